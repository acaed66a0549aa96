#!/usr/bin/env bash
# One device call for issue 21: installs FlashInfer (carried, see below), runs the FlashInfer and
# Triton MLA GPU tests, bench/mla_decode_gpu.py, then the V3 slice (bench/v3_slice_gpu.py);
# everything lands under $OUT. PARTS=tests,mla,v3 picks the steps (default: all three).
# FlashInfer travels as wheels in .whl/ (apache-tvm-ffi, ninja, einops, tabulate, nvidia-ml-py) plus
# .whl/flashinfer-*.zip: flashinfer-python 0.7.2.post1's wheel with the csrc of other kernels
# (Blackwell, sampling, fused MoE, CUTLASS examples) left out, so that it fits a 64 MiB carry;
# `scripts/fetch-flashinfer.sh` makes it. Its MLA kernel JIT-compiles with the image's nvcc (~20 s).
source "$(dirname "$0")/gpu_setup.sh"
REPO=$PWD
for z in .whl/flashinfer-*.zip; do
    [ -f "$z" ] && python3 -m zipfile -e "$z" /tmp/site
done
python3 -c "import flashinfer, sys; print('flashinfer', flashinfer.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
PARTS=${PARTS:-tests,mla,v3}
[[ $PARTS == *tests* ]] && (cd /tmp && timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs --durations=8 \
    "$REPO/tests/model/kernels/test_flashinfer_mla.py" "$REPO/tests/model/kernels/test_kernels.py" -k "mla or flashinfer" 2>&1) \
    | tee "$OUT/tests.log"
# Other GPU tests to run in the same call (paths; e.g. the serving issue's), printed with -s.
if [[ $PARTS == *tests* && -n "${EXTRA_TESTS:-}" ]]; then
    # shellcheck disable=SC2086  # EXTRA_TESTS is a list of paths
    (cd /tmp && timeout "${EXTRA_TIMEOUT:-150}" python3 -m pytest -q -s -p no:cacheprovider -rs \
        $(for t in $EXTRA_TESTS; do echo "$REPO/$t"; done) 2>&1) | tail -c 20000 | tee "$OUT/extra_tests.log"
fi
[[ $PARTS == *mla* ]] && timeout "${BENCH_TIMEOUT:-300}" python3 bench/mla_decode_gpu.py --out "$OUT/mla_decode.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log"
[[ $PARTS == *v3* ]] && timeout "${V3_TIMEOUT:-330}" python3 bench/v3_slice_gpu.py --out "$OUT/v3_slice.json" \
    ${V3_ARGS:-} 2>&1 | tee "$OUT/v3_slice.log"
exit 0
