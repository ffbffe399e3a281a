"""The rank group as the rest of the code sees it: broadcast, all-gather, all-gather-object.

``SoloGroup`` is a group of one (no torch.distributed); ``GlooGroup`` wraps a real gloo
process group. Every method is a collective and runs on the lane thread only.
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .errors import GroupBroken


class SoloGroup:
    rank, world = 0, 1

    def broadcast(self, payload: bytes | None) -> Any:
        return payload

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0)

    def all_gather_object(self, obj: Any) -> list:
        return [obj]

    def close(self) -> None:
        pass


class GlooGroup:
    """A torch.distributed gloo group; collective errors become GroupBroken."""

    def __init__(self, rank: int, world: int, init_method: str, timeout_s: float):
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.rank, self.world = rank, world

    FIRST = 32 << 10  # the first broadcast's size: a typical batch fits, so one collective suffices

    def broadcast(self, payload: bytes | None) -> memoryview:
        """Leader passes bytes, followers None; everyone gets the leader's bytes.

        One fixed-size broadcast carries the length and the first bytes; a second one
        follows only for a payload that did not fit."""
        try:
            head = torch.zeros(self.FIRST, dtype=torch.uint8)
            if payload is not None:
                n = len(payload)
                head[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
                first = min(n, self.FIRST - 8)
                head.numpy()[8: 8 + first] = np.frombuffer(payload, dtype=np.uint8, count=first)
            dist.broadcast(head, src=0)
            n = int(head[:8].view(torch.int64).item())
            if n <= self.FIRST - 8:
                return memoryview(head.numpy())[8: 8 + n]
            buf = torch.empty(n, dtype=torch.uint8)
            if payload is not None:
                buf.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
            dist.broadcast(buf[self.FIRST - 8:], src=0)
            if payload is None:
                buf.numpy()[: self.FIRST - 8] = head.numpy()[8:]
            return memoryview(buf.numpy())
        except RuntimeError as exc:
            raise GroupBroken(f"broadcast failed: {exc}") from exc

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        try:
            out = torch.empty((self.world * t.shape[0], *t.shape[1:]), dtype=t.dtype)
            _all_gather_single(out, t.contiguous())
            return out.view(self.world, *t.shape)
        except RuntimeError as exc:
            raise GroupBroken(f"all_gather failed: {exc}") from exc

    def all_gather_object(self, obj: Any) -> list:
        try:
            out: list = [None] * self.world
            dist.all_gather_object(out, obj)
            return out
        except RuntimeError as exc:
            raise GroupBroken(f"all_gather_object failed: {exc}") from exc

    def close(self) -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


# torch 2.13 renamed all_gather_into_tensor; keep working on the older releases the range admits.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
