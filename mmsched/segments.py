"""What producers (the client) and consumers (the ranks) both need to know about a segment:
where it lives, how it is named, how it is read, and the ack board's layout. No state.
"""

from __future__ import annotations

import os
import secrets

import numpy as np

from .errors import FeatureError

SHM_DIR = "/dev/shm"
ACK_CELL = 8  # an ack board holds one little-endian int64 generation per (slot, rank)


class SegmentTooSmall(FeatureError):
    """The segment holds fewer bytes than offset + nbytes (or shrank while being read)."""


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def new_name(prefix: str) -> str:
    """``<prefix><pid>_<random>``: the creator is visible, collisions are not."""
    return f"{prefix}{os.getpid()}_{secrets.token_hex(8)}"


def tensor_bytes(t) -> memoryview:
    """The raw bytes of a tensor in row-major order (bf16 and bool included)."""
    import torch  # the client's feature builders and the ranks' transports both pass tensors

    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def same_file(name: str, inode: int, size: int | None = None) -> bool:
    """Whether ``name`` is still the file with ``inode`` (and ``size``): not removed or re-created."""
    try:
        st = os.stat(shm_path(name))
    except OSError:
        return False
    return st.st_ino == inode and (size is None or st.st_size == size)


def fully_allocated(st: os.stat_result) -> bool:
    """Whether a file has a page behind every byte: no hole, which a mapping would read as
    zeros (and fill with new pages of the owner's file)."""
    return st.st_blocks * 512 >= st.st_size


def read_into(fd: int, dst: np.ndarray, offset: int, name: str) -> None:
    """Fill ``dst`` (uint8, contiguous) from the segment at ``offset``; a short read is an error."""
    view = memoryview(dst).cast("B")
    pos, n = 0, view.nbytes
    while pos < n:
        got = os.preadv(fd, [view[pos:]], offset + pos)
        if got <= 0:
            raise SegmentTooSmall(f"segment {name} ended after {offset + pos} bytes while being read")
        pos += got


def write_at(fd: int, buf: memoryview, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (pwrite may write less than asked)."""
    pos = 0
    while pos < buf.nbytes:
        pos += os.pwrite(fd, buf[pos:], offset + pos)


def ack_cell(slot: int, ranks: int, rank: int) -> int:
    """The byte offset of ``rank``'s cell for ``slot`` on a board of ``ranks`` columns."""
    return (slot * ranks + rank) * ACK_CELL


def read_acks(fd: int, slots: int, ranks: int) -> np.ndarray:
    """The whole board as a slots x ranks array of generations."""
    raw = os.pread(fd, slots * ranks * ACK_CELL, 0)
    return np.frombuffer(raw, dtype="<i8").reshape(slots, ranks)
