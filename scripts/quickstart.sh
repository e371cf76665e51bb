#!/bin/sh
# Quick start: install what is missing, build, and run the main job: Fashion-MNIST MLP training on
# 4 pipeline stages (threads), 2 parallel pipelines, advance forward with adaptive K, elastic averaging.
set -eu
cd "$(dirname "$0")/.."
sh scripts/install-deps.sh
sh scripts/build.sh
echo
./build/fashion_mnist --trace build/fashion_mnist_trace.json "$@"
echo
echo "Chrome trace of the last iteration: build/fashion_mnist_trace.json (open it in https://ui.perfetto.dev)"
echo "Schedules side by side: ./build/avgpipe compare --schedule 1f1b,advance,afab --stages 4 --micro 8 --advance 3 --comm-latency 1"
