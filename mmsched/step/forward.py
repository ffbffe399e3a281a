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
from ..metrics import RankCounters
from ..remote import Topology
from ..transport import Transports
from .features import Materialized


class Local:
    def __init__(self, topo: Topology, transports: Transports):
        self.topo, self.transports = topo, transports

    def open(self, reqs, open_local: Callable) -> list[list]:
        return [[open_local(it, r) for it in r.items] for r in reqs]

    def ship(self, reqs, m: Materialized, counters: RankCounters) -> None:
        pass


class Shipper(Local):
    READ_INTO = ("shm", "memfd")  # transports whose read can land in a slot of the shipment

    def __init__(self, topo: Topology, transports: Transports):
        super().__init__(topo, transports)
        # the batch's host-bound items and its shipment, from ``open`` to ``ship``
        self._keys: list[tuple[int, int]] = []
        self._shipment: remote.Shipment | None = None

    def open(self, reqs, open_local: Callable) -> list[list]:
        """Host-bound items that travel in message 0 are read straight into their slots of this
        batch's shipment (no copy when shipping), except items a session may keep: a kept view
        would pin the whole shipment."""
        self._keys = keys = remote.host_bound(reqs)
        if not keys:
            self._shipment = None
            return super().open(reqs, open_local)
        items = [reqs[i].items[j] for i, j in keys]
        self._shipment = shipment = remote.Shipment([it.nbytes for it in items], self.transports.buffers)
        into = {key: shipment.slot(k) for k, (key, it) in enumerate(zip(keys, items))
                if it.transport in self.READ_INTO and it.id is None}
        return [[open_local(it, r, into.get((i, j))) for j, it in enumerate(r.items)] for i, r in enumerate(reqs)]

    def ship(self, reqs, m: Materialized, counters: RankCounters) -> None:
        keys, shipment, self._keys, self._shipment = self._keys, self._shipment, [], None
        if not keys:
            return
        payloads = [m.tensors[i][j] if i not in m.errors and m.tensors[i]
                    else m.errors.get(i, "aborted before it was read") for i, j in keys]
        counters.bytes_forwarded += remote.ship(self.topo, shipment.layout.sizes, payloads, self.transports.buffers,
                                                shipment)
        for i, j in keys:
            if reqs[i].items[j].transport == "cuda_ipc":  # remote ranks never touch the pool
                self.transports.acknowledge(reqs[i].items[j], self.topo.remote_ranks, reqs[i].rid)


class Receiver(Local):
    def open(self, reqs, open_local: Callable) -> list[list]:
        opened = [[self.transports.forwarded(it, r.rid) if it.transport in remote.HOST_BOUND
                   else open_local(it, r) for it in r.items] for r in reqs]
        keys = remote.host_bound(reqs)
        if keys:  # the leader's bytes, once per host
            got = remote.receive(self.topo, [reqs[i].items[j].nbytes for i, j in keys], self.transports.buffers)
            for (i, j), bytes_or_reason in zip(keys, got):
                opened[i][j].receive(bytes_or_reason)
        return opened


def forwarding(topo: Topology, transports: Transports) -> Local:
    """The role of this rank (``topo.rank``) in forwarding."""
    if topo.is_remote:
        return Receiver(topo, transports)
    if topo.rank == 0 and topo.remote_hosts:
        return Shipper(topo, transports)
    return Local(topo, transports)
