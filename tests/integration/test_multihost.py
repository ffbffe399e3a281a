"""A rank group over two "hosts" on this machine: two torchrun invocations (``--nnodes 2``,
rendezvous on 127.0.0.1), the second inside its own mount namespace with a private tmpfs
on /dev/shm, so its ranks cannot see the client's segments and take themselves for
another host. The leader must ship them the bytes of every shm / pooled / cuda_ipc item.

What a user would notice if forwarding were wrong:
- digests: ``meta.digests`` is the leader's sha256, and the consensus compares every
  rank's digest prefix, so a wrong byte on a remote rank is a 500 ``DigestMismatch``;
  a 200 with the client's own sha256 means every rank held the client's bytes;
- outputs: the reference engine's embedding mixes every rank's shard, so the same bytes
  sent over shm (forwarded) and inline (broadcast) give the same embedding, and one
  changed byte gives another;
- failures: a fault on the remote rank is a 500 naming it alone; a segment missing on
  the leader's host is a 500 naming the leader (could not read) and the remote rank
  (could not receive);
- leaks: nothing in the host's /dev/shm (autouse fixture) nor in the namespace's (the
  node-1 shell lists it once its torchrun has exited);
- shutdown: SIGTERM to node 0's torchrun drains the leader, whose stop ends node 1.

All traffic is on loopback. Skipped where this machine does not allow mount namespaces.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from mmsched.client import Client, cuda_ipc, inline, pooled, raw, ref, shm
from mmsched.devices import ShmDevice
from mmsched.producers import IpcPool
from mmsched.producers import ShmPool

from ..conftest import free_port, sync_ping

VENV_BIN = os.path.dirname(sys.executable)
TORCHRUN = os.path.join(VENV_BIN, "torchrun")

FAULTS = (
    "--fault", "1:open:remote-open-*",        # the remote rank fails to open
    "--fault", "1:materialize:remote-mat-*",  # the remote rank fails to materialize
    "--fault", "1:corrupt:remote-corrupt-*",  # the remote rank's copy differs by one byte
    "--fault", "1:stall:slow-*",              # holds the lane so the next requests batch together
    "--stall-s", "1",
)


def _namespace_prefix() -> list[str] | None:
    """An ``unshare`` prefix under which this machine lets us mount a private /dev/shm."""
    probe = "mount -t tmpfs -o size=1m tmpfs /dev/shm"
    for prefix in (["unshare", "--mount", "--propagation", "private"],
                   ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]):
        try:
            done = subprocess.run([*prefix, "sh", "-c", probe], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return prefix
    return None


NAMESPACE = _namespace_prefix()
pytestmark = pytest.mark.skipif(
    NAMESPACE is None or not os.path.exists(TORCHRUN),
    reason="needs torchrun and a mount namespace with a private tmpfs on /dev/shm "
           "(`unshare --mount --propagation private` + `mount -t tmpfs`: root or user namespaces), "
           "to put the second host's ranks out of sight of the client's segments")


# ---------------------------------------------------------------- helpers

def sha256_of(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def feature(seed: int, shape=(64, 256)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def named_ranks(message: str) -> list[int]:
    """The ranks a 500's message blames: ``(rank 0: ...; rank 1: ...)``."""
    return sorted(int(r) for r in re.findall(r"rank (\d+): ", message))


