/* NCCL smoke test of avgpipe_nccl.h, for the ranks the machine has: one process per GPU (one rank per
   process, one GPU per rank: the backend's rule).

     nccl_check [--ranks N] [--timeout S]   launcher: N processes (default: one per GPU), bootstrapped
                                            through an id file in a fresh directory under /tmp
     mpirun -np N nccl_check --mpi          the same checks, the id broadcast over MPI (when built with MPI)

   With GPUs, each rank checks: creation; ping-pong of device buffers through isend_on/irecv_on inside
   groups, ordered on the device by `ready`/`done` events only (the host never waits between the two
   hops), bit-exact, with its bandwidth; both directions at once with messages larger than NCCL's buffers
   (the deadlock separate up/down communicators avoid), posted one call at a time, no group; plain
   isend/irecv of host buffers (staged); allreduce_sum on device and host memory against a host sum, and
   the deterministic variant bit for bit against the rank-order sum; split (reversed members: ranks
   renumbered) with an allreduce on the child; a wait that times out (the request stays pending and
   completes later); abort (pending and later calls return AVGPIPE_ABORTED at once). With one GPU, the
   two-rank checks are skipped and one more runs: two ranks on the same GPU must be refused with NCCL's
   text. Without a GPU, it checks that creation fails cleanly with CUDA's text on every rank (nothing
   allocated left behind, no hang) and exits 0 with a notice.

   Every line it prints starts with "nccl_check"; a failure exits non-zero. Each process is bounded by
   --timeout (default 240 s; the launcher kills what is left). */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#ifdef NCCL_CHECK_MPI
#include "avgpipe_mpi.h"
#endif
#include "avgpipe_nccl.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int g_rank = -1, g_size = 0, g_failed = 0;
static double g_timeout = 240;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define SAY(...)                                        \
    do {                                                \
        printf("nccl_check rank %d: ", g_rank);         \
        printf(__VA_ARGS__);                            \
        printf("\n");                                   \
        fflush(stdout);                                 \
    } while (0)

#define CHECK(cond, ...)                                \
    do {                                                \
        if (!(cond)) {                                  \
            printf("nccl_check rank %d: FAILED (%s:%d): ", g_rank, __FILE__, __LINE__); \
            printf(__VA_ARGS__);                        \
            printf("\n");                               \
            fflush(stdout);                             \
            g_failed = 1;                               \
            return 1;                                   \
        }                                               \
    } while (0)

#define CUDA(call) CHECK((call) == cudaSuccess, "%s: %s", #call, cudaGetErrorString(cudaGetLastError()))
#define OK(comm, call)                                                                                         \
    do {                                                                                                       \
        avgpipe_result r_ = (call);                                                                            \
        CHECK(r_ == AVGPIPE_OK, "%s: %s: %s", #call, avgpipe_result_string(r_),                                \
              (comm)->last_error ? (comm)->last_error((comm)->user, g_rank) : "");                             \
    } while (0)

/* ---- an allocator that counts (creation must give everything back when it fails) ---- */
static long g_allocs, g_frees;
static void *count_alloc(size_t n, void *u) {
    void *p = malloc(n);
    (void)u;
    g_allocs += p != NULL;
    return p;
}
static void count_free(void *p, void *u) {
    (void)u;
    if (p) g_frees++, free(p);
}

/* ---- the pieces ---- */

/* Ping-pong between ranks a < b: a fills, sends (up), b receives, copies and marks its reply, sends it back
   (down); every step ordered on the device by events; a checks every byte. Groups on both sides. */
