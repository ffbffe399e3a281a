"""Session features: kept, materialized, on every rank until close_session or the idle timeout.

The store is mutated only on the collective lane, in batch order, from decisions the
leader put in the batch (closes, expiries) or that every rank reaches alike (a turn that
succeeded everywhere stores what it brought). So every rank holds the same features
without a collective of its own. A failed or aborted turn stores nothing and releases
nothing the session already had. Memory is bounded by bytes, by the number of sessions and
by the number of stored features (a zero-size feature still costs its tensor and its
entry): a turn that would pass a bound is refused (503), never an older feature evicted.

A session belongs to the connection that names it: the leader keys it by the client's
routing identity and its ``session_id`` (``scoped``), so no other connection can read,
replace or close it, however well it guesses the id. Its items are read through
``transport.SessionFeature``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Session:
    features: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0
    last_used: float = field(default_factory=time.monotonic)


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def scoped(client: bytes, session_id: str) -> str:
    """The store's key for a client's session: its routing identity, then the id it chose."""
    return f"{client.hex()}/{session_id}"


def unscoped(key: str | None) -> str | None:
    """The ``session_id`` as its client wrote it (for messages)."""
    return key.partition("/")[2] if key and "/" in key else key


@dataclass
class Pending:
    """What the turns of one batch already accepted would add, before any is stored."""
    nbytes: int = 0
    features: int = 0
    sessions: set = field(default_factory=set)


class SessionStore:
    def __init__(self, max_bytes: int, max_count: int = 1 << 62, max_features: int = 1 << 62):
        self.max_bytes, self.max_count, self.max_features = max_bytes, max_count, max_features
        self.nbytes = 0
        self.features = 0  # stored features, all sessions
        self._sessions: dict[str, Session] = {}

    def has(self, session_id: str | None, feature_id: str) -> bool:
        s = self._sessions.get(session_id) if session_id is not None else None
        return s is not None and feature_id in s.features

    def lookup(self, session_id: str | None, feature_id: str) -> torch.Tensor:
        s = self._sessions.get(session_id) if session_id is not None else None
        if s is None or feature_id not in s.features:
            raise KeyError(f"session {unscoped(session_id)!r} holds no feature {feature_id!r}")
        return s.features[feature_id]

    def refusal(self, session_id: str, new: dict[str, torch.Tensor], pending: Pending) -> str | None:
        """Why storing ``new`` (replacing same-id features) on top of ``pending`` would pass a
        bound (a 503 message naming the setting), or None; accepted turns add to ``pending``."""
        s = self._sessions.get(session_id)
        old = s.features if s else {}
        need = sum(_size(t) for t in new.values())
        nbytes = self.nbytes + pending.nbytes - sum(_size(old[k]) for k in new if k in old) + need
        features = self.features + pending.features + sum(k not in old for k in new)
        opens = s is None and session_id not in pending.sessions
        if nbytes > self.max_bytes:
            return (f"session memory full: {self.nbytes} of {self.max_bytes} bytes held, "
                    f"this turn brings {need} (session_max_bytes)")
        if features > self.max_features:
            return (f"session memory full: {self.features} of {self.max_features} features held, "
                    f"this turn brings {len(new)} (session_max_features)")
        if opens and len(self._sessions) + len(pending.sessions) >= self.max_count:
            return f"session memory full: {len(self._sessions)} of {self.max_count} sessions open (session_max_count)"
        pending.nbytes += need
        pending.features += sum(k not in old for k in new)
        if opens:
            pending.sessions.add(session_id)
        return None

    def put(self, session_id: str, new: dict[str, torch.Tensor]) -> None:
        s = self._sessions.setdefault(session_id, Session())
        for k, t in new.items():
            old = s.features.pop(k, None)
            if old is not None:
                s.nbytes -= _size(old)
                self.nbytes -= _size(old)
                self.features -= 1
            s.features[k] = t
            self.features += 1
            s.nbytes += _size(t)
            self.nbytes += _size(t)
        s.last_used = time.monotonic()

    def touch(self, session_id: str) -> None:
        s = self._sessions.get(session_id)
        if s is not None:
            s.last_used = time.monotonic()

    def close(self, session_id: str) -> int:
        """Release every feature of the session; returns the bytes freed."""
        s = self._sessions.pop(session_id, None)
        if s is None:
            return 0
        self.nbytes -= s.nbytes
        self.features -= len(s.features)
        return s.nbytes

    def idle(self, timeout_s: float, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        # a copy (atomic under the GIL): the leader's loop asks while the lane may store
        return [sid for sid, s in self._sessions.copy().items() if now - s.last_used > timeout_s]

    def __len__(self) -> int:
        return len(self._sessions)

    def __repr__(self) -> str:
        return (f"<SessionStore sessions={len(self._sessions)}/{self.max_count} "
                f"features={self.features}/{self.max_features} bytes={self.nbytes}/{self.max_bytes}>")
