/* custom_comm.c — a communication backend written by the user, plugged into avgpipe's runtime.

   avgpipe moves activations and gradients between stage ranks through a table of function pointers
   (avgpipe_comm, section 13 of avgpipe.h). This file implements one from scratch over POSIX pipes
   between the stage threads of one process — the same shape a socket, RDMA or shared-memory backend
   would have:
     - one pipe per ordered pair of ranks (src -> dst); a message is a 16-byte header (size, tag) + payload;
     - isend / irecv queue a request on its channel: requests of a channel are served in posting order,
       so the k-th send from A to B meets B's k-th receive from A, whatever the tags (as in NCCL); the
       receive then checks the header: another tag or more bytes than its capacity fail it with
       AVGPIPE_MISMATCH (the payload is drained, so the stream stays in step), a smaller message is
       delivered (the runtime's variable micro-batch sizes), and its status says what arrived;
     - cancel() takes a request that has not started moving out of its queue;
     - the pipes are non-blocking; a rank moves bytes only when it calls into the backend (post, test,
       wait), and then for ALL its pending requests, so a large send makes progress while its rank
       waits for something else; a message larger than the pipe's buffer streams through in pieces;
     - every wait has a deadline (poll() with a timeout) -> AVGPIPE_TIMEOUT, request left pending;
     - abort() writes one byte into an "abort pipe" that every poll() also watches: all waiters of all
       ranks wake at once and return AVGPIPE_ABORTED (the self-pipe trick);
     - barrier and allreduce_sum go through rank 0 on a second set of pipes (sum in rank order, so
       every rank gets the same bits);
     - last_error per rank, destroy.
   It then checks the contract (FIFO matching, streaming, timeout, abort, collectives) and trains the
   same model with the built-in backend and with this one: the parameters must be bitwise equal, since
   the math does not depend on the transport (exit 1 otherwise).

   Build: gcc -std=c11 -O2 -I. examples/custom_comm.c -o custom_comm -lm -pthread */
#define _POSIX_C_SOURCE 200809L /* pipe, poll, fcntl, clock_gettime */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ==== The backend ============================================================================== */

/* avgpipe_comm_request is an opaque pointer: a backend points it at its own request type. */
typedef struct preq {
    struct preq *next;           /* next request on the same channel, in posting order */
    struct preq *prev_live, *next_live; /* every unreleased request of the rank (freed by destroy) */
    int send, peer, done, drain; /* drain: a mismatched payload being read into nowhere */
    avgpipe_result res;
    const unsigned char *sbuf;
    unsigned char *rbuf;
    uint64_t bytes;
    uint64_t hdr[2];     /* the header as sent / as received: size, tag */
    uint64_t off;        /* bytes moved so far, header included */
    uint32_t tag;
} preq;
enum { HDR = 16 };

typedef struct pqueue {
    preq *head, *tail;
    int broken; /* a receive met a message of another size: the stream is out of step */
} pqueue;

typedef struct prank {
    pqueue *sends, *recvs; /* [peer] */
    preq *live;
    struct pollfd *pfd;    /* 2 n + 1 entries */
    char err[256];
} prank;

typedef struct pcomm {
    int n;
    int *p2p, *coll; /* [(src * n + dst) * 2 + 0 read end / 1 write end], -1 where unused */
    int abort_fd[2];
    atomic_int aborted;
    pthread_mutex_t mu; /* serialises abort() */
    char abort_msg[256];
    prank *rank;
    atomic_llong bytes_moved, messages;
} pcomm;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}
static int rd_fd(const int *fds, int n, int src, int dst) { return fds[(src * n + dst) * 2]; }
static int wr_fd(const int *fds, int n, int src, int dst) { return fds[(src * n + dst) * 2 + 1]; }
static int poll_ms(double left) { return left > 3600 ? 3600000 : (int)ceil(left * 1000); }

/* AVGPIPE_ABORTED, with abort()'s message as self's last error. */
static avgpipe_result aborted(pcomm *C, int self) {
    snprintf(C->rank[self].err, sizeof C->rank[self].err, "%s", C->abort_msg);
    return AVGPIPE_ABORTED;
}

