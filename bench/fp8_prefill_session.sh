#!/usr/bin/env bash
# One device call for the FP8 prefill work (issues 21 and 24): the GPU tests of what it touched (the
# one fused MoE in bf16 and FP8, the activation quantisation, the FP8 linear paths, FlashInfer's
# eager wrapper pool where FlashInfer is carried, DeepGEMM where built, the fused RMSNorm + quantisation
# and the q/k parts read apart in MLA prefill: bit for bit their unfused paths on a GPU too?), then
# bench/fp8_prefill_gpu.py (its norm_quant and qk_split parts time those two against what they replace).
# Everything lands under $OUT. About 5 minutes without DeepGEMM.
#   DEEPGEMM=1 (with bench/deep_gemm_src carried, see bench/deep_gemm_build.sh): build DeepGEMM first
#   (~3-4 min, then each new GEMM shape JIT-compiles once); pair it with TESTS=tests/model/kernels/test_fp8_deep_gemm.py
#   and BENCH_ARGS="--parts moe,linear --models V3 --rows 2048,8192".
#   FlashInfer: carry .whl as for bench/mla_session.sh.
source "$(dirname "$0")/gpu_setup.sh"
REPO=$PWD
if [ "${DEEPGEMM:-0}" = 1 ]; then
    timeout "${DEEPGEMM_TIMEOUT:-300}" bash bench/deep_gemm_build.sh build 2>&1 | tail -40 | tee "$OUT/deep_gemm_build.log"
    export DG_JIT_CACHE_DIR=/tmp/deep_gemm_cache
fi
for z in .whl/flashinfer-*.zip; do
    [ -f "$z" ] && python3 -m zipfile -e "$z" /tmp/site
done
TESTS=${TESTS:-tests/model/kernels/test_fp8_kernels.py tests/model/moe/test_moe_quant_method.py tests/model/kernels/test_fp8_deep_gemm.py \
tests/model/kernels/test_moe_align_large.py tests/model/kernels/test_kernels.py tests/model/kernels/test_batch_invariant_kernels.py \
tests/model/kernels/test_flashinfer_mla.py tests/model/kernels/test_rmsnorm_quant.py tests/model/quant/test_norm_fp8_linear.py \
tests/model/attention/test_rope_split.py tests/model/test_jit_backends.py tests/model/kernels/test_mla_decode_route.py}
# shellcheck disable=SC2086  # TESTS is a list of paths
(cd /tmp && timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -rs --durations=8 \
    $(for t in $TESTS; do echo "$REPO/$t"; done) \
    -k "moe or fp8 or quant or deep_gemm or flashinfer_mla_decode or tiny_model or align or rope_split or start_up or hopper" 2>&1) | tee "$OUT/tests.log"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout "${BENCH_TIMEOUT:-290}" python3 bench/fp8_prefill_gpu.py --out "$OUT" --budget-s "${BENCH_BUDGET:-230}" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
exit 0
