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
