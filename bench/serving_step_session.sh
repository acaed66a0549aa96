#!/usr/bin/env bash
# One device call (see bench/gpu_setup.sh): issue 25's prefill-worker checks, everything under $OUT.
# PART=tests (about 4 min): the per-chunk send order with its phases (when the first copy's host
# calls returned), which first-use CUDA calls wait beside a kernel on another stream, the extend
# step's one wait per round, NVML's total against CUDA's, the host-overhead bench's one added wait. PART=bench (about 5 min, the V2-Lite
# checkpoint reused from bench/serving_session.sh's /tmp/deepseek-pd-bench/v2-lite-random, else
# written first): bench/prefill_step_ratio.py, the prefill worker's step against its runner's in one
# process at 789 tokens, with the model thread in inference mode and as before (in turn on each
# prompt), and a torch trace of the last pairs.
# PART=mac (about 1 min): the mooncake KV MAC's GPU tests (each send hashes its layer on a side stream
# after its event; decode lands each send out of its device staging and MACs it, its check waits for
# no decode step) and bench/kv_mac_finish.py, what is left of the MAC at prefill's `finish` and at
# decode's check against the one-shot MAC of a 4k-token V2-Lite prompt; the sampling batch's
# GPU tests (no sync in `sample`, penalty tables built on the sampling thread); the mooncake KV
# cipher's Triton kernel against a ChaCha20 reference and bench/kv_cipher.py (what it adds to the
# staging copy of a 4k-token V2-Lite prompt, per side).
# PART=gil (about 2 min, not in all): bench/gil_switch.py, the V2-Lite extend of 789 tokens beside a
# Python-busy thread against alone, at GIL switch intervals of 5 (CPython's default) and 0.5 ms:
# whether a worker's other threads can slow its model thread's launches, and whether a shorter
# interval would help; bounded by its own --budget-s (GIL_BUDGET_S, default 60).
# PART=host (about 4.5 min, not in all): bench/prefill_host_overhead.py, the prefill worker's round
# against its runner's extend of one 789-token prompt, stage by stage, then the real engines in one
# process (HOST_BUDGET_S, default 120), and PART=gil's run.
# PART=threads (about 4 min, not in all): bench/prefill_thread_cpu.py, `up` on V2-Lite (one prefill
# and one decode process, the real router) with its prefill worker observed: per forward at c = 1
# and 16 (789-token prompts, one output token), each thread's CPU against the model thread's, the
# model thread's CPU and GIL/device waits against the runner alone (THREADS_LEVELS, THREADS_ROUNDS;
# THREADS_ARGS adds flags, e.g. "--stacks" or "--worker-arg=--engine-opt=layerwise_transfer=false").
# All three write the V2-Lite checkpoint first when /tmp lacks it (~45 s; serving_session.sh's, reused).
# PART=penalty (about 3 min, not in all): prefill_step_ratio.py with a repetition penalty on every
# request (sampling tables built on the model thread, not the event loop), 8 requests.
# PART=all (default) runs tests, bench and mac. No wheels needed (the byte stream's crc32 falls back to zlib).
# PART=threads starts `up`, whose router comes from the .whl/ wheels (carry .whl/, bench/gpu_setup.sh).
if [ "${PART:-all}" = threads ]; then export WHEELS_REQUIRED=1; fi
source "$(dirname "$0")/gpu_setup.sh"
REPO=$PWD
PART=${PART:-all}
if [ "$PART" = all ] || [ "$PART" = tests ]; then
    (cd /tmp && timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -s -p no:cacheprovider -rs --durations=8 \
        "$REPO/tests/workers/prefill/test_chunk_send_order_cuda.py" \
        "$REPO/tests/workers/transport/test_cuda_first_use_cuda.py" \
        "$REPO/tests/workers/engine/test_extend_step_cuda.py" \
        "$REPO/tests/workers/engine/test_round_clock_cuda.py" \
        "$REPO/tests/workers/test_gpu_chunk_default.py" \
        "$REPO/tests/bench/test_prefill_host_overhead_cuda.py" 2>&1) | tee "$OUT/tests.log"
