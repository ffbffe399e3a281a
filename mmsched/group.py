"""The rank group as the rest of the code sees it: broadcast, all-gather, all-gather-object.

``SoloGroup`` is a group of one (no torch.distributed); ``GlooGroup`` wraps a real gloo
process group; ``RingGroup`` is a ``GlooGroup`` whose broadcast reaches the followers on
the leader's host through a shared-memory ring (``mmsched.ring``: no gloo threads, no
TCP) and only the ranks on other hosts through gloo; where every rank shares that host,
it also gives the engine's gathers a shared-memory all-gather (``mmsched.exchange``).
Every method is a collective and runs on the lane thread only.
"""

from __future__ import annotations

import datetime
import functools
import os
import uuid
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .errors import GroupBroken
from .exchange import Exchange
from .ring import Ring, pid_namespace, visible
from .step_reports import StepReports


class SoloGroup:
    rank, world = 0, 1
    publishes_ahead = False  # a group of one publishes nothing

    def broadcast(self, payload: bytes | None) -> Any:
        return payload

    def all_gather(self, payload: np.ndarray) -> np.ndarray:
        return payload.reshape(1, -1)

    def all_gather_object(self, obj: Any) -> list:
        return [obj]

    def step_begins(self) -> None:
        pass  # no peer to hear from

    def step_done(self, steps: int, gathered: bool) -> None:
        pass  # no peer to wait for

    def close(self) -> None:
        pass


class SubGroup:
    """Collectives on another process group over the same ranks (the engine's own), so a rank
    that calls one where its peer calls the runner's never mixes the two in one collective."""

    def __init__(self, pg, rank: int, world: int, exchange: Exchange | None = None):
        """``exchange``: the same-host all-gather the engine's gathers take instead of gloo."""
        self.pg, self.rank, self.world, self.exchange = pg, rank, world, exchange

    def all_gather(self, payload: np.ndarray) -> np.ndarray:
        if self.exchange is not None:
            return self.exchange.all_gather(payload)
        return all_gather(payload, self.world, self.pg)

    def all_gather_object(self, obj: Any) -> list:
        return all_gather_object(obj, self.world, self.pg)


class GlooGroup(SubGroup):
    """A torch.distributed gloo group; collective errors become GroupBroken."""

    publishes_ahead = False  # its broadcast is a collective: the followers' calls must pair with it

    def __init__(self, rank: int, world: int, init_method: str, timeout_s: float):
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        super().__init__(dist.group.WORLD, rank, world)  # the whole (default) group

    def broadcast(self, payload: bytes | None) -> memoryview:
        """Leader passes bytes, followers None; everyone gets the leader's bytes."""
        return broadcast_bytes(payload, None)

    def engine_exchange(self) -> Exchange | None:
        return None  # without the batch ring, the engine gathers through gloo too

    @functools.cached_property
    def _reports(self) -> StepReports:
        """Every follower's (made at the first step: a ``RingGroup`` around this group has its own)."""
        return StepReports(self.pg, self.rank, list(range(1, self.world)))

    def step_begins(self) -> None:
        self._reports.begin()

    def step_done(self, steps: int, gathered: bool) -> None:
        """Engine step ``steps`` is over on this rank; where its agreement rode in the step's last
        ``ctx.gather`` (``gathered``), the leader waits for each follower's word that its step is
        over too, here a gloo message (``mmsched.step_reports`` says why)."""
        if gathered:
            self._reports.done(steps)

    def close(self) -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def all_gather(payload: np.ndarray, world: int, pg) -> np.ndarray:
    """Every rank's ``payload`` (bytes, as a 1-D uint8 array) on process group ``pg``, stacked:
    [world, n], in a fresh array.

    gloo's collective all-gather, called on the process group itself (skipping
    torch.distributed's Python layer: its checks and group lookups cost ~80 µs of CPU a call
    here). Not a pairwise exchange posted from this thread (session 27's choice, on its
    p50): its calls fall in two groups, most ~0.3 ms and 10-25% ~4 ms (one scheduler tick on
    this host; every call, with each rank pinned to its own CPU), where a plain TCP or pipe
    round trip between the same CPUs takes 20-30 µs. (Why, found in session 49: the thread
    that posts holds the pair's lock, and gloo's transport thread, woken by the peer's
    bytes, only try-locks it and polls again, spinning until a tick when the two share a
    CPU; a rank now runs that thread below itself, ``timeslice.place_gloo_threads``.)
    Measured here (session 29, two rank processes, 3,000 back-to-back calls): pairwise p50
    0.27-0.28 ms, p90 4.0 ms, mean 0.99-1.25 ms; the collective p50 0.33-0.34, p90 0.46-0.47,
    mean 0.44-0.45 ms."""
    try:
        payload = np.ascontiguousarray(payload, dtype=np.uint8)
        out = np.empty((world, payload.size), dtype=np.uint8)
        pg.all_gather_single(torch.from_numpy(out).view(-1), torch.from_numpy(payload)).wait()
        return out
    except RuntimeError as exc:
        raise GroupBroken(f"all_gather failed: {exc}") from exc


def all_gather_object(obj: Any, world: int, pg) -> list:
    try:
        out: list = [None] * world
        dist.all_gather_object(out, obj, group=pg)
        return out
    except RuntimeError as exc:
        raise GroupBroken(f"all_gather_object failed: {exc}") from exc


