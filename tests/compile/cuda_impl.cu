// Compile test: avgpipe_cuda.h with its implementation under nvcc: the kernels are compiled by nvcc (or, with
// -DAVGPIPE_CUDA_NVRTC, built at run time by NVRTC, linking -lnvrtc).
#include "cuda_impl.c"
