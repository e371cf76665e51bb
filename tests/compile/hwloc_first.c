/* Must NOT compile: avgpipe_hwloc.h without avgpipe.h before it stops with #error (meson.build runs the
   compiler and expects the failure and the message). */
#include "avgpipe_hwloc.h"
int main(void) { return 0; }
