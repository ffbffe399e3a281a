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
from .shm import unlink_segment


def release_unrun(req: Request, world: int, named_elsewhere: Callable[[str], bool] = lambda name: False) -> int:
    """Unlink ``req``'s owned segments and ack its cuda_ipc slots for all ``world`` ranks;
    never raises. Returns the segments this call unlinked. A segment another queued or
    running request still names (``named_elsewhere``) is left to that request: ownership
    passes with each request, and the last one that holds it unlinks it."""
    unlinked = sum(unlink_segment(name, req.rid, quiet_if_missing=True)
                   for name in req.owned_segments if not named_elsewhere(name))
    for it in req.items:
        if it.transport == "cuda_ipc":
            acknowledge(it, range(world), req.rid)
    return unlinked


def release_malformed(header, prefix: str, rid: str | None,
                      named_elsewhere: Callable[[str], bool] = lambda name: False) -> int:
    """A message refused at decoding: unlink the owned segments its raw header names
    (``protocol.owned_segments``, which never touches a name outside ``prefix``), but none
    that a queued or running request names (``named_elsewhere``)."""
    return sum(unlink_segment(name, rid, quiet_if_missing=True)
               for name in owned_segments(header, prefix) if not named_elsewhere(name))
