// Compile test: avgpipe_nccl.h with its implementation under nvcc (host code): the C++ test, as CUDA.
#include "nccl_impl.cpp"
