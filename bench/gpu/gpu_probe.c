/* bench/gpu/gpu_probe.c: does the CUDA runtime see a GPU? bench/gpu/run.sh's first GPU step (nvidia-smi may
   be missing on a bare image; the runtime is what the programs use). Prints one line per device and,
   for device 0, "arch sm_XY" (run.sh builds the nvcc programs for it). Exit status: 0 at least one device,
   77 none (the reason on one line: the runtime's error, e.g. no driver), 2 bad usage.
   Build: cc -std=c11 -O2 -isystem CUDA/include bench/gpu/gpu_probe.c -LCUDA/lib64 -lcudart */
#include <cuda_runtime_api.h>
#include <stdio.h>

int main(int argc, char **argv) {
    int n = 0, i, driver = 0, runtime = 0;
    cudaError_t e;
    (void)argv;
    if (argc > 1) {
        fprintf(stderr, "usage: gpu_probe\n");
        return 2;
    }
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n < 1) {
        printf("gpu_probe: no CUDA device: %s (driver API %d, runtime %d)\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices",
               driver, runtime);
        return 77;
    }
    printf("gpu_probe: %d CUDA device%s (driver API %d, runtime %d)\n", n, n > 1 ? "s" : "", driver, runtime);
    for (i = 0; i < n; i++) {
        struct cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
            printf("device %d: cudaGetDeviceProperties failed\n", i);
            continue;
        }
        printf("device %d: %s, compute capability %d.%d, %d SMs, %.1f GiB\n", i, p.name, p.major, p.minor, p.multiProcessorCount,
               (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
        if (i == 0) printf("arch sm_%d%d\n", p.major, p.minor);
    }
    return 0;
}
