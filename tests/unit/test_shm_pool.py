"""Pooled shared memory: the client's ShmPool (slices, reuse only after the result) and the ranks' PoolCache."""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from mmsched.client import Client, pooled
from mmsched.faults import Faults
from mmsched.protocol import Item
from mmsched.sweep import sweep
from mmsched.producers import ShmPool
from mmsched.segments import shm_path
from mmsched.transport import shm_pool
from mmsched.transport.shm_pool import PoolCache, PooledFeature
from tests.integration.lifecycle import replace_segment

NO_FAULTS = Faults([], 0)


@pytest.fixture
def pools():
    made: list[ShmPool] = []

    def make(size: int, prefix: str = "mmsched_") -> ShmPool:
        p = ShmPool(size, prefix)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def item(name: str, offset: int, nbytes: int) -> Item:
    return Item(index=0, modality="image", transport="shm", dtype="uint8", shape=(nbytes,), nbytes=nbytes,
                shm_name=name, offset=offset, pooled=True)


def current(cache: PoolCache, name: str):
    """The pool the cache reads ``name`` through now (leased and given back at once)."""
    lease = cache.lease(name)
    cache.release(lease)
    return lease.handle


def read(cache: PoolCache, name: str, offset: int, nbytes: int) -> bytes:
    f = PooledFeature(item(name, offset, nbytes), "r", NO_FAULTS, cache)
    try:
        return bytes(f.materialize().numpy())
    finally:
        f.release(unlink=True)


# ---------------------------------------------------------------- ShmPool: first fit, coalescing

def test_first_fit_reuses_the_first_hole_and_frees_coalesce(pools):
    pool = pools(64 * 10)
    a = pool.put(torch.zeros(100, dtype=torch.uint8))   # 128 bytes (64-aligned)
    b = pool.put(torch.zeros(64, dtype=torch.uint8))
    c = pool.put(torch.zeros(1, dtype=torch.uint8))     # even 1 byte takes one 64-byte unit
    assert (a, b, c) == (0, 128, 192)
    assert pool.num_leased == 3 and pool.bytes_free == 640 - 256
    pool.free(b, 64)
    assert pool.put(torch.zeros(10, dtype=torch.uint8)) == 128  # first fit: b's hole, not the tail
    assert pool.put(torch.zeros(65, dtype=torch.uint8)) == 256  # too big for any hole but the tail
    assert pool.put(torch.zeros(1000, dtype=torch.uint8)) is None  # bigger than anything free
    for off, n in ((0, 100), (128, 10), (192, 1), (256, 65)):
        pool.free(off, n)
    assert pool.num_leased == 0 and pool.bytes_free == 640
    assert pool._holes == [(0, 640)]  # coalesced into one hole, whatever the order of frees
    assert pool.put(torch.zeros(640, dtype=torch.uint8)) == 0


def test_freeing_out_of_order_coalesces_neighbours(pools):
    pool = pools(64 * 4)
    offs = [pool.put(torch.zeros(64, dtype=torch.uint8)) for _ in range(4)]
    assert offs == [0, 64, 128, 192] and pool.put(torch.zeros(1, dtype=torch.uint8)) is None
    for off in (128, 0, 192, 64):
        pool.free(off, 64)
    assert pool._holes == [(0, 256)]


def test_put_writes_the_bytes_a_rank_reads(pools):
    pool = pools(1 << 16)
    t = torch.arange(1000, dtype=torch.int32)
    off = pool.put(t)
    cache = PoolCache()
    try:
        f = PooledFeature(Item(index=0, modality="image", transport="shm", dtype="int32", shape=(1000,),
                               nbytes=4000, shm_name=pool.name, offset=off, pooled=True), "r", NO_FAULTS, cache)
        assert torch.equal(f.materialize(), t)
        f.release(unlink=True)
    finally:
        cache.clear()
    assert os.path.exists(shm_path(pool.name))


# ---------------------------------------------------------------- PoolCache: replaced, never unlinks, bounded

def test_replaced_pool_is_detected_and_remapped(pools):
    pool = pools(4096)
    pool.put(torch.full((4096,), 1, dtype=torch.uint8))
    cache = PoolCache()
    try:
        assert read(cache, pool.name, 0, 16) == b"\x01" * 16
        first = current(cache, pool.name)
        assert cache.num_replaced == 0
        replace_segment(pool.name, b"\x07" * 4096)  # same name, same size, new inode
        assert read(cache, pool.name, 0, 16) == b"\x07" * 16
        assert cache.num_replaced == 1
        assert current(cache, pool.name) is not first and len(cache) == 1
        assert "replaced=1" in repr(cache)
        assert read(cache, pool.name, 100, 16) == b"\x07" * 16  # mapped once: no second replacement
        assert cache.num_replaced == 1
    finally:
        cache.clear()


def test_a_resized_pool_is_remapped_too(pools):
    pool = pools(4096)
    cache = PoolCache()
    try:
        read(cache, pool.name, 0, 8)
        os.truncate(shm_path(pool.name), 8192)  # same inode, new size: map it again
        assert read(cache, pool.name, 8000, 8) == b"\0" * 8
        assert cache.num_replaced == 1 and current(cache, pool.name).size == 8192
    finally:
        cache.clear()


