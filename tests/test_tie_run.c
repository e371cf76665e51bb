/* Tests of ties and step agreement at run time (avgpipe.h sections 15-16): a small tied, clipped model
   trained by the runtime under every schedule kind, against a plain loop that sums each tie at the
   step and clips by the same global norm (parameters bit for bit); the tied copies identical after
   every iteration; ranks split over several runs sharing one comm backend, as processes do (the
   threads' bits); on an asynchronous device, and on one whose memory the host cannot touch
   (tests/opaque_device.h); checkpoint and resume; a non-finite gradient skipping one pipeline's step on every
   partition and nothing else; the user's contribution summed in partition order; bad descriptions
   refused naming the field.

   The model: every partition holds E (D x D), W (D x D) and b (D). Partition 0 embeds its input
   (u = E x), every partition computes y = tanh(W u + b), the last one projects with E's transpose
   (l = E^T y, the tied head) and takes the squared error against a target. Ties: E of partition 0
   with E of the last partition (GPT-2's wte); with four partitions or more also b of partition 1 with
   b of partition G-2 (on one rank under V placement: no bytes move). Weight gradients are kept per
   micro-batch and summed in micro-batch order into the gradient buffer the runtime sees, once the
   last micro-batch of the round went back, so every schedule must give the loop's bits.
   Variable shapes (desc.variable_bytes): micro-batch (model, round, micro) has rows(...) of the BS
   rows, 1 .. BS; each forward sets output_bytes to its rows and each consumer takes its row count
   from input_bytes / grad_output_bytes (checked against rows()), so a size lost on the way fails. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS (tests/opaque_device.h) */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tests/opaque_device.h" /* and tests/async_device.h, which it builds on */

#define D 6
#define BS 3
#define PC (2 * D * D + D)
#define OFF_W (D * D)
#define OFF_B (2 * D * D)
#define MAXG 8
#define MAXN 2
#define MAXM 8
#define MAXSLOT 64
#define MAXR 64
#define LR 0.05f
#define CLIP 0.25

/* The model's arithmetic, exact whatever flags this file is built with (the runtime's callbacks and
   the plain loop run it in different places). */
AVGPIPE__FP_EXACT_BEGIN

typedef struct stash {
    int valid, model, round, micro, n; /* n: rows of this micro-batch */
    float x[BS * D], u[BS * D], y[BS * D], l[BS * D];
} stash;

static struct {
    int G, M, N, S;
    float w[MAXN][MAXG][PC];
    float grad[MAXN][MAXG][PC];
    float gacc[MAXN][MAXG][MAXM][PC];
    int nback[MAXN][MAXG];
    stash st[MAXG][MAXSLOT];
    unsigned char skipped[MAXN][MAXG][MAXR]; /* what step_agreed was told */
    long nstep[MAXN][MAXG];
    int nan_model, nan_stage, nan_round;     /* a NaN into that backward's gradient (micro-batch 0) */
    int contribute;                          /* agree.width 1: each partition contributes stage + 1 */
    int size_fault;                          /* stage 0's forward of round 1: 1 output_bytes over act_bytes */
    char err[MAXG][160];
} T;

static int bad(int g, int code, const char *what) {
    if (!T.err[g][0]) snprintf(T.err[g], sizeof T.err[g], "%s", what);
    return code;
}

static void gen_input(int model, int round, int micro, float *x) {
    int i;
    for (i = 0; i < BS * D; i++) x[i] = (float)sin(0.7 * model + 0.31 * round + 0.53 * micro + 0.19 * i * (i % 5 + 1) + 0.2);
}
static int rows(int model, int round, int micro) { return 1 + (model * 7 + round * 3 + micro * 5) % BS; }
static float target(int model, int round, int micro, int i) { return (float)cos(0.9 * model + 0.23 * round + 0.41 * micro + 0.37 * i); }
static void init_params(int g, int G, float *p) {
    int j;
    for (j = 0; j < PC; j++) p[j] = (float)(0.5 * sin(12.9898 * (g * PC + j + 1) + 78.233 * g));
    if (g == G - 1 && G > 1) /* the tied copies start alike: E of the last partition is partition 0's */
        for (j = 0; j < D * D; j++) p[j] = (float)(0.5 * sin(12.9898 * (j + 1)));
    if (G >= 4 && g == G - 2) /* and b of partition G-2 is partition 1's */
        for (j = 0; j < D; j++) p[OFF_B + j] = (float)(0.5 * sin(12.9898 * (PC + OFF_B + j + 1) + 78.233));
}

/* Stage forward: x (n x D) -> s's u, y (and logits l on the last stage); returns the loss there. */
static double fwd(int g, int G, const float *p, const float *x, stash *s, float *out, int model, int round, int micro, int n) {
    int b, i, j;
    double loss = 0;
    s->n = n;
    memcpy(s->x, x, sizeof(float) * D * (size_t)n);
    for (b = 0; b < n; b++) {
        const float *xb = x + b * D;
        float *u = s->u + b * D, *y = s->y + b * D;
        for (i = 0; i < D; i++) {
            float a = 0;
            if (g == 0)
                for (j = 0; j < D; j++) a += p[i * D + j] * xb[j];
            u[i] = g == 0 ? a : xb[i];
        }
        for (i = 0; i < D; i++) {
            float a = p[OFF_B + i];
            for (j = 0; j < D; j++) a += p[OFF_W + i * D + j] * u[j];
            y[i] = tanhf(a);
        }
        if (g == G - 1)
            for (j = 0; j < D; j++) {
                float a = 0, e;
                for (i = 0; i < D; i++) a += p[i * D + j] * y[i];
                s->l[b * D + j] = a;
                e = a - target(model, round, micro, b * D + j);
                loss += 0.5 * (double)e * (double)e / n;
            }
        else if (out)
            memcpy(out + b * D, y, sizeof(float) * D);
    }
    return loss;
}

/* Stage backward from s: gy (NULL on the last stage) -> gx (NULL on stage 0), gradients into ga. */
static void bwd(int g, int G, const float *p, const stash *s, const float *gy_in, float *gx, float *ga, int model, int round, int micro) {
    int b, i, j;
    for (b = 0; b < s->n; b++) {
        const float *y = s->y + b * D, *u = s->u + b * D, *x = s->x + b * D;
        float gy[D], gh[D], gu[D];
        if (g == G - 1) {
            float gl[D];
            for (j = 0; j < D; j++) gl[j] = (s->l[b * D + j] - target(model, round, micro, b * D + j)) / (float)s->n;
            for (i = 0; i < D; i++) {
                float a = 0;
                for (j = 0; j < D; j++) {
                    a += p[i * D + j] * gl[j];
                    ga[i * D + j] += y[i] * gl[j];
                }
                gy[i] = a;
            }
        } else
            memcpy(gy, gy_in + b * D, sizeof gy);
        for (i = 0; i < D; i++) gh[i] = gy[i] * (1 - y[i] * y[i]);
        for (i = 0; i < D; i++) {
            for (j = 0; j < D; j++) ga[OFF_W + i * D + j] += gh[i] * u[j];
            ga[OFF_B + i] += gh[i];
        }
        for (j = 0; j < D; j++) {
            float a = 0;
            for (i = 0; i < D; i++) a += p[OFF_W + i * D + j] * gh[i];
            gu[j] = a;
        }
        if (g == 0)
            for (i = 0; i < D; i++)
                for (j = 0; j < D; j++) ga[i * D + j] += gu[i] * x[j];
        else
            memcpy(gx + b * D, gu, sizeof gu);
    }
}

