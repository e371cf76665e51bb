/* Tests of avgpipe_cuda.h that need no GPU (the GPU side is tests/gpu/cuda_device_check.c, run by
   bench/gpu/run.sh):
   - the kernels' element function, compiled for the host (avgpipe_device_cuda_ea_pass_host), against the CPU
     device's kernels on edge values (NaN, +-Inf, denormals, -0, alpha 0 and 1, momentum, first/last);
   - the kernels themselves (their source text, compiled for the host with an emulated grid: every block and
     thread run in turn) with the header's launch plans, against the CPU device, on awkward sizes and
     misaligned buffers: the grid-stride loops, the float4 body, the scalar head and tail;
   - the grids: each kernel's grid is multiprocessors x the occupancy an emulated GPU (an H200's limits,
     the kernels' register counts) reports, and the kernels give the same bits whatever the grid;
   - the non-finite flag kernel (flag_nonfinite: bits ORed, the first call's tag) and the averaging
     kernel's skip word, emulated the same way;
   - the NVRTC build of the kernels' source: PTX without fused multiply-adds or flushed denormals;
   - creation without a device fails cleanly (the state of this machine and of CI), every entry's error
     path, the mapping of CUDA errors to avgpipe_result;
   - events: made without timing unless desc.timed_events, the timing modes, the table of timed twins;
   - streams past the hardware queues (CUDA_DEVICE_MAX_CONNECTIONS): one warning through the logger.
   Criterion forks per test: each test initialises CUDA in its own process. */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_cuda.h"

#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "tests/rng.h"

/* ---- helpers --------------------------------------------------------------------------------- */

static int has(const char *msg, const char *part) { return strstr(msg, part) != NULL; }

/* 64-byte aligned float buffers, so that offsets 0..3 give every alignment modulo 16 bytes. */
static float *fbuf(size_t n) {
    size_t bytes = ((n + 16) * sizeof(float) + 63) / 64 * 64;
    void *p = aligned_alloc(64, bytes);
    cr_assert(p != NULL);
    memset(p, 0, bytes);
    return (float *)p;
}

/* Counting allocator: what creation leaves allocated. */
typedef struct counter {
    long live, total;
} counter;
static void *count_alloc(size_t n, void *user) {
    counter *c = (counter *)user;
    void *p = malloc(n);
    if (p) c->live++, c->total++;
    return p;
}
static void count_free(void *p, void *user) {
    counter *c = (counter *)user;
    if (p) c->live--;
    free(p);
}
static void counting_ctx(avgpipe_context *ctx, counter *c) {
    avgpipe_context_desc cd;
    memset(&cd, 0, sizeof cd);
    memset(c, 0, sizeof *c);
    cd.allocator.alloc = count_alloc;
    cd.allocator.free = count_free;
    cd.allocator.user = c;
    cr_assert_eq(avgpipe_context_init(ctx, &cd), AVGPIPE_OK);
}

/* The passes to compare: every flag combination the CPU kernels have. */
typedef struct pass_kind {
    avgpipe_ea_mode mode;
    float alpha, momentum;
    int first, last;
} pass_kind;
static int pass_kinds(pass_kind *out, const float *alphas, int nalpha) {
    int n = 0, m, a, fi, la, mo;
    for (m = 0; m < 2; m++)
        for (a = 0; a < nalpha; a++)
            for (fi = 0; fi < 2; fi++)
                for (la = 0; la < 2; la++)
                    for (mo = 0; mo < (m == 1 ? 2 : 1); mo++) {
                        out[n].mode = m == 0 ? AVGPIPE_EA_MEAN : AVGPIPE_EA_ELASTIC;
                        out[n].alpha = alphas[a];
                        out[n].momentum = mo ? 0.9f : 0.0f;
                        out[n].first = fi, out[n].last = la;
                        n++;
                    }
    return n;
}
static avgpipe_ea_pass make_pass(const pass_kind *k, float *w, const float *z, const float *zp, float *acc, size_t n) {
    avgpipe_ea_pass p;
    memset(&p, 0, sizeof p);
    p.w = w, p.z = z, p.z_prev = zp, p.acc = acc, p.count = n;
    p.mode = k->mode, p.alpha = k->alpha, p.momentum = k->momentum, p.first = k->first, p.last = k->last;
    p.scale = 0.25f;
    return p;
}

/* Run pass kind k on (w, z, zp, acc) with the CPU device and with `other`, from the same inputs, and
   require the same bits in w and acc. other(p) runs the pass on host memory. */
typedef void (*pass_fn)(const avgpipe_ea_pass *p, void *user);
static long compare_pass(const avgpipe_device *cpu, const pass_kind *k, const float *w0, const float *z, const float *zp,
                         const float *a0, size_t n, pass_fn other, void *user, int must_match, const char *what) {
    float *w1 = fbuf(n), *a1 = fbuf(n), *w2 = fbuf(n), *a2 = fbuf(n);
    avgpipe_ea_pass p;
    long diff = 0;
    size_t i;
    memcpy(w1, w0, n * sizeof(float)), memcpy(w2, w0, n * sizeof(float));
    memcpy(a1, a0, n * sizeof(float)), memcpy(a2, a0, n * sizeof(float));
    p = make_pass(k, w1, z, zp, a1, n);
    cr_assert_eq(cpu->ea_pass(cpu->user, &p, NULL), AVGPIPE_OK);
    p = make_pass(k, w2, z, zp, a2, n);
    other(&p, user);
    for (i = 0; i < n; i++) {
        int ok = same(w1[i], w2[i]) && same(a1[i], a2[i]);
        if (!ok && must_match)
            cr_assert(0,
                      "%s: mode %d alpha %g mu %g first %d last %d, element %zu of %zu (w %a z %a zp %a acc %a): "
                      "CPU w %a acc %a, other w %a acc %a",
                      what, (int)k->mode, (double)k->alpha, (double)k->momentum, k->first, k->last, i, n, (double)w0[i],
                      (double)z[i], (double)zp[i], (double)a0[i], (double)w1[i], (double)a1[i], (double)w2[i], (double)a2[i]);
        diff += !ok;
    }
    free(w1), free(a1), free(w2), free(a2);
    return diff;
}

