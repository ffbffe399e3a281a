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


def linked(seg) -> bool:
    return os.path.exists(os.path.join("/dev/shm", seg.name))


def test_a_segment_two_requests_name_is_unlinked_by_whichever_is_done_last():
    """A batch that read a segment another queued request holds leaves it linked; the drop of
    the last hold unlinks it, once (outside attack: a retry, or a bad request naming a queued
    request's segment, unlinked it under that request: a 500)."""
    seg = create_segment(b"s" * 64)
    seg.sent()
    holds, closed = Holds(), []

    def close(unlink: bool) -> bool:  # what the batch's feature does: close, unlink if told
        closed.append(unlink)
        if unlink:
            os.unlink(os.path.join("/dev/shm", seg.name))
        return True

    try:
        first = Req(holds.hold([seg.name, seg.name]))  # one request naming it in two items
        second = Req(holds.hold([seg.name]))           # queued behind, naming it too
        assert holds.owner([first])(seg.name, close) is True and closed == [False]
        assert holds.unlink_unheld([seg.name]) == 0, "a request no rank read leaves a held segment alone"
        assert holds.drop(first.holds) == 0 and linked(seg)
        assert holds.drop(second.holds) == 1 and not linked(seg), "the last hold's drop unlinks it"
        assert holds.drop([]) == 0 and len(holds) == 0
    finally:
        seg.discard()


def test_a_batch_holding_every_hold_unlinks_at_once_and_an_unheld_segment_goes_with_its_request():
    seg, lone = create_segment(b"s" * 64), create_segment(b"l" * 64)
    seg.sent(), lone.sent()
    holds = Holds()
    try:
        only = Req(holds.hold([seg.name]))
        assert holds.owner([only])(seg.name, lambda unlink: unlink) is True, "told to unlink: nobody else holds it"
        assert holds.drop(only.holds) == 0, "nothing owed: the batch unlinked it"
        assert holds.unlink_unheld([lone.name]) == 1 and not linked(lone)
    finally:
        seg.discard(), lone.discard()


def test_a_request_admitted_while_a_batch_decides_either_holds_first_or_finds_the_segment_gone():
    """Second outside attack: a request admitted between the batch's decision to unlink and the
    unlink itself held a segment that then vanished (a 500, ~1 run in 1,000). The decision
    and the unlink are one step under the lock that ``hold`` takes too."""
    import threading
    import time

    seg = create_segment(b"s" * 64)
    seg.sent()
    holds, deciding, got = Holds(), threading.Event(), {}
    first = Req(holds.hold([seg.name]))

    def close(unlink: bool) -> bool:
        deciding.set()
        time.sleep(0.2)  # a slow close inside the decision: the admission must wait for it
        if unlink:
            os.unlink(os.path.join("/dev/shm", seg.name))
        return True

    def admit():
        deciding.wait(5)
        got["held"] = holds.hold([seg.name])

    t = threading.Thread(target=admit)
    t.start()
    try:
        holds.owner([first])(seg.name, close)
        t.join(5)
        assert got["held"] == [], "it held a segment the batch was unlinking"
        assert holds.drop(first.holds) == 0 and len(holds) == 0
    finally:
        seg.discard()


def test_a_batch_leaves_alone_a_name_its_answered_request_already_released():
    """Outside attack (second SIGTERM at tp=1): requests in flight are answered 503 and their
    segments unlinked while the batch still runs; the client re-creates a segment under the
    same name; the batch's release then unlinked the client's new segment."""

    class Running(Req):
        def __init__(self, holds, names):
            super().__init__(holds)
            self.owned_segments = names

    seg = create_segment(b"s" * 64)
    seg.sent()
    holds, closed = Holds(), []
    try:
        req = Running(holds.hold([seg.name]), [seg.name])
        owner = holds.owner([req])  # the batch is past its consensus
        holds.drop(req.holds)       # the second signal: answered, its hold dropped ...
        req.holds = None
        assert holds.unlink_unheld(req.owned_segments) == 1  # ... and its segment released
        with open(os.path.join("/dev/shm", seg.name), "xb") as fh:  # the client's new segment, same name
            fh.write(b"n" * 64)
        assert owner(seg.name, lambda unlink: closed.append(unlink) or True) is True
        assert closed == [False] and linked(seg), "the batch must not unlink the client's new segment"
    finally:
        seg.discard()
        if linked(seg):
            os.unlink(os.path.join("/dev/shm", seg.name))


def recreate(seg, data: bytes) -> None:
    """The client's new segment under a name mmsched has unlinked (a new file)."""
    with open(os.path.join("/dev/shm", seg.name), "xb") as fh:
        fh.write(data)


def test_a_name_reused_after_its_batch_unlinked_it_goes_with_the_request_that_reused_it():
    """Outside attack (session 54): request A's batch unlinked its segment while A still ran;
    the client made a new segment under the free name and sent B naming it; B was aborted
    while queued (or refused). The leader took the name for A's and left the new segment in
    /dev/shm. A hold is of a file: B holds the new one, and B's release unlinks it."""
    seg = create_segment(b"s" * 64)
    seg.sent()
    holds, before = Holds(), open_fds()
    try:
        a = Req(holds.hold([seg.name]))
        assert holds.owner([a])(seg.name, lambda unlink: unlink and os.unlink(os.path.join("/dev/shm", seg.name)) or True)
        assert not linked(seg), "A's batch unlinked it; A still holds its descriptor"
        recreate(seg, b"n" * 64)
        b = Req(holds.hold([seg.name]))
        assert len(b.holds) == 1 and (len(holds), open_fds() - before) == (2, 2), "B holds the new file"
        assert holds.drop(b.holds) == 0          # B answered unrun (aborted, refused): its hold goes ...
        assert holds.unlink_unheld([seg.name]) == 1 and not linked(seg), "... and so does its segment"
        assert holds.drop(a.holds) == 0 and (len(holds), open_fds() - before) == (0, 0)
    finally:
        seg.discard()


def test_a_reused_name_run_in_a_later_batch_is_unlinked_by_it_and_by_nobody_else():
    seg = create_segment(b"s" * 64)
    seg.sent()
    holds, unlinks = Holds(), []

    def close(unlink: bool) -> bool:
        unlinks.append(unlink)
        if unlink:
            os.unlink(os.path.join("/dev/shm", seg.name))
        return True

    try:
        a = Req(holds.hold([seg.name]))
        holds.owner([a])(seg.name, close)
        recreate(seg, b"n" * 64)
        b = Req(holds.hold([seg.name]))
        assert holds.drop(a.holds) == 0 and linked(seg), "A's answer leaves B's segment alone"
        holds.owner([b])(seg.name, close)
        assert unlinks == [True, True] and not linked(seg)
        assert holds.drop(b.holds) == 0 and len(holds) == 0
    finally:
        seg.discard()