/* The round's gradient: the micro-batches' in order. */
static void sum_micro(float (*gacc)[PC], int M, float *grad) {
    int m, j;
    for (j = 0; j < PC; j++) {
        float a = 0;
        for (m = 0; m < M; m++) a += gacc[m][j];
        grad[j] = a;
    }
    memset(gacc, 0, sizeof(float) * PC * (size_t)M);
}

static void sgd(float *p, float *grad, double scale, int skip) {
    float s = (float)scale;
    int j;
    for (j = 0; j < PC && !skip; j++) p[j] -= LR * (s * grad[j]);
    memset(grad, 0, sizeof(float) * PC);
}
AVGPIPE__FP_EXACT_END

/* ---- the callbacks ---------------------------------------------------------------------------- */

static int model_of(const avgpipe_op_ctx *op) { return op->replica * T.N + op->pipe; }

static int cb_forward(avgpipe_op_ctx *op) {
    float xb[BS * D];
    stash *s;
    int g = op->stage, n = rows(model_of(op), op->round, op->micro);
    if (op->slot < 0 || op->slot >= MAXSLOT) return bad(g, 90, "slot out of range");
    s = &T.st[g][op->slot];
    if (s->valid) return bad(g, 91, "forward into a slot in use");
    if (g > 0 && op->input_bytes != sizeof(float) * D * (size_t)n) return bad(g, 97, "input_bytes is not the producer's size");
    if (g + 1 < T.G && op->output_bytes != sizeof(float) * D * BS) return bad(g, 98, "output_bytes is not preset to act_bytes");
    s->valid = 1, s->model = model_of(op), s->round = op->round, s->micro = op->micro;
    if (g == 0) gen_input(model_of(op), op->round, op->micro, xb);
    op->loss = fwd(g, T.G, op->params, g == 0 ? xb : (const float *)op->input, s, (float *)op->output, model_of(op), op->round, op->micro,
                   g == 0 ? n : (int)(op->input_bytes / (sizeof(float) * D)));
    if (g + 1 < T.G) op->output_bytes = sizeof(float) * D * (size_t)n;
    if (T.size_fault && g == 0 && op->round == 1) op->output_bytes = sizeof(float) * D * BS + 4;
    return 0;
}

static int cb_backward(avgpipe_op_ctx *op) {
    int g = op->stage, m = model_of(op);
    stash *s = &T.st[g][op->slot];
    if (!s->valid || s->model != m || s->round != op->round || s->micro != op->micro) return bad(g, 92, "backward without its forward");
    if ((g + 1 < T.G && op->grad_output_bytes != sizeof(float) * D * (size_t)s->n) || (g > 0 && op->grad_input_bytes != op->input_bytes))
        return bad(g, 99, "grad_output_bytes is not the gradient's size, or grad_input_bytes not preset to input_bytes");
    if (g > 0) op->grad_input_bytes = sizeof(float) * D * (size_t)s->n;
    bwd(g, T.G, op->params, s, (const float *)op->grad_output, (float *)op->grad_input, T.gacc[m][g][op->micro], m, op->round, op->micro);
    if (m == T.nan_model && g == T.nan_stage && op->round == T.nan_round && op->micro == 0) T.gacc[m][g][0][OFF_W + 3] = NAN;
    s->valid = 0;
    if (++T.nback[m][g] == T.M) { /* the round's last micro-batch went back */
        T.nback[m][g] = 0;
        sum_micro(T.gacc[m][g], T.M, T.grad[m][g]);
    }
    return 0;
}

/* Slot 0: stage + 1. Slot 1: 1e16 on stage 0, 1 on stage 1, -1e16 on the last: 0 in partition order
   ((1e16 + 1) rounds to 1e16), 1 in the order of a V placement's ranks (0, G-1, 1, ...). */
static int cb_contribute(const avgpipe_step_ctx *st, double *out) {
    int g = st->stage;
    if (st->agreed) return bad(g, 93, "contribute saw a result");
    out[0] = g + 1;
    out[1] = g == 0 ? 1e16 : g == T.G - 1 ? -1e16 : g == 1 ? 1 : 0;
    return 0;
}

static int cb_step_agreed(const avgpipe_step_ctx *st) {
    int m = st->replica * T.N + st->pipe, g = st->stage;
    if (st->params != T.w[m][g] || st->grads != T.grad[m][g] || st->count != PC) return bad(g, 94, "step got another partition");
    if (T.contribute && (!st->agreed || st->width != 2 || st->agreed[0] != T.G * (T.G + 1) / 2.0))
        return bad(g, 95, "the agreed sum of the contributions is not 1 + 2 + ... + G");
    if (T.contribute && st->agreed[1] != 0) return bad(g, 96, "the contributions were not summed in partition order");
    if (st->round >= 0 && st->round < MAXR) T.skipped[m][g][st->round] = (unsigned char)(st->skip ? 1 : 2);
    sgd(st->params, st->grads, st->scale, st->skip);
    T.nstep[m][g]++;
    return 0;
}

/* ---- the plain loop --------------------------------------------------------------------------- */

static void tie_list(int G, avgpipe_tie *ties, int *n) {
    *n = 0;
    if (G < 2) return;
    ties[(*n)++] = (avgpipe_tie){0, G - 1, 0, 0, D * D};
    if (G >= 4) ties[(*n)++] = (avgpipe_tie){G - 2, 1, OFF_B, OFF_B, D}; /* given high stage first: either order */
}

