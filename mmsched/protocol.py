"""The wire contract (docs/protocol.md): typed messages, validation, encode/decode. No I/O.

Every way a message can break the contract becomes a ``BadRequest`` naming the field;
nothing a client sends makes ``decode`` raise anything else.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np

from .errors import BadRequest

VERSION = 1
SHM_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
MODALITIES = frozenset({"image", "audio", "video", "other"})
TRANSPORTS = frozenset({"shm", "inline", "cuda_ipc", "session"})
# dtype name -> itemsize; the torch dtype lives in transport (protocol has no torch).
ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}
REQUEST_TYPES = frozenset({"generate", "embed"})
SMALL_HEADER = 16 << 10  # a header this small is decoded in one call: ~1.5 MB at worst, and 4x faster
MAX_PARAMS_DEPTH = 32  # msgpack refuses to pack past ~1000 levels: a deep params map must not reach the ranks

# result statuses and their err_type
OK, BAD_REQUEST, ABORTED, INTERNAL, UNAVAILABLE = 200, 400, 499, 500, 503
ERR_TYPE = {
    BAD_REQUEST: "BadRequestError",
    ABORTED: "RequestAborted",
    INTERNAL: "InternalServerError",
    UNAVAILABLE: "ServiceUnavailable",
}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; checked before any allocation."""

    shm_prefix: str = "mmsched_"
    max_input_len: int = 131072
    max_items: int = 64
    max_item_bytes: int = 1 << 30
    max_request_bytes: int = 2 << 30
    max_new_tokens: int = 4096
    default_max_new_tokens: int = 8
    max_message_bytes: int = 256 << 20
    max_params_bytes: int = 64 << 10
    max_params_items: int = 4096

    @property
    def max_containers(self) -> int:
        """Maps and arrays a header may hold outside ``params``: the header, ``input_ids``,
        ``mm_items``, and per item its map, ``shape`` and ``ipc`` (with room to spare)."""
        return 16 + 4 * self.max_items


@dataclass(slots=True)
class Item:
    """One feature of a request, validated. ``payload`` is the inline frame (zero-copy)."""

    index: int
    modality: str
    transport: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shm_name: str | None = None
    offset: int = 0
    pooled: bool = False
    payload: Any = None
    id: str | None = None
    ref: str | None = None
    ipc: dict | None = None

    def wire(self) -> dict:
        """The item as the leader forwards it to followers (inline bytes included)."""
        d = {
            "modality": self.modality, "transport": self.transport, "dtype": self.dtype,
            "shape": list(self.shape), "shm_name": self.shm_name, "offset": self.offset,
            "pooled": self.pooled, "id": self.id, "ref": self.ref, "ipc": self.ipc,
        }
        if self.payload is not None:
            d["payload"] = self.payload
        return d

    @classmethod
    def from_wire(cls, index: int, d: dict) -> "Item":
        shape = tuple(d["shape"])
        return cls(
            index=index, modality=d["modality"], transport=d["transport"], dtype=d["dtype"],
            shape=shape, nbytes=_nbytes(shape, d["dtype"]), shm_name=d["shm_name"],
            offset=d["offset"], pooled=d["pooled"], payload=d.get("payload"), id=d["id"],
            ref=d["ref"], ipc=d["ipc"],
        )

    @property
    def owned_segment(self) -> str | None:
        """The segment whose ownership passed to mmsched with this item, if any."""
        return self.shm_name if self.transport == "shm" and not self.pooled else None


@dataclass(slots=True)
class Request:
    """A validated ``generate``/``embed``. ``client`` is the ROUTER identity (leader only)."""

    rid: str
    type: str
    input_ids: np.ndarray
    items: list[Item]
    session_id: str | None = None
    max_new_tokens: int = 8
    want_digest: bool = False
    params: dict = field(default_factory=dict)
    client: bytes = b""
    holds: list | None = None  # leader: fds locking its segments from admission until answered
    t0: float | None = None  # leader: admission time, for the latency histogram
    seq: int = 0  # leader: arrival order, so a close_session waits for the requests before it

    @property
    def key(self) -> tuple[bytes, str]:
        return (self.client, self.rid)

    @property
    def owned_segments(self) -> list[str]:
        return [it.owned_segment for it in self.items if it.owned_segment]

    @property
    def feature_bytes(self) -> int:
        return sum(it.nbytes for it in self.items)

    def wire(self) -> list:
        return [
            self.rid, self.type, self.input_ids.tobytes(), [it.wire() for it in self.items],
            self.session_id, self.max_new_tokens, self.want_digest, self.params,
        ]

    @classmethod
    def from_wire(cls, w: list) -> "Request":
        rid, typ, ids, items, sid, mnt, digest, params = w
        return cls(
            rid=rid, type=typ, input_ids=np.frombuffer(ids, dtype="<i4"),
            items=[Item.from_wire(i, d) for i, d in enumerate(items)], session_id=sid,
            max_new_tokens=mnt, want_digest=digest, params=params,
        )


