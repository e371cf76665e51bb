#!/bin/sh
# bench/gpu/run.sh: avgpipe's GPU figures in one bounded run, on a bare machine with an NVIDIA GPU.
#
# NEEDS only: the CUDA toolkit (nvcc with a host C++ compiler, cudart, NVRTC, cuBLAS), a C compiler (cc),
# Python 3 (its standard library), coreutils' timeout. Optional: NCCL (the toolkit's, NCCL_HOME, or pip's
# nvidia-nccl-cu13: site-packages/nvidia/nccl/{include,lib}); OpenBLAS (the system's headers and library, or
# the copy NumPy bundles: numpy.libs/libscipy_openblas64_*.so); zlib's headers. Nothing from apt, no meson,
# no Criterion. What is missing is replaced (below) or its figure is skipped with one line saying why.
#
# Usage: sh bench/gpu/run.sh [--data DIR] [--build DIR] [--out DIR] [--help]      (from the repository root)
#   --data DIR   Fashion-MNIST ({train,t10k}-{images-idx3,labels-idx1}-ubyte, .gz or not: a copy carried
#                along); default: a synthetic set of the same shape (bench/gpu/runtool.py synth)
#   --build DIR  where to build (default: a fresh temporary directory, removed at the end)
#   --out DIR    where the logs and figures.txt go (default: $OUT/gpu-run when OUT is set, else a fresh
#                temporary directory, kept and named at the end)
#
# STEPS (each bounded by `timeout`; all together by AVGPIPE_GPU_TOTAL_S, default 470 s, under 8 minutes):
#   1. detect: the toolkit, whether nvcc can build a program, NCCL, OpenBLAS, zlib, the CPU's vector units;
#   2. build, in parallel, directly with cc and nvcc: gpu_probe (bench/gpu/gpu_probe.c), the CUDA device
#      check twice (tests/gpu/cuda_device_check.c by cc, kernels from NVRTC at run time; the .cu by nvcc for
#      this GPU), nccl_check (tests/gpu/nccl_check.c, where NCCL is), the CPU trainer (examples/fashion_mnist.c)
#      and the CUDA trainer (examples/cuda_mlp.cu, with --backend nccl where NCCL is). The CPU trainer and the
#      host side of the CUDA trainer need CBLAS and zlib: without OpenBLAS's headers they are built against
#      bench/gpu/shim/blas (shim_blas.c: NumPy's bundled OpenBLAS through dlopen when there is one, else plain
#      loops in two summation orders); without zlib's headers against bench/gpu/shim/zlib (uncompressed files;
#      step 4 always writes the data uncompressed). The build says which it took;
#   3. gpu_probe: does the CUDA runtime see a GPU (and which: the nvcc programs are built for its arch);
#   4. the data: --data DIR checked and written uncompressed, or the synthetic set;
#   5. the device checks with --bench (NVRTC kernels, then nvcc's): FIGURES ea-bandwidth-* (the averaging
#      kernel ea_pass against cudaMemcpy device to device, median bandwidth ratio, target >= 0.90),
#      ea-bitwise-* (ea_pass of every kind, edge values, and the averaging module over the GPU bit for bit
#      equal to the CPU's on the same inputs), device-check-* (all of the check's other checks passed);
#   6. FIGURE nccl-smoke: tests/gpu/nccl_check on the GPUs there are (one GPU: one rank, then two ranks on
#      it refused with NCCL's text), where NCCL is (no NCCL: skipped, which is not a missing figure);
#   7. FIGURE trainer-agreement: the CPU trainer with several BLAS kernels and the CUDA trainer, the same
#      flags (2 Adam steps of one pipeline, batches of 4 micro-batches of 32; seeds 7, 8, 9), compared per
#      tensor (below);
#   8. FIGURE samples-per-s: the CUDA trainer with N = 1, 2, 3, 4 pipelines on one GPU at micro-batches of 8
#      samples: N > 1 must beat N = 1 (AvgPipe's effect: small pipelines leave a GPU idle, N fill it).
# It ends with the figures, one line naming everything it skipped and why, and the verdict.
#
# EXIT STATUS: 0 every figure present and met; 1 a figure present but its criterion not met (or a check
# failed); 2 a figure it exists to produce is missing: not built, no GPU, a step failed or timed out, no
# time left (2 wins over 1); 64 bad usage.
#
# THE AGREEMENT CRITERION, and why. The CUDA trainer sums its GEMMs in cuBLAS's order and takes CUDA's expf,
# logf and sqrtf; the CPU trainer OpenBLAS's order and glibc's: correct code agrees to rounding, not bit for
# bit, and Adam carries rounding far: it divides each gradient by its own size, so a sum that rounds across
# zero, or a ReLU input that rounds across it, moves a weight by a whole step of the learning rate, and the
# runs part. Measured here (2-vCPU CI machine, OpenBLAS 0.3.21, Fashion-MNIST and the synthetic set, the
# kernels Haswell, SkylakeX, Sandybridge and Nehalem, 12 seeds each), per tensor, relative L2 ||x - y|| / ||y||:
#   - two CPU runs that differ only in the kernel, after 2 Adam steps: 2e-7 .. 6e-6;
#   - each kernel left out in turn and judged against the other three as below: ratio <= 4.3 in 95 of 96
#     cases; in 1 (3 of 96 after 4 steps, more after 8 or 16) that one run alone fell into another basin of
#     the trajectory, ratio ~1000 (the 1.8e-3 after 16 steps that made the old "every parameter within 1e-4
#     of the CPU run" fail for correct code);
#   - the same batches in 2 micro-batches instead of 4 (another summation grouping): ratio 0.5;
#   - the learning rate 0.1% off, the smallest real error tried: ratio > 15000 (a wrong gradient or a stale
#     buffer is far beyond).
# Hence: 2 Adam steps (2 iterations, Adam's t = 1 and 2, the cosine decay); the CPU trainer run with every
# kernel this CPU has (OPENBLAS_CORETYPE; without OpenBLAS the shim's two loop orders, said so); per tensor the
# SPREAD is the largest difference between two of those CPU runs (what correct code does here: printed beside
# each figure); a seed is met when the CUDA run is, in every tensor, within FACTOR = 10 times the spread
# (floored at float's epsilon, 1.2e-7) of its nearest CPU run (a CPU run in the same basin); the figure is met
# when 2 of the 3 seeds are (one run that alone fell into another basin is outvoted; a real error fails all).
# FACTOR 10 leaves twice the worst correct ratio seen for the GPU's own rounding (cuBLAS's tiles and split-K,
# CUDA's libm) and is still 1000 times below the smallest error tried. bench/gpu/runtool.py compare computes it.
#
# ENVIRONMENT: CUDA_HOME (default: nvcc's on PATH, else /usr/local/cuda), NVCC, CC (default cc), PYTHON
# (default python3), NCCL_HOME (a directory with include/nccl.h and lib/libnccl.so*), AVGPIPE_GPU_NCCL=off
# (no NCCL figure, skipped), AVGPIPE_GPU_BLAS=auto|openblas|numpy|naive (the CPU BLAS; default auto, in that
# order), AVGPIPE_GPU_CPU_KERNELS (the CPU runs' kernels, e.g. "Haswell Nehalem" or "naive-dot naive-axpy";
# default: all this CPU has), AVGPIPE_GPU_ZLIB=auto|shim, AVGPIPE_GPU_SEEDS (default "7 8 9"), AVGPIPE_GPU_SYNTH=TRAIN,TEST (the synthetic
# set's sizes, default 60000,10000), AVGPIPE_GPU_TOTAL_S, AVGPIPE_GPU_KEEP=1 (keep the build directory).
# STAND-IN (tests/gpu_runsh_test.sh, on machines without a GPU): AVGPIPE_GPU_STANDIN=PROGRAM runs every GPU
# program as `PROGRAM ROLE ARGS...` (ROLE: gpu-probe, device-check-nvrtc, device-check-nvcc, nccl-check,
# cuda-mlp) instead of building and running it (AVGPIPE_GPU_STANDIN_BUILD=1: build them all the same); the
# CPU trainer is built and run for real, and a stand-in cuda-mlp may run it: run.sh exports
# AVGPIPE_GPU_STANDIN_CPU (its path) and AVGPIPE_GPU_STANDIN_CPU_ENV (the environment of the second CPU run).
set -u

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
T0=$(date +%s)
TOTAL=${AVGPIPE_GPU_TOTAL_S:-470}
CC=${CC:-cc}
PYTHON=${PYTHON:-python3}
STANDIN=${AVGPIPE_GPU_STANDIN:-}
DATA_DIR="" B="" LOGS=""
while [ $# -gt 0 ]; do
    case $1 in
    --data) [ $# -ge 2 ] || { echo "run.sh: --data needs a directory" >&2; exit 64; }; DATA_DIR=$2; shift 2 ;;
    --build) [ $# -ge 2 ] || { echo "run.sh: --build needs a directory" >&2; exit 64; }; B=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || { echo "run.sh: --out needs a directory" >&2; exit 64; }; LOGS=$2; shift 2 ;;
    --help | -h) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 64 ;;
    esac