static void host_twin(const avgpipe_ea_pass *p, void *user) {
    (void)user;
    cr_assert_eq(avgpipe_device_cuda_ea_pass_host(NULL, p), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
}

/* Edge values: zeros, ones, the fp32 extremes, denormals, infinities and NaNs (quiet, with a payload,
   negative), and neighbours whose differences round. */
static const uint32_t edge_bits[] = {
    0x00000000u, 0x80000000u, 0x3f800000u, 0xbf800000u, 0x3dcccccdu, /* 0, -0, 1, -1, 0.1 */
    0x7f7fffffu, 0xff7fffffu, 0x00800000u, 0x80800000u,             /* +-FLT_MAX, +-FLT_MIN */
    0x00000001u, 0x80000001u, 0x007fffffu, 0x00400000u,             /* denormals: smallest, largest, half */
    0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7fc00123u, /* +-Inf, NaN, -NaN, NaN with payload */
    0x3f800001u, 0x4b800000u, 0x33800000u, 0x4effffffu              /* 1 + ulp, 2^24, 2^-24, near 2^31 */
};
#define NEDGE (sizeof edge_bits / sizeof edge_bits[0])

/* Every (w, z, zp, acc) quadruple of edge values: NEDGE^4 elements. */
static size_t edge_inputs(float **w, float **z, float **zp, float **a) {
    size_t n = NEDGE * NEDGE * NEDGE * NEDGE, i;
    *w = fbuf(n), *z = fbuf(n), *zp = fbuf(n), *a = fbuf(n);
    for (i = 0; i < n; i++) {
        (*w)[i] = from_bits(edge_bits[i % NEDGE]);
        (*z)[i] = from_bits(edge_bits[i / NEDGE % NEDGE]);
        (*zp)[i] = from_bits(edge_bits[i / (NEDGE * NEDGE) % NEDGE]);
        (*a)[i] = from_bits(edge_bits[i / (NEDGE * NEDGE * NEDGE)]);
    }
    return n;
}

/* ---- the element function: host twin against the CPU device ------------------------------------------ */

Test(cuda_elem, edge_values_match_cpu_device) {
    avgpipe_device cpu;
    float *w, *z, *zp, *a;
    size_t n = edge_inputs(&w, &z, &zp, &a);
    /* alpha 0 (no pull), 1 (w = z), a plain one, a denormal, the largest below 1 */
    const float alphas[] = {0.0f, 1.0f, 0.1f, from_bits(0x00000005u), from_bits(0x3f7fffffu)};
    pass_kind kinds[64];
    int nk = pass_kinds(kinds, alphas, 5), i;
    cr_assert_eq(avgpipe_device_cpu_create(NULL, NULL, &cpu), AVGPIPE_OK);
    for (i = 0; i < nk; i++) compare_pass(&cpu, &kinds[i], w, z, zp, a, n, host_twin, NULL, 1, "host twin, edge values");
    avgpipe_device_destroy(&cpu);
    free(w), free(z), free(zp), free(a);
}

Test(cuda_elem, random_values_match_cpu_device) {
    avgpipe_device cpu;
    rng r = {0x1234567u};
    const size_t n = 100003;
    float *w = fbuf(n), *z = fbuf(n), *zp = fbuf(n), *a = fbuf(n);
    const float alphas[] = {0.0f, 1.0f, 0.1f, 0.37f};
    pass_kind kinds[64];
    int nk = pass_kinds(kinds, alphas, 4), i;
    size_t j;
    for (j = 0; j < n; j++) {
        w[j] = rng_float(&r, -2, 2), z[j] = rng_float(&r, -2, 2), zp[j] = rng_float(&r, -2, 2), a[j] = rng_float(&r, -8, 8);
        if (j % 97 == 0) w[j] *= 1e-38f; /* some results near and in the denormal range */
    }
    cr_assert_eq(avgpipe_device_cpu_create(NULL, NULL, &cpu), AVGPIPE_OK);
    for (i = 0; i < nk; i++) compare_pass(&cpu, &kinds[i], w, z, zp, a, n, host_twin, NULL, 1, "host twin, random values");
    avgpipe_device_destroy(&cpu);
    free(w), free(z), free(zp), free(a);
}

/* The comparison above can fail: an implementation that fuses the multiply into the subtract (what an
   FMA-contracting compiler would make of w - alpha*(w - z)) differs from the CPU device on these data. */
static void contracted(const avgpipe_ea_pass *p, void *user) {
    size_t i;
    (void)user;
    for (i = 0; i < p->count; i++) {
        float v = fmaf(-p->alpha, p->w[i] - p->z[i], p->w[i]);
        p->w[i] = v;
        p->acc[i] = p->first ? v : p->acc[i] + v;
    }
}
Test(cuda_elem, comparison_detects_contraction) {
    avgpipe_device cpu;
    rng r = {99};
    const size_t n = 10000;
    float *w = fbuf(n), *z = fbuf(n), *zp = fbuf(n), *a = fbuf(n);
    pass_kind k;
    size_t j;
    long diff;
    for (j = 0; j < n; j++) w[j] = rng_float(&r, -2, 2), z[j] = rng_float(&r, -2, 2), a[j] = rng_float(&r, -2, 2);
    memset(&k, 0, sizeof k);
    k.mode = AVGPIPE_EA_MEAN, k.alpha = 0.1f, k.first = 0, k.last = 0;
    cr_assert_eq(avgpipe_device_cpu_create(NULL, NULL, &cpu), AVGPIPE_OK);
    cr_assert_eq(compare_pass(&cpu, &k, w, z, zp, a, n, host_twin, NULL, 1, "host twin"), 0);
    diff = compare_pass(&cpu, &k, w, z, zp, a, n, contracted, NULL, 0, "contracted");
    cr_assert_gt(diff, (long)(n / 100), "a contracted pass differs in %ld of %zu elements only", diff, n);
    avgpipe_device_destroy(&cpu);
    free(w), free(z), free(zp), free(a);
}

Test(cuda_elem, pass_host_arguments) {
    avgpipe_ea_pass p;
    float w[4] = {1, 2, 3, 4}, acc[4] = {0, 0, 0, 0}, z[4] = {0, 0, 0, 0};
    avgpipe_context ctx;
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_device_cuda_ea_pass_host(&ctx, NULL), AVGPIPE_INVALID_ARG);
    memset(&p, 0, sizeof p);
    p.w = w, p.acc = acc, p.count = 4, p.mode = AVGPIPE_EA_MEAN, p.alpha = 0.5f, p.first = 1;
    cr_assert_eq(avgpipe_device_cuda_ea_pass_host(&ctx, &p), AVGPIPE_INVALID_ARG, "z is read when pulling");
    cr_assert(has(avgpipe_last_error(&ctx), "z is NULL"), "%s", avgpipe_last_error(&ctx));
    p.alpha = 0.0f; /* no pull: z not read, acc = w */
    cr_assert_eq(avgpipe_device_cuda_ea_pass_host(&ctx, &p), AVGPIPE_OK);
    cr_assert(acc[2] == 3.0f && w[2] == 3.0f);
    p.mode = AVGPIPE_EA_ELASTIC, p.last = 1, p.momentum = 0.5f, p.z = z; /* finalize with momentum reads z_prev */
    cr_assert_eq(avgpipe_device_cuda_ea_pass_host(&ctx, &p), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "z_prev"), "%s", avgpipe_last_error(&ctx));
    p.mode = (avgpipe_ea_mode)7;
    cr_assert_eq(avgpipe_device_cuda_ea_pass_host(&ctx, &p), AVGPIPE_INVALID_ARG);
}

/* ---- the kernels, run on the host over an emulated grid ------------------------------------------------
   The same source text the device runs (avgpipe_cuda.h's kernel macros), with host stand-ins for the
   device helpers: the thread index comes from the emulated launch, the arithmetic from the host twin, the
   atomic minimum is a plain one (the threads run one after the other). */

static unsigned emu_block, emu_thread, emu_bdim, emu_gdim;
typedef unsigned long long avgpipe__cu_u64;
static float avgpipe__cu_add(float a, float b) { return avgpipe__cuh_add(a, b); }
static float avgpipe__cu_sub(float a, float b) { return avgpipe__cuh_sub(a, b); }
static float avgpipe__cu_mul(float a, float b) { return avgpipe__cuh_mul(a, b); }
static int avgpipe__cu_bad(float x) { return (bits(x) & AVGPIPE__CUDA_EXP_MASK) == AVGPIPE__CUDA_EXP_MASK; }
static avgpipe__cu_u64 avgpipe__cu_thread(void) { return (avgpipe__cu_u64)emu_block * emu_bdim + emu_thread; }
static avgpipe__cu_u64 avgpipe__cu_threads(void) { return (avgpipe__cu_u64)emu_gdim * emu_bdim; }
static void avgpipe__cu_min(avgpipe__cu_u64 *p, avgpipe__cu_u64 v) {
    if (v < *p) *p = v;
}
static unsigned emu_cas_calls, emu_or_calls;
static unsigned avgpipe__cu_cas(unsigned *p, unsigned cmp, unsigned v) {
    unsigned old = *p;
    emu_cas_calls++;
    if (old == cmp) *p = v;
    return old;
}
static void avgpipe__cu_or(unsigned *p, unsigned v) { emu_or_calls++, *p |= v; }
#define AVGPIPE__CU_GLOBAL static
#define AVGPIPE__CU_DEVICE static
#define AVGPIPE__CU_RESTRICT restrict
AVGPIPE__CUDA_ELEM_DEVICE_TEXT
AVGPIPE__CUDA_EA_TEXT
AVGPIPE__CUDA_NONFINITE_TEXT
AVGPIPE__CUDA_FLAG_TEXT
AVGPIPE__CUDA_SCALE_TEXT
#undef AVGPIPE__CU_GLOBAL
#undef AVGPIPE__CU_DEVICE
#undef AVGPIPE__CU_RESTRICT

#define EMU_GRID(pl, call)                                                           \
    do {                                                                             \
        emu_gdim = (pl).grid, emu_bdim = (pl).block;                                 \
        for (emu_block = 0; emu_block < emu_gdim; emu_block++)                       \
            for (emu_thread = 0; emu_thread < emu_bdim; emu_thread++) call;          \
    } while (0)

typedef struct launch_shape {
    int block, max_blocks;
} launch_shape;
/* One block of one warp (every thread loops many times), a few small blocks, and the default shape. */
static const launch_shape shapes[] = {{32, 1}, {64, 3}, {256, 1 << 20}};
#define NSHAPE (sizeof shapes / sizeof shapes[0])

static void emu_ea(const avgpipe_ea_pass *p, void *user) {
    const launch_shape *s = (const launch_shape *)user;
    avgpipe__cuda_ea_args x = avgpipe__cuda_ea_prep(p, s->block, s->max_blocks);
    if (!p->count) return;
    EMU_GRID(x.pl, avgpipe__cu_ea(x.w, x.z, x.zp, x.a, x.pl.head, x.pl.nvec, x.pl.tail, x.alpha, x.scale, x.mu, x.f, x.skip));
}

/* Sizes around the float4 width and the block lengths, and the awkward ones of the GPU check. */
static const size_t sizes[] = {1, 2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 63, 64, 65, 255, 256, 257, 4097, 10007};

