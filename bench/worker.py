"""End to end through the tokenizer worker: HTTP requests/s, latency, and where the time goes.

    .venv/bin/python bench/worker.py [--tp 1] [--requests 200] [--concurrency 8] [--max-tokens 8]

Starts ``mmsched serve --engine mmsched.engines.hf:HFEngine`` and ``mmsched worker`` on
private addresses, sends chat completions with one PNG each (closed loop), and splits
each request's time three ways from the worker's headers: the worker itself (HTTP, JSON,
tokenizer, image processor, decoding) = total − X-Mmsched-Seconds; mmsched (queue,
batch broadcast, materialize, agreement, results) = X-Mmsched-Seconds − X-Engine-Seconds;
the engine = X-Engine-Seconds (the whole engine step of the request's batch: batch-mates
run one after another, so that wait is the engine's, not mmsched's). Prints one
JSON row. Needs mmsched[hf]. A machine under other load measures that load.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

PREFIX = "mmbench_"  # its own segments: the server's sweep never touches another run's
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body(max_tokens: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return json.dumps({"max_tokens": max_tokens, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in the picture?"}, {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


async def drive(port: int, n: int, concurrency: int, payload: bytes) -> tuple[list[tuple[float, float, float]], float]:
    import aiohttp

    rows: list[tuple[float, float, float]] = []
    todo = iter(range(n))
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def one(session) -> None:
        for _ in todo:
            t0 = time.perf_counter()
            async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
                rows.append((time.perf_counter() - t0, float(resp.headers["X-Mmsched-Seconds"]),
                             float(resp.headers["X-Engine-Seconds"])))

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session) for _ in range(3)))  # warm-up: not counted
        rows.clear()
        todo = iter(range(n))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session) for _ in range(concurrency)))
        return rows, time.perf_counter() - t0


def wait_http(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the worker exited")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3).status == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("the worker never became healthy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    addr, port = f"ipc:///tmp/mmbench-worker-{uuid.uuid4().hex[:8]}.sock", free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMSCHED_")}
    log = tempfile.TemporaryFile()
    procs = [subprocess.Popen([sys.executable, "-m", "mmsched", "serve", "--frontend", addr, "--tp", str(args.tp),
                               "--engine", "mmsched.engines.hf:HFEngine", "--shm-prefix", PREFIX], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True),
             subprocess.Popen([sys.executable, "-m", "mmsched", "worker", "--frontend", addr, "--listen",
                               f"127.0.0.1:{port}", "--shm-prefix", PREFIX], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)]
    try:
        wait_http(port, procs[1])
        rows, wall = asyncio.run(drive(port, args.requests, args.concurrency, body(args.max_tokens)))
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(60)
    total = sum(r[0] for r in rows)
    lat = sorted(r[0] for r in rows)
    print(json.dumps({
        "bench": "worker", "tp": args.tp, "requests": len(rows), "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "requests_per_s": round(len(rows) / wall, 2),
        "latency_ms_p50": round(1000 * statistics.median(lat), 2),
        "latency_ms_p99": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
        "share_worker": round(sum(r[0] - r[1] for r in rows) / total, 3),
        "share_mmsched": round(sum(r[1] - r[2] for r in rows) / total, 3),
        "share_engine": round(sum(r[2] for r in rows) / total, 3),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
