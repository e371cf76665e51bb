/* avgpipe_ea_wip.h — device backend table and elastic averaging (issue 3), work in progress.

   TEMPORARY COMPANION of avgpipe.h, kept in its own file while avgpipe.h's schedule layer is being
   edited. At merge time it is pasted, mechanically, into avgpipe.h:
     - the text between @@EA_DECL_BEGIN@@ and @@EA_DECL_END@@ goes where the sections' declarations go
       (it expects to sit inside avgpipe.h's extern "C" block, after section 1, "Basics");
     - the text between @@EA_IMPL_BEGIN@@ and @@EA_IMPL_END@@ goes into the implementation (inside its
       extern "C" block, after the basics' helpers it uses: avgpipe__ctx, avgpipe__fail, avgpipe__calloc,
       avgpipe__log, avgpipe_alloc);
     - the rest of this file (guards, the extern "C" wrappers, the WIP-only block at the end) is dropped,
       and the tests' and benchmark's include lines marked WIP-MERGE are deleted.
   Until then: #include "avgpipe.h" first, then this file, with AVGPIPE_IMPLEMENTATION defined in one
   translation unit as usual. Link with -pthread.
*/
#ifndef AVGPIPE_H
#error "avgpipe_ea_wip.h: include avgpipe.h before avgpipe_ea_wip.h"
#endif

#ifndef AVGPIPE_EA_WIP_H
#define AVGPIPE_EA_WIP_H

