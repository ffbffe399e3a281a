"""What one client can make the leader hold, and what the leader owes every sender
(issue 16, items 1, 6, 7, 8 and 10): descriptors and items per queue, aborts that end
with their request, a routing id taken over by a new connection, messages still unread
at the socket when the leader stops, and what a batch really costs (memory per feature,
session refs on the loop).

Every test runs against a real server; figures (descriptors in /proc/PID/fd, peak RSS,
ping latency) are read from the leader process.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import time

import msgpack
import pytest
import torch
import zmq

from mmsched.client import Client, raw, ref, shm
from mmsched.producers import create_segment

from ..conftest import Server, free_port, shm_segments, sync_ping
from .lifecycle import expect, feature, my_segments, sha256_of, wait_until


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def vm_hwm(pid: int) -> int:
    """Peak resident memory of a process, in bytes."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def dealer(addr: str, routing_id: bytes | None = None, reconnect: bool = True) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    if not reconnect:
        s.setsockopt(zmq.RECONNECT_IVL, -1)
    s.connect(addr)
    return s


def shm_item(seg, nbytes: int) -> dict:
    return {"modality": "image", "transport": "shm", "dtype": "uint8", "shape": [nbytes], "shm_name": seg.name}


def request(rid: str, items: list[dict], **kw) -> bytes:
    return msgpack.packb({"v": 1, "type": "embed", "rid": rid, "input_ids": [1, 2, 3], "mm_items": items,
                          "want_digest": True, **kw})


def replies(s: zmq.Socket, n: int, timeout: float) -> list[dict]:
    """Up to ``n`` replies within ``timeout`` seconds."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and (left := deadline - time.monotonic()) > 0:
        if s.poll(int(left * 1000)):
            got.append(msgpack.unpackb(s.recv(), raw=False))
    return got


def until_pong(s: zmq.Socket, timeout: float) -> list[dict]:
    """The replies before the next pong (which, one pipe in order, answers a ping sent last)."""
    got, deadline = [], time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and s.poll(int(left * 1000)):
        h = msgpack.unpackb(s.recv(), raw=False)
        if h["type"] == "pong":
            return got
        got.append(h)
    raise AssertionError(f"no pong within {timeout}s")


def gone(name: str) -> bool:
    return not os.path.exists(os.path.join("/dev/shm", name))


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    with Server(tmp_dir=str(tmp_path_factory.mktemp("solo"))) as srv:
        yield srv


# ---------------------------------------------------------------- 7. a routing id already in use

def test_a_new_connection_with_a_routing_id_in_use_takes_it_over(solo):
    """A client that reconnects under its routing id while its old connection is still open
    (a restarted process, a half-dead link) is served on the new connection: a pong, a 200
    with its own bytes, its segment unlinked. On main the new connection was ignored."""
    old = dealer(solo.addr, b"client-7", reconnect=False)
    new = None
    try:
        old.send(msgpack.packb({"v": 1, "type": "ping"}))
        assert replies(old, 1, 10)[0]["type"] == "pong"
        new = dealer(solo.addr, b"client-7")
        data = bytes(range(256)) * 16
        seg = create_segment(data)
        seg.sent()
        new.send(msgpack.packb({"v": 1, "type": "ping"}))
        new.send(request("r7", [shm_item(seg, len(data))]))
        got = replies(new, 2, 10)
        assert [g["type"] for g in got] == ["pong", "result"], f"the new connection got {got}"
        res = got[1]
        assert (res["rid"], res["status"]) == ("r7", 200), res
        assert res["meta"]["digests"] == [hashlib.sha256(data).hexdigest()]
        assert gone(seg.name)
    finally:
        old.close(linger=0)
        if new is not None:
            new.close(linger=0)
    assert sync_ping(solo.addr, 5)["healthy"] is True


# ---------------------------------------------------------------- 1. descriptors and items per queue

STALL_S = 4


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def stalling(request, tmp_path_factory):
    """A ``hold-*`` request keeps the leader's lane busy STALL_S seconds, so what follows queues."""
    with Server("--tp", str(request.param), "--fault", "0:stall:hold-*", "--stall-s", str(STALL_S),
                tmp_dir=str(tmp_path_factory.mktemp("stalling"))) as srv:
        srv.leader = srv.proc.pid if request.param == 1 else srv.rank_pids()[0]
        yield srv


