#!/bin/sh
# bench_peer: the main job (build/fashion_mnist as it runs by default: tuned, split auto) against PyTorch
# (bench/peer_torch.py: the same model, data, batch and optimizer) on the same OpenBLAS kernel, PyTorch in
# 1 and in 2 threads; one epoch per run, the three alternating REPS times; medians, spread (slowest run
# over the fastest), and the main job's samples/s over PyTorch's best. PyTorch gets OPENBLAS_CORETYPE set
# to the kernel the main job ran (examples/blas_kernel.h may have restarted it with a better one than
# OpenBLAS picks), unless it is set already.
# Needs Debian's PyTorch (sh scripts/install-deps.sh --peer), run by /usr/bin/python3 (PYTHON overrides).
# Runs during which other programs used >= BENCH_MAX_OTHERS cores (default 0.15) are waited out and redone.
# Usage: sh bench/bench_peer.sh [BUILD_DIR] [REPS]
set -eu
B=${1:-build}
REPS=${2:-3}
PY=${PYTHON:-/usr/bin/python3}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/bench_lib.sh"
[ -x "$B/fashion_mnist" ] || { echo "bench_peer: build first (sh scripts/build.sh)" >&2; exit 2; }
"$PY" -c 'import torch' 2>/dev/null || { echo "bench_peer: $PY cannot import torch (sh scripts/install-deps.sh --peer: Debian's python3-torch)" >&2; exit 2; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/bench_peer.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

rate() { grep '^trained' "$1" | sed -n 's/.*(\([0-9][0-9]*\) samples\/s).*/\1/p'; }
blas() { sed -n 's/^BLAS: //p' "$1" | head -n 1; }

main=""; t1=""; t2=""; others=""
i=0
while [ "$i" -lt "$REPS" ]; do
    bench_run "$TMP/m" "$B/fashion_mnist" --epochs 1; others="$others $BENCH_OTHERS"
    main="$main $(rate "$TMP/m")"
    kernel=$(blas "$TMP/m" | sed -n 's/.*kernel \([A-Za-z0-9_]*\).*/\1/p')
    core=${OPENBLAS_CORETYPE:-$kernel}
    bench_run "$TMP/t1" env OPENBLAS_CORETYPE="$core" OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "$PY" "$HERE/peer_torch.py" --threads 1
    others="$others $BENCH_OTHERS"; t1="$t1 $(rate "$TMP/t1")"
    bench_run "$TMP/t2" env OPENBLAS_CORETYPE="$core" OPENBLAS_NUM_THREADS=2 OMP_NUM_THREADS=2 "$PY" "$HERE/peer_torch.py" --threads 2
    others="$others $BENCH_OTHERS"; t2="$t2 $(rate "$TMP/t2")"
    i=$((i + 1))
done
mm=$(echo $main | bench_list | bench_median); m1=$(echo $t1 | bench_list | bench_median); m2=$(echo $t2 | bench_list | bench_median)
best=$(awk -v a="$m1" -v b="$m2" 'BEGIN { print (a > b ? a : b) }')
echo "bench_peer: 784-512-256-128-10, batch 128, Adam, 1 epoch per run, $REPS runs each, alternating; $(nproc) cores"
printf '%-58s %10s %7s  %s\n' run samples/s spread BLAS
printf '%-58s %10.0f %7s  %s\n' "main job ($(sed -n 's/.*tuner: chose \([^:]*\):.*/\1/p' "$TMP/m" | tail -n 1))" "$mm" \
    "$(echo $main | bench_list | bench_spread)" "$(blas "$TMP/m")"
printf '%-58s %10.0f %7s  %s\n' "PyTorch, 1 thread" "$m1" "$(echo $t1 | bench_list | bench_spread)" "$(blas "$TMP/t1")"
printf '%-58s %10.0f %7s  %s\n' "PyTorch, 2 threads" "$m2" "$(echo $t2 | bench_list | bench_spread)" "$(blas "$TMP/t2")"
awk -v m="$mm" -v b="$best" 'BEGIN { printf "main job / PyTorch'"'"'s best: %.2fx (target >= 1.5: %s)\n", m / b, (m / b >= 1.5 ? "met" : "NOT met") }'
echo "others used$(echo $others | bench_list | awk '{ printf " %s", $1 }') cores during the kept runs; $BENCH_REDONE runs redone"