done
command -v timeout > /dev/null 2>&1 || { echo "run.sh: needs timeout (coreutils)" >&2; exit 2; }
if [ -z "$LOGS" ]; then
    if [ -n "${OUT:-}" ]; then LOGS=$OUT/gpu-run; else LOGS=$(mktemp -d /tmp/avgpipe-gpu-run.XXXXXX); fi
fi
mkdir -p "$LOGS" || exit 2
LOGS=$(cd "$LOGS" && pwd)
KEEP_B=${AVGPIPE_GPU_KEEP:-0}
if [ -z "$B" ]; then B=$(mktemp -d /tmp/avgpipe-gpu-build.XXXXXX); else KEEP_B=1; fi
mkdir -p "$B" || exit 2
B=$(cd "$B" && pwd)
rm -rf "${B:?}/lib" && mkdir "$B/lib" || exit 2 # (libdir_of's links: this run's)
JOB_PIDS=""
# shellcheck disable=SC2317
cleanup() {
    # shellcheck disable=SC2086
    [ -z "$JOB_PIDS" ] || kill $JOB_PIDS 2> /dev/null # builds still running (a signal ended this run)
    [ "$KEEP_B" = 1 ] || rm -rf "${B:?}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
: > "$LOGS/figures.txt"
: > "$LOGS/skipped.txt"
[ -n "$DATA_DIR" ] && DATA_DIR=$(cd "$DATA_DIR" 2> /dev/null && pwd || echo "$DATA_DIR")

say() { echo "run.sh: $*"; }
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((TOTAL - ($(date +%s) - T0))); }
# skip WHAT WHY: one line now, and WHAT (WHY) in the closing line
skip() {
    say "SKIP $1: $2"
    printf '%s (%s)\n' "$1" "$2" >> "$LOGS/skipped.txt"
}
# figure NAME STATUS TEXT: STATUS met | not-met | missing | skipped; the last word for NAME counts
figure() {
    printf '%s|%s|%s\n' "$1" "$2" "$3" >> "$LOGS/figures.txt"
    case $2 in
    met) say "FIGURE $1: $3" ;;
    not-met) say "FIGURE $1: $3 -- NOT MET" ;;
    missing) say "FIGURE $1: MISSING: $3" ;;
    skipped) skip "figure $1" "$3" ;;
    esac
}
# run_bounded SECS LOG CMD...: CMD with its output in LOG, within SECS and what is left; prints nothing.
# Returns CMD's status; 124 when it timed out; 125 when no time was left to start it.
run_bounded() {
    secs=$1 log=$2
    shift 2
    l=$(left)
    [ "$l" -gt 5 ] || { echo "run.sh: no time left (AVGPIPE_GPU_TOTAL_S=$TOTAL)" > "$log"; return 125; }
    [ "$secs" -le "$l" ] || secs=$l
    rc=0
    timeout -k 5 "$secs" "$@" > "$log" 2>&1 || rc=$?
    [ "$rc" -eq 137 ] && rc=124
    return "$rc"
}
# step NAME SECS LOG CMD...: run_bounded, the output shown indented, one line with the outcome; returns rc
step() {
    sname=$1 ssecs=$2 slog=$LOGS/$3
    shift 3
    say "== $sname (at most $ssecs s; $(elapsed) s so far)"
    srt=$(date +%s)
    src=0
    run_bounded "$ssecs" "$slog" "$@" || src=$?
    if [ -n "${STEP_SHOW:-}" ]; then grep -E "$STEP_SHOW" "$slog" | sed 's/^/    /' | head -n 20
    else sed 's/^/    /' "$slog" | grep -v '^    epoch [0-9]' | head -n 60; fi
    STEP_SHOW= # (a VAR=... before a function call may outlive it in some shells)
    case $src in
    0) say "   $sname: ok in $(($(date +%s) - srt)) s" ;;
    124) say "   $sname: TIMED OUT after $(($(date +%s) - srt)) s (log: $slog)" ;;
    125) say "   $sname: not run, no time left" ;;
    *) say "   $sname: exit status $src in $(($(date +%s) - srt)) s (log: $slog)" ;;
    esac
    return "$src"
}
why_failed() { # why_failed RC LOG: a short reason for a figure's MISSING line
    case $1 in
    124) echo "timed out" ;;
    125) echo "no time left" ;;
    77) echo "no CUDA device seen" ;;
    *) echo "exit status $1: $(grep -v '^ *$' "$2" 2> /dev/null | tail -n 1 | cut -c1-160)" ;;
    esac
}
# step_gpu NAME SECS LOG ROLE ARGS...: step with a GPU program, or with the stand-in playing it
step_gpu() {
    gname=$1 gsecs=$2 glog=$3 role=$4
    shift 4
    if [ -n "$STANDIN" ]; then step "$gname" "$gsecs" "$glog" "$STANDIN" "$role" "$@"; return; fi
    case $role in
    gpu-probe) gbin=$B/gpu_probe ;;
    device-check-nvrtc) gbin=$B/cuda_device_check ;;
    device-check-nvcc) gbin=$B/cuda_device_check_nvcc ;;
    nccl-check) gbin=$B/nccl_check ;;
    *) gbin=$B/cuda_mlp ;;
    esac
    step "$gname" "$gsecs" "$glog" "$gbin" "$@"
}

