"""The load generator: drive one frontend with a seeded request mix; keep raw timestamps; summarize.

A library with a thin CLI (``mmsched loadtest``). ``run(spec)`` sends requests in an
open loop (``rate``: arrivals at fixed intervals, whatever the server does) or a closed
loop (``concurrency``: that many requests always in flight), bounded by a request count
and a duration, then waits at most ``drain_s`` for the results still outstanding and
counts the rest as lost. It returns a ``Report``: the raw per-request rows (``Records``,
send/receive timestamps and statuses) and, separately, ``summarize(records)``.

The mix is drawn from one seeded ``random.Random``, one draw per request in send order:
its transport (``pooled`` by default, ``shm``, ``inline``, ``cuda_ipc``), its feature
sizes, and its fault, if any:

- ``fail``: the rid starts with ``fail_prefix`` (default ``fail-``). Start the server with
  a fault glob that matches it, e.g. ``--fault 0:open:fail-*`` (a rank fails opening the
  features: requests with features get a 500) or ``--fault 0:engine:fail-*`` (text-only
  requests too); without one such a request is simply served (200).
- client faults (``missing``, ``too_small``, ``bad_name``): an shm item naming a segment
  that does not exist (500), a segment smaller than the item says (500; mmsched unlinks
  it), or a name without the prefix (400; nothing is created).
- ``abort``: an abort sent right after the request (499, or 200 when the result won).

With ``session_turns`` T > 1 every session sends T turns one after another: the first
brings its features with ids, later turns refer to them (``ref``) while the session holds
them, and bring them again after a turn that stored nothing; each session is closed.
In a closed loop each slot runs its session to the end; in an open loop each arrival is
the next turn of a session whose last turn has returned, or the first turn of a new one.

Which transport (measured with ``make bench`` on a 2-core machine; see bench/results.json):
``pooled`` (the default) for a client that sends features again and again: one segment
made once, slices reused when results arrive, no create/open/unlink per request, and a
rank reads through a descriptor it keeps (1 MiB items: ~1.4x the requests/s of ``shm``
at tp=1, ~1.6x at tp=2); ``shm`` for a one-off feature or a client that cannot keep a
pool (each feature is a segment the client creates and mmsched opens, reads and
unlinks: ~50 µs of fixed cost per feature here, besides the copy); ``inline`` for small
features or a client on another host (the bytes ride in the message; at tp > 1 they are
broadcast to every rank with the batch); ``cuda_ipc`` for features already on a GPU;
``memfd`` (an extension) is ``pooled`` over a sealed memfd the ranks copy out of a kept
mapping: for big features (16 MiB: see bench/materialize.py), ranks on the client's host.

When the server goes away (a 503 ``service unavailable: …``: draining, stopped, group
broken; or no pong for ``GONE_S``), the generator stops sending at once: requests sent
into a socket nobody reads would be lost results and segments nobody unlinks. With no
pong at the start it sends nothing and says so.

Segments: the prefixed segments in /dev/shm are listed before and after. Segments this
process created (``<prefix><pid>_…``) and that are still there at the end are a leak;
the generator's own pools are removed before the count.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import os
import random
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from .client import Client, Feature, cuda_ipc, inline, pooled, raw, ref, shm
from .devices import CudaDevice, ShmDevice
from .producers import IpcPool, MemfdPool, ShmPool, create_segment
from .segments import SHM_DIR

TRANSPORTS = ("pooled", "shm", "inline", "cuda_ipc", "memfd")
CLIENT_FAULTS = ("missing", "too_small", "bad_name")
# what each kind of request should get; an abort races the result
EXPECTED = {"": (200,), "fail": (500,), "missing": (500,), "too_small": (500,), "bad_name": (400,),
            "abort": (499, 200)}
LOST = 0  # the status recorded for a request whose result never came
GONE_S = 4.0  # no pong for this long while running: the server is gone
_RUNS = itertools.count()


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
        if {"pooled", "memfd"} <= set(self.transports):  # both are the client's one shm_pool
            raise ValueError("transports pooled and memfd cannot be mixed in one run")
        if self.session_turns < 1:
            raise ValueError("session_turns must be >= 1")
        rates = (self.fail_rate, self.client_faults, self.abort_rate)
        if any(not 0 <= r <= 1 for r in rates) or sum(rates) > 1:
            raise ValueError("fail_rate, client_faults and abort_rate are fractions that add up to at most 1")

    @property
    def in_flight(self) -> int:
        """Requests this run expects to hold at once (sizes the pools)."""
        if self.concurrency is not None:
            return self.concurrency
        return 16 if self.rate is None else max(16, min(4096, int(self.rate * 0.05)))


# ---------------------------------------------------------------- raw rows

class Records:
    """One row per request sent, in send order; times in seconds since the run's start."""

    COLUMNS = ("rid", "transport", "fault", "session", "turn", "t_send", "t_recv", "status", "verified")
    MATCHED, MISMATCHED, UNCHECKED = 1, 0, -1  # ``verified``: a 200's digests against the client's own

    def __init__(self):
        self.rid: list[str] = []
        self.transport: list[str] = []
        self.fault: list[str] = []
        self.session: list[int] = []   # -1: not part of a session
        self.turn: list[int] = []
        self.t_send: list[float] = []
        self.t_recv: list[float] = []  # nan while (or if forever) outstanding
        self.status: list[int] = []    # LOST (0) while outstanding
        self.verified: list[int] = []  # MATCHED / MISMATCHED, or UNCHECKED (not a 200, or not --verify)

    def add(self, rid: str, transport: str, fault: str, session: int, turn: int, t_send: float) -> int:
        self.rid.append(rid)
        self.transport.append(transport)
        self.fault.append(fault)
        self.session.append(session)
        self.turn.append(turn)
        self.t_send.append(t_send)
        self.t_recv.append(math.nan)
        self.status.append(LOST)
        self.verified.append(self.UNCHECKED)
        return len(self.rid) - 1

    def __len__(self) -> int:
        return len(self.rid)

    def rows(self) -> list[list]:
        cols = [getattr(self, c) for c in self.COLUMNS]
        return [[c[i] if not (isinstance(c[i], float) and math.isnan(c[i])) else None for c in cols]
                for i in range(len(self))]


