"""Soak: many requests at tp = 2 with injected failures on every rank and stage, and aborts,
through a bounded window. Features travel as fresh segments, slices of one shared pool,
inline frames, and slices of 96 client pools (3x what a rank keeps open), and every 200's
digests are checked against the client's own. Afterwards: every request got exactly one
result of the kind its fate calls for, /dev/shm is as it was, and the ranks' memory
stopped growing. ``test_loadtest_verify_soak`` runs ``mmsched loadtest --verify`` too.

Marked slow (``make soak``). ``MMSCHED_SOAK_REQUESTS`` sets the count (default 100,000).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from collections import Counter

import pytest
import torch

from mmsched.client import Client, inline, pooled, raw, shm
from mmsched.producers import ShmPool
from mmsched.transport.shm_pool import PoolCache

from ..conftest import Server
from .lifecycle import my_segments, sha256_of

pytestmark = pytest.mark.slow

N = int(os.environ.get("MMSCHED_SOAK_REQUESTS", "100000"))
WINDOW = 256              # requests in flight, all clients together
CLIENTS = 4
TIME_LIMIT_S = 25 * 60
FAIL_RATE, ABORT_RATE = 0.10, 0.05
RSS_GROWTH_LIMIT = 0.05

# fate of a request: its rid prefix, and the rank that fails it (None: it succeeds)
FAILURES = {
    "f-open1": 1, "f-open0": 0,     # cannot open its features
    "f-mat0": 0, "f-mat1": 1,       # cannot materialize them
    "f-eng1": 1, "f-eng0": 0,       # the engine step fails on that rank
    "f-rel0": None, "f-rel1": None,  # releasing fails (logged); the request itself succeeds
}
ARGS = ["--tp", "2", "--max-batch", "64",
        "--fault", "1:open:f-open1-*", "--fault", "0:open:f-open0-*",
        "--fault", "0:materialize:f-mat0-*", "--fault", "1:materialize:f-mat1-*",
        "--fault", "1:engine:f-eng1-*", "--fault", "0:engine:f-eng0-*",
        "--fault", "0:release:f-rel0-*", "--fault", "1:release:f-rel1-*"]


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        m = re.search(r"^VmRSS:\s+(\d+) kB", fh.read(), re.M)
    assert m, f"no VmRSS for pid {pid}"
    return int(m.group(1))


def plan(n: int, seed: int = 20240601) -> list[str]:
    """Each request's fate: 'ok', 'abort', or a failure kind, spread evenly and shuffled."""
    rng = random.Random(seed)
    kinds = list(FAILURES)
    fates = []
    for i in range(n):
        u = rng.random()
        fates.append(kinds[i % len(kinds)] if u < FAIL_RATE else "abort" if u < FAIL_RATE + ABORT_RATE else "ok")
    return fates