/* Round `round` of model m of G partitions (w, grads), as the runtime is to compute it. */
static void reference_round(float (*w)[PC], int G, int M, int m, int round, int skip_nonfinite) {
    static float gacc[MAXG][MAXM][PC], grad[MAXG][PC];
    static stash s[MAXG];
    float a[MAXG + 1][BS * D], gy[BS * D], gx[BS * D];
    avgpipe_tie ties[2];
    double parts[MAXG * 2] = {0}, tot[2], scale;
    int mi, g, t, nt, k;
    tie_list(G, ties, &nt);
    memset(gacc, 0, sizeof gacc);
    for (mi = 0; mi < M; mi++) {
        gen_input(m, round, mi, a[0]);
        for (g = 0; g < G; g++) fwd(g, G, w[g], a[g], &s[g], a[g + 1], m, round, mi, rows(m, round, mi));
        for (g = G - 1; g >= 0; g--) {
            bwd(g, G, w[g], &s[g], gy, gx, gacc[g][mi], m, round, mi);
            memcpy(gy, gx, sizeof gy);
        }
        if (m == T.nan_model && round == T.nan_round && mi == 0) gacc[T.nan_stage][0][OFF_W + 3] = NAN;
    }
    for (g = 0; g < G; g++) sum_micro(gacc[g], M, grad[g]);
    for (t = 0; t < nt; t++) /* the tie at the step: both copies get a + b */
        for (k = 0; k < (int)ties[t].count; k++) {
            float *x = &grad[ties[t].stage_a][ties[t].offset_a + k], *y = &grad[ties[t].stage_b][ties[t].offset_b + k];
            *x = *y = *x + *y;
        }
    for (g = 0; g < G; g++) { /* each partition's sum of squares, a tied range on its higher side left out */
        size_t at = 0;
        parts[2 * g] = parts[2 * g + 1] = 0;
        for (t = 0; t < nt; t++) {
            int hi = ties[t].stage_a > ties[t].stage_b ? ties[t].stage_a : ties[t].stage_b;
            size_t off = ties[t].stage_a > ties[t].stage_b ? ties[t].offset_a : ties[t].offset_b;
            if (hi != g) continue;
            avgpipe_grad_sumsq(grad[g] + at, off - at, &parts[2 * g], &parts[2 * g + 1]);
            at = off + ties[t].count;
        }
        avgpipe_grad_sumsq(grad[g] + at, PC - at, &parts[2 * g], &parts[2 * g + 1]);
    }
    avgpipe_agree_combine(parts, G, 2, tot);
    scale = avgpipe_clip_scale(tot[0], CLIP);
    for (g = 0; g < G; g++) sgd(w[g], grad[g], scale, skip_nonfinite && tot[1] > 0);
}

/* ---- running ---------------------------------------------------------------------------------- */

typedef struct setup {
    avgpipe_run_desc d;
    size_t act[MAXG], pc[MAXG];
    float *params[MAXN * MAXG], *grads[MAXN * MAXG];
    avgpipe_tie ties[2];
} setup;

static void setup_init(setup *s, avgpipe_sched_kind kind, int S, int V, int M, int N) {
    int G = S * (V > 0 ? V : 1), g, i, nt;
    if (kind == AVGPIPE_SCHED_ZBV || kind == AVGPIPE_SCHED_DUALPIPEV) G = 2 * S;
    memset(&T, 0, sizeof T);
    memset(s, 0, sizeof *s);
    T.G = G, T.M = M, T.N = N, T.S = S;
    T.nan_model = T.nan_stage = T.nan_round = -1;
    for (i = 0; i < N; i++)
        for (g = 0; g < G; g++) init_params(g, G, T.w[i][g]);
    for (g = 0; g < G; g++) {
        s->act[g] = sizeof(float) * BS * D;
        s->pc[g] = PC;
        for (i = 0; i < N; i++) s->params[i * G + g] = T.w[i][g], s->grads[i * G + g] = T.grad[i][g];
    }
    tie_list(G, s->ties, &nt);
    s->d.sched.kind = kind, s->d.sched.stages = S, s->d.sched.chunks = V, s->d.sched.micro = M, s->d.sched.pipes = N;
    s->d.sched.advance = kind == AVGPIPE_SCHED_ADVANCE ? 1 : 0;
    s->d.cb.forward = cb_forward;
    s->d.cb.backward = cb_backward;
    s->d.cb.step_agreed = cb_step_agreed;
    s->d.act_bytes = s->act;
    s->d.params = s->params;
    s->d.param_count = s->pc;
    s->d.grads = s->grads;
    s->d.ties = nt ? s->ties : NULL;
    s->d.nties = nt;
    s->d.agree.clip_norm = CLIP;
    s->d.agree.skip_nonfinite = 1;
    s->d.averaging.alpha = AVGPIPE_ZERO; /* N models train on their own: each is its own plain loop */
    s->d.timeout_s = 20;
    s->d.variable_bytes = 1; /* micro-batches of rows() rows */
}

static void no_callback_error(const char *name) {
    int g;
    for (g = 0; g < T.G; g++) cr_assert(!T.err[g][0], "%s: stage %d callback: %s", name, g, T.err[g]);
}

static void ties_identical(const char *name, int it) {
    avgpipe_tie ties[2];
    int nt, t, m;
    tie_list(T.G, ties, &nt);
    for (m = 0; m < T.N; m++)
        for (t = 0; t < nt; t++)
            cr_assert(memcmp(&T.w[m][ties[t].stage_a][ties[t].offset_a], &T.w[m][ties[t].stage_b][ties[t].offset_b], ties[t].count * sizeof(float)) == 0,
                      "%s, iteration %d, model %d: the two copies of tie %d differ", name, it, m, t);
}

/* ITERS iterations of R rounds; every model equals its plain loop bit for bit after each. */
#define ITERS 3
static void equal_to_plain_loop(avgpipe_sched_kind kind, int S, int V, int M, int N, int R, const char *name) {
    static float ref[MAXN][MAXG][PC];
    setup s;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_run_stats st;
    avgpipe_result res;
    int it, m, g, r;
    char nm[96];
    setup_init(&s, kind, S, V, M, N);
    s.d.sched.rounds = R;
    if (kind == AVGPIPE_SCHED_DUALPIPEV && M * N < 2 * S) s.d.sched.micro = T.M = M = (2 * S + N - 1) / N; /* its minimum */
    cr_assert(M <= MAXM && T.G <= MAXG);
    snprintf(nm, sizeof nm, "%s S=%d M=%d N=%d R=%d", name, S, M, N, R);
    memcpy(ref, T.w, sizeof ref);
    avgpipe_context_init(&ctx, NULL);
    res = avgpipe_run_create(&ctx, &s.d, &run);
    cr_assert_eq(res, AVGPIPE_OK, "%s: create: %s", nm, avgpipe_last_error(&ctx));
    for (it = 0; it < ITERS; it++) {
        res = avgpipe_run_iteration(run, &st);
        no_callback_error(nm);
        cr_assert_eq(res, AVGPIPE_OK, "%s: iteration %d: %s", nm, it, avgpipe_last_error(&ctx));
        cr_assert_eq(st.skipped, 0, "%s: %lld steps skipped", nm, st.skipped);
        for (m = 0; m < N; m++)
            for (r = 0; r < R; r++) reference_round(ref[m], T.G, M, m, it * R + r, 1);
        for (m = 0; m < N; m++)
            for (g = 0; g < T.G; g++)
                cr_assert(memcmp(T.w[m][g], ref[m][g], sizeof ref[m][g]) == 0, "%s, iteration %d, model %d, stage %d: not the plain loop's bits",
                          nm, it, m, g);
        ties_identical(nm, it);
    }
    {
        float p0[PC];
        init_params(0, T.G, p0);
        cr_assert(memcmp(p0, T.w[0][0], sizeof p0) != 0, "%s: nothing trained", nm);
    }
    avgpipe_run_destroy(run);
}

