"""The raw per-request rows of a run, and ``summarize``, the pure summary read from them."""

from __future__ import annotations

import math

import numpy as np

from .spec import EXPECTED, LOST


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
