"""Pooled shared memory (``pooled: true``): a long-lived segment the client owns, reused slice by slice.

Measured on this machine (bench/materialize.py): reading a slice of a pool kept open
costs a fraction of a fresh segment's open + read + unlink. So each rank keeps a bounded
cache of open pools, keyed by name and checked against the inode on every use (a pool
replaced under the same name is reopened), and never unlinks one. Each feature leases
its pool until it is released (``leases.py``): a descriptor is never closed under a read.

Slices are copied out of a mapping each rank keeps of the pool, at ~0.8-1.0 of an
in-process copy (16 MiB), against ~0.5-0.6 for ``pread``. The owner may truncate its pool
at any moment, and a mapping touched past the file's end is a SIGBUS, which would kill the
rank: so the copy is guarded (``_guarded_copy.c``: a SIGBUS inside it is a failed copy,
here ``SegmentTooSmall`` for one request). Only a fully allocated pool is mapped (a read
through a mapping fills a hole with pages of the client's file; ``pread`` does not), and
where the guarded copy did not build (no C compiler) every pool is read with ``pread``.
The client's side is ``mmsched.producers.shm_pool``.
"""

from __future__ import annotations

import mmap
import os
import stat

import numpy as np

from ..errors import FeatureError
from ..segments import SegmentTooSmall, fully_allocated, read_into, shm_path
from .base import LeasedFeature
from .leases import LeasedCache

try:
    from ._guarded_copy import copy as guarded_copy
except ImportError:  # built without a C compiler: pread only
    guarded_copy = None


class _OpenPool:
    """A pool this rank keeps open: its descriptor (-1 once mapped: the mapping holds one), and
    the inode and size it had when opened."""

    __slots__ = ("name", "inode", "size", "fd", "map")

    def __init__(self, name: str):
        self.name = name
        # O_NONBLOCK: a FIFO under a pool's name must fail the request, not block the rank
        self.fd = os.open(shm_path(name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise FeatureError(f"pool {name} is not a regular shared-memory segment")
            self.inode, self.size = st.st_ino, st.st_size  # 0 is fine: it holds zero-size slices
            self.map = _map(self.fd, st)
        except BaseException:
            os.close(self.fd)
            raise
        if self.map is not None:  # the mapping keeps a descriptor of its own (mmap dups it)
            os.close(self.fd)
            self.fd = -1

    def is_current(self) -> bool:
        """Still the file under its name, at the size it had (a pool is replaced, never resized),
        and, if mapped, with no hole punched since."""
        try:
            st = os.stat(shm_path(self.name))
        except OSError:
            return False
        return st.st_ino == self.inode and st.st_size == self.size and (self.map is None or fully_allocated(st))

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
        else:
            os.close(self.fd)


def _map(fd: int, st: os.stat_result) -> mmap.mmap | None:
    """A read-only mapping of a fully allocated pool, for the guarded copy; else None (pread)."""
    if guarded_copy is None or not st.st_size or not fully_allocated(st):
        return None
    try:
        return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    except OSError:  # (out of address space, say): the pool is still read, with pread
        return None


class PoolCache(LeasedCache[str, _OpenPool]):
    """Per rank (``Transports`` holds one): open pools by name, checked against the file on
    every lease; never unlinks. ``limit`` bounds the idle pools kept open; a batch naming
    more still reads each one."""

    LIMIT = 32

    def __init__(self, limit: int = LIMIT):
        super().__init__("shm_pools", _OpenPool, _OpenPool.close, lambda name, pool: pool.is_current(), limit)



class PooledFeature(LeasedFeature):
    """A slice of a client's pool, copied out of its leased mapping (guarded) or read with
    pread; nothing to unlink. The lease keeps the descriptor and mapping until ``release``,
    so neither goes under this read. A pool its owner shrank under the read is an error for
    this request only."""

    __slots__ = ()

    def _open(self) -> None:
        item = self.item
        self._lease = self._cache.lease(item.shm_name)
        pool = self._lease.handle
        if item.offset + item.nbytes > pool.size:
            raise SegmentTooSmall(f"pool {item.shm_name} holds {pool.size} bytes; offset "
                                  f"{item.offset} + nbytes {item.nbytes} = {item.offset + item.nbytes}")

    def _copy_part(self, dst: np.ndarray, at: int) -> None:
        item, pool = self.item, self._lease.handle
        if pool.map is None:
            read_into(pool.fd, dst, item.offset + at, item.shm_name)  # a short read raises
        elif not guarded_copy(dst, pool.map, item.offset + at) or pool.map.size() < item.offset + item.nbytes:
            # a fault in the copy, or a file cut inside the slice's last page (no fault there:
            # the bytes past the end read as zeros)
            raise SegmentTooSmall(f"pool {item.shm_name} shrank below offset {item.offset} + nbytes "
                                  f"{item.nbytes} while being read")
