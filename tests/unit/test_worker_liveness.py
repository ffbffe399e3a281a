"""The worker's view of whether mmsched answers (mmsched/worker/liveness.py), no sockets:
a stand-in for the client whose pings answer or time out, as a stopped mmsched's do."""

from __future__ import annotations

import asyncio

import pytest

from mmsched.worker.liveness import Liveness, MmschedDown


class Pings:
    def __init__(self):
        self.answering = True

    async def ping(self, timeout=None):
        if not self.answering:
            await asyncio.sleep(timeout)
            raise asyncio.TimeoutError
        return {"type": "pong"}


def test_a_request_waiting_when_mmsched_stops_answering_fails_fast_and_it_recovers():
    async def drill():
        client = Pings()
        live = Liveness(client, every=0.02, misses=3)
        live.start()
        waiting = asyncio.get_running_loop().create_future()  # a result that will never come
        with live.watching(waiting):
            await asyncio.sleep(0.1)
            assert not live.down and not waiting.done()
            client.answering = False
            with pytest.raises(MmschedDown):
                await asyncio.wait_for(waiting, 2)
        assert live.down
        client.answering = True
        for _ in range(100):
            if not live.down:
                break
            await asyncio.sleep(0.02)
        await live.stop()
        return live.down

    assert asyncio.run(drill()) is False
