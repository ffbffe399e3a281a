"""CUDA IPC features from a producer-owned pool, with per-rank acknowledgement.

The producer exports one pooled device buffer once and leases fixed-size slots of it;
a request carries its slot (offset, nbytes, dtype, shape, generation) and the pool's
handle. Every consumer rank copies its slice onto its own device and then writes the
slot's generation into its cell of a small *ack board* (a shared-memory int64 array,
slots x ranks, owned by the producer). The producer recycles a slot only when every
rank's cell holds the lease's generation, so a stale ack can never free a newer lease.
A rank that fails or is aborted before copying acknowledges without reconstruction,
and the leader acknowledges for every rank when a request never reached the group
(400, 503, aborted while queued): the pool never loses a slot.

The device is behind ``Device``: ``CudaDevice`` (torch CUDA IPC) where CUDA exists,
``ShmDevice`` (a /dev/shm segment standing in for device memory) everywhere, which is
how the pool's logic is tested on CPU-only machines.
"""

from __future__ import annotations

import logging
import os
import stat
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import msgpack
import numpy as np
import torch

from ..errors import FeatureError, describe
from ..faults import Faults
from ..log import event
from ..protocol import Item
from . import OpenedFeature, typed
from .leases import LeasedCache
from .shm import create_segment, read_into, shm_path, tensor_bytes


class Device(Protocol):
    kind: str

    def export(self, nbytes: int, prefix: str) -> tuple[object, bytes]:
        """Producer: allocate a pool buffer; returns (buffer, handle to send)."""

    def write(self, buffer: object, offset: int, data: torch.Tensor) -> None:
        """Producer: fill a slot."""

    def attach(self, handle: bytes) -> object:
        """Consumer: open the pool (cached by the caller)."""

    def copy_out(self, pool: object, offset: int, nbytes: int) -> torch.Tensor:
        """Consumer: copy a slice into memory this rank owns (uint8)."""

    def is_current(self, handle: bytes, pool: object) -> bool:
        """Consumer: whether an attachment still shows the buffer ``handle`` names now."""

    def detach(self, pool: object) -> None: ...

    def free(self, buffer: object) -> None: ...


