"""cuda_ipc on real device memory (``CudaDevice``): the basic flow of test_ipc.py through a
tp = 2 group whose ranks rebuild the client's pool from its CUDA IPC handle.

Skipped where torch has no CUDA device (the CPU path is covered by test_ipc.py).
"""

from __future__ import annotations

import pytest
import torch

from mmsched.client import Client, cuda_ipc, shm

from ..conftest import Server
from .lifecycle import expect, no_extra_results, sha256_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available())")

SLOT = 1 << 16


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with Server("--tp", "2", "--fault", "1:open:cudafail-*",
                tmp_dir=str(tmp_path_factory.mktemp("cuda"))) as srv:
        yield srv


@pytest.fixture
def pool():
    from mmsched.devices import CudaDevice
    from mmsched.producers import IpcPool

    p = IpcPool(CudaDevice(), slots=4, slot_bytes=SLOT, ranks=2)
    yield p
    p.close()


def on_device(seed: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to("cuda")


async def test_cuda_ipc_round_trip_and_slots_come_back(group, pool):
    async with Client(group.addr, ipc_pool=pool) as c:
        for rnd in range(3):  # 6 leases from 4 slots: recycled on both ranks' acks
            a, b = on_device(rnd, (8, 32)), on_device(10 + rnd, (3, 5, 7)).to(torch.float16)
            r = expect(await c.embed([1, 2, rnd], [cuda_ipc(a), cuda_ipc(b)], want_digest=True), 200)
            assert r.meta["digests"] == [sha256_of(a.cpu()), sha256_of(b.cpu())]
            assert pool.reclaim() == 2, pool.board.read()
        x = on_device(50, (16, 16))
        via_ipc = expect(await c.embed([4, 5], [cuda_ipc(x)]), 200)
        via_shm = expect(await c.embed([4, 5], [shm(x.cpu())]), 200)
        assert torch.equal(via_ipc.embedding, via_shm.embedding)
        assert pool.reclaim() == 1
        await no_extra_results(c)


async def test_cuda_ipc_failure_on_rank_1_returns_the_slot(group, pool):
    async with Client(group.addr, ipc_pool=pool) as c:
        r = expect(await c.embed([1], [cuda_ipc(on_device(1, (4, 4)))], rid="cudafail-1"), 500)
        assert r.meta["failed_ranks"] == [1]
        assert pool.reclaim() == 1
        await no_extra_results(c)
