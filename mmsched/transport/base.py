"""The one interface every transport's feature has: ``open`` (errors as data), ``materialize``,
``release``. A failure at open is kept on the feature and raised by ``materialize``;
``release`` is idempotent, never raises, and logs what it could not do.
"""

from __future__ import annotations

import numpy as np
import torch

from ..faults import Faults
from ..protocol import Item, torch_dtype
from .buffers import NO_REUSE, Buffers
from .reader import ONE_THREAD, Reader


def typed(raw: torch.Tensor, item: Item) -> torch.Tensor:
    """Owned uint8 bytes → the item's dtype and shape (a view: no copy)."""
    return raw.view(torch_dtype(item.dtype)).reshape(item.shape)


class OpenedFeature:
    """Errors as data, once for every transport: ``_open`` runs at construction after the
    ``open`` fault check, and whatever it raises is kept; ``materialize`` raises it, or
    checks the ``materialize`` fault and returns ``_read()``."""

    __slots__ = ("item", "rid", "error", "_faults")

    def __init__(self, item: Item, rid: str, faults: Faults):
        self.item, self.rid, self.error, self._faults = item, rid, None, faults
        try:
            faults.check("open", rid)
            self._open()
        except Exception as exc:
            self.error = exc
            self._open_failed()

    def _open(self) -> None:
        """Attach to the feature; raise what went wrong."""

    def _open_failed(self) -> None:
        """Hook: what a transport owes its producer when it will never read (cuda_ipc acks)."""

    def _read(self) -> torch.Tensor:
        raise NotImplementedError

    def materialize(self) -> torch.Tensor:
        """An owned tensor of the item's dtype and shape; raises the open error if any."""
        if self.error is not None:
            raise self.error
        self._faults.check("materialize", self.rid)
        t = self._read()
        return self._corrupted(t) if self._faults.hit("corrupt", self.rid) else t

    def _corrupted(self, t: torch.Tensor) -> torch.Tensor:
        """The ``corrupt`` drill: a copy with its first byte flipped (``t`` may share a buffer)."""
        raw = t.reshape(-1).view(torch.uint8).clone()
        if raw.numel():
            raw[0] ^= 0xFF
        return typed(raw, self.item)

    def release(self, unlink: bool) -> bool:
        """Close what this rank holds; ``unlink`` (the leader) also removes an owned segment.

        Never raises; idempotent; False means something could not be released (and was logged)."""
        raise NotImplementedError


class LeasedFeature(OpenedFeature):
    """A slice of a client's pool (pooled shm, memfd), read through a handle leased from a
    per-rank cache (``leases.py``) into a buffer from ``buffers``, a big one in two halves at
    once (``reader``). ``_open`` sets ``_lease``; release gives it back: the cache keeps the
    pool open for the next request, nothing is unlinked."""

    __slots__ = ("_lease", "_cache", "_buffers", "_reader")

    def __init__(self, item: Item, rid: str, faults: Faults, cache, buffers: Buffers = NO_REUSE,
                 reader: Reader = ONE_THREAD):
        self._lease, self._cache, self._buffers, self._reader = None, cache, buffers, reader
        super().__init__(item, rid, faults)

    def _read(self) -> torch.Tensor:
        raw = self._buffers.take(self.item.nbytes)
        if self.item.nbytes:
            self._reader.fill(raw.numpy(), self._copy_part)
        return typed(raw, self.item)

    def _copy_part(self, dst: np.ndarray, at: int) -> None:
        """Fill ``dst`` with the slice's bytes from ``at`` on (a whole read, or one of its halves)."""
        raise NotImplementedError

    def release(self, unlink: bool) -> bool:
        if self._lease is not None:
            self._cache.release(self._lease)
            self._lease = None
        return True
