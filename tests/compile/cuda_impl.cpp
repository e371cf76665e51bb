// Compile test: avgpipe_cuda.h with its implementation in a C++ translation unit (NVRTC kernels).
#include "cuda_impl.c"