static void every_shape(avgpipe_sched_kind kind, int V, const char *name) {
    int S, mi, M[3] = {1, 2, 4};
    for (S = 2; S <= 4; S++)
        for (mi = 0; mi < 3; mi++) {
            if (kind == AVGPIPE_SCHED_INTERLEAVED && M[mi] % S) continue; /* interleaved needs M a multiple of S */
            equal_to_plain_loop(kind, S, V, M[mi], 1, 1, name);
        }
}

TestSuite(tie_run, .timeout = 120);

Test(tie_run, afab) { every_shape(AVGPIPE_SCHED_AFAB, 0, "afab"); }
Test(tie_run, one_f_one_b) { every_shape(AVGPIPE_SCHED_1F1B, 0, "1f1b"); }
Test(tie_run, advance) { every_shape(AVGPIPE_SCHED_ADVANCE, 0, "advance K=1"); }
Test(tie_run, interleaved) { every_shape(AVGPIPE_SCHED_INTERLEAVED, 2, "interleaved V=2"); }
Test(tie_run, zbh1) { every_shape(AVGPIPE_SCHED_ZBH1, 0, "zbh1"); }
Test(tie_run, zbv) { every_shape(AVGPIPE_SCHED_ZBV, 0, "zbv"); }
Test(tie_run, dualpipev) { every_shape(AVGPIPE_SCHED_DUALPIPEV, 0, "dualpipev"); }
Test(tie_run, two_pipelines_two_rounds) {
    equal_to_plain_loop(AVGPIPE_SCHED_1F1B, 3, 0, 4, 2, 2, "1f1b");
    equal_to_plain_loop(AVGPIPE_SCHED_ZBV, 2, 0, 2, 2, 2, "zbv");
}
Test(tie_run, one_stage_no_ties) { equal_to_plain_loop(AVGPIPE_SCHED_1F1B, 1, 0, 2, 1, 1, "1f1b"); }

/* The user's own contribution, summed in partition order (the step checks; see cb_contribute). */
Test(tie_run, contribution_summed_over_partitions) {
    setup s;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    setup_init(&s, AVGPIPE_SCHED_ZBV, 3, 0, 3, 2);
    T.contribute = 1;
    s.d.agree.width = 2;
    s.d.agree.contribute = cb_contribute;
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    no_callback_error("contribute");
    cr_assert_eq(T.nstep[1][5], 1);
    avgpipe_run_destroy(run);
}

/* A NaN in one partition's gradient at (pipeline 1, round 2) skips that pipeline's step on every
   partition in that round and nothing else; the reference stays finite; the skip is counted. */
Test(tie_run, non_finite_gradient_skips_the_pipelines_step) {
    static float ref[MAXN][MAXG][PC];
    setup s;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_run_stats st;
    int it, m, g, r, G;
    long long skipped = 0;
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 2);
    s.d.averaging.alpha = 0.25f; /* the models are averaged: the skipped one must not poison the reference */
    s.d.deterministic = 1;
    G = T.G;
    T.nan_model = 1, T.nan_stage = 2, T.nan_round = 2;
    memcpy(ref, T.w, sizeof ref);
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (it = 0; it < 4; it++) {
        cr_assert_eq(avgpipe_run_iteration(run, &st), AVGPIPE_OK, "iteration %d: %s", it, avgpipe_last_error(&ctx));
        cr_assert_eq(st.skipped, it == 2, "iteration %d: %lld skipped", it, st.skipped);
        skipped += st.skipped;
        no_callback_error("nan");
    }
    for (m = 0; m < 2; m++)
        for (g = 0; g < G; g++)
            for (r = 0; r < 4; r++)
                cr_assert_eq(T.skipped[m][g][r], m == 1 && r == 2 ? 1 : 2, "model %d stage %d round %d: step %s", m, g, r,
                             T.skipped[m][g][r] == 1 ? "skipped" : "not skipped");
    for (g = 0; g < G; g++) {
        const float *z = avgpipe_run_reference(run, g, NULL);
        size_t j;
        for (j = 0; j < PC; j++) {
            uint32_t bits; /* a bit test, as -ffast-math folds isfinite */
            memcpy(&bits, &z[j], sizeof bits);
            cr_assert((bits & 0x7f800000u) != 0x7f800000u, "stage %d: reference[%zu] is %g", g, j, (double)z[j]);
        }
    }
    cr_assert_eq(skipped, 1);
    avgpipe_run_destroy(run);
    /* without averaging, the skipping model equals a plain loop that skips the same step */
    setup_init(&s, AVGPIPE_SCHED_ZBV, 2, 0, 2, 2);
    T.nan_model = 1, T.nan_stage = 0, T.nan_round = 1;
    memcpy(ref, T.w, sizeof ref);
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (it = 0; it < 3; it++) {
        cr_assert_eq(avgpipe_run_iteration(run, &st), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        for (m = 0; m < 2; m++) reference_round(ref[m], T.G, 2, m, it, 1);
    }
    for (m = 0; m < 2; m++)
        for (g = 0; g < T.G; g++) cr_assert(memcmp(T.w[m][g], ref[m][g], sizeof ref[m][g]) == 0, "model %d stage %d: not the skipping loop's bits", m, g);
    avgpipe_run_destroy(run);
}

/* ---- processes: one run per rank over one shared in-process backend ---------------------------- */

typedef struct proc {
    avgpipe_run_desc d;
    int rank, iters;
    avgpipe_context ctx;
    avgpipe_result res;
    char msg[AVGPIPE_ERROR_MAX];
} proc;

static void *proc_main(void *arg) {
    proc *p = (proc *)arg;
    avgpipe_run *run = NULL;
    int it;
    avgpipe_context_init(&p->ctx, NULL);
    p->res = avgpipe_run_create(&p->ctx, &p->d, &run);
    for (it = 0; it < p->iters && !p->res; it++) p->res = avgpipe_run_iteration(run, NULL);
    if (p->res) snprintf(p->msg, sizeof p->msg, "%s", avgpipe_last_error(&p->ctx));
    avgpipe_run_destroy(run);
    return NULL;
}

/* A comm that takes only exact sizes (comm.exact_bytes, as NCCL): the in-process one, flagged, its
   sends counted: payloads must move at act_bytes, each followed by an 8-byte size message. */
static avgpipe_result (*inner_isend)(void *, int, int, const void *, size_t, uint32_t, avgpipe_comm_request *);
static long n_payload_short, n_size_msgs;
static avgpipe_result counting_isend(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req) {
    if (tag < (1u << 30) && bytes != sizeof(float) * BS * D) __atomic_add_fetch(&n_payload_short, 1, __ATOMIC_RELAXED);
    return inner_isend(user, self, peer, buf, bytes, tag, req);
}
static avgpipe_result counting_zisend(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req) {
    if (tag >= (3u << 29) && bytes == 8) __atomic_add_fetch(&n_size_msgs, 1, __ATOMIC_RELAXED);
    return inner_isend(user, self, peer, buf, bytes, tag, req);
}
static avgpipe_result counting_split(void *user, int self, const int *members, int count, avgpipe_comm *out);
static avgpipe_result (*inner_split)(void *, int, const int *, int, avgpipe_comm *);
static avgpipe_result counting_split(void *user, int self, const int *members, int count, avgpipe_comm *out) {
    avgpipe_result res = inner_split(user, self, members, count, out);
    if (!res) out->isend = counting_zisend; /* the sizes' (and the ties') communicators: the same in-process isend */
    return res;
}