Test(cuda_kernels, ea_kernel_matches_cpu_device) {
    avgpipe_device cpu;
    rng r = {7};
    const size_t nmax = 10007 + 8;
    float *w = fbuf(nmax), *z = fbuf(nmax), *zp = fbuf(nmax), *a = fbuf(nmax);
    const float alphas[] = {0.0f, 1.0f, 0.1f};
    pass_kind kinds[64];
    int nk = pass_kinds(kinds, alphas, 3), k;
    size_t si, j, sh;
    /* buffer offsets in floats: all aligned; all equally misaligned (a scalar head); unequal (scalar only) */
    static const int offs[][4] = {{0, 0, 0, 0}, {1, 1, 1, 1}, {2, 2, 2, 2}, {3, 3, 3, 3}, {0, 1, 2, 3}, {0, 0, 0, 1}};
    size_t oi;
    for (j = 0; j < nmax; j++)
        w[j] = rng_float(&r, -2, 2), z[j] = rng_float(&r, -2, 2), zp[j] = rng_float(&r, -2, 2), a[j] = rng_float(&r, -8, 8);
    cr_assert_eq(avgpipe_device_cpu_create(NULL, NULL, &cpu), AVGPIPE_OK);
    for (si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
        for (oi = 0; oi < sizeof offs / sizeof offs[0]; oi++)
            for (k = 0; k < nk; k++)
                for (sh = 0; sh < NSHAPE; sh++) {
                    if (sh < 2 && sizes[si] > 300 && k % 4) continue; /* the long emulations only for some kinds */
                    compare_pass(&cpu, &kinds[k], w + offs[oi][0], z + offs[oi][1], zp + offs[oi][2], a + offs[oi][3], sizes[si],
                                 emu_ea, (void *)&shapes[sh], 1, "emulated ea kernel");
                }
    avgpipe_device_destroy(&cpu);
    free(w), free(z), free(zp), free(a);
}

/* The plan: float4s exactly when every touched buffer has the same alignment, aligned by the head. */
Test(cuda_kernels, plans) {
    float *buf = fbuf(64);
    const void *p[4];
    avgpipe__cuda_plan pl;
    int o;
    for (o = 0; o < 4; o++) {
        p[0] = buf + o, p[1] = buf + 16 + o, p[2] = NULL, p[3] = buf + 32 + o;
        pl = avgpipe__cuda_plan_make(p, 4, 11, 256, 100);
        cr_assert_eq(pl.head, (unsigned long long)((4 - o) % 4), "offset %d", o);
        cr_assert_eq(pl.head + 4 * pl.nvec + pl.tail, 11ull);
        cr_assert_eq(((uintptr_t)(buf + o + pl.head)) % 16, 0u);
        cr_assert_lt(pl.tail, 4ull);
    }
    p[1] = buf + 17; /* one buffer off by one float: scalar */
    pl = avgpipe__cuda_plan_make(p, 4, 11, 256, 100);
    cr_assert(pl.nvec == 0 && pl.head == 11 && pl.tail == 0);
    p[0] = buf + 1, p[1] = buf + 17, p[3] = buf + 33; /* a head longer than the pass: scalar */
    pl = avgpipe__cuda_plan_make(p, 4, 2, 256, 100);
    cr_assert(pl.nvec == 0 && pl.head == 2);
    p[0] = (const char *)buf + 2; /* not even float-aligned: scalar */
    pl = avgpipe__cuda_plan_make(p, 1, 100, 256, 100);
    cr_assert(pl.nvec == 0 && pl.head == 100);
    /* grid: enough blocks for the work, at most max_blocks, at least 1 */
    p[0] = buf;
    pl = avgpipe__cuda_plan_make(p, 1, (size_t)1 << 30, 256, 100);
    cr_assert(pl.grid == 100 && pl.block == 256 && pl.nvec == (1ull << 28));
    pl = avgpipe__cuda_plan_make(p, 1, 4 * 300, 256, 100);
    cr_assert_eq(pl.grid, 2u);
    pl = avgpipe__cuda_plan_make(p, 1, 1, 256, 100);
    cr_assert_eq(pl.grid, 1u);
    free(buf);
}

static size_t emu_nonfinite(const float *x, size_t n, const launch_shape *s) {
    const void *p[1];
    avgpipe__cuda_plan pl;
    unsigned long long result = ~0ull;
    p[0] = x;
    pl = avgpipe__cuda_plan_make(p, 1, n, s->block, s->max_blocks);
    EMU_GRID(pl, avgpipe__cu_nonfinite(x, pl.head, pl.nvec, pl.tail, &result));
    return result < n ? (size_t)result : n;
}

Test(cuda_kernels, nonfinite_kernel_finds_the_lowest) {
    avgpipe_device cpu;
    rng r = {11};
    const size_t nmax = 10007 + 8;
    float *x = fbuf(nmax);
    const float bad[] = {INFINITY, -INFINITY, NAN, from_bits(0xffc00001u)};
    size_t si, j, o, sh, want, got, t;
    cr_assert_eq(avgpipe_device_cpu_create(NULL, NULL, &cpu), AVGPIPE_OK);
    for (si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
        for (o = 0; o < 4; o++)
            for (t = 0; t < 6; t++) {
                size_t n = sizes[si];
                float *v = x + o;
                for (j = 0; j < nmax - o; j++) v[j] = rng_float(&r, -1e30, 1e30);
                v[n] = NAN; /* past the end: never reported */
                if (t == 1) v[0] = bad[rng_next(&r) % 4];                         /* the first */
                if (t == 2) v[n - 1] = bad[rng_next(&r) % 4];                     /* the last */
                if (t >= 3) v[rng_next(&r) % n] = bad[rng_next(&r) % 4];          /* anywhere */
                if (t >= 4) v[rng_next(&r) % n] = bad[rng_next(&r) % 4];          /* two */
                if (t == 5) v[n / 2] = from_bits(0x7f7fffffu), v[n - 1] = INFINITY; /* FLT_MAX is finite */
                cr_assert_eq(cpu.find_nonfinite(cpu.user, v, n, &want, NULL), AVGPIPE_OK);
                for (sh = 0; sh < NSHAPE; sh++) {
                    got = emu_nonfinite(v, n, &shapes[sh]);
                    cr_assert_eq(got, want, "size %zu offset %zu case %zu shape %zu: kernel %zu, CPU device %zu", n, o, t, sh, got,
                                 want);
                }
            }
    avgpipe_device_destroy(&cpu);
    free(x);
}

/* flag_nonfinite's kernel (emulated), with the entry's plan: {0, 0} stays on clean data; a NaN or +-Inf
   anywhere sets flag[0] = bits and flag[1] = tag through exactly one compare-and-swap winner; a second
   flagging call ORs its bits and keeps the first tag; a clean call changes nothing. */
static void emu_flag(const float *x, size_t n, uint32_t *flag, uint32_t bits, uint32_t tag, const launch_shape *s) {
    const void *p[1];
    avgpipe__cuda_plan pl;
    unsigned *f = (unsigned *)flag;
    if (!n) return; /* as the entry: no launch */
    p[0] = x;
    pl = avgpipe__cuda_plan_make(p, 1, n, s->block, s->max_blocks);
    EMU_GRID(pl, avgpipe__cu_flag(x, pl.head, pl.nvec, pl.tail, f, bits, tag));
}

Test(cuda_kernels, flag_kernel_sets_bits_and_first_tag) {
    avgpipe_device cpu;
    rng r = {13};
    const size_t nmax = 10007 + 8;
    float *x = fbuf(nmax);
    const float bad[] = {INFINITY, -INFINITY, NAN, from_bits(0xffc00001u), from_bits(0x7f800001u)};
    size_t si, j, o, sh, t, want;
    cr_assert_eq(avgpipe_device_cpu_create(NULL, NULL, &cpu), AVGPIPE_OK);
    for (si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
        for (o = 0; o < 4; o++)
            for (t = 0; t < 7; t++) {
                size_t n = sizes[si];
                float *v = x + o;
                for (j = 0; j < nmax - o; j++) v[j] = rng_float(&r, -1e30, 1e30);
                v[n] = NAN; /* past the end: never seen */
                if (t == 1) v[0] = bad[rng_next(&r) % 5];                        /* the first */
                if (t == 2) v[n - 1] = bad[rng_next(&r) % 5];                    /* the last */
                if (t == 3) v[n / 2] = bad[rng_next(&r) % 5];                    /* the middle */
                if (t == 4) v[rng_next(&r) % n] = NAN, v[rng_next(&r) % n] = INFINITY; /* a NaN and an Inf */
                if (t == 5) for (j = 0; j < n; j++) v[j] = bad[j % 5];            /* every one: many finders */
                if (t == 6) v[n / 2] = from_bits(0x7f7fffffu), v[0] = -FLT_MAX;  /* finite extremes only */
                cr_assert_eq(cpu.find_nonfinite(cpu.user, v, n, &want, NULL), AVGPIPE_OK);
                for (sh = 0; sh < NSHAPE; sh++) {
                    uint32_t flag[2] = {0, 0};
                    const int dirty = want < n;
                    char what[128];
                    snprintf(what, sizeof what, "size %zu offset %zu case %zu shape %zu", n, o, t, sh);
                    emu_cas_calls = emu_or_calls = 0;
                    emu_flag(v, n, flag, 1u << 5, 0xabc0u + (uint32_t)t, &shapes[sh]);
                    if (!dirty) {
                        cr_assert(flag[0] == 0 && flag[1] == 0, "%s: clean data flagged {%#x, %#x}", what, flag[0], flag[1]);
                        cr_assert_eq(emu_cas_calls, 0u, "%s: clean data touched the flag", what);
                        continue;
                    }
                    cr_assert(flag[0] == 1u << 5 && flag[1] == 0xabc0u + (uint32_t)t, "%s: flag {%#x, %#x}", what, flag[0], flag[1]);
                    cr_assert_eq(emu_cas_calls, emu_or_calls + 1, "%s: one winner, the other finders OR", what);
                    /* a second flagging call (other bits, other tag): bits ORed, the first tag kept */
                    emu_flag(v, n, flag, 1u << 9, 0x55u, &shapes[sh]);
                    cr_assert(flag[0] == ((1u << 5) | (1u << 9)) && flag[1] == 0xabc0u + (uint32_t)t, "%s: second call: {%#x, %#x}",
                              what, flag[0], flag[1]);
                    /* the same bits again: nothing changes */
                    emu_flag(v, n, flag, 1u << 5, 0x66u, &shapes[sh]);
                    cr_assert(flag[0] == ((1u << 5) | (1u << 9)) && flag[1] == 0xabc0u + (uint32_t)t, "%s: third call", what);
                }
            }
    {
        /* a clean call after a flagged one changes nothing; a flagged call on a set flag keeps the tag; as the
           test devices (adev_flag_task) do */
        uint32_t flag[2] = {0, 0};
        for (j = 0; j < 100; j++) x[j] = (float)j;
        emu_flag(x, 100, flag, 1u, 3u, &shapes[2]);
        cr_assert(flag[0] == 0 && flag[1] == 0);
        x[37] = NAN;
        emu_flag(x, 100, flag, 1u << 31, 4u, &shapes[2]);
        cr_assert(flag[0] == 1u << 31 && flag[1] == 4u);
        x[37] = 1.0f;
        emu_flag(x, 100, flag, 1u, 5u, &shapes[2]);
        cr_assert(flag[0] == 1u << 31 && flag[1] == 4u, "a clean call changed the flag");
        emu_flag(x, 0, flag, 1u, 6u, &shapes[2]);
        cr_assert(flag[0] == 1u << 31 && flag[1] == 4u);
    }
    avgpipe_device_destroy(&cpu);
    free(x);
}

/* The averaging kernel's skip word (emulated): *skip nonzero leaves w and acc bit-identical, whatever the
   pass; *skip 0 and skip NULL give the CPU device's bits, as before. */
static void emu_ea_skip(const avgpipe_ea_pass *p, void *user) {
    avgpipe_ea_pass q = *p;
    q.skip = (const uint32_t *)user;
    emu_ea(&q, (void *)&shapes[1]);
}
static void host_twin_skip(const avgpipe_ea_pass *p, void *user) {
    avgpipe_ea_pass q = *p;
    q.skip = (const uint32_t *)user;
    host_twin(&q, NULL);
}
Test(cuda_kernels, ea_kernel_honours_skip) {
    avgpipe_device cpu;
    rng r = {17};
    const size_t nmax = 4097 + 8;
    float *w = fbuf(nmax), *z = fbuf(nmax), *zp = fbuf(nmax), *a = fbuf(nmax), *w2 = fbuf(nmax), *a2 = fbuf(nmax);
    const float alphas[] = {0.0f, 0.1f};
    static const size_t ns[] = {1, 5, 33, 4097};
    const uint32_t zero = 0, one = 1, other = 0x80000000u;
    pass_kind kinds[32];
    int nk = pass_kinds(kinds, alphas, 2), k;
    size_t ni, j, o;
    for (j = 0; j < nmax; j++)
        w[j] = rng_float(&r, -2, 2), z[j] = rng_float(&r, -2, 2), zp[j] = rng_float(&r, -2, 2), a[j] = rng_float(&r, -8, 8);
    cr_assert_eq(avgpipe_device_cpu_create(NULL, NULL, &cpu), AVGPIPE_OK);
    for (ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
        for (o = 0; o < 2; o++)
            for (k = 0; k < nk; k++) {
                const size_t n = ns[ni];
                const uint32_t *skips[] = {&one, &other};
                int s;
                /* *skip 0 and NULL: the CPU device's bits */
                compare_pass(&cpu, &kinds[k], w + o, z + o, zp + o, a + o, n, emu_ea_skip, (void *)&zero, 1, "ea kernel, *skip 0");
                compare_pass(&cpu, &kinds[k], w + o, z + o, zp + o, a + o, n, emu_ea_skip, NULL, 1, "ea kernel, skip NULL");
                compare_pass(&cpu, &kinds[k], w + o, z + o, zp + o, a + o, n, host_twin_skip, (void *)&zero, 1, "host twin, *skip 0");
                for (s = 0; s < 2; s++) {
                    avgpipe_ea_pass p;
                    memcpy(w2, w, nmax * sizeof(float)), memcpy(a2, a, nmax * sizeof(float));
                    p = make_pass(&kinds[k], w2 + o, z + o, zp + o, a2 + o, n);
                    emu_ea_skip(&p, (void *)skips[s]);
                    cr_assert(memcmp(w2, w, nmax * sizeof(float)) == 0 && memcmp(a2, a, nmax * sizeof(float)) == 0,
                              "ea kernel with *skip %#x changed w or acc (size %zu kind %d)", *skips[s], n, k);
                    p.skip = skips[s];
                    cr_assert_eq(avgpipe_device_cuda_ea_pass_host(NULL, &p), AVGPIPE_OK);
                    cr_assert(memcmp(w2, w, nmax * sizeof(float)) == 0 && memcmp(a2, a, nmax * sizeof(float)) == 0,
                              "host twin with *skip %#x changed w or acc", *skips[s]);
                    cr_assert_eq(cpu.ea_pass(cpu.user, &p, NULL), AVGPIPE_OK);
                    cr_assert(memcmp(w2, w, nmax * sizeof(float)) == 0 && memcmp(a2, a, nmax * sizeof(float)) == 0,
                              "CPU device with *skip changed w or acc");
                }
            }
    avgpipe_device_destroy(&cpu);
    free(w), free(z), free(zp), free(a), free(w2), free(a2);
}

Test(cuda_kernels, scale_kernel_matches_cpu_device) {
    avgpipe_device cpu;
    rng r = {5};
    const size_t nmax = 10007 + 8;
    float *x = fbuf(nmax), *y = fbuf(nmax);
    const float factors[] = {0.25f, 1.0f / 3.0f, -0.0f, 3.0e38f, 1e-40f};
    size_t si, o, f, sh, j;
    cr_assert_eq(avgpipe_device_cpu_create(NULL, NULL, &cpu), AVGPIPE_OK);
    for (si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
        for (o = 0; o < 4; o++)
            for (f = 0; f < sizeof factors / sizeof factors[0]; f++)
                for (sh = 0; sh < NSHAPE; sh++) {
                    size_t n = sizes[si];
                    const void *p[1];
                    avgpipe__cuda_plan pl;
                    float *a = x + o, *b = y + o, s = factors[f];
                    for (j = 0; j < n + 1; j++) a[j] = b[j] = rng_float(&r, -4, 4);
                    a[0] = b[0] = from_bits(0x00000003u); /* a denormal */
                    cr_assert_eq(cpu.scale(cpu.user, a, s, n, NULL), AVGPIPE_OK);
                    p[0] = b;
                    pl = avgpipe__cuda_plan_make(p, 1, n, shapes[sh].block, shapes[sh].max_blocks);
                    EMU_GRID(pl, avgpipe__cu_scale(b, s, pl.head, pl.nvec, pl.tail));
                    for (j = 0; j < n + 1; j++)
                        cr_assert(same(a[j], b[j]), "size %zu offset %zu factor %g element %zu: CPU %a kernel %a", n, o,
                                  (double)s, j, (double)a[j], (double)b[j]);
                }
    avgpipe_device_destroy(&cpu);
    free(x), free(y);
}

/* ---- grids from occupancy -------------------------------------------------------------------------------
   An emulated H200 as CUDA's occupancy calculator sees it: 132 multiprocessors of 2048 threads, 65536
   registers (allocated per warp in units of 256), at most 32 blocks; the kernels' registers per thread as
   ptxas reports them for sm_90 (ea 38, non-finite 20, scale 18, flag 16 as a stand-in). The fake kernel
   handles 1, 2, 3, 4 stand for the four kernels. */
static int emu_regs[4] = {38, 20, 18, 16};
static int emu_calls;
static cudaError_t emu_occupancy(int *blocks, const void *kernel, int block) {
    int k = (int)(uintptr_t)kernel - 1, per_warp, by_regs, by_threads, n;
    emu_calls++;
    if (k < 0 || k > 3) return cudaErrorInvalidDeviceFunction;
    per_warp = (emu_regs[k] * 32 + 255) / 256 * 256;
    by_regs = 65536 / per_warp / (block / 32); /* whole blocks of warps the register file holds */
    by_threads = 2048 / block;
    n = by_regs < by_threads ? by_regs : by_threads;
    *blocks = n < 32 ? n : 32;
    return cudaSuccess;
}
static void emu_gpu(avgpipe__cuda *st, int block_size, int max_blocks) {
    memset(st, 0, sizeof *st);
    st->magic = AVGPIPE__CUDA_MAGIC;
    snprintf(st->name, sizeof st->name, "cuda:0");
    st->info.desc = avgpipe_device_cuda_query_defaults(NULL);
    st->info.desc.block_size = block_size, st->info.desc.max_blocks = max_blocks;
    st->info.multiprocessors = 132;
    st->k_ea = (const void *)1, st->k_nonfinite = (const void *)2, st->k_scale = (const void *)3, st->k_flag = (const void *)4;
}

Test(cuda_kernels, grid_is_multiprocessors_times_occupancy) {
    avgpipe__cuda st;
    avgpipe_context ctx;
    avgpipe__cuda_ea_args x;
    avgpipe__cuda_plan pl;
    avgpipe_ea_pass p;
    const void *ptrs[1];
    float *buf = fbuf(16);
    const int E = AVGPIPE_DEVICE_CUDA_KERNEL_EA, NF = AVGPIPE_DEVICE_CUDA_KERNEL_NONFINITE, SC = AVGPIPE_DEVICE_CUDA_KERNEL_SCALE;
    avgpipe_context_init(&ctx, NULL);
    emu_gpu(&st, 256, 0);
    emu_calls = 0;
    cr_assert_eq(avgpipe__cuda_occupancy(&ctx, &st, emu_occupancy), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(emu_calls, AVGPIPE_DEVICE_CUDA_KERNEL_COUNT, "asked once per kernel");
    cr_assert_eq(AVGPIPE_DEVICE_CUDA_KERNEL_COUNT, 4);
    cr_assert_eq(st.info.blocks_per_sm[AVGPIPE_DEVICE_CUDA_KERNEL_FLAG], 8);
    cr_assert_eq(st.info.grid[AVGPIPE_DEVICE_CUDA_KERNEL_FLAG], 132 * 8);
    /* 38 registers: 1280 per warp, 51 warps, 6 blocks of 8 warps (not the 8 that 2048 threads allow) */
    cr_assert_eq(st.info.blocks_per_sm[E], 6);
    cr_assert_eq(st.info.blocks_per_sm[NF], 8);
    cr_assert_eq(st.info.blocks_per_sm[SC], 8);
    cr_assert_eq(st.info.grid[E], 132 * st.info.blocks_per_sm[E]);
    cr_assert_eq(st.info.grid[E], 792);
    cr_assert_eq(st.info.grid[NF], 132 * 8);
    cr_assert_eq(st.info.grid[SC], 132 * 8);
    cr_assert_eq(st.info.desc.max_blocks, 1056, "the resolved max_blocks is the largest grid");
    /* the entries' plans of a pass that would cover more blocks: each kernel its own grid, never more */
    memset(&p, 0, sizeof p);
    p.w = buf, p.acc = buf + 4, p.count = (size_t)1 << 28, p.mode = AVGPIPE_EA_MEAN, p.first = 1;
    x = avgpipe__cuda_ea_prep(&p, st.info.desc.block_size, st.info.grid[E]); /* as avgpipe__cuda_ea_pass */
    cr_assert_eq(x.pl.grid, 792u);
    cr_assert_eq(x.pl.block, 256u);
    ptrs[0] = buf;
    pl = avgpipe__cuda_plan_of(&st, NF, ptrs, 1, (size_t)1 << 28);
    cr_assert_eq(pl.grid, 1056u);
    pl = avgpipe__cuda_plan_of(&st, SC, ptrs, 1, (size_t)1 << 28);
    cr_assert_eq(pl.grid, 1056u);
    pl = avgpipe__cuda_plan_of(&st, SC, ptrs, 1, 1000); /* small: only the blocks it needs */
    cr_assert_eq(pl.grid, 1u);
    /* 1024 threads a block: 51 warps hold one block of 32 warps of the ea kernel */
    emu_gpu(&st, 1024, 0);
    cr_assert_eq(avgpipe__cuda_occupancy(&ctx, &st, emu_occupancy), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert(st.info.blocks_per_sm[E] == 1 && st.info.grid[E] == 132 && st.info.grid[NF] == 264, "%d %d", st.info.grid[E],
              st.info.grid[NF]);
    /* desc.max_blocks given: every kernel's grid, the occupancy still reported */
    emu_gpu(&st, 256, 100);
    cr_assert_eq(avgpipe__cuda_occupancy(&ctx, &st, emu_occupancy), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert(st.info.grid[E] == 100 && st.info.grid[NF] == 100 && st.info.grid[SC] == 100 &&
              st.info.grid[AVGPIPE_DEVICE_CUDA_KERNEL_FLAG] == 100 && st.info.desc.max_blocks == 100);
    cr_assert_eq(st.info.blocks_per_sm[E], 6);
    /* no block fits (too many registers for 1024 threads): refused, naming the kernel and the block size */
    emu_regs[0] = 80;
    emu_gpu(&st, 1024, 0);
    cr_assert_eq(avgpipe__cuda_occupancy(&ctx, &st, emu_occupancy), AVGPIPE_BACKEND_ERROR);
    cr_assert(has(avgpipe_last_error(&ctx), "avgpipe__cu_ea") && has(avgpipe_last_error(&ctx), "blocks of 1024 threads") &&
                  has(avgpipe_last_error(&ctx), "desc.block_size"),
              "%s", avgpipe_last_error(&ctx));
    emu_regs[0] = 38;
    /* the query fails: CUDA's text, naming the call and the kernel */
    emu_gpu(&st, 256, 0);
    st.k_scale = (const void *)7;
    cr_assert_eq(avgpipe__cuda_occupancy(&ctx, &st, emu_occupancy), AVGPIPE_BACKEND_ERROR);
    cr_assert(has(avgpipe_last_error(&ctx), "cudaOccupancyMaxActiveBlocksPerMultiprocessor") &&
                  has(avgpipe_last_error(&ctx), "cudaErrorInvalidDeviceFunction") && has(avgpipe_last_error(&ctx), "avgpipe__cu_scale"),
              "%s", avgpipe_last_error(&ctx));
    free(buf);
}

/* The kernels' results do not depend on the grid: the emulated kernels over the occupancy grids of the
   emulated H200 (792, 1056), a partial wave, one block, and a grid that covers the work without looping,
   on a pass longer than one full wave of the largest grid (so threads loop, and some more than others),
   at a misaligned offset (a scalar head and tail), every time the CPU device's bits. */
Test(cuda_kernels, results_do_not_depend_on_the_grid) {
    avgpipe_device cpu;
    rng r = {23};
    const size_t n = (size_t)1056 * 256 * 4 + 792 * 256 + 3;
    float *w = fbuf(n + 8), *z = fbuf(n + 8), *zp = fbuf(n + 8), *a = fbuf(n + 8), *x = fbuf(n + 8), *y = fbuf(n + 8);
    const int grids[] = {792, 1056, 131, 1, 1 << 20};
    const float alphas[] = {0.1f};
    pass_kind kinds[16];
    int nk = pass_kinds(kinds, alphas, 1), k;
    size_t gi, j, want, got;
    for (j = 0; j < n + 8; j++)
        w[j] = rng_float(&r, -2, 2), z[j] = rng_float(&r, -2, 2), zp[j] = rng_float(&r, -2, 2), a[j] = rng_float(&r, -8, 8);
    cr_assert_eq(avgpipe_device_cpu_create(NULL, NULL, &cpu), AVGPIPE_OK);
    x[1 + n - 5] = NAN, x[1 + n / 2 + 7] = INFINITY; /* two non-finite values: the lower wins */
    cr_assert_eq(cpu.find_nonfinite(cpu.user, x + 1, n, &want, NULL), AVGPIPE_OK);
    cr_assert_eq(want, n / 2 + 7);
    for (gi = 0; gi < sizeof grids / sizeof grids[0]; gi++) {
        launch_shape sh;
        const void *ptrs[1];
        avgpipe__cuda_plan pl;
        sh.block = 256, sh.max_blocks = grids[gi];
        for (k = 0; k < nk; k += 2) /* MEAN and ELASTIC, first/last, momentum: every other kind */
            compare_pass(&cpu, &kinds[k], w + 1, z + 1, zp + 1, a + 1, n, emu_ea, &sh, 1, "emulated ea kernel, grid sweep");
        got = emu_nonfinite(x + 1, n, &sh);
        cr_assert_eq(got, want, "grid %d: non-finite scan gives %zu, the CPU device %zu", grids[gi], got, want);
        for (j = 0; j < n; j++) y[1 + j] = w[1 + j];
        ptrs[0] = y + 1;
        pl = avgpipe__cuda_plan_make(ptrs, 1, n, 256, grids[gi]);
        cr_assert(pl.nvec > 0 && pl.head == 3 && pl.grid <= (unsigned)grids[gi]);
        EMU_GRID(pl, avgpipe__cu_scale(y + 1, 1.0f / 3.0f, pl.head, pl.nvec, pl.tail));
        for (j = 0; j < n; j++) {
            float c = w[1 + j];
            cr_assert_eq(cpu.scale(cpu.user, &c, 1.0f / 3.0f, 1, NULL), AVGPIPE_OK);
            if (!same(c, y[1 + j])) cr_assert(0, "grid %d: scale element %zu: CPU %a kernel %a", grids[gi], j, (double)c, (double)y[1 + j]);
        }
    }
    avgpipe_device_destroy(&cpu);
    free(w), free(z), free(zp), free(a), free(x), free(y);
}

/* ---- NVRTC: the source compiles, and into PTX without FMA or flush-to-zero ------------------------------ */

static char *ptx_for(int arch) {
    avgpipe_context ctx;
    avgpipe_allocator al = avgpipe_context_query(NULL).allocator;
    char *image = NULL;
    size_t size = 0;
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe__nvrtc_build(&ctx, &al, arch, 0, &image, &size), AVGPIPE_OK, "compute_%d: %s", arch,
                 avgpipe_last_error(&ctx));
    cr_assert(image && size > 0 && image[size - 1] == 0);
    return image;
}

Test(cuda_nvrtc, kernels_have_no_fma_and_keep_denormals) {
    int archs[] = {75, 80, 90, 0};
    int machine, lo, hi, k;
    archs[3] = avgpipe__nvrtc_arch(1000, &machine, &lo, &hi); /* the newest NVRTC knows */
    cr_assert_gt(archs[3], 0);
    for (k = 0; k < 4; k++) {
        char *ptx = ptx_for(archs[k]);
        cr_assert(has(ptx, ".entry avgpipe__cu_ea("), "compute_%d: no ea kernel", archs[k]);
        cr_assert(has(ptx, ".entry avgpipe__cu_nonfinite("), "compute_%d: no non-finite kernel", archs[k]);
        cr_assert(has(ptx, ".entry avgpipe__cu_scale("), "compute_%d: no scale kernel", archs[k]);
        cr_assert(has(ptx, ".entry avgpipe__cu_flag("), "compute_%d: no flag kernel", archs[k]);
        cr_assert(has(ptx, "global.cas.b32") && has(ptx, "global.or.b32"), "compute_%d: the flag's atomics", archs[k]);
        cr_assert(has(ptx, "add.rn.f32") && has(ptx, "sub.rn.f32") && has(ptx, "mul.rn.f32"), "compute_%d", archs[k]);
        cr_assert(!has(ptx, "fma"), "compute_%d: an FMA in the kernels' PTX", archs[k]);
        cr_assert(!has(ptx, ".ftz"), "compute_%d: flush-to-zero in the kernels' PTX", archs[k]);
        cr_assert(has(ptx, "ld.global.v4.f32") || has(ptx, "ld.global.nc.v4.f32"), "compute_%d: no float4 loads", archs[k]);
        free(ptx);
    }
}

/* The check above can fail: NVRTC does contract a plain a * b + c into an FMA when allowed to. */
Test(cuda_nvrtc, control_kernel_shows_fma) {
    const char *src = "extern \"C\" __global__ void k(float *x) { x[0] = x[1] * x[2] + x[3]; }\n";
    const char *opts[] = {"--gpu-architecture=compute_90", "--fmad=true"};
    nvrtcProgram prog;
    size_t n;
    char *ptx;
    cr_assert_eq(nvrtcCreateProgram(&prog, src, "control.cu", 0, NULL, NULL), NVRTC_SUCCESS);
    cr_assert_eq(nvrtcCompileProgram(prog, 2, opts), NVRTC_SUCCESS);
    cr_assert_eq(nvrtcGetPTXSize(prog, &n), NVRTC_SUCCESS);
    ptx = (char *)malloc(n);
    cr_assert_eq(nvrtcGetPTX(prog, ptx), NVRTC_SUCCESS);
    cr_assert(has(ptx, "fma.rn.f32"), "the control kernel was not contracted:\n%s", ptx);
    free(ptx);
    nvrtcDestroyProgram(&prog);
}

/* What creation loads on an H100/H200: machine code for sm_90 (an ELF cubin). */
Test(cuda_nvrtc, cubin_for_sm_90) {
    avgpipe_context ctx;
    avgpipe_allocator al = avgpipe_context_query(NULL).allocator;
    char *image = NULL;
    size_t size = 0;
    int machine, lo, hi;
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe__nvrtc_arch(90, &machine, &lo, &hi), 90);
    cr_assert_eq(machine, 1);
    cr_assert_eq(avgpipe__nvrtc_build(&ctx, &al, 90, 1, &image, &size), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert(size > 4 && memcmp(image, "\177ELF", 4) == 0);
    free(image);
    /* an architecture NVRTC does not know as machine code: PTX for the newest one below it */
    cr_assert_eq(avgpipe__nvrtc_arch(91, &machine, &lo, &hi), 90);
    cr_assert_eq(machine, 0);
    cr_assert_eq(avgpipe__nvrtc_arch(lo - 1, &machine, &lo, &hi), 0, "older than NVRTC's oldest: refused");
}

/* ---- creation, entries and errors without a device -------------------------------------------------- */

Test(cuda_device, query_defaults) {
    avgpipe_device_cuda_desc d, q;
    q = avgpipe_device_cuda_query_defaults(NULL);
    cr_assert(q.device == 0 && q.block_size == 256 && q.max_blocks == 0 && q.no_timing == 0 && q.blocking_sync == 0 &&
              q.timeout_s == 300.0 && q.timed_events == 0);
    memset(&d, 0, sizeof d);
    d.device = 3, d.block_size = 128, d.max_blocks = 7, d.no_timing = 1, d.blocking_sync = 1, d.timeout_s = 2.5, d.timed_events = 1;
    q = avgpipe_device_cuda_query_defaults(&d);
    cr_assert(q.device == 3 && q.block_size == 128 && q.max_blocks == 7 && q.no_timing == 1 && q.blocking_sync == 1 &&
              q.timeout_s == 2.5 && q.timed_events == 1);
}

Test(cuda_device, invalid_arguments) {
    avgpipe_context ctx;
    avgpipe_device dev;
    avgpipe_device_cuda_desc d;
    avgpipe_device_cuda_info info;
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_device_cuda_create(&ctx, NULL, NULL), AVGPIPE_INVALID_ARG);
    memset(&d, 0, sizeof d);
    d.device = -1;
    memset(&dev, 0x5a, sizeof dev);
    cr_assert_eq(avgpipe_device_cuda_create(&ctx, &d, &dev), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "desc.device"), "%s", avgpipe_last_error(&ctx));
    cr_assert(dev.alloc == NULL && dev.user == NULL && dev.name == NULL, "the table is zeroed on error");
    d.device = 0, d.block_size = 48;
    cr_assert_eq(avgpipe_device_cuda_create(&ctx, &d, &dev), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "desc.block_size"), "%s", avgpipe_last_error(&ctx));
    d.block_size = 2048;
    cr_assert_eq(avgpipe_device_cuda_create(&ctx, &d, &dev), AVGPIPE_INVALID_ARG);
    d.block_size = 0, d.max_blocks = -2;
    cr_assert_eq(avgpipe_device_cuda_create(&ctx, &d, &dev), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "desc.max_blocks"), "%s", avgpipe_last_error(&ctx));
    d.max_blocks = 0, d.timeout_s = -1.0;
    cr_assert_eq(avgpipe_device_cuda_create(&ctx, &d, &dev), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "desc.timeout_s"), "%s", avgpipe_last_error(&ctx));
    d.timeout_s = (double)NAN;
    cr_assert_eq(avgpipe_device_cuda_create(&ctx, &d, &dev), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "desc.timeout_s"), "%s", avgpipe_last_error(&ctx));
    d.timeout_s = 0, d.no_timing = 1, d.timed_events = 1; /* no event timed, and every one */
    cr_assert_eq(avgpipe_device_cuda_create(&ctx, &d, &dev), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "desc.no_timing and desc.timed_events"), "%s", avgpipe_last_error(&ctx));
    /* query: only on CUDA tables */
    cr_assert_eq(avgpipe_device_cuda_query(&ctx, NULL, &info), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_device_cpu_create(NULL, NULL, &dev), AVGPIPE_OK);
    cr_assert_eq(avgpipe_device_cuda_query(&ctx, &dev, &info), AVGPIPE_INVALID_ARG);
    cr_assert(has(avgpipe_last_error(&ctx), "'cpu' is not a CUDA device"), "%s", avgpipe_last_error(&ctx));
    avgpipe_device_destroy(&dev);
}

