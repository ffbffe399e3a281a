"""The closer: a big segment's name goes when it is released, its last descriptor (which frees
its pages) closes on the rank's closer thread, never more than ``limit`` bytes wait, and a
flush leaves nothing open. Real segments in /dev/shm, no server."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from mmsched.faults import NO_FAULTS
from mmsched.producers import create_segment
from mmsched.transport import Transports, closer
from mmsched.transport.closer import Closer
from mmsched.transport.shm import Holds

from .test_transport import shm_item

MiB = 1 << 20


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def linked(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


@pytest.fixture
def gate(monkeypatch):
    """Holds the closer's thread before each close until set (the caller's own closes pass)."""
    opened = threading.Event()
    real = closer._close

    def held_close(fd: int) -> None:
        if threading.current_thread().name == "mmsched-closer":
            assert opened.wait(10), "the test never opened the gate"
        real(fd)

    monkeypatch.setattr(closer, "_close", held_close)
    yield opened
    opened.set()


@pytest.mark.parametrize("nbytes, deferred", [(2 * MiB, 1), (64 * 1024, 0)])
def test_a_released_segment_is_gone_at_once_and_a_big_ones_descriptor_closes_on_the_thread(gate, nbytes, deferred):
    t = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    seg = create_segment(t)
    seg.sent()
    tr, before = Transports(), open_fds()
    try:
        f = tr.open(shm_item(seg.name, "uint8", (nbytes,)), "r")
        assert torch.equal(f.materialize(), t)
        fd = f._fd
        assert f.release(unlink=True) is True
        assert not linked(seg.name), "the name goes with the release, not with the close"
        assert tr.closer.deferred == deferred and is_open(fd) == bool(deferred)
        gate.set()
        tr.clear()  # flushes the closer
        assert not is_open(fd) and open_fds() == before and tr.closer.waiting == 0
    finally:
        gate.set()
        tr.clear()
        seg.discard()


def test_no_more_than_the_limit_waits_the_rest_closes_on_the_callers_thread(gate):
    segs = [create_segment(bytes(MiB)) for _ in range(3)]
    for s in segs:
        s.sent()
    c, fds = Closer(limit=2 * MiB), []
    try:
        for s in segs:
            fd = os.open(os.path.join("/dev/shm", s.name), os.O_RDONLY)
            os.unlink(os.path.join("/dev/shm", s.name))
            fds.append(fd)
            c.close(fd, MiB)
            assert c.waiting <= 2 * MiB
        assert c.deferred == 2 and not is_open(fds[2]), "past the limit: closed by the caller, at once"
        assert all(is_open(fd) for fd in fds[:2])
        gate.set()
        assert c.flush(10) is True and not any(is_open(fd) for fd in fds)
    finally:
        gate.set()
        c.flush(10)
        for s in segs:
            s.discard()


def test_the_last_holds_drop_unlinks_then_hands_the_descriptor_to_the_closer(gate):
    seg = create_segment(bytes(4 * MiB))
    seg.sent()
    c, before = Closer(), open_fds()
    holds = Holds(c)
    try:
        held = holds.hold([seg.name])
        assert holds.owner([])(seg.name, lambda unlink: True) is True  # a batch left it to its holder
        assert holds.drop(held) == 1 and not linked(seg.name)
        assert c.deferred == 1 and open_fds() == before + 1, "still open: the closer's to close"
        gate.set()
        assert c.flush(10) and open_fds() == before and len(holds) == 0
    finally:
        gate.set()
        c.flush(10)
        seg.discard()


def test_a_feature_that_never_opened_has_nothing_to_close():
    c = Closer()
    from mmsched.transport.shm import ShmFeature
    f = ShmFeature(shm_item("mmsched_no_such_segment", "uint8", (MiB,)), "r", NO_FAULTS, closer=c)
    assert isinstance(f.error, FileNotFoundError)
    assert f.release(unlink=True) is True and c.deferred == 0 and c.flush(1)
