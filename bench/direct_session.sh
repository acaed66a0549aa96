#!/usr/bin/env bash
# One device call (see bench/gpu_setup.sh; carry .whl): the same-host direct KV path on the GPU.
# 1. the CUDA tests of the KV path, per-chunk send order, pool sizing and the GPU chunk default; 2. bench/kv_transfer.py GPU pool -> GPU pool,
# the byte stream (same_host_direct off) against direct copies over CUDA IPC (auto), in one run;
# 3. bench/serving_gpu.py (all six issue-7 targets) within what is left. Everything under $OUT.
source "$(dirname "$0")/gpu_setup.sh"
repo=$(pwd)
commit=${COMMIT:-unknown}
(cd /tmp && timeout 150 python3 -m pytest -q -p no:cacheprovider -rs \
    "$repo/tests/workers/transport/test_kv_direct_cuda.py" "$repo/tests/workers/transport/test_kv_direct.py" \
    "$repo/tests/model/kv/test_kv_pool_sizing.py" "$repo/tests/workers/transport/test_kv_transfer.py" \
    "$repo/tests/workers/prefill/test_chunk_send_order_cuda.py" "$repo/tests/workers/test_gpu_chunk_default.py" 2>&1) | tee "$OUT/tests.log" | tail -15
# Which first-use CUDA calls wait beside a kernel on the default stream (printed: -s).
(cd /tmp && timeout 120 python3 -m pytest -q -s -p no:cacheprovider \
    "$repo/tests/workers/transport/test_cuda_first_use_cuda.py" 2>&1) | tee "$OUT/first_use.log" | tail -15
for mode in off auto; do
    (cd /tmp && timeout 90 python3 "$repo/bench/kv_transfer.py" --device cuda --streams 1 --tokens 4096 \
        --same-host-direct "$mode" --json "$OUT/kv_$mode.json" 2>&1) > "$OUT/kv_$mode.log"
    tail -5 "$OUT/kv_$mode.log"
done
cd /tmp && timeout "${SERVING_TIMEOUT:-330}" python3 "$repo/bench/serving_gpu.py" --out "$OUT/serving" --commit "$commit" \
    --budget-s "${SERVING_BUDGET:-310}" "$@" 2>&1 | tail -30
cp "$OUT/serving/serving_gpu.json" "$OUT/serving_gpu.json" 2>/dev/null
(cd "$OUT" && tar czf bundle.tgz --remove-files serving kv_off.log kv_auto.log install.log 2>/dev/null)
