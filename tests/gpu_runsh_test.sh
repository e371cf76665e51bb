#!/bin/sh
# tests/gpu_runsh_test.sh: bench/gpu/run.sh exercised up to its GPU steps on a machine without a GPU.
#   A. no CUDA toolkit, no GPU: one SKIP line per thing it cannot build or run, with the reason; the GPU
#      figures MISSING; the closing "skipped:" line; exit status 2;
#   B. every GPU program played by tests/gpu_runsh_standin.sh, NCCL switched off: the NCCL figure skipped
#      with its reason (not missing), every other figure met, the comparison judging real parameter files
#      of the CPU trainer (built and run here); exit status 0;
#   C. the stand-in, NCCL found the way pip installs it (site-packages/nvidia/nccl, libnccl.so.2 only), the
#      nvcc device check's bandwidth line left out and the CUDA trainer crashing: those figures MISSING,
#      the NCCL figure met; exit status 2;
#   D. the stand-in with two figures off target (samples/s, the trainer's learning rate): NOT MET, exit 1;
#   E. the stand-in's GPU probe finding no device: every GPU step skipped, nothing else run; exit 2;
#   F. no OpenBLAS, no zlib (AVGPIPE_GPU_BLAS=naive, AVGPIPE_GPU_ZLIB=shim: bench/gpu/shim): the CPU trainer
#      built on the shims, the spread from their two loop orders; exit status 0;
#   G. OpenBLAS only as NumPy bundles it (the system's library posing as numpy.libs/...openblas...so): found,
#      loaded through the shim's dlopen, OPENBLAS_CORETYPE obeyed; exit status 0.
# Needs a C compiler and python3 (and, for B..D, OpenBLAS or NumPy; else they run on the shims too).
# Usage: sh tests/gpu_runsh_test.sh [SOURCE_DIR]
set -u
SRC=${1:-$(cd "$(dirname "$0")/.." && pwd)}
RUN=$SRC/bench/gpu/run.sh
STANDIN=$SRC/tests/gpu_runsh_standin.sh
T=$(mktemp -d "${TMPDIR:-/tmp}/gpu-runsh-test.XXXXXX") || exit 1
trap 'rm -rf "$T"' EXIT
fails=0 passes=0
check() { # check NAME CONDITION-COMMAND...
    n=$1
    shift
    if "$@"; then passes=$((passes + 1)); else fails=$((fails + 1)); echo "FAIL [$scenario] $n"; fi
}
has() { grep -qF -- "$1" "$T/$scenario.txt"; }
has_re() { grep -qE -- "$1" "$T/$scenario.txt"; }
hasnt() { ! grep -qF -- "$1" "$T/$scenario.txt"; }
status_is() { [ "$(cat "$T/$scenario.rc")" = "$1" ]; }
# run_case NAME ENV...: run.sh with ENV (VAR=value words), its output in T/NAME.txt and its status in T/NAME.rc
run_case() {
    scenario=$1
    shift
    t0=$(date +%s)
    rc=0
    env -u OUT "$@" AVGPIPE_GPU_SYNTH=2048,500 AVGPIPE_GPU_SEEDS=7 AVGPIPE_GPU_TOTAL_S=300 \
        timeout -k 5 120 sh "$RUN" --build "$T/build" --out "$T/out-$scenario" > "$T/$scenario.txt" 2>&1 || rc=$?
    echo "$rc" > "$T/$scenario.rc"
    echo "[$scenario] run.sh exit status $rc in $(($(date +%s) - t0)) s"
}
show_on_fail() {
    [ "$fails" -eq "$1" ] && return
    echo "---- run.sh's output [$scenario]:"
    sed 's/^/    /' "$T/$scenario.txt"
}

