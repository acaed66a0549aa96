# Sourced by the bench/*_session.sh scripts at the start of a device call: installs the package
# without deps (the GPU image already has torch, triton and transformers), puts it on PYTHONPATH,
# and records the device and library versions under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