say "avgpipe GPU run: $(cd "$ROOT" && git log -1 --format='%h %s' 2> /dev/null || echo "$ROOT"); logs: $LOGS; build: $B"
[ -n "$STANDIN" ] && say "STAND-IN: GPU programs played by $STANDIN (AVGPIPE_GPU_STANDIN): its figures are canned"

# ---- 1. what is here --------------------------------------------------------------------------------------
say "== detect"
STANDIN_ONLY=0
[ -n "$STANDIN" ] && [ "${AVGPIPE_GPU_STANDIN_BUILD:-0}" != 1 ] && STANDIN_ONLY=1
command -v "$CC" > /dev/null 2>&1 || { say "no C compiler ($CC): nothing can be built"; CC=; }
command -v "$PYTHON" > /dev/null 2>&1 || { say "no $PYTHON: the data and comparison steps need it"; PYTHON=; }
if [ -z "${CUDA_HOME:-}" ]; then
    CUDA_HOME=${CUDA_PATH:-}
    if [ -z "$CUDA_HOME" ]; then
        nv=$(command -v nvcc 2> /dev/null || true)
        if [ -n "$nv" ]; then CUDA_HOME=$(cd "$(dirname "$nv")/.." && pwd); else CUDA_HOME=/usr/local/cuda; fi
    fi
fi
NVCC=${NVCC:-$CUDA_HOME/bin/nvcc}
first_dir_with() { # first_dir_with FILE DIR...: the first DIR holding FILE (a glob), or nothing
    f=$1
    shift
    for d in "$@"; do
        for x in "$d"/$f; do [ -e "$x" ] && { echo "$d"; return 0; }; done
    done
    return 1
}
# libdir_of NAME DIR...: the first DIR with libNAME.so or libNAME.so.*; a versioned-only one gets a
# libNAME.so link in BUILD/lib, so that -lNAME finds it (the binary keeps the soname, found through rpath)
libdir_of() {
    n=$1
    shift
    for d in "$@"; do
        if [ -e "$d/lib$n.so" ]; then echo "$d"; return 0; fi
        for x in "$d/lib$n.so".*; do
            if [ -e "$x" ]; then ln -sf "$x" "$B/lib/lib$n.so"; echo "$d"; return 0; fi
        done
    done
    return 1
}
CUDA_INC=$(first_dir_with cuda_runtime_api.h "$CUDA_HOME/include" "$CUDA_HOME/targets/x86_64-linux/include" "$CUDA_HOME/targets/sbsa-linux/include" || true)
CUDA_LIBDIRS="$CUDA_HOME/lib64 $CUDA_HOME/lib $CUDA_HOME/targets/x86_64-linux/lib $CUDA_HOME/targets/sbsa-linux/lib"
# shellcheck disable=SC2086
CUDA_LIB=$(libdir_of cudart $CUDA_LIBDIRS || true)
# shellcheck disable=SC2086
NVRTC_LIB=$(libdir_of nvrtc $CUDA_LIBDIRS || true)
# shellcheck disable=SC2086
CUBLAS_LIB=$(libdir_of cublas $CUDA_LIBDIRS || true)
HAVE_NVCC=0 HAVE_CUDART=0 HAVE_NVRTC=0 HAVE_CUBLAS=0
[ -x "$NVCC" ] && HAVE_NVCC=1
[ -n "$CUDA_INC" ] && [ -n "$CUDA_LIB" ] && HAVE_CUDART=1
[ "$HAVE_CUDART" = 1 ] && [ -n "$NVRTC_LIB" ] && [ -e "$CUDA_INC/nvrtc.h" ] && HAVE_NVRTC=1
[ -n "$CUBLAS_LIB" ] && [ -e "$CUDA_INC/cublas_v2.h" ] && HAVE_CUBLAS=1
NVCC_OK=0 nvcc_text="not found"
if [ "$HAVE_NVCC" = 1 ]; then
    nvcc_text=$("$NVCC" --version 2> /dev/null | grep -o 'release [0-9.]*' | head -n 1)
    if [ "$STANDIN_ONLY" = 1 ]; then
        nvcc_text="$nvcc_text (not tried: stand-in)"
    else
        printf 'int main(void) { return 0; }\n' > "$B/smoke.cu"
        if run_bounded 90 "$LOGS/nvcc-smoke.txt" "$NVCC" "$B/smoke.cu" -o "$B/smoke"; then NVCC_OK=1 nvcc_text="$nvcc_text, builds a program"
        else nvcc_text="$nvcc_text, CANNOT build a program: $(grep -v '^ *$' "$LOGS/nvcc-smoke.txt" | tail -n 1 | cut -c1-160)"; fi
    fi
fi
say "CUDA toolkit $CUDA_HOME: nvcc $nvcc_text"
say "  cudart: ${CUDA_LIB:-not found}; NVRTC: $([ "$HAVE_NVRTC" = 1 ] && echo "$NVRTC_LIB" || echo 'not found'); cuBLAS: $([ "$HAVE_CUBLAS" = 1 ] && echo "$CUBLAS_LIB" || echo 'not found')"

# NCCL: NCCL_HOME, the toolkit's, pip's (site-packages/nvidia/nccl), the system's
NCCL_INC="" NCCL_LIB="" NCCL_FROM=""
if [ "${AVGPIPE_GPU_NCCL:-auto}" = off ]; then
    NCCL_FROM="off (AVGPIPE_GPU_NCCL=off)"
