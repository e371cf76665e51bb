/* gpt_reference.c — the non-pipelined baseline of the GPT example: trains examples/gpt_model.h's byte-level
   GPT on the fortunes corpus in one plain loop, with the model held as the same S partitions the pipeline
   uses, so that a pipelined run of one pipeline (examples/gpt.c) can be compared with it bit for bit
   (`cmp` of the --save files). avgpipe.h is included only for its three exact arithmetic helpers of the
   step agreement (avgpipe_grad_sumsq, avgpipe_agree_combine, avgpipe_clip_scale: the global norm and the
   clip scale exactly as avgpipe's runtime computes them); no runtime, no threads of avgpipe's.

   One step (batch `step` of --batch windows: M micro-batches of B = batch / M rows, gpt_data_micro's order):
     for u = 0 .. M-1: forward partitions 0 .. S-1, then backward S-1 .. 0 (gradients added, so every
       partition accumulates its micro-batches in the order 0 .. M-1, as in the pipeline);
     the tie: grad_first_wte[k] = grad_last_wte[k] = grad_first_wte[k] + grad_last_wte[k];
     per partition p, from 0: avgpipe_grad_sumsq over its gradients in index order (the last one without
       its wte range), the S (sum of squares, non-finite count) pairs added by avgpipe_agree_combine in
       partition order: what the runtime's step agreement computes;
     a non-finite gradient anywhere skips the step on every partition (counted);
     else AdamW on every partition with the clip scale avgpipe_clip_scale(total, clip) (clip / norm above
     clip, else 1) and the learning rate of gpt_lr (linear warm-up, cosine to 10%); Adam's bias correction
     counts applied steps.

   --threads T: what a user without a pipeline library would do on T cores: T threads over the
   micro-batches of a step (thread k runs micro-batches k, k + T, ... with its own stashes and gradient
   arrays; the T gradient arrays are then added in thread order), each calling OpenBLAS single-threaded
   (the GEMMs of this model are small: M = B x T rows of at most 4C; threading inside them scales worse).
   T = 1 is the bit-for-bit baseline; T > 1 sums the gradients in another order (not bit-identical).

   Figures (2 vCPUs, Intel Xeon with AVX-512, OpenBLAS 0.3.21 SkylakeX kernel, gcc 12 -O2 -fno-math-errno):
     default shape (4 layers, 128 channels, 4 heads, context 64; batch 16 = M 2 x 8 windows): 8.6-9.3k
     tokens/s with --threads 1 (the same at M 1, 4 and 8), 12.6-13.5k with --threads 2 (1.45x: the two
     micro-batches of a step differ in length, and the gradient sum and AdamW run on one thread); llm.c's
     CPU trainer: 5,600 on 2 cores (quoted). Tokens are non-padding positions.
     Learning, one thread's bits (measured with gpt --pipes 1, which gives them): 2,400 steps (2.07M tokens)
     2.628 bits/byte, 3,600 steps (3.1M) 2.546; --channels 96, 3,600 steps: 2.607; lr 4e-3, 2,400 steps:
     2.648.
   Earlier, on 2 vCPUs of an AMD EPYC (OpenBLAS Haswell kernel, gcc -O3, the clip scale then nanoGPT's
     clip / (norm + 1e-6)): 13.0k tokens/s with --threads 1, 22.6k with --threads 2 (M 4); 3,600 steps in
     146 s with --threads 2: 2.540 bits/byte; --channels 96 --steps 5600: 2.495 in 151 s; 16 windows a step
     learned more per token than 32 and as much as 8; lr 6e-3 and 1e-2 stall near 2.7 nats, 2e-3 is slower.

   Build: meson (build/gpt_reference), or
          gcc -std=c11 -O2 -fno-math-errno -I. examples/gpt_reference.c -o /tmp/gpt_reference -lopenblas -lm -pthread
   Run:   /tmp/gpt_reference [--threads 2] [--channels 96 --steps 5600] [--save FILE] ...   (--help lists all) */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_STATIC /* a private copy: only the step agreement's arithmetic is used */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "examples/gpt_model.h"
#define BLAS_KERNEL_IMPLEMENTATION
#include "examples/blas_kernel.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void openblas_set_num_threads(int num_threads); /* also in OpenBLAS's cblas.h; not in netlib's */

#define PROG "gpt_reference"

