"""The leader's admission core: what is queued, running and aborting, and what to answer.

Pure: no sockets, no files, no clock (``now`` is passed in). Each call returns its
decision (an ``Accept``, the ``Reply`` messages to send, the next ``Batch``) and the
async layer (``leader.py``) carries it out: it sends, takes and drops the admission
locks, and releases the features of requests no rank read (``Reply.unrun``).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from ..protocol.batch import Batch
from ..config import Config
from ..log import event, sampled_event
from ..protocol import ABORTED, BAD_REQUEST, INTERNAL, UNAVAILABLE, Request, ack_close, result
from ..sessions import SessionStore, scoped, unscoped


@dataclass
class Reply:
    """A message for ``client``. ``req``: the request it answers (its locks are dropped);
    ``unrun``: no rank read that request, so its features are released here."""

    client: bytes
    header: dict
    req: Request | None = None
    unrun: bool = False


@dataclass
class Accept:
    req: Request


class Admission:
    STATS_EVERY_S = 2.0  # how often a batch carries gather_stats (followers' counters)
    IDLE_CHECK_S = 1.0  # how often sessions are checked for idleness

    def __init__(self, cfg: Config, sessions: SessionStore, gather_stats: bool, now: float):
        self.cfg, self.sessions, self.gather_stats = cfg, sessions, gather_stats
        self.queue: OrderedDict[tuple, Request] = OrderedDict()
        self.inflight: dict[tuple, Request] = {}
        self.aborting: dict[tuple, Request] = {}  # in-flight requests their client aborted
        self.feature_bytes_held = 0  # of queued and running requests (max_inflight_bytes)
        self.items_held = 0  # of queued and running requests (max_queued_items)
        # close_session asks in arrival order, each with the seq of the last request received
        # before it: it joins a batch once none of those is still queued, and is acked after it
        self._closing: deque[tuple[int, bytes, str]] = deque()
        self._acks: dict[int, list[tuple[bytes, str]]] = {}  # by batch seq: the closes it runs and acks
        self._closes_pending: Counter[str] = Counter()  # scoped ids with a close not yet acked
        self._arrived = 0  # requests received so far (their seq)
        self._seq = 0  # batches formed
        self._stats_at = self._idle_checked = now

    # ------------------------------------------------------------ arrivals
    def admit(self, req: Request, unavailable: str | None = None) -> Accept | Reply:
        """Queue ``req`` or answer it at once; ``unavailable`` is why the leader refuses work."""
        self._arrived += 1
        req.seq = self._arrived
        if req.session_id is not None:  # sessions are per connection (protocol.md, Sessions)
            req.session_id = scoped(req.client, req.session_id)
        self._count_refs(req)
        refused = self._refusal(req, unavailable)
        if refused is not None:
            return Reply(req.client, result(req.rid, *refused), req, unrun=True)
        self.queue[req.key] = req
        self.feature_bytes_held += req.feature_bytes
        self.items_held += len(req.items)
        return Accept(req)

    def _refusal(self, req: Request, unavailable: str | None) -> tuple[int, str] | None:
        bad_ref = self._unknown_ref(req)
        if bad_ref:
            sampled_event("bad_request", rid=req.rid, field=bad_ref.split(":", 1)[0], error=bad_ref)
            return BAD_REQUEST, bad_ref
        if req.key in self.queue or req.key in self.inflight:
            return BAD_REQUEST, "rid: already in flight for this client"
        if unavailable:
            return UNAVAILABLE, f"service unavailable: {unavailable}"
        if req.feature_bytes > self.cfg.max_inflight_bytes:  # alone over a bound: no retry would help
            return BAD_REQUEST, (f"mm_items: {req.feature_bytes} feature bytes exceed max_inflight_bytes="
                                 f"{self.cfg.max_inflight_bytes}, more than this server ever holds at once")
        if len(req.items) > self.cfg.max_queued_items:
            return BAD_REQUEST, (f"mm_items: {len(req.items)} items exceed max_queued_items="
                                 f"{self.cfg.max_queued_items}, more than this server ever holds at once")
        if len(self.queue) >= self.cfg.max_queue:
            return UNAVAILABLE, f"overloaded: {len(self.queue)} requests queued (max_queue)"
        if self.feature_bytes_held + req.feature_bytes > self.cfg.max_inflight_bytes:
            return UNAVAILABLE, (f"overloaded: {self.feature_bytes_held} feature bytes in flight, "
                                 f"this request brings {req.feature_bytes} (max_inflight_bytes)")
        if self.items_held + len(req.items) > self.cfg.max_queued_items:
            return UNAVAILABLE, (f"overloaded: {self.items_held} feature items queued and running, "
                                 f"this request brings {len(req.items)} (max_queued_items)")
        return None

    def _unknown_ref(self, req: Request) -> str | None:
        for it in req.items:
            if it.transport != "session":
                continue
            if req.session_id is None:
                return f"session_id: required by mm_items[{it.index}] (transport 'session')"
            if req.session_id in self._closes_pending or not self.sessions.has(req.session_id, it.ref):
                return (f"mm_items[{it.index}].ref: session {unscoped(req.session_id)!r} "
                        f"holds no feature {it.ref!r}")
        return None

    def _count_refs(self, req: Request) -> None:
        """A session item costs its batch the whole feature it names (the engine reads every
        byte): count it at that size, for max_inflight_bytes and for the loop-or-lane choice."""
        for it in req.items:
            if it.transport == "session":
                try:
                    t = self.sessions.lookup(req.session_id, it.ref)
                except KeyError:
                    continue  # an unknown ref: a 400 (or, if closed meanwhile, a 500 in its batch)
                it.nbytes = t.numel() * t.element_size()

    def abort(self, key: tuple) -> Reply | None:
        """A queued request is answered 499 now; one in flight is marked for its batch."""
        req = self.queue.pop(key, None)
        if req is not None:
            return self._unrun(req, ABORTED, "aborted by client", stage="queued")
        if key in self.inflight:
            self.aborting[key] = self.inflight[key]
        return None

    def close_session(self, client: bytes, session_id: str, answering: bool = True) -> Reply | None:
        """Close after every request received before it (see ``next_batch``); at once, when no
        batch runs again (``answering`` false: the sessions die with the process)."""
        if not answering:
            return Reply(client, ack_close(session_id))
        self._closing.append((self._arrived, client, session_id))
        self._closes_pending[scoped(client, session_id)] += 1
        return None

    def is_aborted(self, req: Request) -> bool:
        return self.aborting.get(req.key) is req  # that request, not a later one with its rid

    def aborts_pending(self) -> bool:
        """Whether any running request is aborted (if not, no batch need ask ``is_aborted``)."""
        return bool(self.aborting)

    # ------------------------------------------------------------ batches
    @property
    def has_work(self) -> bool:
        return bool(self.queue or self._closing)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.inflight and not self._closing

    def next_batch(self, now: float) -> Batch:
        """Up to max_batch queued requests (the batch is empty for a heartbeat), after the
        closes whose earlier requests all left the queue, and the sessions idle too long."""
        self._seq += 1
        acks = []
        while self._closing and not self._queued_before(self._closing[0][0]):
            _, client, sid = self._closing.popleft()
            acks.append((client, sid))
        batch = Batch(self._seq, closes=[scoped(client, sid) for client, sid in acks])
        if acks:  # kept by batch: the leader may form the next batch before it answers this one
            self._acks[batch.seq] = acks
        if self.gather_stats and now - self._stats_at >= self.STATS_EVERY_S:
            self._stats_at, batch.gather_stats = now, True
        if now - self._idle_checked >= self.IDLE_CHECK_S:  # sessions idle past their timeout close in-stream
            self._idle_checked = now
            expired = self.sessions.idle(self.cfg.session_idle_timeout, now)
            if expired:  # not one with a turn queued or running: that turn would find it gone
                used = {r.session_id for r in (*self.queue.values(), *self.inflight.values())}
                expired = [sid for sid in expired if sid not in used]
            if expired:
                event("sessions_expired", count=len(expired))
                batch.closes.extend(expired)
        while self.queue and len(batch.requests) < self.cfg.max_batch:
            if self._closing and not self._queued_before(self._closing[0][0]):
                break  # a close received before this request applies first: in the next batch
            key, req = self.queue.popitem(last=False)
            self.inflight[key] = req
            batch.requests.append(req)
        return batch

    def _queued_before(self, seq: int) -> bool:
        """Whether the queue still holds a request received before arrival ``seq``."""
        head = next(iter(self.queue.values()), None)
        return head is not None and head.seq <= seq

    def finish(self, batch: Batch, results: list[dict]) -> list[Reply]:
        """The acks of the sessions this batch closed, then each request's result."""
        replies = []
        for client, sid in self._acks.pop(batch.seq, ()):
            key = scoped(client, sid)
            self._closes_pending[key] -= 1
            if not self._closes_pending[key]:
                del self._closes_pending[key]
            replies.append(Reply(client, ack_close(sid)))
        for req, res in zip(batch.requests, results):
            self._forget(req)
            self.inflight.pop(req.key, None)
            if res["status"] == INTERNAL:
                sampled_event("request_failed", logging.WARNING, rid=req.rid,
                              failed_ranks=res["meta"].get("failed_ranks"), error=res["message"])
            replies.append(Reply(req.client, res, req))
        return replies

    # ------------------------------------------------------------ stopping
    def stop_batch(self) -> Batch:
        """The batch that tells the followers to stop."""
        self._seq += 1
        return Batch(self._seq, stop=True)

    def answer_queued(self, status: int, message: str) -> list[Reply]:
        """Answer everything still queued; no rank read any of it."""
        replies = [self._unrun(req, status, message) for req in self.queue.values()]
        self.queue.clear()
        return replies

    def answer_inflight(self, status: int, message: str, **meta) -> list[Reply]:
        """Answer the running batch without waiting for it (a second signal, a broken group)."""
        replies = [self._unrun(req, status, message, **meta) for req in self.inflight.values()]
        self.inflight.clear()
        return replies

    def ack_closes(self) -> list[Reply]:
        """No batch will run again: ack every close still waiting."""
        waiting = [a for acks in self._acks.values() for a in acks] + [(client, sid) for _, client, sid in self._closing]
        self._acks, self._closing = {}, deque()
        return [Reply(client, ack_close(sid)) for client, sid in waiting]

    def _unrun(self, req: Request, status: int, message: str, **meta) -> Reply:
        self._forget(req)
        return Reply(req.client, result(req.rid, status, message, meta=meta), req, unrun=True)

    def _forget(self, req: Request) -> None:
        """``req`` leaves the queue or the batch: drop its abort mark and its share of what is
        held. Every answer to an admitted request passes here, so no mark outlives it."""
        if self.aborting.get(req.key) is req:
            del self.aborting[req.key]
        self.feature_bytes_held -= req.feature_bytes
        self.items_held -= len(req.items)

    def segments(self) -> set[str]:
        """Segments named by queued and running requests (the sweep leaves them alone)."""
        return {n for r in (*self.queue.values(), *self.inflight.values()) for n in r.owned_segments}

    def __repr__(self) -> str:
        return (f"<Admission queued={len(self.queue)} inflight={len(self.inflight)} aborting={len(self.aborting)} "
                f"bytes_held={self.feature_bytes_held} items_held={self.items_held} closing={len(self._closing)}>")