def test_cache_never_unlinks_and_evicts_least_recently_used(pools):
    a, b, c = pools(4096), pools(4096), pools(4096)
    cache = PoolCache(limit=2)
    try:
        for name in (a.name, b.name, a.name, c.name):  # a is used after b; c's lease evicts b
            current(cache, name)
        assert len(cache) == 2
        assert set(cache._entries) == {a.name, c.name}
        f = PooledFeature(item(c.name, 0, 64), "r", NO_FAULTS, cache)
        f.materialize()
        assert f.release(unlink=True) is True  # a pooled feature never unlinks, even on the leader
    finally:
        cache.clear()
    assert len(cache) == 0
    for p in (a, b, c):
        assert os.path.exists(shm_path(p.name)), "the cache removed a pool it does not own"


def test_slice_past_the_pool_is_a_feature_error_not_a_crash(pools):
    pool = pools(4096)
    cache = PoolCache()
    try:
        f = PooledFeature(item(pool.name, 4000, 200), "r", NO_FAULTS, cache)
        assert f.error is not None and "4096" in str(f.error)
        with pytest.raises(type(f.error)):
            f.materialize()
        f.release(unlink=True)
    finally:
        cache.clear()


# ---------------------------------------------------------------- through a real server

async def test_slices_are_reused_only_after_their_result(start_server, pools):
    """While a request is in flight its slice is never handed out again; once its result is in, it is."""
    srv = start_server("--fault", "0:stall:slow-*", "--fault", "0:open:bad-*", "--stall-s", "1.0")
    pool = pools(64 * 64)
    t1 = torch.full((1000,), 3, dtype=torch.uint8)
    async with Client(srv.addr, shm_pool=pool) as c:
        fut = c.send_request("embed", [1, 2], [pooled(t1)], rid="slow-1", want_digest=True)
        assert pool.num_leased == 1
        taken = range(0, 1024)  # 1000 bytes -> 16 x 64
        # while slow-1 is held by the stall fault, new slices come from elsewhere in the pool
        others = [c.send_request("embed", [1], [pooled(torch.full((64,), 9, dtype=torch.uint8))],
                                 rid=f"other-{i}") for i in range(3)]
        offs = [off for off, _ in (c._held[f"other-{i}"].slices[0] for i in range(3))]
        assert all(o not in taken for o in offs), offs
        r1 = await c.wait("slow-1", fut, timeout=30)
        for i, f in enumerate(others):
            assert (await c.wait(f"other-{i}", f, timeout=30)).status == 200
        assert r1.status == 200, r1.message
        # the server read slow-1's bytes, not whatever the others wrote
        assert r1.meta["digests"] == [hashlib.sha256(t1.numpy()).hexdigest()]
        assert pool.num_leased == 0 and pool.bytes_free == pool.size
        assert pool.put(torch.zeros(1, dtype=torch.uint8)) == 0  # offset 0 is handed out again
        pool.free(0, 1)
        # a failed request gives its slice back too
        r = await c.request("embed", [1], [pooled(t1)], rid="bad-1", timeout=30)
        assert r.status == 500 and pool.num_leased == 0 and pool.bytes_free == pool.size


def test_a_dead_clients_pool_is_left_to_the_sweep():
    """A client SIGKILLed while holding its pool: the segment stays locked while it lives, the sweep takes it after."""
    prefix = f"mmsched_t{uuid.uuid4().hex[:8]}_"  # this test's segments only: the sweep below touches nothing else
    code = ("import sys, time\nfrom mmsched.producers import ShmPool\n"
            f"p = ShmPool(1 << 16, {prefix!r})\nprint(p.name, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith(prefix) and os.path.exists(shm_path(name))
        live = sweep(prefix, grace_s=0)
        assert name in live.locked and name not in live.reclaimed  # alive: its lock protects it
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert os.path.exists(shm_path(name))  # nobody cleaned up after the dead client ...
        report = sweep(prefix, grace_s=0)
        assert report.reclaimed == [name]      # ... until the sweep
        assert not os.path.exists(shm_path(name))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        for n in os.listdir("/dev/shm"):
            if n.startswith(prefix):
                os.unlink(shm_path(n))


def test_a_full_pool_is_mapped_and_a_sparse_one_is_read_with_pread(pools):
    """A read through a mapping fills a hole with pages of the client's file (pread does not):
    only a fully allocated pool is mapped, and one with a hole punched since is let go."""
    if shm_pool.guarded_copy is None:
        pytest.skip("the guarded copy did not build: every pool is read with pread")
    full = pools(1 << 20)
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    at = full.put(data)
    sparse = f"mmsched_{uuid.uuid4().hex[:12]}"
    fd = os.open(shm_path(sparse), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    cache = PoolCache()
    try:
        os.ftruncate(fd, 1 << 20)
        os.pwrite(fd, bytes(data.numpy()), 8192)
        assert read(cache, full.name, at, 5000) == bytes(data.numpy())
        assert read(cache, sparse, 8192, 5000) == bytes(data.numpy())
        assert current(cache, full.name).map is not None and current(cache, sparse).map is None
        mapped = current(cache, full.name)
        punch = ctypes.CDLL(None, use_errno=True).fallocate  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        assert punch(full.segment.fd, 3, ctypes.c_long(65536), ctypes.c_long(65536)) == 0, os.strerror(ctypes.get_errno())
        assert read(cache, full.name, at, 5000) == bytes(data.numpy())  # read anew, with pread
        assert current(cache, full.name) is not mapped and current(cache, full.name).map is None
    finally:
        cache.clear()
        os.close(fd)
        os.unlink(shm_path(sparse))
