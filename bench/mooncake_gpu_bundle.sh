#!/usr/bin/env bash
# Run HERE, once (needs pip, apt-get and dpkg-deb; not on the GPU machine, which reaches no network):
# packs what bench/mooncake_gpu_session.sh needs into one small git-ignored file to carry,
#     bench/wheels-mooncake/mooncake-gpu.tar.xz
# and prints the sizes.
#
# Why not carry the wheel: `mooncake-transfer-engine-cuda13` 0.3.14 (cp312, manylinux_2_28) is a 50 MB
# wheel, most of it Mooncake Store, EP and PG (165 MB unpacked), and beside the project's tree and
# the router's wheels it does not fit one call's 64 MiB. The bench imports only `mooncake.engine`, so
# the bundle holds, unchanged from the wheel: mooncake/__init__.py, mooncake/engine.so and the
# libraries engine.so loads from the wheel (its RPATH: $ORIGIN and ../mooncake_transfer_engine_cuda13.libs),
# plus the dist-info (workers/transport/mooncake_build.py names the build by it). engine.so also links
# system libraries the GPU image may lack (libibverbs, libmlx5, libnuma, libcurl and theirs): each is
# taken from its Debian package (apt-get download, dpkg-deb -x; the packages this machine has
# installed) into syslibs/, and the session links only those the image lacks. glibc, libstdc++ and
# libgcc are the image's own; libcuda (the driver) and libcudart.so.13 (CUDA 13, the image's torch) too.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=bench/wheels-mooncake
VERSION=${MOONCAKE_VERSION:-0.3.14}
PYTHON=${PYTHON:-.venv/bin/python}
BUNDLE=$DIR/mooncake-gpu.tar.xz
mkdir -p "$DIR"

find_wheel() { ls "$DIR"/mooncake_transfer_engine_cuda13-"$VERSION"-cp312-*.whl 2>/dev/null | head -1; }
wheel=$(find_wheel)
if [ -z "$wheel" ]; then
    "$PYTHON" -m pip download -q "mooncake-transfer-engine-cuda13==$VERSION" --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux2014_x86_64 -d "$DIR"
    wheel=$(find_wheel)
fi
[ -n "$wheel" ] || { echo "error: no cp312 wheel of mooncake-transfer-engine-cuda13 $VERSION in $DIR"; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unzip -q "$wheel" -d "$work/wheel"
stage=$work/bundle
mkdir -p "$stage/site/mooncake" "$stage/syslibs" "$work/debs" "$work/x"
chmod 755 "$work" && chmod 777 "$work/debs"  # apt-get download writes as its own user (_apt)
cp "$work/wheel/mooncake/__init__.py" "$work/wheel/mooncake/engine.so" "$stage/site/mooncake/"
cp -r "$work/wheel"/mooncake_transfer_engine_cuda13-*.dist-info "$stage/site/"

# Everything engine.so loads, transitively, as this machine resolves it.
ldd "$work/wheel/mooncake/engine.so" >"$work/ldd.txt"
IMAGE_OWN='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s)\.so'
missing=$(awk '/not found/ {print $1}' "$work/ldd.txt" | grep -v -E '^(libcuda\.so\.1|libcudart\.so\.13)$' || true)
if [ -n "$missing" ]; then
    echo "error: engine.so needs $missing, not installed here (apt-get install libibverbs1 ibverbs-providers libnuma1 libcurl4)"
    exit 1
fi
manifest=$stage/MANIFEST.txt
echo "wheel $(basename "$wheel") sha256 $(sha256sum "$wheel" | cut -d' ' -f1)" >"$manifest"
while read -r name _ path _; do
    case "$path" in
        "$work"/wheel/*)  # from the wheel: kept where engine.so's RPATH looks for it
            rel=$(realpath -m --relative-to="$work/wheel" "$path")
            mkdir -p "$stage/site/$(dirname "$rel")"
            cp "$path" "$stage/site/$rel"
            echo "wheel $rel" >>"$manifest";;
        /*)
            if [[ "$name" =~ $IMAGE_OWN ]]; then continue; fi
            real=$(readlink -f "$path")
            package=$(dpkg -S "$real" 2>/dev/null || dpkg -S "${real/#\/usr\/lib\//\/lib\/}" 2>/dev/null \
                      || dpkg -S "${real/#\/lib\//\/usr\/lib\/}" 2>/dev/null) \
                || { echo "error: no Debian package holds $real ($name)"; exit 1; }
            package=${package%%:*}
            # The installed version when the archive still has it, else the archive's (same soname).
            if [ -z "$(ls "$work/debs/$package"_*.deb 2>/dev/null)" ]; then
                installed=$(dpkg-query -W -f='${Version}' "$package")
                (cd "$work/debs" && { apt-get download -q "$package=$installed" || apt-get download -q "$package"; }) \
                    >/dev/null 2>"$work/apt.log" \
                    || { cat "$work/apt.log"; echo "error: apt-get download $package failed (apt-get update?)"; exit 1; }
            fi
            version=$(dpkg-deb -f "$work/debs/$package"_*.deb Version)
            rm -rf "$work/x" && mkdir "$work/x" && dpkg-deb -x "$work/debs/$package"_*.deb "$work/x"
            file=$(find "$work/x" -name "$name" | head -1)
            [ -n "$file" ] || { echo "error: $package's .deb has no $name"; exit 1; }
            cp -L "$file" "$stage/syslibs/$name"
            echo "deb $name $package $version" >>"$manifest";;
    esac
done < <(grep '=>' "$work/ldd.txt")

tar -C "$stage" -cJf "$BUNDLE" .
raw=$(du -sb "$stage" | cut -f1)
echo "wheel:  $(basename "$wheel")  $(stat -c %s "$wheel") bytes (not carried)"
echo "bundle: $BUNDLE  $(stat -c %s "$BUNDLE") bytes ($raw unpacked)"
sed 's/^/  /' "$manifest"
echo "carry it: carry=[\"$BUNDLE\"]; the device command: bash bench/mooncake_gpu_session.sh"
