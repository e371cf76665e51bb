/* avgpipe.h — pipeline-parallel DNN training with elastic averaging over parallel pipelines.
   Header-only C11. Version 0.1.0. License: MIT (see the end of this file).

   WHAT IT IS
   ----------
   A C trainer describes its model as S stage partitions and gets, from this one header:
     - schedules for N parallel pipelines that share the same S ranks: all-forward-all-backward (GPipe),
       1F1B, AvgPipe's advance forward (K extra warm-up forwards), interleaved 1F1B (V chunks per rank)
       and zero-bubble ZB-H1 (backward split into I and W), in synchronous or continuous rounds;
     - a validator (every invariant of a correct schedule, plus a deadlock replay under asynchronous
       and blocking sends), a timed discrete-event simulator, and timelines (ASCII, Chrome trace, SVG);
     - text import/export compatible with PyTorch's torch.distributed.pipelining CSV schedules.
   The method follows "Elastic Averaging for Efficient Pipelined DNN Training" (AvgPipe, PPoPP 2023).

   QUICK START
   -----------
       #define AVGPIPE_IMPLEMENTATION          // in exactly one .c file
       #include "avgpipe.h"

       avgpipe_sched_desc d = {0};             // zero fields mean "the documented default"
       d.kind = AVGPIPE_SCHED_ADVANCE;
       d.stages = 4; d.micro = 8; d.pipes = 2; d.advance = 2;
       avgpipe_schedule s;
       if (avgpipe_sched_generate(NULL, &d, &s) != AVGPIPE_OK) {
           fprintf(stderr, "%s\n", avgpipe_last_error(NULL));
           return 1;
       }
       avgpipe_sim_desc sd = {0};              // F = 1, B = 2, I = W = 1, free transfers
       avgpipe_sim_result r;
       avgpipe_sim_run(NULL, &s, &sd, &r);
       printf("makespan %.1f bubble %.3f\n", r.makespan, r.bubble);
       avgpipe_sim_result_free(NULL, &r);
       avgpipe_sched_free(NULL, &s);

   CONFIGURATION MACROS (define before including)
   ------------------------------------------
     AVGPIPE_IMPLEMENTATION   compile the implementation into this translation unit (once per program).
     AVGPIPE_STATIC           make every function static (private copy per translation unit).
     AVGPIPE_ASSERT(c)        internal assertions; default assert() from <assert.h>.
     AVGPIPE_MALLOC/REALLOC/FREE  default allocator when none is given in avgpipe_context_desc.
     AVGPIPE_NO_STDIO         leave out the functions that take FILE* or paths.

   ERRORS
   ------
   Every fallible call returns an avgpipe_result (0 = AVGPIPE_OK, negative = error); avgpipe_result_string()
   names it. The detail (which field, which rank, which op) goes to the context's last-error buffer:
   avgpipe_last_error(ctx). A NULL context is allowed everywhere: the library then uses the default
   allocator and a per-thread error buffer. The library never calls exit() or abort() and never prints
   unless a logger was installed.

   THREAD-SAFETY
   -------------
   A context may be used by one thread at a time. Schedules and simulation results are plain data:
   read them from any number of threads; functions that write one need exclusive access to it.

   CONTENTS
   --------
     1. Basics          avgpipe_result, avgpipe_context (allocator, logger, last error), avgpipe_buf
     2. Schedule IR     avgpipe_op, avgpipe_schedule, text import/export          (avgpipe_sched_*)
     3. Generators      AFAB, 1F1B, advance, interleaved, ZB-H1, greedy, lowering (avgpipe_sched_*)
     4. Validation      invariants and deadlock replay                              (avgpipe_sched_validate)
     5. Simulation      timed discrete-event simulator                              (avgpipe_sim_*)
     6. Rendering       ASCII timeline, Chrome trace JSON, SVG                      (avgpipe_render_*)
*/
#ifndef AVGPIPE_H
#define AVGPIPE_H

#include <stddef.h>
#include <stdint.h>
#ifndef AVGPIPE_NO_STDIO
#include <stdio.h>
#endif

#define AVGPIPE_VERSION_MAJOR 0
#define AVGPIPE_VERSION_MINOR 1
#define AVGPIPE_VERSION_PATCH 0
#define AVGPIPE_VERSION_STRING "0.1.0"

#ifndef AVGPIPE_API
#ifdef AVGPIPE_STATIC
#define AVGPIPE_API static
#else
#define AVGPIPE_API extern
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ============================================================================================ */
/* 1. Basics                                                                                     */
/* ============================================================================================ */

