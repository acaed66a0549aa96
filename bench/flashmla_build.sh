#!/usr/bin/env bash
# FlashMLA's sm90 dense bf16 decode (attention backend "flashmla", model/kernels/flashmla_mla.py),
# built on the GPU machine (nvcc, no network), then checked and timed: one device call.
#
#   here:  bash scripts/fetch-flashmla.sh          → .flashmla-src/ (sources + the ninja wheel, ~3 MB)
#   there: bash bench/flashmla_build.sh            (carry .flashmla-src; add .whl for the FlashInfer column)
#
# Steps (PARTS=build,tests,bench picks them; all by default):
#   build  unpacks the sources into /tmp/flashmla-build and compiles our binding, the metadata and
#          combine kernels and the bf16 dense kernel for sm_90a (scripts/flashmla_setup.py; ninja
#          -j16), timed; the package lands in /tmp/site/flash_mla (kept while the machine is held:
#          a later call skips the build) and in $OUT/flashmla/flash_mla (cuda*.so + the Python
#          files + BUILD_INFO). Bring that folder back as .flashmla/ (git-ignored) and carry it:
#          DEEPSEEK_PD_FLASHMLA_DIR=.flashmla is then used instead of building again.
#   tests  the FlashMLA GPU tests and the route tests (and FlashInfer's, where it is carried).
#   bench  bench/mla_decode_gpu.py: Triton, FlashInfer (if carried) and FlashMLA at issue 21's shapes.
# Writes under $OUT: build.log, build_time.txt, flashmla/, tests.log, mla_decode.json, bench.log.
#
#   bash bench/flashmla_build.sh --dry-run   (CPU) unpacks and checks the sources, writes the binding
#                                            and prints the build command, stopping where nvcc is needed.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
SRC_DIR=${FLASHMLA_SRC_DIR:-.flashmla-src}  # the packed sources (scripts/fetch-flashmla.sh)
BUILD_DIR=${FLASHMLA_BUILD_DIR:-/tmp/flashmla-build}

unpack() {
    local tarball
    tarball=$(ls "$SRC_DIR"/flashmla-*.tar.gz 2>/dev/null | head -1)
    [ -n "$tarball" ] || { echo "error: no $SRC_DIR/flashmla-*.tar.gz: run scripts/fetch-flashmla.sh and carry $SRC_DIR" >&2; return 1; }
    rm -rf "$BUILD_DIR" && mkdir -p "$BUILD_DIR" && tar -xzf "$tarball" -C "$BUILD_DIR" || return 1
    local missing=0
    for f in csrc/api/dense_decode.h csrc/sm90/decode/dense/instantiations/bf16.cu \
             csrc/smxx/decode/combine/combine.cu csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu \
             csrc/cutlass/include/cute/tensor.hpp csrc/cutlass/include/cutlass/cutlass.h flash_mla/__init__.py; do
        [ -f "$BUILD_DIR/FlashMLA/$f" ] || { echo "error: $f is missing from $tarball" >&2; missing=1; }
    done
    [ "$missing" = 0 ] && echo "sources: $(tr '\n' ' ' < "$BUILD_DIR/FlashMLA/COMMITS")"
}

build_command() {
    echo "cd $BUILD_DIR/FlashMLA && MAX_JOBS=16 NVCC_THREADS=4 TORCH_CUDA_ARCH_LIST=9.0" \
         "python3 $REPO/scripts/flashmla_setup.py $REPO/scripts/flashmla_bindings.cpp"
}

if [ "${1:-}" = --dry-run ]; then
    unpack || exit 1
    # -I: with the repo root on the path, its operator/ would shadow the stdlib's for `-m`.
    bash -n "$0" && python3 -I -m py_compile scripts/flashmla_setup.py || exit 1
    echo "would run: $(build_command)"
    command -v nvcc >/dev/null || echo "stopping here: no nvcc on this machine"
    exit 0
fi

source bench/gpu_setup.sh
# A carried build (DEEPSEEK_PD_FLASHMLA_DIR=.flashmla, the folder a previous call left under $OUT):
# absolute, since the tests run from /tmp.
if [ -n "${DEEPSEEK_PD_FLASHMLA_DIR:-}" ]; then
    DEEPSEEK_PD_FLASHMLA_DIR=$(cd "$DEEPSEEK_PD_FLASHMLA_DIR" && pwd) && export DEEPSEEK_PD_FLASHMLA_DIR
fi
export PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-deps --no-index --target /tmp/site "$SRC_DIR"/ninja-*.whl >>"$OUT/install.log" 2>&1 \
    || echo "note: no ninja wheel in $SRC_DIR: the build compiles one unit at a time"
