#!/usr/bin/env bash
# One device call for issue 21's batch-1 decode (at most ~5 min: the timeouts below): the fusions'
# GPU tests, then bench/decode_bs1_gpu.py (graph tok/s with the small-batch fusions off / router / moe / kv_norm / on, per-layer
# kernels and time, the weight-read floor, and each variant's step split: host time, replay time, the
# kernels and idle gaps inside the graph), then bench/decode_bs1_moe_tiles.py (the one-token MoE's
# tiles against the sorted path). Run from the repository root:
#   bash bench/decode_bs1_session.sh        (files under $OUT: gpu.txt, tests.log, bs1.log, bs1.json,
#                                            moe_tiles.log, moe_tiles.json)
REPO=$(pwd)
# shellcheck source=bench/gpu_setup.sh
source bench/gpu_setup.sh
(cd /tmp && timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -q -p no:cacheprovider -rs --durations=8 \
    "$REPO/tests/model/kernels/test_small_batch_fusions.py" "$REPO/tests/model/kernels/test_kernels.py" \
    "$REPO/tests/model/test_norm_rope_triton.py" \
    -k "small_batch or fusions or (fused_moe_gpu and v2lite) or tiny_model_triton_backends_match or rope_and_cache" \
    2>&1) | tee "$OUT/tests.log"
timeout "${BENCH_TIMEOUT:-150}" python3 bench/decode_bs1_gpu.py --out "$OUT/bs1.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bs1.log"
timeout "${TILES_TIMEOUT:-60}" python3 bench/decode_bs1_moe_tiles.py --out "$OUT/moe_tiles.json" 2>&1 \
    | tee "$OUT/moe_tiles.log"
