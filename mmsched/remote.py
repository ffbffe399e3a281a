"""Ranks on other hosts: who can see the leader's shared memory, and how the others get the bytes.

A rank's *host* is the shared memory it can see: the kernel's boot id and the device of
/dev/shm. Ranks that share the leader's attach shm / CUDA IPC features as usual. For the
others, the leader ships the bytes it already read (read once) with the batch to the
lowest rank of each remote host (one message in the common case: the shipment, below),
which re-broadcasts to the other ranks of its host over a host-local subgroup. So each remote host receives a
feature once, however many of its ranks need it. A failure to read on the leader's host
or to receive on a remote one is recorded on the feature (``transport.ForwardedFeature``)
like any other: the consensus sees it and the 500 names the rank.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from .transport.buffers import NO_REUSE

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
    links: dict[str, object] = field(default_factory=dict)  # remote host -> group {0, its first rank};
    # absent: the default group, which is exactly those two ranks (a world of 2)

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
        return cls.build(rank, hosts)

    @classmethod
    def build(cls, rank: int, hosts: list[str]) -> "Topology":
        """Collective: the subgroups for remote hosts (every rank creates each, in the same order)."""
        import torch.distributed as dist

        groups, links = {}, {}
        seen: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            seen.setdefault(h, []).append(r)
        for h, ranks in seen.items():
            if h != hosts[0] and len(ranks) > 1:
                groups[h] = dist.new_group(ranks, backend="gloo")
            if h != hosts[0] and len(hosts) > 2:
                links[h] = dist.new_group([0, ranks[0]], backend="gloo")
        return cls(rank, hosts, groups, links)


def host_bound(reqs) -> list[tuple[int, int]]:
    """(request, item) indexes of the batch's items that remote ranks must be sent."""
    return [(i, j) for i, r in enumerate(reqs) for j, it in enumerate(r.items) if it.transport in HOST_BOUND]


# ---- the shipment: what the leader sends a remote host for one batch, and where it lands
#
# Both sides know from the batch which items are forwarded and each one's declared size, so
# the layout of the receiver's one buffer is fixed before a byte moves: an 8-byte prefix (the
# length of the reasons, 0 when none), ``INLINE_REASONS`` bytes for them, then the small
# items, then the big ones, each item padded to ``ALIGN``. Message 0 is the prefix and the
# reasons with the small items copied in behind them; each big item is its own message, sent
# as it is and received straight into its slice. The reasons (msgpack, one per item that
# failed on the leader) ride in message 0; only when they are longer than ``INLINE_REASONS``
# does one more message follow with them. A failed item's slot still travels (zeros), so the
# layout never depends on what failed. Each message is a broadcast over the host's link ({leader, its first rank}):
# measured here, gloo's send/recv has a much longer tail under load than its broadcast.

PREFIX = 8  # bytes: int64 length of the reasons message (0: every item arrived)
INLINE_REASONS = 1024  # bytes kept behind the prefix: reasons up to this long ride in message 0
BIG = 2 << 20  # items of at least this many bytes travel as their own message, never copied


@dataclass(frozen=True)
class Layout:
    """Where each forwarded item lies in the receiver's buffer; ``slots`` are the messages' ranges."""

    sizes: list[int]
    offsets: list[int]
    slots: list[tuple[int, int]]  # message k lands in buf[start:end]; message 0 is prefix + small items

    @property
    def total(self) -> int:
        return self.slots[-1][1]


def layout(sizes: list[int]) -> Layout:
    """The same on the leader and on the receiver: it depends on the declared sizes only."""
    offsets, pos = [0] * len(sizes), PREFIX + INLINE_REASONS
    for k, n in enumerate(sizes):
        if n < BIG:
            offsets[k], pos = pos, pos + _padded(n)
    slots = [(0, pos)]
    for k, n in enumerate(sizes):
        if n >= BIG:
            offsets[k], pos = pos, pos + _padded(n)
            slots.append((offsets[k], offsets[k] + n))
    return Layout(sizes, offsets, slots)


class Shipment:
    """The leader's message 0 for one batch, taken before the batch is read, so that its small
    items can be read straight into their slots (``slot``): ``frame`` then copies nothing for
    them (a copy cost ~0.25 ms per MiB here, a third of the broadcast that follows)."""

    def __init__(self, sizes: list[int], buffers=NO_REUSE):
        self.layout = layout(sizes)
        self.head = buffers.take(self.layout.slots[0][1])

    def slot(self, k: int) -> torch.Tensor | None:
        """Where item ``k``'s bytes travel from, if they travel in message 0."""
        n = self.layout.sizes[k]
        return self.head[self.layout.offsets[k]: self.layout.offsets[k] + n] if n < BIG else None


