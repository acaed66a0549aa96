#!/usr/bin/env bash
# One device call for piecewise extend graphs (model/extend_graph.py; at most ~5 min: the timeouts
# below): their GPU tests (replay vs eager in bf16 with decode graphs sharing the pool, host launches),
# then bench/extend_graph_gpu.py on a random V2-Lite checkpoint (eager vs graphs, one prompt of
# 256/789/2048 tokens and a batch of 8x240; wall and host time and their ratios). From the repository root:
#   bash bench/extend_graph_session.sh        (files under $OUT: gpu.txt, tests.log, extend_graph.log/.json)
REPO=$(pwd)
# shellcheck source=bench/gpu_setup.sh
source bench/gpu_setup.sh
(cd /tmp && timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -q -p no:cacheprovider -rs --durations=5 \
    "$REPO/tests/model/test_extend_graph.py" -m gpu 2>&1) | tee "$OUT/tests.log"
(cd /tmp && timeout "${BENCH_TIMEOUT:-190}" python3 "$REPO/bench/extend_graph_gpu.py" --out "$OUT/extend_graph.json" \
    ${BENCH_ARGS:-} 2>&1) | tee "$OUT/extend_graph.log"
