"""A request's ``mm_items``, each validated by transport: what it declares (modality, dtype,
a bounded shape) and where its bytes are (a segment, a payload frame, a pool, a device)."""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..errors import BadRequest
from .dtypes import ITEMSIZE, nbytes as item_nbytes
from .fields import is_int, one_of, opt_text, protocol_map
from .limits import MODALITIES, TRANSPORTS, Limits, valid_shm_name
from .messages import Item


def item(i: int, it: Any, frames: Sequence[Any], limits: Limits) -> Item:
    f = f"mm_items[{i}]"
    if not isinstance(it, dict):
        raise BadRequest(f, "must be a map")
    protocol_map(it, f)
    transport = it.get("transport")
    if not one_of(transport, TRANSPORTS):
        raise BadRequest(f"{f}.transport", f"must be one of {sorted(TRANSPORTS)}")
    item_id = opt_text(it, "id", f)
    if transport == "session":
        return _session_item(i, it, f, item_id)
    sized = _sized_item(i, it, f, item_id, limits)
    if transport == "shm":
        _shm_fields(sized, it, f, limits)
    elif transport == "inline":
        _inline_payload(sized, it, f, frames)
    elif transport == "memfd":
        sized.memfd, sized.offset = _memfd(it.get("memfd"), f"{f}.memfd"), _offset(it, f)
    else:
        sized.ipc = _ipc(it.get("ipc"), f"{f}.ipc", limits)
    return sized


def _session_item(i: int, it: dict, f: str, item_id: str | None) -> Item:
    """A ``ref`` to a feature the session keeps; its dtype and shape come from the stored feature."""
    ref = opt_text(it, "ref", f)
    if ref is None:
        raise BadRequest(f"{f}.ref", "required for transport 'session'")
    modality = it.get("modality", "other")
    if not one_of(modality, MODALITIES):
        raise BadRequest(f"{f}.modality", f"must be one of {sorted(MODALITIES)}")
    return Item(index=i, modality=modality, transport="session", dtype="uint8", shape=(0,),
                nbytes=0, ref=ref, id=item_id)


def _sized_item(i: int, it: dict, f: str, item_id: str | None, limits: Limits) -> Item:
    """What every transport that brings bytes declares: modality, dtype and a bounded shape."""
    modality = it.get("modality")
    if not one_of(modality, MODALITIES):
        raise BadRequest(f"{f}.modality", f"must be one of {sorted(MODALITIES)}")
    dtype = it.get("dtype")
    if not one_of(dtype, ITEMSIZE):
        raise BadRequest(f"{f}.dtype", f"must be one of {' '.join(ITEMSIZE)}")
    shape = it.get("shape")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= 8
            or not all(is_int(d) and d >= 0 for d in shape)):
        raise BadRequest(f"{f}.shape", "must be an array of 1-8 ints, each >= 0")
    nbytes = item_nbytes(shape, dtype)  # Python ints do not overflow: bounded before anything is allocated
    if nbytes > limits.max_item_bytes:
        raise BadRequest(f"{f}.shape", f"{nbytes} bytes exceed max_item_bytes={limits.max_item_bytes}")
    if not nbytes and math.prod(max(d, 1) for d in shape) >= 2**63:  # torch's sizes and strides are int64
        raise BadRequest(f"{f}.shape", "its dimensions, zeros left out, must multiply to less than 2**63")
    return Item(index=i, modality=modality, transport=it["transport"], dtype=dtype,
                shape=tuple(shape), nbytes=nbytes, id=item_id)


def _shm_fields(item: Item, it: dict, f: str, limits: Limits) -> None:
    """An shm item's segment name (prefixed, path-safe), offset and ``pooled`` flag."""
    name = it.get("shm_name")
    if not valid_shm_name(name, limits.shm_prefix):
        raise BadRequest(f"{f}.shm_name", f"must start with {limits.shm_prefix!r} and be 1-200 "
                         "characters of [A-Za-z0-9_.-]")
    offset = _offset(it, f)
    pooled = it.get("pooled", False)
    if not isinstance(pooled, bool):
        raise BadRequest(f"{f}.pooled", "must be a bool")
    item.shm_name, item.offset, item.pooled = name, offset, pooled


def _inline_payload(item: Item, it: dict, f: str, frames: Sequence[Any]) -> None:
    """An inline item's payload frame, which must hold exactly the bytes its dtype and shape say."""
    idx = it.get("frame")
    if not is_int(idx) or not 1 <= idx < len(frames):
        raise BadRequest(f"{f}.frame", f"must index a payload frame (1..{len(frames) - 1})")
    payload = frames[idx]
    payload = payload.buffer if hasattr(payload, "buffer") else memoryview(payload)
    if payload.nbytes != item.nbytes:
        raise BadRequest(f"{f}.frame", f"frame {idx} holds {payload.nbytes} bytes, "
                         f"dtype and shape say {item.nbytes}")
    item.payload = payload


def _offset(it: dict, f: str) -> int:
    offset = it.get("offset", 0)
    if not is_int(offset) or offset < 0:
        raise BadRequest(f"{f}.offset", "must be an int >= 0")
    return offset


def _memfd(m: Any, f: str) -> dict:
    """The ``memfd`` map of a memfd pool item (an extension): whose descriptor, and its inode."""
    if not isinstance(m, dict):
        raise BadRequest(f, "required for transport 'memfd': a map of pid, fd, inode (see docs/protocol.md)")
    for key, lo in (("pid", 1), ("fd", 0), ("inode", 0)):
        if not is_int(m.get(key)) or not lo <= m[key] < 1 << 63:
            raise BadRequest(f"{f}.{key}", f"must be an int >= {lo}")
    return {k: m[k] for k in ("pid", "fd", "inode")}


def _ipc(ipc: Any, f: str, limits: Limits) -> dict:
    """The ``ipc`` map of a cuda_ipc item: where the slice is and where to acknowledge it."""
    if not isinstance(ipc, dict):
        raise BadRequest(f, "required for transport 'cuda_ipc': a map (see docs/protocol.md)")
    if ipc.get("device") not in ("cuda", "shm"):
        raise BadRequest(f"{f}.device", "must be 'cuda' or 'shm'")
    if not isinstance(ipc.get("handle"), bytes) or not 1 <= len(ipc["handle"]) <= 4096:
        raise BadRequest(f"{f}.handle", "must be a bin of 1-4096 bytes")
    if not valid_shm_name(ipc.get("acks"), limits.shm_prefix):
        raise BadRequest(f"{f}.acks", f"must be a segment name starting with {limits.shm_prefix!r}")
    if ipc["device"] == "shm" and not valid_shm_name(ipc["handle"].decode(errors="replace"), limits.shm_prefix):
        raise BadRequest(f"{f}.handle", f"an shm pool handle must name a segment starting with {limits.shm_prefix!r}")
    for key, lo in (("ranks", 1), ("slot", 0), ("offset", 0), ("generation", 1)):
        if not is_int(ipc.get(key)) or ipc[key] < lo:
            raise BadRequest(f"{f}.{key}", f"must be an int >= {lo}")
    out = {k: ipc[k] for k in ("device", "handle", "acks", "ranks", "slot", "offset", "generation")}
    if ipc.get("acks_id") is not None:  # optional: the board's inode, so a re-created board is told apart
        if not is_int(ipc["acks_id"]) or ipc["acks_id"] < 0:
            raise BadRequest(f"{f}.acks_id", "must be an int >= 0 (the ack board's inode)")
        out["acks_id"] = ipc["acks_id"]
    return out
