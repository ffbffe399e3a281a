"""shm.Holds: the leader's admission locks cost one descriptor per segment, however many
items or requests name it, and the last holder's drop closes it."""

from __future__ import annotations

import fcntl
import os

from mmsched.transport.shm import Holds, create_segment, shm_path


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def locked(name: str) -> bool:
    """Whether someone holds a lock on the segment (an exclusive try fails)."""
    fd = os.open(shm_path(name), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_one_descriptor_per_segment_whatever_the_items_and_requests():
    a, b = create_segment(b"a" * 64), create_segment(b"b" * 64)
    a.sent(), b.sent()
    holds, before = Holds(), open_fds()
    try:
        first = holds.hold([a.name] * 64)          # one request, 64 items naming one segment
        second = holds.hold([a.name, b.name])      # another request naming it again
        missing = holds.hold(["mmsched_no_such_segment"])
        assert (len(holds), open_fds() - before) == (2, 2)
        assert missing == []
        holds.drop(first)
        assert locked(a.name) and locked(b.name)   # the second request still holds both
        holds.drop(second)
        assert (len(holds), open_fds() - before) == (0, 0)
        assert not locked(a.name) and not locked(b.name)
    finally:
        a.discard(), b.discard()
