"""The leader's admission core (mmsched.rank.admission), pure: every answer it gives at
admission, aborts queued and in flight, batching (max_batch, the close_session order,
heartbeats, idle sessions, the gather_stats cadence) and the answers at a stop."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from mmsched.config import Config
from mmsched.protocol import ABORTED, BAD_REQUEST, INTERNAL, UNAVAILABLE, Item, Request
from mmsched.rank.admission import Accept, Admission, Reply
from mmsched.sessions import SessionStore, scoped

A, B = b"client-a", b"client-b"


def item(nbytes: int, name: str | None = "mmsched_x") -> Item:
    return Item(0, "image", "shm", "uint8", (nbytes,), nbytes, shm_name=name)


def req(rid: str, client: bytes = A, items=(), session: str | None = None) -> Request:
    return Request(rid, "generate", np.zeros(2, "<i4"), list(items), session_id=session, client=client)


def core(**over) -> Admission:
    cfg = dataclasses.replace(Config(), **{"max_queue": 4, "max_batch": 2, "max_inflight_bytes": 100,
                                           "max_queued_items": 3, **over})
    return Admission(cfg, SessionStore(1 << 20), gather_stats=True, now=0.0)


def ok(status: int):
    return {"type": "result", "status": status, "meta": {}, "message": None}


def refused(decision, status: int, words: str) -> None:
    assert isinstance(decision, Reply), decision
    assert decision.unrun, "a request answered at admission never reaches the ranks"
    assert decision.header["status"] == status and words in decision.header["message"], decision.header


# ---------------------------------------------------------------- admission

def test_accepts_and_counts_what_it_holds():
    c = core()
    assert isinstance(c.admit(req("r1", items=[item(40), item(10)])), Accept)
    assert (len(c.queue), c.feature_bytes_held, c.items_held) == (1, 50, 2)


def test_a_rid_in_flight_for_the_same_client_is_a_400_but_another_client_may_use_it():
    c = core()
    c.admit(req("r1"))
    refused(c.admit(req("r1")), BAD_REQUEST, "already in flight")
    assert isinstance(c.admit(req("r1", client=B)), Accept)
    c.next_batch(1.0)  # both now in flight: still a duplicate
    refused(c.admit(req("r1")), BAD_REQUEST, "already in flight")


def test_not_serving_is_a_503_naming_the_reason():
    refused(core().admit(req("r1"), unavailable="draining"), UNAVAILABLE, "service unavailable: draining")


def test_overload_by_queue_bytes_and_items_is_a_503_naming_the_setting():
    c = core(max_queue=1)
    c.admit(req("q1"))
    refused(c.admit(req("q2")), UNAVAILABLE, "(max_queue)")
    c = core()
    c.admit(req("b1", items=[item(60)]))
    refused(c.admit(req("b2", items=[item(41)])), UNAVAILABLE, "60 feature bytes in flight, this request brings 41")
    assert isinstance(c.admit(req("b3", items=[item(40)])), Accept), "exactly at the limit is admitted"
    c = core(max_inflight_bytes=1000)
    c.admit(req("i1", items=[item(1), item(1)]))
    refused(c.admit(req("i2", items=[item(1), item(1)])), UNAVAILABLE, "(max_queued_items)")
    assert c.items_held == 2 and c.feature_bytes_held == 2, "a refused request holds nothing"


def test_a_request_no_idle_server_could_hold_is_a_400_not_a_503_to_retry():
    """Outside attack: one request over max_inflight_bytes on an idle server was told to back
    off and retry (503), which could never succeed."""
    c = core()
    refused(c.admit(req("big", items=[item(101)])), BAD_REQUEST, "101 feature bytes exceed max_inflight_bytes=100")
    refused(c.admit(req("many", items=[item(1)] * 4)), BAD_REQUEST, "4 items exceed max_queued_items=3")
    assert isinstance(c.admit(req("edge", items=[item(97), item(1), item(1)])), Accept), "at both bounds: queued"
    assert c.feature_bytes_held == 99 and c.items_held == 3


def test_a_session_ref_the_session_does_not_hold_is_a_400():
    c = core()
    bad = Item(0, "image", "session", "uint8", (4,), 4, ref="img")
    refused(c.admit(req("s1", items=[bad], session="chat")), BAD_REQUEST, "holds no feature 'img'")
    refused(c.admit(req("s2", items=[bad])), BAD_REQUEST, "session_id: required")


def test_a_session_ref_counts_the_bytes_of_the_feature_it_names():
    c = core()
    c.sessions.put(scoped(A, "chat"), {"img": torch.zeros(20, dtype=torch.float32)})
    ref = Item(0, "image", "session", "uint8", (4,), 4, ref="img")
    assert isinstance(c.admit(req("s1", items=[ref], session="chat")), Accept)
    assert c.feature_bytes_held == 80
    c.close_session(A, "chat")  # a session with a close not yet acked holds nothing
    refused(c.admit(req("s2", items=[dataclasses.replace(ref)], session="chat")), BAD_REQUEST, "holds no feature")


# ---------------------------------------------------------------- aborts

def test_abort_of_a_queued_request_answers_it_now_and_releases_it():
    c = core()
    c.admit(req("r1", items=[item(30)]))
    reply = c.abort((A, "r1"))
    assert reply.header["status"] == ABORTED and reply.header["meta"] == {"stage": "queued"} and reply.unrun
    assert not c.queue and c.feature_bytes_held == 0 and c.items_held == 0


def test_abort_of_a_running_request_marks_it_for_its_batch_until_it_is_answered():
    c = core()
    r1 = req("r1")
    c.admit(r1)
    batch = c.next_batch(1.0)
    assert c.abort((A, "r1")) is None and c.is_aborted(r1)
    assert not c.is_aborted(req("r1")), "the mark is on that request, not on its rid"
    assert c.abort((A, "unknown")) is None
    c.finish(batch, [ok(499)])
    assert not c.aborting and not c.inflight


# ---------------------------------------------------------------- batches

def test_next_batch_takes_at_most_max_batch_in_arrival_order():
    c = core(max_inflight_bytes=1 << 20, max_queued_items=100)
    for i in range(3):
        c.admit(req(f"r{i}"))
    assert [r.rid for r in c.next_batch(1.0).requests] == ["r0", "r1"]
    assert [r.rid for r in c.next_batch(1.0).requests] == ["r2"]


def test_an_idle_leader_forms_an_empty_batch_for_the_heartbeat():
    c = core()
    b1, b2 = c.next_batch(0.1), c.next_batch(0.2)
    assert b1.empty and b2.empty and b2.seq == b1.seq + 1


def test_a_close_runs_after_the_requests_received_before_it_and_before_those_after():
    c = core(max_batch=8)
    c.admit(req("a1"))
    assert c.close_session(A, "chat") is None, "acked only after its batch"
    c.admit(req("a2"))
    c.admit(req("b1", client=B))
    first = c.next_batch(1.0)
    assert [r.rid for r in first.requests] == ["a1"] and first.closes == [], \
        "a2 and b1 came after the close: they wait for the next batch"
    assert [r.header for r in c.finish(first, [ok(200)])][0]["status"] == 200
    second = c.next_batch(1.0)
    assert second.closes == [scoped(A, "chat")] and [r.rid for r in second.requests] == ["a2", "b1"]
    replies = c.finish(second, [ok(200), ok(200)])
    assert replies[0].header["type"] == "ack" and replies[0].client == A, "the close is acked first"


def test_a_close_in_the_next_batch_is_acked_with_that_batch_even_when_formed_before_the_last_is_answered():
    """The leader starts batch k+1 before it answers batch k (tp > 1): the ack of a close
    that k+1 runs must not leave with k's answers, before the session was released."""
    c = core(max_batch=8)
    c.admit(req("a1"))
    c.close_session(A, "chat")
    first = c.next_batch(1.0)
    second = c.next_batch(1.0)  # formed while the first still runs
    assert second.closes == [scoped(A, "chat")]
    assert [r.header["type"] for r in c.finish(first, [ok(200)])] == ["result"], "no ack with the first batch"
    assert [r.header["type"] for r in c.finish(second, [])] == ["ack"]
    assert c.ack_closes() == [], "acked once"


