"""The collective lane: one thread runs every collective of a rank, in order, under our deadline.

gloo does not reliably honour its own timeout once a peer is gone, so each call is
awaited with a deadline of our own. A call that raises or passes the deadline means the
group is broken (``GroupBroken``); the lane then refuses further work. The thread is a
daemon: a call stuck inside gloo cannot keep the process from exiting.

``on_start`` runs first on the thread itself: torch's intra-op thread count is per
thread (OpenMP), so a lane that did not set it would run its tensor ops on a pool of one
thread per core whose workers spin after every op (measured: a third of a core each at
tp=2, and the batch ring 40% slower than gloo because of it).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Coroutine

from .errors import GroupBroken, describe


class Lane:
    def __init__(self, timeout_s: float, name: str = "lane", on_start: Callable[[], Any] | None = None):
        self.timeout_s = timeout_s
        self.broken: str | None = None
        self.busy_since: float | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._on_start = on_start
        self.inside_call = False  # the thread is running a call (maybe stuck in gloo) right now
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            if self.broken:  # a call queued behind the one that broke the group never runs
                fut.set_exception(GroupBroken(self.broken))
                continue
            self.inside_call = True
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                self.broken = self.broken or f"collective {getattr(fn, '__name__', fn)} raised {describe(exc)}"
                fut.set_exception(exc)
            finally:
                self.inside_call = False

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """Run ``fn(*args)`` on the lane; GroupBroken if it raises or overruns the deadline."""
        return await self.start(fn, *args, timeout_s=timeout_s)

    def start(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Coroutine:
        """Queue ``fn(*args)`` now, before the caller yields; await the result for its value
        (the leader starts the next batch this way, then answers the last one)."""
        if self.broken:
            return self._refused(self.broken)
        fut: Future = Future()
        self.busy_since = time.monotonic()
        self._jobs.put((fut, fn, args))
        return self._result(fut, getattr(fn, "__name__", fn), self.timeout_s if timeout_s is None else timeout_s)

    @staticmethod
    async def _refused(why: str) -> Any:
        raise GroupBroken(why)

    async def _result(self, fut: Future, name: str, deadline: float) -> Any:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), deadline)
        except asyncio.TimeoutError:
            self.broken = f"collective {name} passed its {deadline:g}s deadline"
            raise GroupBroken(self.broken) from None
        except GroupBroken as exc:
            self.broken = str(exc)
            raise
        except Exception as exc:
            self.broken = f"collective {name} raised {describe(exc)}"
            raise GroupBroken(self.broken) from exc
        finally:
            self.busy_since = None

    def stuck_for(self) -> float:
        """Seconds the current call has run (0 when idle): /health reads it."""
        return 0.0 if self.busy_since is None else time.monotonic() - self.busy_since

    def close(self) -> None:
        self._jobs.put(None)

    def __repr__(self) -> str:
        state = f"broken: {self.broken}" if self.broken else (
            f"busy {self.stuck_for():.3f}s" if self.busy_since else "idle")
        return f"<Lane {state} timeout={self.timeout_s:g}s>"