static int pingpong(avgpipe_comm *c, int a, int b, size_t n, int iters, double *gbps) {
    cudaStream_t s;
    cudaEvent_t ready_send, ready_recv, sent, recvd;
    unsigned char *buf, *back, *host;
    avgpipe_comm_request rq[2];
    double t0 = 0;
    int it, me = g_rank;
    size_t i;
    CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CUDA(cudaEventCreateWithFlags(&ready_send, cudaEventDisableTiming));
    CUDA(cudaEventCreateWithFlags(&ready_recv, cudaEventDisableTiming));
    CUDA(cudaEventCreateWithFlags(&sent, cudaEventDisableTiming));
    CUDA(cudaEventCreateWithFlags(&recvd, cudaEventDisableTiming));
    CUDA(cudaMalloc((void **)&buf, n));
    CUDA(cudaMalloc((void **)&back, n));
    host = (unsigned char *)malloc(n);
    CHECK(host != NULL, "malloc");
    CUDA(cudaEventRecord(ready_recv, s));
    for (it = -1; it < iters; it++) { /* iteration -1 warms up (not timed) */
        unsigned char v = (unsigned char)(it * 37 + 11);
        if (it == 0) {
            OK(c, c->barrier(c->user, me, g_timeout));
            t0 = now_s();
        }
        if (me == a) { /* both transfers in one group */
            OK(c, c->group_begin(c->user, me));
            CUDA(cudaStreamWaitEvent(s, sent, 0));    /* the previous send has read buf */
            CUDA(cudaMemsetAsync(buf, v, n, s));       /* the "producer" */
            CUDA(cudaEventRecord(ready_send, s));
            OK(c, c->isend_on(c->user, me, b, buf, n, 100u + (uint32_t)(it + 1), (avgpipe_device_event)(void *)ready_send,
                              (avgpipe_device_event)(void *)sent, &rq[0]));
            OK(c, c->irecv_on(c->user, me, b, back, n, 200u + (uint32_t)(it + 1), (avgpipe_device_event)(void *)ready_recv,
                              (avgpipe_device_event)(void *)recvd, &rq[1]));
            OK(c, c->group_end(c->user, me));
        } else {
            /* the receive on its own: `done` is recorded when the call (or its group) is issued, so the
               reply's copy, ordered after it, comes after that */
            OK(c, c->irecv_on(c->user, me, a, buf, n, 100u + (uint32_t)(it + 1), (avgpipe_device_event)(void *)ready_recv,
                              (avgpipe_device_event)(void *)recvd, &rq[1]));
            /* the reply: a copy of what arrived, first byte marked; ordered after the receive on the device */
            CUDA(cudaStreamWaitEvent(s, recvd, 0));
            CUDA(cudaStreamWaitEvent(s, sent, 0));
            CUDA(cudaMemcpyAsync(back, buf, n, cudaMemcpyDeviceToDevice, s));
            CUDA(cudaMemsetAsync(back, 0xEE, 1, s));
            CUDA(cudaEventRecord(ready_send, s));
            CUDA(cudaEventRecord(ready_recv, s)); /* buf's last reader was the copy */
            OK(c, c->group_begin(c->user, me));
            OK(c, c->isend_on(c->user, me, a, back, n, 200u + (uint32_t)(it + 1), (avgpipe_device_event)(void *)ready_send,
                              (avgpipe_device_event)(void *)sent, &rq[0]));
            OK(c, c->group_end(c->user, me));
        }
        if (me == a) { /* check every byte of the reply, after `recvd` on the device */
            CUDA(cudaStreamWaitEvent(s, recvd, 0));
            CUDA(cudaMemcpyAsync(host, back, n, cudaMemcpyDeviceToHost, s));
            CUDA(cudaEventRecord(ready_recv, s));
            CUDA(cudaStreamSynchronize(s));
            CHECK(host[0] == 0xEE, "iteration %d, %zu bytes: the reply's mark is %#x", it, n, host[0]);
            for (i = 1; i < n; i++) CHECK(host[i] == v, "iteration %d, %zu bytes: byte %zu is %#x, sent %#x", it, n, i, host[i], v);
        }
        OK(c, c->wait(c->user, me, rq[0], g_timeout, NULL));
        OK(c, c->wait(c->user, me, rq[1], g_timeout, NULL));
    }
    *gbps = 2.0 * (double)n * iters / (now_s() - t0) / 1e9;
    CUDA(cudaStreamSynchronize(s));
    cudaFree(buf), cudaFree(back), free(host);
    cudaEventDestroy(ready_send), cudaEventDestroy(ready_recv), cudaEventDestroy(sent), cudaEventDestroy(recvd);
    cudaStreamDestroy(s);
    return 0;
}

