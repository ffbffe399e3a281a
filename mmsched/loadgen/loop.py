"""One run's sending: the open and closed loops, each result sending the next request, the sessions' turns."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import random
import time
from collections import deque

from ..client import Client
from .mix import Mix, Session
from .records import Records
from .spec import CLIENT_FAULTS, LoadSpec
from .watch import Watch

# the open loop's shortest sleep: uvloop rounds a delay to whole milliseconds and runs one under
# 0.5 ms at once, so shorter waits between arrivals spun a core (0.8-1.0 of one at 1000-1900 req/s)
# that a 2-core server needs; arrivals due within it go out together, on time or up to 1 ms late
MIN_SLEEP_S = 0.001
_RUNS = itertools.count()


class Run(Watch):
    """One run's state. Callbacks (no task per request): a result arriving sends the next request."""

    def __init__(self, spec: LoadSpec, client: Client, rng: random.Random):
        self.spec, self.client = spec, client
        self.mix = Mix(spec, rng)
        self.rec = Records()
        self.t0 = 0.0
        self.send_until = 0.0
        self.outstanding = 0
        self.sending = True
        self.all_done = asyncio.Event()
        self.futs: dict[int, asyncio.Future] = {}  # row -> its result, while outstanding
        self.sessions: list[Session] = []
        self.ready: deque[Session] = deque()  # open loop: sessions whose last turn returned
        self.closing: list[asyncio.Task] = []
        self.want: dict[int, list[str]] = {}  # row -> the digests its 200 must carry (--verify)
        self.tag = f"lg{os.getpid()}-{next(_RUNS)}"
        self.tasks: set[asyncio.Task] = set()  # aborts in flight (the loop keeps only weak references)
        self.errors: list[str] = []
        self.stopped_by: str | None = None  # why sending stopped before its count and duration
        self.given_up: set[int] = set()  # rows sent before the connection was replaced, never answered
        Watch.__init__(self)

    # -- sending
    def send_one(self, sess: Session | None = None) -> bool:
        """Send the next request (a new one, or ``sess``'s next turn); False once the send phase is over."""
        if not self.sending:
            return False
        if len(self.rec) >= (self.spec.requests or math.inf) or time.perf_counter() >= self.send_until:
            self.stop_sending()
            return False
        if sess is not None and sess.stored:  # a turn that would refer to kept features: look now
            if self._look():
                sess.stored = False  # no connection: the one made next keeps none of its features
        else:
            self._paused()  # a new connection seen within a millisecond: what is sent from now is not given up
        transport, fault, sizes, ids_k = self.mix.draw()
        rid = self.client.new_rid()
        if fault == "fail":
            rid = self.spec.fail_prefix + rid
        feats, seg, want = self._payload(transport, fault, sizes, sess)
        params = {"max_new_tokens": self.spec.max_new_tokens} if self.spec.type == "generate" else None
        try:
            fut = self.client.send_request(self.spec.type, self.mix.ids[ids_k], feats, rid=rid,
                                           session_id=sess.id if sess is not None else None, params=params,
                                           want_digest=self.spec.verify)
        except BaseException:
            if seg is not None:
                seg.discard()
            raise
        if seg is not None:  # locked until its result, as the client library keeps its own segments
            fut.add_done_callback(lambda f, seg=seg: _hand_over(seg, f))
        self._track(rid, "ref" if feats and feats[0].transport == "session" else transport, fault, sess, fut, want)
        return True

    def _payload(self, transport: str, fault: str, sizes: list[int], sess: Session | None):
        """(features, a too-small segment to hand over or None, the digests a 200 must carry or None)."""
        if fault in CLIENT_FAULTS:
            feat, seg = self.mix.fault_item(fault, sizes)
            return [feat], seg, None
        feats, sent_sizes = self.mix.features(transport, sizes, sess)
        return feats, None, [self.mix.sha256[n] for n in sent_sizes] if self.spec.verify else None

    def _track(self, rid: str, transport: str, fault: str, sess: Session | None, fut: asyncio.Future,
               want: list[str] | None) -> None:
        """A row for the request just sent; its result calls back; an abort follows it at once."""
        t = time.perf_counter() - self.t0
        row = self.rec.add(rid, transport, fault, sess.n if sess is not None else -1,
                           sess.turn if sess is not None else 0, t)
        self.outstanding += 1
        if want is not None:
            self.want[row] = want
        self.futs[row] = fut
        if sess is not None:
            sess.busy = True
        fut.add_done_callback(lambda f, row=row, sess=sess: self._on_result(row, sess, f))
        if fault == "abort":
            task = asyncio.ensure_future(self.client.abort(rid))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def stop_sending(self) -> None:
        if self.sending:
            self.sending = False
            self._check_done()

    def _check_done(self) -> None:
        if not self.sending and self.outstanding == 0:
            self.all_done.set()

    def _on_result(self, row: int, sess: Session | None, fut: asyncio.Future) -> None:
        self.futs.pop(row, None)
        if fut.cancelled():
            if row in self.given_up:  # its connection was replaced: it stays lost, its slot goes on
                self.outstanding -= 1
                self.want.pop(row, None)
                self._go_on(sess, None)
            return  # else the run is over: it stays lost
        res = fut.result()  # latency ends where the client read the reply, not when this callback ran
        self.rec.t_recv[row], self.rec.status[row] = res.received_at - self.t0, res.status
        want = self.want.pop(row, None)
        if want is not None and res.status == 200:
            ok = res.meta.get("digests") == want
            self.rec.verified[row] = Records.MATCHED if ok else Records.MISMATCHED
            if not ok:
                self.errors.append(f"{res.rid}: 200 whose digests are not those of the bytes sent")
        self.outstanding -= 1
        if res.status == 503 and res.message.startswith("service unavailable") and self.sending:
            self.stopped_by = self.stopped_by or f"the server is going away ({res.message}): stopped sending"
            self.stop_sending()
        self._go_on(sess, res.status, self.rec.transport[row] != "ref")

    def _go_on(self, sess: Session | None, status: int | None, brought: bool = False) -> None:
        """After a result (``status``; None: a given-up request): a session's next turn, else
        the closed loop's next request in the slot."""
        try:
            if sess is not None:
                sess.busy = False
                if status is None:
                    self._lost_turn()
                else:
                    self._next_turn(sess, status, brought)
            elif self.spec.concurrency is not None and self.sending:
                self.send_one()
        except Exception as exc:  # noqa: BLE001 - a send that cannot be made ends the send phase
            self.errors.append(f"{type(exc).__name__}: {exc}")
            self.stop_sending()
        self._check_done()

    # -- sessions
    def _lost_turn(self) -> None:
        """A session whose turn was given up ends there (what it kept was the old connection's);
        a closed loop starts a new one in its slot."""
        if self.spec.concurrency is not None and self.sending:
            self.send_one(self._new_session())

    def _new_session(self) -> Session:
        sess = Session(len(self.sessions), self.tag)
        self.sessions.append(sess)
        return sess

    def _next_turn(self, sess: Session, status: int, brought: bool) -> None:
        if status == 200 and brought and self.spec.items > 0:
            sess.stored = True
        sess.turn += 1
        if sess.turn >= self.spec.session_turns:
            self._close_session(sess)
            if self.spec.concurrency is not None and self.sending:
                self.send_one(self._new_session())
        elif self.spec.concurrency is not None:
            if not self.send_one(sess):
                self._close_session(sess)
        else:  # open loop: the next arrival may take this session's next turn
            self.ready.append(sess)

    def close_sessions(self) -> None:
        """At the end: close every session that still holds features and has no turn out."""
        for sess in self.sessions:
            if not sess.busy:
                self._close_session(sess)

    def _close_session(self, sess: Session) -> None:
        if sess.stored:
            sess.stored = False
            self.closing.append(asyncio.ensure_future(self.client.close_session(sess.id, timeout=5.0)))

    # -- the two loops
    async def closed_loop(self) -> None:
        for _ in range(self.spec.concurrency):
            sess = self._new_session() if self.spec.session_turns > 1 else None
            if not self.send_one(sess):
                break
        while self.sending:  # results drive the sending; this only enforces the duration
            await asyncio.sleep(min(0.05, max(0.0, self.send_until - time.perf_counter())))
            if time.perf_counter() >= self.send_until:
                self.stop_sending()

    async def open_loop(self) -> None:
        """Arrival i is due at i / rate: the next turn of a session whose last turn returned, or a new one."""
        rate, sessions = self.spec.rate, self.spec.session_turns > 1
        i = 0
        while self.sending:
            due = self.t0 + i / rate
            now = time.perf_counter()
            if now >= self.send_until or i >= (self.spec.requests or math.inf):
                break
            if due > now:
                await asyncio.sleep(max(due - now, MIN_SLEEP_S))
                continue
            burst = 0
            while due <= now and burst < 256 and self.sending and not self._paused():
                if sessions:
                    sess = self.ready.popleft() if self.ready else self._new_session()
                    if not self.send_one(sess):
                        break
                elif not self.send_one():
                    break
                i += 1
                burst += 1
                due = self.t0 + i / rate
            await asyncio.sleep(0.01 if self.paused else 0)  # let results in between bursts
        self.stop_sending()


def _hand_over(seg, fut: asyncio.Future) -> None:
    """A too-small segment's result is in: from the send on it was mmsched's (contract guarantee
    4), unless mmsched refused the request with a 400, which unlinks what it took first: a
    segment of ours still there then is one it never took (the wrong ``shm_prefix``, say), ours
    to unlink, as the client library unlinks its own (docs/protocol.md, Segment ownership)."""
    if not fut.cancelled() and fut.exception() is None and fut.result().status == 400:
        seg.discard()
    else:
        seg.sent()