# ---------------------------------------------------------------- the summary (pure)

def _pct(sorted_ms: np.ndarray, q: float) -> float:
    return float(np.percentile(sorted_ms, q)) if sorted_ms.size else math.nan


def summarize(rec: Records, elapsed_s: float | None = None) -> dict:
    """Counts and latency by status, lost results, and the expected-status check; no I/O."""
    status = np.asarray(rec.status, dtype=np.int64)
    t_send = np.asarray(rec.t_send, dtype=np.float64)
    t_recv = np.asarray(rec.t_recv, dtype=np.float64)
    done = status != LOST
    lat_ms = (t_recv - t_send) * 1e3
    if elapsed_s is None:
        elapsed_s = float(np.nanmax(t_recv)) if done.any() else (float(t_send.max()) if len(rec) else 0.0)
    by_status = {}
    for s in sorted(set(status[done].tolist())):
        ms = np.sort(lat_ms[status == s])
        by_status[int(s)] = {"count": int(ms.size), "p50_ms": _pct(ms, 50), "p90_ms": _pct(ms, 90),
                             "p99_ms": _pct(ms, 99), "max_ms": float(ms[-1])}
    all_ms = np.sort(lat_ms[done])
    expected: dict[str, dict] = {}
    unexpected = 0
    for kind, st in zip(rec.fault, rec.status):
        row = expected.setdefault(kind or "none", {})
        row[str(st)] = row.get(str(st), 0) + 1
        unexpected += st != LOST and st not in EXPECTED[kind]
    send_window = float(t_send.max() - t_send.min()) if len(rec) > 1 else 0.0
    return {
        "sent": len(rec), "completed": int(done.sum()), "lost": int((~done).sum()),
        "elapsed_s": elapsed_s,
        "achieved_rate": (int(done.sum()) / elapsed_s) if elapsed_s > 0 else 0.0,
        "send_rate": (len(rec) - 1) / send_window if send_window > 0 else 0.0,
        "latency_ms": {"p50": _pct(all_ms, 50), "p90": _pct(all_ms, 90), "p99": _pct(all_ms, 99),
                       "max": float(all_ms[-1]) if all_ms.size else math.nan},
        "by_status": by_status,
        "by_fault": expected,
        "unexpected": int(unexpected),
        "verified": rec.verified.count(Records.MATCHED),
        "mismatched": rec.verified.count(Records.MISMATCHED),
    }


