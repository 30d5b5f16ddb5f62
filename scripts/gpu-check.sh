#!/usr/bin/env bash
# The prepared GPU run, for the device tool: no package registry there, so the wheels its image
# lacks come in dist/gpu-bundle (scripts/build_gpu_bundle.py; carry it) and are installed into
# .gpu-site; the project itself is imported from this tree. Then every section of
# scripts/gpu_check.py runs; the JSON lands in $OUT/gpu-check.json (and on the last line).
#   device run: command "bash scripts/gpu-check.sh", carry ["dist/gpu-bundle"], timeout_s 540
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
BUNDLE=${BUNDLE:-dist/gpu-bundle}
SITE=$PWD/.gpu-site
export OUT=${OUT:-$PWD/runs} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if ls "$BUNDLE"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$BUNDLE"/*.whl || echo "bundle install failed" >&2
fi
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import torch, transformers, easerve; print('gpu:', torch.cuda.get_device_name(0), 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tee "$OUT/preflight.txt"
exec "$PY" scripts/gpu_check.py "$@"
