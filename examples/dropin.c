/* dropin.c — the smallest complete trainer that adopts avgpipe. A tutorial: read it top to bottom.

   Part 1 is a trainer you might already have: a 3-layer MLP (8 -> 32 -> 32 -> 1, tanh) learning a
   synthetic regression by SGD, in plain C loops. Part 2 is ALL you add to run it through avgpipe:
     - say how the model splits into stages (one layer per stage here): a flat float buffer of
       parameters per stage and the bytes of one micro-batch's activation at each boundary;
     - wrap your layer code in four callbacks: forward, backward, step (your own SGD), loss on the last
       stage's forward;
     - create a run, call avgpipe_run_iteration in your loop, read the reference model at the end.
   Part 3 checks and shows it: the pipelined run with one pipeline and alpha = 0 must give the plain
   loop's parameters bit for bit (exit 1 if not), and two parallel pipelines with elastic averaging
   train the reference model.

   Build: gcc -std=c11 -O2 -I. examples/dropin.c -o dropin -lm -pthread */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Part 1: the trainer you already have ======================================================= */

enum { LAYERS = 3, IN = 8, HID = 32, B = 16 /* samples per micro-batch */, M = 4 /* micro-batches per batch */,
       NB = 16 /* batches in the training set */, ITERS = 200, MAXP = 2 /* parallel pipelines, part 3 */ };
static const int width[LAYERS + 1] = {IN, HID, HID, 1};
static const float LR = 0.05f;
static float X[NB + 1][M][B * IN], Y[NB + 1][M][B]; /* batch NB is held out for evaluation */

/* Layer l: z_out = W_l tanh(z_in) + b_l (layer 0 reads the raw input). Parameters: W (rows of width[l]
   floats), then b. Keeping pre-activations on the wire means a backward needs only its input. */
static size_t layer_size(int l) { return (size_t)width[l + 1] * width[l] + width[l + 1]; }

static void layer_forward(int l, const float *p, const float *zin, float *zout) {
    int n = width[l], m = width[l + 1];
    float h[B * HID];
    for (int i = 0; i < B * n; i++) h[i] = l ? tanhf(zin[i]) : zin[i];
    for (int s = 0; s < B; s++)
        for (int j = 0; j < m; j++) {
            float a = p[n * m + j];
            for (int i = 0; i < n; i++) a += p[j * n + i] * h[s * n + i];
            zout[s * m + j] = a;
        }
}

/* Adds this micro-batch's weight gradient to g; writes the input gradient to gin unless it is NULL. */
static void layer_backward(int l, const float *p, const float *zin, const float *gout, float *g, float *gin) {
    int n = width[l], m = width[l + 1];
    float h[B * HID];
    for (int i = 0; i < B * n; i++) h[i] = l ? tanhf(zin[i]) : zin[i];
    for (int s = 0; s < B; s++)
        for (int j = 0; j < m; j++) {
            g[n * m + j] += gout[s * m + j];
            for (int i = 0; i < n; i++) g[j * n + i] += gout[s * m + j] * h[s * n + i];
        }
    for (int s = 0; gin && s < B; s++)
        for (int i = 0; i < n; i++) {
            float a = 0;
            for (int j = 0; j < m; j++) a += p[j * n + i] * gout[s * m + j];
            gin[s * n + i] = l ? a * (1 - h[s * n + i] * h[s * n + i]) : a;
        }
}

/* Mean squared error / 2 of a micro-batch; its gradient with respect to the output goes to gz. */
static double loss_grad(const float *z, const float *y, float *gz) {
    double loss = 0;
    for (int s = 0; s < B; s++) {
        gz[s] = (z[s] - y[s]) / B;
        loss += 0.5 * (double)(z[s] - y[s]) * (z[s] - y[s]) / B;
    }
    return loss;
}

/* SGD on the gradient summed over the batch's M micro-batches, then clear it. */
static void sgd(float *p, float *g, size_t n) {
    for (size_t i = 0; i < n; i++) {
        p[i] -= LR * g[i] / M;
        g[i] = 0;
    }
}

/* The plain loop: one batch (M micro-batches), forward and backward through every layer, then SGD. */
static double plain_iteration(float *p[LAYERS], float *g[LAYERS], int batch) {
    float z[LAYERS + 1][B * HID], gz[2][B * HID];
    double loss = 0;
    for (int u = 0; u < M; u++) {
        memcpy(z[0], X[batch][u], sizeof X[batch][u]);
        for (int l = 0; l < LAYERS; l++) layer_forward(l, p[l], z[l], z[l + 1]);
        loss += loss_grad(z[LAYERS], Y[batch][u], gz[0]);
        for (int l = LAYERS - 1, k = 0; l >= 0; l--, k ^= 1) layer_backward(l, p[l], z[l], gz[k], g[l], l ? gz[k ^ 1] : NULL);
    }
    for (int l = 0; l < LAYERS; l++) sgd(p[l], g[l], layer_size(l));
    return loss / M;
}

