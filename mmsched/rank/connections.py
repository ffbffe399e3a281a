"""The bound on client connections. Each costs the leader a descriptor, and a listener out
of descriptors is fatal: libzmq aborts the process on an ipc:// accept that fails with
EMFILE (and spins a core on a tcp:// one), while the leader's own reads fail too.

A thread reads a socket monitor (each connection accepted and gone, by descriptor), so
the count keeps up however busy the loop is. At ``at_most`` it shuts the door (libzmq's
I/O thread stops accepting: ``_AcceptPause``) and shuts down any connection accepted past
it; at 90% it opens the door again. A client kept out retries on its own (ZeroMQ
reconnects) and gets in then. Nothing at the socket's address changes meanwhile.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import platform
import resource
import socket
import struct
import threading
import time

import zmq

from ..log import event

ACCEPTED, DISCONNECTED, LISTENING = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED), int(zmq.EVENT_LISTENING)
NOBLOCK = int(zmq.NOBLOCK)
_ids = itertools.count()


class ConnectionBound:
    """Counts the frontend's connections and keeps them to ``at_most``.

    Made before the bind (the listener comes in the monitor's LISTENING event), started
    after it. The monitor's queue is unbounded: libzmq blocks the socket's I/O thread on a
    full one (measured: with 2,000 events unread the ROUTER delivered nothing more)."""

    LOG_EVERY_S = 10.0  # each event is logged at most this often (a client retries every 100 ms)
    POLL_S = 0.1
    CHUNK = 4096  # events applied at once
    FD_MARGIN = 512  # descriptors short of the limit at which the door shuts whatever the count
    SEEK_DOOR_S = 5.0  # how long to look for the listener in libzmq's epoll set after LISTENING

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, at_most: int):
        self.at_most, self.reopen_at = at_most, at_most - max(1, at_most // 10)
        self.open: set[int] = set()  # descriptors of the connections accepted and not gone
        self.refused = 0
        self.fd_limit, self.low = resource.getrlimit(resource.RLIMIT_NOFILE)[0], False
        self.door: _Door = _Door()
        self._listener = None  # (family, port or path) of the bound socket
        self._seeking: tuple[int, float] | None = None  # (listener descriptor, look until) while no door yet
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
        """Before the socket closes: stop the thread; the door stays as it is (opened now, it
        would let in a crowd the thread no longer bounds)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5 * self.POLL_S + 1.0)
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._log.flush()
        self._pair.close(linger=0)

    def _run(self) -> None:
        checked, every = 0.0, self.POLL_S
        while not self._stop.is_set():
            if self._pair.poll(5 if self._seeking else int(self.POLL_S * 1000)):
                self._drain()
            self._seek_door()
            if time.monotonic() - checked >= every:
                checked = time.monotonic()
                every = self._check_descriptors()
            self._swing()

    def _drain(self) -> None:
        """Apply up to CHUNK events waiting (a stream of them must not keep the door from being
        seen to). An accepted descriptor reported gone in the same read is skipped: libzmq may
        have given its number to another file since."""
        events = []
        for _ in range(self.CHUNK):
            try:
                head = self._pair.recv(NOBLOCK)
                self._pair.recv(NOBLOCK)  # the endpoint
            except zmq.Again:
                break
            events.append(struct.unpack_from("=HI", head))  # event, value (the descriptor)
        gone_at = {fd: i for i, (kind, fd) in enumerate(events) if kind == DISCONNECTED}
        for i, (kind, fd) in enumerate(events):
            if kind == LISTENING:
                self._listener, self._seeking = _local_name(fd), (fd, time.monotonic() + self.SEEK_DOOR_S)
            elif kind == DISCONNECTED:
                self.open.discard(fd)
            elif kind == ACCEPTED and gone_at.get(fd, -1) < i:
                self._accepted(fd)

    def _seek_door(self) -> None:
        """Find the listener's entry in libzmq's epoll set. The monitor says LISTENING from the
        bind, before the I/O thread has added the listener to that set (seen here as a door that
        never shut, on a loaded host), so it is looked for again until it is there."""
        if self._seeking is None:
            return
        fd, until = self._seeking
        door = _door_for(fd)
        if door is None and time.monotonic() < until:
            return
        self._seeking = None
        if door is None:
            event("connections_door_failed", logging.WARNING, error="the listener is in no epoll set of this "
                                                                   f"process after {self.SEEK_DOOR_S:g}s")
        self.door = door or _Door()

    def _check_descriptors(self) -> float:
        """The truth behind the count: the process's open descriptors (admin HTTP connections,
        a count behind its events). Within FD_MARGIN of the limit the door shuts as well.
        Returns when to look again: soon near the limit, else in a second (reading 17,000
        entries of /proc/self/fd takes ~15 ms)."""
        try:
            n = len(os.listdir("/proc/self/fd"))
        except OSError:
            return self.POLL_S
        self.low = n >= self.fd_limit - self.FD_MARGIN
        if self.low:
            self._log.note("descriptors_low", logging.WARNING, open_descriptors=n, limit=self.fd_limit)
        return self.POLL_S if self.fd_limit - n < 4 * self.FD_MARGIN else 1.0

    def _swing(self) -> None:
        full = len(self.open) >= self.at_most or self.low
        if full and not self.door.shut:
            self.door.close()
            self._log.note("connections_full", logging.WARNING, open=len(self.open), at_most=self.at_most)
        elif self.door.shut and len(self.open) <= self.reopen_at and not self.low:
            self.door.open()
            self._log.note("connections_open", logging.INFO, open=len(self.open), at_most=self.at_most)

    def _accepted(self, fd: int) -> None:
        if len(self.open) < self.at_most:
            self.open.add(fd)
        elif self._listener is not None and _shut_down_if(fd, self._listener):
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
    """Where new connections come in. This one shuts nothing: the listener was not found in
    libzmq's epoll set (``connections_door_failed`` said why); the shutdowns still bound."""

    shut = False

    def close(self) -> None:
        pass

    def open(self) -> None:
        pass


