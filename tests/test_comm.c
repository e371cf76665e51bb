/* Tests of the in-process comm backend (section 13) on its own: per-peer FIFO matching, tag and size
   mismatches, cancel, split, timeouts, abort, barrier and allreduce across threads, table checks.
   Posting never blocks on this backend, so one thread may post for several ranks in turn (one rank's
   calls still come from one thread at a time); waits that must block run on their own threads. */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static void nap_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* The backend keeps the context it was created with (for its allocations): give it one that
   outlives it (NULL: the defaults). */
static avgpipe_comm make(int ranks) {
    avgpipe_comm c;
    avgpipe_context ctx;
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_comm_local_create(NULL, ranks, &c), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    cr_assert_eq(c.size, ranks);
    cr_assert_eq(avgpipe_comm_check(&ctx, &c), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    return c;
}

TestSuite(comm, .timeout = 30);

/* Messages from one peer arrive in the order they were sent, whether the receive or the send is
   posted first; messages from another peer on the same receiver do not mix in. */
Test(comm, fifo_per_peer) {
    avgpipe_comm c = make(3);
    avgpipe_comm_request s0[6], s2[3], r0[6], r2[3];
    int out0[6][4], out2[3][4], in0[6][4], in2[3][4], k, j;
    memset(in0, 0xff, sizeof in0);
    memset(in2, 0xff, sizeof in2);
    for (k = 0; k < 6; k++)
        for (j = 0; j < 4; j++) out0[k][j] = 100 * k + j;
    for (k = 0; k < 3; k++)
        for (j = 0; j < 4; j++) out2[k][j] = -(100 * k + j) - 1;
    /* rank 1 posts two receives from 0 and one from 2 before anything is sent */
    cr_assert_eq(c.irecv(c.user, 1, 0, in0[0], sizeof in0[0], 0, &r0[0]), AVGPIPE_OK);
    cr_assert_eq(c.irecv(c.user, 1, 2, in2[0], sizeof in2[0], 0, &r2[0]), AVGPIPE_OK);
    cr_assert_eq(c.irecv(c.user, 1, 0, in0[1], sizeof in0[1], 0, &r0[1]), AVGPIPE_OK);
    /* interleaved sends from 0 and 2 */
    for (k = 0; k < 6; k++) {
        cr_assert_eq(c.isend(c.user, 0, 1, out0[k], sizeof out0[k], 0, &s0[k]), AVGPIPE_OK);
        if (k < 3) cr_assert_eq(c.isend(c.user, 2, 1, out2[k], sizeof out2[k], 0, &s2[k]), AVGPIPE_OK);
    }
    /* the rest of the receives, after the sends */
    for (k = 2; k < 6; k++) cr_assert_eq(c.irecv(c.user, 1, 0, in0[k], sizeof in0[k], 0, &r0[k]), AVGPIPE_OK);
    for (k = 1; k < 3; k++) cr_assert_eq(c.irecv(c.user, 1, 2, in2[k], sizeof in2[k], 0, &r2[k]), AVGPIPE_OK);
    for (k = 0; k < 6; k++) {
        cr_assert_eq(c.wait(c.user, 1, r0[k], 1.0, NULL), AVGPIPE_OK);
        cr_assert_eq(c.wait(c.user, 0, s0[k], 1.0, NULL), AVGPIPE_OK);
    }
    for (k = 0; k < 3; k++) {
        cr_assert_eq(c.wait(c.user, 1, r2[k], 1.0, NULL), AVGPIPE_OK);
        cr_assert_eq(c.wait(c.user, 2, s2[k], 1.0, NULL), AVGPIPE_OK);
    }
    for (k = 0; k < 6; k++)
        for (j = 0; j < 4; j++) cr_assert_eq(in0[k][j], 100 * k + j, "message %d from rank 0, word %d: %d", k, j, in0[k][j]);
    for (k = 0; k < 3; k++)
        for (j = 0; j < 4; j++) cr_assert_eq(in2[k][j], -(100 * k + j) - 1, "message %d from rank 2, word %d: %d", k, j, in2[k][j]);
    avgpipe_comm_destroy(&c);
    cr_assert(c.isend == NULL && c.user == NULL, "avgpipe_comm_destroy must zero the table");
}

/* Both directions of a pair are independent channels; test() reports progress without blocking. */
Test(comm, test_and_both_directions) {
    avgpipe_comm c = make(2);
    avgpipe_comm_request ra, rb, sa, sb;
    double a = 1.5, b = -2.25, ga = 0, gb = 0;
    int done = 7;
    cr_assert_eq(c.irecv(c.user, 0, 1, &gb, sizeof gb, 0, &rb), AVGPIPE_OK);
    cr_assert_eq(c.irecv(c.user, 1, 0, &ga, sizeof ga, 0, &ra), AVGPIPE_OK);
    cr_assert_eq(c.test(c.user, 0, rb, &done, NULL), AVGPIPE_OK);
    cr_assert_eq(done, 0, "a receive without a send reported done");
    cr_assert_eq(c.isend(c.user, 0, 1, &a, sizeof a, 0, &sa), AVGPIPE_OK);
    cr_assert_eq(c.test(c.user, 0, rb, &done, NULL), AVGPIPE_OK);
    cr_assert_eq(done, 0, "rank 0's send to 1 completed rank 0's receive from 1");
    cr_assert_eq(c.isend(c.user, 1, 0, &b, sizeof b, 0, &sb), AVGPIPE_OK);
    cr_assert_eq(c.test(c.user, 0, rb, &done, NULL), AVGPIPE_OK);
    cr_assert_eq(done, 1);
    cr_assert_eq(c.test(c.user, 1, ra, &done, NULL), AVGPIPE_OK);
    cr_assert_eq(done, 1);
    cr_assert_eq(c.wait(c.user, 0, sa, 1.0, NULL), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 1, sb, 1.0, NULL), AVGPIPE_OK);
    cr_assert(ga == a && gb == b, "got %g and %g", ga, gb);
    avgpipe_comm_destroy(&c);
}

