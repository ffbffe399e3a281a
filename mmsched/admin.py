"""The leader's admin HTTP endpoint: ``GET /health`` and ``GET /metrics``, on the asyncio loop.

Small on purpose: two routes, no keep-alive, bounded request size. /health is 200 only
while every rank is alive and the last collective finished within its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from .errors import ConfigError
from .log import event

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


def parse_address(addr: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT``; the host defaults to 127.0.0.1."""
    host, _, port = addr.rpartition(":")
    return (host or "127.0.0.1"), int(port)


def check_admin(address: str) -> None:
    """Before anything starts: a port already taken stops start-up as a config error
    (exit 2), instead of failing after the leader said ``serving``."""
    if not address:
        return
    host, port = parse_address(address)
    try:
        with socket.create_server((host, port)):  # SO_REUSEADDR, as asyncio's own listener
            pass
    except OSError as exc:
        raise ConfigError(f"admin: cannot listen on {host}:{port}: {exc.strerror}") from exc


class AdminServer:
    def __init__(self, leader, address: str):
        self.leader, self.address = leader, address
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        host, port = parse_address(self.address)
        try:
            self._server = await asyncio.start_server(self._handle, host, port, limit=8192)
        except OSError as exc:
            raise ConfigError(f"admin: cannot listen on {host}:{port}: {exc.strerror}") from exc
        event("admin_listening", address=f"http://{host}:{port}")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            status, ctype, body = self._route(method, path.split("?", 1)[0])
            writer.write(f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError, ValueError):
            pass
        except Exception as exc:  # noqa: BLE001 - the admin port must never take the loop down
            event("admin_error", logging.WARNING, error=repr(exc))
        finally:
            writer.close()

    def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method != "GET":
            return 405, "text/plain", b"GET only\n"
        if path == "/health":
            ok, reason = self.leader.health()
            return (200 if ok else 503), "text/plain", (reason + "\n").encode()
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4; charset=utf-8", self.leader.metrics.render()
        return 404, "text/plain", b"try /health or /metrics\n"
