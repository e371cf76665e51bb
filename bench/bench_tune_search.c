/* bench_tune_search — how long the tuner takes to choose, as the ranks grow.

   Two measurements on a synthetic layered model (no profile, no BLAS: the costs are made up, the work the
   tuner does is not):
     1. avgpipe_tune_search over every candidate of S ranks (all tuned kinds, N <= 4, every M dividing the
        batch, every K of advance forward that changes a warm-up), on one thread and on every processor
        online (avgpipe_tune_desc.threads), the two interleaved repetition by repetition; the candidates
        are compared byte for byte (the result must not depend on the threads).
     2. avgpipe_tune_choose_split (the stage partitioner) against its baseline: the same splits, in the
        same order, each searched alone with avgpipe_tune_search on one thread, as the partitioner did
        before 0.10.0 (it now plans each candidate schedule's buffers once for all splits). Both must
        choose the same split and setting.
   Each time is the median of the repetitions with its spread (min-max): the machines are shared and noisy.
   The ratios are against the baseline measured in the same run.

   Usage: bench_tune_search [S B [reps [S2 L2 B2]]]   defaults: S = 16, B = 64, 3 reps; partitioner S2 = 4
   ranks, L2 = 12 layers, B2 = 32 */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define REPS_MAX 16

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0..n) (sorts v) and its min-max as "lo-hi". */
static double median(double *v, int n, char *range, size_t cap) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    snprintf(range, cap, "%.2f-%.2f", v[0], v[n - 1]);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void die(const char *what, avgpipe_context *ctx) {
    fprintf(stderr, "bench_tune_search: %s: %s\n", what, avgpipe_last_error(ctx));
    exit(1);
}

/* A model of L layers (a few heavy ones among light ones) on S partitions, layer l on partition l*S/L. */
static void layered(int S, int L, avgpipe_cost_model *m) {
    int K = AVGPIPE_OP_KIND_COUNT, l, g;
    memset(m, 0, sizeof *m);
    m->nstages = S;
    m->a = (double *)calloc((size_t)S * K, sizeof(double));
    m->b = (double *)calloc((size_t)S * K, sizeof(double));
    m->param_floats = (double *)calloc((size_t)S, sizeof(double));
    m->act_bytes_per_sample = (double *)calloc((size_t)S, sizeof(double));
    m->layers = (avgpipe_layer_cost *)calloc((size_t)L, sizeof *m->layers);
    if (!m->a || !m->b || !m->param_floats || !m->act_bytes_per_sample || !m->layers) exit(1);
    m->nlayers = L;
    for (l = 0; l < L; l++) {
        avgpipe_layer_cost *c = &m->layers[l];
        double w = l % 4 == 1 ? 8 : 1;
        c->stage = l * S / L;
        c->f_a = 1e-5 * (1 + (l * 7) % 5), c->f_b = w * 1e-6 * (1 + (l * 3) % 4);
        c->b_a = 2 * c->f_a, c->b_b = 2 * c->f_b;
        c->param_floats = w * 1e5, c->act_bytes = 1024.0 * (1 + (l * 5) % 7);
    }
    for (l = 0; l < L; l++) { /* the partitions' own costs: their layers' sums */
        const avgpipe_layer_cost *c = &m->layers[l];
        g = c->stage;
        m->a[g * K + AVGPIPE_OP_F] += c->f_a, m->b[g * K + AVGPIPE_OP_F] += c->f_b;
        m->a[g * K + AVGPIPE_OP_B] += c->b_a, m->b[g * K + AVGPIPE_OP_B] += c->b_b;
        m->a[g * K + AVGPIPE_OP_I] += c->b_a / 2, m->b[g * K + AVGPIPE_OP_I] += c->b_b / 2;
        m->a[g * K + AVGPIPE_OP_W] += c->b_a / 2, m->b[g * K + AVGPIPE_OP_W] += c->b_b / 2;
        m->param_floats[g] += c->param_floats;
        if (l + 1 == L || m->layers[l + 1].stage != g) m->act_bytes_per_sample[g] = c->act_bytes;
    }
    m->latency = 1e-5, m->samples_lo = 1, m->samples_hi = 64, m->avg_per_float = 1e-10, m->op_overhead = 2e-6;
}

