/* bench_tune_regret — how good are the tuner's predictions on a real model, on a shared, noisy machine?

   The Fashion-MNIST MLP of examples/mlp.h trains on CPU stage threads (the runtime's workers, OpenBLAS
   single-threaded inside each). ONE setting (advance K = 1, N = 2) is profiled at two micro-batch sizes
   (M = 4 and M = 8) into one profile, with an 'averaging' line per stage (avgpipe_tune_measure_averaging);
   the tuner fits its cost model to it (op times as lines through the medians, the runtime's time per op,
   the averaging per parameter; the stage threads and their averaging threads share the machine's cores).
   Then every setting of a grid (schedules 1f1b, advance K = 1, afab, zbh1; M in {2, 4, 8, 16}; N in
   {1, 2, 3}) is measured and compared with the tuner's prediction:
     - per setting: the median time per sample over every timed iteration of every pass, the trimmed mean
       (middle 60%), their spread (90th percentile over the median, and the slowest pass median over the
       fastest), the prediction and its error, predicted memory against what the runtime allocated;
     - mean absolute relative error, Spearman rank correlation of predicted vs measured (medians, and
       again on trimmed means);
     - regret: measured time of the tuner's choice within the grid over the best measured, minus 1;
     - the tuner's overall choice (all divisors M of the batch down to B/16 samples, N <= 3), measured too;
     - tuning time (fit + search) as a fraction of the time the grid took to measure.
   Targets: regret <= 5%, rank correlation >= 0.9, tuning time < 1% of the grid's; the last lines say
   whether each was met.

   Noise. The grid is measured in --passes passes, each visiting every setting once in its own random
   order (so a slow spell of the machine spreads over many settings instead of landing on a few), each
   visit --warmup + --iters iterations. The profile's 3 visits per micro-batch size are spread over the
   same passes, among the grid's visits: the speed of these machines drifts by 10-20% over minutes, and a
   profile taken before the grid could fall in a spell the grid never sees. (Predictions still come out
   about 10% low across the whole grid, a common scale that leaves the ranking and the regret alone.) The
   tuner's overall choice, when the grid lacks it, is measured afterwards in --passes visits that
   alternate with visits of the grid's best, and compared with those. Other programs' use of the
   machine is watched (bench/quiet.h: /proc/stat minus this process): before a visit the bench waits
   (up to 10 s) for them to use under --max-others cores, and a visit during which they used more is
   redone (up to 3 times; counted and reported).

   Usage: bench_tune_regret [--stages S] [--limit N] [--passes P] [--iters I] [--batch B] [--rounds R] [--sync]
                            [--max-others C] [--seed X] [--hidden LIST] [--data DIR]
   Defaults: S = 4 with 4 or more cores, else 2; 8192 training samples; 8 passes of 1 + 3 iterations per
   visit; B = 128; R = 2 continuous rounds; others under 0.15 cores; seed 1.
   More stage threads than cores (the main job's 4 stages on 2 cores): --stages 4 on 2 cores. The fit then
   also takes from the profile (N = 2) how many cores' worth of work the stage threads got through at once
   (the cost model's busy_cores), which bounds every prediction instead of the cores. */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#define MLP_IMPLEMENTATION
#include "examples/mlp.h"
#define BLAS_KERNEL_IMPLEMENTATION
#include "examples/blas_kernel.h"
#include "bench/quiet.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void openblas_set_num_threads(int num_threads); /* also in OpenBLAS's cblas.h; not in netlib's */

#define PROG "bench_tune_regret"
#define MAXN 4
#define WARMUP_MAX 8
#define MAXITERS 32
#define MAXPASSES 16
#define MAXSET 64
#define RETRIES 3
#define PROFILE_VISITS 3 /* per profiled micro-batch size */
#define PROFILED 1000    /* in a pass's visiting order: profiled[i] is PROFILED + i */

typedef struct options {
    int stages, limit, iters, passes, warmup, batch, rounds, continuous;
    double max_others;
    unsigned seed;
    const char *hidden, *data;
} options;

/* The model and data, shared by every setting. */
static options O;
static mlp_model MODEL;
static mlp_data TRAIN;
static size_t ACT_BYTES[MLP_MAX_LAYERS];
static blas_kernel_status BLAS;