#ifdef __cplusplus
extern "C" {
#endif

/* @@EA_DECL_BEGIN@@ */
/* ============================================================================================ */
/* 7. Device backend   (avgpipe_device_*)                                                       */
/* ============================================================================================ */
/* A device is a table of function pointers plus `void *user` (passed back as the first argument of
   every entry). The library never touches device memory itself: it only calls the table. Entries take a
   stream and may run asynchronously (a CUDA backend enqueues and returns); work on one stream runs in
   order, and events order work across streams (record on one, wait on another). On the CPU device every
   entry runs to completion before it returns, so streams and events are no-ops (NULL handles).

   Every entry returns AVGPIPE_OK or an error (AVGPIPE_OUT_OF_MEMORY from alloc, AVGPIPE_BACKEND_ERROR
   otherwise); error_string() gives the backend's own text for the last failure. The NULL stream is the
   device's default stream. A backend must let different threads use different streams at once; the
   averaging module serialises its own calls that touch the same buffers (see "Averaging"). */

typedef struct avgpipe_device_stream_s *avgpipe_device_stream; /* opaque; NULL = the default stream */
typedef struct avgpipe_device_event_s *avgpipe_device_event;   /* opaque */

typedef enum avgpipe_device_copy_kind {
    AVGPIPE_DEVICE_COPY_H2D = 1, /* host -> device */
    AVGPIPE_DEVICE_COPY_D2H = 2, /* device -> host */
    AVGPIPE_DEVICE_COPY_D2D = 3  /* device -> device */
} avgpipe_device_copy_kind;

typedef enum avgpipe_ea_mode {
    AVGPIPE_EA_MODE_DEFAULT = 0, /* -> AVGPIPE_EA_MEAN */
    AVGPIPE_EA_MEAN = 1,         /* AvgPipe: the reference is the mean of the parallel models */
    AVGPIPE_EA_ELASTIC = 2       /* EASGD / Crossbow SMA: the reference moves by the sum of the pulls */
} avgpipe_ea_mode;

/* One fused averaging pass over `count` floats: ONE read of w, z, acc and ONE write of w, acc (plus a
   read of z_prev in the finalizing pass of ELASTIC with momentum). Element by element, with
   pull = (alpha != 0):
     MEAN:     v = pull ? w - alpha*(w - z) : w;    if (pull) w = v;
               acc = first ? v : acc + v;           if (last) acc = acc * scale;
     ELASTIC:  c = pull ? alpha*(w - z) : 0;        if (pull) w = w - c;
               acc = first ? c : acc + c;
               if (last) acc = acc + (momentum != 0 ? z + momentum*(z - z_prev) : z);
   `first` stores instead of adding (the accumulator is never zeroed); `last` is the round's finalize,
   fused into the last contribution (after it, acc holds the next reference). A backend must produce
   these values in fp32 with exactly these operations (no fused multiply-add), so that the CPU and other
   backends agree to the bit where the hardware allows. w, z, z_prev and acc never overlap. z is read
   only when pull or (ELASTIC and last); z_prev only then with momentum != 0; either may be NULL when
   not read. */
typedef struct avgpipe_ea_pass {
    float *w;            /* the parallel model's partition (device memory) */
    const float *z;      /* the reference it is pulled toward */
    const float *z_prev; /* the reference before z (ELASTIC with momentum only) */
    float *acc;          /* the round's accumulator */
    size_t count;        /* floats */
    avgpipe_ea_mode mode;
    float alpha;    /* elasticity, in [0, 1] */
    float scale;    /* MEAN: 1/N, applied by the last pass */
    float momentum; /* ELASTIC: mu on the reference */
    int first;      /* nonzero: first contribution of its round (store) */
    int last;       /* nonzero: last contribution of its round (finalize) */
} avgpipe_ea_pass;

typedef struct avgpipe_device {
    const char *name;      /* for messages ("cpu", "cuda:0") */
    size_t alloc_overhead; /* bytes alloc() takes from its allocator beyond each request (memory accounting) */
    /* Memory. alloc returns memory aligned to at least 64 bytes; free(user, NULL) is harmless. */
    avgpipe_result (*alloc)(void *user, size_t bytes, void **out);
    void (*free)(void *user, void *ptr);
    avgpipe_result (*copy)(void *user, void *dst, const void *src, size_t bytes, avgpipe_device_copy_kind kind,
                           avgpipe_device_stream stream);
    avgpipe_result (*memset)(void *user, void *dst, int value, size_t bytes, avgpipe_device_stream stream);
    /* Streams and events (CUDA semantics: a wait orders against the event's latest record). */
    avgpipe_result (*stream_create)(void *user, avgpipe_device_stream *out);
    void (*stream_destroy)(void *user, avgpipe_device_stream stream);
    avgpipe_result (*stream_synchronize)(void *user, avgpipe_device_stream stream);
    avgpipe_result (*event_create)(void *user, avgpipe_device_event *out);
    void (*event_destroy)(void *user, avgpipe_device_event event);
    avgpipe_result (*event_record)(void *user, avgpipe_device_event event, avgpipe_device_stream stream);
    avgpipe_result (*stream_wait_event)(void *user, avgpipe_device_stream stream, avgpipe_device_event event);
    avgpipe_result (*event_synchronize)(void *user, avgpipe_device_event event);
    avgpipe_result (*synchronize)(void *user); /* the whole device */
    /* Averaging kernels. ea_pass: one avgpipe_ea_pass (pull + contribute, and finalize when p->last);
       may be asynchronous. find_nonfinite: *index = the lowest i with x[i] NaN or +-Inf, or count if
       none; synchronous (returns once *index is known, after the stream's earlier work). */
    avgpipe_result (*ea_pass)(void *user, const avgpipe_ea_pass *p, avgpipe_device_stream stream);
    avgpipe_result (*find_nonfinite)(void *user, const float *x, size_t count, size_t *index,
                                     avgpipe_device_stream stream);
    /* The backend's text for its last failure ("" if none); may be NULL. */
    const char *(*error_string)(void *user);
    /* Release the backend's own state (called by avgpipe_device_destroy); may be NULL. */
    void (*destroy)(void *user);
    void *user;
} avgpipe_device;

/* CPU device description. Zero-initialise; zero fields mean:
     threads         0 -> 1: kernels run on the calling thread only. More threads split one pass into
                     contiguous chunks (a pthread each, started per pass, the caller runs the first chunk);
                     worth it for passes of millions of floats. At most AVGPIPE_DEVICE_CPU_MAX_THREADS.
     min_per_thread  0 -> 65536 floats: a pass uses at most count/min_per_thread threads.             */
typedef struct avgpipe_device_cpu_desc {
    int threads;
    size_t min_per_thread;
} avgpipe_device_cpu_desc;

#define AVGPIPE_DEVICE_CPU_MAX_THREADS 64
#define AVGPIPE_DEVICE_CPU_ALIGN 64

/* The CPU description with its defaults filled in (desc may be NULL: all defaults). Thread-safe. */
AVGPIPE_API avgpipe_device_cpu_desc avgpipe_device_cpu_query_defaults(const avgpipe_device_cpu_desc *desc);

/* Create the CPU device: memory comes from ctx's allocator (64-byte aligned; alloc_overhead bytes
   extra per allocation), copies are memcpy, streams and events are no-ops, kernels run on up to
   desc->threads threads. desc may be NULL (defaults).
   Errors: AVGPIPE_INVALID_ARG (out NULL, threads < 0 or > AVGPIPE_DEVICE_CPU_MAX_THREADS),
   AVGPIPE_OUT_OF_MEMORY. Release with avgpipe_device_destroy().
   Thread-safety: the device may be used from any number of threads at once (it holds no mutable
   state); creating it touches only ctx and *out. */
AVGPIPE_API avgpipe_result avgpipe_device_cpu_create(avgpipe_context *ctx, const avgpipe_device_cpu_desc *desc,
                                                     avgpipe_device *out);

/* Release a device's own state (its destroy entry) and zero the table. NULL or a zeroed table is
   harmless. Not thread-safe: nothing may use the device during or after the call. */
AVGPIPE_API void avgpipe_device_destroy(avgpipe_device *dev);

/* Check that a device table is complete: every entry but error_string and destroy set. Returns
   AVGPIPE_INVALID_ARG naming the first missing entry. Useful when writing a backend. Thread-safe
   (writes only ctx). */
AVGPIPE_API avgpipe_result avgpipe_device_check(avgpipe_context *ctx, const avgpipe_device *dev);

/* ============================================================================================ */
/* 8. Averaging   (avgpipe_ea_*)                                                                 */
/* ============================================================================================ */
/* The elastic-averaging state of ONE stage partition (P floats) shared by N parallel models.

   Round t: every pipeline i contributes once, after its local optimizer step. A contribution is one
   fused pass (avgpipe_ea_pass): pull w_i toward z, the newest COMPLETE reference, and add to the
   round's accumulator. The last contribution of a round finalizes it in the same pass, and the
   accumulator becomes the reference by pointer rotation: no zeroing pass, no copy, no finalize pass.
     MEAN      w_i <- w_i - alpha (w_i - z);  z' = (1/N) sum_i w_i      (after the pulls)
     ELASTIC   c_i = alpha (w_i - z); w_i -= c_i;  z' = z + sum_i c_i + mu (z - z_prev)
   Contributions of a round are accepted in any order.

   Staleness and buffers. A pipeline that has contributed to round t may contribute to round t+1
   while round t is still open; it is then pulled toward the reference round t started from (staleness
   1). Round t+2 must wait until round t completes: such a contribution is refused with
   AVGPIPE_STATE_ERROR (call avgpipe_ea_wait first). So at most two rounds are open, and the state is
   three P-float device buffers that rotate roles: the reference, the accumulator of the oldest open
   round, the accumulator of the next one; ELASTIC with momentum keeps the previous reference as a
   fourth. When round t completes its accumulator becomes the reference and the buffer it replaces
   becomes the accumulator of round t+2. (Allowing more rounds ahead would need one buffer per extra
   round and give staleness > 1; the paper bounds staleness at 1.) The last contributor of a round is
   always one whose own previous round is complete, so it pulls toward the round's starting reference,
   which is what the ELASTIC finalize adds.

   Non-finite guard. Before a contribution touches anything, w_i is scanned for NaN and +-Inf (one
   extra read of w_i: 4P bytes next to the pass's 20P; switch it off with desc.no_finite_check). A bad
   model is refused with AVGPIPE_NON_FINITE naming the pipeline, stage, round and index; w_i, the
   reference and the accumulator are left untouched, so nothing already averaged is lost: re-seed the
   model with avgpipe_ea_reset_from_reference and contribute again for the same round. (A fused check
   cannot roll back: acc + x - x is not acc in floating point.)

   Device ordering. Every operation on the module's buffers waits on one internal event and records it
   again, on the caller's stream, under the module's mutex: all averaging work is totally ordered, so
   buffers can be recycled safely even when pipelines use different streams.

   Thread-safety. Different pipelines may contribute from different threads at once (one thread per
   pipeline index at a time; each thread with its own context, or NULL for the per-thread default).
   Round bookkeeping is protected by a mutex; on the CPU device the pass itself runs under it too (two
   passes on one accumulator cannot overlap), the non-finite scan does not. */

typedef struct avgpipe_ea avgpipe_ea; /* opaque */

/* Description of one stage partition's averaging. Zero-initialise; zero fields mean:
     mode            0 -> AVGPIPE_EA_MEAN
     alpha           0 -> 0.1, the published default (Crossbow; AvgPipe follows it). For alpha = 0 exactly
                     (no pull: with N = 1 this is plain training), set zero_alpha instead.
     momentum        0 -> none. mu in [0, 1); AVGPIPE_EA_ELASTIC only.
     device          NULL -> a single-threaded CPU device created for (and owned by) the module
     stage           only used in messages (0 -> stage 0)
     no_finite_check 0 -> the non-finite guard is on
   Required: count (P > 0), pipes (N >= 1), initial (z0: P floats in device memory, typically model
   0's starting weights; copied at creation). */
typedef struct avgpipe_ea_desc {
    size_t count;
    int pipes;
    avgpipe_ea_mode mode;
    float alpha;
    int zero_alpha; /* nonzero: alpha = 0 exactly; alpha must be left 0 */
    float momentum;
    const float *initial;
    const avgpipe_device *device; /* the table is copied; its user state must outlive the module */
    int stage;
    int no_finite_check;
} avgpipe_ea_desc;

/* What the module allocates. */
typedef struct avgpipe_ea_memory_info {
    size_t device_bytes; /* buffers * (P * sizeof(float) + device->alloc_overhead), through device->alloc */
    size_t host_bytes;   /* bookkeeping (and the owned CPU device when desc.device is NULL), through the
                            context's allocator */
    int buffers;         /* P-float device buffers: 3, or 4 for ELASTIC with momentum */
} avgpipe_ea_memory_info;

/* desc with its defaults filled in (mode, alpha; device stays NULL, meaning the owned CPU device).
   No validation; desc may be NULL (all defaults). Thread-safe. */
AVGPIPE_API avgpipe_ea_desc avgpipe_ea_query_defaults(const avgpipe_ea_desc *desc);

/* The exact bytes avgpipe_ea_create(ctx, desc, ...) allocates (the tuner's memory model). With the
   CPU device (desc->device NULL, or a CPU device on the same allocator), device_bytes + host_bytes is
   what the context's allocator hands out. Errors: those of avgpipe_ea_create's validation
   (AVGPIPE_INVALID_ARG naming the field; desc->initial may be NULL here), desc or out NULL.
   Thread-safe (writes only ctx and *out). */
AVGPIPE_API avgpipe_result avgpipe_ea_memory_bytes(avgpipe_context *ctx, const avgpipe_ea_desc *desc,
                                                   avgpipe_ea_memory_info *out);

/* Create the averaging state: resolve and validate desc, allocate the buffers, copy desc->initial
   into the reference (z0 = initial; with momentum also z_prev = initial). Round 0 is open.
   Errors: AVGPIPE_INVALID_ARG naming the field (count 0, pipes < 1, mode unknown, alpha outside [0, 1]
   or NaN, zero_alpha with alpha != 0, momentum outside [0, 1) or with MEAN, initial NULL, an
   incomplete device table, desc or out NULL), AVGPIPE_OUT_OF_MEMORY, AVGPIPE_BACKEND_ERROR. On error
   *out is NULL and nothing is left allocated.
   Thread-safety: touches only ctx and *out; the device must be usable from this thread. */
AVGPIPE_API avgpipe_result avgpipe_ea_create(avgpipe_context *ctx, const avgpipe_ea_desc *desc, avgpipe_ea **out);

/* Wait for the module's outstanding device work, then free everything (through the allocator and
   device it was created with). NULL is harmless. Not thread-safe: no other call on ea may run during
   or after it. */
AVGPIPE_API void avgpipe_ea_destroy(avgpipe_ea *ea);

/* The resolved description the module runs with (zeroed if ea is NULL). Thread-safe. */
AVGPIPE_API avgpipe_ea_desc avgpipe_ea_query_desc(const avgpipe_ea *ea);

/* Pipeline `pipe` contributes its partition w (device memory, P floats) to round `round`: one fused
   pass pulls w toward the newest complete reference (w is updated in place) and adds it to the round's
   accumulator; the round's last contribution finalizes it. Enqueued on `stream` (the pipeline's
   stream; NULL = default) after all earlier averaging work; on the CPU it is done when the call
   returns. Rounds are counted from 0 and each pipeline contributes to every round, in order.
   Errors (nothing is modified on any error):
     AVGPIPE_INVALID_ARG   ea or w NULL, pipe outside [0, N);
     AVGPIPE_STATE_ERROR   pipe already contributed to `round` (twice in one round), skipped a round, or
                           `round` is two ahead of the oldest open round (wait for it first);
     AVGPIPE_NON_FINITE    w holds NaN or +-Inf: refused; the message names pipeline, stage, round, index;
     AVGPIPE_BACKEND_ERROR a device entry failed.
   Thread-safety: different pipelines may call concurrently (one thread per pipe at a time); the round
   bookkeeping and, on the CPU, the pass run under the module's mutex, the non-finite scan outside it. */
AVGPIPE_API avgpipe_result avgpipe_ea_contribute(avgpipe_context *ctx, avgpipe_ea *ea, int pipe, uint64_t round,
                                                 float *w, avgpipe_device_stream stream);

/* The synchronous/deterministic variant: wait until round `round` is complete (all N contributed) and
   the device has finished its passes, i.e. until the reference produced by round `round` is ready.
   timeout_ms = 0 only checks ("assert complete"); timeout_ms > 0 waits at most that long.
   Errors: AVGPIPE_INVALID_ARG (ea NULL, timeout_ms < 0), AVGPIPE_TIMEOUT (the message lists the
   pipelines still missing), AVGPIPE_BACKEND_ERROR. Thread-safety: any thread, concurrently with
   contributions. */
AVGPIPE_API avgpipe_result avgpipe_ea_wait(avgpipe_context *ctx, avgpipe_ea *ea, uint64_t round, int64_t timeout_ms);

/* Re-seed a parallel model from the reference: w <- z (the newest complete reference), on `stream`
   after all earlier averaging work. Use it after AVGPIPE_NON_FINITE, then contribute again for the same
   round (the pipeline's round bookkeeping is unchanged). The caller resets its optimizer state as it
   sees fit. Errors: AVGPIPE_INVALID_ARG (ea or w NULL, pipe outside [0, N)), AVGPIPE_BACKEND_ERROR.
   Thread-safety: as avgpipe_ea_contribute. */
AVGPIPE_API avgpipe_result avgpipe_ea_reset_from_reference(avgpipe_context *ctx, avgpipe_ea *ea, int pipe, float *w,
                                                           avgpipe_device_stream stream);

/* Copy the newest complete reference (P floats) to dst: kind AVGPIPE_DEVICE_COPY_D2D (dst in device memory)
   or AVGPIPE_DEVICE_COPY_D2H (host memory; on an asynchronous device the copy may be in flight until `stream`
   is synchronised). *version (may be NULL) receives the number of rounds that produced it.
   Errors: AVGPIPE_INVALID_ARG (ea or dst NULL, another kind), AVGPIPE_BACKEND_ERROR.
   Thread-safety: any thread, concurrently with contributions. */
AVGPIPE_API avgpipe_result avgpipe_ea_copy_reference(avgpipe_context *ctx, avgpipe_ea *ea, void *dst,
                                                     avgpipe_device_copy_kind kind, uint64_t *version,
                                                     avgpipe_device_stream stream);

/* The newest complete reference in device memory, without a copy; *version (may be NULL) receives the
   number of completed rounds it reflects. It stays valid and unchanged at least until the round open
   now completes (one round later with momentum); copy it (avgpipe_ea_copy_reference) to keep it
   longer. On an asynchronous device, order your reads after avgpipe_ea_wait. NULL if ea is NULL.
   Thread-safety: any thread. */
AVGPIPE_API const float *avgpipe_ea_reference(avgpipe_ea *ea, uint64_t *version);

/* Number of completed rounds (= the index of the oldest open round); 0 if ea is NULL. Any thread. */
AVGPIPE_API uint64_t avgpipe_ea_rounds_completed(avgpipe_ea *ea);
/* @@EA_DECL_END@@ */

#ifdef __cplusplus
} /* extern "C" */
#endif
#endif /* AVGPIPE_EA_WIP_H */

