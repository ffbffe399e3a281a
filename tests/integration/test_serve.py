"""The real command line: ``mmsched serve`` start, ping, SIGTERM drain, config errors, ``make serve``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from mmsched.affinity import ranges
from mmsched.client import Client, raw, shm
from mmsched.producers import create_segment
from tests.conftest import Server, fd_targets, pid_alive, sync_ping
from .lifecycle import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MMSCHED = os.path.join(os.path.dirname(sys.executable), "mmsched")
PREFIX = "mmsched_"


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("MMSCHED_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def assert_clean_log(text: str) -> None:
    assert "resource_tracker" not in text, text
    assert "leaked" not in text.lower(), text
    assert "Traceback" not in text, text


@pytest.fixture(scope="module")
def drilled(tmp_path_factory):
    """(server, admin port): one tp=1 server with an admin port and two drills, shared by the
    tests below that only ping it, read its log or its /health. The frontend-gone test removes
    its socket file: after it, only tests that read the log may use it."""
    from .test_operations import free_port

    port = free_port()
    with Server("--admin", str(port), "--fault", "0:open:zz-*", "--fault", "5:open:x-*",
                tmp_dir=str(tmp_path_factory.mktemp("drilled"))) as srv:
        yield srv, port


async def test_ping_through_the_client(drilled):
    async with Client(drilled[0].addr) as c:
        pong = await c.ping(timeout=10)
        assert pong["v"] == 1 and pong["type"] == "pong"
        assert pong["ranks"] == 1 and pong["healthy"] is True
        r = await c.embed([1, 2, 3], [shm(torch.ones(2, 2))])
        assert r.status == 200


@pytest.mark.slow  # suite budget: test_operations.py::test_sigterm_during_load_answers_every_request_once_and_exits_0 drains under load
async def test_sigterm_drains_every_request_once(start_server):
    """hold-0 stalls 2 s in the engine; 20 more queue behind it; SIGTERM with a 0.5 s drain budget."""
    srv = start_server("--fault", "0:stall:hold-*", "--stall-s", "2", "--shutdown-timeout", "0.5")
    segs = [create_segment(torch.full((16,), float(i)), PREFIX) for i in range(22)]  # ready before the clock runs
    names = [s.name for s in segs]

    def item(seg):
        return raw({"modality": "image", "transport": "shm", "dtype": "float32", "shape": [seg.nbytes // 4],
                    "shm_name": seg.name})

    async with Client(srv.addr) as c:
        futs = {}
        futs["hold-0"] = c.send_request("embed", [1], [item(segs[0])], rid="hold-0")
        segs[0].sent()
        deadline = time.monotonic() + 15
        while os.path.exists(f"/dev/shm/{segs[0].name}"):  # materialized: hold-0 is inside the engine step
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        for i in range(1, 21):
            futs[f"q-{i}"] = c.send_request("embed", [i + 1], [item(segs[i])], rid=f"q-{i}")
            segs[i].sent()
        await c.ping(timeout=10)  # the server has read every request above
        srv.proc.send_signal(signal.SIGTERM)
        late = c.send_request("embed", [1], [item(segs[21])], rid="late")
        segs[21].sent()
        results = {rid: await c.wait(rid, f, 30) for rid, f in futs.items()}
        late_result = await c.wait("late", late, 30)
        code = await asyncio.get_running_loop().run_in_executor(None, srv.proc.wait, 30)
        await asyncio.sleep(0.2)
        assert c.unrouted == []
    assert code == 0, srv.logs()
    assert not os.path.exists(srv.addr[len("ipc://"):]), "the stopped server left its ipc socket file"
    assert results["hold-0"].status == 200, results["hold-0"].message
    for rid, r in results.items():
        assert r.status in (200, 503), (rid, r.status, r.message)
        assert r.rid == rid
        if r.status == 503:
            assert r.err_type == "ServiceUnavailable"
    assert any(r.status == 503 for r in results.values()), "a 0.5 s drain cannot run 20 queued requests"
    assert late_result.status in (200, 503)
    leftover = [n for n in names if os.path.exists(f"/dev/shm/{n}")]
    assert leftover == [], "segments of drained requests were not unlinked"
    assert_clean_log(srv.logs())


async def test_sigterm_waits_for_in_flight_work_within_the_drain_timeout(start_server):
    srv = start_server("--fault", "0:stall:hold-*", "--stall-s", "1")
    async with Client(srv.addr) as c:
        futs = {rid: c.send_request("embed", [1], [shm(torch.ones(8))], rid=rid)
                for rid in ("hold-a", "b", "c")}
        await c.ping(timeout=10)
        srv.proc.send_signal(signal.SIGTERM)
        results = {rid: await c.wait(rid, f, 30) for rid, f in futs.items()}
        code = await asyncio.get_running_loop().run_in_executor(None, srv.proc.wait, 30)
    assert code == 0
    assert {rid: r.status for rid, r in results.items()} == {"hold-a": 200, "b": 200, "c": 200}
    assert_clean_log(srv.logs())


def test_config_errors_exit_2_and_name_the_key(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text('max_batch = 8\nbogus_knob = 3\n')
    addr = f"ipc:///tmp/mmsched-test-{uuid.uuid4().hex[:10]}.sock"
    runs = {
        "max_batch": [MMSCHED, "serve", "--frontend", addr, "--max-batch", "0"],
        "bogus_knob": [MMSCHED, "serve", "--frontend", addr, "--config", str(toml)],
    }
    procs = {key: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=clean_env(), start_new_session=True)
             for key, cmd in runs.items()}
    try:
        for key, p in procs.items():
            out, err = p.communicate(timeout=60)
            assert p.returncode == 2, (key, out, err)
            assert key in err, err
            assert "Traceback" not in err
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert sync_ping(addr, 0.2) is None  # nothing was left serving


def test_make_serve(tmp_path):
    sock = f"/tmp/mmsched-make-{uuid.uuid4().hex[:10]}.sock"
    addr = f"ipc://{sock}"
    log = open(tmp_path / "make.log", "wb")
    proc = subprocess.Popen(["make", "serve", f"ARGS=--frontend {addr}"], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)
    try:
        pong = None
        deadline = time.monotonic() + 60
        while pong is None and time.monotonic() < deadline and proc.poll() is None:
            pong = sync_ping(addr, 0.5)
        assert pong is not None, (tmp_path / "make.log").read_text()
        assert pong["type"] == "pong" and pong["ranks"] == 1 and pong["healthy"] is True
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while sync_ping(addr, 0.2) is not None:  # the server under make went too
            assert time.monotonic() < deadline, "mmsched still answers after make exited"
        assert_clean_log((tmp_path / "make.log").read_text())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything make left behind
        except ProcessLookupError:
            pass
        log.close()
        if os.path.exists(sock):
            os.unlink(sock)


# ---------------------------------------------------------------- one ipc:// path, one server

def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([MMSCHED, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=clean_env(), start_new_session=True)


def test_a_second_server_on_a_live_socket_is_refused_and_the_first_keeps_its_clients(drilled):
    """Issue 17 item 2: a second ``serve`` on the same ipc:// path took the socket from the first
    (and removed the file when it stopped), while the first still said "serving"."""
    from .test_operations import http_get

    first, port = drilled
    second = _serve("--frontend", first.addr)
    try:
        _, err = second.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(second.pid, signal.SIGTERM)  # the second stops as a user would stop it
        _, err = second.communicate(timeout=30)
        raise AssertionError(f"a second server started on {first.addr}:\n{err[-2000:]}") from None
    finally:
        assert sync_ping(first.addr, 10) is not None, "the first server's clients can no longer reach it"
        status, body = http_get(port, "/health")
        assert (status, body.split(" ", 1)[0]) == (200, "serving"), (status, body)
    assert second.returncode == 2 and "config error: frontend:" in err and "in use" in err, err[-2000:]
    assert "Traceback" not in err


def test_health_says_the_frontend_is_gone_when_its_socket_file_is(drilled):
    """Once nobody can connect (the socket file removed), /health must not say serving.
    Breaks the shared server's frontend: see ``drilled``."""
    from .test_operations import http_get

    srv, port = drilled
    assert http_get(port, "/health")[0] == 200
    os.unlink(srv.addr[len("ipc://"):])
    status, body = http_get(port, "/health")
    assert status == 503 and body.startswith("frontend gone:"), (status, body)


