#!/bin/sh
# Install the Debian packages avgpipe needs to build, test and run its examples (only the missing ones).
set -eu
PKGS="build-essential meson ninja-build pkg-config libcriterion-dev clang libopenblas-dev zlib1g-dev dataset-fashion-mnist libopenmpi-dev openmpi-bin libhwloc-dev"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
missing=""
for p in $PKGS; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "install-deps: installing$missing"
    $SUDO apt-get update -q
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
else
    echo "install-deps: everything is installed"
fi
