"""bench/materialize.py runs end to end: every approach read the client's bytes, and every
row carries a ratio to the copy (what ``make bench`` reports against the issue's targets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("fresh", "pooled", "memfd", "mapped")


def test_bench_materialize_prints_a_row_per_size(tmp_path):
    out = tmp_path / "materialize.json"
    proc = subprocess.run(  # 2 MiB: big enough for the ranks' reused buffers (Buffers.MIN is 1 MiB)
        [sys.executable, os.path.join(ROOT, "bench", "materialize.py"), "--sizes", "64K,2M",
         "--budget", "0.05", "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the bench asserts each approach's bytes first
    printed = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [row[:2] for row in printed] == [["64", "KiB"], ["2", "MiB"]], proc.stdout
    rows = json.loads(out.read_text())
    assert [r["bytes"] for r in rows] == [64 << 10, 2 << 20]
    assert rows[1]["buffers_reused"] > 0  # 2 MiB: read into the buffers a rank reuses, as the copy is
    for r in rows:
        assert r["rounds"] >= 3 and r["copy_gbps"] > 0
        for kind in KINDS:
            assert r[f"{kind}_gbps"] > 0 and r[f"{kind}_ratio"] > 0, (kind, r)
