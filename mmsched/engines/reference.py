"""The reference engine: a deterministic tensor-parallel projection, mmsched's default plug-in.

Each rank computes its column shard of one projection and the shards are all-gathered on
the engine's own process group, so a rank that skipped a request would hang the gather,
exactly as a real model would. The output depends only on the input ids and the feature
bytes: the same for any number of ranks, up to float tolerance.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from ..engine import EngineContext, EngineRequest


class ReferenceEngine:
    D_IN, HIDDEN, TOKEN_TABLE, CHUNKS = 64, 256, 4096, 16

    def __init__(self, ctx: EngineContext):
        g = torch.Generator().manual_seed(ctx.seed)
        self.token_table = torch.randn(self.TOKEN_TABLE, self.D_IN, generator=g, dtype=torch.float64).numpy()
        self.byte_proj_np = torch.randn(self.CHUNKS, self.D_IN, generator=g, dtype=torch.float64).numpy()
        w = torch.randn(self.D_IN, self.HIDDEN, generator=g, dtype=torch.float64) / math.sqrt(self.D_IN)
        self.mix = torch.randn(self.HIDDEN, generator=g, dtype=torch.float64)
        shards = torch.tensor_split(w, ctx.world, dim=1)
        self.shard = shards[ctx.rank].contiguous()
        self.widths = [s.shape[1] for s in shards]
        self.width = max(self.widths)
        self.rank, self.world, self.group = ctx.rank, ctx.world, ctx.group

    def encode(self, req: EngineRequest) -> np.ndarray:
        """Input ids and feature bytes → one D_IN vector (numpy: no torch dispatch per small op)."""
        # the rows of the request's tokens, summed: not a dense pass over the whole table per request
        x = self.token_table[req.input_ids % self.TOKEN_TABLE].sum(axis=0) / len(req.input_ids)
        for t in req.features:
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

    def step(self, requests: list[EngineRequest]) -> list[dict | Exception]:
        n = len(requests)
        x = torch.zeros(n, self.D_IN, dtype=torch.float64)
        xn = x.numpy()  # rows filled through numpy: one torch setitem less per request
        failed: dict[int, Exception] = {}
        for i, req in enumerate(requests):
            try:
                xn[i] = self.encode(req)
            except Exception as exc:  # noqa: BLE001 - this request fails on this rank only
                failed[i] = exc
        local = torch.zeros(n, self.width, dtype=torch.float64)
        local[:, : self.shard.shape[1]] = x @ self.shard
        hidden = self._gather(local)
        if self.rank != 0:  # only rank 0's outputs are sent: the others do not render theirs
            return [failed.get(i, {}) for i in range(n)]
        rows = hidden.numpy()  # one view for the batch; each request reads its row
        return [failed[i] if i in failed else self._output(req, rows[i]) for i, req in enumerate(requests)]

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's shard of every row, side by side: [n, HIDDEN]."""
        if self.world == 1:
            return local[:, : self.widths[0]]
        out = torch.empty((self.world * local.shape[0], self.width), dtype=local.dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, local, group=self.group)
        parts = out.view(self.world, local.shape[0], self.width)
        return torch.cat([parts[r, :, :w] for r, w in enumerate(self.widths)], dim=1)

    def _output(self, req: EngineRequest, h: np.ndarray) -> dict:
        if req.type == "embed":  # numpy per row: a few torch dispatches less per request
            v = (h / max(math.sqrt(float(h @ h)), 1e-12)).astype("<f4")
            return {"embedding": v.tobytes(), "dim": int(v.size)}
        k = req.max_new_tokens
        idx = (torch.arange(self.HIDDEN)[None, :] - torch.arange(k)[:, None]) % self.HIDDEN
        tokens = torch.argmax(torch.from_numpy(h)[idx] * self.mix, dim=1)
        return {"output_ids": tokens.tolist()}
