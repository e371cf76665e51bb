#!/bin/sh
# The kernels nvcc compiles from avgpipe_cuda.h carry no fused multiply-add and no flush-to-zero, under nvcc's
# default -fmad=true and under --use_fast_math: their arithmetic is inline PTX with explicit rounding
# (add.rn.f32, sub.rn.f32, mul.rn.f32), which PTX never contracts. A control kernel in the same file shows
# that the check sees an FMA (and .ftz) when there is one. Finally ptxas assembles the kernels for sm_90.
# Usage: cuda_ptx_check.sh NVCC SOURCE_ROOT OUT_DIR
set -eu
NVCC=$1 SRC=$2 OUT=$3
mkdir -p "$OUT"
fail() { echo "cuda_ptx_check: $*"; exit 1; }

check() { # $1: a label; the rest: extra nvcc flags
    label=$1; shift
    "$NVCC" -std=c++14 -I"$SRC" -arch=compute_90 -ptx "$@" "$SRC/tests/compile/cuda_ptx.cu" -o "$OUT/all.ptx"
    # split: the control kernel's body, and everything else (our kernels and any helper functions)
    awk -v o="$OUT" '/\.entry[ \t]+avgpipe_control/ { c = 1 }
                     { print > (c ? o "/control.ptx" : o "/ours.ptx") }
                     c && /^}/ { c = 0 }' "$OUT/all.ptx"
    for k in avgpipe__cu_ea avgpipe__cu_nonfinite avgpipe__cu_scale avgpipe__cu_flag; do
        grep -q "\.entry.*$k" "$OUT/ours.ptx" || fail "$label: no kernel $k in the PTX"
    done
    for op in add.rn.f32 sub.rn.f32 mul.rn.f32; do
        grep -q "$op" "$OUT/ours.ptx" || fail "$label: no $op in the kernels"
    done
    if grep -n "fma" "$OUT/ours.ptx"; then fail "$label: an FMA in the kernels' PTX"; fi
    if grep -n "\.ftz" "$OUT/ours.ptx"; then fail "$label: flush-to-zero in the kernels' PTX"; fi
    grep -q "fma.rn" "$OUT/control.ptx" || fail "$label: the control kernel has no FMA: the check proves nothing"
    echo "cuda_ptx_check: $label: kernels without FMA or .ftz ($(grep -c '\.rn\.f32' "$OUT/ours.ptx") rounded fp32 ops); control has $(grep -c 'fma' "$OUT/control.ptx") FMA"
}
check "nvcc default flags"
check "--use_fast_math" --use_fast_math
grep -q "\.ftz" "$OUT/control.ptx" || fail "--use_fast_math: the control kernel has no .ftz: the check proves nothing"
"$NVCC" -std=c++14 -I"$SRC" -arch=sm_90 -cubin "$SRC/tests/compile/cuda_ptx.cu" -o "$OUT/kernels.cubin"
[ -s "$OUT/kernels.cubin" ] || fail "ptxas produced no sm_90 cubin"
echo "cuda_ptx_check: sm_90 cubin assembled ($(wc -c < "$OUT/kernels.cubin") bytes)"