# A. no toolkit, no GPU
mkdir -p "$T/nocuda" "$T/bin"
f0=$fails
run_case A CUDA_HOME="$T/nocuda" NVCC="$T/nocuda/bin/nvcc" PATH="$T/bin:/usr/bin:/bin"
check "exit status 2" status_is 2
check "no nvcc said" has "CUDA toolkit $T/nocuda: nvcc not found"
check "SKIP for the GPU programs, with the reason" has "run.sh: SKIP gpu_probe and every GPU program: no CUDA runtime"
check "SKIP for the NVRTC device check" has "run.sh: SKIP cuda_device_check (NVRTC kernels): no NVRTC"
check "SKIP for the nvcc device check" has "run.sh: SKIP cuda_device_check (nvcc kernels): no nvcc under $T/nocuda"
check "SKIP for the CUDA trainer" has_re '^run\.sh: SKIP the CUDA trainer \(cuda_mlp\): .*no cuBLAS'
check "SKIP for the GPU steps" has "run.sh: SKIP every GPU step: no GPU: gpu_probe not built"
check "figures missing" has "run.sh: FIGURE ea-bandwidth-nvrtc: MISSING: no GPU"
check "trainer figure missing" has "run.sh: FIGURE trainer-agreement: MISSING: no GPU"
check "one closing line naming the skips" has_re '^run\.sh: skipped: .*every GPU step \(no GPU: gpu_probe not built\)'
check "verdict" has "run.sh: FAILED: a figure is missing"
show_on_fail "$f0"

# B. the stand-in plays every GPU program; NCCL off
f0=$fails
run_case B AVGPIPE_GPU_STANDIN="$STANDIN" AVGPIPE_GPU_NCCL=off
check "exit status 0" status_is 0
check "stand-in announced" has "run.sh: STAND-IN: GPU programs played by"
check "NCCL skipped with its reason" has "run.sh: SKIP figure nccl-smoke: no NCCL: off (AVGPIPE_GPU_NCCL=off)"
check "closing line names it" has "run.sh: skipped: figure nccl-smoke (no NCCL: off (AVGPIPE_GPU_NCCL=off))"
check "bandwidth figure" has "run.sh: FIGURE ea-bandwidth-nvcc: ea_pass / cudaMemcpy D2D bandwidth 0.953 (target >= 0.90)"
check "bitwise figure" has "run.sh: FIGURE ea-bitwise-nvrtc: GPU averaging pass bitwise equal to the CPU's"
check "the CPU trainer built and run" has_re '^run\.sh: == CPU trainer, seed 7, kernel [A-Za-z-]+, 2 steps'
check "per-tensor table with the spread" has_re '^ +W1 512x784 +401408 '
check "agreement met" has_re '^run\.sh: FIGURE trainer-agreement: CUDA vs CPU trainer after 2 steps, .* in 1 of 1 seeds'
check "samples/s figure" has "run.sh: FIGURE samples-per-s: N = 1 60000, N = 2 80000, N = 3 100000, N = 4 120000"
check "verdict" has_re '^run\.sh: all figures present and met \(8 met, 0 not met, 0 missing, 1 skipped'
show_on_fail "$f0"

# C. NCCL from a pip-like site-packages; a bandwidth line left out; the CUDA trainer crashing
mkdir -p "$T/site/nvidia/nccl/include" "$T/site/nvidia/nccl/lib"
: > "$T/site/nvidia/nccl/include/nccl.h"
: > "$T/site/nvidia/nccl/lib/libnccl.so.2"
f0=$fails
run_case C AVGPIPE_GPU_STANDIN="$STANDIN" CUDA_HOME="$T/nocuda" PYTHONPATH="$T/site" \
    GPU_RUNSH_STANDIN_DROP=ea-bandwidth-nvcc,trainer-agreement
check "exit status 2" status_is 2
check "NCCL found under pip's layout" has "run.sh: NCCL: pip's nvidia nccl: $T/site/nvidia/nccl/include/nccl.h"
check "NCCL figure met" has "run.sh: FIGURE nccl-smoke: nccl_check: all ranks passed"
check "bandwidth figure missing" has "run.sh: FIGURE ea-bandwidth-nvcc: MISSING: no BENCH line"
check "the other bandwidth figure there" has "run.sh: FIGURE ea-bandwidth-nvrtc: ea_pass / cudaMemcpy D2D bandwidth 0.953"
check "trainer figure missing, with why" has_re '^run\.sh: FIGURE trainer-agreement: MISSING: .*seed 7: cuda_mlp exit status 1: cuda_mlp: an illegal memory access'
check "verdict" has_re '^run\.sh: FAILED: a figure is missing \(7 met, 0 not met, 2 missing, 0 skipped'
show_on_fail "$f0"

