"""Slow clients: a deadline for a connection's request headers, and a bound on open connections.

aiohttp has neither (its ``keepalive_timeout`` covers only idle time between requests,
and a handler runs only once the headers are in), so a client sending headers a byte at a
time held a connection as long as it liked, and a hundred such connections never counted
against ``--max-concurrency``. The guard wraps aiohttp's protocol factory: a connection
past ``max_connections`` is answered 503 and closed, and one whose first request has not
reached a handler within ``header_timeout`` is closed.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web


class Guard:
    """The protocol factory for ``loop.create_server``, plus the middleware that marks headers read."""

    def __init__(self, max_connections: int, header_timeout: float, who: str = "worker"):
        self.server: web.Server | None = None  # the runner's, once it is set up
        self.busy = json.dumps({"error": {"message": f"{who} busy: too many open connections", "code": 503}}).encode()
        self.max_connections, self.header_timeout = max_connections, header_timeout
        self.waiting: set = set()  # connections whose first request has not reached a handler

    def __call__(self) -> asyncio.Protocol:
        if self._num_open() >= self.max_connections:
            return _Refuse(self.busy)
        proto = self.server()
        self.waiting.add(proto)
        asyncio.get_running_loop().call_later(self.header_timeout, self._expire, proto)
        return proto

    def _num_open(self) -> int:
        """aiohttp keeps a closed connection in ``connections`` until its task has ended, a few
        loop turns after the peer saw the close: a client that reconnected at once was told 503."""
        return sum(1 for proto in self.server.connections if proto.connected)

    def _expire(self, proto) -> None:
        if proto in self.waiting:
            self.waiting.discard(proto)
            proto.force_close()

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        self.waiting.discard(request.protocol)
        return await handler(request)


class _Refuse(asyncio.Protocol):
    """A connection over the bound: one JSON 503, then closed."""

    def __init__(self, busy: bytes):
        self.busy = busy

    def connection_made(self, transport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(self.busy), self.busy))
        transport.close()
