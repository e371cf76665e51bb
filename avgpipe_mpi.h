/* avgpipe_mpi.h — the MPI comm backend for avgpipe.h: one rank per process, CPU processes across machines.

   WHAT IT IS
   ----------
   An avgpipe_comm table (avgpipe.h, section 13) over MPI point-to-point messages and nonblocking
   collectives, so that avgpipe_run executes one pipeline rank per MPI process: on one machine over
   shared memory, across machines over whatever network MPI uses. Open MPI from Debian (libopenmpi-dev,
   openmpi-bin) is what it is tested with; any MPI-3 library with MPI_THREAD_MULTIPLE should do.

   USE
   ---
       #define AVGPIPE_IMPLEMENTATION          // in one .c file: both headers' implementations
       #include "avgpipe.h"
       #include "avgpipe_mpi.h"                // after avgpipe.h; needs <mpi.h> (mpicc, or -I and -lmpi)

       if (avgpipe_mpi_init(&ctx, &argc, &argv)) ...      // MPI_Init_thread(MPI_THREAD_MULTIPLE), checked
       avgpipe_comm comm;
       if (avgpipe_mpi_create(&ctx, NULL, &comm)) ...     // over MPI_COMM_WORLD
       int me = avgpipe_mpi_rank(&comm);
       desc.comm = &comm; desc.local_ranks = &me; desc.local_count = 1;
       avgpipe_run_create(&ctx, &desc, &run); ... avgpipe_run_destroy(run);
       avgpipe_comm_destroy(&comm);
       MPI_Finalize();                                      // after a failure: see FAILURES

   Run with `mpirun -np S ./trainer` (S·D processes with D replica groups); several machines: a hostfile
   (`mpirun --hostfile hosts -np 8 ./trainer`, one line "host slots=4" per machine).

   SEMANTICS
   ---------
   - One rank per process: `self` in every call is this process's rank in the communicator.
   - Point to point: MPI_Isend / MPI_Irecv on a private duplicate of the communicator, so nothing else
     the program sends can interleave. A receive takes whatever message comes next from its peer
     (MPI_ANY_TAG: MPI keeps the order of messages between two processes), then checks its tag against
     what it expects and its size against the receive's capacity: another tag or more bytes (MPI's
     truncation) fail it with AVGPIPE_MISMATCH (status says what arrived); a smaller message is
     delivered, status.bytes its size (MPI_Get_count). MPI has written the message into the buffer by
     then (up to the capacity). Messages of more than
     INT_MAX bytes are refused (AVGPIPE_INVALID_ARG). Tags need MPI_TAG_UB >= 2^31 - 1 (Open MPI and
     MPICH's default device give it); with a smaller bound tags are folded modulo MPI_TAG_UB + 1.
   - Waits never call MPI_Wait: they poll MPI_Test, spinning for desc.spin_us, then sleeping with a
     growing back-off up to desc.max_sleep_us between polls, until the timeout. So every wait has a
     bound, and a waiting thread does not hold a core once the wait is long.
   - Errors are returned, never fatal: the communicators use MPI_ERRORS_RETURN, and MPI's own text
     (MPI_Error_string) is in last_error().
   - Threads: stage workers and averaging threads call MPI at the same time, so the backend asks for
     MPI_THREAD_MULTIPLE. With MPI_THREAD_SERIALIZED it serialises its own MPI calls with a mutex (it
     never blocks inside MPI, so that works); with less it refuses to be created.
   - barrier: MPI_Ibarrier, polled. allreduce_sum: by default MPI_Iallgather of every rank's floats and
     a sum in rank order on each rank (the same bits on every rank and every run, equal to the in-process
     backend's; it moves size x count floats); desc.fast_allreduce uses MPI_Iallreduce instead (MPI's
     order of additions). A collective that times out stays pending inside MPI: the communicator is
     then broken, later collectives fail at once (AVGPIPE_STATE_ERROR).
   - split: MPI_Comm_split (color members[0], key: the position in members). Collective and blocking,
     like MPI's: every process calls it. The sub-communicator is an independent backend; destroy it
     before its parent.
   - cancel: a pending receive is MPI_Cancel'led and freed; a pending send is tested for up to 100 ms
     and then freed with MPI_Request_free (MPI cannot reliably cancel sends: it may still read the
     buffer while the peer is alive; keep the buffers until MPI_Finalize when in doubt).
   - abort: besides failing every pending and later call of this process with AVGPIPE_ABORTED, it sends
     a short notice to every other rank (on a second private communicator); their pending and later
     calls then fail within milliseconds with "rank R aborted: <reason>", instead of waiting for their
     timeouts. Sub-communicators see their parent's abort.

   FAILURES
   --------
   A process that dies is not reported by MPI (Open MPI 4.1 has no fault tolerance: MPI_Test never
   fails for a dead peer). The ranks that wait for it time out (the run's timeout_s), abort, and their
   notices stop everyone else. By default `mpirun` kills the whole job about a second after a process
   dies; with `mpirun --mca orte_abort_on_non_zero_status 0` the survivors report their errors and exit
   on their own. After a failure, exit without MPI_Finalize (it may wait for the dead process): e.g.
   print the error and call exit(1).

   THREAD-SAFETY
   -------------
   As the comm table says: different threads may call at once (the process's worker and averaging
   threads); one request is used by one thread at a time. avgpipe_mpi_create and split are collective.

   CONFIGURATION MACROS
   --------------------
     AVGPIPE_MPI_IMPLEMENTATION   compile the implementation here (AVGPIPE_IMPLEMENTATION and AVGPIPE_IMPL
                                  turn it on too).
   License: MIT, as avgpipe.h. */
