"""The ring's wake-up cost: a round trip through two ``mmsched.ring.Ring`` against one through two pipes.

    .venv/bin/python bench/ring.py [--n 2000]

Two processes bounce a 64-byte message: the parent writes, the child reads and writes it
back on a second ring (or pipe). Both sides sleep while they wait (futex / read), so the
figure is two wake-ups and two copies. Prints the p50 and p90 round trip in µs, each
against the pipe's from the same run (issue 13 measured pipe 8 µs, futex 12 µs idle).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmsched.ring import Ring  # noqa: E402

MSG = b"m" * 64


def _echo_ring(names: tuple[str, str], n: int) -> None:
    inbox, outbox = Ring.attach(names[0], 1, 0, 30), Ring.attach(names[1], 1, 0, 30)
    for _ in range(n):
        outbox.write(inbox.read())


def _echo_pipe(r: int, w: int, n: int) -> None:
    for _ in range(n):
        os.write(w, os.read(r, 64))


def _pct(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return xs[len(xs) // 2] * 1e6, xs[int(len(xs) * 0.9)] * 1e6


def ring_rtt(n: int) -> list[float]:
    base = f"mmbench_{os.getpid()}_ring_"
    out, back = Ring.create(base + "a", 1, 30), Ring.create(base + "b", 1, 30)
    back.index = 0  # this side reads the second ring, the child writes it
    p = mp.get_context("fork").Process(target=_echo_ring, args=((out.name, back.name), n))
    p.start()
    time.sleep(0.3)
    out.unlink()
    back.unlink()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        out.write(MSG)
        back.read()
        times.append(time.perf_counter() - t0)
    p.join()
    return times


def pipe_rtt(n: int) -> list[float]:
    (r1, w1), (r2, w2) = os.pipe(), os.pipe()
    p = mp.get_context("fork").Process(target=_echo_pipe, args=(r1, w2, n))
    p.start()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        os.write(w1, MSG)
        os.read(r2, 64)
        times.append(time.perf_counter() - t0)
    p.join()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000)
    args = p.parse_args(argv)
    (r50, r90), (p50, p90) = _pct(ring_rtt(args.n)), _pct(pipe_rtt(args.n))
    print(f"ring round trip p50 {r50:.1f} µs p90 {r90:.1f} µs; pipe p50 {p50:.1f} µs p90 {p90:.1f} µs; "
          f"ratio pipe/ring p50 {p50 / r50:.2f} (load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
