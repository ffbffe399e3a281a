"""Fresh segments, created by a client: one per feature, handed over with the request."""

from __future__ import annotations

import errno
import fcntl
import os

import torch

from ..errors import ShmFull
from ..segments import new_name, shm_path, tensor_bytes, write_at


class Segment:
    """A segment this process created, locked (shared flock) until it is sent.

    Ownership passes to mmsched when the request is sent (contract guarantee 4); the
    client library keeps the lock until the request's result arrives and then calls
    ``sent()``, so no orphan sweep can take a segment in flight. A segment that was never
    sent is removed with ``discard()``.
    """

    __slots__ = ("name", "nbytes", "_fd")

    def __init__(self, name: str, nbytes: int, fd: int):
        self.name, self.nbytes, self._fd = name, nbytes, fd

    @property
    def fd(self) -> int:
        """The producer's read-write descriptor (holding the shared lock), -1 once sent."""
        return self._fd

    def sent(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        self.sent()
        try:
            os.unlink(shm_path(self.name))
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"<Segment {self.name} {self.nbytes}B {'locked' if self._fd >= 0 else 'sent'}>"


def create_segment(data, prefix: str = "mmsched_", size: int | None = None) -> Segment:
    """Write ``data`` (tensor or bytes-like) into a new segment, pages reserved up front.

    ``posix_fallocate`` makes a full /dev/shm an ``ShmFull`` here instead of a SIGBUS
    later. ``size`` may exceed the data (a segment that holds more than one item).
    """
    buf = tensor_bytes(data) if isinstance(data, torch.Tensor) else memoryview(data).cast("B")
    size = buf.nbytes if size is None else size
    name = new_name(prefix)
    fd = os.open(shm_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    where = os.path.dirname(shm_path(name))
                    raise ShmFull(f"cannot reserve {size} bytes in {where}: {exc.strerror}") from exc
                raise
        write_at(fd, buf, 0)
    except BaseException:
        os.close(fd)
        os.unlink(shm_path(name))
        raise
    return Segment(name, size, fd)
