/* GPU check of avgpipe_cuda.h (bench/gpu/run.sh runs it where there is an NVIDIA GPU):
     - every entry of the CUDA device table: memory, copies of every kind, memset, streams, events (record,
       wait, synchronize, query, elapsed: events without timing, timed by their twins from the first record
       after event_elapsed asked; desc.timed_events), synchronize, error texts;
     - the grids: each kernel's grid is multiprocessors x its occupancy (printed);
     - a profiled run (avgpipe_run, profile = 1) over the table: its second iteration's ops are timed by
       the device (a forward whose host function spins 3 ms lasts >= 3 ms although its call returns at once);
     - more streams than CUDA_DEVICE_MAX_CONNECTIONS: one warning through the context's logger;
     - flag_nonfinite (bits ORed, the first call's tag) and ea_pass's skip word, chained on one stream;
     - ea_pass, find_nonfinite and scale against the CPU device, bit for bit, on random data (denormals and
       signed zeros included) and on edge values, of awkward sizes (1, 3, 4097, 2^20 + 3, ...) at aligned and
       misaligned offsets, for every kind of pass;
     - the averaging module (avgpipe_ea) over the GPU against the same module over the CPU: the reference
       models and every parallel model bit for bit after each round, the non-finite guard;
     - streams: work ordered across streams by events, several threads with their own streams at once
       (passes and scans), and the speed-up of small passes spread over streams (printed);
     - waits with a time limit: a stream held by a host function (cudaLaunchHostFunc) makes
       stream_synchronize, event_synchronize, synchronize and find_nonfinite return AVGPIPE_TIMEOUT after
       desc.timeout_s, and work again once it is let go;
     - a kernel fault: the error reaches the caller with CUDA's text (last: it ends the CUDA context);
     - with --bench: the averaging kernel's bandwidth against cudaMemcpy device-to-device (medians, spread,
       ratio; target >= 0.9), and the other kernels'; boundary-buffer transfers through the table's copy
       entry against cudaMemcpyAsync at activation sizes (4 KiB to 64 MiB).
   Exit status: 0 all checks passed, 1 a check failed, 77 no CUDA device (skipped: meson's "skip").
   It is built as C by cc (kernels from NVRTC) and as CUDA by nvcc (cuda_device_check.cu: kernels compiled in).
   Usage: cuda_device_check [--device N] [--bench] [--no-fault] */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_cuda.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "tests/rng.h"

static int failures, checks;
#define CHECK(cond, ...)                                          \
    do {                                                          \
        checks++;                                                 \
        if (!(cond)) {                                            \
            failures++;                                           \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);           \
            printf(__VA_ARGS__);                                  \
            printf("\n");                                         \
            fflush(stdout);                                       \
        }                                                         \
    } while (0)
#define OK(call) CHECK((call) == AVGPIPE_OK, "%s: %s", #call, gpu.error_string(gpu.user))

static avgpipe_device gpu, cpu;

/* ---- helpers --------------------------------------------------------------------------------- */

static double now(void) {
    struct timespec t;
    timespec_get(&t, TIME_UTC); /* C11: no POSIX feature macros needed */
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
static float *hbuf(size_t n) {
    float *p = (float *)calloc(n + 16, sizeof(float));
    if (!p) {
        printf("out of host memory\n");
        exit(1);
    }
    return p;
}
static float *dbuf(size_t n) {
    void *p = NULL;
    if (gpu.alloc(gpu.user, (n + 16) * sizeof(float), &p) != AVGPIPE_OK) {
        printf("FAIL: device alloc of %zu floats: %s\n", n, gpu.error_string(gpu.user));
        exit(1);
    }
    return (float *)p;
}
static void up(float *d, const float *h, size_t n) {
    OK(gpu.copy(gpu.user, d, h, n * sizeof(float), AVGPIPE_DEVICE_COPY_H2D, NULL));
}
static void down(float *h, const float *d, size_t n) {
    OK(gpu.copy(gpu.user, h, d, n * sizeof(float), AVGPIPE_DEVICE_COPY_D2H, NULL));
    OK(gpu.stream_synchronize(gpu.user, NULL));
}
static int has(const char *s, const char *part) { return s && strstr(s, part) != NULL; }
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- memory, copies, memset ------------------------------------------------------------------------- */

static void check_memory(void) {
    const size_t sizes[] = {0, 1, 3, 64, 4097 * 4, (size_t)1 << 26};
    size_t k, i;
    void *p = NULL, *q = NULL;
    unsigned char *h, *g;
    for (k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k];
        OK(gpu.alloc(gpu.user, n, &p));
        CHECK(p != NULL && (uintptr_t)p % 64 == 0, "alloc(%zu) gave %p (64-byte alignment promised)", n, p);
        if (!n) {
            gpu.free(gpu.user, p);
            continue;
        }
        OK(gpu.alloc(gpu.user, n, &q));
        h = (unsigned char *)malloc(n), g = (unsigned char *)malloc(n);
        for (i = 0; i < n; i++) h[i] = (unsigned char)(i * 131 + k);
        OK(gpu.memset(gpu.user, p, 0xab, n, NULL));
        OK(gpu.copy(gpu.user, g, p, n, AVGPIPE_DEVICE_COPY_D2H, NULL));
        OK(gpu.stream_synchronize(gpu.user, NULL));
        for (i = 0; i < n && g[i] == 0xab; i++) {
        }
        CHECK(i == n, "memset(0xab, %zu): byte %zu is %#x", n, i, i < n ? g[i] : 0);
        OK(gpu.copy(gpu.user, p, h, n, AVGPIPE_DEVICE_COPY_H2D, NULL));
        OK(gpu.copy(gpu.user, q, p, n, AVGPIPE_DEVICE_COPY_D2D, NULL));
        memset(g, 0, n);
        OK(gpu.copy(gpu.user, g, q, n, AVGPIPE_DEVICE_COPY_D2H, NULL));
        OK(gpu.stream_synchronize(gpu.user, NULL));
        CHECK(memcmp(g, h, n) == 0, "H2D, D2D, D2H round trip of %zu bytes differs", n);
        if (n > 8) { /* unaligned, odd-sized copies inside the buffers */
            OK(gpu.copy(gpu.user, (char *)q + 1, (char *)p + 3, n - 5, AVGPIPE_DEVICE_COPY_D2D, NULL));
            OK(gpu.copy(gpu.user, g, q, n, AVGPIPE_DEVICE_COPY_D2H, NULL));
            OK(gpu.stream_synchronize(gpu.user, NULL));
            CHECK(memcmp(g + 1, h + 3, n - 5) == 0 && g[0] == h[0], "offset D2D copy of %zu bytes differs", n - 5);
        }
        free(h), free(g);
        gpu.free(gpu.user, p), gpu.free(gpu.user, q);
    }
    gpu.free(gpu.user, NULL); /* harmless */
    /* too much: AVGPIPE_OUT_OF_MEMORY with CUDA's words */
    p = (void *)1;
    CHECK(gpu.alloc(gpu.user, (size_t)1 << 50, &p) == AVGPIPE_OUT_OF_MEMORY && p == NULL, "a 1 PiB alloc did not fail with OOM");
    CHECK(has(gpu.error_string(gpu.user), "alloc: cudaMalloc: ") && has(gpu.error_string(gpu.user), "cudaErrorMemoryAllocation"),
          "error text: %s", gpu.error_string(gpu.user));
    CHECK(gpu.copy(gpu.user, NULL, NULL, 4, (avgpipe_device_copy_kind)0, NULL) == AVGPIPE_BACKEND_ERROR, "copy kind 0 accepted");
    printf("memory: alloc alignment, memset, H2D/D2H/D2D copies (offsets), OOM: checked\n");
}

/* ---- the kernels against the CPU device -------------------------------------------------------------- */

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
                        out[n].alpha = alphas[a], out[n].momentum = mo ? 0.9f : 0.0f;
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
    p.scale = 1.0f / 3.0f;
    return p;
}

/* Inputs hw, hz, hzp, ha (n floats each) at float offsets off[0..3] in the device buffers; the pass on the
   GPU and on the CPU device; w and acc compared. Returns the number of differing elements. */
typedef struct ea_bufs {
    float *dw, *dz, *dzp, *da;     /* device, nmax + 16 floats each */
    float *w, *a, *gw, *ga;        /* host: CPU results, GPU results */
} ea_bufs;
static long ea_compare(ea_bufs *b, const pass_kind *k, const float *hw, const float *hz, const float *hzp, const float *ha,
                       size_t n, const int *off, avgpipe_device_stream s) {
    float *dw = b->dw + off[0], *dz = b->dz + off[1], *dzp = b->dzp + off[2], *da = b->da + off[3];
    avgpipe_ea_pass p;
    long diff = 0;
    size_t i;
    up(dw, hw, n), up(dz, hz, n), up(dzp, hzp, n), up(da, ha, n);
    OK(gpu.stream_synchronize(gpu.user, NULL));
    p = make_pass(k, dw, dz, dzp, da, n);
    OK(gpu.ea_pass(gpu.user, &p, s));
    OK(gpu.stream_synchronize(gpu.user, s));
    down(b->gw, dw, n), down(b->ga, da, n);
    memcpy(b->w, hw, n * sizeof(float)), memcpy(b->a, ha, n * sizeof(float));
    p = make_pass(k, b->w, hz, hzp, b->a, n);
    OK(cpu.ea_pass(cpu.user, &p, NULL));
    for (i = 0; i < n; i++) {
        if (same(b->w[i], b->gw[i]) && same(b->a[i], b->ga[i])) continue;
        if (!diff)
            printf("  first difference: mode %d alpha %g mu %g first %d last %d, n %zu offsets %d%d%d%d, element %zu "
                   "(w %a z %a zp %a acc %a): CPU w %a acc %a, GPU w %a acc %a\n",
                   (int)k->mode, (double)k->alpha, (double)k->momentum, k->first, k->last, n, off[0], off[1], off[2], off[3], i,
                   (double)hw[i], (double)hz[i], (double)hzp[i], (double)ha[i], (double)b->w[i], (double)b->a[i],
                   (double)b->gw[i], (double)b->ga[i]);
        diff++;
    }
    return diff;
}

