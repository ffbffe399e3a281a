"""shm.Holds: the leader's admission locks cost one descriptor per segment, however many
items or requests name it, and the last holder's drop closes it."""

from __future__ import annotations

import os

from mmsched.producers import create_segment
from mmsched.transport.shm import Holds

from .test_transport import exclusively_lockable


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


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
        assert not exclusively_lockable(a.name) and not exclusively_lockable(b.name)   # the second request still holds both
        holds.drop(second)
        assert (len(holds), open_fds() - before) == (0, 0)
        assert exclusively_lockable(a.name) and exclusively_lockable(b.name)
    finally:
        a.discard(), b.discard()
