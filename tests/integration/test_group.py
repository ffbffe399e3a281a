"""Real rank groups (gloo over 127.0.0.1, 1, 2 and 4 processes): per-request failure scoping,
cross-rank determinism, a loop that stays responsive during slow collectives, and what a
dead or hung rank does to the group.

Groups are expensive on a 2-core machine (each rank imports torch), so the groups that
tests do not break are started once per module, with every fault glob the tests need;
the tests that break or stop a group start their own.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from mmsched.client import Client, Result, inline, shm

from ..conftest import free_port, Server, sync_ping
from ..conftest import pid_alive as alive

VENV_BIN = os.path.dirname(sys.executable)

# One fault glob per test family; every shared group carries all of them.
SHARED_ARGS = (
    "--max-batch", "64",
    "--fault", "1:open:f1-*",          # mixed batch: fails on rank 1 only
    "--fault", "0:materialize:f0-*",   # mixed batch: fails on rank 0 only
    "--fault", "1:stall:slow-*",       # ping during a slow collective; holding a batch back
    "--fault", "1:engine:eng-*",       # engine failure on one rank
    "--fault", "1:release:rel-*",      # release failures (follower and leader)
    "--fault", "0:release:rel0-*",
    "--fault", "1:corrupt:bad1-*",     # rank 1 holds other bytes than rank 0
    "--fault", "0:corrupt:bad0-*",     # rank 0 holds other bytes than the followers
    "--stall-s", "3",
)


# ---------------------------------------------------------------- helpers

def my_segments() -> set[str]:
    """Segments this test process created (the name carries the creator's pid)."""
    mine = f"mmsched_{os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(mine)}


def sha256_of(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def feature(seed: int, shape=(8, 32)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def named_ranks(message: str) -> list[int]:
    """The ranks a 500's message blames: ``(rank 1: InjectedFault: ...; rank 3: ...)``."""
    return sorted(int(r) for r in re.findall(r"rank (\d+): ", message))






def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.05)


def wait_log(srv: Server, pattern: str, timeout: float = 10.0) -> None:
    wait_until(lambda: re.search(pattern, srv.logs(), re.M), timeout,
               f"log line matching {pattern!r}; log:\n{srv.logs()}")


async def results(c: Client, futs: dict[str, asyncio.Future], timeout: float = 30.0) -> dict[str, Result]:
    return {rid: await c.wait(rid, f, timeout) for rid, f in futs.items()}


async def no_extra_results(c: Client) -> None:
    """A ping's pong travels the same pipe after every earlier reply: a duplicate result
    for a finished request would be in ``unrouted`` by the time the pong is here."""
    await c.ping(timeout=10)
    assert c.unrouted == [], [(r.rid, r.status) for r in c.unrouted]


async def hold_lane(c: Client, tag: str) -> asyncio.Future:
    """Send a request that stalls rank 1 for --stall-s inside the engine collective.

    Everything sent in the next seconds queues at the leader behind it, so those requests
    form the next batch together (max_batch 256 ≥ what a test sends)."""
    fut = c.send_request("embed", [7], [], rid=f"slow-hold-{tag}")
    await asyncio.sleep(0.5)  # let the leader put it on the lane
    return fut


async def one_batch(c: Client, tag: str, send) -> tuple[dict[str, Result], dict]:
    """Behind a held lane, ``send()`` (rid -> future) forms one batch: its results, then a pong."""
    hold = await hold_lane(c, tag)
    futs = send()
    assert not hold.done(), "the held batch finished before the next batch was queued"
    got = await results(c, futs)
    await c.wait(f"slow-hold-{tag}", hold)
    await no_extra_results(c)
    return got, await c.ping(timeout=10)


# ---------------------------------------------------------------- shared groups

@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """``group(tp)``: a ready module-wide group of tp ranks with SHARED_ARGS, started on first use."""
    tmp = str(tmp_path_factory.mktemp("groups"))
    started: dict[int, Server] = {}

    def get(tp: int) -> Server:
        if tp not in started:
            srv = Server("--tp", str(tp), *SHARED_ARGS, tmp_dir=tmp)
            started[tp] = srv
            srv.wait_ready(timeout=90)
        return started[tp]

    yield get
    for srv in started.values():
        try:
            srv.stop(timeout=30)
        finally:
            srv.kill_all()


@pytest.fixture
def private_server(tmp_path):
    """Factory for a group this test breaks or stops; always reaped (process group killed)."""
    servers: list[Server] = []

    def start(*args: str, cls=Server, **kw) -> Server:
        srv = cls(*args, tmp_dir=str(tmp_path), **kw)
        servers.append(srv)
        srv.wait_ready(timeout=90)
        return srv

    yield start
    for srv in servers:
        srv.kill_all()


# ---------------------------------------------------------------- failures scoped to their request

@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])  # tp=4 (slow): same logic, twice the ranks
async def test_mixed_batch_failures_are_scoped_to_their_rank(group, tp):
    srv = group(tp)
    tag = uuid.uuid4().hex[:6]
    tensors = {f"f1-{tag}": feature(1), f"f0-{tag}": feature(2),
               f"ok-{tag}-a": feature(3), f"ok-{tag}-b": feature(4, (3, 5, 7))}
    assert my_segments() == set()
    async with Client(srv.addr) as c:
        hold = await hold_lane(c, tag)
        futs = {rid: c.send_request("embed", [1, 2, 3, tp], [shm(t)], rid=rid, want_digest=True)
                for rid, t in tensors.items()}
        # every request carries a real segment, and they all wait behind the held batch
        assert len(my_segments()) == len(tensors)
        assert not hold.done(), "the held batch finished before the mixed batch was queued"
        got = await results(c, futs)
        assert (await c.wait(f"slow-hold-{tag}", hold)).status == 200
        await no_extra_results(c)
        pong = await c.ping(timeout=10)

    f1, f0 = got[f"f1-{tag}"], got[f"f0-{tag}"]
    assert (f1.status, f1.err_type) == (500, "InternalServerError"), f1
    assert f1.meta["failed_ranks"] == [1], (f1.meta, f1.message)
    assert named_ranks(f1.message) == [1], f1.message
    assert "InjectedFault" in f1.message and "open" in f1.message
    assert (f0.status, f0.err_type) == (500, "InternalServerError"), f0
    assert f0.meta["failed_ranks"] == [0], f0.meta
    assert named_ranks(f0.message) == [0], f0.message
    assert "materialize" in f0.message
    for rid in (f"ok-{tag}-a", f"ok-{tag}-b"):
        r = got[rid]
        assert r.status == 200, (rid, r.message)
        assert r.meta["ranks"] == tp
        assert r.meta["digests"] == [sha256_of(tensors[rid])]
        assert r.output["dim"] == len(r.embedding) > 0
    # segments are gone once results are out (the leader unlinks right after the consensus)
    assert my_segments() == set()
    assert pong["healthy"] is True and pong["ranks"] == tp, pong


