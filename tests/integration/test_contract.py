"""The wire contract (PROTOCOL.md) through real ZeroMQ sockets against a real tp=1 ``mmsched serve``."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import uuid

import msgpack
import numpy as np
import pytest
import torch
import zmq

from mmsched.client import Client, inline, raw, shm
from mmsched.producers import create_segment
from mmsched.protocol import dtype_name
from mmsched.segments import tensor_bytes
from tests.conftest import Server

PREFIX = "mmsched_"
FAILED_PREFIX = "Multimodal feature reconstruction failed (rank 0: "


def shm_file(name: str) -> str:
    return os.path.join("/dev/shm", name)


def sha256_of(t: torch.Tensor) -> str:
    """Client-side digest of a tensor's row-major bytes, computed independently of mmsched."""
    flat = t.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def seg_item(t: torch.Tensor, **extra):
    """An shm item map for ``t`` in a fresh segment; call ``seg.sent()`` once the request is out."""
    seg = create_segment(t, PREFIX)
    item = {"modality": "image", "transport": "shm", "dtype": dtype_name(t.dtype), "shape": list(t.shape),
            "shm_name": seg.name, **extra}
    return item, seg


def request(rid: str, **over) -> dict:
    h = {"v": 1, "type": "embed", "rid": rid, "input_ids": [3, 1, 4, 1, 5]}
    h.update(over)
    return h


async def quiet(c: Client) -> None:
    """Every result was routed to its request: nothing extra arrived (a ping flushes the pipe)."""
    pong = await c.ping(timeout=10)
    assert pong["type"] == "pong"
    await asyncio.sleep(0.1)
    assert c.unrouted == [], [(r.rid, r.status, r.message) for r in c.unrouted]


