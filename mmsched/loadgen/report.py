"""A run's ``Report`` (the summary and the raw rows, kept apart), its table and its JSON."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from .records import Records


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
                and not self.summary["unexpected"] and self.error is None)

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
                                 ("200s with bytes that were not sent", s["mismatched"]),
                                 (f"{s['unexpected']} results of a status their kind should not get "
                                  "(see 'by kind')", s["unexpected"])) if bad]
    verdict = "OK" if report.ok else "FAIL: " + ", ".join(problems + ([report.error] if report.error else []))
    lines.append(verdict)
    return "\n".join(lines)


def write_json(report: Report, path: str) -> None:
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