/* A receive that meets a message larger than its capacity (or of another tag) fails with
   AVGPIPE_MISMATCH, says what arrived in its status and its last error, and leaves its buffer alone;
   the send completes (a sender cannot know); the channel stays in step for the next message. A
   smaller message is delivered, status.bytes its size. */
Test(comm, size_mismatch_fails_the_receive) {
    avgpipe_comm c = make(2);
    avgpipe_comm_request s, r;
    avgpipe_comm_status st;
    char out[8] = "abcdefg", in[4] = {0};
    cr_assert_eq(c.isend(c.user, 0, 1, out, 8, 5, &s), AVGPIPE_OK);
    cr_assert_eq(c.irecv(c.user, 1, 0, in, 4, 5, &r), AVGPIPE_OK);
    memset(&st, 0, sizeof st);
    cr_assert_eq(c.wait(c.user, 1, r, 1.0, &st), AVGPIPE_MISMATCH);
    cr_assert_eq(c.wait(c.user, 0, s, 1.0, NULL), AVGPIPE_OK);
    cr_assert(st.bytes == 8 && st.tag == 5, "status: %zu bytes, tag %u", st.bytes, (unsigned)st.tag);
    cr_assert(strstr(c.last_error(c.user, 1), "8") != NULL && strstr(c.last_error(c.user, 1), "4") != NULL,
              "receiver's error: '%s'", c.last_error(c.user, 1));
    cr_assert(in[0] == 0, "a mismatched receive wrote into its buffer");
    cr_assert_eq(c.isend(c.user, 0, 1, out, 4, 6, &s), AVGPIPE_OK);
    cr_assert_eq(c.irecv(c.user, 1, 0, in, 4, 6, &r), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 1, r, 1.0, &st), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 0, s, 1.0, NULL), AVGPIPE_OK);
    cr_assert(!memcmp(in, "abcd", 4) && st.tag == 6 && st.bytes == 4);
    cr_assert_eq(c.isend(c.user, 0, 1, out + 4, 3, 7, &s), AVGPIPE_OK); /* 3 bytes into a receive of 4 */
    cr_assert_eq(c.irecv(c.user, 1, 0, in, 4, 7, &r), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 1, r, 1.0, &st), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 0, s, 1.0, NULL), AVGPIPE_OK);
    cr_assert(!memcmp(in, "efgd", 4) && st.tag == 7 && st.bytes == 3, "in '%.4s', %zu bytes", in, st.bytes);
    avgpipe_comm_destroy(&c);
}