class RingGroup:
    """A gloo group whose batch broadcast goes through a ring to same-host followers."""

    def __init__(self, gloo: GlooGroup, hosts: list[str], prefix: str, timeout_s: float):
        """Collective, at start-up: the leader creates the ring, its followers map it, then
        the leader unlinks its name (so nothing is left in /dev/shm, whatever happens next)."""
        self.gloo, self.rank, self.world = gloo, gloo.rank, gloo.world
        self._prefix, self._timeout_s, self._exchange = prefix, timeout_s, None
        local = [r for r in range(1, self.world) if hosts[r] == hosts[0]]
        self._local_names = [f"rank {r}" for r in local]
        remote = [r for r in range(1, self.world) if hosts[r] != hosts[0]]
        self._remote = dist.new_group([0, *remote], backend="gloo") if remote else None  # every rank calls it
        self._reports = StepReports(self._remote, [0, *remote].index(self.rank), remote) \
            if remote and (self.rank == 0 or self.rank in remote) else None  # ranks the ring does not reach
        self.ring: Ring | None = None
        if self.rank == 0 and local:
            self.ring = Ring.create(f"{prefix}{os.getpid()}_ring_{uuid.uuid4().hex[:8]}", len(local), timeout_s)
        me = (os.getpid(), pid_namespace(), self.ring.name if self.ring else None)
        peers = gloo.all_gather_object(me)
        problem = None
        if self.rank in local:
            try:
                self.ring = Ring.attach(peers[0][2], len(local), local.index(self.rank), timeout_s)
                self.ring.peers = [visible(peers[0], me)]
            except (OSError, GroupBroken) as exc:
                problem = f"rank {self.rank} cannot map the ring: {exc}"
        problems = [p for p in gloo.all_gather_object(problem) if p]
        if self.rank == 0 and self.ring:
            self.ring.peers = [visible(peers[r], me) for r in local]
            self.ring.unlink()
        if problems:
            self.close()
            raise GroupBroken("; ".join(problems))

    def broadcast(self, payload: bytes | None) -> Any:
        if self.rank == 0:
            if self.ring is not None:
                self.ring.write(payload)
            if self._remote is not None:
                broadcast_bytes(payload, self._remote)
            return payload
        return self.ring.read() if self.ring is not None else broadcast_bytes(None, self._remote)

    @property
    def publishes_ahead(self) -> bool:
        """Whether the leader may publish batches ahead of the one its followers run (where the
        ring has room: ``broadcast_if_room``): not with ranks on other hosts, whose gloo
        broadcast would wait for a rank that may be inside a collective of the batch before."""
        return self._remote is None

    def broadcast_if_room(self, payload: bytes) -> bool:
        """The leader's ``broadcast``, only if it cannot wait: the ring has room for all of it
        now. A follower still running the batch before may be waiting for this rank inside a
        collective: a write that waited for that follower to read would never end."""
        if not (self.publishes_ahead and self.ring.has_room(len(payload))):
            return False
        self.broadcast(payload)
        return True

    def all_gather(self, payload: np.ndarray) -> np.ndarray:
        return self.gloo.all_gather(payload)

    def all_gather_object(self, obj: Any) -> list:
        return self.gloo.all_gather_object(obj)

    def step_done(self, steps: int, gathered: bool) -> None:
        """Engine step ``steps`` is over on this rank (``gathered``: its agreement rode in the
        step's last ``ctx.gather``). A follower on the ring says so; the leader, where its last
        gather was the agreement, waits until each of them has said so before it answers: a
        follower still gathering (a call more than rank 0) would otherwise have a failure it
        names there missed and a 200 sent. Those calls pair one to one up to rank 0's last
        (each carries its (step, call) stamp), so a follower whose step is over made as many.
        Ranks on other hosts say so by a gloo message (``mmsched.step_reports``)."""
        if self.ring is not None:
            if self.rank != 0:
                self.ring.report_step(steps)
            elif gathered:  # else the runner agreed after the step, when every rank had finished it
                self.ring.wait_steps(steps, self._local_names)
        if self._reports is not None and gathered:
            self._reports.done(steps)

    def step_begins(self) -> None:
        if self._reports is not None:
            self._reports.begin()

    def engine_exchange(self) -> Exchange | None:
        """Collective, at start-up: where every rank shares the leader's host, the engine's
        all-gather through shared memory (``mmsched.exchange``); else None (gloo)."""
        if self._remote is None and self._exchange is None:
            self._exchange = Exchange.join(self, self._prefix, self._timeout_s)
        return self._exchange

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self._exchange is not None:
            self._exchange.close()
            self._exchange = None
        self.gloo.close()


FIRST = 32 << 10  # the first broadcast's size: a typical batch fits, so one collective suffices


def broadcast_bytes(payload: bytes | None, pg) -> memoryview:
    """The leader's bytes to every rank of ``pg`` (None: the whole group), over gloo.

    One fixed-size broadcast carries the length and the first bytes; a second one
    follows only for a payload that did not fit."""
    try:
        head = torch.zeros(FIRST, dtype=torch.uint8)
        if payload is not None:
            n = len(payload)
            head[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
            first = min(n, FIRST - 8)
            head.numpy()[8: 8 + first] = np.frombuffer(payload, dtype=np.uint8, count=first)
        dist.broadcast(head, src=0, group=pg)
        n = int(head[:8].view(torch.int64).item())
        if n <= FIRST - 8:
            return memoryview(head.numpy())[8: 8 + n]
        buf = torch.empty(n, dtype=torch.uint8)
        if payload is not None:
            buf.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        dist.broadcast(buf[FIRST - 8:], src=0, group=pg)
        if payload is None:
            buf.numpy()[: FIRST - 8] = head.numpy()[8:]
        return memoryview(buf.numpy())
    except RuntimeError as exc:
        raise GroupBroken(f"broadcast failed: {exc}") from exc

