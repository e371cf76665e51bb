#!/bin/sh
# Build and run every test (Criterion suites, compile tests, examples, CLI, the runtime over MPI); prints
# each suite's output. Then the same tests once more under AddressSanitizer + UndefinedBehaviorSanitizer
# (build-san/), and the threaded suites under ThreadSanitizer (build-tsan/); quiet unless something fails.
set -eu
cd "$(dirname "$0")/.."
sh scripts/build.sh
meson test -C build --verbose --print-errorlogs
echo
echo "== the tests again under AddressSanitizer + UndefinedBehaviorSanitizer (build-san/) =="
if [ -f build-san/build.ninja ]; then
    meson setup --reconfigure build-san >/dev/null
else
    meson setup build-san -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debugoptimized >/dev/null
fi
meson compile -C build-san >/dev/null
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 meson test -C build-san --print-errorlogs
echo
echo "== the threaded suites (runtime, streams, opaque device, comm, averaging, tuner search) under ThreadSanitizer (build-tsan/) =="
if [ -f build-tsan/build.ninja ]; then
    meson setup --reconfigure build-tsan >/dev/null
else
    meson setup build-tsan -Db_sanitize=thread -Dbuildtype=debugoptimized >/dev/null
fi
meson compile -C build-tsan test_comm_tsan test_ea_tsan test_runtime_tsan test_tie_run_tsan test_streams_tsan test_opaque_tsan test_tune_threads_tsan >/dev/null
meson test -C build-tsan --no-rebuild --print-errorlogs
