/* bench_runtime: what the runtime costs, and how well the simulator predicts it.

   Part 1, overhead. Empty stage callbacks, 1F1B, N = 1, M = 32, S = 2 and 4: iterations per second
   and microseconds per op of the runtime, against a baseline measured in the same run: a plain loop
   calling the same empty callbacks directly (forward and backward of every (stage, micro-batch), and
   the steps). The difference is the runtime's overhead: posting and waiting for messages, slot
   bookkeeping, thread hand-offs, the averaging thread, profiling off.
     us/op (wall)   iteration wall time / ops of all ranks (ops = compute + send/recv + STEP + AVG)
     us/op (rank)   iteration wall time / ops of one rank: the cost of an op on a rank's own thread,
                    waits for the neighbours included (what a 1 us target is about)
     overhead/op    (runtime - direct loop) / ops of all ranks, per compute op in brackets
   Part 2, makespan vs simulator (and the paper's Figure 7 on real threads). Callbacks busy-wait fixed
   durations (F 200 us, B 400 us; ZB-H1 I 200 us, W 200 us); a comm wrapper delivers every message
   `delay` after it was sent (200 us), serialised per link like the simulator's link. The profile of the
   measured iterations gives the mean cost per op kind; avgpipe_sim_run on the run's own (lowered)
   schedule with those costs and latency = delay predicts the makespan. Printed: measured median,
   prediction, error, ratio to 1F1B (baseline, same run), bubble, and memory per rank
   (avgpipe_run_bytes: boundary buffers + averaging) with the slots per stage.
   The machine this was written on has 2 cores: with S > 2 busy-waiting stage threads time-share cores
   and timings mean little, so part 2 uses S = 2 (override at your own risk: bench_runtime reps S).
   The first line reports the CPU share S spinning threads get: on a shared machine where other
   processes hold the cores, part 2's measured times are inflated (a stage thread is descheduled for
   whole time slices) and its comparison with the simulator means nothing; rerun when it is ~100%.

   Every figure is a median over `reps` repetitions (default 7); schedules are interleaved within each
   repetition so that the machine's noise hits them alike. Nothing is asserted.

   Build: meson compile -C build bench_runtime   (or gcc -std=c11 -O2 -I. bench/bench_runtime.c -lm -pthread)
   Run:   build/bench_runtime [reps [S for part 2]] */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "tests/delaycomm.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define REPS_MAX 64

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(const double *v, int n) {
    double t[REPS_MAX * 8];
    memcpy(t, v, (size_t)n * sizeof *v);
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}
static void spin_until(double t) {
    while (now() < t) {
    }
}
static void die(const char *what, avgpipe_context *ctx) {
    fprintf(stderr, "bench_runtime: %s: %s\n", what, avgpipe_last_error(ctx));
    exit(1);
}

/* ---- part 1: empty callbacks ------------------------------------------------------------------- */

static int empty_op(avgpipe_op_ctx *op) {
    (void)op;
    return 0;
}
static int empty_step(int rank, int pipe, int stage, int round, float *params, void *user) {
    (void)rank, (void)pipe, (void)stage, (void)round, (void)params, (void)user;
    return 0;
}
/* Called through volatile pointers so the direct loop really makes the calls. */
static int (*volatile fwd_ptr)(avgpipe_op_ctx *) = empty_op;
static int (*volatile bwd_ptr)(avgpipe_op_ctx *) = empty_op;
static int (*volatile step_ptr)(int, int, int, int, float *, void *) = empty_step;

#define PFLOATS 64

