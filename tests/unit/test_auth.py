"""Which frontends count as local (no CurveZMQ needed), and the start-up checks."""

from __future__ import annotations

import os
import socket
import stat
import types

import pytest

from mmsched.auth import check_frontend, claim_ipc, is_local, keygen, restrict_ipc
from mmsched.errors import ConfigError


@pytest.mark.parametrize("address", [
    "tcp://127.0.0.1:5555", "tcp://127.5.5.5:5555", "tcp://localhost:5555", "tcp://[::1]:5555",
    "ipc:///tmp/mmsched.sock", "ipc://@abstract-name", "inproc://frontend",
])
def test_local(address):
    assert is_local(address)


@pytest.mark.parametrize("address", [
    "tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.1:5555", "tcp://192.168.1.7:5555",
    "tcp://example.com:5555", "tcp://eth0:5555", "tcp://[::]:5555", "tcp://[2001:db8::1]:5555",
    "tcp://127.0.0.1.example.com:5555", "tcp://localhost.example.com:5555",
    "tcp://127.0.0.1", "tcp://:5555",  # unparsable: treated as reachable from elsewhere
])
def test_not_local(address):
    assert not is_local(address)


def _cfg(**kw):
    base = dict(frontend="tcp://0.0.0.0:5555", insecure=False, curve_secret_key="", curve_clients_dir="")
    return types.SimpleNamespace(**{**base, **kw})


def test_check_frontend(tmp_path):
    check_frontend(_cfg(frontend="tcp://127.0.0.1:5555"))
    check_frontend(_cfg(frontend="ipc:///tmp/x.sock"))
    check_frontend(_cfg(insecure=True))
    with pytest.raises(ConfigError, match="curve_secret_key"):
        check_frontend(_cfg())
    with pytest.raises(ConfigError, match="curve_secret_key"):  # one of the two is not enough
        check_frontend(_cfg(curve_secret_key=str(tmp_path / "s.key_secret")))
    public, secret = keygen(str(tmp_path / "keys"), "server")
    with pytest.raises(ConfigError, match="curve_clients_dir"):
        check_frontend(_cfg(curve_secret_key=secret, curve_clients_dir=str(tmp_path / "missing")))
    check_frontend(_cfg(curve_secret_key=secret, curve_clients_dir=str(tmp_path / "keys")))
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600


def test_restrict_ipc_sets_the_mode_and_leaves_others_alone(tmp_path):
    path = tmp_path / "sock"
    path.write_bytes(b"")
    os.chmod(path, 0o777)
    restrict_ipc(f"ipc://{path}", 0o640)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    restrict_ipc("ipc://@abstract-name", 0o660)  # an abstract socket has no file: nothing to do
    restrict_ipc("tcp://127.0.0.1:5555", 0o660)


def test_claim_ipc_refuses_a_live_socket_or_a_file_and_takes_a_stale_socket(tmp_path):
    """ZeroMQ unlinks whatever lies at an ipc:// path before it binds: a live server's socket
    (issue 17 item 2) or a regular file (it used to delete one named as --frontend)."""
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    with pytest.raises(ConfigError, match=r"^frontend: .* exists and is not a socket"):
        claim_ipc(f"ipc://{precious}")
    assert precious.read_text() == "keep me"
    with pytest.raises(ConfigError, match=r"^frontend: .*directory .*missing does not exist"):
        claim_ipc(f"ipc://{tmp_path}/missing/s.sock")
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(live))
        server.listen()
        with pytest.raises(ConfigError, match=r"^frontend: .* is in use by a running server"):
            claim_ipc(f"ipc://{live}")
    claim_ipc(f"ipc://{live}")  # closed, file left behind: stale, taken over
    claim_ipc(f"ipc://{tmp_path}/new.sock")
    claim_ipc("ipc://@abstract-name")
    claim_ipc("tcp://127.0.0.1:5555")