static void processes_equal_threads_ex(avgpipe_sched_kind kind, int S, int M, int N, int exact, const char *name) {
    static float want[MAXN][MAXG][PC];
    pthread_t th[8];
    proc p[8];
    setup s;
    avgpipe_comm comm;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    int k, m, g;
    setup_init(&s, kind, S, 0, M, N);
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (k = 0; k < 2; k++) cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    avgpipe_run_destroy(run);
    memcpy(want, T.w, sizeof want);
    setup_init(&s, kind, S, 0, M, N);
    cr_assert_eq(avgpipe_comm_local_create(NULL, S, &comm), AVGPIPE_OK);
    n_payload_short = n_size_msgs = 0;
    if (exact) {
        comm.exact_bytes = 1;
        inner_isend = comm.isend, comm.isend = counting_isend;
        inner_split = comm.split, comm.split = counting_split;
    }
    for (k = 0; k < S; k++) {
        memset(&p[k], 0, sizeof p[k]);
        p[k].d = s.d;
        p[k].rank = k;
        p[k].d.local_ranks = &p[k].rank;
        p[k].d.local_count = 1;
        p[k].d.comm = &comm;
        p[k].iters = 2;
        cr_assert_eq(pthread_create(&th[k], NULL, proc_main, &p[k]), 0);
    }
    for (k = 0; k < S; k++) pthread_join(th[k], NULL);
    avgpipe_comm_destroy(&comm);
    no_callback_error(name);
    for (k = 0; k < S; k++) cr_assert_eq(p[k].res, AVGPIPE_OK, "%s: process of rank %d: %s", name, k, p[k].msg);
    for (m = 0; m < N; m++)
        for (g = 0; g < T.G; g++)
            cr_assert(memcmp(T.w[m][g], want[m][g], sizeof want[m][g]) == 0, "%s: model %d stage %d: processes differ from threads", name, m, g);
    if (exact) cr_assert(n_payload_short == 0 && n_size_msgs > 0, "%s: %ld payloads under act_bytes, %ld size messages", name, n_payload_short, n_size_msgs);
}
static void processes_equal_threads(avgpipe_sched_kind kind, int S, int M, int N, const char *name) {
    processes_equal_threads_ex(kind, S, M, N, 0, name);
}

Test(tie_run, processes_equal_threads) {
    processes_equal_threads(AVGPIPE_SCHED_1F1B, 4, 4, 2, "1f1b S=4 N=2");
    processes_equal_threads(AVGPIPE_SCHED_ZBV, 2, 2, 1, "zbv S=2");
    processes_equal_threads(AVGPIPE_SCHED_DUALPIPEV, 3, 6, 1, "dualpipev S=3");
}

/* Variable sizes over a comm of exact sizes only: the payloads at act_bytes, the sizes apart. */
Test(tie_run, exact_bytes_comm_carries_the_sizes_apart) {
    processes_equal_threads_ex(AVGPIPE_SCHED_1F1B, 3, 4, 2, 1, "1f1b S=3 N=2, exact_bytes");
    processes_equal_threads_ex(AVGPIPE_SCHED_ZBV, 2, 4, 1, 1, "zbv S=2, exact_bytes");
}

/* A size over the boundary's maximum fails the run naming the op and the field; without
   variable_bytes a size other than the maximum does, naming the option. */
Test(tie_run, bad_sizes_are_refused_naming_the_op) {
    setup s;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_result res = AVGPIPE_OK;
    int it;
    avgpipe_context_init(&ctx, NULL);
    setup_init(&s, AVGPIPE_SCHED_1F1B, 2, 0, 2, 1);
    T.size_fault = 1;
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (it = 0; it < 2 && !res; it++) res = avgpipe_run_iteration(run, NULL);
    cr_assert_eq(res, AVGPIPE_INVALID_ARG, "%s", avgpipe_result_string(res));
    cr_assert(strstr(avgpipe_last_error(&ctx), "output_bytes = 76 is over act_bytes[0] = 72") && strstr(avgpipe_last_error(&ctx), "0:0F"),
              "%s", avgpipe_last_error(&ctx));
    avgpipe_run_destroy(run);
    run = NULL;
    setup_init(&s, AVGPIPE_SCHED_1F1B, 2, 0, 2, 1);
    s.d.variable_bytes = 0; /* the forwards still set their rows' size */
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    res = avgpipe_run_iteration(run, NULL);
    cr_assert_eq(res, AVGPIPE_INVALID_ARG, "%s", avgpipe_result_string(res));
    cr_assert(strstr(avgpipe_last_error(&ctx), "differs from act_bytes[0]") && strstr(avgpipe_last_error(&ctx), "desc.variable_bytes"), "%s",
              avgpipe_last_error(&ctx));
    avgpipe_run_destroy(run);
    run = NULL;
    setup_init(&s, AVGPIPE_SCHED_1F1B, 2, 0, 2, 1);
    s.d.variable_bytes = 2;
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(&ctx), "variable_bytes: 2") != NULL, "%s", avgpipe_last_error(&ctx));
}

/* ---- on a device with asynchronous streams (tests/async_device.h, tests/opaque_device.h) --------- */

/* The same callbacks as tasks on op->stream; the step checks what it was given on the host and enqueues
   its update on st->stream. The gradients then live in "device memory": the runtime must bring each
   tied range and each partition's gradients to the host after the backward work on the stream, and the
   sums back before the step's task runs, or the bits differ from the plain loop's. On the opaque device
   the partitions and gradients the runtime is given are PROT_NONE pages over T's arrays, the slot
   buffers too: a task sees them through the device's mirror (as a kernel would), and any host access of
   them by the runtime faults. */
