"""The guarded copy a rank reads pooled segments with: a pool its owner shrinks under the
copy is a failed copy (the request's 500), never a SIGBUS that kills the rank, and a SIGBUS
anywhere else still kills the process as it would without the guard."""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import uuid

import numpy as np
import pytest

from mmsched.transport import shm_pool

PAGE = mmap.PAGESIZE


def test_the_guarded_copy_is_built_where_a_compiler_is():
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here: pooled segments are read with pread")
    assert shm_pool.guarded_copy is not None, "mmsched/transport/_guarded_copy.c did not build (make install)"


copy = shm_pool.guarded_copy
needs_guard = pytest.mark.skipif(copy is None, reason="the guarded copy did not build")


@pytest.fixture
def segment():
    """A fully allocated /dev/shm file and a read-only mapping of it, gone afterwards."""
    path = f"/dev/shm/mmsched_guard_{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)  # nothing to leave behind, whatever happens
    made = []

    def make(data: bytes) -> mmap.mmap:
        os.ftruncate(fd, len(data))
        os.pwrite(fd, data, 0)
        made.append(mmap.mmap(fd, len(data), mmap.MAP_SHARED, mmap.PROT_READ))
        return made[-1]

    make.fd = fd
    yield make
    for m in made:
        m.close()
    os.close(fd)


@needs_guard
def test_it_copies_the_bytes_at_the_offset(segment):
    data = os.urandom(5 * PAGE + 123)
    src = segment(data)
    dst = np.full(3 * PAGE + 7, 0x5A, dtype=np.uint8)
    assert copy(dst, src, 2 * PAGE - 5) is True
    assert hashlib.sha256(dst.tobytes()).digest() == hashlib.sha256(data[2 * PAGE - 5: 5 * PAGE + 2]).digest()
    with pytest.raises(ValueError, match="past the end"):
        copy(dst, src, 3 * PAGE)
    with pytest.raises(TypeError):
        copy(bytes(8), src, 0)  # a destination it cannot write


@needs_guard
def test_a_mapping_shrunk_under_it_is_a_failed_copy_and_the_process_goes_on(segment):
    data = os.urandom(8 * PAGE)
    src = segment(data)
    dst = np.empty(6 * PAGE, dtype=np.uint8)
    os.ftruncate(segment.fd, 3 * PAGE)  # the owner shrinks it: pages 3.. are past the file's end
    assert copy(dst, src, PAGE) is False
    assert copy(dst[: 2 * PAGE], src, 0) is True  # what is still in the file copies
    os.ftruncate(segment.fd, 8 * PAGE)  # grown again: the missing pages read as zeros
    assert copy(dst, src, 2 * PAGE) is True
    assert dst[:PAGE].tobytes() == data[2 * PAGE: 3 * PAGE] and not dst[PAGE:].any()


@needs_guard
def test_a_fault_on_one_thread_fails_only_that_threads_copy(segment):
    good = np.frombuffer(os.urandom(4 * PAGE), dtype=np.uint8)
    shrunk = segment(bytes(8 * PAGE))
    os.ftruncate(segment.fd, PAGE)
    results: dict[str, list[bool]] = {"good": [], "shrunk": []}

    def run(name, src):
        dst = np.empty(4 * PAGE, dtype=np.uint8)
        for _ in range(300):
            results[name].append(copy(dst, src, 0) and dst.tobytes() == good.tobytes())

    threads = [threading.Thread(target=run, args=("good", good)), threading.Thread(target=run, args=("shrunk", shrunk))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["good"] == [True] * 300 and results["shrunk"] == [False] * 300


FAULT_OUTSIDE = textwrap.dedent("""
    import faulthandler, mmap, os, sys
    import numpy as np
    from mmsched.transport.shm_pool import guarded_copy
    if sys.argv[1] == "before":
        faulthandler.enable()
    fd = os.memfd_create("guard")
    os.ftruncate(fd, 4 * mmap.PAGESIZE)
    m = mmap.mmap(fd, 4 * mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)
    dst = np.empty(mmap.PAGESIZE, dtype=np.uint8)
    assert guarded_copy(dst, m, 0)  # the guard is in place from here on
    if sys.argv[1] == "after":
        faulthandler.enable()
    os.ftruncate(fd, 0)
    assert guarded_copy(dst, m, mmap.PAGESIZE) is False
    print("guarded fault survived", flush=True)
    np.frombuffer(m, dtype=np.uint8)[2 * mmap.PAGESIZE]  # a fault outside any guarded copy
    print("not reached", flush=True)
""")


@needs_guard
@pytest.mark.parametrize("faulthandler", ["off", "before", "after"])
def test_a_sigbus_outside_a_copy_still_kills_the_process(faulthandler):
    """The guard must not hide a real fault: a rank that touches a bad mapping elsewhere dies
    of it (with faulthandler's traceback where it is on, whichever was installed first)."""
    proc = subprocess.run([sys.executable, "-c", FAULT_OUTSIDE, faulthandler], capture_output=True, text=True,
                          timeout=30, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.stdout == "guarded fault survived\n", (proc.stdout, proc.stderr)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr)
    assert ("Fatal Python error: Bus error" in proc.stderr) == (faulthandler != "off"), proc.stderr
