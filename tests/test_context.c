/* Tests of the basics: the context (allocator and logger hooks, last-error buffers), result strings,
   and that every allocation of the schedule, validation, simulation and text layers goes through the
   allocator hook and is given back, also when an allocation fails halfway (fault injection).

   Build and run from the repository root:
     gcc -std=c11 -O2 -Wall -Wextra -pedantic -Werror -I. tests/test_context.c -o /tmp/test_context \
         -lcriterion -lm && /tmp/test_context */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include "tests/sched_helpers.h"
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a counting allocator that can fail on purpose --------------------------------------------- */

#define TRACK_SLOTS (1 << 18)

typedef struct counter {
    long allocs, frees, live, foreign;
    long fail_at; /* the allocation with this index (0-based) and all later ones fail; -1: never */
    void *slot[TRACK_SLOTS]; /* live pointers, open addressing */
} counter;

static counter *g_counter;

static size_t slot_of(void *p) { return (size_t)(((uintptr_t)p >> 4) * 2654435761u) & (TRACK_SLOTS - 1); }

static void *count_alloc(size_t size, void *user) {
    counter *c = (counter *)user;
    void *p;
    size_t h;
    if (c->fail_at >= 0 && c->allocs >= c->fail_at) return NULL;
    p = malloc(size);
    if (!p) return NULL;
    c->allocs++;
    c->live++;
    for (h = slot_of(p); c->slot[h]; h = (h + 1) & (TRACK_SLOTS - 1)) {
    }
    c->slot[h] = p;
    return p;
}

static void count_free(void *ptr, void *user) {
    counter *c = (counter *)user;
    size_t h, n;
    if (!ptr) return;
    for (h = slot_of(ptr), n = 0; c->slot[h] != ptr && n < TRACK_SLOTS; h = (h + 1) & (TRACK_SLOTS - 1), n++)
        if (!c->slot[h]) break;
    if (c->slot[h] != ptr) { /* not ours, or freed twice: do not touch it */
        c->foreign++;
        return;
    }
    /* remove with backward-shift deletion */
    c->slot[h] = NULL;
    {
        size_t j = (h + 1) & (TRACK_SLOTS - 1);
        while (c->slot[j]) {
            void *q = c->slot[j];
            c->slot[j] = NULL;
            {
                size_t k;
                for (k = slot_of(q); c->slot[k]; k = (k + 1) & (TRACK_SLOTS - 1)) {
                }
                c->slot[k] = q;
            }
            j = (j + 1) & (TRACK_SLOTS - 1);
        }
    }
    c->frees++;
    c->live--;
    free(ptr);
}

static void counting_ctx(avgpipe_context *ctx, long fail_at) {
    avgpipe_context_desc d;
    if (!g_counter) g_counter = (counter *)calloc(1, sizeof *g_counter);
    cr_assert_not_null(g_counter);
    cr_assert_eq(g_counter->live, 0, "previous step leaked %ld allocations", g_counter->live);
    memset(g_counter, 0, sizeof *g_counter);
    g_counter->fail_at = fail_at;
    memset(&d, 0, sizeof d);
    d.allocator.alloc = count_alloc;
    d.allocator.free = count_free;
    d.allocator.user = g_counter;
    cr_assert_eq(avgpipe_context_init(ctx, &d), AVGPIPE_OK);
}

static void assert_all_freed(const char *what) {
    cr_assert_eq(g_counter->foreign, 0, "%s: %ld frees of pointers the allocator never gave (or twice)", what, g_counter->foreign);
    cr_assert_eq(g_counter->live, 0, "%s: %ld of %ld allocations never freed", what, g_counter->live, g_counter->allocs);
    cr_assert_eq(g_counter->allocs, g_counter->frees, "%s: %ld allocations, %ld frees", what, g_counter->allocs, g_counter->frees);
}

/* ---- context ------------------------------------------------------------------------------------ */

