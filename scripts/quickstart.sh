#!/bin/sh
# Quick start: install what is missing, build what the main job needs, and run it: a byte-level GPT trained on
# the fortunes corpus on 2 pipeline stages (threads), the tuner's choice of split, schedule and parallel
# pipelines, elastic averaging, the tied embedding and gradient clipping run by the runtime.
# Only the main job and the avgpipe tool are built here (seconds); sh scripts/test.sh builds the rest.
set -eu
cd "$(dirname "$0")/.."
step() { printf '\n== quickstart: %s ==\n' "$*"; }
step "1/3 the Debian packages avgpipe needs (apt-get; a minute or two on a fresh machine)"
sh scripts/install-deps.sh
step "2/3 configuring (meson) and building the main job and the avgpipe tool"
sh scripts/build.sh gpt avgpipe
step "3/3 the main job: ./build/gpt --trace build/gpt_trace.json $* (2-3 minutes on 2 cores)"
./build/gpt --trace build/gpt_trace.json "$@"
echo
echo "Chrome trace of the last iteration: build/gpt_trace.json (open it in https://ui.perfetto.dev)"
echo "Schedules side by side: ./build/avgpipe compare --schedule 1f1b,advance,afab --stages 4 --micro 8 --advance 3 --comm-latency 1"
echo "The same model in a plain loop, bit for bit: sh scripts/build.sh gpt_reference; ./build/gpt_reference --help"
echo "Every test: sh scripts/test.sh"
