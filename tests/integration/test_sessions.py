"""Sessions at tp = 2: a feature kept by one turn is used by later turns; failed and aborted
turns neither lose what the session holds nor store what they brought; close_session, the
idle timeout and the memory bounds (bytes, sessions, features) release or refuse features on
every rank alike; a session belongs to the connection that named it; a close applies after
the requests sent before it, and is acked during a drain too.

Two groups: one shared by every test (distinct session ids, rid globs per test), and one
with a 1 s idle timeout for the expiry test only; the drain test comes last and ends the
shared servers (tp=2 and the tp=1 one).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import msgpack
import pytest
import torch
import zmq

from mmsched.client import Client, inline, ref, shm

from ..conftest import Server
from .lifecycle import (expect, feature, hold_lane, my_segments, no_extra_results,
                        sha256_of)

MAX_BYTES = 64 * 1024  # --session-max-bytes: all sessions together
MAX_COUNT = 8          # session_max_count: sessions open at once
MAX_FEATURES = 24      # session_max_features: features stored, all sessions
STALL_S = 2

ARGS = (
    "--tp", "2",
    "--session-max-bytes", str(MAX_BYTES),
    "--fault", "1:open:sfail-*",      # a turn that fails on rank 1 (open stage)
    "--fault", "1:stall:shold-*",     # holds the lane: later turns wait queued at the leader
    "--fault", "0:hold:smat-*",       # the leader is slow while materializing: abort lands there
    "--fault", "0:stall:dhold-*",     # holds the lane while the drain test sends its close
    "--stall-s", str(STALL_S),
)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    # the count bounds come through the environment layer of the config
    env = {"MMSCHED_SESSION_MAX_COUNT": str(MAX_COUNT), "MMSCHED_SESSION_MAX_FEATURES": str(MAX_FEATURES)}
    with Server(*ARGS, tmp_dir=str(tmp_path_factory.mktemp("sessions")), env=env) as srv:
        yield srv


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    """One rank: small batches run on the leader's loop there, not on the lane."""
    with Server("--tp", "1", "--fault", "0:stall:shold-*", "--fault", "0:stall:dhold-*", "--stall-s", str(STALL_S),
                tmp_dir=str(tmp_path_factory.mktemp("solo"))) as srv:
        yield srv


