/* delaycomm: a comm table around the in-process one that delivers each message `delay` seconds after
   it was sent, serialised per link like the simulator's link (start = max(sent, link free), end =
   start + delay): a receive's wait returns once the message is due. Used by the runtime tests and
   bench_runtime (injected transfer delays). Needs _POSIX_C_SOURCE >= 199309L before any include. */
#ifndef AVGPIPE_TESTS_DELAYCOMM_H
#define AVGPIPE_TESTS_DELAYCOMM_H

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DELAYCOMM_RING 4096 /* messages in flight per channel */

typedef struct delaycomm_req {
    avgpipe_comm_request inner;
    double *due;
    int recv, done;
} delaycomm_req;

typedef struct delaycomm {
    avgpipe_comm inner;
    double delay;
    int S;
    double *due;       /* [S * S][RING]: due time of message k on channel (src, dst), written by src */
    double *link_free; /* [S * S], src's */
    long *nsend, *nrecv;
    delaycomm_req *req; /* [S * S][RING][2] */
} delaycomm;

static inline double delaycomm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Sleep most of the way, spin the last 100 us (sleeps overshoot). */
static inline void delaycomm_wait_until(double t) {
    double left;
    while ((left = t - delaycomm_now()) > 0)
        if (left > 2e-4) {
            struct timespec ts;
            long us = (long)((left - 1e-4) * 1e6);
            ts.tv_sec = us / 1000000;
            ts.tv_nsec = (us % 1000000) * 1000;
            nanosleep(&ts, NULL);
        }
}

static inline avgpipe_result delaycomm_isend(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag,
                                             avgpipe_comm_request *out) {
    delaycomm *c = (delaycomm *)user;
    int ch = self * c->S + peer;
    long k = c->nsend[ch]++ % DELAYCOMM_RING;
    double t = delaycomm_now(), start = t > c->link_free[ch] ? t : c->link_free[ch];
    delaycomm_req *r = &c->req[((size_t)ch * DELAYCOMM_RING + (size_t)k) * 2];
    c->link_free[ch] = start + c->delay;
    c->due[(size_t)ch * DELAYCOMM_RING + (size_t)k] = start + c->delay; /* published to the receiver by the inner backend's lock */
    r->recv = 0, r->done = 0, r->due = NULL;
    *out = (avgpipe_comm_request)(void *)r;
    return c->inner.isend(c->inner.user, self, peer, buf, bytes, tag, &r->inner);
}

static inline avgpipe_result delaycomm_irecv(void *user, int self, int peer, void *buf, size_t bytes, uint32_t tag,
                                             avgpipe_comm_request *out) {
    delaycomm *c = (delaycomm *)user;
    int ch = peer * c->S + self;
    long k = c->nrecv[ch]++ % DELAYCOMM_RING;
    delaycomm_req *r = &c->req[((size_t)ch * DELAYCOMM_RING + (size_t)k) * 2 + 1];
    r->recv = 1, r->done = 0, r->due = &c->due[(size_t)ch * DELAYCOMM_RING + (size_t)k];
    *out = (avgpipe_comm_request)(void *)r;
    return c->inner.irecv(c->inner.user, self, peer, buf, bytes, tag, &r->inner);
}

static inline avgpipe_result delaycomm_waitreq(void *user, int self, avgpipe_comm_request req, double timeout_s,
                                               avgpipe_comm_status *status) {
    delaycomm *c = (delaycomm *)user;
    delaycomm_req *r = (delaycomm_req *)(void *)req;
    avgpipe_result res = AVGPIPE_OK;
    if (!r->done) res = c->inner.wait(c->inner.user, self, r->inner, timeout_s, status);
    if (res) return res;
    r->done = 1;
    if (r->recv) delaycomm_wait_until(*r->due);
    return AVGPIPE_OK;
}

static inline avgpipe_result delaycomm_test(void *user, int self, avgpipe_comm_request req, int *done, avgpipe_comm_status *status) {
    delaycomm *c = (delaycomm *)user;
    delaycomm_req *r = (delaycomm_req *)(void *)req;
    *done = 0;
    if (!r->done) {
        int d = 0;
        avgpipe_result res = c->inner.test(c->inner.user, self, r->inner, &d, status);
        if (res || !d) return res;
        r->done = 1;
    }
    *done = !r->recv || delaycomm_now() >= *r->due;
    return AVGPIPE_OK;
}

static inline void delaycomm_cancel(void *user, int self, avgpipe_comm_request req) {
    delaycomm *c = (delaycomm *)user;
    delaycomm_req *r = (delaycomm_req *)(void *)req;
    if (!r->done) c->inner.cancel(c->inner.user, self, r->inner);
}
static inline avgpipe_result delaycomm_barrier(void *user, int self, double timeout_s) {
    delaycomm *c = (delaycomm *)user;
    return c->inner.barrier(c->inner.user, self, timeout_s);
}
static inline void delaycomm_abort(void *user, avgpipe_result why, const char *message) {
    delaycomm *c = (delaycomm *)user;
    c->inner.abort(c->inner.user, why, message);
}
static inline const char *delaycomm_last_error(void *user, int self) {
    delaycomm *c = (delaycomm *)user;
    return c->inner.last_error ? c->inner.last_error(c->inner.user, self) : "";
}

static inline void delaycomm_free(delaycomm *c) {
    avgpipe_comm_destroy(&c->inner);
    free(c->due), free(c->link_free), free(c->nsend), free(c->nrecv), free(c->req);
    memset(c, 0, sizeof *c);
}

/* Fill *table with the wrapper over a new in-process backend of S ranks. */
static inline avgpipe_result delaycomm_init(delaycomm *c, int S, double delay, avgpipe_comm *table) {
    avgpipe_result res;
    memset(c, 0, sizeof *c);
    res = avgpipe_comm_local_create(NULL, S, &c->inner);
    if (res) return res;
    c->S = S;
    c->delay = delay;
    c->due = (double *)calloc((size_t)S * S * DELAYCOMM_RING, sizeof(double));
    c->link_free = (double *)calloc((size_t)S * S, sizeof(double));
    c->nsend = (long *)calloc((size_t)S * S, sizeof(long));
    c->nrecv = (long *)calloc((size_t)S * S, sizeof(long));
    c->req = (delaycomm_req *)calloc((size_t)S * S * DELAYCOMM_RING * 2, sizeof(delaycomm_req));
    if (!c->due || !c->link_free || !c->nsend || !c->nrecv || !c->req) {
        delaycomm_free(c);
        return AVGPIPE_OUT_OF_MEMORY;
    }
    memset(table, 0, sizeof *table);
    table->name = "delayed";
    table->size = S;
    table->isend = delaycomm_isend;
    table->irecv = delaycomm_irecv;
    table->test = delaycomm_test;
    table->wait = delaycomm_waitreq;
    table->cancel = delaycomm_cancel;
    table->barrier = delaycomm_barrier;
    table->abort = delaycomm_abort;
    table->last_error = delaycomm_last_error;
    table->user = c;
    return AVGPIPE_OK;
}

#endif
