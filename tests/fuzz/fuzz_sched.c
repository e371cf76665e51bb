/* libFuzzer harness: schedule text (section 2) and what reads a schedule (sections 4-9).

   The input is (data, size) with no NUL after it, as avgpipe_sched_import allows. An input that
   imports must also: validate without a crash, export, import back, and export to the very same bytes
   (abort otherwise: the text form is lossless for everything import accepts); lower; and, when it is
   small enough to stay fast, simulate under asynchronous and blocking sends and render its timeline.
   A schedule that validates must lower to one that validates too, and simulate without a deadlock
   under both kinds of sends (the validator's replay says so).

   Build (tests/fuzz/meson.build does this when clang has libFuzzer):
     clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I. \
         tests/fuzz/fuzz_sched.c -o fuzz_sched -lm -pthread
   Run: ./fuzz_sched -max_total_time=60 CORPUS_DIR tests/fuzz/corpus/sched tests/fuzz/regress/sched */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Ops above which an input is not simulated: a run stays in milliseconds. */
#define FUZZ_MAX_SIM_OPS 20000

static void fuzz_fail(const char *what, const avgpipe_buf *a, const avgpipe_buf *b) {
    fprintf(stderr, "fuzz_sched: %s\n--- first export:\n%s\n--- second:\n%s\n", what, a && a->data ? a->data : "",
            b && b->data ? b->data : "");
    abort();
}

static long long count_ops(const avgpipe_schedule *s) {
    long long n = 0;
    int r;
    for (r = 0; r < s->nranks; r++) n += s->len[r];
    return n;
}

static void simulate(avgpipe_context *ctx, const avgpipe_schedule *s, int blocking, int valid) {
    avgpipe_sim_desc sd;
    avgpipe_sim_result r;
    avgpipe_buf out = {NULL, 0, 0};
    avgpipe_result res;
    memset(&sd, 0, sizeof sd);
    sd.blocking_send = blocking;
    sd.latency = 0.5;
    sd.record_events = 1;
    res = avgpipe_sim_run(ctx, s, &sd, &r);
    if (res != AVGPIPE_OK && valid && res != AVGPIPE_OUT_OF_MEMORY) {
        fprintf(stderr, "fuzz_sched: a valid schedule does not simulate (%s sends): %s\n", blocking ? "blocking" : "async",
                avgpipe_last_error(ctx));
        abort();
    }
    if (res != AVGPIPE_OK) return;
    if (!(r.makespan >= 0) || !(r.bubble <= 1)) {
        fprintf(stderr, "fuzz_sched: makespan %g, bubble %g\n", r.makespan, r.bubble);
        abort();
    }
    avgpipe_render_ascii(ctx, r.events, r.nevents, r.nranks, NULL, &out);
    avgpipe_render_chrome(ctx, r.events, r.nevents, r.nranks, NULL, &out);
    avgpipe_render_svg(ctx, r.events, r.nevents, r.nranks, NULL, &out);
    avgpipe_buf_free(ctx, &out);
    avgpipe_sim_result_free(ctx, &r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    avgpipe_context ctx;
    avgpipe_schedule s, back, low;
    avgpipe_validate_report rep;
    avgpipe_buf t1 = {NULL, 0, 0}, t2 = {NULL, 0, 0}, grid = {NULL, 0, 0};
    avgpipe_context_init(&ctx, NULL);
    if (avgpipe_sched_import(&ctx, (const char *)data, size, &s) != AVGPIPE_OK) return 0;

    /* export -> import -> export: the same bytes */
    if (avgpipe_sched_export(&ctx, &s, 0, &t1) != AVGPIPE_OK) fuzz_fail("export failed", NULL, NULL);
    if (avgpipe_sched_import(&ctx, t1.data, t1.len, &back) != AVGPIPE_OK) {
        fprintf(stderr, "fuzz_sched: the export does not import: %s\n", avgpipe_last_error(&ctx));
        fuzz_fail("re-import failed", &t1, NULL);
    }
    if (avgpipe_sched_export(&ctx, &back, 0, &t2) != AVGPIPE_OK) fuzz_fail("second export failed", &t1, NULL);
    if (t1.len != t2.len || memcmp(t1.data, t2.data, t1.len) != 0) fuzz_fail("second export differs", &t1, &t2);
    if (back.nranks != s.nranks || back.nstages != s.nstages || back.has_comm != s.has_comm || count_ops(&back) != count_ops(&s) ||
        memcmp(&back.shape, &s.shape, sizeof s.shape) != 0)
        fuzz_fail("re-imported schedule differs (ranks, stages, ops or shape)", &t1, &t2);
    avgpipe_sched_export(&ctx, &s, AVGPIPE_TEXT_TORCH, &t2); /* may refuse (pipes > 1); must not crash */

    avgpipe_sched_validate(&ctx, &s, NULL, &rep);
    if (rep.result == AVGPIPE_INVALID_SCHEDULE || rep.result == AVGPIPE_DEADLOCK)
        avgpipe_sched_render_grid(&ctx, &s, rep.rank, rep.pos, &grid);
    if (!s.has_comm && avgpipe_sched_lower(&ctx, &s, &low) == AVGPIPE_OK) {
        avgpipe_validate_report lrep;
        avgpipe_validate_desc vd;
        memset(&vd, 0, sizeof vd);
        vd.skip_memory = 1; /* the memory model is the compute schedule's; the lowered one is compared op by op */
        if (rep.result == AVGPIPE_OK && avgpipe_sched_validate(&ctx, &low, &vd, &lrep) != AVGPIPE_OK) {
            fprintf(stderr, "fuzz_sched: a valid schedule lowers to an invalid one: %s\n", lrep.message);
            abort();
        }
        avgpipe_sched_free(&ctx, &low);
    }
    if (count_ops(&s) <= FUZZ_MAX_SIM_OPS && s.nranks <= 256) {
        simulate(&ctx, &s, 0, rep.result == AVGPIPE_OK);
        simulate(&ctx, &s, 1, rep.result == AVGPIPE_OK);
    }
    avgpipe_buf_free(&ctx, &grid);
    avgpipe_buf_free(&ctx, &t1);
    avgpipe_buf_free(&ctx, &t2);
    avgpipe_sched_free(&ctx, &back);
    avgpipe_sched_free(&ctx, &s);
    return 0;
}
