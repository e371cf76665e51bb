/* avgpipe_cuda.h — the CUDA device backend for avgpipe.h: memory, copies, streams, events and the averaging
   kernels of one NVIDIA GPU, behind avgpipe.h's device table (section 11).

   WHAT IT IS
   ----------
   avgpipe_device_cuda_create fills an avgpipe_device over the CUDA runtime API for one CUDA device: give it
   to avgpipe_ea (the averaging of the N parallel models) and to avgpipe_run (the runtime's boundary
   buffers, one stream per pipeline, events between compute, averaging and comm). The averaging pass, the
   non-finite scan and the scale are CUDA kernels whose results equal the CPU device's bit for bit (see
   BITWISE); the non-finite flag (flag_nonfinite, with the pass's skip word) lets the averaging check its
   inputs without a host wait. Written against CUDA 13.0; kernels built by NVRTC need CUDA >= 12.8 (they are loaded and launched
   through the runtime's library API: cudaLibraryLoadData, cudaLibraryGetKernel, cudaLaunchKernel).

   USE FROM A .cu FILE (nvcc compiles the kernels into the program)
   ----------------------------------------------------------------
       #define AVGPIPE_IMPLEMENTATION          // in one .cu file: avgpipe.h's and this header's implementations
       #include "avgpipe.h"
       #include "avgpipe_cuda.h"               // after avgpipe.h

       avgpipe_device gpu;
       avgpipe_device_cuda_desc cd = {0};      // device 0, grids from occupancy, events without timing
       cd.device = 1;                          // or the ordinal you want
       if (avgpipe_device_cuda_create(&ctx, &cd, &gpu) != AVGPIPE_OK) {
           fprintf(stderr, "%s\n", avgpipe_last_error(&ctx));   // e.g. "... cudaGetDeviceCount: no CUDA-capable device is detected"
           return 1;
       }
       ea_desc.device = &gpu;                  // averaging on the GPU; run_desc.device = &gpu for the runtime
       ...
       avgpipe_device_destroy(&gpu);           // after everything that uses it

       nvcc -O2 -arch=sm_90 trainer.cu -o trainer   // nvcc links the CUDA runtime itself; -arch: your GPU's
                                                    // (without it CUDA 13 builds sm_75, JIT-compiled at start)

   USE FROM PLAIN C (gcc or clang, no nvcc): the kernels are built at run time with NVRTC
   -----------------------------------------------------------------------------------------
   The same code in a .c file. Without nvcc (no __CUDACC__) the implementation keeps the kernels' CUDA source
   as a string, compiles it with NVRTC when the device is created (for the device's own architecture; about
   0.1 to 1 s, once per created device) and loads it with the runtime's library API. Link the CUDA runtime
   and NVRTC, nothing else (not libcuda: the driver is found at run time by the runtime, so the program
   also starts, and fails cleanly, on a machine without a GPU):

       cc -std=c11 -O2 -I/usr/local/cuda/include trainer.c -L/usr/local/cuda/lib64 -lcudart -lnvrtc -lm -pthread

   (use -isystem instead of -I with -Wpedantic: CUDA's own headers are not pedantic C). Alternatively compile
   only this header's implementation in a .cu file (#define AVGPIPE_CUDA_IMPLEMENTATION, include avgpipe.h
   and avgpipe_cuda.h) with nvcc and link it with your C objects: the API is extern "C".

   THE ENTRIES
   -----------
     name               "cuda:N" (N the ordinal).
     alloc / free       cudaMalloc / cudaFree: 256-byte aligned (>= the 64 the table promises); 0 bytes gives a
                        real (1-byte) allocation. cudaFree synchronises the device: allocate up front, not per
                        iteration. alloc_overhead is an estimate (AVGPIPE_DEVICE_CUDA_ALLOC_OVERHEAD): the
                        driver rounds every request up to its allocation granularity.
     copy               cudaMemcpyAsync on the stream, kind mapped (H2D, D2H, D2D). Host memory may be
                        pageable or pinned. Pageable host memory makes the copy synchronous for the host: H2D
                        returns once the source was staged (you may reuse it at once), D2H once the data has
                        arrived. Pinned memory (cudaHostAlloc) gives a truly asynchronous copy: keep the host
                        buffer untouched until the stream has passed the copy.
     memset             cudaMemsetAsync.
     stream_*           cudaStreamCreateWithFlags(cudaStreamNonBlocking) / cudaStreamDestroy /
                        stream_synchronize polls cudaStreamQuery (see WAITS). A stream handle IS the
                        cudaStream_t: AVGPIPE_CUDA_STREAM(s) casts
                        it for your own kernels, and any cudaStream_t of this device cast to
                        avgpipe_device_stream may be passed in. The NULL stream is CUDA's default (legacy)
                        stream, which non-blocking streams do not synchronise with: order them with events.
                        More live streams than the GPU's hardware queues warn once (see HARDWARE QUEUES).
     event_*            cudaEventCreateWithFlags / cudaEventDestroy / cudaEventRecord / cudaStreamWaitEvent /
                        event_synchronize polls cudaEventQuery (see WAITS). Events are made with
                        cudaEventDisableTiming (the fast path of records, waits and queries: they order work),
                        unless desc.timed_events; with cudaEventBlockingSync too with desc.blocking_sync. An
                        event handle IS the cudaEvent_t (AVGPIPE_CUDA_EVENT).
     event_query        cudaEventQuery: cudaErrorNotReady gives *done = 0 (not an error); never blocks.
     event_elapsed      cudaEventElapsedTime, in seconds (resolution about 0.5 us), of the events' records made
                        through this table; NULL with desc.no_timing. See TIMING: by default an event is timed
                        from its first record after event_elapsed first asked for a time.
     synchronize        every stream this table created (and not yet destroyed) and CUDA's default stream,
                        each polled (see WAITS). Not streams you created yourself: cudaDeviceSynchronize would
                        wait for those too, but it cannot be given a time limit, and a stream of another
                        library (NCCL's, waiting for a peer that is gone) could hold it forever.
     ea_pass            one fused averaging pass (avgpipe.h's avgpipe_ea_pass) as a kernel on the stream:
                        grid-stride over a grid of as many blocks as the GPU holds at once (see GRIDS),
                        16-byte (float4) loads and stores when the buffers' addresses allow (all
                        read or written buffers equally aligned modulo 16 bytes: a scalar head of up to 3
                        elements, the float4 body, a scalar tail), scalar otherwise. Reads only what the pass
                        needs (acc not on a first pass, z only when pulled or finalizing ELASTIC, z_prev only
                        with momentum), writes w only when pulled. Asynchronous. Honours
                        avgpipe_ea_pass.skip: when it is not NULL, every thread first reads *skip (on the
                        device, when the kernel starts, so after the stream's earlier work, e.g. the
                        flag_nonfinite that wrote it) and, nonzero, returns without touching w or acc.
     find_nonfinite     a kernel testing exponent bits (float4 loads) into a per-call 8-byte result slot by an
                        atomic minimum, copied back and waited for (polled, see WAITS): synchronous, gives the
                        LOWEST index. Up to AVGPIPE__CUDA_SLOTS (64) calls run at once from different threads;
                        more wait for a slot (at most desc.timeout_s).
     scale              x[i] = x[i] * factor in fp32, a kernel like ea_pass.
     flag_nonfinite     the non-finite check without a host wait (avgpipe_device.flag_nonfinite): a kernel
                        enqueued on the stream like find_nonfinite's scan (float4 loads, exponent bits, its own
                        grid: AVGPIPE_DEVICE_CUDA_KERNEL_FLAG), and nothing else: no copy back, no wait, no
                        result slot. If some x[i] is NaN or +-Inf, a thread that found one does
                        atomicCAS(&flag[0], 0, bits): the single winner (flag[0] was 0 before any bit was
                        set) writes flag[1] = tag, every other finder atomicOr(&flag[0], bits). So the tag
                        is that of the first flagging call, provided the calls on one flag are totally
                        ordered on the device (the averaging module makes them on one stream chain: calls
                        on unordered streams could race for the tag). flag: two uint32 of device memory.
                        Returns after the launch; a failed launch is reported as by the other entries.
     error_string       the calling thread's text of its last failed entry on a CUDA device ("" if none).
     destroy            frees the device's own buffers, the kernels' module and the events' timed twins (see
                        TIMING); does not reset the device.
   Every entry but error_string first makes the device current on the calling thread (cudaSetDevice) and
   leaves it current.

   GRIDS
   -----
   Each kernel's grid is what the GPU runs at once: multiprocessors x the blocks of desc.block_size threads
   one multiprocessor holds of that kernel (cudaOccupancyMaxActiveBlocksPerMultiprocessor, for the kernel
   as it was built: by nvcc, or by NVRTC as a cudaKernel_t; asked once, at creation). Every block of the
   grid-stride loops is resident from the start: no tail of blocks that runs after the first wave at a
   fraction of the occupancy. (An H200 has 132 multiprocessors; the averaging kernel as nvcc builds it for
   sm_90 takes 38 registers a thread, so 6 blocks of 256 threads fit one, not the 8 its 2048 thread slots
   would hold: a grid of 792, where 132 x 8 = 1056 left 264 blocks to a second wave at a third of the
   occupancy.)
   desc.max_blocks overrides it (more blocks than fit at once make such a tail). avgpipe_device_cuda_query
   gives each kernel's occupancy and grid. The grid never changes a result: each element is computed by
   one thread from its own inputs alone, find_nonfinite's answer is the minimum over every thread's
   (see BITWISE), and flag_nonfinite's flag does not depend on which threads found a bad value.

   TIMING
   ------
   Ordering events (every event the runtime and the averaging module create) need no timestamps, and
   events made without (cudaEventDisableTiming) are the cheap path of records, waits and queries; only
   event_elapsed needs timestamps, and cudaEventElapsedTime refuses an event made without them. So by
   default (desc.timed_events 0, desc.no_timing 0) events carry no timing, and event_elapsed(start, end)
   times them by a timed twin of each: a second event that event_record records with it (just before it,
   on the same stream: the twin has completed whenever the event has; work another thread enqueues on
   that stream between the two records would count in the time), while waits and queries keep using the
   untimed event. Twins are made
     - for start and end, by the first event_elapsed that names them: that call has nothing to time and
       fails (AVGPIPE_BACKEND_ERROR, "... had no timing yet ..."); their later records are timed;
     - for every event recorded while an anchor lives, at that record: an anchor is an event that
       event_elapsed has named as its start, until it is destroyed (a profiled run's per-iteration origin).
   So nothing is timed, and every record is one cudaEventRecord, until something asks for a time; a
   profiled avgpipe.h run (whose profile falls back to the host's clock for a record event_elapsed cannot
   time) is host-timed in its first iteration and device-timed from its second on (the tuner's profiles
   follow a warm-up iteration; avgpipe_run_write_profile writes the last), recording each of its events
   twice meanwhile; once that run is destroyed (its anchors with it), a run that does not profile records
   once again. Records made directly with cudaEventRecord on AVGPIPE_CUDA_EVENT(e) do not move the twin.
   desc.timed_events = 1 makes every event with timing instead (event_elapsed from the first record; the
   slower path for every record, wait and query); desc.no_timing = 1 none (event_elapsed NULL: profiles
   use the host's clock).

   HARDWARE QUEUES
   ---------------
   CUDA maps a process's streams on a GPU onto CUDA_DEVICE_MAX_CONNECTIONS hardware work queues (8 unless
   the environment sets it, at most 32). Streams beyond that share queues, and work on one may wait behind
   unrelated work on another: N pipelines of S stages in one process make S x (N + 1) streams (4 stages x
   N = 4: 20), which 8 queues falsely serialise. The table counts the streams it created and has not
   destroyed; when the count first passes the limit (as read from the environment at creation:
   avgpipe_device_cuda_info.max_connections) it warns once through the creating context's logger
   (AVGPIPE_LOG_WARN), naming the count, the limit and the variable to set. CUDA reads the variable when
   it creates the GPU's context, before this header could see that it was needed, and the program may
   have initialised CUDA already (its own CUDA calls, cuBLAS, NCCL), so the table does not set it itself
   (nor would changing the environment of a running, threaded process be safe): set
   CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment, or setenv() first thing in main(), before any CUDA
   call (examples/cuda_mlp.cu does).

   WAITS
   -----
   No entry waits for the GPU without a time limit. stream_synchronize, event_synchronize, synchronize and
   find_nonfinite poll cudaStreamQuery / cudaEventQuery: spinning for the first 20 us (not with
   desc.blocking_sync), then sleeping with a back-off up to 1 ms between polls (a wait adds at most that to
   the GPU's time), and give up after desc.timeout_s (default 300 s) with AVGPIPE_TIMEOUT and the text "cuda:0
   stream_synchronize: the GPU did not finish within 300 s ...": work that never ends (a kernel that spins,
   a stream waiting for a transfer whose peer is gone) fails the caller instead of hanging it. The work
   itself stays queued: CUDA cannot withdraw it.

   BITWISE
   -------
   The kernels compute each element with exactly the fp32 operations avgpipe_ea_pass documents, in the same
   order, so a GPU reference model equals the CPU device's bit for bit (NaN results are NaN on both, but the
   GPU gives the canonical NaN where the CPU may keep a payload or sign). Every add, subtract and multiply
   is written as inline PTX with an explicit rounding mode (add.rn.f32, sub.rn.f32, mul.rn.f32, no .ftz):
   PTX never contracts such instructions into a fused multiply-add, and without .ftz denormals are kept, so
   this holds whatever the user's nvcc flags (-fmad=true, the default; --use_fast_math; -ftz=true); NVRTC
   builds also pass --fmad=false --ftz=false. One source text of the element function (a macro) is compiled
   three ways: by nvcc, by NVRTC (as a string) and for the host (avgpipe_device_cuda_ea_pass_host, which
   tests compare with the CPU device on edge values: NaN, +-Inf, denormals, -0, alpha 0 and 1, momentum).

   THREAD-SAFETY
   -------------
   The table may be used from any number of threads at once (CUDA's runtime is thread-safe and every entry
   selects its device): different threads may use different streams, or one stream, whose work then runs in
   the order of the calls. Entries on the same buffers from different threads need ordering by the caller
   (the averaging module does its own). error_string is per thread. avgpipe_device_destroy: nothing may use
   the device during or after it. Create devices after fork(), not before (CUDA does not survive a fork).

   ERRORS
   ------
   cudaErrorMemoryAllocation -> AVGPIPE_OUT_OF_MEMORY, a wait past desc.timeout_s -> AVGPIPE_TIMEOUT, every
   other CUDA (and NVRTC) error -> AVGPIPE_BACKEND_ERROR. The text names the device, the entry and the CUDA call, with cudaGetErrorString and
   cudaGetErrorName: "cuda:0 ea_pass: cudaLaunchKernel: an illegal memory access was encountered
   (cudaErrorIllegalAddress)". Creation puts it in the context (avgpipe_last_error); the entries, which have
   no context, in error_string. After a sticky error (a kernel fault) CUDA refuses every later call in the
   process: every entry then fails.

   LIMITS
   ------
   - One device per table; a process may create several (one per GPU, or several on one GPU: each counts
     only its own streams against the hardware queues).
   - ea_pass, find_nonfinite, flag_nonfinite and scale take up to 2^64 - 1 floats; grids are at most desc.max_blocks blocks.
   - NVRTC builds machine code for the device's architecture when NVRTC knows it, else PTX for the newest
     architecture NVRTC knows below it (compiled by the driver at load; needs a driver at least as new as
     NVRTC). A device older than NVRTC's oldest architecture is refused (AVGPIPE_BACKEND_ERROR).
   - Creating a device initialises CUDA's primary context on it (about 0.1 to 0.5 s) and allocates 512 bytes
     of device memory and 512 of pinned host memory for the non-finite scan. A desc.block_size no block of
     which fits a multiprocessor for some kernel (too many registers) is refused (AVGPIPE_BACKEND_ERROR).

   CONFIGURATION MACROS
   --------------------
     AVGPIPE_CUDA_IMPLEMENTATION  compile this header's implementation here (AVGPIPE_IMPLEMENTATION and
                                  AVGPIPE_IMPL turn it on too).
     AVGPIPE_CUDA_NVRTC           build the kernels with NVRTC at run time even in a .cu file compiled by
                                  nvcc (link -lnvrtc); the default, and the only way, without nvcc.
   License: MIT, as avgpipe.h. */
