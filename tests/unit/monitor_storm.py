"""A client refused ~3,000 times in a few seconds beside one that pings on the same context
(run by test_client_close.py in a process of its own): prints the pong, or hangs."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import msgpack
import zmq
import zmq.asyncio

from mmsched.client import Client


async def main() -> None:
    listener = socket.socket()  # accepts and closes: each connect fails, ZeroMQ tries again
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    listener.settimeout(0.1)
    accepted, stop = [0], threading.Event()

    def refuse() -> None:
        while not stop.is_set():
            try:
                listener.accept()[0].close()
                accepted[0] += 1
            except socket.timeout:
                pass
    threading.Thread(target=refuse, daemon=True).start()
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.RECONNECT_IVL, 1)
    ctx.setsockopt(zmq.RECONNECT_IVL_MAX, 1)
    server = zmq.asyncio.Context().socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")

    async def pong() -> None:
        while True:
            peer, _ = await server.recv_multipart()
            await server.send_multipart([peer, msgpack.packb({"v": 1, "type": "pong", "ranks": 1})])
    ponging = asyncio.ensure_future(pong())
    async with Client(f"tcp://127.0.0.1:{port}", timeout=5, context=ctx) as good, \
            Client(f"tcp://127.0.0.1:{listener.getsockname()[1]}", context=ctx) as refused:
        pinging = asyncio.ensure_future(refused.ping(timeout=60))
        deadline = time.monotonic() + 20
        while accepted[0] < 3000 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        print(f"refused {accepted[0]} connects", flush=True)
        assert accepted[0] > 2100, "the reconnects stopped: the context froze"
        assert (await good.ping(timeout=3))["type"] == "pong"
        print(f"pong after {accepted[0]} refused connects", flush=True)
        pinging.cancel()
    ponging.cancel()
    stop.set()
    server.close(0)
    listener.close()


if __name__ == "__main__":
    asyncio.run(main())