@pytest.mark.timeout(TIME_LIMIT_S + 300)
async def test_soak(tmp_path):
    fates = plan(N)
    features = [torch.randn(*shape, generator=torch.Generator().manual_seed(k))
                for k, shape in enumerate([(4, 4), (8, 16), (16, 16), (3, 5, 7), (64,), (2, 128)] * 4)]
    digests = [sha256_of(t) for t in features]
    own = [ShmPool(4096) for _ in range(3 * PoolCache.LIMIT)]  # pool j holds features[j % len(features)]
    own_items = []
    for j, pool in enumerate(own):
        t = features[j % len(features)]
        own_items.append({"modality": "image", "transport": "shm", "shm_name": pool.name, "offset": pool.put(t),
                          "pooled": True, "dtype": "float32", "shape": list(t.shape)})
    shared = ShmPool(8 << 20)
    srv = Server(*ARGS, tmp_dir=str(tmp_path))
    try:
        srv.wait_ready(timeout=120)
        pids = srv.rank_pids()
        mark = min(10_000, max(1, N // 10))
        rss_mark: dict[int, int] = {}
        rss_series: list[tuple[int, list[int]]] = []
        results: dict[int, tuple[int, str]] = {}
        wrong: list[str] = []
        next_i, done = 0, 0
        start = time.monotonic()
        deadline = start + TIME_LIMIT_S
        clients = [Client(srv.addr, timeout=120, shm_pool=shared) for _ in range(CLIENTS)]
        for c in clients:
            await c.__aenter__()

        async def worker(c: Client, rng: random.Random) -> None:
            nonlocal next_i, done
            while next_i < N:
                assert time.monotonic() < deadline, f"soak over {TIME_LIMIT_S} s after {done} results"
                i, next_i = next_i, next_i + 1
                fate = fates[i]
                k = i % len(features)
                rid = f"{fate}-{i}" if fate in FAILURES else f"r-{fate}-{i}"
                how = (i // 7) % 4
                if how == 3:  # one of the client's own pools, and the feature it holds
                    j = i % len(own)
                    k = j % len(features)
                    feat = raw(own_items[j])
                else:
                    feat = (shm, pooled, inline)[how](features[k])
                fut = c.send_request("embed", [i % 4000 + 1, 7], [feat], rid=rid, want_digest=True)
                if fate == "abort":
                    await asyncio.sleep(rng.choice([0, 0, 0.0005, 0.002, 0.01]))
                    await c.abort(rid)
                r = await c.wait(rid, fut, 120)
                assert i not in results, f"request {i} answered twice"
                results[i] = (r.status, fate)
                expected_rank = FAILURES.get(fate, None)
                if fate in ("ok", "f-rel0", "f-rel1") or (fate == "abort" and r.status == 200):
                    if r.status != 200 or r.meta.get("digests") != [digests[k]]:
                        wrong.append(f"{rid}: {r.status} {r.message} {r.meta}")
                elif fate == "abort":
                    if r.status != 499:
                        wrong.append(f"{rid}: {r.status} {r.message}")
                elif r.status != 500 or r.meta.get("failed_ranks") != [expected_rank]:
                    wrong.append(f"{rid}: {r.status} {r.message} {r.meta}")
                done += 1
                if done == mark:
                    rss_mark.update({pid: vm_rss_kib(pid) for pid in pids})
                if done % max(1, N // 10) == 0:
                    rss_series.append((done, [vm_rss_kib(pid) for pid in pids]))

        rngs = [random.Random(s) for s in range(WINDOW)]
        try:
            await asyncio.gather(*(worker(clients[w % CLIENTS], rngs[w]) for w in range(WINDOW)))
            elapsed = time.monotonic() - start
            rss_end = {pid: vm_rss_kib(pid) for pid in pids}
            for c in clients:  # a second result for anything would be here by the pong
                await c.ping(timeout=30)
                assert c.unrouted == [], [(r.rid, r.status) for r in c.unrouted[:5]]
        finally:
            for c in clients:
                await c.close()
        assert srv.stop(timeout=120) == 0
        logs = srv.logs()
    finally:
        srv.kill_all()
        for pool in (*own, shared):
            pool.close()

    by_status = Counter(s for s, _ in results.values())
    by_fate = Counter(f for _, f in results.values())
    aborts = Counter(s for s, f in results.values() if f == "abort")
    stopped = re.search(r"stopped results=\"?\{([^}]*)\}", logs)
    print(f"\nsoak: {N} requests in {elapsed:.1f} s = {N / elapsed:.0f} requests/s, window {WINDOW}, "
          f"{CLIENTS} clients")
    print(f"soak: results by status {dict(sorted(by_status.items()))}; by fate {dict(sorted(by_fate.items()))}; "
          f"aborts answered {dict(sorted(aborts.items()))}")
    print(f"soak: server counted {stopped.group(1) if stopped else '?'}")
    print("soak: VmRSS MiB per rank along the way: "
          + ", ".join(f"{n}: " + "/".join(f"{k / 1024:.1f}" for k in kib) for n, kib in rss_series))
    for pid in pids:
        a, b = rss_mark[pid], rss_end[pid]
        print(f"soak: rank pid {pid} VmRSS at request {mark}: {a / 1024:.1f} MiB, at the end: {b / 1024:.1f} MiB "
              f"({(b - a) / a:+.2%})")

    assert len(results) == N, f"{N - len(results)} requests without a result"
    assert not wrong, f"{len(wrong)} requests got the wrong result, e.g. {wrong[:5]}"
    assert set(by_status) <= {200, 499, 500}, by_status
    assert stopped, "no 'stopped results=' line in the server log"
    server_counts = {int(k): int(v) for k, v in re.findall(r"(\d+): (\d+)", stopped.group(1))}
    assert server_counts == dict(by_status), (server_counts, by_status)
    assert "Traceback" not in logs and "group_broken" not in logs
    # every segment of the soak carries this process's pid; the autouse guard (conftest) checks
    # that /dev/shm as a whole is as it was before the test
    assert my_segments() == set(), sorted(my_segments())[:5]
    for pid in pids:
        growth = (rss_end[pid] - rss_mark[pid]) / rss_mark[pid]
        assert growth < RSS_GROWTH_LIMIT, f"rank pid {pid} grew {growth:.1%} after request {mark}"


@pytest.mark.timeout(TIME_LIMIT_S + 300)
def test_loadtest_verify_soak(tmp_path):
    """``mmsched loadtest --verify`` for N requests at tp=2: every transport, two-turn sessions,
    server and client faults, aborts. Exit 0 means no result lost, no leak, and no 200
    whose digests differ from the SHA-256 of the bytes the load generator sent."""
    import json
    import subprocess
    import sys

    out = tmp_path / "verify.json"
    with Server("--tp", "2", "--fault", "1:materialize:fail-*", tmp_dir=str(tmp_path), ready_timeout=120) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "mmsched", "loadtest", "--frontend", srv.addr, "--verify", "--quiet",
             "--requests", str(N), "--duration", str(TIME_LIMIT_S), "--concurrency", str(WINDOW),
             "--transport", "pooled,shm,inline,cuda_ipc", "--items", "2", "--item-bytes", "1K,8K,64K",
             "--session-turns", "2", "--fail-rate", "0.05", "--client-faults", "0.05", "--abort-rate", "0.05",
             "--json", str(out)],
            capture_output=True, text=True, timeout=TIME_LIMIT_S + 120)
        print("\n" + proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())["summary"]
    assert s["sent"] == N and s["lost"] == 0 and s["mismatched"] == 0 and s["unexpected"] == 0, s
    assert s["verified"] == s["by_status"]["200"]["count"], s
