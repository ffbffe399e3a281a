"""Sealed memfd pools (``transport: "memfd"``, an extension): slices copied out of a kept mapping.

A mapping touched past the end of its file is a SIGBUS that kills the rank. A pooled shm
segment's owner may truncate it, so a rank copies out of its mapping only under a guard
(``shm_pool.py``, a C part), and reads it with ``pread`` where the guard did not build. A
memfd sealed with ``F_SEAL_SHRINK | F_SEAL_GROW`` cannot change size (the kernel refuses
its owner's ``ftruncate``), so each rank maps a pool once (``MemfdCache``, a ``LeasedCache``
keyed by ``(pid, fd)``) and copies slices out of the mapping with no guard at all, in two
halves at once from 2 MiB (``reader.py``): at 16 MiB 0.7-1.4 of an in-process copy into a
reused buffer (bench/materialize.py). Before a mapping is trusted, and on every item, a pool
is refused (an error for that request only) when it is not a memfd, not sealed, backed by
huge pages, sparse (a hole reads as zeros: a wrong 200), or not the inode the item names
(the client's descriptor number now holds another file). The client's side is
``mmsched.producers.memfd_pool``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

import numpy as np

from ..errors import FeatureError
from ..segments import SegmentTooSmall, fully_allocated
from .base import LeasedFeature
from .leases import LeasedCache

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # what makes a kept mapping safe: a fixed size


class _Mapped:
    """A pool this rank keeps mapped: its descriptor, inode, size and read-only mapping."""

    __slots__ = ("path", "fd", "inode", "size", "map")

    def __init__(self, key: tuple[int, int]):
        self.path = "/proc/%d/fd/%d" % key
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(self.fd)
            self.inode, self.size = st.st_ino, st.st_size
            _check(self.fd, st, self.path)
            self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ) if self.size else None
        except BaseException:
            os.close(self.fd)
            raise

    def is_current(self) -> bool:
        """Still the file behind the client's descriptor (gone when the client closed it or died)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def close(self) -> None:
        try:
            if self.map is not None:
                self.map.close()
        finally:
            os.close(self.fd)


def _check(fd: int, st: os.stat_result, where: str) -> None:
    """Raise unless ``fd`` is a sealed, fully allocated, small-page memfd."""
    if not stat.S_ISREG(st.st_mode):
        raise FeatureError(f"memfd pool {where} is not a regular file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise FeatureError(f"memfd pool {where} is not a memfd (it cannot be sealed)") from None
    if seals & SEALS != SEALS:
        raise FeatureError(f"memfd pool {where} is not sealed with F_SEAL_SHRINK|F_SEAL_GROW "
                           f"(seals {seals:#x}): its owner could shrink it under a reader")
    if st.st_blksize > mmap.PAGESIZE:
        raise FeatureError(f"memfd pool {where} is backed by huge pages ({st.st_blksize}-byte blocks): refused")
    _check_allocated(st, where)


def _check_allocated(st: os.stat_result, where: str) -> None:
    if not fully_allocated(st):
        raise FeatureError(f"memfd pool {where} is sparse: {st.st_blocks * 512} of {st.st_size} bytes "
                           "allocated (a hole reads as zeros; the producer must fallocate it)")


class MemfdCache(LeasedCache[tuple, _Mapped]):
    """Per rank (``Transports`` holds one): mapped pools by (pid, fd), checked on every lease."""

    LIMIT = 32

    def __init__(self, limit: int = LIMIT):
        super().__init__("memfd_pools", _Mapped, _Mapped.close, lambda key, pool: pool.is_current(), limit)


class MemfdFeature(LeasedFeature):
    """A slice of a client's sealed memfd pool, copied out of a leased mapping; nothing to unlink."""

    __slots__ = ()

    def _open(self) -> None:
        item, m = self.item, self.item.memfd
        self._lease = self._cache.lease((m["pid"], m["fd"]))
        pool = self._lease.handle
        if pool.inode != m["inode"]:
            raise FeatureError(f"memfd pool {pool.path} is inode {pool.inode}, the item names inode "
                               f"{m['inode']}: the pool was replaced")
        _check_allocated(os.fstat(pool.fd), pool.path)  # a hole punched since it was mapped
        if item.offset + item.nbytes > pool.size:
            raise SegmentTooSmall(f"memfd pool {pool.path} holds {pool.size} bytes; offset "
                                  f"{item.offset} + nbytes {item.nbytes} = {item.offset + item.nbytes}")

    def _copy_part(self, dst: np.ndarray, at: int) -> None:
        # (numpy lets the GIL go while it copies: the two halves of a big read copy at once)
        src = np.frombuffer(self._lease.handle.map, np.uint8, dst.nbytes, self.item.offset + at)
        np.copyto(dst, src)
        del src  # the mapping can be closed only once no array exports it
