"""The orphan sweep: what a crashed client leaves behind is reclaimed; what anybody still
holds, what is young, and what does not carry the prefix is never touched.

Each test uses a prefix of its own (``mmsweep<random>_``), so a sweep here can never reach
a segment of another test or of a server running beside us, and ages segments with
``os.utime`` instead of sleeping.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from mmsched import cli
from mmsched.sweep import sweep
from mmsched.producers import create_segment

from ..conftest import Server
from .lifecycle import wait_until

SHM_DIR = "/dev/shm"
HOUR = 3600.0


def path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def exists(name: str) -> bool:
    return os.path.exists(path(name))


def age(name: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path(name), (t, t))


def plain_file(name: str, nbytes: int = 64) -> str:
    """A file in /dev/shm made by hand: unlocked, as a client that does not lock leaves it."""
    with open(path(name), "wb") as fh:
        fh.write(b"\0" * nbytes)
    return name


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("MMSCHED_")}


@pytest.fixture
def prefix():
    """A prefix of this test's own; whatever is left under it (or under ``other``) is removed."""
    p = f"mmsweep{uuid.uuid4().hex[:8]}_"
    yield p
    left = [n for n in os.listdir(SHM_DIR) if n.startswith(p[:-1]) or n.startswith("other" + p)]
    for n in left:
        try:
            os.unlink(path(n))
        except FileNotFoundError:
            pass


@pytest.fixture
def sweep_cli(capsys):
    """``mmsched sweep ARGS`` in this process; its stdout. The logging it sets up is undone."""
    lg = logging.getLogger("mmsched")

    def run(*args: str) -> str:
        saved = (lg.handlers[:], lg.level, lg.propagate)
        try:
            assert cli.main(["sweep", *args]) == 0
        finally:
            lg.handlers[:] = saved[0]
            lg.setLevel(saved[1])
            lg.propagate = saved[2]
        return capsys.readouterr().out

    return run


