// Compile test: the header with its implementation under nvcc (host code): the C++ test, as CUDA.
#include "impl.cpp"