/* This machine and CI have no GPU: creation must fail with CUDA's own words, leave nothing allocated, and
   leave the table zeroed. (On a machine with a GPU the ordinal past the last device is the failing case.) */
Test(cuda_device, create_without_device_fails_cleanly) {
    avgpipe_context ctx;
    counter c;
    avgpipe_device dev;
    avgpipe_device_cuda_desc d;
    int n = -1;
    cudaError_t e = cudaGetDeviceCount(&n);
    const char *msg;
    counting_ctx(&ctx, &c);
    memset(&d, 0, sizeof d);
    if (e == cudaSuccess && n > 0) d.device = n + 3;
    memset(&dev, 0x5a, sizeof dev);
    cr_assert_eq(avgpipe_device_cuda_create(&ctx, &d, &dev), AVGPIPE_BACKEND_ERROR);
    msg = avgpipe_last_error(&ctx);
    if (e != cudaSuccess) {
        cr_assert(has(msg, cudaGetErrorString(e)), "CUDA's text missing: %s", msg);
        cr_assert(has(msg, "cudaGetDeviceCount") && has(msg, "cuda:0"), "%s", msg);
    } else if (n == 0) {
        cr_assert(has(msg, "no such device"), "%s", msg);
    } else {
        cr_assert(has(msg, "no such device") && has(msg, "CUDA device"), "%s", msg);
    }
    cr_assert_eq(c.live, 0, "creation left %ld allocations behind", c.live);
    cr_assert(dev.alloc == NULL && dev.user == NULL && dev.destroy == NULL);
    avgpipe_device_destroy(&dev); /* a zeroed table: harmless */
    /* a second attempt fails the same way (no state kept from the first) */
    cr_assert_eq(avgpipe_device_cuda_create(&ctx, &d, &dev), AVGPIPE_BACKEND_ERROR);
    cr_assert_eq(c.live, 0);
}

