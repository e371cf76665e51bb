/* Must NOT compile: avgpipe_mpi.h without avgpipe.h before it stops with #error (tests/meson.build runs
   the compiler and expects the failure and the message). */
#include "avgpipe_mpi.h"
int main(void) { return 0; }
