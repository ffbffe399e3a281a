"""The leader as the outside sees it: ``health`` (for /health and pongs) and ``Status``,
the narrow view ``Metrics`` and ``AdminServer`` read instead of the leader's insides."""

from __future__ import annotations

from typing import Callable

from ..lane import Lane
from ..metrics import Metrics, RankCounters
from ..remote import Topology
from ..sessions import SessionStore
from .admission import Admission
from .connections import ConnectionBound
from .lifecycle import Lifecycle, State


def health(life: Lifecycle, lane: Lane, lost: Callable[[], str | None], deadline_s: float,
           topology: Topology, world: int) -> tuple[bool, str]:
    """(ok, reason): ok only while serving, no rank lost, the ipc:// socket file still ours,
    and no collective past its deadline."""
    if life.state is State.BROKEN or lane.broken:
        return False, life.broken_reason or f"rank group broken: {lane.broken}"
    if life.state is not State.SERVING:
        return False, life.state.value
    gone = lost()
    if gone:
        return False, gone
    stuck = lane.stuck_for()
    if stuck > deadline_s:
        return False, f"lane stuck: a collective has run {stuck:.1f}s (deadline {deadline_s:g}s)"
    hosts = " ".join(f"{h}={','.join(map(str, r))}" for h, r in topology.by_host().items())
    return True, f"serving ranks={world} {hosts}"


class Status:
    """Counters the leader keeps, the queue depths, the sessions, and health."""

    def __init__(self, core: Admission, life: Lifecycle, lane: Lane, lost: Callable[[], str | None],
                 deadline_s: float, sessions: SessionStore, topology: Topology, counters: RankCounters,
                 world: int, connections: ConnectionBound | None = None):
        self._core, self._life, self._lane, self._lost = core, life, lane, lost
        self.connections = connections  # the frontend's client connections (None: not counted)
        self._deadline_s, self._counters = deadline_s, counters
        self.sessions, self.topology, self.world = sessions, topology, world
        self.results_sent: dict[int, int] = {}
        self.orphans_reclaimed = 0
        self.unlinked_at_leader = 0  # segments of requests answered before reaching the ranks
        self.follower_counters: dict[int, dict] = {}  # as of their last report
        self.metrics = Metrics(self)

    def reclaimed(self, n: int) -> None:
        """The orphan sweep took ``n`` segments."""
        self.orphans_reclaimed += n

    def health(self) -> tuple[bool, str]:
        return health(self._life, self._lane, self._lost, self._deadline_s, self.topology, self.world)

    @property
    def state(self) -> str:
        return self._life.state.value

    @property
    def queued(self) -> int:
        return len(self._core.queue)

    @property
    def running(self) -> int:
        return len(self._core.inflight)

    @property
    def feature_bytes_held(self) -> int:
        return self._core.feature_bytes_held

    def rank_counters(self) -> dict[int, dict]:
        """Counter snapshots by rank: the leader's live, followers' as of their last report."""
        return {**self.follower_counters, 0: self._counters.snapshot()}
