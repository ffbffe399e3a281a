"""The engine plug-in contract: what a model sees of mmsched, and how mmsched finds it.

An engine is any object with ``step(requests) -> outputs``, built by a factory named on
the command line (``--engine module:factory``) that receives an ``EngineContext``. The
runner calls ``step`` on every rank with the same requests in the same order; agreeing
failures and aborts across ranks, fault drills and rendering results are the runner's
job, so an engine needs nothing of mmsched beyond this module. See docs/engines.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import numpy as np
import torch

from .errors import ConfigError, describe


@dataclass(frozen=True)
class EngineContext:
    rank: int                 # this rank, 0..world-1
    world: int                # tp size
    group: "torch.distributed.ProcessGroup | None"  # the engine's own gloo group over all ranks; None at world 1
    seed: int                 # cfg.seed
    options: dict             # cfg.engine_options: the [engine_options] table, passed through
    # The runner's all-gather, for an engine whose step has one cross-rank gather anyway:
    # ``gather(local, failed)`` with ``local`` [n, ...] (one row per request of the step; a dense CPU tensor) and
    # ``failed`` {request index: exception} returns every rank's ``local`` as [world, n, ...],
    # and the runner's agreement on failures and aborts rides in it, so the step costs no
    # collective of its own (docs/engines.md). None where the runner gives none (tests).
    gather: "Callable[[torch.Tensor, Mapping[int, BaseException] | None], torch.Tensor] | None" = None


@dataclass
class EngineRequest:
    rid: str
    type: str                 # "generate" | "embed"
    input_ids: np.ndarray     # int64, 1-D
    features: list[torch.Tensor]   # materialized features, one per mm_item, request order
    modalities: list[str]     # the items' modality, same order
    max_new_tokens: int
    params: dict              # the request's params map, as sent


class Engine(Protocol):
    def step(self, requests: list[EngineRequest]) -> list[dict | Exception]:
        """Same requests, same order, on every rank (the runner guarantees it). Returns one
        entry per request: the output map (msgpack-able; e.g. {"output_ids": [...]} or
        {"embedding": bytes, "dim": int}) or an Exception for a request that failed on this
        rank. Raising from step fails the whole batch on this rank (each request gets that
        error). Only rank 0's outputs are sent to clients."""


def resolve(spec: str) -> Callable[[EngineContext], Engine]:
    """'module:factory' -> the factory, imported; ConfigError naming the spec and what failed."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"engine: {spec!r} is not module:factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a missing module or one that fails to import
        raise ConfigError(f"engine: {spec!r}: cannot import {module_name!r} ({describe(exc)})") from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ConfigError(f"engine: {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ConfigError(f"engine: {spec!r}: {attr!r} is not callable")
    return factory


def load_engine(spec: str, ctx: EngineContext) -> Engine:
    """'module:factory' -> factory(ctx). Errors are ConfigError naming the spec."""
    factory = resolve(spec)
    try:
        engine = factory(ctx)
    except Exception as exc:  # noqa: BLE001 - any failure to build is the operator's to fix
        raise ConfigError(f"engine: {spec!r}: the factory raised {describe(exc)}") from None
    if not callable(getattr(engine, "step", None)):
        raise ConfigError(f"engine: {spec!r}: the factory returned {type(engine).__name__}, which has no step()")
    return engine
