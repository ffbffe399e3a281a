"""The leader's lifecycle (mmsched.rank.lifecycle) and what the outside sees of it
(mmsched.rank.status), pure: the drain and its deadline, the second signal, the same stop
twice, broken; health; /metrics rendered from the status view alone."""

from __future__ import annotations

import dataclasses

import numpy as np

from mmsched.config import Config
from mmsched.metrics import RankCounters
from mmsched.protocol import Request
from mmsched.rank.admission import Admission
from mmsched.rank.lifecycle import Lifecycle, State
from mmsched.rank.status import Status, health
from mmsched.remote import Topology
from mmsched.sessions import SessionStore


def serving(timeout: float = 30.0) -> Lifecycle:
    life = Lifecycle(timeout)
    life.serve()
    return life


def test_a_signal_drains_until_idle_or_the_deadline():
    life = serving(30.0)
    assert life.unavailable is None
    assert life.request_stop(100.0) == "draining"
    assert life.state is State.DRAINING and life.unavailable == "draining"
    assert not life.done(110.0, idle=False), "work left, deadline not passed"
    assert life.done(110.0, idle=True), "nothing left to do"
    assert life.done(130.0, idle=False), "the drain deadline passed"


def test_a_second_signal_means_now_unless_it_is_the_same_stop():
    life = serving()
    life.request_stop(100.0)
    assert life.request_stop(100.5) is None and not life.now, "within SAME_STOP_S: the same stop forwarded twice"
    assert life.request_stop(102.0) == "stop_now" and life.now
    assert life.done(102.0, idle=False)


def test_an_immediate_stop_goes_at_once():
    life = serving()
    assert life.request_stop(5.0, immediate=True) == "stop_now" and life.done(5.0, idle=False)


def test_broken_is_final_and_names_its_reason():
    life = serving()
    life.broken("collective broadcast raised")
    assert life.unavailable == "rank group broken: collective broadcast raised"
    assert life.request_stop(1.0) is None and life.state is State.BROKEN, "a signal does not leave BROKEN"
    assert not life.answering


def test_stopped_refuses_and_answers_no_more_batches():
    life = serving()
    life.request_stop(1.0)
    life.stopped()
    assert life.unavailable == "stopped" and not life.answering


class FakeLane:
    def __init__(self, broken: str | None = None, stuck: float = 0.0):
        self.broken, self._stuck = broken, stuck

    def stuck_for(self) -> float:
        return self._stuck


def check(life, lane=None, lost=None):
    return health(life, lane or FakeLane(), lambda: lost, 10.0, Topology.single(), 1)


def test_health_is_ok_only_while_serving_with_the_lane_on_time_and_the_socket_file_ours():
    ok, reason = check(serving())
    assert ok and reason.startswith("serving ranks=1 host0=0"), reason
    assert check(Lifecycle(1.0)) == (False, "starting")
    draining = serving()
    draining.request_stop(0.0)
    assert check(draining) == (False, "draining")
    assert check(serving(), lost="ipc socket file removed") == (False, "ipc socket file removed")
    ok, reason = check(serving(), FakeLane(stuck=12.5))
    assert not ok and reason == "lane stuck: a collective has run 12.5s (deadline 10s)"
    assert check(serving(), FakeLane(broken="gloo timeout")) == (False, "rank group broken: gloo timeout")
    broken = serving()
    broken.broken("rank 1 exited")
    assert check(broken) == (False, "rank group broken: rank 1 exited")


def test_metrics_render_from_the_status_view_alone():
    """/metrics reads the narrow ``Status`` (queue depths, counters, health), not the leader."""
    cfg = dataclasses.replace(Config(), max_batch=1)
    core = Admission(cfg, SessionStore(1024), gather_stats=False, now=0.0)
    for rid in ("a", "b"):
        core.admit(Request(rid, "embed", np.zeros(1, "<i4"), [], client=b"c"))
    core.next_batch(1.0)
    status = Status(core, serving(), FakeLane(), lambda: None, 10.0, core.sessions, Topology.single(),
                    RankCounters(), world=1)
    status.results_sent[200] = 3
    text = status.metrics.render().decode()
    for line in ("mmsched_requests_waiting 1.0", "mmsched_requests_running 1.0",
                 'mmsched_results_total{status="200"} 3.0', "mmsched_healthy 1.0", "mmsched_ranks 1.0"):
        assert line in text, line
