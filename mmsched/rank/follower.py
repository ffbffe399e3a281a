"""A follower rank: runs each batch the leader broadcasts; the leader decides when to stop."""

from __future__ import annotations

import logging

from ..batch import BatchRunner
from ..protocol.batch import Batch
from ..config import Config
from ..errors import GroupBroken
from ..lane import Lane
from ..log import event


class Follower:
    def __init__(self, cfg: Config, runner: BatchRunner, lane: Lane):
        self.cfg, self.runner, self.lane = cfg, runner, lane
        self._stopped = False  # set on the lane by the stop batch; a step queued behind it does nothing

    def _follow(self) -> bool:
        """On the lane: 1. receive the batch, 2. run it, 3. report counters when asked."""
        if self._stopped:
            return False
        batch = Batch.decode(self.runner.group.broadcast(None))
        if batch.stop:
            self._stopped = True
            return False
        self.runner.run(batch)
        if batch.gather_stats:
            self.runner.exchange_counters()
        return True

    async def serve(self) -> int:
        """Each step is queued before the last one is awaited, so the lane goes from one batch
        to the next without a round trip through this loop; each keeps its own deadline."""
        deadline = self.cfg.collective_timeout + self.cfg.heartbeat_s
        current = self.lane.start(self._follow, timeout_s=deadline)
        following = None
        try:
            while True:
                following = self.lane.start(self._follow, timeout_s=deadline)
                if not await current:
                    await following  # returns at once: the stop was seen
                    return 0
                current, following = following, None
        except GroupBroken as exc:
            if following is not None:
                following.cancel()  # never awaited: the group is gone
            event("group_broken", logging.ERROR, reason=str(exc))
            return 3
