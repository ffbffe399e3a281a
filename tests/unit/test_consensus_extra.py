"""consensus.agree's ``extra``: every rank's tensor comes back bit for bit, whatever its dtype,
size or layout (an engine's rows ride in the agreement's all-gather). Two ranks in one
process: each rank's payload is gathered for real bytes, as gloo would stack them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmsched import consensus


class TwoRanks:
    """The all-gather of two ranks run one after the other: rank 1 leaves its payload, rank 0
    gets both, stacked (a fresh array each call, as the gloo group's is)."""

    def __init__(self):
        self.payloads: dict[int, np.ndarray] = {}

    def rank(self, r: int):
        pair = self

        class Group:
            rank, world = r, 2

            def all_gather(self, payload):
                pair.payloads[r] = payload.copy()
                return np.stack([pair.payloads.get(0, payload), pair.payloads.get(1, payload)])

        return Group()


def agree_both(extras, flags=(None, None), errors=({}, {})):
    """Rank 1 then rank 0; rank 0's verdict (it saw both payloads)."""
    pair = TwoRanks()
    n = extras[0].shape[0]
    for r in (1, 0):
        f = np.zeros(n, dtype=np.int64) if flags[r] is None else np.asarray(flags[r])
        v = consensus.agree(pair.rank(r), f, errors[r], extra=extras[r], stamp=(5, 1))
    return v


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        a.contiguous().view(torch.uint8).numpy().tobytes() == b.contiguous().view(torch.uint8).numpy().tobytes()


CASES = {
    "float64 rows": lambda r: torch.from_numpy(np.random.default_rng(r).random((3, 32))),
    "float32, an odd count (rank 1's row starts 4 bytes off)": lambda r: torch.tensor([[r + 0.5], [float("nan")], [-0.0]]),
    "uint8, odd (flags of rank 1 unaligned)": lambda r: torch.arange(5, dtype=torch.uint8).reshape(5, 1) + r,
    "complex128 (16-byte items), an even batch": lambda r: torch.tensor([[1 + 2j * r], [3.5 - 1j]], dtype=torch.complex128),
    "complex128, an odd batch (rank 1's row 8 bytes into an item)": lambda r: torch.tensor(
        [[1 + 2j * r, 0.5j], [3.5 - 1j, -0.0], [r, 2]], dtype=torch.complex128),
    "complex128, one request": lambda r: torch.tensor([[1 + 2j * r]], dtype=torch.complex128),
    "a conjugate view": lambda r: torch.tensor([[1 + 2j * r, 3 - 1j]], dtype=torch.complex64).conj(),
    "a negative view": lambda r: torch.tensor([[1 + 2j * r, 3 - 1j]], dtype=torch.complex64).conj().imag,
    "bfloat16 (no numpy dtype)": lambda r: torch.tensor([[1.5, r], [2.0, -3.0]], dtype=torch.bfloat16),
    "int16, three dimensions": lambda r: torch.arange(24, dtype=torch.int16).reshape(2, 3, 4) * (r + 1),
    "non-contiguous": lambda r: torch.arange(12, dtype=torch.float64).reshape(3, 4).t() + r,
    "no bytes a row": lambda r: torch.empty((4, 0), dtype=torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_extra_comes_back_bit_for_bit(case):
    extras = [CASES[case](0), CASES[case](1)]
    v = agree_both(extras)
    n = extras[0].shape[0]
    want = torch.stack([e.resolve_conj().resolve_neg().contiguous() for e in extras]).reshape(2, n, -1)
    assert same_bits(v.extra, want)
    assert v.extra.numpy().flags.aligned if v.extra.dtype != torch.bfloat16 else True
    assert [v.ok(i) for i in range(n)] == [True] * n


def test_the_rows_are_the_verdicts_own():
    """A later agreement does not change an earlier verdict's rows (the engine may keep them)."""
    first = agree_both([torch.ones(2, 3, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64)])
    kept = first.extra.clone()
    agree_both([torch.full((2, 3), 7.0, dtype=torch.float64)] * 2)
    assert torch.equal(first.extra, kept)


def test_failures_and_their_messages_ride_beside_an_odd_sized_extra():
    extras = [torch.arange(3, dtype=torch.uint8).reshape(3, 1), torch.arange(3, dtype=torch.uint8).reshape(3, 1)]
    v = agree_both(extras, flags=([0, 0, 0], [0, consensus.FAILED, 0]),
                   errors=({}, {1: "FileNotFoundError: /dev/shm/x"}))
    assert [v.ok(i) for i in range(3)] == [True, False, True]
    assert v.message(1) == "rank 1: FileNotFoundError: /dev/shm/x"


def test_ranks_out_of_step_are_a_broken_group():
    pair = TwoRanks()
    consensus.agree(pair.rank(1), np.zeros(1, dtype=np.int64), {}, stamp=(5, 2))
    with pytest.raises(consensus.GroupBroken, match=r"out of step.*\[\[5, 1\], \[5, 2\]\]"):
        consensus.agree(pair.rank(0), np.zeros(1, dtype=np.int64), {}, stamp=(5, 1))
