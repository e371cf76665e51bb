/* Compile test: the declarations alone (no implementation) are valid C11. */
#include "avgpipe.h"

int avgpipe_compile_test_decl_only(void);
int avgpipe_compile_test_decl_only(void) { return (int)sizeof(avgpipe_schedule) + (int)AVGPIPE_OP_KIND_COUNT; }