else
    cands=""
    [ -n "${NCCL_HOME:-}" ] && cands="$NCCL_HOME|NCCL_HOME"
    cands="$cands $CUDA_HOME|the-CUDA-toolkit"
    if [ -n "$PYTHON" ]; then
        for p in $("$PYTHON" -c '
import glob, os, site, sys, sysconfig
dirs = []
try:
    import nvidia.nccl as m
    dirs += list(m.__path__)
except Exception:
    pass
roots = [sysconfig.get_paths().get(k) for k in ("purelib", "platlib")]
try:
    roots += site.getsitepackages() + [site.getusersitepackages()]
except Exception:
    pass
for r in roots:
    if r:
        dirs += glob.glob(os.path.join(r, "nvidia", "nccl"))
seen = set()
for d in dirs:
    d = os.path.realpath(d)
    if d not in seen:
        seen.add(d)
        print(d)
' 2> /dev/null); do cands="$cands $p|pip's-nvidia-nccl"; done
    fi
    cands="$cands /usr|the-system"
    for c in $cands; do
        d=${c%%|*}
        i=$(first_dir_with nccl.h "$d/include" || true)
        [ -n "$i" ] || continue
        l=$(first_dir_with 'libnccl.so*' "$d/lib64" "$d/lib" "$d/lib/x86_64-linux-gnu" "$d/targets/x86_64-linux/lib" || true)
        [ -n "$l" ] || continue
        NCCL_INC=$i NCCL_LIB=$l NCCL_FROM=$(echo "${c#*|}" | tr '-' ' ')
        [ -e "$l/libnccl.so" ] || for x in "$l"/libnccl.so.*; do ln -sf "$x" "$B/lib/libnccl.so"; break; done
        break
    done
fi
if [ -n "$NCCL_LIB" ]; then say "NCCL: $NCCL_FROM: $NCCL_INC/nccl.h, $NCCL_LIB"
elif [ -n "$NCCL_FROM" ]; then say "NCCL: $NCCL_FROM"
else say "NCCL: not found (NCCL_HOME, $CUDA_HOME, pip's nvidia/nccl in site-packages, /usr)"; fi

# CPU BLAS for the CPU trainer and the CUDA trainer's host side; zlib for both
BLAS_MODE="" BLAS_CFLAGS="" BLAS_LIBS="" BLAS_LIB_PATH="" BLAS_WHY=""
try_cc() { # try_cc FLAGS... < program: does it compile and link?
    [ -n "$CC" ] || return 1
    cat > "$B/try.c"
    # shellcheck disable=SC2068
    "$CC" -std=c11 "$B/try.c" -o "$B/try" $@ > "$B/try.log" 2>&1
}
want_blas=${AVGPIPE_GPU_BLAS:-auto}
if [ "$want_blas" = auto ] || [ "$want_blas" = openblas ]; then
    for inc in "" -I/usr/include/openblas -I/usr/include/x86_64-linux-gnu/openblas-pthread ${OPENBLAS_HOME:+-I$OPENBLAS_HOME/include}; do
        # shellcheck disable=SC2086
        if printf '#include <cblas.h>\nint main(void) { float c = 0; cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 1, 1, 1, 1.0f, &c, 1, &c, 1, 0.0f, &c, 1); return openblas_get_corename() == 0; }\n' |
            try_cc $inc ${OPENBLAS_HOME:+-L$OPENBLAS_HOME/lib} -lopenblas; then
            BLAS_MODE=openblas BLAS_CFLAGS=$inc BLAS_LIBS="${OPENBLAS_HOME:+-L$OPENBLAS_HOME/lib -Wl,-rpath,$OPENBLAS_HOME/lib} -lopenblas"
            break
        fi
    done
    [ -n "$BLAS_MODE" ] || BLAS_WHY="no OpenBLAS headers and library for cc"
fi
if [ -z "$BLAS_MODE" ] && { [ "$want_blas" = auto ] || [ "$want_blas" = numpy ]; } && [ -n "$PYTHON" ]; then
    BLAS_LIB_PATH=$("$PYTHON" -c '
import glob, os
c = []
try:
    import scipy_openblas64 as s
    c += glob.glob(os.path.join(s.get_lib_dir(), "lib*openblas*.so*"))
except Exception:
    pass
try:
    import numpy
    d = os.path.dirname(numpy.__file__)
    c += glob.glob(os.path.join(d, os.pardir, "numpy.libs", "lib*openblas*.so*")) + glob.glob(os.path.join(d, ".libs", "lib*openblas*.so*"))
except Exception:
    pass
print(os.path.realpath(c[0]) if c else "")
' 2> /dev/null || true)
    if [ -n "$BLAS_LIB_PATH" ]; then BLAS_MODE=numpy; else BLAS_WHY="${BLAS_WHY:+$BLAS_WHY; }no OpenBLAS in NumPy (numpy.libs)"; fi
fi
if [ -z "$BLAS_MODE" ] && [ "$want_blas" != openblas ] && [ "$want_blas" != numpy ]; then
    BLAS_MODE=naive
    [ "$want_blas" = naive ] && BLAS_WHY="AVGPIPE_GPU_BLAS=naive"
fi
case $BLAS_MODE in
openblas) say "CPU BLAS: the system's OpenBLAS (cc ${BLAS_CFLAGS:+$BLAS_CFLAGS }-lopenblas)" ;;
numpy) say "CPU BLAS: NumPy's OpenBLAS $BLAS_LIB_PATH, through bench/gpu/shim/shim_blas.c (dlopen)${BLAS_WHY:+ ($BLAS_WHY)}" ;;
naive) say "CPU BLAS: NO OpenBLAS ($BLAS_WHY): bench/gpu/shim/shim_blas.c's plain loops (orders dot and axpy) for the CPU trainer and the CUDA trainer's host side" ;;
*) say "CPU BLAS: AVGPIPE_GPU_BLAS=$want_blas not available ($BLAS_WHY)" ;;
esac
if [ "$BLAS_MODE" = numpy ] || [ "$BLAS_MODE" = naive ]; then
    BLAS_CFLAGS="-I$ROOT/bench/gpu/shim/blas" BLAS_LIBS="$B/shim_blas.o -ldl -lpthread"
fi
if [ "${AVGPIPE_GPU_ZLIB:-auto}" != shim ] &&
    printf '#include <zlib.h>\nint main(void) { gzFile f = gzopen("/nonexistent", "rb"); return f != 0; }\n' | try_cc -lz; then
    Z_MODE=zlib Z_CFLAGS="" Z_LIBS=-lz
    say "zlib: the system's"
else
    Z_MODE=shim Z_CFLAGS="-I$ROOT/bench/gpu/shim/zlib" Z_LIBS="$B/shim_zlib.o"
    say "zlib: $([ "${AVGPIPE_GPU_ZLIB:-auto}" = shim ] && echo 'AVGPIPE_GPU_ZLIB=shim' || echo 'no headers or library'): bench/gpu/shim/zlib (uncompressed files: the data step writes them so)"
fi
AVX2=0 AVX512=0
if grep -qw avx2 /proc/cpuinfo 2> /dev/null && grep -qw fma /proc/cpuinfo; then
    AVX2=1 AVX512=1
    for f in avx512f avx512cd avx512bw avx512dq avx512vl; do grep -qw $f /proc/cpuinfo || AVX512=0; done
fi
say "host: $(grep -m1 'model name' /proc/cpuinfo 2> /dev/null | sed 's/.*: //'), $(getconf _NPROCESSORS_ONLN 2> /dev/null || echo '?') CPUs, AVX2 $AVX2, AVX-512 $AVX512"
if command -v nvidia-smi > /dev/null 2>&1; then
    timeout 30 nvidia-smi -L > "$LOGS/nvidia-smi.txt" 2>&1 || true
    say "nvidia-smi -L: $(head -n 4 "$LOGS/nvidia-smi.txt" | tr '\n' ';')"
else
    say "nvidia-smi: not on PATH (gpu_probe asks the CUDA runtime instead)"
fi

# ---- 2. build -------------------------------------------------------------------------------------------
# Each target: a background job bounded by timeout, its command in BUILD/<t>.cmd, its log in LOGS/build-<t>.txt.
# What it needs and lacks is a SKIP line (and its figures missing). gpu_probe first: the arch comes from it.
BUILT=" "
built() { case $BUILT in *" $1 "*) return 0 ;; esac; return 1; }
# job T SECS CMD...: start building T in the background
JOBS="" JOB_PIDS=""
job() {
    t=$1 secs=$2
    shift 2
    # up to date (a --build directory used again): the same command, and no source of the checkout newer
    if [ -x "$B/$t" ] && [ -f "$B/$t.cmd" ] && [ "$(cat "$B/$t.cmd")" = "$*" ] && [ "$(cat "$B/$t.rc" 2> /dev/null)" = 0 ] &&
        [ -z "$(find "$ROOT"/avgpipe*.h "$ROOT/examples" "$ROOT/tests" "$ROOT/bench/gpu" -newer "$B/$t" \
            \( -name '*.h' -o -name '*.c' -o -name '*.cu' \) 2> /dev/null | head -n 1)" ]; then
        echo "up to date: $B/$t" > "$LOGS/build-$t.txt"
        JOBS="$JOBS $t"
        return
    fi
    printf '%s\n' "$*" > "$B/$t.cmd"
    rm -f "$B/$t.rc"
    l=$(left)
    if [ "$l" -le 5 ]; then
        echo "run.sh: no time left (AVGPIPE_GPU_TOTAL_S=$TOTAL)" > "$LOGS/build-$t.txt"
        echo 125 > "$B/$t.rc"
    else
        [ "$secs" -le "$l" ] || secs=$l
        timeout -k 5 "$secs" "$@" > "$LOGS/build-$t.txt" 2>&1 &
        eval "JOB_PID_$t=\$!"
        JOB_PIDS="$JOB_PIDS $!"
    fi
    JOBS="$JOBS $t"
}
finish_jobs() {
    for t in $JOBS; do
        eval "p=\${JOB_PID_$t:-}"
        if [ -n "$p" ]; then
            rc=0
            wait "$p" || rc=$?
            [ "$rc" -eq 137 ] && rc=124
            echo "$rc" > "$B/$t.rc"
            eval "JOB_PID_$t="
        fi
        rc=$(cat "$B/$t.rc" 2> /dev/null || echo 1)
        if [ "$rc" = 0 ]; then
            BUILT="$BUILT$t "
            if grep -q '^up to date: ' "$LOGS/build-$t.txt"; then say "up to date: $t (--build $B, the same command, no newer source)"
            else say "built $t ($(sed -n 1p "$B/$t.cmd" | cut -c1-150)...)"; fi
        else
            say "BUILD FAILED: $t ($(why_failed "$rc" "$LOGS/build-$t.txt")); log: $LOGS/build-$t.txt"
            tail -n 15 "$LOGS/build-$t.txt" | sed 's/^/    /'
        fi
    done
    JOBS="" JOB_PIDS=""
}
# BUILD/lib first: libdir_of's links for libraries installed with their versioned names only
CUDA_LINK="-L$B/lib -L$CUDA_LIB -Wl,-rpath,$CUDA_LIB"
NVCC_CUDA_LINK="-L$B/lib -L$CUDA_LIB -Xlinker -rpath=$CUDA_LIB"
say "== build (in parallel; at most 300 s; $(elapsed) s so far)"
if [ "$STANDIN_ONLY" = 1 ]; then
    say "stand-in: the GPU programs (gpu_probe, cuda_device_check twice, nccl_check, cuda_mlp) are not built: $STANDIN plays them"
    BUILT=" gpu_probe cuda_device_check cuda_device_check_nvcc cuda_mlp ${NCCL_LIB:+nccl_check }"
fi
[ -n "$CC" ] || skip "every build" "no C compiler"
ARCH=
if [ "$STANDIN_ONLY" = 0 ] && [ -n "$CC" ]; then
    if [ "$HAVE_CUDART" = 1 ]; then
        # shellcheck disable=SC2086
        job gpu_probe 60 "$CC" -std=c11 -O2 -isystem "$CUDA_INC" "$ROOT/bench/gpu/gpu_probe.c" -o "$B/gpu_probe" $CUDA_LINK -lcudart
        finish_jobs
    else
        skip "gpu_probe and every GPU program" "no CUDA runtime (cuda_runtime_api.h and libcudart under $CUDA_HOME)"
    fi
fi

# ---- 3. the GPU -----------------------------------------------------------------------------------------
HAVE_GPU=0 GPU_WHY=
if built gpu_probe; then
    if step_gpu "gpu_probe" 30 gpu-probe.txt gpu-probe; then
        HAVE_GPU=1
        ARCH=$(sed -n 's/^arch \(sm_[0-9]*\)$/\1/p' "$LOGS/gpu-probe.txt" | head -n 1)
    else
        GPU_WHY=$(grep -v '^ *$' "$LOGS/gpu-probe.txt" | tail -n 1 | cut -c1-200)
        [ -n "$GPU_WHY" ] || GPU_WHY="gpu_probe: $(why_failed 1 "$LOGS/gpu-probe.txt")"
    fi
else
    GPU_WHY="gpu_probe not built"
fi
[ "$HAVE_GPU" = 1 ] || skip "every GPU step" "no GPU: $GPU_WHY"
NVARCH=${ARCH:+-arch=$ARCH}
[ -n "$NVARCH" ] || NVARCH=
[ "$STANDIN_ONLY" = 0 ] && [ "$NVCC_OK" = 1 ] && say "nvcc programs built for ${ARCH:-the default arch of nvcc (no GPU to ask)}"

if [ -n "$CC" ]; then
    if [ "$BLAS_MODE" = numpy ] || [ "$BLAS_MODE" = naive ]; then
        run_bounded 60 "$LOGS/build-shim_blas.txt" "$CC" -std=c11 -O2 -fPIC -I"$ROOT/bench/gpu/shim/blas" -c "$ROOT/bench/gpu/shim/shim_blas.c" -o "$B/shim_blas.o" ||
            { say "BUILD FAILED: shim_blas.o: $(tail -n 3 "$LOGS/build-shim_blas.txt")"; BLAS_MODE=; }
    fi
    if [ "$Z_MODE" = shim ]; then
        run_bounded 60 "$LOGS/build-shim_zlib.txt" "$CC" -std=c11 -O2 -fPIC -I"$ROOT/bench/gpu/shim/zlib" -c "$ROOT/bench/gpu/shim/shim_zlib.c" -o "$B/shim_zlib.o" ||
            { say "BUILD FAILED: shim_zlib.o: $(tail -n 3 "$LOGS/build-shim_zlib.txt")"; Z_MODE=; }
    fi
fi
HOST_OK=0
[ -n "$BLAS_MODE" ] && [ -n "$Z_MODE" ] && HOST_OK=1
if [ -n "$CC" ]; then
    if [ "$HOST_OK" = 1 ]; then
        # shellcheck disable=SC2086
        job fashion_mnist 240 "$CC" -std=c11 -O2 -I"$ROOT" $BLAS_CFLAGS $Z_CFLAGS "$ROOT/examples/fashion_mnist.c" -o "$B/fashion_mnist" \
            $BLAS_LIBS $Z_LIBS -lm -pthread
    else
        skip "the CPU trainer (fashion_mnist)" "no usable CBLAS or zlib (AVGPIPE_GPU_BLAS=$want_blas)"
    fi
