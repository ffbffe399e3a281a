"""Ranks on other hosts: who can see the leader's shared memory, and how the others get the bytes.

A rank's *host* is the shared memory it can see: the kernel's boot id and the device of
/dev/shm. Ranks that share the leader's attach shm / CUDA IPC features as usual. For the
others, the leader ships the bytes it already read (read once) with the batch: one
point-to-point transfer to the lowest rank of each remote host, which re-broadcasts to
the other ranks of its host over a host-local subgroup. So each remote host receives a
feature once, however many of its ranks need it. A failure to read on the leader's host
or to receive on a remote one is recorded on the feature (``transport.ForwardedFeature``)
like any other: the consensus sees it and the 500 names the rank.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import msgpack
import torch

HOST_BOUND = ("shm", "cuda_ipc", "memfd")  # transports that only reach ranks on the client's host
ALIGN = 8  # forwarded items start at multiples of this in the shipped buffer (the widest dtype)


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def host_id() -> str:
    """Ranks with the same id see the same /dev/shm (same kernel, same tmpfs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = socket.gethostname()
    return f"{boot}:{os.stat('/dev/shm').st_dev}"


@dataclass
class Topology:
    """Which rank is on which host; the same on every rank (all-gathered at start)."""

    rank: int
    hosts: list[str]
    host_groups: dict[str, object]  # remote host -> its subgroup (only where it has > 1 rank)

    @property
    def is_remote(self) -> bool:
        return self.hosts[self.rank] != self.hosts[0]

    @property
    def remote_hosts(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for r, h in enumerate(self.hosts):
            if h != self.hosts[0]:
                out.setdefault(h, []).append(r)
        return out

    @property
    def remote_ranks(self) -> list[int]:
        return [r for ranks in self.remote_hosts.values() for r in ranks]

    def by_host(self) -> dict[str, list[int]]:
        """Ranks per host, for ping and /health (host ids shortened)."""
        names: dict[str, str] = {}
        for h in self.hosts:
            names.setdefault(h, f"host{len(names)}")
        return {names[h]: [r for r, x in enumerate(self.hosts) if x == h] for h in names}

    @classmethod
    def single(cls) -> "Topology":
        return cls(0, [host_id()], {})

    @classmethod
    def discover(cls, rank: int, world: int) -> "Topology":
        """Collective, at start-up: every rank tells where it is; subgroups for remote hosts."""
        import torch.distributed as dist

        hosts: list = [None] * world
        dist.all_gather_object(hosts, host_id())
        groups = {}
        seen: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            seen.setdefault(h, []).append(r)
        for h, ranks in seen.items():  # every rank creates every subgroup, in the same order
            if h != hosts[0] and len(ranks) > 1:
                groups[h] = dist.new_group(ranks, backend="gloo")
        return cls(rank, hosts, groups)


def host_bound(reqs) -> list[tuple[int, int]]:
    """(request, item) indexes of the batch's items that remote ranks must be sent."""
    return [(i, j) for i, r in enumerate(reqs) for j, it in enumerate(r.items) if it.transport in HOST_BOUND]


def ship(topo: Topology, keys: list[tuple[int, int]], tensors, errors: dict[int, str]) -> int:
    """Leader: send each remote host the bytes of ``keys`` (or why not); returns feature bytes sent.

    Items lie back to back in one buffer, each padded to ``ALIGN`` bytes so that a remote
    rank can view its slice as any dtype."""
    import torch.distributed as dist

    header, parts, sent = [], [], 0
    for i, j in keys:
        t = tensors[i][j] if i not in errors and tensors[i] else None
        if t is None:
            header.append(errors.get(i, "aborted before it was read"))
        else:
            raw = t.reshape(-1).view(torch.uint8).cpu()  # a CUDA device's copy travels from host memory
            header.append(raw.numel())
            parts.append(raw)
            sent += raw.numel()
            if _padded(raw.numel()) > raw.numel():
                parts.append(torch.zeros(_padded(raw.numel()) - raw.numel(), dtype=torch.uint8))
    head = torch.frombuffer(bytearray(msgpack.packb(header)), dtype=torch.uint8)
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    sizes = torch.tensor([head.numel(), flat.numel()], dtype=torch.int64)
    for ranks in topo.remote_hosts.values():
        dst = ranks[0]
        dist.send(sizes, dst)
        dist.send(head, dst)
        if flat.numel():
            dist.send(flat, dst)
    return sent * len(topo.remote_hosts)


def receive(topo: Topology) -> tuple[list, torch.Tensor]:
    """Remote rank: the leader's header and bytes, once per host (re-broadcast within the host)."""
    import torch.distributed as dist

    ranks = topo.remote_hosts[topo.hosts[topo.rank]]
    group = topo.host_groups.get(topo.hosts[topo.rank])
    sizes = torch.zeros(2, dtype=torch.int64)
    if topo.rank == ranks[0]:
        dist.recv(sizes, 0)
    if group is not None:
        dist.broadcast(sizes, ranks[0], group=group)
    head = torch.empty(int(sizes[0]), dtype=torch.uint8)
    flat = torch.empty(int(sizes[1]), dtype=torch.uint8)
    for buf in (head, flat):
        if not buf.numel():
            continue
        if topo.rank == ranks[0]:
            dist.recv(buf, 0)
        if group is not None:
            dist.broadcast(buf, ranks[0], group=group)
    return msgpack.unpackb(head.numpy().tobytes()), flat


def fill(opened, keys: list[tuple[int, int]], header: list, flat: torch.Tensor) -> None:
    """Remote rank: hand each forwarded feature its bytes (views into one received buffer)."""
    pos = 0
    for (i, j), entry in zip(keys, header):
        if isinstance(entry, int):
            opened[i][j].receive(flat[pos: pos + entry], None)
            pos += _padded(entry)
        else:
            opened[i][j].receive(None, entry)
