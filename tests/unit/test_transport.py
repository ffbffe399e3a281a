"""Feature transports against real /dev/shm segments: round trips, errors kept as data, release."""

from __future__ import annotations

import ast
import fcntl
import logging
import os
import pathlib
import subprocess
import sys
import uuid

import msgpack
import pytest
import torch

import mmsched
from mmsched.errors import InjectedFault
from mmsched.faults import Fault, Faults
from mmsched.producers import create_segment
from mmsched.protocol import DTYPES, Item, Limits, decode, torch_dtype
from mmsched.segments import SegmentTooSmall, shm_path, tensor_bytes
from mmsched.transport.inline import InlineFeature
from mmsched.transport.shm import ShmFeature

NO_FAULTS = Faults([], 0)
LIMITS = Limits()
PREFIX = LIMITS.shm_prefix


@pytest.fixture
def segments():
    """Names created by a test; whatever is still there afterwards is removed."""
    names: list[str] = []
    yield names
    for name in names:
        try:
            os.unlink(shm_path(name))
        except FileNotFoundError:
            pass


def make(segments: list, data, size: int | None = None) -> str:
    seg = create_segment(data, PREFIX, size=size)
    segments.append(seg.name)
    seg.sent()  # drop the producer's lock, as a client does once the request is out
    return seg.name


def shm_item(name: str, dtype: str, shape, offset: int = 0) -> Item:
    """An item exactly as the leader would decode it from a request."""
    header = {"v": 1, "type": "embed", "rid": "t", "input_ids": [1],
              "mm_items": [{"modality": "image", "transport": "shm", "dtype": dtype, "shape": list(shape),
                            "shm_name": name, "offset": offset}]}
    return decode([msgpack.packb(header)], LIMITS).items[0]


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


