/* async_device.h — a device for the tests whose streams really are asynchronous, as a GPU's are: each
   stream is a thread that runs its queue of tasks in order; an event is "stream s has run its first
   n tasks" (a record enqueues a marker task that also notes the time, so event_elapsed works); a wait
   on an event is a task that blocks its stream until the other stream got there; memory is host
   memory. The kernels (averaging pass, scale) run the CPU device's code as tasks; find_nonfinite
   synchronises its stream first, as the table requires; flag_nonfinite is a task (the averaging's guard
   then runs on the device, without a host wait).

   Every task may first sleep adev.delay_us (set it > 0 to make a missing wait show: a consumer that
   is not ordered after its producer then runs before it, on another thread); an averaging pass may
   take pass_delay_us more.

   Tests enqueue their own work (the stage callbacks' computation) with adev_enqueue(stream, fn, arg,
   size): arg is copied. Include after avgpipe.h; needs pthreads and <time.h> (nanosleep: define
   _POSIX_C_SOURCE >= 199309L before any include). */
#ifndef AVGPIPE_TESTS_ASYNC_DEVICE_H
#define AVGPIPE_TESTS_ASYNC_DEVICE_H

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ADEV_ARG 512 /* bytes of a task's argument, copied */

typedef struct adev_task {
    void (*fn)(void *arg);
    unsigned char arg[ADEV_ARG];
} adev_task;

typedef struct adev_stream {
    struct adev *dev;
    pthread_t thread;
    adev_task *q;
    long long head, tail, cap; /* tasks [head, tail) wait; the first `head` ones have run */
    long id; /* unique over the program (an address may come back for a new stream) */
    int quit;
} adev_stream;

typedef struct adev_event {
    adev_stream *s;
    long sid;         /* s->id when recorded */
    long long ticket; /* complete when s->head >= ticket */
    double t;         /* when the marker ran */
} adev_event;

typedef struct adev {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    adev_stream *streams[64];
    int nstreams;
    adev_stream *def; /* the NULL stream */
    avgpipe_device cpu;
    long delay_us;
    long pass_delay_us; /* an averaging pass takes at least this long (a slow kernel) */
    long allocs, frees;
    long next_id;
} adev;

static adev ADEV; /* one per test program */

