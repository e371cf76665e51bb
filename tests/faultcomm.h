/* faultcomm.h — a comm table around another one that loses or duplicates one message: the
   `fault_index`-th send from `fault_src` to `fault_dst` is either never delivered (its request never
   completes: wait honours the timeout and abort) or delivered twice. Used by the runtime tests (around
   the in-process backend) and by tests/mpi_check.c (around the MPI one). Include after avgpipe.h;
   needs <pthread.h>, <string.h>, <time.h> (nanosleep: _POSIX_C_SOURCE >= 199309L). */
#ifndef AVGPIPE_TESTS_FAULTCOMM_H
#define AVGPIPE_TESTS_FAULTCOMM_H

#include <pthread.h>
#include <string.h>
#include <time.h>

typedef struct faultcomm {
    avgpipe_comm inner;
    int fault_src, fault_dst, fault_index, duplicate;
    int sent[64];                 /* sends by fault_src to each peer (only fault_src's thread touches it) */
    avgpipe_comm_request extra;   /* the duplicate's own request, cancelled at the end */
    int aborted;                  /* read with the lock below */
    pthread_mutex_t mu;
} faultcomm;
static char faultcomm_lost; /* the request handle of the lost message */

static double faultcomm_now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static avgpipe_result fc_isend(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req) {
    faultcomm *c = (faultcomm *)user;
    if (self == c->fault_src && peer == c->fault_dst && peer < 64 && c->sent[peer]++ == c->fault_index) {
        if (!c->duplicate) {
            *req = (avgpipe_comm_request)(void *)&faultcomm_lost;
            return AVGPIPE_OK;
        }
        c->inner.isend(c->inner.user, self, peer, buf, bytes, tag, &c->extra);
    }
    return c->inner.isend(c->inner.user, self, peer, buf, bytes, tag, req);
}
static avgpipe_result fc_irecv(void *user, int self, int peer, void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req) {
    faultcomm *c = (faultcomm *)user;
    return c->inner.irecv(c->inner.user, self, peer, buf, bytes, tag, req);
}
static int fc_is_aborted(faultcomm *c) {
    int a;
    pthread_mutex_lock(&c->mu);
    a = c->aborted;
    pthread_mutex_unlock(&c->mu);
    return a;
}
static avgpipe_result fc_wait(void *user, int self, avgpipe_comm_request req, double timeout_s, avgpipe_comm_status *st) {
    faultcomm *c = (faultcomm *)user;
    if (req == (avgpipe_comm_request)(void *)&faultcomm_lost) {
        double t0 = faultcomm_now();
        struct timespec ms = {0, 1000000L};
        while (!fc_is_aborted(c) && faultcomm_now() - t0 < timeout_s) nanosleep(&ms, NULL);
        return fc_is_aborted(c) ? AVGPIPE_ABORTED : AVGPIPE_TIMEOUT;
    }
    return c->inner.wait(c->inner.user, self, req, timeout_s, st);
}
static avgpipe_result fc_test(void *user, int self, avgpipe_comm_request req, int *done, avgpipe_comm_status *st) {
    faultcomm *c = (faultcomm *)user;
    if (req == (avgpipe_comm_request)(void *)&faultcomm_lost) {
        *done = 0;
        return fc_is_aborted(c) ? AVGPIPE_ABORTED : AVGPIPE_OK;
    }
    return c->inner.test(c->inner.user, self, req, done, st);
}
static void fc_cancel(void *user, int self, avgpipe_comm_request req) {
    faultcomm *c = (faultcomm *)user;
    if (req != (avgpipe_comm_request)(void *)&faultcomm_lost && c->inner.cancel) c->inner.cancel(c->inner.user, self, req);
}
static avgpipe_result fc_barrier(void *user, int self, double timeout_s) {
    faultcomm *c = (faultcomm *)user;
    return c->inner.barrier(c->inner.user, self, timeout_s);
}
static void fc_abort(void *user, avgpipe_result why, const char *message) {
    faultcomm *c = (faultcomm *)user;
    pthread_mutex_lock(&c->mu);
    c->aborted = 1;
    pthread_mutex_unlock(&c->mu);
    c->inner.abort(c->inner.user, why, message);
}
static const char *fc_last_error(void *user, int self) {
    faultcomm *c = (faultcomm *)user;
    return c->inner.last_error ? c->inner.last_error(c->inner.user, self) : "";
}

/* Wrap `inner` (taken over: faultcomm_free destroys it) into *table. */
static void faultcomm_init(faultcomm *fc, avgpipe_comm *table, const avgpipe_comm *inner, int src, int dst, int index, int duplicate) {
    memset(fc, 0, sizeof *fc);
    pthread_mutex_init(&fc->mu, NULL);
    fc->inner = *inner;
    fc->fault_src = src, fc->fault_dst = dst, fc->fault_index = index, fc->duplicate = duplicate;
    memset(table, 0, sizeof *table);
    table->name = duplicate ? "duplicate-one" : "drop-one";
    table->size = inner->size;
    table->isend = fc_isend;
    table->irecv = fc_irecv;
    table->test = fc_test;
    table->wait = fc_wait;
    table->cancel = fc_cancel;
    table->barrier = fc_barrier;
    table->abort = fc_abort;
    table->last_error = fc_last_error;
    table->user = fc;
}
static void faultcomm_free(faultcomm *fc) {
    if (fc->extra && fc->inner.cancel) fc->inner.cancel(fc->inner.user, fc->fault_src, fc->extra);
    avgpipe_comm_destroy(&fc->inner);
    pthread_mutex_destroy(&fc->mu);
}

#endif
