"""The leader's batches to its followers: each once, in lane order, and ahead of time where
the group allows it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..protocol.batch import Batch


@dataclass(slots=True)
class _Waiting:
    """A batch started on the lane and not yet published, with its bytes once encoded: a
    batch ``ahead`` found no room for is published by ``through`` with the same bytes (a big
    inline batch costs milliseconds to encode)."""

    batch: Batch
    _bytes: bytes | None = None

    def encoded(self) -> bytes:
        if self._bytes is None:
            self._bytes = self.batch.encode()
        return self._bytes


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
        self._waiting: deque[_Waiting] = deque()  # started on the lane, not yet published; lane order

    def _publish(self, waiting: _Waiting) -> None:
        if self.group is not None:
            self.group.broadcast(waiting.encoded())

    def started(self, batch: Batch) -> None:
        self._waiting.append(_Waiting(batch))

    def through(self, batch: Batch) -> None:
        """Publish, in order, what waits up to and including ``batch`` (nothing if it went
        ahead). Batches are numbered in the order they are started; the loop thread may append
        meanwhile, so the deque is only ever read at its head, never iterated."""
        while self._waiting and self._waiting[0].batch.seq <= batch.seq:
            self._publish(self._waiting.popleft())

    def ahead(self) -> None:
        """Every batch started so far, in order, while the group can publish it without waiting
        (a full ring would wait for a follower that may be waiting for this rank); the rest
        goes when it runs (``through``)."""
        while self._waiting and self.group.broadcast_if_room(self._waiting[0].encoded()):
            self._waiting.popleft()
