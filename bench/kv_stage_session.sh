#!/usr/bin/env bash
# One device call (see bench/gpu_setup.sh): where the gRPC KV sender's time goes on one GPU.
#   1. bench/kv_stage_gpu.py: the staging (PageGather) alone, then with a second process busy on
#      the same GPU (as 1P1D on one GPU), against a pinned D2H copy and the device gather;
#   2. bench/kv_transfer.py --device cuda: the whole transfer, prefill and decode in two processes
#      and then in one (--together), 1 and 4 KV streams, with the slot_wait/stage split;
#   3. if CUDA MPS starts here, 1 and 2 again under MPS (one GPU context for both processes).
# Carry .whl (grpcio, protobuf, smg-grpc-proto, isal wheels; DEVELOPERS notes in the device README).
source "$(dirname "$0")/gpu_setup.sh"
repo=$(pwd)
cd /tmp
run() { echo "== $*"; timeout "${STEP_TIMEOUT:-150}" python3 "$@" 2>&1 | tail -40; }
round() {
    run "$repo/bench/kv_stage_gpu.py"
    run "$repo/bench/kv_stage_gpu.py" --busy-process
    run "$repo/bench/kv_transfer.py" --device cuda --streams 1,4 --repeats 3
    run "$repo/bench/kv_transfer.py" --device cuda --streams 1,4 --repeats 3 --together
}
round 2>&1 | tee "$OUT/kv_stage.log"
if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d 2>>"$OUT/mps.log"; then
    sleep 2
    echo "== under MPS" | tee -a "$OUT/kv_stage.log"
    { run "$repo/bench/kv_stage_gpu.py" --busy-process
      run "$repo/bench/kv_transfer.py" --device cuda --streams 1,4 --repeats 3; } 2>&1 | tee -a "$OUT/kv_stage.log"
    echo quit | nvidia-cuda-mps-control
else
    echo "MPS: not available here ($(command -v nvidia-cuda-mps-control || echo no binary))" | tee -a "$OUT/kv_stage.log"
fi
