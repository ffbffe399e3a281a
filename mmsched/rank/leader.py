"""The leader rank: its loop, and the async layer that carries out the admission core's
decisions (send, lock, release). Role links (publish to followers, run inline or on the
lane, stop the followers) are bound once at start, so the loop never asks the world size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import deque
from typing import Coroutine

from .. import protocol
from ..admin import AdminServer
from ..batch import BatchRunner
from ..protocol.batch import Batch
from ..config import Config
from ..errors import BadRequest, GroupBroken, describe
from ..lane import Lane
from ..log import event, flush_sampled, sampled_event
from ..protocol import BAD_REQUEST, INTERNAL, UNAVAILABLE, Abort, CloseSession, Ping, Request, result
from ..sweep import sweep_every
from ..transport.shm import Holds
from ..transport.unread import release_malformed, release_unrun
from .admission import Accept, Admission, Reply
from .frontend import Frontend
from .lifecycle import Lifecycle, State
from .publisher import Publisher
from .status import Status

Outcome = tuple[list[dict], float | None]  # results, consensus seconds


class Leader:
    """Receives from clients, batches, and answers each request exactly once."""

    INLINE_BYTES = 1 << 20  # feature bytes a batch may copy and still run on the loop (~1 ms)
    LANE_AHEAD = 2          # batches started on the lane at once (tp > 1, while work is waiting)

    def __init__(self, cfg: Config, runner: BatchRunner, lane: Lane, world: int):
        self.cfg, self.runner, self.lane, self.world = cfg, runner, lane, world
        self.life = Lifecycle(cfg.shutdown_timeout)
        self.core = Admission(cfg, runner.sessions, gather_stats=world > 1, now=time.monotonic())
        self.holds = Holds(runner.transports.closer)  # the admission locks: one descriptor per segment named
        runner.is_aborted, runner.segment_owner = self.core.is_aborted, self.holds.owner
        runner.aborts_pending = self.core.aborts_pending
        self.frontend = Frontend(cfg)
        self.status = Status(self.core, self.life, lane, self.frontend.lost, cfg.collective_timeout,
                             runner.sessions, runner.topology, runner.counters, world,
                             self.frontend.connections)
        self._wake, self._stop = asyncio.Event(), asyncio.Event()
        self._steps: set[asyncio.Future] = set()  # batches on the lane: a second signal cancels them
        self.publisher = Publisher(runner.group if world > 1 else None)  # role links, bound once
        if self.publisher.can_go_ahead:  # the batches behind a step go out once its agreement is in
            runner.agreed = self.publisher.ahead
        self._overlap = world > 1  # a group of one runs small batches on the loop itself
        self._stop_followers = self._broadcast_stop if world > 1 else _nothing_async

    async def serve(self) -> int:
        """The leader's loop: take, run on every rank, answer — until drained or broken.

        With followers, while work is waiting, up to ``LANE_AHEAD`` batches stand on the lane:
        the next starts the moment the last one's collectives end, not after a round trip
        through this loop, and answering (encode, send, release) overlaps it."""
        async with self._services():
            ahead: deque = deque()  # (batch, step): started on the lane, in lane order
            try:
                while ahead or not self.life.done(time.monotonic(), self.core.idle):
                    if not ahead:
                        batch = await self._next_batch()         # 1. what is queued (or a heartbeat)
                        ahead.append((batch, self._start(batch)))  # 2. publish + run, on every rank
                    batch, step = ahead[0]
                    try:
                        outcome = await step
                    except GroupBroken as exc:
                        return await self._broken(str(exc))
                    ahead.popleft()
                    if outcome is None:                          # a second signal: go now
                        break
                    while len(ahead) < self.LANE_AHEAD and (following := self._waiting_batch()) is not None:
                        ahead.append((following, self._start(following)))
                    self._finish(batch, *outcome)                # 3. answer each request once
                return await self._stopped()
            finally:
                for _, step in ahead:  # never awaited: a second signal or a broken group ended the loop
                    step.close()

    # ------------------------------------------------------------ 1. receive, admit, batch
    def _on_message(self, frames: list) -> None:
        client, body = frames[0].bytes, frames[1:]
        if not body:
            return
        try:
            msg = protocol.decode(body, self.cfg.limits)
        except BadRequest as exc:
            header = protocol.unpack_lenient(body[0])  # reads past what made it a 400
            self.status.unlinked_at_leader += release_malformed(header, self.cfg.limits.shm_prefix, exc.rid,
                                                                self.holds.unlink_unheld)
            sampled_event("bad_request", rid=exc.rid, field=exc.field, error=str(exc))
            self._carry([Reply(client, result(exc.rid, BAD_REQUEST, str(exc)))])
            return
        except Exception as exc:  # a bug must not take the loop down; the client still gets an answer
            event("decode_crashed", logging.ERROR, error=describe(exc), exc_info=True)
            self._carry([Reply(client, result(None, BAD_REQUEST, "header: could not be decoded"))])
            return
        if isinstance(msg, Request):
            msg.client, msg.t0 = client, time.monotonic()
            decision = self.core.admit(msg, self.life.unavailable)
            if isinstance(decision, Accept):
                msg.holds = self.holds.hold(msg.owned_segments)
            else:
                self._carry([decision])
        elif isinstance(msg, Ping):
            self._carry([Reply(client, protocol.pong(self.world, self.status.health()[0], state=self.life.state.value,
                                                     hosts=self.runner.topology.by_host()))])
        elif isinstance(msg, Abort):
            self._carry(filter(None, [self.core.abort((client, msg.rid))]))
        elif isinstance(msg, CloseSession):
            self._carry(filter(None, [self.core.close_session(client, msg.session_id, self.life.answering)]))
            self._wake.set()

    def _received(self) -> None:
        if self.core.queue:
            self._wake.set()

    def _waiting_batch(self) -> Batch | None:
        """The next batch when work is queued and followers could start it now; else None."""
        if not self._overlap or not self.core.has_work or self.life.done(time.monotonic(), False):
            return None  # (a second signal: done at once)
        return self.core.next_batch(time.monotonic())

    async def _next_batch(self) -> Batch:
        """Wait for work (or a heartbeat of idleness), then let the core form the batch."""
        if not self.core.has_work and not self._stop.is_set():
            self._wake.clear()
            beat = asyncio.get_running_loop().call_later(self.cfg.heartbeat_s, self._wake.set)  # or a heartbeat
            try:  # (no wait_for: on Python 3.11 it wraps the wait in a task, at every idle batch)
                await self._wake.wait()
            finally:
                beat.cancel()
        return self.core.next_batch(time.monotonic())

    # ------------------------------------------------------------ 2. run on every rank
    def _lead(self, batch: Batch) -> Outcome:
        """Publish the batch (unless it went ahead), run it here, collect counters when asked."""
        self.publisher.through(batch)
        out = self.runner.run(batch)
        if batch.gather_stats:
            self.status.follower_counters = self.runner.exchange_counters()
        return out

    async def _run_solo(self, batch: Batch) -> Outcome | None:
        """A group of one has no collective to wait on: a small batch (text, small features, no
        drills) costs less on the loop than the hand-off to the lane thread (2x the
        throughput on 2 cores, bench/run.py). Big copies and fault drills keep the lane, so
        pings, aborts and /health are answered while they run."""
        if batch.empty:
            self.runner.tidy()  # nothing to run, but idle pools are still checked
            return [], None
        if self.runner.faults or sum(r.feature_bytes for r in batch.requests) > self.INLINE_BYTES:
            return await self._run_on_lane(batch)
        try:
            return self._lead(batch)
        except Exception as exc:  # as on the lane: a step that raises means we can no longer serve
            raise GroupBroken(f"batch step raised {describe(exc)}") from exc

    def _run_on_lane(self, batch: Batch) -> Coroutine:
        """Queued on the lane at once (not when the caller next yields); awaited, the outcome (None
        when a second signal cancelled it). A step never awaited keeps its error to itself."""
        self.publisher.started(batch)
        step = self.lane.start(self._lead, batch)
        self._steps.add(step)
        step.add_done_callback(lambda f: self._steps.discard(f) or f.cancelled() or f.exception())
        if self.life.now:
            step.cancel()
        return self._watched(step)

    def _start(self, batch: Batch) -> Coroutine:
        """The batch's outcome, to await. With followers the batch is on the lane already
        (the loop may answer the last batch first); a group of one runs it when awaited."""
        return self._run_on_lane(batch) if self._overlap else self._run_solo(batch)

    async def _watched(self, step: asyncio.Future) -> Outcome | None:
        """The batch's outcome; None when a second signal cancelled it (cheaper than ``asyncio.wait``)."""
        try:
            return await step
        except asyncio.CancelledError:
            if not (step.cancelled() and self.life.now):
                raise  # this task's own cancellation, not the second signal's
        self._carry(self.core.answer_inflight(UNAVAILABLE, "service unavailable: stopped before this request finished"))
        return None

    # ------------------------------------------------------------ 3. answer
    def _finish(self, batch: Batch, results: list[dict], consensus_s: float | None) -> None:
        if consensus_s is not None:
            self.status.metrics.consensus_seconds.observe(consensus_s)
        self._carry(self.core.finish(batch, results))
        flush_sampled()  # after every batch, heartbeats included: no held-back count waits long

    def _carry(self, replies) -> None:
        """Carry out the core's answers: release what no rank read, drop the locks, send."""
        for r in replies:
            req = r.req
            if req is not None and req.holds is not None:  # a batch may have left a segment to this holder
                self.status.unlinked_at_leader += self.holds.drop(req.holds, req.rid)
                req.holds = None
            if req is not None and r.unrun:  # what another request still holds stays, for that one
                self.status.unlinked_at_leader += release_unrun(req, self.world, self.holds.unlink_unheld)
            self._send(r.client, r.header, req.t0 if req is not None else None)

    def _send(self, client: bytes, header: dict, t0: float | None) -> None:
        self.frontend.send_to_clients(client, header)
        if header.get("type") == "result":
            status = header["status"]
            self.status.results_sent[status] = self.status.results_sent.get(status, 0) + 1
            if t0 is not None:
                self.status.metrics.observe_latency(status, time.monotonic() - t0)

    # ------------------------------------------------------------ services and stopping
    @contextlib.asynccontextmanager
    async def _services(self):
        """Receiving, the orphan sweep and the admin endpoint run beside the loop; closed after it."""
        admin = AdminServer(self.status, self.cfg.admin) if self.cfg.admin else None
        tasks: list = []
        try:
            if admin:  # listening before the first ping is answered: a client that saw a pong
                await admin.start()  # can read /health (its start imports aiohttp: ~0.5 s)
            self.life.serve()
            event("serving", frontend=self.cfg.frontend, ranks=self.world, max_batch=self.cfg.max_batch,
                  gil_switch_us=round(sys.getswitchinterval() * 1e6),  # as set, not as configured
                  connections_at_most=self.frontend.connections.at_most)
            tasks = [asyncio.ensure_future(self.frontend.recv_from_clients(self._on_message, self._received)),
                     asyncio.ensure_future(sweep_every(self.cfg.shm_prefix, self.cfg.sweep_grace,
                                                       self.cfg.sweep_interval, self.core.segments, self.status.reclaimed))]
            yield
        finally:
            if admin:
                await admin.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.frontend.read_unread(self._on_message)  # stopped or broken: answered 503
            self.frontend.close()
            flush_sampled(everything=True)  # the last second's held-back lines counted, before the exit
            if self.life.state is State.STOPPED:  # counted after the last 503s of the closing socket
                event("stopped", results=dict(sorted(self.status.results_sent.items())))

    async def _stopped(self) -> int:
        if not self.life.now:
            await self._stop_followers()
        self._carry(self.core.answer_queued(UNAVAILABLE, "service unavailable: shut down before this request ran"))
        self._carry(self.core.ack_closes())
        self.life.stopped()
        return 0

    async def _broadcast_stop(self) -> None:
        try:
            await self.lane.run(self.runner.group.broadcast, self.core.stop_batch().encode())
        except GroupBroken as exc:
            event("stop_broadcast_failed", logging.WARNING, reason=str(exc))

    async def _broken(self, reason: str) -> int:
        """The group is gone: answer everything held, release locally, report unhealthy, exit 3."""
        self.life.broken(reason)
        why = self.life.broken_reason
        event("group_broken", logging.ERROR, reason=reason, inflight=len(self.core.inflight),
              queued=len(self.core.queue))
        self._carry(self.core.answer_inflight(INTERNAL, f"{why}; the request may not have run on every rank",
                                              failed_ranks=list(range(self.world)), stage="group"))
        self._carry(self.core.answer_queued(UNAVAILABLE, f"service unavailable: {why}"))
        self._carry(self.core.ack_closes())  # after the answers to the turns sent before each close
        deadline = time.monotonic() + 2.0  # linger, so clients that send now get a 503 rather than silence
        while True:
            self._carry(self.core.answer_queued(UNAVAILABLE, f"service unavailable: {why}"))
            if time.monotonic() >= deadline:
                return 3
            await asyncio.sleep(0.05)

    def request_stop(self, immediate: bool = False) -> None:
        """Signal handlers call this only: set state, wake the loop."""
        step = self.life.request_stop(time.monotonic(), immediate)
        if step == "draining":
            event("draining", inflight=len(self.core.inflight), queued=len(self.core.queue),
                  timeout_s=self.cfg.shutdown_timeout)
        elif step == "stop_now":
            event("stop_now", inflight=len(self.core.inflight), queued=len(self.core.queue))
            for running in list(self._steps):
                running.cancel()
        self._stop.set()
        self._wake.set()

    def __repr__(self) -> str:
        return f"<Leader {self.life.state.value} {self.core!r} {self.lane!r}>"


async def _nothing_async() -> None:
    """The stop broadcast of a group of one."""
