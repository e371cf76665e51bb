#!/bin/sh
# Build and run every test (Criterion suites, compile tests, CLI tests); prints each suite's output.
set -eu
cd "$(dirname "$0")/.."
sh scripts/build.sh
meson test -C build --verbose --print-errorlogs