#if defined(AVGPIPE_IMPLEMENTATION) && !defined(AVGPIPE_EA_WIP_IMPL_INCLUDED)
#define AVGPIPE_EA_WIP_IMPL_INCLUDED
#ifndef AVGPIPE_IMPLEMENTATION_INCLUDED
#error "avgpipe_ea_wip.h: define AVGPIPE_IMPLEMENTATION before including avgpipe.h, then include this file"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* @@EA_IMPL_BEGIN@@ */
/* --- 7. Device backend ------------------------------------------------------------------------ */

/* POSIX threads for the CPU device's kernel threads and the averaging module's mutex. Plain C headers,
   harmless inside extern "C". */
#include <pthread.h>
#include <time.h>

#if defined(__cplusplus)
#if defined(__GNUC__) || defined(_MSC_VER)
#define AVGPIPE__RESTRICT __restrict
#else
#define AVGPIPE__RESTRICT
#endif
#else
#define AVGPIPE__RESTRICT restrict
#endif

#if defined(__GNUC__) || defined(__clang__)
#define AVGPIPE__FORCE_INLINE static inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define AVGPIPE__FORCE_INLINE static __forceinline
#else
#define AVGPIPE__FORCE_INLINE static inline
#endif

typedef struct avgpipe__cpu_device {
    avgpipe_allocator allocator; /* the creating context's, copied: the device does not keep the context */
    int threads;
    size_t min_per_thread;
} avgpipe__cpu_device;

AVGPIPE_API avgpipe_device_cpu_desc avgpipe_device_cpu_query_defaults(const avgpipe_device_cpu_desc *desc) {
    avgpipe_device_cpu_desc d;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if (d.threads == 0) d.threads = 1;
    if (d.min_per_thread == 0) d.min_per_thread = (size_t)1 << 16;
    return d;
}

/* Aligned allocation through the allocator: the raw pointer is stored just below the aligned block. */
#define AVGPIPE__CPU_OVERHEAD (AVGPIPE_DEVICE_CPU_ALIGN - 1 + sizeof(void *))

