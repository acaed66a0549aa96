#!/usr/bin/env bash
# One device call (no wheels to carry): the GPU tests of the decode worker's high-priority stream
# and of the prefill round's one host wait, then bench/stream_priority.py plain (threads: one
# context; processes: two, time-sliced) and under MPS (processes sharing one context), then the
# prefill step's attribution (bench/prefill_step_ratio.py --trace; small files only into $OUT).
source "$(dirname "$0")/gpu_setup.sh"
repo=$(pwd)
# From /tmp, as the other sessions: the installed package, not the checkout's folders.
(cd /tmp && timeout 150 python3 -m pytest -q -s -p no:cacheprovider -rs "$repo/tests/workers/engine/test_model_stream_cuda.py" \
    "$repo/tests/workers/engine/test_extend_step_cuda.py" 2>&1) | tail -15 | tee "$OUT/tests.log"
timeout 150 python3 "$repo/bench/stream_priority.py" --mode threads,processes --json "$OUT/stream_priority_plain.json"
if nvidia-cuda-mps-control -d; then
    sleep 2
    timeout 100 python3 "$repo/bench/stream_priority.py" --mode processes --json "$OUT/stream_priority_mps.json"
    echo quit | nvidia-cuda-mps-control
else
    echo "MPS did not start"
fi
cd /tmp && timeout "${STEP_TIMEOUT:-200}" python3 "$repo/bench/prefill_step_ratio.py" --device cuda --shape v2-lite \
    --tokens 789 --repeats 12 --trace /tmp/step_trace --json "$OUT/step.json" 2>&1 | tail -30
cp /tmp/step_trace/prefill_step_attribution.json /tmp/step_trace/prefill_step_ops.txt "$OUT/" 2>/dev/null
