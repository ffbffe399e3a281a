"""The ceiling for throughput: a bare ZeroMQ ROUTER that decodes each msgpack request and answers it.

    .venv/bin/python bench/bare_router.py ipc:///tmp/bare.sock [--max-seconds 600]

What any server of the contract must do at the least, and nothing more: receive in
batches (poll, then drain without blocking), unpack each header, unlink the non-pooled
shm segments a request hands over (ownership passes with the request), and send one
result of the same shape as mmsched's (an ``embed`` reply carries a 256-float embedding;
``generate`` the requested number of ids). No validation, no materializing, no ranks. A
ping gets a pong, so the load generator talks to it as to mmsched. Prints ``ready`` once
bound; stops on SIGTERM/SIGINT or after ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import msgpack
import zmq

EMBEDDING = bytes(256 * 4)  # the reference engine's HIDDEN=256 float32


def serve(address: str, max_seconds: float, shm_prefix: str = "mmsched_") -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.bind(address)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    pack, unpack = msgpack.Packer(use_bin_type=True).pack, msgpack.unpackb
    print("ready", flush=True)
    deadline = time.monotonic() + max_seconds
    answered = 0
    while not stop and time.monotonic() < deadline:
        if not poller.poll(200):
            continue
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            client, h = frames[0].bytes, unpack(frames[1].buffer, raw=False)
            kind = h.get("type")
            if kind == "ping":
                sock.send_multipart([client, pack({"v": 1, "type": "pong", "ranks": 1, "healthy": True})])
                continue
            if kind not in ("embed", "generate"):
                continue
            for it in h.get("mm_items") or ():
                name = it.get("shm_name")
                if it.get("transport") == "shm" and not it.get("pooled") and name and name.startswith(shm_prefix):
                    try:
                        os.unlink("/dev/shm/" + name)
                    except FileNotFoundError:
                        pass
            if kind == "embed":
                output = {"embedding": EMBEDDING, "dim": 256}
            else:
                output = {"output_ids": [0] * int((h.get("params") or {}).get("max_new_tokens", 8))}
            sock.send_multipart([client, pack({"v": 1, "type": "result", "rid": h.get("rid"), "status": 200,
                                               "err_type": None, "message": None, "output": output,
                                               "meta": {"ranks": 1}})])
            answered += 1
    sock.close(0)
    ctx.term()
    if address.startswith("ipc://"):  # libzmq leaves the socket file behind
        try:
            os.unlink(address[len("ipc://"):])
        except FileNotFoundError:
            pass
    print(f"answered {answered}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("address")
    p.add_argument("--max-seconds", type=float, default=600.0, help="stop by itself after this long (600)")
    p.add_argument("--shm-prefix", default="mmsched_")
    args = p.parse_args(argv)
    return serve(args.address, args.max_seconds, args.shm_prefix)


if __name__ == "__main__":
    sys.exit(main())