@pytest.fixture(params=["group", "solo"])
def tp1_or_2(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def idle_group(tmp_path_factory):
    with Server("--tp", "2", "--session-idle-timeout", "1",
                tmp_dir=str(tmp_path_factory.mktemp("idle"))) as srv:
        yield srv


def sid() -> str:
    return f"sess-{uuid.uuid4().hex[:10]}"


async def turn(c: Client, session_id: str | None, features, ids=(1, 2, 3), **kw):
    return await c.embed(list(ids), features, session_id=session_id, want_digest=True, timeout=30, **kw)


# ---------------------------------------------------------------- stored, then referred to

async def test_ref_uses_the_feature_an_earlier_turn_stored(group):
    s, img, other = sid(), feature(1), feature(2, (4, 4, 3))
    async with Client(group.addr) as c:
        first = expect(await turn(c, s, [shm(img, id="img"), inline(other)]), 200)
        assert first.meta["ranks"] == 2
        assert first.meta["digests"] == [sha256_of(img), sha256_of(other)]
        assert my_segments() == set()  # the turn's segment went the usual way: unlinked
        by_ref = expect(await turn(c, s, [ref("img")], ids=(5, 6)), 200)
        resent = expect(await turn(c, None, [shm(img)], ids=(5, 6)), 200)
        # the same feature may be referred to again, and alongside new features
        again = expect(await turn(c, s, [inline(other), ref("img")], ids=(9,)), 200)
        await c.close_session(s)
        await no_extra_results(c)
    assert by_ref.meta["digests"] == [sha256_of(img)] == resent.meta["digests"]
    assert torch.equal(by_ref.embedding, resent.embedding)  # the engine saw the very same bytes
    assert again.meta["digests"] == [sha256_of(other), sha256_of(img)]


async def test_a_session_is_private_to_its_id(group):
    s1, s2 = sid(), sid()
    async with Client(group.addr) as c:
        expect(await turn(c, s1, [inline(feature(3), id="x")]), 200)
        r = expect(await turn(c, s2, [ref("x")]), 400, err_type="BadRequestError")
        assert "ref" in r.message and "x" in r.message, r.message
        expect(await turn(c, s1, [ref("x")]), 200)
        await c.close_session(s1)
        await no_extra_results(c)


# ---------------------------------------------------------------- failed and aborted turns

async def test_failed_turn_keeps_old_features_and_stores_none_of_its_own(group):
    s, a, b = sid(), feature(10), feature(11)
    tag = uuid.uuid4().hex[:6]
    async with Client(group.addr) as c:
        expect(await turn(c, s, [shm(a, id="a")]), 200)
        bad = await turn(c, s, [ref("a"), shm(b, id="b")], rid=f"sfail-{tag}")
        expect(bad, 500, err_type="InternalServerError")
        assert bad.meta["failed_ranks"] == [1], bad.meta
        assert my_segments() == set()  # the failed turn's segment is unlinked all the same
        ok = expect(await turn(c, s, [ref("a")]), 200)
        assert ok.meta["digests"] == [sha256_of(a)]
        lost = expect(await turn(c, s, [ref("b")]), 400, err_type="BadRequestError")
        assert "'b'" in lost.message, lost.message
        await c.close_session(s)
        await no_extra_results(c)


async def test_turn_aborted_while_queued_keeps_old_features_and_stores_none(group):
    s, a, new = sid(), feature(20), feature(21)
    tag = uuid.uuid4().hex[:6]
    async with Client(group.addr) as c:
        expect(await turn(c, s, [shm(a, id="a")]), 200)
        hold = await hold_lane(c, f"shold-{tag}")
        rid = f"sq-{tag}"
        fut = c.send_request("embed", [4, 5], [ref("a"), shm(new, id="new")], rid=rid,
                             session_id=s, want_digest=True)
        await asyncio.sleep(0.1)
        assert len(my_segments()) == 1  # queued, its segment waiting with it
        await c.abort(rid)
        aborted = expect(await c.wait(rid, fut, 30), 499, err_type="RequestAborted")
        assert aborted.meta.get("stage") == "queued", aborted.meta
        assert not hold.done(), "the abort was answered only after the lane freed up"
        expect(await c.wait(f"shold-{tag}", hold, 30), 200)
        assert my_segments() == set()
        expect(await turn(c, s, [ref("a")]), 200)
        expect(await turn(c, s, [ref("new")]), 400)
        await c.close_session(s)
        await no_extra_results(c)


async def test_turn_aborted_while_materializing_keeps_old_features_and_stores_none(group):
    s, a, new = sid(), feature(30), feature(31)
    tag = uuid.uuid4().hex[:6]
    async with Client(group.addr) as c:
        expect(await turn(c, s, [shm(a, id="a")]), 200)
        rid = f"smat-{tag}"  # rank 0 dwells STALL_S s materializing it, before it checks aborts
        fut = c.send_request("embed", [4, 5], [ref("a"), shm(new, id="new")], rid=rid,
                             session_id=s, want_digest=True)
        await asyncio.sleep(0.5)
        await c.abort(rid)
        aborted = expect(await c.wait(rid, fut, 30), 499, err_type="RequestAborted")
        assert aborted.meta.get("stage") == "materialize", aborted.meta
        assert my_segments() == set()
        again = expect(await turn(c, s, [ref("a")]), 200)
        assert again.meta["digests"] == [sha256_of(a)]
        expect(await turn(c, s, [ref("new")]), 400)
        await c.close_session(s)
        await no_extra_results(c)


# ---------------------------------------------------------------- close_session

async def test_close_session_acks_then_its_features_are_gone(group):
    s = sid()
    async with Client(group.addr) as c:
        expect(await turn(c, s, [shm(feature(40), id="a"), shm(feature(41), id="b")]), 200)
        ack = await c.close_session(s, timeout=30)
        assert ack == {"v": 1, "type": "ack", "op": "close_session", "session_id": s}
        for fid in ("a", "b"):
            r = expect(await turn(c, s, [ref(fid)]), 400, err_type="BadRequestError")
            assert f"'{fid}'" in r.message, r.message
        # the id may be used again: a fresh, empty session
        expect(await turn(c, s, [inline(feature(42), id="a")]), 200)
        expect(await turn(c, s, [ref("a")]), 200)
        # closing a session nobody opened is acknowledged too
        other = sid()
        assert (await c.close_session(other, timeout=30))["session_id"] == other
        await c.close_session(s)
        await no_extra_results(c)


# ---------------------------------------------------------------- malformed references

async def test_unknown_ref_is_a_400_and_its_segments_are_unlinked(group):
    s = sid()
    async with Client(group.addr) as c:
        expect(await turn(c, s, [inline(feature(50), id="known")]), 200)
        r = expect(await turn(c, s, [shm(feature(51)), ref("nope")]), 400, err_type="BadRequestError")
        assert r.rid is not None
        assert "mm_items[1].ref" in r.message and "nope" in r.message, r.message
        assert my_segments() == set()  # the 400's segment: ownership passed, mmsched unlinked it
        expect(await turn(c, s, [ref("known")]), 200)
        await c.close_session(s)
        await no_extra_results(c)


async def test_ref_without_session_id_is_a_400(group):
    async with Client(group.addr) as c:
        r = expect(await turn(c, None, [shm(feature(60)), ref("img")]), 400, err_type="BadRequestError")
        assert "session_id" in r.message, r.message
        assert my_segments() == set()
        await no_extra_results(c)


# ---------------------------------------------------------------- the memory bound

async def test_turn_beyond_the_memory_bound_is_a_503_and_earlier_features_survive(group):
    s, small = sid(), feature(70, (16, 16))  # 1 KiB
    big = feature(71, (MAX_BYTES // 4 + 16,))  # just past the bound on its own
    async with Client(group.addr) as c:
        expect(await turn(c, s, [shm(small, id="small")]), 200)
        r = expect(await turn(c, s, [ref("small"), shm(big, id="big")]), 503, err_type="ServiceUnavailable")
        assert "session" in r.message, r.message
        assert my_segments() == set()
        ok = expect(await turn(c, s, [ref("small")]), 200)
        assert ok.meta["digests"] == [sha256_of(small)]
        expect(await turn(c, s, [ref("big")]), 400)
        # the same bytes without an id are not kept, so the bound does not apply
        expect(await turn(c, s, [shm(big)]), 200)
        await c.close_session(s)
        await no_extra_results(c)


async def test_the_bound_is_shared_by_all_sessions_and_close_frees_it(group):
    s1, s2 = sid(), sid()
    half = feature(80, (MAX_BYTES // 8 + 64,))  # a bit over half the bound
    async with Client(group.addr) as c:
        expect(await turn(c, s1, [inline(half, id="h")]), 200)
        expect(await turn(c, s2, [inline(half, id="h")]), 503)  # two halves do not fit
        await c.close_session(s1, timeout=30)
        expect(await turn(c, s2, [inline(half, id="h")]), 200)  # now they do
        expect(await turn(c, s2, [ref("h")]), 200)
        await c.close_session(s2)
        await no_extra_results(c)


async def test_the_bound_edges_exactly_full_and_replacing_near_it(tmp_path):
    """A group of its own, so no other session holds bytes: a turn that fills
    session_max_bytes exactly is kept, one byte more is refused; replacing a stored id
    counts the bytes it frees, so a same-size replacement of a full store is kept and one
    byte more is refused (the store then still holds the previous feature)."""
    bound = 4096
    a1, a2 = torch.arange(bound, dtype=torch.int32).to(torch.uint8), torch.full((bound,), 7, dtype=torch.uint8)
    s = sid()
    with Server("--tp", "2", "--session-max-bytes", str(bound), tmp_dir=str(tmp_path)) as srv:
        async with Client(srv.addr) as c:
            full = await turn(c, s, [shm(a1, id="a")])
            assert full.status == 200, f"a turn of exactly session_max_bytes: {full.status} {full.message}"
            r = expect(await turn(c, s, [inline(torch.ones(1, dtype=torch.uint8), id="b")]), 503)
            assert "session_max_bytes" in r.message, r.message
            same = await turn(c, s, [inline(a2, id="a")])
            assert same.status == 200, f"replacing a full store's feature with as many bytes: {same.message}"
            assert expect(await turn(c, s, [ref("a")]), 200).meta["digests"] == [sha256_of(a2)]
            expect(await turn(c, s, [shm(torch.ones(bound + 1, dtype=torch.uint8), id="a")]), 503)
            assert expect(await turn(c, s, [ref("a")]), 200).meta["digests"] == [sha256_of(a2)]
            await c.close_session(s, timeout=30)
            await no_extra_results(c)
    assert my_segments() == set()


# ---------------------------------------------------------------- the idle timeout

async def test_idle_session_expires_and_a_busy_one_does_not(idle_group):
    idle, busy = sid(), sid()
    async with Client(idle_group.addr) as c:
        expect(await turn(c, idle, [shm(feature(90), id="a")]), 200)
        expect(await turn(c, busy, [shm(feature(91), id="a")]), 200)
        expect(await turn(c, idle, [ref("a")]), 200)  # fresh: still there
        for _ in range(8):  # 2.4 s of use, each gap well under the 1 s timeout
            await asyncio.sleep(0.3)
            expect(await turn(c, busy, [ref("a")]), 200)
        r = expect(await turn(c, idle, [ref("a")]), 400, err_type="BadRequestError")
        assert "'a'" in r.message, r.message
        await asyncio.sleep(2.5)
        expect(await turn(c, busy, [ref("a")]), 400)  # idle in turn: gone
        await no_extra_results(c)


# ---------------------------------------------------------------- scope: the connection's own

async def test_another_connection_cannot_read_replace_or_close_a_session(tp1_or_2):
    s, mine, theirs = sid(), feature(100), feature(101)
    async with Client(tp1_or_2.addr) as a, Client(tp1_or_2.addr) as b:
        expect(await turn(a, s, [inline(mine, id="x")]), 200)
        # b names the same session id: none of a's features are there for it
        r = expect(await turn(b, s, [ref("x")]), 400, err_type="BadRequestError")
        assert f"session '{s}' holds no feature 'x'" in r.message, r.message
        # b storing under the same session and feature id fills b's own session
        expect(await turn(b, s, [inline(theirs, id="x")]), 200)
        assert (await b.close_session(s, timeout=30))["session_id"] == s
        got = expect(await turn(a, s, [ref("x")]), 200)
        assert got.meta["digests"] == [sha256_of(mine)]  # a's bytes, neither replaced nor closed by b
        expect(await turn(b, s, [ref("x")]), 400)  # b's close closed b's session
        await a.close_session(s, timeout=30)
        await no_extra_results(a)
        await no_extra_results(b)


# ---------------------------------------------------------------- close_session keeps its place

def test_close_session_applies_after_the_requests_sent_before_it(tp1_or_2):
    """One raw connection, so the order of its replies is seen exactly as they arrive."""
    s, a, b = sid(), feature(110), feature(111)
    tag = uuid.uuid4().hex[:6]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tp1_or_2.addr)

    def send(h: dict, *frames) -> None:
        sock.send_multipart([msgpack.packb({"v": 1, "input_ids": [4, 5], "session_id": s, **h}), *frames])

    def reply() -> dict:
        assert sock.poll(30_000), "no reply within 30 s"
        return msgpack.unpackb(sock.recv_multipart()[0], raw=False)

    def item(t: torch.Tensor, **kw) -> dict:
        return {"modality": "image", "transport": "inline", "dtype": "float32", "shape": list(t.shape), **kw}

    try:
        send({"type": "embed", "rid": f"s0-{tag}", "mm_items": [item(a, frame=1, id="a")]}, a.numpy().tobytes())
        assert reply()["status"] == 200
        send({"type": "embed", "rid": f"shold-{tag}", "session_id": None})  # holds the lane STALL_S s
        time.sleep(0.5)
        # queued behind it, back to back: a turn that uses "a" and stores "b", the close, a late ref
        send({"type": "embed", "rid": f"sb-{tag}", "want_digest": True,
              "mm_items": [{"transport": "session", "ref": "a", "modality": "image"}, item(b, frame=1, id="b")]},
             b.numpy().tobytes())
        send({"type": "close_session"})
        send({"type": "embed", "rid": f"sa-{tag}", "mm_items": [{"transport": "session", "ref": "a",
                                                                "modality": "image"}]})
        got = [reply() for _ in range(4)]
        seen = [(h["type"], h.get("rid"), h.get("status")) for h in got]
        assert seen == [("result", f"sa-{tag}", 400),     # sent after the close: the ref is gone
                        ("result", f"shold-{tag}", 200),
                        ("result", f"sb-{tag}", 200),     # sent before the close: ran before it
                        ("ack", None, None)], [(x, h.get("message")) for x, h in zip(seen, got)]
        assert got[2]["meta"]["digests"] == [sha256_of(a), sha256_of(b)]
        assert "holds no feature 'a'" in got[0]["message"], got[0]["message"]
        for fid in ("a", "b"):  # the close released what the turn before it stored
            send({"type": "embed", "rid": f"s{fid}-after-{tag}",
                  "mm_items": [{"transport": "session", "ref": fid, "modality": "image"}]})
            assert reply()["status"] == 400
    finally:
        sock.close(linger=0)


# ---------------------------------------------------------------- bounds beyond bytes

async def test_zero_size_features_count_against_the_session_bounds(group):
    empty = torch.empty(0)
    async with Client(group.addr) as c:
        s = sid()  # features: MAX_FEATURES in all, zero bytes each
        expect(await turn(c, s, [inline(empty, id=f"f{i}") for i in range(16)]), 200)
        r = expect(await turn(c, s, [inline(empty, id=f"g{i}") for i in range(9)]), 503,
                   err_type="ServiceUnavailable")
        assert r.message == (f"session memory full: 16 of {MAX_FEATURES} features held, this turn "
                             f"brings 9 (session_max_features)"), r.message
        # replacing stored ids adds no entry: 8 replaced and 8 new fill the bound exactly
        expect(await turn(c, s, [inline(empty, id=f"f{i}") for i in range(8)]
                          + [inline(empty, id=f"h{i}") for i in range(8)]), 200)
        expect(await turn(c, s, [inline(empty, id="one-more")]), 503)
        expect(await turn(c, s, [ref("h7"), ref("f15")]), 200)
        await c.close_session(s, timeout=30)
        opened = [sid() for _ in range(MAX_COUNT)]  # sessions: MAX_COUNT open at once
        for x in opened:
            expect(await turn(c, x, [inline(empty, id="e")]), 200)
        extra = sid()
        r = expect(await turn(c, extra, [inline(empty, id="e")]), 503, err_type="ServiceUnavailable")
        assert r.message == (f"session memory full: {MAX_COUNT} of {MAX_COUNT} sessions open "
                             f"(session_max_count)"), r.message
        expect(await turn(c, opened[0], [inline(empty, id="e2")]), 200)  # an open one still grows
        expect(await turn(c, extra, [inline(feature(120))]), 200)  # nothing to keep: no session needed
        await c.close_session(opened[0], timeout=30)
        expect(await turn(c, extra, [inline(empty, id="e")]), 200)  # the close freed a place
        for x in opened[1:] + [extra]:
            await c.close_session(x, timeout=30)
        await no_extra_results(c)


# ---------------------------------------------------------------- close_session in a drain

async def test_close_session_sent_during_a_drain_is_acked(tp1_or_2):
    """Last in the module: the drain ends the shared server it runs on."""
    srv = tp1_or_2
    s = sid()
    async with Client(srv.addr) as c:
        expect(await turn(c, s, [inline(feature(130), id="a")]), 200)
        hold = await hold_lane(c, "dhold-1")  # STALL_S in the engine: the drain waits for it
        srv.proc.send_signal(signal.SIGTERM)
        for _ in range(100):
            if (await c.ping(timeout=5))["state"] == "draining":
                break
            await asyncio.sleep(0.02)
        ack = await c.close_session(s, timeout=15)
        assert ack == {"v": 1, "type": "ack", "op": "close_session", "session_id": s}
        expect(await c.wait("dhold-1", hold, 30), 200)
    assert srv.proc.wait(30) == 0
