"""Destination buffers for big features, reused once nobody holds them.

Measured here (16 MiB): copying into pages the process already has costs ~3 ms, into
fresh pages ~20-50 ms (the page faults, not the copy). glibc hands a big tensor fresh
pages whenever a batch's features add up past its trim threshold, or one is over 32 MiB
(always ``mmap``), so a rank that reads a few big features per batch pays the faults
every batch. ``Buffers`` keeps big uint8 buffers and hands one out only when no tensor
uses its storage any more (the storage's use count is back to what the pool alone
holds): whatever keeps a feature (a session, the engine, a view of it) keeps its buffer
out of the pool. No one must release anything: safe without any hook in the step.
"""

from __future__ import annotations

import threading

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # None: reuse off, plain torch.empty


class Buffers:
    """Per rank (``Transports`` holds one): at most ``limit`` bytes of buffers, each ≥ ``MIN``."""

    MIN = 1 << 20        # smaller tensors come out of glibc's heap without faults
    GRAIN = 1 << 20      # buffer sizes are multiples of this
    LIMIT = 512 << 20    # bytes kept at most, per rank

    def __init__(self, limit: int = LIMIT):
        self.limit, self.kept = limit, 0
        self._free: list[tuple[torch.Tensor, int]] = []  # (buffer, the use count of its storage at rest)
        self._lock = threading.Lock()
        self.reused = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """An uint8 tensor of ``nbytes`` (its contents arbitrary): a kept buffer nobody uses, if any fits."""
        if nbytes < self.MIN or self.limit == 0 or _use_count is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        size = -(-nbytes // self.GRAIN) * self.GRAIN  # one size class: a kept feature wastes < GRAIN
        with self._lock:
            for buf, rest in self._free:
                if buf.numel() == size and _count(buf) == rest:
                    self.reused += 1
                    return buf[:nbytes]
            buf = torch.empty(size, dtype=torch.uint8)
            if self.kept + size > self.limit:
                self._drop_idle(self.kept + size - self.limit)
            if self.kept + size <= self.limit:
                self._free.append((buf, _count(buf)))
                self.kept += size
            return buf[:nbytes]

    def _drop_idle(self, need: int) -> None:
        """Forget idle buffers (smallest first) until ``need`` bytes are freed or none is idle."""
        for buf, rest in sorted(self._free, key=lambda e: e[0].numel()):
            if need <= 0:
                return
            if _count(buf) == rest:
                self._free = [e for e in self._free if e[0] is not buf]
                self.kept -= buf.numel()
                need -= buf.numel()

    def clear(self) -> None:
        with self._lock:
            self._free, self.kept = [], 0


class Into:
    """One destination chosen before the read (the leader's shipment slot, ``remote.Shipment``):
    the read lands where the bytes will travel from, so shipping them copies nothing."""

    def __init__(self, view: torch.Tensor):
        self.view = view

    def take(self, nbytes: int) -> torch.Tensor:
        return self.view if self.view.numel() == nbytes else torch.empty(nbytes, dtype=torch.uint8)


NO_REUSE = Buffers(limit=0)  # for features built outside a ``Transports`` (benchmarks, tests)


def _count(buf: torch.Tensor) -> int:
    return _use_count(buf.untyped_storage()._cdata)
