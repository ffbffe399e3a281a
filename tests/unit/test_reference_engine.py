"""The reference engine computes a batch in a few numpy calls; its outputs must be the bits
the per-request formula gave (a client comparing embeddings across versions, or across tp
sizes, sees no change). ``old_step`` below is that formula, kept verbatim as the oracle.
No processes: a tp group's all-gather is done in-process from each rank's engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmsched.engine import EngineContext, EngineRequest
from mmsched.engines.reference import ReferenceEngine


def engines(world: int, seed: int = 0) -> list[ReferenceEngine]:
    return [ReferenceEngine(EngineContext(rank=r, world=world, group=None, seed=seed, options={}))
            for r in range(world)]


def old_encode(e: ReferenceEngine, req: EngineRequest) -> np.ndarray:
    x = e.token_table[req.input_ids % e.TOKEN_TABLE].sum(axis=0) / len(req.input_ids)
    for t in req.features:
        b = t.reshape(-1).view(torch.uint8).cpu().numpy()
        if b.size == 0:
            continue
        m = b.size // e.CHUNKS
        sums = np.zeros(e.CHUNKS)
        if m:
            sums += np.add.reduce(b[: m * e.CHUNKS].reshape(e.CHUNKS, m), axis=1, dtype=np.int64)
        sums[-1] += float(b[m * e.CHUNKS:].sum(dtype=np.int64))
        x += (sums / (255.0 * max(m, 1))) @ e.byte_proj_np
    return x


def old_output(e: ReferenceEngine, req: EngineRequest, h: np.ndarray) -> dict:
    if req.type == "embed":
        v = (h / max(math.sqrt(float(h @ h)), 1e-12)).astype("<f4")
        return {"embedding": v.tobytes(), "dim": int(v.size)}
    k = req.max_new_tokens
    idx = (torch.arange(e.HIDDEN)[None, :] - torch.arange(k)[:, None]) % e.HIDDEN
    return {"output_ids": torch.argmax(torch.from_numpy(h)[idx] * e.mix, dim=1).tolist()}


def old_step(ranks: list[ReferenceEngine], requests: list[EngineRequest]) -> list[dict]:
    """The per-request formula of every rank, gathered: rank 0's outputs."""
    locals_ = []
    for e in ranks:
        x = torch.zeros(len(requests), e.D_IN, dtype=torch.float64)
        for i, req in enumerate(requests):
            x.numpy()[i] = old_encode(e, req)
        locals_.append(x @ e.shard)
    rows = torch.cat(locals_, dim=1).numpy()
    return [old_output(ranks[0], req, rows[i]) for i, req in enumerate(requests)]


def new_step(ranks: list[ReferenceEngine], requests: list[EngineRequest]) -> list:
    """Each rank's real ``step``, its all-gather replaced by the columns the others computed."""
    columns = []
    for e in reversed(ranks):  # followers first: rank 0 renders once it has every rank's columns
        def gather(local, failed):  # every rank's rows, [world, n, width], as the gather returns them
            columns.insert(0, local.clone())
            if len(ranks) == 1:
                return local  # a group of one gathers nothing
            return torch.stack(columns)  # a follower's is partial: it renders nothing
        e._gather = gather
        out = e.step(requests)
    return out


def random_requests(rng: np.random.Generator, n: int, features: bool) -> list[EngineRequest]:
    reqs = []
    for i in range(n):
        size = int(rng.choice([1, 9, 256, int(rng.integers(1, 600))]))  # requests of one length share a block
        ids = rng.integers(0, 2**31, size=size, dtype=np.int64)
        feats = []
        if features and i % 3 != 1:
            feats = [torch.from_numpy(rng.integers(0, 256, size=int(s), dtype=np.uint8))
                     for s in rng.choice([0, 7, 16, 1000, 4099], size=int(rng.integers(1, 3)))]
        typ = "generate" if i % 4 == 3 else "embed"
        reqs.append(EngineRequest(rid=f"r{i}", type=typ, input_ids=ids, features=feats,
                                  modalities=["image"] * len(feats), max_new_tokens=int(rng.integers(1, 9)),
                                  params={}))
    return reqs


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("features", [False, True])
@pytest.mark.parametrize("n", [1, 5, 64])
def test_the_batch_path_gives_the_per_request_bits(world, features, n):
    rng = np.random.default_rng(1000 * world + 10 * n + features)
    ranks = engines(world, seed=n)
    requests = random_requests(rng, n, features)
    want, got = old_step(ranks, requests), new_step(ranks, requests)
    assert got == want  # embedding bytes and output ids, exactly
    # and before the float32 cast hides a last bit: each rank's columns of the encoded rows, bit for bit
    want = np.stack([old_encode(ranks[0], r) for r in requests])
    for e in ranks:
        x = np.zeros((n, e.span[1] - e.span[0]))
        assert e.encode_batch(requests, x) == {}
        assert x.tobytes() == np.ascontiguousarray(want[:, slice(*e.span)]).tobytes()


def test_a_request_the_batch_path_cannot_take_fails_alone():
    """Ids of the wrong kind fail that request (as ``encode`` always did); the others keep
    their bits, computed request by request."""
    (e,) = engines(1)
    rng = np.random.default_rng(7)
    good = random_requests(rng, 3, features=True)
    bad = EngineRequest(rid="bad", type="embed", input_ids=np.array([0.5, 1.5]), features=[],
                        modalities=[], max_new_tokens=1, params={})
    unsigned = EngineRequest(rid="u", type="embed", input_ids=good[0].input_ids.astype(np.uint64), features=[],
                             modalities=[], max_new_tokens=1, params={})
    out = new_step([e], [good[0], bad, good[1], good[2], unsigned])
    assert isinstance(out[1], IndexError)
    assert [out[0], out[2], out[3], out[4]] == old_step([e], [*good, unsigned])


def test_a_feature_that_cannot_be_read_fails_its_request_only():
    (e,) = engines(1)
    good = random_requests(np.random.default_rng(3), 2, features=False)
    bad = EngineRequest(rid="bad", type="embed", input_ids=np.arange(4), features=["not a tensor"],
                        modalities=["image"], max_new_tokens=1, params={})
    out = new_step([e], [good[0], bad, good[1]])
    assert isinstance(out[1], AttributeError)
    assert [out[0], out[2]] == old_step([e], good)