Test(context, rejects_half_set_allocator) {
    avgpipe_context ctx;
    avgpipe_context_desc d;
    counter *c = (counter *)calloc(1, sizeof *c);
    memset(&d, 0, sizeof d);
    d.allocator.alloc = count_alloc;
    cr_assert_eq(avgpipe_context_init(&ctx, &d), AVGPIPE_INVALID_ARG, "alloc without free accepted");
    cr_assert_not_null(strstr(avgpipe_last_error(&ctx), "allocator"), "message '%s'", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_last_result(&ctx), AVGPIPE_INVALID_ARG);
    d.allocator.alloc = NULL;
    d.allocator.free = count_free;
    cr_assert_eq(avgpipe_context_init(&ctx, &d), AVGPIPE_INVALID_ARG, "free without alloc accepted");
    cr_assert_not_null(strstr(avgpipe_last_error(&ctx), "allocator"), "message '%s'", avgpipe_last_error(&ctx));
    d.allocator.alloc = count_alloc;
    d.allocator.user = c;
    cr_assert_eq(avgpipe_context_init(&ctx, &d), AVGPIPE_OK);
    cr_assert_str_eq(avgpipe_last_error(&ctx), "");
    cr_assert_eq(avgpipe_last_result(&ctx), AVGPIPE_OK);
    cr_assert_eq(avgpipe_context_init(NULL, &d), AVGPIPE_INVALID_ARG);
    free(c);
}

Test(context, defaults_and_query) {
    avgpipe_context ctx;
    avgpipe_context_desc q, d;
    counter *c = (counter *)calloc(1, sizeof *c);
    c->fail_at = -1;
    cr_assert_eq(avgpipe_context_init(&ctx, NULL), AVGPIPE_OK);
    q = avgpipe_context_query(&ctx);
    cr_assert_not_null((void *)(uintptr_t)q.allocator.alloc, "default alloc not resolved");
    cr_assert_not_null((void *)(uintptr_t)q.allocator.free, "default free not resolved");
    cr_assert_eq(q.log_level, AVGPIPE_LOG_WARN, "default log level %d", q.log_level);
    cr_assert_null((void *)(uintptr_t)q.log);
    q = avgpipe_context_query(NULL);
    cr_assert_not_null((void *)(uintptr_t)q.allocator.alloc);
    cr_assert_eq(q.log_level, AVGPIPE_LOG_WARN);
    memset(&d, 0, sizeof d);
    d.allocator.alloc = count_alloc;
    d.allocator.free = count_free;
    d.allocator.user = c;
    d.log_level = AVGPIPE_LOG_DEBUG;
    cr_assert_eq(avgpipe_context_init(&ctx, &d), AVGPIPE_OK);
    q = avgpipe_context_query(&ctx);
    cr_assert(q.allocator.alloc == count_alloc && q.allocator.free == count_free && q.allocator.user == c, "allocator not kept");
    cr_assert_eq(q.log_level, AVGPIPE_LOG_DEBUG);
    {
        void *p = avgpipe_alloc(&ctx, 100);
        cr_assert_not_null(p);
        cr_assert_eq(c->allocs, 1, "avgpipe_alloc did not use the hook");
        avgpipe_free(&ctx, p);
        avgpipe_free(&ctx, NULL); /* harmless */
        cr_assert_eq(c->frees, 1);
        cr_assert_eq(c->live, 0);
        cr_assert_eq(c->foreign, 0);
    }
    free(c);
}

Test(context, version_at_run_time) {
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", AVGPIPE_VERSION_MAJOR, AVGPIPE_VERSION_MINOR, AVGPIPE_VERSION_PATCH);
    cr_assert_str_eq(avgpipe_version(), want);
    cr_assert_str_eq(avgpipe_version(), AVGPIPE_VERSION_STRING);
    cr_assert_eq(avgpipe_version_number(), AVGPIPE_VERSION_MAJOR * 10000 + AVGPIPE_VERSION_MINOR * 100 + AVGPIPE_VERSION_PATCH);
}

