#!/usr/bin/env bash
# One device call (see bench/gpu_setup.sh): all six targets of issue 7 in one run of
# bench/serving_gpu.py on one GPU (random V2-Lite checkpoint; runner alone; the gRPC KV transfer
# GPU pool -> GPU pool and Mooncake TCP, each against its raw ceiling; layer-wise TTFT of an 8k
# prompt; `deepseek-pd up` 1P1D and `bench serving` at c=1/16/64/128). The last table printed is
# the six targets (value, target, ratio, PASS/MISS, commit); everything lands under $OUT. Extra
# arguments go to serving_gpu.py (e.g. --profile, --parts serving, --worker-args "--engine-opt=...";
# --parts prefill_only,decode_only: issue 25's loads apart, bench/solo_levels.py, in a call of their own).
# Carry .whl/ with the router's wheels (smg, ...) unless the image has them, and bench/wheels/ with
# the mooncake (and isal) wheels, or the Mooncake row says it was skipped (gpu_setup.sh says how).
source "$(dirname "$0")/gpu_setup.sh"
# From /tmp: `python -m deepseek_pd.cli` in the checkout would import its deepseek_pd/ folder, which
# lacks the mapped subpackages (model/, workers/, ...), instead of the installed package.
repo=$(pwd)
cd /tmp && timeout "${SERVING_TIMEOUT:-570}" python3 "$repo/bench/serving_gpu.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/serving_gpu.log"
# The device call brings back at most 8 files: the per-level, worker and part files go in one archive.
(cd "$OUT" && tar czf bundle.tgz --remove-files $(ls -d levels logs parts profile 2>/dev/null) runner_steps.* checkpoint.log install.log 2>/dev/null)
