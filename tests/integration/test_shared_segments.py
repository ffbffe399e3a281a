"""A segment two requests name: each passes ownership to mmsched, and the segment goes once,
when the last of them is done with it. Found by an outside attack on a tp=2 group: a
request refused or aborted while another queued request named its segment (a retry with the
same rid, a malformed request, an abort, another connection's bad request) unlinked it, and
the queued request failed with a 500; so did the second of two good requests in different
batches. Each case checks the good request's 200 carries the digest of the bytes the client
wrote, and that the segment is gone afterwards (unlinked exactly once: nothing left)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid

import pytest

from mmsched.client import Client, raw
from mmsched.producers import create_segment

from ..conftest import Server
from .lifecycle import expect, no_extra_results

STALL_S = 2


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    # rank 1 stalls before the engine collective on hold-*, and dwells materializing dwell-*
    # (its leader waits in the consensus): what is sent meanwhile queues
    with Server("--tp", "2", "--fault", "1:stall:hold-*", "--fault", "1:hold:dwell-*", "--stall-s", str(STALL_S),
                tmp_dir=str(tmp_path_factory.mktemp("shared"))) as srv:
        yield srv


def segment() -> tuple[dict, object, str]:
    """A sent segment, the item naming it, and the SHA-256 of its bytes."""
    data = os.urandom(4096)
    seg = create_segment(data)
    seg.sent()
    item = {"modality": "image", "transport": "shm", "dtype": "uint8", "shape": [len(data)], "shm_name": seg.name}
    return item, seg, hashlib.sha256(data).hexdigest()


def gone(seg) -> bool:
    return not os.path.exists(os.path.join("/dev/shm", seg.name))


def request(c: Client, rid: str, items: list, **kw) -> asyncio.Future:
    return c.send_request("embed", [1, 2], [raw(it) for it in items], rid=rid, want_digest=True, **kw)


def malformed(c: Client, rid: str, item: dict) -> asyncio.Future:
    header = {"v": 1, "type": "embed", "rid": rid, "input_ids": [1],
              "mm_items": [item, {"modality": "image", "transport": "bogus"}]}
    return c.send_raw(header, rid=rid)


@pytest.mark.parametrize("other", ["same_rid", "malformed", "aborted", "other_connection"])
async def test_a_refused_or_aborted_request_leaves_a_queued_requests_segment_alone(group, other):
    t = uuid.uuid4().hex[:6]
    item, seg, digest = segment()
    try:
        async with Client(group.addr) as c, Client(group.addr) as stranger:
            hold = request(c, f"hold-{t}", [])
            await asyncio.sleep(0.5)  # on the lane: what follows queues
            queued = request(c, f"q-{t}", [item])
            await asyncio.sleep(0.1)
            if other == "same_rid":  # a retry while the first is queued: a 400, not its segment
                with pytest.raises(ValueError):  # our client refuses it; send it as a raw client would
                    request(c, f"q-{t}", [item])
                c._results.pop(f"q-{t}")
                retry = c.send_raw({"v": 1, "type": "embed", "rid": f"q-{t}", "input_ids": [1],
                                    "mm_items": [item]}, rid=f"q-{t}")
                expect(await c.wait(f"q-{t}", retry, 30), 400)
                c._results[f"q-{t}"] = queued
            elif other == "malformed":
                expect(await c.wait(f"bad-{t}", malformed(c, f"bad-{t}", item), 30), 400)
            elif other == "aborted":
                second = request(c, f"second-{t}", [item])
                await asyncio.sleep(0.1)
                await c.abort(f"second-{t}")
                expect(await c.wait(f"second-{t}", second, 30), 499)
            else:
                expect(await stranger.wait(f"bad-{t}", malformed(stranger, f"bad-{t}", item), 30), 400)
            assert not gone(seg), f"{other}: the queued request's segment was unlinked under it"
            expect(await c.wait(f"hold-{t}", hold, 30), 200)
            r = expect(await c.wait(f"q-{t}", queued, 30), 200)
            assert r.meta["digests"] == [digest]
            await no_extra_results(c)
        assert gone(seg), "unlinked once its last request was done"
    finally:
        seg.discard()


async def test_two_good_requests_in_different_batches_both_read_the_segment(group):
    """The second is queued while the first's batch is still reading the segment (a client
    that names a segment again only after mmsched took it has given it up: a 500 then)."""
    t = uuid.uuid4().hex[:6]
    item, seg, digest = segment()
    try:
        async with Client(group.addr) as c:
            first = request(c, f"dwell-first-{t}", [item])  # runs now, its consensus held up
            await asyncio.sleep(0.5)
            second = request(c, f"second-{t}", [item])      # queued: the next batch
            a = expect(await c.wait(f"dwell-first-{t}", first, 30), 200)
            b = expect(await c.wait(f"second-{t}", second, 30), 200)
            assert a.meta["digests"] == b.meta["digests"] == [digest]
            await no_extra_results(c)
        assert gone(seg)
    finally:
        seg.discard()
