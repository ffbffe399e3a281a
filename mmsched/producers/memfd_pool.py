"""The client's ``MemfdPool``: a sealed memfd handed out slice by slice (``transport: "memfd"``).

A pooled shm segment can be truncated by its owner at any time, so the ranks must read it
with ``pread`` (~0.45 of a user-space copy at 16 MiB). A memfd sealed with
``F_SEAL_SHRINK | F_SEAL_GROW`` can never change size, so the ranks may keep a mapping of
it and copy out of it (``mmsched.transport.memfd``). The pages are reserved up front
(``posix_fallocate``): the ranks refuse a sparse pool, whose holes would read as zeros.
Ranks open it by ``/proc/PID/fd/N`` (same user, same host); it is freed when this process
closes it or dies. Slices are allocated and taken back exactly as ``ShmPool``'s.
"""

from __future__ import annotations

import errno
import fcntl
import os

from ..errors import ShmFull
from .shm_pool import ShmPool

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class MemfdPool(ShmPool):
    """One sealed memfd of ``size`` bytes; first-fit 64-byte-aligned slices (``ShmPool``'s)."""

    def __init__(self, size: int, prefix: str = "mmsched_", seals: int = SEALS):
        """``seals`` is for tests that need a pool the ranks must refuse (``0``: unsealed)."""
        if size <= 0:
            raise ValueError("a memfd pool needs a size > 0")
        fd = os.memfd_create(f"{prefix}pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise ShmFull(f"cannot reserve {size} bytes for a memfd pool: {exc.strerror}") from exc
                raise
            if seals:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        except BaseException:
            os.close(fd)
            raise
        self.pid, self.inode = os.getpid(), os.fstat(fd).st_ino
        self._start(f"memfd:{self.pid}:{fd}", fd, size)

    def where(self, offset: int) -> dict:
        return {"transport": "memfd", "offset": offset,
                "memfd": {"pid": self.pid, "fd": self.fd, "inode": self.inode}}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
