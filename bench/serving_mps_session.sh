#!/usr/bin/env bash
# One device call: bench/serving_gpu.py (1P1D on one GPU behind smg) twice in the same call, first
# as is (the prefill and decode processes time-slice the GPU), then under CUDA MPS (one GPU context
# shared by both: their kernels run side by side). Short levels so both fit one call: c=1 and c=64;
# serving only (--parts serving: the transfer parts do not depend on MPS).
# Carry .whl (smg, setproctitle, grpcio-health-checking, grpcio, protobuf, smg-grpc-proto, isal).
WHEELS_REQUIRED=1  # the router (smg) comes only from .whl: stop if it cannot be installed
source "$(dirname "$0")/gpu_setup.sh"
export PATH=/tmp/site/bin:$PATH
repo=$(pwd)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
cd /tmp
levels=${SERVING_LEVELS:-1:16,64:192}
one() {  # $1: label
    timeout 285 python3 "$repo/bench/serving_gpu.py" --out "/tmp/serving_$1" --levels "$levels" --budget-s 270 --parts serving \
        --model-dir /tmp/v2lite-random --commit "$commit" > "$OUT/serving_$1.log" 2>&1
    cp "/tmp/serving_$1/serving_gpu.json" "$OUT/serving_$1.json" 2>/dev/null
    tail -25 "$OUT/serving_$1.log"
}
one plain
if nvidia-cuda-mps-control -d; then
    sleep 2
    one mps
    echo quit | nvidia-cuda-mps-control
else
    echo "MPS did not start"
fi
