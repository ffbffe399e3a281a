"""The client's ``ShmPool``: one long-lived segment, handed out slice by slice (``pooled: true``).

A slice is taken back when its request's result arrives, whatever the status: by then no
rank reads it (contract guarantee 5). The ranks' side is ``mmsched.transport.shm_pool``.
"""

from __future__ import annotations

import torch

from ..segments import tensor_bytes, write_at
from .segment import create_segment


class ShmPool:
    """One long-lived segment; first-fit slices, 64-byte aligned, freed when results arrive."""

    ALIGN = 64

    def __init__(self, size: int, prefix: str = "mmsched_"):
        self.segment = create_segment(b"", prefix, size=size)  # locked for the pool's life
        self._start(self.segment.name, self.segment.fd, size)

    def _start(self, name: str, fd: int, size: int) -> None:
        """The slice allocator over ``fd`` (shared with ``MemfdPool``)."""
        self.name, self.fd, self.size = name, fd, size
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
        write_at(self.fd, buf, off)
        self.num_leased += 1
        return off

    def where(self, offset: int) -> dict:
        """The item fields that name the slice at ``offset`` (see docs/protocol.md)."""
        return {"transport": "shm", "shm_name": self.name, "offset": offset, "pooled": True}

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