static double adev_now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void adev_nap(long us) {
    struct timespec ts;
    ts.tv_sec = us / 1000000;
    ts.tv_nsec = (us % 1000000) * 1000;
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static void *adev_stream_main(void *p) {
    adev_stream *s = (adev_stream *)p;
    adev *d = s->dev;
    for (;;) {
        adev_task t;
        pthread_mutex_lock(&d->mu);
        while (s->head == s->tail && !s->quit) pthread_cond_wait(&d->cv, &d->mu);
        if (s->head == s->tail && s->quit) {
            pthread_mutex_unlock(&d->mu);
            return NULL;
        }
        t = s->q[s->head % s->cap];
        pthread_mutex_unlock(&d->mu);
        if (d->delay_us > 0) adev_nap(d->delay_us);
        t.fn(t.arg);
        pthread_mutex_lock(&d->mu);
        s->head++;
        pthread_cond_broadcast(&d->cv);
        pthread_mutex_unlock(&d->mu);
    }
}

static adev_stream *adev_stream_new(adev *d) {
    adev_stream *s = (adev_stream *)calloc(1, sizeof *s);
    if (!s) return NULL;
    s->dev = d;
    s->cap = 1024;
    s->q = (adev_task *)malloc((size_t)s->cap * sizeof *s->q);
    if (!s->q || pthread_create(&s->thread, NULL, adev_stream_main, s) != 0) {
        free(s->q);
        free(s);
        return NULL;
    }
    pthread_mutex_lock(&d->mu);
    s->id = ++d->next_id;
    d->streams[d->nstreams++] = s;
    pthread_mutex_unlock(&d->mu);
    return s;
}

static adev_stream *adev_of(adev_stream *s) { return s ? s : ADEV.def; }

/* Enqueue fn(copy of arg) on stream s (NULL: the default stream); *ticket (may be NULL): the task's
   position, counted from 1 (the stream got there once head >= ticket). */
static int adev_enqueue_at(avgpipe_device_stream stream, void (*fn)(void *), const void *arg, size_t size, long long *ticket) {
    adev *d = &ADEV;
    adev_stream *s = adev_of((adev_stream *)stream);
    adev_task *t;
    if (size > ADEV_ARG) return -1;
    pthread_mutex_lock(&d->mu);
    if (s->tail - s->head == s->cap) { /* grow the ring, keeping the order */
        long long n = s->cap * 2, i;
        adev_task *q = (adev_task *)malloc((size_t)n * sizeof *q);
        if (!q) {
            pthread_mutex_unlock(&d->mu);
            return -1;
        }
        for (i = s->head; i < s->tail; i++) q[i % n] = s->q[i % s->cap];
        free(s->q);
        s->q = q;
        s->cap = n;
    }
    t = &s->q[s->tail % s->cap];
    t->fn = fn;
    if (size) memcpy(t->arg, arg, size);
    s->tail++;
    if (ticket) *ticket = s->tail;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    return 0;
}

static int adev_enqueue(avgpipe_device_stream stream, void (*fn)(void *), const void *arg, size_t size) {
    return adev_enqueue_at(stream, fn, arg, size, NULL);
}

/* Is s (of id `id`) a stream not destroyed yet? (A destroyed stream ran all its tasks first.) Mutex held. */
static int adev_live(const adev_stream *s, long id) {
    int i;
    for (i = 0; i < ADEV.nstreams; i++)
        if (ADEV.streams[i] == s) return s->id == id;
    return 0;
}

/* Block until stream s has run its first `ticket` tasks (at once when s was destroyed). */
static void adev_reach_id(adev_stream *s, long id, long long ticket) {
    adev *d = &ADEV;
    pthread_mutex_lock(&d->mu);
    while (adev_live(s, id) && s->head < ticket) pthread_cond_wait(&d->cv, &d->mu);
    pthread_mutex_unlock(&d->mu);
}
static void adev_reach(adev_stream *s, long long ticket) { adev_reach_id(s, s->id, ticket); }

/* ---- tasks ---- */

typedef struct { void *dst; const void *src; size_t n; int value, is_set; } adev_mem_arg;
static void adev_mem_task(void *p) {
    adev_mem_arg *a = (adev_mem_arg *)p;
    if (a->is_set) memset(a->dst, a->value, a->n);
    else if (a->n) memmove(a->dst, a->src, a->n);
}
typedef struct { adev_stream *s; long id; long long ticket; } adev_wait_arg;
static void adev_wait_task(void *p) {
    adev_wait_arg *a = (adev_wait_arg *)p;
    adev_reach_id(a->s, a->id, a->ticket);
}
static void adev_mark_task(void *p) { (*(adev_event **)p)->t = adev_now(); }
static void adev_pass_task(void *p) {
    avgpipe_ea_pass *e = (avgpipe_ea_pass *)p;
    if (ADEV.pass_delay_us > 0) adev_nap(ADEV.pass_delay_us);
    ADEV.cpu.ea_pass(ADEV.cpu.user, e, NULL);
}
typedef struct { float *x; float f; size_t n; } adev_scale_arg;
static void adev_scale_task(void *p) {
    adev_scale_arg *a = (adev_scale_arg *)p;
    ADEV.cpu.scale(ADEV.cpu.user, a->x, a->f, a->n, NULL);
}

typedef struct { const float *x; size_t n; uint32_t *flag, bits, tag; } adev_flag_arg;
static void adev_flag_task(void *p) { /* the device's non-finite guard: see avgpipe_device.flag_nonfinite */
    adev_flag_arg *a = (adev_flag_arg *)p;
    size_t bad = a->n;
    ADEV.cpu.find_nonfinite(ADEV.cpu.user, a->x, a->n, &bad, NULL);
    if (bad < a->n) {
        if (!a->flag[0]) a->flag[1] = a->tag;
        a->flag[0] |= a->bits;
    }
}

/* ---- the table ---- */

static avgpipe_result adev_alloc(void *u, size_t bytes, void **out) {
    (void)u;
    *out = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!*out) return AVGPIPE_OUT_OF_MEMORY;
    __atomic_add_fetch(&ADEV.allocs, 1, __ATOMIC_RELAXED);
    return AVGPIPE_OK;
}
static void adev_free(void *u, void *p) {
    (void)u;
    if (p) __atomic_add_fetch(&ADEV.frees, 1, __ATOMIC_RELAXED);
    free(p);
}
static avgpipe_result adev_copy(void *u, void *dst, const void *src, size_t n, avgpipe_device_copy_kind k, avgpipe_device_stream s) {
    adev_mem_arg a = {dst, src, n, 0, 0};
    (void)u, (void)k;
    return adev_enqueue(s, adev_mem_task, &a, sizeof a) ? AVGPIPE_OUT_OF_MEMORY : AVGPIPE_OK;
}
static avgpipe_result adev_memset(void *u, void *dst, int v, size_t n, avgpipe_device_stream s) {
    adev_mem_arg a = {dst, NULL, n, v, 1};
    (void)u;
    return adev_enqueue(s, adev_mem_task, &a, sizeof a) ? AVGPIPE_OUT_OF_MEMORY : AVGPIPE_OK;
}
static avgpipe_result adev_stream_create(void *u, avgpipe_device_stream *out) {
    (void)u;
    *out = (avgpipe_device_stream)adev_stream_new(&ADEV);
    return *out ? AVGPIPE_OK : AVGPIPE_BACKEND_ERROR;
}
static avgpipe_result adev_stream_sync(void *u, avgpipe_device_stream st) {
    adev_stream *s = adev_of((adev_stream *)st);
    long long t;
    (void)u;
    pthread_mutex_lock(&ADEV.mu);
    t = s->tail;
    pthread_mutex_unlock(&ADEV.mu);
    adev_reach(s, t);
    return AVGPIPE_OK;
}
static void adev_stream_destroy(void *u, avgpipe_device_stream st) {
    adev_stream *s = (adev_stream *)st;
    int i;
    if (!s) return;
    adev_stream_sync(u, st);
    pthread_mutex_lock(&ADEV.mu);
    s->quit = 1;
    pthread_cond_broadcast(&ADEV.cv);
    for (i = 0; i < ADEV.nstreams; i++)
        if (ADEV.streams[i] == s) ADEV.streams[i] = ADEV.streams[--ADEV.nstreams];
    pthread_mutex_unlock(&ADEV.mu);
    pthread_join(s->thread, NULL);
    free(s->q);
    free(s);
}
static avgpipe_result adev_event_create(void *u, avgpipe_device_event *out) {
    (void)u;
    *out = (avgpipe_device_event)calloc(1, sizeof(adev_event));
    return *out ? AVGPIPE_OK : AVGPIPE_OUT_OF_MEMORY;
}
static avgpipe_result adev_event_sync(void *u, avgpipe_device_event ev);
/* As CUDA's: a record still queued completes first (its marker writes the event). */
static void adev_event_destroy(void *u, avgpipe_device_event e) {
    if (e) adev_event_sync(u, e);
    free(e);
}
static avgpipe_result adev_event_record(void *u, avgpipe_device_event ev, avgpipe_device_stream st) {
    adev_event *e = (adev_event *)ev;
    adev_stream *s = adev_of((adev_stream *)st);
    long long ticket;
    (void)u;
    if (adev_enqueue_at((avgpipe_device_stream)s, adev_mark_task, &e, sizeof e, &ticket)) return AVGPIPE_OUT_OF_MEMORY;
    pthread_mutex_lock(&ADEV.mu);
    e->s = s;
    e->sid = s->id;
    e->ticket = ticket; /* the marker included */
    pthread_mutex_unlock(&ADEV.mu);
    return AVGPIPE_OK;
}
static avgpipe_result adev_stream_wait(void *u, avgpipe_device_stream st, avgpipe_device_event ev) {
    adev_event *e = (adev_event *)ev;
    adev_wait_arg a;
    (void)u;
    pthread_mutex_lock(&ADEV.mu);
    a.s = e->s, a.id = e->sid, a.ticket = e->ticket; /* the event's latest record, as of now */
    if (a.s && !adev_live(a.s, a.id)) a.s = NULL;     /* its stream is gone: the record completed */
    pthread_mutex_unlock(&ADEV.mu);
    if (!a.s) return AVGPIPE_OK;
    return adev_enqueue(st, adev_wait_task, &a, sizeof a) ? AVGPIPE_OUT_OF_MEMORY : AVGPIPE_OK;
}
static avgpipe_result adev_event_sync(void *u, avgpipe_device_event ev) {
    adev_event *e = (adev_event *)ev;
    adev_stream *s;
    long long t;
    long id;
    (void)u;
    pthread_mutex_lock(&ADEV.mu);
    s = e->s, t = e->ticket, id = e->sid;
    pthread_mutex_unlock(&ADEV.mu);
    if (s) adev_reach_id(s, id, t);
    return AVGPIPE_OK;
}
static avgpipe_result adev_event_query(void *u, avgpipe_device_event ev, int *done) {
    adev_event *e = (adev_event *)ev;
    (void)u;
    pthread_mutex_lock(&ADEV.mu);
    *done = !e->s || !adev_live(e->s, e->sid) || e->s->head >= e->ticket;
    pthread_mutex_unlock(&ADEV.mu);
    return AVGPIPE_OK;
}
static avgpipe_result adev_event_elapsed(void *u, avgpipe_device_event a, avgpipe_device_event b, double *seconds) {
    (void)u;
    adev_event_sync(u, a);
    adev_event_sync(u, b);
    *seconds = ((adev_event *)b)->t - ((adev_event *)a)->t;
    return AVGPIPE_OK;
}
static avgpipe_result adev_sync(void *u) {
    int i, n;
    adev_stream *all[64];
    pthread_mutex_lock(&ADEV.mu);
    n = ADEV.nstreams;
    memcpy(all, ADEV.streams, (size_t)n * sizeof all[0]);
    pthread_mutex_unlock(&ADEV.mu);
    for (i = 0; i < n; i++) adev_stream_sync(u, (avgpipe_device_stream)all[i]);
    return AVGPIPE_OK;
}
static avgpipe_result adev_ea_pass(void *u, const avgpipe_ea_pass *p, avgpipe_device_stream s) {
    (void)u;
    return adev_enqueue(s, adev_pass_task, p, sizeof *p) ? AVGPIPE_OUT_OF_MEMORY : AVGPIPE_OK;
}
static avgpipe_result adev_find_nonfinite(void *u, const float *x, size_t n, size_t *index, avgpipe_device_stream s) {
    adev_stream_sync(u, s);
    return ADEV.cpu.find_nonfinite(ADEV.cpu.user, x, n, index, NULL);
}
static avgpipe_result adev_scale(void *u, float *x, float f, size_t n, avgpipe_device_stream s) {
    adev_scale_arg a = {x, f, n};
    (void)u;
    return adev_enqueue(s, adev_scale_task, &a, sizeof a) ? AVGPIPE_OUT_OF_MEMORY : AVGPIPE_OK;
}
static avgpipe_result adev_flag_nonfinite(void *u, const float *x, size_t n, uint32_t *flag, uint32_t bits, uint32_t tag,
                                          avgpipe_device_stream s) {
    adev_flag_arg a = {x, n, flag, bits, tag};
    (void)u;
    return adev_enqueue(s, adev_flag_task, &a, sizeof a) ? AVGPIPE_OUT_OF_MEMORY : AVGPIPE_OK;
}
static const char *adev_error_string(void *u) {
    (void)u;
    return "";
}

