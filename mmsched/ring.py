"""A same-host shared-memory ring: the leader's batches to the followers that see its /dev/shm.

Why: a gloo broadcast hands the bytes to a worker thread and a TCP loop thread (0.14 ms
idle, milliseconds under load); a follower on the leader's host can read them from shared
memory instead. vLLM's ``MessageQueue`` does the same, but its readers spin on
``sched_yield``; on 2 cores that burns the core the leader needs, so here every wait is a
futex on a word of the ring (about 12 µs to wake), in ticks of ``TICK_S`` that check the
deadline and whether the other side is still alive. A wait that runs out raises
``GroupBroken``, the broken-group path every collective ends in.

Layout: one header line (64 bytes) per word, then ``SLOTS`` slots of ``SLOT_BYTES``:

- line 0: ``published``, the chunks the leader has written (a u32 that wraps), then
  ``leader_waits``, set while the leader waits for a slot (readers wake it only then; a
  wake lost to the race between the two is made up by the next tick);
- line 1 + r: ``consumed`` by reader r (its own line: readers never share one), then
  the engine steps reader r has finished (``report_step``; the leader answers a step only
  once each reader has finished it: ``wait_steps``);
- slot: u32 message length, u32 chunk length, the chunk's bytes.

A message longer than a slot's payload spans consecutive slots (the overflow path): the
leader waits for each slot to be read before it reuses it, the readers reassemble. The
ordering relies on x86's stores (payload, then ``published``) being seen in order.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import struct
import time
from typing import Callable, TypeVar

from .errors import GroupBroken
from .segments import shm_path

SLOTS = 8
SLOT_BYTES = 1 << 20              # a batch with a 1 MiB inline feature fits in two; 64 KiB slots cost
# tp=2 a hand-off (a futex wake and a wait) per 64 KiB: 1 MiB inline features 16-62% slower
PAYLOAD = SLOT_BYTES - 8
TICK_S = 0.05                    # how often a wait looks at its deadline and the other side
MASK = 0xFFFFFFFF
_LINE = 64
T = TypeVar("T")
_PUBLISHED, _LEADER_WAITS = 0, 1  # header words (u32 indices) of line 0


def _consumed(r: int) -> int:
    """Reader r's ``consumed`` word (the first of its line); its finished steps are the next."""
    return (1 + r) * _LINE // 4

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine(), 202)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not _PRIVATE): the waiters are other processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall = _libc.syscall
_NR, _WAIT, _WAKE, _ALL, _ZERO = (ctypes.c_long(_SYS_FUTEX), ctypes.c_int(_FUTEX_WAIT), ctypes.c_int(_FUTEX_WAKE),
                                  ctypes.c_int(0x7FFFFFFF), ctypes.c_int(0))


