"""POSIX shared-memory features: the consumer (every rank) and the producer (clients).

The consumer never maps a segment: it reads the bytes with ``preadv`` into an owned
tensor. A segment that shrinks or vanishes while being read gives a short read (an
error for that request) instead of a SIGBUS, no page tables are built for a segment
read once, and nothing is registered with Python's ``resource_tracker``.
While a request is in flight its ranks hold a shared ``flock`` on the segment, which
tells the orphan sweep the segment is alive.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat

import numpy as np
import torch

from ..errors import FeatureError, InjectedFault, ShmFull, describe
from ..faults import Faults
from ..log import event
from ..protocol import Item
from . import OpenedFeature, typed

SHM_DIR = "/dev/shm"


class SegmentTooSmall(FeatureError):
    """The segment holds fewer bytes than offset + nbytes (or shrank while being read)."""


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class ShmFeature(OpenedFeature):
    """A feature in a segment: opened and locked at construction, errors kept as data."""

    __slots__ = ("unlinked", "_fd", "_released")

    def __init__(self, item: Item, rid: str, faults: Faults):
        self._fd, self._released, self.unlinked = -1, False, False
        super().__init__(item, rid, faults)

    def _open(self) -> None:
        item = self.item
        self._fd = open_segment(item.shm_name)
        size = os.fstat(self._fd).st_size
        need = item.offset + item.nbytes
        if need > size:
            raise SegmentTooSmall(f"segment {item.shm_name} holds {size} bytes; "
                                  f"offset {item.offset} + nbytes {item.nbytes} = {need}")

    def _read(self) -> torch.Tensor:
        raw = torch.empty(self.item.nbytes, dtype=torch.uint8)
        read_into(self._fd, raw.numpy(), self.item.offset, self.item.shm_name)
        return typed(raw, self.item)

    def release(self, unlink: bool) -> bool:
        """Close (and, for the leader, unlink); False if anything failed (logged)."""
        if self._released:
            return True
        self._released = True
        name, ok = self.item.shm_name, True
        try:
            self._faults.check("release", self.rid)
        except InjectedFault as exc:
            event("release_failed", logging.WARNING, rid=self.rid, shm=name, error=describe(exc))
            ok = False
        if self._fd >= 0:
            try:
                os.close(self._fd)  # also drops our flock
            except OSError as exc:
                event("release_failed", logging.WARNING, rid=self.rid, shm=name, error=describe(exc))
                ok = False
            self._fd = -1
        if unlink:
            missing_ok = isinstance(self.error, FileNotFoundError)
            self.unlinked = unlink_segment(name, self.rid, quiet_if_missing=missing_ok)
            ok = (self.unlinked or missing_ok) and ok
        return ok

    def __repr__(self) -> str:
        state = "released" if self._released else ("failed" if self.error else "open")
        return f"<ShmFeature {self.item.shm_name} {self.item.nbytes}B {state}>"


def open_segment(name: str) -> int:
    """Open a segment read-only and share-lock it, never blocking: a FIFO or a segment another
    process holds exclusively is an error for this request, not a stalled rank."""
    fd = os.open(shm_path(name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FeatureError(f"{name} is not a regular shared-memory segment")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FeatureError(f"segment {name} is locked exclusively by another process") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_into(fd: int, dst: np.ndarray, offset: int, name: str) -> None:
    """Fill ``dst`` (uint8, contiguous) from the segment at ``offset``; a short read is an error."""
    view = memoryview(dst).cast("B")
    pos, n = 0, view.nbytes
    while pos < n:
        got = os.preadv(fd, [view[pos:]], offset + pos)
        if got <= 0:
            raise SegmentTooSmall(f"segment {name} ended after {offset + pos} bytes while being read")
        pos += got


def unlink_segment(name: str, rid: str | None = None, quiet_if_missing: bool = False) -> bool:
    """Unlink one owned segment; never raises. True if this call removed it."""
    try:
        os.unlink(shm_path(name))
        return True
    except FileNotFoundError:
        if not quiet_if_missing:
            event("unlink_missing", logging.WARNING, rid=rid, shm=name)
    except OSError as exc:
        event("unlink_failed", logging.WARNING, rid=rid, shm=name, error=describe(exc))
    return False


class Holds:
    """The leader's shared locks on the segments of queued and running requests, so that the
    orphan sweep leaves them alone: one descriptor per segment, however many items or
    requests name it (counted), so descriptors held never exceed the items admitted."""

    def __init__(self) -> None:
        self._held: dict[str, list[int]] = {}  # name -> [fd, how many holders]

    def hold(self, names: list[str]) -> list[str]:
        """Lock each segment (or count one more holder); the names held, for ``drop``."""
        held = []
        for name in names:
            entry = self._held.get(name)
            if entry is None:
                try:
                    entry = self._held[name] = [open_segment(name), 0]
                except (OSError, FeatureError):
                    continue  # missing, odd or locked: the request will fail to open it, as it should
            entry[1] += 1
            held.append(name)
        return held

    def drop(self, names: list[str]) -> None:
        for name in names:
            entry = self._held[name]
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[name]
                try:
                    os.close(entry[0])
                except OSError:
                    pass

    def __len__(self) -> int:
        """Descriptors held."""
        return len(self._held)


# ---------------------------------------------------------------- producer (client side)

class Segment:
    """A segment this process created, locked (shared flock) until it is sent.

    Ownership passes to mmsched when the request is sent (contract guarantee 4); the
    client library keeps the lock until the request's result arrives and then calls
    ``sent()``, so no orphan sweep can take a segment in flight. A segment that was never
    sent is removed with ``discard()``.
    """

    __slots__ = ("name", "nbytes", "_fd")

    def __init__(self, name: str, nbytes: int, fd: int):
        self.name, self.nbytes, self._fd = name, nbytes, fd

    @property
    def fd(self) -> int:
        """The producer's read-write descriptor (holding the shared lock), -1 once sent."""
        return self._fd

    def sent(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        self.sent()
        try:
            os.unlink(shm_path(self.name))
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"<Segment {self.name} {self.nbytes}B {'locked' if self._fd >= 0 else 'sent'}>"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor in row-major order (bf16 and bool included)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def new_name(prefix: str) -> str:
    """``<prefix><pid>_<random>``: the creator is visible, collisions are not."""
    return f"{prefix}{os.getpid()}_{secrets.token_hex(8)}"


def create_segment(data, prefix: str = "mmsched_", size: int | None = None) -> Segment:
    """Write ``data`` (tensor or bytes-like) into a new segment, pages reserved up front.

    ``posix_fallocate`` makes a full /dev/shm an ``ShmFull`` here instead of a SIGBUS
    later. ``size`` may exceed the data (a segment that holds more than one item).
    """
    buf = tensor_bytes(data) if isinstance(data, torch.Tensor) else memoryview(data).cast("B")
    size = buf.nbytes if size is None else size
    name = new_name(prefix)
    fd = os.open(shm_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise ShmFull(f"cannot reserve {size} bytes in {SHM_DIR}: {exc.strerror}") from exc
                raise
        pos = 0
        while pos < buf.nbytes:
            pos += os.pwrite(fd, buf[pos:], pos)
    except BaseException:
        os.close(fd)
        os.unlink(shm_path(name))
        raise
    return Segment(name, size, fd)
