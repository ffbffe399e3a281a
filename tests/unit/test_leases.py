"""The rank's handle caches (pooled shm, cuda_ipc attachments and ack boards) against a model.

A feature must read the bytes its pool held when it was opened, whatever happens to the
cache meanwhile: more pools than the bound, pools replaced or unlinked under their name,
prunes, releases in any order. And no descriptor may outlive the last reader of a pool
the cache no longer keeps. The first build failed the first rule (a descriptor closed by
eviction, its number reused by the next open, a 200 with another pool's bytes).
"""

from __future__ import annotations

import os
import uuid

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from mmsched.faults import Faults
from mmsched.protocol import Item
from mmsched.segments import shm_path
from mmsched.transport import Transports
from mmsched.transport.cuda_ipc import Attachments, CudaIpcFeature
from mmsched.transport.shm_pool import PoolCache, PooledFeature
from tests.conftest import fd_targets
from tests.integration.lifecycle import replace_segment

NO_FAULTS = Faults([], 0)
POOL_BYTES = 256
NAMES = 5  # more names than the caches below may keep idle
LIMIT = 2


def fds_into(prefix: str) -> int:
    """Descriptors this process holds on files named with ``prefix`` (unlinked ones included)."""
    return sum(t.startswith(f"/dev/shm/{prefix}") for t in fd_targets())


class CacheMachine(RuleBasedStateMachine):
    """Owners create, replace and unlink pools; features open, read and release them."""

    features = Bundle("features")
    caches = 1  # how many bounded caches the transport keeps

    def __init__(self):
        super().__init__()
        self.prefix = f"mmsched_lease{uuid.uuid4().hex[:8]}_"
        self.files: dict[str, bytes] = {}   # the model: what each name holds now
        self.generation = 0
        self.live: dict[int, object] = {}  # features opened and not yet released
        self.setup()

    # ------------------------------------------------------------ transport-specific
    def setup(self) -> None:
        raise NotImplementedError

    def make_feature(self, name: str, offset: int, nbytes: int):
        raise NotImplementedError

    def cached_open(self) -> int:
        raise NotImplementedError

    def prune(self) -> None:
        raise NotImplementedError

    def close_caches(self) -> None:
        raise NotImplementedError

    def created(self, name: str) -> None:
        """Hook: the owner (re)created ``name``."""

    def unlinking(self, name: str) -> None:
        """Hook: the owner is about to unlink ``name``."""

    # ------------------------------------------------------------ owners
    @rule(k=st.integers(0, NAMES - 1))
    def create_or_replace(self, k):
        self.generation += 1
        data = bytes((self.generation * 7 + i) % 251 for i in range(POOL_BYTES))
        name = f"{self.prefix}{k}"
        replace_segment(name, data)
        self.files[name] = data
        self.created(name)

    @rule(k=st.integers(0, NAMES - 1))
    def owner_unlinks(self, k):
        name = f"{self.prefix}{k}"
        if self.files.pop(name, None) is not None:
            self.unlinking(name)
            os.unlink(shm_path(name))

    # ------------------------------------------------------------ readers
    @rule(target=features, k=st.integers(0, NAMES - 1), offset=st.integers(0, POOL_BYTES - 1),
          nbytes=st.integers(1, 64))
    def open(self, k, offset, nbytes):
        name = f"{self.prefix}{k}"
        f = self.make_feature(name, offset, nbytes)
        data = self.files.get(name)
        if data is None:
            assert f.error is not None, "opened a pool that is not there"
        elif offset + nbytes <= len(data):
            assert f.error is None, f.error
        # None: reading must fail (no pool, or a slice past its end)
        expected = data[offset: offset + nbytes] if data is not None and offset + nbytes <= len(data) else None
        self.live[id(f)] = f
        return (f, expected)

    @rule(entry=features)
    def read(self, entry):
        f, expected = entry
        if id(f) not in self.live:
            return
        if expected is None:
            with pytest.raises(Exception):
                f.materialize()
        else:  # the bytes the pool held when this feature opened it, never another pool's
            assert bytes(f.materialize().numpy()) == expected

    @rule(entry=consumes(features))
    def release(self, entry):
        f, _ = entry
        assert f.release(unlink=True) is True
        self.live.pop(id(f), None)

    @rule()
    def tidy(self):
        self.prune()

    @invariant()
    def no_descriptor_leaks(self):
        # every descriptor we hold is one the cache accounts for, and the idle ones are bounded
        assert fds_into(self.prefix) == self.cached_open()
        assert self.cached_open() <= self.caches * LIMIT + len(self.live)

    def teardown(self):
        try:
            for f in self.live.values():
                f.release(unlink=True)
            self.close_caches()
            assert fds_into(self.prefix) == 0, "a descriptor outlived every reader and the cache"
        finally:
            for name in list(self.files):
                os.unlink(shm_path(name))