static const size_t awkward[] = {1, 3, 4, 5, 63, 4097, 65537, ((size_t)1 << 20) + 3};
#define NAWK (sizeof awkward / sizeof awkward[0])
static const int offsets[][4] = {{0, 0, 0, 0}, {1, 1, 1, 1}, {3, 3, 3, 3}, {0, 1, 2, 3}, {2, 2, 2, 0}};
#define NOFF (sizeof offsets / sizeof offsets[0])

static void check_ea_pass(avgpipe_device_stream s) {
    const size_t nmax = ((size_t)1 << 20) + 3;
    ea_bufs b;
    rng r = {42};
    float *hw = hbuf(nmax), *hz = hbuf(nmax), *hzp = hbuf(nmax), *ha = hbuf(nmax);
    const float alphas[] = {0.0f, 1.0f, 0.1f};
    pass_kind kinds[64];
    int nk = pass_kinds(kinds, alphas, 3), k;
    size_t si, oi, i;
    long bad = 0, passes = 0;
    b.dw = dbuf(nmax), b.dz = dbuf(nmax), b.dzp = dbuf(nmax), b.da = dbuf(nmax);
    b.w = hbuf(nmax), b.a = hbuf(nmax), b.gw = hbuf(nmax), b.ga = hbuf(nmax);
    for (i = 0; i < nmax; i++) {
        hw[i] = rng_float(&r, -2, 2), hz[i] = rng_float(&r, -2, 2), hzp[i] = rng_float(&r, -2, 2), ha[i] = rng_float(&r, -8, 8);
        if (i % 101 == 0) hw[i] *= 1e-38f;            /* denormal results */
        if (i % 103 == 0) hz[i] = hw[i], ha[i] = -0.0f; /* exact zeros and signed zeros */
    }
    for (si = 0; si < NAWK; si++)
        for (oi = 0; oi < NOFF; oi++)
            for (k = 0; k < nk; k++) {
                if (awkward[si] > 70000 && oi > 1 && k % 3) continue; /* the largest size: fewer combinations */
                bad += ea_compare(&b, &kinds[k], hw, hz, hzp, ha, awkward[si], offsets[oi], s) != 0;
                passes++;
            }
    CHECK(bad == 0, "ea_pass: %ld of %ld passes differ from the CPU device", bad, passes);
    printf("ea_pass: %ld passes (every kind, sizes 1 .. 2^20+3, 5 offset patterns) bitwise equal to the CPU device: %s\n", passes,
           bad ? "NO" : "yes");
    { /* edge values: every (w, z, zp, acc) of 14 special values */
        static const uint32_t e[] = {0x00000000u, 0x80000000u, 0x3f800000u, 0xbf800000u, 0x7f7fffffu, 0x00800000u, 0x00000001u,
                                     0x807fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00123u, 0x3f800001u, 0x33800000u};
        const size_t ne = sizeof e / sizeof e[0], n = ne * ne * ne * ne;
        const float ealphas[] = {0.0f, 1.0f, 0.1f, from_bits(0x00000005u)};
        static const int zero[4] = {0, 0, 0, 0};
        for (i = 0; i < n; i++)
            hw[i] = from_bits(e[i % ne]), hz[i] = from_bits(e[i / ne % ne]), hzp[i] = from_bits(e[i / (ne * ne) % ne]),
            ha[i] = from_bits(e[i / (ne * ne * ne)]);
        nk = pass_kinds(kinds, ealphas, 4);
        bad = 0;
        for (k = 0; k < nk; k++) bad += ea_compare(&b, &kinds[k], hw, hz, hzp, ha, n, zero, s) != 0;
        CHECK(bad == 0, "ea_pass on edge values: %ld of %d kinds differ from the CPU device", bad, nk);
        printf("ea_pass: edge values (NaN, +-Inf, denormals, -0, FLT_MAX; alpha 0, 1, 0.1, denormal) x %d kinds: %s\n", nk,
               bad ? "DIFFER" : "bitwise equal (NaN as NaN)");
    }
    gpu.free(gpu.user, b.dw), gpu.free(gpu.user, b.dz), gpu.free(gpu.user, b.dzp), gpu.free(gpu.user, b.da);
    free(b.w), free(b.a), free(b.gw), free(b.ga), free(hw), free(hz), free(hzp), free(ha);
}

static void check_nonfinite_scale(avgpipe_device_stream s) {
    const size_t nmax = ((size_t)1 << 20) + 3;
    float *h = hbuf(nmax), *g = hbuf(nmax), *d = dbuf(nmax);
    const float badv[] = {INFINITY, -INFINITY, NAN, from_bits(0xffc00001u)};
    const float factors[] = {0.25f, 1.0f / 3.0f, -0.0f, 3.0e38f, 1e-40f};
    rng r = {7};
    size_t si, o, t, f, i, want, got;
    long bad = 0, scans = 0, sbad = 0;
    for (si = 0; si < NAWK; si++)
        for (o = 0; o < 4; o++)
            for (t = 0; t < 6; t++) {
                size_t n = awkward[si];
                for (i = 0; i < n; i++) h[i] = rng_float(&r, -1e30, 1e30);
                if (t == 1) h[0] = badv[rng_next(&r) % 4];
                if (t == 2) h[n - 1] = badv[rng_next(&r) % 4];
                if (t >= 3) h[rng_next(&r) % n] = badv[rng_next(&r) % 4];
                if (t >= 4) h[rng_next(&r) % n] = badv[rng_next(&r) % 4];
                if (t == 5) h[n / 2] = from_bits(0x7f7fffffu);
                h[n] = NAN; /* just past the end: never reported */
                up(d + o, h, n + 1);
                OK(cpu.find_nonfinite(cpu.user, h, n, &want, NULL));
                got = (size_t)-1;
                OK(gpu.find_nonfinite(gpu.user, d + o, n, &got, s));
                bad += got != want, scans++;
                if (got != want) printf("  find_nonfinite: n %zu offset %zu case %zu: GPU %zu, CPU %zu\n", n, o, t, got, want);
            }
    CHECK(bad == 0, "find_nonfinite: %ld of %ld scans differ from the CPU device", bad, scans);
    printf("find_nonfinite: %ld scans (none, first, last, one, two; 4 offsets): %s\n", scans, bad ? "DIFFER" : "equal to the CPU device");
    for (si = 0; si < NAWK; si++)
        for (o = 0; o < 4; o++)
            for (f = 0; f < sizeof factors / sizeof factors[0]; f++) {
                size_t n = awkward[si];
                for (i = 0; i < n + 1; i++) h[i] = rng_float(&r, -4, 4);
                h[0] = from_bits(0x00000003u), h[n - 1] = -0.0f;
                up(d + o, h, n + 1);
                OK(gpu.scale(gpu.user, d + o, factors[f], n, s));
                OK(gpu.stream_synchronize(gpu.user, s));
                down(g, d + o, n + 1);
                OK(cpu.scale(cpu.user, h, factors[f], n, NULL));
                for (i = 0; i < n + 1 && same(g[i], h[i]); i++) {
                }
                sbad += i < n + 1;
            }
    CHECK(sbad == 0, "scale: %ld runs differ from the CPU device (or wrote past the end)", sbad);
    printf("scale: sizes 1 .. 2^20+3, 4 offsets, 5 factors: %s\n", sbad ? "DIFFER" : "bitwise equal to the CPU device");
    gpu.free(gpu.user, d);
    free(h), free(g);
}

/* ---- the averaging module over the GPU against the same module over the CPU ------------------------------- */

/* flag_nonfinite (no host wait) and the averaging kernel's skip word, as the averaging module chains them on
   one stream: the flag zeroed, flagging calls, a pass that reads the flag as its skip word. Clean data
   leaves {0, 0}; a NaN or +-Inf (first, last, middle, a NaN and an Inf) gives {bits, tag}; a second call
   ORs its bits and keeps the first tag. A pass whose skip word is set leaves w and acc bit-identical; with
   a clear skip word (or NULL) it gives the CPU device's bits. */