#ifndef AVGPIPE_CUDA_H
#define AVGPIPE_CUDA_H

#ifndef AVGPIPE_H
#error "avgpipe_cuda.h: include avgpipe.h first"
#endif
#if AVGPIPE_VERSION_NUMBER != 1003 /* released together: 0.10.3 */
#error "avgpipe_cuda.h is version 0.10.3: include the avgpipe.h of the same release"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Your own kernels: the stream and event handles the table gives out are the CUDA handles, cast. */
#define AVGPIPE_CUDA_STREAM(s) ((cudaStream_t)(s))
#define AVGPIPE_CUDA_EVENT(e) ((cudaEvent_t)(e))

/* Estimated bytes cudaMalloc takes beyond a request (its smallest allocation granularity). */
#define AVGPIPE_DEVICE_CUDA_ALLOC_OVERHEAD 512

/* CUDA device description. Zero-initialise; zero fields mean:
     device         0 -> CUDA device 0 (the ordinal as the CUDA runtime counts them: CUDA_VISIBLE_DEVICES
                    applies)
     block_size     0 -> 256 threads per block for the kernels (32..1024, a multiple of 32)
     max_blocks     0 -> each kernel's grid is as many of its blocks as the device holds at once:
                    multiprocessors x its occupancy (see GRIDS). > 0: every kernel's grid is at most this
                    (grid-stride loops)
     no_timing      0 -> event_elapsed works (see TIMING). 1: no event is ever timed; the table's
                    event_elapsed is then NULL
     blocking_sync  0 -> waits spin for 20 us before they sleep between polls. 1: they sleep from the first
                    poll (and events are made with cudaEventBlockingSync, for your own cudaEventSynchronize)
     timeout_s      0 -> 300: the longest any entry waits for the GPU (see WAITS) before AVGPIPE_TIMEOUT
     timed_events   0 -> events are made without timing (cudaEventDisableTiming); event_elapsed times
                    them by timed twins, from a record after it first asked for a time (see TIMING). 1: every event
                    is made with timing (event_elapsed works from its first record; records, waits and
                    queries take CUDA's slower path). Not together with no_timing */
typedef struct avgpipe_device_cuda_desc {
    int device;
    int block_size;
    int max_blocks;
    int no_timing;
    int blocking_sync;
    double timeout_s;
    int timed_events;
} avgpipe_device_cuda_desc;

/* The kernels, as avgpipe_device_cuda_info's per-kernel arrays index them. */
#define AVGPIPE_DEVICE_CUDA_KERNEL_EA 0        /* ea_pass */
#define AVGPIPE_DEVICE_CUDA_KERNEL_NONFINITE 1 /* find_nonfinite */
#define AVGPIPE_DEVICE_CUDA_KERNEL_SCALE 2     /* scale */
#define AVGPIPE_DEVICE_CUDA_KERNEL_FLAG 3      /* flag_nonfinite */
#define AVGPIPE_DEVICE_CUDA_KERNEL_COUNT 4

/* What a created CUDA device runs with (avgpipe_device_cuda_query). */
typedef struct avgpipe_device_cuda_info {
    avgpipe_device_cuda_desc desc; /* resolved: max_blocks is the largest of grid[] */
    int cc_major, cc_minor;        /* compute capability */
    int multiprocessors;
    int nvrtc;                     /* 1: kernels built at run time by NVRTC; 0: compiled by nvcc */
    char kernels[48];              /* how: "nvcc", "nvrtc sm_90", "nvrtc compute_90 (PTX)" */
    /* [AVGPIPE_DEVICE_CUDA_KERNEL_*]: blocks of desc.block_size threads of each kernel one multiprocessor
       holds at once (cudaOccupancyMaxActiveBlocksPerMultiprocessor), and each kernel's grid (see GRIDS) */
    int blocks_per_sm[AVGPIPE_DEVICE_CUDA_KERNEL_COUNT];
    int grid[AVGPIPE_DEVICE_CUDA_KERNEL_COUNT];
    int max_connections; /* hardware work queues: CUDA_DEVICE_MAX_CONNECTIONS at creation (8 unset, 1..32) */
} avgpipe_device_cuda_info;

/* The description with its defaults filled in, as far as they do not depend on the device: max_blocks
   stays 0 when it was (it is resolved by avgpipe_device_cuda_create; see avgpipe_device_cuda_query).
   desc may be NULL (all defaults). No validation. Thread-safe; touches no CUDA state. */
AVGPIPE_API avgpipe_device_cuda_desc avgpipe_device_cuda_query_defaults(const avgpipe_device_cuda_desc *desc);

/* Create the device table for CUDA device desc->device (desc may be NULL: device 0, defaults): checks the
   device exists, makes it current, builds or finds the kernels, allocates the non-finite scan's result
   slots, and fills every entry of *out (event_elapsed only with timing). The table's state comes from
   ctx's allocator. Release with avgpipe_device_destroy().
   Errors (then *out is zeroed and nothing is left allocated): AVGPIPE_INVALID_ARG naming the field (out
   NULL, device < 0, block_size not a multiple of 32 in 32..1024, max_blocks < 0, timeout_s negative or not
   a number), AVGPIPE_BACKEND_ERROR
   with CUDA's text (no driver: "CUDA driver version is insufficient for CUDA runtime version"; no device:
   "no CUDA-capable device is detected"; an ordinal past the last device; an NVRTC failure with its log),
   AVGPIPE_OUT_OF_MEMORY (host, device or pinned memory).
   Thread-safety: touches only ctx, *out and CUDA (the calling thread's current device becomes desc->device);
   reads CUDA_DEVICE_MAX_CONNECTIONS from the environment (getenv). */
AVGPIPE_API avgpipe_result avgpipe_device_cuda_create(avgpipe_context *ctx, const avgpipe_device_cuda_desc *desc,
                                                      avgpipe_device *out);

/* What a table made by avgpipe_device_cuda_create runs with: the resolved description, the compute
   capability, and how its kernels were built. Errors: AVGPIPE_INVALID_ARG (dev or out NULL, or dev is not
   a CUDA table made by this implementation). Thread-safe. */
AVGPIPE_API avgpipe_result avgpipe_device_cuda_query(avgpipe_context *ctx, const avgpipe_device *dev,
                                                     avgpipe_device_cuda_info *out);

/* The CUDA kernels' element function compiled for the host: apply one averaging pass to HOST memory,
   element by element, with exactly the fp32 operations (and the same source text) the GPU kernel runs. The
   reference that tests and checks compare the GPU and the CPU device against. p's pointers are host
   pointers; z and z_prev may be NULL where the pass does not read them (avgpipe_ea_pass); p->skip, when
   not NULL, is a host pointer here, and *skip nonzero leaves w and acc as they are (as the kernel does).
   Errors: AVGPIPE_INVALID_ARG (p NULL; w or acc NULL with count > 0; z or z_prev NULL where read; mode
   not MEAN or ELASTIC). Thread-safe (writes only ctx and the pass's buffers). */
AVGPIPE_API avgpipe_result avgpipe_device_cuda_ea_pass_host(avgpipe_context *ctx, const avgpipe_ea_pass *p);

#ifdef __cplusplus
}
#endif
#endif /* AVGPIPE_CUDA_H */

/* ============================================================================================ */
/* Implementation                                                                                */
/* ============================================================================================ */
#if (defined(AVGPIPE_CUDA_IMPLEMENTATION) || defined(AVGPIPE_IMPLEMENTATION) || defined(AVGPIPE_IMPL)) && \
    !defined(AVGPIPE_CUDA_IMPLEMENTATION_INCLUDED)
#define AVGPIPE_CUDA_IMPLEMENTATION_INCLUDED

#if !defined(__CUDACC__) && !defined(AVGPIPE_CUDA_NVRTC)
#define AVGPIPE_CUDA_NVRTC 1 /* no nvcc: the kernels can only come from NVRTC */
#endif

#include <cuda_runtime_api.h>
#ifdef AVGPIPE_CUDA_NVRTC
#include <nvrtc.h>
#if CUDART_VERSION < 12080
#error "avgpipe_cuda.h: kernels built by NVRTC are launched through the runtime's library API: CUDA >= 12.8 (or compile with nvcc)"
#endif
#endif
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__cplusplus)
#define AVGPIPE__CUDA_TLS thread_local
#elif defined(_MSC_VER)
#define AVGPIPE__CUDA_TLS __declspec(thread)
#else
#define AVGPIPE__CUDA_TLS _Thread_local
#endif

/* --- The device code, once ------------------------------------------------------------------------
   The helpers, the element function and the kernels are macros holding CUDA source text. A .cu file
   compiled by nvcc expands them into code; otherwise they are turned into a string (AVGPIPE__CUDA_STR) that
   NVRTC compiles at run time; and the element function is also expanded as host code (the host twin).
   Hence: no '#' directives and no line comments inside them, and a few placeholders that each use defines:
   AVGPIPE__CU_GLOBAL (a kernel), AVGPIPE__CU_DEVICE (a device function), AVGPIPE__CU_RESTRICT. They are
   defined only while the nvcc expansion below runs, so the string keeps them as words and NVRTC's prelude
   defines them. Identifiers inside the texts that are macros when the string is made (the flag names) are
   expanded into it, which is intended. */

/* Pass flags, the same values as avgpipe.h's CPU kernels use. */
#define AVGPIPE__CUDA_F_PULL 1u
#define AVGPIPE__CUDA_F_FIRST 2u
#define AVGPIPE__CUDA_F_LAST 4u
#define AVGPIPE__CUDA_F_ELASTIC 8u
#define AVGPIPE__CUDA_F_MOMENTUM 16u
#define AVGPIPE__CUDA_EXP_MASK 0x7f800000u /* all exponent bits set: NaN or +-Inf */