typedef struct options {
    gpt_config cfg;
    int micro, stages, threads, split[GPT_MAX_PARTS], nsplit, log_every, eval_every, eval_micro, sample_len;
    long steps, warmup;
    double lr, clip, wd, temperature;
    unsigned long long seed;
    const char *data, *save;
} options;

static const char *usage =
    "usage: gpt_reference [options]\n"
    "  --layers L       transformer blocks (default 4)\n"
    "  --channels C     embedding width (default 128)\n"
    "  --heads H        attention heads (default 4)\n"
    "  --seq T          context: the longest window, and the rows of wpe (default 64)\n"
    "  --batch B        windows per step, a multiple of --micro (default 16)\n"
    "  --micro M        micro-batches per step, of B / M windows each (default 2)\n"
    "  --steps N        optimizer steps (default 2000, as gpt: about 2.5 minutes with --threads 2 on 2 cores)\n"
    "  --lr LR          peak learning rate (default 3e-3)\n"
    "  --warmup W       linear warm-up steps (default 100), then cosine decay to lr / 10\n"
    "  --wd WD          AdamW weight decay of the 2-D tensors (default 0.1)\n"
    "  --clip C         global gradient-norm clip (default 1.0; 0: none)\n"
    "  --seed S         weights and batch order (default 1)\n"
    "  --stages S       partitions, as the pipeline uses (default 2)\n"
    "  --split LIST     layers per partition, e.g. 3,3 (default: an even split of the L + 2 layers)\n"
    "  --threads T      threads over the micro-batches of a step (default 1: the bit-for-bit baseline)\n"
    "  --data DIR       fortunes corpus (default /usr/share/games/fortunes: apt-get install fortunes)\n"
    "  --save FILE      write the trained model (gpt_save: the same bytes whatever the partitioning)\n"
    "  --log-every K    train loss and tokens/s every K steps (default 200)\n"
    "  --eval-every K   validation loss every K steps on 60 validation micro-batches (default 1000; 0: only at the end, on all)\n"
    "  --sample-len N   bytes of each of the 3 samples at the end (default 200; 0: none)\n"
    "  --temperature X  of the samples (default 0.8; top-k 40)\n";

static void die_usage(const char *msg, const char *arg) {
    fprintf(stderr, PROG ": %s '%s' (try --help)\n", msg, arg);
    exit(2);
}

static long parse_long(const char *flag, const char *s, long lo, long hi) {
    char *end;
    long v;
    errno = 0;
    v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) {
        fprintf(stderr, PROG ": %s expects an integer in [%ld, %ld], got '%s'\n", flag, lo, hi, s);
        exit(2);
    }
    return v;
}

static double parse_double(const char *flag, const char *s, double lo, double hi) {
    char *end;
    double v;
    errno = 0;
    v = strtod(s, &end);
    if (end == s || *end || errno || !(v >= lo && v <= hi)) {
        fprintf(stderr, PROG ": %s expects a number in [%g, %g], got '%s'\n", flag, lo, hi, s);
        exit(2);
    }
    return v;
}

