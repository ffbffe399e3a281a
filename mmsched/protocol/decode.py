"""Validation: a header map and its frames → a typed message, or a ``BadRequest`` naming
the field. Nothing a client sends makes ``decode`` raise anything else.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..errors import BadRequest
from .dtypes import ITEMSIZE, nbytes as item_nbytes
from .header import Unread, frame_len, unpack_header
from .limits import MAX_PARAMS_DEPTH, MODALITIES, REQUEST_TYPES, TRANSPORTS, VERSION, Limits, valid_shm_name
from .messages import Abort, CloseSession, Item, Message, Ping, Request

I32 = np.dtype("<i4")
_min, _max = np.minimum.reduce, np.maximum.reduce  # what ndarray.min/max call, minus two Python layers


def readable_rid(header: Any) -> str | None:
    """The rid a 400 may carry: only a well-formed one."""
    rid = header.get("rid") if isinstance(header, dict) else None
    return rid if isinstance(rid, str) and 1 <= len(rid) <= 128 else None


def decode(frames: Sequence[Any], limits: Limits) -> Message:
    """Frames (header first, then payloads as buffers) → a typed message, or BadRequest."""
    header = unpack_header(frames[0], limits)
    for key, v in header.items():
        if isinstance(v, Unread):
            raise BadRequest(key, v.problem, readable_rid(header))
    size = sum(map(frame_len, frames))
    if size > limits.max_message_bytes:
        raise BadRequest("message", f"{size} bytes exceed max_message_bytes={limits.max_message_bytes}",
                         readable_rid(header))
    try:
        return _decode(header, frames, limits)
    except BadRequest as exc:  # the rid a 400 may carry, looked for only when there is a 400
        exc.rid = readable_rid(header)
        raise


def _short(value: Any, limit: int = 80) -> str:
    """A client's value as an error message quotes it: never more than ``limit`` characters."""
    text = repr(value) if not isinstance(value, (str, bytes)) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit + 3 else text[:limit] + "..."


def _decode(h: dict, frames: Sequence[Any], limits: Limits) -> Message:
    if not _is_int(h.get("v")) or h.get("v") != VERSION:  # true and 1.0 are not 1
        raise BadRequest("v", f"unsupported protocol version {_short(h.get('v'))} (this server speaks 1)")
    typ = h.get("type")
    if _one_of(typ, REQUEST_TYPES):
        return _request(h, typ, frames, limits)
    if typ == "ping":
        return Ping()
    if typ == "abort":
        return Abort(_str(h, "rid", 1, 128))
    if typ == "close_session":
        return CloseSession(_str(h, "session_id", 1, 256))
    raise BadRequest("type", f"unknown message type {_short(typ)}")


_PLAIN = frozenset(("v", "type", "rid", "input_ids"))  # a request that names nothing optional


def _request(h: dict, typ: str, frames: Sequence[Any], limits: Limits) -> Request:
    rid = _str(h, "rid", 1, 128)
    ids = _input_ids(h.get("input_ids"), limits)
    if h.keys() <= _PLAIN and limits.default_max_new_tokens <= limits.max_new_tokens:  # text only,
        # every optional field at its default (most requests): the checks below cost ~1.1 us more
        return Request(rid=rid, type=typ, input_ids=ids, items=[], max_new_tokens=limits.default_max_new_tokens)
    session_id = _str(h, "session_id", 1, 256) if h.get("session_id") is not None else None
    want_digest = h.get("want_digest", False)
    if not isinstance(want_digest, bool):
        raise BadRequest("want_digest", "must be a bool")
    params = h.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("params", "must be a map")
    # params are re-packed into the batch every rank receives: bounded in depth and elements
    depth, count = _shape_of(params, MAX_PARAMS_DEPTH, limits.max_params_items) if params else (1, 0)
    if depth > MAX_PARAMS_DEPTH:
        raise BadRequest("params", f"nested deeper than {MAX_PARAMS_DEPTH} levels")
    if count > limits.max_params_items:
        raise BadRequest("params", f"more than {limits.max_params_items} elements (max_params_items)")
    mnt = params.get("max_new_tokens", limits.default_max_new_tokens)
    if not _is_int(mnt) or not 1 <= mnt <= limits.max_new_tokens:
        raise BadRequest("params.max_new_tokens", f"must be an int in 1..{limits.max_new_tokens} (max_new_tokens)")
    raw_items = h.get("mm_items", [])
    if raw_items is None:
        raw_items = []
    if not isinstance(raw_items, list):
        raise BadRequest("mm_items", "must be an array of item maps")
    if len(raw_items) > limits.max_items:
        raise BadRequest("mm_items", f"{len(raw_items)} items exceed max_items={limits.max_items}")
    items = [_item(i, it, frames, limits) for i, it in enumerate(raw_items)]
    total = sum(it.nbytes for it in items)
    if total > limits.max_request_bytes:
        raise BadRequest("mm_items", f"{total} feature bytes exceed max_request_bytes={limits.max_request_bytes}")
    ids_seen = [it.id for it in items if it.id is not None]
    if len(ids_seen) != len(set(ids_seen)):
        raise BadRequest("mm_items.id", "ids must be unique within a request")
    return Request(rid=rid, type=typ, input_ids=ids, items=items, session_id=session_id,
                   max_new_tokens=mnt, want_digest=want_digest, params=params)