@pytest.fixture
def mmsched_log():
    """Records logged by mmsched, caught on its own logger (whatever its propagation)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("mmsched")
    handler, old_level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def exclusively_lockable(name: str) -> bool:
    """True when nobody holds a flock on the segment (what the orphan sweep looks at)."""
    fd = os.open(shm_path(name), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("dtype", DTYPES)
def test_shm_round_trip_every_dtype(segments, dtype):
    t = sample(torch_dtype(dtype))
    name = make(segments, t)
    f = ShmFeature(shm_item(name, dtype, t.shape), "r", NO_FAULTS)
    assert f.error is None
    out = f.materialize()
    f.release(unlink=True)
    assert out.dtype == t.dtype and tuple(out.shape) == tuple(t.shape)
    assert torch.equal(out, t)
    assert not os.path.exists(shm_path(name))


@pytest.mark.parametrize("shape", [(0, 3), (0,), (4, 0, 2)])
def test_shm_empty_shape(segments, shape):
    t = torch.empty(shape, dtype=torch.float32)
    name = make(segments, t)
    assert os.path.getsize(shm_path(name)) == 0
    f = ShmFeature(shm_item(name, "float32", shape), "r", NO_FAULTS)
    out = f.materialize()
    f.release(unlink=True)
    assert tuple(out.shape) == shape and out.numel() == 0
    assert not os.path.exists(shm_path(name))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
def test_shm_non_contiguous_source(segments, dtype):
    base = sample(torch_dtype(dtype), (4, 6))
    t = base.t()  # a transposed view: not contiguous
    assert not t.is_contiguous()
    name = make(segments, t)
    f = ShmFeature(shm_item(name, dtype, t.shape), "r", NO_FAULTS)
    out = f.materialize()
    f.release(unlink=True)
    assert tuple(out.shape) == (6, 4)
    assert torch.equal(out, t)
    assert out.is_contiguous()


def test_shm_offset_inside_a_bigger_segment(segments):
    a = sample(torch.float32, (3, 5))
    b = sample(torch.int16, (7,)) + 3
    blob = bytes(tensor_bytes(a)) + bytes(tensor_bytes(b))
    name = make(segments, blob, size=len(blob) + 100)  # room to spare after the second item
    fa = ShmFeature(shm_item(name, "float32", a.shape), "r", NO_FAULTS)
    fb = ShmFeature(shm_item(name, "int16", b.shape, offset=a.numel() * 4), "r", NO_FAULTS)
    assert fa.error is None and fb.error is None
    assert torch.equal(fa.materialize(), a)
    assert torch.equal(fb.materialize(), b)
    fa.release(unlink=False)
    fb.release(unlink=True)
    assert not os.path.exists(shm_path(name))


def test_materialized_tensor_is_owned(segments):
    """The bytes are copied out: rewriting (or removing) the segment later changes nothing."""
    t = torch.arange(16, dtype=torch.int32)
    name = make(segments, t)
    f = ShmFeature(shm_item(name, "int32", t.shape), "r", NO_FAULTS)
    out = f.materialize()
    f.release(unlink=True)
    with open(shm_path(name), "wb") as fh:  # a new segment of the same name, other bytes
        fh.write(bytes(64))
    assert torch.equal(out, t)


# ---------------------------------------------------------------- errors are data

def test_missing_segment_error_kept_until_materialize(mmsched_log):
    name = f"{PREFIX}absent_{uuid.uuid4().hex}"
    f = ShmFeature(shm_item(name, "float32", (4,)), "r", NO_FAULTS)  # must not raise
    assert isinstance(f.error, FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        f.materialize()
    f.release(unlink=True)  # never raises; a segment that never existed is not worth a warning
    f.release(unlink=True)
    assert not [r for r in mmsched_log if r.levelno >= logging.WARNING]
    assert not os.path.exists(shm_path(name))


def test_segment_too_small(segments):
    name = make(segments, bytes(16))
    f = ShmFeature(shm_item(name, "float32", (8,)), "r", NO_FAULTS)  # needs 32 bytes
    assert isinstance(f.error, SegmentTooSmall)
    with pytest.raises(SegmentTooSmall):
        f.materialize()
    f.release(unlink=True)
    assert not os.path.exists(shm_path(name))


def test_offset_past_the_end_is_too_small(segments):
    name = make(segments, bytes(32))
    assert ShmFeature(shm_item(name, "float32", (8,)), "r", NO_FAULTS).error is None
    f = ShmFeature(shm_item(name, "float32", (8,), offset=4), "r", NO_FAULTS)
    assert isinstance(f.error, SegmentTooSmall)
    f.release(unlink=False)
    f = ShmFeature(shm_item(name, "uint8", (1,), offset=2**62), "r", NO_FAULTS)
    assert isinstance(f.error, SegmentTooSmall)
    f.release(unlink=False)
    assert os.path.exists(shm_path(name))


@pytest.mark.parametrize("new_size", [0, 8, 31])
def test_segment_truncated_between_open_and_materialize(segments, new_size):
    t = sample(torch.float32, (8,))
    name = make(segments, t)
    f = ShmFeature(shm_item(name, "float32", t.shape), "r", NO_FAULTS)
    assert f.error is None
    os.truncate(shm_path(name), new_size)
    with pytest.raises(SegmentTooSmall):
        f.materialize()
    f.release(unlink=True)
    assert not os.path.exists(shm_path(name))


def test_materialize_fault_is_raised_by_materialize_only(segments):
    name = make(segments, bytes(8))
    faults = Faults([Fault.parse("0:materialize:boom-*")], 0)
    ok = ShmFeature(shm_item(name, "uint8", (8,)), "fine", faults)
    assert ok.materialize().numel() == 8
    ok.release(unlink=False)
    f = ShmFeature(shm_item(name, "uint8", (8,)), "boom-1", faults)
    assert f.error is None
    with pytest.raises(InjectedFault):
        f.materialize()
    f.release(unlink=True)
    assert not os.path.exists(shm_path(name))


# ---------------------------------------------------------------- release

def test_release_unlinks_exactly_once(segments):
    name = make(segments, bytes(8))
    f = ShmFeature(shm_item(name, "uint8", (8,)), "r", NO_FAULTS)
    f.release(unlink=True)
    assert not os.path.exists(shm_path(name))
    # someone creates a new segment of the same name: a second release must not touch it
    with open(shm_path(name), "wb") as fh:
        fh.write(b"new")
    f.release(unlink=True)
    f.release(unlink=False)
    assert os.path.exists(shm_path(name))


def test_release_without_unlink_leaves_segment_and_drops_lock(segments):
    name = make(segments, bytes(8))
    assert exclusively_lockable(name)
    f = ShmFeature(shm_item(name, "uint8", (8,)), "r", NO_FAULTS)
    assert not exclusively_lockable(name), "an open feature holds a shared lock (sweep must skip it)"
    f.materialize()
    f.release(unlink=False)
    assert os.path.exists(shm_path(name))
    assert exclusively_lockable(name)
    f.release(unlink=True)  # already released: idempotent, does not unlink now
    assert os.path.exists(shm_path(name))


def test_release_fault_never_raises_and_still_cleans_up(segments, mmsched_log):
    name = make(segments, bytes(8))
    faults = Faults([Fault.parse("0:release:*")], 0)
    f = ShmFeature(shm_item(name, "uint8", (8,)), "r", faults)
    f.materialize()
    f.release(unlink=True)
    f.release(unlink=True)
    assert not os.path.exists(shm_path(name))
    assert [r.getMessage() for r in mmsched_log].count("release_failed") == 1


def test_release_of_an_already_removed_segment_never_raises(segments):
    name = make(segments, bytes(8))
    f = ShmFeature(shm_item(name, "uint8", (8,)), "r", NO_FAULTS)
    os.unlink(shm_path(name))  # removed behind our back
    assert f.materialize().numel() == 8  # the open descriptor still reads it
    f.release(unlink=True)
    assert not os.path.exists(shm_path(name))


# ---------------------------------------------------------------- inline

def inline_item(t: torch.Tensor, dtype: str) -> Item:
    payload = bytes(tensor_bytes(t))
    header = {"v": 1, "type": "embed", "rid": "t", "input_ids": [1],
              "mm_items": [{"modality": "audio", "transport": "inline", "dtype": dtype,
                            "shape": list(t.shape), "frame": 1}]}
    return decode([msgpack.packb(header), payload], LIMITS).items[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool", "int64"])
def test_inline_round_trip(dtype):
    t = sample(torch_dtype(dtype), (5, 3)).t()
    f = InlineFeature(inline_item(t, dtype), "r", NO_FAULTS)
    assert f.error is None
    out = f.materialize()
    assert out.dtype == t.dtype and torch.equal(out, t)
    f.release(unlink=True)
    f.release(unlink=True)
    assert f.item.payload is None


def test_inline_empty():
    f = InlineFeature(inline_item(torch.empty(0, 3), "float32"), "r", NO_FAULTS)
    assert tuple(f.materialize().shape) == (0, 3)


def test_inline_materialized_tensor_is_owned():
    buf = bytearray(bytes(tensor_bytes(torch.arange(4, dtype=torch.int32))))
    item = Item(index=0, modality="other", transport="inline", dtype="int32", shape=(4,), nbytes=16,
                payload=memoryview(buf))
    out = InlineFeature(item, "r", NO_FAULTS).materialize()
    buf[:] = bytes(16)  # zmq may reuse the frame's buffer after release
    assert out.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("length", [15, 17, 0])
def test_inline_length_check(length):
    item = Item(index=0, modality="other", transport="inline", dtype="int32", shape=(4,), nbytes=16,
                payload=memoryview(bytes(length)))
    f = InlineFeature(item, "r", NO_FAULTS)  # must not raise
    assert isinstance(f.error, ValueError)
    with pytest.raises(ValueError):
        f.materialize()
    f.release(unlink=True)


# ---------------------------------------------------------------- the producer side

def test_segment_discard(segments):
    t = torch.ones(4)
    seg = create_segment(t, PREFIX)
    segments.append(seg.name)
    assert seg.name.startswith(f"{PREFIX}{os.getpid()}_")
    assert os.path.getsize(shm_path(seg.name)) == 16
    assert not exclusively_lockable(seg.name), "the creator holds a lock until the segment is sent"
    seg.discard()
    assert not os.path.exists(shm_path(seg.name))
    seg.discard()  # twice: nothing to do, no error


def test_segment_sent_drops_lock_keeps_segment(segments):
    seg = create_segment(b"abcd", PREFIX)
    segments.append(seg.name)
    seg.sent()
    seg.sent()
    assert exclusively_lockable(seg.name)
    with open(shm_path(seg.name), "rb") as fh:
        assert fh.read() == b"abcd"


def test_segment_names_are_unique(segments):
    names = set()
    for _ in range(20):
        seg = create_segment(b"x", PREFIX)
        segments.append(seg.name)
        names.add(seg.name)
        seg.discard()
    assert len(names) == 20


# ---------------------------------------------------------------- no resource_tracker

def test_no_multiprocessing_shared_memory_in_mmsched():
    """Attaching must never go through multiprocessing.shared_memory / resource_tracker."""
    root = pathlib.Path(mmsched.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            for n in names:
                if "shared_memory" in n or "resource_tracker" in n or n == "SharedMemory":
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}: {n}")
    assert not offenders, offenders


def test_attach_in_a_process_never_registers_the_segment(segments):
    """A consumer process that attaches and exits leaves the segment alone and prints no warning."""
    t = torch.arange(64, dtype=torch.float32)
    name = make(segments, t)
    code = f"""
import sys, msgpack, torch
import multiprocessing.resource_tracker as rt
from mmsched.faults import Faults
from mmsched.protocol import Limits, decode
from mmsched.transport.shm import ShmFeature
h = {{"v": 1, "type": "embed", "rid": "t", "input_ids": [1], "mm_items": [{{"modality": "image",
     "transport": "shm", "dtype": "float32", "shape": [64], "shm_name": {name!r}}}]}}
item = decode([msgpack.packb(h)], Limits()).items[0]
f = ShmFeature(item, "t", Faults([], 0))
assert torch.equal(f.materialize(), torch.arange(64, dtype=torch.float32))
f.release(unlink=False)
assert "multiprocessing.shared_memory" not in sys.modules
assert rt._resource_tracker._pid is None, "resource_tracker was started"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert "resource_tracker" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr
    assert os.path.exists(shm_path(name)), "the consumer's exit removed the segment"