/* Ranks a < b send each other n bytes at the same time, each call on its own (no group): a's send goes
   up, b's down. On one stream per rank, with n beyond NCCL's buffers, this would deadlock. */
static int both_directions(avgpipe_comm *c, int a, int b, size_t n, double *ms) {
    unsigned char *out, *in, *host;
    avgpipe_comm_request s, r;
    int me = g_rank, other = me == a ? b : a;
    unsigned char mine = (unsigned char)(0x30 + me), theirs = (unsigned char)(0x30 + other);
    double t0;
    size_t i;
    CUDA(cudaMalloc((void **)&out, n));
    CUDA(cudaMalloc((void **)&in, n));
    CUDA(cudaMemset(out, mine, n));
    CUDA(cudaMemset(in, 0, n));
    CUDA(cudaDeviceSynchronize()); /* plain isend: the buffer must hold its data when it is called */
    host = (unsigned char *)malloc(n);
    CHECK(host != NULL, "malloc");
    OK(c, c->barrier(c->user, me, g_timeout));
    t0 = now_s();
    OK(c, c->isend(c->user, me, other, out, n, 7, &s));
    OK(c, c->irecv(c->user, me, other, in, n, 7, &r));
    OK(c, c->wait(c->user, me, r, 60, NULL));
    OK(c, c->wait(c->user, me, s, 60, NULL));
    *ms = (now_s() - t0) * 1e3;
    CUDA(cudaMemcpy(host, in, n, cudaMemcpyDeviceToHost));
    for (i = 0; i < n; i += 4093) CHECK(host[i] == theirs, "byte %zu is %#x, expected %#x", i, host[i], theirs);
    CHECK(host[n - 1] == theirs, "the last byte is %#x", host[n - 1]);
    cudaFree(out), cudaFree(in), free(host);
    return 0;
}

/* Plain isend/irecv of host memory (staged through the device): exact bytes; the send buffer is reused
   at once after isend returns. */
static int host_messages(avgpipe_comm *c, int a, int b) {
    size_t n = (1u << 20) + 13, i;
    unsigned char *out = (unsigned char *)malloc(n), *in = (unsigned char *)malloc(n);
    avgpipe_comm_request s, r;
    avgpipe_comm_status st;
    int me = g_rank, other = me == a ? b : a;
    CHECK(out && in, "malloc");
    for (i = 0; i < n; i++) out[i] = (unsigned char)(i * 7 + (size_t)me);
    memset(in, 0, n);
    OK(c, c->isend(c->user, me, other, out, n, 9, &s));
    memset(out, 0xFF, n); /* the backend copied it before isend returned */
    OK(c, c->irecv(c->user, me, other, in, n, 9, &r));
    OK(c, c->wait(c->user, me, r, g_timeout, &st));
    OK(c, c->wait(c->user, me, s, g_timeout, NULL));
    CHECK(st.tag == 9 && st.bytes == n, "status tag %u bytes %zu", (unsigned)st.tag, st.bytes);
    for (i = 0; i < n; i++) CHECK(in[i] == (unsigned char)(i * 7 + (size_t)other), "host message byte %zu", i);
    free(out), free(in);
    return 0;
}

static float value(int r, size_t i) { return (float)((double)(i % 977) * 0.001 + 0.25 * r + 1e-7 * (double)(i % 13)); }