class PoolMachine(CacheMachine):
    def setup(self):
        self.cache = PoolCache(limit=LIMIT)

    def make_feature(self, name, offset, nbytes):
        item = Item(index=0, modality="image", transport="shm", dtype="uint8", shape=(nbytes,), nbytes=nbytes,
                    shm_name=name, offset=offset, pooled=True)
        return PooledFeature(item, "r", NO_FAULTS, self.cache)

    def cached_open(self):
        return self.cache.num_open

    def prune(self):
        self.cache.prune()

    def close_caches(self):
        self.cache.clear()


class AttachmentMachine(CacheMachine):
    """The cuda_ipc consumer through ShmDevice: each name is a pool buffer with its own ack board."""

    caches = 2  # attachments and ack boards

    def setup(self):
        self.attached = Attachments(limit=LIMIT)

    def created(self, name):
        replace_segment(f"{name}.acks", bytes(8))  # re-created with its pool, as a producer does

    def unlinking(self, name):
        os.unlink(shm_path(f"{name}.acks"))

    def make_feature(self, name, offset, nbytes):
        ipc = {"device": "shm", "handle": name.encode(), "acks": f"{name}.acks", "ranks": 1, "slot": 0,
               "offset": offset, "generation": 1}
        item = Item(index=0, modality="image", transport="cuda_ipc", dtype="uint8", shape=(nbytes,),
                    nbytes=nbytes, ipc=ipc)
        return CudaIpcFeature(item, "r", NO_FAULTS, 0, 1, self.attached)

    def cached_open(self):
        return self.attached.pools.num_open + self.attached.boards.num_open

    def prune(self):
        self.attached.prune()

    def close_caches(self):
        self.attached.pools.clear()
        self.attached.boards.clear()

    def teardown(self):
        try:
            super().teardown()
        finally:
            for name in os.listdir("/dev/shm"):
                if name.startswith(self.prefix):
                    os.unlink(shm_path(name))


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
AttachmentMachine.TestCase.settings = PoolMachine.TestCase.settings
TestPoolCache = PoolMachine.TestCase
TestAttachments = AttachmentMachine.TestCase


def test_tidy_drops_a_pool_its_owner_unlinked():
    """An unlinked pool must not stay allocated through a rank's cached descriptor."""
    transports = Transports()
    name = f"mmsched_prune{uuid.uuid4().hex[:8]}"
    replace_segment(name, b"\x05" * 128)
    item = Item(index=0, modality="image", transport="shm", dtype="uint8", shape=(16,), nbytes=16,
                shm_name=name, pooled=True)
    f = transports.open(item, "r")
    assert isinstance(f, PooledFeature) and bytes(f.materialize().numpy()) == b"\x05" * 16
    f.release(unlink=True)
    assert fds_into(name) == 1  # kept open for the pool's next request
    os.unlink(shm_path(name))
    assert transports.tidy() == 1
    assert fds_into(name) == 0 and name not in transports.pools._entries


def cells(board: str) -> list[int]:
    with open(shm_path(board), "rb") as fh:
        raw = fh.read()
    return [int.from_bytes(raw[i: i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def test_a_replaced_ack_board_gets_the_acks():
    """A pool re-created under its name: acks go to the new board, not the old one."""
    name, transports = f"mmsched_board{uuid.uuid4().hex[:8]}", Transports(0, 2)
    replace_segment(name, bytes(16))
    try:
        item = Item(index=0, modality="image", transport="cuda_ipc", dtype="uint8", shape=(1,), nbytes=1,
                    ipc={"device": "shm", "handle": b"x", "acks": name, "ranks": 2, "slot": 0, "offset": 0,
                         "generation": 3})
        transports.acknowledge(item, [0])
        assert cells(name) == [3, 0]
        replace_segment(name, bytes(16))  # the producer made a new pool (and board) under the same name
        transports.acknowledge(item, [1])
        assert cells(name) == [0, 3]
    finally:
        os.unlink(shm_path(name))
        transports.clear()
