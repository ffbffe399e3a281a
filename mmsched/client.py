"""The asyncio client: ``async with Client(addr) as c: r = await c.embed(ids, [shm(t)])``.

One DEALER socket (``client_socket``: sends never wait), one reader fanning replies out to futures.
Features are described with ``shm()``, ``inline()``, ``pooled()``, ``cuda_ipc()``, ``ref()``
or ``raw()`` (``mmsched.producers.features``, which writes them at send time); ``shm``
segments are locked until the result arrives, and owned by mmsched once sent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
from collections import deque
from typing import Any, Callable, Iterable, Sequence

import msgpack
import numpy as np
import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .client_socket import ClientSocket
from .producers.features import Feature, Held, cuda_ipc, inline, pooled, raw, ref, shm
from . import protocol
from .protocol import VERSION, pack

__all__ = ["Client", "Feature", "Result", "cuda_ipc", "inline", "pooled", "raw", "ref", "shm"]

log = logging.getLogger("mmsched.client")


class Result(protocol.Result):
    """A result as the client reads it (``Result.from_wire``), with its embedding decoded."""

    received_at = math.nan  # time.perf_counter() when the client read it off its socket

    @property
    def embedding(self) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(self.output["embedding"], dtype="<f4").copy())


class Client:
    """An async client of one mmsched frontend."""

    _ids = itertools.count()

    def __init__(self, address: str, *, shm_prefix: str = "mmsched_", timeout: float = 60.0,
                 context: zmq.asyncio.Context | None = None, ipc_pool=None, shm_pool=None,
                 server_key: str | bytes | None = None, client_cert: str | None = None):
        """``server_key`` (the server's NAME.key file or z85 key) and ``client_cert`` (this
        client's NAME.key_secret) turn on CurveZMQ for a frontend that requires it."""
        self._curve = (server_key, client_cert) if server_key is not None else None
        self.address, self.shm_prefix, self.timeout = address, shm_prefix, timeout
        self.ipc_pool, self.shm_pool = ipc_pool, shm_pool
        self._held: dict[str, Held] = {}  # rid -> what its features hold until its result
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.Socket | None = None  # a plain socket: self._io makes it asyncio's
        self._io: ClientSocket | None = None
        self._reader: asyncio.Task | None = None
        self._events: asyncio.Task | None = None  # reads the monitor now and then (_drain_events)
        self._monitor: zmq.Socket | None = None  # the DEALER's connection events (a PAIR socket)
        self._read_events: zmq.Socket | None = None  # its sync view: read without a future
        self._connected = self._lost = False
        self.connections = 0  # connections made (a handshake done): a reconnect counts one more
        self._results: dict[str, asyncio.Future] = {}
        self._pongs: deque[asyncio.Future] = deque()
        self._acks: dict[str, deque[asyncio.Future]] = {}
        self.unrouted: list[Result] = []  # results with rid nil (the message was unreadable)
        self._tag = f"c{os.getpid()}-{next(self._ids)}"
        self._n = itertools.count()

    async def __aenter__(self) -> "Client":
        self._sock = self._ctx.socket(zmq.DEALER, socket_class=zmq.Socket)  # (the context closes it too)
        self._io = ClientSocket(self._sock)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Replies the reader has not taken yet wait in ZeroMQ, not in the kernel: at the default
        # 1000, a busy client's I/O thread stops reading, and so misses the server closing.
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        if self._curve is not None:
            from .auth import secure_client

            secure_client(self._sock, *self._curve)
        self._connected, self._lost, self.connections = False, False, 0
        try:
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            self._read_events = zmq.Socket.shadow(self._monitor.underlying)
            self._sock.connect(self.address)
        except BaseException:
            await self.close()
            raise
        self._reader = asyncio.ensure_future(self._io.receive(self._route))
        self._events = asyncio.ensure_future(self._drain_events())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for task in (self._reader, self._events):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._reader = self._events = None
        if self._io is not None:
            self._io.close()
        if self._monitor is not None:
            if not self._sock.closed:  # (closed already if its context was destroyed)
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = self._read_events = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        for held in self._held.values():
            held.unlock()
        self._held.clear()
        pending = [*self._results.values(), *self._pongs, *(f for q in self._acks.values() for f in q)]
        for fut in pending:  # no reply can come any more: every waiter is woken (cancelled)
            if not fut.done():
                fut.cancel()
        self._results, self._pongs, self._acks = {}, deque(), {}

    def connection_lost(self) -> bool:
        """Whether this client had a connection to the server and has none now (the server
        stopped or dropped it); checked without blocking. ZeroMQ reconnects on its own, and a
        new connection clears it. Meanwhile what is sent is read by nobody, and a ROUTER
        drops the replies to a peer that left."""
        events = self._read_events
        while events is not None and events.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            if parse_monitor_message(events.recv_multipart())["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected, self._lost = True, False
                self.connections += 1
            else:  # disconnected (a handshake that failed never connected)
                self._lost = self._connected
        return self._lost

    async def _drain_events(self, every_s: float = 1.0) -> None:
        """Read the monitor even when nobody asks: ZeroMQ's I/O thread blocks on a full one
        (~2,000 events: minutes of failed reconnects), and with it every socket of the context."""
        while True:
            await asyncio.sleep(every_s)
            self.connection_lost()

    # ------------------------------------------------------------ requests
    def new_rid(self) -> str:
        return f"{self._tag}-{next(self._n)}"

    async def embed(self, input_ids: Sequence[int] | np.ndarray, features: Iterable[Feature] = (),
                    **kw: Any) -> Result:
        return await self.request("embed", input_ids, features, **kw)

    async def generate(self, input_ids: Sequence[int] | np.ndarray, features: Iterable[Feature] = (),
                       max_new_tokens: int | None = None, **kw: Any) -> Result:
        params = dict(kw.pop("params", {}) or {})
        if max_new_tokens is not None:
            params["max_new_tokens"] = max_new_tokens
        return await self.request("generate", input_ids, features, params=params, **kw)

    async def request(self, type: str, input_ids, features: Iterable[Feature] = (), *,
                      rid: str | None = None, session_id: str | None = None, params: dict | None = None,
                      want_digest: bool = False, timeout: float | None = None) -> Result:
        """Send one request and wait for its one result."""
        rid = rid or self.new_rid()
        fut = self.send_request(type, input_ids, features, rid=rid, session_id=session_id,
                                params=params, want_digest=want_digest)
        return await self.wait(rid, fut, timeout)

    def send_request(self, type: str, input_ids, features: Iterable[Feature] = (), *, rid: str,
                     session_id: str | None = None, params: dict | None = None,
                     want_digest: bool = False) -> asyncio.Future:
        """Send without waiting; the returned future resolves to the Result."""
        header: dict[str, Any] = {"v": VERSION, "type": type, "rid": rid,
                                  "input_ids": _ids_bin(input_ids)}
        if session_id is not None:
            header["session_id"] = session_id
        if params:
            header["params"] = params
        if want_digest:
            header["want_digest"] = True
        frames: list[Any] = []
        held = Held(self.shm_pool, self.ipc_pool, self.shm_prefix)
        try:
            header["mm_items"] = [held.item(f, frames) for f in features]
            fut = self.send_raw(header, frames, rid=rid, never_sent=held.never_sent if held else None)
        except BaseException:
            held.never_sent()
            raise
        if held:
            self._held[rid] = held
        return fut

    def send_raw(self, header: Any, frames: Sequence[Any] = (), rid: str | None = None,
                 packed: bytes | None = None, never_sent: Callable[[], None] | None = None) -> asyncio.Future | None:
        """Send a header (or pre-packed bytes) and frames; a future for ``rid``'s result if given;
        ``never_sent`` runs if the client closes before ZeroMQ took it (no server saw it: what
        its features hold is ours to unlink; ``close`` then finds the locks already gone)."""
        fut = None
        if rid is not None:
            if rid in self._results:
                raise ValueError(f"rid {rid!r} is already in flight on this client")
            fut = asyncio.get_running_loop().create_future()
            self._results[rid] = fut
        body = packed if packed is not None else pack(header)
        self._io.send([body, *frames], never_sent=never_sent)
        return fut

    def give_up(self, rid: str) -> None:
        """Stop waiting for ``rid``'s result (its connection was replaced: no reply can come).
        Its future is cancelled and its segments' locks dropped, so the server's sweep may
        reclaim them once no request names them; its pool slices stay taken (a rank may still
        be reading them). A reply that comes after all is unrouted."""
        fut = self._results.pop(rid, None)
        if fut is not None and not fut.done():
            fut.cancel()
        held = self._held.pop(rid, None)
        if held is not None:
            held.unlock()

    async def wait(self, rid: str, fut: asyncio.Future, timeout: float | None = None) -> Result:
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout or self.timeout)
        finally:
            if fut.done():
                self._results.pop(rid, None)

    async def abort(self, rid: str) -> None:
        self._io.send([pack({"v": VERSION, "type": "abort", "rid": rid})])

    async def ping(self, timeout: float | None = None) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self._pongs.append(fut)
        return await self._exchange([pack({"v": VERSION, "type": "ping"})], fut, timeout)

    async def close_session(self, session_id: str, timeout: float | None = None) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self._acks.setdefault(session_id, deque()).append(fut)
        return await self._exchange([pack({"v": VERSION, "type": "close_session", "session_id": session_id})],
                                    fut, timeout)

    async def _exchange(self, frames: list, fut: asyncio.Future, timeout: float | None) -> dict:
        """Send, then wait for the reply, under one deadline (ZeroMQ may not take the message: a
        server refusing our CURVE key); still waiting in the client then, it is never sent."""
        sent = self._io.send(frames, track=True)

        async def both() -> dict:
            await sent
            return await fut
        try:
            return await asyncio.wait_for(both(), timeout or self.timeout)
        finally:
            sent.cancel()  # (done: nothing; still waiting in the client: never sent)

    # ------------------------------------------------------------ the reader
    def _route(self, frames: list, at: float) -> None:
        """One reply (read off the socket at ``at``) to whoever waits for it."""
        try:
            h = msgpack.unpackb(frames[0], raw=False)
            kind = h.get("type")  # (not a map: dropped too, never the reader's end)
        except Exception:
            log.warning("unreadable reply dropped")
            return
        if kind == "result":
            res = Result.from_wire(h)
            res.received_at = at
            fut = self._results.pop(res.rid, None) if res.rid is not None else None
            held = self._held.pop(res.rid, None) if res.rid is not None else None
            if held is not None:
                held.answered(res.status)
            if fut is None or fut.done():
                self.unrouted.append(res)
            else:
                fut.set_result(res)
        elif kind == "pong":
            while self._pongs:
                fut = self._pongs.popleft()
                if not fut.done():
                    fut.set_result(h)
                    break
        elif kind == "ack":
            q = self._acks.get(h.get("session_id"))
            if q:
                fut = q.popleft()
                if not fut.done():
                    fut.set_result(h)

    def __repr__(self) -> str:
        return f"<Client {self.address} pending={len(self._results)}>"


def _ids_bin(ids) -> bytes:
    return np.ascontiguousarray(np.asarray(ids), dtype="<i4").tobytes()
