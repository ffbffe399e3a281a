"""Whether mmsched answers, known before a chat needs it.

ZeroMQ reconnects silently, so a request sent to a stopped mmsched just waits out the
worker's ``--timeout``. The worker pings mmsched every ``every`` seconds instead; after
``misses`` unanswered pings in a row it is down: new chats get a 503 at once, and the
requests in flight fail with ``MmschedDown`` (a 503) rather than waiting. One answered
ping and it is up again.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager


class MmschedDown(ConnectionError):
    """mmsched stopped answering pings while this request waited."""


class Liveness:
    def __init__(self, client, every: float = 1.0, misses: int = 3):
        self.client, self.every, self.misses = client, every, misses
        self.down = False
        self._waiting: set[asyncio.Future] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @contextmanager
    def watching(self, fut: asyncio.Future):
        """While inside, ``fut`` fails with MmschedDown if mmsched goes down."""
        self._waiting.add(fut)
        try:
            yield
        finally:
            self._waiting.discard(fut)

    async def _run(self) -> None:
        missed = 0
        while True:
            try:
                await self.client.ping(timeout=2 * self.every)
                missed, self.down = 0, False
            except asyncio.TimeoutError:
                missed += 1
                if missed >= self.misses and not self.down:
                    self.down = True
                    self._fail_waiting()
            await asyncio.sleep(self.every)

    def _fail_waiting(self) -> None:
        for fut in list(self._waiting):
            if not fut.done():
                fut.set_exception(MmschedDown())
