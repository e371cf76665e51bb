/* The tuner's search on several threads (avgpipe_tune_desc.threads): the same candidates, byte for byte,
   and the same errors as one thread, for avgpipe_tune_search and the stage partitioner; and the slot
   counts the partitioner's searches share. A suite of its
   own, using only the macros tests/tsan/criterion/criterion.h provides, so that it also runs under
   ThreadSanitizer (scripts/test.sh): the threads share the candidate list, a mutex-guarded counter and
   the partitioner's slot counts. */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A model of L layers on P partitions (layer l on partition l*P/L, a few heavy layers among light
   ones), with per-layer costs for the partitioner. Free with avgpipe_tune_cost_model_free. */
static void layered(avgpipe_context *ctx, int P, int L, avgpipe_cost_model *m) {
    int K = AVGPIPE_OP_KIND_COUNT, l, g;
    memset(m, 0, sizeof *m);
    m->nstages = P;
    m->a = (double *)avgpipe__calloc(ctx, (size_t)P * K, sizeof(double));
    m->b = (double *)avgpipe__calloc(ctx, (size_t)P * K, sizeof(double));
    m->param_floats = (double *)avgpipe__calloc(ctx, (size_t)P, sizeof(double));
    m->act_bytes_per_sample = (double *)avgpipe__calloc(ctx, (size_t)P, sizeof(double));
    m->layers = (avgpipe_layer_cost *)avgpipe__calloc(ctx, (size_t)L, sizeof *m->layers);
    cr_assert(m->a && m->b && m->param_floats && m->act_bytes_per_sample && m->layers, "out of memory");
    m->nlayers = L;
    for (l = 0; l < L; l++) {
        avgpipe_layer_cost *c = &m->layers[l];
        double w = l % 3 == 1 ? 6 : 1;
        c->stage = g = l * P / L;
        c->f_a = 1e-5 * (1 + (l * 7) % 5), c->f_b = w * 1e-6 * (1 + (l * 3) % 4);
        c->b_a = 2 * c->f_a, c->b_b = 2 * c->f_b;
        c->param_floats = w * 2e4, c->act_bytes = 256.0 * (1 + (l * 5) % 7);
        m->a[g * K + AVGPIPE_OP_F] += c->f_a, m->b[g * K + AVGPIPE_OP_F] += c->f_b;
        m->a[g * K + AVGPIPE_OP_B] += c->b_a, m->b[g * K + AVGPIPE_OP_B] += c->b_b;
        m->a[g * K + AVGPIPE_OP_I] += c->b_a / 2, m->b[g * K + AVGPIPE_OP_I] += c->b_b / 2;
        m->a[g * K + AVGPIPE_OP_W] += c->b_a / 2, m->b[g * K + AVGPIPE_OP_W] += c->b_b / 2;
        m->param_floats[g] += c->param_floats;
        m->act_bytes_per_sample[g] = c->act_bytes; /* the partition's last layer's output */
    }
    m->latency = 3e-6, m->samples_lo = 1, m->samples_hi = 16, m->avg_per_float = 1e-9, m->op_overhead = 2e-6;
    m->step_a = 5e-6, m->step_b = 1e-9;
}

/* Two searches are equal candidate for candidate, byte for byte (each candidate is written from a
   zeroed one, so the padding is equal too). */
static void same_search(const avgpipe_tune_candidate *a, int na, const avgpipe_tune_candidate *b, int nb, const char *what) {
    int i;
    cr_assert_eq(na, nb, "%s: %d candidates, %d", what, na, nb);
    for (i = 0; i < na; i++)
        cr_assert(!memcmp(&a[i], &b[i], sizeof a[i]), "%s: candidate %d differs: %s M %d N %d K %d, %.17g s %.17g bytes against %s M %d N %d K %d, %.17g s %.17g bytes",
                  what, i, avgpipe_sched_kind_name(a[i].sched.kind), a[i].sched.micro, a[i].sched.pipes, a[i].sched.advance, a[i].seconds,
                  a[i].peak_bytes, avgpipe_sched_kind_name(b[i].sched.kind), b[i].sched.micro, b[i].sched.pipes, b[i].sched.advance,
                  b[i].seconds, b[i].peak_bytes);
}

/* 1, 2, 3 and 5 threads: the same candidates in the same order, with a tie, the agreement and a memory
   limit some settings exceed, on a loop-placed model (3 ranks) and a V-placed one (4 partitions on 2
   ranks: interleaved, ZB-V, DualPipeV). */
