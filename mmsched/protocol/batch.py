"""The internal batch format: what the leader broadcasts to every rank, once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from .messages import Request


@dataclass
class Batch:
    seq: int
    requests: list[Request] = field(default_factory=list)
    stop: bool = False
    closes: list[str] = field(default_factory=list)  # sessions to release first (close or idle)
    gather_stats: bool = False  # after the step, every rank all-gathers its counters

    @property
    def empty(self) -> bool:
        return not self.requests and not self.closes

    def encode(self) -> bytes:
        return msgpack.packb([self.seq, self.stop, [r.wire() for r in self.requests], self.closes,
                              self.gather_stats], use_bin_type=True)

    @classmethod
    def decode(cls, buf) -> "Batch":
        seq, stop, reqs, closes, gather_stats = msgpack.unpackb(buf, raw=False)
        return cls(seq, [Request.from_wire(w) for w in reqs], stop, closes, gather_stats)
