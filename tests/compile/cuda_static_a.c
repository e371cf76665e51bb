/* Two-TU link test: both translation units compile a private (static) copy of avgpipe.h and avgpipe_cuda.h. */
#define AVGPIPE_STATIC
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_cuda.h"

int avgpipe_cuda_static_b(void);

int main(void) {
    avgpipe_device_cuda_desc d = avgpipe_device_cuda_query_defaults(NULL);
    return d.block_size == avgpipe_cuda_static_b() ? 0 : 1;
}
