/* tests/exact_ref.h: the documented fp32 averaging pass and the rank-order sum, computed here one
   rounded operation at a time, so that no compiler flag of the test's own build can change them:
   every operand and result goes through a volatile float (no contraction into a fused multiply-add,
   no reassociation, no folding of 0 + x under -fno-signed-zeros, no excess precision), and the FP environment is set by hand to round to nearest
   with subnormals kept (a program linked with -Ofast starts with flush-to-zero). Independent of the
   library: it never calls it. Also the inputs these tests feed it, drawn as bit patterns (no
   floating-point arithmetic that flags could change), with subnormals, signed zeros and
   near-cancellations in the mix. Used by test_ea and exact_check, in every build of them. */
#ifndef AVGPIPE_TESTS_EXACT_REF_H
#define AVGPIPE_TESTS_EXACT_REF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "tests/rng.h"
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define EXACT_REF_MXCSR 1
#endif

static inline float xr_sub(float a, float b) {
    volatile float va = a, vb = b, r;
    r = va - vb;
    return r;
}
static inline float xr_add(float a, float b) {
    volatile float va = a, vb = b, r;
    r = va + vb;
    return r;
}
static inline float xr_mul(float a, float b) {
    volatile float va = a, vb = b, r;
    r = va * vb;
    return r;
}

/* Flush-to-zero and denormals-are-zero: on (1) or off (0) for this thread; returns whether they were on. */
static inline int xr_set_ftz(int on) {
#ifdef EXACT_REF_MXCSR
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(on ? (csr | 0x8040u) : (csr & ~0x8040u));
    return (csr & 0x8040u) != 0;
#else
    (void)on;
    return 0;
#endif
}
static inline int xr_ftz_on(void) {
#ifdef EXACT_REF_MXCSR
    return (_mm_getcsr() & 0x8040u) != 0;
#else
    return 0;
#endif
}

/* One element of the pass, as avgpipe.h's section 11 documents it (MEAN and ELASTIC). */
typedef struct xr_pass {
    int elastic, first, last;
    float alpha, scale, momentum;
} xr_pass;

static inline void xr_elem(const xr_pass *p, float *w, float z, float zp, float *acc) {
    int pull = bits(p->alpha) != 0u; /* alpha != 0 (never -0 here) */
    float wi = *w, c, v, a;
    if (p->elastic) {
        c = pull ? xr_mul(p->alpha, xr_sub(wi, z)) : 0.0f;
        if (pull) *w = xr_sub(wi, c);
        a = p->first ? c : xr_add(*acc, c);
        if (p->last) a = xr_add(a, bits(p->momentum) != 0u ? xr_add(z, xr_mul(p->momentum, xr_sub(z, zp))) : z);
    } else {
        v = pull ? xr_sub(wi, xr_mul(p->alpha, xr_sub(wi, z))) : wi;
        if (pull) *w = v;
        a = p->first ? v : xr_add(*acc, v);
        if (p->last) a = xr_mul(a, p->scale);
    }
    *acc = a;
}

/* dst[i] = ((0 + part_0[i]) + part_1[i]) + ... */
static inline void xr_sum_ranks(float *dst, const float *parts, size_t stride, int nparts, size_t count) {
    size_t i;
    int r;
    for (i = 0; i < count; i++) {
        float s = 0.0f;
        for (r = 0; r < nparts; r++) s = xr_add(s, parts[(size_t)r * stride + i]);
        dst[i] = s;
    }
}

/* A float of magnitude class k % 4: 0 ordinary [-4, 4), 1 subnormal or tiny normal, 2 near `near`
   (a few ulps away: cancellation in w - z), 3 a signed zero or a power of two. Never NaN or Inf. */
static inline float xr_draw(rng *r, int k, float near) {
    uint64_t u = rng_next(r);
    uint32_t sign = (uint32_t)(u >> 63) << 31, mant = (uint32_t)(u >> 20) & 0x7fffffu;
    switch (k & 3) {
    case 0: return from_bits(sign | ((uint32_t)(120 + (u >> 8) % 9) << 23) | mant); /* 2^-7 .. 2^1 */
    case 1: return from_bits(sign | ((uint32_t)((u >> 8) % 3) << 23) | mant);       /* exponent 0..2 */
    case 2: return from_bits(bits(near) + (uint32_t)((u >> 8) % 7) - 3u * ((bits(near) & 0x7fffffffu) > 3u));
    default: return (u >> 8) & 1 ? from_bits(sign) : from_bits(sign | ((uint32_t)(110 + (u >> 9) % 20) << 23));
    }
}
/* w, z, z_prev, acc for `n` elements: each element's class drawn at random; in class 2 w is ordinary and z
   (and z_prev) a few ulps from it. */
static inline void xr_fill(rng *r, float *w, float *z, float *zp, float *acc, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        int k = (int)(rng_next(r) % 4);
        w[i] = xr_draw(r, k == 2 ? 0 : k, 0.0f);
        z[i] = xr_draw(r, k, w[i]);
        zp[i] = xr_draw(r, k, z[i]);
        acc[i] = xr_draw(r, (int)(rng_next(r) % 4), 0.0f);
    }
}

/* The alphas, scales and momenta the tests run: 1/N scales, the paper's 0.1, random bit patterns in (0, 1). */
static inline float xr_alpha(rng *r, int k) {
    static const float fixed[] = {0.1f, 0.37f, 1.0f, 0.125f, 0.3f, 0.9999999f};
    if (k < (int)(sizeof fixed / sizeof fixed[0])) return fixed[k];
    return from_bits((uint32_t)((100 + rng_next(r) % 26) << 23) | (uint32_t)(rng_next(r) & 0x7fffffu));
}

/* FNV-1a over the bits of n floats: what the builds with different flags compare. */
static inline uint64_t xr_digest(uint64_t h, const float *x, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t b = bits(x[i]);
        int k;
        for (k = 0; k < 4; k++) h = (h ^ ((b >> (8 * k)) & 0xffu)) * 1099511628211ull;
    }
    return h;
}
#define XR_DIGEST_SEED 14695981039346656037ull

#endif
