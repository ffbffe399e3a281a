"""Forwarding to a remote host: mmsched's ``remote.ship``/``receive`` against a raw gloo broadcast.

    .venv/bin/python bench/remote.py [--sizes 64K,1M,16M] [--items 1] [--no-extra] [--budget 0.8] [--json FILE]

Two processes form a real gloo group on 127.0.0.1 (one torch thread each). Rank 1 is
marked remote (``Topology(rank, hosts=["a", "b"], host_groups={})``), so for every
batch the leader does what ``BatchRunner`` step 2b does: ``ship`` sends the batch's
host-bound items (``--items`` of them, together ``size`` bytes) in its framing (small items
behind a status prefix in one message, where the leader's read put them, big ones as they
are); rank 1 ``receive``s them into one
buffer from a ``Buffers`` pool (as a rank's ``Transports`` does) and hands its forwarded
features their bytes, which it materializes. Two extra rows (``--no-extra`` drops them):
1 MiB in 4 items (all copied into one message), and the same with one item the leader
failed to read (one more message, the reason). The baseline is one ``dist.broadcast`` of
the same bytes into a buffer rank 1 already holds: what gloo alone costs to move them. A
third column, one ``dist.send``/``recv`` of the same bytes, shows what the point-to-point
primitive ``ship`` is built on costs by itself. All are timed on the receiving rank, from
a barrier to the last transfer landing, in rounds that take the approaches in turn (a
noisy spell hits them all); the figure is the median round. Before timing, rank 1 checks
that what it received is byte for byte what rank 0 shipped (and that a failed item fails
with the leader's reason). Each cell is bounded by ``--budget`` seconds, so a run stays
well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

ROUNDS = 7
MIN_REPS = 2
EXTRA = [(1 << 20, 4, 0), (1 << 20, 4, 1)]  # (bytes, items, items the leader failed to read)
FAILED = "FileNotFoundError: bench: the leader could not read this item"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(size: int, items: int, seed: int):
    """One request holding ``items`` uint8 features that add up to ``size`` bytes."""
    import torch

    from mmsched.protocol import Item

    g = torch.Generator().manual_seed(seed)
    cuts = [size * k // items for k in range(items + 1)]
    tensors = [torch.randint(0, 256, (cuts[k + 1] - cuts[k],), dtype=torch.uint8, generator=g)
               for k in range(items)]
    meta = [Item(index=k, modality="image", transport="shm", dtype="uint8", shape=(t.numel(),),
                 nbytes=t.numel(), shm_name=f"mmsched_bench_{k}") for k, t in enumerate(tensors)]
    return tensors, meta


def _worker(rank: int, port: int, cases: list[tuple[int, int, int]], budget: float, out) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from mmsched import remote
    from mmsched.faults import Faults
    from mmsched.group import GlooGroup
    from mmsched.remote import Topology
    from mmsched.transport import ForwardedFeature
    from mmsched.transport.buffers import Buffers

    group = GlooGroup(rank, 2, f"tcp://127.0.0.1:{port}", timeout_s=60)
    topo = Topology(rank, hosts=["a", "b"], host_groups={})
    faults = Faults([], rank)
    buffers = Buffers()
    barrier = np.zeros(8, dtype=np.uint8)  # one flag's bytes

    def agreed(value: float) -> float:
        """Rank 1's value (the receiver's), known to both ranks."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.broadcast(t, src=1)
        return float(t.item())

    rows = []
    for size, items, failed in cases:
        tensors, meta = _batch(size, items, seed=size)
        sizes = [it.nbytes for it in meta]
        bad = set(range(1, 1 + failed))  # the failed items sit between good ones
        # the leader reads small items straight into the batch's shipment (forward.Shipper.open):
        # here they are put there once; the read is the leader's own, in neither column
        shipment = remote.Shipment(sizes, buffers)
        payloads = [FAILED if k in bad else t if shipment.slot(k) is None else shipment.slot(k).copy_(t)
                    for k, t in enumerate(tensors)]

        def forward():
            if rank == 0:
                remote.ship(topo, sizes, payloads, buffers, shipment)
                return None
            opened = [ForwardedFeature(it, "bench", faults) for it in meta]
            for f, got in zip(opened, remote.receive(topo, sizes, buffers)):
                f.receive(got)
            return [f.materialize() if k not in bad else f.error for k, f in enumerate(opened)]

        flat = torch.cat(tensors)
        raw_buf = flat.clone() if rank == 0 else torch.empty_like(flat)

        def broadcast():
            dist.broadcast(raw_buf, src=0)

        def send():
            if rank == 0:
                dist.send(raw_buf, 1)
            else:
                dist.recv(raw_buf, 0)

        # correctness first: the remote rank holds exactly what the leader read
        got = forward()
        if rank == 1:
            assert all(FAILED in str(a) if k in bad else torch.equal(a, b)
                       for k, (a, b) in enumerate(zip(got, tensors))), f"forwarded bytes differ at {size}"
        if rank == 1:
            raw_buf.zero_()
        broadcast()
        if rank == 1:
            assert torch.equal(raw_buf, flat), f"broadcast bytes differ at {size}"

        row = {"bytes": size, "items": items, "failed": failed}
        approaches = {"mmsched": forward, "gloo": broadcast, "send": send}
        reps, times = {}, {name: [] for name in approaches}
        for name, fn in approaches.items():  # warm up, and size the rounds to the budget
            group.all_gather(barrier)
            t0 = time.perf_counter()
            fn()
            fn()
            one = (time.perf_counter() - t0) / 2
            reps[name] = int(agreed(max(MIN_REPS, int(budget / ROUNDS / max(one, 1e-7)))))
        for _ in range(ROUNDS):  # rounds interleave the approaches: a noisy spell hits them all
            for name, fn in approaches.items():
                group.all_gather(barrier)  # start every round together
                t0 = time.perf_counter()
                for _ in range(reps[name]):
                    fn()
                times[name].append(agreed(time.perf_counter() - t0))  # the receiver's clock
        for name in approaches:
            per = statistics.median(times[name]) / reps[name]
            row[f"{name}_ms"] = per * 1e3
            row[f"{name}_mib_s"] = size / per / (1 << 20)
            row[f"{name}_reps"] = reps[name] * ROUNDS
        row["ratio"] = row["mmsched_mib_s"] / row["gloo_mib_s"]
        rows.append(row)
    group.all_gather(barrier)
    if rank == 0:
        out.put(rows)
    group.close()


