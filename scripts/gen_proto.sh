#!/usr/bin/env bash
# Regenerates the Python code of proto/*.proto (committed; tests check it is up to date).
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: proto/, next to the .proto files)
# The generated imports are rewritten from `import bootstrap_pb2` to the installed package path
# `deepseek_pd.proto.bootstrap_pb2`, since proto/ is mapped to deepseek_pd.proto.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/proto}"
python="${PYTHON:-$root/.venv/bin/python}"
mkdir -p "$out"
"$python" -m grpc_tools.protoc -I "$root/proto" \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    "$root"/proto/*.proto
for f in "$out"/*_pb2_grpc.py "$out"/*_pb2.py; do
    sed -i -E 's/^import ([a-z_0-9]+_pb2) as /from deepseek_pd.proto import \1 as /' "$f"
done