static void flag_down(uint32_t *h, const uint32_t *d, avgpipe_device_stream s) {
    OK(gpu.stream_synchronize(gpu.user, s));
    OK(gpu.copy(gpu.user, h, d, 2 * sizeof(uint32_t), AVGPIPE_DEVICE_COPY_D2H, NULL));
    OK(gpu.stream_synchronize(gpu.user, NULL));
}
static void check_flag_skip(avgpipe_device_stream s) {
    const size_t nmax = ((size_t)1 << 20) + 3;
    float *h = hbuf(nmax), *d = dbuf(nmax), *hz = hbuf(nmax), *ha = hbuf(nmax), *gw = hbuf(nmax), *ga = hbuf(nmax);
    float *dw = dbuf(nmax), *dz = dbuf(nmax), *da = dbuf(nmax);
    const float badv[] = {INFINITY, -INFINITY, NAN, from_bits(0xffc00001u)};
    uint32_t *dflag = NULL, hf[2];
    rng r = {99};
    size_t si, o, t, i, want;
    long fbad = 0, calls = 0, sbad = 0, passes = 0;
    OK(gpu.alloc(gpu.user, 2 * sizeof(uint32_t), (void **)&dflag));
    if (!gpu.flag_nonfinite || !dflag) {
        CHECK(0, "flag_nonfinite: entry %s, flag %p", gpu.flag_nonfinite ? "set" : "NULL", (void *)dflag);
        return;
    }
    for (si = 0; si < NAWK; si++)
        for (o = 0; o < 4; o++)
            for (t = 0; t < 5; t++) {
                size_t n = awkward[si];
                const uint32_t tag = 0x1000u + (uint32_t)(si * 20 + o * 5 + t);
                int dirty;
                for (i = 0; i < n; i++) h[i] = rng_float(&r, -1e30, 1e30);
                if (t == 1) h[0] = badv[rng_next(&r) % 4];
                if (t == 2) h[n - 1] = badv[rng_next(&r) % 4];
                if (t == 3) h[n / 2] = badv[rng_next(&r) % 4];
                if (t == 4) h[rng_next(&r) % n] = NAN, h[rng_next(&r) % n] = INFINITY;
                h[n] = NAN; /* just past the end: never seen */
                up(d + o, h, n + 1);
                OK(gpu.stream_synchronize(gpu.user, NULL));
                OK(cpu.find_nonfinite(cpu.user, h, n, &want, NULL));
                dirty = want < n;
                OK(gpu.memset(gpu.user, dflag, 0, 2 * sizeof(uint32_t), s));
                OK(gpu.flag_nonfinite(gpu.user, d + o, n, dflag, 1u << 3, tag, s));
                flag_down(hf, dflag, s);
                calls++;
                if (dirty ? !(hf[0] == 1u << 3 && hf[1] == tag) : !(hf[0] == 0 && hf[1] == 0)) {
                    fbad++;
                    printf("  flag_nonfinite: n %zu offset %zu case %zu: flag {%#x, %#x}, want {%#x, %#x}\n", n, o, t, hf[0], hf[1],
                           dirty ? 1u << 3 : 0u, dirty ? tag : 0u);
                }
                OK(gpu.flag_nonfinite(gpu.user, d + o, n, dflag, 1u << 30, 0xdeadu, s)); /* a second call: OR, first tag */
                flag_down(hf, dflag, s);
                if (dirty ? !(hf[0] == ((1u << 3) | (1u << 30)) && hf[1] == tag) : !(hf[0] == 0 && hf[1] == 0)) {
                    fbad++;
                    printf("  flag_nonfinite (second call): n %zu offset %zu case %zu: flag {%#x, %#x}\n", n, o, t, hf[0], hf[1]);
                }
            }
    CHECK(fbad == 0, "flag_nonfinite: %ld of %ld flag checks wrong", fbad, calls);
    printf("flag_nonfinite: %ld checks (clean, first, last, middle, NaN and Inf; 4 offsets; a second call): %s\n", calls,
           fbad ? "WRONG" : "bits ORed, first tag kept");
    for (si = 0; si < NAWK; si++)
        for (o = 0; o < 2; o++)
            for (t = 0; t < 3; t++) { /* 0: skip word set by a flagging call; 1: flag clear; 2: skip NULL */
                size_t n = awkward[si];
                pass_kind k;
                avgpipe_ea_pass p;
                size_t j;
                k.mode = si % 2 ? AVGPIPE_EA_ELASTIC : AVGPIPE_EA_MEAN, k.alpha = 0.1f, k.momentum = 0.0f, k.first = 0, k.last = 1;
                for (i = 0; i < n; i++) h[i] = rng_float(&r, -2, 2), hz[i] = rng_float(&r, -2, 2), ha[i] = rng_float(&r, -8, 8);
                up(dw + o, h, n), up(dz + o, hz, n), up(da + o, ha, n);
                memcpy(gw, h, n * sizeof(float)); /* the flagged data: w with a NaN in the middle */
                if (t == 0) gw[n / 2] = NAN;
                up(d, gw, n);
                OK(gpu.stream_synchronize(gpu.user, NULL));
                OK(gpu.memset(gpu.user, dflag, 0, 2 * sizeof(uint32_t), s));
                OK(gpu.flag_nonfinite(gpu.user, d, n, dflag, 1u, 7u, s));
                p = make_pass(&k, dw + o, dz + o, NULL, da + o, n);
                p.skip = t == 2 ? NULL : dflag;
                OK(gpu.ea_pass(gpu.user, &p, s));
                OK(gpu.stream_synchronize(gpu.user, s));
                down(gw, dw + o, n), down(ga, da + o, n);
                passes++;
                if (t == 0) {
                    for (j = 0; j < n && same(gw[j], h[j]) && same(ga[j], ha[j]); j++) {
                    }
                } else {
                    p = make_pass(&k, h, hz, NULL, ha, n);
                    OK(cpu.ea_pass(cpu.user, &p, NULL));
                    for (j = 0; j < n && same(gw[j], h[j]) && same(ga[j], ha[j]); j++) {
                    }
                }
                if (j < n) {
                    sbad++;
                    printf("  ea_pass skip: n %zu offset %zu case %zu: element %zu differs (GPU w %a acc %a, want w %a acc %a)\n", n,
                           o, t, j, (double)gw[j], (double)ga[j], (double)h[j], (double)ha[j]);
                }
            }
    CHECK(sbad == 0, "ea_pass with skip: %ld of %ld passes wrong", sbad, passes);
    printf("ea_pass skip: %ld passes (skip set on the device: untouched; clear or NULL: the CPU device's bits): %s\n", passes,
           sbad ? "WRONG" : "ok");
    gpu.free(gpu.user, dflag);
    gpu.free(gpu.user, d), gpu.free(gpu.user, dw), gpu.free(gpu.user, dz), gpu.free(gpu.user, da);
    free(h), free(hz), free(ha), free(gw), free(ga);
}

