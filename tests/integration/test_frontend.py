"""The leader's ROUTER socket with real ZeroMQ clients, in-process (no ranks): results go out
through the sync socket, and a send can use up the edge of the FD the receiver waits on:
a request that arrives while the leader sends must still be read, and a client that reads
nothing must not block the loop."""

from __future__ import annotations

import asyncio
import time

import msgpack
import zmq

from mmsched.config import Config
from mmsched.rank.frontend import Frontend
from tests.integration.lifecycle import until


def client(fe: Frontend, opened: list, rcvhwm: int = 1000) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, rcvhwm)
    s.connect(fe.address)
    opened.append(s)
    return s


def run(tmp_path, body, **cfg) -> None:
    """``body(frontend, opened, received)`` with the frontend receiving beside it."""
    fe = Frontend(Config(frontend=f"ipc://{tmp_path}/fe.sock", **cfg))
    opened, received = [], []

    async def main():
        task = asyncio.ensure_future(fe.recv_from_clients(lambda f: received.append([x.bytes for x in f]),
                                                          lambda: None))
        try:
            await body(fe, opened, received)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        for s in opened:
            s.close(linger=0)
        fe.close()


def test_a_request_that_arrives_during_a_burst_of_sends_is_read(tmp_path):
    async def body(fe, opened, received):
        busy, late = client(fe, opened), client(fe, opened)
        busy.send(b"hello")
        await until(lambda: len(received) == 1, "the request read", timeout=3.0, every=0.005)
        who = received[0][0]
        for rnd in range(10):
            late.send(msgpack.packb({"rid": f"late{rnd}"}))
            time.sleep(0.02)  # no yield: it arrives, and its signal waits on the FD, while we send
            for i in range(100):
                fe.send_to_clients(who, {"type": "result", "rid": f"{rnd}.{i}"})
            await until(lambda: len(received) == 2 + rnd,
                        f"round {rnd}: the request sent during the burst to be read", timeout=2.0, every=0.005)
        assert [msgpack.unpackb(m[1])["rid"] for m in received[1:]] == [f"late{r}" for r in range(10)]
        rids = []
        while busy.poll(1000):
            rids.append(msgpack.unpackb(busy.recv())["rid"])
            if len(rids) == 1000:
                break
        assert rids == [f"{r}.{i}" for r in range(10) for i in range(100)]  # every reply, in order

    run(tmp_path, body)


def test_a_client_that_reads_nothing_does_not_block_the_loop(tmp_path):
    """Sends never wait: past the high-water mark ZeroMQ's ROUTER drops what a full client
    would get (as before; it raises nothing, so there is no ``send_failed`` either), the
    client reads the replies that found room, in order, and the others are answered meanwhile."""
    async def body(fe, opened, received):
        stuck, other = client(fe, opened, rcvhwm=1), client(fe, opened)
        stuck.send(b"stuck")
        other.send(b"other")
        await until(lambda: len(received) == 2, "both requests read", timeout=3.0, every=0.005)
        who = {payload: identity for identity, payload in received}  # they may arrive in either order
        big = "x" * (256 << 10)  # a few of these fill the socket buffers behind a high-water mark of 1
        t0 = time.monotonic()
        for i in range(64):
            fe.send_to_clients(who[b"stuck"], {"type": "result", "rid": f"big{i}", "message": big})
        elapsed = time.monotonic() - t0
        assert elapsed < 2.0, f"sending to a full client blocked the loop for {elapsed:.1f}s"
        fe.send_to_clients(who[b"other"], {"type": "result", "rid": "other"})
        assert other.poll(2000) and msgpack.unpackb(other.recv())["rid"] == "other"
        got = []
        while stuck.poll(500):
            got.append(msgpack.unpackb(stuck.recv())["rid"])
        order = [int(rid[3:]) for rid in got]
        assert order == sorted(set(order)) and order[0] == 0 and len(order) < 64, got

    run(tmp_path, body, zmq_hwm=1)
