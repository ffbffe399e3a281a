"""What one client can make the leader hold, and what the leader owes every sender
(issue 16, items 1, 6, 7, 8 and 10): descriptors and items per queue, aborts that end
with their request, a routing id taken over by a new connection, messages still unread
at the socket when the leader stops, and what a batch really costs (memory per feature,
session refs on the loop).

Every test runs against a real server; figures (descriptors in /proc/PID/fd, peak RSS,
ping latency) are read from the leader process.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time

import msgpack
import pytest
import torch
import zmq

from mmsched.client import Client, raw, shm
from mmsched.transport.shm import create_segment

from ..conftest import Server, shm_segments, sync_ping
from .lifecycle import expect, feature, my_segments, sha256_of, wait_until


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def vm_hwm(pid: int) -> int:
    """Peak resident memory of a process, in bytes."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def dealer(addr: str, routing_id: bytes | None = None, reconnect: bool = True) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    if not reconnect:
        s.setsockopt(zmq.RECONNECT_IVL, -1)
    s.connect(addr)
    return s


def shm_item(seg, nbytes: int) -> dict:
    return {"modality": "image", "transport": "shm", "dtype": "uint8", "shape": [nbytes], "shm_name": seg.name}


def request(rid: str, items: list[dict], **kw) -> bytes:
    return msgpack.packb({"v": 1, "type": "embed", "rid": rid, "input_ids": [1, 2, 3], "mm_items": items,
                          "want_digest": True, **kw})


def replies(s: zmq.Socket, n: int, timeout: float) -> list[dict]:
    """Up to ``n`` replies within ``timeout`` seconds."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and (left := deadline - time.monotonic()) > 0:
        if s.poll(int(left * 1000)):
            got.append(msgpack.unpackb(s.recv(), raw=False))
    return got


def gone(name: str) -> bool:
    return not os.path.exists(os.path.join("/dev/shm", name))


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    with Server(tmp_dir=str(tmp_path_factory.mktemp("solo"))) as srv:
        yield srv


# ---------------------------------------------------------------- 7. a routing id already in use

def test_a_new_connection_with_a_routing_id_in_use_takes_it_over(solo):
    """A client that reconnects under its routing id while its old connection is still open
    (a restarted process, a half-dead link) is served on the new connection: a pong, a 200
    with its own bytes, its segment unlinked. On main the new connection was ignored."""
    old = dealer(solo.addr, b"client-7", reconnect=False)
    new = None
    try:
        old.send(msgpack.packb({"v": 1, "type": "ping"}))
        assert replies(old, 1, 10)[0]["type"] == "pong"
        new = dealer(solo.addr, b"client-7")
        data = bytes(range(256)) * 16
        seg = create_segment(data)
        seg.sent()
        new.send(msgpack.packb({"v": 1, "type": "ping"}))
        new.send(request("r7", [shm_item(seg, len(data))]))
        got = replies(new, 2, 10)
        assert [g["type"] for g in got] == ["pong", "result"], f"the new connection got {got}"
        res = got[1]
        assert (res["rid"], res["status"]) == ("r7", 200), res
        assert res["meta"]["digests"] == [hashlib.sha256(data).hexdigest()]
        assert gone(seg.name)
    finally:
        old.close(linger=0)
        if new is not None:
            new.close(linger=0)
    assert sync_ping(solo.addr, 5)["healthy"] is True
