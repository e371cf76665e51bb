/* nccl_emu.h — the CUDA runtime and NCCL, as avgpipe_nccl.h calls them, emulated on the host: the backend's
   creation, transfers, groups, collectives, splits, polls, cancel and destroy run in a test without a GPU,
   its ranks as threads of one process.

   HOW IT PLUGS IN
   The backend calls the CUDA runtime and NCCL by their plain names. Included the first time (after
   <cuda_runtime_api.h> and <nccl.h>, before avgpipe_nccl.h and its implementation), this file renames each
   of those calls to an emu_ function of the same signature; included again with NCCL_EMU_DEFINE defined
   (after avgpipe_nccl.h), it ends the renaming and defines the emu_ functions. Code after the second
   inclusion calls the real functions by their names and the emulation by its emu_ names.

       #include <cuda_runtime_api.h>
       #include <nccl.h>
       #include "tests/nccl_emu.h"
       #define AVGPIPE_IMPLEMENTATION
       #include "avgpipe.h"
       #include "avgpipe_nccl.h"
       #define NCCL_EMU_DEFINE
       #include "tests/nccl_emu.h"

   Until emu_begin (and after emu_end) every emu_ function is the real call: the tests that need CUDA's own
   answers (creation failing without a GPU) see them. Between the two, the emulation answers:

   - Devices: emu_begin's count. The current device is per host thread (cudaSetDevice, cudaGetDevice).
   - The last error, as the runtime keeps it: per host thread, set by every call that returns an error
     (cudaErrorNotReady from cudaStreamQuery and cudaEventQuery included), returned and reset to cudaSuccess
     by cudaGetLastError, returned by cudaPeekAtLastError. A successful call leaves it as it is.
     emu_threads lists it for every thread that called the emulation.
   - Device memory is host memory (cudaMalloc, cudaMallocAsync) that cudaPointerGetAttributes knows as the
     allocating device's; any other pointer is unregistered host memory. Copies and memsets must name
     device memory where their kind says so, NCCL buffers must be device memory.
   - Streams run their work in order, lazily: copies, memsets, frees, event records, waits for events and
     NCCL operations run when a query (cudaStreamQuery, cudaEventQuery, ncclCommGetAsyncError) makes the
     emulated GPU progress. A query answers cudaErrorNotReady `polls` times after new work was queued (on
     the stream, or an event record) before it may answer cudaSuccess, even when the work has run: every
     poll loop sees "not ready" at least `polls` times.
   - NCCL (nonblocking communicators only): a communicator from an id is ready once every one of its
     nranks joined; a split once every rank of the parent split (rank and size of the child by color and
     key); init, split, group end and finalize return ncclInProgress, and ncclCommGetAsyncError then says
     ncclInProgress `polls` times. ncclCommGetAsyncError touches no CUDA state (in NCCL it reads an atomic).
     Point-to-point: a send is buffered when it runs, a receive takes its peer's next message on that
     communicator (the sizes must match). The calls of one group on one stream run as one operation (a
     group's receive does not hold back its sends), calls outside a group each as its own group.
     ncclAllReduce (ncclSum of floats or int32, added in rank order) and ncclAllGather finish when every
     rank's call has run. ncclCommAbort and ncclCommDestroy retire the communicator.
   - Anything inconsistent (a message of another size, an unknown handle, a buffer that is not device
     memory, something not emulated) is a problem: emu_problems returns how many and the first one's text.
   - emu_inject(e): the calling thread's next cudaEventQuery returns e (a real error).
   - emu_live: allocations, streams and events not freed or destroyed (what the backend left behind).
   One mutex guards it all; the emulated GPU progresses under it, on the threads that query. */

#ifndef NCCL_EMU_DEFINE
#ifndef NCCL_EMU_RENAMED
#define NCCL_EMU_RENAMED

static cudaError_t emu_cudaGetDeviceCount(int *count);
static cudaError_t emu_cudaSetDevice(int device);
static cudaError_t emu_cudaGetDevice(int *device);
static cudaError_t emu_cudaGetLastError(void);
static cudaError_t emu_cudaPeekAtLastError(void);
static cudaError_t emu_cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags);
static cudaError_t emu_cudaStreamDestroy(cudaStream_t stream);
static cudaError_t emu_cudaStreamQuery(cudaStream_t stream);
static cudaError_t emu_cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
static cudaError_t emu_cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
static cudaError_t emu_cudaEventDestroy(cudaEvent_t event);
static cudaError_t emu_cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
static cudaError_t emu_cudaEventQuery(cudaEvent_t event);
static cudaError_t emu_cudaMalloc(void **ptr, size_t size);
static cudaError_t emu_cudaFree(void *ptr);
static cudaError_t emu_cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream);
static cudaError_t emu_cudaFreeAsync(void *ptr, cudaStream_t stream);
static cudaError_t emu_cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream);
static cudaError_t emu_cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t stream);
static cudaError_t emu_cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr);

static ncclResult_t emu_ncclGetUniqueId(ncclUniqueId *id);
static ncclResult_t emu_ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config);
static ncclResult_t emu_ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config);
static ncclResult_t emu_ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
static const char *emu_ncclGetLastError(ncclComm_t comm);
static ncclResult_t emu_ncclCommFinalize(ncclComm_t comm);
static ncclResult_t emu_ncclCommDestroy(ncclComm_t comm);
static ncclResult_t emu_ncclCommAbort(ncclComm_t comm);
static ncclResult_t emu_ncclCommUserRank(const ncclComm_t comm, int *rank);
static ncclResult_t emu_ncclCommCount(const ncclComm_t comm, int *count);
static ncclResult_t emu_ncclCommCuDevice(const ncclComm_t comm, int *device);
static ncclResult_t emu_ncclGroupStart(void);
static ncclResult_t emu_ncclGroupEnd(void);
static ncclResult_t emu_ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream);
static ncclResult_t emu_ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream);
static ncclResult_t emu_ncclAllReduce(const void *in, void *out, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream);
static ncclResult_t emu_ncclAllGather(const void *in, void *out, size_t count, ncclDataType_t type, ncclComm_t comm, cudaStream_t stream);

