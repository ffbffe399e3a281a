"""Give each rank on a host its own share of the CPUs this process may run on.

Why: a rank's threads (the loop, the lane, gloo's worker and TCP loop, ZeroMQ's I/O
thread) hand work to each other all the time, and the loop and the lane take turns under
one GIL. Left to the scheduler, each hand-off may wake the other thread on the other CPU,
away from the caches the rank just filled, and the ranks of a group keep moving between
CPUs. Measured here (2 CPUs, tp=2, plain client, rank 0 on CPU 0 and rank 1 on CPU 1):
p50 at 3000 req/s 2.4 -> 1.6 ms, at 9000 req/s 4.1 -> 2.3 ms, closed loop 19.5 k -> 22.4 k
req/s; at tp=4 (two ranks a CPU) closed loop +13%; pinning rank 0 alone gave most of it.

The share: the CPUs the process may use (``os.sched_getaffinity``: a container's cpuset,
or a ``taskset`` the supervisor applied) split into ``local_world`` contiguous runs, one per
local rank; with fewer CPUs than ranks, ranks share a CPU in order. One rank on its host
keeps every CPU. Threads inherit their creator's mask, so this runs first, and also sets
the threads already running (torch's, at import).
"""

from __future__ import annotations

import os


def share(cpus: list[int], local_rank: int, local_world: int) -> list[int]:
    """Local rank ``local_rank``'s CPUs out of ``cpus`` (sorted) among ``local_world`` ranks."""
    n = len(cpus)  # never 0: a process always may run somewhere
    if n < local_world:
        return [cpus[local_rank * n // local_world]]
    return cpus[local_rank * n // local_world: (local_rank + 1) * n // local_world]


def pin_rank(mode: str, world: int, env: dict | os._Environ = os.environ) -> list[int] | str | None:
    """Apply ``cpu_affinity`` to a rank of a group of ``world``: the CPUs it now runs on, None
    when left alone (``off``, a server of one, a rank alone on its host), or why not (a string:
    also for a local rank the environment gives wrongly, which would otherwise share CPUs)."""
    if mode == "off" or world <= 1:  # a server of one: LOCAL_* left over in its environment mean nothing
        return None
    given = env.get("LOCAL_RANK"), env.get("LOCAL_WORLD_SIZE")
    if given == (None, None):
        return "LOCAL_RANK and LOCAL_WORLD_SIZE are not set (mmsched serve and torchrun set them)"
    try:
        local_rank, local_world = int(given[0] or ""), int(given[1] or "")
    except ValueError:
        local_rank = local_world = -1
    if not (1 <= local_world <= world and 0 <= local_rank < local_world):
        return f"LOCAL_RANK={given[0]!r:.24} LOCAL_WORLD_SIZE={given[1]!r:.24} is not a rank of this host's share of {world}"
    if local_world == 1:
        return None
    if not hasattr(os, "sched_setaffinity"):
        return "no sched_setaffinity on this system"
    allowed = os.sched_getaffinity(0)
    mine = share(sorted(allowed), local_rank, local_world)
    try:
        _set_threads(mine)
    except OSError as exc:
        try:
            _set_threads(allowed)  # all or nothing: no thread left on a share the log does not name
        except OSError:
            pass
        return f"sched_setaffinity {ranges(mine)}: {exc.strerror}"
    return mine


def _set_threads(cpus) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # that thread ended meanwhile
            pass


def ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``, the way taskset and /proc write CPU lists."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
