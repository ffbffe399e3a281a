"""The client's DEALER on asyncio without zmq.asyncio: a send never waits, one reader reads.

Why not zmq.asyncio: it wraps each send in a future and each wait in a poller. Its send and
poll were ~20% of the load generator's samples, and the load generator shares the host (2
cores here) with the server it measures. Here a send is one NOBLOCK call. A message ZeroMQ
cannot take now (no peer yet, or its send queue full) waits, in order, in ``unsent`` until
the socket is writable. The socket's descriptor is edge-triggered and a send can use up its
edge, so after every send the reader looks at ZMQ_EVENTS again (as the server's Frontend does).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Callable, Sequence

import zmq

# plain ints: pyzmq's flag enums cost microseconds per call on the request path
NOBLOCK, SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
POLLIN, POLLOUT, EVENTS = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.EVENTS)
PER_READ = 256  # messages handled before the reader lets the loop run (a flood must not starve it)

Handler = Callable[[list, float], None]  # (a message's frames, time.perf_counter() when read)


class ClientSocket:
    """``send`` from any coroutine or callback of the loop; ``receive`` runs as one task."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        # (frames, the ``track`` future or None, what to do if it is never sent or None)
        self._unsent: deque[tuple[Sequence[Any], asyncio.Future | None, Callable[[], None] | None]] = deque()
        self._check = asyncio.Event()  # set: the reader must look at ZMQ_EVENTS again

    def send(self, frames: Sequence[Any], track: bool = False,
             never_sent: Callable[[], None] | None = None) -> asyncio.Future | None:
        """Send ``frames`` as one message now, or after what waits; ``track``: a future done
        once ZeroMQ has taken it (cancel it, as a deadline around ``await`` does, and a message
        still waiting here is never sent); ``never_sent``: called if ``close`` comes first."""
        if not self._unsent:
            try:
                _send_now(self.sock, frames)
            except zmq.Again:
                pass
            else:
                self._check.set()
                return _done() if track else None
        sent = asyncio.get_running_loop().create_future() if track else None
        self._unsent.append((frames, sent, never_sent))
        self._check.set()
        return sent

    def close(self) -> None:
        """Nothing waiting will be sent: wake whoever tracks it (cancelled), and say so."""
        unsent, self._unsent = self._unsent, deque()
        for _, sent, never_sent in unsent:
            if sent is not None and not sent.done():
                sent.cancel()
            if never_sent is not None:
                never_sent()

    async def receive(self, handle: Handler) -> None:
        """Until cancelled: send what waits once the socket takes it, and ``handle`` each
        message that arrives, stamped with the time it was read off the socket."""
        loop = asyncio.get_running_loop()
        fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._check.set)
        try:
            while True:
                events = self.sock.getsockopt(EVENTS)
                if self._unsent and events & POLLOUT and self._flush():
                    continue  # (the sends may have used up the descriptor's edge: look again)
                if not events & POLLIN:
                    self._check.clear()
                    await self._check.wait()
                    continue
                messages = _drain(self.sock, PER_READ)
                now = time.perf_counter()
                for frames in messages:
                    handle(frames, now)
                if len(messages) == PER_READ:
                    await asyncio.sleep(0)
        finally:
            loop.remove_reader(fd)

    def _flush(self) -> bool:
        """Send what waits, in order, while ZeroMQ takes it; whether anything went."""
        went = False
        while self._unsent:
            frames, sent, _ = self._unsent[0]
            if sent is not None and sent.cancelled():  # its sender gave up on it: never sent
                self._unsent.popleft()
                continue
            try:
                _send_now(self.sock, frames)
            except zmq.Again:
                break
            self._unsent.popleft()
            went = True
            if sent is not None and not sent.done():
                sent.set_result(None)
        return went


def _send_now(sock: zmq.Socket, frames: Sequence[Any]) -> None:
    """One message, or zmq.Again with nothing sent: ZeroMQ takes a message's later parts
    once it has taken its first."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, SNDMORE_NOBLOCK if i < last else NOBLOCK, copy=False)


def _drain(sock: zmq.Socket, limit: int) -> list[list]:
    """Up to ``limit`` waiting messages, without blocking (until EAGAIN re-arms the socket's edge)."""
    out = []
    for _ in range(limit):
        try:
            out.append(sock.recv_multipart(NOBLOCK))
        except zmq.Again:
            break
    return out


def _done() -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut
