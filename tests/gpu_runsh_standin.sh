#!/bin/sh
# tests/gpu_runsh_standin.sh: plays the GPU programs of bench/gpu/run.sh on a machine without a GPU
# (AVGPIPE_GPU_STANDIN=tests/gpu_runsh_standin.sh; tests/gpu_runsh_test.sh drives it). Called as
#   gpu_runsh_standin.sh ROLE ARGS...      ROLE: gpu-probe, device-check-nvrtc, device-check-nvcc, nccl-check, cuda-mlp
# it prints what the real program prints for the lines run.sh reads, with canned figures that meet their
# targets. cuda-mlp with --save (run.sh's agreement runs) runs the CPU trainer run.sh built
# ($AVGPIPE_GPU_STANDIN_CPU) in the environment of its second CPU run ($AVGPIPE_GPU_STANDIN_CPU_ENV), with
# --micro 2 for run.sh's --micro 4, so the comparison step judges real parameter files that differ by rounding. Knobs, each a comma-separated list of figure names
# (ea-bandwidth-nvrtc, ea-bitwise-nvcc, device-check-nvrtc, nccl-smoke, trainer-agreement, samples-per-s, ...):
#   GPU_RUNSH_STANDIN_DROP=...  those figures' lines are left out (or their program fails): figure missing
#   GPU_RUNSH_STANDIN_BAD=...   those figures miss their target (trainer-agreement: the learning rate 10% off)
#   GPU_RUNSH_STANDIN_NO_GPU=1  gpu-probe finds no device (exit 77)
# Every call is appended to $GPU_RUNSH_STANDIN_LOG when that is set.
set -u
role=${1:-}
[ $# -gt 0 ] && shift
[ -n "${GPU_RUNSH_STANDIN_LOG:-}" ] && echo "$role $*" >> "$GPU_RUNSH_STANDIN_LOG"
in_list() { case ",$2," in *",$1,"*) return 0 ;; esac; return 1; }
drop() { in_list "$1" "${GPU_RUNSH_STANDIN_DROP:-}"; }
bad() { in_list "$1" "${GPU_RUNSH_STANDIN_BAD:-}"; }

case $role in
gpu-probe)
    if [ "${GPU_RUNSH_STANDIN_NO_GPU:-0}" = 1 ]; then
        echo "gpu_probe: no CUDA device: no CUDA-capable device is detected (driver API 0, runtime 13000) [stand-in]"
        exit 77
    fi
    echo "gpu_probe: 1 CUDA device (driver API 13000, runtime 13000) [stand-in]"
    echo "device 0: NVIDIA H200 [stand-in], compute capability 9.0, 132 SMs, 139.8 GiB"
    echo "arch sm_90"
    ;;
device-check-nvrtc | device-check-nvcc)
    k=${role#device-check-}
    echo "device cuda:0: NVIDIA H200 [stand-in], compute capability 9.0, 132 multiprocessors; kernels: $k; launch: 256 threads x up to 4096 blocks"
    echo "memory: alloc alignment, memset, H2D/D2H/D2D copies (offsets), OOM: checked"
    if ! drop "ea-bitwise-$k"; then
        if bad "ea-bitwise-$k"; then v=NO; else v=yes; fi
        echo "ea_pass: 1460 passes (every kind, sizes 1 .. 2^20+3, 5 offset patterns) bitwise equal to the CPU device: $v"
        echo "ea_pass: edge values (NaN, +-Inf, denormals, -0, FLT_MAX; alpha 0, 1, 0.1, denormal) x 24 kinds: bitwise equal (NaN as NaN)"
        echo "averaging module (MEAN, N = 4, P = 2^20+3, 6 rounds, varying order) on the GPU: references and models bitwise equal to the CPU module; non-finite guard: refused"
        echo "averaging module (ELASTIC + momentum, N = 4, P = 2^20+3, 6 rounds, varying order) on the GPU: references and models bitwise equal to the CPU module; non-finite guard: refused"
    fi
    if ! drop "ea-bandwidth-$k"; then
        if bad "ea-bandwidth-$k"; then r=0.712; else r=0.953; fi
        echo "bandwidth, 67108864 floats per buffer (256 MiB), median of 15 (min .. max), bytes read + written per second:"
        echo "  cudaMemcpy D2D                       3900.0 GB/s  (3850.0 .. 3950.0)  0.138 ms"
        echo "BENCH ea_pass/memcpy bandwidth ratio: $r (stand-in)"
    fi
    failed=0
    bad "device-check-$k" && failed=2
    drop "device-check-$k" || echo "cuda_device_check ($k kernels): 812 checks, $failed failed, 4.2 s"
    [ "$failed" = 0 ] || exit 1
    ;;
nccl-check)
    echo "nccl_check: 1 GPU, 1 rank (one process each, id through a file) [stand-in]"
    echo "nccl_check rank 0: ping-pong skipped (one rank)"
    drop nccl-smoke && { echo "nccl_check: rank 0 killed by signal 11 [stand-in]"; exit 1; }
    bad nccl-smoke && { echo "nccl_check: FAILED [stand-in]"; exit 1; }
    echo "nccl_check: two ranks on GPU 0 (must be refused)"
    echo "nccl_check: all ranks passed"
    ;;
cuda-mlp)
    save=0 pipes=1
    prev=
    for a in "$@"; do
        [ "$prev" = --pipes ] && pipes=$a
        [ "$a" = --save ] && save=1
        prev=$a
    done
    if [ "$save" = 1 ]; then
        drop trainer-agreement && { echo "cuda_mlp: an illegal memory access was encountered [stand-in]" >&2; exit 1; }
        [ -n "${AVGPIPE_GPU_STANDIN_CPU:-}" ] || { echo "stand-in: AVGPIPE_GPU_STANDIN_CPU is not set (run.sh exports it)" >&2; exit 1; }
        echo "GPU: NVIDIA H200 [stand-in: the CPU trainer with ${AVGPIPE_GPU_STANDIN_CPU_ENV:-its default kernel}]"
        # the same batches cut into 2 micro-batches instead of run.sh's 4: summed in another grouping, a
        # difference of rounding as the GPU's is (a wrong learning rate for GPU_RUNSH_STANDIN_BAD)
        extra=
        bad trainer-agreement && extra="--lr 0.0011"
        n=$#
        while [ "$n" -gt 0 ]; do
            a=$1
            shift
            [ "$a" = 4 ] && [ "${prev2:-}" = --micro ] && a=2
            prev2=$a
            set -- "$@" "$a"
            n=$((n - 1))
        done
        # shellcheck disable=SC2086
        exec env -u OPENBLAS_CORETYPE -u AVGPIPE_NAIVE_BLAS -u AVGPIPE_BLAS_SHIM_LIB ${AVGPIPE_GPU_STANDIN_CPU_ENV:-} "$AVGPIPE_GPU_STANDIN_CPU" "$@" $extra
    fi
    drop samples-per-s && [ "$pipes" = 3 ] && { echo "cuda_mlp: out of memory [stand-in]" >&2; exit 1; }
    if bad samples-per-s; then rate=$((90000 - 10000 * pipes)); else rate=$((40000 + 20000 * pipes)); fi
    echo "GPU: NVIDIA H200 [stand-in] (cuda:0, compute capability 9.0, 132 SMs), cuBLAS 13.0.0, averaging kernels nvcc"
    echo "trained 1 epochs in 1.0 s ($rate samples/s); reference model test accuracy 0.8123"
    ;;
*)
    echo "gpu_runsh_standin.sh: unknown role '$role'" >&2
    exit 2
    ;;
esac
exit 0
