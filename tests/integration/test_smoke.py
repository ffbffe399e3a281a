import torch

from mmsched.client import Client, shm


async def test_embed_over_shm_tp1(shared_server):
    async with Client(shared_server.addr) as c:
        r = await c.embed([1, 2, 3], [shm(torch.ones(4, 4))], want_digest=True)
    assert r.status == 200, r.message
    assert len(r.meta["digests"]) == 1
