#!/usr/bin/env bash
# The GPU runs still owed (docs/performance.md, "session 16 — no device call ran"), packed into five
# device calls of at most ~9.5 min each, so that a session with 30 minutes of device time spends
# them on work and not on machine starts. One call per part, from the repository root:
#
#   bash bench/owed_session.sh A   extend graphs' tests + bench (issue 25), then batch-1 decode split,
#                                  fusions and MoE tiles (issue 21)                      no carry
#   bash bench/owed_session.sh B   FlashMLA build + its tests, the page-size GPU test, then the V3
#                                  slice with FlashMLA among its variants (issue 21)    carry .flashmla-src
#   bash bench/owed_session.sh C   Mooncake TCP GPU pool -> GPU pool against raw (issue 25), then
#                                  the prefill worker's threads at c = 1 and 16 (issue 25)
#                                  carry bench/wheels-mooncake/mooncake-gpu.tar.xz and .whl
#   bash bench/owed_session.sh D   trained MTP on V2-Lite (issue 22), then --deterministic (issue 25)
#                                                                                        carry .whl
#   bash bench/owed_session.sh E   the KV MAC's and staging's GPU tests (GMAC on host copies, slot ids
#                                  through host_copy), then FP8 accuracy: every FP8 GEMM backend against
#                                  its dequantised twin, and the trained tiny model (issue 21)  no carry
# (.whl 42 MB + the Mooncake bundle 12 MB + .flashmla-src 3 MB fit one 64 MiB carry: carrying all
# three on every call lets any part run on a held machine.) The order is the order of value: a
# session that gets one call runs A, two runs A and B, and so on.
#
# Each part runs the existing session scripts, each into its own folder under $OUT with its own
# timeouts (cut to fit the call), and then packs everything into $OUT/part-<P>.tar.gz plus a
# summary.txt of each script's last lines: one file to fetch, whatever the scripts wrote.
#   bash bench/owed_session.sh --dry-run A   prints the commands without running them (CPU check).
set -uo pipefail
dry=""
if [ "${1:-}" = --dry-run ]; then dry=1; shift; fi
part=${1:-}
case "$part" in A|B|C|D|E) ;; *) echo "usage: bash bench/owed_session.sh [--dry-run] A|B|C|D|E"; exit 2 ;; esac
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
root=$OUT
mkdir -p "$root"
start=$(date +%s)

# One step: a name (its folder and log under $OUT) and a command run with OUT set to that folder.
step() {
    local name=$1; shift
    echo "== $name ($(( $(date +%s) - start )) s into the call): $*"
    [ -n "$dry" ] && return 0
    mkdir -p "$root/$name"
    (export OUT=$root/$name; eval "$@") >"$root/$name.log" 2>&1
    echo "   exit $? after $(( $(date +%s) - start )) s"
}

case "$part" in
A)
    step extend_graph 'TEST_TIMEOUT=70 BENCH_TIMEOUT=150 bash bench/extend_graph_session.sh'
    step decode_bs1 'TEST_TIMEOUT=70 BENCH_TIMEOUT=150 TILES_TIMEOUT=60 bash bench/decode_bs1_session.sh'
    ;;
B)
    step flashmla 'PARTS=build,tests BUILD_TIMEOUT=300 TEST_TIMEOUT=90 bash bench/flashmla_build.sh'
    step page_size 'source bench/gpu_setup.sh && (cd /tmp && timeout 40 python3 -m pytest -q -p no:cacheprovider -rs -m gpu "$OLDPWD/tests/model/kv/test_page_size.py") 2>&1 | tee "$OUT/tests.log"'
    step v3_slice 'source bench/gpu_setup.sh && timeout 150 python3 bench/v3_slice_gpu.py --out "$OUT/v3_slice.json"'
    ;;
C)
    step mooncake 'TEST_TIMEOUT=45 WRITE_TIMEOUT=75 MOONCAKE_GPU_TIMEOUT=120 bash bench/mooncake_gpu_session.sh'
    step threads 'THREADS_TIMEOUT=240 PART=threads bash bench/serving_step_session.sh'
    ;;
D)
    step mtp_trained 'source bench/gpu_setup.sh && timeout 290 python3 bench/mtp_trained_gpu.py --write-v2-lite /tmp/v2lite-mtp --device cuda --dtype bfloat16 --cuda-graph --data in-sample --budget-s 250 --lr 3e-3 --out "$OUT/mtp_trained.json"'
    step deterministic 'TEST_TIMEOUT=120 BENCH_TIMEOUT=100 bash bench/deterministic_session.sh'
    ;;
E)
    step mac_staging_tests 'source bench/gpu_setup.sh && (cd /tmp && timeout 150 python3 -m pytest -q -p no:cacheprovider -rs -s -m gpu "$OLDPWD/tests/workers/transport/test_kv_mac_cuda.py" "$OLDPWD/tests/workers/transport/test_staging_cuda.py" "$OLDPWD/tests/workers/transport/test_host_copy_staging_cuda.py") 2>&1 | tee "$OUT/tests.log"'
    step fp8_accuracy 'source bench/gpu_setup.sh && timeout 360 python3 bench/fp8_accuracy.py --device cuda --prefixes 1000 --out "$OUT/fp8_accuracy.json"'
    ;;
esac
[ -n "$dry" ] && exit 0

# Pack: one file back whatever the scripts wrote, and the tails to read first.
for log in "$root"/*.log; do
    echo "=== $(basename "$log")"; tail -25 "$log"
done >"$root/summary.txt"
tar -czf "$root/part-$part.tar.gz" -C "$root" --exclude "part-$part.tar.gz" --exclude summary.txt \
    $(cd "$root" && ls | grep -v -e "^part-$part.tar.gz$" -e '^summary.txt$')
find "$root" -mindepth 1 -maxdepth 1 ! -name "part-$part.tar.gz" ! -name summary.txt -exec rm -rf {} +
echo "part $part done in $(( $(date +%s) - start )) s: $root/part-$part.tar.gz, $root/summary.txt"
