"""The memfd pool transport without a server: real sealed memfds in this process, read through
``/proc/self/fd/N`` as a rank reads a client's; every refusal is a ``FeatureError`` kept on the
feature (a 500 for that request), never a SIGBUS."""

from __future__ import annotations

import ctypes
import fcntl
import os

import numpy as np
import pytest
import torch

from mmsched.errors import BadRequest, FeatureError
from mmsched.faults import NO_FAULTS
from mmsched.producers import MemfdPool
from mmsched.producers.features import Held, pooled
from mmsched.protocol import Item, Limits
from mmsched.protocol.items import item as _item
from mmsched.transport import Transports
from mmsched.transport.memfd import MemfdCache, MemfdFeature

MiB = 1 << 20


def _as_item(d: dict) -> Item:
    return _item(0, d, [b""], Limits())


def _sent(pool, t: torch.Tensor) -> Item:
    held = Held(shm_pool=pool)
    return _as_item(held.item(pooled(t), []))


def test_round_trip_through_the_held_item_and_the_cache():
    pool, tr = MemfdPool(MiB), Transports()
    try:
        a, b = torch.randn(64, 32), torch.arange(1000, dtype=torch.int16)
        ia, ib = _sent(pool, a), _sent(pool, b)
        assert ia.transport == "memfd" and ia.memfd == {"pid": os.getpid(), "fd": pool.fd, "inode": pool.inode}
        fa, fb = tr.open(ia, "r1"), tr.open(ib, "r1")
        assert torch.equal(fa.materialize(), a) and torch.equal(fb.materialize(), b)
        assert len(tr.memfds) == 1 and tr.memfds.num_leased == 1  # one mapping for both slices
        fa.release(True), fb.release(True)
        assert tr.memfds.num_leased == 0 and tr.tidy() == 0  # still current: kept mapped
    finally:
        pool.close()
    assert tr.tidy() == 1 and tr.memfds.num_open == 0  # the client closed it: the mapping goes


