#!/bin/sh
# bench/gpu/run.sh: everything GPU-side of avgpipe in one bounded run, on a machine with an NVIDIA GPU.
#   1. the GPUs (nvidia-smi) and the toolkit (nvcc);
#   2. a build (meson + ninja) with the CUDA backends found;
#   3. the test suites that touch the GPU, through meson: test_cuda, gpu-cuda-device-check, and where this
#      checkout has them test_nccl, nccl-check, test_hwloc (the branches are merged separately);
#   4. the CUDA device check, its kernels built at run time by NVRTC (the C build) and then compiled in by
#      nvcc, with --bench: the averaging kernel's bandwidth against cudaMemcpy device-to-device (target >= 0.9),
#      the other kernels', and boundary-buffer ("slot") transfers through the device table's copy entry
#      against cudaMemcpyAsync; the reference model over the GPU bit for bit against the CPU's;
#   5. the NCCL smoke test for the ranks the machine has (one process per GPU), where built;
#   6. the CUDA trainer: its first steps against the CPU example, and samples/s with N = 1..4 pipelines.
# Each step is bounded by `timeout`, and all of them together by AVGPIPE_GPU_TOTAL_S (default 470 s: under 8
# minutes; a fresh build takes most of it, a second run reuses the build). A failing
# step stops the run with "run.sh: FAILED: <step>" and exit status 1; a GPU check that skips (no device seen)
# counts as a failure here. The figures are printed at the end (and the full logs kept in BUILD/gpu-logs).
# Usage: sh bench/gpu/run.sh [BUILD_DIR]      (default: build-gpu, next to this checkout's meson.build)
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
B=${1:-$ROOT/build-gpu}
case $B in /*) ;; *) B=$(pwd)/$B ;; esac
LOGS=$B/gpu-logs
T0=$(date +%s)
TOTAL=${AVGPIPE_GPU_TOTAL_S:-470} # the whole run's limit, seconds (each step gets at most what is left)

say() { echo "run.sh: $*"; }
fail() {
    say "FAILED: $*"
    exit 1
}
# step NAME SECONDS LOG CMD...: run CMD bounded by SECONDS, output shown and kept in LOGS/LOG; stop on failure.
step() {
    name=$1 secs=$2 log=$LOGS/$3
    shift 3
    left=$((TOTAL - ($(date +%s) - T0)))
    [ "$left" -gt 5 ] || fail "$name: no time left (AVGPIPE_GPU_TOTAL_S=$TOTAL s in all)"
    [ "$secs" -le "$left" ] || secs=$left
    say "== $name (at most ${secs} s)"
    rc=0
    timeout -k 10 "$secs" "$@" > "$log" 2>&1 || rc=$?
    cat "$log"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && fail "$name: timed out after ${secs} s"
    [ "$rc" -eq 77 ] && fail "$name: skipped (exit 77: no CUDA device seen) on a machine with a GPU"
    [ "$rc" -eq 0 ] || fail "$name: exit status $rc (log: $log)"
    say "   $name: ok ($(($(date +%s) - T0)) s since start)"
}

# 1. GPUs and toolkit
command -v timeout > /dev/null || { echo "run.sh: needs timeout (coreutils)"; exit 1; }
command -v nvidia-smi > /dev/null || fail "no nvidia-smi: this script is for a machine with an NVIDIA GPU"
NVCC=${NVCC:-}
[ -n "$NVCC" ] || NVCC=$(command -v nvcc || true)
[ -n "$NVCC" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || NVCC=/usr/local/cuda/bin/nvcc
[ -n "$NVCC" ] || fail "no nvcc (PATH or /usr/local/cuda/bin)"
mkdir -p "$B" "$LOGS"
timeout 30 nvidia-smi -L > "$LOGS/gpus.txt" 2>&1 || fail "nvidia-smi -L: $(cat "$LOGS/gpus.txt")"
NGPU=$(grep -c '^GPU ' "$LOGS/gpus.txt" || true)
[ "$NGPU" -ge 1 ] || fail "nvidia-smi lists no GPU"
say "$NGPU GPU(s):"
sed 's/^/    /' "$LOGS/gpus.txt"
say "nvcc: $("$NVCC" --version | tail -n 1)"

# 2. build
if [ ! -f "$B/build.ninja" ]; then
    step "meson setup" 180 setup.txt env PATH="$(dirname "$NVCC"):$PATH" meson setup "$B" "$ROOT" -Dbuildtype=release
fi
step "build" 420 build.txt ninja -C "$B"

# 3. the suites that touch the GPU, those this checkout has
timeout 60 meson test -C "$B" --list > "$LOGS/tests.txt" 2>&1 || fail "meson test --list: $(tail -n 5 "$LOGS/tests.txt")"
TESTS=""
for t in test_cuda gpu-cuda-device-check compile-cuda-nvcc compile-cuda-nvcc-nvrtc cuda-ptx-no-fma test_nccl nccl-check nccl-check-mpi \
         test_hwloc compile-hwloc-cudart; do
    grep -Eq "(^| )$t\$" "$LOGS/tests.txt" && TESTS="$TESTS $t"
done
[ -n "$TESTS" ] || fail "this build has none of the GPU tests (was nvcc found? see $LOGS/setup.txt)"
# shellcheck disable=SC2086
step "meson test:$TESTS" 420 meson-test.txt meson test -C "$B" --no-rebuild --print-errorlogs $TESTS
grep -Eq '^ *[0-9]+/[0-9]+ .*gpu-cuda-device-check +SKIP' "$LOGS/meson-test.txt" &&
    fail "gpu-cuda-device-check was skipped: CUDA sees no device although nvidia-smi lists $NGPU"

# 4. the CUDA device check with the benchmark: NVRTC kernels (the C build; ends with a kernel fault on purpose),
#    then the kernels compiled in by nvcc for this GPU
[ -x "$B/cuda_device_check" ] || fail "no $B/cuda_device_check (the CUDA backend was not built)"
step "cuda_device_check (C, NVRTC kernels) --bench" 240 device-nvrtc.txt "$B/cuda_device_check" --bench
step "nvcc build of the device check (-arch=native)" 240 nvcc-build.txt \
    "$NVCC" -std=c++14 -O2 -arch=native -Werror all-warnings -I"$ROOT" "$ROOT/tests/gpu/cuda_device_check.cu" \
    -o "$B/cuda_device_check_nvcc"
step "cuda_device_check (nvcc kernels) --bench" 240 device-nvcc.txt "$B/cuda_device_check_nvcc" --bench --no-fault

# 5. NCCL, where this checkout has it
if [ -x "$B/nccl_check" ]; then
    step "nccl_check ($NGPU rank(s), one process per GPU)" 240 nccl.txt "$B/nccl_check" --ranks "$NGPU" --timeout 180
else
    say "nccl_check: not in this build (no avgpipe_nccl.h in this checkout, or NCCL not found): skipped"
fi

# 6. the CUDA trainer (examples/cuda_mlp.cu), where built: its first steps against the CPU example (the same
#    flags; every parameter within 1e-4 relative of the CPU's, compared as floats with od), then samples/s with
#    N = 1..4 pipelines on one GPU at small micro-batches (AvgPipe's effect: N > 1 should beat N = 1)
if [ -x "$B/cuda_mlp" ] && [ -x "$B/fashion_mnist" ]; then
    FLAGS="--micro 4 --pipes 1 --schedule 1f1b --epochs 1 --limit-train 2048 --rounds 2 --seed 7"
    # shellcheck disable=SC2086
    step "fashion_mnist (CPU), first steps" 120 cpu-steps.txt "$B/fashion_mnist" $FLAGS --save "$LOGS/cpu.params"
    # shellcheck disable=SC2086
    step "cuda_mlp (GPU), the same steps" 120 gpu-steps.txt "$B/cuda_mlp" $FLAGS --save "$LOGS/gpu.params"
    od -An -v -f "$LOGS/cpu.params" | tr -s ' ' '\n' | grep -v '^$' > "$LOGS/cpu.floats"
    od -An -v -f "$LOGS/gpu.params" | tr -s ' ' '\n' | grep -v '^$' > "$LOGS/gpu.floats"
    paste "$LOGS/cpu.floats" "$LOGS/gpu.floats" | awk '
        { n++; d = $1 - $2; if (d < 0) d = -d; s = ($1 < 0 ? -$1 : $1); if (s < 1e-3) s = 1e-3; if (d / s > m) m = d / s }
        END { printf "run.sh: CUDA trainer vs CPU example after the same steps: %d floats, max relative difference %.3g (target <= 1e-4)\n", n, m;
              exit (n == 0 || m > 1e-4) }' > "$LOGS/steps-compare.txt" || { cat "$LOGS/steps-compare.txt"; fail "cuda_mlp differs from the CPU example"; }
    cat "$LOGS/steps-compare.txt"
    for n in 1 2 3 4; do
        step "cuda_mlp N = $n pipelines, micro-batches of 8 samples" 90 pipes-$n.txt \
            "$B/cuda_mlp" --micro 4 --batch 32 --pipes "$n" --schedule 1f1b --epochs 1 --limit-train 16384
    done
else
    say "cuda_mlp or fashion_mnist: not in this build (cuBLAS, OpenBLAS or the data set missing): skipped"
fi

# Figures
say "== figures ($(($(date +%s) - T0)) s in all)"
for f in device-nvrtc device-nvcc; do
    echo "-- $f"
    grep -Ev '^  (first difference|round|find_nonfinite)|^FAIL' "$LOGS/$f.txt" || true
done
[ -f "$LOGS/nccl.txt" ] && { echo "-- nccl"; grep -Ei 'GB/s|bandwidth|passed|refused|ok' "$LOGS/nccl.txt" | head -n 40 || true; }
[ -f "$LOGS/steps-compare.txt" ] && { echo "-- cuda_mlp"; cat "$LOGS/steps-compare.txt"; }
for n in 1 2 3 4; do
    [ -f "$LOGS/pipes-$n.txt" ] && echo "N = $n: $(grep -Eo 'trained .*samples/s\)' "$LOGS/pipes-$n.txt" || echo '?')"
done
say "all steps passed"
