"""Reclaim orphaned segments: prefixed, unlocked, not in flight, and older than the grace period.

Holders keep a shared flock (clients until they send, the leader from admission until
the request is answered, every rank while it reads), so a segment that anybody still
uses is never taken: age alone never deletes. Only this user's regular files are taken, and
config.py refuses a prefix short or loose enough to reach files mmsched does not own. The check and the unlink happen while
the sweep holds an exclusive lock, so a holder cannot slip in between.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Callable

from .log import event
from .protocol import valid_shm_name
from .segments import SHM_DIR, shm_path


@dataclass
class SweepReport:
    reclaimed: list[str] = field(default_factory=list)
    locked: list[str] = field(default_factory=list)
    young: list[str] = field(default_factory=list)
    in_flight: list[str] = field(default_factory=list)
    dry_run: bool = False

    def __str__(self) -> str:
        return (f"{'would_reclaim' if self.dry_run else 'reclaimed'}={len(self.reclaimed)} locked={len(self.locked)} "
                f"young={len(self.young)} in_flight={len(self.in_flight)}")


def sweep(prefix: str, grace_s: float, in_flight: frozenset[str] | set[str] = frozenset(),
          dry_run: bool = False) -> SweepReport:
    report = SweepReport(dry_run=dry_run)
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError as exc:
        event("sweep_failed", logging.WARNING, error=str(exc))
        return report
    for name in names:
        if not valid_shm_name(name, prefix):
            continue
        if name in in_flight:
            report.in_flight.append(name)
            continue
        try:
            fd = os.open(shm_path(name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone already, or not a regular file we may touch
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                report.locked.append(name)
                continue
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue  # a directory, a FIFO or another user's file is never ours to take
            if time.time() - st.st_mtime < grace_s:
                report.young.append(name)
                continue
            if not dry_run:
                try:
                    os.unlink(shm_path(name))
                except FileNotFoundError:
                    continue
                except OSError as exc:  # one entry must not end the sweep (nor the server's sweeper)
                    event("sweep_unlink_failed", logging.WARNING, shm=name, error=str(exc))
                    continue
            report.reclaimed.append(name)
        finally:
            os.close(fd)
    if report.reclaimed:
        event("orphans_reclaimed", count=len(report.reclaimed), dry_run=dry_run,
              names=",".join(report.reclaimed[:5]))
    return report


async def sweep_every(prefix: str, grace_s: float, interval_s: float, in_flight: Callable[[], set[str]],
                      reclaimed: Callable[[int], None]) -> None:
    """The leader's sweeper: at start-up, then every ``interval_s`` (0: once), off the loop.
    ``in_flight`` names the segments of queued and running requests; ``reclaimed`` counts."""
    loop = asyncio.get_running_loop()
    while True:
        report = await loop.run_in_executor(None, sweep, prefix, grace_s, in_flight())
        reclaimed(len(report.reclaimed))
        if not interval_s:
            return
        await asyncio.sleep(interval_s)
