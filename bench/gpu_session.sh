#!/usr/bin/env bash
# One device call: install the package without deps (the GPU image has torch/triton/transformers),
# run the GPU tests and the model benchmark, leave everything under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
(cd /tmp && python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/model/test_gpu_smoke.py" "$@" 2>&1) | tee "$OUT/gpu_tests.log"
python3 bench/model_gpu.py --out "$OUT/model_gpu.json" --parts "${PARTS:-smoke,v2lite}" 2>&1 | tee "$OUT/model_gpu.log"
