/* bench_sync_run: what ties and step agreement cost the runtime, measured. A synthetic model of G = S
   stage partitions on S stage threads (the in-process comm), N pipelines, M micro-batches: each F
   and B op is a fixed amount of arithmetic (F_US microseconds' worth, B twice that, calibrated on this
   machine), each partition holds P floats of parameters and gradients. Four variants, interleaved
   round-robin (these machines are noisy) over REPS repetitions of ITERS iterations each: plain (the
   baseline, measured in the same run), GPT-2's tie (partition 0's first T floats with the last
   partition's: T floats cross ranks each way per pipeline and round), the agreement with global-norm
   clipping (each partition's sum of squares over its P gradients, summed over the pipeline), both.
   Prints each variant's median iteration time, its spread (min-max of the repetitions' medians) and
   its ratio to plain's; then the simulator's prediction of the same ratios for the schedule with the
   measured op times and no transfer cost (the data dependency alone).
   Usage: bench_sync_run [S M N [P T [F_US]]]   (defaults 4 8 2, 262144 65536, 200) */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define REPS 5
#define ITERS 6
#define MAXG 16

static double now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static long spin_per_us = 1;
static volatile double sink;
static void spin(long n) { /* n iterations of a dependent multiply-add chain */
    double x = 1.0;
    long i;
    for (i = 0; i < n; i++) x = x * 0.999999 + 1e-7;
    sink = x;
}

static int S, M, N, G;
static size_t P, TIE;
static double f_us;
static float *params[MAXG * 8], *grads[MAXG * 8];

static int cb_forward(avgpipe_op_ctx *op) {
    spin((long)(f_us * spin_per_us));
    (void)op;
    return 0;
}
static int cb_backward(avgpipe_op_ctx *op) {
    float *g = grads[op->pipe * G + op->stage];
    spin((long)(2 * f_us * spin_per_us));
    g[op->micro % P] += 1e-3f; /* a gradient that changes, cheaply */
    return 0;
}
static int cb_step(const avgpipe_step_ctx *st) {
    size_t j;
    float s = (float)st->scale;
    for (j = 0; j < st->count; j++) st->params[j] -= 1e-3f * s * st->grads[j], st->grads[j] = 0;
    return 0;
}

/* Median iteration time of ITERS iterations of variant v (0 plain, 1 tie, 2 agreement, 3 both); -1 on
   an error (printed). */
static double measure(int v) {
    avgpipe_run_desc d;
    avgpipe_run *run = NULL;
    size_t act[MAXG], pc[MAXG];
    avgpipe_tie tie = {0, 0, 0, 0, 0};
    double t[ITERS], tmp;
    int g, i, j;
    memset(&d, 0, sizeof d);
    for (g = 0; g < G; g++) act[g] = 4096, pc[g] = P;
    tie.stage_b = G - 1, tie.count = TIE;
    d.sched.kind = AVGPIPE_SCHED_1F1B, d.sched.stages = S, d.sched.micro = M, d.sched.pipes = N;
    d.cb.forward = cb_forward, d.cb.backward = cb_backward, d.cb.step_agreed = cb_step;
    d.act_bytes = act, d.param_count = pc, d.params = params, d.grads = grads;
    if (v & 1) d.ties = &tie, d.nties = 1;
    if (v & 2) d.agree.clip_norm = 1.0;
    if (avgpipe_run_create(NULL, &d, &run) != AVGPIPE_OK) {
        fprintf(stderr, "bench_sync_run: %s\n", avgpipe_last_error(NULL));
        return -1;
    }
    for (i = 0; i < ITERS + 1; i++) { /* the first iteration warms up */
        double a = now();
        if (avgpipe_run_iteration(run, NULL) != AVGPIPE_OK) {
            fprintf(stderr, "bench_sync_run: %s\n", avgpipe_last_error(NULL));
            avgpipe_run_destroy(run);
            return -1;
        }
        if (i) t[i - 1] = now() - a;
    }
    avgpipe_run_destroy(run);
    for (i = 0; i < ITERS; i++)
        for (j = i + 1; j < ITERS; j++)
            if (t[j] < t[i]) tmp = t[i], t[i] = t[j], t[j] = tmp;
    return 0.5 * (t[(ITERS - 1) / 2] + t[ITERS / 2]);
}

