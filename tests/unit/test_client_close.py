"""Client.close() wakes every caller still waiting for a reply: results, pongs and acks."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from mmsched.client import Client


async def test_close_settles_every_pending_future(tmp_path):
    addr = f"ipc://{tmp_path}/nobody"  # no server: no reply will ever come
    async with Client(addr, timeout=30) as c:
        waiting = [asyncio.ensure_future(c.request("embed", [1, 2], rid="r1")),
                   asyncio.ensure_future(c.ping()),
                   asyncio.ensure_future(c.close_session("s1")),
                   asyncio.ensure_future(c.close_session("s1"))]
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in waiting)
        await c.close()
        done, pending = await asyncio.wait(waiting, timeout=5)
        assert not pending, "close() left a caller waiting for a reply that cannot come"
        for t in done:
            with pytest.raises(asyncio.CancelledError):
                t.result()
        assert "pending=0" in repr(c)


async def test_connection_lost_says_while_the_server_has_closed_the_connection(tmp_path):
    """The load generator pauses on it, and ends the run when it lasts: a server that drained
    and left while the client was stalled sent no 503 to say so. A reconnect clears it."""
    import zmq
    import zmq.asyncio

    addr = f"ipc://{tmp_path}/router"
    ctx = zmq.asyncio.Context.instance()

    async def serve_one_ping() -> zmq.asyncio.Socket:
        server = ctx.socket(zmq.ROUTER)
        server.bind(addr)
        assert len(await asyncio.wait_for(server.recv_multipart(), 5)) == 2  # connected: it read our ping
        return server

    async def until(want: bool) -> bool:
        for _ in range(250):
            if c.connection_lost() is want:
                return True
            await asyncio.sleep(0.02)
        return False

    async with Client(addr, timeout=5) as c:
        assert not c.connection_lost()  # never connected is not lost
        pinging = asyncio.ensure_future(c.ping())  # no pong comes
        server = await serve_one_ping()
        assert await until(False)
        server.close(linger=0)
        assert await until(True) and c.connection_lost()  # and it stays so while nobody listens
        pinging.cancel()
        pinging = asyncio.ensure_future(c.ping())  # queued until the DEALER reconnects
        server = await serve_one_ping()
        assert await until(False), "a new connection must clear it"
        pinging.cancel()
        server.close(linger=0)


async def test_a_client_that_fails_to_enter_or_is_never_closed_does_not_hang_its_context():
    """Outside review: the first cut's monitor socket sat on a shadow context, which
    ``destroy`` does not know: an unclosed client, or one whose connect failed, hung it."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    with pytest.raises(zmq.ZMQError):
        async with Client("bogus://x", context=ctx):
            pass
    left_open = Client("ipc:///tmp/mmsched-test-nobody.sock", context=ctx)
    await left_open.__aenter__()
    destroying = threading.Thread(target=ctx.destroy, args=(0,), daemon=True)  # a hang fails, not hangs, the test
    destroying.start()
    destroying.join(10)
    assert not destroying.is_alive(), "Context.destroy hung on the client's sockets"
    await left_open.close()


async def test_a_connection_that_never_completes_its_handshake_is_not_lost():
    """Only a connection that existed can be lost: a listener that accepts and closes (a
    wrong port, a CurveZMQ key it refuses) is no server going away."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    async with Client(f"tcp://127.0.0.1:{port}", timeout=5) as c:
        pinging = asyncio.ensure_future(c.ping())
        accepted = 0
        for _ in range(100):
            try:
                conn, _addr = listener.accept()
                conn.close()
                accepted += 1
            except BlockingIOError:
                pass
            await asyncio.sleep(0.02)
            assert not c.connection_lost()
        assert accepted >= 2 and c.connections == 0, accepted
        pinging.cancel()
    listener.close()


def test_minutes_of_failed_reconnects_do_not_freeze_the_clients_context():
    """Outside review: libzmq's I/O thread blocks on a full monitor (~2,000 unread events)
    and with it every socket of the context, so a client that nobody asked
    ``connection_lost`` of froze its neighbours (no pong after 2,001 failed connects). The
    client reads its monitor now and then. Reconnects every 1 ms make minutes seconds; in a
    process of its own, as a frozen context also hangs the clients' close."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "monitor_storm.py")
    try:
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the storm hung (the context froze): {exc.stdout}")
    assert proc.returncode == 0 and "pong after" in proc.stdout, proc.stdout + proc.stderr


async def test_a_rid_still_in_flight_raises_and_takes_back_the_segment_it_made(tmp_path):
    """The README: calls never raise for a 4xx or 5xx, but a rid still in flight on the same
    client raises ValueError (the caller's mistake) and sends nothing: the segment the
    second call wrote is taken back (outside attack, session 54: the docs said nothing)."""
    import torch

    from mmsched.client import shm

    def mine() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"mmsched_{os.getpid()}_")}

    async with Client(f"ipc://{tmp_path}/nobody", timeout=30) as c:
        first = c.send_request("embed", [1], rid="same")
        before = mine()
        with pytest.raises(ValueError, match="already in flight on this client"):
            c.send_request("embed", [1], [shm(torch.ones(4))], rid="same")
        assert mine() == before, "the refused call's segment is gone"
        assert not first.done()


async def test_close_unlinks_the_segments_of_requests_that_never_left_the_client(tmp_path):
    """Outside attack, session 60: with no server, ZeroMQ queues 1000 messages and the rest
    wait in the client; close() left the segments of all of them. Those that never reached
    ZeroMQ are still the client's, and go; those ZeroMQ took are the server's by the
    contract (its sweep reclaims them), removed here by the test as the sweep would."""
    import torch

    from mmsched.client import shm

    def mine() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"mmsched_{os.getpid()}_")}

    n = 1300
    before = mine()
    c = Client(f"ipc://{tmp_path}/nobody", timeout=30)
    await c.__aenter__()
    try:
        for i in range(n):
            c.send_request("embed", [1], [shm(torch.ones(4))], rid=f"r{i}")
        assert len(mine() - before) == n
        await c.close()
        left = mine() - before
        assert len(left) <= 1000, f"{len(left)} segments left: the never-sent requests' too"
    finally:
        await c.close()
        for name in mine() - before:
            os.unlink(f"/dev/shm/{name}")


async def test_a_reply_that_is_not_a_map_is_dropped_and_the_reader_goes_on(tmp_path):
    """A reply MessagePack reads but that is no map (a server of something else) used to end
    the reader (``h.get`` raised): every later result would then wait for its timeout."""
    import msgpack
    import zmq

    addr = f"ipc://{tmp_path}/rogue"
    r = zmq.Context.instance().socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    r.bind(addr)
    try:
        async with Client(addr, timeout=5) as c:
            fut = c.send_request("embed", [1, 2], rid="x")
            for _ in range(500):
                if r.poll(0, zmq.POLLIN):
                    break
                await asyncio.sleep(0.01)
            ident, *_ = r.recv_multipart()
            r.send_multipart([ident, msgpack.packb(7)])
            r.send_multipart([ident, msgpack.packb({"v": 1, "type": "result", "rid": "x", "status": 200})])
            assert (await c.wait("x", fut, 5)).status == 200
    finally:
        r.close(0)
