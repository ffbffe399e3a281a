"""Consensus cost: the reference systems' per-request agreement against mmsched's batched one.

    .venv/bin/python bench/consensus.py [--tp 2,4] [--batches 1,8,64] [--budget 0.6] [--json FILE]

For each group size a real gloo process group is spawned (127.0.0.1, one torch thread per
rank, each on its share of the CPUs with the scheduler slice a rank asks for and gloo's loop
threads lowered as a rank lowers them, built with ``mmsched.group.GlooGroup``). For each batch size both approaches agree
the same flags:

- reference: ``consensus.agree_per_request`` — one ``all_gather_object`` per request;
- batched:   ``consensus.agree`` — one tensor all-gather per batch (plus one
  ``all_gather_object`` of error strings only when one rank failed more requests than
  ``consensus.ERR_SLOTS``: one error string per failed request rides in the same all-gather).

Two row sets: ``clean`` (nothing failed) and ``1 failure`` (rank 1 fails the first request
of every batch, its error string rides in the batched all-gather). Every cell is warmed up,
then timed in rounds, the two approaches alternating round by round (the host's noise
drifts over seconds: so it falls on both); each figure is the median round, in µs per
request, and the ratio the median of the rounds' ratios. Each cell's timed part is about
``--budget`` seconds per approach (at least 3 batches), so on an idle
2-core machine the whole run takes well under a minute.

Then the floor: ``FLOOR_CALLS`` single all-gathers of one flag (``mmsched.group``'s, the
one a text-only batch pays at tp > 1), a millisecond apart as batches of a lightly loaded
server are, timed one by one: p50 and p99 in ms. No batch at tp > 1 can come back faster.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import numpy as np

ROUNDS = 5          # timed rounds per cell (fewer, down to MIN_ROUNDS, when one batch is slow)
MIN_ROUNDS = 3      # the reported figure is the median round
FLOOR_CALLS = 600   # single all-gathers timed for the floor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(batch: int, fail: bool, rank: int) -> tuple[np.ndarray, dict[int, str]]:
    flags = np.zeros(batch, dtype=np.int64)
    errors: dict[int, str] = {}
    if fail and rank == 1:
        flags[0] = 1
        errors[0] = "FileNotFoundError: [Errno 2] No such file or directory: '/dev/shm/mmsched_1_bench'"
    return flags, errors


def _worker(rank: int, world: int, port: int, batches: list[int], budget: float, out) -> None:
    from mmsched import consensus
    from mmsched.config import Config
    from mmsched.group import GlooGroup
    from mmsched.server import place_gloo, place_process
    from mmsched.timeslice import thread_ids

    cfg = Config()  # as a rank runs, before gloo starts its threads: its CPUs, its slice, one torch thread
    place_process(cfg, world, {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    before = thread_ids()
    group = GlooGroup(rank, world, f"tcp://127.0.0.1:{port}", timeout_s=60)
    place_gloo(cfg, before)  # and, the group up, its gloo loop threads below it
    barrier = np.zeros(8, dtype=np.uint8)  # one flag's bytes

    def agreed(*values: int) -> list[int]:
        """Rank 0's values, known to every rank (keeps the ranks in lockstep)."""
        buf = group.broadcast(",".join(map(str, values)).encode() if rank == 0 else None)
        return [int(v) for v in bytes(buf).decode().split(",")]

    approaches = {"reference": consensus.agree_per_request, "batched": consensus.agree}
    rows = []
    for fail in (False, True):
        for batch in batches:
            flags, errors = _flags(batch, fail, rank)
            row = {"tp": world, "batch": batch, "failures": int(fail)}
            verdicts, reps, times = {}, {}, {name: [] for name in approaches}
            for name, fn in approaches.items():
                # warm up, then size the rounds so the cell fits its time budget
                group.all_gather(barrier)
                verdicts[name] = fn(group, flags, errors)
                group.all_gather(barrier)
                t0 = time.perf_counter()
                fn(group, flags, errors)
                one = max(time.perf_counter() - t0, 1e-7)  # one batch
                reps[name] = max(1, int(budget / ROUNDS / one))
            *counts, rounds = agreed(*reps.values(), ROUNDS if min(reps.values()) > 1 else MIN_ROUNDS)
            reps = dict(zip(reps, counts))
            for _ in range(rounds):  # the approaches alternate round by round: the host's noise
                for name, fn in approaches.items():  # (it drifts over seconds) falls on both
                    group.all_gather(barrier)  # start every round together
                    t0 = time.perf_counter()
                    for _ in range(reps[name]):
                        fn(group, flags, errors)
                    times[name].append((time.perf_counter() - t0) / (reps[name] * batch) * 1e6)
            for name in approaches:
                row[f"{name}_us"] = statistics.median(times[name])
                row[f"{name}_batches"] = reps[name] * rounds
            # both approaches must reach the same verdict, or the comparison means nothing
            ref, ours = verdicts["reference"], verdicts["batched"]
            assert (ref.flags == ours.flags).all(), (ref.flags, ours.flags)
            for i in range(batch):
                assert ref.failed_ranks(i) == ours.failed_ranks(i)
                assert ref.message(i) == ours.message(i), (ref.message(i), ours.message(i))
            assert bool(ours.flags.any()) == fail
            row["ratio"] = statistics.median(r / b for r, b in zip(times["reference"], times["batched"]))
            rows.append(row)
    floor = _floor(group, barrier)
    group.all_gather(barrier)
    if rank == 0:
        out.put({"rows": rows, "floor": floor})
    group.close()


