"""Forwarding to remote hosts without processes: topology arithmetic, and the shipment's framing
(``frame`` on the leader → messages placed where ``layout`` says → ``unframe`` on the receiver).
The real gloo path: tests/integration/test_forwarding.py and test_multihost.py."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from mmsched import remote
from mmsched.faults import Faults
from mmsched.protocol import Item, dtype_name
from mmsched.remote import BIG, Topology
from mmsched.transport import ForwardedFeature

NO_FAULTS = Faults([], 1)


def item(t: torch.Tensor, index: int = 0, id: str | None = None) -> Item:
    return Item(index=index, modality="image", transport="shm", dtype=dtype_name(t.dtype), shape=tuple(t.shape),
                nbytes=t.numel() * t.element_size(), shm_name=f"mmsched_x{index}", id=id)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_topology_groups_ranks_by_host_leader_first():
    topo = Topology(2, hosts=["b", "a", "a", "c", "b"], host_groups={})
    assert topo.is_remote
    assert topo.remote_hosts == {"a": [1, 2], "c": [3]}
    assert topo.remote_ranks == [1, 2, 3]
    assert topo.by_host() == {"host0": [0, 4], "host1": [1, 2], "host2": [3]}
    assert not Topology(4, hosts=["b", "a", "a", "c", "b"], host_groups={}).is_remote


def transfer(tensors: list[torch.Tensor], failed: dict[int, str] | None = None, ids=None):
    """Leader ``frame`` → each message into its slot of the receiver's buffer → ``unframe``;
    the forwarded features filled with what arrived, and the leader's messages."""
    failed = failed or {}
    sizes = [nbytes(t) for t in tensors]
    messages, blob = remote.frame(sizes, [failed.get(k, t) for k, t in enumerate(tensors)])
    lay = remote.layout(sizes)
    buf = torch.full((lay.total,), 0xEE, dtype=torch.uint8)  # what a reused buffer held before
    assert len(messages) == len(lay.slots)
    for (a, b), m in zip(lay.slots, messages):
        buf[a:b] = m
    assert remote.reasons_length(buf) == len(blob)
    feats = [ForwardedFeature(item(t, k, (ids or {}).get(k)), f"r{k}", NO_FAULTS) for k, t in enumerate(tensors)]
    for f, got in zip(feats, remote.unframe(lay, buf, blob)):
        f.receive(got)
    return feats, messages, blob


def test_odd_sized_items_of_every_width_arrive_viewable_as_their_dtype():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g), torch.randn(5, 7, generator=g),
               torch.ones(1, dtype=torch.bool), torch.randn(3, 3, dtype=torch.float64, generator=g),
               torch.randn(2, 5, generator=g).to(torch.bfloat16), torch.arange(7, dtype=torch.int16),
               torch.empty(0, 4), torch.arange(3, dtype=torch.float64)]
    feats, messages, blob = transfer(tensors)
    for t, f in zip(tensors, feats):
        got = f.materialize()
        assert got.dtype == t.dtype and torch.equal(got, t)
    assert len(messages) == 1 and blob == b""  # small items, nothing failed: one message


def test_zero_byte_items_alone_and_between_others():
    tensors = [torch.empty(0), torch.arange(5, dtype=torch.int32), torch.empty(0, 3, dtype=torch.float64)]
    for batch in (tensors[:1], tensors):
        feats, messages, _ = transfer(batch)
        assert len(messages) == 1
        assert messages[0].numel() == remote.PREFIX + remote.INLINE_REASONS + 24 * (len(batch) > 1)
        for t, f in zip(batch, feats):
            got = f.materialize()
            assert got.shape == t.shape and torch.equal(got, t)


