// Compile test: avgpipe_nccl.h with its implementation in a C++ translation unit (and, through
// nccl_impl.cu, under nvcc).
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_nccl.h"

int main() {
    avgpipe_nccl_desc in = avgpipe_nccl_desc();
    in.device = AVGPIPE_NCCL_DEVICE_LOCAL;
    avgpipe_nccl_desc d = avgpipe_nccl_query_defaults(&in);
    return d.timeout_s > 0 && d.device == AVGPIPE_NCCL_DEVICE_LOCAL && avgpipe_nccl_rank(NULL) == -1 ? 0 : 1;
}
