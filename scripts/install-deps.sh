#!/bin/sh
# Install the Debian packages avgpipe needs to build, test and run its examples and benchmarks (only the
# missing ones; time: GNU time, which bench/bench_lib.sh reads each run's own CPU time from).
# --peer: also PyTorch (python3-torch, about 1 GB), which only bench/bench_peer.sh needs.
set -eu
PKGS="build-essential meson ninja-build pkg-config libcriterion-dev clang libopenblas-dev zlib1g-dev dataset-fashion-mnist libopenmpi-dev openmpi-bin libhwloc-dev time fortunes"
for a in "$@"; do
    case "$a" in
        --peer) PKGS="$PKGS python3-torch" ;;
        *) echo "usage: sh scripts/install-deps.sh [--peer]" >&2; exit 2 ;;
    esac
done
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
missing=""
for p in $PKGS; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "install-deps: installing$missing (apt-get update, then apt-get install)"
    $SUDO apt-get update -q
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
else
    echo "install-deps: everything is installed"
fi