for z in .whl/flashinfer-*.zip; do  # FlashInfer for the bench's FlashInfer column, when carried
    [ -f "$z" ] && python3 -m zipfile -e "$z" /tmp/site
done
PARTS=${PARTS:-build,tests,bench}
# One device call runs at most 600 s: each step's timeout is its own limit or what is left of
# CALL_BUDGET_S (counted from here, less the set-up above), whichever is less.
CALL_BUDGET_S=${CALL_BUDGET_S:-540}
left() {  # left LIMIT: the seconds the next step may take
    local rest=$((CALL_BUDGET_S - SECONDS))
    [ "$rest" -lt "$1" ] && echo $((rest > 10 ? rest : 10)) || echo "$1"
}
SECONDS=0

build() {
    local commit
    commit=$(tar -xzOf "$SRC_DIR"/flashmla-*.tar.gz FlashMLA/COMMITS 2>/dev/null | head -1)
    if [ -f /tmp/site/flash_mla/BUILD_INFO ] && grep -qF "$commit" /tmp/site/flash_mla/BUILD_INFO; then
        echo "FlashMLA: built in an earlier call on this machine ($commit)" | tee "$OUT/build_time.txt"
        return 0
    fi
    if [ -n "${DEEPSEEK_PD_FLASHMLA_DIR:-}" ] && [ -f "$DEEPSEEK_PD_FLASHMLA_DIR/flash_mla/BUILD_INFO" ]; then
        echo "FlashMLA: carried in $DEEPSEEK_PD_FLASHMLA_DIR, not rebuilt" | tee "$OUT/build_time.txt"
        return 0
    fi
    unpack || return 1
    echo "nvcc: $(nvcc --version | tail -2 | tr '\n' ' ')" | tee -a "$OUT/gpu.txt"
    local start=$SECONDS
    (cd "$BUILD_DIR/FlashMLA" && MAX_JOBS=16 NVCC_THREADS=4 TORCH_CUDA_ARCH_LIST=9.0 \
        timeout "$(left "${BUILD_TIMEOUT:-420}")" python3 "$REPO/scripts/flashmla_setup.py" "$REPO/scripts/flashmla_bindings.cpp") \
        >"$OUT/build.log" 2>&1
    local rc=$?
    echo "FlashMLA build: exit $rc in $((SECONDS - start)) s (ninja: $(command -v ninja || echo none))" \
        | tee "$OUT/build_time.txt"
    [ "$rc" = 0 ] || { tail -40 "$OUT/build.log"; return 1; }
    local pkg=$BUILD_DIR/FlashMLA/flash_mla
    {
        echo "$commit"
        echo "built $(date -u +%FT%TZ) in $((SECONDS - start)) s with torch $(python3 -c 'import torch; print(torch.__version__)')"
        nvcc --version | tail -1
    } > "$pkg/BUILD_INFO"
    rm -rf /tmp/site/flash_mla "$OUT/flashmla" && mkdir -p "$OUT/flashmla"
    cp -r "$pkg" /tmp/site/flash_mla && cp -r "$pkg" "$OUT/flashmla/flash_mla"
    ls -l "$OUT/flashmla/flash_mla"
}

if [[ $PARTS == *build* ]]; then
    build || { echo "FlashMLA did not build; the tests and bench run without it"; }
fi
# From /tmp: in the checkout, its deepseek_pd/ folder (without the mapped model/) would shadow the package.
(cd /tmp && python3 - <<'PY') 2>&1 | tee -a "$OUT/gpu.txt"
from deepseek_pd.model.kernels.flashmla_mla import flashmla_available, flashmla_blocker, check_against_reference
print("flashmla blocker:", flashmla_blocker())
try:
    check_against_reference("cuda")
    print("flashmla start-up check: passed")
except Exception as exc:
    print("flashmla start-up check: FAILED", type(exc).__name__, exc)
print("flashmla_available:", flashmla_available())
PY
if [[ $PARTS == *tests* ]]; then
    (cd /tmp && timeout "$(left "${TEST_TIMEOUT:-240}")" python3 -m pytest -q -s -p no:cacheprovider -rs --durations=8 \
        "$REPO/tests/model/kernels/test_flashmla_mla.py" "$REPO/tests/model/kernels/test_mla_decode_route.py" \
        "$REPO/tests/model/kernels/test_flashinfer_mla.py" 2>&1) | tail -c 20000 | tee "$OUT/tests.log"
fi
if [[ $PARTS == *bench* ]]; then
    timeout "$(left "${BENCH_TIMEOUT:-300}")" python3 bench/mla_decode_gpu.py --out "$OUT/mla_decode.json" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench.log"
fi
exit 0
