#!/bin/sh
# Configure (once) and build into ./build: everything, or only the targets named (sh scripts/build.sh fashion_mnist).
set -eu
cd "$(dirname "$0")/.."
if [ -f build/build.ninja ]; then
    meson setup --reconfigure build >/dev/null
else
    meson setup build
fi
meson compile -C build "$@"
