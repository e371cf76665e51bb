/* Two-TU link test: both translation units compile a private (static) copy of the library. */
#define AVGPIPE_STATIC
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

int avgpipe_static_b(void);

int main(void) {
    avgpipe_sched_desc d = {AVGPIPE_SCHED_AFAB, 2, 2, 0, 0, 0, 0, 0, AVGPIPE_PLACE_AUTO};
    avgpipe_schedule s;
    int n;
    if (avgpipe_sched_generate(NULL, &d, &s) != AVGPIPE_OK) return 1;
    n = s.len[0];
    avgpipe_sched_free(NULL, &s);
    return n == avgpipe_static_b() ? 0 : 1;
}
