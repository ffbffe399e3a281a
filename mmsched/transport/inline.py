"""Inline features: the payload frame, received with ``copy=False``, copied once into owned memory."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..errors import InjectedFault, describe
from ..log import event
from .base import OpenedFeature, typed


class InlineFeature(OpenedFeature):
    __slots__ = ()

    def _open(self) -> None:
        got = memoryview(self.item.payload).nbytes
        if got != self.item.nbytes:  # the leader checked; followers re-check
            raise ValueError(f"payload holds {got} bytes, expected {self.item.nbytes}")

    def _read(self) -> torch.Tensor:
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
