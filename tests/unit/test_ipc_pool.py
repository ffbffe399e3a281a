"""The cuda_ipc pool's bookkeeping on the CPU stand-in for device memory (``ShmDevice``):
leases, the per-rank ack board, generations, and the consumer side's acknowledgement on
every path (materialized, released unread, failed to open, misconfigured).

No server: the producer (``IpcPool``) and the consumer (``Transports.open`` → ``CudaIpcFeature``)
run in this process, over real /dev/shm segments.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from mmsched.errors import FeatureError, InjectedFault
from mmsched.faults import NO_FAULTS, Fault, Faults
from mmsched.protocol import Limits, decode, pack
from mmsched.devices import ShmDevice
from mmsched.producers import IpcPool
from mmsched.segments import shm_path
from mmsched.transport import Transports
from mmsched.transport.cuda_ipc import AckBoard, CudaIpcFeature, acknowledge
from tests.integration.lifecycle import replace_segment

SLOT = 1024


@pytest.fixture
def make_pool():
    pools: list[IpcPool] = []

    def make(slots: int = 4, ranks: int = 2, slot_bytes: int = SLOT) -> IpcPool:
        p = IpcPool(ShmDevice(), slots=slots, slot_bytes=slot_bytes, ranks=ranks)
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.close()


@pytest.fixture
def ranks():
    """``ranks(rank, world, faults)``: that rank's transports, its cached handles closed after the test."""
    made: list[Transports] = []

    def make(rank: int, world: int, faults: Faults = NO_FAULTS) -> Transports:
        made.append(Transports(rank, world, faults))
        return made[-1]

    yield make
    for t in made:
        t.clear()


