"""Both open-loop clients wait for their next arrival instead of spinning: a client that
spins takes a core, and on a 2-core host that is half of what the server it measures has
(found in issue 13: pyzmq truncates a float poll timeout and uvloop runs a delay under
0.5 ms at once, so every wait at 1000 req/s spun; each client used 0.8-1.0 of a core).
Against the bare ROUTER, whose answers cost the client nothing to wait for."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from mmsched.loadgen import LoadSpec, loop
from mmsched.loadgen.runner import run_sync

from ..conftest import bare_router

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECONDS = 2.0


@pytest.fixture(scope="module")
def bare():
    with bare_router() as addr:
        yield addr


def test_the_load_generators_open_loop_leaves_the_cores_to_the_server(bare, monkeypatch):
    # 2000 req/s: every wait is under 0.5 ms (the load generator's own work is ~0.3 ms a request:
    # about half a core; spinning, it used all of one)
    rate = 2000
    waits: list[float] = []
    sleep = asyncio.sleep

    def counted(delay, *args, **kwargs):
        waits.append(delay)
        return sleep(delay, *args, **kwargs)

    monkeypatch.setattr(loop.asyncio, "sleep", counted)
    spec = LoadSpec(frontend=bare, rate=rate, requests=10**6, duration=SECONDS, drain_s=5, items=0, seed=1)
    cpu, wall = time.process_time(), time.perf_counter()
    report = run_sync(spec)
    cores = (time.process_time() - cpu) / (time.perf_counter() - wall)
    s = report.summary
    assert s["sent"] >= 0.9 * rate * SECONDS and s["lost"] == 0, s  # it kept the schedule
    # a wait under 0.5 ms is no wait under uvloop (it rounds to whole ms): the spin, counted
    # exactly (the old loop made thousands); a pause between bursts (0) only lets results in
    spins = [w for w in waits if 0 < w < 0.0005]
    assert not spins, f"{len(spins)} waits under 0.5 ms, which uvloop does not wait"
    assert cores < 0.95, f"the load generator used {cores:.2f} of a core at {rate} req/s"


def test_the_plain_clients_open_loop_leaves_the_cores_to_the_server(bare):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import sync_client
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    rate = 1000  # every wait under 1 ms: truncated, each was a poll(0)
    r = sync_client.open_loop(bare, rate, SECONDS)
    assert r["completed"] == r["sent"] == rate * SECONDS and r["bad"] == 0, r
    assert r["client_cores"] < 0.5, f"the plain client used {r['client_cores']:.2f} of a core at {rate} req/s"
