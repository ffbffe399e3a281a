"""A plug-in engine that all-gathers through ``EngineContext.gather``, and can misuse it on
one rank the way an outside attack did (``params.mode``; the first request's mode sets the
batch's): the tests of test_engine_gather.py serve it at tp=2."""

from __future__ import annotations

import zlib
from datetime import timedelta

import torch


def tag(rid: str) -> int:
    return zlib.crc32(rid.encode()) % 65536


def want_sum(rid: str) -> float:
    """The gathered sum of a request's rows at tp=2, when every rank gathered this request's row."""
    return 2.0 * tag(rid) + 3.0


class GatheringEngine:
    def __init__(self, ctx):
        self.ctx = ctx

    def step(self, requests):
        mode, rank = requests[0].params.get("mode", ""), self.ctx.rank
        # each row names its request (a gather paired with another step's shows in the sum)
        local = torch.tensor([[tag(r.rid) + rank + 1.0] * 3 for r in requests], dtype=torch.float32)
        if mode == "raise_before_r0" and rank == 0:
            raise MemoryError("out of memory before the all-gather")
        if mode == "skip_r1" and rank == 1:
            return [{"sum": -1.0} for _ in requests]  # never gathers: its peer waits in the gather
        failed = {j: ValueError(f"row {j} fails on rank {rank}") for j, r in enumerate(requests)
                  if r.params.get("fail_on_rank") == rank}
        if mode == "bad_keys_r1" and rank == 1:
            failed = {str(j): ValueError("keyed by str") for j in range(len(requests))}
        if mode == "raise_between_r0":  # rank 0 runs out of memory between its two gathers
            self.ctx.gather(local, {})
            if rank == 0:
                raise MemoryError("out of memory between two gathers")
        if mode == "fail_first_call_r1":  # rank 1 names row 0 in the first of two gathers only
            self.ctx.gather(local, {0: ValueError("found in the first gather")} if rank == 1 else {})
            failed = {}
        rows = self.ctx.gather(local, failed)  # [world, n, 3]
        if mode == "extra_r1" and rank == 1:  # one gather more than its peer, of the same shape
            self.ctx.gather(local, {})
        if mode == "extra_caught_r1" and rank == 1:  # the same, its failure (0.5 s) caught: the step goes on
            self.ctx.group.set_timeout(timedelta(seconds=0.5))
            try:
                self.ctx.gather(local, {0: ValueError("named in the extra call")})
            except Exception:  # noqa: BLE001 - an engine that returns errors rather than raise
                failed = dict.fromkeys(range(len(requests)), RuntimeError("the extra gather failed"))
        return [failed.get(j) or {"sum": float(rows[:, j, 0].sum())} for j in range(len(requests))]
