"""Reused destination buffers: a big feature's buffer comes back only when nothing holds any
view of it (a session keeping a feature, the engine, a digest), so a kept feature's bytes never
change; real memfd pools, no server."""

from __future__ import annotations

import torch

from mmsched.producers import MemfdPool
from mmsched.producers.features import Held, pooled
from mmsched.protocol import Limits
from mmsched.protocol.items import item as _item
from mmsched.transport import Transports
from mmsched.transport.buffers import Buffers

MiB = 1 << 20


def test_a_buffer_is_reused_only_once_no_view_of_it_is_alive():
    b = Buffers(limit=8 * MiB)
    first = b.take(2 * MiB)
    ptr = first.data_ptr()
    kept = first.view(torch.int32)[:10]  # a view (what a session or an engine may keep)
    del first
    second = b.take(2 * MiB)
    assert second.data_ptr() != ptr and b.reused == 0
    del kept
    third = b.take(2 * MiB - 5)
    assert third.data_ptr() == ptr and b.reused == 1 and third.numel() == 2 * MiB - 5
    assert second.data_ptr() != third.data_ptr()


def test_small_features_are_not_pooled_and_the_limit_bounds_what_is_kept():
    b = Buffers(limit=4 * MiB)
    assert b.take(4096).numel() == 4096 and b.kept == 0
    held = [b.take(3 * MiB), b.take(3 * MiB)]  # the second does not fit the limit: not kept
    assert b.kept == 3 * MiB
    del held
    x = b.take(MiB)  # not the idle 3 MiB buffer (another size class): a new one
    assert b.kept == 4 * MiB and b.reused == 0
    y = b.take(MiB + 1)  # 2 MiB more: the idle 3 MiB buffer is dropped to make room, x (held) is not
    assert b.kept == 3 * MiB and x.numel() == MiB and y.numel() == MiB + 1


def _open(tr: Transports, pool: MemfdPool, t: torch.Tensor, rid: str):
    item = _item(0, Held(shm_pool=pool).item(pooled(t), []), [b""], Limits())
    f = tr.open(item, rid)
    out = f.materialize()
    f.release(True)
    return out


def test_a_kept_feature_keeps_its_bytes_while_the_next_batches_reuse_buffers():
    tr, pool = Transports(), MemfdPool(16 * MiB)
    try:
        a, b, c = (torch.full((2 * MiB,), v, dtype=torch.uint8) for v in (1, 2, 3))
        stored = _open(tr, pool, a, "turn-1")  # a session keeps it
        got_b = _open(tr, pool, b, "batch-2")
        assert torch.equal(got_b, b) and tr.buffers.reused == 0
        ptr_b = got_b.data_ptr()
        del got_b  # the batch is done: nobody holds it
        got_c = _open(tr, pool, c, "batch-3")
        assert torch.equal(got_c, c) and got_c.data_ptr() == ptr_b and tr.buffers.reused == 1
        assert torch.equal(stored, a), "a kept feature was overwritten"
    finally:
        tr.clear()
        pool.close()
