"""Validation: a header map and its frames → a typed message, or a ``BadRequest`` naming
the field. Nothing a client sends makes ``decode`` raise anything else.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgpack
import numpy as np

from ..errors import BadRequest
from .fields import is_int, one_of, short, text
from .header import Unread, frame_len, unpack_header
from .items import item
from .limits import MAX_PARAMS_DEPTH, REQUEST_TYPES, SMALL_HEADER, VERSION, Limits
from .messages import Abort, CloseSession, Message, Ping, Request

I32 = np.dtype("<i4")


def readable_rid(header: Any) -> str | None:
    """The rid a 400 may carry: only a well-formed one."""
    rid = header.get("rid") if isinstance(header, dict) else None
    return rid if isinstance(rid, str) and 1 <= len(rid) <= 128 else None


def decode(frames: Sequence[Any], limits: Limits) -> Message:
    """Frames (header first, then payloads as buffers) → a typed message, or BadRequest."""
    if len(frames) == 1 and (req := _plain(frames[0], limits)) is not None:
        return req
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


_PLAIN = {"v", "type", "rid", "input_ids"}  # a request that names nothing optional


def _plain(frame: Any, limits: Limits) -> Request | None:
    """Most requests, checked in one expression: a map of four entries (0x84), keys exactly
    v, type, rid and input_ids (so each once, each a string), text only, every optional field
    at its default, ids a bin of int32: what the full checks would build, ~2.5 us sooner on
    the leader's loop. None for anything else, which they decide, with the 400 if any."""
    if not 0 < frame_len(frame) <= min(SMALL_HEADER, limits.max_message_bytes):
        return None
    if memoryview(frame)[0] != 0x84:  # (a zmq.Frame's own ``bytes`` or ``buffer`` cost ~0.7 us more)
        return None
    try:
        h = msgpack.unpackb(frame, raw=False)
    except Exception:  # noqa: BLE001 - the full checks say what is wrong
        return None
    v, typ, rid, ids = h.get("v"), h.get("type"), h.get("rid"), h.get("input_ids")
    if (h.keys() == _PLAIN and type(v) is int and v == VERSION and type(typ) is str and typ in REQUEST_TYPES
            and type(rid) is str and 1 <= len(rid) <= 128 and type(ids) is bytes and not len(ids) % 4
            and 1 <= len(ids) >> 2 <= limits.max_input_len and ids[3::4].isascii()):
        return Request(rid=rid, type=typ, input_ids=np.frombuffer(ids, dtype=I32), items=[],
                       max_new_tokens=limits.default_max_new_tokens)
    return None


def _decode(h: dict, frames: Sequence[Any], limits: Limits) -> Message:
    if not is_int(h.get("v")) or h.get("v") != VERSION:  # true and 1.0 are not 1
        raise BadRequest("v", f"unsupported protocol version {short(h.get('v'))} (this server speaks 1)")
    typ = h.get("type")
    if one_of(typ, REQUEST_TYPES):
        return _request(h, typ, frames, limits)
    if typ == "ping":
        return Ping()
    if typ == "abort":
        return Abort(text(h, "rid", 1, 128))
    if typ == "close_session":
        return CloseSession(text(h, "session_id", 1, 256))
    raise BadRequest("type", f"unknown message type {short(typ)}")


def _request(h: dict, typ: str, frames: Sequence[Any], limits: Limits) -> Request:
    rid = text(h, "rid", 1, 128)
    ids = _input_ids(h.get("input_ids"), limits)
    session_id = text(h, "session_id", 1, 256) if h.get("session_id") is not None else None
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
    if not is_int(mnt) or not 1 <= mnt <= limits.max_new_tokens:
        raise BadRequest("params.max_new_tokens", f"must be an int in 1..{limits.max_new_tokens} (max_new_tokens)")
    raw_items = h.get("mm_items", [])
    if raw_items is None:
        raw_items = []
    if not isinstance(raw_items, list):
        raise BadRequest("mm_items", "must be an array of item maps")
    if len(raw_items) > limits.max_items:
        raise BadRequest("mm_items", f"{len(raw_items)} items exceed max_items={limits.max_items}")
    items = [item(i, it, frames, limits) for i, it in enumerate(raw_items)]
    total = sum(it.nbytes for it in items)
    if total > limits.max_request_bytes:
        raise BadRequest("mm_items", f"{total} feature bytes exceed max_request_bytes={limits.max_request_bytes}")
    ids_seen = [it.id for it in items if it.id is not None]
    if len(ids_seen) != len(set(ids_seen)):
        raise BadRequest("mm_items.id", "ids must be unique within a request")
    return Request(rid=rid, type=typ, input_ids=ids, items=items, session_id=session_id,
                   max_new_tokens=mnt, want_digest=want_digest, params=params)


def _input_ids(v: Any, limits: Limits) -> np.ndarray:
    """The ids as int32, their count checked before anything is built. The common case, a bin
    of int32, is never copied and cannot reach 2^31; a list must hold ints alone (one C pass
    over its types: numpy would take a bool as 0 or 1) within the bounds of one min and max."""
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
    if not set(map(type, v)) <= {int}:  # no bool (numpy would read it as 0 or 1), float, nil or nesting
        raise BadRequest(f, "must be an array of ints or a bin of int32")
    if min(v) < 0 or max(v) >= 2**31:
        raise BadRequest(f, "each id must satisfy 0 <= id < 2^31")
    return np.array(v, dtype=I32)


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
