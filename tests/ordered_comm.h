/* ordered_comm.h — a comm table with device-ordered transfers (isend_on / irecv_on) for the tests,
   over the in-process backend and the asynchronous test device of tests/async_device.h, the way NCCL
   orders its transfers on GPU streams: each (rank, peer, direction) has its own stream; a transfer is
   a task on it that first waits for the `ready` event, then posts the inner send or receive and waits
   for it (the in-process backend copies when both sides are posted), then `done` is recorded on that
   stream. Nothing on the host waits for the data: a consumer that does not order itself after `done`
   reads its buffer before the message landed (with a task delay, reliably).

   The request's test/wait report the task's end (polling `done`'s twin with a timeout) and the inner
   result. The plain isend/irecv and the rest are the inner backend's. Include after async_device.h. */
#ifndef AVGPIPE_TESTS_ORDERED_COMM_H
#define AVGPIPE_TESTS_ORDERED_COMM_H

#define OCOMM_MAXR 8
#define OCOMM_POOL 65536 /* requests over a comm's life */

typedef struct ocomm_req {
    int magic, send;
    void *buf;
    const void *sbuf;
    size_t bytes;
    uint32_t tag;
    int self, peer;
    avgpipe_device_event mine; /* recorded with `done`: the request's own completion */
    avgpipe_result res;
    avgpipe_comm_status st;
} ocomm_req;

typedef struct ocomm {
    avgpipe_comm inner;
    avgpipe_device *dev;
    avgpipe_device_stream chan[OCOMM_MAXR][OCOMM_MAXR][2]; /* [self][peer][send] */
    ocomm_req *pool;
    long used;
    double timeout_s;
    long posted; /* transfers posted through isend_on / irecv_on */
} ocomm;

#define OCOMM_MAGIC 0x6f636d72
#define OCOMM_CANCELLED 0x6f636d63 /* released by cancel: its event is destroyed at close */

static ocomm OCOMM;

static void ocomm_task(void *arg) {
    ocomm_req *r = *(ocomm_req **)arg;
    avgpipe_comm_request inner = NULL;
    avgpipe_result res = r->send ? OCOMM.inner.isend(OCOMM.inner.user, r->self, r->peer, r->sbuf, r->bytes, r->tag, &inner)
                                 : OCOMM.inner.irecv(OCOMM.inner.user, r->self, r->peer, r->buf, r->bytes, r->tag, &inner);
    if (!res) res = OCOMM.inner.wait(OCOMM.inner.user, r->self, inner, OCOMM.timeout_s, &r->st);
    r->res = res;
}

static avgpipe_result ocomm_post(int send, int self, int peer, const void *sbuf, void *rbuf, size_t bytes, uint32_t tag,
                                 avgpipe_device_event ready, avgpipe_device_event done, avgpipe_comm_request *req) {
    ocomm *c = &OCOMM;
    avgpipe_device *d = c->dev;
    avgpipe_device_stream *s;
    ocomm_req *r;
    avgpipe_result res;
    long k;
    if (self < 0 || self >= OCOMM_MAXR || peer < 0 || peer >= OCOMM_MAXR) return AVGPIPE_INVALID_ARG;
    s = &c->chan[self][peer][send]; /* only rank self's thread touches it */
    if (!*s && (res = d->stream_create(d->user, s)) != AVGPIPE_OK) return res;
    if ((k = __atomic_fetch_add(&c->used, 1, __ATOMIC_RELAXED)) >= OCOMM_POOL) return AVGPIPE_OUT_OF_MEMORY;
    r = &c->pool[k];
    r->magic = OCOMM_MAGIC, r->send = send, r->sbuf = sbuf, r->buf = rbuf, r->bytes = bytes, r->tag = tag;
    r->self = self, r->peer = peer, r->res = AVGPIPE_OK;
    if ((res = d->event_create(d->user, &r->mine)) != AVGPIPE_OK) return res;
    if (ready && (res = d->stream_wait_event(d->user, *s, ready)) != AVGPIPE_OK) return res;
    if (adev_enqueue(*s, ocomm_task, &r, sizeof r)) return AVGPIPE_OUT_OF_MEMORY;
    if ((res = d->event_record(d->user, r->mine, *s)) != AVGPIPE_OK) return res;
    if (done && (res = d->event_record(d->user, done, *s)) != AVGPIPE_OK) return res;
    __atomic_add_fetch(&c->posted, 1, __ATOMIC_RELAXED);
    *req = r;
    return AVGPIPE_OK;
}

static avgpipe_result ocomm_isend_on(void *u, int self, int peer, const void *buf, size_t bytes, uint32_t tag, avgpipe_device_event ready,
                                     avgpipe_device_event done, avgpipe_comm_request *req) {
    (void)u;
    return ocomm_post(1, self, peer, buf, NULL, bytes, tag, ready, done, req);
}
static avgpipe_result ocomm_irecv_on(void *u, int self, int peer, void *buf, size_t bytes, uint32_t tag, avgpipe_device_event ready,
                                     avgpipe_device_event done, avgpipe_comm_request *req) {
    (void)u;
    return ocomm_post(0, self, peer, NULL, buf, bytes, tag, ready, done, req);
}

static int ocomm_is_mine(avgpipe_comm_request req) {
    ocomm_req *r = (ocomm_req *)req;
    return r >= OCOMM.pool && r < OCOMM.pool + OCOMM_POOL && r->magic == OCOMM_MAGIC;
}