/* The device table (ADEV is the state; call once per program, adev_close at the end). */
static avgpipe_device adev_open(long delay_us) {
    avgpipe_device t;
    memset(&t, 0, sizeof t);
    pthread_mutex_init(&ADEV.mu, NULL);
    pthread_cond_init(&ADEV.cv, NULL);
    ADEV.delay_us = delay_us;
    avgpipe_device_cpu_create(NULL, NULL, &ADEV.cpu);
    ADEV.def = adev_stream_new(&ADEV);
    t.name = "async-test";
    t.alloc_overhead = 0;
    t.alloc = adev_alloc;
    t.free = adev_free;
    t.copy = adev_copy;
    t.memset = adev_memset;
    t.stream_create = adev_stream_create;
    t.stream_destroy = adev_stream_destroy;
    t.stream_synchronize = adev_stream_sync;
    t.event_create = adev_event_create;
    t.event_destroy = adev_event_destroy;
    t.event_record = adev_event_record;
    t.stream_wait_event = adev_stream_wait;
    t.event_synchronize = adev_event_sync;
    t.event_query = adev_event_query;
    t.event_elapsed = adev_event_elapsed;
    t.synchronize = adev_sync;
    t.ea_pass = adev_ea_pass;
    t.find_nonfinite = adev_find_nonfinite;
    t.scale = adev_scale;
    t.flag_nonfinite = adev_flag_nonfinite;
    t.error_string = adev_error_string;
    return t;
}

static void adev_close(void) {
    adev_stream_destroy(NULL, (avgpipe_device_stream)ADEV.def);
    ADEV.def = NULL;
    avgpipe_device_destroy(&ADEV.cpu);
}

#endif