def _item(i: int, it: Any, frames: Sequence[Any], limits: Limits) -> Item:
    f = f"mm_items[{i}]"
    if not isinstance(it, dict):
        raise BadRequest(f, "must be a map")
    transport = it.get("transport")
    if not _one_of(transport, TRANSPORTS):
        raise BadRequest(f"{f}.transport", f"must be one of {sorted(TRANSPORTS)}")
    item_id = _opt_str(it, "id", f)
    if transport == "session":
        return _session_item(i, it, f, item_id)
    item = _sized_item(i, it, f, item_id, limits)
    if transport == "shm":
        _shm_fields(item, it, f, limits)
    elif transport == "inline":
        _inline_payload(item, it, f, frames)
    elif transport == "memfd":
        item.memfd, item.offset = _memfd(it.get("memfd"), f"{f}.memfd"), _offset(it, f)
    else:
        item.ipc = _ipc(it.get("ipc"), f"{f}.ipc", limits)
    return item


def _session_item(i: int, it: dict, f: str, item_id: str | None) -> Item:
    """A ``ref`` to a feature the session keeps; its dtype and shape come from the stored feature."""
    ref = _opt_str(it, "ref", f)
    if ref is None:
        raise BadRequest(f"{f}.ref", "required for transport 'session'")
    modality = it.get("modality", "other")
    if not _one_of(modality, MODALITIES):
        raise BadRequest(f"{f}.modality", f"must be one of {sorted(MODALITIES)}")
    return Item(index=i, modality=modality, transport="session", dtype="uint8", shape=(0,),
                nbytes=0, ref=ref, id=item_id)


def _sized_item(i: int, it: dict, f: str, item_id: str | None, limits: Limits) -> Item:
    """What every transport that brings bytes declares: modality, dtype and a bounded shape."""
    modality = it.get("modality")
    if not _one_of(modality, MODALITIES):
        raise BadRequest(f"{f}.modality", f"must be one of {sorted(MODALITIES)}")
    dtype = it.get("dtype")
    if not _one_of(dtype, ITEMSIZE):
        raise BadRequest(f"{f}.dtype", f"must be one of {' '.join(ITEMSIZE)}")
    shape = it.get("shape")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= 8
            or not all(_is_int(d) and d >= 0 for d in shape)):
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
    if not _is_int(idx) or not 1 <= idx < len(frames):
        raise BadRequest(f"{f}.frame", f"must index a payload frame (1..{len(frames) - 1})")
    payload = frames[idx]
    payload = payload.buffer if hasattr(payload, "buffer") else memoryview(payload)
    if payload.nbytes != item.nbytes:
        raise BadRequest(f"{f}.frame", f"frame {idx} holds {payload.nbytes} bytes, "
                         f"dtype and shape say {item.nbytes}")
    item.payload = payload


def _offset(it: dict, f: str) -> int:
    offset = it.get("offset", 0)
    if not _is_int(offset) or offset < 0:
        raise BadRequest(f"{f}.offset", "must be an int >= 0")
    return offset


