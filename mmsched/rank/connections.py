"""The bound on client connections. Each costs the leader a descriptor, and a listener out
of descriptors is fatal: libzmq aborts the process on an ipc:// accept that fails with
EMFILE (and spins a core on a tcp:// one), while the leader's own reads fail too.

A thread reads a socket monitor (each connection accepted and gone, by descriptor), so
the count keeps up however busy the loop is. At ``at_most`` it shuts the door (an ipc://
socket file is unlinked, kept by a hidden hard link; a tcp:// listener drops new SYNs
through a socket filter) and shuts down any connection accepted past it; at 90% it opens
the door again. A client kept out retries on its own (ZeroMQ reconnects) and gets in then.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import socket
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..log import event

ACCEPTED, DISCONNECTED, LISTENING = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED), int(zmq.EVENT_LISTENING)
_ids = itertools.count()


class ConnectionBound:
    """Counts the frontend's connections and keeps them to ``at_most``.

    Made before the bind (the listener comes in the monitor's LISTENING event), started
    after it. The monitor's queue is unbounded: libzmq blocks the socket's I/O thread on a
    full one (measured: with 2,000 events unread the ROUTER delivered nothing more)."""

    LOG_EVERY_S = 10.0  # each event is logged at most this often (a client retries every 100 ms)
    POLL_S = 0.1

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, at_most: int, address: str):
        self.at_most, self.reopen_at = at_most, at_most - max(1, at_most // 10)
        self.open: set[int] = set()  # descriptors of the connections accepted and not gone
        self.refused = 0
        self.door: _Door = _Door()
        self._address, self._listener = address, None  # (family, port or path) of the bound socket
        self._log = _Quiet(self.LOG_EVERY_S)
        inproc = f"inproc://mmsched-connections-{next(_ids)}"
        sock.monitor(inproc, ACCEPTED | DISCONNECTED | LISTENING)
        self._pair = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)  # a sync socket, the thread's
        self._pair.setsockopt(zmq.RCVHWM, 0)
        self._pair.connect(inproc)
        self._sock, self._stop = sock, threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmsched-connections", daemon=True)

    @property
    def paused(self) -> bool:
        return self.door.shut

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Before the socket closes: stop the thread; the door stays shut (opened now, it would
        let in a crowd the thread no longer bounds), its hidden link removed."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5 * self.POLL_S + 1.0)
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.door.discard()
        self._log.flush()
        self._pair.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._pair.poll(int(self.POLL_S * 1000)):
                self.drain()

    def drain(self) -> None:
        """Apply every event waiting. An accepted descriptor reported gone in the same read
        is skipped: libzmq may have given its number to another file since."""
        events = []
        while self._pair.poll(0):
            events.append(parse_monitor_message(self._pair.recv_multipart()))
        gone_at = {ev["value"]: i for i, ev in enumerate(events) if int(ev["event"]) == DISCONNECTED}
        for i, ev in enumerate(events):
            kind, fd = int(ev["event"]), ev["value"]
            if kind == LISTENING:
                self._listener, self.door = _local_name(fd), _door_for(self._address, fd)
            elif kind == DISCONNECTED:
                self.open.discard(fd)
            elif kind == ACCEPTED and gone_at.get(fd, -1) < i:
                self._accepted(fd)
        if len(self.open) >= self.at_most and not self.door.shut:
            self.door.close()
            self._log.note("connections_full", logging.WARNING, open=len(self.open), at_most=self.at_most)
        elif len(self.open) <= self.reopen_at and self.door.shut:
            self.door.open()
            self._log.note("connections_open", logging.INFO, open=len(self.open), at_most=self.at_most)

    def _accepted(self, fd: int) -> None:
        if len(self.open) < self.at_most:
            self.open.add(fd)
        elif self._listener is not None and _local_name(fd) == self._listener:  # still a frontend connection
            _shut_down(fd)
            self.refused += 1
            self._log.note("connections_refused", logging.WARNING, open=len(self.open), at_most=self.at_most)


class _Quiet:
    """Each event at most once per ``every_s``, saying how many ``times`` it happened since its
    last line: clients can make the door swing and connections be refused many times a second."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.times: dict[str, int] = {}
        self.logged_at: dict[str, float] = {}
        self.last: dict[str, tuple] = {}  # name: (level, fields) of its latest occurrence

    def note(self, name: str, level: int, **fields) -> None:
        self.times[name] = self.times.get(name, 0) + 1
        self.last[name] = (level, fields)
        now = time.monotonic()
        if now - self.logged_at.get(name, -self.every_s) >= self.every_s:
            self._emit(name)
            self.logged_at[name] = now

    def flush(self) -> None:
        for name in list(self.times):
            self._emit(name)

    def _emit(self, name: str) -> None:
        n = self.times.pop(name, 0)
        if n:
            level, fields = self.last[name]
            event(name, level, times=n, **fields)


class _Door:
    """Where new connections come in: nothing to shut (a Linux abstract ipc:// address)."""

    shut = False

    def close(self) -> None:
        pass

    def open(self) -> None:
        pass

    def discard(self) -> None:
        """The socket is closing: leave nothing behind."""


class _SocketFile(_Door):
    """An ipc:// socket file: unlinked while shut (connects fail with ENOENT), its inode kept by
    a hidden hard link and linked back (a connect finds the socket by its inode)."""

    def __init__(self, path: str):
        self.path, self.hidden = path, f"{path}.full-{os.getpid()}"

    def close(self) -> None:
        try:
            with contextlib.suppress(OSError):
                os.unlink(self.hidden)  # one left by a server killed while full
            os.link(self.path, self.hidden)
            os.unlink(self.path)
            self.shut = True
        except OSError as exc:
            event("connections_door_failed", logging.WARNING, path=self.path, error=str(exc))

    def open(self) -> None:
        if not self.shut:
            return
        self.shut = False
        try:
            os.link(self.hidden, self.path)  # fails if another file took the path meanwhile: /health says so
        except OSError as exc:
            event("connections_door_failed", logging.WARNING, path=self.path, error=str(exc))
        with contextlib.suppress(OSError):
            os.unlink(self.hidden)

    def discard(self) -> None:
        if self.shut:
            with contextlib.suppress(OSError):
                os.unlink(self.hidden)


class _SynFilter(_Door):
    """A tcp:// listener: a socket filter that drops every packet while shut, so new SYNs go
    unanswered (the client's TCP retries them) and nothing more is accepted."""

    SO_ATTACH_FILTER, SO_DETACH_FILTER = 26, 27

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        self.shut = self._setsockopt(self.SO_ATTACH_FILTER, bytes(_DROP_ALL))

    def open(self) -> None:
        if self.shut:
            self.shut = not self._setsockopt(self.SO_DETACH_FILTER, b"\0" * 4)

    def _setsockopt(self, opt: int, value: bytes) -> bool:
        try:
            s = socket.socket(fileno=self.fd)
        except OSError:
            return False
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, value)
            return True
        except OSError as exc:
            event("connections_door_failed", logging.WARNING, fd=self.fd, error=str(exc))
            return False
        finally:
            s.detach()


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Filter))]


_RET_ZERO = (_Filter * 1)(_Filter(0x06, 0, 0, 0))  # BPF_RET | BPF_K, 0: keep no byte of any packet
_DROP_ALL = _Program(1, _RET_ZERO)


def _door_for(address: str, listener_fd: int) -> _Door:
    if address.startswith("tcp://"):
        return _SynFilter(listener_fd)
    if address.startswith("ipc://") and not address.startswith("ipc://@"):
        return _SocketFile(address[len("ipc://"):])
    return _Door()


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
