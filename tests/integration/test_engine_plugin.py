"""An engine from outside the package, loaded by ``--engine``, serving at tp = 2 (real
ranks): examples/echo_engine.py, the example of docs/engines.md. Also what a spec that
cannot be used does at start: exit 2, the spec named."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest
import torch

from mmsched.client import Client, inline, shm

from ..conftest import Server
from .lifecycle import expect, feature, hold_lane, my_segments, no_extra_results, sha256_of

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    with Server("--tp", "2", "--engine", "echo_engine:EchoEngine", "--engine-options", "{prefix = [7, 7]}",
                "--fault", "1:stall:hold-*", "--stall-s", "1",
                tmp_dir=str(tmp_path_factory.mktemp("echo")), env={"PYTHONPATH": EXAMPLES}) as srv:
        yield srv


def byte_sum(*ts: torch.Tensor) -> int:
    return sum(int(t.contiguous().reshape(-1).view(torch.uint8).sum(dtype=torch.int64)) for t in ts)


async def test_the_echo_engine_serves_a_batch_and_one_rank_fails_one_request(echo):
    t = uuid.uuid4().hex[:6]
    x, y, z = feature(1), feature(2, (5, 3)), feature(3, (16,))
    async with Client(echo.addr) as c:
        hold = await hold_lane(c, f"hold-{t}")  # what follows waits in the queue: one batch
        sent = {
            f"a-{t}": ([1, 2, 3], [shm(x), inline(y, "audio")], {}),
            f"b-{t}": ([4, 5], [shm(z)], {"fail_on_rank": 1}),
            f"c-{t}": ([6], [], {}),
        }
        futs = {rid: c.send_request("generate", ids, feats, rid=rid, want_digest=True,
                                    params={"max_new_tokens": 4, **params})
                for rid, (ids, feats, params) in sent.items()}
        expect(await c.wait(f"hold-{t}", hold, 60), 200)
        rs = {rid: await c.wait(rid, fut, 60) for rid, fut in futs.items()}
        await no_extra_results(c)
    a = expect(rs[f"a-{t}"], 200)
    assert a.output == {"output_ids": [7, 7, 1, 2], "byte_sum": byte_sum(x, y), "modalities": ["image", "audio"]}
    assert a.meta == {"ranks": 2, "digests": [sha256_of(x), sha256_of(y)]}
    b = expect(rs[f"b-{t}"], 500, err_type="InternalServerError")
    assert b.message == "Engine step failed (rank 1: ValueError: this request fails on rank 1)", b.message
    assert b.meta == {"failed_ranks": [1], "stage": "engine"}
    c_ = expect(rs[f"c-{t}"], 200)
    assert c_.output["output_ids"] == [7, 7, 6] and c_.output["byte_sum"] == 0
    assert my_segments() == set()


def mmsched(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MMSCHED_")}
    return subprocess.run([sys.executable, "-m", "mmsched", *args], env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("spec, what", [
    ("echo_engine:NoSuchEngine", "has no attribute 'NoSuchEngine'"),
    # the other two (slow): the same exit path; tests/unit/test_engine_loading.py checks every message
    pytest.param("no_such_engine_module:Engine", "cannot import 'no_such_engine_module'", marks=pytest.mark.slow),
    pytest.param("json:loads", "the factory raised TypeError", marks=pytest.mark.slow),  # a factory that raises
])
def test_a_spec_that_cannot_be_used_exits_2_naming_it(spec, what, tmp_path):
    proc = mmsched("serve", "--frontend", f"ipc://{tmp_path}/s.sock", "--engine", spec,
                   env={"PYTHONPATH": EXAMPLES})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"engine: '{spec}'" in proc.stdout + proc.stderr and what in proc.stdout + proc.stderr, proc.stderr
