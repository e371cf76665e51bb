/* Compile test: avgpipe_cuda.h with its implementation (AVGPIPE_IMPLEMENTATION turns both headers' on), C11,
   every warning an error; links the CUDA runtime and NVRTC (the kernels are built at run time). Runs without a
   GPU: only the host parts are called. */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_cuda.h"
#include "avgpipe_cuda.h" /* a second include is harmless */

int main(void) {
    float w[5] = {1, 2, 3, 4, 5}, z[5] = {0, 0, 0, 0, 0}, acc[5] = {0, 0, 0, 0, 0};
    avgpipe_ea_pass p;
    avgpipe_device_cuda_desc d = avgpipe_device_cuda_query_defaults(NULL);
    memset(&p, 0, sizeof p);
    p.w = w, p.z = z, p.acc = acc, p.count = 5, p.mode = AVGPIPE_EA_MEAN, p.alpha = 0.5f, p.first = 1;
    if (avgpipe_device_cuda_ea_pass_host(NULL, &p) != AVGPIPE_OK) return 1;
    return d.block_size == 256 && w[4] == 2.5f && acc[4] == 2.5f ? 0 : 1;
}
