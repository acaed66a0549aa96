#!/usr/bin/env bash
# Downloads FlashInfer 0.7.2.post1 and its runtime needs for the GPU machine into .whl/ (git-ignored
# through .git/info/exclude), trimming the FlashInfer wheel to a zip of what the MLA kernels need
# so that the project and the wheels fit one 64 MiB device carry (42 MB in all), plus the gRPC
# wheels the workers' GPU tests import (the image has grpcio 1.84, the generated code needs 1.85).
# Used by bench/mla_session.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
full="$(mktemp -d)"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$full" flashinfer-python==0.7.2.post1
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl apache-tvm-ffi==0.1.15.post2 ninja einops tabulate nvidia-ml-py \
    grpcio==1.85.3 protobuf==7.36.2 smg-grpc-proto==0.4.28 grpcio-health-checking==1.85.1
python3 - "$full"/flashinfer_python-*.whl .whl/flashinfer-0.7.2.post1-trimmed.zip <<'PY'
import sys, zipfile
# Sources of kernels other than MLA decode: Blackwell, sampling, fused MoE, and CUTLASS's extras.
DROP = tuple(f"flashinfer/{p}" for p in (
    "data/csrc/cake_sampling", "data/csrc/kda", "data/csrc/cake_dsv4", "data/csrc/gdn", "data/csrc/experimental",
    "data/csrc/blackwell", "data/csrc/cake_fmha", "data/csrc/fused_moe", "data/csrc/nv_internal",
    "data/cutlass/examples", "data/cutlass/python", "data/cutlass/test", "data/cutlass/tools",
    "data/cutlass/media", "data/cutlass/docs", "moe_ep/kernel_src/sm100", "moe_ep/kernel_src/sm120"))
src, dst = zipfile.ZipFile(sys.argv[1]), zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED)
for info in src.infolist():
    if not info.filename.startswith(DROP):
        dst.writestr(info, src.read(info.filename))
dst.close()
PY
rm -rf "$full"
du -sh .whl
