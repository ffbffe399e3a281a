"""How a client's feature becomes an item map, and what it holds until its result arrives.

``shm()``, ``inline()``, ``pooled()``, ``cuda_ipc()``, ``ref()`` and ``raw()`` describe a
feature; ``Held.item`` writes it where it goes (a fresh segment, a pool slice, an IPC slot,
a payload frame, falling back when a pool or /dev/shm is full) and keeps what must live
until the result: segments locked (no sweep window), slices and slots to give back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..errors import ShmFull
from ..protocol import dtype_name
from ..segments import tensor_bytes
from .segment import Segment, create_segment

log = logging.getLogger("mmsched.client")  # the client's log: its fallbacks are the client's news


@dataclass
class Feature:
    """A feature to send. Build with shm(), inline(), ref() or raw()."""

    transport: str
    tensor: torch.Tensor | None = None
    modality: str = "image"
    id: str | None = None
    ref: str | None = None
    item: dict | None = None       # raw(): the item map as given
    payload: bytes | None = None   # raw(): an extra frame the item refers to as frame=-1


def shm(tensor: torch.Tensor, modality: str = "image", id: str | None = None) -> Feature:
    return Feature("shm", tensor, modality, id)


def inline(tensor: torch.Tensor, modality: str = "image", id: str | None = None) -> Feature:
    return Feature("inline", tensor, modality, id)


def ref(feature_id: str, modality: str = "image") -> Feature:
    return Feature("session", modality=modality, ref=feature_id)


def pooled(tensor: torch.Tensor, modality: str = "image", id: str | None = None) -> Feature:
    """A slice of the client's ShmPool (``pooled: true``); a fresh segment when the pool is full."""
    return Feature("pooled", tensor, modality, id)


def cuda_ipc(tensor: torch.Tensor, modality: str = "image", id: str | None = None) -> Feature:
    """A slot of the client's IpcPool; falls back to shm when the pool is full."""
    return Feature("cuda_ipc", tensor, modality, id)


def raw(item: dict, payload: bytes | None = None) -> Feature:
    """An item map sent as is (tests, other transports); ``"frame": -1`` points at ``payload``."""
    return Feature("raw", item=item, payload=payload)


@dataclass
class Held:
    """What one request's features hold on the client side until its result arrives."""

    shm_pool: object = None  # the client's ShmPool or MemfdPool, if any
    ipc_pool: object = None  # the client's IpcPool, if any
    shm_prefix: str = "mmsched_"
    segments: list[Segment] = field(default_factory=list)  # locked until the result: no sweep window
    slices: list[tuple[int, int]] = field(default_factory=list)  # ShmPool (offset, nbytes)
    leases: list = field(default_factory=list)  # IpcPool leases

    def item(self, f: Feature, frames: list) -> dict:
        """The item map of ``f``; its bytes written where it goes (a payload appended to ``frames``)."""
        if f.transport == "raw":
            item = dict(f.item)
            if item.get("frame") == -1:
                frames.append(f.payload)
                item["frame"] = len(frames)
            return item
        if f.transport == "session":
            return {"transport": "session", "ref": f.ref, "modality": f.modality}
        t = f.tensor
        item = {"modality": f.modality, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        if f.id is not None:
            item["id"] = f.id
        if f.transport == "pooled":
            off = self.shm_pool.put(t) if self.shm_pool is not None else None
            if off is not None:
                self.slices.append((off, t.numel() * t.element_size()))
                return dict(item, **self.shm_pool.where(off))
            log.warning("shm_pool_full falling_back=shm nbytes=%d", t.numel() * t.element_size())
        if f.transport == "cuda_ipc":
            lease = self.ipc_pool.lease(t) if self.ipc_pool is not None else None
            if lease is not None:
                self.leases.append(lease)
                return dict(item, transport="cuda_ipc", ipc=self.ipc_pool.item(t, lease))
            log.warning("ipc_pool_full falling_back=shm nbytes=%d", t.numel() * t.element_size())
        if f.transport in ("shm", "cuda_ipc", "pooled"):
            try:
                seg = create_segment(t, self.shm_prefix)
            except ShmFull as exc:
                log.warning("shm_full falling_back=inline nbytes=%d error=%s", t.numel() * t.element_size(), exc)
            else:
                self.segments.append(seg)
                return dict(item, transport="shm", shm_name=seg.name)
        frames.append(tensor_bytes(t))
        return dict(item, transport="inline", frame=len(frames))

    def __bool__(self) -> bool:
        return bool(self.segments or self.slices or self.leases)

    def unlock(self) -> None:
        for seg in self.segments:
            seg.sent()

    def answered(self, status: int) -> None:
        """The result arrived: no rank reads these bytes any more (contract guarantee 5)."""
        self.unlock()
        for off, n in self.slices:
            self.shm_pool.free(off, n)
        if status == 400:  # no rank saw it: nobody will acknowledge its slots
            for lease in self.leases:
                self.ipc_pool.forget(lease)
            self._take_back()

    def _take_back(self) -> None:
        """After a 400 each of our segments the server took is gone already (it unlinks them
        before answering); one still there is a name it never takes (without its prefix: it
        never opens, unlinks nor sweeps one), so it is still ours to unlink. Left, a client
        configured with the wrong prefix filled /dev/shm (an outside test: 7,693 in one run)."""
        for seg in self.segments:
            seg.discard()

    def never_sent(self) -> None:
        for seg in self.segments:
            seg.discard()
        for lease in self.leases:
            self.ipc_pool.forget(lease)
        for off, n in self.slices:
            self.shm_pool.free(off, n)