/* Tags check, they do not select: a lost message shows up at the next receive of its channel as the
   wrong tag (a reordered or duplicated one likewise), whatever the posting order. */
Test(comm, tag_mismatch_is_reported_at_the_receive) {
    avgpipe_comm c = make(2);
    avgpipe_comm_request s[2], r[2];
    avgpipe_comm_status st;
    int a = 1, b = 2, x = 0, y = 0;
    cr_assert_eq(c.irecv(c.user, 1, 0, &x, sizeof x, 100, &r[0]), AVGPIPE_OK);
    cr_assert_eq(c.irecv(c.user, 1, 0, &y, sizeof y, 101, &r[1]), AVGPIPE_OK);
    cr_assert_eq(c.isend(c.user, 0, 1, &a, sizeof a, 101, &s[0]), AVGPIPE_OK); /* tag 100 was "lost" */
    memset(&st, 0, sizeof st);
    cr_assert_eq(c.wait(c.user, 1, r[0], 1.0, &st), AVGPIPE_MISMATCH);
    cr_assert(st.tag == 101 && st.bytes == sizeof a && x == 0, "tag %u, %zu bytes, x %d", (unsigned)st.tag, st.bytes, x);
    cr_assert(strstr(c.last_error(c.user, 1), "tag 100") && strstr(c.last_error(c.user, 1), "tag 101"), "%s", c.last_error(c.user, 1));
    cr_assert_eq(c.isend(c.user, 0, 1, &b, sizeof b, 102, &s[1]), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 1, r[1], 1.0, &st), AVGPIPE_MISMATCH);
    cr_assert_eq(st.tag, 102);
    cr_assert_eq(c.wait(c.user, 0, s[0], 1.0, NULL), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 0, s[1], 1.0, NULL), AVGPIPE_OK);
    avgpipe_comm_destroy(&c);
}

/* cancel: a pending receive leaves its queue (the next message meets the next receive), a pending
   send is never delivered, and nothing reads or writes their buffers afterwards. */
Test(comm, cancel_releases_pending_requests) {
    avgpipe_comm c = make(2);
    avgpipe_comm_request s, r, dead_r, dead_s;
    int v = 42, w = 43, got = 0, never = -1, unsent = 99;
    cr_assert_eq(c.irecv(c.user, 1, 0, &never, sizeof never, 1, &dead_r), AVGPIPE_OK);
    c.cancel(c.user, 1, dead_r);
    cr_assert_eq(c.irecv(c.user, 1, 0, &got, sizeof got, 2, &r), AVGPIPE_OK);
    cr_assert_eq(c.isend(c.user, 0, 1, &v, sizeof v, 2, &s), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 1, r, 1.0, NULL), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 0, s, 1.0, NULL), AVGPIPE_OK);
    cr_assert(got == 42 && never == -1, "got %d, the cancelled receive holds %d", got, never);
    /* a send nobody received, cancelled: the next receive gets the next send */
    cr_assert_eq(c.isend(c.user, 0, 1, &unsent, sizeof unsent, 3, &dead_s), AVGPIPE_OK);
    c.cancel(c.user, 0, dead_s);
    cr_assert_eq(c.isend(c.user, 0, 1, &w, sizeof w, 4, &s), AVGPIPE_OK);
    cr_assert_eq(c.irecv(c.user, 1, 0, &got, sizeof got, 4, &r), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 1, r, 1.0, NULL), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 0, s, 1.0, NULL), AVGPIPE_OK);
    cr_assert_eq(got, 43);
    avgpipe_comm_destroy(&c);
}