/* fp32 arithmetic as PTX with an explicit rounding mode: never fused, never flushed (see BITWISE). */
#define AVGPIPE__CUDA_HELPERS_TEXT                                                                          \
    typedef unsigned long long avgpipe__cu_u64;                                                             \
    AVGPIPE__CU_DEVICE float avgpipe__cu_add(float a, float b) {                                            \
        float r;                                                                                            \
        asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                                           \
        return r;                                                                                           \
    }                                                                                                       \
    AVGPIPE__CU_DEVICE float avgpipe__cu_sub(float a, float b) {                                            \
        float r;                                                                                            \
        asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                                           \
        return r;                                                                                           \
    }                                                                                                       \
    AVGPIPE__CU_DEVICE float avgpipe__cu_mul(float a, float b) {                                            \
        float r;                                                                                            \
        asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                                           \
        return r;                                                                                           \
    }                                                                                                       \
    AVGPIPE__CU_DEVICE int avgpipe__cu_bad(float x) {                                                       \
        return (__float_as_uint(x) & AVGPIPE__CUDA_EXP_MASK) == AVGPIPE__CUDA_EXP_MASK;                     \
    }                                                                                                       \
    AVGPIPE__CU_DEVICE avgpipe__cu_u64 avgpipe__cu_thread(void) {                                           \
        return (avgpipe__cu_u64)blockIdx.x * blockDim.x + threadIdx.x;                                      \
    }                                                                                                       \
    AVGPIPE__CU_DEVICE avgpipe__cu_u64 avgpipe__cu_threads(void) { return (avgpipe__cu_u64)gridDim.x * blockDim.x; } \
    AVGPIPE__CU_DEVICE void avgpipe__cu_min(avgpipe__cu_u64 *p, avgpipe__cu_u64 v) { atomicMin(p, v); }      \
    AVGPIPE__CU_DEVICE unsigned avgpipe__cu_cas(unsigned *p, unsigned cmp, unsigned v) { return atomicCAS(p, cmp, v); } \
    AVGPIPE__CU_DEVICE void avgpipe__cu_or(unsigned *p, unsigned v) { atomicOr(p, v); }

/* The element function of avgpipe_ea_pass (avgpipe.h, section 11), operation for operation as the CPU
   kernel avgpipe__ea_elem: w, z, zp, a are the element's inputs (z, zp, a only meaningful where f says they
   are read); *wo receives w's new value (unchanged without PULL), *ao acc's. */
#define AVGPIPE__CUDA_ELEM_TEXT(Q, NAME, ADD, SUB, MUL)                                                     \
    Q void NAME(float *wo, float *ao, float w, float z, float zp, float a, float alpha, float scale,         \
                float mu, unsigned f) {                                                                     \
        float c, v;                                                                                         \
        if (f & AVGPIPE__CUDA_F_ELASTIC) {                                                                  \
            c = (f & AVGPIPE__CUDA_F_PULL) ? MUL(alpha, SUB(w, z)) : 0.0f;                                  \
            *wo = (f & AVGPIPE__CUDA_F_PULL) ? SUB(w, c) : w;                                               \
            a = (f & AVGPIPE__CUDA_F_FIRST) ? c : ADD(a, c);                                                \
            if (f & AVGPIPE__CUDA_F_LAST)                                                                   \
                a = ADD(a, (f & AVGPIPE__CUDA_F_MOMENTUM) ? ADD(z, MUL(mu, SUB(z, zp))) : z);               \
        } else {                                                                                            \
            v = (f & AVGPIPE__CUDA_F_PULL) ? SUB(w, MUL(alpha, SUB(w, z))) : w;                             \
            *wo = v;                                                                                        \
            a = (f & AVGPIPE__CUDA_F_FIRST) ? v : ADD(a, v);                                                \
            if (f & AVGPIPE__CUDA_F_LAST) a = MUL(a, scale);                                                \
        }                                                                                                   \
        *ao = a;                                                                                            \
    }

/* Every kernel covers [0, head) and [head + 4 nvec, head + 4 nvec + tail) with scalar accesses and the
   nvec float4s in between with 16-byte ones (head makes the float4s aligned; the host plans it, see
   avgpipe__cuda_plan_make), each in a grid-stride loop. The averaging kernel first reads *skip (skip not
   NULL: avgpipe_ea_pass.skip, written earlier on the stream): nonzero, every thread returns at once, and
   w and acc are not touched (one launch is the whole pass, so that one read decides it). */
#define AVGPIPE__CUDA_EA_TEXT                                                                               \
    AVGPIPE__CU_GLOBAL void avgpipe__cu_ea(float *AVGPIPE__CU_RESTRICT w, const float *AVGPIPE__CU_RESTRICT z, \
                                           const float *AVGPIPE__CU_RESTRICT zp, float *AVGPIPE__CU_RESTRICT a, \
                                           avgpipe__cu_u64 head, avgpipe__cu_u64 nvec, avgpipe__cu_u64 tail,   \
                                           float alpha, float scale, float mu, unsigned f,                  \
                                           const unsigned *skip) {                                          \
        const avgpipe__cu_u64 t0 = avgpipe__cu_thread(), step = avgpipe__cu_threads();                      \
        const int rz = (f & AVGPIPE__CUDA_F_PULL) || ((f & AVGPIPE__CUDA_F_ELASTIC) && (f & AVGPIPE__CUDA_F_LAST)); \
        const int rp = (f & AVGPIPE__CUDA_F_MOMENTUM) != 0, ra = !(f & AVGPIPE__CUDA_F_FIRST);             \
        const int ww = (f & AVGPIPE__CUDA_F_PULL) != 0;                                                     \
        avgpipe__cu_u64 i, e;                                                                               \
        if (skip && *skip) return;                                                                          \
        for (i = t0; i < nvec; i += step) {                                                                 \
            float4 wv, zv, pv, av, wo, ao;                                                                  \
            e = head + 4 * i;                                                                               \
            wv = *(const float4 *)(w + e);                                                                  \
            zv = rz ? *(const float4 *)(z + e) : wv;                                                        \
            pv = rp ? *(const float4 *)(zp + e) : wv;                                                       \
            av = ra ? *(const float4 *)(a + e) : wv;                                                        \
            avgpipe__cu_ea_elem(&wo.x, &ao.x, wv.x, zv.x, pv.x, av.x, alpha, scale, mu, f);                 \
            avgpipe__cu_ea_elem(&wo.y, &ao.y, wv.y, zv.y, pv.y, av.y, alpha, scale, mu, f);                 \
            avgpipe__cu_ea_elem(&wo.z, &ao.z, wv.z, zv.z, pv.z, av.z, alpha, scale, mu, f);                 \
            avgpipe__cu_ea_elem(&wo.w, &ao.w, wv.w, zv.w, pv.w, av.w, alpha, scale, mu, f);                 \
            if (ww) *(float4 *)(w + e) = wo;                                                                \
            *(float4 *)(a + e) = ao;                                                                        \
        }                                                                                                   \
        for (i = t0; i < head + tail; i += step) {                                                          \
            float wo, ao;                                                                                   \
            e = i < head ? i : i + 4 * nvec;                                                                \
            avgpipe__cu_ea_elem(&wo, &ao, w[e], rz ? z[e] : 0.0f, rp ? zp[e] : 0.0f, ra ? a[e] : 0.0f, alpha, \
                                scale, mu, f);                                                              \
            if (ww) w[e] = wo;                                                                              \
            a[e] = ao;                                                                                      \
        }                                                                                                   \
    }

/* The lowest index of a NaN or +-Inf: each thread stops at its own first one (head, body and tail hold
   increasing indices), and only a thread that found one touches the result (an atomic minimum). */
#define AVGPIPE__CUDA_NONFINITE_TEXT                                                                        \
    AVGPIPE__CU_GLOBAL void avgpipe__cu_nonfinite(const float *AVGPIPE__CU_RESTRICT x, avgpipe__cu_u64 head, \
                                                  avgpipe__cu_u64 nvec, avgpipe__cu_u64 tail,               \
                                                  avgpipe__cu_u64 *result) {                                \
        const avgpipe__cu_u64 t0 = avgpipe__cu_thread(), step = avgpipe__cu_threads(), none = ~0ull;       \
        avgpipe__cu_u64 i, e, best = none;                                                                  \
        for (i = t0; i < head && best == none; i += step)                                                   \
            if (avgpipe__cu_bad(x[i])) best = i;                                                            \
        for (i = t0; i < nvec && best == none; i += step) {                                                 \
            float4 v;                                                                                       \
            e = head + 4 * i;                                                                               \
            v = *(const float4 *)(x + e);                                                                   \
            if (avgpipe__cu_bad(v.x)) best = e;                                                             \
            else if (avgpipe__cu_bad(v.y)) best = e + 1;                                                    \
            else if (avgpipe__cu_bad(v.z)) best = e + 2;                                                    \
            else if (avgpipe__cu_bad(v.w)) best = e + 3;                                                    \
        }                                                                                                   \
        for (i = t0; i < tail && best == none; i += step) {                                                 \
            e = head + 4 * nvec + i;                                                                        \
            if (avgpipe__cu_bad(x[e])) best = e;                                                            \
        }                                                                                                   \
        if (best != none) avgpipe__cu_min(result, best);                                                    \
    }

/* flag_nonfinite: each thread stops at its own first NaN or +-Inf; a thread that found one sets the flag.
   The compare-and-swap from 0 has exactly one winner while flag[0] is 0, and only the winner writes the
   tag, so flag[1] = tag holds exactly when flag[0] was 0 before this call set any bit; every other finder
   ORs its bits in (the same bits within a call). The calls on one flag are totally ordered on the device
   (the averaging module makes them on one stream chain), so a later call sees flag[0] != 0 and keeps the
   first call's tag. (With bits 0 flag[0] stays 0, and finders all store the same tag.) */
#define AVGPIPE__CUDA_FLAG_TEXT                                                                             \
    AVGPIPE__CU_GLOBAL void avgpipe__cu_flag(const float *AVGPIPE__CU_RESTRICT x, avgpipe__cu_u64 head,      \
                                             avgpipe__cu_u64 nvec, avgpipe__cu_u64 tail, unsigned *flag,    \
                                             unsigned bits, unsigned tag) {                                 \
        const avgpipe__cu_u64 t0 = avgpipe__cu_thread(), step = avgpipe__cu_threads();                      \
        avgpipe__cu_u64 i;                                                                                  \
        int found = 0;                                                                                      \
        for (i = t0; i < head && !found; i += step) found = avgpipe__cu_bad(x[i]);                          \
        for (i = t0; i < nvec && !found; i += step) {                                                       \
            const float4 v = *(const float4 *)(x + head + 4 * i);                                           \
            found = avgpipe__cu_bad(v.x) | avgpipe__cu_bad(v.y) | avgpipe__cu_bad(v.z) | avgpipe__cu_bad(v.w); \
        }                                                                                                   \
        for (i = t0; i < tail && !found; i += step) found = avgpipe__cu_bad(x[head + 4 * nvec + i]);        \
        if (found) {                                                                                        \
            if (avgpipe__cu_cas(flag, 0u, bits) == 0u) flag[1] = tag;                                       \
            else avgpipe__cu_or(flag, bits);                                                                \
        }                                                                                                   \
    }

#define AVGPIPE__CUDA_SCALE_TEXT                                                                            \
    AVGPIPE__CU_GLOBAL void avgpipe__cu_scale(float *AVGPIPE__CU_RESTRICT x, float s, avgpipe__cu_u64 head,  \
                                              avgpipe__cu_u64 nvec, avgpipe__cu_u64 tail) {                 \
        const avgpipe__cu_u64 t0 = avgpipe__cu_thread(), step = avgpipe__cu_threads();                      \
        avgpipe__cu_u64 i, e;                                                                               \
        for (i = t0; i < nvec; i += step) {                                                                 \
            float4 v;                                                                                       \
            e = head + 4 * i;                                                                               \
            v = *(const float4 *)(x + e);                                                                   \
            v.x = avgpipe__cu_mul(v.x, s);                                                                  \
            v.y = avgpipe__cu_mul(v.y, s);                                                                  \
            v.z = avgpipe__cu_mul(v.z, s);                                                                  \
            v.w = avgpipe__cu_mul(v.w, s);                                                                  \
            *(float4 *)(x + e) = v;                                                                         \
        }                                                                                                   \
        for (i = t0; i < head + tail; i += step) {                                                          \
            e = i < head ? i : i + 4 * nvec;                                                                \
            x[e] = avgpipe__cu_mul(x[e], s);                                                                \
        }                                                                                                   \
    }

/* The element function as the kernels use it (device helpers). */
#define AVGPIPE__CUDA_ELEM_DEVICE_TEXT \
    AVGPIPE__CUDA_ELEM_TEXT(AVGPIPE__CU_DEVICE, avgpipe__cu_ea_elem, avgpipe__cu_add, avgpipe__cu_sub, avgpipe__cu_mul)

#if defined(__CUDACC__) && !defined(AVGPIPE_CUDA_NVRTC)
/* nvcc: the kernels are part of the program. */
#define AVGPIPE__CU_GLOBAL static __global__
#define AVGPIPE__CU_DEVICE static __device__ __forceinline__
#define AVGPIPE__CU_RESTRICT __restrict__
AVGPIPE__CUDA_HELPERS_TEXT
AVGPIPE__CUDA_ELEM_DEVICE_TEXT
AVGPIPE__CUDA_EA_TEXT
AVGPIPE__CUDA_NONFINITE_TEXT
AVGPIPE__CUDA_FLAG_TEXT
AVGPIPE__CUDA_SCALE_TEXT
#undef AVGPIPE__CU_GLOBAL
#undef AVGPIPE__CU_DEVICE
#undef AVGPIPE__CU_RESTRICT
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* --- The host twin of the element function ------------------------------------------------------
   The same text with host arithmetic. A volatile store rounds each result to fp32 and keeps the compiler
   from contracting a multiply and an add into an FMA (gcc does that under -ffp-contract=fast, the default
   of the GNU C dialects, on FMA hardware), so the twin is the exact spec whatever the flags. */
static float avgpipe__cuh_add(float a, float b) {
    volatile float r = a + b;
    return r;
}
static float avgpipe__cuh_sub(float a, float b) {
    volatile float r = a - b;
    return r;
}
static float avgpipe__cuh_mul(float a, float b) {
    volatile float r = a * b;
    return r;
}
AVGPIPE__CUDA_ELEM_TEXT(static, avgpipe__cuda_elem_host, avgpipe__cuh_add, avgpipe__cuh_sub, avgpipe__cuh_mul)

