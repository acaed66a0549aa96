#!/usr/bin/env bash
# One device call (see bench/gpu_setup.sh): a decode step of the runner alone at world size 1,
# DeepSeek-V2-Lite shape (random bf16 weights), batch 32/128/256, context 512-1024 + 64, in three
# runs of bench/runner_steps.py: CUDA graphs, eager, and eager with two-batch overlap (CUDA graphs
# cannot capture TBO). At world size 1 TBO has no all-to-all to hide, so this is its overhead.
# Then bench/kv_transfer.py's chunk-size sweep (gRPC KV, GPU pool -> GPU pool, two processes).
# Carry .whl (grpcio, protobuf, smg-grpc-proto, isal).
source "$(dirname "$0")/gpu_setup.sh"
repo=$(pwd)
cd /tmp
model=/tmp/v2lite-random
python3 "$repo/bench/random_checkpoint.py" "$model" --shape v2-lite 2>&1 | tail -2 | tee "$OUT/checkpoint.log"
common=(--model "$model" --prefill-lengths 768 --batches "${TBO_BATCHES:-32,128,256}" --steps 16 --repeats 1)
for variant in graph eager tbo; do
    case $variant in
        graph) flags=(--cuda-graph) ;;
        eager) flags=() ;;
        tbo) flags=(--enable-tbo) ;;
    esac
    echo "== runner_steps $variant" | tee -a "$OUT/tbo_steps.log"
    timeout 200 python3 "$repo/bench/runner_steps.py" "${common[@]}" "${flags[@]}" --out "$OUT/steps_$variant.json" 2>&1 \
        | grep -v Warning | tail -6 | tee -a "$OUT/tbo_steps.log"
done
for chunk in 8 16; do
    echo "== kv_transfer chunk ${chunk} MiB" | tee -a "$OUT/tbo_steps.log"
    timeout 90 python3 "$repo/bench/kv_transfer.py" --device cuda --streams 1,2 --repeats 3 --chunk-mb "$chunk" 2>&1 \
        | tail -8 | tee -a "$OUT/tbo_steps.log"
done