/* split: groups {0, 2} and {3, 1} of four ranks become communicators of two ranks, members[i] being
   rank i; their allreduce and messages stay inside the group; the parent still works; every table is
   destroyed on its own. */
typedef struct splitter {
    avgpipe_comm *parent, sub;
    int rank, bad;
    float sum;
    char msg[256];
} splitter;

static void *split_allreduce_thread(void *arg) {
    splitter *t = (splitter *)arg;
    int me = t->sub.size == 2 ? (t->rank == 0 || t->rank == 3 ? 0 : 1) : -1;
    avgpipe_result res;
    t->sum = (float)(t->rank + 1);
    res = t->sub.allreduce_sum(t->sub.user, me, &t->sum, 1, 5.0);
    if (res) t->bad = 1, snprintf(t->msg, sizeof t->msg, "rank %d: sub-allreduce: %s", t->rank, avgpipe_result_string(res));
    return NULL;
}

Test(comm, split_forms_groups) {
    avgpipe_comm c = make(4);
    static const int ga[2] = {0, 2}, gb[2] = {3, 1};
    splitter t[4];
    pthread_t th[4];
    avgpipe_comm_request s, r;
    int r0, x = 5, y = 0;
    memset(t, 0, sizeof t);
    for (r0 = 0; r0 < 4; r0++) { /* one thread splits for every rank: it must not wait for the others */
        t[r0].parent = &c, t[r0].rank = r0;
        cr_assert_eq(c.split(c.user, r0, r0 % 2 == 0 ? ga : gb, 2, &t[r0].sub), AVGPIPE_OK);
        cr_assert_eq(t[r0].sub.size, 2);
    }
    cr_assert_eq(c.split(c.user, 1, ga, 2, &t[0].sub), AVGPIPE_INVALID_ARG, "rank 1 is not in {0, 2}: refused");
    for (r0 = 0; r0 < 4; r0++) cr_assert_eq(pthread_create(&th[r0], NULL, split_allreduce_thread, &t[r0]), 0);
    for (r0 = 0; r0 < 4; r0++) pthread_join(th[r0], NULL);
    for (r0 = 0; r0 < 4; r0++) cr_assert(!t[r0].bad, "%s", t[r0].msg);
    cr_assert(t[0].sum == 4 && t[2].sum == 4, "group {0, 2}: %g %g, want 1 + 3", (double)t[0].sum, (double)t[2].sum);
    cr_assert(t[1].sum == 6 && t[3].sum == 6, "group {3, 1}: %g %g, want 4 + 2", (double)t[1].sum, (double)t[3].sum);
    /* group {3, 1}: rank 3 is sub-rank 0, rank 1 sub-rank 1 */
    cr_assert_eq(t[3].sub.isend(t[3].sub.user, 0, 1, &x, sizeof x, 7, &s), AVGPIPE_OK);
    cr_assert_eq(t[1].sub.irecv(t[1].sub.user, 1, 0, &y, sizeof y, 7, &r), AVGPIPE_OK);
    cr_assert_eq(t[1].sub.wait(t[1].sub.user, 1, r, 1.0, NULL), AVGPIPE_OK);
    cr_assert_eq(t[3].sub.wait(t[3].sub.user, 0, s, 1.0, NULL), AVGPIPE_OK);
    cr_assert_eq(y, 5);
    for (r0 = 0; r0 < 4; r0++) avgpipe_comm_destroy(&t[r0].sub);
    cr_assert_eq(c.isend(c.user, 3, 1, &x, sizeof x, 8, &s), AVGPIPE_OK); /* the parent is untouched */
    cr_assert_eq(c.irecv(c.user, 1, 3, &y, sizeof y, 8, &r), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 1, r, 1.0, NULL), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 3, s, 1.0, NULL), AVGPIPE_OK);
    avgpipe_comm_destroy(&c);
}