def run(cases: list[tuple[int, int, int]], budget: float) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_worker, args=(_free_port(), cases, budget, out), nprocs=2, join=True)
    return out.get()


def _human(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def format_table(rows: list[dict]) -> str:
    head = (f"{'size':>8} {'items':>12} {'mmsched ms':>11} {'MiB/s':>7} {'broadcast ms':>13} {'MiB/s':>7} "
            f"{'ratio':>6} {'send ms':>8} {'MiB/s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        items = f"{r['items']}, {r['failed']} failed" if r.get("failed") else str(r["items"])
        lines.append(f"{_human(r['bytes']):>8} {items:>12} {r['mmsched_ms']:>11.3f} {r['mmsched_mib_s']:>7.0f} "
                     f"{r['gloo_ms']:>13.3f} {r['gloo_mib_s']:>7.0f} {r['ratio']:>6.2f} "
                     f"{r['send_ms']:>8.3f} {r['send_mib_s']:>7.0f}")
    return "\n".join(lines)


def _sizes(text: str) -> list[int]:
    from mmsched.loadgen import parse_size

    try:
        vals = [parse_size(x) for x in text.split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: need one or more sizes >= 1 byte")
    return vals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=_sizes, default=[64 << 10, 1 << 20, 16 << 20],
                   help="bytes per batch, comma-separated (default 64K,1M,16M)")
    p.add_argument("--items", type=int, default=1, help="host-bound items the bytes are split into (default 1)")
    p.add_argument("--no-extra", action="store_true",
                   help="leave out the rows 1 MiB in 4 items, and one of them failed")
    p.add_argument("--budget", type=float, default=0.8, help="timed seconds per approach and size (default 0.8)")
    p.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    args = p.parse_args(argv)
    if args.items < 1 or any(s < args.items for s in args.sizes):
        p.error("--items: need 1 <= items <= every size")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    t0 = time.perf_counter()
    cases = [(size, args.items, 0) for size in args.sizes] + ([] if args.no_extra else EXTRA)
    rows = run(cases, args.budget)
    print(format_table(rows))
    print(f"({time.perf_counter() - t0:.1f} s; median of {ROUNDS} rounds per cell; {os.cpu_count()} CPUs; "
          f"mmsched = remote.ship on rank 0 + remote.receive/materialize on rank 1 (remote host); "
          f"broadcast = one dist.broadcast of the same bytes into a preallocated buffer; "
          f"ratio = mmsched / broadcast throughput; send = one dist.send/recv of them, the primitive ship uses)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "rounds": ROUNDS, "budget_s": args.budget}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
