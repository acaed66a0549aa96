#!/usr/bin/env bash
# One device call: bench/serving_gpu.py (1P1D on one GPU behind smg) twice in the same call, first
# as is (the prefill and decode processes time-slice the GPU), then under CUDA MPS (one GPU context
# shared by both: their kernels run side by side). Short levels so both fit one call: c=1 and c=64;
# serving only (--parts serving: the transfer parts do not depend on MPS).
# SERVING_RUNS picks the runs, in order (default "plain mps"): plain, mps, and with "_off" appended
# (plain_off, mps_off) the same with `--engine-opt stream_priority=false` on both workers (decode's
# kernels then lose their high-priority stream: workers/engine/model_stream.py). The priority can act
# only under MPS (one context); e.g. SERVING_RUNS="mps mps_off" is its A/B.
# Carry .whl (smg, setproctitle, grpcio-health-checking, grpcio, protobuf, smg-grpc-proto, isal).
WHEELS_REQUIRED=1  # the router (smg) comes only from .whl: stop if it cannot be installed
source "$(dirname "$0")/gpu_setup.sh"
export PATH=/tmp/site/bin:$PATH
repo=$(pwd)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
cd /tmp
levels=${SERVING_LEVELS:-1:16,64:192}
one() {  # $1: label; "_off" at its end: stream priorities off
    local extra=()
    [[ $1 == *_off ]] && extra=(--worker-args "--engine-opt=stream_priority=false")
    timeout 285 python3 "$repo/bench/serving_gpu.py" --out "/tmp/serving_$1" --levels "$levels" --budget-s 270 --parts serving \
        --model-dir /tmp/v2lite-random --commit "$commit" "${extra[@]}" > "$OUT/serving_$1.log" 2>&1
    cp "/tmp/serving_$1/serving_gpu.json" "$OUT/serving_$1.json" 2>/dev/null
    tail -25 "$OUT/serving_$1.log"
}
mps_on=""
for run in ${SERVING_RUNS:-plain mps}; do
    if [[ $run == mps* && -z $mps_on ]]; then
        nvidia-cuda-mps-control -d || { echo "MPS did not start"; break; }
        mps_on=1; sleep 2
    elif [[ $run != mps* && -n $mps_on ]]; then
        echo quit | nvidia-cuda-mps-control; mps_on=""; sleep 2
    fi
    one "$run"
done
[ -n "$mps_on" ] && echo quit | nvidia-cuda-mps-control
