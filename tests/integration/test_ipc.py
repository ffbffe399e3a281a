"""cuda_ipc through a real tp = 2 group, with the CPU stand-in for device memory (ShmDevice):
the bytes arrive intact, and every slot comes back to the pool whatever the request's fate
(200, 500 on one rank, 499 while queued, 400), or the client falls back to shm.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from mmsched.client import Client, cuda_ipc, ref, shm
from mmsched.devices import ShmDevice
from mmsched.producers import IpcPool

from ..conftest import Server
from .lifecycle import captured, expect, feature, hold_lane, my_segments, no_extra_results, sha256_of

ARGS = (
    "--tp", "2",
    "--fault", "1:open:ipcfail-*",   # rank 1 cannot open the request's features
    "--fault", "1:stall:ipchold-*",  # holds the lane: what follows waits queued
    "--stall-s", "2",
)
SLOT = 4096


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with Server(*ARGS, tmp_dir=str(tmp_path_factory.mktemp("ipc"))) as srv:
        yield srv


@pytest.fixture
def make_pool():
    pools: list[IpcPool] = []

    def make(slots: int = 4) -> IpcPool:
        p = IpcPool(ShmDevice(), slots=slots, slot_bytes=SLOT, ranks=2)
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.close()


def acked_by_all(pool: IpcPool, lease) -> bool:
    return pool.board.read()[lease.slot].tolist() == [lease.generation] * pool.ranks


async def wait_for_async(cond, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout}s: {what}"
        await asyncio.sleep(0.02)


def tag() -> str:
    return uuid.uuid4().hex[:6]


async def test_cuda_ipc_features_arrive_intact_and_every_slot_comes_back(group, make_pool):
    pool = make_pool(slots=4)
    async with Client(group.addr, ipc_pool=pool) as c:
        for rnd in range(3):  # 6 leases from 4 slots: slots must be recycled
            a = feature(rnd, (8, 32))                                 # 1 KiB
            b = torch.arange(3 * 5 * 7, dtype=torch.uint8).reshape(3, 5, 7) + rnd
            plain = feature(100 + rnd, (2, 3))
            r = expect(await c.embed([1, 2, rnd], [cuda_ipc(a), shm(plain), cuda_ipc(b)],
                                     want_digest=True), 200)
            assert r.meta["digests"] == [sha256_of(a), sha256_of(plain), sha256_of(b)]
            assert pool.num_leased == 2
            assert pool.reclaim() == 2, pool.board.read()
            assert pool.num_free == 4
        # the same bytes through shm give the same embedding: the engine saw identical features
        x = feature(50, (16, 16))
        via_ipc = expect(await c.embed([4, 5], [cuda_ipc(x)]), 200)
        via_shm = expect(await c.embed([4, 5], [shm(x)]), 200)
        assert torch.equal(via_ipc.embedding, via_shm.embedding)
        assert pool.reclaim() == 1
        await no_extra_results(c)
    assert my_segments() == {pool.buffer.name, pool.board.name}  # only the pool's own


async def test_a_request_failing_on_rank_1_returns_its_slots(group, make_pool):
    pool = make_pool(slots=2)
    x, y = feature(1), feature(2)
    async with Client(group.addr, ipc_pool=pool) as c:
        fut = c.send_request("embed", [1], [cuda_ipc(x), cuda_ipc(y)], rid=f"ipcfail-{tag()}")
        assert pool.num_leased == 2
        r = expect(await asyncio.wait_for(fut, 30), 500, err_type="InternalServerError")
        assert r.meta["failed_ranks"] == [1], r.meta
        # rank 0 acknowledged after copying, rank 1 when it released what it failed to open;
        # that release runs after the consensus on rank 1's own lane, so with no engine step
        # after it (the whole batch failed) its ack may land just after the result
        freed = [pool.reclaim()]
        await wait_for_async(lambda: freed.append(pool.reclaim()) or sum(freed) == 2, 10,
                             f"both slots back; board {pool.board.read().tolist()}")
        ok = expect(await c.embed([1], [cuda_ipc(x)], want_digest=True), 200)
        assert ok.meta["digests"] == [sha256_of(x)]
        assert pool.reclaim() == 1
        await no_extra_results(c)


async def test_a_request_aborted_while_queued_returns_its_slot_at_once(group, make_pool):
    pool = make_pool(slots=2)
    t = tag()
    async with Client(group.addr, ipc_pool=pool) as c:
        hold = await hold_lane(c, f"ipchold-{t}")
        rid = f"q-{t}"
        fut = c.send_request("embed", [1], [cuda_ipc(feature(3))], rid=rid)
        await asyncio.sleep(0.1)
        await c.abort(rid)
        r = expect(await c.wait(rid, fut, 30), 499, err_type="RequestAborted")
        assert r.meta.get("stage") == "queued"
        assert not hold.done()
        assert pool.reclaim() == 1  # the leader acknowledged for both ranks: no rank will read it
        expect(await c.wait(f"ipchold-{t}", hold, 30), 200)
        await no_extra_results(c)


async def test_a_full_pool_falls_back_to_shm(group, make_pool):
    pool = make_pool(slots=1)
    x, y, big = feature(4), feature(5), feature(6, (SLOT // 4 + 1,))
    async with Client(group.addr, ipc_pool=pool) as c:
        with captured("mmsched.client") as logged:
            r = expect(await c.embed([1], [cuda_ipc(x), cuda_ipc(y), cuda_ipc(big)], want_digest=True), 200)
        assert r.meta["digests"] == [sha256_of(x), sha256_of(y), sha256_of(big)]
        falls = [m for m in logged if "ipc_pool_full" in m]
        assert len(falls) == 2 and all("falling_back=shm" in m for m in falls), falls
        assert pool.reclaim() == 1
        await no_extra_results(c)
    assert my_segments() == {pool.buffer.name, pool.board.name}  # the fallback segments are gone


async def test_a_400_gives_the_lease_back_to_the_client(group, make_pool):
    pool = make_pool(slots=2)
    async with Client(group.addr, ipc_pool=pool) as c:
        # malformed: rejected while decoding, no rank (and not the leader) acknowledges it
        r = expect(await c.embed([1], [cuda_ipc(feature(7))], params={"max_new_tokens": 0}), 400)
        assert "max_new_tokens" in r.message
        assert (pool.num_leased, pool.num_free) == (0, 2), "the client takes the slot back on a 400"
        # well-formed but refers to nothing: the leader acknowledges, the client takes it back
        r = expect(await c.embed([1], [cuda_ipc(feature(8)), ref("nothing")], session_id=f"s-{tag()}"), 400)
        assert (pool.num_leased, pool.num_free) == (0, 2)
        assert pool.reclaim() == 0  # nothing is freed twice
        assert sorted(pool._free) == [0, 1]  # noqa: SLF001 - each slot exactly once
        x = feature(9)
        ok = expect(await c.embed([1], [cuda_ipc(x)], want_digest=True), 200)
        assert ok.meta["digests"] == [sha256_of(x)]
        assert pool.reclaim() == 1
        await no_extra_results(c)