/* allreduce_sum on device and host memory; exact = 1: the bits of the rank-order sum. */
static int allreduce(avgpipe_comm *c, int size, size_t count, int exact, const char *name, double *ms) {
    float *d, *h = (float *)malloc(count * sizeof(float)), *got = (float *)malloc(count * sizeof(float));
    size_t i;
    int r, me = c->size == size ? avgpipe_nccl_rank(c) : -1;
    double t0, worst = 0;
    CHECK(h && got && me >= 0, "setup");
    for (i = 0; i < count; i++) h[i] = value(me, i);
    CUDA(cudaMalloc((void **)&d, count * sizeof(float)));
    CUDA(cudaMemcpy(d, h, count * sizeof(float), cudaMemcpyHostToDevice));
    OK(c, c->barrier(c->user, me, g_timeout));
    t0 = now_s();
    OK(c, c->allreduce_sum(c->user, me, d, count, g_timeout));
    *ms = (now_s() - t0) * 1e3;
    OK(c, c->allreduce_sum(c->user, me, h, count, g_timeout)); /* host memory: staged */
    CUDA(cudaMemcpy(got, d, count * sizeof(float), cudaMemcpyDeviceToHost));
    for (i = 0; i < count; i++) {
        float want = 0;
        double rel;
        for (r = 0; r < size; r++) want += value(r, i);
        if (exact) {
            CHECK(memcmp(&got[i], &want, 4) == 0 && memcmp(&h[i], &want, 4) == 0, "%s: element %zu: %.9g / %.9g, rank order gives %.9g", name,
                  i, got[i], h[i], want);
        } else {
            rel = (got[i] - want) / (want != 0 ? want : 1);
            if (rel < 0) rel = -rel;
            if (rel > worst) worst = rel;
            CHECK(rel <= 1e-6 * size, "%s: element %zu: %.9g, expected %.9g", name, i, got[i], want);
            rel = (h[i] - want) / (want != 0 ? want : 1);
            CHECK(rel <= 1e-6 * size && rel >= -1e-6 * size, "%s (host memory): element %zu: %.9g, expected %.9g", name, i, h[i], want);
        }
    }
    if (!exact) SAY("%s: worst relative difference from the rank-order sum %.2e", name, worst);
    cudaFree(d), free(h), free(got);
    return 0;
}

/* Reversed members: rank r becomes size-1-r in the child, whose allreduce sums the same. */
static int split_check(avgpipe_comm *c, int size) {
    int *members = (int *)malloc((size_t)size * sizeof(int)), i, me = g_rank;
    avgpipe_comm sub, solo;
    double ms;
    float one = 1.0f + (float)me, *d;
    CHECK(members != NULL, "malloc");
    for (i = 0; i < size; i++) members[i] = size - 1 - i;
    OK(c, c->split(c->user, me, members, size, &sub));
    CHECK(avgpipe_nccl_rank(&sub) == size - 1 - me && sub.size == size, "split: rank %d size %d", avgpipe_nccl_rank(&sub), sub.size);
    if (allreduce(&sub, size, 4099, 0, "allreduce_sum on a split", &ms)) return 1;
    /* singletons: a group of one sums nothing else */
    OK(c, c->split(c->user, me, &me, 1, &solo));
    CUDA(cudaMalloc((void **)&d, sizeof(float)));
    CUDA(cudaMemcpy(d, &one, sizeof one, cudaMemcpyHostToDevice));
    OK(&solo, solo.allreduce_sum(solo.user, 0, d, 1, g_timeout));
    CUDA(cudaMemcpy(&one, d, sizeof one, cudaMemcpyDeviceToHost));
    CHECK(one == 1.0f + (float)me, "allreduce on a group of one changed the value to %g", one);
    cudaFree(d);
    avgpipe_comm_destroy(&solo);
    avgpipe_comm_destroy(&sub);
    free(members);
    return 0;
}

/* A receive nobody sends to yet: wait times out and leaves it pending; after a barrier the peer sends,
   and the same request completes. */