static void overhead(int S, int M, int reps) {
    enum { BATCH = 50 };
    avgpipe_context ctx;
    avgpipe_run_desc d;
    avgpipe_run *run;
    avgpipe_run_stats st;
    static float w[8][PFLOATS];
    float *params[8];
    size_t act[8], pc[8];
    double trun[REPS_MAX], tdir[REPS_MAX];
    long long ops = 0;
    int g, rep, i, m, ncompute = 2 * S * M;
    avgpipe_context_init(&ctx, NULL);
    memset(&d, 0, sizeof d);
    for (g = 0; g < S; g++) params[g] = w[g], act[g] = 256, pc[g] = PFLOATS;
    d.sched.kind = AVGPIPE_SCHED_1F1B;
    d.sched.stages = S;
    d.sched.micro = M;
    d.cb.forward = empty_op;
    d.cb.backward = empty_op;
    d.cb.step = empty_step;
    d.act_bytes = act;
    d.params = params;
    d.param_count = pc;
    d.averaging.alpha = AVGPIPE_ZERO;
    if (avgpipe_run_create(&ctx, &d, &run)) die("avgpipe_run_create", &ctx);
    for (i = 0; i < 5; i++)
        if (avgpipe_run_iteration(run, &st)) die("iteration", &ctx);
    for (rep = 0; rep < reps; rep++) {
        double t0 = now(), one[BATCH];
        for (i = 0; i < BATCH; i++) {
            if (avgpipe_run_iteration(run, &st)) die("iteration", &ctx);
            one[i] = st.seconds;
        }
        (void)t0;
        trun[rep] = median(one, BATCH);
        ops = st.ops;
        /* the direct loop: the same callbacks, the same number of calls, one thread */
        for (i = 0; i < BATCH; i++) {
            avgpipe_op_ctx oc;
            double t1 = now();
            memset(&oc, 0, sizeof oc);
            for (g = 0; g < S; g++) {
                oc.stage = g;
                oc.params = w[g];
                for (m = 0; m < M; m++) {
                    oc.micro = m;
                    (void)fwd_ptr(&oc);
                }
                for (m = 0; m < M; m++) {
                    oc.micro = m;
                    (void)bwd_ptr(&oc);
                }
                (void)step_ptr(g, 0, g, 0, w[g], NULL);
            }
            one[i] = now() - t1;
        }
        tdir[rep] = median(one, BATCH);
    }
    {
        double tr = median(trun, reps), td = median(tdir, reps);
        printf("S=%d M=%-3d %8lld %9.1f %10.0f %9.3f %9.3f %9.3f %12.3f (%6.3f) %9.1f\n", S, M, ops, tr * 1e6, 1.0 / tr, tr * 1e6 / ops,
               tr * 1e6 / ((double)ops / S), td * 1e6 / ncompute, (tr - td) * 1e6 / ops, (tr - td) * 1e6 / ncompute, tr / td);
    }
    avgpipe_run_destroy(run);
}

/* ---- part 2: busy callbacks, delayed links, simulator ------------------------------------------ */

static double cost_f = 200e-6, cost_b = 400e-6, cost_i = 200e-6, cost_w = 200e-6;

static int busy_f(avgpipe_op_ctx *op) {
    (void)op;
    spin_until(now() + cost_f);
    return 0;
}
static int busy_b(avgpipe_op_ctx *op) {
    (void)op;
    spin_until(now() + cost_b);
    return 0;
}
static int busy_i(avgpipe_op_ctx *op) {
    (void)op;
    spin_until(now() + cost_i);
    return 0;
}
static int busy_w(avgpipe_op_ctx *op) {
    (void)op;
    spin_until(now() + cost_w);
    return 0;
}

#define NSCHED 4
#define MAXS 8
#define BIGP 4096          /* floats per stage partition (averaging buffers show in the memory) */
#define ACTB (16 * 1024)   /* bytes of one micro-batch's activation */

typedef struct sched_case {
    const char *name;
    avgpipe_sched_kind kind;
    int advance, split;
    avgpipe_context ctx;
    avgpipe_run_desc d;
    avgpipe_comm table;
    delaycomm dc;
    avgpipe_run *run;
    float *params[MAXS];
    size_t act[MAXS], pc[MAXS];
    double t[REPS_MAX], bubble[REPS_MAX];
    double sum[AVGPIPE_OP_KIND_COUNT];
    long n[AVGPIPE_OP_KIND_COUNT];
} sched_case;

static void case_create(sched_case *c, int S, int M, double delay) {
    int g;
    avgpipe_context_init(&c->ctx, NULL);
    memset(&c->d, 0, sizeof c->d);
    for (g = 0; g < S; g++) {
        c->params[g] = (float *)calloc(BIGP, sizeof(float));
        c->act[g] = ACTB;
        c->pc[g] = BIGP;
    }
    if (delaycomm_init(&c->dc, S, delay, &c->table)) die("delaycomm_init", NULL);
    c->d.sched.kind = c->kind;
    c->d.sched.stages = S;
    c->d.sched.micro = M;
    c->d.sched.advance = c->advance;
    c->d.cb.forward = busy_f;
    if (c->split) {
        c->d.cb.backward_input = busy_i;
        c->d.cb.backward_weight = busy_w;
    } else {
        c->d.cb.backward = busy_b;
    }
    c->d.cb.step = empty_step;
    c->d.act_bytes = c->act;
    c->d.params = c->params;
    c->d.param_count = c->pc;
    c->d.averaging.alpha = AVGPIPE_ZERO;
    c->d.profile = 1;
    c->d.comm = &c->table;
    if (avgpipe_run_create(&c->ctx, &c->d, &c->run)) die(c->name, &c->ctx);
}