Test(context, result_strings_nonempty_and_distinct) {
#define LIST_CODE(name, value, text) name,
    static const avgpipe_result codes[] = {AVGPIPE_RESULT_LIST(LIST_CODE)};
#undef LIST_CODE
    size_t n = sizeof codes / sizeof codes[0], i, j;
    cr_assert_eq(n, 15, "%zu result codes", n);
    for (i = 0; i < n; i++) {
        const char *a = avgpipe_result_string(codes[i]);
        cr_assert_not_null(a);
        cr_assert_gt(strlen(a), 0, "code %d has an empty string", codes[i]);
        if (codes[i] != AVGPIPE_OK) cr_assert_lt(codes[i], 0, "error code %d is not negative", codes[i]);
        for (j = 0; j < i; j++) {
            cr_assert_neq(codes[i], codes[j], "codes %zu and %zu share value %d", i, j, codes[i]);
            cr_assert_str_neq(a, avgpipe_result_string(codes[j]), "codes %d and %d share the string '%s'", codes[i], codes[j], a);
        }
    }
    cr_assert_not_null(avgpipe_result_string((avgpipe_result)-999));
    cr_assert_gt(strlen(avgpipe_result_string((avgpipe_result)-999)), 0);
    cr_assert_str_eq(avgpipe_result_string(AVGPIPE_OK), "ok");
}

typedef struct log_sink {
    int calls;
    avgpipe_log_level level;
    char last[AVGPIPE_ERROR_MAX];
} log_sink;

static void sink_log(avgpipe_log_level level, const char *msg, void *user) {
    log_sink *s = (log_sink *)user;
    s->calls++;
    s->level = level;
    snprintf(s->last, sizeof s->last, "%s", msg);
}

Test(context, logger_gets_errors) {
    avgpipe_context ctx;
    avgpipe_context_desc d;
    log_sink sink;
    avgpipe_sched_desc sd = desc_of(AVGPIPE_SCHED_1F1B, 0, 4, 1, 1, 1, 0, 0);
    avgpipe_schedule s;
    memset(&sink, 0, sizeof sink);
    memset(&d, 0, sizeof d);
    d.log = sink_log;
    d.log_user = &sink;
    cr_assert_eq(avgpipe_context_init(&ctx, &d), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_generate(&ctx, &sd, &s), AVGPIPE_INVALID_ARG);
    cr_assert_eq(sink.calls, 1, "logger called %d times", sink.calls);
    cr_assert_eq(sink.level, AVGPIPE_LOG_ERROR);
    cr_assert_str_eq(sink.last, avgpipe_last_error(&ctx));
    cr_assert_not_null(strstr(sink.last, "stages"), "%s", sink.last);
    sd.stages = 2;
    cr_assert_eq(avgpipe_sched_generate(&ctx, &sd, &s), AVGPIPE_OK);
    cr_assert_eq(sink.calls, 1, "a successful call logged at the default level");
    avgpipe_sched_free(&ctx, &s);
}

static void *fail_in_thread(void *arg) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_1F1B, 1, 0, 1, 1, 1, 0, 0);
    avgpipe_schedule s;
    (void)arg;
    if (avgpipe_sched_generate(NULL, &d, &s) != AVGPIPE_INVALID_ARG) return NULL;
    return strstr(avgpipe_last_error(NULL), "micro") ? (void *)1 : NULL;
}

/* A NULL context means this thread's own error buffer. */
Test(context, null_context_error_is_per_thread) {
    pthread_t t;
    void *ok = NULL;
    avgpipe_clear_error(NULL);
    cr_assert_eq(pthread_create(&t, NULL, fail_in_thread, NULL), 0);
    cr_assert_eq(pthread_join(t, &ok), 0);
    cr_assert_not_null(ok, "the other thread did not see its error");
    cr_assert_str_eq(avgpipe_last_error(NULL), "", "another thread's error leaked here: '%s'", avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_last_result(NULL), AVGPIPE_OK);
}