static int timeout_check(avgpipe_comm *c, int a, int b) {
    int me = g_rank;
    float *d;
    avgpipe_comm_request r;
    avgpipe_result res;
    double t0;
    int done = 1;
    CUDA(cudaMalloc((void **)&d, 1024));
    if (me == a) {
        OK(c, c->irecv(c->user, me, b, d, 1024, 5, &r));
        t0 = now_s();
        res = c->wait(c->user, me, r, 0.5, NULL);
        CHECK(res == AVGPIPE_TIMEOUT, "wait returned %s, not timeout", avgpipe_result_string(res));
        CHECK(now_s() - t0 >= 0.5 && now_s() - t0 < 3, "a 0.5 s wait took %.2f s", now_s() - t0);
        SAY("timeout: %s", c->last_error(c->user, me));
        OK(c, c->test(c->user, me, r, &done, NULL));
        CHECK(done == 0, "test says a receive nobody sent is done");
    }
    OK(c, c->barrier(c->user, me, g_timeout));
    if (me == b) {
        CUDA(cudaMemset(d, 1, 1024));
        CUDA(cudaDeviceSynchronize());
        OK(c, c->isend(c->user, me, a, d, 1024, 5, &r));
    }
    OK(c, c->wait(c->user, me, r, g_timeout, NULL));
    cudaFree(d);
    return 0;
}

/* abort: a pending wait and every later call return AVGPIPE_ABORTED at once; cancel releases. */
static int abort_check(avgpipe_comm *c, int peer) {
    int me = g_rank;
    float *d;
    avgpipe_comm_request r;
    avgpipe_result res;
    double t0;
    CUDA(cudaMalloc((void **)&d, 4096));
    OK(c, c->irecv(c->user, me, peer, d, 4096, 1, &r)); /* never sent */
    c->abort(c->user, AVGPIPE_CALLBACK_ERROR, "nccl_check's abort test");
    t0 = now_s();
    res = c->wait(c->user, me, r, 30, NULL);
    CHECK(res == AVGPIPE_ABORTED, "wait after abort: %s", avgpipe_result_string(res));
    CHECK(now_s() - t0 < 1, "wait after abort took %.2f s", now_s() - t0);
    c->cancel(c->user, me, r);
    res = c->barrier(c->user, me, 30);
    CHECK(res == AVGPIPE_ABORTED, "barrier after abort: %s", avgpipe_result_string(res));
    res = c->isend(c->user, me, peer, d, 16, 1, &r);
    CHECK(res == AVGPIPE_ABORTED, "isend after abort: %s", avgpipe_result_string(res));
    SAY("abort: %s", c->last_error(c->user, me));
    cudaFree(d);
    return 0;
}

/* ---- one rank ---- */

typedef struct boot {
    int mpi;
    const char *file;
    int device; /* -2: this rank's own GPU */
} boot;

static avgpipe_result create(avgpipe_context *ctx, const boot *b, int deterministic, int id_suffix, avgpipe_comm *out) {
    avgpipe_nccl_desc d;
    char path[600];
    memset(&d, 0, sizeof d);
    d.timeout_s = 60;
    d.deterministic_allreduce = deterministic;
    d.lazy_connect = deterministic; /* the second table: no eager connection */
    d.device = b->device >= 0 ? b->device : (b->mpi ? AVGPIPE_NCCL_DEVICE_LOCAL : g_rank);
#ifdef NCCL_CHECK_MPI
    if (b->mpi) return avgpipe_nccl_create_mpi(ctx, &d, MPI_COMM_WORLD, out);
#endif
    snprintf(path, sizeof path, "%s.%d", b->file, id_suffix);
    d.id_file = path, d.file_token = "nccl_check", d.rank = g_rank, d.size = g_size;
    return avgpipe_nccl_create(ctx, &d, out);
}

