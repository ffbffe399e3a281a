"""Every limit, against one real server started with small limits set by flags.

Per-request limits (max_input_len, max_items, max_item_bytes, max_request_bytes,
max_new_tokens, max_message_bytes): just over is a 400 whose message names the setting,
just under is served. In-flight limits (max_queue, max_inflight_bytes): a request over
them is a 503, and its segments are unlinked all the same. ZeroMQ's own backstop
(MAXMSGSIZE = max_message_bytes, per frame): a single frame over it makes ZeroMQ drop the
sender's connection; the server stays up and serves everyone else.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import urllib.request

import msgpack
import numpy as np
import pytest
import zmq

from mmsched.client import Client, raw
from mmsched.producers import Segment, create_segment

from ..conftest import free_port, Server, sync_ping

MAX_INPUT_LEN = 16
MAX_ITEMS = 2
MAX_ITEM_BYTES = 1024
MAX_REQUEST_BYTES = 1536
MAX_NEW_TOKENS = 8
MAX_MESSAGE_BYTES = 4096
MAX_QUEUE = 2
MAX_INFLIGHT_BYTES = 2560
STALL_S = 3  # how long a ``hold-*`` request keeps rank 0 inside its engine step
ZMQ_HWM = 100


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    port = free_port()
    with Server(
        "--max-input-len", str(MAX_INPUT_LEN), "--max-items", str(MAX_ITEMS),
        "--max-item-bytes", str(MAX_ITEM_BYTES), "--max-request-bytes", str(MAX_REQUEST_BYTES),
        "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-message-bytes", str(MAX_MESSAGE_BYTES),
        "--max-queue", str(MAX_QUEUE), "--max-inflight-bytes", str(MAX_INFLIGHT_BYTES),
        "--max-batch", "1", "--fault", "0:stall:hold-*", "--stall-s", str(STALL_S), "--zmq-hwm", str(ZMQ_HWM),
        "--admin", str(port),
        tmp_dir=str(tmp_path_factory.mktemp("limits"))) as srv:
        srv.admin = f"http://127.0.0.1:{port}"
        yield srv


# ---------------------------------------------------------------- helpers

def segment(nbytes: int, fill: int = 7) -> tuple[dict, Segment]:
    """A real segment of ``nbytes`` and the shm item naming it (uint8, shape [nbytes])."""
    seg = create_segment(bytes([fill]) * nbytes)
    item = {"modality": "image", "transport": "shm", "dtype": "uint8", "shape": [nbytes],
            "shm_name": seg.name}
    return item, seg


def exists(seg: Segment) -> bool:
    return os.path.exists(os.path.join("/dev/shm", seg.name))


def inline_item(nbytes: int) -> tuple[dict, bytes]:
    return {"modality": "audio", "transport": "inline", "dtype": "uint8", "shape": [nbytes], "frame": -1}, \
        bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)


async def send(c: Client, items: list[tuple[dict, Segment]], ids=(1, 2, 3), **kw):
    """Send a request naming these segments; ownership passes (the client closes its locks)."""
    fut = c.send_request("embed", list(ids), [raw(it) for it, _ in items], rid=kw.pop("rid", c.new_rid()), **kw)
    for _, seg in items:
        seg.sent()
    return fut


def metric(srv: Server, name: str) -> float:
    with urllib.request.urlopen(f"{srv.admin}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def assert_bad(r, setting: str, rid: str) -> None:
    assert (r.status, r.err_type) == (400, "BadRequestError"), (r.status, r.message)
    assert r.rid == rid
    assert setting in r.message, f"400 does not name {setting}: {r.message!r}"


# ---------------------------------------------------------------- per-request limits

async def test_max_input_len(limited):
    async with Client(limited.addr) as c:
        ok = await c.embed(np.arange(MAX_INPUT_LEN), rid="len-ok")
        over = await c.embed(np.arange(MAX_INPUT_LEN + 1), rid="len-over")
        # the array form is held to the same limit as the bin form the client sends
        fut = c.send_raw({"v": 1, "type": "embed", "rid": "len-over-list",
                          "input_ids": list(range(MAX_INPUT_LEN + 1))}, rid="len-over-list")
        over_list = await c.wait("len-over-list", fut, 10)
    assert ok.status == 200, ok.message
    assert_bad(over, "max_input_len", "len-over")
    assert_bad(over_list, "max_input_len", "len-over-list")


async def test_max_items_and_the_segments_of_a_rejected_request_are_unlinked(limited):
    under = [segment(8) for _ in range(MAX_ITEMS)]
    over = [segment(8) for _ in range(MAX_ITEMS + 1)]
    async with Client(limited.addr) as c:
        r_ok = await c.wait("items-ok", await send(c, under, rid="items-ok"), 10)
        r_over = await c.wait("items-over", await send(c, over, rid="items-over"), 10)
    assert r_ok.status == 200, r_ok.message
    assert_bad(r_over, "max_items", "items-over")
    assert not any(exists(s) for _, s in under + over), "a segment outlived its request's result"


async def test_max_item_bytes(limited):
    just = segment(MAX_ITEM_BYTES)
    over = segment(MAX_ITEM_BYTES + 1)
    async with Client(limited.addr) as c:
        r_ok = await c.wait("item-ok", await send(c, [just], rid="item-ok"), 10)
        r_over = await c.wait("item-over", await send(c, [over], rid="item-over"), 10)
        # the same bound holds for inline payloads
        it, payload = inline_item(MAX_ITEM_BYTES + 1)
        r_inline = await c.request("embed", [1], [raw(it, payload)], rid="item-over-inline", timeout=10)
    assert r_ok.status == 200, r_ok.message
    assert_bad(r_over, "max_item_bytes", "item-over")
    assert_bad(r_inline, "max_item_bytes", "item-over-inline")
    assert not exists(just[1]) and not exists(over[1])


async def test_max_request_bytes(limited):
    under = [segment(MAX_ITEM_BYTES), segment(MAX_REQUEST_BYTES - MAX_ITEM_BYTES)]
    over = [segment(MAX_ITEM_BYTES), segment(MAX_REQUEST_BYTES - MAX_ITEM_BYTES + 1)]
    async with Client(limited.addr) as c:
        r_ok = await c.wait("req-ok", await send(c, under, rid="req-ok"), 10)
        r_over = await c.wait("req-over", await send(c, over, rid="req-over"), 10)
    assert r_ok.status == 200, r_ok.message
    assert_bad(r_over, "max_request_bytes", "req-over")
    assert not any(exists(s) for _, s in under + over)


async def test_max_new_tokens(limited):
    async with Client(limited.addr) as c:
        ok = await c.generate([1, 2, 3], max_new_tokens=MAX_NEW_TOKENS, rid="mnt-ok")
        over = await c.generate([1, 2, 3], max_new_tokens=MAX_NEW_TOKENS + 1, rid="mnt-over")
    assert ok.status == 200 and len(ok.output["output_ids"]) == MAX_NEW_TOKENS, ok
    assert_bad(over, "max_new_tokens", "mnt-over")


def _padded(total: int) -> list[bytes]:
    """A valid embed whose frames add up to exactly ``total`` bytes: header, one inline
    item of 1000 bytes, and an unreferenced padding frame."""
    header = {"v": 1, "type": "embed", "rid": f"msg-{total}", "input_ids": [1, 2],
              "mm_items": [{"modality": "image", "transport": "inline", "dtype": "uint8",
                            "shape": [1000], "frame": 1}]}
    head = msgpack.packb(header)
    pad = total - len(head) - 1000
    assert 0 < pad < MAX_MESSAGE_BYTES
    return [head, bytes(1000), bytes(pad)]


async def test_max_message_bytes_counts_every_frame(limited):
    """Frames each under the per-frame backstop, together just over: a 400 naming the limit."""
    async with Client(limited.addr) as c:
        for total, status in ((MAX_MESSAGE_BYTES, 200), (MAX_MESSAGE_BYTES + 1, 400)):
            frames = _padded(total)
            assert sum(map(len, frames)) == total and max(map(len, frames)) < MAX_MESSAGE_BYTES
            fut = c.send_raw(None, frames[1:], rid=f"msg-{total}", packed=frames[0])
            r = await c.wait(f"msg-{total}", fut, 10)
            assert r.status == status, (total, r.status, r.message)
            if status == 400:
                assert_bad(r, "max_message_bytes", f"msg-{total}")


async def test_single_frame_over_max_message_bytes_drops_only_that_connection(limited):
    """ZeroMQ's MAXMSGSIZE refuses a frame over max_message_bytes before mmsched reads it:
    ZeroMQ closes that connection. The sender gets no result for the message (mmsched never
    saw it) and its DEALER silently reconnects under a new identity, so replies to anything
    else it had in flight are lost too. Everyone else is served; the server stays up."""
    async with Client(limited.addr) as bystander, Client(limited.addr) as sender:
        before = await bystander.embed([1, 2], rid="bystander-before", timeout=10)
        assert before.status == 200
        assert (await sender.ping(timeout=10))["healthy"] is True
        it = {"modality": "image", "transport": "inline", "dtype": "uint8", "shape": [MAX_MESSAGE_BYTES + 1],
              "frame": -1}
        fut = sender.send_request("embed", [1], [raw(it, bytes(MAX_MESSAGE_BYTES + 1))], rid="oversize")
        with pytest.raises(asyncio.TimeoutError):
            await sender.wait("oversize", fut, 2.0)
        after = await bystander.embed([3, 4], rid="bystander-after", timeout=10)
        assert after.status == 200, after.message
        # the sender itself is served again once its DEALER has reconnected
        again = await sender.embed([5, 6], rid="sender-again", timeout=10)
        assert again.status == 200, again.message
    assert limited.proc.poll() is None
    assert sync_ping(limited.addr, 5.0)["healthy"] is True
    assert "oversize" not in limited.logs()  # nothing of the message reached mmsched


# ---------------------------------------------------------------- in-flight limits

async def test_in_flight_limits_answer_503_and_still_unlink(limited):
    """Rank 0 holds ``hold-1`` for STALL_S seconds; requests behind it queue at the leader.
    Over max_inflight_bytes or max_queue: 503 at once, and the segments are unlinked."""
    async with Client(limited.addr) as c:
        hold_items = [segment(MAX_ITEM_BYTES)]
        hold = await send(c, hold_items, rid="hold-1")
        deadline = time.monotonic() + 10
        while metric(limited, "mmsched_requests_running") != 1:  # hold-1 is on the lane now
            assert time.monotonic() < deadline, "hold-1 never started running"
            await asyncio.sleep(0.02)
        queued = [segment(MAX_ITEM_BYTES)]  # in flight: 2 x 1024 = 2048 bytes
        f_queued = await send(c, queued, rid="queued-1")
        too_big = [segment(MAX_ITEM_BYTES)]  # 2048 + 1024 > 2560
        f_big = await send(c, too_big, rid="over-bytes")
        r_big = await c.wait("over-bytes", f_big, 10)
        fits = [segment(MAX_INFLIGHT_BYTES - 2 * MAX_ITEM_BYTES)]  # exactly 2560 in flight
        f_fits = await send(c, fits, rid="fits-bytes")
        # the queue now holds MAX_QUEUE requests; one more (0 feature bytes) is over max_queue
        over_q = [segment(0)]
        f_over_q = await send(c, over_q, rid="over-queue")
        r_over_q = await c.wait("over-queue", f_over_q, 10)
        # all of this happened while hold-1 was still running
        assert not hold.done(), f"hold-1 finished within {STALL_S}s before the queue was filled"
        assert metric(limited, "mmsched_requests_waiting") == MAX_QUEUE
        assert metric(limited, "mmsched_feature_bytes_inflight") == MAX_INFLIGHT_BYTES
        # the rejected requests' segments are gone the moment their 503 is out
        assert not exists(too_big[0][1]) and not exists(over_q[0][1])
        assert exists(queued[0][1]) and exists(fits[0][1])  # still waiting to be read
        rest = {rid: await c.wait(rid, f, 20) for rid, f in
                (("hold-1", hold), ("queued-1", f_queued), ("fits-bytes", f_fits))}
        await c.ping(timeout=10)
        assert c.unrouted == []
    assert (r_big.status, r_big.err_type) == (503, "ServiceUnavailable"), r_big
    assert "max_inflight_bytes" in r_big.message, r_big.message
    assert (r_over_q.status, r_over_q.err_type) == (503, "ServiceUnavailable"), r_over_q
    assert "max_queue" in r_over_q.message, r_over_q.message
    for rid, r in rest.items():
        assert r.status == 200, (rid, r.message)
    for _, s in hold_items + queued + fits:
        assert not exists(s)
    assert metric(limited, "mmsched_feature_bytes_inflight") == 0



def test_a_client_that_never_reads_cannot_make_the_server_buffer_its_replies(limited):
    """The frontend's send high-water mark is zmq_hwm: replies to a client that stops reading
    are dropped by ZeroMQ beyond it, instead of piling up in the server's memory."""
    n = 60000
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.RCVHWM, 10)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(limited.addr)
        for _ in range(n):
            s.send(b"\xc1")  # never valid MessagePack: a 400 each, answered at once
        pong = sync_ping(limited.addr, 10.0)  # another client is served meanwhile
        assert pong is not None and pong["healthy"] is True
        got = 0
        while s.poll(500):
            s.recv()
            got += 1
    finally:
        s.close(linger=0)
    # what arrives is the high-water marks' worth plus what the kernel's socket buffers held
    # (a few thousand small replies); without the mark it would be all n
    assert ZMQ_HWM <= got < n // 3, f"{got} of {n} replies were buffered for a client that did not read"
    assert limited.proc.poll() is None