/* A wait that times out leaves the request pending: a later send completes it. */
Test(comm, wait_timeout_then_complete) {
    avgpipe_comm c = make(2);
    avgpipe_comm_request s, r;
    int v = 42, got = 0;
    double t0, dt;
    cr_assert_eq(c.irecv(c.user, 1, 0, &got, sizeof got, 0, &r), AVGPIPE_OK);
    t0 = now_s();
    cr_assert_eq(c.wait(c.user, 1, r, 0.1, NULL), AVGPIPE_TIMEOUT);
    dt = now_s() - t0;
    cr_assert(dt >= 0.09 && dt < 1.0, "a 0.1 s wait took %.3f s", dt);
    cr_assert_eq(c.isend(c.user, 0, 1, &v, sizeof v, 0, &s), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 1, r, 1.0, NULL), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 0, s, 1.0, NULL), AVGPIPE_OK);
    cr_assert_eq(got, 42);
    /* an unmatched send times out too */
    cr_assert_eq(c.isend(c.user, 0, 1, &v, sizeof v, 0, &s), AVGPIPE_OK);
    cr_assert_eq(c.wait(c.user, 0, s, 0.05, NULL), AVGPIPE_TIMEOUT);
    avgpipe_comm_destroy(&c);
}

typedef struct waiter {
    avgpipe_comm *c;
    avgpipe_comm_request req;
    int rank;
    avgpipe_result res;
    double seconds;
} waiter;

static void *wait_thread(void *arg) {
    waiter *w = (waiter *)arg;
    double t0 = now_s();
    w->res = w->c->wait(w->c->user, w->rank, w->req, 10.0, NULL);
    w->seconds = now_s() - t0;
    return NULL;
}
static void *barrier_wait_thread(void *arg) {
    waiter *w = (waiter *)arg;
    double t0 = now_s();
    w->res = w->c->barrier(w->c->user, w->rank, 10.0);
    w->seconds = now_s() - t0;
    return NULL;
}

Test(comm, abort_wakes_waiters) {
    avgpipe_comm c = make(3);
    avgpipe_comm_request r, s;
    pthread_t th[2];
    waiter w[2];
    int buf = 0;
    float x = 1;
    cr_assert_eq(c.irecv(c.user, 1, 0, &buf, sizeof buf, 0, &r), AVGPIPE_OK);
    memset(w, 0, sizeof w);
    w[0].c = &c, w[0].req = r, w[0].rank = 1;
    w[1].c = &c, w[1].rank = 2; /* rank 2 in a barrier nobody else joins */
    cr_assert_eq(pthread_create(&th[0], NULL, wait_thread, &w[0]), 0);
    cr_assert_eq(pthread_create(&th[1], NULL, barrier_wait_thread, &w[1]), 0);
    nap_ms(100);
    c.abort(c.user, AVGPIPE_CALLBACK_ERROR, "stop: test abort");
    pthread_join(th[0], NULL);
    pthread_join(th[1], NULL);
    cr_assert_eq(w[0].res, AVGPIPE_ABORTED, "the waiting receive returned %s", avgpipe_result_string(w[0].res));
    cr_assert_eq(w[1].res, AVGPIPE_ABORTED, "the waiting barrier returned %s", avgpipe_result_string(w[1].res));
    cr_assert(w[0].seconds < 2.0 && w[1].seconds < 2.0, "waiters woke after %.3f / %.3f s (timeout 10 s)", w[0].seconds,
              w[1].seconds);
    /* everything afterwards is refused */
    cr_assert_eq(c.isend(c.user, 0, 1, &buf, sizeof buf, 0, &s), AVGPIPE_ABORTED);
    cr_assert_eq(c.irecv(c.user, 2, 0, &buf, sizeof buf, 0, &s), AVGPIPE_ABORTED);
    cr_assert_eq(c.barrier(c.user, 0, 1.0), AVGPIPE_ABORTED);
    cr_assert_eq(c.allreduce_sum(c.user, 0, &x, 1, 1.0), AVGPIPE_ABORTED);
    avgpipe_comm_destroy(&c);
}