/* No GPU: creation must fail with CUDA's text, give back every allocation, and not hang. */
static int nogpu(const boot *b) {
    avgpipe_context ctx;
    avgpipe_context_desc cd;
    avgpipe_comm c;
    avgpipe_result r;
    double t0 = now_s();
    memset(&cd, 0, sizeof cd);
    cd.allocator.alloc = count_alloc, cd.allocator.free = count_free;
    avgpipe_context_init(&ctx, &cd);
    r = create(&ctx, b, 0, 0, &c);
    CHECK(r == AVGPIPE_BACKEND_ERROR, "creation without a GPU returned %s: %s", avgpipe_result_string(r), avgpipe_last_error(&ctx));
    CHECK(strstr(avgpipe_last_error(&ctx), "no usable CUDA device") || strstr(avgpipe_last_error(&ctx), "no CUDA device") ||
              strstr(avgpipe_last_error(&ctx), "could not set up its GPU"),
          "unexpected detail: %s", avgpipe_last_error(&ctx));
    CHECK(g_allocs == g_frees, "%ld allocations, %ld frees", g_allocs, g_frees);
    CHECK(now_s() - t0 < 30, "failing took %.1f s", now_s() - t0);
    SAY("no GPU: creation failed cleanly in %.2f s: %s", now_s() - t0, avgpipe_last_error(&ctx));
    return 0;
}

/* Two ranks on one GPU: NCCL must refuse, and creation must say so (not hang). */
static int duplicate_gpu(const boot *b) {
    avgpipe_context ctx;
    avgpipe_comm c;
    avgpipe_result r;
    avgpipe_context_init(&ctx, NULL);
    r = create(&ctx, b, 0, 9, &c);
    if (r == AVGPIPE_OK) avgpipe_comm_destroy(&c);
    CHECK(r == AVGPIPE_BACKEND_ERROR || r == AVGPIPE_TIMEOUT, "two ranks on GPU %d: %s: %s", b->device, avgpipe_result_string(r),
          avgpipe_last_error(&ctx));
    SAY("two ranks on one GPU refused (%s): %s", avgpipe_result_string(r), avgpipe_last_error(&ctx));
    return 0;
}

static int rank_main(const boot *b) {
    avgpipe_context ctx;
    avgpipe_comm c, det;
    int n = 0, a, peer;
    double t0 = now_s(), gbps, ms;
    size_t sz;
    if (b->device >= 0) return duplicate_gpu(b);
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return nogpu(b);
    avgpipe_context_init(&ctx, NULL);
    {
        avgpipe_result r = create(&ctx, b, 0, 0, &c);
        CHECK(r == AVGPIPE_OK, "create: %s: %s", avgpipe_result_string(r), avgpipe_last_error(&ctx));
    }
    SAY("created: %d ranks, device %d of %d, in %.2f s", c.size, avgpipe_nccl_device(&c), n, now_s() - t0);
    CHECK(g_size == 1 || g_size % 2 == 0, "use one rank or an even number of ranks (the two-rank checks run in pairs)");
    a = g_rank & ~1;
    peer = g_rank ^ 1;
    if (g_size >= 2) {
        for (sz = 4; sz <= ((size_t)64 << 20); sz *= 64) {
            if (pingpong(&c, a, a + 1, sz, sz < 4096 ? 200 : 20, &gbps)) return 1;
            SAY("ping-pong with rank %d, %zu bytes each way, isend_on/irecv_on ordered by events: ok, %.2f GB/s (both hops' bytes per second)",
                peer, sz, gbps);
        }
        if (both_directions(&c, a, a + 1, (size_t)256 << 20, &ms)) return 1;
        SAY("both directions at once, 256 MiB each way, one call at a time: ok in %.1f ms (%.1f GB/s each way)", ms,
            (double)(256 << 20) / ms / 1e6);
        if (host_messages(&c, a, a + 1)) return 1;
        SAY("plain isend/irecv of host memory (staged): ok");
    } else {
        SAY("one rank: the two-rank checks need two GPUs (skipped)");
    }
    if (allreduce(&c, g_size, ((size_t)1 << 22) + 3, 0, "allreduce_sum (NCCL's order)", &ms)) return 1;
    SAY("allreduce_sum of 4M floats: ok, %.2f ms", ms);
    if (split_check(&c, g_size)) return 1;
    SAY("split (reversed members, singletons) + allreduce_sum: ok");
    {
        avgpipe_result r = create(&ctx, b, 1, 1, &det);
        CHECK(r == AVGPIPE_OK, "create (deterministic): %s: %s", avgpipe_result_string(r), avgpipe_last_error(&ctx));
    }
    if (allreduce(&det, g_size, ((size_t)1 << 22) + 3, 1, "allreduce_sum (rank order)", &ms)) return 1;
    SAY("deterministic allreduce_sum of 4M floats: bit-identical to the rank-order sum, %.2f ms", ms);
    avgpipe_comm_destroy(&det);
    if (g_size >= 2) {
        if (timeout_check(&c, a, a + 1)) return 1;
        SAY("a timed-out wait leaves the request pending; it completes later: ok");
        if (abort_check(&c, peer)) return 1;
        SAY("abort: ok");
    } else {
        c.abort(c.user, AVGPIPE_CALLBACK_ERROR, "nccl_check's abort test");
        CHECK(c.barrier(c.user, 0, 10) == AVGPIPE_ABORTED, "barrier after abort");
        SAY("abort: ok");
    }
    avgpipe_comm_destroy(&c);
    SAY("all checks passed in %.1f s", now_s() - t0);
    return 0;
}