static double evaluate(const float *const p[LAYERS]) { /* loss on the held-out batch */
    float z[LAYERS + 1][B * HID], gz[B];
    double loss = 0;
    for (int u = 0; u < M; u++) {
        memcpy(z[0], X[NB][u], sizeof X[NB][u]);
        for (int l = 0; l < LAYERS; l++) layer_forward(l, p[l], z[l], z[l + 1]);
        loss += loss_grad(z[LAYERS], Y[NB][u], gz);
    }
    return loss / M;
}

/* ==== Part 2: what you add to your trainer ======================================================= */

/* Your state, reached from every callback through op->user: gradients per (pipeline, stage). A stage's
   callbacks all run on the one thread of the rank that holds it, so no locking is needed. */
typedef struct trainer {
    int pipes;
    float *grad[MAXP][LAYERS];
} trainer;

/* Which batch pipeline `pipe` trains on in round `round` (pipelines see different data). */
static int batch_of(const trainer *t, int pipe, int round) { return (round * t->pipes + pipe) % NB; }

/* Forward of one micro-batch on one stage. Stage 0 loads its own input (op->input is NULL); the last
   stage has no output buffer: it computes the loss instead. */
static int on_forward(avgpipe_op_ctx *op) {
    int l = op->stage, b = batch_of(op->user, op->pipe, op->round);
    const float *in = l == 0 ? X[b][op->micro] : op->input;
    float z[B], gz[B];
    if (op->output) {
        layer_forward(l, op->params, in, op->output);
        return 0;
    }
    layer_forward(l, op->params, in, z);
    op->loss = loss_grad(z, Y[b][op->micro], gz);
    return 0;
}

/* Backward: the runtime hands back this micro-batch's input and the gradient of the output. The last
   stage starts from its loss (grad_output is NULL): it recomputes its one-column output rather than
   stash it (to stash instead, key your buffers by (op->stage, op->slot); see avgpipe_run_slots). */
static int on_backward(avgpipe_op_ctx *op) {
    trainer *t = op->user;
    int l = op->stage, b = batch_of(t, op->pipe, op->round);
    const float *in = l == 0 ? X[b][op->micro] : op->input, *gout = op->grad_output;
    float z[B], gz[B];
    if (!gout) {
        layer_forward(l, op->params, in, z);
        loss_grad(z, Y[b][op->micro], gz);
        gout = gz;
    }
    layer_backward(l, op->params, in, gout, t->grad[op->pipe][l], op->grad_input);
    return 0;
}

/* Your optimizer, once per (pipeline, stage) after the batch's last backward. */
static int on_step(int rank, int pipe, int stage, int round, float *params, void *user) {
    trainer *t = user;
    (void)rank, (void)round;
    sgd(params, t->grad[pipe][stage], layer_size(stage));
    return 0;
}

/* Train `pipes` copies of w0 through avgpipe; loss[it] = the iteration's mean micro-batch loss; the
   final reference model goes to ref, pipeline 0's parameters to out. Returns 0 or an avgpipe_result. */
static int train_avgpipe(const float *const w0[LAYERS], avgpipe_sched_kind kind, int pipes, float alpha,
                         double *loss, float *ref[LAYERS], float *out[LAYERS]) {
    static float store[MAXP][LAYERS][2][HID * HID + HID]; /* parameters and gradients */
    trainer t = {.pipes = pipes};
    float *params[MAXP * LAYERS];
    size_t count[LAYERS], act[LAYERS - 1];
    for (int l = 0; l < LAYERS; l++) {
        count[l] = layer_size(l);
        if (l < LAYERS - 1) act[l] = B * width[l + 1] * sizeof(float); /* boundary l | l+1 */
        for (int i = 0; i < pipes; i++) { /* every pipeline starts from the same weights */
            params[i * LAYERS + l] = memcpy(store[i][l][0], w0[l], count[l] * sizeof(float));
            t.grad[i][l] = memset(store[i][l][1], 0, count[l] * sizeof(float));
        }
    }
    avgpipe_run_desc d = {
        .sched = {.kind = kind, .stages = LAYERS, .micro = M, .pipes = pipes, .advance = 2},
        .cb = {.forward = on_forward, .backward = on_backward, .step = on_step, .user = &t},
        .act_bytes = act, .params = params, .param_count = count,
        .averaging.alpha = alpha == 0 ? AVGPIPE_ZERO : alpha, /* alpha = 0 exactly: no pull (0 would mean 0.1) */
        .deterministic = 1, .timeout_s = 10,
    };
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_run_stats st;
    avgpipe_context_init(&ctx, NULL);
    int res = avgpipe_run_create(&ctx, &d, &run);
    for (int it = 0; it < ITERS && !res; it++) {
        res = avgpipe_run_iteration(run, &st);
        loss[it] = st.loss;
        if (!res && st.micro_batches != (long long)M * pipes) { /* cheap insurance: every micro-batch ran */
            fprintf(stderr, "avgpipe: only %lld of %d micro-batches ran\n", st.micro_batches, M * pipes);
            avgpipe_run_destroy(run);
            return 1;
        }
    }
    if (res) {
        fprintf(stderr, "avgpipe: %s: %s\n", avgpipe_result_string(res), avgpipe_last_error(&ctx));
        avgpipe_run_destroy(run);
        return res;
    }
    for (int l = 0; l < LAYERS; l++) { /* the reference is only valid until the next iteration: copy it */
        memcpy(ref[l], avgpipe_run_reference(run, l, NULL), count[l] * sizeof(float));
        memcpy(out[l], params[l], count[l] * sizeof(float));
    }
    avgpipe_run_destroy(run);
    return 0;
}