static void check_ea_module(avgpipe_ea_mode mode, float momentum) {
    const size_t P = ((size_t)1 << 20) + 3;
    const int N = 3, rounds = 4;
    avgpipe_context ctx;
    avgpipe_ea_desc desc;
    avgpipe_ea *eg = NULL, *ec = NULL;
    float *hw[3], *dw[3], *init = hbuf(P), *dinit = dbuf(P), *zc = hbuf(P), *zg = hbuf(P), *tmp = hbuf(P);
    avgpipe_device_stream st[3];
    rng r = {1000 + (uint64_t)mode};
    int i, t, diffs = 0;
    size_t j;
    avgpipe_result rg, rc;
    avgpipe_context_init(&ctx, NULL);
    for (j = 0; j < P; j++) init[j] = rng_float(&r, -1, 1);
    up(dinit, init, P);
    OK(gpu.stream_synchronize(gpu.user, NULL));
    for (i = 0; i < N; i++) {
        hw[i] = hbuf(P), dw[i] = dbuf(P);
        memcpy(hw[i], init, P * sizeof(float));
        OK(gpu.stream_create(gpu.user, &st[i]));
    }
    memset(&desc, 0, sizeof desc);
    desc.count = P, desc.pipes = N, desc.mode = mode, desc.alpha = 0.1f, desc.momentum = momentum;
    desc.initial = dinit, desc.device = &gpu;
    CHECK(avgpipe_ea_create(&ctx, &desc, &eg) == AVGPIPE_OK, "avgpipe_ea_create on the GPU: %s", avgpipe_last_error(&ctx));
    desc.initial = init, desc.device = &cpu;
    CHECK(avgpipe_ea_create(&ctx, &desc, &ec) == AVGPIPE_OK, "avgpipe_ea_create on the CPU: %s", avgpipe_last_error(&ctx));
    if (!eg || !ec) return;
    for (t = 0; t < rounds; t++) {
        for (i = 0; i < N; i++) { /* a "local step": the same update on both sides, then the same bits uploaded */
            for (j = 0; j < P; j++) hw[i][j] = hw[i][j] + rng_float(&r, -0.01, 0.01);
            up(dw[i], hw[i], P);
        }
        OK(gpu.stream_synchronize(gpu.user, NULL));
        for (i = 0; i < N; i++) {
            int pipe = (i + t) % N; /* a different contribution order each round */
            rg = avgpipe_ea_contribute(&ctx, eg, pipe, (uint64_t)t, dw[pipe], st[pipe]);
            rc = avgpipe_ea_contribute(&ctx, ec, pipe, (uint64_t)t, hw[pipe], NULL);
            CHECK(rg == AVGPIPE_OK && rc == AVGPIPE_OK, "round %d pipe %d: %d %d %s", t, pipe, (int)rg, (int)rc, avgpipe_last_error(&ctx));
        }
        CHECK(avgpipe_ea_wait(&ctx, eg, (uint64_t)t, 10000) == AVGPIPE_OK, "wait: %s", avgpipe_last_error(&ctx));
        OK(avgpipe_ea_copy_reference(&ctx, eg, zg, AVGPIPE_DEVICE_COPY_D2H, NULL, NULL));
        OK(gpu.synchronize(gpu.user));
        OK(avgpipe_ea_copy_reference(&ctx, ec, zc, AVGPIPE_DEVICE_COPY_D2H, NULL, NULL));
        for (j = 0; j < P && bits(zg[j]) == bits(zc[j]); j++) {
        }
        if (j < P) diffs++, printf("  round %d: reference differs at %zu: GPU %a CPU %a\n", t, j, (double)zg[j], (double)zc[j]);
        for (i = 0; i < N; i++) {
            down(tmp, dw[i], P);
            for (j = 0; j < P && bits(tmp[j]) == bits(hw[i][j]); j++) {
            }
            if (j < P) diffs++, printf("  round %d: model %d differs at %zu\n", t, i, j);
        }
    }
    CHECK(diffs == 0, "averaging module over the GPU differs from the CPU one (%d)", diffs);
    /* the non-finite guard runs on the GPU too: refused, nothing changed */
    tmp[0] = 1.0f, tmp[1] = NAN;
    up(dw[0] + 12345, tmp, 2);
    OK(gpu.stream_synchronize(gpu.user, NULL));
    rg = avgpipe_ea_contribute(&ctx, eg, 0, (uint64_t)rounds, dw[0], st[0]);
    CHECK(rg == AVGPIPE_NON_FINITE && has(avgpipe_last_error(&ctx), "12346"), "a NaN at 12346: %d %s", (int)rg, avgpipe_last_error(&ctx));
    printf("averaging module (%s%s, N = %d, P = 2^20+3, %d rounds, varying order) on the GPU: references and models %s; "
           "non-finite guard: %s\n",
           mode == AVGPIPE_EA_MEAN ? "MEAN" : "ELASTIC", momentum != 0.0f ? " + momentum" : "", N, rounds,
           diffs ? "DIFFER" : "bitwise equal to the CPU module", rg == AVGPIPE_NON_FINITE ? "refused" : "NOT refused");
    avgpipe_ea_destroy(eg), avgpipe_ea_destroy(ec);
    for (i = 0; i < N; i++) free(hw[i]), gpu.free(gpu.user, dw[i]), gpu.stream_destroy(gpu.user, st[i]);
    gpu.free(gpu.user, dinit);
    free(init), free(zc), free(zg), free(tmp);
}

/* ---- streams and events ----------------------------------------------------------------------------------- */

static void check_streams_events(void) {
    const size_t P = (size_t)1 << 24;
    avgpipe_device_stream s1, s2;
    avgpipe_device_event a, b, never;
    float *w = dbuf(P), *z = dbuf(P), *acc = dbuf(P), *copy = dbuf(P), *h = hbuf(P), *g = hbuf(P);
    avgpipe_ea_pass p;
    pass_kind k;
    double secs = -1;
    int done = -1, q_after_record, k_iter;
    size_t i;
    OK(gpu.stream_create(gpu.user, &s1));
    OK(gpu.stream_create(gpu.user, &s2));
    CHECK(s1 != NULL && s2 != NULL && s1 != s2, "streams");
    OK(gpu.event_create(gpu.user, &a));
    OK(gpu.event_create(gpu.user, &b));
    OK(gpu.event_create(gpu.user, &never));
    OK(gpu.event_query(gpu.user, never, &done));
    CHECK(done == 1, "a never-recorded event is done");
    for (i = 0; i < P; i++) h[i] = (float)(i % 1000) * 0.001f;
    up(w, h, P), up(z, h, P);
    OK(gpu.memset(gpu.user, acc, 0, P * sizeof(float), NULL));
    OK(gpu.synchronize(gpu.user));
    /* long work on s1 (40 passes over 3 x 64 MiB), then an event; s2 waits for it and copies the result */
    memset(&k, 0, sizeof k);
    k.mode = AVGPIPE_EA_MEAN, k.alpha = 0.0f, k.first = 0, k.last = 0; /* acc += w, 40 times */
    p = make_pass(&k, w, z, NULL, acc, P);
    OK(gpu.event_record(gpu.user, a, s1));
    for (k_iter = 0; k_iter < 40; k_iter++) OK(gpu.ea_pass(gpu.user, &p, s1));
    OK(gpu.event_record(gpu.user, b, s1));
    OK(gpu.event_query(gpu.user, b, &done));
    q_after_record = done;
    OK(gpu.stream_wait_event(gpu.user, s2, b));
    OK(gpu.copy(gpu.user, copy, acc, P * sizeof(float), AVGPIPE_DEVICE_COPY_D2D, s2));
    OK(gpu.stream_synchronize(gpu.user, s2));
    down(g, copy, P);
    for (i = 0; i < P; i++) {
        float want = 0.0f;
        for (k_iter = 0; k_iter < 40; k_iter++) want = want + h[i];
        if (bits(g[i]) != bits(want)) break;
    }
    CHECK(i == P, "s2's copy waited for s1's passes: element %zu is %g", i, i < P ? (double)g[i] : 0.0);
    OK(gpu.event_synchronize(gpu.user, b));
    OK(gpu.event_query(gpu.user, b, &done));
    CHECK(done == 1, "event done after event_synchronize");
    /* events without timing (the default): the first event_elapsed makes their timed twins and fails */
    CHECK(gpu.event_elapsed(gpu.user, a, b, &secs) == AVGPIPE_BACKEND_ERROR && has(gpu.error_string(gpu.user), "had no timing yet"),
          "elapsed of events recorded before they were timed: %s", gpu.error_string(gpu.user));
    OK(gpu.event_record(gpu.user, a, s1)); /* from now on they are timed */
    for (k_iter = 0; k_iter < 40; k_iter++) OK(gpu.ea_pass(gpu.user, &p, s1));
    OK(gpu.event_record(gpu.user, b, s1));
    OK(gpu.event_synchronize(gpu.user, b));
    OK(gpu.event_elapsed(gpu.user, a, b, &secs));
    CHECK(secs > 0 && secs < 10, "elapsed %g s", secs);
    printf("streams/events: cross-stream wait ordered the copy; query right after recording 40 passes: done = %d; elapsed %.3f ms "
           "(%.0f GB/s)\n",
           q_after_record, secs * 1e3, 40.0 * 3 * 4 * (double)P / secs / 1e9);
    /* elapsed between an event and one never recorded: first its twin is made, then CUDA's error */
    CHECK(gpu.event_elapsed(gpu.user, a, never, &secs) == AVGPIPE_BACKEND_ERROR && has(gpu.error_string(gpu.user), "had no timing yet"),
          "elapsed to a never-recorded event: %s", gpu.error_string(gpu.user));
    CHECK(gpu.event_elapsed(gpu.user, a, never, &secs) == AVGPIPE_BACKEND_ERROR &&
              has(gpu.error_string(gpu.user), "event_elapsed: cudaEventElapsedTime"),
          "elapsed to a never-recorded event: %s", gpu.error_string(gpu.user));
    OK(gpu.synchronize(gpu.user));
    gpu.event_destroy(gpu.user, a), gpu.event_destroy(gpu.user, b), gpu.event_destroy(gpu.user, never);
    gpu.stream_destroy(gpu.user, s1), gpu.stream_destroy(gpu.user, s2);
    gpu.free(gpu.user, w), gpu.free(gpu.user, z), gpu.free(gpu.user, acc), gpu.free(gpu.user, copy);
    free(h), free(g);
}

