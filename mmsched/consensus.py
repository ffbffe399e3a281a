"""The batched agreement: one all-gather per batch tells every rank which ranks failed which requests.

Each rank contributes one flag per request (0 ok, 1 failed here, 2 aborted — only the
leader sets 2, so an abort is agreed like any failure). Error strings travel only in a
batch with a failure, in one more collective. An optional ``extra`` tensor rides in the
same all-gather (the engine's shards, digest prefixes), so agreeing costs nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

OK, FAILED, ABORTED = 0, 1, 2


@dataclass
class Verdict:
    flags: np.ndarray                    # [world, n]
    errors: list[dict[int, str]] | None  # per rank: request index -> "Type: message"
    extra: torch.Tensor | None           # [world, n, k], gathered alongside
    _ok: list = field(init=False, repr=False)       # per request, computed once per batch
    _aborted: list = field(init=False, repr=False)  # (not one numpy call per request and question)

    def __post_init__(self) -> None:
        self._ok = (~self.flags.any(axis=0)).tolist()
        self._aborted = (self.flags[0] == ABORTED).tolist()

    def ok(self, i: int) -> bool:
        return self._ok[i]

    def aborted(self, i: int) -> bool:
        return self._aborted[i]

    def failed_ranks(self, i: int) -> list[int]:
        return [int(r) for r in np.flatnonzero(self.flags[:, i] == FAILED)]

    def message(self, i: int) -> str:
        """``rank 0: FileNotFoundError: ...; rank 1: ...`` — every failed rank, once."""
        errs = self.errors or []
        return "; ".join(f"rank {r}: {errs[r].get(i, 'unknown error') if r < len(errs) else 'unknown error'}"
                         for r in self.failed_ranks(i))


def agree(group, flags: np.ndarray, errors: dict[int, str], extra: torch.Tensor | None = None) -> Verdict:
    """One collective for the batch (two when something failed). Runs on the lane."""
    n = len(flags)
    dtype = extra.dtype if extra is not None else torch.int64
    local = torch.from_numpy(np.ascontiguousarray(flags, dtype=np.int64)).to(dtype).reshape(n, 1)
    if extra is not None:
        local = torch.cat([local, extra.reshape(n, -1)], dim=1)
    gathered = group.all_gather(local)
    all_flags = gathered[:, :, 0].to(torch.int64).numpy()
    all_errors = group.all_gather_object(errors) if (all_flags == FAILED).any() else None
    return Verdict(all_flags, all_errors, gathered[:, :, 1:] if extra is not None else None)


def agree_per_request(group, flags: np.ndarray, errors: dict[int, str]) -> Verdict:
    """The reference systems' way, for bench/consensus.py: one all_gather_object per request."""
    world = group.world
    all_flags = np.zeros((world, len(flags)), dtype=np.int64)
    all_errors: list[dict[int, str]] = [{} for _ in range(world)]
    for i, f in enumerate(flags):
        for r, (flag, err) in enumerate(group.all_gather_object((int(f), errors.get(i)))):
            all_flags[r, i] = flag
            if err is not None:
                all_errors[r][i] = err
    return Verdict(all_flags, all_errors, None)