/* ==== Part 3: check and show ===================================================================== */

int main(void) {
    static float mem[7][LAYERS][HID * HID + HID];
    float *w0[LAYERS], *plain[LAYERS], *grad[LAYERS], *pipe1[LAYERS], *ref1[LAYERS], *pipe2[LAYERS], *ref2[LAYERS];
    double lp[ITERS], l1[ITERS], l2[ITERS];
    unsigned rng = 12345;
#define UNIFORM() ((float)((rng = rng * 1664525u + 1013904223u) >> 8) / 8388608.0f - 1.0f) /* [-1, 1) */
    for (int b = 0; b <= NB; b++) /* the target: a smooth function of 4 of the 8 inputs */
        for (int u = 0; u < M; u++)
            for (int s = 0; s < B; s++) {
                float *x = &X[b][u][s * IN];
                for (int i = 0; i < IN; i++) x[i] = UNIFORM();
                Y[b][u][s] = sinf(2 * x[0]) * cosf(x[1]) + 0.5f * x[2] * x[3];
            }
    for (int l = 0; l < LAYERS; l++) {
        w0[l] = mem[0][l], grad[l] = mem[1][l], plain[l] = mem[2][l];
        pipe1[l] = mem[3][l], ref1[l] = mem[4][l], pipe2[l] = mem[5][l], ref2[l] = mem[6][l];
        for (size_t i = 0; i < layer_size(l); i++) w0[l][i] = UNIFORM() / sqrtf((float)width[l]);
        memcpy(plain[l], w0[l], layer_size(l) * sizeof(float));
        memset(grad[l], 0, sizeof mem[1][l]);
    }
    double before = evaluate((const float *const *)w0);

    for (int it = 0; it < ITERS; it++) lp[it] = plain_iteration(plain, grad, it % NB); /* the plain way */
    /* One pipeline of 3 stages, 1F1B, alpha = 0: plain training, pipelined. */
    if (train_avgpipe((const float *const *)w0, AVGPIPE_SCHED_1F1B, 1, 0.0f, l1, ref1, pipe1)) return 1;
    /* Two parallel pipelines (each on its own batches), advance forward K = 2, elastic averaging. */
    if (train_avgpipe((const float *const *)w0, AVGPIPE_SCHED_ADVANCE, 2, 0.1f, l2, ref2, pipe2)) return 1;

    printf("3-layer MLP (%d-%d-%d-1), %d micro-batches of %d samples per batch, SGD lr %.2f\n", IN, HID, HID, M, B, LR);
    printf("%6s %14s %22s %28s\n", "iter", "plain loop", "avgpipe N=1 alpha=0", "avgpipe N=2 alpha=0.1 K=2");
    static const int rows[] = {0, 5, 10, 20, 40, 80, 120, 160, ITERS - 1};
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++)
        printf("%6d %14.6f %22.6f %28.6f\n", rows[k], lp[rows[k]], l1[rows[k]], l2[rows[k]]);

    int same = 1;
    for (int l = 0; l < LAYERS; l++)
        same &= !memcmp(plain[l], pipe1[l], layer_size(l) * sizeof(float)) && !memcmp(plain[l], ref1[l], layer_size(l) * sizeof(float));
    for (int it = 0; it < ITERS; it++) same &= lp[it] == l1[it];
    printf("held-out loss: initial %.6f, plain %.6f, avgpipe N=1 reference %.6f, avgpipe N=2 reference %.6f\n", before,
           evaluate((const float *const *)plain), evaluate((const float *const *)ref1), evaluate((const float *const *)ref2));
    printf("N=1 alpha=0 vs plain loop: parameters and losses %s\n", same ? "bitwise identical" : "DIFFER");
    if (!same || !(evaluate((const float *const *)ref2) < 0.5 * before)) return 1;
    return 0;
}
