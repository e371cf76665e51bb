/* toy_model.h — the small real model the runtime tests train, shared by tests/test_runtime.c and the
   MPI test program tests/mpi_check.c: an MLP, one Linear layer per stage partition, tanh between stages,
   softmax cross-entropy on the last one; deterministic data per (model, round, micro-batch); the
   callbacks the runtime calls, with checks of what it passes them; a non-pipelined single-thread
   reference and an independent float64 computation of the two-level elastic averaging.

   The model code is written once as a macro and instantiated for float (what the callbacks and the
   single-thread reference run) and double (the independent float64 computation). Weight gradients are
   kept per (model, stage, micro-batch) and summed in micro-batch order by the step callback, as the
   reference does, so every schedule must reproduce the reference's bits.

   Models: with D replica groups of N pipelines, model replica * N + pipe. State lives in one static
   struct T (one per process): reset_state_d() before each run. Include after avgpipe.h; needs
   <math.h>, <string.h>, <stdio.h>, <time.h> (nanosleep: _POSIX_C_SOURCE >= 199309L). */
#ifndef AVGPIPE_TESTS_TOY_MODEL_H
#define AVGPIPE_TESTS_TOY_MODEL_H

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#if defined(__GNUC__) || defined(__clang__)
#define TOY_FN static __attribute__((unused)) /* a program need not use every helper */
#else
#define TOY_FN static
#endif

/* The model's own arithmetic is compiled exactly whatever flags the test is built with (meson also builds
   test_runtime with -Ofast): the pipelined run and the single-thread reference run this code in different
   places, and -ffast-math would let the compiler round them differently (reassociated sums, vector
   tanhf), which is the test's model drifting, not the runtime. The library's own region macro does it. */
AVGPIPE__FP_EXACT_BEGIN

/* ---- the model -------------------------------------------------------------------------------- */

#define BS 4                /* samples per micro-batch */
#define MAXW 9              /* widest layer */
#define PMAX (MAXW * MAXW + MAXW)
#define ACT (BS * MAXW)     /* floats of the largest activation of one micro-batch */
#define MAXG 8
#define MAXN 4               /* models in all: replica groups x pipelines */
#define MAXD 2               /* replica groups */
#define MAXM 16
#define MAXSLOT 64
#define LR 0.2

/* Widths differ from boundary to boundary, so that a buffer of the wrong boundary is caught:
   stage g maps wid(g) features to wid(g + 1); the last stage's output width is the class count. */
TOY_FN int wid(int g) { return 5 + (3 * g) % 5; } /* 5 8 6 9 7 5 8 6 9 */
TOY_FN int pcount(int g) { return wid(g + 1) * wid(g) + wid(g + 1); }
TOY_FN size_t act_bytes_of(int g) { return (size_t)BS * (size_t)wid(g + 1) * sizeof(float); } /* boundary g|g+1 */

/* Stage forward: h = W x + b per sample (W: dout rows of din, then b); y = tanh(h) unless this is
   the last stage (h are the logits). Stage backward: gh = gy * (1 - tanh(h)^2), or on the last stage
   (softmax(h) - onehot(target)) / BS; gx = W^T gh; gW += gh x^T, gb += gh. */
