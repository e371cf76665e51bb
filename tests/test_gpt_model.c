/* Tests of examples/gpt_model.h, the byte-level GPT the pipeline example and gpt_reference train.
     - gradients: the analytic gradient of every tensor of every partition (1, 2 and 3 partitions) against
       central finite differences of an independent float64 forward written here from the documented
       model (not from the header's code);
     - partitions: the activations passed between partitions give the single partition's loss bit for
       bit, its gradients bit for bit except wte, whose two copies sum to its gradient;
     - variable T and padding: padded tokens change nothing; a micro-batch padded to a longer T gives the
       same loss and gradients;
     - the tie and AdamW keep both wte copies bit-identical; norms, the schedule;
     - save/load: the same bytes for 1, 2 and 3 partitions; errors;
     - data: a fortunes-format directory written here (documents split on "%" lines, .dat files and
       symlinks skipped), windows, the split, batches as a pure function of (seed, step, micro-batch),
       padding; a missing directory names the Debian package.
   Build: gcc -std=c11 -O2 -Wall -Wextra -I. tests/test_gpt_model.c -o /tmp/test_gpt_model -lcriterion -lopenblas -lm */
#define _POSIX_C_SOURCE 200809L
#include "examples/gpt_model.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void openblas_set_num_threads(int num_threads); /* OpenBLAS's own */

static void one_thread(void) {
    openblas_set_num_threads(1);
}

/* The tiny model of the gradient checks. */
static gpt_config tiny(void) {
    gpt_config c;
    c.C = 16, c.L = 2, c.H = 2, c.Tmax = 6, c.B = 2;
    return c;
}

/* ---- An independent float64 model, from the header comment's description -------------------------------- */

/* Offset of tensor (layer, index) in the canonical order (the single partition's array, the save file). */
static size_t canon_off(const gpt_config *c, int layer, int index) {
    size_t C = (size_t)c->C, V = 256, blk = 12 * C * C + 13 * C, off;
    const size_t sizes[12] = {C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C};
    int i;
    if (layer == 0) return index == 0 ? 0 : V * C;
    off = V * C + (size_t)c->Tmax * C;
    if (layer <= c->L) {
        off += (size_t)(layer - 1) * blk;
        for (i = 0; i < index; i++) off += sizes[i];
        return off;
    }
    return off + (size_t)c->L * blk + (index == 0 ? 0 : C);
}

static void ref_ln(const double *x, const double *w, const double *b, double *y, int N, int C) {
    int i, c;
    for (i = 0; i < N; i++) {
        double m = 0, v = 0, s;
        for (c = 0; c < C; c++) m += x[i * C + c];
        m /= C;
        for (c = 0; c < C; c++) v += (x[i * C + c] - m) * (x[i * C + c] - m);
        s = 1.0 / sqrt(v / C + 1e-5);
        for (c = 0; c < C; c++) y[i * C + c] = (x[i * C + c] - m) * s * w[c] + b[c];
    }
}

/* y[N x out] = x[N x in] W^T + b, plain loops. */
static void ref_lin(const double *x, const double *W, const double *b, double *y, int N, int in, int out) {
    int i, o, k;
    for (i = 0; i < N; i++)
        for (o = 0; o < out; o++) {
            double s = b ? b[o] : 0;
            for (k = 0; k < in; k++) s += x[i * in + k] * W[o * in + k];
            y[i * out + o] = s;
        }
}

/* Sum over positions of mask * -log softmax(logits)[target], the whole model in double. */
static double ref_loss(const gpt_config *c, const double *w, const gpt_micro *mb) {
    const int C = c->C, H = c->H, hs = C / H, T = mb->T, N = mb->rows * T, V = 256;
    double *x = calloc((size_t)N * C, 8), *ln = calloc((size_t)N * C, 8), *qkv = calloc((size_t)N * 3 * C, 8);
    double *y = calloc((size_t)N * C, 8), *tmp = calloc((size_t)N * 4 * C, 8), *lg = calloc((size_t)N * V, 8), loss = 0;
    int i, l, b, h, t, j, k;
    for (i = 0; i < N; i++)
        for (k = 0; k < C; k++) x[i * C + k] = w[(size_t)mb->tokens[i] * C + k] + w[canon_off(c, 0, 1) + (size_t)(i % T) * C + k];
    for (l = 1; l <= c->L; l++) {
        const double *p[12];
        for (k = 0; k < 12; k++) p[k] = w + canon_off(c, l, k);
        ref_ln(x, p[0], p[1], ln, N, C);
        ref_lin(ln, p[2], p[3], qkv, N, C, 3 * C);
        for (b = 0; b < mb->rows; b++)
            for (h = 0; h < H; h++)
                for (t = 0; t < T; t++) {
                    double sc[64], mx = -1e300, sum = 0;
                    const double *q = qkv + (size_t)(b * T + t) * 3 * C + h * hs;
                    for (j = 0; j <= t; j++) {
                        const double *kk = qkv + (size_t)(b * T + j) * 3 * C + C + h * hs;
                        double s = 0;
                        for (k = 0; k < hs; k++) s += q[k] * kk[k];
                        sc[j] = s / sqrt((double)hs);
                        if (sc[j] > mx) mx = sc[j];
                    }
                    for (j = 0; j <= t; j++) sum += (sc[j] = exp(sc[j] - mx));
                    for (k = 0; k < hs; k++) {
                        double s = 0;
                        for (j = 0; j <= t; j++) s += sc[j] / sum * qkv[(size_t)(b * T + j) * 3 * C + 2 * C + h * hs + k];
                        y[(size_t)(b * T + t) * C + h * hs + k] = s;
                    }
                }
        ref_lin(y, p[4], p[5], tmp, N, C, C);
        for (i = 0; i < N * C; i++) x[i] += tmp[i];
        ref_ln(x, p[6], p[7], ln, N, C);
        ref_lin(ln, p[8], p[9], tmp, N, C, 4 * C);
        for (i = 0; i < N * 4 * C; i++) {
            double u = tmp[i];
            tmp[i] = 0.5 * u * (1 + tanh(sqrt(2 / 3.141592653589793) * (u + 0.044715 * u * u * u)));
        }
        ref_lin(tmp, p[10], p[11], y, N, 4 * C, C);
        for (i = 0; i < N * C; i++) x[i] += y[i];
    }
    ref_ln(x, w + canon_off(c, c->L + 1, 0), w + canon_off(c, c->L + 1, 1), ln, N, C);
    ref_lin(ln, w, NULL, lg, N, C, V);
    for (i = 0; i < N; i++) {
        double mx = -1e300, s = 0;
        for (k = 0; k < V; k++) mx = lg[i * V + k] > mx ? lg[i * V + k] : mx;
        for (k = 0; k < V; k++) s += exp(lg[i * V + k] - mx);
        if (mb->mask[i] != 0) loss += mb->mask[i] * (mx + log(s) - lg[i * V + mb->targets[i]]);
    }
    free(x), free(ln), free(qkv), free(y), free(tmp), free(lg);
    return loss;
}

