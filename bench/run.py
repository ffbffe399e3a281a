"""``make bench``: every figure a ratio against a ceiling measured in the same run, on this machine.

    .venv/bin/python bench/run.py [--quick] [--json bench/results.json] [--budget-s 360]

1. materialization (bench/materialize.py): GB/s of a fresh shm segment, of a pooled shm and a memfd pool
   slice, opened as a rank opens them (warm caches, reused buffers), against an in-process copy
   into a reused buffer, 64 KiB to 64 MiB; the approaches take turns, round by round;
2. throughput: the load generator (closed loop, fixed concurrency, bounded by count and
   time) against mmsched at tp=1 and tp=2 and against a bare ROUTER that only decodes
   and answers (bench/bare_router.py), for text-only requests and one 64 KiB shm, 1 MiB
   shm, 1 MiB inline and 1 MiB pooled item; best of two interleaved rounds each;
3. latency: p50/p99 in an open loop at half of mmsched's measured maximum (tp=1 and
   tp=2, text-only), against the bare ROUTER at the same rate;
4. consensus: bench/consensus.py (per-request all_gather_object against one batched
   all-gather), when it is there, and its floor: one gloo all-gather between two idle rank
   processes, p50/p99, which every tp=2 batch with features pays, and every batch of a group
   across hosts (ranks on one host gather a text-only batch through shared memory);
5. remote: bench/remote.py (shipping host-bound features to a rank on another host
   against one gloo broadcast of the same bytes), when it is there;
6. sync client: bench/sync_client.py, a plain synchronous pyzmq DEALER (no asyncio, not
   our load generator): text-only throughput with 256 in flight, and p50/p99 in an open
   loop at 1000 req/s, each against the bare ROUTER; then the same open loops against
   bench/floor_server.py, a tp=2 server doing only a ROUTER and one gloo all-gather a batch
   (what a tp=2 batch across hosts must): a floor row beside the tp=2 latency targets;
   and mmsched at tp=2 serving bench/gather_engine.py (no arithmetic, one ``ctx.gather`` a
   step) at tp2's half rate and at half its own maximum: the scheduler's share of those rows.
   Its half-maximum runs also print where the server's CPU went, per rank and thread role
   (bench/thread_cpu.py, from /proc: the profile behind a missed latency row, at no cost).

Targets are issue 13's; a ratio target is ">=", a latency target is in ms.

Prints one table and writes the raw figures to bench/results.json. Servers use their
own shm prefix (``mmbench_``), so a test run on the same machine cannot take their
segments. Everything is bounded: each load run by count and time, the whole by
``--budget-s`` (later sections are skipped, and said so, when it runs out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import msgpack  # noqa: E402
import zmq  # noqa: E402

from mmsched import loadgen  # noqa: E402
from mmsched.loadgen import LoadSpec  # noqa: E402
import thread_cpu  # noqa: E402  (bench/, on the path above)

PREFIX = "mmbench_"
KiB, MiB = 1 << 10, 1 << 20
# name, items, item bytes, transport, concurrency
WORKLOADS = [
    ("text-only", 0, 0, "shm", 128),
    ("1 x 64 KiB shm", 1, 64 * KiB, "shm", 128),
    ("1 x 1 MiB shm", 1, MiB, "shm", 32),
    ("1 x 1 MiB inline", 1, MiB, "inline", 32),
    ("1 x 1 MiB pooled", 1, MiB, "pooled", 32),
]
TARGETS = {("throughput", 1, "text-only"): 0.50, ("throughput", 2, "text-only"): 0.35,
           ("materialize", "fresh", 16 * MiB): 0.30, ("materialize", "pooled", 16 * MiB): 0.70,
           ("materialize", "memfd", 16 * MiB): 0.70}
SYNC_RATE = 1000.0                      # the open loop's fixed rate, req/s
SYNC_TARGETS = {1: 0.50, 2: 0.35}       # closed-loop throughput vs the bare ROUTER
SYNC_P50_SLACK_MS = {1: 0.5, 2: 1.0}    # open-loop p50 <= the bare ROUTER's + this
P99_MAX_MS, HALF_RATE_P50_MS = 5.0, 2.0


# ---------------------------------------------------------------- servers

class Proc:
    """A server subprocess of this benchmark (its own session; killed by pid group at the end)."""

    def __init__(self, name: str, argv: list[str], log_dir: str):
        self.name = name
        self.addr = f"ipc:///tmp/mmbench-{name}-{uuid.uuid4().hex[:8]}.sock"
        self.log_path = os.path.join(log_dir, f"{name}.log")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MMSCHED_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, *argv, *self._addr_args()], stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)

    def _addr_args(self) -> list[str]:
        return ["--frontend", self.addr] if self.name != "bare" else [self.addr]

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        ctx = zmq.Context.instance()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.logs()[-2000:]}")
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            try:
                s.connect(self.addr)
                s.send(msgpack.packb({"v": 1, "type": "ping"}))
                if s.poll(500):
                    s.recv()
                    return
            finally:
                s.close(0)
        raise TimeoutError(f"{self.name} not ready after {timeout}s: {self.logs()[-2000:]}")

    def logs(self) -> str:
        with open(self.log_path, "rb") as fh:
            return fh.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


SERVE = ["-m", "mmsched", "serve", "--shm-prefix", PREFIX, "--sweep-interval", "0"]


def start_servers(log_dir: str) -> dict[str, Proc]:
    procs = {"bare": Proc("bare", [os.path.join(HERE, "bare_router.py"), "--shm-prefix", PREFIX,
                                   "--max-seconds", "900"], log_dir),
             "tp1": Proc("tp1", SERVE, log_dir),
             "tp2": Proc("tp2", [*SERVE, "--tp", "2"], log_dir)}
    for p in procs.values():
        p.wait_ready()
    return procs


# ---------------------------------------------------------------- load runs

def load(addr: str, items: int, nbytes: int, transport: str, *, concurrency: int | None = None,
         rate: float | None = None, requests: int, duration: float, seed: int = 0) -> dict:
    spec = LoadSpec(frontend=addr, concurrency=concurrency, rate=rate, requests=requests, duration=duration,
                    drain_s=15.0, items=items, item_bytes=[nbytes or 1], transports=[transport], seed=seed,
                    shm_prefix=PREFIX)
    cpu, wall = time.process_time(), time.perf_counter()
    rep = loadgen.run_sync(spec)
    cores = (time.process_time() - cpu) / (time.perf_counter() - wall)  # the client's own share of the host
    s = rep.summary
    out = {"rate": s["achieved_rate"], "sent": s["sent"], "completed": s["completed"], "lost": s["lost"],
           "client_cores": cores,
           "p50_ms": s["latency_ms"]["p50"], "p99_ms": s["latency_ms"]["p99"],
           "statuses": {str(k): v["count"] for k, v in s["by_status"].items()},
           "leaked": len(rep.segments["leaked"]), "ok": rep.ok and set(s["by_status"]) <= {200}}
    if not out["ok"]:
        out["notes"] = rep.notes
    return out


def throughput(procs: dict[str, Proc], quick: bool, deadline: float) -> list[dict]:
    rows = []
    rounds, dur = (1, 1.5) if quick else (2, 3.0)
    for name, items, nbytes, transport, conc in WORKLOADS:
        best: dict[str, dict] = {}
        for target in ("bare", "tp1", "tp2"):  # warm-up: pools mapped, caches hot
            load(procs[target].addr, items, nbytes, transport, concurrency=conc, requests=200, duration=2)
        for rnd in range(rounds):
            for target in ("bare", "tp1", "tp2"):
                r = load(procs[target].addr, items, nbytes, transport, concurrency=conc, requests=200_000,
                         duration=dur, seed=rnd)
                if target not in best or r["rate"] > best[target]["rate"]:
                    best[target] = r
        rows.append({"workload": name, "concurrency": conc, **{t: best[t] for t in best}})
        print(f"  throughput {name:<18} bare {best['bare']['rate']:>8.0f}  tp1 {best['tp1']['rate']:>8.0f}  "
              f"tp2 {best['tp2']['rate']:>8.0f} req/s", file=sys.stderr, flush=True)
        if time.monotonic() > deadline:
            print("  (time budget spent: remaining throughput workloads skipped)", file=sys.stderr)
            break
    return rows


def latency(procs: dict[str, Proc], tput: list[dict], quick: bool) -> list[dict]:
    text = next((r for r in tput if r["workload"] == "text-only"), None)
    if text is None:
        return []
    rows = []
    dur = 2.0 if quick else 4.0
    for target in ("tp1", "tp2"):
        rate = 0.5 * text[target]["rate"]
        if rate <= 0:  # nothing completed: no rate to halve, so no latency row (the throughput row says why)
            print(f"  latency {target}: skipped, its throughput run completed nothing", file=sys.stderr, flush=True)
            continue
        ours = load(procs[target].addr, 0, 0, "shm", rate=rate, requests=int(rate * dur) + 1, duration=dur + 1)
        bare = load(procs["bare"].addr, 0, 0, "shm", rate=rate, requests=int(rate * dur) + 1, duration=dur + 1)
        rows.append({"target": target, "rate": rate, "ours": ours, "bare": bare})
        print(f"  latency {target} @ {rate:.0f} req/s: p50 {ours['p50_ms']:.2f} ms p99 {ours['p99_ms']:.2f} ms "
              f"(bare {bare['p50_ms']:.2f} / {bare['p99_ms']:.2f}; the load generator used "
              f"{ours['client_cores']:.2f} cores)", file=sys.stderr, flush=True)
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def sync_client(procs: dict[str, Proc], quick: bool, log_dir: str) -> dict:
    """The plain synchronous client against bare, tp1, tp2: closed-loop rate, open-loop latency;
    then against the floor server (bench/floor_server.py) at the rates tp2 was measured at."""
    import sync_client as sc

    secs = 1.5 if quick else 3.0
    out: dict = {"closed": {}, "open": {}}
    for target in ("bare", "tp1", "tp2"):
        sc.closed(procs[target].addr, 0.5)  # warm-up
        out["closed"][target] = sc.closed(procs[target].addr, secs)
    for target in ("bare", "tp1", "tp2"):
        out["open"][target] = sc.open_loop(procs[target].addr, SYNC_RATE, secs)
    c, o = out["closed"], out["open"]
    print(f"  sync client closed: bare {c['bare']['rate']:.0f} tp1 {c['tp1']['rate']:.0f} "
          f"tp2 {c['tp2']['rate']:.0f} req/s; open @ {SYNC_RATE:.0f}: p50 bare {_ms(o['bare']['p50_ms'])} "
          f"tp1 {_ms(o['tp1']['p50_ms'])} tp2 {_ms(o['tp2']['p50_ms'])} ms (the client used "
          f"{max(r['client_cores'] for r in o.values()):.2f} cores at most)", file=sys.stderr, flush=True)
    out["half"] = {}
    for target in ("tp1", "tp2"):  # half of its own closed-loop maximum, as the load generator's rows
        rate = 0.5 * c[target]["rate"]
        if rate <= 0:  # as latency(): the closed-loop row says why
            print(f"  sync client {target} half rate: skipped, its closed loop completed nothing",
                  file=sys.stderr, flush=True)
        else:
            addr = procs[target].addr
            ours, cpu = thread_cpu.measure(procs[target].proc.pid, lambda: sc.open_loop(addr, rate, secs))
            h = out["half"][target] = {"rate": rate, "ours": ours, "cpu": cpu,
                                       "bare": sc.open_loop(procs["bare"].addr, rate, secs)}
            print(f"  sync client {target} @ {rate:.0f} req/s (0.5 x max): p50 {_ms(h['ours']['p50_ms'])} ms "
                  f"p99 {_ms(h['ours']['p99_ms'])} ms (bare {_ms(h['bare']['p50_ms'])} / {_ms(h['bare']['p99_ms'])}; "
                  f"the client used {h['ours']['client_cores']:.2f} cores); where the server's CPU went: "
                  f"{thread_cpu.line(cpu)}", file=sys.stderr, flush=True)
    out["floor"] = _floor(out, secs, log_dir)
    out["gather_only"] = _gather_only(out, secs, log_dir)
    return out


def _served(name: str, argv: list[str], log_dir: str, measure) -> dict:
    """``measure(addr)`` against a server started only for it (its ranks would take CPU from the
    other runs); {} where it did not start, and why, on stderr."""
    proc = Proc(name, argv, log_dir)
    try:
        proc.wait_ready()
        return measure(proc.addr)
    except (RuntimeError, TimeoutError) as exc:
        print(f"  {name}: {exc}", file=sys.stderr, flush=True)
        return {}
    finally:
        proc.stop()


def _floor(out: dict, secs: float, log_dir: str) -> dict:
    """The floor server's p50/p99 at SYNC_RATE and at tp2's half rate."""
    import sync_client as sc

    rates = [SYNC_RATE] + ([out["half"]["tp2"]["rate"]] if "tp2" in out["half"] else [])
    got = _served("floor", [os.path.join(HERE, "floor_server.py")], log_dir,
                  lambda addr: {f"{rate:.0f}": sc.open_loop(addr, rate, secs) for rate in rates})
    if got:
        print("  floor server (tp=2): " + ", ".join(f"@ {k} req/s p50 {_ms(v['p50_ms'])} p99 {_ms(v['p99_ms'])} ms"
                                                    for k, v in got.items()), file=sys.stderr, flush=True)
    return got


def _gather_only(out: dict, secs: float, log_dir: str) -> dict:
    """mmsched at tp=2 serving bench/gather_engine.py (no arithmetic, the step's one all-gather):
    its closed loop, then p50/p99 at tp2's half rate and at half its own maximum. Beside the
    tp=2 rows, the same minutes: the scheduler's share of them; the rest is the reference
    engine's numpy and torch on rank 0's CPU."""
    import sync_client as sc

    def measure(addr: str) -> dict:
        sc.closed(addr, 0.5)  # warm-up
        closed = sc.closed(addr, secs)
        runs = [(out["half"]["tp2"]["rate"], False)] if "tp2" in out["half"] else []
        runs += [(0.5 * closed["rate"], True)] if closed["rate"] > 0 else []
        return {"closed": closed, "open": [{"rate": rate, "own_half": own, "result": sc.open_loop(addr, rate, secs)}
                                           for rate, own in runs]}

    got = _served("tp2-gather", [*SERVE, "--tp", "2", "--engine", "bench.gather_engine:GatherEngine"], log_dir,
                  measure)
    if got:
        print(f"  tp=2 with the gather-only engine: closed {got['closed']['rate']:.0f} req/s; " + ", ".join(
            f"@ {o['rate']:.0f} req/s p50 {_ms(o['result']['p50_ms'])} p99 {_ms(o['result']['p99_ms'])} ms"
            for o in got["open"]), file=sys.stderr, flush=True)
    return got


def sub_bench(tmp: str, name: str, args: list[str], timeout: float = 240.0) -> dict:
    """Run another benchmark of bench/ (``--json``); its rows, or why there are none."""
    script = os.path.join(HERE, f"{name}.py")
    if not os.path.exists(script):
        return {"missing": True}
    out = os.path.join(tmp, f"{name}.json")
    try:
        proc = subprocess.run([sys.executable, script, *args, "--json", out], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"bench/{name}.py ran past {timeout:.0f} s"}
    if proc.returncode != 0 or not os.path.exists(out):
        return {"error": f"bench/{name}.py exited {proc.returncode}: {proc.stderr[-500:]}"}
    with open(out) as fh:
        got = json.load(fh)
    return {"rows": got.get("rows", []), "floors": got.get("floors", []), "table": proc.stdout}


def consensus(tmp: str, quick: bool) -> dict:
    return sub_bench(tmp, "consensus", ["--tp", "2", "--batches", "1,8,64", "--budget", "0.2" if quick else "0.4"])


def remote(tmp: str, quick: bool) -> dict:
    return sub_bench(tmp, "remote", ["--sizes", "64K,1M,16M", "--budget", "0.3" if quick else "0.6"])


# ---------------------------------------------------------------- the one table

def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _sync_rows(add, sync: dict) -> None:
    """The plain synchronous client's rows: closed-loop throughput, open-loop p50/p99 at SYNC_RATE
    and at half its own closed-loop maximum (the load generator's latency rows, with a light client)."""
    closed, opened = sync.get("closed", {}), sync.get("open", {})
    for tp in (1, 2):
        ours, bare = closed.get(f"tp{tp}"), closed.get("bare")
        if ours and bare:
            add("sync client", f"tp={tp} text-only throughput (256 in flight)", f"{ours['rate']:.0f} req/s",
                f"{bare['rate']:.0f} req/s", ours["rate"] / bare["rate"] if bare["rate"] else 0.0,
                SYNC_TARGETS[tp], "bare ROUTER")
    for tp in (1, 2):
        ours, bare = opened.get(f"tp{tp}"), opened.get("bare")
        if ours and bare:
            _open_rows(add, tp, f"{SYNC_RATE:.0f} req/s", ours, bare,
                       {"p50": (bare["p50_ms"] or 0.0) + SYNC_P50_SLACK_MS[tp], "p99": P99_MAX_MS})
    for tp in (1, 2):
        half = sync.get("half", {}).get(f"tp{tp}")
        if half:
            _open_rows(add, tp, f"{half['rate']:.0f} req/s (0.5 x max)", half["ours"], half["bare"],
                       {"p50": HALF_RATE_P50_MS, "p99": None})


def _open_rows(add, tp: int, at: str, ours: dict, bare: dict, limits: dict) -> None:
    """One open loop's p50 and p99 rows beside the bare ROUTER's at the same rate."""
    for q in ("p50", "p99"):
        o, b = ours[f"{q}_ms"], bare[f"{q}_ms"]
        add("sync client", f"tp={tp} text-only {q} open loop @ {at}",
            "-" if o is None else f"{o:.2f} ms", "-" if b is None else f"{b:.2f} ms",
            b / o if o and b else 0.0, None, "bare ROUTER, same rate", limit_ms=limits[q],
            ms=None if ours["bad"] or ours["lost"] else o)  # a non-200 or lost reply misses the target


def table(mat: list[dict], tput: list[dict], lat: list[dict], cons: dict, rem: dict,
          sync: dict | None = None) -> tuple[str, list[dict]]:
    rows: list[dict] = []

    def add(section, case, ours, ceiling, ratio, target=None, ceiling_name="", limit_ms=None, ms=None):
        """``target``: ratio >= it; ``limit_ms``: ``ms`` (our latency) <= it."""
        verdict = "" if target is None else ("ok" if ratio >= target else "MISSED")
        if limit_ms is not None:
            verdict = "ok" if ms is not None and ms <= limit_ms else "MISSED"
        rows.append({"section": section, "case": case, "ours": ours, "ceiling": ceiling,
                     "ceiling_name": ceiling_name, "ratio": ratio, "target": target, "limit_ms": limit_ms,
                     "verdict": verdict})

    for r in tput:
        for tp in (1, 2):
            ours, bare = r[f"tp{tp}"], r["bare"]
            add("throughput", f"tp={tp} {r['workload']} (C={r['concurrency']})", f"{ours['rate']:.0f} req/s",
                f"{bare['rate']:.0f} req/s", ours["rate"] / bare["rate"] if bare["rate"] else 0.0,
                TARGETS.get(("throughput", tp, r["workload"])), "bare ROUTER")
    for r in mat:
        for kind, label in (("fresh", "fresh shm"), ("pooled", "pooled shm"), ("memfd", "memfd pool (sealed, mapped)"),
                            ("mapped", "pool mapping, one numpy copy (reference)")):
            add("materialize", f"{_size(r['bytes'])} {label}", f"{r[kind + '_gbps']:.2f} GB/s",
                f"{r['copy_gbps']:.2f} GB/s", r[f"{kind}_ratio"], TARGETS.get(("materialize", kind, r["bytes"])),
                "in-process copy")
    for r in lat:
        tp = r["target"][-1]
        for q in ("p50", "p99"):
            o, b = r["ours"][f"{q}_ms"] or 0.0, r["bare"][f"{q}_ms"] or 0.0  # None: no result came back
            add("latency", f"tp={tp} text-only {q} @ {r['rate']:.0f} req/s (0.5 x max)", f"{o:.2f} ms",
                f"{b:.2f} ms", b / o if o else 0.0, None, "bare ROUTER, same rate",
                limit_ms=HALF_RATE_P50_MS if q == "p50" else None, ms=o)
    _sync_rows(add, sync or {})
    if rem.get("rows"):
        for r in rem["rows"]:
            failed = f", {r['failed']} failed" if r.get("failed") else ""
            add("remote", f"ship {_size(r['bytes'])} in {r['items']} item(s){failed} to a remote host",
                f"{r['mmsched_mib_s']:.0f} MiB/s", f"{r['gloo_mib_s']:.0f} MiB/s", r["ratio"], 0.80,
                "one gloo broadcast of the bytes")
    elif not rem.get("skipped"):
        reason = "bench/remote.py not present" if rem.get("missing") else rem.get("error", "not run")
        rows.append({"section": "remote", "case": f"(placeholder: {reason})", "ours": "-", "ceiling": "-",
                     "ceiling_name": "", "ratio": None, "target": None, "verdict": ""})
    if cons.get("rows"):
        for r in cons["rows"]:
            what = "1 failure" if r["failures"] else "clean"
            add("consensus", f"tp={r['tp']} batch={r['batch']} {what}", f"{r['batched_us']:.2f} us/req",
                f"{r['reference_us']:.1f} us/req", r["ratio"], 100.0 if r["batch"] >= 64 else 1.0,
                "per-request all_gather_object")
    else:
        reason = "bench/consensus.py not present" if cons.get("missing") else cons.get("error", "not run")
        rows.append({"section": "consensus", "case": f"(placeholder: {reason})", "ours": "-", "ceiling": "-",
                     "ceiling_name": "", "ratio": None, "target": None, "verdict": ""})
    for rate, f in (sync or {}).get("floor", {}).items():  # a whole tp=2 server doing only what every batch must
        for q in ("p50", "p99"):
            rows.append({"section": "floor", "case": f"tp=2 floor server, {q} open loop @ {rate} req/s",
                         "ours": _ms(f[q + "_ms"]) + " ms", "ceiling": "-", "ratio": None, "target": None,
                         "ceiling_name": "ROUTER + one gloo all-gather a batch (bench/floor_server.py)",
                         "verdict": ""})
    _gather_only_rows(rows, (sync or {}).get("gather_only", {}))
    for f in cons.get("floors", []):  # what no batch at tp > 1 can beat: beside the latency targets
        for q in ("p50", "p99"):
            rows.append({"section": "floor", "case": f"tp={f['tp']} one all-gather of one flag, {q}, 1 ms apart",
                         "ours": f"{f[q + '_ms']:.2f} ms", "ceiling": "-", "ceiling_name": "two idle rank processes",
                         "ratio": None, "target": None, "verdict": ""})
    w = max(len(r["case"]) for r in rows)
    head = (f"{'section':<12} {'case':<{w}} {'mmsched':>14} {'ceiling':>14} {'ratio':>7} {'target':>8}  "
            "ceiling is")
    lines = [head, "-" * (len(head) + 20)]
    last = None
    for r in rows:
        if last is not None and r["section"] != last:
            lines.append("")
        last = r["section"]
        ratio = "-" if r["ratio"] is None else (f"{r['ratio']:.1f}x" if r["section"] == "consensus"
                                                 else f"{r['ratio']:.2f}")
        target = "" if r["target"] is None else f">={r['target']:g}"
        target = f"<={r['limit_ms']:.1f}ms" if r.get("limit_ms") is not None else target
        lines.append(f"{r['section']:<12} {r['case']:<{w}} {r['ours']:>14} {r['ceiling']:>14} {ratio:>7} "
                     f"{target:>8}  {r['ceiling_name']}{'  ' + r['verdict'] if r['verdict'] else ''}")
    return "\n".join(lines), rows


def _gather_only_rows(rows: list[dict], got: dict) -> None:
    """The tp=2 server with the gather-only engine, no verdict: the scheduler's share of the
    tp=2 rows above it (the same client, rates and minutes)."""
    def row(case: str, ours: str) -> None:
        rows.append({"section": "floor", "case": f"tp=2 gather-only engine, {case}", "ours": ours, "ceiling": "-",
                     "ratio": None, "target": None, "verdict": "",
                     "ceiling_name": "mmsched, no engine arithmetic (bench/gather_engine.py)"})

    if got.get("closed"):
        row("throughput (256 in flight)", f"{got['closed']['rate']:.0f} req/s")
    for o in got.get("open", []):
        for q in ("p50", "p99"):
            row(f"{q} open loop @ {o['rate']:.0f} req/s{' (0.5 x its max)' if o['own_half'] else ''}",
                _ms(o["result"][q + "_ms"]) + " ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter runs (a smoke test of the benchmark itself)")
    p.add_argument("--json", default=os.path.join(HERE, "results.json"), help="where to write the figures")
    p.add_argument("--budget-s", type=float, default=360.0, help="stop starting new sections after this long")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: materialize,throughput,"
                                               "latency,sync,consensus,remote")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    import materialize as mat_mod

    mat, tput, lat, cons, sync = [], [], [], {"error": "skipped"}, {}
    with tempfile.TemporaryDirectory(prefix="mmbench-") as tmp:
        if "materialize" not in skip:
            print("materialization ...", file=sys.stderr, flush=True)
            mat = mat_mod.run([64 * KiB, MiB, 16 * MiB, 64 * MiB], 0.2 if args.quick else 0.5)
        if not skip >= {"throughput", "latency", "sync"}:
            print("starting servers (bare ROUTER, mmsched tp=1, tp=2) ...", file=sys.stderr, flush=True)
            procs = {}
            try:
                procs = start_servers(tmp)
                if "throughput" not in skip:
                    tput = throughput(procs, args.quick, deadline)
                if "latency" not in skip and time.monotonic() < deadline:
                    lat = latency(procs, tput, args.quick)
                if "sync" not in skip and time.monotonic() < deadline:
                    sync = sync_client(procs, args.quick, tmp)
            finally:
                for proc in procs.values():
                    proc.stop()
        if "consensus" not in skip and time.monotonic() < deadline:
            print("consensus ...", file=sys.stderr, flush=True)
            cons = consensus(tmp, args.quick)
        elif "consensus" not in skip:
            cons = {"error": "time budget spent"}
        rem = {"skipped": True}
        if "remote" not in skip and time.monotonic() < deadline:
            print("remote forwarding ...", file=sys.stderr, flush=True)
            rem = remote(tmp, args.quick)
        elif "remote" not in skip:
            rem = {"error": "time budget spent"}
    text, rows = table(mat, tput, lat, cons, rem, sync)
    elapsed = time.monotonic() - t0
    print(text)
    print(f"({elapsed:.0f} s on {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; ratio = mmsched / "
          "ceiling (latency: ceiling / mmsched; consensus: per-request / batched); best of 2 rounds for throughput)")
    doc = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                       "loadavg_end": os.getloadavg()},
           "elapsed_s": elapsed, "quick": args.quick, "table": rows, "materialize": mat, "throughput": tput,
           "latency": lat, "consensus": cons, "remote": rem, "sync_client": sync}
    with open(args.json, "w") as fh:
        json.dump(loadgen._finite(doc), fh, indent=1)
    bad = [r for r in tput for t in ("bare", "tp1", "tp2") if not r[t]["ok"]]
    if bad:
        print(f"warning: {len(bad)} throughput run(s) had lost results, leaks or non-200 statuses "
              f"(see {args.json})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
