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

/* Generate d into s (0, s untouched, when the kind refuses the shape) with, by mode, no sync ops (0),
   a tie of the first and the last stage (1, when there are two), or that tie and the step agreement
   (2), placed by avgpipe_sched_add_sync. */
static inline int gen_with_sync(const avgpipe_sched_desc *d, int mode, avgpipe_schedule *s) {
    avgpipe_schedule t;
    avgpipe_tie tie;
    avgpipe_sync_desc sy;
    avgpipe_context quiet;
    avgpipe_context_init(&quiet, NULL);
    if (avgpipe_sched_generate(&quiet, d, s) != AVGPIPE_OK) return 0;
    memset(&tie, 0, sizeof tie);
    memset(&sy, 0, sizeof sy);
    tie.stage_a = 0, tie.stage_b = s->nstages - 1, tie.count = 4;
    sy.ties = &tie;
    sy.nties = mode >= 1 && s->nstages > 1;
    sy.agree = mode == 2;
    if (sy.nties || sy.agree) {
        cr_assert_eq(avgpipe_sched_add_sync(NULL, s, &sy, &t), AVGPIPE_OK, "%s mode %d: %s", shape_str(d), mode, avgpipe_last_error(NULL));
        avgpipe_sched_free(NULL, s);
        *s = t;
    }
    return 1;
}

#endif
