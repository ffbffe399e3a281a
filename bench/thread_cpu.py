"""Where a server's CPU went during a run: each rank's threads, from /proc, grouped by role.

Why: issue 13 asks for the profile behind each missed target. A sampling profiler on 2 CPUs
takes the CPU it measures (py-spy at 2 kHz on both ranks made a tp=2 server shed a third of
its requests as 503s); the kernel already counts every thread's CPU, at no cost. So
``make bench`` reads the ranks' threads before and after its half-maximum runs and prints
each rank's share of a CPU: the loop (the main thread), the other Python threads (the lane,
mostly), gloo's threads, ZeroMQ's (docs/performance.md, session 51).

Linux only (``/proc``); elsewhere ``snapshot`` returns nothing and the line says so.
"""

from __future__ import annotations

import os
import time

ROLES = (("gloo", ("gloo_tcp_loop", "pt_gloo_runloop")), ("zmq", ("ZMQbg/",)))


def ranks(pid: int) -> list[int]:
    """The rank processes of server ``pid``, in rank order: its children where it launched a
    group (``mmsched serve --tp N`` starts one process a rank, in rank order, so pid order is
    rank order but for a pid wrap), else itself (a group of one)."""
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids += [int(k) for k in fh.read().split()]
    except OSError:
        pass
    return sorted(kids) or [pid]


def snapshot(pids: list[int]) -> dict:
    """{(pid, tid): (role, CPU seconds)} for every thread of ``pids`` now; {} without /proc."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                    stat = fh.read()
            except OSError:  # the thread ended meanwhile
                continue
            name = stat[stat.index("(") + 1: stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            out[(pid, int(tid))] = (_role(name, int(tid) == pid), (int(fields[11]) + int(fields[12])) / tick)
    return out


def _role(name: str, main: bool) -> str:
    if main:
        return "loop"
    for role, prefixes in ROLES:
        if name.startswith(prefixes):
            return role
    return "python"  # the lane, and any other thread Python started (they carry the process's name)


def shares(before: dict, after: dict, pids: list[int], seconds: float) -> list[dict]:
    """Per rank: its share of one CPU over ``seconds``, in all and by role."""
    out = []
    for pid in pids:
        by_role: dict[str, float] = {}
        for (p, tid), (role, cpu) in after.items():
            if p == pid:
                by_role[role] = by_role.get(role, 0.0) + cpu - before.get((p, tid), (role, 0.0))[1]
        if by_role:
            out.append({"pid": pid, "cores": round(sum(by_role.values()) / seconds, 3),
                        **{r: round(v / seconds, 3) for r, v in sorted(by_role.items())}})
    return out


def line(measured: list[dict]) -> str:
    """``rank 0 0.88 of a CPU (loop 0.27, python 0.44, gloo 0.12, zmq 0.05); rank 1 ...``"""
    if not measured:
        return "no per-thread CPU here (no /proc)"
    return "; ".join(
        f"rank {r} {m['cores']:.2f} of a CPU ("
        + ", ".join(f"{k} {m[k]:.2f}" for k in ("loop", "python", "gloo", "zmq") if k in m) + ")"
        for r, m in enumerate(measured))


def measure(pid: int, run) -> tuple[object, list[dict]]:
    """``run()``'s result, and the CPU shares of server ``pid``'s ranks while it ran."""
    pids = ranks(pid)
    before, t0 = snapshot(pids), time.monotonic()
    result = run()
    return result, shares(before, snapshot(pids), pids, max(time.monotonic() - t0, 1e-9))