/* (cudaGetErrorString, cudaGetErrorName and ncclGetErrorString stay the real ones: they only look up text.) */
#undef cudaGetDeviceCount
#undef cudaSetDevice
#undef cudaGetDevice
#undef cudaGetLastError
#undef cudaPeekAtLastError
#undef cudaStreamCreateWithFlags
#undef cudaStreamDestroy
#undef cudaStreamQuery
#undef cudaStreamWaitEvent
#undef cudaEventCreateWithFlags
#undef cudaEventDestroy
#undef cudaEventRecord
#undef cudaEventQuery
#undef cudaMalloc
#undef cudaFree
#undef cudaMallocAsync
#undef cudaFreeAsync
#undef cudaMemcpyAsync
#undef cudaMemsetAsync
#undef cudaPointerGetAttributes
#define cudaGetDeviceCount emu_cudaGetDeviceCount
#define cudaSetDevice emu_cudaSetDevice
#define cudaGetDevice emu_cudaGetDevice
#define cudaGetLastError emu_cudaGetLastError
#define cudaPeekAtLastError emu_cudaPeekAtLastError
#define cudaStreamCreateWithFlags emu_cudaStreamCreateWithFlags
#define cudaStreamDestroy emu_cudaStreamDestroy
#define cudaStreamQuery emu_cudaStreamQuery
#define cudaStreamWaitEvent emu_cudaStreamWaitEvent
#define cudaEventCreateWithFlags emu_cudaEventCreateWithFlags
#define cudaEventDestroy emu_cudaEventDestroy
#define cudaEventRecord emu_cudaEventRecord
#define cudaEventQuery emu_cudaEventQuery
#define cudaMalloc emu_cudaMalloc
#define cudaFree emu_cudaFree
#define cudaMallocAsync emu_cudaMallocAsync
#define cudaFreeAsync emu_cudaFreeAsync
#define cudaMemcpyAsync emu_cudaMemcpyAsync
#define cudaMemsetAsync emu_cudaMemsetAsync
#define cudaPointerGetAttributes emu_cudaPointerGetAttributes
#define ncclGetUniqueId emu_ncclGetUniqueId
#define ncclCommInitRankConfig emu_ncclCommInitRankConfig
#define ncclCommSplit emu_ncclCommSplit
#define ncclCommGetAsyncError emu_ncclCommGetAsyncError
#define ncclGetLastError emu_ncclGetLastError
#define ncclCommFinalize emu_ncclCommFinalize
#define ncclCommDestroy emu_ncclCommDestroy
#define ncclCommAbort emu_ncclCommAbort
#define ncclCommUserRank emu_ncclCommUserRank
#define ncclCommCount emu_ncclCommCount
#define ncclCommCuDevice emu_ncclCommCuDevice
#define ncclGroupStart emu_ncclGroupStart
#define ncclGroupEnd emu_ncclGroupEnd
#define ncclSend emu_ncclSend
#define ncclRecv emu_ncclRecv
#define ncclAllReduce emu_ncclAllReduce
#define ncclAllGather emu_ncclAllGather
#endif /* NCCL_EMU_RENAMED */

#else /* NCCL_EMU_DEFINE: the renaming ends here; the emulation */
#ifndef NCCL_EMU_DEFINED
#define NCCL_EMU_DEFINED

#undef cudaGetDeviceCount
#undef cudaSetDevice
#undef cudaGetDevice
#undef cudaGetLastError
#undef cudaPeekAtLastError
#undef cudaStreamCreateWithFlags
#undef cudaStreamDestroy
#undef cudaStreamQuery
#undef cudaStreamWaitEvent
#undef cudaEventCreateWithFlags
#undef cudaEventDestroy
#undef cudaEventRecord
#undef cudaEventQuery
#undef cudaMalloc
#undef cudaFree
#undef cudaMallocAsync
#undef cudaFreeAsync
#undef cudaMemcpyAsync
#undef cudaMemsetAsync
#undef cudaPointerGetAttributes
#undef ncclGetUniqueId
#undef ncclCommInitRankConfig
#undef ncclCommSplit
#undef ncclCommGetAsyncError
#undef ncclGetLastError
#undef ncclCommFinalize
#undef ncclCommDestroy
#undef ncclCommAbort
#undef ncclCommUserRank
#undef ncclCommCount
#undef ncclCommCuDevice
#undef ncclGroupStart
#undef ncclGroupEnd
#undef ncclSend
#undef ncclRecv
#undef ncclAllReduce
#undef ncclAllGather

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EMU_MAX_THREADS 64
#define EMU_MAX_RANKS 16
#define EMU_KEY 96
#define EMU_MAGIC_STREAM 0x53545245u
#define EMU_MAGIC_EVENT 0x45564e54u
#define EMU_MAGIC_COMM 0x434f4d4du

enum { EMU_SEND, EMU_RECV, EMU_ALLREDUCE, EMU_ALLGATHER };         /* NCCL operations */
enum { EMU_COPY, EMU_SET, EMU_FREE, EMU_RECORD, EMU_WAIT, EMU_GROUP }; /* stream work */

typedef struct emu_stream emu_stream;
typedef struct emu_event emu_event;
typedef struct emu_comm emu_comm;

typedef struct emu_sub { /* one NCCL operation */
    struct emu_sub *next;
    int kind;
    char key[EMU_KEY]; /* the communicator, as every rank names it */
    int rank, size, peer;
    const void *in;
    void *out;
    size_t bytes; /* send, receive: the message; collectives: one rank's part */
    ncclDataType_t type;
    unsigned long seq; /* collectives: the communicator's how-many-th */
    int contributed, done;
    emu_stream *stream; /* while the open group holds it */
    emu_comm *comm;
} emu_sub;

typedef struct emu_op { /* one piece of stream work */
    struct emu_op *next;
    int kind;
    void *dst;
    const void *src;
    size_t n;
    int value;
    emu_event *ev;
    unsigned long gen;
    emu_sub *subs; /* EMU_GROUP */
} emu_op;

struct emu_stream {
    unsigned magic;
    int device, dead, not_ready_left;
    emu_op *head, *tail;
    emu_stream *all;
};

struct emu_event {
    unsigned magic;
    int dead, not_ready_left;
    unsigned long gen, done_gen; /* records made, records reached */
    emu_event *all;
};

typedef struct emu_alloc {
    struct emu_alloc *next;
    unsigned char *p;
    size_t n;
    int device;
} emu_alloc;

typedef struct emu_msg {
    struct emu_msg *next;
    char key[EMU_KEY];
    int src, dst;
    size_t n;
    unsigned char data[];
} emu_msg;

typedef struct emu_coll { /* one collective, gathering every rank's part */
    struct emu_coll *next;
    char key[EMU_KEY];
    unsigned long seq;
    int kind, size, arrived, departed;
    size_t bytes;
    ncclDataType_t type;
    unsigned char *part;
} emu_coll;

typedef struct emu_family { /* the ranks joining a communicator: by id, or by splitting a parent */
    struct emu_family *next;
    char key[EMU_KEY];
    int size, joined, split;
    unsigned char in[EMU_MAX_RANKS];
    int color[EMU_MAX_RANKS], skey[EMU_MAX_RANKS];
} emu_family;

struct emu_comm {
    unsigned magic;
    char key[EMU_KEY];
    int rank, size, device, busy, gone;
    unsigned long nsplit, nseq;
    emu_family *wait; /* not ready while its family is incomplete */
    int color, skey, prank; /* a split child's color and key, its parent rank */
    emu_comm *all;
};

