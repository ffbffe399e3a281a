"""Materialization speed: what a rank pays to own a feature's bytes, against a plain in-process copy.

    .venv/bin/python bench/materialize.py [--sizes 64K,1M,16M,64M] [--budget 0.4]

For each size, GB/s of (median time per operation):

- ``copy``:   ``src.clone()`` of a tensor already in this process (the ceiling);
- ``fresh``:  a segment made by a client just before (not timed), then ``ShmFeature``
  open + materialize + release with unlink, as the leader does for a non-pooled item;
- ``pooled``: a slice of a client's ``ShmPool`` through ``PooledFeature`` with a warm
  ``PoolCache`` (the pool mapped once, as on a rank that has served it before);
- ``memfd``: a slice of a client's sealed ``MemfdPool`` through ``MemfdFeature`` with a
  warm ``MemfdCache`` (the pool mapped once; a numpy copy out of the mapping, safe
  because the seals forbid shrinking: the ``memfd`` transport, an extension);
- ``mapped``: for reference only, a numpy copy out of a mapping of the pool kept open:
  what a pooled read would cost if mmsched copied out of a kept mapping instead of
  ``pread`` (it does not: a pool its owner truncates would SIGBUS the rank).

Every rank process runs with one torch thread; so does this benchmark.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmsched.faults import Faults  # noqa: E402
from mmsched.protocol import Item  # noqa: E402
from mmsched.producers import MemfdPool, ShmPool, create_segment  # noqa: E402
from mmsched.segments import shm_path  # noqa: E402
from mmsched.transport.memfd import MemfdCache, MemfdFeature  # noqa: E402
from mmsched.transport.shm import ShmFeature  # noqa: E402
from mmsched.transport.shm_pool import PoolCache, PooledFeature  # noqa: E402

NO_FAULTS = Faults([], 0)
PREFIX = "mmbench_"


def _item(name: str, nbytes: int, offset: int = 0, pooled: bool = False) -> Item:
    return Item(index=0, modality="image", transport="shm", dtype="uint8", shape=(nbytes,), nbytes=nbytes,
                shm_name=name, offset=offset, pooled=pooled)


def _time(op, budget: float, setup=None, min_reps: int = 5, max_reps: int = 2000) -> float:
    """Median seconds of ``op()`` (``setup()`` before each, untimed), within about ``budget`` seconds."""
    times: list[float] = []
    end = time.perf_counter() + budget
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < end):
        arg = setup() if setup is not None else None
        t0 = time.perf_counter()
        op(arg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(nbytes: int, budget: float = 0.4) -> dict:
    src = torch.from_numpy(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    row = {"bytes": nbytes}

    # ceiling: an in-process copy into fresh memory
    row["copy_s"] = _time(lambda _: src.clone(), budget)

    # fresh segment: open + materialize + release (unlink), the segment made just before
    def make(_=None):
        seg = create_segment(src, PREFIX)
        seg.sent()
        return seg.name

    def fresh(name):
        f = ShmFeature(_item(name, nbytes), "bench", NO_FAULTS)
        t = f.materialize()
        f.release(unlink=True)
        return t

    row["fresh_s"] = _time(fresh, budget, setup=make, max_reps=400)

    # pooled: a slice of a long-lived pool, the pool mapped once (warm cache)
    pool = ShmPool(nbytes + 64, PREFIX)
    cache = PoolCache()
    try:
        off = pool.put(src)
        row["pooled_s"] = _time_warm(PooledFeature, _item(pool.name, nbytes, off, pooled=True), cache, src, budget)
        # reference only (mmsched does not do this): a copy out of a mapping kept open
        fd = os.open(shm_path(pool.name), os.O_RDONLY)
        mm = mmap.mmap(fd, pool.size, prot=mmap.PROT_READ)
        view = np.frombuffer(mm, dtype=np.uint8)

        def copy_mapped(_):
            raw = torch.empty(nbytes, dtype=torch.uint8)
            raw.numpy()[:] = view[off: off + nbytes]
            return raw

        try:
            assert torch.equal(copy_mapped(None), src)
            row["mapped_s"] = _time(copy_mapped, budget)
        finally:
            view = None  # drop the export before closing the mapping
            mm.close()
            os.close(fd)
    finally:
        cache.clear()
        pool.close()
    row["memfd_s"] = _memfd(src, budget)
    for k in ("copy", "fresh", "pooled", "memfd", "mapped"):
        row[f"{k}_gbps"] = nbytes / row[f"{k}_s"] / 1e9
        if k != "copy":
            row[f"{k}_ratio"] = row["copy_s"] / row[f"{k}_s"]
    return row


def _memfd(src: torch.Tensor, budget: float) -> float:
    """Median seconds of a slice of a sealed memfd pool read through a warm ``MemfdCache``."""
    pool, cache = MemfdPool(src.numel() + 64, PREFIX), MemfdCache()
    try:
        item = Item(index=0, modality="image", transport="memfd", dtype="uint8", shape=(src.numel(),),
                    nbytes=src.numel(), offset=pool.put(src),
                    memfd={"pid": os.getpid(), "fd": pool.fd, "inode": pool.inode})
        return _time_warm(MemfdFeature, item, cache, src, budget)
    finally:
        cache.clear()
        pool.close()


def _time_warm(kind, item: Item, cache, src: torch.Tensor, budget: float) -> float:
    """Median seconds of a ``kind`` feature (pooled shm, memfd) read through a warm ``cache``."""
    def read(_):
        f = kind(item, "bench", NO_FAULTS, cache)
        t = f.materialize()
        f.release(unlink=True)
        return t

    assert torch.equal(read(None), src)  # warm: map it once, and check the bytes
    return _time(read, budget)


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