/* ---- Helpers -------------------------------------------------------------------------------------------- */

/* The tests' own random numbers (splitmix64), independent of the header's. */
static uint64_t rnd_state;
static double rnd_uniform(void) {
    uint64_t z = (rnd_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)((z >> 11) + 1) / 9007199254740992.0;
}
static double rnd_normal(void) {
    double u = rnd_uniform(), v = rnd_uniform();
    return sqrt(-2 * log(u)) * cos(6.283185307179586 * v);
}

typedef struct model {
    gpt_config cfg;
    int S;
    gpt_part part[4];
    float *param[4], *grad[4], *stash[4], *work[4], *act[4], *dact[4];
} model;

static void model_init(model *m, const gpt_config *c, int S, const int *split) {
    char err[256];
    int s;
    memset(m, 0, sizeof *m);
    m->cfg = *c, m->S = S;
    cr_assert_eq(gpt_partition(c, S, split, m->part, err, sizeof err), 0, "%s", err);
    for (s = 0; s < S; s++) {
        m->param[s] = calloc(m->part[s].nparams, 4), m->grad[s] = calloc(m->part[s].nparams, 4);
        m->stash[s] = calloc(gpt_part_stash_floats(&m->part[s]), 4), m->work[s] = calloc(gpt_part_work_floats(&m->part[s]), 4);
        m->act[s] = calloc(gpt_act_floats(c), 4), m->dact[s] = calloc(gpt_act_floats(c), 4);
        cr_assert(m->param[s] && m->grad[s] && m->stash[s] && m->work[s] && m->act[s] && m->dact[s]);
    }
}

static void model_free(model *m) {
    int s;
    for (s = 0; s < m->S; s++) free(m->param[s]), free(m->grad[s]), free(m->stash[s]), free(m->work[s]), free(m->act[s]), free(m->dact[s]);
}

/* Set every partition's parameters from canonical values (double), each tensor by its (layer, index). */
static void model_set(model *m, const double *canon) {
    gpt_tensor t[64];
    int s, i, n;
    size_t j;
    for (s = 0; s < m->S; s++) {
        n = gpt_part_tensors(&m->part[s], t);
        for (i = 0; i < n; i++)
            for (j = 0; j < t[i].len; j++) m->param[s][t[i].off + j] = (float)canon[canon_off(&m->cfg, t[i].layer, t[i].index) + j];
    }
}

/* Forward every partition; returns the loss sum. */
static double model_forward(model *m, const gpt_micro *mb) {
    double loss = -1;
    int s;
    for (s = 0; s < m->S; s++)
        cr_assert_eq(gpt_forward(&m->part[s], m->param[s], mb, s ? m->act[s - 1] : NULL, s + 1 < m->S ? m->act[s] : NULL, m->stash[s], &loss), 0);
    return loss;
}

/* Backward every partition (last first), gradients added. */
static void model_backward(model *m, double weight) {
    int s;
    for (s = m->S - 1; s >= 0; s--)
        cr_assert_eq(gpt_backward(&m->part[s], m->param[s], m->grad[s], m->stash[s], s + 1 < m->S ? m->dact[s] : NULL, s ? m->dact[s - 1] : NULL,
                                  m->work[s], weight),
                     0);
}

static void model_zero_grad(model *m) {
    int s;
    for (s = 0; s < m->S; s++) memset(m->grad[s], 0, m->part[s].nparams * 4);
}

/* Random canonical parameters: weights N(0, 0.3), biases N(0, 0.2), LayerNorm gains 1 + N(0, 0.2); larger
   than the initialisation, so that attention is far from uniform and every path carries gradient. */
static double *random_canon(const gpt_config *c, uint64_t seed) {
    size_t n = gpt_config_params(c), i;
    double *w = malloc(n * 8);
    gpt_tensor t[GPT_MAX_TENSORS];
    int l, k, nt;
    rnd_state = seed;
    for (l = 0; l < c->L + 2; l++) {
        nt = gpt_layer_tensors(c, l, 0, t);
        for (k = 0; k < nt; k++)
            for (i = 0; i < t[k].len; i++) {
                double z = rnd_normal();
                w[canon_off(c, l, k) + i] = t[k].rows > 1 ? 0.3 * z : t[k].init == GPT_INIT_ONE ? 1 + 0.2 * z : 0.2 * z;
            }
    }
    return w;
}

/* A micro-batch of random bytes: row r has len[r] real positions, the rest padding (mask 0). */
static void make_micro(gpt_micro *mb, int rows, int T, const int *len, uint64_t seed) {
    int i, t;
    rnd_state = seed;
    mb->rows = rows, mb->T = T, mb->ntok = 0;
    for (i = 0; i < rows; i++)
        for (t = 0; t < T; t++) {
            size_t k = (size_t)i * T + t;
            mb->tokens[k] = (uint8_t)(rnd_uniform() * 255.999);
            mb->targets[k] = (uint8_t)(rnd_uniform() * 255.999);
            mb->mask[k] = t < len[i] ? 1.0f : 0.0f;
            mb->ntok += t < len[i];
        }
}

/* ---- Layout ------------------------------------------------------------------------------------------------ */

Test(gpt, layout_follows_the_documented_order) {
    gpt_config c = tiny();
    gpt_part p[3];
    gpt_tensor t[64];
    char err[256];
    size_t C = 16, V = 256, off, len, total = gpt_config_params(&c);
    int split[3] = {1, 2, 1}, i, n, s;
    cr_assert_eq(total, V * C + 6 * C + 2 * (12 * C * C + 13 * C) + 2 * C);
    cr_assert_eq(gpt_partition(&c, 1, NULL, p, err, sizeof err), 0, "%s", err);
    cr_assert_eq(p[0].nparams, total);
    cr_assert(p[0].wte_off == 0 && p[0].wte_len == V * C && !p[0].wte_copy);
    n = gpt_part_tensors(&p[0], t);
    cr_assert_eq(n, 2 + 24 + 2);
    for (i = 0; i < n; i++) cr_assert_eq(t[i].off, canon_off(&c, t[i].layer, t[i].index), "tensor %s", t[i].name);
    cr_assert_eq(gpt_partition(&c, 3, split, p, err, sizeof err), 0, "%s", err);
    cr_assert(p[0].lo == 0 && p[0].hi == 1 && p[1].hi == 3 && p[2].hi == 4);
    cr_assert_eq(p[0].nparams, V * C + 6 * C);
    cr_assert_eq(p[2].nparams, 2 * C + V * C);
    cr_assert(p[2].wte_copy && p[2].wte_off == 2 * C && p[2].wte_len == V * C);
    cr_assert(p[1].wte_len == 0 && !p[1].wte_copy);
    cr_assert_eq(gpt_part_layout(&c, 3, 4, &off, &len), p[2].nparams);
    cr_assert(off == 2 * C && len == V * C);
    n = gpt_part_tensors(&p[2], t);
    cr_assert(n == 3 && t[2].layer == 0 && t[2].index == 0 && t[2].off == 2 * C && !strcmp(t[2].name, "wte"));
    for (s = 0; s < 3; s++) cr_assert(gpt_part_stash_floats(&p[s]) > 0 && gpt_part_work_floats(&p[s]) > 0);
    /* even split: the first (L + 2) % S partitions get the extra layer */
    cr_assert_eq(gpt_partition(&c, 3, NULL, p, err, sizeof err), 0, "%s", err);
    cr_assert(p[0].hi == 2 && p[1].hi == 3 && p[2].hi == 4);
    cr_assert_eq(gpt_partition(&c, 5, NULL, p, err, sizeof err), -1);
    cr_assert(strstr(err, "stages 5"), "%s", err);
    split[1] = 1;
    cr_assert_eq(gpt_partition(&c, 3, split, p, err, sizeof err), -1);
    cr_assert(strstr(err, "adds up to 3"), "%s", err);
    c.H = 3;
    cr_assert_eq(gpt_part_init(p, &c, 0, 4, err, sizeof err), -1);
    cr_assert(strstr(err, "heads 3"), "%s", err);
}