/* One list, expanded into the enum and into avgpipe_result_string(). */
#define AVGPIPE_RESULT_LIST(X)                                                   \
    X(AVGPIPE_OK, 0, "ok")                                                       \
    X(AVGPIPE_INVALID_ARG, -1, "invalid argument")                               \
    X(AVGPIPE_OUT_OF_MEMORY, -2, "out of memory")                                \
    X(AVGPIPE_INVALID_SCHEDULE, -3, "invalid schedule")                          \
    X(AVGPIPE_DEADLOCK, -4, "deadlock")                                          \
    X(AVGPIPE_PARSE_ERROR, -5, "parse error")                                    \
    X(AVGPIPE_IO_ERROR, -6, "i/o error")                                         \
    X(AVGPIPE_TIMEOUT, -7, "timeout")                                            \
    X(AVGPIPE_NON_FINITE, -8, "non-finite value")                                \
    X(AVGPIPE_BACKEND_ERROR, -9, "backend error")                                \
    X(AVGPIPE_CALLBACK_ERROR, -10, "user callback failed")                       \
    X(AVGPIPE_ABORTED, -11, "aborted")                                           \
    X(AVGPIPE_UNSUPPORTED, -12, "unsupported")                                   \
    X(AVGPIPE_STATE_ERROR, -13, "call not valid in this state")

typedef enum avgpipe_result {
#define AVGPIPE__RESULT_ENUM(name, value, text) name = value,
    AVGPIPE_RESULT_LIST(AVGPIPE__RESULT_ENUM)
#undef AVGPIPE__RESULT_ENUM
    AVGPIPE_RESULT_MIN_ = -13
} avgpipe_result;

/* A short English name of a result code ("invalid argument"); never NULL. Thread-safe. */
AVGPIPE_API const char *avgpipe_result_string(avgpipe_result r);

typedef enum avgpipe_log_level {
    AVGPIPE_LOG_ERROR = 1,
    AVGPIPE_LOG_WARN = 2,
    AVGPIPE_LOG_INFO = 3,
    AVGPIPE_LOG_DEBUG = 4
} avgpipe_log_level;

/* Allocation hooks. alloc(size, user) returns NULL on failure; free(NULL, user) must be harmless. */
typedef struct avgpipe_allocator {
    void *(*alloc)(size_t size, void *user);
    void (*free)(void *ptr, void *user);
    void *user;
} avgpipe_allocator;

/* Logger hook: called with a complete message line (no trailing newline). */
typedef void (*avgpipe_log_fn)(avgpipe_log_level level, const char *msg, void *user);

/* Context description. Zero-initialise; zero fields mean:
     allocator  both NULL -> AVGPIPE_MALLOC / AVGPIPE_FREE (malloc/free)
     log        NULL      -> nothing is ever printed
     log_level  0         -> AVGPIPE_LOG_WARN                                                  */
typedef struct avgpipe_context_desc {
    avgpipe_allocator allocator;
    avgpipe_log_fn log;
    void *log_user;
    avgpipe_log_level log_level;
} avgpipe_context_desc;

#define AVGPIPE_ERROR_MAX 1024

/* A context: resolved hooks and the last-error buffer. Plain data the user owns (stack or heap);
   initialise with avgpipe_context_init(), nothing to free. */
typedef struct avgpipe_context {
    avgpipe_context_desc desc; /* resolved: every field set */
    avgpipe_result last_result;
    char error[AVGPIPE_ERROR_MAX];
} avgpipe_context;

/* Resolve desc's defaults into *ctx. desc may be NULL (all defaults). Returns AVGPIPE_INVALID_ARG if
   exactly one of allocator.alloc / allocator.free is set. */
AVGPIPE_API avgpipe_result avgpipe_context_init(avgpipe_context *ctx, const avgpipe_context_desc *desc);
/* The resolved description (what a zero field became). ctx may be NULL: the defaults. */
AVGPIPE_API avgpipe_context_desc avgpipe_context_query(const avgpipe_context *ctx);
/* The detail of the last failed call on ctx ("" if none). ctx NULL: this thread's buffer. */
AVGPIPE_API const char *avgpipe_last_error(const avgpipe_context *ctx);
/* The result code of the last failed call on ctx (AVGPIPE_OK if none). */
AVGPIPE_API avgpipe_result avgpipe_last_result(const avgpipe_context *ctx);
/* Forget the last error. */
AVGPIPE_API void avgpipe_clear_error(avgpipe_context *ctx);
/* Memory through the context's allocator (ctx may be NULL). avgpipe_free(ctx, NULL) is harmless. */
AVGPIPE_API void *avgpipe_alloc(avgpipe_context *ctx, size_t size);
AVGPIPE_API void avgpipe_free(avgpipe_context *ctx, void *ptr);

