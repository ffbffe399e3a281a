"""Structure-aware fuzzing of a tp = 2 group: whatever arrives, no rank dies, nothing leaks.

A seeded generator builds valid requests (every transport: real shm segments, pooled slices,
inline frames, session refs, cuda_ipc slots of a real shm-backed pool, bogus cuda_ipc maps),
then mutates them field by field: random types, out-of-range and huge values, unicode, extra
keys, missing or extra or truncated frames, truncated MessagePack, random bytes; aborts,
close_session and pings are interleaved. Shapes hostile clients used (issue 16): params far
over max_params_bytes / max_params_items (millions of empty maps), turns of up to 64
zero-size features with ids in fresh sessions, up to 64 items naming one segment, and rids
reused (one answered on the same socket, one in flight on the other). Messages go out over two DEALER sockets in bounded
windows (at most WINDOW awaiting a reply), so max_queue is never what answers.

The oracle, from the contract alone:
- every message gets exactly the replies the contract promises: one result for each message
  whose rid is readable and whose kind has a result (requests, malformed anything), a pong per
  ping, an ack per close_session, nothing for a well-formed abort; nothing more, ever;
- each result is well-formed, comes back on the socket that sent the message, and its status is
  one the contract allows for that message (a request whose params are over a bound: 400 only; a
  header over 16 KiB is read field by field as the leader does, and a field over its bound is
  refused unread, with the rid, whatever it holds);
- a non-pooled, prefixed shm segment named by a generate/embed message is unlinked by the time
  its result arrives; the fuzzer removes the segments it created for anything else itself;
- both rank processes are alive at the end, /dev/shm holds nothing new, and each rank's RSS grew
  by less than 64 MiB from after the warm-up to the end.

Every shm_name the fuzzer generates names either a segment that does not exist or one the
fuzzer created for that message; mutations never point a name at anything else.
"""

from __future__ import annotations

import os
import random
import string
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import msgpack
import pytest
import torch
import zmq

from mmsched.errors import BadRequest
from mmsched.protocol import ITEMSIZE, SMALL_HEADER, Limits, Unread, readable_rid, unpack_header
from mmsched.devices import ShmDevice
from mmsched.producers import IpcPool
from mmsched.producers import create_segment
from mmsched.producers import ShmPool

from ..conftest import Server, sync_ping
from ..conftest import pid_alive as alive

PREFIX = "mmsched_"
SHM = "/dev/shm"
WINDOW = 200
REPLY_TIMEOUT = 30.0
RSS_BUDGET_KIB = 64 * 1024
SESSIONS = [f"fz-s{i}" for i in range(4)]
MAX_PARAMS_BYTES, MAX_PARAMS_ITEMS = 65536, 4096
FUZZ_LIMITS = Limits(max_params_bytes=MAX_PARAMS_BYTES, max_params_items=MAX_PARAMS_ITEMS)
STATUSES = {200: None, 400: "BadRequestError", 499: "RequestAborted", 500: "InternalServerError",
            503: "ServiceUnavailable"}
GROUP_ARGS = (
    "--tp", "2", "--max-batch", "64", "--collective-timeout", "30",
    "--session-max-bytes", str(64 * 1024), "--session-idle-timeout", "5",
    "--session-max-count", "64", "--session-max-features", "1024",
    "--max-params-bytes", str(MAX_PARAMS_BYTES), "--max-params-items", str(MAX_PARAMS_ITEMS),
    # some rids fail on purpose, on either rank and at each stage, so the 500 paths are fuzzed too
    "--fault", "1:open:fzf1-*", "--fault", "0:materialize:fzf0-*", "--fault", "1:engine:fze1-*",
    "--fault", "1:release:fzr1-*", "--fault", "0:open:fzo0-*",
)


# ---------------------------------------------------------------- the group

@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with Server(*GROUP_ARGS, tmp_dir=str(tmp_path_factory.mktemp("fuzzgroup"))) as srv:
        srv.pids = srv.rank_pids()
        yield srv






def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


# ---------------------------------------------------------------- the oracle