Test(gpt, split_parse) {
    int v[8], n;
    char err[128];
    cr_assert_eq(gpt_split_parse("2,2,1,1", v, 8, &n, err, sizeof err), 0);
    cr_assert(n == 4 && v[0] == 2 && v[3] == 1);
    cr_assert_eq(gpt_split_parse("2,,1", v, 8, &n, err, sizeof err), -1);
    cr_assert_eq(gpt_split_parse("2,0", v, 8, &n, err, sizeof err), -1);
    cr_assert_eq(gpt_split_parse("3,", v, 8, &n, err, sizeof err), -1);
    cr_assert_eq(gpt_split_parse("x", v, 8, &n, err, sizeof err), -1);
    cr_assert(strstr(err, "split 'x'"), "%s", err);
}

/* ---- Gradients against finite differences -------------------------------------------------------------------- */

/* Batch of the checks: micro-batch 0 has T = 5 (row 1 padded after 3 positions), micro-batch 1 T = 3
   (row 0 padded after 2). The loss is the mean over their non-padding positions. */
static void check_batch(gpt_micro *mb) {
    const int len0[2] = {5, 3}, len1[2] = {2, 3};
    cr_assert_eq(gpt_micro_alloc(&mb[0], 2, 6), 0);
    cr_assert_eq(gpt_micro_alloc(&mb[1], 2, 6), 0);
    make_micro(&mb[0], 2, 5, len0, 11);
    make_micro(&mb[1], 2, 3, len1, 12);
}

static double batch_ref_loss(const gpt_config *c, const double *w, const gpt_micro *mb) {
    return (ref_loss(c, w, &mb[0]) + ref_loss(c, w, &mb[1])) / (mb[0].ntok + mb[1].ntok);
}

/* Analytic gradient of the batch for model m (zeroed, accumulated over both micro-batches). */
static double model_batch_grad(model *m, const gpt_micro *mb) {
    double weight = mb[0].ntok + mb[1].ntok, loss = 0;
    int u;
    model_zero_grad(m);
    for (u = 0; u < 2; u++) {
        loss += model_forward(m, &mb[u]);
        model_backward(m, weight);
    }
    return loss / weight;
}

/* Worst |analytic - fd| of a tensor, relative to the tensor's largest |fd|. */
static double tensor_err(const float *a, const double *fd, size_t n, double *scale) {
    double mx = 0, e = 0;
    size_t i;
    for (i = 0; i < n; i++) mx = fabs(fd[i]) > mx ? fabs(fd[i]) : mx;
    for (i = 0; i < n; i++) e = fabs(a[i] - fd[i]) > e ? fabs(a[i] - fd[i]) : e;
    *scale = mx;
    return mx > 0 ? e / mx : e;
}

#define GRAD_TOL 2e-5 /* measured worst 1.0e-6 (float against float64); 0.0447 for 0.044715 in GELU's backward gives 2.2e-5 */

Test(gpt, gradients_match_float64_finite_differences, .init = one_thread, .timeout = 120) {
    gpt_config c = tiny();
    gpt_micro mb[2];
    size_t n = gpt_config_params(&c), i;
    double *w = random_canon(&c, 7), *fd = malloc(n * 8), loss_ref;
    const int splits[3][4] = {{4}, {2, 2}, {1, 2, 1}};
    const int S[3] = {1, 2, 3};
    int k;
    check_batch(mb);
    loss_ref = batch_ref_loss(&c, w, mb);
    for (i = 0; i < n; i++) { /* central differences, h = 1e-5, of the float64 loss */
        double keep = w[i], lp, lm;
        w[i] = keep + 1e-5, lp = batch_ref_loss(&c, w, mb);
        w[i] = keep - 1e-5, lm = batch_ref_loss(&c, w, mb);
        w[i] = keep;
        fd[i] = (lp - lm) / 2e-5;
    }
    for (k = 0; k < 3; k++) {
        model m;
        gpt_tensor t[64];
        float *wte_sum = calloc(256 * 16, 4);
        double loss, scale, e;
        int s, j, nt;
        model_init(&m, &c, S[k], splits[k]);
        model_set(&m, w);
        loss = model_batch_grad(&m, mb);
        cr_assert(fabs(loss - loss_ref) <= 1e-6 * fabs(loss_ref), "%d partitions: loss %.9g, float64 %.9g", S[k], loss, loss_ref);
        for (s = 0; s < S[k]; s++) {
            nt = gpt_part_tensors(&m.part[s], t);
            for (j = 0; j < nt; j++) {
                const float *a = m.grad[s] + t[j].off;
                if (t[j].layer == 0 && t[j].index == 0) { /* wte: its copies' gradients add up to the tied gradient */
                    for (i = 0; i < t[j].len; i++) wte_sum[i] += a[i];
                    continue;
                }
                e = tensor_err(a, fd + canon_off(&c, t[j].layer, t[j].index), t[j].len, &scale);
                cr_assert(scale > 1e-4, "%s has no gradient to check (%g)", t[j].name, scale);
                cr_assert(e <= GRAD_TOL, "%d partitions, partition %d, %s: worst error %.3g of %.3g", S[k], s, t[j].name, e, scale);
            }
        }
        e = tensor_err(wte_sum, fd, 256 * 16, &scale);
        cr_assert(e <= GRAD_TOL, "%d partitions, wte (copies summed): worst error %.3g of %.3g", S[k], e, scale);
        free(wte_sum);
        model_free(&m);
    }
    /* a wrong gradient fails: one float off by 1% of the scale is seen */
    {
        float a[4] = {1, 2, 3, 4};
        double f[4] = {1, 2, 3.04, 4}, scale;
        cr_assert(tensor_err(a, f, 4, &scale) > GRAD_TOL);
    }
    gpt_micro_free(&mb[0]), gpt_micro_free(&mb[1]);
    free(w), free(fd);
}