async def test_one_client_cannot_exhaust_the_leaders_descriptors(stalling):
    """While the lane is busy, one client queues 200 requests of 64 items, all naming one
    64-byte segment. The leader holds one descriptor for that segment (not one per item),
    admits max_queued_items (8192) items and answers the rest 503 naming the setting; every
    request gets one result, another client is served, nothing stays linked or open."""
    pid = stalling.leader
    base = fds(pid)
    data = bytes(range(64))
    seg = create_segment(data)
    seg.sent()
    flood = dealer(stalling.addr)
    try:
        async with Client(stalling.addr) as c:
            hold = c.send_request("embed", [7], [], rid="hold-1")
            await asyncio.sleep(0.5)
            for i in range(200):
                flood.send(request(f"f{i}", [shm_item(seg, len(data))] * 64))
            flood.send(msgpack.packb({"v": 1, "type": "ping"}))
            early = until_pong(flood, 10)  # the leader has read the whole flood
            held = fds(pid) - base
            print(f"descriptors held for 200 x 64 items naming one segment: +{held}")
            assert not hold.done(), "hold-1 ended before the flood was queued"
            assert held < 16, f"the leader holds {held} more descriptors for one client's queued requests"
            got = {r["rid"]: r for r in early + replies(flood, 200 - len(early), 60)}
            expect(await c.wait("hold-1", hold, 30), 200)
            mine = create_segment(data)
            r = expect(await c.embed([1, 2, 3], [raw(shm_item(mine, len(data)))], want_digest=True), 200)
            mine.sent()
            assert r.meta["digests"] == [hashlib.sha256(data).hexdigest()]
    finally:
        flood.close(linger=0)
    assert len(got) == 200, f"{200 - len(got)} flood requests got no result"
    statuses = [r["status"] for r in got.values()]
    over = [r for r in got.values() if r["status"] == 503]
    assert len(over) == 200 - 8192 // 64, statuses
    assert all("max_queued_items" in r["message"] for r in over), over[0]["message"]
    for r in got.values():
        assert r["status"] in (200, 500, 503), r
        if r["status"] == 200:
            assert r["meta"]["digests"] == [hashlib.sha256(data).hexdigest()] * 64
    assert gone(seg.name)
    assert fds(pid) - base < 16
    assert stalling.proc.poll() is None and sync_ping(stalling.addr, 5)["healthy"] is True