@dataclass(slots=True)
class Abort:
    rid: str


@dataclass(slots=True)
class CloseSession:
    session_id: str


@dataclass(slots=True)
class Ping:
    pass


Message = Request | Abort | CloseSession | Ping


# ---------------------------------------------------------------- encoding

def pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def result(rid: str | None, status: int, message: str | None = None,
           output: dict | None = None, meta: dict | None = None) -> dict:
    return {
        "v": VERSION, "type": "result", "rid": rid, "status": status,
        "err_type": ERR_TYPE.get(status), "message": message, "output": output,
        "meta": meta or {},
    }


def pong(ranks: int, healthy: bool, **extra: Any) -> dict:
    return {"v": VERSION, "type": "pong", "ranks": ranks, "healthy": healthy, **extra}


def ack_close(session_id: str) -> dict:
    return {"v": VERSION, "type": "ack", "op": "close_session", "session_id": session_id}


# ---------------------------------------------------------------- decoding

def unpack_header(frame: Any, limits: Limits = Limits()) -> dict:
    """Frame 0 → the header map; any failure is a 400 with rid nil.

    Decoding costs memory in proportion to the frame's bytes (an empty map is 1 byte on
    the wire and ~100 in memory): ``params`` over ``max_params_bytes`` is left unread, and
    the other fields together may build at most ``limits.max_containers`` maps and arrays;
    a field past that is left unread too. ``decode`` refuses an unread field by name."""
    try:
        if _frame_len(frame) <= min(SMALL_HEADER, limits.max_params_bytes):  # bounded whatever it holds
            header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
            if not isinstance(header, dict):
                raise BadRequest("header", "not a MessagePack map")
            return header
        header, budget = {}, _Budget(limits.max_containers)
        for key, value in _map_entries(frame):
            key = _key(key)
            if key is None:
                raise ValueError("map key is not a string")
            if key == "params" and value.nbytes > limits.max_params_bytes:
                header[key] = Unread(f"{value.nbytes} bytes exceed max_params_bytes={limits.max_params_bytes}")
                continue
            try:
                header[key] = msgpack.unpackb(value, raw=False, strict_map_key=True,
                                              **({} if key == "params" else budget.hooks))
            except _Budget.Spent:
                header[key] = Unread(f"more than {limits.max_containers} maps and arrays in the header (max_items)")
        return header
    except BadRequest:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadRequest("header", f"not a MessagePack map ({type(exc).__name__})") from exc


def unpack_lenient(frame: Any) -> dict | None:
    """The ``mm_items`` of frame 0 as leniently as MessagePack allows (any map keys, bad
    UTF-8 replaced, trailing bytes ignored, fields left unread by ``unpack_header``), or None.

    Only to find the segments a rejected message names: a header that breaks the contract
    still passed their ownership. Of each item only the fields ``owned_segments`` reads are
    decoded, so the cost stays in proportion to the frame's bytes."""
    try:
        header = {}
        for key, value in _map_entries(frame, trailing_ok=True, lenient=True):
            if _key(key, "replace") == "mm_items":
                header["mm_items"] = _lenient_items(value)
        return header
    except Exception:  # msgpack raises several unrelated types
        return None


_KEPT = ("transport", "pooled", "shm_name")  # what owned_segments reads of an item
# A rejected message's first LENIENT_ITEMS items are searched for the segments it hands over
# (a valid request has at most max_items); what it names past them is left to the sweep.
# Walking 64 M nil items blocked the loop for 32 s and broke a tp=2 group.
LENIENT_ITEMS = 1024
MAX_MAP_KEYS = 64  # a header or an item has about a dozen keys


def _lenient_items(buf: memoryview) -> list | None:
    if buf[0] not in (0xdc, 0xdd) and buf[0] & 0xf0 != 0x90:
        return None  # not an array
    up, items = _unpacker(buf), []
    for _ in range(min(up.read_array_header(), LENIENT_ITEMS)):
        start = up.tell()
        up.skip()
        item = buf[start:up.tell()]
        if _is_map(item[0]):
            kept = {}
            for key, value in _map_entries(item, lenient=True):
                key = _key(key, "replace")
                if key in _KEPT:
                    try:
                        kept[key] = msgpack.unpackb(value, raw=False, unicode_errors="replace", **_Budget(0).hooks)
                    except Exception:  # an unreadable value names no segment
                        pass
            items.append(kept)
    return items


