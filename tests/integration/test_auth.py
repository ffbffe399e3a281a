"""Who may talk to the frontend, against real servers.

- ``mmsched keygen`` writes a CurveZMQ key pair (the secret file mode 0600).
- A frontend reachable from other hosts (``tcp://0.0.0.0``) refuses to start without
  Curve keys (exit 2 naming ``curve_secret_key``), starts with ``--insecure``.
- With Curve keys: a client whose public key is in ``curve_clients_dir`` is served; a
  client with another key, or a plain client, gets nothing through.
- Loopback tcp and ipc:// need no keys; an ipc:// socket file gets mode 0660 by default,
  ``--ipc-mode``'s otherwise.

Servers bound to 0.0.0.0 are only ever connected to through 127.0.0.1. The servers of
this module start in parallel (each rank imports torch; two cores).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import subprocess
import sys

import pytest
import zmq
import zmq.auth

from mmsched.client import Client

from ..conftest import free_port, Server, sync_ping


def keygen(out: str, name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmsched", "keygen", "--out", out, "--name", name],
                          capture_output=True, text=True, timeout=60)



class Keys:
    def __init__(self, root: str):
        self.dir = os.path.join(root, "keys")
        self.clients_dir = os.path.join(root, "allowed")
        os.makedirs(self.clients_dir)
        for name in ("server", "alice", "mallory"):
            out = keygen(self.dir, name)
            assert out.returncode == 0, out.stderr
        shutil.copy(self.path("alice.key"), self.clients_dir)  # only alice is allowed

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("auth"))
    keys = Keys(root)
    ports = {k: free_port() for k in ("insecure", "curve", "loopback")}
    specs = {
        "insecure": ("--frontend", f"tcp://0.0.0.0:{ports['insecure']}", "--insecure"),
        "curve": ("--frontend", f"tcp://0.0.0.0:{ports['curve']}", "--curve-secret-key",
                  keys.path("server.key_secret"), "--curve-clients-dir", keys.clients_dir),
        "loopback": ("--frontend", f"tcp://127.0.0.1:{ports['loopback']}"),
        "ipc_default": (),
        "ipc_600": ("--ipc-mode", "600"),
    }
    started: dict[str, Server] = {}
    try:
        for name, args in specs.items():  # all at once: they import torch in parallel
            started[name] = Server(*args, tmp_dir=root)
        for name in ("insecure", "curve", "loopback"):
            started[name].addr = f"tcp://127.0.0.1:{ports[name]}"  # connect through loopback only
        for name, srv in started.items():
            _wait_ready(srv, keys if name == "curve" else None)
        yield started, keys
    finally:
        for srv in started.values():  # drain all at once, then reap
            if srv.proc.poll() is None:
                srv.proc.send_signal(signal.SIGTERM)
        for srv in started.values():
            try:
                srv.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
            srv.kill_all()


def _wait_ready(srv: Server, keys: Keys | None, timeout: float = 90.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"server exited {srv.proc.returncode}:\n{srv.logs()}")
        if keys is None:
            pong = sync_ping(srv.addr, 0.5)
        else:
            pong = sync_ping(srv.addr, 0.5, keys.path("server.key"), keys.path("alice.key_secret"))
        if pong is not None:
            return
    raise TimeoutError(f"server not ready:\n{srv.logs()}")


# ---------------------------------------------------------------- keygen

def test_keygen_writes_a_key_pair(tmp_path):
    out = keygen(str(tmp_path / "k"), "node1")
    assert out.returncode == 0, out.stderr
    public, secret = tmp_path / "k" / "node1.key", tmp_path / "k" / "node1.key_secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    pub, sec = zmq.auth.load_certificate(str(secret))
    assert len(pub) == 40 and sec is not None and len(sec) == 40  # z85 of 32-byte keys
    assert zmq.auth.load_certificate(str(public)) == (pub, None)  # the public file holds no secret
    assert "secret-key" not in public.read_text()
    assert str(public) in out.stdout and str(secret) in out.stdout


# ---------------------------------------------------------------- refusing to start

@pytest.mark.parametrize("frontend", ["tcp://0.0.0.0:{port}", "tcp://*:{port}"])
def test_non_loopback_frontend_without_keys_refuses_to_start(frontend, tmp_path):
    addr = frontend.format(port=free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMSCHED_")}
    out = subprocess.run([sys.executable, "-m", "mmsched", "serve", "--frontend", addr],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "curve_secret_key" in out.stderr and "insecure" in out.stderr, out.stderr
    # a key file that does not exist is refused just as early
    out = subprocess.run([sys.executable, "-m", "mmsched", "serve", "--frontend", addr,
                          "--curve-secret-key", str(tmp_path / "nope.key_secret"),
                          "--curve-clients-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "curve_secret_key" in out.stderr, out.stderr


# ---------------------------------------------------------------- serving

async def test_insecure_non_loopback_frontend_serves_anyone(servers):
    srv = servers[0]["insecure"]
    async with Client(srv.addr) as c:
        r = await c.embed([1, 2, 3], timeout=10)
    assert r.status == 200, r


async def test_curve_serves_only_allowed_keys(servers):
    started, keys = servers
    srv = started["curve"]
    async with Client(srv.addr, server_key=keys.path("server.key"),
                      client_cert=keys.path("alice.key_secret")) as alice:
        r = await alice.embed([1, 2, 3], timeout=10)
        assert r.status == 200, r
        async with Client(srv.addr, server_key=keys.path("server.key"),
                          client_cert=keys.path("mallory.key_secret")) as mallory, Client(srv.addr) as plain:
            f_m = mallory.send_request("embed", [4], rid="mallory-1")
            f_p = plain.send_request("embed", [5], rid="plain-1")
            m_ping = asyncio.ensure_future(mallory.ping(timeout=2.0))
            p_ping = asyncio.ensure_future(plain.ping(timeout=2.0))
            # a bounded wait: nothing at all comes back to either of them
            waits = await asyncio.gather(mallory.wait("mallory-1", f_m, 2.0), plain.wait("plain-1", f_p, 2.0),
                                         m_ping, p_ping, return_exceptions=True)
            assert all(isinstance(w, asyncio.TimeoutError) for w in waits), waits
            assert mallory.unrouted == [] and plain.unrouted == []
            # meanwhile the allowed client is served as before
            r2 = await alice.embed([6, 7], timeout=10)
            assert r2.status == 200, r2
    assert "mallory-1" not in srv.logs() and "plain-1" not in srv.logs()  # nothing reached mmsched
    assert "curve_enabled clients=1" in srv.logs()
    assert sync_ping(srv.addr, 5.0, keys.path("server.key"), keys.path("alice.key_secret"))["healthy"] is True


async def test_loopback_tcp_needs_no_keys(servers):
    srv = servers[0]["loopback"]
    async with Client(srv.addr) as c:
        r = await c.embed([1, 2, 3], timeout=10)
    assert r.status == 200, r
    assert "curve_enabled" not in srv.logs()


def _socket_mode(srv: Server) -> int:
    path = srv.addr[len("ipc://"):]
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode)
    return stat.S_IMODE(st.st_mode)


async def test_ipc_needs_no_keys_and_its_socket_file_is_0660(servers):
    srv = servers[0]["ipc_default"]
    assert _socket_mode(srv) == 0o660
    async with Client(srv.addr) as c:
        r = await c.embed([1, 2, 3], timeout=10)
    assert r.status == 200, r


def test_ipc_mode_setting_sets_the_socket_file_mode(servers):
    srv = servers[0]["ipc_600"]
    assert _socket_mode(srv) == 0o600
    assert sync_ping(srv.addr, 5.0)["healthy"] is True
