"""The load generator: drive one frontend with a seeded request mix; keep raw timestamps; summarize.

A library with a thin CLI (``mmsched loadtest``). ``run(spec)`` sends requests in an
open loop (``rate``: arrivals at fixed intervals, whatever the server does) or a closed
loop (``concurrency``: that many requests always in flight), bounded by a request count
and a duration, then waits at most ``drain_s`` for the results still outstanding and
counts the rest as lost. It returns a ``Report``: the raw per-request rows (``Records``,
send/receive timestamps and statuses) and, separately, ``summarize(records)``.

The mix is drawn from one seeded ``random.Random``, one draw per request in send order:
its transport (``pooled`` by default, ``shm``, ``inline``, ``cuda_ipc``), its feature
sizes, and its fault, if any:

- ``fail``: the rid starts with ``fail_prefix`` (default ``fail-``). Start the server with
  a fault glob that matches it, e.g. ``--fault 0:open:fail-*`` (a rank fails opening the
  features: requests with features get a 500) or ``--fault 0:engine:fail-*`` (text-only
  requests too); without one such a request is simply served (200).
- client faults (``missing``, ``too_small``, ``bad_name``): an shm item naming a segment
  that does not exist (500), a segment smaller than the item says (500; mmsched unlinks
  it; refused with a 400 instead, under a prefix the server does not serve, the load
  generator unlinks it), or a name without the prefix (400; nothing is created).
- ``abort``: an abort sent right after the request (499, or 200 when the result won).

With ``session_turns`` T > 1 every session sends T turns one after another: the first
brings its features with ids, later turns refer to them (``ref``) while the session holds
them, and bring them again after a turn that stored nothing; each session is closed.
In a closed loop each slot runs its session to the end; in an open loop each arrival is
the next turn of a session whose last turn has returned, or the first turn of a new one.

Which transport (measured with ``make bench`` on a 2-core machine; see bench/results.json):
``pooled`` (the default) for a client that sends features again and again: one segment
made once, slices reused when results arrive, no create/open/unlink per request, and a
rank reads through a descriptor it keeps (1 MiB items: ~1.4x the requests/s of ``shm``
at tp=1, ~1.6x at tp=2); ``shm`` for a one-off feature or a client that cannot keep a
pool (each feature is a segment the client creates and mmsched opens, reads and
unlinks: ~50 µs of fixed cost per feature here, besides the copy); ``inline`` for small
features or a client on another host (the bytes ride in the message; at tp > 1 they are
broadcast to every rank with the batch); ``cuda_ipc`` for features already on a GPU;
``memfd`` (an extension) is ``pooled`` over a sealed memfd the ranks copy out of a kept
mapping: for big features (16 MiB: see bench/materialize.py), ranks on the client's host.

When the server goes away (a 503 ``service unavailable: …``: draining, stopped, group
broken; the connection lost for ``LATE_S``, not just dropped and reconnected; or no pong
for ``GONE_S``), the generator stops sending at once (a lost connection pauses it):
requests sent into a socket nobody reads would be lost results and segments nobody
unlinks. With no pong at the start it sends nothing and says so. A connection dropped
and made again (the server dropped it, or was replaced at the same address) loses the
replies to what the server had read: ``drain_s`` (at least ``REPLACED_S``) after the new
connection, requests sent before it and still unanswered are given up (lost, their
segments' locks dropped, their pool slices kept) and a closed loop sends again in their
slots; every session brings its features again.

Segments: the prefixed segments in /dev/shm are listed before and after. Segments this
process created (``<prefix><pid>_…``) and that are still there at the end are a leak;
the generator's own pools are removed before the count.
"""

from __future__ import annotations

from .watch import GONE_S, LATE_S, REPLACED_S
from .plot import PLOT_NEEDS, can_plot, write_plot
from .records import Records, summarize
from .report import Report, _finite, format_table, write_json
from .runner import list_segments, run, run_sync
from .spec import CLIENT_FAULTS, EXPECTED, LOST, TRANSPORTS, LoadSpec, parse_size

__all__ = ["CLIENT_FAULTS", "EXPECTED", "GONE_S", "LATE_S", "LOST", "REPLACED_S", "PLOT_NEEDS", "TRANSPORTS", "LoadSpec", "Records", "Report",
           "can_plot", "format_table", "list_segments", "parse_size", "run", "run_sync", "summarize", "write_json",
           "write_plot"]
