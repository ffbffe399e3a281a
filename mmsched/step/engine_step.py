"""The engine step as the runner takes it: call any engine, inject the drills, agree.

The engine only computes. Around it the runner turns a raised step or a bad return into
per-request errors, applies the ``engine`` and ``stall`` drills, reads the leader's late
aborts, and agrees all of it across ranks in one collective (two when something failed).
"""

from __future__ import annotations

import numbers
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import msgpack
import numpy as np
import torch

from .. import consensus
from ..engine import Engine, EngineRequest
from ..errors import GroupBroken, InjectedFault, describe
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
        _encodes_as_reply([out])  # one level up, as the result map holds it
    except Exception as exc:  # noqa: BLE001 - anything the encoder refuses
        return TypeError(f"engine output cannot be sent as MessagePack: {describe(exc)}")
    return out


def _encodes_as_reply(outs: list) -> None:
    """Raise unless the outputs encode at the depth the reply puts them and decode as a
    client decodes them (map keys strings: a 200 with an int key is one it cannot read)."""
    msgpack.unpackb(msgpack.packb(outs, use_bin_type=True), raw=False, strict_map_key=True)


def call(engine: Engine, requests: list[EngineRequest]) -> tuple[list, BaseException | None]:
    """One entry per request, an output map or an Exception (a raising step fails them all
    here), and the exception the step raised, if it did."""
    try:
        outs = engine.step(requests)
    except GroupBroken:
        raise  # a collective inside the step (EngineContext.gather) found the group gone
    except Exception as exc:  # noqa: BLE001 - the engine's failure, this rank's only
        return [exc] * len(requests), exc
    if not isinstance(outs, list) or len(outs) != len(requests):
        wrong = TypeError(f"engine step returned {type(outs).__name__} of "
                          f"{len(outs) if hasattr(outs, '__len__') else '?'} entries for {len(requests)} requests")
        return [wrong] * len(requests), None
    if _all_maps_sendable(outs):  # the usual step: one encoder pass over every output
        return list(outs), None
    return [o if isinstance(o, Exception) else _sendable(o) if isinstance(o, dict)
            else TypeError(f"engine returned {type(o).__name__}, not a map") for o in outs], None


def _all_maps_sendable(outs: list) -> bool:
    """Whether every entry is a map a client can read, found in one encoder pass over them all
    (~0.1 us a request, against ~0.5 for one call each); any doubt goes one by one."""
    if not all(type(o) is dict for o in outs):
        return False
    try:
        _encodes_as_reply(outs)
    except Exception:  # noqa: BLE001 - which one, and why, is the one-by-one check's to say
        return False
    return True


def local_flags(requests: list[EngineRequest], failures: dict[int, BaseException], faults: Faults,
                aborts: Mapping[int, str]) -> tuple[np.ndarray, dict[int, str]]:
    """This rank's flag per request: FAILED where it failed here or an ``engine`` drill hits,
    ABORTED where the leader saw an abort (``aborts``: "early" wins over a failure, "late" does not)."""
    flags = np.zeros(len(requests), dtype=np.int64)
    errors: dict[int, str] = {}
    injected = faults.hits("engine", requests)
    for j in injected | failures.keys():
        out = InjectedFault(f"injected engine fault on rank {faults.rank}") if j in injected else failures[j]
        if out is not None:  # (an engine's ``failed`` may map a row to None: not a failure)
            flags[j], errors[j] = consensus.FAILED, describe(out)
    for j, why in aborts.items():
        if why == "early" or not flags[j]:
            flags[j] = consensus.ABORTED
            errors.pop(j, None)
    return flags, errors


def _no_aborts() -> dict[int, str]:
    """No request is aborted: what an unarmed gather answers."""
    return {}


