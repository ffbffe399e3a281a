"""CUDA IPC features on the ranks: copy a slot of a producer's pool, then acknowledge it.

Every rank copies its slice onto its own device and then writes the slot's generation
into its cell of the producer's *ack board* (``mmsched.producers.ipc_pool``). A rank
that fails or is aborted before copying acknowledges without reconstruction, and the
leader acknowledges for every rank when a request never reached the group (400, 503,
aborted while queued): the pool never loses a slot. The pool's memory is behind
``mmsched.devices.Device``.
"""

from __future__ import annotations

import logging
import os

import torch

from ..devices import Device, device_for
from ..errors import FeatureError, describe
from ..faults import Faults
from ..log import sampled_event
from ..protocol import Item
from ..segments import ACK_CELL, ack_cell, same_file, shm_path
from .base import OpenedFeature, typed
from .leases import LeasedCache


class AckBoard:
    """A rank's handle on a producer's ack board: it writes its own cells, never unlinks."""

    def __init__(self, name: str):
        self.name = name
        self._fd = os.open(shm_path(name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        self.inode = os.fstat(self._fd).st_ino

    def is_current(self) -> bool:
        """Still the board under its name: acks for a re-created pool go to its new board."""
        return same_file(self.name, self.inode)

    def check(self, ipc: dict, rank: int) -> int:
        """The position of ``rank``'s cell for this lease; raises when this board is not the
        one the request was sent with (re-created under its name) or has no such cell."""
        if ipc.get("acks_id") is not None and ipc["acks_id"] != self.inode:
            raise FeatureError(f"ack board {self.name} was re-created since the request was sent "
                               f"(inode {self.inode}, the request names {ipc['acks_id']})")
        ranks = ipc["ranks"]
        if not 0 <= rank < ranks:  # it would land in another slot's cell and free an unread lease
            raise FeatureError(f"ack board {self.name} has {ranks} rank columns; no cell for rank {rank}")
        pos = ack_cell(ipc["slot"], ranks, rank)
        if pos + ACK_CELL > os.fstat(self._fd).st_size:
            raise FeatureError(f"ack board {self.name} has no cell for slot {ipc['slot']}, rank {rank}")
        return pos

    def ack(self, ipc: dict, rank: int) -> None:
        """Write the lease's generation into ``rank``'s cell (after ``check``'s refusals)."""
        os.pwrite(self._fd, int(ipc["generation"]).to_bytes(ACK_CELL, "little", signed=True), self.check(ipc, rank))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1


class Attachments:
    """Per rank (``Transports`` holds one): attached pools and opened ack boards, each leased
    by its readers (``leases.py``)."""

    LIMIT = 16

    def __init__(self, limit: int = LIMIT):
        self.pools: LeasedCache[tuple[str, bytes], tuple[Device, object]] = LeasedCache(
            "ipc_pools", self._attach, lambda entry: entry[0].detach(entry[1]),
            lambda key, entry: entry[0].is_current(key[1], entry[1]), limit)
        self.boards: LeasedCache[str, AckBoard] = LeasedCache(
            "ack_boards", AckBoard, AckBoard.close, lambda name, board: board.is_current(), limit)

    @staticmethod
    def _attach(key: tuple[str, bytes]) -> tuple[Device, object]:
        dev = device_for(key[0])
        return dev, dev.attach(key[1])

    def prune(self) -> int:
        return self.pools.prune() + self.boards.prune()


def acknowledge(item: Item, ranks: range | list[int], rid: str | None = None,
                boards: LeasedCache | None = None) -> None:
    """Write this lease's generation for ``ranks``; never raises (logs).

    Through ``boards`` (a rank's cache) or, without one, a board opened for this call only
    (the leader answering a request no rank will see)."""
    ipc = item.ipc
    try:
        if boards is None:
            board = AckBoard(ipc["acks"])
            try:
                for r in ranks:
                    board.ack(ipc, r)
            finally:
                board.close()
            return
        lease = boards.lease(ipc["acks"])
        try:  # never into a board re-created since: that would free another lease's slot
            for r in ranks:
                lease.handle.ack(ipc, r)
        finally:
            boards.release(lease)
    except Exception as exc:  # noqa: BLE001 - a release path
        sampled_event("ack_failed", logging.WARNING, rid=rid, acks=ipc.get("acks"), error=describe(exc))


class CudaIpcFeature(OpenedFeature):
    __slots__ = ("rank", "world", "_attached", "_pool", "_acked")

    def __init__(self, item: Item, rid: str, faults: Faults, rank: int, world: int, attached: Attachments):
        self.rank, self.world, self._attached, self._pool, self._acked = rank, world, attached, None, False
        super().__init__(item, rid, faults)

    def _open(self) -> None:
        ipc = self.item.ipc
        if ipc["ranks"] < self.world:
            raise FeatureError(f"ack board has {ipc['ranks']} rank columns, the group has {self.world}")
        board = self._attached.boards.lease(ipc["acks"])
        try:  # a board re-created since the request was sent means its pool was too: not ours to read
            board.handle.check(ipc, self.rank)
        finally:
            self._attached.boards.release(board)
        self._pool = self._attached.pools.lease((ipc["device"], ipc["handle"]))

    def _open_failed(self) -> None:
        self._ack()  # this rank will never read it: say so now, not at release

    def _read(self) -> torch.Tensor:
        dev, pool = self._pool.handle
        try:
            raw = dev.copy_out(pool, self.item.ipc["offset"], self.item.nbytes)
        finally:
            self._ack()  # copied (or failed for good): the producer may reuse it once every rank says so
        return typed(raw, self.item)

    def _ack(self) -> None:
        if not self._acked:
            self._acked = True
            acknowledge(self.item, [self.rank], self.rid, self._attached.boards)

    def release(self, unlink: bool) -> bool:
        self._ack()  # failed or aborted before copying: acknowledge without reconstruction
        if self._pool is not None:  # the attachment stays cached for the pool's next request
            self._attached.pools.release(self._pool)
            self._pool = None
        return True