def test_an_item_failed_on_the_leader_between_two_good_ones_fails_with_the_reason():
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(4, generator=g), torch.randn(2, 2, generator=g), torch.randn(3, generator=g)]
    why = "FileNotFoundError: [Errno 2] No such file or directory: '/dev/shm/mmsched_gone'"
    feats, messages, blob = transfer(tensors, {1: why})
    assert torch.equal(feats[0].materialize(), tensors[0])
    assert torch.equal(feats[2].materialize(), tensors[2])
    with pytest.raises(Exception, match="not received from the leader's host.*FileNotFoundError"):
        feats[1].materialize()
    assert msgpack.unpackb(blob, strict_map_key=False) == {1: why}
    assert bytes(messages[0][remote.PREFIX: remote.PREFIX + len(blob)]) == blob  # in message 0: no message more
    lay = remote.layout([nbytes(t) for t in tensors])
    assert not messages[0][lay.offsets[1]: lay.offsets[1] + 16].any()  # its slot travels as zeros


def test_payloads_bigger_than_the_copy_limit_go_as_they_are_among_small_ones():
    g = torch.Generator().manual_seed(2)
    big1 = torch.randint(0, 255, (BIG + 3,), dtype=torch.uint8, generator=g)
    big2 = torch.randn(BIG // 4 + 1, generator=g)
    tensors = [big1, torch.randn(7, generator=g), big2, torch.arange(3, dtype=torch.int16)]
    feats, messages, _ = transfer(tensors)
    for t, f in zip(tensors, feats):
        assert torch.equal(f.materialize(), t)
    assert len(messages) == 3  # prefix + the two small ones, then each big item
    assert messages[1].data_ptr() == big1.data_ptr()  # sent from the leader's own memory, not copied
    assert messages[2].data_ptr() == big2.data_ptr()
    # a big item the leader failed to read still fills its slot (zeros) and fails by its reason
    feats, messages, _ = transfer(tensors, {0: "OSError: gone"})
    assert messages[1].numel() == big1.numel() and not messages[1].any()
    with pytest.raises(Exception, match="OSError: gone"):
        feats[0].materialize()
    assert torch.equal(feats[2].materialize(), big2)


def test_many_items_with_some_failed_keep_their_places():
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-99, 99, (k % 13,), dtype=torch.int64 if k % 2 else torch.int8, generator=g)
               for k in range(300)]
    failed = {k: f"ValueError: item {k}" for k in range(5, 300, 37)}
    feats, messages, _ = transfer(tensors, failed)
    assert len(messages) == 1
    for k, (t, f) in enumerate(zip(tensors, feats)):
        if k in failed:
            with pytest.raises(Exception, match=f"item {k}\\)"):
                f.materialize()
        else:
            assert torch.equal(f.materialize(), t), k


def test_a_leader_tensor_of_another_size_than_declared_fails_that_item_only():
    sizes = [16, 8]
    messages, blob = remote.frame(sizes, [torch.ones(3), torch.ones(2)])
    assert msgpack.unpackb(blob, strict_map_key=False) == {0: "the leader read 12 bytes where the item declares 16"}


def test_a_feature_a_session_may_keep_does_not_pin_the_batch_buffer():
    big, small = torch.randn(256, 256), torch.randn(4)
    feats, _, _ = transfer([big, small], ids={1: "img"})
    kept = feats[1].materialize()
    assert torch.equal(kept, small)
    assert kept.untyped_storage().nbytes() == small.numel() * small.element_size()
    # one without an id is a view: no copy on the hot path
    view = feats[0].materialize()
    assert view.untyped_storage().nbytes() > math.prod(big.shape) * big.element_size()