/* Move what the pipe accepts / holds for the head requests of one channel, finishing them in order. */
static void pump(pcomm *C, int self, pqueue *q, int fd, int send) {
    prank *R = &C->rank[self];
    unsigned char sink[4096];
    while (q->head) {
        preq *r = q->head;
        uint64_t total = HDR + (!send && r->off >= HDR ? r->hdr[0] : r->bytes); /* a receive: the message's size once its header is in */
        while (!q->broken && r->off < total) {
            int in_hdr = r->off < HDR;
            uint64_t body = r->off - HDR;
            size_t len = (size_t)(in_hdr ? HDR - r->off : total - r->off);
            unsigned char *dst = in_hdr ? (unsigned char *)r->hdr + r->off : r->drain ? sink : r->rbuf + body;
            ssize_t k;
            if (!in_hdr && r->drain && len > sizeof sink) len = sizeof sink;
            k = send ? write(fd, in_hdr ? (unsigned char *)r->hdr + r->off : r->sbuf + body, len) : read(fd, dst, len);
            if (k < 0 && errno == EINTR) continue;
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return; /* pipe full / empty: later */
            if (k <= 0) {
                snprintf(R->err, sizeof R->err, "%s rank %d: %s", send ? "write to" : "read from", r->peer,
                         k ? strerror(errno) : "end of stream");
                r->res = AVGPIPE_BACKEND_ERROR;
                q->broken = 1;
                break;
            }
            r->off += (uint64_t)k;
            if (!send && r->off == HDR) total = HDR + r->hdr[0]; /* at most the receive's capacity (the comm contract) */
            if (!send && r->off == HDR && (r->hdr[0] > r->bytes || r->hdr[1] != r->tag)) { /* not the message it expects */
                snprintf(R->err, sizeof R->err, "receive of %llu bytes with tag %u from rank %d met a message of %llu bytes with tag %llu",
                         (unsigned long long)r->bytes, (unsigned)r->tag, r->peer, (unsigned long long)r->hdr[0],
                         (unsigned long long)r->hdr[1]);
                r->res = AVGPIPE_MISMATCH;
                r->drain = 1;
            }
        }
        if (q->broken && !r->res) r->res = AVGPIPE_BACKEND_ERROR; /* later requests of a broken stream */
        r->done = 1;
        q->head = r->next;
        if (!q->head) q->tail = NULL;
        if (!send && !r->res) atomic_fetch_add(&C->bytes_moved, (long long)r->hdr[0]), atomic_fetch_add(&C->messages, 1);
    }
}

static void progress(pcomm *C, int self) {
    for (int p = 0; p < C->n; p++)
        if (p != self) {
            pump(C, self, &C->rank[self].sends[p], wr_fd(C->p2p, C->n, self, p), 1);
            pump(C, self, &C->rank[self].recvs[p], rd_fd(C->p2p, C->n, p, self), 0);
        }
}

/* Sleep until one of self's channels can move, abort() is called, or ms pass. */
static void sleep_on_channels(pcomm *C, int self, int ms) {
    prank *R = &C->rank[self];
    nfds_t k = 0;
    for (int p = 0; p < C->n; p++) {
        if (R->sends[p].head) R->pfd[k++] = (struct pollfd){wr_fd(C->p2p, C->n, self, p), POLLOUT, 0};
        if (R->recvs[p].head) R->pfd[k++] = (struct pollfd){rd_fd(C->p2p, C->n, p, self), POLLIN, 0};
    }
    R->pfd[k++] = (struct pollfd){C->abort_fd[0], POLLIN, 0};
    poll(R->pfd, k, ms);
}

static avgpipe_result post(pcomm *C, int send, int self, int peer, const void *sbuf, void *rbuf, size_t bytes, uint32_t tag,
                           avgpipe_comm_request *req) {
    if (!req || self < 0 || self >= C->n || peer < 0 || peer >= C->n || peer == self || (bytes && !sbuf && !rbuf))
        return AVGPIPE_INVALID_ARG;
    if (atomic_load(&C->aborted)) return aborted(C, self);
    prank *R = &C->rank[self];
    preq *r = calloc(1, sizeof *r);
    if (!r) return AVGPIPE_OUT_OF_MEMORY;
    *r = (preq){.send = send, .peer = peer, .sbuf = sbuf, .rbuf = rbuf, .bytes = bytes, .hdr = {bytes, tag}, .tag = tag};
    r->next_live = R->live; /* track it, so destroy frees what an aborted run never waited for */
    if (R->live) R->live->prev_live = r;
    R->live = r;
    pqueue *q = send ? &R->sends[peer] : &R->recvs[peer];
    if (q->tail) q->tail->next = r;
    else q->head = r;
    q->tail = r;
    *req = (avgpipe_comm_request)(void *)r;
    progress(C, self); /* eager: small messages are gone before the caller returns */
    return AVGPIPE_OK;
}
static avgpipe_result pc_isend(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req) {
    return post(user, 1, self, peer, buf, NULL, bytes, tag, req);
}
static avgpipe_result pc_irecv(void *user, int self, int peer, void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req) {
    return post(user, 0, self, peer, NULL, buf, bytes, tag, req);
}

