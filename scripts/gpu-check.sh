#!/usr/bin/env bash
# One short GPU pass for a machine with CUDA (e.g. the device tool): the GPU tests
# (green contexts, CUDA IPC, NCCL, paged KV) and the decode batching bench on cuda.
# Prints the GPU name first so every figure is recorded against it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]'; PY=.venv/bin/python; }
"$PY" -c "import torch; print('gpu:', torch.cuda.get_device_name(0), 'torch', torch.__version__, 'cuda', torch.version.cuda)"
"$PY" -m pytest -q -rA -s tests/gpu
"$PY" -m pytest -q -rA tests/models/test_engine.py -k cuda
"$PY" bench/decode_batching.py --device cuda --batches 1,16,64 | tail -1