class ShmDevice:
    """Device memory stood in for by a /dev/shm segment: the CPU path of this transport."""

    kind = "shm"

    def export(self, nbytes, prefix):
        seg = create_segment(b"", prefix, size=nbytes)
        return seg, seg.name.encode()

    def write(self, buffer, offset, data):
        buf = tensor_bytes(data)
        fd = os.open(shm_path(buffer.name), os.O_WRONLY | os.O_CLOEXEC)
        try:
            pos = 0
            while pos < buf.nbytes:
                pos += os.pwrite(fd, buf[pos:], offset + pos)
        finally:
            os.close(fd)

    def attach(self, handle):
        name = handle.decode()
        fd = os.open(shm_path(name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO never blocks
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise FeatureError(f"pool {name} is not a regular shared-memory segment")
        return (fd, name, st.st_size, st.st_ino)

    def is_current(self, handle, pool):
        """A pool re-created under its name is a new buffer: attach it anew."""
        return _same_file(pool[1], pool[3], pool[2])

    def copy_out(self, pool, offset, nbytes):
        fd, name, size, _ = pool
        if offset + nbytes > size:
            raise FeatureError(f"pool {name} holds {size} bytes; slice ends at {offset + nbytes}")
        out = torch.empty(nbytes, dtype=torch.uint8)
        read_into(fd, out.numpy(), offset, name)
        return out

    def detach(self, pool):
        os.close(pool[0])

    def free(self, buffer):
        buffer.discard()


class CudaDevice:
    """Real CUDA IPC through torch's storage sharing (the rebuild torch.multiprocessing does).

    The handle travels as a msgpack array of the eight values ``_share_cuda_`` returns;
    it comes from a client, so it is never unpickled.
    """

    kind = "cuda"

    def __init__(self, device: int | None = None):
        if not torch.cuda.is_available():
            raise FeatureError("CUDA is not available on this rank")
        if device is None:  # a rank uses the device of its local rank
            device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        self.device = device

    def export(self, nbytes, prefix):
        buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
        return buf, msgpack.packb(list(buf.untyped_storage()._share_cuda_()), use_bin_type=True)

    def write(self, buffer, offset, data):
        src = data.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset: offset + src.numel()].copy_(src, non_blocking=False)

    def attach(self, handle):
        fields = msgpack.unpackb(handle, raw=False)
        if not isinstance(fields, list) or len(fields) != 8:
            raise FeatureError("cuda_ipc handle is not the 8-field array _share_cuda_ gives")
        dev, h, size, off, rc_h, rc_off, ev_h, ev_sync = fields
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(dev, h, size, off, rc_h, rc_off, ev_h, ev_sync)
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def copy_out(self, pool, offset, nbytes):
        if offset + nbytes > pool.numel():
            raise FeatureError(f"pool holds {pool.numel()} bytes; slice ends at {offset + nbytes}")
        out = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
        out.copy_(pool[offset: offset + nbytes])
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def is_current(self, handle, pool):
        """A CUDA IPC handle names one allocation (with its own ref-counter file): never replaced."""
        return True

    def detach(self, pool):
        del pool

    def free(self, buffer):
        del buffer


def device_for(kind: str) -> Device:
    if kind == "shm":
        return ShmDevice()
    if kind == "cuda":
        return CudaDevice()
    raise FeatureError(f"unknown cuda_ipc device kind {kind!r}")


# ---------------------------------------------------------------- the ack board

class AckBoard:
    """slots x ranks int64 generations in a segment the producer owns (never unlinked by mmsched).

    The producer's handle keeps the segment's shared flock for the pool's life, so the
    orphan sweep leaves it alone until the producer is gone.
    """

    def __init__(self, name: str, slots: int, ranks: int, fd: int, segment=None):
        self.name, self.slots, self.ranks, self._fd, self._segment = name, slots, ranks, fd, segment
        self.inode = os.fstat(fd).st_ino

    @classmethod
    def create(cls, prefix: str, slots: int, ranks: int) -> "AckBoard":
        seg = create_segment(np.zeros(slots * ranks, dtype=np.int64).tobytes(), prefix)
        return cls(seg.name, slots, ranks, seg.fd, seg)

    @classmethod
    def open(cls, name: str) -> "AckBoard":
        return cls(name, 0, 0, os.open(shm_path(name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW))

    def is_current(self) -> bool:
        """Still the board under its name: acks for a re-created pool go to its new board."""
        return _same_file(self.name, self.inode)

    def check(self, ipc: dict, rank: int) -> int:
        """The position of ``rank``'s cell for this lease; raises when this board is not the
        one the request was sent with (re-created under its name) or has no such cell."""
        if ipc.get("acks_id") is not None and ipc["acks_id"] != self.inode:
            raise FeatureError(f"ack board {self.name} was re-created since the request was sent "
                               f"(inode {self.inode}, the request names {ipc['acks_id']})")
        ranks = ipc["ranks"]
        if not 0 <= rank < ranks:  # it would land in another slot's cell and free an unread lease
            raise FeatureError(f"ack board {self.name} has {ranks} rank columns; no cell for rank {rank}")
        pos = (ipc["slot"] * ranks + rank) * 8
        if pos + 8 > os.fstat(self._fd).st_size:
            raise FeatureError(f"ack board {self.name} has no cell for slot {ipc['slot']}, rank {rank}")
        return pos

    def ack(self, ipc: dict, rank: int) -> None:
        """Write the lease's generation into ``rank``'s cell (after ``check``'s refusals)."""
        os.pwrite(self._fd, int(ipc["generation"]).to_bytes(8, "little", signed=True), self.check(ipc, rank))

    def read(self) -> np.ndarray:
        raw = os.pread(self._fd, self.slots * self.ranks * 8, 0)
        return np.frombuffer(raw, dtype="<i8").reshape(self.slots, self.ranks)

    def close(self) -> None:
        if self._segment is not None:  # the producer's board: remove it
            self._segment.discard()
        elif self._fd >= 0:
            os.close(self._fd)
        self._fd = -1


# ---------------------------------------------------------------- producer: the pool

@dataclass(frozen=True)
class Lease:
    slot: int
    offset: int
    nbytes: int
    generation: int


class IpcPool:
    """Producer side: one exported buffer, fixed-size slots, recycled on every rank's ack."""

    def __init__(self, device: Device, slots: int, slot_bytes: int, ranks: int, prefix: str = "mmsched_"):
        self.device, self.slot_bytes, self.ranks, self.prefix = device, slot_bytes, ranks, prefix
        self.buffer, self.handle = device.export(slots * slot_bytes, prefix)
        self.board = AckBoard.create(prefix, slots, ranks)
        self.generation = [0] * slots
        self._free = deque(range(slots))
        self._leased: set[int] = set()

    def lease(self, t: torch.Tensor) -> Lease | None:
        """A slot holding ``t``, or None when the pool is full or ``t`` too big (fall back to shm)."""
        nbytes = t.numel() * t.element_size()
        if nbytes > self.slot_bytes:
            return None
        if not self._free:
            self.reclaim()
        if not self._free:
            return None
        slot = self._free.popleft()
        self.generation[slot] += 1
        self.device.write(self.buffer, slot * self.slot_bytes, t)
        self._leased.add(slot)
        return Lease(slot, slot * self.slot_bytes, nbytes, self.generation[slot])

    def reclaim(self) -> int:
        """Free every leased slot that all ranks acknowledged at its current generation."""
        acks = self.board.read()
        done = [s for s in self._leased if (acks[s] >= self.generation[s]).all()]
        for s in done:
            self._leased.discard(s)
            self._free.append(s)
        return len(done)

    def forget(self, lease: Lease) -> None:
        """Take a slot back that no rank will ever see (its request got a 400 before reaching them)."""
        if lease.slot in self._leased and self.generation[lease.slot] == lease.generation:
            self._leased.discard(lease.slot)
            self._free.append(lease.slot)

    def item(self, t: torch.Tensor, lease: Lease) -> dict:
        """The ``ipc`` map of a cuda_ipc item (see docs/protocol.md)."""
        return {"device": self.device.kind, "handle": self.handle, "acks": self.board.name,
                "acks_id": self.board.inode, "ranks": self.ranks, "slot": lease.slot, "offset": lease.offset,
                "generation": lease.generation}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_leased(self) -> int:
        return len(self._leased)

    def close(self) -> None:
        self.board.close()
        self.device.free(self.buffer)

    def __repr__(self) -> str:
        return f"<IpcPool {self.device.kind} free={self.num_free} leased={self.num_leased} slot={self.slot_bytes}B>"


# ---------------------------------------------------------------- consumer: the feature

def _same_file(name: str, inode: int, size: int | None = None) -> bool:
    try:
        st = os.stat(shm_path(name))
    except OSError:
        return False
    return st.st_ino == inode and (size is None or st.st_size == size)


class _Attachments:
    """Per rank: attached pools and opened ack boards, each leased by its readers (``leases.py``)."""

    def __init__(self, limit: int = 16):
        self.pools: LeasedCache[tuple[str, bytes], tuple[Device, object]] = LeasedCache(
            "ipc_pools", self._attach, lambda entry: entry[0].detach(entry[1]),
            lambda key, entry: entry[0].is_current(key[1], entry[1]), limit)
        self.boards: LeasedCache[str, AckBoard] = LeasedCache(
            "ack_boards", AckBoard.open, AckBoard.close, lambda name, board: board.is_current(), limit)

    @staticmethod
    def _attach(key: tuple[str, bytes]) -> tuple[Device, object]:
        dev = device_for(key[0])
        return dev, dev.attach(key[1])

    def prune(self) -> int:
        return self.pools.prune() + self.boards.prune()


ATTACHED = _Attachments()


def acknowledge(item: Item, ranks: range | list[int], rid: str | None = None) -> None:
    """Write this lease's generation for ``ranks``; never raises (logs)."""
    ipc = item.ipc
    try:
        lease = ATTACHED.boards.lease(ipc["acks"])
        try:  # never into a board re-created since: that would free another lease's slot
            for r in ranks:
                lease.handle.ack(ipc, r)
        finally:
            ATTACHED.boards.release(lease)
    except Exception as exc:  # noqa: BLE001 - a release path
        event("ack_failed", logging.WARNING, rid=rid, acks=ipc.get("acks"), error=describe(exc))


class CudaIpcFeature(OpenedFeature):
    __slots__ = ("rank", "world", "_pool", "_acked")

    def __init__(self, item: Item, rid: str, faults: Faults, rank: int, world: int):
        self.rank, self.world, self._pool, self._acked = rank, world, None, False
        super().__init__(item, rid, faults)

    def _open(self) -> None:
        ipc = self.item.ipc
        if ipc["ranks"] < self.world:
            raise FeatureError(f"ack board has {ipc['ranks']} rank columns, the group has {self.world}")
        board = ATTACHED.boards.lease(ipc["acks"])
        try:  # a board re-created since the request was sent means its pool was too: not ours to read
            board.handle.check(ipc, self.rank)
        finally:
            ATTACHED.boards.release(board)
        self._pool = ATTACHED.pools.lease((ipc["device"], ipc["handle"]))

    def _open_failed(self) -> None:
        self._ack()  # this rank will never read it: say so now, not at release

    def _read(self) -> torch.Tensor:
        dev, pool = self._pool.handle
        try:
            raw = dev.copy_out(pool, self.item.ipc["offset"], self.item.nbytes)
        finally:
            self._ack()  # copied (or failed for good): the producer may reuse it once every rank says so
        return typed(raw, self.item)

    def _ack(self) -> None:
        if not self._acked:
            self._acked = True
            acknowledge(self.item, [self.rank], self.rid)

    def release(self, unlink: bool) -> bool:
        self._ack()  # failed or aborted before copying: acknowledge without reconstruction
        if self._pool is not None:  # the attachment stays cached for the pool's next request
            ATTACHED.pools.release(self._pool)
            self._pool = None
        return True