static int dev_task_failed, dev_opaque;
static float *dev_params[MAXN][MAXG], *dev_grads[MAXN][MAXG]; /* the addresses the runtime was given */
typedef struct dev_task {
    int (*fn)(avgpipe_op_ctx *);
    avgpipe_op_ctx op;
} dev_task;
static void dev_task_run(void *p) {
    dev_task *t = (dev_task *)p;
    avgpipe_op_ctx *op = &t->op;
    op->params = (float *)odev_mirror(op->params); /* host pointers come back unchanged */
    op->input = odev_mirror(op->input);
    op->output = odev_mirror(op->output);
    op->grad_output = odev_mirror(op->grad_output);
    op->grad_input = odev_mirror(op->grad_input);
    if (t->fn(op)) __atomic_store_n(&dev_task_failed, 1, __ATOMIC_SEQ_CST);
}
static int dev_enqueue(int (*fn)(avgpipe_op_ctx *), avgpipe_op_ctx *op) {
    dev_task t;
    t.fn = fn, t.op = *op;
    return adev_enqueue(op->stream, dev_task_run, &t, sizeof t) ? 1 : 0;
}
/* The sizes are the host's to set, before the call returns (the task's copy is not read). */
static int dev_forward(avgpipe_op_ctx *op) {
    int rc = dev_enqueue(cb_forward, op);
    if (op->stage + 1 < T.G) op->output_bytes = sizeof(float) * D * (size_t)rows(model_of(op), op->round, op->micro);
    return rc;
}
static int dev_backward(avgpipe_op_ctx *op) {
    int rc = dev_enqueue(cb_backward, op);
    if (op->stage > 0) op->grad_input_bytes = sizeof(float) * D * (size_t)rows(model_of(op), op->round, op->micro);
    return rc;
}
typedef struct dev_step {
    float *params, *grads;
    double scale;
    int skip;
} dev_step;
static void dev_step_run(void *p) {
    const dev_step *t = (const dev_step *)p;
    sgd((float *)odev_mirror(t->params), (float *)odev_mirror(t->grads), t->scale, t->skip);
}
static int dev_step_agreed(const avgpipe_step_ctx *st) {
    int m = st->replica * T.N + st->pipe, g = st->stage;
    dev_step t;
    if (!st->stream) return bad(g, 89, "a device step without a stream");
    if (st->params != dev_params[m][g] || st->grads != dev_grads[m][g] || st->count != PC) return bad(g, 94, "step got another partition");
    if (dev_opaque && (!odev_is_device(st->params) || !odev_is_device(st->grads))) return bad(g, 88, "step got host memory");
    if (st->round >= 0 && st->round < MAXR) T.skipped[m][g][st->round] = (unsigned char)(st->skip ? 1 : 2);
    T.nstep[m][g]++;
    t.params = st->params, t.grads = st->grads, t.scale = st->scale, t.skip = st->skip;
    return adev_enqueue(st->stream, dev_step_run, &t, sizeof t) ? 1 : 0;
}

/* opaque: the partitions, gradients and the runtime's buffers are memory the host cannot touch. nan: a
   NaN into model 0's gradient of stage nan at round 1 (-1: none), which must skip that step on every
   partition of the pipeline, the other pipelines' steps not. */
static void device_equal_to_plain_loop_ex(avgpipe_sched_kind kind, int S, int V, int M, int N, int opaque, int nan, const char *name) {
    static float ref[MAXN][MAXG][PC];
    setup s;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_device dev;
    avgpipe_run_stats st;
    int it, m, g;
    long long skipped = 0;
    char nm[128];
    setup_init(&s, kind, S, V, M, N);
    snprintf(nm, sizeof nm, "%s S=%d M=%d N=%d on the %s device%s", name, S, M, N, opaque ? "opaque" : "async", nan >= 0 ? ", a NaN" : "");
    if (nan >= 0) T.nan_model = 0, T.nan_stage = nan, T.nan_round = 1;
    dev = opaque ? odev_open(20) : adev_open(20);
    if (opaque) ADEV.allocs = ADEV.frees = 0, odev_guard();
    dev_opaque = opaque;
    for (m = 0; m < N; m++)
        for (g = 0; g < T.G; g++) {
            dev_params[m][g] = opaque ? (float *)odev_alloc_over(T.w[m][g], sizeof T.w[m][g]) : T.w[m][g];
            dev_grads[m][g] = opaque ? (float *)odev_alloc_over(T.grad[m][g], sizeof T.grad[m][g]) : T.grad[m][g];
            cr_assert(dev_params[m][g] && dev_grads[m][g], "%s: device memory for model %d, stage %d", nm, m, g);
            s.params[m * T.G + g] = dev_params[m][g], s.grads[m * T.G + g] = dev_grads[m][g];
        }
    s.d.device = &dev;
    s.d.cb.forward = dev_forward, s.d.cb.backward = dev_backward, s.d.cb.step_agreed = dev_step_agreed;
    dev_task_failed = 0;
    memcpy(ref, T.w, sizeof ref);
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s: create: %s", nm, avgpipe_last_error(&ctx));
    for (it = 0; it < ITERS; it++) {
        cr_assert_eq(avgpipe_run_iteration(run, &st), AVGPIPE_OK, "%s: iteration %d: %s", nm, it, avgpipe_last_error(&ctx));
        no_callback_error(nm);
        cr_assert(!dev_task_failed, "%s: a task failed", nm);
        skipped += st.skipped;
        /* the iteration returned: its work has finished on the device, and T's arrays are the mirrors */
        for (m = 0; m < N; m++) reference_round(ref[m], T.G, M, m, it, 1);
        for (m = 0; m < N; m++)
            for (g = 0; g < T.G; g++)
                cr_assert(memcmp(T.w[m][g], ref[m][g], sizeof ref[m][g]) == 0, "%s, iteration %d, model %d, stage %d: not the plain loop's bits",
                          nm, it, m, g);
        ties_identical(nm, it);
    }
    if (nan >= 0) {
        cr_assert_eq(skipped, 1, "%s: %lld pipeline steps skipped (one expected)", nm, skipped);
        for (g = 0; g < T.G; g++) cr_assert_eq(T.skipped[0][g][1], 1, "%s: stage %d of model 0 took round 1's step", nm, g);
        for (m = 1; m < N; m++) cr_assert_eq(T.skipped[m][0][1], 2, "%s: model %d skipped round 1's step", nm, m);
    }
    avgpipe_run_destroy(run);
    if (opaque) {
        for (m = 0; m < N; m++)
            for (g = 0; g < T.G; g++) odev_free_over(dev_params[m][g]), odev_free_over(dev_grads[m][g]);
        cr_assert_eq(ODEV.bad_kinds, 0, "%s: %ld copies of the wrong kind (%s)", nm, ODEV.bad_kinds, ODEV.error);
        cr_assert(ADEV.allocs > 0 && ADEV.allocs == ADEV.frees, "%s: %ld device allocations, %ld frees", nm, ADEV.allocs, ADEV.frees);
        cr_assert_eq(ODEV.live, 0, "%s: %ld device allocations still live", nm, ODEV.live);
        odev_close();
    } else
        adev_close();
}
static void device_equal_to_plain_loop(avgpipe_sched_kind kind, int S, int V, int M, int N, const char *name) {
    device_equal_to_plain_loop_ex(kind, S, V, M, N, 0, -1, name);
}

/* Ties and the agreement with gradients in device memory: across ranks (1F1B), on one rank (ZB-V puts
   partitions 0 and G-1 together), two pipelines. */
Test(tie_run, on_a_device_with_asynchronous_streams) {
    device_equal_to_plain_loop(AVGPIPE_SCHED_1F1B, 2, 0, 2, 1, "1f1b");
    device_equal_to_plain_loop(AVGPIPE_SCHED_1F1B, 4, 0, 4, 2, "1f1b");
    device_equal_to_plain_loop(AVGPIPE_SCHED_ZBV, 2, 0, 4, 1, "zbv");
    device_equal_to_plain_loop(AVGPIPE_SCHED_DUALPIPEV, 3, 0, 6, 1, "dualpipev");
}

