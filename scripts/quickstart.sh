#!/bin/sh
# Quick start: install what is missing, build what the main job needs, and run it: Fashion-MNIST MLP training
# on 4 pipeline stages (threads), the tuner's choice of schedule and parallel pipelines, elastic averaging.
# Only the main job and the avgpipe tool are built here (seconds); sh scripts/test.sh builds the rest.
set -eu
cd "$(dirname "$0")/.."
step() { printf '\n== quickstart: %s ==\n' "$*"; }
step "1/3 the Debian packages avgpipe needs (apt-get; a minute or two on a fresh machine)"
sh scripts/install-deps.sh
step "2/3 configuring (meson) and building the main job and the avgpipe tool"
sh scripts/build.sh fashion_mnist avgpipe
step "3/3 the main job: ./build/fashion_mnist --trace build/fashion_mnist_trace.json $*"
./build/fashion_mnist --trace build/fashion_mnist_trace.json "$@"
echo
echo "Chrome trace of the last iteration: build/fashion_mnist_trace.json (open it in https://ui.perfetto.dev)"
echo "Schedules side by side: ./build/avgpipe compare --schedule 1f1b,advance,afab --stages 4 --micro 8 --advance 3 --comm-latency 1"
echo "Every test: sh scripts/test.sh"