static void case_iterate(sched_case *c, int rep) {
    avgpipe_run_stats st;
    const avgpipe_event *ev;
    size_t n, i;
    if (avgpipe_run_iteration(c->run, &st)) die(c->name, &c->ctx);
    if (rep < 0) return; /* warm-up */
    c->t[rep] = st.seconds;
    c->bubble[rep] = st.bubble;
    ev = avgpipe_run_events(c->run, &n);
    for (i = 0; i < n; i++)
        if (ev[i].track == 0) {
            c->sum[ev[i].op.kind] += ev[i].end - ev[i].start;
            c->n[ev[i].op.kind]++;
        }
}

static void case_report(sched_case *c, int S, int reps, double delay, double base) {
    avgpipe_sim_desc sd;
    avgpipe_sim_result res;
    int k, r, g;
    double meas = median(c->t, reps);
    char slots[64] = "", mem[128] = "";
    memset(&sd, 0, sizeof sd);
    for (k = 0; k < AVGPIPE_OP_KIND_COUNT; k++) sd.cost[k] = AVGPIPE_ZERO; /* exactly zero unless measured */
    for (k = 0; k < AVGPIPE_OP_KIND_COUNT; k++)
        if (c->n[k] && c->sum[k] > 0) sd.cost[k] = c->sum[k] / c->n[k];
    sd.latency = delay;
    if (avgpipe_sim_run(&c->ctx, avgpipe_run_schedule(c->run), &sd, &res)) die("avgpipe_sim_run", &c->ctx);
    for (g = 0; g < S; g++) {
        size_t len = strlen(slots);
        snprintf(slots + len, sizeof slots - len, "%s%d", g ? "/" : "", avgpipe_run_slots(c->run, g));
    }
    for (r = 0; r < S; r++) {
        size_t len = strlen(mem);
        double b = avgpipe_run_bytes(c->run, r);
        snprintf(mem + len, sizeof mem - len, "%s%.0f", r ? "/" : "", b / 1024);
    }
    printf("%-12s %8.3f %8.3f %+7.1f%% %7.3f %7.3f %7.3f  %-8s %-16s", c->name, meas * 1e3, res.makespan * 1e3,
           100 * (res.makespan - meas) / meas, meas / base, median(c->bubble, reps), res.bubble, slots, mem);
    for (r = 0; r < S && r < 4; r++) printf("%s%d", r ? "/" : " ", res.rank[r].peak_stash);
    printf("\n");
    printf("%-12s   mean cost (us): F %.1f", "", c->n[AVGPIPE_OP_F] ? 1e6 * c->sum[AVGPIPE_OP_F] / c->n[AVGPIPE_OP_F] : 0);
    if (c->n[AVGPIPE_OP_B]) printf(" B %.1f", 1e6 * c->sum[AVGPIPE_OP_B] / c->n[AVGPIPE_OP_B]);
    if (c->n[AVGPIPE_OP_I]) printf(" I %.1f", 1e6 * c->sum[AVGPIPE_OP_I] / c->n[AVGPIPE_OP_I]);
    if (c->n[AVGPIPE_OP_W]) printf(" W %.1f", 1e6 * c->sum[AVGPIPE_OP_W] / c->n[AVGPIPE_OP_W]);
    if (c->n[AVGPIPE_OP_STEP]) printf(" STEP %.1f", 1e6 * c->sum[AVGPIPE_OP_STEP] / c->n[AVGPIPE_OP_STEP]);
    printf("\n");
    avgpipe_sim_result_free(&c->ctx, &res);
}

static void case_destroy(sched_case *c, int S) {
    int g;
    avgpipe_run_destroy(c->run);
    delaycomm_free(&c->dc);
    for (g = 0; g < S; g++) free(c->params[g]);
}