static void parse_options(int argc, char **argv, options *o) {
    static const char *const flags[] = {"--layers", "--channels", "--heads", "--seq", "--batch", "--micro", "--steps", "--lr",
                                        "--warmup", "--wd", "--clip", "--seed", "--stages", "--split", "--threads", "--data",
                                        "--save", "--log-every", "--eval-every", "--sample-len", "--temperature"};
    const char *split = NULL;
    char err[256];
    int i, stages_set = 0, batch = 16;
    size_t k;
    memset(o, 0, sizeof *o);
    o->cfg.L = 4, o->cfg.C = 128, o->cfg.H = 4, o->cfg.Tmax = 64, o->cfg.B = 8;
    o->micro = 2, o->stages = 2, o->threads = 1, o->steps = 2000, o->warmup = 100, o->lr = 3e-3, o->clip = 1.0, o->wd = 0.1;
    o->seed = 1, o->log_every = 200, o->eval_every = 1000, o->eval_micro = 60, o->sample_len = 200, o->temperature = 0.8;
    o->data = "/usr/share/games/fortunes";
    for (i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int known = 0;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) fputs(usage, stdout), exit(0);
        for (k = 0; k < sizeof flags / sizeof flags[0]; k++) known |= !strcmp(f, flags[k]);
        if (!known) die_usage(strncmp(f, "--", 2) ? "unexpected argument" : "unknown option", f);
        if (!v) die_usage("missing value after", f);
        i++;
        if (!strcmp(f, "--layers")) o->cfg.L = (int)parse_long(f, v, 0, GPT_MAX_BLOCKS);
        else if (!strcmp(f, "--channels")) o->cfg.C = (int)parse_long(f, v, 1, 16384);
        else if (!strcmp(f, "--heads")) o->cfg.H = (int)parse_long(f, v, 1, 16384);
        else if (!strcmp(f, "--seq")) o->cfg.Tmax = (int)parse_long(f, v, 1, 4096);
        else if (!strcmp(f, "--batch")) batch = (int)parse_long(f, v, 1, 1 << 20);
        else if (!strcmp(f, "--micro")) o->micro = (int)parse_long(f, v, 1, 1 << 16);
        else if (!strcmp(f, "--steps")) o->steps = parse_long(f, v, 1, 100000000L);
        else if (!strcmp(f, "--lr")) o->lr = parse_double(f, v, 1e-9, 10);
        else if (!strcmp(f, "--warmup")) o->warmup = parse_long(f, v, 0, 100000000L);
        else if (!strcmp(f, "--wd")) o->wd = parse_double(f, v, 0, 10);
        else if (!strcmp(f, "--clip")) o->clip = parse_double(f, v, 0, 1e9);
        else if (!strcmp(f, "--seed")) o->seed = (unsigned long long)parse_long(f, v, 0, 2147483647L);
        else if (!strcmp(f, "--stages")) o->stages = (int)parse_long(f, v, 1, GPT_MAX_PARTS), stages_set = 1;
        else if (!strcmp(f, "--split")) split = v;
        else if (!strcmp(f, "--threads")) o->threads = (int)parse_long(f, v, 1, 256);
        else if (!strcmp(f, "--data")) o->data = v;
        else if (!strcmp(f, "--save")) o->save = v;
        else if (!strcmp(f, "--log-every")) o->log_every = (int)parse_long(f, v, 1, 1 << 30);
        else if (!strcmp(f, "--eval-every")) o->eval_every = (int)parse_long(f, v, 0, 1 << 30);
        else if (!strcmp(f, "--sample-len")) o->sample_len = (int)parse_long(f, v, 0, 1 << 20);
        else if (!strcmp(f, "--temperature")) o->temperature = parse_double(f, v, 0, 100);
    }
    if (batch % o->micro) fprintf(stderr, PROG ": --batch %d is not a multiple of --micro %d\n", batch, o->micro), exit(2);
    o->cfg.B = batch / o->micro;
    if (gpt_config_check(&o->cfg, err, sizeof err)) fprintf(stderr, PROG ": %s\n", err), exit(2);
    if (split) {
        if (gpt_split_parse(split, o->split, GPT_MAX_PARTS, &o->nsplit, err, sizeof err)) fprintf(stderr, PROG ": --split: %s\n", err), exit(2);
        if (stages_set && o->stages != o->nsplit)
            fprintf(stderr, PROG ": --split %s has %d partitions, --stages says %d\n", split, o->nsplit, o->stages), exit(2);
        o->stages = o->nsplit;
    }
}

/* ---- One thread's buffers ------------------------------------------------------------------------------ */

typedef struct worker {
    const struct trainer *tr;
    int id;
    float *grad[GPT_MAX_PARTS]; /* thread 0: the trainer's own */
    float *stash[GPT_MAX_PARTS], *work[GPT_MAX_PARTS], *act[GPT_MAX_PARTS], *dact[GPT_MAX_PARTS];
    gpt_micro mb;
    long step;
    double batch_weight, loss; /* this step's: the batch's token count; the loss sums of its micro-batches */
    int failed;
} worker;

typedef struct trainer {
    options o;
    gpt_data data;
    gpt_part part[GPT_MAX_PARTS];
    int S;
    float *param[GPT_MAX_PARTS], *m[GPT_MAX_PARTS], *v[GPT_MAX_PARTS];
    worker *w;
} trainer;

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (!p) fprintf(stderr, PROG ": out of memory (%zu x %zu bytes)\n", n, size), exit(1);
    return p;
}

