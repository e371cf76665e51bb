#!/bin/sh
# bench_mpi: one pipeline rank per MPI process against one rank per thread, on this machine (S = 2).
#   1. The runtime's cost per op with empty callbacks (build/bench_mpi: 1F1B, M = 32), threads vs 2 MPI
#      processes, at 256 B and 64 KiB activations.
#   2. Fashion-MNIST samples/s, 2 stages: `fashion_mnist --stages 2` (2 threads) vs
#      `mpirun -np 2 fashion_mnist --backend mpi --stages 2`, 1 epoch, --micro 4 --pipes 2.
# Runs alternate between the two (REPS passes), medians and spreads are printed, and the ratio
# MPI / threads of the medians (target: samples/s >= 0.9). Nothing is asserted.
# Usage: sh bench/bench_mpi.sh [BUILD_DIR] [REPS]
set -eu
B=${1:-build}
REPS=${2:-5}
[ -x "$B/bench_mpi" ] && [ -x "$B/fashion_mnist" ] || { echo "bench_mpi: build first (sh scripts/build.sh, with MPI)" >&2; exit 2; }
MPIRUN="mpirun --oversubscribe --bind-to none"
[ "$(id -u)" -eq 0 ] && MPIRUN="$MPIRUN --allow-run-as-root"

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
spread() { sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf "%s..%s", lo, hi }'; }

# alternate CMD_A CMD_B: REPS passes of each, alternating; sets $ta and $tb to the lists of their outputs.
alternate() {
    ta=""; tb=""
    i=0
    while [ $i -lt "$REPS" ]; do
        ta="$ta $(eval "$1")"
        tb="$tb $(eval "$2")"
        i=$((i + 1))
    done
}
# summary LIST: median (lo..hi)
summary() { printf '%s (%s)' "$(echo $1 | tr ' ' '\n' | median)" "$(echo $1 | tr ' ' '\n' | spread)"; }
ratio() { echo "$(echo $1 | tr ' ' '\n' | median) $(echo $2 | tr ' ' '\n' | median)" | awk '{ print $1 / $2 }'; }

echo "bench_mpi: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $REPS passes (threads and MPI alternate)"
for bytes in 256 65536; do
    alternate "\"$B/bench_mpi\" threads 3 $bytes | sed -n 's/.*median \([0-9.]*\) .*/\1/p'" \
              "$MPIRUN -np 2 \"$B/bench_mpi\" mpi 3 $bytes | sed -n 's/.*median \([0-9.]*\) .*/\1/p'"
    printf 'per-op cost, %6s B activations: threads %s us/op, MPI %s us/op: MPI / threads %.2fx\n' "$bytes" "$(summary "$ta")" \
        "$(summary "$tb")" "$(ratio "$tb" "$ta")"
done

rate() { sed -n 's/.*(\([0-9][0-9]*\) samples\/s).*/\1/p' | tail -n 1; }
kernel=$("$B/fashion_mnist" --stages 2 --micro 4 --pipes 2 --epochs 1 --limit-train 2048 2>/dev/null | sed -n 's/^BLAS: //p' | head -n 1)
FM="--stages 2 --micro 4 --pipes 2 --epochs 1"
alternate "\"$B/fashion_mnist\" $FM 2>/dev/null | rate" "$MPIRUN -np 2 \"$B/fashion_mnist\" --backend mpi $FM 2>/dev/null | rate"
printf 'Fashion-MNIST, 2 stages, 1 epoch (%s): threads %s samples/s, MPI %s samples/s: MPI / threads %.2f (target >= 0.9)\n' \
    "${kernel:-BLAS kernel not reported}" "$(summary "$ta")" "$(summary "$tb")" "$(ratio "$tb" "$ta")"