/* Several threads, each with its own stream, passes and scans at once: every answer right. */
typedef struct worker {
    int id, iters, errors;
} worker;
static void *worker_main(void *arg) {
    worker *wk = (worker *)arg;
    const size_t n = 100003;
    avgpipe_device_stream s;
    float *d = dbuf(n), *h = hbuf(n), *g = hbuf(n), *a = dbuf(n);
    size_t idx, want, i;
    int it;
    avgpipe_ea_pass p;
    if (gpu.stream_create(gpu.user, &s) != AVGPIPE_OK) {
        wk->errors++;
        return NULL;
    }
    for (it = 0; it < wk->iters; it++) {
        for (i = 0; i < n; i++) h[i] = (float)(i + (size_t)wk->id);
        want = (size_t)(wk->id * 977 + it * 131) % n;
        h[want] = NAN;
        wk->errors += gpu.copy(gpu.user, d, h, n * sizeof(float), AVGPIPE_DEVICE_COPY_H2D, s) != AVGPIPE_OK;
        wk->errors += gpu.find_nonfinite(gpu.user, d, n, &idx, s) != AVGPIPE_OK || idx != want;
        h[want] = 0.0f;
        wk->errors += gpu.copy(gpu.user, d, h, n * sizeof(float), AVGPIPE_DEVICE_COPY_H2D, s) != AVGPIPE_OK;
        memset(&p, 0, sizeof p);
        p.w = d, p.acc = a, p.count = n, p.mode = AVGPIPE_EA_MEAN, p.first = 1, p.last = 1, p.scale = 2.0f;
        wk->errors += gpu.ea_pass(gpu.user, &p, s) != AVGPIPE_OK;
        wk->errors += gpu.copy(gpu.user, g, a, n * sizeof(float), AVGPIPE_DEVICE_COPY_D2H, s) != AVGPIPE_OK;
        wk->errors += gpu.stream_synchronize(gpu.user, s) != AVGPIPE_OK;
        for (i = 0; i < n && g[i] == h[i] * 2.0f; i++) {
        }
        wk->errors += i < n;
    }
    gpu.stream_destroy(gpu.user, s);
    gpu.free(gpu.user, d), gpu.free(gpu.user, a);
    free(h), free(g);
    return NULL;
}
static void check_threads(void) {
    enum { T = 8 };
    pthread_t tid[T];
    worker wk[T];
    int i, errors = 0;
    for (i = 0; i < T; i++) {
        wk[i].id = i, wk[i].iters = 50, wk[i].errors = 0;
        pthread_create(&tid[i], NULL, worker_main, &wk[i]);
    }
    for (i = 0; i < T; i++) pthread_join(tid[i], NULL), errors += wk[i].errors;
    CHECK(errors == 0, "threads: %d wrong answers or failures", errors);
    printf("threads: %d threads x 50 (scan + pass) on their own streams at once: %s\n", T, errors ? "WRONG" : "all right");
}

/* Small passes (that one alone does not fill the GPU) on one stream, then spread over 4: the speed-up is
   what N parallel pipelines get on one GPU. Printed, not asserted. */
static void check_stream_concurrency(void) {
    enum { S = 4, K = 200 };
    const size_t n = 1 << 14;
    avgpipe_device_stream st[S];
    avgpipe_device_event e0, e1;
    float *w[S], *z[S], *acc[S];
    avgpipe_ea_pass p;
    double one = 0, many = 0, t0;
    int i, k, rep;
    OK(gpu.event_create(gpu.user, &e0));
    OK(gpu.event_create(gpu.user, &e1));
    for (i = 0; i < S; i++) {
        OK(gpu.stream_create(gpu.user, &st[i]));
        w[i] = dbuf(n), z[i] = dbuf(n), acc[i] = dbuf(n);
        OK(gpu.memset(gpu.user, w[i], 0, n * 4, NULL));
        OK(gpu.memset(gpu.user, z[i], 0, n * 4, NULL));
        OK(gpu.memset(gpu.user, acc[i], 0, n * 4, NULL));
    }
    OK(gpu.synchronize(gpu.user));
    memset(&p, 0, sizeof p);
    p.count = n, p.mode = AVGPIPE_EA_MEAN, p.alpha = 0.1f;
    for (rep = 0; rep < 3; rep++) { /* the last repetition counts (the first ones warm up) */
        t0 = now();
        for (k = 0; k < K; k++)
            for (i = 0; i < S; i++) {
                p.w = w[i], p.z = z[i], p.acc = acc[i];
                OK(gpu.ea_pass(gpu.user, &p, st[0]));
            }
        OK(gpu.stream_synchronize(gpu.user, st[0]));
        one = now() - t0;
        t0 = now();
        for (k = 0; k < K; k++)
            for (i = 0; i < S; i++) {
                p.w = w[i], p.z = z[i], p.acc = acc[i];
                OK(gpu.ea_pass(gpu.user, &p, st[i]));
            }
        OK(gpu.synchronize(gpu.user));
        many = now() - t0;
    }
    printf("stream concurrency: %d x %d passes of %zu floats: one stream %.2f ms, %d streams %.2f ms (speed-up %.2f)\n", K, S, n,
           one * 1e3, S, many * 1e3, one / many);
    for (i = 0; i < S; i++) {
        gpu.stream_destroy(gpu.user, st[i]);
        gpu.free(gpu.user, w[i]), gpu.free(gpu.user, z[i]), gpu.free(gpu.user, acc[i]);
    }
    gpu.event_destroy(gpu.user, e0), gpu.event_destroy(gpu.user, e1);
}

/* ---- a second device on the same GPU: no timing, blocking sync, another launch shape -------------------------- */

static void check_variants(int ordinal) {
    avgpipe_context ctx;
    avgpipe_device d2;
    avgpipe_device_cuda_desc cd;
    avgpipe_device_cuda_info info;
    avgpipe_device_event ev;
    avgpipe_result r;
    avgpipe_context_init(&ctx, NULL);
    memset(&cd, 0, sizeof cd);
    cd.device = ordinal, cd.no_timing = 1, cd.blocking_sync = 1, cd.block_size = 1024, cd.max_blocks = 3;
    r = avgpipe_device_cuda_create(&ctx, &cd, &d2);
    CHECK(r == AVGPIPE_OK, "create (no timing, blocking sync, 1024 x 3): %s", avgpipe_last_error(&ctx));
    if (r != AVGPIPE_OK) return;
    CHECK(d2.event_elapsed == NULL, "no timing: no event_elapsed");
    CHECK(avgpipe_device_check(&ctx, &d2) == AVGPIPE_OK, "table complete");
    CHECK(avgpipe_device_cuda_query(&ctx, &d2, &info) == AVGPIPE_OK && info.desc.max_blocks == 3 && info.desc.block_size == 1024,
          "query");
    CHECK(d2.event_create(d2.user, &ev) == AVGPIPE_OK && d2.event_record(d2.user, ev, NULL) == AVGPIPE_OK &&
              d2.event_synchronize(d2.user, ev) == AVGPIPE_OK,
          "blocking-sync event");
    d2.event_destroy(d2.user, ev);
    CHECK(info.grid[AVGPIPE_DEVICE_CUDA_KERNEL_EA] == 3 && info.grid[AVGPIPE_DEVICE_CUDA_KERNEL_SCALE] == 3, "desc.max_blocks 3: grids %d %d %d",
          info.grid[0], info.grid[1], info.grid[2]);
    {   /* a pass with a tiny grid (3 blocks of 1024: every thread loops) against the CPU device */
        const size_t n = ((size_t)1 << 20) + 3;
        float *h = hbuf(n), *ha = hbuf(n), *c = hbuf(n), *ca = hbuf(n), *g = hbuf(n), *dw = NULL, *da = NULL;
        avgpipe_ea_pass p;
        size_t i;
        CHECK(d2.alloc(d2.user, n * 4, (void **)&dw) == AVGPIPE_OK && d2.alloc(d2.user, n * 4, (void **)&da) == AVGPIPE_OK, "alloc");
        for (i = 0; i < n; i++) h[i] = (float)i * 0.5f, ha[i] = 1.0f / (float)(i + 1);
        memcpy(c, h, n * 4), memcpy(ca, ha, n * 4);
        d2.copy(d2.user, dw, h, n * 4, AVGPIPE_DEVICE_COPY_H2D, NULL);
        d2.copy(d2.user, da, ha, n * 4, AVGPIPE_DEVICE_COPY_H2D, NULL);
        memset(&p, 0, sizeof p);
        p.w = dw, p.acc = da, p.count = n, p.mode = AVGPIPE_EA_MEAN; /* no pull: acc += w */
        CHECK(d2.ea_pass(d2.user, &p, NULL) == AVGPIPE_OK, "ea_pass");
        d2.copy(d2.user, g, da, n * 4, AVGPIPE_DEVICE_COPY_D2H, NULL);
        d2.synchronize(d2.user);
        p.w = c, p.acc = ca;
        cpu.ea_pass(cpu.user, &p, NULL);
        for (i = 0; i < n && bits(g[i]) == bits(ca[i]); i++) {
        }
        CHECK(i == n, "tiny-grid pass differs at %zu", i);
        d2.free(d2.user, dw), d2.free(d2.user, da);
        free(h), free(ha), free(c), free(ca), free(g);
    }
    avgpipe_device_destroy(&d2);
    {   /* desc.timed_events: every event timed from its first record */
        avgpipe_device_event e0 = NULL, e1 = NULL;
        double secs = -1;
        memset(&cd, 0, sizeof cd);
        cd.device = ordinal, cd.timed_events = 1;
        r = avgpipe_device_cuda_create(&ctx, &cd, &d2);
        CHECK(r == AVGPIPE_OK, "create (timed events): %s", avgpipe_last_error(&ctx));
        if (r == AVGPIPE_OK) {
            CHECK(d2.event_elapsed != NULL, "timed events: event_elapsed");
            CHECK(d2.event_create(d2.user, &e0) == AVGPIPE_OK && d2.event_create(d2.user, &e1) == AVGPIPE_OK &&
                      d2.event_record(d2.user, e0, NULL) == AVGPIPE_OK && d2.event_record(d2.user, e1, NULL) == AVGPIPE_OK &&
                      d2.event_synchronize(d2.user, e1) == AVGPIPE_OK && d2.event_elapsed(d2.user, e0, e1, &secs) == AVGPIPE_OK &&
                      secs >= 0 && secs < 1,
                  "timed events: elapsed of their first records: %g s, %s", secs, d2.error_string(d2.user));
            d2.event_destroy(d2.user, e0), d2.event_destroy(d2.user, e1);
            avgpipe_device_destroy(&d2);
        }
        cd.no_timing = 1;
        r = avgpipe_device_cuda_create(&ctx, &cd, &d2);
        CHECK(r == AVGPIPE_INVALID_ARG && has(avgpipe_last_error(&ctx), "desc.no_timing and desc.timed_events"), "both: %d %s", (int)r,
              avgpipe_last_error(&ctx));
    }
    /* an ordinal past the last device */
    memset(&cd, 0, sizeof cd);
    cd.device = 4096;
    r = avgpipe_device_cuda_create(&ctx, &cd, &d2);
    CHECK(r == AVGPIPE_BACKEND_ERROR && has(avgpipe_last_error(&ctx), "no such device"), "cuda:4096: %d %s", (int)r,
          avgpipe_last_error(&ctx));
    printf("variants: no-timing/blocking-sync device, a 3 x 1024 grid, timed events, a missing ordinal: checked\n");
}

