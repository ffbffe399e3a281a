"""Where a ``cuda_ipc`` pool's memory lives: the ``Device`` interface, used by the producer
(``export``, ``write``, ``free``) and by the ranks (``attach``, ``copy_out``, ``detach``).

``CudaDevice`` is torch CUDA IPC where CUDA exists; ``ShmDevice`` stands a /dev/shm
segment in for device memory everywhere, which is how the pool's logic is tested on
CPU-only machines.
"""

from __future__ import annotations

import os
import stat
from typing import Protocol

import msgpack
import torch

from .errors import FeatureError
from .producers.segment import create_segment
from .segments import read_into, same_file, shm_path, tensor_bytes, write_at


class Device(Protocol):
    kind: str

    def export(self, nbytes: int, prefix: str) -> tuple[object, bytes]:
        """Producer: allocate a pool buffer; returns (buffer, handle to send)."""

    def write(self, buffer: object, offset: int, data: torch.Tensor) -> None:
        """Producer: fill a slot."""

    def attach(self, handle: bytes) -> object:
        """Consumer: open the pool (cached by the caller)."""

    def copy_out(self, pool: object, offset: int, nbytes: int) -> torch.Tensor:
        """Consumer: copy a slice into memory this rank owns (uint8)."""

    def is_current(self, handle: bytes, pool: object) -> bool:
        """Consumer: whether an attachment still shows the buffer ``handle`` names now."""

    def detach(self, pool: object) -> None: ...

    def free(self, buffer: object) -> None: ...


class ShmDevice:
    """Device memory stood in for by a /dev/shm segment: the CPU path of this transport."""

    kind = "shm"

    def export(self, nbytes, prefix):
        seg = create_segment(b"", prefix, size=nbytes)
        return seg, seg.name.encode()

    def write(self, buffer, offset, data):
        fd = os.open(shm_path(buffer.name), os.O_WRONLY | os.O_CLOEXEC)
        try:
            write_at(fd, tensor_bytes(data), offset)
        finally:
            os.close(fd)

    def attach(self, handle):
        name = handle.decode()
        fd = os.open(shm_path(name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO never blocks
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise FeatureError(f"pool {name} is not a regular shared-memory segment")
        return (fd, name, st.st_size, st.st_ino)

    def is_current(self, handle, pool):
        """A pool re-created under its name is a new buffer: attach it anew."""
        return same_file(pool[1], pool[3], pool[2])

    def copy_out(self, pool, offset, nbytes):
        fd, name, size, _ = pool
        if offset + nbytes > size:
            raise FeatureError(f"pool {name} holds {size} bytes; slice ends at {offset + nbytes}")
        out = torch.empty(nbytes, dtype=torch.uint8)
        read_into(fd, out.numpy(), offset, name)
        return out

    def detach(self, pool):
        os.close(pool[0])

    def free(self, buffer):
        buffer.discard()


class CudaDevice:
    """Real CUDA IPC through torch's storage sharing (the rebuild torch.multiprocessing does).

    The handle travels as a msgpack array of the eight values ``_share_cuda_`` returns;
    it comes from a client, so it is never unpickled.
    """

    kind = "cuda"

    def __init__(self, device: int | None = None):
        if not torch.cuda.is_available():
            raise FeatureError("CUDA is not available on this rank")
        if device is None:  # a rank uses the device of its local rank
            device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        self.device = device

    def export(self, nbytes, prefix):
        buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
        return buf, msgpack.packb(list(buf.untyped_storage()._share_cuda_()), use_bin_type=True)

    def write(self, buffer, offset, data):
        src = data.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset: offset + src.numel()].copy_(src, non_blocking=False)

    def attach(self, handle):
        fields = msgpack.unpackb(handle, raw=False)
        if not isinstance(fields, list) or len(fields) != 8:
            raise FeatureError("cuda_ipc handle is not the 8-field array _share_cuda_ gives")
        dev, h, size, off, rc_h, rc_off, ev_h, ev_sync = fields
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(dev, h, size, off, rc_h, rc_off, ev_h, ev_sync)
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def copy_out(self, pool, offset, nbytes):
        if offset + nbytes > pool.numel():
            raise FeatureError(f"pool holds {pool.numel()} bytes; slice ends at {offset + nbytes}")
        out = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
        out.copy_(pool[offset: offset + nbytes])
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def is_current(self, handle, pool):
        """A CUDA IPC handle names one allocation (with its own ref-counter file): never replaced."""
        return True

    def detach(self, pool):
        del pool

    def free(self, buffer):
        del buffer


def device_for(kind: str) -> Device:
    if kind == "shm":
        return ShmDevice()
    if kind == "cuda":
        return CudaDevice()
    raise FeatureError(f"unknown cuda_ipc device kind {kind!r}")
