"""A plain synchronous client, independent of ours: one pyzmq DEALER, no asyncio, no mmsched import.

    .venv/bin/python bench/sync_client.py ADDRESS [--closed 3] [--rate 1000 --open 3]

Why: a target met only with our own load generator is not met (issue 13). It sends
256-token ``embed`` requests, text only, and counts 200 replies:

- closed loop: 256 requests in flight, for ``--closed`` seconds; throughput in req/s;
- open loop: one request every 1/``--rate`` s on a fixed schedule (not waiting for
  replies), for ``--open`` seconds; p50/p99 of send-to-reply in ms, and the share of a
  core the client itself used. It waits in ``poll``, in whole milliseconds (on 2 cores a
  client that spins leaves the server one), so above 1000 req/s the requests due within
  a millisecond go out together, up to ~1 ms late; latency counts from the actual send.

Prints one JSON line; ``run.py`` calls ``closed``/``open_loop`` directly.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import msgpack
import zmq

INPUT_IDS = b"".join(i.to_bytes(4, "little") for i in range(256))  # 256 int32 ids (bin form)


def _socket(address: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    s.connect(address)
    return s


def _header(n: int) -> bytes:
    return msgpack.packb({"v": 1, "type": "embed", "rid": f"s{n}", "input_ids": INPUT_IDS}, use_bin_type=True)


def _ok(frames: list) -> tuple[str, bool]:
    h = msgpack.unpackb(frames[0], raw=False)
    return h.get("rid"), h.get("status") == 200


def closed(address: str, seconds: float, inflight: int = 256) -> dict:
    """Keep ``inflight`` requests outstanding; the rate of 200 replies."""
    s = _socket(address)
    sent = done = bad = 0
    for _ in range(inflight):
        s.send(_header(sent))
        sent += 1
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        if not s.poll(1000):
            break  # nothing for a second: the server is gone or stuck, report what we have
        while True:
            try:
                frames = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            done += 1
            bad += not _ok(frames)[1]
            s.send(_header(sent))
            sent += 1
    elapsed = time.perf_counter() - t0
    _drain(s, sent - done)
    s.close(0)
    return {"rate": (done - bad) / elapsed, "completed": done, "bad": bad, "inflight": inflight}


def open_loop(address: str, rate: float, seconds: float) -> dict:
    """Send on a fixed schedule whatever the replies do; latency percentiles in ms."""
    s = _socket(address)
    n = int(rate * seconds)
    sent_at: dict[str, float] = {}
    lat: list[float] = []
    bad = 0
    t0, cpu = time.perf_counter(), time.process_time()
    i = 0
    while i < n or (sent_at and time.perf_counter() < t0 + seconds + 5):
        due = t0 + i / rate if i < n else t0 + seconds + 5
        # whole milliseconds, rounded up: pyzmq truncates a float timeout, so every wait under
        # 1 ms (all of them at 1000 req/s) was a poll(0) and the client spun a core of its own
        if s.poll(math.ceil(max(0.0, (due - time.perf_counter()) * 1000))):
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                now = time.perf_counter()
                rid, ok = _ok(frames)
                if rid in sent_at:
                    lat.append((now - sent_at.pop(rid)) * 1000)
                bad += not ok
        while i < n and time.perf_counter() >= t0 + i / rate:
            sent_at[f"s{i}"] = time.perf_counter()
            s.send(_header(i))
            i += 1
    cores = (time.process_time() - cpu) / (time.perf_counter() - t0)  # this client's own share of the host
    s.close(0)
    lat.sort()
    pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None)
    return {"rate": rate, "sent": n, "completed": len(lat), "bad": bad, "lost": len(sent_at),
            "p50_ms": pct(0.50), "p99_ms": pct(0.99), "client_cores": cores}


def _drain(s: zmq.Socket, outstanding: int, timeout_s: float = 5.0) -> None:
    """Read the replies still in flight, so the next run does not see them."""
    end = time.monotonic() + timeout_s
    while outstanding > 0 and time.monotonic() < end and s.poll(200):
        try:
            s.recv_multipart(zmq.NOBLOCK)
            outstanding -= 1
        except zmq.Again:
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("address")
    p.add_argument("--closed", type=float, default=3.0, help="closed-loop seconds (0: skip)")
    p.add_argument("--rate", type=float, default=1000.0, help="open-loop rate, req/s")
    p.add_argument("--open", type=float, default=3.0, help="open-loop seconds (0: skip)")
    args = p.parse_args(argv)
    out = {}
    if args.closed:
        out["closed"] = closed(args.address, args.closed)
    if args.open:
        out["open"] = open_loop(args.address, args.rate, args.open)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
