"""POSIX shared-memory features on the ranks (the client's side is ``mmsched.producers``).

The consumer never maps a segment: it reads the bytes with ``preadv`` into an owned
tensor. A segment that shrinks or vanishes while being read gives a short read (an
error for that request) instead of a SIGBUS, no page tables are built for a segment
read once, and nothing is registered with Python's ``resource_tracker``.
While a request is in flight its ranks hold a shared ``flock`` on the segment, which
tells the orphan sweep the segment is alive.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
from collections import Counter
from typing import Callable

import torch

from ..errors import FeatureError, InjectedFault, describe
from ..faults import Faults
from ..log import event, sampled_event
from ..protocol import Item
from ..segments import SegmentTooSmall, shm_path
from .base import OpenedFeature, typed
from .buffers import NO_REUSE, Buffers
from .closer import NOW, Closer
from .reader import ONE_THREAD, Reader


class ShmFeature(OpenedFeature):
    """A feature in a segment: opened and locked at construction, errors kept as data."""

    __slots__ = ("unlinked", "_fd", "_size", "_released", "_buffers", "_closer", "_reader")

    def __init__(self, item: Item, rid: str, faults: Faults, buffers: Buffers = NO_REUSE, closer: Closer = NOW,
                 reader: Reader = ONE_THREAD):
        self._fd, self._size, self._released, self.unlinked = -1, 0, False, False
        self._buffers, self._closer, self._reader = buffers, closer, reader
        super().__init__(item, rid, faults)

    def _open(self) -> None:
        item = self.item
        self._fd, size = open_segment(item.shm_name)
        self._size = size
        need = item.offset + item.nbytes
        if need > size:
            raise SegmentTooSmall(f"segment {item.shm_name} holds {size} bytes; "
                                  f"offset {item.offset} + nbytes {item.nbytes} = {need}")

    def _read(self) -> torch.Tensor:
        raw = self._buffers.take(self.item.nbytes)
        self._reader.read(self._fd, raw.numpy(), self.item.offset, self.item.shm_name)
        return typed(raw, self.item)

    def release(self, unlink: bool) -> bool:
        """Unlink (the leader), then close; False if anything failed (logged). The name goes
        first, while our descriptor still holds the pages: the last close frees them, and a
        big segment's is left to the rank's ``Closer`` thread (~3.5 ms for 16 MiB here)."""
        if self._released:
            return True
        self._released = True
        name, ok = self.item.shm_name, True
        try:
            self._faults.check("release", self.rid)
        except InjectedFault as exc:
            event("release_failed", logging.WARNING, rid=self.rid, shm=name, error=describe(exc))
            ok = False
        if unlink:
            missing_ok = isinstance(self.error, FileNotFoundError)
            self.unlinked = unlink_segment(name, self.rid, quiet_if_missing=missing_ok)
            ok = (self.unlinked or missing_ok) and ok
        if self._fd >= 0:
            self._closer.close(self._fd, self._size)  # also drops our flock
            self._fd = -1
        return ok

    def __repr__(self) -> str:
        state = "released" if self._released else ("failed" if self.error else "open")
        return f"<ShmFeature {self.item.shm_name} {self.item.nbytes}B {state}>"


def open_segment(name: str) -> tuple[int, int]:
    """Open a segment read-only and share-lock it, never blocking: a FIFO or a segment another
    process holds exclusively is an error for this request, not a stalled rank. The
    descriptor and the segment's size."""
    fd = os.open(shm_path(name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FeatureError(f"{name} is not a regular shared-memory segment")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FeatureError(f"segment {name} is locked exclusively by another process") from None
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def unlink_segment(name: str, rid: str | None = None, quiet_if_missing: bool = False) -> bool:
    """Unlink one owned segment; never raises. True if this call removed it."""
    try:
        os.unlink(shm_path(name))
        return True
    except FileNotFoundError:
        if not quiet_if_missing:
            sampled_event("unlink_missing", logging.WARNING, rid=rid, shm=name)  # a client can cause it at will
    except OSError as exc:
        event("unlink_failed", logging.WARNING, rid=rid, shm=name, error=describe(exc))
    return False


Owner = Callable[[str, Callable[[bool], bool]], bool]  # (segment name, close(unlink)) -> close's result


class _Hold:
    """One segment file the leader has open for its holders: how many hold it, and whether a
    batch left its unlink to the last of them (``owed``)."""

    __slots__ = ("name", "fd", "size", "count", "owed")

    def __init__(self, name: str, fd: int, size: int):
        self.name, self.fd, self.size, self.count, self.owed = name, fd, size, 0, False


class Holds:
    """The leader's shared locks on the segments of queued and running requests, so that the
    orphan sweep leaves them alone: one descriptor per segment, however many items or
    requests name it (counted), so descriptors held never exceed the items admitted.

    They also own the leader's unlinks, so that a segment several requests name goes once,
    when the last of them is done with it (a retry with the same segment, or another
    client naming it, must not take it from a request still queued). A batch past its
    consensus unlinks what no request outside it holds (``owner``), else the drop of the
    last hold does (``drop``); a request no rank read unlinks what nobody holds
    (``unlink_unheld``). Each decision and its unlink happen under one lock that ``hold``
    takes too: a request admitted meanwhile either holds the segment first (and keeps it)
    or finds it gone (a 500: it named a segment mmsched had taken).

    A hold is of a file, not of a name: once a batch has unlinked a segment its holders
    keep their descriptor, and the name is free. A request that names it again holds
    whatever the client created there since, so that file goes with that request on
    every path (outside attack: a client re-using a name while the request that first
    sent it was still running, then aborting the second request, left the new segment
    in /dev/shm: the leader took the name for the old request's and left it alone)."""

    def __init__(self, closer: Closer = NOW) -> None:
        self._closer = closer  # the last holder's descriptor may free a big segment's pages
        self._held: dict[str, _Hold] = {}  # name -> the file under that name now, while held
        self._open = 0  # descriptors, those of unlinked files still held included
        self._lock = threading.Lock()  # the loop holds and drops, the lane releases

    def hold(self, names: list[str]) -> list[_Hold]:
        """Lock each segment (or count one more holder); the holds taken, for ``drop``."""
        if not names:  # a request that hands over no segment (text-only, say): no lock to take
            return []
        held = []
        with self._lock:
            for name in names:
                entry = self._held.get(name)
                if entry is None:
                    try:
                        fd, size = open_segment(name)
                    except (OSError, FeatureError):
                        continue  # missing, odd or locked: the request will fail to open it, as it should
                    entry = self._held[name] = _Hold(name, fd, size)
                    self._open += 1
                entry.count += 1
                held.append(entry)
        return held

    def drop(self, holds: list[_Hold], rid: str | None = None) -> int:
        """Drop each hold, unlinking what a batch left to its last holder; the number unlinked."""
        if not holds:
            return 0
        unlinked = 0
        with self._lock:
            for entry in holds:
                entry.count -= 1
                if entry.count == 0:
                    if self._held.get(entry.name) is entry:
                        del self._held[entry.name]
                    if entry.owed:  # unlinked first: our descriptor's close then frees the pages
                        unlinked += unlink_segment(entry.name, rid, quiet_if_missing=True)
                    self._open -= 1
                    self._closer.close(entry.fd, entry.size)
        return unlinked

    def owner(self, batch: list) -> Owner:
        """For ``step.features.release`` on the lane, once ``batch`` (its requests) is past its
        consensus: ``owner(name, close)`` calls ``close(unlink)`` on the feature reading
        ``name``, unlinking it unless a request outside the batch holds it (then the drop of
        the last hold does), and returns ``close``'s result. The batch's holds are counted once."""
        in_batch = Counter(entry for r in batch if r.holds for entry in r.holds)
        return lambda name, close: self._release(name, in_batch, close, batch)

    def _release(self, name: str, in_batch: Counter, close: Callable[[bool], bool], batch: list) -> bool:
        with self._lock:
            entry = self._held.get(name)
            if entry is None and any(r.holds is None and name in r.owned_segments for r in batch):
                # its request was answered while the batch ran (a second signal): that answer
                # released it, and the name may be the client's new segment by now
                return close(False)
            kept = entry is not None and entry.count > in_batch[entry]
            if entry is not None:
                entry.owed = kept  # (an earlier batch may have left it to this one)
                if not kept:  # unlinked now: the name is free, a newcomer holds what is there next
                    del self._held[name]
            return close(not kept)

    def unlink_unheld(self, names: list[str], rid: str | None = None) -> int:
        """Unlink the segments of a request no rank read, but none a queued or running request
        holds (the last of those unlinks it); the number unlinked."""
        with self._lock:
            return sum(unlink_segment(n, rid, quiet_if_missing=True) for n in names if n not in self._held)

    def __len__(self) -> int:
        """Descriptors held."""
        return self._open