# ---------------------------------------------------------------- params

def _vm_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(line.split()[1] for line in fh if line.startswith(key + ":")))


def _with_raw(header: dict, key: str, value: bytes) -> bytes:
    """``header`` with one more entry whose value is these encoded bytes (no packing cost here)."""
    packed = msgpack.packb(header)
    assert 0x80 <= packed[0] < 0x8f, "a fixmap header"
    return bytes([packed[0] + 1]) + packed[1:] + msgpack.packb(key) + value


N_HOSTILE = 4_000_000
HUGE_PARAMS = b"\x81" + msgpack.packb("x") + b"\xdd" + N_HOSTILE.to_bytes(4, "big") + b"\x80" * N_HOSTILE
HOSTILE = {  # name: (frame 0, the 400's rid, its message)
    # 4 MB of params holding 4 M empty maps: on main a 200 after the leader grew ~0.5 GiB and
    # another client's ping waited seconds (a tp=2 group with a 3 s collective deadline broke)
    "params": (_with_raw({"v": 1, "type": "embed", "rid": "huge", "input_ids": [1]}, "params", HUGE_PARAMS),
               "huge", f"params: {len(HUGE_PARAMS)} bytes exceed max_params_bytes=65536"),
    # 4 M nil items: the strict read refused them at once, but finding the segments a 400 hands
    # over walked every one (0.5 s a million; 64 M broke a tp=2 group, found by outside testing)
    "mm_items": (_with_raw({"v": 1, "type": "embed", "rid": "huge", "input_ids": [1]}, "mm_items",
                           b"\xdd" + N_HOSTILE.to_bytes(4, "big") + b"\xc0" * N_HOSTILE),
                 "huge", f"mm_items: {N_HOSTILE} items exceed max_items=64"),
    # a header of 4 M one-letter keys (12 MB): 30 s to walk in the strict read, 27 s in the lenient one
    "keys": (b"\xdf" + N_HOSTILE.to_bytes(4, "big") + b"\xa1a\x00" * N_HOSTILE,
             None, f"header: a map of {N_HOSTILE} keys (at most 64)"),
}


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def short_deadline(request, tmp_path_factory):
    """A group whose collectives give up after 3 s: a loop blocked that long breaks it."""
    with Server("--tp", str(request.param), "--collective-timeout", "3",
                tmp_dir=str(tmp_path_factory.mktemp("huge"))) as srv:
        yield srv, request.param


