# DeepGEMM (the optional "deep_gemm" FP8 backends, model/kernels/fp8_deep_gemm.py) built from source on
# the GPU machine, which has nvcc but no network. Two steps:
#
#   here:  bash bench/deep_gemm_build.sh pack DEEPGEMM_GIT CUTLASS_GIT FMT_GIT
#            (bare git dirs of deepseek-ai/DeepGEMM, NVIDIA/cutlass and fmtlib/fmt, e.g. from the search
#            tool's `fetch`) → bench/deep_gemm_src/deepgemm-<commit>.tar.gz (git-ignored; about 3 MB:
#            DeepGEMM at DEEPGEMM_COMMIT, CUTLASS's include/cute + include/cutlass and fmt's include/ at
#            the submodule commits DeepGEMM pins)
#   there: bash bench/deep_gemm_build.sh build      (carry bench/deep_gemm_src)
#            → /tmp/site/deep_gemm, importable with PYTHONPATH=/tmp/site; exits non-zero if it does not import
#
# The build compiles one translation unit (csrc/python_api.cpp, the host API) into deep_gemm/_C*.so
# (bench/deep_gemm_setup.py, without DeepGEMM's setup.py, which wants `wheel` and a git tree); DeepGEMM
# JIT-compiles each kernel shape with nvcc on first use (cache: DG_JIT_CACHE_DIR, /tmp/deep_gemm_cache).
# While the machine is held, /tmp/site stays for the next call: build once, then test and bench.
set -euo pipefail
DEEPGEMM_COMMIT=54e22612409371d6364144b69086735beb54e98b  # 2026-06-23, v2.6.1 (sm90 + sm100)
SRC_DIR=bench/deep_gemm_src

pack() {
    local dg=$1 cutlass=$2 fmt=$3 tmp
    tmp=$(mktemp -d)
    git --git-dir "$dg" archive --prefix=DeepGEMM/ "$DEEPGEMM_COMMIT" | tar -x -C "$tmp"
    local cutlass_commit fmt_commit
    cutlass_commit=$(git --git-dir "$dg" ls-tree "$DEEPGEMM_COMMIT" third-party/cutlass | awk '{print $3}')
    fmt_commit=$(git --git-dir "$dg" ls-tree "$DEEPGEMM_COMMIT" third-party/fmt | awk '{print $3}')
    git --git-dir "$cutlass" archive --prefix=DeepGEMM/third-party/cutlass/ "$cutlass_commit" include/cute include/cutlass \
        | tar -x -C "$tmp"
    git --git-dir "$fmt" archive --prefix=DeepGEMM/third-party/fmt/ "$fmt_commit" include | tar -x -C "$tmp"
    mkdir -p "$SRC_DIR"
    tar -czf "$SRC_DIR/deepgemm-${DEEPGEMM_COMMIT:0:7}.tar.gz" -C "$tmp" DeepGEMM
    rm -rf "$tmp"
    ls -l "$SRC_DIR"
}

build() {
    local tarball
    local REPO=$PWD
    tarball=$(ls "$SRC_DIR"/deepgemm-"${DEEPGEMM_COMMIT:0:7}".tar.gz)
    rm -rf /tmp/DeepGEMM && tar -xzf "$tarball" -C /tmp
    (
        cd /tmp/DeepGEMM
        # The JIT reads the CuTe/CUTLASS headers from the package's own include/ at run time.
        cp -r third-party/cutlass/include/cute third-party/cutlass/include/cutlass deep_gemm/include/
        MAX_JOBS=16 python3 "$REPO/bench/deep_gemm_setup.py"
    )
    mkdir -p /tmp/site && rm -rf /tmp/site/deep_gemm && cp -r /tmp/DeepGEMM/deep_gemm /tmp/site/
    export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/deep_gemm_cache}
    PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__version__, 'imports')"
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    build) build ;;
    *) echo "usage: $0 pack DEEPGEMM_GIT CUTLASS_GIT FMT_GIT | build" >&2; exit 2 ;;
esac