/* ---- the launcher: one process per rank, fresh (exec), so CUDA is never initialised before a fork ---- */

static int launch(const char *self, int ranks, int device, double limit) {
    char dir[] = "/tmp/avgpipe-nccl-check-XXXXXX", file[64], rs[16], ns[16], ds[16], ts[32];
    pid_t kids[64];
    int i, status, bad = 0, left;
    double t0 = now_s();
    if (ranks < 1 || ranks > 64) return 2;
    if (!mkdtemp(dir)) return 2;
    snprintf(file, sizeof file, "%s/nccl.id", dir);
    snprintf(ns, sizeof ns, "%d", ranks);
    snprintf(ds, sizeof ds, "%d", device);
    snprintf(ts, sizeof ts, "%g", limit);
    for (i = 0; i < ranks; i++) {
        snprintf(rs, sizeof rs, "%d", i);
        kids[i] = fork();
        if (kids[i] < 0) return 2;
        if (kids[i] == 0) {
            execl(self, self, "--rank", rs, "--size", ns, "--file", file, "--device", ds, "--timeout", ts, (char *)NULL);
            _exit(127);
        }
    }
    for (left = ranks; left > 0;) {
        pid_t p = waitpid(-1, &status, WNOHANG);
        if (p > 0) {
            left--;
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) bad = 1;
            continue;
        }
        if (now_s() - t0 > limit + 10) {
            printf("nccl_check: ranks still running after %.0f s: killed\n", limit + 10);
            for (i = 0; i < ranks; i++) kill(kids[i], SIGKILL);
            while (waitpid(-1, &status, 0) > 0) {}
            bad = 1;
            break;
        }
        {
            struct timespec ts2 = {0, 20000000};
            nanosleep(&ts2, NULL);
        }
    }
    for (i = 0; i < 10; i++) { /* the id files, if a failure left one */
        char p[96];
        snprintf(p, sizeof p, "%s.%d", file, i);
        remove(p);
    }
    rmdir(dir);
    return bad;
}

