/* Compile test: the header with its implementation, C11, every warning an error. */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe.h" /* a second include is harmless */

int main(void) {
    avgpipe_context ctx;
    if (avgpipe_context_init(&ctx, NULL) != AVGPIPE_OK) return 1;
    return avgpipe_result_string(AVGPIPE_OK)[0] == 'o' ? 0 : 1;
}
