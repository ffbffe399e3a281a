"""Inline features: the payload frame, received with ``copy=False``, copied once into owned memory."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..errors import InjectedFault, describe
from ..faults import Faults
from ..log import event
from ..protocol import Item
from . import typed


class InlineFeature:
    __slots__ = ("item", "rid", "error", "_faults")

    def __init__(self, item: Item, rid: str, faults: Faults):
        self.item, self.rid, self.error, self._faults = item, rid, None, faults
        try:
            faults.check("open", rid)
            if memoryview(item.payload).nbytes != item.nbytes:  # the leader checked; followers re-check
                raise ValueError(f"payload holds {memoryview(item.payload).nbytes} bytes, expected {item.nbytes}")
        except Exception as exc:
            self.error = exc

    def materialize(self) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        self._faults.check("materialize", self.rid)
        raw = torch.empty(self.item.nbytes, dtype=torch.uint8)
        if self.item.nbytes:
            raw.numpy()[:] = np.frombuffer(self.item.payload, dtype=np.uint8)
        return typed(raw, self.item)

    def release(self, unlink: bool) -> bool:
        if self.item.payload is None:
            return True
        self.item.payload = None  # drop the frame: zmq may reuse its buffer
        try:
            self._faults.check("release", self.rid)
        except InjectedFault as exc:
            event("release_failed", logging.WARNING, rid=self.rid, transport="inline", error=describe(exc))
            return False
        return True
