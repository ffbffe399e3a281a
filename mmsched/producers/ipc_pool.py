"""The producer side of ``cuda_ipc``: ``IpcPool`` leases fixed-size slots of one exported
buffer and recycles a slot only when every rank's cell on its ``AckBoard`` holds the
lease's generation, so a stale ack can never free a newer lease. The ranks' side
(reading, acknowledging) is ``mmsched.transport.cuda_ipc``.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..segments import read_acks
from .segment import create_segment

if TYPE_CHECKING:  # the devices import this package's segment module: no import at run time
    from ..devices import Device


class AckBoard:
    """slots x ranks int64 generations in a segment this producer owns and removes at close.

    Its handle keeps the segment's shared flock for the pool's life, so the orphan sweep
    leaves it alone until the producer is gone."""

    def __init__(self, prefix: str, slots: int, ranks: int):
        self.segment = create_segment(np.zeros(slots * ranks, dtype=np.int64).tobytes(), prefix)
        self.name, self.slots, self.ranks = self.segment.name, slots, ranks
        self.inode = os.fstat(self.segment.fd).st_ino

    def read(self) -> np.ndarray:
        return read_acks(self.segment.fd, self.slots, self.ranks)

    def close(self) -> None:
        self.segment.discard()


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
        self.board = AckBoard(prefix, slots, ranks)
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
