"""The client's side of the transports: segments, pools and slots it creates and hands over.

Nothing here imports a server module, so ``mmsched.client`` stays a client; the ranks'
side is ``mmsched.transport``, and what both need is in ``mmsched.segments``
and ``mmsched.devices`` (the ``cuda_ipc`` pool's memory).
"""

from .ipc_pool import AckBoard, IpcPool, Lease
from .segment import Segment, create_segment
from .memfd_pool import MemfdPool
from .shm_pool import ShmPool

__all__ = ["AckBoard", "IpcPool", "Lease", "MemfdPool", "Segment", "ShmPool", "create_segment"]