async def wait_gone(name: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(shm_file(name)):
        assert time.monotonic() < deadline, f"segment {name} still there after {timeout}s"
        await asyncio.sleep(0.01)


class Raw:
    """A bare DEALER for bytes the client library would never send."""

    def __init__(self, addr: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def send(self, header, *payloads) -> None:
        body = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
        self.sock.send_multipart([body, *payloads])

    def recv(self, timeout: float = 15.0) -> dict:
        assert self.sock.poll(int(timeout * 1000)), f"no reply within {timeout}s"
        frames = self.sock.recv_multipart()
        assert len(frames) == 1
        return msgpack.unpackb(frames[0], raw=False)

    def extras(self, wait: float = 0.1) -> list[dict]:
        """Ping, collect everything that comes before the pong and shortly after it."""
        self.send({"v": 1, "type": "ping"})
        got = []
        for _ in range(1000):
            h = self.recv()
            if h.get("type") == "pong":
                break
            got.append(h)
        while self.sock.poll(int(wait * 1000)) and len(got) < 1000:
            got.append(msgpack.unpackb(self.sock.recv_multipart()[0], raw=False))
        return got

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def rawsock(shared_server):
    r = Raw(shared_server.addr)
    yield r
    try:
        assert r.extras(wait=0.02) == []  # replies to bad requests are sent before the pong
    finally:
        r.close()


@pytest.fixture(scope="module")
def stall_server(tmp_path_factory):
    """A tp=1 server whose rank sleeps 2 s inside the engine step of every ``hold-*`` request."""
    with Server("--fault", "0:stall:hold-*", "--stall-s", "2", tmp_dir=str(tmp_path_factory.mktemp("stall"))) as srv:
        yield srv


# ---------------------------------------------------------------- 200

async def test_embed_200_digests_match_client_side(shared_server):
    image = torch.randn(6, 4).t()  # not contiguous: its row-major bytes are what travels
    audio = torch.randn(3, 5).to(torch.bfloat16)
    mask = torch.rand(7) > 0.5
    image_item, image_seg = seg_item(image)
    mask_item, mask_seg = seg_item(mask, modality="other")
    async with Client(shared_server.addr) as c:
        fut = c.send_request("embed", [1, 2, 3], [raw(image_item), inline(audio, "audio"), raw(mask_item)],
                             rid="digest-1", want_digest=True)
        image_seg.sent()
        mask_seg.sent()
        r = await c.wait("digest-1", fut)
        assert r.status == 200, r.message
        assert r.err_type is None and r.rid is not None
        assert r.meta["digests"] == [sha256_of(image), sha256_of(audio), sha256_of(mask)]
        emb = r.embedding
        assert r.output["dim"] == emb.numel() > 0
        assert torch.isfinite(emb).all()
        await quiet(c)
    assert not os.path.exists(shm_file(image_seg.name)) and not os.path.exists(shm_file(mask_seg.name))


async def test_no_digest_unless_asked(shared_server):
    async with Client(shared_server.addr) as c:
        r = await c.embed([1, 2], [shm(torch.ones(3))])
        assert r.status == 200 and "digests" not in r.meta
        await quiet(c)


async def test_embed_is_deterministic_and_depends_on_the_features(shared_server):
    feat = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    async with Client(shared_server.addr) as c:
        a = await c.embed([7, 8, 9], [shm(feat)])
        b = await c.embed([7, 8, 9], [shm(feat.clone())])
        via_inline = await c.embed([7, 8, 9], [inline(feat)])
        other_feat = await c.embed([7, 8, 9], [shm(feat + 1)])
        other_ids = await c.embed([7, 8, 10], [shm(feat)])
        await quiet(c)
    for r in (a, b, via_inline, other_feat, other_ids):
        assert r.status == 200, r.message
    assert a.output["embedding"] == b.output["embedding"]
    assert a.output["embedding"] == via_inline.output["embedding"]  # the transport does not matter
    assert a.output["embedding"] != other_feat.output["embedding"]
    assert a.output["embedding"] != other_ids.output["embedding"]


async def test_generate_200(shared_server):
    async with Client(shared_server.addr) as c:
        r8 = await c.generate(np.arange(10), [shm(torch.ones(2, 2))])
        r3 = await c.generate(np.arange(10), [shm(torch.ones(2, 2))], max_new_tokens=3)
        again = await c.generate(np.arange(10), [shm(torch.ones(2, 2))])
        plain = await c.generate([5])
        await quiet(c)
    for r in (r8, r3, again, plain):
        assert r.status == 200, r.message
    ids = r8.output["output_ids"]
    assert len(ids) == 8 and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    assert len(r3.output["output_ids"]) == 3
    assert again.output["output_ids"] == ids
    assert len(plain.output["output_ids"]) == 8


async def test_many_requests_each_get_one_result(shared_server):
    async with Client(shared_server.addr) as c:
        futs = {}
        for i in range(40):
            rid = f"many-{i}"
            futs[rid] = c.send_request("embed", [i + 1], [shm(torch.full((4,), float(i)))], rid=rid)
        results = {rid: await c.wait(rid, f, 30) for rid, f in futs.items()}
        await quiet(c)
    assert all(r.status == 200 and r.rid == rid for rid, r in results.items())
    assert len({r.output["embedding"] for r in results.values()}) == 40


# ---------------------------------------------------------------- 400

def _drop(key):
    def f(h):
        del h[key]
        return h
    return f


BAD = [
    ("v", lambda h: dict(h, v=2)),
    ("v", _drop("v")),
    ("type", lambda h: dict(h, type="classify")),
    ("type", lambda h: dict(h, type=["embed"])),
    ("rid", lambda h: dict(h, rid="")),
    ("rid", lambda h: dict(h, rid="x" * 129)),
    ("rid", lambda h: dict(h, rid=12)),
    ("input_ids", _drop("input_ids")),
    ("input_ids", lambda h: dict(h, input_ids=[])),
    ("input_ids", lambda h: dict(h, input_ids=[1, -2])),
    ("input_ids", lambda h: dict(h, input_ids=[2**31])),
    ("input_ids", lambda h: dict(h, input_ids=[1, [2]])),
    ("input_ids", lambda h: dict(h, input_ids=b"\x01\x00\x00")),
    ("mm_items", lambda h: dict(h, mm_items={"transport": "shm"})),
    ("mm_items[0]", lambda h: dict(h, mm_items=["shm"])),
    ("mm_items[0].transport", lambda h: dict(h, mm_items=[{"transport": "carrier-pigeon"}])),
    ("mm_items[0].modality", lambda h: dict(h, mm_items=[{"transport": "inline", "modality": "smell"}])),
    ("mm_items[0].dtype", lambda h: dict(h, mm_items=[{"transport": "inline", "modality": "image",
                                                       "dtype": "complex64", "shape": [1], "frame": 1}])),
    ("mm_items[0].shape", lambda h: dict(h, mm_items=[{"transport": "inline", "modality": "image",
                                                       "dtype": "uint8", "shape": [1] * 9, "frame": 1}])),
    ("mm_items[0].shape", lambda h: dict(h, mm_items=[{"transport": "inline", "modality": "image",
                                                       "dtype": "uint8", "shape": [True], "frame": 1}])),
    ("mm_items[0].shm_name", lambda h: dict(h, mm_items=[{"transport": "shm", "modality": "image",
                                                          "dtype": "uint8", "shape": [1],
                                                          "shm_name": "mmsched_a/../b"}])),
    ("mm_items[0].offset", lambda h: dict(h, mm_items=[{"transport": "shm", "modality": "image",
                                                        "dtype": "uint8", "shape": [1], "offset": -1,
                                                        "shm_name": f"{PREFIX}absent_{uuid.uuid4().hex}"}])),
    ("mm_items[0].frame", lambda h: dict(h, mm_items=[{"transport": "inline", "modality": "image",
                                                       "dtype": "uint8", "shape": [1], "frame": 5}])),
    ("mm_items[0].frame", lambda h: dict(h, mm_items=[{"transport": "inline", "modality": "image",
                                                       "dtype": "uint8", "shape": [3], "frame": 1}])),
    ("mm_items[0].ref", lambda h: dict(h, mm_items=[{"transport": "session", "modality": "image"}])),
    ("params.max_new_tokens", lambda h: dict(h, type="generate", params={"max_new_tokens": 0})),
    ("params.max_new_tokens", lambda h: dict(h, type="generate", params={"max_new_tokens": "4"})),
    ("want_digest", lambda h: dict(h, want_digest="yes")),
]


@pytest.mark.parametrize("field,mutate", BAD, ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD)])
def test_400_names_the_field(rawsock, field, mutate):
    rid = f"bad-{uuid.uuid4().hex[:8]}"
    header = mutate(request(rid))
    rawsock.send(header, b"\x07")  # one payload frame of 1 byte
    r = rawsock.recv()
    assert r["type"] == "result" and r["v"] == 1
    assert r["status"] == 400 and r["err_type"] == "BadRequestError"
    assert r["message"].startswith(field + ":"), r["message"]
    readable = isinstance(header.get("rid"), str) and 1 <= len(header["rid"]) <= 128
    assert r["rid"] == (rid if readable else None)
    assert r["output"] is None