/* The number of GPUs, asked of a child process (the launcher itself never initialises CUDA). */
static int probe(const char *self) {
    char cmd[4200];
    FILE *p;
    int n = 0;
    snprintf(cmd, sizeof cmd, "'%s' --count", self);
    p = popen(cmd, "r");
    if (!p) return 0;
    if (fscanf(p, "%d", &n) != 1) n = 0;
    pclose(p);
    return n;
}

int main(int argc, char **argv) {
    boot b;
    int i, ranks = -1, launcher = 1, rc;
    char self[4096];
    ssize_t len;
    memset(&b, 0, sizeof b);
    b.device = -2;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--count")) {
            int n = 0;
            if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
            printf("%d\n", n);
            return 0;
        } else if (!strcmp(argv[i], "--mpi")) {
            b.mpi = 1, launcher = 0;
        } else if (i + 1 < argc && !strcmp(argv[i], "--ranks")) {
            ranks = atoi(argv[++i]);
        } else if (i + 1 < argc && !strcmp(argv[i], "--timeout")) {
            g_timeout = atof(argv[++i]);
        } else if (i + 1 < argc && !strcmp(argv[i], "--rank")) {
            g_rank = atoi(argv[++i]), launcher = 0;
        } else if (i + 1 < argc && !strcmp(argv[i], "--size")) {
            g_size = atoi(argv[++i]);
        } else if (i + 1 < argc && !strcmp(argv[i], "--file")) {
            b.file = argv[++i];
        } else if (i + 1 < argc && !strcmp(argv[i], "--device")) {
            b.device = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: nccl_check [--ranks N] [--timeout S] | --mpi (under mpirun)\n");
            return 2;
        }
    }
    if (!launcher) alarm((unsigned)(g_timeout + 5)); /* a hang ends a rank (SIGALRM); the launcher bounds itself */
    if (launcher) {
        int gpus;
        len = readlink("/proc/self/exe", self, sizeof self - 1);
        if (len <= 0) return 2;
        self[len] = 0;
        gpus = probe(self);
        if (ranks < 0) ranks = gpus >= 2 ? gpus & ~1 : 2; /* pairs */
        if (gpus == 0) printf("nccl_check: no GPU on this machine: checking that %d ranks fail cleanly\n", ranks);
        else printf("nccl_check: %d GPU%s, %d rank%s (one process each, id through a file)\n", gpus, gpus == 1 ? "" : "s", ranks, ranks == 1 ? "" : "s");
        fflush(stdout);
        if (gpus == 1) ranks = 1;
        rc = launch(self, ranks, -2, g_timeout);
        if (rc == 0 && gpus >= 1) { /* NCCL's one-GPU-per-rank rule, checked: two ranks on GPU 0 */
            printf("nccl_check: two ranks on GPU 0 (must be refused)\n");
            fflush(stdout);
            rc = launch(self, 2, 0, 90 < g_timeout ? 90 : g_timeout);
        }
        printf("nccl_check: %s\n", rc == 0 ? (gpus ? "all ranks passed" : "no GPU: creation fails cleanly on every rank (nothing else to check here)")
                                            : "FAILED");
        return rc == 0 ? 0 : 1;
    }
#ifdef NCCL_CHECK_MPI
    if (b.mpi) {
        avgpipe_context ctx;
        avgpipe_context_init(&ctx, NULL);
        if (avgpipe_mpi_init(&ctx, &argc, &argv) != AVGPIPE_OK) {
            printf("nccl_check: %s\n", avgpipe_last_error(&ctx));
            return 1;
        }
        MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
        MPI_Comm_size(MPI_COMM_WORLD, &g_size);
        rc = rank_main(&b);
        if (rc == 0) MPI_Finalize(); /* after a failure: exit without it (it may wait for a dead peer) */
        return rc;
    }
#else
    if (b.mpi) {
        printf("nccl_check: built without MPI\n");
        return 2;
    }
#endif
    if (g_rank < 0 || g_size < 1 || !b.file) return 2;
    return rank_main(&b) || g_failed;
}
