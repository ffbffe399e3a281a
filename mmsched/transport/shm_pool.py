"""Pooled shared memory (``pooled: true``): a long-lived segment the client owns, reused slice by slice.

Measured on this machine (bench/materialize.py): reading a slice of a pool kept open
costs a fraction of a fresh segment's open + read + unlink. So each rank keeps a bounded
cache of open pools, keyed by name and checked against the inode on every use (a pool
replaced under the same name is reopened), and never unlinks one. Each feature leases
its pool until it is released (``leases.py``): a descriptor is never closed under a read. Slices are read with
pread, not copied out of a mapping: the owner may truncate its pool at any moment, and a
mapping touched past the file's end is a SIGBUS that kills the rank, where a short read
is an error for one request. (A kept mapping copies faster, ~1.1x vs ~0.7x of an
in-process copy at 16 MiB; safety first.) The client's ``ShmPool`` hands out slices
and takes each back when its request's result arrives, whatever the status: by then
no rank reads it (contract guarantee 5).
"""

from __future__ import annotations

import os
import stat
import torch

from ..errors import FeatureError
from ..faults import Faults
from ..protocol import Item
from . import OpenedFeature, typed
from .leases import LeasedCache
from .shm import SegmentTooSmall, create_segment, read_into, shm_path, tensor_bytes


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
    """Per rank: open pools by name, checked against the file on every lease; never unlinks.

    ``limit`` bounds the idle pools kept open; a batch naming more still reads each one."""

    def __init__(self, limit: int = 32):
        super().__init__("shm_pools", _OpenPool, _OpenPool.close, lambda name, pool: pool.is_current(), limit)


POOLS = PoolCache()


class PooledFeature(OpenedFeature):
    """A slice of a client's pool, read (pread) through a leased descriptor; nothing to unlink.

    The lease keeps the descriptor open until ``release``, so its number is never reused
    under this read. Never copied out of a mapping: the owner may truncate its pool at any
    time, and touching a mapping past the end of its file is a SIGBUS that would take the
    rank down; a short read is an error for this request only."""

    __slots__ = ("_lease", "_cache")

    def __init__(self, item: Item, rid: str, faults: Faults, cache: PoolCache = POOLS):
        self._lease, self._cache = None, cache
        super().__init__(item, rid, faults)

    def _open(self) -> None:
        item = self.item
        self._lease = self._cache.lease(item.shm_name)
        pool = self._lease.handle
        if item.offset + item.nbytes > pool.size:
            raise SegmentTooSmall(f"pool {item.shm_name} holds {pool.size} bytes; offset "
                                  f"{item.offset} + nbytes {item.nbytes} = {item.offset + item.nbytes}")

    def _read(self) -> torch.Tensor:
        raw = torch.empty(self.item.nbytes, dtype=torch.uint8)
        read_into(self._lease.handle.fd, raw.numpy(), self.item.offset, self.item.shm_name)
        return typed(raw, self.item)

    def release(self, unlink: bool) -> bool:
        if self._lease is not None:  # the cache keeps the pool open for the next request
            self._cache.release(self._lease)
            self._lease = None
        return True


# ---------------------------------------------------------------- producer (client side)

class ShmPool:
    """One long-lived segment; first-fit slices, 64-byte aligned, freed when results arrive."""

    ALIGN = 64

    def __init__(self, size: int, prefix: str = "mmsched_"):
        self.segment = create_segment(b"", prefix, size=size)  # locked for the pool's life
        self.name, self.size = self.segment.name, size
        self._holes: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted, coalesced
        self.num_leased = 0

    def put(self, t: torch.Tensor) -> int | None:
        """Write ``t`` into a free slice; its offset, or None when no hole is big enough."""
        buf = tensor_bytes(t)
        need = max(self.ALIGN, -(-buf.nbytes // self.ALIGN) * self.ALIGN)
        for i, (off, length) in enumerate(self._holes):
            if length >= need:
                self._holes[i: i + 1] = [(off + need, length - need)] if length > need else []
                break
        else:
            return None
        pos = 0
        while pos < buf.nbytes:
            pos += os.pwrite(self.segment.fd, buf[pos:], off + pos)
        self.num_leased += 1
        return off

    def free(self, offset: int, nbytes: int) -> None:
        length = max(self.ALIGN, -(-nbytes // self.ALIGN) * self.ALIGN)
        holes = sorted(self._holes + [(offset, length)])
        merged: list[tuple[int, int]] = []
        for off, ln in holes:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            else:
                merged.append((off, ln))
        self._holes = merged
        self.num_leased -= 1

    @property
    def bytes_free(self) -> int:
        return sum(ln for _, ln in self._holes)

    def close(self) -> None:
        self.segment.discard()

    def __repr__(self) -> str:
        return f"<ShmPool {self.name} leased={self.num_leased} free={self.bytes_free}/{self.size}>"