fi
if [ "$STANDIN_ONLY" = 0 ] && [ -n "$CC" ]; then
    if [ "$HAVE_NVRTC" = 1 ]; then
        # shellcheck disable=SC2086
        job cuda_device_check 240 "$CC" -std=c11 -O2 -I"$ROOT" -isystem "$CUDA_INC" "$ROOT/tests/gpu/cuda_device_check.c" -o "$B/cuda_device_check" \
            $CUDA_LINK -L"$NVRTC_LIB" -Wl,-rpath,"$NVRTC_LIB" -lcudart -lnvrtc -lm -pthread
    else
        skip "cuda_device_check (NVRTC kernels)" "no NVRTC (nvrtc.h and libnvrtc under $CUDA_HOME) or no cudart"
    fi
    if [ "$NVCC_OK" = 1 ]; then
        # shellcheck disable=SC2086
        job cuda_device_check_nvcc 300 "$NVCC" -std=c++14 -O2 $NVARCH -I"$ROOT" "$ROOT/tests/gpu/cuda_device_check.cu" -o "$B/cuda_device_check_nvcc"
    else
        skip "cuda_device_check (nvcc kernels)" "$([ "$HAVE_NVCC" = 1 ] && echo "nvcc cannot build a program (see $LOGS/nvcc-smoke.txt; a host C++ compiler, g++, missing?)" || echo "no nvcc under $CUDA_HOME")"
    fi
    if [ -n "$NCCL_LIB" ] && [ "$HAVE_CUDART" = 1 ]; then
        # shellcheck disable=SC2086
        job nccl_check 240 "$CC" -std=c11 -O2 -I"$ROOT" -I"$NCCL_INC" -isystem "$CUDA_INC" "$ROOT/tests/gpu/nccl_check.c" -o "$B/nccl_check" \
            -L"$B/lib" -L"$NCCL_LIB" -Wl,-rpath,"$NCCL_LIB" $CUDA_LINK -lnccl -lcudart -lm -pthread
    fi
    if [ "$NVCC_OK" = 1 ] && [ "$HAVE_CUBLAS" = 1 ] && [ "$HOST_OK" = 1 ]; then
        CM_NCCL_C= CM_NCCL_L=
        # (NCCL's directory first: its rpath before the toolkit's, which may hold another libnccl)
        if [ -n "$NCCL_LIB" ]; then CM_NCCL_C="-DCUDA_MLP_NCCL -I$NCCL_INC" CM_NCCL_L="-L$B/lib -L$NCCL_LIB -Xlinker -rpath=$NCCL_LIB -lnccl"; fi
        # shellcheck disable=SC2086
        job cuda_mlp 300 "$NVCC" -std=c++14 -O2 -fmad=false $NVARCH -I"$ROOT" $BLAS_CFLAGS $Z_CFLAGS $CM_NCCL_C "$ROOT/examples/cuda_mlp.cu" \
            -o "$B/cuda_mlp" $CM_NCCL_L $NVCC_CUDA_LINK -L"$CUBLAS_LIB" -Xlinker -rpath="$CUBLAS_LIB" -lcublas $BLAS_LIBS $Z_LIBS -lpthread -lm
    else
        skip "the CUDA trainer (cuda_mlp)" "$([ "$NVCC_OK" = 1 ] || echo 'nvcc cannot build a program; ')$([ "$HAVE_CUBLAS" = 1 ] || echo 'no cuBLAS; ')$([ "$HOST_OK" = 1 ] || echo 'no CBLAS/zlib for its host side')"
    fi
fi
finish_jobs
if [ "$STANDIN_ONLY" = 0 ] && [ -n "$NCCL_LIB" ] && [ -e "$B/cuda_mlp.rc" ] && ! built cuda_mlp && [ -n "$CM_NCCL_C" ]; then
    say "cuda_mlp with NCCL failed to build: again without it (--backend threads is what this run uses)"
    # shellcheck disable=SC2086
    job cuda_mlp 300 "$NVCC" -std=c++14 -O2 -fmad=false $NVARCH -I"$ROOT" $BLAS_CFLAGS $Z_CFLAGS "$ROOT/examples/cuda_mlp.cu" \
        -o "$B/cuda_mlp" $NVCC_CUDA_LINK -L"$CUBLAS_LIB" -Xlinker -rpath="$CUBLAS_LIB" -lcublas $BLAS_LIBS $Z_LIBS -lpthread -lm
    finish_jobs
fi

# ---- 4. the data ----------------------------------------------------------------------------------------
DATA=$B/data
HAVE_DATA=0
if [ "$HAVE_GPU" != 1 ]; then
    : # nothing runs the trainers
elif built fashion_mnist || built cuda_mlp; then
    if [ -z "$PYTHON" ]; then
        skip "the data" "no $PYTHON"
    elif [ -n "$DATA_DIR" ]; then
        step "data: Fashion-MNIST from $DATA_DIR" 60 data.txt "$PYTHON" "$ROOT/bench/gpu/runtool.py" data "$DATA_DIR" "$DATA" && HAVE_DATA=1
    else
        sz=${AVGPIPE_GPU_SYNTH:-60000,10000}
        step "data: synthetic (no --data)" 90 data.txt "$PYTHON" "$ROOT/bench/gpu/runtool.py" synth "$DATA" --train "${sz%,*}" --test "${sz#*,}" && HAVE_DATA=1
    fi
fi