/* ---- more streams than hardware queues: one warning through the logger ---------------------------------------- */

typedef struct log_seen {
    int calls;
    char msg[1024];
} log_seen;
static void capture_log(avgpipe_log_level level, const char *msg, void *user) {
    log_seen *l = (log_seen *)user;
    if (level != AVGPIPE_LOG_WARN) return;
    l->calls++;
    snprintf(l->msg, sizeof l->msg, "%s", msg);
}
static void check_queues_warning(int ordinal) {
    avgpipe_context ctx;
    avgpipe_context_desc cdesc;
    avgpipe_device d4;
    avgpipe_device_cuda_desc cd;
    avgpipe_device_cuda_info info;
    avgpipe_device_stream st[40];
    log_seen seen;
    int i, n, made = 0;
    memset(&cdesc, 0, sizeof cdesc);
    memset(&seen, 0, sizeof seen);
    cdesc.log = capture_log, cdesc.log_user = &seen;
    avgpipe_context_init(&ctx, &cdesc);
    memset(&cd, 0, sizeof cd);
    cd.device = ordinal;
    if (avgpipe_device_cuda_create(&ctx, &cd, &d4) != AVGPIPE_OK) {
        CHECK(0, "create: %s", avgpipe_last_error(&ctx));
        return;
    }
    avgpipe_device_cuda_query(&ctx, &d4, &info);
    n = info.max_connections + 2;
    for (i = 0; i < n; i++) {
        if (d4.stream_create(d4.user, &st[i]) != AVGPIPE_OK) break;
        made++;
        if (i + 1 <= info.max_connections) CHECK(seen.calls == 0, "warned at %d streams (limit %d)", i + 1, info.max_connections);
    }
    CHECK(made == n, "%d streams: %s", n, d4.error_string(d4.user));
    CHECK(seen.calls == 1 && has(seen.msg, "CUDA_DEVICE_MAX_CONNECTIONS"), "%d streams over %d queues: %d warnings: %s", made,
          info.max_connections, seen.calls, seen.msg);
    printf("hardware queues: %d streams, CUDA_DEVICE_MAX_CONNECTIONS gives %d: warned once: \"%s\"\n", made, info.max_connections, seen.msg);
    for (i = 0; i < made; i++) d4.stream_destroy(d4.user, st[i]);
    avgpipe_device_destroy(&d4);
}

/* ---- a profiled run: device times from its second iteration (avgpipe_cuda.h, TIMING) -------------------------- */

static pthread_mutex_t prof_mu = PTHREAD_MUTEX_INITIALIZER;
static avgpipe_result (*real_elapsed)(void *, avgpipe_device_event, avgpipe_device_event, double *);
static int elapsed_ok, elapsed_failed;
static avgpipe_result counting_elapsed(void *user, avgpipe_device_event a, avgpipe_device_event b, double *secs) {
    avgpipe_result r = real_elapsed(user, a, b, secs);
    pthread_mutex_lock(&prof_mu); /* the runtime's workers ask from their threads */
    if (r == AVGPIPE_OK) elapsed_ok++;
    else elapsed_failed++;
    pthread_mutex_unlock(&prof_mu);
    return r;
}
static void CUDART_CB spin_3ms(void *arg) { /* on CUDA's host-function thread, in stream order */
    double t0 = now();
    (void)arg;
    while (now() - t0 < 3e-3) {
    }
}
static int prof_forward(avgpipe_op_ctx *op) {
    return cudaLaunchHostFunc(AVGPIPE_CUDA_STREAM(op->stream), spin_3ms, NULL) == cudaSuccess ? 0 : 1;
}
static int prof_backward(avgpipe_op_ctx *op) {
    (void)op;
    return 0;
}
/* Run after every event named by event_elapsed so far was destroyed (no anchor lives, see TIMING): the
   first iteration has no timed events, the second has. */
static void check_profile_run(void) {
    enum { G = 2, M = 4, P = 1000 };
    avgpipe_context ctx;
    avgpipe_device dev = gpu; /* the table with a counting event_elapsed */
    avgpipe_run_desc d;
    avgpipe_run *run = NULL;
    avgpipe_run_stats rs;
    float *params[G];
    size_t pc[G] = {P, P}, act[G] = {256, 0}, n = 0, k;
    const avgpipe_event *ev;
    avgpipe_result r;
    int it, g;
    avgpipe_context_init(&ctx, NULL);
    real_elapsed = gpu.event_elapsed;
    dev.event_elapsed = counting_elapsed;
    for (g = 0; g < G; g++) {
        params[g] = dbuf(P);
        OK(gpu.memset(gpu.user, params[g], 0, P * sizeof(float), NULL));
    }
    OK(gpu.synchronize(gpu.user));
    memset(&d, 0, sizeof d);
    d.sched.kind = AVGPIPE_SCHED_1F1B, d.sched.stages = G, d.sched.micro = M, d.sched.pipes = 1, d.sched.rounds = 1;
    d.cb.forward = prof_forward, d.cb.backward = prof_backward;
    d.act_bytes = act, d.params = params, d.param_count = pc;
    d.profile = 1, d.device = &dev, d.timeout_s = 60;
    r = avgpipe_run_create(&ctx, &d, &run);
    CHECK(r == AVGPIPE_OK, "profiled run: create: %s", avgpipe_last_error(&ctx));
    for (it = 0; run && it < 2; it++) {
        long forwards = 0, timed = 0;
        double shortest = 1e9;
        pthread_mutex_lock(&prof_mu);
        elapsed_ok = elapsed_failed = 0;
        pthread_mutex_unlock(&prof_mu);
        r = avgpipe_run_iteration(run, &rs);
        CHECK(r == AVGPIPE_OK, "profiled run: iteration %d: %s", it + 1, avgpipe_last_error(&ctx));
        if (r != AVGPIPE_OK) break;
        ev = avgpipe_run_events(run, &n);
        for (k = 0; ev && k < n; k++) {
            double t;
            if (ev[k].op.kind != AVGPIPE_OP_F || ev[k].track != 0) continue; /* track 0: the op itself */
            t = ev[k].end - ev[k].start;
            forwards++, timed += t >= 2.9e-3;
            if (t < shortest) shortest = t;
        }
        pthread_mutex_lock(&prof_mu);
        if (it == 0) /* the events had no timing yet: their twins are made, the ops keep the host's times */
            CHECK(elapsed_ok == 0 && elapsed_failed > 0, "profiled run, iteration 1: %d elapsed ok, %d failed", elapsed_ok, elapsed_failed);
        else
            CHECK(elapsed_ok > 0 && elapsed_failed == 0 && forwards == G * M && timed == forwards,
                  "profiled run, iteration 2: %d elapsed ok, %d failed; %ld of %ld forwards last >= 2.9 ms (shortest %.3f ms)", elapsed_ok,
                  elapsed_failed, timed, forwards, shortest * 1e3);
        printf("profiled run, iteration %d: event_elapsed %d ok, %d failed; %ld forwards, shortest %.3f ms (the host function spins 3 ms)\n",
               it + 1, elapsed_ok, elapsed_failed, forwards, shortest * 1e3);
        pthread_mutex_unlock(&prof_mu);
    }
    avgpipe_run_destroy(run);
    for (g = 0; g < G; g++) gpu.free(gpu.user, params[g]);
}

/* ---- waits with a time limit: a stream held by a host function until the check lets it go ------------------- */

static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;
static int hold_released;
/* Runs on CUDA's host-callback thread, in stream order: the stream's later work waits for it. Bounded
   itself (60 s), so that a failing check cannot hang the program. */
static void CUDART_CB hold_stream(void *arg) {
    struct timespec until;
    (void)arg;
    timespec_get(&until, TIME_UTC);
    until.tv_sec += 60;
    pthread_mutex_lock(&hold_mu);
    while (!hold_released && pthread_cond_timedwait(&hold_cv, &hold_mu, &until) == 0) {
    }
    pthread_mutex_unlock(&hold_mu);
}

