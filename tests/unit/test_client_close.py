"""Client.close() wakes every caller still waiting for a reply: results, pongs and acks."""

from __future__ import annotations

import asyncio

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


async def test_connection_lost_says_when_the_server_closed_the_connection(tmp_path):
    """The load generator stops on it: a server that drained and left while the client was
    stalled sent no 503 to say so, and what is sent after is read by nobody."""
    import zmq
    import zmq.asyncio

    addr = f"ipc://{tmp_path}/router"
    server = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    server.bind(addr)
    async with Client(addr, timeout=5) as c:
        pinging = asyncio.ensure_future(c.ping())  # connected once the server reads it (no pong comes)
        assert len(await asyncio.wait_for(server.recv_multipart(), 5)) == 2
        await asyncio.sleep(0.1)
        assert not c.connection_lost()
        server.close(linger=0)
        for _ in range(100):
            if c.connection_lost():
                break
            await asyncio.sleep(0.02)
        assert c.connection_lost() and c.connection_lost()  # and it stays so
        pinging.cancel()
