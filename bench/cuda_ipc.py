"""CUDA IPC transfer bandwidth: a consumer process copies pool slices onto its device,
against an in-process device-to-device copy of the same size (the ceiling), in one run.

Needs a GPU (bench/gpu_check.sh runs it); prints a table and exits 0 with a note elsewhere.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.multiprocessing as mp

from mmsched.protocol import Item
from mmsched.devices import CudaDevice
from mmsched.producers import IpcPool
from mmsched.transport.cuda_ipc import Attachments, CudaIpcFeature
from mmsched.faults import NO_FAULTS

SIZES = [1 << 20, 16 << 20, 64 << 20]


def _consumer(items, out_q, reps):
    torch.cuda.set_device(0)
    times, attached = {}, Attachments()
    for size, item_wire in items:
        item = Item(index=0, modality="image", transport="cuda_ipc", dtype="uint8", shape=(size,),
                    nbytes=size, ipc=item_wire)
        best = float("inf")
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f = CudaIpcFeature(item, "bench", NO_FAULTS, 0, 1, attached)
            t = f.materialize()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
            f.release(False)
            del t
        times[size] = best
    out_q.put(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("cuda_ipc bench: no CUDA device here, skipped")
        return
    dev = CudaDevice(0)
    pool = IpcPool(dev, slots=len(SIZES), slot_bytes=max(SIZES), ranks=1)
    items = []
    for size in SIZES:
        lease = pool.lease(torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda"))
        items.append((size, pool.item(None, lease)))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_consumer, args=(items, q, args.reps))
    p.start()
    ipc = q.get(timeout=240)
    p.join(60)
    rows = []
    print(f"{'size':>8} {'ipc GB/s':>10} {'d2d GB/s':>10} {'ratio':>7}")
    for size in SIZES:
        src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
        best = float("inf")
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.empty_like(src).copy_(src)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        row = {"bytes": size, "ipc_gbps": size / ipc[size] / 1e9, "d2d_gbps": size / best / 1e9}
        row["ratio"] = row["ipc_gbps"] / row["d2d_gbps"]
        rows.append(row)
        print(f"{size >> 20:>6}Mi {row['ipc_gbps']:>10.1f} {row['d2d_gbps']:>10.1f} {row['ratio']:>7.2f}")
    pool.close()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