async def test_ranks_holding_different_bytes_get_a_digest_mismatch_500(group):
    """The consensus compares every rank's digests with rank 0's: a rank whose copy differs
    fails its request (500 DigestMismatch naming the ranks that differ from rank 0), the
    batch mates are served with the client's own bytes, and every segment is unlinked."""
    srv = group(2)
    tag = uuid.uuid4().hex[:6]
    tensors = {f"bad1-{tag}": feature(30), f"bad0-{tag}": feature(31), f"ok-{tag}": feature(32)}
    async with Client(srv.addr) as c:
        got, pong = await one_batch(c, tag, lambda: {
            rid: c.send_request("embed", [3], [shm(t), inline(t[:1])], rid=rid, want_digest=True)
            for rid, t in tensors.items()})
    for rid in (f"bad1-{tag}", f"bad0-{tag}"):  # with two ranks, rank 1 is the one that differs
        r = got[rid]
        assert (r.status, r.err_type) == (500, "InternalServerError"), (rid, r.status, r.message)
        assert r.message == "Multimodal feature reconstruction failed (rank 1: DigestMismatch: bytes differ " \
                            "from rank 0's)", r.message
        assert r.meta == {"failed_ranks": [1], "stage": "materialize"}, r.meta
    ok, t = got[f"ok-{tag}"], tensors[f"ok-{tag}"]
    assert ok.status == 200, ok.message
    assert ok.meta["digests"] == [sha256_of(t), sha256_of(t[:1])]
    assert my_segments() == set()
    assert pong["healthy"] is True


