"""bench/thread_cpu.py: a run's CPU, per rank process and per thread role, read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import thread_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs /proc")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_thread_counts_as_python_and_the_main_thread_as_the_loop():
    """(Threads live through the run, as a server's do: one that ends before the second look
    leaves nothing in /proc to count.)"""
    go, spun, done = threading.Event(), threading.Event(), threading.Event()

    def worker():
        go.wait(10)
        _spin(0.3)
        spun.set()
        done.wait(10)

    t = threading.Thread(target=worker)
    t.start()

    def run():
        go.set()
        _spin(0.1)
        spun.wait(10)

    me = [os.getpid()]  # (not ``measure(getpid())``: a test process may have children, a resource tracker say)
    try:
        before, t0 = thread_cpu.snapshot(me), time.monotonic()
        run()
        measured = thread_cpu.shares(before, thread_cpu.snapshot(me), me, time.monotonic() - t0)
    finally:
        done.set()
        t.join()
    (me,) = measured
    assert me["pid"] == os.getpid()
    assert me["python"] > me["loop"] > 0, measured  # the other thread spun three times as long
    assert "rank 0" in thread_cpu.line(measured) and "python" in thread_cpu.line(measured)


def test_a_launcher_is_measured_by_its_children_in_rank_order():
    code = ("import subprocess, sys, time; "
            "ps = [subprocess.Popen([sys.executable, '-c', 'import time\\nend = time.thread_time() + 0.4\\n"
            "while time.thread_time() < end: pass\\ntime.sleep(5)']) for _ in range(2)]; time.sleep(10)")
    launcher = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while len(thread_cpu.ranks(launcher.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = thread_cpu.ranks(launcher.pid)
        assert len(pids) == 2 and launcher.pid not in pids and pids == sorted(pids)
        _, measured = thread_cpu.measure(launcher.pid, lambda: time.sleep(1.5))
        assert [m["pid"] for m in measured] == pids
        assert all(m["loop"] > 0 for m in measured), measured  # each child spun on its main thread
    finally:
        for pid in thread_cpu.ranks(launcher.pid):
            if pid != launcher.pid:
                os.kill(pid, 9)
        launcher.kill()
        launcher.wait()


def test_no_proc_means_a_line_that_says_so():
    assert thread_cpu.line([]) == "no per-thread CPU here (no /proc)"
