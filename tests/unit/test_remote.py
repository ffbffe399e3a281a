"""Forwarding to remote hosts without processes: topology arithmetic, and ``ship`` → ``fill``
with ``torch.distributed.send`` captured (the real gloo path: tests/integration/test_multihost.py)."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from mmsched import remote
from mmsched.faults import Faults
from mmsched.protocol import Item, dtype_name
from mmsched.remote import Topology
from mmsched.transport import ForwardedFeature

NO_FAULTS = Faults([], 1)


def item(t: torch.Tensor, index: int = 0, id: str | None = None) -> Item:
    return Item(index=index, modality="image", transport="shm", dtype=dtype_name(t.dtype), shape=tuple(t.shape),
                nbytes=t.numel() * t.element_size(), shm_name=f"mmsched_x{index}", id=id)


def test_topology_groups_ranks_by_host_leader_first():
    topo = Topology(2, hosts=["b", "a", "a", "c", "b"], host_groups={})
    assert topo.is_remote
    assert topo.remote_hosts == {"a": [1, 2], "c": [3]}
    assert topo.remote_ranks == [1, 2, 3]
    assert topo.by_host() == {"host0": [0, 4], "host1": [1, 2], "host2": [3]}
    assert not Topology(4, hosts=["b", "a", "a", "c", "b"], host_groups={}).is_remote


def ship_and_fill(monkeypatch, tensors, errors, ids=None):
    """Leader ``ship`` to one remote host, its sends captured; the remote rank's ``fill``."""
    sent: list[tuple[torch.Tensor, int]] = []
    monkeypatch.setattr(torch.distributed, "send", lambda t, dst: sent.append((t.clone(), dst)))
    topo = Topology(0, hosts=["a", "b"], host_groups={})
    keys = [(i, j) for i, ts in enumerate(tensors) for j in range(len(ts))]
    shipped = remote.ship(topo, keys, tensors, errors)
    (sizes, d0), (head, d1), *rest = sent
    assert d0 == d1 == 1 and all(d == 1 for _, d in rest)
    flat = rest[0][0] if rest else torch.empty(0, dtype=torch.uint8)
    assert sizes.tolist() == [head.numel(), flat.numel()]
    opened = [[ForwardedFeature(item(t, j, (ids or {}).get((i, j))), f"r{i}", NO_FAULTS)
               for j, t in enumerate(ts)] for i, ts in enumerate(tensors)]
    remote.fill(opened, keys, msgpack.unpackb(head.numpy().tobytes()), flat)
    return opened, shipped


def test_odd_sized_items_arrive_viewable_as_their_dtype(monkeypatch):
    g = torch.Generator().manual_seed(0)
    tensors = [[torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g), torch.randn(5, 7, generator=g)],
               [torch.ones(1, dtype=torch.bool), torch.randn(3, 3, dtype=torch.float64, generator=g),
                torch.randn(2, 5, generator=g).to(torch.bfloat16), torch.arange(7, dtype=torch.int16),
                torch.empty(0, 4), torch.arange(3, dtype=torch.float64)]]
    opened, shipped = ship_and_fill(monkeypatch, tensors, {})
    for ts, feats in zip(tensors, opened):
        for t, f in zip(ts, feats):
            got = f.materialize()
            assert got.dtype == t.dtype and torch.equal(got, t)
    # the metric counts feature bytes, not the alignment padding
    assert shipped == sum(t.numel() * t.element_size() for ts in tensors for t in ts)


def test_a_request_the_leader_could_not_read_fails_on_the_remote_rank_with_the_reason(monkeypatch):
    tensors = [[torch.ones(4)], [], [torch.zeros(2, 2)]]
    errors = {1: "FileNotFoundError: [Errno 2] No such file or directory: '/dev/shm/mmsched_gone'"}
    keys_tensors = [tensors[0], [torch.ones(1)], tensors[2]]  # request 1's item exists only in the header
    sent: list = []
    monkeypatch.setattr(torch.distributed, "send", lambda t, dst: sent.append(t.clone()))
    keys = [(0, 0), (1, 0), (2, 0)]
    remote.ship(Topology(0, ["a", "b"], {}), keys, tensors, errors)
    opened = [[ForwardedFeature(item(t, 0), f"r{i}", NO_FAULTS)] for i, (t,) in enumerate(keys_tensors)]
    remote.fill(opened, keys, msgpack.unpackb(sent[1].numpy().tobytes()), sent[2])
    assert torch.equal(opened[0][0].materialize(), torch.ones(4))
    assert torch.equal(opened[2][0].materialize(), torch.zeros(2, 2))
    with pytest.raises(Exception, match="not received from the leader's host.*FileNotFoundError"):
        opened[1][0].materialize()


def test_a_feature_a_session_may_keep_does_not_pin_the_batch_buffer(monkeypatch):
    big, small = torch.randn(256, 256), torch.randn(4)
    opened, _ = ship_and_fill(monkeypatch, [[big], [small]], {}, ids={(1, 0): "img"})
    kept = opened[1][0].materialize()
    assert torch.equal(kept, small)
    assert kept.untyped_storage().nbytes() == small.numel() * small.element_size()
    # one without an id is a view: no copy on the hot path
    view = opened[0][0].materialize()
    assert view.untyped_storage().nbytes() > math.prod(big.shape) * big.element_size()
