"""Big features end to end at tp=2: every rank reads a 16 MiB shm or pooled feature in two
halves at once (``transport/reader.py``), and what both ranks read is what the client sent."""

from __future__ import annotations

import asyncio

import torch

from mmsched.client import Client, pooled, shm
from mmsched.producers import ShmPool

from .lifecycle import expect, my_segments, no_extra_results, sha256_of

MiB = 1 << 20


def big(seed: int, nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


async def test_big_shm_and_pooled_features_read_as_sent_on_both_ranks(start_server):
    srv = start_server("--tp", "2")
    pool = ShmPool(64 * MiB, "mmsched_")
    try:
        async with Client(srv.addr, shm_pool=pool) as c:
            for round_ in range(2):  # the second round lands in buffers the first one filled
                feats = {f"big-{round_}-{i}": big(10 * round_ + i, 16 * MiB + 4097 * i) for i in range(4)}
                futs = {rid: c.send_request("embed", [1, 2], [(shm if i % 2 else pooled)(t)], rid=rid,
                                            want_digest=True)
                        for i, (rid, t) in enumerate(feats.items())}
                for rid, t in feats.items():
                    r = expect(await c.wait(rid, futs[rid], 60), 200)
                    assert r.meta["digests"] == [sha256_of(t)], rid  # rank 0's; a rank that differs is a 500
            await no_extra_results(c)
    finally:
        pool.close()
    await asyncio.sleep(0)
    assert my_segments() == set()
