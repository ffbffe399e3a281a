"""Reading a big feature with two threads at once.

A fresh segment is read with ``preadv``, not out of a mapping (mapping it for one read
costs what ``preadv`` does), and one ``preadv`` from tmpfs copies at ~0.25-0.5 of a user-space copy
here: the kernel walks the file page by page. Two ``preadv`` calls on the two halves, one
on a helper thread (the GIL is released while each copies), read 1.6-2x as fast from
2 MiB up; below that the hand-off costs what it saves. A pool's guarded copy out of its
mapping (``shm_pool.py``) is split the same way: one ``memcpy`` does ~0.8-0.9 of an
in-process copy at 16 MiB, two at once 1.1-1.5. The caller copies the first half and
always waits for the helper's before it returns or raises, so a buffer is never handed
on while a copy still writes into it; a short read (or a fault) in either half is the
request's error, as with one read.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import numpy as np

from ..segments import read_into

Part = Callable[[np.ndarray, int], None]  # part(dst slice, its byte offset in dst): fill it or raise


class _Half:
    """The second half of one read, for the helper; ``done`` is released when it is over."""

    __slots__ = ("part", "dst", "at", "error", "done")

    def __init__(self, part: Part, dst: np.ndarray, at: int):
        self.part, self.dst, self.at, self.error = part, dst, at, None
        self.done = threading.Lock()
        self.done.acquire()


class Reader:
    """One per rank (``Transports`` holds one): ``read`` fills a buffer from a segment and
    ``fill`` by any copy, a big one in two halves at once."""

    SPLIT = 2 << 20  # reads of this size and over are split (each half >= 1 MiB)

    def __init__(self, split: int = SPLIT):
        self.split = split
        self._halves: queue.SimpleQueue[_Half] = queue.SimpleQueue()
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None
        self.splits = 0  # reads done in two halves (a count for tests)

    def read(self, fd: int, dst: np.ndarray, offset: int, name: str) -> None:
        """Fill ``dst`` (uint8, one dimension, contiguous) from ``fd`` at ``offset``; a short read raises."""
        self.fill(dst, lambda part, at: read_into(fd, part, offset + at, name))

    def fill(self, dst: np.ndarray, part: Part) -> None:
        """``part(dst[a:b], a)`` over all of ``dst``: once, or for a big one on two threads at once."""
        n = dst.nbytes
        if not self.split or n < self.split:
            part(dst, 0)
            return
        cut = (n // 2) & ~4095  # on a page boundary: each half copies whole pages where it can
        half = _Half(part, dst[cut:], cut)
        self._ensure_thread()
        self._halves.put(half)
        self.splits += 1
        try:
            part(dst[:cut], 0)
        finally:
            half.done.acquire()  # never return, nor raise, while the helper writes into dst
        error, half.error = half.error, None  # raised here, it gains frames that hold dst
        if error is not None:
            raise error

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="mmsched-reader", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            half = self._halves.get()
            try:
                half.part(half.dst, half.at)
            except BaseException as exc:  # noqa: BLE001 - the caller raises it, as its own read's
                half.error = exc
            finally:
                half.dst = half.part = None  # idle, the helper holds no buffer (an outside attack: 1 GiB kept)
                half.done.release()

    def __repr__(self) -> str:
        return f"<Reader split>={self.split} B splits={self.splits}>"


ONE_THREAD = Reader(split=0)  # reads on the caller's thread only: for features built without a rank's Reader