#define NT 4
#define NROUNDS 25
typedef struct team {
    avgpipe_comm *c;
    int rank;
    int *arrived; /* [NROUNDS], under mu */
    pthread_mutex_t *mu;
    int bad;
    char msg[256];
} team;

static void *barrier_thread(void *arg) {
    team *t = (team *)arg;
    int k, a;
    for (k = 0; k < NROUNDS && !t->bad; k++) {
        avgpipe_result res;
        if ((k + t->rank) % 3 == 0) nap_ms(1); /* arrive in varying order */
        pthread_mutex_lock(t->mu);
        t->arrived[k]++;
        pthread_mutex_unlock(t->mu);
        res = t->c->barrier(t->c->user, t->rank, 5.0);
        pthread_mutex_lock(t->mu);
        a = t->arrived[k];
        pthread_mutex_unlock(t->mu);
        if (res) t->bad = 1, snprintf(t->msg, sizeof t->msg, "rank %d, barrier %d: %s", t->rank, k, avgpipe_result_string(res));
        else if (a != NT) t->bad = 1, snprintf(t->msg, sizeof t->msg, "rank %d left barrier %d with %d of %d arrived", t->rank, k, a, NT);
    }
    return NULL;
}

/* Run fn on NT threads, rank r on thread r, then fail on the first rank that reported a problem. */
static void run_team(avgpipe_comm *c, void *(*fn)(void *), int *arrived, pthread_mutex_t *mu) {
    pthread_t th[NT];
    team t[NT];
    int r;
    for (r = 0; r < NT; r++) {
        memset(&t[r], 0, sizeof t[r]);
        t[r].c = c, t[r].rank = r, t[r].arrived = arrived, t[r].mu = mu;
        cr_assert_eq(pthread_create(&th[r], NULL, fn, &t[r]), 0);
    }
    for (r = 0; r < NT; r++) pthread_join(th[r], NULL);
    for (r = 0; r < NT; r++) cr_assert(!t[r].bad, "%s", t[r].msg);
}

Test(comm, barrier_four_threads) {
    avgpipe_comm c = make(NT);
    int arrived[NROUNDS] = {0}, r;
    pthread_mutex_t mu;
    pthread_mutex_init(&mu, NULL);
    run_team(&c, barrier_thread, arrived, &mu);
    for (r = 0; r < NROUNDS; r++) cr_assert_eq(arrived[r], NT);
    pthread_mutex_destroy(&mu);
    avgpipe_comm_destroy(&c);
}

Test(comm, barrier_timeout) {
    avgpipe_comm c = make(NT);
    double t0 = now_s(), dt;
    cr_assert_eq(c.barrier(c.user, 0, 0.1), AVGPIPE_TIMEOUT);
    dt = now_s() - t0;
    cr_assert(dt >= 0.09 && dt < 1.0, "a 0.1 s barrier took %.3f s", dt);
    avgpipe_comm_destroy(&c);
}

/* Allreduce: several back-to-back rounds of different lengths; values are small integers and
   halves so every sum is exact in float whatever the order. */
static const size_t ar_counts[] = {1, 7, 1000, 3, 4096, 1};
#define NAR (sizeof ar_counts / sizeof ar_counts[0])

