"""Closing big segments' descriptors off the thread that released them.

The last reference to an unlinked segment frees its pages, and that is not cheap here:
16 MiB (4,096 tmpfs pages) takes ~3.5 ms, as long as reading it. Whoever drops the last
reference pays: the leader's loop (the admission lock's descriptor, just before the
result is sent) or a rank's lane (the feature's descriptor, before the engine step).
So segments are unlinked first, while a descriptor still holds them (the name goes at
once: /dev/shm is clean when the result is out), and the descriptor is handed here; a
thread closes it a moment later, with the GIL released. Small segments are closed by the
caller (the hand-off would cost more than their pages), and so is anything past
``limit`` bytes waiting: pages never pile up faster than they are freed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque

from ..errors import describe
from ..log import event


class Closer:
    """One per rank (``Transports`` holds one): ``close(fd, nbytes)`` now or on its thread."""

    MIN = 1 << 20        # smaller segments: closed by the caller (~256 pages, ~0.2 ms at most)
    LIMIT = 256 << 20    # bytes of segments waiting to be closed, at most

    def __init__(self, limit: int = LIMIT):
        self.limit, self.waiting = limit, 0
        self._fds: deque[tuple[int, int]] = deque()
        self._cv = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self.deferred = 0  # descriptors closed on the thread (a count for tests and logs)

    def close(self, fd: int, nbytes: int) -> None:
        """Close ``fd`` (a segment of ``nbytes``), on the thread if it is big and there is room."""
        if nbytes >= self.MIN and self.limit:
            with self._cv:
                if self.waiting + nbytes <= self.limit:
                    self.waiting += nbytes
                    self._fds.append((fd, nbytes))
                    self.deferred += 1
                    if self._thread is None:
                        self._thread = threading.Thread(target=self._run, name="mmsched-closer", daemon=True)
                        self._thread.start()
                    self._cv.notify()
                    return
        _close(fd)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every handed descriptor is closed (shutdown, tests); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self.waiting == 0, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._fds)
                fd, nbytes = self._fds[0]
            _close(fd)  # the pages are freed here, without the lock or the GIL
            with self._cv:
                self._fds.popleft()
                self.waiting -= nbytes
                self._cv.notify_all()

    def __repr__(self) -> str:
        return f"<Closer waiting={len(self._fds)} ({self.waiting} B) deferred={self.deferred}>"


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError as exc:  # a descriptor of ours: cannot happen short of a bug; say so, go on
        event("release_failed", logging.WARNING, fd=fd, error=describe(exc))


NOW = Closer(limit=0)  # closes on the caller's thread: for holders built without a rank's Closer
