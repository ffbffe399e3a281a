"""The feature steps of a batch: open, materialize, agree, release.

Errors stay data: an item that cannot be opened or read is a flag and a message for the
consensus, never an exception out of the step, so every rank takes the same collectives.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .. import consensus
from ..errors import describe
from ..faults import Faults
from ..metrics import RankCounters
from ..protocol import Request
from ..transport.shm import Owner


def digest_prefix(digests: list[str]) -> int:
    """8 bytes standing for a request's item digests, to compare across ranks in the consensus."""
    h = hashlib.sha256("".join(digests).encode()).digest()
    return int.from_bytes(h[:8], "little", signed=True)


@dataclass
class Materialized:
    """One rank's view of a batch after step 2, per request."""

    n: int
    flags: np.ndarray = field(init=False)
    errors: dict[int, str] = field(default_factory=dict)
    tensors: list[list[torch.Tensor]] = field(init=False)
    digests: list[list[str] | None] = field(init=False)
    prefixes: np.ndarray = field(init=False)  # [n, 1] int64 (numpy: no torch op for a text-only batch)

    def __post_init__(self) -> None:
        self.flags = np.zeros(self.n, dtype=np.int64)
        self.tensors = [[] for _ in range(self.n)]
        self.digests = [None] * self.n
        self.prefixes = np.zeros((self.n, 1), dtype=np.int64)

    @property
    def aborted(self) -> frozenset[int]:
        return frozenset(i for i, f in enumerate(self.flags.tolist()) if f == consensus.ABORTED)


def materialize(reqs: list[Request], opened: list[list], faults: Faults, stall_s: float,
                is_aborted: Callable[[Request], bool], counters: RankCounters) -> Materialized:
    """Read every feature into owned memory; digest where asked. A failure is recorded, never raised."""
    m = Materialized(len(reqs))
    holds = faults.hits("hold", reqs)
    for i, (req, feats) in enumerate(zip(reqs, opened)):
        if i in holds:  # a drill: a slow rank between broadcast and consensus
            time.sleep(stall_s)
        if is_aborted(req):
            m.flags[i] = consensus.ABORTED
            continue
        if not feats and not req.want_digest:  # text only: nothing to read
            continue
        try:
            m.tensors[i] = [f.materialize() for f in feats]
            if req.want_digest:
                m.digests[i] = [hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy()).hexdigest()
                                for t in m.tensors[i]]
                m.prefixes[i, 0] = digest_prefix(m.digests[i])
        except Exception as exc:  # noqa: BLE001 - errors are data until the consensus
            m.flags[i], m.errors[i] = consensus.FAILED, describe(exc)
            m.tensors[i] = []
            counters.failures["open" if any(f.error for f in feats) else "materialize"] += 1
    return m


def agree(group, m: Materialized) -> tuple[consensus.Verdict, list[list[int]]]:
    """One collective: the verdict, and per request the ranks whose digests differ from rank 0's."""
    verdict = consensus.agree(group, m.flags, m.errors, extra=torch.from_numpy(m.prefixes))
    prefixes = verdict.extra[:, :, 0]
    differs = (prefixes != prefixes[0:1]).numpy()
    mismatch: list[list[int]] = [[] for _ in range(m.n)]
    for i in np.flatnonzero(differs.any(axis=0)).tolist():  # per request, once per batch
        mismatch[i] = [int(r) for r in np.flatnonzero(differs[:, i])]
    return verdict, mismatch


def unlink_always(name: str, close: Callable[[bool], bool]) -> bool:
    """The owner where no request outside the batch can hold a segment: unlink it now."""
    return close(True)


def release(opened: list[list], unlinks: bool, counters: RankCounters, owner: Owner = unlink_always) -> None:
    """Every rank closes; the leader (``unlinks``) unlinks each owned segment once, unless a
    request outside the batch still holds it (``owner`` decides, then closes: that
    request's turn to unlink it, later)."""
    seen: set[str] = set()
    for feats in opened:
        for f in feats:
            name = f.item.owned_segment
            first = name is not None and name not in seen
            if first:
                seen.add(name)
            ok = owner(name, lambda unlink, f=f: f.release(unlink=unlink)) if unlinks and first \
                else f.release(unlink=False)
            if ok is False:
                counters.release_failures += 1
            counters.segments_unlinked += getattr(f, "unlinked", False)
