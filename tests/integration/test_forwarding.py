"""The shipment over a real gloo group of 3 rank processes: rank 0 on host "a", ranks 1 and 2
on host "b" (``Topology.build`` makes the same subgroups as at start-up: the link {0, 1} and
the host group {1, 2}). For each batch the leader ``ship``s, both remote ranks ``receive``;
every item's bytes must equal what the leader shipped, on rank 1 (received) and rank 2
(re-broadcast within its host), and an item the leader failed must fail with its reason.
The servers' path, end to end with a client's digests: test_multihost.py."""

from __future__ import annotations

import hashlib
import os
import socket

import pytest
import torch

from mmsched.remote import BIG, INLINE_REASONS

WHY = "FileNotFoundError: [Errno 2] No such file or directory: '/dev/shm/mmsched_gone'"


def _batches() -> dict[str, tuple[list[torch.Tensor], dict[int, str]]]:
    """name -> (the leader's tensors, the items it failed to read and why); the same on every rank."""
    g = torch.Generator().manual_seed(5)
    return {
        "one": ([torch.randn(16, 16, generator=g)], {}),
        "zero-bytes": ([torch.empty(0), torch.arange(3, dtype=torch.int16), torch.empty(0, 2)], {}),
        "failed-between": ([torch.randn(5, generator=g), torch.randn(9, generator=g), torch.randn(2, generator=g)],
                           {1: WHY}),
        "many": ([torch.randint(-9, 9, (k % 11,), dtype=torch.int32, generator=g) for k in range(200)],
                 {k: f"ValueError: {k}" for k in range(3, 200, 50)}),
        # reasons longer than remote.INLINE_REASONS: they follow message 0 as a message of their own
        "long-reasons": ([torch.randn(k + 1, generator=g) for k in range(40)],
                         {k: f"{WHY} (item {k})" for k in range(0, 40, 2)}),
        "big": ([torch.randint(0, 255, (BIG + 5,), dtype=torch.uint8, generator=g), torch.randn(3, generator=g),
                 torch.randn(BIG // 4, generator=g).to(torch.bfloat16), torch.randn(BIG // 8, generator=g)],
                {3: "OSError: short read"}),
    }


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _rank(rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    from mmsched import remote
    from mmsched.group import GlooGroup
    from mmsched.transport.buffers import Buffers

    group = GlooGroup(rank, 3, f"tcp://127.0.0.1:{port}", timeout_s=30)
    topo = remote.Topology.build(rank, ["a", "b", "b"])
    buffers = Buffers()
    seen = {}
    for name, (tensors, failed) in _batches().items():
        sizes = [t.numel() * t.element_size() for t in tensors]
        if rank == 0:
            sent = remote.ship(topo, sizes, [failed.get(k, t) for k, t in enumerate(tensors)], buffers)
            seen[name] = sent
        else:
            got = remote.receive(topo, sizes, buffers)
            seen[name] = [g if isinstance(g, str) else _sha(g) for g in got]  # small: through a pipe
    out.put((rank, seen))
    group.close()


@pytest.fixture(scope="module")
def received() -> dict:
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_rank, args=(port, out), nprocs=3, join=True)
    return dict(out.get() for _ in range(3))


@pytest.mark.parametrize("name", list(_batches()))
def test_both_remote_ranks_hold_the_leaders_bytes_or_its_reason(received, name):
    tensors, failed = _batches()[name]
    for rank in (1, 2):
        got = received[rank][name]
        assert len(got) == len(tensors)
        for k, t in enumerate(tensors):
            want = failed.get(k, _sha(t))
            assert got[k] == want, (rank, name, k)
    # the metric: feature bytes of the items the leader read, once for the one remote host
    assert received[0][name] == sum(t.numel() * t.element_size() for k, t in enumerate(tensors) if k not in failed)


def test_the_long_reasons_batch_really_needs_a_message_of_its_own():
    """So the batch above tests the path past the inline room (one more collective)."""
    import msgpack

    _, failed = _batches()["long-reasons"]
    short = {k: v for k, v in list(failed.items())[:3]}
    assert len(msgpack.packb(failed)) > INLINE_REASONS >= len(msgpack.packb(short))