/* The same on memory the host cannot touch (issue 17's device): the tie's exchange across ranks goes
   through the device-aware in-process comm, the sums through host copies made by the device; a
   non-finite gradient found there skips its pipeline's step on every partition. */
Test(tie_run, on_a_device_whose_memory_the_host_cannot_touch) {
    device_equal_to_plain_loop_ex(AVGPIPE_SCHED_1F1B, 2, 0, 2, 1, 1, -1, "1f1b");
    device_equal_to_plain_loop_ex(AVGPIPE_SCHED_1F1B, 4, 0, 4, 2, 1, -1, "1f1b");
    device_equal_to_plain_loop_ex(AVGPIPE_SCHED_ZBV, 2, 0, 4, 1, 1, -1, "zbv");
    device_equal_to_plain_loop_ex(AVGPIPE_SCHED_DUALPIPEV, 3, 0, 6, 1, 1, -1, "dualpipev");
    device_equal_to_plain_loop_ex(AVGPIPE_SCHED_1F1B, 4, 0, 4, 2, 1, 2, "1f1b");
}

/* ---- checkpoints ------------------------------------------------------------------------------- */

Test(tie_run, checkpoint_resume_equals_one_run) {
    static float want[MAXN][MAXG][PC];
    char dir[] = "/tmp/avgpipe_tie_ckptXXXXXX";
    setup s;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    int k;
    cr_assert(mkdtemp(dir) != NULL);
    avgpipe_context_init(&ctx, NULL);
    setup_init(&s, AVGPIPE_SCHED_ZBV, 2, 0, 2, 2);
    s.d.averaging.alpha = 0.3f;
    s.d.deterministic = 1;
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (k = 0; k < 4; k++) {
        cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        if (k == 1) cr_assert_eq(avgpipe_run_save(run, dir), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    }
    avgpipe_run_destroy(run);
    memcpy(want, T.w, sizeof want);
    setup_init(&s, AVGPIPE_SCHED_ZBV, 2, 0, 2, 2);
    s.d.averaging.alpha = 0.3f;
    s.d.deterministic = 1;
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_run_load(run, dir), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (k = 2; k < 4; k++) cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert(memcmp(T.w, want, sizeof want) == 0, "resumed run differs from the one run");
    ties_identical("resumed", 3);
    avgpipe_run_destroy(run);
    /* a run without the ties refuses the checkpoint, naming the field */
    setup_init(&s, AVGPIPE_SCHED_ZBV, 2, 0, 2, 2);
    s.d.averaging.alpha = 0.3f;
    s.d.deterministic = 1;
    s.d.nties = 0, s.d.ties = NULL;
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_run_load(run, dir), AVGPIPE_MISMATCH);
    cr_assert(strstr(avgpipe_last_error(&ctx), "ties") != NULL, "%s", avgpipe_last_error(&ctx));
    avgpipe_run_destroy(run);
    {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        cr_assert_eq(system(cmd), 0);
    }
}

/* ---- bad descriptions -------------------------------------------------------------------------- */

static void refused(setup *s, avgpipe_result want, const char *needle) {
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_result res;
    avgpipe_context_init(&ctx, NULL);
    res = avgpipe_run_create(&ctx, &s->d, &run);
    cr_assert_eq(res, want, "want %s, got %s: %s", avgpipe_result_string(want), avgpipe_result_string(res), avgpipe_last_error(&ctx));
    cr_assert(run == NULL);
    cr_assert(strstr(avgpipe_last_error(&ctx), needle) != NULL, "the message '%s' does not name '%s'", avgpipe_last_error(&ctx), needle);
}

Test(tie_run, bad_ties_are_refused_naming_the_field) {
    setup s;
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.ties[0].offset_b = PC - 10; /* 36 floats from PC - 10: out of bounds */
    refused(&s, AVGPIPE_INVALID_ARG, "ties[0].offset_b");
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.ties[1].stage_a = 0, s.ties[1].stage_b = 3, s.ties[1].offset_a = 10, s.ties[1].offset_b = OFF_B; /* overlaps E in stage 0 */
    refused(&s, AVGPIPE_INVALID_ARG, "ties[1] overlaps ties[0] in stage 0");
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.ties[1].stage_a = s.ties[1].stage_b = 2;
    refused(&s, AVGPIPE_INVALID_ARG, "tied to itself");
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.ties[1].stage_b = 4;
    refused(&s, AVGPIPE_INVALID_ARG, "ties[1]: stages");
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.ties[0].count = 0;
    refused(&s, AVGPIPE_INVALID_ARG, "ties[0].count");
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.d.grads = NULL;
    refused(&s, AVGPIPE_INVALID_ARG, "grads");
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.grads[2] = NULL;
    refused(&s, AVGPIPE_INVALID_ARG, "grads[2]");
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.d.cb.step_agreed = NULL;
    s.d.cb.step = NULL;
    refused(&s, AVGPIPE_INVALID_ARG, "cb.step_agreed");
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.d.agree.clip_norm = -1;
    refused(&s, AVGPIPE_INVALID_ARG, "agree.clip_norm");
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.d.agree.width = 2;
    refused(&s, AVGPIPE_INVALID_ARG, "agree.contribute");
}