Test(context, schedule_building_errors) {
    avgpipe_schedule s;
    avgpipe_op op;
    memset(&s, 0, sizeof s);
    avgpipe_sched_free(NULL, &s); /* safe on a zeroed struct */
    cr_assert_eq(avgpipe_sched_init(NULL, &s, 0, NULL), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_sched_init(NULL, &s, 2, NULL), AVGPIPE_OK);
    memset(&op, 0, sizeof op);
    op.kind = AVGPIPE_OP_F;
    cr_assert_eq(avgpipe_sched_push(NULL, &s, 2, op), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_sched_push(NULL, &s, -1, op), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_sched_push(NULL, &s, 1, op), AVGPIPE_OK);
    cr_assert_eq(s.len[1], 1);
    avgpipe_sched_free(NULL, &s);
    cr_assert_null(s.ops);
    avgpipe_sched_free(NULL, &s); /* twice is harmless */
}

/* ---- everything through the hook, everything given back --------------------------------------- */

static const char golden_like[] = "0F0,0F1,2F0,,2F1,2I0,2W0,0I0,0W0,2I1,2W1,0I1,0W1\n,1F0,1F1,3F0,3I0,3F1,3I1,3W0,3W1,1I0,1W0,1I1,1W1\n";

/* One pass over the library's allocating calls on ctx. Returns the first failing result (OK if
   none); with a failing allocator each call must fail cleanly with AVGPIPE_OUT_OF_MEMORY. */
static avgpipe_result exercise(avgpipe_context *ctx, int step) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ADVANCE, 4, 6, 2, 1, 2, 2, step & 1);
    avgpipe_schedule s, low, cp, imp;
    avgpipe_sim_desc sd;
    avgpipe_sim_result r;
    avgpipe_validate_report rep;
    avgpipe_buf b = {NULL, 0, 0};
    avgpipe_greedy_desc g;
    avgpipe_result res;
    memset(&s, 0, sizeof s), memset(&low, 0, sizeof low), memset(&cp, 0, sizeof cp), memset(&imp, 0, sizeof imp);
    memset(&r, 0, sizeof r);
    switch (step / 2) {
    case 0: /* generate + validate */
        if ((res = avgpipe_sched_generate(ctx, &d, &s))) return res;
        res = avgpipe_sched_validate(ctx, &s, NULL, &rep);
        break;
    case 1: /* lower + validate the lowered schedule */
        d.kind = AVGPIPE_SCHED_ZBH1;
        if ((res = avgpipe_sched_generate(ctx, &d, &s))) return res;
        if ((res = avgpipe_sched_lower(ctx, &s, &low))) break;
        res = avgpipe_sched_validate(ctx, &low, NULL, &rep);
        break;
    case 2: /* simulate, with events and blocking sends (which lowers internally) */
        d.kind = AVGPIPE_SCHED_INTERLEAVED;
        d.chunks = 2;
        d.micro = 8;
        if ((res = avgpipe_sched_generate(ctx, &d, &s))) return res;
        memset(&sd, 0, sizeof sd);
        sd.record_events = 1;
        sd.blocking_send = step & 1;
        sd.latency = 0.5;
        if ((res = avgpipe_sim_run(ctx, &s, &sd, &r))) break;
        if ((res = avgpipe_render_ascii(ctx, r.events, r.nevents, r.nranks, NULL, &b))) break;
        if ((res = avgpipe_render_chrome(ctx, r.events, r.nevents, r.nranks, NULL, &b))) break;
        res = avgpipe_render_svg(ctx, r.events, r.nevents, r.nranks, NULL, &b);
        break;
    case 3: /* export, import, copy, grid */
        if ((res = avgpipe_sched_generate(ctx, &d, &s))) return res;
        if ((res = avgpipe_sched_export(ctx, &s, 0, &b))) break;
        if ((res = avgpipe_sched_import(ctx, b.data, b.len, &imp))) break;
        if ((res = avgpipe_sched_copy(ctx, &imp, &cp))) break;
        res = avgpipe_sched_render_grid(ctx, &cp, 1, 3, &b);
        break;
    case 4: /* greedy; import of a PyTorch-style file, validated */
        memset(&g, 0, sizeof g);
        g.shape.stages = 3, g.shape.micro = 5, g.shape.pipes = 2, g.shape.rounds = 2, g.shape.continuous = 1, g.split_backward = step & 1;
        if ((res = avgpipe_sched_greedy(ctx, &g, &s))) return res;
        if ((res = avgpipe_sched_import(ctx, golden_like, sizeof golden_like - 1, &imp))) break;
        res = avgpipe_sched_validate(ctx, &imp, NULL, &rep);
        break;
    default: /* failures must clean up too: a parse error, a deadlock in validation and simulation */
        res = avgpipe_sched_import(ctx, "0F0,0B0\n1F0,1Z0\n", 16, &imp);
        if (res == AVGPIPE_PARSE_ERROR) res = AVGPIPE_OK;
        if (res) break;
        if ((res = avgpipe_sched_import(ctx, "0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n", 32, &imp))) break;
        res = avgpipe_sched_validate(ctx, &imp, NULL, &rep);
        if (res == AVGPIPE_DEADLOCK) res = avgpipe_sim_run(ctx, &imp, NULL, &r);
        if (res == AVGPIPE_DEADLOCK) res = AVGPIPE_OK;
        break;
    }
    avgpipe_buf_free(ctx, &b);
    avgpipe_sim_result_free(ctx, &r);
    avgpipe_sched_free(ctx, &cp);
    avgpipe_sched_free(ctx, &imp);
    avgpipe_sched_free(ctx, &low);
    avgpipe_sched_free(ctx, &s);
    return res;
}
#define NSTEPS 12