def tensor(seed: int, n: int = 64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def item_for(pool: IpcPool, t: torch.Tensor, lease):
    """The item as a rank gets it: encoded by the client's rules, decoded by the server's."""
    header = {"v": 1, "type": "embed", "rid": "r", "input_ids": [1],
              "mm_items": [{"modality": "image", "transport": "cuda_ipc", "dtype": "float32",
                            "shape": list(t.shape), "ipc": pool.item(t, lease)}]}
    return decode([pack(header)], Limits()).items[0]


def ack(pool: IpcPool, lease, rank: int, generation: int) -> None:
    """What a rank writes after copying ``lease`` (as of ``generation``)."""
    board = AckBoard(pool.board.name)
    try:
        board.ack({"ranks": pool.ranks, "slot": lease.slot, "generation": generation}, rank)
    finally:
        board.close()


def cell(pool: IpcPool, slot: int, rank: int) -> int:
    return int(pool.board.read()[slot, rank])


# ---------------------------------------------------------------- producer: lease, ack, reclaim

def test_a_slot_is_recycled_only_after_every_rank_acknowledged(make_pool):
    pool = make_pool(slots=4, ranks=2)
    lease = pool.lease(tensor(1))
    assert (lease.slot, lease.generation, lease.nbytes) == (0, 1, 64 * 4)
    assert (pool.num_free, pool.num_leased) == (3, 1)
    ack(pool, lease, 0, lease.generation)
    assert pool.reclaim() == 0, "rank 1 has not read the slot yet"
    assert pool.num_leased == 1
    ack(pool, lease, 1, lease.generation)
    assert pool.reclaim() == 1
    assert (pool.num_free, pool.num_leased) == (4, 0)
    assert pool.reclaim() == 0  # freed once


def test_a_stale_ack_does_not_free_a_newer_lease(make_pool):
    pool = make_pool(slots=1, ranks=2)
    first = pool.lease(tensor(1))
    for r in (0, 1):
        ack(pool, first, r, first.generation)
    assert pool.reclaim() == 1
    second = pool.lease(tensor(2))
    assert second.slot == first.slot and second.generation == first.generation + 1
    # the board still holds both ranks' acks of the first lease: they do not count
    assert pool.reclaim() == 0
    assert pool.lease(tensor(3)) is None
    ack(pool, second, 0, second.generation)
    ack(pool, second, 1, first.generation)  # a late ack of the old lease
    assert pool.reclaim() == 0
    ack(pool, second, 1, second.generation)
    assert pool.reclaim() == 1


def test_forget_returns_the_slot_and_ignores_an_outdated_lease(make_pool):
    pool = make_pool(slots=1, ranks=2)
    old = pool.lease(tensor(1))
    pool.forget(old)
    assert (pool.num_free, pool.num_leased) == (1, 0)
    new = pool.lease(tensor(2))
    pool.forget(old)  # the slot is someone else's now
    assert pool.num_leased == 1
    pool.forget(new)
    pool.forget(new)  # twice is harmless
    assert (pool.num_free, pool.num_leased) == (1, 0)


def test_full_pool_and_oversized_tensor_get_no_lease(make_pool):
    pool = make_pool(slots=2, ranks=2)
    assert pool.lease(torch.zeros(SLOT // 4 + 1)) is None  # one byte too many for a slot
    assert pool.num_free == 2, "a refused tensor must not take a slot"
    assert pool.lease(torch.zeros(SLOT // 4)) is not None  # exactly a slot
    assert pool.lease(torch.zeros(1)) is not None
    assert pool.lease(torch.zeros(1)) is None
    assert pool.num_leased == 2


def test_lease_reclaims_by_itself_when_no_slot_is_free(make_pool):
    pool = make_pool(slots=1, ranks=2)
    a = pool.lease(tensor(1))
    acknowledge(item_for(pool, tensor(1), a), range(2))  # what the leader does for a 400/503/499
    b = pool.lease(tensor(2))
    assert b is not None and b.slot == a.slot and b.generation == 2


def test_close_removes_the_pool_segments(make_pool):
    pool = make_pool()
    names = [pool.buffer.name, pool.board.name]
    assert all(os.path.exists(shm_path(n)) for n in names)
    assert all(n.startswith("mmsched_") for n in names)
    pool.close()
    assert not any(os.path.exists(shm_path(n)) for n in names)


# ---------------------------------------------------------------- consumer: the feature

def test_feature_materializes_the_slot_bytes_and_acknowledges(make_pool, ranks):
    pool = make_pool(slots=4, ranks=2)
    pool.lease(tensor(0))  # slot 0 taken, so the feature reads at a non-zero offset
    t = tensor(7, 48).reshape(6, 8)
    lease = pool.lease(t)
    assert lease.offset == SLOT
    item = item_for(pool, t, lease)
    f0 = ranks(0, 2, NO_FAULTS).open(item, "r")
    assert isinstance(f0, CudaIpcFeature) and f0.error is None
    out = f0.materialize()
    assert out.dtype == torch.float32 and out.shape == (6, 8)
    assert torch.equal(out, t)
    assert cell(pool, lease.slot, 0) == lease.generation  # acknowledged once the bytes were copied
    assert cell(pool, lease.slot, 1) == 0
    f0.release(unlink=True)
    f0.release(unlink=True)  # idempotent
    # the copy is owned: the producer may overwrite the slot without changing it
    pool.device.write(pool.buffer, lease.offset, torch.zeros_like(t))
    assert torch.equal(out, t)
    f1 = ranks(1, 2, NO_FAULTS).open(item, "r")
    assert torch.equal(f1.materialize(), torch.zeros_like(t))
    f1.release(unlink=False)
    assert pool.reclaim() == 1


def test_feature_released_without_materializing_still_acknowledges(make_pool, ranks):
    """A request failed or aborted before this rank copied its slice."""
    pool = make_pool(slots=2, ranks=2)
    t = tensor(3)
    lease = pool.lease(t)
    item = item_for(pool, t, lease)
    for rank in (0, 1):
        f = ranks(rank, 2, NO_FAULTS).open(item, "r")
        assert f.error is None
        f.release(unlink=rank == 0)
    assert [cell(pool, lease.slot, r) for r in (0, 1)] == [lease.generation] * 2
    assert pool.reclaim() == 1


def test_feature_whose_open_fails_acknowledges_at_once(make_pool, ranks):
    pool = make_pool(slots=2, ranks=2)
    t = tensor(4)
    lease = pool.lease(t)
    item = item_for(pool, t, lease)
    faults = Faults([Fault.parse("1:open:bad-*")], 1)
    f1 = ranks(1, 2, faults).open(item, "bad-1")
    assert isinstance(f1.error, InjectedFault)
    assert cell(pool, lease.slot, 1) == lease.generation  # this rank will never read it: acked already
    with pytest.raises(InjectedFault):
        f1.materialize()
    f1.release(unlink=False)
    assert cell(pool, lease.slot, 1) == lease.generation
    f0 = ranks(0, 2, Faults([Fault.parse("1:open:bad-*")], 0)).open(item, "bad-1")  # rank 1's fault only
    assert torch.equal(f0.materialize(), t)
    assert pool.reclaim() == 1


def test_feature_with_a_missing_pool_keeps_the_error_and_acknowledges(make_pool, ranks):
    pool = make_pool(slots=2, ranks=2)
    t = tensor(5)
    lease = pool.lease(t)
    item = item_for(pool, t, lease)
    item.ipc = dict(item.ipc, handle=b"mmsched_no_such_pool_" + os.urandom(4).hex().encode())
    f = ranks(0, 2, NO_FAULTS).open(item, "r")
    assert isinstance(f.error, FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        f.materialize()
    f.release(unlink=True)
    assert cell(pool, lease.slot, 0) == lease.generation


def test_ack_board_too_small_for_the_group_is_an_error_on_the_feature(make_pool, caplog, ranks):
    """The producer sized its board for 1 rank; the group has 2."""
    pool = make_pool(slots=2, ranks=1)
    t = tensor(6)
    a = pool.lease(t)
    b = pool.lease(tensor(7))  # the neighbouring slot, leased and not yet read by anyone
    item = item_for(pool, t, a)
    f = ranks(1, 2, NO_FAULTS).open(item, "r")
    assert isinstance(f.error, FeatureError)
    assert "rank columns" in str(f.error), f.error
    with pytest.raises(FeatureError):
        f.materialize()
    with caplog.at_level(logging.WARNING, logger="mmsched"):
        mmsched_log = logging.getLogger("mmsched")
        mmsched_log.addHandler(caplog.handler)
        try:
            f.release(unlink=False)  # rank 1 has no column: it must not write into another cell
        finally:
            mmsched_log.removeHandler(caplog.handler)
    assert pool.board.read().tolist() == [[0], [0]]
    assert any(r.getMessage() == "ack_failed" for r in caplog.records)
    assert pool.reclaim() == 0, "no slot may be freed by an ack meant for no cell"
    assert b.slot in pool._leased  # noqa: SLF001 - the neighbour is still leased


def test_the_leader_acknowledges_for_every_rank_when_none_will_read(make_pool):
    """A request answered before reaching the ranks (400 on a bad ref, 503, aborted while queued)."""
    pool = make_pool(slots=1, ranks=4)
    t = tensor(8)
    lease = pool.lease(t)
    acknowledge(item_for(pool, t, lease), range(4), "r")
    assert pool.board.read()[lease.slot].tolist() == [lease.generation] * 4
    assert pool.reclaim() == 1


def test_acks_for_a_board_re_created_under_its_name_go_nowhere(make_pool, ranks):
    """A producer that re-creates its pool and board under the same names restarts at
    generation 1: the acks of requests sent to the old board must not free the new leases."""
    pool = make_pool(slots=1, ranks=1)
    t = tensor(1)
    old = item_for(pool, t, pool.lease(t))
    assert old.ipc["acks_id"] == pool.board.inode
    replace_segment(pool.board.name, bytes(8))  # re-created: same name, new inode, no acks yet
    f = ranks(0, 1, NO_FAULTS).open(old, "r")
    assert "re-created since the request was sent" in str(f.error)  # a 500, not the new pool's bytes
    f.release(unlink=True)
    acknowledge(old, [0])
    with open(shm_path(pool.board.name), "rb") as fh:
        assert fh.read() == bytes(8), "an old request's ack landed on the new board"
