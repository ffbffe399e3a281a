"""Shared fixtures: real server processes, and a /dev/shm guard on every test."""

from __future__ import annotations

import contextlib
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid

import msgpack
import pytest
import zmq

from mmsched.auth import secure_client

SHM_DIR = "/dev/shm"
PREFIX = "mmsched_"


def shm_segments(prefix: str = PREFIX) -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _outside_run(pid: int) -> bool:
    """A live process that is neither this test run nor one of its descendants."""
    if _ppid(pid) is None:
        return False  # gone: what it left is ours to account for (a killed client, say)
    me = os.getpid()
    for _ in range(64):  # walk up the parent chain
        if pid == me:
            return False
        parent = _ppid(pid)
        if parent is None or parent <= 1:
            return True
        pid = parent
    return True


def _lock_holders(name: str) -> set[int]:
    """Pids holding a flock on the segment (/proc/locks), as every client of the contract does."""
    try:
        st = os.stat(os.path.join(SHM_DIR, name))
        with open("/proc/locks") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return set()
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return {int(f[4]) for f in (line.split() for line in lines) if len(f) > 5 and f[1] == "FLOCK" and f[5] == want}


def _foreign(name: str) -> bool:
    """A segment another run on this machine (a developer's server or client, a second
    pytest, another xdist worker) owns: its creator (``<prefix><pid>_...``) or a process holding its lock is alive
    outside this test run. Neither flagged nor removed here. Segments of our own processes,
    dead ones included, are ours to account for."""
    if any(_outside_run(pid) for pid in _lock_holders(name)):
        return True
    creator = _creator(name)
    return creator is not None and _outside_run(creator)


_NEW_NAME = re.compile(r"_(\d+)_(?:ring_)?[0-9a-f]+(?:\.\w+)?$")  # segments.new_name under any prefix


def _creator(name: str) -> int | None:
    """The pid in ``<prefix><pid>_...``: the default prefix, or a test's own (``mmsched_t1a2b_``)."""
    head = name[len(PREFIX):].split("_", 1)[0]
    if head.isdigit():
        return int(head)
    m = _NEW_NAME.search(name)
    return int(m.group(1)) if m else None


def _new_segments(before: set[str]) -> set[str]:
    return {n for n in shm_segments() - before if not _foreign(n)}


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Fail the test that leaves an mmsched segment in /dev/shm (and clean up after it)."""
    before = shm_segments()
    yield
    deadline = time.monotonic() + 2.0  # a killed server's ranks may still be exiting
    while (leaked := _new_segments(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if leaked:
        for name in leaked:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
        pytest.fail(f"test leaked {len(leaked)} segment(s) in /dev/shm: {sorted(leaked)[:5]}")


def sync_ping(addr: str, timeout: float = 1.0, server_key: str | None = None,
              client_cert: str | None = None) -> dict | None:
    """One ping over a fresh DEALER (CurveZMQ when keys are given); None if no pong within timeout."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        if server_key is not None:
            secure_client(s, server_key, client_cert)
        s.connect(addr)
        s.send(msgpack.packb({"v": 1, "type": "ping"}))
        if s.poll(int(timeout * 1000)):
            return msgpack.unpackb(s.recv(), raw=False)
        return None
    finally:
        s.close(linger=0)


def fd_targets(pid: int | str = "self") -> list[str]:
    """What each descriptor of process ``pid`` points at (``/dev/shm/NAME``, ``socket:[INODE]``,
    ...); one closed while we look is skipped."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range, for a server or a gloo store a test
    starts: a port ``bind(0)`` hands out can be taken, before the server binds it, by the local
    end of any outgoing connection, gloo's in a test running beside this one among them
    ("Address already in use": 5 setup errors in one clean-clone ``.ci/run``)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        low = int(fh.read().split()[0])
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def two_ranks(target, *args, answers: int = 2, timeout: float = 120) -> list:
    """Run ``target(rank, port, queue, *args)`` in two spawned rank processes (a gloo group on a
    free port); the first ``answers`` items they put on the queue. Both are joined (killed if stuck)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, out, *args)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=timeout) for _ in range(answers)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def pid_alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (reaped between the open and the read: ESRCH)
        return False


def start_bare_router(addr: str, max_seconds: float = 120) -> subprocess.Popen:
    """bench/bare_router.py (the throughput ceiling: decodes and answers, nothing more) on
    ``addr``, once it says it is bound; the caller stops it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, os.path.join(root, "bench", "bare_router.py"), addr,
                             "--max-seconds", str(max_seconds)], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        raise AssertionError(f"bench/bare_router.py did not start on {addr}")
    return proc


@contextlib.contextmanager
def bare_router(max_seconds: float = 120):
    """``start_bare_router`` on a private ipc:// address, yielded; stopped (killed if it will
    not stop) on the way out."""
    addr = f"ipc:///tmp/mmsched-test-bare-{uuid.uuid4().hex[:8]}.sock"
    proc = start_bare_router(addr, max_seconds)
    try:
        yield addr
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


class Server:
    """A real ``mmsched serve`` subprocess on a private ipc:// address."""

    def __init__(self, *args: str, tmp_dir: str, env: dict | None = None, ready_timeout: float = 90.0,
                 nofile: int | None = None):
        """``nofile``: the server's RLIMIT_NOFILE, soft and hard (default: this process's)."""
        self.ready_timeout = ready_timeout
        self.addr = f"ipc:///tmp/mmsched-test-{uuid.uuid4().hex[:10]}.sock"
        self.log_path = os.path.join(tmp_dir, f"server-{uuid.uuid4().hex[:6]}.log")
        self._log = open(self.log_path, "wb")
        clean_env = {k: v for k, v in os.environ.items()
                     if not k.startswith("MMSCHED_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        clean_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmsched", "serve", "--frontend", self.addr, *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=clean_env, start_new_session=True,
            preexec_fn=None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))

    def wait_ready(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.logs()}")
            pong = sync_ping(self.addr, 0.5)
            if pong is not None:
                return pong
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as fh:
            return fh.read().decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise

    def __enter__(self) -> "Server":
        """``with Server(...) as srv``: ready inside; stopped after (and its process group
        killed), even when a test broke it."""
        try:
            self.wait_ready(self.ready_timeout)
        except BaseException:
            self.kill_all()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.kill_all()

    def rank_pids(self, timeout: float = 10.0) -> list[int]:
        """The rank pids the tp>1 launcher logged (``launched ranks=N pids=P0,P1,...``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"launched ranks=\d+ pids=([\d,]+)", self.logs())
            if m:
                return [int(p) for p in m.group(1).split(",")]
            time.sleep(0.05)
        raise AssertionError(f"no 'launched' line in the server log:\n{self.logs()}")

    def kill_all(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        try:  # a killed server cannot remove its socket file itself
            os.unlink(self.addr[len("ipc://"):])
        except FileNotFoundError:
            pass
        self._log.close()


@pytest.fixture
def start_server(tmp_path):
    """Factory: ``srv = start_server("--tp", "2")`` starts and waits for a ready server."""
    servers: list[Server] = []

    def start(*args: str, env: dict | None = None, ready: bool = True) -> Server:
        srv = Server(*args, tmp_dir=str(tmp_path), env=env)
        servers.append(srv)
        if ready:
            srv.wait_ready()
        return srv

    yield start
    for srv in servers:
        if srv.proc.poll() is None:
            try:
                srv.stop(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        srv.kill_all()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One tp=1 server for a whole module of tests that do not change its state."""
    with Server(tmp_dir=str(tmp_path_factory.mktemp("srv"))) as srv:
        yield srv
