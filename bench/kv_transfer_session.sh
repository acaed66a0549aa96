#!/usr/bin/env bash
# One device call (see bench/gpu_setup.sh): bench/kv_transfer.py on one GPU, GPU pool -> GPU pool over
# loopback gRPC for one 4k-token V2-Lite request (127 MB), with 1 and 4 KV streams per room; the
# summary table (GB/s against the 2 GB/s target, raw gRPC ceilings) is printed last and kept in
# $OUT/kv_transfer.log. Extra arguments go to kv_transfer.py (e.g. --streams 1,2,4,8 --layerwise).
# (bench/serving_session.sh runs this same measurement among all six targets of issue 7.)
#
# crc32 runs through ISA-L when `isal` imports (about 10x zlib's): the GPU image lacks it, so carry
# its wheel in bench/wheels/ (gpu_setup.sh says how). The table's header says which crc32 ran.
source "$(dirname "$0")/gpu_setup.sh"
repo=$(pwd)
cd /tmp && timeout "${KV_TRANSFER_TIMEOUT:-540}" python3 "$repo/bench/kv_transfer.py" --device cuda "$@" 2>&1 \
    | tee "$OUT/kv_transfer.log"