static avgpipe_result avgpipe__cpu_alloc(void *user, size_t bytes, void **out) {
    avgpipe__cpu_device *d = (avgpipe__cpu_device *)user;
    unsigned char *raw;
    uintptr_t a;
    *out = NULL;
    if (bytes > (size_t)-1 - AVGPIPE__CPU_OVERHEAD) return AVGPIPE_OUT_OF_MEMORY;
    raw = (unsigned char *)d->allocator.alloc(bytes + AVGPIPE__CPU_OVERHEAD, d->allocator.user);
    if (!raw) return AVGPIPE_OUT_OF_MEMORY;
    a = ((uintptr_t)raw + sizeof(void *) + AVGPIPE_DEVICE_CPU_ALIGN - 1) & ~(uintptr_t)(AVGPIPE_DEVICE_CPU_ALIGN - 1);
    memcpy((unsigned char *)a - sizeof(void *), &raw, sizeof raw);
    *out = (void *)a;
    return AVGPIPE_OK;
}
static void avgpipe__cpu_free(void *user, void *ptr) {
    avgpipe__cpu_device *d = (avgpipe__cpu_device *)user;
    void *raw;
    if (!ptr) return;
    memcpy(&raw, (unsigned char *)ptr - sizeof(void *), sizeof raw);
    d->allocator.free(raw, d->allocator.user);
}
static avgpipe_result avgpipe__cpu_copy(void *user, void *dst, const void *src, size_t bytes, avgpipe_device_copy_kind kind,
                                        avgpipe_device_stream stream) {
    (void)user, (void)kind, (void)stream;
    if (bytes && dst != src) memmove(dst, src, bytes);
    return AVGPIPE_OK;
}
static avgpipe_result avgpipe__cpu_memset(void *user, void *dst, int value, size_t bytes, avgpipe_device_stream stream) {
    (void)user, (void)stream;
    if (bytes) memset(dst, value, bytes);
    return AVGPIPE_OK;
}
/* Everything runs to completion on the calling thread: streams and events are NULL handles. */
static avgpipe_result avgpipe__cpu_stream_create(void *user, avgpipe_device_stream *out) {
    (void)user;
    *out = NULL;
    return AVGPIPE_OK;
}
static void avgpipe__cpu_stream_destroy(void *user, avgpipe_device_stream s) { (void)user, (void)s; }
static avgpipe_result avgpipe__cpu_stream_sync(void *user, avgpipe_device_stream s) {
    (void)user, (void)s;
    return AVGPIPE_OK;
}
static avgpipe_result avgpipe__cpu_event_create(void *user, avgpipe_device_event *out) {
    (void)user;
    *out = NULL;
    return AVGPIPE_OK;
}
static void avgpipe__cpu_event_destroy(void *user, avgpipe_device_event e) { (void)user, (void)e; }
static avgpipe_result avgpipe__cpu_event_record(void *user, avgpipe_device_event e, avgpipe_device_stream s) {
    (void)user, (void)e, (void)s;
    return AVGPIPE_OK;
}
static avgpipe_result avgpipe__cpu_stream_wait(void *user, avgpipe_device_stream s, avgpipe_device_event e) {
    (void)user, (void)s, (void)e;
    return AVGPIPE_OK;
}
static avgpipe_result avgpipe__cpu_event_sync(void *user, avgpipe_device_event e) {
    (void)user, (void)e;
    return AVGPIPE_OK;
}
static avgpipe_result avgpipe__cpu_sync(void *user) {
    (void)user;
    return AVGPIPE_OK;
}
static const char *avgpipe__cpu_error_string(void *user) {
    (void)user;
    return "";
}

/* --- CPU kernels. Loops run over blocks of a compile-time length so that compilers vectorise them
   even at -O2 without a runtime trip-count or alias check (gcc 12's "very cheap" cost model); the
   pointers are restrict; the flags are compile-time constants in each instantiation. --------------- */

#define AVGPIPE__EA_BLOCK 64
#define AVGPIPE__EA_PULL 1u
#define AVGPIPE__EA_FIRST 2u
#define AVGPIPE__EA_LAST 4u
#define AVGPIPE__EA_ELASTIC 8u
#define AVGPIPE__EA_MOMENTUM 16u

AVGPIPE__FORCE_INLINE void avgpipe__ea_elem(float *AVGPIPE__RESTRICT w, const float *AVGPIPE__RESTRICT z,
                                            const float *AVGPIPE__RESTRICT zp, float *AVGPIPE__RESTRICT a,
                                            size_t i, float alpha, float scale, float mu, const unsigned f) {
    const float wi = w[i];
    float c, v, acc;
    if (f & AVGPIPE__EA_ELASTIC) {
        c = (f & AVGPIPE__EA_PULL) ? alpha * (wi - z[i]) : 0.0f;
        if (f & AVGPIPE__EA_PULL) w[i] = wi - c;
        acc = (f & AVGPIPE__EA_FIRST) ? c : a[i] + c;
        if (f & AVGPIPE__EA_LAST) acc = acc + ((f & AVGPIPE__EA_MOMENTUM) ? z[i] + mu * (z[i] - zp[i]) : z[i]);
    } else {
        v = (f & AVGPIPE__EA_PULL) ? wi - alpha * (wi - z[i]) : wi;
        if (f & AVGPIPE__EA_PULL) w[i] = v;
        acc = (f & AVGPIPE__EA_FIRST) ? v : a[i] + v;
        if (f & AVGPIPE__EA_LAST) acc = acc * scale;
    }
    a[i] = acc;
}

AVGPIPE__FORCE_INLINE void avgpipe__ea_run(float *AVGPIPE__RESTRICT w, const float *AVGPIPE__RESTRICT z,
                                           const float *AVGPIPE__RESTRICT zp, float *AVGPIPE__RESTRICT a, size_t n,
                                           float alpha, float scale, float mu, const unsigned f) {
    size_t i = 0, j;
    for (; i + AVGPIPE__EA_BLOCK <= n; i += AVGPIPE__EA_BLOCK)
        for (j = 0; j < AVGPIPE__EA_BLOCK; j++)
            avgpipe__ea_elem(w, z, zp, a, i + j, alpha, scale, mu, f); /* z, zp may be NULL: index, never offset */
    for (; i < n; i++) avgpipe__ea_elem(w, z, zp, a, i, alpha, scale, mu, f);
}

/* The kernel flags of a pass; momentum only matters where it is read (ELASTIC's finalize). */
static unsigned avgpipe__ea_flags(const avgpipe_ea_pass *p) {
    unsigned f = 0;
    if (p->alpha != 0.0f) f |= AVGPIPE__EA_PULL;
    if (p->first) f |= AVGPIPE__EA_FIRST;
    if (p->last) f |= AVGPIPE__EA_LAST;
    if (p->mode == AVGPIPE_EA_ELASTIC) {
        f |= AVGPIPE__EA_ELASTIC;
        if (p->last && p->momentum != 0.0f) f |= AVGPIPE__EA_MOMENTUM;
    }
    return f;
}

/* One function per flag combination: restrict parameters of a real (not inlined) function are what
   lets gcc prove the streams independent; inlined into one big switch it gives up ("complicated access
   pattern") and falls back to scalar code. */