/* Partitioned models: the same loss bit for bit, the same gradients bit for bit except wte. */
Test(gpt, partitions_agree_bit_for_bit, .init = one_thread) {
    gpt_config c = tiny();
    gpt_micro mb[2];
    double *w = random_canon(&c, 3);
    const int splits[5][4] = {{2, 2}, {1, 2, 1}, {1, 1, 1, 1}, {3, 1}, {1, 3}};
    const int S[5] = {2, 3, 4, 2, 2};
    model one;
    double loss1;
    int k;
    check_batch(mb);
    model_init(&one, &c, 1, NULL);
    model_set(&one, w);
    loss1 = model_batch_grad(&one, mb);
    for (k = 0; k < 5; k++) {
        model m;
        gpt_tensor t[64];
        double loss;
        int s, j, nt;
        size_t i;
        model_init(&m, &c, S[k], splits[k]);
        model_set(&m, w);
        loss = model_batch_grad(&m, mb);
        cr_assert(loss == loss1, "split %d: loss %.17g, single %.17g", k, loss, loss1);
        for (s = 0; s < S[k]; s++) {
            nt = gpt_part_tensors(&m.part[s], t);
            for (j = 0; j < nt; j++) {
                const float *a = m.grad[s] + t[j].off, *b = one.grad[0] + canon_off(&c, t[j].layer, t[j].index);
                if (t[j].layer == 0 && t[j].index == 0 && S[k] > 1) continue;
                cr_assert(!memcmp(a, b, t[j].len * 4), "split %d partition %d: %s differs from the single partition", k, s, t[j].name);
            }
        }
        if (S[k] > 1) { /* wte: first + last copy = single, up to the order of the additions */
            const float *g0 = m.grad[0], *g1 = m.grad[S[k] - 1] + m.part[S[k] - 1].wte_off;
            for (i = 0; i < 256 * 16; i++) {
                float sum = g0[i] + g1[i], ref = one.grad[0][i];
                cr_assert(fabsf(sum - ref) <= 1e-6f * (fabsf(ref) + 1e-3f), "split %d: wte[%zu] %.9g vs %.9g", k, i, sum, ref);
            }
        }
        model_free(&m);
    }
    model_free(&one);
    gpt_micro_free(&mb[0]), gpt_micro_free(&mb[1]);
    free(w);
}

/* ---- Variable T and padding ------------------------------------------------------------------------------------ */

Test(gpt, padding_changes_nothing, .init = one_thread) {
    gpt_config c = tiny();
    gpt_micro mb[2];
    double *w = random_canon(&c, 5), loss_a, loss_b;
    model a, b;
    int s, i;
    check_batch(mb);
    model_init(&a, &c, 2, NULL), model_init(&b, &c, 2, NULL);
    model_set(&a, w), model_set(&b, w);
    loss_a = model_batch_grad(&a, mb);
    for (i = 0; i < mb[0].rows * mb[0].T; i++) /* other bytes at every padded position */
        if (mb[0].mask[i] == 0) mb[0].tokens[i] ^= 0x5a, mb[0].targets[i] ^= 0xa5;
    for (i = 0; i < mb[1].rows * mb[1].T; i++)
        if (mb[1].mask[i] == 0) mb[1].tokens[i] = 0, mb[1].targets[i] = 255;
    loss_b = model_batch_grad(&b, mb);
    cr_assert(loss_a == loss_b, "loss %.17g vs %.17g", loss_a, loss_b);
    for (s = 0; s < 2; s++) cr_assert(!memcmp(a.grad[s], b.grad[s], a.part[s].nparams * 4), "partition %d: gradients differ", s);
    model_free(&a), model_free(&b);
    gpt_micro_free(&mb[0]), gpt_micro_free(&mb[1]);
    free(w);
}

/* The T = 3 micro-batch padded to T = 5: the same loss and gradients up to float rounding (other BLAS shapes). */
Test(gpt, longer_T_with_padding_gives_the_same_result, .init = one_thread) {
    gpt_config c = tiny();
    gpt_micro m3, m5;
    double *w = random_canon(&c, 9), l3, l5;
    model a, b;
    const int len[2] = {2, 3};
    int r, t;
    size_t i;
    cr_assert_eq(gpt_micro_alloc(&m3, 2, 6), 0);
    cr_assert_eq(gpt_micro_alloc(&m5, 2, 6), 0);
    make_micro(&m3, 2, 3, len, 12);
    m5.rows = 2, m5.T = 5, m5.ntok = m3.ntok;
    for (r = 0; r < 2; r++)
        for (t = 0; t < 5; t++) {
            int in = t < 3;
            m5.tokens[r * 5 + t] = in ? m3.tokens[r * 3 + t] : 7;
            m5.targets[r * 5 + t] = in ? m3.targets[r * 3 + t] : 9;
            m5.mask[r * 5 + t] = in ? m3.mask[r * 3 + t] : 0.0f;
        }
    model_init(&a, &c, 1, NULL), model_init(&b, &c, 1, NULL);
    model_set(&a, w), model_set(&b, w);
    l3 = model_forward(&a, &m3), model_backward(&a, m3.ntok);
    l5 = model_forward(&b, &m5), model_backward(&b, m5.ntok);
    cr_assert(fabs(l3 - l5) <= 1e-6 * fabs(l3), "loss %.9g vs %.9g", l3, l5);
    { /* per tensor, relative to its largest gradient (elements that cancel differ more in relative terms) */
        gpt_tensor tt[64];
        int j, nt = gpt_part_tensors(&a.part[0], tt);
        for (j = 0; j < nt; j++) {
            double mx = 0, e = 0;
            for (i = tt[j].off; i < tt[j].off + tt[j].len; i++) {
                mx = fabs(a.grad[0][i]) > mx ? fabs(a.grad[0][i]) : mx;
                e = fabs(a.grad[0][i] - b.grad[0][i]) > e ? fabs(a.grad[0][i] - b.grad[0][i]) : e;
            }
            cr_assert(e <= 1e-5 * mx, "%s: worst difference %.3g of %.3g", tt[j].name, e, mx);
        }
    }
    model_free(&a), model_free(&b);
    gpt_micro_free(&m3), gpt_micro_free(&m5);
    free(w);
}