def test_stats_are_gathered_every_two_seconds_and_idle_sessions_close_in_stream():
    c = core(session_idle_timeout=5.0)
    c.sessions.put("idle-one", {"f": torch.zeros(1)})
    assert not c.next_batch(1.0).gather_stats
    assert c.next_batch(2.0).gather_stats and not c.next_batch(3.0).gather_stats
    assert c.next_batch(1e9).closes == ["idle-one"]


def test_a_session_with_a_turn_queued_or_running_is_not_idle_however_long_it_waits():
    """An outside attack (a tp=2 group slowed by hold drills, a 3 s idle timeout): turns
    admitted while their session held the feature they named got a 500 `holds no feature`,
    the session expiring while they waited."""
    c = core(session_idle_timeout=5.0, max_batch=1)
    c.sessions.put(scoped(A, "chat"), {"img": torch.zeros(4, dtype=torch.uint8)})
    ref = Item(0, "image", "session", "uint8", (4,), 4, ref="img")
    assert isinstance(c.admit(req("t1", items=[ref], session="chat")), Accept)
    assert isinstance(c.admit(req("t2", items=[ref], session="chat")), Accept)
    first = c.next_batch(1e9)  # t1 runs, t2 waits in the queue: neither lets the session expire
    assert [r.rid for r in first.requests] == ["t1"] and first.closes == []
    c.finish(first, [ok(200)])
    second = c.next_batch(2e9)  # t2 running, the queue empty
    assert [r.rid for r in second.requests] == ["t2"] and second.closes == []
    c.finish(second, [ok(200)])
    assert c.next_batch(3e9).closes == [scoped(A, "chat")]  # no turn left: idle, it goes