Test(memory, everything_freed) {
    int step;
    for (step = 0; step < NSTEPS; step++) {
        avgpipe_context ctx;
        avgpipe_result res;
        char what[32];
        counting_ctx(&ctx, -1);
        res = exercise(&ctx, step);
        cr_assert_eq(res, AVGPIPE_OK, "step %d: %s (%s)", step, avgpipe_result_string(res), avgpipe_last_error(&ctx));
        cr_assert_gt(g_counter->allocs, 0, "step %d allocated nothing through the hook", step);
        snprintf(what, sizeof what, "step %d", step);
        assert_all_freed(what);
    }
}

/* Make allocation number k fail, for every k until the step succeeds: each failure is reported as
   AVGPIPE_OUT_OF_MEMORY with a message, nothing leaks, nothing is freed twice, nothing crashes. */
Test(memory, allocation_failures_are_clean) {
    int step;
    for (step = 0; step < NSTEPS; step++) {
        long k;
        for (k = 0;; k++) {
            avgpipe_context ctx;
            avgpipe_result res;
            char what[64];
            counting_ctx(&ctx, k);
            res = exercise(&ctx, step);
            snprintf(what, sizeof what, "step %d failing allocation #%ld", step, k);
            assert_all_freed(what);
            if (res == AVGPIPE_OK) {
                cr_assert_lt(g_counter->allocs, k + 1, "%s: succeeded although an allocation failed", what);
                break;
            }
            cr_assert_eq(res, AVGPIPE_OUT_OF_MEMORY, "%s: %s (%s)", what, avgpipe_result_string(res), avgpipe_last_error(&ctx));
            cr_assert_neq(avgpipe_last_error(&ctx)[0], 0, "%s: no message", what);
            cr_assert_lt(k, 100000, "step %d never succeeds", step);
        }
    }
}

/* ---- every description's zero fields, as its query_defaults resolves them ------------------------ */

/* Two schedules hold the same ops in the same order on every rank. */
static int same_ops(const avgpipe_schedule *a, const avgpipe_schedule *b) {
    int r;
    if (a->nranks != b->nranks) return 0;
    for (r = 0; r < a->nranks; r++)
        if (a->len[r] != b->len[r] || memcmp(a->ops[r], b->ops[r], a->len[r] * sizeof(avgpipe_op)) != 0) return 0;
    return 1;
}