Test(gpt, bad_micro_batches_are_refused) {
    gpt_config c = tiny();
    gpt_micro mb;
    model m;
    const int len[3] = {3, 3, 3};
    cr_assert_eq(gpt_micro_alloc(&mb, 3, 7), 0);
    model_init(&m, &c, 2, NULL);
    make_micro(&mb, 2, 7, len, 1); /* T 7 > Tmax 6 */
    cr_assert_eq(gpt_forward(&m.part[0], m.param[0], &mb, NULL, m.act[0], m.stash[0], NULL), -1);
    make_micro(&mb, 3, 3, len, 1); /* 3 rows > B 2 */
    cr_assert_eq(gpt_forward(&m.part[0], m.param[0], &mb, NULL, m.act[0], m.stash[0], NULL), -1);
    make_micro(&mb, 2, 3, len, 1);
    cr_assert_eq(gpt_forward(&m.part[1], m.param[1], &mb, NULL, NULL, m.stash[1], NULL), -1, "no input activation");
    cr_assert_eq(gpt_forward(&m.part[0], m.param[0], &mb, NULL, m.act[0], m.stash[0], NULL), 0);
    /* partition 1's backward on partition 0's stash */
    cr_assert_eq(gpt_backward(&m.part[1], m.param[1], m.grad[1], m.stash[0], NULL, m.dact[0], m.work[1], 6), -1);
    cr_assert_eq(gpt_backward(&m.part[0], m.param[0], m.grad[0], m.stash[0], m.dact[0], NULL, m.work[0], 0), -1, "batch weight 0");
    model_free(&m);
    gpt_micro_free(&mb);
}

/* ---- The tie, AdamW, norms, schedule ---------------------------------------------------------------------------- */

/* A few steps of the documented training step on 2 and 1 partitions: both wte copies stay bit-identical,
   and the two models agree up to the order of the wte gradient's additions. */
Test(gpt, tie_and_adamw_keep_the_copies_identical, .init = one_thread) {
    gpt_config c = tiny();
    gpt_micro mb[2];
    model two, one;
    gpt_adamw_hp hp = gpt_adamw_defaults();
    float *mo[2], *vo[2], *m1, *v1;
    int step, s;
    size_t i, V = 256 * 16;
    check_batch(mb);
    model_init(&two, &c, 2, NULL), model_init(&one, &c, 1, NULL);
    for (s = 0; s < 2; s++) {
        gpt_init(&two.part[s], two.param[s], 42);
        mo[s] = calloc(two.part[s].nparams, 4), vo[s] = calloc(two.part[s].nparams, 4);
    }
    gpt_init(&one.part[0], one.param[0], 42);
    m1 = calloc(one.part[0].nparams, 4), v1 = calloc(one.part[0].nparams, 4);
    cr_assert(!memcmp(two.param[0], two.param[1] + two.part[1].wte_off, V * 4), "initial wte copies differ");
    for (step = 0; step < 5; step++) {
        double total = 0.0;
        float lr = (float)gpt_lr(1e-2, step, 2, 5), scale;
        model_batch_grad(&two, mb);
        model_batch_grad(&one, mb);
        gpt_tie_sum(two.grad[0] + two.part[0].wte_off, two.grad[1] + two.part[1].wte_off, V);
        for (s = 0; s < 2; s++) total += gpt_sumsq(&two.part[s], two.grad[s], two.part[s].wte_copy);
        cr_assert(fabs(total - gpt_sumsq(&one.part[0], one.grad[0], 0)) <= 1e-5 * total, "norms: %.9g vs %.9g", total,
                  gpt_sumsq(&one.part[0], one.grad[0], 0));
        scale = gpt_clip_scale(total, 0.5);
        for (s = 0; s < 2; s++) gpt_adamw(&two.part[s], two.param[s], two.grad[s], mo[s], vo[s], step + 1, lr, scale, &hp);
        gpt_adamw(&one.part[0], one.param[0], one.grad[0], m1, v1, step + 1, lr, gpt_clip_scale(gpt_sumsq(&one.part[0], one.grad[0], 0), 0.5), &hp);
        cr_assert(!memcmp(two.param[0], two.param[1] + two.part[1].wte_off, V * 4), "step %d: wte copies differ", step);
    }
    for (i = 0; i < one.part[0].nparams; i++) {
        const float *x = i < two.part[0].nparams ? two.param[0] + i : two.param[1] + (i - two.part[0].nparams);
        cr_assert(fabsf(*x - one.param[0][i]) <= 1e-5f, "param %zu: %.9g vs %.9g", i, *x, one.param[0][i]);
    }
    for (s = 0; s < 2; s++) free(mo[s]), free(vo[s]);
    free(m1), free(v1);
    model_free(&two), model_free(&one);
    gpt_micro_free(&mb[0]), gpt_micro_free(&mb[1]);
}

Test(gpt, adamw_step_by_hand) {
    gpt_config c = tiny();
    gpt_part p;
    gpt_adamw_hp hp = gpt_adamw_defaults();
    float *x, *g, *m, *v;
    size_t n, wpe = 256 * 16, bias = canon_off(&c, 1, 3);
    double gs, mh, vh, want;
    cr_assert_eq(gpt_part_init(&p, &c, 0, 4, NULL, 0), 0);
    n = p.nparams;
    x = calloc(n, 4), g = calloc(n, 4), m = calloc(n, 4), v = calloc(n, 4);
    x[wpe] = 0.5f, g[wpe] = 2.0f, x[bias] = 0.5f, g[bias] = 2.0f;
    gpt_adamw(&p, x, g, m, v, 1, 0.01f, 0.25f, &hp);
    gs = 0.5, mh = 0.1 * gs / 0.1, vh = 0.05 * gs * gs / 0.05;
    want = 0.5 - 0.01 * (mh / (sqrt(vh) + 1e-8) + 0.1 * 0.5); /* wpe is 2-D: decayed */
    cr_assert(fabs(x[wpe] - want) <= 1e-6, "wpe: %.9g, want %.9g", x[wpe], want);
    want = 0.5 - 0.01 * (mh / (sqrt(vh) + 1e-8)); /* a bias: not decayed */
    cr_assert(fabs(x[bias] - want) <= 1e-6, "bias: %.9g, want %.9g", x[bias], want);
    cr_assert(fabsf(m[wpe] - 0.05f) <= 1e-7f && fabsf(v[wpe] - 0.0125f) <= 1e-7f, "m %.9g v %.9g", m[wpe], v[wpe]);
    cr_assert_eq(x[0], 0.0f, "a zero parameter with zero gradient stays zero");
    free(x), free(g), free(m), free(v);
}

