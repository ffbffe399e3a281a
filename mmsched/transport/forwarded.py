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

    def receive(self, got: torch.Tensor | str) -> None:
        """The item's bytes (a view into the batch's received buffer), or why the leader has none."""
        if self.error is None:
            if isinstance(got, str):
                self.error = FeatureError(f"not received from the leader's host ({got})")
            else:
                self._raw = got

    def _read(self) -> torch.Tensor:
        # A view into the batch's one received buffer (reused for a later batch only once no view
        # of it is alive: ``Buffers``); a feature a session may keep gets its own memory, or it
        # would hold every forwarded byte of its batch, and that buffer, past the session's bound.
        raw = self._raw.clone() if self.item.id is not None else self._raw
        return typed(raw, self.item)

    def release(self, unlink: bool) -> bool:
        self._raw = None
        return True