static void check_timeouts(int ordinal) {
    avgpipe_context ctx;
    avgpipe_device d3;
    avgpipe_device_cuda_desc cd;
    avgpipe_device_stream s = NULL;
    avgpipe_device_event ev = NULL;
    float *x = NULL;
    size_t index = 0;
    double t0, t;
    int done = -1;
    avgpipe_result r;
    avgpipe_context_init(&ctx, NULL);
    memset(&cd, 0, sizeof cd);
    cd.device = ordinal, cd.timeout_s = 0.25;
    r = avgpipe_device_cuda_create(&ctx, &cd, &d3);
    CHECK(r == AVGPIPE_OK, "create with timeout_s 0.25: %s", avgpipe_last_error(&ctx));
    if (r != AVGPIPE_OK) return;
    CHECK(d3.stream_create(d3.user, &s) == AVGPIPE_OK && d3.event_create(d3.user, &ev) == AVGPIPE_OK &&
              d3.alloc(d3.user, 4096, (void **)&x) == AVGPIPE_OK && d3.memset(d3.user, x, 0, 4096, NULL) == AVGPIPE_OK &&
              d3.synchronize(d3.user) == AVGPIPE_OK,
          "setup: %s", d3.error_string(d3.user));
    hold_released = 0;
    CHECK(cudaLaunchHostFunc(AVGPIPE_CUDA_STREAM(s), hold_stream, NULL) == cudaSuccess, "cudaLaunchHostFunc");
    CHECK(d3.event_record(d3.user, ev, s) == AVGPIPE_OK, "event_record");
    t0 = now();
    r = d3.stream_synchronize(d3.user, s);
    t = now() - t0;
    CHECK(r == AVGPIPE_TIMEOUT && has(d3.error_string(d3.user), "stream_synchronize: the GPU did not finish within 0.25 s"),
          "stream_synchronize of a held stream: %d %s", (int)r, d3.error_string(d3.user));
    CHECK(t >= 0.24 && t < 3.0, "stream_synchronize gave up after %.3f s (0.25 asked)", t);
    r = d3.event_synchronize(d3.user, ev);
    CHECK(r == AVGPIPE_TIMEOUT && has(d3.error_string(d3.user), "event_synchronize: the GPU did not finish"), "event_synchronize: %d %s",
          (int)r, d3.error_string(d3.user));
    r = d3.synchronize(d3.user);
    CHECK(r == AVGPIPE_TIMEOUT && has(d3.error_string(d3.user), "synchronize: the GPU did not finish"), "synchronize: %d %s", (int)r,
          d3.error_string(d3.user));
    r = d3.find_nonfinite(d3.user, x, 1024, &index, s);
    CHECK(r == AVGPIPE_TIMEOUT && has(d3.error_string(d3.user), "find_nonfinite: the GPU did not finish"), "find_nonfinite: %d %s",
          (int)r, d3.error_string(d3.user));
    CHECK(d3.event_query(d3.user, ev, &done) == AVGPIPE_OK && done == 0, "the held event is not done");
    pthread_mutex_lock(&hold_mu);
    hold_released = 1;
    pthread_cond_broadcast(&hold_cv);
    pthread_mutex_unlock(&hold_mu);
    CHECK(d3.stream_synchronize(d3.user, s) == AVGPIPE_OK, "after the release: %s", d3.error_string(d3.user));
    CHECK(d3.event_query(d3.user, ev, &done) == AVGPIPE_OK && done == 1, "the event is done after the release");
    CHECK(d3.find_nonfinite(d3.user, x, 1024, &index, s) == AVGPIPE_OK && index == 1024, "a scan after the release: %s",
          d3.error_string(d3.user));
    CHECK(d3.synchronize(d3.user) == AVGPIPE_OK, "synchronize after the release");
    printf("waits: a stream held by a host function: stream_synchronize gave up after %.3f s (limit 0.25 s), event_synchronize, "
           "synchronize and find_nonfinite too (AVGPIPE_TIMEOUT); all fine once released\n", t);
    d3.free(d3.user, x);
    d3.event_destroy(d3.user, ev);
    d3.stream_destroy(d3.user, s);
    avgpipe_device_destroy(&d3);
}

/* ---- the bandwidth benchmark -------------------------------------------------------------------------------- */

typedef struct bench_stat {
    double med, lo, hi;
} bench_stat;
/* Events of the default device carry no timing until event_elapsed first names them (avgpipe_cuda.h,
   TIMING): ask once, before their first records. */
static void time_events(avgpipe_device_event e0, avgpipe_device_event e1) {
    double secs;
    CHECK(gpu.event_elapsed(gpu.user, e0, e1, &secs) == AVGPIPE_BACKEND_ERROR && has(gpu.error_string(gpu.user), "had no timing yet"),
          "the first event_elapsed of new events: %s", gpu.error_string(gpu.user));
}
static bench_stat stat_of(double *t, int n) {
    bench_stat s;
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    s.med = n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
    s.lo = t[0], s.hi = t[n - 1];
    return s;
}

static void bench(avgpipe_device_stream s) {
    enum { REPS = 25, KINDS = 6 };
    const size_t P = (size_t)1 << 26; /* 256 MiB per buffer: far beyond the L2 */
    float *w = dbuf(P), *z = dbuf(P), *zp = dbuf(P), *acc = dbuf(P), *src = dbuf(P), *dst = dbuf(P);
    avgpipe_device_event e0, e1;
    double t[KINDS][REPS], bytes[KINDS];
    const char *names[KINDS] = {"cudaMemcpy D2D (copy entry)", "ea_pass MEAN pull + accumulate", "ea_pass MEAN first (store)",
                                "ea_pass ELASTIC last + momentum", "find_nonfinite", "scale"};
    avgpipe_ea_pass pm, pf, pe;
    bench_stat st[KINDS];
    size_t idx;
    int rep, k;
    OK(gpu.event_create(gpu.user, &e0));
    OK(gpu.event_create(gpu.user, &e1));
    time_events(e0, e1);
    OK(gpu.memset(gpu.user, w, 0, P * 4, s));
    OK(gpu.memset(gpu.user, z, 0, P * 4, s));
    OK(gpu.memset(gpu.user, zp, 0, P * 4, s));
    OK(gpu.memset(gpu.user, acc, 0, P * 4, s));
    OK(gpu.memset(gpu.user, src, 0, P * 4, s));
    OK(gpu.memset(gpu.user, dst, 0, P * 4, s));
    memset(&pm, 0, sizeof pm);
    pm.w = w, pm.z = z, pm.acc = acc, pm.count = P, pm.mode = AVGPIPE_EA_MEAN, pm.alpha = 0.1f;
    pf = pm, pf.first = 1;
    pe = pm, pe.mode = AVGPIPE_EA_ELASTIC, pe.z_prev = zp, pe.last = 1, pe.momentum = 0.9f;
    bytes[0] = 2.0 * 4 * (double)P; /* read + write */
    bytes[1] = 5.0 * 4 * (double)P; /* read w, z, acc; write w, acc */
    bytes[2] = 4.0 * 4 * (double)P; /* read w, z; write w, acc */
    bytes[3] = 6.0 * 4 * (double)P; /* read w, z, z_prev, acc; write w, acc */
    bytes[4] = 1.0 * 4 * (double)P;
    bytes[5] = 2.0 * 4 * (double)P;
    for (rep = -3; rep < REPS; rep++) /* interleaved, so that the clocks and the neighbours affect all alike */
        for (k = 0; k < KINDS; k++) {
            double secs = 0;
            OK(gpu.event_record(gpu.user, e0, s));
            switch (k) {
            case 0: OK(gpu.copy(gpu.user, dst, src, P * 4, AVGPIPE_DEVICE_COPY_D2D, s)); break;
            case 1: OK(gpu.ea_pass(gpu.user, &pm, s)); break;
            case 2: OK(gpu.ea_pass(gpu.user, &pf, s)); break;
            case 3: OK(gpu.ea_pass(gpu.user, &pe, s)); break;
            case 4: OK(gpu.find_nonfinite(gpu.user, w, P, &idx, s)); break;
            default: OK(gpu.scale(gpu.user, w, 1.0f, P, s)); break;
            }
            OK(gpu.event_record(gpu.user, e1, s));
            OK(gpu.event_synchronize(gpu.user, e1));
            OK(gpu.event_elapsed(gpu.user, e0, e1, &secs));
            if (rep >= 0) t[k][rep] = secs;
        }
    printf("bandwidth, %zu floats per buffer (%.0f MiB), median of %d (min .. max), bytes read + written per second:\n", P,
           (double)P * 4 / 1048576.0, REPS);
    for (k = 0; k < KINDS; k++) {
        st[k] = stat_of(t[k], REPS);
        printf("  %-34s %8.1f GB/s  (%.1f .. %.1f)  %.3f ms\n", names[k], bytes[k] / st[k].med / 1e9, bytes[k] / st[k].hi / 1e9,
               bytes[k] / st[k].lo / 1e9, st[k].med * 1e3);
    }
    for (k = 1; k < KINDS; k++)
        printf("  ratio %-28s / memcpy: %.3f%s\n", names[k], (bytes[k] / st[k].med) / (bytes[0] / st[0].med),
               k == 1 ? "   (target >= 0.90)" : "");
    printf("BENCH ea_pass/memcpy bandwidth ratio: %.3f (%s)\n", (bytes[1] / st[1].med) / (bytes[0] / st[0].med),
           (bytes[1] / st[1].med) / (bytes[0] / st[0].med) >= 0.9 ? "meets the 0.90 target" : "BELOW the 0.90 target");
    gpu.event_destroy(gpu.user, e0), gpu.event_destroy(gpu.user, e1);
    gpu.free(gpu.user, w), gpu.free(gpu.user, z), gpu.free(gpu.user, zp), gpu.free(gpu.user, acc);
    gpu.free(gpu.user, src), gpu.free(gpu.user, dst);
}