Test(gpt, sumsq_clip_nonfinite_and_schedule) {
    gpt_config c = tiny();
    gpt_part p[2];
    float *g;
    size_t i;
    double s;
    cr_assert_eq(gpt_partition(&c, 2, NULL, p, NULL, 0), 0);
    g = calloc(p[1].nparams, 4);
    for (i = 0; i < p[1].nparams; i++) g[i] = 1.0f;
    g[0] = 3.0f;
    s = gpt_sumsq(&p[1], g, 0);
    cr_assert_eq(s, (double)p[1].nparams - 1 + 9);
    s = gpt_sumsq(&p[1], g, 1);
    cr_assert_eq(s, (double)(p[1].nparams - p[1].wte_len) - 1 + 9, "wte range left out");
    cr_assert_eq(gpt_nonfinite(g, p[1].nparams), 0);
    g[5] = NAN, g[7] = INFINITY, g[9] = -INFINITY;
    cr_assert_eq(gpt_nonfinite(g, p[1].nparams), 3);
    free(g);
    cr_assert_eq(gpt_clip_scale(4.0, 1.0), (float)(1.0 / (2.0 + 1e-6)));
    cr_assert_eq(gpt_clip_scale(0.25, 1.0), 1.0f);
    cr_assert_eq(gpt_clip_scale(100.0, 0.0), 1.0f, "clip 0: no clipping");
    cr_assert(fabs(gpt_lr(1.0, 0, 10, 100) - 0.1) < 1e-15);
    cr_assert(fabs(gpt_lr(1.0, 9, 10, 100) - 1.0) < 1e-15);
    cr_assert(fabs(gpt_lr(1.0, 10, 10, 100) - 1.0) < 1e-15);
    cr_assert(fabs(gpt_lr(1.0, 99, 10, 100) - 0.1) < 1e-12);
    cr_assert(fabs(gpt_lr(1.0, 500, 10, 100) - 0.1) < 1e-12);
    cr_assert(fabs(gpt_lr(1.0, 10 + 89 / 2.0, 10, 100) - 0.55) < 0.02);
    for (i = 11; i < 100; i++) cr_assert(gpt_lr(1.0, (long)i, 10, 100) <= gpt_lr(1.0, (long)i - 1, 10, 100));
}

/* ---- Save and load ---------------------------------------------------------------------------------------------- */

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    char *b;
    long sz;
    cr_assert(f, "open %s", path);
    fseek(f, 0, SEEK_END), sz = ftell(f), fseek(f, 0, SEEK_SET);
    b = malloc((size_t)sz + 1);
    cr_assert_eq(fread(b, 1, (size_t)sz, f), (size_t)sz);
    fclose(f);
    *n = (size_t)sz;
    return b;
}

Test(gpt, save_is_the_same_bytes_for_any_partitioning) {
    gpt_config c = tiny();
    char dir[] = "/tmp/gpt_save_XXXXXX", path[3][128], err[256];
    const int S[3] = {1, 2, 3};
    size_t n[3], i;
    char *bytes[3];
    model m3, back;
    int k, s;
    cr_assert(mkdtemp(dir));
    for (k = 0; k < 3; k++) {
        model m;
        model_init(&m, &c, S[k], NULL);
        for (s = 0; s < S[k]; s++) gpt_init(&m.part[s], m.param[s], 1234);
        snprintf(path[k], sizeof path[k], "%s/m%d.bin", dir, S[k]);
        cr_assert_eq(gpt_save(path[k], m.part, S[k], m.param, err, sizeof err), 0, "%s", err);
        bytes[k] = slurp(path[k], &n[k]);
        model_free(&m);
    }
    cr_assert_eq(n[0], 40 + 4 * gpt_config_params(&c));
    {
        char tmp[160];
        model m;
        snprintf(tmp, sizeof tmp, "%s.tmp", path[0]);
        cr_assert(access(tmp, F_OK) != 0, "the temporary file was renamed");
        model_init(&m, &c, 1, NULL);
        cr_assert_eq(gpt_save("/nonexistent-dir/m.bin", m.part, 1, m.param, err, sizeof err), -1);
        cr_assert(strstr(err, "cannot create '/nonexistent-dir/m.bin.tmp'"), "%s", err);
        model_free(&m);
    }
    cr_assert(!memcmp(bytes[0], "GPTBYTE1", 8));
    for (k = 1; k < 3; k++) cr_assert(n[k] == n[0] && !memcmp(bytes[k], bytes[0], n[0]), "%d partitions: other bytes", S[k]);
    /* the 1-partition file loaded into 3 partitions: the 3-partition initial model, both wte copies */
    model_init(&m3, &c, 3, NULL), model_init(&back, &c, 3, NULL);
    for (s = 0; s < 3; s++) gpt_init(&m3.part[s], m3.param[s], 1234);
    cr_assert_eq(gpt_load(path[0], back.part, 3, back.param, err, sizeof err), 0, "%s", err);
    for (s = 0; s < 3; s++) cr_assert(!memcmp(m3.param[s], back.param[s], m3.part[s].nparams * 4), "partition %d", s);
    cr_assert(!memcmp(back.param[0], back.param[2] + back.part[2].wte_off, 256 * 16 * 4));
    /* the initial values: N(0, 0.02) for wte, 1 for ln1.w, 0 for biases */
    {
        double sum = 0, sq = 0;
        for (i = 0; i < 256 * 16; i++) sum += m3.param[0][i], sq += (double)m3.param[0][i] * m3.param[0][i];
        cr_assert(fabs(sum / 4096) < 0.002 && fabs(sqrt(sq / 4096) - 0.02) < 0.002, "wte mean %g std %g", sum / 4096, sqrt(sq / 4096));
        cr_assert_eq(m3.param[0][canon_off(&c, 1, 0)], 1.0f);
        cr_assert_eq(m3.param[0][canon_off(&c, 1, 1)], 0.0f);
    }
    /* errors: a truncated file, a file of another config */
    {
        char bad[160];
        FILE *f;
        gpt_config c2 = c;
        model o;
        snprintf(bad, sizeof bad, "%s/short.bin", dir);
        f = fopen(bad, "wb");
        fwrite(bytes[0], 1, n[0] - 4, f), fclose(f);
        cr_assert_eq(gpt_load(bad, back.part, 3, back.param, err, sizeof err), -1);
        cr_assert(strstr(err, "truncated"), "%s", err);
        f = fopen(bad, "wb");
        fwrite(bytes[0], 1, n[0], f), fwrite("x", 1, 1, f), fclose(f);
        cr_assert_eq(gpt_load(bad, back.part, 3, back.param, err, sizeof err), -1);
        cr_assert(strstr(err, "bytes after"), "%s", err);
        c2.L = 1;
        model_init(&o, &c2, 1, NULL);
        cr_assert_eq(gpt_load(path[0], o.part, 1, o.param, err, sizeof err), -1);
        cr_assert(strstr(err, "layers 2, the model has 1"), "%s", err);
        cr_assert_eq(gpt_load("/nonexistent/m.bin", o.part, 1, o.param, err, sizeof err), -1);
        cr_assert(strstr(err, "cannot open '/nonexistent/m.bin'"), "%s", err);
        model_free(&o);
        unlink(bad);
    }
    for (k = 0; k < 3; k++) unlink(path[k]), free(bytes[k]);
    rmdir(dir);
    model_free(&m3), model_free(&back);
}

/* ---- Data ---------------------------------------------------------------------------------------------------------- */