static void worker_init(worker *w, const trainer *tr, int id) {
    int s;
    memset(w, 0, sizeof *w);
    w->tr = tr, w->id = id;
    for (s = 0; s < tr->S; s++) {
        const gpt_part *p = &tr->part[s];
        w->grad[s] = (float *)xcalloc(p->nparams, sizeof(float));
        w->stash[s] = (float *)xcalloc(gpt_part_stash_floats(p), sizeof(float));
        w->work[s] = (float *)xcalloc(gpt_part_work_floats(p), sizeof(float));
        w->act[s] = (float *)xcalloc(gpt_act_floats(&p->cfg), sizeof(float));
        w->dact[s] = (float *)xcalloc(gpt_act_floats(&p->cfg), sizeof(float));
    }
    if (gpt_micro_alloc(&w->mb, tr->o.cfg.B, tr->o.cfg.Tmax)) fprintf(stderr, PROG ": out of memory\n"), exit(1);
}

static void worker_free(worker *w, int S) {
    int s;
    for (s = 0; s < S; s++) free(w->grad[s]), free(w->stash[s]), free(w->work[s]), free(w->act[s]), free(w->dact[s]);
    gpt_micro_free(&w->mb);
}

/* Micro-batch u of the worker's step: forward through every partition, then backward. */
static int run_micro(worker *w, int u) {
    const trainer *tr = w->tr;
    int s, S = tr->S;
    double loss = 0;
    if (gpt_data_micro(&tr->data, w->step, u, tr->o.micro, &w->mb)) return -1;
    for (s = 0; s < S; s++)
        if (gpt_forward(&tr->part[s], tr->param[s], &w->mb, s ? w->act[s - 1] : NULL, s + 1 < S ? w->act[s] : NULL, w->stash[s], &loss)) return -1;
    w->loss += loss;
    for (s = S - 1; s >= 0; s--)
        if (gpt_backward(&tr->part[s], tr->param[s], w->grad[s], w->stash[s], s + 1 < S ? w->dact[s] : NULL, s ? w->dact[s - 1] : NULL, w->work[s],
                         w->batch_weight))
            return -1;
    return 0;
}

/* Thread body: micro-batches id, id + T, ... of the step. */
static void *worker_main(void *arg) {
    worker *w = (worker *)arg;
    int u;
    for (u = w->id; u < w->tr->o.micro && !w->failed; u += w->tr->o.threads) w->failed = run_micro(w, u) != 0;
    return NULL;
}

/* ---- The step -------------------------------------------------------------------------------------------- */

/* Gradients of batch `step` into tr->w[0].grad (the other threads' added in thread order). Returns the
   mean loss per token. */
static double compute_grads(trainer *tr, long step, double weight) {
    int k, s, T = tr->o.threads;
    pthread_t th[256];
    double loss = 0;
    size_t i;
    for (k = 0; k < T; k++) {
        worker *w = &tr->w[k];
        for (s = 0; s < tr->S; s++) memset(w->grad[s], 0, tr->part[s].nparams * sizeof(float));
        w->step = step, w->batch_weight = weight, w->loss = 0, w->failed = 0;
    }
    if (T == 1) {
        worker_main(&tr->w[0]);
    } else {
        for (k = 0; k < T; k++)
            if (pthread_create(&th[k], NULL, worker_main, &tr->w[k])) fprintf(stderr, PROG ": cannot start a thread\n"), exit(1);
        for (k = 0; k < T; k++) pthread_join(th[k], NULL);
    }
    for (k = 0; k < T; k++) {
        if (tr->w[k].failed) fprintf(stderr, PROG ": step %ld: a micro-batch could not run (internal error)\n", step), exit(1);
        loss += tr->w[k].loss;
        if (k)
            for (s = 0; s < tr->S; s++)
                for (i = 0; i < tr->part[s].nparams; i++) tr->w[0].grad[s][i] += tr->w[k].grad[s][i];
    }
    return loss / weight;
}

/* The tie, the global norm (avgpipe's arithmetic), the non-finite check, clipping and AdamW. Returns 1 when
   the step was skipped; *norm gets the global gradient norm. */
