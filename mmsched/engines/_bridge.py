"""TEMPORARY: the engine plug-in contract of the redesign (issue 12), adapted to today's
``Engine.step(group, batch, flags, faults, aborted)``, so an engine written against the
contract runs end to end before the plug-in runner lands. When ``mmsched/engine.py`` ships
``EngineContext``, ``EngineRequest`` and ``load_engine``, delete this file and import
those names from ``mmsched.engine`` instead (see docs/hf.md, "Before the plug-in lands").
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import consensus
from ..errors import ConfigError, describe


@dataclass(frozen=True)
class EngineContext:
    rank: int
    world: int
    group: object  # torch.distributed ProcessGroup, None at world 1
    seed: int = 0
    options: dict = field(default_factory=dict)


@dataclass
class EngineRequest:
    rid: str
    type: str
    input_ids: np.ndarray
    features: list[torch.Tensor]
    modalities: list[str]
    max_new_tokens: int
    params: dict


def load_engine(spec: str, ctx: EngineContext):
    """'module:factory' -> factory(ctx); errors are ConfigError naming the spec."""
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"engine: cannot load {spec!r}: {describe(exc)}") from exc
    return factory(ctx)


def engine_group(world: int):
    """The group the engine's collectives use. The contract asks for a ``dist.new_group``;
    here it is the default group, which is safe today (the engine runs on the lane thread,
    between the runner's own collectives) and because with a new gloo group, rank 1 of a
    tp=2 HF group aborted at exit ("terminate called without an active exception", exit
    -6) after serving one request; the default group exits 0."""
    if world == 1:
        return None
    import torch.distributed as dist

    return dist.group.WORLD


class BridgeEngine:
    """Today's step around a contract engine: every rank runs every request (the engine's
    collectives need it); faults, stall and the agreement stay here, as in the runner to come."""

    def __init__(self, engine, stall_s: float):
        self.engine, self.stall_s = engine, stall_s

    def step(self, group, batch, flags, faults, aborted=lambda i: False):
        reqs = [EngineRequest(b.request.rid, b.request.type, np.asarray(b.request.input_ids, dtype=np.int64),
                              b.features, [it.modality for it in b.request.items], b.request.max_new_tokens,
                              dict(b.request.params or {})) for b in batch]
        try:
            outs = self.engine.step(reqs)
        except Exception as exc:  # noqa: BLE001 - the whole batch fails on this rank
            outs = [exc] * len(reqs)
        errors: dict[int, str] = {}
        stall = False
        for i, (req, out) in enumerate(zip(reqs, outs)):
            try:
                faults.check("engine", req.rid)
            except Exception as exc:  # noqa: BLE001
                out = exc
            if isinstance(out, Exception) and not flags[i]:
                flags[i], errors[i] = consensus.FAILED, describe(out)
            try:
                faults.check("stall", req.rid)
            except Exception:  # noqa: BLE001
                stall = True
        if stall:
            time.sleep(self.stall_s)
        for i in range(len(reqs)):
            if not flags[i] and aborted(i):
                flags[i] = consensus.ABORTED
        verdict = consensus.agree(group, flags, errors)
        if group.rank != 0:
            return [None] * len(reqs), verdict
        return [outs[i] if verdict.ok(i) else None for i in range(len(reqs))], verdict


def bridged(cfg, rank: int, world: int) -> BridgeEngine:
    """server.py's one call: the engine ``cfg.engine`` names, behind today's step."""
    ctx = EngineContext(rank, world, engine_group(world), cfg.seed, dict(cfg.engine_options))
    return BridgeEngine(load_engine(cfg.engine, ctx), cfg.stall_s)