typedef struct emu_thread {
    int gen;
    cudaError_t last;  /* the last error, as cudaGetLastError would return it on this thread */
    cudaError_t inject;
    int device, group;
    emu_sub *pending; /* the open group's operations, in call order */
    long calls, not_ready;
} emu_thread;

/* What emu_threads reports of one thread. */
typedef struct emu_thread_info {
    cudaError_t last;
    long calls, not_ready;
} emu_thread_info;

static pthread_mutex_t emu_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int emu_on;
static int emu_gen, emu_ndev, emu_polls;
static emu_thread emu_threads_[EMU_MAX_THREADS];
static int emu_nthreads;
static _Thread_local int emu_tls_gen, emu_tls_slot;
static emu_stream *emu_streams;
static emu_event *emu_events;
static emu_comm *emu_comms;
static emu_alloc *emu_allocs;
static emu_msg *emu_msgs;
static emu_coll *emu_colls;
static emu_family *emu_families;
static int emu_nproblems;
static char emu_problem[400];
static unsigned emu_ids;

static void emu_problemf(const char *fmt, ...) {
    va_list ap;
    if (emu_nproblems++) return;
    va_start(ap, fmt);
    vsnprintf(emu_problem, sizeof emu_problem, fmt, ap);
    va_end(ap);
}

/* The calling thread's record (emu_mu held). */
static emu_thread *emu_me(void) {
    emu_thread *t;
    if (emu_tls_gen != emu_gen) {
        if (emu_nthreads == EMU_MAX_THREADS) {
            fprintf(stderr, "nccl_emu: more than %d threads\n", EMU_MAX_THREADS);
            abort();
        }
        emu_tls_slot = emu_nthreads++;
        emu_tls_gen = emu_gen;
        t = &emu_threads_[emu_tls_slot];
        memset(t, 0, sizeof *t);
        t->gen = emu_gen;
        t->last = cudaSuccess;
        t->inject = cudaSuccess;
    }
    return &emu_threads_[emu_tls_slot];
}

/* A call's result, recorded as the thread's last error when it is one (as the runtime does). */
static cudaError_t emu_ret(emu_thread *t, cudaError_t e) {
    if (e != cudaSuccess) t->last = e;
    if (e == cudaErrorNotReady) t->not_ready++;
    return e;
}

#define EMU_ENTER()                     \
    emu_thread *t;                      \
    pthread_mutex_lock(&emu_mu);        \
    t = emu_me();                       \
    t->calls++
#define EMU_LEAVE(e)                              \
    do {                                          \
        cudaError_t r_ = emu_ret(t, (e));         \
        pthread_mutex_unlock(&emu_mu);            \
        return r_;                                \
    } while (0)
#define EMU_NLEAVE(r)                  \
    do {                               \
        ncclResult_t r_ = (r);         \
        pthread_mutex_unlock(&emu_mu); \
        return r_;                     \
    } while (0)

/* ---- handles and memory ---- */

static emu_stream *emu_stream_of(cudaStream_t s, const char *what) {
    emu_stream *p;
    for (p = emu_streams; p; p = p->all)
        if ((void *)p == (void *)s && p->magic == EMU_MAGIC_STREAM && !p->dead) return p;
    emu_problemf("%s: stream %p is not a live emulated stream%s", what, (void *)s, s ? "" : " (the default stream is not emulated)");
    return NULL;
}

static emu_event *emu_event_of(cudaEvent_t e, const char *what) {
    emu_event *p;
    for (p = emu_events; p; p = p->all)
        if ((void *)p == (void *)e && p->magic == EMU_MAGIC_EVENT && !p->dead) return p;
    emu_problemf("%s: event %p is not a live emulated event", what, (void *)e);
    return NULL;
}

static emu_comm *emu_comm_of(ncclComm_t c, const char *what) {
    emu_comm *p;
    for (p = emu_comms; p; p = p->all)
        if ((void *)p == (void *)c && p->magic == EMU_MAGIC_COMM && !p->gone) return p;
    emu_problemf("%s: communicator %p is not a live emulated one", what, (void *)c);
    return NULL;
}

/* The allocation [p, p + n) lies in, or NULL. */
static emu_alloc *emu_alloc_of(const void *p, size_t n) {
    emu_alloc *a;
    for (a = emu_allocs; a; a = a->next)
        if ((const unsigned char *)p >= a->p && (const unsigned char *)p + n <= a->p + a->n) return a;
    return NULL;
}

static emu_alloc *emu_alloc_new(size_t n, int device) {
    emu_alloc *a = (emu_alloc *)calloc(1, sizeof *a);
    if (!a) return NULL;
    a->p = (unsigned char *)malloc(n ? n : 1);
    if (!a->p) {
        free(a);
        return NULL;
    }
    a->n = n, a->device = device;
    a->next = emu_allocs, emu_allocs = a;
    return a;
}

static void emu_alloc_free(void *p, const char *what) {
    emu_alloc **pp;
    for (pp = &emu_allocs; *pp; pp = &(*pp)->next)
        if ((*pp)->p == p) {
            emu_alloc *a = *pp;
            *pp = a->next;
            free(a->p);
            free(a);
            return;
        }
    emu_problemf("%s: %p is not emulated device memory", what, p);
}

/* ---- the emulated GPU ---- */

static void emu_enqueue(emu_stream *s, emu_op *o) {
    if (s->tail) s->tail->next = o;
    else s->head = o;
    s->tail = o;
    s->not_ready_left = emu_polls;
}

static emu_op *emu_op_new(int kind) {
    emu_op *o = (emu_op *)calloc(1, sizeof *o);
    if (!o) abort();
    o->kind = kind;
    return o;
}

static void emu_op_free(emu_op *o) {
    while (o->subs) {
        emu_sub *u = o->subs;
        o->subs = u->next;
        free(u);
    }
    free(o);
}

static size_t emu_type_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}

static emu_coll *emu_coll_of(const emu_sub *u) {
    emu_coll *c;
    for (c = emu_colls; c; c = c->next)
        if (c->seq == u->seq && !strcmp(c->key, u->key)) break;
    if (!c) {
        c = (emu_coll *)calloc(1, sizeof *c);
        if (!c) abort();
        snprintf(c->key, sizeof c->key, "%s", u->key);
        c->seq = u->seq, c->kind = u->kind, c->size = u->size, c->bytes = u->bytes, c->type = u->type;
        c->part = (unsigned char *)calloc((size_t)u->size, u->bytes ? u->bytes : 1);
        if (!c->part) abort();
        c->next = emu_colls, emu_colls = c;
    }
    if (c->kind != u->kind || c->size != u->size || c->bytes != u->bytes || c->type != u->type)
        emu_problemf("collective %lu of %s: rank %d calls %s of %zu bytes, another rank %s of %zu bytes", u->seq, u->key, u->rank,
                     u->kind == EMU_ALLREDUCE ? "ncclAllReduce" : "ncclAllGather", u->bytes,
                     c->kind == EMU_ALLREDUCE ? "ncclAllReduce" : "ncclAllGather", c->bytes);
    return c;
}