def expected(frame0: bytes) -> tuple[str, str | None, frozenset[int]]:
    """(kind of reply, rid it carries, statuses allowed) that the contract promises for a message."""
    if len(frame0) > SMALL_HEADER:  # read field by field: a field over its bound is refused unread, rid kept
        try:
            h = unpack_header(frame0, FUZZ_LIMITS)
        except BadRequest:
            return "result", None, frozenset({400})
        if any(isinstance(v, Unread) for v in h.values()):
            return "result", readable_rid(h), frozenset({400})
    try:
        h = msgpack.unpackb(frame0, raw=False, strict_map_key=True)
    except Exception:
        return "result", None, frozenset({400})
    if not isinstance(h, dict):
        return "result", None, frozenset({400})
    rid = h.get("rid")
    rid = rid if isinstance(rid, str) and 1 <= len(rid) <= 128 else None
    v, typ = h.get("v"), h.get("type")
    if not (type(v) is int and v == 1):
        return "result", rid, frozenset({400})
    if typ == "ping":
        return "pong", None, frozenset()
    if typ == "abort":
        return ("none", None, frozenset()) if rid is not None else ("result", None, frozenset({400}))
    if typ == "close_session":
        sid = h.get("session_id")
        if isinstance(sid, str) and 1 <= len(sid) <= 256:
            return "ack", None, frozenset()
        return "result", rid, frozenset({400})
    if typ in ("generate", "embed"):
        if params_over_bounds(h.get("params")):
            return "result", rid, frozenset({400})
        return "result", rid, frozenset({200, 400, 499, 500, 503})
    return "result", rid, frozenset({400})


def params_over_bounds(params) -> bool:
    if not isinstance(params, dict):
        return False
    count, todo = 0, [params]
    while todo:
        x = todo.pop()
        children = [*x.keys(), *x.values()] if isinstance(x, dict) else x if isinstance(x, list) else []
        count += len(children)
        todo.extend(children)
    return count > MAX_PARAMS_ITEMS or len(msgpack.packb(params, use_bin_type=True)) > MAX_PARAMS_BYTES


def must_unlink(frame0: bytes, created: set[str]) -> set[str]:
    """The fuzzer's segments whose ownership the message passed to mmsched (contract guarantee 4)."""
    try:
        h = msgpack.unpackb(frame0, raw=False, strict_map_key=True)
    except Exception:
        return set()
    if not isinstance(h, dict) or h.get("type") not in ("generate", "embed"):
        return set()
    items = h.get("mm_items")
    out = set()
    for it in items if isinstance(items, list) else []:
        if (isinstance(it, dict) and it.get("transport") == "shm" and it.get("pooled", False) is False
                and isinstance(it.get("shm_name"), str) and it["shm_name"] in created):
            out.add(it["shm_name"])
    return out


# ---------------------------------------------------------------- the generator

@dataclass
class Msg:
    frames: list
    sock: int
    kind: str
    rid: str | None
    statuses: frozenset
    created: set[str] = field(default_factory=set)
    owned: set[str] = field(default_factory=set)
    slices: list = field(default_factory=list)
    leases: list = field(default_factory=list)


UNICODE = "é€😀\u202e\u0301\x00\ud7ff\ufeff语ß"


