"""Structure-aware fuzzing of the frontend: whatever arrives, each message gets at most one reply,
every message whose rid can be read gets exactly one, and the server keeps answering.

Headers are built from a valid request and then mutated field by field (random types, deleted
keys, extra keys, extra frames), or are random MessagePack values or random bytes. Every rid that
is a valid string is made unique, so results can be counted. No generated ``shm_name`` (nor a
cuda_ipc pool/ack-board name) ever points at a real segment: it is either unprefixed or a fresh
prefixed name that does not exist.
"""

from __future__ import annotations

import itertools
import math
import os
import time
import uuid
from collections import Counter

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, Phase, configuration, given, settings
from hypothesis import strategies as st

from mmsched.protocol import ITEMSIZE

PREFIX = "mmsched_"
TAG = uuid.uuid4().hex[:6]
REPLY_TIMEOUT = 5.0


class Fresh:
    """A placeholder the test replaces with a unique value (hypothesis draws only the shape)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self) -> str:
        return f"Fresh({self.kind})"


_n = itertools.count()


def fresh_rid() -> str:
    return f"fz-{TAG}-{next(_n)}"


def absent_segment() -> str:
    name = f"{PREFIX}fuzz_absent_{TAG}_{next(_n)}"
    assert not os.path.exists(os.path.join("/dev/shm", name))
    return name


# ---------------------------------------------------------------- strategies

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.integers(-3, 300)
           | st.floats() | st.text(max_size=12) | st.binary(max_size=12))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                      max_leaves=6)
unprefixed_names = st.from_regex(r"[A-Za-z0-9_.\-/]{1,30}", fullmatch=True).filter(lambda s: not s.startswith(PREFIX))
shm_names = st.one_of(st.just(Fresh("absent")), unprefixed_names,
                      st.builds(lambda s: PREFIX + s, st.sampled_from(["/x", "a/../b", "a b", "é", "x" * 200])))


@st.composite
def shapes(draw):
    return draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))


@st.composite
def items(draw, frames: list):
    transport = draw(st.sampled_from(["shm", "shm", "inline", "inline", "session", "cuda_ipc"]))
    dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
    shape = draw(shapes())
    it = {"modality": draw(st.sampled_from(["image", "audio", "video", "other"])), "transport": transport,
          "dtype": dtype, "shape": shape}
    if draw(st.booleans()):
        it["id"] = draw(st.text(min_size=1, max_size=8))
    if transport == "shm":
        it["shm_name"] = draw(shm_names)
        if draw(st.booleans()):
            it["offset"] = draw(st.integers(0, 64))
        if draw(st.booleans()):
            it["pooled"] = draw(st.booleans())
    elif transport == "inline":
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        size = draw(st.sampled_from([nbytes, nbytes, nbytes + 1, max(nbytes - 1, 0)]))
        frames.append(draw(st.binary(min_size=size, max_size=size)))
        it["frame"] = draw(st.sampled_from([len(frames), len(frames), 0, len(frames) + 1]))
    elif transport == "session":
        it = {"transport": "session", "ref": draw(st.text(min_size=1, max_size=8)), "modality": it["modality"]}
    else:
        it["ipc"] = {"device": draw(st.sampled_from(["shm", "cuda", "tpu"])), "handle": Fresh("absent-bin"),
                     "acks": Fresh("absent"), "ranks": draw(st.integers(0, 2)), "slot": draw(st.integers(-1, 3)),
                     "offset": draw(st.integers(0, 64)), "generation": draw(st.integers(0, 3))}
    for key in draw(st.lists(st.sampled_from(sorted(it)), max_size=2, unique=True)):  # mutate fields
        if draw(st.booleans()):
            del it[key]
        else:
            it[key] = draw(values)
    return it


@st.composite
def requests(draw):
    frames: list[bytes] = []
    h = {"v": 1, "type": draw(st.sampled_from(["embed", "generate"])), "rid": Fresh("rid")}
    ids = draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8))
    h["input_ids"] = ids if draw(st.booleans()) else b"".join(i.to_bytes(4, "little") for i in ids)
    h["mm_items"] = [draw(items(frames)) for _ in range(draw(st.integers(0, 3)))]
    if draw(st.booleans()):
        h["params"] = {"max_new_tokens": draw(st.integers(-1, 12))}
    if draw(st.booleans()):
        h["want_digest"] = draw(st.booleans())
    if draw(st.integers(0, 4)) == 0:
        h["session_id"] = draw(st.sampled_from([f"s-{TAG}-a", f"s-{TAG}-b"]))
    for key in draw(st.lists(st.sampled_from(sorted(h)), max_size=2, unique=True)):
        choice = draw(st.integers(0, 2))
        if choice == 0:
            del h[key]
        elif choice == 1:
            h[key] = draw(values)
        else:  # same key, a plausible but wrong value
            h[key] = draw(st.sampled_from([0, -1, "", "x" * 129, [], {}, 2, [2**31], b"\x01", True, None]))
    for _ in range(draw(st.integers(0, 1))):
        h[draw(st.text(min_size=1, max_size=6))] = draw(values)
    extra = draw(st.lists(st.binary(max_size=16), max_size=2))
    return "packed", h, frames + extra


control = st.one_of(
    st.fixed_dictionaries({"v": st.just(1), "type": st.just("ping")}),
    st.fixed_dictionaries({"v": st.just(1), "type": st.just("abort"), "rid": st.just(Fresh("rid")) | values}),
    st.fixed_dictionaries({"v": st.sampled_from([1, 1, 2, True]), "type": st.just("close_session"),
                           "session_id": st.sampled_from([f"s-{TAG}-a", f"s-{TAG}-c"]) | values}),
    st.fixed_dictionaries({"v": values, "type": values | st.sampled_from(["ping", "abort", "embed"]),
                           "rid": st.just(Fresh("rid")) | values}),
)

messages = st.one_of(
    requests(), requests(), requests(), requests(),
    st.tuples(st.just("packed"), control, st.lists(st.binary(max_size=8), max_size=1)),
    st.tuples(st.just("packed"), values, st.lists(st.binary(max_size=8), max_size=1)),  # any MessagePack value
    st.tuples(st.just("raw"), st.binary(max_size=48), st.lists(st.binary(max_size=8), max_size=2)),  # any bytes
)


# ---------------------------------------------------------------- the oracle

def resolve(obj):
    """Replace placeholders; keep every readable rid unique and every prefixed segment name absent."""
    if isinstance(obj, Fresh):
        return {"rid": fresh_rid, "absent": absent_segment, "absent-bin": lambda: absent_segment().encode()}[obj.kind]()
    if isinstance(obj, list):
        return [resolve(x) for x in obj]
    if isinstance(obj, dict):
        return {k: resolve(v) for k, v in obj.items()}
    return obj


def sanitize(header) -> None:
    """Whatever the mutations produced: a readable rid is fresh, a prefixed name is absent."""
    if not isinstance(header, dict):
        return
    rid = header.get("rid")
    if isinstance(rid, str) and 1 <= len(rid) <= 128 and not rid.startswith(f"fz-{TAG}-"):
        header["rid"] = fresh_rid()
    its = header.get("mm_items")
    for it in its if isinstance(its, list) else []:
        if not isinstance(it, dict):
            continue
        for key, value in list(it.items()):
            if isinstance(value, str) and value.startswith(PREFIX) and "absent" not in value:
                it[key] = absent_segment()
            elif isinstance(value, bytes) and value.startswith(PREFIX.encode()) and b"absent" not in value:
                it[key] = absent_segment().encode()
        ipc = it.get("ipc")
        if isinstance(ipc, dict):
            for key, value in list(ipc.items()):
                if isinstance(value, str) and value.startswith(PREFIX) and "absent" not in value:
                    ipc[key] = absent_segment()
                elif isinstance(value, bytes) and value.startswith(PREFIX.encode()) and b"absent" not in value:
                    ipc[key] = absent_segment().encode()


def expected_reply(frame0: bytes) -> tuple[str, str | None, set[int]]:
    """From the contract alone: what one message must get back (kind, rid, allowed statuses)."""
    try:
        h = msgpack.unpackb(frame0, raw=False, strict_map_key=True)
    except Exception:
        return "result", None, {400}
    if not isinstance(h, dict):
        return "result", None, {400}
    rid = h.get("rid")
    rid = rid if isinstance(rid, str) and 1 <= len(rid) <= 128 else None
    v, typ = h.get("v"), h.get("type")
    if not (type(v) is int and v == 1):
        return "result", rid, {400}
    if typ == "ping":
        return "pong", None, set()
    if typ == "abort":
        return ("none", None, set()) if rid is not None else ("result", None, {400})
    if typ == "close_session":
        sid = h.get("session_id")
        if isinstance(sid, str) and 1 <= len(sid) <= 256:
            return "ack", None, set()
        return "result", rid, {400}
    if typ in ("embed", "generate"):
        return "result", rid, {200, 400, 500, 503}
    return "result", rid, {400}


ERR_TYPE = {200: None, 400: "BadRequestError", 499: "RequestAborted", 500: "InternalServerError",
            503: "ServiceUnavailable"}


class Harness:
    """One DEALER, one message in flight at a time: every reply is attributable to the message just sent."""

    def __init__(self, addr: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.counts: Counter = Counter()  # what was due, by kind
        self.sent = 0
        self.dirty = False  # an exchange failed: its late reply must not be blamed on the next one

    def _recv(self, timeout_s: float) -> dict | None:
        if not self.sock.poll(max(1, int(timeout_s * 1000))):
            return None
        frames = self.sock.recv_multipart()
        assert len(frames) == 1, f"a reply of {len(frames)} frames"
        h = msgpack.unpackb(frames[0], raw=False)
        assert isinstance(h, dict) and h.get("v") == 1, h
        return h

    def exchange(self, frames: list[bytes]) -> None:
        if self.dirty:  # hypothesis is shrinking a failure: forget what the failed exchange left behind
            while self._recv(0.2) is not None:
                pass
            self.dirty = False
        self.dirty = True
        self._exchange(frames)
        self.dirty = False

    def _exchange(self, frames: list[bytes]) -> None:
        kind, rid, statuses = expected_reply(frames[0])
        self.sock.send_multipart(frames)
        self.sent += 1
        self.counts[kind] += 1
        if kind == "none":
            return  # anything it wrongly gets shows up as unexpected in the next exchange or in settle()
        deadline = time.monotonic() + REPLY_TIMEOUT
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {kind} for rid={rid!r} within {REPLY_TIMEOUT}s (guarantee 1)"
            h = self._recv(remaining)
            if h is None:
                continue
            assert h.get("type") == kind and (kind != "result" or h.get("rid") == rid), (
                f"expected one {kind} with rid={rid!r}, got {h!r}")
            if kind == "result":
                assert h["status"] in statuses, (h, statuses)
                assert h["err_type"] == ERR_TYPE[h["status"]], h
                if h["status"] == 400:
                    assert isinstance(h["message"], str) and ":" in h["message"], h
            return

    def settle(self) -> list[dict]:
        """A final ping, then a bounded quiet period; returns every reply other than that pong."""
        self.sock.send_multipart([msgpack.packb({"v": 1, "type": "ping"})])
        extras, pong = [], None
        deadline = time.monotonic() + REPLY_TIMEOUT
        while pong is None and time.monotonic() < deadline:
            h = self._recv(0.1)
            if h is not None and h.get("type") == "pong":
                pong = h
            elif h is not None:
                extras.append(h)
        assert pong is not None and pong["healthy"] is True, "the server stopped answering"
        quiet_until = time.monotonic() + 0.3
        while time.monotonic() < quiet_until and len(extras) < 100:
            h = self._recv(0.05)
            if h is not None:
                extras.append(h)
        return extras

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def hypothesis_home(tmp_path):
    """Hypothesis' caches go to a temporary directory: no .hypothesis is left in the checkout."""
    repo_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            ".hypothesis")
    had = os.path.exists(repo_dir)
    home = tmp_path / "hypothesis-home"
    configuration.set_hypothesis_home_dir(home)
    yield home
    configuration.set_hypothesis_home_dir(None)
    if not had:
        assert not os.path.exists(repo_dir), "hypothesis wrote .hypothesis into the checkout"


def test_fuzz_frontend(shared_server, hypothesis_home):
    h = Harness(shared_server.addr)

    @settings(max_examples=1000, deadline=None, database=None, derandomize=False,
              phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(messages)
    def one_message(msg):
        how, header, payloads = msg
        if how == "raw":
            frame0 = header
        else:
            header = resolve(header)
            sanitize(header)
            frame0 = msgpack.packb(header, use_bin_type=True)
        h.exchange([frame0, *payloads])

    try:
        one_message()
        extras = h.settle()
        assert extras == [], f"replies nobody asked for: {extras[:5]}"
        assert h.sent >= 500 and h.counts["result"] > 300, (h.sent, h.counts)
    finally:
        h.close()
    logs = shared_server.logs()
    assert "decode_crashed" not in logs, "decode raised something other than BadRequest"
    assert "Traceback" not in logs
