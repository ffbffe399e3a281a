"""How many collectives one batch costs at tp = 2: a real gloo group of two rank processes
running ``BatchRunner`` with the reference engine, every collective counted.

Before the engine plug-in a text-only batch paid three: the batch broadcast, the
consensus all-gather and the engine's all-gather (the flags rode in it). The plug-in split
made the runner agree engine failures itself, after the step. Now the reference engine
gathers through ``EngineContext.gather``, which carries that agreement, and a batch
without feature items skips the materialization consensus: a text-only batch pays two
(the broadcast and one all-gather), a batch with a feature three.
"""

from __future__ import annotations

import os

import numpy as np

from ..conftest import two_ranks

TEXT_ONLY = 2  # the broadcast + the engine's gather carrying the agreement (3 before EngineContext.gather)


class CountingGroup:
    """Our Group, every collective counted by name."""

    def __init__(self, inner, counts: dict):
        self.inner, self.counts = inner, counts
        self.rank, self.world = inner.rank, inner.world

    def _count(self, name: str, *args):
        self.counts[name] = self.counts.get(name, 0) + 1
        return getattr(self.inner, name)(*args)

    def broadcast(self, payload):
        return self._count("broadcast", payload)

    def all_gather(self, payload):
        return self._count("all_gather", payload)

    def all_gather_object(self, obj):
        return self._count("all_gather_object", obj)

    def step_begins(self):
        return self.inner.step_begins()

    def step_done(self, steps, gathered):  # no collective: a word in the batch ring, or (here, no
        return self.inner.step_done(steps, gathered)  # ring) one point-to-point message a follower


def _batches():
    from mmsched.batch import Batch
    from mmsched.protocol import Item, Request

    def req(rid, items=()):
        return Request(rid=rid, type="generate", input_ids=np.arange(1, 6, dtype="<i4"), items=list(items),
                       max_new_tokens=4)

    inline = Item(index=0, modality="image", transport="inline", dtype="float32", shape=(4,), nbytes=16,
                  payload=bytes(range(16)))
    return {"text": Batch(1, [req("t1"), req("t2")]), "feature": Batch(2, [req("t3"), req("f1", [inline])])}


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch.distributed as dist

    import mmsched.group
    from mmsched.batch import Batch, BatchRunner
    from mmsched.config import Config
    from mmsched.faults import NO_FAULTS
    from mmsched.group import GlooGroup
    from mmsched.server import start_engine
    from mmsched.sessions import SessionStore

    group = GlooGroup(rank, 2, "env://", 60.0)
    counts: dict = {}
    counting = CountingGroup(group, counts)
    engine, gather = start_engine(Config(), group)
    for module, name in ((dist, "all_gather_into_tensor"), (dist, "all_gather_single"), (dist, "all_reduce"),
                         (dist, "broadcast"), (dist, "all_gather"), (mmsched.group, "all_gather")):
        real = getattr(module, name, None)
        if real is not None:  # the engine's own collectives: those on its process group
            def counted(*a, _real=real, _name=name, **kw):
                if kw.get("group") is engine.group or (len(a) == 3 and a[2] is engine.group):
                    counts[f"engine.{_name}"] = counts.get(f"engine.{_name}", 0) + 1
                return _real(*a, **kw)
            setattr(module, name, counted)
    runner = BatchRunner(counting, engine, NO_FAULTS, unlinks=rank == 0,
                         sessions=SessionStore(1 << 20, 16, 16), gather=gather)
    report = {}
    for kind, batch in _batches().items():
        counts.clear()
        payload = runner.group.broadcast(batch.encode() if rank == 0 else None)  # as Leader/Follower do
        results, _ = runner.run(Batch.decode(payload))
        report[kind] = (sum(counts.values()), dict(counts), [(r["status"], r["output"]) for r in results])
    out.put((rank, report))
    group.close()


def test_a_text_only_batch_pays_one_all_gather_the_agreement_riding_in_the_engines():
    reports = dict(two_ranks(_rank))
    for rank, report in reports.items():
        total, counts, _ = report["text"]  # the agreement rides in the engine's gather, on its group
        assert total == TEXT_ONLY and counts == {"broadcast": 1, "engine.all_gather": 1}, (rank, counts)
        total, counts, _ = report["feature"]  # a feature can fail to materialize: one consensus more
        assert total == TEXT_ONLY + 1 and counts.get("all_gather") == 1, (rank, counts)
    leader = reports[0]
    assert [s for s, _ in leader["text"][2]] == [200, 200]
    assert [s for s, _ in leader["feature"][2]] == [200, 200]
    assert all(len(o["output_ids"]) == 4 for _, o in leader["text"][2] + leader["feature"][2])
    assert reports[1]["text"][2] == [], "a follower renders no results"