def _futex_wait(addr: ctypes.c_void_p, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 at ``addr`` is ``expected``, at most ``timeout_s`` (returns early on a wake)."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _syscall(_NR, addr, _WAIT, ctypes.c_uint32(expected), ctypes.byref(ts), None, _ZERO)


def _futex_wake(addr: ctypes.c_void_p) -> None:
    _syscall(_NR, addr, _WAKE, _ALL, None, None, _ZERO)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True  # not in our pid namespace: only the deadline can tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


LATE, GONE = "late", "gone"  # why ``sleep_until`` gave up


def sleep_until(word: Callable[[], int], addr: ctypes.c_void_p, done: Callable[[int], bool], timeout_s: float,
                alive: Callable[[], bool]) -> str | None:
    """Sleep on the shared u32 at ``addr`` (read by ``word``) until ``done(value)``: None, or
    why not, LATE past ``timeout_s`` or GONE once ``alive()`` says the other side died. Each
    sleep is a futex tick of at most ``TICK_S``, so the deadline and the peer are looked at
    even when no wake comes."""
    seen = word()
    if done(seen):
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return LATE
        # sleep only while the word still holds the value just judged: a change between
        # the check and the call makes the kernel return at once (no lost wake-up)
        _futex_wait(addr, seen, min(TICK_S, left))
        seen = word()
        if done(seen):
            return None
        if not alive():
            return GONE


def reserve(name: str, size: int, use: Callable[[int], T]) -> T:
    """Create /dev/shm segment ``name`` of ``size`` bytes, shared-locked (the sweep leaves it
    alone) and its pages reserved now: a full /dev/shm fails here (ENOSPC), not a write into a
    hole later (SIGBUS). Returns ``use(fd)``; on any failure nothing is left."""
    fd = os.open(shm_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        return use(fd)
    except BaseException:
        os.close(fd)
        os.unlink(shm_path(name))
        raise


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def visible(peer: tuple, me: tuple) -> int | None:
    """A peer's (pid, pid namespace, ...): its pid, where this rank can see it (the same
    namespace); else None (only the deadline can tell)."""
    return peer[0] if peer[1] and peer[1] == me[1] else None


def segment_bytes(readers: int) -> int:
    return _LINE * (1 + readers) + SLOTS * SLOT_BYTES


class Ring:
    """One end of the ring: the leader's (``create``) or reader ``index``'s (``attach``)."""

    def __init__(self, name: str, fd: int, readers: int, index: int | None, timeout_s: float):
        self.name, self.readers, self.index, self.timeout_s = name, readers, index, timeout_s
        self._fd = fd
        self._mm = mmap.mmap(fd, segment_bytes(readers))
        anchor = ctypes.c_char.from_buffer(self._mm)
        self._base = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping lives; no export is kept
        self._slots = _LINE * (1 + readers)
        self._words = memoryview(self._mm)[: self._slots].cast("I")
        waited = [_PUBLISHED, *(_consumed(r) + k for r in range(readers) for k in (0, 1))]
        self._addr = {at: ctypes.c_void_p(self._base + 4 * at) for at in waited}  # the words futexes wait on
        self._count = 0          # chunks written (leader) or read (reader) so far, unwrapped
        self.peers: list[int | None] = []  # the pids waited on: readers (leader), the leader (reader)

    @classmethod
    def create(cls, name: str, readers: int, timeout_s: float) -> "Ring":
        """The leader's end; it holds a shared flock until ``unlink``, so the sweep leaves it alone."""
        return reserve(name, segment_bytes(readers), lambda fd: cls(name, fd, readers, None, timeout_s))

    @classmethod
    def attach(cls, name: str, readers: int, index: int, timeout_s: float) -> "Ring":
        fd = os.open(shm_path(name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size != segment_bytes(readers):
                raise GroupBroken(f"ring {name}: unexpected size {os.fstat(fd).st_size}")
            return cls(name, fd, readers, index, timeout_s)
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """The name goes once every reader has mapped it: nothing is left in /dev/shm, even after kill -9."""
        try:
            os.unlink(shm_path(self.name))
        except FileNotFoundError:
            pass
        if self._fd >= 0 and self.index is None:
            os.close(self._fd)  # drops the flock too
        self._fd = -1

    def close(self) -> None:
        if self.index is None:
            self.unlink()
        self._words.release()
        self._mm.close()

    # ------------------------------------------------------------ waiting

    def _wait(self, at: int, until, who: str) -> None:
        """Sleep on header word ``at`` until ``until(value)``; GroupBroken past the deadline or if a peer died."""
        words = self._words
        if until(words[at]):  # the usual case, at no more cost than the check
            return
        why = sleep_until(lambda: words[at], self._addr[at], until, self.timeout_s,
                          lambda: all(_alive(p) for p in self.peers))
        if why is not None:
            raise GroupBroken(f"ring: {who} did not move within {self.timeout_s:g} s" if why == LATE
                              else f"ring: {who} is gone")

    # ------------------------------------------------------------ leader

    def has_room(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` fits in the slots every reader has read: ``write``
        would not wait (only this writer fills slots; readers only free them)."""
        behind = max((self._count - self._words[_consumed(r)]) & MASK for r in range(self.readers))
        return SLOTS - behind >= max(1, -(-nbytes // PAYLOAD))

    def write(self, msg) -> None:
        """Publish one message (bytes-like); blocks only while a reader is ``SLOTS`` chunks behind."""
        view = memoryview(msg).cast("B")
        n, off = len(view), 0
        while True:
            c = self._count
            for r in range(self.readers):
                if (c - self._words[_consumed(r)]) & MASK >= SLOTS:
                    self._words[_LEADER_WAITS] = 1  # readers wake us only while this is set
                    try:
                        self._wait(_consumed(r), lambda v: (c - v) & MASK < SLOTS, f"ring reader {r}")
                    finally:
                        self._words[_LEADER_WAITS] = 0
            at = self._slots + (c % SLOTS) * SLOT_BYTES
            k = min(n - off, PAYLOAD)
            struct.pack_into("<II", self._mm, at, n, k)
            self._mm[at + 8: at + 8 + k] = view[off: off + k]
            self._count = c + 1
            self._words[_PUBLISHED] = self._count & MASK
            _futex_wake(self._addr[_PUBLISHED])
            off += k
            if off >= n:
                return

    def wait_steps(self, steps: int, names: list[str] | None = None) -> None:
        """Wait until every reader has finished engine step ``steps`` (``names``: the readers
        as an error should name them, their ranks)."""
        for r in range(self.readers):
            who = names[r] if names else f"ring reader {r}"
            self._wait(_consumed(r) + 1, lambda v: v == steps & MASK, f"{who} (engine step {steps})")

    # ------------------------------------------------------------ reader

    def report_step(self, steps: int) -> None:
        """Engine step ``steps`` is over here (the leader may be waiting for it)."""
        at = _consumed(self.index) + 1
        self._words[at] = steps & MASK
        _futex_wake(self._addr[at])

    def read(self) -> bytes:
        """The next message, copied out of the ring (its slots are free again on return)."""
        parts, got, at_me = [], 0, _consumed(self.index)
        while True:
            c = self._count
            self._wait(_PUBLISHED, lambda v: v != c & MASK, "the leader")
            at = self._slots + (c % SLOTS) * SLOT_BYTES
            n, k = struct.unpack_from("<II", self._mm, at)
            parts.append(self._mm[at + 8: at + 8 + k])
            got += k
            self._count = c + 1
            self._words[at_me] = self._count & MASK
            if self._words[_LEADER_WAITS]:  # the leader waits for a slot (rarely: the ring was full)
                _futex_wake(self._addr[at_me])
            if got >= n:
                return parts[0] if len(parts) == 1 else b"".join(parts)