/* The kernel flags of a pass, as avgpipe.h's avgpipe__ea_flags: momentum matters only where it is read. */
static unsigned avgpipe__cuda_flags(const avgpipe_ea_pass *p) {
    unsigned f = 0;
    if (p->alpha != 0.0f) f |= AVGPIPE__CUDA_F_PULL;
    if (p->first) f |= AVGPIPE__CUDA_F_FIRST;
    if (p->last) f |= AVGPIPE__CUDA_F_LAST;
    if (p->mode == AVGPIPE_EA_ELASTIC) {
        f |= AVGPIPE__CUDA_F_ELASTIC;
        if (p->last && p->momentum != 0.0f) f |= AVGPIPE__CUDA_F_MOMENTUM;
    }
    return f;
}
static int avgpipe__cuda_reads_z(unsigned f) {
    return (f & AVGPIPE__CUDA_F_PULL) || ((f & AVGPIPE__CUDA_F_ELASTIC) && (f & AVGPIPE__CUDA_F_LAST));
}

AVGPIPE_API avgpipe_result avgpipe_device_cuda_ea_pass_host(avgpipe_context *ctx, const avgpipe_ea_pass *p) {
    unsigned f;
    size_t i;
    int rz, rp, ra;
    if (!p) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_cuda_ea_pass_host: p is NULL");
    if (p->mode != AVGPIPE_EA_MEAN && p->mode != AVGPIPE_EA_ELASTIC)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_cuda_ea_pass_host: mode %d is not MEAN or ELASTIC",
                                 (int)p->mode);
    f = avgpipe__cuda_flags(p);
    rz = avgpipe__cuda_reads_z(f), rp = (f & AVGPIPE__CUDA_F_MOMENTUM) != 0, ra = !(f & AVGPIPE__CUDA_F_FIRST);
    if (p->count == 0) return AVGPIPE_OK;
    if (!p->w || !p->acc || (rz && !p->z) || (rp && !p->z_prev))
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_cuda_ea_pass_host: %s is NULL but read",
                                 !p->w ? "w" : !p->acc ? "acc" : (rz && !p->z) ? "z" : "z_prev");
    if (p->skip && *p->skip) return AVGPIPE_OK; /* as the kernel: a host pointer here */
    for (i = 0; i < p->count; i++) {
        float wo, ao;
        avgpipe__cuda_elem_host(&wo, &ao, p->w[i], rz ? p->z[i] : 0.0f, rp ? p->z_prev[i] : 0.0f, ra ? p->acc[i] : 0.0f,
                                p->alpha, p->scale, p->momentum, f);
        if (f & AVGPIPE__CUDA_F_PULL) p->w[i] = wo;
        p->acc[i] = ao;
    }
    return AVGPIPE_OK;
}

/* --- Launch planning ----------------------------------------------------------------------------- */

/* How a kernel covers `count` floats: a scalar head, nvec float4s, a scalar tail (see the kernel texts),
   and its grid. */
typedef struct avgpipe__cuda_plan {
    unsigned long long head, nvec, tail;
    unsigned grid, block;
} avgpipe__cuda_plan;

/* ptrs: the buffers the kernel touches (NULL entries: not touched). float4 accesses need every one of them
   at the same address modulo 16 (then a head of 0..3 floats aligns them all); else the kernel stays
   scalar. The grid covers the larger of the vector and the scalar work, at most max_blocks blocks (the
   kernel's grid: avgpipe__cuda_grids). */
static avgpipe__cuda_plan avgpipe__cuda_plan_make(const void *const *ptrs, int nptr, size_t count, int block, int max_blocks) {
    avgpipe__cuda_plan pl;
    uintptr_t off = 16;
    unsigned long long work, blocks;
    int k, vec = 1;
    for (k = 0; k < nptr; k++) {
        uintptr_t o;
        if (!ptrs[k]) continue;
        o = (uintptr_t)ptrs[k] & 15u;
        if (off == 16) off = o;
        else if (o != off) vec = 0;
    }
    if (off == 16 || off % 4 != 0) vec = 0; /* nothing touched, or floats not even 4-byte aligned */
    pl.head = count, pl.nvec = 0, pl.tail = 0;
    if (vec && (16 - off) % 16 / 4 <= count) {
        pl.head = (16 - off) % 16 / 4;
        pl.nvec = (count - pl.head) / 4;
        pl.tail = count - pl.head - 4 * pl.nvec;
    }
    work = pl.nvec > pl.head + pl.tail ? pl.nvec : pl.head + pl.tail;
    blocks = (work + (unsigned)block - 1) / (unsigned)block;
    if (blocks > (unsigned long long)max_blocks) blocks = (unsigned long long)max_blocks;
    if (blocks < 1) blocks = 1;
    pl.grid = (unsigned)blocks;
    pl.block = (unsigned)block;
    return pl;
}

/* --- Errors ------------------------------------------------------------------------------------------ */

#define AVGPIPE__CUDA_ERR_MAX 1024
static AVGPIPE__CUDA_TLS char avgpipe__cuda_err[AVGPIPE__CUDA_ERR_MAX];

/* The avgpipe_result of a CUDA error. */
static avgpipe_result avgpipe__cuda_result(cudaError_t e) {
    if (e == cudaSuccess) return AVGPIPE_OK;
    return e == cudaErrorMemoryAllocation ? AVGPIPE_OUT_OF_MEMORY : AVGPIPE_BACKEND_ERROR;
}

/* Record CUDA error e of `call` in `entry` of device `name` as this thread's text, and map it. CUDA keeps
   the last error per thread until read: reading it here keeps a failure already reported from showing up
   again in the user's own cudaGetLastError (sticky errors stay, as CUDA wants). */
static avgpipe_result avgpipe__cuda_fail(const char *name, cudaError_t e, const char *entry, const char *call) {
    snprintf(avgpipe__cuda_err, sizeof avgpipe__cuda_err, "%s %s: %s: %s (%s)", name, entry, call, cudaGetErrorString(e),
             cudaGetErrorName(e));
    (void)cudaGetLastError();
    return avgpipe__cuda_result(e);
}

/* event_query's reading of cudaEventQuery: not ready is an answer, not an error. */
static avgpipe_result avgpipe__cuda_query_done(const char *name, cudaError_t e, int *done) {
    *done = e == cudaSuccess;
    if (e == cudaSuccess) return AVGPIPE_OK;
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return AVGPIPE_OK;
    }
    return avgpipe__cuda_fail(name, e, "event_query", "cudaEventQuery");
}

/* --- The device state ---------------------------------------------------------------------------- */

#define AVGPIPE__CUDA_MAGIC 0x63756461u
#define AVGPIPE__CUDA_SLOTS 64 /* find_nonfinite calls at once (one bit each in a 64-bit mask) */

typedef struct avgpipe__cuda {
    unsigned magic;
    avgpipe_allocator allocator;   /* the creating context's: frees this struct */
    avgpipe_device_cuda_info info; /* resolved description and what the device is */
    int ordinal;
    char name[24];                 /* "cuda:N" */
    const void *k_ea, *k_nonfinite, *k_scale, *k_flag; /* kernels, as cudaLaunchKernel takes them */
#ifdef AVGPIPE_CUDA_NVRTC
    cudaLibrary_t lib;
    char *image; /* the NVRTC output the library was loaded from (kept for the library's lifetime) */
#endif
    unsigned long long *d_slots, *h_slots; /* find_nonfinite results: device, and pinned host mirror */
    pthread_mutex_t mu; /* the slots and the stream list */
    pthread_cond_t cv;
    uint64_t slot_free; /* bit k: slot k is free */
    int slots_lost;     /* slots withheld after a failure left work in flight on them */
    int sync_ready;
    cudaStream_t *streams; /* the streams stream_create made and stream_destroy has not destroyed (synchronize) */
    int nstreams, cap_streams;
    int warned_streams;    /* the hardware-queues warning was given (once per table) */
    /* The timed twins of events (see TIMING), under mu: an open-addressing table from an event to its
       twin (tw_key NULL: an empty slot; tw_cap a power of two or 0). twins: the default timing mode. */
    int twins;
    cudaEvent_t *tw_key, *tw_val;
    size_t tw_cap, tw_n;
    cudaEvent_t *anchors; /* the live events event_elapsed has named as a start */
    int nanchors, cap_anchors;
    /* The creating context's logger (the hardware-queues warning). */
    avgpipe_log_fn log;
    void *log_user;
    avgpipe_log_level log_level;
} avgpipe__cuda;

#define AVGPIPE__CUDA_SET(d, entry)                                                                        \
    do {                                                                                                   \
        cudaError_t e_ = cudaSetDevice((d)->ordinal);                                                      \
        if (e_ != cudaSuccess) return avgpipe__cuda_fail((d)->name, e_, entry, "cudaSetDevice");           \
    } while (0)
#define AVGPIPE__CUDA_TRY(d, entry, call, expr)                                                            \
    do {                                                                                                   \
        cudaError_t e_ = (expr);                                                                           \
        if (e_ != cudaSuccess) return avgpipe__cuda_fail((d)->name, e_, entry, call);                      \
    } while (0)
/* For the void entries: the failure is only recorded (error_string). */
#define AVGPIPE__CUDA_NOTE(d, entry, call, expr)                                                           \
    do {                                                                                                   \
        cudaError_t e_ = (expr);                                                                           \
        if (e_ != cudaSuccess) (void)avgpipe__cuda_fail((d)->name, e_, entry, call);                       \
    } while (0)

/* --- Waiting with a time limit (see WAITS) --------------------------------------------------------- */

#define AVGPIPE__CUDA_SPIN_US 20.0
#define AVGPIPE__CUDA_MAX_NAP_US 1000.0
#define AVGPIPE__CUDA_DEFAULT_TIMEOUT_S 300.0

/* Seconds, for durations (C11's timespec_get: no POSIX feature macros needed). */
static double avgpipe__cuda_now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static struct timespec avgpipe__cuda_deadline(double seconds) {
    struct timespec ts;
    double whole;
    timespec_get(&ts, TIME_UTC);
    whole = floor(seconds);
    ts.tv_sec += (time_t)whole;
    ts.tv_nsec += (long)((seconds - whole) * 1e9);
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    return ts;
}
/* Sleep `us` microseconds: a timed wait on a condition nobody signals. */
static pthread_mutex_t avgpipe__cuda_nap_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t avgpipe__cuda_nap_cv = PTHREAD_COND_INITIALIZER;
static void avgpipe__cuda_nap(double us) {
    struct timespec until = avgpipe__cuda_deadline(us * 1e-6);
    pthread_mutex_lock(&avgpipe__cuda_nap_mu);
    (void)pthread_cond_timedwait(&avgpipe__cuda_nap_cv, &avgpipe__cuda_nap_mu, &until);
    pthread_mutex_unlock(&avgpipe__cuda_nap_mu);
}

/* Wait until ev (when not NULL) or else stream s has finished its work, polling, within the device's
   timeout. `entry` names the table entry for the messages. */
static avgpipe_result avgpipe__cuda_poll(const avgpipe__cuda *d, const char *entry, cudaStream_t s, cudaEvent_t ev) {
    const double t0 = avgpipe__cuda_now(), limit = d->info.desc.timeout_s;
    const double spin = d->info.desc.blocking_sync ? 0.0 : AVGPIPE__CUDA_SPIN_US;
    double nap = 1.0, t;
    for (;;) {
        cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(s);
        if (e == cudaSuccess) return AVGPIPE_OK;
        if (e != cudaErrorNotReady) return avgpipe__cuda_fail(d->name, e, entry, ev ? "cudaEventQuery" : "cudaStreamQuery");
        (void)cudaGetLastError(); /* not ready is an answer, not an error to leave behind */
        t = avgpipe__cuda_now() - t0;
        if (t >= limit) {
            snprintf(avgpipe__cuda_err, sizeof avgpipe__cuda_err,
                     "%s %s: the GPU did not finish within %.3g s (desc.timeout_s): is a kernel or a transfer on that %s "
                     "waiting for something that never comes (a peer that is gone)? The work stays queued",
                     d->name, entry, limit, ev ? "event's stream" : "stream");
            return AVGPIPE_TIMEOUT;
        }
        if (t * 1e6 >= spin) {
            avgpipe__cuda_nap(nap);
            nap = nap * 2 < AVGPIPE__CUDA_MAX_NAP_US ? nap * 2 : AVGPIPE__CUDA_MAX_NAP_US;
        }
    }
}

/* --- Memory, copies, streams, events --------------------------------------------------------------- */

