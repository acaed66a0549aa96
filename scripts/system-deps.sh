#!/usr/bin/env bash
# Installs the Debian packages the tests and the demo rely on, when missing and when we can.
set -euo pipefail
need=()
ldconfig -p | grep -q libibverbs.so.1 || need+=(libibverbs1)
command -v ip >/dev/null || need+=(iproute2)
command -v unshare >/dev/null || need+=(util-linux)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "missing Debian packages: ${need[*]} (run as root, or install them, to enable Mooncake tests)" >&2
    exit 0
fi
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