class Gen:
    def __init__(self, seed: int, tag: str, shm_pool: ShmPool, ipc_pool: IpcPool):
        self.r = random.Random(seed)
        self.tag, self.pool, self.ipc = tag, shm_pool, ipc_pool
        self.n = 0
        self.absent_n = 0
        self.reusable: list[str] = []  # set by the driver before each message

    # ---- atoms
    def fresh_rid(self) -> str:
        self.n += 1
        r = self.r.random()
        base = f"fz{self.tag}-{self.n}"
        if r < 0.04:
            return ("f" + "ü" * 127 + base)[-128:]  # 128 characters, unicode
        if r < 0.08:
            return "é😀" + base
        if r < 0.14:  # a rid that an injected fault fails somewhere
            return self.r.choice(["fzf1-", "fzf0-", "fze1-", "fzr1-", "fzo0-"]) + base
        return base

    def absent(self) -> str:
        self.absent_n += 1
        return f"{PREFIX}fzabsent_{self.tag}_{self.absent_n}"

    def text(self, lo: int = 0, hi: int = 12) -> str:
        alphabet = string.ascii_letters + string.digits + "_.-/ " + UNICODE
        return "".join(self.r.choice(alphabet) for _ in range(self.r.randint(lo, hi)))

    def junk(self, depth: int = 0):
        r = self.r.random()
        if depth < 3 and r < 0.12:
            return [self.junk(depth + 1) for _ in range(self.r.randint(0, 3))]
        if depth < 3 and r < 0.22:
            return {self.text(0, 5): self.junk(depth + 1) for _ in range(self.r.randint(0, 3))}
        return self.r.choice([
            None, True, False, 0, 1, -1, 2, 7, 2**31, 2**31 - 1, -(2**31), 2**32, 2**63 - 1, -(2**63),
            2**64 - 1, 0.0, -0.0, 1.0, 1.5, float("nan"), float("inf"), -float("inf"), 1e308,
            "", "x", "embed", "generate", "ping", "abort", "shm", "inline", "image", "float32", "1",
            b"", b"\x00", b"\xff" * 9, msgpack.ExtType(self.r.randint(0, 127), os.urandom(self.r.randint(0, 9))),
            msgpack.Timestamp(self.r.randint(0, 2**34 - 1), self.r.randint(0, 999999999)),
            [], {}, self.text(1, 20), self.r.randint(-5, 300), self.r.random() * 1e6,
        ])

    def huge_params(self) -> dict:
        """Over max_params_items or max_params_bytes, some of them by far (4 M empty maps in 4 MB)."""
        n = self.r.choice([MAX_PARAMS_ITEMS, 20_000, 300_000, 4_000_000 if self.r.random() < 0.02 else 40_000])
        return self.r.choice([{"x": [{}] * n}, {"x": [0] * n}, {"x": bytes(MAX_PARAMS_BYTES)},
                              {"x": "é" * (MAX_PARAMS_BYTES // 2)}, {str(i): None for i in range(min(n, 40_000))}])

    def deep(self):
        v: object = 0
        for _ in range(self.r.choice([33, 600, 1019, 1021, 1021])):
            v = [v] if self.r.random() < 0.5 else {"k": v}
        return v

    # ---- items
    def item(self, msg: Msg, frames: list, session: str | None) -> dict:
        dtype = self.r.choice(sorted(ITEMSIZE))
        shape = [self.r.randint(0, 4) for _ in range(self.r.randint(1, 3))]
        nbytes = ITEMSIZE[dtype]
        for d in shape:
            nbytes *= d
        it = {"modality": self.r.choice(["image", "audio", "video", "other"]), "dtype": dtype, "shape": shape}
        if session is not None and self.r.random() < 0.5:
            it["id"] = self.r.choice(["a", "b", "c", self.text(1, 6)])
        t = self.r.random()
        if t < 0.30:  # a real segment, handed over
            offset = self.r.choice([0, 0, 0, 8, 64])
            size = offset + nbytes + self.r.choice([0, 0, 0, 5, -1 if nbytes else 0])
            seg = create_segment(os.urandom(max(size, 0)))
            seg.sent()
            msg.created.add(seg.name)
            it.update(transport="shm", shm_name=seg.name)
            if offset or self.r.random() < 0.2:
                it["offset"] = offset
        elif t < 0.38:  # a prefixed name that does not exist
            it.update(transport="shm", shm_name=self.absent())
        elif t < 0.48 and nbytes:  # a slice of the fuzzer's pool
            tensor = torch.frombuffer(bytearray(os.urandom(nbytes)), dtype=torch.uint8)
            off = self.pool.put(tensor)
            if off is None:
                it.update(transport="shm", shm_name=self.absent())
            else:
                msg.slices.append((off, nbytes))
                it.update(transport="shm", shm_name=self.pool.name, offset=off, pooled=True)
        elif t < 0.70:
            payload = os.urandom(nbytes)
            frames.append(payload)
            it.update(transport="inline", frame=len(frames))
        elif t < 0.80:
            it = {"transport": "session", "ref": self.r.choice(["a", "b", "c", "zz"]),
                  "modality": it["modality"]}
        elif t < 0.88 and nbytes:  # a real cuda_ipc slot (shm-backed device)
            tensor = torch.frombuffer(bytearray(os.urandom(nbytes)), dtype=torch.uint8)
            lease = self.ipc.lease(tensor)
            if lease is None:
                it.update(transport="shm", shm_name=self.absent())
            else:
                msg.leases.append(lease)
                it.update(transport="cuda_ipc", ipc=self.ipc.item(tensor, lease))
        else:  # a bogus cuda_ipc map
            it.update(transport="cuda_ipc", ipc={
                "device": self.r.choice(["shm", "shm", "cuda", "tpu"]), "handle": self.absent().encode(),
                "acks": self.absent(), "ranks": self.r.choice([0, 1, 2, 3, 2**40]),
                "slot": self.r.choice([-1, 0, 1, 2**62]), "offset": self.r.choice([0, 8, 2**63]),
                "generation": self.r.choice([0, 1, 2**63 - 1, 2**63])})
        return it

    def request(self, msg: Msg) -> tuple[dict, list]:
        frames: list = []
        ids = [self.r.randint(0, 2**31 - 1) for _ in range(self.r.randint(1, 16))]
        rid = self.r.choice(self.reusable) if self.reusable and self.r.random() < 0.05 else self.fresh_rid()
        h = {"v": 1, "type": self.r.choice(["embed", "generate"]), "rid": rid,
             "input_ids": ids if self.r.random() < 0.5 else b"".join(i.to_bytes(4, "little") for i in ids)}
        session = self.r.choice(SESSIONS) if self.r.random() < 0.25 else None
        if session is not None:
            h["session_id"] = session
        if h["type"] == "generate" and self.r.random() < 0.7:
            h["params"] = {"max_new_tokens": self.r.randint(1, 8)}
        if self.r.random() < 0.2:
            h["want_digest"] = True
        r = self.r.random()
        if r < 0.04:  # up to 64 zero-size features with ids, in a session of its own
            h["session_id"] = f"fz-z{self.tag}-{self.n}"
            h["mm_items"] = [self.zero_size(msg, frames, f"z{i}") for i in range(self.r.randint(1, 64))]
        elif r < 0.08:  # up to 64 items naming one segment
            h["mm_items"] = self.one_segment(msg, self.r.randint(2, 64))
        else:
            h["mm_items"] = [self.item(msg, frames, session) for _ in range(self.r.choice([0, 1, 1, 2, 3]))]
        return h, frames

    def zero_size(self, msg: Msg, frames: list, item_id: str) -> dict:
        it = {"modality": "image", "dtype": self.r.choice(sorted(ITEMSIZE)), "id": item_id,
              "shape": self.r.choice([[0], [0, 5], [3, 0, 2]])}
        t = self.r.random()
        if t < 0.4:
            frames.append(b"")
            it.update(transport="inline", frame=len(frames))
        elif t < 0.7:
            seg = create_segment(b"")
            seg.sent()
            msg.created.add(seg.name)
            it.update(transport="shm", shm_name=seg.name)
        else:  # a zero-size slice of the fuzzer's pool, at any offset inside it
            it.update(transport="shm", shm_name=self.pool.name, offset=self.r.randrange(self.pool.size),
                      pooled=True)
        return it

    def one_segment(self, msg: Msg, n: int) -> list[dict]:
        seg = create_segment(os.urandom(64))
        seg.sent()
        msg.created.add(seg.name)
        items = []
        for _ in range(n):
            dtype = self.r.choice(["uint8", "float32", "int64"])
            count = self.r.randint(0, 64 // ITEMSIZE[dtype])
            items.append({"modality": "image", "transport": "shm", "shm_name": seg.name, "dtype": dtype,
                          "shape": [count], "offset": self.r.randint(0, 64 - count * ITEMSIZE[dtype])})
        return items

    # ---- mutations
    def mutate_item(self, it: dict) -> None:
        key = self.r.choice(sorted(it) + ["shm_name", "offset", "pooled", "frame", "id", "ref", "ipc", "extra"])
        r = self.r.random()
        if key == "extra":
            it[self.text(1, 6)] = self.junk()
        elif r < 0.25:
            it.pop(key, None)
        elif key == "shape":
            it["shape"] = self.r.choice([[], [-1], [2**40, 2**40], [1] * 9, [1.0], ["2"], [2**64 - 1], [[2]],
                                         [0, 2**62], self.junk()])
        elif key == "shm_name":
            it["shm_name"] = self.r.choice([self.absent(), "other_fz", f"{PREFIX}../etc/passwd", "/dev/shm/x",
                                            f"{PREFIX}a b", PREFIX + "é", "", PREFIX + "x" * 200, self.junk()])
        elif key == "offset":
            it["offset"] = self.r.choice([-1, 2**63, 2**64 - 1, 1.0, "0", 10**6, self.junk()])
        elif key == "ipc" and isinstance(it.get("ipc"), dict) and r < 0.8:
            ipc = it["ipc"]
            k = self.r.choice(["device", "handle", "acks", "ranks", "slot", "offset", "generation"])
            ipc[k] = self.r.choice([self.junk(), -1, 0, 2**64 - 1, b"x" * 5000, self.absent(),
                                    self.absent().encode()])
        else:
            it[key] = self.junk()

    def mutate(self, h: dict, frames: list) -> None:
        for _ in range(self.r.randint(1, 3)):
            r = self.r.random()
            items = h.get("mm_items")
            if r < 0.35 and isinstance(items, list) and items:
                it = self.r.choice(items)
                if isinstance(it, dict):
                    self.mutate_item(it)
                else:
                    items[items.index(it)] = self.junk()
            elif r < 0.45:
                h[self.text(1, 8)] = self.junk()  # an extra key
            elif r < 0.55:
                h.pop(self.r.choice(sorted(h)), None)
            elif r < 0.62:
                key = self.r.choice(["v", "type", "rid", "input_ids", "session_id", "want_digest", "params",
                                     "mm_items"])
                h[key] = self.r.choice([0, -1, "", "x" * 129, [], {}, 2, [2**31], b"\x01\x02\x03", True, None,
                                        1.0, [-1], [2**64 - 1], list(range(300)), [[1]], [1.5], self.junk()])
            elif r < 0.72:
                h["params"] = self.r.choice([{"max_new_tokens": self.r.choice([0, -1, 9, 2**64 - 1, "4", 4.0])},
                                             {"x": self.deep()}, {"x": self.deep()},
                                             {"max_new_tokens": 2, "extra": self.junk()}, self.junk(),
                                             self.huge_params(), self.huge_params()])
            elif r < 0.74:  # too many items
                h["mm_items"] = [{"transport": "session", "ref": "a"}] * self.r.choice([65, 1000])
            elif r < 0.82 and frames:
                op = self.r.random()
                if op < 0.3:
                    frames.pop(self.r.randrange(len(frames)))
                elif op < 0.6:
                    i = self.r.randrange(len(frames))
                    frames[i] = frames[i][: self.r.randint(0, max(len(frames[i]) - 1, 0))]
                else:
                    self.r.shuffle(frames)
            elif r < 0.88:
                frames.append(os.urandom(self.r.randint(0, 64)))
            else:
                h[self.r.choice(["v", "type"])] = self.junk()

    def sanitize(self, h) -> None:
        """After mutation: a readable rid is fresh, and no name points at a real segment the fuzzer
        does not expect mmsched to consume (its pool is only ever named as pooled)."""
        if not isinstance(h, dict):
            return
        rid = h.get("rid")
        if isinstance(rid, str) and 1 <= len(rid) <= 128 and f"fz{self.tag}-" not in rid:
            h["rid"] = self.fresh_rid()
        items = h.get("mm_items")
        for it in items if isinstance(items, list) else []:
            if not isinstance(it, dict):
                continue
            for key, value in list(it.items()):
                if key == "ipc" or not isinstance(value, (str, bytes)):
                    continue
                s = value.decode(errors="replace") if isinstance(value, bytes) else value
                if s in (self.pool.name, self.ipc.board.name, self.ipc.handle.decode()):
                    if not (key == "shm_name" and it.get("transport") == "shm" and it.get("pooled") is True
                            and s == self.pool.name):
                        it[key] = self.absent()

    # ---- messages
    def message(self, msg: Msg, in_flight: list[str]) -> None:
        r = self.r.random()
        if r < 0.10:
            h, frames = self.request(msg)  # valid as built
        elif r < 0.70:
            h, frames = self.request(msg)
            self.mutate(h, frames)
            self.sanitize(h)
        elif r < 0.74:
            msg.frames = [msgpack.packb({"v": 1, "type": "ping"})]
            return
        elif r < 0.80:
            target = self.r.choice(in_flight) if in_flight and self.r.random() < 0.8 else self.fresh_rid()
            h = {"v": 1, "type": "abort", "rid": target}
            if self.r.random() < 0.3:
                h[self.r.choice(["v", "rid", "extra"])] = self.junk()
            msg.frames = [msgpack.packb(h, use_bin_type=True)]
            return
        elif r < 0.85:
            h = {"v": 1, "type": "close_session", "session_id": self.r.choice(SESSIONS)}
            if self.r.random() < 0.3:
                h[self.r.choice(["v", "session_id", "rid"])] = self.junk()
                self.sanitize(h)
            msg.frames = [msgpack.packb(h, use_bin_type=True)]
            return
        elif r < 0.90:  # any MessagePack value
            msg.frames = [msgpack.packb(self.junk(), use_bin_type=True)] + \
                [os.urandom(self.r.randint(0, 8)) for _ in range(self.r.randint(0, 2))]
            return
        elif r < 0.95:  # random bytes, or a header with a raw MessagePack oddity where the rid goes
            if self.r.random() < 0.5:
                msg.frames = [os.urandom(self.r.randint(0, 64)) for _ in range(self.r.randint(1, 3))]
            else:
                oddity = self.r.choice([
                    b"\xd4\xff\x00", b"\xc7\x05\xff" + bytes(5),          # timestamps of impossible lengths
                    b"\xc1", b"\xa5abc", b"\xdb\xff\xff\xff\xff",         # never-used byte, short str, 4 GiB str
                    b"\xa2\xc3\x28", b"\xdd\x7f\xff\xff\xff",            # invalid UTF-8; a 2^31-element array
                    b"\x81\x01\x02", b"\x81\x91\x01\x02",                 # map with an int key / an array key
                ])
                head = b"\x83" + msgpack.packb("v") + msgpack.packb(1) + msgpack.packb("type") + \
                    msgpack.packb(self.r.choice(["embed", "ping", "abort"])) + msgpack.packb("rid")
                msg.frames = [head + oddity]
            return
        else:  # a valid request, truncated
            h, frames = self.request(msg)
            packed = msgpack.packb(h, use_bin_type=True)
            msg.frames = [packed[: self.r.randint(0, len(packed) - 1)], *frames]
            return
        msg.frames = [msgpack.packb(h, use_bin_type=True), *frames]


# ---------------------------------------------------------------- the driver

class Fuzz:
    def __init__(self, srv: Server, seed: int):
        self.srv = srv
        self.tag = uuid.uuid4().hex[:6]
        ctx = zmq.Context.instance()
        self.socks = []
        for _ in range(2):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(srv.addr)
            self.socks.append(s)
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)
        self.pool = ShmPool(1 << 20)
        self.ipc = IpcPool(ShmDevice(), slots=32, slot_bytes=1024, ranks=2)
        self.gen = Gen(seed, self.tag, self.pool, self.ipc)
        self.due: list[Counter] = [Counter(), Counter()]      # rid (None: nil) -> results due
        self.got: list[Counter] = [Counter(), Counter()]
        self.by_rid: list[dict[str, list[Msg]]] = [defaultdict(list), defaultdict(list)]
        self.pongs_due, self.pongs = [0, 0], [0, 0]
        self.acks_due, self.acks = [0, 0], [0, 0]
        self.statuses: Counter = Counter()
        self.problems: list[str] = []
        self.nil_msgs: list[Msg] = []  # messages whose result carries rid nil: cleaned at the end
        self.answered: list[list[str]] = [[], []]  # rids whose every message is answered, per socket
        self.sent = 0

    # outstanding replies (results, pongs, acks) over both sockets
    def outstanding(self) -> int:
        return sum(sum(d.values()) - sum(g.values()) for d, g in zip(self.due, self.got)) + \
            sum(self.pongs_due) - sum(self.pongs) + sum(self.acks_due) - sum(self.acks)

    def send_one(self) -> None:
        k = self.gen.r.randrange(2)
        msg = Msg(frames=[], sock=k, kind="", rid=None, statuses=frozenset())
        in_flight = [rid for rid, ms in self.by_rid[k].items() if ms and self.due[k][rid] > self.got[k][rid]]
        other = [rid for rid in list(self.by_rid[1 - k])[-20:] if rid is not None]
        self.gen.reusable = other + self.answered[k][-20:]  # in flight on the other socket; answered here
        self.gen.message(msg, in_flight[-50:])
        msg.kind, msg.rid, msg.statuses = expected(msg.frames[0])
        msg.owned = must_unlink(msg.frames[0], msg.created)
        self.socks[k].send_multipart(msg.frames, copy=False)
        self.sent += 1
        if msg.kind == "result":
            self.due[k][msg.rid] += 1
            if msg.rid is None:
                self.nil_msgs.append(msg)
            else:
                self.by_rid[k][msg.rid].append(msg)
        elif msg.kind == "pong":
            self.pongs_due[k] += 1
        elif msg.kind == "ack":
            self.acks_due[k] += 1
        else:  # a well-formed abort: no reply; its resources (none) need no bookkeeping
            pass
        if msg.kind != "result":
            self.release(msg, result_status=None)

    def release(self, msg: Msg, result_status: int | None) -> None:
        """The message is answered: check what mmsched owned is gone; clean up what it did not own."""
        for name in msg.owned:
            if os.path.exists(os.path.join(SHM, name)):
                self.problems.append(f"segment {name} of rid={msg.rid!r} outlived its result")
        for name in msg.created - msg.owned:
            try:
                os.unlink(os.path.join(SHM, name))
            except FileNotFoundError:
                pass
        msg.created = set()
        for off, n in msg.slices:
            self.pool.free(off, n)
        msg.slices = []
        if msg.leases and result_status == 400:  # never reached a rank: nobody acknowledges it
            for lease in msg.leases:
                self.ipc.forget(lease)
        msg.leases = []

    def take(self, timeout_ms: int) -> bool:
        ready = dict(self.poller.poll(timeout_ms))
        if not ready:
            return False
        for k, s in enumerate(self.socks):
            if s not in ready:
                continue
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.on_reply(k, frames)
        return True

    def on_reply(self, k: int, frames: list[bytes]) -> None:
        h = msgpack.unpackb(frames[0], raw=False)
        if len(frames) != 1 or h.get("v") != 1:
            self.problems.append(f"malformed reply {h!r}")
        kind = h.get("type")
        if kind == "pong":
            self.pongs[k] += 1
            return
        if kind == "ack":
            self.acks[k] += 1
            return
        if kind != "result":
            self.problems.append(f"unexpected reply {h!r}")
            return
        rid, status = h.get("rid"), h.get("status")
        self.statuses[status] += 1
        self.got[k][rid] += 1
        if self.got[k][rid] > self.due[k][rid]:
            other = 1 - k
            where = "on the other socket" if self.due[other][rid] else "for no message"
            self.problems.append(f"extra result rid={rid!r} status={status} ({where})")
            return
        if STATUSES.get(status, "?") != h.get("err_type"):
            self.problems.append(f"status {status} with err_type {h.get('err_type')!r}")
        if rid is None:
            if status != 400:
                self.problems.append(f"rid-nil result with status {status}")
            return
        msgs = self.by_rid[k][rid]
        allowed = frozenset().union(*(m.statuses for m in msgs))
        if status not in allowed:
            self.problems.append(f"rid={rid!r} got {status}, allowed {sorted(allowed)}: {h.get('message')!r}")
        if self.got[k][rid] == self.due[k][rid]:  # every message with this rid is answered
            for m in msgs:
                self.release(m, status)
            del self.by_rid[k][rid]
            self.answered[k] = self.answered[k][-63:] + [rid]

    def check_alive(self) -> None:
        dead = [p for p in self.srv.pids if not alive(p)]
        assert not dead, (f"rank pid(s) {dead} died after {self.sent} messages; server log tail:\n"
                          f"{self.srv.logs()[-3000:]}")

    def run(self, n: int) -> None:
        for i in range(n):
            while self.outstanding() >= WINDOW:
                if not self.take(int(REPLY_TIMEOUT * 1000)):
                    self.check_alive()
                    raise AssertionError(f"no reply within {REPLY_TIMEOUT}s with {self.outstanding()} outstanding;"
                                         f" server log tail:\n{self.srv.logs()[-3000:]}")
            self.send_one()
            self.take(0)
            if i % 250 == 0:
                self.check_alive()

    def settle(self) -> None:
        deadline = time.monotonic() + REPLY_TIMEOUT
        while self.outstanding() > 0 and time.monotonic() < deadline:
            self.take(100)
        # a final ping on each socket: any reply still owed would have come before its pong
        for k, s in enumerate(self.socks):
            self.pongs_due[k] += 1
            s.send(msgpack.packb({"v": 1, "type": "ping"}))
        deadline = time.monotonic() + REPLY_TIMEOUT
        while self.outstanding() > 0 and time.monotonic() < deadline:
            self.take(100)
        quiet = time.monotonic() + 0.5
        while time.monotonic() < quiet:
            self.take(50)

    def missing(self) -> list[str]:
        out = []
        for k in range(2):
            for rid, n in self.due[k].items():
                if self.got[k][rid] < n:
                    out.append(f"sock {k} rid={rid!r}: {self.got[k][rid]} of {n} results")
            if self.pongs[k] != self.pongs_due[k]:
                out.append(f"sock {k}: {self.pongs[k]} of {self.pongs_due[k]} pongs")
            if self.acks[k] != self.acks_due[k]:
                out.append(f"sock {k}: {self.acks[k]} of {self.acks_due[k]} acks")
        return out

    def close(self) -> None:
        for msgs in (m for by in self.by_rid for ms in by.values() for m in ms):
            self.release(msgs, None)
        for m in self.nil_msgs:
            m.owned = set()  # which nil-rid result was whose is unknowable: clean up, checked below
            self.release(m, None)
        for s in self.socks:
            s.close(linger=0)
        self.pool.close()
        self.ipc.close()


def fuzz(srv: Server, total: int, warmup: int, seed: int) -> dict:
    mine = f"{PREFIX}{os.getpid()}_"
    before_shm = {n for n in os.listdir(SHM) if n.startswith(PREFIX)}
    f = Fuzz(srv, seed)
    t0 = time.monotonic()
    try:
        f.run(warmup)
        f.settle()
        f.check_alive()
        rss0 = [rss_kib(p) for p in srv.pids]
        f.run(total - warmup)
        f.settle()
        f.check_alive()
        rss1 = [rss_kib(p) for p in srv.pids]
        missing = f.missing()
    finally:
        f.close()
    duration = time.monotonic() - t0
    figures = {"messages": f.sent, "seconds": round(duration, 1), "rss_kib_before": rss0, "rss_kib_after": rss1,
               "results": dict(sorted(f.statuses.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))),
               "pongs": sum(f.pongs), "acks": sum(f.acks)}
    print(f"\nfuzz figures: {figures}")
    assert f.problems == [], f"{len(f.problems)} problems, first: {f.problems[:10]}"
    assert missing == [], f"replies missing: {missing[:10]}"
    assert all(alive(p) for p in srv.pids), f"a rank died:\n{srv.logs()[-3000:]}"
    assert srv.proc.poll() is None
    pong = sync_ping(srv.addr, 10.0)
    assert pong is not None and pong["healthy"] is True and pong["ranks"] == 2, pong
    for p, a, b in zip(srv.pids, rss0, rss1):
        assert b - a < RSS_BUDGET_KIB, f"rank pid {p} RSS grew {b - a} KiB ({a} -> {b})"
    leftover = {n for n in os.listdir(SHM) if n.startswith(PREFIX)} - before_shm
    assert not {n for n in leftover if n.startswith(mine) or "fzabsent" in n}, sorted(leftover)[:10]
    logs = srv.logs()
    for bad in ("Traceback", "decode_crashed", "group_broken", "rank_exited"):
        assert bad not in logs, f"{bad} in the server log:\n{logs[-3000:]}"
    # the statuses a fuzzer should reach, so a generator that went dull fails loudly
    assert {200, 400, 500}.issubset(f.statuses), f.statuses
    return figures


def test_fuzz_group_fast(group):
    fuzz(group, total=2000, warmup=300, seed=7)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_group_full(group):
    fuzz(group, total=int(os.environ.get("MMSCHED_FUZZ_MESSAGES", "50000")), warmup=2000,
         seed=int(os.environ.get("MMSCHED_FUZZ_SEED", "20260")))


async def test_deeply_nested_params_are_refused_and_the_group_stays_up(group):
    """A header whose params nest ~1000 deep decodes, but could not be re-packed into the batch
    the followers receive: it must be a 400, never a broken group."""
    from mmsched.client import Client

    async with Client(group.addr) as c:
        for depth in (33, 1019, 1021):
            v: object = 0
            for _ in range(depth):
                v = [v]
            fut = c.send_raw({"v": 1, "type": "embed", "rid": f"deep-{depth}", "input_ids": [1],
                              "params": {"x": v}}, rid=f"deep-{depth}")
            r = await c.wait(f"deep-{depth}", fut, 10)
            assert (r.status, r.err_type) == (400, "BadRequestError"), r
            assert r.message.startswith("params:"), r.message
        ok = await c.embed([1, 2], params={"x": [[[1]]]}, timeout=10)
        assert ok.status == 200, ok
    assert all(alive(p) for p in group.pids)
    assert sync_ping(group.addr, 5.0)["healthy"] is True
