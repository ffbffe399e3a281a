"""Slow clients: a deadline for a connection's request headers, and a bound on open connections.

aiohttp has neither (its ``keepalive_timeout`` covers only idle time between requests,
and a handler runs only once the headers are in), so a client sending headers a byte at a
time held a connection as long as it liked, and a hundred such connections never counted
against ``--max-concurrency``. The guard wraps aiohttp's protocol factory: a connection
past ``max_connections`` is answered 503 and closed, and one whose first request has not
reached a handler within ``header_timeout`` is closed. At the bound, the connection that has
waited longest for its first request's headers is closed to make room, if it has had its
chance: open EVICTABLE_AFTER_S or more, with nothing unread in its socket (an outside attack
held the admin endpoint's 64 places with half-sent headers, renewed every 8 s, and every
health probe was told 503; a burst of callers is accepted in one loop turn before any is read,
and cutting the oldest of those cut complete requests without a reply). Failing that, the
keep-alive connection idle longest between its requests is closed, as nginx closes idle
keep-alive connections when it runs out of them (callers keeping every place alive kept every
new caller at 503): idle EVICTABLE_AFTER_S or more, its response sent (a body its handler left
unread may still be coming: aiohttp reads and drops it, and nothing is owed). Neither kind is
cut with a whole request read and not yet handed to its handler (aiohttp reads a request a
loop turn or more before its handler runs: a test of the socket alone cut complete requests
without a reply); a request only partly sent is nothing owed. Otherwise the new connection is
refused. And a connection whose client has not taken one byte of its responses (writes paused)
for ``header_timeout`` is closed: nothing else would ever free its place.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import struct
import termios
import time

from aiohttp import web

from ..log import sampled_event


EVICTABLE_AFTER_S = 0.05  # a younger connection may not have been read yet (its request may be in flight)


class Guard:
    """The protocol factory for ``loop.create_server``, plus the middleware that marks requests handled."""

    def __init__(self, max_connections: int, header_timeout: float, who: str = "worker"):
        self.server: web.Server | None = None  # the runner's, once it is set up
        self.busy = json.dumps({"error": {"message": f"{who} busy: too many open connections", "code": 503}}).encode()
        self.max_connections, self.header_timeout, self.who = max_connections, header_timeout, who
        # connections whose first request has not reached a handler -> when accepted, oldest first
        self.waiting: dict = {}
        # connections between requests (a handler has returned) -> since when, longest idle first
        self.idle: dict = {}
        self.watched: dict = {}  # every open connection -> its _Watched

    def __call__(self) -> asyncio.Protocol:
        if self._num_open() >= self.max_connections:
            now = time.monotonic()
            action = ("cut_oldest_without_headers" if self._cut_oldest(self.waiting, now)
                      else "cut_longest_idle" if self._cut_oldest(self.idle, now) else "refused")
            sampled_event(f"{self.who}_connections_full", logging.WARNING, limit=self.max_connections, action=action)
            if action == "refused":  # none waiting or idle has had its chance
                return _Refuse(self.busy)
        proto = self.server()
        self.waiting[proto] = time.monotonic()
        asyncio.get_running_loop().call_later(self.header_timeout, self._expire, proto)
        self.watched[proto] = watched = _Watched(proto, self)
        return watched

    def _num_open(self) -> int:
        """aiohttp keeps a closed connection in ``connections`` until its task has ended, a few
        loop turns after the peer saw the close: a client that reconnected at once was told 503."""
        return sum(1 for proto in self.server.connections if proto.connected)

    def _cut_oldest(self, since: dict, now: float) -> bool:
        """Close the oldest connection in ``since`` (proto -> when it began to wait, oldest first)
        that has had its chance: waiting EVICTABLE_AFTER_S or more, no request read whole and
        not yet handled, its writes sent, nothing unread. False if none has (a closed one frees
        no place: dropped; a place cut is the new connection's, though it counts as open a few
        loop turns more)."""
        for proto, at in list(since.items()):
            if now - at < EVICTABLE_AFTER_S:
                return False  # and the rest are younger still
            if not proto.connected:  # its client closed it
                del since[proto]
            elif not self.watched[proto].request_on_its_way() and not _unread(proto) and _sent(proto):
                del since[proto]
                self.watched[proto].cut()
                return True
        return False

    def _expire(self, proto) -> None:
        if self.waiting.pop(proto, None) is not None:
            proto.force_close()

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        proto = request.protocol
        self.waiting.pop(proto, None)
        self.idle.pop(proto, None)
        if (watched := self.watched.get(proto)) is not None:
            watched.started, watched.body = watched.started + 1, None
        try:
            return await handler(request)
        finally:  # its response goes out now; then, kept alive, it waits for its next request
            if watched is not None and watched.inner.connected:  # or aiohttp reads and drops a body the
                watched.body = None if request.content.is_eof() else request.content  # handler left
                self.idle[proto] = time.monotonic()


class _Watched(asyncio.Protocol):
    """aiohttp's protocol for one connection, as the transport sees it: the same calls, plus
    a deadline while the client leaves its responses unread (``pause_writing`` until
    ``resume_writing``)."""

    def __init__(self, inner, guard: Guard):
        self.inner, self.guard = inner, guard
        self.started = 0  # requests handed to a handler (the middleware counts them)
        self.body = None  # the last request's body while aiohttp reads and drops what its handler left
        self._stalled: asyncio.TimerHandle | None = None

    def request_on_its_way(self) -> bool:
        """Whether a request has been read whole but not yet handed to its handler: aiohttp
        parses it, then starts its handler a loop turn or more later (a cut in between lost it
        without a reply). aiohttp counts the requests it has parsed (``_request_count``, not
        public: tests/unit/test_guard.py checks it is there); where it is not, every connection
        counts as having one (never cut: safe, only less room for newcomers)."""
        return getattr(self.inner, "_request_count", float("inf")) > self.started

    def cut(self) -> None:
        """Close it for a newcomer. A body aiohttp is reading and dropping is ended first: its
        read, woken by bytes, would find the connection closed and aiohttp would log an error
        with a traceback (98 in 6 s in an outside attack)."""
        if self.body is not None and not self.body.is_eof():
            self.body.feed_eof()
        self.inner.force_close()

    def connection_made(self, transport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self._watch_unsent(_unsent(self.inner))
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        self.inner.resume_writing()

    def _watch_unsent(self, unsent: int) -> None:
        self._stalled = asyncio.get_running_loop().call_later(self.guard.header_timeout, self._stalled_yet, unsent)

    def _stalled_yet(self, unsent_before: int) -> None:
        """Writes paused a deadline long: closed if not one byte went to the client meanwhile (a
        client reading, however slowly, acknowledges bytes: it keeps its connection)."""
        unsent = _unsent(self.inner)
        if unsent != unsent_before:
            self._watch_unsent(unsent)
            return
        sampled_event(f"{self.guard.who}_reader_stalled", logging.WARNING, seconds=self.guard.header_timeout)
        transport = self.inner.transport
        self.inner.force_close()
        if transport is not None:
            transport.abort()  # its unsent bytes dropped (a close would wait to send them, for good)

    def connection_lost(self, exc) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
        g = self.guard
        g.watched.pop(self.inner, None)
        g.idle.pop(self.inner, None)
        g.waiting.pop(self.inner, None)
        self.inner.connection_lost(exc)


class _Refuse(asyncio.Protocol):
    """A connection over the bound: one JSON 503, then closed once what the caller sent is read
    (closed with its request unread, the kernel resets the connection and the 503 may be lost),
    or after REFUSED_LINGER_S at most: a flood of refused connections holds few descriptors."""

    REFUSED_LINGER_S = 0.1

    def __init__(self, busy: bytes):
        self.busy = busy

    def connection_made(self, transport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(self.busy), self.busy))
        if transport.can_write_eof():
            transport.write_eof()  # the caller reads the 503 to its end
        asyncio.get_running_loop().call_later(self.REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # read and dropped, so the close is a clean one

    def eof_received(self) -> bool:
        return False  # the caller is done: close now


def _sent(proto) -> bool:
    """Whether everything written to the connection has gone to its socket (a response still
    going out is not cut)."""
    transport = proto.transport
    return transport is not None and transport.get_write_buffer_size() == 0


def _unsent(proto) -> int:
    """Bytes written to the connection that its client has not acknowledged yet: the
    transport's buffer and the socket's send queue."""
    transport = proto.transport
    return 0 if transport is None else transport.get_write_buffer_size() + _socket_count(proto, termios.TIOCOUTQ)


def _unread(proto) -> bool:
    """Whether bytes wait in the connection's socket that the loop has not read yet."""
    return _socket_count(proto, termios.FIONREAD) > 0


def _socket_count(proto, request: int) -> int:
    """A byte count the kernel keeps for the connection's socket (FIONREAD, TIOCOUTQ); 0 when
    the socket is gone."""
    try:
        fd = proto.transport.get_extra_info("socket").fileno()
        return struct.unpack("i", fcntl.ioctl(fd, request, b"\0\0\0\0"))[0]
    except (AttributeError, OSError, ValueError):  # no transport or socket any more
        return 0
