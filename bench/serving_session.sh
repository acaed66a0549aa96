#!/usr/bin/env bash
# One device call (see bench/gpu_setup.sh): bench/serving_gpu.py end to end on one GPU (random
# V2-Lite checkpoint, runner alone, `deepseek-pd up` 1P1D, `bench serving` at c=1/16/64/128);
# everything lands under $OUT. Extra arguments go to serving_gpu.py (e.g. --profile,
# --worker-args "--engine-opt=..."). The router wheel (smg) must already be installed.
source "$(dirname "$0")/gpu_setup.sh"
# From /tmp: `python -m deepseek_pd.cli` in the checkout would import its deepseek_pd/ folder, which
# lacks the mapped subpackages (model/, workers/, ...), instead of the installed package.
repo=$(pwd)
cd /tmp && timeout "${SERVING_TIMEOUT:-570}" python3 "$repo/bench/serving_gpu.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/serving_gpu.log"