Test(tune_threads, search_is_the_same_on_any_threads) {
    static const int threads[] = {2, 3, 5};
    avgpipe_context ctx;
    avgpipe_cost_model m;
    avgpipe_tune_desc td;
    avgpipe_tune_candidate *c1 = NULL, *c = NULL;
    avgpipe_tie tie = {0, 2, 0, 0, 300};
    int n1 = 0, n = 0, t, v;
    avgpipe_context_init(&ctx, NULL);
    for (v = 1; v <= 2; v++) {
        layered(&ctx, v == 1 ? 3 : 4, 7, &m);
        memset(&td, 0, sizeof td);
        td.batch = 12, td.max_pipes = 3, td.opt_bytes_per_param = 8, td.noise_scale = 40, td.chunks = v;
        td.ties = &tie, td.nties = 1, td.agree = 1;
        if (v == 2) td.kinds = (1u << AVGPIPE_SCHED_INTERLEAVED) | (1u << AVGPIPE_SCHED_ZBV) | (1u << AVGPIPE_SCHED_DUALPIPEV);
        cr_assert_eq(avgpipe_tune_search(&ctx, &m, &td, &c1, &n1), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        cr_assert(n1 > 3 * 8, "V %d: %d candidates: too few to share among 3 threads", v, n1);
        td.mem_limit = 0.5 * (c1[0].peak_bytes + c1[n1 - 1].peak_bytes); /* some fit, some do not */
        avgpipe_free(&ctx, c1);
        cr_assert_eq(avgpipe_tune_search(&ctx, &m, &td, &c1, &n1), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        cr_assert(c1[0].fits && !c1[n1 - 1].fits, "V %d: the limit should split the candidates", v);
        for (t = 0; t < 3; t++) {
            char what[64];
            td.threads = threads[t];
            snprintf(what, sizeof what, "V %d, %d threads", v, threads[t]);
            cr_assert_eq(avgpipe_tune_search(&ctx, &m, &td, &c, &n), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
            same_search(c1, n1, c, n, what);
            avgpipe_free(&ctx, c);
            c = NULL;
        }
        avgpipe_free(&ctx, c1);
        c1 = NULL;
        avgpipe_tune_cost_model_free(&ctx, &m);
    }
}

/* A failing search reports the same error on any threads, and hands out nothing; a thread count out of
   range is refused naming the field. */
Test(tune_threads, the_first_error_whatever_the_threads) {
    avgpipe_context ctx;
    avgpipe_cost_model m;
    avgpipe_tune_desc td;
    avgpipe_tune_candidate *c = NULL;
    avgpipe_tie tie = {0, 1, 0, 0, 1u << 30}; /* more floats than a partition holds: every candidate fails */
    char err1[AVGPIPE_ERROR_MAX];
    int n = 0;
    avgpipe_context_init(&ctx, NULL);
    layered(&ctx, 2, 4, &m);
    memset(&td, 0, sizeof td);
    td.batch = 16, td.max_pipes = 2, td.ties = &tie, td.nties = 1, td.threads = 1;
    cr_assert_eq(avgpipe_tune_search(&ctx, &m, &td, &c, &n), AVGPIPE_INVALID_ARG);
    snprintf(err1, sizeof err1, "%s", avgpipe_last_error(&ctx));
    cr_assert(strstr(err1, "ties[0]") != NULL, "%s", err1);
    td.threads = 4;
    avgpipe_clear_error(&ctx);
    cr_assert_eq(avgpipe_tune_search(&ctx, &m, &td, &c, &n), AVGPIPE_INVALID_ARG);
    cr_assert(!strcmp(avgpipe_last_error(&ctx), err1), "4 threads: '%s', one thread: '%s'", avgpipe_last_error(&ctx), err1);
    cr_assert(c == NULL && n == 0, "a failed search handed out %d candidates", n);
    td.nties = 0;
    td.threads = -1;
    cr_assert_eq(avgpipe_tune_search(&ctx, &m, &td, &c, &n), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(&ctx), "threads: -1") != NULL, "%s", avgpipe_last_error(&ctx));
    td.threads = AVGPIPE_TUNE_MAX_THREADS + 1;
    cr_assert_eq(avgpipe_tune_search(&ctx, &m, &td, &c, &n), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(&ctx), "threads") != NULL, "%s", avgpipe_last_error(&ctx));
    avgpipe_tune_cost_model_free(&ctx, &m);
}

/* The partitioner on 1 and 3 threads (its searches share the slot counts the first one planned):
   the same split, the same best candidate to the byte, the same count of splits searched; under a
   memory limit that makes some splits' best settings not fit too. */
Test(tune_threads, partitioner_is_the_same_on_any_threads) {
    avgpipe_context ctx;
    avgpipe_cost_model m;
    avgpipe_tune_desc td;
    avgpipe_tune_split_desc pd;
    avgpipe_tune_split_choice one, three;
    int lim;
    avgpipe_context_init(&ctx, NULL);
    layered(&ctx, 3, 7, &m);
    memset(&pd, 0, sizeof pd);
    pd.stages = 3;
    memset(&td, 0, sizeof td);
    td.batch = 8, td.max_pipes = 2, td.opt_bytes_per_param = 8, td.noise_scale = 16, td.agree = 1;
    for (lim = 0; lim < 2; lim++) {
        td.threads = 1;
        cr_assert_eq(avgpipe_tune_choose_split(&ctx, &m, &td, &pd, &one), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        td.threads = 3;
        cr_assert_eq(avgpipe_tune_choose_split(&ctx, &m, &td, &pd, &three), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        cr_assert(one.searched > 1, "the partitioner searched %lld split(s): the shared slot counts were not used", one.searched);
        cr_assert(one.found == three.found && one.searched == three.searched && one.nparts == three.nparts, "limit %d: found %d/%d, searched %lld/%lld",
                  lim, one.found, three.found, one.searched, three.searched);
        cr_assert(!memcmp(one.split, three.split, (size_t)one.nparts * sizeof *one.split), "limit %d: the splits differ", lim);
        cr_assert(!memcmp(&one.best, &three.best, sizeof one.best), "limit %d: the best candidates differ", lim);
        if (!lim) td.mem_limit = one.best.peak_bytes * 0.9;
        avgpipe_tune_split_choice_free(&ctx, &one);
        avgpipe_tune_split_choice_free(&ctx, &three);
    }
    avgpipe_tune_cost_model_free(&ctx, &m);
}

/* The partitioner plans each candidate's buffers once: a search of another split reuses the slot counts
   the first search found (the schedules are the same; only the bytes per slot follow the split). A
   search of split B after one of split A, through that cache, equals a search of B alone, candidate
   for candidate, with a tie and the agreement, on 1 and 2 threads; a cache of other candidates (another
   batch) is not used but refilled. */
Test(tune_threads, slot_counts_planned_once_equal_a_fresh_search) {
    avgpipe_context ctx;
    avgpipe_cost_model m, ma, mb;
    avgpipe_tune_desc td;
    avgpipe_tune_candidate *ref = NULL, *c = NULL;
    avgpipe__slot_cache cache;
    avgpipe_tie tie = {0, 2, 0, 0, 100};
    int sa[3] = {1, 1, 6}, sb[3] = {3, 2, 3}, nref = 0, n = 0, t, i, differ;
    avgpipe_context_init(&ctx, NULL);
    memset(&cache, 0, sizeof cache);
    layered(&ctx, 3, 8, &m);
    cr_assert_eq(avgpipe_tune_split_model(&ctx, &m, sa, 3, &ma), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_tune_split_model(&ctx, &m, sb, 3, &mb), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    memset(&td, 0, sizeof td);
    td.batch = 8, td.max_pipes = 2, td.opt_bytes_per_param = 8, td.ties = &tie, td.nties = 1, td.agree = 1;
    cr_assert_eq(avgpipe_tune_search(&ctx, &mb, &td, &ref, &nref), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (t = 1; t <= 2; t++) {
        td.threads = t;
        cr_assert_eq(avgpipe__tune_search_in(&ctx, &ma, &td, &cache, &c, &n), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        cr_assert_eq(cache.n, n, "the first search fills the cache");
        for (i = 0, differ = 0; i < nref && !differ; i++) differ = ref[i].peak_bytes != c[i].peak_bytes;
        cr_assert(differ, "splits A and B should need different memory");
        avgpipe_free(&ctx, c);
        for (i = 0; i < cache.n * cache.G; i++) cr_assert(cache.slots[i] >= 1, "slot count %d at %d", cache.slots[i], i);
        cr_assert_eq(avgpipe__tune_search_in(&ctx, &mb, &td, &cache, &c, &n), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        same_search(ref, nref, c, n, t == 1 ? "split B after A, 1 thread" : "split B after A, 2 threads");
        avgpipe_free(&ctx, c);
        c = NULL;
    }
    td.batch = 6; /* other candidates: the cache is refilled, not read */
    avgpipe_free(&ctx, ref);
    cr_assert_eq(avgpipe_tune_search(&ctx, &mb, &td, &ref, &nref), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe__tune_search_in(&ctx, &mb, &td, &cache, &c, &n), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    same_search(ref, nref, c, n, "another batch through a stale cache");
    cr_assert_eq(cache.n, n);
    avgpipe_free(&ctx, c);
    avgpipe_free(&ctx, ref);
    avgpipe__slot_cache_free(&ctx, &cache);
    avgpipe_tune_cost_model_free(&ctx, &m);
    avgpipe_tune_cost_model_free(&ctx, &ma);
    avgpipe_tune_cost_model_free(&ctx, &mb);
}
