"""The docs say what the server does: every metric name they mention is on /metrics, and the
fields protocol.md gives the pong and each result are the ones a real tp=2 group sends.

Parsed from the docs themselves, so a renamed metric or a new result field fails here
until the docs follow (issue 17 item 10).
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import msgpack
import torch
import zmq

from mmsched.client import Client, shm

from .lifecycle import sha256_of
from .test_operations import free_port, http_get

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", *sorted((ROOT / "configs").glob("*.toml"))]
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")


def metric_names_in_docs() -> dict[str, list[str]]:
    """``mmsched_…`` words (not segment names, not test names) → the files naming them."""
    found: dict[str, list[str]] = {}
    for path in DOCS:
        for name in re.findall(r"(?<![\w/.-])(mmsched_[a-z][a-z0-9_]*[a-z])(?![\w.-]*/)", path.read_text("utf-8")):
            found.setdefault(name, []).append(path.name)
    return found


def keys_of(line_start: str) -> set[str]:
    """The keys of the one-line JSON shape protocol.md gives for a message type."""
    m = re.search(r'^`(\{"v": 1, "type": "' + line_start + r'".*\})`', PROTOCOL, re.M)
    assert m, f'protocol.md has no `{{"v": 1, "type": "{line_start}", ...}}` line'
    return set(re.findall(r'"(\w+)":', m.group(1)))


def meta_of_500(message_start: str) -> dict[str, str | None]:
    """The meta keys (and documented ``stage``) of the 500 row whose message starts so."""
    for row in re.findall(r"^\| (?!cause)(.*)\|$", PROTOCOL.split("### 500 messages", 1)[1].split("###", 1)[0], re.M):
        cells = [c.strip() for c in row.split("|")]
        if len(cells) >= 3 and cells[1].startswith(f"`{message_start}"):
            keys = set(re.findall(r"`(\w+)(?::[^`]*)?`", cells[2]))
            stage = re.search(r'`stage: "(\w+)"`', cells[2])
            return {"keys": keys, "stage": stage.group(1) if stage else None}
    raise AssertionError(f"protocol.md's 500 table has no row for {message_start!r}")


def raw_result(addr: str) -> dict:
    """One text-only embed over a bare DEALER: the result header as sent, every key."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(addr)
        s.send(msgpack.packb({"v": 1, "type": "embed", "rid": "raw-1", "input_ids": [1, 2]}))
        assert s.poll(30_000), "no result within 30 s"
        return msgpack.unpackb(s.recv(), raw=False)
    finally:
        s.close(linger=0)


def test_every_metric_the_docs_name_is_served_and_every_field_they_give_is_sent(start_server):
    port = free_port()
    srv = start_server("--tp", "2", "--admin", str(port), "--fault", "1:materialize:mat-*",
                       "--fault", "1:engine:eng-*", "--fault", "0:hold:hold-*", "--stall-s", "3",
                       "--collective-timeout", "30")
    image = torch.arange(64, dtype=torch.float32)

    async def drive():
        async with Client(srv.addr) as c:
            pong = await c.ping(timeout=20)
            header = await asyncio.get_running_loop().run_in_executor(None, raw_result, srv.addr)
            ok = await c.embed([1, 2], [shm(image)], want_digest=True)
            mat = await c.embed([1, 2], [shm(image)], rid="mat-1")
            eng = await c.embed([3], [], rid="eng-1")
            metrics = http_get(port, "/metrics")[1]
            hold = c.send_request("embed", [4], [shm(image)], rid="hold-1")
            await asyncio.sleep(1.0)  # rank 0 now holds hold-1 before the consensus
            os.kill(srv.rank_pids()[1], 9)
            broken = await c.wait("hold-1", hold, 60)
            return pong, header, ok, mat, eng, metrics, broken

    pong, header, ok, mat, eng, metrics, broken = asyncio.run(drive())

    # every metric name in the docs exists
    served = set(re.findall(r"^(?:# TYPE )?(mmsched_\w+)", metrics, re.M))  # as written on /metrics
    missing = {n: files for n, files in metric_names_in_docs().items() if n not in served}
    assert not missing, f"the docs name metrics /metrics does not serve: {missing}"

    # the pong and the result carry exactly the documented fields
    assert set(pong) == keys_of("pong"), (sorted(pong), sorted(keys_of("pong")))
    assert ok.status == 200, ok
    assert set(header) == keys_of("result"), (sorted(header), sorted(keys_of("result")))
    row_200 = PROTOCOL.split("| 200 | nil |", 1)[1].split("\n", 1)[0]
    assert set(ok.meta) == set(re.findall(r"`meta\.(\w+)`", row_200)), ok.meta
    assert ok.meta["digests"] == [sha256_of(image)]

    # each 500 carries the meta its protocol.md row gives
    for res, start in ((mat, "Multimodal feature reconstruction failed"), (eng, "Engine step failed"),
                       (broken, "rank group broken")):
        doc = meta_of_500(start)
        assert res.status == 500 and res.message.startswith(start), (res.status, res.message)
        assert set(res.meta) == doc["keys"], (start, res.meta, doc)
        assert res.meta["stage"] == doc["stage"], (start, res.meta, doc)
    assert broken.meta["failed_ranks"] == [0, 1]