/* State of one setting's run, reached by the callbacks through op->user. */
typedef struct app {
    int G, N, mb;
    float loss_scale;
    mlp_order order;
    mlp_adam_hp adam;
    mlp_net nets[MAXN];
    float *params[MAXN * MLP_MAX_LAYERS];
    int slots[MLP_MAX_LAYERS];
    mlp_stash *stash[MLP_MAX_LAYERS];
    mlp_perm perm[MLP_MAX_LAYERS];
} app;

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs(PROG ": ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(2);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- callbacks (as examples/fashion_mnist.c) ----------------------------------------------------- */

static mlp_stash *stash_of(app *A, const avgpipe_op_ctx *op) { return &A->stash[op->stage][op->slot]; }

static int cb_forward(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    mlp_stash *st = stash_of(A, op);
    int last = op->stage == A->G - 1;
    if (op->stage == 0 || last) {
        const uint32_t *idx = mlp_order_micro(&A->order, &A->perm[op->stage], op->pipe, op->round, op->micro, A->mb);
        if (!idx || mlp_stash_load(st, &TRAIN, idx, A->mb) != 0) return 1;
    }
    if (mlp_stage_forward(&MODEL, op->stage, op->params, st, (const float *)op->input, last ? NULL : (float *)op->output, A->mb))
        return 1;
    if (last) op->loss = mlp_stage_loss(&MODEL, st, NULL);
    return last && !isfinite(op->loss);
}

static int cb_backward(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    return mlp_stage_backward(&MODEL, op->stage, op->params, stash_of(A, op), (const float *)op->input,
                              (const float *)op->grad_output, (float *)op->grad_input, A->nets[op->pipe].grad[op->stage],
                              A->loss_scale) != 0;
}

static int cb_backward_input(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    return mlp_stage_backward_input(&MODEL, op->stage, op->params, stash_of(A, op), (const float *)op->grad_output,
                                    (float *)op->grad_input, A->loss_scale) != 0;
}

static int cb_backward_weight(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    return mlp_stage_backward_weight(&MODEL, op->stage, stash_of(A, op), (const float *)op->input,
                                     A->nets[op->pipe].grad[op->stage]) != 0;
}

static int cb_step(int rank, int pipe, int stage, int round, float *params, void *user) {
    app *A = (app *)user;
    (void)rank, (void)round;
    mlp_adam_step(&A->nets[pipe].adam[stage], &A->adam, params, A->nets[pipe].grad[stage]);
    return 0;
}

/* ---- one setting --------------------------------------------------------------------------------- */

static void app_init(app *A, int M, int N) {
    char err[256];
    int i, g;
    memset(A, 0, sizeof *A);
    A->G = MODEL.stages;
    A->N = N;
    A->mb = O.batch / M;
    A->loss_scale = 1.0f / (float)O.batch;
    A->adam = mlp_adam_defaults();
    if (mlp_order_init(&A->order, TRAIN.n, O.batch, N, O.rounds, 1, err, sizeof err) != 0) die("%s", err);
    for (i = 0; i < N; i++) {
        if (mlp_net_init(&A->nets[i], &MODEL, 1) != 0) die("out of memory");
        for (g = 0; g < A->G; g++) A->params[i * A->G + g] = A->nets[i].params[g];
    }
    if (mlp_perm_init(&A->perm[0], TRAIN.n) != 0 || mlp_perm_init(&A->perm[A->G - 1], TRAIN.n) != 0) die("out of memory");
}

static void app_stashes(app *A, const avgpipe_run *run) {
    int g, s;
    for (g = 0; g < A->G; g++) {
        int want = avgpipe_run_slots(run, g);
        if (want <= A->slots[g]) continue;
        A->stash[g] = (mlp_stash *)realloc(A->stash[g], sizeof(mlp_stash) * (size_t)want);
        if (!A->stash[g]) die("out of memory");
        for (s = A->slots[g]; s < want; s++)
            if (mlp_stash_init(&A->stash[g][s], &MODEL, g, A->mb) != 0) die("out of memory");
        A->slots[g] = want;
    }
}

static void app_free(app *A) {
    int i, g;
    for (g = 0; g < MLP_MAX_LAYERS; g++) {
        for (i = 0; i < A->slots[g]; i++) mlp_stash_free(&A->stash[g][i]);
        free(A->stash[g]);
        mlp_perm_free(&A->perm[g]);
    }
    for (i = 0; i < A->N; i++) mlp_net_free(&A->nets[i]);
}

typedef struct setting {
    avgpipe_sched_kind kind;
    int micro, pipes, advance, continuous;
    /* results */
    double times[MAXPASSES * MAXITERS]; /* timed iterations of every accepted visit, seconds */
    double pass_median[MAXPASSES];      /* each accepted visit's median */
    int ntimes, nvisits, redone;
    double measured, trimmed, p90, pass_spread, predicted, pred_peak, real_peak, wall;
} setting;

static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static double median_of(const double *x, int n) {
    double s[(MAXPASSES * MAXITERS)];
    memcpy(s, x, sizeof(double) * (size_t)n);
    qsort(s, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

static avgpipe_sched_desc sched_of(const setting *s) {
    avgpipe_sched_desc d;
    memset(&d, 0, sizeof d);
    d.kind = s->kind;
    d.stages = MODEL.stages;
    d.micro = s->micro;
    d.pipes = s->pipes;
    d.advance = s->advance;
    d.rounds = O.rounds;
    d.continuous = s->continuous;
    return d;
}

/* Append the file `from` to `to`, without its header line unless `to` is empty. */
static void append_file(const char *from, const char *to) {
    FILE *in = fopen(from, "rb"), *out = fopen(to, "ab");
    char line[512];
    int first = 1;
    if (!in || !out) die("cannot copy '%s' to '%s': %s", from, to, strerror(errno));
    fseek(out, 0, SEEK_END);
    while (fgets(line, sizeof line, in)) {
        if (!first || ftell(out) == 0) fputs(line, out);
        first = 0;
    }
    fclose(in);
    if (fclose(out) != 0) die("cannot write '%s'", to);
}

/* One visit of setting s: O.warmup + O.iters iterations; the timed ones into t[]. With a profile path
   the timed iterations' profiles go to tmp files (kept by the caller when the visit is accepted).
   Returns the cores other programs used meanwhile. */
static double visit(avgpipe_context *ctx, setting *s, double *t, const char *profile, char tmp[][40]) {
    app *A = (app *)calloc(1, sizeof(app));
    avgpipe_run_desc rd;
    avgpipe_run *run;
    avgpipe_run_stats st;
    quiet_snap q0, q1;
    double t0 = now();
    int i, g, r;
    if (!A) die("out of memory");
    app_init(A, s->micro, s->pipes);
    for (g = 0; g + 1 < MODEL.stages; g++) /* boundary g|g+1: one micro-batch's activation */
        ACT_BYTES[g] = (size_t)A->mb * (size_t)mlp_stage_out_width(&MODEL, g) * sizeof(float);
    memset(&rd, 0, sizeof rd);
    rd.sched = sched_of(s);
    rd.cb.forward = cb_forward;
    rd.cb.backward = cb_backward;
    rd.cb.backward_input = cb_backward_input;
    rd.cb.backward_weight = cb_backward_weight;
    rd.cb.step = cb_step;
    rd.cb.user = A;
    rd.act_bytes = ACT_BYTES;
    rd.params = (float *const *)A->params;
    rd.param_count = MODEL.count;
    rd.profile = profile != NULL;
    rd.micro_samples = A->mb;
    if (avgpipe_run_create(ctx, &rd, &run) != AVGPIPE_OK) die("avgpipe_run_create: %s", avgpipe_last_error(ctx));
    app_stashes(A, run);
    s->real_peak = 0; /* what the runtime allocated, plus the weights and Adam's two moments of N models */
    for (r = 0; r < MODEL.stages; r++) {
        double b = avgpipe_run_bytes(run, r);
        for (g = r; g < MODEL.stages; g += MODEL.stages) b += (double)s->pipes * (double)MODEL.count[g] * (4 + 8);
        if (b > s->real_peak) s->real_peak = b;
    }
    q0 = quiet_now();
    for (i = 0; i < O.warmup + O.iters; i++) {
        int k = i - O.warmup;
        if (avgpipe_run_iteration(run, &st) != AVGPIPE_OK) die("iteration: %s", avgpipe_last_error(ctx));
        if (k < 0) continue;
        t[k] = st.seconds;
        if (profile) {
            int fd;
            snprintf(tmp[k], 40, "/tmp/" PROG "_XXXXXX");
            if ((fd = mkstemp(tmp[k])) < 0) die("mkstemp: %s", strerror(errno));
            close(fd);
            if (avgpipe_run_write_profile(run, tmp[k]) != AVGPIPE_OK) die("profile: %s", avgpipe_last_error(ctx));
        }
    }
    q1 = quiet_now();
    avgpipe_run_destroy(run);
    app_free(A);
    free(A);
    s->wall += now() - t0;
    return quiet_others(&q0, &q1);
}

/* Measure s once, accepted when other programs stayed under O.max_others cores (else redone, up to
   RETRIES times; the last try is kept). Adds the timed iterations to s. */
static void measure(avgpipe_context *ctx, setting *s, const char *profile, int *redone_total) {
    double t[MAXITERS], others = 0;
    char tmp[MAXITERS][40];
    int try, i;
    for (try = 0; try <= RETRIES; try++) {
        quiet_wait(O.max_others, 10);
        others = visit(ctx, s, t, profile, tmp);
        if (others < O.max_others || try == RETRIES) break;
        s->redone++, ++*redone_total;
        for (i = 0; profile && i < O.iters; i++) remove(tmp[i]);
    }
    for (i = 0; profile && i < O.iters; i++) {
        append_file(tmp[i], profile);
        remove(tmp[i]);
    }
    memcpy(s->times + s->ntimes, t, sizeof(double) * (size_t)O.iters);
    s->ntimes += O.iters;
    s->pass_median[s->nvisits++] = median_of(t, O.iters);
    (void)others;
}

/* The statistics of s over everything measured so far, per sample. */
static void summarise(setting *s) {
    double sorted[(MAXPASSES * MAXITERS)], per = 1.0 / ((double)O.rounds * s->pipes * O.batch), sum = 0, lo, hi;
    int n = s->ntimes, i, a = n / 5, b = n - n / 5;
    memcpy(sorted, s->times, sizeof(double) * (size_t)n);
    qsort(sorted, (size_t)n, sizeof(double), cmp_double);
    s->measured = median_of(s->times, n) * per;
    for (i = a; i < b; i++) sum += sorted[i];
    s->trimmed = sum / (b - a) * per;
    s->p90 = sorted[(int)(0.9 * (n - 1) + 0.5)] * per / s->measured;
    lo = hi = s->pass_median[0];
    for (i = 1; i < s->nvisits; i++) lo = fmin(lo, s->pass_median[i]), hi = fmax(hi, s->pass_median[i]);
    s->pass_spread = lo > 0 ? hi / lo : 0;
}

/* The 1-minute load average (-1 where /proc/loadavg cannot be read). */
static double loadavg(void) {
    FILE *f = fopen("/proc/loadavg", "r");
    double l = -1;
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = -1;
        fclose(f);
    }
    return l;
}

static int same(const avgpipe_tune_candidate *c, const setting *s) {
    return c->sched.kind == s->kind && c->sched.micro == s->micro && c->sched.pipes == s->pipes && c->sched.advance == s->advance &&
           c->sched.continuous == s->continuous;
}

/* ---- statistics ------------------------------------------------------------------------------------ */

/* Ranks 1..n, ties get the mean of their ranks. */
static void ranks(const double *x, int n, double *rk) {
    int i, j;
    for (i = 0; i < n; i++) {
        double less = 0, equal = 0;
        for (j = 0; j < n; j++) less += x[j] < x[i], equal += x[j] == x[i];
        rk[i] = less + (equal + 1) / 2;
    }
}

static double spearman(const double *x, const double *y, int n) {
    double rx[256], ry[256], mx = 0, my = 0, sxy = 0, sxx = 0, syy = 0;
    int i;
    ranks(x, n, rx);
    ranks(y, n, ry);
    for (i = 0; i < n; i++) mx += rx[i] / n, my += ry[i] / n;
    for (i = 0; i < n; i++) sxy += (rx[i] - mx) * (ry[i] - my), sxx += (rx[i] - mx) * (rx[i] - mx), syy += (ry[i] - my) * (ry[i] - my);
    return sxx > 0 && syy > 0 ? sxy / sqrt(sxx * syy) : 0;
}

/* A permutation of 0..n-1 from a small LCG (the same on every machine for the same seed). */
/* Shuffle ix[0 .. n-1] in place (Fisher-Yates on a fixed-seed LCG: the same order for the same --seed). */
static void shuffle(int *ix, int n, unsigned *state) {
    int i;
    for (i = n - 1; i > 0; i--) {
        int j, t;
        *state = *state * 1664525u + 1013904223u;
        j = (int)((*state >> 8) % (unsigned)(i + 1));
        t = ix[i], ix[i] = ix[j], ix[j] = t;
    }
}

/* ---- main ------------------------------------------------------------------------------------------ */

static long arg_long(const char *flag, const char *v, long lo, long hi) {
    char *end;
    long x;
    errno = 0;
    x = strtol(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi) die("%s expects an integer in [%ld, %ld], got '%s'", flag, lo, hi, v);
    return x;
}

static void parse(int argc, char **argv) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int i;
    O.stages = cores >= 4 ? 4 : 2;
    O.limit = 8192;
    O.iters = 3;
    O.passes = 8; /* Spearman 0.88-0.89 with 5 (the grid's own noise), 0.94 with 10 */
    O.warmup = 1;
    O.batch = 128;
    O.rounds = 2;
    O.continuous = 1;
    O.max_others = 0.15;
    O.seed = 1;
    O.hidden = "512,256,128";
    O.data = "/usr/share/datasets/fashion-mnist";
    for (i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            printf("usage: " PROG " [--stages S] [--limit N] [--passes P] [--iters I] [--warmup W] [--batch B] [--rounds R] [--sync] "
                   "[--max-others CORES] [--seed X] [--hidden LIST] [--data DIR]\n");
            exit(0);
        }
        if (!strcmp(f, "--sync")) {
            O.continuous = 0;
            continue;
        }
        if (!v) die("unknown option or missing value: '%s' (try --help)", f);
        if (!strcmp(f, "--stages")) O.stages = (int)arg_long(f, v, 1, MLP_MAX_LAYERS);
        else if (!strcmp(f, "--limit")) O.limit = (int)arg_long(f, v, 1, 1 << 24);
        else if (!strcmp(f, "--iters")) O.iters = (int)arg_long(f, v, 1, MAXITERS);
        else if (!strcmp(f, "--passes")) O.passes = (int)arg_long(f, v, 1, MAXPASSES);
        else if (!strcmp(f, "--warmup")) O.warmup = (int)arg_long(f, v, 0, WARMUP_MAX);
        else if (!strcmp(f, "--batch")) O.batch = (int)arg_long(f, v, 16, 1 << 16);
        else if (!strcmp(f, "--rounds")) O.rounds = (int)arg_long(f, v, 1, 64);
        else if (!strcmp(f, "--seed")) O.seed = (unsigned)arg_long(f, v, 0, 2147483647L);
        else if (!strcmp(f, "--max-others")) {
            char *end;
            O.max_others = strtod(v, &end);
            if (end == v || *end || !(O.max_others > 0)) die("--max-others expects a number of cores > 0, got '%s'", v);
        }
        else if (!strcmp(f, "--hidden")) O.hidden = v;
        else if (!strcmp(f, "--data")) O.data = v;
        else die("unknown option '%s' (try --help)", f);
        i++;
    }
    if (O.batch % 16) die("--batch %d: must be a multiple of 16 (the grid's largest M)", O.batch);
}

