#!/bin/sh
# bench_fmnist: Fashion-MNIST samples/s on 2 pipeline stages (2 threads) against the same model trained
# single-threaded without pipelining (mlp_reference), both measured here, one epoch each, median of
# REPS runs. Two models: the default 784-512-256-128-10 (its first layer holds most of the work, so two
# stages cannot split it evenly) and 784-512-512-10, whose two stages cost about the same.
# Usage: sh bench/bench_fmnist.sh [BUILD_DIR] [REPS]
set -eu
B=${1:-build}
REPS=${2:-3}
[ -x "$B/fashion_mnist" ] && [ -x "$B/mlp_reference" ] || { echo "bench_fmnist: build first (sh scripts/build.sh)" >&2; exit 2; }

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# samples/s from each program's last line
rate_ref() { "$B/mlp_reference" --stages 2 --epochs 1 --eval-every 0 "$@" 2>&1 | tail -n 1 | sed -n 's/.* \([0-9][0-9]*\) samples\/s.*/\1/p'; }
rate_pipe() { "$B/fashion_mnist" --stages 2 --micro 4 --pipes 2 --epochs 1 "$@" 2>/dev/null | tail -n 1 | sed -n 's/.*(\([0-9][0-9]*\) samples\/s).*/\1/p'; }

echo "bench_fmnist: 1 epoch, median of $REPS runs, samples/s (2 cores)"
printf '%-22s %14s %14s %8s\n' model single-thread "2 stages" ratio
for hidden in 512,256,128 512,512; do
    r=""; p=""
    i=0
    while [ $i -lt "$REPS" ]; do
        r="$r $(rate_ref --hidden $hidden)"
        p="$p $(rate_pipe --hidden $hidden)"
        i=$((i + 1))
    done
    mr=$(echo $r | tr ' ' '\n' | median)
    mp=$(echo $p | tr ' ' '\n' | median)
    printf '%-22s %14s %14s %7.2fx\n' "784-$(echo $hidden | tr , -)-10" "$mr" "$mp" "$(echo "$mp $mr" | awk '{ print $1 / $2 }')"
done
echo "(2 stages: 4 micro-batches of 32, 2 parallel pipelines, advance with adaptive K, continuous rounds)"
