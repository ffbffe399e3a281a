"""The typed messages: what clients send (``Request``, ``Item``, ``Abort``, ``Ping``,
``CloseSession``) and what mmsched answers (``Result``, ``Pong``, ``AckClose``).

An outgoing message's ``to_wire()`` is the exact map docs/protocol.md gives, key order
included (the bytes on the wire are pinned by tests/unit/test_protocol_wire.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from .dtypes import nbytes
from .limits import VERSION

# result statuses and their err_type
OK, BAD_REQUEST, ABORTED, INTERNAL, UNAVAILABLE = 200, 400, 499, 500, 503
ERR_TYPE = {
    BAD_REQUEST: "BadRequestError",
    ABORTED: "RequestAborted",
    INTERNAL: "InternalServerError",
    UNAVAILABLE: "ServiceUnavailable",
}


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
    memfd: dict | None = None  # transport "memfd" (an extension): {"pid", "fd", "inode"}

    def wire(self) -> dict:
        """The item as the leader forwards it to followers (inline bytes included)."""
        d = {
            "modality": self.modality, "transport": self.transport, "dtype": self.dtype,
            "shape": list(self.shape), "shm_name": self.shm_name, "offset": self.offset,
            "pooled": self.pooled, "id": self.id, "ref": self.ref, "ipc": self.ipc,
        }
        if self.payload is not None:
            d["payload"] = self.payload
        if self.memfd is not None:  # only then: the batch of other transports is unchanged
            d["memfd"] = self.memfd
        return d

    @classmethod
    def from_wire(cls, index: int, d: dict) -> "Item":
        shape = tuple(d["shape"])
        return cls(
            index=index, modality=d["modality"], transport=d["transport"], dtype=d["dtype"],
            shape=shape, nbytes=nbytes(shape, d["dtype"]), shm_name=d["shm_name"],
            offset=d["offset"], pooled=d["pooled"], payload=d.get("payload"), id=d["id"],
            ref=d["ref"], ipc=d["ipc"], memfd=d.get("memfd"),
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
        return [it.owned_segment for it in self.items if it.owned_segment] if self.items else []

    @property
    def feature_bytes(self) -> int:
        """Asked several times per request on the leader: a text-only one costs no generator."""
        return sum([it.nbytes for it in self.items]) if self.items else 0

    def wire(self) -> list:
        return [
            self.rid, self.type, memoryview(self.input_ids).cast("B"), [it.wire() for it in self.items],
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


# ---------------------------------------------------------------- outgoing

@dataclass
class Result:
    """The one answer to a request, as the server builds it and the client reads it;
    ``err_type`` follows from ``status`` unless the wire said otherwise."""

    rid: str | None
    status: int
    err_type: str | None = None
    message: str | None = None
    output: dict | None = None
    meta: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_wire(self) -> dict:
        return _result_map(self.rid, self.status, self.err_type, self.message, self.output, self.meta)

    @classmethod
    def from_wire(cls, h: dict) -> "Result":
        """A result map as received (the client's side: fields taken as sent)."""
        return cls(h.get("rid"), h.get("status"), h.get("err_type"), h.get("message"),
                   h.get("output"), h.get("meta") or {})


@dataclass(slots=True)
class Pong:
    """The answer to a ping; ``extra`` (state, hosts) follows the fixed fields in order."""

    ranks: int
    healthy: bool
    extra: dict = field(default_factory=dict)

    def to_wire(self) -> dict:
        return {"v": VERSION, "type": "pong", "ranks": self.ranks, "healthy": self.healthy, **self.extra}


@dataclass(slots=True)
class AckClose:
    """The acknowledgement of a ``close_session``, sent once its session is released."""

    session_id: str

    def to_wire(self) -> dict:
        return {"v": VERSION, "type": "ack", "op": "close_session", "session_id": self.session_id}


def pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def result(rid: str | None, status: int, message: str | None = None,
           output: dict | None = None, meta: dict | None = None) -> dict:
    return _result_map(rid, status, None, message, output, meta)  # one per request: no Result object


def _result_map(rid: str | None, status: int, err_type: str | None, message: str | None,
                output: dict | None, meta: dict | None) -> dict:
    return {
        "v": VERSION, "type": "result", "rid": rid, "status": status,
        "err_type": ERR_TYPE.get(status) if err_type is None else err_type,
        "message": message, "output": output, "meta": meta or {},
    }


def pong(ranks: int, healthy: bool, **extra: Any) -> dict:
    return Pong(ranks, healthy, extra).to_wire()


def ack_close(session_id: str) -> dict:
    return AckClose(session_id).to_wire()