/* The profile of one setting at M = 4 and M = 8 (visits alternating, 3 each), and an 'averaging' line per
   stage: what the tuner fits. Returns the seconds it took. */
/* The profiled setting, advance K = 1, N = 2, at M = 4 and M = 8: profiled[0 and 1]. */
static void profile_settings(setting *profiled) {
    int i;
    for (i = 0; i < 2; i++) {
        memset(&profiled[i], 0, sizeof profiled[i]);
        profiled[i].kind = AVGPIPE_SCHED_ADVANCE;
        profiled[i].micro = i == 0 ? 4 : 8;
        profiled[i].pipes = 2;
        profiled[i].advance = 1;
        profiled[i].continuous = O.continuous;
    }
}

/* Whether pass `pass` holds visit j (0..PROFILE_VISITS-1) of profiled size i (0, 1): the visits spread
   evenly over the passes, the two sizes' alternating. */
static int profile_visit_in(int pass, int i, int j) {
    return (2 * j + i) * O.passes / (2 * PROFILE_VISITS) == pass;
}

/* After the profile's op lines: an 'averaging' line per stage (the tuner's averaging cost). */
static void profile_averaging(avgpipe_context *ctx, const char *path) {
    FILE *f = fopen(path, "a");
    int g;
    if (!f) die("cannot append to '%s': %s", path, strerror(errno));
    for (g = 0; g < MODEL.stages; g++) {
        double t;
        if (avgpipe_tune_measure_averaging(ctx, MODEL.count[g], &t) != AVGPIPE_OK) die("%s", avgpipe_last_error(ctx));
        fprintf(f, "averaging floats=%zu seconds=%.9g\n", MODEL.count[g], t);
    }
    if (fclose(f) != 0) die("cannot write '%s'", path);
}

