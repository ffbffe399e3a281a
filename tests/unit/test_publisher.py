"""The leader's Publisher: every batch started on the lane reaches the followers once, in
lane order, whether the loop publishes it as it starts it, or the lane ahead of it or when
it runs."""

from __future__ import annotations

import threading

import numpy as np

from mmsched.protocol import Item, Request
from mmsched.protocol.batch import Batch
from mmsched.rank.publisher import LOOP_BYTES, Publisher


class Group:
    def __init__(self, ahead: bool, room: int = 99):
        self.publishes_ahead, self.sent, self.room = ahead, [], room
        self.hold: threading.Event | None = None  # set: broadcast waits for it (a lane inside a publish)
        self.inside = threading.Event()

    def broadcast(self, payload: bytes):
        self.inside.set()
        if self.hold is not None:
            self.hold.wait(10)
        self.sent.append(Batch.decode(payload).seq)

    def broadcast_if_room(self, payload: bytes) -> bool:
        if self.room <= 0:
            return False
        self.room -= 1
        self.broadcast(payload)
        return True


def _inline_batch(seq: int, nbytes: int) -> Batch:
    item = Item(index=0, modality="image", transport="inline", dtype="uint8", shape=(nbytes,), nbytes=nbytes,
                payload=bytes(nbytes))
    return Batch(seq, [Request(rid=f"r{seq}", type="embed", input_ids=np.arange(4, dtype=np.int32), items=[item])])


def test_a_small_batch_goes_out_as_it_is_started_and_never_twice():
    group = Group(ahead=True)
    p = Publisher(group)
    one, two = Batch(1), Batch(2)
    p.started(one)
    assert group.sent == [1], "published by the loop, before the lane runs it"
    p.started(two)
    p.through(one)
    p.ahead()
    p.through(two)
    assert group.sent == [1, 2]


def test_what_does_not_fit_now_waits_for_its_turn_in_order():
    group = Group(ahead=True, room=0)
    p = Publisher(group)
    batches = [Batch(seq) for seq in (1, 2, 3)]
    p.started(batches[0])  # no room: it waits
    group.room = 2
    p.started(batches[1])  # room now, but 1 waits before it: 2 must not overtake it
    assert group.sent == []
    p.through(batches[0])  # a batch that runs is published whatever the room
    assert group.sent == [1]
    p.ahead()  # room for one: 2 goes ahead
    p.started(batches[2])
    assert group.sent == [1, 2, 3]
    p.through(batches[1])
    p.through(batches[2])
    assert group.sent == [1, 2, 3]


def test_a_batch_with_big_inline_payloads_is_left_to_the_lane():
    group = Group(ahead=True)
    p = Publisher(group)
    big, small = _inline_batch(1, LOOP_BYTES), _inline_batch(2, LOOP_BYTES - 1)
    assert big.inline_bytes == LOOP_BYTES and Batch(9).inline_bytes == 0
    p.started(big)
    p.started(small)  # behind a batch still waiting: not published either
    assert group.sent == []
    p.ahead()
    assert group.sent == [1, 2]


def test_the_loop_never_waits_for_a_lane_that_is_publishing():
    group = Group(ahead=True)
    p = Publisher(group)
    first, second = Batch(1), Batch(2)
    group.room = 0
    p.started(first)  # waits for the lane
    group.hold, group.room = threading.Event(), 99
    lane = threading.Thread(target=p.through, args=(first,))
    lane.start()
    assert group.inside.wait(10)  # the lane is inside the publish of 1, holding the publisher
    done = threading.Event()
    loop = threading.Thread(target=lambda: (p.started(second), done.set()))
    loop.start()
    assert done.wait(5), "started() waited for the lane's publish"
    assert group.sent == [], "nothing overtook the batch the lane is publishing"
    group.hold.set()
    lane.join(10)
    loop.join(10)
    p.through(second)
    assert group.sent == [1, 2]


def test_groups_that_cannot_go_ahead_and_a_group_of_one():
    group = Group(ahead=False)
    p = Publisher(group)
    assert not p.can_go_ahead
    for seq in (4, 5, 6):
        p.started(Batch(seq))
    assert group.sent == [], "a gloo broadcast pairs with the followers' calls: only the lane publishes"
    p.through(Batch(5))
    assert group.sent == [4, 5]
    alone = Publisher(None)
    alone.started(Batch(1))
    alone.through(Batch(1))
    alone.ahead()
    assert not alone.can_go_ahead  # and nothing was published (there is no group to publish to)
