"""bench/floor_server.py, the tp=2 floor ``make bench`` prints beside the latency targets:
it answers every request with its own rid (a floor that dropped or mixed up answers would
flatter itself), and killing it leaves no rank behind."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

from mmsched.client import Client

from ..conftest import Server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _procs_of(script: str) -> set[int]:
    out = subprocess.run(["pgrep", "-f", script], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def test_the_floor_server_answers_each_request_and_leaves_no_rank_behind(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import sync_client
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    addr = f"ipc://{tmp_path}/floor-{uuid.uuid4().hex[:6]}.sock"
    script = os.path.join(ROOT, "bench", "floor_server.py")
    model = ["--loop-us", "5", "--lane-us", "5", "--follower-us", "5"]  # the model's spins run too (rank 1's by its own flag)
    proc = subprocess.Popen([sys.executable, script, "--frontend", addr, *model], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(addr.removeprefix("ipc://")) and time.monotonic() < deadline:
            assert proc.poll() is None, "the floor server exited before it listened"
            time.sleep(0.1)
        r = sync_client.open_loop(addr, 500, 1.0)  # _ok checks each answer's rid against what was sent
        assert r["completed"] == r["sent"] == 500 and r["bad"] == r["lost"] == 0, r
        ranks = {p for p in _procs_of(addr) if p != os.getpid()}
        assert len(ranks) == 2, ranks  # rank 0 and the rank 1 it started
    finally:
        proc.kill()  # rank 0 only: rank 1 must notice by itself
        proc.wait()
    deadline = time.monotonic() + 40  # rank 1 sees the group break (at once: the peer's socket closed)
    while _procs_of(addr) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _procs_of(addr), "rank 1 outlived rank 0"


async def test_the_gather_only_engine_answers_every_request_at_tp2(tmp_path):
    """bench/gather_engine.py, which ``make bench`` serves beside the reference engine: each rank
    passes the step's gather, and every request gets a 200 (an embedding of one zero; a
    ``generate`` no tokens), none lost or mixed up."""
    with Server("--tp", "2", "--engine", "bench.gather_engine:GatherEngine", tmp_dir=str(tmp_path),
                env={"PYTHONPATH": ROOT}) as srv:
        async with Client(srv.addr) as client:
            rids = [f"g{i}" for i in range(40)]
            got = await asyncio.gather(*(client.request("embed" if i % 4 else "generate", [i, 1, 2], rid=rid)
                                         for i, rid in enumerate(rids)))
    assert [r.rid for r in got] == rids and {r.status for r in got} == {200}
    assert all(r.output == ({"embedding": bytes(4), "dim": 1} if i % 4 else {"output_ids": []})
               for i, r in enumerate(got))