@pytest.mark.parametrize("frame", [b"\xc1\xc1", b"not msgpack at all", msgpack.packb([1, "embed"]),
                                   msgpack.packb("embed"), msgpack.packb(None), msgpack.packb({1: "v"}),
                                   msgpack.packb({"v": 1, "type": "embed", "rid": "t"})[:-3]],
                         ids=["bad-bytes", "text", "array", "str", "nil", "int-key", "truncated"])
def test_unreadable_header_gets_400_with_nil_rid(rawsock, frame):
    rawsock.send(frame)
    r = rawsock.recv()
    assert r["status"] == 400 and r["err_type"] == "BadRequestError"
    assert r["rid"] is None
    assert r["message"].startswith("header:")


async def test_400s_through_the_client_do_not_disturb_good_requests(shared_server):
    async with Client(shared_server.addr) as c:
        good = c.send_request("embed", [1, 2], [shm(torch.ones(5))], rid="good-1")
        c.send_raw(None, packed=b"\xc1")
        bad = c.send_raw(request("bad-1", v=2), rid="bad-1")
        unknown = c.send_raw(request("bad-2", type="explode"), rid="bad-2")
        good2 = c.send_request("generate", [3], rid="good-2")
        assert (await c.wait("bad-1", bad)).status == 400
        assert (await c.wait("bad-2", unknown)).message.startswith("type:")
        assert (await c.wait("good-1", good)).status == 200
        assert (await c.wait("good-2", good2)).status == 200
        pong = await c.ping(timeout=10)
        assert pong["healthy"] is True and pong["ranks"] == 1
        await asyncio.sleep(0.2)
        assert [(r.rid, r.status) for r in c.unrouted] == [(None, 400)]  # the unreadable one, exactly once


# ---------------------------------------------------------------- ownership of segments

def test_400_unlinks_owned_segment_but_not_pooled_one(rawsock):
    owned_item, owned = seg_item(torch.ones(4))
    pooled_item, pooled = seg_item(torch.ones(4), pooled=True)
    try:
        rawsock.send(request("own-1", input_ids="oops", mm_items=[owned_item, pooled_item]))
        owned.sent()
        pooled.sent()
        r = rawsock.recv()
        assert r["status"] == 400 and r["rid"] == "own-1" and r["message"].startswith("input_ids:")
        assert not os.path.exists(shm_file(owned.name)), "a 400'd request's segment must be unlinked"
        assert os.path.exists(shm_file(pooled.name)), "a pooled segment belongs to the client"
    finally:
        pooled.discard()
        owned.discard()


