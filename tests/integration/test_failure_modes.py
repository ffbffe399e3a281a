"""Fault drills that back rows of docs/failure-modes.md no other test covers.

- open and engine faults on the leader, a materialize fault on a follower (tests/integration/
  test_group.py covers the other rank of each stage);
- a stall on the leader: the follower waits inside the collective, the loop stays free;
- a client that goes away mid-request: the request still completes and its segment is unlinked;
- the leader killed: the follower exits non-zero, so does the launcher, clients get nothing,
  and ``mmsched sweep`` reclaims the segments the dead leader held.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import msgpack
import pytest
import zmq

from mmsched.client import Client, raw
from mmsched.producers import create_segment

from ..conftest import free_port, Server, sync_ping
from ..conftest import pid_alive as alive

SHM = "/dev/shm"
STALL_S = 2






def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.05)
    return got


def http(srv: Server, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{srv.admin}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(srv: Server, sample: str) -> float:
    """The value of one exposition line, e.g. ``mmsched_results_total{status="200"}`` (0 when absent)."""
    text = http(srv, "/metrics")[1]
    m = re.search(rf"^{re.escape(sample)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def segment_item(nbytes: int = 256) -> tuple[dict, object]:
    seg = create_segment(os.urandom(nbytes))
    return {"modality": "image", "transport": "shm", "dtype": "uint8", "shape": [nbytes], "shm_name": seg.name}, seg


def gone(seg) -> bool:
    return not os.path.exists(os.path.join(SHM, seg.name))


@pytest.fixture(scope="module")
def drills(tmp_path_factory):
    port = free_port()
    srv = Server("--tp", "2", "--collective-timeout", "20", "--stall-s", str(STALL_S), "--admin", str(port),
                 "--fault", "0:open:lo-*", "--fault", "1:materialize:fm-*", "--fault", "0:engine:le-*",
                 "--fault", "0:stall:ls-*", "--fault", "1:stall:cg-*",
                 tmp_dir=str(tmp_path_factory.mktemp("drills")))
    srv.admin = f"http://127.0.0.1:{port}"
    with srv:
        srv.pids = srv.rank_pids()
        yield srv


# ---------------------------------------------------------------- faults at each stage, on the other rank

async def test_open_and_engine_faults_on_the_leader_and_materialize_on_a_follower(drills):
    tag = uuid.uuid4().hex[:6]
    rids = [f"lo-{tag}", f"fm-{tag}", f"le-{tag}", f"ok-{tag}"]
    before_open = metric(drills, 'mmsched_materialize_failures_total{rank="0",stage="open"}')
    before_engine = metric(drills, 'mmsched_materialize_failures_total{rank="0",stage="engine"}')
    before_mat = metric(drills, 'mmsched_materialize_failures_total{rank="1",stage="materialize"}')
    segs = {}
    async with Client(drills.addr) as c:
        futs = {}
        for rid in rids:
            item, segs[rid] = segment_item()
            futs[rid] = c.send_request("generate", [1, 2, 3], [raw(item)], rid=rid, params={"max_new_tokens": 3})
            segs[rid].sent()
        got = {rid: await c.wait(rid, f, 30) for rid, f in futs.items()}
        await c.ping(timeout=10)
        assert c.unrouted == []
    lo, fm, le, ok = (got[r] for r in rids)
    assert (lo.status, lo.meta["failed_ranks"], lo.meta["stage"]) == (500, [0], "materialize"), lo
    assert "rank 0: InjectedFault: injected open fault on rank 0" in lo.message, lo.message
    assert (fm.status, fm.meta["failed_ranks"], fm.meta["stage"]) == (500, [1], "materialize"), fm
    assert "rank 1: InjectedFault: injected materialize fault on rank 1" in fm.message, fm.message
    assert (le.status, le.meta["failed_ranks"], le.meta["stage"]) == (500, [0], "engine"), le
    assert "injected engine fault on rank 0" in le.message, le.message
    assert ok.status == 200 and len(ok.output["output_ids"]) == 3, ok
    assert all(gone(s) for s in segs.values()), "a failed request's segment was not unlinked"
    # what the operator sees: one log line per 500 at the leader, counters by rank and stage, /health 200
    logs = drills.logs()
    for rid, ranks in ((f"lo-{tag}", "[0]"), (f"fm-{tag}", "[1]"), (f"le-{tag}", "[0]")):
        assert re.search(rf"\[rank0\] request_failed rid={rid} failed_ranks={re.escape(ranks)}", logs), rid
    assert metric(drills, 'mmsched_materialize_failures_total{rank="0",stage="open"}') == before_open + 1
    assert metric(drills, 'mmsched_materialize_failures_total{rank="0",stage="engine"}') == before_engine + 1
    wait_until(lambda: metric(drills, 'mmsched_materialize_failures_total{rank="1",stage="materialize"}')
               == before_mat + 1, 15, "rank 1's materialize failure reaches /metrics")
    assert http(drills, "/health")[0] == 200


async def test_stall_on_the_leader_keeps_the_frontend_and_health_answering(drills):
    """Rank 0 sleeps before its engine collective; rank 1 waits inside it. The leader's loop
    (which is not the lane) keeps answering pings, /health and other clients' 400s."""
    item, seg = segment_item()
    async with Client(drills.addr) as c:
        fut = c.send_request("embed", [4, 5], [raw(item)], rid="ls-1")
        seg.sent()
        wait_until(lambda: metric(drills, "mmsched_requests_running") == 1, 10, "ls-1 on the lane")
        pong = await c.ping(timeout=5)
        health = http(drills, "/health")
        bad = await c.request("embed", [], rid="bad-during-stall", timeout=5)
        assert not fut.done(), f"ls-1 finished within {STALL_S}s before the checks"
        r = await c.wait("ls-1", fut, 30)
    assert pong["healthy"] is True and pong["ranks"] == 2
    assert health[0] == 200, health
    assert bad.status == 400
    assert r.status == 200, r
    assert gone(seg)


