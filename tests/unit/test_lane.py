"""The lane's deadline: a call that overruns it breaks the group, and the lane refuses
every later call at once (a thread, no sockets, no processes)."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import threading
import time

import pytest
import uvloop

from mmsched.errors import GroupBroken
from mmsched.lane import Lane


def test_a_call_within_the_deadline_returns_its_value():
    lane = Lane(5.0)
    assert asyncio.run(lane.run(lambda a, b: a + b, 2, 3)) == 5
    assert lane.broken is None and lane.stuck_for() == 0.0
    lane.close()


def test_an_overrun_is_group_broken_and_later_calls_are_refused():
    lane, release = Lane(0.2), threading.Event()

    async def scenario():
        t0 = time.monotonic()
        with pytest.raises(GroupBroken, match="passed its 0.2s deadline"):
            await lane.run(release.wait, 30)
        assert time.monotonic() - t0 < 5, "the deadline, not the call, ended the wait"
        ran = []
        with pytest.raises(GroupBroken, match="deadline"):
            await lane.run(ran.append, 1)
        assert ran == [], "a broken lane runs nothing more"

    asyncio.run(scenario())
    release.set()
    lane.close()


def test_a_call_that_raises_breaks_the_lane_with_its_error():
    lane = Lane(5.0)

    def boom():
        raise RuntimeError("gloo: connection reset")

    async def scenario():
        with pytest.raises(GroupBroken, match="RuntimeError: gloo: connection reset"):
            await lane.run(boom)
        with pytest.raises(GroupBroken):
            await lane.run(lambda: 1)

    asyncio.run(scenario())
    lane.close()


def test_the_rank_lane_runs_torch_ops_on_the_configured_thread_count():
    """torch's thread count is per thread: a lane left at the default ran each op on an
    OpenMP pool of one thread per core whose workers spin, a third of a core each."""
    import torch

    from mmsched.config import Config
    from mmsched.server import make_lane

    cfg = Config(torch_threads=1)
    lane = make_lane(cfg)
    try:
        assert asyncio.run(lane.run(torch.get_num_threads)) == cfg.torch_threads
    finally:
        lane.close()


def test_a_rank_process_takes_the_configured_gil_switch_interval():
    """Python's 5 ms could leave a lane woken from gloo waiting that long for the loop
    thread's GIL (tp=2's p99 at 1000 req/s: 6.3 ms, against 5.4 at 0.5 ms): a rank sets
    ``gil_switch_us`` at start."""
    code = ("import sys; from mmsched.config import Config; from mmsched.server import _prepare_process; "
            "_prepare_process(Config(gil_switch_us=250, sched_slice_us=0), 1); print(sys.getswitchinterval())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == 250e-6, out.stdout


def test_start_queues_the_call_before_the_caller_yields():
    """The leader starts batch k+1 this way and then answers batch k on the loop: the lane
    must already be running k+1 meanwhile, not wait for the loop's next turn."""
    lane, ran = Lane(5.0), threading.Event()

    async def scenario():
        pending = lane.start(ran.set)
        assert ran.wait(5), "the call ran while the loop had not yielded"
        await pending

    asyncio.run(scenario())
    lane.close()


def test_a_call_that_reports_progress_keeps_a_deadline_per_unit_of_work():
    """A follower runs batch after batch in one lane call: each batch done restarts the
    deadline, so a long run of quick batches never trips it, but one batch that stalls
    (a leader gone mid-batch) still breaks the group within the deadline."""
    lane, stall = Lane(0.3), threading.Event()
    units = []

    def batches():
        for i in range(12):  # 12 x 0.1 s: four times the deadline in all
            time.sleep(0.1)
            units.append(i)
            lane.progress()
        stall.wait(30)  # the 13th never ends

    async def scenario():
        t0 = time.monotonic()
        with pytest.raises(GroupBroken, match="passed its 0.3s deadline"):
            await lane.run(batches)
        took = time.monotonic() - t0
        assert units == list(range(12)), "every unit ran under the restarted deadline"
        assert 1.2 + 0.3 - 0.05 < took < 1.2 + 0.3 + 1.0, f"broke {took:.2f}s in: one deadline after the last unit"

    asyncio.run(scenario())
    stall.set()
    lane.close()


def test_progress_of_one_call_does_not_extend_the_deadline_of_another():
    """The leader queues batch k+1 while k runs, each with its own deadline from when it was
    queued: the running call's progress moves its own deadline only."""
    lane = Lane(0.3)

    def busy():
        for _ in range(10):  # 1 s of progress every 0.1 s
            time.sleep(0.1)
            lane.progress()
        return "done"

    async def scenario():
        running = lane.start(busy)
        queued = lane.start(lambda: "late")
        t0 = time.monotonic()
        with pytest.raises(GroupBroken, match="<lambda> passed its 0.3s deadline"):
            await queued
        assert time.monotonic() - t0 < 0.8, "the queued call kept its own deadline"
        assert await running == "done", "the running call's progress kept it alive"

    asyncio.run(scenario())
    lane.close()


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_outcomes_reach_every_loop_that_starts_calls_and_close_frees_the_bell(run):
    """Outcomes cross to the loop through the lane's eventfd (uvloop's call_soon_threadsafe
    wakes the loop with the GIL held): each call settles with its own result, errors stay
    errors, a lane outlives a loop (a new one takes the bell over), and close() frees it."""
    run(asyncio.sleep(0))  # uvloop's first loop in a process leaves a pipe of its own, for good
    fds = len(os.listdir("/proc/self/fd"))
    lane = Lane(5.0)

    async def burst(base: int) -> list:
        return await asyncio.gather(*(lane.run(lambda i=i: base + i) for i in range(50)))

    assert run(burst(0)) == list(range(50))
    assert run(burst(100)) == list(range(100, 150)), "a second loop gets its outcomes too"
    with pytest.raises(GroupBroken):
        run(lane.run(lambda: 1 / 0))
    lane.close()
    gc.collect()  # the loops' own descriptors go with them
    assert len(os.listdir("/proc/self/fd")) == fds