/* Free a finished (or cancelled) request; a receive's status says what its message carried. */
static avgpipe_result release(pcomm *C, int self, preq *r, avgpipe_comm_status *status) {
    prank *R = &C->rank[self];
    avgpipe_result res = r->res;
    if (status && !r->send) status->bytes = (size_t)r->hdr[0], status->tag = (uint32_t)r->hdr[1];
    if (r->prev_live) r->prev_live->next_live = r->next_live;
    else R->live = r->next_live;
    if (r->next_live) r->next_live->prev_live = r->prev_live;
    free(r);
    return res;
}

static avgpipe_result pc_test(void *user, int self, avgpipe_comm_request req, int *done, avgpipe_comm_status *status) {
    pcomm *C = user;
    preq *r = (preq *)(void *)req;
    if (!r || !done || self < 0 || self >= C->n) return AVGPIPE_INVALID_ARG;
    progress(C, self);
    *done = r->done;
    if (r->done) return release(C, self, r, status);
    return atomic_load(&C->aborted) ? aborted(C, self) : AVGPIPE_OK;
}

static avgpipe_result pc_wait(void *user, int self, avgpipe_comm_request req, double timeout_s, avgpipe_comm_status *status) {
    pcomm *C = user;
    preq *r = (preq *)(void *)req;
    double deadline = now_s() + (timeout_s > 0 ? timeout_s : 0);
    if (!r || self < 0 || self >= C->n) return AVGPIPE_INVALID_ARG;
    for (;;) {
        progress(C, self);
        if (r->done) return release(C, self, r, status);
        if (atomic_load(&C->aborted)) return aborted(C, self);
        double left = deadline - now_s();
        if (left <= 0) {
            snprintf(C->rank[self].err, sizeof C->rank[self].err, "%s rank %d: %llu of %llu bytes moved in %.3g s",
                     r->send ? "send to" : "receive from", r->peer, (unsigned long long)(r->off > HDR ? r->off - HDR : 0),
                     (unsigned long long)r->bytes, timeout_s);
            return AVGPIPE_TIMEOUT; /* still queued: wait again, cancel, or abort */
        }
        sleep_on_channels(C, self, poll_ms(left));
    }
}

/* Out of its channel's queue. One that has started moving cannot leave a byte stream: the channel is
   then out of step, and its later requests fail. */
static void pc_cancel(void *user, int self, avgpipe_comm_request req) {
    pcomm *C = user;
    preq *r = (preq *)(void *)req, *p = NULL, *c;
    if (!r || self < 0 || self >= C->n) return;
    if (!r->done) {
        pqueue *q = r->send ? &C->rank[self].sends[r->peer] : &C->rank[self].recvs[r->peer];
        for (c = q->head; c && c != r; c = c->next) p = c;
        if (c) {
            if (r->off > 0) q->broken = 1;
            if (p) p->next = r->next;
            else q->head = r->next;
            if (q->tail == r) q->tail = p;
        }
    }
    release(C, self, r, NULL);
}