#ifndef AVGPIPE_MPI_H
#define AVGPIPE_MPI_H

#ifndef AVGPIPE_H
#error "avgpipe_mpi.h: include avgpipe.h first"
#endif
#if AVGPIPE_VERSION_NUMBER != 1003 /* released together: 0.10.3 */
#error "avgpipe_mpi.h is version 0.10.3: include the avgpipe.h of the same release"
#endif

#if defined(__cplusplus) /* the C API is all avgpipe uses: leave out MPI's deprecated C++ bindings */
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#endif
#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Zero-initialise; zero fields mean:
     comm            0 (or MPI_COMM_NULL) -> MPI_COMM_WORLD. The backend works on duplicates of it.
     spin_us         0 -> 50: a wait polls without sleeping for this long
     max_sleep_us    0 -> 200: longest sleep between two polls afterwards (the latency a long wait adds
                     at most; lower costs a waiting thread more CPU)
     fast_allreduce  0 -> allreduce_sum sums in rank order (reproducible); 1 -> MPI_Iallreduce
     no_abort_notices 0 -> abort() tells the other ranks; 1 -> it stays local                          */
typedef struct avgpipe_mpi_desc {
    MPI_Comm comm;
    double spin_us;
    double max_sleep_us;
    int fast_allreduce;
    int no_abort_notices;
} avgpipe_mpi_desc;

/* Initialise MPI for avgpipe unless the program already did: MPI_Init_thread asking for
   MPI_THREAD_MULTIPLE. Fails (AVGPIPE_UNSUPPORTED, naming the level) when MPI gives less than
   MPI_THREAD_SERIALIZED; AVGPIPE_BACKEND_ERROR with MPI's text when MPI fails. argc/argv may be NULL. */
AVGPIPE_API avgpipe_result avgpipe_mpi_init(avgpipe_context *ctx, int *argc, char ***argv);

/* Create the backend over desc->comm (desc may be NULL: all defaults). Collective over the
   communicator (it duplicates it twice). Errors: AVGPIPE_STATE_ERROR (MPI not initialised),
   AVGPIPE_UNSUPPORTED (thread level below MPI_THREAD_SERIALIZED), AVGPIPE_BACKEND_ERROR (MPI's text),
   AVGPIPE_OUT_OF_MEMORY. out->size is the communicator's size. Release with avgpipe_comm_destroy
   (before MPI_Finalize). */
AVGPIPE_API avgpipe_result avgpipe_mpi_create(avgpipe_context *ctx, const avgpipe_mpi_desc *desc, avgpipe_comm *out);

/* This process's rank in a table made by avgpipe_mpi_create (or its split); -1 for another table. */
AVGPIPE_API int avgpipe_mpi_rank(const avgpipe_comm *comm);

/* The resolved description (what zero fields became). Thread-safe. */
AVGPIPE_API avgpipe_mpi_desc avgpipe_mpi_query_defaults(const avgpipe_mpi_desc *desc);

#ifdef __cplusplus
}
#endif
#endif /* AVGPIPE_MPI_H */

/* ============================================================================================ */
/* Implementation                                                                                */
/* ============================================================================================ */
#if (defined(AVGPIPE_MPI_IMPLEMENTATION) || defined(AVGPIPE_IMPLEMENTATION) || defined(AVGPIPE_IMPL)) && \
    !defined(AVGPIPE_MPI_IMPLEMENTATION_INCLUDED)
#define AVGPIPE_MPI_IMPLEMENTATION_INCLUDED

#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

#define AVGPIPE__MPI_NOTICE 256 /* bytes of an abort notice */
#define AVGPIPE__MPI_MAGIC 0x6d706921u

