/* Tests of the device backend (CPU) and the averaging module (issue 3).
   Numbers are checked against float64 computations written here, independently of the library. */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "tests/rng.h"
#include "tests/exact_ref.h"

/* ---- helpers --------------------------------------------------------------------------------- */

static int rng_int(rng *r, int lo, int hi) { return lo + (int)(rng_next(r) % (uint64_t)(hi - lo + 1)); }
static void fill(rng *r, float *x, size_t n, double lo, double hi) {
    size_t i;
    for (i = 0; i < n; i++) x[i] = rng_float(r, lo, hi);
}
static void shuffle(rng *r, int *a, int n) {
    int i, j, t;
    for (i = 0; i < n; i++) a[i] = i;
    for (i = n - 1; i > 0; i--) {
        j = rng_int(r, 0, i);
        t = a[i], a[i] = a[j], a[j] = t;
    }
}
static float *falloc(size_t n) {
    float *p = (float *)calloc(n ? n : 1, sizeof(float));
    cr_assert(p != NULL);
    return p;
}
static double *dalloc(size_t n) {
    double *p = (double *)calloc(n ? n : 1, sizeof(double));
    cr_assert(p != NULL);
    return p;
}
static int has(const char *msg, const char *part) { return strstr(msg, part) != NULL; }

/* |got - want| <= tol * scale[i] elementwise, where scale is the magnitude of the inputs of that
   element's computation (the usual relative-error measure for sums and differences). */
static void expect_close(const char *what, const float *got, const double *want, const double *scale, size_t n,
                         double tol, int round) {
    size_t i;
    for (i = 0; i < n; i++) {
        double s = scale ? scale[i] : fabs(want[i]);
        double err = fabs((double)got[i] - want[i]);
        if (s < 1e-30) s = 1e-30;
        cr_assert(err <= tol * s, "%s, round %d, element %zu: got %.9g, float64 %.17g, relative error %.3g > %.1g", what,
                  round, i, (double)got[i], want[i], err / s, tol);
    }
}

static avgpipe_ea *make_ea(avgpipe_context *ctx, size_t count, int pipes, avgpipe_ea_mode mode, float alpha,
                           float momentum, const float *initial, const avgpipe_device *dev) {
    avgpipe_ea_desc d;
    avgpipe_ea *ea = NULL;
    avgpipe_result r;
    memset(&d, 0, sizeof d);
    d.count = count;
    d.pipes = pipes;
    d.mode = mode;
    d.alpha = alpha == 0.0f ? AVGPIPE_ZERO : alpha;
    d.momentum = momentum;
    d.initial = initial;
    d.device = dev;
    r = avgpipe_ea_create(ctx, &d, &ea);
    cr_assert_eq(r, AVGPIPE_OK, "avgpipe_ea_create: %s", avgpipe_last_error(ctx));
    return ea;
}

static void contribute_ok(avgpipe_context *ctx, avgpipe_ea *ea, int pipe, uint64_t round, float *w) {
    avgpipe_result r = avgpipe_ea_contribute(ctx, ea, pipe, round, w, NULL);
    cr_assert_eq(r, AVGPIPE_OK, "contribute(pipe %d, round %llu): %s", pipe, (unsigned long long)round,
                 avgpipe_last_error(ctx));
}

/* ---- defaults -------------------------------------------------------------------------------- */

