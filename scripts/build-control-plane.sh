#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager and kube-scheduler for the end-to-end tests (tests/k8s/).
#
# The sources are tests/k8s/controlplane: a tiny main per program around upstream's
# k8s.io/kubernetes/cmd/<program>/app, and a go.mod that pins the release (its `require k8s.io/kubernetes` line)
# and every k8s.io staging module to the matching v0.x. The binaries go into a cache directory
# keyed by that release, so a second run (or a second `make test`) does nothing:
#
#   ${DEEPSEEK_PD_KUBE_CACHE:-~/.cache/deepseek-pd/kube}/<release>/{kube-apiserver,kube-controller-manager,kube-scheduler}
#
# A stamp (hash of go.mod, go.sum and the mains) sits beside them: editing the sources rebuilds.
# Needs Go (go.mod's `go` line) and the Go module proxy; a cold build takes many minutes on two
# cores (the log is <dir>/build.log). kube-scheduler shares all but 6 of its 1449 packages with the
# other two (same module set, same GOCACHE), so it adds ~20 s to a cold build (measured here: its
# build right after the other two took 20 s). Prints the directory. Usage: scripts/build-control-plane.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
src="$repo/tests/k8s/controlplane"
release="$(sed -nE 's,^[[:space:]]*(require[[:space:]]+)?k8s\.io/kubernetes[[:space:]]+(v[^[:space:]]+).*,\2,p' "$src/go.mod" | head -n 1)"
[ -n "$release" ] || { echo "no 'require k8s.io/kubernetes' line in $src/go.mod" >&2; exit 1; }
dest="${DEEPSEEK_PD_KUBE_CACHE:-$HOME/.cache/deepseek-pd/kube}/$release"
programs=(kube-apiserver kube-controller-manager kube-scheduler)
stamp="$(cat "$src/go.mod" "$src/go.sum" "$src"/*/main.go | sha256sum | cut -c1-16)"

built() {
    [ "$(cat "$dest/stamp" 2>/dev/null)" = "$stamp" ] || return 1
    for p in "${programs[@]}"; do [ -x "$dest/$p" ] || return 1; done
}

if built; then echo "$dest"; exit 0; fi
command -v go >/dev/null || { echo "Go is not installed: cannot build the control plane" >&2; exit 1; }
mkdir -p "$dest"
exec 9>"$dest/.lock"
flock 9                              # a concurrent run waits, then finds the binaries built
if built; then echo "$dest"; exit 0; fi

minor="${release#v1.}"; minor="${minor%%.*}"
pkg="k8s.io/component-base/version"
# What the servers report as their version (helm checks a chart's kubeVersion against it).
ldflags="-s -w -X $pkg.gitVersion=$release -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
work="$(mktemp -d "$dest/.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
echo "building ${programs[*]} $release into $dest (log: $dest/build.log)" >&2
start=$SECONDS
# Two phases, timed apart in the log: the module download (network-bound) and the compile.
# One `go build` of both mains: the packages they share compile once, and the go tool keeps
# both cores busy to the end (two builds in a row would link the first on one core alone).
(
    cd "$src"
    CGO_ENABLED=0 nice -n 10 go list -deps "${programs[@]/#/./}" >/dev/null   # downloads what the build needs
    echo "modules downloaded in $((SECONDS - start)) s"
    compile=$SECONDS
    CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "$ldflags" -o "$work/" "${programs[@]/#/./}"
    echo "compiled and linked in $((SECONDS - compile)) s"
) >"$dest/build.log" 2>&1 || { tail -n 30 "$dest/build.log" >&2; exit 1; }
for p in "${programs[@]}"; do mv -f "$work/$p" "$dest/$p"; done
echo "$stamp" >"$dest/stamp"
echo "built in $((SECONDS - start)) s ($(grep -E '^(modules|compiled)' "$dest/build.log" | paste -sd ';' -))" |
    tee -a "$dest/build.log" >&2
echo "$dest"
