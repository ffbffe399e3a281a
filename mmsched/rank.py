"""One rank's loop. Roles are bound once at start: the leader talks to clients and
forms batches; a follower receives the leader's batches. Both run the same
``BatchRunner`` on the collective lane, so every rank takes every step in the same order.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import Counter, OrderedDict, deque

import zmq
import zmq.asyncio

from . import protocol
from .batch import Batch, BatchRunner
from .config import Config
from .errors import BadRequest, ConfigError, GroupBroken, describe
from .admin import AdminServer
from .auth import claim_ipc, ipc_identity, ipc_lost, remove_ipc, restrict_ipc, secure_frontend
from .lane import Lane
from .log import event
from .metrics import Metrics
from .protocol import (BAD_REQUEST, INTERNAL, UNAVAILABLE, Abort, CloseSession, Ping, Request,
                       pack, result)
from .sessions import scoped, unscoped
from .sweep import sweep
from .transport.cuda_ipc import acknowledge
from .transport.shm import Holds, unlink_segment


class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"
    BROKEN = "broken"


class Follower:
    """Receives each batch from the leader and runs it; the leader decides when to stop."""

    def __init__(self, cfg: Config, runner: BatchRunner, lane: Lane):
        self.cfg, self.runner, self.lane = cfg, runner, lane

    def _follow(self) -> bool:
        batch = Batch.decode(self.runner.group.broadcast(None))
        if batch.stop:
            return False
        self.runner.run(batch)
        if batch.gather_stats:
            self.runner.exchange_counters()
        return True

    async def serve(self) -> int:
        deadline = self.cfg.collective_timeout + self.cfg.heartbeat_s
        try:
            while await self.lane.run(self._follow, timeout_s=deadline):
                pass
        except GroupBroken as exc:
            event("group_broken", logging.ERROR, reason=str(exc))
            return 3
        return 0


class Leader:
    """Receives from clients, validates, batches, and answers each request exactly once."""

    def __init__(self, cfg: Config, runner: BatchRunner, lane: Lane, world: int):
        self.cfg, self.runner, self.lane, self.world = cfg, runner, lane, world
        self.limits = cfg.limits
        self.state = State.STARTING
        self.queue: OrderedDict[tuple, Request] = OrderedDict()
        self.inflight: dict[tuple, Request] = {}
        self.aborting: dict[tuple, Request] = {}  # in-flight requests their client aborted
        self.broken_reason: str | None = None
        self.results_sent: dict[int, int] = {}
        self.orphans_reclaimed = 0
        self.unlinked_at_leader = 0  # segments of requests answered before reaching the ranks
        self.feature_bytes_held = 0  # of queued and running requests (max_inflight_bytes)
        self.items_held = 0  # of queued and running requests (max_queued_items)
        self.holds = Holds()  # the admission locks: one descriptor per segment named
        self._follower_counters: dict[int, dict] = {}
        self._stats_at = time.monotonic()
        self.metrics = Metrics(self)
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._now = asyncio.Event()
        self._seq = 0
        # close_session asks in arrival order, each with the seq of the last request received
        # before it: it joins a batch once none of those is still queued, and is acked after it
        self._closing: deque[tuple[int, bytes, str]] = deque()
        self._acking: list[tuple[bytes, str]] = []
        self._closes_pending: Counter[str] = Counter()  # scoped ids with a close not yet acked
        self._arrived = 0  # requests received so far (their seq)
        self._idle_checked = time.monotonic()
        self._drain_deadline: float | None = None
        runner.is_aborted = lambda req: self.aborting.get(req.key) is req  # that request, not its rid
        claim_ipc(cfg.frontend)  # again: another server may have bound it since the CLI checked
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)  # per frame: the hard backstop
        self.sock.setsockopt(zmq.SNDHWM, cfg.zmq_hwm)
        self.sock.setsockopt(zmq.RCVHWM, cfg.zmq_hwm)
        # A connection that brings a routing id already in use takes it over (what the old one
        # had delivered is still read; libzmq reads nothing more from it): the default ignores
        # the newcomer for good, so it would get no reply and its segments would stay linked.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._auth = secure_frontend(self.ctx, self.sock, cfg)
        try:
            self.sock.bind(cfg.frontend)
        except zmq.ZMQError as exc:
            self.sock.close(linger=0)
            raise ConfigError(f"frontend: cannot bind {cfg.frontend}: {exc}") from exc
        restrict_ipc(cfg.frontend, int(cfg.ipc_mode, 8))
        self._bound = ipc_identity(cfg.frontend)  # /health and the stop check the file is still ours
        self._raw = zmq.Socket.shadow(self.sock.underlying)  # sync view for NOBLOCK drains and sends

    # ------------------------------------------------------------ client I/O
    def _send_to_client(self, client: bytes, header: dict, t0: float | None = None) -> None:
        # Through the asyncio socket, not the shadow: a send processes the socket's mailbox and
        # can consume the edge-triggered FD signal the receiver's poll waits on; pyzmq's own
        # send then re-checks ZMQ_EVENTS, so incoming messages are never left unread.
        exc = self.sock.send_multipart([client, pack(header)], flags=zmq.NOBLOCK).exception()
        if exc is not None:
            event("send_failed", logging.WARNING, rid=header.get("rid"), error=describe(exc))
        if header.get("type") == "result":
            status = header["status"]
            self.results_sent[status] = self.results_sent.get(status, 0) + 1
            if t0 is not None:
                self.metrics.request_latency.labels(str(status)).observe(time.monotonic() - t0)

    def _answer(self, req: Request, status: int, message: str, **meta) -> None:
        """Answer a request that never reached the ranks (or whose batch was lost with the
        group): the leader owns its segments alone, and unlinks what is still there."""
        for name in req.owned_segments:
            self.unlinked_at_leader += unlink_segment(name, req.rid, quiet_if_missing=True)
        self._forget(req)
        for it in req.items:
            if it.transport == "cuda_ipc":  # no rank will read it: acknowledge for all of them
                acknowledge(it, range(self.world), req.rid)
        self._send_to_client(req.client, result(req.rid, status, message, meta=meta), req.t0)

    async def _recv_from_clients(self) -> None:
        """Wait for a message, then drain without blocking: receiving in batches is ~7x faster."""
        while True:
            await self.sock.poll(flags=zmq.POLLIN)
            for _ in range(max(self.cfg.max_batch, 64)):
                try:
                    frames = self._raw.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_message(frames)
            if self.queue:
                self._wake.set()

    def _on_message(self, frames: list) -> None:
        client, body = frames[0].bytes, frames[1:]
        if not body:
            return
        try:
            msg = protocol.decode(body, self.limits)
        except BadRequest as exc:
            self._reject(client, body[0], exc)
            return
        except Exception as exc:  # a bug must not take the loop down; the client still gets an answer
            event("decode_crashed", logging.ERROR, error=describe(exc), exc_info=True)
            self._send_to_client(client, result(None, BAD_REQUEST, "header: could not be decoded"))
            return
        if isinstance(msg, Request):
            self._arrived += 1
            msg.client, msg.t0, msg.seq = client, time.monotonic(), self._arrived
            if msg.session_id is not None:  # sessions are per connection (protocol.md, Sessions)
                msg.session_id = scoped(client, msg.session_id)
            self._admit(msg)
        elif isinstance(msg, Ping):
            self._send_to_client(client, protocol.pong(self.world, self.healthy, state=self.state.value,
                                                       hosts=self.runner.topology.by_host()))
        elif isinstance(msg, Abort):
            self._abort((client, msg.rid))
        elif isinstance(msg, CloseSession):
            self._close_session(client, msg.session_id)

    def _close_session(self, client: bytes, session_id: str) -> None:
        """Close after every request received before it: see ``_next_batch``."""
        if self.state in (State.STOPPED, State.BROKEN):  # no batch runs again; sessions die with us
            self._send_to_client(client, protocol.ack_close(session_id))
            return
        self._closing.append((self._arrived, client, session_id))
        self._closes_pending[scoped(client, session_id)] += 1
        self._wake.set()

    def _forget(self, req: Request) -> None:
        """The request is answered: drop its abort mark, its admission locks and its share of the
        in-flight bytes. Every answer passes here, so no mark outlives its request."""
        if self.aborting.get(req.key) is req:
            del self.aborting[req.key]
        if req.holds is not None:
            self.holds.drop(req.holds)
            req.holds = None
            self.feature_bytes_held -= req.feature_bytes
            self.items_held -= len(req.items)

    def _reject(self, client: bytes, header_frame, exc: BadRequest) -> None:
        header = protocol.unpack_lenient(header_frame)  # reads past what made it a 400
        for name in protocol.owned_segments(header, self.limits.shm_prefix):
            self.unlinked_at_leader += unlink_segment(name, exc.rid, quiet_if_missing=True)
        event("bad_request", rid=exc.rid, field=exc.field, error=str(exc))
        self._send_to_client(client, result(exc.rid, BAD_REQUEST, str(exc)))

    def _unknown_ref(self, req: Request) -> str | None:
        for it in req.items:
            if it.transport != "session":
                continue
            if req.session_id is None:
                return f"session_id: required by mm_items[{it.index}] (transport 'session')"
            if req.session_id in self._closes_pending or not self.runner.sessions.has(req.session_id, it.ref):
                return (f"mm_items[{it.index}].ref: session {unscoped(req.session_id)!r} "
                        f"holds no feature {it.ref!r}")
        return None

    def _count_refs(self, req: Request) -> None:
        """A session item costs its batch the whole feature it names (the engine reads every
        byte): count it at that size, for max_inflight_bytes and for the loop-or-lane choice."""
        for it in req.items:
            if it.transport == "session":
                try:
                    t = self.runner.sessions.lookup(req.session_id, it.ref)
                except KeyError:
                    continue  # an unknown ref: a 400 (or, if closed meanwhile, a 500 in its batch)
                it.nbytes = t.numel() * t.element_size()

    def _admit(self, req: Request) -> None:
        self._count_refs(req)
        bad_ref = self._unknown_ref(req)
        if bad_ref:
            event("bad_request", rid=req.rid, field=bad_ref.split(":", 1)[0], error=bad_ref)
            self._answer(req, BAD_REQUEST, bad_ref)
        elif req.key in self.queue or req.key in self.inflight:
            self._answer(req, BAD_REQUEST, "rid: already in flight for this client")
        elif self.state is not State.SERVING:
            reason = self.broken_reason or self.state.value
            self._answer(req, UNAVAILABLE, f"service unavailable: {reason}")
        elif len(self.queue) >= self.cfg.max_queue:
            self._answer(req, UNAVAILABLE, f"overloaded: {len(self.queue)} requests queued (max_queue)")
        elif self.feature_bytes_held + req.feature_bytes > self.cfg.max_inflight_bytes:
            self._answer(req, UNAVAILABLE, f"overloaded: {self.feature_bytes_held} feature bytes in flight, "
                         f"this request brings {req.feature_bytes} (max_inflight_bytes)")
        elif self.items_held + len(req.items) > self.cfg.max_queued_items:
            self._answer(req, UNAVAILABLE, f"overloaded: {self.items_held} feature items queued and running, "
                         f"this request brings {len(req.items)} (max_queued_items)")
        else:
            req.holds = self.holds.hold(req.owned_segments)
            self.queue[req.key] = req
            self.feature_bytes_held += req.feature_bytes
            self.items_held += len(req.items)

    def _abort(self, key: tuple) -> None:
        req = self.queue.pop(key, None)
        if req is not None:
            self._answer(req, protocol.ABORTED, "aborted by client", stage="queued")
        elif key in self.inflight:
            self.aborting[key] = self.inflight[key]

    @property
    def healthy(self) -> bool:
        return self.health()[0]

    def health(self) -> tuple[bool, str]:
        """(ok, reason): ok only while serving, no rank lost, and no collective past its deadline."""
        if self.state is State.BROKEN or self.lane.broken:
            return False, self.broken_reason or f"rank group broken: {self.lane.broken}"
        if self.state is not State.SERVING:
            return False, self.state.value
        lost = ipc_lost(self.cfg.frontend, self._bound)
        if lost:
            return False, lost
        stuck = self.lane.stuck_for()
        if stuck > self.cfg.collective_timeout:
            return False, f"lane stuck: a collective has run {stuck:.1f}s (deadline {self.cfg.collective_timeout:g}s)"
        hosts = " ".join(f"{h}={','.join(map(str, r))}" for h, r in self.runner.topology.by_host().items())
        return True, f"serving ranks={self.world} {hosts}"

    def rank_counters(self) -> dict[int, dict]:
        """Counter snapshots by rank: the leader's live, followers' as of their last report."""
        return {**self._follower_counters, 0: self.runner.counters.snapshot()}

    # ------------------------------------------------------------ the batch loop
    async def _next_batch(self) -> Batch:
        """1. Up to max_batch queued requests; an empty batch after a heartbeat of idleness."""
        if not self.queue and not self._closing and not self._stop.is_set():
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.cfg.heartbeat_s)
            except asyncio.TimeoutError:
                pass
        self._seq += 1
        head = next(iter(self.queue.values()), None)
        while self._closing and (head is None or self._closing[0][0] < head.seq):
            _, client, sid = self._closing.popleft()  # nothing received before it is still queued
            self._acking.append((client, sid))
        batch = Batch(self._seq, closes=[scoped(client, sid) for client, sid in self._acking])
        if self.world > 1 and time.monotonic() - self._stats_at >= 2.0:
            self._stats_at, batch.gather_stats = time.monotonic(), True
        now = time.monotonic()
        if now - self._idle_checked >= 1.0:  # sessions idle past their timeout close in-stream
            self._idle_checked = now
            expired = self.runner.sessions.idle(self.cfg.session_idle_timeout, now)
            if expired:
                event("sessions_expired", count=len(expired))
                batch.closes.extend(expired)
        while self.queue and len(batch.requests) < self.cfg.max_batch:
            if self._closing and self._closing[0][0] < next(iter(self.queue.values())).seq:
                break  # a close received before this request applies first: in the next batch
            key, req = self.queue.popitem(last=False)
            self.inflight[key] = req
            batch.requests.append(req)
        return batch

    def _lead(self, batch: Batch):
        """On the lane: 2. broadcast the batch to followers, 3. run it here."""
        if self.world > 1:
            self.runner.group.broadcast(batch.encode())
        out = self.runner.run(batch)
        if batch.gather_stats:
            self._follower_counters = self.runner.exchange_counters()
        return out

    def _finish(self, batch: Batch, results: list[dict], consensus_s: float | None) -> None:
        """Answer each request once; forget it. Ack the sessions this batch closed."""
        if consensus_s is not None:
            self.metrics.consensus_seconds.observe(consensus_s)
        for client, sid in self._acking:
            key = scoped(client, sid)
            self._closes_pending[key] -= 1
            if not self._closes_pending[key]:
                del self._closes_pending[key]
            self._send_to_client(client, protocol.ack_close(sid))
        self._acking = []
        for req, res in zip(batch.requests, results):
            self._forget(req)
            self.inflight.pop(req.key, None)
            if res["status"] == INTERNAL:
                event("request_failed", logging.WARNING, rid=req.rid, failed_ranks=res["meta"].get("failed_ranks"),
                      error=res["message"])
            self._send_to_client(req.client, res, req.t0)

    async def serve(self) -> int:
        """The leader's loop: take, run on every rank, answer — until drained or broken."""
        async with self._services():
            while not self._done():
                batch = await self._next_batch()                 # 1. what is queued (or a heartbeat)
                if batch.empty and self.world == 1:
                    self.runner.tidy()  # nothing to run, but idle pools are still checked
                    continue
                try:
                    outcome = await self._run_on_lane(batch)     # 2. broadcast + run, on every rank
                except GroupBroken as exc:
                    return await self._broken(str(exc))
                if outcome is None:                              # a second signal: go now
                    break
                self._finish(batch, *outcome)                    # 3. answer each request once
            return await self._stopped()

    INLINE_BYTES = 1 << 20  # feature bytes a batch may copy and still run on the loop (~1 ms)

    def _runs_inline(self, batch: Batch) -> bool:
        """A group of one has no collective to wait on: a small batch (text, small features, no
        drills) costs less on the loop than the hand-off to the lane thread (2x the
        throughput on 2 cores, bench/run.py). Big copies and fault drills keep the lane, so
        pings, aborts and /health are answered while they run."""
        return (self.world == 1 and not self.runner.faults
                and sum(r.feature_bytes for r in batch.requests) <= self.INLINE_BYTES)

    async def _run_on_lane(self, batch: Batch):
        """(results, consensus seconds) of the batch; None when a second signal cut it short."""
        if self._runs_inline(batch):
            try:
                return self._lead(batch)
            except Exception as exc:  # as on the lane: a step that raises means we can no longer serve
                raise GroupBroken(f"batch step raised {describe(exc)}") from exc
        step = asyncio.ensure_future(self.lane.run(self._lead, batch))
        now = asyncio.ensure_future(self._now.wait())
        await asyncio.wait({step, now}, return_when=asyncio.FIRST_COMPLETED)
        now.cancel()
        if not step.done():
            step.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._answer_inflight(UNAVAILABLE, "service unavailable: stopped before this request finished")
            return None
        return step.result()

    async def _stopped(self) -> int:
        if not self._now.is_set():
            await self._stop_followers()
        self._answer_all(UNAVAILABLE, "service unavailable: shut down before this request ran")
        self._ack_closes()
        self.state = State.STOPPED
        event("stopped", results=dict(sorted(self.results_sent.items())))
        return 0

    @contextlib.asynccontextmanager
    async def _services(self):
        """Receiving, the orphan sweep and the admin endpoint run beside the loop; closed after it."""
        self.state = State.SERVING
        event("serving", frontend=self.cfg.frontend, ranks=self.world, max_batch=self.cfg.max_batch)
        tasks = [asyncio.ensure_future(self._recv_from_clients()), asyncio.ensure_future(self._sweep_orphans())]
        admin = AdminServer(self, self.cfg.admin) if self.cfg.admin else None
        try:
            if admin:
                await admin.start()
            yield
        finally:
            if admin:
                await admin.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._answer_unread()
            self.sock.close(linger=1000)
            remove_ipc(self.cfg.frontend, self._bound)
            if self._auth is not None:
                self._auth.stop()
            self.ctx.term()

    # clients still sending when we stop (a load generator until it sees its first 503)
    UNREAD_QUIET_S, UNREAD_MAX_S = 0.2, 2.0

    def _answer_unread(self) -> None:
        """The loop is over (stopped or broken): answer what clients sent that is still
        queued at the socket (503, unlinking its segments) instead of closing on it. Reads
        until the socket stays quiet for UNREAD_QUIET_S, for at most UNREAD_MAX_S."""
        deadline = time.monotonic() + self.UNREAD_MAX_S
        while time.monotonic() < deadline and self._raw.poll(int(self.UNREAD_QUIET_S * 1000), zmq.POLLIN):
            for _ in range(1024):
                try:
                    frames = self._raw.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_message(frames)

    async def _sweep_orphans(self) -> None:
        """At start-up, then every sweep_interval: reclaim what crashed clients or ranks left behind."""
        loop = asyncio.get_running_loop()
        while True:
            in_flight = {n for r in (*self.queue.values(), *self.inflight.values()) for n in r.owned_segments}
            report = await loop.run_in_executor(None, sweep, self.cfg.shm_prefix, self.cfg.sweep_grace, in_flight)
            self.orphans_reclaimed += len(report.reclaimed)
            if not self.cfg.sweep_interval:
                return
            await asyncio.sleep(self.cfg.sweep_interval)

    def _done(self) -> bool:
        if self.state is not State.DRAINING:
            return False
        timed_out = time.monotonic() >= (self._drain_deadline or 0)
        return timed_out or (not self.queue and not self.inflight and not self._closing)

    async def _stop_followers(self) -> None:
        if self.world > 1:
            stop = Batch(self._seq + 1, stop=True)
            try:
                await self.lane.run(self.runner.group.broadcast, stop.encode())
            except GroupBroken as exc:
                event("stop_broadcast_failed", logging.WARNING, reason=str(exc))

    def _answer_all(self, status: int, message: str) -> None:
        """Answer everything still queued (in-flight work: ``_answer_inflight``) and unlink its segments."""
        for req in list(self.queue.values()):
            self._answer(req, status, message)
        self.queue.clear()

    def _answer_inflight(self, status: int, message: str, **meta) -> None:
        for req in list(self.inflight.values()):
            self._answer(req, status, message, **meta)
        self.inflight.clear()

    def _ack_closes(self) -> None:
        """No batch will run again: ack every close still waiting; the sessions die with the process."""
        for client, sid in self._acking + [(client, sid) for _, client, sid in self._closing]:
            self._send_to_client(client, protocol.ack_close(sid))
        self._acking, self._closing = [], deque()

    async def _broken(self, reason: str) -> int:
        """The group is gone: answer everything held, release locally, report unhealthy, exit non-zero."""
        self.state, self.broken_reason = State.BROKEN, f"rank group broken: {reason}"
        event("group_broken", logging.ERROR, reason=reason, inflight=len(self.inflight), queued=len(self.queue))
        self._answer_inflight(INTERNAL, f"{self.broken_reason}; the request may not have run on every rank",
                              failed_ranks=list(range(self.world)), stage="group")
        self._ack_closes()
        self._answer_all(UNAVAILABLE, f"service unavailable: {self.broken_reason}")
        # Linger briefly so clients that send now get a 503 rather than silence.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            self._answer_all(UNAVAILABLE, f"service unavailable: {self.broken_reason}")
        return 3

    # Signals this close together are one stop: the launcher forwards a SIGTERM that a
    # process manager (systemd, a terminal's Ctrl-C under torchrun) may also deliver here.
    SAME_STOP_S = 1.0
    _stop_asked_at = float("-inf")

    def request_stop(self, immediate: bool = False) -> None:
        """Signal handlers call this only: set state, wake the loop."""
        now = time.monotonic()
        if not immediate and self.state is State.DRAINING and now - self._stop_asked_at < self.SAME_STOP_S:
            return
        self._stop_asked_at = now
        if immediate or self.state is State.DRAINING:
            event("stop_now", inflight=len(self.inflight), queued=len(self.queue))
            self._drain_deadline = 0.0
            self._now.set()
        elif self.state is State.SERVING:
            event("draining", inflight=len(self.inflight), queued=len(self.queue),
                  timeout_s=self.cfg.shutdown_timeout)
            self._drain_deadline = time.monotonic() + self.cfg.shutdown_timeout
        self.state = State.DRAINING
        self._stop.set()
        self._wake.set()

    def __repr__(self) -> str:
        return (f"<Leader {self.state.value} queued={len(self.queue)} inflight={len(self.inflight)} "
                f"aborting={len(self.aborting)} {self.lane!r}>")