def test_a_config_the_descriptor_limit_cannot_hold_is_refused_at_start(tmp_path):
    """Rather than run out of descriptors mid-batch (which breaks the group), a rank whose
    hard RLIMIT_NOFILE cannot hold min(max_batch x max_items, max_queued_items) (+ max_queued_items at the leader)
    refuses to start, naming the setting."""
    import resource
    import subprocess
    import sys

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, 2048))

    proc = subprocess.run([sys.executable, "-m", "mmsched", "serve", "--frontend", f"ipc://{tmp_path}/x.sock"],
                          preexec_fn=low_limit, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MMSCHED_")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "max_queued_items" in proc.stdout + proc.stderr and "2048" in proc.stdout + proc.stderr



def test_the_descriptors_reserved_grow_with_a_batch_only_up_to_max_queued_items():
    """A rank has at most max_queued_items items open (admission holds queued and running
    items to it), so the default 256 x 64 per batch must not ask for 16,384 descriptors: the
    defaults fit a hard limit of 17,664 at the leader (256 of them client connections),
    9,216 at a follower, and one fewer does not."""
    import subprocess
    import sys

    probe = ("import resource, sys; from mmsched.config import Config; from mmsched.errors import ConfigError\n"
             "from mmsched.descriptors import connections_at_most, reserve_descriptors\n"
             "rank, hard = int(sys.argv[1]), int(sys.argv[2]); resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))\n"
             "try: print(reserve_descriptors(Config(), rank), resource.getrlimit(resource.RLIMIT_NOFILE)[0], "
             "connections_at_most(Config()))\n"
             "except ConfigError as exc: print('refused', exc)")

    def reserve(rank: int, hard: int) -> str:
        return subprocess.run([sys.executable, "-c", probe, str(rank), str(hard)], capture_output=True, text=True,
                              timeout=60, check=True).stdout.strip()

    assert reserve(0, 17664) == "17664 17664 256" and reserve(1, 9216).startswith("9216 9216 ")
    assert reserve(0, 20000) == "17664 20000 2592", "the soft limit goes to the hard: room for client connections"
    assert reserve(0, 17663).startswith("refused max_queued_items: rank 0 may need 17664 descriptors")
    assert reserve(1, 9215).startswith("refused max_queued_items: rank 1 may need 9216 descriptors")


ROOM_300 = ("--max-queued-items", "64", "--max-batch", "4")  # with nofile=1452: room for 300 connections


def crowd(addr: str, n: int) -> tuple[zmq.Context, list[zmq.Socket]]:
    ctx = zmq.Context()
    ctx.max_sockets = n + 16
    socks = []
    for _ in range(n):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(addr)
        socks.append(d)
    return ctx, socks


def most_fds(pid: int, seconds: float) -> int:
    most, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            most = max(most, fds(pid))
        time.sleep(0.005)
    return most


def test_connections_past_what_the_descriptor_limit_leaves_wait_outside(tmp_path):
    """Each client connection costs the leader a descriptor, and a listener out of them is
    fatal (libzmq aborts the leader on an ipc:// accept that fails with EMFILE). With room
    for 300, 400 more clients connecting do not take the leader past it (before: one
    descriptor each, up to the limit): at 300 libzmq stops accepting until there is room,
    a warning says so, the socket file stays, /health stays healthy, a client connected
    before is served with its own bytes, and once the others leave a new client gets in
    and the descriptors are back where they were."""
    with Server(*ROOM_300, tmp_dir=str(tmp_path), nofile=1452) as srv:
        assert "connections_at_most=300" in srv.logs(), srv.logs()
        path = srv.addr[len("ipc://"):]
        first = dealer(srv.addr)
        try:
            first.send(msgpack.packb({"v": 1, "type": "ping"}))
            assert replies(first, 1, 10)[0]["type"] == "pong"
            base = fds(srv.proc.pid)
            ctx, extra = crowd(srv.addr, 400)
            try:
                wait_until(lambda: "connections_full" in srv.logs(), 30, "a connections_full warning")
                most = most_fds(srv.proc.pid, 1.0)
                print(f"leader descriptors: {base} with one client, at most {most} with 401 connecting")
                assert most <= base + 299 + 8, f"the leader holds {most - base} more descriptors for 400 connections"
                assert os.path.exists(path), "the socket file went away while the bound was full"
                data = bytes(range(256)) * 64
                seg = create_segment(data)
                seg.sent()
                first.send(msgpack.packb({"v": 1, "type": "ping"}))
                first.send(request("r-first", [shm_item(seg, len(data))]))
                pong, res = replies(first, 2, 20)
                assert pong["type"] == "pong" and pong["healthy"] is True, pong
                assert (res["rid"], res["status"]) == ("r-first", 200), res
                assert res["meta"]["digests"] == [hashlib.sha256(data).hexdigest()]
                assert gone(seg.name)
            finally:
                for d in extra:
                    d.close(linger=0)
                ctx.term()
        finally:
            first.close(linger=0)
        wait_until(lambda: fds(srv.proc.pid) <= base, 20, f"the leader's descriptors back to {base}")
        assert sync_ping(srv.addr, 10)["healthy"] is True, "a new client did not get in once the others left"
        assert "EMFILE" not in srv.logs() and "Too many open files" not in srv.logs()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stop_while_clients_wait_outside_the_bound_exits_cleanly(tmp_path, tp):
    """SIGTERM while 800 clients retry past a bound of 300 (an outside attack: the bound
    stopped with the receiver, descriptors jumped to the limit and libzmq aborted the
    leader, exit -6): the leader stays within its limit through the drain and exits 0."""
    with Server(*ROOM_300, "--tp", str(tp), tmp_dir=str(tmp_path), nofile=1452) as srv:
        leader = srv.proc.pid if tp == 1 else srv.rank_pids()[0]
        base = fds(leader)
        ctx, extra = crowd(srv.addr, 800)
        try:
            wait_until(lambda: "connections_full" in srv.logs(), 30, "a connections_full warning")
            srv.proc.send_signal(signal.SIGTERM)
            most = most_fds(leader, 1.5)
            assert srv.proc.wait(30) == 0, srv.logs()[-3000:]
        finally:
            for d in extra:
                d.close(linger=0)
            ctx.term()
        assert most <= base + 300 + 8, f"{most - base} more descriptors during the drain"
        assert "Too many open files" not in srv.logs()


def test_a_flood_on_one_connection_does_not_starve_the_others(solo):
    """One client sends pings as fast as it can (never waiting for a pong): another client's
    request is still answered within seconds (before: the receiver read the flood for as long
    as it lasted, and no batch ran until it stopped)."""
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDHWM, 0)
    flood.connect(solo.addr)
    ping = msgpack.packb({"v": 1, "type": "ping"})
    other = dealer(solo.addr)
    try:
        for _ in range(20000):  # queued before the request: the leader reads them first
            flood.send(ping, zmq.NOBLOCK)
        other.send(request("r-other", []))
        t0, got = time.monotonic(), []
        while time.monotonic() - t0 < 10 and not got:
            for _ in range(2000):
                flood.send(ping, zmq.NOBLOCK)
            while flood.poll(0):
                flood.recv()
            got = replies(other, 1, 0.01)
        assert got and got[0]["status"] == 200, f"no result within 10 s of flooding: {got}"
    finally:
        flood.close(linger=0)
        other.close(linger=0)
        ctx.term()

