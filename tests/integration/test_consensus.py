"""The failure consensus over a real gloo group of 2 rank processes: error strings ride in the
flags' all-gather, and what every rank agrees is the 500 message a client reads.

- a long error is cut at ``ERR_WIDTH`` bytes with a marker, on a character boundary;
- a non-ASCII error arrives intact;
- more failures on one rank than the gather has slots still name every error (the
  second, object gather), and every rank agrees the same messages;
- the extra tensor (the engine's shards, digest prefixes) arrives bit for bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mmsched import consensus

from ..conftest import free_port

LONG = "ValueError: " + "ü" * 400        # 812 bytes of UTF-8: cut
SNOW = "KeyError: '☃ schneemann'"           # non-ASCII, short: intact
MANY = consensus.ERR_SLOTS + 3


def _rank(rank: int, port: int, out) -> None:
    import torch

    torch.set_num_threads(1)
    from mmsched.group import GlooGroup

    group = GlooGroup(rank, 2, f"tcp://127.0.0.1:{port}", timeout_s=30)
    seen = {}
    # 1. one batch of 3: rank 1 fails 0 (long) and 2 (non-ASCII); rank 0 fails 2 too
    flags = np.array([1, 0, 1] if rank == 1 else [0, 0, 1])
    errors = {0: LONG, 2: SNOW} if rank == 1 else {2: "OSError: leader side"}
    extra = torch.tensor([[rank + 0.5, -1e-30], [7.25, rank], [float("inf"), 3.0]], dtype=torch.float32)
    v = consensus.agree(group, flags, errors, extra)
    seen["small"] = ([v.message(i) for i in range(3)], [v.ok(i) for i in range(3)], v.extra.tolist())
    # 2. rank 1 fails more requests than the gather has slots for
    flags = np.ones(MANY, dtype=np.int64) if rank == 1 else np.zeros(MANY, dtype=np.int64)
    errors = {i: f"RuntimeError: number {i} ✓" for i in range(MANY)} if rank == 1 else {}
    v = consensus.agree(group, flags, errors)
    seen["many"] = [v.message(i) for i in range(MANY)]
    out.put((rank, seen))
    group.close()


@pytest.fixture(scope="module")
def verdicts() -> dict:
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_rank, args=(free_port(), out), nprocs=2, join=True)
    return dict(out.get() for _ in range(2))


def test_every_rank_agrees_the_same_messages(verdicts):
    assert verdicts[0] == verdicts[1]


def test_long_error_is_cut_with_a_marker_and_non_ascii_survives(verdicts):
    messages, ok, _ = verdicts[0]["small"]
    assert ok == [False, True, False]
    cut = messages[0]
    assert cut.startswith("rank 1: ValueError: üü") and cut.endswith(consensus.TRUNCATED)
    assert len(cut[len("rank 1: "):].encode()) <= consensus.ERR_WIDTH
    assert "\ufffd" not in cut  # cut on a character boundary, no half character
    assert messages[1] == ""
    assert messages[2] == f"rank 0: OSError: leader side; rank 1: {SNOW}"


def test_extra_rides_bit_for_bit(verdicts):
    extra = verdicts[0]["small"][2]
    for rank in (0, 1):
        assert extra[rank] == [[rank + 0.5, np.float32(-1e-30).item()], [7.25, rank], [float("inf"), 3.0]]


def test_more_failures_than_slots_still_name_each_error(verdicts):
    assert verdicts[0]["many"] == [f"rank 1: RuntimeError: number {i} ✓" for i in range(MANY)]