async def test_engine_failure_on_one_rank_fails_only_that_request(group):
    srv = group(2)
    tag = uuid.uuid4().hex[:6]
    tensors = {f"eng-{tag}": feature(10), f"ok-{tag}-1": feature(11), f"ok-{tag}-2": feature(12)}
    async with Client(srv.addr) as c:
        got, pong = await one_batch(c, tag, lambda: {
            rid: c.send_request("generate", [5, 6, 7], [shm(t)], rid=rid, want_digest=True,
                                params={"max_new_tokens": 4})
            for rid, t in tensors.items()})
    bad = got[f"eng-{tag}"]
    assert bad.status == 500, bad
    assert bad.meta["stage"] == "engine"
    assert bad.meta["failed_ranks"] == [1]
    assert named_ranks(bad.message) == [1], bad.message
    assert "engine" in bad.message
    for rid in (f"ok-{tag}-1", f"ok-{tag}-2"):
        assert got[rid].status == 200, got[rid]
        assert len(got[rid].output["output_ids"]) == 4
        assert got[rid].meta["digests"] == [sha256_of(tensors[rid])]
    assert my_segments() == set()
    assert pong["healthy"] is True


async def test_release_failures_are_logged_and_do_not_change_the_result(group):
    srv = group(2)
    tag = uuid.uuid4().hex[:6]
    tensors = {f"rel-{tag}": feature(20), f"rel0-{tag}": feature(21)}
    async with Client(srv.addr) as c:
        futs = {rid: c.send_request("embed", [9, 9], [shm(t)], rid=rid, want_digest=True)
                for rid, t in tensors.items()}
        got = await results(c, futs)
        await no_extra_results(c)
    for rid, t in tensors.items():
        assert got[rid].status == 200, got[rid]
        assert got[rid].meta["digests"] == [sha256_of(t)]
    assert my_segments() == set()  # the injected release failure still released and unlinked
    wait_log(srv, rf"\[rank1\] release_failed rid=rel-{tag} ")
    wait_log(srv, rf"\[rank0\] release_failed rid=rel0-{tag} ")
    assert not re.search(rf"\[rank0\] release_failed rid=rel-{tag} ", srv.logs())
    assert sync_ping(srv.addr, 5.0)["healthy"] is True


# ---------------------------------------------------------------- the same answer for any tp

async def test_tp1_tp2_tp4_give_the_same_outputs(group):
    t = feature(30, (4, 16, 16))
    other = feature(31, (4, 16, 16))
    ids = [101, 7, 3000, 42, 42, 9]
    outs = {}
    for tp in (1, 2, 4):
        async with Client(group(tp).addr) as c:
            e = await c.embed(ids, [shm(t)], rid="same-embed", timeout=30)
            g = await c.generate(ids, [shm(t)], max_new_tokens=12, rid="same-gen", timeout=30)
            e2 = await c.embed(ids, [inline(other)], rid="same-other", timeout=30)
        assert (e.status, g.status, e2.status) == (200, 200, 200), (e.message, g.message, e2.message)
        assert e.meta["ranks"] == g.meta["ranks"] == tp
        outs[tp] = (e.embedding, g.output["output_ids"], e2.embedding)
    emb1, ids1, other1 = outs[1]
    assert len(ids1) == 12
    # the output depends on the feature bytes (or the comparison below would prove little)
    assert not torch.allclose(emb1, other1, atol=1e-3)
    for tp in (2, 4):
        emb, gen, oth = outs[tp]
        assert torch.allclose(emb, emb1, atol=1e-5), (tp, (emb - emb1).abs().max())
        assert torch.allclose(oth, other1, atol=1e-5), tp
        assert gen == ids1, (tp, gen, ids1)
    assert my_segments() == set()


