"""An engine plug-in that does no arithmetic: one ``ctx.gather`` of one column a step.

    mmsched serve --tp 2 --engine bench.gather_engine:GatherEngine   # from the repository root

Why: ``make bench``'s tp=2 latency rows run the reference engine, whose numpy and torch work
(encoding 256 token rows a request, the projection, the outputs) runs on rank 0's CPU beside
the scheduler's. Served with this engine instead, in the same minutes, the same rows say how
much of a p50 is the scheduler's path (the socket, admission, the ring, the agreement riding
in the step's one all-gather, the answers) and how much is the reference engine's arithmetic.
Each embedding it answers is one float32 zero; a ``generate`` gets no tokens.
"""

from __future__ import annotations

import torch

_ZERO = bytes(4)  # one float32 0.0


class GatherEngine:
    def __init__(self, ctx):
        self.gather = ctx.gather if ctx.world > 1 else None

    def step(self, requests):
        if self.gather is not None:  # the step's one collective, as every tp > 1 step has
            self.gather(torch.zeros((len(requests), 1), dtype=torch.float64), {})
        return [{"embedding": _ZERO, "dim": 1} if r.type == "embed" else {"output_ids": []} for r in requests]