def sweep_subprocess(*args: str) -> str:
    """The real command line, once per test where it matters."""
    out = subprocess.run([sys.executable, "-m", "mmsched", "sweep", *args], capture_output=True,
                         text=True, env=clean_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


CHILD = """
import sys, time
from mmsched.producers import create_segment
segs = [create_segment(bytes(range(256)) * 16, prefix=sys.argv[1]) for _ in range(3)]
print(" ".join(s.name for s in segs), flush=True)
time.sleep(120)
"""


# ---------------------------------------------------------------- a crashed client

def test_sweep_reclaims_what_a_killed_client_left_behind(prefix, sweep_cli):
    child = subprocess.Popen([sys.executable, "-c", CHILD, prefix], stdout=subprocess.PIPE,
                             text=True, env=clean_env())
    try:
        line = child.stdout.readline()  # bounded: the child exits (EOF) if it fails
        names = line.split()
        assert len(names) == 3 and all(n.startswith(f"{prefix}{child.pid}_") for n in names), line
        assert all(exists(n) for n in names)
        # while the client lives its locks protect its segments, however old and whatever the grace
        for n in names:
            age(n, HOUR)
        out = sweep_cli("--shm-prefix", prefix, "--grace", "0")
        assert "sweep reclaimed=0 locked=3" in out, out
        assert all(exists(n) for n in names)
        child.send_signal(signal.SIGKILL)  # crashed before sending: nobody will ever unlink them
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    for n in names:
        age(n, 0)  # just written, as far as the sweep can tell
    out = sweep_cli("--shm-prefix", prefix, "--grace", "0", "--dry-run")
    assert sorted(re.findall(r"^would reclaim (\S+)$", out, re.M)) == sorted(names), out
    assert "sweep would_reclaim=3 locked=0" in out, out  # a dry run reclaims nothing
    assert all(exists(n) for n in names), "a dry run unlinks nothing"
    out = sweep_subprocess("--shm-prefix", prefix, "--grace", "0")
    assert sorted(re.findall(r"^reclaimed (\S+)$", out, re.M)) == sorted(names), out
    assert "sweep reclaimed=3 locked=0" in out, out
    assert not any(exists(n) for n in names)


# ---------------------------------------------------------------- what the sweep leaves alone

def test_a_segment_locked_by_a_live_process_survives_however_old(prefix, sweep_cli):
    seg = create_segment(b"held", prefix=prefix)  # this process holds its shared lock
    try:
        age(seg.name, 10 * HOUR)
        out = sweep_cli("--shm-prefix", prefix, "--grace", "0")
        assert "reclaimed=0 locked=1" in out, out
        assert exists(seg.name)
        seg.sent()  # lock dropped (as a client does once it sent the request): now it is fair game
        out = sweep_cli("--shm-prefix", prefix)  # default grace: it is old enough
        assert out.splitlines()[0] == f"reclaimed {seg.name}", out
        assert not exists(seg.name)
    finally:
        seg.discard()


def test_a_young_unlocked_segment_survives_the_default_grace(prefix, sweep_cli):
    young = plain_file(f"{prefix}young")
    older = plain_file(f"{prefix}older")
    age(older, 59)  # still inside the default 60 s
    out = sweep_cli("--shm-prefix", prefix)
    assert "reclaimed=0 locked=0 young=2" in out, out
    assert exists(young) and exists(older)
    age(older, 61)
    out = sweep_cli("--shm-prefix", prefix)
    assert out.splitlines()[0] == f"reclaimed {older}", out
    assert exists(young) and not exists(older)


def test_names_without_the_prefix_are_never_touched(prefix, sweep_cli):
    keep = [
        plain_file("other" + prefix + "x"),         # the prefix, but not at the start
        plain_file(prefix[:-1] + "-x"),              # a near miss
        plain_file(prefix + "bad name"),            # the prefix, with a character names may not have
    ]
    os.mkdir(path(prefix + "dir"))                  # a directory is nobody's segment
    keep.append(prefix + "dir")
    os.mkfifo(path(prefix + "fifo"))                # nor is a FIFO (and opening it must not block)
    keep.append(prefix + "fifo")
    target = plain_file(prefix + "orphan")
    try:
        for n in keep + [target]:
            age(n, HOUR)
        out = sweep_cli("--shm-prefix", prefix, "--grace", "0")
        assert out.splitlines()[0] == f"reclaimed {target}", out
        assert "sweep reclaimed=1 " in out, out
        assert all(exists(n) for n in keep), [n for n in keep if not exists(n)]
        assert not exists(target)
    finally:
        os.rmdir(path(prefix + "dir"))


def test_sweep_skips_what_is_in_flight(prefix):
    """The leader passes the segments of the requests it holds: never reclaimed, even unlocked."""
    busy, idle = plain_file(prefix + "busy"), plain_file(prefix + "idle")
    age(busy, HOUR)
    age(idle, HOUR)
    report = sweep(prefix, 0, in_flight={busy})
    assert report.in_flight == [busy] and report.reclaimed == [idle]
    assert exists(busy) and not exists(idle)


# ---------------------------------------------------------------- serve sweeps at start-up

def test_serve_reclaims_an_old_orphan_at_start_up(prefix, tmp_path):
    orphan = plain_file(prefix + "orphan")
    outsider = plain_file("other" + prefix + "old")
    held = create_segment(b"still mine", prefix=prefix)
    for n in (orphan, outsider, held.name):
        age(n, HOUR)
    srv = Server("--shm-prefix", prefix, "--sweep-grace", "0", "--sweep-interval", "0",
                 tmp_dir=str(tmp_path))
    try:
        srv.wait_ready(timeout=60)
        wait_until(lambda: not exists(orphan), 30, f"the start-up sweep to reclaim {orphan}")
        wait_until(lambda: re.search(r"orphans_reclaimed count=1 ", srv.logs()), 10,
                   f"an orphans_reclaimed line in the server log:\n{srv.logs()}")
        assert exists(outsider), "a name without the prefix was touched"
        assert exists(held.name), "a locked segment was reclaimed"
        assert srv.stop(timeout=30) == 0
    finally:
        held.discard()
        srv.kill_all()


# ---------------------------------------------------------------- a prefix must not reach other files

@pytest.mark.parametrize("loose", ["", "m", "mm_", "sem.", "mmsched"])
def test_a_prefix_that_could_reach_files_mmsched_does_not_own_is_refused(loose, tmp_path):
    """Issue 17 item 1: ``--shm-prefix ""`` listed (and at start-up unlinked) any old file in
    /dev/shm. The sweep CLI (dry run: nothing is removed even where the check is missing)
    and serve (a grace no file reaches) must refuse it with exit 2 naming shm_prefix."""
    decoy = plain_file(f"{loose or 'x'}decoy{uuid.uuid4().hex[:8]}")  # like libpod_lock: not ours
    age(decoy, HOUR)
    try:
        out = subprocess.run([sys.executable, "-m", "mmsched", "sweep", "--shm-prefix", loose, "--grace", "0",
                              "--dry-run"], capture_output=True, text=True, env=clean_env(), timeout=60)
        assert decoy not in out.stdout, out.stdout
        assert out.returncode == 2 and "config error: shm_prefix:" in out.stderr, (out.returncode, out.stderr)
        sock = tmp_path / "never.sock"
        proc = subprocess.Popen([sys.executable, "-m", "mmsched", "serve", "--frontend", f"ipc://{sock}",
                                 "--shm-prefix", loose, "--sweep-grace", "1e9"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=clean_env(), start_new_session=True)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
        assert proc.returncode == 2 and "config error: shm_prefix:" in err, (proc.returncode, err[-2000:])
        assert not sock.exists() and exists(decoy)
    finally:
        os.unlink(path(decoy))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_another_users_file_with_the_prefix_is_never_taken(prefix, sweep_cli):
    """A sweep run as root must not take another user's file, however old and unlocked."""
    theirs, ours = plain_file(prefix + "theirs"), plain_file(prefix + "ours")
    os.chown(path(theirs), 65534, 65534)
    for n in (theirs, ours):
        age(n, HOUR)
    out = sweep_cli("--shm-prefix", prefix, "--grace", "0")
    assert out.splitlines()[0] == f"reclaimed {ours}" and "sweep reclaimed=1 " in out, out
    assert exists(theirs) and not exists(ours)
