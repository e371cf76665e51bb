/* Second translation unit of the two-TU link test (see static_a.c). */
#define AVGPIPE_STATIC
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

int avgpipe_static_b(void);
int avgpipe_static_b(void) {
    avgpipe_sched_desc d = {AVGPIPE_SCHED_AFAB, 2, 2, 0, 0, 0, 0, 0, AVGPIPE_PLACE_AUTO};
    avgpipe_schedule s;
    int n;
    if (avgpipe_sched_generate(NULL, &d, &s) != AVGPIPE_OK) return -1;
    n = s.len[0];
    avgpipe_sched_free(NULL, &s);
    return n;
}
