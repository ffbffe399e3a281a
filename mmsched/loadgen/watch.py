"""Whether anyone still answers a run: pongs, the connection, and what a replaced connection carried.

A mixin of ``Run`` (loop.py): it reads the run's client, spec, clock (``t0``), sessions,
outstanding futures and records, and ends or pauses its sending.
"""

from __future__ import annotations

import asyncio
import math
import time

GONE_S = 4.0  # no pong for this long while running: the server is gone
LATE_S = 0.5  # a connection still lost after this long (ZeroMQ reconnects in ~0.1 s): the server is gone
# a new connection loses the replies to what the old one carried, but a request ZeroMQ still
# held goes to the new one and may yet be answered: those sent before it and still unanswered
# drain_s later (the patience a run has for results at its end), and at least this long, are
# given up: counted as lost, and a closed loop sends again in their slots
REPLACED_S = 1.0


class Watch:
    def __init__(self):
        self._checked_at, self.paused = -math.inf, False  # the connection, as _paused last saw it
        self._connections = 0  # connections seen by _look (from start_watching's count on)

    def start_watching(self) -> None:
        """The connections made before the run (a client may have reconnected already): only
        one made after them replaces another; a count of 0 (its monitor not read yet) lets
        the first connection come without counting as a replacement."""
        self.client.connection_lost()
        self._connections = self.client.connections

    async def watch(self, every_s: float = 1.0) -> None:
        """Ping while the run lasts: no pong for GONE_S means nobody reads what we send."""
        last = time.perf_counter()
        while not self.all_done.is_set():
            try:
                await self.client.ping(timeout=every_s)
                last = time.perf_counter()
            except asyncio.TimeoutError:
                if time.perf_counter() - last >= GONE_S:
                    return self._gone(f"no pong from {self.spec.frontend} for {GONE_S:g} s: the server is gone")
                continue
            await asyncio.sleep(every_s)

    async def watch_connection(self, every_s: float = 0.05) -> None:
        """A lost connection pauses the open loop (what is sent meanwhile is read by nobody;
        the closed loop has at most its concurrency out); one still lost after ``LATE_S``
        ends the run: the server is gone, even if no 503 said so (a client stalled while the
        server drained and left got none). ZeroMQ reconnects within ~0.1 s to a server that
        only dropped us (say, for an oversized frame)."""
        lost_since, seen = None, self.client.connections
        while not self.all_done.is_set():
            if not self._look() or self.client.connections != seen:  # (a reconnect between two looks)
                lost_since, seen = None, self.client.connections
            elif lost_since is None:
                lost_since = time.perf_counter()
            elif time.perf_counter() - lost_since >= LATE_S:
                return self._gone("the server is going away (it closed the connection): stopped sending")
            await asyncio.sleep(every_s)

    def _look(self) -> bool:
        """Whether the connection is lost now (the client reads its monitor); a connection
        made since the last look, other than the first, replaced the one before."""
        lost, made = self.client.connection_lost(), self.client.connections
        if made > max(self._connections, 1):
            self._replaced()
        self._connections = made  # (the client's count only grows)
        return lost

    def _replaced(self) -> None:
        """A new connection: the server keeps sessions per connection, so every session's next
        turn brings its features again; what is still unanswered from before is given up later."""
        for sess in self.sessions:
            sess.stored = False
        at = time.perf_counter() - self.t0
        asyncio.get_running_loop().call_later(self.give_up_s, self._give_up_before, at)

    @property
    def give_up_s(self) -> float:
        return max(self.spec.drain_s, REPLACED_S)

    def _give_up_before(self, at: float) -> None:
        """No reply can come for what was sent before ``at`` and is still unanswered: lost."""
        rows = [row for row, fut in self.futs.items() if self.rec.t_send[row] < at and not fut.done()]
        self.given_up.update(rows)
        for row in rows:
            self.client.give_up(self.rec.rid[row])  # its future is cancelled: _on_result

    def _gone(self, why: str) -> None:
        """The run ends here: nobody will answer what is outstanding."""
        self.stopped_by = self.stopped_by or why
        self.stop_sending()
        self.all_done.set()

    def _paused(self) -> bool:
        """Whether the connection is lost; asked of the client at most once a millisecond (~4 µs a time)."""
        now = time.perf_counter()
        if now - self._checked_at >= 0.001:
            self._checked_at, self.paused = now, self._look()
        return self.paused