static void model_free(avgpipe_cost_model *m) {
    free(m->a), free(m->b), free(m->param_floats), free(m->act_bytes_per_sample), free(m->layers);
}

/* The partitioner's loop as it was before 0.10.0: splits in order of their bound, each searched alone
   (avgpipe_tune_search, one thread), until the bound passes the best found. *searched: splits searched. */
static int baseline_split(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *desc, const avgpipe_tune_split_desc *pd,
                          int *split_out, avgpipe_tune_candidate *best_out, long long *searched) {
    avgpipe_tune_desc td = avgpipe_tune_query_defaults(desc);
    avgpipe__plan_item *items;
    int *splits, P, found, any;
    long long count, k, best = -1;
    unsigned kinds;
    avgpipe_tune_candidate c, b;
    if (avgpipe__split_check(ctx, m, desc, pd, &P, &count)) return -1;
    td.threads = 1;
    td.kinds = desc->kinds;
    splits = (int *)malloc((size_t)count * (size_t)P * sizeof *splits);
    items = (avgpipe__plan_item *)malloc((size_t)count * sizeof *items);
    if (!splits || !items || avgpipe__tune_kinds(ctx, &td, 1, &kinds) ||
        avgpipe__split_enumerate(ctx, m, pd->stages, P, (double)desc->batch, td.max_pipes, kinds, splits, items, count))
        return -1;
    qsort(items, (size_t)count, sizeof *items, avgpipe__cmp_split_item);
    *searched = 0;
    for (k = 0; k < count; k++) {
        double lo = items[k].bound * (td.objective != AVGPIPE_TUNE_THROUGHPUT ? avgpipe_tune_efficiency(td.noise_scale, td.batch) * td.target_samples : 1);
        if (best >= 0 && lo > avgpipe__tune_key(&td, &b)) break;
        if (avgpipe__split_search(ctx, m, splits + items[k].index * P, &td, pd, NULL, &c, &found, &any)) return -1;
        ++*searched;
        if (found && (best < 0 || avgpipe__tune_key(&td, &c) < avgpipe__tune_key(&td, &b) ||
                      (avgpipe__tune_key(&td, &c) == avgpipe__tune_key(&td, &b) && items[k].index < best)))
            b = c, best = items[k].index;
    }
    if (best >= 0) memcpy(split_out, splits + best * P, (size_t)P * sizeof *split_out), *best_out = b;
    free(splits);
    free(items);
    return best >= 0 ? 0 : -1;
}

