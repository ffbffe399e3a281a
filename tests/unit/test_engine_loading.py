"""``load_engine``: a spec names a module and a factory; each way it can be wrong is a
ConfigError naming the spec and what failed (no processes: a context of one rank)."""

from __future__ import annotations

import numpy as np
import pytest

from mmsched.engine import EngineContext, EngineRequest, load_engine
from mmsched.engines.reference import ReferenceEngine
from mmsched.errors import ConfigError

CTX = EngineContext(rank=0, world=1, group=None, seed=0, options={"k": 1})


class NoStep:
    def __init__(self, ctx):
        pass


def raising(ctx):
    raise ValueError(f"cannot use options {ctx.options}")


@pytest.mark.parametrize("spec, what", [
    ("no_colon", "is not module:factory"),
    (":Factory", "is not module:factory"),
    ("mmsched_no_such_module:Engine", "cannot import 'mmsched_no_such_module' (ModuleNotFoundError"),
    ("mmsched.engines.reference:NoSuchEngine", "has no attribute 'NoSuchEngine'"),
    ("mmsched.engines.reference:math", "'math' is not callable"),
    (f"{__name__}:raising", "the factory raised ValueError: cannot use options {'k': 1}"),
    (f"{__name__}:NoStep", "returned NoStep, which has no step()"),
])
def test_a_bad_spec_is_a_config_error_naming_it(spec, what):
    with pytest.raises(ConfigError) as info:
        load_engine(spec, CTX)
    assert str(info.value).startswith(f"engine: {spec!r}"), info.value
    assert what in str(info.value), info.value


def test_the_default_spec_builds_the_reference_engine_from_the_context():
    engine = load_engine("mmsched.engines.reference:ReferenceEngine", CTX)
    assert isinstance(engine, ReferenceEngine)
    req = EngineRequest("r", "generate", np.array([1, 2, 3], dtype=np.int64), [], [], 5, {})
    out = engine.step([req])
    assert len(out[0]["output_ids"]) == 5
    again = load_engine("mmsched.engines.reference:ReferenceEngine", CTX).step([req])
    assert again == out, "the same seed gives the same weights"