def test_a_kept_forwarded_feature_is_never_overwritten_by_a_later_batch():
    """The receiver's buffer comes from ``Buffers``: while the engine (or anyone) still holds a
    view of batch k's feature, batch k+1 lands elsewhere; once nothing holds it, it is reused."""
    from mmsched.transport.buffers import Buffers

    buffers = Buffers(limit=16 << 20)
    first, second = torch.randn(1 << 18), torch.randn(1 << 18)  # 1 MiB each: big enough to be pooled
    sizes = [nbytes(first)]
    lay = remote.layout(sizes)

    def land(t: torch.Tensor) -> torch.Tensor:
        buf = buffers.take(lay.total)
        (message,), blob = remote.frame(sizes, [t])
        buf.copy_(message)
        f = ForwardedFeature(item(t), "r", NO_FAULTS)
        f.receive(remote.unframe(lay, buf, blob)[0])
        return f.materialize()

    held = land(first)
    ptr = held.data_ptr()
    later = land(second)
    assert torch.equal(held, first) and torch.equal(later, second)
    assert later.data_ptr() != ptr
    del held, later
    again = land(second)
    assert buffers.reused >= 1 and torch.equal(again, second)


def test_items_read_into_their_shipment_slots_travel_as_read_and_the_rest_is_copied_in():
    """The leader reads small host-bound items straight into the batch's shipment (``Shipment``,
    ``Transports.open(into=...)``): real segments, read as a rank reads them; the features it
    hands its own engine are those bytes, and what arrives is the client's bytes for each item:
    one read into its slot, one that was not (a session item: copied in), one failed (zeroed)."""
    from mmsched.producers import create_segment
    from mmsched.transport import Transports
    from mmsched.transport.buffers import Buffers

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (300_001, 5, 700_000)]
    segs = [create_segment(t) for t in tensors]
    for s in segs:
        s.sent()
    tr, buffers = Transports(), Buffers(limit=16 << 20)
    try:
        sizes = [nbytes(t) for t in tensors]
        shipment = remote.Shipment(sizes, buffers)
        items = [Item(index=k, modality="image", transport="shm", dtype="uint8", shape=(n,), nbytes=n,
                      shm_name=s.name) for k, (n, s) in enumerate(zip(sizes, segs))]
        read = tr.open(items[0], "r0", into=shipment.slot(0)).materialize()
        other = tr.open(items[2], "r2").materialize()  # not into its slot (as a session item is not)
        head = shipment.head
        assert head.data_ptr() <= read.data_ptr() < head.data_ptr() + head.numel(), "read into its slot"
        assert torch.equal(read, tensors[0]) and torch.equal(other, tensors[2])
        messages, blob = remote.frame(sizes, [read, "FileNotFoundError: gone", other], shipment=shipment)
        assert messages[0] is head and torch.equal(read, tensors[0]), "shipping leaves the leader's bytes alone"
        got = remote.unframe(shipment.layout, messages[0].clone(), blob)
        assert torch.equal(got[0], tensors[0]) and torch.equal(got[2], tensors[2])
        assert got[1] == "FileNotFoundError: gone"
        off = shipment.layout.offsets[1]
        assert not head[off: off + 5].any(), "a failed item's slot travels as zeros"
    finally:
        tr.clear()
        for s in segs:
            s.discard()


def test_a_feature_read_into_a_shipment_is_never_overwritten_by_a_later_batchs():
    """The engine (or anyone) may keep a feature read into batch k's shipment: batch k+1's
    shipment lands elsewhere while a view of it lives, and reuses it once nothing does."""
    from mmsched.transport.buffers import Buffers

    buffers = Buffers(limit=16 << 20)
    first, second = torch.full((600_000,), 1, dtype=torch.uint8), torch.full((600_000,), 2, dtype=torch.uint8)
    sizes = [600_000, 600_000]  # 1.2 MiB of message 0: a pooled buffer

    def ship_one(t: torch.Tensor) -> torch.Tensor:
        s = remote.Shipment(sizes, buffers)
        kept = s.slot(0)
        kept.copy_(t)  # what the read does
        s.slot(1).copy_(t)
        remote.frame(sizes, [kept, s.slot(1)], shipment=s)
        return kept

    held = ship_one(first)
    later = ship_one(second)
    assert torch.equal(held, first) and torch.equal(later, second)
    del held, later
    ship_one(second)
    assert buffers.reused >= 1
