"""The bound on client connections: each costs the leader a descriptor, and a listener out
of descriptors makes libzmq spin a core on an accept it cannot make, while the leader's
own reads fail with EMFILE. A socket monitor reports each connection accepted and gone;
one past ``at_most`` is shut down as it is accepted (its client's ZeroMQ reconnects,
100 ms later by default, and gets in once there is room).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..log import event

ACCEPTED, DISCONNECTED, LISTENING = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED), int(zmq.EVENT_LISTENING)
NOBLOCK, POLLIN, EVENTS = int(zmq.NOBLOCK), int(zmq.POLLIN), int(zmq.EVENTS)
_ids = itertools.count()


class ConnectionBound:
    """Counts the frontend's connections (by descriptor) and shuts down those past ``at_most``.

    Set up before the bind (the listener's own address comes in its LISTENING event). The
    monitor's queue is unbounded: libzmq blocks the socket's I/O thread on a full monitor
    (measured: with 2,000 events unread the ROUTER delivered nothing more)."""

    LOG_EVERY_S = 10.0  # refusals are logged at most this often (a client retries every 100 ms)

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, at_most: int):
        self.at_most = at_most
        self.open: set[int] = set()  # descriptors of the connections accepted and not gone
        self.refused = 0
        self._listener: tuple | None = None  # (family, port or path) of the bound socket
        self._unlogged, self._logged_at = 0, -self.LOG_EVERY_S
        address = f"inproc://mmsched-connections-{next(_ids)}"
        sock.monitor(address, ACCEPTED | DISCONNECTED | LISTENING)
        pair = ctx.socket(zmq.PAIR)
        pair.setsockopt(zmq.RCVHWM, 0)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(address)
        self._sock, self._pair = sock, zmq.Socket.shadow(pair.underlying)
        self._pair_owner = pair

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self._pair.getsockopt(zmq.FD), self.drain)
        self.drain()  # what came before (the edge-triggered FD may not fire for it)

    def stop(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self._pair.getsockopt(zmq.FD))

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._pair_owner.close(linger=0)

    def drain(self) -> None:
        """Read every event waiting. An accepted descriptor already reported gone in the same
        read is skipped: libzmq may have given its number to another file since."""
        events = []
        while self._pair.get(EVENTS) & POLLIN:
            events.append(parse_monitor_message(self._pair.recv_multipart(NOBLOCK)))
        gone_at = {ev["value"]: i for i, ev in enumerate(events) if int(ev["event"]) == DISCONNECTED}
        for i, ev in enumerate(events):
            kind, fd = int(ev["event"]), ev["value"]
            if kind == LISTENING:
                self._listener = _local_name(fd)
            elif kind == DISCONNECTED:
                self.open.discard(fd)
            elif kind == ACCEPTED and gone_at.get(fd, -1) < i:
                self._accepted(fd)

    def _accepted(self, fd: int) -> None:
        if len(self.open) < self.at_most:
            self.open.add(fd)
            return
        if self._listener is not None and _local_name(fd) == self._listener:  # still a frontend connection
            _shut_down(fd)
            self.refused += 1
            self._unlogged += 1
            now = time.monotonic()
            if now - self._logged_at >= self.LOG_EVERY_S:
                event("connections_refused", logging.WARNING, refused=self._unlogged, open=len(self.open),
                      at_most=self.at_most, why="RLIMIT_NOFILE leaves room for at most at_most connections")
                self._unlogged, self._logged_at = 0, now


def _local_name(fd: int) -> tuple | None:
    """(family, port) of a TCP socket, (family, path) of a Unix one; None if ``fd`` is no socket."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        name = s.getsockname()
        return (s.family, name[1] if s.family in (socket.AF_INET, socket.AF_INET6) else name)
    except OSError:
        return None
    finally:
        s.detach()  # the descriptor stays libzmq's


def _shut_down(fd: int) -> None:
    """End the connection (libzmq sees it close, closes its descriptor and reports it gone)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return  # closed meanwhile
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already gone
    finally:
        s.detach()
