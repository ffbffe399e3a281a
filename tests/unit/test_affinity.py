"""Each rank on a host runs on its own share of the CPUs the process may use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mmsched.affinity import pin_rank, ranges, share

CPUS = list(range(8))


def test_ranks_get_contiguous_runs_that_cover_every_cpu_once():
    runs = [share(CPUS, r, 3) for r in range(3)]
    assert runs == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert share([2, 3, 6, 7], 1, 2) == [6, 7]  # the CPUs allowed, not 0..n-1


def test_with_fewer_cpus_than_ranks_ranks_share_cpus_in_order():
    assert [share([0, 1], r, 4) for r in range(4)] == [[0], [0], [1], [1]]
    assert [share([5], r, 3) for r in range(3)] == [[5], [5], [5]]


def test_a_rank_alone_on_its_host_keeps_every_cpu():
    assert share(CPUS, 0, 1) == CPUS


def test_nothing_is_pinned_when_off_for_a_server_of_one_or_a_rank_alone_on_its_host():
    assert pin_rank("off", 2, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}) is None
    assert pin_rank("spread", 2, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) is None  # torchrun, a node of one
    # tp=1 keeps the machine, whatever LOCAL_* an outer torchrun or shell left in its environment
    assert pin_rank("spread", 1, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) is None


@pytest.mark.parametrize("local_rank, local_world", [
    ("5", "2"), ("-1", "2"), ("abc", "2"), ("9" * 30, "2"), ("0", "0"), ("0", ""), ("", "2"), ("0", "3"), (None, "2"),
])
def test_a_local_rank_given_wrongly_is_a_refusal_that_says_so_not_silence(local_rank, local_world):
    """A rank left on every CPU while its peers have their shares overlaps one of them: the
    log must say why (``cpu_affinity_refused``), naming what the environment held."""
    env = {k: v for k, v in (("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", local_world)) if v is not None}
    why = pin_rank("spread", 2, env)
    assert isinstance(why, str) and "LOCAL_WORLD_SIZE=" in why and "of 2" in why, why
    assert pin_rank("spread", 2, {}) == "LOCAL_RANK and LOCAL_WORLD_SIZE are not set (mmsched serve and torchrun set them)"


def test_cpu_lists_read_as_taskset_writes_them():
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert ranges([3]) == "3"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_pinned_rank_moves_the_threads_it_already_has_and_those_it_starts_later():
    code = textwrap.dedent("""
        import json, os, threading
        from mmsched.affinity import pin_rank
        seen, go = [], threading.Event()
        early = threading.Thread(target=lambda: (go.wait(), seen.append(os.sched_getaffinity(0))))
        early.start()
        mine = pin_rank("spread", 2)
        go.set(); early.join()
        late = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        late.start(); late.join()
        print(json.dumps([sorted(mine), sorted(os.sched_getaffinity(0)), sorted(seen[0]), sorted(seen[1])]))
    """)
    allowed = sorted(os.sched_getaffinity(0))
    want = share(allowed, 1, 2)
    env = dict(os.environ, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [want] * 4, out.stdout  # returned, main thread, early, late


def test_a_refused_pin_leaves_every_thread_where_it_was(monkeypatch):
    """All or nothing: a thread refused its share (EINVAL, say, a CPU gone from the cpuset)
    must not leave the threads before it on a share the log does not name."""
    allowed = {0, 1, 2, 3}
    calls: list[tuple[int, frozenset]] = []

    def setaffinity(tid, cpus):
        calls.append((tid, frozenset(cpus)))
        if frozenset(cpus) != allowed and len(calls) == 2:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(allowed))
    monkeypatch.setattr(os, "sched_setaffinity", setaffinity)
    monkeypatch.setattr(os, "listdir", lambda path: ["100", "101", "102"])
    why = pin_rank("spread", 2, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert why == "sched_setaffinity 2-3: Invalid argument"
    assert calls[-3:] == [(t, frozenset(allowed)) for t in (100, 101, 102)]