#if defined(__GNUC__) || defined(__clang__)
#define AVGPIPE__NOINLINE __attribute__((noinline))
#elif defined(_MSC_VER)
#define AVGPIPE__NOINLINE __declspec(noinline)
#else
#define AVGPIPE__NOINLINE
#endif
#define AVGPIPE__EA_KERNEL(k)                                                                                      \
    static AVGPIPE__NOINLINE void avgpipe__ea_kernel_##k(float *AVGPIPE__RESTRICT w, const float *AVGPIPE__RESTRICT z,  \
                                                         const float *AVGPIPE__RESTRICT zp, float *AVGPIPE__RESTRICT a, \
                                                         size_t n, float alpha, float scale, float mu) {                \
        avgpipe__ea_run(w, z, zp, a, n, alpha, scale, mu, k##u);                                                   \
    }
/* MEAN: PULL x FIRST x LAST; ELASTIC (8): PULL x FIRST x LAST, and LAST with MOMENTUM (16) */
#define AVGPIPE__EA_KERNELS(X)                                                                                     \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15) X(28) X(29) X(30) X(31)
AVGPIPE__EA_KERNELS(AVGPIPE__EA_KERNEL)

/* One pass over elements [b, e). */
static void avgpipe__ea_pass_range(const avgpipe_ea_pass *p, size_t b, size_t e) {
    float *w = p->w + b, *a = p->acc + b;
    const float *z = p->z ? p->z + b : NULL, *zp = p->z_prev ? p->z_prev + b : NULL;
    switch (avgpipe__ea_flags(p)) {
#define AVGPIPE__EA_CASE(k)                                                           \
    case k:                                                                           \
        avgpipe__ea_kernel_##k(w, z, zp, a, e - b, p->alpha, p->scale, p->momentum); \
        break;
        AVGPIPE__EA_KERNELS(AVGPIPE__EA_CASE)
#undef AVGPIPE__EA_CASE
    default:
        AVGPIPE_ASSERT(0 && "unreachable averaging kernel flags");
        break;
    }
}

/* The lowest index in [b, e) whose value is NaN or +-Inf, or (size_t)-1. Tests the exponent bits, so
   it still works when the user compiles with -ffast-math (where x - x != 0 would be folded away). */
static size_t avgpipe__nonfinite_range(const float *x, size_t b, size_t e) {
    const float *AVGPIPE__RESTRICT p = x + b;
    const size_t n = e - b;
    size_t i = 0, j;
    unsigned bad = 0;
    uint32_t u;
    for (; i + AVGPIPE__EA_BLOCK <= n; i += AVGPIPE__EA_BLOCK)
        for (j = 0; j < AVGPIPE__EA_BLOCK; j++) {
            memcpy(&u, p + i + j, sizeof u);
            bad |= (u & 0x7f800000u) == 0x7f800000u;
        }
    for (; i < n; i++) {
        memcpy(&u, p + i, sizeof u);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    if (!bad) return (size_t)-1;
    for (i = 0; i < n; i++) { /* the rare path: find the first one */
        memcpy(&u, p + i, sizeof u);
        if ((u & 0x7f800000u) == 0x7f800000u) return b + i;
    }
    return (size_t)-1;
}

/* Splitting a kernel over threads: contiguous chunks, multiples of the block length (so chunks start
   on cache lines when the buffers do), one pthread each; the caller runs chunk 0. A thread that cannot
   be started has its chunk run by the caller: slower, never wrong. The split only changes which thread
   computes an element, never how: results are bit-identical for any thread count. */
typedef struct avgpipe__cpu_job {
    const avgpipe_ea_pass *pass; /* an ea_pass job, or */
    const float *x;              /* a find_nonfinite job */
    size_t begin, end, result;
} avgpipe__cpu_job;

static void avgpipe__cpu_job_run(avgpipe__cpu_job *j) {
    if (j->pass)
        avgpipe__ea_pass_range(j->pass, j->begin, j->end);
    else
        j->result = avgpipe__nonfinite_range(j->x, j->begin, j->end);
}
static void *avgpipe__cpu_thread(void *arg) {
    avgpipe__cpu_job_run((avgpipe__cpu_job *)arg);
    return NULL;
}

/* Runs the job over [0, n) on up to d->threads threads; returns the smallest job result. */
static size_t avgpipe__cpu_parallel(const avgpipe__cpu_device *d, avgpipe__cpu_job proto, size_t n) {
    avgpipe__cpu_job jobs[AVGPIPE_DEVICE_CPU_MAX_THREADS];
    pthread_t tid[AVGPIPE_DEVICE_CPU_MAX_THREADS];
    int started[AVGPIPE_DEVICE_CPU_MAX_THREADS];
    size_t t = (size_t)d->threads, chunk, best = (size_t)-1, k;
    if (t > n / d->min_per_thread) t = n / d->min_per_thread;
    if (t <= 1) {
        proto.begin = 0, proto.end = n, proto.result = (size_t)-1;
        avgpipe__cpu_job_run(&proto);
        return proto.result;
    }
    chunk = (n + t - 1) / t;
    chunk = (chunk + AVGPIPE__EA_BLOCK - 1) / AVGPIPE__EA_BLOCK * AVGPIPE__EA_BLOCK;
    for (k = 0; k < t; k++) {
        jobs[k] = proto;
        jobs[k].begin = k * chunk < n ? k * chunk : n;
        jobs[k].end = (k + 1) * chunk < n ? (k + 1) * chunk : n;
        jobs[k].result = (size_t)-1;
        started[k] = k > 0 && jobs[k].begin < jobs[k].end &&
                     pthread_create(&tid[k], NULL, avgpipe__cpu_thread, &jobs[k]) == 0;
    }
    for (k = 0; k < t; k++)
        if (!started[k] && jobs[k].begin < jobs[k].end) avgpipe__cpu_job_run(&jobs[k]);
    for (k = 0; k < t; k++) {
        if (started[k]) pthread_join(tid[k], NULL);
        if (jobs[k].result < best) best = jobs[k].result;
    }
    return best;
}

static avgpipe_result avgpipe__cpu_ea_pass(void *user, const avgpipe_ea_pass *p, avgpipe_device_stream stream) {
    avgpipe__cpu_job job;
    (void)stream;
    memset(&job, 0, sizeof job);
    job.pass = p;
    avgpipe__cpu_parallel((const avgpipe__cpu_device *)user, job, p->count);
    return AVGPIPE_OK;
}
static avgpipe_result avgpipe__cpu_find_nonfinite(void *user, const float *x, size_t count, size_t *index,
                                                  avgpipe_device_stream stream) {
    avgpipe__cpu_job job;
    size_t r;
    (void)stream;
    memset(&job, 0, sizeof job);
    job.x = x;
    r = avgpipe__cpu_parallel((const avgpipe__cpu_device *)user, job, count);
    *index = r == (size_t)-1 ? count : r;
    return AVGPIPE_OK;
}
static void avgpipe__cpu_destroy(void *user) {
    avgpipe__cpu_device *d = (avgpipe__cpu_device *)user;
    avgpipe_allocator a = d->allocator;
    a.free(d, a.user);
}

AVGPIPE_API avgpipe_result avgpipe_device_cpu_create(avgpipe_context *ctx, const avgpipe_device_cpu_desc *desc,
                                                     avgpipe_device *out) {
    avgpipe_device_cpu_desc d = avgpipe_device_cpu_query_defaults(desc);
    avgpipe__cpu_device *st;
    ctx = avgpipe__ctx(ctx);
    if (!out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_cpu_create: out is NULL");
    memset(out, 0, sizeof *out);
    if (d.threads < 1 || d.threads > AVGPIPE_DEVICE_CPU_MAX_THREADS)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_cpu_create: desc.threads is %d (1..%d, 0 = 1)",
                             d.threads, AVGPIPE_DEVICE_CPU_MAX_THREADS);
    st = (avgpipe__cpu_device *)avgpipe__calloc(ctx, 1, sizeof *st);
    if (!st) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_device_cpu_create: out of memory");
    st->allocator = ctx->desc.allocator;
    st->threads = d.threads;
    st->min_per_thread = d.min_per_thread;
    out->name = "cpu";
    out->alloc_overhead = AVGPIPE__CPU_OVERHEAD;
    out->alloc = avgpipe__cpu_alloc;
    out->free = avgpipe__cpu_free;
    out->copy = avgpipe__cpu_copy;
    out->memset = avgpipe__cpu_memset;
    out->stream_create = avgpipe__cpu_stream_create;
    out->stream_destroy = avgpipe__cpu_stream_destroy;
    out->stream_synchronize = avgpipe__cpu_stream_sync;
    out->event_create = avgpipe__cpu_event_create;
    out->event_destroy = avgpipe__cpu_event_destroy;
    out->event_record = avgpipe__cpu_event_record;
    out->stream_wait_event = avgpipe__cpu_stream_wait;
    out->event_synchronize = avgpipe__cpu_event_sync;
    out->synchronize = avgpipe__cpu_sync;
    out->ea_pass = avgpipe__cpu_ea_pass;
    out->find_nonfinite = avgpipe__cpu_find_nonfinite;
    out->error_string = avgpipe__cpu_error_string;
    out->destroy = avgpipe__cpu_destroy;
    out->user = st;
    return AVGPIPE_OK;
}

AVGPIPE_API void avgpipe_device_destroy(avgpipe_device *dev) {
    if (!dev) return;
    if (dev->destroy) dev->destroy(dev->user);
    memset(dev, 0, sizeof *dev);
}

/* The first entry a device table lacks (error_string and destroy are optional), or NULL. */
static const char *avgpipe__device_missing(const avgpipe_device *dev) {
#define AVGPIPE__DEV_NEED(f) \
    if (!dev->f) return #f;
    AVGPIPE__DEV_NEED(alloc) AVGPIPE__DEV_NEED(free) AVGPIPE__DEV_NEED(copy) AVGPIPE__DEV_NEED(memset)
    AVGPIPE__DEV_NEED(stream_create) AVGPIPE__DEV_NEED(stream_destroy) AVGPIPE__DEV_NEED(stream_synchronize)
    AVGPIPE__DEV_NEED(event_create) AVGPIPE__DEV_NEED(event_destroy) AVGPIPE__DEV_NEED(event_record)
    AVGPIPE__DEV_NEED(stream_wait_event) AVGPIPE__DEV_NEED(event_synchronize) AVGPIPE__DEV_NEED(synchronize)
    AVGPIPE__DEV_NEED(ea_pass) AVGPIPE__DEV_NEED(find_nonfinite)
#undef AVGPIPE__DEV_NEED
    return NULL;
}

AVGPIPE_API avgpipe_result avgpipe_device_check(avgpipe_context *ctx, const avgpipe_device *dev) {
    const char *missing;
    if (!dev) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_check: dev is NULL");
    if ((missing = avgpipe__device_missing(dev)) != NULL)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_check: device '%s' has no %s entry",
                             dev->name ? dev->name : "?", missing);
    return AVGPIPE_OK;
}

/* --- 8. Averaging ----------------------------------------------------------------------------- */

struct avgpipe_ea {
    avgpipe_ea_desc desc;        /* resolved; desc.device points at dev */
    avgpipe_device dev;          /* copied table (or the owned CPU device) */
    int own_device;
    avgpipe_allocator allocator; /* the creating context's: frees the struct */
    pthread_mutex_t lock;
    pthread_cond_t done;         /* broadcast when a round completes */
    int sync_ready;              /* lock and done initialised */
    avgpipe_device_event chain;         /* orders every device operation on the buffers */
    int chain_ready;
    int nbuf;                    /* 3, or 4 with momentum */
    int head;                    /* buffer roles rotate: see avgpipe__ea_buf */
    float *buf[4];
    float scale;                 /* 1/N */
    uint64_t completed;          /* rounds completed = index of the oldest open round */
    int count[2];                /* contributions so far to rounds completed and completed + 1 */
    uint64_t *next;              /* per pipeline: the round it contributes to next */
};

/* The buffers form a ring; head advances by one when a round completes. Counted back from the ring's
   end, the roles are: 1 the accumulator of the round after the oldest open one, 2 the accumulator of the
   oldest open round, 3 the reference z, 4 z_prev (momentum only). After head += 1 the accumulator (2) is
   the reference (3), z moves to z_prev (4) and the freed buffer comes round as the new accumulator (1). */
enum { AVGPIPE__EA_ACC1 = 1, AVGPIPE__EA_ACC0 = 2, AVGPIPE__EA_Z = 3, AVGPIPE__EA_ZPREV = 4 };
static float *avgpipe__ea_buf(const avgpipe_ea *ea, int role) {
    AVGPIPE_ASSERT(role >= 1 && role <= ea->nbuf);
    return ea->buf[(ea->head + ea->nbuf - role) % ea->nbuf];
}

AVGPIPE_API avgpipe_ea_desc avgpipe_ea_query_defaults(const avgpipe_ea_desc *desc) {
    avgpipe_ea_desc d;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if (d.mode == AVGPIPE_EA_MODE_DEFAULT) d.mode = AVGPIPE_EA_MEAN;
    if (d.alpha == 0.0f && !d.zero_alpha) d.alpha = 0.1f;
    return d;
}

/* Validation shared by create and the memory query. */
static avgpipe_result avgpipe__ea_validate(avgpipe_context *ctx, const char *fn, const avgpipe_ea_desc *d,
                                           int need_initial) {
    if (d->count == 0)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.count is 0 (P, the floats of the stage "
                             "partition, must be > 0)", fn, d->stage);
    if (d->count > ((size_t)-1 - AVGPIPE__CPU_OVERHEAD) / (4 * sizeof(float)))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.count %zu is too large", fn, d->stage,
                             d->count);
    if (d->pipes < 1 || d->pipes > (1 << 24))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.pipes is %d (N, the parallel models, "
                             "must be >= 1)", fn, d->stage, d->pipes);
    if (d->mode != AVGPIPE_EA_MEAN && d->mode != AVGPIPE_EA_ELASTIC)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.mode %d is not an avgpipe_ea_mode", fn,
                             d->stage, (int)d->mode);
    if (!(d->alpha >= 0.0f && d->alpha <= 1.0f))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.alpha %g is outside [0, 1]", fn, d->stage,
                             (double)d->alpha);
    if (d->zero_alpha && d->alpha != 0.0f)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.zero_alpha is set but desc.alpha is %g",
                             fn, d->stage, (double)d->alpha);
    if (!(d->momentum >= 0.0f && d->momentum < 1.0f))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.momentum %g is outside [0, 1)", fn,
                             d->stage, (double)d->momentum);
    if (d->momentum != 0.0f && d->mode != AVGPIPE_EA_ELASTIC)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.momentum applies to AVGPIPE_EA_ELASTIC "
                             "only", fn, d->stage);
    if (need_initial && !d->initial)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.initial is NULL (the starting reference "
                             "z0, P floats in device memory)", fn, d->stage);
    if (d->device && avgpipe__device_missing(d->device))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.device: device '%s' has no %s entry", fn,
                             d->stage, d->device->name ? d->device->name : "?", avgpipe__device_missing(d->device));
    return AVGPIPE_OK;
}