# ---- 5. the device checks -------------------------------------------------------------------------------
device_figures() { # device_figures KIND RC LOG
    k=$1 rc=$2 log=$3
    if [ "$rc" = 124 ] || [ "$rc" = 125 ] || [ "$rc" = 77 ] || ! grep -q '^device ' "$log"; then
        for f in ea-bandwidth ea-bitwise device-check; do figure "$f-$k" missing "cuda_device_check ($k): $(why_failed "$rc" "$log")"; done
        return
    fi
    r=$(sed -n 's/^BENCH ea_pass\/memcpy bandwidth ratio: \([0-9.]*\).*/\1/p' "$log" | head -n 1)
    if [ -z "$r" ]; then figure "ea-bandwidth-$k" missing "no BENCH line in $log ($(why_failed "$rc" "$log"))"
    elif awk -v r="$r" 'BEGIN { exit !(r >= 0.9) }'; then figure "ea-bandwidth-$k" met "ea_pass / cudaMemcpy D2D bandwidth $r (target >= 0.90)"
    else figure "ea-bandwidth-$k" not-met "ea_pass / cudaMemcpy D2D bandwidth $r (target >= 0.90)"; fi
    p=$(grep -c 'bitwise equal to the CPU device: yes$' "$log")
    e=$(grep -c '^ea_pass: edge values.*bitwise equal (NaN as NaN)$' "$log")
    m=$(grep -c '^averaging module.*references and models bitwise equal to the CPU module' "$log")
    any=$(grep -c '^ea_pass: .*bitwise\|^averaging module' "$log")
    if [ "$any" -lt 4 ]; then figure "ea-bitwise-$k" missing "$any of the 4 lines (ea_pass, edge values, 2 averaging modules) in $log"
    elif [ "$p" -ge 1 ] && [ "$e" -ge 1 ] && [ "$m" -ge 2 ]; then
        figure "ea-bitwise-$k" met "GPU averaging pass bitwise equal to the CPU's: $(sed -n 's/^ea_pass: \([0-9]* passes\).*/\1/p' "$log" | head -n 1), edge values, MEAN and ELASTIC modules"
    else figure "ea-bitwise-$k" not-met "ea_pass $p/1, edge values $e/1, modules $m/2 bitwise equal: $(grep -m1 'DIFFER\|: NO$' "$log")"; fi
    s=$(grep '^cuda_device_check (' "$log" | tail -n 1)
    if [ -z "$s" ]; then figure "device-check-$k" missing "no summary line ($(why_failed "$rc" "$log"))"
    elif [ "$rc" = 0 ] && echo "$s" | grep -q ', 0 failed'; then figure "device-check-$k" met "$s"
    else figure "device-check-$k" not-met "$s (exit status $rc)"; fi
}
for k in nvrtc nvcc; do
    t=cuda_device_check
    [ $k = nvcc ] && t=cuda_device_check_nvcc
    if [ "$HAVE_GPU" != 1 ]; then
        for f in ea-bandwidth ea-bitwise device-check; do figure "$f-$k" missing "no GPU"; done
    elif ! built $t; then
        for f in ea-bandwidth ea-bitwise device-check; do figure "$f-$k" missing "$t not built"; done
    else
        rc=0
        if [ $k = nvrtc ]; then step_gpu "cuda_device_check --bench (NVRTC kernels; ends with a kernel fault on purpose)" 150 device-nvrtc.txt device-check-nvrtc --bench || rc=$?
        else step_gpu "cuda_device_check --bench --no-fault (nvcc kernels, ${ARCH:-default arch})" 150 device-nvcc.txt device-check-nvcc --bench --no-fault || rc=$?; fi
        device_figures $k "$rc" "$LOGS/device-$k.txt"
    fi
done

# ---- 6. NCCL ------------------------------------------------------------------------------------------
if [ -z "$NCCL_LIB" ]; then
    why=$NCCL_FROM
    [ -n "$why" ] || why="not found in NCCL_HOME, $CUDA_HOME, the nvidia/nccl of pip's site-packages, /usr"
    figure nccl-smoke skipped "no NCCL: $why"
elif [ "$HAVE_GPU" != 1 ]; then
    figure nccl-smoke missing "no GPU"
elif ! built nccl_check; then
    figure nccl-smoke missing "nccl_check not built (NCCL from $NCCL_FROM)"
else
    rc=0
    step_gpu "nccl_check (NCCL from $NCCL_FROM; one process per GPU)" 150 nccl.txt nccl-check --timeout 120 || rc=$?
    if [ "$rc" = 0 ] && grep -q '^nccl_check: all ranks passed' "$LOGS/nccl.txt"; then
        figure nccl-smoke met "nccl_check: all ranks passed ($(grep -m1 '^nccl_check: [0-9]* GPU' "$LOGS/nccl.txt" | sed 's/^nccl_check: //'))"
    elif grep -q '^nccl_check: FAILED\|FAILED (' "$LOGS/nccl.txt"; then
        figure nccl-smoke not-met "$(grep -m1 'FAILED' "$LOGS/nccl.txt" | cut -c1-200)"
    else
        figure nccl-smoke missing "nccl_check: $(why_failed "$rc" "$LOGS/nccl.txt")"
    fi
fi

# ---- 7. the CUDA trainer against the CPU trainer ---------------------------------------------------------
# For each of SEEDS: the CPU trainer with each kernel, then the CUDA trainer, the same flags; runtool.py compare
# judges each seed (header: why), and the figure is met when a majority of the seeds is (one seed whose CUDA
# run alone fell into another basin of the trajectory is outvoted; a real error fails them all).
STEPS=2 SEEDS=${AVGPIPE_GPU_SEEDS:-7 8 9}
AGREE_FLAGS="--micro 4 --pipes 1 --schedule 1f1b --epochs 1 --limit-train $((128 * STEPS)) --rounds 1"
CPU_KERNELS=${AVGPIPE_GPU_CPU_KERNELS:-}
[ -n "$CPU_KERNELS" ] || case $BLAS_MODE in
openblas | numpy)
    [ "$AVX2" = 1 ] && CPU_KERNELS="$CPU_KERNELS Haswell"
    [ "$AVX512" = 1 ] && CPU_KERNELS="$CPU_KERNELS SkylakeX"
    CPU_KERNELS="$CPU_KERNELS Sandybridge Nehalem"
    ;;
