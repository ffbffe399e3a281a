"""Who may talk to the frontend: loopback and ipc:// are local; anything else needs CurveZMQ.

A frontend bound beyond this host refuses to start without a server key and a directory
of allowed client public keys, unless ``--insecure`` says so on purpose. Keys are
ZeroMQ certificate files (``mmsched keygen``): ``NAME.key`` (public, give it to the
other side) and ``NAME.key_secret`` (keep it).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from .errors import ConfigError
from .log import event


def is_local(address: str) -> bool:
    """ipc:// and inproc://, or tcp:// on a loopback address (127.0.0.0/8, ::1, localhost)."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name, a hostname: reachable from elsewhere


def check_frontend(cfg) -> None:
    """Refuse a live or unusable ipc:// path, and a frontend reachable from other hosts
    without Curve unless insecure is set. Run before a group starts: one clear line."""
    claim_ipc(cfg.frontend)
    if is_local(cfg.frontend) or cfg.insecure:
        return
    if not cfg.curve_secret_key or not cfg.curve_clients_dir:
        raise ConfigError(f"frontend: {cfg.frontend} is reachable from other hosts; set curve_secret_key and "
                          "curve_clients_dir (see mmsched keygen), or insecure = true to serve without auth")
    for key in ("curve_secret_key", "curve_clients_dir"):
        if not os.path.exists(getattr(cfg, key)):
            raise ConfigError(f"{key}: {getattr(cfg, key)} does not exist")


def keygen(out_dir: str, name: str) -> tuple[str, str]:
    """Write NAME.key and NAME.key_secret in out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    public, secret = zmq.auth.create_certificates(out_dir, name)
    os.chmod(secret, stat.S_IRUSR | stat.S_IWUSR)
    return public, secret


def secure_frontend(ctx: zmq.asyncio.Context, sock: zmq.Socket, cfg) -> AsyncioAuthenticator | None:
    """Before bind: make ``sock`` a Curve server allowing only the keys in curve_clients_dir."""
    if not cfg.curve_secret_key:
        return None
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=cfg.curve_clients_dir)
    public, secret = zmq.auth.load_certificate(cfg.curve_secret_key)
    if secret is None:
        raise ConfigError(f"curve_secret_key: {cfg.curve_secret_key} holds no secret key")
    sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True
    event("curve_enabled", clients=len(zmq.auth.load_certificates(cfg.curve_clients_dir)))
    return auth


def secure_client(sock: zmq.Socket, server_key: str | bytes, client_cert: str) -> None:
    """Before connect: authenticate as ``client_cert`` (a .key_secret file) to a Curve server."""
    if isinstance(server_key, str) and os.path.exists(server_key):
        server_key = zmq.auth.load_certificate(server_key)[0]
    public, secret = zmq.auth.load_certificate(client_cert)
    sock.curve_serverkey = server_key if isinstance(server_key, bytes) else server_key.encode()
    sock.curve_publickey, sock.curve_secretkey = public, secret


def _ipc_path(address: str) -> str | None:
    """The file behind an ipc:// address (None for tcp:// and Linux abstract sockets)."""
    if address.startswith("ipc://") and not address.startswith("ipc://@"):
        return address[len("ipc://"):]
    return None


def claim_ipc(address: str) -> None:
    """Before binding: ZeroMQ unlinks whatever lies at an ipc:// path and binds anew, which
    silently takes the socket of a live server (and would remove a regular file). Refuse a
    path a server still answers on, or that is not a socket; a stale socket is taken over."""
    path = _ipc_path(address)
    if not path:
        return
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise ConfigError(f"frontend: {address}: directory {parent} does not exist")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"frontend: {address}: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return  # stale: left by a server that was killed
        except OSError:
            pass  # a backlog that does not answer is still somebody's
    raise ConfigError(f"frontend: {address} is in use by a running server; stop it or choose another path")


def ipc_identity(address: str) -> tuple[int, int] | None:
    """(device, inode) of the ipc:// socket file we bound, to tell it from a later one."""
    path = _ipc_path(address)
    try:
        st = os.lstat(path) if path else None
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino) if st else None


def ipc_lost(address: str, bound: tuple[int, int] | None) -> str | None:
    """Why clients can no longer reach our ipc:// frontend (the file removed or replaced), or None."""
    if bound is None or ipc_identity(address) == bound:
        return None
    return f"frontend gone: {_ipc_path(address)} was removed or replaced; clients cannot connect"


def remove_ipc(address: str, bound: tuple[int, int] | None) -> None:
    """After the frontend closed: ZeroMQ leaves an ipc:// socket file behind; remove it if it is ours."""
    path = _ipc_path(address)
    if path and bound is not None and ipc_identity(address) == bound:
        os.unlink(path)


def restrict_ipc(address: str, mode: int) -> None:
    """Give an ipc:// socket file its configured mode (default 0660).

    A Linux abstract socket (``ipc://@name``) has no file and so no mode: like loopback
    tcp, any local process may connect to it."""
    path = _ipc_path(address)
    if path:
        os.chmod(path, mode)