#define MODEL_FUNCS(T, PFX, TANH, EXP, LOG)                                                  \
    TOY_FN void PFX##_fwd(int last, int din, int dout, const T *p, const T *x, T *h, T *y) { \
        int b, i, j;                                                                         \
        for (b = 0; b < BS; b++)                                                             \
            for (i = 0; i < dout; i++) {                                                     \
                T a = p[dout * din + i];                                                     \
                for (j = 0; j < din; j++) a += p[i * din + j] * x[b * din + j];              \
                h[b * dout + i] = a;                                                         \
                if (!last) y[b * dout + i] = TANH(a);                                        \
            }                                                                                \
    }                                                                                        \
    TOY_FN void PFX##_softmax(int n, const T *h, T *out) {                                   \
        int i;                                                                               \
        T mx = h[0], s = 0;                                                                  \
        for (i = 1; i < n; i++) mx = h[i] > mx ? h[i] : mx;                                  \
        for (i = 0; i < n; i++) s += (out[i] = EXP(h[i] - mx));                              \
        for (i = 0; i < n; i++) out[i] /= s;                                                 \
    }                                                                                        \
    TOY_FN T PFX##_loss(int n, const T *h, const int *tgt) {                                 \
        int b;                                                                               \
        T l = 0, pr[MAXW];                                                                   \
        for (b = 0; b < BS; b++) {                                                           \
            PFX##_softmax(n, h + b * n, pr);                                                 \
            l -= LOG(pr[tgt[b]]);                                                            \
        }                                                                                    \
        return l / (T)BS;                                                                    \
    }                                                                                        \
    TOY_FN void PFX##_gh(int last, int n, const T *h, const T *gy, const int *tgt, T *gh) {  \
        int b, i;                                                                            \
        for (b = 0; b < BS; b++) {                                                           \
            if (last) {                                                                      \
                PFX##_softmax(n, h + b * n, gh + b * n);                                     \
                gh[b * n + tgt[b]] -= 1;                                                     \
                for (i = 0; i < n; i++) gh[b * n + i] /= (T)BS;                              \
            } else {                                                                         \
                for (i = 0; i < n; i++) {                                                    \
                    T t = TANH(h[b * n + i]);                                                \
                    gh[b * n + i] = gy[b * n + i] * (1 - t * t);                             \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    TOY_FN void PFX##_gx(int din, int dout, const T *p, const T *gh, T *gx) {                \
        int b, i, j;                                                                         \
        for (b = 0; b < BS; b++)                                                             \
            for (j = 0; j < din; j++) {                                                      \
                T a = 0;                                                                     \
                for (i = 0; i < dout; i++) a += p[i * din + j] * gh[b * dout + i];           \
                gx[b * din + j] = a;                                                         \
            }                                                                                \
    }                                                                                        \
    TOY_FN void PFX##_gw(int din, int dout, const T *x, const T *gh, T *gw) {                \
        int b, i, j;                                                                         \
        for (b = 0; b < BS; b++)                                                             \
            for (i = 0; i < dout; i++) {                                                     \
                for (j = 0; j < din; j++) gw[i * din + j] += gh[b * dout + i] * x[b * din + j]; \
                gw[dout * din + i] += gh[b * dout + i];                                      \
            }                                                                                \
    }

MODEL_FUNCS(float, mf, tanhf, expf, logf)
MODEL_FUNCS(double, md, tanh, exp, log)

/* Deterministic data: stage 0's input and the last stage's targets of (pipeline, round, micro-batch). */
TOY_FN void gen_input(int pipe, int round, int micro, float *x) {
    int b, j, n = wid(0);
    for (b = 0; b < BS; b++)
        for (j = 0; j < n; j++)
            x[b * n + j] = (float)sin(1.3 * pipe + 0.71 * round + 0.37 * micro + 0.53 * b + 0.29 * j * (j + 1) + 0.1);
}
TOY_FN void gen_target(int classes, int pipe, int round, int micro, int *t) {
    int b;
    for (b = 0; b < BS; b++) t[b] = (pipe * 5 + round * 3 + micro * 7 + b * 3) % classes;
}
TOY_FN void init_params(int g, float *p) { /* in [-0.6, 0.6], exactly representable as float */
    int j;
    for (j = 0; j < pcount(g); j++) p[j] = (float)(0.6 * sin(12.9898 * (g * PMAX + j + 1) + 78.233 * g));
}

/* ---- what the callbacks share ----------------------------------------------------------------- */

typedef struct stash {
    int valid, pipe, round, micro, has_gy; /* pipe: the model (replica * N + pipeline) */
    float h[ACT];
    float gy[ACT];
} stash;

static struct {
    int G, M, N, D, S, nslots[MAXG]; /* N pipelines in each of D replica groups of S ranks */
    float w[MAXN][MAXG][PMAX];    /* [model = replica * N + pipe][stage] */
    float gacc[MAXN][MAXG][MAXM][PMAX]; /* weight gradient of each micro-batch, summed in order by step */
    stash st[MAXD][MAXG][MAXSLOT];
    /* calls per (model, stage): forward, backward (B or I), weight (B or W), step */
    long nf[MAXN][MAXG], nbi[MAXN][MAXG], nw[MAXN][MAXG], nstep[MAXN][MAXG];
    long noverlap[MAXG]; /* overlapped pairs run through cb_overlap, by the forward's stage */
    int split;           /* use_split(): an I runs backward_input (else the full backward, as the runtime does) */
    char err[MAXG][256]; /* the first problem a callback saw, per stage (the stage's own thread writes it) */
    /* fault injection */
    int fail_stage, fail_micro, fail_round;
    int sleep_stage, sleep_micro, sleep_ms; /* a slow backward */
    int op_sleep_us;                         /* every op sleeps this long (adaptive test) */
} T;

/* D replica groups of N pipelines over G stages, M micro-batches per batch; every model starts alike. */
TOY_FN void reset_state_d(int G, int M, int N, int D) {
    int i, g;
    memset(&T, 0, sizeof T);
    T.G = G, T.M = M, T.N = N, T.D = D;
    T.fail_stage = T.sleep_stage = -1;
    for (i = 0; i < N * D; i++)
        for (g = 0; g < G; g++) init_params(g, T.w[i][g]);
}
TOY_FN void reset_state(int G, int M, int N) { reset_state_d(G, M, N, 1); }

/* The model an op belongs to: its replica group's pipeline. */
TOY_FN int model_of(const avgpipe_op_ctx *op) { return op->replica * T.N + op->pipe; }

TOY_FN int bad(int g, int code, const char *what) {
    if (!T.err[g][0]) snprintf(T.err[g], sizeof T.err[g], "%s", what);
    return code;
}

TOY_FN void nap_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* Checks every callback makes on the context the runtime passes. */
TOY_FN int check_ctx(const avgpipe_op_ctx *op, int is_fwd, int is_weight) {
    int g = op->stage;
    if (g < 0 || g >= T.G || op->pipe < 0 || op->pipe >= T.N || op->micro < 0 || op->micro >= T.M || op->replica < 0 ||
        op->replica >= (T.D ? T.D : 1))
        return bad(0, 90, "bad indices");
    if (op->stages != T.G) return bad(g, 91, "op->stages != G");
    if (op->params != T.w[model_of(op)][g]) return bad(g, 92, "op->params is not the pipeline's partition");
    if (op->slot < 0 || op->slot >= T.nslots[g] || op->slot >= MAXSLOT) return bad(g, 93, "slot out of range");
    if ((g == 0) != (op->input == NULL)) return bad(g, 94, "input must be NULL exactly on stage 0");
    if (is_fwd && (g == T.G - 1) != (op->output == NULL)) return bad(g, 95, "output must be NULL exactly on the last stage");
    if (!is_fwd && !is_weight && (g == T.G - 1) != (op->grad_output == NULL))
        return bad(g, 96, "grad_output must be NULL exactly on the last stage");
    if (!is_fwd && !is_weight && (g == 0) != (op->grad_input == NULL)) return bad(g, 97, "grad_input must be NULL exactly on stage 0");
    return 0;
}

TOY_FN const float *stage_input(const avgpipe_op_ctx *op, float *buf) {
    if (op->stage > 0) return (const float *)op->input;
    gen_input(model_of(op), op->round, op->micro, buf);
    return buf;
}

/* The stash of this op's slot, which must hold this micro-batch's forward. */
TOY_FN stash *own_stash(const avgpipe_op_ctx *op) {
    stash *s = &T.st[op->replica][op->stage][op->slot];
    if (!s->valid || s->pipe != model_of(op) || s->round != op->round || s->micro != op->micro) {
        bad(op->stage, 0, "a backward found another micro-batch's forward in its slot");
        return NULL;
    }
    return s;
}

TOY_FN int cb_forward(avgpipe_op_ctx *op) {
    float xb[ACT];
    const float *x;
    stash *s;
    int g = op->stage, rc = check_ctx(op, 1, 0);
    if (rc) return rc;
    if (g == T.fail_stage && op->micro == T.fail_micro && op->round == T.fail_round) return 7;
    if (T.op_sleep_us) nap_us(T.op_sleep_us);
    s = &T.st[op->replica][g][op->slot];
    if (s->valid) return bad(g, 98, "forward into a slot still in use");
    s->valid = 1, s->pipe = model_of(op), s->round = op->round, s->micro = op->micro, s->has_gy = 0;
    x = stage_input(op, xb);
    mf_fwd(g == T.G - 1, wid(g), wid(g + 1), op->params, x, s->h, (float *)op->output);
    if (g == T.G - 1) {
        int t[BS];
        gen_target(wid(T.G), model_of(op), op->round, op->micro, t);
        op->loss = mf_loss(wid(T.G), s->h, t);
    }
    T.nf[model_of(op)][g]++;
    return 0;
}

/* gh of this micro-batch from the stashed pre-activations and the output gradient gy. */
TOY_FN void grad_h(const avgpipe_op_ctx *op, const stash *s, const float *gy, float *gh) {
    int t[BS];
    gen_target(wid(T.G), model_of(op), op->round, op->micro, t);
    mf_gh(op->stage == T.G - 1, wid(op->stage + 1), s->h, gy, t, gh);
}

TOY_FN int cb_backward(avgpipe_op_ctx *op) {
    float xb[ACT], gh[ACT];
    stash *s;
    int g = op->stage, rc = check_ctx(op, 0, 0);
    if (rc) return rc;
    if (T.op_sleep_us) nap_us(T.op_sleep_us);
    if (g == T.sleep_stage && op->micro == T.sleep_micro) nap_us(1000L * T.sleep_ms);
    if (!(s = own_stash(op))) return 99;
    grad_h(op, s, (const float *)op->grad_output, gh);
    if (g > 0) mf_gx(wid(g), wid(g + 1), op->params, gh, (float *)op->grad_input);
    mf_gw(wid(g), wid(g + 1), stage_input(op, xb), gh, T.gacc[model_of(op)][g][op->micro]);
    s->valid = 0;
    T.nbi[model_of(op)][g]++;
    T.nw[model_of(op)][g]++;
    return 0;
}

/* I: the input gradient; keeps the output gradient for W (the runtime's buffer is not promised to W). */
TOY_FN int cb_backward_input(avgpipe_op_ctx *op) {
    float gh[ACT];
    stash *s;
    int g = op->stage, rc = check_ctx(op, 0, 0);
    if (rc) return rc;
    if (!(s = own_stash(op))) return 99;
    if (s->has_gy) return bad(g, 100, "I ran twice for one micro-batch");
    grad_h(op, s, (const float *)op->grad_output, gh);
    if (g > 0) mf_gx(wid(g), wid(g + 1), op->params, gh, (float *)op->grad_input);
    if (op->grad_output) memcpy(s->gy, op->grad_output, act_bytes_of(g));
    s->has_gy = 1;
    T.nbi[model_of(op)][g]++;
    return 0;
}

TOY_FN int cb_backward_weight(avgpipe_op_ctx *op) {
    float xb[ACT], gh[ACT];
    stash *s;
    int g = op->stage, rc = check_ctx(op, 0, 1);
    if (rc) return rc;
    if (!(s = own_stash(op))) return 99;
    if (!s->has_gy) return bad(g, 101, "W before its I");
    grad_h(op, s, s->gy, gh);
    mf_gw(wid(g), wid(g + 1), stage_input(op, xb), gh, T.gacc[model_of(op)][g][op->micro]);
    s->valid = 0;
    T.nw[model_of(op)][g]++;
    return 0;
}

/* An overlapped pair "(F;B)OVERLAP_F_B": the backward first, then the forward (their micro-batches
   differ, so a trainer may interleave them any way; running them in the other order than F-then-B
   checks that the runtime prepared both before the call). */
TOY_FN int cb_overlap(avgpipe_op_ctx *f, avgpipe_op_ctx *b) {
    int rc;
    if (f->kind != AVGPIPE_OP_F || (b->kind != AVGPIPE_OP_B && b->kind != AVGPIPE_OP_I)) return bad(f->stage, 103, "overlap: not (F;B)");
    if (f->rank != b->rank) return bad(f->stage, 104, "overlap: a pair from two ranks");
    rc = b->kind == AVGPIPE_OP_I && T.split ? cb_backward_input(b) : cb_backward(b);
    if (!rc) rc = cb_forward(f);
    if (!rc) __atomic_add_fetch(&T.noverlap[f->stage], 1, __ATOMIC_RELAXED); /* replica groups share stages */
    return rc;
}

/* SGD on the mean gradient of the batch; gradients summed in micro-batch order. */
TOY_FN void sgd_f(float *p, float (*gacc)[PMAX], int M, int n) {
    float gsum[PMAX];
    const float lr = (float)(LR / M);
    int m, j;
    memset(gsum, 0, sizeof gsum);
    for (m = 0; m < M; m++)
        for (j = 0; j < n; j++) {
            gsum[j] += gacc[m][j];
            gacc[m][j] = 0;
        }
    for (j = 0; j < n; j++) p[j] -= lr * gsum[j];
}

TOY_FN int cb_step(int rank, int pipe, int stage, int round, float *params, void *user) {
    int model = (rank / (T.S ? T.S : 1)) * T.N + pipe; /* the replica group is rank / S */
    (void)round, (void)user;
    if (params != T.w[model][stage]) return bad(stage, 102, "step got another partition");
    sgd_f(params, T.gacc[model][stage], T.M, pcount(stage));
    T.nstep[model][stage]++;
    return 0;
}

/* ---- the non-pipelined single-thread reference (float, same layer code) ------------------------ */

/* Train one model of G stages on batches (pipe, rounds[0..nr-1]); returns the mean loss. */
TOY_FN double reference_train(float (*w)[PMAX], int G, int M, int pipe, int round) {
    static float gacc[MAXG][MAXM][PMAX];
    float a[MAXG + 1][ACT], h[MAXG][ACT], gy[ACT], gx[ACT], gh[ACT];
    double loss = 0;
    int m, g, t[BS];
    memset(gacc, 0, sizeof gacc);
    for (m = 0; m < M; m++) {
        gen_input(pipe, round, m, a[0]);
        gen_target(wid(G), pipe, round, m, t);
        for (g = 0; g < G; g++) mf_fwd(g == G - 1, wid(g), wid(g + 1), w[g], a[g], h[g], a[g + 1]);
        loss += mf_loss(wid(G), h[G - 1], t);
        for (g = G - 1; g >= 0; g--) {
            mf_gh(g == G - 1, wid(g + 1), h[g], gy, t, gh);
            if (g > 0) mf_gx(wid(g), wid(g + 1), w[g], gh, gx);
            mf_gw(wid(g), wid(g + 1), a[g], gh, gacc[g][m]);
            memcpy(gy, gx, sizeof gy);
        }
    }
    for (g = 0; g < G; g++) sgd_f(w[g], gacc[g], M, pcount(g));
    return loss / M;
}

/* ---- running ---------------------------------------------------------------------------------- */

typedef struct setup {
    avgpipe_run_desc d;
    size_t act[MAXG], pc[MAXG];
    float *params[MAXN * MAXG];
} setup;

/* A run description over T's parameters for G stages, N pipelines and D replica groups of S ranks
   (S: what the schedule will say; cb_step needs it to tell the groups apart), full backward callbacks. */
TOY_FN void setup_init_d(setup *s, int G, int N, int D, int S) {
    int i, g;
    memset(s, 0, sizeof *s);
    T.S = S;
    for (g = 0; g < G; g++) {
        s->act[g] = act_bytes_of(g);
        s->pc[g] = (size_t)pcount(g);
        for (i = 0; i < N * D; i++) s->params[i * G + g] = T.w[i][g];
    }
    s->d.replicas = D;
    s->d.cb.forward = cb_forward;
    s->d.cb.backward = cb_backward;
    s->d.cb.step = cb_step;
    s->d.act_bytes = s->act;
    s->d.params = s->params;
    s->d.param_count = s->pc;
    s->d.timeout_s = 20;
}

TOY_FN void setup_init(setup *s, int G, int N) { setup_init_d(s, G, N, 1, G); }

TOY_FN void use_split(setup *s, int keep_full) {
    T.split = 1;
    s->d.cb.backward_input = cb_backward_input;
    s->d.cb.backward_weight = cb_backward_weight;
    if (!keep_full) s->d.cb.backward = NULL;
}

/* Double-precision training of D groups of N models of G stages for `rounds` rounds with MEAN
   averaging: local SGD step of each model, then in each group w_i <- w_i - alpha (w_i - z_prev),
   z <- mean_i w_i; every H rounds (round t with (t + 1) % H == 0) each group's z <- the mean of the
   D groups' z. Model i (of D * N) trains on the data of "pipeline" i; z[d] is group d's reference;
   loss[t] is round t's mean over all models. */
TOY_FN void averaging_f64_d(int G, int M, int N, int D, int H, int rounds, double alpha, double (*w)[MAXG][PMAX],
                            double (*z)[MAXG][PMAX], double *loss) {
    static double gsum[MAXG][PMAX];
    double a[MAXG + 1][ACT], h[MAXG][ACT], gy[ACT], gx[ACT], gh[ACT];
    int t, i, m, g, j, d, tg[BS];
    float xf[ACT] = {0};
    for (i = 0; i < D * N; i++)
        for (g = 0; g < G; g++) {
            float p[PMAX];
            init_params(g, p);
            for (j = 0; j < pcount(g); j++) w[i][g][j] = p[j];
        }
    for (d = 0; d < D; d++)
        for (g = 0; g < G; g++) memcpy(z[d][g], w[d * N][g], sizeof z[d][g]);
    for (t = 0; t < rounds; t++) {
        loss[t] = 0;
        for (i = 0; i < D * N; i++) {
            memset(gsum, 0, sizeof gsum);
            for (m = 0; m < M; m++) {
                gen_input(i, t, m, xf);
                for (j = 0; j < ACT; j++) a[0][j] = xf[j];
                gen_target(wid(G), i, t, m, tg);
                for (g = 0; g < G; g++) md_fwd(g == G - 1, wid(g), wid(g + 1), w[i][g], a[g], h[g], a[g + 1]);
                loss[t] += md_loss(wid(G), h[G - 1], tg) / (D * N * M);
                for (g = G - 1; g >= 0; g--) {
                    md_gh(g == G - 1, wid(g + 1), h[g], gy, tg, gh);
                    if (g > 0) md_gx(wid(g), wid(g + 1), w[i][g], gh, gx);
                    md_gw(wid(g), wid(g + 1), a[g], gh, gsum[g]);
                    memcpy(gy, gx, sizeof gy);
                }
            }
            for (g = 0; g < G; g++)
                for (j = 0; j < pcount(g); j++) w[i][g][j] -= LR / M * gsum[g][j];
        }
        for (d = 0; d < D; d++)
            for (g = 0; g < G; g++)
                for (j = 0; j < pcount(g); j++) {
                    double acc = 0;
                    for (i = d * N; i < (d + 1) * N; i++) {
                        w[i][g][j] -= alpha * (w[i][g][j] - z[d][g][j]);
                        acc += w[i][g][j];
                    }
                    z[d][g][j] = acc / N;
                }
        if ((t + 1) % H == 0)
            for (g = 0; g < G; g++)
                for (j = 0; j < pcount(g); j++) {
                    double acc = 0;
                    for (d = 0; d < D; d++) acc += z[d][g][j];
                    for (d = 0; d < D; d++) z[d][g][j] = acc / D;
                }
    }
}

/* One group (D = 1). */
TOY_FN void averaging_f64(int G, int M, int N, int rounds, double alpha, double (*w)[MAXG][PMAX], double (*z)[PMAX], double *loss) {
    static double zd[MAXD][MAXG][PMAX];
    averaging_f64_d(G, M, N, 1, 1, rounds, alpha, w, zd, loss);
    memcpy(z, zd[0], sizeof zd[0]);
}

AVGPIPE__FP_EXACT_END

#endif
