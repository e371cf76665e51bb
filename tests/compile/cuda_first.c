/* Must NOT compile: avgpipe_cuda.h without avgpipe.h before it stops with #error (meson.build runs the
   compiler and expects the failure and the message). */
#include "avgpipe_cuda.h"
int main(void) { return 0; }
