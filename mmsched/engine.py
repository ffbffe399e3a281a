"""The engine interface and the built-in reference engine.

An engine step runs on the collective lane, in lockstep on every rank. It receives the
batch's surviving requests with their materialized features and this rank's flags (the
leader's aborts), and must agree those flags through a collective of its own — which a
real tensor-parallel step runs anyway. What a rank-local engine failure does: that
request fails with a 500 naming the rank, the rest of the batch completes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from . import consensus
from .errors import describe
from .faults import Faults
from .protocol import Request


@dataclass(slots=True)
class EngineInput:
    request: Request
    features: list[torch.Tensor]


class Engine(Protocol):
    def step(self, group, batch: list[EngineInput], flags: np.ndarray, faults: Faults,
             aborted=lambda i: False) -> tuple[list[dict | None], consensus.Verdict]:
        """Outputs (None where the verdict says the request did not succeed) and the verdict.

        ``aborted(i)`` is the leader's latest word on request i: ask it right before the
        collective that agrees the flags, so an abort that arrived during the step counts."""


class ReferenceEngine:
    """A tensor-parallel projection: each rank computes its column shard, the shards are gathered.

    Output is a deterministic function of the input ids and the feature bytes, the same
    for any number of ranks up to float tolerance: a rank that skipped a request would
    hang the gather, exactly as a real model would.
    """

    D_IN, HIDDEN, TOKEN_TABLE, CHUNKS = 64, 256, 4096, 16

    def __init__(self, rank: int, world: int, seed: int = 0, stall_s: float = 3.0):
        g = torch.Generator().manual_seed(seed)
        self.token_table = torch.randn(self.TOKEN_TABLE, self.D_IN, generator=g, dtype=torch.float64).numpy()
        self.byte_proj = torch.randn(self.CHUNKS, self.D_IN, generator=g, dtype=torch.float64)
        self.byte_proj_np = self.byte_proj.numpy()
        w = torch.randn(self.D_IN, self.HIDDEN, generator=g, dtype=torch.float64) / math.sqrt(self.D_IN)
        self.mix = torch.randn(self.HIDDEN, generator=g, dtype=torch.float64)
        shards = torch.tensor_split(w, world, dim=1)
        self.shard = shards[rank].contiguous()
        self.widths = [s.shape[1] for s in shards]
        self.width = max(self.widths)
        self.stall_s = stall_s

    def encode(self, req: Request, feats: list[torch.Tensor]) -> np.ndarray:
        """Input ids and feature bytes → one D_IN vector (numpy: no torch dispatch per small op)."""
        # the rows of the request's tokens, summed: not a dense pass over the whole table per request
        x = self.token_table[req.input_ids % self.TOKEN_TABLE].sum(axis=0) / len(req.input_ids)
        for t in feats:
            b = t.reshape(-1).view(torch.uint8).cpu().numpy()  # the reference engine computes on the CPU
            n = b.size
            if n == 0:
                continue
            m = n // self.CHUNKS
            sums = np.zeros(self.CHUNKS)
            if m:  # numpy widens in small buffered blocks; torch's sum(dtype=int64) made an int64
                # copy of the whole feature first (8x its size: a 256 MiB feature cost 2.3 GiB)
                sums += np.add.reduce(b[: m * self.CHUNKS].reshape(self.CHUNKS, m), axis=1, dtype=np.int64)
            sums[-1] += float(b[m * self.CHUNKS:].sum(dtype=np.int64))
            x += (sums / (255.0 * max(m, 1))) @ self.byte_proj_np
        return x

    def step(self, group, batch, flags, faults, aborted=lambda i: False):
        n = len(batch)
        x = torch.zeros(n, self.D_IN, dtype=torch.float64)
        xn = x.numpy()  # rows filled through numpy: one torch setitem less per request
        errors: dict[int, str] = {}
        stall = False
        for i, inp in enumerate(batch):
            if flags[i]:
                continue
            try:
                faults.check("engine", inp.request.rid)
                xn[i] = self.encode(inp.request, inp.features)
            except Exception as exc:
                flags[i], errors[i] = consensus.FAILED, describe(exc)
            try:
                faults.check("stall", inp.request.rid)
            except Exception:
                stall = True
        if stall:
            time.sleep(self.stall_s)  # a drill: this rank holds its peers inside the collective
        for i in range(n):
            if not flags[i] and aborted(i):
                flags[i] = consensus.ABORTED
        local = torch.zeros(n, self.width, dtype=torch.float64)
        local[:, : self.shard.shape[1]] = x @ self.shard
        verdict = consensus.agree(group, flags, errors, extra=local)
        hidden = torch.cat([verdict.extra[r, :, :w] for r, w in enumerate(self.widths)], dim=1)
        if group.rank != 0:  # only the leader's outputs are sent: followers do not render them
            return [None] * n, verdict
        rows = hidden.numpy()  # one view for the batch; each request reads its row
        return [self._output(batch[i].request, rows[i]) if verdict.ok(i) else None
                for i in range(n)], verdict

    def _output(self, req: Request, h: np.ndarray) -> dict:
        if req.type == "embed":  # numpy per row: a few torch dispatches less per request
            v = (h / max(math.sqrt(float(h @ h)), 1e-12)).astype("<f4")
            return {"embedding": v.tobytes(), "dim": int(v.size)}
        k = req.max_new_tokens
        idx = (torch.arange(self.HIDDEN)[None, :] - torch.arange(k)[:, None]) % self.HIDDEN
        tokens = torch.argmax(torch.from_numpy(h)[idx] * self.mix, dim=1)
        return {"output_ids": tokens.tolist()}