class FlaggedGather:
    """``EngineContext.gather``: the engine's all-gather, with the runner's agreement in it.

    It runs on the engine's own process group (through shared memory where every rank shares
    the leader's host: ``mmsched.exchange``): a rank whose engine skips its gather (it
    raised first, say) agrees on the runner's group instead, and the two collectives can
    only wait for each other (the lane's deadline breaks the group), never pair up with
    different sizes. Armed for one step; each call gathers the engine's rows together with
    this rank's flags as known then (the failures the engine named so far in the step, the
    drills, the leader's aborts); the last call's verdict is the step's, and the runner's
    own agreement is skipped. A ``failed`` that names no valid row fails every row here,
    still inside the collective: a local mistake must not leave the peers waiting. Each
    gather carries (step, call) and checks every rank's: a rank that called it more or
    less often than its peers (an engine raising between two gathers, say) would pair
    this step's gather with another's, so that is a broken group, never a 200 read from
    another request's rows."""

    def __init__(self, group, faults: Faults, stall_s: float):
        self.group, self.faults, self.stall_s = group, faults, stall_s
        self.requests: list[EngineRequest] = []
        self.aborted: Callable[[], Mapping[int, str]] = _no_aborts
        self.failed: dict[int, BaseException] = {}  # named by the engine in this step's calls so far
        self.thread: int | None = None  # the step's thread while armed; None between steps
        self.verdict: consensus.Verdict | None = None
        self.steps = self.calls = 0  # steps armed so far; gathers in this step
        self.seconds = 0.0
        self.agreed: Callable[[], None] | None = None  # called once, after the step's first gather
        # what broke the step (``agreed`` raised, or a call's collective failed): run_engine raises
        # it after the step, whatever the engine did with it (catching it must not hide it)
        self.broke: BaseException | None = None

    def arm(self, requests: list[EngineRequest], aborted: Callable[[], Mapping[int, str]],
            agreed: Callable[[], None] | None = None) -> None:
        self.steps += 1  # the same count on every rank: every rank runs the same steps
        self.requests, self.aborted, self.failed, self.thread = requests, aborted, {}, threading.get_ident()
        self.verdict, self.calls, self.agreed, self.broke = None, 0, agreed, None

    def disarm(self) -> consensus.Verdict | None:
        """The step is over: let go of its requests, whose features (1 GiB each, maybe) would
        otherwise stay alive on every rank until the next step armed the gather."""
        self.thread, self.requests, self.aborted, self.failed = None, [], _no_aborts, {}
        return self.verdict

    def __call__(self, local: torch.Tensor, failed: Mapping[int, BaseException] | None = None) -> torch.Tensor:
        if self.thread is None or self.thread != threading.get_ident():
            raise RuntimeError("EngineContext.gather is a collective of the step: call it inside step(), "
                               "on step's own thread")
        requests = self.requests
        if not isinstance(local, torch.Tensor) or local.dim() == 0 or local.shape[0] != len(requests):
            shape = tuple(local.shape) if isinstance(local, torch.Tensor) else type(local).__name__
            raise ValueError(f"gather: {shape} is not one row per request ({len(requests)})")
        if local.device.type != "cpu" or local.layout != torch.strided:  # gloo reads the bytes on the CPU
            raise ValueError(f"gather: rows must be a dense CPU tensor, not {local.layout} on {local.device} "
                             f"(pass local.cpu(), or .to_dense())")
        self.failed.update(_named_failures(failed, len(requests)))
        if self.verdict is None and self.faults.hits("stall", requests):
            time.sleep(self.stall_s)  # a drill: this rank holds its peers inside the gather
        flags, errors = local_flags(requests, self.failed, self.faults, self.aborted())
        self.calls += 1  # the stamp: a rank that gathered more or less often than its peers is caught
        t0 = time.perf_counter()
        try:
            self.verdict = consensus.agree(self.group, flags, errors, extra=local, stamp=(self.steps, self.calls))
        except GroupBroken as exc:  # the collective failed: a step that went on would be answered by an
            # earlier call's verdict (or the runner's own agreement), its peers out of step
            if self.broke is None:
                self.broke = GroupBroken(f"EngineContext.gather failed on rank {self.group.rank} ({describe(exc)}) "
                                         f"and the step went on: the ranks' gathers may be out of step")
                self.broke.__cause__ = exc
            raise
        self.seconds = time.perf_counter() - t0  # the last call's: the agreement's time, for /metrics
        if self.agreed is not None:
            agreed, self.agreed = self.agreed, None
            try:
                agreed()
            except BaseException as exc:  # noqa: BLE001 - an engine catching it must not hide it
                self.broke = self.broke or exc
        return self.verdict.extra.reshape(self.group.world, *local.shape)