static avgpipe_result avgpipe__cuda_alloc(void *user, size_t bytes, void **out) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    *out = NULL;
    AVGPIPE__CUDA_SET(d, "alloc");
    AVGPIPE__CUDA_TRY(d, "alloc", "cudaMalloc", cudaMalloc(out, bytes ? bytes : 1));
    return AVGPIPE_OK;
}
static void avgpipe__cuda_free(void *user, void *ptr) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    cudaError_t e;
    if (!ptr) return;
    if ((e = cudaSetDevice(d->ordinal)) != cudaSuccess) {
        (void)avgpipe__cuda_fail(d->name, e, "free", "cudaSetDevice");
        return;
    }
    AVGPIPE__CUDA_NOTE(d, "free", "cudaFree", cudaFree(ptr));
}
static avgpipe_result avgpipe__cuda_copy(void *user, void *dst, const void *src, size_t bytes, avgpipe_device_copy_kind kind,
                                         avgpipe_device_stream stream) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    enum cudaMemcpyKind k;
    switch (kind) {
    case AVGPIPE_DEVICE_COPY_H2D: k = cudaMemcpyHostToDevice; break;
    case AVGPIPE_DEVICE_COPY_D2H: k = cudaMemcpyDeviceToHost; break;
    case AVGPIPE_DEVICE_COPY_D2D: k = cudaMemcpyDeviceToDevice; break;
    default:
        snprintf(avgpipe__cuda_err, sizeof avgpipe__cuda_err, "%s copy: unknown copy kind %d", d->name, (int)kind);
        return AVGPIPE_BACKEND_ERROR;
    }
    if (!bytes) return AVGPIPE_OK;
    AVGPIPE__CUDA_SET(d, "copy");
    AVGPIPE__CUDA_TRY(d, "copy", "cudaMemcpyAsync", cudaMemcpyAsync(dst, src, bytes, k, (cudaStream_t)stream));
    return AVGPIPE_OK;
}
static avgpipe_result avgpipe__cuda_memset(void *user, void *dst, int value, size_t bytes, avgpipe_device_stream stream) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    if (!bytes) return AVGPIPE_OK;
    AVGPIPE__CUDA_SET(d, "memset");
    AVGPIPE__CUDA_TRY(d, "memset", "cudaMemsetAsync", cudaMemsetAsync(dst, value, bytes, (cudaStream_t)stream));
    return AVGPIPE_OK;
}
/* CUDA_DEVICE_MAX_CONNECTIONS (env: its value, NULL when unset) as the limit it sets: 1..32, and 8 (CUDA's
   default) when unset, empty or not a positive number; larger values give 32 (the hardware's most). */
static int avgpipe__cuda_connections(const char *env) {
    char *end;
    long v;
    if (!env || !*env) return 8;
    v = strtol(env, &end, 10);
    while (*end == ' ' || *end == '\t' || *end == '\n') end++;
    if (end == env || *end || v < 1) return 8;
    return v > 32 ? 32 : (int)v;
}

/* The warning of HARDWARE QUEUES: n streams passed the limit. Called without mu held (the logger is the
   user's code). */
static void avgpipe__cuda_warn_streams(const avgpipe__cuda *d, int n) {
    char msg[640];
    const int lim = d->info.max_connections;
    if (!d->log || d->log_level < AVGPIPE_LOG_WARN) return;
    if (lim < 32)
        snprintf(msg, sizeof msg,
                 "%s: %d streams on this GPU exceed its %d hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 when unset): "
                 "streams share queues and their work may wait behind each other's (pipelines falsely serialised). Set "
                 "CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment before the program starts (CUDA reads it when it creates "
                 "the context; setting it now has no effect)",
                 d->name, n, lim);
    else
        snprintf(msg, sizeof msg,
                 "%s: %d streams on this GPU exceed its 32 hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS=32, the most): "
                 "streams share queues and their work may wait behind each other's; fewer pipelines or stages on one GPU "
                 "keep them apart",
                 d->name, n);
    d->log(AVGPIPE_LOG_WARN, msg, d->log_user);
}

/* Remember stream s for synchronize (0), or forget it (-1 when it was not there). Adding the stream that
   passes the hardware queues warns (once). */
static int avgpipe__cuda_track(avgpipe__cuda *d, cudaStream_t s, int add) {
    int k, rc = 0, warn = 0;
    pthread_mutex_lock(&d->mu);
    if (add) {
        if (d->nstreams == d->cap_streams) {
            int cap = d->cap_streams ? 2 * d->cap_streams : 16;
            cudaStream_t *a = (cudaStream_t *)d->allocator.alloc((size_t)cap * sizeof *a, d->allocator.user);
            if (!a) rc = -1;
            else {
                if (d->nstreams) memcpy(a, d->streams, (size_t)d->nstreams * sizeof *a);
                d->allocator.free(d->streams, d->allocator.user);
                d->streams = a, d->cap_streams = cap;
            }
        }
        if (rc == 0) {
            d->streams[d->nstreams++] = s;
            if (d->nstreams > d->info.max_connections && !d->warned_streams) d->warned_streams = 1, warn = d->nstreams;
        }
    } else {
        for (k = 0; k < d->nstreams && d->streams[k] != s; k++) {
        }
        if (k < d->nstreams) d->streams[k] = d->streams[--d->nstreams];
        else rc = -1;
    }
    pthread_mutex_unlock(&d->mu);
    if (warn) avgpipe__cuda_warn_streams(d, warn);
    return rc;
}

static avgpipe_result avgpipe__cuda_stream_create(void *user, avgpipe_device_stream *out) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    cudaStream_t s = NULL;
    *out = NULL;
    AVGPIPE__CUDA_SET(d, "stream_create");
    AVGPIPE__CUDA_TRY(d, "stream_create", "cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (avgpipe__cuda_track(d, s, 1) != 0) {
        (void)cudaStreamDestroy(s);
        snprintf(avgpipe__cuda_err, sizeof avgpipe__cuda_err, "%s stream_create: out of memory (the table's list of streams)", d->name);
        return AVGPIPE_OUT_OF_MEMORY;
    }
    *out = (avgpipe_device_stream)s;
    return AVGPIPE_OK;
}
static void avgpipe__cuda_stream_destroy(void *user, avgpipe_device_stream stream) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    cudaError_t e;
    if (!stream) return; /* the default stream is not ours to destroy */
    if ((e = cudaSetDevice(d->ordinal)) != cudaSuccess) {
        (void)avgpipe__cuda_fail(d->name, e, "stream_destroy", "cudaSetDevice");
        return;
    }
    (void)avgpipe__cuda_track(d, (cudaStream_t)stream, 0); /* a stream of your own was never in the list */
    AVGPIPE__CUDA_NOTE(d, "stream_destroy", "cudaStreamDestroy", cudaStreamDestroy((cudaStream_t)stream));
}
static avgpipe_result avgpipe__cuda_stream_sync(void *user, avgpipe_device_stream stream) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    AVGPIPE__CUDA_SET(d, "stream_synchronize");
    return avgpipe__cuda_poll(d, "stream_synchronize", (cudaStream_t)stream, NULL);
}
/* --- Timed twins (see TIMING): the table from an event to its twin, under d->mu -------------------------- */

static size_t avgpipe__cuda_tw_home(cudaEvent_t ev, size_t cap) {
    uint64_t h = (uint64_t)(uintptr_t)ev;
    h ^= h >> 29;
    h *= 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 32) & (cap - 1);
}
/* The slot of ev, or the empty slot where it would go (cap > 0). */
static size_t avgpipe__cuda_tw_slot(const avgpipe__cuda *d, cudaEvent_t ev) {
    size_t i = avgpipe__cuda_tw_home(ev, d->tw_cap);
    while (d->tw_key[i] && d->tw_key[i] != ev) i = (i + 1) & (d->tw_cap - 1);
    return i;
}
/* ev's twin, or NULL. */
static cudaEvent_t avgpipe__cuda_tw_find(const avgpipe__cuda *d, cudaEvent_t ev) {
    if (!d->tw_cap || !ev) return NULL;
    return d->tw_val[avgpipe__cuda_tw_slot(d, ev)];
}
/* Add ev -> twin (ev not yet there, both non-NULL); -1 when out of memory. */
static int avgpipe__cuda_tw_put(avgpipe__cuda *d, cudaEvent_t ev, cudaEvent_t twin) {
    size_t i;
    if (2 * (d->tw_n + 1) > d->tw_cap) { /* at most half full */
        size_t cap = d->tw_cap ? 2 * d->tw_cap : 64, k, old = d->tw_cap;
        cudaEvent_t *key = (cudaEvent_t *)d->allocator.alloc(cap * sizeof *key, d->allocator.user);
        cudaEvent_t *val = (cudaEvent_t *)d->allocator.alloc(cap * sizeof *val, d->allocator.user);
        cudaEvent_t *okey = d->tw_key, *oval = d->tw_val;
        if (!key || !val) {
            d->allocator.free(key, d->allocator.user);
            d->allocator.free(val, d->allocator.user);
            return -1;
        }
        memset(key, 0, cap * sizeof *key);
        memset(val, 0, cap * sizeof *val);
        d->tw_key = key, d->tw_val = val, d->tw_cap = cap;
        for (k = 0; k < old; k++)
            if (okey[k]) {
                i = avgpipe__cuda_tw_slot(d, okey[k]);
                d->tw_key[i] = okey[k], d->tw_val[i] = oval[k];
            }
        d->allocator.free(okey, d->allocator.user);
        d->allocator.free(oval, d->allocator.user);
    }
    i = avgpipe__cuda_tw_slot(d, ev);
    d->tw_key[i] = ev, d->tw_val[i] = twin;
    d->tw_n++;
    return 0;
}
/* Remove ev and return its twin (NULL when it had none). The entries after it that were displaced past
   the freed slot move back into it (no tombstones: a lookup still ends at the first empty slot). */
static cudaEvent_t avgpipe__cuda_tw_take(avgpipe__cuda *d, cudaEvent_t ev) {
    size_t i, j, h, mask;
    cudaEvent_t twin;
    if (!d->tw_cap || !ev) return NULL;
    mask = d->tw_cap - 1;
    i = avgpipe__cuda_tw_slot(d, ev);
    if (!d->tw_key[i]) return NULL;
    twin = d->tw_val[i];
    for (j = (i + 1) & mask; d->tw_key[j]; j = (j + 1) & mask) {
        h = avgpipe__cuda_tw_home(d->tw_key[j], d->tw_cap);
        /* the entry at j may fill the hole at i unless its home lies cyclically in (i, j] */
        if (i <= j ? (h <= i || h > j) : (h <= i && h > j)) {
            d->tw_key[i] = d->tw_key[j], d->tw_val[i] = d->tw_val[j];
            i = j;
        }
    }
    d->tw_key[i] = NULL, d->tw_val[i] = NULL;
    d->tw_n--;
    return twin;
}

/* Is ev an anchor (a start event_elapsed named, see TIMING)? Under d->mu. */
static int avgpipe__cuda_anchor_at(const avgpipe__cuda *d, cudaEvent_t ev) {
    int k;
    for (k = 0; k < d->nanchors && d->anchors[k] != ev; k++) {
    }
    return k < d->nanchors ? k : -1;
}
/* Make ev an anchor (once); -1 when out of memory. Under d->mu. */
static int avgpipe__cuda_anchor_add(avgpipe__cuda *d, cudaEvent_t ev) {
    if (avgpipe__cuda_anchor_at(d, ev) >= 0) return 0;
    if (d->nanchors == d->cap_anchors) {
        int cap = d->cap_anchors ? 2 * d->cap_anchors : 16;
        cudaEvent_t *a = (cudaEvent_t *)d->allocator.alloc((size_t)cap * sizeof *a, d->allocator.user);
        if (!a) return -1;
        if (d->nanchors) memcpy(a, d->anchors, (size_t)d->nanchors * sizeof *a);
        d->allocator.free(d->anchors, d->allocator.user);
        d->anchors = a, d->cap_anchors = cap;
    }
    d->anchors[d->nanchors++] = ev;
    return 0;
}

#define AVGPIPE__CUDA_TWIN_FIND 0     /* the twin if there is one */
#define AVGPIPE__CUDA_TWIN_MAKE 1     /* made if there is none */
#define AVGPIPE__CUDA_TWIN_ANCHORED 2 /* made if there is none while an anchor lives (event_record) */

/* ev's timed twin in *twin (NULL: none), made as `how` says; *made = 1 when it was made now (not yet
   recorded). `entry` names the table entry for the messages. */
static avgpipe_result avgpipe__cuda_twin(avgpipe__cuda *d, cudaEvent_t ev, int how, const char *entry, cudaEvent_t *twin, int *made) {
    cudaEvent_t t = NULL, had;
    int oom;
    *made = 0;
    pthread_mutex_lock(&d->mu);
    *twin = avgpipe__cuda_tw_find(d, ev);
    if (how == AVGPIPE__CUDA_TWIN_ANCHORED) how = d->nanchors > 0 ? AVGPIPE__CUDA_TWIN_MAKE : AVGPIPE__CUDA_TWIN_FIND;
    pthread_mutex_unlock(&d->mu);
    if (*twin || how == AVGPIPE__CUDA_TWIN_FIND) return AVGPIPE_OK;
    AVGPIPE__CUDA_TRY(d, entry, "cudaEventCreateWithFlags", cudaEventCreateWithFlags(&t, cudaEventDefault)); /* timed */
    pthread_mutex_lock(&d->mu);
    had = avgpipe__cuda_tw_find(d, ev); /* another thread may have made one meanwhile */
    oom = !had && avgpipe__cuda_tw_put(d, ev, t) != 0;
    pthread_mutex_unlock(&d->mu);
    if (had || oom) (void)cudaEventDestroy(t);
    if (oom) {
        snprintf(avgpipe__cuda_err, sizeof avgpipe__cuda_err, "%s %s: out of memory (the table of timed events)", d->name, entry);
        return AVGPIPE_OUT_OF_MEMORY;
    }
    *twin = had ? had : t;
    *made = !had;
    return AVGPIPE_OK;
}

/* The flags events are made with (see TIMING). */
static unsigned avgpipe__cuda_event_flags(const avgpipe_device_cuda_desc *desc) {
    return (desc->timed_events ? 0u : (unsigned)cudaEventDisableTiming) | (desc->blocking_sync ? (unsigned)cudaEventBlockingSync : 0u);
}

