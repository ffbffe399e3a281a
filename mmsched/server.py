"""Start a rank: process group, lane, engine, role, signals.

``mmsched serve`` runs rank 0 in-process for tp=1; for tp=N the launcher (launcher.py)
starts N rank processes, each running ``run_rank``. Under torchrun (RANK/WORLD_SIZE set)
it runs the one rank it was given.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import log
from .affinity import pin_rank, ranges
from .batch import BatchRunner
from .config import Config
from .descriptors import reserve_descriptors
from .engine import Engine, EngineContext, load_engine
from .errors import ConfigError, describe
from .faults import NO_FAULTS, Faults
from .group import GlooGroup, RingGroup, SoloGroup, SubGroup
from .lane import Lane
from .launcher import die_with_launcher, ignore_late_signals, outlive_launcher
from .log import event
from .rank import Follower, Leader
from .remote import Topology
from .sessions import SessionStore
from .step.engine_step import FlaggedGather
from .timeslice import place_gloo_threads, request_slice, thread_ids
from .transport import Transports


def run_rank(cfg: Config, rank: int, world: int) -> int:
    """Run one rank to completion; returns its exit code (0 clean, 3 group broken)."""
    _prepare_process(cfg, rank, world)
    try:
        reserve_descriptors(cfg, rank)
    except ConfigError as exc:
        event("config_error", logging.ERROR, error=str(exc))
        return 2
    before_groups = thread_ids()  # gloo's threads are the ones started from here on
    try:
        group, topology = _join_group(cfg, rank, world)
    except Exception as exc:
        if rank == 0 and _store_port_taken(exc):  # a conflict like a taken frontend: exit 2 now, and the
            event("config_error", logging.ERROR,  # launcher stops the followers (they would retry for 30 s+)
                  error=f"dist_init: {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} is in use: "
                        "rank 0 serves the group's rendezvous store there")
            return 2
        event("group_init_failed", logging.ERROR, error=describe(exc))
        return 3
    _announce(cfg, rank, world, topology)
    faults = Faults(cfg.faults, rank)
    try:
        engine, gather = start_engine(cfg, group, faults)
    except ConfigError as exc:
        event("config_error", logging.ERROR, error=str(exc))
        return 2
    except Exception as exc:  # the engine's group, or the agreement on it, failed
        event("group_init_failed", logging.ERROR, error=describe(exc))
        return 3
    outlive_launcher(rank)  # the group and its engine are up
    if world > 1 and place_gloo(cfg, before_groups) == 0:  # ranks that mostly wait
        event("gloo_loops_not_found", logging.WARNING, thread="gloo_tcp_loop")
    lane = make_lane(cfg)
    runner = BatchRunner(group, engine, faults, unlinks=(rank == 0),
                         sessions=SessionStore(cfg.session_max_bytes, cfg.session_max_count, cfg.session_max_features),
                         topology=topology, stall_s=cfg.stall_s, transports=Transports(rank, world, faults),
                         gather=gather)
    settle_heap()
    try:
        code = _run_loop(cfg, runner, lane, rank, world)
    except ConfigError as exc:  # found only when binding: a port in use, a socket path not writable
        event("config_error", logging.ERROR, error=str(exc))
        code = 2
    if code != 0 or lane.inside_call:  # a second signal leaves the lane inside its collective
        logging.shutdown()
        os._exit(code)  # a lane thread may be stuck inside gloo: do not wait for it, nor close
        # the process group under it (gloo then calls std::terminate: SIGABRT, a core dump)
    ignore_late_signals()
    lane.close()
    runner.transports.closer.flush()  # big segments' descriptors handed off: closed before the exit
    group.close()
    if world > 1:  # a launched rank: leave now, not through the interpreter's teardown, which
        # destroys the engine's gloo group with its threads still joinable (std::terminate at
        # exit: a tp=2 HF group's rank 1 exited -6 under load, the launcher 250)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def settle_heap() -> None:
    """Move what start-up built (torch, numpy, the engine: ~10^5 objects) out of the cycle
    collector's reach. Left in, every full collection walks all of it while the loop waits:
    at tp=1 the collector took 8% of the leader's time under load, 0.6 s in 8 s; frozen, 1%
    (issue 13's note). What the loop allocates from here on is collected as before."""
    gc.collect()
    gc.freeze()


def make_lane(cfg: Config) -> Lane:
    """The rank's collective lane, its torch thread count set on the lane thread itself."""
    return Lane(cfg.collective_timeout, on_start=lambda: torch.set_num_threads(cfg.torch_threads))


def place_process(cfg: Config, world: int, env=os.environ) -> tuple[list[int] | str | None, str | None]:
    """How a rank runs, set before any thread of ours or gloo's starts (they inherit it): its
    CPUs, torch's threads, the GIL switch interval, its scheduler slice. The benchmarks'
    ranks call it too, so they run as served ranks do. Returns what ``pin_rank`` said and
    why the slice was refused (None: it was not)."""
    pinned = pin_rank(cfg.cpu_affinity, world, env)  # first: the threads started from here on inherit it
    torch.set_num_threads(cfg.torch_threads)
    # A thread woken from a collective (the lane, out of gloo or the ring) needs the GIL back
    # from the loop thread, which gives it up only every switch interval while it decodes or
    # answers (tp=2 here, 0.5 ms against 5: p99 at 1000 req/s 6.3 -> 5.4 ms; docs/operations.md).
    sys.setswitchinterval(cfg.gil_switch_us / 1e6)
    # torch's flight recorder keeps a Python traceback of every collective (one all-gather a
    # batch here), for dumps mmsched never asks for: off, unless the operator set it
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")
    return pinned, request_slice(cfg.sched_slice_us)


def place_gloo(cfg: Config, since: set[int]) -> int | None:
    """Once the process groups are made: gloo's TCP loop threads started after ``since``
    (``thread_ids()`` taken before the groups) run below the rank, and its workers without
    wake-up preemption, as a rank that asks for a scheduler slice runs them
    (``timeslice.place_gloo_threads``); how many loop threads, None where no slice is asked
    for. The benchmarks' ranks call it too."""
    return place_gloo_threads(since, cfg.sched_slice_us) if cfg.sched_slice_us > 0 else None


def _prepare_process(cfg: Config, rank: int, world: int = 1) -> None:
    """Logging, how the rank runs (``place_process``), signals (followers leave the decision
    to the leader), the launcher's death."""
    log.setup(rank, cfg.log_format, cfg.log_level)
    pinned, refused = place_process(cfg, world)
    if isinstance(pinned, str):
        event("cpu_affinity_refused", logging.WARNING, reason=pinned)
    elif pinned is not None:
        event("rank_cpus", cpus=ranges(pinned))
    if refused:
        event("sched_slice_refused", logging.WARNING, slice_us=cfg.sched_slice_us, reason=refused)
    if rank > 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_launcher(rank)


def _join_group(cfg: Config, rank: int, world: int):
    """The rank group (gloo, then the same-host ring, for tp > 1) and which ranks share the leader's host."""
    group = SoloGroup() if world == 1 else GlooGroup(rank, world, "env://", cfg.collective_timeout)
    topology = Topology.single() if world == 1 else Topology.discover(rank, world)
    if world > 1:
        if cfg.batch_ring:  # on by default: +21% at tp=2 text-only (sync client), issue 13's note
            group = RingGroup(group, topology.hosts, cfg.shm_prefix, cfg.collective_timeout)
    return group, topology


def _announce(cfg: Config, rank: int, world: int, topology: Topology) -> None:
    """Log ranks on other hosts, and on the leader any active fault (a drill must never pass for a
    real failure, nor a typo for a drill)."""
    if topology.remote_hosts:
        event("topology", hosts=topology.by_host(), remote_ranks=topology.remote_ranks)
    if rank == 0 and cfg.fault:
        idle = [str(f) for f in cfg.faults if f.rank >= world]
        event("faults_active", logging.WARNING, faults=",".join(cfg.fault), stall_s=cfg.stall_s,
              **({"never_fire": ",".join(idle)} if idle else {}))


def start_engine(cfg: Config, group, faults: Faults = NO_FAULTS) -> tuple[Engine, FlaggedGather]:
    """The engine of ``cfg.engine`` with its own process group over all ranks (gloo; None at
    world 1), and its ``EngineContext.gather`` on that group, or through shared memory where
    every rank shares the leader's host (``RingGroup.engine_exchange``); the runner's
    agreement rides in it. Whether every rank built the engine is agreed (one collective at start), so a
    factory that fails on one rank stops them all with exit 2 rather than leaving the
    others waiting."""
    world = group.world
    engine_group = None if world == 1 else dist.new_group(
        list(range(world)), backend="gloo", timeout=timedelta(seconds=cfg.collective_timeout))
    gather = FlaggedGather(SoloGroup() if world == 1 else SubGroup(engine_group, group.rank, world,
                                                                   group.engine_exchange()),
                           faults, cfg.stall_s)
    ctx = EngineContext(rank=group.rank, world=world, group=engine_group, seed=cfg.seed,
                        options=dict(cfg.engine_options), gather=gather)
    engine, problem = None, None
    t0 = time.monotonic()
    event("engine_loading", engine=cfg.engine)  # a factory may load weights for minutes: say so
    try:
        engine = load_engine(cfg.engine, ctx)
        event("engine_ready", engine=cfg.engine, seconds=round(time.monotonic() - t0, 3))
    except ConfigError as exc:
        problem = f"rank {group.rank}: {exc}"
    problems = [p for p in group.all_gather_object(problem) if p]
    if problems:
        raise ConfigError("; ".join(problems))
    return engine, gather


def _run_loop(cfg: Config, runner: BatchRunner, lane: Lane, rank: int, world: int) -> int:
    async def main() -> int:
        if rank == 0:
            role = Leader(cfg, runner, lane, world)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, role.request_stop)
        else:
            role = Follower(cfg, runner, lane)
        return await role.serve()

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main())
    return uvloop.run(main())


def _store_port_taken(exc: BaseException) -> bool:
    """Rank 0 could not bind the rendezvous store's port (torch says so in its message alone)."""
    return isinstance(exc, dist.DistNetworkError) and "failed to listen" in str(exc) and "EADDRINUSE" in str(exc)