/* Run one NCCL operation if it can: 1 when it has finished. */
static int emu_sub_run(emu_sub *u) {
    if (u->kind == EMU_SEND) {
        emu_msg *m = (emu_msg *)malloc(sizeof *m + (u->bytes ? u->bytes : 1)), **pp;
        if (!m) abort();
        m->next = NULL;
        snprintf(m->key, sizeof m->key, "%s", u->key);
        m->src = u->rank, m->dst = u->peer, m->n = u->bytes;
        if (u->bytes) memcpy(m->data, u->in, u->bytes);
        for (pp = &emu_msgs; *pp; pp = &(*pp)->next) {}
        *pp = m;
        return 1;
    }
    if (u->kind == EMU_RECV) {
        emu_msg **pp;
        for (pp = &emu_msgs; *pp; pp = &(*pp)->next)
            if ((*pp)->src == u->peer && (*pp)->dst == u->rank && !strcmp((*pp)->key, u->key)) {
                emu_msg *m = *pp;
                if (m->n != u->bytes)
                    emu_problemf("%s: rank %d receives %zu bytes from rank %d, which sent %zu", u->key, u->rank, u->bytes, u->peer, m->n);
                memcpy(u->out, m->data, m->n < u->bytes ? m->n : u->bytes);
                *pp = m->next;
                free(m);
                return 1;
            }
        return 0;
    }
    {
        emu_coll *c = emu_coll_of(u), **pp;
        size_t i, n;
        int r;
        if (!u->contributed) {
            memcpy(c->part + (size_t)u->rank * c->bytes, u->in, c->bytes);
            c->arrived++;
            u->contributed = 1;
        }
        if (c->arrived < c->size) return 0;
        if (u->kind == EMU_ALLGATHER) {
            memcpy(u->out, c->part, c->bytes * (size_t)c->size);
        } else if (c->type == ncclFloat32) {
            n = c->bytes / sizeof(float);
            for (i = 0; i < n; i++) {
                float s = 0, v;
                for (r = 0; r < c->size; r++) memcpy(&v, c->part + (size_t)r * c->bytes + i * sizeof v, sizeof v), s += v;
                memcpy((unsigned char *)u->out + i * sizeof s, &s, sizeof s);
            }
        } else {
            n = c->bytes / sizeof(int32_t);
            for (i = 0; i < n; i++) {
                int32_t s = 0, v;
                for (r = 0; r < c->size; r++) memcpy(&v, c->part + (size_t)r * c->bytes + i * sizeof v, sizeof v), s += v;
                memcpy((unsigned char *)u->out + i * sizeof s, &s, sizeof s);
            }
        }
        if (++c->departed == c->size) {
            for (pp = &emu_colls; *pp != c; pp = &(*pp)->next) {}
            *pp = c->next;
            free(c->part);
            free(c);
        }
        return 1;
    }
}

/* Run one piece of stream work if it can: 1 when it has finished. */
static int emu_op_run(emu_op *o) {
    emu_sub *u;
    int all = 1;
    switch (o->kind) {
    case EMU_COPY: memmove(o->dst, o->src, o->n); return 1;
    case EMU_SET: memset(o->dst, o->value, o->n); return 1;
    case EMU_FREE: emu_alloc_free(o->dst, "cudaFreeAsync"); return 1;
    case EMU_RECORD:
        if (o->ev->done_gen < o->gen) o->ev->done_gen = o->gen;
        return 1;
    case EMU_WAIT: return o->ev->done_gen >= o->gen;
    default:
        for (u = o->subs; u; u = u->next)
            if (!u->done && !(u->done = emu_sub_run(u))) all = 0;
        return all;
    }
}

/* Let every live stream run what it can (emu_mu held). */
static void emu_progress(void) {
    int changed = 1;
    while (changed) {
        emu_stream *s;
        changed = 0;
        for (s = emu_streams; s; s = s->all)
            while (!s->dead && s->head && emu_op_run(s->head)) {
                emu_op *o = s->head;
                s->head = o->next;
                if (!s->head) s->tail = NULL;
                emu_op_free(o);
                changed = 1;
            }
    }
}

/* ---- the CUDA runtime ---- */

