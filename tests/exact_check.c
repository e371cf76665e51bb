/* tests/exact_check.c: what avgpipe.h promises bit for bit holds under the flags it was built with.
   Built by meson with the project's flags and again with -std=gnu11 -O3 -march=native, -Ofast
   -march=native, -O2 -ffast-math, clang, g++ and nvcc (tests/exact_flags_test.sh runs them all):
     1. every averaging pass (MEAN and ELASTIC, each combination of pull, first, last and momentum;
        1 and 3 kernel threads) equals the documented formula of section 10, computed here one rounded
        operation at a time (tests/exact_ref.h), on inputs with subnormals, signed zeros and
        cancellations; also with flush-to-zero set by the caller (and left set after the call);
     2. avgpipe_comm_sum_ranks equals the rank-order sum, for 1..8 ranks;
     3. the non-finite scan finds the first NaN or Inf wherever it is;
     4. a run of the runtime (2 stages, 2 parallel pipelines, alpha 0.3, deterministic, 2 replica groups
        averaged through the in-process allreduce) whose model arithmetic is exact in any build (dyadic
        steps): its parameters and references;
   and prints one digest of every result's bits, which the script compares across the builds.
   Exit status 0 when everything holds, 1 with a line per failure. Also compiles as C++ and CUDA. */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tests/exact_ref.h"

static int failures, checks;
static uint64_t digest = XR_DIGEST_SEED;

#define CHECK(cond, ...)                                 \
    do {                                                 \
        checks++;                                        \
        if (!(cond)) {                                   \
            if (failures++ < 20) {                       \
                fprintf(stderr, "exact_check: FAIL: "); \
                fprintf(stderr, __VA_ARGS__);            \
                fputc('\n', stderr);                     \
            }                                            \
        }                                                \
    } while (0)

static float *falloc(size_t n) {
    float *p = (float *)calloc(n ? n : 1, sizeof(float));
    if (!p) {
        fprintf(stderr, "exact_check: out of memory\n");
        exit(2);
    }
    return p;
}

/* ---- 1. the averaging pass -------------------------------------------------------------------- */

enum { PASS_N = 4099 }; /* not a multiple of the kernels' block: the tail loop runs too */

static void one_pass(const avgpipe_device *dev, rng *r, int elastic, unsigned flags, float alpha, int ftz_caller) {
    float *w = falloc(PASS_N), *z = falloc(PASS_N), *zp = falloc(PASS_N), *acc = falloc(PASS_N);
    float *rw = falloc(PASS_N), *racc = falloc(PASS_N);
    avgpipe_ea_pass p;
    xr_pass x;
    size_t i, bad = 0, first_bad = 0;
    int was;
    xr_fill(r, w, z, zp, acc, PASS_N);
    memcpy(rw, w, PASS_N * sizeof(float));
    memcpy(racc, acc, PASS_N * sizeof(float));
    memset(&p, 0, sizeof p);
    memset(&x, 0, sizeof x);
    p.w = w, p.z = z, p.z_prev = zp, p.acc = acc, p.count = PASS_N;
    p.mode = elastic ? AVGPIPE_EA_ELASTIC : AVGPIPE_EA_MEAN;
    p.alpha = (flags & 1u) ? alpha : 0.0f;
    p.first = (flags & 2u) != 0, p.last = (flags & 4u) != 0;
    p.scale = from_bits(0x3eaaaaabu);                       /* 1/3 */
    p.momentum = (flags & 8u) ? from_bits(0x3f000000u) : 0.0f; /* 0.5 */
    x.elastic = elastic, x.first = p.first, x.last = p.last;
    x.alpha = p.alpha, x.scale = p.scale, x.momentum = p.momentum;
    was = xr_set_ftz(0);
    for (i = 0; i < PASS_N; i++) xr_elem(&x, &rw[i], z[i], zp[i], &racc[i]);
    xr_set_ftz(ftz_caller);
    CHECK(dev->ea_pass(dev->user, &p, NULL) == AVGPIPE_OK, "ea_pass failed");
    CHECK(xr_ftz_on() == ftz_caller, "the pass did not give the caller back its flush-to-zero setting (%d)", ftz_caller);
    xr_set_ftz(was);
    for (i = 0; i < PASS_N; i++)
        if (bits(w[i]) != bits(rw[i]) || bits(acc[i]) != bits(racc[i])) {
            if (!bad++) first_bad = i;
        }
    CHECK(bad == 0,
          "%s pass, pull %d first %d last %d momentum %d, alpha %a, caller ftz %d: %zu of %d elements differ from the formula; "
          "first %zu: w %a (formula %a), acc %a (formula %a); inputs z %a z_prev %a",
          elastic ? "ELASTIC" : "MEAN", (flags & 1u) != 0, p.first, p.last, (flags & 8u) != 0, (double)alpha, ftz_caller, bad,
          PASS_N, first_bad, (double)w[first_bad], (double)rw[first_bad], (double)acc[first_bad], (double)racc[first_bad],
          (double)z[first_bad], (double)zp[first_bad]);
    digest = xr_digest(digest, w, PASS_N);
    digest = xr_digest(digest, acc, PASS_N);
    free(w), free(z), free(zp), free(acc), free(rw), free(racc);
}

