"""Aborts at tp = 2, at each stage a request can be in, each with shm features: exactly one
result per request and nothing left in /dev/shm, whatever the timing.

Stages: queued at the leader (answered at once, meta.stage "queued"); in the batch being
materialized (the leader's flag in the consensus, "materialize"); past the consensus,
waiting for the engine (the leader's flag in the engine collective, "engine"). The
``hold`` fault keeps a rank busy materializing a request, which is what holds one between
the batch broadcast and the consensus.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid

import pytest

from mmsched.client import Client, raw, shm
from mmsched.producers import create_segment

from ..conftest import Server
from .lifecycle import (SHM_DIR, expect, feature, hold_lane, my_segments, no_extra_results,
                        replace_segment, sha256_of)

STALL_S = 2

ARGS = (
    "--tp", "2",
    "--fault", "1:stall:astall-*",   # rank 1 sleeps before the engine collective
    "--fault", "0:hold:ahold0-*",    # the leader dwells materializing it: abort lands before its check
    "--fault", "1:hold:ahold1-*",    # rank 1 dwells materializing it: the leader waits in the consensus
    "--stall-s", str(STALL_S),
)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with Server(*ARGS, tmp_dir=str(tmp_path_factory.mktemp("abort"))) as srv:
        yield srv


def tag() -> str:
    return uuid.uuid4().hex[:6]


async def abort_after(c: Client, rid: str, delay: float, features, held: bool = True) -> tuple:
    """Send ``rid`` with ``features``, abort it ``delay`` s later; its one result. ``held``: a
    ``hold`` drill keeps it materializing past ``delay``, so its segments are still linked
    then. (Checked right after the send instead, a fast group had sometimes unlinked them
    already: the client, preempted on a loaded machine, looked after the consensus.)"""
    fut = c.send_request("embed", [1, 2, 3], features, rid=rid, want_digest=True)
    await asyncio.sleep(delay)
    if held:
        assert my_segments(), "the request's segments exist until mmsched is done with them"
    await c.abort(rid)
    return await c.wait(rid, fut, 30)


# ---------------------------------------------------------------- the three stages

async def test_abort_while_queued_is_answered_at_once(group):
    t = tag()
    async with Client(group.addr) as c:
        hold = await hold_lane(c, f"astall-hold-{t}")
        rid = f"q-{t}"
        fut = c.send_request("embed", [1, 2], [shm(feature(1)), shm(feature(2, (3, 5)))], rid=rid)
        await asyncio.sleep(0.1)
        assert len(my_segments()) == 2
        await c.abort(rid)
        r = expect(await c.wait(rid, fut, 30), 499, err_type="RequestAborted")
        assert r.meta.get("stage") == "queued", r.meta
        assert r.output is None
        # answered while the lane was still busy, and its segments are gone already
        assert not hold.done()
        assert my_segments() == set()
        expect(await c.wait(f"astall-hold-{t}", hold, 30), 200)
        await no_extra_results(c)


async def test_abort_while_materializing(group):
    async with Client(group.addr) as c:
        r = await abort_after(c, f"ahold0-{tag()}", 0.5, [shm(feature(3)), shm(feature(4))])
        expect(r, 499, err_type="RequestAborted")
        assert r.meta.get("stage") == "materialize", r.meta
        assert my_segments() == set()
        await no_extra_results(c)
        assert (await c.ping(timeout=10))["healthy"] is True


async def test_abort_while_waiting_for_the_engine(group):
    async with Client(group.addr) as c:
        r = await abort_after(c, f"ahold1-{tag()}", 0.5, [shm(feature(5))])
        expect(r, 499, err_type="RequestAborted")
        assert r.meta.get("stage") == "engine", r.meta
        assert my_segments() == set()
        await no_extra_results(c)


async def test_abort_during_the_engine_collective_gives_one_result(group):
    """Rank 1 stalls before the engine collective: the leader is already inside it, its abort
    flag taken, so the request runs to completion (200) — or, were aborts honoured that
    late, a 499. Either way: one result, the right bytes, no segment left."""
    t0 = feature(6)
    async with Client(group.addr) as c:
        r = await abort_after(c, f"astall-{tag()}", 0.5, [shm(t0)], held=False)  # unlinked after its consensus
        assert r.status in (200, 499), (r.status, r.message)
        print(f"abort during the engine collective: {r.status}")
        if r.status == 200:
            assert r.meta["digests"] == [sha256_of(t0)]
        assert my_segments() == set()
        await no_extra_results(c)


async def test_abort_of_the_request_in_a_batch_spares_its_batch_mates(group):
    """The leader dwells on the first request; the second, in the same batch, is aborted."""
    t = tag()
    mates = {f"mate-{t}-{i}": feature(100 + i) for i in range(3)}
    async with Client(group.addr) as c:
        hold = await hold_lane(c, f"astall-hold-{t}")
        futs = {rid: c.send_request("embed", [4], [shm(x)], rid=rid, want_digest=True)
                for rid, x in mates.items()}
        victim = f"ahold0-{t}"
        vfut = c.send_request("embed", [4], [shm(feature(99))], rid=victim)
        expect(await c.wait(f"astall-hold-{t}", hold, 30), 200)  # the batch of four starts now
        await asyncio.sleep(0.3)
        await c.abort(victim)
        v = expect(await c.wait(victim, vfut, 30), 499)
        assert v.meta.get("stage") == "materialize", v.meta
        for rid, x in mates.items():
            r = expect(await c.wait(rid, futs[rid], 30), 200)
            assert r.meta["digests"] == [sha256_of(x)]
        assert my_segments() == set()
        await no_extra_results(c)


# ---------------------------------------------------------------- aborts that do nothing

async def test_abort_after_the_result_does_nothing(group):
    x = feature(7)
    async with Client(group.addr) as c:
        rid = f"done-{tag()}"
        first = expect(await c.embed([1, 2], [shm(x)], rid=rid, want_digest=True), 200)
        await c.abort(rid)
        await no_extra_results(c)
        # the rid is free again, and the stale abort does not touch its new request
        again = expect(await c.embed([1, 2], [shm(x)], rid=rid, want_digest=True), 200)
        assert again.meta["digests"] == first.meta["digests"] == [sha256_of(x)]
        await no_extra_results(c)
    assert my_segments() == set()


async def test_abort_of_an_unknown_rid_does_nothing(group):
    async with Client(group.addr) as c:
        rid = f"never-{tag()}"
        await c.abort(rid)
        await no_extra_results(c)
        expect(await c.embed([3], [shm(feature(8))], rid=rid), 200)
        await no_extra_results(c)
        assert (await c.ping(timeout=10))["healthy"] is True
    assert my_segments() == set()


async def test_abort_from_another_client_does_not_touch_mine(group):
    """rids are scoped to their client: the same rid from someone else is a different request."""
    t = tag()
    async with Client(group.addr) as mine, Client(group.addr) as theirs:
        hold = await hold_lane(mine, f"astall-hold-{t}")
        rid = f"shared-{t}"
        fut = mine.send_request("embed", [5], [shm(feature(9))], rid=rid)
        await asyncio.sleep(0.1)
        await theirs.abort(rid)
        expect(await mine.wait(f"astall-hold-{t}", hold, 30), 200)
        expect(await mine.wait(rid, fut, 30), 200)
        await no_extra_results(mine)
        await no_extra_results(theirs)
    assert my_segments() == set()


async def test_abort_racing_completion_gives_exactly_one_result(group):
    rng = random.Random(1234)
    n, deadline = 50, time.monotonic() + 60
    t = tag()
    statuses: dict[int, int] = {}
    async with Client(group.addr) as c:
        for i in range(n):
            assert time.monotonic() < deadline, f"race loop over time after {i} rounds"
            rid = f"race-{t}-{i}"
            x = feature(1000 + i, (4, 16))
            fut = c.send_request("embed", [i + 1], [shm(x)], rid=rid, want_digest=True)
            await asyncio.sleep(rng.choice([0, 0, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016]))
            await c.abort(rid)
            r = await c.wait(rid, fut, 30)
            assert r.status in (200, 499), (rid, r.status, r.message)
            if r.status == 200:
                assert r.meta["digests"] == [sha256_of(x)]
            else:
                assert r.err_type == "RequestAborted"
            statuses[r.status] = statuses.get(r.status, 0) + 1
            assert my_segments() == set(), f"round {i}: segments left after the result"
        await no_extra_results(c)
    print(f"abort race: {n} rounds, results by status {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) == n


# ---------------------------------------------------------------- a segment name used again

@pytest.mark.parametrize("second_is", ["aborted", "refused"])
async def test_a_name_reused_while_its_first_request_runs_goes_with_the_second(group, second_is):
    """Outside attack (session 54): request A's segment is unlinked after its consensus while
    A still runs (rank 1 stalls before the engine); the client makes a new segment under the
    free name and sends B naming it; B is aborted while queued, or refused (a dtype no server knows).
    B's segment used to stay in /dev/shm (the leader took the name for A's, and left it to
    A); it goes with B now, and A still reads its own bytes."""
    t = tag()
    first, second = feature(21), feature(22)
    seg = create_segment(first)
    seg.sent()  # handed over with A

    def item(x, dtype: str = "float32") -> dict:
        return {"modality": "image", "transport": "shm", "shm_name": seg.name, "dtype": dtype,
                "shape": list(x.shape)}

    rid_a = f"astall-reuse-{t}"
    async with Client(group.addr) as c, Client(group.addr) as other:
        fut_a = c.send_request("embed", [1], [raw(item(first))], rid=rid_a, want_digest=True)
        deadline = time.monotonic() + 10
        while os.path.exists(os.path.join(SHM_DIR, seg.name)):  # A's batch is past its consensus
            assert time.monotonic() < deadline, "A's segment was not unlinked after its consensus"
            await asyncio.sleep(0.005)
        replace_segment(seg.name, second.numpy().tobytes())
        rid_b = f"reuse-{t}"
        fut_b = other.send_request("embed", [1], [raw(item(second, "float32" if second_is == "aborted" else "float99"))],
                                   rid=rid_b)
        if second_is == "aborted":
            await asyncio.sleep(0.1)
            await other.abort(rid_b)
            b = expect(await other.wait(rid_b, fut_b, 30), 499)
            assert b.meta.get("stage") == "queued", b.meta
        else:
            expect(await other.wait(rid_b, fut_b, 30), 400)
        assert not fut_a.done(), "B was answered while A still ran"
        a = expect(await c.wait(rid_a, fut_a, 30), 200)
        assert a.meta["digests"] == [sha256_of(first)]
        assert my_segments() == set(), "B's segment is released with B"
        await no_extra_results(c)
