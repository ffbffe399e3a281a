"""Helpers shared by the lifecycle tests (sessions, aborts, cuda_ipc, sweep, soak).

Kept out of conftest.py on purpose: plain functions, imported where used.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import signal
import time

import torch

from mmsched.client import Client, Result

from ..conftest import pid_alive


SHM_DIR = "/dev/shm"


def my_segments(prefix: str = "mmsched_") -> set[str]:
    """Segments this test process created (``create_segment`` names carry the creator's pid)."""
    mine = f"{prefix}{os.getpid()}_"
    return {n for n in os.listdir(SHM_DIR) if n.startswith(mine)}


def sha256_of(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def feature(seed: int, shape=(8, 32), dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def replace_segment(name: str, data: bytes) -> None:
    """A segment under ``name`` holding ``data``; one that exists is replaced, as an owner
    re-creating its pool does (unlinked, then created anew: a new inode)."""
    path = os.path.join(SHM_DIR, name)
    if os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def wait_until(cond, timeout: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(step)


async def until(predicate, what: str, timeout: float = 15.0, every: float = 0.02):
    """``wait_until`` inside a coroutine: the loop runs on while it waits."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(every)


async def while_stopped(pid: int, request) -> tuple[Result, float]:
    """``request`` (a coroutine, not yet awaited) run while process ``pid`` is stopped
    (SIGSTOP; SIGCONT whatever happens): its result and the seconds it took."""
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = await request
        return r, time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)


def assert_group_broke(srv, pids: list[int], r: Result, took: float, timeout: float, why: str) -> None:
    """What a request held by a stopped rank must end in: a 500 ``rank group broken`` within the
    collective deadline (+3 s), ``group_broken`` logged for a reason matching ``why``, the group
    exiting non-zero and every rank process gone."""
    assert r.status == 500 and "broken" in r.message, r
    assert took < timeout + 3, took
    assert re.search(rf"group_broken.*({why})", srv.logs()), srv.logs()[-3000:]
    assert srv.proc.wait(timeout=timeout + 10) != 0
    wait_until(lambda: not any(pid_alive(p) for p in pids), 10, "every rank process exits")


async def no_extra_results(c: Client) -> None:
    """Every reply travels one pipe in order: once the pong is here, a second result for
    a request already answered would have arrived (and be in ``unrouted``)."""
    await c.ping(timeout=20)
    assert c.unrouted == [], [(r.rid, r.status, r.message) for r in c.unrouted]


async def hold_lane(c: Client, rid: str, settle: float = 0.5) -> asyncio.Future:
    """Send ``rid`` (which the server stalls on a rank) and give the leader time to put it on
    the lane: what is sent next waits at the leader, in the queue, until it finishes."""
    fut = c.send_request("embed", [7], [], rid=rid)
    await asyncio.sleep(settle)
    assert not fut.done(), "the lane-holding request finished before the test could queue behind it"
    return fut




def expect(r: Result, status: int, *, err_type: str | None = None) -> Result:
    assert r.status == status, (r.rid, r.status, r.message, r.meta)
    if err_type is not None:
        assert r.err_type == err_type, r
    return r


@contextlib.contextmanager
def captured(logger: str = "mmsched.client", level: int = logging.WARNING):
    """The messages ``logger`` emits inside the block, whatever its propagation is set to."""
    messages: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    lg, handler = logging.getLogger(logger), _Keep(level)
    old_level = lg.level
    lg.addHandler(handler)
    if lg.getEffectiveLevel() > level:
        lg.setLevel(level)
    try:
        yield messages
    finally:
        lg.removeHandler(handler)
        lg.setLevel(old_level)