@dataclass
class Report:
    spec: dict
    summary: dict
    records: Records
    segments: dict            # before/after counts, leaked names
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # why the run stopped early (no server, the server went away)

    @property
    def ok(self) -> bool:
        return (self.summary["lost"] == 0 and not self.segments["leaked"] and not self.summary["mismatched"]
                and self.error is None)

    def to_json(self) -> dict:
        """The summary and the raw rows, kept apart."""
        return {"spec": self.spec, "summary": self.summary, "segments": self.segments, "notes": self.notes,
                "error": self.error,
                "raw": {"columns": list(Records.COLUMNS), "rows": self.records.rows()}}


def format_table(report: Report) -> str:
    s, seg = report.summary, report.segments
    lines = [f"{'status':>8} {'count':>8} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'max ms':>9}"]
    for st, row in s["by_status"].items():
        lines.append(f"{st:>8} {row['count']:>8} {row['p50_ms']:>9.2f} {row['p90_ms']:>9.2f} "
                     f"{row['p99_ms']:>9.2f} {row['max_ms']:>9.2f}")
    lat = s["latency_ms"]
    lines.append(f"{'all':>8} {s['completed']:>8} {lat['p50']:>9.2f} {lat['p90']:>9.2f} "
                 f"{lat['p99']:>9.2f} {lat['max']:>9.2f}")
    lines.append(f"sent {s['sent']}  completed {s['completed']}  lost {s['lost']}  in {s['elapsed_s']:.2f} s: "
                 f"achieved {s['achieved_rate']:.0f} req/s (sent at {s['send_rate']:.0f} req/s)")
    mix = "  ".join(f"{k}: " + ",".join(f"{st}x{n}" for st, n in sorted(v.items())) for k, v in s["by_fault"].items())
    lines.append(f"by kind (status x count)  {mix}  unexpected {s['unexpected']}")
    lines.append(f"/dev/shm {report.spec['shm_prefix']}* segments: before {seg['before']}, after {seg['after']}; "
                 f"leaked by this run {len(seg['leaked'])}" + (f" {seg['leaked'][:5]}" if seg["leaked"] else ""))
    if report.spec.get("verify"):
        lines.append(f"digests: {s['verified']} results carried exactly the bytes sent, "
                     f"{s['mismatched']} carried other bytes")
    lines.extend(report.notes)
    problems = [x for x, bad in (("lost results", s["lost"]), ("leaked segments", seg["leaked"]),
                                 ("200s with bytes that were not sent", s["mismatched"])) if bad]
    verdict = "OK" if report.ok else "FAIL: " + ", ".join(problems + ([report.error] if report.error else []))
    lines.append(verdict)
    return "\n".join(lines)


def write_json(report: Report, path: str) -> None:
    import json

    with open(path, "w") as fh:
        json.dump(_finite(report.to_json()), fh, indent=1, allow_nan=False, default=str)