static void *allreduce_thread(void *arg) {
    team *t = (team *)arg;
    size_t k, i;
    float *buf = (float *)malloc(4096 * sizeof(float));
    if (!buf) {
        t->bad = 1;
        return NULL;
    }
    for (k = 0; k < NAR && !t->bad; k++) {
        size_t n = ar_counts[k];
        avgpipe_result res;
        for (i = 0; i < n; i++) buf[i] = (float)(t->rank + 1) + 0.5f * (float)(i % 64) + (float)k;
        if ((k + (size_t)t->rank) % 2) nap_ms(1);
        res = t->c->allreduce_sum(t->c->user, t->rank, buf, n, 5.0);
        if (res) {
            t->bad = 1, snprintf(t->msg, sizeof t->msg, "rank %d, allreduce %zu: %s", t->rank, k, avgpipe_result_string(res));
            break;
        }
        for (i = 0; i < n; i++) {
            float want = 10.0f + 4 * (0.5f * (float)(i % 64) + (float)k); /* (1+2+3+4) + 4 * the rest */
            if (buf[i] != want) {
                t->bad = 1;
                snprintf(t->msg, sizeof t->msg, "rank %d, allreduce %zu of %zu floats, element %zu: %g, want %g", t->rank, k, n, i,
                         (double)buf[i], (double)want);
                break;
            }
        }
    }
    free(buf);
    return NULL;
}

Test(comm, allreduce_sum_four_threads) {
    avgpipe_comm c = make(NT);
    run_team(&c, allreduce_thread, NULL, NULL);
    avgpipe_comm_destroy(&c);
}

/* Sends and receives posted from different threads at once: each of 4 ranks sends a numbered
   stream to every other rank; every stream arrives in order. */
#define NMSG 200
static void *stream_thread(void *arg) {
    team *t = (team *)arg;
    avgpipe_comm *c = t->c;
    static int in[NT][NT][NMSG];
    avgpipe_comm_request sreq[NT][NMSG], rreq[NT][NMSG];
    int out[NMSG], p, k;
    for (k = 0; k < NMSG; k++) out[k] = t->rank * 100000 + k;
    for (k = 0; k < NMSG; k++)
        for (p = 0; p < NT; p++) {
            if (p == t->rank) continue;
            if (c->irecv(c->user, t->rank, p, &in[t->rank][p][k], sizeof(int), 0, &rreq[p][k]) ||
                c->isend(c->user, t->rank, p, &out[k], sizeof(int), 0, &sreq[p][k])) {
                t->bad = 1, snprintf(t->msg, sizeof t->msg, "rank %d: posting failed", t->rank);
                return NULL;
            }
        }
    for (p = 0; p < NT; p++) {
        if (p == t->rank) continue;
        for (k = 0; k < NMSG; k++) {
            avgpipe_result a = c->wait(c->user, t->rank, rreq[p][k], 5.0, NULL), b = c->wait(c->user, t->rank, sreq[p][k], 5.0, NULL);
            if (a || b) {
                t->bad = 1, snprintf(t->msg, sizeof t->msg, "rank %d, peer %d, message %d: %s / %s", t->rank, p, k,
                                     avgpipe_result_string(a), avgpipe_result_string(b));
                return NULL;
            }
            if (in[t->rank][p][k] != p * 100000 + k) {
                t->bad = 1, snprintf(t->msg, sizeof t->msg, "rank %d got %d from %d as message %d", t->rank, in[t->rank][p][k], p, k);
                return NULL;
            }
        }
    }
    return NULL;
}

Test(comm, concurrent_streams_stay_in_order) {
    avgpipe_comm c = make(NT);
    run_team(&c, stream_thread, NULL, NULL);
    avgpipe_comm_destroy(&c);
}

/* After a collective timed out on one rank, a later collective of all ranks must still be one: a
   barrier nobody leaves before every rank arrived, an allreduce that returns the sum of the values
   of this call. Failing with an error is acceptable (the communicator may be considered broken after
   a timeout); silently passing early or returning a wrong sum is not. Ranks arrive 20 ms apart. */
typedef struct late {
    avgpipe_comm *c;
    int rank, *arrived;
    pthread_mutex_t *mu;
    avgpipe_result res;
    int seen;   /* barrier: ranks arrived when this one left */
    float sum;  /* allreduce: what this rank got */
    int reduce; /* 0 barrier, 1 allreduce */
} late;