@pytest.mark.parametrize("shape", sorted(HOSTILE))
def test_a_huge_header_is_refused_in_proportion_and_the_loop_keeps_answering(short_deadline, shape):
    frame, rid, message = HOSTILE[shape]
    srv, tp = short_deadline
    pids = srv.rank_pids() if tp > 1 else [srv.proc.pid]
    ctx = zmq.Context.instance()
    big, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s in (big, other):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(srv.addr)
        assert sync_ping(srv.addr, 10) is not None
        hwm = [_vm_kib(p, "VmHWM") for p in pids]
        big.send(frame)
        time.sleep(0.05)  # the big message is at the leader first
        t0 = time.monotonic()
        other.send(msgpack.packb({"v": 1, "type": "ping"}))
        assert other.poll(60_000), "no pong"
        ping_wait = time.monotonic() - t0
        assert msgpack.unpackb(other.recv())["type"] == "pong"
        assert big.poll(60_000), "no reply to the big message"
        r = msgpack.unpackb(big.recv(), raw=False)
        grown = [(_vm_kib(p, "VmHWM") - h) >> 10 for p, h in zip(pids, hwm)]
        figures = f"status={r['status']} ping_wait={ping_wait:.2f}s peak_rss_growth_mib={grown}"
        assert (r["status"], r["rid"]) == (400, rid), figures
        assert r["message"] == message, figures
        assert ping_wait < 1.0 and max(grown) < 64, figures
        pong = sync_ping(srv.addr, 10)
        assert pong is not None and pong["healthy"], pong
    finally:
        big.close(linger=0)
        other.close(linger=0)