def _raw_memfd(size: int, seals: int, allocate: bool) -> int:
    fd = os.memfd_create("mmsched_test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.posix_fallocate(fd, 0, size) if allocate else os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _item_for(fd: int, nbytes: int, inode: int | None = None, offset: int = 0) -> Item:
    inode = os.fstat(fd).st_ino if inode is None else inode
    return _as_item({"transport": "memfd", "modality": "image", "dtype": "uint8", "shape": [nbytes],
                     "offset": offset, "memfd": {"pid": os.getpid(), "fd": fd, "inode": inode}})


@pytest.mark.parametrize("seals,allocate,says", [
    (0, True, "not sealed"),
    (fcntl.F_SEAL_GROW, True, "not sealed"),
    (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, False, "is sparse"),
])
def test_unsealed_and_sparse_pools_are_refused(seals, allocate, says):
    fd, cache = _raw_memfd(MiB, seals, allocate), MemfdCache()
    try:
        f = MemfdFeature(_item_for(fd, 4096), "r", NO_FAULTS, cache)
        with pytest.raises(FeatureError, match=says):
            f.materialize()
        f.release(True)
        assert cache.num_leased == 0
    finally:
        cache.clear()
        os.close(fd)


def test_a_hole_punched_after_mapping_is_refused_on_the_next_item():
    """F_SEAL_SHRINK does not stop a punched hole (it would read zeros): checked per item."""
    pool, cache = MemfdPool(MiB), MemfdCache()
    try:
        item = _sent(pool, torch.ones(4096, dtype=torch.uint8))
        f = MemfdFeature(item, "r", NO_FAULTS, cache)
        assert f.materialize().sum() == 4096
        f.release(True)
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.fallocate(pool.fd, 0x03, ctypes.c_long(0), ctypes.c_long(65536)) == 0  # PUNCH_HOLE|KEEP_SIZE
        g = MemfdFeature(item, "r2", NO_FAULTS, cache)
        with pytest.raises(FeatureError, match="is sparse"):
            g.materialize()
        g.release(True)
    finally:
        cache.clear()
        pool.close()


def test_a_replaced_pool_and_a_plain_file_are_refused(tmp_path):
    pool, cache = MemfdPool(MiB), MemfdCache()
    try:
        item = _sent(pool, torch.ones(16))
        f = MemfdFeature(item, "r", NO_FAULTS, cache)
        f.materialize()
        f.release(True)
        other = _raw_memfd(MiB, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, True)
        os.dup2(other, pool.fd)  # the client's descriptor number now holds another memfd
        os.close(other)
        g = MemfdFeature(item, "r2", NO_FAULTS, cache)
        with pytest.raises(FeatureError, match="was replaced"):
            g.materialize()
        g.release(True)
        assert cache.num_replaced == 1
        plain = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
        os.ftruncate(plain, 4096)
        h = MemfdFeature(_item_for(plain, 16), "r3", NO_FAULTS, cache)
        with pytest.raises(FeatureError, match="not a memfd"):
            h.materialize()
        os.close(plain)
    finally:
        cache.clear()
        pool.close()


def test_a_slice_past_the_end_or_a_closed_pool_is_an_error():
    pool, cache = MemfdPool(MiB), MemfdCache()
    fd, inode = pool.fd, pool.inode
    pool.close()
    f = MemfdFeature(_item_for(fd, 16, inode=inode), "r", NO_FAULTS, cache)
    with pytest.raises(FileNotFoundError):  # /proc/PID/fd/N is gone: a 500, not a crash
        f.materialize()
    pool = MemfdPool(4096)
    try:
        g = MemfdFeature(_item_for(pool.fd, 16, offset=4090), "r", NO_FAULTS, cache)
        with pytest.raises(FeatureError, match="holds 4096 bytes"):
            g.materialize()
    finally:
        cache.clear()
        pool.close()


def test_the_owner_cannot_shrink_a_sealed_pool():
    pool = MemfdPool(MiB)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(pool.fd, 0)
    finally:
        pool.close()


@pytest.mark.parametrize("memfd,field", [
    (None, "mm_items[0].memfd"), ({"pid": 0, "fd": 3, "inode": 1}, "mm_items[0].memfd.pid"),
    ({"pid": 1, "fd": -1, "inode": 1}, "mm_items[0].memfd.fd"), ({"pid": 1, "fd": 3}, "mm_items[0].memfd.inode"),
    ({"pid": 1, "fd": 3, "inode": True}, "mm_items[0].memfd.inode"),
])
def test_a_malformed_memfd_map_is_a_400_naming_the_field(memfd, field):
    with pytest.raises(BadRequest) as err:
        _as_item({"transport": "memfd", "modality": "image", "dtype": "uint8", "shape": [4], "memfd": memfd})
    assert err.value.field == field


def test_the_item_travels_to_followers_and_other_items_are_unchanged():
    it = _item_for(0, 4, inode=7)
    back = Item.from_wire(0, it.wire())
    assert back.memfd == it.memfd and back.transport == "memfd"
    plain = _as_item({"transport": "shm", "modality": "image", "dtype": "uint8", "shape": [4], "shm_name": "mmsched_x"})
    assert "memfd" not in plain.wire()
    np.testing.assert_equal(Item.from_wire(0, plain.wire()).memfd, None)


def test_a_hugetlb_pool_is_refused():
    try:
        fd = os.memfd_create("mmsched_test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
        os.ftruncate(fd, 2 << 20)  # no huge page is needed until it is touched
    except OSError as exc:
        pytest.skip(f"no hugetlb memfd here: {exc}")
    cache = MemfdCache()
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        f = MemfdFeature(_item_for(fd, 16), "r", NO_FAULTS, cache)
        with pytest.raises(FeatureError, match="backed by huge pages"):
            f.materialize()
    finally:
        cache.clear()
        os.close(fd)