int main(int argc, char **argv) {
    int S = argc > 2 ? atoi(argv[1]) : 16, B = argc > 2 ? atoi(argv[2]) : 64, reps = argc > 3 ? atoi(argv[3]) : 3;
    int S2 = argc > 6 ? atoi(argv[4]) : 4, L2 = argc > 6 ? atoi(argv[5]) : 12, B2 = argc > 6 ? atoi(argv[6]) : 32;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int T = cores < 1 ? 1 : cores > AVGPIPE_TUNE_MAX_THREADS ? AVGPIPE_TUNE_MAX_THREADS : (int)cores, rep, n1 = 0, nT = 0, i;
    double t1[REPS_MAX], tT[REPS_MAX], p1[REPS_MAX], pT[REPS_MAX], pb[REPS_MAX], m1, mT;
    char r1[32], rT[32], rb[32];
    avgpipe_context ctx;
    avgpipe_cost_model m, m2;
    avgpipe_tune_desc td;
    avgpipe_tune_split_desc pd;
    long long searched = 0;
    if (S < 1 || B < 1 || reps < 1 || reps > REPS_MAX || S2 < 1 || L2 < S2 || B2 < 1) {
        fprintf(stderr, "usage: bench_tune_search [S B [reps 1..%d [S2 L2 B2]]]\n", REPS_MAX);
        return 2;
    }
    avgpipe_context_init(&ctx, NULL);
    layered(S, 2 * S, &m);
    memset(&td, 0, sizeof td);
    td.batch = B, td.max_pipes = 4, td.opt_bytes_per_param = 8, td.noise_scale = 4.0 * B;
    printf("bench_tune_search: %ld processors online; median of %d runs (s), min-max\n", cores, reps);
    for (rep = 0; rep < reps; rep++) { /* interleaved: one thread, then all */
        avgpipe_tune_candidate *c1, *cT;
        double t0 = now();
        td.threads = 1;
        if (avgpipe_tune_search(&ctx, &m, &td, &c1, &n1)) die("search", &ctx);
        t1[rep] = now() - t0;
        t0 = now();
        td.threads = T;
        if (avgpipe_tune_search(&ctx, &m, &td, &cT, &nT)) die("search", &ctx);
        tT[rep] = now() - t0;
        if (n1 != nT || memcmp(c1, cT, (size_t)n1 * sizeof *c1)) {
            fprintf(stderr, "bench_tune_search: %d threads found other candidates than one thread\n", T);
            return 1;
        }
        if (rep == 0)
            printf("search: S=%d, batch %d, N <= 4: %d candidates; best %s M=%d N=%d K=%d\n", S, B, n1, avgpipe_sched_kind_name(c1[0].sched.kind),
                   c1[0].sched.micro, c1[0].sched.pipes, c1[0].sched.advance);
        avgpipe_free(&ctx, c1);
        avgpipe_free(&ctx, cT);
    }
    m1 = median(t1, reps, r1, sizeof r1), mT = median(tT, reps, rT, sizeof rT);
    printf("  %3d thread   %8.2f s (%s)  %7.0f candidates/s\n", 1, m1, r1, n1 / m1);
    printf("  %3d thread%s  %8.2f s (%s)  %7.0f candidates/s  %.2fx the one thread (candidates identical)\n", T, T == 1 ? " " : "s", mT, rT,
           nT / mT, m1 / mT);
    model_free(&m);

    layered(S2, L2, &m2);
    memset(&td, 0, sizeof td);
    td.batch = B2, td.max_pipes = 4, td.opt_bytes_per_param = 8, td.noise_scale = 2.0 * B2;
    memset(&pd, 0, sizeof pd);
    pd.stages = S2;
    for (rep = 0; rep < reps; rep++) { /* interleaved: baseline, one thread, all */
        avgpipe_tune_split_choice ch;
        avgpipe_tune_candidate best;
        int split[AVGPIPE__MAX_STAGES], t;
        double t0 = now();
        if (baseline_split(&ctx, &m2, &td, &pd, split, &best, &searched)) die("baseline partitioner", &ctx);
        pb[rep] = now() - t0;
        for (t = 0; t < 2; t++) {
            td.threads = t ? T : 1;
            t0 = now();
            if (avgpipe_tune_choose_split(&ctx, &m2, &td, &pd, &ch)) die("choose_split", &ctx);
            (t ? pT : p1)[rep] = now() - t0;
            if (memcmp(&ch.best, &best, sizeof best) || memcmp(ch.split, split, (size_t)ch.nparts * sizeof *split) || ch.searched != searched) {
                fprintf(stderr, "bench_tune_search: choose_split (%d threads) chose otherwise than the baseline\n", td.threads);
                return 1;
            }
            if (rep == 0 && t == 0) {
                printf("partitioner: S=%d, %d layers, batch %d: %lld splits, %lld searched; split", S2, L2, B2, ch.splits, ch.searched);
                for (i = 0; i < ch.nparts; i++) printf("%s%d", i ? "," : " ", ch.split[i]);
                printf(", %s M=%d N=%d K=%d\n", avgpipe_sched_kind_name(ch.best.sched.kind), ch.best.sched.micro, ch.best.sched.pipes,
                       ch.best.sched.advance);
            }
            avgpipe_tune_split_choice_free(&ctx, &ch);
        }
    }
    {
        double b = median(pb, reps, rb, sizeof rb), a1 = median(p1, reps, r1, sizeof r1), aT = median(pT, reps, rT, sizeof rT);
        printf("  baseline (each split searched alone, 1 thread) %8.2f s (%s)\n", b, rb);
        printf("  choose_split, %3d thread                       %8.2f s (%s)  %.2fx faster\n", 1, a1, r1, b / a1);
        printf("  choose_split, %3d thread%s                      %8.2f s (%s)  %.2fx faster (same choice)\n", T, T == 1 ? " " : "s", aT, rT,
               b / aT);
    }
    model_free(&m2);
    return 0;
}
