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


class Req:
    """What ``Holds.release`` reads of a request: the names it holds."""

    def __init__(self, holds):
        self.holds = holds


def test_a_segment_two_requests_name_is_unlinked_by_whichever_is_done_last():
    """A batch that read a segment another queued request holds leaves it linked; the drop of
    the last hold hands it over for unlinking, once (outside attack: a retry, or a bad
    request naming a queued request's segment, unlinked it under that request: a 500)."""
    seg = create_segment(b"s" * 64)
    seg.sent()
    holds = Holds()
    try:
        first = Req(holds.hold([seg.name, seg.name]))  # one request naming it in two items
        second = Req(holds.hold([seg.name]))           # queued behind, naming it too
        assert holds.release(seg.name, [first]) is False, "the queued request still needs it"
        assert holds.drop(first.holds) == [] and holds.held(seg.name)
        assert holds.drop(second.holds) == [seg.name], "its last hold's drop: unlink it now"
        assert not holds.held(seg.name) and holds.drop([]) == []
        again = Req(holds.hold([seg.name]))             # one batch holding every hold: unlink at once
        assert holds.release(seg.name, [again]) is True and holds.drop(again.holds) == []
        assert holds.release("mmsched_never_held", []) is True
    finally:
        seg.discard()