def _finite(x):
    """NaN (a percentile of nothing) → null: strict JSON."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


PLOT_NEEDS = "--plot needs matplotlib: pip install 'mmsched[plot]' (or .venv/bin/pip install matplotlib)"


def can_plot() -> bool:
    """Checked before a run, so a missing matplotlib does not cost the whole run."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_plot(report: Report, path: str) -> None:
    """A PNG: each result's latency against its send time, by status, with p50/p99 per time bin."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:
        raise RuntimeError(PLOT_NEEDS) from exc
    rec = report.records
    status = np.asarray(rec.status)
    t = np.asarray(rec.t_send)
    lat = (np.asarray(rec.t_recv) - t) * 1e3
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    for st in sorted(set(status.tolist()) - {LOST}):
        m = status == st
        ax.scatter(t[m], lat[m], s=3, alpha=0.35, label=f"{st} ({int(m.sum())})", rasterized=True)
    done = status != LOST
    if done.sum() > 1:
        bins = np.linspace(t[done].min(), t[done].max() + 1e-9, min(60, max(2, int(done.sum() // 20))) + 1)
        idx = np.digitize(t[done], bins) - 1
        mids, p50, p99 = [], [], []
        for b in range(len(bins) - 1):
            v = lat[done][idx == b]
            if v.size:
                mids.append((bins[b] + bins[b + 1]) / 2)
                p50.append(np.percentile(v, 50))
                p99.append(np.percentile(v, 99))
        ax.plot(mids, p50, color="black", lw=1.5, label="p50")
        ax.plot(mids, p99, color="red", lw=1.5, label="p99")
    if (~done).any():
        ax.scatter(t[~done], np.full(int((~done).sum()), np.nanmax(lat) if done.any() else 1.0),
                   marker="x", color="red", s=12, label=f"lost ({int((~done).sum())})")
    ax.set_yscale("log")
    def minor(v: float, _pos) -> str:  # within one decade every tick, else the 2s and 5s
        lo, hi = ax.get_ylim()
        few = hi < 10 * max(lo, 1e-12)
        return f"{v:g}" if v > 0 and (few or round(v / 10 ** math.floor(math.log10(v))) in (2, 5)) else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))  # milliseconds plainly: 6, not 6×10^0
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))
    ax.set_xlabel("send time (s since start)")
    ax.set_ylabel("latency (ms)")
    s = report.summary
    ax.set_title(f"mmsched loadtest: {s['completed']}/{s['sent']} results, {s['achieved_rate']:.0f} req/s, "
                 f"p50 {s['latency_ms']['p50']:.2f} ms, p99 {s['latency_ms']['p99']:.2f} ms")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, markerscale=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------- segments

def list_segments(prefix: str) -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except OSError:
        return set()


# ---------------------------------------------------------------- the run

class _Session:
    __slots__ = ("n", "id", "turn", "stored", "ids", "sizes", "busy")

    def __init__(self, n: int, tag: str):
        self.n, self.id, self.turn = n, f"{tag}-s{n}", 0
        self.stored = False      # the server holds this session's features (a turn with them got 200)
        self.ids: list[str] = []
        self.sizes: list[int] = []  # payload size behind each id
        self.busy = False        # a turn is in flight


class _Run:
    """One run's state. Callbacks (no task per request): a result arriving sends the next request."""

    def __init__(self, spec: LoadSpec, client: Client, rng: random.Random):
        self.spec, self.client, self.rng = spec, client, rng
        self.rec = Records()
        self.t0 = 0.0
        self.send_until = 0.0
        self.outstanding = 0
        self.sending = True
        self.all_done = asyncio.Event()
        self.rids: dict[int, str] = {}   # row -> rid, while outstanding
        self.futs: dict[int, asyncio.Future] = {}
        self.sessions: list[_Session] = []
        self.ready: deque[_Session] = deque()  # open loop: sessions whose last turn returned
        self.closing: list[asyncio.Task] = []
        rng_np = np.random.default_rng(spec.seed)
        self.payloads = {n: torch.from_numpy(rng_np.integers(0, 256, n, dtype=np.uint8)) for n in spec.item_bytes}
        self.sha256 = {n: hashlib.sha256(t.numpy()).hexdigest() for n, t in self.payloads.items()}
        self.want: dict[int, list[str]] = {}  # row -> the digests its 200 must carry (--verify)
        self.ids = [rng_np.integers(0, 32000, spec.input_len, dtype=np.int32) for _ in range(8)]
        self.tag = f"lg{os.getpid()}-{next(_RUNS)}"
        self.counter = 0
        self.tasks: set[asyncio.Task] = set()  # aborts in flight (the loop keeps only weak references)
        self.errors: list[str] = []
        self.stopped_by: str | None = None  # why sending stopped before its count and duration

    async def watch(self, every_s: float = 1.0) -> None:
        """Ping while the run lasts: no pong for GONE_S means nobody reads what we send."""
        last = time.perf_counter()
        while not self.all_done.is_set():
            try:
                await self.client.ping(timeout=every_s)
                last = time.perf_counter()
            except asyncio.TimeoutError:
                if time.perf_counter() - last >= GONE_S:
                    self.stopped_by = self.stopped_by or f"no pong from {self.spec.frontend} for {GONE_S:g} s: the server is gone"
                    self.stop_sending()
                    self.all_done.set()  # nobody will answer what is outstanding
                    return
                continue
            await asyncio.sleep(every_s)

    # -- what one request is (one seeded draw per request, in send order)
    def _draw(self) -> tuple[str, str, list[int], int]:
        r, s = self.rng, self.spec
        transport = s.transports[0] if len(s.transports) == 1 else r.choice(s.transports)
        sizes = [s.item_bytes[0] if len(s.item_bytes) == 1 else r.choice(s.item_bytes) for _ in range(s.items)]
        x = r.random()
        if x < s.fail_rate:
            fault = "fail"
        elif x < s.fail_rate + s.client_faults:
            fault = CLIENT_FAULTS[r.randrange(len(CLIENT_FAULTS))]
        elif x < s.fail_rate + s.client_faults + s.abort_rate:
            fault = "abort"
        else:
            fault = ""
        return transport, fault, sizes, r.randrange(len(self.ids))

    def _features(self, transport: str, sizes: list[int], sess: _Session | None) -> tuple[list[Feature], list[int]]:
        """The request's features, and the payload size behind each (a ref stands for its stored one)."""
        if sess is not None and sess.turn > 0 and sess.stored:
            return [ref(fid) for fid in sess.ids], sess.sizes
        make = {"pooled": pooled, "memfd": pooled, "shm": shm, "inline": inline, "cuda_ipc": cuda_ipc}[transport]
        feats = []
        for k, n in enumerate(sizes):
            fid = f"f{k}" if sess is not None else None
            feats.append(make(self.payloads[n], "image", fid))
        if sess is not None:
            sess.ids, sess.sizes = [f"f{k}" for k in range(len(sizes))], sizes
        return feats, sizes

    def _fault_item(self, kind: str, sizes: list[int]) -> tuple[Feature, Any]:
        """A client-made bad item: (feature, segment to hand over once sent or None)."""
        n = sizes[0] if sizes else 64
        item = {"modality": "image", "transport": "shm", "dtype": "uint8", "shape": [n]}
        prefix = self.spec.shm_prefix
        if kind == "missing":
            return raw(dict(item, shm_name=f"{prefix}{os.getpid()}_missing_{self.counter}")), None
        if kind == "bad_name":
            return raw(dict(item, shm_name=f"not{prefix}{os.getpid()}_{self.counter}")), None
        seg = create_segment(bytes(max(1, n // 2)), prefix)  # too small: mmsched owns and unlinks it
        return raw(dict(item, shm_name=seg.name, shape=[max(2, n)])), seg

    # -- sending
    def send_one(self, sess: _Session | None = None) -> bool:
        """Send the next request (a new one, or ``sess``'s next turn); False once the send phase is over."""
        if not self.sending:
            return False
        now = time.perf_counter()
        if len(self.rec) >= (self.spec.requests or math.inf) or now >= self.send_until:
            self.stop_sending()
            return False
        transport, fault, sizes, ids_k = self._draw()
        self.counter += 1
        rid = self.client.new_rid()
        if fault == "fail":
            rid = self.spec.fail_prefix + rid
        seg = None
        want = None
        if fault in CLIENT_FAULTS:
            feat, seg = self._fault_item(fault, sizes)
            feats = [feat]
        else:
            feats, sent_sizes = self._features(transport, sizes, sess)
            want = [self.sha256[n] for n in sent_sizes] if self.spec.verify else None
        params = {"max_new_tokens": self.spec.max_new_tokens} if self.spec.type == "generate" else None
        try:
            fut = self.client.send_request(self.spec.type, self.ids[ids_k], feats, rid=rid,
                                           session_id=sess.id if sess is not None else None, params=params,
                                           want_digest=self.spec.verify)
        except BaseException:
            if seg is not None:
                seg.discard()
            raise
        if seg is not None:
            seg.sent()  # ownership passed to mmsched (contract guarantee 4)
        t = time.perf_counter() - self.t0
        row = self.rec.add(rid, "ref" if feats and feats[0].transport == "session" else transport, fault,
                           sess.n if sess is not None else -1, sess.turn if sess is not None else 0, t)
        self.outstanding += 1
        if want is not None:
            self.want[row] = want
        self.rids[row] = rid
        self.futs[row] = fut
        if sess is not None:
            sess.busy = True
        fut.add_done_callback(lambda f, row=row, sess=sess: self._on_result(row, sess, f))
        if fault == "abort":
            task = asyncio.ensure_future(self.client.abort(rid))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return True

    def stop_sending(self) -> None:
        if self.sending:
            self.sending = False
            self._check_done()

    def _check_done(self) -> None:
        if not self.sending and self.outstanding == 0:
            self.all_done.set()

    def _on_result(self, row: int, sess: _Session | None, fut: asyncio.Future) -> None:
        t = time.perf_counter() - self.t0
        self.rids.pop(row, None)
        self.futs.pop(row, None)
        if fut.cancelled():
            return  # the run is over: it stays lost
        res = fut.result()
        self.rec.t_recv[row], self.rec.status[row] = t, res.status
        want = self.want.pop(row, None)
        if want is not None and res.status == 200:
            ok = res.meta.get("digests") == want
            self.rec.verified[row] = Records.MATCHED if ok else Records.MISMATCHED
            if not ok:
                self.errors.append(f"{res.rid}: 200 whose digests are not those of the bytes sent")
        self.outstanding -= 1
        if res.status == 503 and res.message.startswith("service unavailable") and self.sending:
            self.stopped_by = self.stopped_by or f"the server is going away ({res.message}): stopped sending"
            self.stop_sending()
        try:
            if sess is not None:
                self._next_turn(sess, res.status, self.rec.transport[row] != "ref")
            elif self.spec.concurrency is not None and self.sending:
                self.send_one()
        except Exception as exc:  # noqa: BLE001 - a send that cannot be made ends the send phase
            self.errors.append(f"{type(exc).__name__}: {exc}")
            self.stop_sending()
        self._check_done()

    # -- sessions
    def _new_session(self) -> _Session:
        sess = _Session(len(self.sessions), self.tag)
        self.sessions.append(sess)
        return sess

    def _next_turn(self, sess: _Session, status: int, brought: bool) -> None:
        sess.busy = False
        if status == 200 and brought and self.spec.items > 0:
            sess.stored = True
        sess.turn += 1
        if sess.turn >= self.spec.session_turns:
            self._close_session(sess)
            if self.spec.concurrency is not None and self.sending:
                self.send_one(self._new_session())
        elif self.spec.concurrency is not None:
            if not self.send_one(sess):
                self._close_session(sess)
        else:  # open loop: the next arrival may take this session's next turn
            self.ready.append(sess)

    def close_sessions(self) -> None:
        """At the end: close every session that still holds features and has no turn out."""
        for sess in self.sessions:
            if not sess.busy:
                self._close_session(sess)

    def _close_session(self, sess: _Session) -> None:
        if sess.stored:
            sess.stored = False
            self.closing.append(asyncio.ensure_future(self.client.close_session(sess.id, timeout=5.0)))

    # -- the two loops
    async def closed_loop(self) -> None:
        for _ in range(self.spec.concurrency):
            sess = self._new_session() if self.spec.session_turns > 1 else None
            if not self.send_one(sess):
                break
        while self.sending:  # results drive the sending; this only enforces the duration
            await asyncio.sleep(min(0.05, max(0.0, self.send_until - time.perf_counter())))
            if time.perf_counter() >= self.send_until:
                self.stop_sending()

    async def open_loop(self) -> None:
        """Arrival i is due at i / rate: the next turn of a session whose last turn returned, or a new one."""
        rate, sessions = self.spec.rate, self.spec.session_turns > 1
        i = 0
        while self.sending:
            due = self.t0 + i / rate
            now = time.perf_counter()
            if now >= self.send_until or i >= (self.spec.requests or math.inf):
                break
            if due > now:
                await asyncio.sleep(due - now)
                continue
            burst = 0
            while due <= now and burst < 256 and self.sending:
                if sessions:
                    sess = self.ready.popleft() if self.ready else self._new_session()
                    if not self.send_one(sess):
                        break
                elif not self.send_one():
                    break
                i += 1
                burst += 1
                due = self.t0 + i / rate
            await asyncio.sleep(0)  # let results in between bursts
        self.stop_sending()


async def run(spec: LoadSpec, client: Client | None = None) -> Report:
    """Run the load described by ``spec`` against ``spec.frontend``; always returns, bounded in time."""
    spec.validate()
    if spec.rate is None and spec.concurrency is None:
        spec.concurrency = 16
    before = list_segments(spec.shm_prefix)
    notes: list[str] = []
    fallbacks = _FallbackCounter()
    logging.getLogger("mmsched.client").addFilter(fallbacks)
    shm_pool = ipc_pool = None
    own = client is None
    client = client or Client(spec.frontend, shm_prefix=spec.shm_prefix)
    r = _Run(spec, client, random.Random(spec.seed))
    elapsed = 0.0
    try:
        if own:
            await client.__aenter__()
        wait_s = min(2.0, max(0.5, spec.drain_s))
        try:
            ranks = int((await client.ping(timeout=wait_s)).get("ranks", 1))
        except asyncio.TimeoutError:
            r.stopped_by = f"no pong from {spec.frontend} within {wait_s:g} s: is the server up? (make serve)"
            return _report(spec, r, elapsed, before, notes)
        biggest = max(spec.item_bytes) if spec.items else 0
        if {"pooled", "memfd"} & set(spec.transports) and spec.items:
            size = spec.pool_bytes or min(1 << 30, max(16 << 20, 2 * spec.in_flight * spec.items * _aligned(biggest)))
            kind = MemfdPool if "memfd" in spec.transports else ShmPool
            shm_pool = client.shm_pool = kind(size, spec.shm_prefix)
        if "cuda_ipc" in spec.transports and spec.items:
            device = CudaDevice() if torch.cuda.is_available() else ShmDevice()
            slots = min(4096, 2 * spec.in_flight * spec.items)
            ipc_pool = client.ipc_pool = IpcPool(device, slots, biggest, max(ranks, 1), spec.shm_prefix)
        progress = asyncio.ensure_future(_progress(r)) if spec.progress else None
        watch = asyncio.ensure_future(r.watch())
        r.t0 = time.perf_counter()
        r.send_until = r.t0 + spec.duration
        try:
            await (r.closed_loop() if spec.concurrency is not None else r.open_loop())
            sent_at = time.perf_counter()
            try:
                await asyncio.wait_for(r.all_done.wait(), spec.drain_s)
            except asyncio.TimeoutError:
                notes.append(f"note: {r.outstanding} result(s) still missing {spec.drain_s:g} s after the send "
                             "phase: counted as lost")
            last = np.nanmax(np.asarray(r.rec.t_recv)) if len(r.rec) and r.outstanding < len(r.rec) else None
            elapsed = float(last) if last is not None else sent_at - r.t0
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            if progress is not None:
                progress.cancel()
                await asyncio.gather(progress, return_exceptions=True)
                _clear_progress()
        for row, fut in list(r.futs.items()):  # lost: stop waiting for them
            fut.cancel()
        r.close_sessions()
        if r.tasks:
            await asyncio.gather(*r.tasks, return_exceptions=True)
        notes.extend(f"error: {e}" for e in r.errors[:5])
        if r.closing:
            done = await asyncio.gather(*r.closing, return_exceptions=True)
            bad = sum(isinstance(d, BaseException) for d in done)
            if bad:
                notes.append(f"note: {bad} close_session call(s) got no ack")
    finally:
        if own:
            await client.close()
        if shm_pool is not None:
            shm_pool.close()
        if ipc_pool is not None:
            ipc_pool.close()
        logging.getLogger("mmsched.client").removeFilter(fallbacks)
        if fallbacks.count:
            notes.append(f"note: {fallbacks.count} feature(s) fell back from their pool to a fresh segment "
                         "(pool full: raise --pool-mb)")
    return _report(spec, r, elapsed, before, notes)


def _report(spec: LoadSpec, r: "_Run", elapsed: float, before: set[str], notes: list[str]) -> Report:
    leaked = _leaked(before, spec.shm_prefix)
    after = list_segments(spec.shm_prefix)
    segments = {"before": len(before), "after": len(after), "leaked": leaked,
                "others_appeared": len(after - before) - len(leaked)}
    spec_d = asdict(spec)
    spec_d["transports"] = list(spec.transports)
    return Report(spec_d, summarize(r.rec, elapsed), r.rec, segments, notes, error=r.stopped_by)


def run_sync(spec: LoadSpec) -> Report:
    """``run`` on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(run(spec))
    return uvloop.run(run(spec))


def _aligned(n: int) -> int:
    return max(64, -(-n // 64) * 64)


def _leaked(before: set[str], prefix: str, wait_s: float = 1.0) -> list[str]:
    """Segments this process created that are still there (after a short grace for the last unlinks)."""
    mine = f"{prefix}{os.getpid()}_"
    deadline = time.monotonic() + wait_s
    while True:
        left = sorted(n for n in list_segments(prefix) - before if n.startswith(mine))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


class _FallbackCounter(logging.Filter):
    """Counts (and silences) the client's per-request pool-full warnings."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(("shm_pool_full", "ipc_pool_full")):
            self.count += 1
            return False
        return True


async def _progress(r: _Run) -> None:
    spec = r.spec
    while True:
        await asyncio.sleep(0.2)
        el = time.perf_counter() - r.t0
        frac = min(1.0, max(len(r.rec) / (spec.requests or math.inf), el / spec.duration))
        done = len(r.rec) - r.outstanding
        bar = "#" * int(frac * 30)
        line = (f"[{bar:<30}] sent {len(r.rec)}{f'/{spec.requests}' if spec.requests else ''} done {done} in flight {r.outstanding} "
                f"{done / el if el else 0:.0f} req/s {el:.1f}s")
        sys.stderr.write("\r" + line + "\x1b[K")
        sys.stderr.flush()


def _clear_progress() -> None:
    sys.stderr.write("\r\x1b[K")
    sys.stderr.flush()


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