def test_a_stale_socket_file_is_taken_over(tmp_path):
    """What a killed server left behind (a socket file nobody listens on) is no obstacle."""
    import socket as sk

    path = tmp_path / "stale.sock"
    with sk.socket(sk.AF_UNIX, sk.SOCK_STREAM) as s:
        s.bind(str(path))  # closed without unlink: the file stays, nobody listens
    proc = _serve("--frontend", f"ipc://{path}")
    try:
        deadline = time.monotonic() + 60
        while (pong := sync_ping(f"ipc://{path}", 0.5)) is None and proc.poll() is None:
            assert time.monotonic() < deadline, "no pong from the server on the stale path"
        assert pong is not None, "the server exited on a stale socket file"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-2000:]
        assert not path.exists(), "the server removes its own socket file when it stops"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


# ---------------------------------------------------------------- start-up errors: one line, nothing bound

def test_start_up_errors_are_one_line_and_nothing_is_bound(tmp_path):
    """Issue 17 items 7 and 12: a taken admin port used to log ``serving`` and then exit 2; a
    tp=2 config whose socket directory is missing made the follower log gloo's
    ``group_broken`` text."""
    import socket as sk

    sock = tmp_path / "never.sock"
    tp2 = tmp_path / "tp2.toml"
    tp2.write_text(f'tp = 2\nfrontend = "ipc://{tmp_path}/missing/mmsched.sock"\n')
    with sk.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        runs = {
            "admin": _serve("--frontend", f"ipc://{sock}", "--admin", str(port)),
            "frontend": _serve("--config", str(tp2)),
        }
        try:
            errs = {key: p.communicate(timeout=60)[1] for key, p in runs.items()}
        finally:
            for p in runs.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.communicate()
    for key, p in runs.items():
        assert p.returncode == 2, (key, p.returncode, errs[key][-2000:])
        lines = errs[key].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"mmsched: config error: {key}:"), (key, errs[key][-2000:])
    assert "does not exist" in errs["frontend"], errs
    assert not sock.exists()


