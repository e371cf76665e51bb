/* Compile test: avgpipe_cuda.h's declarations need no CUDA header (no CUDA include path is given). */
#include "avgpipe.h"
#include "avgpipe_cuda.h"

int avgpipe_compile_test_cuda_decl_only(void);
int avgpipe_compile_test_cuda_decl_only(void) {
    avgpipe_device_cuda_desc d = avgpipe_device_cuda_query_defaults(NULL);
    return d.block_size + (int)sizeof(avgpipe_device_cuda_info) + AVGPIPE_DEVICE_CUDA_ALLOC_OVERHEAD;
}
