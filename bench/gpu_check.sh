#!/usr/bin/env bash
# On a machine with a GPU: the CUDA IPC tests and a transfer-bandwidth figure, in under 5 minutes.
# Usage: bash bench/gpu_check.sh   (from the repo root; creates .venv with `make install` if needed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || make install
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device (is this a CPU build of torch?)'; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_cuda.py tests/unit/test_ipc_pool.py
timeout 90 "$PY" bench/cuda_ipc.py --json "${OUT:-/tmp}/cuda_ipc.json"
