"""When the load generator takes a connection for a replaced one (its replies lost): only a
connection made after those the run started with. The client's monitor is stood in for by
its two readings, ``connection_lost()`` and ``connections``; tests/integration/test_loadgen.py
runs the same against real servers."""

from __future__ import annotations

import asyncio
import math
import random
import time

from mmsched.loadgen import LoadSpec
from mmsched.loadgen.loop import Run


class Monitor:
    """A client's connection as its monitor tells it: lost or not, connections made so far."""

    def __init__(self, connections: int):
        self.connections, self.lost = connections, False

    def connection_lost(self) -> bool:
        return self.lost


def run_with(monitor: Monitor) -> tuple[Run, list[float]]:
    r = Run(LoadSpec(frontend="ipc:///nowhere", rate=100, items=0, drain_s=1), monitor, random.Random(0))
    replaced: list[float] = []
    r._replaced = lambda: replaced.append(time.perf_counter())
    return r, replaced


def test_the_connections_made_before_the_run_replace_nothing():
    for before in (0, 1, 2, 5):  # 0: the monitor not read yet; 2, 5: a client that reconnected before
        monitor = Monitor(before)
        r, replaced = run_with(monitor)
        r.start_watching()
        if before == 0:
            monitor.connections = 1  # the first connection, read late
        r._look()
        assert replaced == [], before
        monitor.connections += 1  # one made during the run
        r._look()
        r._look()
        assert len(replaced) == 1, before


async def test_a_reconnect_seen_by_another_look_still_keeps_the_run_going():
    """The connection drops every 50 ms and comes back 20 ms later; the open loop's own look
    sees each new connection, the watcher (every 50 ms) only ever looks while it is down.
    It must still see that connections were made, not end the run after LATE_S."""
    monitor = Monitor(1)
    r, _ = run_with(monitor)
    r.start_watching()
    r.t0, r.send_until = time.perf_counter(), math.inf
    watcher = asyncio.ensure_future(r.watch_connection())
    t0 = time.perf_counter()
    try:
        monitor.lost = True
        await asyncio.sleep(0.01)
        while time.perf_counter() - t0 < 1.5 and not r.all_done.is_set():
            await asyncio.sleep(0.02)
            monitor.lost, monitor.connections = False, monitor.connections + 1
            r._checked_at = -math.inf
            r._paused()  # the open loop's look
            await asyncio.sleep(0.005)
            monitor.lost = True
            await asyncio.sleep(0.025)
        assert r.stopped_by is None, (r.stopped_by, monitor.connections)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