def http_get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:_total)? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics:\n{text}"
    return float(m.group(1))


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class TwoHosts:
    """Node 0 (1 rank: the leader) on this host; node 1 (``node1_procs`` ranks) in a mount
    namespace with its own /dev/shm. Each torchrun leads its own process group."""

    def __init__(self, tmp: str, node1_procs: int = 1, admin: int | None = None, args: tuple = (),
                 env: dict | None = None):
        self.addr = f"ipc:///tmp/mmsched-mh-{uuid.uuid4().hex[:10]}.sock"
        self.ls_path = os.path.join(tmp, "node1-dev-shm.txt")
        self.rc_path = os.path.join(tmp, "node1-rc.txt")
        run_env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("MMSCHED_", "TORCHELASTIC_"))
                   and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        run_env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **(env or {}))
        port = free_port()

        def torchrun(node: int, procs: int) -> list[str]:
            return [TORCHRUN, "--nnodes", "2", "--nproc-per-node", str(procs), "--node-rank", str(node),
                    "--master-addr", "127.0.0.1", "--master-port", str(port),
                    "-m", "mmsched", "serve", "--frontend", self.addr, *FAULTS, *args]

        admin_args = ["--admin", str(admin)] if admin else []
        self.logs_at = [os.path.join(tmp, "node0.log"), os.path.join(tmp, "node1.log")]
        self._files = [open(p, "wb") for p in self.logs_at]
        self.node0 = subprocess.Popen(torchrun(0, 1) + admin_args, env=run_env, stdout=self._files[0],
                                      stderr=subprocess.STDOUT, start_new_session=True)
        # No `exec`: the shell outlives torchrun to record its exit code and what the
        # namespace's /dev/shm still holds (the tmpfs vanishes with the namespace).
        script = (f"mount -t tmpfs -o size=256m tmpfs /dev/shm || exit 97; "
                  f"{shlex.join(torchrun(1, node1_procs))}; echo $? > {shlex.quote(self.rc_path)}; "
                  f"ls -A /dev/shm > {shlex.quote(self.ls_path)}")
        self.node1 = subprocess.Popen([*NAMESPACE, "sh", "-c", script], env=run_env, stdout=self._files[1],
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def logs(self, node: int) -> str:
        self._files[node].flush()
        with open(self.logs_at[node], "rb") as fh:
            return fh.read().decode(errors="replace")

    def all_logs(self) -> str:
        return f"--- node 0 ---\n{self.logs(0)[-6000:]}\n--- node 1 ---\n{self.logs(1)[-6000:]}"

    def wait_ready(self, timeout: float = 75.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in (("node 0", self.node0), ("node 1", self.node1)):
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited {p.returncode} before serving:\n{self.all_logs()}")
            pong = sync_ping(self.addr, 0.5)
            if pong is not None:
                return pong
            time.sleep(0.2)
        raise TimeoutError(f"group not serving after {timeout}s:\n{self.all_logs()}")

    def stop(self, node0_s: float = 40.0, node1_s: float = 30.0) -> None:
        """SIGTERM to node 0's torchrun only (its agent forwards it to the leader, which drains
        and broadcasts stop); node 1 must then end on its own within ``node1_s``."""
        self.node0.send_signal(signal.SIGTERM)
        try:
            self.node0.wait(node0_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node 0 still running {node0_s}s after SIGTERM:\n{self.all_logs()}") from None
        try:
            self.node1.wait(node1_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node 1 still running {node1_s}s after node 0 stopped:\n{self.all_logs()}") \
                from None

    def node1_leftovers(self) -> list[str]:
        with open(self.ls_path) as fh:
            return fh.read().split()

    def kill(self) -> None:
        """SIGKILL whatever is left: torchrun starts each rank in a session of its own, so the
        ranks are found as descendants (before their agent dies) and killed by pid."""
        ranks = descendants(self.node0.pid) + descendants(self.node1.pid)
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in (self.node0, self.node1):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for f in self._files:
            f.close()
        try:
            os.unlink(self.addr[len("ipc://"):])
        except FileNotFoundError:
            pass


def assert_stopped_cleanly(g: TwoHosts) -> None:
    log0, log1 = g.logs(0), g.logs(1)
    assert "[rank0] stopped" in log0, g.all_logs()
    assert "group_broken" not in log0 + log1, g.all_logs()
    with open(g.rc_path) as fh:  # node 1's torchrun: its ranks exited 0 (the stop broadcast)
        assert fh.read().strip() == "0", g.all_logs()
    assert g.node1_leftovers() == [], f"left in node 1's /dev/shm: {g.node1_leftovers()}"


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    g = TwoHosts(str(tmp_path_factory.mktemp("two-hosts")))
    try:
        g.wait_ready()
        yield g
    finally:
        g.kill()


# ---------------------------------------------------------------- two hosts, one rank each

async def test_ping_reports_ranks_per_host(two_hosts):
    async with Client(two_hosts.addr) as c:
        pong = await c.ping(timeout=10)
    assert pong["ranks"] == 2 and pong["healthy"] is True, pong
    assert pong["hosts"] == {"host0": [0], "host1": [1]}, pong
    # node 1 really is elsewhere: its /dev/shm is not ours
    assert "topology" in two_hosts.logs(1) and "remote_ranks=[1]" in two_hosts.logs(1)


async def test_every_transport_reaches_the_remote_rank_byte_for_byte(two_hosts):
    a, b = feature(1), feature(2, (3, 1000))
    a2 = a.clone()
    a2.view(torch.uint8).view(-1)[12345] ^= 1  # one bit differs
    spool = ShmPool(1 << 20)
    ipool = IpcPool(ShmDevice(), slots=4, slot_bytes=1 << 18, ranks=2)
    try:
        async with Client(two_hosts.addr, shm_pool=spool, ipc_pool=ipool) as c:
            sent = {
                "shm": [shm(a), shm(b)],
                "shm-diff": [shm(a2), shm(b)],
                "pooled": [pooled(a), pooled(b)],
                "cuda_ipc": [cuda_ipc(a), cuda_ipc(b)],
                "inline": [inline(a), inline(b)],
                "mixed": [inline(a), shm(b)],
            }
            got = dict(zip(sent, await asyncio.gather(
                *(c.embed([5, 6, 7], feats, want_digest=True, timeout=30) for feats in sent.values()))))
        assert spool.num_leased == 0  # every pooled slice came back with its result
        ipool.reclaim()
        assert ipool.num_leased == 0, "a cuda_ipc slot was never acknowledged for every rank"
    finally:
        spool.close()
        ipool.close()

    for name, r in got.items():
        assert r.status == 200, (name, r.message)
        assert r.meta["ranks"] == 2
    want = [sha256_of(a), sha256_of(b)]
    for name in ("shm", "pooled", "cuda_ipc", "inline", "mixed"):
        assert got[name].meta["digests"] == want, name
    assert got["shm-diff"].meta["digests"] == [sha256_of(a2), sha256_of(b)] != want
    # the output mixes every rank's shard: forwarded bytes give what broadcast bytes give
    for name in ("shm", "pooled", "cuda_ipc", "mixed"):
        assert torch.equal(got[name].embedding, got["inline"].embedding), name
    assert not torch.equal(got["shm-diff"].embedding, got["shm"].embedding)


async def test_odd_sized_items_of_every_width_in_one_batch(two_hosts):
    """Forwarded items travel back to back in one buffer: a 3-byte uint8 item must not leave
    the float32 / float64 / bfloat16 items after it at offsets they cannot be viewed at."""
    g = torch.Generator().manual_seed(11)
    feats = [torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
             torch.randn(5, 7, generator=g),
             torch.randint(0, 2, (1,), dtype=torch.bool, generator=g),
             torch.randn(3, 3, generator=g, dtype=torch.float64),
             torch.randn(2, 5, generator=g).to(torch.bfloat16),
             torch.randint(-9, 9, (7,), dtype=torch.int16, generator=g)]
    async with Client(two_hosts.addr) as c:
        one = await c.embed([3], [shm(t) for t in feats], want_digest=True)
        # the same items split over two requests of one batch
        split = await asyncio.gather(c.embed([3], [shm(t) for t in feats[:3]], want_digest=True),
                                     c.embed([3], [shm(t) for t in feats[3:]], want_digest=True))
    assert one.status == 200, one.message
    assert one.meta["digests"] == [sha256_of(t) for t in feats]
    assert [r.status for r in split] == [200, 200], [r.message for r in split]
    assert split[0].meta["digests"] + split[1].meta["digests"] == one.meta["digests"]


async def test_session_turn_then_ref_on_the_remote_rank(two_hosts):
    t = feature(7, (16, 100))
    sid = f"s-{uuid.uuid4().hex[:6]}"
    async with Client(two_hosts.addr) as c:
        first = await c.embed([1, 2], [shm(t, id="img")], session_id=sid, want_digest=True)
        again = await c.embed([1, 2], [ref("img")], session_id=sid, want_digest=True)
        plain = await c.embed([1, 2], [inline(t)], want_digest=True)
        await c.close_session(sid, timeout=10)
        gone = await c.embed([1, 2], [ref("img")], session_id=sid)
    assert first.status == 200 and again.status == 200, (first.message, again.message)
    assert first.meta["digests"] == again.meta["digests"] == [sha256_of(t)]
    # rank 1 kept the forwarded bytes in its session: the ref turn computes the same output
    assert torch.equal(again.embedding, plain.embedding)
    assert torch.equal(first.embedding, plain.embedding)
    assert gone.status == 400 and "img" in gone.message


async def test_remote_faults_and_a_missing_segment_in_one_batch(two_hosts):
    """A batch mixing good requests, faults on the remote rank (open, materialize, also on a
    cuda_ipc item) and a segment missing on the leader's host: each 500 names exactly the
    ranks that failed, the good ones succeed with their own bytes."""
    tag = uuid.uuid4().hex[:6]
    ipool = IpcPool(ShmDevice(), slots=2, slot_bytes=1 << 16, ranks=2)
    missing = {"modality": "image", "transport": "shm", "dtype": "float32", "shape": [4, 4],
               "shm_name": f"mmsched_gone_{tag}"}
    good = {f"ok-{tag}-{k}": feature(20 + k, (8, 8 * (k + 1))) for k in range(3)}
    try:
        async with Client(two_hosts.addr, ipc_pool=ipool) as c:
            hold = c.send_request("embed", [9], [], rid=f"slow-{tag}")
            await asyncio.sleep(0.4)  # rank 1 sits in the engine: what follows forms one batch
            futs = {
                f"remote-open-{tag}": c.send_request("embed", [1], [shm(feature(3))], rid=f"remote-open-{tag}"),
                f"remote-mat-{tag}": c.send_request("embed", [1], [inline(feature(4)), shm(feature(5))],
                                                    rid=f"remote-mat-{tag}"),
                f"remote-mat-ipc-{tag}": c.send_request("embed", [1], [cuda_ipc(feature(6, (8, 8)))],
                                                        rid=f"remote-mat-ipc-{tag}"),
                f"gone-{tag}": c.send_request("embed", [1], [shm(feature(8)), raw(missing)], rid=f"gone-{tag}"),
                **{rid: c.send_request("embed", [2], [shm(t)], rid=rid, want_digest=True)
                   for rid, t in good.items()},
            }
            got = {rid: await c.wait(rid, f, 30) for rid, f in futs.items()}
            assert (await c.wait(f"slow-{tag}", hold, 30)).status == 200
        ipool.reclaim()
        assert ipool.num_leased == 0, "the failed cuda_ipc item's slot was never acknowledged"
    finally:
        ipool.close()

    for stage in ("open", "mat", "mat-ipc"):
        r = got[f"remote-{stage}-{tag}"]
        assert (r.status, r.err_type) == (500, "InternalServerError"), r
        assert r.meta["failed_ranks"] == [1], (stage, r.meta, r.message)
        assert named_ranks(r.message) == [1], r.message
        assert "InjectedFault" in r.message
        assert ("open" if stage == "open" else "materialize") in r.message
    gone = got[f"gone-{tag}"]
    assert gone.status == 500, gone
    assert gone.meta["failed_ranks"] == [0, 1], (gone.meta, gone.message)
    assert named_ranks(gone.message) == [0, 1], gone.message
    assert "FileNotFoundError" in gone.message and "not received from the leader's host" in gone.message
    for rid, t in good.items():
        assert got[rid].status == 200, (rid, got[rid].message)
        assert got[rid].meta["digests"] == [sha256_of(t)]


async def test_a_remote_rank_holding_other_bytes_is_a_digest_mismatch(two_hosts):
    """Bytes forwarded to the other host (shm, pooled) and broadcast (inline) are compared
    through the digests: a remote copy that differs is a 500 DigestMismatch naming rank 1
    alone; its batch mate is served with the client's bytes."""
    tag = uuid.uuid4().hex[:6]
    bad, good = feature(40, (16, 16)), feature(41, (16, 16))
    pool = ShmPool(1 << 16)
    try:
        async with Client(two_hosts.addr, shm_pool=pool) as c:
            hold = c.send_request("embed", [9], [], rid=f"slow-{tag}")
            await asyncio.sleep(0.4)  # rank 1 sits in the engine: what follows forms one batch
            futs = {rid: c.send_request("embed", [1], [shm(t), pooled(t[:2]), inline(t[2:4])], rid=rid,
                                        want_digest=True)
                    for rid, t in ((f"remote-corrupt-{tag}", bad), (f"ok-{tag}", good))}
            got = {rid: await c.wait(rid, f, 30) for rid, f in futs.items()}
            assert (await c.wait(f"slow-{tag}", hold, 30)).status == 200
    finally:
        pool.close()
    r = got[f"remote-corrupt-{tag}"]
    assert (r.status, r.err_type) == (500, "InternalServerError"), (r.status, r.message)
    assert r.message == "Multimodal feature reconstruction failed (rank 1: DigestMismatch: bytes differ " \
                        "from rank 0's)", r.message
    assert r.meta == {"failed_ranks": [1], "stage": "materialize"}, r.meta
    ok = got[f"ok-{tag}"]
    assert ok.status == 200, ok.message
    assert ok.meta["digests"] == [sha256_of(good), sha256_of(good[:2]), sha256_of(good[2:4])]


def test_sigterm_to_node0_stops_both_hosts_leaving_nothing(two_hosts):
    """Last in this module: it stops the shared group."""
    two_hosts.stop()
    assert_stopped_cleanly(two_hosts)


# ---------------------------------------------------------------- two hosts, 1 + 2 ranks

async def test_three_ranks_on_two_hosts_bytes_cross_once_per_host(tmp_path):
    admin = free_port()
    g = TwoHosts(str(tmp_path), node1_procs=2, admin=admin)
    try:
        pong = g.wait_ready()
        assert pong["ranks"] == 3 and pong["hosts"] == {"host0": [0], "host1": [1, 2]}, pong
        status, health = http_get(admin, "/health")
        assert status == 200 and "host0=0 host1=1,2" in health, health

        tensors = [feature(30), feature(31, (5, 333)), feature(32, (2, 2))]
        pool = IpcPool(ShmDevice(), slots=2, slot_bytes=1 << 16, ranks=3)
        try:
            async with Client(g.addr, ipc_pool=pool) as c:
                got = await asyncio.gather(
                    c.embed([1, 2, 3], [shm(tensors[0]), inline(tensors[1])], want_digest=True, timeout=30),
                    c.embed([4], [shm(tensors[1]), cuda_ipc(tensors[2])], want_digest=True, timeout=30),
                    c.embed([1, 2, 3], [inline(tensors[0]), inline(tensors[1])], want_digest=True, timeout=30))
            pool.reclaim()
            assert pool.num_leased == 0
        finally:
            pool.close()
        assert [r.status for r in got] == [200, 200, 200], [r.message for r in got]
        assert got[0].meta["digests"] == [sha256_of(tensors[0]), sha256_of(tensors[1])]
        assert got[1].meta["digests"] == [sha256_of(tensors[1]), sha256_of(tensors[2])]
        assert torch.equal(got[0].embedding, got[2].embedding)  # ranks 1 and 2 both got rank 0's bytes

        # host-bound bytes crossed once to the one remote host, not once per remote rank
        shipped = nbytes(tensors[0]) + nbytes(tensors[1]) + nbytes(tensors[2])
        status, text = http_get(admin, "/metrics")
        assert status == 200
        assert metric(text, "mmsched_feature_bytes_forwarded") == shipped * 1, (shipped, text)

        g.stop()
        assert_stopped_cleanly(g)
    finally:
        g.kill()


# ---------------------------------------------------------------- an engine out of step on the remote host

async def test_a_remote_rank_gathering_once_more_than_the_leader_lets_no_200_out(tmp_path):
    """The remote rank's engine calls ``ctx.gather`` once more than rank 0's (tests/integration/
    gathering_engine.py, ``extra_r1``): rank 0 waits for that rank's word that its step is over
    (a gloo message: no batch ring reaches another host), which never comes; the group breaks
    at ``collective_timeout`` and the step's request is a 500, not a 200 from rank 0's last call."""
    here = os.path.dirname(os.path.abspath(__file__))
    g = TwoHosts(str(tmp_path), args=("--engine", "gathering_engine:GatheringEngine", "--collective-timeout", "2"),
                 env={"PYTHONPATH": here})
    try:
        g.wait_ready()
        async with Client(g.addr) as c:
            fine = await c.request("generate", [1], rid="fine", timeout=30)
            results = [fine]
            for i in range(3):
                fut = c.send_request("generate", [i], rid=f"extra-{i}", params={"mode": "extra_r1"})
                results.append(await c.wait(f"extra-{i}", fut, 30))
        assert fine.status == 200, fine  # an even step is answered as ever, through the remote word
        statuses = [r.status for r in results[1:]]
        assert 200 not in statuses and 500 in statuses, results
        assert all("broken" in r.message for r in results[1:] if r.status == 500), results
        assert g.node0.wait(30) != 0, g.all_logs()
        g.node1.wait(30)
        assert "group_broken" in g.logs(0), g.all_logs()
        assert g.node1_leftovers() == [], f"left in node 1's /dev/shm: {g.node1_leftovers()}"
    finally:
        g.kill()