def test_idle_admin_connections_are_bounded(tmp_path):
    """Each admin HTTP connection is a descriptor of the leader's too (an outside attack: 1,600
    idle ones took it to its limit, then a ZeroMQ accept aborted it). Past 64 open, the one
    waiting longest for its headers is closed to make room: the leader's descriptors stay near
    where they were, and a health probe is still answered (another attack kept the 64 places
    with half-sent headers, and every probe was told 503)."""
    import socket

    port = free_port()
    with Server("--admin", f"127.0.0.1:{port}", tmp_dir=str(tmp_path)) as srv:
        base, held = fds(srv.proc.pid), []
        try:
            for _ in range(200):
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            time.sleep(1.0)
            grown = fds(srv.proc.pid) - base
            late = socket.create_connection(("127.0.0.1", port), timeout=5)
            late.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b"".join(iter(lambda: late.recv(4096), b""))  # to the close: the whole reply
            late.close()
            held[0].settimeout(5)
            oldest = held[0].recv(4096)
        finally:
            for s in held:
                s.close()
        assert grown <= 64 + 8, f"200 idle admin connections cost the leader {grown} descriptors"
        assert answer.startswith(b"HTTP/1.1 200") and b"serving ranks=1" in answer, answer
        assert oldest == b"", "the first idle connection is still open"
        wait_until(lambda: fds(srv.proc.pid) <= base + 2, 20, "the leader's descriptors back")
        assert sync_ping(srv.addr, 5)["healthy"] is True

# ---------------------------------------------------------------- 10 and 8: on one fresh server per tp

@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def fresh(request, tmp_path_factory):
    """A server no other test used: first for the memory test (its peak RSS is still the
    start-up one), then for the stop test, which ends it (so it comes last)."""
    with Server("--tp", str(request.param), tmp_dir=str(tmp_path_factory.mktemp("fresh"))) as srv:
        srv.tp = request.param
        yield srv


async def test_a_feature_costs_a_rank_about_its_own_size(fresh):
    """One 64 MiB feature: each rank's peak memory grows by about the feature (its owned
    copy), not ~9x (the reference engine widened every byte to int64 first: +579 MiB)."""
    srv = fresh
    ranks = [srv.proc.pid] if srv.tp == 1 else srv.rank_pids()
    x = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(10))
    before = [vm_hwm(p) for p in ranks]
    async with Client(srv.addr) as c:
        r = expect(await c.embed([1, 2, 3], [shm(x)], want_digest=True, timeout=60), 200)
    grown = [vm_hwm(p) - b for p, b in zip(ranks, before)]
    print(f"peak RSS per rank for one {x.numel() >> 20} MiB feature: {['+%d MiB' % (g >> 20) for g in grown]}")
    assert r.meta["digests"] == [sha256_of(x)]
    for rank, g in enumerate(grown):
        assert g < 2.5 * x.numel(), f"rank {rank}'s peak RSS grew {g >> 20} MiB for a {x.numel() >> 20} MiB feature"



# ---------------------------------------------------------------- 8. a stop with messages unread

