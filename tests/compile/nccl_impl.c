/* Compile test: avgpipe_nccl.h with its implementation (AVGPIPE_IMPLEMENTATION turns both on), C11, linked
   against NCCL and the CUDA runtime. Runs without a GPU (nothing here touches the device). */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_nccl.h"
#include "avgpipe_nccl.h" /* a second include is harmless */

int main(void) {
    avgpipe_nccl_desc d = avgpipe_nccl_query_defaults(NULL);
    return d.timeout_s > 0 && avgpipe_nccl_rank(NULL) == -1 && avgpipe_nccl_device(NULL) == -1 ? 0 : 1;
}
