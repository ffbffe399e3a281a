"""The one dtype table: every wire dtype name, its item size, and its torch and numpy forms.

Every module that names a dtype imports it from here (the server's decoder, the
transports, the client's feature builders, the tests). Each name is also the name of a
torch dtype attribute, so the torch side is derived, not written out again.
"""

from __future__ import annotations

import math
from functools import cache

ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}
DTYPES = tuple(ITEMSIZE)


@cache
def _torch_table() -> dict:
    import torch  # only where a tensor is built: decoding a header needs no torch

    return {name: getattr(torch, name) for name in DTYPES}


def torch_dtype(name: str):
    """The torch dtype of a wire dtype name (KeyError for a name not on the wire)."""
    return _torch_table()[name]


@cache
def _name_table() -> dict:
    return {d: name for name, d in _torch_table().items()}


def dtype_name(dtype) -> str:
    """The wire name of a torch dtype (KeyError for one the wire cannot carry)."""
    return _name_table()[dtype]


def nbytes(shape, dtype: str) -> int:
    """Bytes of an item of ``shape`` and wire dtype ``dtype`` (Python ints: no overflow)."""
    return math.prod(shape) * ITEMSIZE[dtype]