static size_t avgpipe__ea_host_size(int pipes) {
    size_t head = (sizeof(avgpipe_ea) + sizeof(uint64_t) - 1) / sizeof(uint64_t) * sizeof(uint64_t);
    return head + (size_t)pipes * sizeof(uint64_t);
}

AVGPIPE_API avgpipe_result avgpipe_ea_memory_bytes(avgpipe_context *ctx, const avgpipe_ea_desc *desc,
                                                   avgpipe_ea_memory_info *out) {
    avgpipe_ea_desc d;
    avgpipe_result r;
    ctx = avgpipe__ctx(ctx);
    if (!desc || !out)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_memory_bytes: %s is NULL", desc ? "out" : "desc");
    memset(out, 0, sizeof *out);
    d = avgpipe_ea_query_defaults(desc);
    if ((r = avgpipe__ea_validate(ctx, "avgpipe_ea_memory_bytes", &d, 0)) != AVGPIPE_OK) return r;
    out->buffers = d.momentum != 0.0f ? 4 : 3;
    out->device_bytes = (size_t)out->buffers *
                        (d.count * sizeof(float) + (d.device ? d.device->alloc_overhead : AVGPIPE__CPU_OVERHEAD));
    out->host_bytes = avgpipe__ea_host_size(d.pipes) + (d.device ? 0 : sizeof(avgpipe__cpu_device));
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__ea_backend_fail(avgpipe_context *ctx, const avgpipe_ea *ea, const char *fn,
                                               const char *entry, avgpipe_result r) {
    const char *msg = ea->dev.error_string ? ea->dev.error_string(ea->dev.user) : "";
    return avgpipe__fail(ctx, r == AVGPIPE_OUT_OF_MEMORY ? r : AVGPIPE_BACKEND_ERROR,
                         "%s: stage %d: device '%s': %s failed: %s%s%s", fn, ea->desc.stage,
                         ea->dev.name ? ea->dev.name : "?", entry, avgpipe_result_string(r), msg && *msg ? ": " : "",
                         msg ? msg : "");
}

AVGPIPE_API void avgpipe_ea_destroy(avgpipe_ea *ea) {
    int k;
    avgpipe_allocator a;
    if (!ea) return;
    if (ea->chain_ready) ea->dev.event_synchronize(ea->dev.user, ea->chain);
    for (k = 0; k < 4; k++)
        if (ea->buf[k]) ea->dev.free(ea->dev.user, ea->buf[k]);
    if (ea->chain_ready) ea->dev.event_destroy(ea->dev.user, ea->chain);
    if (ea->sync_ready) {
        pthread_cond_destroy(&ea->done);
        pthread_mutex_destroy(&ea->lock);
    }
    if (ea->own_device) avgpipe_device_destroy(&ea->dev);
    a = ea->allocator;
    a.free(ea, a.user);
}

/* Allocate the buffers and copy z0 (and z_prev = z0): the device part of create. */
static avgpipe_result avgpipe__ea_init_device(avgpipe_context *ctx, avgpipe_ea *ea) {
    const char *fn = "avgpipe_ea_create";
    const size_t bytes = ea->desc.count * sizeof(float);
    avgpipe_result r;
    void *p;
    int k;
    if ((r = ea->dev.event_create(ea->dev.user, &ea->chain)) != AVGPIPE_OK)
        return avgpipe__ea_backend_fail(ctx, ea, fn, "event_create", r);
    ea->chain_ready = 1;
    for (k = 0; k < ea->nbuf; k++) {
        if ((r = ea->dev.alloc(ea->dev.user, bytes, &p)) != AVGPIPE_OK)
            return avgpipe__ea_backend_fail(ctx, ea, fn, "alloc", r);
        ea->buf[k] = (float *)p;
    }
    r = ea->dev.copy(ea->dev.user, avgpipe__ea_buf(ea, AVGPIPE__EA_Z), ea->desc.initial, bytes, AVGPIPE_DEVICE_COPY_D2D, NULL);
    if (r == AVGPIPE_OK && ea->nbuf == 4)
        r = ea->dev.copy(ea->dev.user, avgpipe__ea_buf(ea, AVGPIPE__EA_ZPREV), ea->desc.initial, bytes,
                         AVGPIPE_DEVICE_COPY_D2D, NULL);
    if (r != AVGPIPE_OK) return avgpipe__ea_backend_fail(ctx, ea, fn, "copy", r);
    if ((r = ea->dev.event_record(ea->dev.user, ea->chain, NULL)) != AVGPIPE_OK)
        return avgpipe__ea_backend_fail(ctx, ea, fn, "event_record", r);
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_ea_create(avgpipe_context *ctx, const avgpipe_ea_desc *desc, avgpipe_ea **out) {
    avgpipe_ea_desc d;
    avgpipe_ea *ea;
    avgpipe_result r;
    ctx = avgpipe__ctx(ctx);
    if (!out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_create: out is NULL");
    *out = NULL;
    if (!desc) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_create: desc is NULL");
    d = avgpipe_ea_query_defaults(desc);
    if ((r = avgpipe__ea_validate(ctx, "avgpipe_ea_create", &d, 1)) != AVGPIPE_OK) return r;
    ea = (avgpipe_ea *)avgpipe__calloc(ctx, 1, avgpipe__ea_host_size(d.pipes));
    if (!ea) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_ea_create: stage %d: out of memory", d.stage);
    ea->allocator = ctx->desc.allocator;
    ea->next = (uint64_t *)((unsigned char *)ea + avgpipe__ea_host_size(0));
    ea->nbuf = d.momentum != 0.0f ? 4 : 3;
    ea->scale = 1.0f / (float)d.pipes;
    if (d.device) {
        ea->dev = *d.device;
    } else if ((r = avgpipe_device_cpu_create(ctx, NULL, &ea->dev)) != AVGPIPE_OK) {
        avgpipe_ea_destroy(ea);
        return r;
    } else {
        ea->own_device = 1;
    }
    d.device = &ea->dev;
    ea->desc = d;
    if (pthread_mutex_init(&ea->lock, NULL) != 0) {
        avgpipe_ea_destroy(ea);
        return avgpipe__fail(ctx, AVGPIPE_BACKEND_ERROR, "avgpipe_ea_create: pthread_mutex_init failed");
    }
    if (pthread_cond_init(&ea->done, NULL) != 0) {
        pthread_mutex_destroy(&ea->lock);
        avgpipe_ea_destroy(ea);
        return avgpipe__fail(ctx, AVGPIPE_BACKEND_ERROR, "avgpipe_ea_create: pthread_cond_init failed");
    }
    ea->sync_ready = 1;
    if ((r = avgpipe__ea_init_device(ctx, ea)) != AVGPIPE_OK) {
        avgpipe_ea_destroy(ea);
        return r;
    }
    *out = ea;
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_ea_desc avgpipe_ea_query_desc(const avgpipe_ea *ea) {
    avgpipe_ea_desc d;
    if (ea) return ea->desc;
    memset(&d, 0, sizeof d);
    return d;
}

/* Round admission, under the lock: which open round (slot 0 = oldest, 1 = the next) `round` is for. */
static avgpipe_result avgpipe__ea_admit(avgpipe_context *ctx, const avgpipe_ea *ea, int pipe, uint64_t round,
                                        int *slot) {
    const uint64_t next = ea->next[pipe];
    if (round < next)
        return avgpipe__fail(ctx, AVGPIPE_STATE_ERROR, "avgpipe_ea_contribute: pipeline %d, stage %d: already "
                             "contributed to round %llu (its next round is %llu)", pipe, ea->desc.stage,
                             (unsigned long long)round, (unsigned long long)next);
    if (round > next)
        return avgpipe__fail(ctx, AVGPIPE_STATE_ERROR, "avgpipe_ea_contribute: pipeline %d, stage %d: round %llu "
                             "skips round %llu (every pipeline contributes to every round, in order)", pipe,
                             ea->desc.stage, (unsigned long long)round, (unsigned long long)next);
    if (round > ea->completed + 1)
        return avgpipe__fail(ctx, AVGPIPE_STATE_ERROR, "avgpipe_ea_contribute: pipeline %d, stage %d: round %llu is "
                             "too far ahead: round %llu is still open (%d of %d contributed) and at most one round "
                             "may run ahead of it; call avgpipe_ea_wait(round %llu) first", pipe, ea->desc.stage,
                             (unsigned long long)round, (unsigned long long)ea->completed, ea->count[0],
                             ea->desc.pipes, (unsigned long long)ea->completed);
    *slot = (int)(round - ea->completed);
    return AVGPIPE_OK;
}

/* Under the lock: enqueue the pass of pipeline `pipe` into open round `slot`, then do the bookkeeping. */
static avgpipe_result avgpipe__ea_pass_locked(avgpipe_context *ctx, avgpipe_ea *ea, int pipe, int slot, float *w,
                                              avgpipe_device_stream stream) {
    const char *fn = "avgpipe_ea_contribute";
    avgpipe_ea_pass p;
    avgpipe_result r;
    memset(&p, 0, sizeof p);
    p.w = w;
    p.z = avgpipe__ea_buf(ea, AVGPIPE__EA_Z);
    p.z_prev = ea->nbuf == 4 ? avgpipe__ea_buf(ea, AVGPIPE__EA_ZPREV) : NULL;
    p.acc = avgpipe__ea_buf(ea, slot == 0 ? AVGPIPE__EA_ACC0 : AVGPIPE__EA_ACC1);
    p.count = ea->desc.count;
    p.mode = ea->desc.mode;
    p.alpha = ea->desc.alpha;
    p.scale = ea->scale;
    p.momentum = ea->desc.momentum;
    p.first = ea->count[slot] == 0;
    /* Only the oldest open round can fill up: the next round's contributors are a subset of this one's. */
    p.last = slot == 0 && ea->count[0] == ea->desc.pipes - 1;
    if ((r = ea->dev.stream_wait_event(ea->dev.user, stream, ea->chain)) != AVGPIPE_OK)
        return avgpipe__ea_backend_fail(ctx, ea, fn, "stream_wait_event", r);
    if ((r = ea->dev.ea_pass(ea->dev.user, &p, stream)) != AVGPIPE_OK)
        return avgpipe__ea_backend_fail(ctx, ea, fn, "ea_pass", r);
    if ((r = ea->dev.event_record(ea->dev.user, ea->chain, stream)) != AVGPIPE_OK)
        return avgpipe__ea_backend_fail(ctx, ea, fn, "event_record", r);
    ea->count[slot]++;
    ea->next[pipe]++;
    if (p.last) { /* the accumulator is now the reference: rotate the roles */
        ea->head = (ea->head + 1) % ea->nbuf;
        ea->completed++;
        ea->count[0] = ea->count[1];
        ea->count[1] = 0;
        pthread_cond_broadcast(&ea->done);
        avgpipe__log(ctx, AVGPIPE_LOG_DEBUG, "avgpipe_ea: stage %d: round %llu complete", ea->desc.stage,
                     (unsigned long long)(ea->completed - 1));
    }
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__ea_check_pipe(avgpipe_context *ctx, const char *fn, const avgpipe_ea *ea, int pipe,
                                             const void *w, const char *wname) {
    if (!ea) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: ea is NULL", fn);
    if (pipe < 0 || pipe >= ea->desc.pipes)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: pipe %d is outside [0, %d)", fn, ea->desc.stage,
                             pipe, ea->desc.pipes);
    if (!w)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: pipeline %d, stage %d: %s is NULL", fn, pipe,
                             ea->desc.stage, wname);
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_ea_contribute(avgpipe_context *ctx, avgpipe_ea *ea, int pipe, uint64_t round,
                                                 float *w, avgpipe_device_stream stream) {
    avgpipe_result r;
    size_t bad = 0;
    int slot;
    float v = 0.0f;
    ctx = avgpipe__ctx(ctx);
    if ((r = avgpipe__ea_check_pipe(ctx, "avgpipe_ea_contribute", ea, pipe, w, "w")) != AVGPIPE_OK) return r;
    /* State errors first (they are the caller's bug, whatever w holds); admission is decided again below,
       since other pipelines may complete a round meanwhile. */
    pthread_mutex_lock(&ea->lock);
    r = avgpipe__ea_admit(ctx, ea, pipe, round, &slot);
    pthread_mutex_unlock(&ea->lock);
    if (r != AVGPIPE_OK) return r;
    if (!ea->desc.no_finite_check) { /* outside the lock: it reads only this pipeline's w */
        if ((r = ea->dev.find_nonfinite(ea->dev.user, w, ea->desc.count, &bad, stream)) != AVGPIPE_OK)
            return avgpipe__ea_backend_fail(ctx, ea, "avgpipe_ea_contribute", "find_nonfinite", r);
        if (bad < ea->desc.count) {
            ea->dev.copy(ea->dev.user, &v, w + bad, sizeof v, AVGPIPE_DEVICE_COPY_D2H, stream);
            ea->dev.stream_synchronize(ea->dev.user, stream);
            return avgpipe__fail(ctx, AVGPIPE_NON_FINITE, "avgpipe_ea_contribute: pipeline %d, stage %d, round %llu: "
                                 "w[%zu] = %g is not finite; contribution refused (the reference, the accumulator "
                                 "and w are unchanged); re-seed the model with avgpipe_ea_reset_from_reference and "
                                 "contribute again", pipe, ea->desc.stage, (unsigned long long)round, bad, (double)v);
        }
    }
    pthread_mutex_lock(&ea->lock);
    r = avgpipe__ea_admit(ctx, ea, pipe, round, &slot);
    if (r == AVGPIPE_OK) r = avgpipe__ea_pass_locked(ctx, ea, pipe, slot, w, stream);
    pthread_mutex_unlock(&ea->lock);
    return r;
}

/* Names of the pipelines that have not contributed to the oldest open round, for messages. */
static void avgpipe__ea_missing(const avgpipe_ea *ea, char *s, size_t cap) {
    size_t len = 0;
    int i, n;
    s[0] = 0;
    for (i = 0; i < ea->desc.pipes && len + 16 < cap; i++)
        if (ea->next[i] == ea->completed) {
            n = snprintf(s + len, cap - len, "%s%d", len ? " " : "", i);
            if (n > 0) len += (size_t)n;
        }
    if (i < ea->desc.pipes) snprintf(s + len, cap - len, " ...");
}

AVGPIPE_API avgpipe_result avgpipe_ea_wait(avgpipe_context *ctx, avgpipe_ea *ea, uint64_t round, int64_t timeout_ms) {
    struct timespec until;
    avgpipe_result r = AVGPIPE_OK;
    char missing[256];
    int timed_out = 0;
    ctx = avgpipe__ctx(ctx);
    if (!ea) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_wait: ea is NULL");
    if (timeout_ms < 0)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_wait: stage %d: timeout_ms is %lld (must be >= 0)",
                             ea->desc.stage, (long long)timeout_ms);
    timespec_get(&until, TIME_UTC);
    until.tv_sec += (time_t)(timeout_ms / 1000);
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&ea->lock);
    while (ea->completed <= round && !timed_out)
        timed_out = timeout_ms == 0 || pthread_cond_timedwait(&ea->done, &ea->lock, &until) != 0;
    if (ea->completed <= round) {
        avgpipe__ea_missing(ea, missing, sizeof missing);
        r = avgpipe__fail(ctx, AVGPIPE_TIMEOUT, "avgpipe_ea_wait: stage %d: round %llu not complete after %lld ms: "
                          "round %llu has %d of %d contributions (missing pipelines: %s)", ea->desc.stage,
                          (unsigned long long)round, (long long)timeout_ms, (unsigned long long)ea->completed,
                          ea->count[0], ea->desc.pipes, missing);
    }
    pthread_mutex_unlock(&ea->lock);
    if (r == AVGPIPE_OK && (r = ea->dev.event_synchronize(ea->dev.user, ea->chain)) != AVGPIPE_OK)
        return avgpipe__ea_backend_fail(ctx, ea, "avgpipe_ea_wait", "event_synchronize", r);
    return r;
}

/* Under the lock: copy the reference out, ordered after all earlier averaging work on `stream`. */
static avgpipe_result avgpipe__ea_copy_out(avgpipe_context *ctx, avgpipe_ea *ea, const char *fn, void *dst,
                                           avgpipe_device_copy_kind kind, uint64_t *version, avgpipe_device_stream stream) {
    avgpipe_result r;
    pthread_mutex_lock(&ea->lock);
    if (version) *version = ea->completed;
    r = ea->dev.stream_wait_event(ea->dev.user, stream, ea->chain);
    if (r == AVGPIPE_OK)
        r = ea->dev.copy(ea->dev.user, dst, avgpipe__ea_buf(ea, AVGPIPE__EA_Z), ea->desc.count * sizeof(float), kind,
                         stream);
    /* later passes wait for this copy: the buffer it reads may become an accumulator */
    if (r == AVGPIPE_OK) r = ea->dev.event_record(ea->dev.user, ea->chain, stream);
    if (r != AVGPIPE_OK) r = avgpipe__ea_backend_fail(ctx, ea, fn, "copy", r);
    pthread_mutex_unlock(&ea->lock);
    return r;
}

AVGPIPE_API avgpipe_result avgpipe_ea_reset_from_reference(avgpipe_context *ctx, avgpipe_ea *ea, int pipe, float *w,
                                                           avgpipe_device_stream stream) {
    avgpipe_result r;
    ctx = avgpipe__ctx(ctx);
    if ((r = avgpipe__ea_check_pipe(ctx, "avgpipe_ea_reset_from_reference", ea, pipe, w, "w")) != AVGPIPE_OK)
        return r;
    return avgpipe__ea_copy_out(ctx, ea, "avgpipe_ea_reset_from_reference", w, AVGPIPE_DEVICE_COPY_D2D, NULL, stream);
}

AVGPIPE_API avgpipe_result avgpipe_ea_copy_reference(avgpipe_context *ctx, avgpipe_ea *ea, void *dst,
                                                     avgpipe_device_copy_kind kind, uint64_t *version,
                                                     avgpipe_device_stream stream) {
    ctx = avgpipe__ctx(ctx);
    if (!ea) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_copy_reference: ea is NULL");
    if (!dst)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_copy_reference: stage %d: dst is NULL",
                             ea->desc.stage);
    if (kind != AVGPIPE_DEVICE_COPY_D2D && kind != AVGPIPE_DEVICE_COPY_D2H)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_copy_reference: stage %d: kind %d is not "
                             "AVGPIPE_DEVICE_COPY_D2D or AVGPIPE_DEVICE_COPY_D2H", ea->desc.stage, (int)kind);
    return avgpipe__ea_copy_out(ctx, ea, "avgpipe_ea_copy_reference", dst, kind, version, stream);
}

AVGPIPE_API const float *avgpipe_ea_reference(avgpipe_ea *ea, uint64_t *version) {
    const float *z;
    if (!ea) return NULL;
    pthread_mutex_lock(&ea->lock);
    z = avgpipe__ea_buf(ea, AVGPIPE__EA_Z);
    if (version) *version = ea->completed;
    pthread_mutex_unlock(&ea->lock);
    return z;
}

AVGPIPE_API uint64_t avgpipe_ea_rounds_completed(avgpipe_ea *ea) {
    uint64_t c;
    if (!ea) return 0;
    pthread_mutex_lock(&ea->lock);
    c = ea->completed;
    pthread_mutex_unlock(&ea->lock);
    return c;
}
/* @@EA_IMPL_END@@ */

#ifdef __cplusplus
} /* extern "C" */
#endif
#endif /* AVGPIPE_IMPLEMENTATION && !AVGPIPE_EA_WIP_IMPL_INCLUDED */
