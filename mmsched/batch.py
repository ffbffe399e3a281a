"""One batch's life on a rank, as named steps run on the lane: open, materialize, agree,
release, engine, decide, and on the leader only, render. The same code runs on every rank;
what differs by rank (unlinking, forwarding, rendering) is bound once when the runner is built.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from .engine import Engine
from .faults import Faults
from .log import event
from .metrics import RankCounters
from .protocol import Request
from .protocol.batch import Batch
from .remote import Topology
from .sessions import Pending, SessionStore
from .step.engine_step import FlaggedGather, engine_requests, run_engine
from .step.features import Materialized, Owner, agree, materialize, release, unlink_always
from .step.forward import forwarding
from .step.outcome import Failed, Gate, Ok, Outcome, decide, render
from .transport import Transports


def _render_all(reqs: list[Request], outcomes: list[Outcome], world: int) -> list[dict]:
    return [render(r.rid, o, world) for r, o in zip(reqs, outcomes)]


def _no_results(reqs: list[Request], outcomes: list[Outcome], world: int) -> list[dict]:
    return []  # a follower's results would be dropped: it does not build them


class BatchRunner:
    """Runs one batch on this rank. ``is_aborted`` is the leader's view of client aborts."""

    PRUNE_EVERY_S = 1.0  # how often idle cached pools are checked against their files

    def __init__(self, group, engine: Engine, faults: Faults, unlinks: bool, sessions: SessionStore,
                 is_aborted=None, topology: Topology | None = None, stall_s: float = 3.0,
                 transports: Transports | None = None, gather: FlaggedGather | None = None):
        self.group, self.engine, self.faults, self.stall_s = group, engine, faults, stall_s
        self.topology = topology or Topology.single()
        self.unlinks, self.sessions = unlinks, sessions
        self.is_aborted: Callable[[Request], bool] = is_aborted or (lambda req: False)
        # whether any request may be aborted now: if not, the step asks no request (the leader
        # binds its admission's answer; one given ``is_aborted`` alone is asked every time)
        self.aborts_pending: Callable[[], bool] = lambda: is_aborted is not None
        # the leader's Holds.owner: per batch, unlink a segment it read now, or leave it to a later holder
        self.segment_owner: Callable[[list[Request]], Owner] = lambda reqs: unlink_always
        self.counters = RankCounters()
        self.transports = transports or Transports(group.rank, group.world, faults)  # this rank's caches
        self.forwarding = forwarding(self.topology, self.transports)
        self.gather = gather  # the engine's EngineContext.gather, when the engine was given it
        # called on the lane once the step's agreement is in (the leader publishes the batches
        # queued behind this one then, so its followers start them while it renders this one)
        self.agreed: Callable[[], None] = lambda: None
        self._results = _render_all if group.rank == 0 else _no_results
        self._stepped: tuple[int, bool] | None = None  # the batch's engine step: (number, agreed in a gather)
        self._next_prune = 0.0

    def exchange_counters(self) -> dict[int, dict]:
        """A collective: every rank's counter snapshot, by rank (the leader keeps them for /metrics)."""
        return dict(enumerate(self.group.all_gather_object(self.counters.snapshot())))

    def tidy(self) -> None:
        """At most once a second: close cached pools whose owner removed or replaced them."""
        if (now := time.monotonic()) >= self._next_prune:
            self._next_prune = now + self.PRUNE_EVERY_S
            self.transports.tidy()

    def run(self, batch: Batch) -> tuple[list[dict], float | None]:
        """Results (rendered on the leader; [] elsewhere) and the failure agreement's seconds.

        Runs for every batch, heartbeats included, so idle ranks still drop stale pools."""
        self.tidy()
        for sid in batch.closes:  # 0. sessions closed or idle, in stream order
            self.sessions.close(sid)
        reqs = batch.requests
        if not reqs:
            return [], None
        opened = self.forwarding.open(reqs, self._open)               # 1. open (errors stay on the feature)
        m = materialize(reqs, opened, self.faults, self.stall_s, self.is_aborted, self.counters)  # 2.
        self.forwarding.ship(reqs, m, self.counters)                  # 2b. to ranks on other hosts
        gate, seconds = self._agree(reqs, m)                          # 3. agree: the barrier before unlinks
        release(opened, self.unlinks, self.counters, self.segment_owner(reqs))  # 4. release
        outcomes, engine_s = self._step(reqs, m, gate)                # 5. engine, its failures agreed
        self._keep(reqs, m, outcomes)                                 # 6. sessions keep what succeeded
        for i, msg in m.errors.items():
            event("feature_failed", logging.DEBUG, rid=reqs[i].rid, error=msg)
        results = self._results(reqs, outcomes, self.group.world)     # 7. on the leader
        if self._stepped is not None:  # 8. the step is over here (a follower), or everywhere (the leader)
            self.group.step_done(*self._stepped)
            self._stepped = None
        return results, seconds if seconds is not None else engine_s

    def _open(self, item, req: Request, into=None):
        return self.transports.open(item, req.rid, lambda ref: self.sessions.lookup(req.session_id, ref), into)

    def _agree(self, reqs: list[Request], m: Materialized) -> tuple[Gate, float | None]:
        """The materialization consensus, skipped for a batch without feature items: nothing
        can fail to materialize there, and the leader's aborts are agreed after the step."""
        n = len(reqs)
        if not any(r.items for r in reqs):
            return Gate(n, None, {}, [[] for _ in range(n)]), None
        t0 = time.perf_counter()
        verdict, mismatch = agree(self.group, m)
        seconds = time.perf_counter() - t0
        refused = self._session_overflow(reqs, m.tensors, [i for i in range(n) if verdict.ok(i)])
        return Gate(n, verdict, refused, mismatch), seconds

    def _step(self, reqs: list[Request], m: Materialized, gate: Gate) -> tuple[list[Outcome], float | None]:
        """The engine on what survived everywhere, then ``decide``: one outcome per request."""
        live = gate.survivors()
        if not live:
            return decide(gate, None, [], m.digests), None
        early = m.aborted if gate.verdict is None else frozenset()

        def aborted() -> dict[int, str]:
            """The leader's aborts among the survivors as they stand now, by survivor index."""
            marks = {j: "early" for j, i in enumerate(live) if i in early} if early else {}
            if self.aborts_pending():  # most batches: no abort waits anywhere, no request to look at
                marks.update({j: "late" for j, i in enumerate(live) if j not in marks and self.is_aborted(reqs[i])})
            return marks

        self.group.step_begins()  # the leader hears of the step's end from ranks off the ring
        s = run_engine(self.group, self.engine, self.faults, self.stall_s,
                       engine_requests(reqs, m.tensors, live), aborted, self.gather, self.agreed)
        self.counters.failures["engine"] += s.failures
        if self.gather is not None:
            self._stepped = self.gather.steps, self.gather.calls > 0
        return decide(gate, s.verdict, s.outputs, m.digests, early, s.late), s.agree_s

    @staticmethod
    def _new_session_features(req: Request, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        if req.session_id is None:
            return {}
        return {it.id: t for it, t in zip(req.items, tensors) if it.id is not None and it.transport != "session"}

    def _session_overflow(self, reqs: list[Request], tensors, ok: list[int]) -> dict[int, str]:
        """Turns whose new session features would pass a bound: refused (503), same on every rank."""
        refused, pending = {}, Pending()
        for i in ok:
            new = self._new_session_features(reqs[i], tensors[i])
            why = self.sessions.refusal(reqs[i].session_id, new, pending) if new else None
            if why:
                refused[i] = why
        return refused

    def _keep(self, reqs: list[Request], m: Materialized, outcomes: list[Outcome]) -> None:
        """A session keeps the new features of its turns that succeeded; every turn touches it."""
        for req, tensors, outcome in zip(reqs, m.tensors, outcomes):
            if req.session_id is None:
                continue
            if isinstance(outcome, Ok) or (isinstance(outcome, Failed) and outcome.agreed_ok):
                new = self._new_session_features(req, tensors)
                if new:
                    self.sessions.put(req.session_id, new)
        for req in reqs:
            if req.session_id is not None:
                self.sessions.touch(req.session_id)
