/* Second translation unit of the CUDA two-TU link test (see cuda_static_a.c). */
#define AVGPIPE_STATIC
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_cuda.h"

int avgpipe_cuda_static_b(void);
int avgpipe_cuda_static_b(void) { return avgpipe_device_cuda_query_defaults(NULL).block_size; }
