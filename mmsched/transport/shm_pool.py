"""Pooled shared memory (``pooled: true``): a long-lived segment the client owns, reused slice by slice.

Measured on this machine (bench/materialize.py): reading a slice of a pool kept open
costs a fraction of a fresh segment's open + read + unlink. So each rank keeps a bounded
cache of open pools, keyed by name and checked against the inode on every use (a pool
replaced under the same name is reopened), and never unlinks one. Each feature leases
its pool until it is released (``leases.py``): a descriptor is never closed under a read. Slices are read with
pread, not copied out of a mapping: the owner may truncate its pool at any moment, and a
mapping touched past the file's end is a SIGBUS that kills the rank, where a short read
is an error for one request. (A kept mapping copies faster: at 16 MiB ~0.8-0.9 of an
in-process copy into a reused buffer, against ~0.5-0.55 for ``pread``; safety first.) The client's side is ``mmsched.producers.shm_pool``.
"""

from __future__ import annotations

import os
import stat

import torch

from ..errors import FeatureError
from ..faults import Faults
from ..protocol import Item
from ..segments import SegmentTooSmall, shm_path
from .base import LeasedFeature, typed
from .buffers import NO_REUSE, Buffers
from .leases import LeasedCache
from .reader import ONE_THREAD, Reader


class _OpenPool:
    """A pool this rank keeps open: its descriptor, and the inode and size it had when opened."""

    __slots__ = ("name", "inode", "size", "fd")

    def __init__(self, name: str):
        self.name = name
        # O_NONBLOCK: a FIFO under a pool's name must fail the request, not block the rank
        self.fd = os.open(shm_path(name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise FeatureError(f"pool {name} is not a regular shared-memory segment")
            self.inode, self.size = st.st_ino, st.st_size  # 0 is fine: it holds zero-size slices
        except BaseException:
            os.close(self.fd)
            raise

    def is_current(self) -> bool:
        """Still the file under its name, at the size it had (a pool is replaced, never resized)."""
        try:
            st = os.stat(shm_path(self.name))
        except OSError:
            return False
        return st.st_ino == self.inode and st.st_size == self.size

    def close(self) -> None:
        os.close(self.fd)


class PoolCache(LeasedCache[str, _OpenPool]):
    """Per rank (``Transports`` holds one): open pools by name, checked against the file on
    every lease; never unlinks. ``limit`` bounds the idle pools kept open; a batch naming
    more still reads each one."""

    LIMIT = 32

    def __init__(self, limit: int = LIMIT):
        super().__init__("shm_pools", _OpenPool, _OpenPool.close, lambda name, pool: pool.is_current(), limit)



class PooledFeature(LeasedFeature):
    """A slice of a client's pool, read (pread) through a leased descriptor; nothing to unlink.

    The lease keeps the descriptor open until ``release``, so its number is never reused
    under this read. Never copied out of a mapping: the owner may truncate its pool at any
    time, and touching a mapping past the end of its file is a SIGBUS that would take the
    rank down; a short read is an error for this request only."""

    __slots__ = ("_reader",)

    def __init__(self, item: Item, rid: str, faults: Faults, cache: PoolCache, buffers: Buffers = NO_REUSE,
                 reader: Reader = ONE_THREAD):
        self._reader = reader
        super().__init__(item, rid, faults, cache, buffers)

    def _open(self) -> None:
        item = self.item
        self._lease = self._cache.lease(item.shm_name)
        pool = self._lease.handle
        if item.offset + item.nbytes > pool.size:
            raise SegmentTooSmall(f"pool {item.shm_name} holds {pool.size} bytes; offset "
                                  f"{item.offset} + nbytes {item.nbytes} = {item.offset + item.nbytes}")

    def _read(self) -> torch.Tensor:
        raw = self._buffers.take(self.item.nbytes)
        self._reader.read(self._lease.handle.fd, raw.numpy(), self.item.offset, self.item.shm_name)
        return typed(raw, self.item)
