#!/bin/sh
# bench_gpt: tokens/s of the main job (build/gpt: the byte-level GPT on the fortunes corpus) against the same
# model trained without a pipeline (build/gpt_reference), on this machine's cores:
#   gpt_reference                    one thread, the plain loop (the bit-for-bit baseline)
#   gpt_reference --threads 2        two threads over the micro-batches of each step (data parallel inside a
#                                    step, gradients added in thread order: what one writes without a library)
#   gpt                              the main job as it runs by default: tuned (split, schedule, M, N, K), 2 stages
#   gpt --stages 2 --micro 2 --pipes 1   2 stages, the reference's own M and one pipeline (the split still the
#                                    partitioner's): the pipeline without the tuner's setting
# The default model (4 layers, 128 channels, 4 heads, context 64) and batch (16 windows a step: M = 2 of 8
# windows for the references), STEPS steps per run (default 300); tokens are non-padding positions, the time is
# the training's own (not the tuner's profile, the data loading or the evaluation). The runs alternate (each
# kind once per repetition) REPS times (default 3); medians, the spread (slowest run over the fastest) and the
# ratios of the medians. Runs during which other programs used >= BENCH_MAX_OTHERS cores (default 0.15) are
# waited out and redone (bench/bench_lib.sh). Targets (the issue's): the main job >= 1.8x the single thread and
# >= 1.1x the two threads; llm.c's CPU trainer is quoted beside (not measured here).
# Usage: sh bench/bench_gpt.sh [BUILD_DIR] [REPS] [STEPS]
set -eu
B=${1:-build}
REPS=${2:-3}
STEPS=${3:-300}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/bench_lib.sh"
[ -x "$B/gpt" ] && [ -x "$B/gpt_reference" ] || { echo "bench_gpt: build first (sh scripts/build.sh gpt gpt_reference)" >&2; exit 2; }
[ -d /usr/share/games/fortunes ] || { echo "bench_gpt: no fortunes corpus (apt-get install fortunes)" >&2; exit 2; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/bench_gpt.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

common="--steps $STEPS --eval-every 0 --sample-len 0 --log-every 100000"
rate() { sed -n 's/^done: .* \([0-9][0-9]*\) tokens\/s$/\1/p' "$1" | tail -n 1; }
setting_of() { sed -n 's/.*tuner: chose \([^:]*\):.*/\1/p' "$1" | tail -n 1; }
split_of() { sed -n 's/.*tuner: split \([0-9,]*\) .*/\1/p' "$1" | tail -n 1; }

kernel=$("$B/gpt_reference" --steps 1 --eval-every 0 --sample-len 0 --layers 1 --channels 16 --heads 1 --seq 8 | sed -n 's/^BLAS: \([^,]*, kernel [^,]*\).*/\1/p')
echo "bench_gpt: $STEPS steps per run, $REPS runs each, alternating; medians (spread = slowest/fastest run); $(nproc) cores"
echo "BLAS: $kernel"
r1=""; r2=""; p=""; q=""; others=""
i=0
while [ "$i" -lt "$REPS" ]; do
    bench_run "$TMP/r1" "$B/gpt_reference" $common; others="$others $BENCH_OTHERS"; r1="$r1 $(rate "$TMP/r1")"
    bench_run "$TMP/p" "$B/gpt" $common; others="$others $BENCH_OTHERS"; p="$p $(rate "$TMP/p")"; cp "$TMP/p" "$TMP/p.last"
    bench_run "$TMP/r2" "$B/gpt_reference" --threads 2 $common; others="$others $BENCH_OTHERS"; r2="$r2 $(rate "$TMP/r2")"
    bench_run "$TMP/q" "$B/gpt" --stages 2 --micro 2 --pipes 1 $common; others="$others $BENCH_OTHERS"; q="$q $(rate "$TMP/q")"
    cp "$TMP/q" "$TMP/q.last"
    i=$((i + 1))
done
m1=$(echo $r1 | bench_list | bench_median)
m2=$(echo $r2 | bench_list | bench_median)
printf '%-58s %10s %7s %9s %9s\n' run tokens/s spread "vs 1 thr" "vs 2 thr"
row() { # row LABEL RATES
    awk -v l="$1" -v m="$(echo $2 | bench_list | bench_median)" -v s="$(echo $2 | bench_list | bench_spread)" -v a="$m1" -v b="$m2" 'BEGIN {
        printf "%-58s %10.0f %7s %8.2fx %8.2fx\n", l, m, s, m / a, m / b }'
}
row "gpt_reference, 1 thread" "$r1"
row "gpt_reference --threads 2" "$r2"
row "gpt (tuned: $(setting_of "$TMP/p.last"), split $(split_of "$TMP/p.last"))" "$p"
row "gpt --stages 2 --micro 2 --pipes 1 (split $(split_of "$TMP/q.last"))" "$q"
printf '%-58s %10s %7s %8.2fx %8.2fx   (quoted: llm.c CPU, 4 layers, 128 channels, T 64, B 8, 2 cores; not measured here)\n' \
    "llm.c train_gpt2 (CPU)" 5600 - "$(awk -v a="$m1" 'BEGIN { print 5600 / a }')" "$(awk -v b="$m2" 'BEGIN { print 5600 / b }')"
pm=$(echo $p | bench_list | bench_median)
awk -v m="$pm" -v a="$m1" -v b="$m2" 'BEGIN {
    printf "targets: tuned gpt >= 1.8x one thread: %.2fx (%s); >= 1.1x two threads: %.2fx (%s)\n", m / a, (m / a >= 1.8 ? "met" : "missed"),
        m / b, (m / b >= 1.1 ? "met" : "missed") }'
echo "  (others used$(echo $others | bench_list | awk '{ printf " %s", $1 }') cores during the kept runs)"
echo "$BENCH_REDONE runs redone because other programs used >= $BENCH_MAX_OTHERS cores; kernel: $kernel"
