#!/usr/bin/env bash
# One device call (see bench/gpu_setup.sh): `--deterministic` on the GPU. First its tests (the kernels'
# bit checks in bf16, the runner's rows against their solo runs eager and by CUDA-graph replay, and
# PD at concurrency 16 against offline generate; the PD case imports the gRPC wheels: carry .whl/,
# scripts/fetch-flashinfer.sh fetches them), then bench/batch_invariant_gpu.py: each swapped kernel's
# time against the default's, with the bit checks (`inv` must be yes). Everything lands under $OUT.
# The serving cost end to end is two runs of bench/serving_session.sh, with and without
# --worker-args "--deterministic" (docs/deterministic.md).
source "$(dirname "$0")/gpu_setup.sh"
REPO=$PWD
(cd /tmp && timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs --durations=8 \
    "$REPO/tests/model/kernels/test_batch_invariant_kernels.py" "$REPO/tests/model/test_deterministic.py" \
    "$REPO/tests/workers/test_pd_deterministic.py" 2>&1) | tee "$OUT/tests.log"
timeout "${BENCH_TIMEOUT:-240}" python3 bench/batch_invariant_gpu.py --out "$OUT/batch_invariant.jsonl" \
    --parts "${PARTS:-gemm,moe,mla}" 2>&1 | tee "$OUT/bench.log"
