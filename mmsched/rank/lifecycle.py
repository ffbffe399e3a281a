"""The leader's lifecycle: ``STARTING → SERVING → DRAINING → STOPPED``, or ``BROKEN``.

Pure state (the clock is passed in), so a signal handler can only set it: the loop reads
it at each turn. The drain has a deadline; a second signal within ``SAME_STOP_S`` of the
first is the same stop (a launcher and a process manager may both forward one), a later
one means "now".
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"
    BROKEN = "broken"


class Lifecycle:
    SAME_STOP_S = 1.0

    def __init__(self, shutdown_timeout: float):
        self.shutdown_timeout = shutdown_timeout
        self.state = State.STARTING
        self.broken_reason: str | None = None
        self.drain_deadline: float | None = None
        self.now = False  # a second signal: answer what runs and go, without waiting for it
        self._stop_asked_at = float("-inf")

    def serve(self) -> None:
        self.state = State.SERVING

    def request_stop(self, now: float, immediate: bool = False) -> str | None:
        """What the stop became: ``"draining"``, ``"stop_now"``, or None (nothing new)."""
        if self.state in (State.STOPPED, State.BROKEN):
            return None
        if not immediate and self.state is State.DRAINING and now - self._stop_asked_at < self.SAME_STOP_S:
            return None
        self._stop_asked_at = now
        step = None  # STARTING: nothing to drain, no deadline (done at once)
        if immediate or self.state is State.DRAINING:
            self.drain_deadline, self.now, step = 0.0, True, "stop_now"
        elif self.state is State.SERVING:
            self.drain_deadline, step = now + self.shutdown_timeout, "draining"
        self.state = State.DRAINING
        return step

    def done(self, now: float, idle: bool) -> bool:
        """Draining, and nothing is left to do or the drain deadline has passed."""
        return self.state is State.DRAINING and (idle or now >= (self.drain_deadline or 0.0))

    def broken(self, reason: str) -> None:
        self.state, self.broken_reason = State.BROKEN, f"rank group broken: {reason}"

    def stopped(self) -> None:
        self.state = State.STOPPED

    @property
    def unavailable(self) -> str | None:
        """Why a new request is refused (503), or None while serving."""
        if self.state is State.SERVING:
            return None
        return self.broken_reason or self.state.value

    @property
    def answering(self) -> bool:
        """Whether a batch may still run (so a session close waits for it)."""
        return self.state not in (State.STOPPED, State.BROKEN)

    def __repr__(self) -> str:
        return f"<Lifecycle {self.state.value} drain_deadline={self.drain_deadline} now={self.now}>"