static void passes(void) {
    avgpipe_device dev[2];
    avgpipe_device_cpu_desc dd;
    rng r = {0x51ed2701u};
    int t, elastic, k;
    unsigned f;
    memset(&dd, 0, sizeof dd);
    for (t = 0; t < 2; t++) {
        dd.threads = t ? 3 : 1;
        dd.min_per_thread = 256;
        if (avgpipe_device_cpu_create(NULL, &dd, &dev[t]) != AVGPIPE_OK) {
            fprintf(stderr, "exact_check: avgpipe_device_cpu_create: %s\n", avgpipe_last_error(NULL));
            exit(2);
        }
    }
    for (t = 0; t < 2; t++)
        for (elastic = 0; elastic < 2; elastic++)
            for (f = 0; f < 16; f++) {
                if ((f & 8u) && (!elastic || !(f & 4u))) continue; /* momentum: ELASTIC's finalize only */
                for (k = 0; k < 8; k++) one_pass(&dev[t], &r, elastic, f, xr_alpha(&r, k), 0);
                one_pass(&dev[t], &r, elastic, f, xr_alpha(&r, 0), 1); /* the caller runs with flush-to-zero */
            }
    avgpipe_device_destroy(&dev[0]);
    avgpipe_device_destroy(&dev[1]);
}

/* ---- 2. the rank-order sum --------------------------------------------------------------------- */

static void sums(void) {
    enum { N = 1027 };
    rng r = {0x5eed5u};
    float *parts = falloc(8 * N), *got = falloc(N), *want = falloc(N), *junk = falloc(3 * N);
    int n, i, was;
    size_t e, bad;
    for (n = 1; n <= 8; n++) {
        for (i = 0; i < n; i++) xr_fill(&r, parts + (size_t)i * N, junk, junk + N, junk + 2 * N, N);
        was = xr_set_ftz(0);
        xr_sum_ranks(want, parts, N, n, N);
        xr_set_ftz(n & 1); /* odd rank counts: the caller runs with flush-to-zero */
        avgpipe_comm_sum_ranks(got, parts, N, n, N);
        xr_set_ftz(was);
        for (e = 0, bad = 0; e < N; e++) bad += bits(got[e]) != bits(want[e]);
        CHECK(bad == 0, "avgpipe_comm_sum_ranks over %d ranks: %zu of %d sums differ from the rank-order sum", n, bad, N);
        digest = xr_digest(digest, got, N);
        avgpipe_comm_sum_ranks(parts, parts, N, n, N); /* into part 0 itself */
        CHECK(memcmp(parts, want, N * sizeof(float)) == 0, "avgpipe_comm_sum_ranks into part 0 over %d ranks differs", n);
    }
    free(parts), free(got), free(want), free(junk);
}

/* ---- 3. the non-finite scan -------------------------------------------------------------------- */

static void scans(void) {
    static const uint32_t bad_bits[] = {0x7fc00000u, 0xffc00001u, 0x7f800000u, 0xff800000u, 0x7f800001u};
    enum { N = 70001 };
    avgpipe_device dev;
    avgpipe_device_cpu_desc dd;
    float *x = falloc(N);
    size_t where[] = {0, 63, 64, 4098, N / 2, N - 1}, idx, k, b;
    rng r = {77};
    memset(&dd, 0, sizeof dd);
    dd.threads = 3, dd.min_per_thread = 1000;
    if (avgpipe_device_cpu_create(NULL, &dd, &dev) != AVGPIPE_OK) exit(2);
    for (k = 0; k < sizeof where / sizeof where[0]; k++)
        for (b = 0; b < sizeof bad_bits / sizeof bad_bits[0]; b++) {
            size_t e;
            for (e = 0; e < N; e++) x[e] = xr_draw(&r, (int)(e % 4), 1.0f);
            x[where[k]] = from_bits(bad_bits[b]);
            if (where[k] + 7 < N) x[where[k] + 7] = from_bits(0x7f800000u); /* a later one does not hide it */
            CHECK(dev.find_nonfinite(dev.user, x, N, &idx, NULL) == AVGPIPE_OK, "find_nonfinite failed");
            CHECK(idx == where[k], "find_nonfinite: 0x%08x at %zu found at %zu", (unsigned)bad_bits[b], where[k], idx);
        }
    for (k = 0; k < N; k++) x[k] = xr_draw(&r, (int)(k % 4), 1.0f);
    CHECK(dev.find_nonfinite(dev.user, x, N, &idx, NULL) == AVGPIPE_OK && idx == (size_t)N, "find_nonfinite: none, but %zu",
          idx);
    avgpipe_device_destroy(&dev);
    free(x);
}

