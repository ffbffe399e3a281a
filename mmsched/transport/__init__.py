"""Feature transports on a rank: one module per transport, one interface (``base.OpenedFeature``:
open with errors as data, ``materialize``, ``release(unlink)``), and ``Transports``, the
per-rank object that opens items and owns the handles they keep open across requests.

The client's side (creating segments and pools) is ``mmsched.producers``.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..faults import NO_FAULTS, Faults
from ..protocol import Item
from .base import OpenedFeature, typed
from .buffers import Buffers, Into
from .closer import Closer
from .cuda_ipc import Attachments, CudaIpcFeature, acknowledge
from .forwarded import ForwardedFeature
from .inline import InlineFeature
from .memfd import MemfdCache, MemfdFeature
from .reader import Reader
from .session import SessionFeature
from .shm import ShmFeature
from .shm_pool import PoolCache, PooledFeature

__all__ = ["ForwardedFeature", "OpenedFeature", "Transports", "typed"]


class Transports:
    """One rank's transports: ``open`` picks an item's transport and never raises, ``tidy``
    closes cached handles their owners removed. The caches (pooled shm descriptors, memfd mappings,
    cuda_ipc attachments and ack boards) live here, one set per rank, not in module globals."""

    def __init__(self, rank: int = 0, world: int = 1, faults: Faults = NO_FAULTS,
                 pool_limit: int = PoolCache.LIMIT, attach_limit: int = Attachments.LIMIT):
        self.rank, self.world, self.faults = rank, world, faults
        self.pools = PoolCache(pool_limit)
        self.memfds = MemfdCache(pool_limit)
        self.buffers = Buffers()  # big features' destinations, reused once nobody holds them
        self.closer = Closer()  # big segments' last descriptors, closed off the lane and the loop
        self.reader = Reader()  # big segments read in two halves at once
        self.attached = Attachments(attach_limit)

    def open(self, item: Item, rid: str, lookup: Callable[[str], torch.Tensor] | None = None,
             into: torch.Tensor | None = None) -> OpenedFeature:
        """Open one item on this rank. Never raises: errors are kept on the feature.

        ``lookup(ref)`` resolves a session item to the session's stored tensor; ``into``, an
        uint8 view of the item's size, is where an shm or memfd read lands (the leader's
        shipment slot). The protocol admits only these five transports (memfd is an extension)."""
        buffers = self.buffers if into is None else Into(into)
        if item.transport == "shm":
            if item.pooled:
                return PooledFeature(item, rid, self.faults, self.pools, buffers, self.reader)
            return ShmFeature(item, rid, self.faults, buffers, self.closer, self.reader)
        if item.transport == "inline":
            return InlineFeature(item, rid, self.faults)
        if item.transport == "session":
            return SessionFeature(item, rid, self.faults, lookup)
        if item.transport == "memfd":
            return MemfdFeature(item, rid, self.faults, self.memfds, buffers, self.reader)
        return CudaIpcFeature(item, rid, self.faults, self.rank, self.world, self.attached)

    def forwarded(self, item: Item, rid: str) -> ForwardedFeature:
        """A host-bound item on a rank of another host: its bytes come with the batch."""
        return ForwardedFeature(item, rid, self.faults)

    def acknowledge(self, item: Item, ranks, rid: str | None = None) -> None:
        """Acknowledge a cuda_ipc item's slot for ``ranks`` (never raises; logs)."""
        acknowledge(item, ranks, rid, self.attached.boards)

    def tidy(self) -> int:
        """Close cached pool descriptors and attachments whose file is gone or replaced and that
        no feature reads now: a pool its owner unlinked is freed, not kept alive by this rank."""
        return self.pools.prune() + self.memfds.prune() + self.attached.prune()

    def clear(self) -> None:
        """Close every idle handle (the rest on their last release): for whoever is done with them
        (shutdown, tests); descriptors handed to the closer are closed before it returns."""
        for cache in (self.pools, self.memfds, self.attached.pools, self.attached.boards, self.buffers):
            cache.clear()
        self.closer.flush()

    def __repr__(self) -> str:
        return f"<Transports rank={self.rank}/{self.world} {self.pools!r} {self.attached.pools!r}>"
