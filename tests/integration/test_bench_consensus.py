"""bench/consensus.py runs end to end and the batched consensus beats the per-request one (sanity only)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_consensus_prints_a_table(tmp_path):
    out = tmp_path / "consensus.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "consensus.py"),
         "--tp", "2", "--batches", "1,64", "--budget", "0.2", "--json", str(out)],
        capture_output=True, text=True, timeout=150, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(re.match(r"\s*tp\s+batch\s+failures\s+reference µs/req\s+batched µs/req\s+ratio", l) for l in lines), proc.stdout
    # one printed row per (failures, batch): tp, batch, failures, two timings, ratio
    rows = [l.split() for l in lines if re.match(r"\s*2\s+(1|64)\s+[01]\s+[\d.]+\s+[\d.]+\s+[\d.]+x$", l)]
    assert len(rows) == 4, proc.stdout
    table = json.loads(out.read_text())["rows"]
    assert {(r["tp"], r["batch"], r["failures"]) for r in table} == {(2, b, f) for b in (1, 64) for f in (0, 1)}
    for r in table:
        assert r["reference_us"] > 0 and r["batched_us"] > 0
        assert r["ratio"] > 0  # the median of the rounds' ratios (the approaches alternate round by round)
    clean64 = next(r for r in table if r["batch"] == 64 and r["failures"] == 0)
    assert clean64["ratio"] > 1, clean64
    printed64 = next(r for r in rows if r[1] == "64" and r[2] == "0")
    assert float(printed64[5].rstrip("x")) == pytest.approx(clean64["ratio"], abs=0.051)
    [floor] = json.loads(out.read_text())["floors"]  # one all-gather: what every tp=2 batch pays
    assert floor["tp"] == 2 and 0 < floor["p50_ms"] <= floor["p99_ms"] and floor["calls"] >= 500
    assert re.search(r"floor, tp=2: one all-gather of one flag, p50 [\d.]+ ms, p99 [\d.]+ ms", proc.stdout)
