// PTX check (tests/cuda_ptx_check.sh): the kernels as nvcc compiles them, and a control kernel that nvcc does
// contract into an FMA (and flushes with --use_fast_math), so that the check is seen to be able to fail.
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_cuda.h"

extern "C" __global__ void avgpipe_control(float *x) { x[0] = x[1] * x[2] + x[3]; }
