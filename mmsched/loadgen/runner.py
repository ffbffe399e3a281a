"""``run(spec)``: one bounded load run, from the first pong to the report with its segment count."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

from ..client import Client
from ..devices import CudaDevice, ShmDevice
from ..producers import IpcPool, MemfdPool, ShmPool
from ..segments import SHM_DIR
from .loop import Run
from .records import summarize
from .report import Report
from .spec import LoadSpec


async def run(spec: LoadSpec, client: Client | None = None) -> Report:
    """Run the load described by ``spec`` against ``spec.frontend``; always returns, bounded in time."""
    spec.validate()
    if spec.rate is None and spec.concurrency is None:
        spec.concurrency = 16
    before = list_segments(spec.shm_prefix)
    notes: list[str] = []
    fallbacks = _FallbackCounter()
    logging.getLogger("mmsched.client").addFilter(fallbacks)
    own = client is None
    client = client or Client(spec.frontend, shm_prefix=spec.shm_prefix)
    r = Run(spec, client, random.Random(spec.seed))
    pools: list = []
    elapsed = 0.0
    try:
        if own:
            await client.__aenter__()
        ranks = await _first_pong(spec, client, r)
        if ranks is not None:
            _open_pools(spec, client, ranks, pools)
            elapsed = await _send_phase(spec, r, notes)
            await _wind_up(r, notes)
    finally:
        if own:
            await client.close()
        for pool in pools:
            pool.close()
        logging.getLogger("mmsched.client").removeFilter(fallbacks)
        if fallbacks.count:
            notes.append(f"note: {fallbacks.count} feature(s) fell back from their pool to a fresh segment "
                         + ("(pool full: requests given up after a reconnect keep their slices)" if r.given_up
                            else "(pool full: raise --pool-mb)"))
    return _report(spec, r, elapsed, before, notes)


async def _first_pong(spec: LoadSpec, client: Client, r: Run) -> int | None:
    """The group's size from a pong, or None (and why, in ``r.stopped_by``): nothing is sent."""
    wait_s = min(2.0, max(0.5, spec.drain_s))
    try:
        return int((await client.ping(timeout=wait_s)).get("ranks", 1))
    except asyncio.TimeoutError:
        r.stopped_by = (f"no pong from {spec.frontend} within {wait_s:g} s: is the server up? (make serve; "
                        "or at its connection bound: connections_full in its log)")
        return None


def _open_pools(spec: LoadSpec, client: Client, ranks: int, pools: list) -> None:
    """The client's pools for the pooled and cuda_ipc transports, sized for what will be in flight."""
    biggest = max(spec.item_bytes) if spec.items else 0
    if {"pooled", "memfd"} & set(spec.transports) and spec.items:
        size = spec.pool_bytes or min(1 << 30, max(16 << 20, 2 * spec.in_flight * spec.items * _aligned(biggest)))
        client.shm_pool = (MemfdPool if "memfd" in spec.transports else ShmPool)(size, spec.shm_prefix)
        pools.append(client.shm_pool)
    if "cuda_ipc" in spec.transports and spec.items:
        device = CudaDevice() if torch.cuda.is_available() else ShmDevice()
        slots = min(4096, 2 * spec.in_flight * spec.items)
        client.ipc_pool = IpcPool(device, slots, biggest, max(ranks, 1), spec.shm_prefix)
        pools.append(client.ipc_pool)


async def _send_phase(spec: LoadSpec, r: Run, notes: list[str]) -> float:
    """The loop, then at most ``drain_s`` for the results outstanding; returns the run's elapsed seconds."""
    progress = asyncio.ensure_future(_progress(r)) if spec.progress else None
    r.start_watching()
    watch = asyncio.gather(r.watch(), r.watch_connection())
    r.t0 = time.perf_counter()
    r.send_until = r.t0 + spec.duration
    try:
        await (r.closed_loop() if spec.concurrency is not None else r.open_loop())
        sent_at = time.perf_counter()
        try:
            await asyncio.wait_for(r.all_done.wait(), spec.drain_s)
        except asyncio.TimeoutError:
            notes.append(f"note: {r.outstanding} result(s) still missing {spec.drain_s:g} s after the send "
                         "phase: counted as lost")
        last = np.nanmax(np.asarray(r.rec.t_recv)) if len(r.rec) and r.outstanding < len(r.rec) else None
        return float(last) if last is not None else sent_at - r.t0
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        if progress is not None:
            progress.cancel()
            await asyncio.gather(progress, return_exceptions=True)
            _clear_progress()


async def _wind_up(r: Run, notes: list[str]) -> None:
    """Stop waiting for the lost, close the sessions, let the aborts and closes finish."""
    for fut in list(r.futs.values()):
        fut.cancel()
    r.close_sessions()
    if r.tasks:
        await asyncio.gather(*r.tasks, return_exceptions=True)
    notes.extend(f"error: {e}" for e in r.errors[:5])
    if r.given_up:
        notes.append(f"note: {len(r.given_up)} request(s) sent before the connection was replaced got no "
                     f"reply within {r.give_up_s:g} s of it: counted as lost"
                     + (" (their pool slices stay taken)" if {"pooled", "memfd"} & set(r.spec.transports)
                        and r.spec.items else ""))
    if r.closing:
        done = await asyncio.gather(*r.closing, return_exceptions=True)
        bad = sum(isinstance(d, BaseException) for d in done)
        if bad:
            notes.append(f"note: {bad} close_session call(s) got no ack")


def _report(spec: LoadSpec, r: Run, elapsed: float, before: set[str], notes: list[str]) -> Report:
    leaked = _leaked(before, spec.shm_prefix)
    after = list_segments(spec.shm_prefix)
    segments = {"before": len(before), "after": len(after), "leaked": leaked,
                "others_appeared": len(after - before) - len(leaked)}
    spec_d = asdict(spec)
    spec_d["transports"] = list(spec.transports)
    return Report(spec_d, summarize(r.rec, elapsed), r.rec, segments, notes, error=r.stopped_by)


def run_sync(spec: LoadSpec) -> Report:
    """``run`` on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(run(spec))
    return uvloop.run(run(spec))


def _aligned(n: int) -> int:
    return max(64, -(-n // 64) * 64)


def list_segments(prefix: str) -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except OSError:
        return set()


def _leaked(before: set[str], prefix: str, wait_s: float = 1.0) -> list[str]:
    """Segments this process created that are still there (after a short grace for the last unlinks)."""
    mine = f"{prefix}{os.getpid()}_"
    deadline = time.monotonic() + wait_s
    while True:
        left = sorted(n for n in list_segments(prefix) - before if n.startswith(mine))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


class _FallbackCounter(logging.Filter):
    """Counts (and silences) the client's per-request pool-full warnings."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(("shm_pool_full", "ipc_pool_full")):
            self.count += 1
            return False
        return True


async def _progress(r: Run) -> None:
    spec = r.spec
    while True:
        await asyncio.sleep(0.2)
        el = time.perf_counter() - r.t0
        frac = min(1.0, max(len(r.rec) / (spec.requests or math.inf), el / spec.duration))
        done = len(r.rec) - r.outstanding
        bar = "#" * int(frac * 30)
        line = (f"[{bar:<30}] sent {len(r.rec)}{f'/{spec.requests}' if spec.requests else ''} done {done} in flight {r.outstanding} "
                f"{done / el if el else 0:.0f} req/s {el:.1f}s")
        sys.stderr.write("\r" + line + "\x1b[K")
        sys.stderr.flush()


def _clear_progress() -> None:
    sys.stderr.write("\r\x1b[K")
    sys.stderr.flush()
