#!/usr/bin/env bash
# One device call (see bench/gpu_setup.sh): the kernel and GPU smoke tests, then
# bench/kernels_gpu.py; everything lands under $OUT.
# PARTS=fp8,fp8moe,small,moe,mla,flash,runner(,e2e) selects bench parts, TESTS the test files, BENCH_ARGS extra bench flags;
# TEST_TIMEOUT / BENCH_TIMEOUT bound each step (seconds).
source "$(dirname "$0")/gpu_setup.sh"
REPO=$PWD
TESTS=${TESTS:-tests/model/kernels/test_kernels.py tests/model/kernels/test_fp8_kernels.py tests/model/quant/test_fp8_weights.py tests/model/attention/test_attention_prefill_triton.py tests/model/test_norm_rope_triton.py tests/model/kernels/test_moe_align_large.py tests/model/test_gpu_smoke.py}
# shellcheck disable=SC2086  # TESTS is a list of paths
(cd /tmp && timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rs --durations=8 \
    $(for t in $TESTS; do echo "$REPO/$t"; done) 2>&1) | tee "$OUT/tests.log"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout "${BENCH_TIMEOUT:-420}" python3 bench/kernels_gpu.py --out "$OUT/kernels_gpu.json" \
    --parts "${PARTS:-fp8,fp8moe,small,moe,mla,flash,runner}" --budget-s "${BENCH_BUDGET:-300}" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