static void *late_thread(void *arg) {
    late *t = (late *)arg;
    nap_ms(20L * t->rank);
    pthread_mutex_lock(t->mu);
    ++*t->arrived;
    pthread_mutex_unlock(t->mu);
    if (t->reduce) {
        t->sum = (float)(t->rank + 1);
        t->res = t->c->allreduce_sum(t->c->user, t->rank, &t->sum, 1, 2.0);
    } else {
        t->res = t->c->barrier(t->c->user, t->rank, 2.0);
    }
    pthread_mutex_lock(t->mu);
    t->seen = *t->arrived;
    pthread_mutex_unlock(t->mu);
    return NULL;
}

static void collective_after_timeout(int reduce) {
    avgpipe_comm c = make(NT);
    pthread_t th[NT];
    late t[NT];
    pthread_mutex_t mu;
    int arrived = 0, r;
    float stale = 100;
    pthread_mutex_init(&mu, NULL);
    if (reduce) cr_assert_eq(c.allreduce_sum(c.user, 0, &stale, 1, 0.05), AVGPIPE_TIMEOUT);
    else cr_assert_eq(c.barrier(c.user, 0, 0.05), AVGPIPE_TIMEOUT);
    for (r = 0; r < NT; r++) {
        memset(&t[r], 0, sizeof t[r]);
        t[r].c = &c, t[r].rank = r, t[r].arrived = &arrived, t[r].mu = &mu, t[r].reduce = reduce;
        cr_assert_eq(pthread_create(&th[r], NULL, late_thread, &t[r]), 0);
    }
    for (r = 0; r < NT; r++) pthread_join(th[r], NULL);
    for (r = 0; r < NT; r++) {
        if (t[r].res != AVGPIPE_OK) continue; /* an error is an acceptable answer */
        if (reduce)
            cr_assert(t[r].sum == 10.0f, "rank %d: allreduce of 1+2+3+4 after a timed-out allreduce returned %g", r, (double)t[r].sum);
        else
            cr_assert_eq(t[r].seen, NT, "rank %d left the barrier with %d of %d ranks arrived (after a timed-out barrier)", r,
                         t[r].seen, NT);
    }
    pthread_mutex_destroy(&mu);
    avgpipe_comm_destroy(&c);
}

Test(comm, barrier_after_a_timed_out_barrier) { collective_after_timeout(0); }
Test(comm, allreduce_after_a_timed_out_allreduce) { collective_after_timeout(1); }

Test(comm, bad_arguments) {
    avgpipe_context ctx;
    avgpipe_comm c, broken;
    avgpipe_comm_request r;
    int x = 0;
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_comm_local_create(&ctx, 0, &c), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(&ctx), "ranks") != NULL, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_comm_local_create(&ctx, 2, NULL), AVGPIPE_INVALID_ARG);
    c = make(2);
    cr_assert_eq(c.isend(c.user, 0, 0, &x, sizeof x, 0, &r), AVGPIPE_INVALID_ARG, "a send to oneself must be refused");
    cr_assert_eq(c.isend(c.user, 0, 2, &x, sizeof x, 0, &r), AVGPIPE_INVALID_ARG, "a send to rank 2 of 2 must be refused");
    cr_assert_eq(c.irecv(c.user, -1, 1, &x, sizeof x, 0, &r), AVGPIPE_INVALID_ARG);
    broken = c;
    broken.wait = NULL;
    cr_assert_eq(avgpipe_comm_check(&ctx, &broken), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(&ctx), "wait") != NULL, "%s", avgpipe_last_error(&ctx));
    broken = c;
    broken.size = 0;
    cr_assert_eq(avgpipe_comm_check(&ctx, &broken), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_comm_check(&ctx, NULL), AVGPIPE_INVALID_ARG);
    avgpipe_comm_destroy(&c);
    avgpipe_comm_destroy(NULL); /* harmless */
}
