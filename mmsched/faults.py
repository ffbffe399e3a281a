"""Fault injection (``--fault RANK:STAGE:RID_GLOB``): make one rank fail one stage on purpose.

Used by tests and failure drills. ``release`` faults are raised and logged like a real
close/unlink failure, after which the real release still runs, so a drill leaves
/dev/shm clean while proving the request's result does not depend on its release.
``engine`` and ``stall`` are injected by the runner around any engine (step/engine_step.py),
which knows nothing of faults: ``engine`` makes the rank report that request failed;
``stall`` makes it sleep (``stall_s``) after the engine step, before the runner's
agreement, holding its peers inside it: the drill for slow collectives and the deadline.
``hold`` makes the rank sleep (``stall_s``) while materializing that request, before the
leader looks for its abort: the drill for a request caught between broadcast and consensus.
``corrupt`` flips the first byte of each feature the rank materializes (a copy: shared
buffers stay intact): the drill for ranks holding different bytes, which ``want_digest``
turns into a 500 ``DigestMismatch``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from .errors import ConfigError, InjectedFault

STAGES = ("open", "materialize", "release", "engine", "stall", "hold", "corrupt")


@dataclass(frozen=True)
class Fault:
    rank: int
    stage: str
    rid_glob: str

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        parts = spec.split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in STAGES or not parts[2]:
            raise ConfigError(f"fault: {spec!r} is not RANK:STAGE:RID_GLOB with STAGE in {'|'.join(STAGES)}")
        return cls(int(parts[0]), parts[1], parts[2])

    def __str__(self) -> str:
        return f"{self.rank}:{self.stage}:{self.rid_glob}"


class Faults:
    """The faults that apply to one rank; ``check`` raises where one matches."""

    def __init__(self, faults: list[Fault], rank: int):
        self._by_stage: dict[str, list[str]] = {}
        for f in faults:
            if f.rank == rank:
                self._by_stage.setdefault(f.stage, []).append(f.rid_glob)
        self.rank = rank

    def hit(self, stage: str, rid: str) -> bool:
        globs = self._by_stage.get(stage)
        return bool(globs) and any(fnmatch.fnmatchcase(rid, g) for g in globs)

    def hits(self, stage: str, requests) -> frozenset[int]:
        """The indices of ``requests`` (anything with a ``rid``) that a fault of ``stage``
        hits: at once, without a look at them, where none is set (every batch, every rank)."""
        if stage not in self._by_stage:
            return frozenset()
        return frozenset(j for j, r in enumerate(requests) if self.hit(stage, r.rid))

    def check(self, stage: str, rid: str) -> None:
        if self.hit(stage, rid):
            raise InjectedFault(f"injected {stage} fault on rank {self.rank}")

    def __bool__(self) -> bool:
        return bool(self._by_stage)


NO_FAULTS = Faults([], -1)