/* A growable text buffer (renderers and exporters write into one). data is NUL-terminated.
   Zero-initialise; release with avgpipe_buf_free(). */
typedef struct avgpipe_buf {
    char *data;
    size_t len, cap;
} avgpipe_buf;
AVGPIPE_API void avgpipe_buf_free(avgpipe_context *ctx, avgpipe_buf *b);

/*@@SECTIONS_DECL@@*/

#ifdef __cplusplus
} /* extern "C" */
#endif
#endif /* AVGPIPE_H */

/* ============================================================================================ */
/* Implementation                                                                                */
/* ============================================================================================ */
#if defined(AVGPIPE_IMPLEMENTATION) && !defined(AVGPIPE_IMPLEMENTATION_INCLUDED)
#define AVGPIPE_IMPLEMENTATION_INCLUDED

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <limits.h>

#ifndef AVGPIPE_ASSERT
#include <assert.h>
#define AVGPIPE_ASSERT(c) assert(c)
#endif
#ifndef AVGPIPE_MALLOC
#define AVGPIPE_MALLOC(sz) malloc(sz)
#define AVGPIPE_FREE(p) free(p)
#endif

#if defined(__cplusplus)
#define AVGPIPE__THREAD_LOCAL thread_local
#elif defined(_MSC_VER)
#define AVGPIPE__THREAD_LOCAL __declspec(thread)
#else
#define AVGPIPE__THREAD_LOCAL _Thread_local
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* --- 1. Basics -------------------------------------------------------------------------------- */

AVGPIPE_API const char *avgpipe_result_string(avgpipe_result r) {
    switch (r) {
#define AVGPIPE__RESULT_CASE(name, value, text) \
    case name:                                  \
        return text;
        AVGPIPE_RESULT_LIST(AVGPIPE__RESULT_CASE)
#undef AVGPIPE__RESULT_CASE
    default:
        return "unknown result";
    }
}

static void *avgpipe__default_alloc(size_t size, void *user) {
    (void)user;
    return AVGPIPE_MALLOC(size);
}
static void avgpipe__default_free(void *ptr, void *user) {
    (void)user;
    AVGPIPE_FREE(ptr);
}

/* The context used when the caller passes NULL: default hooks, one error buffer per thread. */
static AVGPIPE__THREAD_LOCAL avgpipe_context avgpipe__tls_ctx;
static AVGPIPE__THREAD_LOCAL int avgpipe__tls_ready;

static avgpipe_context *avgpipe__ctx(avgpipe_context *ctx) {
    if (ctx) return ctx;
    if (!avgpipe__tls_ready) {
        avgpipe_context_init(&avgpipe__tls_ctx, NULL);
        avgpipe__tls_ready = 1;
    }
    return &avgpipe__tls_ctx;
}

AVGPIPE_API avgpipe_context_desc avgpipe_context_query(const avgpipe_context *ctx) {
    avgpipe_context_desc d;
    if (ctx) return ctx->desc;
    memset(&d, 0, sizeof d);
    d.allocator.alloc = avgpipe__default_alloc;
    d.allocator.free = avgpipe__default_free;
    d.log_level = AVGPIPE_LOG_WARN;
    return d;
}

AVGPIPE_API avgpipe_result avgpipe_context_init(avgpipe_context *ctx, const avgpipe_context_desc *desc) {
    if (!ctx) return AVGPIPE_INVALID_ARG;
    memset(ctx, 0, sizeof *ctx);
    ctx->desc = avgpipe_context_query(NULL);
    if (desc) {
        if ((desc->allocator.alloc == NULL) != (desc->allocator.free == NULL)) {
            snprintf(ctx->error, sizeof ctx->error,
                     "avgpipe_context_init: allocator.alloc and allocator.free must be set together");
            ctx->last_result = AVGPIPE_INVALID_ARG;
            return AVGPIPE_INVALID_ARG;
        }
        if (desc->allocator.alloc) ctx->desc.allocator = desc->allocator;
        ctx->desc.log = desc->log;
        ctx->desc.log_user = desc->log_user;
        if (desc->log_level) ctx->desc.log_level = desc->log_level;
    }
    return AVGPIPE_OK;
}

