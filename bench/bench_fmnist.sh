#!/bin/sh
# bench_fmnist: Fashion-MNIST samples/s of the pipelined trainer against the same model trained in one
# thread without pipelining (mlp_reference, at M = 1 and at its default M = 4: the faster is the
# baseline), and against the bound the model's layers set: the single-thread rate divided by the busiest
# stage's share of the work (what the tuner's partitioner reports: "stage g, the busiest, does X% of the
# work"). One epoch per run; the runs alternate (reference, pipelined, ...) REPS times; medians, and the
# spread (slowest run over the fastest).
#   784-512-256-128-10   the main job's model: layer 0 holds most of the work, no split balances it;
#                        2 stages (tuned, split auto), and the main job as it runs by default (4 stages)
#   784-512-512-10       the model this benchmark used before (stage 0 does ~53% of the work)
#   784-512-512-512-512-10  a model whose layers split into two stages of equal work (2 + 3 layers: ~50%)
# Runs during which other programs used >= BENCH_MAX_OTHERS cores (default 0.15) are waited out and redone
# (bench/bench_lib.sh). The BLAS kernel is printed next to the timings (the programs' first line).
# Usage: sh bench/bench_fmnist.sh [BUILD_DIR] [REPS]
set -eu
B=${1:-build}
REPS=${2:-3}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/bench_lib.sh"
[ -x "$B/fashion_mnist" ] && [ -x "$B/mlp_reference" ] || { echo "bench_fmnist: build first (sh scripts/build.sh)" >&2; exit 2; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/bench_fmnist.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

rate_ref() { tail -n 1 "$1" | sed -n 's/.* \([0-9][0-9]*\) samples\/s.*/\1/p'; }
rate_pipe() { grep '^trained' "$1" | sed -n 's/.*(\([0-9][0-9]*\) samples\/s).*/\1/p'; }
share_of() { sed -n 's/.*the busiest, does \([0-9.]*\)% of the work.*/\1/p' "$1" | tail -n 1; }
split_of() { sed -n 's/.*tuner: split \([0-9,]*\) .*/\1/p' "$1" | tail -n 1; }
setting_of() { sed -n 's/.*tuner: chose \([^:]*\):.*/\1/p' "$1" | tail -n 1; }

kernel=$("$B/mlp_reference" --help >/dev/null 2>&1; "$B/mlp_reference" --epochs 1 --limit-train 256 --eval-every 0 | sed -n 's/^BLAS: //p')
echo "bench_fmnist: 1 epoch per run, $REPS runs each, alternating; medians (spread = slowest/fastest run); $(nproc) cores"
echo "BLAS: $kernel"
printf '%-20s %-34s %10s %7s %9s %9s %9s\n' model run samples/s spread "vs 1 thr" bound "of bound"
for hidden in 512,256,128 512,512 512,512,512,512; do
    name="784-$(echo $hidden | tr , -)-10"
    r1=""; r4=""; p=""; mj=""; sh2=""; shm=""; others=""
    i=0
    while [ "$i" -lt "$REPS" ]; do
        bench_run "$TMP/r1" "$B/mlp_reference" --stages 2 --epochs 1 --eval-every 0 --micro 1 --hidden $hidden; others="$others $BENCH_OTHERS"
        r1="$r1 $(rate_ref "$TMP/r1")"
        bench_run "$TMP/p" "$B/fashion_mnist" --stages 2 --epochs 1 --hidden $hidden; others="$others $BENCH_OTHERS"
        p="$p $(rate_pipe "$TMP/p")"; sh2="$sh2 $(share_of "$TMP/p")"; cp "$TMP/p" "$TMP/p.last"
        bench_run "$TMP/r4" "$B/mlp_reference" --stages 2 --epochs 1 --eval-every 0 --micro 4 --hidden $hidden; others="$others $BENCH_OTHERS"
        r4="$r4 $(rate_ref "$TMP/r4")"
        if [ "$hidden" = 512,256,128 ]; then
            bench_run "$TMP/m" "$B/fashion_mnist" --epochs 1; others="$others $BENCH_OTHERS"
            mj="$mj $(rate_pipe "$TMP/m")"; shm="$shm $(share_of "$TMP/m")"; cp "$TMP/m" "$TMP/m.last"
        fi
        i=$((i + 1))
    done
    m1=$(echo $r1 | bench_list | bench_median); m4=$(echo $r4 | bench_list | bench_median)
    ref=$(awk -v a="$m1" -v b="$m4" 'BEGIN { print (a > b ? a : b) }')
    row() { # row LABEL RATES SHARES
        med=$(echo $2 | bench_list | bench_median)
        share=$(echo $3 | bench_list | bench_median)
        awk -v n="$name" -v l="$1" -v m="$med" -v s="$(echo $2 | bench_list | bench_spread)" -v r="$ref" -v sh="$share" 'BEGIN {
            if (sh > 0) printf "%-20s %-34s %10.0f %7s %8.2fx %8.2fx %9.2f\n", n, l, m, s, m / r, 100 / sh, m / (r * 100 / sh)
            else printf "%-20s %-34s %10.0f %7s %8.2fx %9s %9s\n", n, l, m, s, m / r, "-", "-" }'
    }
    row "1 thread, M = 1 (mlp_reference)" "$r1" ""
    row "1 thread, M = 4 (mlp_reference)" "$r4" ""
    row "2 stages: $(setting_of "$TMP/p.last"), split $(split_of "$TMP/p.last")" "$p" "$sh2"
    [ -n "$mj" ] && row "main job: $(setting_of "$TMP/m.last")" "$mj" "$shm"
    echo "  (others used$(echo $others | bench_list | awk '{ printf " %s", $1 }') cores during the kept runs)"
done
echo "vs 1 thr: over the faster single-thread run; bound: 1 / the busiest stage's share of the work (the tuner's"
echo "partitioner, at the chosen micro-batch size); of bound: samples/s over (single-thread samples/s x bound)."
echo "$BENCH_REDONE runs redone because other programs used >= $BENCH_MAX_OTHERS cores; kernel: $kernel"