def test_a_stop_answers_what_is_still_unread_at_the_socket(fresh):
    """500 requests sit unread at the frontend (the leader is paused while they are sent)
    when SIGTERM arrives: each still gets one result (200 if it ran, 503 otherwise) and its
    segment is unlinked; the group exits 0. On main the leader closed the socket on the
    ones it had not read yet: no result, segments left."""
    srv = fresh
    leader = srv.proc.pid if srv.tp == 1 else srv.rank_pids()[0]
    n, data = 500, bytes(range(256)) * 16
    segs = [create_segment(data) for _ in range(n)]
    s = dealer(srv.addr)
    try:
        os.kill(leader, signal.SIGSTOP)
        try:
            for i, seg in enumerate(segs):
                s.send(request(f"u{i}", [shm_item(seg, len(data))]))
                seg.sent()
            time.sleep(0.5)  # the client's I/O thread hands everything to the kernel
            srv.proc.send_signal(signal.SIGTERM)  # at tp=2 the launcher forwards it to the leader
            time.sleep(0.2)
        finally:
            os.kill(leader, signal.SIGCONT)
        got = replies(s, n, 30)
    finally:
        s.close(linger=0)
    assert srv.proc.wait(30) == 0, srv.logs()[-2000:]
    by_rid = {r["rid"]: r for r in got}
    assert len(got) == len(by_rid) == n, f"{n - len(by_rid)} of {n} requests got no result"
    digest = hashlib.sha256(data).hexdigest()
    for r in got:
        assert r["status"] in (200, 503), r
        if r["status"] == 200:
            assert r["meta"]["digests"] == [digest]
        else:
            assert r["message"].startswith("service unavailable"), r["message"]
    left = [seg.name for seg in segs if not gone(seg.name)]
    assert not left, f"{len(left)} segments left in /dev/shm"


# ---------------------------------------------------------------- 10. session refs

async def test_session_refs_count_their_bytes_and_leave_the_loop_free(solo):
    """64 refs to a stored 32 MiB feature are a 2 GiB batch, not a 0-byte one: at tp=1 it
    runs on the lane, so another client's pings are answered meanwhile (on main it ran on
    the event loop and a ping waited seconds)."""
    x = feature(11, (8 << 20,))  # 32 MiB of float32
    sid = f"s10-{os.getpid()}"
    async with Client(solo.addr) as c, Client(solo.addr) as other:
        expect(await c.embed([1], [shm(x, id="big")], session_id=sid, want_digest=True, timeout=60), 200)
        futs = {f"ref-{i}": c.send_request("embed", [1, 2], [ref("big")], rid=f"ref-{i}", session_id=sid,
                                           want_digest=True) for i in range(64)}
        worst = 0.0
        while not all(f.done() for f in futs.values()):
            t0 = time.monotonic()
            await other.ping(timeout=60)
            worst = max(worst, time.monotonic() - t0)
            await asyncio.sleep(0.02)
        results = [await c.wait(rid, f, 60) for rid, f in futs.items()]
        await c.close_session(sid, timeout=30)
    print(f"slowest ping while 64 refs to a 32 MiB feature ran: {worst:.3f}s")
    for r in results:
        expect(r, 200)
        assert r.meta["digests"] == [sha256_of(x)]
    assert worst < 1.0, f"a ping waited {worst:.2f}s while the refs' batch ran"


# ---------------------------------------------------------------- 6. an abort ends with its request

async def test_a_rid_reused_after_an_in_flight_abort_runs(stalling):
    """An abort marks the request it reached, not its rid: once the aborted request's 499 is
    out, the same rid runs again (200, its own bytes)."""
    x, y = feature(61), feature(62)
    async with Client(stalling.addr) as c:
        fut = c.send_request("embed", [1, 2, 3], [shm(x)], rid="hold-6", want_digest=True)
        await asyncio.sleep(1.0)  # on the lane now, stalled before the engine's abort check
        await c.abort("hold-6")
        r = expect(await c.wait("hold-6", fut, 30), 499, err_type="RequestAborted")
        again = expect(await c.embed([1, 2, 3], [shm(y)], rid="hold-6", want_digest=True, timeout=30), 200)
        assert again.meta["digests"] == [sha256_of(y)]
    assert r.meta.get("stage") == "engine", r.meta
    assert my_segments() == set()


def test_at_tp2_a_refused_config_stops_the_group_at_once(tmp_path):
    """Third outside attack: rank 0 refused its config (exit 2) and the follower waited in
    start-up until the launcher killed it, collective_timeout + 5 s later (~41 s). Now the
    launcher stops the rest at once and exits 2; the subprocess timeout is well under
    collective_timeout, so a launcher that still waits fails here."""
    import resource
    import subprocess
    import sys

    def low_limit():  # room for a follower (min(256 x 64, 8192) + 1024), not for the leader (+ 8192 queued items)
        resource.setrlimit(resource.RLIMIT_NOFILE, (10240, 10240))

    proc = subprocess.run([sys.executable, "-m", "mmsched", "serve", "--tp", "2", "--collective-timeout", "120",
                           "--frontend", f"ipc://{tmp_path}/x.sock"],
                          preexec_fn=low_limit, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MMSCHED_")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "max_queued_items" in proc.stdout + proc.stderr