def test_finish_answers_each_request_once_and_frees_what_it_held():
    c = core()
    c.admit(req("r1", items=[item(10)]))
    c.admit(req("r2", items=[item(20)]))
    batch = c.next_batch(1.0)
    replies = c.finish(batch, [ok(200), {**ok(INTERNAL), "meta": {"failed_ranks": [1]}, "message": "x"}])
    assert [(r.req.rid, r.unrun) for r in replies] == [("r1", False), ("r2", False)]
    assert c.idle and c.feature_bytes_held == 0 and c.items_held == 0


def test_at_a_stop_everything_held_is_answered_and_released():
    c = core(max_batch=1)
    c.admit(req("run"))
    c.next_batch(1.0)
    c.admit(req("wait"))
    c.close_session(B, "chat")
    running = c.answer_inflight(INTERNAL, "rank group broken", stage="group")
    queued = c.answer_queued(UNAVAILABLE, "service unavailable: stopped")
    acks = c.ack_closes()
    assert [(r.req.rid, r.header["status"], r.unrun) for r in running + queued] == \
        [("run", INTERNAL, True), ("wait", UNAVAILABLE, True)]
    assert running[0].header["meta"] == {"stage": "group"}
    assert [a.header["session_id"] for a in acks] == ["chat"] and c.idle
    assert c.close_session(B, "late", answering=False).header["type"] == "ack", "no batch runs again: acked now"


def test_repr_shows_queue_depths_in_flight_aborting_and_bytes_held():
    c = core()
    c.admit(req("r1", items=[item(7)]))
    c.next_batch(1.0)
    c.abort((A, "r1"))
    c.admit(req("r2", items=[item(5)]))
    assert repr(c) == "<Admission queued=1 inflight=1 aborting=1 bytes_held=12 items_held=2 closing=0>"