Test(ea, defaults_are_documented) {
    avgpipe_ea_desc d, q;
    avgpipe_device_cpu_desc c;
    avgpipe_context ctx;
    avgpipe_ea *ea;
    float z0[10] = {0};
    memset(&d, 0, sizeof d);
    q = avgpipe_ea_query_defaults(&d);
    cr_assert_eq(q.mode, AVGPIPE_EA_MEAN);
    cr_assert_eq(q.alpha, 0.1f);
    cr_assert_eq(q.momentum, 0.0f);
    cr_assert_eq(q.stage, 0);
    cr_assert_eq(q.no_finite_check, 0);
    q = avgpipe_ea_query_defaults(NULL);
    cr_assert_eq(q.alpha, 0.1f);
    d.alpha = AVGPIPE_ZERO;
    cr_assert_eq(avgpipe_ea_query_defaults(&d).alpha, 0.0f);
    d.alpha = 0.25f;
    d.mode = AVGPIPE_EA_ELASTIC;
    q = avgpipe_ea_query_defaults(&d);
    cr_assert_eq(q.alpha, 0.25f);
    cr_assert_eq(q.mode, AVGPIPE_EA_ELASTIC);
    c = avgpipe_device_cpu_query_defaults(NULL);
    cr_assert_eq(c.threads, 1);
    cr_assert_eq(c.min_per_thread, (size_t)65536);

    avgpipe_context_init(&ctx, NULL);
    memset(&d, 0, sizeof d);
    d.count = 10, d.pipes = 2, d.initial = z0, d.stage = 3;
    cr_assert_eq(avgpipe_ea_create(&ctx, &d, &ea), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    q = avgpipe_ea_query_desc(ea);
    cr_assert_eq(q.alpha, 0.1f);
    cr_assert_eq(q.mode, AVGPIPE_EA_MEAN);
    cr_assert_eq(q.stage, 3);
    cr_assert_eq(q.count, (size_t)10);
    cr_assert(q.device != NULL && q.device->name && strcmp(q.device->name, "cpu") == 0);
    avgpipe_ea_destroy(ea);
}

/* ---- MEAN: z is the float64 mean of the parallel models, over 200 random rounds ----------------- */

/* One configuration: random P, N, alpha; random optimizer-like updates before each contribution; a
   random order that also lets pipelines run one round ahead. Checks every pull against
   w - alpha (w - z) and every completed reference against the mean of the round's models, in
   float64, to 1e-6 relative. */
static void mean_run(rng *r, int rounds, size_t P, int N, float alpha) {
    avgpipe_context ctx;
    avgpipe_ea *ea;
    float **w = (float **)calloc((size_t)N, sizeof(float *));
    float *zcur = falloc(P), *before = falloc(P);
    double *sum[2], *mag[2], *want = dalloc(P), *scale = dalloc(P);
    uint64_t *next = (uint64_t *)calloc((size_t)N, sizeof(uint64_t)), completed = 0;
    int i, k, done[2] = {0, 0};
    size_t e;
    avgpipe_context_init(&ctx, NULL);
    for (k = 0; k < 2; k++) sum[k] = dalloc(P), mag[k] = dalloc(P);
    for (i = 0; i < N; i++) {
        w[i] = falloc(P);
        fill(r, w[i], P, -1.0, 1.0);
    }
    memcpy(zcur, w[0], P * sizeof(float));
    ea = make_ea(&ctx, P, N, AVGPIPE_EA_MEAN, alpha, 0.0f, zcur, NULL);
    while (completed < (uint64_t)rounds) {
        /* any pipeline may go: one at the open round, or one round ahead of it */
        uint64_t t;
        int slot;
        i = rng_int(r, 0, N - 1);
        if (next[i] > completed + 1) continue;
        t = next[i];
        slot = (int)(t & 1);
        for (e = 0; e < P; e++) w[i][e] += rng_float(r, -0.05, 0.05); /* the local optimizer step */
        memcpy(before, w[i], P * sizeof(float));
        contribute_ok(&ctx, ea, i, t, w[i]);
        next[i]++;
        for (e = 0; e < P; e++) { /* the pull, toward the newest complete reference */
            want[e] = (double)before[e] - (double)alpha * ((double)before[e] - (double)zcur[e]);
            scale[e] = fmax(fabs((double)before[e]), fabs((double)zcur[e]));
            sum[slot][e] += (double)w[i][e];
            mag[slot][e] = fmax(mag[slot][e], fabs((double)w[i][e]));
        }
        expect_close("pull", w[i], want, scale, P, 1e-6, (int)t);
        if (++done[slot] == N) { /* the round is complete: z = the mean of its models */
            const float *z;
            uint64_t version = 0;
            cr_assert_eq(t, completed, "round %llu completed before round %llu", (unsigned long long)t,
                         (unsigned long long)completed);
            cr_assert_eq(avgpipe_ea_wait(&ctx, ea, t, 0), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
            z = avgpipe_ea_reference(ea, &version);
            cr_assert_eq(version, t + 1);
            for (e = 0; e < P; e++) want[e] = sum[slot][e] / N;
            expect_close("reference = mean of the models", z, want, mag[slot], P, 1e-6, (int)t);
            memcpy(zcur, z, P * sizeof(float));
            memset(sum[slot], 0, P * sizeof(double));
            memset(mag[slot], 0, P * sizeof(double));
            done[slot] = 0;
            completed++;
        } else {
            cr_assert_eq(avgpipe_ea_rounds_completed(ea), completed);
        }
    }
    avgpipe_ea_destroy(ea);
    for (i = 0; i < N; i++) free(w[i]);
    for (k = 0; k < 2; k++) free(sum[k]), free(mag[k]);
    free(w), free(zcur), free(before), free(want), free(scale), free(next);
}

Test(ea, mean_is_the_float64_mean_over_200_random_rounds) {
    rng r = {0x9e3779b97f4a7c15ull};
    int c;
    for (c = 0; c < 8; c++) { /* 8 configurations x 25 rounds */
        size_t P = (size_t)rng_int(&r, 1, 3000);
        int N = rng_int(&r, 1, 8);
        float alpha = c == 0 ? 1.0f : c == 1 ? 0.0f : rng_float(&r, 0.0, 1.0);
        mean_run(&r, 25, P, N, alpha);
    }
}

/* ---- N = 1, alpha = 0 is plain training, to the bit ------------------------------------------ */

Test(ea, n1_alpha0_is_plain_training_bit_for_bit) {
    enum { P = 1031, ROUNDS = 50 };
    avgpipe_context ctx;
    rng r = {42};
    float *w = falloc(P), *plain = falloc(P), *z0 = falloc(P), *u = falloc(P);
    int mode, t;
    size_t e;
    avgpipe_context_init(&ctx, NULL);
    for (mode = AVGPIPE_EA_MEAN; mode <= AVGPIPE_EA_ELASTIC; mode++) {
        avgpipe_ea *ea;
        fill(&r, w, P, -2.0, 2.0);
        memcpy(plain, w, P * sizeof(float));
        memcpy(z0, w, P * sizeof(float));
        ea = make_ea(&ctx, P, 1, (avgpipe_ea_mode)mode, 0.0f, 0.0f, z0, NULL);
        for (t = 0; t < ROUNDS; t++) {
            fill(&r, u, P, -0.1, 0.1);
            for (e = 0; e < P; e++) w[e] -= 0.01f * u[e], plain[e] -= 0.01f * u[e]; /* same SGD step */
            contribute_ok(&ctx, ea, 0, (uint64_t)t, w);
            cr_assert(memcmp(w, plain, P * sizeof(float)) == 0, "mode %d round %d: the model moved", mode, t);
            if (mode == AVGPIPE_EA_MEAN)
                cr_assert(memcmp(avgpipe_ea_reference(ea, NULL), plain, P * sizeof(float)) == 0,
                          "round %d: the reference is not the model", t);
            else /* ELASTIC with alpha = 0: the reference never moves */
                cr_assert(memcmp(avgpipe_ea_reference(ea, NULL), z0, P * sizeof(float)) == 0, "round %d", t);
        }
        avgpipe_ea_destroy(ea);
    }
    free(w), free(plain), free(z0), free(u);
}

/* ---- ELASTIC: EASGD's rules (and momentum on the reference) in float64 over 100 rounds ---------- */

/* Published rules, synchronous rounds: c_i = alpha (w_i - z); w_i -= c_i; z' = z + sum c_i
   + mu (z - z_prev). The float64 run starts from the same weights and gets the same updates; it never
   reads the library's state. Tolerance: 1e-6 of the magnitude of the weights. */
static void elastic_run(float mu, int N, float alpha, unsigned seed) {
    enum { P = 2053, ROUNDS = 100 };
    avgpipe_context ctx;
    rng r = {seed};
    avgpipe_ea *ea;
    float *w[8], *u = falloc(P);
    double *W[8], *Z = dalloc(P), *Zp = dalloc(P), *Zn = dalloc(P), *scale = dalloc(P), *wantw = dalloc(P);
    int order[8], i, t, k;
    size_t e;
    avgpipe_context_init(&ctx, NULL);
    for (i = 0; i < N; i++) {
        w[i] = falloc(P), W[i] = dalloc(P);
        fill(&r, w[i], P, -1.0, 1.0);
        for (e = 0; e < P; e++) W[i][e] = w[i][e];
    }
    for (e = 0; e < P; e++) Z[e] = Zp[e] = W[0][e];
    ea = make_ea(&ctx, P, N, AVGPIPE_EA_ELASTIC, alpha, mu, w[0], NULL);
    for (t = 0; t < ROUNDS; t++) {
        for (i = 0; i < N; i++) { /* local steps */
            fill(&r, u, P, -0.05, 0.05);
            for (e = 0; e < P; e++) w[i][e] += u[e], W[i][e] += (double)u[e];
        }
        shuffle(&r, order, N);
        for (k = 0; k < N; k++) contribute_ok(&ctx, ea, order[k], (uint64_t)t, w[order[k]]);
        cr_assert_eq(avgpipe_ea_wait(&ctx, ea, (uint64_t)t, 0), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        for (e = 0; e < P; e++) {
            double s = 0.0;
            for (i = 0; i < N; i++) {
                double c = (double)alpha * (W[i][e] - Z[e]);
                W[i][e] -= c;
                s += c;
            }
            Zn[e] = Z[e] + s + (double)mu * (Z[e] - Zp[e]);
        }
        for (e = 0; e < P; e++) {
            Zp[e] = Z[e], Z[e] = Zn[e];
            scale[e] = 1.0;
            for (i = 0; i < N; i++) scale[e] = fmax(scale[e], fabs(W[i][e]));
        }
        for (i = 0; i < N; i++) {
            memcpy(wantw, W[i], P * sizeof(double));
            expect_close("model", w[i], wantw, scale, P, 1e-6, t);
        }
        expect_close("reference", avgpipe_ea_reference(ea, NULL), Z, scale, P, 1e-6, t);
    }
    avgpipe_ea_destroy(ea);
    for (i = 0; i < N; i++) free(w[i]), free(W[i]);
    free(u), free(Z), free(Zp), free(Zn), free(scale), free(wantw);
}

Test(ea, elastic_matches_float64_easgd_over_100_rounds) { elastic_run(0.0f, 4, 0.1f, 7); }
Test(ea, elastic_with_momentum_matches_float64_over_100_rounds) { elastic_run(0.5f, 3, 0.2f, 11); }
Test(ea, elastic_n8_alpha_one_over_8) { elastic_run(0.0f, 8, 0.125f, 13); }

/* ---- the documented fp32 pass, to the bit, in every build ------------------------------------ */

/* The module driven in a fixed order (pipelines 0..N-1 each round, each round complete before the next):
   every pulled model and every reference must be section 10's formula exactly, as tests/exact_ref.h
   computes it one rounded operation at a time (so this holds whatever flags this file is built with:
   meson builds it again with -std=gnu11 -O3 -march=native and with -Ofast). Inputs include subnormals,
   signed zeros and near-cancellations; the caller runs with flush-to-zero on in odd rounds. */
static void formula_run(avgpipe_ea_mode mode, int N, float alpha, float mu, uint64_t seed) {
    enum { P = 1543, ROUNDS = 12 };
    avgpipe_context ctx;
    rng r = {seed};
    avgpipe_ea *ea;
    float *w[8], *rw[8], *z = falloc(P), *zp = falloc(P), *acc = falloc(P), *junk = falloc(3 * P);
    float scale = xr_mul(1.0f, 1.0f / (float)N); /* what the module uses: 1/N in fp32 */
    xr_pass x;
    int i, t, was;
    size_t e;
    avgpipe_context_init(&ctx, NULL);
    for (i = 0; i < N; i++) {
        w[i] = falloc(P), rw[i] = falloc(P);
        xr_fill(&r, w[i], junk, junk + P, junk + 2 * P, P);
        memcpy(rw[i], w[i], P * sizeof(float));
    }
    memcpy(z, w[0], P * sizeof(float));
    memcpy(zp, z, P * sizeof(float));
    ea = make_ea(&ctx, P, N, mode, alpha, mu, z, NULL);
    memset(&x, 0, sizeof x);
    x.elastic = mode == AVGPIPE_EA_ELASTIC, x.alpha = alpha, x.scale = scale, x.momentum = mu;
    for (t = 0; t < ROUNDS; t++) {
        for (i = 0; i < N; i++) { /* a local step that moves some elements by a few ulps, others far */
            for (e = 0; e < P; e++) w[i][e] = rw[i][e] = xr_draw(&r, (int)(e % 4), rw[i][e]);
            was = xr_set_ftz(t & 1);
            contribute_ok(&ctx, ea, i, (uint64_t)t, w[i]);
            cr_assert_eq(xr_ftz_on(), t & 1, "the contribution changed the caller's flush-to-zero setting");
            xr_set_ftz(0);
            x.first = i == 0, x.last = i == N - 1;
            for (e = 0; e < P; e++) xr_elem(&x, &rw[i][e], z[e], zp[e], &acc[e]);
            xr_set_ftz(was);
            for (e = 0; e < P; e++)
                cr_assert(bits(w[i][e]) == bits(rw[i][e]), "mode %d N %d round %d pipeline %d element %zu: pulled %a, formula %a",
                          (int)mode, N, t, i, e, (double)w[i][e], (double)rw[i][e]);
        }
        cr_assert_eq(avgpipe_ea_wait(&ctx, ea, (uint64_t)t, 0), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        memcpy(zp, z, P * sizeof(float));
        memcpy(z, acc, P * sizeof(float));
        for (e = 0; e < P; e++)
            cr_assert(bits(avgpipe_ea_reference(ea, NULL)[e]) == bits(z[e]), "mode %d N %d round %d element %zu: reference %a, formula %a",
                      (int)mode, N, t, e, (double)avgpipe_ea_reference(ea, NULL)[e], (double)z[e]);
    }
    avgpipe_ea_destroy(ea);
    for (i = 0; i < N; i++) free(w[i]), free(rw[i]);
    free(z), free(zp), free(acc), free(junk);
}

Test(ea, mean_is_the_documented_fp32_formula_bit_for_bit) {
    formula_run(AVGPIPE_EA_MEAN, 3, 0.1f, 0.0f, 5);
    formula_run(AVGPIPE_EA_MEAN, 4, 0.37f, 0.0f, 6);
    formula_run(AVGPIPE_EA_MEAN, 1, 1.0f, 0.0f, 7);
}
Test(ea, elastic_is_the_documented_fp32_formula_bit_for_bit) {
    formula_run(AVGPIPE_EA_ELASTIC, 3, 0.2f, 0.0f, 8);
    formula_run(AVGPIPE_EA_ELASTIC, 2, 0.3f, 0.5f, 9);
    formula_run(AVGPIPE_EA_ELASTIC, 5, 0.125f, 0.9f, 10);
}

/* ---- double buffering ------------------------------------------------------------------------ */

Test(ea, reference_stays_readable_and_unchanged_while_the_next_round_accumulates) {
    enum { P = 500, N = 3 };
    const float alpha = 0.3f;
    avgpipe_context ctx;
    rng r = {5};
    avgpipe_ea *ea;
    float *w[N], *snap = falloc(P), *before = falloc(P);
    double *want = dalloc(P), *scale = dalloc(P), *sum = dalloc(P), *mag = dalloc(P);
    const float *z1, *z2, *seen[8];
    int i, nseen = 0, t, j, fresh;
    uint64_t version;
    size_t e;
    avgpipe_context_init(&ctx, NULL);
    for (i = 0; i < N; i++) w[i] = falloc(P), fill(&r, w[i], P, -1.0, 1.0);
    ea = make_ea(&ctx, P, N, AVGPIPE_EA_MEAN, alpha, 0.0f, w[0], NULL);
    for (i = 0; i < N; i++) contribute_ok(&ctx, ea, i, 0, w[i]);
    z1 = avgpipe_ea_reference(ea, &version);
    cr_assert_eq(version, 1u);
    memcpy(snap, z1, P * sizeof(float));

    /* round 1 accumulates (pipes 0 and 1), then pipes 0 and 1 run ahead into round 2 */
    for (t = 1; t <= 2; t++)
        for (i = 0; i < 2; i++) {
            memcpy(before, w[i], P * sizeof(float));
            contribute_ok(&ctx, ea, i, (uint64_t)t, w[i]);
            cr_assert(avgpipe_ea_reference(ea, &version) == z1 && version == 1u, "the reference moved");
            cr_assert(memcmp(z1, snap, P * sizeof(float)) == 0, "round %d, pipe %d: the reference changed", t, i);
            for (e = 0; e < P; e++) { /* both rounds pull toward z1, the newest complete reference */
                want[e] = (double)before[e] - (double)alpha * ((double)before[e] - (double)snap[e]);
                scale[e] = fmax(fabs((double)before[e]), fabs((double)snap[e]));
                if (t == 1) sum[e] += (double)w[i][e], mag[e] = fmax(mag[e], fabs((double)w[i][e]));
            }
            expect_close("pull toward z1", w[i], want, scale, P, 1e-6, t);
        }
    cr_assert_eq(avgpipe_ea_wait(&ctx, ea, 1, 0), AVGPIPE_TIMEOUT);
    cr_assert(has(avgpipe_last_error(&ctx), "missing pipelines: 2"), "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_ea_wait(&ctx, ea, 1, 20), AVGPIPE_TIMEOUT);

    /* pipe 2 completes round 1: the accumulator becomes the reference (no copy: a new pointer) */
    contribute_ok(&ctx, ea, 2, 1, w[2]);
    for (e = 0; e < P; e++) sum[e] += (double)w[2][e], mag[e] = fmax(mag[e], fabs((double)w[2][e]));
    cr_assert_eq(avgpipe_ea_wait(&ctx, ea, 1, 0), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    z2 = avgpipe_ea_reference(ea, &version);
    cr_assert_eq(version, 2u);
    cr_assert(z2 != z1, "the new reference must be the accumulator, not a copy into the old buffer");
    for (e = 0; e < P; e++) want[e] = sum[e] / N;
    expect_close("round 1 mean", z2, want, mag, P, 1e-6, 1);

    /* keep going: the reference rotates over exactly three buffers */
    for (t = 2; t < 12; t++) {
        for (i = 0; i < N; i++)
            if (!(t == 2 && i < 2)) contribute_ok(&ctx, ea, i, (uint64_t)t, w[i]);
        z2 = avgpipe_ea_reference(ea, NULL);
        for (fresh = 1, j = 0; j < nseen; j++) fresh &= seen[j] != z2;
        if (fresh && nseen < 8) seen[nseen++] = z2;
    }
    cr_assert_eq(nseen, 3, "the reference used %d distinct buffers, not 3", nseen);
    avgpipe_ea_destroy(ea);
    for (i = 0; i < N; i++) free(w[i]);
    free(snap), free(before), free(want), free(scale), free(sum), free(mag);
}

/* ---- non-finite guard ------------------------------------------------------------------------ */

static void nonfinite_run(avgpipe_ea_mode mode) {
    enum { P = 777, N = 3 };
    const float alpha = 0.2f;
    avgpipe_context ctx;
    avgpipe_ea_desc d;
    rng r = {99};
    avgpipe_ea *ea;
    float *w[N], *zsnap = falloc(P), *wsnap[N], *zbefore = falloc(P), *w0pre = falloc(P);
    double *want = dalloc(P), *mag = dalloc(P);
    avgpipe_result res;
    size_t e;
    int i;
    avgpipe_context_init(&ctx, NULL);
    for (i = 0; i < N; i++) w[i] = falloc(P), wsnap[i] = falloc(P), fill(&r, w[i], P, -1.0, 1.0);
    memset(&d, 0, sizeof d);
    d.count = P, d.pipes = N, d.mode = mode, d.alpha = alpha, d.initial = w[0], d.stage = 5;
    cr_assert_eq(avgpipe_ea_create(&ctx, &d, &ea), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (i = 0; i < N; i++) contribute_ok(&ctx, ea, i, 0, w[i]);

    /* round 1: pipe 0 contributes, pipe 1 has diverged */
    memcpy(zbefore, avgpipe_ea_reference(ea, NULL), P * sizeof(float));
    memcpy(w0pre, w[0], P * sizeof(float));
    contribute_ok(&ctx, ea, 0, 1, w[0]);
    w[1][123] = NAN;
    w[1][400] = INFINITY;
    memcpy(zsnap, avgpipe_ea_reference(ea, NULL), P * sizeof(float));
    for (i = 0; i < N; i++) memcpy(wsnap[i], w[i], P * sizeof(float));
    res = avgpipe_ea_contribute(&ctx, ea, 1, 1, w[1], NULL);
    cr_assert_eq(res, AVGPIPE_NON_FINITE, "got %s", avgpipe_result_string(res));
    cr_assert_eq(avgpipe_last_result(&ctx), AVGPIPE_NON_FINITE);
    cr_assert(has(avgpipe_last_error(&ctx), "pipeline 1") && has(avgpipe_last_error(&ctx), "stage 5") &&
                  has(avgpipe_last_error(&ctx), "w[123]") && has(avgpipe_last_error(&ctx), "round 1"),
              "message: %s", avgpipe_last_error(&ctx));
    cr_assert(memcmp(avgpipe_ea_reference(ea, NULL), zsnap, P * sizeof(float)) == 0, "the reference changed");
    for (i = 0; i < N; i++) cr_assert(memcmp(w[i], wsnap[i], P * sizeof(float)) == 0, "model %d changed", i);
    cr_assert_eq(avgpipe_ea_rounds_completed(ea), 1u);

    /* re-seed, contribute again: the round completes and pipe 0's contribution was kept */
    cr_assert_eq(avgpipe_ea_reset_from_reference(&ctx, ea, 1, w[1], NULL), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert(memcmp(w[1], zsnap, P * sizeof(float)) == 0, "re-seeding did not copy the reference");
    for (e = 0; e < P; e++) cr_assert(isfinite(w[1][e]));
    contribute_ok(&ctx, ea, 1, 1, w[1]);
    contribute_ok(&ctx, ea, 2, 1, w[2]);
    cr_assert_eq(avgpipe_ea_wait(&ctx, ea, 1, 0), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (e = 0; e < P; e++) {
        double z = zbefore[e], s = 0.0;
        if (mode == AVGPIPE_EA_MEAN) { /* the models after their pulls */
            for (i = 0; i < N; i++) s += (double)w[i][e];
            want[e] = s / N;
        } else { /* z + sum of the pulls, each = alpha (w - z) with w before the pull */
            s += (double)alpha * ((double)w0pre[e] - z);
            s += 0.0; /* pipe 1 was re-seeded to z: its pull is zero */
            s += (double)alpha * ((double)wsnap[2][e] - z);
            want[e] = z + s;
        }
        mag[e] = fmax(1.0, fabs(want[e]));
    }
    expect_close("round 1 after the refusal", avgpipe_ea_reference(ea, NULL), want, mag, P, 1e-6, 1);

    /* a refused FIRST contribution of a round does not count either: the next one still stores */
    w[0][0] = -INFINITY;
    cr_assert_eq(avgpipe_ea_contribute(&ctx, ea, 0, 2, w[0], NULL), AVGPIPE_NON_FINITE);
    cr_assert(has(avgpipe_last_error(&ctx), "w[0] = -inf"), "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_ea_reset_from_reference(&ctx, ea, 0, w[0], NULL), AVGPIPE_OK);
    for (i = 0; i < N; i++) contribute_ok(&ctx, ea, i, 2, w[i]);
    for (e = 0; e < P; e++) cr_assert(isfinite(avgpipe_ea_reference(ea, NULL)[e]));
    avgpipe_ea_destroy(ea);
    for (i = 0; i < N; i++) free(w[i]), free(wsnap[i]);
    free(zsnap), free(zbefore), free(w0pre), free(want), free(mag);
}

Test(ea, nan_contribution_is_refused_and_nothing_is_lost_mean) { nonfinite_run(AVGPIPE_EA_MEAN); }
Test(ea, nan_contribution_is_refused_and_nothing_is_lost_elastic) { nonfinite_run(AVGPIPE_EA_ELASTIC); }

/* ---- bad arguments --------------------------------------------------------------------------- */

static void expect_create_error(avgpipe_ea_desc d, const char *part) {
    avgpipe_context ctx;
    avgpipe_ea *ea = (avgpipe_ea *)&ctx; /* must come back NULL */
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_ea_create(&ctx, &d, &ea), AVGPIPE_INVALID_ARG, "expected an error about %s", part);
    cr_assert(ea == NULL);
    cr_assert(has(avgpipe_last_error(&ctx), part), "message '%s' does not name '%s'", avgpipe_last_error(&ctx), part);
}

Test(ea, bad_arguments_are_refused_with_the_field_named) {
    float z0[16] = {0}, w[16] = {0};
    avgpipe_ea_desc good, d;
    avgpipe_device dev;
    avgpipe_context ctx;
    avgpipe_ea *ea;
    memset(&good, 0, sizeof good);
    good.count = 16, good.pipes = 2, good.initial = z0, good.stage = 4;

    d = good, d.count = 0, expect_create_error(d, "desc.count");
    d = good, d.pipes = 0, expect_create_error(d, "desc.pipes");
    d = good, d.pipes = -3, expect_create_error(d, "desc.pipes");
    d = good, d.alpha = 1.5f, expect_create_error(d, "desc.alpha");
    d = good, d.alpha = -0.1f, expect_create_error(d, "desc.alpha");
    d = good, d.alpha = NAN, expect_create_error(d, "desc.alpha");
    d = good, d.alpha = -2.0f, expect_create_error(d, "desc.alpha"); /* only AVGPIPE_ZERO (-1) means 0 */
    d = good, d.initial = NULL, expect_create_error(d, "desc.initial");
    d = good, d.mode = (avgpipe_ea_mode)7, expect_create_error(d, "desc.mode");
    d = good, d.momentum = 0.5f, expect_create_error(d, "desc.momentum"); /* MEAN has no momentum */
    d = good, d.mode = AVGPIPE_EA_ELASTIC, d.momentum = 1.0f, expect_create_error(d, "desc.momentum");
    d = good, d.count = 0, expect_create_error(d, "stage 4");

    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_device_cpu_create(&ctx, NULL, &dev), AVGPIPE_OK);
    {
        avgpipe_device broken = dev;
        broken.ea_pass = NULL;
        d = good, d.device = &broken, expect_create_error(d, "ea_pass");
        cr_assert_eq(avgpipe_device_check(&ctx, &broken), AVGPIPE_INVALID_ARG);
        cr_assert(has(avgpipe_last_error(&ctx), "ea_pass"));
        cr_assert_eq(avgpipe_device_check(&ctx, &dev), AVGPIPE_OK);
    }
    {
        avgpipe_device_cpu_desc cd;
        avgpipe_device other;
        memset(&cd, 0, sizeof cd);
        cd.threads = -1;
        cr_assert_eq(avgpipe_device_cpu_create(&ctx, &cd, &other), AVGPIPE_INVALID_ARG);
        cr_assert(has(avgpipe_last_error(&ctx), "desc.threads"));
        cd.threads = AVGPIPE_DEVICE_CPU_MAX_THREADS + 1;
        cr_assert_eq(avgpipe_device_cpu_create(&ctx, &cd, &other), AVGPIPE_INVALID_ARG);
    }
    avgpipe_device_destroy(&dev);
    cr_assert_eq(avgpipe_ea_create(&ctx, NULL, &ea), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "desc"));
    cr_assert_eq(avgpipe_ea_create(&ctx, &good, NULL), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "out"));

    cr_assert_eq(avgpipe_ea_create(&ctx, &good, &ea), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_ea_contribute(&ctx, NULL, 0, 0, w, NULL), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "ea is NULL"));
    cr_assert_eq(avgpipe_ea_contribute(&ctx, ea, 0, 0, NULL, NULL), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "w is NULL") && has(avgpipe_last_error(&ctx), "pipeline 0"), "%s",
              avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_ea_contribute(&ctx, ea, 2, 0, w, NULL), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "pipe 2 is outside [0, 2)"), "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_ea_contribute(&ctx, ea, -1, 0, w, NULL), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "pipe -1"));
    cr_assert_eq(avgpipe_ea_reset_from_reference(&ctx, ea, 5, w, NULL), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "pipe 5"));
    cr_assert_eq(avgpipe_ea_copy_reference(&ctx, ea, NULL, AVGPIPE_DEVICE_COPY_D2H, NULL, NULL), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "dst"));
    cr_assert_eq(avgpipe_ea_copy_reference(&ctx, ea, w, AVGPIPE_DEVICE_COPY_H2D, NULL, NULL), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "kind"));
    cr_assert_eq(avgpipe_ea_wait(&ctx, ea, 0, -1), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "timeout_ms"));

    /* round bookkeeping */
    contribute_ok(&ctx, ea, 0, 0, w);
    cr_assert_eq(avgpipe_ea_contribute(&ctx, ea, 0, 0, w, NULL), AVGPIPE_STATE_ERROR);
    cr_assert(has(avgpipe_last_error(&ctx), "already contributed to round 0"), "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_ea_contribute(&ctx, ea, 1, 3, w, NULL), AVGPIPE_STATE_ERROR);
    cr_assert(has(avgpipe_last_error(&ctx), "skips round 0"), "%s", avgpipe_last_error(&ctx));
    contribute_ok(&ctx, ea, 0, 1, w); /* one round ahead: fine */
    cr_assert_eq(avgpipe_ea_contribute(&ctx, ea, 0, 2, w, NULL), AVGPIPE_STATE_ERROR);
    cr_assert(has(avgpipe_last_error(&ctx), "too far ahead") && has(avgpipe_last_error(&ctx), "round 0 is still open"),
              "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_ea_rounds_completed(ea), 0u);
    contribute_ok(&ctx, ea, 1, 0, w);
    contribute_ok(&ctx, ea, 0, 2, w); /* now it is only one ahead */
    avgpipe_ea_destroy(ea);

    /* the memory query validates like create, but does not need initial */
    {
        avgpipe_ea_memory_info info;
        d = good, d.initial = NULL;
        cr_assert_eq(avgpipe_ea_memory_bytes(&ctx, &d, &info), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        d.pipes = 0;
        cr_assert_eq(avgpipe_ea_memory_bytes(&ctx, &d, &info), AVGPIPE_INVALID_ARG);
        cr_assert(has(avgpipe_last_error(&ctx), "desc.pipes"));
    }
}

/* ---- memory accounting ----------------------------------------------------------------------- */

typedef struct counter {
    size_t live, peak, calls;
} counter;
static void *count_alloc(size_t size, void *user) {
    counter *c = (counter *)user;
    size_t *p = (size_t *)malloc(size + 16);
    if (!p) return NULL;
    p[0] = size;
    c->live += size;
    c->calls++;
    if (c->live > c->peak) c->peak = c->live;
    return (unsigned char *)p + 16;
}
static void count_free(void *ptr, void *user) {
    counter *c = (counter *)user;
    size_t *p;
    if (!ptr) return;
    p = (size_t *)((unsigned char *)ptr - 16);
    c->live -= p[0];
    free(p);
}

Test(ea, memory_accounting_equals_what_is_allocated) {
    static const struct {
        size_t P;
        int N;
        avgpipe_ea_mode mode;
        float mu;
    } cases[] = {{1, 1, AVGPIPE_EA_MEAN, 0.0f},        {1000, 4, AVGPIPE_EA_MEAN, 0.0f},
                 {4097, 8, AVGPIPE_EA_ELASTIC, 0.0f},  {4097, 8, AVGPIPE_EA_ELASTIC, 0.9f},
                 {100000, 3, AVGPIPE_EA_ELASTIC, 0.5f}, {77, 1000, AVGPIPE_EA_MEAN, 0.0f}};
    counter c = {0, 0, 0};
    avgpipe_context_desc cd;
    avgpipe_context ctx;
    float *z0 = falloc(100000);
    size_t k;
    int own;
    memset(&cd, 0, sizeof cd);
    cd.allocator.alloc = count_alloc, cd.allocator.free = count_free, cd.allocator.user = &c;
    cr_assert_eq(avgpipe_context_init(&ctx, &cd), AVGPIPE_OK);
    for (own = 0; own < 2; own++)
        for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
            avgpipe_device dev;
            avgpipe_device_cpu_desc dd;
            avgpipe_ea_desc d;
            avgpipe_ea_memory_info info;
            avgpipe_ea *ea;
            size_t before, used;
            memset(&dd, 0, sizeof dd);
            dd.threads = 2;
            if (!own) cr_assert_eq(avgpipe_device_cpu_create(&ctx, &dd, &dev), AVGPIPE_OK);
            memset(&d, 0, sizeof d);
            d.count = cases[k].P, d.pipes = cases[k].N, d.mode = cases[k].mode, d.momentum = cases[k].mu;
            d.initial = z0, d.device = own ? NULL : &dev;
            cr_assert_eq(avgpipe_ea_memory_bytes(&ctx, &d, &info), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
            before = c.live;
            cr_assert_eq(avgpipe_ea_create(&ctx, &d, &ea), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
            used = c.live - before;
            cr_assert_eq(used, info.device_bytes + info.host_bytes,
                         "P %zu N %d mode %d mu %g own %d: allocated %zu, predicted %zu + %zu", cases[k].P, cases[k].N,
                         (int)cases[k].mode, (double)cases[k].mu, own, used, info.device_bytes, info.host_bytes);
            cr_assert_eq(info.buffers, cases[k].mu != 0.0f ? 4 : 3);
            /* the P-proportional part is exactly the buffers: 3 (or 4) x P floats */
            cr_assert(info.device_bytes >= (size_t)info.buffers * cases[k].P * sizeof(float) &&
                      info.device_bytes <= (size_t)info.buffers * (cases[k].P * sizeof(float) + 128));
            avgpipe_ea_destroy(ea);
            cr_assert_eq(c.live, before, "destroy leaked %zu bytes", c.live - before);
            if (!own) avgpipe_device_destroy(&dev);
        }
    cr_assert_eq(c.live, (size_t)0);
    free(z0);
}

/* ---- threaded kernels ------------------------------------------------------------------------ */

Test(ea, threaded_kernels_give_the_single_thread_result_bit_for_bit) {
    enum { P = 100003, N = 3, ROUNDS = 6 };
    static const int threads[] = {2, 3, 7};
    avgpipe_context ctx;
    avgpipe_device one, many;
    avgpipe_device_cpu_desc dd;
    rng r = {2024};
    float *a[N], *b[N], *z0 = falloc(P);
    size_t idx;
    int ti, mode, i, t;
    avgpipe_context_init(&ctx, NULL);
    for (i = 0; i < N; i++) a[i] = falloc(P), b[i] = falloc(P);
    memset(&dd, 0, sizeof dd);
    dd.threads = 1;
    cr_assert_eq(avgpipe_device_cpu_create(&ctx, &dd, &one), AVGPIPE_OK);
    for (ti = 0; ti < 3; ti++) {
        dd.threads = threads[ti];
        dd.min_per_thread = 1000;
        cr_assert_eq(avgpipe_device_cpu_create(&ctx, &dd, &many), AVGPIPE_OK);
        for (mode = AVGPIPE_EA_MEAN; mode <= AVGPIPE_EA_ELASTIC; mode++) {
            float mu = mode == AVGPIPE_EA_ELASTIC ? 0.3f : 0.0f;
            avgpipe_ea *ea1, *ea2;
            for (i = 0; i < N; i++) fill(&r, a[i], P, -1.0, 1.0), memcpy(b[i], a[i], P * sizeof(float));
            memcpy(z0, a[0], P * sizeof(float));
            ea1 = make_ea(&ctx, P, N, (avgpipe_ea_mode)mode, 0.37f, mu, z0, &one);
            ea2 = make_ea(&ctx, P, N, (avgpipe_ea_mode)mode, 0.37f, mu, z0, &many);
            for (t = 0; t < ROUNDS; t++)
                for (i = 0; i < N; i++) {
                    size_t e;
                    for (e = 0; e < P; e += 97) a[i][e] += 0.01f * (float)(t + 1), b[i][e] = a[i][e];
                    contribute_ok(&ctx, ea1, i, (uint64_t)t, a[i]);
                    contribute_ok(&ctx, ea2, i, (uint64_t)t, b[i]);
                    cr_assert(memcmp(a[i], b[i], P * sizeof(float)) == 0, "threads %d mode %d: models differ",
                              threads[ti], mode);
                }
            cr_assert(memcmp(avgpipe_ea_reference(ea1, NULL), avgpipe_ea_reference(ea2, NULL), P * sizeof(float)) == 0,
                      "threads %d mode %d: references differ", threads[ti], mode);
            avgpipe_ea_destroy(ea1);
            avgpipe_ea_destroy(ea2);
        }
        /* the threaded scan finds the lowest bad index, wherever the chunks split */
        a[0][P - 1] = NAN;
        cr_assert_eq(many.find_nonfinite(many.user, a[0], P, &idx, NULL), AVGPIPE_OK);
        cr_assert_eq(idx, (size_t)(P - 1));
        a[0][P / 2 + 1] = INFINITY;
        cr_assert_eq(many.find_nonfinite(many.user, a[0], P, &idx, NULL), AVGPIPE_OK);
        cr_assert_eq(idx, (size_t)(P / 2 + 1));
        a[0][5] = -NAN;
        cr_assert_eq(many.find_nonfinite(many.user, a[0], P, &idx, NULL), AVGPIPE_OK);
        cr_assert_eq(idx, (size_t)5);
        fill(&r, a[0], P, -1.0, 1.0);
        cr_assert_eq(many.find_nonfinite(many.user, a[0], P, &idx, NULL), AVGPIPE_OK);
        cr_assert_eq(idx, (size_t)P, "no non-finite value, but index %zu", idx);
        avgpipe_device_destroy(&many);
    }
    avgpipe_device_destroy(&one);
    for (i = 0; i < N; i++) free(a[i]), free(b[i]);
    free(z0);
}

/* ---- concurrent contributions ---------------------------------------------------------------- */

enum { CONC_P = 4096, CONC_N = 4, CONC_ROUNDS = 60 };
typedef struct conc_arg {
    avgpipe_ea *ea;
    int pipe;
    int errors;
    char msg[AVGPIPE_ERROR_MAX];
} conc_arg;

/* Pipeline i sets its model to (i + 1) + t before round t: with alpha = 0 and N = 4 every sum is exact,
   so z after round t must be 2.5 + t exactly, whatever the interleaving. */
static void *conc_worker(void *p) {
    conc_arg *a = (conc_arg *)p;
    avgpipe_context ctx;
    float *w = falloc(CONC_P);
    int t;
    size_t e;
    avgpipe_context_init(&ctx, NULL);
    for (t = 0; t < CONC_ROUNDS; t++) {
        for (e = 0; e < CONC_P; e++) w[e] = (float)(a->pipe + 1 + t);
        if (t >= 2 && avgpipe_ea_wait(&ctx, a->ea, (uint64_t)(t - 2), 10000) != AVGPIPE_OK) goto fail;
        if (avgpipe_ea_contribute(&ctx, a->ea, a->pipe, (uint64_t)t, w, NULL) != AVGPIPE_OK) goto fail;
    }
    free(w);
    return NULL;
fail:
    a->errors++;
    snprintf(a->msg, sizeof a->msg, "%s", avgpipe_last_error(&ctx));
    free(w);
    return NULL;
}

Test(ea, concurrent_contributions_from_one_thread_per_pipeline) {
    avgpipe_context ctx;
    conc_arg args[CONC_N];
    pthread_t tid[CONC_N];
    float *z0 = falloc(CONC_P);
    avgpipe_ea *ea;
    const float *z;
    size_t e;
    int i;
    avgpipe_context_init(&ctx, NULL);
    ea = make_ea(&ctx, CONC_P, CONC_N, AVGPIPE_EA_MEAN, 0.0f, 0.0f, z0, NULL);
    for (i = 0; i < CONC_N; i++) {
        memset(&args[i], 0, sizeof args[i]);
        args[i].ea = ea, args[i].pipe = i;
        cr_assert_eq(pthread_create(&tid[i], NULL, conc_worker, &args[i]), 0);
    }
    for (i = 0; i < CONC_N; i++) pthread_join(tid[i], NULL);
    for (i = 0; i < CONC_N; i++) cr_assert_eq(args[i].errors, 0, "pipe %d: %s", i, args[i].msg);
    cr_assert_eq(avgpipe_ea_wait(&ctx, ea, CONC_ROUNDS - 1, 1000), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_ea_rounds_completed(ea), (uint64_t)CONC_ROUNDS);
    z = avgpipe_ea_reference(ea, NULL);
    for (e = 0; e < CONC_P; e++)
        cr_assert_eq(z[e], 2.5f + (float)(CONC_ROUNDS - 1), "z[%zu] = %g", e, (double)z[e]);
    avgpipe_ea_destroy(ea);
    free(z0);
}

/* ---- copies and re-seeding through the device table ------------------------------------------- */

Test(ea, copy_reference_returns_the_newest_complete_reference_and_its_version) {
    enum { P = 300 };
    avgpipe_context ctx;
    rng r = {3};
    float *w0 = falloc(P), *w1 = falloc(P), *out = falloc(P);
    avgpipe_ea *ea;
    uint64_t v = 99;
    avgpipe_context_init(&ctx, NULL);
    fill(&r, w0, P, -1, 1), fill(&r, w1, P, -1, 1);
    ea = make_ea(&ctx, P, 2, AVGPIPE_EA_MEAN, 0.5f, 0.0f, w0, NULL);
    cr_assert_eq(avgpipe_ea_copy_reference(&ctx, ea, out, AVGPIPE_DEVICE_COPY_D2H, &v, NULL), AVGPIPE_OK);
    cr_assert_eq(v, 0u);
    cr_assert(memcmp(out, w0, P * sizeof(float)) == 0, "z0 is not desc.initial");
    contribute_ok(&ctx, ea, 0, 0, w0);
    contribute_ok(&ctx, ea, 1, 0, w1);
    cr_assert_eq(avgpipe_ea_copy_reference(&ctx, ea, out, AVGPIPE_DEVICE_COPY_D2D, &v, NULL), AVGPIPE_OK);
    cr_assert_eq(v, 1u);
    cr_assert(memcmp(out, avgpipe_ea_reference(ea, NULL), P * sizeof(float)) == 0);
    avgpipe_ea_destroy(ea);
    free(w0), free(w1), free(out);
}
