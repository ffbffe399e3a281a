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
import collections
import os
import queue
import threading
import time
from typing import Any, Callable

from .errors import GroupBroken, describe


class Lane:
    def __init__(self, timeout_s: float, name: str = "lane", on_start: Callable[[], Any] | None = None):
        self.timeout_s = timeout_s
        self.broken: str | None = None
        self.busy_since: float | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._on_start = on_start
        self.inside_call = False  # the thread is running a call (maybe stuck in gloo) right now
        self._running: asyncio.Future | None = None  # that call's future (lane thread only)
        self._progressed: tuple[asyncio.Future | None, float] = (None, 0.0)  # (call, when), by ``progress``
        # outcomes for the loop: queued here, then one eventfd write rings the loop's reader
        self._done: collections.deque = collections.deque()
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._bell_loop: asyncio.AbstractEventLoop | None = None  # the loop whose reader watches the bell
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, fut, fn, args = job
            if fut.cancelled():  # its caller gave up before it started (the loop is ending)
                continue
            if self.broken:  # a call queued behind the one that broke the group never runs
                self._settle_from_thread(loop, fut, None, GroupBroken(self.broken), _name(fn))
                continue
            self.inside_call, self._running = True, fut
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                self.broken = self.broken or f"collective {_name(fn)} raised {describe(exc)}"
                result, error = None, exc
            finally:
                self.inside_call, self._running = False, None
            self._settle_from_thread(loop, fut, result, error, _name(fn))

    def _settle_from_thread(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any,
                            error: BaseException | None, name: str) -> None:
        """Hand the outcome to the loop. Through the bell, not ``call_soon_threadsafe``: uvloop
        wakes the loop from inside that call with the GIL held (py-spy --gil, tp=2 at 1000
        req/s: 11.5% of the leader's GIL time on that one line), so the woken loop waited for
        the GIL; ``os.eventfd_write`` lets go of it for the write."""
        if loop is self._bell_loop and not loop.is_closed():
            self._done.append((fut, result, error, name))
            os.eventfd_write(self._bell, 1)
            return
        try:
            loop.call_soon_threadsafe(self._settle, fut, result, error, name)
        except RuntimeError:  # the loop is closed: nobody waits for this call any more
            pass

    def _watch_bell(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop that starts calls reads the bell (a lane outlives the loops of tests)."""
        old, self._bell_loop = self._bell_loop, loop
        if old is not None and not old.is_closed():
            old.remove_reader(self._bell)
        loop.add_reader(self._bell, self._rung)

    def _rung(self) -> None:
        """On the loop: settle every outcome the lane queued (a ring may cover several)."""
        try:
            os.eventfd_read(self._bell)
        except BlockingIOError:
            pass
        while self._done:
            self._settle(*self._done.popleft())

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """Run ``fn(*args)`` on the lane; GroupBroken if it raises or overruns the deadline."""
        return await self.start(fn, *args, timeout_s=timeout_s)

    def start(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> asyncio.Future:
        """Queue ``fn(*args)`` now, before the caller yields; the future is its result (the
        leader starts the next batch this way, then answers the last one). One plain future,
        settled when the lane rings its bell, and one timer for the deadline: the hand-off through
        tasks and wrapped futures cost ~120 µs more per batch here."""
        loop = asyncio.get_running_loop()
        if loop is not self._bell_loop:
            self._watch_bell(loop)
        fut = loop.create_future()
        if self.broken:
            fut.set_exception(GroupBroken(self.broken))
            return fut
        name = _name(fn)
        deadline = self.timeout_s if timeout_s is None else timeout_s
        timer: list[asyncio.TimerHandle] = []  # one slot: the deadline's timer, replaced when re-armed
        timer.append(loop.call_later(deadline, self._overran, fut, name, deadline, timer))
        fut.add_done_callback(lambda _: timer[0].cancel())
        self.busy_since = time.monotonic()
        self._jobs.put((loop, fut, fn, args))
        return fut

    def progress(self) -> None:
        """On the lane thread, inside a call that loops (a follower's batches): one unit of its
        work is done, so that call's deadline runs again from now; /health's ``stuck_for`` too."""
        self._progressed = (self._running, time.monotonic())
        self.busy_since = self._progressed[1]

    def _overran(self, fut: asyncio.Future, name: str, deadline: float, timer: list) -> None:
        if fut.done():
            return
        call, at = self._progressed
        left = at + deadline - time.monotonic() if call is fut else 0.0
        if left > 0:  # this call reported progress since the timer was set: wait the rest
            timer[0] = asyncio.get_running_loop().call_later(left, self._overran, fut, name, deadline, timer)
            return
        self.broken = f"collective {name} passed its {deadline:g}s deadline"
        self.busy_since = None
        fut.set_exception(GroupBroken(self.broken))

    def _settle(self, fut: asyncio.Future, result: Any, error: BaseException | None, name: str) -> None:
        """On the loop: the call's outcome, unless the deadline (or the caller) came first."""
        if fut.done():
            return
        self.busy_since = None
        if error is None:
            fut.set_result(result)
        elif isinstance(error, GroupBroken):
            self.broken = str(error)
            fut.set_exception(error)
        else:
            self.broken = f"collective {name} raised {describe(error)}"
            broken = GroupBroken(self.broken)
            broken.__cause__ = error
            fut.set_exception(broken)

    def stuck_for(self) -> float:
        """Seconds the current call has run (0 when idle): /health reads it."""
        return 0.0 if self.busy_since is None else time.monotonic() - self.busy_since

    def close(self) -> None:
        """Stop the thread; the bell closes once no running loop reads it (the server closes
        the lane after its loop)."""
        self._jobs.put(None)
        if self._bell_loop is None or self._bell_loop.is_closed():
            os.close(self._bell)
            self._bell = -1

    def __repr__(self) -> str:
        state = f"broken: {self.broken}" if self.broken else (
            f"busy {self.stuck_for():.3f}s" if self.busy_since else "idle")
        return f"<Lane {state} timeout={self.timeout_s:g}s>"


def _name(fn: Callable[..., Any]) -> str:
    """(Not ``getattr``'s default: that would build ``repr(fn)`` at every call, and a bound
    method's repr is its object's: the leader's, queue depths and all.)"""
    name = getattr(fn, "__name__", None)
    return name if name is not None else repr(fn)