def test_unreadable_rest_still_unlinks_owned_segment(rawsock):
    """Even v=2 with no rid: ownership passed when it was sent."""
    item, seg = seg_item(torch.ones(2))
    rawsock.send({"v": 2, "mm_items": [item]})
    seg.sent()
    r = rawsock.recv()
    assert r["status"] == 400 and r["rid"] is None
    assert not os.path.exists(shm_file(seg.name))


async def test_pooled_segment_survives_200_and_can_be_reused(shared_server):
    t = torch.arange(12, dtype=torch.float32)
    item, seg = seg_item(t, pooled=True)
    seg.sent()
    try:
        async with Client(shared_server.addr) as c:
            r1 = await c.embed([1], [raw(item)], want_digest=True)
            assert r1.status == 200 and r1.meta["digests"] == [sha256_of(t)]
            assert os.path.exists(shm_file(seg.name))
            with open(shm_file(seg.name), "r+b") as fh:  # the client reuses the slice at once
                fh.write(bytes(tensor_bytes(t * 2)))
            r2 = await c.embed([1], [raw(item)], want_digest=True)
            assert r2.status == 200 and r2.meta["digests"] == [sha256_of(t * 2)]
            assert r1.output["embedding"] != r2.output["embedding"]
            await quiet(c)
        assert os.path.exists(shm_file(seg.name))
    finally:
        seg.discard()


def test_unprefixed_segment_never_opened_nor_unlinked(rawsock):
    name = f"othertest_{uuid.uuid4().hex}"
    path = shm_file(name)
    with open(path, "wb") as fh:
        fh.write(bytes(16))
    try:
        item = {"modality": "image", "transport": "shm", "dtype": "float32", "shape": [4]}
        for i, shm_name in enumerate([name, f"{PREFIX}/../{name}", f"/{name}", f"../{name}"]):
            rawsock.send(request(f"other-{i}", mm_items=[dict(item, shm_name=shm_name)]))
            r = rawsock.recv()
            assert r["status"] == 400 and r["rid"] == f"other-{i}"
            assert r["message"].startswith("mm_items[0].shm_name:"), r["message"]
        # a malformed request naming it does not make it fair game either
        rawsock.send({"v": 1, "type": "embed", "mm_items": [dict(item, shm_name=name)]})
        assert rawsock.recv()["status"] == 400
        assert os.path.exists(path)
        with open(path, "rb") as fh:
            assert fh.read() == bytes(16)
    finally:
        os.unlink(path)


# ---------------------------------------------------------------- 500

async def test_500_missing_segment(shared_server):
    name = f"{PREFIX}absent_{uuid.uuid4().hex}"
    async with Client(shared_server.addr) as c:
        r = await c.embed([1, 2], [raw({"modality": "image", "transport": "shm", "dtype": "float32",
                                        "shape": [4], "shm_name": name})])
        await quiet(c)
    assert r.status == 500 and r.err_type == "InternalServerError"
    assert r.message.startswith(FAILED_PREFIX + "FileNotFoundError: "), r.message
    assert r.meta["failed_ranks"] == [0]
    assert r.output is None
    assert not os.path.exists(shm_file(name))


async def test_500_segment_too_small_fails_only_its_request(shared_server):
    small_item, small = seg_item(torch.ones(4))  # 16 bytes
    small_item["shape"] = [8]                    # says 32
    offset_item, off = seg_item(torch.ones(4))
    offset_item["offset"] = 8                    # 8 + 16 > 16
    async with Client(shared_server.addr) as c:
        before = c.send_request("embed", [1], [shm(torch.ones(3))], rid="ok-before")
        f_small = c.send_request("embed", [1], [raw(small_item)], rid="small")
        small.sent()
        f_off = c.send_request("embed", [1], [shm(torch.ones(2)), raw(offset_item)], rid="offset")
        off.sent()
        after = c.send_request("generate", [1], [shm(torch.ones(3))], rid="ok-after")
        rs = {rid: await c.wait(rid, f) for rid, f in
              [("ok-before", before), ("small", f_small), ("offset", f_off), ("ok-after", after)]}
        await quiet(c)
    for rid in ("small", "offset"):
        r = rs[rid]
        assert r.status == 500 and r.err_type == "InternalServerError", r.message
        assert r.message.startswith(FAILED_PREFIX + "SegmentTooSmall: "), r.message
        assert r.meta["failed_ranks"] == [0]
    assert rs["ok-before"].status == 200 and rs["ok-after"].status == 200
    assert not os.path.exists(shm_file(small.name)) and not os.path.exists(shm_file(off.name))


