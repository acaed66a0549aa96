#!/usr/bin/env bash
# One device call (see bench/gpu_setup.sh): issue 25's Mooncake TCP target, GPU pool to GPU pool on
# one GPU against raw Mooncake, by bench/mooncake_gpu.py with the CUDA 13 build of Mooncake.
#
#   here, once:  bash bench/mooncake_gpu_bundle.sh      -> bench/wheels-mooncake/mooncake-gpu.tar.xz (~12 MB)
#   device call: command "bash bench/mooncake_gpu_session.sh", carry ["bench/wheels-mooncake/mooncake-gpu.tar.xz"]
#
# The bundle (what the bench needs of mooncake-transfer-engine-cuda13: its engine, the libraries it
# loads, and Debian's libibverbs/libmlx5/libnuma/libcurl with theirs) is unpacked into
# /tmp/site-mooncake; a machine still held from an earlier call keeps it, so a later call may leave
# the carry out. The router's wheels are not needed. Of the carried system libraries only those the
# image lacks are linked in (/tmp/site-mooncake/lib, first on LD_LIBRARY_PATH), found by ldd; the CUDA
# runtime is the image's (CUDA 13, as torch's). Then the GPU tests of this path (tests.log: the bench's
# tiny GPU run, the build's name), then the bench with prefill writing (mooncake_gpu_write.log, write/), then
# the bench as the workers run by default, decode pulling: mooncake_gpu.log and mooncake_gpu.json in $OUT,
# its target table last. Extra arguments go to both runs of mooncake_gpu.py (e.g. --repeats 10).
source "$(dirname "$0")/gpu_setup.sh"
repo=$(pwd)
bundle=$repo/bench/wheels-mooncake/mooncake-gpu.tar.xz
site=/tmp/site-mooncake
if [ -f "$bundle" ]; then
    rm -rf "$site" && mkdir -p "$site" && python3 -m tarfile -e "$bundle" "$site" \
        || { echo "error: could not unpack $bundle"; exit 1; }
elif [ ! -f "$site/MANIFEST.txt" ]; then
    echo "error: carry bench/wheels-mooncake/mooncake-gpu.tar.xz (made here by bash bench/mooncake_gpu_bundle.sh)"
    exit 1
fi
head -1 "$site/MANIFEST.txt"

# CUDA 13's runtime: the toolkit's, else the pip package torch loads (nvidia/cu13/lib).
cudart=$(python3 -c '
import glob, os, site
roots = ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"] + site.getsitepackages()
hits = [hit for root in roots for pattern in ("libcudart.so.13*", "nvidia/*/lib/libcudart.so.13*")
        for hit in sorted(glob.glob(os.path.join(root, pattern)))]
print(hits[0] if hits else "")' 2>/dev/null)
mkdir -p "$site/lib"
export LD_LIBRARY_PATH=$site/lib${cudart:+:$(dirname "$cudart")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
engine=$site/site/mooncake/engine.so
for _ in 1 2 3 4 5 6 7 8; do  # a linked library may need others the image lacks: until none is added
    added=0
    for name in $(ldd "$engine" | awk '/not found/ {print $1}'); do
        if [ -f "$site/syslibs/$name" ] && [ ! -e "$site/lib/$name" ]; then
            ln -s "$site/syslibs/$name" "$site/lib/$name" && added=1
        fi
    done
    [ "$added" = 1 ] || break
done
echo "carried libraries linked in (the image lacks them): $(ls "$site/lib" | tr '\n' ' ')"
# libcudart.so.13 alone may stay unfound here: torch loads that soname before mooncake in every caller.
if ldd "$engine" | grep "not found" | grep -q -v "^\s*libcudart\.so\.13 "; then
    ldd "$engine" | tee "$OUT/mooncake_ldd.txt"
    echo "error: mooncake's engine.so still misses libraries (above; libcudart: ${cudart:-none found})"
    exit 1
fi
echo "libcudart: ${cudart:-none found outside torch}"
export PYTHONPATH=$site/site:$PYTHONPATH  # before /tmp/site, where a carried non-cuda wheel may sit
(cd /tmp && timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -rs --durations=4 \
    "$repo/tests/bench/test_mooncake_gpu_cuda.py" "$repo/tests/workers/transport/test_mooncake_build.py" 2>&1) \
    | tee "$OUT/tests.log"
# The other direction too (prefill writes), for the record: its log and JSON under $OUT/write/.
cd /tmp || exit 1
timeout "${WRITE_TIMEOUT:-150}" python3 "$repo/bench/mooncake_gpu.py" --device cuda --direction write \
    --out "$OUT/write" "$@" >"$OUT/mooncake_gpu_write.log" 2>&1 || echo "the write-direction run failed (its log)"
timeout "${MOONCAKE_GPU_TIMEOUT:-200}" python3 "$repo/bench/mooncake_gpu.py" --device cuda --out "$OUT" "$@" \
    2>&1 | tee "$OUT/mooncake_gpu.log"
rc=${PIPESTATUS[0]}
echo  # both tables last (Mooncake's own log lines end each run): written by prefill, then pulled by decode
grep -h -A4 "^issue 25 Mooncake GPU" "$OUT/mooncake_gpu_write.log" "$OUT/mooncake_gpu.log"
exit "$rc"