/* The model's layer shapes at the grid's smallest micro-batch, checked by blas_kernel_ensure. */
static void ensure_kernel(char **argv) {
    blas_kernel_shape shapes[MLP_MAX_LAYERS];
    char err[256];
    int l;
    if (mlp_model_parse(&MODEL, 784, O.hidden, O.stages, err, sizeof err) != 0) die("%s", err);
    for (l = 0; l < MODEL.layers; l++) shapes[l].m = O.batch / 16, shapes[l].n = MODEL.width[l + 1], shapes[l].k = MODEL.width[l];
    blas_kernel_ensure(argv, shapes, MODEL.layers, PROG, &BLAS);
    printf("BLAS: %s, 1 thread per stage\n", BLAS.line);
    fflush(stdout);
}

static void load(void) {
    mlp_data test;
    char err[512], desc[256];
    float mean, sd;
    if (mlp_data_load_fashion(O.data, &TRAIN, &test, err, sizeof err) != 0) die("%s", err);
    mlp_data_free(&test);
    mlp_data_stats(&TRAIN, &mean, &sd);
    mlp_data_normalize(&TRAIN, mean, sd);
    mlp_data_truncate(&TRAIN, O.limit);
    if (TRAIN.n < 3 * O.batch * O.rounds) die("--limit %d: too few samples for 3 pipelines x %d rounds x %d", TRAIN.n, O.rounds, O.batch);
    if (mlp_model_parse(&MODEL, TRAIN.dim, O.hidden, O.stages, err, sizeof err) != 0) die("%s", err);
    mlp_model_describe(&MODEL, desc, sizeof desc);
    printf(PROG ": model %s\n", desc);
    printf("S=%d stage threads on %ld cores%s, batch %d per pipeline, R=%d %s rounds per iteration, %d training samples; %d passes in random "
           "order, %d + %d iterations per visit, visits redone while other programs use >= %.2f cores\n",
           O.stages, sysconf(_SC_NPROCESSORS_ONLN), O.stages > sysconf(_SC_NPROCESSORS_ONLN) ? " (more stage threads than cores)" : "",
           O.batch, O.rounds, O.continuous ? "continuous" : "synchronous", TRAIN.n, O.passes, O.warmup, O.iters, O.max_others);
}

