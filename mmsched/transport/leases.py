"""A bounded cache of open handles that is never closed under a reader.

Pooled shm descriptors and cuda_ipc attachments are kept open across requests, but a
feature reads through its handle between ``open`` and ``release``, which spans a whole
batch. Closing a handle inside that window frees its descriptor number, the next
``os.open`` reuses it, and the reader silently reads another client's bytes (the first
build returned 200s with another request's image this way). So every feature *leases*
the entry it reads through, and the cache closes an entry only when nobody leases it:

- ``limit`` bounds the *idle* entries: eviction (least recently used first) skips leased
  ones, so a batch that names more handles than the limit still reads each correctly
  and the cache shrinks back when the batch releases them.
- An entry found replaced (``current`` says its file is no longer the one under that
  key) leaves the cache at once, so new readers open the new file, and is closed when
  its last lease is returned.
- ``prune`` drops idle entries that are no longer current (a pool its owner unlinked
  would otherwise stay allocated through our descriptor, with no name left to sweep).

Thread-safe: the loop thread and the lane thread both lease (acks, the inline tp=1 path).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

from ..errors import describe
from ..log import event

K = TypeVar("K", bound=Hashable)
H = TypeVar("H")


class Lease(Generic[H]):
    """One open handle and how many features read through it now."""

    __slots__ = ("key", "handle", "readers", "retired")

    def __init__(self, key: Hashable, handle: H):
        self.key, self.handle, self.readers, self.retired = key, handle, 0, False

    def __repr__(self) -> str:
        return f"<Lease {self.key!r} readers={self.readers}{' retired' if self.retired else ''}>"


class LeasedCache(Generic[K, H]):
    """Open handles by key, shared by their readers; closed only when no reader holds them."""

    def __init__(self, name: str, open: Callable[[K], H], close: Callable[[H], None],
                 current: Callable[[K, H], bool], limit: int):
        self.name, self.limit = name, limit
        self._open, self._close, self._current = open, close, current
        self._entries: OrderedDict[K, Lease[H]] = OrderedDict()
        self._retired: set[int] = set()  # ids of replaced entries some reader still holds
        self._lock = threading.Lock()
        self.num_replaced = 0

    def lease(self, key: K) -> Lease[H]:
        """The current handle for ``key``, opened if needed; give it back with ``release``.

        Raises what opening raises (the caller keeps it as the feature's error)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not self._current(key, entry.handle):
                self.num_replaced += 1
                event("handle_replaced", cache=self.name, key=_short(key))
                self._retire(entry)
                entry = None
            if entry is None:
                entry = self._entries[key] = Lease(key, self._open(key))
            entry.readers += 1
            self._entries.move_to_end(key)
            self._trim()
            return entry

    def release(self, entry: Lease[H]) -> None:
        """A reader is done with ``entry``; closes it if it was retired and this was the last reader."""
        with self._lock:
            entry.readers -= 1
            if entry.readers == 0 and entry.retired:
                self._retired.discard(id(entry))
                self._close_quietly(entry)
            else:
                self._trim()

    def prune(self) -> int:
        """Drop idle entries that are no longer current (unlinked or replaced by their owner)."""
        with self._lock:
            stale = [e for e in self._entries.values() if e.readers == 0 and not self._current(e.key, e.handle)]
            for entry in stale:
                self._retire(entry)
            return len(stale)

    def clear(self) -> None:
        """Close every idle entry and retire the leased ones (closed on their last release)."""
        with self._lock:
            for entry in list(self._entries.values()):
                self._retire(entry)

    def _retire(self, entry: Lease[H]) -> None:
        del self._entries[entry.key]
        if entry.readers == 0:
            self._close_quietly(entry)
        else:
            entry.retired = True
            self._retired.add(id(entry))

    def _trim(self) -> None:
        """Close idle entries, least recently used first, while over the limit."""
        excess = len(self._entries) - self.limit
        if excess <= 0:
            return
        for entry in [e for e in self._entries.values() if e.readers == 0][:excess]:
            del self._entries[entry.key]
            self._close_quietly(entry)

    def _close_quietly(self, entry: Lease[H]) -> None:
        try:
            self._close(entry.handle)
        except Exception as exc:  # noqa: BLE001 - a release path never raises
            event("handle_close_failed", logging.WARNING, cache=self.name, key=_short(entry.key),
                  error=describe(exc))

    @property
    def num_open(self) -> int:
        """Handles open now: cached ones plus replaced ones still being read."""
        return len(self._entries) + len(self._retired)

    @property
    def num_leased(self) -> int:
        return sum(e.readers > 0 for e in self._entries.values()) + len(self._retired)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (f"<LeasedCache {self.name} open={self.num_open} leased={self.num_leased} "
                f"limit={self.limit} replaced={self.num_replaced}>")


def _short(key: Hashable) -> str:
    text = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
    return text if len(text) <= 80 else text[:77] + "..."
