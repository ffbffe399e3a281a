"""The reference engine: a deterministic tensor-parallel model, mmsched's default plug-in.

Each rank sums its column shard of the token embedding (and of the features' projected byte
sums) for every request; the shards are all-gathered on the engine's own process group, so a
rank that skipped a request would hang the gather, exactly as a real model would; rank 0
then projects the joined rows, shard by shard, as each rank used to. The output depends only
on the input ids and the feature bytes, bit for bit the per-request formula's, and the same
for any number of ranks up to float tolerance (the projection's shards differ in width).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from ..engine import EngineContext, EngineRequest


class ReferenceEngine:
    D_IN, HIDDEN, TOKEN_TABLE, CHUNKS = 64, 256, 4096, 16  # TOKEN_TABLE: a power of two (_encode_rows)
    BLOCK_IDS = 1 << 12  # ids gathered in one block: its rows (2 MiB) stay in cache while summed

    def __init__(self, ctx: EngineContext):
        g = torch.Generator().manual_seed(ctx.seed)
        self.token_table = torch.randn(self.TOKEN_TABLE, self.D_IN, generator=g, dtype=torch.float64).numpy()
        self.byte_proj_np = torch.randn(self.CHUNKS, self.D_IN, generator=g, dtype=torch.float64).numpy()
        w = torch.randn(self.D_IN, self.HIDDEN, generator=g, dtype=torch.float64) / math.sqrt(self.D_IN)
        self.mix = torch.randn(self.HIDDEN, generator=g, dtype=torch.float64)
        self.shards = [s.contiguous() for s in torch.tensor_split(w, ctx.world, dim=1)]  # rank 0 projects each
        self.shard = self.shards[ctx.rank]
        spans = [(int(c[0]), int(c[-1]) + 1) for c in np.array_split(np.arange(self.D_IN), ctx.world)]
        self.span = spans[ctx.rank]  # this rank's columns of the embedding
        self.widths = [b - a for a, b in spans]
        self.width = max(self.widths)
        # this rank's columns, contiguous: a narrower row gathers faster (the sums are the same bits)
        self.columns = np.ascontiguousarray(self.token_table[:, slice(*self.span)])
        self.rank, self.world, self.group, self.flagged = ctx.rank, ctx.world, ctx.group, ctx.gather

    def encode(self, req: EngineRequest) -> np.ndarray:
        """Input ids and feature bytes → this rank's columns of one D_IN vector (numpy: no torch
        dispatch per small op)."""
        # the rows of the request's tokens, summed: not a dense pass over the whole table per request
        x = self.columns[req.input_ids % self.TOKEN_TABLE].sum(axis=0) / len(req.input_ids)
        return self._add_features(x, req)

    def _add_features(self, x: np.ndarray, req: EngineRequest) -> np.ndarray:
        """``x`` plus each feature's chunked byte sums, projected (in place; returned)."""
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
            x += ((sums / (255.0 * max(m, 1))) @ self.byte_proj_np)[slice(*self.span)]
        return x

    def encode_batch(self, requests: list[EngineRequest], x: np.ndarray) -> dict[int, Exception]:
        """Every request's ``encode`` into the rows of ``x`` [n, this rank's columns]; the failures by index.

        Requests with as many ids as each other share one fancy index and one sum over a
        [k, len, D_IN] block: the rows are added in the same order as ``encode`` adds them,
        so the bits are the same (``np.add.reduceat`` adds in another order: it is not)."""
        groups: dict[int | None, list[int]] = {}
        for i, req in enumerate(requests):
            ids = req.input_ids
            ok = isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype.kind in "iu"
            groups.setdefault(len(ids) if ok else None, []).append(i)
        failed: dict[int, Exception] = {}
        for length, rows in groups.items():
            per = max(1, self.BLOCK_IDS // max(length or 1, 1))
            for at in range(0, len(rows), per):
                self._encode_rows(requests, rows[at: at + per], length, x, failed)
        return failed

    def _encode_rows(self, requests: list[EngineRequest], rows: list[int], length: int | None,
                     x: np.ndarray, failed: dict[int, Exception]) -> None:
        """The rows of requests of ``length`` ids (None: odd ids, each request alone)."""
        if length:
            try:
                # & (TOKEN_TABLE - 1) is % TOKEN_TABLE for every int (a power of two), 10x cheaper;
                # ids [length, k]: the sum runs over the outer axis, adding whole [k, columns] slabs
                # in id order (the same additions, in the same order, as one request's sum)
                ids = np.stack([requests[i].input_ids for i in rows], axis=1) & (self.TOKEN_TABLE - 1)
                x[rows] = np.take(self.columns, ids, axis=0).sum(axis=0) / length  # take: faster than []
            except (IndexError, TypeError):  # int64 and uint64 ids stack as floats: each alone then
                length = None
        for i in rows:
            try:
                if not length:
                    x[i] = self.encode(requests[i])
                elif requests[i].features:
                    self._add_features(x[i], requests[i])
            except Exception as exc:  # noqa: BLE001 - this request fails on this rank only
                failed[i] = exc

    def step(self, requests: list[EngineRequest]) -> list[dict | Exception]:
        n = len(requests)
        x = torch.from_numpy(np.zeros((n, self.width)))  # as wide as the widest shard: rows of one width
        failed = self.encode_batch(requests, x.numpy()[:, : self.span[1] - self.span[0]]) if n else {}
        gathered = self._gather(x, failed)
        if self.rank != 0:  # only rank 0's outputs are sent: the others do not render (nor join) theirs
            return [failed.get(i, {}) for i in range(n)]
        joined = gathered if self.world == 1 else self._join(gathered)
        parts = [joined @ s for s in self.shards]  # each shard of the projection as its rank once did
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return self._outputs(requests, hidden.numpy(), failed)

    def _gather(self, local: torch.Tensor, failed: dict[int, Exception]) -> torch.Tensor:
        """Every rank's rows, [world, n, width] (a group of one: ``local`` itself, nothing to
        gather, and the runner's agreement after the step costs no copy of the rows). Through
        the runner's gather where it is given (its agreement rides along: no collective of the
        runner's own), telling it which rows failed here."""
        if self.world == 1:
            return local
        if self.flagged is not None:
            return self.flagged(local, failed)
        out = torch.empty((self.world * local.shape[0], self.width), dtype=local.dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13
        gather(out, local, group=self.group)
        return out.view(self.world, local.shape[0], self.width)

    def _join(self, parts: torch.Tensor) -> torch.Tensor:
        """The ranks' columns side by side: [n, D_IN], the same bytes as ``torch.cat`` of the
        slices (numpy: a torch slice costs several µs, one per rank at every step)."""
        rows = parts.numpy()
        return torch.from_numpy(np.concatenate([rows[r, :, :w] for r, w in enumerate(self.widths)], axis=1))

    def _outputs(self, requests: list[EngineRequest], rows: np.ndarray, failed: dict) -> list[dict | Exception]:
        """Each request's output from its row of ``rows`` [n, HIDDEN]; the embeddings are
        normalised in one pass. Each row's norm is still its own ``h @ h``: a stack of [1, H] @
        [H, 1] products runs numpy's vector dot per row, as ``h @ h`` does (the same bits), in
        one call (a row at a time cost ~2.4 us a request here)."""
        norms = (rows[:, None, :] @ rows[:, :, None])[:, 0, 0]
        np.sqrt(norms, out=norms)
        emb = (rows / np.maximum(norms, 1e-12)[:, None]).astype("<f4")
        return [failed[i] if i in failed
                else {"embedding": emb[i].tobytes(), "dim": emb.shape[1]} if req.type == "embed"
                else self._generate(req, rows[i]) for i, req in enumerate(requests)]

    def _generate(self, req: EngineRequest, h: np.ndarray) -> dict:
        k = req.max_new_tokens
        idx = (torch.arange(self.HIDDEN)[None, :] - torch.arange(k)[:, None]) % self.HIDDEN
        tokens = torch.argmax(torch.from_numpy(h)[idx] * self.mix, dim=1)
        return {"output_ids": tokens.tolist()}