typedef struct avgpipe__mpi avgpipe__mpi;
struct avgpipe__mpi {
    unsigned magic;
    avgpipe_mpi_desc desc;
    avgpipe_allocator alloc;
    MPI_Comm comm, ctl;      /* messages; abort notices */
    int rank, size, serialize;
    long tag_mod;            /* MPI_TAG_UB + 1 */
    pthread_mutex_t mu;      /* the backend's state; and every MPI call when serialize */
    pthread_mutex_t notice_mu; /* one thread at a time polls the notice receive */
    int aborted, broken;     /* broken: a collective timed out and is still pending inside MPI */
    char abort_msg[AVGPIPE__MPI_NOTICE];
    char notice_in[AVGPIPE__MPI_NOTICE], notice_out[AVGPIPE__MPI_NOTICE];
    MPI_Request notice_req;  /* the posted receive of a notice from anyone */
    MPI_Request *notice_sends; /* [size] */
    avgpipe__mpi *parent;    /* a split's parent: its abort counts here too */
    char err[256];
};

typedef struct avgpipe__mpi_req {
    MPI_Request req;
    int send, peer;
    uint32_t tag;
    size_t bytes;
} avgpipe__mpi_req;

static void avgpipe__mpi_lock(avgpipe__mpi *m) {
    if (m->serialize) pthread_mutex_lock(&m->mu);
}
static void avgpipe__mpi_unlock(avgpipe__mpi *m) {
    if (m->serialize) pthread_mutex_unlock(&m->mu);
}

/* MPI's text of code `rc` after `what`, as the rank's last error. */
static avgpipe_result avgpipe__mpi_error(avgpipe__mpi *m, int rc, const char *what) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "MPI error %d", rc);
    else text[len < MPI_MAX_ERROR_STRING ? len : MPI_MAX_ERROR_STRING - 1] = 0;
    pthread_mutex_lock(&m->mu);
    snprintf(m->err, sizeof m->err, "rank %d: %.60s: %.180s", m->rank, what, text);
    pthread_mutex_unlock(&m->mu);
    return AVGPIPE_BACKEND_ERROR;
}

static double avgpipe__mpi_now(void) { return MPI_Wtime(); }

static void avgpipe__mpi_sleep_us(double us) {
    struct timespec ts;
    ts.tv_sec = (time_t)(us / 1e6);
    ts.tv_nsec = (long)((us - (double)ts.tv_sec * 1e6) * 1e3);
    nanosleep(&ts, NULL);
}

/* Has anyone (this process, its parent, another rank's notice) aborted? Polls the notice receive. */
static int avgpipe__mpi_aborted(avgpipe__mpi *m) {
    int flag = 0;
    if (m->parent && avgpipe__mpi_aborted(m->parent)) {
        pthread_mutex_lock(&m->mu);
        if (!m->aborted) {
            m->aborted = 1;
            snprintf(m->abort_msg, sizeof m->abort_msg, "%s", m->parent->abort_msg);
        }
        pthread_mutex_unlock(&m->mu);
    }
    pthread_mutex_lock(&m->mu);
    flag = m->aborted;
    pthread_mutex_unlock(&m->mu);
    if (flag || m->notice_req == MPI_REQUEST_NULL || pthread_mutex_trylock(&m->notice_mu) != 0) return flag;
    {
        MPI_Status st;
        int done = 0;
        avgpipe__mpi_lock(m);
        if (m->notice_req != MPI_REQUEST_NULL && MPI_Test(&m->notice_req, &done, &st) == MPI_SUCCESS && done) {
            m->notice_in[AVGPIPE__MPI_NOTICE - 1] = 0;
            pthread_mutex_lock(&m->mu);
            if (!m->aborted) {
                m->aborted = 1;
                snprintf(m->abort_msg, sizeof m->abort_msg, "rank %d aborted: %.220s", st.MPI_SOURCE, m->notice_in);
            }
            flag = 1;
            pthread_mutex_unlock(&m->mu);
        }
        avgpipe__mpi_unlock(m);
    }
    pthread_mutex_unlock(&m->notice_mu);
    return flag;
}

