"""Feature transports. Each subclasses ``OpenedFeature``: ``open`` (errors as data), ``materialize``, ``release``.

``open_feature`` never raises: a failure is kept on the returned feature and raised by
``materialize``. ``release`` is idempotent, never raises, and logs what it could not do.
"""

from __future__ import annotations

import torch

from ..faults import Faults
from ..protocol import Item

TORCH_DTYPE = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "uint8": torch.uint8, "int8": torch.int8,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}


def typed(raw: torch.Tensor, item: Item) -> torch.Tensor:
    """Owned uint8 bytes → the item's dtype and shape (a view: no copy)."""
    return raw.view(TORCH_DTYPE[item.dtype]).reshape(item.shape)


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


def prune_idle() -> int:
    """Close cached pool descriptors and attachments whose file is gone or replaced and that
    no feature reads now: a pool its owner unlinked is freed, not kept alive by this rank."""
    from .cuda_ipc import ATTACHED
    from .shm_pool import POOLS

    return POOLS.prune() + ATTACHED.prune()


def open_feature(item: Item, rid: str, faults: Faults, lookup=None, rank: int = 0,
                 world: int = 1) -> OpenedFeature:
    """Open one item on this rank. Never raises: errors are kept on the feature.

    ``lookup(ref)`` resolves a session item to the session's stored tensor. The protocol
    admits only these four transports.
    """
    if item.transport == "shm":
        if item.pooled:
            return shm_pool.PooledFeature(item, rid, faults)
        return shm.ShmFeature(item, rid, faults)
    if item.transport == "inline":
        return inline.InlineFeature(item, rid, faults)
    if item.transport == "session":
        from ..sessions import SessionFeature

        return SessionFeature(item, rid, faults, lookup)
    return cuda_ipc.CudaIpcFeature(item, rid, faults, rank, world)


# Imported here, once OpenedFeature exists (they extend it), and at start-up rather than on
# first use: an import inside a batch that meets a descriptor limit (EMFILE) would break
# the group. Sessions import this package; batch.py imports them at start-up.
from . import cuda_ipc, inline, shm, shm_pool  # noqa: E402
