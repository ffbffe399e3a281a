"""A full /dev/shm: ``create_segment`` raises ShmFull (pages are reserved up front, so it is
an error at create time, never a SIGBUS later) and leaves nothing behind; the client then
sends the feature inline and says so in its log.

The real /dev/shm cannot be filled here; a 1 MiB tmpfs mounted for the test stands in for
it (``SHM_DIR`` pointed at it). Needs permission to mount: skipped otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess

import pytest
import torch

from mmsched import segments
from mmsched.client import Client, inline, shm
from mmsched.errors import ShmFull
from mmsched.producers.features import Held
from mmsched.producers import create_segment

SIZE = 1 << 20


@pytest.fixture
def full_shm(tmp_path, monkeypatch):
    """A 1 MiB tmpfs as the segment directory; yields its path."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mnt)],
                           capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, PermissionError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    monkeypatch.setattr(segments, "SHM_DIR", str(mnt))
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@pytest.fixture
def client_warnings():
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    lg, h = logging.getLogger("mmsched.client"), Keep(logging.WARNING)
    lg.addHandler(h)
    try:
        yield messages
    finally:
        lg.removeHandler(h)


def test_a_segment_bigger_than_the_free_space_is_shm_full_and_leaves_nothing(full_shm):
    with pytest.raises(ShmFull, match=str(full_shm)):
        create_segment(torch.zeros(2 * SIZE, dtype=torch.uint8))
    assert os.listdir(full_shm) == []


def test_what_is_left_counts_not_the_total(full_shm):
    first = create_segment(torch.ones(SIZE * 3 // 4, dtype=torch.uint8))
    try:
        assert os.listdir(full_shm) == [first.name]
        with pytest.raises(ShmFull):
            create_segment(b"x" * (SIZE // 2))  # would fit an empty /dev/shm, not this one
        assert os.listdir(full_shm) == [first.name]
        small = create_segment(b"y" * 4096)  # what does fit is still created
        small.discard()
    finally:
        first.discard()
    assert os.listdir(full_shm) == []


async def test_the_client_falls_back_to_inline_and_logs_it(full_shm, client_warnings):
    t = torch.arange(SIZE // 2, dtype=torch.float32)  # 2 MiB: cannot fit
    frames, held = [], Held()  # what Client.send_request builds: no connection needed
    item = held.item(shm(t, id="big"), frames)
    segments = held.segments
    assert item["transport"] == "inline" and item["frame"] == 1
    assert (item["dtype"], item["shape"], item["id"]) == ("float32", [SIZE // 2], "big")
    assert bytes(frames[0]) == t.numpy().tobytes()
    assert segments == [] and os.listdir(full_shm) == []
    assert len(client_warnings) == 1 and client_warnings[0].startswith("shm_full falling_back=inline"), client_warnings
    assert f"nbytes={SIZE * 2}" in client_warnings[0]


async def test_a_request_still_succeeds_when_shm_is_full(full_shm, client_warnings, shared_server):
    big = torch.randn(SIZE // 2, generator=torch.Generator().manual_seed(1))
    async with Client(shared_server.addr) as c:
        r = await c.embed([1, 2, 3], [shm(big)], want_digest=True, timeout=60)
        same = await c.embed([1, 2, 3], [inline(big)], timeout=60)
    assert r.status == 200, r.message
    assert r.meta["digests"] == [hashlib.sha256(big.numpy().tobytes()).hexdigest()]
    assert torch.equal(r.embedding, same.embedding)
    assert any(m.startswith("shm_full falling_back=inline") for m in client_warnings)
    assert os.listdir(full_shm) == []


def test_a_batch_ring_that_does_not_fit_fails_the_start_and_leaves_nothing(full_shm):
    """The ring's pages are reserved when the group starts: a /dev/shm without room for it is
    an error then (the group does not start), never a SIGBUS when a big batch first reaches
    a page of it."""
    from mmsched.ring import Ring

    with pytest.raises(OSError) as exc:
        Ring.create("mmsched_test_ring", readers=1, timeout_s=1.0)
    assert exc.value.errno == 28  # ENOSPC
    assert os.listdir(full_shm) == []


def test_an_engine_gather_segment_that_does_not_fit_fails_the_start_and_leaves_nothing(full_shm):
    """The same for the engine's same-host all-gather (``mmsched.exchange``): reserved at the
    start, where a full /dev/shm is a clear error, and unlinked then."""
    from mmsched import exchange
    from mmsched.ring import reserve

    with pytest.raises(OSError) as exc:
        reserve("mmsched_test_gather", exchange.segment_bytes(2), lambda fd: fd)
    assert exc.value.errno == 28  # ENOSPC
    assert os.listdir(full_shm) == []
