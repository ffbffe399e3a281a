"""The short scheduler slice a rank asks for: its threads, gloo's included, inherit it."""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import subprocess
import sys
import textwrap

import pytest

from mmsched.timeslice import request_slice

GETATTR = {"x86_64": 315, "aarch64": 275}.get(platform.machine())


def slice_ns_of(tid: int = 0) -> int:
    buf = ctypes.create_string_buffer(56)
    assert ctypes.CDLL(None, use_errno=True).syscall(GETATTR, tid, buf, 56, 0) == 0
    return struct.unpack("IIQiIQQQII", buf.raw)[5]


@pytest.mark.skipif(GETATTR is None or not sys.platform.startswith("linux"), reason="Linux only")
def test_a_rank_thread_started_after_the_request_keeps_the_short_slice():
    code = textwrap.dedent(f"""
        import threading, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_timeslice import slice_ns_of
        from mmsched.timeslice import request_slice
        assert request_slice(250) is None
        seen = []
        t = threading.Thread(target=lambda: seen.append(slice_ns_of()))
        t.start(); t.join()
        print(slice_ns_of(), seen[0])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    main, thread = map(int, out.stdout.split())
    if main == 0:  # a kernel before sched_attr.sched_runtime for ordinary threads reports none
        pytest.skip("this kernel keeps no slice for SCHED_OTHER threads")
    assert main == thread == 250_000


def test_zero_asks_nothing():
    assert request_slice(0) is None


def test_gloos_tcp_loop_threads_run_below_the_rank_and_nothing_else_does(tmp_path):
    """Each process group's TCP loop thread goes 10 nice levels down (it spins on a lock the
    thread it preempted holds); its worker threads run as SCHED_BATCH (not preempting the
    lane that hands them a collective); the rank's own threads keep their priority and policy."""
    code = textwrap.dedent(f"""
        import os, threading, torch.distributed as dist
        from mmsched.timeslice import GLOO_LOOP_NICE, place_gloo_threads, thread_ids
        before = thread_ids()
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        dist.new_group([0], backend="gloo")  # a second group: a second loop thread
        base = os.getpriority(os.PRIO_PROCESS, 0)
        n = place_gloo_threads(before, 200)
        seen, policies = {{}}, {{}}
        for tid in os.listdir("/proc/self/task"):
            comm = open(f"/proc/self/task/{{tid}}/comm").read().strip()
            seen.setdefault(comm, set()).add(os.getpriority(os.PRIO_PROCESS, int(tid)) - base)
            policies.setdefault(comm == "pt_gloo_runloop", set()).add(os.sched_getscheduler(int(tid)))
        print(sorted(policies[True]), sorted(policies[False]), len(seen["pt_gloo_runloop"]))
        print(n, GLOO_LOOP_NICE, sorted(seen.pop("gloo_tcp_loop")), sorted(set().union(*seen.values())))
        dist.destroy_process_group()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    policies, counts = out.stdout.splitlines()
    assert policies == f"[{os.SCHED_BATCH}] [{os.SCHED_OTHER}] 1", out.stdout  # every worker, nothing else
    n, step, loops, others = counts.split(" ", 3)
    assert int(n) == 2, out.stdout
    assert loops == f"[{step}]" and others.strip() == "[0]", out.stdout


def test_a_loop_thread_that_names_itself_late_is_still_lowered():
    """gloo's loop thread names itself once it first runs: on a loaded host, after its group
    is made (the clean-clone suite once found one of two). A new thread still bearing the
    process's name is looked at again until it is named."""
    import threading
    import time

    from mmsched.timeslice import place_gloo_threads, thread_ids

    before, named, done = thread_ids(), threading.Event(), threading.Event()

    def late_loop():
        time.sleep(0.1)
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as fh:
            fh.write("gloo_tcp_loop")
        named.set()
        done.wait(10)

    t = threading.Thread(target=late_loop, daemon=True)
    t.start()
    try:
        assert place_gloo_threads(before) == 1
        assert named.is_set()
        assert os.getpriority(os.PRIO_PROCESS, t.native_id) - os.getpriority(os.PRIO_PROCESS, 0) == 10
    finally:
        done.set()
        t.join()