Test(cuda_device, errors_map_to_results) {
    int done = 7;
    const char *t;
    cr_assert_eq(avgpipe__cuda_result(cudaSuccess), AVGPIPE_OK);
    cr_assert_eq(avgpipe__cuda_result(cudaErrorMemoryAllocation), AVGPIPE_OUT_OF_MEMORY);
    cr_assert_eq(avgpipe__cuda_result(cudaErrorInvalidValue), AVGPIPE_BACKEND_ERROR);
    cr_assert_eq(avgpipe__cuda_result(cudaErrorIllegalAddress), AVGPIPE_BACKEND_ERROR);
    cr_assert_eq(avgpipe__cuda_result(cudaErrorLaunchFailure), AVGPIPE_BACKEND_ERROR);
    cr_assert_eq(avgpipe__cuda_result(cudaErrorNoDevice), AVGPIPE_BACKEND_ERROR);
    cr_assert_eq(avgpipe__cuda_result(cudaErrorInsufficientDriver), AVGPIPE_BACKEND_ERROR);
    cr_assert_eq(avgpipe__nvrtc_result(NVRTC_SUCCESS), AVGPIPE_OK);
    cr_assert_eq(avgpipe__nvrtc_result(NVRTC_ERROR_OUT_OF_MEMORY), AVGPIPE_OUT_OF_MEMORY);
    cr_assert_eq(avgpipe__nvrtc_result(NVRTC_ERROR_COMPILATION), AVGPIPE_BACKEND_ERROR);
    /* the text names the device, the entry, the call, and CUDA's string and name */
    cr_assert_eq(avgpipe__cuda_fail("cuda:2", cudaErrorMemoryAllocation, "alloc", "cudaMalloc"), AVGPIPE_OUT_OF_MEMORY);
    t = avgpipe__cuda_error_string(NULL);
    cr_assert(has(t, "cuda:2 alloc: cudaMalloc: ") && has(t, cudaGetErrorString(cudaErrorMemoryAllocation)) &&
                  has(t, "cudaErrorMemoryAllocation"),
              "%s", t);
    /* event_query: not ready is an answer */
    cr_assert_eq(avgpipe__cuda_query_done("cuda:0", cudaErrorNotReady, &done), AVGPIPE_OK);
    cr_assert_eq(done, 0);
    cr_assert_eq(avgpipe__cuda_query_done("cuda:0", cudaSuccess, &done), AVGPIPE_OK);
    cr_assert_eq(done, 1);
    cr_assert_eq(avgpipe__cuda_query_done("cuda:0", cudaErrorInvalidResourceHandle, &done), AVGPIPE_BACKEND_ERROR);
    cr_assert_eq(done, 0);
    cr_assert(has(avgpipe__cuda_error_string(NULL), "event_query: cudaEventQuery"), "%s", avgpipe__cuda_error_string(NULL));
}