def frame(sizes: list[int], payloads: list, buffers=NO_REUSE,
          shipment: Shipment | None = None) -> tuple[list[torch.Tensor], bytes]:
    """Leader: the messages for ``payloads`` (a tensor of the item's bytes, or why there is none),
    in ``layout(sizes).slots`` order, and the reasons message (empty when nothing failed).

    Message 0 is ``shipment``'s, or comes from ``buffers`` (reused pages: a big copy into fresh
    ones costs as much again); a payload already in its slot is not copied, its padding bytes
    are left as they are, a failed item's slot is zeroed. Byte work goes through numpy: each
    torch op costs several microseconds here, at every batch."""
    lay = layout(sizes) if shipment is None else shipment.layout
    raws = [_raw(p, n) for p, n in zip(payloads, sizes)]
    reasons = {k: r for k, r in enumerate(raws) if isinstance(r, str)}
    blob = msgpack.packb(reasons) if reasons else b""
    head = buffers.take(lay.slots[0][1]) if shipment is None else shipment.head
    out, base = head.numpy(), head.data_ptr()
    struct.pack_into("<q", out, 0, len(blob))
    if len(blob) <= INLINE_REASONS:  # no message more for a failed item (the reasons' own collective)
        out[PREFIX: PREFIX + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    messages = [head]
    for k, (raw, n) in enumerate(zip(raws, sizes)):
        failed = isinstance(raw, str)
        if n >= BIG:
            messages.append(torch.zeros(n, dtype=torch.uint8) if failed else raw)
        elif failed:
            out[lay.offsets[k]: lay.offsets[k] + n] = 0
        elif n and raw.data_ptr() != base + lay.offsets[k]:  # not read into its slot: copy it there
            out[lay.offsets[k]: lay.offsets[k] + n] = raw.numpy()
    return messages, blob


def _raw(payload, nbytes: int):
    """An item's bytes as one contiguous uint8 CPU tensor, or why the leader cannot send them."""
    if isinstance(payload, str):
        return payload
    raw = payload.reshape(-1).view(torch.uint8).cpu()  # a CUDA device's copy travels from host memory
    if raw.numel() != nbytes:
        return f"the leader read {raw.numel()} bytes where the item declares {nbytes}"
    return raw


def reasons_length(buf: torch.Tensor) -> int:
    """The prefix: how many bytes of reasons follow the shipment."""
    return struct.unpack_from("<q", buf.numpy(), 0)[0]


def unframe(lay: Layout, buf: torch.Tensor, blob: bytes) -> list:
    """Receiver: per item a uint8 view into ``buf``, or the leader's reason why it has none."""
    reasons = msgpack.unpackb(blob, strict_map_key=False) if blob else {}
    return [reasons[k] if k in reasons else buf[off: off + n]
            for k, (off, n) in enumerate(zip(lay.offsets, lay.sizes))]


def ship(topo: Topology, sizes: list[int], payloads: list, buffers=NO_REUSE,
         shipment: Shipment | None = None) -> int:
    """Leader: send every remote host the items' bytes (or why not); returns feature bytes sent."""
    import torch.distributed as dist

    messages, blob = frame(sizes, payloads, buffers, shipment)
    if len(blob) > INLINE_REASONS:
        messages.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    works = [dist.broadcast(m, 0, group=topo.links.get(h), async_op=True)
             for h in topo.remote_hosts for m in messages]
    for w in works:  # posted together: every host's transfers overlap
        w.wait()
    return sum(n for n, p in zip(sizes, payloads) if not isinstance(p, str)) * len(topo.remote_hosts)


def receive(topo: Topology, sizes: list[int], buffers=NO_REUSE) -> list:
    """Remote rank: per item its bytes (views into one buffer from ``buffers``) or the leader's
    reason; received once per host and re-broadcast within it."""
    import torch.distributed as dist

    lay = layout(sizes)
    host = topo.hosts[topo.rank]
    ranks, group, link = topo.remote_hosts[host], topo.host_groups.get(host), topo.links.get(host)
    buf = buffers.take(lay.total)
    if topo.rank == ranks[0]:
        parts = [buf] if len(lay.slots) == 1 else [buf[a:b] for a, b in lay.slots]
        for p in parts:  # one after another: two posted at once cost ~0.6 ms more per 16 MiB here
            dist.broadcast(p, 0, group=link)
    if group is not None:
        dist.broadcast(buf, ranks[0], group=group)
    length = reasons_length(buf)  # not 0 only when an item failed on the leader
    if length <= INLINE_REASONS:
        blob = buf[PREFIX: PREFIX + length].numpy().tobytes()
    else:
        reasons = torch.empty(length, dtype=torch.uint8)
        if topo.rank == ranks[0]:
            dist.broadcast(reasons, 0, group=link)
        if group is not None:
            dist.broadcast(reasons, ranks[0], group=group)
        blob = reasons.numpy().tobytes()
    return unframe(lay, buf, blob)
