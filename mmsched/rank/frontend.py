"""The leader's ROUTER socket, made in one place: options, CurveZMQ, bind, ipc mode; then
``recv_from_clients`` and ``send_to_clients``, and the read of what is unread at the stop."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import msgpack
import zmq
import zmq.asyncio

from ..auth import claim_ipc, ipc_identity, ipc_lost, remove_ipc, restrict_ipc, secure_frontend
from ..client_socket import EVENTS, NOBLOCK, POLLIN, SNDMORE_NOBLOCK  # plain ints, not pyzmq's enums
from ..config import Config
from ..descriptors import connections_at_most
from ..errors import ConfigError, describe
from ..log import event, sampled_event
from ..protocol import INTERNAL, pack, result
from .connections import ConnectionBound

Handler = Callable[[list], None]
# pyzmq's own send, under its Python wrapper (which only adds routing_id and group, for draft
# socket types): two sends per answer, ~0.4 us each saved on the leader's loop
_send = zmq.backend.Socket.send


class Frontend:
    # clients still sending when we stop (a load generator until it sees its first 503)
    UNREAD_QUIET_S, UNREAD_MAX_S = 0.2, 2.0

    def __init__(self, cfg: Config):
        self.address = cfg.frontend
        self.per_read = max(cfg.max_batch, 64)
        claim_ipc(cfg.frontend)  # again: another server may have bound it since the CLI checked
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)  # per frame: the hard backstop
        self.sock.setsockopt(zmq.SNDHWM, cfg.zmq_hwm)
        self.sock.setsockopt(zmq.RCVHWM, cfg.zmq_hwm)
        # A connection that brings a routing id already in use takes it over (what the old one
        # had delivered is still read; libzmq reads nothing more from it): the default ignores
        # the newcomer for good, so it would get no reply and its segments would stay linked.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._auth = secure_frontend(self.ctx, self.sock, cfg)
        # before the bind: the monitor reports the listener
        self.connections = ConnectionBound(self.ctx, self.sock, connections_at_most(cfg))
        try:
            self.sock.bind(cfg.frontend)
        except zmq.ZMQError as exc:
            self.connections.close()
            self.sock.close(linger=0)
            raise ConfigError(f"frontend: cannot bind {cfg.frontend}: {exc}") from exc
        restrict_ipc(cfg.frontend, int(cfg.ipc_mode, 8))
        self.connections.start()
        self._bound = ipc_identity(cfg.frontend)  # /health and the stop check the file is still ours
        self._raw = zmq.Socket.shadow(self.sock.underlying)  # sync view: NOBLOCK drains and sends
        self._check = asyncio.Event()  # set: the receiver must look at ZMQ_EVENTS again
        self._packer = msgpack.Packer(use_bin_type=True)  # protocol.pack's bytes, without a Packer per call

    async def recv_from_clients(self, handle: Handler, after: Callable[[], None]) -> None:
        """Wait for a message, then drain without blocking (receiving in batches is ~7x
        faster): ``handle`` each one, then call ``after``. Runs until cancelled.

        The socket's FD is edge-triggered: it wakes us, and ZMQ_EVENTS says whether a message
        waits; so does every send (``send_to_clients``), which may have used up the FD's edge."""
        loop = asyncio.get_running_loop()
        fd = self._raw.getsockopt(zmq.FD)
        loop.add_reader(fd, self._check.set)
        try:
            while True:
                if not self._raw.get(EVENTS) & POLLIN:
                    self._check.clear()
                    await self._check.wait()
                    continue
                full = self._read(handle, self.per_read) == self.per_read
                after()
                if full:  # more may wait: let the loop form a batch first (a flood would starve it)
                    await asyncio.sleep(0)
        finally:
            loop.remove_reader(fd)

    def send_to_clients(self, client: bytes, header: dict) -> None:
        # Through the sync shadow (the asyncio socket wraps each send in futures). A send
        # processes the socket's mailbox and can consume the FD signal the receiver waits on:
        # the receiver re-checks ZMQ_EVENTS after it. NOBLOCK: a full peer never blocks the loop.
        try:
            _send(self._raw, client, SNDMORE_NOBLOCK)
            _send(self._raw, _packed(header, self._packer.pack), NOBLOCK)
        except zmq.ZMQError as exc:
            sampled_event("send_failed", logging.WARNING, rid=header.get("rid"), error=describe(exc))
        self._check.set()

    def read_unread(self, handle: Handler) -> None:
        """The loop is over: ``handle`` what clients sent that is still queued at the socket,
        until it stays quiet for UNREAD_QUIET_S, for at most UNREAD_MAX_S."""
        deadline = time.monotonic() + self.UNREAD_MAX_S
        while time.monotonic() < deadline and self._raw.poll(int(self.UNREAD_QUIET_S * 1000), zmq.POLLIN):
            self._read(handle, 1024)

    def _read(self, handle: Handler, most: int) -> int:
        """``handle`` up to ``most`` messages waiting; how many there were."""
        recv = self._raw.recv
        for n in range(most):
            try:
                frame = recv(NOBLOCK, copy=False)
            except zmq.Again:
                return n
            frames = [frame]
            while frame.more:  # a message's parts arrive together: the rest is there
                frame = recv(NOBLOCK, copy=False)
                frames.append(frame)
            handle(frames)
        return most

    def lost(self) -> str | None:
        """Why the ipc:// socket file is no longer ours (for /health), or None."""
        return ipc_lost(self.address, self._bound)

    def close(self) -> None:
        self.connections.close()
        self.sock.close(linger=1000)
        remove_ipc(self.address, self._bound)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()


def _packed(header: dict, packb: Callable[[dict], bytes] = pack) -> bytes:
    """The message's bytes. A result that cannot be encoded (the runner already refuses an
    engine output MessagePack cannot carry: this is the last line) becomes a 500 for that
    request instead of an exception that would end the loop."""
    try:
        return packb(header)
    except Exception as exc:  # noqa: BLE001 - whatever the encoder refuses
        event("result_not_encodable", logging.ERROR, rid=header.get("rid"), error=describe(exc))
        return pack(result(header.get("rid"), INTERNAL, f"result could not be encoded: {describe(exc)}"))
