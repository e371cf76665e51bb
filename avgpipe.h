/* avgpipe.h — pipeline-parallel DNN training with elastic averaging over parallel pipelines.
   Header-only C11. Version 0.10.3 (CHANGELOG.md: what changed and how to port). License: MIT (see the end
   of this file).

   WHAT IT IS
   ----------
   A C trainer describes its model as S stage partitions and gets, from this one header:
     - schedules for N parallel pipelines that share the same S ranks: all-forward-all-backward (GPipe),
       1F1B, AvgPipe's advance forward (K extra warm-up forwards), interleaved 1F1B (V chunks per rank),
       zero-bubble ZB-H1 (backward split into I and W), and the V-placed ZB-V and DualPipeV (two stages
       per rank, the first and the last on rank 0; DualPipeV overlaps a forward with a backward), in
       synchronous or continuous rounds; any stage -> rank placement (loop, V, or your own map);
     - a validator (every invariant of a correct schedule, plus a deadlock replay under asynchronous
       and blocking sends), a timed discrete-event simulator, and timelines (ASCII, Chrome trace, SVG);
     - text import/export compatible with PyTorch's torch.distributed.pipelining CSV schedules;
     - elastic averaging of the N parallel models (AvgPipe's "reference keeps the average", or EASGD),
       one fused memory pass per contribution, asynchronous, behind a device backend table (CPU here);
     - a runtime that executes schedules over a comm backend table, calling your forward/backward/step
       callbacks, with per-op profiling and AvgPipe's adaptive advance forward: every rank a thread of one
       process (the in-process backend, built in), or one rank per process (MPI: avgpipe_mpi.h; your own
       backend), with replica groups averaged across machines;
     - a tuner: one profiled run -> a cost model -> every setting simulated -> a ranking under a memory
       limit.
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
     AVGPIPE_MALLOC/AVGPIPE_FREE  default allocator when none is given in avgpipe_context_desc.
     AVGPIPE_NO_STDIO         leave out the functions that take FILE* or paths.
     AVGPIPE_COMM_SPIN        pause instructions the in-process comm spins before a wait sleeps (256).
     AVGPIPE_IMPL             as AVGPIPE_IMPLEMENTATION, for this header and every companion included.

   COMPANION HEADERS
   -----------------
   Each includes after avgpipe.h of the same release (it stops with #error otherwise) and compiles its
   implementation with AVGPIPE_IMPLEMENTATION (or its own macro); each documents itself at its top:
     avgpipe_mpi.h    the comm backend over MPI: one rank per process, across machines
                      (AVGPIPE_MPI_IMPLEMENTATION; link MPI, or pkg-config avgpipe-mpi).
     avgpipe_cuda.h   the device backend over the CUDA runtime: memory, streams, events and the
                      averaging kernels of one GPU, from nvcc or from plain C with NVRTC
                      (AVGPIPE_CUDA_IMPLEMENTATION; link cudart, and nvrtc from C).
     avgpipe_nccl.h   the comm backend over NCCL: one GPU per rank, device-ordered transfers, split for
                      replica groups, bootstrap over MPI or a shared file (AVGPIPE_NCCL_IMPLEMENTATION;
                      link nccl and cudart).
     avgpipe_hwloc.h  thread placement with hwloc: each rank's threads on the cores nearest its GPU or
                      NIC (AVGPIPE_HWLOC_IMPLEMENTATION; link hwloc).
   AVGPIPE_IMPL turns on the implementation of every header included.
   Writing your own backend: a comm or device table (sections 11, 13) plus avgpipe_set_error for errors;
   examples/custom_comm.c is a complete comm backend over POSIX pipes.

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
   read them from any number of threads; functions that write one need exclusive access to it. An
   averaging module (avgpipe_ea) takes contributions from several threads at once; each function's
   comment says what it allows. A run (avgpipe_run) is driven by one thread; its callbacks run on one
   worker thread per local rank (see avgpipe_run_iteration). A comm backend is called by different
   ranks' threads at once, each rank's calls from one thread at a time.

   LINKING
   -------
   The implementation uses libm and POSIX threads: link with -lm -pthread.

   CONTENTS
   --------
   Twenty-two sections, each one subject, in dependency order: no section's implementation calls a later
   one (scripts/check_order.py checks it, and each section's size, in CI). The declarations and the
   implementation carry the same numbers.
     1. Basics          avgpipe_result, avgpipe_context (allocator, logger, last error), avgpipe_buf,
                        clocks and atomics, file reading                            (avgpipe_context_*, avgpipe_buf_*)
     2. Schedule IR     avgpipe_op, avgpipe_schedule, the schedule kinds' table, placement
                                                                                    (avgpipe_sched_*, avgpipe_op_*)
     3. Text format     PyTorch-compatible CSV/text import and export               (avgpipe_sched_import/_export)
     4. Generators      AFAB, 1F1B, advance, interleaved, ZB-H1, ZB-V, DualPipeV    (avgpipe_sched_generate)
     5. Greedy, sync    greedy list scheduler; ties and agreement    (avgpipe_sched_greedy/_add_sync)
     6. Lowering        SEND/RECV insertion; the lowered lists' buffer slots, counted without them
                                                                                    (avgpipe_sched_lower)
     7. Simulation      timed discrete-event simulator                              (avgpipe_sim_*)
     8. Validation      invariants: the static checks                               (avgpipe_sched_validate)
     9. Replay          the validator's deadlock replay and entry point
    10. Rendering       ASCII timeline, Chrome trace JSON, SVG                      (avgpipe_render_*)
    11. Device backend  function-pointer table; the CPU device and its kernels      (avgpipe_device_*)
    12. Averaging       elastic averaging of N parallel models, per stage partition (avgpipe_ea_*)
    13. Comm backend    function-pointer table (tagged p2p, split); in-process one  (avgpipe_comm_*)
    14. Buffer plan and run state   slots and their bytes; the run's structures, tags, accessors
                                                                                    (avgpipe_run_plan_*)
    15. Execution       callbacks, the run's description; waits, slots, compute and comm ops
                                                                                    (avgpipe_run_desc)
    16. Steps and sync  ties, step agreement, STEP and AVG; the worker and averaging threads
                                                          (avgpipe_grad_sumsq, avgpipe_clip_scale)
    17. Processes       control messages, the fingerprint, collectives              (avgpipe_run_gather_*)
    18. Checkpoints     save and load, atomic, checksummed                          (avgpipe_run_save/_load)
    19. Run lifecycle   create, iterate, destroy; adaptive K; the memory model      (avgpipe_run_create ...)
    20. Profiles        events, the profile's writer and reader, traces             (avgpipe_profile_*)
    21. Cost model      fitting a profile, predicting a setting                     (avgpipe_tune_fit/_predict)
    22. Search          candidates and their ranking; the stage partitioner         (avgpipe_tune_search/_plan)
*/
#ifndef AVGPIPE_H
#define AVGPIPE_H

#include <stddef.h>
#include <stdint.h>
#ifndef AVGPIPE_NO_STDIO
#include <stdio.h>
#endif

/* Semantic versioning from 0.2.0 on: CHANGELOG.md lists every change to the public API with its migration.
   The companion headers are released with this one and refuse an avgpipe.h of another version. */
#define AVGPIPE_VERSION_MAJOR 0
#define AVGPIPE_VERSION_MINOR 10
#define AVGPIPE_VERSION_PATCH 3
#define AVGPIPE_VERSION_STRING "0.10.3"
#define AVGPIPE_VERSION_NUMBER (AVGPIPE_VERSION_MAJOR * 10000 + AVGPIPE_VERSION_MINOR * 100 + AVGPIPE_VERSION_PATCH)

#ifndef AVGPIPE_API
#ifdef AVGPIPE_STATIC
#if defined(__GNUC__) || defined(__clang__)
#define AVGPIPE_API static __attribute__((unused)) /* a private copy need not use every function */
#else
#define AVGPIPE_API static
#endif
#else
#define AVGPIPE_API extern
#endif
#endif


/* Exact floating point, whatever the includer's flags (private: for this header and its companions).
   A header-only library is compiled with its user's flags, and the code that promises bits (the
   averaging pass, sums in rank order) must not change with them: with -ffp-contract=fast (GNU C's
   default, and clang's with -Ofast or -ffast-math) w - alpha*(w - z) becomes one fused multiply-add,
   and -ffast-math lets the compiler reorder a sum. Functions defined between AVGPIPE__FP_EXACT_BEGIN
   and AVGPIPE__FP_EXACT_END are compiled with contraction and fast-math off (gcc and g++: optimize
   pragmas, which nvcc hands to its host compiler; clang: float_control precise + contract off; MSVC:
   float_control precise + fp_contract off; others: the standard FP_CONTRACT pragma). Keep such
   functions calling each other, not being inlined into code outside the region.
   A program linked with -Ofast or -ffast-math also starts with flush-to-zero and denormals-are-zero
   set (gcc's crtfastmath.o), which no pragma undoes: avgpipe__fp_exact_enter() sets round to nearest
   with subnormals kept for the calling thread (x86 MXCSR, AArch64 FPCR; a no-op elsewhere) and returns
   the previous state for avgpipe__fp_exact_leave(). */
#if defined(__clang__)
#define AVGPIPE__FP_EXACT_BEGIN _Pragma("float_control(precise, on, push)") _Pragma("clang fp contract(off)")
#define AVGPIPE__FP_EXACT_END _Pragma("float_control(pop)")
#elif defined(__GNUC__) && defined(__CUDACC__) /* nvcc's front end passes them on, with a warning (1675) */
#define AVGPIPE__FP_EXACT_BEGIN                                                                          \
    _Pragma("nv_diag_suppress 1675") _Pragma("GCC push_options")                                        \
    _Pragma("GCC optimize(\"no-fast-math\", \"fp-contract=off\")")
#define AVGPIPE__FP_EXACT_END _Pragma("GCC pop_options") _Pragma("nv_diag_default 1675")
#elif defined(__GNUC__)
#define AVGPIPE__FP_EXACT_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"no-fast-math\", \"fp-contract=off\")")
#define AVGPIPE__FP_EXACT_END _Pragma("GCC pop_options")
#elif defined(_MSC_VER)
#define AVGPIPE__FP_EXACT_BEGIN __pragma(float_control(precise, on, push)) __pragma(fp_contract(off))
#define AVGPIPE__FP_EXACT_END __pragma(float_control(pop))
#else
#define AVGPIPE__FP_EXACT_BEGIN _Pragma("STDC FP_CONTRACT OFF")
#define AVGPIPE__FP_EXACT_END _Pragma("STDC FP_CONTRACT DEFAULT")
#endif
/* clang fuses a multiply and an add in its code generator whenever -ffp-contract=fast is on (-Ofast and
   -ffast-math set it), whatever the pragmas say: AVGPIPE__FP_KEEP(x) makes a product opaque to it (an
   empty asm that the value passes through), so it is rounded before the add that reads it. gcc honours
   the pragmas; there it is nothing. */
#if defined(__clang__) && (defined(__x86_64__) || defined(__i386__)) && defined(__SSE__)
#define AVGPIPE__FP_KEEP(x) __asm__("" : "+x"(x))
#elif defined(__clang__) && defined(__aarch64__)
#define AVGPIPE__FP_KEEP(x) __asm__("" : "+w"(x))
#elif defined(__clang__)
#define AVGPIPE__FP_KEEP(x) __asm__("" : "+m"(x))
#else
#define AVGPIPE__FP_KEEP(x) ((void)0)
#endif
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || (defined(__i386__) && defined(__SSE__)))
static inline uint64_t avgpipe__fp_exact_enter(void) {
    unsigned int csr, want;
    __asm__ __volatile__("stmxcsr %0" : "=m"(csr));
    want = csr & ~(0x8000u | 0x0040u | 0x6000u); /* FTZ, DAZ off; rounding to nearest */
    if (want != csr) __asm__ __volatile__("ldmxcsr %0" : : "m"(want));
    return csr;
}
static inline void avgpipe__fp_exact_leave(uint64_t saved) {
    unsigned int csr, old = (unsigned int)saved;
    __asm__ __volatile__("stmxcsr %0" : "=m"(csr));
    if (csr != old) __asm__ __volatile__("ldmxcsr %0" : : "m"(old));
}
#elif (defined(__GNUC__) || defined(__clang__)) && defined(__aarch64__)
static inline uint64_t avgpipe__fp_exact_enter(void) {
    uint64_t fpcr, want;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    want = fpcr & ~((1ull << 24) | (1ull << 19) | (3ull << 22)); /* FZ, FZ16 off; rounding to nearest */
    if (want != fpcr) __asm__ __volatile__("msr fpcr, %0" : : "r"(want));
    return fpcr;
}
static inline void avgpipe__fp_exact_leave(uint64_t saved) {
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    if (fpcr != saved) __asm__ __volatile__("msr fpcr, %0" : : "r"(saved));
}
#else
static inline uint64_t avgpipe__fp_exact_enter(void) { return 0; }
static inline void avgpipe__fp_exact_leave(uint64_t saved) { (void)saved; }
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
    X(AVGPIPE_STATE_ERROR, -13, "call not valid in this state")                  \
    X(AVGPIPE_MISMATCH, -14, "message mismatch")

typedef enum avgpipe_result {
#define AVGPIPE__RESULT_ENUM(name, value, text) name = value,
    AVGPIPE_RESULT_LIST(AVGPIPE__RESULT_ENUM)
#undef AVGPIPE__RESULT_ENUM
    AVGPIPE_RESULT_MIN_ = -14
} avgpipe_result;

/* A short English name of a result code ("invalid argument"); never NULL. Thread-safe. */
AVGPIPE_API const char *avgpipe_result_string(avgpipe_result r);
/* The version of the implementation compiled in ("0.10.3", AVGPIPE_VERSION_STRING when it was built):
   compare with the header's macros when the implementation lives in another translation unit. And the
   same as major * 10000 + minor * 100 + patch. Thread-safe. */
AVGPIPE_API const char *avgpipe_version(void);
AVGPIPE_API int avgpipe_version_number(void);

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

/* Descriptions are zero-initialised, and a zero field means "the documented default". Where a zero
   is also a meaningful value (an elasticity alpha of 0: no pull; an op that costs nothing), the field
   takes AVGPIPE_ZERO to mean exactly zero. It is the one spelling of "exactly zero" everywhere. */
#define AVGPIPE_ZERO (-1.0f)

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
/* desc with its defaults filled in, as avgpipe_context_init resolves them: no allocator -> the default
   one (AVGPIPE_MALLOC / AVGPIPE_FREE), log_level 0 -> AVGPIPE_LOG_WARN; log stays as given (NULL: no
   output). No validation (a half-set allocator is left as it is); desc may be NULL. Thread-safe. */
AVGPIPE_API avgpipe_context_desc avgpipe_context_query_defaults(const avgpipe_context_desc *desc);
/* The detail of the last failed call on ctx ("" if none). ctx NULL: this thread's buffer. */
AVGPIPE_API const char *avgpipe_last_error(const avgpipe_context *ctx);
/* The result code of the last failed call on ctx (AVGPIPE_OK if none). */
AVGPIPE_API avgpipe_result avgpipe_last_result(const avgpipe_context *ctx);
/* Forget the last error. */
AVGPIPE_API void avgpipe_clear_error(avgpipe_context *ctx);
/* Record an error on ctx (NULL: this thread's buffer) and return r: the detail goes to the last-error
   buffer and the logger, as the library's own errors do. For backends written in other headers
   (avgpipe_mpi.h, yours). */
AVGPIPE_API avgpipe_result avgpipe_set_error(avgpipe_context *ctx, avgpipe_result r, const char *fmt, ...)
#if defined(__GNUC__) || defined(__clang__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
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
/* Append n bytes (data may hold zeros; data stays NUL-terminated after them). AVGPIPE_OUT_OF_MEMORY. */
AVGPIPE_API avgpipe_result avgpipe_buf_append(avgpipe_context *ctx, avgpipe_buf *b, const void *data, size_t n);

/* ============================================================================================ */
/* 2. Schedule IR                                                                                */
/* ============================================================================================ */
/* A schedule is one op list per rank, executed in order. Stage partitions ("stages" below) are
   global: the model has G = S·V of them, and the schedule's placement says which rank holds each
   (avgpipe_placement: PyTorch's loop and V placements, or any map). Micro-batch numbers are per
   parallel pipeline and run on across rounds: micro-batch u of pipeline i belongs to round u / M,
   and is micro-batch u % M of that round's batch. */

/* Which rank holds stage partition g (S ranks, G = S·V stages). Data flows from stage g to g+1
   whatever the placement; a transfer between two stages on the same rank is a local hand-over,
   not a message. */
typedef enum avgpipe_placement {
    AVGPIPE_PLACE_AUTO = 0, /* in a description: the kind's own (V for zbv and dualpipev, else loop) */
    AVGPIPE_PLACE_LOOP,     /* stage g on rank g % S: rank r holds r, S+r, 2S+r, ... */
    AVGPIPE_PLACE_V,        /* chunk c = g / S runs down the ranks when c is even and back up when it
                               is odd: rank r holds r, 2S-1-r, 2S+r, ... (the first and the last
                               stage share rank 0 when V = 2) */
    AVGPIPE_PLACE_CUSTOM,   /* any map: avgpipe_schedule.place */
    AVGPIPE_PLACE_COUNT
} avgpipe_placement;

typedef enum avgpipe_op_kind {
    AVGPIPE_OP_IDLE = 0,    /* an empty slot (kept so imported files export unchanged) */
    AVGPIPE_OP_F,           /* forward */
    AVGPIPE_OP_B,           /* full backward (inputs and weights) */
    AVGPIPE_OP_I,           /* backward to the inputs */
    AVGPIPE_OP_W,           /* backward to the weights */
    AVGPIPE_OP_SEND_F,      /* stage g sends its forward output of a micro-batch to stage g+1 */
    AVGPIPE_OP_RECV_F,      /* stage g posts the receive of its forward input from stage g-1 */
    AVGPIPE_OP_SEND_B,      /* stage g sends its input gradient to stage g-1 */
    AVGPIPE_OP_RECV_B,      /* stage g posts the receive of its output gradient from stage g+1 */
    AVGPIPE_OP_STEP,        /* local optimizer step of one parallel model on one stage; micro = round */
    AVGPIPE_OP_AVG,         /* elastic pull + contribution to the reference; micro = round */
    AVGPIPE_OP_UNSHARD,     /* PyTorch FSDP actions: imported, exported and validated as no-ops */
    AVGPIPE_OP_RESHARD,
    AVGPIPE_OP_REDUCE_GRAD,
    /* Synchronisation before the STEPs of one (pipeline, round) (micro = round), placed by
       avgpipe_sched_add_sync, executed by the runtime on its own sub-communicator: */
    AVGPIPE_OP_TIE,         /* stage's tied gradient ranges with stage `peer` summed (both sides get a + b) */
    AVGPIPE_OP_AGREE,       /* step agreement: the stage's vector contributed, all stages' combined */
    AVGPIPE_OP_KIND_COUNT
} avgpipe_op_kind;

/* Op flags. */
#define AVGPIPE_OPF_OVERLAP_NEXT 1u /* runs together with the next op: "(a;b)OVERLAP_F_B" */

/* One op (16 bytes). micro is -1 where the kind takes none (UNSHARD, RESHARD, REDUCE_GRAD). */
typedef struct avgpipe_op {
    int32_t stage; /* global stage partition g */
    int32_t micro; /* micro-batch (per pipeline, across rounds); the round for STEP, AVG, TIE, AGREE */
    int16_t pipe;  /* parallel pipeline i */
    uint8_t kind;  /* avgpipe_op_kind */
    uint8_t flags; /* AVGPIPE_OPF_* */
    int32_t peer;  /* TIE: the stage the tie is with; 0 for every other kind */
} avgpipe_op;

typedef enum avgpipe_sched_kind {
    AVGPIPE_SCHED_CUSTOM = 0, /* imported or built by hand */
    AVGPIPE_SCHED_AFAB,       /* all forwards, then all backwards (GPipe) */
    AVGPIPE_SCHED_1F1B,       /* one forward one backward (PipeDream-flush) */
    AVGPIPE_SCHED_ADVANCE,    /* AvgPipe's advance forward propagation with K extra forwards */
    AVGPIPE_SCHED_INTERLEAVED,/* interleaved 1F1B, V chunks per rank (Megatron-LM) */
    AVGPIPE_SCHED_ZBH1,       /* zero-bubble ZB-H1: B split into I and W, W fills the bubbles */
    AVGPIPE_SCHED_ZBV,        /* zero-bubble ZB-V: two chunks per rank in a V, I/W split */
    AVGPIPE_SCHED_DUALPIPEV,  /* DualPipeV: V placement, forward of one micro-batch overlapped with
                                 the backward of another */
    AVGPIPE_SCHED_KIND_COUNT
} avgpipe_sched_kind;

/* What each schedule kind is, in one table: the resolver, the tuner, the command-line tool and the
   examples read it instead of re-deriving "V-placed, how many stages per rank". */
typedef struct avgpipe_sched_kind_info {
    avgpipe_sched_kind kind;
    const char *name;            /* as avgpipe_sched_kind_name and avgpipe_sched_kind_parse spell it */
    int generated;               /* 1: avgpipe_sched_generate makes it (all but CUSTOM) */
    int chunks;                  /* stages per rank: 1, 2 (the V kinds), or 0: any V >= 1 (interleaved; 0 -> 2) */
    avgpipe_placement placement; /* LOOP or V (AUTO for CUSTOM: the schedule's own) */
    int advance;                 /* 1: takes K, the extra warm-up forwards; 0: K is ignored (resolved to 0) */
    int split;                   /* 1: the backward runs as I and W */
    int overlapped;              /* 1: pairs a forward with a backward ((F;B)OVERLAP_F_B) */
    int tuned;                   /* 1: in the tuner's search by default (avgpipe_tune_desc.kinds = 0) */
    int micro_multiple;          /* 1: with chunks > 1, micro must be a multiple of stages */
    int micro_pipes_per_stage;   /* micro x pipes >= this x stages (DualPipeV: 2); 0: no such limit */
    const char *limits;          /* the kind's own shape limits, in words (as section 4 lists them) */
} avgpipe_sched_kind_info;

/* The table's row of `kind` (AVGPIPE_SCHED_CUSTOM included), or NULL for a value outside the enum.
   Static data: thread-safe. */
AVGPIPE_API const avgpipe_sched_kind_info *avgpipe_sched_kind_query(avgpipe_sched_kind kind);

/* A schedule's shape: what the generators take (avgpipe_sched_generate, section 4), what a schedule
   keeps (avgpipe_schedule.shape) and writes to its text header, and what a profile records. One type
   for all of them. Zero fields mean the defaults avgpipe_sched_resolve documents. */
typedef struct avgpipe_sched_desc {
    avgpipe_sched_kind kind;
    int stages;     /* S: ranks of one pipeline group */
    int micro;      /* M: micro-batches per batch */
    int pipes;      /* N: parallel pipelines */
    int chunks;     /* V: stage partitions per rank */
    int rounds;     /* R */
    int advance;    /* K (advance forward only) */
    int continuous; /* 0 synchronous, 1 continuous rounds */
    avgpipe_placement placement; /* stage -> rank */
} avgpipe_sched_desc;

/* A schedule: ops[r][0 .. len[r]-1] for each rank r < nranks. Owned by the library's allocator:
   release with avgpipe_sched_free(). has_comm is 1 when the lists carry SEND/RECV ops.
   shape.placement is LOOP, V or CUSTOM (never AUTO); place[g] is the rank of stage g for g < nplace
   when it is CUSTOM (NULL otherwise). Read placements through avgpipe_stage_rank(). */
typedef struct avgpipe_schedule {
    avgpipe_sched_desc shape;
    int nranks;
    int nstages; /* G = S·V */
    int has_comm;
    int *len;
    avgpipe_op **ops;
    int *place;
    int nplace;
} avgpipe_schedule;

/* Release a schedule's lists (the struct itself is the caller's). Safe on a zeroed struct. */
AVGPIPE_API void avgpipe_sched_free(avgpipe_context *ctx, avgpipe_schedule *s);
/* Deep copy. */
AVGPIPE_API avgpipe_result avgpipe_sched_copy(avgpipe_context *ctx, const avgpipe_schedule *src,
                                              avgpipe_schedule *dst);
/* An empty schedule of nranks lists (then append with avgpipe_sched_push). shape may be NULL. */
AVGPIPE_API avgpipe_result avgpipe_sched_init(avgpipe_context *ctx, avgpipe_schedule *s, int nranks,
                                              const avgpipe_sched_desc *shape);
/* Append one op to rank r's list. */
AVGPIPE_API avgpipe_result avgpipe_sched_push(avgpipe_context *ctx, avgpipe_schedule *s, int rank,
                                              avgpipe_op op);
/* Rank that holds global stage g under the schedule's placement; -1 when g is out of range or a
   custom map does not place it. */
AVGPIPE_API int avgpipe_stage_rank(const avgpipe_schedule *s, int stage);
/* Rank of stage g under a named placement (LOOP or V) of `ranks` ranks; -1 for a bad argument. */
AVGPIPE_API int avgpipe_place_rank(avgpipe_placement p, int ranks, int stage);
/* Place the stages explicitly: rank_of[g] for g < nstages, each in 0 .. nranks-1. The schedule's
   placement becomes LOOP or V when the map is one of them, else CUSTOM; nstages grows to cover the
   map (and shape.chunks to ceil(nstages / nranks)). An op already pushed for a stage the map puts
   on another rank is refused (AVGPIPE_INVALID_ARG, naming it). */
AVGPIPE_API avgpipe_result avgpipe_sched_set_place(avgpipe_context *ctx, avgpipe_schedule *s, const int *rank_of,
                                                   int nstages);

/* Names: "F", "SEND_F", ... and "afab", "1f1b", "advance", "interleaved", "zbh1", "zbv",
   "dualpipev", "custom"; "auto", "loop", "v", "custom" for placements. */
AVGPIPE_API const char *avgpipe_op_kind_name(avgpipe_op_kind k);
AVGPIPE_API const char *avgpipe_sched_kind_name(avgpipe_sched_kind k);
AVGPIPE_API const char *avgpipe_placement_name(avgpipe_placement p);
/* Parse a schedule kind name (as above); returns AVGPIPE_INVALID_ARG for an unknown name. */
AVGPIPE_API avgpipe_result avgpipe_sched_kind_parse(const char *name, avgpipe_sched_kind *out);

/* Text form of one op (no composite): "[P:]<stage><KIND>[<micro>]", e.g. "0F3", "1:2SEND_B0",
   "3STEP1", "7TIE2@0" (stage 7's tie with stage 0, round 2). Writes at most cap bytes including the
   NUL; returns the length it needed. */
AVGPIPE_API int avgpipe_op_format(const avgpipe_op *op, int with_pipe, char *out, size_t cap);

/* ============================================================================================ */
/* 3. Text format   (avgpipe_sched_export, _import, _load, _save)                               */
/* ============================================================================================ */
/* PyTorch's format (torch.distributed.pipelining): one line per rank, comma-separated actions in
   execution order, an empty field is an idle slot. An action is <stage><KIND><micro> with KIND one
   of F B I W SEND_F RECV_F SEND_B RECV_B (micro required) or UNSHARD RESHARD REDUCE_GRAD (no micro);
   "(a;b)OVERLAP_F_B" runs a and b together.
   avgpipe's extension (documented, backwards compatible):
     - an action may carry its parallel pipeline as a prefix "P:" ("1:0F3" = pipeline 1);
     - STEP and AVG actions: "<stage>STEP<round>", "<stage>AVG<round>";
     - synchronisation actions (avgpipe_sched_add_sync): "<stage>TIE<round>@<peer stage>",
       "<stage>AGREE<round>";
     - a first line "# avgpipe kind=advance stages=4 chunks=1 micro=8 pipes=2 rounds=3 advance=2
       continuous=1" carries the shape; other lines starting with '#' are comments.
   Blank lines at the end of the text are not ranks, except as many as the header's stages count
   still needs; a blank line followed by a comment is a rank (with one idle slot).
   The exporter writes the header line and the extension only when the schedule needs them (more
   than one pipeline or round, STEP/AVG ops, a generator's shape or any shape import would not infer
   from the actions, or an empty last rank, whose blank line only the header's rank count keeps):
   a PyTorch file exports back byte-identical, and export -> import is the identity for every
   schedule import accepts. AVGPIPE_TEXT_TORCH drops STEP/AVG/TIE/AGREE and the header to produce a file
   PyTorch reads (an error when N > 1). */
#define AVGPIPE_TEXT_TORCH 1u

AVGPIPE_API avgpipe_result avgpipe_sched_export(avgpipe_context *ctx, const avgpipe_schedule *s,
                                                unsigned flags, avgpipe_buf *out);
/* Parse text (len bytes; need not be NUL-terminated). Errors name the line and the field. The
   shape is taken from the header line when present, else inferred: ranks = lines, stages = highest
   stage + 1, V = stages / ranks, N = highest pipeline + 1, M = forwards per (pipeline, stage).
   The shape, from the header or inferred, stays within the generators' limits: at most 32767 stage
   partitions (ranks x chunks) and 32767 pipelines, micro x rounds at most 1e9, stages x chunks x
   pipes x micro x rounds at most 1.3e8. */
AVGPIPE_API avgpipe_result avgpipe_sched_import(avgpipe_context *ctx, const char *text, size_t len,
                                                avgpipe_schedule *out);
#ifndef AVGPIPE_NO_STDIO
/* Read a schedule file (a pipe works too) and import it. A file over 1 GiB is refused
   (AVGPIPE_IO_ERROR) as soon as the read passes the cap, before the buffer grows for it, and one that
   is not text (a NUL byte, or a control character other than tab, newline, CR, VT and FF) at the
   first such byte (AVGPIPE_PARSE_ERROR, naming its offset); profiles likewise (avgpipe_profile_load,
   256 MiB). */
AVGPIPE_API avgpipe_result avgpipe_sched_load(avgpipe_context *ctx, const char *path, avgpipe_schedule *out);
AVGPIPE_API avgpipe_result avgpipe_sched_save(avgpipe_context *ctx, const avgpipe_schedule *s, unsigned flags,
                                              const char *path);
#endif

/* ============================================================================================ */
/* 4. Generators   (avgpipe_sched_resolve, _generate, _warmup, _peak_stash)                     */
/* ============================================================================================ */
/* A generator takes an avgpipe_sched_desc (section 2). Zero-initialise; zero fields mean:
     stages, micro  required (>= 1)
     pipes 0 -> 1, chunks 0 -> 1 (2 for INTERLEAVED, ZBV, DUALPIPEV), rounds 0 -> 1, advance 0 -> 0
     placement 0 -> the kind's own (loop; V for ZBV and DUALPIPEV)
   Supported shapes (avgpipe_sched_resolve checks them, reading each kind's row of the kind table,
   avgpipe_sched_kind_query, whose .limits says the same; an error names the field):
     every kind   stages, micro >= 1; pipes 1..32767; rounds >= 1; stages x chunks <= 32767;
                  micro x rounds <= 1e9; stages x chunks x pipes x micro x rounds <= 1.3e8
     AFAB, 1F1B, ZBH1  chunks 1, loop placement; advance is ignored (0)
     ADVANCE      chunks 1, loop placement; any K >= 0 (K = 0 is 1F1B)
     INTERLEAVED  chunks >= 1, loop placement; with chunks > 1, micro % stages == 0 (Megatron-LM's
                  grouping of S micro-batches per chunk); chunks == 1 is 1F1B
     ZBV          chunks 2, V placement; any K >= 0
     DUALPIPEV    chunks 2, V placement; micro x pipes >= 2 x stages; advance is ignored (0)
   Order of the parallel pipelines: each rank runs the batches as one stream, batch (i, t) of
   pipeline i in round t at position t·N + i; within a stream every rank keeps 1F1B's (or AFAB's)
   discipline over all micro-batches of the stream, so N pipelines fill each other's bubbles.
   Synchronous rounds: a rank starts round t+1 after it has finished every batch of round t.
   Continuous rounds: the stream never drains; the forward of batch (i, t+1) on a stage waits only
   for STEP(i, t) on that stage. STEP(i, t) follows the last backward work of batch (i, t) on its
   stage at once, AVG(i, t) right after it (AVG for every N, so N = 1 with α = 0 is plain training). */

/* desc with its defaults filled in: pipes, rounds 0 -> 1; chunks 0 -> the kind's (2 for interleaved);
   placement AUTO -> the kind's (LOOP with one chunk); advance -> 0 for a kind without it. No validation
   (an unknown kind keeps its chunks and placement); desc may be NULL. Thread-safe. */
AVGPIPE_API avgpipe_sched_desc avgpipe_sched_query_defaults(const avgpipe_sched_desc *desc);
/* avgpipe_sched_query_defaults, then check the shape; *out gets the resolved description. Errors name
   the field. */
AVGPIPE_API avgpipe_result avgpipe_sched_resolve(avgpipe_context *ctx, const avgpipe_sched_desc *desc,
                                                 avgpipe_sched_desc *out);
/* Generate the compute-only schedule (F, B, I, W, STEP, AVG) for desc. */
AVGPIPE_API avgpipe_result avgpipe_sched_generate(avgpipe_context *ctx, const avgpipe_sched_desc *desc,
                                                  avgpipe_schedule *out);
/* Forwards a stage runs before its first backward (per batch stream): AvgPipe's warm-up
   min(T, (S-s-1) + floor(K(S-s-1)/(S-1) + 1/2)) for s < S-1, 0 for the last stage, with T = N·M
   the micro-batches of one round (K = 0 is 1F1B, AFAB is T). For INTERLEAVED, counted in
   (chunk, micro-batch) units per rank: min(T·V, 2(S-r-1) + (V-1)S). ZB-V, in the same units:
   min(T, 2S-r-1 + k_r) + min(T, r+1) with k_r = floor(K(S-1-r)/(S-1) + 1/2) (0 on the last rank);
   DualPipeV 2S (2S+1 on the last rank). Returns -1 on a bad desc. */
AVGPIPE_API int avgpipe_sched_warmup(const avgpipe_sched_desc *desc, int rank);
/* Memory model: peak stashed activations (micro-batches whose forward ran and whose backward did
   not finish: B, or W after I) on a rank, over all its chunks: min(warm-up + 1, T·V); AFAB T·V;
   ZB-H1 min(S, T); ZB-V its warm-up (2S + k_r when T >= 2S: 1F1B's S micro-batches of a whole
   rank); DualPipeV 2S + 1. Equals what the simulator measures for generated schedules, except
   continuous ZB-V, whose forwards may wait for their pipeline's STEP: at most this there. */
AVGPIPE_API int avgpipe_sched_peak_stash(const avgpipe_sched_desc *desc, int rank);

/* ============================================================================================ */
/* 5. Greedy scheduler; ties and agreement   (avgpipe_sched_greedy, avgpipe_sched_add_sync)     */
/* ============================================================================================ */
/* Greedy list scheduler for custom schedules (V = 1). It simulates the pipeline with the given op
   costs and free transfers; whenever a rank is free it runs the first ready op in priority order,
   where a forward is ready only while the rank's in-flight micro-batches (forward done, backward
   not finished) stay under the cap. Backwards are taken oldest first, forwards in stream order.
   Zero fields: shape.pipes, shape.rounds, shape.chunks -> 1, shape.placement -> LOOP; priority {0} ->
   B (or I), F, W; cap NULL -> S - s (1F1B's memory); cost 0 -> F 1, B 2, I 1, W 1 (AVGPIPE_ZERO:
   exactly 0). The kind of the output is CUSTOM, in loop placement. */
typedef struct avgpipe_greedy_desc {
    avgpipe_sched_desc shape;           /* stages, micro (required), pipes, rounds, continuous; kind is not
                                           read; chunks 0 or 1, advance 0, placement AUTO or LOOP */
    int split_backward;                 /* 1: emit I and W instead of B */
    avgpipe_op_kind priority[3];        /* e.g. {I, F, W}; unset entries are filled in default order */
    const int *inflight_cap;            /* per stage, or NULL */
    int inflight_cap_all;               /* if > 0 and inflight_cap is NULL: the same cap everywhere */
    double cost_f, cost_b, cost_i, cost_w;
} avgpipe_greedy_desc;
/* desc with its defaults filled in (the zero fields above; priority: the given entries, then the
   defaults in order, W only with split_backward; cost AVGPIPE_ZERO -> 0). No validation; desc may be NULL.
   Thread-safe. */
AVGPIPE_API avgpipe_greedy_desc avgpipe_greedy_query_defaults(const avgpipe_greedy_desc *desc);
AVGPIPE_API avgpipe_result avgpipe_sched_greedy(avgpipe_context *ctx, const avgpipe_greedy_desc *desc,
                                                avgpipe_schedule *out);

/* Ties and step agreement (the transformer's needs) as ops of the schedule.
   A tie says that a float range of stage partition a and one of partition b are one parameter (GPT-2's
   token embedding: the first stage's embedding and the last stage's LM head). Each round, after both
   partitions' backward work of a pipeline and before either STEP, the two gradient ranges are summed:
   a TIE op on each side (TIE(a@b) on a's rank, TIE(b@a) on b's) exchanges the ranges and both get a + b
   (the same bits: one fp32 addition is commutative). Step agreement: an AGREE op per stage before each
   STEP, where every partition of that pipeline contributes a small vector and all receive their
   combination (the global gradient norm for clipping, a non-finite count for skipping a step).
   Placement: avgpipe_sched_add_sync inserts them into a compute-only schedule with STEPs (any kind,
   any placement) by replaying it with op times (the desc's, default F 1, B 2, I 1, W 1; free
   transfers): each rank runs its list in order; a STEP (and its AVG) whose TIE or AGREE cannot complete
   yet is held back while the rank goes on with ops that do not need it (only the pipeline's next
   forward on that stage does); a TIE pair is placed, on both ranks at once, at the time both sides'
   backward work of the round has ended (before any op that would start later), an AGREE group when
   every stage's has (and its TIEs), and the held STEP and AVG right after. The result is a schedule one execution of which the
   replay has just run, so every execution completes (the validator's replay checks it again), and the
   sync ops are in the same order on every rank (the runtime matches them in order on a communicator of
   their own). A TIE between two stages on one rank moves no bytes. */
typedef struct avgpipe_tie {
    int stage_a, stage_b;      /* two different stage partitions */
    size_t offset_a, offset_b; /* the range's first float in each partition's parameters (and gradients) */
    size_t count;              /* floats in the range; > 0 */
} avgpipe_tie;
typedef struct avgpipe_sync_desc {
    const avgpipe_tie *ties; /* only stage_a and stage_b are read here; several ties between the same two
                                stages make one TIE op per side */
    int nties;
    int agree;               /* 1: an AGREE op before every STEP */
    double cost_f, cost_b, cost_i, cost_w; /* the replay's op times: 0 -> 1, 2, 1, 1 (AVGPIPE_ZERO: 0) */
} avgpipe_sync_desc;
/* Insert TIE and AGREE ops into `in` (compute-only: F, B, I, W, STEP, AVG, IDLE; STEPs required, no
   SEND/RECV and no sync ops yet), moving STEPs and AVGs after them as described above; out is a new
   schedule (in may be out's source only, not out itself). With no ties and agree 0 it is a copy.
   Errors: AVGPIPE_INVALID_ARG (a tie naming a stage outside the schedule or a stage tied to itself,
   naming the tie), AVGPIPE_INVALID_SCHEDULE (in has comm or sync ops, or an op the replay cannot
   run: then the schedule was not valid; or a STEP whose round's sync can never complete because the
   rank's list needs that STEP first, naming both ops). */
AVGPIPE_API avgpipe_result avgpipe_sched_add_sync(avgpipe_context *ctx, const avgpipe_schedule *in, const avgpipe_sync_desc *sync,
                                                  avgpipe_schedule *out);

/* ============================================================================================ */
/* 6. Lowering   (avgpipe_sched_lower)                                                          */
/* ============================================================================================ */
/* Lowering: insert SEND/RECV ops into a compute-only schedule. Each compute op that produces data
   for a stage on another rank is followed by its SEND; the receiver's RECV (the sender inserts the
   matching receive) is posted right after the receiver's previous compute op, before that op's own
   sends, so blocking sends always find the receive posted. Idle slots are dropped. */
AVGPIPE_API avgpipe_result avgpipe_sched_lower(avgpipe_context *ctx, const avgpipe_schedule *in,
                                               avgpipe_schedule *out);

/* ============================================================================================ */
/* 7. Simulation                                                                                */
/* ============================================================================================ */
/* Model: per rank one compute resource that runs its ops in list order, and a full-duplex link
   between each pair of ranks (one resource per direction, FIFO in the sender's order). A transfer
   costs latency + bytes/bandwidth. Asynchronous sends cost the sender nothing; a blocking send
   waits for the receiver to post the receive and for the transfer to finish. Compute-only
   schedules get the transfers implied by their dependencies (asynchronous; lowered first when
   blocking sends are asked for). Event times follow from the dependencies in causal order (every
   resource serves its ops in a fixed order), so the result is exactly that of a discrete-event run.
   Zero fields mean: cost F 1, B 2, I 1, W 1, STEP/AVG/others 0; latency 0; bytes 0; bandwidth 0
   (= no bandwidth term); micro_size 1; act_bytes 0. cost[k] = AVGPIPE_ZERO: that kind costs exactly
   zero. stage_cost and cost_fn are taken as they are (0 is zero; a negative value counts as zero).
   The simulator's tables hold one entry per (pipeline, stage, micro-batch) the schedule's numbers
   span; a schedule that spans more than 8 of them per op it holds (numbered so sparsely that it
   cannot be valid, and a few bytes of text could ask for gigabytes) is refused with
   AVGPIPE_INVALID_SCHEDULE; so is it by avgpipe_sched_lower and avgpipe_sched_validate. */
typedef struct avgpipe_sim_desc {
    double cost[AVGPIPE_OP_KIND_COUNT]; /* per kind, all stages; 0 -> default above, AVGPIPE_ZERO -> 0 */
    const double *stage_cost;   /* optional [stage * AVGPIPE_OP_KIND_COUNT + kind], overrides cost */
    double (*cost_fn)(const avgpipe_op *op, void *user); /* optional, overrides both */
    void *cost_user;
    double micro_size;          /* samples per micro-batch */
    int scale_by_micro_size;    /* 1: compute costs are per sample, multiplied by micro_size */
    double latency;             /* per transfer */
    double bytes;               /* per transfer, every stage boundary */
    const double *stage_bytes;  /* optional per sending stage: bytes of its activation = of its input grad */
    double bandwidth;           /* bytes per time unit; 0: no bandwidth term */
    int blocking_send;          /* 1: a send ends when its receive is posted; TIE and AGREE ops right after
                                   it (past other sends) see the rank arrive when it issued the send */
    double act_bytes;           /* stashed activation bytes per micro-batch and stage, for peak_bytes */
    const double *stage_act_bytes; /* optional per stage */
    double tie_bytes;              /* bytes a TIE between stages on two ranks exchanges each way */
    const double *stage_tie_bytes; /* optional [G]: for the pair (a, b), a < b, stage a's entry */
    int record_events;          /* AVGPIPE_SIM_EVENTS_*: fill result.events (for the renderers); 0: none */
} avgpipe_sim_desc;
/* desc with its defaults filled in, as the simulator resolves them: cost[k] 0 -> the default above
   (AVGPIPE_ZERO -> 0), micro_size 0 -> 1; every other field as given. desc may be NULL. Thread-safe. */
AVGPIPE_API avgpipe_sim_desc avgpipe_sim_query_defaults(const avgpipe_sim_desc *desc);

/* avgpipe_sim_desc.record_events. ALL: every op that is not IDLE and both ends of every transfer (what
   the Chrome trace and SVG renderers show, zero-length transfers as flows). TIMED: only the events that
   take time (end > start): all that avgpipe_render_ascii draws, and far fewer events (memory, time)
   when transfers are free, e.g. 3.1M instead of 9.4M for ZB-V at S = 64, M = 1024, N = 8. */
#define AVGPIPE_SIM_EVENTS_ALL 1
#define AVGPIPE_SIM_EVENTS_TIMED 2

/* One box in a timeline. track: 0 compute, 1 outgoing transfer, 2 incoming transfer. */
typedef struct avgpipe_event {
    avgpipe_op op;
    int32_t rank, track;
    int32_t peer;  /* for transfers: the other rank; else -1 */
    int32_t flow;  /* transfer id shared by the send and the receive event; else -1 */
    double start, end;
} avgpipe_event;

typedef struct avgpipe_rank_stats {
    double busy;     /* compute time */
    double blocked;  /* time waiting in blocking sends */
    double idle;     /* makespan - busy - blocked */
    int peak_stash;  /* stashed activations (micro-batches) */
    double peak_bytes;
} avgpipe_rank_stats;

typedef struct avgpipe_sim_result {
    double makespan;
    double bubble;       /* 1 - sum(busy) / (nranks · makespan) */
    int nranks;
    avgpipe_rank_stats *rank; /* [nranks] */
    long long ops;       /* ops executed */
    long long transfers;
    avgpipe_event *events; /* when record_events: compute and transfer events */
    size_t nevents, events_cap;
} avgpipe_sim_result;

/* Simulate s. Returns AVGPIPE_DEADLOCK (naming each stuck rank's op) if the replay stops. desc may
   be NULL (defaults). */
AVGPIPE_API avgpipe_result avgpipe_sim_run(avgpipe_context *ctx, const avgpipe_schedule *s,
                                           const avgpipe_sim_desc *desc, avgpipe_sim_result *out);
AVGPIPE_API void avgpipe_sim_result_free(avgpipe_context *ctx, avgpipe_sim_result *r);

/* ============================================================================================ */
/* 8. Validation                                                                                */
/* ============================================================================================ */
/* Checks (the invariants of a correct schedule): per (pipeline, stage, round) M forwards and B + (I + W)/2 = M, each I before
   its W, each op on the rank that holds its stage; forward/backward data dependencies; each channel
   (src, dst) carries the same sequence on both ends (matched per peer without tags, as NCCL does);
   SEND after its producer, RECV before its consumer; STEP after all backward work of its batch on
   its stage and before the next batch's forwards, AVG after STEP; a lockstep replay under async and
   under blocking sends progresses (no deadlock); peak stashed activations per rank equal the memory
   model when the schedule carries a generator's shape. The replay of a compute-only
   schedule posts its receives and runs its sends where avgpipe_sched_lower puts them, without
   building the lowered lists. */
typedef struct avgpipe_validate_report {
    avgpipe_result result; /* AVGPIPE_OK, AVGPIPE_INVALID_SCHEDULE or AVGPIPE_DEADLOCK */
    int rank, pos;         /* the offending op (-1 if none); pos indexes the schedule's own list */
    char op_text[64];
    char message[512];     /* also copied to the context's last error */
    int peak_stash[256];   /* per rank (first 256 ranks), from the replay */
} avgpipe_validate_report;

/* Zero flags run every check: zero is the value here, so there are no defaults to resolve. */
typedef struct avgpipe_validate_desc {
    int skip_replay;  /* 1: static checks only */
    int skip_memory;  /* 1: do not compare peak stash with the memory model */
} avgpipe_validate_desc;

/* desc may be NULL. Returns report->result (also when report is NULL). */
AVGPIPE_API avgpipe_result avgpipe_sched_validate(avgpipe_context *ctx, const avgpipe_schedule *s,
                                                  const avgpipe_validate_desc *desc,
                                                  avgpipe_validate_report *report);
/* ASCII grid of the op lists (one row per rank, one column per position); the op at
   (mark_rank, mark_pos) is shown as ">op<". mark_rank -1: no mark, every position. With a mark, only
   the AVGPIPE_GRID_WINDOW positions either side of mark_pos are drawn when the lists are longer (a line
   above the grid names the range shown), so that the op a validation error points at is shown in a
   few lines whatever the schedule's length. */
#define AVGPIPE_GRID_WINDOW 12
AVGPIPE_API avgpipe_result avgpipe_sched_render_grid(avgpipe_context *ctx, const avgpipe_schedule *s,
                                                     int mark_rank, int mark_pos, avgpipe_buf *out);

/* ============================================================================================ */
/* 9. Deadlock replay   (inside avgpipe_sched_validate)                                         */
/* ============================================================================================ */
/* The lockstep replay of section 8's validator (asynchronous and blocking sends, TIE and AGREE as
   rendezvous), and the validator's entry point and grid, which run it: no declarations of its own. */

/* ============================================================================================ */
/* 10. Rendering                                                                                */
/* ============================================================================================ */
/* Renderers take events (from the simulator, or later from a real run's profile). */
typedef struct avgpipe_render_desc {
    int width;          /* ASCII: columns for the time axis; 0 -> 120 */
    double us_per_unit; /* Chrome trace: microseconds per time unit; 0 -> 1000 */
    double px_per_unit; /* SVG: pixels per time unit; 0 -> fit 1200 px */
    const char *title;  /* optional */
} avgpipe_render_desc;
/* desc with its defaults filled in: width 0 -> 120, us_per_unit 0 -> 1000; px_per_unit stays 0 (its
   default fits the timeline into 1200 px, so it depends on the events); desc may be NULL. Thread-safe. */
AVGPIPE_API avgpipe_render_desc avgpipe_render_query_defaults(const avgpipe_render_desc *desc);

AVGPIPE_API avgpipe_result avgpipe_render_ascii(avgpipe_context *ctx, const avgpipe_event *ev, size_t n,
                                                int nranks, const avgpipe_render_desc *desc, avgpipe_buf *out);
/* Chrome trace JSON ("traceEvents"): one process per rank, a compute thread and a comm thread,
   complete events with real durations, and flow arrows from each send to its receive. Opens in
   Perfetto (ui.perfetto.dev) and chrome://tracing. */
AVGPIPE_API avgpipe_result avgpipe_render_chrome(avgpipe_context *ctx, const avgpipe_event *ev, size_t n,
                                                 int nranks, const avgpipe_render_desc *desc, avgpipe_buf *out);
AVGPIPE_API avgpipe_result avgpipe_render_svg(avgpipe_context *ctx, const avgpipe_event *ev, size_t n,
                                              int nranks, const avgpipe_render_desc *desc, avgpipe_buf *out);

/* ============================================================================================ */
/* 11. Device backend   (avgpipe_device_*)                                                       */
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
   backends agree to the bit where the hardware allows. The CPU device does so whatever flags the
   includer compiles this header with (-Ofast, -ffast-math, -march=native, GNU C; gcc, clang, g++, nvcc's
   host compiler), in round to nearest with subnormals kept, also in a program that runs with
   flush-to-zero (linked with -Ofast): tests/exact_check.c checks it in each such build. w, z, z_prev
   and acc never overlap. z is read
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
    /* Device memory, or NULL: when *skip is nonzero as the pass starts (on the device, after the stream's
       earlier work), the pass changes nothing. Set only for a device that has flag_nonfinite. */
    const uint32_t *skip;
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
    /* Optional (needed for replica groups): x[i] = x[i] * factor in fp32, on `stream`. */
    avgpipe_result (*scale)(void *user, float *x, float factor, size_t count, avgpipe_device_stream stream);
    /* Optional: the non-finite check without a host wait, for the averaging. Enqueue on `stream`: if some
       x[i] is NaN or +-Inf, then (flag[0] still 0) flag[1] = tag, and flag[0] |= bits; flag is two
       uint32 of device memory. A device with it must honour avgpipe_ea_pass.skip. */
    avgpipe_result (*flag_nonfinite)(void *user, const float *x, size_t count, uint32_t *flag, uint32_t bits, uint32_t tag,
                                     avgpipe_device_stream stream);
    /* Optional: *done = 1 when the work before the event's latest record has finished (or the event
       was never recorded), else 0; never blocks. The runtime polls it to wait with a timeout. */
    avgpipe_result (*event_query)(void *user, avgpipe_device_event event, int *done);
    /* Optional: the device time between two recorded, finished events, in seconds (profiles time device
       ops with it; without it they use the host's clock around the enqueue). */
    avgpipe_result (*event_elapsed)(void *user, avgpipe_device_event start, avgpipe_device_event end, double *seconds);
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

/* Check that a device table is complete: every entry but the optional scale, error_string and destroy set. Returns
   AVGPIPE_INVALID_ARG naming the first missing entry. Useful when writing a backend. Thread-safe
   (writes only ctx). */
AVGPIPE_API avgpipe_result avgpipe_device_check(avgpipe_context *ctx, const avgpipe_device *dev);

/* ============================================================================================ */
/* 12. Averaging   (avgpipe_ea_*)                                                               */
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
   cannot roll back: acc + x - x is not acc in floating point.) That scan makes the host wait for w_i's
   producer (a GPU's STEP) before the pass can be enqueued; with desc.check_on_device (a device with
   flag_nonfinite; the runtime's choice there) it runs on the device instead, in the pass's stream
   order, and a bad model stops the module on the device: its pass and every later one change nothing,
   so the reference never sees it, and avgpipe_ea_nonfinite tells the host (the runtime reads it at the
   end of each iteration and fails it with AVGPIPE_NON_FINITE, naming pipeline, stage and round).

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
     alpha           0 -> 0.1, the published default (Crossbow; AvgPipe follows it). AVGPIPE_ZERO for
                     alpha = 0 exactly (no pull: with N = 1 this is plain training).
     momentum        0 -> none. mu in [0, 1); AVGPIPE_EA_ELASTIC only.
     device          NULL -> a single-threaded CPU device created for (and owned by) the module
     stage           only used in messages (0 -> stage 0)
     no_finite_check 0 -> the non-finite guard is on
     check_on_device 0 -> the guard waits on the host for each contribution's w (find_nonfinite) and
                     refuses it in the call. 1 (needs the device's flag_nonfinite; the runtime sets it
                     for such a device): the guard runs on the device, in the pass's stream order, and
                     the call returns without waiting for w's producer; a non-finite w makes its pass,
                     and every later pass of the module, change nothing (the reference never sees it),
                     and the host learns of it from avgpipe_ea_nonfinite; the module is then unusable.
     hold_every      0 -> never. H > 0: every round t with (t + 1) % H == 0 is held when its last
                     contribution finalizes it: the new reference is not published (the round does not
                     count as complete) until avgpipe_ea_publish, so the caller can change it in place
                     first (avgpipe_ea_held); the runtime averages it across replica groups there.
   Required: count (P > 0), pipes (N >= 1), initial (z0: P floats in device memory, typically model
   0's starting weights; copied at creation). */
typedef struct avgpipe_ea_desc {
    size_t count;
    int pipes;
    avgpipe_ea_mode mode;
    float alpha;    /* in [0, 1]; 0 -> 0.1, AVGPIPE_ZERO -> exactly 0 */
    float momentum;
    const float *initial;
    const avgpipe_device *device; /* the table is copied; its user state must outlive the module */
    int stage;
    int no_finite_check;
    int check_on_device;
    int hold_every;
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
   into the reference (z0 = initial; with momentum also z_prev = initial) and wait for that copy on the
   device, so initial may change as soon as create returns. Round 0 is open.
   Errors: AVGPIPE_INVALID_ARG naming the field (count 0, pipes < 1, mode unknown, alpha outside [0, 1]
   or NaN, momentum outside [0, 1) or with MEAN, initial NULL, an
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

/* With desc.check_on_device: whether a contribution has been refused as non-finite, read from the
   device (a copy on `stream`, waited for: call it where the host may wait, e.g. after the round's
   work). AVGPIPE_OK: none so far. AVGPIPE_NON_FINITE: the message names the stage, the first refused
   round and the pipelines refused; *pipes (may be NULL) gets their bits (pipeline i: bit i % 32). The
   module is then unusable (destroy it). Without check_on_device: AVGPIPE_OK, *pipes = 0.
   Thread-safety: any thread, concurrently with contributions. */
AVGPIPE_API avgpipe_result avgpipe_ea_nonfinite(avgpipe_context *ctx, avgpipe_ea *ea, avgpipe_device_stream stream, uint32_t *pipes);

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

/* With desc.hold_every: the finalized, not yet published reference of the held round (device memory,
   P floats, writable until avgpipe_ea_publish), *round (may be NULL) its index; NULL when no round is
   held. While a round is held, contributions to the next round are accepted (pulled toward the
   previous reference) and the one after is refused. Any thread. */
AVGPIPE_API float *avgpipe_ea_held(avgpipe_ea *ea, uint64_t *round);
/* Checkpoints, between rounds (no round open: every pipeline has contributed to every round so far and
   nothing is held). avgpipe_ea_save_state copies the state out: the rounds completed, the reference z
   and (ELASTIC with momentum, else z_prev may be NULL) the previous reference, P floats each, to host
   memory, and waits for the device. avgpipe_ea_load_state puts such a state back: the module then
   continues as if it had run those rounds. Errors: AVGPIPE_INVALID_ARG (NULL buffers), AVGPIPE_STATE_ERROR
   (a round is open), AVGPIPE_BACKEND_ERROR. Not concurrent with contributions. */
AVGPIPE_API avgpipe_result avgpipe_ea_save_state(avgpipe_context *ctx, avgpipe_ea *ea, uint64_t *rounds, float *z, float *z_prev);
AVGPIPE_API avgpipe_result avgpipe_ea_load_state(avgpipe_context *ctx, avgpipe_ea *ea, uint64_t rounds, const float *z, const float *z_prev);
/* Publish the held round: it becomes the reference and counts as complete (avgpipe_ea_wait returns).
   Later averaging work is ordered after `stream` (where the caller changed the held buffer).
   Errors: AVGPIPE_INVALID_ARG (ea NULL), AVGPIPE_STATE_ERROR (no round is held), AVGPIPE_BACKEND_ERROR.
   Any thread. */
AVGPIPE_API avgpipe_result avgpipe_ea_publish(avgpipe_context *ctx, avgpipe_ea *ea, avgpipe_device_stream stream);

/* ============================================================================================ */
/* 13. Comm backend   (avgpipe_comm_*)                                                          */
/* ============================================================================================ */
/* Point-to-point messages between ranks plus the collectives a trainer needs. A backend is this table
   plus `user`; `self` is the calling rank. An in-process backend serves several ranks (threads) of one
   process; MPI (avgpipe_mpi.h) and NCCL (avgpipe_nccl.h) one rank per process.

   Matching. Messages are matched per channel (sender, receiver) in posting order, whatever their tags,
   as NCCL does: the k-th send from a to b meets the k-th receive b posted from a. The tag is a check,
   not a selector: every message carries the sender's tag, and a receive whose message carries another
   tag (a message was lost, duplicated or reordered on the way) or more bytes than the receive's
   `bytes` (its capacity) fails with AVGPIPE_MISMATCH, its status saying what arrived; the data is not
   delivered. A message of at most `bytes` is delivered, status.bytes saying how many (since 0.6: the
   runtime's variable micro-batch shapes; a backend that can only match exact sizes sets exact_bytes).
   The send still completes (the sender cannot know). The runtime tags each message with the op it
   belongs to, so a lost message is reported at the receive where it happened, naming both ops. Tags
   are 31-bit.

   Waiting. Every wait takes a timeout; AVGPIPE_TIMEOUT leaves the request pending (wait again, or
   cancel it). abort() makes every pending and later call of every rank return AVGPIPE_ABORTED (an MPI
   backend also tells the other processes, so they stop within milliseconds, not at their timeout).

   Ownership. The table's user state belongs to whoever created it: avgpipe_run never destroys a
   backend it was given (destroy it after avgpipe_run_destroy). A request belongs to the backend from
   isend/irecv until wait() or test() reports it finished, or until cancel() releases it; a send's
   buffer stays untouched until then. After a failure the runtime cancels every request it still has
   (when the backend has cancel; else the backend reclaims them at destroy).

   Required entries: isend, irecv, test, wait, barrier, abort. Optional (NULL): cancel, group_begin and
   group_end, isend_on and irecv_on (device-ordered transfers, both or neither) with wait_issued,
   allreduce_sum and split (needed only for replica groups), last_error, destroy.
   Thread-safety: different ranks may call concurrently; one rank's calls come from one thread at a
   time (any thread). */

typedef void *avgpipe_comm_request; /* a backend's own handle; finished by wait() or test() */

/* What a finished receive carried (filled on success and on AVGPIPE_MISMATCH). */
typedef struct avgpipe_comm_status {
    uint32_t tag; /* the sender's tag */
    size_t bytes; /* the bytes the sender sent */
} avgpipe_comm_status;

#define AVGPIPE_COMM_TAG_MAX 0x7fffffffu /* tags are 0 .. AVGPIPE_COMM_TAG_MAX */

typedef struct avgpipe_comm avgpipe_comm;
struct avgpipe_comm {
    const char *name;
    int size; /* ranks */
    /* Post a send of `bytes` from buf to `peer` / a receive of at most `bytes` into buf from `peer`,
       carrying (expecting) `tag`. buf may be NULL when bytes is 0. */
    avgpipe_result (*isend)(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req);
    avgpipe_result (*irecv)(void *user, int self, int peer, void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req);
    /* *done = 1 and the request is released when it finished (or failed: the result says); status (may
       be NULL) is filled for receives. */
    avgpipe_result (*test)(void *user, int self, avgpipe_comm_request req, int *done, avgpipe_comm_status *status);
    /* Wait at most timeout_s seconds; AVGPIPE_TIMEOUT leaves the request pending. Other results release it. */
    avgpipe_result (*wait)(void *user, int self, avgpipe_comm_request req, double timeout_s, avgpipe_comm_status *status);
    /* Optional: release a pending request without waiting for it; a receive will not be matched any
       more, a send's buffer is no longer read (MPI: see avgpipe_mpi.h for its limits). */
    void (*cancel)(void *user, int self, avgpipe_comm_request req);
    /* Optional (NULL = no-op): calls between begin and end may be issued together (NCCL groups). The
       runtime brackets the sends and receives a rank issues between two compute ops with them. */
    avgpipe_result (*group_begin)(void *user, int self);
    avgpipe_result (*group_end)(void *user, int self);
    /* Optional: device-ordered transfers, for a backend that moves device memory on the device's own
       streams (NCCL; avgpipe_nccl.h). With a device that is not the CPU (desc.device), the runtime uses
       them for activations and gradients: the transfer must not touch buf before `ready` has passed (an
       event recorded on the device after the data's producer, or after the buffer's last reader for a
       receive; NULL: nothing to wait for), and records `done` on the device when it has finished there;
       consumers order themselves after `done` with stream_wait_event, so the host does not wait. The
       request still finishes through test/wait/cancel like any other (test/wait report completion on
       the device). Tags as for isend/irecv (a backend that cannot carry them says so in its header). */
    avgpipe_result (*isend_on)(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag, avgpipe_device_event ready,
                               avgpipe_device_event done, avgpipe_comm_request *req);
    avgpipe_result (*irecv_on)(void *user, int self, int peer, void *buf, size_t bytes, uint32_t tag, avgpipe_device_event ready,
                               avgpipe_device_event done, avgpipe_comm_request *req);
    /* Optional, with isend_on / irecv_on: for a backend that records `done` only once both sides have
       posted the transfer (the in-process one: its copy is enqueued then), return when `done` has been
       recorded for req, at most timeout_s (AVGPIPE_TIMEOUT: not yet). The runtime calls it before it
       orders a consumer after a receive's `done`; it waits for the peer to post, not for the data. NULL:
       `done` is recorded by the time isend_on / irecv_on return (NCCL). */
    avgpipe_result (*wait_issued)(void *user, int self, avgpipe_comm_request req, double timeout_s);
    avgpipe_result (*barrier)(void *user, int self, double timeout_s);
    /* Optional: sum `count` floats over all ranks in place. The in-process and MPI backends add in rank
       order (avgpipe_comm_sum_ranks), so every rank gets the same bits on every run. */
    avgpipe_result (*allreduce_sum)(void *user, int self, float *buf, size_t count, double timeout_s);
    /* Optional: a sub-communicator. Collective: every rank of this communicator calls it once per
       split with the ranks of its own group (`members`, `count` of them, itself included); the groups
       partition the ranks and every member passes the same list. *out becomes a communicator of `count`
       ranks in which members[i] is rank i; destroy it (avgpipe_comm_destroy, once per call) before this
       one. A backend serving several ranks of one process returns without waiting for the others (the
       run calls it for all its local ranks from one thread); MPI blocks like MPI_Comm_split (and uses
       it: color members[0], key i); NCCL uses ncclCommSplit. The runtime averages the reference models
       of replica groups over the sub-communicator of the ranks that hold one stage. */
    avgpipe_result (*split)(void *user, int self, const int *members, int count, avgpipe_comm *out);
    /* Stop everything: pending and later calls of every rank return AVGPIPE_ABORTED. */
    void (*abort)(void *user, avgpipe_result why, const char *message);
    /* The backend's own detail of its last failure on `self` ("" if none). */
    const char *(*last_error)(void *user, int self);
    void (*destroy)(void *user);
    void *user;
    /* 1: a receive must be posted with the sender's exact size (NCCL: a larger receive waits for bytes
       that never come). The runtime then moves a smaller micro-batch at its boundary's maximum and its
       size in a message of its own. 0 (the built-in in-process and MPI backends): receives take any
       message up to their capacity. */
    int exact_bytes;
};

/* The embedded default: `ranks` threads of one process, a FIFO mailbox per (src, dst) channel. Sends
   are zero-copy: a send finishes when its receive has been posted and the bytes copied. Several runs
   (one per thread, each with its own local ranks) may share one instance, as processes share MPI.
   Release with avgpipe_comm_destroy. */
AVGPIPE_API avgpipe_result avgpipe_comm_local_create(avgpipe_context *ctx, int ranks, avgpipe_comm *out);
/* The same for ranks whose buffers live in `device`'s memory (a GPU: avgpipe_cuda.h), which the host
   may not touch; device NULL: avgpipe_comm_local_create. The table then also has isend_on / irecv_on:
   when a send and its receive have both been posted, the bytes move with one device-to-device copy on
   a stream of the channel's own, after both sides' `ready` events, and both `done` events are recorded
   after it; test and wait report the copy finished on the device. allreduce_sum takes device memory
   (ready when called): each rank's values come to the host through the device's copies and go back
   the same way, summed in rank order as on the host. isend / irecv stay host copies, for host buffers
   (the runtime's control messages). A send and a receive that disagree (one device-ordered, one not)
   fail with AVGPIPE_MISMATCH. The device table is copied; its state must outlive the backend. The
   runtime creates this one when desc.device is set and desc.comm is NULL. */
AVGPIPE_API avgpipe_result avgpipe_comm_local_create_on(avgpipe_context *ctx, int ranks, const avgpipe_device *device, avgpipe_comm *out);
/* Calls comm->destroy if set, then zeroes the table. NULL is harmless. */
AVGPIPE_API void avgpipe_comm_destroy(avgpipe_comm *comm);
/* Check that every required entry (isend, irecv, test, wait, barrier, abort) is set and size >= 1;
   AVGPIPE_INVALID_ARG names what is missing. */
AVGPIPE_API avgpipe_result avgpipe_comm_check(avgpipe_context *ctx, const avgpipe_comm *comm);
/* The sum in rank order that the built-in backends' allreduce_sum computes (in-process, MPI, NCCL with
   deterministic_allreduce): dst[i] = ((0 + part_0[i]) + part_1[i]) + ... in fp32, part r at
   parts + r * stride. The same bits under any compiler flags (contraction and fast-math are off in
   its definition; round to nearest with subnormals kept while it runs, even in a program linked with
   -Ofast). dst may be part 0 itself. A backend of your own calls it to agree with these to the bit.
   Thread-safe (it touches only dst). */
AVGPIPE_API void avgpipe_comm_sum_ranks(float *dst, const float *parts, size_t stride, int nparts, size_t count);

/* ============================================================================================ */
/* 14. Buffer plan and run state   (avgpipe_run_plan_*, the run's accessors)                    */
/* ============================================================================================ */
/* The runtime's buffer plan for a lowered schedule, the one avgpipe_run_create allocates by and the
   tuner's memory model reads: per stage, the bytes of one slot (input activation, output activation
   when the next stage is on another rank, gradient of the output, gradient of the input when the
   previous stage is on another rank) and the slots (micro-batches in flight at once: one is taken at
   a micro-batch's first op on the stage and given back after its last); per rank and position, the
   stages whose slot is given back after that op. Each of a slot's buffers takes its bytes rounded up
   to 256 and starts at a multiple of 256 bytes from the stage's allocation (which is 256-aligned on
   CUDA, 64-aligned at least on any device), so kernels may use vector loads on op->input and friends. */
typedef struct avgpipe_buffer_plan {
    int nranks, nstages;  /* S, G */
    int *slots;           /* [G] (at least 1) */
    size_t *slot_bytes;   /* [G] */
    int **release;        /* [S][2 * position + k], k = 0, 1: a stage, or -1 */
} avgpipe_buffer_plan;
/* Plan `lowered` (with SEND/RECV ops; avgpipe_sched_lower) for act_bytes[G-1] (NULL when G = 1).
   Release with avgpipe_buffer_plan_free. */
AVGPIPE_API avgpipe_result avgpipe_buffer_plan_build(avgpipe_context *ctx, const avgpipe_schedule *lowered, const size_t *act_bytes,
                                                    avgpipe_buffer_plan *out);
AVGPIPE_API void avgpipe_buffer_plan_free(avgpipe_context *ctx, avgpipe_buffer_plan *plan);

/* A run (avgpipe_run_create, section 19): what it holds, asked between iterations. */
typedef struct avgpipe_run avgpipe_run; /* opaque */
/* The reference model's partition of stage g (newest complete) of the first local replica group that
   holds it; count floats. NULL when no local rank holds g. Valid until the next iteration. */
AVGPIPE_API const float *avgpipe_run_reference(avgpipe_run *run, int stage, size_t *count);
/* The same for replica group `replica`. */
AVGPIPE_API const float *avgpipe_run_replica_reference(avgpipe_run *run, int replica, int stage, size_t *count);
/* 1 if this process runs global rank `rank`, else 0. */
AVGPIPE_API int avgpipe_run_is_local(const avgpipe_run *run, int rank);
/* Iterations run so far (with a loaded checkpoint: counted from the start of that training). */
AVGPIPE_API long long avgpipe_run_iterations(const avgpipe_run *run);
/* The schedule being run (lowered; its ranks are those of one replica group), and K for advance. */
AVGPIPE_API const avgpipe_schedule *avgpipe_run_schedule(const avgpipe_run *run);
/* Slots (in-flight micro-batches) the runtime reserved on stage g: size your per-slot stash so. With
   adaptive advance the count changes with K: it grows as K rises and shrinks when the controller steps
   back to the best K (or a checkpoint restores a smaller one), so query it again after each iteration
   and after avgpipe_run_load, and key your stash by (stage, slot) below the current count. */
AVGPIPE_API int avgpipe_run_slots(const avgpipe_run *run, int stage);

/* ============================================================================================ */
/* 15. Execution   (avgpipe_stage_callbacks, avgpipe_run_desc, avgpipe_run_stats)               */
/* ============================================================================================ */
/* Executes a schedule: one host worker thread per local rank walks its (lowered) op list and calls
   the user's stage callbacks with the buffers of each (pipeline, micro-batch); receives are posted
   early and waited on just before use, sends are asynchronous; STEP calls the user's optimizer; AVG
   goes to a per-rank averaging thread (off the critical path) that pulls the parallel model toward
   the reference and contributes to it (avgpipe_ea, one module per stage partition). A forward of the
   next batch of a pipeline waits for that pipeline's averaging to finish. Every op's start and end are
   recorded (the profile the tuner reads, and a Chrome trace through the simulator's renderers).

   Counting. sched.stages (S) counts ranks of one pipeline group; the model has G = S·V stage
   partitions ("stages" everywhere else: op->stage, op->stages, param_count[G], act_bytes[G-1]); the
   schedule's placement says which rank holds which stage (avgpipe_stage_rank): loop placement puts
   stages s, s+S, ... on rank s, V placement stages s and 2S-1-s. With replica groups there are D·S
   ranks: rank d·S + s is rank s of group d. Samples, micro-batches and rounds: see "Data" below.

   Processes. By default one process runs every rank on its own threads (the in-process comm backend).
   With desc.local_ranks, a process runs only those ranks (one, typically: one process per rank over
   MPI, see avgpipe_mpi.h) and holds only their parameters and buffers. Every process must describe
   the same run: avgpipe_run_create exchanges a fingerprint of the description and of the lowered
   schedule over the comm backend and refuses (AVGPIPE_MISMATCH) with a message naming the first field
   that differs and the two ranks. What crosses processes: activations and gradients between
   neighbouring stages, and with replica groups one allreduce of each stage's reference every H rounds.

   Buffers. The runtime owns the boundary buffers: per stage g and in-flight micro-batch, the input
   activation (act_bytes[g-1]), the output activation (act_bytes[g]), the gradient of the output
   (act_bytes[g]) and of the input (act_bytes[g-1]). A micro-batch in flight on a stage holds one
   `slot` (0 .. slots(g)-1) from its first op there until its backward (W) finished: key what you
   stash for the backward by (stage, slot) (and replica, when one process runs several groups).

   Variable micro-batch shapes (sequences of different lengths). act_bytes[g] is the boundary's
   maximum: the buffers are planned for it. With desc.variable_bytes = 1 a forward may write fewer
   bytes: it sets op->output_bytes (preset to act_bytes[g]) to what it wrote, and a backward sets
   op->grad_input_bytes (preset to op->input_bytes, the shape of the input) likewise. The size
   travels with the message (and to a neighbouring stage on the same rank without one); the consumer
   reads op->input_bytes (F, B, I, W) and op->grad_output_bytes (B, I, W; W sees its I's). Only the
   bytes set move. A size over the boundary's maximum fails the run naming the op; without
   variable_bytes a size other than the maximum does too (and every message must arrive at exactly
   the maximum, the strict check of 0.5). Over device-ordered transfers (NCCL, whose receives need
   the exact size) the payload moves at the maximum and the size follows it as an 8-byte host
   message, which the consumer waits for on the host before its callback (it shapes the kernels).

   Parameters. params are the user's memory, used in place: STEP's callback updates them, AVG pulls
   them toward the reference in place (between the user's STEP and the pipeline's next forward; the
   user never sees a half-averaged model inside a callback of that pipeline). The reference of each
   stage starts from desc.reference[g] when given, else from pipeline 0's parameters (of its group);
   give every pipeline the same starting values so that "the reference keeps the average" holds.

   Data. The first stage's forward loads its own input (input is NULL there): it picks the samples of
   (replica, pipe, round, micro), which the runtime passes; the recommended split gives each (replica,
   pipe) its own share of every epoch, e.g. batch number (round · D + replica) · N + pipe, micro-batch
   micro within it. The last stage's forward computes the loss (and may report it in op->loss); the
   last stage's backward starts from its own loss (grad_output is NULL there).

   Deterministic mode. Each AVG of round t waits until round t-1's reference is complete (with replica
   groups: averaged across the groups too), so every pull uses exactly that reference. Results then
   depend neither on timing nor on the schedule (when the user's gradients are summed in micro-batch
   order) and are bitwise identical between runs, between processes and threads. The cost: a pipeline
   cannot run ahead of the averaging by a round. Without it, a pull uses the newest complete reference
   (staleness at most 1 round), as in the paper.

   Devices and streams. With desc.device (a GPU: avgpipe_cuda.h) the runtime's buffers, the averaging
   state and the stage parameters live in that device's memory, and the host threads only issue work:
   each rank has one compute stream per pipeline (op->stream: enqueue the op's kernels there and
   return) and one averaging stream. The runtime orders the streams with events, so no callback needs
   to synchronize: a forward after its pipeline's averaging pass, the averaging pass after the STEP,
   a consumer after the receive that filled its buffer (device-ordered transfers, comm.isend_on /
   irecv_on, e.g. NCCL), a host-side send after the op that produced its data. The host waits only
   where it must: before a slot's buffers are reused (for the slot's last op on the device), before
   the host-side step() (use step_async to enqueue the optimizer instead, after the backward work, on
   the pipeline's stream) and at the end of each iteration (every stream, the averaging's included:
   after avgpipe_run_iteration returns, the parameters and references are final). Without isend_on and
   irecv_on the comm backend moves device memory from the host (e.g. MPI over CUDA-aware buffers) and
   the runtime waits for the producer before posting each send. With desc.comm NULL the runtime's own
   in-process comm is device-aware (avgpipe_comm_local_create_on): one process drives several stages
   on one GPU, or one GPU per stage thread, and nothing on the host reads or writes device memory (the
   test suite runs every path on a device whose memory faults when the host touches it).
   What a device run does not give: op->loss is read when the callback returns, before its kernels
   ran; set it from the host (e.g. a previous micro-batch's loss copied back asynchronously) or leave
   it 0 and compute the loss yourself. avgpipe_run_reference returns device memory; checkpoints and
   avgpipe_run_gather_reference copy through the device table. With desc.profile the ops' times come
   from device events (event_elapsed) when the table has them: the profile the tuner reads is the
   device's, not the host's issue times. The CPU device (the default) runs everything on the calling
   thread: streams are NULL and every ordering holds trivially.

   Tied parameters and step agreement (a transformer's needs). The library reaches the gradients
   through desc.grads (the buffers each model's backward accumulates into and its step reads, one per
   model and partition, indexed as params). desc.ties declares float ranges of two partitions to be one
   parameter (GPT-2's token embedding, the first stage's input and the last stage's LM head): each
   round, after both partitions' backward work of a pipeline and before either STEP, the two gradient
   ranges are summed and both hold a + b with the same bits, so both copies take the same step (give
   them the same starting values) and stay identical; averaging keeps them so. desc.agree makes every
   partition of a pipeline contribute a small vector of doubles before the round's STEPs; the vectors
   are summed over the partitions in partition order ((0 + v_0) + v_1) + ..., so every rank sees the
   same bits on every run (threads or processes), and every partition's step_agreed callback receives
   the sums. Built on it: clipping by the global gradient norm (agree.clip_norm: the step gets the
   scale) and skipping a pipeline's step on every partition when any gradient is non-finite
   (agree.skip_nonfinite: counted in avgpipe_run_stats.skipped; the run goes on). The norm is the
   library's own: each partition's sum of squares is avgpipe_grad_sumsq over its gradients in index
   order, a tied range counted once (on the lower-numbered partition), combined as above;
   avgpipe_agree_combine and avgpipe_clip_scale give a plain loop the same bits. The schedule carries
   TIE and AGREE ops (avgpipe_sched_add_sync places them in every generated schedule; a given schedule
   gets them unless it has its own, which must match desc.ties and desc.agree): a tie between two
   ranks exchanges its range on a communicator of its own (comm.split over the replica group's ranks),
   one between two partitions on one rank moves nothing; an agreement sends each rank's vectors to the
   other ranks of its group. On a device (desc.device not the CPU) the gradients are device memory:
   each TIE and AGREE copies what it sums (the tied ranges, a partition's gradients for the built-in
   sum of squares) to host buffers on the pipeline's compute stream, after its backward work, waits
   for the copy, sums on the host as above (the same bits) and copies tied sums back before the STEP;
   step_agreed and contribute get device pointers and st->stream (enqueue the update there). The host
   waits once per TIE and AGREE: correct on any device, not yet a device-side reduction. */

typedef struct avgpipe_op_ctx {
    int rank, pipe, stage, micro, round; /* rank: global (replica · S + s); micro: within the batch;
                                            round: global (iteration · R + r) */
    int replica;                         /* replica group d, 0 .. D-1 */
    int kind;                            /* avgpipe_op_kind: F, B, I or W */
    int slot;                            /* unique among this stage's in-flight micro-batches */
    int stages;                          /* G: stage partitions of the model (not ranks) */
    float *params;                       /* parameters of (replica, pipe, stage) */
    const void *input;                   /* F, B, I, W: the stage's input activation (NULL on stage 0) */
    void *output;                        /* F: write the output activation here (NULL on the last stage) */
    const void *grad_output;             /* B, I, W: gradient of the output (NULL on the last stage); W
                                            sees the same input and grad_output as its I, unchanged */
    void *grad_input;                    /* B, I: write the gradient of the input here (NULL on stage 0
                                            and for W) */
    double loss;                         /* F on the last stage: set it to the micro-batch's loss */
    avgpipe_device_stream stream;        /* enqueue the op's device work here and return (the pipeline's
                                            compute stream on this rank; NULL on the CPU device) */
    void *user;
    /* Sizes of this micro-batch's boundary data (see "Variable micro-batch shapes"): */
    size_t input_bytes;                  /* bytes in input as its producer set them (0 on stage 0) */
    size_t output_bytes;                 /* F: preset to act_bytes[stage]; set it to the bytes written
                                            (desc.variable_bytes; on a device before the callback
                                            returns, with the work it enqueues); 0 on the last stage */
    size_t grad_output_bytes;            /* B, I, W: bytes in grad_output (0 on the last stage) */
    size_t grad_input_bytes;             /* B, I: preset to input_bytes; set it to the bytes written */
} avgpipe_op_ctx;

/* What a step receives with step agreement, and what a contribution is asked for. */
typedef struct avgpipe_step_ctx {
    int rank, pipe, stage, round;  /* as step's arguments: rank global, round global */
    int replica;                   /* replica group d */
    float *params;                 /* parameters of (replica, pipe, stage) */
    float *grads;                  /* desc.grads of (replica, pipe, stage) (ties already summed), or NULL */
    size_t count;                  /* param_count[stage] */
    const double *agreed;          /* [width]: the partitions' contributions summed in partition order
                                      (NULL in contribute, and without agree.width) */
    int width;                     /* agree.width */
    double sumsq;                  /* with clip_norm or skip_nonfinite: the global sum of squares of the
                                      pipeline's gradients (a tied range once); else 0 */
    double nonfinite;              /* with clip_norm or skip_nonfinite: the gradients' NaN and Inf count */
    double scale;                  /* clip_norm > 0: avgpipe_clip_scale(sumsq, clip_norm), else 1: multiply
                                      the gradients by it (or fold it into the update) */
    int skip;                      /* skip_nonfinite and nonfinite > 0: leave params as they are and reset
                                      what you accumulated (the run counts the skip and goes on) */
    void *user;                    /* cb.user */
    avgpipe_device_stream stream;  /* on a device: the pipeline's compute stream on this rank; params and
                                      grads are device memory: enqueue the step here (NULL on the CPU) */
} avgpipe_step_ctx;

/* Step agreement across the stage partitions of a pipeline (see "Tied parameters and step agreement"). */
typedef struct avgpipe_agree_desc {
    int width;                     /* doubles each partition's contribute callback fills; 0: none */
    /* Fill out[0 .. width-1] for (pipe, stage, round) after its backward work and ties (st->grads
       final, st->agreed NULL); on the thread of the rank that runs the stage. Required with width. */
    int (*contribute)(const avgpipe_step_ctx *st, double *out);
    double clip_norm;              /* > 0: the global gradient norm is computed; step gets the clip scale */
    int skip_nonfinite;            /* 1: a non-finite gradient anywhere in the pipeline skips its step */
} avgpipe_agree_desc;

/* Callbacks return 0 on success; any other value stops every rank with AVGPIPE_CALLBACK_ERROR. */
typedef struct avgpipe_stage_callbacks {
    int (*forward)(avgpipe_op_ctx *op);
    int (*backward)(avgpipe_op_ctx *op);        /* B: inputs and weights; required unless I and W are given */
    /* I and W (optional, both or neither): without them an I op runs backward() and W does nothing, so
       split schedules (ZB-H1) run with a plain backward; without backward(), B runs I then W. */
    int (*backward_input)(avgpipe_op_ctx *op);
    int (*backward_weight)(avgpipe_op_ctx *op);
    /* Overlapped pairs (optional): a schedule's "(F;B)OVERLAP_F_B" (DualPipeV) runs the forward f of one
       micro-batch and the backward b (kind B or I) of another, on the same or another stage of this
       rank, in one call, so a trainer can interleave their kernels (one's communication under the
       other's compute). Both inputs have arrived; it must leave what forward(f) and then backward(b)
       (backward_input(b) for I) would. Without it the pair runs as F, then B. On a device both contexts
       carry the same stream (the forward's pipeline's; the runtime joins the two pipelines' streams
       around the call), so the pair's kernels may be enqueued there in any interleaving. */
    int (*overlap)(avgpipe_op_ctx *f, avgpipe_op_ctx *b);
    /* The user's optimizer: update params of (pipe, stage) from the gradients it accumulated over the
       round's micro-batches. rank is global (its replica group is rank / S); round is global
       (iteration · R + r), as in avgpipe_op_ctx. */
    int (*step)(int rank, int pipe, int stage, int round, float *params, void *user);
    /* Instead of step, on a device with asynchronous streams (optional): enqueue the update on `stream`
       (the pipeline's compute stream, after the round's backward work) and return. */
    int (*step_async)(int rank, int pipe, int stage, int round, float *params, avgpipe_device_stream stream, void *user);
    /* Instead of step (required with desc.agree, allowed without): the step with the agreement's result
       (avgpipe_step_ctx: the sums, the clip scale, whether to skip). Called on the rank's thread. */
    int (*step_agreed)(const avgpipe_step_ctx *st);
    /* Checkpoints (optional): what you own for global rank `rank` (the optimizer state of its stages,
       anything your data order needs): save appends it to *out (avgpipe_buf_append), load gets back
       exactly those bytes when the checkpoint is loaded. Called on the thread that saves or loads. */
    int (*save_state)(int rank, avgpipe_buf *out, void *user);
    int (*load_state)(int rank, const void *data, size_t bytes, void *user);
    /* Optional: a callback the watchdog abandoned (see avgpipe_run_destroy) has returned after the run was
       destroyed. Called on that thread as the last thing it does: the run's memory is already freed
       (through the allocator copied from the run's context) and nothing of the run or of yours is
       touched after it. rank is global. Count these against avgpipe_run_abandoned() to know when the
       state those callbacks use may be freed. */
    void (*abandoned_return)(int rank, void *user);
    /* Optional, with desc.reseed_nonfinite: partition (pipe, stage) of global rank `rank` was found
       non-finite at round `round`'s AVG and now holds the reference's values; reset what you keep for
       it (e.g. Adam's moments). Called on the rank's averaging thread, before the partition's next
       forward; nonzero stops the run (AVGPIPE_CALLBACK_ERROR). */
    int (*reseeded)(int rank, int pipe, int stage, int round, void *user);
    void *user;
} avgpipe_stage_callbacks;

typedef struct avgpipe_run_desc {
    avgpipe_sched_desc sched;          /* shape and schedule kind; sched.rounds = rounds per iteration */
    const avgpipe_schedule *schedule;  /* optional: run this schedule (compute-only or lowered) instead;
                                          copied at create (free yours whenever you like) */
    avgpipe_stage_callbacks cb;
    const size_t *act_bytes;           /* [G-1]: bytes of one micro-batch's activation at boundary g|g+1
                                          (may be NULL when G = 1) */
    float *const *params;              /* [(replica * N + pipe) * G + stage]: each parallel model's
                                          parameters; entries of stages this process does not run may be NULL */
    const size_t *param_count;         /* [G]: floats per stage partition (every stage, local or not) */
    const float *const *reference;     /* optional [G]: the reference's starting values (NULL entries for
                                          stages this process does not run); NULL -> pipeline 0's params */
    /* Averaging: mode (0 -> MEAN), alpha (0 -> 0.1, AVGPIPE_ZERO for exactly 0) and momentum (ELASTIC),
       as avgpipe_ea_desc documents them (section 12). The run fills in the rest for each stage
       partition (count, pipes, initial, device, stage, hold_every: leave them 0) and always guards
       against non-finite models (no_finite_check must be 0). */
    avgpipe_ea_desc averaging;
    int deterministic;    /* 1: each AVG waits for the previous round's reference (see above) */
    /* The non-finite guard: 0, a parallel model whose partition is non-finite at its AVG fails the
       iteration (AVGPIPE_NON_FINITE, naming pipeline, stage, round). 1: that partition is re-seeded from
       its stage's reference (avgpipe_ea_reset_from_reference), cb.reseeded is told (reset the optimizer
       state you keep for it), the partition contributes again and the run goes on (counted in
       avgpipe_run_stats.reseeded). On a device the check then waits on the host at each AVG. Not with
       ties (one partition re-seeded alone would part its tied copies): use agree.skip_nonfinite. */
    int reseed_nonfinite;
    double timeout_s;     /* every wait; 0 -> 60 s */
    /* The comm backend over all D·S ranks. NULL: in-process threads, which needs every rank local
       (avgpipe_comm_local_create; with a device, avgpipe_comm_local_create_on: its memory moves by the
       device's copies, the host never touches it). The run does not own a backend it is given: destroy
       it after the run. */
    const avgpipe_comm *comm;
    const int *local_ranks; /* the global ranks this process runs (any order); NULL -> all D·S */
    int local_count;
    /* Replica groups (data parallelism beyond one pipeline group): D groups of S ranks, each training its N models
       with its own samples; every H rounds (round t with (t + 1) % H == 0) the reference models of each
       stage are averaged over the D groups (comm.split + allreduce_sum on the D ranks that hold the
       stage, on the averaging threads, off the critical path; deterministic mode waits for it). */
    int replicas;         /* D; 0 -> 1 */
    int average_every;    /* H; 0 -> 1 */
    int profile;          /* 1: record per-op events (avgpipe_run_events / trace / profile file) */
    double micro_samples; /* samples per micro-batch, written to the profile for the tuner; 0 -> 1 */
    /* Adaptive advance forward (Algorithm 1): only with sched.kind == ADVANCE. Starts at K = 0 (1F1B),
       raises K by one after `window` iterations whose median time improved on the previous K's, while
       the predicted activation memory of every stage stays under mem_limit; then holds. Across
       processes the decision uses the slowest process's time, so all processes change K together. */
    int adaptive;
    int window;           /* 0 -> 3 */
    double mem_limit;     /* bytes of stashed activations per rank; 0 -> no limit */
    /* The device the stages run on (see "Devices and streams" above). NULL: the CPU device, created
       for the run. The run does not own a device it is given: destroy it after the run. */
    const avgpipe_device *device;
    /* Optional: called first thing on each thread the run starts, with the global rank it serves and
       its role (AVGPIPE_THREAD_WORKER: the rank's op list; AVGPIPE_THREAD_AVERAGING: its averaging), to
       bind it to cores (avgpipe_hwloc.h has one). A nonzero return is logged as a warning; the thread
       runs unbound. */
    int (*bind_thread)(int rank, int role, void *user);
    void *bind_user;
    /* Tied parameters and step agreement (see above). grads: [(replica * N + pipe) * G + stage], as
       params (the device's memory, host memory on the CPU; param_count[g] floats; entries of stages this process does not run may be
       NULL), required with ties, clip_norm or skip_nonfinite. ties: nties ranges of two different
       partitions, in bounds, of one length, no two overlapping in one partition. */
    float *const *grads;
    const avgpipe_tie *ties;
    int nties;
    avgpipe_agree_desc agree;
    /* 1: micro-batches may be smaller than act_bytes (op->output_bytes, op->grad_input_bytes; see
       "Variable micro-batch shapes"); a receive then accepts any size up to the maximum. 0: every
       message is exactly act_bytes and a callback that changes a size fails the run. */
    int variable_bytes;
} avgpipe_run_desc;

#define AVGPIPE_THREAD_WORKER 0
#define AVGPIPE_THREAD_AVERAGING 1

typedef struct avgpipe_run_stats {
    double seconds;       /* wall time of the iteration (this process) */
    double loss;          /* mean of op->loss over the iteration's last-stage forwards run here */
    long long micro_batches; /* last-stage forwards run here in the iteration */
    double bubble;        /* 1 - (time in callbacks) / (local ranks · seconds); with more stage threads
                             than cores this includes the time threads wait for a core */
    int advance;          /* K the iteration ran with */
    long long ops;
    long long skipped;    /* agree.skip_nonfinite: the (pipeline, round) steps skipped in the iteration in
                             the replica groups this process runs, counted once each */
    long long reseeded;   /* reseed_nonfinite: the partitions re-seeded from the reference in the
                             iteration on this process's ranks */
} avgpipe_run_stats;

/* ============================================================================================ */
/* 16. Steps and sync: the agreement's arithmetic   (avgpipe_grad_sumsq, _agree_combine)        */
/* ============================================================================================ */
/* Ties and step agreement run inside the iteration (section 15 describes them); these give a plain
   loop the runtime's bits. */
/* Sum of squares for the global gradient norm: *sumsq += x[i]·x[i] for i = 0 .. count-1 in that order
   in double, *nonfinite += the number of NaN and Inf among them (either pointer may be NULL). The
   same bits under any compiler flags (so calling it on consecutive pieces equals one call on their
   concatenation). What the runtime computes for each partition; thread-safe. */
AVGPIPE_API void avgpipe_grad_sumsq(const float *x, size_t count, double *sumsq, double *nonfinite);
/* out[k] = ((0 + parts[0·width + k]) + parts[1·width + k]) + ... over nparts, in that order, the same
   bits under any flags: how the runtime combines the partitions' contributions. */
AVGPIPE_API void avgpipe_agree_combine(const double *parts, int nparts, int width, double *out);
/* The clip scale for a global sum of squares: clip_norm / sqrt(sumsq) when sqrt(sumsq) > clip_norm,
   else 1 (also for clip_norm <= 0, and for a non-finite sumsq: skip such a step instead). Exact. */
AVGPIPE_API double avgpipe_clip_scale(double sumsq, double clip_norm);

/* ============================================================================================ */
/* 17. Processes: collectives between iterations   (avgpipe_run_gather_*, _allreduce)           */
/* ============================================================================================ */
/* Collective (every process, between iterations): the reference of every stage of replica group 0
   lands in dst[g] (param_count[g] floats each) on the process that runs global rank 0; other
   processes pass dst NULL. For evaluating or saving the model when the stages live in several
   processes. Errors: AVGPIPE_INVALID_ARG, AVGPIPE_TIMEOUT naming the rank that did not send. */
AVGPIPE_API avgpipe_result avgpipe_run_gather_reference(avgpipe_run *run, float *const *dst);
/* The same for the parameters of parallel model `pipe` (0 .. N-1) of replica group `replica`: each
   stage's params[(replica * N + pipe) * G + g] lands in dst[g] on the process that runs global rank 0
   (other processes pass dst NULL), for checks and exports. Collective, between iterations. Errors:
   AVGPIPE_INVALID_ARG (replica or pipe out of range, dst NULL on the root), AVGPIPE_TIMEOUT naming the
   rank that did not send. */
AVGPIPE_API avgpipe_result avgpipe_run_gather_params(avgpipe_run *run, int replica, int pipe, float *const *dst);
/* Collective (every process, between iterations): values[0..count-1] summed over the processes (each
   process counts once, whatever number of ranks it runs), in rank order, so every process gets the
   same bits. For reporting: e.g. the loss and accuracy counters of the last stage, printed on rank 0.
   count <= 4096. */
AVGPIPE_API avgpipe_result avgpipe_run_allreduce(avgpipe_run *run, double *values, int count);

/* ============================================================================================ */
/* 18. Checkpoints   (avgpipe_run_save, avgpipe_run_load)                                       */
/* ============================================================================================ */
#ifndef AVGPIPE_NO_STDIO
/* Checkpoints. Collective (every process, between iterations, the same dir name). avgpipe_run_save
   writes into directory `dir` (which must exist) one file per local rank, "rank-R-iter-I.ckpt": the
   rank's N models and references of its stages (and ELASTIC's previous reference), the averaging round
   counters, the iteration count, the adaptive controller's state, and cb.save_state's bytes; then every
   process writes "manifest" listing all ranks' files with their sizes and checksums, and the run's
   description (what must match on load). Each file goes to a temporary name and is renamed into place,
   the manifest last, and a rank's files of its previous checkpoint are removed only after that: a crash
   at any moment leaves the previous checkpoint loadable (atomic against a process that dies; C11 has no
   fsync, so against power loss the file system decides). Every file carries a format version and an
   FNV-1a checksum of all its bytes (any single changed byte is detected).
   avgpipe_run_load, on a run created from the same description (K and adaptive advance may differ),
   verifies the manifest, each local rank's file (size, checksum, version, rank, iteration) and the
   description before changing anything, then restores all of the above into the run, into desc.params
   and through cb.load_state. Errors name the file: AVGPIPE_IO_ERROR (missing, unreadable), AVGPIPE_PARSE_ERROR
   (truncated, corrupted, foreign, another format version), AVGPIPE_MISMATCH (made by another run: names the
   field), AVGPIPE_CALLBACK_ERROR; when any process fails every process fails, naming the rank. */
AVGPIPE_API avgpipe_result avgpipe_run_save(avgpipe_run *run, const char *dir);
AVGPIPE_API avgpipe_result avgpipe_run_load(avgpipe_run *run, const char *dir);
#endif

/* ============================================================================================ */
/* 19. Run lifecycle   (avgpipe_run_create, _iteration, _destroy; the memory model)             */
/* ============================================================================================ */
/* desc with its defaults filled in, as avgpipe_run_create resolves them: sched as
   avgpipe_sched_query_defaults; averaging as avgpipe_ea_query_defaults (mode, alpha); timeout_s 0 -> 60,
   replicas 0 -> 1, average_every 0 -> 1, micro_samples 0 -> 1, window 0 -> 3; pointers, callbacks and
   flags as given. No validation; desc may be NULL. Thread-safe. */
AVGPIPE_API avgpipe_run_desc avgpipe_run_query_defaults(const avgpipe_run_desc *desc);
/* Validate desc, build (or take) the schedule, lower it, check that every process agrees on it,
   allocate the local ranks' buffers and averaging, start their workers. Errors name the field (or,
   AVGPIPE_MISMATCH, the field other processes see differently). ctx must outlive the run. Collective:
   every process calls it (within desc.timeout_s of each other). */
AVGPIPE_API avgpipe_result avgpipe_run_create(avgpipe_context *ctx, const avgpipe_run_desc *desc, avgpipe_run **out);
/* Run the schedule once (R rounds of N batches per group). Returns when every local rank finished its
   ops and every averaging of the iteration has been applied (so avgpipe_run_reference is that
   iteration's). On a failure every rank stops (other processes within milliseconds when the backend
   propagates aborts, else at their timeouts) and the run is dead (destroy it); the error names rank,
   op and peer. Driven by one thread. Threads: the callbacks of a stage always run on its rank's
   worker thread (one per local rank, the same thread every iteration); whatever the driving thread
   writes between iterations is visible to the callbacks, and what they write is visible to it after
   this call returns. Between ranks: everything a callback wrote before it returned (its output or
   gradient, and any other memory of yours) is visible to the callback that consumes that output on
   the other rank (the transfer orders them: in-process, the comm's mutex; across processes, the
   message itself, for what crosses), so a side table written by a forward and read by the next
   stage's forward of the same micro-batch needs no lock of yours. With adaptive advance and ranks in
   other processes it is collective. */
AVGPIPE_API avgpipe_result avgpipe_run_iteration(avgpipe_run *run, avgpipe_run_stats *stats);
/* Stop the workers, cancel pending messages, free everything (not the user's comm backend).
   A callback that never returns: past the timeout the iteration fails with AVGPIPE_TIMEOUT naming the
   rank and the op (the watchdog), and the run is dead. Its thread cannot be stopped from outside (no
   thread is killed): destroy returns without it, leaving it inside your callback; the run's memory is
   kept until the callback returns, and then that thread frees it, calls cb.abandoned_return (when set)
   and ends, touching nothing else (not the comm backend, not your buffers, not your context). Keep what
   that callback uses alive until then (avgpipe_run_abandoned says how many such threads there will be),
   or end the process. */
AVGPIPE_API void avgpipe_run_destroy(avgpipe_run *run);
/* How many worker threads the watchdog has abandoned inside a user callback (0 unless an iteration
   failed with AVGPIPE_TIMEOUT naming a callback): after avgpipe_run_destroy, cb.abandoned_return is
   called once for each, when its callback returns. Thread-safe with respect to the run's own threads. */
AVGPIPE_API int avgpipe_run_abandoned(avgpipe_run *run);
/* Bytes the runtime allocated for boundary buffers and averaging on global rank `rank` (-1 when it
   is not local): what avgpipe_run_memory predicts. */
AVGPIPE_API double avgpipe_run_bytes(const avgpipe_run *run, int rank);
/* Memory model: bytes the runtime allocates per rank of one group for desc (the buffer plan plus the
   averaging buffers); per_rank has sched.stages entries. Equals avgpipe_run_bytes of a run created
   from the same desc. Needs only desc's shape (or schedule), act_bytes, param_count and averaging. */
AVGPIPE_API avgpipe_result avgpipe_run_memory(avgpipe_context *ctx, const avgpipe_run_desc *desc, double *per_rank);

/* ============================================================================================ */
/* 20. Profiles   (avgpipe_run_events, avgpipe_run_write_profile, avgpipe_profile_*)            */
/* ============================================================================================ */
/* Events of the last iteration (desc.profile = 1), of the local ranks: times in seconds from its start. */
AVGPIPE_API const avgpipe_event *avgpipe_run_events(const avgpipe_run *run, size_t *count);
#ifndef AVGPIPE_NO_STDIO
/* Write the last iteration's profile as text / its Chrome trace. Profile format, one record a line:
     # avgpipe profile v1
     shape kind=<name> stages=S chunks=V micro=M pipes=N rounds=R advance=K continuous=0|1
           samples=<per micro-batch> seconds=<iteration time>      (one line; a new section each)
     stage g param_floats=P act_bytes=B slots=Q            (one line per stage)
     op rank=r kind=F pipe=i stage=g micro=u start=<s> end=<s> bytes=<n>
   Times in seconds from the iteration's start; bytes = bytes the op moved (transfers). The profile
   holds the local ranks of the first local replica group (rank = its rank within the group). */
AVGPIPE_API avgpipe_result avgpipe_run_write_profile(avgpipe_run *run, const char *path);
/* The same, appended to `path` as a new section (profile two micro-batch sizes into one file). */
AVGPIPE_API avgpipe_result avgpipe_run_append_profile(avgpipe_run *run, const char *path);
AVGPIPE_API avgpipe_result avgpipe_run_write_trace(avgpipe_run *run, const char *path);
#endif

/* Profile records the tuner reads besides the runtime's (all optional, any order after the header line):
     layer L stage=G f_a=<s> f_b=<s> b_a=<s> b_b=<s> param_floats=P act_bytes=<per sample>
         layer L (0-based, every layer once) of the profiled model: forward f_a + f_b x samples seconds,
         full backward b_a + b_b x samples (I and W are taken as half each), P parameters, and the
         bytes per sample of its output (what crosses a stage boundary after it). G: the stage
         partition that held it in the profiled runs (non-decreasing in L, covering 0..G-1). Times are
         what the layer took inside the profiled ops, so that a stage's op is the sum of its layers.
     averaging floats=P seconds=<s>
         one contribution (avgpipe_ea_contribute) of P floats took that long on this machine. */

typedef struct avgpipe_profile_op {
    int section, rank, kind, pipe, stage, micro; /* kind: avgpipe_op_kind; RECV_* are waits at use */
    double start, end, bytes;
} avgpipe_profile_op;

typedef struct avgpipe_profile_section {
    avgpipe_sched_desc shape;
    double samples;      /* samples per micro-batch */
    double seconds;      /* measured iteration time */
    int nstages;
    double *param_floats, *act_bytes; /* [nstages] */
} avgpipe_profile_section;

/* One layer's costs (a 'layer' line; what the stage partitioner adds up). */
typedef struct avgpipe_layer_cost {
    int stage;          /* the stage partition that holds it (in a profile: in the profiled runs) */
    double f_a, f_b;    /* forward: f_a + f_b x samples per micro-batch, seconds */
    double b_a, b_b;    /* full backward (inputs and weights); I and W are half each */
    double param_floats;
    double act_bytes;   /* bytes per sample of its output activation */
} avgpipe_layer_cost;

typedef struct avgpipe_profile {
    int nsections;
    avgpipe_profile_section *sections;
    size_t nops;
    avgpipe_profile_op *ops;
    int nlayers;                  /* 'layer' lines; 0 when the profile has none */
    avgpipe_layer_cost *layers;   /* [nlayers] */
    double averaging_floats, averaging_seconds; /* sums over the 'averaging' lines (0: none) */
} avgpipe_profile;

/* Parse a profile (the text avgpipe_run_write_profile / avgpipe_run_append_profile write; len bytes,
   need not be NUL-terminated). Errors (AVGPIPE_PARSE_ERROR) name the line and the field: missing
   fields, unknown kinds, negative or non-numeric values, end before start, an op before any shape
   line, and values no real profile holds (so that the tuner's arithmetic stays exact and every
   conversion to an integer is in range): bytes (act_bytes, bytes) at most 2^50 (1 PiB), param_floats
   at most 2^48 (2^50 bytes as fp32), times (start, end, seconds) at most 1e6 s, samples in
   (0, INT_MAX]; the shape's counts as each field's message says. */
AVGPIPE_API avgpipe_result avgpipe_profile_parse(avgpipe_context *ctx, const char *text, size_t len, avgpipe_profile *out);
#ifndef AVGPIPE_NO_STDIO
AVGPIPE_API avgpipe_result avgpipe_profile_load(avgpipe_context *ctx, const char *path, avgpipe_profile *out);
#endif
AVGPIPE_API void avgpipe_profile_free(avgpipe_context *ctx, avgpipe_profile *p);

/* ============================================================================================ */
/* 21. Cost model   (avgpipe_tune_fit, _predict, _split, _slowest_share, _measure_averaging)    */
/* ============================================================================================ */
/* One profiled run is enough (the paper's Section 5, made exact): fit each stage's op times as a
   linear function of the micro-batch size (the profile should hold two sizes: two sections), the
   transfer latency, and take the memory per stage from the profile; then predict every candidate
   (M, N, K, schedule, round mode) by running the timed simulator on those costs, predict its memory
   per rank with the runtime's own buffer planner, and rank by time per sample under a memory limit.
   On CPU stage threads the N pipelines share each rank's core (the simulator's one compute resource
   per rank); on a device the pipelines' kernels overlap, which a fitted factor accounts for (below).

   What the callbacks' times leave out, also fitted from the profile, because on CPU threads it made
   predictions 5-10% low: the runtime's own time per op (between the callbacks: posting and copying
   transfers, waking a waiting thread) and the averaging, which runs on one more thread per rank and
   takes cores from the stage threads (its time per parameter, from 'averaging' lines the trainer
   measures with avgpipe_tune_measure_averaging).

   Pipelines sharing a device. On a GPU the N pipelines' kernels of one rank run concurrently (a stream
   each), so N pipelines get through a rank's ops faster than N times one pipeline's. Profile N = 1 and
   N = 2 (sections of both in one profile): the fit takes the ops' own costs from the N = 1 sections and
   the share of an op that overlaps (cost_model.overlap) from how much less time the ranks were busy at
   N = 2 than those costs add up to; predictions with N pipelines then charge each compute op
   (N (1 - overlap) + overlap) / N of its cost. On CPU threads the ops of a rank never overlap: 0.

   Stage threads sharing cores. With cost_model.cores set, an iteration takes at least all ranks' work
   over the cores. With more ranks than cores the threads do not get all of them (the scheduler wakes a
   receiving thread on its sender's core, where one waits while another core idles), so the fit also
   takes from the profile how many cores' worth of work they got through at once (busy_cores), and the
   bound divides by that. Like the overlap, it wants sections with little bubble (N = 2). */

/* Fitted costs, seconds. Op time of (stage, kind) = a + b · samples per micro-batch. */
typedef struct avgpipe_cost_model {
    int nstages;
    double *a, *b;              /* [stage * AVGPIPE_OP_KIND_COUNT + kind] */
    double latency;             /* per transfer */
    double *param_floats;       /* [nstages] */
    double *act_bytes_per_sample; /* [nstages]: activation bytes at boundary g|g+1 per sample */
    double samples_lo, samples_hi; /* micro-batch sizes seen in the profile */
    /* Cores the ranks share (CPU stage threads); 0 = a core (or device) per rank. With cores set an
       iteration takes at least (all ranks' compute + all averaging) / cores, and with more ranks than
       cores at least that over busy_cores when that is fitted and fewer. Set it after the fit. */
    double cores;
    /* Fitted from the profile (0 where it has nothing to fit them from): */
    double op_overhead;         /* runtime time per compute or STEP op outside the callback (trimmed mean) */
    double avg_per_float;       /* one averaging contribution per parameter float ('averaging' lines) */
    double step_a, step_b;      /* STEP = step_a + step_b x parameters of the partition, over the stages */
    double iter_overhead;       /* per iteration, outside every op: the runtime's start (workers woken) and finish
                                   (the last transfers, STEP and averaging waited for); median over the sections
                                   (the first 64 that count) of the measured time minus the ops' span, from those
                                   where that is at most a quarter of the time (more: the time does not describe
                                   these ops) */
    /* Concurrency on one device (GPU streams): the share p of a compute op's time that overlaps with the
       other pipelines' ops on the same rank. N pipelines' ops then take (N (1 - p) + p) / N of their
       isolated time each (Amdahl). Fitted when the profile has sections with N = 1 (the isolated op
       times) and N >= 2 (the ranks' busy time, the union of their compute ops' intervals, against the
       isolated time of the same ops); 0 on CPU threads, whose ops never overlap. */
    double overlap;
    int nlayers;                /* per-layer costs ('layer' lines), for avgpipe_tune_split_model / _plan */
    avgpipe_layer_cost *layers; /* [nlayers]; .stage = the partition that holds the layer in this model */
    /* Cores' worth of the model's work the ranks were seen to get done at once (fitted; 0: none): per
       section, the fitted cost of its ops and averaging over its measured time less iter_overhead; the
       median over the sections of one shape (kind, M, N), the largest of those. Where stage threads
       outnumber the cores they rarely get all of them (a thread woken onto its waker's core waits there
       while another core idles; measured here: 4 stage threads on 2 cores did 1.25-1.5 cores' worth), so
       with more ranks than `cores` the cores bound divides by this instead (at least 1), when it is less.
       Profile a setting with little bubble (N = 2) so that the sections show what the cores can do. */
    double busy_cores;
} avgpipe_cost_model;

/* Fit a cost model to a profile (every section must have the same stage partitions). Errors:
   AVGPIPE_INVALID_ARG (empty profile, sections that disagree), AVGPIPE_OUT_OF_MEMORY. Free with
   avgpipe_tune_cost_model_free. */
AVGPIPE_API avgpipe_result avgpipe_tune_fit(avgpipe_context *ctx, const avgpipe_profile *p, avgpipe_cost_model *out);
AVGPIPE_API void avgpipe_tune_cost_model_free(avgpipe_context *ctx, avgpipe_cost_model *m);

/* Predicted seconds of one iteration (sched->rounds rounds) with micro-batches of `samples`: the timed
   simulator on the fitted op costs plus op_overhead per op; averaging costs a rank's core when N = 1
   (the next round's forward waits for it) and, with cores set, counts in the cores bound; plus
   iter_overhead. */
AVGPIPE_API avgpipe_result avgpipe_tune_predict(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_sched_desc *sched,
                                                double samples, double *seconds);

/* The cost model of another split of m's layers (m must have layer costs): partition g holds the next
   split[g] layers (nparts partitions, each >= 1 layer, L in all); its op costs are the sums of its
   layers', STEP is step_a + step_b x its parameters, its boundary bytes those of its last layer; the
   rest (latency, overheads, averaging, cores) is m's. Errors name the field. Free with
   avgpipe_tune_cost_model_free. */
AVGPIPE_API avgpipe_result avgpipe_tune_split_model(avgpipe_context *ctx, const avgpipe_cost_model *m, const int *split, int nparts,
                                              avgpipe_cost_model *out);

/* The busiest rank's share of the work per sample (forward, backward and STEP: what one thread would do)
   when m's partitions run on `stages` ranks (partition g on rank g % stages) with micro-batches of
   `samples` and batches of `batch`: 1 / share is the most any schedule can gain over one thread. -1 on a
   bad argument. */
AVGPIPE_API double avgpipe_tune_slowest_share(const avgpipe_cost_model *m, int stages, double samples, int batch);

/* Time one averaging contribution of `floats` parameters on this machine (what the runtime runs: MEAN on
   the CPU device, non-finite guard on; the median of 16 after 4 warm-up ones), for the profile's
   'averaging' line. Errors: AVGPIPE_INVALID_ARG, AVGPIPE_OUT_OF_MEMORY, those of avgpipe_ea_create.
   Thread-safety: touches only ctx and *seconds. */
AVGPIPE_API avgpipe_result avgpipe_tune_measure_averaging(avgpipe_context *ctx, size_t floats, double *seconds);

/* Statistical efficiency: how many samples a target loss takes at a setting's samples per round. The
   model (McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training"): with
   batches of B samples, reaching a target takes E = E_min (1 + B / B_noise) samples, where B_noise =
   tr(Sigma) / |G|^2 is the gradient noise scale (Sigma the per-sample gradient covariance, G the true
   gradient): far below B_noise a batch's gradient is mostly noise and twice the samples per step make
   about twice the progress per step; far above it they are wasted. N parallel models of B samples each,
   pulled toward their average by elastic averaging, count as one model at N B samples per round: in a
   quadratic model the average of the N models follows plain SGD on the N batches together, whatever
   alpha is (the elastic forces cancel in the mean), so N pipelines take as many samples to a target as
   one pipeline with an N times larger batch, never fewer; alpha and M do not enter. This is a model of
   the optimiser, not a measurement of it: bench/bench_converge.sh checks what it chooses against
   training to the target.

   The noise scale from two batch sizes (the paper's appendix A): with |g_s|^2 the squared norm of a
   gradient averaged over b_s samples (unbiased: E|g_s|^2 = |G|^2 + tr(Sigma) / b_s) and |g_b|^2 over b_b
   > b_s samples, |G|^2 = (b_b |g_b|^2 - b_s |g_s|^2) / (b_b - b_s) and tr(Sigma) = (|g_s|^2 - |g_b|^2) /
   (1 / b_s - 1 / b_b), each averaged over the observations before the ratio is taken (the ratio of
   averages, not the average of ratios, which is biased). A pipeline gives both for free: the gradient of
   a micro-batch (b_s samples) and of the whole batch (b_b = M b_s), e.g. measured by the trainer's
   profile run or a short plain-loop probe. With an adaptive optimizer (Adam) take the norms of the
   gradients as it steps them, each coordinate over sqrt(v) + eps (its preconditioner): its critical batch
   is far above the raw estimate (Zhang et al. 2019; Pollux does the same). For the Fashion-MNIST example
   the raw estimate half an epoch in is ~200 samples, the preconditioned 1e5-1e6, and its runs take 4.0-5.0
   epochs to their target at every round size from 128 to 512 samples. */
typedef struct avgpipe_noise_scale {
    double gsq;        /* |G|^2 estimated (can come out <= 0 when the noise hides the gradient) */
    double trace;      /* tr(Sigma) estimated, per sample (can come out <= 0 when the gradients agree) */
    double scale;      /* B_noise = trace / gsq, in samples, when both are > 0; else 0: not measured (no
                          batch size is measurably better than another; avgpipe_tune_efficiency gives 1) */
    double rel_err;    /* the standard error of scale relative to it, by the jackknife over the observations
                          (leave one out; a left-out estimate that is not measured counts as 0); 0 with
                          one observation or scale 0 */
    int n;             /* observations used */
} avgpipe_noise_scale;

/* Estimate the gradient noise scale from n >= 1 observations: small_sq[i] = |g_s|^2 of a gradient over
   b_small samples (e.g. the mean over the micro-batches of a batch of their squared norms), big_sq[i] =
   |g_b|^2 over b_big > b_small samples, both of gradients normalised as means over their samples.
   Errors: AVGPIPE_INVALID_ARG (NULL, n < 1, b_small < 1, b_big <= b_small, a value not finite or < 0),
   naming it. Thread-safe. */
AVGPIPE_API avgpipe_result avgpipe_tune_noise_scale(avgpipe_context *ctx, const double *small_sq, const double *big_sq, int n,
                                                    double b_small, double b_big, avgpipe_noise_scale *out);

/* The noise scale that explains a measured ratio of samples: a probe trained from one state with batch
   `batch` and with k times the batch for the same samples, and the larger batch needed `ratio` times the
   samples the smaller needed for the same progress (e.g. ratio = loss decrease of the small batch / that
   of the large, over the same samples). The model of avgpipe_tune_efficiency gives ratio
   (1 + k batch / B_noise) / (1 + batch / B_noise), so B_noise = batch (k - ratio) / (ratio - 1). This
   measures what the run will see, at its own learning rate (gradient norms measure the noise alone and
   assume the learning rate grows with the batch). ratio is clamped to 1 + (k - 1) [0.001, 0.999]: a ratio
   at or below 1 (the larger batch lost nothing) gives 999 x batch, one at or above k (it gained nothing per
   step) gives batch / 999. -1 when batch is not >= 1, k not > 1, or any argument not finite. */
AVGPIPE_API double avgpipe_tune_noise_from_ratio(double batch, double k, double ratio);

/* The samples a target takes with `samples_per_round` samples per round (N pipelines x batch, x replica
   groups), relative to E_min: 1 + samples_per_round / noise_scale; 1 when noise_scale is 0 (not
   measured). -1 when samples_per_round is not > 0 and finite, or noise_scale is not >= 0 and finite. */
AVGPIPE_API double avgpipe_tune_efficiency(double noise_scale, double samples_per_round);

/* ============================================================================================ */
/* 22. Search and the stage partitioner   (avgpipe_tune_search, avgpipe_tune_choose_split)              */
/* ============================================================================================ */
/* The stage partitioner. With per-layer costs in the profile ('layer' lines: each layer's forward and
   backward time as a + b x samples, its parameters and output bytes, the stage that held it),
   avgpipe_tune_choose_split chooses the contiguous split of the L layers into S (or S·V) partitions jointly
   with M, N, K and the schedule: each split is a cost model (avgpipe_tune_split_model) searched by
   avgpipe_tune_search, the splits taken in order of a lower bound on their time per sample (the busiest
   rank's work, or all work over the cores), stopping when the bound passes the best time found: exact
   with respect to the predictions, and a handful of searches instead of one per split. */

typedef struct avgpipe_tune_desc {
    int batch;                  /* B: samples per batch of one pipeline (required) */
    int max_pipes;              /* N candidates 1..max_pipes; 0 -> 4 */
    int rounds;                 /* R per iteration; 0 -> 1 */
    double mem_limit;           /* bytes per rank; 0 -> none */
    double opt_bytes_per_param; /* optimizer state per parameter and pipeline (Adam: 8); 0 -> 0 */
    int max_advance;            /* largest K tried; 0 -> until every stage runs all its forwards first */
    int min_micro;              /* smallest micro-batch size in samples; 0 -> 1 */
    int no_continuous;          /* 1: synchronous rounds only */
    unsigned kinds;             /* bit (1u << avgpipe_sched_kind); 0 -> the kinds the table marks tuned
                                   that hold V stages per rank (AFAB, 1F1B, advance, ZB-H1; interleaved for
                                   V > 1). A kind asked for that cannot hold V stages per rank is refused,
                                   naming it (ZB-V and DualPipeV need V = 2; they run at K = 0) */
    int chunks;                 /* V: the model's partitions per rank; 0 -> 1. V > 1: interleaved (M a
                                   multiple of the ranks), ZB-V, DualPipeV (V = 2), on nstages / V ranks */
    /* The run's ties and step agreement (avgpipe_run_desc.ties, .agree): each candidate is simulated
       with its TIE and AGREE ops (avgpipe_sched_add_sync), a tie between two ranks moving 4 x count
       bytes each way, an AGREE costing a pass over its partition's gradients (priced as the averaging
       pass, avg_per_float a float), and its memory counts their buffers. NULL / 0: none. */
    const avgpipe_tie *ties;
    int nties;
    int agree;                  /* 1: the run agrees before its steps (clip_norm, skip_nonfinite or width) */
    /* Time to accuracy (the statistical efficiency model of avgpipe_tune_noise_scale): each candidate
       gets efficiency = avgpipe_tune_efficiency(noise_scale, pipes x batch), the samples a target takes at
       its samples per round relative to E_min, and time_to_target = time_per_sample x efficiency x
       target_samples. */
    double noise_scale;         /* B_noise of the model, samples (avgpipe_tune_noise_scale); 0: not known,
                                   efficiency 1 (time to target then ranks as samples per second). With
                                   D replica groups training one reference, give B_noise / D */
    double target_samples;      /* E_min: samples the target takes far below the noise scale; 0 -> 1
                                   (time_to_target is then in seconds per such sample: only its ratios mean
                                   something) */
    int objective;              /* avgpipe_tune_objective: what the ranking sorts by */
    /* Threads the search predicts candidates on, the calling thread among them: 0 -> 1 (the calling
       thread only). The result is the same for every count, candidate for candidate and error for
       error; the threads call the context's allocator (which must then be thread-safe, as the runtime
       needs it to be) and record errors on contexts of their own, the caller's getting the first
       candidate's error in the search's order. At most AVGPIPE_TUNE_MAX_THREADS. */
    int threads;
} avgpipe_tune_desc;
#define AVGPIPE_TUNE_MAX_THREADS 256
/* What avgpipe_tune_search ranks by (after fitting the memory limit). */
typedef enum avgpipe_tune_objective {
    AVGPIPE_TUNE_TIME_TO_TARGET = 0, /* least time_to_target (with noise_scale 0: least time per sample) */
    AVGPIPE_TUNE_THROUGHPUT = 1      /* least time_per_sample: most samples per second, as before 0.7 */
} avgpipe_tune_objective;
/* desc with its defaults filled in, as avgpipe_tune_search resolves them: max_pipes 0 -> 4, rounds 0 ->
   1, min_micro 0 -> 1, chunks 0 -> 1, target_samples 0 -> 1, threads 0 -> 1, kinds 0 -> the table's tuned
   kinds that hold `chunks` stages per rank; max_advance stays 0 (its bound depends on M); the rest as
   given. No validation; desc may be NULL. Thread-safe. */
AVGPIPE_API avgpipe_tune_desc avgpipe_tune_query_defaults(const avgpipe_tune_desc *desc);
/* avgpipe_tune_predict with the ties and agreement of `sync` (its ties, nties and agree; the rest is not read), as
   avgpipe_tune_search predicts each candidate. sync NULL: avgpipe_tune_predict. */
AVGPIPE_API avgpipe_result avgpipe_tune_predict_sync(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_sched_desc *sched,
                                                     double samples, const avgpipe_tune_desc *sync, double *seconds);

typedef struct avgpipe_tune_candidate {
    avgpipe_sched_desc sched;   /* kind, stages, micro, pipes, advance, rounds, continuous */
    double samples;             /* per micro-batch */
    double seconds;             /* predicted iteration time */
    double time_per_sample;     /* seconds / (rounds · pipes · batch) */
    double peak_bytes;          /* max over ranks: runtime buffers + parameters + optimizer state */
    int fits;                   /* peak_bytes <= mem_limit */
    double efficiency;          /* avgpipe_tune_efficiency(desc.noise_scale, pipes x batch) */
    double time_to_target;      /* time_per_sample x efficiency x desc.target_samples (0 -> 1) */
} avgpipe_tune_candidate;

/* Every candidate, fitting ones first, each group by desc->objective: least time to target (ties: least
   time per sample), or least time per sample; then less memory, fewer pipelines, fewer micro-batches.
   The candidates are predicted on desc->threads threads; a search that takes long says how far it is
   every 5 seconds (AVGPIPE_LOG_INFO, from the calling thread). *out is allocated with the context's
   allocator (avgpipe_free it). Errors: AVGPIPE_INVALID_ARG naming the field, AVGPIPE_OUT_OF_MEMORY, those of the
   simulator (the first failing candidate's). */
AVGPIPE_API avgpipe_result avgpipe_tune_search(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *desc,
                                               avgpipe_tune_candidate **out, int *count);

/* The stage partitioner: what to split and what to keep. */
typedef struct avgpipe_tune_split_desc {
    int stages;   /* S: ranks (required) */
    int chunks;   /* V: partitions per rank; 0 -> 1 (V > 1: interleaved, S·V partitions) */
    /* optional: keep only the candidates this returns 1 for (e.g. the M and N a user fixed) */
    int (*keep)(const avgpipe_tune_candidate *c, void *user);
    void *keep_user;
} avgpipe_tune_split_desc;
/* desc with its defaults filled in (chunks 0 -> 1). No validation; desc may be NULL. Thread-safe. */
AVGPIPE_API avgpipe_tune_split_desc avgpipe_tune_split_query_defaults(const avgpipe_tune_split_desc *desc);

typedef struct avgpipe_tune_split_choice {
    int nparts;                  /* S·V */
    int *split;                  /* [nparts] layers per partition, in layer order */
    avgpipe_tune_candidate best; /* the best kept candidate (by desc.objective) of that split that fits */
    int found;                   /* 0: no kept candidate of any split fits the memory limit */
    double slowest_share;        /* avgpipe_tune_slowest_share of the split at best's micro-batch size */
    double bound;                /* 1 / slowest_share, capped at the cores when m->cores is set (busy_cores
                                    with more ranks than cores, as the prediction) */
    long long splits, searched;  /* contiguous splits, and how many were searched (the rest were bounded out) */
} avgpipe_tune_split_choice;

/* Choose the split of m's layers into S·V contiguous partitions and the setting that minimise
   desc->objective (the predicted time to target, or per sample) under desc->mem_limit (ties: the split
   that comes first in layer order).
   Exact: the same as searching every split with avgpipe_tune_search. m needs layer costs (a profile
   with 'layer' lines). Errors: AVGPIPE_INVALID_ARG naming the field (no layer costs, fewer layers than
   partitions, more than 2e6 splits), those of avgpipe_tune_search. Free with avgpipe_tune_split_choice_free. */
AVGPIPE_API avgpipe_result avgpipe_tune_choose_split(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *desc,
                                             const avgpipe_tune_split_desc *plan, avgpipe_tune_split_choice *out);
AVGPIPE_API void avgpipe_tune_split_choice_free(avgpipe_context *ctx, avgpipe_tune_split_choice *p);


#ifdef __cplusplus
} /* extern "C" */
#endif
#endif /* AVGPIPE_H */

/* ============================================================================================ */
/* Implementation                                                                                */
/* ============================================================================================ */
#if defined(AVGPIPE_IMPL) && !defined(AVGPIPE_IMPLEMENTATION)
#define AVGPIPE_IMPLEMENTATION
#endif
#if defined(AVGPIPE_IMPLEMENTATION) && !defined(AVGPIPE_IMPLEMENTATION_INCLUDED)
#define AVGPIPE_IMPLEMENTATION_INCLUDED

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <limits.h>
#include <time.h>
#include <pthread.h>

#ifndef AVGPIPE_ASSERT
#include <assert.h>
#define AVGPIPE_ASSERT(c) assert(c)
#endif
#ifndef AVGPIPE_MALLOC
#define AVGPIPE_MALLOC(sz) malloc(sz)
#define AVGPIPE_FREE(p) free(p)
#endif

/* A hint that *p will be read soon (the simulator and the validator walk many op lists at once, a
   few ops at a time each, too many streams for the hardware to follow). */
#if defined(__GNUC__) || defined(__clang__)
#define AVGPIPE__PREFETCH(p) __builtin_prefetch(p)
#else
#define AVGPIPE__PREFETCH(p) ((void)0)
#endif

/* A function the compiler should inline although its size argues against it: bodies of hot loops
   whose rare paths (errors, events) make them big: the validator's op check, the simulator's
   transfers, the averaging kernels (section 11). */
#if defined(__GNUC__) || defined(__clang__)
#define AVGPIPE__FORCE_INLINE static inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define AVGPIPE__FORCE_INLINE static __forceinline
#else
#define AVGPIPE__FORCE_INLINE static inline
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

AVGPIPE_API const char *avgpipe_version(void) { return AVGPIPE_VERSION_STRING; }
AVGPIPE_API int avgpipe_version_number(void) { return AVGPIPE_VERSION_NUMBER; }

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

AVGPIPE_API avgpipe_context_desc avgpipe_context_query_defaults(const avgpipe_context_desc *desc) {
    avgpipe_context_desc d;
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    if (!d.allocator.alloc && !d.allocator.free) {
        d.allocator.alloc = avgpipe__default_alloc;
        d.allocator.free = avgpipe__default_free;
        d.allocator.user = NULL;
    }
    if (!d.log_level) d.log_level = AVGPIPE_LOG_WARN;
    return d;
}

AVGPIPE_API avgpipe_result avgpipe_context_init(avgpipe_context *ctx, const avgpipe_context_desc *desc) {
    if (!ctx) return AVGPIPE_INVALID_ARG;
    memset(ctx, 0, sizeof *ctx);
    ctx->desc = avgpipe_context_query_defaults(NULL);
    if (desc && (desc->allocator.alloc == NULL) != (desc->allocator.free == NULL)) {
        snprintf(ctx->error, sizeof ctx->error, "avgpipe_context_init: allocator.alloc and allocator.free must be set together");
        ctx->last_result = AVGPIPE_INVALID_ARG;
        return AVGPIPE_INVALID_ARG;
    }
    ctx->desc = avgpipe_context_query_defaults(desc);
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_context_desc avgpipe_context_query(const avgpipe_context *ctx) {
    return ctx ? ctx->desc : avgpipe_context_query_defaults(NULL);
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

/* NaN by its bits: a comparison that should refuse NaN (!(x >= 0)) is folded away when the includer
   compiles with -ffast-math (-ffinite-math-only), this is not. */
static int avgpipe__nan(double x) {
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
}

/* Finite (neither NaN nor an infinity) by its bits, for the same reason. */
static int avgpipe__finite(double x) {
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

/* Record an error on ctx (the detail goes to the last-error buffer and to the logger) and return it. */
static avgpipe_result avgpipe__fail_va(avgpipe_context *ctx, avgpipe_result r, const char *fmt, va_list ap) {
    ctx = avgpipe__ctx(ctx);
    vsnprintf(ctx->error, sizeof ctx->error, fmt, ap);
    ctx->last_result = r;
    avgpipe__log(ctx, AVGPIPE_LOG_ERROR, "%s", ctx->error);
    return r;
}
static avgpipe_result avgpipe__fail(avgpipe_context *ctx, avgpipe_result r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    r = avgpipe__fail_va(ctx, r, fmt, ap);
    va_end(ap);
    return r;
}
AVGPIPE_API avgpipe_result avgpipe_set_error(avgpipe_context *ctx, avgpipe_result r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    r = avgpipe__fail_va(ctx, r, fmt, ap);
    va_end(ap);
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
AVGPIPE_API avgpipe_result avgpipe_buf_append(avgpipe_context *ctx, avgpipe_buf *b, const void *data, size_t n) {
    if (!b || (!data && n)) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_buf_append: NULL argument");
    if (n && !avgpipe__buf_put(ctx, b, (const char *)data, n)) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_buf_append: out of memory");
    return AVGPIPE_OK;
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

/* The AVGPIPE_ZERO convention: 0 -> dflt, AVGPIPE_ZERO -> 0, anything else as given. */
static double avgpipe__or_default(double v, double dflt) {
    if (avgpipe__nan(v)) return v; /* refused by the check that follows (NaN == 0 holds under -ffast-math) */
    if (v == 0) return dflt;
    if (v == (double)AVGPIPE_ZERO) return 0;
    return v;
}
/* A field that is >= 0 or AVGPIPE_ZERO (and not NaN). */
static int avgpipe__zero_ok(double v) { return !avgpipe__nan(v) && (v >= 0 || v == (double)AVGPIPE_ZERO); }

/* ---- clocks, deadlines, atomics (used by the averaging, comm and runtime sections) ---- */

/* Flags written under a mutex are also read lock-free (spinning waits, the runtime's abort flag). */
#if defined(__GNUC__) || defined(__clang__)
#define AVGPIPE__LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define AVGPIPE__STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#else
#define AVGPIPE__LOAD(p) (*(volatile int *)(p))
#define AVGPIPE__STORE(p, v) (*(volatile int *)(p) = (v))
#endif
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define AVGPIPE__RELAX() __builtin_ia32_pause()
#else
#define AVGPIPE__RELAX() ((void)0)
#endif

/* Absolute deadline `seconds` from now (CLOCK_REALTIME, as pthread_cond_timedwait wants). */
static struct timespec avgpipe__deadline(double seconds) {
    struct timespec ts;
    double whole;
    timespec_get(&ts, TIME_UTC); /* the clock pthread_cond_timedwait measures by default */
    if (seconds < 0) seconds = 0;
    if (seconds > 1e7) seconds = 1e7;
    whole = floor(seconds);
    ts.tv_sec += (time_t)whole;
    ts.tv_nsec += (long)((seconds - whole) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

/* Seconds, for durations. C11's timespec_get (clock_gettime needs POSIX feature macros that a
   header included after the user's own cannot set). */
static double avgpipe__now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

#ifndef AVGPIPE_NO_STDIO
/* What a file of each kind may hold: at most `max` bytes (far above any real one; checked as the read
   goes, before the buffer grows), and, for text, no byte that no text holds (NUL, or a control
   character other than tab, newline, carriage return, vertical tab and form feed): /dev/zero or a
   binary given by mistake is refused within its first 64 KiB, not after a gigabyte. */
typedef struct avgpipe__file_kind {
    const char *what; /* "schedule", ... (for messages) */
    const char *why;  /* what the cap is, for messages */
    size_t max;
    int text;
} avgpipe__file_kind;
#define AVGPIPE__MAX_SCHEDULE ((size_t)1 << 30) /* 1 GiB: the largest schedule import takes is about this */
#define AVGPIPE__MAX_PROFILE ((size_t)1 << 28)  /* 256 MiB: millions of op records */
static const avgpipe__file_kind avgpipe__file_schedule = {"schedule", "the most a schedule file may hold", AVGPIPE__MAX_SCHEDULE, 1};
static const avgpipe__file_kind avgpipe__file_profile = {"profile", "the most a profile may hold", AVGPIPE__MAX_PROFILE, 1};

/* The offset of the first byte in p[0, n) that no text file holds, or n. */
static size_t avgpipe__not_text(const char *p, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        if ((c < 0x20 && (c < 0x09 || c > 0x0d)) || c == 0x7f) return i;
    }
    return n;
}

/* Append n bytes to a file's text, growing the buffer by doubling but never past max (+1 for the
   NUL). 0: over max, -1: out of memory. */
static int avgpipe__file_put(avgpipe_context *ctx, avgpipe_buf *text, const char *p, size_t n, size_t max) {
    if (n > max - text->len) return 0; /* checked before growing: the total would pass the cap */
    if (text->len + n + 1 > text->cap) {
        size_t cap = text->cap ? 2 * text->cap : n + 1;
        char *q;
        if (cap < text->len + n + 1) cap = text->len + n + 1;
        if (cap > max + 1) cap = max + 1;
        if (!(q = (char *)avgpipe__realloc(ctx, text->data, text->len, cap))) return -1;
        text->data = q;
        text->cap = cap;
    }
    memcpy(text->data + text->len, p, n);
    text->len += n;
    text->data[text->len] = 0;
    return 1;
}

/* Read a whole file (to EOF: pipes work too) of kind k: refused as soon as the running total passes
   k->max, and (text) at the first byte no text holds. */
static avgpipe_result avgpipe__read_file(avgpipe_context *ctx, const char *path, avgpipe_buf *text, const avgpipe__file_kind *k) {
    FILE *f = fopen(path, "rb");
    char chunk[65536];
    size_t n, at;
    int bad, put;
    if (!f) return avgpipe__fail(ctx, AVGPIPE_IO_ERROR, "cannot open '%s'", path);
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (k->text && (at = avgpipe__not_text(chunk, n)) < n) {
            fclose(f);
            at += text->len;
            avgpipe_buf_free(ctx, text);
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "'%s' is not a %s (text): byte %zu is 0x%02x", path, k->what, at,
                                 (unsigned)(unsigned char)chunk[at % sizeof chunk]);
        }
        if ((put = avgpipe__file_put(ctx, text, chunk, n, k->max)) <= 0) {
            fclose(f);
            avgpipe_buf_free(ctx, text);
            if (put < 0) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "out of memory reading '%s'", path);
            return avgpipe__fail(ctx, AVGPIPE_IO_ERROR, "'%s' is over %zu bytes, %s", path, k->max, k->why);
        }
    }
    bad = ferror(f);
    fclose(f);
    if (bad) { /* e.g. a directory */
        avgpipe_buf_free(ctx, text);
        return avgpipe__fail(ctx, AVGPIPE_IO_ERROR, "cannot read '%s' (a directory, or a read error)", path);
    }
    return AVGPIPE_OK;
}

/* Prefix the last error with the file's name. */
static avgpipe_result avgpipe__fail_in_file(avgpipe_context *ctx, avgpipe_result res, const char *path) {
    char detail[AVGPIPE_ERROR_MAX - 64];
    snprintf(detail, sizeof detail, "%.900s", avgpipe__ctx(ctx)->error);
    return avgpipe__fail(ctx, res, "%.60s: %s", path, detail);
}
#endif

/* --- 2. Schedule IR ---------------------------------------------------------------------------- */

/* Limits of a schedule, for the generators (section 4) and for imported text alike: a schedule larger
   than this is surely a mistake. */
#define AVGPIPE__MAX_STAGES 32767          /* stage partitions S x V */
#define AVGPIPE__MAX_PIPES 32767           /* parallel pipelines (avgpipe_op.pipe is 16 bits) */
#define AVGPIPE__MAX_MICRO_ROUNDS 1e9      /* micro-batches x rounds */
#define AVGPIPE__MAX_OPS 400000000LL
/* The simulator, the lowering and the validator keep tables of one cell per (pipeline, stage,
   micro-batch) that a schedule's numbers name. A valid schedule has at least one op per cell (its
   forward); these tables may hold at most this many cells per op, plus a floor for small hand-made
   schedules, so that a few bytes of text cannot ask for gigabytes. The same bound holds the
   simulator's per-round tables of TIE and AGREE ops to the number of those ops. */
#define AVGPIPE__CELLS_PER_OP 8
#define AVGPIPE__CELLS_FLOOR 4096
#define AVGPIPE__TEXT_VERSION 1 /* the schedule text header's format version */

static int avgpipe__cells_ok(double cells, long long nops) {
    return cells <= (double)AVGPIPE__CELLS_PER_OP * (double)nops + AVGPIPE__CELLS_FLOOR;
}

static const char *const avgpipe__op_names[AVGPIPE_OP_KIND_COUNT] = {
    "", "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "STEP", "AVG",
    "UNSHARD", "RESHARD", "REDUCE_GRAD", "TIE", "AGREE"};
/* The schedule kinds (avgpipe_sched_kind_info), in enum order. */
static const avgpipe_sched_kind_info avgpipe__kinds[AVGPIPE_SCHED_KIND_COUNT] = {
    /* kind, name, generated, chunks, placement, advance, split, overlapped, tuned, micro_multiple, micro_pipes_per_stage */
    {AVGPIPE_SCHED_CUSTOM, "custom", 0, 0, AVGPIPE_PLACE_AUTO, 0, 0, 0, 0, 0, 0, "any valid schedule (imported or built by hand)"},
    {AVGPIPE_SCHED_AFAB, "afab", 1, 1, AVGPIPE_PLACE_LOOP, 0, 0, 0, 1, 0, 0, "chunks 1, loop placement"},
    {AVGPIPE_SCHED_1F1B, "1f1b", 1, 1, AVGPIPE_PLACE_LOOP, 0, 0, 0, 1, 0, 0, "chunks 1, loop placement"},
    {AVGPIPE_SCHED_ADVANCE, "advance", 1, 1, AVGPIPE_PLACE_LOOP, 1, 0, 0, 1, 0, 0, "chunks 1, loop placement; any K >= 0 (K = 0 is 1F1B)"},
    {AVGPIPE_SCHED_INTERLEAVED, "interleaved", 1, 0, AVGPIPE_PLACE_LOOP, 0, 0, 0, 1, 1, 0,
     "chunks >= 1 (0 -> 2), loop placement; with chunks > 1, micro % stages == 0; chunks == 1 is 1F1B"},
    {AVGPIPE_SCHED_ZBH1, "zbh1", 1, 1, AVGPIPE_PLACE_LOOP, 0, 1, 0, 1, 0, 0, "chunks 1, loop placement"},
    {AVGPIPE_SCHED_ZBV, "zbv", 1, 2, AVGPIPE_PLACE_V, 1, 1, 0, 0, 0, 0, "chunks 2, V placement; any K >= 0"},
    {AVGPIPE_SCHED_DUALPIPEV, "dualpipev", 1, 2, AVGPIPE_PLACE_V, 0, 1, 1, 0, 0, 2, "chunks 2, V placement; micro x pipes >= 2 x stages"},
};

AVGPIPE_API const avgpipe_sched_kind_info *avgpipe_sched_kind_query(avgpipe_sched_kind kind) {
    return (int)kind >= 0 && kind < AVGPIPE_SCHED_KIND_COUNT ? &avgpipe__kinds[kind] : NULL;
}
static const char *const avgpipe__place_names[AVGPIPE_PLACE_COUNT] = {"auto", "loop", "v", "custom"};

AVGPIPE_API const char *avgpipe_op_kind_name(avgpipe_op_kind k) {
    return (k >= 0 && k < AVGPIPE_OP_KIND_COUNT) ? avgpipe__op_names[k] : "?";
}
AVGPIPE_API const char *avgpipe_sched_kind_name(avgpipe_sched_kind k) {
    const avgpipe_sched_kind_info *info = avgpipe_sched_kind_query(k);
    return info ? info->name : "?";
}
AVGPIPE_API const char *avgpipe_placement_name(avgpipe_placement p) {
    return (p >= 0 && p < AVGPIPE_PLACE_COUNT) ? avgpipe__place_names[p] : "?";
}
AVGPIPE_API avgpipe_result avgpipe_sched_kind_parse(const char *name, avgpipe_sched_kind *out) {
    int k;
    if (!name || !out) return AVGPIPE_INVALID_ARG;
    for (k = 0; k < AVGPIPE_SCHED_KIND_COUNT; k++)
        if (strcmp(name, avgpipe__kinds[k].name) == 0) {
            *out = (avgpipe_sched_kind)k;
            return AVGPIPE_OK;
        }
    if (strcmp(name, "gpipe") == 0) {
        *out = AVGPIPE_SCHED_AFAB;
        return AVGPIPE_OK;
    }
    return AVGPIPE_INVALID_ARG;
}

/* Rank of stage g under a named placement (g >= 0, S >= 1). */
static int avgpipe__place_formula(avgpipe_placement p, int g, int S) {
    int c = g / S, j = g - c * S;
    return p == AVGPIPE_PLACE_V && (c & 1) ? S - 1 - j : j;
}

/* The placement a description asks for, resolved: AUTO -> the kind's own. */
static avgpipe_placement avgpipe__placement_of(avgpipe_sched_kind kind, avgpipe_placement p) {
    const avgpipe_sched_kind_info *info = avgpipe_sched_kind_query(kind);
    if (p != AVGPIPE_PLACE_AUTO) return p;
    return info && info->placement == AVGPIPE_PLACE_V ? AVGPIPE_PLACE_V : AVGPIPE_PLACE_LOOP;
}

/* A schedule's placement resolved into tables for the passes that walk it (lowering, simulation,
   validation, buffer planning, the runtime): the rank of every stage, and the channels. A channel
   is one ordered pair of ranks that exchange messages; data crosses boundary g|g+1 forwards on
   up[g] and gradients cross it backwards on down[g + 1]. Messages on one channel keep the sender's
   order whatever boundaries they cross (the comm backends match per peer). */
typedef struct avgpipe__place {
    int G, S, nchan;
    int *rank;      /* [G] */
    int *up;        /* [G]: channel of stage g's forward output to g+1; -1 on the same rank or g = G-1 */
    int *down;      /* [G]: channel of stage g's input gradient to g-1; -1 on the same rank or g = 0 */
    int *src, *dst; /* [nchan] */
} avgpipe__place;

static void avgpipe__place_free(avgpipe_context *ctx, avgpipe__place *pl) {
    avgpipe_free(ctx, pl->rank);
    memset(pl, 0, sizeof *pl);
}

/* The channel id of (a, b), added when new: open addressing over a table of 2^k >= 4 entries per
   boundary, keyed a * S + b. */
static int avgpipe__place_chan(avgpipe__place *pl, int *keys, int mask, int a, int b) {
    long long key = (long long)a * pl->S + b;
    unsigned h = (unsigned)((key * 2654435761u) & (unsigned)mask);
    for (;; h = (h + 1) & (unsigned)mask) {
        if (keys[2 * h] < 0) {
            keys[2 * h] = (int)key; /* S <= 32767: a * S + b fits an int */
            keys[2 * h + 1] = pl->nchan;
            pl->src[pl->nchan] = a;
            pl->dst[pl->nchan] = b;
            return pl->nchan++;
        }
        if (keys[2 * h] == (int)key) return keys[2 * h + 1];
    }
}

static avgpipe_result avgpipe__place_build(avgpipe_context *ctx, const avgpipe_schedule *s, avgpipe__place *pl) {
    int g, G = s->nstages, mask = 15, *keys;
    memset(pl, 0, sizeof *pl);
    pl->G = G;
    pl->S = s->nranks;
    while (mask + 1 < 8 * (G + 1)) mask = 2 * mask + 1;
    /* one block: rank, up, down [G each], src, dst [2G each] */
    pl->rank = (int *)avgpipe_alloc(ctx, ((size_t)G * 7 + 2) * sizeof(int));
    keys = (int *)avgpipe_alloc(ctx, ((size_t)mask + 1) * 2 * sizeof(int));
    if (!pl->rank || !keys) {
        avgpipe_free(ctx, keys);
        avgpipe__place_free(ctx, pl);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "out of memory placing %d stages", G);
    }
    pl->up = pl->rank + G;
    pl->down = pl->up + G;
    pl->src = pl->down + G;
    pl->dst = pl->src + 2 * (size_t)G + 1;
    memset(keys, 0xff, ((size_t)mask + 1) * 2 * sizeof(int));
    for (g = 0; g < G; g++) {
        pl->rank[g] = avgpipe_stage_rank(s, g);
        pl->up[g] = pl->down[g] = -1;
    }
    for (g = 0; g + 1 < G; g++) {
        int a = pl->rank[g], b = pl->rank[g + 1];
        if (a == b || a < 0 || b < 0) continue;
        pl->up[g] = avgpipe__place_chan(pl, keys, mask, a, b);
        pl->down[g + 1] = avgpipe__place_chan(pl, keys, mask, b, a);
    }
    avgpipe_free(ctx, keys);
    return AVGPIPE_OK;
}

static int avgpipe__is_compute(int k) {
    return k == AVGPIPE_OP_F || k == AVGPIPE_OP_B || k == AVGPIPE_OP_I || k == AVGPIPE_OP_W;
}
static int avgpipe__is_comm(int k) { return k >= AVGPIPE_OP_SEND_F && k <= AVGPIPE_OP_RECV_B; }
static int avgpipe__is_sync(int k) { return k == AVGPIPE_OP_TIE || k == AVGPIPE_OP_AGREE; }
/* Tie pairs (lo, hi stages, lo < hi) as the validator and the simulator collect them from TIE ops:
   the pair of g and h in pairs[0 .. 2n), or -1; add appends it when new (0: out of memory). */
static int avgpipe__pair_find(const int *pairs, int n, int g, int h) {
    int q, lo = g < h ? g : h, hi = g < h ? h : g;
    for (q = 0; q < n; q++)
        if (pairs[2 * q] == lo && pairs[2 * q + 1] == hi) return q;
    return -1;
}
static int avgpipe__pair_add(avgpipe_context *ctx, int **pairs, int *n, int g, int h) {
    int *np;
    if (avgpipe__pair_find(*pairs, *n, g, h) >= 0) return 1;
    np = (int *)avgpipe__realloc(ctx, *pairs, (size_t)*n * 2 * sizeof(int), (size_t)(*n + 1) * 2 * sizeof(int));
    if (!np) return 0;
    np[2 * *n] = g < h ? g : h;
    np[2 * *n + 1] = g < h ? h : g;
    *pairs = np;
    (*n)++;
    return 1;
}
/* Kinds whose micro is a round (not a micro-batch). */
static int avgpipe__is_per_round(int k) { return k == AVGPIPE_OP_STEP || k == AVGPIPE_OP_AVG || avgpipe__is_sync(k); }
static int avgpipe__is_backward(int k) { return k == AVGPIPE_OP_B || k == AVGPIPE_OP_I; }
static int avgpipe__has_micro(int k) { return (k >= AVGPIPE_OP_F && k <= AVGPIPE_OP_AVG) || avgpipe__is_sync(k); }

static avgpipe_op avgpipe__op(int kind, int pipe, int stage, int micro) {
    avgpipe_op o;
    o.stage = stage;
    o.micro = micro;
    o.pipe = (int16_t)pipe;
    o.kind = (uint8_t)kind;
    o.flags = 0;
    o.peer = 0;
    return o;
}

AVGPIPE_API int avgpipe_place_rank(avgpipe_placement p, int ranks, int stage) {
    if (ranks < 1 || stage < 0 || (p != AVGPIPE_PLACE_LOOP && p != AVGPIPE_PLACE_V)) return -1;
    return avgpipe__place_formula(p, stage, ranks);
}

AVGPIPE_API int avgpipe_stage_rank(const avgpipe_schedule *s, int stage) {
    if (!s || s->nranks < 1 || stage < 0 || stage >= s->nstages) return -1;
    if (s->shape.placement == AVGPIPE_PLACE_CUSTOM)
        return s->place && stage < s->nplace && s->place[stage] >= 0 && s->place[stage] < s->nranks ? s->place[stage] : -1;
    return avgpipe__place_formula(s->shape.placement, stage, s->nranks);
}

AVGPIPE_API void avgpipe_sched_free(avgpipe_context *ctx, avgpipe_schedule *s) {
    int r;
    if (!s) return;
    if (s->ops)
        for (r = 0; r < s->nranks; r++) avgpipe_free(ctx, s->ops[r]);
    avgpipe_free(ctx, s->ops);
    avgpipe_free(ctx, s->len);
    avgpipe_free(ctx, s->place);
    s->ops = NULL;
    s->len = NULL;
    s->place = NULL;
    s->nplace = 0;
    s->nranks = 0;
}

AVGPIPE_API avgpipe_result avgpipe_sched_init(avgpipe_context *ctx, avgpipe_schedule *s, int nranks,
                                              const avgpipe_sched_desc *shape) {
    if (!s) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_init: s is NULL");
    memset(s, 0, sizeof *s);
    if (nranks < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_init: nranks must be >= 1 (got %d)", nranks);
    s->nranks = nranks;
    if (shape) s->shape = *shape;
    s->shape.placement = avgpipe__placement_of(s->shape.kind, s->shape.placement);
    if (s->shape.placement < 0 || s->shape.placement >= AVGPIPE_PLACE_COUNT) s->shape.placement = AVGPIPE_PLACE_LOOP;
    if (s->shape.stages <= 0) s->shape.stages = nranks;
    if (s->shape.chunks <= 0) s->shape.chunks = 1;
    if (s->shape.pipes <= 0) s->shape.pipes = 1;
    if (s->shape.rounds <= 0) s->shape.rounds = 1;
    s->nstages = nranks * s->shape.chunks;
    s->len = (int *)avgpipe__calloc(ctx, (size_t)nranks, sizeof(int));
    s->ops = (avgpipe_op **)avgpipe__calloc(ctx, (size_t)nranks, sizeof(avgpipe_op *));
    if (!s->len || !s->ops) {
        avgpipe_sched_free(ctx, s);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_init: out of memory");
    }
    return AVGPIPE_OK;
}

/* Capacity is implicit: the next power of two >= len (at least 16), so push needs no extra field. */
static size_t avgpipe__cap_of(size_t len) {
    size_t c = 16;
    while (c < len) c *= 2;
    return c;
}

AVGPIPE_API avgpipe_result avgpipe_sched_push(avgpipe_context *ctx, avgpipe_schedule *s, int rank, avgpipe_op op) {
    size_t n;
    if (!s || rank < 0 || rank >= s->nranks)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_push: rank %d out of range", rank);
    n = (size_t)s->len[rank];
    if (!s->ops[rank] || (n >= 16 && n == avgpipe__cap_of(n))) {
        size_t cap = s->ops[rank] ? 2 * n : 16;
        avgpipe_op *p = (avgpipe_op *)avgpipe__realloc(ctx, s->ops[rank], n * sizeof(avgpipe_op), cap * sizeof(avgpipe_op));
        if (!p) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_push: out of memory");
        s->ops[rank] = p;
    }
    s->ops[rank][n] = op;
    s->len[rank]++;
    if (op.stage >= s->nstages && op.kind != AVGPIPE_OP_IDLE) s->nstages = op.stage + 1;
    if (op.pipe >= s->shape.pipes) s->shape.pipes = op.pipe + 1;
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_sched_set_place(avgpipe_context *ctx, avgpipe_schedule *s, const int *rank_of,
                                                   int nstages) {
    int g, r, i, p, match[AVGPIPE_PLACE_COUNT] = {0, 1, 1, 1};
    int *map;
    if (!s || !s->len || !rank_of) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_set_place: NULL argument");
    if (nstages < 1 || nstages > AVGPIPE__MAX_STAGES)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_set_place: nstages must be in 1..%d (got %d)", AVGPIPE__MAX_STAGES,
                             nstages);
    if (nstages < s->nstages)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_set_place: the schedule has %d stages, the map places %d",
                             s->nstages, nstages);
    for (g = 0; g < nstages; g++) {
        if (rank_of[g] < 0 || rank_of[g] >= s->nranks)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_set_place: stage %d on rank %d (ranks are 0..%d)", g, rank_of[g],
                                 s->nranks - 1);
        for (p = AVGPIPE_PLACE_LOOP; p <= AVGPIPE_PLACE_V; p++)
            match[p] &= rank_of[g] == avgpipe__place_formula((avgpipe_placement)p, g, s->nranks);
    }
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++) {
            const avgpipe_op *op = &s->ops[r][i];
            if (op->kind != AVGPIPE_OP_IDLE && op->stage >= 0 && op->stage < nstages && rank_of[op->stage] != r) {
                char txt[64];
                avgpipe_op_format(op, 0, txt, sizeof txt);
                return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_set_place: rank %d position %d (%s) runs stage %d, which the map puts on rank %d",
                                     r, i, txt, op->stage, rank_of[op->stage]);
            }
        }
    s->nstages = nstages;
    s->shape.chunks = (nstages + s->nranks - 1) / s->nranks;
    avgpipe_free(ctx, s->place);
    s->place = NULL;
    s->nplace = 0;
    if (match[AVGPIPE_PLACE_LOOP] || match[AVGPIPE_PLACE_V]) {
        s->shape.placement = match[AVGPIPE_PLACE_LOOP] ? AVGPIPE_PLACE_LOOP : AVGPIPE_PLACE_V;
        return AVGPIPE_OK;
    }
    map = (int *)avgpipe_alloc(ctx, (size_t)nstages * sizeof(int));
    if (!map) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_set_place: out of memory");
    memcpy(map, rank_of, (size_t)nstages * sizeof(int));
    s->place = map;
    s->nplace = nstages;
    s->shape.placement = AVGPIPE_PLACE_CUSTOM;
    return AVGPIPE_OK;
}

/* Reserve exactly n ops for a rank (generators know their counts). */
static avgpipe_result avgpipe__sched_reserve(avgpipe_context *ctx, avgpipe_schedule *s, int rank, size_t n) {
    avgpipe_op *p;
    size_t cap = avgpipe__cap_of(n);
    if (s->ops[rank]) return AVGPIPE_OK;
    p = (avgpipe_op *)avgpipe_alloc(ctx, cap * sizeof(avgpipe_op));
    if (!p) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "out of memory reserving %zu ops", n);
    s->ops[rank] = p;
    return AVGPIPE_OK;
}

/* An empty schedule with src's ranks, shape, stages and placement. */
static avgpipe_result avgpipe__sched_init_like(avgpipe_context *ctx, avgpipe_schedule *dst, const avgpipe_schedule *src) {
    avgpipe_result res = avgpipe_sched_init(ctx, dst, src->nranks, &src->shape);
    if (res) return res;
    dst->nstages = src->nstages;
    if (src->place && src->nplace > 0) {
        dst->place = (int *)avgpipe_alloc(ctx, (size_t)src->nplace * sizeof(int));
        if (!dst->place) {
            avgpipe_sched_free(ctx, dst);
            return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "out of memory copying a placement of %d stages", src->nplace);
        }
        memcpy(dst->place, src->place, (size_t)src->nplace * sizeof(int));
        dst->nplace = src->nplace;
    }
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_sched_copy(avgpipe_context *ctx, const avgpipe_schedule *src, avgpipe_schedule *dst) {
    int r;
    avgpipe_result res;
    if (!src || !dst) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_copy: NULL argument");
    res = avgpipe__sched_init_like(ctx, dst, src);
    if (res) return res;
    dst->has_comm = src->has_comm;
    for (r = 0; r < src->nranks; r++) {
        size_t n = (size_t)src->len[r];
        res = avgpipe__sched_reserve(ctx, dst, r, n);
        if (res) {
            avgpipe_sched_free(ctx, dst);
            return res;
        }
        if (n) memcpy(dst->ops[r], src->ops[r], n * sizeof(avgpipe_op));
        dst->len[r] = (int)n;
    }
    return AVGPIPE_OK;
}

AVGPIPE_API int avgpipe_op_format(const avgpipe_op *op, int with_pipe, char *out, size_t cap) {
    char pre[16] = "";
    if (!op || !out || cap == 0) return 0;
    if (op->kind == AVGPIPE_OP_IDLE) {
        out[0] = 0;
        return 0;
    }
    if (with_pipe || op->pipe != 0) snprintf(pre, sizeof pre, "%d:", op->pipe);
    if (op->kind == AVGPIPE_OP_TIE)
        return snprintf(out, cap, "%s%dTIE%d@%d", pre, op->stage, op->micro, op->peer);
    if (avgpipe__has_micro(op->kind))
        return snprintf(out, cap, "%s%d%s%d", pre, op->stage, avgpipe_op_kind_name((avgpipe_op_kind)op->kind), op->micro);
    return snprintf(out, cap, "%s%d%s", pre, op->stage, avgpipe_op_kind_name((avgpipe_op_kind)op->kind));
}

enum { AVGPIPE__SC_IDLE = 1, AVGPIPE__SC_SYNC = 2, AVGPIPE__SC_MICRO = 4, AVGPIPE__SC_ROUND = 8, AVGPIPE__SC_BAD = 16 };

/* The scan's view of an op kind (AVGPIPE__SC_*). */
static uint8_t avgpipe__scan_class(int k) {
    if (k >= AVGPIPE_OP_KIND_COUNT) return AVGPIPE__SC_BAD;
    return (uint8_t)((k == AVGPIPE_OP_IDLE ? AVGPIPE__SC_IDLE : 0) | (avgpipe__is_sync(k) ? AVGPIPE__SC_SYNC : 0) |
                     (avgpipe__has_micro(k) ? AVGPIPE__SC_MICRO : 0) | (avgpipe__is_per_round(k) ? AVGPIPE__SC_ROUND : 0));
}

/* The scan over well-formed ops (most schedules): no branch per check, the checks folded into one
   flag. Returns 0 when some op fails one; the caller's full pass then says which. */
static int avgpipe__sched_scan_fast(const avgpipe_schedule *s, const int *home_of, int *npipes, long long *nmicro, int *nsync,
                                    long long *nops) {
    uint8_t cls[AVGPIPE_OP_KIND_COUNT];
    int r, i, k, N = *npipes, sync = 0, bad = 0;
    unsigned nst = (unsigned)s->nstages;
    long long U = 1, idle = 0, total = 0;
    for (k = 0; k < AVGPIPE_OP_KIND_COUNT; k++) cls[k] = avgpipe__scan_class(k);
    for (r = 0; r < s->nranks; r++) {
        const avgpipe_op *o = s->ops[r];
        int n = s->len[r];
        total += n;
        for (i = 0; i < n; i++) {
            unsigned g = (unsigned)o[i].stage;
            int c = o[i].kind < AVGPIPE_OP_KIND_COUNT ? (int)cls[o[i].kind] : (int)AVGPIPE__SC_BAD;
            int busy = !(c & AVGPIPE__SC_IDLE), home = g < nst ? home_of[g] : -1, p = o[i].pipe;
            long long u = (c & (AVGPIPE__SC_MICRO | AVGPIPE__SC_ROUND)) == AVGPIPE__SC_MICRO ? o[i].micro + 1LL : 0;
            idle += !busy;
            bad |= busy & ((home != r) | (p < 0) | ((c & AVGPIPE__SC_BAD) != 0) | ((c & AVGPIPE__SC_MICRO) && o[i].micro < 0));
            sync += (c & AVGPIPE__SC_SYNC) != 0;
            if (busy && p >= N) N = p + 1;
            if (busy && u > U) U = u;
        }
    }
    if (bad) return 0; /* nothing written */
    *npipes = N;
    *nmicro = U;
    *nsync = sync;
    *nops = total - idle;
    return 1;
}

/* The most (pipeline, stage, micro-batch) cells the tables of the scan's callers may span. */
#define AVGPIPE__MAX_CELLS 200000000LL

/* avgpipe__sched_scan: check every op's kind, stage placement, pipeline and micro-batch, and count
   the pipelines and the micro-batches per pipeline (across rounds): the sizes of the tables lowering
   and simulation keep. home (may be NULL) is the rank of each of the s->nstages stages, as
   avgpipe_stage_rank gives it. The _sync form also counts the TIE and AGREE ops (*nsync): the
   simulator skips its pass over the ops for their tables when there are none. */
static avgpipe_result avgpipe__sched_scan_sync(avgpipe_context *ctx, const avgpipe_schedule *s, const int *home_of, int *npipes,
                                               long long *nmicro, int *nsync) {
    int r, i, N = s->shape.pipes > 0 ? s->shape.pipes : 1, sync = 0;
    long long U = 1, nops = 0;
    *npipes = 1;
    *nmicro = 1;
    *nsync = 0;
    if (home_of && avgpipe__sched_scan_fast(s, home_of, &N, &U, &sync, &nops)) goto sized;
    if (!home_of && s->nstages > 0) { /* the placement's table, once: avgpipe_stage_rank per op was a third of the pass */
        int *home = (int *)avgpipe_alloc(ctx, (size_t)s->nstages * sizeof(int)), fast;
        if (home) {
            for (i = 0; i < s->nstages; i++) home[i] = avgpipe_stage_rank(s, i);
            fast = avgpipe__sched_scan_fast(s, home, &N, &U, &sync, &nops);
            avgpipe_free(ctx, home);
            if (fast) goto sized;
        }
    }
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++) {
            const avgpipe_op *op = &s->ops[r][i];
            char txt[64];
            int home;
            if (op->kind == AVGPIPE_OP_IDLE) continue;
            nops++;
            home = !home_of ? avgpipe_stage_rank(s, op->stage) : op->stage >= 0 && op->stage < s->nstages ? home_of[op->stage] : -1;
            if (op->kind >= AVGPIPE_OP_KIND_COUNT || home != r || op->pipe < 0 || (avgpipe__has_micro(op->kind) && op->micro < 0))
                avgpipe_op_format(op, 0, txt, sizeof txt); /* only for the messages below */
            if (op->kind >= AVGPIPE_OP_KIND_COUNT)
                return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE, "rank %d position %d: unknown op kind %d", r, i, op->kind);
            if (home != r) {
                if (home < 0)
                    return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE, "rank %d position %d (%s): stage %d is not placed (%d stages)", r, i,
                                         txt, op->stage, s->nstages);
                return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE, "rank %d position %d (%s): stage %d lives on rank %d (%s placement)",
                                     r, i, txt, op->stage, home, avgpipe_placement_name(s->shape.placement));
            }
            if (op->pipe < 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE, "rank %d position %d (%s): negative pipeline", r, i, txt);
            if (op->pipe >= N) N = op->pipe + 1;
            sync += avgpipe__is_sync(op->kind);
            if (avgpipe__has_micro(op->kind)) {
                if (op->micro < 0)
                    return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE, "rank %d position %d (%s): negative micro-batch", r, i, txt);
                if (!avgpipe__is_per_round(op->kind) && op->micro + 1LL > U) U = op->micro + 1LL;
            }
        }
sized:
    if ((long long)N * s->nstages * U > AVGPIPE__MAX_CELLS)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE, "schedule too large to simulate (%d pipelines x %d stages x %lld micro-batches)",
                             N, s->nstages, U);
    if (!avgpipe__cells_ok((double)N * s->nstages * (double)U, nops))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE,
                             "schedule numbered too sparsely to simulate: %d pipelines x %d stages x %lld micro-batches = %.4g cells for "
                             "%lld ops (at most %d cells per op)",
                             N, s->nstages, U, (double)N * s->nstages * (double)U, nops, AVGPIPE__CELLS_PER_OP);
    *npipes = N;
    *nmicro = U;
    *nsync = sync;
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__sched_scan(avgpipe_context *ctx, const avgpipe_schedule *s, const int *home_of, int *npipes,
                                          long long *nmicro) {
    int nsync;
    return avgpipe__sched_scan_sync(ctx, s, home_of, npipes, nmicro, &nsync);
}

/* What the scan counts, known in advance: a schedule avgpipe_sched_generate made (with STEPs, AVGs,
   TIEs and AGREEs added or not) spans every pipeline of its shape and micro x rounds micro-batches
   (tests/test_sched.c checks it against the scan for every kind); nsync: it may hold TIE or AGREE ops.
   The tuner passes it to the simulator and to its memory model, which then skip the scan (a pass over
   every op, a tenth of a prediction). Only for schedules the library generated: the scan also checks. */
typedef struct avgpipe__extent {
    int N, nsync;
    long long U;
} avgpipe__extent;

/* The extent of a generated schedule, or NULL (then the scan refuses it, as for any schedule) when its
   tables would pass the scan's limit. */
static const avgpipe__extent *avgpipe__extent_ok(const avgpipe_schedule *s, const avgpipe__extent *e) {
    return e && (long long)e->N * s->nstages * e->U <= AVGPIPE__MAX_CELLS ? e : NULL;
}

static avgpipe__extent avgpipe__gen_extent(const avgpipe_schedule *s, int nsync) {
    avgpipe__extent sp;
    sp.N = s->shape.pipes;
    sp.U = (long long)s->shape.micro * s->shape.rounds;
    sp.nsync = nsync;
    return sp;
}

/* --- 3. Text format --------------------------------------------------------------------------- */

/* ---- export ---- */

/* The placement the actions imply: LOOP when every op's stage is where loop placement puts it, else
   V when the V placement puts it there, else CUSTOM. With map (s->nstages entries), the rank of each
   stage an op names (-1 for the others); a stage on two ranks returns -1 with *conflict = that
   stage. */
static int avgpipe__place_of_ops(const avgpipe_schedule *s, int *map, int *conflict) {
    int r, i, loop = 1, v = 1, S = s->nranks;
    if (map)
        for (i = 0; i < s->nstages; i++) map[i] = -1;
    for (r = 0; r < S; r++)
        for (i = 0; i < s->len[r]; i++) {
            int g = s->ops[r][i].stage;
            if (s->ops[r][i].kind == AVGPIPE_OP_IDLE || g < 0) continue;
            loop &= avgpipe__place_formula(AVGPIPE_PLACE_LOOP, g, S) == r;
            v &= avgpipe__place_formula(AVGPIPE_PLACE_V, g, S) == r;
            if (map && g < s->nstages) {
                if (map[g] >= 0 && map[g] != r) {
                    *conflict = g;
                    return -1;
                }
                map[g] = r;
            }
        }
    return loop ? AVGPIPE_PLACE_LOOP : v ? AVGPIPE_PLACE_V : AVGPIPE_PLACE_CUSTOM;
}

/* The shape a header-less import gives the actions: ranks = lines, stages = highest stage + 1,
   V = stages / ranks, N = highest pipeline + 1, R = highest STEP/AVG round + 1, M = micro-batches per
   round. Also the highest stage and pipeline named (-1, 0 when none). */
static avgpipe_sched_desc avgpipe__shape_of_ops(const avgpipe_schedule *s, int *maxstage_out, int *maxpipe_out) {
    int r, i, maxstage = -1, maxpipe = 0, maxmicro = -1, maxround = -1, stages;
    avgpipe_sched_desc sh;
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++) {
            const avgpipe_op *op = &s->ops[r][i];
            if (op->kind == AVGPIPE_OP_IDLE) continue;
            if (op->stage > maxstage) maxstage = op->stage;
            if (op->pipe > maxpipe) maxpipe = op->pipe;
            if (avgpipe__is_per_round(op->kind)) {
                if (op->micro > maxround) maxround = op->micro;
            } else if (op->micro > maxmicro)
                maxmicro = op->micro;
        }
    memset(&sh, 0, sizeof sh);
    stages = maxstage + 1;
    sh.kind = AVGPIPE_SCHED_CUSTOM;
    sh.placement = (avgpipe_placement)avgpipe__place_of_ops(s, NULL, NULL);
    sh.stages = s->nranks;
    sh.chunks = stages > s->nranks ? (stages + s->nranks - 1) / s->nranks : 1;
    sh.pipes = maxpipe + 1;
    sh.rounds = maxround >= 0 ? maxround + 1 : 1;
    sh.micro = (maxmicro + 1) / sh.rounds;
    if (sh.micro < 1) sh.micro = 1;
    if (maxstage_out) *maxstage_out = maxstage;
    if (maxpipe_out) *maxpipe_out = maxpipe;
    return sh;
}

static int avgpipe__same_shape(const avgpipe_sched_desc *a, const avgpipe_sched_desc *b) {
    return a->kind == b->kind && a->stages == b->stages && a->micro == b->micro && a->pipes == b->pipes && a->chunks == b->chunks &&
           a->rounds == b->rounds && a->advance == b->advance && a->continuous == b->continuous && a->placement == b->placement;
}

/* A custom map import can infer: every stage named by an op on the rank the map says (-1: out of
   memory). */
static int avgpipe__place_inferable(avgpipe_context *ctx, const avgpipe_schedule *s) {
    int g, ok = 1, conflict = -1, *map;
    if (s->shape.placement != AVGPIPE_PLACE_CUSTOM) return 1;
    if (!s->place || s->nplace < s->nstages) return 0;
    map = (int *)avgpipe_alloc(ctx, ((size_t)s->nstages + 1) * sizeof(int));
    if (!map) return -1;
    if (avgpipe__place_of_ops(s, map, &conflict) < 0) ok = 0;
    for (g = 0; g < s->nstages && ok; g++) ok = map[g] == s->place[g];
    avgpipe_free(ctx, map);
    return ok;
}

static int avgpipe__needs_ext(avgpipe_context *ctx, const avgpipe_schedule *s) {
    int r, i, last = s->nranks - 1;
    avgpipe_sched_desc inferred = avgpipe__shape_of_ops(s, NULL, NULL), own = s->shape;
    if (own.micro < 1) own.micro = inferred.micro; /* a hand-built schedule that never set it: the actions say */
    if (s->shape.kind != AVGPIPE_SCHED_CUSTOM || s->shape.pipes > 1 || s->shape.rounds > 1) return 1;
    if (avgpipe__place_inferable(ctx, s) != 1) return 1;
    /* a shape that import would not infer from the actions (a header's micro=8 over a partial
       schedule): only the header keeps it */
    if (!avgpipe__same_shape(&inferred, &own)) return 1;
    /* An empty last rank line reads back as a blank line at the end of the file, which import drops
       (editors add them) unless the header's stage count says it is a rank. */
    if (last >= 0 && (s->len[last] == 0 || (s->len[last] == 1 && s->ops[last][0].kind == AVGPIPE_OP_IDLE))) return 1;
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++) {
            int k = s->ops[r][i].kind;
            if (avgpipe__is_per_round(k) || s->ops[r][i].pipe != 0) return 1;
        }
    return 0;
}

AVGPIPE_API avgpipe_result avgpipe_sched_export(avgpipe_context *ctx, const avgpipe_schedule *s, unsigned flags,
                                                avgpipe_buf *out) {
    int r, i, ok = 1, torch = (flags & AVGPIPE_TEXT_TORCH) != 0, ext;
    char txt[64];
    if (!s || !out || !s->len) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_export: NULL argument");
    if (s->shape.placement == AVGPIPE_PLACE_CUSTOM && (!s->place || s->nplace < s->nstages))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_export: custom placement without a map of its %d stages", s->nstages);
    if (torch && s->shape.pipes > 1)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG,
                             "avgpipe_sched_export: PyTorch's format has no parallel pipelines (pipes = %d)", s->shape.pipes);
    ext = !torch && avgpipe__needs_ext(ctx, s);
    out->len = 0;
    if (ext) {
        ok &= avgpipe__buf_printf(ctx, out,
                                  "# avgpipe version=%d kind=%s stages=%d chunks=%d micro=%d pipes=%d rounds=%d advance=%d continuous=%d",
                                  AVGPIPE__TEXT_VERSION, avgpipe_sched_kind_name(s->shape.kind), s->nranks, s->shape.chunks,
                                  s->shape.micro > 0 ? s->shape.micro : avgpipe__shape_of_ops(s, NULL, NULL).micro, s->shape.pipes,
                                  s->shape.rounds, s->shape.advance, s->shape.continuous);
        if (s->shape.placement != AVGPIPE_PLACE_LOOP)
            ok &= avgpipe__buf_printf(ctx, out, " placement=%s", avgpipe_placement_name(s->shape.placement));
        if (s->shape.placement == AVGPIPE_PLACE_CUSTOM)
            for (i = 0; i < s->nstages && ok; i++) ok &= avgpipe__buf_printf(ctx, out, "%s%d", i ? "," : " place=", s->place[i]);
        ok &= avgpipe__buf_put(ctx, out, "\n", 1);
    }
    for (r = 0; r < s->nranks && ok; r++) {
        int first = 1, in_group = 0;
        for (i = 0; i < s->len[r] && ok; i++) {
            const avgpipe_op *op = &s->ops[r][i];
            if (torch && avgpipe__is_per_round(op->kind)) continue;
            if (!in_group) {
                if (!first) ok &= avgpipe__buf_put(ctx, out, ",", 1);
                first = 0;
                if (op->flags & AVGPIPE_OPF_OVERLAP_NEXT) {
                    ok &= avgpipe__buf_put(ctx, out, "(", 1);
                    in_group = 1;
                }
            } else {
                ok &= avgpipe__buf_put(ctx, out, ";", 1);
            }
            avgpipe_op_format(op, 0, txt, sizeof txt);
            ok &= avgpipe__buf_put(ctx, out, txt, strlen(txt));
            if (in_group && !(op->flags & AVGPIPE_OPF_OVERLAP_NEXT)) {
                ok &= avgpipe__buf_put(ctx, out, ")OVERLAP_F_B", 12);
                in_group = 0;
            }
        }
        if (in_group) ok &= avgpipe__buf_put(ctx, out, ")OVERLAP_F_B", 12);
        ok &= avgpipe__buf_put(ctx, out, "\n", 1);
    }
    if (!ok) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_export: out of memory");
    return AVGPIPE_OK;
}

/* ---- import ---- */

typedef struct avgpipe__lexer {
    const char *p, *end;
    int line;
} avgpipe__lexer;

static int avgpipe__parse_int(const char **pp, const char *end, int *out) {
    const char *p = *pp;
    long v = 0;
    if (p >= end || *p < '0' || *p > '9') return 0;
    while (p < end && *p >= '0' && *p <= '9') {
        v = v * 10 + (*p - '0');
        if (v > 1000000000L) return 0;
        p++;
    }
    *out = (int)v;
    *pp = p;
    return 1;
}

/* Parse one action "[P:]<stage><KIND>[<micro>]" in [p, end). */
static int avgpipe__parse_action(const char *p, const char *end, avgpipe_op *op, const char **why) {
    int a, b = 0, k, best = -1;
    size_t bestlen = 0;
    *op = avgpipe__op(AVGPIPE_OP_IDLE, 0, 0, -1);
    if (!avgpipe__parse_int(&p, end, &a)) {
        *why = "expected a stage number";
        return 0;
    }
    if (p < end && *p == ':') {
        p++;
        if (a >= AVGPIPE__MAX_PIPES) {
            *why = "pipeline number too large (at most 32767 pipelines)";
            return 0;
        }
        op->pipe = (int16_t)a;
        if (!avgpipe__parse_int(&p, end, &a)) {
            *why = "expected a stage number after the pipeline";
            return 0;
        }
    }
    if (a >= AVGPIPE__MAX_STAGES) {
        *why = "stage number too large (at most 32767 stage partitions)";
        return 0;
    }
    op->stage = a;
    for (k = 1; k < AVGPIPE_OP_KIND_COUNT; k++) { /* longest match: SEND_F before F, etc. */
        size_t n = strlen(avgpipe__op_names[k]);
        if ((size_t)(end - p) >= n && memcmp(p, avgpipe__op_names[k], n) == 0 && n > bestlen) {
            best = k;
            bestlen = n;
        }
    }
    if (best < 0) {
        *why = "unknown action kind";
        return 0;
    }
    op->kind = (uint8_t)best;
    p += bestlen;
    if (avgpipe__has_micro(best)) {
        if (!avgpipe__parse_int(&p, end, &b)) {
            *why = "expected a micro-batch number";
            return 0;
        }
        op->micro = b;
    }
    if (best == AVGPIPE_OP_TIE) { /* "<stage>TIE<round>@<peer stage>" */
        if (p >= end || *p != '@' || (p++, !avgpipe__parse_int(&p, end, &b))) {
            *why = "expected '@' and the tied stage after TIE<round>";
            return 0;
        }
        if (b >= AVGPIPE__MAX_STAGES) {
            *why = "tied stage number too large (at most 32767 stage partitions)";
            return 0;
        }
        op->peer = b;
    }
    if (p != end) {
        *why = "unexpected characters after the action";
        return 0;
    }
    return 1;
}

static int avgpipe__is_space(char c) { return c == ' ' || c == '\t' || c == '\r'; }

/* A short printable copy of input text for error messages: at most 40 characters, others as '?'. */
static const char *avgpipe__quote(const char *p, size_t n, char *out, size_t cap) {
    size_t i, m = n > 40 ? 40 : n;
    if (m + 4 > cap) m = cap - 4;
    for (i = 0; i < m; i++) out[i] = (p[i] >= 32 && p[i] < 127) ? p[i] : '?';
    if (n > m) out[i++] = '.', out[i++] = '.', out[i++] = '.';
    out[i] = 0;
    return out;
}

/* A header's explicit map "place=0,1,1,0" in [p, end): into *map (allocated, *n entries). */
static avgpipe_result avgpipe__parse_place(avgpipe_context *ctx, const char *p, const char *end, int line, int **map, int *n) {
    int cap = 0, v;
    avgpipe_free(ctx, *map);
    *map = NULL;
    *n = 0;
    while (p < end) {
        if (!avgpipe__parse_int(&p, end, &v) || v >= AVGPIPE__MAX_STAGES || (p < end && *p != ','))
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: field 'place' needs ranks separated by commas", line);
        if (*n == AVGPIPE__MAX_STAGES)
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: field 'place' places more than %d stages", line, AVGPIPE__MAX_STAGES);
        if (*n == cap) {
            int c2 = cap ? 2 * cap : 16, *q = (int *)avgpipe__realloc(ctx, *map, (size_t)cap * sizeof(int), (size_t)c2 * sizeof(int));
            if (!q) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "out of memory reading 'place'");
            *map = q;
            cap = c2;
        }
        (*map)[(*n)++] = v;
        if (p < end) p++; /* the comma */
        if (p == end && end[-1] == ',')
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: field 'place' needs ranks separated by commas", line);
    }
    return AVGPIPE_OK;
}

/* "# avgpipe key=value ...": the shape into *sh, an explicit stage map into *map (*nmap entries). */
static avgpipe_result avgpipe__parse_header(avgpipe_context *ctx, const char *p, const char *end, int line,
                                            avgpipe_sched_desc *sh, int **map, int *nmap) {
    while (p < end) {
        const char *k0, *k1, *v0;
        char key[32], val[32], q[48];
        int iv = 0, k;
        while (p < end && avgpipe__is_space(*p)) p++;
        if (p >= end) break;
        k0 = p;
        while (p < end && *p != '=' && !avgpipe__is_space(*p)) p++;
        k1 = p;
        if (p >= end || *p != '=')
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: header field '%s' has no '='", line,
                                 avgpipe__quote(k0, (size_t)(k1 - k0), q, sizeof q));
        p++;
        v0 = p;
        while (p < end && !avgpipe__is_space(*p)) p++;
        if ((size_t)(k1 - k0) == 5 && memcmp(k0, "place", 5) == 0 && p > v0) {
            avgpipe_result res = avgpipe__parse_place(ctx, v0, p, line, map, nmap);
            if (res) return res;
            continue;
        }
        if ((size_t)(k1 - k0) >= sizeof key || (size_t)(p - v0) >= sizeof val || p == v0)
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: bad header field '%s'", line,
                                 avgpipe__quote(k0, (size_t)(p - k0), q, sizeof q));
        memcpy(key, k0, (size_t)(k1 - k0));
        key[k1 - k0] = 0;
        memcpy(val, v0, (size_t)(p - v0));
        val[p - v0] = 0;
        if (strcmp(key, "kind") == 0) {
            if (avgpipe_sched_kind_parse(val, &sh->kind))
                return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: unknown schedule kind '%s'", line, val);
            continue;
        }
        if (strcmp(key, "placement") == 0) {
            for (k = AVGPIPE_PLACE_LOOP; k < AVGPIPE_PLACE_COUNT && strcmp(val, avgpipe__place_names[k]) != 0; k++) {
            }
            if (k == AVGPIPE_PLACE_COUNT)
                return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: unknown placement '%s' (loop, v, custom)", line, val);
            sh->placement = (avgpipe_placement)k;
            continue;
        }
        {
            const char *q = val;
            if (!avgpipe__parse_int(&q, val + strlen(val), &iv) || *q)
                return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: field '%s' needs a number, got '%s'", line, key, val);
        }
        if (strcmp(key, "version") == 0) {
            if (iv < 1 || iv > AVGPIPE__TEXT_VERSION)
                return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: format version %d (this avgpipe reads versions 1 to %d%s)", line,
                                     iv, AVGPIPE__TEXT_VERSION, iv > AVGPIPE__TEXT_VERSION ? ": written by a newer avgpipe" : "");
        } else if (strcmp(key, "stages") == 0) sh->stages = iv;
        else if (strcmp(key, "chunks") == 0) sh->chunks = iv;
        else if (strcmp(key, "micro") == 0) sh->micro = iv;
        else if (strcmp(key, "pipes") == 0) sh->pipes = iv;
        else if (strcmp(key, "rounds") == 0) sh->rounds = iv;
        else if (strcmp(key, "advance") == 0) sh->advance = iv;
        else if (strcmp(key, "continuous") == 0) sh->continuous = iv;
        else return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: unknown header field '%s'", line, key);
    }
    return AVGPIPE_OK;
}

/* Parse one rank line into rank r of s. */
static avgpipe_result avgpipe__parse_line(avgpipe_context *ctx, const char *p, const char *end, int line,
                                          avgpipe_schedule *s, int r) {
    for (;;) {
        const char *f = p, *fe;
        avgpipe_op op;
        const char *why = "";
        char q[48], qq[48];
        while (p < end && *p != ',') p++;
        fe = p;
        while (f < fe && avgpipe__is_space(*f)) f++;
        while (fe > f && avgpipe__is_space(fe[-1])) fe--;
        if (f == fe) {
            if (avgpipe_sched_push(ctx, s, r, avgpipe__op(AVGPIPE_OP_IDLE, 0, 0, -1))) return AVGPIPE_OUT_OF_MEMORY;
        } else if (*f == '(') {
            const char *close = NULL, *c, *a;
            static const char tail[] = ")OVERLAP_F_B";
            size_t tl = sizeof tail - 1;
            int nsub = 0;
            if ((size_t)(fe - f) > tl && memcmp(fe - tl, tail, tl) == 0) close = fe - tl;
            if (!close)
                return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: composite '%s' must end in )OVERLAP_F_B", line,
                                     avgpipe__quote(f, (size_t)(fe - f), q, sizeof q));
            a = f + 1;
            for (c = a; c <= close; c++) {
                if (c == close || *c == ';') {
                    if (!avgpipe__parse_action(a, c, &op, &why))
                        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: action '%s': %s", line,
                                         avgpipe__quote(a, (size_t)(c - a), qq, sizeof qq), why);
                    if (c != close) op.flags |= AVGPIPE_OPF_OVERLAP_NEXT;
                    if (avgpipe_sched_push(ctx, s, r, op)) return AVGPIPE_OUT_OF_MEMORY;
                    nsub++;
                    a = c + 1;
                }
            }
            if (nsub < 2)
                return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: composite '%s' needs at least two actions", line,
                                     avgpipe__quote(f, (size_t)(fe - f), q, sizeof q));
        } else {
            if (!avgpipe__parse_action(f, fe, &op, &why))
                return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: action '%s': %s", line,
                                 avgpipe__quote(f, (size_t)(fe - f), q, sizeof q), why);
            if (avgpipe_sched_push(ctx, s, r, op)) return AVGPIPE_OUT_OF_MEMORY;
        }
        if (p >= end) break;
        p++; /* the comma */
    }
    return AVGPIPE_OK;
}

/* The generators' limits (avgpipe_sched_resolve), for a header's shape or the one inferred from the
   actions: every schedule import accepts, written or inferred, stays within them, so that its export
   (which writes the shape to a header) imports again. `what` says which shape; zero counts are
   refused elsewhere, naming them. */
static avgpipe_result avgpipe__shape_limits(avgpipe_context *ctx, const avgpipe_sched_desc *sh, const char *what) {
    double V = sh->chunks > 1 ? sh->chunks : 1, G = (double)sh->stages * V;
    double total = G * (sh->pipes > 1 ? sh->pipes : 1) * (sh->micro > 1 ? sh->micro : 1) * (sh->rounds > 1 ? sh->rounds : 1);
    if (G > AVGPIPE__MAX_STAGES)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "%s: stages x chunks = %.0f, at most %d", what, G, AVGPIPE__MAX_STAGES);
    if (sh->pipes > AVGPIPE__MAX_PIPES)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "%s: pipes = %d, at most %d", what, sh->pipes, AVGPIPE__MAX_PIPES);
    if ((double)sh->micro * sh->rounds > AVGPIPE__MAX_MICRO_ROUNDS)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "%s: micro x rounds = %.4g, at most %.0g", what, (double)sh->micro * sh->rounds,
                             AVGPIPE__MAX_MICRO_ROUNDS);
    if (total * 3 > (double)AVGPIPE__MAX_OPS)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "%s: stages x chunks x pipes x micro x rounds = %.4g, at most %.4g", what, total,
                             (double)AVGPIPE__MAX_OPS / 3);
    return AVGPIPE_OK;
}

/* The placement: the header's, checked against the actions, or inferred from them (each stage on
   one rank). A custom map may place any number of stages that the ranks x chunks hold: the header's
   map says how many, else the highest stage an action names. line_of[r] is rank r's line in the
   text. Takes *map (the header's place= list). */
static avgpipe_result avgpipe__infer_place(avgpipe_context *ctx, avgpipe_schedule *s, avgpipe_placement said, int **map, int nmap,
                                           const int *line_of) {
    int g, r, i, conflict = -1, kind, G = s->nstages, *seen;
    if (*map && said != AVGPIPE_PLACE_CUSTOM) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "header: place= needs placement=custom");
    if (*map && (nmap > G || nmap <= G - s->nranks))
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "header: place= names %d stages, %d ranks x %d chunks hold %d to %d", nmap, s->nranks,
                             s->shape.chunks, G - s->nranks + 1, G);
    seen = (int *)avgpipe_alloc(ctx, ((size_t)G + 1) * sizeof(int));
    if (!seen) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "out of memory placing %d stages", G);
    kind = avgpipe__place_of_ops(s, seen, &conflict);
    if (kind < 0) { /* name both lines */
        int first = -1, other = -1;
        for (r = 0; r < s->nranks && other < 0; r++)
            for (i = 0; i < s->len[r]; i++)
                if (s->ops[r][i].kind != AVGPIPE_OP_IDLE && s->ops[r][i].stage == conflict) {
                    if (first < 0) first = r;
                    else if (r != first) other = r;
                    break;
                }
        avgpipe_free(ctx, seen);
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "stage %d appears on two ranks: %d (line %d) and %d (line %d); a stage lives on one rank",
                             conflict, first, line_of[first], other, line_of[other]);
    }
    if (said == AVGPIPE_PLACE_AUTO) said = (avgpipe_placement)kind;
    if (said == AVGPIPE_PLACE_CUSTOM) {
        if (*map) { /* the header's */
            avgpipe_free(ctx, seen);
            seen = *map;
            *map = NULL;
            s->nstages = nmap;
        } else { /* the actions': every stage up to the highest one named must be */
            while (s->nstages > G - s->nranks + 1 && seen[s->nstages - 1] < 0) s->nstages--;
            for (g = 0; g < s->nstages; g++)
                if (seen[g] < 0) {
                    avgpipe_free(ctx, seen);
                    return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR,
                                         "the actions place their stages on neither the loop nor the V placement, and stage %d appears on "
                                         "no rank: give the map in the header (placement=custom place=...)",
                                         g);
                }
        }
        for (g = 0; g < s->nstages; g++)
            if (seen[g] >= s->nranks) {
                int bad = seen[g];
                avgpipe_free(ctx, seen);
                return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "header: place= puts stage %d on rank %d of %d", g, bad, s->nranks);
            }
        s->place = seen;
        s->nplace = s->nstages;
        seen = NULL;
    }
    s->shape.placement = said;
    avgpipe_free(ctx, seen);
    for (r = 0; r < s->nranks; r++) /* the header's placement against the actions */
        for (i = 0; i < s->len[r]; i++) {
            const avgpipe_op *op = &s->ops[r][i];
            int home = op->kind == AVGPIPE_OP_IDLE ? r : avgpipe_stage_rank(s, op->stage);
            if (home != r) {
                char txt[64];
                avgpipe_op_format(op, 0, txt, sizeof txt);
                return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: action %s runs stage %d on rank %d, but the %s placement puts it on rank %d",
                                     line_of[r], txt, op->stage, r, avgpipe_placement_name(said), home);
            }
        }
    return AVGPIPE_OK;
}

/* Infer what the header did not say. */
static avgpipe_result avgpipe__infer_shape(avgpipe_context *ctx, avgpipe_schedule *s, int have_header) {
    int r, i, maxstage, maxpipe;
    avgpipe_sched_desc inferred = avgpipe__shape_of_ops(s, &maxstage, &maxpipe);
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++)
            if (avgpipe__is_comm(s->ops[r][i].kind)) s->has_comm = 1;
    if (!have_header) {
        avgpipe_result res =
            avgpipe__shape_limits(ctx, &inferred, "the shape the actions imply (rank lines, highest stage, pipeline, micro-batch)");
        if (res) return res;
        s->shape = inferred;
    } else {
        if (s->shape.stages != s->nranks)
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "header says stages=%d but the file has %d rank lines",
                                 s->shape.stages, s->nranks);
        if (s->shape.chunks < 1 || s->shape.micro < 1 || s->shape.pipes < 1 || s->shape.rounds < 1)
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "header: chunks, micro, pipes and rounds must be >= 1");
        if (maxpipe >= s->shape.pipes)
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "header says pipes=%d but an action names pipeline %d",
                                 s->shape.pipes, maxpipe);
    }
    s->nstages = s->nranks * s->shape.chunks;
    if (maxstage >= s->nstages)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "an action names stage %d but %d ranks x %d chunks hold %d stages",
                             maxstage, s->nranks, s->shape.chunks, s->nstages);
    return AVGPIPE_OK;
}

static const char avgpipe__header_tag[] = "# avgpipe ";

/* Rank lines (not comments) in [p, end); a final newline does not start a line. */
static int avgpipe__count_rank_lines(const char *p, const char *end) {
    int n = 0;
    while (p < end) {
        const char *e = (const char *)memchr(p, '\n', (size_t)(end - p));
        if (!e) e = end;
        if (*p != '#' && n < INT_MAX) n++;
        p = e + 1;
    }
    return n;
}

/* The end of the text that holds ranks. Blank lines at the end are not ranks (editors add them; one
   final newline is kept), except as many as a header's stage count still needs: an exported schedule
   whose last ranks are empty ends in empty lines, and writes the header for them. */
static const char *avgpipe__ranks_end(const char *text, size_t len, int have_header, int stages, int *nlines) {
    const char *full = text + len, *end = full;
    int open;
    while (end > text && (end[-1] == '\n' || end[-1] == '\r') && (end - 1 == text || end[-2] == '\n' || end[-2] == '\r')) end--;
    *nlines = avgpipe__count_rank_lines(text, end);
    open = end > text && end[-1] != '\n'; /* the next newline only ends the last line */
    while (have_header && *nlines < stages && end < full) {
        const char *nl = (const char *)memchr(end, '\n', (size_t)(full - end));
        if (!nl) break;
        end = nl + 1;
        if (open) open = 0;
        else ++*nlines;
    }
    return end;
}

AVGPIPE_API avgpipe_result avgpipe_sched_import(avgpipe_context *ctx, const char *text, size_t len, avgpipe_schedule *out) {
    const char *p, *end;
    int nlines = 0, line = 0, r = 0, have_header = 0;
    size_t taglen = sizeof avgpipe__header_tag - 1;
    avgpipe_sched_desc sh;
    avgpipe_result res;
    int *map = NULL, nmap = 0, *line_of = NULL;
    if (!text || !out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_import: NULL argument");
    memset(out, 0, sizeof *out);
    memset(&sh, 0, sizeof sh);
    if (len >= taglen && memcmp(text, avgpipe__header_tag, taglen) == 0) { /* first: its stage count says which lines are ranks */
        const char *e = (const char *)memchr(text, '\n', len);
        if (!e) e = text + len;
        if (e > text && e[-1] == '\r') e--;
        res = avgpipe__parse_header(ctx, text + taglen, e, 1, &sh, &map, &nmap);
        if (!res) res = avgpipe__shape_limits(ctx, &sh, "line 1: header");
        if (res) {
            avgpipe_free(ctx, map);
            return res;
        }
        have_header = 1;
    }
    end = avgpipe__ranks_end(text, len, have_header, sh.stages, &nlines);
    if (nlines == 0 || nlines > AVGPIPE__MAX_STAGES) { /* a rank holds at least one stage partition */
        avgpipe_free(ctx, map);
        if (nlines == 0) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "schedule text has no rank lines");
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "schedule text has %d rank lines (at most %d)", nlines, AVGPIPE__MAX_STAGES);
    }
    res = avgpipe_sched_init(ctx, out, nlines, NULL);
    if (!res && !(line_of = (int *)avgpipe_alloc(ctx, (size_t)nlines * sizeof(int))))
        res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_import: out of memory");
    if (res) goto fail;
    for (p = text; p < end;) {
        const char *e = (const char *)memchr(p, '\n', (size_t)(end - p)), *le;
        if (!e) e = end;
        line++;
        le = e;
        if (le > p && le[-1] == '\r') le--;
        if (*p == '#') { /* a comment, or the header (line 1: parsed above) */
            if (line != 1 && (size_t)(le - p) >= taglen && memcmp(p, avgpipe__header_tag, taglen) == 0) {
                res = avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "line %d: the '# avgpipe' header must be the first line", line);
                goto fail;
            }
        } else {
            line_of[r] = line;
            res = avgpipe__parse_line(ctx, p, le, line, out, r++);
            if (res) goto fail;
        }
        p = e + 1;
    }
    if (have_header) {
        out->shape = sh;
        if (out->shape.chunks == 0) out->shape.chunks = 1;
    }
    out->shape.placement = AVGPIPE_PLACE_LOOP; /* until inferred: the shape checks need a named one */
    res = avgpipe__infer_shape(ctx, out, have_header);
    if (!res) res = avgpipe__infer_place(ctx, out, sh.placement, &map, nmap, line_of);
    if (res) goto fail;
    avgpipe_free(ctx, line_of);
    return AVGPIPE_OK;
fail:
    avgpipe_free(ctx, map);
    avgpipe_free(ctx, line_of);
    avgpipe_sched_free(ctx, out);
    return res;
}

#ifndef AVGPIPE_NO_STDIO
AVGPIPE_API avgpipe_result avgpipe_sched_load(avgpipe_context *ctx, const char *path, avgpipe_schedule *out) {
    avgpipe_buf text = {NULL, 0, 0};
    avgpipe_result res;
    if (!path || !out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_load: NULL argument");
    res = avgpipe__read_file(ctx, path, &text, &avgpipe__file_schedule);
    if (res) return res;
    res = avgpipe_sched_import(ctx, text.data ? text.data : "", text.len, out);
    if (res) avgpipe__fail_in_file(ctx, res, path);
    avgpipe_buf_free(ctx, &text);
    return res;
}

AVGPIPE_API avgpipe_result avgpipe_sched_save(avgpipe_context *ctx, const avgpipe_schedule *s, unsigned flags,
                                              const char *path) {
    avgpipe_buf b = {NULL, 0, 0};
    FILE *f;
    avgpipe_result res = avgpipe_sched_export(ctx, s, flags, &b);
    if (res) return res;
    f = fopen(path, "wb");
    if (!f) {
        avgpipe_buf_free(ctx, &b);
        return avgpipe__fail(ctx, AVGPIPE_IO_ERROR, "cannot create '%s'", path);
    }
    if (fwrite(b.data, 1, b.len, f) != b.len) res = avgpipe__fail(ctx, AVGPIPE_IO_ERROR, "cannot write '%s'", path);
    if (fclose(f) != 0 && !res) res = avgpipe__fail(ctx, AVGPIPE_IO_ERROR, "cannot write '%s'", path);
    avgpipe_buf_free(ctx, &b);
    return res;
}
#endif

/* --- 4. Generators ---------------------------------------------------------------------------- */

AVGPIPE_API avgpipe_sched_desc avgpipe_sched_query_defaults(const avgpipe_sched_desc *desc) {
    const avgpipe_sched_kind_info *info;
    avgpipe_sched_desc d;
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    if (d.pipes == 0) d.pipes = 1;
    if (d.rounds == 0) d.rounds = 1;
    info = d.kind > AVGPIPE_SCHED_CUSTOM ? avgpipe_sched_kind_query(d.kind) : NULL;
    if (!info) return d;
    if (d.chunks == 0) d.chunks = info->chunks ? info->chunks : 2;
    if ((int)d.placement >= 0 && d.placement < AVGPIPE_PLACE_CUSTOM) d.placement = avgpipe__placement_of(d.kind, d.placement);
    if (d.chunks == 1 && d.placement != AVGPIPE_PLACE_CUSTOM) d.placement = AVGPIPE_PLACE_LOOP; /* one stage per rank: the placements agree */
    if (!info->advance) d.advance = 0;
    return d;
}

AVGPIPE_API avgpipe_result avgpipe_sched_resolve(avgpipe_context *ctx, const avgpipe_sched_desc *desc,
                                                 avgpipe_sched_desc *out) {
    const avgpipe_sched_kind_info *info;
    avgpipe_sched_desc d;
    double total;
    if (!desc || !out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_resolve: NULL argument");
    d = *desc;
    if (d.kind <= AVGPIPE_SCHED_CUSTOM || d.kind >= AVGPIPE_SCHED_KIND_COUNT)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "kind: %d is not a generator (afab, 1f1b, advance, interleaved, zbh1, zbv, dualpipev)",
                             (int)d.kind);
    if (d.stages < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "stages: must be >= 1 (got %d)", d.stages);
    if (d.micro < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "micro: must be >= 1 (got %d)", d.micro);
    if (d.pipes < 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "pipes: must be >= 1 (got %d)", d.pipes);
    if (d.chunks < 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "chunks: must be >= 1 (got %d)", d.chunks);
    if (d.rounds < 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "rounds: must be >= 1 (got %d)", d.rounds);
    if (d.advance < 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "advance: must be >= 0 (got %d)", d.advance);
    if (d.continuous != 0 && d.continuous != 1)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "continuous: must be 0 or 1 (got %d)", d.continuous);
    if ((int)d.placement < 0 || d.placement >= AVGPIPE_PLACE_COUNT)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "placement: %d is not a placement (auto, loop, v)", (int)d.placement);
    if (d.placement == AVGPIPE_PLACE_CUSTOM)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "placement: generators place stages by a named placement (loop, v); "
                                                       "set a custom map on the schedule (avgpipe_sched_set_place)");
    info = avgpipe_sched_kind_query(d.kind); /* the kind's row: what follows is read from it */
    d = avgpipe_sched_query_defaults(&d);
    if (info->chunks == 1 && d.chunks > 1)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "chunks: %d chunks per rank need a kind that holds several (%s takes 1)",
                             d.chunks, info->name);
    if (info->chunks > 1 && d.chunks != info->chunks)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "chunks: %s holds %d stages per rank (got %d)", info->name, info->chunks, d.chunks);
    if (d.chunks > 1 && d.placement != info->placement)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "placement: %s places its stages in the %s placement (got %s)", info->name,
                             avgpipe_placement_name(info->placement), avgpipe_placement_name(d.placement));
    if (info->micro_multiple && d.chunks > 1 && d.micro % d.stages != 0)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "micro: %s needs micro to be a multiple of stages (micro=%d, stages=%d)", info->name,
                             d.micro, d.stages);
    if ((long long)d.pipes * d.micro < (long long)info->micro_pipes_per_stage * d.stages)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "micro: %s needs micro x pipes >= %d x stages (%lld < %d)", info->name,
                             info->micro_pipes_per_stage, (long long)d.pipes * d.micro, info->micro_pipes_per_stage * d.stages);
    if (d.pipes > AVGPIPE__MAX_PIPES) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "pipes: at most %d (got %d)", AVGPIPE__MAX_PIPES, d.pipes);
    if ((long long)d.stages * d.chunks > AVGPIPE__MAX_STAGES)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "stages: stages x chunks must be at most %d", AVGPIPE__MAX_STAGES);
    total = (double)d.stages * d.chunks * d.pipes * d.micro * d.rounds; /* in double: no overflow */
    if (total * 3 > (double)AVGPIPE__MAX_OPS || (double)d.micro * d.rounds > AVGPIPE__MAX_MICRO_ROUNDS)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "micro: stages x chunks x pipes x micro x rounds = %.4g is too large", total);
    *out = d;
    return AVGPIPE_OK;
}

static long long avgpipe__advance_extra(const avgpipe_sched_desc *d, int r);

/* Each kind's warm-up (the forwards a rank runs before its first backward) and peak stash, on a resolved
   description; avgpipe_sched_warmup and avgpipe_sched_peak_stash document the formulas. The kinds' table
   (avgpipe__kind_rows, below) names the pair of each kind. T = N·M: the micro-batches of one round. */
static long long avgpipe__round_micro(const avgpipe_sched_desc *d) { return (long long)d->pipes * d->micro; }
static int avgpipe__cap(long long w, long long cap) { return (int)(w < cap ? w : cap); }
static int avgpipe__warm_all(const avgpipe_sched_desc *d, int r) { (void)r; return (int)avgpipe__round_micro(d); }
static int avgpipe__warm_1f1b(const avgpipe_sched_desc *d, int r) {
    return avgpipe__cap(d->stages - r - 1, avgpipe__round_micro(d));
}
static int avgpipe__warm_advance(const avgpipe_sched_desc *d, int r) {
    long long S = d->stages, dist = S - r - 1;
    if (r >= S - 1) return 0;
    /* dist + floor(K·dist/(S-1) + 1/2) */
    return avgpipe__cap(dist + (2 * (long long)d->advance * dist + (S - 1)) / (2 * (S - 1)), avgpipe__round_micro(d));
}
static int avgpipe__warm_interleaved(const avgpipe_sched_desc *d, int r) {
    if (d->chunks == 1) return avgpipe__warm_1f1b(d, r);
    return avgpipe__cap(2LL * (d->stages - r - 1) + (long long)(d->chunks - 1) * d->stages, avgpipe__round_micro(d) * d->chunks);
}
/* ZB-V: the chunk-0 forwards before the first I1 (K's share extra), and r + 1 chunk-1 ones. */
static int avgpipe__warm_zbv(const avgpipe_sched_desc *d, int r) {
    long long T = avgpipe__round_micro(d);
    return avgpipe__cap(2LL * d->stages - r - 1 + avgpipe__advance_extra(d, r), T) + avgpipe__cap(r + 1, T);
}
static int avgpipe__warm_dualpipev(const avgpipe_sched_desc *d, int r) {
    return r == d->stages - 1 ? 2 * d->stages + 1 : 2 * d->stages;
}

typedef int (*avgpipe__warm_fn)(const avgpipe_sched_desc *d, int r);
static int avgpipe__peak_all(avgpipe__warm_fn warm, const avgpipe_sched_desc *d, int r) {
    (void)warm, (void)r;
    return (int)(avgpipe__round_micro(d) * d->chunks);
}
static int avgpipe__peak_after_warmup(avgpipe__warm_fn warm, const avgpipe_sched_desc *d, int r) {
    return avgpipe__cap(warm(d, r) + 1LL, avgpipe__round_micro(d) * d->chunks);
}
static int avgpipe__peak_zbh1(avgpipe__warm_fn warm, const avgpipe_sched_desc *d, int r) {
    (void)warm, (void)r;
    return avgpipe__cap(d->stages, avgpipe__round_micro(d) * d->chunks);
}
/* ZB-V: no W before the first I, so the warm-up is the peak. */
static int avgpipe__peak_warmup(avgpipe__warm_fn warm, const avgpipe_sched_desc *d, int r) { return warm(d, r); }
static int avgpipe__peak_dualpipev(avgpipe__warm_fn warm, const avgpipe_sched_desc *d, int r) {
    (void)warm, (void)r;
    return 2 * d->stages + 1;
}

/* Stream position -> (pipeline, micro-batch across rounds, batch index in the stream). */
static void avgpipe__stream_item(const avgpipe_sched_desc *d, long long k, int *pipe, int *micro, long long *batch) {
    long long b = k / d->micro, m = k % d->micro, t = b / d->pipes;
    *pipe = (int)(b % d->pipes);
    *micro = (int)(t * d->micro + m);
    *batch = b;
}

/* The j-th forward (or backward) of a rank of the 1F1B family in Megatron-LM's interleaved order
   (groups of S stream items run through chunk 0, 1, ... V-1; backwards through V-1 ... 0), kept as
   counters while j runs on one at a time: the generator places one op per step, and dividing j out
   anew each time was a good part of its time. A group holds gs items (S; 1 when V = 1, where the j-th
   item is j itself); with V > 1 the resolver makes micro a multiple of S, so a group never spans two
   batches: its items are micro-batches m0 .. m0 + gs - 1 of batch b. */
typedef struct avgpipe__vcur {
    int gs, off, c; /* group size; item's place in its group; the group's pass (chunk, forwards) */
    int m0, pipe;   /* the group's first micro-batch within its batch; the batch's pipeline */
    long long b, t; /* batch index in the stream; its round */
} avgpipe__vcur;

static void avgpipe__vcur_init(const avgpipe_sched_desc *d, avgpipe__vcur *x) {
    memset(x, 0, sizeof *x);
    x->gs = d->chunks > 1 ? d->stages : 1;
}

static void avgpipe__vcur_next(const avgpipe_sched_desc *d, avgpipe__vcur *x) {
    if (++x->off < x->gs) return;
    x->off = 0;
    if (++x->c < d->chunks) return;
    x->c = 0;
    if ((x->m0 += x->gs) < d->micro) return;
    x->m0 = 0;
    x->b++;
    if (++x->pipe < d->pipes) return;
    x->pipe = 0;
    x->t++;
}

/* The op of the cursor's item on rank r (chunks in reverse order for a backward). */
static avgpipe_op avgpipe__vcur_op(const avgpipe_sched_desc *d, const avgpipe__vcur *x, int kind, int backward, int r) {
    int chunk = backward ? d->chunks - 1 - x->c : x->c;
    return avgpipe__op(kind, x->pipe, chunk * d->stages + r, (int)(x->t * d->micro + x->m0 + x->off));
}

/* One rank of the 1F1B family (AFAB, 1F1B, advance, interleaved, ZB-H1): forwards while at most
   `warm` micro-batches wait for their backward (so warm-up forwards, then one forward one backward,
   then the cool-down), a forward only once the round (synchronous) or the pipeline's previous batch
   on this stage (continuous) has finished, STEP and AVG right after a batch's last backward work.
   ZB-H1 splits each backward into I and W and runs W(j) right after I(j + s) on stage s: the later
   the stage, the more W it holds back to fill the cool-down bubbles, and every stage keeps at most S
   micro-batches in flight (1F1B's peak, on its first stage). */
static avgpipe_result avgpipe__gen_rank(avgpipe_context *ctx, const avgpipe_sched_desc *d, int r, long long warm, avgpipe_schedule *s,
                                        int *bdone /* [chunks * batches], zeroed */) {
    long long Tall = (long long)d->rounds * d->pipes * d->micro, total = Tall * d->chunks;
    long long nf = 0, nb = 0, nw = 0, batches = (long long)d->rounds * d->pipes, perround = (long long)d->pipes * d->micro * d->chunks;
    int split = d->kind == AVGPIPE_SCHED_ZBH1, lag = split ? r : 0;
    avgpipe__vcur cf, cb, cw; /* the next forward, backward (B or I) and W */
    avgpipe_op *o = s->ops[r];
    int n = 0;
    avgpipe__vcur_init(d, &cf);
    avgpipe__vcur_init(d, &cb);
    avgpipe__vcur_init(d, &cw);
    while ((split ? nw : nb) < total) {
        int chunk, canf = nf < total && nf - nb <= warm;
        long long b, fin = split ? nw : nb;
        avgpipe__vcur at; /* the item of the backward work placed below */
        if (canf) {
            chunk = cf.c;
            b = cf.b;
            if (!d->continuous)
                canf = fin >= cf.t * perround;
            else
                canf = b < d->pipes || bdone[(long long)chunk * batches + b - d->pipes] == d->micro;
            if (canf) {
                o[n++] = avgpipe__vcur_op(d, &cf, AVGPIPE_OP_F, 0, r);
                avgpipe__vcur_next(d, &cf);
                nf++;
                continue;
            }
        }
        if (nb < nf) { /* the next backward (B, or I for ZB-H1) */
            at = cb;
            o[n++] = avgpipe__vcur_op(d, &at, split ? AVGPIPE_OP_I : AVGPIPE_OP_B, 1, r);
            avgpipe__vcur_next(d, &cb);
            nb++;
            if (split && nb - nw <= lag) continue;
        } else if (!split || nw >= nb) { /* cannot happen for the supported shapes; no endless loop */
            return avgpipe__fail(ctx, AVGPIPE_UNSUPPORTED, "generator: rank %d cannot continue at forward %lld", r, nf);
        }
        if (split) { /* the oldest held-back W */
            at = cw;
            o[n++] = avgpipe__vcur_op(d, &at, AVGPIPE_OP_W, 1, r);
            avgpipe__vcur_next(d, &cw);
            nw++;
        }
        chunk = d->chunks - 1 - at.c;
        if (++bdone[(long long)chunk * batches + at.b] == d->micro) {
            int t = (int)at.t;
            o[n++] = avgpipe__op(AVGPIPE_OP_STEP, at.pipe, chunk * d->stages + r, t);
            o[n++] = avgpipe__op(AVGPIPE_OP_AVG, at.pipe, chunk * d->stages + r, t);
        }
    }
    s->len[r] = n;
    return AVGPIPE_OK;
}

/* ---- V-placed schedules: ZB-V and DualPipeV ----
   Rank r holds chunk 0 = stage r and chunk 1 = stage 2S-1-r. Each is written first as a template:
   the published per-rank order over one batch stream of `count` micro-batches (with I/W split and
   overlapped pairs), then settled into the rank's list: ops are taken in template order, except that
   an op whose inputs this rank has not produced yet (a forward of a batch whose pipeline has not
   stepped the previous round on this stage, in continuous rounds, and what hangs on it) waits while
   later ops go on; STEP and AVG follow a batch's last backward work on a stage at once. */

typedef struct avgpipe__vop {
    long long item; /* stream position */
    uint8_t kind, chunk, pair; /* pair: runs together with the next template op (OVERLAP_F_B) */
} avgpipe__vop;

typedef struct avgpipe__vgen {
    avgpipe_context *ctx;
    avgpipe__vop *t;
    long long n, cap, base, count; /* template ops; the items of the template: base .. base+count-1 */
    int oom;
} avgpipe__vgen;

/* Append one template op for item (relative to base); items past the stream's end are dropped
   (ZB-V pads short streams to 2S-1 micro-batches and drops the padding, as PyTorch does). */
static void avgpipe__vput(avgpipe__vgen *g, int kind, int chunk, long long item, int pair) {
    avgpipe__vop *o;
    if (item >= g->count || g->oom) return;
    if (g->n == g->cap) {
        long long cap = g->cap ? 2 * g->cap : 1024;
        avgpipe__vop *p = (avgpipe__vop *)avgpipe__realloc(g->ctx, g->t, (size_t)g->n * sizeof *p, (size_t)cap * sizeof *p);
        if (!p) {
            g->oom = 1;
            return;
        }
        g->t = p;
        g->cap = cap;
    }
    o = &g->t[g->n++];
    o->item = g->base + item;
    o->kind = (uint8_t)kind;
    o->chunk = (uint8_t)chunk;
    o->pair = (uint8_t)pair;
}

/* Extra warm-up forwards of AvgPipe's advance forward on rank r: floor(K(S-1-r)/(S-1) + 1/2). */
static long long avgpipe__advance_extra(const avgpipe_sched_desc *d, int r) {
    long long S = d->stages, dist = S - 1 - r;
    return S > 1 && dist > 0 ? (2 * (long long)d->advance * dist + (S - 1)) / (2 * (S - 1)) : 0;
}

/* ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", the V schedule; PyTorch's ScheduleZBVZeroBubble):
   warm-up 2(S-r)-1 (+K's share) chunk-0 forwards, r x (F1, F0), (S-r) x (F1, I1, W1); steady state
   F0, I0, W0, F1, I1, W1; cool-down r x (I0, I1), (S-r) x (I0, W0), then the held-back W1 and W0. */
static void avgpipe__zbv_template(avgpipe__vgen *g, const avgpipe_sched_desc *d, int r) {
    long long S = d->stages, k = avgpipe__advance_extra(d, r), nm = 2 * S - 1 + avgpipe__advance_extra(d, 0), i;
    long long f0 = 0, f1 = 0, b0 = 0, b1 = 0, w0, w1;
    if (nm < g->count) nm = g->count;
    for (i = 0; i < 2 * (S - r) - 1 + k; i++) avgpipe__vput(g, AVGPIPE_OP_F, 0, f0++, 0);
    for (i = 0; i < r; i++) {
        avgpipe__vput(g, AVGPIPE_OP_F, 1, f1++, 0);
        avgpipe__vput(g, AVGPIPE_OP_F, 0, f0++, 0);
    }
    for (i = 0; i < S - r; i++) {
        avgpipe__vput(g, AVGPIPE_OP_F, 1, f1++, 0);
        avgpipe__vput(g, AVGPIPE_OP_I, 1, b1, 0);
        avgpipe__vput(g, AVGPIPE_OP_W, 1, b1++, 0);
    }
    while (f1 < f0 || f0 < nm) {
        if (f0 < nm) avgpipe__vput(g, AVGPIPE_OP_F, 0, f0++, 0);
        avgpipe__vput(g, AVGPIPE_OP_I, 0, b0, 0);
        avgpipe__vput(g, AVGPIPE_OP_W, 0, b0++, 0);
        avgpipe__vput(g, AVGPIPE_OP_F, 1, f1++, 0);
        avgpipe__vput(g, AVGPIPE_OP_I, 1, b1, 0);
        avgpipe__vput(g, AVGPIPE_OP_W, 1, b1++, 0);
    }
    w0 = b0;
    w1 = b1;
    for (i = 0; i < r; i++) {
        avgpipe__vput(g, AVGPIPE_OP_I, 0, b0++, 0);
        avgpipe__vput(g, AVGPIPE_OP_I, 1, b1++, 0);
    }
    for (i = 0; i < S - r; i++) {
        avgpipe__vput(g, AVGPIPE_OP_I, 0, b0++, 0);
        avgpipe__vput(g, AVGPIPE_OP_W, 0, w0++, 0);
    }
    while (w1 < b1) avgpipe__vput(g, AVGPIPE_OP_W, 1, w1++, 0);
    while (w0 < b0) avgpipe__vput(g, AVGPIPE_OP_W, 0, w0++, 0);
}

/* DualPipeV (DeepSeek's DualPipe folded into a V; PyTorch's ScheduleDualPipeV), count >= 2S:
   1. 2(S-r-1) x F0;  2. (r+1) x (F0, F1);  3. (S-r-1) x (I1, W1, F1);
   4. count-2S+r+1 x ((F0;B1), (F1;B0)) overlapped pairs, the first F0, B1 apart on the last rank;
   5. (S-r-1) x (B1, (F1;B0));  6. (r+1) x (B1, B0), switching to I (W held back) half-way;
   7. (S-r-1) x (W, I0);  8. (r+1) x W. W runs the oldest held-back weight gradient. */
static void avgpipe__dualpipev_template(avgpipe__vgen *g, const avgpipe_sched_desc *d, int r, long long *wq) {
    long long S = d->stages, n = g->count, i, f[2] = {0, 0}, b[2] = {0, 0}, wh = 0, wt = 0;
    int zb = 0, c;
#define AVGPIPE__VF_(ch, pr) avgpipe__vput(g, AVGPIPE_OP_F, ch, f[ch]++, pr)
#define AVGPIPE__VB_(ch, split)                                                                                                    \
    do {                                                                                                                           \
        avgpipe__vput(g, (split) ? AVGPIPE_OP_I : AVGPIPE_OP_B, ch, b[ch], 0);                                                    \
        if (split) wq[wt++] = b[ch] * 2 + (ch);                                                                                    \
        b[ch]++;                                                                                                                   \
    } while (0)
#define AVGPIPE__VW_() (avgpipe__vput(g, AVGPIPE_OP_W, (int)(wq[wh] & 1), wq[wh] >> 1, 0), wh++)
    for (i = 0; i < 2 * (S - r - 1); i++) AVGPIPE__VF_(0, 0);
    for (i = 0; i < r + 1; i++) {
        AVGPIPE__VF_(0, 0);
        AVGPIPE__VF_(1, 0);
    }
    for (i = 0; i < S - r - 1; i++) {
        AVGPIPE__VB_(1, 1);
        AVGPIPE__VW_();
        AVGPIPE__VF_(1, 0);
    }
    for (i = 0; i < n - 2 * S + r + 1; i++) {
        int apart = i == 0 && r == S - 1;
        AVGPIPE__VF_(0, !apart);
        AVGPIPE__VB_(1, 0);
        AVGPIPE__VF_(1, 1);
        AVGPIPE__VB_(0, 0);
    }
    for (i = 0; i < S - r - 1; i++) {
        AVGPIPE__VB_(1, 0);
        AVGPIPE__VF_(1, 1);
        AVGPIPE__VB_(0, 0);
    }
    for (i = 0; i < r + 1; i++)
        for (c = 1; c >= 0; c--) {
            if (i == (r + 1) / 2 && (r % 2 == 1) == (c == 1)) zb = 1; /* odd ranks switch before B1, even ones before B0 */
            AVGPIPE__VB_(c, zb);
        }
    for (i = 0; i < S - r - 1; i++) {
        AVGPIPE__VW_();
        AVGPIPE__VB_(0, 1);
    }
    while (wh < wt) AVGPIPE__VW_();
#undef AVGPIPE__VF_
#undef AVGPIPE__VB_
#undef AVGPIPE__VW_
}

/* avgpipe__stream_item of every stream position, tabled once for all ranks: settling asked for it at
   every op (two dependent 64-bit divisions, a fifth of the settling time). */
typedef struct avgpipe__sitem {
    int32_t micro, batch;
    int16_t pipe;
} avgpipe__sitem;

/* Settle a rank's template into its op list (see above). st: [2 * items] zeroed, bdone: [2 * batches]
   zeroed, done: [ntemplate] zeroed, it: [items] the stream positions' items. */
static avgpipe_result avgpipe__vsettle(avgpipe_context *ctx, const avgpipe_sched_desc *d, int r, const avgpipe__vgen *g, avgpipe_schedule *s,
                                       unsigned char *st, int *bdone, unsigned char *done, const avgpipe__sitem *it) {
    long long items = (long long)d->rounds * d->pipes * d->micro, batches = (long long)d->rounds * d->pipes, head = 0, left = g->n, i;
    int S = d->stages, stage[2], n = 0;
    avgpipe_op *o = s->ops[r];
    enum { VS_F = 1, VS_B = 2, VS_W = 4 };
    stage[0] = r;
    stage[1] = 2 * S - 1 - r;
    while (left > 0) {
        const avgpipe__vop *t = NULL;
        for (i = head; i < g->n; i++) {
            const avgpipe__vop *x = &g->t[i];
            unsigned char *me;
            if (done[i]) continue;
            me = &st[x->chunk * items + x->item];
            if (x->kind == AVGPIPE_OP_F) {
                long long b = it[x->item].batch;
                if (x->chunk == 1 && !(st[x->item] & VS_F)) continue; /* stage r's forward feeds stage 2S-1-r */
                if (d->continuous && b >= d->pipes && bdone[x->chunk * batches + b - d->pipes] != d->micro) continue;
            } else if (x->kind == AVGPIPE_OP_W) {
                if (!(*me & VS_B)) continue;
            } else {
                if (!(*me & VS_F)) continue;
                if (x->chunk == 0 && !(st[items + x->item] & VS_B)) continue; /* the gradient comes back through stage 2S-1-r */
            }
            t = x;
            break;
        }
        if (!t) return avgpipe__fail(ctx, AVGPIPE_UNSUPPORTED, "generator: rank %d of %s cannot continue (%lld ops left)", r,
                                     avgpipe_sched_kind_name(d->kind), left);
        for (;;) { /* the op, and the op it overlaps when that one can run with it */
            int pipe = it[t->item].pipe, c = t->chunk;
            long long b = it[t->item].batch, ti = t - g->t;
            unsigned char *me = &st[c * items + t->item];
            o[n] = avgpipe__op(t->kind, pipe, stage[c], it[t->item].micro);
            done[ti] = 1;
            left--;
            *me |= t->kind == AVGPIPE_OP_F ? VS_F : t->kind == AVGPIPE_OP_W ? VS_W : VS_B;
            if (t->kind == AVGPIPE_OP_B || t->kind == AVGPIPE_OP_W) {
                if (++bdone[c * batches + b] == d->micro) {
                    o[++n] = avgpipe__op(AVGPIPE_OP_STEP, pipe, stage[c], (int)(b / d->pipes));
                    o[++n] = avgpipe__op(AVGPIPE_OP_AVG, pipe, stage[c], (int)(b / d->pipes));
                }
            }
            n++;
            if (!t->pair || ti + 1 >= g->n || done[ti + 1]) break;
            { /* the partner: a backward whose inputs are here */
                const avgpipe__vop *x = t + 1;
                if (!(st[x->chunk * items + x->item] & VS_F) || (x->chunk == 0 && !(st[items + x->item] & VS_B))) break;
                if (o[n - 1].kind != t->kind) break; /* a STEP came between (cannot after a forward) */
                o[n - 1].flags |= AVGPIPE_OPF_OVERLAP_NEXT;
                t = x;
            }
        }
        while (head < g->n && done[head]) head++;
    }
    s->len[r] = n;
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__gen_v(avgpipe_context *ctx, const avgpipe_sched_desc *d, avgpipe_schedule *out) {
    long long T = (long long)d->pipes * d->micro, items = T * d->rounds, batches = (long long)d->rounds * d->pipes, t, k;
    avgpipe__vgen g;
    unsigned char *st = NULL, *done = NULL;
    int *bdone = NULL, r, m;
    long long *wq = NULL;
    avgpipe__sitem *it = NULL;
    avgpipe_result res = AVGPIPE_OK;
    memset(&g, 0, sizeof g);
    g.ctx = ctx;
    st = (unsigned char *)avgpipe_alloc(ctx, (size_t)(2 * items));
    bdone = (int *)avgpipe_alloc(ctx, (size_t)(2 * batches) * sizeof(int));
    wq = (long long *)avgpipe_alloc(ctx, (size_t)(2 * items + 1) * sizeof(long long));
    it = (avgpipe__sitem *)avgpipe_alloc(ctx, (size_t)items * sizeof *it);
    if (!st || !bdone || !wq || !it) res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_generate: out of memory");
    for (t = 0, k = 0; t < batches && !res; t++) /* batch t: pipeline t % N of round t / N */
        for (m = 0; m < d->micro; m++, k++) {
            it[k].micro = (int32_t)(t / d->pipes * d->micro + m);
            it[k].batch = (int32_t)t;
            it[k].pipe = (int16_t)(t % d->pipes);
        }
    for (r = 0; r < d->stages && !res; r++) {
        g.n = 0;
        for (t = 0; t < (d->continuous ? 1 : d->rounds); t++) { /* continuous: one stream over every round */
            g.base = t * T;
            g.count = d->continuous ? items : T;
            if (d->kind == AVGPIPE_SCHED_ZBV) avgpipe__zbv_template(&g, d, r);
            else avgpipe__dualpipev_template(&g, d, r, wq);
        }
        avgpipe_free(ctx, done);
        done = g.oom ? NULL : (unsigned char *)avgpipe__calloc(ctx, (size_t)g.n + 1, 1);
        if (!done) {
            res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_generate: out of memory");
            break;
        }
        memset(st, 0, (size_t)(2 * items));
        memset(bdone, 0, (size_t)(2 * batches) * sizeof(int));
        res = avgpipe__vsettle(ctx, d, r, &g, out, st, bdone, done, it);
    }
    avgpipe_free(ctx, g.t);
    avgpipe_free(ctx, st);
    avgpipe_free(ctx, bdone);
    avgpipe_free(ctx, wq);
    avgpipe_free(ctx, done);
    avgpipe_free(ctx, it);
    return res;
}

static avgpipe_result avgpipe__shape_sched(avgpipe_context *ctx, const avgpipe_sched_desc *d, avgpipe_schedule *out) {
    return avgpipe_sched_init(ctx, out, d->stages, d);
}

/* The 1F1B family (AFAB, 1F1B, advance, interleaved, ZB-H1): each rank on its own, with its kind's warm-up. */
static avgpipe_result avgpipe__gen_loop(avgpipe_context *ctx, avgpipe__warm_fn warm, const avgpipe_sched_desc *d, avgpipe_schedule *out) {
    avgpipe_result res = AVGPIPE_OK;
    int r, *bdone = (int *)avgpipe__calloc(ctx, (size_t)d->chunks * d->rounds * d->pipes, sizeof(int));
    if (!bdone) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_generate: out of memory");
    for (r = 0; r < d->stages && !res; r++) {
        memset(bdone, 0, sizeof(int) * (size_t)d->chunks * d->rounds * d->pipes);
        res = avgpipe__gen_rank(ctx, d, r, warm(d, r), out, bdone);
    }
    avgpipe_free(ctx, bdone);
    return res;
}
static avgpipe_result avgpipe__gen_vkind(avgpipe_context *ctx, avgpipe__warm_fn warm, const avgpipe_sched_desc *d, avgpipe_schedule *out) {
    (void)warm;
    return avgpipe__gen_v(ctx, d, out);
}

/* What each generated kind does, beside its row of avgpipe__kinds (section 2, what it is): its warm-up,
   its peak stash and its generator. A new kind adds a row here and one there (and its generator). */
typedef struct avgpipe__kind_row {
    avgpipe_sched_kind kind; /* rows in enum order (C++ has no designated array initializers): checked */
    avgpipe__warm_fn warmup;
    int (*peak_stash)(avgpipe__warm_fn warm, const avgpipe_sched_desc *d, int r);
    avgpipe_result (*generate)(avgpipe_context *ctx, avgpipe__warm_fn warm, const avgpipe_sched_desc *d, avgpipe_schedule *out);
} avgpipe__kind_row;
static const avgpipe__kind_row avgpipe__kind_rows[AVGPIPE_SCHED_KIND_COUNT] = {
    {AVGPIPE_SCHED_CUSTOM, NULL, NULL, NULL}, /* not generated */
    {AVGPIPE_SCHED_AFAB, avgpipe__warm_all, avgpipe__peak_all, avgpipe__gen_loop},
    {AVGPIPE_SCHED_1F1B, avgpipe__warm_1f1b, avgpipe__peak_after_warmup, avgpipe__gen_loop},
    {AVGPIPE_SCHED_ADVANCE, avgpipe__warm_advance, avgpipe__peak_after_warmup, avgpipe__gen_loop},
    {AVGPIPE_SCHED_INTERLEAVED, avgpipe__warm_interleaved, avgpipe__peak_after_warmup, avgpipe__gen_loop},
    {AVGPIPE_SCHED_ZBH1, avgpipe__warm_1f1b, avgpipe__peak_zbh1, avgpipe__gen_loop},
    {AVGPIPE_SCHED_ZBV, avgpipe__warm_zbv, avgpipe__peak_warmup, avgpipe__gen_vkind},
    {AVGPIPE_SCHED_DUALPIPEV, avgpipe__warm_dualpipev, avgpipe__peak_dualpipev, avgpipe__gen_vkind},
};

/* The row of a resolved description's kind (every generated kind has one, in its place: test_sched's
   kinds tests generate each). */
static const avgpipe__kind_row *avgpipe__kind_row_of(const avgpipe_sched_desc *d) {
    const avgpipe__kind_row *k = &avgpipe__kind_rows[d->kind];
    AVGPIPE_ASSERT(k->kind == d->kind && k->warmup && k->peak_stash && k->generate);
    return k;
}

AVGPIPE_API int avgpipe_sched_warmup(const avgpipe_sched_desc *desc, int rank) {
    avgpipe_sched_desc d;
    avgpipe_context quiet;
    memset(&d, 0, sizeof d);
    avgpipe_context_init(&quiet, NULL);
    if (avgpipe_sched_resolve(&quiet, desc, &d) || rank < 0 || rank >= d.stages) return -1;
    return avgpipe__kind_row_of(&d)->warmup(&d, rank);
}

AVGPIPE_API int avgpipe_sched_peak_stash(const avgpipe_sched_desc *desc, int rank) {
    avgpipe_sched_desc d;
    avgpipe_context quiet;
    const avgpipe__kind_row *k;
    memset(&d, 0, sizeof d);
    avgpipe_context_init(&quiet, NULL);
    if (avgpipe_sched_resolve(&quiet, desc, &d) || rank < 0 || rank >= d.stages) return -1;
    k = avgpipe__kind_row_of(&d);
    return k->peak_stash(k->warmup, &d, rank);
}

AVGPIPE_API avgpipe_result avgpipe_sched_generate(avgpipe_context *ctx, const avgpipe_sched_desc *desc,
                                                  avgpipe_schedule *out) {
    avgpipe_sched_desc d;
    avgpipe_result res;
    const avgpipe__kind_row *k;
    int r;
    long long per_rank;
    if (!out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_generate: out is NULL");
    memset(out, 0, sizeof *out);
    res = avgpipe_sched_resolve(ctx, desc, &d);
    if (res) return res;
    k = avgpipe__kind_row_of(&d);
    res = avgpipe__shape_sched(ctx, &d, out);
    if (res) return res;
    /* per micro-batch and chunk a forward and a B, or I and W where the kind splits the backward; a STEP and
       an AVG per batch and chunk (untouched reserve costs no page, but an exact one keeps the mapping small) */
    per_rank = (2LL + avgpipe_sched_kind_query(d.kind)->split) * d.rounds * d.pipes * d.micro * d.chunks + 2LL * d.rounds * d.pipes * d.chunks;
    for (r = 0; r < d.stages && !res; r++) res = avgpipe__sched_reserve(ctx, out, r, (size_t)per_rank);
    if (!res) res = k->generate(ctx, k->warmup, &d, out);
    if (res) avgpipe_sched_free(ctx, out);
    return res;
}

/* --- 5. Greedy scheduler; ties and agreement ------------------------------------------------- */

/* ---- greedy list scheduler ---- */

typedef struct avgpipe__gstage {
    long long nf, nbi, nw; /* next forward, next backward (B or I), next W: stream positions */
    double t, wake;
    int waiting, done;
} avgpipe__gstage;

AVGPIPE_API avgpipe_greedy_desc avgpipe_greedy_query_defaults(const avgpipe_greedy_desc *desc) {
    static const avgpipe_op_kind defaults[3] = {AVGPIPE_OP_B, AVGPIPE_OP_F, AVGPIPE_OP_W};
    avgpipe_greedy_desc g;
    int prio[3], np = 0, i, j, split;
    if (desc) g = *desc;
    else memset(&g, 0, sizeof g);
    if (!g.shape.pipes) g.shape.pipes = 1;
    if (!g.shape.rounds) g.shape.rounds = 1;
    if (!g.shape.chunks) g.shape.chunks = 1;
    if (g.shape.placement == AVGPIPE_PLACE_AUTO) g.shape.placement = AVGPIPE_PLACE_LOOP;
    g.cost_f = avgpipe__or_default(g.cost_f, 1);
    g.cost_b = avgpipe__or_default(g.cost_b, 2);
    g.cost_i = avgpipe__or_default(g.cost_i, 1);
    g.cost_w = avgpipe__or_default(g.cost_w, 1);
    split = g.split_backward != 0;
    /* priority list: given entries first, the rest in default order; B and I mean "the backward" */
    for (i = 0; i < 6; i++) {
        int k = i < 3 ? (int)g.priority[i] : (int)defaults[i - 3], seen = 0;
        if (k == AVGPIPE_OP_B || k == AVGPIPE_OP_I) k = AVGPIPE_OP_B;
        if (!k || (k == AVGPIPE_OP_W && !split)) continue;
        for (j = 0; j < np; j++) seen |= prio[j] == k;
        if (!seen) prio[np++] = k;
    }
    for (i = 0; i < 3; i++)
        g.priority[i] = (avgpipe_op_kind)(i >= np ? 0 : prio[i] == AVGPIPE_OP_B && split ? AVGPIPE_OP_I : prio[i]);
    return g;
}

static avgpipe_result avgpipe__greedy_check(avgpipe_context *ctx, const avgpipe_greedy_desc *desc) {
    const avgpipe_sched_desc *g = &desc->shape;
    int i;
    if (g->stages < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "shape.stages: must be >= 1 (got %d)", g->stages);
    if (g->micro < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "shape.micro: must be >= 1 (got %d)", g->micro);
    if (g->pipes < 0 || g->pipes > 32767) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "shape.pipes: must be in 1..32767 (got %d)", g->pipes);
    if (g->rounds < 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "shape.rounds: must be >= 1 (got %d)", g->rounds);
    if (g->stages > AVGPIPE__MAX_STAGES) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "shape.stages: at most %d", AVGPIPE__MAX_STAGES);
    if (g->chunks < 0 || g->chunks > 1)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "shape.chunks: the greedy scheduler places one stage per rank (got %d)", g->chunks);
    if (g->advance != 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "shape.advance: not used by the greedy scheduler (got %d; use inflight_cap)", g->advance);
    if (g->continuous != 0 && g->continuous != 1)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "shape.continuous: must be 0 or 1 (got %d)", g->continuous);
    if (g->placement != AVGPIPE_PLACE_AUTO && g->placement != AVGPIPE_PLACE_LOOP)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "shape.placement: the greedy scheduler places stages in a loop (got %s)",
                             (int)g->placement >= 0 && g->placement < AVGPIPE_PLACE_COUNT ? avgpipe_placement_name(g->placement) : "?");
    if (!avgpipe__zero_ok(desc->cost_f) || !avgpipe__zero_ok(desc->cost_b) || !avgpipe__zero_ok(desc->cost_i) || !avgpipe__zero_ok(desc->cost_w))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "cost: op costs must be >= 0 (or AVGPIPE_ZERO)");
    for (i = 0; i < 3; i++) {
        int k = desc->priority[i];
        if (k != 0 && k != AVGPIPE_OP_F && k != AVGPIPE_OP_B && k != AVGPIPE_OP_I && k != AVGPIPE_OP_W)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "priority: entry %d is not F, B, I or W", i);
    }
    if (desc->inflight_cap)
        for (i = 0; i < g->stages; i++)
            if (desc->inflight_cap[i] < 1)
                return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "inflight_cap: stage %d has cap %d (must be >= 1)", i,
                                     desc->inflight_cap[i]);
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__greedy_run(avgpipe_context *ctx, const avgpipe_greedy_desc *gin, avgpipe_schedule *out) {
    avgpipe_greedy_desc g;
    avgpipe_sched_desc d;
    avgpipe__gstage *st = NULL;
    double *fend = NULL, *bend = NULL, cost[4];
    int *bfin = NULL, prio[3], np, i, S, split;
    long long Tall, batches;
    avgpipe_result res;
    memset(out, 0, sizeof *out);
    res = avgpipe__greedy_check(ctx, gin);
    if (res) return res;
    g = avgpipe_greedy_query_defaults(gin);
    S = g.shape.stages;
    split = g.split_backward != 0;
    for (np = 0; np < 3 && g.priority[np]; np++) /* B and I mean "the backward" */
        prio[np] = g.priority[np] == AVGPIPE_OP_I ? AVGPIPE_OP_B : (int)g.priority[np];
    memset(&d, 0, sizeof d);
    d.kind = AVGPIPE_SCHED_1F1B;
    d.stages = S;
    d.micro = g.shape.micro;
    d.pipes = g.shape.pipes;
    d.rounds = g.shape.rounds;
    d.chunks = 1;
    d.continuous = g.shape.continuous != 0;
    Tall = (long long)g.shape.rounds * g.shape.pipes * g.shape.micro;
    batches = (long long)g.shape.rounds * g.shape.pipes;
    if ((double)S * g.shape.rounds * g.shape.pipes * g.shape.micro * 4 > (double)AVGPIPE__MAX_OPS)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "micro: stages x pipes x micro x rounds is too large");
    res = avgpipe__shape_sched(ctx, &d, out);
    if (res) return res;
    out->shape.kind = AVGPIPE_SCHED_CUSTOM;
    cost[0] = g.cost_f;
    cost[1] = split ? g.cost_i : g.cost_b;
    cost[2] = g.cost_w;
    st = (avgpipe__gstage *)avgpipe__calloc(ctx, (size_t)S, sizeof *st);
    fend = (double *)avgpipe__calloc(ctx, (size_t)(S * Tall), sizeof(double));
    bend = (double *)avgpipe__calloc(ctx, (size_t)(S * Tall), sizeof(double));
    bfin = (int *)avgpipe__calloc(ctx, (size_t)(S * batches), sizeof(int));
    if (!st || !fend || !bend || !bfin) {
        res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_greedy: out of memory");
        goto done;
    }
    for (i = 0; i < S; i++) {
        res = avgpipe__sched_reserve(ctx, out, i, (size_t)(3 * Tall + 2 * batches));
        if (res) goto done;
    }
    {
        long long k;
        for (k = 0; k < S * Tall; k++) fend[k] = bend[k] = -1;
    }
    for (;;) {
        int s = -1, pick = 0, j;
        double best = HUGE_VAL, tau;
        avgpipe__gstage *x;
        long long fin;
        for (i = 0; i < S; i++) {
            double when;
            if (st[i].done) continue;
            when = st[i].waiting ? st[i].wake : st[i].t;
            if (when < best) {
                best = when;
                s = i;
            }
        }
        if (s < 0) break; /* all done */
        if (best == HUGE_VAL) {
            res = avgpipe__fail(ctx, AVGPIPE_DEADLOCK, "avgpipe_sched_greedy: no stage can proceed (in-flight caps too small?)");
            goto done;
        }
        x = &st[s];
        tau = best;
        x->t = tau;
        x->waiting = 0;
        fin = split ? x->nw : x->nbi;
        for (j = 0; j < np && !pick; j++) {
            if (prio[j] == AVGPIPE_OP_F && x->nf < Tall) {
                int cap = g.inflight_cap ? g.inflight_cap[s] : g.inflight_cap_all > 0 ? g.inflight_cap_all : S - s;
                int pipe, micro;
                long long b;
                double a = s == 0 ? 0 : fend[(long long)(s - 1) * Tall + x->nf];
                avgpipe__stream_item(&d, x->nf, &pipe, &micro, &b);
                if (x->nf - fin < cap && a >= 0 && a <= tau &&
                    (d.continuous ? (b < d.pipes || bfin[s * batches + b - d.pipes] == d.micro)
                                  : fin >= (b / d.pipes) * d.pipes * d.micro))
                    pick = AVGPIPE_OP_F;
            } else if (prio[j] == AVGPIPE_OP_B && x->nbi < x->nf) {
                double a = s == S - 1 ? 0 : bend[(long long)(s + 1) * Tall + x->nbi];
                if (a >= 0 && a <= tau) pick = AVGPIPE_OP_B;
            } else if (prio[j] == AVGPIPE_OP_W && x->nw < x->nbi) {
                pick = AVGPIPE_OP_W;
            }
        }
        if (!pick) { /* sleep until the next known arrival, or until a neighbour publishes one */
            double w = HUGE_VAL, a;
            if (s > 0 && x->nf < Tall && (a = fend[(long long)(s - 1) * Tall + x->nf]) > tau) w = a;
            if (s < S - 1 && x->nbi < x->nf && (a = bend[(long long)(s + 1) * Tall + x->nbi]) > tau && a < w) w = a;
            x->waiting = 1;
            x->wake = w;
            continue;
        }
        {
            long long k = pick == AVGPIPE_OP_F ? x->nf : pick == AVGPIPE_OP_B ? x->nbi : x->nw, b;
            int pipe, micro, kind = pick == AVGPIPE_OP_B ? (split ? AVGPIPE_OP_I : AVGPIPE_OP_B) : pick, nb;
            double end = tau + cost[pick == AVGPIPE_OP_F ? 0 : pick == AVGPIPE_OP_B ? 1 : 2];
            avgpipe_op *o = out->ops[s];
            avgpipe__stream_item(&d, k, &pipe, &micro, &b);
            nb = out->len[s];
            o[nb++] = avgpipe__op(kind, pipe, s, micro);
            if (pick == AVGPIPE_OP_F) {
                fend[(long long)s * Tall + k] = end;
                x->nf++;
                if (s < S - 1 && st[s + 1].waiting && end < st[s + 1].wake) st[s + 1].wake = end > st[s + 1].t ? end : st[s + 1].t;
            } else if (pick == AVGPIPE_OP_B) {
                bend[(long long)s * Tall + k] = end;
                x->nbi++;
                if (s > 0 && st[s - 1].waiting && end < st[s - 1].wake) st[s - 1].wake = end > st[s - 1].t ? end : st[s - 1].t;
            } else {
                x->nw++;
            }
            if ((pick == AVGPIPE_OP_W || (pick == AVGPIPE_OP_B && !split)) && ++bfin[s * batches + b] == d.micro) {
                o[nb++] = avgpipe__op(AVGPIPE_OP_STEP, pipe, s, (int)(b / d.pipes));
                o[nb++] = avgpipe__op(AVGPIPE_OP_AVG, pipe, s, (int)(b / d.pipes));
            }
            out->len[s] = nb;
            x->t = end;
            if (x->nf == Tall && x->nbi == Tall && (!split || x->nw == Tall)) x->done = 1;
        }
    }
done:
    avgpipe_free(ctx, st);
    avgpipe_free(ctx, fend);
    avgpipe_free(ctx, bend);
    avgpipe_free(ctx, bfin);
    if (res) avgpipe_sched_free(ctx, out);
    return res;
}

AVGPIPE_API avgpipe_result avgpipe_sched_greedy(avgpipe_context *ctx, const avgpipe_greedy_desc *desc, avgpipe_schedule *out) {
    if (!desc || !out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_greedy: NULL argument");
    return avgpipe__greedy_run(ctx, desc, out);
}

/* ---- ties and step agreement: avgpipe_sched_add_sync ---- */

/* The timed replay that places TIE and AGREE ops (see avgpipe_sched_add_sync). Per (pipe, stage,
   micro-batch): when the forward and the input gradient ended (-1: not yet); per (pipe, stage, round):
   backward halves done (B counts 2, I and W 1 each; the round's work is complete at 2M) and when the
   last ended, TIEs placed and when, the STEP's state. A sync event (a TIE pair, an AGREE group) is
   queued when its last prerequisite has ended, at that time, and placed on every rank it concerns at
   once, when the replay's clock reaches it: before any op that would start later. */
#define AVGPIPE__HELD 1    /* the STEP was reached before its sync: held back */
#define AVGPIPE__STEPPED 2 /* the STEP is placed */
typedef struct avgpipe__sync_event {
    double at;
    int p, t, g, h; /* a TIE pair (g < h), or h = -1: the AGREE group of (p, t) */
} avgpipe__sync_event;
typedef struct avgpipe__sync {
    const avgpipe_schedule *in;
    avgpipe_schedule *out;
    int G, N, M, T, agree;
    long long U;
    double cost[AVGPIPE_OP_KIND_COUNT];
    int *rank;                      /* [G] */
    int *part_start, *part;         /* stage g's partners: part[part_start[g] .. part_start[g+1]-1], ascending */
    double *fend, *bend;            /* [N][G][U] */
    double *clock;                  /* [S]: when the rank's last op ended */
    double *wend;                   /* [N][G][T]: backward work ended */
    int *work, *ties_done;          /* [N][G][T] */
    unsigned char *step, *avg_held, *agree_in; /* [N][G][T] */
    int *agree_ready;               /* [N][T]: stages whose ties and work are complete */
    double *agree_at;               /* [N][T]: when the last of them became ready */
    avgpipe__sync_event *ev;        /* queued events, in the order they were queued */
    int nev, cap_ev;
} avgpipe__sync;

static size_t avgpipe__sx(const avgpipe__sync *y, int p, int g, long long u) { return ((size_t)p * y->G + (size_t)g) * (size_t)y->U + (size_t)u; }
static size_t avgpipe__sr(const avgpipe__sync *y, int p, int g, int t) { return ((size_t)p * y->G + (size_t)g) * (size_t)y->T + (size_t)t; }

static void avgpipe__sync_emit(avgpipe__sync *y, int r, avgpipe_op op) { y->out->ops[r][y->out->len[r]++] = op; }

static void avgpipe__sync_queue(avgpipe__sync *y, double at, int p, int t, int g, int h) {
    avgpipe__sync_event *e = &y->ev[y->nev++]; /* cap_ev covers every event: one per pair and one per group, per (p, t) */
    e->at = at;
    e->p = p;
    e->t = t;
    e->g = g;
    e->h = h;
}

static int avgpipe__sync_done(const avgpipe__sync *y, int p, int g, int t) {
    size_t k = avgpipe__sr(y, p, g, t);
    return y->ties_done[k] == y->part_start[g + 1] - y->part_start[g] && (!y->agree || y->agree_in[k] == 2);
}

/* Place a held STEP (and its held AVG) of (p, g, t) whose sync has completed. */
static void avgpipe__sync_release(avgpipe__sync *y, int p, int g, int t) {
    size_t k = avgpipe__sr(y, p, g, t);
    if (y->step[k] != AVGPIPE__HELD || !avgpipe__sync_done(y, p, g, t)) return;
    y->step[k] = AVGPIPE__STEPPED;
    avgpipe__sync_emit(y, y->rank[g], avgpipe__op(AVGPIPE_OP_STEP, p, g, t));
    if (y->avg_held[k]) avgpipe__sync_emit(y, y->rank[g], avgpipe__op(AVGPIPE_OP_AVG, p, g, t));
    y->avg_held[k] = 0;
}

/* Stage g of (p, t) joins the agreement (at time `at`) once its work and its ties are complete; the last
   stage to join queues the group's event. */
static void avgpipe__sync_join(avgpipe__sync *y, int p, int g, int t, double at) {
    size_t k = avgpipe__sr(y, p, g, t), pt = (size_t)p * y->T + (size_t)t;
    if (!y->agree) {
        avgpipe__sync_release(y, p, g, t);
        return;
    }
    if (y->agree_in[k] || y->ties_done[k] != y->part_start[g + 1] - y->part_start[g]) return;
    y->agree_in[k] = 1;
    if (at > y->agree_at[pt]) y->agree_at[pt] = at;
    if (++y->agree_ready[pt] == y->G) avgpipe__sync_queue(y, y->agree_at[pt], p, t, 0, -1);
}

/* An event's time has come: its ops on every rank it concerns (each rank's AGREEs consecutively, in
   stage order), their clocks moved to it, then the STEPs it releases. */
static void avgpipe__sync_fire(avgpipe__sync *y, const avgpipe__sync_event *e) {
    int p = e->p, t = e->t, g;
    if (e->h >= 0) {
        int lo = e->g, hi = e->h, side;
        for (side = 0; side < 2; side++) {
            int a = side ? hi : lo, b = side ? lo : hi, r = y->rank[a];
            avgpipe__sync_emit(y, r, avgpipe__op(AVGPIPE_OP_TIE, p, a, t));
            y->out->ops[r][y->out->len[r] - 1].peer = b;
            if (y->clock[r] < e->at) y->clock[r] = e->at;
            y->ties_done[avgpipe__sr(y, p, a, t)]++;
        }
        avgpipe__sync_join(y, p, lo, t, e->at);
        avgpipe__sync_join(y, p, hi, t, e->at);
        return;
    }
    for (g = 0; g < y->G; g++) {
        int r = y->rank[g];
        avgpipe__sync_emit(y, r, avgpipe__op(AVGPIPE_OP_AGREE, p, g, t));
        if (y->clock[r] < e->at) y->clock[r] = e->at;
        y->agree_in[avgpipe__sr(y, p, g, t)] = 2;
    }
    for (g = 0; g < y->G; g++) avgpipe__sync_release(y, p, g, t);
}

/* Stage g's backward work of (p, t) is complete (ended at `at`): queue the TIE pairs whose other side is
   complete too; a stage without ties joins the agreement now. */
static void avgpipe__sync_work_done(avgpipe__sync *y, int p, int g, int t, double at) {
    int j;
    y->wend[avgpipe__sr(y, p, g, t)] = at;
    for (j = y->part_start[g]; j < y->part_start[g + 1]; j++) {
        int h = y->part[j];
        size_t kh = avgpipe__sr(y, p, h, t);
        if (y->work[kh] != 2 * y->M) continue;
        avgpipe__sync_queue(y, at > y->wend[kh] ? at : y->wend[kh], p, t, g < h ? g : h, g < h ? h : g);
    }
    avgpipe__sync_join(y, p, g, t, at);
}

/* When op could start (its inputs have arrived; a forward also needs its stage's STEP of the previous
   round), or -1 when it cannot yet. */
static double avgpipe__sync_start(const avgpipe__sync *y, int r, const avgpipe_op *op) {
    int p = op->pipe, g = op->stage;
    long long u = op->micro;
    double at = y->clock[r], dep = 0;
    if (op->kind == AVGPIPE_OP_F) {
        int t = (int)(u / y->M);
        if (t > 0 && t - 1 < y->T && y->step[avgpipe__sr(y, p, g, t - 1)] == AVGPIPE__HELD) return -1;
        dep = g == 0 ? 0 : y->fend[avgpipe__sx(y, p, g - 1, u)];
    } else if (avgpipe__is_backward(op->kind)) {
        dep = y->fend[avgpipe__sx(y, p, g, u)];
        if (dep >= 0 && g < y->G - 1) {
            double b = y->bend[avgpipe__sx(y, p, g + 1, u)];
            dep = b < 0 ? -1 : b > dep ? b : dep;
        }
    }
    if (dep < 0) return -1;
    return dep > at ? dep : at;
}

static void avgpipe__sync_run(avgpipe__sync *y, int r, const avgpipe_op *op, double start) {
    int p = op->pipe, g = op->stage, t;
    double end = start + y->cost[op->kind];
    y->clock[r] = end;
    if (op->kind == AVGPIPE_OP_STEP || op->kind == AVGPIPE_OP_AVG) {
        size_t k;
        if (op->micro >= y->T) { /* a round past the last STEP's: nothing to hold for */
            avgpipe__sync_emit(y, r, *op);
            return;
        }
        k = avgpipe__sr(y, p, g, op->micro);
        if (op->kind == AVGPIPE_OP_STEP) {
            if (avgpipe__sync_done(y, p, g, op->micro)) {
                y->step[k] = AVGPIPE__STEPPED;
                avgpipe__sync_emit(y, r, *op);
            } else
                y->step[k] = AVGPIPE__HELD;
        } else if (y->step[k] == AVGPIPE__HELD)
            y->avg_held[k] = 1;
        else
            avgpipe__sync_emit(y, r, *op);
        return;
    }
    avgpipe__sync_emit(y, r, *op);
    if (!avgpipe__is_compute(op->kind)) return;
    if (op->kind == AVGPIPE_OP_F) {
        y->fend[avgpipe__sx(y, p, g, op->micro)] = end;
        return;
    }
    if (avgpipe__is_backward(op->kind)) y->bend[avgpipe__sx(y, p, g, op->micro)] = end;
    t = (int)(op->micro / y->M);
    if (t >= y->T) return;
    y->work[avgpipe__sr(y, p, g, t)] += op->kind == AVGPIPE_OP_B ? 2 : 1;
    if (y->work[avgpipe__sr(y, p, g, t)] == 2 * y->M) avgpipe__sync_work_done(y, p, g, t, end);
}

/* When rank r's next op (with the op it overlaps: *n = 2) could start; -1 when it cannot yet or the
   rank's list is done. */
static double avgpipe__sync_next(const avgpipe__sync *y, const int *cur, int r, int *n) {
    const avgpipe_op *o = y->in->ops[r];
    int c = cur[r];
    double st, st2;
    *n = 1;
    if (c >= y->in->len[r]) return -1;
    if ((o[c].flags & AVGPIPE_OPF_OVERLAP_NEXT) && c + 1 < y->in->len[r]) *n = 2;
    st = avgpipe__sync_start(y, r, &o[c]);
    if (*n == 2 && st >= 0) {
        st2 = avgpipe__sync_start(y, r, &o[c + 1]);
        st = st2 < 0 ? -1 : st2 > st ? st2 : st;
    }
    return st;
}

/* The replay's choice among the ranks, kept in a tournament tree over them (leaves tree[P + r], each
   node the better of its two children: the earlier start, then the lower rank; -1 for a rank that cannot
   start): the earliest op in O(log S) per update instead of asking every rank for every op. A rank's
   start changes only when it runs an op, when an event moves its clock, or when what it waits for
   arrives: the forward of stage g's output (the rank of g + 1), the gradient of g (the rank of g - 1), a
   STEP released by an event (the ranks the event concerns); those ranks are asked again. */
static int avgpipe__sync_better(const double *st, int a, int b) {
    if (a < 0 || st[a] < 0) return b;
    if (b < 0 || st[b] < 0) return a;
    return st[b] < st[a] || (st[b] == st[a] && b < a) ? b : a;
}

static void avgpipe__sync_update(const avgpipe__sync *y, const int *cur, double *st, int *nops, int *tree, int P, int r) {
    int i = P + r;
    st[r] = avgpipe__sync_next(y, cur, r, &nops[r]);
    for (i /= 2; i >= 1; i /= 2) tree[i] = avgpipe__sync_better(st, tree[2 * i], tree[2 * i + 1]);
}

/* After op ran on its rank: ask again the ranks whose next op may now start. */
static void avgpipe__sync_ran(const avgpipe__sync *y, const int *cur, double *st, int *nops, int *tree, int P, const avgpipe_op *op) {
    int g = op->stage;
    if (op->kind == AVGPIPE_OP_F && g + 1 < y->G) avgpipe__sync_update(y, cur, st, nops, tree, P, y->rank[g + 1]);
    if (avgpipe__is_backward(op->kind) && g > 0) avgpipe__sync_update(y, cur, st, nops, tree, P, y->rank[g - 1]);
}

static avgpipe_result avgpipe__sync_replay(avgpipe_context *ctx, avgpipe__sync *y) {
    const avgpipe_schedule *s = y->in;
    int S = s->nranks, r, P = 1;
    int *cur, *nops, *tree;
    double *st;
    while (P < S) P *= 2;
    cur = (int *)avgpipe__calloc(ctx, (size_t)3 * S + 2 * (size_t)P, sizeof(int));
    st = (double *)avgpipe_alloc(ctx, (size_t)S * sizeof(double));
    if (!cur || !st) {
        avgpipe_free(ctx, cur);
        avgpipe_free(ctx, st);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_add_sync: out of memory");
    }
    nops = cur + S;
    tree = nops + S;
    for (r = 0; r < 2 * P; r++) tree[r] = -1;
    for (r = 0; r < S; r++) {
        st[r] = avgpipe__sync_next(y, cur, r, &nops[r]);
        tree[P + r] = r;
    }
    for (r = P - 1; r >= 1; r--) tree[r] = avgpipe__sync_better(st, tree[2 * r], tree[2 * r + 1]);
    for (;;) { /* the earliest thing next: an op (or overlap pair) that can start, or a queued event */
        int best = tree[1], e, first = -1, n;
        double at;
        const avgpipe_op *op;
        if (best >= 0 && st[best] < 0) best = -1;
        at = best >= 0 ? st[best] : 0;
        for (e = 0; e < y->nev; e++)
            if (first < 0 || y->ev[e].at < y->ev[first].at) first = e;
        if (first >= 0 && (best < 0 || y->ev[first].at <= at)) {
            avgpipe__sync_event ev = y->ev[first];
            memmove(&y->ev[first], &y->ev[first + 1], (size_t)(y->nev - first - 1) * sizeof ev);
            y->nev--;
            avgpipe__sync_fire(y, &ev);
            if (ev.h >= 0) { /* a TIE pair: its two ranks' clocks, their STEPs */
                avgpipe__sync_update(y, cur, st, nops, tree, P, y->rank[ev.g]);
                avgpipe__sync_update(y, cur, st, nops, tree, P, y->rank[ev.h]);
            } else /* an AGREE group: every stage */
                for (r = 0; r < S; r++) avgpipe__sync_update(y, cur, st, nops, tree, P, r);
            continue;
        }
        if (best < 0) break;
        n = nops[best];
        op = &s->ops[best][cur[best]];
        avgpipe__sync_run(y, best, op, at);
        if (n == 2) avgpipe__sync_run(y, best, op + 1, at);
        cur[best] += n;
        avgpipe__sync_update(y, cur, st, nops, tree, P, best);
        avgpipe__sync_ran(y, cur, st, nops, tree, P, op);
        if (n == 2) avgpipe__sync_ran(y, cur, st, nops, tree, P, op + 1);
    }
    avgpipe_free(ctx, st);
    for (r = 0; r < S && cur[r] >= s->len[r]; r++) {}
    if (r < S) {
        char txt[64], held[64] = "";
        int p, g, t, pos = cur[r];
        avgpipe_op_format(&s->ops[r][pos], 0, txt, sizeof txt);
        for (p = 0; p < y->N && !held[0]; p++)
            for (g = 0; g < y->G && !held[0]; g++)
                for (t = 0; t < y->T && !held[0]; t++)
                    if (y->step[avgpipe__sr(y, p, g, t)] == AVGPIPE__HELD) {
                        avgpipe_op st = avgpipe__op(AVGPIPE_OP_STEP, p, g, t);
                        avgpipe_op_format(&st, 1, held, sizeof held);
                    }
        avgpipe_free(ctx, cur);
        if (held[0])
            return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE,
                                 "avgpipe_sched_add_sync: rank %d position %d (%s) cannot run before STEP %s, whose round's %s cannot "
                                 "complete before it: this schedule cannot hold the sync (reorder it, or use synchronous rounds)",
                                 r, pos, txt, held, y->agree ? "agreement" : "tie");
        return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE, "avgpipe_sched_add_sync: rank %d position %d (%s) never becomes ready: the schedule is not valid",
                             r, pos, txt);
    }
    avgpipe_free(ctx, cur);
    for (r = 0; r < y->N * y->G * y->T; r++)
        if (y->step[r] == AVGPIPE__HELD)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE, "avgpipe_sched_add_sync: a STEP's sync never completed (a stage misses backward work)");
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_sched_add_sync(avgpipe_context *ctx, const avgpipe_schedule *in, const avgpipe_sync_desc *sync,
                                                  avgpipe_schedule *out) {
    avgpipe__sync y;
    avgpipe_result res;
    int r, i, j, g, G, nt = 0;
    size_t cells, rounds_cells;
    if (!in || !out || in == out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_add_sync: NULL argument (or in == out)");
    if (sync && (sync->nties < 0 || (sync->nties > 0 && !sync->ties)))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_add_sync: sync.ties is NULL with nties %d", sync->nties);
    memset(&y, 0, sizeof y);
    y.in = in;
    y.out = out;
    y.G = G = in->nstages;
    y.agree = sync && sync->agree;
    if (sync) nt = sync->nties;
    for (i = 0; i < nt; i++) {
        const avgpipe_tie *t = &sync->ties[i];
        if (t->stage_a < 0 || t->stage_a >= G || t->stage_b < 0 || t->stage_b >= G)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_add_sync: ties[%d] names stage %d, outside the schedule's %d stages", i,
                                 t->stage_a < 0 || t->stage_a >= G ? t->stage_a : t->stage_b, G);
        if (t->stage_a == t->stage_b)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_add_sync: ties[%d] ties stage %d to itself", i, t->stage_a);
    }
    for (r = 0; r < in->nranks; r++)
        for (i = 0; i < in->len[r]; i++)
            if (avgpipe__is_comm(in->ops[r][i].kind) || avgpipe__is_sync(in->ops[r][i].kind)) {
                char txt[64];
                avgpipe_op_format(&in->ops[r][i], 0, txt, sizeof txt);
                return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE, "avgpipe_sched_add_sync: rank %d position %d (%s): the input must be compute-only, without sync ops",
                                     r, i, txt);
            }
    if (!nt && !y.agree) return avgpipe_sched_copy(ctx, in, out);
    res = avgpipe__sched_scan(ctx, in, NULL, &y.N, &y.U);
    if (res) return res;
    y.M = in->shape.micro > 0 ? in->shape.micro : 1;
    y.cost[AVGPIPE_OP_F] = avgpipe__or_default(sync->cost_f, 1);
    y.cost[AVGPIPE_OP_B] = avgpipe__or_default(sync->cost_b, 2);
    y.cost[AVGPIPE_OP_I] = avgpipe__or_default(sync->cost_i, 1);
    y.cost[AVGPIPE_OP_W] = avgpipe__or_default(sync->cost_w, 1);
    y.T = 0;
    for (r = 0; r < in->nranks; r++)
        for (i = 0; i < in->len[r]; i++)
            if (in->ops[r][i].kind == AVGPIPE_OP_STEP && in->ops[r][i].micro + 1 > y.T) y.T = in->ops[r][i].micro + 1;
    if (y.T == 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_SCHEDULE, "avgpipe_sched_add_sync: the schedule has no STEP ops to synchronise");
    cells = (size_t)y.N * (size_t)G * (size_t)y.U;
    rounds_cells = (size_t)y.N * (size_t)G * (size_t)y.T;
    y.rank = (int *)avgpipe__calloc(ctx, (size_t)G * 2 + 1 + 2 * (size_t)nt, sizeof(int));
    y.step = (unsigned char *)avgpipe__calloc(ctx, 3 * rounds_cells, 1);
    y.work = (int *)avgpipe__calloc(ctx, 2 * rounds_cells + (size_t)y.N * y.T, sizeof(int));
    y.fend = (double *)avgpipe_alloc(ctx, (2 * cells + rounds_cells + (size_t)y.N * y.T + (size_t)in->nranks) * sizeof(double));
    y.cap_ev = y.N * y.T * (nt + 1);
    y.ev = (avgpipe__sync_event *)avgpipe_alloc(ctx, (size_t)y.cap_ev * sizeof *y.ev);
    res = avgpipe__sched_init_like(ctx, out, in);
    if (!y.rank || !y.step || !y.work || !y.fend || !y.ev || res) {
        if (!res) avgpipe_sched_free(ctx, out);
        res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_add_sync: out of memory");
        goto done;
    }
    y.part_start = y.rank + G;
    y.part = y.part_start + G + 1;
    y.bend = y.fend + cells;
    y.wend = y.bend + cells;
    y.agree_at = y.wend + rounds_cells;
    y.clock = y.agree_at + (size_t)y.N * y.T;
    for (j = 0; j < (int)(2 * cells); j++) y.fend[j] = -1;
    memset(y.wend, 0, (rounds_cells + (size_t)y.N * y.T + (size_t)in->nranks) * sizeof(double));
    y.avg_held = y.step + rounds_cells;
    y.agree_in = y.avg_held + rounds_cells;
    y.ties_done = y.work + rounds_cells;
    y.agree_ready = y.ties_done + rounds_cells;
    for (g = 0; g < G; g++) y.rank[g] = avgpipe_stage_rank(in, g);
    /* partners: each unordered pair once, per stage in ascending order */
    for (g = 0, j = 0; g < G; g++) {
        int h;
        y.part_start[g] = j;
        for (h = 0; h < G; h++) {
            int k, hit = 0;
            for (k = 0; k < nt && !hit; k++)
                hit = (sync->ties[k].stage_a == g && sync->ties[k].stage_b == h) || (sync->ties[k].stage_a == h && sync->ties[k].stage_b == g);
            if (hit) y.part[j++] = h;
        }
    }
    y.part_start[G] = j;
    for (r = 0; r < in->nranks && !res; r++) {
        size_t n = (size_t)in->len[r];
        for (i = 0; i < in->len[r]; i++)
            if (in->ops[r][i].kind == AVGPIPE_OP_STEP)
                n += (size_t)(y.part_start[in->ops[r][i].stage + 1] - y.part_start[in->ops[r][i].stage]) + (size_t)y.agree;
        res = avgpipe__sched_reserve(ctx, out, r, n);
    }
    if (!res) res = avgpipe__sync_replay(ctx, &y);
    if (res) avgpipe_sched_free(ctx, out);
done:
    avgpipe_free(ctx, y.rank);
    avgpipe_free(ctx, y.step);
    avgpipe_free(ctx, y.work);
    avgpipe_free(ctx, y.fend);
    avgpipe_free(ctx, y.ev);
    return res;
}

/* --- 6. Lowering, and the lowered lists' buffer slots counted without them ------------------- */

/* The stages whose slot of op's micro-batch an op on rank r touches: its own, the next stage's when
   a forward hands its output to it on the same rank, the previous stage's when a backward does; none
   for an op without a micro-batch or of a round (STEP, AVG, TIE, AGREE: no buffers). */
AVGPIPE__FORCE_INLINE int avgpipe__plan_keys(int G, const int *home, int r, const avgpipe_op *op, int *keys) {
    int n = 0, g = op->stage;
    if (!avgpipe__has_micro(op->kind) || avgpipe__is_per_round(op->kind)) return 0;
    keys[n++] = g;
    if (op->kind == AVGPIPE_OP_F && g + 1 < G && home[g + 1] == r) keys[n++] = g + 1;
    if (avgpipe__is_backward(op->kind) && g > 0 && home[g - 1] == r) keys[n++] = g - 1;
    return n;
}

/* The channel an op of kind k on stage g sends its data on when lowered, or -1: a forward whose
   consumer, or a backward (B or I) whose producer, is on another rank. Lowering, its slot count and
   its messages all ask this (up and down: the placement's, kept in locals by the hot loops). */
AVGPIPE__FORCE_INLINE int avgpipe__send_chan(const int *up, const int *down, int k, int g) {
    return k == AVGPIPE_OP_F ? up[g] : avgpipe__is_backward(k) ? down[g] : -1;
}

/* The SEND a compute op needs (its consumer is on another rank). */
static int avgpipe__op_send(const avgpipe__place *pl, const avgpipe_op *op, avgpipe_op *send) {
    if (avgpipe__send_chan(pl->up, pl->down, op->kind, op->stage) < 0) return 0;
    *send = avgpipe__op(op->kind == AVGPIPE_OP_F ? AVGPIPE_OP_SEND_F : AVGPIPE_OP_SEND_B, op->pipe, op->stage, op->micro);
    return 1;
}

/* Lowering, in three steps per schedule:
   1. every compute op that feeds a stage on another rank gets its SEND right after it (after the
      op's overlap group), so each channel (src, dst) carries messages in the sender's order;
   2. each receive gets a desired slot on its rank: a RECV_F right after the forward before its
      consumer (so a rank blocked in a send has its next forward's receive posted), a RECV_B right after the forward of the same micro-batch (the gradient cannot come
      earlier, and posting it early lets a blocking sender downstream go on);
   3. receives keep the sender's order on each channel (the sender inserts the matching receive):
      walking a channel backwards, slot_k = min(desired_k, slot_k+1).
   A slot q sits after compute unit q-1 and before that unit's sends. When no stage has a consumer
   on another rank (one rank), the result has no SEND/RECV ops and has_comm stays 0. */
/* A message of the lowering, as its receive names it (avgpipe__lower_msg): the receiving stage, the
   pipeline and micro-batch, an activation or a gradient; and the rank that sends it. Kept here so that
   placing and walking the receives does not go back to the sender's list (a cache miss a message). */
typedef struct avgpipe__lmsg {
    int32_t src, stage, micro;
    int16_t pipe;
    uint8_t fwd; /* 1: an activation (RECV_F), 0: a gradient (RECV_B) */
} avgpipe__lmsg;

typedef struct avgpipe__lower {
    const avgpipe_schedule *in;
    avgpipe__place pl;
    int S, G, N;
    long long U;
    int *fpos, *bpos;   /* [pipe][stage][micro] -> index of the unit holding F / B-or-I on its rank */
    int *units;         /* [ustart[r] + j]: the unit of op j of rank r, -1 for a dropped idle slot */
    int *ustart;        /* [S + 1] */
    int *nunits;        /* [S] */
    int *prevf;         /* [ustart[r] + q]: the last unit before q on rank r that holds a forward (-1: none) */
    long long *moff;    /* [S + 1]: message k of rank r (its receives) has the slot slot[moff[r] + k] */
    avgpipe__lmsg **mref; /* [S][moff[r + 1] - moff[r]]: the messages into rank r, in (sender, sender's order) */
    long long *mcap;    /* [S]: room in mref[r] while step 1 fills it */
    int *slot;          /* the slot of each message's receive (steps 2 and 3) */
    int *bucket, *ord;  /* avgpipe__lower_rank: rank r's receives by slot, ord[bucket[q] .. bucket[q + 1]) in slot q */
    int *fill;          /* avgpipe__lower_rank's scratch: the next free place of each slot in ord */
} avgpipe__lower;

/* The cell of (pipeline p, stage g, micro-batch u) in a table of G stages and U micro-batches (the
   callers keep G and U in locals: a store through an int table may alias L's fields otherwise). */
static size_t avgpipe__lix(size_t G, size_t U, int p, int g, int u) { return ((size_t)p * G + (size_t)g) * U + (size_t)u; }

static void avgpipe__lower_free(avgpipe_context *ctx, avgpipe__lower *L) {
    int r;
    avgpipe__place_free(ctx, &L->pl);
    avgpipe_free(ctx, L->fpos);
    avgpipe_free(ctx, L->bpos);
    avgpipe_free(ctx, L->units);
    avgpipe_free(ctx, L->prevf);
    avgpipe_free(ctx, L->ustart);
    avgpipe_free(ctx, L->nunits);
    if (L->mref)
        for (r = 0; r < L->S; r++) avgpipe_free(ctx, L->mref[r]);
    avgpipe_free(ctx, L->mref);
    avgpipe_free(ctx, L->mcap);
    avgpipe_free(ctx, L->moff);
    avgpipe_free(ctx, L->slot);
    avgpipe_free(ctx, L->bucket);
    avgpipe_free(ctx, L->ord);
    avgpipe_free(ctx, L->fill);
    memset(L, 0, sizeof *L);
}

/* What lowering and the slot count share: the placement, the extent, the tables, and every message
   by receiving rank, each in (sender, sender's order): moff[r + 1] counts rank r's (the sends of
   step 1: an F whose consumer is on another rank, a B or I whose producer is). known (may be NULL):
   the schedule's extent (no scan; the scan also checks that each op's stage is on its rank, which
   the steps below take per rank). On failure L is freed and the error recorded. */
static avgpipe_result avgpipe__lower_init(avgpipe_context *ctx, const avgpipe_schedule *in, const avgpipe__extent *known, avgpipe__lower *L) {
    avgpipe_result res;
    int r;
    long long total = 0, cells, i;
    memset(L, 0, sizeof *L);
    res = avgpipe__place_build(ctx, in, &L->pl);
    if (!res && (known = avgpipe__extent_ok(in, known)) != NULL) L->N = known->N, L->U = known->U;
    else if (!res) res = avgpipe__sched_scan(ctx, in, L->pl.rank, &L->N, &L->U);
    if (res) {
        avgpipe__place_free(ctx, &L->pl);
        return res;
    }
    L->in = in;
    L->S = in->nranks;
    L->G = in->nstages;
    cells = (long long)L->N * L->G * L->U;
    for (r = 0; r < L->S; r++) total += in->len[r];
    L->fpos = (int *)avgpipe_alloc(ctx, (size_t)cells * sizeof(int));
    L->bpos = (int *)avgpipe_alloc(ctx, (size_t)cells * sizeof(int));
    L->units = (int *)avgpipe__calloc(ctx, (size_t)total + 1, sizeof(int));
    L->prevf = (int *)avgpipe__calloc(ctx, (size_t)total + 1, sizeof(int));
    L->ustart = (int *)avgpipe__calloc(ctx, (size_t)L->S + 1, sizeof(int));
    L->nunits = (int *)avgpipe__calloc(ctx, (size_t)L->S, sizeof(int));
    L->moff = (long long *)avgpipe__calloc(ctx, (size_t)L->S + 1, sizeof(long long));
    L->mref = (avgpipe__lmsg **)avgpipe__calloc(ctx, (size_t)L->S, sizeof *L->mref);
    L->mcap = (long long *)avgpipe__calloc(ctx, (size_t)L->S, sizeof(long long));
    if (!L->fpos || !L->bpos || !L->units || !L->prevf || !L->ustart || !L->nunits || !L->moff || !L->mref || !L->mcap) goto oom;
    for (i = 0; i < cells; i++) L->fpos[i] = L->bpos[i] = -1;
    {
        const int *up = L->pl.up, *down = L->pl.down, *home = L->pl.rank;
        long long off = 0;
        for (r = 0; r < L->S; r++) {
            const avgpipe_op *src = in->ops[r];
            int n = in->len[r], j;
            L->ustart[r] = (int)off;
            off += n;
            for (j = 0; j < n; j++) {
                int k = src[j].kind, g = src[j].stage, dst, fwd = k == AVGPIPE_OP_F;
                long long *m;
                if (avgpipe__send_chan(up, down, k, g) < 0) continue; /* no send */
                dst = home[fwd ? g + 1 : g - 1];
                m = &L->moff[dst + 1];
                if (*m == L->mcap[dst]) {
                    /* a rank receives at most one message per op of its own in a valid schedule */
                    long long cap = L->mcap[dst] ? 2 * L->mcap[dst] : in->len[dst] + 64;
                    avgpipe__lmsg *q = (avgpipe__lmsg *)avgpipe__realloc(ctx, L->mref[dst], (size_t)*m * sizeof *q, (size_t)cap * sizeof *q);
                    if (!q) goto oom;
                    L->mref[dst] = q;
                    L->mcap[dst] = cap;
                }
                {
                    avgpipe__lmsg *x = &L->mref[dst][(*m)++];
                    x->src = r;
                    x->stage = g + (fwd ? 1 : -1);
                    x->micro = src[j].micro;
                    x->pipe = src[j].pipe;
                    x->fwd = (uint8_t)fwd;
                }
            }
        }
    }
    for (r = 0; r < L->S; r++) L->moff[r + 1] += L->moff[r];
    if (!(L->slot = (int *)avgpipe_alloc(ctx, ((size_t)L->moff[L->S] + 1) * sizeof(int)))) goto oom;
    return AVGPIPE_OK;
oom:
    avgpipe__lower_free(ctx, L);
    return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_lower: out of memory");
}

/* Rank r's units (an op with the ops it overlaps; idle slots are dropped): the unit of each op into
   L->units, the last unit before each unit that holds a forward into L->prevf, the unit of each F and
   B-or-I into L->fpos / L->bpos, their count into L->nunits[r]. touch (may be NULL): each key's
   count of touches by r's ops and their sends (avgpipe__plan_keys). */
static void avgpipe__lower_units(avgpipe__lower *L, int r, int32_t *touch) {
    const size_t LG = (size_t)L->G, LU = (size_t)L->U;
    const int *up = L->pl.up, *down = L->pl.down, *home = L->pl.rank;
    const avgpipe_op *src = L->in->ops[r];
    int *fpos = L->fpos, *bpos = L->bpos, *un = L->units + L->ustart[r], *pf = L->prevf + L->ustart[r];
    int n = L->in->len[r], j, u = -1, open = 0, last = -1;
    for (j = 0; j < n; j++) {
        int k = src[j].kind, g = src[j].stage;
        if (k == AVGPIPE_OP_IDLE && !open) {
            un[j] = -1;
            continue;
        }
        if (!open) pf[++u] = last; /* a new unit: the last unit before it that held a forward */
        un[j] = u;
        open = (src[j].flags & AVGPIPE_OPF_OVERLAP_NEXT) != 0;
        if (touch) {
            int keys[3] = {0, 0, 0}, nk = avgpipe__plan_keys((int)LG, home, r, &src[j], keys), q;
            for (q = 0; q < nk; q++) touch[avgpipe__lix(LG, LU, src[j].pipe, keys[q], src[j].micro)]++;
        }
        if (k == AVGPIPE_OP_F || avgpipe__is_backward(k)) { /* where lowering finds its unit; its send's touch */
            size_t ix = avgpipe__lix(LG, LU, src[j].pipe, g, src[j].micro);
            if (k == AVGPIPE_OP_F) fpos[ix] = last = u;
            else bpos[ix] = u;
            if (touch && avgpipe__send_chan(up, down, k, g) >= 0) touch[ix]++;
        }
    }
    L->nunits[r] = u + 1;
}

/* Steps 2 and 3 for the messages into rank r (after its units): each receive's slot into L->slot. */
static void avgpipe__lower_recv_slots(avgpipe__lower *L, int r) {
    const size_t LG = (size_t)L->G, LU = (size_t)L->U;
    long long n = L->moff[r + 1] - L->moff[r], k;
    const int *pf = L->prevf + L->ustart[r], *fpos = L->fpos, *bpos = L->bpos, nu = L->nunits[r];
    const avgpipe__lmsg *mr = L->mref[r];
    int *sl = L->slot + L->moff[r];
    for (k = 0; k < n; k++) { /* desired slot */
        const avgpipe__lmsg *x = &mr[k];
        size_t ix = avgpipe__lix(LG, LU, x->pipe, x->stage, x->micro);
        int c, f = fpos[ix];
        if (x->fwd) {
            sl[k] = f < 0 ? nu : pf[f] + 1;
        } else {
            c = bpos[ix];
            sl[k] = f >= 0 ? f + 1 : c < 0 ? nu : c;
            if (c >= 0 && sl[k] > c) sl[k] = c;
        }
    }
    for (k = n - 1; k > 0; k--) /* keep each channel's order */
        if (mr[k - 1].src == mr[k].src && sl[k - 1] > sl[k]) sl[k - 1] = sl[k];
}

/* Steps 1-3 for every rank, and avgpipe__lower_rank's tables. */
static avgpipe_result avgpipe__lower_prep(avgpipe_context *ctx, const avgpipe_schedule *in, const avgpipe__extent *known, avgpipe__lower *L) {
    avgpipe_result res = avgpipe__lower_init(ctx, in, known, L);
    int r, maxu = 0;
    if (res) return res;
    for (r = 0; r < L->S; r++) {
        avgpipe__lower_units(L, r, NULL);
        if (L->nunits[r] > maxu) maxu = L->nunits[r];
        avgpipe__lower_recv_slots(L, r);
    }
    L->ord = (int *)avgpipe_alloc(ctx, ((size_t)L->moff[L->S] + 1) * sizeof(int));
    L->bucket = (int *)avgpipe_alloc(ctx, ((size_t)maxu + 2) * sizeof(int));
    L->fill = (int *)avgpipe_alloc(ctx, ((size_t)maxu + 2) * sizeof(int));
    if (L->ord && L->bucket && L->fill) return AVGPIPE_OK;
    avgpipe__lower_free(ctx, L);
    return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_lower: out of memory");
}

/* The receive of message k into rank r (of its moff[r + 1] - moff[r]). */
AVGPIPE__FORCE_INLINE avgpipe_op avgpipe__lower_msg(const avgpipe__lower *L, int r, long long k) {
    const avgpipe__lmsg *m = &L->mref[r][k];
    return avgpipe__op(m->fwd ? AVGPIPE_OP_RECV_F : AVGPIPE_OP_RECV_B, m->pipe, m->stage, m->micro);
}

/* Rank r's lowered list, op by op (avgpipe__lower_next), after avgpipe__lower_rank: slot q's receives
   (bucketed by slot, stable: channel, then order), the sends of unit q-1, the ops of unit q. */
typedef struct avgpipe__lower_cur {
    int r, n, nu, q, b, j, send, send_end, phase;
    long long a0;
} avgpipe__lower_cur;

static void avgpipe__lower_rank(avgpipe__lower *L, int r, avgpipe__lower_cur *c) {
    int nu = L->nunits[r], q;
    long long a0 = L->moff[r], k, nmsg = L->moff[r + 1] - a0;
    memset(L->bucket, 0, ((size_t)nu + 2) * sizeof(int));
    for (k = 0; k < nmsg; k++) L->bucket[L->slot[a0 + k] + 1]++;
    for (q = 0; q <= nu; q++) L->bucket[q + 1] += L->bucket[q];
    memcpy(L->fill, L->bucket, ((size_t)nu + 2) * sizeof(int));
    for (k = 0; k < nmsg; k++) L->ord[L->fill[L->slot[a0 + k]]++] = (int)k;
    memset(c, 0, sizeof *c);
    c->r = r;
    c->n = L->in->len[r];
    c->nu = nu;
    c->a0 = a0;
}

/* The next op of the lowered list into *out; 0 after the last. */
AVGPIPE__FORCE_INLINE int avgpipe__lower_next(const avgpipe__lower *L, avgpipe__lower_cur *c, avgpipe_op *out) {
    const avgpipe_op *so = L->in->ops[c->r];
    const int *un = L->units + L->ustart[c->r];
    for (;;) {
        if (c->phase == 0) { /* slot q's receives */
            if (c->b < L->bucket[c->q + 1]) {
                *out = avgpipe__lower_msg(L, c->r, L->ord[c->b++]);
                return 1;
            }
            c->phase = 1;
        }
        if (c->phase == 1) { /* the sends of unit q-1 */
            while (c->send < c->send_end)
                if (avgpipe__op_send(&L->pl, &so[c->send++], out)) return 1;
            if (c->q == c->nu) return 0;
            while (c->j < c->n && un[c->j] < c->q) c->j++;
            c->send = c->j;
            c->phase = 2;
        }
        if (c->j < c->n && un[c->j] == c->q) { /* unit q */
            *out = so[c->j++];
            return 1;
        }
        c->send_end = c->j;
        c->b = L->bucket[++c->q];
        c->phase = 0;
    }
}

AVGPIPE_API avgpipe_result avgpipe_sched_lower(avgpipe_context *ctx, const avgpipe_schedule *in, avgpipe_schedule *out) {
    avgpipe__lower L;
    avgpipe_result res;
    int r;
    if (!in || !out || !in->len) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_lower: NULL argument");
    if (in->has_comm) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_lower: the schedule already has SEND/RECV ops");
    memset(out, 0, sizeof *out);
    if ((res = avgpipe__lower_prep(ctx, in, NULL, &L)) != AVGPIPE_OK) return res;
    res = avgpipe__sched_init_like(ctx, out, in);
    for (r = 0; r < L.S && !res; r++) {
        avgpipe__lower_cur c;
        avgpipe_op *o;
        int w = 0;
        avgpipe__lower_rank(&L, r, &c);
        if ((res = avgpipe__sched_reserve(ctx, out, r, (size_t)c.n * 2 + (size_t)(L.moff[r + 1] - L.moff[r]) + 2)) != AVGPIPE_OK) break;
        o = out->ops[r];
        while (avgpipe__lower_next(&L, &c, &o[w])) w++;
        out->len[r] = w;
    }
    if (res) avgpipe_sched_free(ctx, out);
    else out->has_comm = L.moff[L.S] > 0; /* one rank, or all chunks on one rank: nothing to send */
    avgpipe__lower_free(ctx, &L);
    return res;
}


/* A cache of ranks' slot counts (the tuner's: one per thread, across its candidates). A rank's slots
   follow from its own list, the facts of its stages (the stage before and after on the same rank, a
   consumer or producer on another) and the messages into it in order, none of which names another
   rank's ops; the tuner's candidates repeat them (advance forward's K + 1 gives rank r the list rank
   r - 1 had at K). The key is that input whole, stages counted from the rank's first and senders
   from the rank, and a hit compares it whole: the cache only skips work.
   words: the entries back to back (the key's 64-bit hash in two words, its length in words, the
   rank's stage count, the key, the slots); table: open addressing on the hash, 1 + an entry's
   offset (0: empty); key: the scratch a rank's key is built in. */
typedef struct avgpipe__slot_memo {
    uint32_t *words, *table, *key;
    size_t n, cap, tsize, used, kcap;
    size_t limit; /* words of entries before it starts again; 0 -> AVGPIPE__SLOT_MEMO_WORDS */
    long long hits, misses, restarts;
} avgpipe__slot_memo;

#ifndef AVGPIPE__SLOT_MEMO_WORDS
#define AVGPIPE__SLOT_MEMO_WORDS ((size_t)1 << 21) /* 8 MiB of entries a search thread; past it the cache starts again */
#endif

static void avgpipe__slot_memo_free(avgpipe_context *ctx, avgpipe__slot_memo *c) {
    avgpipe_free(ctx, c->words);
    avgpipe_free(ctx, c->table);
    avgpipe_free(ctx, c->key);
    memset(c, 0, sizeof *c);
}

/* A hash of w[0..n) for the cache's table (a hit compares the key whole: only the spread matters).
   Four independent lanes of two words each: one multiply chain per word was a third of the search. */
static uint64_t avgpipe__words_hash(const uint32_t *w, size_t n) {
    const uint64_t k = 0x9e3779b97f4a7c15ULL;
    uint64_t a = 0x243f6a8885a308d3ULL ^ n, b = 0x13198a2e03707344ULL, c = 0xa4093822299f31d0ULL, d = 0x082efa98ec4e6c89ULL, x;
    size_t i;
    for (i = 0; i + 8 <= n; i += 8) {
        a = (a + (w[i] | (uint64_t)w[i + 1] << 32)) * k;
        b = (b + (w[i + 2] | (uint64_t)w[i + 3] << 32)) * k;
        c = (c + (w[i + 4] | (uint64_t)w[i + 5] << 32)) * k;
        d = (d + (w[i + 6] | (uint64_t)w[i + 7] << 32)) * k;
    }
    for (; i < n; i++) a = (a + w[i]) * k;
    x = a ^ (b << 17 | b >> 47) ^ (c << 31 | c >> 33) ^ (d << 47 | d >> 17);
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ULL;
    return x ^ (x >> 32);
}

/* The entry of key[0..n) (hash h), or NULL. */
static const uint32_t *avgpipe__slot_memo_find(const avgpipe__slot_memo *c, uint64_t h, const uint32_t *key, size_t n) {
    size_t i, mask = c->tsize - 1;
    if (!c->tsize) return NULL;
    for (i = (size_t)h & mask; c->table[i]; i = (i + 1) & mask) {
        const uint32_t *e = c->words + (c->table[i] - 1);
        if (e[0] == (uint32_t)h && e[1] == (uint32_t)(h >> 32) && e[2] == n && memcmp(e + 4, key, n * sizeof *key) == 0) return e;
    }
    return NULL;
}

/* Remember key[0..n) (hash h) -> slots[0..nst). Returns 0 when out of memory (the cache is then left
   as it was: it only saves work). */
static int avgpipe__slot_memo_put(avgpipe_context *ctx, avgpipe__slot_memo *c, uint64_t h, const uint32_t *key, size_t n, const int *slots, int nst) {
    size_t need = 4 + n + (size_t)nst, i, mask, limit = c->limit ? c->limit : AVGPIPE__SLOT_MEMO_WORDS;
    uint32_t *e;
    if (need > limit / 4) return 1; /* too large to be worth keeping */
    if (c->n + need > limit) { /* full: start again */
        c->n = c->used = 0;
        c->restarts++;
        if (c->table) memset(c->table, 0, c->tsize * sizeof *c->table);
    }
    if (c->n + need > c->cap) {
        size_t cap = c->cap ? c->cap : 4096;
        uint32_t *w;
        while (cap < c->n + need) cap *= 2;
        if (!(w = (uint32_t *)avgpipe__realloc(ctx, c->words, c->n * sizeof *w, cap * sizeof *w))) return 0;
        c->words = w, c->cap = cap;
    }
    if (2 * (c->used + 1) > c->tsize) { /* grow the table, placing the entries again */
        size_t ts = c->tsize ? 2 * c->tsize : 1024, off;
        uint32_t *t = (uint32_t *)avgpipe__calloc(ctx, ts, sizeof *t);
        if (!t) return 0;
        avgpipe_free(ctx, c->table);
        c->table = t, c->tsize = ts, mask = ts - 1;
        for (off = 0; off < c->n; off += 4 + c->words[off + 2] + c->words[off + 3]) {
            for (i = (c->words[off] | (size_t)c->words[off + 1] << 32) & mask; t[i]; i = (i + 1) & mask) {}
            t[i] = (uint32_t)off + 1;
        }
    }
    e = c->words + c->n;
    e[0] = (uint32_t)h, e[1] = (uint32_t)(h >> 32), e[2] = (uint32_t)n, e[3] = (uint32_t)nst;
    memcpy(e + 4, key, n * sizeof *key);
    for (i = 0; i < (size_t)nst; i++) e[4 + n + i] = (uint32_t)slots[i];
    for (mask = c->tsize - 1, i = (size_t)h & mask; c->table[i]; i = (i + 1) & mask) {}
    c->table[i] = (uint32_t)c->n + 1;
    c->n += need;
    c->used++;
    return 1;
}

/* Rank r's key into c->key (its length returned; 0 when out of memory): its stage count, op count and
   message count; each of its stages (ascending, stg[0..nst)) counted from the first, with its facts;
   each op (kind, flags, stage, pipeline, micro-batch; an idle slot by its kind and flags alone, the
   lowering reads nothing else of it); each message into it (activation or gradient, stage, pipeline,
   micro-batch, sender counted from r). */
static size_t avgpipe__slot_memo_key(avgpipe_context *ctx, avgpipe__slot_memo *c, const avgpipe__lower *L, int r, const int *stg, int nst) {
    const avgpipe_op *o = L->in->ops[r];
    const avgpipe__lmsg *mr = L->mref[r];
    const int *home = L->pl.rank, *up = L->pl.up, *down = L->pl.down;
    int n = L->in->len[r], j, base = stg[0], G = L->G;
    long long nm = L->moff[r + 1] - L->moff[r], k;
    size_t need = 3 + (size_t)nst + 3 * (size_t)n + 3 * (size_t)nm, w = 0;
    uint32_t *key;
    if (need > c->kcap) {
        uint32_t *q = (uint32_t *)avgpipe__realloc(ctx, c->key, c->kcap * sizeof *q, need * sizeof *q);
        if (!q) return 0;
        c->key = q, c->kcap = need;
    }
    key = c->key;
    key[w++] = (uint32_t)nst, key[w++] = (uint32_t)n, key[w++] = (uint32_t)nm;
    for (j = 0; j < nst; j++) {
        int g = stg[j];
        key[w++] = (uint32_t)(g - base) | (uint32_t)(g > 0 && home[g - 1] == r) << 16 | (uint32_t)(g + 1 < G && home[g + 1] == r) << 17 |
                   (uint32_t)(up[g] >= 0) << 18 | (uint32_t)(down[g] >= 0) << 19;
    }
    for (j = 0; j < n; j++) {
        const avgpipe_op *op = &o[j];
        int idle = op->kind == AVGPIPE_OP_IDLE;
        key[w++] = (uint32_t)op->kind | (uint32_t)op->flags << 5 | (idle ? 0 : (uint32_t)(op->stage - base) << 13);
        key[w++] = idle ? 0 : (uint32_t)op->pipe;
        key[w++] = idle ? 0 : (uint32_t)op->micro;
    }
    for (k = 0; k < nm; k++) {
        key[w++] = (uint32_t)mr[k].fwd | (uint32_t)(mr[k].stage - base) << 1 | (uint32_t)mr[k].pipe << 16;
        key[w++] = (uint32_t)(mr[k].src - r);
        key[w++] = (uint32_t)mr[k].micro;
    }
    return w;
}

/* The slot counts avgpipe__plan_slots finds in the lowered form of the compute-only schedule in,
   without lowering it (the tuner's memory model: no lowered lists to build and read twice), rank by
   rank: its units count each key's touches (its ops, their sends, the receives into it), then its
   lowered order is walked once without building its ops (slot q's receives, the sends of unit q-1,
   the ops of unit q), taking a slot at a key's first touch and giving it back at its last, as the
   plan does. Each sender's receives come in its order with their slots non-decreasing (step 3 of the
   lowering), so a cursor per sender gives slot q's receives in the lowering's order (sender, then
   message) without sorting them. slots: [in->nstages]; known (may be NULL): in's extent; memo (may be
   NULL): a rank whose key it holds takes its slots from it. */
static avgpipe_result avgpipe__plan_slots_unlowered(avgpipe_context *ctx, const avgpipe_schedule *in, const avgpipe__extent *known,
                                                    avgpipe__slot_memo *memo, int *slots) {
    avgpipe__lower L;
    avgpipe_result res;
    int r, g, G = in->nstages, *live = NULL, *stg = NULL, *sfirst;
    const int *up, *down, *home;
    long long *cur = NULL;
    size_t LG, LU;
    int32_t *tc = NULL;
    if ((res = avgpipe__lower_init(ctx, in, known, &L)) != AVGPIPE_OK) return res;
    live = (int *)avgpipe__calloc(ctx, (size_t)G + 1, sizeof(int));
    cur = (long long *)avgpipe_alloc(ctx, (2 * (size_t)L.S + 2) * sizeof(long long));
    stg = (int *)avgpipe__calloc(ctx, (size_t)G + 2 * (size_t)L.S + 2, sizeof(int));
    tc = (int32_t *)avgpipe__calloc(ctx, (size_t)L.N * (size_t)G * (size_t)L.U + 1, sizeof(int32_t));
    if (!live || !cur || !stg || !tc) {
        res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory planning the buffers");
        goto done;
    }
    LG = (size_t)G, LU = (size_t)L.U, up = L.pl.up, down = L.pl.down, home = L.pl.rank;
    sfirst = stg + G; /* each rank's stages, ascending: stg[sfirst[r] .. sfirst[r + 1]) */
    for (g = 0; g < G; g++) sfirst[home[g] + 1]++;
    for (r = 0; r < L.S; r++) sfirst[r + 1] += sfirst[r];
    for (g = 0; g < G; g++) stg[sfirst[L.S + 1 + home[g]]++ + sfirst[home[g]]] = g; /* counts after sfirst[S] */
    for (g = 0; g < G; g++) slots[g] = 0;
    /* A key's touch: the first (its count still positive) takes a slot, the last (the count, negated
       at the first, back at 0) gives it back. */
#define AVGPIPE__TOUCH(g_, key_)                                                                                                              \
    do {                                                                                                                                       \
        int32_t *t_ = &tc[key_], v_ = *t_;                                                                                                     \
        if (v_ > 0) {                                                                                                                          \
            if (++live[g_] > slots[g_]) slots[g_] = live[g_];                                                                                  \
            v_ = -v_;                                                                                                                          \
        }                                                                                                                                      \
        if (++v_ == 0) live[g_]--;                                                                                                             \
        *t_ = v_;                                                                                                                              \
    } while (0)
    for (r = 0; r < L.S; r++) {
        const avgpipe_op *o = in->ops[r];
        const int *un = L.units + L.ustart[r], *sl = L.slot + L.moff[r], *rs = stg + sfirst[r];
        const avgpipe__lmsg *mr = L.mref[r];
        long long nm = L.moff[r + 1] - L.moff[r], k, *end = cur + L.S + 1;
        int n = in->len[r], nu, q, j = 0, a = 0, b = 0, i, ng = 0, h, nst = sfirst[r + 1] - sfirst[r], kept[64];
        size_t kn = 0;
        uint64_t hash = 0;
        if (nst == 0) continue; /* a rank without stages has no ops the scan lets through */
        if (memo && nst <= 64) {
            const uint32_t *e;
            if ((kn = avgpipe__slot_memo_key(ctx, memo, &L, r, rs, nst)) > 0) {
                hash = avgpipe__words_hash(memo->key, kn);
                if ((e = avgpipe__slot_memo_find(memo, hash, memo->key, kn)) != NULL) {
                    for (i = 0; i < nst; i++) slots[rs[i]] = (int)e[4 + kn + i];
                    memo->hits++;
                    continue;
                }
                memo->misses++;
            }
        }
        avgpipe__lower_units(&L, r, tc);
        for (k = 0; k < nm; k++) tc[avgpipe__lix(LG, LU, mr[k].pipe, mr[k].stage, mr[k].micro)]++; /* the receives' */
        avgpipe__lower_recv_slots(&L, r);
        nu = L.nunits[r];
        for (k = 0; k < nm; k++) /* the senders' runs of messages: cur[h] .. end[h] */
            if (k == 0 || mr[k].src != mr[k - 1].src) {
                if (ng > 0) end[ng - 1] = k;
                cur[ng++] = k;
            }
        if (ng > 0) end[ng - 1] = nm;
        for (q = 0;; q++) {
            for (h = 0; h < ng; h++) /* slot q's receives */
                for (; cur[h] < end[h] && sl[cur[h]] == q; cur[h]++) {
                    const avgpipe__lmsg *m = &mr[cur[h]];
                    AVGPIPE__TOUCH(m->stage, avgpipe__lix(LG, LU, m->pipe, m->stage, m->micro));
                }
            for (i = a; i < b; i++) /* the sends of unit q - 1 */
                if (avgpipe__send_chan(up, down, o[i].kind, o[i].stage) >= 0)
                    AVGPIPE__TOUCH(o[i].stage, avgpipe__lix(LG, LU, o[i].pipe, o[i].stage, o[i].micro));
            if (q == nu) break;
            while (j < n && un[j] < 0) j++; /* idle slots the lowering drops */
            for (a = j; j < n && un[j] == q; j++) { /* unit q */
                int keys[3] = {0, 0, 0}, nk = avgpipe__plan_keys(G, home, r, &o[j], keys), e;
                for (e = 0; e < nk; e++) AVGPIPE__TOUCH(keys[e], avgpipe__lix(LG, LU, o[j].pipe, keys[e], o[j].micro));
            }
            b = j;
        }
        if (kn > 0) { /* remembered (out of memory: not, which only costs the work next time) */
            for (i = 0; i < nst; i++) kept[i] = slots[rs[i]];
            (void)avgpipe__slot_memo_put(ctx, memo, hash, memo->key, kn, kept, nst);
        }
    }
#undef AVGPIPE__TOUCH
    for (g = 0; g < G; g++)
        if (slots[g] < 1) slots[g] = 1;
done:
    avgpipe_free(ctx, live);
    avgpipe_free(ctx, cur);
    avgpipe_free(ctx, stg);
    avgpipe_free(ctx, tc);
    avgpipe__lower_free(ctx, &L);
    return res;
}

/* --- 7. Simulation ---------------------------------------------------------------------------- */

typedef struct avgpipe__chan {
    double link_free;
    int nsend, nrecv, post_cap;
    double *post; /* post time of each receive, for blocking sends */
} avgpipe__chan;

/* What the simulator keeps per (pipeline, stage, micro-batch) cell: when the stage's input activation
   and its output gradient arrive (-1: not yet), and whether the cell's forward and backward (B or I)
   ran. An op's producer on its own rank ran at or before the rank's current time (the rank's clock
   only moves forward), so "ran" is all its consumers need: the times they wait for are arrivals. */
typedef struct avgpipe__cell {
    double act, grad;
} avgpipe__cell;

/* avgpipe__sim.ran bits per cell: its forward ran, its backward (B or I) ran, its activation has
   arrived (cell.act is set), its gradient has (cell.grad is set): the times need no initial pass. */
enum { AVGPIPE__RAN_F = 1, AVGPIPE__RAN_B = 2, AVGPIPE__RAN_A = 4, AVGPIPE__RAN_G = 8 };

typedef struct avgpipe__sim {
    avgpipe_context *ctx;
    const avgpipe_schedule *s;
    const avgpipe_sim_desc *d;
    avgpipe_sim_result *res;
    int S, G, N;
    long long U;
    avgpipe__cell *cell;                      /* [pipe][stage][micro] */
    uint8_t *ran;                             /* [pipe][stage][micro]: AVGPIPE__RAN_* */
    avgpipe__place pl;
    avgpipe__chan *chan;                      /* [pl.nchan] */
    int *pos, *waiting, *stack, nstack, *stash;
    size_t *wait_ix;  /* [S]: the cell an asleep rank waits for, when wait_on says which arrival */
    uint8_t *wait_on; /* [S]: AVGPIPE__RAN_A or _G of cell wait_ix; 0: woken by any producer */
    double *t, *bytes;
    long long flows;
    double makespan;
    int stuck_rank, stuck_pos; /* after a deadlock: the first stuck rank and its op */
    double *cost_tab;          /* [G][AVGPIPE_OP_KIND_COUNT]: every op's cost resolved once (no cost_fn), or NULL */
    int xfer_ready;            /* no stage_bytes: every transfer takes xfer (a division less per transfer) */
    double xfer;
    /* TIE and AGREE rendezvous: a TIE pair (lo, hi) starts when both sides have arrived, an AGREE
       group when every rank holding a stage has */
    int T, npairs, agree_ranks;
    int *pairs;       /* [npairs][2] */
    double *tie_at;   /* [N][T][npairs][2]: arrival of each side, -1 */
    double *agree_at; /* [N][T]: the latest arrival */
    int *agree_n;     /* [N][T]: ranks arrived */
    /* Tables sized from the shape, not from a scan (avgpipe__sim_guess): each op is checked as it
       runs, as the scan would have; spec_bad: one failed (or the run stopped before checking them
       all), and the caller runs again after the scan, which names the fault. */
    int spec, spec_bad, sync_ready;
    long long spec_idle; /* idle ops met (each once: counted when the rank moves past them) */
} avgpipe__sim;

static const double avgpipe__default_cost[AVGPIPE_OP_KIND_COUNT] = {0, 1, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

AVGPIPE_API avgpipe_sim_desc avgpipe_sim_query_defaults(const avgpipe_sim_desc *desc) {
    avgpipe_sim_desc d;
    int k;
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    for (k = 0; k < AVGPIPE_OP_KIND_COUNT; k++) d.cost[k] = avgpipe__or_default(d.cost[k], avgpipe__default_cost[k]);
    if (!(d.micro_size > 0)) d.micro_size = 1;
    return d;
}

/* The cost of op under d (resolved: avgpipe_sim_query_defaults) for a schedule of G stages. Without
   cost_fn it depends on the op's stage and kind alone, so the simulator tables it once per (stage,
   kind); an op outside 0..G-1 (an idle slot: the scan checks every other op) takes its kind's cost. */
static double avgpipe__cost_of(const avgpipe_sim_desc *d, int G, const avgpipe_op *op) {
    double c;
    if (d->cost_fn) {
        c = d->cost_fn(op, d->cost_user);
        return c < 0 ? 0 : c;
    }
    if (d->stage_cost && op->stage >= 0 && op->stage < G) c = d->stage_cost[(size_t)op->stage * AVGPIPE_OP_KIND_COUNT + op->kind];
    else c = d->cost[op->kind];
    if (c < 0) c = 0;
    if (d->scale_by_micro_size && avgpipe__is_compute(op->kind)) c *= d->micro_size;
    return c;
}

AVGPIPE__FORCE_INLINE double avgpipe__cost(const avgpipe__sim *m, const avgpipe_op *op) {
    if (m->cost_tab && (unsigned)op->stage < (unsigned)m->G) return m->cost_tab[(size_t)op->stage * AVGPIPE_OP_KIND_COUNT + op->kind];
    return avgpipe__cost_of(m->d, m->G, op);
}

static double avgpipe__xfer_time(const avgpipe__sim *m, int boundary) {
    const avgpipe_sim_desc *d = m->d;
    double bytes;
    if (m->xfer_ready) return m->xfer;
    bytes = d->stage_bytes ? d->stage_bytes[boundary] : d->bytes;
    return d->latency + (d->bandwidth > 0 ? bytes / d->bandwidth : 0);
}

static size_t avgpipe__idx(const avgpipe__sim *m, int pipe, int stage, int micro) {
    return ((size_t)pipe * (size_t)m->G + (size_t)stage) * (size_t)m->U + (size_t)micro;
}

/* waiting[r]: bit 0 asleep (woken by a producer), bit 1 arrived at the AGREE group it waits for */
static void avgpipe__wake(avgpipe__sim *m, int r) {
    if (m->waiting[r] & 1) {
        m->waiting[r] &= ~1;
        m->stack[m->nstack++] = r;
    }
}

/* The arrival `bit` (AVGPIPE__RAN_A or _G) of cell ix, on rank r: wakes r only if that is what it
   waits for (or it waits for something else than an arrival). In a 1F1B steady state a rank waiting
   for a gradient from downstream meets every activation from upstream first: woken by each, it ran
   no op on half of its turns. */
AVGPIPE__FORCE_INLINE void avgpipe__wake_on(avgpipe__sim *m, int r, size_t ix, int bit) {
    if ((m->waiting[r] & 1) && (!m->wait_on[r] || (m->wait_on[r] == bit && m->wait_ix[r] == ix))) {
        m->waiting[r] &= ~1;
        m->stack[m->nstack++] = r;
        AVGPIPE__PREFETCH(&m->s->ops[r][m->pos[r]]); /* its op left the cache while the other ranks ran */
    }
}

static int avgpipe__event(avgpipe__sim *m, const avgpipe_op *op, int rank, int track, int peer, int flow, double a, double b) {
    avgpipe_sim_result *R = m->res;
    avgpipe_event *e;
    if (R->nevents == R->events_cap) {
        size_t cap = R->events_cap ? 2 * R->events_cap : 1024;
        avgpipe_event *p = (avgpipe_event *)avgpipe__realloc(m->ctx, R->events, R->nevents * sizeof *p, cap * sizeof *p);
        if (!p) return 0;
        R->events = p;
        R->events_cap = cap;
    }
    e = &R->events[R->nevents++];
    e->op = *op;
    e->rank = rank;
    e->track = track;
    e->peer = peer;
    e->flow = flow;
    e->start = a;
    e->end = b;
    return 1;
}

/* A transfer on channel ch (src -> dst), ready at `ready`. Returns its end. */
AVGPIPE__FORCE_INLINE double avgpipe__transfer(avgpipe__sim *m, const avgpipe_op *op, int ch, double ready, int boundary, int *ok) {
    avgpipe__chan *c = &m->chan[ch];
    double xs = ready > c->link_free ? ready : c->link_free, xe = xs + avgpipe__xfer_time(m, boundary);
    int flow = (int)(m->flows++ & 0x7fffffff);
    c->link_free = xe;
    if (xe > m->makespan) m->makespan = xe;
    m->res->transfers++;
    if (m->d->record_events == AVGPIPE_SIM_EVENTS_ALL || (m->d->record_events && xe > xs)) {
        int src = m->pl.src[ch], dst = m->pl.dst[ch];
        *ok &= avgpipe__event(m, op, src, 1, dst, flow, xs, xe);
        *ok &= avgpipe__event(m, op, dst, 2, src, flow, xs, xe);
    }
    return xe;
}

/* Deliver data produced at `end` by op on rank r to the stage that consumes it. */
AVGPIPE__FORCE_INLINE void avgpipe__deliver(avgpipe__sim *m, const avgpipe_op *op, int r, double end, int *ok) {
    int fwd = op->kind == AVGPIPE_OP_F, g2 = op->stage + (fwd ? 1 : -1), r2;
    size_t ix;
    avgpipe__cell *c;
    if (g2 < 0 || g2 >= m->G) return;
    r2 = m->pl.rank[g2];
    ix = avgpipe__idx(m, op->pipe, g2, op->micro);
    c = &m->cell[ix];
    if (r2 == r) *(fwd ? &c->act : &c->grad) = end;
    else if (!m->s->has_comm) {
        *(fwd ? &c->act : &c->grad) =
            avgpipe__transfer(m, op, fwd ? m->pl.up[op->stage] : m->pl.down[op->stage], end, fwd ? op->stage : g2, ok);
        avgpipe__wake_on(m, r2, ix, fwd ? AVGPIPE__RAN_A : AVGPIPE__RAN_G);
    } else {
        return; /* its SEND delivers it */
    }
    m->ran[ix] |= fwd ? AVGPIPE__RAN_A : AVGPIPE__RAN_G;
}

/* A SEND op of rank r at time *t: 1 sent, 0 a blocking send finds no receive posted yet (wait), -1
   the op names no channel (the rank stops there; the validator reports such ops). */
static int avgpipe__sim_send(avgpipe__sim *m, int r, const avgpipe_op *op, double *t, int *ok) {
    int fwd = op->kind == AVGPIPE_OP_SEND_F, g2 = op->stage + (fwd ? 1 : -1), c;
    avgpipe__chan *ch;
    avgpipe__cell *cl;
    size_t ix;
    double ready = *t, xe;
    c = fwd ? m->pl.up[op->stage] : m->pl.down[op->stage];
    if (g2 < 0 || g2 >= m->G || c < 0) return -1;
    ch = &m->chan[c];
    if (m->d->blocking_send) {
        if (ch->nrecv <= ch->nsend) return 0;
        if (ch->post[ch->nsend] > ready) ready = ch->post[ch->nsend];
    }
    ch->nsend++;
    xe = avgpipe__transfer(m, op, c, ready, fwd ? op->stage : g2, ok);
    ix = avgpipe__idx(m, op->pipe, g2, op->micro);
    cl = &m->cell[ix];
    if (fwd) cl->act = xe;
    else cl->grad = xe;
    m->ran[ix] |= fwd ? AVGPIPE__RAN_A : AVGPIPE__RAN_G;
    avgpipe__wake_on(m, m->pl.rank[g2], ix, fwd ? AVGPIPE__RAN_A : AVGPIPE__RAN_G);
    if (m->d->blocking_send) {
        m->res->rank[r].blocked += xe - *t;
        *t = xe;
    }
    return 1;
}

/* A RECV op at time t: 1 the receive is posted, -1 the op names no channel (the rank stops there),
   0 out of memory (*ok = 0). */
static int avgpipe__sim_recv(avgpipe__sim *m, const avgpipe_op *op, double t, int *ok) {
    int k = op->kind, g2 = op->stage + (k == AVGPIPE_OP_RECV_F ? -1 : 1), c;
    avgpipe__chan *ch;
    if (g2 < 0 || g2 >= m->G) return -1;
    c = k == AVGPIPE_OP_RECV_F ? m->pl.up[g2] : m->pl.down[g2];
    if (c < 0) return -1;
    ch = &m->chan[c];
    if (ch->nrecv == ch->post_cap) {
        int cap = ch->post_cap ? 2 * ch->post_cap : 64;
        double *p = (double *)avgpipe__realloc(m->ctx, ch->post, (size_t)ch->post_cap * sizeof(double), (size_t)cap * sizeof(double));
        if (!p) return *ok = 0;
        ch->post = p;
        ch->post_cap = cap;
    }
    ch->post[ch->nrecv++] = t;
    avgpipe__wake(m, m->pl.rank[g2]);
    return 1;
}

/* A TIE or AGREE of rank r reached at time t: 0 to wait for the other side(s), else 1 with *start (when
   all have arrived) and *xfer (the exchange's transfer time, 0 on one rank). */
static int avgpipe__sim_sync(avgpipe__sim *m, int r, int pos, double t, double *start, double *xfer) {
    const avgpipe_op *op = &m->s->ops[r][pos];
    const avgpipe_sim_desc *d = m->d;
    size_t pt = (size_t)op->pipe * (size_t)m->T + (size_t)op->micro;
    int q;
    *xfer = 0;
    *start = t;
    if (op->kind == AVGPIPE_OP_TIE) {
        int h = op->peer, side = op->stage < h ? 0 : 1, lo;
        double *at;
        q = avgpipe__pair_find(m->pairs, m->npairs, op->stage, h);
        at = &m->tie_at[(pt * (size_t)m->npairs + (size_t)q) * 2];
        if (m->pl.rank[h] == r) return 1; /* both sides here: no bytes move */
        if (at[side] < 0) {
            at[side] = t;
            avgpipe__wake(m, m->pl.rank[h]);
        }
        if (at[1 - side] < 0) return 0;
        *start = at[0] > at[1] ? at[0] : at[1];
        lo = op->stage < h ? op->stage : h;
        {
            double b = d->stage_tie_bytes ? d->stage_tie_bytes[lo] : d->tie_bytes;
            *xfer = d->latency + (d->bandwidth > 0 ? b / d->bandwidth : 0);
        }
        return 1;
    }
    if (pos > 0 && m->s->ops[r][pos - 1].kind == AVGPIPE_OP_AGREE && m->s->ops[r][pos - 1].pipe == op->pipe &&
        m->s->ops[r][pos - 1].micro == op->micro)
        return 1; /* the rest of this rank's group */
    if (m->agree_n[pt] >= 0 && !(m->waiting[r] & 2)) { /* this rank arrives */
        m->waiting[r] |= 2;
        if (t > m->agree_at[pt]) m->agree_at[pt] = t;
        if (++m->agree_n[pt] == m->agree_ranks) {
            m->agree_n[pt] = -1; /* complete */
            for (q = 0; q < m->S; q++) avgpipe__wake(m, q);
        }
    }
    if (m->agree_n[pt] >= 0) return 0;
    m->waiting[r] &= ~2;
    *start = m->agree_at[pt];
    *xfer = m->agree_ranks > 1 ? d->latency : 0;
    return 1;
}

/* Rank r waits in the blocking send at pos, which it has issued: the TIE and AGREE ops right after it
   (past other sends) see it arrive now, each at the end of the one before, as the runtime's worker
   waits for them only after issuing every send before them. Without this a schedule the validator
   accepts (it replays sync ops with asynchronous sends) could deadlock here: a rank blocked in a send
   whose receiver posts the receive only after an AGREE that waits for the sender. Called again on
   every wake-up: an arrival is recorded once (avgpipe__sim_sync). */
static void avgpipe__sim_arrive_ahead(avgpipe__sim *m, int r, int pos, double t) {
    const avgpipe_op *o = m->s->ops[r];
    int n = m->s->len[r], j = pos + 1;
    double start, xfer;
    while (j < n && (o[j].kind == AVGPIPE_OP_SEND_F || o[j].kind == AVGPIPE_OP_SEND_B)) j++;
    for (; j < n && avgpipe__is_sync(o[j].kind); j++) {
        if (!avgpipe__sim_sync(m, r, j, t, &start, &xfer)) return;
        if (start > t) t = start;
        t += avgpipe__cost(m, &o[j]) + xfer;
    }
}

/* What the scan checks of one op (avgpipe__sched_scan_fast), against the tables' guessed extent:
   a known kind, its stage on rank r, its pipeline and micro-batch inside the tables (a round for a
   per-round kind: only >= 0). Idle slots are not checked. */
AVGPIPE__FORCE_INLINE int avgpipe__sim_op_ok(const avgpipe__sim *m, const avgpipe_op *op, int r) {
    int k = op->kind;
    if (k == AVGPIPE_OP_IDLE) return 1;
    if (k >= AVGPIPE_OP_KIND_COUNT || (unsigned)op->stage >= (unsigned)m->G || m->pl.rank[op->stage] != r ||
        (unsigned)op->pipe >= (unsigned)m->N)
        return 0;
    if (!avgpipe__has_micro(k)) return 1;
    return op->micro >= 0 && (avgpipe__is_per_round(k) || op->micro < m->U);
}

static avgpipe_result avgpipe__sim_sync_tables(avgpipe__sim *m);

/* Run rank r as far as it can go. Returns 0 on allocation failure, or (m->spec_bad) when a guessed
   extent does not hold. spec: m->spec, a constant in each of the two instances below (the checks
   and the late sync tables in the loop made the unchecked runs, the tuner's, 10% slower). */
AVGPIPE__FORCE_INLINE int avgpipe__sim_rank_in(avgpipe__sim *m, int r, const int spec) {
    const avgpipe_op *ops = m->s->ops[r];
    int n = m->s->len[r], ok = 1, pos = m->pos[r];
    avgpipe_rank_stats *st = &m->res->rank[r];
    const avgpipe_sim_desc *d = m->d;
    double t = m->t[r];
    size_t wix = 0;
    int need = 0; /* the arrival a wait below is for (AVGPIPE__RAN_A or _G of cell wix), 0: other */
    for (; pos < n && ok; pos++) {
        const avgpipe_op *op = &ops[pos];
        double dep = 0, c, end, xfer = 0;
        size_t ix = 0;
        int k = op->kind, how;
        AVGPIPE__PREFETCH(op + 12);
        if (spec && !avgpipe__sim_op_ok(m, op, r)) {
            m->spec_bad = 1;
            ok = 0;
            goto stop;
        }
        if (avgpipe__has_micro(k) && !avgpipe__is_per_round(k)) ix = avgpipe__idx(m, op->pipe, op->stage, op->micro);
        switch (k) {
        case AVGPIPE_OP_TIE:
        case AVGPIPE_OP_AGREE:
            if (spec && !m->sync_ready) { /* the first sync op of a run whose extent was guessed: their tables now */
                m->sync_ready = 1;
                if (avgpipe__sim_sync_tables(m) != AVGPIPE_OK) {
                    m->spec_bad = 1;
                    ok = 0;
                    goto stop;
                }
            }
            if (!avgpipe__sim_sync(m, r, pos, t, &dep, &xfer)) goto wait;
            break;
        case AVGPIPE_OP_F:
            dep = op->stage == 0 ? 0 : m->ran[ix] & AVGPIPE__RAN_A ? m->cell[ix].act : -1;
            need = AVGPIPE__RAN_A;
            wix = ix;
            break;
        case AVGPIPE_OP_B:
        case AVGPIPE_OP_I:
            dep = op->stage == m->G - 1 ? 0 : m->ran[ix] & AVGPIPE__RAN_G ? m->cell[ix].grad : -1;
            need = AVGPIPE__RAN_G;
            wix = ix;
            if (!(m->ran[ix] & AVGPIPE__RAN_F)) dep = -1, need = 0; /* its forward has not run here: stuck */
            break;
        case AVGPIPE_OP_W:
        case AVGPIPE_OP_SEND_B: dep = m->ran[ix] & AVGPIPE__RAN_B ? t : -1; break;
        case AVGPIPE_OP_SEND_F: dep = m->ran[ix] & AVGPIPE__RAN_F ? t : -1; break;
        case AVGPIPE_OP_RECV_F:
        case AVGPIPE_OP_RECV_B:
            if ((how = avgpipe__sim_recv(m, op, t, &ok)) <= 0) goto stop;
            continue;
        default: break;
        }
        if (dep < 0) goto wait; /* input not there yet: sleep until a producer wakes us */
        need = 0;
        if (k == AVGPIPE_OP_SEND_F || k == AVGPIPE_OP_SEND_B) {
            if ((how = avgpipe__sim_send(m, r, op, &t, &ok)) == 0) {
                if (m->T) avgpipe__sim_arrive_ahead(m, r, pos, t);
                goto wait;
            }
            if (how < 0) goto stop;
            continue;
        }
        c = avgpipe__cost(m, op) + xfer;
        if (dep < t) dep = t;
        end = dep + c;
        st->busy += c;
        t = end;
        m->res->ops++;
        if (spec) m->spec_idle += k == AVGPIPE_OP_IDLE; /* an idle op never waits: counted once */
        if (k != AVGPIPE_OP_IDLE && (d->record_events == AVGPIPE_SIM_EVENTS_ALL || (d->record_events && end > dep)))
            ok &= avgpipe__event(m, op, r, 0, -1, -1, dep, end);
        if (k == AVGPIPE_OP_F || k == AVGPIPE_OP_B || k == AVGPIPE_OP_W) {
            double ab = d->stage_act_bytes ? d->stage_act_bytes[op->stage] : d->act_bytes;
            int sign = k == AVGPIPE_OP_F ? 1 : -1;
            m->stash[r] += sign;
            m->bytes[r] += sign * ab;
            if (m->stash[r] > st->peak_stash) st->peak_stash = m->stash[r];
            if (m->bytes[r] > st->peak_bytes) st->peak_bytes = m->bytes[r];
        }
        if (k == AVGPIPE_OP_F) {
            m->ran[ix] |= AVGPIPE__RAN_F;
            avgpipe__deliver(m, op, r, end, &ok);
        } else if (k == AVGPIPE_OP_B || k == AVGPIPE_OP_I) {
            m->ran[ix] |= AVGPIPE__RAN_B;
            avgpipe__deliver(m, op, r, end, &ok);
        }
    }
    m->pos[r] = pos;
    m->t[r] = t;
    return ok;
wait:
    m->waiting[r] |= 1;
    m->wait_on[r] = (uint8_t)need;
    m->wait_ix[r] = wix;
stop:
    m->pos[r] = pos;
    m->t[r] = t;
    return ok;
}
static int avgpipe__sim_rank(avgpipe__sim *m, int r) { return avgpipe__sim_rank_in(m, r, 0); }
static int avgpipe__sim_rank_checked(avgpipe__sim *m, int r) { return avgpipe__sim_rank_in(m, r, 1); }

AVGPIPE_API void avgpipe_sim_result_free(avgpipe_context *ctx, avgpipe_sim_result *r) {
    if (!r) return;
    avgpipe_free(ctx, r->rank);
    avgpipe_free(ctx, r->events);
    memset(r, 0, sizeof *r);
}

static void avgpipe__sim_release(avgpipe__sim *m) {
    avgpipe_context *ctx = m->ctx;
    int i;
    if (m->chan)
        for (i = 0; i < m->pl.nchan; i++) avgpipe_free(ctx, m->chan[i].post);
    avgpipe_free(ctx, m->chan);
    avgpipe__place_free(ctx, &m->pl);
    avgpipe_free(ctx, m->cell);
    avgpipe_free(ctx, m->ran);
    avgpipe_free(ctx, m->pos);
    avgpipe_free(ctx, m->waiting);
    avgpipe_free(ctx, m->stack);
    avgpipe_free(ctx, m->wait_ix);
    avgpipe_free(ctx, m->wait_on);
    avgpipe_free(ctx, m->stash);
    avgpipe_free(ctx, m->t);
    avgpipe_free(ctx, m->bytes);
    avgpipe_free(ctx, m->pairs);
    avgpipe_free(ctx, m->tie_at);
    avgpipe_free(ctx, m->agree_n);
    avgpipe_free(ctx, m->cost_tab);
}

/* The sync ops' tables: the tie pairs, the rounds, the ranks an AGREE waits for. */
static avgpipe_result avgpipe__sim_sync_tables(avgpipe__sim *m) {
    const avgpipe_schedule *s = m->s;
    int r, i, g, nsync = 0;
    size_t n, j;
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++) {
            const avgpipe_op *op = &s->ops[r][i];
            if (!avgpipe__is_sync(op->kind)) continue;
            nsync++;
            if (op->micro + 1 > m->T) m->T = op->micro + 1;
            if (op->kind != AVGPIPE_OP_TIE) continue;
            if (op->peer < 0 || op->peer >= m->G || op->peer == op->stage)
                return avgpipe__fail(m->ctx, AVGPIPE_INVALID_SCHEDULE, "avgpipe_sim_run: rank %d position %d: TIE with stage %d (not another stage of 0..%d)", r, i,
                                     op->peer, m->G - 1);
            if (!avgpipe__pair_add(m->ctx, &m->pairs, &m->npairs, op->stage, op->peer))
                return avgpipe__fail(m->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sim_run: out of memory");
        }
    if (!nsync) return AVGPIPE_OK;
    /* A valid schedule has every tie pair's two TIEs and an AGREE per (pipeline, round): tables of
       more cells than that many ops allow come from a sparse numbering, not from a schedule. */
    if (!avgpipe__cells_ok((double)m->N * m->T * (2.0 * m->npairs + 1), nsync))
        return avgpipe__fail(m->ctx, AVGPIPE_INVALID_SCHEDULE,
                             "schedule's TIE and AGREE rounds numbered too sparsely to simulate: %d pipelines x %d rounds x %d tie "
                             "pairs for %d sync ops",
                             m->N, m->T, m->npairs, nsync);
    for (r = 0; r < m->S; r++) {
        for (g = 0; g < m->G && m->pl.rank[g] != r; g++) {}
        m->agree_ranks += g < m->G;
    }
    n = (size_t)m->N * (size_t)m->T;
    m->tie_at = (double *)avgpipe_alloc(m->ctx, (n * 2 * (size_t)m->npairs + n) * sizeof(double));
    m->agree_n = (int *)avgpipe__calloc(m->ctx, n, sizeof(int));
    if (!m->tie_at || !m->agree_n) return avgpipe__fail(m->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sim_run: out of memory");
    m->agree_at = m->tie_at + n * 2 * (size_t)m->npairs;
    for (j = 0; j < n * 2 * (size_t)m->npairs; j++) m->tie_at[j] = -1;
    for (j = 0; j < n; j++) m->agree_at[j] = 0;
    return AVGPIPE_OK;
}

/* Sizes of the dependency tables, and a structural check the simulator relies on. */
static avgpipe_result avgpipe__sim_deadlock(avgpipe__sim *m) {
    char msg[AVGPIPE_ERROR_MAX];
    size_t n = 0;
    int r, shown = 0;
    n += (size_t)snprintf(msg, sizeof msg, "deadlock (%s sends):", m->d->blocking_send ? "blocking" : "async");
    for (r = 0; r < m->S && n < sizeof msg; r++) {
        char txt[64];
        if (m->pos[r] >= m->s->len[r]) continue;
        if (!shown) {
            m->stuck_rank = r;
            m->stuck_pos = m->pos[r];
        }
        if (shown++ == 8) {
            n += (size_t)snprintf(msg + n, sizeof msg - n, " ...");
            break;
        }
        avgpipe_op_format(&m->s->ops[r][m->pos[r]], 0, txt, sizeof txt);
        n += (size_t)snprintf(msg + n, sizeof msg - n, " rank %d waits at position %d (%s);", r, m->pos[r], txt);
    }
    return avgpipe__fail(m->ctx, AVGPIPE_DEADLOCK, "%s", msg);
}

static avgpipe_result avgpipe__sim_core(avgpipe_context *ctx, const avgpipe_schedule *s, const avgpipe_sim_desc *desc,
                                        avgpipe_sim_result *out, int *stuck, const avgpipe__extent *known, int guess);

AVGPIPE_API avgpipe_result avgpipe_sim_run(avgpipe_context *ctx, const avgpipe_schedule *s, const avgpipe_sim_desc *desc,
                                           avgpipe_sim_result *out) {
    return avgpipe__sim_core(ctx, s, desc, out, NULL, NULL, 1);
}

/* The extent the shape promises (its pipelines, micro x rounds micro-batches), for a run that checks
   each op as it goes instead of scanning them all first (a pass over every op, a third of simulating
   a large schedule): 1 when the shape names one whose tables the scan would allow for this many ops
   (idle ones included; the run checks again without them). Not with blocking sends, whose sync ops
   are looked ahead at. */
static int avgpipe__sim_guess(const avgpipe_schedule *s, const avgpipe_sim_desc *desc, avgpipe__extent *e) {
    const avgpipe_sched_desc *sh = &s->shape;
    long long total = 0;
    int r;
    if (desc->blocking_send || sh->pipes < 1 || sh->micro < 1 || sh->rounds < 1 || s->nstages < 1) return 0;
    *e = avgpipe__gen_extent(s, 0); /* no sync ops counted: their tables come at the first one */
    if (!avgpipe__extent_ok(s, e)) return 0;
    for (r = 0; r < s->nranks; r++) total += s->len[r];
    return avgpipe__cells_ok((double)e->N * s->nstages * (double)e->U, total);
}

/* stuck (optional) gets the rank and position of the first stuck op after a deadlock. known (may be
   NULL): the extent of s (no scan). guess: without known, size the tables from the shape when it
   allows (avgpipe__sim_guess) and check each op as it runs; where that fails (a fault, a deadlock:
   the ops after it were not checked) it runs again after the scan, whose verdict is the result. */
static avgpipe_result avgpipe__sim_core(avgpipe_context *ctx, const avgpipe_schedule *s, const avgpipe_sim_desc *desc,
                                        avgpipe_sim_result *out, int *stuck, const avgpipe__extent *known, int guess) {
    avgpipe_sim_desc zero, resolved;
    avgpipe__sim m;
    avgpipe__extent guessed;
    avgpipe_result res;
    size_t cells;
    int r, N, nsync, spec = 0;
    long long U;
    double busy = 0;
    if (!s || !out || !s->len) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sim_run: NULL argument");
    memset(out, 0, sizeof *out);
    if (!desc) {
        memset(&zero, 0, sizeof zero);
        desc = &zero;
    }
    if (desc->latency < 0 || desc->bytes < 0 || desc->bandwidth < 0 || desc->micro_size < 0)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sim_run: latency, bytes, bandwidth and micro_size must be >= 0");
    if (desc->record_events < 0 || desc->record_events > AVGPIPE_SIM_EVENTS_TIMED)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sim_run: record_events is %d (0, AVGPIPE_SIM_EVENTS_ALL or _TIMED)",
                             desc->record_events);
    for (r = 0; r < AVGPIPE_OP_KIND_COUNT; r++)
        if (!avgpipe__zero_ok(desc->cost[r]))
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sim_run: cost[%s] is %g (a cost is >= 0, or AVGPIPE_ZERO for exactly 0)",
                                 avgpipe_op_kind_name((avgpipe_op_kind)r), desc->cost[r]);
    if (desc->blocking_send && !s->has_comm) { /* blocking semantics need explicit receives */
        avgpipe_schedule low;
        res = avgpipe_sched_lower(ctx, s, &low);
        if (res) return res;
        if (low.has_comm) {
            res = avgpipe__sim_core(ctx, &low, desc, out, NULL, NULL, guess);
            avgpipe_sched_free(ctx, &low);
            return res;
        }
        avgpipe_sched_free(ctx, &low); /* nothing crosses ranks: blocking changes nothing */
    }
    memset(&m, 0, sizeof m);
    resolved = avgpipe_sim_query_defaults(desc);
    res = avgpipe__place_build(ctx, s, &m.pl);
    if (res) return res;
    if (!(known = avgpipe__extent_ok(s, known)) && guess && avgpipe__sim_guess(s, desc, &guessed)) known = &guessed, spec = 1;
    if (known) N = known->N, U = known->U, nsync = known->nsync;
    else res = avgpipe__sched_scan_sync(ctx, s, m.pl.rank, &N, &U, &nsync);
    if (res) {
        avgpipe__place_free(ctx, &m.pl);
        return res;
    }
    m.ctx = ctx;
    m.s = s;
    m.d = &resolved;
    m.res = out;
    m.S = s->nranks;
    m.G = s->nstages;
    m.N = N;
    m.U = U;
    m.spec = spec;
    m.sync_ready = !spec; /* a guessed extent counted no sync ops: their tables at the first one */
    cells = (size_t)N * (size_t)m.G * (size_t)U;
    m.cell = (avgpipe__cell *)avgpipe_alloc(ctx, cells * sizeof *m.cell);
    m.ran = (uint8_t *)avgpipe__calloc(ctx, cells, 1);
    m.chan = (avgpipe__chan *)avgpipe__calloc(ctx, (size_t)m.pl.nchan + 1, sizeof(avgpipe__chan));
    m.pos = (int *)avgpipe__calloc(ctx, (size_t)m.S, sizeof(int));
    m.waiting = (int *)avgpipe__calloc(ctx, (size_t)m.S, sizeof(int));
    m.stack = (int *)avgpipe__calloc(ctx, (size_t)m.S, sizeof(int));
    m.wait_ix = (size_t *)avgpipe__calloc(ctx, (size_t)m.S, sizeof(size_t));
    m.wait_on = (uint8_t *)avgpipe__calloc(ctx, (size_t)m.S, 1);
    m.stash = (int *)avgpipe__calloc(ctx, (size_t)m.S, sizeof(int));
    m.t = (double *)avgpipe__calloc(ctx, (size_t)m.S, sizeof(double));
    m.bytes = (double *)avgpipe__calloc(ctx, (size_t)m.S, sizeof(double));
    out->rank = (avgpipe_rank_stats *)avgpipe__calloc(ctx, (size_t)m.S, sizeof(avgpipe_rank_stats));
    out->nranks = m.S;
    if (!m.cell || !m.ran || !m.chan || !m.pos || !m.waiting || !m.stack || !m.wait_ix || !m.wait_on || !m.stash || !m.t ||
        !m.bytes || !out->rank) {
        res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sim_run: out of memory");
        goto done;
    }
    if (nsync && (res = avgpipe__sim_sync_tables(&m)) != AVGPIPE_OK) goto done;
    if (desc->record_events) { /* room for every event at once: one per op, two per transfer */
        size_t ne = 0;
        int j;
        for (r = 0; r < m.S; r++)
            for (j = 0; j < s->len[r]; j++) {
                int k = s->ops[r][j].kind;
                if (k == AVGPIPE_OP_IDLE || k == AVGPIPE_OP_RECV_F || k == AVGPIPE_OP_RECV_B) continue;
                ne += k == AVGPIPE_OP_SEND_F || k == AVGPIPE_OP_SEND_B ? 2 : !s->has_comm && (k == AVGPIPE_OP_F || avgpipe__is_backward(k)) ? 3 : 1;
            }
        if (ne > 0) {
            out->events = (avgpipe_event *)avgpipe_alloc(ctx, ne * sizeof *out->events);
            if (!out->events) {
                res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sim_run: out of memory");
                goto done;
            }
            out->events_cap = ne;
        }
    }
    if (!desc->cost_fn && m.G > 0) { /* a load per op instead of the branches and the scaling of avgpipe__cost_of */
        int k, g;
        if (!(m.cost_tab = (double *)avgpipe_alloc(ctx, (size_t)m.G * AVGPIPE_OP_KIND_COUNT * sizeof(double)))) {
            res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sim_run: out of memory");
            goto done;
        }
        for (g = 0; g < m.G; g++)
            for (k = 0; k < AVGPIPE_OP_KIND_COUNT; k++) {
                avgpipe_op probe = avgpipe__op(k, 0, g, 0);
                m.cost_tab[(size_t)g * AVGPIPE_OP_KIND_COUNT + k] = avgpipe__cost_of(m.d, m.G, &probe);
            }
    }
    if (!desc->stage_bytes) {
        m.xfer = avgpipe__xfer_time(&m, 0);
        m.xfer_ready = 1;
    }
    for (r = m.S - 1; r >= 0; r--) m.stack[m.nstack++] = r;
    while (m.nstack > 0) {
        r = m.stack[--m.nstack];
        if (!(spec ? avgpipe__sim_rank_checked(&m, r) : avgpipe__sim_rank(&m, r))) {
            if (m.spec_bad) goto again;
            res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sim_run: out of memory");
            goto done;
        }
    }
    if (spec) { /* every op was checked only if every one ran; and the scan's size check, on the ops */
        long long nops = -m.spec_idle;
        for (r = 0; r < m.S; r++) nops += s->len[r];
        for (r = 0; r < m.S; r++)
            if (m.pos[r] < s->len[r]) goto again;
        if (!avgpipe__cells_ok((double)cells, nops)) goto again;
    }
    for (r = 0; r < m.S; r++)
        if (m.pos[r] < s->len[r]) {
            res = avgpipe__sim_deadlock(&m);
            if (stuck) {
                stuck[0] = m.stuck_rank;
                stuck[1] = m.stuck_pos;
            }
            goto done;
        }
    for (r = 0; r < m.S; r++) {
        if (m.t[r] > m.makespan) m.makespan = m.t[r];
        busy += out->rank[r].busy;
    }
    out->makespan = m.makespan;
    for (r = 0; r < m.S; r++) out->rank[r].idle = m.makespan - out->rank[r].busy - out->rank[r].blocked;
    out->bubble = m.makespan > 0 ? 1.0 - busy / (m.S * m.makespan) : 0;
done:
    avgpipe__sim_release(&m);
    if (res) avgpipe_sim_result_free(ctx, out);
    return res;
again: /* the guessed extent did not hold: the scan's run decides */
    avgpipe__sim_release(&m);
    avgpipe_sim_result_free(ctx, out);
    return avgpipe__sim_core(ctx, s, desc, out, stuck, NULL, 0);
}

/* --- 8. Validation: the static checks (section 9 replays) ------------------------------------ */

typedef struct avgpipe__msg {
    uint8_t kind; /* AVGPIPE_OP_F (activation) or AVGPIPE_OP_B (gradient) */
    int16_t pipe;
    int32_t stage, micro; /* the consumer's stage */
    int32_t rank, pos;
} avgpipe__msg;

typedef struct avgpipe__msgs {
    avgpipe__msg *v;
    int n, cap;
} avgpipe__msgs;

static int avgpipe__msgs_push(avgpipe_context *ctx, avgpipe__msgs *q, avgpipe__msg x) {
    if (q->n == q->cap) {
        int cap = q->cap ? 2 * q->cap : 64;
        avgpipe__msg *p = (avgpipe__msg *)avgpipe__realloc(ctx, q->v, (size_t)q->n * sizeof x, (size_t)cap * sizeof x);
        if (!p) return 0;
        q->v = p;
        q->cap = cap;
    }
    q->v[q->n++] = x;
    return 1;
}

typedef struct avgpipe__vstate {
    avgpipe_context *ctx;
    const avgpipe_schedule *s;
    avgpipe_validate_report *rep;
    int S, G, N, M, R;
    uint8_t *st;   /* [pipe][stage][micro]: bits below */
    uint8_t *step; /* [pipe][stage][round]: 1 STEP, 2 AVG */
    avgpipe__place pl;
    avgpipe__msgs *sendq, *recvq; /* [pl.nchan] */
    int any_step;
    /* For the replay of a compute-only schedule: each message's index on its channel (the order in
       which its sender produces it), by the cell it feeds: seqf for the activation into (p, g, u),
       seqb for the gradient into it; nseq counts the messages per channel. NULL when not needed. */
    int32_t *seqf, *seqb;
    int *nseq;
    int fsdp; /* the lists hold UNSHARD, RESHARD or REDUCE_GRAD ops */
    /* Ties and agreement (TIE and AGREE ops). A tie pair is (lo, hi) stages; its TIE(lo@hi) is side 1,
       TIE(hi@lo) side 2 (bits 1, 2 in tie[]: seen by the static pass; 4, 8: reached in the replay). */
    int nsync, any_agree, npairs, agree_ranks;
    /* sync_known: vsync_prepare's verdict is in (else the static pass runs on the guess that there
       are no sync ops, and sync_met says it met one) */
    int sync_known, sync_met, any_sync;
    int *pairs;          /* [npairs][2] */
    int *npart;          /* [G]: partners of each stage */
    uint8_t *tie;        /* [N][R][npairs] */
    uint16_t *nties;     /* [N][G][R]: TIEs seen so far */
    int *agree_at;       /* [S]: replay: p * R + t + 1 of the AGREE group the rank reached last */
    int *agree_arrived;  /* [N][R]: replay: ranks that reached that group */
} avgpipe__vstate;

/* Bits of avgpipe__vstate.st: what the static pass saw (F, B, I, W, RECV_F, RECV_B), then what the
   replay delivered (the activation, the gradient). */
enum { AVGPIPE__VF = 1, AVGPIPE__VB = 2, AVGPIPE__VI = 4, AVGPIPE__VW = 8, AVGPIPE__VRF = 16, AVGPIPE__VRB = 32,
       AVGPIPE__VA = 64, AVGPIPE__VG = 128 };
/* Bits of avgpipe__vstate.step: per (pipe, stage, round). */
enum { AVGPIPE__VSTEP = 1, AVGPIPE__VAVG = 2, AVGPIPE__VAGREE = 4 };

static avgpipe_result avgpipe__vfail(avgpipe__vstate *v, avgpipe_result res, int rank, int pos, const char *fmt, ...) {
    va_list ap;
    avgpipe_validate_report *rep = v->rep;
    char body[400];
    va_start(ap, fmt);
    vsnprintf(body, sizeof body, fmt, ap);
    va_end(ap);
    rep->result = res;
    rep->rank = rank;
    rep->pos = pos;
    rep->op_text[0] = 0;
    if (rank >= 0 && pos >= 0 && rank < v->s->nranks && pos < v->s->len[rank])
        avgpipe_op_format(&v->s->ops[rank][pos], 0, rep->op_text, sizeof rep->op_text);
    if (pos >= 0)
        snprintf(rep->message, sizeof rep->message, "rank %d, position %d, op %s: %s", rank, pos, rep->op_text, body);
    else
        snprintf(rep->message, sizeof rep->message, "%s", body);
    return avgpipe__fail(v->ctx, res, "%s", rep->message);
}

static size_t avgpipe__vix(const avgpipe__vstate *v, int p, int g, int u) {
    return ((size_t)p * (size_t)v->G + (size_t)g) * (size_t)(v->M * v->R) + (size_t)u;
}

/* One op of the static pass. */
/* The first micro-batch of round t whose backward work on (p, g) is not done yet, or -1. */
static int avgpipe__vwork_missing(const avgpipe__vstate *v, int p, int g, int t) {
    int j;
    for (j = t * v->M; j < (t + 1) * v->M; j++) {
        uint8_t b = v->st[avgpipe__vix(v, p, g, j)];
        if (!(b & AVGPIPE__VB) && !(b & AVGPIPE__VW)) return j;
    }
    return -1;
}

/* The tie pair of stages g and h, or -1. */
static int avgpipe__vpair(const avgpipe__vstate *v, int g, int h) { return avgpipe__pair_find(v->pairs, v->npairs, g, h); }

/* A TIE or AGREE op (stage and pipeline already checked): after its stage's backward work of the
   round (a TIE with a stage on the same rank: after that stage's too, as the runtime sums both there),
   once, before the round's STEP; TIEs before the AGREE. */
static avgpipe_result avgpipe__check_sync_op(avgpipe__vstate *v, int r, int i) {
    const avgpipe_op *op = &v->s->ops[r][i];
    int g = op->stage, p = op->pipe, t = op->micro, G = v->G, j;
    size_t k = ((size_t)p * G + g) * v->R + (size_t)t;
    const char *what = op->kind == AVGPIPE_OP_TIE ? "TIE" : "AGREE";
    if (t < 0 || t >= v->R) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "round %d out of range 0..%d", t, v->R - 1);
    if (v->step[k] & AVGPIPE__VSTEP) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "%s after the STEP of its round", what);
    if ((j = avgpipe__vwork_missing(v, p, g, t)) >= 0)
        return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "%s before the backward work of micro-batch %d", what, j);
    if (op->kind == AVGPIPE_OP_AGREE) {
        if (v->step[k] & AVGPIPE__VAGREE) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate AGREE");
        if (v->nties[k] != v->npart[g])
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "AGREE before its TIEs (%d of %d placed)", v->nties[k], v->npart[g]);
        v->step[k] |= AVGPIPE__VAGREE;
        return AVGPIPE_OK;
    }
    {
        int h = op->peer, q = avgpipe__vpair(v, g, h);
        uint8_t bit = (uint8_t)(g < h ? 1 : 2), *x = &v->tie[((size_t)p * v->R + (size_t)t) * (size_t)v->npairs + (size_t)q];
        if (v->step[k] & AVGPIPE__VAGREE) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "TIE after the AGREE of its round");
        if (*x & bit) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate TIE");
        if (v->pl.rank[h] == r && (j = avgpipe__vwork_missing(v, p, h, t)) >= 0)
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i,
                                  "TIE with stage %d (on this rank) before that stage's backward work of micro-batch %d", h, j);
        *x |= bit;
        v->nties[k]++;
    }
    return AVGPIPE_OK;
}

/* The message an activation (fwd) or gradient carries to stage g, seen at rank r position i. Filled
   only for SEND and RECV ops: filling it for every op kept it on the stack in check_op's loop. */
static void avgpipe__msg_at(avgpipe__msg *m, int fwd, int p, int g, int u, int r, int i) {
    m->kind = (uint8_t)(fwd ? AVGPIPE_OP_F : AVGPIPE_OP_B);
    m->pipe = (int16_t)p;
    m->stage = g;
    m->micro = u;
    m->rank = r;
    m->pos = i;
}

/* One op of the static pass, inlined into check_static's loop: a call per op (a large frame, for
   the error paths) was a fifth of the pass. */
AVGPIPE__FORCE_INLINE avgpipe_result avgpipe__check_op(avgpipe__vstate *v, int r, int i) {
    const avgpipe_op *op = &v->s->ops[r][i];
    int k = op->kind, g = op->stage, p = op->pipe, u = op->micro, G = v->G, MR = v->M * v->R;
    uint8_t *x;
    avgpipe__msg msg;
    if (k == AVGPIPE_OP_IDLE) return AVGPIPE_OK;
    if (k == AVGPIPE_OP_UNSHARD || k == AVGPIPE_OP_RESHARD || k == AVGPIPE_OP_REDUCE_GRAD) {
        v->fsdp = 1; /* no-ops here; the replay checks their ranks as the simulator does */
        return AVGPIPE_OK;
    }
    if (k >= AVGPIPE_OP_KIND_COUNT) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "unknown op kind %d", k);
    if (g < 0 || g >= G) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "stage %d out of range 0..%d", g, G - 1);
    if (v->pl.rank[g] != r)
        return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "stage %d lives on rank %d, not %d (%s placement)", g, v->pl.rank[g], r,
                              avgpipe_placement_name(v->s->shape.placement));
    if (p < 0 || p >= v->N) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "pipeline %d out of range 0..%d", p, v->N - 1);
    if (k == AVGPIPE_OP_STEP || k == AVGPIPE_OP_AVG) {
        uint8_t *sx;
        int j;
        if (u < 0 || u >= v->R) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "round %d out of range 0..%d", u, v->R - 1);
        sx = &v->step[((size_t)p * G + g) * v->R + u];
        v->any_step = 1;
        if (k == AVGPIPE_OP_AVG) {
            if (!(*sx & 1)) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "AVG before its STEP");
            if (*sx & 2) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate AVG");
            *sx |= 2;
            return AVGPIPE_OK;
        }
        if (*sx & 1) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate STEP");
        if ((j = avgpipe__vwork_missing(v, p, g, u)) >= 0)
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "STEP before the backward work of micro-batch %d", j);
        if (v->nsync && v->nties[((size_t)p * G + g) * v->R + u] != v->npart[g])
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "STEP before its TIEs (%d of %d placed)",
                                  v->nties[((size_t)p * G + g) * v->R + u], v->npart[g]);
        if (v->any_agree && !(*sx & AVGPIPE__VAGREE)) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "STEP before its AGREE");
        *sx |= 1;
        return AVGPIPE_OK;
    }
    if (avgpipe__is_sync(k)) {
        if (!v->sync_known) { /* the pass guessed there were none: the caller runs it again, prepared */
            v->sync_met = 1;
            return AVGPIPE_INVALID_SCHEDULE;
        }
        return avgpipe__check_sync_op(v, r, i);
    }
    if (u < 0 || u >= MR)
        return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "micro-batch %d out of range 0..%d (micro x rounds)", u, MR - 1);
    x = &v->st[avgpipe__vix(v, p, g, u)];
    switch (k) {
    case AVGPIPE_OP_F:
        if (*x & AVGPIPE__VF) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate forward");
        if (g > 0 && v->pl.rank[g - 1] == r && !(v->st[avgpipe__vix(v, p, g - 1, u)] & AVGPIPE__VF))
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "forward before the forward of stage %d it needs", g - 1);
        if (v->s->has_comm && g > 0 && v->pl.rank[g - 1] != r && !(*x & AVGPIPE__VRF))
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "forward without a RECV_F posted before it");
        if (v->any_step && u >= v->M && !(v->step[((size_t)p * G + g) * v->R + u / v->M - 1] & 1))
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "forward of round %d before STEP of round %d", u / v->M,
                                  u / v->M - 1);
        *x |= AVGPIPE__VF;
        if (v->seqf && v->pl.up[g] >= 0) v->seqf[avgpipe__vix(v, p, g + 1, u)] = v->nseq[v->pl.up[g]]++;
        break;
    case AVGPIPE_OP_B:
    case AVGPIPE_OP_I:
        if (!(*x & AVGPIPE__VF)) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "backward before its forward");
        if (*x & (AVGPIPE__VB | AVGPIPE__VI)) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate backward");
        if (g < G - 1 && v->pl.rank[g + 1] == r && !(v->st[avgpipe__vix(v, p, g + 1, u)] & (AVGPIPE__VB | AVGPIPE__VI)))
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "backward before the backward of stage %d it needs", g + 1);
        if (v->s->has_comm && g < G - 1 && v->pl.rank[g + 1] != r && !(*x & AVGPIPE__VRB))
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "backward without a RECV_B posted before it");
        *x |= k == AVGPIPE_OP_B ? AVGPIPE__VB : AVGPIPE__VI;
        if (v->seqb && v->pl.down[g] >= 0) v->seqb[avgpipe__vix(v, p, g - 1, u)] = v->nseq[v->pl.down[g]]++;
        break;
    case AVGPIPE_OP_W:
        if (!(*x & AVGPIPE__VI)) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "W before its I");
        if (*x & AVGPIPE__VW) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate W");
        *x |= AVGPIPE__VW;
        break;
    case AVGPIPE_OP_SEND_F:
    case AVGPIPE_OP_SEND_B: {
        int fwd = k == AVGPIPE_OP_SEND_F, g2 = g + (fwd ? 1 : -1);
        if (!v->s->has_comm) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "send in a compute-only schedule (has_comm is 0)");
        if (fwd ? !(*x & AVGPIPE__VF) : !(*x & (AVGPIPE__VB | AVGPIPE__VI)))
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "send before the op that produces its data");
        if (g2 < 0 || g2 >= G || v->pl.rank[g2] == r)
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "send with no consumer on another rank");
        avgpipe__msg_at(&msg, fwd, p, g2, u, r, i);
        if (!avgpipe__msgs_push(v->ctx, &v->sendq[fwd ? v->pl.up[g] : v->pl.down[g]], msg))
            return avgpipe__vfail(v, AVGPIPE_OUT_OF_MEMORY, -1, -1, "validator: out of memory");
        break;
    }
    case AVGPIPE_OP_RECV_F:
    case AVGPIPE_OP_RECV_B: {
        int fwd = k == AVGPIPE_OP_RECV_F, g2 = g + (fwd ? -1 : 1);
        if (!v->s->has_comm)
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "receive in a compute-only schedule (has_comm is 0)");
        if (g2 < 0 || g2 >= G || v->pl.rank[g2] == r)
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "receive with no producer on another rank");
        if (*x & (fwd ? AVGPIPE__VRF : AVGPIPE__VRB)) return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate receive");
        *x |= fwd ? AVGPIPE__VRF : AVGPIPE__VRB;
        avgpipe__msg_at(&msg, fwd, p, g, u, r, i);
        if (!avgpipe__msgs_push(v->ctx, &v->recvq[fwd ? v->pl.up[g2] : v->pl.down[g2]], msg))
            return avgpipe__vfail(v, AVGPIPE_OUT_OF_MEMORY, -1, -1, "validator: out of memory");
        break;
    }
    default: break;
    }
    return AVGPIPE_OK;
}

/* Completeness after the pass: every micro-batch forwarded and fully backwarded, every STEP there. */
static avgpipe_result avgpipe__check_complete(avgpipe__vstate *v) {
    int p, g, u, t;
    for (p = 0; p < v->N; p++)
        for (g = 0; g < v->G; g++) {
            for (u = 0; u < v->M * v->R; u++) {
                uint8_t b = v->st[avgpipe__vix(v, p, g, u)];
                if (!(b & AVGPIPE__VF))
                    return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, v->pl.rank[g], -1,
                                          "rank %d: pipeline %d stage %d micro-batch %d has no forward (missing forward)", v->pl.rank[g], p,
                                          g, u);
                if (!(b & (AVGPIPE__VB | AVGPIPE__VI)))
                    return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, v->pl.rank[g], -1,
                                          "rank %d: pipeline %d stage %d micro-batch %d has no backward", v->pl.rank[g], p, g, u);
                if ((b & AVGPIPE__VI) && !(b & AVGPIPE__VW))
                    return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, v->pl.rank[g], -1,
                                          "rank %d: pipeline %d stage %d micro-batch %d has I but no W", v->pl.rank[g], p, g, u);
            }
            if (v->any_step)
                for (t = 0; t < v->R; t++)
                    if (!(v->step[((size_t)p * v->G + g) * v->R + t] & 1))
                        return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, v->pl.rank[g], -1,
                                              "rank %d: pipeline %d stage %d has no STEP for round %d", v->pl.rank[g], p, g, t);
        }
    return AVGPIPE_OK;
}

/* Each channel (src, dst) must carry the same messages in the same order at both ends: the comm
   backends match per peer without tags. */
static avgpipe_result avgpipe__check_channels(avgpipe__vstate *v) {
    int c, j;
    for (c = 0; c < v->pl.nchan; c++) {
        avgpipe__msgs *a = &v->sendq[c], *b = &v->recvq[c];
        int n = a->n < b->n ? a->n : b->n, src = v->pl.src[c], dst = v->pl.dst[c];
        for (j = 0; j < n; j++) {
            avgpipe__msg *x = &a->v[j], *y = &b->v[j];
            if (x->kind != y->kind || x->pipe != y->pipe || x->stage != y->stage || x->micro != y->micro) {
                char tx[64], ty[64];
                avgpipe_op_format(&v->s->ops[x->rank][x->pos], 0, tx, sizeof tx);
                avgpipe_op_format(&v->s->ops[y->rank][y->pos], 0, ty, sizeof ty);
                return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, y->rank, y->pos,
                                      "mismatched send/receive order on channel rank %d -> rank %d, message #%d: sent %s (rank %d "
                                      "position %d), received as %s",
                                      src, dst, j, tx, x->rank, x->pos, ty);
            }
        }
        if (a->n != b->n) {
            avgpipe__msg *x = a->n > b->n ? &a->v[n] : &b->v[n];
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, x->rank, x->pos,
                                  "channel rank %d -> rank %d has %d sends but %d receives", src, dst, a->n, b->n);
        }
    }
    return AVGPIPE_OK;
}

static int avgpipe__rank_holds_stage(const avgpipe__vstate *v, int r) {
    int g;
    for (g = 0; g < v->G; g++)
        if (v->pl.rank[g] == r) return 1;
    return 0;
}

/* Before the static pass: count the sync ops, check their peers, collect the tie pairs. */
static avgpipe_result avgpipe__vsync_prepare(avgpipe__vstate *v) {
    const avgpipe_schedule *s = v->s;
    int r, i, q;
    for (r = 0; r < v->S; r++)
        for (i = 0; i < s->len[r]; i++) {
            const avgpipe_op *op = &s->ops[r][i];
            if (!avgpipe__is_sync(op->kind)) continue;
            v->nsync++;
            if (op->kind == AVGPIPE_OP_AGREE) {
                v->any_agree = 1;
                continue;
            }
            if (op->peer < 0 || op->peer >= v->G || op->peer == op->stage)
                return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, op->peer == op->stage ? "TIE of stage %d with itself" : "TIE with stage %d, outside 0..%d",
                                      op->peer, v->G - 1);
            if (op->stage >= 0 && op->stage < v->G && !avgpipe__pair_add(v->ctx, &v->pairs, &v->npairs, op->stage, op->peer))
                return avgpipe__vfail(v, AVGPIPE_OUT_OF_MEMORY, -1, -1, "validator: out of memory");
        }
    if (!v->nsync) return AVGPIPE_OK;
    v->npart = (int *)avgpipe__calloc(v->ctx, (size_t)v->G + 2 * (size_t)v->S + (size_t)v->N * v->R, sizeof(int));
    v->nties = (uint16_t *)avgpipe__calloc(v->ctx, (size_t)v->N * v->G * v->R, sizeof(uint16_t));
    v->tie = (uint8_t *)avgpipe__calloc(v->ctx, (size_t)v->N * v->R * (size_t)(v->npairs + 1), 1);
    if (!v->npart || !v->nties || !v->tie) return avgpipe__vfail(v, AVGPIPE_OUT_OF_MEMORY, -1, -1, "validator: out of memory");
    v->agree_at = v->npart + v->G;
    v->agree_arrived = v->agree_at + v->S;
    for (q = 0; q < v->npairs; q++) {
        v->npart[v->pairs[2 * q]]++;
        v->npart[v->pairs[2 * q + 1]]++;
    }
    for (r = 0; r < v->S; r++) v->agree_ranks += s->len[r] > 0 && avgpipe__rank_holds_stage(v, r);
    return AVGPIPE_OK;
}

/* The next sync event of rank r from *i on that concerns rank `other` (a TIE with a stage there) or
   everyone (the first AGREE of a group; other -1: AGREE groups only): its op, or NULL at the end. */
static const avgpipe_op *avgpipe__vsync_next(const avgpipe__vstate *v, int r, int other, int *i) {
    const avgpipe_op *o = v->s->ops[r];
    for (; *i < v->s->len[r]; (*i)++) {
        const avgpipe_op *op = &o[*i];
        if (op->kind == AVGPIPE_OP_AGREE && !(*i > 0 && o[*i - 1].kind == AVGPIPE_OP_AGREE && o[*i - 1].pipe == op->pipe &&
                                              o[*i - 1].micro == op->micro))
            return &o[(*i)++];
        if (op->kind == AVGPIPE_OP_TIE && other >= 0 && v->pl.rank[op->peer] == other) return &o[(*i)++];
    }
    return NULL;
}

/* The sync ops travel on a communicator of their own, matched in order: every rank meets the AGREE
   groups in the same order, once each, and two ranks that share a tie meet their TIEs and the AGREE
   groups in the same order. */
static avgpipe_result avgpipe__check_sync_order(avgpipe__vstate *v) {
    int r, q, first = -1;
    for (r = 0; r < v->S; r++) {
        int i = 0, j = 0, n = 0;
        const avgpipe_op *a, *b;
        if (!avgpipe__rank_holds_stage(v, r)) continue;
        if (first < 0) first = r;
        for (;;) {
            a = avgpipe__vsync_next(v, r, -1, &i);
            b = avgpipe__vsync_next(v, first, -1, &j);
            if (!a && !b) break;
            if (!a || !b || a->pipe != b->pipe || a->micro != b->micro)
                return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, a ? r : first, (a ? i : j) - 1,
                                      "AGREE group #%d of rank %d differs from rank %d's (the agreement is matched in order)", n, r, first);
            n++;
        }
        if (v->any_agree && n != v->N * v->R)
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, -1, "rank %d: %d AGREE groups, not one per pipeline and round (%d): a rank's AGREE ops of one round must be consecutive",
                                  r, n, v->N * v->R);
    }
    for (q = 0; q < v->npairs; q++) {
        int A = v->pl.rank[v->pairs[2 * q]], B = v->pl.rank[v->pairs[2 * q + 1]], i = 0, j = 0, n = 0, q2, seen = 0;
        if (A == B) continue;
        for (q2 = 0; q2 < q && !seen; q2++)
            seen = (v->pl.rank[v->pairs[2 * q2]] == A && v->pl.rank[v->pairs[2 * q2 + 1]] == B) ||
                   (v->pl.rank[v->pairs[2 * q2]] == B && v->pl.rank[v->pairs[2 * q2 + 1]] == A);
        if (seen) continue;
        for (;; n++) {
            const avgpipe_op *a = avgpipe__vsync_next(v, A, B, &i), *b = avgpipe__vsync_next(v, B, A, &j);
            if (!a && !b) break;
            if (!a || !b || a->kind != b->kind || a->pipe != b->pipe || a->micro != b->micro ||
                (a->kind == AVGPIPE_OP_TIE && (a->peer != b->stage || b->peer != a->stage)))
                return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, a ? A : B, (a ? i : j) - 1,
                                      "sync op #%d between rank %d and rank %d is not the one the other rank has there (ties and agreement "
                                      "are matched in order)",
                                      n, A, B);
        }
    }
    return AVGPIPE_OK;
}

/* The static pass. peak (may be NULL): the peak stashed activations of each rank r < 256, as
   avgpipe__vprescan counts them (complete only when the pass is). */
static avgpipe_result avgpipe__check_static(avgpipe__vstate *v, int *peak) {
    avgpipe_result res = AVGPIPE_OK;
    int r, i;
    for (r = 0; r < v->S && !res; r++) {
        const avgpipe_op *o = v->s->ops[r];
        int cur = 0, best = 0;
        for (i = 0; i < v->s->len[r] && !res; i++) {
            int k = o[i].kind;
            if (k == AVGPIPE_OP_F && ++cur > best) best = cur;
            if (k == AVGPIPE_OP_B || k == AVGPIPE_OP_W) cur--;
            res = avgpipe__check_op(v, r, i);
        }
        if (peak && r < 256) peak[r] = best;
    }
    if (!res) res = avgpipe__check_complete(v);
    if (!res && v->nsync && !v->any_step)
        res = avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, -1, -1, "TIE and AGREE ops without STEPs (they synchronise the STEPs)");
    if (!res && v->nsync) res = avgpipe__check_sync_order(v);
    if (!res && v->s->has_comm) res = avgpipe__check_channels(v);
    return res;
}

/* What the validator's static pass needs to know before it starts, in one pass over the ops: the
   ops that are not idle (for the size check), whether any is a TIE or AGREE (vsync_prepare has
   nothing to do otherwise), and the peak stashed activations of each rank r < nmax: forward +1, B
   or W -1 (I keeps the activation for W). A valid schedule without sync ops does without it (the
   static pass counts the peaks, and has every cell's forward); the others run it first. */
static long long avgpipe__vprescan(const avgpipe_schedule *s, int *peak, int nmax, int *any_sync) {
    long long nops = 0;
    int r, i, sync = 0;
    for (r = 0; r < s->nranks; r++) {
        int cur = 0, best = 0;
        for (i = 0; i < s->len[r]; i++) {
            int k = s->ops[r][i].kind;
            nops += k != AVGPIPE_OP_IDLE;
            sync |= avgpipe__is_sync(k);
            if (k == AVGPIPE_OP_F && ++cur > best) best = cur;
            if (k == AVGPIPE_OP_B || k == AVGPIPE_OP_W) cur--;
        }
        if (r < nmax) peak[r] = best;
    }
    *any_sync = sync;
    return nops;
}

static avgpipe_result avgpipe__check_memory(avgpipe__vstate *v) {
    const avgpipe_sched_desc *sh = &v->s->shape;
    int r;
    if (sh->kind == AVGPIPE_SCHED_CUSTOM) return AVGPIPE_OK;
    for (r = 0; r < v->S && r < 256; r++) {
        int model = avgpipe_sched_peak_stash(sh, r), got = v->rep->peak_stash[r];
        if (model < 0) continue;
        int bound = sh->kind == AVGPIPE_SCHED_ZBV && sh->continuous; /* forwards may wait for a STEP: fewer in flight */
        if (bound ? got > model : got != model)
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, r, -1,
                                  "rank %d stashes %d activations at its peak but the memory model of %s says %s%d", r, got,
                                  avgpipe_sched_kind_name(sh->kind), bound ? "at most " : "", model);
    }
    return AVGPIPE_OK;
}

/* --- 9. The deadlock replay, and the validator's entry point --------------------------------- */

/* Every rank runs its list in order; an op waits only for what it needs from another rank (the
   static pass has already put each rank's own dependencies in order): a forward or backward waits
   for its input to arrive, and a blocking send waits until the receiver has posted the matching
   receive. Every condition, once true, stays true, so running each rank as far as it can go until
   nothing moves reaches the same final state in any order: the replay needs no times. A blocking
   replay that finishes proves the asynchronous one too (blocking sends only add waits).
   A lowered schedule (has_comm = 1) is replayed as given: receives are counted per channel and the
   k-th send on a channel waits for the k-th receive (the static pass checked that they carry the same
   message). A compute-only schedule is replayed as avgpipe_sched_lower would lower it, without
   building the lowered lists: its compute units (an op with the ops it overlaps; idle slots
   dropped) run in order, each unit's sends follow it, and the receives are posted in the slot
   between two units that the lowering gives them: a unit's forwards' gradients right after it, the
   activations of the next unit holding a forward right after the previous unit holding one (or at
   the start), a gradient whose forward shares its backward's unit before that unit. The lowering
   keeps each channel's order by moving receives earlier (slot_k = min(desired_k, slot_k+1)), so
   message k's receive is posted once the receive of any message >= k on its channel would be: the
   replay keeps, per channel, one past the highest message index whose receive's own slot has been
   reached (the indices come from the static pass, seqf and seqb). */
typedef struct avgpipe__vrank {
    int pos;            /* next op to run */
    int ustart, uend;   /* compute-only: the unit being run; uend -1 between units */
    int send, send_end; /* compute-only: ops of the finished unit whose sends are pending */
    int look;           /* compute-only: where the next unit holding a forward is searched from */
    int done;
} avgpipe__vrank;

typedef struct avgpipe__vreplay {
    avgpipe__vstate *v;
    int blocking;
    avgpipe__vrank *rk;  /* [S] */
    int *posted, *sent;  /* [nchan]: receives posted (compute-only: one past the highest message index), sends done */
    int *waiting, *stack, nstack;
} avgpipe__vreplay;

static void avgpipe__vwake(avgpipe__vreplay *P, int r) {
    if (P->waiting[r]) {
        P->waiting[r] = 0;
        P->stack[P->nstack++] = r;
    }
}

/* The receive of message k on channel c is posted, and with it those of the messages before it. */
static void avgpipe__vpost(avgpipe__vreplay *P, int c, int k) {
    if (P->posted[c] > k) return;
    P->posted[c] = k + 1;
    avgpipe__vwake(P, P->v->pl.src[c]);
}

/* End of the unit that starts at op i (not an idle slot). */
static int avgpipe__unit_end(const avgpipe_op *o, int n, int i) {
    while (i < n && (o[i].flags & AVGPIPE_OPF_OVERLAP_NEXT)) i++;
    return i < n ? i + 1 : n;
}

/* Post the activations' receives of rank r's next unit holding a forward (from rk.look on). */
static void avgpipe__post_acts(avgpipe__vreplay *P, int r) {
    const avgpipe__vstate *v = P->v;
    const avgpipe_op *o = v->s->ops[r];
    int n = v->s->len[r], i = P->rk[r].look, e, j, hasf = 0;
    while (!hasf) {
        while (i < n && o[i].kind == AVGPIPE_OP_IDLE) i++;
        if (i >= n) break;
        e = avgpipe__unit_end(o, n, i);
        for (j = i; j < e; j++)
            if (o[j].kind == AVGPIPE_OP_F) {
                int g = o[j].stage;
                hasf = 1;
                if (g > 0 && v->pl.up[g - 1] >= 0) avgpipe__vpost(P, v->pl.up[g - 1], v->seqf[avgpipe__vix(v, o[j].pipe, g, o[j].micro)]);
            }
        i = e;
    }
    P->rk[r].look = i;
}

/* The message op sends, if any: its channel, the cell it feeds and the bit that marks its arrival. */
static int avgpipe__vmsg(const avgpipe__vstate *v, const avgpipe_op *op, int *c, size_t *cell, int *bit) {
    int k = op->kind, g = op->stage;
    if ((k == AVGPIPE_OP_F || k == AVGPIPE_OP_SEND_F) && v->pl.up[g] >= 0) {
        *c = v->pl.up[g];
        *cell = avgpipe__vix(v, op->pipe, g + 1, op->micro);
        *bit = AVGPIPE__VA;
        return 1;
    }
    if ((avgpipe__is_backward(k) || k == AVGPIPE_OP_SEND_B) && v->pl.down[g] >= 0) {
        *c = v->pl.down[g];
        *cell = avgpipe__vix(v, op->pipe, g - 1, op->micro);
        *bit = AVGPIPE__VG;
        return 1;
    }
    return 0;
}

/* Whether op (a forward or backward) still waits for its input from another rank. */
static int avgpipe__vneeds(const avgpipe__vstate *v, const avgpipe_op *op) {
    int k = op->kind, g = op->stage;
    if (k == AVGPIPE_OP_F) return g > 0 && v->pl.up[g - 1] >= 0 && !(v->st[avgpipe__vix(v, op->pipe, g, op->micro)] & AVGPIPE__VA);
    if (avgpipe__is_backward(k)) return v->pl.up[g] >= 0 && !(v->st[avgpipe__vix(v, op->pipe, g, op->micro)] & AVGPIPE__VG);
    return 0;
}

/* Send the message of op (a producer, or a SEND op) unless a blocking send finds no receive posted
   (then 0). k is the message's index on its channel. */
static int avgpipe__vsend(avgpipe__vreplay *P, const avgpipe_op *op, int explicit_comm) {
    avgpipe__vstate *v = P->v;
    int c, bit, k;
    size_t cell;
    if (!avgpipe__vmsg(v, op, &c, &cell, &bit)) return 1;
    k = explicit_comm ? P->sent[c] : bit == AVGPIPE__VA ? v->seqf[cell] : v->seqb[cell];
    if (P->blocking && P->posted[c] <= k) return 0;
    P->sent[c]++;
    v->st[cell] |= (uint8_t)bit;
    avgpipe__vwake(P, v->pl.dst[c]);
    return 1;
}

/* Whether the sync op at rank r's position i may run: a TIE once its twin has been reached, an AGREE once
   every rank has reached its group. Marks this rank's arrival and wakes those waiting for it. */
static int avgpipe__vsync_pass(avgpipe__vreplay *P, int r, int i) {
    avgpipe__vstate *v = P->v;
    const avgpipe_op *op = &v->s->ops[r][i];
    int t = op->micro, p = op->pipe;
    if (P->blocking) return 1; /* checked by the asynchronous replay (see avgpipe__replay) */
    if (op->kind == AVGPIPE_OP_TIE) {
        int q = avgpipe__vpair(v, op->stage, op->peer);
        uint8_t mine = (uint8_t)(op->stage < op->peer ? 4 : 8), other = (uint8_t)(12 - mine),
                *x = &v->tie[((size_t)p * v->R + (size_t)t) * (size_t)v->npairs + (size_t)q];
        if (!(*x & mine)) {
            *x |= mine;
            avgpipe__vwake(P, v->pl.rank[op->peer]);
        }
        return (*x & other) != 0 || v->pl.rank[op->peer] == r; /* on one rank: the static pass checked both sides' work */
    }
    if (op->kind == AVGPIPE_OP_AGREE) {
        int key = p * v->R + t + 1, *n = &v->agree_arrived[(size_t)p * v->R + (size_t)t], q;
        if (v->agree_at[r] != key) {
            v->agree_at[r] = key;
            if (++*n == v->agree_ranks)
                for (q = 0; q < v->S; q++) avgpipe__vwake(P, q);
        }
        return *n == v->agree_ranks;
    }
    return 1;
}

/* Run rank r of a lowered schedule as far as it goes. */
static void avgpipe__vrun_comm(avgpipe__vreplay *P, int r) {
    avgpipe__vstate *v = P->v;
    avgpipe__vrank *x = &P->rk[r];
    const avgpipe_op *o = v->s->ops[r];
    int n = v->s->len[r];
    for (; x->pos < n; x->pos++) {
        const avgpipe_op *op = &o[x->pos];
        if (op->kind == AVGPIPE_OP_RECV_F || op->kind == AVGPIPE_OP_RECV_B) {
            int c = op->kind == AVGPIPE_OP_RECV_F ? v->pl.up[op->stage - 1] : v->pl.down[op->stage + 1];
            P->posted[c]++;
            avgpipe__vwake(P, v->pl.src[c]);
        } else if (op->kind == AVGPIPE_OP_SEND_F || op->kind == AVGPIPE_OP_SEND_B) {
            if (!avgpipe__vsend(P, op, 1)) break;
        } else if (avgpipe__vneeds(v, op) || !avgpipe__vsync_pass(P, r, x->pos)) {
            break;
        }
    }
    if (x->pos < n) P->waiting[r] = 1;
    else x->done = 1;
}

/* Before unit [a, e) runs: the gradients whose forward is in the same unit (their receive goes in
   the slot before the unit, where the backward's own bound puts it). */
static void avgpipe__post_unit_grads(avgpipe__vreplay *P, const avgpipe_op *o, int a, int e) {
    const avgpipe__vstate *v = P->v;
    int i, j;
    for (j = a + 1; j < e; j++) {
        int g = o[j].stage;
        if (!avgpipe__is_backward(o[j].kind) || v->pl.up[g] < 0) continue;
        for (i = a; i < j; i++)
            if (o[i].kind == AVGPIPE_OP_F && o[i].stage == g && o[i].pipe == o[j].pipe && o[i].micro == o[j].micro)
                avgpipe__vpost(P, v->pl.down[g + 1], v->seqb[avgpipe__vix(v, o[j].pipe, g, o[j].micro)]);
    }
}

/* Run rank r of a compute-only schedule as far as it goes, as its lowered list would run. */
static void avgpipe__vrun_compute(avgpipe__vreplay *P, int r) {
    avgpipe__vstate *v = P->v;
    avgpipe__vrank *x = &P->rk[r];
    const avgpipe_op *o = v->s->ops[r];
    int n = v->s->len[r];
    for (;;) {
        int i, hasf = 0;
        for (; x->send < x->send_end; x->send++)
            if (!avgpipe__vsend(P, &o[x->send], 0)) {
                P->waiting[r] = 1;
                return;
            }
        if (x->uend < 0) {
            while (x->pos < n && o[x->pos].kind == AVGPIPE_OP_IDLE) x->pos++;
            if (x->pos >= n) {
                x->done = 1;
                return;
            }
            x->ustart = x->pos;
            x->uend = avgpipe__unit_end(o, n, x->pos);
            if (x->uend - x->ustart > 1) avgpipe__post_unit_grads(P, o, x->ustart, x->uend);
        }
        for (; x->pos < x->uend; x->pos++)
            if (avgpipe__vneeds(v, &o[x->pos]) || !avgpipe__vsync_pass(P, r, x->pos)) {
                P->waiting[r] = 1;
                return;
            }
        /* the slot after the unit: its forwards' gradients, and the next forwards' activations */
        for (i = x->ustart; i < x->uend; i++) {
            int g = o[i].stage;
            if (o[i].kind != AVGPIPE_OP_F) continue;
            hasf = 1;
            if (v->pl.up[g] >= 0) avgpipe__vpost(P, v->pl.down[g + 1], v->seqb[avgpipe__vix(v, o[i].pipe, g, o[i].micro)]);
        }
        if (hasf) avgpipe__post_acts(P, r);
        x->send = x->ustart;
        x->send_end = x->uend;
        x->uend = -1;
    }
}

/* "deadlock (blocking sends): rank 0 waits at position 3 (0F1, to send to rank 1); ..." for the first
   eight stuck ranks; *rank, *pos get the first. Positions are in the schedule's own lists. */
static void avgpipe__vdeadlock(const avgpipe__vreplay *P, char *msg, size_t cap, int *rank, int *pos) {
    const avgpipe__vstate *v = P->v;
    size_t n = (size_t)snprintf(msg, cap, "deadlock (%s sends):", P->blocking ? "blocking" : "async");
    int r, shown = 0;
    *rank = *pos = -1;
    for (r = 0; r < v->S && n < cap; r++) {
        const avgpipe__vrank *x = &P->rk[r];
        const avgpipe_op *op;
        int at, c, bit, sending = 0;
        size_t cell;
        char txt[64], why[48];
        if (x->done) continue;
        sending = v->s->has_comm ? avgpipe__is_comm(v->s->ops[r][x->pos].kind) : x->send < x->send_end;
        at = !v->s->has_comm && sending ? x->send : x->pos;
        if (shown++ == 8) {
            n += (size_t)snprintf(msg + n, cap - n, " ...");
            break;
        }
        if (*rank < 0) {
            *rank = r;
            *pos = at;
        }
        op = &v->s->ops[r][at];
        avgpipe_op_format(op, 0, txt, sizeof txt);
        if (sending && avgpipe__vmsg(v, op, &c, &cell, &bit)) snprintf(why, sizeof why, ", to send to rank %d", v->pl.dst[c]);
        else if (op->kind == AVGPIPE_OP_TIE) snprintf(why, sizeof why, ", for rank %d's TIE", v->pl.rank[op->peer]);
        else if (op->kind == AVGPIPE_OP_AGREE) snprintf(why, sizeof why, ", for every rank's AGREE");
        else if (op->kind == AVGPIPE_OP_F) snprintf(why, sizeof why, ", for rank %d's activation", v->pl.rank[op->stage - 1]);
        else snprintf(why, sizeof why, ", for rank %d's gradient", v->pl.rank[op->stage + 1]);
        n += (size_t)snprintf(msg + n, cap - n, " rank %d waits at position %d (%s%s);", r, at, txt, why);
    }
}

/* One replay (blocking or asynchronous sends). Returns AVGPIPE_OK, AVGPIPE_DEADLOCK with the message
   in msg and the first stuck op in *rank, *pos, or AVGPIPE_OUT_OF_MEMORY. */
static avgpipe_result avgpipe__vreplay_run(avgpipe__vstate *v, int blocking, char *msg, size_t cap, int *rank, int *pos) {
    avgpipe__vreplay P;
    avgpipe_context *ctx = v->ctx;
    avgpipe_result res = AVGPIPE_OK;
    size_t cells = (size_t)v->N * v->G * v->M * v->R, i;
    int r, nc = v->pl.nchan;
    memset(&P, 0, sizeof P);
    P.v = v;
    P.blocking = blocking;
    P.rk = (avgpipe__vrank *)avgpipe__calloc(ctx, (size_t)v->S, sizeof *P.rk);
    P.posted = (int *)avgpipe__calloc(ctx, 2 * (size_t)nc + 1, sizeof(int));
    P.waiting = (int *)avgpipe__calloc(ctx, 2 * (size_t)v->S, sizeof(int));
    if (!P.rk || !P.posted || !P.waiting) {
        res = AVGPIPE_OUT_OF_MEMORY;
        goto done;
    }
    P.sent = P.posted + nc;
    P.stack = P.waiting + v->S;
    for (i = 0; i < cells; i++) v->st[i] &= (uint8_t)~(AVGPIPE__VA | AVGPIPE__VG);
    if (v->nsync) {
        for (i = 0; i < (size_t)v->N * v->R * (size_t)v->npairs; i++) v->tie[i] &= 3;
        memset(v->agree_at, 0, ((size_t)v->S + (size_t)v->N * v->R) * sizeof(int));
    }
    for (r = 0; r < v->S; r++) {
        P.rk[r].uend = -1;
        if (!v->s->has_comm) avgpipe__post_acts(&P, r); /* the receives of the first unit holding a forward */
    }
    for (r = v->S - 1; r >= 0; r--) P.stack[P.nstack++] = r;
    while (P.nstack > 0) {
        r = P.stack[--P.nstack];
        if (v->s->has_comm) avgpipe__vrun_comm(&P, r);
        else avgpipe__vrun_compute(&P, r);
    }
    for (r = 0; r < v->S; r++)
        if (!P.rk[r].done) {
            avgpipe__vdeadlock(&P, msg, cap, rank, pos);
            res = AVGPIPE_DEADLOCK;
            break;
        }
done:
    avgpipe_free(ctx, P.rk);
    avgpipe_free(ctx, P.posted);
    avgpipe_free(ctx, P.waiting);
    return res;
}

/* The replay of a compute-only schedule, compiled: each rank's list becomes, a few units at a time,
   the sequence of what vrun_compute does with other ranks, in its order (NEED: wait for message k
   of channel c to arrive; POST: the receive of message k of c is posted; SEND: the next message of
   c), and the replay runs these sequences with two counters per channel. A channel's messages are
   sent in the order of their index (its one sender sends them in list order, the order the static
   pass numbered them in), so message k has arrived once more than k have been sent: no per-cell
   state in the lockstep. A waiting rank is woken only by the event it waits for. Gives vreplay_run's
   verdict (its conditions in its order); on a deadlock the caller runs vreplay_run for the message. */
enum { AVGPIPE__XNEED = 0, AVGPIPE__XPOST = 1, AVGPIPE__XSEND = 2 };

typedef struct avgpipe__xent {
    int32_t ck; /* channel << 2 | AVGPIPE__X* */
    int32_t k;  /* message index (NEED, POST) */
} avgpipe__xent;

typedef struct avgpipe__xrank {
    avgpipe__xent *e;   /* the compiled entries not yet run: e[at .. n) */
    int at, n, cap;
    int pos, look;      /* compile: the next unit, where post_acts searches from */
    int started;        /* compile: the first post_acts done */
    int wait_ck, wait_k; /* the entry it waits at (when waiting) */
} avgpipe__xrank;

/* Room for `more` entries after x->n. Returns 0 when out of memory. */
static int avgpipe__xgrow(avgpipe_context *ctx, avgpipe__xrank *x, int more) {
    int cap = x->cap ? x->cap : 256;
    avgpipe__xent *p;
    while (cap < x->n + more) cap *= 2;
    if (cap == x->cap) return 1;
    p = (avgpipe__xent *)avgpipe__realloc(ctx, x->e, (size_t)x->cap * sizeof *p, (size_t)cap * sizeof *p);
    if (!p) return 0;
    x->e = p;
    x->cap = cap;
    return 1;
}

static int avgpipe__xput(avgpipe_context *ctx, avgpipe__xrank *x, int ck, int k) {
    if (x->n == x->cap && !avgpipe__xgrow(ctx, x, 1)) return 0;
    x->e[x->n].ck = ck;
    x->e[x->n].k = k;
    x->n++;
    return 1;
}

/* An entry where avgpipe__xgrow has made room. */
AVGPIPE__FORCE_INLINE void avgpipe__xpush(avgpipe__xrank *x, int ck, int k) {
    x->e[x->n].ck = ck;
    x->e[x->n].k = k;
    x->n++;
}

/* The POSTs of post_acts: the activations of the next unit holding a forward, from x->look on. */
AVGPIPE__FORCE_INLINE int avgpipe__xacts(const avgpipe__vstate *v, const avgpipe_op *o, int n, avgpipe__xrank *x) {
    int i = x->look, hasf = 0, j, end, ok = 1;
    while (!hasf) {
        while (i < n && o[i].kind == AVGPIPE_OP_IDLE) i++;
        if (i >= n) break;
        end = avgpipe__unit_end(o, n, i);
        for (j = i; j < end; j++)
            if (o[j].kind == AVGPIPE_OP_F) {
                int g = o[j].stage;
                hasf = 1;
                if (g > 0 && v->pl.up[g - 1] >= 0)
                    ok &= avgpipe__xput(v->ctx, x, v->pl.up[g - 1] << 2 | AVGPIPE__XPOST, v->seqf[avgpipe__vix(v, o[j].pipe, g, o[j].micro)]);
            }
        i = end;
    }
    x->look = i;
    return ok;
}

/* Refill rank r's entries (all run) with those of its next units. Returns 0 when out of memory. */
static int avgpipe__xfill(const avgpipe__vstate *v, int r, avgpipe__xrank *x) {
    const avgpipe_op *o = v->s->ops[r];
    const int *up = v->pl.up, *down = v->pl.down;
    int n = v->s->len[r], pos = x->pos, a, b, i, j, ok = 1;
    avgpipe_context *ctx = v->ctx;
    x->at = x->n = 0;
    if (!x->started) {
        x->started = 1;
        ok &= avgpipe__xacts(v, o, n, x);
    }
    while (ok && x->n < 128) {
        int hasf = 0;
        while (pos < n && o[pos].kind == AVGPIPE_OP_IDLE) pos++;
        if (pos >= n) break;
        a = pos;
        /* The ranks take turns a few ops at a time, too short a stream for the hardware to prefetch:
           the ops two cache lines ahead, and the message numbers of the op 8 ahead (ZB-V at S=64,
           M=1024, N=8: 93-95 ms to validate without, 80-82 with) */
        if (pos + 32 < n) AVGPIPE__PREFETCH(&o[pos + 32]);
        if (pos + 8 < n) {
            const avgpipe_op *f = &o[pos + 8];
            if ((unsigned)f->stage < (unsigned)v->G && (unsigned)f->pipe < (unsigned)v->N && (unsigned)f->micro < (unsigned)(v->M * v->R)) {
                size_t fx = avgpipe__vix(v, f->pipe, f->stage, f->micro);
                AVGPIPE__PREFETCH(&v->seqf[fx]);
                AVGPIPE__PREFETCH(&v->seqb[fx]);
            }
        }
        if (!(o[a].flags & AVGPIPE_OPF_OVERLAP_NEXT)) { /* a unit of one op (most units): the steps below, unrolled */
            const avgpipe_op *op = &o[a];
            int k = op->kind, g = op->stage;
            pos = a + 1;
            if (k != AVGPIPE_OP_F && !avgpipe__is_backward(k)) continue;
            if (x->n + 3 > x->cap && !avgpipe__xgrow(ctx, x, 3)) {
                ok = 0;
                break;
            }
            if (k == AVGPIPE_OP_F) {
                size_t ix = avgpipe__vix(v, op->pipe, g, op->micro);
                if (g > 0 && up[g - 1] >= 0) avgpipe__xpush(x, up[g - 1] << 2 | AVGPIPE__XNEED, v->seqf[ix]);
                if (up[g] >= 0) avgpipe__xpush(x, down[g + 1] << 2 | AVGPIPE__XPOST, v->seqb[ix]);
                ok &= avgpipe__xacts(v, o, n, x);
                if (up[g] >= 0) ok &= avgpipe__xput(ctx, x, up[g] << 2 | AVGPIPE__XSEND, 0);
            } else {
                if (up[g] >= 0) avgpipe__xpush(x, down[g + 1] << 2 | AVGPIPE__XNEED, v->seqb[avgpipe__vix(v, op->pipe, g, op->micro)]);
                if (down[g] >= 0) avgpipe__xpush(x, down[g] << 2 | AVGPIPE__XSEND, 0);
            }
            continue;
        }
        b = avgpipe__unit_end(o, n, pos);
        if (b - a > 1) /* post_unit_grads */
            for (j = a + 1; j < b; j++) {
                int g = o[j].stage;
                if (!avgpipe__is_backward(o[j].kind) || up[g] < 0) continue;
                for (i = a; i < j; i++)
                    if (o[i].kind == AVGPIPE_OP_F && o[i].stage == g && o[i].pipe == o[j].pipe && o[i].micro == o[j].micro)
                        ok &= avgpipe__xput(ctx, x, down[g + 1] << 2 | AVGPIPE__XPOST, v->seqb[avgpipe__vix(v, o[j].pipe, g, o[j].micro)]);
            }
        for (i = a; i < b; i++) { /* vneeds */
            int k = o[i].kind, g = o[i].stage;
            if (k == AVGPIPE_OP_F) {
                if (g > 0 && up[g - 1] >= 0)
                    ok &= avgpipe__xput(ctx, x, up[g - 1] << 2 | AVGPIPE__XNEED, v->seqf[avgpipe__vix(v, o[i].pipe, g, o[i].micro)]);
            } else if (avgpipe__is_backward(k) && up[g] >= 0) {
                ok &= avgpipe__xput(ctx, x, down[g + 1] << 2 | AVGPIPE__XNEED, v->seqb[avgpipe__vix(v, o[i].pipe, g, o[i].micro)]);
            }
        }
        for (i = a; i < b; i++) { /* the slot after the unit: its forwards' gradients */
            int g = o[i].stage;
            if (o[i].kind != AVGPIPE_OP_F) continue;
            hasf = 1;
            if (up[g] >= 0) ok &= avgpipe__xput(ctx, x, down[g + 1] << 2 | AVGPIPE__XPOST, v->seqb[avgpipe__vix(v, o[i].pipe, g, o[i].micro)]);
        }
        if (hasf) ok &= avgpipe__xacts(v, o, n, x); /* and the next forwards' activations */
        for (i = a; i < b; i++) { /* the unit's sends */
            int k = o[i].kind, g = o[i].stage;
            if (k == AVGPIPE_OP_F && up[g] >= 0) ok &= avgpipe__xput(ctx, x, up[g] << 2 | AVGPIPE__XSEND, 0);
            else if (avgpipe__is_backward(k) && down[g] >= 0) ok &= avgpipe__xput(ctx, x, down[g] << 2 | AVGPIPE__XSEND, 0);
        }
        pos = b;
    }
    x->pos = pos;
    return ok;
}

/* The blocking replay of a compute-only schedule on the compiled sequences: AVGPIPE_OK, AVGPIPE_DEADLOCK
   (no message: see vreplay_run) or AVGPIPE_OUT_OF_MEMORY. */
static avgpipe_result avgpipe__xreplay(avgpipe__vstate *v) {
    avgpipe_context *ctx = v->ctx;
    int S = v->S, nc = v->pl.nchan, r, top = 0;
    const int *src = v->pl.src, *dst = v->pl.dst;
    avgpipe__xrank *X = (avgpipe__xrank *)avgpipe__calloc(ctx, (size_t)S, sizeof *X);
    int *posted = (int *)avgpipe__calloc(ctx, 2 * (size_t)nc + 2 * (size_t)S + 1, sizeof(int)), *sent, *waiting, *stack;
    avgpipe_result res = AVGPIPE_OK;
    if (!X || !posted) {
        res = AVGPIPE_OUT_OF_MEMORY;
        goto done;
    }
    sent = posted + nc;
    waiting = sent + nc;
    stack = waiting + S;
    for (r = S - 1; r >= 0; r--) stack[top++] = r;
    while (top > 0) {
        avgpipe__xrank *x;
        r = stack[--top];
        x = &X[r];
        for (;;) {
            int at = x->at, stop = x->n;
            for (; at < stop; at++) {
                const avgpipe__xent *e = &x->e[at];
                int c = e->ck >> 2, w;
                switch (e->ck & 3) {
                case AVGPIPE__XNEED:
                    if (sent[c] > e->k) continue;
                    break;
                case AVGPIPE__XPOST:
                    if (posted[c] <= e->k) {
                        posted[c] = e->k + 1;
                        w = src[c];
                        if (waiting[w] && X[w].wait_ck == (c << 2 | AVGPIPE__XSEND) && posted[c] > sent[c]) {
                            waiting[w] = 0;
                            stack[top++] = w;
                        }
                    }
                    continue;
                default:
                    if (posted[c] <= sent[c]) break;
                    sent[c]++;
                    w = dst[c];
                    if (waiting[w] && X[w].wait_ck == (c << 2 | AVGPIPE__XNEED) && sent[c] > X[w].wait_k) {
                        waiting[w] = 0;
                        stack[top++] = w;
                    }
                    continue;
                }
                break; /* waits */
            }
            x->at = at;
            if (at < stop) {
                waiting[r] = 1;
                x->wait_ck = x->e[at].ck;
                x->wait_k = x->e[at].k;
                break;
            }
            if (x->pos >= v->s->len[r] && x->started) break; /* done */
            if (!avgpipe__xfill(v, r, x)) {
                res = AVGPIPE_OUT_OF_MEMORY;
                goto done;
            }
        }
    }
    for (r = 0; r < S; r++)
        if (X[r].at < X[r].n || X[r].pos < v->s->len[r]) res = AVGPIPE_DEADLOCK;
done:
    if (X)
        for (r = 0; r < S; r++) avgpipe_free(ctx, X[r].e);
    avgpipe_free(ctx, X);
    avgpipe_free(ctx, posted);
    return res;
}

static avgpipe_result avgpipe__replay(avgpipe__vstate *v) {
    const char *how = v->s->has_comm ? "" : " (sends and receives where avgpipe_sched_lower puts them)";
    char detail[360], bdetail[360];
    int rank, pos, brank, bpos;
    avgpipe_result res;
    if (v->fsdp) { /* the static pass takes them as no-ops; the simulator wants them on their stage's rank */
        int N;
        long long U;
        res = avgpipe__sched_scan(v->ctx, v->s, v->pl.rank, &N, &U);
        if (res) return avgpipe__vfail(v, res, -1, -1, "%s", avgpipe_last_error(v->ctx));
    }
    if ((long long)v->N * v->G * v->M * v->R > AVGPIPE__MAX_CELLS) /* the simulator's tables (its scan refuses more) */
        return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, -1, -1,
                              "schedule too large to simulate (%d pipelines x %d stages x %lld micro-batches)", v->N, v->G,
                              (long long)v->M * v->R);
    if (!v->s->has_comm && v->seqf && !v->nsync) { /* the compiled replay decides; a deadlock is explained below */
        res = avgpipe__xreplay(v);
        if (res == AVGPIPE_OUT_OF_MEMORY) return avgpipe__vfail(v, AVGPIPE_OUT_OF_MEMORY, -1, -1, "validator: out of memory");
        if (res == AVGPIPE_OK) return res;
    }
    res = avgpipe__vreplay_run(v, 1, bdetail, sizeof bdetail, &brank, &bpos);
    /* TIE and AGREE ops are matched on a communicator of their own and wait in the worker only after
       it has issued every send before them (a device's transfers go on by themselves), so they are
       rendezvous of the asynchronous replay; the blocking one checks the data messages without them. */
    if (res == AVGPIPE_OK && v->nsync) {
        res = avgpipe__vreplay_run(v, 0, detail, sizeof detail, &rank, &pos);
        if (res == AVGPIPE_DEADLOCK) return avgpipe__vfail(v, AVGPIPE_DEADLOCK, rank, pos, "%s%s", detail, how);
    }
    if (res == AVGPIPE_DEADLOCK) { /* which semantics does it need? */
        res = avgpipe__vreplay_run(v, 0, detail, sizeof detail, &rank, &pos);
        if (res == AVGPIPE_OK) return avgpipe__vfail(v, AVGPIPE_DEADLOCK, brank, bpos, "%s%s", bdetail, how);
        if (res == AVGPIPE_DEADLOCK) return avgpipe__vfail(v, AVGPIPE_DEADLOCK, rank, pos, "%s%s", detail, how);
    }
    if (res == AVGPIPE_OUT_OF_MEMORY) return avgpipe__vfail(v, AVGPIPE_OUT_OF_MEMORY, -1, -1, "validator: out of memory");
    return res;
}

/* The prescan (its peaks into peak, whether there are sync ops into v->any_sync), and its size check:
   AVGPIPE_INVALID_SCHEDULE (reported) when the shape's cells are too many for the ops that are not idle. */
static avgpipe_result avgpipe__vmissing(avgpipe__vstate *v, int *peak) {
    long long nops = avgpipe__vprescan(v->s, peak, 256, &v->any_sync);
    double cells = (double)v->N * v->G * v->M * v->R;
    if (avgpipe__cells_ok(cells, nops)) return AVGPIPE_OK;
    return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, -1, -1,
                          "the shape's %d pipelines x %d stages x %d micro-batches x %d rounds need %.4g forwards, the schedule has %lld "
                          "ops (missing forwards)",
                          v->N, v->G, v->M, v->R, cells, nops);
}

/* Every stage on a rank. */
static avgpipe_result avgpipe__vplaced(avgpipe__vstate *v) {
    int g;
    for (g = 0; g < v->G; g++)
        if (v->pl.rank[g] < 0)
            return avgpipe__vfail(v, AVGPIPE_INVALID_SCHEDULE, -1, -1, "stage %d is not placed on any rank (custom placement of %d stages)", g,
                                  v->s->nplace);
    return AVGPIPE_OK;
}

/* Forget what a static pass saw (before it runs again). */
static void avgpipe__vreset(avgpipe__vstate *v, size_t cells) {
    int c;
    memset(v->st, 0, cells);
    memset(v->step, 0, (size_t)v->N * v->G * v->R);
    if (v->nseq) memset(v->nseq, 0, (size_t)v->pl.nchan * sizeof(int));
    for (c = 0; c < v->pl.nchan; c++) v->sendq[c].n = v->recvq[c].n = 0;
    v->any_step = v->fsdp = v->sync_met = 0;
}

static avgpipe_result avgpipe__validate_core(avgpipe_context *ctx, const avgpipe_schedule *s, const avgpipe_validate_desc *desc,
                                             avgpipe_validate_report *report, int guess);

AVGPIPE_API avgpipe_result avgpipe_sched_validate(avgpipe_context *ctx, const avgpipe_schedule *s,
                                                  const avgpipe_validate_desc *desc, avgpipe_validate_report *report) {
    return avgpipe__validate_core(ctx, s, desc, report, 1);
}

/* guess 1: the static pass runs first on the guess that the schedule is valid and has no TIE or AGREE
   ops (it then counts the peaks itself, and the prescan's size check holds: every cell has its
   forward); anything else, and guess 0, runs every check in its order: the prescan's size check,
   the tables, vsync_prepare, the static pass. The same verdict either way (test_validate_ref). */
static avgpipe_result avgpipe__validate_core(avgpipe_context *ctx, const avgpipe_schedule *s, const avgpipe_validate_desc *desc,
                                             avgpipe_validate_report *report, int guess) {
    avgpipe_validate_report local;
    avgpipe__vstate v;
    avgpipe_result res = AVGPIPE_OK;
    size_t cells;
    long long nops;
    int c, oom = 0, allocated, peaks[256] = {0};
    if (!report) report = &local;
    memset(report, 0, sizeof *report);
    report->rank = report->pos = -1;
    if (!s || !s->len || s->nranks < 1) {
        report->result = AVGPIPE_INVALID_ARG;
        snprintf(report->message, sizeof report->message, "avgpipe_sched_validate: empty schedule");
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s", report->message);
    }
    memset(&v, 0, sizeof v);
    v.ctx = ctx;
    v.s = s;
    v.rep = report;
    v.S = s->nranks;
    v.G = s->nstages;
    v.N = s->shape.pipes > 0 ? s->shape.pipes : 1;
    v.M = s->shape.micro > 0 ? s->shape.micro : 1;
    v.R = s->shape.rounds > 0 ? s->shape.rounds : 1;
    cells = (size_t)v.N * v.G * v.M * v.R;
    if ((double)v.N * v.G * v.M * v.R > 4e8)
        return avgpipe__vfail(&v, AVGPIPE_INVALID_ARG, -1, -1, "avgpipe_sched_validate: schedule too large");
    for (c = 0, nops = 0; c < v.S; c++) nops += s->len[c];
    if (!avgpipe__cells_ok((double)cells, nops)) /* too few ops even with the idle ones: the exact count for the message */
        return avgpipe__vmissing(&v, peaks);
    v.st = (uint8_t *)avgpipe__calloc(ctx, cells, 1);
    v.step = (uint8_t *)avgpipe__calloc(ctx, (size_t)v.N * v.G * v.R, 1);
    if (v.st && v.step && avgpipe__place_build(ctx, s, &v.pl) == AVGPIPE_OK) {
        v.sendq = (avgpipe__msgs *)avgpipe__calloc(ctx, (size_t)v.pl.nchan + 1, sizeof(avgpipe__msgs));
        v.recvq = (avgpipe__msgs *)avgpipe__calloc(ctx, (size_t)v.pl.nchan + 1, sizeof(avgpipe__msgs));
        if (!s->has_comm && v.pl.nchan > 0 && !(desc && desc->skip_replay)) { /* message order per channel, for the replay */
            v.seqf = (int32_t *)avgpipe_alloc(ctx, cells * sizeof(int32_t));
            v.seqb = (int32_t *)avgpipe_alloc(ctx, cells * sizeof(int32_t));
            v.nseq = (int *)avgpipe__calloc(ctx, (size_t)v.pl.nchan, sizeof(int));
            oom = !v.seqf || !v.seqb || !v.nseq;
        }
    }
    allocated = !oom && v.st && v.step && v.sendq && v.recvq;
    if (!allocated) res = avgpipe__vfail(&v, AVGPIPE_OUT_OF_MEMORY, -1, -1, "validator: out of memory");
    if (!res) res = avgpipe__vplaced(&v);
    if (!res) res = guess ? avgpipe__check_static(&v, peaks) : AVGPIPE_INVALID_SCHEDULE;
    if (res) { /* a fault, or a sync op: every check in its order from the start (the prescan's first) */
        memset(report, 0, sizeof *report);
        report->rank = report->pos = -1;
        if (avgpipe__vmissing(&v, peaks)) res = AVGPIPE_INVALID_SCHEDULE;
        else if (!allocated) res = avgpipe__vfail(&v, AVGPIPE_OUT_OF_MEMORY, -1, -1, "validator: out of memory");
        else if ((res = avgpipe__vplaced(&v)) == AVGPIPE_OK) {
            avgpipe__vreset(&v, cells);
            v.sync_known = 1;
            if (v.any_sync) res = avgpipe__vsync_prepare(&v);
            if (!res) res = avgpipe__check_static(&v, NULL); /* the prescan has counted the peaks */
        }
    }
    memcpy(report->peak_stash, peaks, sizeof peaks);
    if (!res && !(desc && desc->skip_memory)) res = avgpipe__check_memory(&v);
    if (!res && !(desc && desc->skip_replay)) res = avgpipe__replay(&v);
    if (v.sendq)
        for (c = 0; c < v.pl.nchan; c++) avgpipe_free(ctx, v.sendq[c].v);
    if (v.recvq)
        for (c = 0; c < v.pl.nchan; c++) avgpipe_free(ctx, v.recvq[c].v);
    avgpipe_free(ctx, v.sendq);
    avgpipe_free(ctx, v.recvq);
    avgpipe__place_free(ctx, &v.pl);
    avgpipe_free(ctx, v.st);
    avgpipe_free(ctx, v.step);
    avgpipe_free(ctx, v.seqf);
    avgpipe_free(ctx, v.seqb);
    avgpipe_free(ctx, v.nseq);
    avgpipe_free(ctx, v.pairs);
    avgpipe_free(ctx, v.npart);
    avgpipe_free(ctx, v.nties);
    avgpipe_free(ctx, v.tie);
    report->result = res;
    return res;
}

AVGPIPE_API avgpipe_result avgpipe_sched_render_grid(avgpipe_context *ctx, const avgpipe_schedule *s, int mark_rank, int mark_pos,
                                                     avgpipe_buf *out) {
    int r, i, width = 4, maxlen = 0, ok = 1, lo = 0, hi;
    char txt[72];
    if (!s || !out || !s->len) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_sched_render_grid: NULL argument");
    for (r = 0; r < s->nranks; r++)
        if (s->len[r] > maxlen) maxlen = s->len[r];
    hi = maxlen;
    if (mark_rank >= 0 && maxlen > 2 * AVGPIPE_GRID_WINDOW + 1) { /* the window around the mark */
        lo = mark_pos - AVGPIPE_GRID_WINDOW < 0 ? 0 : mark_pos - AVGPIPE_GRID_WINDOW;
        if (lo > maxlen - (2 * AVGPIPE_GRID_WINDOW + 1)) lo = maxlen - (2 * AVGPIPE_GRID_WINDOW + 1);
        hi = lo + 2 * AVGPIPE_GRID_WINDOW + 1;
    }
    for (r = 0; r < s->nranks; r++)
        for (i = lo; i < hi && i < s->len[r]; i++) {
            int n = avgpipe_op_format(&s->ops[r][i], 0, txt, sizeof txt) + 2;
            if (n > width) width = n;
        }
    out->len = 0;
    if (lo > 0 || hi < maxlen)
        ok &= avgpipe__buf_printf(ctx, out, "(positions %d..%d of %d around the marked op)\n", lo, hi - 1, maxlen);
    ok &= avgpipe__buf_printf(ctx, out, "%-8s", "pos");
    for (i = lo; i < hi; i++) ok &= avgpipe__buf_printf(ctx, out, "%-*d", width + 1, i);
    ok &= avgpipe__buf_put(ctx, out, "\n", 1);
    for (r = 0; r < s->nranks; r++) {
        ok &= avgpipe__buf_printf(ctx, out, "rank %-3d", r);
        for (i = lo; i < hi && i < s->len[r]; i++) {
            char cell[80];
            avgpipe_op_format(&s->ops[r][i], 0, txt, sizeof txt);
            if (s->ops[r][i].kind == AVGPIPE_OP_IDLE) snprintf(txt, sizeof txt, ".");
            if (r == mark_rank && i == mark_pos) snprintf(cell, sizeof cell, ">%s<", txt);
            else snprintf(cell, sizeof cell, " %s ", txt);
            ok &= avgpipe__buf_printf(ctx, out, "%-*s", width + 1, cell);
        }
        ok &= avgpipe__buf_put(ctx, out, "\n", 1);
    }
    if (!ok) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_sched_render_grid: out of memory");
    return AVGPIPE_OK;
}

/* --- 10. Rendering ---------------------------------------------------------------------------- */

AVGPIPE_API avgpipe_render_desc avgpipe_render_query_defaults(const avgpipe_render_desc *desc) {
    avgpipe_render_desc d;
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    if (d.width <= 0) d.width = 120; /* a negative width is taken as the default too */
    if (!(d.us_per_unit > 0)) d.us_per_unit = 1000;
    return d;
}

/* "F3", or "Fb3" (pipeline b = 1, micro-batch 3) when the events span several pipelines. */
/* The kind part of an op's label. */
static const char *avgpipe__label_kind(const avgpipe_op *op) {
    if (op->kind == AVGPIPE_OP_STEP) return "S";
    if (op->kind == AVGPIPE_OP_AVG) return "A";
    if (op->kind == AVGPIPE_OP_TIE) return "T";
    if (op->kind == AVGPIPE_OP_AGREE) return "G";
    if (op->kind == AVGPIPE_OP_SEND_F || op->kind == AVGPIPE_OP_RECV_F) return ">";
    if (op->kind == AVGPIPE_OP_SEND_B || op->kind == AVGPIPE_OP_RECV_B) return "<";
    return avgpipe_op_kind_name((avgpipe_op_kind)op->kind);
}

static void avgpipe__label(const avgpipe_op *op, int multi, char *out, size_t cap) {
    const char *k = avgpipe__label_kind(op);
    char pipe[16] = "";
    if (multi) {
        if (op->pipe < 26) snprintf(pipe, sizeof pipe, "%c", 'a' + op->pipe);
        else snprintf(pipe, sizeof pipe, "p%d.", op->pipe);
    }
    snprintf(out, cap, "%s%s%d", k, pipe, op->micro);
}

typedef struct avgpipe__span {
    double makespan;
    int multi; /* more than one pipeline */
    int has_comm;
} avgpipe__span;

static avgpipe_result avgpipe__render_check(avgpipe_context *ctx, const avgpipe_event *ev, size_t n, int nranks,
                                            avgpipe_buf *out, avgpipe__span *sp) {
    size_t i;
    if ((!ev && n) || !out || nranks < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "render: NULL argument or nranks < 1");
    memset(sp, 0, sizeof *sp);
    for (i = 0; i < n; i++) {
        if (ev[i].rank < 0 || ev[i].rank >= nranks || !(ev[i].end >= ev[i].start) || ev[i].start < 0)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "render: event %zu has rank %d or times [%g, %g] out of range", i,
                                 (int)ev[i].rank, ev[i].start, ev[i].end);
        if (ev[i].end > sp->makespan) sp->makespan = ev[i].end;
        if (ev[i].op.pipe > 0) sp->multi = 1;
        if (ev[i].track == 1 && ev[i].end > ev[i].start) sp->has_comm = 1;
    }
    out->len = 0;
    return AVGPIPE_OK;
}

/* Draw one lane: events of `rank` on `track` into row[0..width). A compute box shows its label
   (cut to the box); a transfer box is drawn with '>' (activation) or '<' (gradient). */
static void avgpipe__ascii_draw(const avgpipe_event *e, double scale, int multi, char *row, int width) {
    char lab[32];
    int a, b, j, L;
    if (e->end <= e->start) return;
    a = (int)floor(e->start * scale + 0.5);
    b = (int)floor(e->end * scale + 0.5);
    if (b <= a) b = a + 1;
    if (a >= width) return;
    if (b > width) b = width;
    if (e->track != 0) {
        int grad = e->op.kind == AVGPIPE_OP_B || e->op.kind == AVGPIPE_OP_I || e->op.kind == AVGPIPE_OP_SEND_B ||
                   e->op.kind == AVGPIPE_OP_RECV_B;
        memset(row + a, grad ? '<' : '>', (size_t)(b - a));
        return;
    }
    if (b - a == 1 && avgpipe__label_kind(&e->op)[0]) { /* one column: the label's first character */
        row[a] = avgpipe__label_kind(&e->op)[0];
        return;
    }
    avgpipe__label(&e->op, multi, lab, sizeof lab);
    L = (int)strlen(lab);
    for (j = a; j < b; j++) row[j] = j - a < L ? lab[j - a] : ' ';
}

static void avgpipe__ascii_lane(const avgpipe_event *ev, size_t n, int rank, int track, double scale, int multi, char *row,
                                int width) {
    size_t i;
    memset(row, track == 0 ? '.' : ' ', (size_t)width);
    for (i = 0; i < n; i++)
        if (ev[i].rank == rank && ev[i].track == track) avgpipe__ascii_draw(&ev[i], scale, multi, row, width);
}

/* A round tick step (1, 2 or 5 times a power of ten) of at least `min` time units. */
static double avgpipe__nice_step(double min) {
    double p = pow(10, floor(log10(min > 0 ? min : 1)));
    return min <= p ? p : min <= 2 * p ? 2 * p : min <= 5 * p ? 5 * p : 10 * p;
}

AVGPIPE_API avgpipe_result avgpipe_render_ascii(avgpipe_context *ctx, const avgpipe_event *ev, size_t n, int nranks,
                                                const avgpipe_render_desc *desc, avgpipe_buf *out) {
    avgpipe__span sp;
    avgpipe_result res = avgpipe__render_check(ctx, ev, n, nranks, out, &sp);
    int width = avgpipe_render_query_defaults(desc).width, r, ok = 1, lanes;
    double scale;
    char *row, *grid = NULL;
    if (res) return res;
    if (width > 100000) width = 100000;
    if (sp.makespan <= 0) return avgpipe__buf_printf(ctx, out, "(empty timeline)\n") ? AVGPIPE_OK : AVGPIPE_OUT_OF_MEMORY;
    scale = width / sp.makespan;
    if (scale >= 1) scale = floor(scale); /* whole characters per time unit when they fit */
    width = (int)ceil(sp.makespan * scale);
    row = (char *)avgpipe_alloc(ctx, (size_t)width + 1);
    if (!row) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "render: out of memory");
    if (desc && desc->title) ok &= avgpipe__buf_printf(ctx, out, "%s\n", desc->title);
    {
        double step = avgpipe__nice_step(10 / scale), t;
        memset(row, ' ', (size_t)width);
        row[width] = 0;
        for (t = 0; t < sp.makespan; t += step) {
            char tick[24];
            int c = (int)floor(t * scale + 0.5), L = snprintf(tick, sizeof tick, "|%g", t);
            if (c + L <= width) memcpy(row + c, tick, (size_t)L);
        }
        ok &= avgpipe__buf_printf(ctx, out, "time    %s\n", row);
    }
    /* every lane at once in one pass over the events when the grid is small (each lane sees its events
       in the same order either way), else one pass per lane */
    lanes = sp.has_comm ? 2 : 1;
    if ((double)nranks * lanes * (width + 1) <= 64e6) grid = (char *)avgpipe_alloc(ctx, (size_t)nranks * lanes * ((size_t)width + 1));
    if (grid) {
        size_t i, w1 = (size_t)width + 1;
        for (r = 0; r < nranks * lanes; r++) {
            memset(grid + r * w1, r % lanes == 0 ? '.' : ' ', (size_t)width);
            grid[r * w1 + width] = 0;
        }
        for (i = 0; i < n; i++) {
            const avgpipe_event *e = &ev[i];
            if (e->track >= lanes || e->track < 0) continue;
            avgpipe__ascii_draw(e, scale, sp.multi, grid + ((size_t)e->rank * lanes + e->track) * w1, width);
        }
    }
    for (r = 0; r < nranks && ok; r++) {
        const char *line = row;
        if (grid) line = grid + (size_t)r * lanes * ((size_t)width + 1);
        else avgpipe__ascii_lane(ev, n, r, 0, scale, sp.multi, row, width);
        row[width] = 0;
        ok &= avgpipe__buf_printf(ctx, out, "rank %-3d%s\n", r, line);
        if (sp.has_comm) {
            if (grid) line = grid + ((size_t)r * lanes + 1) * ((size_t)width + 1);
            else avgpipe__ascii_lane(ev, n, r, 1, scale, sp.multi, row, width);
            ok &= avgpipe__buf_printf(ctx, out, "  send  %s\n", line);
        }
    }
    avgpipe_free(ctx, grid);
    ok &= avgpipe__buf_printf(ctx, out, "(%.4g time units, %.3g per column; F/B/I/W + %smicro-batch, S step, A avg, '.' idle%s)\n",
                              sp.makespan, 1 / scale, sp.multi ? "pipeline letter + " : "",
                              sp.has_comm ? ", '>' activation and '<' gradient transfers" : "");
    avgpipe_free(ctx, row);
    return ok ? AVGPIPE_OK : avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "render: out of memory");
}

static const char *avgpipe__track_name(int track) { return track == 0 ? "compute" : track == 1 ? "send" : "recv"; }

AVGPIPE_API avgpipe_result avgpipe_render_chrome(avgpipe_context *ctx, const avgpipe_event *ev, size_t n, int nranks,
                                                 const avgpipe_render_desc *desc, avgpipe_buf *out) {
    avgpipe__span sp;
    avgpipe_result res = avgpipe__render_check(ctx, ev, n, nranks, out, &sp);
    double us = avgpipe_render_query_defaults(desc).us_per_unit;
    int r, t, ok = 1;
    size_t i;
    if (res) return res;
    ok &= avgpipe__buf_printf(ctx, out, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    for (r = 0; r < nranks; r++) {
        ok &= avgpipe__buf_printf(ctx, out, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}},\n", r, r);
        ok &= avgpipe__buf_printf(ctx, out, "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"sort_index\":%d}},\n", r, r);
        for (t = 0; t < 3; t++)
            ok &= avgpipe__buf_printf(ctx, out, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}},\n",
                                      r, t, avgpipe__track_name(t));
    }
    for (i = 0; i < n && ok; i++) {
        const avgpipe_event *e = &ev[i];
        char lab[32], name[48];
        double ts = e->start * us, dur = (e->end - e->start) * us;
        avgpipe__label(&e->op, 1, lab, sizeof lab);
        avgpipe_op_format(&e->op, sp.multi, name, sizeof name);
        ok &= avgpipe__buf_printf(ctx, out,
                                  "{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
                                  "\"args\":{\"op\":\"%s\",\"pipe\":%d,\"stage\":%d,\"micro\":%d,\"peer\":%d}},\n",
                                  name, avgpipe_op_kind_name((avgpipe_op_kind)e->op.kind), (int)e->rank, (int)e->track, ts, dur, lab,
                                  e->op.pipe, e->op.stage, e->op.micro, (int)e->peer);
        if (e->flow >= 0 && e->track != 0) /* arrow from the middle of the send to the middle of the receive */
            ok &= avgpipe__buf_printf(ctx, out,
                                      "{\"name\":\"transfer\",\"cat\":\"comm\",\"ph\":\"%s\",%s\"id\":%d,\"pid\":%d,\"tid\":%d,\"ts\":%.3f},\n",
                                      e->track == 1 ? "s" : "f", e->track == 1 ? "" : "\"bp\":\"e\",", (int)e->flow, (int)e->rank,
                                      (int)e->track, ts + dur / 2);
    }
    if (ok && out->len >= 2 && out->data[out->len - 2] == ',') { /* no trailing comma in JSON */
        out->data[out->len - 2] = '\n';
        out->len--;
        out->data[out->len] = 0;
    }
    ok &= avgpipe__buf_printf(ctx, out, "]}\n");
    return ok ? AVGPIPE_OK : avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "render: out of memory");
}

static const char *avgpipe__color(int kind) {
    switch (kind) {
    case AVGPIPE_OP_F: return "#4e79a7";
    case AVGPIPE_OP_B: return "#f28e2b";
    case AVGPIPE_OP_I: return "#76b7b2";
    case AVGPIPE_OP_W: return "#59a14f";
    case AVGPIPE_OP_STEP: return "#9c755f";
    case AVGPIPE_OP_AVG: return "#b07aa1";
    case AVGPIPE_OP_TIE: return "#ff9da7";
    case AVGPIPE_OP_AGREE: return "#bab0ac";
    default: return "#9d9d9d";
    }
}

static int avgpipe__svg_text(avgpipe_context *ctx, avgpipe_buf *out, const char *s) {
    int ok = 1;
    for (; *s && ok; s++) {
        switch (*s) {
        case '<': ok = avgpipe__buf_put(ctx, out, "&lt;", 4); break;
        case '>': ok = avgpipe__buf_put(ctx, out, "&gt;", 4); break;
        case '&': ok = avgpipe__buf_put(ctx, out, "&amp;", 5); break;
        case '"': ok = avgpipe__buf_put(ctx, out, "&quot;", 6); break;
        default: ok = avgpipe__buf_put(ctx, out, s, 1);
        }
    }
    return ok;
}

AVGPIPE_API avgpipe_result avgpipe_render_svg(avgpipe_context *ctx, const avgpipe_event *ev, size_t n, int nranks,
                                              const avgpipe_render_desc *desc, avgpipe_buf *out) {
    avgpipe__span sp;
    avgpipe_result res = avgpipe__render_check(ctx, ev, n, nranks, out, &sp);
    const double left = 70, top = 40, lane = 24, comm = 9, gap = 8;
    double px, rowh, W, H, tick, t;
    int r, ok = 1;
    size_t i;
    if (res) return res;
    px = desc && desc->px_per_unit > 0 ? desc->px_per_unit : (sp.makespan > 0 ? 1200 / sp.makespan : 1);
    rowh = lane + (sp.has_comm ? 2 * comm : 0) + gap;
    W = left + sp.makespan * px + 20;
    H = top + nranks * rowh + 30;
    ok &= avgpipe__buf_printf(ctx, out,
                              "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"monospace\" "
                              "font-size=\"10\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                              W, H);
    if (desc && desc->title) {
        ok &= avgpipe__buf_printf(ctx, out, "<text x=\"%.0f\" y=\"16\" font-size=\"13\">", left);
        ok &= avgpipe__svg_text(ctx, out, desc->title);
        ok &= avgpipe__buf_printf(ctx, out, "</text>\n");
    }
    tick = sp.makespan > 0 ? pow(10, floor(log10(sp.makespan / 5))) : 1;
    for (t = 0; t <= sp.makespan + 1e-9 && ok; t += tick)
        ok &= avgpipe__buf_printf(ctx, out,
                                  "<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" stroke=\"#ddd\"/><text x=\"%.1f\" y=\"%.0f\" "
                                  "fill=\"#666\">%g</text>\n",
                                  left + t * px, top - 4, left + t * px, H - 24, left + t * px + 2, H - 12, t);
    for (r = 0; r < nranks; r++)
        ok &= avgpipe__buf_printf(ctx, out, "<text x=\"4\" y=\"%.1f\">rank %d</text>\n", top + r * rowh + lane * 0.65, r);
    for (i = 0; i < n && ok; i++) {
        const avgpipe_event *e = &ev[i];
        double x = left + e->start * px, w = (e->end - e->start) * px, y = top + e->rank * rowh, h = lane;
        char lab[32], name[48];
        if (e->track == 2) continue; /* the send lane shows each transfer once */
        if (e->track == 1) {
            y += lane + comm * 0.5;
            h = comm;
        }
        if (w < 1) w = 1;
        avgpipe__label(&e->op, sp.multi, lab, sizeof lab);
        avgpipe_op_format(&e->op, sp.multi, name, sizeof name);
        ok &= avgpipe__buf_printf(ctx, out,
                                  "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\" stroke=\"white\" "
                                  "stroke-width=\"0.5\"><title>rank %d %s [%g, %g]</title></rect>\n",
                                  x, y, w, h, e->track ? "#bab0ac" : avgpipe__color(e->op.kind), (int)e->rank, name, e->start, e->end);
        if (e->track == 0 && w >= 6.5 * (double)strlen(lab))
            ok &= avgpipe__buf_printf(ctx, out, "<text x=\"%.2f\" y=\"%.1f\" fill=\"white\">%s</text>\n", x + 2, y + lane * 0.65, lab);
    }
    ok &= avgpipe__buf_printf(ctx, out, "</svg>\n");
    return ok ? AVGPIPE_OK : avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "render: out of memory");
}

/* --- 11. Device backend ------------------------------------------------------------------------ */

/* POSIX threads (<pthread.h>, included above) run the CPU device's kernel threads and guard the
   averaging module's bookkeeping. */

#if defined(__cplusplus)
#if defined(__GNUC__) || defined(_MSC_VER)
#define AVGPIPE__RESTRICT __restrict
#else
#define AVGPIPE__RESTRICT
#endif
#else
#define AVGPIPE__RESTRICT restrict
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
static avgpipe_result avgpipe__cpu_event_query(void *user, avgpipe_device_event e, int *done) {
    (void)user, (void)e;
    *done = 1; /* the work before a record finished before the record returned */
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

/* From here to avgpipe__cpu_scale: the exact fp32 region (see AVGPIPE__FP_EXACT_BEGIN). */
AVGPIPE__FP_EXACT_BEGIN

AVGPIPE__FORCE_INLINE void avgpipe__ea_elem(float *AVGPIPE__RESTRICT w, const float *AVGPIPE__RESTRICT z,
                                            const float *AVGPIPE__RESTRICT zp, float *AVGPIPE__RESTRICT a,
                                            size_t i, float alpha, float scale, float mu, const unsigned f) {
    const float wi = w[i];
    float c, v, acc, m;
    if (f & AVGPIPE__EA_ELASTIC) {
        c = (f & AVGPIPE__EA_PULL) ? alpha * (wi - z[i]) : 0.0f;
        AVGPIPE__FP_KEEP(c); /* every product rounded before an add reads it (see AVGPIPE__FP_EXACT_BEGIN) */
        if (f & AVGPIPE__EA_PULL) w[i] = wi - c;
        acc = (f & AVGPIPE__EA_FIRST) ? c : a[i] + c;
        if (f & AVGPIPE__EA_LAST) {
            m = (f & AVGPIPE__EA_MOMENTUM) ? mu * (z[i] - zp[i]) : 0.0f;
            AVGPIPE__FP_KEEP(m);
            acc = acc + ((f & AVGPIPE__EA_MOMENTUM) ? z[i] + m : z[i]);
        }
    } else {
        m = (f & AVGPIPE__EA_PULL) ? alpha * (wi - z[i]) : 0.0f;
        AVGPIPE__FP_KEEP(m);
        v = (f & AVGPIPE__EA_PULL) ? wi - m : wi;
        if (f & AVGPIPE__EA_PULL) w[i] = v;
        acc = (f & AVGPIPE__EA_FIRST) ? v : a[i] + v;
        if (f & AVGPIPE__EA_LAST) acc = acc * scale;
    }
    a[i] = acc;
}

#if defined(__clang__) && (((defined(__x86_64__) || defined(__i386__)) && defined(__SSE__)) || defined(__aarch64__))
/* clang: the empty asm of AVGPIPE__FP_KEEP on a scalar stops its vectoriser (the pass ran at 0.58 of memcpy's
   rate, gcc's at 0.92), so four elements at a time go through a 16-byte vector, which the asm keeps in a
   vector register; the same operations in the same order on each lane as avgpipe__ea_elem. */
#define AVGPIPE__EA_VEC 1
typedef float avgpipe__f4 __attribute__((ext_vector_type(4)));
AVGPIPE__FORCE_INLINE void avgpipe__ea_elem4(float *AVGPIPE__RESTRICT w, const float *AVGPIPE__RESTRICT z,
                                             const float *AVGPIPE__RESTRICT zp, float *AVGPIPE__RESTRICT a,
                                             size_t i, float alpha, float scale, float mu, const unsigned f) {
    const avgpipe__f4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
    avgpipe__f4 wi, zi = zero, zpi = zero, ai = zero, c, v, acc, m;
    memcpy(&wi, w + i, sizeof wi);
    if ((f & AVGPIPE__EA_PULL) || ((f & AVGPIPE__EA_ELASTIC) && (f & AVGPIPE__EA_LAST))) memcpy(&zi, z + i, sizeof zi);
    if (f & AVGPIPE__EA_MOMENTUM) memcpy(&zpi, zp + i, sizeof zpi);
    if (!(f & AVGPIPE__EA_FIRST)) memcpy(&ai, a + i, sizeof ai);
    if (f & AVGPIPE__EA_ELASTIC) {
        c = (f & AVGPIPE__EA_PULL) ? alpha * (wi - zi) : zero;
        AVGPIPE__FP_KEEP(c);
        if (f & AVGPIPE__EA_PULL) {
            v = wi - c;
            memcpy(w + i, &v, sizeof v);
        }
        acc = (f & AVGPIPE__EA_FIRST) ? c : ai + c;
        if (f & AVGPIPE__EA_LAST) {
            m = (f & AVGPIPE__EA_MOMENTUM) ? mu * (zi - zpi) : zero;
            AVGPIPE__FP_KEEP(m);
            acc = acc + ((f & AVGPIPE__EA_MOMENTUM) ? zi + m : zi);
        }
    } else {
        m = (f & AVGPIPE__EA_PULL) ? alpha * (wi - zi) : zero;
        AVGPIPE__FP_KEEP(m);
        v = (f & AVGPIPE__EA_PULL) ? wi - m : wi;
        if (f & AVGPIPE__EA_PULL) memcpy(w + i, &v, sizeof v);
        acc = (f & AVGPIPE__EA_FIRST) ? v : ai + v;
        if (f & AVGPIPE__EA_LAST) acc = acc * scale;
    }
    memcpy(a + i, &acc, sizeof acc);
}
#endif

AVGPIPE__FORCE_INLINE void avgpipe__ea_run(float *AVGPIPE__RESTRICT w, const float *AVGPIPE__RESTRICT z,
                                           const float *AVGPIPE__RESTRICT zp, float *AVGPIPE__RESTRICT a, size_t n,
                                           float alpha, float scale, float mu, const unsigned f) {
    size_t i = 0;
#ifdef AVGPIPE__EA_VEC
    for (; i + 4 <= n; i += 4) avgpipe__ea_elem4(w, z, zp, a, i, alpha, scale, mu, f);
#else
    size_t j;
    for (; i + AVGPIPE__EA_BLOCK <= n; i += AVGPIPE__EA_BLOCK)
        for (j = 0; j < AVGPIPE__EA_BLOCK; j++)
            avgpipe__ea_elem(w, z, zp, a, i + j, alpha, scale, mu, f); /* z, zp may be NULL: index, never offset */
#endif
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
    uint64_t fp = avgpipe__fp_exact_enter(); /* each thread: its own FP environment */
    if (j->pass)
        avgpipe__ea_pass_range(j->pass, j->begin, j->end);
    else
        j->result = avgpipe__nonfinite_range(j->x, j->begin, j->end);
    avgpipe__fp_exact_leave(fp);
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
    if (p->skip && *p->skip) return AVGPIPE_OK; /* a contribution of this round was refused */
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
static avgpipe_result avgpipe__cpu_scale(void *user, float *x, float factor, size_t count, avgpipe_device_stream stream) {
    size_t i;
    uint64_t fp = avgpipe__fp_exact_enter();
    (void)user, (void)stream;
    for (i = 0; i < count; i++) x[i] = x[i] * factor;
    avgpipe__fp_exact_leave(fp);
    return AVGPIPE_OK;
}
AVGPIPE__FP_EXACT_END
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
    out->scale = avgpipe__cpu_scale;
    out->event_query = avgpipe__cpu_event_query; /* no event_elapsed: profiles use the host clock */
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

/* --- 12. Averaging ---------------------------------------------------------------------------- */

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
    uint32_t *flag;              /* check_on_device: [0] the refused pipelines' bits, [1] the first refused round */
    int held;                    /* the oldest open round is finalized in ACC0 but held (hold_every) */
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
    d.alpha = (float)avgpipe__or_default(d.alpha, 0.1);
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
    if (d->hold_every < 0)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.hold_every is %d (must be >= 0)", fn, d->stage,
                             d->hold_every);
    if (d->pipes < 1 || d->pipes > (1 << 24))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.pipes is %d (N, the parallel models, "
                             "must be >= 1)", fn, d->stage, d->pipes);
    if (d->mode != AVGPIPE_EA_MEAN && d->mode != AVGPIPE_EA_ELASTIC)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.mode %d is not an avgpipe_ea_mode", fn,
                             d->stage, (int)d->mode);
    if (avgpipe__nan(d->alpha) || !(d->alpha >= 0.0f && d->alpha <= 1.0f))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.alpha %g is outside [0, 1]", fn, d->stage,
                             (double)d->alpha);
    if (avgpipe__nan(d->momentum) || !(d->momentum >= 0.0f && d->momentum < 1.0f))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.momentum %g is outside [0, 1)", fn,
                             d->stage, (double)d->momentum);
    if (d->momentum != 0.0f && d->mode != AVGPIPE_EA_ELASTIC)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.momentum applies to AVGPIPE_EA_ELASTIC "
                             "only", fn, d->stage);
    if (d->check_on_device && (d->no_finite_check || !d->device || !d->device->flag_nonfinite))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "%s: stage %d: desc.check_on_device needs the guard on and a device with "
                             "flag_nonfinite", fn, d->stage);
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
    if (d.check_on_device) out->device_bytes += 2 * sizeof(uint32_t) + d.device->alloc_overhead; /* the flag */
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
    if (ea->flag) ea->dev.free(ea->dev.user, ea->flag);
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
    if (ea->desc.check_on_device) {
        if ((r = ea->dev.alloc(ea->dev.user, 2 * sizeof(uint32_t), &p)) != AVGPIPE_OK)
            return avgpipe__ea_backend_fail(ctx, ea, fn, "alloc", r);
        ea->flag = (uint32_t *)p;
        if ((r = ea->dev.memset(ea->dev.user, ea->flag, 0, 2 * sizeof(uint32_t), NULL)) != AVGPIPE_OK)
            return avgpipe__ea_backend_fail(ctx, ea, fn, "memset", r);
    }
    r = ea->dev.copy(ea->dev.user, avgpipe__ea_buf(ea, AVGPIPE__EA_Z), ea->desc.initial, bytes, AVGPIPE_DEVICE_COPY_D2D, NULL);
    if (r == AVGPIPE_OK && ea->nbuf == 4)
        r = ea->dev.copy(ea->dev.user, avgpipe__ea_buf(ea, AVGPIPE__EA_ZPREV), ea->desc.initial, bytes,
                         AVGPIPE_DEVICE_COPY_D2D, NULL);
    if (r != AVGPIPE_OK) return avgpipe__ea_backend_fail(ctx, ea, fn, "copy", r);
    if ((r = ea->dev.event_record(ea->dev.user, ea->chain, NULL)) != AVGPIPE_OK)
        return avgpipe__ea_backend_fail(ctx, ea, fn, "event_record", r);
    /* the copies are done before create returns: the caller may change `initial` right away (the
       runtime's first step does, on another stream) */
    if ((r = ea->dev.event_synchronize(ea->dev.user, ea->chain)) != AVGPIPE_OK)
        return avgpipe__ea_backend_fail(ctx, ea, fn, "event_synchronize", r);
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

/* Under the lock: the finalized accumulator becomes the reference (the roles rotate). */
static void avgpipe__ea_complete(avgpipe_context *ctx, avgpipe_ea *ea) {
    ea->head = (ea->head + 1) % ea->nbuf;
    ea->completed++;
    ea->held = 0;
    ea->count[0] = ea->count[1];
    ea->count[1] = 0;
    pthread_cond_broadcast(&ea->done);
    avgpipe__log(ctx, AVGPIPE_LOG_DEBUG, "avgpipe_ea: stage %d: round %llu complete", ea->desc.stage,
                 (unsigned long long)(ea->completed - 1));
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
    if (ea->flag) { /* the guard on the device: a non-finite w sets the flag, and a set flag stops every pass */
        if ((r = ea->dev.flag_nonfinite(ea->dev.user, w, ea->desc.count, ea->flag, 1u << (pipe % 32), (uint32_t)ea->next[pipe], stream)) !=
            AVGPIPE_OK)
            return avgpipe__ea_backend_fail(ctx, ea, fn, "flag_nonfinite", r);
        p.skip = ea->flag;
    }
    if ((r = ea->dev.ea_pass(ea->dev.user, &p, stream)) != AVGPIPE_OK)
        return avgpipe__ea_backend_fail(ctx, ea, fn, "ea_pass", r);
    if ((r = ea->dev.event_record(ea->dev.user, ea->chain, stream)) != AVGPIPE_OK)
        return avgpipe__ea_backend_fail(ctx, ea, fn, "event_record", r);
    ea->count[slot]++;
    ea->next[pipe]++;
    if (p.last) {
        if (ea->desc.hold_every > 0 && (ea->completed + 1) % (uint64_t)ea->desc.hold_every == 0) ea->held = 1;
        else avgpipe__ea_complete(ctx, ea);
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
    if (!ea->desc.no_finite_check && !ea->flag) { /* outside the lock: it reads only this pipeline's w */
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

AVGPIPE_API avgpipe_result avgpipe_ea_nonfinite(avgpipe_context *ctx, avgpipe_ea *ea, avgpipe_device_stream stream, uint32_t *pipes) {
    uint32_t f[2] = {0, 0};
    avgpipe_result r;
    char names[160];
    size_t len = 0;
    int i;
    ctx = avgpipe__ctx(ctx);
    if (pipes) *pipes = 0;
    if (!ea) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_nonfinite: ea is NULL");
    if (!ea->flag) return AVGPIPE_OK;
    pthread_mutex_lock(&ea->lock); /* after every pass enqueued so far */
    r = ea->dev.stream_wait_event(ea->dev.user, stream, ea->chain);
    pthread_mutex_unlock(&ea->lock);
    if (!r) r = ea->dev.copy(ea->dev.user, f, ea->flag, sizeof f, AVGPIPE_DEVICE_COPY_D2H, stream);
    if (!r) r = ea->dev.stream_synchronize(ea->dev.user, stream);
    if (r) return avgpipe__ea_backend_fail(ctx, ea, "avgpipe_ea_nonfinite", "copy", r);
    if (pipes) *pipes = f[0];
    if (!f[0]) return AVGPIPE_OK;
    names[0] = 0;
    for (i = 0; i < 32 && i < ea->desc.pipes; i++)
        if (f[0] & (1u << i)) {
            int n = snprintf(names + len, sizeof names - len, "%s%d", len ? ", " : "", i);
            if (n > 0 && (size_t)n < sizeof names - len) len += (size_t)n;
        }
    return avgpipe__fail(ctx, AVGPIPE_NON_FINITE, "avgpipe_ea_nonfinite: stage %d, round %u: pipeline %s held a non-finite value; "
                         "its contribution was refused on the device, and every later pass of the module changed nothing (the "
                         "reference never saw it; the module is unusable)", ea->desc.stage, (unsigned)f[1], names);
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
    until = avgpipe__deadline((double)timeout_ms * 1e-3);
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

AVGPIPE_API float *avgpipe_ea_held(avgpipe_ea *ea, uint64_t *round) {
    float *p = NULL;
    if (!ea) return NULL;
    pthread_mutex_lock(&ea->lock);
    if (ea->held) {
        p = avgpipe__ea_buf(ea, AVGPIPE__EA_ACC0);
        if (round) *round = ea->completed;
    }
    pthread_mutex_unlock(&ea->lock);
    return p;
}

/* Under the lock: is any round open (contributions made to it, or a round held)? */
static avgpipe_result avgpipe__ea_idle(avgpipe_context *ctx, const avgpipe_ea *ea, const char *fn) {
    if (ea->count[0] || ea->count[1] || ea->held)
        return avgpipe__fail(ctx, AVGPIPE_STATE_ERROR, "%s: stage %d: round %llu is open (%d of %d contributed)", fn, ea->desc.stage,
                             (unsigned long long)ea->completed, ea->count[0], ea->desc.pipes);
    return AVGPIPE_OK;
}

/* Under the lock: copy the reference (and z_prev) out of (save) or into (!save) the module, after all
   its device work; on the CPU device the copies are done when it returns. */
static avgpipe_result avgpipe__ea_transfer(avgpipe_context *ctx, avgpipe_ea *ea, const char *fn, int save, float *z, float *z_prev) {
    size_t bytes = ea->desc.count * sizeof(float);
    avgpipe_device_copy_kind kind = save ? AVGPIPE_DEVICE_COPY_D2H : AVGPIPE_DEVICE_COPY_H2D;
    float *bz = avgpipe__ea_buf(ea, AVGPIPE__EA_Z), *bp = ea->nbuf == 4 ? avgpipe__ea_buf(ea, AVGPIPE__EA_ZPREV) : NULL;
    avgpipe_result r = avgpipe__ea_idle(ctx, ea, fn);
    if (r) return r;
    if ((r = ea->dev.event_synchronize(ea->dev.user, ea->chain)) != AVGPIPE_OK) return avgpipe__ea_backend_fail(ctx, ea, fn, "event_synchronize", r);
    if ((r = ea->dev.copy(ea->dev.user, save ? (void *)z : bz, save ? (const void *)bz : z, bytes, kind, NULL)) != AVGPIPE_OK ||
        (bp && (r = ea->dev.copy(ea->dev.user, save ? (void *)z_prev : bp, save ? (const void *)bp : z_prev, bytes, kind, NULL)) != AVGPIPE_OK))
        return avgpipe__ea_backend_fail(ctx, ea, fn, "copy", r);
    if ((r = ea->dev.stream_synchronize(ea->dev.user, NULL)) != AVGPIPE_OK) return avgpipe__ea_backend_fail(ctx, ea, fn, "stream_synchronize", r);
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_ea_save_state(avgpipe_context *ctx, avgpipe_ea *ea, uint64_t *rounds, float *z, float *z_prev) {
    avgpipe_result r;
    ctx = avgpipe__ctx(ctx);
    if (!ea || !rounds || !z || (ea->nbuf == 4 && !z_prev)) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_save_state: NULL argument");
    pthread_mutex_lock(&ea->lock);
    r = avgpipe__ea_transfer(ctx, ea, "avgpipe_ea_save_state", 1, z, z_prev);
    *rounds = ea->completed;
    pthread_mutex_unlock(&ea->lock);
    return r;
}

AVGPIPE_API avgpipe_result avgpipe_ea_load_state(avgpipe_context *ctx, avgpipe_ea *ea, uint64_t rounds, const float *z, const float *z_prev) {
    avgpipe_result r;
    int i;
    ctx = avgpipe__ctx(ctx);
    if (!ea || !z || (ea->nbuf == 4 && !z_prev)) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_load_state: NULL argument");
    pthread_mutex_lock(&ea->lock);
    r = avgpipe__ea_transfer(ctx, ea, "avgpipe_ea_load_state", 0, (float *)(uintptr_t)z, (float *)(uintptr_t)z_prev);
    if (!r) {
        ea->completed = rounds;
        for (i = 0; i < ea->desc.pipes; i++) ea->next[i] = rounds;
    }
    pthread_mutex_unlock(&ea->lock);
    return r;
}

AVGPIPE_API avgpipe_result avgpipe_ea_publish(avgpipe_context *ctx, avgpipe_ea *ea, avgpipe_device_stream stream) {
    avgpipe_result r = AVGPIPE_OK;
    ctx = avgpipe__ctx(ctx);
    if (!ea) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_ea_publish: ea is NULL");
    pthread_mutex_lock(&ea->lock);
    if (!ea->held)
        r = avgpipe__fail(ctx, AVGPIPE_STATE_ERROR, "avgpipe_ea_publish: stage %d: no round is held", ea->desc.stage);
    else if ((r = ea->dev.event_record(ea->dev.user, ea->chain, stream)) != AVGPIPE_OK)
        r = avgpipe__ea_backend_fail(ctx, ea, "avgpipe_ea_publish", "event_record", r);
    else
        avgpipe__ea_complete(ctx, ea);
    pthread_mutex_unlock(&ea->lock);
    return r;
}

/* --- 13. Comm backend: in-process threads ----------------------------------------------------- */

/* Spin-then-sleep waits: a flag written under the mutex is read lock-free while spinning. */
#ifndef AVGPIPE_COMM_SPIN
#define AVGPIPE_COMM_SPIN 256 /* pause instructions before a wait sleeps; 0 disables spinning */
#endif

struct avgpipe_comm_request_s {
    struct avgpipe_comm_request_s *next; /* in a channel queue, or in the free list */
    const void *sbuf;
    void *rbuf;
    size_t bytes;
    uint32_t tag;
    int src, dst, send;
    int queued; /* waiting in its channel's queue for the other side */
    int done;
    avgpipe_result res;
    avgpipe_comm_status st; /* receives: what the matched send carried */
    /* Device-ordered (isend_on / irecv_on): the caller's events, and the request's own event, recorded
       after the copy (kept with the request's storage across reuses: created once). */
    int on, gated;
    avgpipe_device_event ready, done_ev, ev, gate;
};

typedef struct avgpipe__lqueue {
    struct avgpipe_comm_request_s *head, *tail;
} avgpipe__lqueue;

typedef struct avgpipe__lgroup avgpipe__lgroup;

typedef struct avgpipe__local {
    avgpipe_context *ctx; /* points at own_ctx: the caller's context need not outlive the backend */
    avgpipe_context own_ctx;
    int n;
    int refs; /* tables handed out (split hands one to each member) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    avgpipe__lqueue *sends, *recvs; /* [src * n + dst] */
    struct avgpipe_comm_request_s *free_list;
    void **chunks; /* request storage, freed at destroy */
    int nchunks, chunk_cap;
    int aborted;
    avgpipe_result abort_res;
    char abort_msg[256];
    char (*err)[256]; /* per rank */
    int bar_count;
    long bar_gen;
    float *ar_buf;
    size_t ar_count, ar_cap;
    int ar_in, ar_out;
    long ar_gen;
    /* split: groups being formed, and how many splits each rank has made */
    avgpipe__lgroup *groups;
    long *nsplit;
    /* avgpipe_comm_local_create_on: the device whose memory the buffers are, and a copy stream per
       channel [src * n + dst], made when the channel first carries a device-ordered message; and a
       gate stream per rank, where a post's `ready` is taken when it is posted (a later record of that
       event, by the rank's next op on the buffer, must not hold the copy back) */
    int has_dev;
    avgpipe_device dev;
    avgpipe_device_stream *chan, *gate;
} avgpipe__local;

/* A group of a split while its members look it up: (generation, member list) -> the sub-communicator. */
struct avgpipe__lgroup {
    avgpipe__lgroup *next;
    long gen;
    int count, joined;
    int *members;
    avgpipe__local *sub;
};

static void avgpipe__lq_push(avgpipe__lqueue *q, struct avgpipe_comm_request_s *r) {
    r->next = NULL;
    if (q->tail) q->tail->next = r;
    else q->head = r;
    q->tail = r;
    r->queued = 1;
}
static struct avgpipe_comm_request_s *avgpipe__lq_pop(avgpipe__lqueue *q) {
    struct avgpipe_comm_request_s *r = q->head;
    if (r) {
        q->head = r->next;
        if (!q->head) q->tail = NULL;
        r->next = NULL;
        r->queued = 0;
    }
    return r;
}
/* Take r out of q wherever it is (cancel). */
static void avgpipe__lq_remove(avgpipe__lqueue *q, struct avgpipe_comm_request_s *r) {
    struct avgpipe_comm_request_s *p = NULL, *c = q->head;
    while (c && c != r) p = c, c = c->next;
    if (!c) return;
    if (p) p->next = c->next;
    else q->head = c->next;
    if (q->tail == c) q->tail = p;
    c->next = NULL;
    c->queued = 0;
}

/* A request from the free list (grown by chunks of 256). Called with the mutex held. */
static struct avgpipe_comm_request_s *avgpipe__lreq_new(avgpipe__local *L) {
    struct avgpipe_comm_request_s *r;
    if (!L->free_list) {
        int i;
        struct avgpipe_comm_request_s *chunk;
        if (L->nchunks == L->chunk_cap) {
            int cap = L->chunk_cap ? 2 * L->chunk_cap : 16;
            void **p = (void **)avgpipe__realloc(L->ctx, L->chunks, (size_t)L->chunk_cap * sizeof(void *), (size_t)cap * sizeof(void *));
            if (!p) return NULL;
            L->chunks = p;
            L->chunk_cap = cap;
        }
        chunk = (struct avgpipe_comm_request_s *)avgpipe__calloc(L->ctx, 256, sizeof *chunk);
        if (!chunk) return NULL;
        L->chunks[L->nchunks++] = chunk;
        for (i = 0; i < 256; i++) {
            chunk[i].next = L->free_list;
            L->free_list = &chunk[i];
        }
    }
    r = L->free_list;
    L->free_list = r->next;
    {
        avgpipe_device_event ev = r->ev, gate = r->gate; /* the storage's own events outlive each use */
        memset(r, 0, sizeof *r);
        r->ev = ev, r->gate = gate;
    }
    return r;
}
static void avgpipe__lreq_release(avgpipe__local *L, struct avgpipe_comm_request_s *r) {
    r->next = L->free_list;
    L->free_list = r;
}

/* A device-ordered pair: on the channel's stream, after both `ready` events, one device-to-device copy,
   then the receiver's and the sender's `done` and the requests' own events. Mutex held. */
static avgpipe_result avgpipe__lmatch_on(avgpipe__local *L, struct avgpipe_comm_request_s *s, struct avgpipe_comm_request_s *r) {
    avgpipe_device *d = &L->dev;
    avgpipe_device_stream *st = &L->chan[s->src * L->n + s->dst];
    avgpipe_result res = AVGPIPE_OK;
    const char *what = "creating the channel's copy stream";
    if (!*st) res = d->stream_create(d->user, st);
    if (!res && !r->ev) what = "creating an event", res = d->event_create(d->user, &r->ev);
    if (!res && !s->ev) what = "creating an event", res = d->event_create(d->user, &s->ev);
    if (!res && s->gated) what = "waiting for the send's ready event", res = d->stream_wait_event(d->user, *st, s->gate);
    if (!res && r->gated) what = "waiting for the receive's ready event", res = d->stream_wait_event(d->user, *st, r->gate);
    if (!res && s->bytes) what = "copying the message", res = d->copy(d->user, r->rbuf, s->sbuf, s->bytes, AVGPIPE_DEVICE_COPY_D2D, *st);
    if (!res && r->done_ev) what = "recording the receive's done event", res = d->event_record(d->user, r->done_ev, *st);
    if (!res && s->done_ev) what = "recording the send's done event", res = d->event_record(d->user, s->done_ev, *st);
    if (!res) what = "recording an event", res = d->event_record(d->user, r->ev, *st);
    if (!res) res = d->event_record(d->user, s->ev, *st);
    if (res) {
        res = AVGPIPE_BACKEND_ERROR;
        snprintf(L->err[r->dst], sizeof L->err[r->dst], "device '%s', the message from rank %d: %s failed: %s", d->name ? d->name : "?", s->src,
                 what, d->error_string ? d->error_string(d->user) : "");
        if (s->src != r->dst) memcpy(L->err[s->src], L->err[r->dst], sizeof L->err[0]); /* both ranks' requests fail */
    }
    return res;
}

/* Pair a send with a receive: check tag and size, copy, finish both. Called with the mutex held. */
static void avgpipe__lmatch(avgpipe__local *L, struct avgpipe_comm_request_s *s, struct avgpipe_comm_request_s *r) {
    r->st.tag = s->tag;
    r->st.bytes = s->bytes;
    if (s->tag != r->tag || s->bytes > r->bytes) { /* a lost, duplicated or reordered message: the receive says so */
        r->res = AVGPIPE_MISMATCH;
        snprintf(L->err[r->dst], sizeof L->err[r->dst], "a receive from rank %d of %zu bytes with tag %u met a message of %zu bytes with tag %u",
                 s->src, r->bytes, (unsigned)r->tag, s->bytes, (unsigned)s->tag);
    } else if (s->on != r->on) { /* device memory on one side, host memory on the other: no copy can serve both */
        r->res = s->res = AVGPIPE_MISMATCH;
        snprintf(L->err[r->dst], sizeof L->err[r->dst], "a %s receive from rank %d (tag %u) met a %s send", r->on ? "device-ordered" : "host",
                 s->src, (unsigned)r->tag, s->on ? "device-ordered" : "host");
    } else if (s->on) {
        r->res = s->res = avgpipe__lmatch_on(L, s, r);
    } else if (s->bytes) {
        memcpy(r->rbuf, s->sbuf, s->bytes);
    }
    AVGPIPE__STORE(&s->done, 1);
    AVGPIPE__STORE(&r->done, 1);
    pthread_cond_broadcast(&L->cv);
}

static avgpipe_result avgpipe__lpost(avgpipe__local *L, int send, int self, int peer, const void *sbuf, void *rbuf, size_t bytes,
                                     uint32_t tag, const avgpipe_device_event *on, avgpipe_comm_request *req) {
    struct avgpipe_comm_request_s *r, *m;
    int src = send ? self : peer, dst = send ? peer : self;
    if (!req || self < 0 || self >= L->n || peer < 0 || peer >= L->n || peer == self || tag > AVGPIPE_COMM_TAG_MAX)
        return AVGPIPE_INVALID_ARG;
    pthread_mutex_lock(&L->mu);
    if (L->aborted) {
        pthread_mutex_unlock(&L->mu);
        return AVGPIPE_ABORTED;
    }
    r = avgpipe__lreq_new(L);
    if (!r) {
        pthread_mutex_unlock(&L->mu);
        return AVGPIPE_OUT_OF_MEMORY;
    }
    r->sbuf = sbuf;
    r->rbuf = rbuf;
    r->bytes = bytes;
    r->tag = tag;
    r->src = src;
    r->dst = dst;
    r->send = send;
    if (on) {
        avgpipe_result gres = AVGPIPE_OK;
        avgpipe_device *d = &L->dev;
        r->on = 1, r->ready = on[0], r->done_ev = on[1];
        if (r->ready) { /* take `ready` as it is now: on the rank's gate stream, a wait and a record of our own */
            if (!L->gate[self]) gres = d->stream_create(d->user, &L->gate[self]);
            if (!gres && !r->gate) gres = d->event_create(d->user, &r->gate);
            if (!gres) gres = d->stream_wait_event(d->user, L->gate[self], r->ready);
            if (!gres) gres = d->event_record(d->user, r->gate, L->gate[self]);
            if (gres) {
                snprintf(L->err[self], sizeof L->err[self], "device '%s': taking a transfer's ready event failed: %s", d->name ? d->name : "?",
                         d->error_string ? d->error_string(d->user) : "");
                avgpipe__lreq_release(L, r);
                pthread_mutex_unlock(&L->mu);
                return AVGPIPE_BACKEND_ERROR;
            }
            r->gated = 1;
        }
    }
    m = avgpipe__lq_pop(send ? &L->recvs[src * L->n + dst] : &L->sends[src * L->n + dst]);
    if (m) avgpipe__lmatch(L, send ? r : m, send ? m : r);
    else avgpipe__lq_push(send ? &L->sends[src * L->n + dst] : &L->recvs[src * L->n + dst], r);
    *req = r;
    pthread_mutex_unlock(&L->mu);
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__local_isend(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag,
                                           avgpipe_comm_request *req) {
    static const char empty = 0;
    return avgpipe__lpost((avgpipe__local *)user, 1, self, peer, buf ? buf : &empty, NULL, bytes, tag, NULL, req);
}
static avgpipe_result avgpipe__local_irecv(void *user, int self, int peer, void *buf, size_t bytes, uint32_t tag,
                                           avgpipe_comm_request *req) {
    static char sink;
    return avgpipe__lpost((avgpipe__local *)user, 0, self, peer, NULL, buf ? buf : &sink, bytes, tag, NULL, req);
}
static avgpipe_result avgpipe__local_isend_on(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag,
                                              avgpipe_device_event ready, avgpipe_device_event done, avgpipe_comm_request *req) {
    avgpipe_device_event ev[2];
    ev[0] = ready, ev[1] = done;
    if (bytes && !buf) return AVGPIPE_INVALID_ARG;
    return avgpipe__lpost((avgpipe__local *)user, 1, self, peer, buf, NULL, bytes, tag, ev, req);
}
static avgpipe_result avgpipe__local_irecv_on(void *user, int self, int peer, void *buf, size_t bytes, uint32_t tag,
                                              avgpipe_device_event ready, avgpipe_device_event done, avgpipe_comm_request *req) {
    avgpipe_device_event ev[2];
    ev[0] = ready, ev[1] = done;
    if (bytes && !buf) return AVGPIPE_INVALID_ARG;
    return avgpipe__lpost((avgpipe__local *)user, 0, self, peer, NULL, buf, bytes, tag, ev, req);
}

/* Until req is matched (its copy enqueued, `done` recorded), at most timeout_s. */
static avgpipe_result avgpipe__local_wait_issued(void *user, int self, avgpipe_comm_request handle, double timeout_s) {
    avgpipe__local *L = (avgpipe__local *)user;
    struct avgpipe_comm_request_s *req = (struct avgpipe_comm_request_s *)handle;
    struct timespec dl;
    avgpipe_result res = AVGPIPE_OK;
    int spin;
    (void)self;
    if (!req) return AVGPIPE_INVALID_ARG;
    for (spin = 0; spin < AVGPIPE_COMM_SPIN && !AVGPIPE__LOAD(&req->done); spin++) AVGPIPE__RELAX();
    dl = avgpipe__deadline(timeout_s);
    pthread_mutex_lock(&L->mu);
    while (!req->done && !L->aborted)
        if (pthread_cond_timedwait(&L->cv, &L->mu, &dl) != 0 && !req->done) break;
    if (!req->done) res = L->aborted ? AVGPIPE_ABORTED : AVGPIPE_TIMEOUT;
    pthread_mutex_unlock(&L->mu);
    return res;
}

/* A matched device-ordered request: 1 when its copy has finished on the device (0 while it runs; the
   device's query, or a blocking synchronize where the table has no query); a failure sets *res. */
static int avgpipe__ldev_finished(avgpipe__local *L, struct avgpipe_comm_request_s *req, avgpipe_result *res) {
    int fin = 0;
    avgpipe_result r;
    if (!req->on || req->res || !req->ev) return 1;
    r = L->dev.event_query ? L->dev.event_query(L->dev.user, req->ev, &fin) : (fin = 1, L->dev.event_synchronize(L->dev.user, req->ev));
    if (r) {
        *res = AVGPIPE_BACKEND_ERROR;
        return 1;
    }
    return fin;
}

/* A finished request: its result and status, then back to the free list. Mutex held. */
static avgpipe_result avgpipe__lfinish(avgpipe__local *L, struct avgpipe_comm_request_s *req, avgpipe_comm_status *status) {
    avgpipe_result res = req->res;
    if (status && !req->send) *status = req->st;
    avgpipe__lreq_release(L, req);
    return res;
}

static avgpipe_result avgpipe__local_test(void *user, int self, avgpipe_comm_request handle, int *done, avgpipe_comm_status *status) {
    avgpipe__local *L = (avgpipe__local *)user;
    struct avgpipe_comm_request_s *req = (struct avgpipe_comm_request_s *)handle;
    avgpipe_result res = AVGPIPE_OK;
    (void)self;
    if (!req || !done) return AVGPIPE_INVALID_ARG;
    pthread_mutex_lock(&L->mu);
    *done = req->done;
    if (req->done && !avgpipe__ldev_finished(L, req, &res)) *done = 0; /* matched; its copy still runs on the device */
    else if (req->done) {
        avgpipe_result r = avgpipe__lfinish(L, req, status);
        if (!res) res = r;
    } else if (L->aborted) res = AVGPIPE_ABORTED;
    pthread_mutex_unlock(&L->mu);
    return res;
}

static avgpipe_result avgpipe__local_wait(void *user, int self, avgpipe_comm_request handle, double timeout_s, avgpipe_comm_status *status) {
    avgpipe__local *L = (avgpipe__local *)user;
    struct avgpipe_comm_request_s *req = (struct avgpipe_comm_request_s *)handle;
    struct timespec dl;
    avgpipe_result res;
    int spin;
    (void)self;
    if (!req) return AVGPIPE_INVALID_ARG;
    /* A message that is about to arrive is cheaper to wait for spinning a few microseconds than
       sleeping on the condition variable (a wake-up costs a context switch each way). */
    for (spin = 0; spin < AVGPIPE_COMM_SPIN && !AVGPIPE__LOAD(&req->done); spin++) AVGPIPE__RELAX();
    dl = avgpipe__deadline(timeout_s);
    pthread_mutex_lock(&L->mu);
    while (!req->done && !L->aborted)
        if (pthread_cond_timedwait(&L->cv, &L->mu, &dl) != 0 && !req->done) break; /* timed out */
    if (req->done && req->on) { /* matched: now its copy on the device, polled outside the mutex */
        avgpipe_result dres = AVGPIPE_OK;
        double t0 = avgpipe__now(), nap = 2e-6;
        pthread_mutex_unlock(&L->mu);
        while (!avgpipe__ldev_finished(L, req, &dres)) {
            struct timespec nap_dl = avgpipe__deadline(nap);
            if (avgpipe__now() - t0 > timeout_s) return AVGPIPE_TIMEOUT; /* still pending: wait again or cancel */
            pthread_mutex_lock(&L->mu);
            if (L->aborted) {
                pthread_mutex_unlock(&L->mu);
                return AVGPIPE_ABORTED;
            }
            pthread_cond_timedwait(&L->cv, &L->mu, &nap_dl); /* a nap an abort cuts short */
            pthread_mutex_unlock(&L->mu);
            nap = nap < 1e-3 ? 2 * nap : 1e-3;
        }
        pthread_mutex_lock(&L->mu);
        res = avgpipe__lfinish(L, req, status);
        if (dres) res = dres;
    } else if (req->done) res = avgpipe__lfinish(L, req, status);
    else res = L->aborted ? AVGPIPE_ABORTED : AVGPIPE_TIMEOUT;
    pthread_mutex_unlock(&L->mu);
    return res;
}

/* Out of its queue (so no later post matches it) and back to the free list. */
static void avgpipe__local_cancel(void *user, int self, avgpipe_comm_request handle) {
    avgpipe__local *L = (avgpipe__local *)user;
    struct avgpipe_comm_request_s *req = (struct avgpipe_comm_request_s *)handle;
    (void)self;
    if (!req) return;
    pthread_mutex_lock(&L->mu);
    if (req->queued)
        avgpipe__lq_remove(req->send ? &L->sends[req->src * L->n + req->dst] : &L->recvs[req->src * L->n + req->dst], req);
    avgpipe__lreq_release(L, req);
    pthread_mutex_unlock(&L->mu);
}

static avgpipe_result avgpipe__local_barrier(void *user, int self, double timeout_s) {
    avgpipe__local *L = (avgpipe__local *)user;
    struct timespec dl = avgpipe__deadline(timeout_s);
    avgpipe_result res = AVGPIPE_OK;
    long gen;
    (void)self;
    pthread_mutex_lock(&L->mu);
    gen = L->bar_gen;
    if (++L->bar_count == L->n) {
        L->bar_count = 0;
        L->bar_gen++;
        pthread_cond_broadcast(&L->cv);
    }
    while (L->bar_gen == gen && !L->aborted)
        if (pthread_cond_timedwait(&L->cv, &L->mu, &dl) != 0 && L->bar_gen == gen) {
            L->bar_count--; /* withdraw, so the next barrier still waits for every rank */
            res = AVGPIPE_TIMEOUT;
            break;
        }
    if (L->bar_gen == gen && L->aborted) res = AVGPIPE_ABORTED;
    pthread_mutex_unlock(&L->mu);
    return res;
}

AVGPIPE__FP_EXACT_BEGIN
AVGPIPE_API void avgpipe_comm_sum_ranks(float *dst, const float *parts, size_t stride, int nparts, size_t count) {
    uint64_t fp = avgpipe__fp_exact_enter();
    size_t i;
    int r;
    for (i = 0; i < count; i++) {
        float sum = 0;
        AVGPIPE__FP_KEEP(sum); /* not folded away: 0 + (-0) is +0 */
        for (r = 0; r < nparts; r++) {
            sum += parts[(size_t)r * stride + i];
            AVGPIPE__FP_KEEP(sum); /* added in this order */
        }
        dst[i] = sum;
    }
    avgpipe__fp_exact_leave(fp);
}

/* The step agreement's arithmetic (declared in section 16): the same bits under any flags. A value is
   non-finite when its exponent bits are all ones (a bit test: -ffinite-math-only folds isnan away). */
AVGPIPE_API void avgpipe_grad_sumsq(const float *x, size_t count, double *sumsq, double *nonfinite) {
    uint64_t fp = avgpipe__fp_exact_enter();
    double acc = sumsq ? *sumsq : 0, bad = nonfinite ? *nonfinite : 0, v;
    size_t i;
    uint32_t b;
    for (i = 0; i < count; i++) {
        memcpy(&b, x + i, sizeof b);
        if ((b & 0x7f800000u) == 0x7f800000u) bad += 1;
        v = (double)x[i] * (double)x[i];
        AVGPIPE__FP_KEEP(v); /* rounded before the add */
        acc += v;
        AVGPIPE__FP_KEEP(acc); /* added in index order */
    }
    if (sumsq) *sumsq = acc;
    if (nonfinite) *nonfinite = bad;
    avgpipe__fp_exact_leave(fp);
}

AVGPIPE_API void avgpipe_agree_combine(const double *parts, int nparts, int width, double *out) {
    uint64_t fp = avgpipe__fp_exact_enter();
    int k, g;
    for (k = 0; k < width; k++) {
        double sum = 0;
        AVGPIPE__FP_KEEP(sum);
        for (g = 0; g < nparts; g++) {
            sum += parts[(size_t)g * (size_t)width + (size_t)k];
            AVGPIPE__FP_KEEP(sum);
        }
        out[k] = sum;
    }
    avgpipe__fp_exact_leave(fp);
}

AVGPIPE_API double avgpipe_clip_scale(double sumsq, double clip_norm) {
    uint64_t fp = avgpipe__fp_exact_enter();
    double norm = sqrt(sumsq), scale = 1;
    uint64_t b;
    memcpy(&b, &norm, sizeof b);
    if (clip_norm > 0 && (b & 0x7ff0000000000000ull) != 0x7ff0000000000000ull && norm > clip_norm) {
        AVGPIPE__FP_KEEP(norm);
        scale = clip_norm / norm;
    }
    avgpipe__fp_exact_leave(fp);
    return scale;
}
AVGPIPE__FP_EXACT_END

/* Each rank leaves its values in its own part; the last to arrive sums the parts in rank order (the
   same bits on every run) and everyone copies the sum out; the last one out opens the next round. A
   rank that times out withdraws its part, so a later allreduce is still exact. */
static avgpipe_result avgpipe__local_allreduce_host(avgpipe__local *L, int self, float *buf, size_t count, double timeout_s) {
    struct timespec dl = avgpipe__deadline(timeout_s);
    avgpipe_result res = AVGPIPE_OK;
    long gen;
    if ((!buf && count) || self < 0 || self >= L->n) return AVGPIPE_INVALID_ARG;
    pthread_mutex_lock(&L->mu);
    while (L->ar_out > 0 && !L->aborted) /* the previous allreduce is still being read */
        if (pthread_cond_timedwait(&L->cv, &L->mu, &dl) != 0 && L->ar_out > 0) {
            pthread_mutex_unlock(&L->mu);
            return AVGPIPE_TIMEOUT;
        }
    if (L->aborted) {
        pthread_mutex_unlock(&L->mu);
        return AVGPIPE_ABORTED;
    }
    if (L->ar_in == 0) {
        if (count > L->ar_cap) {
            float *p = (float *)avgpipe__realloc(L->ctx, L->ar_buf, 0, count * sizeof(float) * ((size_t)L->n + 1));
            if (!p) {
                pthread_mutex_unlock(&L->mu);
                return AVGPIPE_OUT_OF_MEMORY;
            }
            L->ar_buf = p;
            L->ar_cap = count;
        }
        L->ar_count = count;
    } else if (count != L->ar_count) {
        snprintf(L->err[self], sizeof L->err[self], "allreduce of %zu floats met one of %zu", count, L->ar_count);
        pthread_mutex_unlock(&L->mu);
        return AVGPIPE_INVALID_ARG;
    }
    memcpy(L->ar_buf + (size_t)(self + 1) * L->ar_cap, buf, count * sizeof(float)); /* part of `self` */
    gen = L->ar_gen;
    if (++L->ar_in == L->n) {
        avgpipe_comm_sum_ranks(L->ar_buf, L->ar_buf + L->ar_cap, L->ar_cap, L->n, count);
        L->ar_in = 0;
        L->ar_out = L->n;
        L->ar_gen++;
        pthread_cond_broadcast(&L->cv);
    }
    while (L->ar_gen == gen && !L->aborted)
        if (pthread_cond_timedwait(&L->cv, &L->mu, &dl) != 0 && L->ar_gen == gen) {
            L->ar_in--; /* withdraw */
            res = AVGPIPE_TIMEOUT;
            break;
        }
    if (L->ar_gen != gen) {
        memcpy(buf, L->ar_buf, count * sizeof(float));
        if (--L->ar_out == 0) pthread_cond_broadcast(&L->cv);
    } else if (!res) {
        res = AVGPIPE_ABORTED;
    }
    pthread_mutex_unlock(&L->mu);
    return res;
}

/* With a device, buf is device memory: its values come to a host buffer of this rank's through the
   device's copies (the caller made them ready), are summed as above, and go back the same way. */
static avgpipe_result avgpipe__local_allreduce(void *user, int self, float *buf, size_t count, double timeout_s) {
    avgpipe__local *L = (avgpipe__local *)user;
    avgpipe_device *d = &L->dev;
    avgpipe_result res;
    float *host;
    if (!L->has_dev || !count) return avgpipe__local_allreduce_host(L, self, buf, count, timeout_s);
    if (!buf || self < 0 || self >= L->n) return AVGPIPE_INVALID_ARG;
    host = (float *)avgpipe_alloc(L->ctx, count * sizeof(float));
    if (!host) return AVGPIPE_OUT_OF_MEMORY;
    res = d->copy(d->user, host, buf, count * sizeof(float), AVGPIPE_DEVICE_COPY_D2H, NULL);
    if (!res) res = d->stream_synchronize(d->user, NULL);
    if (res) {
        snprintf(L->err[self], sizeof L->err[self], "allreduce: device '%s': copying the values to the host failed: %s", d->name ? d->name : "?",
                 d->error_string ? d->error_string(d->user) : "");
        res = AVGPIPE_BACKEND_ERROR;
    }
    if (!res) res = avgpipe__local_allreduce_host(L, self, host, count, timeout_s);
    if (!res) {
        res = d->copy(d->user, buf, host, count * sizeof(float), AVGPIPE_DEVICE_COPY_H2D, NULL);
        if (!res) res = d->stream_synchronize(d->user, NULL); /* host is freed next */
        if (res) {
            snprintf(L->err[self], sizeof L->err[self], "allreduce: device '%s': copying the sum back failed: %s", d->name ? d->name : "?",
                     d->error_string ? d->error_string(d->user) : "");
            res = AVGPIPE_BACKEND_ERROR;
        }
    }
    avgpipe_free(L->ctx, host);
    return res;
}

static void avgpipe__local_abort(void *user, avgpipe_result why, const char *message) {
    avgpipe__local *L = (avgpipe__local *)user;
    pthread_mutex_lock(&L->mu);
    if (!L->aborted) {
        L->aborted = 1;
        L->abort_res = why;
        snprintf(L->abort_msg, sizeof L->abort_msg, "%s", message ? message : "");
    }
    pthread_cond_broadcast(&L->cv);
    pthread_mutex_unlock(&L->mu);
}

static const char *avgpipe__local_last_error(void *user, int self) {
    avgpipe__local *L = (avgpipe__local *)user;
    if (self < 0 || self >= L->n) return "";
    return L->aborted && !L->err[self][0] ? L->abort_msg : L->err[self];
}

/* Drop one reference; the last frees everything (requests still pending included). */
static void avgpipe__local_destroy(void *user) {
    avgpipe__local *L = (avgpipe__local *)user;
    int i, last;
    if (!L) return;
    pthread_mutex_lock(&L->mu);
    last = --L->refs == 0;
    pthread_mutex_unlock(&L->mu);
    if (!last) return;
    while (L->groups) { /* splits whose members never all came: their sub-communicators lose this reference */
        avgpipe__lgroup *g = L->groups;
        L->groups = g->next;
        avgpipe__local_destroy(g->sub);
        avgpipe_free(L->ctx, g->members);
        avgpipe_free(L->ctx, g);
    }
    if (L->has_dev) { /* the device's work first, then its streams and the requests' events */
        int j;
        for (i = 0; L->chan && i < L->n * L->n; i++)
            if (L->chan[i]) {
                L->dev.stream_synchronize(L->dev.user, L->chan[i]);
                L->dev.stream_destroy(L->dev.user, L->chan[i]);
            }
        for (i = 0; L->gate && i < L->n; i++)
            if (L->gate[i]) {
                L->dev.stream_synchronize(L->dev.user, L->gate[i]);
                L->dev.stream_destroy(L->dev.user, L->gate[i]);
            }
        for (i = 0; i < L->nchunks; i++)
            for (j = 0; j < 256; j++) {
                struct avgpipe_comm_request_s *r = (struct avgpipe_comm_request_s *)L->chunks[i] + j;
                if (r->ev) L->dev.event_destroy(L->dev.user, r->ev);
                if (r->gate) L->dev.event_destroy(L->dev.user, r->gate);
            }
        avgpipe_free(L->ctx, L->chan);
        avgpipe_free(L->ctx, L->gate);
    }
    for (i = 0; i < L->nchunks; i++) avgpipe_free(L->ctx, L->chunks[i]);
    avgpipe_free(L->ctx, L->chunks);
    avgpipe_free(L->ctx, L->sends);
    avgpipe_free(L->ctx, L->recvs);
    avgpipe_free(L->ctx, L->err);
    avgpipe_free(L->ctx, L->ar_buf);
    avgpipe_free(L->ctx, L->nsplit);
    pthread_mutex_destroy(&L->mu);
    pthread_cond_destroy(&L->cv);
    {
        avgpipe_context c = L->own_ctx; /* L holds it: free L through a copy */
        avgpipe_free(&c, L);
    }
}

static avgpipe_result avgpipe__local_split(void *user, int self, const int *members, int count, avgpipe_comm *out);

/* The table over L (one more reference on it). */
static void avgpipe__local_table(avgpipe__local *L, avgpipe_comm *out) {
    memset(out, 0, sizeof *out);
    out->name = "local-threads";
    out->size = L->n;
    out->isend = avgpipe__local_isend;
    out->irecv = avgpipe__local_irecv;
    out->test = avgpipe__local_test;
    out->wait = avgpipe__local_wait;
    out->cancel = avgpipe__local_cancel;
    out->barrier = avgpipe__local_barrier;
    out->allreduce_sum = avgpipe__local_allreduce;
    out->split = avgpipe__local_split;
    if (L->has_dev) {
        out->name = "local-threads-device";
        out->isend_on = avgpipe__local_isend_on;
        out->irecv_on = avgpipe__local_irecv_on;
        out->wait_issued = avgpipe__local_wait_issued;
    }
    out->abort = avgpipe__local_abort;
    out->last_error = avgpipe__local_last_error;
    out->destroy = avgpipe__local_destroy;
    out->user = L;
}

static avgpipe__local *avgpipe__local_new(avgpipe_context *ctx, int ranks, const avgpipe_device *device) {
    avgpipe__local *L = (avgpipe__local *)avgpipe__calloc(ctx, 1, sizeof *L);
    if (!L) return NULL;
    if (device) {
        L->chan = (avgpipe_device_stream *)avgpipe__calloc(ctx, (size_t)ranks * ranks, sizeof(avgpipe_device_stream));
        L->gate = (avgpipe_device_stream *)avgpipe__calloc(ctx, (size_t)ranks, sizeof(avgpipe_device_stream));
        if (!L->chan || !L->gate) {
            avgpipe_free(ctx, L->chan);
            avgpipe_free(ctx, L->gate);
            avgpipe_free(ctx, L);
            return NULL;
        }
        L->has_dev = 1;
        L->dev = *device;
    }
    avgpipe_context_init(&L->own_ctx, &avgpipe__ctx(ctx)->desc); /* same allocator, private error buffer */
    L->ctx = &L->own_ctx;
    L->n = ranks;
    L->sends = (avgpipe__lqueue *)avgpipe__calloc(ctx, (size_t)ranks * ranks, sizeof(avgpipe__lqueue));
    L->recvs = (avgpipe__lqueue *)avgpipe__calloc(ctx, (size_t)ranks * ranks, sizeof(avgpipe__lqueue));
    L->err = (char(*)[256])avgpipe__calloc(ctx, (size_t)ranks, 256);
    L->nsplit = (long *)avgpipe__calloc(ctx, (size_t)ranks, sizeof(long));
    if (!L->sends || !L->recvs || !L->err || !L->nsplit) {
        avgpipe_free(ctx, L->sends);
        avgpipe_free(ctx, L->recvs);
        avgpipe_free(ctx, L->err);
        avgpipe_free(ctx, L->nsplit);
        avgpipe_free(ctx, L->chan);
        avgpipe_free(ctx, L->gate);
        avgpipe_free(ctx, L); /* own_ctx lives inside L */
        return NULL;
    }
    pthread_mutex_init(&L->mu, NULL);
    pthread_cond_init(&L->cv, NULL);
    L->refs = 1;
    return L;
}

/* The k-th split of each rank forms generation k; a group is found by its generation and member list
   (every member passes the same list) and forgotten once all its members have their table. */
static avgpipe_result avgpipe__local_split(void *user, int self, const int *members, int count, avgpipe_comm *out) {
    avgpipe__local *L = (avgpipe__local *)user, *sub = NULL;
    avgpipe__lgroup *g, **link;
    int i, me = -1;
    long gen;
    if (!out || !members || count < 1 || count > L->n || self < 0 || self >= L->n) return AVGPIPE_INVALID_ARG;
    for (i = 0; i < count; i++) {
        if (members[i] < 0 || members[i] >= L->n) return AVGPIPE_INVALID_ARG;
        if (members[i] == self) me = i;
    }
    if (me < 0) {
        snprintf(L->err[self], sizeof L->err[self], "split: rank %d is not among the %d members it passed", self, count);
        return AVGPIPE_INVALID_ARG;
    }
    pthread_mutex_lock(&L->mu);
    gen = L->nsplit[self]++;
    for (link = &L->groups; (g = *link) != NULL; link = &g->next)
        if (g->gen == gen && g->count == count && memcmp(g->members, members, (size_t)count * sizeof(int)) == 0) break;
    if (!g) {
        g = (avgpipe__lgroup *)avgpipe__calloc(L->ctx, 1, sizeof *g);
        if (g) g->members = (int *)avgpipe_alloc(L->ctx, (size_t)count * sizeof(int));
        if (g && g->members) g->sub = avgpipe__local_new(L->ctx, count, L->has_dev ? &L->dev : NULL); /* the same device */
        if (!g || !g->members || !g->sub) {
            if (g) avgpipe_free(L->ctx, g->members);
            avgpipe_free(L->ctx, g);
            L->nsplit[self]--;
            pthread_mutex_unlock(&L->mu);
            return AVGPIPE_OUT_OF_MEMORY;
        }
        memcpy(g->members, members, (size_t)count * sizeof(int));
        g->gen = gen;
        g->count = count; /* g->sub's first reference is the registry's */
        g->next = L->groups;
        L->groups = g;
        link = &L->groups;
    }
    sub = g->sub;
    pthread_mutex_lock(&sub->mu);
    sub->refs++;
    pthread_mutex_unlock(&sub->mu);
    if (++g->joined == count) { /* every member has its table: the registry forgets the group */
        *link = g->next;
        pthread_mutex_lock(&sub->mu);
        sub->refs--; /* the registry's reference; the members hold theirs */
        pthread_mutex_unlock(&sub->mu);
        avgpipe_free(L->ctx, g->members);
        avgpipe_free(L->ctx, g);
    }
    pthread_mutex_unlock(&L->mu);
    avgpipe__local_table(sub, out);
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_comm_local_create_on(avgpipe_context *ctx, int ranks, const avgpipe_device *device, avgpipe_comm *out) {
    avgpipe__local *L;
    avgpipe_result res;
    if (!out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_comm_local_create: out is NULL");
    memset(out, 0, sizeof *out);
    if (ranks < 1 || ranks > 4096) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "ranks: must be in 1..4096 (got %d)", ranks);
    if (device && (res = avgpipe_device_check(ctx, device)) != AVGPIPE_OK) return res;
    L = avgpipe__local_new(ctx, ranks, device);
    if (!L) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_comm_local_create: out of memory");
    avgpipe__local_table(L, out);
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_comm_local_create(avgpipe_context *ctx, int ranks, avgpipe_comm *out) {
    return avgpipe_comm_local_create_on(ctx, ranks, NULL, out);
}

AVGPIPE_API void avgpipe_comm_destroy(avgpipe_comm *comm) {
    if (!comm) return;
    if (comm->destroy) comm->destroy(comm->user);
    memset(comm, 0, sizeof *comm);
}

AVGPIPE_API avgpipe_result avgpipe_comm_check(avgpipe_context *ctx, const avgpipe_comm *comm) {
    if (!comm) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "comm: NULL table");
    if (!comm->isend || !comm->irecv || !comm->test || !comm->wait || !comm->barrier || !comm->abort)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "comm '%s': isend, irecv, test, wait, barrier and abort are required",
                             comm->name ? comm->name : "?");
    if (comm->size < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "comm '%s': size must be >= 1", comm->name ? comm->name : "?");
    if (!comm->isend_on != !comm->irecv_on || (comm->wait_issued && !comm->isend_on))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "comm '%s': isend_on and irecv_on come together (and wait_issued only with them)",
                             comm->name ? comm->name : "?");
    return AVGPIPE_OK;
}

/* --- 14. Buffer plan; the run's state, message tags, schedule preparation --------------------- */

/* A slot's buffers start at multiples of AVGPIPE__SLOT_ALIGN bytes from its allocation (cudaMalloc's own
   alignment), so that a kernel may load them as float4 or wider: each part's bytes, rounded up. */
#define AVGPIPE__SLOT_ALIGN ((size_t)256)
static size_t avgpipe__slot_part(size_t bytes) { return (bytes + AVGPIPE__SLOT_ALIGN - 1) / AVGPIPE__SLOT_ALIGN * AVGPIPE__SLOT_ALIGN; }

/* ---- the buffer plan (public: the tuner's memory model uses it too) ---- */

AVGPIPE_API void avgpipe_buffer_plan_free(avgpipe_context *ctx, avgpipe_buffer_plan *plan) {
    int r;
    if (!plan) return;
    if (plan->release)
        for (r = 0; r < plan->nranks; r++) avgpipe_free(ctx, plan->release[r]);
    avgpipe_free(ctx, plan->release);
    avgpipe_free(ctx, plan->slots);
    avgpipe_free(ctx, plan->slot_bytes);
    memset(plan, 0, sizeof *plan);
}

/* Slots: a micro-batch takes one on a stage at its first op there (a receive, its forward, or the
   forward of the stage before it on the same rank) and gives it back after its last op there. */
static avgpipe_result avgpipe__plan_slots(avgpipe_context *ctx, const avgpipe_schedule *s, int N, int U, avgpipe_buffer_plan *p) {
    int r, i, j, G = s->nstages;
    size_t cells = (size_t)G * N * U;
    int *lastpos = (int *)avgpipe_alloc(ctx, cells * sizeof(int)), *live = (int *)avgpipe__calloc(ctx, 2 * (size_t)G, sizeof(int));
    int *home = live ? live + G : NULL; /* the rank of each stage */
    unsigned char *seen = (unsigned char *)avgpipe__calloc(ctx, cells, 1);
    for (i = 0; home && i < G; i++) home[i] = avgpipe_stage_rank(s, i);
    if (!lastpos || !live || !seen) {
        avgpipe_free(ctx, lastpos);
        avgpipe_free(ctx, live);
        avgpipe_free(ctx, seen);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory planning the buffers");
    }
#define AVGPIPE__KEY(g, p, u) (((size_t)(g) * N + (size_t)(p)) * U + (size_t)(u))
    for (r = 0; r < s->nranks; r++) {
        for (i = 0; i < s->len[r]; i++) { /* last touch of each key */
            const avgpipe_op *op = &s->ops[r][i];
            int keys[3] = {0, 0, 0}, nk = avgpipe__plan_keys(G, home, r, op, keys);
            for (j = 0; j < nk; j++) lastpos[AVGPIPE__KEY(keys[j], op->pipe, op->micro)] = i;
        }
        for (i = 0; i < s->len[r]; i++) { /* count live slots; mark where they end */
            const avgpipe_op *op = &s->ops[r][i];
            int keys[3] = {0, 0, 0}, nk, none[2], *rel = p->release ? &p->release[r][2 * i] : none;
            rel[0] = rel[1] = -1;
            nk = avgpipe__plan_keys(G, home, r, op, keys);
            for (j = 0; j < nk; j++) {
                size_t k = AVGPIPE__KEY(keys[j], op->pipe, op->micro);
                if (!seen[k]) { /* first touch: take a slot */
                    seen[k] = 1;
                    if (++live[keys[j]] > p->slots[keys[j]]) p->slots[keys[j]] = live[keys[j]];
                }
                if (lastpos[k] == i) {
                    live[keys[j]]--;
                    rel[rel[0] < 0 ? 0 : 1] = keys[j];
                }
            }
        }
    }
#undef AVGPIPE__KEY
    for (i = 0; i < G; i++)
        if (p->slots[i] < 1) p->slots[i] = 1;
    avgpipe_free(ctx, lastpos);
    avgpipe_free(ctx, live);
    avgpipe_free(ctx, seen);
    return AVGPIPE_OK;
}

/* The bytes of one slot of stage g (of G): its input and output activations, and a copy of each that
   crosses to another rank (remote_prev, remote_next), each part rounded up to AVGPIPE__SLOT_ALIGN. */
static size_t avgpipe__plan_slot_bytes(const size_t *act_bytes, int G, int g, int remote_prev, int remote_next) {
    size_t in = g > 0 ? act_bytes[g - 1] : 0, o = g + 1 < G ? act_bytes[g] : 0;
    return avgpipe__slot_part(in) + (remote_next ? avgpipe__slot_part(o) : 0) + avgpipe__slot_part(o) + (remote_prev ? avgpipe__slot_part(in) : 0);
}

static avgpipe_result avgpipe__buffer_plan_in(avgpipe_context *ctx, const avgpipe_schedule *s, const size_t *act_bytes, int release,
                                             avgpipe_buffer_plan *out);

AVGPIPE_API avgpipe_result avgpipe_buffer_plan_build(avgpipe_context *ctx, const avgpipe_schedule *s, const size_t *act_bytes,
                                                    avgpipe_buffer_plan *out) {
    return avgpipe__buffer_plan_in(ctx, s, act_bytes, 1, out);
}

/* avgpipe_buffer_plan_build; release 0: no release tables (the memory model reads the slots alone). */
static avgpipe_result avgpipe__buffer_plan_in(avgpipe_context *ctx, const avgpipe_schedule *s, const size_t *act_bytes, int release,
                                             avgpipe_buffer_plan *out) {
    avgpipe_result res;
    int r, g, N;
    long long U;
    if (!s || !out || !s->len) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_buffer_plan_build: NULL argument");
    memset(out, 0, sizeof *out);
    if (s->nstages > 1 && !act_bytes) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_buffer_plan_build: act_bytes is NULL");
    if (!s->has_comm && s->nranks > 1)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_buffer_plan_build: the schedule has no SEND/RECV ops (lower it first)");
    if ((res = avgpipe__sched_scan(ctx, s, NULL, &N, &U)) != AVGPIPE_OK) return res;
    out->nranks = s->nranks;
    out->nstages = s->nstages;
    out->slots = (int *)avgpipe__calloc(ctx, (size_t)s->nstages, sizeof(int));
    out->slot_bytes = (size_t *)avgpipe__calloc(ctx, (size_t)s->nstages, sizeof(size_t));
    out->release = release ? (int **)avgpipe__calloc(ctx, (size_t)s->nranks, sizeof(int *)) : NULL;
    res = out->slots && out->slot_bytes && (out->release || !release) ? AVGPIPE_OK : AVGPIPE_OUT_OF_MEMORY;
    for (r = 0; r < s->nranks && !res && release; r++)
        if (!(out->release[r] = (int *)avgpipe_alloc(ctx, (2 * (size_t)s->len[r] + 2) * sizeof(int)))) res = AVGPIPE_OUT_OF_MEMORY;
    if (res) {
        avgpipe_buffer_plan_free(ctx, out);
        return avgpipe__fail(ctx, res, "runtime: out of memory planning the buffers");
    }
    for (g = 0; g < s->nstages; g++) {
        int rk = avgpipe_stage_rank(s, g);
        int remote_next = g + 1 < s->nstages && avgpipe_stage_rank(s, g + 1) != rk;
        int remote_prev = g > 0 && avgpipe_stage_rank(s, g - 1) != rk;
        out->slot_bytes[g] = avgpipe__plan_slot_bytes(act_bytes, s->nstages, g, remote_prev, remote_next);
    }
    res = avgpipe__plan_slots(ctx, s, N, (int)U, out);
    if (res) avgpipe_buffer_plan_free(ctx, out);
    return res;
}

/* ---- the run ---- */

typedef struct avgpipe__slot {
    unsigned char *in_act, *out_act, *grad_out, *grad_in;
    avgpipe_comm_request recv_f, recv_b; /* pending receives into in_act / grad_out */
    avgpipe_comm_request send[2];        /* sends still reading out_act / grad_in */
    int send_peer[2];
    int nsend;
    int flow_f, flow_b;                  /* trace flow ids of the pending receives */
    int peer_f, peer_b;                  /* their peers */
    int ordered_f, ordered_b;            /* device-ordered receives: the consumer waited on ev_recv_*, the
                                            request is finished later (slot reuse, iteration end) */
    /* Device events: after the last compute op that touched the slot's buffers (its reuse waits for
       it; a send of its data is ordered after it), and the device-ordered transfers' completions. */
    avgpipe_device_event ev_last, ev_recv_f, ev_recv_b, ev_send[2];
    /* The micro-batch's sizes (desc.variable_bytes): in in_act / grad_out as received or handed over
       by a neighbour on this rank, in out_act / grad_in as the producer set them. */
    size_t in_bytes, out_bytes, gout_bytes, gin_bytes;
    /* Sizes as messages of their own (run->sized): sends still reading zout, receives into zin_*. */
    avgpipe_comm_request zsend[2], zrecv_f, zrecv_b;
    int zsend_peer[2], nzsend;
    uint64_t zout[2], zin_f, zin_b;
} avgpipe__slot;

/* A stage partition of one replica group; only those of local ranks get buffers and averaging. */
typedef struct avgpipe__stage {
    int nslots;
    unsigned char *mem;
    avgpipe__slot *slot;
    int *freeq, fq_head, fq_len; /* free slots, FIFO so a freed slot's sends get time to finish */
    avgpipe_ea *ea;
    int *avg_done; /* [pipe]: rounds whose AVG finished (global count) */
    /* [pipe]: recorded after the pipeline's STEP on its compute stream (its AVG waits for it on the
       averaging stream) and after its averaging pass (its next forward waits for it) */
    avgpipe_device_event *ev_step, *ev_avg;
} avgpipe__stage;

typedef struct avgpipe__job {
    int g, pipe, round;
} avgpipe__job;

typedef struct avgpipe__worker {
    struct avgpipe_run *run;
    int rank, replica, srank; /* global rank = replica * S + srank */
    int started, avg_started, avg_busy;
    /* the watchdog's view: the user callback this worker is in (cb_kind 0: none), since when */
    pthread_mutex_t cbmu;
    int cb_ready, cb_kind, stuck, orphan; /* orphan: left inside a callback by avgpipe_run_destroy */
    avgpipe_op cb_op;
    double cb_since;
    pthread_t thread, avg_thread;
    avgpipe_context ctx, avg_ctx;
    avgpipe_comm group; /* replicas: this stage-rank's D ranks (comm.split) */
    int has_group;
    /* run->sized: the micro-batches' sizes travel on a communicator of their own (comm.split over the
       replica group's S ranks, this worker srank there), so a backend that orders its device-ordered
       and its host messages apart (NCCL's streams) keeps each kind in order */
    avgpipe_comm zcomm;
    int has_zcomm;
    /* ties and step agreement: their communicator (comm.split over the replica group's S ranks, in
       which this worker is srank), the receive buffer of a tie's range, the agreement's tables (by rank
       order, by partition order: [G * wagree] each), its result per pipeline and the round it is of,
       the requests of one exchange ([2 S]), the skipped steps seen in the iteration */
    avgpipe_comm sync;
    int has_sync, counts_skips;
    float *tie_buf;
    float *hstage[2]; /* run->staged: host copies of a partition's gradients ([0], its param_count) and of a tied range ([1]) */
    double *agree_tab, *agreed;
    int *agree_round, *tie_round; /* [N], [N * nties]: the round last agreed, last summed on this rank */
    avgpipe_comm_request *sreq;
    int *speer;
    long long skipped, reseeded; /* reseeded: by the averaging thread, under run->mu */
    avgpipe__job *jobs;
    int jcap, jhead, jlen;
    double busy, loss;
    long long nloss, ops;
    avgpipe_event *ev;
    double *evbytes;
    size_t nev, evcap;
    int *seq, *rseq; /* [P]: messages sent to / received from each rank, for trace flow ids */
    avgpipe_device_stream *cs; /* [N]: a compute stream per parallel pipeline (NULL handles on the CPU) */
    avgpipe_device_stream as;  /* the averaging stream */
    int in_group;              /* between comm.group_begin and group_end */
    /* device-timed profile: a pair of events around each compute op and STEP (npev pairs, used in
       order), the base recorded when the iteration starts, which pair each record used (evdev, parallel
       to ev; -1 for none) */
    avgpipe_device_event *pev, base;
    int npev, upev, cur_pev, *evdev;
    double base_host;
    avgpipe_device_event *ev_end; /* [N]: the end of an iteration on each compute stream */
    avgpipe_device_event ev_pair[2]; /* an overlapped pair of two pipelines: its streams joined and parted */
} avgpipe__worker;

struct avgpipe_run {
    avgpipe_context *ctx;
    avgpipe_run_desc d;
    avgpipe_sched_desc sd;
    avgpipe_schedule given; /* a copy of desc.schedule (d.schedule points here), or empty */
    avgpipe_schedule base, low;
    avgpipe_buffer_plan plan;
    int S, G, N, M, R, U, K;
    int *place, *chunk;   /* [G]: the rank of each stage; its index among that rank's stages */
    int *rst, *roff;      /* [G], [S + 1]: the stages of each stage-rank (AVGPIPE__RANK_STAGES) */
    int D, H, P;          /* replica groups, rounds between their averagings, ranks in all (D·S) */
    int nlocal, all_local;
    size_t *act;          /* [G]: act[g] = bytes at boundary g|g+1 (0 for the last stage) */
    avgpipe_comm comm;
    int own_comm;
    avgpipe_device dev;
    int own_dev;
    int ordered;          /* transfers through comm.isend_on / irecv_on (a device was given and the comm has them) */
    int varb, sized;      /* desc.variable_bytes; and the sizes travel as messages of their own (ordered or
                             comm.exact_bytes: the payload moves at the boundary's maximum) */
    avgpipe_tie *ties;    /* a copy of desc.ties */
    int nties;
    int agreeing, builtin, wagree; /* an agreement; its built-in slots (sumsq, non-finite count) first; doubles per partition */
    int staged;           /* ties or agreement with gradients in device memory: they come to the host to be summed */
    int *excl_start;      /* [G + 1]: the tied ranges partition g leaves out of its sum of squares (it is the */
    size_t *excl;         /* higher-numbered side): excl[2 k] offset, [2 k + 1] count, k in excl_start[g] .. , by offset */
    int timed;            /* profile from device events (desc.profile and the device has event_elapsed) */
    avgpipe__stage *st;   /* [D * G] */
    int *slot_of;         /* [((d * G + g) * N + pipe) * U + micro] */
    avgpipe__worker *w;   /* [nlocal], by ascending global rank */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    long go, done;
    int quit, aborted, dead; /* aborted: set under mu, read lock-free too (AVGPIPE__LOAD) */
    int orphaned;            /* destroyed while a worker was stuck in a callback: that worker frees the run */
    long long ckpt_prev;     /* iteration of the last checkpoint saved or loaded (its files go at the next save); -1 */
    avgpipe_context ctx_copy;
    avgpipe_result abort_res;
    char abort_msg[AVGPIPE_ERROR_MAX];
    long long iter;
    double t0, seconds;
    /* adaptive advance */
    double *win, best;
    int win_n, best_k, adapt_done;
    /* events of the local ranks, gathered on request */
    avgpipe_event *mev;
    double *mbytes;
    size_t mcap;
};

static int avgpipe__run_rank(const avgpipe_run *run, int g) { AVGPIPE_ASSERT(g >= 0 && g < run->G); return run->place[g]; }
/* The stages of stage-rank r: rst[roff[r]] .. rst[roff[r + 1] - 1], ascending. */
#define AVGPIPE__RANK_STAGES(run, r, j, g) for ((j) = (run)->roff[r]; (j) < (run)->roff[(r) + 1] && ((g) = (run)->rst[j]) >= 0; (j)++)
static avgpipe__stage *avgpipe__run_stage(avgpipe_run *run, int replica, int g) { return &run->st[replica * run->G + g]; }
static int avgpipe__run_aborted(const avgpipe_run *run) { return AVGPIPE__LOAD(&run->aborted); }
static float *avgpipe__run_params(const avgpipe_run *run, int replica, int pipe, int g) {
    return run->d.params[((size_t)replica * run->N + (size_t)pipe) * run->G + g];
}
static float *avgpipe__run_grads(const avgpipe_run *run, int replica, int pipe, int g) {
    return run->d.grads ? run->d.grads[((size_t)replica * run->N + (size_t)pipe) * run->G + g] : NULL;
}
static int *avgpipe__slot_key(avgpipe_run *run, int replica, int g, int pipe, int micro) {
    return &run->slot_of[(((size_t)replica * run->G + g) * run->N + pipe) * run->U + micro];
}

/* Under run->mu: record a failure if it is the first (returns 1 then) and wake every waiter. */
static int avgpipe__run_record(avgpipe_run *run, avgpipe_result res, const char *msg) {
    int first = !run->aborted;
    if (first) {
        run->abort_res = res;
        snprintf(run->abort_msg, sizeof run->abort_msg, "%s", msg);
        AVGPIPE__STORE(&run->aborted, 1);
    }
    pthread_cond_broadcast(&run->cv);
    return first;
}
/* After the first failure: the comm backends stop the other ranks (and other processes). */
static void avgpipe__run_abort_comms(avgpipe_run *run, avgpipe_result res, const char *msg) {
    int k;
    if (run->comm.abort) run->comm.abort(run->comm.user, res, msg);
    for (k = 0; k < run->nlocal; k++)
        if (run->w[k].has_group) run->w[k].group.abort(run->w[k].group.user, res, msg);
    for (k = 0; k < run->nlocal; k++)
        if (run->w[k].has_sync) run->w[k].sync.abort(run->w[k].sync.user, res, msg);
    for (k = 0; k < run->nlocal; k++)
        if (run->w[k].has_zcomm) run->w[k].zcomm.abort(run->w[k].zcomm.user, res, msg);
}

/* First failure wins: it is recorded, every waiter wakes, the comm backend aborts the other ranks. */
static avgpipe_result avgpipe__run_fail(avgpipe_run *run, avgpipe_result res, const char *fmt, ...) {
    va_list ap;
    char msg[AVGPIPE_ERROR_MAX];
    int first;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&run->mu);
    first = avgpipe__run_record(run, res, msg);
    pthread_mutex_unlock(&run->mu);
    if (first) avgpipe__run_abort_comms(run, res, msg);
    return res;
}

/* ---- message tags: what a message is, checked by the receive ---- */

#define AVGPIPE__TAG_CTL (1u << 30) /* control messages (agreement, gathers) use tags from here */

/* The tag of the message stage `from` sends to its neighbour: dir 0 an activation (SEND_F), 1 a
   gradient (SEND_B), of (pipe, micro) in an iteration of this parity. Below AVGPIPE__TAG_CTL. */
/* A message's identity v folded into a data tag, 1 .. AVGPIPE__TAG_CTL - 1 (0 is never a tag). */
static uint32_t avgpipe__tag_fold(uint64_t v) { return (uint32_t)(v % (AVGPIPE__TAG_CTL - 1)) + 1; }
static uint32_t avgpipe__data_tag(const avgpipe_run *run, int dir, int pipe, int from, int micro) {
    return avgpipe__tag_fold(((((uint64_t)(run->iter & 1) * (uint64_t)run->U + (uint64_t)micro) * (uint64_t)run->N + (uint64_t)pipe) *
                                  (uint64_t)run->G + (uint64_t)from) * 2u + (uint64_t)dir);
}

/* The tag of the 8-byte message that carries the size of data_tag's message (run->sized). */
#define AVGPIPE__TAG_SIZE (3u << 29)
static uint32_t avgpipe__size_tag(uint32_t data_tag) { return AVGPIPE__TAG_SIZE | (data_tag & (AVGPIPE__TAG_SIZE / 3u - 1u)); }

/* The op a data tag names, as text ("0:2SEND_F5"), when the tags of this shape are unambiguous. */
static void avgpipe__tag_text(const avgpipe_run *run, uint32_t tag, char *out, size_t cap) {
    uint64_t v = (uint64_t)tag - 1, range = (uint64_t)run->U * run->N * run->G * 4;
    avgpipe_op op;
    int dir;
    if ((tag & AVGPIPE__TAG_SIZE) == AVGPIPE__TAG_SIZE && range < AVGPIPE__TAG_SIZE / 3u) { /* a size message: of which data message */
        size_t n = (size_t)snprintf(out, cap, "the size of ");
        if (n < cap) avgpipe__tag_text(run, tag & (AVGPIPE__TAG_SIZE / 3u - 1u), out + n, cap - n);
        return;
    }
    if (tag == 0 || tag >= AVGPIPE__TAG_CTL || range >= AVGPIPE__TAG_CTL - 1) {
        snprintf(out, cap, "%s message (tag %u)", tag >= AVGPIPE__TAG_CTL ? "a control" : "an unknown", (unsigned)tag);
        return;
    }
    dir = (int)(v % 2), v /= 2;
    op = avgpipe__op(dir ? AVGPIPE_OP_SEND_B : AVGPIPE_OP_SEND_F, 0, (int)(v % (uint64_t)run->G), 0);
    v /= (uint64_t)run->G;
    op.pipe = (int16_t)(v % (uint64_t)run->N), v /= (uint64_t)run->N;
    op.micro = (int)(v % (uint64_t)run->U), v /= (uint64_t)run->U;
    avgpipe_op_format(&op, 1, out, cap);
    if (v != (uint64_t)(run->iter & 1)) {
        size_t n = strlen(out);
        snprintf(out + n, cap - n, " of the %s iteration", v ? "next or previous" : "previous or next");
    }
}

/* ---- schedule preparation ---- */

/* A schedule without STEP ops (e.g. an imported PyTorch file) gets STEP and AVG after the last
   backward work of each (pipeline, stage, round). */
static avgpipe_result avgpipe__add_steps(avgpipe_context *ctx, avgpipe_schedule *s) {
    int r, i, M = s->shape.micro, R = s->shape.rounds, N = s->shape.pipes, G = s->nstages;
    int *last = NULL;
    avgpipe_result res = AVGPIPE_OK;
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++)
            if (s->ops[r][i].kind == AVGPIPE_OP_STEP) return AVGPIPE_OK;
    last = (int *)avgpipe__calloc(ctx, (size_t)N * G * R, sizeof(int));
    if (!last) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory");
    for (r = 0; r < s->nranks && !res; r++) {
        avgpipe_op *old = s->ops[r];
        int n = s->len[r], k;
        for (k = 0; k < N * G * R; k++) last[k] = -1;
        for (i = 0; i < n; i++) {
            const avgpipe_op *op = &old[i];
            if ((op->kind == AVGPIPE_OP_B || op->kind == AVGPIPE_OP_W) && op->micro >= 0 && op->micro < M * R && op->pipe < N)
                last[(op->pipe * G + op->stage) * R + op->micro / M] = i;
        }
        s->ops[r] = NULL;
        s->len[r] = 0;
        res = avgpipe__sched_reserve(ctx, s, r, (size_t)n + 2 * (size_t)N * G * R);
        for (i = 0; i < n && !res; i++) {
            const avgpipe_op *op = &old[i];
            s->ops[r][s->len[r]++] = *op;
            if ((op->kind == AVGPIPE_OP_B || op->kind == AVGPIPE_OP_W) && op->micro >= 0 && op->micro < M * R && op->pipe < N &&
                last[(op->pipe * G + op->stage) * R + op->micro / M] == i) {
                s->ops[r][s->len[r]++] = avgpipe__op(AVGPIPE_OP_STEP, op->pipe, op->stage, op->micro / M);
                s->ops[r][s->len[r]++] = avgpipe__op(AVGPIPE_OP_AVG, op->pipe, op->stage, op->micro / M);
            }
        }
        avgpipe_free(ctx, old);
    }
    avgpipe_free(ctx, last);
    return res;
}

/* The schedule a run executes: desc's own (copied) or generated for sd with K, STEP/AVG added where
   missing, validated (a generated one is valid by construction unless `check`), lowered. */
/* The run's ties and agreement as avgpipe_sched_add_sync takes them; NULL when it has neither. */
static const avgpipe_sync_desc *avgpipe__run_sync_desc(const avgpipe_run *run, avgpipe_sync_desc *out) {
    memset(out, 0, sizeof *out);
    out->ties = run->ties;
    out->nties = run->nties;
    out->agree = run->agreeing;
    return run->nties || run->agreeing ? out : NULL;
}

/* A schedule's sync ops against the run's ties and agreement: none yet -> placed (avgpipe_sched_add_sync,
   which needs it compute-only); some -> every TIE op's pair is a tie of desc.ties and back, AGREE
   ops present exactly when desc.agree asks for them. */
static avgpipe_result avgpipe__run_sync_ops(avgpipe_context *ctx, const avgpipe_sync_desc *sync, avgpipe_schedule *base) {
    int r, i, t, nsync = 0, agree = 0, fr = -1, fi = -1;
    avgpipe_schedule out;
    avgpipe_result res;
    for (r = 0; r < base->nranks; r++)
        for (i = 0; i < base->len[r]; i++) {
            const avgpipe_op *op = &base->ops[r][i];
            if (!avgpipe__is_sync(op->kind)) continue;
            if (!nsync++) fr = r, fi = i;
            if (op->kind == AVGPIPE_OP_AGREE) {
                agree = 1;
                continue;
            }
            for (t = 0; sync && t < sync->nties; t++)
                if ((sync->ties[t].stage_a == op->stage && sync->ties[t].stage_b == op->peer) ||
                    (sync->ties[t].stage_b == op->stage && sync->ties[t].stage_a == op->peer))
                    break;
            if (sync && t == sync->nties)
                return avgpipe__fail(ctx, AVGPIPE_MISMATCH, "schedule: rank %d position %d ties stages %d and %d, which desc.ties does not", r, i, op->stage, op->peer);
        }
    if (!nsync) {
        if (!sync) return AVGPIPE_OK;
        if (base->has_comm)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "schedule: lowered and without TIE/AGREE ops while desc.ties or desc.agree is set: give it "
                                 "compute-only (the run places them) or with them (avgpipe_sched_add_sync, then avgpipe_sched_lower)");
        if ((res = avgpipe_sched_add_sync(ctx, base, sync, &out)) != AVGPIPE_OK) return res;
        avgpipe_sched_free(ctx, base);
        *base = out;
        return AVGPIPE_OK;
    }
    if (!sync)
        return avgpipe__fail(ctx, AVGPIPE_MISMATCH, "schedule: rank %d position %d is a %s op, but desc.ties and desc.agree are empty", fr, fi,
                             avgpipe_op_kind_name((avgpipe_op_kind)base->ops[fr][fi].kind));
    if (agree != sync->agree)
        return avgpipe__fail(ctx, AVGPIPE_MISMATCH, "schedule: %s AGREE ops while desc.agree %s", agree ? "has" : "has no",
                             agree ? "asks for none" : "asks for an agreement");
    for (t = 0; t < sync->nties; t++) { /* every tie has its ops */
        for (r = 0; r < base->nranks; r++) {
            for (i = 0; i < base->len[r]; i++) {
                const avgpipe_op *op = &base->ops[r][i];
                if (op->kind == AVGPIPE_OP_TIE && op->stage == sync->ties[t].stage_a && op->peer == sync->ties[t].stage_b) break;
            }
            if (i < base->len[r]) break;
        }
        if (r == base->nranks)
            return avgpipe__fail(ctx, AVGPIPE_MISMATCH, "schedule: no TIE op of stage %d with stage %d (desc.ties[%d])", sync->ties[t].stage_a,
                                 sync->ties[t].stage_b, t);
    }
    return AVGPIPE_OK;
}

/* The run's schedule (base: generated, or a copy of the one given; its STEP/AVG and sync ops placed)
   and its lowered form. own (may be NULL): the schedule generation would give, already generated (its
   sync ops may be placed already: they are checked against sync as a given schedule's are): taken (*own
   is emptied) instead of generating again. low NULL: base only, not lowered. */
static avgpipe_result avgpipe__run_schedules_own(avgpipe_context *ctx, const avgpipe_schedule *given, const avgpipe_sched_desc *sd, int K,
                                                 int check, const avgpipe_sync_desc *sync, avgpipe_schedule *own, avgpipe_schedule *base,
                                                 avgpipe_schedule *low) {
    avgpipe_validate_report rep;
    avgpipe_result res;
    if (low) memset(low, 0, sizeof *low);
    if (given) res = avgpipe_sched_copy(ctx, given, base);
    else if (own) {
        *base = *own;
        memset(own, 0, sizeof *own);
        res = AVGPIPE_OK;
    } else {
        avgpipe_sched_desc d = *sd;
        d.advance = K;
        res = avgpipe_sched_generate(ctx, &d, base);
    }
    if (res) return res;
    res = avgpipe__add_steps(ctx, base);
    if (!res) res = avgpipe__run_sync_ops(ctx, sync, base);
    if (!res && (check || given) && (res = avgpipe_sched_validate(ctx, base, NULL, &rep)) != AVGPIPE_OK)
        res = avgpipe__fail(ctx, res, "runtime: the schedule is not valid: %s", rep.message);
    if (!res && low) res = base->has_comm ? avgpipe_sched_copy(ctx, base, low) : avgpipe_sched_lower(ctx, base, low);
    if (res) avgpipe_sched_free(ctx, base);
    return res;
}

static avgpipe_result avgpipe__run_schedules(avgpipe_context *ctx, const avgpipe_schedule *given, const avgpipe_sched_desc *sd, int K,
                                             int check, const avgpipe_sync_desc *sync, avgpipe_schedule *base, avgpipe_schedule *low) {
    return avgpipe__run_schedules_own(ctx, given, sd, K, check, sync, NULL, base, low);
}

static void avgpipe__free_buffer_plan(avgpipe_run *run) {
    int k;
    avgpipe_buffer_plan_free(run->ctx, &run->plan);
    if (run->st)
        for (k = 0; k < run->D * run->G; k++) {
            avgpipe__stage *st = &run->st[k];
            int q, e;
            for (q = 0; st->slot && q < st->nslots; q++) {
                avgpipe_device_event *ev[5];
                ev[0] = &st->slot[q].ev_last, ev[1] = &st->slot[q].ev_recv_f, ev[2] = &st->slot[q].ev_recv_b;
                ev[3] = &st->slot[q].ev_send[0], ev[4] = &st->slot[q].ev_send[1];
                for (e = 0; e < 5; e++)
                    if (*ev[e]) run->dev.event_destroy(run->dev.user, *ev[e]);
            }
            if (st->mem) run->dev.free(run->dev.user, st->mem);
            avgpipe_free(run->ctx, run->st[k].slot);
            avgpipe_free(run->ctx, run->st[k].freeq);
            run->st[k].mem = NULL;
            run->st[k].slot = NULL;
            run->st[k].freeq = NULL;
            run->st[k].nslots = 0;
        }
    avgpipe_free(run->ctx, run->slot_of);
    run->slot_of = NULL;
    avgpipe_sched_free(run->ctx, &run->low);
    avgpipe_sched_free(run->ctx, &run->base);
}

/* Give stage g of a replica group its slot buffers, laid out as the plan says. */
static avgpipe_result avgpipe__alloc_stage(avgpipe_run *run, int replica, int g) {
    avgpipe__stage *st = avgpipe__run_stage(run, replica, g);
    int i, r = avgpipe__run_rank(run, g);
    size_t in = g > 0 ? run->act[g - 1] : 0, out = run->act[g], sz = run->plan.slot_bytes[g];
    int remote_next = g + 1 < run->G && avgpipe__run_rank(run, g + 1) != r;
    avgpipe_result res = AVGPIPE_OK;
    void *mem = NULL;
    st->nslots = run->plan.slots[g];
    if (sz && (res = run->dev.alloc(run->dev.user, sz * (size_t)st->nslots, &mem)) != AVGPIPE_OK) /* exactly the plan's bytes */
        return avgpipe__fail(run->ctx, res, "runtime: device '%s' cannot allocate %zu bytes for stage %d's buffers: %s", run->dev.name,
                             sz * (size_t)st->nslots, g, run->dev.error_string ? run->dev.error_string(run->dev.user) : "");
    st->mem = (unsigned char *)mem;
    st->slot = (avgpipe__slot *)avgpipe__calloc(run->ctx, (size_t)st->nslots, sizeof(avgpipe__slot));
    st->freeq = (int *)avgpipe__calloc(run->ctx, (size_t)st->nslots, sizeof(int));
    if (!st->slot || !st->freeq) return avgpipe__fail(run->ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory for stage %d buffers", g);
    for (i = 0; i < st->nslots && !res; i++) {
        avgpipe__slot *sl = &st->slot[i];
        avgpipe_device_event *ev[5];
        int e;
        ev[0] = &sl->ev_last, ev[1] = &sl->ev_recv_f, ev[2] = &sl->ev_recv_b, ev[3] = &sl->ev_send[0], ev[4] = &sl->ev_send[1];
        for (e = 0; e < 5 && !res; e++) res = run->dev.event_create(run->dev.user, ev[e]);
    }
    if (res)
        return avgpipe__fail(run->ctx, res, "runtime: device '%s' cannot create events for stage %d: %s", run->dev.name, g,
                             run->dev.error_string ? run->dev.error_string(run->dev.user) : "");
    for (i = 0; st->mem && i < st->nslots; i++) { /* no bytes: every buffer stays NULL; each starts at a multiple of 256 */
        unsigned char *p = st->mem + (size_t)i * sz;
        avgpipe__slot *sl = &st->slot[i];
        sl->in_act = in ? p : NULL;
        p += avgpipe__slot_part(in);
        sl->out_act = remote_next && out ? p : NULL;
        p += remote_next ? avgpipe__slot_part(out) : 0;
        sl->grad_out = out ? p : NULL;
        p += avgpipe__slot_part(out);
        sl->grad_in = g > 0 && avgpipe__run_rank(run, g - 1) != r && in ? p : NULL;
    }
    return AVGPIPE_OK;
}

/* Build (or rebuild, when K changes) everything that depends on the schedule. */
static avgpipe_result avgpipe__run_prepare(avgpipe_run *run) {
    avgpipe_context *ctx = run->ctx;
    avgpipe_result res;
    int j;
    int k, g;
    avgpipe_sync_desc sy;
    avgpipe__free_buffer_plan(run);
    res = avgpipe__run_schedules(ctx, run->d.schedule, &run->sd, run->K, 1, avgpipe__run_sync_desc(run, &sy), &run->base, &run->low);
    if (res) return res;
    run->M = run->base.shape.micro;
    run->R = run->base.shape.rounds;
    run->U = run->M * run->R;
    if ((res = avgpipe_buffer_plan_build(ctx, &run->low, run->act, &run->plan)) != AVGPIPE_OK) return res;
    run->slot_of = (int *)avgpipe_alloc(ctx, (size_t)run->D * run->G * run->N * run->U * sizeof(int));
    if (!run->slot_of) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory");
    for (k = 0; k < run->nlocal && !res; k++)
        AVGPIPE__RANK_STAGES(run, run->w[k].srank, j, g) if (!res) res = avgpipe__alloc_stage(run, run->w[k].replica, g);
    return res;
}

/* A local rank's streams (one compute stream per parallel pipeline, one for averaging) and events. */
static avgpipe_result avgpipe__worker_streams(avgpipe_run *run, avgpipe__worker *w) {
    avgpipe_result res = AVGPIPE_OK;
    int p;
    w->cs = (avgpipe_device_stream *)avgpipe__calloc(run->ctx, (size_t)run->N, sizeof *w->cs);
    w->ev_end = (avgpipe_device_event *)avgpipe__calloc(run->ctx, (size_t)run->N, sizeof *w->ev_end);
    if (!w->cs || !w->ev_end) return avgpipe__fail(run->ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory");
    for (p = 0; p < run->N && !res; p++) {
        res = run->dev.stream_create(run->dev.user, &w->cs[p]);
        if (!res) res = run->dev.event_create(run->dev.user, &w->ev_end[p]);
    }
    for (p = 0; p < 2 && !res; p++) res = run->dev.event_create(run->dev.user, &w->ev_pair[p]);
    if (!res) res = run->dev.stream_create(run->dev.user, &w->as);
    if (!res && run->timed) res = run->dev.event_create(run->dev.user, &w->base);
    if (res)
        return avgpipe__fail(run->ctx, res, "runtime: device '%s' cannot create rank %d's streams: %s", run->dev.name, w->rank,
                             run->dev.error_string ? run->dev.error_string(run->dev.user) : "");
    return AVGPIPE_OK;
}

static void avgpipe__worker_streams_free(avgpipe_run *run, avgpipe__worker *w) {
    int p;
    for (p = 0; p < 2 * w->npev; p++)
        if (w->pev[p]) run->dev.event_destroy(run->dev.user, w->pev[p]);
    for (p = 0; w->cs && p < run->N; p++) {
        if (w->cs[p]) run->dev.stream_destroy(run->dev.user, w->cs[p]);
        if (w->ev_end[p]) run->dev.event_destroy(run->dev.user, w->ev_end[p]);
    }
    for (p = 0; p < 2; p++)
        if (w->ev_pair[p]) run->dev.event_destroy(run->dev.user, w->ev_pair[p]), w->ev_pair[p] = NULL;
    if (w->as) run->dev.stream_destroy(run->dev.user, w->as);
    if (w->base) run->dev.event_destroy(run->dev.user, w->base);
    avgpipe_free(run->ctx, w->pev);
    avgpipe_free(run->ctx, w->cs);
    avgpipe_free(run->ctx, w->ev_end);
    avgpipe_free(run->ctx, w->evdev);
    w->pev = NULL, w->cs = NULL, w->ev_end = NULL, w->evdev = NULL, w->as = NULL, w->base = NULL, w->npev = 0;
}

/* Free everything a run owns; its threads have ended (or this is the last of them, see below). */
static void avgpipe__run_free(avgpipe_run *run) {
    avgpipe_context *ctx = run->ctx;
    int k, g, p;
    for (k = 0; run->w && k < run->nlocal; k++) { /* the device's work first (after a failure some may be queued) */
        avgpipe__worker *w = &run->w[k];
        for (p = 0; w->cs && p < run->N; p++)
            if (w->cs[p]) run->dev.stream_synchronize(run->dev.user, w->cs[p]);
        if (w->as) run->dev.stream_synchronize(run->dev.user, w->as);
    }
    if (run->st) /* then the averaging modules, whose last event may be on a worker's averaging stream */
        for (g = 0; g < run->D * run->G; g++) {
            avgpipe_ea_destroy(run->st[g].ea);
            for (p = 0; run->st[g].ev_step && p < 2 * run->N; p++)
                if (run->st[g].ev_step[p]) run->dev.event_destroy(run->dev.user, run->st[g].ev_step[p]);
            avgpipe_free(ctx, run->st[g].avg_done);
            avgpipe_free(ctx, run->st[g].ev_step);
        }
    for (k = 0; run->w && k < run->nlocal; k++) {
        avgpipe__worker *w = &run->w[k];
        avgpipe__worker_streams_free(run, w);
        avgpipe_free(ctx, w->jobs);
        avgpipe_free(ctx, w->seq);
        avgpipe_free(ctx, w->rseq);
        avgpipe_free(ctx, w->ev);
        avgpipe_free(ctx, w->evbytes);
        avgpipe_free(ctx, w->tie_buf);
        avgpipe_free(ctx, w->hstage[0]);
        avgpipe_free(ctx, w->hstage[1]);
        avgpipe_free(ctx, w->agree_tab);
        avgpipe_free(ctx, w->agree_round);
        avgpipe_free(ctx, w->tie_round);
        avgpipe_free(ctx, w->sreq);
        avgpipe_free(ctx, w->speer);
        if (w->cb_ready) pthread_mutex_destroy(&w->cbmu);
    }
    avgpipe__free_buffer_plan(run);
    avgpipe_free(ctx, run->ties);
    avgpipe_free(ctx, run->excl_start);
    avgpipe_free(ctx, run->excl);
    avgpipe_sched_free(ctx, &run->given);
    if (run->own_comm) avgpipe_comm_destroy(&run->comm);
    if (run->own_dev) avgpipe_device_destroy(&run->dev);
    avgpipe_free(ctx, run->st);
    avgpipe_free(ctx, run->w);
    avgpipe_free(ctx, run->act);
    avgpipe_free(ctx, run->place);
    avgpipe_free(ctx, run->win);
    avgpipe_free(ctx, run->mev);
    avgpipe_free(ctx, run->mbytes);
    pthread_mutex_destroy(&run->mu);
    pthread_cond_destroy(&run->cv);
    avgpipe_free(ctx, run);
}

AVGPIPE_API long long avgpipe_run_iterations(const avgpipe_run *run) { return run ? run->iter : 0; }

AVGPIPE_API int avgpipe_run_is_local(const avgpipe_run *run, int rank) {
    int lo = 0, hi;
    if (!run || rank < 0 || rank >= run->P) return 0;
    if (run->all_local) return 1;
    hi = run->nlocal - 1;
    while (lo <= hi) { /* the workers are sorted by rank */
        int mid = (lo + hi) / 2;
        if (run->w[mid].rank == rank) return 1;
        if (run->w[mid].rank < rank) lo = mid + 1;
        else hi = mid - 1;
    }
    return 0;
}

AVGPIPE_API const float *avgpipe_run_replica_reference(avgpipe_run *run, int replica, int stage, size_t *count) {
    if (!run || stage < 0 || stage >= run->G || replica < 0 || replica >= run->D) return NULL;
    if (!avgpipe_run_is_local(run, replica * run->S + avgpipe__run_rank(run, stage))) return NULL;
    if (count) *count = run->d.param_count[stage];
    return avgpipe_ea_reference(avgpipe__run_stage(run, replica, stage)->ea, NULL);
}

AVGPIPE_API const float *avgpipe_run_reference(avgpipe_run *run, int stage, size_t *count) {
    int d;
    if (!run) return NULL;
    for (d = 0; d < run->D; d++)
        if (avgpipe_run_is_local(run, d * run->S + avgpipe__run_rank(run, stage))) return avgpipe_run_replica_reference(run, d, stage, count);
    return NULL;
}

AVGPIPE_API const avgpipe_schedule *avgpipe_run_schedule(const avgpipe_run *run) { return run ? &run->low : NULL; }

AVGPIPE_API int avgpipe_run_slots(const avgpipe_run *run, int stage) {
    return run && stage >= 0 && stage < run->G ? run->plan.slots[stage] : -1;
}

/* --- 15. Execution: waits, slots, callbacks, the compute and comm ops ------------------------- */

static int avgpipe__record(avgpipe__worker *w, const avgpipe_op *op, int track, int peer, int flow, double a, double b, double bytes) {
    avgpipe_run *run = w->run;
    if (!run->d.profile) return 1;
    if (w->nev == w->evcap) {
        size_t cap = w->evcap ? 2 * w->evcap : 1024;
        avgpipe_event *e = (avgpipe_event *)avgpipe__realloc(run->ctx, w->ev, w->nev * sizeof *e, cap * sizeof *e);
        double *bb;
        int *dd;
        if (!e) return 0;
        w->ev = e;
        bb = (double *)avgpipe__realloc(run->ctx, w->evbytes, w->nev * sizeof *bb, cap * sizeof *bb);
        if (!bb) return 0;
        w->evbytes = bb;
        dd = (int *)avgpipe__realloc(run->ctx, w->evdev, w->nev * sizeof *dd, cap * sizeof *dd);
        if (!dd) return 0;
        w->evdev = dd;
        w->evcap = cap;
    }
    w->evdev[w->nev] = track == 0 ? w->cur_pev : -1;
    if (track == 0) w->cur_pev = -1;
    w->ev[w->nev].op = *op;
    w->ev[w->nev].rank = w->rank;
    w->ev[w->nev].track = track;
    w->ev[w->nev].peer = peer;
    w->ev[w->nev].flow = flow;
    w->ev[w->nev].start = a - run->t0;
    w->ev[w->nev].end = b - run->t0;
    w->evbytes[w->nev] = bytes;
    w->nev++;
    return 1;
}

/* Device-timed profiles: record the start of an op on its stream (w->cur_pev names the pair for the
   op's record); nothing unless run->timed. Pairs are created as needed and reused every iteration. */
static avgpipe_result avgpipe__prof_begin(avgpipe__worker *w, avgpipe_device_stream stream) {
    avgpipe_run *run = w->run;
    avgpipe_result res;
    w->cur_pev = -1;
    if (!run->timed) return AVGPIPE_OK;
    if (w->upev == w->npev) {
        int cap = w->npev ? 2 * w->npev : 256, i;
        avgpipe_device_event *p = (avgpipe_device_event *)avgpipe__realloc(run->ctx, w->pev, 2 * (size_t)w->npev * sizeof *p, 2 * (size_t)cap * sizeof *p);
        if (!p) return avgpipe__run_fail(run, AVGPIPE_OUT_OF_MEMORY, "rank %d: out of memory for the profile", w->rank);
        w->pev = p;
        for (i = 2 * w->npev; i < 2 * cap; i++) {
            if ((res = run->dev.event_create(run->dev.user, &w->pev[i])) != AVGPIPE_OK) {
                w->npev = i / 2;
                return avgpipe__run_fail(run, res, "rank %d: device '%s': creating profile events failed: %s", w->rank, run->dev.name,
                                         run->dev.error_string ? run->dev.error_string(run->dev.user) : "");
            }
        }
        w->npev = cap;
    }
    if ((res = run->dev.event_record(run->dev.user, w->pev[2 * w->upev], stream)) != AVGPIPE_OK)
        return avgpipe__run_fail(run, res, "rank %d: device '%s': recording a profile event failed", w->rank, run->dev.name);
    w->cur_pev = w->upev++;
    return AVGPIPE_OK;
}
static avgpipe_result avgpipe__prof_end(avgpipe__worker *w, avgpipe_device_stream stream) {
    avgpipe_run *run = w->run;
    if (w->cur_pev < 0 || run->dev.event_record(run->dev.user, w->pev[2 * w->cur_pev + 1], stream) == AVGPIPE_OK) return AVGPIPE_OK;
    return avgpipe__run_fail(run, AVGPIPE_BACKEND_ERROR, "rank %d: device '%s': recording a profile event failed", w->rank, run->dev.name);
}

static avgpipe_result avgpipe__profile_oom(avgpipe__worker *w) {
    return avgpipe__run_fail(w->run, AVGPIPE_OUT_OF_MEMORY, "rank %d: out of memory for the profile", w->rank);
}

/* The watchdog: a worker that has been inside one user callback for longer than `limit` seconds stops
   the run (AVGPIPE_TIMEOUT naming the rank and the op) and is not waited for any more. Returns 1 when it
   found one. The driving thread checks against the timeout; a wait that timed out checks against half of
   it first, so that the stuck callback, not the wait it caused, is what the error names. */
static int avgpipe__watchdog(avgpipe_run *run, double limit) {
    int k, found = 0, first = 0;
    double now = avgpipe__now();
    char msg[AVGPIPE_ERROR_MAX];
    pthread_mutex_lock(&run->mu); /* one finder records the failure; the others see it found */
    for (k = 0; k < run->nlocal && !found; k++) {
        avgpipe__worker *w = &run->w[k];
        avgpipe_op op;
        double since;
        int kind;
        char txt[64];
        pthread_mutex_lock(&w->cbmu);
        kind = w->cb_kind, op = w->cb_op, since = w->cb_since;
        pthread_mutex_unlock(&w->cbmu);
        if (w->stuck) found = 1;
        if (!kind || w->stuck || now - since <= limit) continue;
        found = w->stuck = 1;
        avgpipe_op_format(&op, 1, txt, sizeof txt);
        snprintf(msg, sizeof msg, "rank %d, op %s: the %s callback has been running for %.1f s (timeout %.3g s); the run is stopped "
                 "and its thread left inside the callback (see avgpipe_run_destroy)", w->rank, txt,
                 avgpipe_op_kind_name((avgpipe_op_kind)kind), now - since, run->d.timeout_s);
        first = avgpipe__run_record(run, AVGPIPE_TIMEOUT, msg);
    }
    pthread_mutex_unlock(&run->mu);
    if (first) avgpipe__run_abort_comms(run, AVGPIPE_TIMEOUT, msg);
    return found;
}

/* Wait for *req (a request of op, with `peer`); *req becomes NULL once the backend released it (on
   AVGPIPE_TIMEOUT and AVGPIPE_ABORTED it stays pending: the run cancels it when it stops). `expect`:
   for a receive, the tag it expects (for the message on a mismatch), else 0. */
/* Wait for *req on comm c (as rank `self` there; peer is global, for the messages). */
static avgpipe_result avgpipe__comm_wait_in(avgpipe__worker *w, const avgpipe_comm *c, int self, avgpipe_comm_request *req, const avgpipe_op *op,
                                            int peer, uint32_t expect, const char *what, size_t *bytes) {
    avgpipe_run *run = w->run;
    avgpipe_comm_status st;
    avgpipe_result res;
    char txt[64], want[96], got[96];
    memset(&st, 0, sizeof st);
    res = c->wait(c->user, self, *req, run->d.timeout_s, &st);
    if (res != AVGPIPE_TIMEOUT && res != AVGPIPE_ABORTED) *req = NULL;
    if (bytes) *bytes = st.bytes;
    if (!res) return AVGPIPE_OK;
    if (res == AVGPIPE_ABORTED && avgpipe__run_aborted(run)) return res; /* this process's own failure says why */
    avgpipe_op_format(op, 1, txt, sizeof txt);
    if (res == AVGPIPE_TIMEOUT && avgpipe__watchdog(run, 0.5 * run->d.timeout_s)) return res; /* a local callback is the cause */
    if (res == AVGPIPE_ABORTED) /* another process stopped: say what this rank was waiting for, and why it stopped */
        return avgpipe__run_fail(run, res, "rank %d, op %s: %s rank %d: stopped: %s", w->rank, txt, what, peer,
                                 c->last_error ? c->last_error(c->user, self) : "aborted");
    if (res == AVGPIPE_MISMATCH && expect) {
        avgpipe__tag_text(run, expect, want, sizeof want);
        avgpipe__tag_text(run, st.tag, got, sizeof got);
        return avgpipe__run_fail(run, res, "rank %d, op %s: %s rank %d: expected the message of %s, received that of %s (%zu bytes): "
                                 "a message between ranks %d and %d was lost, duplicated or reordered", w->rank, txt, what, peer, want,
                                 got, st.bytes, peer, w->rank);
    }
    return avgpipe__run_fail(run, res, "rank %d, op %s: %s rank %d %s (%s)", w->rank, txt, what, peer,
                             res == AVGPIPE_TIMEOUT ? "timed out" : "failed",
                             res == AVGPIPE_TIMEOUT ? "no data within the timeout: is that process alive?"
                                                    : (c->last_error ? c->last_error(c->user, self) : ""));
}
static avgpipe_result avgpipe__comm_wait(avgpipe__worker *w, avgpipe_comm_request *req, const avgpipe_op *op, int peer, uint32_t expect,
                                         const char *what, size_t *bytes) {
    return avgpipe__comm_wait_in(w, &w->run->comm, w->rank, req, op, peer, expect, what, bytes);
}

/* Wait for the sends that still read slot sl's buffers. */
/* A test build may leave out one of the runtime's device waits (AVGPIPE_TEST_SKIP_WAIT = its number
   below) to check that the tests notice; never define it otherwise. */
#ifndef AVGPIPE_TEST_SKIP_WAIT
#define AVGPIPE_TEST_SKIP_WAIT 0
#endif
enum {
    AVGPIPE__WAIT_SLOT_REUSE = 1, /* host: a slot's buffers are free once its last op ran */
    AVGPIPE__WAIT_AVG_BEFORE_F,   /* device: a pipeline's forward after its averaging pass */
    AVGPIPE__WAIT_STEP_BEFORE_AVG,/* device: the averaging pass after the pipeline's STEP */
    AVGPIPE__WAIT_SEND_AFTER_OP,  /* host: a host-side send after the op that produced its data */
    AVGPIPE__WAIT_RECV_BEFORE_OP, /* device: the consumer after a device-ordered receive */
    AVGPIPE__WAIT_BACKWARD_BEFORE_STEP, /* host: a host-side step() after the round's backward work */
    AVGPIPE__WAIT_ITERATION_END   /* host: every stream at the end of an iteration */
};
#define AVGPIPE__WAITS(which) (AVGPIPE_TEST_SKIP_WAIT != (which))

/* The device's text for a failed entry, as the run's failure. */
static avgpipe_result avgpipe__dev_fail(avgpipe__worker *w, avgpipe_result res, const avgpipe_op *op, const char *what) {
    avgpipe_run *run = w->run;
    char txt[64];
    if (res == AVGPIPE_ABORTED && avgpipe__run_aborted(run)) return res;
    avgpipe_op_format(op, 1, txt, sizeof txt);
    return avgpipe__run_fail(run, res, "rank %d, op %s: device '%s': %s failed: %s", w->rank, txt, run->dev.name ? run->dev.name : "?", what,
                             run->dev.error_string ? run->dev.error_string(run->dev.user) : "");
}

/* Wait on the host until the device passed `ev`, at most timeout_s (polling event_query, sleeping on
   the run's condition so that a failure elsewhere ends the wait; without event_query the device's
   event_synchronize, unbounded). AVGPIPE_TIMEOUT, AVGPIPE_ABORTED, or the device's error. */
static avgpipe_result avgpipe__event_wait(avgpipe_run *run, avgpipe_device_event ev, double timeout_s) {
    double t0 = avgpipe__now(), nap = 20e-6;
    int done = 0;
    avgpipe_result res;
    if (!ev) return AVGPIPE_OK; /* the CPU device: its work finished when the call returned */
    if (!run->dev.event_query) return run->dev.event_synchronize(run->dev.user, ev);
    for (;;) {
        struct timespec dl;
        if ((res = run->dev.event_query(run->dev.user, ev, &done)) != AVGPIPE_OK) return res;
        if (done) return AVGPIPE_OK;
        if (avgpipe__run_aborted(run)) return AVGPIPE_ABORTED;
        if (avgpipe__now() - t0 > timeout_s) return AVGPIPE_TIMEOUT;
        dl = avgpipe__deadline(nap);
        pthread_mutex_lock(&run->mu);
        if (!run->aborted) pthread_cond_timedwait(&run->cv, &run->mu, &dl);
        pthread_mutex_unlock(&run->mu);
        nap = nap < 1e-3 ? 2 * nap : 1e-3;
    }
}

/* The same on a worker, failing the run with a message naming rank, op and what it waited for. */
static avgpipe_result avgpipe__dev_wait(avgpipe__worker *w, avgpipe_device_event ev, const avgpipe_op *op, const char *what) {
    avgpipe_run *run = w->run;
    avgpipe_result res = avgpipe__event_wait(run, ev, run->d.timeout_s);
    char txt[64];
    if (!res || (res == AVGPIPE_ABORTED && avgpipe__run_aborted(run))) return res;
    if (res != AVGPIPE_TIMEOUT) return avgpipe__dev_fail(w, res, op, what);
    if (avgpipe__watchdog(run, 0.5 * run->d.timeout_s)) return res;
    avgpipe_op_format(op, 1, txt, sizeof txt);
    return avgpipe__run_fail(run, res, "rank %d, op %s: the device did not finish %s within %.3g s", w->rank, txt, what, run->d.timeout_s);
}

/* Order `stream` after `ev` on the device (nothing when either is the CPU's NULL handle). */
static avgpipe_result avgpipe__dev_order(avgpipe__worker *w, avgpipe_device_stream stream, avgpipe_device_event ev, const avgpipe_op *op,
                                         const char *what) {
    avgpipe_run *run = w->run;
    avgpipe_result res;
    if (!ev) return AVGPIPE_OK;
    res = run->dev.stream_wait_event(run->dev.user, stream, ev);
    return res ? avgpipe__dev_fail(w, res, op, what) : AVGPIPE_OK;
}

static avgpipe_result avgpipe__dev_record(avgpipe__worker *w, avgpipe_device_event ev, avgpipe_device_stream stream, const avgpipe_op *op) {
    avgpipe_run *run = w->run;
    avgpipe_result res;
    if (!ev) return AVGPIPE_OK;
    res = run->dev.event_record(run->dev.user, ev, stream);
    return res ? avgpipe__dev_fail(w, res, op, "recording an event") : AVGPIPE_OK;
}

static avgpipe_result avgpipe__slot_sends(avgpipe__worker *w, avgpipe__slot *sl, const avgpipe_op *op, const char *what) {
    int j;
    for (j = 0; j < sl->nsend; j++) {
        avgpipe_result res = sl->send[j] ? avgpipe__comm_wait(w, &sl->send[j], op, sl->send_peer[j], 0, what, NULL) : AVGPIPE_OK;
        if (res) return res;
    }
    sl->nsend = 0;
    for (j = 0; j < sl->nzsend; j++) {
        avgpipe_result res = sl->zsend[j] ? avgpipe__comm_wait_in(w, &w->zcomm, w->srank, &sl->zsend[j], op, sl->zsend_peer[j], 0, what, NULL)
                                          : AVGPIPE_OK;
        if (res) return res;
    }
    sl->nzsend = 0;
    return AVGPIPE_OK;
}

/* Finish the device-ordered receives of a slot's micro-batch (their consumers were ordered after them
   on the device; the requests still belong to the backend until test/wait says so). */
static avgpipe_result avgpipe__slot_receives(avgpipe__worker *w, avgpipe__slot *sl, const avgpipe_op *op) {
    avgpipe_result res = AVGPIPE_OK;
    if (sl->ordered_f && sl->recv_f) res = avgpipe__comm_wait(w, &sl->recv_f, op, sl->peer_f, 0, "an earlier receive from", NULL);
    if (!res && sl->ordered_b && sl->recv_b) res = avgpipe__comm_wait(w, &sl->recv_b, op, sl->peer_b, 0, "an earlier receive from", NULL);
    if (!res) sl->ordered_f = sl->ordered_b = 0;
    return res;
}

/* The slot of (g, pipe, micro) in this worker's replica group, taking a free one at the first touch. */
static avgpipe_result avgpipe__slot_get(avgpipe__worker *w, int g, const avgpipe_op *op, avgpipe__slot **out) {
    avgpipe_run *run = w->run;
    avgpipe__stage *st = avgpipe__run_stage(run, w->replica, g);
    int *k = avgpipe__slot_key(run, w->replica, g, op->pipe, op->micro);
    avgpipe_result res;
    if (*k < 0) {
        avgpipe__slot *sl;
        if (st->fq_len == 0) /* the plan counted the slots: cannot happen */
            return avgpipe__run_fail(run, AVGPIPE_STATE_ERROR, "rank %d: stage %d has no free slot", w->rank, g);
        *k = st->freeq[st->fq_head];
        st->fq_head = (st->fq_head + 1) % st->nslots;
        st->fq_len--;
        sl = &st->slot[*k];
        res = avgpipe__slot_sends(w, sl, op, "an earlier send to"); /* an earlier owner's sends still read these buffers */
        if (!res) res = avgpipe__slot_receives(w, sl, op);       /* and its device-ordered receives are still to finish */
        if (!res && AVGPIPE__WAITS(AVGPIPE__WAIT_SLOT_REUSE)) res = avgpipe__dev_wait(w, sl->ev_last, op, "the slot's previous micro-batch");
        if (res) return res;
        sl->recv_f = sl->recv_b = sl->zrecv_f = sl->zrecv_b = NULL;
        sl->ordered_f = sl->ordered_b = 0;
        sl->in_bytes = sl->gin_bytes = g > 0 ? run->act[g - 1] : 0;
        sl->out_bytes = sl->gout_bytes = run->act[g];
    }
    *out = &st->slot[*k];
    return AVGPIPE_OK;
}

static void avgpipe__slot_put(avgpipe__worker *w, int g, const avgpipe_op *op) {
    avgpipe__stage *st = avgpipe__run_stage(w->run, w->replica, g);
    st->freeq[(st->fq_head + st->fq_len) % st->nslots] = *avgpipe__slot_key(w->run, w->replica, g, op->pipe, op->micro);
    st->fq_len++;
}

/* A forward of pipeline p's round t on stage g waits until AVG(p, g, t-1) has been applied. */
static avgpipe_result avgpipe__wait_avg(avgpipe__worker *w, int g, int pipe, int round, const avgpipe_op *op) {
    avgpipe_run *run = w->run;
    avgpipe__stage *st = avgpipe__run_stage(run, w->replica, g);
    struct timespec dl = avgpipe__deadline(run->d.timeout_s);
    avgpipe_result res = AVGPIPE_OK;
    char txt[64];
    pthread_mutex_lock(&run->mu);
    while (st->avg_done[pipe] < round && !run->aborted)
        if (pthread_cond_timedwait(&run->cv, &run->mu, &dl) != 0 && st->avg_done[pipe] < round) {
            res = AVGPIPE_TIMEOUT;
            break;
        }
    if (!res && run->aborted) res = AVGPIPE_ABORTED;
    pthread_mutex_unlock(&run->mu);
    if (res == AVGPIPE_TIMEOUT && !avgpipe__watchdog(run, 0.5 * run->d.timeout_s)) {
        avgpipe_op_format(op, 1, txt, sizeof txt);
        return avgpipe__run_fail(run, res, "rank %d, op %s: timed out waiting for the averaging of round %d", w->rank, txt, round - 1);
    }
    if (!res && AVGPIPE__WAITS(AVGPIPE__WAIT_AVG_BEFORE_F)) /* the pass itself, on the averaging stream */
        res = avgpipe__dev_order(w, w->cs[pipe], st->ev_avg[pipe], op, "ordering the forward after the averaging");
    return res;
}

/* Tell the watchdog that this worker enters (kind: the op kind) or leaves (0) a user callback. */
static void avgpipe__in_callback(avgpipe__worker *w, int kind, const avgpipe_op *op) {
    pthread_mutex_lock(&w->cbmu);
    w->cb_kind = kind;
    if (kind) w->cb_op = *op, w->cb_since = avgpipe__now();
    pthread_mutex_unlock(&w->cbmu);
}

static avgpipe_result avgpipe__callback(avgpipe__worker *w, int (*fn)(avgpipe_op_ctx *), avgpipe_op_ctx *oc, const avgpipe_op *op) {
    int rc;
    char txt[64];
    if (!fn) return AVGPIPE_OK;
    avgpipe__in_callback(w, op->kind, op);
    rc = fn(oc);
    avgpipe__in_callback(w, 0, NULL);
    if (avgpipe__run_aborted(w->run)) return AVGPIPE_ABORTED; /* the run ended meanwhile (e.g. the watchdog): touch nothing more */
    if (rc == 0) return AVGPIPE_OK;
    avgpipe_op_format(op, 1, txt, sizeof txt);
    return avgpipe__run_fail(w->run, AVGPIPE_CALLBACK_ERROR, "rank %d, op %s: the %s callback returned %d", w->rank, txt,
                             avgpipe_op_kind_name((avgpipe_op_kind)op->kind), rc);
}

/* B, I, W with whatever the user gave: B = I then W when only the split pair exists; without the
   split pair, I runs the full backward and W has nothing left to do. */
static avgpipe_result avgpipe__backward(avgpipe__worker *w, avgpipe_op_ctx *oc, const avgpipe_op *op) {
    const avgpipe_stage_callbacks *cb = &w->run->d.cb;
    int split = cb->backward_input && cb->backward_weight;
    avgpipe_result res;
    switch (op->kind) {
    case AVGPIPE_OP_B:
        if (cb->backward) return avgpipe__callback(w, cb->backward, oc, op);
        res = avgpipe__callback(w, cb->backward_input, oc, op);
        return res ? res : avgpipe__callback(w, cb->backward_weight, oc, op);
    case AVGPIPE_OP_I: return avgpipe__callback(w, split ? cb->backward_input : cb->backward, oc, op);
    default: return split ? avgpipe__callback(w, cb->backward_weight, oc, op) : AVGPIPE_OK;
    }
}

static void avgpipe__op_ctx_init(avgpipe__worker *w, const avgpipe_op *op, avgpipe_op_ctx *oc) {
    avgpipe_run *run = w->run;
    memset(oc, 0, sizeof *oc);
    oc->rank = w->rank;
    oc->replica = w->replica;
    oc->kind = op->kind;
    oc->pipe = op->pipe;
    oc->stage = op->stage;
    oc->micro = op->micro % run->M;
    oc->round = (int)(run->iter * run->R + op->micro / run->M);
    oc->stages = run->G;
    oc->params = avgpipe__run_params(run, w->replica, op->pipe, op->stage);
    oc->slot = *avgpipe__slot_key(run, w->replica, op->stage, op->pipe, op->micro);
    oc->user = run->d.cb.user;
}

/* Wait for a posted receive of slot sl (activation: fwd) before its consumer runs; record it. */
/* comm.wait_issued on a device-ordered receive: until its transfer is on the device (the peer posted
   its send), failing the run like a wait for data when it does not come. */
static avgpipe_result avgpipe__comm_issued(avgpipe__worker *w, avgpipe_comm_request req, const avgpipe_op *op, int peer) {
    avgpipe_run *run = w->run;
    avgpipe_result res = run->comm.wait_issued(run->comm.user, w->rank, req, run->d.timeout_s);
    char txt[64];
    if (!res) return AVGPIPE_OK;
    if (res == AVGPIPE_ABORTED && avgpipe__run_aborted(run)) return res;
    if (res == AVGPIPE_TIMEOUT && avgpipe__watchdog(run, 0.5 * run->d.timeout_s)) return res; /* a local callback is the cause */
    avgpipe_op_format(op, 1, txt, sizeof txt);
    return avgpipe__run_fail(run, res, "rank %d, op %s: the send of rank %d %s (%s)", w->rank, txt, peer,
                             res == AVGPIPE_TIMEOUT ? "was not posted within the timeout" : "failed",
                             run->comm.last_error ? run->comm.last_error(run->comm.user, w->rank) : "");
}

/* The size a received message (or its size message) says its micro-batch has, checked against the
   boundary's maximum (and, without variable_bytes, required to be it), into *into. */
static avgpipe_result avgpipe__recv_size(avgpipe__worker *w, const avgpipe_op *op, int fwd, uint64_t got, size_t *into) {
    avgpipe_run *run = w->run;
    size_t max = run->act[fwd ? op->stage - 1 : op->stage];
    char txt[64];
    if (got > max || (!run->varb && got != max)) {
        avgpipe_op_format(op, 1, txt, sizeof txt);
        return avgpipe__run_fail(run, AVGPIPE_MISMATCH, "rank %d, op %s: the %s it received has %llu bytes; act_bytes[%d] is %zu (%s)", w->rank,
                                 txt, fwd ? "activation" : "gradient", (unsigned long long)got, fwd ? op->stage - 1 : op->stage, max,
                                 got > max ? "the boundary's maximum" : "without desc.variable_bytes every message has exactly that size");
    }
    *into = (size_t)got;
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__recv_wait(avgpipe__worker *w, avgpipe__slot *sl, const avgpipe_op *op, int fwd) {
    avgpipe_run *run = w->run;
    int g = op->stage, from = fwd ? g - 1 : g + 1, peer;
    avgpipe_comm_request *req = fwd ? &sl->recv_f : &sl->recv_b, *zreq = fwd ? &sl->zrecv_f : &sl->zrecv_b;
    uint32_t tag = avgpipe__data_tag(run, fwd ? 0 : 1, op->pipe, from, op->micro);
    size_t *into = fwd ? &sl->in_bytes : &sl->gout_bytes, got = 0;
    double t = avgpipe__now();
    avgpipe_result res;
    if (!*req) return AVGPIPE_OK; /* nothing posted: the first stage's input, or a neighbour on this rank */
    peer = w->replica * run->S + avgpipe__run_rank(run, from);
    if (*zreq) { /* the size first: the host shapes the consumer by it (sent after the data, already on its way) */
        res = avgpipe__comm_wait_in(w, &w->zcomm, w->srank, zreq, op, peer, avgpipe__size_tag(tag),
                                    fwd ? "receiving the activation's size from" : "receiving the gradient's size from", NULL);
        if (!res) res = avgpipe__recv_size(w, op, fwd, fwd ? sl->zin_f : sl->zin_b, into);
        if (res) return res;
    }
    if (fwd ? sl->ordered_f : sl->ordered_b) { /* the device orders the consumer after the transfer; no host wait */
        if (!AVGPIPE__WAITS(AVGPIPE__WAIT_RECV_BEFORE_OP)) return AVGPIPE_OK;
        if (run->comm.wait_issued && (res = avgpipe__comm_issued(w, *req, op, peer)) != AVGPIPE_OK) return res;
        return avgpipe__dev_order(w, w->cs[op->pipe], fwd ? sl->ev_recv_f : sl->ev_recv_b, op, "ordering the op after its receive");
    }
    res = avgpipe__comm_wait(w, req, op, peer, tag, fwd ? "receiving the activation from" : "receiving the gradient from", &got);
    if (!res && !run->sized) res = avgpipe__recv_size(w, op, fwd, got, into); /* else the payload moved at the maximum */
    if (res) return res;
    *req = NULL;
    if (!avgpipe__record(w, op, 2, peer, fwd ? sl->flow_f : sl->flow_b, t, avgpipe__now(), (double)*into))
        return avgpipe__profile_oom(w);
    return AVGPIPE_OK;
}

/* F, B, I, W before the user's call: wait for the inputs and point the context at its buffers (the
   next stage's input slot, or the previous stage's gradient slot, when that stage is on this rank). */
static avgpipe_result avgpipe__compute_prepare(avgpipe__worker *w, const avgpipe_op *op, avgpipe_op_ctx *oc) {
    avgpipe_run *run = w->run;
    int g = op->stage, k = op->kind, s = w->srank;
    avgpipe__slot *sl, *nb;
    avgpipe_result res = avgpipe__slot_get(w, g, op, &sl);
    if (res) return res;
    avgpipe__op_ctx_init(w, op, oc);
    oc->stream = w->cs[op->pipe];
    oc->input = g > 0 ? sl->in_act : NULL;
    if (k == AVGPIPE_OP_F) {
        if ((res = avgpipe__recv_wait(w, sl, op, 1)) != AVGPIPE_OK) return res;
        if (oc->round > 0 && (res = avgpipe__wait_avg(w, g, op->pipe, oc->round, op)) != AVGPIPE_OK) return res;
        oc->input_bytes = g > 0 ? sl->in_bytes : 0;
        oc->output_bytes = run->act[g];
        if (g + 1 < run->G) {
            if (avgpipe__run_rank(run, g + 1) == s) {
                if ((res = avgpipe__slot_get(w, g + 1, op, &nb)) != AVGPIPE_OK) return res;
                oc->output = nb->in_act;
            } else {
                oc->output = sl->out_act;
            }
        }
        return AVGPIPE_OK;
    }
    if (avgpipe__is_backward(k) && (res = avgpipe__recv_wait(w, sl, op, 0)) != AVGPIPE_OK) return res;
    oc->grad_output = g + 1 < run->G ? sl->grad_out : NULL;
    oc->input_bytes = g > 0 ? sl->in_bytes : 0;
    oc->grad_output_bytes = g + 1 < run->G ? sl->gout_bytes : 0;
    oc->grad_input_bytes = g > 0 && k != AVGPIPE_OP_W ? oc->input_bytes : 0;
    if (g > 0 && k != AVGPIPE_OP_W) {
        if (avgpipe__run_rank(run, g - 1) == s) {
            if ((res = avgpipe__slot_get(w, g - 1, op, &nb)) != AVGPIPE_OK) return res;
            oc->grad_input = nb->grad_out;
        } else {
            oc->grad_input = sl->grad_in;
        }
    }
    return AVGPIPE_OK;
}

/* After the user's call: the slots' events (the op's slot, and the neighbouring stage's on this rank
   that it wrote), the loss of a last-stage forward, the profile event. */
static avgpipe_result avgpipe__compute_finish(avgpipe__worker *w, const avgpipe_op *op, const avgpipe_op_ctx *oc, double t, double e) {
    avgpipe_run *run = w->run;
    int g = op->stage, nbg = op->kind == AVGPIPE_OP_F ? g + 1 : op->kind == AVGPIPE_OP_W ? -1 : g - 1;
    int local = nbg >= 0 && nbg < run->G && avgpipe__run_rank(run, nbg) == w->srank;
    avgpipe__slot *sl = &avgpipe__run_stage(run, w->replica, g)->slot[*avgpipe__slot_key(run, w->replica, g, op->pipe, op->micro)];
    avgpipe__slot *nb = local ? &avgpipe__run_stage(run, w->replica, nbg)->slot[*avgpipe__slot_key(run, w->replica, nbg, op->pipe, op->micro)] : NULL;
    avgpipe_result res = avgpipe__dev_record(w, sl->ev_last, oc->stream, op);
    if (!res && nb) res = avgpipe__dev_record(w, nb->ev_last, oc->stream, op);
    if (res) return res;
    if (nbg >= 0 && nbg < run->G) { /* the size the op set for what it produced: checked, then where its consumer reads it */
        int fwd = op->kind == AVGPIPE_OP_F, b = fwd ? g : g - 1;
        size_t n = fwd ? oc->output_bytes : oc->grad_input_bytes;
        if (n > run->act[b] || (!run->varb && n != run->act[b])) {
            char txt[64];
            avgpipe_op_format(op, 1, txt, sizeof txt);
            return avgpipe__run_fail(run, AVGPIPE_INVALID_ARG, "rank %d, op %s: %s = %zu %s act_bytes[%d] = %zu%s", w->rank, txt,
                                     fwd ? "output_bytes" : "grad_input_bytes", n, n > run->act[b] ? "is over" : "differs from", b, run->act[b],
                                     n > run->act[b] ? ", the boundary's maximum" : " (set desc.variable_bytes for smaller micro-batches)");
        }
        if (fwd) *(nb ? &nb->in_bytes : &sl->out_bytes) = n;
        else *(nb ? &nb->gout_bytes : &sl->gin_bytes) = n;
    }
    if (op->kind == AVGPIPE_OP_F && op->stage == run->G - 1) {
        w->loss += oc->loss;
        w->nloss++;
    }
    if (!avgpipe__record(w, op, 0, -1, -1, t, e, 0)) return avgpipe__profile_oom(w);
    return AVGPIPE_OK;
}

/* F, B, I, W: wait for the inputs, call the user, hand results to local neighbours. */
static avgpipe_result avgpipe__exec_compute(avgpipe__worker *w, const avgpipe_op *op) {
    avgpipe_op_ctx oc;
    avgpipe_result res = avgpipe__compute_prepare(w, op, &oc);
    double t, e;
    if (res || (res = avgpipe__prof_begin(w, oc.stream)) != AVGPIPE_OK) return res;
    t = avgpipe__now();
    res = op->kind == AVGPIPE_OP_F ? avgpipe__callback(w, w->run->d.cb.forward, &oc, op) : avgpipe__backward(w, &oc, op);
    e = avgpipe__now();
    w->busy += e - t;
    if (!res) res = avgpipe__prof_end(w, oc.stream);
    return res ? res : avgpipe__compute_finish(w, op, &oc, t, e);
}

/* An overlapped pair (f a forward, b a B or I) through the user's overlap callback: both prepared,
   one call, both finished (each recorded over the call's span). The pair's device work goes on one
   stream, the forward's: when b belongs to another pipeline, that stream first waits for what b's
   inputs wait on (its stream so far), and b's stream then waits for the pair. */
static avgpipe_result avgpipe__exec_overlap(avgpipe__worker *w, const avgpipe_op *f, const avgpipe_op *b) {
    avgpipe_op_ctx of, ob;
    avgpipe_result res = avgpipe__compute_prepare(w, f, &of);
    double t, e;
    int rc;
    char tf[64], tb[64];
    int pev;
    avgpipe_device_stream bstream;
    if (!res) res = avgpipe__compute_prepare(w, b, &ob);
    if (res) return res;
    bstream = ob.stream;
    if (bstream != of.stream) { /* join: f's stream after b's inputs */
        if ((res = avgpipe__dev_record(w, w->ev_pair[0], bstream, b)) != AVGPIPE_OK ||
            (res = avgpipe__dev_order(w, of.stream, w->ev_pair[0], b, "joining an overlapped pair's streams")) != AVGPIPE_OK)
            return res;
        ob.stream = of.stream;
    }
    if ((res = avgpipe__prof_begin(w, of.stream)) != AVGPIPE_OK) return res;
    pev = w->cur_pev;
    t = avgpipe__now();
    avgpipe__in_callback(w, f->kind, f);
    rc = w->run->d.cb.overlap(&of, &ob);
    avgpipe__in_callback(w, 0, NULL);
    e = avgpipe__now();
    w->busy += e - t;
    if (avgpipe__run_aborted(w->run)) return AVGPIPE_ABORTED;
    if ((res = avgpipe__prof_end(w, of.stream)) != AVGPIPE_OK) return res;
    if (bstream != of.stream && /* part: b's stream after the pair */
        ((res = avgpipe__dev_record(w, w->ev_pair[1], of.stream, b)) != AVGPIPE_OK ||
         (res = avgpipe__dev_order(w, bstream, w->ev_pair[1], b, "parting an overlapped pair's streams")) != AVGPIPE_OK))
        return res;
    if (rc != 0) {
        avgpipe_op_format(f, 1, tf, sizeof tf);
        avgpipe_op_format(b, 1, tb, sizeof tb);
        return avgpipe__run_fail(w->run, AVGPIPE_CALLBACK_ERROR, "rank %d, ops (%s;%s): the overlap callback returned %d", w->rank, tf, tb, rc);
    }
    res = avgpipe__compute_finish(w, f, &of, t, e);
    w->cur_pev = pev; /* the backward's record spans the same call */
    return res ? res : avgpipe__compute_finish(w, b, &ob, t, e);
}

/* SEND/RECV: post on the comm backend, tagged with what the message is; waits happen where the data
   is used (or the slot reused). */
static avgpipe_result avgpipe__exec_comm(avgpipe__worker *w, const avgpipe_op *op) {
    avgpipe_run *run = w->run;
    int g = op->stage, k = op->kind, fwd = k == AVGPIPE_OP_SEND_F || k == AVGPIPE_OP_RECV_F;
    int send = k == AVGPIPE_OP_SEND_F || k == AVGPIPE_OP_SEND_B;
    int other = fwd == send ? g + 1 : g - 1, peer = w->replica * run->S + avgpipe__run_rank(run, other);
    size_t bytes = run->act[fwd ? (send ? g : g - 1) : (send ? g - 1 : g)], moved;
    uint32_t tag = avgpipe__data_tag(run, fwd ? 0 : 1, op->pipe, send ? g : other, op->micro);
    avgpipe__slot *sl;
    avgpipe_comm_request req = NULL;
    avgpipe_result res = avgpipe__slot_get(w, g, op, &sl);
    double t = avgpipe__now();
    char txt[64];
    int flow;
    if (res) return res;
    moved = bytes;
    if (send && !run->sized) moved = bytes = fwd ? sl->out_bytes : sl->gin_bytes; /* the size travels with the message */
    else if (send) moved = fwd ? sl->out_bytes : sl->gin_bytes;                   /* in a message after it */
    if (send) {
        void *buf = fwd ? sl->out_act : sl->grad_in;
        flow = (w->rank * run->P + peer) * 1048576 + (w->seq[peer]++ & 1048575);
        if (run->ordered) /* after the producer, on the device */
            res = run->comm.isend_on(run->comm.user, w->rank, peer, buf, bytes, tag, sl->ev_last, sl->ev_send[sl->nsend], &req);
        else if (!AVGPIPE__WAITS(AVGPIPE__WAIT_SEND_AFTER_OP) ||
                 (res = avgpipe__dev_wait(w, sl->ev_last, op, "the op whose data the send carries")) == AVGPIPE_OK)
            res = run->comm.isend(run->comm.user, w->rank, peer, buf, bytes, tag, &req);
        else
            return res;
        if (!res) {
            sl->send_peer[sl->nsend] = peer;
            sl->send[sl->nsend++] = req;
        }
        if (!res && run->sized) { /* the micro-batch's size, after its data on the same channel */
            int j = sl->nzsend;
            sl->zout[j] = (uint64_t)moved;
            req = NULL;
            res = w->zcomm.isend(w->zcomm.user, w->srank, peer - w->replica * run->S, &sl->zout[j], sizeof(uint64_t), avgpipe__size_tag(tag), &req);
            if (!res) sl->zsend_peer[j] = peer, sl->zsend[sl->nzsend++] = req;
        }
    } else {
        void *buf = fwd ? sl->in_act : sl->grad_out;
        flow = (peer * run->P + w->rank) * 1048576 + (w->rseq[peer]++ & 1048575);
        if (run->ordered)
            res = run->comm.irecv_on(run->comm.user, w->rank, peer, buf, bytes, tag, sl->ev_last, fwd ? sl->ev_recv_f : sl->ev_recv_b, &req);
        else
            res = run->comm.irecv(run->comm.user, w->rank, peer, buf, bytes, tag, &req);
        if (!res) {
            if (fwd) sl->recv_f = req, sl->flow_f = flow, sl->peer_f = peer, sl->ordered_f = run->ordered;
            else sl->recv_b = req, sl->flow_b = flow, sl->peer_b = peer, sl->ordered_b = run->ordered;
        }
        if (!res && run->sized) {
            req = NULL;
            res = w->zcomm.irecv(w->zcomm.user, w->srank, peer - w->replica * run->S, fwd ? &sl->zin_f : &sl->zin_b, sizeof(uint64_t),
                                 avgpipe__size_tag(tag), &req);
            if (!res) *(fwd ? &sl->zrecv_f : &sl->zrecv_b) = req;
        }
    }
    if (res && res != AVGPIPE_ABORTED) {
        avgpipe_op_format(op, 1, txt, sizeof txt);
        return avgpipe__run_fail(run, res, "rank %d, op %s: posting the %s with rank %d failed: %s", w->rank, txt, send ? "send" : "receive",
                                 peer, run->comm.last_error ? run->comm.last_error(run->comm.user, w->rank) : "");
    }
    if (!res && send && !avgpipe__record(w, op, 1, peer, flow, t, avgpipe__now(), (double)moved)) return avgpipe__profile_oom(w);
    return res;
}

/* --- 16. Steps and sync: ties, agreement, STEP and AVG; worker and averaging threads ---------- */

/* ---- ties and step agreement (TIE, AGREE) ---- */

/* The tag of a sync message of (pipe, round micro) in an iteration of this parity: `what` 2 t + d is tie
   t's range sent by its lower-numbered stage (d 0) or its higher one (d 1), 2 nties the agreement's
   vectors. The sync communicator keeps them in order; the receive checks the tag. */
static uint32_t avgpipe__sync_tag(const avgpipe_run *run, int pipe, int micro, int what) {
    return avgpipe__tag_fold((((uint64_t)(run->iter & 1) * (uint64_t)run->R + (uint64_t)micro) * (uint64_t)run->N + (uint64_t)pipe) *
                                 (uint64_t)(2 * run->nties + 1) + (uint64_t)what);
}

/* Wait for the n requests of one exchange on the sync communicator (sends and receives with the ranks
   peers[k] of the group); on a failure the others are cancelled and the message names the first. */
static avgpipe_result avgpipe__sync_wait(avgpipe__worker *w, const avgpipe_op *op, avgpipe_comm_request *req, const int *peers, int n,
                                         const char *what) {
    avgpipe_run *run = w->run;
    avgpipe_comm_status st;
    avgpipe_result res = AVGPIPE_OK;
    char txt[64];
    int k, bad = -1;
    for (k = 0; k < n; k++) {
        avgpipe_result r;
        if (!req[k]) continue;
        if (res) { /* after a failure: give the rest back */
            if (w->sync.cancel) w->sync.cancel(w->sync.user, w->srank, req[k]);
            req[k] = NULL;
            continue;
        }
        memset(&st, 0, sizeof st);
        r = w->sync.wait(w->sync.user, w->srank, req[k], run->d.timeout_s, &st);
        if (r == AVGPIPE_TIMEOUT || r == AVGPIPE_ABORTED) {
            if (w->sync.cancel) w->sync.cancel(w->sync.user, w->srank, req[k]);
        }
        req[k] = NULL;
        if (r) res = r, bad = k;
    }
    if (!res) return AVGPIPE_OK;
    if (res == AVGPIPE_ABORTED && avgpipe__run_aborted(run)) return res;
    if (res == AVGPIPE_TIMEOUT && avgpipe__watchdog(run, 0.5 * run->d.timeout_s)) return res; /* a local callback is the cause */
    avgpipe_op_format(op, 1, txt, sizeof txt);
    return avgpipe__run_fail(run, res, "rank %d, op %s: %s rank %d %s (%s)", w->rank, txt, what, w->replica * run->S + peers[bad],
                             res == AVGPIPE_TIMEOUT    ? "timed out"
                             : res == AVGPIPE_MISMATCH ? "got another message (the two ranks' ties and agreements are out of step)"
                             : res == AVGPIPE_ABORTED  ? "stopped"
                                                       : "failed",
                             res == AVGPIPE_TIMEOUT ? "nothing within the timeout: is that rank alive?"
                                                    : (w->sync.last_error ? w->sync.last_error(w->sync.user, w->srank) : ""));
}

/* Post a send of sbytes and a receive of rbytes with group rank q on the sync communicator. */
static avgpipe_result avgpipe__sync_post(avgpipe__worker *w, const avgpipe_op *op, int q, const void *sbuf, size_t sbytes, uint32_t stag,
                                         void *rbuf, size_t rbytes, uint32_t rtag, avgpipe_comm_request *req) {
    avgpipe_run *run = w->run;
    avgpipe_result res = w->sync.isend(w->sync.user, w->srank, q, sbuf, sbytes, stag, &req[0]);
    char txt[64];
    if (!res && (res = w->sync.irecv(w->sync.user, w->srank, q, rbuf, rbytes, rtag, &req[1])) != AVGPIPE_OK) {
        if (w->sync.cancel) w->sync.cancel(w->sync.user, w->srank, req[0]);
        req[0] = NULL;
    }
    if (!res || (res == AVGPIPE_ABORTED && avgpipe__run_aborted(run))) return res;
    avgpipe_op_format(op, 1, txt, sizeof txt);
    return avgpipe__run_fail(run, res, "rank %d, op %s: posting its exchange with rank %d failed: %s", w->rank, txt, w->replica * run->S + q,
                             w->sync.last_error ? w->sync.last_error(w->sync.user, w->srank) : "");
}

/* run->staged: n gradient floats between device memory and a host buffer, on the pipeline's compute
   stream (after its backward work there), waited for before this returns. */
static avgpipe_result avgpipe__stage_grads(avgpipe__worker *w, const avgpipe_op *op, float *dst, const float *src, size_t n, int to_host) {
    avgpipe_run *run = w->run;
    avgpipe_device_stream cs = w->cs[op->pipe];
    avgpipe_result res = run->dev.copy(run->dev.user, dst, src, n * sizeof(float), to_host ? AVGPIPE_DEVICE_COPY_D2H : AVGPIPE_DEVICE_COPY_H2D, cs);
    if (!res) res = run->dev.stream_synchronize(run->dev.user, cs);
    return res ? avgpipe__dev_fail(w, res, op, to_host ? "copying gradients to the host" : "copying summed gradients back") : AVGPIPE_OK;
}

/* TIE: sum this stage's gradient ranges tied to op->peer with the peer's. On one rank the first of the
   two TIEs sums both in place (both come after both stages' backward work; the second finds the round
   done, and a STEP after the first sees the sum); across ranks each side sends its range and adds the
   other's: a + b and b + a are the same bits. */
static avgpipe_result avgpipe__exec_tie(avgpipe__worker *w, const avgpipe_op *op) {
    avgpipe_run *run = w->run;
    int g = op->stage, h = op->peer, q = avgpipe__run_rank(run, h), t;
    float *a = avgpipe__run_grads(run, w->replica, op->pipe, g);
    double t0 = avgpipe__now(), bytes = 0;
    avgpipe_result res = AVGPIPE_OK;
    for (t = 0; t < run->nties && !res; t++) {
        const avgpipe_tie *tie = &run->ties[t];
        size_t mine, theirs, i, n = tie->count;
        if (!((tie->stage_a == g && tie->stage_b == h) || (tie->stage_a == h && tie->stage_b == g))) continue;
        mine = tie->stage_a == g ? tie->offset_a : tie->offset_b;
        theirs = tie->stage_a == g ? tie->offset_b : tie->offset_a;
        if (q == w->srank) {
            float *b = avgpipe__run_grads(run, w->replica, op->pipe, h);
            int *done = &w->tie_round[(size_t)op->pipe * (size_t)run->nties + (size_t)t], round = (int)(run->iter * run->R + op->micro);
            if (*done != round && run->staged) { /* a + b on the host, back to both copies */
                float *x = w->hstage[0], *y = w->hstage[1];
                if ((res = avgpipe__stage_grads(w, op, x, a + mine, n, 1)) != AVGPIPE_OK || (res = avgpipe__stage_grads(w, op, y, b + theirs, n, 1)) != AVGPIPE_OK)
                    return res;
                for (i = 0; i < n; i++) x[i] = x[i] + y[i];
                if ((res = avgpipe__stage_grads(w, op, a + mine, x, n, 0)) != AVGPIPE_OK || (res = avgpipe__stage_grads(w, op, b + theirs, x, n, 0)) != AVGPIPE_OK)
                    return res;
            } else if (*done != round) {
                for (i = 0; i < n; i++) a[mine + i] = b[theirs + i] = a[mine + i] + b[theirs + i];
            }
            *done = round;
            continue;
        }
        {
            avgpipe_comm_request req[2] = {NULL, NULL};
            int peers[2];
            float *x = run->staged ? w->hstage[0] : a + mine; /* what this side sends and sums into */
            peers[0] = peers[1] = q;
            if (run->staged && (res = avgpipe__stage_grads(w, op, x, a + mine, n, 1)) != AVGPIPE_OK) return res;
            res = avgpipe__sync_post(w, op, q, x, n * sizeof(float), avgpipe__sync_tag(run, op->pipe, op->micro, 2 * t + (g > h)),
                                     w->tie_buf, n * sizeof(float), avgpipe__sync_tag(run, op->pipe, op->micro, 2 * t + (h > g)), req);
            if (res) return res;
            if ((res = avgpipe__sync_wait(w, op, req, peers, 2, "exchanging a tied gradient range with")) != AVGPIPE_OK) return res;
            for (i = 0; i < n; i++) x[i] = x[i] + w->tie_buf[i];
            if (run->staged && (res = avgpipe__stage_grads(w, op, a + mine, x, n, 0)) != AVGPIPE_OK) return res;
        }
        bytes += (double)(n * sizeof(float));
    }
    if (!res && !avgpipe__record(w, op, 0, -1, -1, t0, avgpipe__now(), bytes)) return avgpipe__profile_oom(w);
    return res;
}

/* The context a contribution or an agreed step sees for (pipe, stage) of this worker's group. */
static void avgpipe__step_ctx_init(avgpipe__worker *w, int pipe, int g, int round, avgpipe_step_ctx *sc) {
    avgpipe_run *run = w->run;
    memset(sc, 0, sizeof *sc);
    sc->rank = w->rank;
    sc->pipe = pipe;
    sc->stage = g;
    sc->round = round;
    sc->replica = w->replica;
    sc->params = avgpipe__run_params(run, w->replica, pipe, g);
    sc->grads = avgpipe__run_grads(run, w->replica, pipe, g);
    sc->count = run->d.param_count[g];
    sc->width = run->d.agree.width;
    sc->scale = 1;
    sc->stream = w->cs[pipe];
    sc->user = run->d.cb.user;
}

/* Partition g's vector of the agreement: the built-in sum of squares and non-finite count (its tied
   ranges where it is the higher-numbered side left out), then the user's contribution. */
static avgpipe_result avgpipe__contribute(avgpipe__worker *w, const avgpipe_op *op, int g, int round, double *v) {
    avgpipe_run *run = w->run;
    avgpipe_step_ctx sc;
    int rc, k;
    char txt[64];
    avgpipe__step_ctx_init(w, op->pipe, g, round, &sc);
    if (run->builtin) {
        const float *x = sc.grads;
        size_t at = 0;
        avgpipe_result res;
        if (run->staged && (res = avgpipe__stage_grads(w, op, w->hstage[0], sc.grads, sc.count, 1)) != AVGPIPE_OK) return res;
        if (run->staged) x = w->hstage[0];
        v[0] = v[1] = 0;
        for (k = run->excl_start[g]; k < run->excl_start[g + 1]; k++) {
            avgpipe_grad_sumsq(x + at, run->excl[2 * k] - at, &v[0], &v[1]);
            at = run->excl[2 * k] + run->excl[2 * k + 1];
        }
        avgpipe_grad_sumsq(x + at, sc.count - at, &v[0], &v[1]);
        v += 2;
    }
    if (!run->d.agree.width) return AVGPIPE_OK;
    for (k = 0; k < run->d.agree.width; k++) v[k] = 0;
    avgpipe__in_callback(w, AVGPIPE_OP_AGREE, op);
    rc = run->d.agree.contribute(&sc, v);
    avgpipe__in_callback(w, 0, NULL);
    if (avgpipe__run_aborted(run)) return AVGPIPE_ABORTED;
    if (!rc) return AVGPIPE_OK;
    avgpipe_op_format(op, 1, txt, sizeof txt);
    return avgpipe__run_fail(run, AVGPIPE_CALLBACK_ERROR, "rank %d, op %s: agree.contribute returned %d for stage %d", w->rank, txt, rc, g);
}

/* AGREE: the first of a group on this rank (they are consecutive) computes the vectors of the rank's
   stages, swaps them with every other rank of the group and combines all G in partition order; the
   rest of the group find the round's result there. */
static avgpipe_result avgpipe__exec_agree(avgpipe__worker *w, const avgpipe_op *op) {
    avgpipe_run *run = w->run;
    int p = op->pipe, round = (int)(run->iter * run->R + op->micro), W = run->wagree, j, g, q, n = 0, r = w->srank;
    double *tab = w->agree_tab, *parts = tab + (size_t)run->G * W, t0 = avgpipe__now();
    avgpipe_result res = AVGPIPE_OK;
    int *peers = w->speer;
    if (w->agree_round[p] == round) return AVGPIPE_OK;
    for (j = run->roff[r]; j < run->roff[r + 1] && !res; j++) res = avgpipe__contribute(w, op, run->rst[j], round, tab + (size_t)j * W);
    for (q = 0; q < run->S && !res; q++) {
        uint32_t tag = avgpipe__sync_tag(run, p, op->micro, 2 * run->nties);
        if (q == r) continue;
        res = avgpipe__sync_post(w, op, q, tab + (size_t)run->roff[r] * W, (size_t)(run->roff[r + 1] - run->roff[r]) * W * sizeof(double), tag,
                                 tab + (size_t)run->roff[q] * W, (size_t)(run->roff[q + 1] - run->roff[q]) * W * sizeof(double), tag, w->sreq + n);
        if (res) break;
        peers[n] = peers[n + 1] = q;
        n += 2;
    }
    if (res) { /* give back what was posted */
        for (j = 0; j < n && w->sync.cancel; j++) w->sync.cancel(w->sync.user, w->srank, w->sreq[j]);
        return res;
    }
    if (n && (res = avgpipe__sync_wait(w, op, w->sreq, peers, n, "agreeing with")) != AVGPIPE_OK) return res;
    for (g = 0; g < run->G; g++) { /* rank order -> partition order */
        int at = run->roff[run->place[g]];
        while (run->rst[at] != g) at++;
        memcpy(parts + (size_t)g * W, tab + (size_t)at * W, (size_t)W * sizeof(double));
    }
    avgpipe_agree_combine(parts, run->G, W, w->agreed + (size_t)p * W);
    w->agree_round[p] = round;
    if (run->builtin && run->d.agree.skip_nonfinite && w->agreed[(size_t)p * W + 1] > 0 && w->counts_skips) w->skipped++;
    if (!avgpipe__record(w, op, 0, -1, -1, t0, avgpipe__now(), (double)((size_t)(run->S - 1) * (size_t)(run->roff[r + 1] - run->roff[r]) * W * sizeof(double))))
        return avgpipe__profile_oom(w);
    return AVGPIPE_OK;
}

/* STEP through cb.step_agreed: the agreement's result for the round (checked to be this round's). */
static int avgpipe__step_agreed(avgpipe__worker *w, const avgpipe_op *op, int round, avgpipe_result *res) {
    avgpipe_run *run = w->run;
    avgpipe_step_ctx sc;
    int rc, W = run->wagree;
    avgpipe__step_ctx_init(w, op->pipe, op->stage, round, &sc);
    if (run->agreeing) {
        const double *v = w->agreed + (size_t)op->pipe * W;
        char txt[64];
        if (w->agree_round[op->pipe] != round) {
            avgpipe_op_format(op, 1, txt, sizeof txt);
            *res = avgpipe__run_fail(run, AVGPIPE_STATE_ERROR, "rank %d, op %s: no agreement of round %d before the step (the schedule's AGREE is missing)",
                                     w->rank, txt, round);
            return 0;
        }
        if (run->builtin) {
            sc.sumsq = v[0];
            sc.nonfinite = v[1];
            sc.scale = avgpipe_clip_scale(v[0], run->d.agree.clip_norm);
            sc.skip = run->d.agree.skip_nonfinite && v[1] > 0;
            v += 2;
        }
        sc.agreed = run->d.agree.width ? v : NULL;
    }
    avgpipe__in_callback(w, AVGPIPE_OP_STEP, op);
    rc = run->d.cb.step_agreed(&sc);
    avgpipe__in_callback(w, 0, NULL);
    return rc;
}

static avgpipe_result avgpipe__exec_step(avgpipe__worker *w, const avgpipe_op *op) {
    avgpipe_run *run = w->run;
    int round = (int)(run->iter * run->R + op->micro), rc = 0;
    double t = avgpipe__now(), e;
    char txt[64];
    if (op->kind == AVGPIPE_OP_AVG) { /* to this rank's averaging thread */
        avgpipe__job *j;
        pthread_mutex_lock(&run->mu);
        if (w->jlen == w->jcap) {
            pthread_mutex_unlock(&run->mu);
            return avgpipe__run_fail(run, AVGPIPE_STATE_ERROR, "rank %d: averaging queue full", w->rank);
        }
        j = &w->jobs[(w->jhead + w->jlen) % w->jcap];
        j->g = op->stage;
        j->pipe = op->pipe;
        j->round = round;
        w->jlen++;
        pthread_cond_broadcast(&run->cv);
        pthread_mutex_unlock(&run->mu);
        return AVGPIPE_OK;
    }
    {
        avgpipe_device_stream cs = w->cs[op->pipe];
        float *params = avgpipe__run_params(run, w->replica, op->pipe, op->stage);
        avgpipe_result res = AVGPIPE_OK;
        if (run->d.cb.step_agreed) { /* called on the host; on a device it enqueues the update on st->stream */
            rc = avgpipe__step_agreed(w, op, round, &res);
            if (res) return res;
        } else if (run->d.cb.step_async) { /* enqueued on the pipeline's stream, after its backward work */
            if ((res = avgpipe__prof_begin(w, cs)) != AVGPIPE_OK) return res;
            avgpipe__in_callback(w, AVGPIPE_OP_STEP, op);
            rc = run->d.cb.step_async(w->rank, op->pipe, op->stage, round, params, cs, run->d.cb.user);
            avgpipe__in_callback(w, 0, NULL);
            if (!rc) res = avgpipe__prof_end(w, cs);
        } else if (run->d.cb.step) { /* on the host: once the device finished the round's backward work */
            if (cs && AVGPIPE__WAITS(AVGPIPE__WAIT_BACKWARD_BEFORE_STEP)) {
                res = run->dev.stream_synchronize(run->dev.user, cs);
                if (res) return avgpipe__dev_fail(w, res, op, "waiting for the backward work before step()");
            }
            avgpipe__in_callback(w, AVGPIPE_OP_STEP, op);
            rc = run->d.cb.step(w->rank, op->pipe, op->stage, round, params, run->d.cb.user);
            avgpipe__in_callback(w, 0, NULL);
        }
        if (avgpipe__run_aborted(run)) return AVGPIPE_ABORTED;
        if (res) return res;
        if (!rc && (res = avgpipe__dev_record(w, avgpipe__run_stage(run, w->replica, op->stage)->ev_step[op->pipe], cs, op)) != AVGPIPE_OK)
            return res;
    }
    e = avgpipe__now();
    w->busy += e - t;
    if (rc) {
        avgpipe_op_format(op, 1, txt, sizeof txt);
        return avgpipe__run_fail(run, AVGPIPE_CALLBACK_ERROR, "rank %d, op %s: the step callback returned %d", w->rank, txt, rc);
    }
    if (!avgpipe__record(w, op, 0, -1, -1, t, e, 0)) return avgpipe__profile_oom(w);
    return AVGPIPE_OK;
}

/* Device-timed profiles, once the iteration's work finished: each record that used a pair of events
   gets the device's times, from the base recorded when the iteration started (the host's clock then,
   relative to the iteration's start, is the origin). */
static void avgpipe__prof_times(avgpipe__worker *w) {
    avgpipe_run *run = w->run;
    double origin = w->base_host - run->t0, a, b;
    size_t i;
    for (i = 0; i < w->nev; i++) {
        int p = w->evdev[i];
        if (p < 0) continue;
        if (run->dev.event_elapsed(run->dev.user, w->base, w->pev[2 * p], &a) != AVGPIPE_OK ||
            run->dev.event_elapsed(run->dev.user, w->base, w->pev[2 * p + 1], &b) != AVGPIPE_OK)
            continue; /* keep the host's times */
        w->ev[i].start = origin + a;
        w->ev[i].end = origin + b;
    }
}

/* One iteration of this worker's rank: walk the lowered list of its rank in the group. */
static void avgpipe__worker_iteration(avgpipe__worker *w) {
    avgpipe_run *run = w->run;
    const avgpipe_schedule *s = &run->low;
    int j;
    int r = w->srank, i, g, q;
    avgpipe_result res = AVGPIPE_OK;
    avgpipe_op none = avgpipe__op(AVGPIPE_OP_IDLE, 0, 0, 0);
    w->upev = 0;
    w->cur_pev = -1;
    if (run->timed) { /* the origin of the device times: every stream is idle now */
        w->base_host = avgpipe__now();
        res = avgpipe__dev_record(w, w->base, w->cs[0], &none);
    }
    for (i = 0; i < s->len[r] && !res; i++) {
        const avgpipe_op *op = &s->ops[r][i];
        const int *rel = &run->plan.release[r][2 * i];
        int k = op->kind, pair = 0;
        if (avgpipe__is_comm(k) != w->in_group && (avgpipe__is_comm(k) ? run->comm.group_begin : run->comm.group_end)) {
            /* the sends and receives between two compute ops go to the backend as one group (NCCL) */
            res = avgpipe__is_comm(k) ? run->comm.group_begin(run->comm.user, w->rank) : run->comm.group_end(run->comm.user, w->rank);
            w->in_group = avgpipe__is_comm(k);
            if (res) {
                avgpipe__run_fail(run, res, "rank %d: comm '%s': %s failed: %s", w->rank, run->comm.name ? run->comm.name : "?",
                                  w->in_group ? "group_begin" : "group_end", run->comm.last_error ? run->comm.last_error(run->comm.user, w->rank) : "");
                break;
            }
        }
        if (k == AVGPIPE_OP_F && (op->flags & AVGPIPE_OPF_OVERLAP_NEXT) && run->d.cb.overlap && i + 1 < s->len[r] &&
            avgpipe__is_backward(s->ops[r][i + 1].kind)) { /* lowering keeps a pair adjacent */
            pair = 1;
            res = avgpipe__exec_overlap(w, op, &s->ops[r][i + 1]);
        } else if (avgpipe__is_compute(k)) res = avgpipe__exec_compute(w, op);
        else if (avgpipe__is_comm(k)) res = avgpipe__exec_comm(w, op);
        else if (k == AVGPIPE_OP_STEP || k == AVGPIPE_OP_AVG) res = avgpipe__exec_step(w, op);
        else if (k == AVGPIPE_OP_TIE) res = avgpipe__exec_tie(w, op);
        else if (k == AVGPIPE_OP_AGREE) res = avgpipe__exec_agree(w, op);
        else continue;
        w->ops += 1 + pair;
        if (!res && rel[0] >= 0) avgpipe__slot_put(w, rel[0], op);
        if (!res && rel[1] >= 0) avgpipe__slot_put(w, rel[1], op);
        if (pair && !res) { /* then the backward's releases */
            op = &s->ops[r][++i];
            rel = &run->plan.release[r][2 * i];
            if (rel[0] >= 0) avgpipe__slot_put(w, rel[0], op);
            if (rel[1] >= 0) avgpipe__slot_put(w, rel[1], op);
        }
        if (res && !avgpipe__run_aborted(run)) { /* e.g. ABORTED from a comm backend stopped from outside */
            char txt[64];
            avgpipe_op_format(op, 1, txt, sizeof txt);
            avgpipe__run_fail(run, res, "rank %d stopped at position %d (%s): %s%s%s", w->rank, i, txt, avgpipe_result_string(res),
                              run->comm.last_error ? ": " : "", run->comm.last_error ? run->comm.last_error(run->comm.user, w->rank) : "");
        }
    }
    if (!res && w->in_group) {
        w->in_group = 0;
        if ((res = run->comm.group_end(run->comm.user, w->rank)) != AVGPIPE_OK)
            avgpipe__run_fail(run, res, "rank %d: comm '%s': group_end failed: %s", w->rank, run->comm.name ? run->comm.name : "?",
                              run->comm.last_error ? run->comm.last_error(run->comm.user, w->rank) : "");
    }
    for (j = run->roff[r]; j < run->roff[r + 1] && !res; j++) { /* transfers still in flight must finish inside the iteration */
        avgpipe__stage *st = avgpipe__run_stage(run, w->replica, g = run->rst[j]);
        none.stage = g;
        for (q = 0; q < st->nslots && !res; q++) {
            res = avgpipe__slot_sends(w, &st->slot[q], &none, "a send to");
            if (!res) res = avgpipe__slot_receives(w, &st->slot[q], &none);
        }
        if (res && !avgpipe__run_aborted(run)) avgpipe__run_fail(run, res, "rank %d: finishing its transfers: %s", w->rank, avgpipe_result_string(res));
    }
    for (q = 0; q < run->N && !res && AVGPIPE__WAITS(AVGPIPE__WAIT_ITERATION_END); q++) { /* and the device its work */
        res = avgpipe__dev_record(w, w->ev_end[q], w->cs[q], &none);
        if (!res) res = avgpipe__dev_wait(w, w->ev_end[q], &none, "the iteration's work");
    }
    if (!res && run->timed) avgpipe__prof_times(w);
}

static void avgpipe__run_free(avgpipe_run *run);

/* desc.bind_thread, first thing on a thread the run started. */
static void avgpipe__bind(avgpipe__worker *w, int role) {
    avgpipe_run *run = w->run;
    int rc;
    if (!run->d.bind_thread) return;
    rc = run->d.bind_thread(w->rank, role, run->d.bind_user);
    if (rc != 0)
        avgpipe__log(run->ctx, AVGPIPE_LOG_WARN, "rank %d: binding its %s thread failed (%d); it runs unbound", w->rank,
                     role == AVGPIPE_THREAD_WORKER ? "worker" : "averaging", rc);
}

static void *avgpipe__worker_main(void *arg) {
    avgpipe__worker *w = (avgpipe__worker *)arg;
    avgpipe_run *run = w->run;
    long seen = 0;
    avgpipe__bind(w, AVGPIPE_THREAD_WORKER);
    for (;;) {
        pthread_mutex_lock(&run->mu);
        while (run->go == seen && !run->quit) pthread_cond_wait(&run->cv, &run->mu);
        if (run->quit) {
            pthread_mutex_unlock(&run->mu);
            return NULL;
        }
        seen = run->go;
        pthread_mutex_unlock(&run->mu);
        avgpipe__worker_iteration(w);
        pthread_mutex_lock(&run->mu);
        run->done++;
        pthread_cond_broadcast(&run->cv);
        if (w->orphan) { /* destroyed while this thread was inside a callback: it is the last one, it frees the run */
            void (*returned)(int, void *) = run->d.cb.abandoned_return;
            void *user = run->d.cb.user;
            int rank = w->rank;
            while (!run->orphaned) pthread_cond_wait(&run->cv, &run->mu);
            pthread_mutex_unlock(&run->mu);
            avgpipe__run_free(run);
            if (returned) returned(rank, user); /* the last thing: the user may free what the callback used */
            return NULL;
        }
        pthread_mutex_unlock(&run->mu);
    }
}

/* Replica groups: the held reference of stage g (round `round`) becomes the mean over the D groups. */
static avgpipe_result avgpipe__replica_average(avgpipe__worker *w, avgpipe__stage *st, int g) {
    avgpipe_run *run = w->run;
    uint64_t round = 0;
    float *z = avgpipe_ea_held(st->ea, &round);
    size_t count = run->d.param_count[g];
    avgpipe_result res;
    if (!z) return AVGPIPE_OK;
    if (w->as && (res = run->dev.stream_synchronize(run->dev.user, w->as)) != AVGPIPE_OK) /* the held reference is final */
        return avgpipe__fail(&w->avg_ctx, res, "device '%s': waiting for the averaging before the replica allreduce failed: %s", run->dev.name,
                             run->dev.error_string ? run->dev.error_string(run->dev.user) : "");
    res = w->group.allreduce_sum(w->group.user, w->replica, z, count, run->d.timeout_s);
    if (res)
        return avgpipe__fail(&w->avg_ctx, res, "averaging the reference across the %d replica groups (round %llu) %s: %s", run->D,
                             (unsigned long long)round, res == AVGPIPE_TIMEOUT ? "timed out" : "failed",
                             w->group.last_error ? w->group.last_error(w->group.user, w->replica) : "");
    res = run->dev.scale(run->dev.user, z, 1.0f / (float)run->D, count, w->as);
    if (res) return avgpipe__fail(&w->avg_ctx, res, "device '%s': scale failed", run->dev.name ? run->dev.name : "?");
    return avgpipe_ea_publish(&w->avg_ctx, st->ea, w->as);
}

/* The averaging thread of a rank: pull + contribute, in the order the AVG ops came. */
/* reseed_nonfinite: a refused (non-finite) contribution's partition takes the reference's values, the
   user resets its optimizer state, and it contributes again to the same round. */
static avgpipe_result avgpipe__reseed(avgpipe__worker *w, avgpipe__stage *st, const avgpipe__job *j) {
    avgpipe_run *run = w->run;
    float *p = avgpipe__run_params(run, w->replica, j->pipe, j->g);
    avgpipe_result res = avgpipe_ea_reset_from_reference(&w->avg_ctx, st->ea, j->pipe, p, w->as);
    int rc;
    if (res) return res;
    avgpipe__log(run->ctx, AVGPIPE_LOG_WARN, "rank %d: pipeline %d stage %d was non-finite at round %d: re-seeded from the reference", w->rank,
                 j->pipe, j->g, j->round);
    if (run->d.cb.reseeded && (rc = run->d.cb.reseeded(w->rank, j->pipe, j->g, j->round, run->d.cb.user)) != 0)
        return avgpipe__fail(&w->avg_ctx, AVGPIPE_CALLBACK_ERROR, "cb.reseeded returned %d", rc);
    pthread_mutex_lock(&run->mu);
    w->reseeded++;
    pthread_mutex_unlock(&run->mu);
    return avgpipe_ea_contribute(&w->avg_ctx, st->ea, j->pipe, (uint64_t)j->round, p, w->as);
}

static void *avgpipe__avg_main(void *arg) {
    avgpipe__worker *w = (avgpipe__worker *)arg;
    avgpipe_run *run = w->run;
    avgpipe__bind(w, AVGPIPE_THREAD_AVERAGING);
    for (;;) {
        avgpipe__job j;
        avgpipe_result res = AVGPIPE_OK;
        avgpipe__stage *st;
        pthread_mutex_lock(&run->mu);
        while (w->jlen == 0 && !run->quit) pthread_cond_wait(&run->cv, &run->mu);
        if (run->quit) {
            pthread_mutex_unlock(&run->mu);
            return NULL;
        }
        j = w->jobs[w->jhead];
        w->avg_busy = 1;
        pthread_mutex_unlock(&run->mu);
        st = avgpipe__run_stage(run, w->replica, j.g);
        if (!avgpipe__run_aborted(run)) {
            if (run->d.deterministic && j.round > 0)
                res = avgpipe_ea_wait(&w->avg_ctx, st->ea, (uint64_t)j.round - 1, (int64_t)(run->d.timeout_s * 1000));
            if (!res && st->ev_step[j.pipe] && AVGPIPE__WAITS(AVGPIPE__WAIT_STEP_BEFORE_AVG) &&
                (res = run->dev.stream_wait_event(run->dev.user, w->as, st->ev_step[j.pipe])) != AVGPIPE_OK)
                avgpipe__fail(&w->avg_ctx, res, "device '%s': ordering the averaging after the step failed: %s", run->dev.name,
                              run->dev.error_string ? run->dev.error_string(run->dev.user) : "");
            if (!res)
                res = avgpipe_ea_contribute(&w->avg_ctx, st->ea, j.pipe, (uint64_t)j.round, avgpipe__run_params(run, w->replica, j.pipe, j.g),
                                            w->as);
            if (res == AVGPIPE_NON_FINITE && run->d.reseed_nonfinite) res = avgpipe__reseed(w, st, &j);
            if (!res && st->ev_avg[j.pipe] && (res = run->dev.event_record(run->dev.user, st->ev_avg[j.pipe], w->as)) != AVGPIPE_OK)
                avgpipe__fail(&w->avg_ctx, res, "device '%s': recording the averaging's event failed: %s", run->dev.name,
                              run->dev.error_string ? run->dev.error_string(run->dev.user) : "");
            if (!res && run->D > 1) res = avgpipe__replica_average(w, st, j.g);
            if (res && !avgpipe__run_aborted(run))
                avgpipe__run_fail(run, res, "rank %d, averaging of pipeline %d stage %d round %d: %s", w->rank, j.pipe, j.g, j.round,
                                  avgpipe_last_error(&w->avg_ctx));
        }
        pthread_mutex_lock(&run->mu);
        w->jhead = (w->jhead + 1) % w->jcap;
        w->jlen--;
        w->avg_busy = 0;
        if (!res) st->avg_done[j.pipe] = j.round + 1;
        pthread_cond_broadcast(&run->cv);
        pthread_mutex_unlock(&run->mu);
    }
}

/* After a failure: give back every request the local ranks still have (the backend's cancel). */
static void avgpipe__run_cancel_pending(avgpipe_run *run) {
    int k, g, q, j, i;
    for (k = 0; k < run->nlocal; k++) {
        avgpipe__worker *w = &run->w[k];
        AVGPIPE__RANK_STAGES(run, w->srank, i, g) {
            avgpipe__stage *st = avgpipe__run_stage(run, w->replica, g);
            for (q = 0; st->slot && q < st->nslots; q++) {
                avgpipe__slot *sl = &st->slot[q];
                avgpipe_comm_request *reqs[8];
                reqs[0] = &sl->recv_f, reqs[1] = &sl->recv_b, reqs[2] = &sl->send[0], reqs[3] = &sl->send[1];
                reqs[4] = &sl->zrecv_f, reqs[5] = &sl->zrecv_b, reqs[6] = &sl->zsend[0], reqs[7] = &sl->zsend[1];
                for (j = 0; j < 8; j++) {
                    int live = j < 2 || (j >= 4 && j < 6) || (j < 4 ? j - 2 < sl->nsend : j - 6 < sl->nzsend);
                    const avgpipe_comm *c = j < 4 ? &run->comm : &w->zcomm;
                    if (*reqs[j] && c->cancel && live) c->cancel(c->user, j < 4 ? w->rank : w->srank, *reqs[j]);
                    *reqs[j] = NULL;
                }
                sl->nsend = sl->nzsend = 0;
            }
        }
    }
}

/* --- 17. Processes: control messages between iterations, collectives -------------------------- */

/* Post, for local worker k, a receive or a send of `bytes` with rank `peer`; collected in reqs. */
typedef struct avgpipe__ctl {
    avgpipe_comm_request req[64];
    int self[64], peer[64], n;
} avgpipe__ctl;

static avgpipe_result avgpipe__ctl_wait(avgpipe_run *run, avgpipe__ctl *c, const char *what) {
    avgpipe_result res = AVGPIPE_OK, r;
    int i;
    for (i = 0; i < c->n; i++) {
        avgpipe_comm_status st;
        if (!c->req[i]) continue;
        r = run->comm.wait(run->comm.user, c->self[i], c->req[i], run->d.timeout_s, &st);
        if (r == AVGPIPE_TIMEOUT || r == AVGPIPE_ABORTED) {
            if (run->comm.cancel) run->comm.cancel(run->comm.user, c->self[i], c->req[i]);
        }
        c->req[i] = NULL;
        if (r && !res)
            res = avgpipe__fail(run->ctx, r, "%s: rank %d %s rank %d (%s)", what, c->self[i],
                                r == AVGPIPE_TIMEOUT ? "heard nothing within the timeout from" : "failed to exchange with", c->peer[i],
                                r == AVGPIPE_TIMEOUT ? "is that process running, with the same ranks?"
                                                     : (run->comm.last_error ? run->comm.last_error(run->comm.user, c->self[i]) : ""));
    }
    c->n = 0;
    return res;
}

static avgpipe_result avgpipe__ctl_post(avgpipe_run *run, avgpipe__ctl *c, int send, int self, int peer, void *buf, size_t bytes,
                                        uint32_t tag, const char *what) {
    avgpipe_result res;
    if (c->n == 64 && (res = avgpipe__ctl_wait(run, c, what)) != AVGPIPE_OK) return res;
    c->self[c->n] = self;
    c->peer[c->n] = peer;
    res = send ? run->comm.isend(run->comm.user, self, peer, buf, bytes, tag, &c->req[c->n])
               : run->comm.irecv(run->comm.user, self, peer, buf, bytes, tag, &c->req[c->n]);
    if (res) {
        c->req[c->n] = NULL;
        avgpipe__ctl_wait(run, c, what);
        return avgpipe__fail(run->ctx, res, "%s: rank %d cannot %s rank %d: %s", what, self, send ? "send to" : "receive from", peer,
                             run->comm.last_error ? run->comm.last_error(run->comm.user, self) : "");
    }
    c->n++;
    return AVGPIPE_OK;
}

/* Every rank's `bytes` (mine: one record per local worker) in all[rank * bytes], on every process:
   through rank 0, with nonblocking messages driven from this one thread, whatever the local ranks. */
static avgpipe_result avgpipe__ctl_allgather(avgpipe_run *run, const unsigned char *mine, size_t bytes, unsigned char *all,
                                             uint32_t tag, const char *what) {
    avgpipe__ctl c;
    avgpipe_result res = AVGPIPE_OK;
    unsigned char *copies = NULL;
    int k, q, root_local = avgpipe_run_is_local(run, 0);
    c.n = 0;
    for (k = 0; k < run->nlocal; k++) memcpy(all + (size_t)run->w[k].rank * bytes, mine + (size_t)k * bytes, bytes);
    if (run->all_local) return AVGPIPE_OK;
    if (root_local) { /* rank 0 collects the other processes' records, then sends everyone the table */
        for (q = 1; q < run->P && !res; q++)
            if (!avgpipe_run_is_local(run, q)) res = avgpipe__ctl_post(run, &c, 0, 0, q, all + (size_t)q * bytes, bytes, tag, what);
        if (!res) res = avgpipe__ctl_wait(run, &c, what);
        for (q = 1; q < run->P && !res; q++)
            if (!avgpipe_run_is_local(run, q)) res = avgpipe__ctl_post(run, &c, 1, 0, q, all, bytes * (size_t)run->P, tag + 1, what);
        if (!res) res = avgpipe__ctl_wait(run, &c, what);
        avgpipe__ctl_wait(run, &c, what);
        return res;
    }
    copies = (unsigned char *)avgpipe_alloc(run->ctx, bytes * (size_t)run->P * (size_t)run->nlocal);
    if (!copies) return avgpipe__fail(run->ctx, AVGPIPE_OUT_OF_MEMORY, "%s: out of memory", what);
    for (k = 0; k < run->nlocal && !res; k++) {
        res = avgpipe__ctl_post(run, &c, 1, run->w[k].rank, 0, all + (size_t)run->w[k].rank * bytes, bytes, tag, what);
        if (!res) res = avgpipe__ctl_post(run, &c, 0, run->w[k].rank, 0, copies + (size_t)k * bytes * run->P, bytes * (size_t)run->P, tag + 1, what);
    }
    if (!res) res = avgpipe__ctl_wait(run, &c, what);
    avgpipe__ctl_wait(run, &c, what);
    if (!res) memcpy(all, copies, bytes * (size_t)run->P);
    avgpipe_free(run->ctx, copies);
    return res;
}

/* The agreement check: a fingerprint of the description and the lowered schedule, compared field by
   field between every rank and rank 0 (every process finds the same first difference). */
#define AVGPIPE__FP_FIELDS 28
static const char *const avgpipe__fp_names[AVGPIPE__FP_FIELDS] = {
    "protocol", "comm.size", "replicas", "average_every", "schedule (given or generated)", "sched.kind", "sched.stages",
    "sched.chunks", "sched.micro", "sched.pipes", "sched.rounds", "sched.advance (K)", "sched.continuous", "adaptive", "window",
    "mem_limit", "averaging.mode", "averaging.alpha", "averaging.momentum", "deterministic", "act_bytes (the boundary sizes)", "param_count (the stage sizes)",
    "the lowered schedule (its ops)", "stage partitions (G)", "placement (the rank of each stage)", "ties (stages, offsets, counts)",
    "agree (width, clip_norm, skip_nonfinite)", "variable_bytes"};

static uint64_t avgpipe__fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}
static int64_t avgpipe__bits(double v) {
    int64_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

static void avgpipe__fingerprint(const avgpipe_run *run, int64_t *f) {
    const avgpipe_sched_desc *sh = &run->base.shape;
    uint64_t h = 14695981039346656037ull;
    int r, i = 0;
    f[i++] = 1;
    f[i++] = run->comm.size;
    f[i++] = run->D;
    f[i++] = run->H;
    f[i++] = run->d.schedule != NULL;
    f[i++] = sh->kind;
    f[i++] = run->S;
    f[i++] = sh->chunks;
    f[i++] = sh->micro;
    f[i++] = run->N;
    f[i++] = sh->rounds;
    f[i++] = run->K;
    f[i++] = sh->continuous;
    f[i++] = run->d.adaptive;
    f[i++] = run->d.window;
    f[i++] = avgpipe__bits(run->d.mem_limit);
    f[i++] = run->d.averaging.mode ? run->d.averaging.mode : AVGPIPE_EA_MEAN;
    f[i++] = avgpipe__bits(avgpipe__or_default(run->d.averaging.alpha, 0.1));
    f[i++] = avgpipe__bits(run->d.averaging.momentum);
    f[i++] = run->d.deterministic;
    f[i++] = (int64_t)avgpipe__fnv(h, run->act, (size_t)run->G * sizeof(size_t));
    f[i++] = (int64_t)avgpipe__fnv(h, run->d.param_count, (size_t)run->G * sizeof(size_t));
    for (r = 0; r < run->low.nranks; r++) h = avgpipe__fnv(h, run->low.ops[r], (size_t)run->low.len[r] * sizeof(avgpipe_op));
    f[i++] = (int64_t)h;
    f[i++] = run->G;
    f[i++] = (int64_t)avgpipe__fnv(14695981039346656037ull, run->place, (size_t)run->G * sizeof(int));
    h = 14695981039346656037ull; /* 0 without ties and agreement: what a checkpoint without these fields means */
    for (r = 0; r < run->nties; r++) {
        uint64_t t[5];
        t[0] = (uint64_t)run->ties[r].stage_a, t[1] = (uint64_t)run->ties[r].stage_b;
        t[2] = run->ties[r].offset_a, t[3] = run->ties[r].offset_b, t[4] = run->ties[r].count;
        h = avgpipe__fnv(h, t, sizeof t);
    }
    f[i++] = run->nties ? (int64_t)h : 0;
    f[i++] = run->agreeing ? (int64_t)avgpipe__fnv(avgpipe__fnv((uint64_t)run->d.agree.width * 2 + (uint64_t)run->d.agree.skip_nonfinite, &run->d.agree.clip_norm,
                                                                sizeof(double)), "agree", 5)
                           : 0;
    f[i++] = run->d.variable_bytes;
}

static avgpipe_result avgpipe__run_agree(avgpipe_run *run) {
    size_t rec = AVGPIPE__FP_FIELDS * sizeof(int64_t);
    unsigned char *mine = (unsigned char *)avgpipe_alloc(run->ctx, rec * (size_t)run->nlocal);
    unsigned char *all = (unsigned char *)avgpipe_alloc(run->ctx, rec * (size_t)run->P);
    avgpipe_result res = AVGPIPE_OK;
    int64_t f[AVGPIPE__FP_FIELDS], a[AVGPIPE__FP_FIELDS], b[AVGPIPE__FP_FIELDS];
    int k, q, i;
    if (!mine || !all) res = avgpipe__fail(run->ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory");
    if (!res) {
        avgpipe__fingerprint(run, f);
        for (k = 0; k < run->nlocal; k++) memcpy(mine + (size_t)k * rec, f, rec);
        res = avgpipe__ctl_allgather(run, mine, rec, all, AVGPIPE__TAG_CTL + 2, "the processes' agreement check");
    }
    for (q = 1; q < run->P && !res; q++) {
        memcpy(a, all, rec);
        memcpy(b, all + (size_t)q * rec, rec);
        for (i = 0; i < AVGPIPE__FP_FIELDS && !res; i++)
            if (a[i] != b[i]) {
                int num = i != 17 && i != 18 && i != 15 && i < 20; /* a plain number, shown as such */
                if (num)
                    res = avgpipe__fail(run->ctx, AVGPIPE_MISMATCH, "the processes describe different runs: rank %d has %s = %lld, rank 0 "
                                        "has %lld (start every process with the same flags)", q, avgpipe__fp_names[i], (long long)b[i],
                                        (long long)a[i]);
                else
                    res = avgpipe__fail(run->ctx, AVGPIPE_MISMATCH, "the processes describe different runs: rank %d and rank 0 differ in "
                                        "%s (start every process with the same flags)", q, avgpipe__fp_names[i]);
            }
    }
    avgpipe_free(run->ctx, mine);
    avgpipe_free(run->ctx, all);
    return res;
}

/* The slowest process's iteration time (the adaptive controller's input, equal on every process). */
static avgpipe_result avgpipe__run_max_time(avgpipe_run *run, double *seconds) {
    unsigned char *mine, *all;
    avgpipe_result res;
    int k;
    if (run->all_local) return AVGPIPE_OK;
    mine = (unsigned char *)avgpipe_alloc(run->ctx, sizeof(double) * (size_t)(run->nlocal + run->P));
    if (!mine) return avgpipe__fail(run->ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory");
    all = mine + sizeof(double) * (size_t)run->nlocal;
    for (k = 0; k < run->nlocal; k++) memcpy(mine + sizeof(double) * (size_t)k, seconds, sizeof(double));
    res = avgpipe__ctl_allgather(run, mine, sizeof(double), all, AVGPIPE__TAG_CTL + 4, "the adaptive controller's time exchange");
    for (k = 0; k < run->P && !res; k++) {
        double t;
        memcpy(&t, all + sizeof(double) * (size_t)k, sizeof t);
        if (t > *seconds) *seconds = t;
    }
    avgpipe_free(run->ctx, mine);
    return res;
}

/* avgpipe_run_allreduce's sum in process order: dst[i] = ((0 + part_0[i]) + part_1[i]) + ..., part r at
   byte offset r * stride (read with memcpy); the same bits under any compiler flags. */
AVGPIPE__FP_EXACT_BEGIN
static void avgpipe__sum_parts_f64(double *dst, const unsigned char *parts, size_t stride, int nparts, size_t count) {
    uint64_t fp = avgpipe__fp_exact_enter();
    size_t i;
    int r;
    for (i = 0; i < count; i++) {
        double sum = 0, v;
        AVGPIPE__FP_KEEP(sum);
        for (r = 0; r < nparts; r++) {
            memcpy(&v, parts + stride * (size_t)r + sizeof(double) * i, sizeof v);
            sum += v;
            AVGPIPE__FP_KEEP(sum);
        }
        dst[i] = sum;
    }
    avgpipe__fp_exact_leave(fp);
}
AVGPIPE__FP_EXACT_END

AVGPIPE_API avgpipe_result avgpipe_run_allreduce(avgpipe_run *run, double *values, int count) {
    unsigned char *mine, *all;
    avgpipe_result res;
    size_t bytes;
    if (!run || (!values && count) || count < 0 || count > 4096)
        return avgpipe__fail(run ? run->ctx : NULL, AVGPIPE_INVALID_ARG, "avgpipe_run_allreduce: bad argument (count %d, 0..4096)", count);
    if (run->dead) return avgpipe__fail(run->ctx, AVGPIPE_STATE_ERROR, "avgpipe_run_allreduce: the run failed earlier (%s)", run->abort_msg);
    if (run->all_local || count == 0) return AVGPIPE_OK;
    bytes = (size_t)count * sizeof(double);
    mine = (unsigned char *)avgpipe__calloc(run->ctx, (size_t)(run->nlocal + run->P), bytes);
    if (!mine) return avgpipe__fail(run->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_allreduce: out of memory");
    all = mine + bytes * (size_t)run->nlocal;
    memcpy(mine, values, bytes); /* the process counts once: through its first local rank; the others add 0 */
    res = avgpipe__ctl_allgather(run, mine, bytes, all, AVGPIPE__TAG_CTL + 6, "avgpipe_run_allreduce");
    if (!res) avgpipe__sum_parts_f64(values, all, bytes, run->P, (size_t)count);
    avgpipe_free(run->ctx, mine);
    return res;
}

/* Between the host and the run's device memory (parameters, references), waited for; a plain memcpy
   on the CPU device. Only between iterations: every stream is idle then. */
static avgpipe_result avgpipe__run_copy(avgpipe_run *run, avgpipe_context *ctx, void *dst, const void *src, size_t n,
                                        avgpipe_device_copy_kind kind, const char *what) {
    avgpipe_result res;
    if (!run->d.device) {
        if (n) memcpy(dst, src, n);
        return AVGPIPE_OK;
    }
    res = run->dev.copy(run->dev.user, dst, src, n, kind, NULL);
    if (!res) res = run->dev.stream_synchronize(run->dev.user, NULL);
    if (res)
        return avgpipe__fail(ctx, res, "%s: device '%s': copying %zu bytes %s failed: %s", what, run->dev.name, n,
                             kind == AVGPIPE_DEVICE_COPY_D2H ? "to the host" : "to the device",
                             run->dev.error_string ? run->dev.error_string(run->dev.user) : "");
    return AVGPIPE_OK;
}

/* Every stage of replica group `replica` onto the process that runs global rank 0, into dst[g]: its
   reference (pipe -1) or the parameters of parallel model `pipe`. Each stage comes from the rank that
   holds it (through the host on a device); on the root, from its own memory. */
static avgpipe_result avgpipe__run_gather(avgpipe_run *run, int replica, int pipe, float *const *dst, uint32_t tag0, const char *what) {
    avgpipe__ctl c;
    avgpipe_result res = AVGPIPE_OK;
    int g, root = avgpipe_run_is_local(run, 0);
    unsigned char *stage = NULL; /* on a device: the local partitions, copied to the host for sending */
    size_t at = 0, total = 0;
    if (root && !dst) return avgpipe__fail(run->ctx, AVGPIPE_INVALID_ARG, "%s: dst is NULL on the process that runs rank 0", what);
    c.n = 0;
    for (g = 0; g < run->G && !root && run->d.device; g++)
        if (avgpipe_run_is_local(run, replica * run->S + avgpipe__run_rank(run, g))) total += run->d.param_count[g] * sizeof(float);
    if (total && !(stage = (unsigned char *)avgpipe_alloc(run->ctx, total)))
        return avgpipe__fail(run->ctx, AVGPIPE_OUT_OF_MEMORY, "%s: out of memory", what);
    for (g = 0; g < run->G && !res; g++) {
        int r = replica * run->S + avgpipe__run_rank(run, g), mine = avgpipe_run_is_local(run, r);
        size_t bytes = run->d.param_count[g] * sizeof(float);
        const float *z = !mine ? NULL : pipe < 0 ? avgpipe_run_replica_reference(run, replica, g, NULL) : avgpipe__run_params(run, replica, pipe, g);
        uint32_t tag = tag0 + (uint32_t)(g & 0xffff);
        if (root && !dst[g]) {
            res = avgpipe__fail(run->ctx, AVGPIPE_INVALID_ARG, "%s: dst[%d] is NULL", what, g);
        } else if (root && mine) {
            res = avgpipe__run_copy(run, run->ctx, dst[g], z, bytes, AVGPIPE_DEVICE_COPY_D2H, what);
        } else if (root) {
            res = avgpipe__ctl_post(run, &c, 0, 0, r, dst[g], bytes, tag, what);
        } else if (mine) {
            if (stage && (res = avgpipe__run_copy(run, run->ctx, stage + at, z, bytes, AVGPIPE_DEVICE_COPY_D2H, what)) == AVGPIPE_OK)
                z = (const float *)(const void *)(stage + at), at += bytes;
            if (!res) res = avgpipe__ctl_post(run, &c, 1, r, 0, (void *)(uintptr_t)z, bytes, tag, what);
        }
    }
    if (!res) res = avgpipe__ctl_wait(run, &c, what);
    avgpipe__ctl_wait(run, &c, what);
    avgpipe_free(run->ctx, stage);
    return res;
}

AVGPIPE_API avgpipe_result avgpipe_run_gather_reference(avgpipe_run *run, float *const *dst) {
    const char *what = "avgpipe_run_gather_reference";
    if (!run) return avgpipe__fail(NULL, AVGPIPE_INVALID_ARG, "%s: run is NULL", what);
    if (run->dead) return avgpipe__fail(run->ctx, AVGPIPE_STATE_ERROR, "%s: the run failed earlier (%s)", what, run->abort_msg);
    return avgpipe__run_gather(run, 0, -1, dst, AVGPIPE__TAG_CTL + 16, what);
}

AVGPIPE_API avgpipe_result avgpipe_run_gather_params(avgpipe_run *run, int replica, int pipe, float *const *dst) {
    const char *what = "avgpipe_run_gather_params";
    if (!run) return avgpipe__fail(NULL, AVGPIPE_INVALID_ARG, "%s: run is NULL", what);
    if (run->dead) return avgpipe__fail(run->ctx, AVGPIPE_STATE_ERROR, "%s: the run failed earlier (%s)", what, run->abort_msg);
    if (replica < 0 || replica >= run->D || pipe < 0 || pipe >= run->N)
        return avgpipe__fail(run->ctx, AVGPIPE_INVALID_ARG, "%s: replica %d, pipe %d (the run has %d replica group%s of %d pipeline%s)", what,
                             replica, pipe, run->D, run->D == 1 ? "" : "s", run->N, run->N == 1 ? "" : "s");
    return avgpipe__run_gather(run, replica, pipe, dst, AVGPIPE__TAG_CTL + 0x20000u, what);
}

/* --- 18. Checkpoints -------------------------------------------------------------------------- */

#ifndef AVGPIPE_NO_STDIO
#define AVGPIPE__CKPT_VERSION 1u
#define AVGPIPE__CKPT_HEADER 64
#define AVGPIPE__CKPT_ENDIAN 0x01020304u
enum { AVGPIPE__CK_RUN = 1, AVGPIPE__CK_STAGE = 2, AVGPIPE__CK_USER = 3 };

/* Which fingerprint fields a checkpoint must match: not K under adaptive advance, not the window, the
   memory limit, deterministic mode or (for generated schedules: K decides it) the lowered schedule. */
static int avgpipe__ckpt_field(const avgpipe_run *run, int i) {
    if (i == 11) return !run->d.adaptive;
    if (i == 22) return run->d.schedule != NULL;
    return i != 14 && i != 15 && i != 19 && i != 27; /* window, mem_limit, deterministic, variable_bytes: a resume may change them */
}

static void avgpipe__put_u32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void avgpipe__put_u64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t avgpipe__get_u32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static uint64_t avgpipe__get_u64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
/* The FNV-1a checksum of a rank file: every byte, its checksum field (56..63) counted as zeros. */
static uint64_t avgpipe__ckpt_sum(const unsigned char *p, size_t n) {
    static const unsigned char zero[8] = {0};
    uint64_t h = 14695981039346656037ull;
    h = avgpipe__fnv(h, p, 56);
    h = avgpipe__fnv(h, zero, 8);
    return avgpipe__fnv(h, p + 64, n - 64);
}

/* Append one record (tag, id, n bytes) to a rank file being built; data NULL: only its header (the
   caller fills the n bytes in place). */
static int avgpipe__ckpt_record(avgpipe_context *ctx, avgpipe_buf *b, uint32_t tag, uint32_t id, const void *data, size_t n) {
    unsigned char h[16];
    avgpipe__put_u32(h, tag);
    avgpipe__put_u32(h + 4, id);
    avgpipe__put_u64(h + 8, (uint64_t)n);
    return avgpipe__buf_put(ctx, b, (const char *)h, 16) && (!n || !data || avgpipe__buf_put(ctx, b, (const char *)data, n));
}

/* The bytes of local worker w's rank file: header, the run's state, each stage's averaging state and
   models, the user's state. */
static avgpipe_result avgpipe__ckpt_build(avgpipe_run *run, avgpipe__worker *w, avgpipe_buf *b) {
    int j;
    avgpipe_context *ctx = run->ctx;
    unsigned char head[AVGPIPE__CKPT_HEADER];
    avgpipe_buf user = {NULL, 0, 0};
    avgpipe_result res = AVGPIPE_OK;
    int g, p, ok = 1;
    memset(head, 0, sizeof head);
    memcpy(head, "AVGPCKPT", 8);
    avgpipe__put_u32(head + 8, AVGPIPE__CKPT_VERSION);
    avgpipe__put_u32(head + 12, AVGPIPE__CKPT_ENDIAN);
    avgpipe__put_u64(head + 16, (uint64_t)run->iter);
    avgpipe__put_u32(head + 24, (uint32_t)w->rank);
    avgpipe__put_u32(head + 28, (uint32_t)run->P);
    avgpipe__put_u32(head + 32, (uint32_t)run->G);
    avgpipe__put_u32(head + 36, (uint32_t)run->N);
    avgpipe__put_u32(head + 40, (uint32_t)run->D);
    b->len = 0;
    ok = avgpipe__buf_put(ctx, b, (const char *)head, sizeof head);
    { /* the run: iteration, K, the adaptive controller */
        double rs[4 + 64];
        int i, n = run->d.window < 64 ? run->d.window : 64;
        rs[0] = (double)run->iter, rs[1] = run->K, rs[2] = run->best_k, rs[3] = run->best;
        for (i = 0; i < n; i++) rs[4 + i] = run->win[i];
        ok = ok && avgpipe__ckpt_record(ctx, b, AVGPIPE__CK_RUN, (uint32_t)(run->win_n | run->adapt_done << 8 | n << 16), rs,
                                        (size_t)(4 + n) * sizeof(double));
    }
    for (j = run->roff[w->srank]; j < run->roff[w->srank + 1] && ok && !res; j++) { /* each stage: rounds, z (z_prev), the N models */
        avgpipe__stage *st = avgpipe__run_stage(run, w->replica, g = run->rst[j]);
        size_t count = run->d.param_count[g], n = count * sizeof(float);
        int momentum = run->d.averaging.momentum != 0.0f;
        uint64_t rounds = 0;
        unsigned char sh[16];
        size_t at = b->len + 16;
        avgpipe__put_u64(sh, 0);
        avgpipe__put_u64(sh + 8, (uint64_t)count);
        ok = avgpipe__ckpt_record(ctx, b, AVGPIPE__CK_STAGE, (uint32_t)g, NULL, 16 + n * (size_t)(1 + momentum + run->N)) &&
             avgpipe__buf_reserve(ctx, b, 16 + n * (size_t)(1 + momentum + run->N));
        if (!ok) break;
        memcpy(b->data + at, sh, 16);
        res = avgpipe_ea_save_state(ctx, st->ea, &rounds, (float *)(void *)(b->data + at + 16),
                                    momentum ? (float *)(void *)(b->data + at + 16 + n) : NULL);
        avgpipe__put_u64((unsigned char *)b->data + at, rounds);
        for (p = 0; p < run->N && !res; p++)
            res = avgpipe__run_copy(run, ctx, b->data + at + 16 + n * (size_t)(1 + momentum + p), avgpipe__run_params(run, w->replica, p, g), n,
                                    AVGPIPE_DEVICE_COPY_D2H, "checkpoint");
        b->len = at + 16 + n * (size_t)(1 + momentum + run->N);
    }
    if (ok && !res && run->d.cb.save_state && run->d.cb.save_state(w->rank, &user, run->d.cb.user) != 0)
        res = avgpipe__fail(ctx, AVGPIPE_CALLBACK_ERROR, "checkpoint: the save_state callback of rank %d failed", w->rank);
    ok = ok && avgpipe__ckpt_record(ctx, b, AVGPIPE__CK_USER, 0, user.data, user.len);
    avgpipe_buf_free(ctx, &user);
    if (!ok && !res) res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "checkpoint: out of memory");
    if (!res) {
        avgpipe__put_u64((unsigned char *)b->data + 48, (uint64_t)(b->len - AVGPIPE__CKPT_HEADER));
        avgpipe__put_u64((unsigned char *)b->data + 56, avgpipe__ckpt_sum((const unsigned char *)b->data, b->len));
    }
    return res;
}

/* Write bytes to path through path.tmp.<rank> and a rename (the old file, if any, stays whole until
   then; processes that write the same file on a shared directory each use their own temporary). */
static avgpipe_result avgpipe__write_atomic(avgpipe_context *ctx, const char *path, int rank, const void *data, size_t n) {
    char tmp[4200];
    FILE *f;
    int bad;
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, rank);
    f = fopen(tmp, "wb");
    if (!f) return avgpipe__fail(ctx, AVGPIPE_IO_ERROR, "checkpoint: cannot create '%s'", tmp);
    bad = fwrite(data, 1, n, f) != n;
    bad |= fflush(f) != 0;
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0) {
        remove(tmp);
        return avgpipe__fail(ctx, AVGPIPE_IO_ERROR, "checkpoint: cannot write '%s' (disk full, or no permission?)", path);
    }
    return AVGPIPE_OK;
}

static void avgpipe__ckpt_name(char *out, size_t cap, const char *dir, int rank, long long iter) {
    snprintf(out, cap, "%s/rank-%d-iter-%lld.ckpt", dir, rank, iter);
}

/* The manifest: the run's description (f<index>=value), each rank's file, the text's checksum. */
static int avgpipe__ckpt_manifest(avgpipe_run *run, const unsigned char *all, avgpipe_buf *m) {
    int64_t f[AVGPIPE__FP_FIELDS];
    int i, r, ok;
    char line[64];
    avgpipe__fingerprint(run, f);
    m->len = 0;
    ok = avgpipe__buf_printf(run->ctx, m, "# avgpipe checkpoint v%u\niteration %lld\nranks %d\ndesc", AVGPIPE__CKPT_VERSION, run->iter, run->P);
    for (i = 0; i < AVGPIPE__FP_FIELDS && ok; i++)
        if (avgpipe__ckpt_field(run, i)) ok = avgpipe__buf_printf(run->ctx, m, " f%d=%lld", i, (long long)f[i]);
    ok = ok && avgpipe__buf_put(run->ctx, m, "\n", 1);
    for (r = 0; r < run->P && ok; r++)
        ok = avgpipe__buf_printf(run->ctx, m, "rank %d file=rank-%d-iter-%lld.ckpt bytes=%llu checksum=%016llx\n", r, r, run->iter,
                                 (unsigned long long)avgpipe__get_u64(all + 24 * (size_t)r + 8),
                                 (unsigned long long)avgpipe__get_u64(all + 24 * (size_t)r + 16));
    snprintf(line, sizeof line, "end checksum=%016llx\n", (unsigned long long)avgpipe__fnv(14695981039346656037ull, m->data, m->len));
    return ok && avgpipe__buf_put(run->ctx, m, line, strlen(line));
}

AVGPIPE_API avgpipe_result avgpipe_run_save(avgpipe_run *run, const char *dir) {
    avgpipe_context *ctx;
    avgpipe_buf b = {NULL, 0, 0}, m = {NULL, 0, 0};
    unsigned char *mine, *all;
    char path[4200];
    avgpipe_result res = AVGPIPE_OK, mres;
    int k, r;
    if (!run || !dir) return avgpipe__fail(run ? run->ctx : NULL, AVGPIPE_INVALID_ARG, "avgpipe_run_save: NULL argument");
    ctx = run->ctx;
    if (run->dead) return avgpipe__fail(ctx, AVGPIPE_STATE_ERROR, "avgpipe_run_save: the run failed earlier (%s)", run->abort_msg);
    if (strlen(dir) > 4000) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_run_save: directory name too long");
    mine = (unsigned char *)avgpipe__calloc(ctx, (size_t)(run->nlocal + run->P), 24);
    if (!mine) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_save: out of memory");
    all = mine + 24 * (size_t)run->nlocal;
    for (k = 0; k < run->nlocal && !res; k++) { /* each local rank's file; a failure is still reported to the others */
        avgpipe__ckpt_name(path, sizeof path, dir, run->w[k].rank, run->iter);
        res = avgpipe__ckpt_build(run, &run->w[k], &b);
        if (!res) res = avgpipe__write_atomic(ctx, path, run->w[k].rank, b.data, b.len);
        avgpipe__put_u64(mine + 24 * (size_t)k, (uint64_t)res);
        avgpipe__put_u64(mine + 24 * (size_t)k + 8, res ? 0 : (uint64_t)b.len);
        avgpipe__put_u64(mine + 24 * (size_t)k + 16, res ? 0 : avgpipe__get_u64((const unsigned char *)b.data + 56));
    }
    for (; k < run->nlocal; k++) avgpipe__put_u64(mine + 24 * (size_t)k, (uint64_t)AVGPIPE_ABORTED);
    mres = avgpipe__ctl_allgather(run, mine, 24, all, AVGPIPE__TAG_CTL + 10, "avgpipe_run_save");
    for (r = 0; r < run->P && !res && !mres; r++)
        if (avgpipe__get_u64(all + 24 * (size_t)r) != 0)
            res = avgpipe__fail(ctx, AVGPIPE_IO_ERROR, "avgpipe_run_save: rank %d could not write its checkpoint file (see its error)", r);
    if (!res) res = mres;
    if (!res && !avgpipe__ckpt_manifest(run, all, &m)) res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_save: out of memory");
    if (!res) {
        snprintf(path, sizeof path, "%s/manifest", dir);
        res = avgpipe__write_atomic(ctx, path, run->w[0].rank, m.data, m.len);
    }
    if (!res && run->ckpt_prev >= 0 && run->ckpt_prev != run->iter)
        for (k = 0; k < run->nlocal; k++) { /* the new checkpoint is in place: the previous one's files go */
            avgpipe__ckpt_name(path, sizeof path, dir, run->w[k].rank, run->ckpt_prev);
            remove(path);
        }
    if (!res) run->ckpt_prev = run->iter;
    avgpipe_buf_free(ctx, &b);
    avgpipe_buf_free(ctx, &m);
    avgpipe_free(ctx, mine);
    return res;
}

/* A local rank's verified file, parsed: where its records are. */
typedef struct avgpipe__ckpt_file {
    avgpipe_buf data;
    const unsigned char *run_rec, *user;
    size_t run_len, user_len;
    uint32_t run_id;
    const unsigned char *stage[64]; /* the stage records of this rank's stages (by chunk) */
} avgpipe__ckpt_file;

/* Read the manifest: check its checksum and format, that it was made by this run (naming the first
   field that differs), and find rank `rank`'s file, size and checksum. */
static avgpipe_result avgpipe__ckpt_manifest_read(avgpipe_run *run, const char *dir, const avgpipe_buf *t, long long *iter,
                                                  int rank, char *file, size_t cap, unsigned long long *bytes, unsigned long long *sum) {
    avgpipe_context *ctx = run->ctx;
    const char *end = t->data ? strstr(t->data, "\nend checksum=") : NULL, *p, *d;
    unsigned long long want = 0;
    int64_t f[AVGPIPE__FP_FIELDS];
    int v = 0, ranks = 0, i, r;
    char key[32];
    char canon[64];
    if (end && sscanf(end + 14, "%16llx", &want) == 1) /* the checksum line exactly as written, and nothing after it */
        snprintf(canon, sizeof canon, "end checksum=%016llx\n", want);
    if (!end || strcmp(end + 1, canon) != 0 || t->len != (size_t)(end + 1 - t->data) + strlen(canon) ||
        avgpipe__fnv(14695981039346656037ull, t->data, (size_t)(end + 1 - t->data)) != want)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "checkpoint '%s/manifest': truncated or corrupted (its checksum does not match)", dir);
    if (sscanf(t->data, "# avgpipe checkpoint v%d\niteration %lld\nranks %d\n", &v, iter, &ranks) != 3 || v != (int)AVGPIPE__CKPT_VERSION)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "checkpoint '%s/manifest': not an avgpipe checkpoint of format v%u", dir, AVGPIPE__CKPT_VERSION);
    if (ranks != run->P)
        return avgpipe__fail(ctx, AVGPIPE_MISMATCH, "checkpoint '%s' holds %d ranks; this run has %d", dir, ranks, run->P);
    avgpipe__fingerprint(run, f);
    d = strstr(t->data, "\ndesc");
    for (i = 0; d && i < AVGPIPE__FP_FIELDS; i++) {
        long long got;
        if (!avgpipe__ckpt_field(run, i)) continue;
        snprintf(key, sizeof key, " f%d=", i);
        p = strstr(d, key);
        if ((!p || p > strchr(d + 1, '\n')) && i >= 25) got = 0; /* written before ties and agreement existed */
        else if (!p || p > strchr(d + 1, '\n') || sscanf(p + strlen(key), "%lld", &got) != 1)
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "checkpoint '%s/manifest': no %s", dir, avgpipe__fp_names[i]);
        if (got != f[i])
            return avgpipe__fail(ctx, AVGPIPE_MISMATCH, "checkpoint '%s' was made by another run: its %s differs from this run's%s", dir,
                                 avgpipe__fp_names[i], i < 14 ? "" : " (compare the flags it was made with)");
    }
    snprintf(key, sizeof key, "\nrank %d file=", rank);
    p = strstr(t->data, key);
    if (!p || sscanf(p + 1, "rank %d file=%255s bytes=%llu checksum=%16llx", &r, file, bytes, sum) != 4 || r != rank || cap < 256)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "checkpoint '%s/manifest': no entry for rank %d", dir, rank);
    return AVGPIPE_OK;
}

/* Read and verify local worker w's file; find its records. Nothing of the run is changed. */
static avgpipe_result avgpipe__ckpt_read(avgpipe_run *run, const char *dir, avgpipe__worker *w, long long *iter, avgpipe__ckpt_file *out) {
    int j;
    avgpipe_context *ctx = run->ctx;
    avgpipe_buf man = {NULL, 0, 0};
    char name[256], path[4400];
    unsigned long long bytes = 0, sum = 0;
    const unsigned char *q, *e;
    avgpipe_result res;
    int g;
    snprintf(path, sizeof path, "%s/manifest", dir);
    {
        static const avgpipe__file_kind manifest = {"checkpoint manifest", "the most a checkpoint manifest may hold", (size_t)1 << 24, 0};
        res = avgpipe__read_file(ctx, path, &man, &manifest);
    }
    if (!res) res = avgpipe__ckpt_manifest_read(run, dir, &man, iter, w->rank, name, sizeof name, &bytes, &sum);
    avgpipe_buf_free(ctx, &man);
    if (res) return res;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    {
        /* a rank's file holds what the manifest says (no cap of its own: a model's parameters can be GBs) */
        avgpipe__file_kind data = {"checkpoint", "the size its manifest gives", 0, 0};
        data.max = bytes < (unsigned long long)((size_t)-1 - 1) ? (size_t)bytes : (size_t)-1 - 1;
        if ((res = avgpipe__read_file(ctx, path, &out->data, &data)) != AVGPIPE_OK) return res;
    }
    q = (const unsigned char *)out->data.data;
    if (out->data.len != bytes || bytes < AVGPIPE__CKPT_HEADER)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "checkpoint '%s': %zu bytes, the manifest says %llu (truncated?)", path, out->data.len, bytes);
    if (avgpipe__ckpt_sum(q, out->data.len) != sum || avgpipe__get_u64(q + 56) != sum)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "checkpoint '%s' is corrupted: its checksum does not match", path);
    if (memcmp(q, "AVGPCKPT", 8) || avgpipe__get_u32(q + 8) != AVGPIPE__CKPT_VERSION || avgpipe__get_u32(q + 12) != AVGPIPE__CKPT_ENDIAN)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "checkpoint '%s': not an avgpipe rank file of format v%u from a machine of this byte order", path,
                             AVGPIPE__CKPT_VERSION);
    if ((long long)avgpipe__get_u64(q + 16) != *iter || (int)avgpipe__get_u32(q + 24) != w->rank || (int)avgpipe__get_u32(q + 28) != run->P ||
        (int)avgpipe__get_u32(q + 32) != run->G || (int)avgpipe__get_u32(q + 36) != run->N || (int)avgpipe__get_u32(q + 40) != run->D ||
        avgpipe__get_u64(q + 48) != bytes - AVGPIPE__CKPT_HEADER)
        return avgpipe__fail(ctx, AVGPIPE_MISMATCH, "checkpoint '%s' belongs to another rank, iteration or shape", path);
    for (q += AVGPIPE__CKPT_HEADER, e = (const unsigned char *)out->data.data + bytes; q < e;) { /* the records */
        uint32_t tag, id;
        uint64_t n;
        if ((size_t)(e - q) < 16 || (n = avgpipe__get_u64(q + 8)) > (uint64_t)(e - q - 16))
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "checkpoint '%s': a record runs past the end", path);
        tag = avgpipe__get_u32(q), id = avgpipe__get_u32(q + 4);
        if (tag == AVGPIPE__CK_RUN) out->run_rec = q + 16, out->run_len = (size_t)n, out->run_id = id;
        else if (tag == AVGPIPE__CK_USER) out->user = q + 16, out->user_len = (size_t)n;
        else if (tag == AVGPIPE__CK_STAGE && (int)id < run->G && run->place[id] == w->srank && run->chunk[id] < 64) {
            size_t count = run->d.param_count[id], want = 16 + count * sizeof(float) * (size_t)(1 + (run->d.averaging.momentum != 0.0f) + run->N);
            if (n != want || avgpipe__get_u64(q + 24) != count)
                return avgpipe__fail(ctx, AVGPIPE_MISMATCH, "checkpoint '%s': stage %u holds another number of parameters", path, id);
            out->stage[run->chunk[id]] = q + 16;
        } else
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "checkpoint '%s': unknown record %u/%u", path, tag, id);
        q += 16 + n;
    }
    AVGPIPE__RANK_STAGES(run, w->srank, j, g)
        if (!out->stage[run->chunk[g]]) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "checkpoint '%s': no state for stage %d", path, g);
    if (!out->run_rec || out->run_len < 4 * sizeof(double)) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "checkpoint '%s': no run state", path);
    return AVGPIPE_OK;
}

/* Put a verified file's state into the run, the user's parameters and the user's state. */
static avgpipe_result avgpipe__ckpt_apply(avgpipe_run *run, avgpipe__worker *w, const avgpipe__ckpt_file *f) {
    avgpipe_context *ctx = run->ctx;
    avgpipe_result res = AVGPIPE_OK;
    int g, p, j, momentum = run->d.averaging.momentum != 0.0f;
    for (j = run->roff[w->srank]; j < run->roff[w->srank + 1] && !res; j++) {
        const unsigned char *q = f->stage[j - run->roff[w->srank]];
        avgpipe__stage *st = avgpipe__run_stage(run, w->replica, g = run->rst[j]);
        size_t n = run->d.param_count[g] * sizeof(float);
        uint64_t rounds = avgpipe__get_u64(q);
        res = avgpipe_ea_load_state(ctx, st->ea, rounds, (const float *)(const void *)(q + 16),
                                    momentum ? (const float *)(const void *)(q + 16 + n) : NULL);
        for (p = 0; p < run->N && !res; p++) {
            res = avgpipe__run_copy(run, ctx, avgpipe__run_params(run, w->replica, p, g), q + 16 + n * (size_t)(1 + momentum + p), n,
                                    AVGPIPE_DEVICE_COPY_H2D, "checkpoint");
            st->avg_done[p] = (int)rounds;
        }
    }
    if (!res && run->d.cb.load_state && run->d.cb.load_state(w->rank, f->user ? f->user : (const unsigned char *)"", f->user_len, run->d.cb.user) != 0)
        res = avgpipe__fail(ctx, AVGPIPE_CALLBACK_ERROR, "checkpoint: the load_state callback of rank %d failed", w->rank);
    return res;
}

AVGPIPE_API avgpipe_result avgpipe_run_load(avgpipe_run *run, const char *dir) {
    avgpipe_context *ctx;
    avgpipe__ckpt_file *files;
    unsigned char *mine, *all;
    avgpipe_result res = AVGPIPE_OK, mres;
    long long iter = -1;
    int k, r;
    if (!run || !dir) return avgpipe__fail(run ? run->ctx : NULL, AVGPIPE_INVALID_ARG, "avgpipe_run_load: NULL argument");
    ctx = run->ctx;
    if (run->dead) return avgpipe__fail(ctx, AVGPIPE_STATE_ERROR, "avgpipe_run_load: the run failed earlier (%s)", run->abort_msg);
    if (strlen(dir) > 4000) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_run_load: directory name too long");
    files = (avgpipe__ckpt_file *)avgpipe__calloc(ctx, (size_t)run->nlocal, sizeof *files);
    mine = (unsigned char *)avgpipe__calloc(ctx, (size_t)(run->nlocal + run->P), 8);
    if (!files || !mine) {
        avgpipe_free(ctx, files);
        avgpipe_free(ctx, mine);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_load: out of memory");
    }
    all = mine + 8 * (size_t)run->nlocal;
    for (k = 0; k < run->nlocal; k++) { /* verify everything first */
        avgpipe_result e = res ? AVGPIPE_ABORTED : avgpipe__ckpt_read(run, dir, &run->w[k], &iter, &files[k]);
        if (e && !res) res = e;
        avgpipe__put_u64(mine + 8 * (size_t)k, (uint64_t)(e ? 1 : 0));
    }
    mres = avgpipe__ctl_allgather(run, mine, 8, all, AVGPIPE__TAG_CTL + 12, "avgpipe_run_load");
    for (r = 0; r < run->P && !res && !mres; r++)
        if (avgpipe__get_u64(all + 8 * (size_t)r))
            res = avgpipe__fail(ctx, AVGPIPE_IO_ERROR, "avgpipe_run_load: rank %d could not load the checkpoint '%s' (see its error)", r, dir);
    if (!res) res = mres;
    if (!res) { /* the run: iteration, K, the adaptive controller (all ranks' files agree on it) */
        double rs[4 + 64];
        uint32_t id = files[0].run_id;
        int i, n = (int)(id >> 16 & 0xff);
        memcpy(rs, files[0].run_rec, files[0].run_len < sizeof rs ? files[0].run_len : sizeof rs);
        run->iter = iter;
        if ((int)rs[1] != run->K) {
            run->K = (int)rs[1];
            res = avgpipe__run_prepare(run);
        }
        run->best_k = (int)rs[2], run->best = rs[3];
        run->adapt_done = (int)(id >> 8 & 1);
        run->win_n = n == run->d.window && (size_t)(4 + n) * sizeof(double) <= files[0].run_len ? (int)(id & 0xff) : 0;
        for (i = 0; i < run->win_n; i++) run->win[i] = rs[4 + i];
    }
    for (k = 0; k < run->nlocal && !res; k++) {
        res = avgpipe__ckpt_apply(run, &run->w[k], &files[k]);
        if (res) run->dead = 1; /* partly restored: not a state to train on */
    }
    if (!res) run->ckpt_prev = iter;
    for (k = 0; k < run->nlocal; k++) avgpipe_buf_free(ctx, &files[k].data);
    avgpipe_free(ctx, files);
    avgpipe_free(ctx, mine);
    return res;
}
#endif

/* --- 19. Run lifecycle: create, iterate, destroy, adaptive K, the memory model ---------------- */

/* The floats of stage-rank r's tie receive buffer: its longest tie range with a stage on another rank. */
static size_t avgpipe__tie_floats(const avgpipe_run *run, int r) {
    size_t n = 0;
    int t;
    for (t = 0; t < run->nties; t++) {
        int ra = run->place[run->ties[t].stage_a], rb = run->place[run->ties[t].stage_b];
        if (ra != rb && (ra == r || rb == r) && run->ties[t].count > n) n = run->ties[t].count;
    }
    return n;
}

/* run->staged: the floats of stage-rank r's host copies, a whole partition's gradients (or a tied
   range, if larger) in hstage[0] and a tied range in hstage[1]. */
static void avgpipe__stage_floats(const avgpipe_run *run, int r, size_t *n0, size_t *n1) {
    size_t pc = 0, tc = 1;
    int j, g;
    AVGPIPE__RANK_STAGES(run, r, j, g) if (run->d.param_count[g] > pc) pc = run->d.param_count[g];
    for (j = 0; j < run->nties; j++) tc = run->ties[j].count > tc ? run->ties[j].count : tc;
    *n0 = pc > tc ? pc : tc, *n1 = tc;
}

/* The bytes of stage-rank r's tie and agreement buffers (host memory; with gradients on a device also
   the host copies they are summed in). */
static double avgpipe__sync_bytes(const avgpipe_run *run, int r) {
    double b = (double)avgpipe__tie_floats(run, r) * sizeof(float);
    if (run->agreeing) b += (double)((2 * (size_t)run->G + (size_t)run->N) * (size_t)run->wagree) * sizeof(double);
    if (run->staged) {
        size_t n0, n1;
        avgpipe__stage_floats(run, r, &n0, &n1);
        b += (double)(n0 + n1) * sizeof(float);
    }
    return b;
}

/* desc.ties and desc.agree checked (each field named) and taken: the copy of the ties, the ranges each
   partition leaves out of its sum of squares, the agreement's width. Needs the shape (G, place). */
static avgpipe_result avgpipe__run_ties(avgpipe_context *ctx, avgpipe_run *run) {
    const avgpipe_run_desc *d = &run->d;
    const avgpipe_agree_desc *a = &d->agree;
    int t, u, g, k, n;
    if (d->nties < 0 || (d->nties > 0 && !d->ties) || (d->ties && !d->nties))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "ties, nties: %d ties with ties %s", d->nties, d->ties ? "given" : "NULL");
    if (a->width < 0 || a->width > 1024 || (a->width > 0) != (a->contribute != NULL))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "agree.width, agree.contribute: width %d (0..1024) needs contribute, and contribute a width", a->width);
    if (avgpipe__nan(a->clip_norm) || a->clip_norm < 0 || a->clip_norm > 1e300)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "agree.clip_norm: %g (>= 0, finite; 0 = no clipping)", a->clip_norm);
    if (a->skip_nonfinite != 0 && a->skip_nonfinite != 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "agree.skip_nonfinite: %d (0 or 1)", a->skip_nonfinite);
    run->agreeing = a->width > 0 || a->clip_norm > 0 || a->skip_nonfinite;
    run->builtin = a->clip_norm > 0 || a->skip_nonfinite;
    run->wagree = (run->builtin ? 2 : 0) + a->width;
    if (!d->nties && !run->agreeing) return AVGPIPE_OK;
    run->staged = d->device && strcmp(d->device->name ? d->device->name : "", "cpu") != 0; /* the CPU device's memory is the host's */
    for (t = 0; t < d->nties; t++) {
        const avgpipe_tie *x = &d->ties[t];
        if (x->stage_a < 0 || x->stage_a >= run->G || x->stage_b < 0 || x->stage_b >= run->G)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "ties[%d]: stages %d and %d (the model has partitions 0..%d)", t, x->stage_a, x->stage_b, run->G - 1);
        if (x->stage_a == x->stage_b)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "ties[%d]: stage_a and stage_b are both %d (a partition tied to itself)", t, x->stage_a);
        if (x->count < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "ties[%d].count: 0 (a range has at least one float)", t);
        if (d->param_count && (x->offset_a > d->param_count[x->stage_a] || x->count > d->param_count[x->stage_a] - x->offset_a))
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "ties[%d].offset_a: floats %zu .. %zu of stage %d, which has %zu (param_count[%d])", t,
                                 x->offset_a, x->offset_a + x->count - 1, x->stage_a, d->param_count[x->stage_a], x->stage_a);
        if (d->param_count && (x->offset_b > d->param_count[x->stage_b] || x->count > d->param_count[x->stage_b] - x->offset_b))
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "ties[%d].offset_b: floats %zu .. %zu of stage %d, which has %zu (param_count[%d])", t,
                                 x->offset_b, x->offset_b + x->count - 1, x->stage_b, d->param_count[x->stage_b], x->stage_b);
        for (u = 0; u < t; u++) { /* no float of a partition in two ties */
            const avgpipe_tie *y = &d->ties[u];
            int sx, sy;
            for (sx = 0; sx < 2; sx++)
                for (sy = 0; sy < 2; sy++) {
                    int gx = sx ? x->stage_b : x->stage_a, gy = sy ? y->stage_b : y->stage_a;
                    size_t ox = sx ? x->offset_b : x->offset_a, oy = sy ? y->offset_b : y->offset_a;
                    if (gx == gy && ox < oy + y->count && oy < ox + x->count)
                        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "ties[%d] overlaps ties[%d] in stage %d (floats %zu .. %zu and %zu .. %zu)", t, u, gx, ox,
                                             ox + x->count - 1, oy, oy + y->count - 1);
                }
        }
    }
    run->nties = d->nties;
    run->ties = (avgpipe_tie *)avgpipe_alloc(ctx, (size_t)(d->nties ? d->nties : 1) * sizeof(avgpipe_tie));
    run->excl_start = (int *)avgpipe__calloc(ctx, (size_t)run->G + 1, sizeof(int));
    run->excl = (size_t *)avgpipe_alloc(ctx, (size_t)(2 * d->nties + 1) * sizeof(size_t));
    if (!run->ties || !run->excl_start || !run->excl) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_create: out of memory");
    if (d->nties) memcpy(run->ties, d->ties, (size_t)d->nties * sizeof(avgpipe_tie));
    for (g = 0, n = 0; g < run->G; g++) { /* the higher-numbered side of each tie, by offset */
        run->excl_start[g] = n;
        for (t = 0; t < run->nties; t++) {
            const avgpipe_tie *x = &run->ties[t];
            size_t off = x->stage_a > x->stage_b ? x->offset_a : x->offset_b;
            if ((x->stage_a > x->stage_b ? x->stage_a : x->stage_b) != g) continue;
            for (k = n; k > run->excl_start[g] && run->excl[2 * (k - 1)] > off; k--) {
                run->excl[2 * k] = run->excl[2 * (k - 1)];
                run->excl[2 * k + 1] = run->excl[2 * (k - 1) + 1];
            }
            run->excl[2 * k] = off;
            run->excl[2 * k + 1] = x->count;
            n++;
        }
    }
    run->excl_start[run->G] = n;
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__run_check(avgpipe_context *ctx, avgpipe_run *run) {
    const avgpipe_run_desc *d = &run->d;
    int k, g, p, j;
    avgpipe_result res;
    if (!d->cb.forward) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "cb.forward: required");
    if (!d->cb.backward && !(d->cb.backward_input && d->cb.backward_weight))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "cb.backward: required (or both backward_input and backward_weight)");
    if (!d->cb.backward_input != !d->cb.backward_weight)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "cb.backward_input, cb.backward_weight: give both or neither");
    if (run->G > 1 && !d->act_bytes) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "act_bytes: required for %d stages (one entry per boundary)", run->G);
    if (!d->params || !d->param_count) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "params, param_count: required");
    for (g = 0; g < run->G; g++)
        if (d->param_count[g] < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "param_count[%d]: must be >= 1", g);
    for (k = 0; k < run->nlocal; k++) /* the local ranks' partitions of every model */
        AVGPIPE__RANK_STAGES(run, run->w[k].srank, j, g)
            for (p = 0; p < run->N; p++)
                if (!avgpipe__run_params(run, run->w[k].replica, p, g))
                    return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "params[%d]: NULL (replica %d, pipeline %d, stage %d, run by local rank %d)",
                                         (run->w[k].replica * run->N + p) * run->G + g, run->w[k].replica, p, g, run->w[k].rank);
    {
        const avgpipe_ea_desc *a = &d->averaging;
        const char *set = a->count ? "count" : a->pipes ? "pipes" : a->initial ? "initial" : a->device ? "device" : a->stage ? "stage"
                          : a->hold_every ? "hold_every" : a->check_on_device ? "check_on_device" : a->no_finite_check ? "no_finite_check" : NULL;
        if (set)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "averaging.%s: the run sets it for each stage partition%s (leave it 0)", set,
                                 a->no_finite_check ? " and always guards against non-finite models" : "");
    }
    if (avgpipe__nan(d->timeout_s) || d->timeout_s < 0 || avgpipe__nan(d->mem_limit) || d->mem_limit < 0 || d->window < 0)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "timeout_s, mem_limit and window must be >= 0 (and not NaN)");
    if (d->adaptive && (d->schedule || d->sched.kind != AVGPIPE_SCHED_ADVANCE))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "adaptive: needs sched.kind = AVGPIPE_SCHED_ADVANCE and no custom schedule");
    if ((res = avgpipe__run_ties(ctx, run)) != AVGPIPE_OK) return res;
    if (!!d->cb.step + !!d->cb.step_async + !!d->cb.step_agreed > 1)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "cb.step, cb.step_async, cb.step_agreed: give one of them");
    if (run->agreeing && !d->cb.step_agreed)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "cb.step_agreed: required with agree (%s): the step receives the agreement",
                             d->agree.width ? "width" : d->agree.clip_norm > 0 ? "clip_norm" : "skip_nonfinite");
    if (d->reseed_nonfinite && run->nties)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "reseed_nonfinite with ties: a partition is re-seeded on its own, which would leave its tied "
                                                       "copies apart for good; use agree.skip_nonfinite (a non-finite gradient then never reaches the parameters)");
    if (d->reseed_nonfinite != 0 && d->reseed_nonfinite != 1)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "reseed_nonfinite: %d (0 or 1)", d->reseed_nonfinite);
    if (d->variable_bytes != 0 && d->variable_bytes != 1)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "variable_bytes: %d (0 or 1)", d->variable_bytes);
    if ((run->nties || run->builtin) && !d->grads)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "grads: required with %s (the gradient buffers, indexed as params)",
                             run->nties ? "ties" : d->agree.clip_norm > 0 ? "agree.clip_norm" : "agree.skip_nonfinite");
    for (k = 0; d->grads && k < run->nlocal; k++)
        AVGPIPE__RANK_STAGES(run, run->w[k].srank, j, g)
            for (p = 0; p < run->N; p++)
                if (!avgpipe__run_grads(run, run->w[k].replica, p, g))
                    return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "grads[%d]: NULL (replica %d, pipeline %d, stage %d, run by local rank %d)",
                                         (run->w[k].replica * run->N + p) * run->G + g, run->w[k].replica, p, g, run->w[k].rank);
    return AVGPIPE_OK;
}

/* Which ranks run here: desc.local_ranks (checked, sorted), or all of them. */
static avgpipe_result avgpipe__run_locals(avgpipe_context *ctx, avgpipe_run *run) {
    const avgpipe_run_desc *d = &run->d;
    int k, i, n = d->local_ranks ? d->local_count : run->P;
    if (d->local_ranks && (d->local_count < 1 || d->local_count > run->P))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "local_count: %d with local_ranks given (1..%d)", d->local_count, run->P);
    if (!d->local_ranks && d->local_count)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "local_count: %d without local_ranks", d->local_count);
    run->w = (avgpipe__worker *)avgpipe__calloc(ctx, (size_t)n, sizeof(avgpipe__worker));
    if (!run->w) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_create: out of memory");
    for (k = 0; k < n; k++) {
        int r = d->local_ranks ? d->local_ranks[k] : k;
        if (r < 0 || r >= run->P)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "local_ranks[%d]: rank %d outside 0..%d (%d replica groups of %d ranks)", k, r,
                                 run->P - 1, run->D, run->S);
        for (i = k; i > 0 && run->w[i - 1].rank > r; i--) run->w[i] = run->w[i - 1]; /* insertion sort */
        run->w[i].rank = r;
    }
    for (k = 0; k < n; k++) {
        if (k > 0 && run->w[k].rank == run->w[k - 1].rank)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "local_ranks: rank %d is listed twice", run->w[k].rank);
        run->w[k].run = run;
        run->w[k].replica = run->w[k].rank / run->S;
        run->w[k].srank = run->w[k].rank % run->S;
    }
    run->nlocal = n;
    run->all_local = n == run->P;
    return AVGPIPE_OK;
}

/* The comm backend: the user's (checked), or the in-process one when every rank runs here. */
static avgpipe_result avgpipe__run_comm(avgpipe_context *ctx, avgpipe_run *run) {
    avgpipe_result res;
    if (!run->d.comm) {
        if (!run->all_local)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "comm: required when local_ranks leaves ranks to other processes");
        /* on a device (not the CPU one) its memory moves by the device's copies: the host never touches it */
        res = avgpipe_comm_local_create_on(ctx, run->P, run->d.device, &run->comm);
        run->own_comm = !res;
        return res;
    }
    run->comm = *run->d.comm;
    if ((res = avgpipe_comm_check(ctx, &run->comm)) != AVGPIPE_OK) return res;
    if (run->comm.size != run->P)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "comm: size %d but the run has %d ranks (%d replica groups x %d)", run->comm.size, run->P,
                             run->D, run->S);
    return AVGPIPE_OK;
}

/* Replica groups: each local rank joins the sub-communicator of the D ranks that hold its stages. */
static avgpipe_result avgpipe__run_groups(avgpipe_context *ctx, avgpipe_run *run) {
    int k, d, *members;
    avgpipe_result res = AVGPIPE_OK;
    if (run->D == 1) return AVGPIPE_OK;
    if (!run->comm.split || !run->comm.allreduce_sum)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "comm '%s': replicas need its split and allreduce_sum entries",
                             run->comm.name ? run->comm.name : "?");
    if (!run->dev.scale) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "device '%s': replicas need its scale entry", run->dev.name);
    members = (int *)avgpipe_alloc(ctx, (size_t)run->D * sizeof(int));
    if (!members) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_create: out of memory");
    for (k = 0; k < run->nlocal && !res; k++) {
        avgpipe__worker *w = &run->w[k];
        for (d = 0; d < run->D; d++) members[d] = d * run->S + w->srank;
        res = run->comm.split(run->comm.user, w->rank, members, run->D, &w->group);
        if (res)
            res = avgpipe__fail(ctx, res, "comm '%s': rank %d cannot form its replica group: %s", run->comm.name ? run->comm.name : "?", w->rank,
                                run->comm.last_error ? run->comm.last_error(run->comm.user, w->rank) : "");
        else
            w->has_group = 1;
    }
    avgpipe_free(ctx, members);
    return res;
}

/* Each local worker's communicator over the S ranks of its replica group (comm.split; it is srank
   there): the ties' and agreement's (sizes 0: w->sync) or the micro-batches' sizes' (1: w->zcomm). */
static avgpipe_result avgpipe__split_groups(avgpipe_context *ctx, avgpipe_run *run, int sizes) {
    int k, q, *members = (int *)avgpipe_alloc(ctx, (size_t)run->S * sizeof(int));
    avgpipe_result res = AVGPIPE_OK;
    if (!members) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_create: out of memory");
    for (k = 0; k < run->nlocal && !res; k++) {
        avgpipe__worker *w = &run->w[k];
        for (q = 0; q < run->S; q++) members[q] = w->replica * run->S + q;
        res = run->comm.split(run->comm.user, w->rank, members, run->S, sizes ? &w->zcomm : &w->sync);
        if (res)
            res = avgpipe__fail(ctx, res, "comm '%s': rank %d cannot form the communicator of %s: %s", run->comm.name ? run->comm.name : "?", w->rank,
                                sizes ? "the micro-batches' sizes" : "its ties and agreement",
                                run->comm.last_error ? run->comm.last_error(run->comm.user, w->rank) : "");
        else
            *(sizes ? &w->has_zcomm : &w->has_sync) = 1;
    }
    avgpipe_free(ctx, members);
    return res;
}

/* Variable sizes as messages of their own (run->sized): each local worker's communicator for them. */
static avgpipe_result avgpipe__run_sizes(avgpipe_context *ctx, avgpipe_run *run) {
    if (!run->sized || run->S == 1) return AVGPIPE_OK;
    if (!run->comm.split)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "variable_bytes over comm '%s' (%s): the sizes travel on a communicator of their own, which needs its "
                             "split entry", run->comm.name ? run->comm.name : "?", run->ordered ? "device-ordered transfers" : "exact_bytes");
    return avgpipe__split_groups(ctx, run, 1);
}

/* Ties and agreement: each local worker's buffers and, when they cross ranks, its communicator for
   them (comm.split over the S ranks of its replica group, so they keep their own order). */
static avgpipe_result avgpipe__run_sync(avgpipe_context *ctx, avgpipe_run *run) {
    int k, q, cross = 0;
    if (!run->nties && !run->agreeing) return AVGPIPE_OK;
    for (q = 0; q < run->S; q++) cross |= avgpipe__tie_floats(run, q) > 0;
    cross |= run->agreeing && run->S > 1;
    for (k = 0; k < run->nlocal; k++) {
        avgpipe__worker *w = &run->w[k];
        size_t nt = avgpipe__tie_floats(run, w->srank), W = (size_t)run->wagree;
        w->counts_skips = k == 0 || run->w[k - 1].replica != w->replica; /* the first local rank of each group */
        w->tie_buf = nt ? (float *)avgpipe_alloc(ctx, nt * sizeof(float)) : NULL;
        if (run->staged) {
            size_t n0, n1;
            avgpipe__stage_floats(run, w->srank, &n0, &n1);
            w->hstage[0] = (float *)avgpipe_alloc(ctx, n0 * sizeof(float));
            w->hstage[1] = (float *)avgpipe_alloc(ctx, n1 * sizeof(float));
            if (!w->hstage[0] || !w->hstage[1]) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_create: out of memory");
        }
        w->agree_tab = (double *)avgpipe__calloc(ctx, (2 * (size_t)run->G + (size_t)run->N) * W + 1, sizeof(double));
        w->agreed = w->agree_tab + 2 * (size_t)run->G * W;
        w->agree_round = (int *)avgpipe_alloc(ctx, (size_t)run->N * sizeof(int));
        w->tie_round = (int *)avgpipe_alloc(ctx, (size_t)run->N * (size_t)(run->nties + 1) * sizeof(int));
        w->sreq = (avgpipe_comm_request *)avgpipe__calloc(ctx, 2 * (size_t)run->S, sizeof(avgpipe_comm_request));
        w->speer = (int *)avgpipe__calloc(ctx, 2 * (size_t)run->S, sizeof(int));
        if ((nt && !w->tie_buf) || !w->agree_tab || !w->agree_round || !w->tie_round || !w->sreq || !w->speer)
            return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_create: out of memory");
        for (q = 0; q < run->N; q++) w->agree_round[q] = -1;
        for (q = 0; q < run->N * (run->nties + 1); q++) w->tie_round[q] = -1;
    }
    if (!cross) return AVGPIPE_OK;
    if (!run->comm.split)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "comm '%s': ties and agreement between ranks need its split entry (they travel on a communicator of their own)",
                             run->comm.name ? run->comm.name : "?");
    return avgpipe__split_groups(ctx, run, 0);
}

static avgpipe_result avgpipe__run_start(avgpipe_run *run) {
    int k, g, j, p;
    avgpipe_result res;
    for (k = 0; k < run->nlocal; k++) /* averaging: one module per local stage partition */
        AVGPIPE__RANK_STAGES(run, run->w[k].srank, j, g) {
            avgpipe__stage *st = avgpipe__run_stage(run, run->w[k].replica, g);
            avgpipe_ea_desc ed;
            memset(&ed, 0, sizeof ed);
            ed.count = run->d.param_count[g];
            ed.pipes = run->N;
            ed.mode = run->d.averaging.mode;
            ed.alpha = run->d.averaging.alpha;
            ed.momentum = run->d.averaging.momentum;
            ed.initial = run->d.reference && run->d.reference[g] ? run->d.reference[g] : avgpipe__run_params(run, run->w[k].replica, 0, g);
            ed.device = &run->dev;
            ed.stage = g;
            ed.hold_every = run->D > 1 ? run->H : 0;
            /* no host wait per AVG, read at the iteration's end; re-seeding needs the host's check (a refused contribution) */
            ed.check_on_device = run->dev.flag_nonfinite != NULL && !run->d.reseed_nonfinite;
            if ((res = avgpipe_ea_create(run->ctx, &ed, &st->ea)) != AVGPIPE_OK) return res;
            st->avg_done = (int *)avgpipe__calloc(run->ctx, (size_t)run->N, sizeof(int));
            st->ev_step = (avgpipe_device_event *)avgpipe__calloc(run->ctx, 2 * (size_t)run->N, sizeof(avgpipe_device_event));
            if (!st->avg_done || !st->ev_step) return avgpipe__fail(run->ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory");
            st->ev_avg = st->ev_step + run->N;
            for (p = 0; p < 2 * run->N; p++)
                if ((res = run->dev.event_create(run->dev.user, &st->ev_step[p])) != AVGPIPE_OK)
                    return avgpipe__fail(run->ctx, res, "runtime: device '%s' cannot create events: %s", run->dev.name,
                                         run->dev.error_string ? run->dev.error_string(run->dev.user) : "");
        }
    for (k = 0; k < run->nlocal; k++)
        if ((res = avgpipe__worker_streams(run, &run->w[k])) != AVGPIPE_OK) return res;
    for (k = 0; k < run->nlocal; k++) {
        avgpipe__worker *w = &run->w[k];
        pthread_mutex_init(&w->cbmu, NULL);
        w->cb_ready = 1;
        avgpipe_context_init(&w->ctx, &run->ctx->desc);
        avgpipe_context_init(&w->avg_ctx, &run->ctx->desc);
        w->jcap = 2 * run->N * run->G * run->R + 16; /* AVG jobs of one iteration fit */
        w->jobs = (avgpipe__job *)avgpipe__calloc(run->ctx, (size_t)w->jcap, sizeof(avgpipe__job));
        w->seq = (int *)avgpipe__calloc(run->ctx, (size_t)run->P, sizeof(int));
        w->rseq = (int *)avgpipe__calloc(run->ctx, (size_t)run->P, sizeof(int));
        if (!w->jobs || !w->seq || !w->rseq) return avgpipe__fail(run->ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory");
        if (pthread_create(&w->thread, NULL, avgpipe__worker_main, w) != 0)
            return avgpipe__fail(run->ctx, AVGPIPE_BACKEND_ERROR, "runtime: cannot start the worker thread of rank %d", w->rank);
        w->started = 1;
        if (pthread_create(&w->avg_thread, NULL, avgpipe__avg_main, w) != 0)
            return avgpipe__fail(run->ctx, AVGPIPE_BACKEND_ERROR, "runtime: cannot start the averaging thread of rank %d", w->rank);
        w->avg_started = 1;
    }
    return AVGPIPE_OK;
}

/* The shape, the groups and the local ranks of desc (create and the memory model). */
static avgpipe_result avgpipe__run_shape(avgpipe_context *ctx, avgpipe_run *run) {
    const avgpipe_run_desc *d = &run->d;
    avgpipe_result res;
    int g, r;
    if (d->schedule) {
        if (!d->schedule->len || d->schedule->nranks < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "schedule: empty");
        run->sd = d->schedule->shape;
        run->S = d->schedule->nranks;
        run->G = d->schedule->nstages;
        run->N = d->schedule->shape.pipes;
    } else {
        if ((res = avgpipe_sched_resolve(ctx, &d->sched, &run->sd)) != AVGPIPE_OK) return res;
        run->S = run->sd.stages;
        run->G = run->sd.stages * run->sd.chunks;
        run->N = run->sd.pipes;
        run->K = d->adaptive ? 0 : run->sd.advance;
    }
    if (d->replicas < 0 || d->replicas > 65536) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "replicas: %d (0..65536; 0 means 1)", d->replicas);
    if (d->average_every < 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "average_every: %d (>= 0; 0 means 1)", d->average_every);
    run->D = d->replicas ? d->replicas : 1;
    run->H = d->average_every ? d->average_every : 1;
    if ((long long)run->D * run->S > 1 << 20) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "replicas x stages: too many ranks");
    run->P = run->D * run->S;
    run->act = (size_t *)avgpipe__calloc(ctx, (size_t)run->G, sizeof(size_t));
    run->place = (int *)avgpipe_alloc(ctx, (3 * (size_t)run->G + (size_t)run->S + 1) * sizeof(int));
    if (!run->act || !run->place) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_create: out of memory");
    run->chunk = run->place + run->G;
    run->rst = run->chunk + run->G;
    run->roff = run->rst + run->G;
    memset(run->roff, 0, ((size_t)run->S + 1) * sizeof(int));
    for (g = 0; g < run->G; g++) {
        int r = d->schedule ? avgpipe_stage_rank(d->schedule, g) : avgpipe__place_formula(run->sd.placement, g, run->S);
        if (r < 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "schedule: stage %d is not placed on any rank", g);
        run->place[g] = r;
        run->chunk[g] = run->roff[r + 1]++; /* counts for now */
    }
    for (r = 0; r < run->S; r++) run->roff[r + 1] += run->roff[r];
    for (g = 0; g < run->G; g++) run->rst[run->roff[run->place[g]] + run->chunk[g]] = g;
    if (run->G > 1 && !d->act_bytes) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "act_bytes: required for %d stages (one entry per boundary)", run->G);
    if (run->G > 1) memcpy(run->act, d->act_bytes, (size_t)(run->G - 1) * sizeof(size_t));
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_run_desc avgpipe_run_query_defaults(const avgpipe_run_desc *desc) {
    avgpipe_run_desc d;
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    d.sched = avgpipe_sched_query_defaults(&d.sched);
    d.averaging = avgpipe_ea_query_defaults(&d.averaging);
    if (d.timeout_s == 0) d.timeout_s = 60;
    if (d.replicas == 0) d.replicas = 1;
    if (d.average_every == 0) d.average_every = 1;
    if (d.micro_samples == 0) d.micro_samples = 1;
    if (d.window == 0) d.window = 3;
    return d;
}

AVGPIPE_API avgpipe_result avgpipe_run_create(avgpipe_context *ctx, const avgpipe_run_desc *desc, avgpipe_run **out) {
    avgpipe_run *run;
    avgpipe_result res;
    if (!desc || !out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_run_create: NULL argument");
    *out = NULL;
    ctx = avgpipe__ctx(ctx);
    run = (avgpipe_run *)avgpipe__calloc(ctx, 1, sizeof *run);
    if (!run) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_create: out of memory");
    run->ctx = ctx;
    run->d = avgpipe_run_query_defaults(desc);
    run->d.sched = desc->sched;         /* resolved and checked with the run's shape (avgpipe_sched_resolve) */
    run->d.averaging = desc->averaging; /* each averaging module resolves its own (AVGPIPE_ZERO reaches it) */
    pthread_mutex_init(&run->mu, NULL);
    pthread_cond_init(&run->cv, NULL);
    if (desc->schedule) { /* the run's own copy: the caller may free theirs after create */
        if ((res = avgpipe_sched_copy(ctx, desc->schedule, &run->given)) != AVGPIPE_OK) {
            pthread_mutex_destroy(&run->mu);
            pthread_cond_destroy(&run->cv);
            avgpipe_free(ctx, run);
            return res;
        }
        run->d.schedule = &run->given;
    }
    res = avgpipe__run_shape(ctx, run);
    if (!res) res = avgpipe__run_locals(ctx, run);
    if (!res) res = avgpipe__run_check(ctx, run);
    if (!res) {
        run->st = (avgpipe__stage *)avgpipe__calloc(ctx, (size_t)run->D * run->G, sizeof(avgpipe__stage));
        run->win = (double *)avgpipe__calloc(ctx, (size_t)run->d.window, sizeof(double));
        if (!run->st || !run->win) res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_run_create: out of memory");
    }
    run->best = -1;
    run->best_k = run->K;
    run->ckpt_prev = -1;
    if (!res && run->d.device) {
        if ((res = avgpipe_device_check(ctx, run->d.device)) == AVGPIPE_OK) run->dev = *run->d.device;
    } else if (!res && (res = avgpipe_device_cpu_create(ctx, NULL, &run->dev)) == AVGPIPE_OK)
        run->own_dev = 1;
    if (!res) res = avgpipe__run_comm(ctx, run);
    if (!res) {
        run->ordered = run->d.device && run->comm.isend_on && run->comm.irecv_on;
        run->varb = run->d.variable_bytes;
        run->sized = run->varb && (run->ordered || run->comm.exact_bytes);
        run->timed = run->d.profile && run->dev.event_elapsed != NULL;
    }
    if (!res) res = avgpipe__run_prepare(run);
    if (!res) res = avgpipe__run_agree(run);
    if (!res) res = avgpipe__run_groups(ctx, run);
    if (!res) res = avgpipe__run_sync(ctx, run);
    if (!res) res = avgpipe__run_sizes(ctx, run);
    if (!res) res = avgpipe__run_start(run);
    if (res) {
        char msg[AVGPIPE_ERROR_MAX];
        snprintf(msg, sizeof msg, "%s", ctx->error);
        avgpipe_run_destroy(run);
        return avgpipe__fail(ctx, res, "%s", msg);
    }
    *out = run;
    return AVGPIPE_OK;
}

AVGPIPE_API void avgpipe_run_destroy(avgpipe_run *run) {
    int k, orphans = 0;
    if (!run) return;
    pthread_mutex_lock(&run->mu);
    run->quit = 1;
    pthread_cond_broadcast(&run->cv);
    pthread_mutex_unlock(&run->mu);
    for (k = 0; run->w && k < run->nlocal; k++) {
        avgpipe__worker *w = &run->w[k];
        if (w->started && w->cb_ready) { /* a thread still inside a user callback cannot be joined: it frees the run when it ends */
            pthread_mutex_lock(&w->cbmu);
            w->orphan = w->stuck && w->cb_kind != 0;
            pthread_mutex_unlock(&w->cbmu);
        }
        if (w->orphan) pthread_detach(w->thread), orphans++;
        else if (w->started) pthread_join(w->thread, NULL);
        if (w->avg_started) pthread_join(w->avg_thread, NULL);
    }
    /* Only once every thread is joined: a failing thread aborts every worker's communicators
       (avgpipe__run_abort_comms), so none may be gone while another thread can still fail. */
    for (k = 0; run->w && k < run->nlocal; k++) {
        avgpipe__worker *w = &run->w[k];
        if (w->has_group) avgpipe_comm_destroy(&w->group), w->has_group = 0;
        if (w->has_sync) avgpipe_comm_destroy(&w->sync), w->has_sync = 0;
        if (w->has_zcomm) avgpipe_comm_destroy(&w->zcomm), w->has_zcomm = 0;
    }
    if (run->st && run->comm.isend) avgpipe__run_cancel_pending(run);
    if (!orphans) {
        avgpipe__run_free(run);
        return;
    }
    /* The orphan touches nothing but the run when its callback returns; the user's context may be gone
       by then, so the run keeps a copy of it (the allocator hooks), and the own comm is stopped now. */
    run->ctx_copy = *run->ctx;
    run->ctx = &run->ctx_copy;
    if (run->own_comm) run->comm.abort(run->comm.user, AVGPIPE_TIMEOUT, "the run was destroyed");
    pthread_mutex_lock(&run->mu);
    run->orphaned = 1;
    pthread_cond_broadcast(&run->cv);
    pthread_mutex_unlock(&run->mu);
}

AVGPIPE_API int avgpipe_run_abandoned(avgpipe_run *run) {
    int k, n = 0;
    if (!run || !run->w) return 0;
    pthread_mutex_lock(&run->mu); /* the watchdog's order: the run's mutex (stuck), then the worker's (cb_kind) */
    for (k = 0; k < run->nlocal; k++) {
        avgpipe__worker *w = &run->w[k];
        pthread_mutex_lock(&w->cbmu);
        n += w->stuck && w->cb_kind != 0;
        pthread_mutex_unlock(&w->cbmu);
    }
    pthread_mutex_unlock(&run->mu);
    return n;
}

static int avgpipe__cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Stashed boundary-buffer bytes per rank the memory model predicts for advance with K. */
static double avgpipe__predicted_stash(const avgpipe_run *run, int K, int rank) {
    avgpipe_sched_desc d = run->sd;
    double bytes = 0;
    int j;
    int g;
    d.advance = K;
    AVGPIPE__RANK_STAGES(run, rank, j, g)
        bytes += (double)avgpipe_sched_peak_stash(&d, rank) * (double)((g > 0 ? run->act[g - 1] : 0) + run->act[g]);
    return bytes;
}

/* Algorithm 1: after `window` iterations at K, keep raising K while the median time improves and
   the predicted memory fits; otherwise go back to the best K and hold. */
static avgpipe_result avgpipe__adapt(avgpipe_run *run, double seconds) {
    double med;
    int next, r, fits = 1;
    avgpipe_result res;
    if (!run->d.adaptive || run->adapt_done) return AVGPIPE_OK;
    if (run->iter == 1) return AVGPIPE_OK; /* the first iteration warms caches and pages up */
    if ((res = avgpipe__run_max_time(run, &seconds)) != AVGPIPE_OK) return res; /* every process decides alike */
    run->win[run->win_n++] = seconds;
    if (run->win_n < run->d.window) return AVGPIPE_OK;
    qsort(run->win, (size_t)run->win_n, sizeof(double), avgpipe__cmp_double);
    med = run->win[run->win_n / 2];
    run->win_n = 0;
    if (run->best < 0 || med < run->best) {
        run->best = med;
        run->best_k = run->K;
        next = run->K + 1;
    } else {
        next = run->best_k;
        run->adapt_done = 1;
    }
    if (!run->adapt_done) {
        if (next > (run->S - 1) * run->sd.micro * run->sd.pipes) fits = 0; /* all forwards first already */
        for (r = 0; r < run->S && fits && run->d.mem_limit > 0; r++)
            if (avgpipe__predicted_stash(run, next, r) > run->d.mem_limit) fits = 0;
        if (!fits) {
            next = run->best_k;
            run->adapt_done = 1;
        }
    }
    if (next == run->K) return AVGPIPE_OK;
    run->K = next;
    avgpipe__log(run->ctx, AVGPIPE_LOG_INFO, "adaptive advance: K = %d (best median %.6g s at K = %d)", run->K, run->best, run->best_k);
    return avgpipe__run_prepare(run);
}

/* Wait until every worker that is not stuck in a callback has finished the iteration. */
static void avgpipe__run_wait_workers(avgpipe_run *run) {
    double slice = run->d.timeout_s / 4 < 0.25 ? run->d.timeout_s / 4 : 0.25;
    for (;;) {
        int k, stuck = 0, finished;
        struct timespec dl = avgpipe__deadline(slice);
        pthread_mutex_lock(&run->mu);
        for (k = 0; k < run->nlocal; k++) stuck += run->w[k].stuck;
        if (run->done + stuck < run->nlocal) pthread_cond_timedwait(&run->cv, &run->mu, &dl);
        for (k = 0, stuck = 0; k < run->nlocal; k++) stuck += run->w[k].stuck;
        finished = run->done + stuck >= run->nlocal;
        pthread_mutex_unlock(&run->mu);
        if (finished) return;
        avgpipe__watchdog(run, run->d.timeout_s);
    }
}

AVGPIPE_API avgpipe_result avgpipe_run_iteration(avgpipe_run *run, avgpipe_run_stats *stats) {
    int k, g, i;
    double busy = 0, loss = 0, t1;
    long long nloss = 0, ops = 0, skipped = 0, reseeded = 0;
    avgpipe_result res;
    if (stats) memset(stats, 0, sizeof *stats); /* zeros when the iteration fails */
    if (!run) return avgpipe__fail(NULL, AVGPIPE_INVALID_ARG, "avgpipe_run_iteration: run is NULL");
    if (run->dead) return avgpipe__fail(run->ctx, AVGPIPE_STATE_ERROR, "avgpipe_run_iteration: an earlier iteration failed (%s)", run->abort_msg);
    for (i = 0; i < run->D * run->G * run->N * run->U; i++) run->slot_of[i] = -1;
    for (g = 0; g < run->D * run->G; g++) {
        avgpipe__stage *st = &run->st[g];
        st->fq_head = 0;
        st->fq_len = st->nslots;
        for (i = 0; i < st->nslots; i++) st->freeq[i] = i;
    }
    for (k = 0; k < run->nlocal; k++) {
        avgpipe__worker *w = &run->w[k];
        w->busy = w->loss = 0;
        w->nloss = w->ops = w->skipped = 0;
        pthread_mutex_lock(&run->mu);
        w->reseeded = 0;
        pthread_mutex_unlock(&run->mu);
        w->nev = 0;
    }
    run->t0 = avgpipe__now();
    pthread_mutex_lock(&run->mu);
    run->done = 0;
    run->go++;
    pthread_cond_broadcast(&run->cv);
    pthread_mutex_unlock(&run->mu);
    avgpipe__run_wait_workers(run); /* every worker wait has its own timeout; callbacks are watched */
    pthread_mutex_lock(&run->mu);
    for (k = 0; k < run->nlocal; k++) /* and the averaging of this iteration */
        while ((run->w[k].jlen > 0 || run->w[k].avg_busy) && !run->aborted) pthread_cond_wait(&run->cv, &run->mu);
    pthread_mutex_unlock(&run->mu);
    for (k = 0; k < run->nlocal && !avgpipe__run_aborted(run) && AVGPIPE__WAITS(AVGPIPE__WAIT_ITERATION_END); k++) {
        avgpipe__worker *w = &run->w[k]; /* the averaging's device work too: the models and references are final */
        if (w->as && (res = run->dev.stream_synchronize(run->dev.user, w->as)) != AVGPIPE_OK)
            avgpipe__run_fail(run, res, "rank %d: device '%s': waiting for the averaging at the end of the iteration failed: %s", w->rank,
                              run->dev.name, run->dev.error_string ? run->dev.error_string(run->dev.user) : "");
    }
    /* the guard's verdict, read once (part of the iteration's end: the read waits for the averaging stream) */
    for (k = 0; k < run->nlocal && !avgpipe__run_aborted(run) && run->dev.flag_nonfinite && AVGPIPE__WAITS(AVGPIPE__WAIT_ITERATION_END); k++) {
        avgpipe__worker *w = &run->w[k];
        AVGPIPE__RANK_STAGES(run, w->srank, i, g) if (!avgpipe__run_aborted(run)) {
            avgpipe__stage *st = avgpipe__run_stage(run, w->replica, g);
            avgpipe_context q;
            avgpipe_context_init(&q, NULL);
            if ((res = avgpipe_ea_nonfinite(&q, st->ea, w->as, NULL)) != AVGPIPE_OK)
                avgpipe__run_fail(run, res, "rank %d, averaging of stage %d: %s", w->rank, g, avgpipe_last_error(&q));
        }
    }
    t1 = avgpipe__now();
    run->iter++;
    if (avgpipe__run_aborted(run)) {
        run->dead = 1;
        return avgpipe__fail(run->ctx, run->abort_res, "%s", run->abort_msg);
    }
    for (k = 0; k < run->nlocal; k++) {
        busy += run->w[k].busy;
        skipped += run->w[k].skipped;
        pthread_mutex_lock(&run->mu);
        reseeded += run->w[k].reseeded;
        pthread_mutex_unlock(&run->mu);
        loss += run->w[k].loss;
        nloss += run->w[k].nloss;
        ops += run->w[k].ops;
    }
    run->seconds = t1 - run->t0;
    if (stats) {
        memset(stats, 0, sizeof *stats);
        stats->seconds = run->seconds;
        stats->loss = nloss ? loss / (double)nloss : 0;
        stats->micro_batches = nloss;
        stats->bubble = run->seconds > 0 ? 1 - busy / (run->nlocal * run->seconds) : 0;
        stats->advance = run->K;
        stats->ops = ops;
        stats->skipped = skipped;
        stats->reseeded = reseeded;
    }
    res = avgpipe__adapt(run, run->seconds);
    if (res) run->dead = 1;
    return res;
}

/* The averaging buffers of stage g under desc's averaging settings. */
static double avgpipe__ea_bytes(avgpipe_context *ctx, const avgpipe_run_desc *d, int N, size_t count) {
    avgpipe_ea_desc ed;
    avgpipe_ea_memory_info mi;
    memset(&ed, 0, sizeof ed);
    ed.count = count;
    ed.pipes = N;
    ed.mode = d->averaging.mode;
    ed.alpha = d->averaging.alpha;
    ed.momentum = d->averaging.momentum;
    ed.device = d->device;
    ed.check_on_device = d->device && d->device->flag_nonfinite && !d->reseed_nonfinite; /* as the run creates it */
    return avgpipe_ea_memory_bytes(ctx, &ed, &mi) == AVGPIPE_OK ? (double)mi.device_bytes : -1;
}

/* The boundary buffers of stage g: the plan's bytes in one device allocation (its overhead included). */
static double avgpipe__slot_bytes(const avgpipe_run_desc *d, const avgpipe_buffer_plan *plan, int g) {
    double b = (double)plan->slot_bytes[g] * plan->slots[g];
    return b > 0 ? b + (double)(d->device ? d->device->alloc_overhead : AVGPIPE__CPU_OVERHEAD) : 0;
}

AVGPIPE_API double avgpipe_run_bytes(const avgpipe_run *run, int rank) {
    double bytes = 0;
    int j;
    avgpipe_context quiet;
    int g;
    if (!run || !avgpipe_run_is_local(run, rank)) return -1;
    avgpipe_context_init(&quiet, NULL);
    AVGPIPE__RANK_STAGES(run, rank % run->S, j, g)
        bytes += avgpipe__slot_bytes(&run->d, &run->plan, g) + avgpipe__ea_bytes(&quiet, &run->d, run->N, run->d.param_count[g]);
    return bytes + avgpipe__sync_bytes(run, rank % run->S);
}

/* A buffer plan of the run's stages from their slot counts (as an earlier plan of the same schedule
   found them), without the release tables: what the memory model reads. */
static avgpipe_result avgpipe__plan_from_slots(avgpipe_context *ctx, const avgpipe_run *run, const int *slots, avgpipe_buffer_plan *out) {
    int g, G = run->G;
    memset(out, 0, sizeof *out);
    out->nranks = run->S;
    out->nstages = G;
    out->slots = (int *)avgpipe_alloc(ctx, (size_t)G * sizeof(int));
    out->slot_bytes = (size_t *)avgpipe_alloc(ctx, (size_t)G * sizeof(size_t));
    if (!out->slots || !out->slot_bytes) {
        avgpipe_buffer_plan_free(ctx, out);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory planning the buffers");
    }
    memcpy(out->slots, slots, (size_t)G * sizeof(int));
    for (g = 0; g < G; g++)
        out->slot_bytes[g] = avgpipe__plan_slot_bytes(run->act, G, g, g > 0 && run->place[g - 1] != run->place[g],
                                                      g + 1 < G && run->place[g + 1] != run->place[g]);
    return AVGPIPE_OK;
}

/* avgpipe_run_memory, with the stages' slot counts given (slots_in: a plan of the same schedule found
   them; nothing is generated, lowered or planned) or handed out (slots_out, [G]; both may be NULL).
   own (may be NULL): the schedule desc->sched generates, already generated (with or without the TIE and
   AGREE ops the run places); taken (and emptied). memo (may be NULL): the slot count's cache of ranks. */
static avgpipe_result avgpipe__run_memory_in(avgpipe_context *ctx, const avgpipe_run_desc *desc, const int *slots_in, int *slots_out,
                                             avgpipe_schedule *own, avgpipe__slot_memo *memo, double *per_rank) {
    avgpipe_run run;
    avgpipe_schedule base;
    avgpipe_buffer_plan plan;
    avgpipe_sync_desc sy;
    avgpipe_result res;
    int g;
    if (!desc || !per_rank) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_run_memory: NULL argument");
    if (!desc->param_count) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_run_memory: param_count is required");
    memset(&run, 0, sizeof run);
    run.d = *desc;
    res = avgpipe__run_shape(ctx, &run);
    if (!res) res = avgpipe__run_ties(ctx, &run);
    if (!res && slots_in && !desc->schedule) {
        res = avgpipe__plan_from_slots(ctx, &run, slots_in, &plan);
    } else if (!res) { /* the slots of the lowered schedule, counted without lowering a compute-only one */
        res = avgpipe__run_schedules_own(ctx, desc->schedule, &run.sd, run.K, 0, avgpipe__run_sync_desc(&run, &sy), desc->schedule ? NULL : own,
                                         &base, NULL);
        if (!res) {
            if (base.has_comm) res = avgpipe__buffer_plan_in(ctx, &base, run.act, 0, &plan);
            else {
                int *slots = (int *)avgpipe_alloc(ctx, (size_t)run.G * sizeof(int));
                avgpipe__extent ext = avgpipe__gen_extent(&base, 1); /* generated here or by the tuner, unless given */
                res = slots ? avgpipe__plan_slots_unlowered(ctx, &base, desc->schedule ? NULL : &ext, memo, slots)
                            : avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "runtime: out of memory planning the buffers");
                if (!res) res = avgpipe__plan_from_slots(ctx, &run, slots, &plan);
                avgpipe_free(ctx, slots);
            }
            avgpipe_sched_free(ctx, &base);
        }
        if (!res && slots_out) memcpy(slots_out, plan.slots, (size_t)run.G * sizeof(int));
    }
    if (!res) {
        for (g = 0; g < run.S; g++) per_rank[g] = 0;
        for (g = 0; g < run.G && !res; g++) {
            double ea = avgpipe__ea_bytes(ctx, desc, run.N, desc->param_count[g]);
            if (ea < 0) res = avgpipe_last_result(avgpipe__ctx(ctx));
            per_rank[run.place[g]] += avgpipe__slot_bytes(desc, &plan, g) + ea;
        }
        for (g = 0; g < run.S; g++) per_rank[g] += avgpipe__sync_bytes(&run, g);
        avgpipe_buffer_plan_free(ctx, &plan);
    }
    avgpipe_free(ctx, run.act);
    avgpipe_free(ctx, run.place);
    avgpipe_free(ctx, run.ties);
    avgpipe_free(ctx, run.excl_start);
    avgpipe_free(ctx, run.excl);
    return res;
}

AVGPIPE_API avgpipe_result avgpipe_run_memory(avgpipe_context *ctx, const avgpipe_run_desc *desc, double *per_rank) {
    return avgpipe__run_memory_in(ctx, desc, NULL, NULL, NULL, NULL, per_rank);
}

/* --- 20. Profiles: events, the profile writer and reader, traces ------------------------------ */

/* The local ranks' events of the last iteration, gathered into one array (run->mev). */
static size_t avgpipe__gather_events(avgpipe_run *run) {
    size_t n = 0, k = 0;
    int r;
    for (r = 0; r < run->nlocal; r++) n += run->w[r].nev;
    if (n > run->mcap) {
        avgpipe_event *e = (avgpipe_event *)avgpipe__realloc(run->ctx, run->mev, 0, n * sizeof *e);
        double *b;
        if (!e) return 0;
        run->mev = e;
        b = (double *)avgpipe__realloc(run->ctx, run->mbytes, 0, n * sizeof *b);
        if (!b) return 0;
        run->mbytes = b;
        run->mcap = n;
    }
    for (r = 0; r < run->nlocal; r++) {
        if (run->w[r].nev == 0) continue;
        memcpy(run->mev + k, run->w[r].ev, run->w[r].nev * sizeof(avgpipe_event));
        memcpy(run->mbytes + k, run->w[r].evbytes, run->w[r].nev * sizeof(double));
        k += run->w[r].nev;
    }
    return k;
}

AVGPIPE_API const avgpipe_event *avgpipe_run_events(const avgpipe_run *run, size_t *count) {
    size_t n;
    if (count) *count = 0;
    if (!run || !run->d.profile) return NULL;
    n = avgpipe__gather_events((avgpipe_run *)run); /* a cache: logically const */
    if (count) *count = n;
    return n ? run->mev : NULL;
}

#ifndef AVGPIPE_NO_STDIO
static avgpipe_result avgpipe__run_profile(avgpipe_run *run, const char *path, int append);

AVGPIPE_API avgpipe_result avgpipe_run_write_profile(avgpipe_run *run, const char *path) { return avgpipe__run_profile(run, path, 0); }
AVGPIPE_API avgpipe_result avgpipe_run_append_profile(avgpipe_run *run, const char *path) { return avgpipe__run_profile(run, path, 1); }

static avgpipe_result avgpipe__run_profile(avgpipe_run *run, const char *path, int append) {
    FILE *f;
    size_t n, i;
    int g, bad, group;
    const avgpipe_sched_desc *sh;
    if (!run || !path) return avgpipe__fail(NULL, AVGPIPE_INVALID_ARG, "avgpipe_run_write_profile: NULL argument");
    if (!run->d.profile) return avgpipe__fail(run->ctx, AVGPIPE_STATE_ERROR, "avgpipe_run_write_profile: create the run with profile = 1");
    n = avgpipe__gather_events(run);
    f = fopen(path, append ? "a" : "w");
    if (!f) return avgpipe__fail(run->ctx, AVGPIPE_IO_ERROR, "cannot create '%s'", path);
    sh = &run->base.shape;
    group = run->w[0].replica; /* one group's ranks: the tuner models one group */
    if (!append || ftell(f) == 0) fprintf(f, "# avgpipe profile v1\n");
    fprintf(f, "shape kind=%s stages=%d chunks=%d micro=%d pipes=%d rounds=%d advance=%d continuous=%d samples=%.17g seconds=%.9f\n",
            avgpipe_sched_kind_name(sh->kind), run->S, sh->chunks, sh->micro, run->N, sh->rounds, run->K, sh->continuous,
            run->d.micro_samples > 0 ? run->d.micro_samples : 1.0, run->seconds);
    for (g = 0; g < run->G; g++)
        fprintf(f, "stage %d param_floats=%zu act_bytes=%zu slots=%d\n", g, run->d.param_count[g], run->act[g], run->plan.slots[g]);
    for (i = 0; i < n; i++) {
        const avgpipe_event *e = &run->mev[i];
        if (e->rank / run->S != group) continue;
        fprintf(f, "op rank=%d kind=%s pipe=%d stage=%d micro=%d start=%.9f end=%.9f bytes=%.0f\n", (int)e->rank % run->S,
                e->track == 2 ? (e->op.kind == AVGPIPE_OP_F ? "RECV_F" : "RECV_B") : avgpipe_op_kind_name((avgpipe_op_kind)e->op.kind),
                e->op.pipe, e->op.stage, e->op.micro, e->start, e->end, run->mbytes[i]);
    }
    bad = ferror(f);
    if (fclose(f) != 0 || bad) return avgpipe__fail(run->ctx, AVGPIPE_IO_ERROR, "cannot write '%s'", path);
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_run_write_trace(avgpipe_run *run, const char *path) {
    avgpipe_buf b = {NULL, 0, 0};
    avgpipe_render_desc rd;
    avgpipe_result res;
    size_t n;
    FILE *f;
    if (!run || !path) return avgpipe__fail(NULL, AVGPIPE_INVALID_ARG, "avgpipe_run_write_trace: NULL argument");
    if (!run->d.profile) return avgpipe__fail(run->ctx, AVGPIPE_STATE_ERROR, "avgpipe_run_write_trace: create the run with profile = 1");
    n = avgpipe__gather_events(run);
    memset(&rd, 0, sizeof rd);
    rd.us_per_unit = 1e6; /* event times are seconds */
    res = avgpipe_render_chrome(run->ctx, run->mev, n, run->P, &rd, &b);
    if (res) return res;
    f = fopen(path, "w");
    if (!f) res = avgpipe__fail(run->ctx, AVGPIPE_IO_ERROR, "cannot create '%s'", path);
    else {
        if (fwrite(b.data, 1, b.len, f) != b.len) res = avgpipe__fail(run->ctx, AVGPIPE_IO_ERROR, "cannot write '%s'", path);
        if (fclose(f) != 0 && !res) res = avgpipe__fail(run->ctx, AVGPIPE_IO_ERROR, "cannot write '%s'", path);
    }
    avgpipe_buf_free(run->ctx, &b);
    return res;
}
#endif


AVGPIPE_API void avgpipe_profile_free(avgpipe_context *ctx, avgpipe_profile *p) {
    int i;
    if (!p) return;
    for (i = 0; i < p->nsections; i++) {
        avgpipe_free(ctx, p->sections[i].param_floats);
        avgpipe_free(ctx, p->sections[i].act_bytes);
    }
    avgpipe_free(ctx, p->sections);
    avgpipe_free(ctx, p->ops);
    avgpipe_free(ctx, p->layers);
    memset(p, 0, sizeof *p);
}

/* "key=value" fields of one line; returns the number found (at most max). */
typedef struct avgpipe__kv {
    char key[24];
    char val[40];
} avgpipe__kv;

static int avgpipe__split_kv(const char *p, const char *end, avgpipe__kv *kv, int max, int *bad) {
    int n = 0, i;
    *bad = 0;
    while (p < end) {
        const char *k0, *eq, *v0;
        while (p < end && avgpipe__is_space(*p)) p++;
        if (p >= end) break;
        k0 = p;
        while (p < end && !avgpipe__is_space(*p)) p++;
        eq = (const char *)memchr(k0, '=', (size_t)(p - k0));
        if (!eq || eq == k0 || (size_t)(eq - k0) >= sizeof kv->key || (size_t)(p - eq - 1) >= sizeof kv->val || n >= max) {
            *bad = 1; /* no '=', an empty or over-long key or value, or too many fields */
            return n;
        }
        v0 = eq + 1;
        memcpy(kv[n].key, k0, (size_t)(eq - k0));
        kv[n].key[eq - k0] = 0;
        memcpy(kv[n].val, v0, (size_t)(p - v0));
        kv[n].val[p - v0] = 0;
        for (i = 0; i < n; i++)
            if (strcmp(kv[i].key, kv[n].key) == 0) *bad = 2; /* a field given twice */
        n++;
    }
    return n;
}

static const char *avgpipe__kv_problem(int bad) {
    return bad == 2 ? "a field is given twice" : "a field is not key=value (or its key or value is over 23/39 characters)";
}

static const char *avgpipe__kv_get(const avgpipe__kv *kv, int n, const char *key) {
    int i;
    for (i = 0; i < n; i++)
        if (strcmp(kv[i].key, key) == 0) return kv[i].val;
    return NULL;
}

/* Bounds of a profile's values: generous for any real run, small enough that the tuner's sums stay
   exact in double and its conversions to size_t and int are in range. */
#define AVGPIPE__PROFILE_MAX_BYTES 1125899906842624.0 /* 2^50 */
#define AVGPIPE__PROFILE_MAX_FLOATS 281474976710656.0 /* 2^48: 2^50 bytes as fp32 */
#define AVGPIPE__PROFILE_MAX_SECONDS 1e6
#define AVGPIPE__PROFILE_MAX_SAMPLES 2147483647.0     /* INT_MAX */

/* A number in [0, hi] from field `key`; 0 = missing or bad (the message says which). kv values are
   the parser's own NUL-terminated copies, so strtod stays inside them. */
static int avgpipe__kv_num(avgpipe_context *ctx, const avgpipe__kv *kv, int n, const char *key, int line, double hi, double *out) {
    const char *v = avgpipe__kv_get(kv, n, key);
    char *e;
    double x;
    if (!v) {
        avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: missing field '%s'", line, key);
        return 0;
    }
    x = strtod(v, &e);
    if (e == v || *e || !(x >= 0 && x <= hi)) {
        avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: field '%s' needs a number from 0 to %.16g, got '%s'", line, key, hi, v);
        return 0;
    }
    *out = x;
    return 1;
}

/* An integer field in [lo, hi]. */
static int avgpipe__kv_int(avgpipe_context *ctx, const avgpipe__kv *kv, int n, const char *key, int line, double lo, double hi, double *out) {
    if (!avgpipe__kv_num(ctx, kv, n, key, line, 1e300, out)) return 0;
    if (*out != floor(*out) || *out < lo || *out > hi) {
        avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: field '%s' needs a whole number in %.0f..%.0f, got '%s'", line, key,
                      lo, hi, avgpipe__kv_get(kv, n, key));
        return 0;
    }
    return 1;
}

/* Every stage of section i has its line. Checked when the next section starts and at the end, so that
   only the last section's stage tables (up to 512 KiB for 32767 stages) can wait for lines that never
   come: the parser's memory follows the lines it has read. */
static avgpipe_result avgpipe__profile_complete(avgpipe_context *ctx, const avgpipe_profile *p, int i, int line) {
    int g;
    for (g = 0; g < p->sections[i].nstages; g++)
        if (p->sections[i].param_floats[g] < 0) {
            if (line > 0)
                return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: section %d has no 'stage %d' line", line, i + 1, g);
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile: section %d has no 'stage %d' line", i + 1, g);
        }
    return AVGPIPE_OK;
}

/* The parse's state: the profile, and the capacities of its growing arrays. */
typedef struct avgpipe__pparse {
    avgpipe_profile *p;
    size_t ops_cap, sections_cap, layers_cap;
} avgpipe__pparse;

/* The record parsers, one per record kind (avgpipe__profile_records, below): the state, the index after
   the record's word (for the indexed kinds; else empty), the key=value fields and the line number. */
static avgpipe_result avgpipe__profile_shape(avgpipe_context *ctx, avgpipe__pparse *st, const char *idx, const char *idx_end,
                                             const avgpipe__kv *kv, int n, int line) {
    avgpipe_profile *p = st->p;
    size_t *cap = &st->sections_cap;
    avgpipe_profile_section *sec, *ns;
    (void)idx, (void)idx_end;
    double v[9];
    static const char *const keys[7] = {"stages", "chunks", "micro", "pipes", "rounds", "advance", "continuous"};
    const char *kind = avgpipe__kv_get(kv, n, "kind");
    int i;
    static const double lo[7] = {1, 1, 1, 1, 1, 0, 0}, hi[7] = {AVGPIPE__MAX_STAGES, 64, 1e6, 32767, 1e6, 1e9, 1};
    for (i = 0; i < 7; i++)
        if (!avgpipe__kv_int(ctx, kv, n, keys[i], line, lo[i], hi[i], &v[i])) return AVGPIPE_PARSE_ERROR;
    if (!avgpipe__kv_num(ctx, kv, n, "samples", line, AVGPIPE__PROFILE_MAX_SAMPLES, &v[7]) ||
        !avgpipe__kv_num(ctx, kv, n, "seconds", line, AVGPIPE__PROFILE_MAX_SECONDS, &v[8]))
        return AVGPIPE_PARSE_ERROR;
    if (v[7] <= 0) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: field 'samples' must be > 0", line);
    if (v[0] * v[1] > AVGPIPE__MAX_STAGES || v[0] * v[1] * v[2] * v[3] * v[4] > 5e7)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR,
                             "profile line %d: stages x chunks x micro x pipes x rounds is too large for a profile (at most 5e7)", line);
    if (p->nsections > 0 && avgpipe__profile_complete(ctx, p, p->nsections - 1, line)) return AVGPIPE_PARSE_ERROR;
    if (p->nsections == INT_MAX) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: too many sections", line);
    if ((size_t)p->nsections == *cap) { /* doubling: one at a time would copy them all for each */
        size_t nc = *cap ? 2 * *cap : 4;
        ns = (avgpipe_profile_section *)avgpipe__realloc(ctx, p->sections, (size_t)p->nsections * sizeof *ns, nc * sizeof *ns);
        if (!ns) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "profile: out of memory");
        p->sections = ns;
        *cap = nc;
    }
    sec = &p->sections[p->nsections++];
    memset(sec, 0, sizeof *sec);
    if (!kind || avgpipe_sched_kind_parse(kind, &sec->shape.kind))
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: field 'kind' missing or unknown", line);
    sec->shape.stages = (int)v[0];
    sec->shape.chunks = (int)v[1];
    sec->shape.micro = (int)v[2];
    sec->shape.pipes = (int)v[3];
    sec->shape.rounds = (int)v[4];
    sec->shape.advance = (int)v[5];
    sec->shape.continuous = v[6] != 0;
    sec->samples = v[7];
    sec->seconds = v[8];
    sec->nstages = sec->shape.stages * sec->shape.chunks;
    sec->param_floats = (double *)avgpipe__calloc(ctx, (size_t)sec->nstages, sizeof(double));
    sec->act_bytes = (double *)avgpipe__calloc(ctx, (size_t)sec->nstages, sizeof(double));
    for (i = 0; sec->param_floats && sec->act_bytes && i < sec->nstages; i++) sec->param_floats[i] = -1;
    if (!sec->param_floats || !sec->act_bytes) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "profile: out of memory");
    return AVGPIPE_OK;
}

/* "stage <g> key=value ...": the index is the word [idx, idx_end), parsed within it (the text need not
   be NUL-terminated, and a missing index must not be taken from the next line). */
static avgpipe_result avgpipe__profile_stage(avgpipe_context *ctx, avgpipe__pparse *st, const char *idx, const char *idx_end,
                                             const avgpipe__kv *kv, int n, int line) {
    avgpipe_profile *p = st->p;
    avgpipe_profile_section *sec = p->nsections ? &p->sections[p->nsections - 1] : NULL;
    double pf, ab;
    const char *e = idx;
    int g = -1;
    char q[48];
    if (!sec) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: 'stage' before any 'shape' line", line);
    if (idx == idx_end) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: 'stage' needs a stage index", line);
    if (!avgpipe__parse_int(&e, idx_end, &g) || e != idx_end || g >= sec->nstages)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: stage index '%s' is not a number in 0..%d", line,
                             avgpipe__quote(idx, (size_t)(idx_end - idx), q, sizeof q), sec->nstages - 1);
    if (!avgpipe__kv_num(ctx, kv, n, "param_floats", line, AVGPIPE__PROFILE_MAX_FLOATS, &pf) ||
        !avgpipe__kv_num(ctx, kv, n, "act_bytes", line, AVGPIPE__PROFILE_MAX_BYTES, &ab))
        return AVGPIPE_PARSE_ERROR;
    sec->param_floats[g] = pf;
    sec->act_bytes[g] = ab;
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__profile_op(avgpipe_context *ctx, avgpipe__pparse *st, const char *idx, const char *idx_end,
                                          const avgpipe__kv *kv, int n, int line) {
    avgpipe_profile *p = st->p;
    size_t *cap = &st->ops_cap;
    avgpipe_profile_section *sec = p->nsections ? &p->sections[p->nsections - 1] : NULL;
    avgpipe_profile_op op;
    double v[7];
    static const char *const keys[7] = {"rank", "pipe", "stage", "micro", "start", "end", "bytes"};
    const char *kind = avgpipe__kv_get(kv, n, "kind");
    int i, k = -1;
    (void)idx, (void)idx_end;
    if (!sec) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: 'op' before any 'shape' line", line);
    for (i = 0; i < 4; i++)
        if (!avgpipe__kv_int(ctx, kv, n, keys[i], line, 0, 2e9, &v[i])) return AVGPIPE_PARSE_ERROR;
    for (i = 4; i < 7; i++)
        if (!avgpipe__kv_num(ctx, kv, n, keys[i], line, i < 6 ? AVGPIPE__PROFILE_MAX_SECONDS : AVGPIPE__PROFILE_MAX_BYTES, &v[i]))
            return AVGPIPE_PARSE_ERROR;
    for (i = 1; kind && i < AVGPIPE_OP_KIND_COUNT; i++)
        if (strcmp(kind, avgpipe__op_names[i]) == 0) k = i;
    if (k < 0) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: field 'kind' missing or unknown", line);
    if (v[0] >= sec->shape.stages || v[1] >= sec->shape.pipes || v[2] >= sec->nstages ||
        v[3] >= (double)sec->shape.micro * sec->shape.rounds)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: rank, pipe or stage out of range for its shape line", line);
    if (v[5] < v[4]) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: end %g is before start %g (wrong units?)", line, v[5], v[4]);
    if (p->nops == *cap) {
        size_t nc = *cap ? 2 * *cap : 1024;
        avgpipe_profile_op *q = (avgpipe_profile_op *)avgpipe__realloc(ctx, p->ops, *cap * sizeof *q, nc * sizeof *q);
        if (!q) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "profile: out of memory");
        p->ops = q;
        *cap = nc;
    }
    op.section = p->nsections - 1;
    op.rank = (int)v[0];
    op.kind = k;
    op.pipe = (int)v[1];
    op.stage = (int)v[2];
    op.micro = (int)v[3];
    op.start = v[4];
    op.end = v[5];
    op.bytes = v[6];
    p->ops[p->nops++] = op;
    return AVGPIPE_OK;
}

/* "layer L stage=G f_a= f_b= b_a= b_b= param_floats= act_bytes=": layer L's costs (kept in order; the
   checks that need every line come after the parse, avgpipe__profile_layers_check). The index is the
   word [idx, idx_end), parsed within it, as a stage's; the table grows by doubling (*cap entries). */
static avgpipe_result avgpipe__profile_layer(avgpipe_context *ctx, avgpipe__pparse *st, const char *idx, const char *idx_end,
                                             const avgpipe__kv *kv, int n, int line) {
    avgpipe_profile *p = st->p;
    size_t *cap = &st->layers_cap;
    static const char *const keys[7] = {"stage", "f_a", "f_b", "b_a", "b_b", "param_floats", "act_bytes"};
    static const double hi[7] = {0, AVGPIPE__PROFILE_MAX_SECONDS, AVGPIPE__PROFILE_MAX_SECONDS, AVGPIPE__PROFILE_MAX_SECONDS,
                                 AVGPIPE__PROFILE_MAX_SECONDS, AVGPIPE__PROFILE_MAX_FLOATS, AVGPIPE__PROFILE_MAX_BYTES};
    avgpipe_layer_cost *nl, *c;
    double v[7];
    const char *e = idx;
    int i, l = -1;
    char q[48];
    if (idx == idx_end) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: 'layer' needs a layer index", line);
    if (!avgpipe__parse_int(&e, idx_end, &l) || e != idx_end || l >= AVGPIPE__MAX_STAGES)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: layer index '%s' is not a whole number in 0..%d", line,
                             avgpipe__quote(idx, (size_t)(idx_end - idx), q, sizeof q), AVGPIPE__MAX_STAGES - 1);
    if (l != p->nlayers)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: layer %d where layer %d comes next (layers in order, each once)",
                             line, l, p->nlayers);
    if (!avgpipe__kv_int(ctx, kv, n, keys[0], line, 0, AVGPIPE__MAX_STAGES - 1, &v[0])) return AVGPIPE_PARSE_ERROR;
    for (i = 1; i < 7; i++)
        if (!avgpipe__kv_num(ctx, kv, n, keys[i], line, hi[i], &v[i])) return AVGPIPE_PARSE_ERROR;
    if (p->nlayers && v[0] < p->layers[p->nlayers - 1].stage)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: field 'stage' is %.0f, below the previous layer's %d "
                             "(stage partitions are contiguous runs of layers)", line, v[0], p->layers[p->nlayers - 1].stage);
    if ((size_t)p->nlayers == *cap) { /* doubling: one at a time would copy them all for each */
        size_t nc = *cap ? 2 * *cap : 8;
        nl = (avgpipe_layer_cost *)avgpipe__realloc(ctx, p->layers, (size_t)p->nlayers * sizeof *nl, nc * sizeof *nl);
        if (!nl) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "profile: out of memory");
        p->layers = nl;
        *cap = nc;
    }
    c = &p->layers[p->nlayers++];
    c->stage = (int)v[0];
    c->f_a = v[1], c->f_b = v[2], c->b_a = v[3], c->b_b = v[4], c->param_floats = v[5], c->act_bytes = v[6];
    return AVGPIPE_OK;
}

/* "averaging floats=P seconds=T": one contribution's measured time. */
static avgpipe_result avgpipe__profile_averaging(avgpipe_context *ctx, avgpipe__pparse *st, const char *idx, const char *idx_end,
                                                 const avgpipe__kv *kv, int n, int line) {
    avgpipe_profile *p = st->p;
    double f, t;
    (void)idx, (void)idx_end;
    if (!avgpipe__kv_num(ctx, kv, n, "floats", line, AVGPIPE__PROFILE_MAX_FLOATS, &f) ||
        !avgpipe__kv_num(ctx, kv, n, "seconds", line, AVGPIPE__PROFILE_MAX_SECONDS, &t))
        return AVGPIPE_PARSE_ERROR;
    if (f < 1) return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: field 'floats' must be >= 1", line);
    p->averaging_floats += f;
    p->averaging_seconds += t;
    return AVGPIPE_OK;
}

/* After the parse: the layers cover the sections' stage partitions 0..G-1, each with at least one layer. */
static avgpipe_result avgpipe__profile_layers_check(avgpipe_context *ctx, const avgpipe_profile *p) {
    int l, G = p->nsections ? p->sections[0].nstages : 0;
    if (!p->nlayers) return AVGPIPE_OK;
    if (p->layers[0].stage != 0 || p->layers[p->nlayers - 1].stage != G - 1)
        return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile: the 'layer' lines' field 'stage' must run from 0 to %d (the "
                             "sections' stage partitions), got %d to %d", G - 1, p->layers[0].stage, p->layers[p->nlayers - 1].stage);
    for (l = 1; l < p->nlayers; l++)
        if (p->layers[l].stage > p->layers[l - 1].stage + 1)
            return avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile: no 'layer' line has stage=%d (layer %d has stage=%d, layer %d "
                                 "stage=%d)", p->layers[l - 1].stage + 1, l - 1, p->layers[l - 1].stage, l, p->layers[l].stage);
    return AVGPIPE_OK;
}

/* The profile's record kinds, one row each: the word that starts the line, whether an index follows it
   ("stage 3 ...", "layer 7 ..."), and the parser of its fields. */
typedef avgpipe_result (*avgpipe__precord_fn)(avgpipe_context *ctx, avgpipe__pparse *st, const char *idx, const char *idx_end,
                                             const avgpipe__kv *kv, int n, int line);
static const struct avgpipe__precord {
    const char *word;
    int indexed;
    avgpipe__precord_fn parse;
} avgpipe__profile_records[] = {{"shape", 0, avgpipe__profile_shape},
                                {"stage", 1, avgpipe__profile_stage},
                                {"op", 0, avgpipe__profile_op},
                                {"layer", 1, avgpipe__profile_layer},
                                {"averaging", 0, avgpipe__profile_averaging}};

AVGPIPE_API avgpipe_result avgpipe_profile_parse(avgpipe_context *ctx, const char *text, size_t len, avgpipe_profile *out) {
    const char *p, *end;
    int line = 0, have_header = 0;
    avgpipe__pparse st;
    avgpipe_result res = AVGPIPE_OK;
    if (!text || !out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_profile_parse: NULL argument");
    memset(out, 0, sizeof *out);
    memset(&st, 0, sizeof st);
    st.p = out;
    end = text + len;
    for (p = text; p < end && !res;) {
        const char *e = (const char *)memchr(p, '\n', (size_t)(end - p)), *w;
        const struct avgpipe__precord *rec = NULL;
        size_t k;
        if (!e) e = end;
        line++;
        if (e > p && e[-1] == '\r') e--;
        w = p;
        while (w < e && !avgpipe__is_space(*w)) w++;
        for (k = 0; k < sizeof avgpipe__profile_records / sizeof avgpipe__profile_records[0]; k++)
            if (strlen(avgpipe__profile_records[k].word) == (size_t)(w - p) && memcmp(p, avgpipe__profile_records[k].word, (size_t)(w - p)) == 0)
                rec = &avgpipe__profile_records[k];
        if (p == e || *p == '#') {
            if (line == 1 && (size_t)(e - p) >= 20 && memcmp(p, "# avgpipe profile v1", 20) == 0) have_header = 1;
        } else if (!rec) {
            char q[48];
            res = avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: unknown record '%s'", line, avgpipe__quote(p, (size_t)(w - p), q, sizeof q));
        } else {
            const char *idx = w;
            avgpipe__kv kv[16];
            int n, bad;
            if (rec->indexed) { /* the index, then the fields */
                while (idx < e && avgpipe__is_space(*idx)) idx++;
                w = idx;
                while (w < e && !avgpipe__is_space(*w)) w++;
            }
            n = avgpipe__split_kv(w, e, kv, 16, &bad);
            res = bad ? avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line %d: %s", line, avgpipe__kv_problem(bad))
                      : rec->parse(ctx, &st, idx, w, kv, n, line);
        }
        if (line == 1 && !have_header && !res)
            res = avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile line 1: expected '# avgpipe profile v1'");
        p = (e < end && *e == '\r') ? e + 1 : e; /* past the line's end: its '\r', then its '\n' */
        if (p < end) p++;
    }
    if (!res && out->nsections == 0) res = avgpipe__fail(ctx, AVGPIPE_PARSE_ERROR, "profile: no 'shape' line");
    if (!res) res = avgpipe__profile_complete(ctx, out, out->nsections - 1, 0); /* the others: at the next shape line */
    if (!res) res = avgpipe__profile_layers_check(ctx, out);
    if (res) avgpipe_profile_free(ctx, out);
    return res;
}

#ifndef AVGPIPE_NO_STDIO
AVGPIPE_API avgpipe_result avgpipe_profile_load(avgpipe_context *ctx, const char *path, avgpipe_profile *out) {
    avgpipe_buf text = {NULL, 0, 0};
    avgpipe_result res;
    if (!path || !out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_profile_load: NULL argument");
    res = avgpipe__read_file(ctx, path, &text, &avgpipe__file_profile);
    if (res) return res;
    res = avgpipe_profile_parse(ctx, text.data ? text.data : "", text.len, out);
    if (res) avgpipe__fail_in_file(ctx, res, path);
    avgpipe_buf_free(ctx, &text);
    return res;
}
#endif

/* --- 21. Cost model: fitting and prediction --------------------------------------------------- */

AVGPIPE_API void avgpipe_tune_cost_model_free(avgpipe_context *ctx, avgpipe_cost_model *m) {
    if (!m) return;
    avgpipe_free(ctx, m->a);
    avgpipe_free(ctx, m->b);
    avgpipe_free(ctx, m->param_floats);
    avgpipe_free(ctx, m->act_bytes_per_sample);
    avgpipe_free(ctx, m->layers);
    memset(m, 0, sizeof *m);
}

/* Least squares of y = a + b·x over the ops of one (stage, kind); proportional when one size was seen. */
static void avgpipe__fit_line(const double *s, double *a, double *b, int constant) {
    double n = s[0], sx = s[1], sy = s[2], sxx = s[3], sxy = s[4], det = n * sxx - sx * sx;
    *a = *b = 0;
    if (n <= 0) return;
    if (constant) {
        *a = sy / n;
        return;
    }
    if (det > 1e-12 * n * sxx) {
        *b = (n * sxy - sx * sy) / det;
        *a = (sy - *b * sx) / n;
    }
    if (det <= 1e-12 * n * sxx || *b < 0 || *a < 0) { /* one size, or a fit outside physics: proportional */
        *a = 0;
        *b = sx > 0 ? sy / sx : 0;
    }
}

static int avgpipe__cmp_dbl(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

/* The median of v[0 .. n-1], n >= 1 (sorts v): the middle one, or the mean of the middle two. */
static double avgpipe__median(double *v, size_t n) {
    qsort(v, n, sizeof *v, avgpipe__cmp_dbl);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* A producer's end time, found by (section's pipeline, stage, micro-batch, forward or backward):
   sorted keys, so the fit's memory follows the ops a profile holds, not the cells its shape names. */
typedef struct avgpipe__prod {
    long long key;
    size_t ix; /* position in the profile: of equal keys the last one counts */
    double end;
} avgpipe__prod;

static int avgpipe__cmp_prod(const void *x, const void *y) {
    const avgpipe__prod *a = (const avgpipe__prod *)x, *b = (const avgpipe__prod *)y;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return (a->ix > b->ix) - (a->ix < b->ix);
}

/* The parser keeps pipe, stage and micro inside the section's shape (at most 5e7 cells): no overflow. */
static long long avgpipe__prod_key(const avgpipe_profile_section *sec, int pipe, int stage, int micro, int backward) {
    long long U = (long long)sec->shape.micro * sec->shape.rounds;
    return ((((long long)pipe * sec->nstages + stage) * U + micro) << 1) | backward;
}

/* End of the last producer with `key` in sorted v[0..n-1], or -1. */
static double avgpipe__prod_end(const avgpipe__prod *v, size_t n, long long key) {
    size_t lo = 0, hi = n; /* first element with a larger key */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (v[mid].key <= key) lo = mid + 1;
        else hi = mid;
    }
    return lo > 0 && v[lo - 1].key == key ? v[lo - 1].end : -1;
}

/* Transfer latency: median over the receive waits that blocked of (wait end - producer end). */
static avgpipe_result avgpipe__fit_latency(avgpipe_context *ctx, const avgpipe_profile *p, double *latency) {
    int s;
    double *d = (double *)avgpipe_alloc(ctx, (p->nops + 1) * sizeof(double));
    avgpipe__prod *v = (avgpipe__prod *)avgpipe_alloc(ctx, (p->nops + 1) * sizeof(avgpipe__prod));
    size_t nd = 0, i;
    *latency = 0;
    if (!d || !v) {
        avgpipe_free(ctx, d);
        avgpipe_free(ctx, v);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "tune: out of memory");
    }
    for (s = 0; s < p->nsections; s++) {
        const avgpipe_profile_section *sec = &p->sections[s];
        size_t nv = 0;
        for (i = 0; i < p->nops; i++) {
            const avgpipe_profile_op *o = &p->ops[i];
            int back = o->kind == AVGPIPE_OP_B || o->kind == AVGPIPE_OP_I;
            if (o->section != s || (o->kind != AVGPIPE_OP_F && !back)) continue;
            v[nv].key = avgpipe__prod_key(sec, o->pipe, o->stage, o->micro, back);
            v[nv].ix = i;
            v[nv++].end = o->end;
        }
        qsort(v, nv, sizeof *v, avgpipe__cmp_prod);
        for (i = 0; i < p->nops; i++) {
            const avgpipe_profile_op *o = &p->ops[i];
            int fwd = o->kind == AVGPIPE_OP_RECV_F, g2 = o->stage + (fwd ? -1 : 1);
            double prod;
            if (o->section != s || (!fwd && o->kind != AVGPIPE_OP_RECV_B) || o->end - o->start < 2e-6) continue;
            if (g2 < 0 || g2 >= sec->nstages) continue;
            prod = avgpipe__prod_end(v, nv, avgpipe__prod_key(sec, o->pipe, g2, o->micro, !fwd));
            if (prod >= 0 && o->end >= prod) d[nd++] = o->end - prod;
        }
    }
    if (nd) {
        qsort(d, nd, sizeof *d, avgpipe__cmp_dbl);
        *latency = d[nd / 2];
    }
    avgpipe_free(ctx, d);
    avgpipe_free(ctx, v);
    return AVGPIPE_OK;
}

/* Mean of the middle 60% of x[0 .. n-1] (sorted in place): robust to the few ops a busy machine
   stretches, unlike the mean, and unlike the median it keeps the mix of ops with and without sends. */
static double avgpipe__trimmed_mean(double *x, size_t n) {
    size_t i, lo, hi;
    double s = 0;
    if (!n) return 0;
    qsort(x, n, sizeof *x, avgpipe__cmp_dbl);
    lo = n / 5, hi = n - n / 5;
    for (i = lo; i < hi; i++) s += x[i];
    return s / (double)(hi - lo);
}

typedef struct avgpipe__ev {
    double start, end;
    int kind;
} avgpipe__ev;

static int avgpipe__cmp_ev(const void *x, const void *y) {
    const avgpipe__ev *a = (const avgpipe__ev *)x, *b = (const avgpipe__ev *)y;
    return (a->start > b->start) - (a->start < b->start);
}

/* The runtime's own time per op: on each rank, what passes from the end of a compute or STEP op to the
   start of the next one that is not a blocked receive (posting and copying transfers, bookkeeping);
   the trimmed mean over every such op of every section. */
static avgpipe_result avgpipe__fit_overhead(avgpipe_context *ctx, const avgpipe_profile *p, double *overhead) {
    avgpipe__ev *ev = (avgpipe__ev *)avgpipe_alloc(ctx, (p->nops + 1) * sizeof *ev);
    double *gap = (double *)avgpipe_alloc(ctx, (p->nops + 1) * sizeof *gap);
    size_t i, ng = 0;
    int s, r;
    *overhead = 0;
    if (!ev || !gap) {
        avgpipe_free(ctx, ev);
        avgpipe_free(ctx, gap);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "tune: out of memory");
    }
    for (s = 0; s < p->nsections; s++)
        for (r = 0; r < p->sections[s].shape.stages; r++) {
            size_t n = 0, j;
            for (i = 0; i < p->nops; i++)
                if (p->ops[i].section == s && p->ops[i].rank == r)
                    ev[n].start = p->ops[i].start, ev[n].end = p->ops[i].end, ev[n++].kind = p->ops[i].kind;
            qsort(ev, n, sizeof *ev, avgpipe__cmp_ev);
            for (j = 0; j < n; j++) {
                double t = 0, at;
                size_t k;
                if (!avgpipe__is_compute(ev[j].kind) && ev[j].kind != AVGPIPE_OP_STEP) continue;
                for (k = j + 1, at = ev[j].end; k < n && !avgpipe__is_compute(ev[k].kind) && ev[k].kind != AVGPIPE_OP_STEP; k++) {
                    int wait = ev[k].kind == AVGPIPE_OP_RECV_F || ev[k].kind == AVGPIPE_OP_RECV_B;
                    if (ev[k].start > at) t += ev[k].start - at;       /* a gap */
                    if (!wait && ev[k].end > ev[k].start) t += ev[k].end - ev[k].start; /* a send being posted */
                    if (ev[k].end > at) at = ev[k].end;
                }
                if (k < n) gap[ng++] = t + (ev[k].start > at ? ev[k].start - at : 0);
            }
        }
    *overhead = avgpipe__trimmed_mean(gap, ng);
    avgpipe_free(ctx, ev);
    avgpipe_free(ctx, gap);
    return AVGPIPE_OK;
}

/* STEP as a function of the partition's parameters: a line through (param_floats, time) of every STEP
   op (the optimizer is one pass over them); proportional when the stages give one size. */
static void avgpipe__fit_step(const avgpipe_profile *p, avgpipe_cost_model *m) {
    double q[5] = {0, 0, 0, 0, 0};
    size_t i;
    for (i = 0; i < p->nops; i++) {
        const avgpipe_profile_op *o = &p->ops[i];
        double x, y = o->end - o->start;
        if (o->kind != AVGPIPE_OP_STEP || o->stage >= m->nstages) continue;
        x = m->param_floats[o->stage];
        q[0] += 1, q[1] += x, q[2] += y, q[3] += x * x, q[4] += x * y;
    }
    avgpipe__fit_line(q, &m->step_a, &m->step_b, 0);
}

/* The layer costs, and the averaging time per parameter. */
/* m->iter_overhead: per section, its measured time minus the span of its ops (first start to last end);
   the median over the first 64 sections where that is in [0, a quarter of the time]. */
static void avgpipe__fit_iteration(const avgpipe_profile *p, avgpipe_cost_model *m) {
    double gap[64], lo, hi;
    size_t i;
    int s, n = 0;
    m->iter_overhead = 0;
    for (s = 0; s < p->nsections && n < 64; s++) {
        const avgpipe_profile_section *sec = &p->sections[s];
        int any = 0;
        lo = HUGE_VAL, hi = -HUGE_VAL;
        for (i = 0; i < p->nops; i++)
            if (p->ops[i].section == s) {
                any = 1;
                if (p->ops[i].start < lo) lo = p->ops[i].start;
                if (p->ops[i].end > hi) hi = p->ops[i].end;
            }
        if (any && sec->seconds > 0 && sec->seconds - (hi - lo) >= 0 && sec->seconds - (hi - lo) <= 0.25 * sec->seconds)
            gap[n++] = sec->seconds - (hi - lo);
    }
    if (n) m->iter_overhead = avgpipe__median(gap, (size_t)n);
}

static double avgpipe__op_time(const avgpipe_cost_model *m, int g, int kind, double samples, double util);
static double avgpipe__avg_cost(const avgpipe_cost_model *m, int g);

/* m->busy_cores (see avgpipe_cost_model), after the op costs, overheads and averaging are fitted. */
static avgpipe_result avgpipe__fit_busy_cores(avgpipe_context *ctx, const avgpipe_profile *p, avgpipe_cost_model *m) {
    double *rate;
    char *used;
    size_t i;
    int s, t, g;
    m->busy_cores = 0;
    rate = (double *)avgpipe__calloc(ctx, (size_t)p->nsections, sizeof *rate);
    used = (char *)avgpipe__calloc(ctx, (size_t)p->nsections, 1);
    if (!rate || !used) {
        avgpipe_free(ctx, rate);
        avgpipe_free(ctx, used);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_fit: out of memory");
    }
    for (i = 0; i < p->nops; i++) { /* the ops' fitted cost, as the prediction charges them */
        const avgpipe_profile_op *o = &p->ops[i];
        if (o->section < 0 || o->section >= p->nsections || o->stage < 0 || o->stage >= m->nstages) continue;
        if (avgpipe__is_compute(o->kind) || o->kind == AVGPIPE_OP_STEP)
            rate[o->section] += avgpipe__op_time(m, o->stage, o->kind, p->sections[o->section].samples, 1);
    }
    for (s = 0; s < p->nsections; s++) { /* + one averaging contribution per stage, pipeline and round */
        const avgpipe_profile_section *sec = &p->sections[s];
        double t_run = sec->seconds - m->iter_overhead;
        for (g = 0; g < m->nstages; g++) rate[s] += (double)sec->shape.pipes * sec->shape.rounds * avgpipe__avg_cost(m, g);
        rate[s] = t_run > 0 ? rate[s] / t_run : 0;
    }
    for (s = 0; s < p->nsections; s++) { /* per shape the median, the largest of them */
        const avgpipe_sched_desc *a = &p->sections[s].shape;
        double v[64], med;
        int n = 0;
        if (used[s]) continue;
        for (t = s; t < p->nsections; t++) {
            const avgpipe_sched_desc *b = &p->sections[t].shape;
            if (used[t] || b->kind != a->kind || b->micro != a->micro || b->pipes != a->pipes) continue;
            used[t] = 1;
            if (rate[t] > 0 && n < 64) v[n++] = rate[t];
        }
        if (n && (med = avgpipe__median(v, (size_t)n)) > m->busy_cores) m->busy_cores = med;
    }
    avgpipe_free(ctx, rate);
    avgpipe_free(ctx, used);
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__fit_extras(avgpipe_context *ctx, const avgpipe_profile *p, avgpipe_cost_model *m) {
    if (p->averaging_floats > 0) m->avg_per_float = p->averaging_seconds / p->averaging_floats;
    avgpipe__fit_step(p, m);
    if (p->nlayers) {
        m->layers = (avgpipe_layer_cost *)avgpipe_alloc(ctx, (size_t)p->nlayers * sizeof *m->layers);
        if (!m->layers) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_fit: out of memory");
        memcpy(m->layers, p->layers, (size_t)p->nlayers * sizeof *m->layers);
        m->nlayers = p->nlayers;
    }
    avgpipe__fit_iteration(p, m);
    return avgpipe__fit_overhead(ctx, p, &m->op_overhead);
}

/* Has the profile a section with lo <= pipes <= hi? */
static int avgpipe__profile_has_pipes(const avgpipe_profile *p, int lo, int hi) {
    int s;
    for (s = 0; s < p->nsections; s++)
        if (p->sections[s].shape.pipes >= lo && p->sections[s].shape.pipes <= hi) return 1;
    return 0;
}

/* m->overlap from the sections with N >= 2 (needs the isolated op costs fitted from N = 1): per rank,
   the isolated time of its compute ops (a + b x samples) against the union of their intervals, h =
   isolated / busy, so N (1 - 1/h) / (N - 1) per section; the mean weighted by isolated time, in [0, 1]. */
static avgpipe_result avgpipe__fit_overlap(avgpipe_context *ctx, const avgpipe_profile *p, avgpipe_cost_model *m) {
    avgpipe__ev *ev;
    double wsum = 0, psum = 0;
    int s, r, K = AVGPIPE_OP_KIND_COUNT;
    m->overlap = 0;
    if (!avgpipe__profile_has_pipes(p, 1, 1) || !avgpipe__profile_has_pipes(p, 2, INT_MAX)) return AVGPIPE_OK;
    if (!(ev = (avgpipe__ev *)avgpipe_alloc(ctx, (p->nops + 1) * sizeof *ev))) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "tune: out of memory");
    for (s = 0; s < p->nsections; s++) {
        const avgpipe_profile_section *sec = &p->sections[s];
        double iso = 0, busy = 0, h, q;
        int N = sec->shape.pipes;
        if (N < 2) continue;
        for (r = 0; r < sec->shape.stages; r++) {
            size_t i, n = 0, j;
            double end = -1e300;
            for (i = 0; i < p->nops; i++) {
                const avgpipe_profile_op *o = &p->ops[i];
                if (o->section != s || o->rank != r || !avgpipe__is_compute(o->kind) || o->stage >= m->nstages) continue;
                iso += m->a[o->stage * K + o->kind] + m->b[o->stage * K + o->kind] * sec->samples;
                ev[n].start = o->start, ev[n++].end = o->end;
            }
            qsort(ev, n, sizeof *ev, avgpipe__cmp_ev);
            for (j = 0; j < n; j++) { /* the union of the intervals */
                double a = ev[j].start > end ? ev[j].start : end;
                if (ev[j].end > a) busy += ev[j].end - a;
                if (ev[j].end > end) end = ev[j].end;
            }
        }
        if (!(iso > 0) || !(busy > 0)) continue;
        h = iso / busy;
        q = (double)N * (1 - 1 / h) / (double)(N - 1);
        psum += iso * (q < 0 ? 0 : q > 1 ? 1 : q);
        wsum += iso;
    }
    avgpipe_free(ctx, ev);
    m->overlap = wsum > 0 ? psum / wsum : 0;
    return AVGPIPE_OK;
}

typedef struct avgpipe__obs {
    int g, k;
    double x, y;
} avgpipe__obs;

static int avgpipe__cmp_obs(const void *x, const void *y) {
    const avgpipe__obs *a = (const avgpipe__obs *)x, *b = (const avgpipe__obs *)y;
    if (a->g != b->g) return a->g - b->g;
    if (a->k != b->k) return a->k - b->k;
    if (a->x != b->x) return a->x < b->x ? -1 : 1;
    return (a->y > b->y) - (a->y < b->y);
}

/* The points the lines are fitted through: per (stage, kind), the median op time at each micro-batch size
   (sums[(g K + k) 5 ..]: n, sum x, sum y, sum x^2, sum x y over the sizes). Medians, not every op: a few
   ops stretched by another program on a shared machine would pull a least-squares line. */
static avgpipe_result avgpipe__fit_medians(avgpipe_context *ctx, const avgpipe_profile *p, int G, double *sums) {
    avgpipe__obs *o = (avgpipe__obs *)avgpipe_alloc(ctx, (p->nops + 1) * sizeof *o);
    size_t n = 0, i, j;
    int isolated = avgpipe__profile_has_pipes(p, 1, 1); /* the ops' own times: from N = 1 where there is one */
    if (!o) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_fit: out of memory");
    for (i = 0; i < p->nops; i++) {
        const avgpipe_profile_op *op = &p->ops[i];
        if ((!avgpipe__is_compute(op->kind) && op->kind != AVGPIPE_OP_STEP) || op->stage >= G) continue;
        if (isolated && p->sections[op->section].shape.pipes > 1) continue;
        o[n].g = op->stage, o[n].k = op->kind, o[n].x = p->sections[op->section].samples, o[n++].y = op->end - op->start;
    }
    qsort(o, n, sizeof *o, avgpipe__cmp_obs);
    for (i = 0; i < n; i = j) {
        double *q = &sums[((size_t)o[i].g * AVGPIPE_OP_KIND_COUNT + (size_t)o[i].k) * 5], x = o[i].x, y;
        for (j = i; j < n && o[j].g == o[i].g && o[j].k == o[i].k && o[j].x == x; j++) continue;
        y = (j - i) % 2 ? o[i + (j - i) / 2].y : (o[i + (j - i) / 2 - 1].y + o[i + (j - i) / 2].y) / 2;
        q[0] += 1, q[1] += x, q[2] += y, q[3] += x * x, q[4] += x * y;
    }
    avgpipe_free(ctx, o);
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_tune_fit(avgpipe_context *ctx, const avgpipe_profile *p, avgpipe_cost_model *out) {
    int G, s, g, k, K = AVGPIPE_OP_KIND_COUNT;
    double *sums;
    avgpipe_result res;
    if (!p || !out || p->nsections < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_fit: NULL or empty profile");
    memset(out, 0, sizeof *out);
    G = p->sections[0].nstages;
    for (s = 1; s < p->nsections; s++)
        if (p->sections[s].nstages != G)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_fit: section %d has %d stages, section 1 has %d", s + 1,
                                 p->sections[s].nstages, G);
    out->nstages = G;
    out->a = (double *)avgpipe__calloc(ctx, (size_t)G * K, sizeof(double));
    out->b = (double *)avgpipe__calloc(ctx, (size_t)G * K, sizeof(double));
    out->param_floats = (double *)avgpipe__calloc(ctx, (size_t)G, sizeof(double));
    out->act_bytes_per_sample = (double *)avgpipe__calloc(ctx, (size_t)G, sizeof(double));
    sums = (double *)avgpipe__calloc(ctx, (size_t)G * K * 5, sizeof(double));
    if (!out->a || !out->b || !out->param_floats || !out->act_bytes_per_sample || !sums) {
        avgpipe_free(ctx, sums);
        avgpipe_tune_cost_model_free(ctx, out);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_fit: out of memory");
    }
    out->samples_lo = out->samples_hi = p->sections[0].samples;
    for (s = 0; s < p->nsections; s++) {
        if (p->sections[s].samples < out->samples_lo) out->samples_lo = p->sections[s].samples;
        if (p->sections[s].samples > out->samples_hi) out->samples_hi = p->sections[s].samples;
    }
    for (g = 0; g < G; g++) {
        out->param_floats[g] = p->sections[0].param_floats[g];
        out->act_bytes_per_sample[g] = p->sections[0].act_bytes[g] / p->sections[0].samples;
    }
    res = avgpipe__fit_medians(ctx, p, G, sums);
    if (res) {
        avgpipe_free(ctx, sums);
        avgpipe_tune_cost_model_free(ctx, out);
        return res;
    }
    for (g = 0; g < G; g++)
        for (k = 0; k < K; k++)
            avgpipe__fit_line(&sums[((size_t)g * K + (size_t)k) * 5], &out->a[g * K + k], &out->b[g * K + k], k == AVGPIPE_OP_STEP);
    for (g = 0; g < G; g++) { /* a backward seen only whole, or only split */
        double *a = &out->a[g * K], *b = &out->b[g * K];
        double nB = sums[((size_t)g * K + AVGPIPE_OP_B) * 5], nI = sums[((size_t)g * K + AVGPIPE_OP_I) * 5];
        if (nB == 0 && nI > 0) {
            a[AVGPIPE_OP_B] = a[AVGPIPE_OP_I] + a[AVGPIPE_OP_W];
            b[AVGPIPE_OP_B] = b[AVGPIPE_OP_I] + b[AVGPIPE_OP_W];
        } else if (nI == 0 && nB > 0) {
            a[AVGPIPE_OP_I] = a[AVGPIPE_OP_W] = a[AVGPIPE_OP_B] / 2;
            b[AVGPIPE_OP_I] = b[AVGPIPE_OP_W] = b[AVGPIPE_OP_B] / 2;
        }
    }
    avgpipe_free(ctx, sums);
    res = avgpipe__fit_latency(ctx, p, &out->latency);
    if (!res) res = avgpipe__fit_extras(ctx, p, out);
    if (!res) res = avgpipe__fit_overlap(ctx, p, out);
    if (!res) res = avgpipe__fit_busy_cores(ctx, p, out);
    if (res) avgpipe_tune_cost_model_free(ctx, out);
    return res;
}

typedef struct avgpipe__pred {
    const avgpipe_cost_model *m;
    double samples;
    int avg_on_rank; /* N = 1: the next round's forward waits for the averaging, on the rank's timeline */
    double util;     /* compute ops' share of their isolated time with N pipelines on a device (m->overlap) */
} avgpipe__pred;

/* One averaging contribution of stage g. */
static double avgpipe__avg_cost(const avgpipe_cost_model *m, int g) { return m->avg_per_float * m->param_floats[g]; }

/* The cores the cores bound divides by for `ranks` ranks (m->cores set): m->cores, or the fitted
   busy_cores when the ranks outnumber the cores and it is less, but at least one core (a profile whose
   sections were bound by their bubbles shows less than the machine can do; one thread uses one core). */
static double avgpipe__cores(const avgpipe_cost_model *m, int ranks) {
    double c = m->busy_cores > 1 ? m->busy_cores : 1;
    return (double)ranks > m->cores && m->busy_cores > 0 && c < m->cores ? c : m->cores;
}

/* The share of a compute op's own time that is left when N pipelines share each device (their kernels
   overlap by cost_model.overlap): 1 - overlap (N - 1) / N; 1 for N = 1 or overlap 0. */
static double avgpipe__util(const avgpipe_cost_model *m, int N) { return 1 - m->overlap * (double)(N - 1) / (double)N; }

/* THE predicted time of one F, B, I, W or STEP op of stage g on `samples` samples, with compute ops
   scaled by util (avgpipe__util of the setting's N): stage g's line a + b * samples for its kind, plus
   the runtime's per-op overhead. The prediction (the simulator's cost function) and the partitioner's
   bound both take op times from here. Invariant the bound relies on: for a fixed (g, kind) it is
   nondecreasing in samples and in util (a, b >= 0, util in (0, 1]), so the time at a batch's B samples
   and the least util any searched N gives is a lower bound of that op's share in every candidate. */
static double avgpipe__op_time(const avgpipe_cost_model *m, int g, int kind, double samples, double util) {
    size_t ix = (size_t)g * AVGPIPE_OP_KIND_COUNT + (size_t)kind;
    return (m->a[ix] + m->b[ix] * samples) * (kind == AVGPIPE_OP_STEP ? 1 : util) + m->op_overhead;
}

static double avgpipe__pred_cost(const avgpipe__pred *p, int g, int kind) {
    if (kind == AVGPIPE_OP_AVG) return p->avg_on_rank ? avgpipe__avg_cost(p->m, g) : 0;
    if (kind == AVGPIPE_OP_AGREE) return avgpipe__avg_cost(p->m, g); /* a pass over the partition's gradients */
    if (!avgpipe__is_compute(kind) && kind != AVGPIPE_OP_STEP) return 0;
    return avgpipe__op_time(p->m, g, kind, p->samples, p->util);
}

AVGPIPE_API avgpipe_result avgpipe_tune_predict(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_sched_desc *sched,
                                                double samples, double *seconds) {
    return avgpipe_tune_predict_sync(ctx, m, sched, samples, NULL, seconds);
}

static avgpipe_result avgpipe__tune_predict_on(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_schedule *gen, double samples,
                                              const avgpipe_tune_desc *sync, double *seconds, avgpipe_schedule *synced_out);

AVGPIPE_API avgpipe_result avgpipe_tune_predict_sync(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_sched_desc *sched,
                                                     double samples, const avgpipe_tune_desc *sync, double *seconds) {
    avgpipe_schedule s;
    avgpipe_result res;
    if (!m || !sched || !seconds || !(samples > 0)) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_predict: bad argument");
    if (sync && sync->nties && !sync->ties) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_predict_sync: ties is NULL with nties %d", sync->nties);
    if ((res = avgpipe_sched_generate(ctx, sched, &s)) != AVGPIPE_OK) return res;
    res = avgpipe__tune_predict_on(ctx, m, &s, samples, sync, seconds, NULL);
    avgpipe_sched_free(ctx, &s);
    return res;
}

/* avgpipe_tune_predict_sync of the schedule gen, generated from the setting (arguments checked).
   synced_out (may be NULL): the schedule with the TIE and AGREE ops it placed (emptied when it placed
   none); free it. */
static avgpipe_result avgpipe__tune_predict_on(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_schedule *gen, double samples,
                                              const avgpipe_tune_desc *sync, double *seconds, avgpipe_schedule *synced_out) {
    avgpipe_schedule synced;
    const avgpipe_schedule *sp = gen;
    avgpipe_sim_desc sd;
    avgpipe_sim_result r;
    avgpipe__pred pr;
    avgpipe_result res;
    double *tie_bytes = NULL, *cost;
    int t, g, k;
    if (gen->nstages != m->nstages)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_predict: the schedule has %d stage partitions, the model %d", gen->nstages,
                             m->nstages);
    memset(&sd, 0, sizeof sd);
    memset(&synced, 0, sizeof synced);
    if (sync && (sync->nties > 0 || sync->agree)) { /* the run's TIE and AGREE ops, placed as the run places them */
        avgpipe_sync_desc sy;
        memset(&sy, 0, sizeof sy);
        sy.ties = sync->ties, sy.nties = sync->nties, sy.agree = sync->agree != 0;
        if ((res = avgpipe_sched_add_sync(ctx, gen, &sy, &synced)) != AVGPIPE_OK) return res;
        sp = &synced;
        if (!(tie_bytes = (double *)avgpipe__calloc(ctx, (size_t)m->nstages, sizeof(double)))) {
            avgpipe_sched_free(ctx, &synced);
            return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_predict_sync: out of memory");
        }
        for (t = 0; t < sync->nties; t++) {
            int lo = sync->ties[t].stage_a < sync->ties[t].stage_b ? sync->ties[t].stage_a : sync->ties[t].stage_b;
            if (lo >= 0 && lo < m->nstages) tie_bytes[lo] += 4.0 * (double)sync->ties[t].count;
        }
        sd.stage_tie_bytes = tie_bytes;
    }
    pr.m = m;
    pr.samples = samples;
    pr.avg_on_rank = sp->shape.pipes == 1;
    pr.util = avgpipe__util(m, sp->shape.pipes);
    /* The costs as a table: every cost depends on the op's stage and kind alone, and the simulator
       looks a table up faster than it calls a function per op; the same values (both count a negative
       cost as zero). */
    if (!(cost = (double *)avgpipe_alloc(ctx, (size_t)m->nstages * AVGPIPE_OP_KIND_COUNT * sizeof(double)))) {
        avgpipe_free(ctx, tie_bytes);
        avgpipe_sched_free(ctx, &synced);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_predict: out of memory");
    }
    for (g = 0; g < m->nstages; g++)
        for (k = 0; k < AVGPIPE_OP_KIND_COUNT; k++) cost[(size_t)g * AVGPIPE_OP_KIND_COUNT + k] = avgpipe__pred_cost(&pr, g, k);
    sd.stage_cost = cost;
    sd.latency = m->latency;
    {
        avgpipe__extent ext = avgpipe__gen_extent(gen, sp != gen); /* generated: no scan */
        res = avgpipe__sim_core(ctx, sp, &sd, &r, NULL, &ext, 0);
    }
    avgpipe_free(ctx, tie_bytes);
    avgpipe_free(ctx, cost);
    if (res) {
        avgpipe_sched_free(ctx, &synced);
        return res;
    }
    *seconds = r.makespan;
    if (m->cores > 0) { /* the ranks, and their averaging threads, time-share the cores */
        double busy = 0, cores = avgpipe__cores(m, r.nranks);
        int k, g;
        for (k = 0; k < r.nranks; k++) busy += r.rank[k].busy;
        for (g = 0; g < m->nstages && !pr.avg_on_rank; g++)
            busy += (double)sp->shape.pipes * sp->shape.rounds * avgpipe__avg_cost(m, g);
        if (busy / cores > *seconds) *seconds = busy / cores;
    }
    *seconds += m->iter_overhead;
    if (synced_out) *synced_out = synced; /* the caller's now */
    else avgpipe_sched_free(ctx, &synced);
    avgpipe_sim_result_free(ctx, &r);
    return AVGPIPE_OK;
}

/* An empty model of G partitions with m's shared terms. */
static avgpipe_result avgpipe__model_like(avgpipe_context *ctx, const avgpipe_cost_model *m, int G, avgpipe_cost_model *out) {
    int K = AVGPIPE_OP_KIND_COUNT;
    memset(out, 0, sizeof *out);
    out->nstages = G;
    out->a = (double *)avgpipe__calloc(ctx, (size_t)G * K, sizeof(double));
    out->b = (double *)avgpipe__calloc(ctx, (size_t)G * K, sizeof(double));
    out->param_floats = (double *)avgpipe__calloc(ctx, (size_t)G, sizeof(double));
    out->act_bytes_per_sample = (double *)avgpipe__calloc(ctx, (size_t)G, sizeof(double));
    out->layers = (avgpipe_layer_cost *)avgpipe_alloc(ctx, (size_t)m->nlayers * sizeof *out->layers);
    if (!out->a || !out->b || !out->param_floats || !out->act_bytes_per_sample || !out->layers) {
        avgpipe_tune_cost_model_free(ctx, out);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_split_model: out of memory");
    }
    memcpy(out->layers, m->layers, (size_t)m->nlayers * sizeof *out->layers);
    out->nlayers = m->nlayers;
    out->latency = m->latency;
    out->samples_lo = m->samples_lo, out->samples_hi = m->samples_hi;
    out->cores = m->cores;
    out->op_overhead = m->op_overhead;
    out->iter_overhead = m->iter_overhead;
    out->overlap = m->overlap;
    out->busy_cores = m->busy_cores;
    out->avg_per_float = m->avg_per_float;
    out->step_a = m->step_a, out->step_b = m->step_b;
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_tune_split_model(avgpipe_context *ctx, const avgpipe_cost_model *m, const int *split, int nparts,
                                              avgpipe_cost_model *out) {
    int g, l = 0, i, K = AVGPIPE_OP_KIND_COUNT;
    avgpipe_result res;
    if (!m || !split || !out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_split_model: NULL argument");
    if (m->nlayers < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_split_model: the model has no layer costs ('layer' lines)");
    if (nparts < 1 || nparts > m->nlayers)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "nparts: %d partitions for %d layers (1..%d)", nparts, m->nlayers, m->nlayers);
    for (g = 0; g < nparts; g++) {
        if (split[g] < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "split[%d]: %d layers (each partition needs >= 1)", g, split[g]);
        l += split[g];
        if (l > m->nlayers) break;
    }
    if (l != m->nlayers) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "split: the partitions hold %s%d layers, the model has %d",
                                              l > m->nlayers ? "more than " : "", l, m->nlayers);
    if ((res = avgpipe__model_like(ctx, m, nparts, out)) != AVGPIPE_OK) return res;
    for (g = 0, l = 0; g < nparts; g++)
        for (i = 0; i < split[g]; i++, l++) {
            const avgpipe_layer_cost *c = &m->layers[l];
            double *a = &out->a[g * K], *b = &out->b[g * K];
            out->layers[l].stage = g;
            a[AVGPIPE_OP_F] += c->f_a, b[AVGPIPE_OP_F] += c->f_b;
            a[AVGPIPE_OP_B] += c->b_a, b[AVGPIPE_OP_B] += c->b_b;
            a[AVGPIPE_OP_I] += c->b_a / 2, b[AVGPIPE_OP_I] += c->b_b / 2;
            a[AVGPIPE_OP_W] += c->b_a / 2, b[AVGPIPE_OP_W] += c->b_b / 2;
            out->param_floats[g] += c->param_floats;
            if (i + 1 == split[g]) out->act_bytes_per_sample[g] = g + 1 < nparts ? c->act_bytes : 0;
        }
    for (g = 0; g < nparts; g++) out->a[g * K + AVGPIPE_OP_STEP] = m->step_a + m->step_b * out->param_floats[g];
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_tune_measure_averaging(avgpipe_context *ctx, size_t floats, double *seconds) {
    enum { WARM = 4, TIMED = 16 };
    avgpipe_ea_desc d;
    avgpipe_ea *ea = NULL;
    float *w = NULL;
    double t[TIMED];
    int k;
    avgpipe_result res;
    if (!seconds || floats < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_measure_averaging: floats must be >= 1");
    *seconds = 0;
    w = (float *)avgpipe__calloc(ctx, 2 * floats, sizeof *w); /* two pipelines' models, zero: finite */
    if (!w) return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_measure_averaging: out of memory");
    memset(&d, 0, sizeof d);
    d.count = floats;
    d.pipes = 2;
    d.initial = w;
    res = avgpipe_ea_create(ctx, &d, &ea);
    for (k = 0; !res && k < WARM + TIMED; k++) { /* round k / 2 of pipeline k % 2, in order */
        double t0 = avgpipe__now();
        res = avgpipe_ea_contribute(ctx, ea, k % 2, (uint64_t)(k / 2), w + (size_t)(k % 2) * floats, NULL);
        if (k >= WARM) t[k - WARM] = avgpipe__now() - t0;
    }
    if (!res) {
        qsort(t, TIMED, sizeof *t, avgpipe__cmp_dbl);
        *seconds = (t[TIMED / 2 - 1] + t[TIMED / 2]) / 2;
    }
    avgpipe_ea_destroy(ea);
    avgpipe_free(ctx, w);
    return res;
}

/* The estimate from the observations' averages s = mean |g_s|^2, b = mean |g_b|^2 (k of them). */
static void avgpipe__noise_from(double s, double b, int k, double bs, double bb, avgpipe_noise_scale *o) {
    o->gsq = (bb * b - bs * s) / (bb - bs);
    o->trace = (s - b) / (1 / bs - 1 / bb);
    o->scale = o->gsq > 0 && o->trace > 0 ? o->trace / o->gsq : 0;
    o->n = k;
}

AVGPIPE_API avgpipe_result avgpipe_tune_noise_scale(avgpipe_context *ctx, const double *small_sq, const double *big_sq, int n,
                                                    double b_small, double b_big, avgpipe_noise_scale *out) {
    avgpipe_noise_scale one;
    double ss = 0, sb = 0, mean = 0, var = 0;
    int i, pass;
    if (!small_sq || !big_sq || !out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_noise_scale: NULL argument");
    memset(out, 0, sizeof *out);
    if (n < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_noise_scale: n is %d (at least 1 observation)", n);
    if (!avgpipe__finite(b_small) || !avgpipe__finite(b_big) || !(b_small >= 1) || !(b_big > b_small))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_noise_scale: b_small %g, b_big %g (1 <= b_small < b_big, finite)", b_small, b_big);
    for (i = 0; i < n; i++) {
        if (!avgpipe__finite(small_sq[i]) || !avgpipe__finite(big_sq[i]) || !(small_sq[i] >= 0) || !(big_sq[i] >= 0))
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_noise_scale: observation %d: small_sq %g, big_sq %g (finite, >= 0)", i,
                                 small_sq[i], big_sq[i]);
        ss += small_sq[i], sb += big_sq[i];
    }
    avgpipe__noise_from(ss / n, sb / n, n, b_small, b_big, out);
    if (n < 2 || out->scale == 0) return AVGPIPE_OK;
    /* jackknife: the estimate without observation i, from the sums less it; var = (n - 1) / n sum (x_i - mean)^2,
       the mean in pass 0, the squares in pass 1 */
    for (pass = 0; pass < 2; pass++)
        for (i = 0; i < n; i++) {
            avgpipe__noise_from((ss - small_sq[i]) / (n - 1), (sb - big_sq[i]) / (n - 1), n - 1, b_small, b_big, &one);
            if (pass == 0) mean += one.scale / n;
            else var += (one.scale - mean) * (one.scale - mean);
        }
    out->rel_err = sqrt(var * (n - 1) / n) / out->scale;
    return AVGPIPE_OK;
}

AVGPIPE_API double avgpipe_tune_noise_from_ratio(double batch, double k, double ratio) {
    double lo, hi;
    if (!avgpipe__finite(batch) || !avgpipe__finite(k) || !avgpipe__finite(ratio) || !(batch >= 1) || !(k > 1)) return -1;
    lo = 1 + 0.001 * (k - 1), hi = 1 + 0.999 * (k - 1);
    ratio = ratio < lo ? lo : ratio > hi ? hi : ratio;
    return batch * (k - ratio) / (ratio - 1);
}

AVGPIPE_API double avgpipe_tune_efficiency(double noise_scale, double samples_per_round) {
    if (!avgpipe__finite(samples_per_round) || !avgpipe__finite(noise_scale) || !(samples_per_round > 0) || !(noise_scale >= 0)) return -1;
    return noise_scale > 0 ? 1 + samples_per_round / noise_scale : 1;
}

/* Work per sample of partition g (forward, backward, STEP), micro-batches of x samples, batches of B. */
static double avgpipe__part_work(const avgpipe_cost_model *m, int g, double x, double B) {
    const double *a = &m->a[g * AVGPIPE_OP_KIND_COUNT], *b = &m->b[g * AVGPIPE_OP_KIND_COUNT];
    return (a[AVGPIPE_OP_F] + b[AVGPIPE_OP_F] * x + a[AVGPIPE_OP_B] + b[AVGPIPE_OP_B] * x) / x + a[AVGPIPE_OP_STEP] / B;
}

AVGPIPE_API double avgpipe_tune_slowest_share(const avgpipe_cost_model *m, int stages, double samples, int batch) {
    double total = 0, worst = 0, w;
    int r, g;
    if (!m || stages < 1 || m->nstages < 1 || m->nstages % stages || !(samples > 0) || batch < 1) return -1;
    for (r = 0; r < stages; r++) {
        for (g = r, w = 0; g < m->nstages; g += stages) w += avgpipe__part_work(m, g, samples, (double)batch);
        total += w;
        if (w > worst) worst = w;
    }
    return total > 0 ? worst / total : -1;
}

/* --- 22. Search and the stage partitioner ----------------------------------------------------- */

/* The order of the throughput ranking; the time-to-target ranking (below) puts time_to_target first. */
static int avgpipe__cmp_candidate(const void *x, const void *y) {
    const avgpipe_tune_candidate *a = (const avgpipe_tune_candidate *)x, *b = (const avgpipe_tune_candidate *)y;
    if (a->fits != b->fits) return b->fits - a->fits;
    if (a->time_per_sample != b->time_per_sample) return (a->time_per_sample > b->time_per_sample) ? 1 : -1;
    /* ties (often exact: a stage-bound pipeline): less memory, fewer pipelines, fewer micro-batches, K */
    if (a->peak_bytes != b->peak_bytes) return (a->peak_bytes > b->peak_bytes) ? 1 : -1;
    if (a->sched.pipes != b->sched.pipes) return a->sched.pipes - b->sched.pipes;
    if (a->sched.micro != b->sched.micro) return a->sched.micro - b->sched.micro;
    if (a->sched.kind != b->sched.kind) return (int)a->sched.kind - (int)b->sched.kind;
    if (a->sched.continuous != b->sched.continuous) return a->sched.continuous - b->sched.continuous;
    return a->sched.advance - b->sched.advance;
}

static int avgpipe__cmp_candidate_ttt(const void *x, const void *y) {
    const avgpipe_tune_candidate *a = (const avgpipe_tune_candidate *)x, *b = (const avgpipe_tune_candidate *)y;
    if (a->fits != b->fits) return b->fits - a->fits;
    if (a->time_to_target != b->time_to_target) return (a->time_to_target > b->time_to_target) ? 1 : -1;
    return avgpipe__cmp_candidate(x, y);
}

/* What a ranking by td's objective minimises. */
static double avgpipe__tune_key(const avgpipe_tune_desc *td, const avgpipe_tune_candidate *c) {
    return td->objective == AVGPIPE_TUNE_THROUGHPUT ? c->time_per_sample : c->time_to_target;
}

/* The sizes the memory model converts to size_t must be in range first (a model is plain data the
   caller may have filled in): parameters and activation bytes per sample finite, within the
   profile's bounds. */
static avgpipe_result avgpipe__model_check(avgpipe_context *ctx, const avgpipe_cost_model *m) {
    int g;
    if (m->nstages < 1 || m->nstages > AVGPIPE__MAX_STAGES || !m->a || !m->b || !m->param_floats || !m->act_bytes_per_sample)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "cost model: %d stages (1..%d) or a table missing", m->nstages, AVGPIPE__MAX_STAGES);
    for (g = 0; g < m->nstages; g++) {
        if (!(m->param_floats[g] >= 0 && m->param_floats[g] <= AVGPIPE__PROFILE_MAX_FLOATS))
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "cost model: stage %d: param_floats %g is not a number from 0 to 2^48", g,
                                 m->param_floats[g]);
        if (!(m->act_bytes_per_sample[g] >= 0 && m->act_bytes_per_sample[g] <= AVGPIPE__PROFILE_MAX_BYTES))
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "cost model: stage %d: act_bytes_per_sample %g is not a number from 0 to 2^50",
                                 g, m->act_bytes_per_sample[g]);
    }
    return AVGPIPE_OK;
}

/* Predict one candidate: time by simulation, memory by the runtime's planner (or from the slot counts
   slots_in an earlier plan of the same schedule found; slots_out, if not NULL, gets the plan's). memo
   (may be NULL): the thread's cache of ranks' slot counts. */
static avgpipe_result avgpipe__tune_eval(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *td,
                                         avgpipe_tune_candidate *c, size_t *act, size_t *pcount, double *mem, const int *slots_in,
                                         int *slots_out, avgpipe__slot_memo *memo) {
    avgpipe_run_desc rd;
    avgpipe_schedule gen, synced;
    avgpipe_result res;
    int g, r, S = c->sched.stages;
    if (td->nties && !td->ties) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_predict_sync: ties is NULL with nties %d", td->nties);
    for (g = 0; g < m->nstages; g++) { /* checked before the conversion: an out-of-range double -> size_t is undefined */
        double ab = m->act_bytes_per_sample[g] * c->samples + 0.5;
        if (!(ab <= AVGPIPE__PROFILE_MAX_BYTES))
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG,
                                 "tune: stage %d: %.4g activation bytes per micro-batch of %g samples (act_bytes_per_sample %g) is over "
                                 "2^50 bytes",
                                 g, ab, c->samples, m->act_bytes_per_sample[g]);
        act[g] = (size_t)ab;
        pcount[g] = m->param_floats[g] >= 1 ? (size_t)m->param_floats[g] : 1; /* in range: avgpipe__model_check */
    }
    memset(&synced, 0, sizeof synced);
    if ((res = avgpipe_sched_generate(ctx, &c->sched, &gen)) != AVGPIPE_OK) return res; /* once: the prediction's and the memory's */
    res = avgpipe__tune_predict_on(ctx, m, &gen, c->samples, td, &c->seconds, &synced);
    if (!res && synced.len) { /* its TIE and AGREE ops are those the run places (the same pairs, the agreement): the memory's too */
        avgpipe_sched_free(ctx, &gen);
        gen = synced;
    }
    if (res) {
        avgpipe_sched_free(ctx, &gen);
        return res;
    }
    c->time_per_sample = c->seconds / ((double)c->sched.rounds * c->sched.pipes * td->batch);
    c->efficiency = avgpipe_tune_efficiency(td->noise_scale, (double)c->sched.pipes * td->batch);
    c->time_to_target = c->time_per_sample * c->efficiency * td->target_samples; /* resolved: 0 -> 1 */
    memset(&rd, 0, sizeof rd);
    rd.sched = c->sched;
    rd.act_bytes = act;
    rd.param_count = pcount;
    rd.agree.skip_nonfinite = td->agree != 0; /* the agreement's tables */
    if (td->nties > 0) { /* the ties' buffers: only their stages and counts matter (the offsets move with the split) */
        size_t *at = (size_t *)avgpipe__calloc(ctx, (size_t)m->nstages, sizeof(size_t));
        avgpipe_tie *t = (avgpipe_tie *)avgpipe_alloc(ctx, (size_t)td->nties * sizeof *t);
        int k;
        if (!at || !t) res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "tune: out of memory");
        for (k = 0; !res && k < td->nties; k++) {
            int a = td->ties[k].stage_a, b = td->ties[k].stage_b;
            if (a < 0 || a >= m->nstages || b < 0 || b >= m->nstages || a == b)
                res = avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "tune: ties[%d]: stages %d and %d (the model has %d partitions)", k, a, b, m->nstages);
            else if (at[a] + td->ties[k].count > pcount[a] || at[b] + td->ties[k].count > pcount[b])
                res = avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "tune: ties[%d]: %zu floats do not fit in partition %d or %d of this split", k,
                                    td->ties[k].count, a, b);
            else
                t[k] = td->ties[k], t[k].offset_a = at[a], t[k].offset_b = at[b], at[a] += t[k].count, at[b] += t[k].count;
        }
        rd.ties = t, rd.nties = td->nties;
        if (!res) res = avgpipe__run_memory_in(ctx, &rd, slots_in, slots_out, &gen, memo, mem);
        avgpipe_free(ctx, at);
        avgpipe_free(ctx, t);
    } else {
        res = avgpipe__run_memory_in(ctx, &rd, slots_in, slots_out, &gen, memo, mem);
    }
    avgpipe_sched_free(ctx, &gen); /* emptied when the memory model took it */
    if (res) return res;
    c->peak_bytes = 0;
    for (r = 0; r < S; r++) {
        double b = mem[r];
        for (g = r; g < m->nstages; g += S) b += (double)c->sched.pipes * (double)pcount[g] * (4.0 + td->opt_bytes_per_param);
        if (b > c->peak_bytes) c->peak_bytes = b;
    }
    c->fits = td->mem_limit <= 0 || c->peak_bytes <= td->mem_limit;
    return AVGPIPE_OK;
}

/* The kinds a search runs (bit 1u << kind), from desc->kinds (0: the table's tuned kinds) and the model's
   partitions per rank V: a kind runs when it holds V stages per rank (interleaved any V > 1, the others
   their own count). A kind asked for by name that cannot hold V is refused, naming it: the search never
   drops what it was asked for without a word. */
/* Whether kind k holds V stages per rank (interleaved with V = 1 is 1F1B). */
static int avgpipe__kind_holds(int k, int V) {
    const avgpipe_sched_kind_info *info = &avgpipe__kinds[k];
    return info->chunks ? info->chunks == V : V > 1;
}

AVGPIPE_API avgpipe_tune_desc avgpipe_tune_query_defaults(const avgpipe_tune_desc *desc) {
    avgpipe_tune_desc d;
    int k;
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    if (!d.max_pipes) d.max_pipes = 4;
    if (!d.rounds) d.rounds = 1;
    if (!d.min_micro) d.min_micro = 1;
    if (!d.chunks) d.chunks = 1;
    if (!(d.target_samples > 0)) d.target_samples = 1;
    if (!d.threads) d.threads = 1;
    if (!d.kinds)
        for (k = AVGPIPE_SCHED_CUSTOM + 1; k < AVGPIPE_SCHED_KIND_COUNT; k++)
            if (avgpipe__kinds[k].tuned && avgpipe__kind_holds(k, d.chunks)) d.kinds |= 1u << k;
    return d;
}

AVGPIPE_API avgpipe_tune_split_desc avgpipe_tune_split_query_defaults(const avgpipe_tune_split_desc *desc) {
    avgpipe_tune_split_desc d;
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    if (!d.chunks) d.chunks = 1;
    return d;
}

static avgpipe_result avgpipe__tune_kinds(avgpipe_context *ctx, const avgpipe_tune_desc *td, int V, unsigned *out) {
    unsigned kinds = 0;
    int k;
    if (td->kinds & ~((1u << AVGPIPE_SCHED_KIND_COUNT) - 2u))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "kinds: 0x%x names no generator kind (bits 1 .. %d)", td->kinds, AVGPIPE_SCHED_KIND_COUNT - 1);
    for (k = AVGPIPE_SCHED_CUSTOM + 1; k < AVGPIPE_SCHED_KIND_COUNT; k++) {
        const avgpipe_sched_kind_info *info = &avgpipe__kinds[k];
        int holds = avgpipe__kind_holds(k, V);
        if (td->kinds ? !(td->kinds & (1u << k)) : !info->tuned) continue;
        if (holds) kinds |= 1u << k;
        else if (td->kinds)
            return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "kinds: %s holds %s stage%s per rank, the model %d (chunks = %d)", info->name,
                                 info->chunks ? (info->chunks == 1 ? "1" : "2") : "several", info->chunks == 1 ? "" : "s", V, V);
    }
    if (!kinds)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "kinds: none of the kinds searched holds %d stages per rank (chunks = %d)", V, V);
    *out = kinds;
    return AVGPIPE_OK;
}

/* The time-to-target fields of a search description. */
static avgpipe_result avgpipe__tune_objective_check(avgpipe_context *ctx, const avgpipe_tune_desc *td) {
    if (!avgpipe__finite(td->noise_scale) || !(td->noise_scale >= 0) || !avgpipe__finite(td->target_samples) || !(td->target_samples >= 0))
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "noise_scale %g, target_samples %g: must be finite and >= 0", td->noise_scale,
                             td->target_samples);
    if (td->objective != AVGPIPE_TUNE_TIME_TO_TARGET && td->objective != AVGPIPE_TUNE_THROUGHPUT)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "objective: %d (AVGPIPE_TUNE_TIME_TO_TARGET or AVGPIPE_TUNE_THROUGHPUT)", td->objective);
    return AVGPIPE_OK;
}

/* The search's predictions, shared by its threads: candidates [0, n) of list, taken in blocks from
   `next`. A thread that fails at candidate i records it when i is the least failure so far; blocks
   starting past that are not taken (the serial search would have stopped there), so the error
   reported is the one of the first failing candidate in the search's order, whatever the threads. */
typedef struct avgpipe__tune_pool {
    const avgpipe_cost_model *m;
    const avgpipe_tune_desc *td;
    avgpipe_tune_candidate *list;
    int n;
    int *slots, known; /* [n][G] the candidates' slot counts: known, or to be filled in; NULL: neither */
    pthread_mutex_t mu;
    int next;                       /* under mu: the first candidate no thread has taken */
    int failed;                     /* under mu: the least failing candidate; n: none */
    avgpipe_result res;             /* under mu: its result and detail */
    char error[AVGPIPE_ERROR_MAX];
} avgpipe__tune_pool;

typedef struct avgpipe__tune_worker {
    avgpipe__tune_pool *pool;
    avgpipe_context ctx; /* the caller's allocator; its own error buffer; no logger */
    avgpipe_context *caller; /* the calling thread's worker: its context, for the progress lines; else NULL */
} avgpipe__tune_worker;

#ifndef AVGPIPE__TUNE_PROGRESS_S
#define AVGPIPE__TUNE_PROGRESS_S 5.0 /* seconds between the search's progress lines (AVGPIPE_LOG_INFO) */
#endif

#define AVGPIPE__TUNE_BLOCK 8 /* candidates a thread takes at a time */

static void *avgpipe__tune_work(void *arg) {
    avgpipe__tune_worker *w = (avgpipe__tune_worker *)arg;
    avgpipe__tune_pool *p = w->pool;
    int G = p->m->nstages, S = G / p->td->chunks, i, j, end;
    size_t *act = (size_t *)avgpipe__calloc(&w->ctx, 2 * (size_t)G, sizeof(size_t)), *pcount = act ? act + G : NULL; /* per partition */
    double *mem = (double *)avgpipe__calloc(&w->ctx, (size_t)S, sizeof(double));                                 /* per rank */
    avgpipe_result res = act && mem ? AVGPIPE_OK : avgpipe__fail(&w->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_search: out of memory");
    double t0 = w->caller ? avgpipe__now() : 0, said = t0;
    avgpipe__slot_memo memo; /* the ranks' slot counts this thread has found */
    memset(&memo, 0, sizeof memo);
    for (;;) {
        pthread_mutex_lock(&p->mu);
        i = p->next;
        if (res) { /* out of memory before the first candidate: the first one not yet taken fails */
            if (i < p->failed) p->failed = i, p->res = res, memcpy(p->error, w->ctx.error, sizeof p->error);
            i = p->n;
        }
        if (i < p->failed) p->next = i + AVGPIPE__TUNE_BLOCK;
        else i = p->n;
        pthread_mutex_unlock(&p->mu);
        if (i >= p->n) break;
        if (w->caller && avgpipe__now() - said >= AVGPIPE__TUNE_PROGRESS_S) { /* a long search says how far it is */
            said = avgpipe__now();
            avgpipe__log(w->caller, AVGPIPE_LOG_INFO, "avgpipe_tune_search: %d of %d candidates taken in %.0f s (%.0f%%)", i, p->n, said - t0,
                         100.0 * i / p->n);
        }
        end = i + AVGPIPE__TUNE_BLOCK < p->n ? i + AVGPIPE__TUNE_BLOCK : p->n;
        for (j = i; j < end; j++) {
            int *sl = p->slots ? p->slots + (size_t)j * G : NULL;
            if ((res = avgpipe__tune_eval(&w->ctx, p->m, p->td, &p->list[j], act, pcount, mem, p->known ? sl : NULL, p->known ? NULL : sl, &memo)) !=
                AVGPIPE_OK)
                break;
        }
        if (res) {
            pthread_mutex_lock(&p->mu);
            if (j < p->failed) p->failed = j, p->res = res, memcpy(p->error, w->ctx.error, sizeof p->error);
            pthread_mutex_unlock(&p->mu);
            break;
        }
    }
    avgpipe_free(&w->ctx, act);
    avgpipe_free(&w->ctx, mem);
    avgpipe__slot_memo_free(&w->ctx, &memo);
    return NULL;
}

/* The slot counts of a search's candidates, kept across the partitioner's searches: every split's
   search lists the same candidates (they follow from the description and the ranks, not from the
   costs), and a schedule's buffer plan counts its slots from the schedule alone; only the bytes of a
   slot change with the split. */
typedef struct avgpipe__slot_cache {
    int n, G;                /* candidates and partitions of the searches it holds; n = 0: empty */
    avgpipe_sched_desc *key; /* [n]: each candidate's schedule */
    int *slots;              /* [n][G] */
} avgpipe__slot_cache;

static void avgpipe__slot_cache_free(avgpipe_context *ctx, avgpipe__slot_cache *k) {
    avgpipe_free(ctx, k->key);
    avgpipe_free(ctx, k->slots);
    memset(k, 0, sizeof *k);
}

/* Predict list[0, n) on td->threads threads (the caller's among them), with the slot counts in cache
   (NULL: none) when it holds these candidates, or into it. */
static avgpipe_result avgpipe__tune_eval_all(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *td,
                                             avgpipe_tune_candidate *list, int n, avgpipe__slot_cache *cache) {
    avgpipe__tune_pool p;
    avgpipe__tune_worker *w;
    pthread_t *tid;
    int T = td->threads, k, started = 1;
    if (n == 0) return AVGPIPE_OK;
    if (T > (n + AVGPIPE__TUNE_BLOCK - 1) / AVGPIPE__TUNE_BLOCK) T = (n + AVGPIPE__TUNE_BLOCK - 1) / AVGPIPE__TUNE_BLOCK;
    memset(&p, 0, sizeof p);
    p.m = m, p.td = td, p.list = list, p.n = n, p.failed = n;
    if (cache) {
        int i, G = m->nstages;
        p.known = cache->n == n && cache->G == G;
        for (i = 0; p.known && i < n; i++) p.known = memcmp(&cache->key[i], &list[i].sched, sizeof list[i].sched) == 0;
        if (!p.known) { /* this search fills it */
            avgpipe__slot_cache_free(ctx, cache);
            cache->key = (avgpipe_sched_desc *)avgpipe_alloc(ctx, (size_t)n * sizeof *cache->key);
            cache->slots = (int *)avgpipe_alloc(ctx, (size_t)n * (size_t)G * sizeof(int));
            if (!cache->key || !cache->slots) {
                avgpipe__slot_cache_free(ctx, cache);
                return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_search: out of memory");
            }
            for (i = 0; i < n; i++) cache->key[i] = list[i].sched;
            cache->G = G;
        }
        p.slots = cache->slots;
    }
    w = (avgpipe__tune_worker *)avgpipe_alloc(ctx, (size_t)T * sizeof *w);
    tid = (pthread_t *)avgpipe_alloc(ctx, (size_t)T * sizeof *tid);
    if (!w || !tid || pthread_mutex_init(&p.mu, NULL) != 0) {
        avgpipe_free(ctx, w);
        avgpipe_free(ctx, tid);
        return avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_search: out of memory");
    }
    for (k = 0; k < T; k++) {
        w[k].pool = &p;
        w[k].caller = k == 0 ? ctx : NULL;
        w[k].ctx = *avgpipe__ctx(ctx);
        w[k].ctx.desc.log = NULL;
        w[k].ctx.error[0] = 0;
        w[k].ctx.last_result = AVGPIPE_OK;
    }
    for (k = 1; k < T && pthread_create(&tid[k], NULL, avgpipe__tune_work, &w[k]) == 0; k++) started++; /* fewer: the rest share the work */
    avgpipe__tune_work(&w[0]);
    for (k = 1; k < started; k++) pthread_join(tid[k], NULL);
    pthread_mutex_destroy(&p.mu);
    avgpipe_free(ctx, w);
    avgpipe_free(ctx, tid);
    if (cache) cache->n = p.failed < n ? 0 : n; /* filled only by a search that predicted every candidate */
    return p.failed < n ? avgpipe__fail(ctx, p.res, "%s", p.error) : AVGPIPE_OK;
}

static avgpipe_result avgpipe__tune_search_in(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *desc,
                                             avgpipe__slot_cache *cache, avgpipe_tune_candidate **out, int *count);

AVGPIPE_API avgpipe_result avgpipe_tune_search(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *desc,
                                               avgpipe_tune_candidate **out, int *count) {
    return avgpipe__tune_search_in(ctx, m, desc, NULL, out, count);
}

/* avgpipe_tune_search, with the slot counts of the candidates kept in cache (NULL: none). */
static avgpipe_result avgpipe__tune_search_in(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *desc,
                                             avgpipe__slot_cache *cache, avgpipe_tune_candidate **out, int *count) {
    avgpipe_tune_desc td;
    avgpipe_tune_candidate *list = NULL;
    int n = 0, cap = 0, kind, N, M, cont, K, S, V, *warm = NULL;
    unsigned kinds = 0;
    avgpipe_result res = AVGPIPE_OK;
    if (!m || !desc || !out || !count) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_search: NULL argument");
    *out = NULL;
    *count = 0;
    td = *desc;
    if (td.batch < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "batch: must be >= 1 (got %d)", td.batch);
    if (td.max_pipes < 0 || td.rounds < 0 || td.max_advance < 0 || td.min_micro < 0 || td.mem_limit < 0 || td.opt_bytes_per_param < 0 ||
        td.chunks < 0)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG,
                             "max_pipes, rounds, max_advance, min_micro, mem_limit, opt_bytes_per_param, chunks: must be >= 0");
    if (td.threads < 0 || td.threads > AVGPIPE_TUNE_MAX_THREADS)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "threads: %d (0 .. %d)", td.threads, AVGPIPE_TUNE_MAX_THREADS);
    if ((res = avgpipe__tune_objective_check(ctx, &td)) != AVGPIPE_OK) return res;
    td = avgpipe_tune_query_defaults(&td);
    td.kinds = desc->kinds; /* checked below against V, naming a kind asked for that cannot hold it */
    V = td.chunks;
    if (m->nstages % V)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "chunks: the model's %d partitions are not a multiple of %d chunks", m->nstages, V);
    if ((res = avgpipe__model_check(ctx, m)) != AVGPIPE_OK) return res;
    if ((res = avgpipe__tune_kinds(ctx, &td, V, &kinds)) != AVGPIPE_OK) return res;
    S = m->nstages / V;
    warm = (int *)avgpipe__calloc(ctx, (size_t)S, sizeof(int));
    if (!warm) res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_search: out of memory");
    /* the candidates, in the search's order; predicted after (avgpipe__tune_eval_all) */
    for (kind = AVGPIPE_SCHED_CUSTOM + 1; kind < AVGPIPE_SCHED_KIND_COUNT && !res; kind++) {
        const avgpipe_sched_kind_info *info = &avgpipe__kinds[kind];
        if (!(kinds & (1u << kind))) continue;
        for (N = 1; N <= td.max_pipes && !res; N++)
            for (M = 1; M <= td.batch && !res; M++) {
                if (td.batch % M || td.batch / M < td.min_micro || (V > 1 && info->micro_multiple && M % S)) continue;
                if ((long long)N * M < (long long)info->micro_pipes_per_stage * S) continue; /* the kind's own limit */
                for (cont = 0; cont <= (td.no_continuous ? 0 : 1) && !res; cont++) {
                    long long kfull = ((long long)N * M - 1) * (S > 1 ? S - 1 : 1); /* in long long: N, M, S are the caller's */
                    int kmax = kind != AVGPIPE_SCHED_ADVANCE ? 0 : td.max_advance ? td.max_advance : kfull < INT_MAX ? (int)kfull : INT_MAX - 1;
                    int r, same;
                    for (K = kind == AVGPIPE_SCHED_ADVANCE ? 1 : 0; K <= kmax && !res; K++) {
                        avgpipe_tune_candidate c;
                        memset(&c, 0, sizeof c);
                        c.sched.kind = (avgpipe_sched_kind)kind;
                        c.sched.stages = S;
                        c.sched.chunks = V > 1 || info->chunks == 0 ? V : 0; /* V = 1 on a one-chunk kind: 0, the default */
                        c.sched.micro = M;
                        c.sched.pipes = N;
                        c.sched.rounds = td.rounds;
                        c.sched.continuous = cont;
                        c.sched.advance = K;
                        c.samples = (double)td.batch / M;
                        if (kind == AVGPIPE_SCHED_ADVANCE) { /* a K that changes no rank's warm-up changes nothing */
                            for (r = 0, same = K > 1; r < S; r++) {
                                int w = avgpipe_sched_warmup(&c.sched, r);
                                same &= w == warm[r];
                                warm[r] = w;
                            }
                            if (same) continue;
                        }
                        if (n == cap) {
                            int nc = cap ? 2 * cap : 64;
                            avgpipe_tune_candidate *q = (avgpipe_tune_candidate *)avgpipe__realloc(ctx, list, (size_t)cap * sizeof *q, (size_t)nc * sizeof *q);
                            if (!q) {
                                res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_search: out of memory");
                                break;
                            }
                            list = q;
                            cap = nc;
                        }
                        list[n++] = c;
                    }
                }
            }
    }
    avgpipe_free(ctx, warm);
    if (!res) res = avgpipe__tune_eval_all(ctx, m, &td, list, n, cache);
    if (res) {
        avgpipe_free(ctx, list);
        return res;
    }
    qsort(list, (size_t)n, sizeof *list, td.objective == AVGPIPE_TUNE_THROUGHPUT ? avgpipe__cmp_candidate : avgpipe__cmp_candidate_ttt);
    *out = list;
    *count = n;
    return AVGPIPE_OK;
}


/* ---- the stage partitioner ---- */

#define AVGPIPE__PLAN_MAX_SPLITS 100000 /* contiguous splits the partitioner enumerates (C(L-1, P-1)) */

AVGPIPE_API void avgpipe_tune_split_choice_free(avgpipe_context *ctx, avgpipe_tune_split_choice *p) {
    if (!p) return;
    avgpipe_free(ctx, p->split);
    memset(p, 0, sizeof *p);
}

/* The next split of L layers into P parts in lexicographic order of split[]; 0 after the last. */
static int avgpipe__next_split(int *split, int P, int L) {
    int i, j, used = 0;
    for (i = 0; i < P - 1; i++) used += split[i];
    for (i = P - 2; i >= 0; i--) {
        used -= split[i]; /* layers in parts 0 .. i-1 */
        if (L - used - split[i] - 1 >= P - 1 - i) { /* part i can take one more, the rest keep one each */
            split[i]++;
            used += split[i];
            for (j = i + 1; j < P - 1; j++) split[j] = 1, used++;
            split[P - 1] = L - used;
            return 1;
        }
    }
    return 0;
}

/* Lower bound on the predicted time per sample of every setting of split model sm on S ranks with up to
   max_pipes pipelines: at M = 1 (each term of a prediction grows with M) the busiest rank's work for one
   batch (F, B and STEP, from avgpipe__op_time at the least util any N <= max_pipes gives), and with cores
   set all ranks' work plus the averaging over the cores (avgpipe__cores). A hair under, so that rounding never lets it
   pass an equal prediction. */
static double avgpipe__split_bound(const avgpipe_cost_model *sm, int S, double B, int max_pipes, avgpipe_placement place) {
    int r, g;
    double worst = 0, total = 0, w, bound, util = avgpipe__util(sm, max_pipes); /* util falls as N grows */
    for (r = 0; r < S; r++) {
        for (g = 0, w = 0; g < sm->nstages; g++)
            if (avgpipe_place_rank(place, S, g) == r) /* the stages rank r holds (loop or V) */
                w += avgpipe__op_time(sm, g, AVGPIPE_OP_F, B, util) + avgpipe__op_time(sm, g, AVGPIPE_OP_B, B, util) +
                     avgpipe__op_time(sm, g, AVGPIPE_OP_STEP, 0, util);
        total += w;
        if (w > worst) worst = w;
    }
    for (g = 0; g < sm->nstages; g++) total += avgpipe__avg_cost(sm, g);
    bound = sm->cores > 0 ? total / avgpipe__cores(sm, S) : 0; /* all the work over the cores the ranks get */
    if (bound < worst) bound = worst;
    return bound / B * (1 - 1e-9);
}

typedef struct avgpipe__plan_item {
    double bound;
    long long index; /* position in layer (lexicographic) order */
} avgpipe__plan_item;

static int avgpipe__cmp_split_item(const void *x, const void *y) {
    const avgpipe__plan_item *a = (const avgpipe__plan_item *)x, *b = (const avgpipe__plan_item *)y;
    if (a->bound != b->bound) return a->bound < b->bound ? -1 : 1;
    return (a->index > b->index) - (a->index < b->index);
}

/* Every split (in layer order, into splits[count * P]) with its bound. */
static avgpipe_result avgpipe__split_enumerate(avgpipe_context *ctx, const avgpipe_cost_model *m, int S, int P, double B, int max_pipes,
                                              unsigned kinds, int *splits, avgpipe__plan_item *items, long long count) {
    avgpipe_cost_model sm;
    avgpipe_result res = AVGPIPE_OK;
    long long k;
    int g, *cur = splits;
    for (g = 0; g < P; g++) cur[g] = g + 1 < P ? 1 : m->nlayers - (P - 1);
    for (k = 0; k < count && !res; k++) {
        int *sp = splits + k * P;
        if (k > 0) {
            memcpy(sp, sp - P, (size_t)P * sizeof *sp);
            avgpipe__next_split(sp, P, m->nlayers);
        }
        res = avgpipe_tune_split_model(ctx, m, sp, P, &sm);
        if (res) break;
        { /* the least bound over the placements of the kinds searched */
            double lo = -1, b;
            int kind;
            for (kind = AVGPIPE_SCHED_CUSTOM + 1; kind < AVGPIPE_SCHED_KIND_COUNT; kind++)
                if ((kinds & (1u << kind)) && ((b = avgpipe__split_bound(&sm, S, B, max_pipes, avgpipe__kinds[kind].placement)) < lo || lo < 0))
                    lo = b;
            items[k].bound = lo;
        }
        items[k].index = k;
        avgpipe_tune_cost_model_free(ctx, &sm);
    }
    return res;
}

/* Search one split; *best gets its fastest kept fitting candidate (*found = 1), or when none fits its
   kept candidate with the least memory (*found = 0, *any = 1 if there was one). */
static avgpipe_result avgpipe__split_search(avgpipe_context *ctx, const avgpipe_cost_model *m, const int *split, const avgpipe_tune_desc *td,
                                           const avgpipe_tune_split_desc *pd, avgpipe__slot_cache *cache, avgpipe_tune_candidate *best,
                                           int *found, int *any) {
    avgpipe_cost_model sm;
    avgpipe_tune_candidate *c = NULL;
    int n = 0, i;
    avgpipe_result res = avgpipe_tune_split_model(ctx, m, split, pd->stages * avgpipe_tune_split_query_defaults(pd).chunks, &sm);
    *found = *any = 0;
    if (res) return res;
    res = avgpipe__tune_search_in(ctx, &sm, td, cache, &c, &n);
    for (i = 0; !res && i < n; i++) {
        if (pd->keep && !pd->keep(&c[i], pd->keep_user)) continue;
        if (c[i].fits) {
            *best = c[i], *found = 1;
            break;
        }
        if (!*any || c[i].peak_bytes < best->peak_bytes) *best = c[i], *any = 1;
    }
    avgpipe_free(ctx, c);
    avgpipe_tune_cost_model_free(ctx, &sm);
    return res;
}

/* C(n, k) as a double (splits of L layers into P parts: C(L-1, P-1)). */
static double avgpipe__choose(int n, int k) {
    double c = 1;
    int i;
    for (i = 1; i <= k; i++) c = c * (n - k + i) / i;
    return c;
}

/* Check the arguments; *P partitions, *count splits. */
static avgpipe_result avgpipe__split_check(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *desc,
                                          const avgpipe_tune_split_desc *pd, int *P, long long *count) {
    avgpipe_result res;
    double c;
    if (!m || !desc || !pd) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_choose_split: NULL argument");
    if (m->nlayers < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_choose_split: the model has no layer costs ('layer' lines)");
    if (pd->stages < 1 || pd->chunks < 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "stages, chunks: stages >= 1, chunks >= 0");
    if (desc->batch < 1) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "batch: must be >= 1 (got %d)", desc->batch);
    if (desc->max_pipes < 0) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "max_pipes: must be >= 0 (got %d)", desc->max_pipes);
    if ((res = avgpipe__tune_objective_check(ctx, desc)) != AVGPIPE_OK) return res;
    *P = pd->stages * avgpipe_tune_split_query_defaults(pd).chunks;
    if (*P > m->nlayers)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "stages: %d partitions (stages x chunks) for a model of %d layers", *P, m->nlayers);
    c = avgpipe__choose(m->nlayers - 1, *P - 1);
    if (c > AVGPIPE__PLAN_MAX_SPLITS)
        return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "stages: %.0f ways to split %d layers into %d partitions (at most %d are tried)", c,
                             m->nlayers, *P, AVGPIPE__PLAN_MAX_SPLITS);
    *count = (long long)(c + 0.5);
    return AVGPIPE_OK;
}

/* The chosen split into out, with its slowest share and the bound it sets. */
static avgpipe_result avgpipe__split_finish(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *desc,
                                           const avgpipe_tune_split_desc *pd, const int *split, int P, avgpipe_tune_split_choice *out) {
    avgpipe_cost_model sm;
    avgpipe_result res = avgpipe_tune_split_model(ctx, m, split, P, &sm);
    if (res) return res;
    out->nparts = P;
    memcpy(out->split, split, (size_t)P * sizeof *split);
    out->slowest_share = avgpipe_tune_slowest_share(&sm, pd->stages, out->best.samples, desc->batch);
    out->bound = out->slowest_share > 0 ? 1 / out->slowest_share : 0;
    if (m->cores > 0) {
        double cores = avgpipe__cores(m, pd->stages);
        if (out->bound > cores) out->bound = cores;
    }
    avgpipe_tune_cost_model_free(ctx, &sm);
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_tune_choose_split(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *desc,
                                             const avgpipe_tune_split_desc *pd, avgpipe_tune_split_choice *out) {
    avgpipe_tune_desc td;
    avgpipe__plan_item *items = NULL;
    int *splits = NULL, P = 0, found, any, have_any = 0;
    long long count = 0, k, best = -1;
    avgpipe_result res;
    avgpipe_tune_candidate c, fallback;
    long long fallback_index = -1;
    unsigned kinds = 0;
    avgpipe__slot_cache cache; /* every split's search lists the same schedules: planned once */
    memset(&cache, 0, sizeof cache);
    if (!out) return avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_choose_split: NULL argument");
    memset(out, 0, sizeof *out);
    if ((res = avgpipe__split_check(ctx, m, desc, pd, &P, &count)) != AVGPIPE_OK) return res;
    td = avgpipe_tune_query_defaults(desc);
    td.chunks = avgpipe_tune_split_query_defaults(pd).chunks;
    td.kinds = desc->kinds; /* resolved against the split's chunks (avgpipe__tune_kinds) */
    splits = (int *)avgpipe_alloc(ctx, (size_t)count * (size_t)P * sizeof *splits);
    items = (avgpipe__plan_item *)avgpipe_alloc(ctx, (size_t)count * sizeof *items);
    out->split = (int *)avgpipe_alloc(ctx, (size_t)P * sizeof *out->split);
    if (!splits || !items || !out->split) res = avgpipe__fail(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_tune_choose_split: out of memory");
    if (!res) res = avgpipe__tune_kinds(ctx, &td, td.chunks, &kinds);
    if (!res)
        res = avgpipe__split_enumerate(ctx, m, pd->stages, P, (double)desc->batch, td.max_pipes, kinds, splits,
                                      items, count);
    if (!res) qsort(items, (size_t)count, sizeof *items, avgpipe__cmp_split_item);
    for (k = 0; !res && k < count; k++) {
        /* bounded out: no setting of this split (nor of any later one) can beat the best found; the least
           efficiency any candidate has is that of one pipeline (avgpipe_tune_efficiency grows with N) */
        double lo = items[k].bound;
        if (td.objective != AVGPIPE_TUNE_THROUGHPUT) lo *= avgpipe_tune_efficiency(td.noise_scale, td.batch) * td.target_samples;
        if (best >= 0 && lo > avgpipe__tune_key(&td, &out->best)) break;
        res = avgpipe__split_search(ctx, m, splits + items[k].index * P, &td, pd, &cache, &c, &found, &any);
        out->searched++;
        if (!res && found &&
            (best < 0 || avgpipe__tune_key(&td, &c) < avgpipe__tune_key(&td, &out->best) ||
             (avgpipe__tune_key(&td, &c) == avgpipe__tune_key(&td, &out->best) && items[k].index < best)))
            out->best = c, best = items[k].index;
        if (!res && !found && any && (!have_any || c.peak_bytes < fallback.peak_bytes)) fallback = c, fallback_index = items[k].index, have_any = 1;
    }
    if (!res && best < 0 && !have_any)
        res = avgpipe__fail(ctx, AVGPIPE_INVALID_ARG, "avgpipe_tune_choose_split: no candidate to choose from (the search found none, or keep refused all)");
    if (!res) {
        out->found = best >= 0;
        if (!out->found) out->best = fallback, best = fallback_index;
        res = avgpipe__split_finish(ctx, m, desc, pd, splits + best * P, P, out);
    }
    out->splits = count;
    avgpipe__slot_cache_free(ctx, &cache);
    avgpipe_free(ctx, splits);
    avgpipe_free(ctx, items);
    if (res) avgpipe_tune_split_choice_free(ctx, out);
    return res;
}

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