static void write_file(const char *dir, const char *name, const char *text) {
    char path[256];
    FILE *f;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    f = fopen(path, "wb");
    cr_assert(f, "create %s", path);
    fputs(text, f);
    fclose(f);
}

/* A fortunes directory: "a" holds 30 documents of 1..30 bytes of 'a'+k (then "\n"), "b" holds "hello\n"
   and a blank entry, "b.dat" and a symlink must be skipped, so must a subdirectory. */
static void make_corpus(char *dir) {
    char text[4096], sub[160];
    size_t at = 0;
    int k, j;
    cr_assert(mkdtemp(dir));
    for (k = 0; k < 30; k++) {
        for (j = 0; j <= k; j++) text[at++] = (char)('a' + k % 26);
        text[at++] = '\n';
        if (k < 29) text[at++] = '%', text[at++] = '\n';
    }
    text[at] = '\0';
    write_file(dir, "a", text);
    write_file(dir, "b", "hello\n%\n  \n%\n");
    write_file(dir, "b.dat", "\x01\x02%\nbinary\n%\n");
    snprintf(text, sizeof text, "%s/a", dir);
    snprintf(sub, sizeof sub, "%s/a.u8", dir);
    cr_assert_eq(symlink(text, sub), 0);
    snprintf(sub, sizeof sub, "%s/off", dir);
    cr_assert_eq(mkdir(sub, 0755), 0);
    write_file(sub, "x", "offensive\n");
}

static void remove_corpus(const char *dir) {
    const char *names[] = {"a", "b", "b.dat", "a.u8", "off/x"};
    char p[256];
    size_t i;
    for (i = 0; i < 5; i++) snprintf(p, sizeof p, "%s/%s", dir, names[i]), unlink(p);
    snprintf(p, sizeof p, "%s/off", dir), rmdir(p);
    rmdir(dir);
}

Test(gpt, data_documents_windows_and_split) {
    char dir[] = "/tmp/gpt_data_XXXXXX", err[256];
    gpt_data d;
    size_t i, want_tok = 0, nval = 0, ntrain = 0;
    int k;
    make_corpus(dir);
    cr_assert_eq(gpt_data_load(&d, dir, 8, 2, 1, err, sizeof err), 0, "%s", err);
    cr_assert_eq(d.nfiles, 2, "only the plain files a and b");
    cr_assert_eq(d.ndocs, 31, "30 in a, 1 in b (the blank entry is no document)");
    for (k = 0; k < 30; k++) want_tok += (size_t)k + 2 + 2; /* 0, k + 1 letters, newline, 0 */
    want_tok += 6 + 2;
    cr_assert_eq(d.ntok, want_tok);
    /* document 0: 0 'a' '\n' 0; document 29: 0, 30 x 'd', '\n', 0; document 30 (b's hello) */
    cr_assert(d.tok[0] == 0 && d.tok[1] == 'a' && d.tok[2] == '\n' && d.tok[3] == 0);
    cr_assert(d.tok[d.ntok - 8] == 0 && !memcmp(d.tok + d.ntok - 7, "hello\n", 6) && d.tok[d.ntok - 1] == 0);
    cr_assert_eq(d.nval_docs, 1, "document 19 (20 't') goes to validation");
    /* windows: document k has k + 3 targets, cut into ceil((k + 3) / 8) windows */
    for (k = 0; k < 31; k++) {
        size_t n = k < 30 ? (size_t)k + 3 : 7, w = (n + 7) / 8;
        if (k == 19) nval += w;
        else ntrain += w;
    }
    cr_assert_eq(d.ntrain, ntrain);
    cr_assert_eq(d.nval, nval);
    /* validation: 0, 20 't', '\n', 0 = 22 targets in windows of 8, 8, 6, sorted by length */
    cr_assert(d.val[0].len == 6 && d.val[1].len == 8 && d.val[2].len == 8, "sorted by length");
    for (i = 0; i < d.nval; i++) {
        uint32_t j;
        for (j = 0; j <= d.val[i].len; j++) {
            uint8_t x = d.tok[d.val[i].start + j];
            cr_assert(x == 't' || x == '\n' || x == 0, "validation window %zu: byte %d", i, x);
        }
    }
    cr_assert(d.tok[d.val[2].start] == 0 || d.tok[d.val[1].start] == 0, "one window starts the document");
    for (i = 1; i < d.ntrain; i++) cr_assert(d.train[i - 1].len <= d.train[i].len);
    cr_assert(fabs(d.val_targets - 22) < 1e-12);
    gpt_data_free(&d);
    remove_corpus(dir);
}

