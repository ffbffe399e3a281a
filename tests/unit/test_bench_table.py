"""bench/run.py's table survives a run in which a target completed nothing (rate 0)."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_bench_run():
    spec = importlib.util.spec_from_file_location("bench_run", os.path.join(ROOT, "bench", "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dead_run() -> dict:
    return {"rate": 0.0, "sent": 10, "completed": 0, "lost": 10, "p50_ms": None, "p99_ms": None,
            "statuses": {}, "leaked": 0, "ok": False}


def test_a_zero_rate_gives_a_table_not_a_crash():
    bench = load_bench_run()
    tput = [{"workload": "text-only", "concurrency": 128, "bare": dead_run(), "tp1": dead_run(), "tp2": dead_run()}]
    assert bench.latency({}, tput, quick=True) == []  # nothing to halve: no load is run, no division by 0
    lat = [{"target": "tp1", "rate": 100.0, "ours": dead_run(), "bare": dead_run()}]
    text, rows = bench.table([], tput, lat, {}, {})
    assert "tp=1 text-only (C=128)" in text and "tp=1 text-only p50" in text
    assert {r["ratio"] for r in rows if r["section"] in ("throughput", "latency")} == {0.0}


def sync_run(p50, p99, lost=0) -> dict:
    return {"rate": 1000.0, "sent": 10, "completed": 10 - lost, "bad": 0, "lost": lost, "p50_ms": p50,
            "p99_ms": p99, "client_cores": 0.2}


def test_the_plain_clients_half_rate_rows_are_judged_against_the_2_ms_target():
    bench = load_bench_run()
    sync = {"closed": {}, "open": {},
            "half": {"tp1": {"rate": 3700.0, "ours": sync_run(0.9, 3.0), "bare": sync_run(0.3, 1.0)},
                     "tp2": {"rate": 2500.0, "ours": sync_run(None, None, lost=10), "bare": sync_run(0.3, 1.0)}}}
    _, rows = bench.table([], [], [], {}, {}, sync)
    half = {r["case"]: r["verdict"] for r in rows if "(0.5 x max)" in r["case"]}
    assert half == {"tp=1 text-only p50 open loop @ 3700 req/s (0.5 x max)": "ok",
                    "tp=1 text-only p99 open loop @ 3700 req/s (0.5 x max)": "",
                    "tp=2 text-only p50 open loop @ 2500 req/s (0.5 x max)": "MISSED",  # nothing came back
                    "tp=2 text-only p99 open loop @ 2500 req/s (0.5 x max)": ""}


def test_the_floor_servers_rows_stand_beside_the_targets_without_a_verdict():
    bench = load_bench_run()
    sync = {"closed": {}, "open": {}, "half": {},
            "floor": {"1000": sync_run(0.55, 3.4), "10165": sync_run(0.83, 3.6)}}
    _, rows = bench.table([], [], [], {}, {}, sync)
    floor = {r["case"]: (r["ours"], r["target"], r["verdict"]) for r in rows if "floor server" in r["case"]}
    assert floor == {"tp=2 floor server, p50 open loop @ 1000 req/s": ("0.55 ms", None, ""),
                     "tp=2 floor server, p99 open loop @ 1000 req/s": ("3.40 ms", None, ""),
                     "tp=2 floor server, p50 open loop @ 10165 req/s": ("0.83 ms", None, ""),
                     "tp=2 floor server, p99 open loop @ 10165 req/s": ("3.60 ms", None, "")}


def test_the_gather_only_engines_rows_stand_beside_the_tp2_rows_without_a_verdict():
    bench = load_bench_run()
    sync = {"closed": {}, "open": {}, "half": {},
            "gather_only": {"closed": {"rate": 30000.0}, "open": [
                {"rate": 11000.0, "own_half": False, "result": sync_run(1.8, 4.1)},
                {"rate": 15000.0, "own_half": True, "result": sync_run(2.1, 4.9)}]}}
    _, rows = bench.table([], [], [], {}, {}, sync)
    got = {r["case"]: (r["ours"], r["target"], r["verdict"]) for r in rows if "gather-only" in r["case"]}
    assert got == {"tp=2 gather-only engine, throughput (256 in flight)": ("30000 req/s", None, ""),
                   "tp=2 gather-only engine, p50 open loop @ 11000 req/s": ("1.80 ms", None, ""),
                   "tp=2 gather-only engine, p99 open loop @ 11000 req/s": ("4.10 ms", None, ""),
                   "tp=2 gather-only engine, p50 open loop @ 15000 req/s (0.5 x its max)": ("2.10 ms", None, ""),
                   "tp=2 gather-only engine, p99 open loop @ 15000 req/s (0.5 x its max)": ("4.90 ms", None, "")}
