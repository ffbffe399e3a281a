"""Session features (``transport: "session"``): a tensor a session already keeps on this rank."""

from __future__ import annotations

from typing import Callable

import torch

from ..faults import Faults
from ..protocol import Item
from .base import OpenedFeature


class SessionFeature(OpenedFeature):
    """The stored tensor, shared read-only with the session; ``lookup(ref)`` finds it."""

    __slots__ = ("_tensor", "_lookup")

    def __init__(self, item: Item, rid: str, faults: Faults, lookup: Callable[[str], torch.Tensor]):
        self._tensor, self._lookup = None, lookup
        super().__init__(item, rid, faults)

    def _open(self) -> None:
        self._tensor = self._lookup(self.item.ref)

    def _read(self) -> torch.Tensor:
        return self._tensor

    def release(self, unlink: bool) -> bool:
        self._tensor = None  # the session keeps its own reference
        return True
