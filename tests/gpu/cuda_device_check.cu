// The GPU check compiled by nvcc: the kernels are compiled into the program (see cuda_device_check.c).
#include "cuda_device_check.c"