/* Boundary-buffer ("slot") transfers as the runtime makes them, through the table's copy entry, against
   cudaMemcpyAsync called directly, at sizes of activations and gradients: K copies back to back on one
   stream, timed by events (device time) and by the host clock around the enqueue (the entry's overhead). */
static void bench_transfers(avgpipe_device_stream s) {
    enum { K = 50, REPS = 7 };
    const size_t sizes[] = {(size_t)4 << 10, (size_t)256 << 10, (size_t)4 << 20, (size_t)64 << 20};
    avgpipe_device_event e0, e1;
    size_t si;
    void *src = NULL, *dst = NULL;
    OK(gpu.event_create(gpu.user, &e0));
    OK(gpu.event_create(gpu.user, &e1));
    time_events(e0, e1);
    OK(gpu.alloc(gpu.user, sizes[3], &src));
    OK(gpu.alloc(gpu.user, sizes[3], &dst));
    OK(gpu.memset(gpu.user, src, 1, sizes[3], s));
    printf("slot transfers D2D, %d copies per sample, median of %d (device time; host enqueue time per copy):\n", K, REPS);
    for (si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        double dev[2][REPS], host[2][REPS];
        bench_stat d[2], h[2];
        int rep, way, k;
        for (rep = -1; rep < REPS; rep++)
            for (way = 0; way < 2; way++) { /* 0: cudaMemcpyAsync, 1: the table's copy entry */
                double t0, t1, secs = 0;
                OK(gpu.event_record(gpu.user, e0, s));
                t0 = now();
                for (k = 0; k < K; k++) {
                    if (way == 0) CHECK(cudaMemcpyAsync(dst, src, sizes[si], cudaMemcpyDeviceToDevice, AVGPIPE_CUDA_STREAM(s)) == cudaSuccess, "cudaMemcpyAsync");
                    else OK(gpu.copy(gpu.user, dst, src, sizes[si], AVGPIPE_DEVICE_COPY_D2D, s));
                }
                t1 = now();
                OK(gpu.event_record(gpu.user, e1, s));
                OK(gpu.event_synchronize(gpu.user, e1));
                OK(gpu.event_elapsed(gpu.user, e0, e1, &secs));
                if (rep >= 0) dev[way][rep] = secs / K, host[way][rep] = (t1 - t0) / K;
            }
        for (way = 0; way < 2; way++) d[way] = stat_of(dev[way], REPS), h[way] = stat_of(host[way], REPS);
        printf("  %8zu KiB: cudaMemcpyAsync %8.1f GB/s %7.2f us/copy (enqueue %5.2f us); copy entry %8.1f GB/s %7.2f us/copy "
               "(enqueue %5.2f us); ratio %.3f\n",
               sizes[si] >> 10, 2.0 * (double)sizes[si] / d[0].med / 1e9, d[0].med * 1e6, h[0].med * 1e6,
               2.0 * (double)sizes[si] / d[1].med / 1e9, d[1].med * 1e6, h[1].med * 1e6, d[0].med / d[1].med);
    }
    gpu.free(gpu.user, src), gpu.free(gpu.user, dst);
    gpu.event_destroy(gpu.user, e0), gpu.event_destroy(gpu.user, e1);
}

/* ---- a kernel fault: last, since it ends the CUDA context of the process ------------------------------------- */

static void check_fault(void) {
    avgpipe_result r;
    r = gpu.scale(gpu.user, (float *)(uintptr_t)0x10, 2.0f, 1000, NULL); /* launches fine, faults on the GPU */
    if (r == AVGPIPE_OK) r = gpu.synchronize(gpu.user);
    CHECK(r == AVGPIPE_BACKEND_ERROR && has(gpu.error_string(gpu.user), "cudaError"), "a kernel fault: %d %s", (int)r,
          gpu.error_string(gpu.user));
    printf("fault: a kernel writing through a bad pointer -> %s: \"%s\"\n", avgpipe_result_string(r), gpu.error_string(gpu.user));
}

static void print_log(avgpipe_log_level level, const char *msg, void *user) {
    (void)user;
    printf("log (%s): %s\n", level == AVGPIPE_LOG_ERROR ? "error" : level == AVGPIPE_LOG_WARN ? "warning" : "info", msg);
}

int main(int argc, char **argv) {
    avgpipe_context ctx;
    avgpipe_context_desc cdesc;
    avgpipe_device_cuda_desc cd;
    avgpipe_device_cuda_info info;
    avgpipe_device_stream s = NULL;
    struct cudaDeviceProp prop;
    int i, n = 0, do_bench = 0, do_fault = 1;
    double t0 = now();
    cudaError_t e;
    memset(&cd, 0, sizeof cd);
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--bench")) do_bench = 1;
        else if (!strcmp(argv[i], "--no-fault")) do_fault = 0;
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) cd.device = atoi(argv[++i]);
        else {
            printf("usage: %s [--device N] [--bench] [--no-fault]\n", argv[0]);
            return 2;
        }
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if ((e = cudaGetDeviceCount(&n)) != cudaSuccess || n == 0) {
        printf("cuda_device_check: no CUDA device (%s): skipped\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 77;
    }
    memset(&cdesc, 0, sizeof cdesc);
    cdesc.log = print_log; /* the warnings of the table (more streams than hardware queues) */
    avgpipe_context_init(&ctx, &cdesc);
    if (avgpipe_device_cuda_create(&ctx, &cd, &gpu) != AVGPIPE_OK) {
        printf("FAIL: avgpipe_device_cuda_create: %s\n", avgpipe_last_error(&ctx));
        return 1;
    }
    if (avgpipe_device_cpu_create(&ctx, NULL, &cpu) != AVGPIPE_OK) return 1;
    CHECK(avgpipe_device_check(&ctx, &gpu) == AVGPIPE_OK, "table: %s", avgpipe_last_error(&ctx));
    CHECK(avgpipe_device_cuda_query(&ctx, &gpu, &info) == AVGPIPE_OK, "query");
    memset(&prop, 0, sizeof prop);
    cudaGetDeviceProperties(&prop, cd.device);
    printf("device %s: %s, compute capability %d.%d, %d multiprocessors; kernels: %s; launch: %d threads x up to %d blocks\n",
           gpu.name, prop.name, info.cc_major, info.cc_minor, info.multiprocessors, info.kernels, info.desc.block_size,
           info.desc.max_blocks);
    printf("grids (multiprocessors x blocks per multiprocessor): ea_pass %d x %d = %d, find_nonfinite %d x %d = %d, scale %d x %d = %d, "
           "flag_nonfinite %d x %d = %d; CUDA_DEVICE_MAX_CONNECTIONS %d\n",
           info.multiprocessors, info.blocks_per_sm[0], info.grid[0], info.multiprocessors, info.blocks_per_sm[1], info.grid[1],
           info.multiprocessors, info.blocks_per_sm[2], info.grid[2], info.multiprocessors, info.blocks_per_sm[3], info.grid[3],
           info.max_connections);
    for (i = 0; i < AVGPIPE_DEVICE_CUDA_KERNEL_COUNT; i++)
        CHECK(info.blocks_per_sm[i] >= 1 && info.grid[i] == info.multiprocessors * info.blocks_per_sm[i] && info.desc.max_blocks >= info.grid[i],
              "kernel %d: grid %d, %d multiprocessors x %d blocks, max_blocks %d", i, info.grid[i], info.multiprocessors,
              info.blocks_per_sm[i], info.desc.max_blocks);
    CHECK(gpu.event_elapsed != NULL && gpu.scale != NULL && gpu.event_query != NULL && gpu.flag_nonfinite != NULL, "optional entries set");
    check_memory();
    OK(gpu.stream_create(gpu.user, &s));
    check_ea_pass(s);
    check_ea_pass(NULL); /* the default stream too */
    check_nonfinite_scale(s);
    check_flag_skip(s);
    check_ea_module(AVGPIPE_EA_MEAN, 0.0f);
    check_ea_module(AVGPIPE_EA_ELASTIC, 0.9f);
    check_streams_events();
    check_threads();
    check_stream_concurrency();
    check_profile_run();
    check_variants(cd.device);
    check_queues_warning(cd.device);
    check_timeouts(cd.device);
    if (do_bench) {
        bench(s);
        bench_transfers(s);
    }
    gpu.stream_destroy(gpu.user, s);
    if (do_fault) check_fault();
    printf("cuda_device_check (%s kernels): %d checks, %d failed, %.1f s\n", info.kernels, checks, failures, now() - t0);
    if (!do_fault) avgpipe_device_destroy(&gpu); /* after a fault CUDA refuses everything: the process ends instead */
    avgpipe_device_destroy(&cpu);
    return failures ? 1 : 0;
}
