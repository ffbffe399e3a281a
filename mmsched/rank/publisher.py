"""The leader's batches to its followers: each once, in lane order, and ahead of time where
the group allows it."""

from __future__ import annotations

from collections import deque

from ..protocol.batch import Batch


class Publisher:
    """``started`` (loop thread) records a batch queued on the lane; ``through`` (lane thread,
    when the batch runs) publishes what is still unpublished up to it; ``ahead`` (lane thread,
    once a step's agreement is in) publishes every batch started so far.

    Why ahead: a follower waits for the next batch while the leader renders and answers the
    last one. Where the group can publish without waiting for a follower (a ring on the
    leader's host that has room: ``RingGroup.broadcast_if_room``), the next batch goes out as
    soon as the last one's agreement is in, and the follower reads it when it finishes the
    last one. A publish that waits (a full ring; a gloo broadcast to another host) could wait
    for a follower that is itself waiting for this rank in a collective of the batch before
    (the counters' exchange, the engine's next gather): there only ``through`` publishes."""

    def __init__(self, group):
        """``group``: the rank group (its ``broadcast`` and ``publishes_ahead``); None for a
        group of one, which publishes nothing."""
        self.group, self.can_go_ahead = group, bool(group is not None and group.publishes_ahead)
        # started on the lane, not yet published, in lane order: [batch, its encoding once made]
        self._waiting: deque[list] = deque()

    def _publish(self, entry: list) -> None:
        if self.group is not None:
            self.group.broadcast(self._encoded(entry))

    @staticmethod
    def _encoded(entry: list) -> bytes:
        """The batch's bytes, encoded once: a batch ``ahead`` found no room for is published by
        ``through`` with the same bytes (a big inline batch costs milliseconds to encode)."""
        if entry[1] is None:
            entry[1] = entry[0].encode()
        return entry[1]

    def started(self, batch: Batch) -> None:
        self._waiting.append([batch, None])

    def through(self, batch: Batch) -> None:
        """Publish, in order, what waits up to and including ``batch`` (nothing if it went
        ahead). Batches are numbered in the order they are started; the loop thread may append
        meanwhile, so the deque is only ever read at its head, never iterated."""
        while self._waiting and self._waiting[0][0].seq <= batch.seq:
            self._publish(self._waiting.popleft())

    def ahead(self) -> None:
        """Every batch started so far, in order, while the group can publish it without waiting
        (a full ring would wait for a follower that may be waiting for this rank); the rest
        goes when it runs (``through``)."""
        while self._waiting and self.group.broadcast_if_room(self._encoded(self._waiting[0])):
            self._waiting.popleft()
