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

    def _follow(self) -> bool:
        """On the lane: 1. receive the batch, 2. run it, 3. report counters when asked."""
        batch = Batch.decode(self.runner.group.broadcast(None))
        if batch.stop:
            return False
        self.runner.run(batch)
        if batch.gather_stats:
            self.runner.exchange_counters()
        return True

    async def serve(self) -> int:
        deadline = self.cfg.collective_timeout + self.cfg.heartbeat_s
        try:
            while await self.lane.run(self._follow, timeout_s=deadline):
                pass
        except GroupBroken as exc:
            event("group_broken", logging.ERROR, reason=str(exc))
            return 3
        return 0