/* A given schedule with sync ops must be the one desc describes. */
Test(tie_run, given_schedule_must_match_the_ties) {
    setup s;
    avgpipe_schedule plain, synced;
    avgpipe_sync_desc sy;
    avgpipe_tie one = {0, 2, 0, 0, 1};
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    cr_assert_eq(avgpipe_sched_generate(NULL, &s.d.sched, &plain), AVGPIPE_OK);
    memset(&sy, 0, sizeof sy);
    sy.ties = &one, sy.nties = 1, sy.agree = 1;
    cr_assert_eq(avgpipe_sched_add_sync(NULL, &plain, &sy, &synced), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    s.d.schedule = &synced;
    refused(&s, AVGPIPE_MISMATCH, "ties stages 0 and 2");
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.d.schedule = &synced;
    s.d.ties = NULL, s.d.nties = 0;
    s.d.agree.clip_norm = 0, s.d.agree.skip_nonfinite = 0;
    s.d.grads = NULL;
    s.d.cb.step_agreed = NULL;
    refused(&s, AVGPIPE_MISMATCH, "desc.ties and desc.agree are empty");
    /* the plain schedule given: the run places the ops itself and trains as the generated one */
    setup_init(&s, AVGPIPE_SCHED_1F1B, 4, 0, 2, 1);
    s.d.schedule = &plain;
    {
        avgpipe_context ctx;
        avgpipe_run *run = NULL;
        avgpipe_context_init(&ctx, NULL);
        cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        ties_identical("given plain schedule", 0);
        avgpipe_run_destroy(run);
    }
    avgpipe_sched_free(NULL, &plain);
    avgpipe_sched_free(NULL, &synced);
}

/* The exact helpers: pieces equal one call; the scale formula. */
Test(tie_run, exact_helpers) {
    float x[5] = {1, 2, -3, NAN, 0.5f};
    double a = 0, na = 0, b = 0, nb = 0, parts[6] = {1, 10, 2, 20, 3, 30}, out[2];
    avgpipe_grad_sumsq(x, 3, &a, &na);
    cr_assert(a == 14 && na == 0);
    avgpipe_grad_sumsq(x, 2, &b, &nb);
    avgpipe_grad_sumsq(x + 2, 1, &b, &nb);
    cr_assert(a == b);
    avgpipe_grad_sumsq(x, 5, &b, &nb);
    {
        uint64_t bits; /* a bit test: this file may be built with -ffast-math, which folds isnan */
        memcpy(&bits, &b, sizeof bits);
        cr_assert(nb == 1 && (bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull && (bits & 0xfffffffffffffull), "sumsq with a NaN: %g", b);
    }
    avgpipe_agree_combine(parts, 3, 2, out);
    cr_assert(out[0] == 6 && out[1] == 60);
    cr_assert(avgpipe_clip_scale(4, 1) == 0.5);
    cr_assert(avgpipe_clip_scale(0.25, 1) == 1);
    cr_assert(avgpipe_clip_scale(4, 0) == 1);
    cr_assert(avgpipe_clip_scale(1e308 * 10, 1) == 1); /* a non-finite sum: no clipping (skip such a step) */
}

/* A schedule of one's own may put the higher stage's TIE first on a rank holding both sides and its
   STEP before the other TIE: that STEP must already see the sum (the first TIE of a pair on one rank
   sums both copies). */
Test(tie_run, same_rank_pair_summed_at_its_first_tie) {
    setup s;
    avgpipe_schedule plain, synced, mine;
    avgpipe_sync_desc sy;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    int r, i, it;
    setup_init(&s, AVGPIPE_SCHED_ZBV, 2, 0, 2, 1);
    s.d.agree.clip_norm = 0, s.d.agree.skip_nonfinite = 0; /* ties only: no AGREE between the TIEs and the STEPs */
    cr_assert_eq(avgpipe_sched_generate(NULL, &s.d.sched, &plain), AVGPIPE_OK);
    memset(&sy, 0, sizeof sy);
    sy.ties = s.ties, sy.nties = s.d.nties;
    cr_assert_eq(avgpipe_sched_add_sync(NULL, &plain, &sy, &synced), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_sched_init(NULL, &mine, synced.nranks, &synced.shape), AVGPIPE_OK);
    for (r = 0; r < synced.nranks; r++) { /* each rank: compute ops, then hi TIE, hi STEP, hi AVG, lo TIE, lo STEP, lo AVG */
        const avgpipe_op *tail[6] = {NULL};
        for (i = 0; i < synced.len[r]; i++) {
            const avgpipe_op *op = &synced.ops[r][i];
            int hi = op->stage == 3 || op->stage == 2; /* rank 0 holds 0 and 3, rank 1 holds 1 and 2 */
            if (op->kind == AVGPIPE_OP_TIE) tail[hi ? 0 : 3] = op;
            else if (op->kind == AVGPIPE_OP_STEP) tail[hi ? 1 : 4] = op;
            else if (op->kind == AVGPIPE_OP_AVG) tail[hi ? 2 : 5] = op;
            else cr_assert_eq(avgpipe_sched_push(NULL, &mine, r, *op), AVGPIPE_OK);
        }
        for (i = 0; i < 6; i++) {
            cr_assert(tail[i] != NULL, "rank %d: no op %d of the tail", r, i);
            cr_assert_eq(avgpipe_sched_push(NULL, &mine, r, *tail[i]), AVGPIPE_OK);
        }
    }
    s.d.schedule = &mine;
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (it = 0; it < 2; it++) {
        cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        ties_identical("hi TIE first", it);
    }
    avgpipe_run_destroy(run);
    no_callback_error("hi TIE first");
    avgpipe_sched_free(NULL, &plain);
    avgpipe_sched_free(NULL, &synced);
    avgpipe_sched_free(NULL, &mine);
}

/* reseed_nonfinite: a model made non-finite (a NaN gradient, no skipping) is re-seeded from the
   reference at its AVG, the user is told, and the run goes on; without the option the iteration fails.
   Not with ties (a partition re-seeded alone would part its tied copies): refused. */
static int nreseeded, reseed_at[4];
static int cb_reseeded(int rank, int pipe, int stage, int round, void *user) {
    (void)user;
    reseed_at[0] = rank, reseed_at[1] = pipe, reseed_at[2] = stage, reseed_at[3] = round;
    nreseeded++;
    return 0;
}
Test(tie_run, non_finite_model_is_reseeded) {
    setup s;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_run_stats st;
    int it, m, g, j;
    avgpipe_context_init(&ctx, NULL);
    for (int reseed = 0; reseed < 2; reseed++) {
        setup_init(&s, AVGPIPE_SCHED_1F1B, 2, 0, 2, 2);
        s.d.agree.skip_nonfinite = 0; /* the NaN reaches the parameters */
        s.d.averaging.alpha = 0.25f;
        s.d.deterministic = 1;
        s.d.reseed_nonfinite = reseed;
        s.d.cb.reseeded = reseed ? cb_reseeded : NULL;
        T.nan_model = 1, T.nan_stage = 1, T.nan_round = 1;
        nreseeded = 0;
        if (reseed) {
            cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_INVALID_ARG);
            cr_assert(strstr(avgpipe_last_error(&ctx), "reseed_nonfinite with ties") != NULL, "%s", avgpipe_last_error(&ctx));
            s.d.ties = NULL, s.d.nties = 0;
        }
        cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        for (it = 0; it < 4; it++) {
            avgpipe_result res = avgpipe_run_iteration(run, &st);
            if (!reseed && it == 1) {
                cr_assert_eq(res, AVGPIPE_NON_FINITE, "without reseed_nonfinite: %s", avgpipe_result_string(res));
                cr_assert(strstr(avgpipe_last_error(&ctx), "pipeline 1") != NULL, "%s", avgpipe_last_error(&ctx));
                break;
            }
            cr_assert_eq(res, AVGPIPE_OK, "iteration %d: %s", it, avgpipe_last_error(&ctx));
            cr_assert_eq(st.reseeded, it == 1, "iteration %d: %lld re-seeded", it, st.reseeded);
        }
        avgpipe_run_destroy(run);
        run = NULL;
        if (!reseed) continue;
        cr_assert_eq(nreseeded, 1);
        cr_assert(reseed_at[0] == 1 && reseed_at[1] == 1 && reseed_at[2] == 1 && reseed_at[3] == 1, "re-seeded %d %d %d %d", reseed_at[0],
                  reseed_at[1], reseed_at[2], reseed_at[3]);
        for (m = 0; m < 2; m++)
            for (g = 0; g < T.G; g++)
                for (j = 0; j < PC; j++) {
                    uint32_t bits;
                    memcpy(&bits, &T.w[m][g][j], sizeof bits);
                    cr_assert((bits & 0x7f800000u) != 0x7f800000u, "model %d stage %d [%d] non-finite after the re-seed", m, g, j);
                }
    }
}