/* ---- 4. the runtime ---------------------------------------------------------------------------- */

/* A model whose own arithmetic no flag can change: each stage adds its first parameter to the
   activation's first float and passes the rest on; the step subtracts (round + pipe + i) % 5 - 2
   sixteenths, exact in fp32 at these magnitudes. Only the averaging rounds. */
enum { RUN_S = 2, RUN_N = 2, RUN_D = 2, RUN_P = 300, RUN_ACT = 8, RUN_ITERS = 6 };

static int run_forward(avgpipe_op_ctx *op) {
    float a[RUN_ACT];
    int i;
    if (op->input)
        memcpy(a, op->input, sizeof a);
    else
        for (i = 0; i < RUN_ACT; i++) a[i] = (float)(op->micro + i);
    if (op->output) memcpy(op->output, a, sizeof a);
    else op->loss = (double)a[0];
    return 0;
}
static int run_backward(avgpipe_op_ctx *op) {
    if (op->grad_input) memset(op->grad_input, 0, RUN_ACT * sizeof(float));
    return 0;
}
static int run_step(int rank, int pipe, int stage, int round, float *params, void *user) {
    int i;
    (void)rank, (void)stage, (void)user;
    for (i = 0; i < RUN_P; i++) params[i] = params[i] - (float)((round + pipe + i) % 5 - 2) * 0.0625f;
    return 0;
}

static void runtime(void) {
    static float store[RUN_D * RUN_N * RUN_S][RUN_P];
    float *params[RUN_D * RUN_N * RUN_S];
    size_t count[RUN_S] = {RUN_P, RUN_P}, act[RUN_S - 1] = {RUN_ACT * sizeof(float)};
    avgpipe_run_desc d;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_result res;
    rng r = {0xa11ce};
    int k, it, g, rep;
    for (k = 0; k < RUN_D * RUN_N * RUN_S; k++) {
        int e;
        params[k] = store[k];
        for (e = 0; e < RUN_P; e++) store[k][e] = xr_draw(&r, 0, 0.0f);
    }
    memset(&d, 0, sizeof d);
    d.sched.kind = AVGPIPE_SCHED_1F1B;
    d.sched.stages = RUN_S, d.sched.micro = 4, d.sched.pipes = RUN_N;
    d.cb.forward = run_forward, d.cb.backward = run_backward, d.cb.step = run_step;
    d.act_bytes = act, d.params = params, d.param_count = count;
    d.averaging.alpha = from_bits(0x3e99999au); /* 0.3 */
    d.deterministic = 1, d.timeout_s = 30;
    d.replicas = RUN_D;
    avgpipe_context_init(&ctx, NULL);
    res = avgpipe_run_create(&ctx, &d, &run);
    CHECK(res == AVGPIPE_OK, "avgpipe_run_create: %s", avgpipe_last_error(&ctx));
    for (it = 0; it < RUN_ITERS && res == AVGPIPE_OK; it++) {
        res = avgpipe_run_iteration(run, NULL);
        CHECK(res == AVGPIPE_OK, "avgpipe_run_iteration %d: %s", it, avgpipe_last_error(&ctx));
    }
    if (res == AVGPIPE_OK) {
        for (k = 0; k < RUN_D * RUN_N * RUN_S; k++) digest = xr_digest(digest, store[k], RUN_P);
        for (rep = 0; rep < RUN_D; rep++)
            for (g = 0; g < RUN_S; g++) {
                size_t n = 0;
                const float *z = avgpipe_run_replica_reference(run, rep, g, &n);
                CHECK(z && n == RUN_P, "no reference of replica %d stage %d", rep, g);
                if (z) digest = xr_digest(digest, z, n);
            }
    }
    avgpipe_run_destroy(run);
}

int main(void) {
    printf("exact_check: flush-to-zero at start %s (a program linked with -Ofast or -ffast-math starts with it on)\n",
           xr_ftz_on() ? "on" : "off");
    passes();
    sums();
    scans();
    runtime();
    printf("exact_check: digest %016llx\n", (unsigned long long)digest);
    if (failures) {
        printf("exact_check: %d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("exact_check: all %d checks hold\n", checks);
    return 0;
}