# ---------------------------------------------------------------- 499

async def test_abort_queued_request(stall_server):
    hold_item, hold_seg = seg_item(torch.ones(8))
    q_item, q_seg = seg_item(torch.ones(8))
    order = []
    async with Client(stall_server.addr) as c:
        hold = c.send_request("embed", [1], [raw(hold_item)], rid="hold-1")
        hold_seg.sent()
        hold.add_done_callback(lambda _: order.append("hold-1"))
        await wait_gone(hold_seg.name)  # materialized and released: hold-1 now sits in the engine step
        q = c.send_request("embed", [2], [raw(q_item)], rid="q-1")
        q_seg.sent()
        q.add_done_callback(lambda _: order.append("q-1"))
        await c.abort("q-1")
        rq = await c.wait("q-1", q)
        rh = await c.wait("hold-1", hold)
        await quiet(c)
    assert rq.status == 499 and rq.err_type == "RequestAborted" and rq.rid == "q-1"
    assert rh.status == 200
    assert order == ["q-1", "hold-1"], "the queued request was answered while hold-1 still ran"
    assert not os.path.exists(shm_file(q_seg.name))


async def test_abort_request_stalled_in_engine_step(stall_server):
    item, seg = seg_item(torch.ones(8))
    async with Client(stall_server.addr) as c:
        hold = c.send_request("embed", [1], [raw(item)], rid="hold-2")
        seg.sent()
        await wait_gone(seg.name)
        await c.abort("hold-2")
        r = await c.wait("hold-2", hold)
        await c.abort("hold-2")  # finished: aborting again does nothing
        await quiet(c)
    assert r.status == 499, f"{r.status} {r.message}"
    assert r.err_type == "RequestAborted"


async def test_abort_unknown_rid_does_nothing(shared_server):
    async with Client(shared_server.addr) as c:
        await c.abort("never-sent")
        await c.abort("x" * 300)  # not even a valid rid: a 400 with rid nil at most
        r = await c.embed([1], [shm(torch.ones(2))])
        assert r.status == 200
        await c.ping(timeout=10)
        await asyncio.sleep(0.2)
        assert [(u.rid, u.status) for u in c.unrouted] == [(None, 400)]


# ---------------------------------------------------------------- rids are per client

async def test_same_rid_from_two_clients(shared_server):
    fa, fb = torch.randn(16), torch.randn(16)
    async with Client(shared_server.addr) as solo:
        ea = (await solo.embed([1, 2, 3], [shm(fa)])).output["embedding"]
        eb = (await solo.embed([4, 5, 6], [shm(fb)])).output["embedding"]
        await quiet(solo)
    assert ea != eb
    async with Client(shared_server.addr) as a, Client(shared_server.addr) as b:
        for round_ in range(3):
            rid = f"shared-rid-{round_}"
            fut_a = a.send_request("embed", [1, 2, 3], [shm(fa)], rid=rid)
            fut_b = b.send_request("embed", [4, 5, 6], [shm(fb)], rid=rid)
            ra, rb = await asyncio.gather(a.wait(rid, fut_a), b.wait(rid, fut_b))
            assert ra.status == rb.status == 200
            assert ra.output["embedding"] == ea
            assert rb.output["embedding"] == eb
        await quiet(a)
        await quiet(b)


def test_duplicate_rid_in_flight_from_one_client(stall_server):
    r = Raw(stall_server.addr)
    first_item, first = seg_item(torch.ones(8))
    dup_item, dup = seg_item(torch.zeros(8))
    try:
        r.send(request("hold-dup", mm_items=[first_item]))
        first.sent()
        deadline = time.monotonic() + 15
        while os.path.exists(shm_file(first.name)):  # in flight, inside the engine step
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r.send(request("hold-dup", input_ids=[9, 9], mm_items=[dup_item]))
        dup.sent()
        one, two = r.recv(), r.recv()
        assert one["rid"] == two["rid"] == "hold-dup"
        assert (one["status"], two["status"]) == (400, 200), "the duplicate is refused, the original served"
        assert one["message"].startswith("rid:")
        assert not os.path.exists(shm_file(dup.name)), "the refused duplicate's segment is still owned by us"
        assert r.extras() == []
    finally:
        r.close()
