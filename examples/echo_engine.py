"""An mmsched engine in one file (docs/engines.md walks through it).

Run it:  PYTHONPATH=examples mmsched serve --tp 2 --engine echo_engine:EchoEngine

``generate`` echoes the prompt (after an optional prefix from ``[engine_options]``), cut to
``max_new_tokens``; every request also gets the sum of its feature bytes, which the ranks
compute together: each sums its own stripe of the bytes, one ``all_reduce`` on the
engine's process group adds the stripes up, so the answer is the same at any tp size.
A request whose params say ``{"fail_on_rank": R}`` fails on rank R only: the 500 names R.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmsched.engine import EngineContext, EngineRequest


class EchoEngine:
    def __init__(self, ctx: EngineContext):
        self.rank, self.world, self.group = ctx.rank, ctx.world, ctx.group
        self.prefix = [int(t) for t in ctx.options.get("prefix", [])]

    def step(self, requests: list[EngineRequest]) -> list[dict | Exception]:
        stripes = torch.tensor([self._stripe_sum(r) for r in requests], dtype=torch.int64)
        if self.group is not None:  # the same requests, in the same order, on every rank
            dist.all_reduce(stripes, group=self.group)
        outputs: list[dict | Exception] = []
        for req, byte_sum in zip(requests, stripes.tolist()):
            if req.params.get("fail_on_rank") == self.rank:
                outputs.append(ValueError(f"this request fails on rank {self.rank}"))
                continue
            out = {"byte_sum": byte_sum, "modalities": req.modalities}
            if req.type == "generate":
                out["output_ids"] = (self.prefix + req.input_ids.tolist())[: req.max_new_tokens]
            else:
                out["dim"] = 0
                out["embedding"] = b""
            outputs.append(out)
        return outputs

    def _stripe_sum(self, req: EngineRequest) -> int:
        """This rank's share of the request's feature bytes: every world-th byte from its rank."""
        return sum(int(t.reshape(-1).view(torch.uint8)[self.rank:: self.world].sum(dtype=torch.int64))
                   for t in req.features)
