"""Multi-host forwarding as the step sees it: one role object per rank, chosen once.

``Local`` (every rank on the leader's host, and any group without remote hosts) opens
items itself and ships nothing; ``Shipper`` (the leader, with ranks on other hosts) sends
what it read once per remote host; ``Receiver`` (a rank on another host) opens host-bound
items as ``ForwardedFeature`` and fills them from the leader's shipment. The runner calls
``open`` at step 1 and ``ship`` after step 2, the same two calls on every rank.
"""

from __future__ import annotations

from typing import Callable

from .. import remote
from ..faults import Faults
from ..metrics import RankCounters
from ..remote import ForwardedFeature, Topology
from ..transport.cuda_ipc import acknowledge
from .features import Materialized


class Local:
    def __init__(self, topo: Topology, faults: Faults):
        self.topo, self.faults = topo, faults

    def open(self, reqs, open_local: Callable) -> list[list]:
        return [[open_local(it, r) for it in r.items] for r in reqs]

    def ship(self, reqs, m: Materialized, counters: RankCounters) -> None:
        pass


class Shipper(Local):
    def ship(self, reqs, m: Materialized, counters: RankCounters) -> None:
        keys = remote.host_bound(reqs)
        if not keys:
            return
        counters.bytes_forwarded += remote.ship(self.topo, keys, m.tensors, m.errors)
        for i, j in keys:
            if reqs[i].items[j].transport == "cuda_ipc":  # remote ranks never touch the pool
                acknowledge(reqs[i].items[j], self.topo.remote_ranks, reqs[i].rid)


class Receiver(Local):
    def open(self, reqs, open_local: Callable) -> list[list]:
        opened = [[ForwardedFeature(it, r.rid, self.faults) if it.transport in remote.HOST_BOUND
                   else open_local(it, r) for it in r.items] for r in reqs]
        keys = remote.host_bound(reqs)
        if keys:  # the leader's bytes, once per host
            remote.fill(opened, keys, *remote.receive(self.topo))
        return opened


def forwarding(topo: Topology, faults: Faults) -> Local:
    """The role of this rank (``topo.rank``) in forwarding."""
    if topo.is_remote:
        return Receiver(topo, faults)
    if topo.rank == 0 and topo.remote_hosts:
        return Shipper(topo, faults)
    return Local(topo, faults)
