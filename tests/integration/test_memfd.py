"""The memfd pool transport through a real tp = 2 group: the ranks read what the client wrote;
an unsealed, a sparse and a replaced pool are each a 500 for that request while the group keeps
serving; a producer killed while a rank still reads its pool costs no SIGBUS and no mapping."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from mmsched.client import Client, pooled, raw, ref, shm
from mmsched.producers import MemfdPool

from ..conftest import Server, pid_alive
from .lifecycle import expect, feature, no_extra_results, sha256_of, wait_until

ARGS = ("--tp", "2", "--fault", "1:hold:memfd-hold-*", "--stall-s", "3")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with Server(*ARGS, tmp_dir=str(tmp_path_factory.mktemp("memfd"))) as srv:
        yield srv


@pytest.fixture
def pool():
    p = MemfdPool(4 << 20)
    yield p
    p.close()


async def test_memfd_round_trip_matches_the_client_bytes(group, pool):
    async with Client(group.addr, shm_pool=pool) as c:
        for rnd in range(3):  # slices are taken back on every result and reused
            a, b = feature(rnd, (256, 1024)), feature(10 + rnd, (3, 5, 7), torch.float16)
            r = expect(await c.embed([1, 2, rnd], [pooled(a), pooled(b)], want_digest=True), 200)
            assert r.meta["digests"] == [sha256_of(a), sha256_of(b)]
            assert pool.num_leased == 0
        x = feature(50, (16, 16))
        via_memfd = expect(await c.embed([4, 5], [pooled(x)]), 200)
        via_shm = expect(await c.embed([4, 5], [shm(x)]), 200)
        assert torch.equal(via_memfd.embedding, via_shm.embedding)
        await no_extra_results(c)



async def test_a_big_feature_a_session_keeps_is_not_overwritten_by_later_batches(group):
    """Big features land in reused buffers on the ranks; one a session stores must keep its bytes."""
    big = MemfdPool(16 << 20)
    try:
        async with Client(group.addr, shm_pool=big) as c:
            kept = feature(1, (1 << 19,))  # 2 MiB float32
            expect(await c.embed([1], [pooled(kept, id="img")], session_id="s-memfd"), 200)
            for k in range(3):  # later batches of big features, each its own buffer
                x = feature(20 + k, (1 << 19,))
                r = expect(await c.embed([2], [pooled(x), pooled(x * 2)], want_digest=True), 200)
                assert r.meta["digests"] == [sha256_of(x), sha256_of(x * 2)]
            r = expect(await c.embed([3], [ref("img")], session_id="s-memfd", want_digest=True), 200)
            assert r.meta["digests"] == [sha256_of(kept)]
            await c.close_session("s-memfd")
    finally:
        big.close()

def _memfd(seals: int, allocate: bool, size: int = 1 << 20) -> int:
    fd = os.memfd_create("mmsched_test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.posix_fallocate(fd, 0, size) if allocate else os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _item(fd: int, inode: int | None = None, n: int = 4096) -> dict:
    inode = os.fstat(fd).st_ino if inode is None else inode
    return {"transport": "memfd", "modality": "image", "dtype": "uint8", "shape": [n], "offset": 0,
            "memfd": {"pid": os.getpid(), "fd": fd, "inode": inode}}


async def test_unsealed_sparse_and_replaced_pools_are_500s_and_the_group_serves_on(group, pool):
    sealed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    unsealed, sparse = _memfd(0, True), _memfd(sealed, False)
    replaced = _memfd(sealed, True)
    old_inode = os.fstat(replaced).st_ino
    try:
        async with Client(group.addr, shm_pool=pool) as c:
            good = feature(7, (64, 64))
            expect(await c.embed([1], [pooled(good)], want_digest=True), 200)
            fresh = _memfd(sealed, True)
            os.dup2(fresh, replaced)  # the descriptor number the item names now holds another memfd
            os.close(fresh)
            for fd, inode, says in ((unsealed, None, "is not sealed"), (sparse, None, "is sparse"),
                                    (replaced, old_inode, "was replaced")):
                r = expect(await c.embed([1], [raw(_item(fd, inode))]), 500)
                assert says in r.message and f"/fd/{fd}" in r.message, r.message
                r = expect(await c.embed([1], [pooled(good)], want_digest=True), 200)
                assert r.meta["digests"] == [sha256_of(good)]
            await no_extra_results(c)
    finally:
        for fd in (unsealed, sparse, replaced):
            os.close(fd)


PRODUCER = """
import asyncio, sys, torch
from mmsched.client import Client, pooled
from mmsched.producers import MemfdPool

async def main():
    pool = MemfdPool(8 << 20, prefix="mmsched_dies_")
    async with Client(sys.argv[1], shm_pool=pool) as c:
        c.send_request("embed", [1, 2], [pooled(torch.ones(1 << 20))], rid="memfd-hold-dies")
        await asyncio.sleep(0.2)
        print("sent", flush=True)
        await asyncio.sleep(120)

asyncio.run(main())
"""


def _maps_dead_pool(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "memfd:mmsched_dies_pool" in f.read()
    except FileNotFoundError:
        return False


async def test_a_producer_killed_mid_batch_is_no_sigbus_and_no_leak(group, pool):
    ranks = group.rank_pids()
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, group.addr], stdout=subprocess.PIPE,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        assert proc.stdout.readline().strip() == b"sent"
        # rank 1 holds the request 3 s after opening it: it reads the pool after its owner is gone
        wait_until(lambda: any(_maps_dead_pool(p) for p in ranks), 10, "a rank maps the producer's pool")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    async with Client(group.addr, shm_pool=pool) as c:
        x = feature(3, (32, 32))
        r = expect(await c.embed([3], [pooled(x)], want_digest=True), 200)  # queued behind the held batch
        assert r.meta["digests"] == [sha256_of(x)]
    assert all(pid_alive(p) for p in ranks), "a rank died"
    wait_until(lambda: not any(_maps_dead_pool(p) for p in ranks), 15, "the ranks unmap the dead pool")


def test_the_load_generator_sends_memfd_items_the_ranks_read_exactly(group, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "mmsched", "loadtest", "--frontend", group.addr, "--requests", "60",
                           "--concurrency", "8", "--item-bytes", "3K,1M", "--items", "2", "--transport", "memfd",
                           "--verify", "--quiet", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())["summary"]
    assert (s["verified"], s["mismatched"]) == (60, 0), s
    assert "fell back" not in proc.stdout  # every feature went through the memfd pool