/* The waits' clock and sleep (see WAITS): a nap sleeps about what it is asked, a deadline is in the future. */
Test(cuda_device, wait_helpers) {
    double t0 = avgpipe__cuda_now(), t;
    struct timespec until = avgpipe__cuda_deadline(1.75), now;
    avgpipe__cuda_nap(20000.0);
    t = avgpipe__cuda_now() - t0;
    cr_assert(t >= 0.019 && t < 2.0, "a 20 ms nap took %g s", t);
    timespec_get(&now, TIME_UTC);
    t = (double)(until.tv_sec - now.tv_sec) + 1e-9 * (double)(until.tv_nsec - now.tv_nsec);
    cr_assert(t > 1.5 && t <= 1.75, "deadline %g s ahead", t);
    cr_assert(until.tv_nsec >= 0 && until.tv_nsec < 1000000000L);
}

/* error_string is per thread: another thread's failure does not show here. */
static void *fail_elsewhere(void *arg) {
    (void)arg;
    (void)avgpipe__cuda_fail("cuda:1", cudaErrorInvalidValue, "copy", "cudaMemcpyAsync");
    return (void *)(intptr_t)has(avgpipe__cuda_error_string(NULL), "cuda:1 copy");
}
Test(cuda_device, error_string_is_per_thread) {
    pthread_t t;
    void *seen = NULL;
    cr_assert_str_eq(avgpipe__cuda_error_string(NULL), "");
    cr_assert_eq(pthread_create(&t, NULL, fail_elsewhere, NULL), 0);
    cr_assert_eq(pthread_join(t, &seen), 0);
    cr_assert_eq((intptr_t)seen, 1);
    cr_assert_str_eq(avgpipe__cuda_error_string(NULL), "");
}