def _unpacker(buf: memoryview) -> msgpack.Unpacker:
    up = msgpack.Unpacker(raw=False, max_buffer_size=max(1, buf.nbytes))
    up.feed(buf)
    return up


def _map_entries(frame: Any, trailing_ok: bool = False, lenient: bool = False) -> list[tuple[memoryview, memoryview]]:
    """A MessagePack map's entries as (encoded key, encoded value), without building any
    of them: ``skip`` walks MessagePack without allocating.

    A map of more than MAX_MAP_KEYS entries is refused (``lenient``: only its first ones
    are read) before any is walked: millions of tiny keys in a few MB blocked the loop
    for half a minute."""
    view = memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")
    if view.nbytes == 0 or not _is_map(view[0]):
        raise ValueError("not a map")
    up, entries = _unpacker(view), []
    n = up.read_map_header()
    if n > MAX_MAP_KEYS:
        if not lenient:
            raise BadRequest("header", f"a map of {n} keys (at most {MAX_MAP_KEYS})")
        n, trailing_ok = MAX_MAP_KEYS, True
    for _ in range(n):
        k0 = up.tell()
        up.skip()
        k1 = up.tell()
        up.skip()
        entries.append((view[k0:k1], view[k1:up.tell()]))
    if not trailing_ok and up.tell() != view.nbytes:
        raise msgpack.ExtraData(None, None)
    return entries


def _is_map(first: int) -> bool:
    return first in (0xde, 0xdf) or first & 0xf0 == 0x80


def _key(buf: memoryview, unicode_errors: str = "strict") -> str | bytes | None:
    """An encoded map key, if it is a str or a bin (checked before anything is built)."""
    first = buf[0]
    if 0xa0 <= first <= 0xbf or 0xd9 <= first <= 0xdb or 0xc4 <= first <= 0xc6:
        return msgpack.unpackb(buf, raw=False, unicode_errors=unicode_errors)
    return None


