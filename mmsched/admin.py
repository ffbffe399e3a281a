"""The leader's admin HTTP endpoint: ``GET /health`` and ``GET /metrics``, on the asyncio loop.

Served by aiohttp (as the tokenizer worker): two routes, nothing else. /health is 200
only while every rank is alive and the last collective finished within its deadline.
The view it serves only needs ``health()`` and ``metrics.render()``.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web

from .config import ADMIN_RE, shown
from .errors import ConfigError
from .log import event

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def parse_address(addr: str) -> tuple[str, int]:
    """``PORT``, ``HOST:PORT`` or ``[IPV6]:PORT`` (the form ``config`` checks, ``ADMIN_RE``);
    the host defaults to 127.0.0.1."""
    form = ADMIN_RE.fullmatch(addr)
    if form is None:
        raise ConfigError(f"admin: {shown(addr)} is not PORT, HOST:PORT or [IPV6]:PORT")
    return form["ipv6"] or form["host"] or "127.0.0.1", int(form["port"])


def listen_address(address: str) -> tuple[socket.AddressFamily, str, int]:
    """The one address the endpoint listens on: the host's first IPv4 address, else its first.
    asyncio listens on every address a name has (``localhost``: 127.0.0.1 and ::1), each on
    a port of its own for port 0, and the start-up check tried only one of them."""
    host, port = parse_address(address)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError, TypeError) as exc:  # bad names raise more than OSError
        raise ConfigError(f"admin: cannot listen on {shown(host)}: {getattr(exc, 'strerror', None) or exc}") from exc
    family, _, _, _, sockaddr = min(found, key=lambda info: info[0] != socket.AF_INET)
    zone = host[host.index("%"):] if "%" in host and family == socket.AF_INET6 else ""  # getaddrinfo drops it
    return family, sockaddr[0] + zone, port


def url(family: socket.AddressFamily, ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if family == socket.AF_INET6 else f"http://{ip}:{port}"


def check_admin(address: str) -> None:
    """Before anything starts: a port already taken stops start-up as a config error
    (exit 2), instead of failing after the leader said ``serving``."""
    if not address:
        return
    family, ip, port = listen_address(address)
    try:
        with socket.create_server((ip, port), family=family):  # SO_REUSEADDR, as asyncio's own listener
            pass
    except OSError as exc:
        raise ConfigError(f"admin: cannot listen on {url(family, ip, port)}: {exc.strerror}") from exc


class AdminServer:
    """Connections are bounded (each is a descriptor of the leader's: 1,600 idle ones took it to
    its limit in an outside attack) and must send their request headers within HEADER_S."""

    MAX_CONNECTIONS, HEADER_S = 64, 10.0

    def __init__(self, view, address: str):
        self.view, self.address = view, address
        self._runner: web.AppRunner | None = None
        self._site = None

    async def start(self) -> None:
        from aiohttp import web  # here: only a leader serving --admin pays for importing aiohttp

        from .worker.guard import Guard

        family, ip, port = listen_address(self.address)
        guard = Guard(self.MAX_CONNECTIONS, self.HEADER_S, who="admin")
        app = web.Application(client_max_size=8192, middlewares=[guard.middleware])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        # lingering_time 0: a body sent with a GET is not read after the answer (aiohttp would for
        # up to 10 s, and a trickled one held its place that long: an outside attack)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, lingering_time=0)
        await self._runner.setup()
        guard.server = self._runner.server
        try:
            self._site = await asyncio.get_running_loop().create_server(guard, ip, port, family=family)
        except OSError as exc:
            await self.close()
            raise ConfigError(f"admin: cannot listen on {url(family, ip, port)}: {exc.strerror}") from exc
        port = self._site.sockets[0].getsockname()[1]  # the one the kernel chose, for port 0
        event("admin_listening", address=url(family, ip, port))

    async def close(self) -> None:
        if self._site is not None:
            self._site.close()
            self._site = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _request: web.Request) -> web.Response:
        ok, reason = self.view.health()
        return _closing(status=200 if ok else 503, text=reason + "\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        return _closing(body=self.view.metrics.render(), headers={"Content-Type": METRICS_TYPE})


def _closing(**response) -> web.Response:
    """No keep-alive, as before the move to aiohttp: a scrape is one request on one connection."""
    from aiohttp import web

    resp = web.Response(**response)
    resp.force_close()
    return resp
