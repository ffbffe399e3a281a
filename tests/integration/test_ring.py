"""The same-host batch ring (mmsched.ring) with real processes and real /dev/shm segments,
then in a real tp=2 group.

What a user would notice if it were wrong:
- a message bigger than the whole ring arrives byte for byte (the overflow path);
- a reader that stalls (SIGSTOP) or dies (SIGKILL) while the leader waits for a slot ends
  in GroupBroken within the deadline, not a hang; a reader whose leader died ends too;
- a leader killed before it unlinked the ring leaves a segment the orphan sweep reclaims
  (and a live leader's ring is locked: the sweep leaves it alone);
- in a tp=2 group, a 1 MiB inline batch (twice the ring) reaches the follower with the
  client's bytes, and a stopped follower breaks the group within ``collective_timeout``.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import re
import signal
import time

import pytest
import torch

from mmsched import ring as ringmod
from mmsched.client import Client, inline
from mmsched.errors import GroupBroken
from mmsched.ring import Ring
from mmsched.sweep import sweep

from .lifecycle import assert_group_broke, feature, sha256_of, wait_until, while_stopped
from .test_group import private_server  # noqa: F401 - the fixture: a group this test breaks

PREFIX = "mmsched_"
BIG = 2 * ringmod.SLOTS * ringmod.SLOT_BYTES + 12345  # spans the ring twice over
CTX = mp.get_context("fork")  # pure-Python readers: no torch state to re-import


MINE = f"{PREFIX}{os.getpid()}_ring_test"  # what these tests sweep: their own rings, never another run's segments


def _name() -> str:
    return f"{MINE}{time.monotonic_ns() % 10**9}"


def _reader(name: str, readers: int, index: int, count: int, out, stop_after: int | None = None) -> None:
    r = Ring.attach(name, readers, index, timeout_s=10)
    for i in range(count):
        if stop_after is not None and i == stop_after:
            os.kill(os.getpid(), signal.SIGSTOP)
        out.send(hashlib.sha256(r.read()).hexdigest())  # a pipe: sent before the reader stops itself
    r.close()


def _get(conn, timeout: float = 20.0) -> str:
    assert conn.poll(timeout), "the reader sent nothing"
    return conn.recv()


def _messages() -> list[bytes]:
    return [b"x", os.urandom(BIG), os.urandom(ringmod.PAYLOAD), os.urandom(ringmod.PAYLOAD + 1), b"end"]


def test_messages_of_any_size_arrive_byte_for_byte_to_every_reader():
    name, msgs = _name(), _messages()
    w = Ring.create(name, readers=2, timeout_s=10)
    pipes = [CTX.Pipe(duplex=False) for _ in range(2)]
    procs = [CTX.Process(target=_reader, args=(name, 2, i, len(msgs), pipes[i][1])) for i in range(2)]
    try:
        for p in procs:
            p.start()
        w.peers = [p.pid for p in procs]
        time.sleep(0.5)  # both mapped (a reader attaching late would miss nothing: it reads from 0)
        w.unlink()
        for m in msgs:
            w.write(m)
        want = [hashlib.sha256(m).hexdigest() for m in msgs]
        for got, _ in pipes:
            assert [_get(got) for _ in msgs] == want
    finally:
        w.close()
        for p in procs:
            p.join(10)
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("how", ["stall", "die"])
def test_leader_waiting_on_a_stalled_or_dead_reader_breaks_within_the_deadline(how):
    name, (got, out) = _name(), CTX.Pipe(duplex=False)
    w = Ring.create(name, readers=1, timeout_s=2.0)
    p = CTX.Process(target=_reader, args=(name, 1, 0, 3, out, 1))  # reads one message, then stops
    try:
        p.start()
        w.peers = [p.pid]
        w.write(b"first")
        assert _get(got) == hashlib.sha256(b"first").hexdigest()
        wait_until(lambda: _stopped(p.pid), 10, "the reader stops itself")
        if how == "die":
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
        t0 = time.monotonic()
        with pytest.raises(GroupBroken, match="ring reader 0"):
            w.write(os.urandom(BIG))  # more than the ring holds: the leader must wait for the reader
        waited = time.monotonic() - t0
        assert waited < 2.0 + 1.0, waited
        if how == "die":
            assert waited < 1.0, waited  # a dead reader is seen at the next tick, not at the deadline
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
        w.close()


def test_a_reader_whose_leader_died_breaks():
    name = _name()
    ready = CTX.Event()

    def leader():
        Ring.create(name, readers=1, timeout_s=30)
        ready.set()
        time.sleep(60)

    p = CTX.Process(target=leader)
    p.start()
    try:
        assert ready.wait(20)
        r = Ring.attach(name, readers=1, index=0, timeout_s=30)
        r.peers = [p.pid]
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        t0 = time.monotonic()
        with pytest.raises(GroupBroken, match="the leader is gone"):
            r.read()
        assert time.monotonic() - t0 < 2.0
        r.close()
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
        # 3. the killed leader never unlinked its ring: the sweep reclaims it, as for any orphan
        assert os.path.exists(f"/dev/shm/{name}")
        report = sweep(MINE, grace_s=0)
        assert name in report.reclaimed and not os.path.exists(f"/dev/shm/{name}")


def test_a_live_leaders_ring_is_locked_against_the_sweep():
    name = _name()
    w = Ring.create(name, readers=1, timeout_s=5)
    try:
        report = sweep(MINE, grace_s=0)
        assert name in report.locked and os.path.exists(f"/dev/shm/{name}")
    finally:
        w.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_the_leader_knows_when_a_write_would_wait_for_a_reader():
    """``has_room`` is what publishing ahead relies on: a write it allows never waits."""
    name = _name()
    w = Ring.create(name, readers=2, timeout_s=5)
    try:
        fast, slow = Ring.attach(name, 2, 0, timeout_s=5), Ring.attach(name, 2, 1, timeout_s=5)
        two_chunks = ringmod.PAYLOAD + 1
        assert w.has_room(ringmod.SLOTS * ringmod.PAYLOAD) and not w.has_room(ringmod.SLOTS * ringmod.PAYLOAD + 1)
        for _ in range(ringmod.SLOTS - 1):
            w.write(b"m")
        assert w.has_room(1) and not w.has_room(two_chunks)
        for _ in range(ringmod.SLOTS - 1):
            assert fast.read() == b"m"
        assert not w.has_room(two_chunks), "the slowest reader decides"
        assert slow.read() == b"m"
        assert w.has_room(two_chunks)
        t0 = time.monotonic()
        w.write(b"y" * two_chunks)  # what it allowed does not wait (the readers read nothing meanwhile)
        assert time.monotonic() - t0 < 1.0 and not w.has_room(1)
        fast.close()
        slow.close()
    finally:
        w.close()


def test_the_leader_waits_for_each_readers_step():
    """``wait_steps`` is how the leader knows a follower finished an engine step before it
    answers: a reader still in the step breaks the group at the deadline, a dead one at the
    next tick; the step count wraps as a u32."""
    name, (got, out) = _name(), CTX.Pipe(duplex=False)
    w = Ring.create(name, readers=2, timeout_s=1.0)
    p = CTX.Process(target=_reporter, args=(name, got))
    try:
        a = Ring.attach(name, 2, 0, timeout_s=1.0)
        a.report_step(1)
        p.start()
        w.peers = [os.getpid(), p.pid]
        t0 = time.monotonic()
        w.wait_steps(1)  # reader 1 (another process) reports 0.3 s after the leader waits
        assert time.monotonic() - t0 > 0.25
        a.report_step(2)
        t0 = time.monotonic()
        with pytest.raises(GroupBroken, match=r"ring: rank 2 \(engine step 2\) did not move within 1 s"):
            w.wait_steps(2, ["rank 1", "rank 2"])  # reader 1 is still in step 2 (gathering once more, say)
        assert 0.9 < time.monotonic() - t0 < 3.0
        a.report_step(2 ** 32 + 2)
        out.send(2 ** 32 + 2)
        w.wait_steps(2 ** 32 + 2)
        out.send(None)  # reader 1 dies without reporting step 3
        p.join(10)
        a.report_step(3)
        t0 = time.monotonic()
        with pytest.raises(GroupBroken, match=r"ring reader 1 \(engine step 3\) is gone"):
            w.wait_steps(3)
        assert time.monotonic() - t0 < 1.0  # seen at the next tick, not at the deadline
        a.close()
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
        w.close()


def _reporter(name: str, steps) -> None:
    """Reader 1: step 1 after 0.3 s (the leader is waiting by then), then each step it is sent."""
    r = Ring.attach(name, 2, 1, timeout_s=10)
    time.sleep(0.3)
    r.report_step(1)
    while (step := steps.recv()) is not None:
        r.report_step(step)
    r.close()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "T"


# ---------------------------------------------------------------- in a real tp=2 group

async def test_big_batch_arrives_then_a_stopped_follower_breaks_the_group(private_server):
    timeout = 4.0
    srv = private_server("--tp", "2", "--batch-ring", "--collective-timeout", str(timeout))
    pids = srv.rank_pids()
    # the leader unlinked its ring once the follower mapped it: a kill -9 from now on leaves nothing
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{PREFIX}{pids[0]}_ring_")]
    big = feature(70, shape=(512, 512))  # 1 MiB inline: the batch spans two of the ring's slots
    async with Client(srv.addr) as c:
        r = await c.request("embed", [1, 2], [inline(big)], rid="big-1", want_digest=True, timeout=60)
        assert r.status == 200, r
        assert r.meta["digests"] == [sha256_of(big)] and r.meta["ranks"] == 2
        r, took = await while_stopped(pids[1], c.request("embed", [3], [inline(big)], rid="big-2",
                                                         timeout=timeout + 10))
    # whichever ran out first broke the group: the ring's wait for reader 0, the lane's deadline,
    # or (when the batch fit the ring's free slots, so the leader went on to the all-gather)
    # gloo's own timeout, set to the same collective_timeout (a clean-clone run on a busy host)
    assert_group_broke(srv, pids, r, took, timeout, r"ring reader 0|deadline|Timed out waiting")

