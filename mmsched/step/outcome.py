"""What happened to each request of a batch: typed outcomes, one pure ``decide``, and ``render``.

``decide`` is the only place that orders the stages: aborted > failed > refused > digest
mismatch > aborted during the engine step > engine failed > ok. It runs on every rank (a
rank keeps a session's features only for an ``Ok``); ``render`` turns an outcome into the
wire result and runs on the leader only, which alone sends results.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..consensus import Verdict
from ..protocol import ABORTED, INTERNAL, OK, UNAVAILABLE, result

MATERIALIZE, ENGINE = "materialize", "engine"
HEADLINE = {MATERIALIZE: "Multimodal feature reconstruction failed", ENGINE: "Engine step failed"}


@dataclass(frozen=True, slots=True)
class Ok:
    output: dict
    digests: list[str] | None  # the request's item digests, when it asked for them


@dataclass(frozen=True, slots=True)
class Aborted:
    stage: str


@dataclass(frozen=True, slots=True)
class Failed:
    stage: str
    ranks: list[int]
    detail: str  # "rank 1: Type: message; ..." — every failed rank, once
    agreed_ok: bool = False  # every rank agreed it ran (the leader failed it after the engine's
    # last gather): sessions keep its features on every rank, so they stay the same everywhere


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str


Outcome = Ok | Aborted | Failed | Refused


@dataclass
class Gate:
    """What is known before the engine step, the same on every rank."""

    n: int
    verdict: Verdict | None          # the materialization consensus; None: skipped (no feature items)
    refused: dict[int, str]          # session bounds: request -> why (503)
    mismatch: list[list[int]]        # per request, the ranks whose digests differ from rank 0's

    def passed(self, i: int) -> bool:
        v = self.verdict
        return (v is None or v.ok(i)) and i not in self.refused and not self.mismatch[i]

    def survivors(self) -> list[int]:
        """The requests the engine runs, in batch order."""
        return [i for i in range(self.n) if self.passed(i)]


def _before_engine(gate: Gate, i: int) -> Outcome | None:
    v = gate.verdict
    if v is not None and v.aborted(i):
        return Aborted(MATERIALIZE)
    if v is not None and not v.ok(i):
        return Failed(MATERIALIZE, v.failed_ranks(i), v.message(i))
    if i in gate.refused:
        return Refused(gate.refused[i])
    if gate.mismatch[i]:
        return Failed(MATERIALIZE, gate.mismatch[i], "; ".join(
            f"rank {r}: DigestMismatch: bytes differ from rank 0's" for r in gate.mismatch[i]))
    return None


def decide(gate: Gate, engine: Verdict | None, outputs: list, digests: list[list[str] | None],
           early_aborts: frozenset[int] = frozenset(), late: dict[int, str] | None = None) -> list[Outcome]:
    """One outcome per request. ``engine``, ``outputs`` and ``late`` are indexed by survivor
    (see ``Gate.survivors``); ``early_aborts`` are the requests the leader saw aborted before a
    step that skipped the materialization consensus (agreed after the step, still reported
    as stage "materialize"); ``late``, the leader's failures after the engine's last gather."""
    late = late or {}
    out: list[Outcome] = []
    j = 0
    for i in range(gate.n):
        early = _before_engine(gate, i)
        if early is not None:
            out.append(early)
            continue
        if engine.aborted(j):
            out.append(Aborted(MATERIALIZE if i in early_aborts else ENGINE))
        elif not engine.ok(j):
            out.append(Failed(ENGINE, engine.failed_ranks(j), engine.message(j)))
        elif j in late:
            out.append(Failed(ENGINE, [0], late[j], agreed_ok=True))
        else:
            out.append(Ok(outputs[j], digests[i]))
        j += 1
    return out


def render(rid: str, outcome: Outcome, world: int) -> dict:
    """The wire result of one outcome (leader only)."""
    if isinstance(outcome, Ok):
        meta = {"ranks": world}
        if outcome.digests is not None:
            meta["digests"] = outcome.digests
        return result(rid, OK, output=outcome.output, meta=meta)
    if isinstance(outcome, Aborted):
        return result(rid, ABORTED, "aborted by client", meta={"stage": outcome.stage})
    if isinstance(outcome, Refused):
        return result(rid, UNAVAILABLE, outcome.reason)
    return result(rid, INTERNAL, f"{HEADLINE[outcome.stage]} ({outcome.detail})",
                  meta={"failed_ranks": outcome.ranks, "stage": outcome.stage})
