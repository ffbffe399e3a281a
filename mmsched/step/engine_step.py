"""The engine step as the runner takes it: call any engine, inject the drills, agree.

The engine only computes. Around it the runner turns a raised step or a bad return into
per-request errors, applies the ``engine`` and ``stall`` drills, reads the leader's late
aborts, and agrees all of it across ranks in one collective (two when something failed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np

from .. import consensus
from ..engine import Engine, EngineRequest
from ..errors import InjectedFault, describe
from ..faults import Faults
from ..protocol import Request


def engine_requests(reqs: list[Request], tensors: list[list], live: list[int]) -> list[EngineRequest]:
    """What the engine sees of the surviving requests: ids, features, no transport details.

    A feature a session keeps (an item with an ``id``, or a ``session`` ref) reaches the
    engine as a copy: an engine that writes into its input must not change what later
    turns read."""
    out = []
    for i in live:
        r = reqs[i]
        features = [_own(it, t) for it, t in zip(r.items, tensors[i])] if r.items else []  # text: no zips
        out.append(EngineRequest(r.rid, r.type, r.input_ids.astype(np.int64), features,
                                 [it.modality for it in r.items], r.max_new_tokens, r.params))
    return out


def _own(item, t):
    return t.clone() if item.id is not None or item.transport == "session" else t


def _sendable(out):
    """The output map, or the TypeError a client would otherwise never see: the leader sends
    outputs as MessagePack, and one it cannot encode must fail that request, not the loop."""
    try:
        msgpack.packb(out, use_bin_type=True)
    except Exception as exc:  # noqa: BLE001 - anything the encoder refuses
        return TypeError(f"engine output cannot be sent as MessagePack: {describe(exc)}")
    return out


def call(engine: Engine, requests: list[EngineRequest]) -> list:
    """One entry per request, an output map or an Exception; a raising step fails them all here."""
    try:
        outs = engine.step(requests)
        if not isinstance(outs, list) or len(outs) != len(requests):
            raise TypeError(f"engine step returned {type(outs).__name__} of {len(outs) if hasattr(outs, '__len__') else '?'}"
                            f" entries for {len(requests)} requests")
    except Exception as exc:  # noqa: BLE001 - the engine's failure, this rank's only
        return [exc] * len(requests)
    return [o if isinstance(o, Exception) else _sendable(o) if isinstance(o, dict)
            else TypeError(f"engine returned {type(o).__name__}, not a map") for o in outs]


def local_flags(requests: list[EngineRequest], outs: list, faults: Faults) -> tuple[np.ndarray, dict[int, str]]:
    """This rank's flag per request (FAILED where it failed or an ``engine`` drill hits)."""
    flags = np.zeros(len(requests), dtype=np.int64)
    errors: dict[int, str] = {}
    for j, (req, out) in enumerate(zip(requests, outs)):
        if faults.hit("engine", req.rid):
            out = InjectedFault(f"injected engine fault on rank {faults.rank}")
        if isinstance(out, Exception):
            flags[j], errors[j] = consensus.FAILED, describe(out)
    return flags, errors


@dataclass
class Stepped:
    verdict: consensus.Verdict  # over the requests given to the engine
    outputs: list               # per request: its output map where the verdict is ok, else None
    failures: int               # requests that failed on this rank
    agree_s: float              # seconds of the agreement


def run_engine(group, engine: Engine, faults: Faults, stall_s: float, requests: list[EngineRequest],
               aborted: Callable[[int], str | None]) -> Stepped:
    """Step, drills, late aborts, agreement.

    ``aborted(j)`` is the leader's word on request j, asked right before the agreement so an
    abort that arrived during the step counts: "early" (seen before a step that skipped the
    materialization consensus; wins over a failure), "late", or None."""
    outs = call(engine, requests)
    flags, errors = local_flags(requests, outs, faults)
    if any(faults.hit("stall", r.rid) for r in requests):
        time.sleep(stall_s)  # a drill: this rank holds its peers inside the agreement
    for j in range(len(requests)):
        why = aborted(j)
        if why == "early" or (why and not flags[j]):
            flags[j] = consensus.ABORTED
            errors.pop(j, None)
    t0 = time.perf_counter()
    verdict = consensus.agree(group, flags, errors)
    return Stepped(verdict, [o if verdict.ok(j) else None for j, o in enumerate(outs)],
                   int((flags == consensus.FAILED).sum()), time.perf_counter() - t0)