def _memfd(m: Any, f: str) -> dict:
    """The ``memfd`` map of a memfd pool item (an extension): whose descriptor, and its inode."""
    if not isinstance(m, dict):
        raise BadRequest(f, "required for transport 'memfd': a map of pid, fd, inode (see docs/protocol.md)")
    for key, lo in (("pid", 1), ("fd", 0), ("inode", 0)):
        if not _is_int(m.get(key)) or not lo <= m[key] < 1 << 63:
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
        if not _is_int(ipc.get(key)) or ipc[key] < lo:
            raise BadRequest(f"{f}.{key}", f"must be an int >= {lo}")
    out = {k: ipc[k] for k in ("device", "handle", "acks", "ranks", "slot", "offset", "generation")}
    if ipc.get("acks_id") is not None:  # optional: the board's inode, so a re-created board is told apart
        if not _is_int(ipc["acks_id"]) or ipc["acks_id"] < 0:
            raise BadRequest(f"{f}.acks_id", "must be an int >= 0 (the ack board's inode)")
        out["acks_id"] = ipc["acks_id"]
    return out


def _input_ids(v: Any, limits: Limits) -> np.ndarray:
    """The ids as int32, their count checked before anything is built. The common case, a bin
    of int32, is never copied and cannot reach 2^31; a list is bound checked by one min (and
    one max) over the array."""
    f = "input_ids"
    if isinstance(v, (bytes, bytearray)):
        if len(v) % 4:
            raise BadRequest(f, "bin length must be a multiple of 4 (little-endian int32)")
        n = len(v) // 4
    elif isinstance(v, list):
        n = len(v)
    else:
        raise BadRequest(f, "required: an array of ints or a bin of int32")
    if not 1 <= n <= limits.max_input_len:  # before numpy copies a list
        raise BadRequest(f, f"length {n} outside 1..{limits.max_input_len} (max_input_len)")
    if not isinstance(v, list):
        # an id is negative exactly when the top bit of its last byte is set: one C pass over
        # every fourth byte (numpy's min cost ~4% of the leader's time holding the GIL at tp=2)
        if not v[3::4].isascii():
            raise BadRequest(f, "each id must satisfy 0 <= id < 2^31")
        return np.frombuffer(v, dtype=I32)
    try:
        arr = np.array(v)
    except (ValueError, TypeError, OverflowError):  # ragged or otherwise not an int array
        raise BadRequest(f, "must be an array of ints or a bin of int32") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise BadRequest(f, "must be an array of ints or a bin of int32")
    if _min(arr) < 0 or (arr.dtype != I32 and _max(arr) >= 2**31):
        raise BadRequest(f, "each id must satisfy 0 <= id < 2^31")
    return arr if arr.dtype == I32 else arr.astype(I32)


def _shape_of(v: Any, max_depth: int, max_count: int) -> tuple[int, int]:
    """(depth, elements) of ``v``, counting every map key, value and array entry; stops
    early once either passes its bound. (Iterative: no recursion limit.)"""
    stack, depth, count = [(v, 1)], 0, 0
    while stack and depth <= max_depth and count <= max_count:
        x, d = stack.pop()
        if not isinstance(x, (dict, list, tuple)):
            continue
        children = (*x.keys(), *x.values()) if isinstance(x, dict) else x
        depth = max(depth, d)
        count += len(children)
        stack.extend((c, d + 1) for c in children)
    return depth, count


def _one_of(v: Any, choices) -> bool:
    """``v in choices`` for any decoded value (a list or map is unhashable: not a member)."""
    return isinstance(v, str) and v in choices


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str(h: dict, key: str, lo: int, hi: int) -> str:
    v = h.get(key)
    if not isinstance(v, str) or not lo <= len(v) <= hi:
        raise BadRequest(key, f"required: a string of {lo}-{hi} characters")
    return v


def _opt_str(it: dict, key: str, f: str) -> str | None:
    v = it.get(key)
    if v is not None and (not isinstance(v, str) or not 1 <= len(v) <= 256):
        raise BadRequest(f"{f}.{key}", "must be a string of 1-256 characters")
    return v