/* Every entry of a table whose device cannot be reached fails with AVGPIPE_BACKEND_ERROR (or records the
   failure, for the void ones), naming itself and CUDA's text; none crashes. Needs the state of this machine
   (CUDA present, no usable device): skipped where a GPU is. */
Test(cuda_device, every_entry_reports_cuda_errors) {
    avgpipe__cuda st;
    avgpipe_device dev;
    avgpipe_device_stream s = NULL;
    avgpipe_device_event ev = NULL;
    avgpipe_ea_pass p;
    float host[8] = {0};
    size_t index = 0;
    double secs = 1;
    int done = 5;
    void *ptr = (void *)1;
    const char *want;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess && n > 0) cr_skip_test("a CUDA device is present: the failure paths are exercised by the GPU check");
    want = cudaGetErrorString(e);
    memset(&st, 0, sizeof st);
    st.magic = AVGPIPE__CUDA_MAGIC;
    snprintf(st.name, sizeof st.name, "cuda:0");
    st.info.desc = avgpipe_device_cuda_query_defaults(NULL);
    st.info.desc.max_blocks = 4;
    st.info.grid[0] = st.info.grid[1] = st.info.grid[2] = st.info.grid[3] = 4;
    memset(&dev, 0, sizeof dev);
    avgpipe__cuda_fill(&dev, &st);
    cr_assert_eq(avgpipe_device_check(NULL, &dev), AVGPIPE_OK, "the table is complete");
    cr_assert(dev.event_elapsed != NULL && dev.scale != NULL && dev.error_string != NULL && dev.flag_nonfinite != NULL);
    cr_assert_str_eq(dev.name, "cuda:0");
#define EXPECT_FAIL(call, entry)                                                                                   \
    do {                                                                                                           \
        avgpipe_result r_ = (call);                                                                                \
        cr_assert_eq(r_, AVGPIPE_BACKEND_ERROR, "%s returned %d", entry, (int)r_);                                 \
        cr_assert(has(dev.error_string(dev.user), "cuda:0 " entry ": ") && has(dev.error_string(dev.user), want),  \
                  "%s: %s", entry, dev.error_string(dev.user));                                                    \
    } while (0)
    EXPECT_FAIL(dev.alloc(dev.user, 16, &ptr), "alloc");
    cr_assert_null(ptr);
    EXPECT_FAIL(dev.copy(dev.user, host, host + 4, 16, AVGPIPE_DEVICE_COPY_H2D, NULL), "copy");
    EXPECT_FAIL(dev.memset(dev.user, host, 0, 16, NULL), "memset");
    EXPECT_FAIL(dev.stream_create(dev.user, &s), "stream_create");
    EXPECT_FAIL(dev.stream_synchronize(dev.user, NULL), "stream_synchronize");
    EXPECT_FAIL(dev.event_create(dev.user, &ev), "event_create");
    EXPECT_FAIL(dev.event_record(dev.user, ev, NULL), "event_record");
    EXPECT_FAIL(dev.stream_wait_event(dev.user, NULL, ev), "stream_wait_event");
    EXPECT_FAIL(dev.event_synchronize(dev.user, ev), "event_synchronize");
    EXPECT_FAIL(dev.event_query(dev.user, ev, &done), "event_query");
    cr_assert_eq(done, 0);
    EXPECT_FAIL(dev.event_elapsed(dev.user, ev, ev, &secs), "event_elapsed");
    cr_assert_eq(secs, 0.0);
    EXPECT_FAIL(dev.synchronize(dev.user), "synchronize");
    memset(&p, 0, sizeof p);
    p.w = host, p.acc = host + 4, p.count = 4, p.mode = AVGPIPE_EA_MEAN, p.first = 1;
    EXPECT_FAIL(dev.ea_pass(dev.user, &p, NULL), "ea_pass");
    EXPECT_FAIL(dev.find_nonfinite(dev.user, host, 8, &index, NULL), "find_nonfinite");
    cr_assert_eq(index, (size_t)8);
    EXPECT_FAIL(dev.scale(dev.user, host, 2.0f, 8, NULL), "scale");
    {
        uint32_t flag[2] = {0, 0};
        EXPECT_FAIL(dev.flag_nonfinite(dev.user, host, 8, flag, 1u, 7u, NULL), "flag_nonfinite");
        cr_assert(flag[0] == 0 && flag[1] == 0);
        cr_assert_eq(dev.flag_nonfinite(dev.user, host, 0, flag, 1u, 7u, NULL), AVGPIPE_OK, "no work, no call");
    }
    /* the void entries record their failure */
    dev.free(dev.user, host);
    cr_assert(has(dev.error_string(dev.user), "cuda:0 free: "), "%s", dev.error_string(dev.user));
    dev.stream_destroy(dev.user, (avgpipe_device_stream)host);
    cr_assert(has(dev.error_string(dev.user), "cuda:0 stream_destroy: "), "%s", dev.error_string(dev.user));
    dev.event_destroy(dev.user, (avgpipe_device_event)host);
    cr_assert(has(dev.error_string(dev.user), "cuda:0 event_destroy: "), "%s", dev.error_string(dev.user));
    /* no work, no call: empty copies, passes and scans succeed without touching CUDA */
    cr_assert_eq(dev.copy(dev.user, host, host, 0, AVGPIPE_DEVICE_COPY_D2D, NULL), AVGPIPE_OK);
    p.count = 0;
    cr_assert_eq(dev.ea_pass(dev.user, &p, NULL), AVGPIPE_OK);
    cr_assert_eq(dev.find_nonfinite(dev.user, host, 0, &index, NULL), AVGPIPE_OK);
    cr_assert_eq(index, (size_t)0);
    /* an unknown copy kind */
    cr_assert_eq(dev.copy(dev.user, host, host + 4, 16, (avgpipe_device_copy_kind)9, NULL), AVGPIPE_BACKEND_ERROR);
    cr_assert(has(dev.error_string(dev.user), "unknown copy kind 9"), "%s", dev.error_string(dev.user));
#undef EXPECT_FAIL
}

/* ---- events: timing modes and the timed twins (see TIMING) ------------------------------------------------ */

Test(cuda_device, events_are_made_without_timing) {
    avgpipe_device_cuda_desc d = avgpipe_device_cuda_query_defaults(NULL);
    avgpipe__cuda st;
    avgpipe_device dev;
    cr_assert_eq(avgpipe__cuda_event_flags(&d), (unsigned)cudaEventDisableTiming, "default: ordering events without timing");
    d.blocking_sync = 1;
    cr_assert_eq(avgpipe__cuda_event_flags(&d), (unsigned)(cudaEventDisableTiming | cudaEventBlockingSync));
    d.timed_events = 1;
    cr_assert_eq(avgpipe__cuda_event_flags(&d), (unsigned)cudaEventBlockingSync);
    d.blocking_sync = 0;
    cr_assert_eq(avgpipe__cuda_event_flags(&d), 0u, "timed_events: CUDA's default (timed) events");
    d.timed_events = 0, d.no_timing = 1;
    cr_assert_eq(avgpipe__cuda_event_flags(&d), (unsigned)cudaEventDisableTiming);
    /* the modes: default (twins, event_elapsed set), timed_events (no twins, event_elapsed set), no_timing (NULL) */
    emu_gpu(&st, 256, 0);
    avgpipe__cuda_fill(&dev, &st);
    cr_assert(dev.event_elapsed != NULL && st.twins == 1);
    emu_gpu(&st, 256, 0);
    st.info.desc.timed_events = 1;
    avgpipe__cuda_fill(&dev, &st);
    cr_assert(dev.event_elapsed != NULL && st.twins == 0);
    emu_gpu(&st, 256, 0);
    st.info.desc.no_timing = 1;
    avgpipe__cuda_fill(&dev, &st);
    cr_assert(dev.event_elapsed == NULL && st.twins == 0);
}

/* The table from an event to its timed twin: every event found after many additions (growing it) and
   removals (which move displaced entries back), none found after its removal, nothing leaked. The fake
   handles are addresses 16 bytes apart, as an allocator gives them. */
