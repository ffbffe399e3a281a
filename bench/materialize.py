"""Materialization speed: what a rank pays to own a feature's bytes, against a plain in-process copy.

    .venv/bin/python bench/materialize.py [--sizes 64K,1M,16M,64M] [--budget 0.4]

For each size, GB/s (median time per operation) of:

- ``copy``:   ``copy_`` of a tensor already in this process into a reused buffer (the ceiling);
- ``fresh``:  a segment made by a client just before (not timed), then opened,
  materialized and released with unlink, as the leader does for a non-pooled item (the
  last close, which frees the pages, on the rank's closer thread, as in the server: what
  the lane pays; it overlaps the next fresh read, not the other approaches);
- ``pooled``: a slice of a client's ``ShmPool`` (a guarded copy out of the rank's kept
  mapping, in two halves at once from 2 MiB: a pool its owner truncates under the copy is
  a failed read, not a SIGBUS; ``pread`` where the guard did not build);
- ``memfd``: a slice of a client's sealed ``MemfdPool`` (a numpy copy out of the mapping,
  in two halves at once from 2 MiB, safe because the seals forbid shrinking: the ``memfd``
  transport, an extension);
- ``mapped``: for reference only, one numpy copy out of a mapping of the pool on one
  thread, with no guard and no ``Transports`` around it.

Features are opened as a rank opens them, through one ``Transports``: its pool caches are
warm (each pool mapped or opened once, as on a rank that has served it before) and big
features land in its reused destination buffers, as the copy does (fresh pages would cost
as much as the copy itself, and glibc gives a clone over 32 MiB fresh ones). The
approaches take turns in ``ROUNDS`` rounds (the host's noise drifts over seconds, so it
falls on all of them); a ratio is the median of the rounds' ratios to the copy. Each
approach's bytes are checked first, read into a buffer that held other bytes.

Every rank process runs with one torch thread; so does this benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmsched.protocol import Item  # noqa: E402
from mmsched.producers import MemfdPool, ShmPool, create_segment  # noqa: E402
from mmsched.segments import shm_path  # noqa: E402
from mmsched.transport import Transports  # noqa: E402

PREFIX = "mmbench_"


def _item(name: str, nbytes: int, offset: int = 0, pooled: bool = False) -> Item:
    return Item(index=0, modality="image", transport="shm", dtype="uint8", shape=(nbytes,), nbytes=nbytes,
                shm_name=name, offset=offset, pooled=pooled)


ROUNDS = 5  # timed rounds per size, every approach in each (a noisy spell falls on all of them)


def _time(op, budget: float, setup=None, min_reps: int = 3, max_reps: int = 2000) -> float:
    """Median seconds of ``op()`` (``setup()`` before each, untimed), within about ``budget`` seconds."""
    times: list[float] = []
    end = time.perf_counter() + budget
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < end):
        arg = setup() if setup is not None else None
        t0 = time.perf_counter()
        op(arg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(nbytes: int, budget: float = 0.4, rounds: int = ROUNDS) -> dict:
    """One row: each approach's median seconds per operation, and its ratio to the copy, the
    median of the rounds' ratios. Features are opened as a rank opens them: through a
    ``Transports`` (its pool caches, warm, and its reused destination buffers); the copy
    lands in a reused buffer too, so every approach writes into memory the process has."""
    src = torch.from_numpy(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    transports = Transports()
    with contextlib.ExitStack() as stack:  # whatever fails, every pool, segment and mapping goes
        stack.callback(transports.clear)
        pool = ShmPool(nbytes + 64, PREFIX)
        stack.callback(pool.close)
        memfd = MemfdPool(nbytes + 64, PREFIX)
        stack.callback(memfd.close)
        pooled_item = _item(pool.name, nbytes, pool.put(src), pooled=True)
        memfd_item = Item(index=0, modality="image", transport="memfd", dtype="uint8", shape=(nbytes,),
                          nbytes=nbytes, offset=memfd.put(src),
                          memfd={"pid": os.getpid(), "fd": memfd.fd, "inode": memfd.inode})
        fd = os.open(shm_path(pool.name), os.O_RDONLY)
        stack.callback(os.close, fd)
        mm = stack.enter_context(mmap.mmap(fd, pool.size, prot=mmap.PROT_READ))
        off = pooled_item.offset

        def read(item):
            f = transports.open(item, "bench")
            try:
                return f.materialize()
            finally:
                f.release(unlink=True)

        def make():  # a fresh segment, as a client makes one per request (not timed)
            seg = create_segment(src, PREFIX)
            seg.sent()
            return _item(seg.name, nbytes)

        def copy(_):  # the ceiling: an in-process copy into a buffer the process already has
            return transports.buffers.take(nbytes).copy_(src)

        def copy_mapped(_):  # reference only: one unguarded copy out of a mapping kept open, one thread
            raw = transports.buffers.take(nbytes)
            view = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=off)
            raw.numpy()[:] = view
            del view  # the mapping can be closed only once no array exports it
            return raw

        approaches = {  # name: (op, setup)
            "copy": (copy, None),
            "fresh": (read, make),
            "pooled": (lambda _: read(pooled_item), None),
            "memfd": (lambda _: read(memfd_item), None),
            "mapped": (copy_mapped, None),
        }
        for name, (op, setup) in approaches.items():  # warm: map each pool once; and check the bytes
            arg = setup() if setup else None
            stale = transports.buffers.take(nbytes)  # the buffer the read will land in (the only
            stale.fill_(0x5A)  # one idle: no result is held) holds other bytes first, so a read
            del stale  # that wrote nothing cannot pass for one that did
            assert torch.equal(op(arg), src), f"{name} read other bytes"
        times: dict[str, list[float]] = {name: [] for name in approaches}
        for _ in range(rounds):
            for name, (op, setup) in approaches.items():
                times[name].append(_time(op, budget / rounds, setup, max_reps=400 if setup else 2000))
                transports.closer.flush()  # the fresh segments' pages, freed on the closer's thread, by now
        reused = transports.buffers.reused
    row = {"bytes": nbytes, "rounds": rounds, "buffers_reused": reused}
    for name, ts in times.items():
        row[f"{name}_s"] = statistics.median(ts)
        row[f"{name}_gbps"] = nbytes / row[f"{name}_s"] / 1e9
        if name != "copy":
            row[f"{name}_ratio"] = statistics.median(c / t for c, t in zip(times["copy"], ts))
    return row


def run(sizes: list[int], budget: float = 0.4) -> list[dict]:
    torch.set_num_threads(1)
    return [measure(n, budget) for n in sizes]


def format_rows(rows: list[dict]) -> str:
    kinds = ("fresh", "pooled", "memfd", "mapped")
    lines = [f"{'size':>8} {'copy GB/s':>10}" + "".join(f" {k + ' GB/s':>12} {'ratio':>6}" for k in kinds)]
    for r in rows:
        lines.append(f"{_size(r['bytes']):>8} {r['copy_gbps']:>10.2f}"
                     + "".join(f" {r[k + '_gbps']:>12.2f} {r[k + '_ratio']:>6.2f}" for k in kinds))
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main(argv: list[str] | None = None) -> int:
    from mmsched.loadgen import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64K,1M,16M,64M")
    p.add_argument("--budget", type=float, default=0.4, help="seconds per cell (0.4)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    rows = run([parse_size(s) for s in args.sizes.split(",")], args.budget)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
