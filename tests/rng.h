/* tests/rng.h: what the numeric tests share: a seeded xorshift64* generator and float bit patterns.
   static inline, so a test that uses part of it gets no unused-function warning. */
#ifndef AVGPIPE_TESTS_RNG_H
#define AVGPIPE_TESTS_RNG_H

#include <stdint.h>
#include <string.h>

typedef struct rng {
    uint64_t s; /* any nonzero seed */
} rng;

static inline uint64_t rng_next(rng *r) { /* xorshift64* */
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 2685821657736338717ull;
}
static inline double rng_unit(rng *r) { return (double)(rng_next(r) >> 11) / 9007199254740992.0; } /* [0, 1) */
static inline float rng_float(rng *r, double lo, double hi) { return (float)(lo + (hi - lo) * rng_unit(r)); }

static inline uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* Bitwise equal, or both NaN (payloads may differ: x86 keeps an operand's, a GPU gives the canonical NaN). */
static inline int is_nan_bits(float a) { return (bits(a) & 0x7fffffffu) > 0x7f800000u; } /* still NaN under -ffast-math */
static inline int same(float a, float b) { return bits(a) == bits(b) || (is_nan_bits(a) && is_nan_bits(b)); }

#endif
