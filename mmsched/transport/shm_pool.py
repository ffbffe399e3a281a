"""Pooled shared memory (``pooled: true``): a long-lived segment the client owns, reused slice by slice.

Measured on this machine (bench/materialize.py): reading a slice of a pool kept open
costs a fraction of a fresh segment's open + read + unlink. So each rank keeps a bounded
cache of open pools, keyed by name and checked against the inode on every use (a pool
replaced under the same name is reopened), and never unlinks one. Slices are read with
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
import threading
from collections import OrderedDict

import torch

from ..errors import FeatureError
from ..faults import Faults
from ..log import event
from ..protocol import Item
from . import OpenedFeature, typed
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

    def close(self) -> None:
        os.close(self.fd)


class PoolCache:
    """Per rank: open pools by name, least recently used first out; never unlinks."""

    def __init__(self, limit: int = 32):
        self.limit = limit
        self._pools: OrderedDict[str, _OpenPool] = OrderedDict()
        self._lock = threading.Lock()
        self.replaced = 0

    def get(self, name: str) -> _OpenPool:
        with self._lock:
            pool = self._pools.get(name)
            if pool is not None:
                try:
                    st = os.stat(shm_path(name))
                except FileNotFoundError:
                    self._drop(name)
                    raise
                if st.st_ino == pool.inode and st.st_size == pool.size:
                    self._pools.move_to_end(name)
                    return pool
                self.replaced += 1
                event("pool_replaced", shm=name, old_inode=pool.inode, new_inode=st.st_ino)
                self._drop(name)
            pool = self._pools[name] = _OpenPool(name)
            while len(self._pools) > self.limit:
                self._pools.popitem(last=False)[1].close()
            return pool

    def _drop(self, name: str) -> None:
        pool = self._pools.pop(name, None)
        if pool is not None:
            pool.close()

    def clear(self) -> None:
        with self._lock:
            for name in list(self._pools):
                self._drop(name)

    def __len__(self) -> int:
        return len(self._pools)

    def __repr__(self) -> str:
        return f"<PoolCache mapped={len(self._pools)}/{self.limit} replaced={self.replaced}>"


POOLS = PoolCache()


class PooledFeature(OpenedFeature):
    """A slice of a client's pool, read (pread) through the cached descriptor; nothing to unlink.

    Never copied out of the mapping itself: the owner may truncate its pool at any time, and
    touching a mapping past the end of its file is a SIGBUS that would take the rank down."""

    __slots__ = ("_pool", "_cache")

    def __init__(self, item: Item, rid: str, faults: Faults, cache: PoolCache = POOLS):
        self._pool, self._cache = None, cache
        super().__init__(item, rid, faults)

    def _open(self) -> None:
        item = self.item
        self._pool = self._cache.get(item.shm_name)
        if item.offset + item.nbytes > self._pool.size:
            raise SegmentTooSmall(f"pool {item.shm_name} holds {self._pool.size} bytes; offset "
                                  f"{item.offset} + nbytes {item.nbytes} = {item.offset + item.nbytes}")

    def _read(self) -> torch.Tensor:
        raw = torch.empty(self.item.nbytes, dtype=torch.uint8)
        # a pool its owner shrank gives a short read: SegmentTooSmall for this request only
        read_into(self._pool.fd, raw.numpy(), self.item.offset, self.item.shm_name)
        return typed(raw, self.item)

    def release(self, unlink: bool) -> bool:
        self._pool = None  # the cache keeps the pool open; a pool is never unlinked by mmsched
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