def _named_failures(failed, n: int) -> dict[int, BaseException]:
    """``failed`` as {row: error}; a map that is not one of rows 0..n-1 fails every row, saying why."""
    if failed is None:
        return {}
    ok = isinstance(failed, Mapping) and all(
        isinstance(k, numbers.Integral) and not isinstance(k, bool) and 0 <= k < n for k in failed)
    if not ok:
        what = f"keys {sorted(map(repr, failed))[:4]}" if isinstance(failed, Mapping) else type(failed).__name__
        err = TypeError(f"EngineContext.gather: failed must map rows 0..{n - 1} to errors, got {what}")
        return dict.fromkeys(range(n), err)
    return {int(k): v for k, v in failed.items()}


@dataclass
class Stepped:
    verdict: consensus.Verdict  # over the requests given to the engine
    outputs: list               # per request: its output map where the verdict is ok, else None
    failures: int               # requests that failed on this rank
    agree_s: float              # seconds of the agreement (where it rode in the engine's gather, that gather's)
    late: dict[int, str]        # the leader's failures after the engine's last gather: 500s of rank 0


def run_engine(group, engine: Engine, faults: Faults, stall_s: float, requests: list[EngineRequest],
               aborted: Callable[[], Mapping[int, str]], gather: FlaggedGather | None = None,
               agreed: Callable[[], None] = lambda: None) -> Stepped:
    """Step, drills, late aborts, agreement.

    ``aborted()`` is the leader's word on the step's requests, asked right before the agreement
    so an abort that arrived during the step counts: {request index: "early" (seen before a
    step that skipped the materialization consensus; wins over a failure) or "late"}. Where the engine
    gathered through ``gather``, its last call carried the agreement; a failure that came
    after it is a 500 of the leader alone (a follower's outputs are never sent), and the
    verdict every rank keeps sessions by stays the agreed one. ``agreed()`` runs once the
    agreement is in (inside the step's first gather, or after the runner's own agreement)."""
    if gather is not None:
        gather.arm(requests, aborted, agreed)
    try:
        outs, raised = call(engine, requests)
    finally:
        verdict = gather.disarm() if gather is not None else None
    if gather is not None and gather.broke is not None:
        raise gather.broke  # publishing the next batches failed, or a gather did: the group is broken
    failures = {j: o for j, o in enumerate(outs) if isinstance(o, Exception)}
    if verdict is not None and raised is not None:  # it may have left its peers inside a later gather
        raise GroupBroken(f"the engine's step raised after EngineContext.gather on rank {group.rank} "
                          f"({describe(raised)}): the ranks' gathers may be out of step")
    if verdict is not None:
        late = {j: f"rank 0: {describe(o)}" for j, o in failures.items() if verdict.ok(j)} if group.rank == 0 else {}
        mine = int((verdict.flags[group.rank] == consensus.FAILED).sum()) + len(late)
        return Stepped(verdict, [o if verdict.ok(j) and j not in late else None for j, o in enumerate(outs)],
                       mine, gather.seconds, late)
    if faults.hits("stall", requests):
        time.sleep(stall_s)  # a drill: this rank holds its peers inside the agreement
    flags, errors = local_flags(requests, failures, faults, aborted())  # aborts read after the stall
    t0 = time.perf_counter()
    verdict = consensus.agree(group, flags, errors)
    agreed()
    return Stepped(verdict, [o if verdict.ok(j) else None for j, o in enumerate(outs)],
                   flags.tolist().count(consensus.FAILED), time.perf_counter() - t0, {})
