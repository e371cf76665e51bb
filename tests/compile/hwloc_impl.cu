// Compile test: avgpipe_hwloc.h with its implementation under nvcc (host code; AVGPIPE_HWLOC_CUDART is on
// by default there): the C++ test, as CUDA.
#include "hwloc_impl.cpp"
