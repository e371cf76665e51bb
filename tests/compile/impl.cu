// Compile test: the header with its implementation under nvcc (host code).
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

int main() {
    avgpipe_sched_desc d = avgpipe_sched_desc();
    d.kind = AVGPIPE_SCHED_1F1B;
    d.stages = 2;
    d.micro = 4;
    avgpipe_schedule s;
    if (avgpipe_sched_generate(NULL, &d, &s) != AVGPIPE_OK) return 1;
    int ok = s.len[0] > 0;
    avgpipe_sched_free(NULL, &s);
    return ok ? 0 : 1;
}