static void print_model(const avgpipe_cost_model *m) {
    int g, K = AVGPIPE_OP_KIND_COUNT;
    printf("fitted cost model (op time = a + b x samples, us; STEP constant):\n");
    for (g = 0; g < m->nstages; g++)
        printf("  stage %d: F %.1f + %.2f x, B %.1f + %.2f x, STEP %.1f\n", g, 1e6 * m->a[g * K + AVGPIPE_OP_F], 1e6 * m->b[g * K + AVGPIPE_OP_F],
               1e6 * m->a[g * K + AVGPIPE_OP_B], 1e6 * m->b[g * K + AVGPIPE_OP_B], 1e6 * m->a[g * K + AVGPIPE_OP_STEP]);
    printf("  transfer latency %.1f us, runtime overhead %.1f us per op and %.1f us per iteration, averaging %.3f ns per parameter; "
           "%g cores shared by the stage and averaging threads\n", 1e6 * m->latency, 1e6 * m->op_overhead, 1e6 * m->iter_overhead,
           1e9 * m->avg_per_float, m->cores);
    if (m->busy_cores > 0)
        printf("  the profile's stage threads got through %.2f cores' worth of work at most (busy_cores)%s\n", m->busy_cores,
               m->nstages > m->cores && m->busy_cores < m->cores ? ": the cores bound with more stage threads than cores" : "");
}

