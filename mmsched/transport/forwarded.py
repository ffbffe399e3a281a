"""Forwarded features: a host-bound item (shm, cuda_ipc) on a rank of another host, whose
bytes arrive from the leader with the batch (``mmsched.remote``)."""

from __future__ import annotations

import torch

from ..errors import FeatureError
from ..faults import Faults
from ..protocol import Item
from .base import OpenedFeature, typed


class ForwardedFeature(OpenedFeature):
    """A host-bound item on a remote rank: its bytes arrive from the leader with the batch."""

    __slots__ = ("_raw",)

    def __init__(self, item: Item, rid: str, faults: Faults):
        self._raw = None
        super().__init__(item, rid, faults)

    def receive(self, raw: torch.Tensor | None, problem: str | None) -> None:
        if self.error is None:
            if raw is None:
                self.error = FeatureError(f"not received from the leader's host ({problem})")
            else:
                self._raw = raw

    def _read(self) -> torch.Tensor:
        # A view into the batch's one received buffer; a feature a session may keep gets its own
        # memory, or it would pin every forwarded byte of its batch past the session's bound.
        raw = self._raw.clone() if self.item.id is not None else self._raw
        return typed(raw, self.item)

    def release(self, unlink: bool) -> bool:
        self._raw = None
        return True
