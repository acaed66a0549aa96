#!/usr/bin/env bash
# One device call for issue 21's batch-1 decode (at most ~6 min: the timeouts below): the fusions'
# GPU tests, then bench/decode_bs1_gpu.py (graph tok/s with the small-batch fusions off / router / moe / kv_norm / on, per-layer
# kernels and time, the weight-read floor). Run from the repository root:
#   bash bench/decode_bs1_session.sh        (files under $OUT: gpu.txt, tests.log, bs1.log, bs1.json)
REPO=$(pwd)
# shellcheck source=bench/gpu_setup.sh
source bench/gpu_setup.sh
(cd /tmp && timeout "${TEST_TIMEOUT:-140}" python3 -m pytest -q -p no:cacheprovider -rs --durations=8 \
    "$REPO/tests/model/kernels/test_small_batch_fusions.py" "$REPO/tests/model/kernels/test_kernels.py" \
    "$REPO/tests/model/test_norm_rope_triton.py" \
    -k "small_batch or fusions or (fused_moe_gpu and v2lite) or tiny_model_triton_backends_match or rope_and_cache" \
    2>&1) | tee "$OUT/tests.log"
timeout "${BENCH_TIMEOUT:-200}" python3 bench/decode_bs1_gpu.py --out "$OUT/bs1.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bs1.log"