fi
if [ "$PART" = all ] || [ "$PART" = mac ]; then
    (cd /tmp && timeout "${MAC_TIMEOUT:-150}" python3 -m pytest -q -s -p no:cacheprovider -rs --durations=5 \
        "$REPO/tests/workers/transport/test_kv_mac_cuda.py" \
        "$REPO/tests/workers/transport/test_staging_cuda.py" \
        "$REPO/tests/workers/transport/test_kv_cipher_cuda.py" \
        "$REPO/tests/model/sampling/test_sampling_batch.py" 2>&1) | tee "$OUT/mac_tests.log"
    (cd /tmp && timeout 60 python3 "$REPO/bench/kv_cipher.py" --device cuda --json "$OUT/kv_cipher.json" 2>&1) \
        | tee "$OUT/kv_cipher.log"
    (cd /tmp && timeout 60 python3 "$REPO/bench/kv_mac_finish.py" --device cuda --tokens 4096 --layerwise \
        --json "$OUT/kv_mac_finish.json" 2>&1; timeout 60 python3 "$REPO/bench/kv_mac_finish.py" --device cuda \
        --tokens 4096 2>&1) | tee "$OUT/kv_mac_finish.log"
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
    cd /tmp || exit 1
    timeout "${BENCH_TIMEOUT:-420}" python3 "$REPO/bench/prefill_step_ratio.py" --device cuda --shape v2-lite \
        --tokens "${TOKENS:-789}" --repeats "${REPEATS:-16}" --also-without-inference-mode --trace "$OUT/trace" \
        --json "$OUT/step.json" 2>&1 | grep -v "^USDT" | tee "$OUT/step.log"
fi
# PART=host and gil: DEVICE (default cuda) and V2_LITE (the checkpoint, default serving_gpu.py's) let a
# CPU dry run point them at a small checkpoint.
DEVICE=${DEVICE:-cuda}
V2_LITE=${V2_LITE:-/tmp/deepseek-pd-bench/v2-lite-random}
ensure_v2_lite() {
    [ -f "$V2_LITE/config.json" ] && return 0
    echo "no V2-Lite checkpoint at $V2_LITE: writing it now (~45 s on the GPU)"
    (cd /tmp && timeout 180 python3 "$REPO/bench/random_checkpoint.py" "$V2_LITE" --shape v2-lite --device "$DEVICE") \
        || { echo "error: the V2-Lite checkpoint could not be written"; exit 1; }
}
if [ "$PART" = host ]; then
    ensure_v2_lite
    cd /tmp || exit 1
    budget=${HOST_BUDGET_S:-120}
    timeout $((budget + 60)) python3 "$REPO/bench/prefill_host_overhead.py" --device "$DEVICE" --model "$V2_LITE" \
        --tokens "${TOKENS:-789}" --budget-s "$budget" --json "$OUT/host_overhead.json" 2>&1 \
        | grep -v "^USDT" | tee "$OUT/host_overhead.log"
    cd "$REPO" || exit 1
fi
if [ "$PART" = gil ] || [ "$PART" = host ]; then
    ensure_v2_lite
    cd /tmp || exit 1
    budget=${GIL_BUDGET_S:-60}
    timeout $((budget + 60)) python3 "$REPO/bench/gil_switch.py" --device "$DEVICE" --model "$V2_LITE" \
        --tokens "${TOKENS:-789}" --pairs 9 --intervals-ms 5,0.5 --small-ops --budget-s "$budget" 2>&1 \
        | tee "$OUT/gil_switch.log"
fi
if [ "$PART" = threads ]; then
    ensure_v2_lite
    cd /tmp || exit 1
    # (unbuffered: a timeout keeps every level printed so far)
    # shellcheck disable=SC2086
    timeout "${THREADS_TIMEOUT:-420}" python3 -u "$REPO/bench/prefill_thread_cpu.py" --device "$DEVICE" \
        --model "$V2_LITE" --tokens "${TOKENS:-789}" --levels "${THREADS_LEVELS:-1,16}" \
        --rounds "${THREADS_ROUNDS:-6}" --log-dir "$OUT/threads_logs" --json "$OUT/threads.json" ${THREADS_ARGS:-} 2>&1 \
        | grep -v "^USDT" | tee "$OUT/threads.log"
    cd "$REPO" || exit 1
fi
if [ "$PART" = penalty ]; then
    cd /tmp || exit 1
    timeout "${BENCH_TIMEOUT:-300}" python3 "$REPO/bench/prefill_step_ratio.py" --device cuda --shape v2-lite \
        --tokens "${TOKENS:-789}" --repeats "${REPEATS:-8}" --repetition-penalty 1.1 \
        --json "$OUT/step_penalty.json" 2>&1 | grep -v "^USDT" | tee "$OUT/step_penalty.log"
fi
