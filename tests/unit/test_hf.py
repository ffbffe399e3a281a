"""The HF engine at tp=1, in process: seeded weights from configs/hf-tiny, the same tokens
from a directory of saved weights (``from_pretrained``), and refusals as per-request errors.
(tp=2 against tp=1 runs through real groups in tests/integration/test_worker.py.)"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from mmsched.engine import EngineContext, EngineRequest  # noqa: E402
from mmsched.engines.hf import SHIPPED, HFEngine  # noqa: E402

IMAGE = 4  # <image> in configs/hf-tiny


def request(rid="r", type="generate", images=1, n=6, pixels=None):
    ids = np.array([1] + [IMAGE] * 16 * images + [40, 41, 42], dtype=np.int64)
    if pixels is None:
        pixels = [torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(images)]
    return EngineRequest(rid, type, ids, pixels, ["image"] * len(pixels), n, {})


def tokens(engine, *reqs) -> list[list[int]]:
    return [out["output_ids"] for out in engine.step(list(reqs))]


@pytest.fixture(scope="module")
def engine():
    return HFEngine(EngineContext(0, 1, None, 0, {}))


def test_generate_is_greedy_and_repeatable_and_embed_is_a_unit_vector(engine):
    a, b, e = engine.step([request(), request(), request(type="embed")])
    assert a["output_ids"] == b["output_ids"] and 1 <= len(a["output_ids"]) <= 6 and a["engine_s"] > 0
    v = np.frombuffer(e["embedding"], dtype="<f4")
    assert e["dim"] == v.size == 64 and abs(float(v @ v) - 1) < 1e-4


def test_the_image_changes_the_answer(engine):
    one, other = tokens(engine, request(n=8), request(n=8, pixels=[torch.full((1, 3, 32, 32), -2.0)]))
    assert one != other


def test_saved_weights_load_through_from_pretrained_with_the_same_tokens(engine, tmp_path):
    engine.model.save_pretrained(tmp_path)
    shutil.copy(SHIPPED / "tokenizer.json", tmp_path)
    loaded = HFEngine(EngineContext(0, 1, None, 0, {"model": str(tmp_path)}))
    assert any(p.suffix == ".safetensors" for p in tmp_path.iterdir())
    assert tokens(loaded, request(n=8)) == tokens(engine, request(n=8))
    reseeded = HFEngine(EngineContext(0, 1, None, 1, {}))
    assert tokens(reseeded, request(n=8)) != tokens(engine, request(n=8))


def test_bad_requests_fail_alone(engine):
    wrong_count = request(images=2, pixels=[torch.rand(1, 3, 32, 32)])
    wrong_shape = request(pixels=[torch.rand(3, 31, 31)])
    not_pixels = request(pixels=[torch.zeros(3 * 32 * 32, dtype=torch.uint8)])
    out = engine.step([wrong_count, wrong_shape, not_pixels, request()])
    assert "32 image tokens for 1 image(s)" in str(out[0])
    assert all(isinstance(o, ValueError) for o in out[:3]), out
    assert "output_ids" in out[3]


def test_a_request_over_the_models_context_fails_alone_before_running(engine):
    long = request(n=2048 - 20 + 1)  # 1 + 16 + 3 input ids: one token over the context of 2048
    fits = request(n=4)
    out = engine.step([long, fits])
    assert isinstance(out[0], ValueError) and "over the model's context of 2048" in str(out[0]), out[0]
    assert "output_ids" in out[1]


@pytest.mark.parametrize("spec", ["mmsched.engines.nosuch:HFEngine", "mmsched.engines.hf:NoSuch", "no-colon"])
def test_an_engine_spec_that_does_not_load_is_a_config_error_naming_it(spec):
    from mmsched.engine import load_engine
    from mmsched.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(repr(spec))):
        load_engine(spec, EngineContext(0, 1, None, 0, {}))


def test_a_model_directory_without_config_is_a_config_error(tmp_path):
    from mmsched.errors import ConfigError

    with pytest.raises(ConfigError, match="no config.json"):
        HFEngine(EngineContext(0, 1, None, 0, {"model": str(tmp_path)}))
