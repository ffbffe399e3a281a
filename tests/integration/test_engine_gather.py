"""``EngineContext.gather`` at tp=2 (docs/engines.md): the runner's agreement rides in an
engine's own all-gather, and a rank that misuses it fails requests or breaks the group
cleanly, never pairs two collectives of different sizes (an outside attack found that
killed the leader by SIGABRT with every reply lost, or gave 200s read from the wrong bytes)."""

from __future__ import annotations

import os
import uuid

import pytest

from mmsched.client import Client, inline

from ..conftest import Server, pid_alive
from .gathering_engine import want_sum
from .lifecycle import feature, my_segments, sha256_of, wait_until
from .test_group import private_server  # noqa: F401 - the fixture: a group this test breaks

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE = ("--engine", "gathering_engine:GatheringEngine")


@pytest.fixture(scope="module")
def gathering(tmp_path_factory):
    with Server("--tp", "2", *ENGINE, tmp_dir=str(tmp_path_factory.mktemp("gather")),
                env={"PYTHONPATH": HERE}) as srv:
        yield srv


async def test_rows_failures_and_misuse_of_failed_are_agreed_in_the_gather(gathering):
    t = uuid.uuid4().hex[:6]
    async with Client(gathering.addr) as c:
        ok = await c.request("generate", [1, 2], [inline(feature(3))], rid=f"ok-{t}", want_digest=True, timeout=60)
        one = await c.request("generate", [1], rid=f"r1-{t}", params={"fail_on_rank": 1}, timeout=60)
        bad = await c.request("generate", [1], rid=f"bad-{t}", params={"mode": "bad_keys_r1"}, timeout=60)
        first = await c.request("generate", [1], rid=f"first-{t}", params={"mode": "fail_first_call_r1"}, timeout=60)
        again = await c.request("generate", [1], rid=f"again-{t}", timeout=60)
    assert ok.status == 200 and ok.output == {"sum": want_sum(f"ok-{t}")}, ok  # both ranks' rows of it
    assert ok.meta["digests"] == [sha256_of(feature(3))], ok.meta  # what the ranks read is what was sent
    assert (one.status, one.message, one.meta["failed_ranks"]) == (
        500, "Engine step failed (rank 1: ValueError: row 0 fails on rank 1)", [1]), one
    assert bad.status == 500 and bad.meta["failed_ranks"] == [1], bad  # a str key is no row: refused, not dropped
    assert "rank 1: TypeError: EngineContext.gather: failed must map rows 0..0 to errors" in bad.message, bad
    assert first.status == 500 and "found in the first gather" in first.message, first  # not forgotten
    assert again.status == 200, "the group serves on after each"
    assert my_segments() == set()


@pytest.mark.parametrize("mode, ring", [("raise_before_r0", True), ("skip_r1", True), ("raise_between_r0", True),
                                        ("extra_r1", True), ("extra_caught_r1", True), ("extra_r1", False)])
async def test_a_rank_out_of_step_with_its_peers_gathers_breaks_the_group_cleanly(private_server, mode, ring):  # noqa: F811
    """Never gathering, raising between two gathers, one gather more (its failure caught, too):
    each would pair one step's gather with another's (a 200 read from another request's rows, or gloo's abort
    on a size mismatch); the group breaks instead, every request answered. Without the batch ring,
    a follower's end of the step reaches the leader by a gloo message instead of a ring word."""
    srv = private_server("--tp", "2", *ENGINE, "--collective-timeout", "2", *(() if ring else ("--no-batch-ring",)),
                         env={"PYTHONPATH": HERE})
    pids = srv.rank_pids()
    async with Client(srv.addr) as c:
        results = []
        for i in range(4):  # one batch each, of one request, text only (no consensus on the runner's
            # group in between): the gathers of two steps have one size and could pair
            fut = c.send_request("generate", [i], rid=f"{mode}-{i}", params={"mode": mode})
            results.append(await c.wait(f"{mode}-{i}", fut, 30))
    statuses = sorted(r.status for r in results)
    assert set(statuses) <= {200, 500, 503} and 500 in statuses, results  # every request answered
    # (a 200 would have to carry the rows of both ranks)
    assert all(r.output == {"sum": want_sum(r.rid)} for r in results if r.status == 200), results
    assert 200 not in statuses, results  # extra_r1 too: the leader waits for the follower to end its step
    assert all("broken" in r.message for r in results if r.status == 500), results
    assert srv.proc.wait(timeout=30) == 3, srv.logs()[-3000:]  # not 250: no rank died of SIGABRT
    assert "terminate called" not in srv.logs()
    wait_until(lambda: not any(pid_alive(p) for p in pids), 10, "every rank exits")
    assert my_segments() == set()
