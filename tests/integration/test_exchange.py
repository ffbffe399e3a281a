"""The engine's same-host all-gather (mmsched.exchange) with real processes and a real /dev/shm
segment, then in a real tp=2 group.

What a user would notice if it were wrong:
- a rank reading another rank's rows of the wrong gather (a buffer written again before it
  was read), or of the wrong size: every gather here is compared byte for byte, over
  hundreds of rounds with the ranks out of phase, and gathers longer than a round;
- a peer that stops (SIGSTOP) or dies (SIGKILL) while a rank waits: GroupBroken within
  the deadline (a dead one at the next tick), never a hang;
- ranks that gather different sizes: GroupBroken on each, never rows read past a peer's;
- in a tp=2 group, text-only embeddings bit for bit those of the group gathering through
  gloo (``--no-batch-ring``), a follower stopped in the engine's gather breaking the group
  within ``collective_timeout``, and nothing left in /dev/shm.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import random
import re
import signal
import time

import numpy as np
import pytest

from mmsched import exchange as exmod
from mmsched.client import Client
from mmsched.errors import GroupBroken
from mmsched.exchange import CHUNK, Exchange
from mmsched.ring import reserve
from mmsched.segments import shm_path

from .lifecycle import assert_group_broke, while_stopped
from .test_group import private_server  # noqa: F401 - the fixture: a group this test breaks

PREFIX = "mmsched_"
CTX = mp.get_context("fork")  # pure numpy ranks: no torch state to re-import
SIZES = [0, 1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


def _payload(rank: int, i: int, n: int) -> np.ndarray:
    return np.random.default_rng([rank, i]).integers(0, 256, size=n, dtype=np.uint8)


def _segment(world: int) -> tuple[str, int]:
    name = f"{PREFIX}{os.getpid()}_gather_test{time.monotonic_ns() % 10**9}"
    return name, reserve(name, exmod.segment_bytes(world), lambda fd: fd)


def _open(name: str, rank: int, world: int, timeout_s: float) -> Exchange:
    fd = os.open(shm_path(name), os.O_RDWR)
    try:
        return Exchange(fd, rank, world, timeout_s)
    finally:
        os.close(fd)


def _rank(name: str, rank: int, world: int, sizes: list[int], out) -> None:
    """A rank gathering ``sizes`` in order, pausing at random (its peers run ahead), sending
    a digest of each gather to the parent."""
    ex = _open(name, rank, world, timeout_s=20)
    rnd = random.Random(rank)
    for i, n in enumerate(sizes):
        if rnd.random() < 0.1:
            time.sleep(rnd.random() * 0.005)
        got = ex.all_gather(_payload(rank, i, n))
        out.send(hashlib.sha256(got.tobytes()).hexdigest() if got.shape == (world, n) else f"shape {got.shape}")
    ex.close()


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_reads_every_gather_byte_for_byte(world):
    rnd = random.Random(world)
    sizes = SIZES + [rnd.choice([rnd.randrange(0, 4096), rnd.randrange(0, 3 * CHUNK)]) for _ in range(300)]
    want = [hashlib.sha256(np.stack([_payload(r, i, n) for r in range(world)]).tobytes()).hexdigest()
            for i, n in enumerate(sizes)]
    name, fd = _segment(world)
    pipes = [CTX.Pipe(duplex=False) for _ in range(world)]
    procs = [CTX.Process(target=_rank, args=(name, r, world, sizes, pipes[r][1])) for r in range(world)]
    try:
        for p in procs:
            p.start()
        for r in range(world):
            got = [pipes[r][0].recv() if pipes[r][0].poll(60) else "nothing" for _ in sizes]
            assert got == want, f"rank {r}: first wrong gather {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
        for p in procs:
            p.join(20)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        os.close(fd)
        os.unlink(shm_path(name))


def _gathers_then(name: str, then: str) -> None:
    """Rank 1: one gather with rank 0, then stop itself or die before the second."""
    ex = _open(name, 1, 2, timeout_s=20)
    ex.all_gather(_payload(1, 0, 100))
    os.kill(os.getpid(), signal.SIGSTOP if then == "stop" else signal.SIGKILL)


@pytest.mark.parametrize("then", ["stop", "die"])
def test_a_peer_that_stops_or_dies_breaks_the_gather(then):
    name, fd = _segment(2)
    p = CTX.Process(target=_gathers_then, args=(name, then))
    try:
        ex = _open(name, 0, 2, timeout_s=1.5)
        p.start()
        ex.peers = [os.getpid(), p.pid]
        first = ex.all_gather(_payload(0, 0, 100))
        assert (first[1] == _payload(1, 0, 100)).all()
        if then == "die":
            p.join(10)
        t0 = time.monotonic()
        why = r"rank 1 did not gather within 1.5 s" if then == "stop" else r"rank 1 is gone"
        with pytest.raises(GroupBroken, match=why):
            ex.all_gather(_payload(0, 1, 100))
        took = time.monotonic() - t0
        assert (1.4 < took < 4.0) if then == "stop" else took < 1.0, took  # a death: at the next tick
        ex.close()
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
        os.close(fd)
        os.unlink(shm_path(name))


def _gathers(name: str, n: int, out) -> None:
    ex = _open(name, 1, 2, timeout_s=5)
    try:
        ex.all_gather(_payload(1, 0, n))
        out.send("gathered")
    except GroupBroken as exc:
        out.send(str(exc))


def test_ranks_gathering_different_sizes_break_on_each_rank():
    name, fd = _segment(2)
    got, out = CTX.Pipe(duplex=False)
    p = CTX.Process(target=_gathers, args=(name, 40, out))
    try:
        ex = _open(name, 0, 2, timeout_s=5)
        p.start()
        with pytest.raises(GroupBroken, match="rank 1 gathered 40 bytes where rank 0 gathered 30"):
            ex.all_gather(_payload(0, 0, 30))
        assert got.poll(10) and re.search("rank 0 gathered 30 bytes where rank 1 gathered 40", got.recv())
        p.join(10)
        ex.close()
    finally:
        if p.is_alive():
            p.kill()
        os.close(fd)
        os.unlink(shm_path(name))


# ---------------------------------------------------------------- in a real tp=2 group

async def _embeddings(addr: str, count: int) -> list:
    async with Client(addr) as c:
        rs = await asyncio.gather(*(c.request("embed", list(range(i, i + 1 + i % 300)), rid=f"e{i}", timeout=60)
                                    for i in range(count)))
    assert [r.status for r in rs] == [200] * count, [r for r in rs if r.status != 200][:3]
    return [r.output["embedding"] for r in rs]


async def test_the_group_gathers_the_bits_gloo_gathers_then_a_stopped_follower_breaks_it(private_server):
    timeout = 4.0
    through_gloo = private_server("--tp", "2", "--no-batch-ring")
    want = await _embeddings(through_gloo.addr, 200)
    through_gloo.kill_all()
    srv = private_server("--tp", "2", "--collective-timeout", str(timeout))
    pids = srv.rank_pids()
    # unlinked once every rank mapped it: a kill -9 from now on leaves nothing
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{PREFIX}{pids[0]}_gather_")]
    assert await _embeddings(srv.addr, 200) == want
    async with Client(srv.addr) as c:
        r, took = await while_stopped(pids[1], c.request("embed", [1, 2, 3], rid="stalled", timeout=timeout + 10))
    assert_group_broke(srv, pids, r, took, timeout, r"engine gather: rank 1 did not gather|deadline")
