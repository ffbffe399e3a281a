"""The wire contract in code (docs/protocol.md): typed messages, validation, the one dtype
table, and the internal batch format. No I/O.

Small private modules, one public face: import from ``mmsched.protocol``.
"""

from .decode import decode, readable_rid
from .dtypes import DTYPES, ITEMSIZE, dtype_name, nbytes, torch_dtype
from .header import Unread, unpack_header
from .lenient import LENIENT_ITEMS, owned_segments, unpack_lenient
from .limits import (MAX_MAP_KEYS, MAX_PARAMS_DEPTH, MODALITIES, REQUEST_TYPES, SHM_NAME_RE, SMALL_HEADER,
                     TRANSPORTS, VERSION, Limits, valid_shm_name)
from .batch import Batch
from .messages import (ABORTED, BAD_REQUEST, ERR_TYPE, INTERNAL, OK, UNAVAILABLE, Abort, AckClose, CloseSession,
                       Item, Message, Ping, Pong, Request, Result, ack_close, pack, pong, result)

__all__ = [
    "ABORTED", "BAD_REQUEST", "Batch", "DTYPES", "ERR_TYPE", "INTERNAL", "ITEMSIZE", "LENIENT_ITEMS", "MAX_MAP_KEYS",
    "MAX_PARAMS_DEPTH", "MODALITIES", "OK", "REQUEST_TYPES", "SHM_NAME_RE", "SMALL_HEADER", "TRANSPORTS",
    "UNAVAILABLE", "VERSION", "Abort", "AckClose", "CloseSession", "Item", "Limits", "Message", "Ping", "Pong",
    "Request", "Result", "Unread", "ack_close", "decode", "dtype_name", "nbytes", "owned_segments", "pack", "pong",
    "readable_rid", "result", "torch_dtype", "unpack_header", "unpack_lenient", "valid_shm_name",
]
