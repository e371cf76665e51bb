#!/bin/sh
# Quick start: install what is missing, build, and run the main job.
set -eu
cd "$(dirname "$0")/.."
sh scripts/install-deps.sh
sh scripts/build.sh
echo
echo "== The main job: 1F1B vs AvgPipe's advance forward vs AFAB, 4 stages, 8 micro-batches, transfers as costly as a forward"
./build/avgpipe compare --schedule 1f1b,advance,afab --stages 4 --micro 8 --advance 3 --comm-latency 1
for s in 1f1b advance afab; do
    echo
    ./build/avgpipe sim --schedule "$s" --stages 4 --micro 8 --advance 3 --comm-latency 1 \
        --trace "build/$s.json" --svg "build/$s.svg"
done
echo
echo "Chrome traces and SVG timelines: build/{1f1b,advance,afab}.{json,svg} (open the .json in https://ui.perfetto.dev)"