static avgpipe_result avgpipe__cuda_event_create(void *user, avgpipe_device_event *out) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    cudaEvent_t ev = NULL;
    unsigned flags = avgpipe__cuda_event_flags(&d->info.desc);
    *out = NULL;
    AVGPIPE__CUDA_SET(d, "event_create");
    AVGPIPE__CUDA_TRY(d, "event_create", "cudaEventCreateWithFlags", cudaEventCreateWithFlags(&ev, flags));
    *out = (avgpipe_device_event)ev;
    return AVGPIPE_OK;
}
static void avgpipe__cuda_event_destroy(void *user, avgpipe_device_event event) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    cudaError_t e;
    if (!event) return;
    if ((e = cudaSetDevice(d->ordinal)) != cudaSuccess) {
        (void)avgpipe__cuda_fail(d->name, e, "event_destroy", "cudaSetDevice");
        return;
    }
    if (d->twins) {
        cudaEvent_t twin;
        int k;
        pthread_mutex_lock(&d->mu);
        twin = avgpipe__cuda_tw_take(d, (cudaEvent_t)event);
        if ((k = avgpipe__cuda_anchor_at(d, (cudaEvent_t)event)) >= 0) d->anchors[k] = d->anchors[--d->nanchors];
        pthread_mutex_unlock(&d->mu);
        if (twin) AVGPIPE__CUDA_NOTE(d, "event_destroy", "cudaEventDestroy", cudaEventDestroy(twin));
    }
    AVGPIPE__CUDA_NOTE(d, "event_destroy", "cudaEventDestroy", cudaEventDestroy((cudaEvent_t)event));
}
static avgpipe_result avgpipe__cuda_event_record(void *user, avgpipe_device_event event, avgpipe_device_stream stream) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    AVGPIPE__CUDA_SET(d, "event_record");
    if (d->twins && event) { /* the twin first: when the event has completed, so has it (stream order) */
        cudaEvent_t twin;
        int made;
        avgpipe_result r = avgpipe__cuda_twin(d, (cudaEvent_t)event, AVGPIPE__CUDA_TWIN_ANCHORED, "event_record", &twin, &made);
        if (r != AVGPIPE_OK) return r;
        if (twin) AVGPIPE__CUDA_TRY(d, "event_record", "cudaEventRecord", cudaEventRecord(twin, (cudaStream_t)stream));
    }
    AVGPIPE__CUDA_TRY(d, "event_record", "cudaEventRecord", cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream));
    return AVGPIPE_OK;
}
static avgpipe_result avgpipe__cuda_stream_wait(void *user, avgpipe_device_stream stream, avgpipe_device_event event) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    AVGPIPE__CUDA_SET(d, "stream_wait_event");
    AVGPIPE__CUDA_TRY(d, "stream_wait_event", "cudaStreamWaitEvent",
                      cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0));
    return AVGPIPE_OK;
}
static avgpipe_result avgpipe__cuda_event_sync(void *user, avgpipe_device_event event) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    AVGPIPE__CUDA_SET(d, "event_synchronize");
    if (!event) { /* cudaEventQuery(NULL) would be an error; a NULL event marks nothing to wait for */
        snprintf(avgpipe__cuda_err, sizeof avgpipe__cuda_err, "%s event_synchronize: the event is NULL", d->name);
        return AVGPIPE_BACKEND_ERROR;
    }
    return avgpipe__cuda_poll(d, "event_synchronize", NULL, (cudaEvent_t)event);
}
static avgpipe_result avgpipe__cuda_event_query(void *user, avgpipe_device_event event, int *done) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    *done = 0;
    AVGPIPE__CUDA_SET(d, "event_query");
    return avgpipe__cuda_query_done(d->name, cudaEventQuery((cudaEvent_t)event), done);
}
static avgpipe_result avgpipe__cuda_event_elapsed(void *user, avgpipe_device_event start, avgpipe_device_event end,
                                                  double *seconds) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    cudaEvent_t a = (cudaEvent_t)start, b = (cudaEvent_t)end;
    float ms = 0.0f;
    *seconds = 0.0;
    AVGPIPE__CUDA_SET(d, "event_elapsed");
    if (d->twins) { /* see TIMING */
        avgpipe_result r;
        int made_a = 0, made_b = 0, oom;
        if (!start || !end) {
            snprintf(avgpipe__cuda_err, sizeof avgpipe__cuda_err, "%s event_elapsed: the %s event is NULL", d->name, !start ? "start" : "end");
            return AVGPIPE_BACKEND_ERROR;
        }
        pthread_mutex_lock(&d->mu);
        oom = avgpipe__cuda_anchor_add(d, a) != 0;
        pthread_mutex_unlock(&d->mu);
        if (oom) {
            snprintf(avgpipe__cuda_err, sizeof avgpipe__cuda_err, "%s event_elapsed: out of memory (the table of timed events)", d->name);
            return AVGPIPE_OUT_OF_MEMORY;
        }
        if ((r = avgpipe__cuda_twin(d, a, AVGPIPE__CUDA_TWIN_MAKE, "event_elapsed", &a, &made_a)) != AVGPIPE_OK ||
            (r = avgpipe__cuda_twin(d, b, AVGPIPE__CUDA_TWIN_MAKE, "event_elapsed", &b, &made_b)) != AVGPIPE_OK)
            return r;
        if (made_a || made_b) {
            snprintf(avgpipe__cuda_err, sizeof avgpipe__cuda_err,
                     "%s event_elapsed: %s had no timing yet (events are made with cudaEventDisableTiming): timed from %s "
                     "next event_record on (desc.timed_events = 1 times every event from its first)",
                     d->name, made_a && made_b && start != end ? "the events" : made_a ? "the start event" : "the end event",
                     made_a && made_b && start != end ? "their" : "its");
            return AVGPIPE_BACKEND_ERROR;
        }
    }
    AVGPIPE__CUDA_TRY(d, "event_elapsed", "cudaEventElapsedTime", cudaEventElapsedTime(&ms, a, b));
    *seconds = (double)ms * 1e-3;
    return AVGPIPE_OK;
}
/* Every stream of the table, then the default stream (see the entry's note in THE ENTRIES). The list is
   copied first: other threads may create and destroy streams meanwhile (a stream destroyed after the copy
   is not waited for; CUDA finishes its work all the same). */
static avgpipe_result avgpipe__cuda_sync(void *user) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    cudaStream_t few[32], *list = few;
    avgpipe_result r = AVGPIPE_OK;
    int n, k;
    AVGPIPE__CUDA_SET(d, "synchronize");
    pthread_mutex_lock(&d->mu);
    n = d->nstreams;
    if (n > 32 && !(list = (cudaStream_t *)d->allocator.alloc((size_t)n * sizeof *list, d->allocator.user))) n = -1;
    else if (n) memcpy(list, d->streams, (size_t)n * sizeof *list);
    pthread_mutex_unlock(&d->mu);
    if (n < 0) {
        snprintf(avgpipe__cuda_err, sizeof avgpipe__cuda_err, "%s synchronize: out of memory", d->name);
        return AVGPIPE_OUT_OF_MEMORY;
    }
    for (k = 0; k < n && r == AVGPIPE_OK; k++) r = avgpipe__cuda_poll(d, "synchronize", list[k], NULL);
    if (r == AVGPIPE_OK) r = avgpipe__cuda_poll(d, "synchronize", NULL, NULL);
    if (list != few) d->allocator.free(list, d->allocator.user);
    return r;
}
static const char *avgpipe__cuda_error_string(void *user) {
    (void)user;
    return avgpipe__cuda_err;
}

/* --- Kernels ------------------------------------------------------------------------------------------ */

static cudaError_t avgpipe__cuda_launch(const void *kernel, const avgpipe__cuda_plan *pl, void **args,
                                        avgpipe_device_stream stream) {
    dim3 grid, block;
    grid.x = pl->grid, grid.y = 1, grid.z = 1;
    block.x = pl->block, block.y = 1, block.z = 1;
    return cudaLaunchKernel(kernel, grid, block, args, 0, (cudaStream_t)stream);
}

/* The plan of kernel `kernel` (AVGPIPE_DEVICE_CUDA_KERNEL_*): its grid (see GRIDS). */
static avgpipe__cuda_plan avgpipe__cuda_plan_of(const avgpipe__cuda *d, int kernel, const void *const *ptrs, int nptr, size_t count) {
    return avgpipe__cuda_plan_make(ptrs, nptr, count, d->info.desc.block_size, d->info.grid[kernel]);
}

/* A pass's kernel arguments: the buffers it touches (NULL: not touched), its flags, its plan. */
typedef struct avgpipe__cuda_ea_args {
    float *w, *a;
    const float *z, *zp;
    float alpha, scale, mu;
    unsigned f;
    const unsigned *skip; /* avgpipe_ea_pass.skip (device memory, or NULL) */
    avgpipe__cuda_plan pl;
} avgpipe__cuda_ea_args;

static avgpipe__cuda_ea_args avgpipe__cuda_ea_prep(const avgpipe_ea_pass *p, int block, int max_blocks) {
    avgpipe__cuda_ea_args x;
    const void *ptrs[4];
    x.f = avgpipe__cuda_flags(p);
    x.w = p->w, x.a = p->acc;
    x.z = avgpipe__cuda_reads_z(x.f) ? p->z : NULL;
    x.zp = (x.f & AVGPIPE__CUDA_F_MOMENTUM) ? p->z_prev : NULL;
    x.alpha = p->alpha, x.scale = p->scale, x.mu = p->momentum;
    x.skip = (const unsigned *)p->skip;
    ptrs[0] = x.w, ptrs[1] = x.z, ptrs[2] = x.zp, ptrs[3] = x.a;
    x.pl = avgpipe__cuda_plan_make(ptrs, 4, p->count, block, max_blocks);
    return x;
}

static avgpipe_result avgpipe__cuda_ea_pass(void *user, const avgpipe_ea_pass *p, avgpipe_device_stream stream) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    avgpipe__cuda_ea_args x;
    void *args[12];
    if (!p->count) return AVGPIPE_OK;
    x = avgpipe__cuda_ea_prep(p, d->info.desc.block_size, d->info.grid[AVGPIPE_DEVICE_CUDA_KERNEL_EA]);
    args[0] = &x.w, args[1] = &x.z, args[2] = &x.zp, args[3] = &x.a, args[4] = &x.pl.head, args[5] = &x.pl.nvec;
    args[6] = &x.pl.tail, args[7] = &x.alpha, args[8] = &x.scale, args[9] = &x.mu, args[10] = &x.f, args[11] = &x.skip;
    AVGPIPE__CUDA_SET(d, "ea_pass");
    AVGPIPE__CUDA_TRY(d, "ea_pass", "cudaLaunchKernel", avgpipe__cuda_launch(d->k_ea, &x.pl, args, stream));
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__cuda_scale(void *user, float *x, float factor, size_t count, avgpipe_device_stream stream) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    const void *ptrs[1];
    avgpipe__cuda_plan pl;
    void *args[5];
    if (!count) return AVGPIPE_OK;
    ptrs[0] = x;
    pl = avgpipe__cuda_plan_of(d, AVGPIPE_DEVICE_CUDA_KERNEL_SCALE, ptrs, 1, count);
    args[0] = &x, args[1] = &factor, args[2] = &pl.head, args[3] = &pl.nvec, args[4] = &pl.tail;
    AVGPIPE__CUDA_SET(d, "scale");
    AVGPIPE__CUDA_TRY(d, "scale", "cudaLaunchKernel", avgpipe__cuda_launch(d->k_scale, &pl, args, stream));
    return AVGPIPE_OK;
}

/* The non-finite check without a host wait (see the kernel text): one launch on the stream, no result
   copied back; the flag is read by whoever waits for the stream. */
static avgpipe_result avgpipe__cuda_flag_nonfinite(void *user, const float *x, size_t count, uint32_t *flag, uint32_t bits,
                                                   uint32_t tag, avgpipe_device_stream stream) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    const void *ptrs[1];
    avgpipe__cuda_plan pl;
    unsigned *f = (unsigned *)flag, b = (unsigned)bits, t = (unsigned)tag;
    void *args[7];
    if (!count) return AVGPIPE_OK;
    ptrs[0] = x;
    pl = avgpipe__cuda_plan_of(d, AVGPIPE_DEVICE_CUDA_KERNEL_FLAG, ptrs, 1, count);
    args[0] = &x, args[1] = &pl.head, args[2] = &pl.nvec, args[3] = &pl.tail, args[4] = &f, args[5] = &b, args[6] = &t;
    AVGPIPE__CUDA_SET(d, "flag_nonfinite");
    AVGPIPE__CUDA_TRY(d, "flag_nonfinite", "cudaLaunchKernel", avgpipe__cuda_launch(d->k_flag, &pl, args, stream));
    return AVGPIPE_OK;
}

/* A result slot for find_nonfinite: waits while all are in use (each holder's wait is itself limited), at
   most desc.timeout_s; -1 when none came free, or every slot was lost to failures. */
static int avgpipe__cuda_slot_take(avgpipe__cuda *d) {
    int k = -1, late = 0;
    struct timespec until = avgpipe__cuda_deadline(d->info.desc.timeout_s);
    pthread_mutex_lock(&d->mu);
    while (!d->slot_free && d->slots_lost < AVGPIPE__CUDA_SLOTS && !late)
        late = pthread_cond_timedwait(&d->cv, &d->mu, &until) != 0;
    if (d->slot_free) {
        for (k = 0; !(d->slot_free >> k & 1u); k++) {
        }
        d->slot_free &= ~((uint64_t)1 << k);
    }
    pthread_mutex_unlock(&d->mu);
    return k;
}
/* lost: work may still be in flight on the slot (a failure after enqueueing): never hand it out again. */
static void avgpipe__cuda_slot_give(avgpipe__cuda *d, int k, int lost) {
    pthread_mutex_lock(&d->mu);
    if (lost) d->slots_lost++;
    else d->slot_free |= (uint64_t)1 << k;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
}

