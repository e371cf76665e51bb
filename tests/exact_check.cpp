// tests/exact_check.c as C++ (g++ with -Ofast -march=native: see meson.build).
#include "exact_check.c"