static double sim_makespan(int v, double f) {
    avgpipe_sched_desc d = {0};
    avgpipe_schedule s, t;
    avgpipe_sim_desc sd = {0};
    avgpipe_sim_result r;
    avgpipe_tie tie = {0, 0, 0, 0, 1};
    avgpipe_sync_desc sy = {0};
    double m = -1;
    tie.stage_b = G - 1;
    d.kind = AVGPIPE_SCHED_1F1B, d.stages = S, d.micro = M, d.pipes = N;
    if (avgpipe_sched_generate(NULL, &d, &s)) return -1;
    sy.ties = (v & 1) ? &tie : NULL, sy.nties = v & 1, sy.agree = (v & 2) != 0;
    sy.cost_f = f, sy.cost_b = 2 * f;
    sd.cost[AVGPIPE_OP_F] = f, sd.cost[AVGPIPE_OP_B] = 2 * f;
    if (!avgpipe_sched_add_sync(NULL, &s, &sy, &t)) {
        if (!avgpipe_sim_run(NULL, &t, &sd, &r)) m = r.makespan;
        avgpipe_sim_result_free(NULL, &r);
        avgpipe_sched_free(NULL, &t);
    }
    avgpipe_sched_free(NULL, &s);
    return m;
}

int main(int argc, char **argv) {
    static const char *name[4] = {"plain", "tie", "agree (clip)", "tie + agree"};
    double med[4][REPS], m[4], lo[4], hi[4], tmp, sim0;
    int v, k, i, j;
    S = argc > 3 ? atoi(argv[1]) : 4, M = argc > 3 ? atoi(argv[2]) : 8, N = argc > 3 ? atoi(argv[3]) : 2;
    P = argc > 5 ? (size_t)atol(argv[4]) : 262144, TIE = argc > 5 ? (size_t)atol(argv[5]) : 65536;
    f_us = argc > 6 ? atof(argv[6]) : 200;
    G = S;
    if (S < 2 || S > MAXG || M < 1 || N < 1 || N > 8 || P < 1 || TIE < 1 || TIE > P || f_us <= 0) {
        fprintf(stderr, "usage: bench_sync_run [S M N [P T [F_US]]] (2 <= S <= %d, 1 <= N <= 8, 1 <= T <= P, F_US > 0)\n", MAXG);
        return 2;
    }
    { /* calibrate the spin loop */
        double a = now();
        spin(20000000);
        spin_per_us = (long)(20000000 / ((now() - a) * 1e6));
        if (spin_per_us < 1) spin_per_us = 1;
    }
    for (i = 0; i < N * G; i++) {
        params[i] = (float *)calloc(P, sizeof(float));
        grads[i] = (float *)calloc(P, sizeof(float));
        if (!params[i] || !grads[i]) return fprintf(stderr, "bench_sync_run: out of memory\n"), 1;
    }
    printf("bench_sync_run: 1F1B S=%d M=%d N=%d, F %.0f us, B %.0f us, %zu floats per partition, tie of %zu floats (%.0f KiB each way), "
           "%d repetitions x %d iterations, interleaved\n", S, M, N, f_us, 2 * f_us, P, TIE, TIE * 4 / 1024.0, REPS, ITERS);
    for (k = 0; k < REPS; k++)
        for (v = 0; v < 4; v++)
            if ((med[v][k] = measure(v)) < 0) return 1;
    for (v = 0; v < 4; v++) {
        for (i = 0; i < REPS; i++)
            for (j = i + 1; j < REPS; j++)
                if (med[v][j] < med[v][i]) tmp = med[v][i], med[v][i] = med[v][j], med[v][j] = tmp;
        m[v] = med[v][REPS / 2], lo[v] = med[v][0], hi[v] = med[v][REPS - 1];
    }
    sim0 = sim_makespan(0, f_us);
    printf("%-14s %12s %22s %10s %12s\n", "variant", "median ms", "spread (min-max) ms", "x plain", "sim x plain");
    for (v = 0; v < 4; v++)
        printf("%-14s %12.3f %10.3f - %-9.3f %10.3f %12.3f\n", name[v], 1e3 * m[v], 1e3 * lo[v], 1e3 * hi[v], m[v] / m[0],
               sim_makespan(v, f_us) / sim0);
    for (i = 0; i < N * G; i++) free(params[i]), free(grads[i]);
    return 0;
}