/* Move exactly `bytes` through a collective pipe, within the deadline. */
static avgpipe_result xfer(pcomm *C, int self, int fd, void *buf, size_t bytes, int send, double deadline) {
    size_t off = 0;
    while (off < bytes) {
        if (atomic_load(&C->aborted)) return aborted(C, self);
        ssize_t k = send ? write(fd, (char *)buf + off, bytes - off) : read(fd, (char *)buf + off, bytes - off);
        if (k > 0) {
            off += (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
            snprintf(C->rank[self].err, sizeof C->rank[self].err, "collective: %s", k ? strerror(errno) : "end of stream");
            return AVGPIPE_BACKEND_ERROR;
        }
        double left = deadline - now_s();
        if (left <= 0) {
            snprintf(C->rank[self].err, sizeof C->rank[self].err, "collective: timed out after %zu of %zu bytes", off, bytes);
            return AVGPIPE_TIMEOUT;
        }
        struct pollfd pf[2] = {{fd, (short)(send ? POLLOUT : POLLIN), 0}, {C->abort_fd[0], POLLIN, 0}};
        poll(pf, 2, poll_ms(left));
    }
    return AVGPIPE_OK;
}

/* Every rank sends [count][floats] to rank 0, which sums in rank order and sends back
   [status][floats]. A timeout or failure in a collective leaves the collective pipes out of step:
   abort the communicator then. */
static avgpipe_result pc_allreduce(void *user, int self, float *buf, size_t count, double timeout_s) {
    pcomm *C = user;
    double deadline = now_s() + timeout_s;
    uint64_t hdr = count, status = 0;
    avgpipe_result res = AVGPIPE_OK;
    if (self < 0 || self >= C->n || (count && !buf)) return AVGPIPE_INVALID_ARG;
    if (atomic_load(&C->aborted)) return aborted(C, self);
    if (self != 0) {
        if (!(res = xfer(C, self, wr_fd(C->coll, C->n, self, 0), &hdr, 8, 1, deadline)) &&
            !(res = xfer(C, self, wr_fd(C->coll, C->n, self, 0), buf, count * sizeof(float), 1, deadline)) &&
            !(res = xfer(C, self, rd_fd(C->coll, C->n, 0, self), &status, 8, 0, deadline)) && status)
            snprintf(C->rank[self].err, sizeof C->rank[self].err, "allreduce: the ranks passed different counts");
        if (!res && status) return AVGPIPE_INVALID_ARG;
        return res ? res : xfer(C, self, rd_fd(C->coll, C->n, 0, self), buf, count * sizeof(float), 0, deadline);
    }
    for (int p = 1; p < C->n && !res; p++) { /* in rank order: the same sum, bit for bit, every call */
        uint64_t theirs = 0;
        float chunk[1024];
        res = xfer(C, 0, rd_fd(C->coll, C->n, p, 0), &theirs, 8, 0, deadline);
        if (!res && theirs != count) {
            snprintf(C->rank[0].err, sizeof C->rank[0].err, "allreduce: rank %d passed %llu floats, rank 0 %zu", p,
                     (unsigned long long)theirs, count);
            status = 1;
        }
        for (uint64_t i = 0; !res && i < theirs; i += 1024) { /* drain it even when refused */
            size_t m = (size_t)(theirs - i < 1024 ? theirs - i : 1024);
            res = xfer(C, 0, rd_fd(C->coll, C->n, p, 0), chunk, m * sizeof(float), 0, deadline);
            for (size_t j = 0; !res && !status && j < m; j++) buf[i + j] += chunk[j];
        }
    }
    for (int p = 1; p < C->n && !res; p++) {
        res = xfer(C, 0, wr_fd(C->coll, C->n, 0, p), &status, 8, 1, deadline);
        if (!res && !status) res = xfer(C, 0, wr_fd(C->coll, C->n, 0, p), buf, count * sizeof(float), 1, deadline);
    }
    return res ? res : status ? AVGPIPE_INVALID_ARG : AVGPIPE_OK;
}
static avgpipe_result pc_barrier(void *user, int self, double timeout_s) { return pc_allreduce(user, self, NULL, 0, timeout_s); }

static void pc_abort(void *user, avgpipe_result why, const char *message) {
    pcomm *C = user;
    pthread_mutex_lock(&C->mu);
    if (!atomic_load(&C->aborted)) {
        snprintf(C->abort_msg, sizeof C->abort_msg, "aborted (%s): %s", avgpipe_result_string(why), message ? message : "");
        atomic_store(&C->aborted, 1);
        if (write(C->abort_fd[1], "!", 1) < 0) { /* the pipe stays readable: every poll() wakes, now and later */
        }
    }
    pthread_mutex_unlock(&C->mu);
}

static const char *pc_last_error(void *user, int self) {
    pcomm *C = user;
    if (self < 0 || self >= C->n) return "";
    return C->rank[self].err;
}

static void pc_destroy(void *user) {
    pcomm *C = user;
    if (!C) return;
    for (int i = 0; i < 2 * C->n * C->n; i++) {
        if (C->p2p && C->p2p[i] >= 0) close(C->p2p[i]);
        if (C->coll && C->coll[i] >= 0) close(C->coll[i]);
    }
    if (C->abort_fd[0] >= 0) close(C->abort_fd[0]), close(C->abort_fd[1]);
    for (int r = 0; C->rank && r < C->n; r++) {
        while (C->rank[r].live) release(C, r, C->rank[r].live, NULL);
        free(C->rank[r].sends), free(C->rank[r].recvs), free(C->rank[r].pfd);
    }
    free(C->rank), free(C->p2p), free(C->coll);
    pthread_mutex_destroy(&C->mu);
    free(C);
}

static int open_pipe(int *fds) {
    if (pipe(fds) != 0) return -1;
    for (int e = 0; e < 2; e++) fcntl(fds[e], F_SETFL, fcntl(fds[e], F_GETFL) | O_NONBLOCK);
    return 0;
}

/* Fill *out with a pipe backend for `ranks` threads of this process. */
static avgpipe_result pipe_comm_create(int ranks, avgpipe_comm *out) {
    pcomm *C = calloc(1, sizeof *C);
    int ok = C != NULL;
    memset(out, 0, sizeof *out);
    if (ok) {
        C->n = ranks;
        C->abort_fd[0] = C->abort_fd[1] = -1;
        pthread_mutex_init(&C->mu, NULL);
        C->p2p = malloc(2 * (size_t)ranks * ranks * sizeof(int));
        C->coll = malloc(2 * (size_t)ranks * ranks * sizeof(int));
        C->rank = calloc((size_t)ranks, sizeof *C->rank);
        ok = C->p2p && C->coll && C->rank && open_pipe(C->abort_fd) == 0;
    }
    for (int i = 0; ok && i < 2 * ranks * ranks; i++) C->p2p[i] = C->coll[i] = -1;
    for (int s = 0; ok && s < ranks; s++) {
        prank *R = &C->rank[s];
        R->sends = calloc((size_t)ranks, sizeof(pqueue));
        R->recvs = calloc((size_t)ranks, sizeof(pqueue));
        R->pfd = calloc(2 * (size_t)ranks + 1, sizeof(struct pollfd));
        ok = R->sends && R->recvs && R->pfd;
        for (int d = 0; ok && d < ranks; d++)
            if (d != s) {
                ok = open_pipe(&C->p2p[(s * ranks + d) * 2]) == 0;
                if (ok && (s == 0 || d == 0)) ok = open_pipe(&C->coll[(s * ranks + d) * 2]) == 0;
            }
    }
    if (!ok) {
        pc_destroy(C);
        return AVGPIPE_BACKEND_ERROR;
    }
    *out = (avgpipe_comm){.name = "posix-pipes", .size = ranks, .isend = pc_isend, .irecv = pc_irecv, .test = pc_test,
                          .wait = pc_wait, .cancel = pc_cancel, .barrier = pc_barrier, .allreduce_sum = pc_allreduce, .abort = pc_abort,
                          .last_error = pc_last_error, .destroy = pc_destroy, .user = C};
    return AVGPIPE_OK;
}

/* ==== Contract checks: one thread per rank ======================================================= */

enum { CRANKS = 4, BIG = 300000 /* bytes: several times a pipe's buffer */ };
static avgpipe_comm cc;
static int fails;
static atomic_int parked; /* ranks blocked in the last wait, which only abort() ends */
#define CHECK(c)                                                                        \
    do {                                                                                \
        if (!(c)) fprintf(stderr, "check failed, line %d: %s\n", __LINE__, #c), fails++; \
    } while (0)

static void *contract_rank(void *arg) {
    int me = (int)(intptr_t)arg;
    static unsigned char big_out[BIG], big_in[BIG];
    avgpipe_comm_request rq[3];
    avgpipe_comm_status st = {0, 0};
    float v[3] = {(float)me, 1, 0.5f};
    int x = me == 0 ? 42 : 0, y = 7, z = 0, done = 0; /* buffers outlive their requests */
    double eight = 8;
    if (me == 0) { /* FIFO matching in posting order, sizes 300 kB / 0 / 4, all in flight at once */
        for (int i = 0; i < BIG; i++) big_out[i] = (unsigned char)(i * 7);
        CHECK(!cc.isend(cc.user, 0, 1, big_out, BIG, 10, &rq[0]) && !cc.isend(cc.user, 0, 1, NULL, 0, 11, &rq[1]) &&
              !cc.isend(cc.user, 0, 1, &x, sizeof x, 12, &rq[2]));
        for (int i = 0; i < 3; i++) CHECK(cc.wait(cc.user, 0, rq[i], 5, NULL) == AVGPIPE_OK);
    } else if (me == 1) {
        CHECK(!cc.irecv(cc.user, 1, 0, big_in, BIG, 10, &rq[0]) && !cc.irecv(cc.user, 1, 0, NULL, 0, 11, &rq[1]) &&
              !cc.irecv(cc.user, 1, 0, &x, sizeof x, 12, &rq[2]));
        CHECK(cc.wait(cc.user, 1, rq[2], 5, &st) == AVGPIPE_OK && x == 42 && st.tag == 12); /* the last one first: the rest streams */
        CHECK(cc.test(cc.user, 1, rq[1], &done, NULL) == AVGPIPE_OK && done);
        CHECK(cc.wait(cc.user, 1, rq[0], 5, NULL) == AVGPIPE_OK && !memcmp(big_in, big_out, BIG));
        /* a receive nobody has sent: the deadline returns TIMEOUT and leaves it pending */
        CHECK(!cc.irecv(cc.user, 1, 2, &x, sizeof x, 5, &rq[0]) && cc.wait(cc.user, 1, rq[0], 0.05, NULL) == AVGPIPE_TIMEOUT);
    } else if (me == 2) { /* 8 bytes meet a receive of 4, then tag 3 meets a receive expecting tag 4: both receives fail */
        CHECK(!cc.isend(cc.user, 2, 3, &eight, sizeof eight, 1, &rq[2]) && cc.wait(cc.user, 2, rq[2], 5, NULL) == AVGPIPE_OK);
        CHECK(!cc.isend(cc.user, 2, 3, &y, sizeof y, 3, &rq[2]) && cc.wait(cc.user, 2, rq[2], 5, NULL) == AVGPIPE_OK);
        CHECK(!cc.isend(cc.user, 2, 3, &y, sizeof y, 4, &rq[2]) && cc.wait(cc.user, 2, rq[2], 5, NULL) == AVGPIPE_OK);
        CHECK(!cc.isend(cc.user, 2, 3, &y, 2, 5, &rq[2]) && cc.wait(cc.user, 2, rq[2], 5, NULL) == AVGPIPE_OK); /* 2 bytes */
    } else {
        CHECK(!cc.irecv(cc.user, 3, 2, &z, 4, 1, &rq[2]) && cc.wait(cc.user, 3, rq[2], 5, &st) == AVGPIPE_MISMATCH && st.bytes == 8);
        CHECK(strstr(cc.last_error(cc.user, 3), "receive of 4 bytes with tag 1 from rank 2 met a message of 8 bytes") != NULL);
        CHECK(!cc.irecv(cc.user, 3, 2, &z, 4, 4, &rq[2]) && cc.wait(cc.user, 3, rq[2], 5, &st) == AVGPIPE_MISMATCH && st.tag == 3);
        CHECK(!cc.irecv(cc.user, 3, 2, &z, 4, 4, &rq[2]) && cc.wait(cc.user, 3, rq[2], 5, &st) == AVGPIPE_OK && z == 7); /* in step */
        z = 0; /* a smaller message than the receive's capacity is delivered, its size in the status */
        CHECK(!cc.irecv(cc.user, 3, 2, &z, 4, 5, &rq[2]) && cc.wait(cc.user, 3, rq[2], 5, &st) == AVGPIPE_OK && st.bytes == 2 &&
              !memcmp(&z, &y, 2));
    }
    CHECK(cc.barrier(cc.user, me, 5) == AVGPIPE_OK);
    if (me == 2) { /* ... now rank 2 sends it, and waiting again finds it */
        CHECK(!cc.isend(cc.user, 2, 1, &y, sizeof y, 5, &rq[1]) && cc.wait(cc.user, 2, rq[1], 5, NULL) == AVGPIPE_OK);
    } else if (me == 1) {
        CHECK(cc.wait(cc.user, 1, rq[0], 5, NULL) == AVGPIPE_OK && x == 7);
        /* a receive cancelled before anything came is gone: the next message meets the next receive */
        CHECK(!cc.irecv(cc.user, 1, 3, &x, sizeof x, 8, &rq[0]));
        cc.cancel(cc.user, 1, rq[0]);
    }
    CHECK(cc.barrier(cc.user, me, 5) == AVGPIPE_OK);
    if (me == 3) {
        CHECK(!cc.isend(cc.user, 3, 1, &z, sizeof z, 9, &rq[1]) && cc.wait(cc.user, 3, rq[1], 5, NULL) == AVGPIPE_OK);
    } else if (me == 1) {
        CHECK(!cc.irecv(cc.user, 1, 3, &x, sizeof x, 9, &rq[0]) && cc.wait(cc.user, 1, rq[0], 5, NULL) == AVGPIPE_OK && x == 7);
    }
    CHECK(cc.allreduce_sum(cc.user, me, v, 3, 5) == AVGPIPE_OK && v[0] == 6 && v[1] == CRANKS && v[2] == 2);
    CHECK(cc.barrier(cc.user, me, 5) == AVGPIPE_OK);
    /* every rank blocks on a receive nobody will send, with a 10 s deadline: abort() must wake them all */
    double t = now_s();
    CHECK(!cc.irecv(cc.user, me, (me + 1) % CRANKS, v, 4, 6, &rq[0]));
    atomic_fetch_add(&parked, 1);
    CHECK(cc.wait(cc.user, me, rq[0], 10, NULL) == AVGPIPE_ABORTED && now_s() - t < 5);
    CHECK(cc.isend(cc.user, me, (me + 1) % CRANKS, v, 4, 6, &rq[1]) == AVGPIPE_ABORTED);
    CHECK(cc.barrier(cc.user, me, 5) == AVGPIPE_ABORTED);
    CHECK(strstr(cc.last_error(cc.user, me), "checks done") != NULL);
    return NULL;
}

static int contract_checks(void) {
    pthread_t th[CRANKS];
    struct timespec ms = {0, 1000000L};
    if (pipe_comm_create(CRANKS, &cc) || avgpipe_comm_check(NULL, &cc)) return 1;
    for (int r = 0; r < CRANKS; r++) pthread_create(&th[r], NULL, contract_rank, (void *)(intptr_t)r);
    for (int i = 0; i < 5000 && atomic_load(&parked) < CRANKS; i++) nanosleep(&ms, NULL);
    for (int i = 0; i < 20; i++) nanosleep(&ms, NULL); /* they are asleep in poll() now */
    cc.abort(cc.user, AVGPIPE_ABORTED, "checks done");
    for (int r = 0; r < CRANKS; r++) pthread_join(th[r], NULL);
    avgpipe_comm_destroy(&cc);
    return fails;
}

/* ==== The model (as in dropin.c): an MLP, one layer per stage ======================================= */

enum { S = 4, IN = 8, HID = 32, B = 16, M = 8, NB = 16, N = 2, ITERS = 60, PMAX = HID * HID + HID };
static const int width[S + 1] = {IN, HID, HID, HID, 1};
static float X[NB][M][B * IN], Y[NB][M][B];
static float grad[N][S][PMAX];

static size_t layer_size(int l) { return (size_t)width[l + 1] * width[l] + width[l + 1]; }
static const float *input_of(const avgpipe_op_ctx *op) { return op->stage ? op->input : X[(op->round * N + op->pipe) % NB][op->micro]; }
static const float *target_of(const avgpipe_op_ctx *op) { return Y[(op->round * N + op->pipe) % NB][op->micro]; }

static void layer_forward(int l, const float *p, const float *zin, float *zout) {
    int n = width[l], m = width[l + 1];
    float h[B * HID];
    for (int i = 0; i < B * n; i++) h[i] = l ? tanhf(zin[i]) : zin[i];
    for (int s = 0; s < B; s++)
        for (int j = 0; j < m; j++) {
            float a = p[n * m + j];
            for (int i = 0; i < n; i++) a += p[j * n + i] * h[s * n + i];
            zout[s * m + j] = a;
        }
}
static double loss_grad(const float *z, const float *y, float *gz) {
    double loss = 0;
    for (int s = 0; s < B; s++) gz[s] = (z[s] - y[s]) / B, loss += 0.5 * (double)(z[s] - y[s]) * (z[s] - y[s]) / B;
    return loss;
}
static int on_forward(avgpipe_op_ctx *op) {
    float z[B], gz[B];
    layer_forward(op->stage, op->params, input_of(op), op->output ? op->output : z);
    if (!op->output) op->loss = loss_grad(z, target_of(op), gz);
    return 0;
}
static int on_backward(avgpipe_op_ctx *op) {
    int l = op->stage, n = width[l], m = width[l + 1];
    const float *zin = input_of(op), *gout = op->grad_output, *p = op->params;
    float *g = grad[op->pipe][l], *gin = op->grad_input, h[B * HID], z[B], gz[B];
    if (!gout) layer_forward(l, p, zin, z), loss_grad(z, target_of(op), gz), gout = gz;
    for (int i = 0; i < B * n; i++) h[i] = l ? tanhf(zin[i]) : zin[i];
    for (int s = 0; s < B; s++)
        for (int j = 0; j < m; j++) {
            g[n * m + j] += gout[s * m + j];
            for (int i = 0; i < n; i++) g[j * n + i] += gout[s * m + j] * h[s * n + i];
        }
    for (int s = 0; gin && s < B; s++)
        for (int i = 0; i < n; i++) {
            float a = 0;
            for (int j = 0; j < m; j++) a += p[j * n + i] * gout[s * m + j];
            gin[s * n + i] = l ? a * (1 - h[s * n + i] * h[s * n + i]) : a;
        }
    return 0;
}
static int on_step(int rank, int pipe, int stage, int round, float *params, void *user) {
    (void)rank, (void)round, (void)user;
    for (size_t i = 0; i < layer_size(stage); i++) params[i] -= 0.05f * grad[pipe][stage][i] / M, grad[pipe][stage][i] = 0;
    return 0;
}

typedef struct result {
    float w[N][S][PMAX], ref[S][PMAX];
    double loss[ITERS], seconds;
} result;

/* Train N = 2 pipelines of S = 4 stages (advance forward K = 2, deterministic averaging) over `comm`
   (NULL: the built-in in-process backend). */
static int train(const avgpipe_comm *comm, float w0[S][PMAX], result *out) {
    float *params[N * S];
    size_t count[S], act[S - 1];
    for (int l = 0; l < S; l++) {
        count[l] = layer_size(l);
        if (l < S - 1) act[l] = B * width[l + 1] * sizeof(float);
        for (int i = 0; i < N; i++) params[i * S + l] = memcpy(out->w[i][l], w0[l], sizeof out->w[i][l]);
    }
    memset(grad, 0, sizeof grad);
    avgpipe_run_desc d = {.sched = {.kind = AVGPIPE_SCHED_ADVANCE, .stages = S, .micro = M, .pipes = N, .advance = 2},
                          .cb = {.forward = on_forward, .backward = on_backward, .step = on_step},
                          .act_bytes = act, .params = params, .param_count = count, .averaging.alpha = 0.1f,
                          .deterministic = 1, .timeout_s = 10, .comm = comm};
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_run_stats st;
    avgpipe_context_init(&ctx, NULL);
    avgpipe_result res = avgpipe_run_create(&ctx, &d, &run);
    double t0 = now_s();
    for (int it = 0; it < ITERS && !res; it++) {
        res = avgpipe_run_iteration(run, &st);
        out->loss[it] = st.loss;
        if (!res && st.micro_batches != (long long)M * N) { /* every micro-batch ran */
            fprintf(stderr, "only %lld of %d micro-batches ran\n", st.micro_batches, M * N);
            avgpipe_run_destroy(run);
            return 1;
        }
    }
    out->seconds = now_s() - t0;
    for (int l = 0; l < S && !res; l++) memcpy(out->ref[l], avgpipe_run_reference(run, l, NULL), count[l] * sizeof(float));
    if (res) fprintf(stderr, "avgpipe (%s): %s: %s\n", comm ? comm->name : "built-in", avgpipe_result_string(res), avgpipe_last_error(&ctx));
    avgpipe_run_destroy(run); /* a failed run aborts `comm`: then it cannot serve another run */
    return res;
}

int main(void) {
    static result builtin, piped;
    static float w0[S][PMAX];
    unsigned rng = 2024;
#define UNIFORM() ((float)((rng = rng * 1664525u + 1013904223u) >> 8) / 8388608.0f - 1.0f)
    for (int b = 0; b < NB; b++)
        for (int u = 0; u < M; u++)
            for (int s = 0; s < B; s++) {
                float *x = &X[b][u][s * IN];
                for (int i = 0; i < IN; i++) x[i] = UNIFORM();
                Y[b][u][s] = sinf(2 * x[0]) * cosf(x[1]) + 0.5f * x[2] * x[3];
            }
    for (int l = 0; l < S; l++)
        for (size_t i = 0; i < layer_size(l); i++) w0[l][i] = UNIFORM() / sqrtf((float)width[l]);

    if (contract_checks()) return 1;
    printf("pipe backend contract: FIFO matching of 300 kB / 0 B / 4 B messages, size and tag mismatch, timeout, cancel, abort "
           "wake-up, barrier, allreduce: ok\n");

    avgpipe_comm pc;
    if (pipe_comm_create(S, &pc)) return 1;
    int bad = train(NULL, w0, &builtin) || train(&pc, w0, &piped);
    pcomm *C = pc.user;
    printf("pipe backend moved %lld bytes in %lld messages\n", (long long)atomic_load(&C->bytes_moved),
           (long long)atomic_load(&C->messages));
    avgpipe_comm_destroy(&pc);
    if (bad) return 1;

    printf("MLP %d-%d-%d-%d-1 on %d stages, %d pipelines, advance K=2, alpha 0.1, %d micro-batches of %d\n", IN, HID, HID,
           HID, S, N, M, B);
    printf("%6s %16s %16s\n", "iter", "built-in loss", "pipes loss");
    static const int rows[] = {0, 5, 10, 20, 30, 40, 50, ITERS - 1};
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++)
        printf("%6d %16.6f %16.6f\n", rows[k], builtin.loss[rows[k]], piped.loss[rows[k]]);
    printf("time for %d iterations: built-in %.1f ms, pipes %.1f ms (pipes / built-in = %.2f)\n", ITERS, 1e3 * builtin.seconds,
           1e3 * piped.seconds, piped.seconds / builtin.seconds);
    int same = !memcmp(builtin.w, piped.w, sizeof builtin.w) && !memcmp(builtin.ref, piped.ref, sizeof builtin.ref) &&
               !memcmp(builtin.loss, piped.loss, sizeof builtin.loss);
    printf("parameters of both pipelines, the reference and every loss: %s\n", same ? "bitwise identical" : "DIFFER");
    return same ? 0 : 1;
}