static cudaError_t emu_cudaGetDeviceCount(int *count) {
    if (!atomic_load(&emu_on)) return cudaGetDeviceCount(count);
    {
        EMU_ENTER();
        if (!count) EMU_LEAVE(cudaErrorInvalidValue);
        *count = emu_ndev;
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaSetDevice(int device) {
    if (!atomic_load(&emu_on)) return cudaSetDevice(device);
    {
        EMU_ENTER();
        if (device < 0 || device >= emu_ndev) EMU_LEAVE(cudaErrorInvalidDevice);
        t->device = device;
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaGetDevice(int *device) {
    if (!atomic_load(&emu_on)) return cudaGetDevice(device);
    {
        EMU_ENTER();
        if (!device) EMU_LEAVE(cudaErrorInvalidValue);
        *device = t->device;
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaGetLastError(void) {
    if (!atomic_load(&emu_on)) return cudaGetLastError();
    {
        cudaError_t e;
        EMU_ENTER();
        e = t->last;
        t->last = cudaSuccess;
        pthread_mutex_unlock(&emu_mu);
        return e;
    }
}

static cudaError_t emu_cudaPeekAtLastError(void) {
    if (!atomic_load(&emu_on)) return cudaPeekAtLastError();
    {
        cudaError_t e;
        EMU_ENTER();
        e = t->last;
        pthread_mutex_unlock(&emu_mu);
        return e;
    }
}

static cudaError_t emu_cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
    if (!atomic_load(&emu_on)) return cudaStreamCreateWithFlags(stream, flags);
    {
        emu_stream *s;
        EMU_ENTER();
        if (!stream) EMU_LEAVE(cudaErrorInvalidValue);
        s = (emu_stream *)calloc(1, sizeof *s);
        if (!s) EMU_LEAVE(cudaErrorMemoryAllocation);
        s->magic = EMU_MAGIC_STREAM, s->device = t->device;
        s->all = emu_streams, emu_streams = s;
        *stream = (cudaStream_t)(void *)s;
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaStreamDestroy(cudaStream_t stream) {
    if (!atomic_load(&emu_on)) return cudaStreamDestroy(stream);
    {
        emu_stream *s;
        EMU_ENTER();
        if (!(s = emu_stream_of(stream, "cudaStreamDestroy"))) EMU_LEAVE(cudaErrorInvalidResourceHandle);
        s->dead = 1; /* what is still queued never runs */
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaStreamQuery(cudaStream_t stream) {
    if (!atomic_load(&emu_on)) return cudaStreamQuery(stream);
    {
        emu_stream *s;
        EMU_ENTER();
        if (!(s = emu_stream_of(stream, "cudaStreamQuery"))) EMU_LEAVE(cudaErrorInvalidResourceHandle);
        emu_progress();
        if (s->head || s->not_ready_left > 0) {
            if (s->not_ready_left > 0) s->not_ready_left--;
            EMU_LEAVE(cudaErrorNotReady);
        }
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    if (!atomic_load(&emu_on)) return cudaStreamWaitEvent(stream, event, flags);
    {
        emu_stream *s;
        emu_event *ev;
        emu_op *o;
        EMU_ENTER();
        if (!(s = emu_stream_of(stream, "cudaStreamWaitEvent")) || !(ev = emu_event_of(event, "cudaStreamWaitEvent")))
            EMU_LEAVE(cudaErrorInvalidResourceHandle);
        o = emu_op_new(EMU_WAIT);
        o->ev = ev, o->gen = ev->gen; /* the record made last, as CUDA waits for */
        emu_enqueue(s, o);
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
    if (!atomic_load(&emu_on)) return cudaEventCreateWithFlags(event, flags);
    {
        emu_event *ev;
        EMU_ENTER();
        if (!event) EMU_LEAVE(cudaErrorInvalidValue);
        ev = (emu_event *)calloc(1, sizeof *ev);
        if (!ev) EMU_LEAVE(cudaErrorMemoryAllocation);
        ev->magic = EMU_MAGIC_EVENT;
        ev->all = emu_events, emu_events = ev;
        *event = (cudaEvent_t)(void *)ev;
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaEventDestroy(cudaEvent_t event) {
    if (!atomic_load(&emu_on)) return cudaEventDestroy(event);
    {
        emu_event *ev;
        EMU_ENTER();
        if (!(ev = emu_event_of(event, "cudaEventDestroy"))) EMU_LEAVE(cudaErrorInvalidResourceHandle);
        ev->dead = 1; /* kept until emu_end: queued records and waits may still name it */
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    if (!atomic_load(&emu_on)) return cudaEventRecord(event, stream);
    {
        emu_stream *s;
        emu_event *ev;
        emu_op *o;
        EMU_ENTER();
        if (!(s = emu_stream_of(stream, "cudaEventRecord")) || !(ev = emu_event_of(event, "cudaEventRecord")))
            EMU_LEAVE(cudaErrorInvalidResourceHandle);
        o = emu_op_new(EMU_RECORD);
        o->ev = ev, o->gen = ++ev->gen;
        ev->not_ready_left = emu_polls;
        emu_enqueue(s, o);
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaEventQuery(cudaEvent_t event) {
    if (!atomic_load(&emu_on)) return cudaEventQuery(event);
    {
        emu_event *ev;
        EMU_ENTER();
        if (t->inject != cudaSuccess) {
            cudaError_t e = t->inject;
            t->inject = cudaSuccess;
            EMU_LEAVE(e);
        }
        if (!(ev = emu_event_of(event, "cudaEventQuery"))) EMU_LEAVE(cudaErrorInvalidResourceHandle);
        emu_progress();
        if (ev->done_gen < ev->gen || ev->not_ready_left > 0) {
            if (ev->not_ready_left > 0) ev->not_ready_left--;
            EMU_LEAVE(cudaErrorNotReady);
        }
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaMalloc(void **ptr, size_t size) {
    if (!atomic_load(&emu_on)) return cudaMalloc(ptr, size);
    {
        emu_alloc *a;
        EMU_ENTER();
        if (!ptr) EMU_LEAVE(cudaErrorInvalidValue);
        if (!(a = emu_alloc_new(size, t->device))) EMU_LEAVE(cudaErrorMemoryAllocation);
        *ptr = a->p;
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaFree(void *ptr) {
    if (!atomic_load(&emu_on)) return cudaFree(ptr);
    {
        EMU_ENTER();
        if (ptr) {
            if (!emu_alloc_of(ptr, 0)) {
                emu_problemf("cudaFree: %p is not emulated device memory", ptr);
                EMU_LEAVE(cudaErrorInvalidValue);
            }
            emu_alloc_free(ptr, "cudaFree");
        }
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream) {
    if (!atomic_load(&emu_on)) return cudaMallocAsync(ptr, size, stream);
    {
        emu_stream *s;
        emu_alloc *a;
        EMU_ENTER();
        if (!ptr) EMU_LEAVE(cudaErrorInvalidValue);
        if (!(s = emu_stream_of(stream, "cudaMallocAsync"))) EMU_LEAVE(cudaErrorInvalidResourceHandle);
        if (!(a = emu_alloc_new(size, s->device))) EMU_LEAVE(cudaErrorMemoryAllocation);
        *ptr = a->p;
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaFreeAsync(void *ptr, cudaStream_t stream) {
    if (!atomic_load(&emu_on)) return cudaFreeAsync(ptr, stream);
    {
        emu_stream *s;
        emu_op *o;
        EMU_ENTER();
        if (!(s = emu_stream_of(stream, "cudaFreeAsync"))) EMU_LEAVE(cudaErrorInvalidResourceHandle);
        if (!ptr || !emu_alloc_of(ptr, 0)) {
            emu_problemf("cudaFreeAsync: %p is not emulated device memory", ptr);
            EMU_LEAVE(cudaErrorInvalidValue);
        }
        o = emu_op_new(EMU_FREE);
        o->dst = ptr;
        emu_enqueue(s, o);
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream) {
    if (!atomic_load(&emu_on)) return cudaMemcpyAsync(dst, src, count, kind, stream);
    {
        emu_stream *s;
        emu_op *o;
        int dst_dev, src_dev;
        EMU_ENTER();
        dst_dev = emu_alloc_of(dst, count) != NULL, src_dev = emu_alloc_of(src, count) != NULL;
        if (!(s = emu_stream_of(stream, "cudaMemcpyAsync"))) EMU_LEAVE(cudaErrorInvalidResourceHandle);
        if ((kind == cudaMemcpyHostToDevice && (!dst_dev || src_dev)) || (kind == cudaMemcpyDeviceToHost && (dst_dev || !src_dev)) ||
            (kind == cudaMemcpyDeviceToDevice && (!dst_dev || !src_dev))) {
            emu_problemf("cudaMemcpyAsync of %zu bytes, kind %d: the destination is %s memory, the source %s", count, (int)kind,
                         dst_dev ? "device" : "host", src_dev ? "device" : "host");
            EMU_LEAVE(cudaErrorInvalidValue);
        }
        o = emu_op_new(EMU_COPY);
        o->dst = dst, o->src = src, o->n = count;
        emu_enqueue(s, o);
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t stream) {
    if (!atomic_load(&emu_on)) return cudaMemsetAsync(ptr, value, count, stream);
    {
        emu_stream *s;
        emu_op *o;
        EMU_ENTER();
        if (!(s = emu_stream_of(stream, "cudaMemsetAsync"))) EMU_LEAVE(cudaErrorInvalidResourceHandle);
        if (!emu_alloc_of(ptr, count)) {
            emu_problemf("cudaMemsetAsync: %zu bytes at %p are not emulated device memory", count, ptr);
            EMU_LEAVE(cudaErrorInvalidValue);
        }
        o = emu_op_new(EMU_SET);
        o->dst = ptr, o->value = value, o->n = count;
        emu_enqueue(s, o);
        EMU_LEAVE(cudaSuccess);
    }
}

static cudaError_t emu_cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr) {
    if (!atomic_load(&emu_on)) return cudaPointerGetAttributes(attributes, ptr);
    {
        emu_alloc *a;
        EMU_ENTER();
        if (!attributes) EMU_LEAVE(cudaErrorInvalidValue);
        memset(attributes, 0, sizeof *attributes);
        a = emu_alloc_of(ptr, 0);
        if (a) {
            attributes->type = cudaMemoryTypeDevice;
            attributes->device = a->device;
            attributes->devicePointer = (void *)(uintptr_t)ptr;
        } else {
            attributes->type = cudaMemoryTypeUnregistered; /* CUDA 11 and later: host memory is no error */
            attributes->device = -2;
        }
        EMU_LEAVE(cudaSuccess);
    }
}

/* ---- NCCL ---- */

static emu_family *emu_family_of(const char *key, int size, int split) {
    emu_family *f;
    for (f = emu_families; f; f = f->next)
        if (!strcmp(f->key, key)) break;
    if (!f) {
        f = (emu_family *)calloc(1, sizeof *f);
        if (!f) abort();
        snprintf(f->key, sizeof f->key, "%s", key);
        f->size = size, f->split = split;
        f->next = emu_families, emu_families = f;
    }
    if (f->size != size) emu_problemf("communicator %s: joined for %d ranks, and for %d", key, f->size, size);
    return f;
}

/* Has every rank joined? A split child learns its rank and size then. */
static int emu_comm_ready(emu_comm *c) {
    int r;
    if (!c->wait) return 1;
    if (c->wait->joined < c->wait->size) return 0;
    if (c->wait->split) {
        c->rank = 0, c->size = 0;
        for (r = 0; r < c->wait->size; r++)
            if (c->wait->color[r] == c->color) {
                c->size++;
                if (c->wait->skey[r] < c->skey || (c->wait->skey[r] == c->skey && r < c->prank)) c->rank++;
            }
    }
    c->wait = NULL;
    return 1;
}

static emu_comm *emu_comm_new(emu_thread *t) {
    emu_comm *c = (emu_comm *)calloc(1, sizeof *c);
    if (!c) abort();
    c->magic = EMU_MAGIC_COMM, c->device = t->device, c->busy = emu_polls;
    c->all = emu_comms, emu_comms = c;
    return c;
}

static int emu_nonblocking(const ncclConfig_t *config, const char *what) {
    if (config && config->blocking == 0) return 1;
    emu_problemf("%s: only nonblocking communicators (config.blocking = 0) are emulated", what);
    return 0;
}

static ncclResult_t emu_ncclGetUniqueId(ncclUniqueId *id) {
    if (!atomic_load(&emu_on)) return ncclGetUniqueId(id);
    {
        EMU_ENTER();
        (void)t;
        if (!id) EMU_NLEAVE(ncclInvalidArgument);
        memset(id, 0, sizeof *id);
        snprintf(id->internal, sizeof id->internal, "emulated id %u", ++emu_ids);
        EMU_NLEAVE(ncclSuccess);
    }
}

static ncclResult_t emu_ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
    if (!atomic_load(&emu_on)) return ncclCommInitRankConfig(comm, nranks, id, rank, config);
    {
        char key[EMU_KEY];
        uint64_t h = 14695981039346656037ull;
        emu_family *f;
        emu_comm *c;
        size_t i;
        EMU_ENTER();
        if (!comm || nranks < 1 || nranks > EMU_MAX_RANKS || rank < 0 || rank >= nranks || !emu_nonblocking(config, "ncclCommInitRankConfig"))
            EMU_NLEAVE(ncclInvalidArgument);
        for (i = 0; i < sizeof id.internal; i++) h = (h ^ (unsigned char)id.internal[i]) * 1099511628211ull;
        snprintf(key, sizeof key, "id%016llx", (unsigned long long)h);
        f = emu_family_of(key, nranks, 0);
        if (f->in[rank]) emu_problemf("ncclCommInitRankConfig: rank %d joins %s twice", rank, key);
        f->in[rank] = 1, f->joined++;
        c = emu_comm_new(t);
        snprintf(c->key, sizeof c->key, "%s", key);
        c->rank = rank, c->size = nranks, c->wait = f;
        *comm = (ncclComm_t)(void *)c;
        EMU_NLEAVE(ncclInProgress);
    }
}

static ncclResult_t emu_ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
    if (!atomic_load(&emu_on)) return ncclCommSplit(comm, color, key, newcomm, config);
    {
        char fkey[EMU_KEY + 24];
        emu_comm *p, *c;
        emu_family *f;
        EMU_ENTER();
        if (!(p = emu_comm_of(comm, "ncclCommSplit")) || !newcomm || color < 0 || !emu_nonblocking(config, "ncclCommSplit"))
            EMU_NLEAVE(ncclInvalidArgument);
        if (!emu_comm_ready(p)) {
            emu_problemf("ncclCommSplit of %s before it is ready", p->key);
            EMU_NLEAVE(ncclInvalidUsage);
        }
        snprintf(fkey, sizeof fkey, "%s/%lu:%d", p->key, p->nsplit++, color);
        if (strlen(fkey) >= EMU_KEY) {
            emu_problemf("ncclCommSplit: the key %s is too long for the emulation", fkey);
            EMU_NLEAVE(ncclInternalError);
        }
        /* every rank of the parent takes part: one record per split, the colors and keys of all */
        {
            char rkey[EMU_KEY + 24];
            snprintf(rkey, sizeof rkey, "%s#%lu", p->key, p->nsplit - 1);
            f = emu_family_of(rkey, p->size, 1);
        }
        if (f->in[p->rank]) emu_problemf("ncclCommSplit: rank %d of %s splits twice", p->rank, p->key);
        f->in[p->rank] = 1, f->joined++;
        f->color[p->rank] = color, f->skey[p->rank] = key;
        c = emu_comm_new(t);
        memcpy(c->key, fkey, strlen(fkey) + 1); /* fits: checked above */
        c->device = p->device, c->wait = f, c->color = color, c->skey = key, c->prank = p->rank;
        *newcomm = (ncclComm_t)(void *)c;
        EMU_NLEAVE(ncclInProgress);
    }
}

static ncclResult_t emu_ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    if (!atomic_load(&emu_on)) return ncclCommGetAsyncError(comm, asyncError);
    {
        emu_comm *c;
        EMU_ENTER();
        (void)t;
        if (!(c = emu_comm_of(comm, "ncclCommGetAsyncError")) || !asyncError) EMU_NLEAVE(ncclInvalidArgument);
        emu_progress();
        if (!emu_comm_ready(c)) *asyncError = ncclInProgress;
        else if (c->busy > 0) c->busy--, *asyncError = ncclInProgress;
        else *asyncError = ncclSuccess;
        EMU_NLEAVE(ncclSuccess);
    }
}

static const char *emu_ncclGetLastError(ncclComm_t comm) {
    if (!atomic_load(&emu_on)) return ncclGetLastError(comm);
    return "";
}

static ncclResult_t emu_ncclCommFinalize(ncclComm_t comm) {
    if (!atomic_load(&emu_on)) return ncclCommFinalize(comm);
    {
        emu_comm *c;
        EMU_ENTER();
        (void)t;
        if (!(c = emu_comm_of(comm, "ncclCommFinalize"))) EMU_NLEAVE(ncclInvalidArgument);
        c->busy = emu_polls;
        EMU_NLEAVE(ncclInProgress);
    }
}

static ncclResult_t emu_retire(ncclComm_t comm, const char *what) {
    emu_comm *c;
    EMU_ENTER();
    (void)t;
    if (!(c = emu_comm_of(comm, what))) EMU_NLEAVE(ncclInvalidArgument);
    c->gone = 1;
    EMU_NLEAVE(ncclSuccess);
}

static ncclResult_t emu_ncclCommDestroy(ncclComm_t comm) {
    if (!atomic_load(&emu_on)) return ncclCommDestroy(comm);
    return emu_retire(comm, "ncclCommDestroy");
}

static ncclResult_t emu_ncclCommAbort(ncclComm_t comm) {
    if (!atomic_load(&emu_on)) return ncclCommAbort(comm);
    return emu_retire(comm, "ncclCommAbort");
}

static ncclResult_t emu_ncclCommUserRank(const ncclComm_t comm, int *rank) {
    if (!atomic_load(&emu_on)) return ncclCommUserRank(comm, rank);
    {
        emu_comm *c;
        EMU_ENTER();
        (void)t;
        if (!(c = emu_comm_of(comm, "ncclCommUserRank")) || !rank || !emu_comm_ready(c)) EMU_NLEAVE(ncclInvalidArgument);
        *rank = c->rank;
        EMU_NLEAVE(ncclSuccess);
    }
}

static ncclResult_t emu_ncclCommCount(const ncclComm_t comm, int *count) {
    if (!atomic_load(&emu_on)) return ncclCommCount(comm, count);
    {
        emu_comm *c;
        EMU_ENTER();
        (void)t;
        if (!(c = emu_comm_of(comm, "ncclCommCount")) || !count || !emu_comm_ready(c)) EMU_NLEAVE(ncclInvalidArgument);
        *count = c->size;
        EMU_NLEAVE(ncclSuccess);
    }
}

static ncclResult_t emu_ncclCommCuDevice(const ncclComm_t comm, int *device) {
    if (!atomic_load(&emu_on)) return ncclCommCuDevice(comm, device);
    {
        emu_comm *c;
        EMU_ENTER();
        (void)t;
        if (!(c = emu_comm_of(comm, "ncclCommCuDevice")) || !device) EMU_NLEAVE(ncclInvalidArgument);
        *device = c->device;
        EMU_NLEAVE(ncclSuccess);
    }
}

/* The thread's queued operations onto their streams: one piece of work per stream, in call order. */
static void emu_flush(emu_thread *t) {
    emu_sub *u;
    while ((u = t->pending) != NULL) {
        emu_stream *s = u->stream;
        emu_op *o = emu_op_new(EMU_GROUP);
        emu_sub **from = &t->pending, **to = &o->subs;
        while (*from) {
            if ((*from)->stream == s) {
                emu_sub *v = *from;
                *from = v->next;
                v->next = NULL;
                v->comm->busy = emu_polls;
                v->stream = NULL, v->comm = NULL;
                *to = v, to = &v->next;
            } else {
                from = &(*from)->next;
            }
        }
        emu_enqueue(s, o);
    }
}

static ncclResult_t emu_ncclGroupStart(void) {
    if (!atomic_load(&emu_on)) return ncclGroupStart();
    {
        EMU_ENTER();
        t->group++;
        EMU_NLEAVE(ncclSuccess);
    }
}

static ncclResult_t emu_ncclGroupEnd(void) {
    if (!atomic_load(&emu_on)) return ncclGroupEnd();
    {
        int any;
        EMU_ENTER();
        if (t->group <= 0) {
            emu_problemf("ncclGroupEnd without ncclGroupStart");
            EMU_NLEAVE(ncclInvalidUsage);
        }
        if (--t->group > 0) EMU_NLEAVE(ncclSuccess);
        any = t->pending != NULL;
        emu_flush(t);
        EMU_NLEAVE(any ? ncclInProgress : ncclSuccess);
    }
}

/* An NCCL operation: queued in the open group, or issued now as its own group. */
static ncclResult_t emu_op_post(int kind, const void *in, void *out, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                                cudaStream_t stream, const char *what) {
    emu_comm *c;
    emu_stream *s;
    emu_sub *u, **pp;
    size_t ts = emu_type_size(type), bytes;
    EMU_ENTER();
    if (!(c = emu_comm_of(comm, what)) || !(s = emu_stream_of(stream, what))) EMU_NLEAVE(ncclInvalidArgument);
    if (!emu_comm_ready(c)) {
        emu_problemf("%s on %s before it is ready", what, c->key);
        EMU_NLEAVE(ncclInvalidUsage);
    }
    if (!ts || ((kind == EMU_ALLREDUCE || kind == EMU_ALLGATHER) && type != ncclFloat32 && (kind == EMU_ALLGATHER || type != ncclInt32))) {
        emu_problemf("%s: data type %d is not emulated", what, (int)type);
        EMU_NLEAVE(ncclInvalidArgument);
    }
    if ((kind == EMU_SEND || kind == EMU_RECV) && (peer < 0 || peer >= c->size || peer == c->rank)) {
        emu_problemf("%s: peer %d on %s (rank %d of %d)", what, peer, c->key, c->rank, c->size);
        EMU_NLEAVE(ncclInvalidArgument);
    }
    bytes = count * ts;
    if ((in && !emu_alloc_of(in, bytes)) ||
        (out && !emu_alloc_of(out, kind == EMU_ALLGATHER ? bytes * (size_t)c->size : bytes))) {
        emu_problemf("%s: a buffer of %zu bytes is not emulated device memory", what, bytes);
        EMU_NLEAVE(ncclInvalidArgument);
    }
    u = (emu_sub *)calloc(1, sizeof *u);
    if (!u) abort();
    u->kind = kind;
    snprintf(u->key, sizeof u->key, "%s", c->key);
    u->rank = c->rank, u->size = c->size, u->peer = peer, u->in = in, u->out = out, u->bytes = bytes, u->type = type;
    if (kind == EMU_ALLREDUCE || kind == EMU_ALLGATHER) u->seq = c->nseq++;
    u->stream = s, u->comm = c;
    for (pp = &t->pending; *pp; pp = &(*pp)->next) {}
    *pp = u;
    if (t->group > 0) EMU_NLEAVE(ncclSuccess);
    emu_flush(t);
    EMU_NLEAVE(ncclInProgress);
}

static ncclResult_t emu_ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
    if (!atomic_load(&emu_on)) return ncclSend(buf, count, type, peer, comm, stream);
    return emu_op_post(EMU_SEND, buf, NULL, count, type, peer, comm, stream, "ncclSend");
}

static ncclResult_t emu_ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
    if (!atomic_load(&emu_on)) return ncclRecv(buf, count, type, peer, comm, stream);
    return emu_op_post(EMU_RECV, NULL, buf, count, type, peer, comm, stream, "ncclRecv");
}

static ncclResult_t emu_ncclAllReduce(const void *in, void *out, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream) {
    if (!atomic_load(&emu_on)) return ncclAllReduce(in, out, count, type, op, comm, stream);
    if (op != ncclSum) {
        pthread_mutex_lock(&emu_mu);
        emu_problemf("ncclAllReduce: only ncclSum is emulated");
        pthread_mutex_unlock(&emu_mu);
        return ncclInvalidArgument;
    }
    return emu_op_post(EMU_ALLREDUCE, in, out, count, type, -1, comm, stream, "ncclAllReduce");
}

static ncclResult_t emu_ncclAllGather(const void *in, void *out, size_t count, ncclDataType_t type, ncclComm_t comm, cudaStream_t stream) {
    if (!atomic_load(&emu_on)) return ncclAllGather(in, out, count, type, comm, stream);
    return emu_op_post(EMU_ALLGATHER, in, out, count, type, -1, comm, stream, "ncclAllGather");
}

/* ---- the test's side ---- */

/* Everything the emulation holds, freed (emu_mu held). */
static void emu_clear(void) {
    while (emu_streams) {
        emu_stream *s = emu_streams;
        emu_streams = s->all;
        while (s->head) {
            emu_op *o = s->head;
            s->head = o->next;
            emu_op_free(o);
        }
        free(s);
    }
    while (emu_events) {
        emu_event *e = emu_events;
        emu_events = e->all;
        free(e);
    }
    while (emu_comms) {
        emu_comm *c = emu_comms;
        emu_comms = c->all;
        free(c);
    }
    while (emu_allocs) {
        emu_alloc *a = emu_allocs;
        emu_allocs = a->next;
        free(a->p);
        free(a);
    }
    while (emu_msgs) {
        emu_msg *m = emu_msgs;
        emu_msgs = m->next;
        free(m);
    }
    while (emu_colls) {
        emu_coll *c = emu_colls;
        emu_colls = c->next;
        free(c->part);
        free(c);
    }
    while (emu_families) {
        emu_family *f = emu_families;
        emu_families = f->next;
        free(f);
    }
    {
        int i;
        for (i = 0; i < emu_nthreads; i++) {
            while (emu_threads_[i].pending) {
                emu_sub *u = emu_threads_[i].pending;
                emu_threads_[i].pending = u->next;
                free(u);
            }
        }
    }
    emu_nthreads = 0;
    emu_nproblems = 0;
    emu_problem[0] = 0;
}

/* Start emulating `devices` GPUs; every query answers "not ready" `polls` times after new work. */
static void emu_begin(int devices, int polls) {
    pthread_mutex_lock(&emu_mu);
    emu_clear();
    emu_gen++;
    emu_ndev = devices, emu_polls = polls;
    atomic_store(&emu_on, 1);
    pthread_mutex_unlock(&emu_mu);
}

/* Stop: every emu_ call is the real one again. */
static void emu_end(void) {
    pthread_mutex_lock(&emu_mu);
    atomic_store(&emu_on, 0);
    emu_clear();
    pthread_mutex_unlock(&emu_mu);
}

/* The number of problems seen, the first one's text in buf. */
static int emu_problems(char *buf, size_t cap) {
    int n;
    pthread_mutex_lock(&emu_mu);
    n = emu_nproblems;
    snprintf(buf, cap, "%s", n ? emu_problem : "none");
    pthread_mutex_unlock(&emu_mu);
    return n;
}

/* The calling thread's next cudaEventQuery returns e. */
static void emu_inject(cudaError_t e) {
    pthread_mutex_lock(&emu_mu);
    emu_me()->inject = e;
    pthread_mutex_unlock(&emu_mu);
}

/* The cudaErrorNotReady answers the calling thread got. */
static long emu_not_ready_here(void) {
    long n;
    pthread_mutex_lock(&emu_mu);
    n = emu_me()->not_ready;
    pthread_mutex_unlock(&emu_mu);
    return n;
}

/* Every thread that called the emulation since emu_begin: its last error now (what cudaGetLastError would
   return on it), its calls and not-ready answers. Returns how many (up to cap in out). */
static int emu_threads(emu_thread_info *out, int cap) {
    int i, n;
    pthread_mutex_lock(&emu_mu);
    n = emu_nthreads;
    for (i = 0; i < n && i < cap; i++)
        out[i].last = emu_threads_[i].last, out[i].calls = emu_threads_[i].calls, out[i].not_ready = emu_threads_[i].not_ready;
    pthread_mutex_unlock(&emu_mu);
    return n;
}

/* What is still allocated, and the streams and events not destroyed. */
static void emu_live(int *allocs, int *streams, int *events) {
    emu_alloc *a;
    emu_stream *s;
    emu_event *e;
    pthread_mutex_lock(&emu_mu);
    *allocs = *streams = *events = 0;
    for (a = emu_allocs; a; a = a->next) ++*allocs;
    for (s = emu_streams; s; s = s->all) *streams += !s->dead;
    for (e = emu_events; e; e = e->all) *events += !e->dead;
    pthread_mutex_unlock(&emu_mu);
}

#endif /* NCCL_EMU_DEFINED */
#endif /* NCCL_EMU_DEFINE */