# ---------------------------------------------------------------- the loop stays free

async def test_ping_is_answered_while_a_rank_is_held_in_a_collective(group):
    srv = group(2)
    async with Client(srv.addr) as c:
        slow = c.send_request("embed", [1, 2], [shm(feature(40))], rid="slow-1")
        await asyncio.sleep(0.5)  # rank 1 now sleeps 3 s before the engine collective; rank 0 waits in it
        pong = await c.ping(timeout=10)
        assert not slow.done(), "the slow request finished before the ping was answered"
        assert pong["healthy"] is True and pong["ranks"] == 2
        r = await c.wait("slow-1", slow, 30)
        assert r.status == 200, r
        await no_extra_results(c)
    assert my_segments() == set()


# ---------------------------------------------------------------- a dead or hung rank

async def test_follower_killed_mid_collective_breaks_the_group_cleanly(private_server):
    timeout = 5.0
    srv = private_server("--tp", "2", "--collective-timeout", str(timeout),
                         "--fault", "1:stall:hold-*", "--stall-s", "60")
    pids = srv.rank_pids()
    assert len(pids) == 2 and all(alive(p) for p in pids)
    async with Client(srv.addr) as c:
        inflight = c.send_request("embed", [1], [shm(feature(50))], rid="hold-1")
        await asyncio.sleep(0.5)  # hold-1 is inside the engine collective; rank 1 sleeps in it
        queued = {rid: c.send_request("embed", [2], [shm(feature(51))], rid=rid) for rid in ("q-1", "q-2")}
        await asyncio.sleep(0.2)
        assert not inflight.done() and not any(f.done() for f in queued.values())
        os.kill(pids[1], signal.SIGKILL)
        new = c.send_request("embed", [3], [shm(feature(52))], rid="new-1")
        bound = timeout + 5
        r_in = await c.wait("hold-1", inflight, bound)
        r_q = await results(c, queued, bound)
        r_new = await c.wait("new-1", new, bound)
        pong = sync_ping(srv.addr, 0.5)
    assert r_in.status == 500, r_in
    assert "broken" in r_in.message
    for r in (*r_q.values(), r_new):
        assert (r.status, r.err_type) == (503, "ServiceUnavailable"), r
    # the leader reports unhealthy until it exits
    assert pong is None or pong["healthy"] is False, pong
    rc = srv.proc.wait(timeout=timeout + 10)
    assert rc != 0, srv.logs()
    wait_until(lambda: not any(alive(p) for p in pids), 10, "every rank process exits")
    assert my_segments() == set()


async def test_collective_past_its_deadline_breaks_the_group(private_server):
    srv = private_server("--tp", "2", "--collective-timeout", "3",
                         "--fault", "1:stall:hang-*", "--stall-s", "20")
    pids = srv.rank_pids()
    async with Client(srv.addr) as c:
        r = await c.request("embed", [1, 2, 3], [shm(feature(60))], rid="hang-1", timeout=10)
        assert r.status == 500 and r.message.startswith("rank group broken"), r
        # the lane's deadline and the wait in the engine's gather (shared memory on one host;
        # gloo's own timeout without the ring), the same 3 s, race: either may say it
        assert re.search(r"deadline|Timed out waiting 3000ms|engine gather: rank 1 did not gather within 3 s",
                         r.message), r.message
        # a new request now: 503 while the leader lingers, or no answer once it is gone.
        # (inline, so a server that is gone leaves nothing in /dev/shm)
        new = c.send_request("embed", [4], [inline(feature(61))], rid="new-1")
        try:
            r_new = await c.wait("new-1", new, 3)
        except asyncio.TimeoutError:
            r_new = None
            assert srv.proc.poll() is not None or not alive(pids[0]), "no answer, yet the leader runs"
        if r_new is not None:
            assert r_new.status == 503, r_new
    pong = sync_ping(srv.addr, 0.5)
    assert pong is None or pong["healthy"] is False, pong
    rc = srv.proc.wait(timeout=15)
    assert rc != 0, srv.logs()
    wait_until(lambda: not any(alive(p) for p in pids), 10, "every rank process exits")
    assert my_segments() == set()