# ---------------------------------------------------------------- a client that goes away

def test_client_gone_mid_request_still_completes_and_releases(drills):
    """The client sends, then closes its socket while rank 1 holds the request. The request
    runs to its end, its segment is unlinked, the result is dropped by ZeroMQ (no peer), and
    nothing else notices."""
    ok_before = metric(drills, 'mmsched_results_total{status="200"}')
    item, seg = segment_item(4096)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.connect(drills.addr)
    s.send(msgpack.packb({"v": 1, "type": "embed", "rid": "cg-gone", "input_ids": [1, 2], "mm_items": [item]}))
    seg.sent()
    wait_until(lambda: metric(drills, "mmsched_requests_running") == 1, 10, "cg-gone on the lane")
    s.close(linger=0)  # gone mid-request
    wait_until(lambda: gone(seg), 30, "the gone client's segment is unlinked")
    wait_until(lambda: metric(drills, 'mmsched_results_total{status="200"}') == ok_before + 1, 30,
               "the gone client's request completes (its 200 is counted)")
    assert metric(drills, "mmsched_requests_running") == 0
    assert metric(drills, "mmsched_feature_bytes_inflight") == 0
    assert sync_ping(drills.addr, 5.0)["healthy"] is True
    assert all(alive(p) for p in drills.pids)


# ---------------------------------------------------------------- the leader killed

async def test_leader_killed_follower_and_launcher_exit_nonzero_and_sweep_reclaims(tmp_path):
    srv = Server("--tp", "2", "--collective-timeout", "5", "--fault", "0:stall:hold-*", "--stall-s", "60",
                 tmp_dir=str(tmp_path))
    try:
        srv.wait_ready(timeout=90)
        pids = srv.rank_pids()
        prefix = f"mmsched_{os.getpid()}_"
        async with Client(srv.addr) as c:
            h_item, h_seg = segment_item()
            hold = c.send_request("embed", [1], [raw(h_item)], rid="hold-1")
            h_seg.sent()
            await asyncio.sleep(0.5)  # hold-1 is on the lane: rank 0 sleeps, rank 1 waits in the collective
            q_item, q_seg = segment_item()
            queued = c.send_request("embed", [2], [raw(q_item)], rid="queued-1")  # waits at the leader
            q_seg.sent()
            await asyncio.sleep(0.2)
            assert not hold.done() and not queued.done()
            os.kill(pids[0], signal.SIGKILL)
            # the follower's collective fails at once (the peer is gone): it exits non-zero
            wait_until(lambda: not alive(pids[1]), 20, "the follower exits after the leader is killed")
            rc = srv.proc.wait(timeout=20)
            # the client gets nothing: there is nobody left to answer
            waits = await asyncio.gather(c.wait("hold-1", hold, 1.0), c.wait("queued-1", queued, 1.0),
                                         return_exceptions=True)
        assert all(isinstance(w, asyncio.TimeoutError) for w in waits), waits
        assert rc == 128 + signal.SIGKILL, (rc, srv.logs()[-2000:])  # as a shell says it: 137
        logs = srv.logs()
        m = re.search(r"group_exited codes=(-?\d+),(-?\d+)", logs)
        assert m and int(m.group(1)) == -signal.SIGKILL and int(m.group(2)) != 0, logs[-2000:]
        assert re.search(r"\[rank1\] group_broken", logs), logs[-2000:]
        assert sync_ping(srv.addr, 0.5) is None
        # hold-1's segment was unlinked after its consensus; queued-1's was only held by the dead
        # leader: an orphan, unlocked now, which the sweep reclaims
        assert gone(h_seg)
        assert not gone(q_seg)
        out = subprocess.run([sys.executable, "-m", "mmsched", "sweep", "--shm-prefix", prefix, "--grace", "0"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"reclaimed {q_seg.name}" in out.stdout, out.stdout
        assert gone(q_seg)
    finally:
        srv.kill_all()


# ---------------------------------------------------------------- the doc these drills back

def test_every_row_of_the_failure_modes_doc_names_tests_that_exist():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "failure-modes.md"), encoding="utf-8") as fh:
        rows = [ln for ln in fh if ln.startswith("| **")]
    assert len(rows) >= 30, len(rows)
    for row in rows:
        cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row)
        assert cited, f"a row without a backing test: {row[:80]}"
        for path, name in cited:
            with open(os.path.join(root, path), encoding="utf-8") as fh:
                source = fh.read()
            assert re.search(rf"^(async )?def {name}\(", source, re.M), f"{path}::{name} does not exist"