Test(gpt, data_batches_are_a_pure_function_of_seed_step_and_micro) {
    char dir[] = "/tmp/gpt_data_XXXXXX", err[256];
    gpt_data d, d2;
    gpt_micro a, b;
    const int M = 3;
    long nb, step;
    int u, r, t, *seen;
    make_corpus(dir);
    cr_assert_eq(gpt_data_load(&d, dir, 8, 2, 77, err, sizeof err), 0, "%s", err);
    cr_assert_eq(gpt_data_load(&d2, dir, 8, 2, 78, err, sizeof err), 0, "%s", err);
    cr_assert_eq(gpt_micro_alloc(&a, 2, 8), 0);
    cr_assert_eq(gpt_micro_alloc(&b, 2, 8), 0);
    nb = gpt_data_batches_per_epoch(&d, M);
    cr_assert_eq(d.nmicro, d.ntrain / 2);
    cr_assert_eq(nb, (long)(d.nmicro / M));
    cr_assert(nb >= 2);
    seen = calloc(d.ntok, sizeof(int));
    for (step = 0; step < 3 * nb; step++) {
        double tok = 0;
        for (u = 0; u < M; u++) {
            cr_assert_eq(gpt_data_micro(&d, step, u, M, &a), 0);
            cr_assert_eq(gpt_data_micro(&d, step, u, M, &b), 0); /* again: the same */
            cr_assert(a.T == b.T && a.rows == 2 && !memcmp(a.tokens, b.tokens, (size_t)a.rows * a.T) &&
                      !memcmp(a.mask, b.mask, sizeof(float) * a.rows * a.T));
            tok += a.ntok;
            for (r = 0; r < 2; r++) {
                int len = 0;
                for (t = 0; t < a.T; t++) len += a.mask[r * a.T + t] != 0;
                cr_assert(len >= 1);
                for (t = 0; t < a.T; t++) { /* real positions first, then padding; targets follow tokens */
                    cr_assert_eq(a.mask[r * a.T + t], t < len ? 1.0f : 0.0f);
                    if (t + 1 < len) cr_assert_eq(a.targets[r * a.T + t], a.tokens[r * a.T + t + 1]);
                    if (t >= len) cr_assert(a.tokens[r * a.T + t] == 0 && a.targets[r * a.T + t] == 0);
                }
                if (step < nb) { /* epoch 0: every window at most once; find it by its first token's address */
                    size_t i;
                    int found = 0;
                    for (i = 0; i < d.ntrain && !found; i++)
                        if (d.train[i].len == (uint32_t)len && !memcmp(d.tok + d.train[i].start, a.tokens + r * a.T, (size_t)len) &&
                            d.tok[d.train[i].start + len] == a.targets[r * a.T + len - 1] && !seen[d.train[i].start]) {
                            seen[d.train[i].start] = 1, found = 1;
                        }
                    cr_assert(found, "step %ld micro %d row %d: a window used twice or not a window", step, u, r);
                }
            }
            {
                int mx = 0;
                for (r = 0; r < 2; r++) {
                    int len = 0;
                    for (t = 0; t < a.T; t++) len += a.mask[r * a.T + t] != 0;
                    mx = len > mx ? len : mx;
                }
                cr_assert_eq(a.T, mx, "T is the longest row");
            }
        }
        cr_assert(fabs(tok - gpt_data_batch_tokens(&d, step, M)) < 1e-12);
    }
    /* epochs differ, and so do seeds */
    {
        int same_epoch = 1, same_seed = 1;
        for (u = 0; u < M; u++) {
            gpt_data_micro(&d, 0, u, M, &a), gpt_data_micro(&d, nb, u, M, &b);
            same_epoch &= a.T == b.T && !memcmp(a.tokens, b.tokens, (size_t)a.rows * a.T);
            gpt_data_micro(&d2, 0, u, M, &b);
            same_seed &= a.T == b.T && !memcmp(a.tokens, b.tokens, (size_t)a.rows * a.T);
        }
        cr_assert(!same_epoch && !same_seed);
    }
    cr_assert_eq(gpt_data_micro(&d, 0, M, M, &a), -1);
    cr_assert_eq(gpt_data_micro(&d, -1, 0, M, &a), -1);
    cr_assert_eq(gpt_data_micro(&d, 0, 0, (int)d.nmicro + 1, &a), -1, "no batch of that many micro-batches");
    /* validation micro-batches: fixed, padded past the end with empty rows */
    cr_assert_eq(gpt_data_val_micros(&d), 2);
    cr_assert_eq(gpt_data_val_micro(&d, 1, &a), 0);
    cr_assert(a.T == 8 && fabs(a.ntok - 8) < 1e-12, "last validation micro-batch: one window of 8 and an empty row");
    cr_assert_eq(gpt_data_val_micro(&d, 2, &a), -1);
    /* padding: by hand from the sorted windows */
    {
        double pad = 0, all = 0;
        size_t k;
        for (k = 0; k < d.nmicro; k++) {
            double T = d.train[2 * k + 1].len;
            all += 2 * T, pad += 2 * T - d.train[2 * k].len - d.train[2 * k + 1].len;
        }
        cr_assert(fabs(gpt_data_padding(&d) - pad / all) < 1e-15);
        cr_assert(gpt_data_padding(&d) < 0.2);
    }
    free(seen);
    gpt_micro_free(&a), gpt_micro_free(&b);
    gpt_data_free(&d), gpt_data_free(&d2);
    remove_corpus(dir);
}

Test(gpt, data_missing_directory_names_the_package) {
    gpt_data d;
    char err[512], dir[] = "/tmp/gpt_empty_XXXXXX";
    cr_assert_eq(gpt_data_load(&d, "/nonexistent/fortunes", 64, 8, 1, err, sizeof err), -1);
    cr_assert(strstr(err, "/nonexistent/fortunes") && strstr(err, "package fortunes") && strstr(err, "apt-get install fortunes"), "%s", err);
    cr_assert(d.tok == NULL && d.ntrain == 0);
    cr_assert(mkdtemp(dir));
    cr_assert_eq(gpt_data_load(&d, dir, 64, 8, 1, err, sizeof err), -1);
    cr_assert(strstr(err, "no fortunes") && strstr(err, "apt-get install fortunes"), "%s", err);
    rmdir(dir);
}

/* ---- Evaluation and sampling ----------------------------------------------------------------------------------------- */

Test(gpt, eval_and_sample, .init = one_thread) {
    char dir[] = "/tmp/gpt_data_XXXXXX", err[256], out1[64], out2[64], out3[64];
    gpt_config c = tiny();
    gpt_data d;
    gpt_micro mb;
    model m;
    double nats, bpb, loss = 0, tok = 0;
    size_t v;
    int s, n1, n2;
    c.Tmax = 8;
    make_corpus(dir);
    cr_assert_eq(gpt_data_load(&d, dir, 8, 2, 1, err, sizeof err), 0, "%s", err);
    model_init(&m, &c, 3, NULL);
    for (s = 0; s < 3; s++) gpt_init(&m.part[s], m.param[s], 5);
    cr_assert_eq(gpt_eval(m.part, 3, m.param, &d, 0, &nats, &bpb, err, sizeof err), 0, "%s", err);
    cr_assert_eq(gpt_micro_alloc(&mb, 2, 8), 0);
    for (v = 0; v < gpt_data_val_micros(&d); v++) {
        gpt_data_val_micro(&d, v, &mb);
        loss += model_forward(&m, &mb), tok += mb.ntok;
    }
    cr_assert(nats == loss / tok && fabs(bpb - nats / log(2.0)) < 1e-15);
    /* near uniform at the start; a little below, as the tied wte favours repeating the input byte, which
       this corpus of repeated letters rewards */
    cr_assert(nats < log(256.0) + 0.05 && nats > log(256.0) - 0.3, "initial model: %g nats", nats);
    n1 = gpt_sample(m.part, 3, m.param, "ab", 40, 1.0f, 0, 99, out1, sizeof out1, err, sizeof err);
    n2 = gpt_sample(m.part, 3, m.param, "ab", 40, 1.0f, 0, 99, out2, sizeof out2, err, sizeof err);
    cr_assert(n1 >= 0 && n1 == n2 && !strcmp(out1, out2), "the same seed, the same text");
    cr_assert(n1 == (int)strlen(out1));
    gpt_sample(m.part, 3, m.param, "ab", 40, 1.0f, 0, 100, out3, sizeof out3, err, sizeof err);
    cr_assert(strcmp(out1, out3) != 0, "another seed, other text");
    n1 = gpt_sample(m.part, 3, m.param, "ab", 20, 0.0f, 0, 1, out1, sizeof out1, err, sizeof err);
    n2 = gpt_sample(m.part, 3, m.param, "ab", 20, 0.0f, 0, 2, out2, sizeof out2, err, sizeof err);
    cr_assert(n1 == n2 && !strcmp(out1, out2), "temperature 0 is greedy: no dependence on the seed");
    cr_assert_eq(gpt_sample(m.part, 3, m.param, "ab", 80, 1.0f, 0, 1, out1, sizeof out1, err, sizeof err), -1, "buffer too small");
    gpt_micro_free(&mb);
    model_free(&m);
    gpt_data_free(&d);
    remove_corpus(dir);
}