/* Enqueue the scan into slot k and wait for its answer. *enqueued tells the caller whether anything may
   still be in flight on the slot after a failure. */
static avgpipe_result avgpipe__cuda_scan(avgpipe__cuda *d, int k, const float *x, size_t count, size_t *index,
                                         avgpipe_device_stream stream, int *enqueued) {
    unsigned long long *slot = d->d_slots + k;
    const void *ptrs[1];
    avgpipe__cuda_plan pl;
    void *args[5];
    ptrs[0] = x;
    pl = avgpipe__cuda_plan_of(d, AVGPIPE_DEVICE_CUDA_KERNEL_NONFINITE, ptrs, 1, count);
    args[0] = &x, args[1] = &pl.head, args[2] = &pl.nvec, args[3] = &pl.tail, args[4] = &slot;
    *enqueued = 0;
    AVGPIPE__CUDA_TRY(d, "find_nonfinite", "cudaMemsetAsync", cudaMemsetAsync(slot, 0xff, sizeof *slot, (cudaStream_t)stream));
    *enqueued = 1;
    AVGPIPE__CUDA_TRY(d, "find_nonfinite", "cudaLaunchKernel", avgpipe__cuda_launch(d->k_nonfinite, &pl, args, stream));
    AVGPIPE__CUDA_TRY(d, "find_nonfinite", "cudaMemcpyAsync",
                      cudaMemcpyAsync(d->h_slots + k, slot, sizeof *slot, cudaMemcpyDeviceToHost, (cudaStream_t)stream));
    {
        avgpipe_result r = avgpipe__cuda_poll(d, "find_nonfinite", (cudaStream_t)stream, NULL);
        if (r != AVGPIPE_OK) return r;
    }
    *enqueued = 0;
    *index = d->h_slots[k] < (unsigned long long)count ? (size_t)d->h_slots[k] : count;
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__cuda_find_nonfinite(void *user, const float *x, size_t count, size_t *index,
                                                   avgpipe_device_stream stream) {
    avgpipe__cuda *d = (avgpipe__cuda *)user;
    avgpipe_result r;
    int k, enqueued = 0;
    *index = count;
    if (!count) return AVGPIPE_OK;
    AVGPIPE__CUDA_SET(d, "find_nonfinite");
    if ((k = avgpipe__cuda_slot_take(d)) < 0) {
        int lost;
        pthread_mutex_lock(&d->mu);
        lost = d->slots_lost >= AVGPIPE__CUDA_SLOTS;
        pthread_mutex_unlock(&d->mu);
        snprintf(avgpipe__cuda_err, sizeof avgpipe__cuda_err, "%s find_nonfinite: %s", d->name,
                 lost ? "every result slot was lost to earlier CUDA failures"
                      : "no result slot came free within desc.timeout_s (64 scans at once, each waiting for its GPU work)");
        return lost ? AVGPIPE_BACKEND_ERROR : AVGPIPE_TIMEOUT;
    }
    r = avgpipe__cuda_scan(d, k, x, count, index, stream, &enqueued);
    /* After a failure with work enqueued, the slot is reusable only if the stream has drained (asked once:
       after a timeout it has not, and the slot is withheld for good rather than waited for). */
    avgpipe__cuda_slot_give(d, k, enqueued && cudaStreamQuery((cudaStream_t)stream) != cudaSuccess);
    if (enqueued) (void)cudaGetLastError();
    return r;
}

/* --- Kernels built at run time (NVRTC) -------------------------------------------------------------- */
#ifdef AVGPIPE_CUDA_NVRTC

#define AVGPIPE__CUDA_STR_(...) #__VA_ARGS__
#define AVGPIPE__CUDA_STR(...) AVGPIPE__CUDA_STR_(__VA_ARGS__)

/* The kernels' source for NVRTC, in pieces (ISO C only promises string literals of 4095 characters). */
static const char *const avgpipe__cuda_src[] = {
    "#define AVGPIPE__CU_GLOBAL extern \"C\" __global__\n"
    "#define AVGPIPE__CU_DEVICE static __device__ __forceinline__\n"
    "#define AVGPIPE__CU_RESTRICT __restrict__\n",
    AVGPIPE__CUDA_STR(AVGPIPE__CUDA_HELPERS_TEXT),
    "\n",
    AVGPIPE__CUDA_STR(AVGPIPE__CUDA_ELEM_DEVICE_TEXT),
    "\n",
    AVGPIPE__CUDA_STR(AVGPIPE__CUDA_EA_TEXT),
    "\n",
    AVGPIPE__CUDA_STR(AVGPIPE__CUDA_NONFINITE_TEXT),
    "\n",
    AVGPIPE__CUDA_STR(AVGPIPE__CUDA_FLAG_TEXT),
    "\n",
    AVGPIPE__CUDA_STR(AVGPIPE__CUDA_SCALE_TEXT),
    "\n"};

/* The source as one string, through the allocator (NULL when out of memory). */
static char *avgpipe__cuda_source(const avgpipe_allocator *al) {
    size_t n = 1, k, len;
    char *s, *p;
    for (k = 0; k < sizeof avgpipe__cuda_src / sizeof avgpipe__cuda_src[0]; k++) n += strlen(avgpipe__cuda_src[k]);
    if (!(s = p = (char *)al->alloc(n, al->user))) return NULL;
    for (k = 0; k < sizeof avgpipe__cuda_src / sizeof avgpipe__cuda_src[0]; k++) {
        len = strlen(avgpipe__cuda_src[k]);
        memcpy(p, avgpipe__cuda_src[k], len);
        p += len;
    }
    *p = 0;
    return s;
}

static avgpipe_result avgpipe__nvrtc_result(nvrtcResult r) {
    if (r == NVRTC_SUCCESS) return AVGPIPE_OK;
    return r == NVRTC_ERROR_OUT_OF_MEMORY ? AVGPIPE_OUT_OF_MEMORY : AVGPIPE_BACKEND_ERROR;
}

/* The architecture to build for on a device of compute capability `cc` (major * 10 + minor): the device's
   own (*machine = 1: a cubin) when NVRTC knows it, else the newest NVRTC knows below it (PTX); 0 when
   NVRTC knows none at or below cc. */
static int avgpipe__nvrtc_arch(int cc, int *machine, int *lowest, int *highest) {
    int archs[128], n = 0, k, best = 0;
    *machine = 0, *lowest = 0, *highest = 0;
    if (nvrtcGetNumSupportedArchs(&n) != NVRTC_SUCCESS || n < 1 || n > 128) return 0;
    if (nvrtcGetSupportedArchs(archs) != NVRTC_SUCCESS) return 0;
    *lowest = archs[0], *highest = archs[0];
    for (k = 0; k < n; k++) {
        if (archs[k] < *lowest) *lowest = archs[k];
        if (archs[k] > *highest) *highest = archs[k];
        if (archs[k] == cc) *machine = 1;
        if (archs[k] <= cc && archs[k] > best) best = archs[k];
    }
    return best;
}

/* Compile the kernels' source for `arch` (e.g. 90): machine code (sm_90, a cubin) or PTX (compute_90,
   NUL-terminated). *image comes from the allocator; the caller frees it. On failure the context gets
   NVRTC's text and the compiler's log. */
static avgpipe_result avgpipe__nvrtc_build(avgpipe_context *ctx, const avgpipe_allocator *al, int arch, int machine,
                                           char **image, size_t *size) {
    char archopt[48], *src, *log = NULL;
    const char *opts[5];
    nvrtcProgram prog = NULL;
    nvrtcResult r;
    size_t logsize = 0;
    avgpipe_result res = AVGPIPE_OK;
    *image = NULL, *size = 0;
    snprintf(archopt, sizeof archopt, "--gpu-architecture=%s_%d", machine ? "sm" : "compute", arch);
    opts[0] = archopt, opts[1] = "--fmad=false", opts[2] = "--ftz=false", opts[3] = "--prec-div=true", opts[4] = "--prec-sqrt=true";
    if (!(src = avgpipe__cuda_source(al))) return avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_device_cuda_create: out of memory");
    if ((r = nvrtcCreateProgram(&prog, src, "avgpipe_cuda_kernels.cu", 0, NULL, NULL)) != NVRTC_SUCCESS) {
        al->free(src, al->user);
        return avgpipe_set_error(ctx, avgpipe__nvrtc_result(r), "avgpipe_device_cuda_create: nvrtcCreateProgram: %s",
                                 nvrtcGetErrorString(r));
    }
    r = nvrtcCompileProgram(prog, 5, opts);
    if (r != NVRTC_SUCCESS) {
        if (nvrtcGetProgramLogSize(prog, &logsize) == NVRTC_SUCCESS && logsize > 0 &&
            (log = (char *)al->alloc(logsize, al->user)) != NULL && nvrtcGetProgramLog(prog, log) != NVRTC_SUCCESS)
            log[0] = 0;
        res = avgpipe_set_error(ctx, avgpipe__nvrtc_result(r), "avgpipe_device_cuda_create: nvrtcCompileProgram (%s): %s: %.600s",
                                archopt, nvrtcGetErrorString(r), log ? log : "");
        al->free(log, al->user);
    } else {
        r = machine ? nvrtcGetCUBINSize(prog, size) : nvrtcGetPTXSize(prog, size);
        if (r == NVRTC_SUCCESS && !(*image = (char *)al->alloc(*size ? *size : 1, al->user))) {
            res = avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_device_cuda_create: out of memory");
        } else {
            if (r == NVRTC_SUCCESS) r = machine ? nvrtcGetCUBIN(prog, *image) : nvrtcGetPTX(prog, *image);
            if (r != NVRTC_SUCCESS) {
                res = avgpipe_set_error(ctx, avgpipe__nvrtc_result(r), "avgpipe_device_cuda_create: nvrtcGet%s: %s",
                                        machine ? "CUBIN" : "PTX", nvrtcGetErrorString(r));
                al->free(*image, al->user);
                *image = NULL, *size = 0;
            }
        }
    }
    (void)nvrtcDestroyProgram(&prog);
    al->free(src, al->user);
    return res;
}

/* Build the kernels for this device and load them (the runtime's library API: no driver API, no -lcuda). */
static avgpipe_result avgpipe__cuda_kernels(avgpipe_context *ctx, avgpipe__cuda *d) {
    int cc = d->info.cc_major * 10 + d->info.cc_minor, machine, lo, hi, arch;
    cudaKernel_t k_ea = NULL, k_nonfinite = NULL, k_scale = NULL, k_flag = NULL;
    size_t size;
    avgpipe_result r;
    cudaError_t e;
    if (!(arch = avgpipe__nvrtc_arch(cc, &machine, &lo, &hi)))
        return avgpipe_set_error(ctx, AVGPIPE_BACKEND_ERROR,
                                 "avgpipe_device_cuda_create: %s: NVRTC cannot build for compute capability %d.%d (it knows %d.%d to %d.%d)",
                                 d->name, d->info.cc_major, d->info.cc_minor, lo / 10, lo % 10, hi / 10, hi % 10);
    if ((r = avgpipe__nvrtc_build(ctx, &d->allocator, arch, machine, &d->image, &size)) != AVGPIPE_OK) return r;
    snprintf(d->info.kernels, sizeof d->info.kernels, machine ? "nvrtc sm_%d" : "nvrtc compute_%d (PTX)", arch);
    d->info.nvrtc = 1;
    e = cudaLibraryLoadData(&d->lib, d->image, NULL, NULL, 0, NULL, NULL, 0);
    if (e == cudaSuccess) e = cudaLibraryGetKernel(&k_ea, d->lib, "avgpipe__cu_ea");
    if (e == cudaSuccess) e = cudaLibraryGetKernel(&k_nonfinite, d->lib, "avgpipe__cu_nonfinite");
    if (e == cudaSuccess) e = cudaLibraryGetKernel(&k_scale, d->lib, "avgpipe__cu_scale");
    if (e == cudaSuccess) e = cudaLibraryGetKernel(&k_flag, d->lib, "avgpipe__cu_flag");
    /* cudaLaunchKernel takes a cudaKernel_t in place of a kernel's address (CUDA >= 12.8) */
    d->k_ea = (const void *)k_ea, d->k_nonfinite = (const void *)k_nonfinite, d->k_scale = (const void *)k_scale;
    d->k_flag = (const void *)k_flag;
    if (e != cudaSuccess) {
        r = avgpipe__cuda_fail(d->name, e, "create", d->lib ? "cudaLibraryGetKernel" : "cudaLibraryLoadData");
        return avgpipe_set_error(ctx, r, "avgpipe_device_cuda_create: %s", avgpipe__cuda_err);
    }
    return AVGPIPE_OK;
}
#else
/* nvcc compiled the kernels into the program. */
static avgpipe_result avgpipe__cuda_kernels(avgpipe_context *ctx, avgpipe__cuda *d) {
    (void)ctx;
    d->k_ea = (const void *)avgpipe__cu_ea;
    d->k_nonfinite = (const void *)avgpipe__cu_nonfinite;
    d->k_scale = (const void *)avgpipe__cu_scale;
    d->k_flag = (const void *)avgpipe__cu_flag;
    snprintf(d->info.kernels, sizeof d->info.kernels, "nvcc");
    d->info.nvrtc = 0;
    return AVGPIPE_OK;
}
#endif

/* --- Creation ------------------------------------------------------------------------------------------ */

/* Release what creation got so far (any prefix of it). */
static void avgpipe__cuda_release(avgpipe__cuda *d) {
    avgpipe_allocator al = d->allocator;
    size_t k;
    if (cudaSetDevice(d->ordinal) == cudaSuccess) {
        for (k = 0; k < d->tw_cap; k++) /* the twins of events still alive (those are the caller's) */
            if (d->tw_key[k]) (void)cudaEventDestroy(d->tw_val[k]);
        if (d->d_slots) (void)cudaFree(d->d_slots);
        if (d->h_slots) (void)cudaFreeHost(d->h_slots);
#ifdef AVGPIPE_CUDA_NVRTC
        if (d->lib) (void)cudaLibraryUnload(d->lib);
#endif
    }
    (void)cudaGetLastError();
#ifdef AVGPIPE_CUDA_NVRTC
    al.free(d->image, al.user);
#endif
    if (d->sync_ready) {
        pthread_cond_destroy(&d->cv);
        pthread_mutex_destroy(&d->mu);
    }
    al.free(d->streams, al.user); /* streams still alive are the caller's to destroy (before the table) */
    al.free(d->tw_key, al.user);
    al.free(d->tw_val, al.user);
    al.free(d->anchors, al.user);
    d->magic = 0;
    al.free(d, al.user);
}
static void avgpipe__cuda_destroy(void *user) { avgpipe__cuda_release((avgpipe__cuda *)user); }

AVGPIPE_API avgpipe_device_cuda_desc avgpipe_device_cuda_query_defaults(const avgpipe_device_cuda_desc *desc) {
    avgpipe_device_cuda_desc d;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if (d.block_size == 0) d.block_size = 256;
    if (d.timeout_s == 0) d.timeout_s = AVGPIPE__CUDA_DEFAULT_TIMEOUT_S;
    return d;
}

/* The device's properties (the grids come from the kernels: avgpipe__cuda_occupancy). */
static avgpipe_result avgpipe__cuda_probe(avgpipe_context *ctx, avgpipe__cuda *d) {
    cudaError_t e = cudaSetDevice(d->ordinal);
    const char *call = "cudaSetDevice";
    if (e == cudaSuccess) call = "cudaDeviceGetAttribute";
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&d->info.multiprocessors, cudaDevAttrMultiProcessorCount, d->ordinal);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&d->info.cc_major, cudaDevAttrComputeCapabilityMajor, d->ordinal);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&d->info.cc_minor, cudaDevAttrComputeCapabilityMinor, d->ordinal);
    if (e != cudaSuccess) {
        avgpipe_result r = avgpipe__cuda_fail(d->name, e, "create", call);
        return avgpipe_set_error(ctx, r, "avgpipe_device_cuda_create: %s", avgpipe__cuda_err);
    }
    return AVGPIPE_OK;
}