def test_a_server_with_drills_says_so_at_start_up(drilled):
    """Item 12: ``--fault 5:open:x`` on a one-rank server was accepted without a word."""
    srv, _ = drilled
    assert "faults_active faults=0:open:zz-*,5:open:x-* stall_s=3.0 never_fire=5:open:x-*" in srv.logs(), srv.logs()


def test_the_serving_event_says_which_gil_switch_interval_the_leader_runs_with(start_server):
    """The switch interval shapes tp=2 latency but was visible nowhere: the leader's ``serving``
    line reads it back from the interpreter, so a value set by env is seen to have taken."""
    srv = start_server(env={"MMSCHED_GIL_SWITCH_US": "250"})
    line = next(l for l in srv.logs().splitlines() if "serving" in l and "frontend=" in l)
    assert "gil_switch_us=250" in line, line


def _cpus_of_threads(pid: int) -> set[str]:
    """Every thread's ``Cpus_allowed_list`` (as /proc writes it: ``0-3,6``)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as fh:
            out.update(l.split(":", 1)[1].strip() for l in fh if l.startswith("Cpus_allowed_list:"))
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to share")
@pytest.mark.parametrize("mode", ["spread", "off"])
def test_each_rank_of_a_group_runs_on_its_own_cpus(start_server, mode):
    """tp=2 on this host's CPUs: with ``spread`` every thread of rank 0 (its loop, lane, gloo's and
    ZeroMQ's threads) runs on the first half and rank 1's on the second, as each rank logs;
    with ``off`` the scheduler places them anywhere. Served either way, with the right bytes."""
    srv = start_server("--tp", "2", "--cpu-affinity", mode)
    allowed = sorted(os.sched_getaffinity(0))
    half = len(allowed) // 2
    want = [ranges(allowed[:half]), ranges(allowed[half:])] if mode == "spread" else [ranges(allowed)] * 2
    assert [_cpus_of_threads(p) for p in srv.rank_pids()] == [{want[0]}, {want[1]}]
    logged = re.findall(r"\[rank(\d)\] rank_cpus cpus=(\S+)", srv.logs())
    assert sorted(logged) == ([("0", want[0]), ("1", want[1])] if mode == "spread" else []), srv.logs()
    feature = torch.randint(0, 256, (64, 64), dtype=torch.uint8)

    async def one():
        async with Client(srv.addr) as c:
            return await c.embed(list(range(32)), [shm(feature)], want_digest=True)
    res = asyncio.run(one())
    assert res.status == 200, res
    assert res.meta.get("digests") == [hashlib.sha256(feature.numpy().tobytes()).hexdigest()], res.meta


def test_a_server_of_one_keeps_every_cpu_whatever_local_rank_its_environment_holds(start_server):
    """tp=1 started from a shell or container an outer torchrun set up: its LOCAL_RANK and
    LOCAL_WORLD_SIZE name no group of ours, and must not cost the server half the machine."""
    srv = start_server(env={"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert _cpus_of_threads(srv.proc.pid) == {ranges(sorted(os.sched_getaffinity(0)))}
    assert "rank_cpus" not in srv.logs() and "cpu_affinity_refused" not in srv.logs(), srv.logs()


def _tcp_listeners() -> dict[tuple[str, int], str]:
    """Every listening TCP socket on this host (IPv4 and IPv6): (address, port) -> socket inode."""
    out = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as fh:
            for line in fh.readlines()[1:]:
                f = line.split()
                addr, port = f[1].rsplit(":", 1)
                if f[3] == "0A":  # LISTEN
                    ip = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(addr) == 8 else addr
                    out[(ip, int(port, 16))] = f[9]
    return out


def _socket_inodes(pid: int) -> set[str]:
    return {t[len("socket:["):-1] for t in fd_targets(pid) if t.startswith("socket:[")}


def test_the_launcher_holds_the_rendezvous_port_on_loopback_only(start_server):
    """tp=2: the port the ranks meet on is bound by the launcher before it starts them, and held
    while they serve, on 127.0.0.1 alone. (A port picked free and bound later by rank 0 could be
    taken in between, by the local end of any connection: the group would not start.)"""
    srv = start_server("--tp", "2")
    port = int(re.search(r"launched .*dist=127\.0\.0\.1:(\d+)", srv.logs()).group(1))
    listeners = {addr: inode for addr, inode in _tcp_listeners().items() if addr[1] == port}
    assert list(listeners) == [("127.0.0.1", port)], listeners
    assert listeners[("127.0.0.1", port)] in _socket_inodes(srv.proc.pid), "not the launcher's socket"
    assert sync_ping(srv.addr)


def test_resets_on_the_rendezvous_port_leave_the_json_log_json(start_server):
    """Each connection reset on the store's port made torch print a C++ warning line of its
    own to the launcher's stderr: any local process could fill a JSON log with lines that are
    not JSON. ``serve`` now starts torch with ``TORCH_CPP_LOG_LEVEL=ERROR`` unless it is set."""
    import socket as sk
    import struct

    srv = start_server("--tp", "2", "--log-format", "json")
    port = int(re.search(r'"dist": "127\.0\.0\.1:(\d+)"', srv.logs()).group(1))
    for _ in range(3):
        with sk.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"\xff" * 64)
            s.setsockopt(sk.SOL_SOCKET, sk.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    assert sync_ping(srv.addr)
    assert srv.stop() == 0
    _json_events(srv.logs())


def test_malformed_http_on_the_admin_port_is_one_json_line_each(start_server):
    """aiohttp logged each malformed request to /health or /metrics as an ERROR with a
    traceback, through Python's last-resort handler: plain text in a JSON log, from any
    local process. Now: one ``bad_http_request`` info line each, JSON, and no traceback."""
    import socket as sk

    from .test_operations import free_port

    admin = free_port()
    srv = start_server("--admin", str(admin), "--log-format", "json")
    bad = [b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
           b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"]
    for raw_request in bad:
        with sk.create_connection(("127.0.0.1", admin)) as s:
            s.settimeout(10)
            s.sendall(raw_request)
            assert s.recv(4096).startswith(b"HTTP/1.0 400")
    with sk.create_connection(("127.0.0.1", admin)) as s:
        s.settimeout(10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    assert srv.stop() == 0
    events = _json_events(srv.logs())
    assert [e["level"] for e in events if e["event"] == "bad_http_request"] == ["info", "info"], events
    assert not [e for e in events if e["level"] == "error" or "exc" in e], events


def test_admin_port_zero_listens_on_a_free_port_named_in_its_log(start_server):
    """``--admin 127.0.0.1:0`` was refused at start-up (an outside client running several
    servers wanted the kernel to pick); now it listens on a free port, which
    ``admin_listening`` names, and that port answers /health."""
    import socket as sk

    srv = start_server("--admin", "127.0.0.1:0", "--log-format", "json")
    listening = [e for e in _json_events(srv.logs()) if e["event"] == "admin_listening"]
    assert len(listening) == 1, listening
    host, port = listening[0]["address"].removeprefix("http://").rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0, listening
    with sk.create_connection((host, int(port))) as s:
        s.settimeout(10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    assert srv.stop() == 0


def _json_events(logs: str) -> list[dict]:
    """Every line of a ``--log-format json`` log, parsed: the test fails on any line that is not JSON."""
    lines = [line for line in logs.splitlines() if line.strip()]
    not_json = [line for line in lines if not _is_json(line)]
    assert lines and not not_json, not_json[:5]
    return [json.loads(line) for line in lines]


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def test_a_taken_dist_init_port_is_a_config_error_at_once(tmp_path):
    """A port rank 0 cannot serve the rendezvous store on is a start-up conflict, like a taken
    frontend: exit 2 within seconds. It was exit 3 after the followers' retries ran out
    (``collective_timeout`` + 5 s, 35 s by default)."""
    import socket as sk

    with sk.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve("--tp", "2", "--frontend", f"ipc://{tmp_path}/m.sock", "--dist-init", f"tcp://127.0.0.1:{port}")
        t0 = time.monotonic()
        try:
            _, err = proc.communicate(timeout=25)
        except subprocess.TimeoutExpired:
            for pid in [*_children(proc.pid), proc.pid]:  # the ranks have sessions of their own
                os.kill(pid, signal.SIGKILL)
            _, err = proc.communicate()
            raise AssertionError(f"still starting after 25 s on a taken port:\n{err[-2000:]}") from None
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert f"dist_init: 127.0.0.1:{port} is in use" in err and "Traceback" not in err, err[-2000:]
    assert time.monotonic() - t0 < 25


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(p) for p in fh.read().split()]


def _two_ranks(proc: subprocess.Popen) -> list[int]:
    """The pids of the two ranks the launcher ``proc`` starts, as soon as both exist."""
    deadline = time.monotonic() + 60
    while len(ranks := _children(proc.pid)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "the launcher never started two ranks"
        time.sleep(0.02)
    return ranks


def _kill_group(proc: subprocess.Popen, ranks: list[int]) -> None:
    """Whatever is left of a launcher and its ranks (each rank runs in a session of its own)."""
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_the_ranks_stop_when_the_launcher_is_killed(tmp_path, when):
    """Starting: a follower ignores SIGTERM (the leader decides when it stops), so when the
    launcher was killed while the group was still starting, the follower lived on, retrying the
    gone rendezvous store for a minute or more (and, on a fixed ``--dist-init`` port, could meet
    a restarted group's); now it dies with the launcher until its group is up. Serving: the
    leader drains and stops its followers, which must live for that. No batch ring: a leader
    killed between creating and unlinking it would leave the segment to the sweep."""
    import msgpack
    import zmq

    addr = f"ipc://{tmp_path}/m.sock"
    proc = _serve("--tp", "2", "--frontend", addr, "--no-batch-ring", "--fault", "1:stall:hold-*", "--stall-s", "2")
    ranks: list[int] = []
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    try:
        ranks = _two_ranks(proc)
        if when == "serving":  # a request in flight, rank 1 inside its step (2 s), when the launcher dies
            assert sync_ping(addr, 60) is not None, "the group never served"
            client.connect(addr)
            client.send(msgpack.packb({"v": 1, "type": "embed", "rid": "hold-1", "input_ids": [1, 2, 3]}))
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()  # (not communicate: the ranks hold its pipes open while they live)
        wait_until(lambda: not any(map(pid_alive, ranks)), 10, f"ranks {ranks} gone after the launcher died")
        if when == "serving":
            assert client.poll(1000), "no answer to the request in flight"
            reply = msgpack.unpackb(client.recv_multipart()[0])
            assert (reply["rid"], reply["status"]) == ("hold-1", 200), reply
    finally:
        client.close()
        _kill_group(proc, ranks)
        err = proc.communicate()[1]
    if when == "serving":
        assert "[rank0] stopped" in err and "group_broken" not in err, err[-3000:]


def test_a_leader_killed_during_start_up_takes_its_followers_down_at_once(tmp_path):
    """Only the leader answers clients, so a follower whose leader failed serves nobody. Yet
    the launcher gave it ``collective_timeout`` + 5 s, and a follower still starting waited
    out the rendezvous store's 30 s for a leader that would never come: the group took 31 s
    to exit, a supervisor that long to restart it. Now the followers get two seconds."""
    proc = _serve("--tp", "2", "--frontend", f"ipc://{tmp_path}/m.sock")
    ranks: list[int] = []
    try:
        ranks = _two_ranks(proc)
        os.kill(ranks[0], signal.SIGKILL)  # rank 0, before it served the group anything
        killed = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - killed
    finally:
        _kill_group(proc, ranks)
        if proc.returncode is None:
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGKILL, err[-2000:]
    assert "rank_exited codes=-9," in err and "group_exited codes=-9," in err, err[-2000:]
    assert took < 10, f"the group took {took:.1f} s to exit after its leader was killed"
    assert not any(map(pid_alive, ranks))