Test(defaults, context) {
    avgpipe_context_desc d, q;
    memset(&d, 0, sizeof d);
    q = avgpipe_context_query_defaults(&d);
    cr_assert(q.allocator.alloc != NULL && q.allocator.free != NULL && q.log == NULL);
    cr_assert_eq(q.log_level, AVGPIPE_LOG_WARN);
    q = avgpipe_context_query_defaults(NULL);
    cr_assert_eq(q.log_level, AVGPIPE_LOG_WARN);
    d.log_level = AVGPIPE_LOG_DEBUG;
    cr_assert_eq(avgpipe_context_query_defaults(&d).log_level, AVGPIPE_LOG_DEBUG, "a set field is kept");
    { /* what init resolves is what the query says */
        avgpipe_context ctx;
        avgpipe_context_init(&ctx, &d);
        q = avgpipe_context_query_defaults(&d);
        cr_assert(q.allocator.alloc == ctx.desc.allocator.alloc && q.allocator.free == ctx.desc.allocator.free &&
                  q.allocator.user == ctx.desc.allocator.user && q.log == ctx.desc.log && q.log_user == ctx.desc.log_user &&
                  q.log_level == ctx.desc.log_level);
    }
}

Test(defaults, sched) {
    static const struct { avgpipe_sched_kind kind; int chunks; avgpipe_placement place; } want[] = {
        {AVGPIPE_SCHED_AFAB, 1, AVGPIPE_PLACE_LOOP},        {AVGPIPE_SCHED_1F1B, 1, AVGPIPE_PLACE_LOOP},
        {AVGPIPE_SCHED_ADVANCE, 1, AVGPIPE_PLACE_LOOP},     {AVGPIPE_SCHED_INTERLEAVED, 2, AVGPIPE_PLACE_LOOP},
        {AVGPIPE_SCHED_ZBH1, 1, AVGPIPE_PLACE_LOOP},        {AVGPIPE_SCHED_ZBV, 2, AVGPIPE_PLACE_V},
        {AVGPIPE_SCHED_DUALPIPEV, 2, AVGPIPE_PLACE_V}};
    size_t i;
    for (i = 0; i < sizeof want / sizeof want[0]; i++) {
        avgpipe_sched_desc d, q, r;
        avgpipe_schedule a, b;
        memset(&d, 0, sizeof d);
        d.kind = want[i].kind, d.stages = 2, d.micro = 4, d.advance = 1;
        q = avgpipe_sched_query_defaults(&d);
        cr_assert(q.pipes == 1 && q.rounds == 1, "%s", avgpipe_sched_kind_name(d.kind));
        cr_assert_eq(q.chunks, want[i].chunks, "%s: chunks %d", avgpipe_sched_kind_name(d.kind), q.chunks);
        cr_assert_eq(q.placement, want[i].place, "%s: placement %s", avgpipe_sched_kind_name(d.kind), avgpipe_placement_name(q.placement));
        cr_assert_eq(q.advance, avgpipe_sched_kind_query(d.kind)->advance ? 1 : 0, "%s: advance %d", avgpipe_sched_kind_name(d.kind), q.advance);
        cr_assert_eq(avgpipe_sched_resolve(NULL, &d, &r), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
        cr_assert(q.kind == r.kind && q.stages == r.stages && q.micro == r.micro && q.pipes == r.pipes && q.chunks == r.chunks &&
                      q.rounds == r.rounds && q.advance == r.advance && q.continuous == r.continuous && q.placement == r.placement,
                  "%s: resolve and query_defaults differ", avgpipe_sched_kind_name(d.kind));
        /* the resolved description is the same schedule as the zero one */
        cr_assert_eq(avgpipe_sched_generate(NULL, &d, &a), AVGPIPE_OK);
        cr_assert_eq(avgpipe_sched_generate(NULL, &q, &b), AVGPIPE_OK);
        cr_assert(same_ops(&a, &b), "%s", avgpipe_sched_kind_name(d.kind));
        avgpipe_sched_free(NULL, &a);
        avgpipe_sched_free(NULL, &b);
    }
    cr_assert_eq(avgpipe_sched_query_defaults(NULL).pipes, 1);
}

Test(defaults, greedy) {
    avgpipe_greedy_desc d, q;
    avgpipe_schedule a, b;
    memset(&d, 0, sizeof d);
    d.shape.stages = 3, d.shape.micro = 4;
    q = avgpipe_greedy_query_defaults(&d);
    cr_assert(q.shape.pipes == 1 && q.shape.rounds == 1 && q.shape.chunks == 1 && q.shape.placement == AVGPIPE_PLACE_LOOP);
    cr_assert(q.cost_f == 1 && q.cost_b == 2 && q.cost_i == 1 && q.cost_w == 1, "%g %g %g %g", q.cost_f, q.cost_b, q.cost_i, q.cost_w);
    cr_assert(q.priority[0] == AVGPIPE_OP_B && q.priority[1] == AVGPIPE_OP_F && q.priority[2] == 0, "%d %d %d", q.priority[0],
              q.priority[1], q.priority[2]);
    cr_assert_eq(avgpipe_sched_greedy(NULL, &d, &a), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_sched_greedy(NULL, &q, &b), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    cr_assert(same_ops(&a, &b), "the resolved description gives another schedule");
    avgpipe_sched_free(NULL, &a);
    avgpipe_sched_free(NULL, &b);
    d.split_backward = 1, d.priority[0] = AVGPIPE_OP_W, d.cost_w = AVGPIPE_ZERO;
    q = avgpipe_greedy_query_defaults(&d);
    cr_assert(q.priority[0] == AVGPIPE_OP_W && q.priority[1] == AVGPIPE_OP_I && q.priority[2] == AVGPIPE_OP_F, "%d %d %d", q.priority[0],
              q.priority[1], q.priority[2]);
    cr_assert_eq(q.cost_w, 0.0, "AVGPIPE_ZERO resolves to 0");
    d.shape.chunks = 2;
    cr_assert_eq(avgpipe_sched_greedy(NULL, &d, &a), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(NULL), "shape.chunks") != NULL, "%s", avgpipe_last_error(NULL));
}

Test(defaults, sim_and_render) {
    avgpipe_sim_desc d, q;
    avgpipe_render_desc rd, rq;
    int k;
    memset(&d, 0, sizeof d);
    d.cost[AVGPIPE_OP_W] = AVGPIPE_ZERO, d.cost[AVGPIPE_OP_B] = 3;
    q = avgpipe_sim_query_defaults(&d);
    cr_assert(q.cost[AVGPIPE_OP_F] == 1 && q.cost[AVGPIPE_OP_B] == 3 && q.cost[AVGPIPE_OP_I] == 1 && q.cost[AVGPIPE_OP_W] == 0);
    for (k = 0; k < AVGPIPE_OP_KIND_COUNT; k++)
        if (k < AVGPIPE_OP_F || k > AVGPIPE_OP_W) cr_assert_eq(q.cost[k], 0.0, "kind %s", avgpipe_op_kind_name((avgpipe_op_kind)k));
    cr_assert(q.micro_size == 1 && q.latency == 0 && q.bandwidth == 0 && q.record_events == 0);
    cr_assert_eq(avgpipe_sim_query_defaults(NULL).cost[AVGPIPE_OP_B], 2.0);
    { /* the simulator resolves the same way: the zero description and a resolved one without AVGPIPE_ZERO agree */
        avgpipe_sched_desc sd;
        avgpipe_schedule s;
        avgpipe_sim_result a, b;
        avgpipe_sim_desc z, zq;
        memset(&sd, 0, sizeof sd);
        sd.kind = AVGPIPE_SCHED_ZBH1, sd.stages = 3, sd.micro = 6;
        cr_assert_eq(avgpipe_sched_generate(NULL, &sd, &s), AVGPIPE_OK);
        memset(&z, 0, sizeof z);
        z.scale_by_micro_size = 1;
        zq = avgpipe_sim_query_defaults(&z);
        cr_assert_eq(avgpipe_sim_run(NULL, &s, &z, &a), AVGPIPE_OK);
        cr_assert_eq(avgpipe_sim_run(NULL, &s, &zq, &b), AVGPIPE_OK);
        cr_assert(a.makespan == b.makespan && a.makespan > 0, "%g vs %g", a.makespan, b.makespan);
        avgpipe_sim_result_free(NULL, &a);
        avgpipe_sim_result_free(NULL, &b);
        avgpipe_sched_free(NULL, &s);
    }
    memset(&rd, 0, sizeof rd);
    rq = avgpipe_render_query_defaults(&rd);
    cr_assert(rq.width == 120 && rq.us_per_unit == 1000 && rq.px_per_unit == 0 && rq.title == NULL);
    rd.width = 33;
    cr_assert_eq(avgpipe_render_query_defaults(&rd).width, 33);
}

Test(defaults, run) {
    avgpipe_run_desc d, q;
    memset(&d, 0, sizeof d);
    d.sched.kind = AVGPIPE_SCHED_INTERLEAVED, d.sched.stages = 2, d.sched.micro = 4;
    q = avgpipe_run_query_defaults(&d);
    cr_assert(q.sched.chunks == 2 && q.sched.pipes == 1 && q.sched.rounds == 1, "sched resolved as avgpipe_sched_query_defaults");
    cr_assert(q.averaging.mode == AVGPIPE_EA_MEAN && q.averaging.alpha == 0.1f && q.averaging.momentum == 0);
    cr_assert(q.timeout_s == 60 && q.replicas == 1 && q.average_every == 1 && q.micro_samples == 1 && q.window == 3,
              "timeout %g replicas %d every %d samples %g window %d", q.timeout_s, q.replicas, q.average_every, q.micro_samples, q.window);
    cr_assert(q.comm == NULL && q.device == NULL && q.mem_limit == 0 && q.adaptive == 0 && q.deterministic == 0);
    d.averaging.alpha = AVGPIPE_ZERO, d.timeout_s = 5;
    q = avgpipe_run_query_defaults(&d);
    cr_assert(q.averaging.alpha == 0.0f && q.timeout_s == 5);
    cr_assert_eq(avgpipe_run_query_defaults(NULL).window, 3);
}

Test(defaults, tune) {
    avgpipe_tune_desc d, q;
    avgpipe_tune_split_desc pd;
    unsigned want1 = 0, want2 = 0;
    int k;
    for (k = AVGPIPE_SCHED_CUSTOM + 1; k < AVGPIPE_SCHED_KIND_COUNT; k++) {
        const avgpipe_sched_kind_info *info = avgpipe_sched_kind_query((avgpipe_sched_kind)k);
        if (!info->tuned) continue;
        if (info->chunks == 1) want1 |= 1u << k;
        else want2 |= 1u << k; /* interleaved (any V > 1), ZB-V and DualPipeV (V = 2) */
    }
    memset(&d, 0, sizeof d);
    d.batch = 8;
    q = avgpipe_tune_query_defaults(&d);
    cr_assert(q.max_pipes == 4 && q.rounds == 1 && q.min_micro == 1 && q.chunks == 1 && q.max_advance == 0 && q.batch == 8);
    cr_assert_eq(q.kinds, want1, "kinds 0x%x, the table's tuned kinds with one chunk 0x%x", q.kinds, want1);
    cr_assert(want1 & (1u << AVGPIPE_SCHED_1F1B));
    d.chunks = 2;
    cr_assert_eq(avgpipe_tune_query_defaults(&d).kinds, want2, "chunks 2: 0x%x", avgpipe_tune_query_defaults(&d).kinds);
    d.kinds = 1u << AVGPIPE_SCHED_ZBV;
    cr_assert_eq(avgpipe_tune_query_defaults(&d).kinds, 1u << AVGPIPE_SCHED_ZBV, "a set field is kept");
    memset(&pd, 0, sizeof pd);
    pd.stages = 3;
    cr_assert(avgpipe_tune_split_query_defaults(&pd).chunks == 1 && avgpipe_tune_split_query_defaults(&pd).stages == 3);
    cr_assert_eq(avgpipe_tune_split_query_defaults(NULL).chunks, 1);
}
