#!/bin/sh
# Run a libFuzzer harness (tests/fuzz/meson.build: tests fuzz-regress-* and fuzz-*).
#
#   usage: tests/fuzz/fuzz.sh once HARNESS CORPUS...
#          tests/fuzz/fuzz.sh fuzz HARNESS WORKDIR CORPUS...
#
# once: every input of the CORPUS folders once (regression inputs and seeds).
# fuzz: fuzz for $AVGPIPE_FUZZ_SECONDS seconds (default 60; 0 skips), starting from the CORPUS folders
# (read only). New inputs go to WORKDIR/corpus, kept between runs so that each run goes on from the
# last; a crashing input goes to WORKDIR/crash-* and is printed (hex and base64). To keep it as a
# regression input, copy it to tests/fuzz/regress/<harness>/ with a name that says what it found.
#
# Limits per input, both modes: 10 s, no single allocation over 256 MiB (fuzzed inputs are at most
# 4 KiB: an allocation that large does not follow the input), 1 GiB in all.
set -eu
limits="-timeout=10 -malloc_limit_mb=256 -rss_limit_mb=1024"
mode=$1
bin=$2
shift 2
case $mode in
once)
    exec "$bin" -runs=0 $limits "$@"
    ;;
fuzz)
    work=$1
    shift
    secs=${AVGPIPE_FUZZ_SECONDS:-60}
    case $secs in
    '' | *[!0-9]*)
        echo "AVGPIPE_FUZZ_SECONDS: expected a whole number of seconds, got '$secs'" >&2
        exit 2
        ;;
    esac
    if [ "$secs" -eq 0 ]; then
        echo "AVGPIPE_FUZZ_SECONDS=0: not fuzzing"
        exit 77 # meson: skipped
    fi
    mkdir -p "$work/corpus"
    # -verbosity=0: no line per new input (thousands in a minute); crashes are reported in full
    exec "$bin" -max_total_time="$secs" $limits -verbosity=0 -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus" "$@"
    ;;
*)
    echo "usage: $0 once HARNESS CORPUS... | $0 fuzz HARNESS WORKDIR CORPUS..." >&2
    exit 2
    ;;
esac
