"""Who may talk to the frontend: loopback and ipc:// are local; anything else needs CurveZMQ.

A frontend bound beyond this host refuses to start without a server key and a directory
of allowed client public keys, unless ``--insecure`` says so on purpose. Keys are
ZeroMQ certificate files (``mmsched keygen``): ``NAME.key`` (public, give it to the
other side) and ``NAME.key_secret`` (keep it).
"""

from __future__ import annotations

import ipaddress
import os
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
    """Refuse a frontend reachable from other hosts without Curve, unless insecure is set."""
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


def remove_ipc(address: str) -> None:
    """After the frontend closed: ZeroMQ leaves an ipc:// socket file behind; remove ours."""
    path = _ipc_path(address)
    if path and os.path.exists(path) and stat.S_ISSOCK(os.lstat(path).st_mode):
        os.unlink(path)


def restrict_ipc(address: str, mode: int) -> None:
    """Give an ipc:// socket file its configured mode (default 0660).

    A Linux abstract socket (``ipc://@name``) has no file and so no mode: like loopback
    tcp, any local process may connect to it."""
    path = _ipc_path(address)
    if path:
        os.chmod(path, mode)
