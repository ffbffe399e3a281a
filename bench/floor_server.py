"""The floor under mmsched's tp=2 latency: the least any two-rank Python server pays a batch.

    .venv/bin/python bench/floor_server.py --frontend ipc:///tmp/floor.sock   # serves until killed

Why: the tp=2 latency targets are absolute (p50 <= 2 ms at half the maximum rate), and on a
small shared host the host decides much of them. This server does only what every tp=2
batch of mmsched must: rank 0 drains a ROUTER without blocking (a batch), a second thread
runs one gloo all-gather with rank 1 (the agreement each batch pays), and rank 0 answers
each request 200 with its rid. (Since session 59 mmsched's ranks on one host make that
all-gather through shared memory, ``mmsched.exchange``, cheaper than gloo's: this floor
keeps gloo's, as a ranks-on-two-hosts group still pays it.) Its ranks run as mmsched's do (``server.place_process``:
one CPU each, one torch thread, the same GIL switch interval and time slice; gloo's TCP
loop threads lowered). No
validation, no admission, no ring, no engine: mmsched's p50 beside this server's at the
same rate (``make bench`` prints both) says how much of it is ours and how much the
host's. It answers anything, a ping included; rank 1 starts as a child of rank 0 and
ends when the group breaks.

As a model (not in ``make bench``): ``--loop-us``, ``--lane-us`` and ``--follower-us``
make each request cost that much CPU (a spin, holding the GIL as Python work does) on rank
0's loop as it is received, on its lane before the all-gather, and on rank 1 after it: a
server of mmsched's shape with mmsched's per-request CPU, without mmsched's code
(docs/performance.md, session 50).
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import socket
import subprocess
import sys
import threading
import time

import msgpack
import torch
import torch.distributed as dist
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmsched import timeslice  # noqa: E402
from mmsched.config import Config  # noqa: E402
from mmsched.server import place_gloo, place_process  # noqa: E402

MAX_BATCH = 256
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


def _join(rank: int, port: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run as a mmsched rank runs (``place_process``: CPU share, torch threads, GIL switch
    interval, slice), make the group, lower its loop threads; this rank's flags buffer and
    the gathered one."""
    cfg = Config()
    place_process(cfg, 2, {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"})
    before = timeslice.thread_ids()
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=30))
    place_gloo(cfg, before)
    return torch.zeros(1 + MAX_BATCH, dtype=torch.int32), torch.zeros(2 * (1 + MAX_BATCH), dtype=torch.int32)


def _spin(seconds: float) -> None:
    """CPU work of ``seconds``, holding the GIL (the model's per-request cost)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def follow(port: int, follower_s: float = 0.0) -> None:
    """Rank 1: join every all-gather until the group breaks (rank 0 gone)."""
    flags, out = _join(1, port)
    try:
        while True:
            _gather(out, flags)
            _spin(follower_s * int(out[0]))
    except Exception:  # noqa: BLE001 - the leader is gone: so is the group
        os._exit(0)


def lead(address: str, port: int, loop_s: float = 0.0, lane_s: float = 0.0) -> None:
    """Rank 0: the ROUTER and its batches, on the main thread; the all-gather on a lane thread."""
    flags, out = _join(0, port)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(address)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    bell = os.eventfd(0, os.EFD_NONBLOCK)
    done: list = []

    def lane() -> None:
        while True:
            batch = todo.get()
            _spin(lane_s * len(batch))
            flags[0] = len(batch)
            _gather(out, flags)
            done.append(batch)
            os.eventfd_write(bell, 1)

    threading.Thread(target=lane, daemon=True).start()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(bell, zmq.POLLIN)
    pending: list = []
    running = False

    while True:
        ready = dict(poller.poll())
        if bell in ready:
            try:
                os.eventfd_read(bell)
            except BlockingIOError:
                pass
            finished = []
            while done:
                finished += done.pop(0)
            running = False
            if pending:  # the next batch first, then the answers (as mmsched's leader)
                running = True
                todo.put(pending[:MAX_BATCH])
                del pending[:MAX_BATCH]
            for client, rid in finished:
                sock.send_multipart([client, msgpack.packb({"v": 1, "type": "result", "rid": rid, "status": 200,
                                                            "output": {}})])
        while len(pending) < MAX_BATCH:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            header = msgpack.unpackb(frames[1], raw=False) if len(frames) > 1 else {}
            pending.append((frames[0], header.get("rid") if isinstance(header, dict) else None))
            _spin(loop_s)
        if pending and not running:  # one batch at a time, as mmsched's lane
            running = True
            todo.put(pending[:MAX_BATCH])
            del pending[:MAX_BATCH]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frontend", required=True, help="the ROUTER's address (ipc:// or tcp://127.0.0.1)")
    for who in ("loop", "lane", "follower"):
        p.add_argument(f"--{who}-us", type=float, default=0.0, help=f"CPU a request costs on the {who} (model)")
    p.add_argument("--follow", type=int, default=0, help=argparse.SUPPRESS)  # rank 1, started by rank 0
    args = p.parse_args(argv)
    if args.follow:
        follow(args.follow, args.follower_us * 1e-6)
        return 0
    port = _free_port()
    subprocess.Popen([sys.executable, os.path.abspath(__file__), "--frontend", args.frontend, "--follow", str(port),
                      "--follower-us", str(args.follower_us)])
    lead(args.frontend, port, args.loop_us * 1e-6, args.lane_us * 1e-6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
