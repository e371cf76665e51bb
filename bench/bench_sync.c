/* bench_sync: what ties and step agreement cost a schedule, as the simulator predicts it. For every
   schedule kind (interleaved with two chunks; ZB-V and DualPipeV on their V placement) at S, M, N
   (default 4, 8, 2; continuous rounds, R = 2): the makespan of the plain schedule (the baseline,
   simulated in the same run), then with GPT-2's tie (first and last stage), the tie with its transfer
   (tie_bytes over a bandwidth that makes it cost T_TIE units, latency 0), the step agreement, and both;
   each as a ratio to the baseline. Op costs F 1, B 2, I 1, W 1 (the placement replay's too). Last, the
   time avgpipe_sched_add_sync takes on the large shape bench_sched uses (S = 64, M = 1024, N = 8, 1F1B
   and ZB-V, tie and agreement), median of 3. The simulator is deterministic: one run per figure.
   Usage: bench_sync [S M N [T_TIE]] */
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

static avgpipe_sched_desc shape(avgpipe_sched_kind kind, int S, int M, int N) {
    avgpipe_sched_desc d = {0};
    d.kind = kind;
    d.stages = S;
    d.micro = M;
    d.pipes = N;
    d.rounds = 2;
    d.continuous = 1;
    if (kind == AVGPIPE_SCHED_INTERLEAVED) d.chunks = 2;
    return d;
}

/* Makespan of s with `sync` added (NULL: as it is); -1 on an error (printed). */
static double makespan(const avgpipe_schedule *s, const avgpipe_sync_desc *sync, double tie_bytes) {
    avgpipe_schedule t;
    avgpipe_sim_desc sd = {0};
    avgpipe_sim_result r;
    double m;
    if (sync && avgpipe_sched_add_sync(NULL, s, sync, &t)) {
        fprintf(stderr, "bench_sync: %s\n", avgpipe_last_error(NULL));
        return -1;
    }
    sd.tie_bytes = tie_bytes;
    sd.bandwidth = 1;
    if (avgpipe_sim_run(NULL, sync ? &t : s, &sd, &r)) {
        fprintf(stderr, "bench_sync: %s\n", avgpipe_last_error(NULL));
        m = -1;
    } else
        m = r.makespan;
    avgpipe_sim_result_free(NULL, &r);
    if (sync) avgpipe_sched_free(NULL, &t);
    return m;
}

int main(int argc, char **argv) {
    int S = argc > 3 ? atoi(argv[1]) : 4, M = argc > 3 ? atoi(argv[2]) : 8, N = argc > 3 ? atoi(argv[3]) : 2, k, bad = 0;
    double T = argc > 4 ? atof(argv[4]) : 1;
    if (S < 2 || M < 1 || N < 1 || T < 0) {
        fprintf(stderr, "usage: bench_sync [S M N [T_TIE]] (S >= 2)\n");
        return 2;
    }
    printf("bench_sync: S=%d M=%d N=%d continuous, R=2; op costs F 1 B 2 I 1 W 1; a tie's transfer %g units\n", S, M, N, T);
    printf("%-12s %9s %14s %14s %14s %14s\n", "kind", "plain", "tie", "tie+transfer", "agree", "tie+agree");
    for (k = AVGPIPE_SCHED_AFAB; k < AVGPIPE_SCHED_KIND_COUNT; k++) {
        avgpipe_sched_desc d = shape((avgpipe_sched_kind)k, S, M, N);
        avgpipe_schedule s;
        avgpipe_tie tie = {0, 0, 0, 0, 1};
        avgpipe_sync_desc only_tie = {.ties = &tie, .nties = 1}, agree = {.agree = 1}, both = {.ties = &tie, .nties = 1, .agree = 1};
        double m0, m1, m2, m3, m4;
        if (avgpipe_sched_generate(NULL, &d, &s)) {
            printf("%-12s (skipped: %s)\n", avgpipe_sched_kind_name((avgpipe_sched_kind)k), avgpipe_last_error(NULL));
            continue;
        }
        tie.stage_b = s.nstages - 1;
        m0 = makespan(&s, NULL, 0);
        m1 = makespan(&s, &only_tie, 0);
        m2 = makespan(&s, &only_tie, T);
        m3 = makespan(&s, &agree, 0);
        m4 = makespan(&s, &both, 0);
        bad |= m0 < 0 || m1 < 0 || m2 < 0 || m3 < 0 || m4 < 0;
        printf("%-12s %9.1f %7.1f %5.3fx %7.1f %5.3fx %7.1f %5.3fx %7.1f %5.3fx\n", avgpipe_sched_kind_name((avgpipe_sched_kind)k), m0, m1,
               m1 / m0, m2, m2 / m0, m3, m3 / m0, m4, m4 / m0);
        avgpipe_sched_free(NULL, &s);
    }
    {
        avgpipe_sched_kind big[2] = {AVGPIPE_SCHED_1F1B, AVGPIPE_SCHED_ZBV};
        int b, rep;
        for (b = 0; b < 2; b++) {
            avgpipe_sched_desc d = shape(big[b], 64, 1024, 8);
            avgpipe_schedule s, t;
            avgpipe_tie tie = {0, 0, 0, 0, 1};
            avgpipe_sync_desc both = {.ties = &tie, .nties = 1, .agree = 1};
            double dt[3], tmp;
            d.rounds = 1;
            if (avgpipe_sched_generate(NULL, &d, &s)) {
                fprintf(stderr, "bench_sync: %s\n", avgpipe_last_error(NULL));
                return 1;
            }
            tie.stage_b = s.nstages - 1;
            for (rep = 0; rep < 3; rep++) {
                double t0 = now();
                if (avgpipe_sched_add_sync(NULL, &s, &both, &t)) {
                    fprintf(stderr, "bench_sync: %s\n", avgpipe_last_error(NULL));
                    return 1;
                }
                dt[rep] = now() - t0;
                avgpipe_sched_free(NULL, &t);
            }
            if (dt[0] > dt[1]) tmp = dt[0], dt[0] = dt[1], dt[1] = tmp;
            if (dt[1] > dt[2]) tmp = dt[1], dt[1] = dt[2], dt[2] = tmp;
            if (dt[0] > dt[1]) tmp = dt[0], dt[0] = dt[1], dt[1] = tmp;
            printf("add_sync %-6s S=64 M=1024 N=8 (tie + agree): median %.3f s (min %.3f, max %.3f)\n", avgpipe_sched_kind_name(big[b]), dt[1], dt[0],
                   dt[2]);
            avgpipe_sched_free(NULL, &s);
        }
    }
    return bad;
}