class _Budget:
    """Counts the maps and arrays MessagePack builds; past ``limit`` it stops the decoding."""

    class Spent(Exception):
        pass

    def __init__(self, limit: int):
        self.left = limit
        self.hooks = {"object_hook": self._count, "list_hook": self._count}

    def _count(self, x: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise self.Spent
        return x


@dataclass(frozen=True)
class Unread:
    """A header value left undecoded because it is too big; ``decode`` refuses it by name."""

    problem: str


def readable_rid(header: Any) -> str | None:
    """The rid a 400 may carry: only a well-formed one."""
    rid = header.get("rid") if isinstance(header, dict) else None
    return rid if isinstance(rid, str) and 1 <= len(rid) <= 128 else None


def decode(frames: Sequence[Any], limits: Limits) -> Message:
    """Frames (header first, then payloads as buffers) → a typed message, or BadRequest."""
    header = unpack_header(frames[0], limits)
    rid = readable_rid(header)
    for key, v in header.items():
        if isinstance(v, Unread):
            raise BadRequest(key, v.problem, rid)
    size = sum(_frame_len(f) for f in frames)
    if size > limits.max_message_bytes:
        raise BadRequest("message", f"{size} bytes exceed max_message_bytes={limits.max_message_bytes}", rid)
    try:
        return _decode(header, frames, limits)
    except BadRequest as exc:
        exc.rid = rid
        raise


def owned_segments(header: Any, prefix: str) -> list[str]:
    """Non-pooled, allowed segment names of a message, however malformed the rest is.

    Ownership passes when a request is sent (contract guarantee 4), so even a request
    that gets a 400 has its segments unlinked; a name without the prefix or with
    characters outside the allowed set is never touched.
    """
    items = header.get("mm_items") if isinstance(header, dict) else None
    if not isinstance(items, list):
        return []
    names = []
    for it in items:
        if not isinstance(it, dict) or it.get("pooled", False) is not False:
            continue
        name = it.get("shm_name")
        if it.get("transport") == "shm" and valid_shm_name(name, prefix):
            names.append(name)
    return list(dict.fromkeys(names))


def _short(value: Any, limit: int = 80) -> str:
    """A client's value as an error message quotes it: never more than ``limit`` characters."""
    text = repr(value) if not isinstance(value, (str, bytes)) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit + 3 else text[:limit] + "..."


def valid_shm_name(name: Any, prefix: str) -> bool:
    return isinstance(name, str) and name.startswith(prefix) and bool(SHM_NAME_RE.fullmatch(name))


def _decode(h: dict, frames: Sequence[Any], limits: Limits) -> Message:
    if not _is_int(h.get("v")) or h.get("v") != VERSION:  # true and 1.0 are not 1
        raise BadRequest("v", f"unsupported protocol version {_short(h.get('v'))} (this server speaks 1)")
    typ = h.get("type")
    if _one_of(typ, REQUEST_TYPES):
        return _request(h, typ, frames, limits)
    if typ == "ping":
        return Ping()
    if typ == "abort":
        return Abort(_rid(h))
    if typ == "close_session":
        return CloseSession(_str(h, "session_id", 1, 256))
    raise BadRequest("type", f"unknown message type {_short(typ)}")


def _request(h: dict, typ: str, frames: Sequence[Any], limits: Limits) -> Request:
    rid = _rid(h)
    ids = _input_ids(h.get("input_ids"), limits)
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
    depth, count = _shape_of(params, MAX_PARAMS_DEPTH, limits.max_params_items)
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
        ref = _opt_str(it, "ref", f)
        if ref is None:
            raise BadRequest(f"{f}.ref", "required for transport 'session'")
        modality = it.get("modality", "other")
        if not _one_of(modality, MODALITIES):
            raise BadRequest(f"{f}.modality", f"must be one of {sorted(MODALITIES)}")
        # dtype/shape come from the session's stored feature.
        return Item(index=i, modality=modality, transport=transport, dtype="uint8", shape=(0,),
                    nbytes=0, ref=ref, id=item_id)
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
    # Python ints do not overflow; bound the product before anything is allocated.
    nbytes = _nbytes(shape, dtype)
    if nbytes > limits.max_item_bytes:
        raise BadRequest(f"{f}.shape", f"{nbytes} bytes exceed max_item_bytes={limits.max_item_bytes}")
    item = Item(index=i, modality=modality, transport=transport, dtype=dtype,
                shape=tuple(shape), nbytes=nbytes, id=item_id)
    if transport == "shm":
        name = it.get("shm_name")
        if not valid_shm_name(name, limits.shm_prefix):
            raise BadRequest(f"{f}.shm_name", f"must start with {limits.shm_prefix!r} and be 1-200 "
                             "characters of [A-Za-z0-9_.-]")
        offset = it.get("offset", 0)
        if not _is_int(offset) or offset < 0:
            raise BadRequest(f"{f}.offset", "must be an int >= 0")
        pooled = it.get("pooled", False)
        if not isinstance(pooled, bool):
            raise BadRequest(f"{f}.pooled", "must be a bool")
        item.shm_name, item.offset, item.pooled = name, offset, pooled
    elif transport == "inline":
        idx = it.get("frame")
        if not _is_int(idx) or not 1 <= idx < len(frames):
            raise BadRequest(f"{f}.frame", f"must index a payload frame (1..{len(frames) - 1})")
        payload = frames[idx]
        payload = payload.buffer if hasattr(payload, "buffer") else memoryview(payload)
        if payload.nbytes != nbytes:
            raise BadRequest(f"{f}.frame", f"frame {idx} holds {payload.nbytes} bytes, "
                             f"dtype and shape say {nbytes}")
        item.payload = payload
    else:
        item.ipc = _ipc(it.get("ipc"), f"{f}.ipc", limits)
    return item


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


def _frame_len(frame: Any) -> int:
    return len(frame) if not hasattr(frame, "buffer") else frame.buffer.nbytes


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def _input_ids(v: Any, limits: Limits) -> np.ndarray:
    f = "input_ids"
    if isinstance(v, (bytes, bytearray)):
        if len(v) % 4:
            raise BadRequest(f, "bin length must be a multiple of 4 (little-endian int32)")
        arr = np.frombuffer(v, dtype="<i4")
    elif isinstance(v, list):
        if len(v) > limits.max_input_len:  # before numpy copies it
            raise BadRequest(f, f"length {len(v)} outside 1..{limits.max_input_len} (max_input_len)")
        try:
            arr = np.array(v) if v else np.zeros(0, dtype=np.int64)
        except (ValueError, TypeError, OverflowError):  # ragged or otherwise not an int array
            raise BadRequest(f, "must be an array of ints or a bin of int32") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise BadRequest(f, "must be an array of ints or a bin of int32")
    else:
        raise BadRequest(f, "required: an array of ints or a bin of int32")
    if not 1 <= arr.size <= limits.max_input_len:
        raise BadRequest(f, f"length {arr.size} outside 1..{limits.max_input_len} (max_input_len)")
    if arr.min() < 0 or (arr.dtype != np.dtype("<i4") and arr.max() >= 2**31):  # int32 cannot reach 2^31
        raise BadRequest(f, "each id must satisfy 0 <= id < 2^31")
    return arr.astype("<i4", copy=False)


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


def _rid(h: dict) -> str:
    return _str(h, "rid", 1, 128)


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