def _floor(group, flag) -> dict:
    """p50/p99 ms of one all-gather of one flag, a millisecond apart (after a warm-up)."""
    times = []
    for i in range(FLOOR_CALLS + 50):
        time.sleep(0.001)
        t0 = time.perf_counter()
        group.all_gather(flag)
        if i >= 50:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"tp": group.world, "calls": len(times), "p50_ms": times[len(times) // 2],
            "p99_ms": times[int(len(times) * 0.99)]}


def run_tp(world: int, batches: list[int], budget: float) -> dict:
    """{"rows": the table's rows, "floor": one all-gather's p50/p99} for a group of ``world``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_worker, args=(world, _free_port(), batches, budget, out), nprocs=world, join=True)
    return out.get()


def format_table(rows: list[dict]) -> str:
    head = f"{'tp':>3} {'batch':>6} {'failures':>9} {'reference µs/req':>17} {'batched µs/req':>15} {'ratio':>8}"
    lines = [head, "-" * len(head)]
    for fail in (0, 1):
        sel = [r for r in rows if r["failures"] == fail]
        if not sel:
            continue
        lines.append(f"# {'one failure per batch (its error string rides in the batched all-gather)' if fail else 'clean batches'}")
        for r in sel:
            lines.append(f"{r['tp']:>3} {r['batch']:>6} {r['failures']:>9} {r['reference_us']:>17.1f} "
                         f"{r['batched_us']:>15.2f} {r['ratio']:>7.1f}x")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: need one or more integers >= 1")
    return vals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=_ints, default=[2, 4], help="group sizes (default 2,4)")
    p.add_argument("--batches", type=_ints, default=[1, 8, 64], help="batch sizes (default 1,8,64)")
    p.add_argument("--budget", type=float, default=0.6, help="timed seconds per approach and cell (default 0.6)")
    p.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    args = p.parse_args(argv)
    if any(t < 2 for t in args.tp):
        p.error("--tp: group sizes must be >= 2 (rank 1 injects the failure)")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    t0 = time.perf_counter()
    rows: list[dict] = []
    floors: list[dict] = []
    for world in args.tp:
        got = run_tp(world, args.batches, args.budget)
        rows += got["rows"]
        floors.append(got["floor"])
    rows.sort(key=lambda r: (r["failures"], r["tp"], r["batch"]))
    print(format_table(rows))
    for f in floors:
        print(f"floor, tp={f['tp']}: one all-gather of one flag, p50 {f['p50_ms']:.2f} ms, p99 {f['p99_ms']:.2f} ms "
              f"({f['calls']} calls a millisecond apart)")
    print(f"({time.perf_counter() - t0:.1f} s; median of {MIN_ROUNDS}-{ROUNDS} timed rounds per cell; "
          f"{os.cpu_count()} CPUs; reference = one all_gather_object per request, "
          f"batched = one tensor all-gather per batch)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "floors": floors, "budget_s": args.budget, "cpus": os.cpu_count()}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
