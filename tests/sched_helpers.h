/* Helpers shared by the schedule test suites (include after avgpipe.h and criterion.h). */
#ifndef AVGPIPE_TESTS_SCHED_HELPERS_H
#define AVGPIPE_TESTS_SCHED_HELPERS_H

#include <stdio.h>
#include <string.h>

static inline avgpipe_sched_desc desc_of(avgpipe_sched_kind kind, int S, int M, int N, int V, int R, int K, int cont) {
    avgpipe_sched_desc d;
    memset(&d, 0, sizeof d);
    d.kind = kind;
    d.stages = S;
    d.micro = M;
    d.pipes = N;
    d.chunks = (kind == AVGPIPE_SCHED_ZBV || kind == AVGPIPE_SCHED_DUALPIPEV) && V == 1 ? 0 : V; /* V kinds: two chunks, their own */
    d.rounds = R;
    d.advance = K;
    d.continuous = cont;
    return d;
}

/* The shape in words, for assertion messages (one static buffer: use it once per message). */
static inline const char *shape_str(const avgpipe_sched_desc *d) {
    static char buf[160];
    snprintf(buf, sizeof buf, "%s S=%d M=%d N=%d V=%d R=%d K=%d continuous=%d", avgpipe_sched_kind_name(d->kind), d->stages,
             d->micro, d->pipes, d->chunks, d->rounds, d->advance, d->continuous);
    return buf;
}

/* Shapes a generator refuses by design: DualPipeV needs N·M >= 2S micro-batches per round. */
static inline int gen_skips(const avgpipe_sched_desc *d) {
    return d->kind == AVGPIPE_SCHED_DUALPIPEV && (long long)(d->pipes > 0 ? d->pipes : 1) * d->micro < 2LL * d->stages;
}

static inline void gen(const avgpipe_sched_desc *d, avgpipe_schedule *s) {
    avgpipe_result r = avgpipe_sched_generate(NULL, d, s);
    cr_assert_eq(r, AVGPIPE_OK, "generate %s: %s (%s)", shape_str(d), avgpipe_result_string(r), avgpipe_last_error(NULL));
}

#endif
