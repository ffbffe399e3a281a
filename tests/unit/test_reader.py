"""Big segments read in two halves at once: the bytes a rank reads are the client's, and a
segment that shrinks under the read is that request's error, whichever half it cuts."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from mmsched.producers import ShmPool, create_segment
from mmsched.protocol import Item
from mmsched.segments import SegmentTooSmall, shm_path
from mmsched.transport import Transports, shm_pool
from mmsched.transport.reader import Reader

PREFIX = "mmsched_"
SPLIT = Reader.SPLIT


def shm_item(name: str, nbytes: int, offset: int = 0, pooled: bool = False) -> Item:
    return Item(index=0, modality="image", transport="shm", dtype="uint8", shape=(nbytes,), nbytes=nbytes,
                shm_name=name, offset=offset, pooled=pooled)


def noise(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


@pytest.fixture
def transports():
    t = Transports()
    yield t
    t.clear()


@pytest.mark.parametrize("nbytes", [SPLIT - 1, SPLIT, SPLIT + 4097, 5 * SPLIT + 3])
def test_a_fresh_segment_reads_as_the_client_wrote_it(transports, nbytes):
    offset = 123  # not on a page: the cut between the halves is not either, relative to the file
    for seed in (1, 2):  # the second read lands in the buffer the first one filled
        data = noise(nbytes, seed)
        seg = create_segment(data, PREFIX, size=offset + nbytes)
        try:
            seg.sent()
            fd = os.open(shm_path(seg.name), os.O_RDWR)
            try:  # move the bytes to the offset, as a client packing a header first would
                os.pwrite(fd, data.numpy().tobytes(), offset)
            finally:
                os.close(fd)
            before = transports.reader.splits
            f = transports.open(shm_item(seg.name, nbytes, offset), "r")
            assert f.error is None
            got = f.materialize()
            assert digest(got) == digest(data)
            assert transports.reader.splits - before == (1 if nbytes >= SPLIT else 0)
            assert f.release(unlink=True)
            assert not os.path.exists(shm_path(seg.name))
        finally:
            seg.discard()


def test_a_pooled_slice_reads_as_the_client_wrote_it(transports):
    pool = ShmPool(16 * SPLIT, PREFIX)
    try:
        pool.put(noise(4096, 9))  # the slice under test starts past the pool's first page
        for seed in (3, 4):
            data = noise(3 * SPLIT + 5, seed)
            offset = pool.put(data)
            before = transports.reader.splits
            f = transports.open(shm_item(pool.name, data.numel(), offset, pooled=True), "r")
            assert f.error is None
            assert digest(f.materialize()) == digest(data)
            assert transports.reader.splits - before == 1
            f.release(unlink=True)
            pool.free(offset, data.numel())
    finally:
        pool.close()


@pytest.mark.parametrize("keep", ["none", "first half", "most of the second half"])
def test_a_segment_that_shrinks_before_the_read_fails_that_read_only(transports, keep):
    nbytes = 2 * SPLIT
    data = noise(nbytes, 5)
    seg = create_segment(data, PREFIX)
    try:
        seg.sent()
        f = transports.open(shm_item(seg.name, nbytes), "r")
        assert f.error is None
        os.truncate(shm_path(seg.name), {"none": 0, "first half": nbytes // 2, "most of the second half": nbytes - 7}[keep])
        with pytest.raises(SegmentTooSmall, match=seg.name):
            f.materialize()
        f.release(unlink=True)
    finally:
        seg.discard()
    again = create_segment(data, PREFIX)  # the reader still reads after an error
    try:
        again.sent()
        f = transports.open(shm_item(again.name, nbytes), "r")
        assert digest(f.materialize()) == digest(data)
        f.release(unlink=True)
    finally:
        again.discard()


@pytest.mark.parametrize("keep", ["none", "first half", "most of the second half"])
def test_a_pool_that_shrinks_under_its_mapped_copy_fails_that_read_only(transports, keep):
    """A pooled read copies out of the rank's mapping of the pool: its owner shrinking it
    there is a SIGBUS in the copy, which must be this request's SegmentTooSmall, whichever
    half it cuts; the pool, grown back, reads again through the same mapping."""
    if shm_pool.guarded_copy is None:
        pytest.skip("the guarded copy did not build: pooled reads are preads (the test above)")
    nbytes = 2 * SPLIT
    pool = ShmPool(nbytes + 4096, PREFIX)
    try:
        offset = pool.put(noise(nbytes, 7))
        f = transports.open(shm_item(pool.name, nbytes, offset, pooled=True), "r")
        assert f.error is None
        mapped = f._lease.handle
        assert mapped.map is not None
        cut = {"none": 0, "first half": offset + nbytes // 2, "most of the second half": offset + nbytes - 7}[keep]
        os.ftruncate(pool.segment.fd, cut)
        before = transports.reader.splits
        with pytest.raises(SegmentTooSmall, match=pool.name):
            f.materialize()
        assert transports.reader.splits == before + 1
        f.release(unlink=True)
        os.posix_fallocate(pool.segment.fd, 0, pool.size)  # the owner grows it back, same inode and size
        pool.free(offset, nbytes)
        data = noise(nbytes, 8)
        offset = pool.put(data)
        g = transports.open(shm_item(pool.name, nbytes, offset, pooled=True), "r")
        assert g._lease.handle is mapped
        assert digest(g.materialize()) == digest(data)
        g.release(unlink=True)
    finally:
        pool.close()


def test_the_helper_holds_no_buffer_once_a_read_is_over(tmp_path):
    """Outside attack: after 1 GiB features a rank stayed 1 GiB larger while idle, the helper
    still holding its last half (and, after a short read, the error's frames held it too)."""
    import gc
    import weakref

    import numpy as np

    reader = Reader()
    path = tmp_path / "segment"
    path.write_bytes(os.urandom(2 * SPLIT))
    fd = os.open(path, os.O_RDONLY)
    try:
        for size in (2 * SPLIT, 3 * SPLIT):  # the second is short in the helper's half
            dst = np.empty(size, dtype=np.uint8)
            gone = weakref.ref(dst)
            try:
                reader.read(fd, dst, 0, "segment")
            except SegmentTooSmall:
                assert size == 3 * SPLIT
            else:
                assert size == 2 * SPLIT and dst.tobytes() == path.read_bytes()
            del dst
            gc.collect()
            assert gone() is None, f"a {size} B buffer outlived its read"
    finally:
        os.close(fd)
    assert reader.splits == 2