static int apply_step(trainer *tr, long step, long *updates, double *norm) {
    float **g = tr->w[0].grad;
    gpt_adamw_hp hp = gpt_adamw_defaults();
    double parts[2 * GPT_MAX_PARTS], total[2], scale;
    float lr;
    int s, S = tr->S;
    hp.weight_decay = (float)tr->o.wd;
    if (S > 1) gpt_tie_sum(g[0] + tr->part[0].wte_off, g[S - 1] + tr->part[S - 1].wte_off, tr->part[0].wte_len);
    for (s = 0; s < S; s++) { /* the tied range counts once: on partition 0, not on the last one's copy */
        const gpt_part *p = &tr->part[s];
        size_t skip = p->wte_copy ? p->wte_off : p->nparams, next = p->wte_copy ? p->wte_off + p->wte_len : p->nparams;
        parts[2 * s] = parts[2 * s + 1] = 0;
        avgpipe_grad_sumsq(g[s], skip, &parts[2 * s], &parts[2 * s + 1]);
        avgpipe_grad_sumsq(g[s] + next, p->nparams - next, &parts[2 * s], &parts[2 * s + 1]);
    }
    avgpipe_agree_combine(parts, S, 2, total);
    *norm = sqrt(total[0]);
    if (total[1] > 0) return 1;
    scale = avgpipe_clip_scale(total[0], tr->o.clip);
    lr = (float)gpt_lr(tr->o.lr, step, tr->o.warmup, tr->o.steps);
    ++*updates;
    for (s = 0; s < S; s++) gpt_adamw(&tr->part[s], tr->param[s], g[s], tr->m[s], tr->v[s], *updates, lr, (float)scale, &hp);
    return 0;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void evaluate(trainer *tr, long step, size_t micro) {
    double nats, bpb, t0 = now();
    char err[256];
    if (gpt_eval(tr->part, tr->S, tr->param, &tr->data, micro, &nats, &bpb, err, sizeof err)) fprintf(stderr, PROG ": %s\n", err), exit(1);
    printf("step %6ld | val loss %.4f nats, %.3f bits/byte (%s, %.1f s)\n", step, nats, bpb, micro ? "subset" : "all validation windows",
           now() - t0);
    fflush(stdout);
}

static void setup(trainer *tr, int argc, char **argv) {
    options *o = &tr->o;
    char err[512], desc[1024];
    blas_kernel_shape shapes[4];
    blas_kernel_status bk;
    int s, N;
    parse_options(argc, argv, o);
    N = o->cfg.B * o->cfg.Tmax;
    shapes[0].m = N, shapes[0].n = 3 * o->cfg.C, shapes[0].k = o->cfg.C;
    shapes[1].m = N, shapes[1].n = 4 * o->cfg.C, shapes[1].k = o->cfg.C;
    shapes[2].m = N, shapes[2].n = o->cfg.C, shapes[2].k = 4 * o->cfg.C;
    shapes[3].m = N, shapes[3].n = GPT_VOCAB, shapes[3].k = o->cfg.C;
    blas_kernel_ensure(argv, shapes, 4, PROG, &bk);
    printf("BLAS: %s, 1 thread per worker, %d worker thread%s over the micro-batches\n", bk.line, o->threads, o->threads > 1 ? "s" : "");
    openblas_set_num_threads(1);
    tr->S = o->stages;
    if (gpt_partition(&o->cfg, tr->S, o->nsplit ? o->split : NULL, tr->part, err, sizeof err)) fprintf(stderr, PROG ": %s\n", err), exit(2);
    if (gpt_data_load(&tr->data, o->data, o->cfg.Tmax, o->cfg.B, o->seed, err, sizeof err)) fprintf(stderr, PROG ": %s\n", err), exit(1);
    if (gpt_data_batches_per_epoch(&tr->data, o->micro) < 1)
        fprintf(stderr, PROG ": the corpus has %zu micro-batches of %d rows: fewer than --micro %d\n", tr->data.nmicro, o->cfg.B, o->micro), exit(2);
    for (s = 0; s < tr->S; s++) {
        tr->param[s] = (float *)xcalloc(tr->part[s].nparams, sizeof(float));
        tr->m[s] = (float *)xcalloc(tr->part[s].nparams, sizeof(float));
        tr->v[s] = (float *)xcalloc(tr->part[s].nparams, sizeof(float));
        gpt_init(&tr->part[s], tr->param[s], o->seed);
    }
    tr->w = (worker *)xcalloc((size_t)o->threads, sizeof(worker));
    for (s = 0; s < o->threads; s++) worker_init(&tr->w[s], tr, s);
    gpt_parts_describe(tr->part, tr->S, desc, sizeof desc);
    printf("model: %d layers, %d channels, %d heads, context %d: %zu parameters; %d partitions [%s]\n", o->cfg.L, o->cfg.C, o->cfg.H, o->cfg.Tmax,
           gpt_config_params(&o->cfg), tr->S, desc);
    printf("data: %s: %zu files, %zu documents (%zu for validation), %.0f training and %.0f validation bytes+ends; %zu windows, "
           "%zu micro-batches of %d rows an epoch (padding %.2f%%), %ld steps of %d micro-batches an epoch\n",
           o->data, tr->data.nfiles, tr->data.ndocs, tr->data.nval_docs, tr->data.train_targets, tr->data.val_targets, tr->data.ntrain,
           tr->data.nmicro, o->cfg.B, 100 * gpt_data_padding(&tr->data), gpt_data_batches_per_epoch(&tr->data, o->micro), o->micro);
    printf("training: %ld steps, lr %g (warm-up %ld, cosine to %g), AdamW wd %g, clip %g, seed %llu\n", o->steps, o->lr, o->warmup, o->lr / 10,
           o->wd, o->clip, o->seed);
    fflush(stdout);
}

static void finish(trainer *tr, long skipped, double train_time, double tokens) {
    options *o = &tr->o;
    char err[256], *text;
    static const char *const prompts[3] = {"", "The ", "A man "};
    int s, k;
    printf("done: %ld steps (%ld skipped: non-finite gradients), %.0f tokens in %.1f s of training: %.0f tokens/s\n", o->steps, skipped, tokens,
           train_time, tokens / train_time);
    evaluate(tr, o->steps, 0);
    if (o->save) {
        if (gpt_save(o->save, tr->part, tr->S, tr->param, err, sizeof err)) fprintf(stderr, PROG ": %s\n", err), exit(1);
        printf("saved %s\n", o->save);
    }
    text = (char *)xcalloc((size_t)o->sample_len + 1, 1);
    for (k = 0; k < 3 && o->sample_len > 0; k++) {
        if (gpt_sample(tr->part, tr->S, tr->param, prompts[k], o->sample_len, (float)o->temperature, 40, o->seed + (unsigned)k, text,
                       (size_t)o->sample_len + 1, err, sizeof err) < 0)
            fprintf(stderr, PROG ": %s\n", err), exit(1);
        printf("--- sample %d (seed %llu)\n%s%s\n", k + 1, o->seed + (unsigned)k, prompts[k], text);
    }
    free(text);
    for (s = 0; s < o->threads; s++) worker_free(&tr->w[s], tr->S);
    for (s = 0; s < tr->S; s++) free(tr->param[s]), free(tr->m[s]), free(tr->v[s]);
    free(tr->w);
    gpt_data_free(&tr->data);
}

int main(int argc, char **argv) {
    static trainer tr;
    long step, updates = 0, skipped = 0;
    double train_time = 0, tokens = 0, win_time = 0, win_tokens = 0, win_loss = 0;
    int win_steps = 0;
    setup(&tr, argc, argv);
    for (step = 0; step < tr.o.steps; step++) {
        double weight = gpt_data_batch_tokens(&tr.data, step, tr.o.micro), t0 = now(), loss, norm;
        loss = compute_grads(&tr, step, weight);
        skipped += apply_step(&tr, step, &updates, &norm);
        t0 = now() - t0;
        train_time += t0, tokens += weight, win_time += t0, win_tokens += weight, win_loss += loss, win_steps++;
        if ((step + 1) % tr.o.log_every == 0 || step + 1 == tr.o.steps) {
            printf("step %6ld | loss %.4f | lr %.2e | norm %.3f | %.0f tokens/s | %.1f s\n", step + 1, win_loss / win_steps,
                   gpt_lr(tr.o.lr, step, tr.o.warmup, tr.o.steps), norm, win_tokens / win_time, train_time);
            fflush(stdout);
            win_time = win_tokens = win_loss = 0, win_steps = 0;
        }
        if (tr.o.eval_every && (step + 1) % tr.o.eval_every == 0 && step + 1 < tr.o.steps) evaluate(&tr, step + 1, (size_t)tr.o.eval_micro);
    }
    finish(&tr, skipped, train_time, tokens);
    return 0;
}