static void makespan(int S, int M, int reps, double delay) {
    sched_case cs[NSCHED];
    int k, rep;
    memset(cs, 0, sizeof cs);
    cs[0].name = "1f1b", cs[0].kind = AVGPIPE_SCHED_1F1B;
    cs[1].kind = AVGPIPE_SCHED_ADVANCE, cs[1].advance = S - 1;
    cs[2].name = "afab", cs[2].kind = AVGPIPE_SCHED_AFAB;
    cs[3].name = "zbh1", cs[3].kind = AVGPIPE_SCHED_ZBH1, cs[3].split = 1;
    {
        static char nm[32];
        snprintf(nm, sizeof nm, "advance K=%d", S - 1);
        cs[1].name = nm;
    }
    for (k = 0; k < NSCHED; k++) case_create(&cs[k], S, M, delay);
    for (rep = -2; rep < reps; rep++)
        for (k = 0; k < NSCHED; k++) case_iterate(&cs[k], rep);
    printf("%-12s %8s %8s %8s %7s %7s %7s  %-8s %-16s %s\n", "schedule", "meas ms", "sim ms", "sim err", "/1f1b", "bubble", "sim bub",
           "slots", "KiB per rank", "sim peak stash");
    for (k = 0; k < NSCHED; k++) case_report(&cs[k], S, reps, delay, median(cs[0].t, reps));
    for (k = 0; k < NSCHED; k++) case_destroy(&cs[k], S);
}

/* CPU left for S busy stage threads: S threads spin 50 ms each, summing the gaps (> 20 us) between
   successive clock reads, i.e. the time they were descheduled. 100% when each has a core; with other
   processes on the cores it drops (2 spinners and one busy process on 2 cores: ~67%), and part 2's
   measured times grow with the missing share. */
typedef struct spin_probe {
    double ran;
} spin_probe;
static void *spin_probe_main(void *arg) {
    spin_probe *p = (spin_probe *)arg;
    double t0 = now(), prev = t0, t, lost = 0;
    while ((t = now()) - t0 < 0.05) {
        if (t - prev > 20e-6) lost += t - prev;
        prev = t;
    }
    p->ran = 1 - lost / (t - t0);
    return NULL;
}
static double cpu_share(int S) {
    pthread_t th[MAXS];
    spin_probe p[MAXS];
    double worst = 1;
    int i;
    for (i = 0; i < S; i++)
        if (pthread_create(&th[i], NULL, spin_probe_main, &p[i]) != 0) return -1;
    for (i = 0; i < S; i++) {
        pthread_join(th[i], NULL);
        if (p[i].ran < worst) worst = p[i].ran;
    }
    return worst;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 7, S2 = argc > 2 ? atoi(argv[2]) : 2;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    const double delay = 200e-6;
    if (reps < 1 || reps > REPS_MAX || S2 < 2 || S2 > MAXS) {
        fprintf(stderr, "usage: bench_runtime [reps 1..%d [S 2..%d]]\n", REPS_MAX, MAXS);
        return 2;
    }
    {
        char load[128] = "?";
        FILE *f = fopen("/proc/loadavg", "r");
        if (f) {
            if (!fgets(load, sizeof load, f)) snprintf(load, sizeof load, "?");
            fclose(f);
            load[strcspn(load, "\n")] = 0;
        }
        printf("bench_runtime: %ld online CPUs (load average %s), median of %d repetitions\n", ncpu, load, reps);
        printf("CPU share of %d spinning threads: %.0f%% (below ~95%% other processes hold the cores: part 2's times are inflated)\n\n",
               S2, 100 * cpu_share(S2));
    }
    printf("1. runtime overhead, empty callbacks, 1F1B, N=1 (each repetition: median of 50 iterations)\n");
    printf("%-9s %8s %9s %10s %9s %9s %9s %21s %9s\n", "shape", "ops/iter", "us/iter", "iter/s", "us/op", "us/op", "direct",
           "overhead/op (/compute)", "run/");
    printf("%-9s %8s %9s %10s %9s %9s %9s %21s %9s\n", "", "", "", "", "(wall)", "(rank)", "us/call", "us", "direct");
    overhead(2, 32, reps);
    overhead(4, 32, reps);
    if (ncpu < 4) printf("(S=4 runs 4 stage threads on %ld CPUs: they time-share)\n", ncpu);
    printf("\n2. measured makespan vs simulator, S=%d M=8 N=1, F %.0f us, B %.0f us (ZB-H1: I %.0f, W %.0f), delivery delay %.0f us\n",
           S2, cost_f * 1e6, cost_b * 1e6, cost_i * 1e6, cost_w * 1e6, delay * 1e6);
    printf("   activations %d KiB per micro-batch, %d floats per stage partition; 'KiB per rank' = avgpipe_run_bytes\n", ACTB / 1024, BIGP);
    if (S2 > ncpu) printf("   WARNING: S=%d busy-waiting stage threads on %ld CPUs time-share: these timings are distorted\n", S2, ncpu);
    else printf("   S=%d so that every busy-waiting stage thread has a core (S > %ld would time-share)\n", S2, ncpu);
    makespan(S2, 8, reps, delay);
    return 0;
}
