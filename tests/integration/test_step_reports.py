"""``StepReports`` between two real gloo rank processes (no batch ring): the leader hears the end
of each engine step from its follower; a report of another step, or a follower gone before it
reports, is ``GroupBroken`` naming the rank, within the group's timeout, never a hang."""

from __future__ import annotations

import os
import time

from ..conftest import two_ranks


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    from mmsched.errors import GroupBroken
    from mmsched.group import GlooGroup

    group = GlooGroup(rank, 2, "env://", 20.0)
    seen: list = []
    if rank == 1:
        group.step_done(1, gathered=True)
        group.step_done(2, gathered=False)  # agreed after the step: nobody waits, nothing sent
        group.step_done(7, gathered=True)   # out of step with the leader's 3
        time.sleep(0.5)
        os._exit(0)  # gone before step 4's report
    for steps, gathered in ((1, True), (2, False), (3, True), (4, True)):
        group.step_begins()  # the receive is posted before the step, as BatchRunner does
        t0 = time.monotonic()
        try:
            group.step_done(steps, gathered)
            seen.append((steps, "ok"))
        except GroupBroken as exc:
            seen.append((steps, str(exc), round(time.monotonic() - t0, 1)))
    out.put(seen)
    out.close()
    out.join_thread()  # flushed before the exit that skips gloo's teardown
    os._exit(0)


def test_the_leader_hears_each_step_end_and_breaks_on_a_wrong_or_missing_one():
    [leader] = two_ranks(_rank, answers=1, timeout=100)
    assert leader[:2] == [(1, "ok"), (2, "ok")], leader
    assert leader[2][0] == 3 and leader[2][1] == "rank 1 ended engine step 7 where rank 0 ended 3", leader
    step, why, seconds = leader[3]
    assert step == 4 and "rank 1's end of engine step 4" in why and seconds < 15, leader  # not the 20 s timeout
