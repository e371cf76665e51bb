/* tune_rank.h — the main jobs' shared ranking of the tuner's candidates (examples/mlp_app.h for
   fashion_mnist.c and cuda_mlp.cu, examples/gpt.c): one search per batch size (the user's, and 2x, 4x, ...
   when the batch is the tuner's to choose), every candidate kept with the batch it was searched at and the
   key it is ranked by, and the choice among them with its tie-break. What each program prints around it
   (samples or windows, its flags) stays in the program.

   Include after avgpipe.h; C and C++ (cuda_mlp.cu is built by nvcc). Static functions only. */
#ifndef AVGPIPE_EXAMPLES_TUNE_RANK_H
#define AVGPIPE_EXAMPLES_TUNE_RANK_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* The threads the tuner's searches predict on: the processors online (its result is the same for any
   count; avgpipe_tune_desc.threads). */
static int tune_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > AVGPIPE_TUNE_MAX_THREADS ? AVGPIPE_TUNE_MAX_THREADS : (int)n;
}

/* A candidate of one of the searches, with the batch it was searched at and what it is ranked by: the
   predicted time to target, or per sample (--objective throughput). */
typedef struct tune_cand {
    avgpipe_tune_candidate c;
    int batch;
    double key;
} tune_cand;

static int tune_cand_cmp(const void *x, const void *y) { /* fitting first, best first */
    const tune_cand *a = (const tune_cand *)x, *b = (const tune_cand *)y;
    if (a->c.fits != b->c.fits) return b->c.fits - a->c.fits;
    return (a->key > b->key) - (a->key < b->key);
}

/* Search m at td->batch x k for k = 1, 2, 4, ... <= batches (batches <= 1: the one batch), micro-batches no
   smaller than td->min_micro x k, and N x k <= batches (N x batch at most `batches` x td->batch); keep(c,
   user) (NULL: all) drops what the user fixed away. feed > 0: the samples one epoch holds per replica group,
   which bound N at each batch (every model needs a batch of its own per round; a batch the epoch cannot
   fill ends the sizes). by_throughput: the key is the time per sample, else the time to target. *out
   (malloc'd, sorted by tune_cand_cmp; free it) and *n; *simulated (may be NULL): the settings simulated,
   kept or not. 0, or -1 with a message in err[cap]. */
static int tune_rank_search(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_tune_desc *td, int batches, long feed,
                            int (*keep)(const avgpipe_tune_candidate *, void *), void *user, int by_throughput, tune_cand **out, int *n,
                            int *simulated, char *err, size_t cap) {
    tune_cand *cand = NULL;
    int i, k, ncand = 0;
    *out = NULL, *n = 0;
    if (simulated) *simulated = 0;
    for (k = 1; k == 1 || k <= batches; k *= 2) {
        avgpipe_tune_desc tk = *td;
        avgpipe_tune_candidate *c = NULL;
        tune_cand *grown;
        int got = 0;
        avgpipe_result r;
        tk.batch = td->batch * k, tk.min_micro = td->min_micro * k;
        if (feed > 0) {
            long fits = feed / tk.batch;
            if (fits < 1) break;
            if (tk.max_pipes > fits) tk.max_pipes = (int)fits;
        }
        if (k > 1 && tk.max_pipes > batches / k) tk.max_pipes = batches / k;
        if ((r = avgpipe_tune_search(ctx, m, &tk, &c, &got)) != AVGPIPE_OK) {
            free(cand);
            snprintf(err, cap, "search failed (batch %d): %s: %s", tk.batch, avgpipe_result_string(r), avgpipe_last_error(ctx));
            return -1;
        }
        if (!(grown = (tune_cand *)realloc(cand, (size_t)(ncand + got + 1) * sizeof *cand))) {
            avgpipe_free(ctx, c);
            free(cand);
            snprintf(err, cap, "out of memory");
            return -1;
        }
        cand = grown;
        if (simulated) *simulated += got;
        for (i = 0; i < got; i++)
            if (!keep || keep(&c[i], user)) {
                cand[ncand].c = c[i], cand[ncand].batch = tk.batch;
                cand[ncand++].key = by_throughput ? c[i].time_per_sample : c[i].time_to_target;
            }
        avgpipe_free(ctx, c);
    }
    if (ncand > 1) qsort(cand, (size_t)ncand, sizeof *cand, tune_cand_cmp);
    *out = cand, *n = ncand;
    return 0;
}

/* The choice among sorted candidates: the best that fits (*best, -1: none fits) and, of those within `tie`
   (relative) of its key, the one with the fewest pipelines (progress per sample), then the least memory.
   Returns its index, or -1 when none fits. */
static int tune_rank_pick(const tune_cand *cand, int n, double tie, int *best) {
    int i, chosen = -1;
    *best = n > 0 && cand[0].c.fits ? 0 : -1;
    for (i = 0; *best >= 0 && i < n && cand[i].c.fits; i++)
        if (cand[i].key <= cand[*best].key * (1 + tie) &&
            (chosen < 0 || cand[i].c.sched.pipes < cand[chosen].c.sched.pipes ||
             (cand[i].c.sched.pipes == cand[chosen].c.sched.pipes && cand[i].c.peak_bytes < cand[chosen].c.peak_bytes)))
            chosen = i;
    return chosen;
}

/* The candidate needing the least memory (for the message when none fits); 0 when n is 0. */
static int tune_rank_smallest(const tune_cand *cand, int n) {
    int i, small = 0;
    for (i = 1; i < n; i++)
        if (cand[i].c.peak_bytes < cand[small].c.peak_bytes) small = i;
    return small;
}

#endif