Test(cuda_device, timed_twin_table) {
    enum { NEV = 3000 };
    static char arena[16 * NEV], twins[NEV];
    avgpipe__cuda st;
    avgpipe_context ctx;
    counter c;
    int i, round;
    counting_ctx(&ctx, &c);
    memset(&st, 0, sizeof st);
    st.allocator = avgpipe_context_query(&ctx).allocator;
#define EV(i) ((cudaEvent_t)(void *)(arena + 16 * (i)))
#define TW(i) ((cudaEvent_t)(void *)(twins + (i)))
    cr_assert_null(avgpipe__cuda_tw_find(&st, EV(0)), "an empty table");
    cr_assert_null(avgpipe__cuda_tw_take(&st, EV(0)));
    for (round = 0; round < 3; round++) {
        for (i = 0; i < NEV; i++)
            if (!avgpipe__cuda_tw_find(&st, EV(i))) cr_assert_eq(avgpipe__cuda_tw_put(&st, EV(i), TW(i)), 0);
        cr_assert_eq(st.tw_n, (size_t)NEV);
        cr_assert(st.tw_cap >= 2 * (size_t)NEV && (st.tw_cap & (st.tw_cap - 1)) == 0, "at most half full, a power of two: %zu",
                  st.tw_cap);
        for (i = 0; i < NEV; i++) cr_assert_eq(avgpipe__cuda_tw_find(&st, EV(i)), TW(i), "round %d: event %d", round, i);
        for (i = round; i < NEV; i += 3) cr_assert_eq(avgpipe__cuda_tw_take(&st, EV(i)), TW(i));
        for (i = 0; i < NEV; i++)
            cr_assert_eq(avgpipe__cuda_tw_find(&st, EV(i)), (i - round) % 3 == 0 && i >= round ? NULL : TW(i), "round %d: event %d after removals",
                         round, i);
        cr_assert_null(avgpipe__cuda_tw_take(&st, EV(round)), "removed twice");
        cr_assert_null(avgpipe__cuda_tw_find(&st, NULL));
    }
    for (i = 0; i < NEV; i++) (void)avgpipe__cuda_tw_take(&st, EV(i));
    cr_assert_eq(st.tw_n, (size_t)0);
    for (i = 0; i < (int)st.tw_cap; i++) cr_assert_null(st.tw_key[i]);
    st.allocator.free(st.tw_key, st.allocator.user);
    st.allocator.free(st.tw_val, st.allocator.user);
    cr_assert_eq(c.live, 0);
#undef EV
#undef TW
}

/* When event_record makes twins (see TIMING): never while no anchor lives (no CUDA call at all: this
   machine's CUDA would fail it), and while one lives for an event without a twin (the attempt reaches
   CUDA, which fails here with its text); an event with a twin gets it without a call; once the anchor is
   dropped (what avgpipe__cuda_event_destroy does with it, done here by hand), no twin is made again. */
Test(cuda_device, twins_are_made_while_an_anchor_lives) {
    static char fake[64];
    avgpipe__cuda st;
    avgpipe_context ctx;
    counter c;
    cudaEvent_t twin = (cudaEvent_t)(void *)&twin, e1 = (cudaEvent_t)(void *)fake, e2 = (cudaEvent_t)(void *)(fake + 16), got;
    int made = 7, k;
    counting_ctx(&ctx, &c);
    emu_gpu(&st, 256, 0);
    st.allocator = avgpipe_context_query(&ctx).allocator;
    cr_assert_eq(pthread_mutex_init(&st.mu, NULL), 0);
    cr_assert_eq(avgpipe__cuda_twin(&st, e1, AVGPIPE__CUDA_TWIN_ANCHORED, "event_record", &got, &made), AVGPIPE_OK);
    cr_assert(got == NULL && made == 0, "no anchor: no twin made, no CUDA call");
    cr_assert_eq(avgpipe__cuda_anchor_add(&st, e2), 0); /* e2 was named as the start of an event_elapsed */
    cr_assert_eq(avgpipe__cuda_anchor_add(&st, e2), 0);
    cr_assert_eq(st.nanchors, 1, "once");
    if (!(cudaGetDeviceCount(&k) == cudaSuccess && k > 0)) {
        cr_assert_eq(avgpipe__cuda_twin(&st, e1, AVGPIPE__CUDA_TWIN_ANCHORED, "event_record", &got, &made), AVGPIPE_BACKEND_ERROR);
        cr_assert(has(avgpipe__cuda_error_string(NULL), "cuda:0 event_record: cudaEventCreateWithFlags: "), "%s",
                  avgpipe__cuda_error_string(NULL));
        cr_assert(got == NULL && made == 0 && st.tw_n == 0);
    }
    cr_assert_eq(avgpipe__cuda_tw_put(&st, e1, twin), 0);
    cr_assert_eq(avgpipe__cuda_twin(&st, e1, AVGPIPE__CUDA_TWIN_ANCHORED, "event_record", &got, &made), AVGPIPE_OK);
    cr_assert(got == twin && made == 0, "an existing twin");
    cr_assert_eq(avgpipe__cuda_twin(&st, e1, AVGPIPE__CUDA_TWIN_FIND, "event_record", &got, &made), AVGPIPE_OK);
    cr_assert(got == twin && made == 0);
    k = avgpipe__cuda_anchor_at(&st, e2);
    cr_assert_eq(k, 0);
    st.anchors[k] = st.anchors[--st.nanchors];
    cr_assert_eq(avgpipe__cuda_anchor_at(&st, e2), -1);
    cr_assert_eq(avgpipe__cuda_twin(&st, e2, AVGPIPE__CUDA_TWIN_ANCHORED, "event_record", &got, &made), AVGPIPE_OK);
    cr_assert(got == NULL && made == 0, "the anchor gone: no twin made");
    cr_assert_eq(avgpipe__cuda_tw_take(&st, e1), twin);
    pthread_mutex_destroy(&st.mu);
    st.allocator.free(st.tw_key, st.allocator.user);
    st.allocator.free(st.tw_val, st.allocator.user);
    st.allocator.free(st.anchors, st.allocator.user);
    cr_assert_eq(c.live, 0);
}

/* ---- streams past the hardware queues (see HARDWARE QUEUES) ----------------------------------------------- */

typedef struct log_seen {
    int calls;
    avgpipe_log_level level;
    char msg[1024];
} log_seen;
static void capture_log(avgpipe_log_level level, const char *msg, void *user) {
    log_seen *l = (log_seen *)user;
    l->calls++;
    l->level = level;
    snprintf(l->msg, sizeof l->msg, "%s", msg);
}

Test(cuda_device, max_connections_from_the_environment) {
    cr_assert_eq(avgpipe__cuda_connections(NULL), 8, "unset: CUDA's default");
    cr_assert_eq(avgpipe__cuda_connections(""), 8);
    cr_assert_eq(avgpipe__cuda_connections("1"), 1);
    cr_assert_eq(avgpipe__cuda_connections("16"), 16);
    cr_assert_eq(avgpipe__cuda_connections("32"), 32);
    cr_assert_eq(avgpipe__cuda_connections("32\n"), 32);
    cr_assert_eq(avgpipe__cuda_connections("64"), 32, "the hardware's most");
    cr_assert_eq(avgpipe__cuda_connections("0"), 8);
    cr_assert_eq(avgpipe__cuda_connections("-4"), 8);
    cr_assert_eq(avgpipe__cuda_connections("many"), 8);
    cr_assert_eq(avgpipe__cuda_connections("12x"), 8);
}

/* The streams stream_create tracks (avgpipe__cuda_track, what it calls once CUDA made the stream): the
   one that passes the limit warns, once per table, naming the count, the limit and what to set; a logger
   that does not take warnings is not called; 20 streams (4 stages x N = 4: 4 x (4 + 1)) under the most
   connections warn with the other advice. */
static void track_streams(int limit, avgpipe_log_level level, int n, log_seen *seen) {
    static char fake[64];
    avgpipe__cuda st;
    avgpipe_context ctx;
    counter c;
    int i;
    counting_ctx(&ctx, &c);
    memset(seen, 0, sizeof *seen);
    emu_gpu(&st, 256, 0);
    st.allocator = avgpipe_context_query(&ctx).allocator;
    st.info.max_connections = limit;
    st.log = capture_log, st.log_user = seen, st.log_level = level;
    cr_assert_eq(pthread_mutex_init(&st.mu, NULL), 0);
    for (i = 0; i < n; i++) {
        cr_assert_eq(avgpipe__cuda_track(&st, (cudaStream_t)(void *)(fake + i), 1), 0);
        if (i + 1 <= limit) cr_assert_eq(seen->calls, 0, "%d streams, limit %d: warned", i + 1, limit);
    }
    cr_assert_eq(st.nstreams, n);
    for (i = 0; i < n; i++) cr_assert_eq(avgpipe__cuda_track(&st, (cudaStream_t)(void *)(fake + i), 0), 0);
    cr_assert_eq(st.nstreams, 0);
    cr_assert_eq(avgpipe__cuda_track(&st, (cudaStream_t)(void *)fake, 0), -1, "not tracked");
    for (i = 0; i < n; i++) cr_assert_eq(avgpipe__cuda_track(&st, (cudaStream_t)(void *)(fake + i), 1), 0); /* again: no second warning */
    pthread_mutex_destroy(&st.mu);
    st.allocator.free(st.streams, st.allocator.user);
    cr_assert_eq(c.live, 0);
}
Test(cuda_device, streams_past_the_hardware_queues_warn_once) {
    log_seen seen;
    track_streams(8, AVGPIPE_LOG_WARN, 20, &seen);
    cr_assert_eq(seen.calls, 1, "warned %d times", seen.calls);
    cr_assert_eq(seen.level, AVGPIPE_LOG_WARN);
    cr_assert(has(seen.msg, "cuda:0: 9 streams") && has(seen.msg, "8 hardware work queues") &&
                  has(seen.msg, "CUDA_DEVICE_MAX_CONNECTIONS=32") && has(seen.msg, "before the program starts"),
              "%s", seen.msg);
    track_streams(8, AVGPIPE_LOG_WARN, 8, &seen);
    cr_assert_eq(seen.calls, 0, "8 streams fit 8 queues: %s", seen.msg);
    track_streams(8, AVGPIPE_LOG_ERROR, 20, &seen);
    cr_assert_eq(seen.calls, 0, "a logger of errors only: not called");
    track_streams(32, AVGPIPE_LOG_DEBUG, 40, &seen);
    cr_assert_eq(seen.calls, 1);
    cr_assert(has(seen.msg, "33 streams") && has(seen.msg, "32 hardware work queues") && has(seen.msg, "fewer pipelines"), "%s",
              seen.msg);
    track_streams(32, AVGPIPE_LOG_WARN, 20, &seen);
    cr_assert_eq(seen.calls, 0, "20 streams (4 stages x N = 4) fit CUDA_DEVICE_MAX_CONNECTIONS=32");
}