# D. figures off target
f0=$fails
run_case D AVGPIPE_GPU_STANDIN="$STANDIN" AVGPIPE_GPU_NCCL=off GPU_RUNSH_STANDIN_BAD=samples-per-s,trainer-agreement
check "exit status 1" status_is 1
check "samples/s not met" has_re '^run\.sh: FIGURE samples-per-s: .*NOT MET \(N > 1 does not beat N = 1\) -- NOT MET'
check "agreement not met" has_re '^run\.sh: FIGURE trainer-agreement: .* in 0 of 1 seeds .*NOT met -- NOT MET'
check "a table row over the limit" has_re ' OVER$'
check "verdict" has_re '^run\.sh: FAILED: a criterion is not met \(6 met, 2 not met, 0 missing, 1 skipped'
show_on_fail "$f0"

# E. the probe finds no GPU
f0=$fails
run_case E AVGPIPE_GPU_STANDIN="$STANDIN" GPU_RUNSH_STANDIN_NO_GPU=1 GPU_RUNSH_STANDIN_LOG="$T/standin-E.log"
check "exit status 2" status_is 2
check "GPU steps skipped, the probe's reason" has "run.sh: SKIP every GPU step: no GPU: gpu_probe: no CUDA device: no CUDA-capable device is detected"
check "only the probe ran" [ "$(cut -d' ' -f1 "$T/standin-E.log" | sort -u)" = gpu-probe ]
check "no data made" hasnt "== data:"
check "verdict" has "run.sh: FAILED: a figure is missing"
show_on_fail "$f0"

# F. no OpenBLAS, no zlib: the shims
f0=$fails
run_case F AVGPIPE_GPU_STANDIN="$STANDIN" AVGPIPE_GPU_NCCL=off AVGPIPE_GPU_BLAS=naive AVGPIPE_GPU_ZLIB=shim
check "exit status 0" status_is 0
check "says it has no OpenBLAS" has "run.sh: CPU BLAS: NO OpenBLAS"
check "zlib stand-in said" has "run.sh: zlib: AVGPIPE_GPU_ZLIB=shim: bench/gpu/shim/zlib"
check "the two loop orders" has "run.sh: CPU kernels for the spread: naive-dot naive-axpy (naive)"
check "their BLAS lines" has "BLAS: naive-loops axpy, kernel naive-axpy"
check "agreement met" has_re '^run\.sh: FIGURE trainer-agreement: .* in 1 of 1 seeds'
show_on_fail "$f0"

# G. OpenBLAS found the way NumPy bundles it (numpy.libs/lib*openblas*.so), here the system's library
# standing in for NumPy's: the CPU trainer built on the shim, the library loaded through dlopen
lib=
for l in /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/libopenblas.so.0 /usr/lib64/libopenblas.so.0; do
    [ -e "$l" ] && { lib=$l; break; }
done
if [ -n "$lib" ]; then
    mkdir -p "$T/np/numpy" "$T/np/numpy.libs"
    : > "$T/np/numpy/__init__.py"
    ln -s "$lib" "$T/np/numpy.libs/libscipy_openblas64_-standin.so"
    f0=$fails
    run_case G AVGPIPE_GPU_STANDIN="$STANDIN" AVGPIPE_GPU_NCCL=off AVGPIPE_GPU_BLAS=numpy AVGPIPE_GPU_ZLIB=shim PYTHONPATH="$T/np" \
        AVGPIPE_GPU_CPU_KERNELS="Sandybridge Nehalem"
    check "exit status 0" status_is 0
    check "NumPy's OpenBLAS through the shim" has "run.sh: CPU BLAS: NumPy's OpenBLAS $(cd "$(dirname "$lib")" && pwd -P)/"
    check "the kernel asked for is loaded" has_re '^    BLAS: OpenBLAS [0-9.]+, kernel Nehalem \(OPENBLAS_CORETYPE=Nehalem, left as set\)'
    check "agreement met" has_re '^run\.sh: FIGURE trainer-agreement: .* in 1 of 1 seeds'
    show_on_fail "$f0"
else
    echo "[G] skipped: no libopenblas.so.0 here to stand in for NumPy's"
fi

echo "$passes passed, $fails failed"
[ "$fails" -eq 0 ]
