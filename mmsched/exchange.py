"""The engine's all-gather between ranks on one host, through shared memory.

Why: each gloo all-gather hands its bytes to a worker thread and a TCP loop thread on every
rank. At tp=2 that was half of the leader lane's time in a text-only batch: ~0.5 ms under
load where the exchange itself is a few microseconds, and ~150 us of rank 0's CPU a batch.
Ranks that share a host can read each other's rows from memory instead, as the batch ring
does for the broadcast. Only the engine's collective (``EngineContext.gather``, which the
runner's agreement of a step rides in) takes this path; the agreement on features before
the engine runs stays on gloo (``RingGroup.all_gather``), and a group with a rank on another
host gathers through gloo everywhere.

Layout: per rank, a 64-byte line, then two buffers of ``CHUNK`` bytes. The line holds the
rounds this rank has published (a u32 that wraps), then the size of the gather each buffer
holds (u64). A gather of up to ``CHUNK`` bytes is one round; a longer one goes in rounds of
``CHUNK``. In round k a rank writes its bytes into buffer k % 2, publishes k, wakes its
waiters (a futex on that word), and waits for every peer to publish k; then it copies their
bytes. A peer can be one round ahead, never two (it would need this rank's next round
first), so the buffer of round k is not written again before every rank has read it. The
waits sleep (no spinning: 2 cores), in ticks of ``ring.TICK_S`` that check the deadline and
whether the peer is alive; a wait that runs out raises ``GroupBroken``. As in the ring, the
order of the stores (bytes, then the round) relies on x86's memory order.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid

import numpy as np

from .errors import GroupBroken
from .ring import LATE, MASK, _alive, _futex_wake, pid_namespace, reserve, sleep_until, visible
from .segments import shm_path

CHUNK = 256 << 10  # bytes a rank publishes a round: a batch of 256 reference-engine rows is ~66 KiB
_LINE = 64


def segment_bytes(world: int) -> int:
    return world * (_LINE + 2 * CHUNK)


class Exchange:
    """One rank's end of the same-host all-gather (every rank maps the same segment)."""

    def __init__(self, fd: int, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._mm = mmap.mmap(fd, segment_bytes(world))
        anchor = ctypes.c_char.from_buffer(self._mm)
        base = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping lives; no export is kept
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8)
        self._lines = [r * (_LINE + 2 * CHUNK) for r in range(world)]  # each rank's line, by offset
        self._words = np.frombuffer(self._mm, dtype=np.uint32)  # a rank's round: word lines[r] // 4
        self._sizes = np.frombuffer(self._mm, dtype=np.uint64)  # its sizes: words lines[r] // 8 + 1, + 2
        self._addr = [ctypes.c_void_p(base + at) for at in self._lines]
        self._round = 0
        self.peers: list[int | None] = [None] * world  # pids waited on (None: only the deadline tells)

    @classmethod
    def join(cls, group, prefix: str, timeout_s: float) -> "Exchange":
        """Collective, at start-up, on ``group`` (the runner's: gloo), every rank on one host: rank 0
        creates the segment, the others map it, then rank 0 unlinks its name (nothing is left in
        /dev/shm, whatever happens next); until then a shared flock keeps the sweep away."""
        rank, world = group.rank, group.world
        fd, problem = -1, None
        name = f"{prefix}{os.getpid()}_gather_{uuid.uuid4().hex[:8]}" if rank == 0 else None
        if rank == 0:
            fd = reserve(name, segment_bytes(world), lambda fd: fd)
        me = (os.getpid(), pid_namespace(), name)
        peers = group.all_gather_object(me)
        if rank != 0:
            try:
                fd = os.open(shm_path(peers[0][2]), os.O_RDWR)
                if os.fstat(fd).st_size != segment_bytes(world):
                    problem = f"rank {rank}: the engine's gather segment has size {os.fstat(fd).st_size}"
            except OSError as exc:
                problem = f"rank {rank} cannot map the engine's gather segment: {exc}"
        problems = [p for p in group.all_gather_object(problem) if p]
        try:
            if rank == 0:
                os.unlink(shm_path(name))
            if problems:
                raise GroupBroken("; ".join(problems))
            ex = cls(fd, rank, world, timeout_s)
        finally:
            if fd >= 0:
                os.close(fd)  # the mapping stays; the flock goes with the descriptor
        ex.peers = [visible(p, me) for p in peers]
        return ex

    def all_gather(self, payload: np.ndarray) -> np.ndarray:
        """Every rank's ``payload`` (bytes, as a 1-D uint8 array), stacked: [world, n], fresh."""
        mine = np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)
        n = mine.size
        out = np.empty((self.world, n), dtype=np.uint8)
        out[self.rank] = mine
        for at in range(0, max(n, 1), CHUNK):
            self._round_of(mine[at: at + CHUNK], out, at, n)
        return out

    def _round_of(self, chunk: np.ndarray, out: np.ndarray, at: int, n: int) -> None:
        self._round += 1
        k, parity = self._round & MASK, self._round & 1
        line = self._lines[self.rank]
        start = line + _LINE + parity * CHUNK
        self._bytes[start: start + chunk.size] = chunk
        self._sizes[line // 8 + 1 + parity] = n
        self._words[line // 4] = k  # published: the bytes before it are there (x86 store order)
        _futex_wake(self._addr[self.rank])
        for r in range(self.world):
            if r == self.rank:
                continue
            self._wait(r, k)
            peer = self._lines[r]
            size = int(self._sizes[peer // 8 + 1 + parity])
            if size != n:
                raise GroupBroken(f"engine gather: rank {r} gathered {size} bytes where rank {self.rank} "
                                  f"gathered {n}: the ranks' gathers are out of step")
            src = peer + _LINE + parity * CHUNK
            out[r, at: at + chunk.size] = self._bytes[src: src + chunk.size]

    def _wait(self, r: int, k: int) -> None:
        """Until rank ``r`` has published round ``k`` (or the next one); GroupBroken past the
        deadline, or if it died."""
        words, at, ahead = self._words, self._lines[r] // 4, (k + 1) & MASK
        if int(words[at]) in (k, ahead):  # there already: no closures built
            return
        why = sleep_until(lambda: int(words[at]), self._addr[r], lambda v: v == k or v == ahead, self.timeout_s,
                          lambda: _alive(self.peers[r]))
        if why is not None:
            raise GroupBroken(f"engine gather: rank {r} did not gather within {self.timeout_s:g} s" if why == LATE
                              else f"engine gather: rank {r} is gone")

    def close(self) -> None:
        self._bytes = self._words = self._sizes = None  # the views go before the mapping
        self._mm.close()

