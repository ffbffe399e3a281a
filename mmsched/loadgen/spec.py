"""What a load run sends: the ``LoadSpec``, the kinds of request and the status each should get."""

from __future__ import annotations

from dataclasses import dataclass, field

TRANSPORTS = ("pooled", "shm", "inline", "cuda_ipc", "memfd")
CLIENT_FAULTS = ("missing", "too_small", "bad_name")
# what each kind of request should get; an abort races the result
EXPECTED = {"": (200,), "fail": (500,), "missing": (500,), "too_small": (500,), "bad_name": (400,),
            "abort": (499, 200)}
LOST = 0  # the status recorded for a request whose result never came


@dataclass
class LoadSpec:
    """What to send, how fast, and for how long (every loop is bounded in count and time)."""

    frontend: str = "ipc:///tmp/mmsched.sock"
    rate: float | None = None           # open loop: requests per second
    concurrency: int | None = None      # closed loop: requests in flight (default 16 without rate)
    requests: int | None = 1000         # at most this many requests are sent (None: no count) ...
    duration: float = 60.0              # ... and only for this many seconds
    drain_s: float = 10.0               # then results are awaited this long; the rest are lost
    type: str = "embed"
    items: int = 1                      # features per request (0: text only)
    item_bytes: list[int] = field(default_factory=lambda: [64 << 10])
    transports: list[str] = field(default_factory=lambda: ["pooled"])
    session_turns: int = 1
    fail_rate: float = 0.0
    fail_prefix: str = "fail-"
    client_faults: float = 0.0
    abort_rate: float = 0.0
    seed: int = 0
    input_len: int = 16
    max_new_tokens: int = 4
    shm_prefix: str = "mmsched_"
    pool_bytes: int | None = None       # ShmPool size (default: enough for what is in flight, capped)
    verify: bool = False                # ask for digests; a 200 whose bytes are not ours is a failure
    progress: bool = False

    def validate(self) -> None:
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("rate and concurrency exclude each other (open or closed loop)")
        if self.rate is not None and not self.rate > 0:
            raise ValueError("rate must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.requests is not None and self.requests < 1 or not self.duration > 0 or self.drain_s < 0:
            raise ValueError("requests >= 1, duration > 0 and drain >= 0 are required")
        if self.type not in ("embed", "generate"):
            raise ValueError("type must be embed or generate")
        if self.items < 0 or not self.item_bytes or any(b < 1 for b in self.item_bytes):
            raise ValueError("items >= 0 and item sizes >= 1 byte are required")
        bad = [t for t in self.transports if t not in TRANSPORTS]
        if bad or not self.transports:
            raise ValueError(f"transports must be among {', '.join(TRANSPORTS)} (got {bad or 'none'})")
        if self.session_turns < 1:
            raise ValueError("session_turns must be >= 1")
        if {"pooled", "memfd"} <= set(self.transports):  # both are the client's one shm_pool
            raise ValueError("transports pooled and memfd cannot be mixed in one run")
        rates = (self.fail_rate, self.client_faults, self.abort_rate)
        if any(not 0 <= r <= 1 for r in rates) or sum(rates) > 1:
            raise ValueError("fail_rate, client_faults and abort_rate are fractions that add up to at most 1")

    @property
    def in_flight(self) -> int:
        """Requests this run expects to hold at once (sizes the pools)."""
        if self.concurrency is not None:
            return self.concurrency
        return 16 if self.rate is None else max(16, min(4096, int(self.rate * 0.05)))


def parse_size(text: str) -> int:
    """``65536``, ``64K``, ``64KiB``, ``1M``, ``1MiB``, ``2G`` → bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    if mult > 1:
        t = t[:-1]
    value = float(t) * mult
    if value < 1 or value != int(value):
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 65536, 64K, 1M)")
    return int(value)