static avgpipe_result avgpipe__mpi_post(void *user, int send, int self, int peer, void *buf, size_t bytes, uint32_t tag,
                                        avgpipe_comm_request *out) {
    static char empty;
    avgpipe__mpi *m = (avgpipe__mpi *)user;
    avgpipe__mpi_req *r;
    int rc;
    if (!out || self != m->rank || peer < 0 || peer >= m->size || peer == self || tag > AVGPIPE_COMM_TAG_MAX) return AVGPIPE_INVALID_ARG;
    if (bytes > (size_t)INT_MAX) {
        snprintf(m->err, sizeof m->err, "rank %d: a message of %zu bytes: the MPI backend carries at most %d", self, bytes, INT_MAX);
        return AVGPIPE_INVALID_ARG;
    }
    if (avgpipe__mpi_aborted(m)) return AVGPIPE_ABORTED;
    r = (avgpipe__mpi_req *)m->alloc.alloc(sizeof *r, m->alloc.user);
    if (!r) return AVGPIPE_OUT_OF_MEMORY;
    r->send = send, r->peer = peer, r->tag = tag, r->bytes = bytes;
    avgpipe__mpi_lock(m);
    if (send) rc = MPI_Isend(buf ? buf : &empty, (int)bytes, MPI_BYTE, peer, (int)((long)tag % m->tag_mod), m->comm, &r->req);
    else rc = MPI_Irecv(buf ? buf : &empty, (int)bytes, MPI_BYTE, peer, MPI_ANY_TAG, m->comm, &r->req);
    avgpipe__mpi_unlock(m);
    if (rc != MPI_SUCCESS) {
        m->alloc.free(r, m->alloc.user);
        return avgpipe__mpi_error(m, rc, send ? "MPI_Isend" : "MPI_Irecv");
    }
    *out = (avgpipe_comm_request)(void *)r;
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__mpi_isend(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag,
                                         avgpipe_comm_request *req) {
    return avgpipe__mpi_post(user, 1, self, peer, (void *)(uintptr_t)buf, bytes, tag, req);
}
static avgpipe_result avgpipe__mpi_irecv(void *user, int self, int peer, void *buf, size_t bytes, uint32_t tag,
                                         avgpipe_comm_request *req) {
    return avgpipe__mpi_post(user, 0, self, peer, buf, bytes, tag, req);
}

/* A finished request: check a receive's tag and size, fill the status, free it. */
static avgpipe_result avgpipe__mpi_finish(avgpipe__mpi *m, avgpipe__mpi_req *r, int rc, MPI_Status *st, avgpipe_comm_status *status) {
    avgpipe_result res = AVGPIPE_OK;
    int count = 0;
    if (!r->send) {
        uint32_t tag = (uint32_t)st->MPI_TAG, want = (uint32_t)((long)r->tag % m->tag_mod);
        if (MPI_Get_count(st, MPI_BYTE, &count) != MPI_SUCCESS || count == MPI_UNDEFINED) count = -1;
        if (status) status->tag = tag, status->bytes = count >= 0 ? (size_t)count : 0;
        if (tag != want || (rc == MPI_SUCCESS && (count < 0 || (size_t)count > r->bytes)) || (rc != MPI_SUCCESS && st->MPI_ERROR == MPI_ERR_TRUNCATE)) {
            pthread_mutex_lock(&m->mu);
            snprintf(m->err, sizeof m->err, "rank %d: a receive from rank %d of %zu bytes with tag %u met a message of %s%d bytes with tag %u",
                     m->rank, r->peer, r->bytes, (unsigned)want, count < 0 ? "more than " : "", count < 0 ? (int)r->bytes : count,
                     (unsigned)tag);
            pthread_mutex_unlock(&m->mu);
            res = AVGPIPE_MISMATCH;
        } else if (rc != MPI_SUCCESS) {
            res = avgpipe__mpi_error(m, st->MPI_ERROR != MPI_SUCCESS ? st->MPI_ERROR : rc, "receive");
        }
    } else if (rc != MPI_SUCCESS) {
        res = avgpipe__mpi_error(m, rc, "send");
    }
    m->alloc.free(r, m->alloc.user);
    return res;
}

/* One MPI_Test of r: 1 when it finished (*res set), 0 when not yet. */
static int avgpipe__mpi_poll(avgpipe__mpi *m, avgpipe__mpi_req *r, avgpipe_comm_status *status, avgpipe_result *res) {
    MPI_Status st;
    int flag = 0, rc;
    memset(&st, 0, sizeof st);
    avgpipe__mpi_lock(m);
    rc = MPI_Test(&r->req, &flag, &st);
    avgpipe__mpi_unlock(m);
    if (rc != MPI_SUCCESS && !flag) flag = 1; /* an error finishes it */
    if (!flag) return 0;
    *res = avgpipe__mpi_finish(m, r, rc, &st, status);
    return 1;
}

static avgpipe_result avgpipe__mpi_test(void *user, int self, avgpipe_comm_request req, int *done, avgpipe_comm_status *status) {
    avgpipe__mpi *m = (avgpipe__mpi *)user;
    avgpipe_result res = AVGPIPE_OK;
    (void)self;
    if (!req || !done) return AVGPIPE_INVALID_ARG;
    *done = avgpipe__mpi_poll(m, (avgpipe__mpi_req *)(void *)req, status, &res);
    if (!*done && avgpipe__mpi_aborted(m)) return AVGPIPE_ABORTED;
    return res;
}

/* Poll fn(arg) until it reports done, spinning then sleeping with back-off, within timeout_s. */
static avgpipe_result avgpipe__mpi_until(avgpipe__mpi *m, double timeout_s, int (*fn)(avgpipe__mpi *, void *), void *arg) {
    double t0 = avgpipe__mpi_now(), sleep_us = 1, now;
    for (;;) {
        if (fn(m, arg)) return AVGPIPE_OK;
        if (avgpipe__mpi_aborted(m)) return AVGPIPE_ABORTED;
        now = avgpipe__mpi_now();
        if (now - t0 >= timeout_s) return AVGPIPE_TIMEOUT;
        if ((now - t0) * 1e6 < m->desc.spin_us) continue;
        avgpipe__mpi_sleep_us(sleep_us);
        sleep_us = sleep_us * 2 < m->desc.max_sleep_us ? sleep_us * 2 : m->desc.max_sleep_us;
    }
}

typedef struct avgpipe__mpi_wait_arg {
    avgpipe__mpi_req *r;
    avgpipe_comm_status *status;
    avgpipe_result res;
} avgpipe__mpi_wait_arg;

static int avgpipe__mpi_wait_fn(avgpipe__mpi *m, void *arg) {
    avgpipe__mpi_wait_arg *a = (avgpipe__mpi_wait_arg *)arg;
    return avgpipe__mpi_poll(m, a->r, a->status, &a->res);
}

static avgpipe_result avgpipe__mpi_wait(void *user, int self, avgpipe_comm_request req, double timeout_s, avgpipe_comm_status *status) {
    avgpipe__mpi *m = (avgpipe__mpi *)user;
    avgpipe__mpi_wait_arg a;
    avgpipe_result res;
    (void)self;
    if (!req) return AVGPIPE_INVALID_ARG;
    a.r = (avgpipe__mpi_req *)(void *)req, a.status = status, a.res = AVGPIPE_OK;
    res = avgpipe__mpi_until(m, timeout_s, avgpipe__mpi_wait_fn, &a);
    if (res == AVGPIPE_TIMEOUT) {
        pthread_mutex_lock(&m->mu);
        snprintf(m->err, sizeof m->err, "rank %d: nothing from rank %d within %.3g s (is it alive?)", m->rank, a.r->peer, timeout_s);
        pthread_mutex_unlock(&m->mu);
    }
    return res ? res : a.res;
}

static void avgpipe__mpi_cancel(void *user, int self, avgpipe_comm_request req) {
    avgpipe__mpi *m = (avgpipe__mpi *)user;
    avgpipe__mpi_req *r = (avgpipe__mpi_req *)(void *)req;
    avgpipe_result res;
    double t0 = avgpipe__mpi_now();
    (void)self;
    if (!r) return;
    if (!r->send) {
        avgpipe__mpi_lock(m);
        MPI_Cancel(&r->req);
        MPI_Request_free(&r->req);
        avgpipe__mpi_unlock(m);
        m->alloc.free(r, m->alloc.user);
        return;
    }
    while (avgpipe__mpi_now() - t0 < 0.1) { /* a send may be just about to finish */
        if (avgpipe__mpi_poll(m, r, NULL, &res)) return;
        avgpipe__mpi_sleep_us(100);
    }
    avgpipe__mpi_lock(m);
    MPI_Request_free(&r->req);
    avgpipe__mpi_unlock(m);
    m->alloc.free(r, m->alloc.user);
}

typedef struct avgpipe__mpi_coll {
    MPI_Request req;
    int rc;
} avgpipe__mpi_coll;

static int avgpipe__mpi_coll_fn(avgpipe__mpi *m, void *arg) {
    avgpipe__mpi_coll *c = (avgpipe__mpi_coll *)arg;
    int flag = 0;
    avgpipe__mpi_lock(m);
    c->rc = MPI_Test(&c->req, &flag, MPI_STATUS_IGNORE);
    avgpipe__mpi_unlock(m);
    return flag || c->rc != MPI_SUCCESS;
}

/* Wait for a started collective; a timeout leaves it inside MPI and the communicator broken. */
static avgpipe_result avgpipe__mpi_coll_wait(avgpipe__mpi *m, avgpipe__mpi_coll *c, double timeout_s, const char *what) {
    avgpipe_result res = avgpipe__mpi_until(m, timeout_s, avgpipe__mpi_coll_fn, c);
    if (res == AVGPIPE_OK && c->rc != MPI_SUCCESS) return avgpipe__mpi_error(m, c->rc, what);
    if (res != AVGPIPE_OK) {
        pthread_mutex_lock(&m->mu);
        m->broken = 1;
        if (res == AVGPIPE_TIMEOUT)
            snprintf(m->err, sizeof m->err, "rank %d: %s: not every rank joined within %.3g s (the communicator is now unusable)", m->rank,
                     what, timeout_s);
        pthread_mutex_unlock(&m->mu);
    }
    return res;
}

static avgpipe_result avgpipe__mpi_check_coll(avgpipe__mpi *m, int self, const char *what) {
    if (self != m->rank) return AVGPIPE_INVALID_ARG;
    if (avgpipe__mpi_aborted(m)) return AVGPIPE_ABORTED;
    if (m->broken) {
        snprintf(m->err, sizeof m->err, "rank %d: %s: an earlier collective timed out; the communicator is unusable", m->rank, what);
        return AVGPIPE_STATE_ERROR;
    }
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__mpi_barrier(void *user, int self, double timeout_s) {
    avgpipe__mpi *m = (avgpipe__mpi *)user;
    avgpipe__mpi_coll c;
    avgpipe_result res = avgpipe__mpi_check_coll(m, self, "barrier");
    if (res) return res;
    avgpipe__mpi_lock(m);
    c.rc = MPI_Ibarrier(m->comm, &c.req);
    avgpipe__mpi_unlock(m);
    if (c.rc != MPI_SUCCESS) return avgpipe__mpi_error(m, c.rc, "MPI_Ibarrier");
    return avgpipe__mpi_coll_wait(m, &c, timeout_s, "barrier");
}

static avgpipe_result avgpipe__mpi_allreduce(void *user, int self, float *buf, size_t count, double timeout_s) {
    avgpipe__mpi *m = (avgpipe__mpi *)user;
    avgpipe__mpi_coll c;
    float *all = NULL;
    avgpipe_result res = avgpipe__mpi_check_coll(m, self, "allreduce");
    if (res) return res;
    if ((!buf && count) || count > (size_t)INT_MAX / (size_t)m->size) return AVGPIPE_INVALID_ARG;
    if (!m->desc.fast_allreduce) {
        all = (float *)m->alloc.alloc((count ? count : 1) * sizeof(float) * (size_t)m->size, m->alloc.user);
        if (!all) return AVGPIPE_OUT_OF_MEMORY;
    }
    avgpipe__mpi_lock(m);
    if (m->desc.fast_allreduce) c.rc = MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, m->comm, &c.req);
    else c.rc = MPI_Iallgather(buf, (int)count, MPI_FLOAT, all, (int)count, MPI_FLOAT, m->comm, &c.req);
    avgpipe__mpi_unlock(m);
    if (c.rc != MPI_SUCCESS) res = avgpipe__mpi_error(m, c.rc, m->desc.fast_allreduce ? "MPI_Iallreduce" : "MPI_Iallgather");
    else res = avgpipe__mpi_coll_wait(m, &c, timeout_s, "allreduce");
    if (res == AVGPIPE_OK && all) /* in rank order: every rank, every run, the in-process backend: the same bits */
        avgpipe_comm_sum_ranks(buf, all, count, m->size, count);
    if (all && res != AVGPIPE_TIMEOUT && res != AVGPIPE_ABORTED) m->alloc.free(all, m->alloc.user); /* else MPI may still write it */
    return res;
}

static void avgpipe__mpi_abort(void *user, avgpipe_result why, const char *message) {
    avgpipe__mpi *m = (avgpipe__mpi *)user;
    int first, r;
    pthread_mutex_lock(&m->mu);
    first = !m->aborted;
    if (first) {
        m->aborted = 1;
        snprintf(m->abort_msg, sizeof m->abort_msg, "%.200s (%.40s)", message ? message : "", avgpipe_result_string(why));
        snprintf(m->notice_out, sizeof m->notice_out, "%s", m->abort_msg);
    }
    pthread_mutex_unlock(&m->mu);
    if (!first || m->desc.no_abort_notices || !m->notice_sends) return;
    avgpipe__mpi_lock(m);
    for (r = 0; r < m->size; r++) /* best effort: never waited for (the peer may be gone) */
        if (r != m->rank) MPI_Isend(m->notice_out, AVGPIPE__MPI_NOTICE, MPI_CHAR, r, 1, m->ctl, &m->notice_sends[r]);
    avgpipe__mpi_unlock(m);
}

static const char *avgpipe__mpi_last_error(void *user, int self) {
    avgpipe__mpi *m = (avgpipe__mpi *)user;
    (void)self;
    return m->aborted && !m->err[0] ? m->abort_msg : m->err;
}

static void avgpipe__mpi_destroy(void *user) {
    avgpipe__mpi *m = (avgpipe__mpi *)user;
    int r, flag = 0;
    if (!m) return;
    if (m->notice_req != MPI_REQUEST_NULL) {
        MPI_Cancel(&m->notice_req);
        MPI_Request_free(&m->notice_req);
    }
    for (r = 0; m->notice_sends && r < m->size; r++)
        if (m->notice_sends[r] != MPI_REQUEST_NULL) {
            MPI_Test(&m->notice_sends[r], &flag, MPI_STATUS_IGNORE);
            if (!flag) MPI_Request_free(&m->notice_sends[r]);
        }
    if (m->ctl != MPI_COMM_NULL) MPI_Comm_free(&m->ctl);
    if (m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
    if (m->notice_sends) m->alloc.free(m->notice_sends, m->alloc.user);
    pthread_mutex_destroy(&m->mu);
    pthread_mutex_destroy(&m->notice_mu);
    m->magic = 0;
    m->alloc.free(m, m->alloc.user);
}

static avgpipe_result avgpipe__mpi_split(void *user, int self, const int *members, int count, avgpipe_comm *out);

static void avgpipe__mpi_table(avgpipe__mpi *m, avgpipe_comm *out) {
    memset(out, 0, sizeof *out);
    out->name = "mpi";
    out->size = m->size;
    out->isend = avgpipe__mpi_isend;
    out->irecv = avgpipe__mpi_irecv;
    out->test = avgpipe__mpi_test;
    out->wait = avgpipe__mpi_wait;
    out->cancel = avgpipe__mpi_cancel;
    out->barrier = avgpipe__mpi_barrier;
    out->allreduce_sum = avgpipe__mpi_allreduce;
    out->split = avgpipe__mpi_split;
    out->abort = avgpipe__mpi_abort;
    out->last_error = avgpipe__mpi_last_error;
    out->destroy = avgpipe__mpi_destroy;
    out->user = m;
}

/* A backend over `base` (duplicated twice: messages, notices). */
static avgpipe_result avgpipe__mpi_new(avgpipe_context *ctx, const avgpipe_mpi_desc *d, MPI_Comm base, avgpipe__mpi *parent,
                                       avgpipe_comm *out) {
    avgpipe__mpi *m;
    int rc, flag = 0, level = 0, r;
    void *ub = NULL;
    m = (avgpipe__mpi *)avgpipe_alloc(ctx, sizeof *m);
    if (!m) return avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_mpi_create: out of memory");
    memset(m, 0, sizeof *m);
    m->magic = AVGPIPE__MPI_MAGIC;
    m->desc = *d;
    m->alloc = avgpipe_context_query(ctx).allocator;
    m->comm = m->ctl = MPI_COMM_NULL;
    m->notice_req = MPI_REQUEST_NULL;
    m->parent = parent;
    pthread_mutex_init(&m->mu, NULL);
    pthread_mutex_init(&m->notice_mu, NULL);
    MPI_Query_thread(&level);
    m->serialize = level < MPI_THREAD_MULTIPLE;
    rc = MPI_Comm_dup(base, &m->comm);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_dup(base, &m->ctl);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(m->ctl, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(m->comm, &m->rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(m->comm, &m->size);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_get_attr(m->comm, MPI_TAG_UB, &ub, &flag);
    if (rc != MPI_SUCCESS) {
        avgpipe__mpi_error(m, rc, "setting up the communicators");
        avgpipe_set_error(ctx, AVGPIPE_BACKEND_ERROR, "avgpipe_mpi_create: %s", m->err);
        avgpipe__mpi_destroy(m);
        return AVGPIPE_BACKEND_ERROR;
    }
    m->tag_mod = flag && ub ? (long)*(int *)ub + 1 : 32768;
    m->notice_sends = (MPI_Request *)avgpipe_alloc(ctx, (size_t)m->size * sizeof(MPI_Request));
    if (!m->notice_sends) {
        avgpipe__mpi_destroy(m);
        return avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_mpi_create: out of memory");
    }
    for (r = 0; r < m->size; r++) m->notice_sends[r] = MPI_REQUEST_NULL;
    rc = MPI_Irecv(m->notice_in, AVGPIPE__MPI_NOTICE, MPI_CHAR, MPI_ANY_SOURCE, 1, m->ctl, &m->notice_req);
    if (rc != MPI_SUCCESS) {
        avgpipe__mpi_error(m, rc, "MPI_Irecv (abort notices)");
        avgpipe_set_error(ctx, AVGPIPE_BACKEND_ERROR, "avgpipe_mpi_create: %s", m->err);
        avgpipe__mpi_destroy(m);
        return AVGPIPE_BACKEND_ERROR;
    }
    avgpipe__mpi_table(m, out);
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__mpi_split(void *user, int self, const int *members, int count, avgpipe_comm *out) {
    avgpipe__mpi *m = (avgpipe__mpi *)user;
    MPI_Comm sub = MPI_COMM_NULL;
    avgpipe_context_desc cd;
    avgpipe_context ctx;
    avgpipe_result res;
    int i, key = -1, rc;
    if (!out || !members || count < 1 || count > m->size || self != m->rank) return AVGPIPE_INVALID_ARG;
    for (i = 0; i < count; i++)
        if (members[i] == self) key = i;
    if (key < 0) {
        snprintf(m->err, sizeof m->err, "rank %d: split: not among the %d members it passed", self, count);
        return AVGPIPE_INVALID_ARG;
    }
    avgpipe__mpi_lock(m);
    rc = MPI_Comm_split(m->comm, members[0], key, &sub);
    avgpipe__mpi_unlock(m);
    if (rc != MPI_SUCCESS) return avgpipe__mpi_error(m, rc, "MPI_Comm_split");
    memset(&cd, 0, sizeof cd);
    cd.allocator = m->alloc;
    avgpipe_context_init(&ctx, &cd);
    res = avgpipe__mpi_new(&ctx, &m->desc, sub, m, out);
    MPI_Comm_free(&sub); /* the backend keeps its own duplicates */
    if (res) snprintf(m->err, sizeof m->err, "rank %d: split: %.200s", self, avgpipe_last_error(&ctx));
    return res;
}

AVGPIPE_API avgpipe_mpi_desc avgpipe_mpi_query_defaults(const avgpipe_mpi_desc *desc) {
    avgpipe_mpi_desc d, zero;
    memset(&d, 0, sizeof d);
    memset(&zero, 0, sizeof zero);
    if (desc) d = *desc;
    if (memcmp(&d.comm, &zero.comm, sizeof d.comm) == 0 || d.comm == MPI_COMM_NULL) d.comm = MPI_COMM_WORLD;
    if (d.spin_us == 0) d.spin_us = 50;
    if (d.max_sleep_us == 0) d.max_sleep_us = 200;
    return d;
}

AVGPIPE_API avgpipe_result avgpipe_mpi_init(avgpipe_context *ctx, int *argc, char ***argv) {
    int inited = 0, level = 0, rc;
    MPI_Initialized(&inited);
    if (!inited) {
        rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &level);
        if (rc != MPI_SUCCESS) return avgpipe_set_error(ctx, AVGPIPE_BACKEND_ERROR, "avgpipe_mpi_init: MPI_Init_thread failed (error %d)", rc);
    } else {
        MPI_Query_thread(&level);
    }
    if (level < MPI_THREAD_SERIALIZED)
        return avgpipe_set_error(ctx, AVGPIPE_UNSUPPORTED, "avgpipe_mpi_init: MPI gives thread level %d; avgpipe needs MPI_THREAD_SERIALIZED (%d) "
                             "or, better, MPI_THREAD_MULTIPLE (%d): stage workers and averaging threads call MPI", level,
                             MPI_THREAD_SERIALIZED, MPI_THREAD_MULTIPLE);
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_result avgpipe_mpi_create(avgpipe_context *ctx, const avgpipe_mpi_desc *desc, avgpipe_comm *out) {
    avgpipe_mpi_desc d = avgpipe_mpi_query_defaults(desc);
    int inited = 0, finalized = 0, level = 0;
    if (!out) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_mpi_create: out is NULL");
    memset(out, 0, sizeof *out);
    if (d.spin_us < 0 || d.max_sleep_us < 0)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_mpi_create: spin_us and max_sleep_us must be >= 0");
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (!inited || finalized)
        return avgpipe_set_error(ctx, AVGPIPE_STATE_ERROR, "avgpipe_mpi_create: MPI is %s (call avgpipe_mpi_init first)",
                             finalized ? "finalized" : "not initialised");
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_SERIALIZED)
        return avgpipe_set_error(ctx, AVGPIPE_UNSUPPORTED, "avgpipe_mpi_create: MPI was initialised with thread level %d; avgpipe needs at least "
                             "MPI_THREAD_SERIALIZED (use avgpipe_mpi_init, or MPI_Init_thread with MPI_THREAD_MULTIPLE)", level);
    return avgpipe__mpi_new(ctx, &d, d.comm, NULL, out);
}

AVGPIPE_API int avgpipe_mpi_rank(const avgpipe_comm *comm) {
    const avgpipe__mpi *m;
    if (!comm || comm->isend != avgpipe__mpi_isend || !comm->user) return -1;
    m = (const avgpipe__mpi *)comm->user;
    return m->magic == AVGPIPE__MPI_MAGIC ? m->rank : -1;
}

#ifdef __cplusplus
}
#endif
#endif /* AVGPIPE_MPI_IMPLEMENTATION */