/* Each kernel's grid from its occupancy (see GRIDS): per_sm[k] blocks of kernel k fit one multiprocessor,
   so multiprocessors x per_sm[k] run at once; desc.max_blocks, when set, instead. The resolved
   desc.max_blocks is the largest grid. */
static void avgpipe__cuda_grids(avgpipe_device_cuda_info *info, const int *per_sm) {
    const int given = info->desc.max_blocks;
    int k, top = 1;
    for (k = 0; k < AVGPIPE_DEVICE_CUDA_KERNEL_COUNT; k++) {
        long long g = given > 0 ? (long long)given : (long long)info->multiprocessors * per_sm[k];
        if (g < 1) g = 1;
        if (g > INT_MAX) g = INT_MAX;
        info->blocks_per_sm[k] = per_sm[k];
        info->grid[k] = (int)g;
        if (info->grid[k] > top) top = info->grid[k];
    }
    info->desc.max_blocks = given > 0 ? given : top;
}

/* How the occupancy is asked (a parameter, so that tests can answer for a GPU they do not have). */
typedef cudaError_t (*avgpipe__cuda_occupancy_fn)(int *blocks, const void *kernel, int block_size);
static cudaError_t avgpipe__cuda_occupancy_cuda(int *blocks, const void *kernel, int block_size) {
    /* a cudaKernel_t (NVRTC's kernels) is taken in place of a kernel's address, as by cudaLaunchKernel */
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, block_size, (size_t)0);
}

/* Ask each kernel's occupancy at desc.block_size (current device: d's), once, and resolve the grids. A
   kernel no block of which fits (too many registers for that block size) refuses the description. */
static avgpipe_result avgpipe__cuda_occupancy(avgpipe_context *ctx, avgpipe__cuda *d, avgpipe__cuda_occupancy_fn occupancy) {
    static const char *const names[AVGPIPE_DEVICE_CUDA_KERNEL_COUNT] = {"avgpipe__cu_ea (ea_pass)", "avgpipe__cu_nonfinite (find_nonfinite)",
                                                                        "avgpipe__cu_scale (scale)", "avgpipe__cu_flag (flag_nonfinite)"};
    const void *kernels[AVGPIPE_DEVICE_CUDA_KERNEL_COUNT];
    int per_sm[AVGPIPE_DEVICE_CUDA_KERNEL_COUNT], k;
    kernels[AVGPIPE_DEVICE_CUDA_KERNEL_EA] = d->k_ea;
    kernels[AVGPIPE_DEVICE_CUDA_KERNEL_NONFINITE] = d->k_nonfinite;
    kernels[AVGPIPE_DEVICE_CUDA_KERNEL_SCALE] = d->k_scale;
    kernels[AVGPIPE_DEVICE_CUDA_KERNEL_FLAG] = d->k_flag;
    for (k = 0; k < AVGPIPE_DEVICE_CUDA_KERNEL_COUNT; k++) {
        cudaError_t e;
        per_sm[k] = 0;
        if ((e = occupancy(&per_sm[k], kernels[k], d->info.desc.block_size)) != cudaSuccess) {
            avgpipe_result r = avgpipe__cuda_fail(d->name, e, "create", "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
            return avgpipe_set_error(ctx, r, "avgpipe_device_cuda_create: %s (kernel %s)", avgpipe__cuda_err, names[k]);
        }
        if (per_sm[k] < 1)
            return avgpipe_set_error(ctx, AVGPIPE_BACKEND_ERROR,
                                     "avgpipe_device_cuda_create: %s: kernel %s cannot run blocks of %d threads on this GPU (none fits "
                                     "a multiprocessor: too many registers for that block size): a smaller desc.block_size",
                                     d->name, names[k], d->info.desc.block_size);
    }
    avgpipe__cuda_grids(&d->info, per_sm);
    return AVGPIPE_OK;
}

/* The find_nonfinite result slots (device and pinned host memory) and their lock. */
static avgpipe_result avgpipe__cuda_slots(avgpipe_context *ctx, avgpipe__cuda *d) {
    const size_t bytes = AVGPIPE__CUDA_SLOTS * sizeof(unsigned long long);
    cudaError_t e = cudaMalloc((void **)&d->d_slots, bytes);
    const char *call = "cudaMalloc";
    if (e == cudaSuccess) {
        call = "cudaHostAlloc";
        e = cudaHostAlloc((void **)&d->h_slots, bytes, cudaHostAllocPortable);
    }
    if (e != cudaSuccess) {
        avgpipe_result r = avgpipe__cuda_fail(d->name, e, "create", call);
        return avgpipe_set_error(ctx, r, "avgpipe_device_cuda_create: %s", avgpipe__cuda_err);
    }
    if (pthread_mutex_init(&d->mu, NULL) != 0) return avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_device_cuda_create: pthread_mutex_init failed");
    if (pthread_cond_init(&d->cv, NULL) != 0) {
        pthread_mutex_destroy(&d->mu);
        return avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_device_cuda_create: pthread_cond_init failed");
    }
    d->sync_ready = 1;
    d->slot_free = ~(uint64_t)0;
    return AVGPIPE_OK;
}

static void avgpipe__cuda_fill(avgpipe_device *out, avgpipe__cuda *d) {
    out->name = d->name;
    out->alloc_overhead = AVGPIPE_DEVICE_CUDA_ALLOC_OVERHEAD;
    out->alloc = avgpipe__cuda_alloc;
    out->free = avgpipe__cuda_free;
    out->copy = avgpipe__cuda_copy;
    out->memset = avgpipe__cuda_memset;
    out->stream_create = avgpipe__cuda_stream_create;
    out->stream_destroy = avgpipe__cuda_stream_destroy;
    out->stream_synchronize = avgpipe__cuda_stream_sync;
    out->event_create = avgpipe__cuda_event_create;
    out->event_destroy = avgpipe__cuda_event_destroy;
    out->event_record = avgpipe__cuda_event_record;
    out->stream_wait_event = avgpipe__cuda_stream_wait;
    out->event_synchronize = avgpipe__cuda_event_sync;
    out->synchronize = avgpipe__cuda_sync;
    out->ea_pass = avgpipe__cuda_ea_pass;
    out->find_nonfinite = avgpipe__cuda_find_nonfinite;
    out->scale = avgpipe__cuda_scale;
    out->flag_nonfinite = avgpipe__cuda_flag_nonfinite;
    out->event_query = avgpipe__cuda_event_query;
    out->event_elapsed = d->info.desc.no_timing ? NULL : avgpipe__cuda_event_elapsed;
    d->twins = !d->info.desc.no_timing && !d->info.desc.timed_events; /* see TIMING */
    out->error_string = avgpipe__cuda_error_string;
    out->destroy = avgpipe__cuda_destroy;
    out->user = d;
}

AVGPIPE_API avgpipe_result avgpipe_device_cuda_create(avgpipe_context *ctx, const avgpipe_device_cuda_desc *desc,
                                                      avgpipe_device *out) {
    avgpipe_device_cuda_desc dd = avgpipe_device_cuda_query_defaults(desc);
    avgpipe_allocator al = avgpipe_context_query(ctx).allocator;
    avgpipe__cuda *d;
    avgpipe_result r;
    cudaError_t e;
    int count = 0;
    if (!out) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_cuda_create: out is NULL");
    memset(out, 0, sizeof *out);
    if (dd.device < 0) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_cuda_create: desc.device is %d (>= 0)", dd.device);
    if (dd.block_size < 32 || dd.block_size > 1024 || dd.block_size % 32)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG,
                                 "avgpipe_device_cuda_create: desc.block_size is %d (a multiple of 32 in 32..1024, 0 = 256)", dd.block_size);
    if (dd.max_blocks < 0)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_cuda_create: desc.max_blocks is %d (>= 0)", dd.max_blocks);
    if (!(dd.timeout_s > 0)) /* negative, or NaN */
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_cuda_create: desc.timeout_s is %g (> 0 seconds, 0 = 300)",
                                 dd.timeout_s);
    if (dd.no_timing && dd.timed_events)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG,
                                 "avgpipe_device_cuda_create: desc.no_timing and desc.timed_events are both set (no event timed, or every one)");
    if ((e = cudaGetDeviceCount(&count)) != cudaSuccess) {
        r = avgpipe__cuda_fail("cuda", e, "create", "cudaGetDeviceCount");
        return avgpipe_set_error(ctx, r, "avgpipe_device_cuda_create: cuda:%d: cudaGetDeviceCount: %s (%s)", dd.device,
                                 cudaGetErrorString(e), cudaGetErrorName(e));
    }
    if (dd.device >= count)
        return avgpipe_set_error(ctx, AVGPIPE_BACKEND_ERROR, "avgpipe_device_cuda_create: cuda:%d: no such device (%d CUDA device%s)",
                                 dd.device, count, count == 1 ? "" : "s");
    if (!(d = (avgpipe__cuda *)al.alloc(sizeof *d, al.user)))
        return avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_device_cuda_create: out of memory");
    memset(d, 0, sizeof *d);
    d->magic = AVGPIPE__CUDA_MAGIC;
    d->allocator = al;
    d->ordinal = dd.device;
    d->info.desc = dd;
    d->info.max_connections = avgpipe__cuda_connections(getenv("CUDA_DEVICE_MAX_CONNECTIONS"));
    {
        avgpipe_context_desc cdesc = avgpipe_context_query(ctx);
        d->log = cdesc.log, d->log_user = cdesc.log_user, d->log_level = cdesc.log_level;
    }
    snprintf(d->name, sizeof d->name, "cuda:%d", dd.device);
    if ((r = avgpipe__cuda_probe(ctx, d)) != AVGPIPE_OK || (r = avgpipe__cuda_kernels(ctx, d)) != AVGPIPE_OK ||
        (r = avgpipe__cuda_occupancy(ctx, d, avgpipe__cuda_occupancy_cuda)) != AVGPIPE_OK ||
        (r = avgpipe__cuda_slots(ctx, d)) != AVGPIPE_OK) {
        avgpipe__cuda_release(d);
        return r;
    }
    avgpipe__cuda_fill(out, d);
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_device_cuda_query(avgpipe_context *ctx, const avgpipe_device *dev,
                                                     avgpipe_device_cuda_info *out) {
    const avgpipe__cuda *d;
    if (!dev || !out) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_cuda_query: %s is NULL", !dev ? "dev" : "out");
    d = (const avgpipe__cuda *)dev->user;
    if (dev->destroy != avgpipe__cuda_destroy || !d || d->magic != AVGPIPE__CUDA_MAGIC)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_device_cuda_query: device '%s' is not a CUDA device of this implementation",
                                 dev->name ? dev->name : "?");
    *out = d->info;
    return AVGPIPE_OK;
}

#ifdef __cplusplus
}
#endif
#endif /* AVGPIPE_CUDA_IMPLEMENTATION */
