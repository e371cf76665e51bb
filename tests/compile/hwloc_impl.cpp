// Compile test: avgpipe_hwloc.h with its implementation in a C++ translation unit (the C test, as C++).
#include "hwloc_impl.c"
