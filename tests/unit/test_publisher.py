"""The leader's Publisher: every batch started on the lane reaches the followers once, in
lane order, whether it goes out when it runs or ahead of it."""

from __future__ import annotations

from mmsched.protocol.batch import Batch
from mmsched.rank.publisher import Publisher


class Group:
    def __init__(self, ahead: bool, room: int = 99):
        self.publishes_ahead, self.sent, self.room = ahead, [], room

    def broadcast(self, payload: bytes):
        self.sent.append(Batch.decode(payload).seq)

    def broadcast_if_room(self, payload: bytes) -> bool:
        if self.room <= 0:
            return False
        self.room -= 1
        self.broadcast(payload)
        return True


def test_batches_go_out_once_in_lane_order_ahead_or_not():
    group = Group(ahead=True)
    p = Publisher(group)
    assert p.can_go_ahead
    one, two, three = Batch(1), Batch(2), Batch(3)
    for b in (one, two):
        p.started(b)
    p.through(one)
    assert group.sent == [1]
    p.ahead()  # one's agreement is in: two goes now
    p.started(three)  # started by the loop after that
    p.through(two)  # it went ahead: not again
    assert group.sent == [1, 2]
    p.through(three)
    p.ahead()
    assert group.sent == [1, 2, 3]


def test_a_batch_that_runs_publishes_the_unpublished_ones_before_it_first():
    group = Group(ahead=False)
    p = Publisher(group)
    for seq in (4, 5, 6):
        p.started(Batch(seq))
    p.through(Batch(5))
    assert group.sent == [4, 5]


def test_what_does_not_fit_now_waits_for_its_turn_in_order():
    group = Group(ahead=True, room=1)
    p = Publisher(group)
    batches = [Batch(seq) for seq in (1, 2, 3)]
    for b in batches:
        p.started(b)
    p.through(batches[0])  # a batch that runs may wait for room: it is published whatever the room
    p.ahead()  # room for one more: 2 goes ahead, 3 does not (and nothing after it would)
    assert group.sent == [1, 2]
    p.through(batches[1])
    assert group.sent == [1, 2]
    p.through(batches[2])
    assert group.sent == [1, 2, 3]


def test_groups_that_cannot_go_ahead_and_a_group_of_one():
    assert not Publisher(Group(ahead=False)).can_go_ahead
    alone = Publisher(None)
    alone.started(Batch(1))
    alone.through(Batch(1))
    alone.ahead()
    assert not alone.can_go_ahead  # and nothing was published (there is no group to publish to)
