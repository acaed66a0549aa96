#!/usr/bin/env bash
# Fetches the CRDs of third-party kinds the operator renders (ServiceMonitor, PodGroup) from their
# Go modules, pinned with their go.sum hash in scripts/third-party-crds.txt, through the Go module
# proxy, into a cache keyed by module and version (a no-op once cached):
#
#   ${DEEPSEEK_PD_CRD_CACHE:-~/.cache/deepseek-pd/crds}/<module>@<version>/<crd>.yaml
#
# The tests validate those kinds with these CRDs: installed into the tests' kube-apiserver, and as
# the JSON schema of the same files in the fast unit tests (tests/support/pdtest/crd_schemas.py).
# Prints one directory per module. Needs Go. Usage: scripts/fetch-third-party-crds.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
pins="$repo/scripts/third-party-crds.txt"
cache="${DEEPSEEK_PD_CRD_CACHE:-$HOME/.cache/deepseek-pd/crds}"
empty="$(mktemp -d)"
trap 'rmdir "$empty"' EXIT

fetched() {  # every CRD file of the line is in its directory
    local dest="$1"; shift
    for path in "$@"; do [ -s "$dest/$(basename "$path")" ] || return 1; done
}

json_field() {  # the value of "field" in `go mod download -json` output
    sed -nE "s/^[[:space:]]*\"$1\": \"(.*)\",?$/\1/p" | head -n 1
}

while read -r module version sum paths; do
    case "$module" in ''|'#'*) continue ;; esac
    read -r -a files <<<"$paths"
    dest="$cache/$module@$version"
    if ! fetched "$dest" "${files[@]}"; then
        command -v go >/dev/null || { echo "Go is not installed: cannot fetch $module@$version" >&2; exit 1; }
        mkdir -p "$dest"
        exec 9>"$dest/.lock"
        flock 9                      # a concurrent run waits, then finds the files
        if ! fetched "$dest" "${files[@]}"; then
            # Outside any module (an empty directory): the download is of this one version only.
            info="$(cd "$empty" && GOFLAGS=-mod=mod go mod download -json "$module@$version")" || {
                echo "go mod download $module@$version failed:" >&2; echo "$info" >&2; exit 1; }
            got="$(json_field Sum <<<"$info")"
            dir="$(json_field Dir <<<"$info")"
            [ "$got" = "$sum" ] || {
                echo "$module@$version: the proxy served $got, scripts/third-party-crds.txt pins $sum" >&2; exit 1; }
            for path in "${files[@]}"; do
                [ -s "$dir/$path" ] || { echo "$module@$version has no $path" >&2; exit 1; }
                cp "$dir/$path" "$dest/.$(basename "$path").tmp"
                mv -f "$dest/.$(basename "$path").tmp" "$dest/$(basename "$path")"
            done
        fi
        exec 9>&-
    fi
    echo "$dest"
done <"$pins"
