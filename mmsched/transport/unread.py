"""Releasing what a request named when no rank will read it.

A request answered before it reached the ranks (refused, aborted while queued, cut short by
a stop or a broken group) leaves its features with the leader alone: it unlinks the
segments the client gave up, and acknowledges each cuda_ipc slot for every rank so the
producer can reuse it. This is the one place that knows those release rules for the leader.
"""

from __future__ import annotations

from typing import Callable

from ..protocol import Request, owned_segments
from .cuda_ipc import acknowledge

Unlink = Callable[[list[str], "str | None"], int]  # (names, rid) -> how many it unlinked


def release_unrun(req: Request, world: int, unlink: Unlink) -> int:
    """Unlink ``req``'s owned segments and ack its cuda_ipc slots for all ``world`` ranks;
    never raises. Returns the segments this call unlinked. The leader passes
    ``Holds.unlink_unheld``: a segment another queued or running request holds is left to
    that request (ownership passes with each request; the last one unlinks it)."""
    unlinked = unlink(req.owned_segments, req.rid)
    for it in req.items:
        if it.transport == "cuda_ipc":
            acknowledge(it, range(world), req.rid)
    return unlinked


def release_malformed(header, prefix: str, rid: str | None, unlink: Unlink) -> int:
    """A message refused at decoding: unlink the owned segments its raw header names
    (``protocol.owned_segments``, which never touches a name outside ``prefix``), as
    ``release_unrun`` does."""
    return unlink(owned_segments(header, prefix), rid)
