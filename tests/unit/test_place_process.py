"""How a rank runs (``server.place_process``): what it turns off in torch before its groups start."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CODE = textwrap.dedent("""
    import datetime, pickle, socket, torch, torch.distributed as dist
    import torch._C._distributed_c10d as c10d
    from mmsched.config import Config
    from mmsched.server import place_process
    place_process(Config(cpu_affinity="off"), 1, {})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=30))
    t = torch.zeros(4)
    for _ in range(5):
        dist.all_reduce(t)
    print(len(pickle.loads(c10d._dump_fr_trace()).get("entries", [])))
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("preset, entries", [(None, 0), ("16", 5)])
def test_the_flight_recorder_is_off_unless_the_operator_asks_for_it(preset, entries):
    """torch records every collective with a Python traceback (a few us of the lane's CPU at
    every batch) for dumps mmsched never takes: a rank turns that off, and an operator who
    set TORCH_FR_BUFFER_SIZE keeps their setting."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    if preset is not None:
        env["TORCH_FR_BUFFER_SIZE"] = preset
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == entries, out.stdout
