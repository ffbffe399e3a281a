"""One batch's life on a rank, as pure-ish steps run on the lane: open, materialize, agree,
release, engine, results. The same code runs on every rank; only ``unlinks`` differs.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from . import consensus
from .engine import Engine, EngineInput
from .errors import describe
from .faults import Faults
from .log import event
from . import remote
from .metrics import RankCounters
from .remote import Topology
from .protocol import ABORTED, INTERNAL, OK, UNAVAILABLE, Request, result
from .protocol.batch import Batch  # noqa: F401 - moved; the lead removes this at merge
from .sessions import Pending, SessionStore
from .transport import Transports


def digest_prefix(digests: list[str]) -> int:
    """8 bytes standing for a request's item digests, to compare across ranks in the consensus."""
    h = hashlib.sha256("".join(digests).encode()).digest()
    return int.from_bytes(h[:8], "little", signed=True)


class BatchRunner:
    """Runs one batch on this rank. ``is_aborted`` is the leader's view of client aborts."""

    PRUNE_EVERY_S = 1.0  # how often idle cached pools are checked against their files

    def __init__(self, group, engine: Engine, faults: Faults, unlinks: bool, sessions: SessionStore,
                 is_aborted=lambda req: False, topology: Topology | None = None,
                 transports: Transports | None = None):
        self.group, self.engine, self.faults = group, engine, faults
        self.topology = topology or Topology.single()
        self.unlinks, self.sessions, self.is_aborted = unlinks, sessions, is_aborted
        self.counters = RankCounters()
        self.transports = transports or Transports(group.rank, group.world, faults)  # this rank's caches
        self._next_prune = 0.0

    def exchange_counters(self) -> dict[int, dict]:
        """A collective: every rank's counter snapshot, by rank (the leader keeps them for /metrics)."""
        return dict(enumerate(self.group.all_gather_object(self.counters.snapshot())))

    def _lookup(self, session_id: str | None):
        return lambda ref: self.sessions.lookup(session_id, ref)

    def tidy(self) -> None:
        """At most once a second: close cached pools whose owner removed or replaced them."""
        if (now := time.monotonic()) >= self._next_prune:
            self._next_prune = now + self.PRUNE_EVERY_S
            self.transports.tidy()

    def run(self, batch: Batch) -> tuple[list[dict], float | None]:
        """Results (built on every rank, sent by the leader) and the consensus's seconds.

        Runs for every batch, heartbeats included, so idle ranks still drop stale pools."""
        self.tidy()
        reqs = batch.requests
        n = len(reqs)
        for sid in batch.closes:  # 0. sessions closed or idle, in stream order
            self.sessions.close(sid)
        if not reqs:
            return [], None
        # 1. open every feature; errors stay on the feature
        rank, world, topo = self.group.rank, self.group.world, self.topology
        forwarded = remote.host_bound(reqs) if topo.remote_hosts else []
        opened = [[self.transports.forwarded(it, r.rid) if topo.is_remote and it.transport in remote.HOST_BOUND
                   else self.transports.open(it, r.rid, self._lookup(r.session_id))
                   for it in r.items] for r in reqs]
        if forwarded and topo.is_remote:  # 1b. remote host: the leader's bytes, once per host
            remote.fill(opened, forwarded, *remote.receive(topo))
        # 2. materialize into owned memory; a failure is recorded, never raised
        flags = np.zeros(n, dtype=np.int64)
        errors: dict[int, str] = {}
        tensors: list[list[torch.Tensor]] = [[] for _ in range(n)]
        digests: list[list[str]] = [[] for _ in range(n)]
        prefixes = torch.zeros(n, 1, dtype=torch.int64)
        for i, (req, feats) in enumerate(zip(reqs, opened)):
            if self.faults.hit("hold", req.rid):  # a drill: a slow rank between broadcast and consensus
                time.sleep(getattr(self.engine, "stall_s", 0.0))
            if self.is_aborted(req):
                flags[i] = consensus.ABORTED
                continue
            try:
                tensors[i] = [f.materialize() for f in feats]
                if req.want_digest:
                    digests[i] = [hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy()).hexdigest()
                                  for t in tensors[i]]
                    prefixes[i, 0] = digest_prefix(digests[i])
            except Exception as exc:
                flags[i], errors[i] = consensus.FAILED, describe(exc)
                tensors[i] = []
                self.counters.failures["open" if any(f.error for f in feats) else "materialize"] += 1
        if forwarded and rank == 0:  # 2b. the leader ships what it read to the other hosts
            self.counters.bytes_forwarded += remote.ship(topo, forwarded, tensors, errors)
            for i, j in forwarded:
                if reqs[i].items[j].transport == "cuda_ipc":  # remote ranks never touch the pool
                    self.transports.acknowledge(reqs[i].items[j], topo.remote_ranks, reqs[i].rid)
        # 3. agree: one collective; the barrier before anyone unlinks
        t0 = time.perf_counter()
        verdict = consensus.agree(self.group, flags, errors, extra=prefixes)
        consensus_s = time.perf_counter() - t0
        mismatch = (verdict.extra[:, :, 0] != verdict.extra[0:1, :, 0]).numpy()
        mismatched = mismatch.any(axis=0).tolist()  # per request, once per batch
        # 4. release: every rank closes, the leader unlinks each owned segment once
        seen: set[str] = set()
        for feats in opened:
            for f in feats:
                name = f.item.owned_segment
                first = name is not None and name not in seen
                if first:
                    seen.add(name)
                if f.release(unlink=self.unlinks and first) is False:
                    self.counters.release_failures += 1
                self.counters.segments_unlinked += getattr(f, "unlinked", False)
        # 5. engine step on what survived everywhere (its own collective agrees late aborts)
        refused = self._session_overflow(reqs, tensors, [i for i in range(n) if verdict.ok(i)])
        live = [i for i in range(n) if verdict.ok(i) and not mismatched[i] and i not in refused]
        slot = {i: j for j, i in enumerate(live)}
        if live:
            eflags = np.array([consensus.ABORTED if self.is_aborted(reqs[i]) else 0 for i in live], dtype=np.int64)
            inputs = [EngineInput(reqs[i], tensors[i]) for i in live]
            outputs, everdict = self.engine.step(self.group, inputs, eflags, self.faults,
                                                 aborted=lambda j: self.is_aborted(reqs[live[j]]))
            self.counters.failures["engine"] += int((everdict.flags[rank] == consensus.FAILED).sum())
        # 6. results (built on every rank, sent by the leader)
        results = []
        for i, req in enumerate(reqs):
            if verdict.aborted(i):
                results.append(result(req.rid, ABORTED, "aborted by client", meta={"stage": "materialize"}))
            elif not verdict.ok(i):
                ranks = verdict.failed_ranks(i)
                results.append(result(req.rid, INTERNAL,
                                      f"Multimodal feature reconstruction failed ({verdict.message(i)})",
                                      meta={"failed_ranks": ranks, "stage": "materialize"}))
            elif i in refused:
                results.append(result(req.rid, UNAVAILABLE, refused[i]))
            elif mismatched[i]:
                ranks = [int(r) for r in np.flatnonzero(mismatch[:, i])]
                results.append(result(req.rid, INTERNAL, "Multimodal feature reconstruction failed ("
                                      + "; ".join(f"rank {r}: DigestMismatch: bytes differ from rank 0's"
                                                  for r in ranks) + ")",
                                      meta={"failed_ranks": ranks, "stage": "materialize"}))
            else:
                j = slot[i]
                if everdict.aborted(j):
                    results.append(result(req.rid, ABORTED, "aborted by client", meta={"stage": "engine"}))
                elif not everdict.ok(j):
                    results.append(result(req.rid, INTERNAL, f"Engine step failed ({everdict.message(j)})",
                                          meta={"failed_ranks": everdict.failed_ranks(j), "stage": "engine"}))
                else:
                    self._keep_session_features(req, tensors[i])
                    meta = {"ranks": self.group.world}
                    if req.want_digest:
                        meta["digests"] = digests[i]
                    results.append(result(req.rid, OK, output=outputs[j], meta=meta))
        for req in reqs:
            if req.session_id is not None:
                self.sessions.touch(req.session_id)
        for i, msg in errors.items():
            event("feature_failed", logging.DEBUG, rid=reqs[i].rid, error=msg)
        return results, consensus_s

    @staticmethod
    def _new_session_features(req: Request, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        if req.session_id is None:
            return {}
        return {it.id: t for it, t in zip(req.items, tensors) if it.id is not None and it.transport != "session"}

    def _session_overflow(self, reqs: list[Request], tensors, ok: list[int]) -> dict[int, str]:
        """Turns whose new session features would pass a bound: refused (503), same on every rank."""
        refused, pending = {}, Pending()
        for i in ok:
            new = self._new_session_features(reqs[i], tensors[i])
            why = self.sessions.refusal(reqs[i].session_id, new, pending) if new else None
            if why:
                refused[i] = why
        return refused

    def _keep_session_features(self, req: Request, tensors: list[torch.Tensor]) -> None:
        new = self._new_session_features(req, tensors)
        if new:
            self.sessions.put(req.session_id, new)