int main(int argc, char **argv) {
    static const avgpipe_sched_kind kinds[] = {AVGPIPE_SCHED_1F1B, AVGPIPE_SCHED_ADVANCE, AVGPIPE_SCHED_AFAB, AVGPIPE_SCHED_ZBH1};
    static const int micros[] = {2, 4, 8, 16};
    static setting grid[MAXSET + 2], profiled[2]; /* grid: the 48 settings, then maybe the overall choice and a copy of the best */
    avgpipe_context ctx;
    char prof[] = "/tmp/" PROG "_profile_XXXXXX";
    int ng, nall, i, j, g, fd, cand_n, full_n, pass, best_meas = 0, best_trim = 0, pick = -1, overall = -1, mem_exact = 1, met = 0;
    int redone = 0, order[MAXSET + 2 * PROFILE_VISITS];
    unsigned state;
    double load0, load1, grid_time = 0, t_prof, t_fit, t_search, t_full, mae = 0, meas[MAXSET], trim[MAXSET], pred[MAXSET], rho, rho_t;
    double regret, regret_t, others_start;
    long ncores;
    avgpipe_profile p;
    avgpipe_cost_model m;
    avgpipe_tune_desc td;
    avgpipe_tune_candidate *cand;

    parse(argc, argv);
    ensure_kernel(argv);
    load0 = loadavg();
    others_start = quiet_wait(O.max_others, 30);
    ncores = sysconf(_SC_NPROCESSORS_ONLN);
    openblas_set_num_threads(1);
    avgpipe_context_init(&ctx, NULL);
    load();

    /* 1. The grid and the profiled setting, measured together in passes: each pass visits every grid
          setting once, in its own random order, and the profile's visits (PROFILE_VISITS per size, their
          timed iterations' profiles into one file) are spread over the passes among them, so that the
          fit and the grid see the machine alike (a fast or slow spell does not land on the profile alone). */
    if ((fd = mkstemp(prof)) < 0) die("mkstemp: %s", strerror(errno));
    close(fd);
    profile_settings(profiled);
    for (ng = 0, i = 0; i < 4; i++)
        for (j = 0; j < 4; j++)
            for (g = 1; g <= 3; g++) {
                setting *s = &grid[ng++];
                memset(s, 0, sizeof *s);
                s->kind = kinds[i], s->micro = micros[j], s->pipes = g;
                s->advance = kinds[i] == AVGPIPE_SCHED_ADVANCE ? 1 : 0;
                s->continuous = O.continuous;
            }
    state = O.seed * 2654435761u + 7u;
    for (pass = 0; pass < O.passes; pass++) {
        int n = 0;
        for (i = 0; i < ng; i++) order[n++] = i;
        for (i = 0; i < 2; i++)
            for (j = 0; j < PROFILE_VISITS; j++)
                if (profile_visit_in(pass, i, j)) order[n++] = PROFILED + i;
        shuffle(order, n, &state);
        for (i = 0; i < n; i++) {
            if (order[i] >= PROFILED) measure(&ctx, &profiled[order[i] - PROFILED], prof, &redone);
            else measure(&ctx, &grid[order[i]], NULL, &redone);
        }
    }
    profile_averaging(&ctx, prof);
    t_prof = profiled[0].wall + profiled[1].wall;
    printf("profiled advance K=1 N=2 at M=4 and M=8 (%d and %d samples per micro-batch): %d visits each among the grid's passes, "
           "%.1f s\n", O.batch / 4, O.batch / 8, PROFILE_VISITS, t_prof);

    /* 2. Fit and search (timed: the tuning cost). */
    t_fit = now();
    if (avgpipe_profile_load(&ctx, prof, &p) != AVGPIPE_OK || avgpipe_tune_fit(&ctx, &p, &m) != AVGPIPE_OK)
        die("%s", avgpipe_last_error(&ctx));
    m.cores = (double)ncores; /* the stage threads and their averaging threads share the cores */
    t_fit = now() - t_fit;
    remove(prof);
    memset(&td, 0, sizeof td);
    td.batch = O.batch;
    td.max_pipes = 3;
    td.rounds = O.rounds;
    td.opt_bytes_per_param = 8; /* Adam */
    t_full = now();             /* the default search space: every M dividing B */
    if (avgpipe_tune_search(&ctx, &m, &td, &cand, &full_n) != AVGPIPE_OK) die("search: %s", avgpipe_last_error(&ctx));
    t_full = now() - t_full;
    avgpipe_free(&ctx, cand);
    td.min_micro = O.batch / 16; /* the grid's micro-batch sizes and larger */
    t_search = now();
    if (avgpipe_tune_search(&ctx, &m, &td, &cand, &cand_n) != AVGPIPE_OK) die("search: %s", avgpipe_last_error(&ctx));
    t_search = now() - t_search;
    print_model(&m);

    /* 3. The tuner's overall choice: a grid setting, or measured now in --passes visits that alternate with
          visits of the grid's best so far (a fresh copy): their ratio is measured in one stretch of time. */
    for (i = 0; i < ng; i++) summarise(&grid[i]);
    for (i = 0; i < ng && overall < 0; i++)
        if (same(&cand[0], &grid[i])) overall = i;
    nall = ng;
    if (overall < 0) {
        setting *s = &grid[ng], *b = &grid[ng + 1];
        for (i = 1; i < ng; i++)
            if (grid[i].measured < grid[best_meas].measured) best_meas = i;
        memset(s, 0, sizeof *s);
        s->kind = cand[0].sched.kind, s->micro = cand[0].sched.micro, s->pipes = cand[0].sched.pipes;
        s->advance = cand[0].sched.advance, s->continuous = cand[0].sched.continuous;
        *b = grid[best_meas];
        b->ntimes = b->nvisits = b->redone = 0, b->wall = 0;
        for (pass = 0; pass < O.passes; pass++) {
            measure(&ctx, pass % 2 ? b : s, NULL, &redone);
            measure(&ctx, pass % 2 ? s : b, NULL, &redone);
        }
        summarise(s);
        summarise(b);
        overall = ng;
        nall = ng + 2;
        best_meas = 0;
    }
    printf("\n%-8s %2s %3s %2s %11s %11s %11s %8s %6s %6s %12s %12s %s\n", "schedule", "K", "M", "N", "median_us", "trimmed_us", "pred_us",
           "error", "p90", "passes", "pred_peak", "runtime_peak", "redone");
    for (i = 0; i < ng; i++) {
        setting *s = &grid[i];
        avgpipe_sched_desc sd = sched_of(s);
        double sec;
        grid_time += s->wall;
        if (avgpipe_tune_predict(&ctx, &m, &sd, (double)O.batch / s->micro, &sec) != AVGPIPE_OK) die("%s", avgpipe_last_error(&ctx));
        s->predicted = sec / ((double)O.rounds * s->pipes * O.batch);
        for (j = 0; j < cand_n; j++) /* the search's own memory figure for this setting */
            if (same(&cand[j], s)) s->pred_peak = cand[j].peak_bytes;
        mem_exact &= s->pred_peak == s->real_peak;
        meas[i] = s->measured, trim[i] = s->trimmed, pred[i] = s->predicted;
        mae += fabs(s->predicted / s->measured - 1) / ng;
        if (s->measured < grid[best_meas].measured) best_meas = i;
        if (s->trimmed < grid[best_trim].trimmed) best_trim = i;
        printf("%-8s %2d %3d %2d %11.2f %11.2f %11.2f %+7.1f%% %6.2f %6.2f %12.0f %12.0f %d\n", avgpipe_sched_kind_name(s->kind), s->advance,
               s->micro, s->pipes, 1e6 * s->measured, 1e6 * s->trimmed, 1e6 * s->predicted, 100 * (s->predicted / s->measured - 1), s->p90,
               s->pass_spread, s->pred_peak, s->real_peak, s->redone);
    }
    printf("(times per sample; p90: 90th percentile of the timed iterations over their median; passes: slowest pass median over the "
           "fastest; kernel %s)\n", BLAS.kernel);

    /* 4. The tuner's choice within the grid: the first of its ranking that the grid holds. */
    for (j = 0; j < cand_n && pick < 0; j++)
        for (i = 0; i < ng; i++)
            if (same(&cand[j], &grid[i])) {
                pick = i;
                break;
            }
    if (pick < 0) die("the search's ranking holds no grid setting");
    rho = spearman(meas, pred, ng);
    rho_t = spearman(trim, pred, ng);
    regret = grid[pick].measured / grid[best_meas].measured - 1;
    regret_t = grid[pick].trimmed / grid[best_trim].trimmed - 1;

    printf("\nmean absolute relative error of the predictions: %.1f%% (over %d settings)\n", 100 * mae, ng);
    printf("Spearman rank correlation, predicted vs measured: %.3f on medians (target >= 0.9: %s), %.3f on trimmed means\n", rho,
           rho >= 0.9 ? "met" : "NOT met", rho_t);
    met += rho >= 0.9;
    printf("tuner's choice within the grid: %s K=%d M=%d N=%d, measured %.2f us/sample (predicted %.2f); best measured: %s K=%d "
           "M=%d N=%d, %.2f us/sample [kernel %s]\n", avgpipe_sched_kind_name(grid[pick].kind), grid[pick].advance, grid[pick].micro,
           grid[pick].pipes, 1e6 * grid[pick].measured, 1e6 * grid[pick].predicted, avgpipe_sched_kind_name(grid[best_meas].kind),
           grid[best_meas].advance, grid[best_meas].micro, grid[best_meas].pipes, 1e6 * grid[best_meas].measured, BLAS.kernel);
    printf("regret: %.1f%% on medians (target <= 5%%: %s), %.1f%% on trimmed means\n", 100 * regret, regret <= 0.05 ? "met" : "NOT met",
           100 * regret_t);
    met += regret <= 0.05;
    {
        /* against the grid's best: in the grid, or the copy measured alternately with the choice */
        const setting *vs = overall == ng ? &grid[ng + 1] : &grid[best_meas];
        printf("tuner's overall choice (%d candidates: M dividing %d with >= %d samples, N <= 3): %s K=%d M=%d N=%d %s, predicted %.2f "
               "us/sample, measured %.2f (%+.1f%% vs the best measured in the grid, %s K=%d M=%d N=%d%s) [kernel %s]\n", cand_n, O.batch,
               O.batch / 16, avgpipe_sched_kind_name(cand[0].sched.kind), cand[0].sched.advance, cand[0].sched.micro, cand[0].sched.pipes,
               cand[0].sched.continuous ? "continuous" : "synchronous", 1e6 * cand[0].time_per_sample, 1e6 * grid[overall].measured,
               100 * (grid[overall].measured / vs->measured - 1), avgpipe_sched_kind_name(vs->kind), vs->advance, vs->micro, vs->pipes,
               overall == ng ? ", measured again alternately with it" : "", BLAS.kernel);
    }
    printf("tuning time: fit %.1f ms + search %.1f ms = %.3f%% of the %.1f s the grid took to measure (target < 1%%: %s)\n",
           1e3 * t_fit, 1e3 * t_search, 100 * (t_fit + t_search) / grid_time, grid_time,
           (t_fit + t_search) < 0.01 * grid_time ? "met" : "NOT met");
    printf("  (the default search, down to 1 sample per micro-batch: %d candidates in %.1f ms, %.3f%% of the grid's time)\n", full_n,
           1e3 * t_full, 100 * (t_fit + t_full) / grid_time);
    met += (t_fit + t_search) < 0.01 * grid_time;
    printf("memory: predicted peak bytes per rank (runtime buffers + weights + Adam state) %s the runtime's for every setting\n",
           mem_exact ? "equal" : "DIFFER from");
    load1 = loadavg();
    printf("noise: %d visits redone because other programs used >= %.2f cores (%d visits in all); other programs used %.2f cores "
           "before the start; 1-minute load average %.1f at the start, %.1f at the end (%ld cores)\n", redone, O.max_others,
           O.passes * nall + 2 * PROFILE_VISITS + redone, others_start, load0, load1, ncores);
    printf("targets met: %d of 3\n", met);
    avgpipe_free(&ctx, cand);
    avgpipe_tune_cost_model_free(&ctx, &m);
    avgpipe_profile_free(&ctx, &p);
    mlp_data_free(&TRAIN);
    return 0;
}