class _AcceptPause(_Door):
    """libzmq's I/O thread accepts whenever its epoll set reports the listener readable, and
    has no bound of its own. While shut, the listener's entry in that set asks for no events
    (``epoll_ctl`` is safe from any thread; the entry is found in /proc/self/fdinfo, matched
    by descriptor and inode): the connections already open go on, new ones wait in the
    kernel's backlog (ZMQ_BACKLOG, 100), then fail with EAGAIN (ipc://) or unanswered SYNs
    (tcp://), and their clients retry. Opened, the entry is as libzmq made it."""

    def __init__(self, epfd: int, fd: int, events: int, data: int):
        self.epfd, self.fd, self.events, self.data = epfd, fd, events, data

    def close(self) -> None:
        self.shut = self._modify(0)

    def open(self) -> None:
        if self.shut:
            self.shut = not self._modify(self.events)

    def _modify(self, events: int) -> bool:
        entry = _EpollEvent(events, self.data)
        if _libc.epoll_ctl(self.epfd, 3, self.fd, ctypes.byref(entry)) == 0:  # EPOLL_CTL_MOD
            return True
        event("connections_door_failed", logging.WARNING, error=os.strerror(ctypes.get_errno()))
        return False


class _EpollEvent(ctypes.Structure):
    _pack_ = 1 if platform.machine() == "x86_64" else 0  # the kernel's struct epoll_event is packed there
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def _door_for(listener_fd: int) -> _Door | None:
    """The listener's entry in libzmq's epoll set, as a door; None if it is in none (yet); a
    door that shuts nothing if the listener is gone."""
    try:
        inode = os.fstat(listener_fd).st_ino
    except OSError as exc:
        event("connections_door_failed", logging.WARNING, error=str(exc))
        return _Door()
    for name in os.listdir("/proc/self/fdinfo"):
        try:
            with open(f"/proc/self/fdinfo/{name}") as fh:
                lines = fh.read().splitlines()
        except OSError:
            continue
        for line in lines:  # "tfd: 12 events: 19 data: 7ff860000b70 pos:0 ino:12e59c4 sdev:9"
            f = line.split()
            if f[:1] == ["tfd:"] and int(f[1]) == listener_fd and f"ino:{inode:x}" in f:
                return _AcceptPause(int(name), listener_fd, int(f[3], 16), int(f[5], 16))
    return None


def _local_name(fd: int) -> tuple | None:
    """(family, port) of a TCP socket, (family, path) of a Unix one; None if ``fd`` is no socket."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return _name_of(s)
    finally:
        s.detach()  # the descriptor stays libzmq's


def _shut_down_if(fd: int, listener: tuple) -> bool:
    """End the connection on ``fd`` if it is still one of ``listener``'s (libzmq sees it close,
    closes its descriptor and reports it gone); whether it was."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return False  # closed meanwhile
    try:
        if _name_of(s) != listener:
            return False
        s.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False  # already gone
    finally:
        s.detach()


def _name_of(s: socket.socket) -> tuple:
    name = s.getsockname()
    return (s.family, name[1] if s.family in (socket.AF_INET, socket.AF_INET6) else name)
