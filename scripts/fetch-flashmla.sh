#!/usr/bin/env bash
# Packs FlashMLA's sm90 dense decode sources, at a pinned Hopper-capable commit, for the GPU machine
# (nvcc, no network) into .flashmla-src/ (git-ignored: .gitignore), where bench/flashmla_build.sh
# builds them. Never committed: third-party source travels only as this carry.
#
#   bash scripts/fetch-flashmla.sh FLASHMLA_GIT CUTLASS_GIT
#     FLASHMLA_GIT, CUTLASS_GIT: git dirs of deepseek-ai/FlashMLA and NVIDIA/cutlass (the search
#     tool's `fetch` gives /work/.mirror/<owner>+<name>/repo, the defaults)
#   → .flashmla-src/flashmla-<commit>.tar.gz (about 4 MB) + the ninja wheel the build runs with
#
# What is packed: FlashMLA at FLASHMLA_COMMIT without its sm100 kernels, its sparse kernels, tests,
# benchmarks and docs (the dense decode's API header, kernels, scheduler-metadata and combine
# kernels, kerutils and the Python package stay), plus CUTLASS's include/ and tools/util/include at
# the commit FlashMLA's csrc/cutlass submodule pins. `--check` only verifies that the pinned
# commits exist in the git dirs and that the dense sm90 kernels are in the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
# FlashMLA's newest release that still has the sm90 dense bf16 decode kernels in the snapshot here
# (2026-04-29, "Swap FlashMLA combine grid dimensions"); later releases dropped Hopper's dense decode.
FLASHMLA_COMMIT=9241ae3ef9bac614dd25e45e507e089f888280e0
NINJA_VERSION=1.13.2
DENSE_DECODE=csrc/sm90/decode/dense/instantiations/bf16.cu
DEST=.flashmla-src

check_only=
if [ "${1:-}" = --check ]; then check_only=1; shift; fi
flashmla_git=${1:-/work/.mirror/deepseek-ai+FlashMLA/repo}
cutlass_git=${2:-/work/.mirror/NVIDIA+cutlass/repo}
for dir in "$flashmla_git" "$cutlass_git"; do
    git --git-dir "$dir" rev-parse --git-dir >/dev/null 2>&1 || { echo "error: $dir is not a git dir" >&2; exit 2; }
done
git --git-dir "$flashmla_git" cat-file -e "$FLASHMLA_COMMIT^{commit}" 2>/dev/null \
    || { echo "error: FlashMLA commit $FLASHMLA_COMMIT is not in $flashmla_git" >&2; exit 1; }
git --git-dir "$flashmla_git" cat-file -e "$FLASHMLA_COMMIT:$DENSE_DECODE" 2>/dev/null \
    || { echo "error: $DENSE_DECODE is not in FlashMLA at $FLASHMLA_COMMIT (no sm90 dense decode)" >&2; exit 1; }
cutlass_commit=$(git --git-dir "$flashmla_git" ls-tree "$FLASHMLA_COMMIT" csrc/cutlass | awk '{print $3}')
[ -n "$cutlass_commit" ] || { echo "error: no csrc/cutlass submodule at $FLASHMLA_COMMIT" >&2; exit 1; }
git --git-dir "$cutlass_git" cat-file -e "$cutlass_commit^{commit}" 2>/dev/null \
    || { echo "error: CUTLASS commit $cutlass_commit (FlashMLA's submodule) is not in $cutlass_git" >&2; exit 1; }
echo "FlashMLA ${FLASHMLA_COMMIT:0:7}, CUTLASS ${cutlass_commit:0:9} (its submodule pin)"
[ -n "$check_only" ] && exit 0

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
root="$tmp/FlashMLA"
mkdir -p "$root"
git --git-dir "$flashmla_git" archive "$FLASHMLA_COMMIT" csrc flash_mla LICENSE setup.py | tar -x -C "$root"
# Only the sm90 dense decode is built (scripts/flashmla_setup.py): Blackwell and the sparse kernels go.
# (kerutils keeps its sm100 headers: its device.cuh includes them.)
rm -rf "$root/csrc/sm100" "$root/csrc/sm90/prefill" "$root/csrc/sm90/decode/sparse_fp8" "$root/csrc/api/api.cpp"
# A snapshot may lack CUTLASS's large media blobs; git archive names them on stderr while it writes
# the headers asked for, so its output is checked by the count of headers instead.
git --git-dir "$cutlass_git" archive --prefix=csrc/cutlass/ "$cutlass_commit" include/cute include/cutlass \
    tools/util/include LICENSE.txt 2> >(grep -v '^error: invalid object' >&2) | tar -x -C "$root"
want=$(git --git-dir "$cutlass_git" ls-tree -r "$cutlass_commit" include/cute include/cutlass tools/util/include | wc -l)
have=$(find "$root/csrc/cutlass/include" "$root/csrc/cutlass/tools" -type f | wc -l)
[ "$have" -eq "$want" ] || { echo "error: $have of CUTLASS's $want headers unpacked" >&2; exit 1; }
printf 'flashmla %s\ncutlass %s\n' "$FLASHMLA_COMMIT" "$cutlass_commit" > "$root/COMMITS"

rm -rf "$DEST" && mkdir -p "$DEST"
tar -czf "$DEST/flashmla-${FLASHMLA_COMMIT:0:7}.tar.gz" -C "$tmp" FlashMLA
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" "ninja==$NINJA_VERSION"
du -sh "$DEST"
ls -l "$DEST"