naive) CPU_KERNELS="naive-dot naive-axpy" ;;
esac
cpu_env() { # the environment of the CPU run with kernel $1
    case $1 in
    naive-*) echo "AVGPIPE_NAIVE_BLAS=${1#naive-}" ;;
    *) echo "OPENBLAS_CORETYPE=$1${BLAS_LIB_PATH:+ AVGPIPE_BLAS_SHIM_LIB=$BLAS_LIB_PATH}" ;;
    esac
}
# cpu_runs SEED: the CPU runs of one seed; CPU_RUNS gets the kernels whose parameters differ from the others'
cpu_runs() {
    CPU_RUNS=
    for k in $CPU_KERNELS; do
        # shellcheck disable=SC2046,SC2086
        STEP_SHOW='^BLAS:|^trained|rror|annot' step "CPU trainer, seed $1, kernel $k, $STEPS steps" 90 cpu-$1-$k.txt env -u OPENBLAS_CORETYPE -u AVGPIPE_NAIVE_BLAS \
            -u AVGPIPE_BLAS_SHIM_LIB $(cpu_env $k) "$B/fashion_mnist" $AGREE_FLAGS --seed "$1" --data "$DATA" --save "$B/cpu-$1-$k.params" || continue
        got=$(sed -n 's/^BLAS: .*, kernel \([^ ]*\) .*/\1/p' "$LOGS/cpu-$1-$k.txt" | head -n 1)
        [ "$got" = "$k" ] || say "   note: asked for kernel $k, the CPU trainer's BLAS line says ${got:-nothing}"
        dup=
        for r in $CPU_RUNS; do cmp -s "$B/cpu-$1-$r.params" "$B/cpu-$1-$k.params" && dup=$r; done
        if [ -n "$dup" ]; then say "   kernel $k gave the parameters of kernel $dup bit for bit: not another kernel here, left out"
        else CPU_RUNS="$CPU_RUNS $k"; fi
    done
}
# shellcheck disable=SC2086,SC2116
[ -n "$CPU_KERNELS" ] && built fashion_mnist && say "CPU kernels for the spread: $(echo $CPU_KERNELS) ($BLAS_MODE)"
# shellcheck disable=SC2086
set -- $CPU_KERNELS
if built fashion_mnist && [ $# -ge 1 ]; then # what a stand-in cuda-mlp may run (tests/gpu_runsh_standin.sh)
    AVGPIPE_GPU_STANDIN_CPU="$B/fashion_mnist" AVGPIPE_GPU_STANDIN_CPU_ENV=$(cpu_env "${2:-$1}")
    export AVGPIPE_GPU_STANDIN_CPU AVGPIPE_GPU_STANDIN_CPU_ENV
fi
if [ "$HAVE_GPU" != 1 ]; then figure trainer-agreement missing "no GPU"
elif ! built cuda_mlp; then figure trainer-agreement missing "cuda_mlp not built"
elif ! built fashion_mnist; then figure trainer-agreement missing "the CPU trainer not built"
elif [ "$HAVE_DATA" != 1 ]; then figure trainer-agreement missing "no data set"
else
    n_ok=0 n_bad=0 n_gone=0 per=
    for seed in $SEEDS; do
        cpu_runs "$seed"
        # shellcheck disable=SC2086
        set -- $CPU_RUNS
        if [ $# -lt 2 ]; then
            say "   seed $seed: fewer than two CPU runs with different results (${CPU_RUNS:-none}): no spread to judge by"
            n_gone=$((n_gone + 1)) per="$per seed $seed: no spread;"
            continue
        fi
        rc=0
        # shellcheck disable=SC2086
        STEP_SHOW='^GPU:|^BLAS:|^trained|rror|annot|fail' step_gpu "CUDA trainer, seed $seed, the same $STEPS steps" 120 gpu-$seed.txt cuda-mlp $AGREE_FLAGS --seed "$seed" --data "$DATA" \
            --save "$B/gpu-$seed.params" || rc=$?
        if [ "$rc" != 0 ]; then
            n_gone=$((n_gone + 1)) per="$per seed $seed: cuda_mlp $(why_failed "$rc" "$LOGS/gpu-$seed.txt");"
            continue
        fi
        files= names=CUDA
        for r in $CPU_RUNS; do files="$files $B/cpu-$seed-$r.params" names="$names,CPU[$r]"; done
        rc=0
        # shellcheck disable=SC2086
        run_bounded 60 "$LOGS/agreement-$seed.txt" "$PYTHON" "$ROOT/bench/gpu/runtool.py" compare "$B/gpu-$seed.params" $files \
            --names "$names" --label "seed $seed" || rc=$?
        sed 's/^/    /' "$LOGS/agreement-$seed.txt"
        w=$(sed -n 's/^FIGURE trainer-agreement.*worst ratio \([0-9.infa]*\).*largest spread \([^:]*\):.*/ratio \1, spread \2/p' "$LOGS/agreement-$seed.txt")
        case $rc in
        0) n_ok=$((n_ok + 1)) per="$per seed $seed: $w met;" ;;
        1) n_bad=$((n_bad + 1)) per="$per seed $seed: $w NOT met;" ;;
        *) n_gone=$((n_gone + 1)) per="$per seed $seed: comparison failed;" ;;
        esac
    done
    per=${per%;}
    # shellcheck disable=SC2086
    nseeds=$(echo $SEEDS | wc -w)
    text="CUDA vs CPU trainer after $STEPS steps, within 10 x the CPU-kernel spread per tensor in $n_ok of $nseeds seeds (majority needed):$per"
    if [ "$n_gone" -gt 0 ]; then figure trainer-agreement missing "$text"
    elif [ $((2 * n_ok)) -gt "$nseeds" ]; then figure trainer-agreement met "$text"
    else figure trainer-agreement not-met "$text"; fi
fi

# ---- 8. samples/s, N = 1..4 pipelines on one GPU ---------------------------------------------------------
SPEED_FLAGS="--micro 4 --batch 32 --schedule 1f1b --epochs 1"
if [ "$HAVE_GPU" != 1 ]; then figure samples-per-s missing "no GPU"
elif ! built cuda_mlp; then figure samples-per-s missing "cuda_mlp not built"
elif [ "$HAVE_DATA" != 1 ]; then figure samples-per-s missing "no data set"
else
    logs= ok=1
    for n in 1 2 3 4; do
        # shellcheck disable=SC2086
        step_gpu "CUDA trainer, N = $n pipeline(s), micro-batches of 8 samples, one epoch" 90 pipes-$n.txt cuda-mlp $SPEED_FLAGS --pipes $n --data "$DATA" || ok=0
        logs="$logs $LOGS/pipes-$n.txt"
    done
    # shellcheck disable=SC2086
    "$PYTHON" "$ROOT/bench/gpu/runtool.py" speed $logs > "$LOGS/speed.txt" 2>&1
    rc=$?
    line=$(sed -n 's/^FIGURE samples-per-s: //p' "$LOGS/speed.txt")
    case $rc in
    0) figure samples-per-s met "$line" ;;
    1) figure samples-per-s not-met "$line" ;;
    *) figure samples-per-s missing "${line:-$(tail -n 1 "$LOGS/speed.txt")}" ;;
    esac
fi

# ---- figures and verdict --------------------------------------------------------------------------------
say "== figures ($(elapsed) s in all; logs in $LOGS)"
WANT="ea-bandwidth-nvrtc ea-bandwidth-nvcc ea-bitwise-nvrtc ea-bitwise-nvcc device-check-nvrtc device-check-nvcc nccl-smoke trainer-agreement samples-per-s"
n_met=0 n_not=0 n_miss=0 n_skip=0
for f in $WANT; do
    l=$(grep "^$f|" "$LOGS/figures.txt" | tail -n 1)
    if [ -z "$l" ]; then
        l="$f|missing|never produced"
        printf '%s\n' "$l" >> "$LOGS/figures.txt"
    fi
    st=$(echo "$l" | cut -d'|' -f2)
    tx=$(echo "$l" | cut -d'|' -f3-)
    case $st in
    met) n_met=$((n_met + 1)); printf '  %-20s met      %s\n' "$f" "$tx" ;;
    not-met) n_not=$((n_not + 1)); printf '  %-20s NOT MET  %s\n' "$f" "$tx" ;;
    skipped) n_skip=$((n_skip + 1)); printf '  %-20s skipped  %s\n' "$f" "$tx" ;;
    *) n_miss=$((n_miss + 1)); printf '  %-20s MISSING  %s\n' "$f" "$tx" ;;
    esac
done
if [ -s "$LOGS/skipped.txt" ]; then say "skipped: $(sed 's/$/;/' "$LOGS/skipped.txt" | tr '\n' ' ' | sed 's/; $//')"
else say "skipped: nothing"; fi
summary="$n_met met, $n_not not met, $n_miss missing, $n_skip skipped, in $(elapsed) s"
if [ "$n_miss" -gt 0 ]; then say "FAILED: a figure is missing ($summary)"; exit 2; fi
if [ "$n_not" -gt 0 ]; then say "FAILED: a criterion is not met ($summary)"; exit 1; fi
say "all figures present and met ($summary)"
exit 0