static avgpipe_result ocomm_finish(ocomm_req *r, avgpipe_comm_status *status) {
    if (status && !r->send) *status = r->st;
    r->magic = 0;
    OCOMM.dev->event_destroy(OCOMM.dev->user, r->mine);
    return r->res;
}

static avgpipe_result ocomm_test(void *u, int self, avgpipe_comm_request req, int *done, avgpipe_comm_status *status) {
    ocomm_req *r = (ocomm_req *)req;
    (void)u;
    if (!ocomm_is_mine(req)) return OCOMM.inner.test(OCOMM.inner.user, self, req, done, status);
    OCOMM.dev->event_query(OCOMM.dev->user, r->mine, done);
    return *done ? ocomm_finish(r, status) : AVGPIPE_OK;
}

static avgpipe_result ocomm_wait(void *u, int self, avgpipe_comm_request req, double timeout_s, avgpipe_comm_status *status) {
    ocomm_req *r = (ocomm_req *)req;
    double end = adev_now() + timeout_s;
    int done = 0;
    (void)u;
    if (!ocomm_is_mine(req)) return OCOMM.inner.wait(OCOMM.inner.user, self, req, timeout_s, status);
    for (;;) {
        OCOMM.dev->event_query(OCOMM.dev->user, r->mine, &done);
        if (done) return ocomm_finish(r, status);
        if (adev_now() > end) return AVGPIPE_TIMEOUT;
        adev_nap(50);
    }
}

/* Releases the request; its task still runs (the inner backend is aborted or will match it) and its
   event lives until ocomm_close. */
static void ocomm_cancel(void *u, int self, avgpipe_comm_request req) {
    (void)u;
    if (!ocomm_is_mine(req)) {
        if (OCOMM.inner.cancel) OCOMM.inner.cancel(OCOMM.inner.user, self, req);
        return;
    }
    ((ocomm_req *)req)->magic = OCOMM_CANCELLED;
}

static avgpipe_result ocomm_isend(void *u, int self, int peer, const void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req) {
    (void)u;
    return OCOMM.inner.isend(OCOMM.inner.user, self, peer, buf, bytes, tag, req);
}
static avgpipe_result ocomm_irecv(void *u, int self, int peer, void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req) {
    (void)u;
    return OCOMM.inner.irecv(OCOMM.inner.user, self, peer, buf, bytes, tag, req);
}
static avgpipe_result ocomm_barrier(void *u, int self, double t) {
    (void)u;
    return OCOMM.inner.barrier(OCOMM.inner.user, self, t);
}
static void ocomm_abort(void *u, avgpipe_result why, const char *message) {
    (void)u;
    OCOMM.inner.abort(OCOMM.inner.user, why, message);
}
static const char *ocomm_last_error(void *u, int self) {
    (void)u;
    return OCOMM.inner.last_error ? OCOMM.inner.last_error(OCOMM.inner.user, self) : "";
}
static avgpipe_result ocomm_allreduce(void *u, int self, float *buf, size_t count, double t) {
    (void)u;
    return OCOMM.inner.allreduce_sum(OCOMM.inner.user, self, buf, count, t);
}
static avgpipe_result ocomm_split(void *u, int self, const int *members, int count, avgpipe_comm *out) {
    (void)u;
    return OCOMM.inner.split(OCOMM.inner.user, self, members, count, out);
}

/* The table over `ranks` in-process ranks and the device dev (the async test device). */
static avgpipe_comm ocomm_open(int ranks, avgpipe_device *dev, double timeout_s) {
    avgpipe_comm t;
    memset(&OCOMM, 0, sizeof OCOMM);
    avgpipe_comm_local_create(NULL, ranks, &OCOMM.inner);
    OCOMM.dev = dev;
    OCOMM.timeout_s = timeout_s;
    OCOMM.pool = (ocomm_req *)calloc(OCOMM_POOL, sizeof *OCOMM.pool);
    memset(&t, 0, sizeof t);
    t.name = "ordered-test";
    t.size = ranks;
    t.isend = ocomm_isend;
    t.irecv = ocomm_irecv;
    t.test = ocomm_test;
    t.wait = ocomm_wait;
    t.cancel = ocomm_cancel;
    t.isend_on = ocomm_isend_on;
    t.irecv_on = ocomm_irecv_on;
    t.barrier = ocomm_barrier;
    t.abort = ocomm_abort;
    t.last_error = ocomm_last_error;
    t.allreduce_sum = ocomm_allreduce;
    t.split = ocomm_split;
    return t;
}

/* After the runs that used it: every channel stream drained and destroyed, then the inner backend. */
static void ocomm_close(void) {
    int i, j, k;
    for (i = 0; i < OCOMM_MAXR; i++)
        for (j = 0; j < OCOMM_MAXR; j++)
            for (k = 0; k < 2; k++)
                if (OCOMM.chan[i][j][k]) OCOMM.dev->stream_destroy(OCOMM.dev->user, OCOMM.chan[i][j][k]);
    for (i = 0; i < OCOMM.used && i < OCOMM_POOL; i++)
        if (OCOMM.pool[i].magic == OCOMM_CANCELLED) OCOMM.dev->event_destroy(OCOMM.dev->user, OCOMM.pool[i].mine);
    avgpipe_comm_destroy(&OCOMM.inner);
    free(OCOMM.pool);
    memset(&OCOMM, 0, sizeof OCOMM);
}

#endif