async def test_a_follower_serving_longer_than_its_deadline_stays_in_the_group(private_server):
    """The follower runs batch after batch inside one lane call; each batch done restarts
    that call's deadline. Batches and idle heartbeats for four times the deadline: every
    request a 200 with the client's bytes on both ranks, and the group still healthy."""
    srv = private_server("--tp", "2", "--collective-timeout", "1")  # follower deadline 1.25 s
    pids = srv.rank_pids()
    end = time.monotonic() + 5.0
    n = 0
    async with Client(srv.addr) as c:
        while time.monotonic() < end:
            t = feature(900 + n)
            r = await c.embed([n, 1], [shm(t)], want_digest=True, timeout=10)
            assert r.status == 200 and r.meta["ranks"] == 2, (n, r)
            assert r.meta["digests"] == [sha256_of(t)], n
            n += 1
            await asyncio.sleep(0.6 if n % 10 == 0 else 0.01)  # idle spells: the heartbeats carry on
        pong = await c.ping(timeout=5)
    assert n >= 50, n
    assert pong["healthy"] is True and pong["ranks"] == 2, pong
    assert all(alive(p) for p in pids)
    assert "group_broken" not in srv.logs(), srv.logs()[-3000:]
    assert my_segments() == set()


# ---------------------------------------------------------------- signals

async def test_follower_ignores_signals_and_launcher_sigterm_exits_zero(private_server):
    srv = private_server("--tp", "2")
    pids = srv.rank_pids()
    os.kill(pids[1], signal.SIGTERM)
    os.kill(pids[1], signal.SIGINT)
    await asyncio.sleep(0.5)
    assert alive(pids[1]), "the follower died of a signal the leader should decide on"
    async with Client(srv.addr) as c:
        t = feature(70)
        r = await c.embed([1, 2], [shm(t)], want_digest=True, timeout=30)
    assert r.status == 200 and r.meta["ranks"] == 2, r
    assert r.meta["digests"] == [sha256_of(t)]
    assert sync_ping(srv.addr, 5.0)["healthy"] is True
    assert srv.stop(signal.SIGTERM, timeout=30) == 0, srv.logs()
    wait_until(lambda: not any(alive(p) for p in pids), 10, "every rank process exits")


# ---------------------------------------------------------------- torchrun

class TorchrunServer(Server):
    """``torchrun --nproc-per-node 2 -m mmsched serve`` on a private ipc:// address."""

    def __init__(self, *args: str, tmp_dir: str, env: dict | None = None):
        self.addr = f"ipc:///tmp/mmsched-test-{uuid.uuid4().hex[:10]}.sock"
        self.log_path = os.path.join(tmp_dir, f"torchrun-{uuid.uuid4().hex[:6]}.log")
        self._log = open(self.log_path, "wb")
        clean_env = {k: v for k, v in os.environ.items()
                     if not k.startswith(("MMSCHED_", "TORCHELASTIC_"))
                     and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        clean_env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **(env or {}))
        self.proc = subprocess.Popen(
            [os.path.join(VENV_BIN, "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(free_port()), "-m", "mmsched", "serve", "--frontend", self.addr, *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=clean_env, start_new_session=True)


async def test_group_under_torchrun(private_server):
    srv = private_server(cls=TorchrunServer)
    t = feature(80)
    async with Client(srv.addr) as c:
        r = await c.embed([5, 4, 3], [shm(t)], want_digest=True, timeout=30)
    assert r.status == 200, r
    assert r.meta["ranks"] == 2
    assert r.meta["digests"] == [sha256_of(t)]
    assert my_segments() == set()
    srv.stop(signal.SIGTERM, timeout=30)
    assert "[rank0] stopped" in srv.logs(), srv.logs()
