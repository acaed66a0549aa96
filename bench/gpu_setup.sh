# Sourced by the bench/*_session.sh scripts at the start of a device call: installs the package
# without deps (the GPU image already has torch, triton and transformers), puts it on PYTHONPATH,
# installs any wheels carried in .whl/ (the router: smg, setproctitle, grpcio-health-checking, ...)
# or bench/wheels/ (git-ignored; the image lacks isal and mooncake), and records the device
# and library versions under $OUT. To carry the two optional bench wheels:
#   for w in isal==1.9.1 mooncake-transfer-engine-non-cuda==0.3.13.post1; do
#       .venv/bin/python -m pip download $w --only-binary=:all: --python-version 3.12 \
#           --platform manylinux2014_x86_64 --no-deps -d bench/wheels; done
# then pass carry=["bench/wheels"] to the device call. The 64 MiB a call carries do not fit the
# router's wheels (44 MB) and mooncake (46 MB) together (the CUDA build's engine alone, with the system
# libraries it links, is a 12 MB carry: bench/mooncake_gpu_bundle.sh): for the serving runs carry .whl/ alone with
# smg 1.13.0, smg-grpc-proto 0.4.28, grpcio 1.85.3, protobuf 7.36.2, grpcio-health-checking 1.85.1,
# setproctitle, isal (the crc32 of the byte stream; zlib's is slower) and py-spy (--profile; its
# binary lands in /tmp/site/bin, put on PATH here). The session scripts install wheels only
# through here; one that cannot run without the .whl/ wheels sets WHEELS_REQUIRED=1 before
# sourcing, and a missing or failed .whl/ install then ends the call.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
for wheels in .whl bench/wheels; do
    if ls "$wheels"/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/site "$wheels"/*.whl \
            >>"$OUT/install.log" 2>&1 && continue
        echo "note: $wheels/*.whl could not be installed (see $OUT/install.log)"
    fi
    if [ "$wheels" = .whl ] && [ -n "${WHEELS_REQUIRED:-}" ]; then
        echo "error: this session needs the .whl/ wheels installed (carry .whl)"; exit 1
    fi
done
export PYTHONPATH=/tmp/site
export PATH=/tmp/site/bin:$PATH  # console scripts of carried wheels (py-spy)
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
