#!/usr/bin/env bash
# One device call (see bench/gpu_setup.sh): bench/kv_transfer.py on one GPU, GPU pool -> GPU pool over
# loopback gRPC for one 4k-token V2-Lite request (127 MB), with 1 and 4 KV streams per room; the
# summary table (GB/s against the 2 GB/s target, raw gRPC ceilings) is printed last and kept in
# $OUT/kv_transfer.log. Extra arguments go to kv_transfer.py (e.g. --streams 1,2,4,8 --layerwise).
#
# crc32 runs through ISA-L when `isal` imports (about 10x zlib's): the GPU image lacks it, so put its
# wheel in bench/wheels/ first and carry that folder (it is git-ignored):
#   .venv/bin/pip download isal==1.9.1 --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --no-deps -d bench/wheels
# The table's header says which crc32 ran.
source "$(dirname "$0")/gpu_setup.sh"
if ls bench/wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/site bench/wheels/*.whl >>"$OUT/install.log" 2>&1 \
        || echo "note: bench/wheels could not be installed (see $OUT/install.log); crc32 falls back to zlib"
fi
repo=$(pwd)
cd /tmp && timeout "${KV_TRANSFER_TIMEOUT:-540}" python3 "$repo/bench/kv_transfer.py" --device cuda "$@" 2>&1 \
    | tee "$OUT/kv_transfer.log"
