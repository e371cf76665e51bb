/* bench_sched: generate + validate + simulate a large schedule (S=64, M=1024, N=8 by default).
   Prints medians of several repetitions, simulator throughput in ops/s, and a ratio against a
   baseline measured in the same run: one plain read pass over the same op arrays (the floor for
   any algorithm that looks at every op once). Every schedule kind runs (interleaved with two
   chunks; ZB-V and DualPipeV on their V placement); each time is the median of the repetitions,
   and the total's spread (min-max) follows it: the machines are shared and noisy.
   Beside the total, what the tuner also does to each candidate: count the buffer slots of its memory
   model (avgpipe__plan_slots_unlowered, internal), against its baseline, lowering the schedule and
   planning the lowered one (avgpipe_buffer_plan_build), as the memory model did before 0.10.1 (the same
   slots: checked here). bench_sync times avgpipe_sched_add_sync at this scale.
   Usage: bench_sched [S M N [reps]] */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Smallest and largest of v[0..n) (call after median: v is sorted). */
static void spread(const double *v, int n, double *lo, double *hi) {
    *lo = v[0];
    *hi = v[n - 1];
}

/* Baseline: one pass reading every op (checksum so the compiler keeps it). */
static double plain_pass(const avgpipe_schedule *s, long long *sum) {
    double t0 = now();
    int r, i;
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++) *sum += s->ops[r][i].micro + s->ops[r][i].kind;
    return now() - t0;
}

#define REPS_MAX 32

/* The tuner's memory model on schedule s: *tm its slot count, *tl its baseline (lower + plan), whose
   slots must be the same. */
static int memory_model(const avgpipe_schedule *s, double *tm, double *tl) {
    avgpipe_schedule low;
    avgpipe_buffer_plan plan;
    size_t *act = (size_t *)calloc((size_t)s->nstages, sizeof *act);
    int *slots = (int *)calloc((size_t)s->nstages, sizeof *slots), g, bad = 0;
    double t0, t1, t2;
    if (!act || !slots) return 1;
    for (g = 0; g < s->nstages; g++) act[g] = 4096;
    t0 = now();
    if (avgpipe__plan_slots_unlowered(NULL, s, NULL, NULL, slots)) {
        fprintf(stderr, "slots: %s\n", avgpipe_last_error(NULL));
        return 1;
    }
    t1 = now();
    if (avgpipe_sched_lower(NULL, s, &low) || avgpipe_buffer_plan_build(NULL, &low, act, &plan)) {
        fprintf(stderr, "lower + plan: %s\n", avgpipe_last_error(NULL));
        return 1;
    }
    t2 = now();
    for (g = 0; g < s->nstages; g++) bad |= plan.slots[g] != slots[g];
    avgpipe_buffer_plan_free(NULL, &plan);
    avgpipe_sched_free(NULL, &low);
    free(act);
    free(slots);
    if (bad) {
        fprintf(stderr, "bench_sched: the memory model's slots differ from the lowered plan's\n");
        return 1;
    }
    *tm = t1 - t0, *tl = t2 - t1;
    return 0;
}

int main(int argc, char **argv) {
    int S = argc > 3 ? atoi(argv[1]) : 64, M = argc > 3 ? atoi(argv[2]) : 1024, N = argc > 3 ? atoi(argv[3]) : 8;
    int reps = argc > 4 ? atoi(argv[4]) : 5, k;
    static const avgpipe_sched_kind kinds[] = {AVGPIPE_SCHED_AFAB,        AVGPIPE_SCHED_1F1B, AVGPIPE_SCHED_ADVANCE,
                                               AVGPIPE_SCHED_INTERLEAVED, AVGPIPE_SCHED_ZBH1, AVGPIPE_SCHED_ZBV,
                                               AVGPIPE_SCHED_DUALPIPEV};
    long long sum = 0;
    if (S < 1 || M < 1 || N < 1 || reps < 1 || reps > REPS_MAX) {
        fprintf(stderr, "usage: bench_sched [S M N [reps 1..%d]]\n", REPS_MAX);
        return 2;
    }
    printf("bench_sched: S=%d M=%d N=%d, median of %d runs (ms)\n", S, M, N, reps);
    printf("%-11s %10s %7s %9s %9s %7s %13s %7s %11s %8s %8s %7s %9s %8s\n", "schedule", "ops", "gen", "validate", "simulate", "total",
           "total min-max", "pass", "sim ops/s", "val/pass", "sim/pass", "slots", "low+plan", "speedup");
    for (k = 0; k < (int)(sizeof kinds / sizeof kinds[0]); k++) {
        double tg[REPS_MAX], tv[REPS_MAX], ts[REPS_MAX], tt[REPS_MAX], tp[REPS_MAX], tm[REPS_MAX], tl[REPS_MAX];
        long long ops = 0;
        int rep, r;
        for (rep = 0; rep < reps; rep++) {
            avgpipe_sched_desc d = {0};
            avgpipe_schedule s;
            avgpipe_sim_result res;
            avgpipe_validate_report rp;
            double t0, t1, t2, t3;
            d.kind = kinds[k];
            d.stages = S;
            d.micro = M;
            d.pipes = N;
            d.advance = d.kind == AVGPIPE_SCHED_ADVANCE ? S - 1 : 0;
            d.chunks = d.kind == AVGPIPE_SCHED_INTERLEAVED ? 2 : 0;
            t0 = now();
            if (avgpipe_sched_generate(NULL, &d, &s)) {
                fprintf(stderr, "generate: %s\n", avgpipe_last_error(NULL));
                return 1;
            }
            t1 = now();
            if (avgpipe_sched_validate(NULL, &s, NULL, &rp)) {
                fprintf(stderr, "validate: %s\n", rp.message);
                return 1;
            }
            t2 = now();
            if (avgpipe_sim_run(NULL, &s, NULL, &res)) {
                fprintf(stderr, "simulate: %s\n", avgpipe_last_error(NULL));
                return 1;
            }
            t3 = now();
            tg[rep] = t1 - t0;
            tv[rep] = t2 - t1;
            ts[rep] = t3 - t2;
            tt[rep] = t3 - t0;
            tp[rep] = plain_pass(&s, &sum);
            if (memory_model(&s, &tm[rep], &tl[rep])) return 1;
            ops = 0;
            for (r = 0; r < s.nranks; r++) ops += s.len[r];
            avgpipe_sim_result_free(NULL, &res);
            avgpipe_sched_free(NULL, &s);
        }
        {
            double g = median(tg, reps), v = median(tv, reps), sm = median(ts, reps), t = median(tt, reps), p = median(tp, reps), lo, hi;
            double mm = median(tm, reps), ml = median(tl, reps);
            char range[32];
            spread(tt, reps, &lo, &hi);
            snprintf(range, sizeof range, "%.1f-%.1f", lo * 1e3, hi * 1e3);
            printf("%-11s %10lld %7.1f %9.1f %9.1f %7.1f %13s %7.2f %11.3g %7.0fx %7.0fx %7.1f %9.1f %7.1fx\n",
                   avgpipe_sched_kind_name(kinds[k]), ops, g * 1e3, v * 1e3, sm * 1e3, t * 1e3, range, p * 1e3, ops / sm, v / p, sm / p,
                   mm * 1e3, ml * 1e3, ml / mm);
        }
    }
    printf("(validate = static checks + a blocking-send deadlock replay, sends and receives placed as lowering places them; "
           "slots = the memory model's count, low+plan = lower + buffer plan, its baseline; checksum %lld)\n", sum % 10);
    return 0;
}