AVGPIPE_API const char *avgpipe_last_error(const avgpipe_context *ctx) {
    return ctx ? ctx->error : avgpipe__ctx(NULL)->error;
}
AVGPIPE_API avgpipe_result avgpipe_last_result(const avgpipe_context *ctx) {
    return ctx ? ctx->last_result : avgpipe__ctx(NULL)->last_result;
}
AVGPIPE_API void avgpipe_clear_error(avgpipe_context *ctx) {
    ctx = avgpipe__ctx(ctx);
    ctx->error[0] = 0;
    ctx->last_result = AVGPIPE_OK;
}

AVGPIPE_API void *avgpipe_alloc(avgpipe_context *ctx, size_t size) {
    ctx = avgpipe__ctx(ctx);
    return ctx->desc.allocator.alloc(size ? size : 1, ctx->desc.allocator.user);
}
AVGPIPE_API void avgpipe_free(avgpipe_context *ctx, void *ptr) {
    if (!ptr) return;
    ctx = avgpipe__ctx(ctx);
    ctx->desc.allocator.free(ptr, ctx->desc.allocator.user);
}

static void avgpipe__log(avgpipe_context *ctx, avgpipe_log_level lvl, const char *fmt, ...) {
    char msg[AVGPIPE_ERROR_MAX];
    va_list ap;
    ctx = avgpipe__ctx(ctx);
    if (!ctx->desc.log || lvl > ctx->desc.log_level) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ctx->desc.log(lvl, msg, ctx->desc.log_user);
}

/* Record an error on ctx (the detail goes to the last-error buffer and to the logger) and return it. */
static avgpipe_result avgpipe__fail(avgpipe_context *ctx, avgpipe_result r, const char *fmt, ...) {
    va_list ap;
    ctx = avgpipe__ctx(ctx);
    va_start(ap, fmt);
    vsnprintf(ctx->error, sizeof ctx->error, fmt, ap);
    va_end(ap);
    ctx->last_result = r;
    avgpipe__log(ctx, AVGPIPE_LOG_ERROR, "%s", ctx->error);
    return r;
}

/* Overflow-checked allocation helpers: count * size, zero-filled. */
static void *avgpipe__calloc(avgpipe_context *ctx, size_t count, size_t size) {
    void *p;
    size_t bytes;
    if (size && count > (size_t)-1 / size) return NULL;
    bytes = count * size;
    p = avgpipe_alloc(ctx, bytes);
    if (p && bytes > 0) memset(p, 0, bytes);
    return p;
}
static void *avgpipe__realloc(avgpipe_context *ctx, void *old, size_t old_size, size_t new_size) {
    void *p = avgpipe_alloc(ctx, new_size);
    if (!p) return NULL;
    if (old) {
        memcpy(p, old, old_size < new_size ? old_size : new_size);
        avgpipe_free(ctx, old);
    }
    return p;
}

AVGPIPE_API void avgpipe_buf_free(avgpipe_context *ctx, avgpipe_buf *b) {
    if (!b) return;
    avgpipe_free(ctx, b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}
static int avgpipe__buf_reserve(avgpipe_context *ctx, avgpipe_buf *b, size_t extra) {
    size_t need = b->len + extra + 1, cap;
    char *p;
    if (need <= b->cap) return 1;
    cap = b->cap ? b->cap : 256;
    while (cap < need) cap *= 2;
    p = (char *)avgpipe__realloc(ctx, b->data, b->cap, cap);
    if (!p) return 0;
    b->data = p;
    b->cap = cap;
    return 1;
}
static int avgpipe__buf_put(avgpipe_context *ctx, avgpipe_buf *b, const char *s, size_t n) {
    if (!avgpipe__buf_reserve(ctx, b, n)) return 0;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = 0;
    return 1;
}
static int avgpipe__buf_printf(avgpipe_context *ctx, avgpipe_buf *b, const char *fmt, ...) {
    va_list ap;
    int n;
    char small[256];
    va_start(ap, fmt);
    n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return 0;
    if ((size_t)n < sizeof small) return avgpipe__buf_put(ctx, b, small, (size_t)n);
    if (!avgpipe__buf_reserve(ctx, b, (size_t)n)) return 0;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return 1;
}

/*@@SECTIONS_IMPL@@*/

#ifdef __cplusplus
} /* extern "C" */
#endif
#endif /* AVGPIPE_IMPLEMENTATION */

/*
------------------------------------------------------------------------------
MIT License. Copyright (c) 2026 the avgpipe authors.
Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction, including
without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is furnished to do so, subject to the
following conditions: The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY
KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A
PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR
ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
------------------------------------------------------------------------------
*/
