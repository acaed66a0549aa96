#!/usr/bin/env bash
# One device call: the CUDA smoke test, then bench/model_gpu.py (torch backends vs HF on the
# V2-Lite shape); everything lands under $OUT. PARTS=smoke,v2lite selects the bench parts.
source "$(dirname "$0")/gpu_setup.sh"
(cd /tmp && python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/model/test_gpu_smoke.py" "$@" 2>&1) | tee "$OUT/gpu_tests.log"
python3 bench/model_gpu.py --out "$OUT/model_gpu.json" --parts "${PARTS:-smoke,v2lite}" 2>&1 | tee "$OUT/model_gpu.log"
