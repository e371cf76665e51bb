/* fashion_mnist.c — avgpipe's main example: an MLP (examples/mlp.h) trained on Fashion-MNIST by N
   parallel pipelines of G stages, with elastic averaging of the N models after every round.

   Each stage partition runs on its own stage thread (the runtime's workers; OpenBLAS single-threaded
   inside them), or, with --backend mpi, one pipeline rank per MPI process (avgpipe_mpi.h):
       mpirun -np 4 build/fashion_mnist --backend mpi                    4 ranks, one per process
       mpirun -np 8 build/fashion_mnist --backend mpi --replicas 2       2 replica groups of 4
   Each process loads only what its stages need (stage 0 the pixels, the last stage the labels; rank 0
   also the test set, which it evaluates the gathered reference model on) and allocates only its stages;
   rank 0 tunes (in threads, on its own) and prints. --replicas D (threads or MPI) trains D groups of N
   pipelines on disjoint shares of every epoch and averages their reference models every round. Every parallel model starts from the same weights, trains on its own batches (an epoch
   shows each training sample to one pipeline) with its own Adam state, and is pulled toward the
   reference model, the mean of the N models, after each of its steps. The reference model is what
   gets evaluated.

   By default M and N are "auto": before training the example profiles a few iterations, fits the
   tuner's cost model, simulates every setting (schedule, M, N, K, round mode), prints the fit, the
   choice and the best alternatives on stderr, and trains with the choice (see tune()).

   Build: gcc -std=c11 -O2 -Wall -Wextra -pedantic -Werror -I. examples/fashion_mnist.c -o fashion_mnist \
              -lopenblas -lz -lm -pthread                  (meson adds MPI when it finds it: -DFMNIST_MPI)
   Run:   ./fashion_mnist                       (4 stages; schedule, M, N, K from the tuner)
          ./fashion_mnist --micro 4 --pipes 2   (no tuner: advance forward with the runtime's adaptive K)
          ./fashion_mnist --schedule zbh1 --pipes 3 --trace trace.json           (--help lists all)

   Callback mapping (avgpipe_op_ctx -> mlp.h):
     forward   stage 0 gathers the samples of (pipe, round, micro) into its stash (input is NULL there),
               the last stage gathers their labels; mlp_stage_forward(stage, params, stash[stage][slot],
               input, output); the last stage then sets op->loss = mlp_stage_loss (softmax kept for B).
     backward  mlp_stage_backward(..., input, grad_output, grad_input, grad[pipe][stage], 1 / batch)
     I / W     mlp_stage_backward_input / mlp_stage_backward_weight (B is exactly I then W)
     step      Adam on (pipe, stage) with cosine learning-rate decay; zeroes the accumulated gradient. */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#ifdef FMNIST_MPI
#include "avgpipe_mpi.h"
#endif
#define MLP_IMPLEMENTATION
#include "examples/mlp.h"

#include <errno.h>
#include <sys/stat.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void openblas_set_num_threads(int num_threads); /* also in OpenBLAS's cblas.h; not in netlib's */
char *openblas_get_corename(void);

#define PROG "fashion_mnist"
#define ADVANCE_AUTO (-1)
#define AUTO 0 /* --micro auto, --pipes auto: the tuner picks them */
#define MAX_REPLICAS 8

typedef struct options {
    int stages, pipes, micro, batch, epochs, rounds, chunks, advance, limit_train, replicas;
    int checkpoint_every, stop_after;  /* iterations between checkpoints (0: only at the end); epochs to run now */
    int deterministic, continuous, normalize, cosine, mpi;
    int schedule_set, sync_set;   /* the user fixed --schedule / --sync: the tuner keeps them */
    avgpipe_sched_kind schedule;
    double alpha, lr;
    double mem_limit;             /* --mem-limit: bytes per rank for the tuner; 0: none */
    unsigned long long seed;
    const char *data, *hidden, *trace, *profile, *save, *profile_tune, *checkpoint, *resume;
} options;

/* Everything the callbacks reach through op->user. Per-(replica, stage) state (stash, perm) is touched
   only by the worker of the rank that holds that stage of that replica group; per-model state (the nets'
   gradients and Adam) too. A model is replica * N + pipe. */
typedef struct app {
    options opt;
    mlp_model model;
    mlp_data train, test;
    mlp_order order;              /* over D * N "pipelines": each model its share of every epoch */
    int G, S, mb;                 /* stage partitions, ranks per replica group */
    float loss_scale;             /* 1 / samples per batch: gradients are batch means */
    int64_t decay_steps;          /* optimizer steps of one model over the whole run */
    mlp_adam_hp adam;
    mlp_net *nets;                /* [D * N]; only those of local replica groups are allocated */
    float **params;               /* [model * G + stage] -> nets[model].params[stage], NULL when not local */
    size_t act_bytes[MLP_MAX_LAYERS];
    int slots[MLP_MAX_LAYERS];
    mlp_stash *stash[MAX_REPLICAS][MLP_MAX_LAYERS]; /* [replica][stage][slot] */
    mlp_perm perm[MAX_REPLICAS][MLP_MAX_LAYERS];    /* sample order cache of stage 0 and of the last stage */
    long long correct[MAX_REPLICAS]; /* last stage's argmax hits; read by the main thread between iterations */
    /* processes (--backend mpi): this one's rank and the comm backend; me = -1 with threads */
    int me, nproc;
    avgpipe_comm comm;
    float *ref[MLP_MAX_LAYERS];   /* rank 0: the gathered reference model */
} app;

static int g_rank = -1; /* --backend mpi: this process's rank, for messages */

/* Print "fashion_mnist: <message>" (mpi: "fashion_mnist (rank R): ...") on stderr; returns -1. */
static int fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (g_rank >= 0) fprintf(stderr, PROG " (rank %d): ", g_rank);
    else fputs(PROG ": ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return -1;
}

/* ---- Options ---------------------------------------------------------------------------------- */

static const char *usage =
    "usage: " PROG " [options]\n"
    "  --stages G          stage partitions of the model (default 4)\n"
    "  --backend B         threads (default: every rank a thread of this process) | mpi (one rank per\n"
    "                      process: mpirun -np <replicas x ranks> " PROG " --backend mpi ...)\n"
    "  --replicas D        replica groups of the pipelines, each on its own share of the data, their\n"
    "                      reference models averaged every round (default 1)\n"
    "  --pipes N|auto      parallel pipelines = parallel models (default auto: the tuner picks 1..4)\n"
    "  --micro M|auto      micro-batches per batch (default auto: the tuner picks M, micro-batches of\n"
    "                      at least 16 samples)\n"
    "  --batch B           samples per batch per pipeline (default 128; a multiple of M)\n"
    "  --schedule KIND     afab | 1f1b | advance | interleaved | zbh1 | zbv | dualpipev (default advance;\n"
    "                      with --micro or --pipes auto the tuner's pick among afab, 1f1b, advance, zbh1,\n"
    "                      or only KIND); zbv and dualpipev hold two stages per rank in a V (ranks = G / 2)\n"
    "  --advance K|auto    advance forwards (advance only; default auto: the runtime's adaptive K when M and\n"
    "                      N are fixed, the tuner's K otherwise; a fixed K needs fixed --micro and --pipes)\n"
    "  --chunks V          model chunks per rank (interleaved only; default 2; ranks = G / V)\n"
    "  --rounds R          rounds per runtime iteration (default 8)\n"
    "  --sync              synchronous rounds (default: continuous rounds, or the tuner's pick)\n"
    "  --mem-limit SIZE    tuner: bytes per rank (buffers, parameters, Adam state), suffix K, M or G\n"
    "                      (binary); default no limit\n"
    "  --profile-tune FILE tuner: keep its profile (default: a temporary file, removed)\n"
    "  --alpha A           elasticity in [0, 1] (default 0.1)\n"
    "  --epochs E          (default 10)\n"
    "  --lr LR             Adam learning rate, cosine-decayed to 0 over the run (default 1e-3)\n"
    "  --constant-lr       no learning-rate decay\n"
    "  --seed S            weights and sample order (default 1)\n"
    "  --hidden LIST       hidden widths (default 512,256,128: 784-512-256-128-10)\n"
    "  --data DIR          (default /usr/share/datasets/fashion-mnist)\n"
    "  --limit-train N     use only the first N training samples\n"
    "  --deterministic     every averaging waits for the previous round's reference (reproducible)\n"
    "  --trace FILE.json   Chrome trace of the last iteration (open in ui.perfetto.dev); with --backend\n"
    "                      mpi each process writes its ranks' part, rank R's to FILE.R (rank 0's to FILE)\n"
    "  --profile FILE      per-op profile of the last iteration (the tuner's input); mpi: as --trace\n"
    "  --save FILE         write the reference model's parameters (mlp_params_save)\n"
    "  --checkpoint DIR    save a checkpoint there (avgpipe_run_save: every rank's models, references,\n"
    "                      averaging state and Adam state) at the end, and every --checkpoint-every K\n"
    "                      iterations; the directory is created if missing\n"
    "  --resume DIR        continue from the checkpoint in DIR: give the flags it was made with (with\n"
    "                      --micro/--pipes auto the tuner must choose the same: fix them to be sure)\n"
    "  --stop-after E      stop after epoch E of --epochs (to resume later; default: run them all)\n"
    "  --no-normalize      keep pixels in [0, 1] (default: standardise with the training set's mean/std)\n"
    "Tuning (when --micro or --pipes is auto, the default): before training, the model is profiled for\n"
    "a few iterations of 1 pipeline at two micro-batch sizes on throwaway copies of the initial weights\n"
    "(training then starts from the same weights and sample order as without tuning), a cost model is\n"
    "fitted, and every setting (schedule, M, N <= 4, K, round mode) is simulated; what the command line\n"
    "fixes (--micro, --pipes, --schedule, --sync) stays fixed. The fastest predicted per sample within\n"
    "--mem-limit is trained (near-ties, within 0.5%: fewer pipelines, then less memory). The fit, the\n"
    "choice and the best alternatives (one per M and N) go to stderr.\n";

/* A bad command line: one line on stderr, exit status 2. */
static void bad_usage(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs(PROG ": ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(2);
}

static long parse_long(const char *flag, const char *s, long lo, long hi) {
    char *end;
    long v;
    errno = 0;
    v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi)
        bad_usage("%s expects an integer in [%ld, %ld], got '%s'", flag, lo, hi, s);
    return v;
}

static double parse_double(const char *flag, const char *s, double lo, double hi) {
    char *end;
    double v;
    errno = 0;
    v = strtod(s, &end);
    if (end == s || *end || errno || !(v >= lo && v <= hi))
        bad_usage("%s expects a number in [%g, %g], got '%s'", flag, lo, hi, s);
    return v;
}

/* A size in bytes: a number with an optional binary suffix K, M or G ("512M", "1.5G"). */
static double parse_size(const char *flag, const char *s) {
    char *end;
    double v, unit = 1;
    errno = 0;
    v = strtod(s, &end);
    if (end != s && *end && !end[1]) {
        if (*end == 'K' || *end == 'k') unit = 1024.0, end++;
        else if (*end == 'M' || *end == 'm') unit = 1024.0 * 1024, end++;
        else if (*end == 'G' || *end == 'g') unit = 1024.0 * 1024 * 1024, end++;
    }
    if (end == s || *end || errno || !(v * unit >= 1 && v * unit <= 1e18))
        bad_usage("%s expects a size in bytes with an optional suffix K, M or G (e.g. 64M), got '%s'", flag, s);
    return v * unit;
}

/* --micro or --pipes auto: profile, tune, then train with the tuner's choice. */
static int tuning(const options *o) { return o->micro == AUTO || o->pipes == AUTO; }
/* Schedules that hold two stages per rank in a V (rank r: stages r and 2S-1-r). */
static int v_placed(avgpipe_sched_kind k) { return k == AVGPIPE_SCHED_ZBV || k == AVGPIPE_SCHED_DUALPIPEV; }

static void set_defaults(options *o) {
    memset(o, 0, sizeof *o);
    o->stages = 4, o->pipes = AUTO, o->micro = AUTO, o->batch = 128, o->epochs = 10, o->rounds = 8, o->chunks = 0;
    o->replicas = 1;
    o->advance = ADVANCE_AUTO, o->continuous = 1, o->normalize = 1, o->cosine = 1;
    o->schedule = AVGPIPE_SCHED_ADVANCE, o->alpha = 0.1, o->lr = 1e-3, o->seed = 1;
    o->data = "/usr/share/datasets/fashion-mnist", o->hidden = "512,256,128";
}

/* Flags without a value; returns 1 if f was one. */
static int parse_switch(options *o, const char *f) {
    if (!strcmp(f, "--help") || !strcmp(f, "-h")) fputs(usage, stdout), exit(0);
    if (!strcmp(f, "--sync")) return o->continuous = 0, o->sync_set = 1, 1;
    if (!strcmp(f, "--deterministic")) return o->deterministic = 1, 1;
    if (!strcmp(f, "--no-normalize")) return o->normalize = 0, 1;
    if (!strcmp(f, "--constant-lr")) return o->cosine = 0, 1;
    return 0;
}

static void parse_value(options *o, const char *f, const char *v) {
    if (!strcmp(f, "--stages")) o->stages = (int)parse_long(f, v, 1, MLP_MAX_LAYERS);
    else if (!strcmp(f, "--pipes")) o->pipes = !strcmp(v, "auto") ? AUTO : (int)parse_long(f, v, 1, 256);
    else if (!strcmp(f, "--micro")) o->micro = !strcmp(v, "auto") ? AUTO : (int)parse_long(f, v, 1, 4096);
    else if (!strcmp(f, "--batch")) o->batch = (int)parse_long(f, v, 1, 1 << 20);
    else if (!strcmp(f, "--epochs")) o->epochs = (int)parse_long(f, v, 1, 100000);
    else if (!strcmp(f, "--rounds")) o->rounds = (int)parse_long(f, v, 1, 100000);
    else if (!strcmp(f, "--chunks")) o->chunks = (int)parse_long(f, v, 1, MLP_MAX_LAYERS);
    else if (!strcmp(f, "--limit-train")) o->limit_train = (int)parse_long(f, v, 1, 1 << 24);
    else if (!strcmp(f, "--replicas")) o->replicas = (int)parse_long(f, v, 1, MAX_REPLICAS);
    else if (!strcmp(f, "--checkpoint-every")) o->checkpoint_every = (int)parse_long(f, v, 1, 1 << 30);
    else if (!strcmp(f, "--stop-after")) o->stop_after = (int)parse_long(f, v, 1, 100000);
    else if (!strcmp(f, "--checkpoint")) o->checkpoint = v;
    else if (!strcmp(f, "--resume")) o->resume = v;
    else if (!strcmp(f, "--backend")) {
        if (!strcmp(v, "mpi")) o->mpi = 1;
        else if (!strcmp(v, "threads")) o->mpi = 0;
        else bad_usage("--backend expects threads or mpi, got '%s'", v);
#ifndef FMNIST_MPI
        if (o->mpi) bad_usage("--backend mpi: this build has no MPI (install libopenmpi-dev and rebuild)");
#endif
    }
    else if (!strcmp(f, "--alpha")) o->alpha = parse_double(f, v, 0, 1);
    else if (!strcmp(f, "--lr")) o->lr = parse_double(f, v, 1e-9, 10);
    else if (!strcmp(f, "--seed")) o->seed = (unsigned long long)parse_long(f, v, 0, 2147483647L);
    else if (!strcmp(f, "--advance")) o->advance = !strcmp(v, "auto") ? ADVANCE_AUTO : (int)parse_long(f, v, 0, 4096);
    else if (!strcmp(f, "--schedule")) {
        if (avgpipe_sched_kind_parse(v, &o->schedule) != AVGPIPE_OK || o->schedule == AVGPIPE_SCHED_CUSTOM)
            bad_usage("--schedule expects afab, 1f1b, advance, interleaved, zbh1, zbv or dualpipev, got '%s'", v);
        o->schedule_set = 1;
    } else if (!strcmp(f, "--mem-limit")) o->mem_limit = parse_size(f, v);
    else if (!strcmp(f, "--profile-tune")) o->profile_tune = v;
    else if (!strcmp(f, "--data")) o->data = v;
    else if (!strcmp(f, "--hidden")) o->hidden = v;
    else if (!strcmp(f, "--trace")) o->trace = v;
    else if (!strcmp(f, "--profile")) o->profile = v;
    else if (!strcmp(f, "--save")) o->save = v;
}

/* Cross-flag checks that need no data. */
static void check_options(options *o, const char *advance_flag) {
    int interleaved = o->schedule == AVGPIPE_SCHED_INTERLEAVED, vplaced = v_placed(o->schedule);
    if (o->micro != AUTO && o->batch % o->micro != 0)
        bad_usage("--batch %d is not a multiple of --micro %d", o->batch, o->micro);
    if (tuning(o) && (interleaved || vplaced))
        bad_usage("--schedule %s needs fixed --micro and --pipes (the tuner profiles one chunk per rank)",
                  avgpipe_sched_kind_name(o->schedule));
    if (tuning(o) && advance_flag && strcmp(advance_flag, "auto") != 0)
        bad_usage("--advance %s needs fixed --micro and --pipes (with --micro or --pipes auto the tuner picks K)",
                  advance_flag);
    if (!tuning(o) && (o->mem_limit > 0 || o->profile_tune))
        bad_usage("%s applies only to the tuner (--micro auto or --pipes auto)",
                  o->mem_limit > 0 ? "--mem-limit" : "--profile-tune");
    if (advance_flag && o->schedule != AVGPIPE_SCHED_ADVANCE && strcmp(advance_flag, "auto") != 0)
        bad_usage("--advance %s applies only to --schedule advance", advance_flag);
    if (o->chunks && !interleaved) bad_usage("--chunks applies only to --schedule interleaved");
    if (o->checkpoint_every && !o->checkpoint) bad_usage("--checkpoint-every needs --checkpoint DIR");
    if (o->stop_after > o->epochs) bad_usage("--stop-after %d is past --epochs %d", o->stop_after, o->epochs);
    if (interleaved && !o->chunks) o->chunks = 2;
    if (!interleaved) o->chunks = vplaced ? 2 : 1;
    if (o->stages % o->chunks != 0)
        bad_usage("--stages %d is not a multiple of %d (%s holds %d stages per rank)", o->stages, o->chunks,
                  avgpipe_sched_kind_name(o->schedule), o->chunks);
    if (o->schedule == AVGPIPE_SCHED_DUALPIPEV && !tuning(o) && o->pipes * o->micro < o->stages)
        bad_usage("--schedule dualpipev needs --pipes x --micro >= 2 x ranks = %d (got %d x %d)", o->stages, o->pipes,
                  o->micro);
}

/* The model flags, checked now for Fashion-MNIST's 784 inputs (the data set's own size is used later). */
static void check_model(const options *o) {
    mlp_model m;
    char err[512];
    if (mlp_model_parse(&m, 784, o->hidden, o->stages, err, sizeof err) != 0) bad_usage("%s", err);
}

/* Output files are created before training, so that a bad path fails now rather than after the run. */
static void check_output(const char *flag, const char *path) {
    FILE *f;
    if (!path) return;
    errno = 0;
    f = fopen(path, "wb");
    if (!f) bad_usage("%s %s: cannot create: %s", flag, path, strerror(errno));
    fclose(f);
}

static int is_value_flag(const char *f) {
    static const char *const names[] = {"--stages", "--pipes", "--micro", "--batch", "--epochs", "--rounds",
                                        "--chunks", "--limit-train", "--alpha", "--lr", "--seed", "--advance",
                                        "--schedule", "--data", "--hidden", "--trace", "--profile", "--save",
                                        "--mem-limit", "--profile-tune", "--replicas", "--backend", "--checkpoint",
                                        "--checkpoint-every", "--resume", "--stop-after"};
    size_t i;
    for (i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(f, names[i])) return 1;
    return 0;
}

static void parse_options(int argc, char **argv, options *o) {
    const char *advance_flag = NULL;
    int i;
    set_defaults(o);
    for (i = 1; i < argc; i++) {
        const char *f = argv[i];
        if (parse_switch(o, f)) continue;
        if (strncmp(f, "--", 2) != 0) bad_usage("unexpected argument '%s' (try --help)", f);
        if (!is_value_flag(f)) bad_usage("unknown option '%s' (try --help)", f);
        if (i + 1 >= argc) bad_usage("missing value after %s", f);
        if (!strcmp(f, "--advance")) advance_flag = argv[i + 1];
        parse_value(o, f, argv[++i]);
    }
    check_options(o, advance_flag);
    check_model(o);
    if (o->mpi) return; /* the process's rank says which files it writes: check_outputs() once it is known */
    check_output("--trace", o->trace);
    check_output("--profile", o->profile);
    check_output("--save", o->save);
    check_output("--profile-tune", o->profile_tune);
}

/* --backend mpi: what rank r writes: FILE for rank 0, FILE.r for the others. */
static const char *rank_path(const app *A, const char *path, char *buf, size_t cap) {
    if (!path || A->me <= 0) return path;
    snprintf(buf, cap, "%s.%d", path, A->me);
    return buf;
}

static void check_outputs(const app *A) {
    char b1[4096], b2[4096];
    check_output("--trace", rank_path(A, A->opt.trace, b1, sizeof b1));
    check_output("--profile", rank_path(A, A->opt.profile, b2, sizeof b2));
    if (A->me == 0) check_output("--save", A->opt.save);
    if (A->me == 0) check_output("--profile-tune", A->opt.profile_tune);
}

/* ---- Stage callbacks -------------------------------------------------------------------------- */

/* The model an op belongs to: replica group's pipeline. */
static int model_of(const app *A, const avgpipe_op_ctx *op) { return op->replica * A->opt.pipes + op->pipe; }

static mlp_stash *op_stash(app *A, const avgpipe_op_ctx *op) {
    if (op->stage < 0 || op->stage >= A->G || op->slot < 0 || op->slot >= A->slots[op->stage] || op->pipe < 0 ||
        op->pipe >= A->opt.pipes || op->replica < 0 || op->replica >= A->opt.replicas || !A->stash[op->replica][op->stage]) {
        fprintf(stderr, "\n" PROG ": op of replica %d, pipeline %d, stage %d, slot %d is outside the model's %d replicas, %d "
                "pipelines, %d stages, %d slots\n", op->replica, op->pipe, op->stage, op->slot, A->opt.replicas, A->opt.pipes,
                A->G, op->stage >= 0 && op->stage < A->G ? A->slots[op->stage] : 0);
        return NULL;
    }
    return &A->stash[op->replica][op->stage][op->slot];
}

static int op_failed(const avgpipe_op_ctx *op, const char *what) {
    fprintf(stderr, "\n" PROG ": %s (pipeline %d, stage %d, round %d, micro-batch %d)\n", what, op->pipe,
            op->stage, op->round, op->micro);
    return 1;
}

/* Stage 0 gathers the micro-batch's pixels, the last stage its labels (both when G = 1). */
static int load_samples(app *A, const avgpipe_op_ctx *op, mlp_stash *st) {
    const uint32_t *idx = mlp_order_micro(&A->order, &A->perm[op->replica][op->stage], model_of(A, op), op->round, op->micro, A->mb);
    if (!idx || mlp_stash_load(st, &A->train, idx, A->mb) != 0) return op_failed(op, "cannot load the samples");
    return 0;
}

static int cb_forward(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    mlp_stash *st = op_stash(A, op);
    int last, correct = 0;
    if (!st) return 1;
    last = op->stage == A->G - 1;
    if ((op->stage == 0 || last) && load_samples(A, op, st) != 0) return 1;
    if (mlp_stage_forward(&A->model, op->stage, op->params, st, (const float *)op->input,
                          last ? NULL : (float *)op->output, A->mb) != 0)
        return op_failed(op, "forward failed");
    if (!last) return 0;
    op->loss = mlp_stage_loss(&A->model, st, &correct);
    if (!isfinite(op->loss)) return op_failed(op, "non-finite loss: lower --lr?");
    A->correct[op->replica] += correct;
    return 0;
}

static int cb_backward(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    mlp_stash *st = op_stash(A, op);
    if (!st || mlp_stage_backward(&A->model, op->stage, op->params, st, (const float *)op->input,
                                  (const float *)op->grad_output, (float *)op->grad_input,
                                  A->nets[model_of(A, op)].grad[op->stage], A->loss_scale) != 0)
        return op_failed(op, "backward failed");
    return 0;
}

static int cb_backward_input(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    mlp_stash *st = op_stash(A, op);
    if (!st || mlp_stage_backward_input(&A->model, op->stage, op->params, st, (const float *)op->grad_output,
                                        (float *)op->grad_input, A->loss_scale) != 0)
        return op_failed(op, "backward to the input (I) failed");
    return 0;
}

static int cb_backward_weight(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    mlp_stash *st = op_stash(A, op);
    if (!st || mlp_stage_backward_weight(&A->model, op->stage, st, (const float *)op->input,
                                         A->nets[model_of(A, op)].grad[op->stage]) != 0)
        return op_failed(op, "backward to the weights (W) failed");
    return 0;
}

/* The rank (within a replica group) that holds stage g: the schedule's placement. */
static int stage_rank(const app *A, int g) {
    return avgpipe_place_rank(v_placed(A->opt.schedule) ? AVGPIPE_PLACE_V : AVGPIPE_PLACE_LOOP, A->S, g);
}

/* Adam on (pipe, stage). The decay follows this model's own step count, so it does not depend on how
   the runtime numbers rounds. */
static int cb_step(int rank, int pipe, int stage, int round, float *params, void *user) {
    app *A = (app *)user;
    int model = rank / A->S * A->opt.pipes + pipe; /* the replica group is rank / S */
    mlp_adam *adam;
    mlp_adam_hp hp;
    (void)round;
    if (pipe < 0 || pipe >= A->opt.pipes || stage < 0 || stage >= A->G || model >= A->opt.pipes * A->opt.replicas) return 1;
    adam = &A->nets[model].adam[stage];
    hp = A->adam;
    hp.lr = mlp_lr_cosine(A->adam.lr, adam->t, A->decay_steps);
    mlp_adam_step(adam, &hp, params, A->nets[model].grad[stage]);
    return 0;
}

/* Checkpoints: what this example owns for a rank is the Adam state (step count, both moments) of the
   rank's stages of each model of its replica group. The sample order needs nothing: it is a function of
   the seed and the round. */
static int cb_save_state(int rank, avgpipe_buf *out, void *user) {
    app *A = (app *)user;
    int i, g, d = rank / A->S;
    for (i = d * A->opt.pipes; i < (d + 1) * A->opt.pipes; i++)
        for (g = 0; g < A->G; g++)
            if (stage_rank(A, g) == rank % A->S) { /* this rank's stages, ascending */
            const mlp_adam *a = &A->nets[i].adam[g];
            int64_t t = a->t;
            if (avgpipe_buf_append(NULL, out, &t, sizeof t) || avgpipe_buf_append(NULL, out, a->m, a->count * sizeof(float)) ||
                avgpipe_buf_append(NULL, out, a->v, a->count * sizeof(float)))
                return fail("checkpoint: out of memory");
        }
    return 0;
}

static int cb_load_state(int rank, const void *data, size_t bytes, void *user) {
    app *A = (app *)user;
    const unsigned char *p = (const unsigned char *)data;
    int i, g, d = rank / A->S;
    for (i = d * A->opt.pipes; i < (d + 1) * A->opt.pipes; i++)
        for (g = 0; g < A->G; g++)
            if (stage_rank(A, g) == rank % A->S) { /* this rank's stages, ascending */
            mlp_adam *a = &A->nets[i].adam[g];
            size_t n = a->count * sizeof(float);
            int64_t t;
            if (bytes < sizeof t + 2 * n) return fail("checkpoint: rank %d's Adam state is too short (other --hidden?)", rank);
            memcpy(&t, p, sizeof t);
            memcpy(a->m, p + sizeof t, n);
            memcpy(a->v, p + sizeof t + n, n);
            a->t = (long)t;
            p += sizeof t + 2 * n, bytes -= sizeof t + 2 * n;
        }
    return bytes == 0 ? 0 : fail("checkpoint: rank %d's Adam state is too long (other --hidden or --pipes?)", rank);
}

/* ---- Setup ------------------------------------------------------------------------------------ */

/* Does this process run stage g of replica group d? (Threads, or rank 0 tuning on its own: every stage.) */
static int is_local(const app *A, int d, int g) { return A->me < 0 || A->me == d * A->S + stage_rank(A, g); }

/* With --backend mpi a process reads only what its stages need: stage 0 the pixels, the last stage the
   labels; rank 0 everything (it tunes on its own and evaluates the reference on the test set). */
static int load_data(app *A) {
    char err[512];
    int parts = 0, test = 0, d, G = A->opt.stages;
    for (d = 0; d < A->opt.replicas; d++) {
        if (is_local(A, d, 0)) parts |= MLP_PIXELS;
        if (is_local(A, d, G - 1)) parts |= MLP_LABELS;
    }
    if (A->me <= 0) parts = MLP_PIXELS | MLP_LABELS, test = MLP_PIXELS | MLP_LABELS;
    if (!parts) parts = MLP_LABELS; /* a middle stage: the header gives the sample count the order needs */
    if (mlp_data_load_fashion_parts(A->opt.data, &A->train, parts, &A->test, test, err, sizeof err) != 0) {
        return fail("%s", err);
    }
    if (A->opt.normalize && A->train.x) {
        float mean, std;
        mlp_data_stats(&A->train, &mean, &std);
        mlp_data_normalize(&A->train, mean, std);
        mlp_data_normalize(&A->test, mean, std);
    }
    if (A->opt.limit_train) mlp_data_truncate(&A->train, A->opt.limit_train);
    return 0;
}

/* Rounds per iteration: at most what one epoch holds, so that an epoch is a whole number of iterations.
   The order hands each of the D x N models its own batches. quiet: no note when the rounds are lowered
   (the tuner's profile runs). */
static int setup_order(app *A, int quiet) {
    options *o = &A->opt;
    long per_round = (long)o->replicas * o->pipes * o->batch;
    char err[512];
    int d;
    if (A->train.n / per_round < 1) {
        return fail("%d training samples cannot fill one round of %d x %d pipelines x %d samples", A->train.n, o->replicas,
                    o->pipes, o->batch);
    }
    if (A->train.n / per_round < o->rounds) {
        o->rounds = (int)(A->train.n / per_round);
        if (!quiet && A->me <= 0)
            fprintf(stderr, PROG ": note: --rounds lowered to %d (one epoch holds %d rounds)\n", o->rounds, o->rounds);
    }
    if (mlp_order_init(&A->order, A->train.n, o->batch, o->replicas * o->pipes, o->rounds, o->seed, err, sizeof err) != 0) {
        return fail("%s", err);
    }
    A->decay_steps = o->cosine ? A->order.rounds_per_epoch * o->epochs : 0;
    for (d = 0; d < o->replicas; d++)
        if ((is_local(A, d, 0) && mlp_perm_init(&A->perm[d][0], A->train.n) != 0) ||
            (o->stages > 1 && is_local(A, d, o->stages - 1) && mlp_perm_init(&A->perm[d][o->stages - 1], A->train.n) != 0))
            return fail("out of memory");
    return 0;
}

/* D x N nets, all from the same seed: every parallel model (and so every reference) starts identical.
   Only the local replica groups' nets exist, and only local stages reach the runtime. */
static int setup_model(app *A) {
    options *o = &A->opt;
    char err[512];
    int i, g, n = o->replicas * o->pipes;
    if (mlp_model_parse(&A->model, A->train.dim, o->hidden, o->stages, err, sizeof err) != 0) {
        return fail("%s", err);
    }
    A->G = o->stages;
    A->S = o->stages / o->chunks;
    A->mb = o->batch / o->micro;
    A->loss_scale = 1.0f / (float)o->batch;
    A->adam = mlp_adam_defaults();
    A->adam.lr = (float)o->lr;
    A->nets = (mlp_net *)calloc((size_t)n, sizeof *A->nets);
    A->params = (float **)calloc((size_t)n * (size_t)A->G, sizeof *A->params);
    if (!A->nets || !A->params) return fail("out of memory");
    for (i = 0; i < n; i++) {
        int d = i / o->pipes, mine = 0;
        for (g = 0; g < A->G; g++) mine |= is_local(A, d, g);
        if (!mine) continue;
        if (mlp_net_init(&A->nets[i], &A->model, o->seed) != 0) return fail("out of memory");
        for (g = 0; g < A->G; g++) A->params[i * A->G + g] = is_local(A, d, g) ? A->nets[i].params[g] : NULL;
    }
    for (g = 0; g + 1 < A->G; g++)
        A->act_bytes[g] = (size_t)A->mb * (size_t)mlp_stage_out_width(&A->model, g) * sizeof(float);
    return 0;
}

static avgpipe_run_desc make_run_desc(app *A) {
    const options *o = &A->opt;
    avgpipe_run_desc d;
    memset(&d, 0, sizeof d);
    d.sched.kind = o->schedule;
    d.sched.stages = o->stages / o->chunks;
    d.sched.chunks = o->chunks;
    d.sched.micro = o->micro;
    d.sched.pipes = o->pipes;
    d.sched.rounds = o->rounds;
    d.sched.continuous = o->continuous;
    d.sched.advance = o->advance == ADVANCE_AUTO ? 0 : o->advance;
    d.adaptive = o->schedule == AVGPIPE_SCHED_ADVANCE && o->advance == ADVANCE_AUTO;
    d.cb.forward = cb_forward;
    d.cb.backward = cb_backward;
    d.cb.backward_input = cb_backward_input;
    d.cb.backward_weight = cb_backward_weight;
    d.cb.step = cb_step;
    d.cb.save_state = cb_save_state;
    d.cb.load_state = cb_load_state;
    d.cb.user = A;
    d.act_bytes = A->act_bytes;
    d.params = (float *const *)A->params;
    d.param_count = A->model.count;
    d.alpha = o->alpha == 0.0 ? AVGPIPE_ZERO : (float)o->alpha;
    d.deterministic = o->deterministic;
    d.profile = o->trace || o->profile;
    d.replicas = o->replicas;
    if (A->me >= 0) { /* one rank per process over MPI */
        d.comm = &A->comm;
        d.local_ranks = &A->me;
        d.local_count = 1;
        d.timeout_s = 120;
    }
    return d;
}

/* One stash per slot the runtime reserved on stage g, for each local replica group. The count can grow
   between iterations (the adaptive controller raising K re-plans the slots), so this runs after every
   iteration too, while no callback runs. */
static int grow_stashes(app *A, const avgpipe_run *run, int g) {
    int want = avgpipe_run_slots(run, g), s, d;
    if (want < 1) return fail("the runtime reports %d slots on stage %d", want, g);
    if (want <= A->slots[g]) return 0;
    for (d = 0; d < A->opt.replicas; d++) {
        mlp_stash *grown;
        if (!is_local(A, d, g)) continue;
        grown = (mlp_stash *)realloc(A->stash[d][g], sizeof(mlp_stash) * (size_t)want);
        if (!grown) return fail("out of memory");
        A->stash[d][g] = grown;
        memset(grown + A->slots[g], 0, sizeof(mlp_stash) * (size_t)(want - A->slots[g]));
        for (s = A->slots[g]; s < want; s++)
            if (mlp_stash_init(&grown[s], &A->model, g, A->mb) != 0) return fail("out of memory");
    }
    A->slots[g] = want;
    return 0;
}

static int setup_stashes(app *A, const avgpipe_run *run) {
    int g;
    for (g = 0; g < A->G; g++)
        if (grow_stashes(A, run, g) != 0) return -1;
    return 0;
}

/* Undo setup_order, setup_model and setup_stashes (the data stays): the tuner's profile runs use them on
   throwaway nets, then training sets them up afresh for the chosen shape. */
static void free_model(app *A) {
    int i, g, d;
    for (d = 0; d < MAX_REPLICAS; d++)
        for (g = 0; g < MLP_MAX_LAYERS; g++) {
            for (i = 0; A->stash[d][g] && i < A->slots[g]; i++) mlp_stash_free(&A->stash[d][g][i]);
            free(A->stash[d][g]);
            A->stash[d][g] = NULL;
            mlp_perm_free(&A->perm[d][g]);
        }
    for (g = 0; g < MLP_MAX_LAYERS; g++) A->slots[g] = 0;
    for (i = 0; A->nets && i < A->opt.pipes * A->opt.replicas; i++) mlp_net_free(&A->nets[i]);
    free(A->nets);
    free(A->params);
    A->nets = NULL;
    A->params = NULL;
    memset(A->correct, 0, sizeof A->correct);
}

static void free_app(app *A) {
    free_model(A);
    mlp_data_free(&A->train);
    mlp_data_free(&A->test);
}

/* ---- Training --------------------------------------------------------------------------------- */

typedef struct epoch_stats {
    double seconds, loss, bubble_time; /* bubble_time: sum of bubble * seconds */
    long long micro_batches, samples, correct;
    int advance;
} epoch_stats;

/* The reference model's partitions, one per stage, on the process that evaluates it (threads: this one;
   mpi: rank 0, gathered from the ranks that hold them: collective). -1 if there is none to give. */
static int get_reference(app *A, avgpipe_run *run, avgpipe_context *ctx, const float **ref) {
    int g;
    if (A->me >= 0) {
        if (avgpipe_run_gather_reference(run, A->me == 0 ? A->ref : NULL) != AVGPIPE_OK)
            return fail("gathering the reference model: %s", avgpipe_last_error(ctx));
        for (g = 0; g < A->G; g++) ref[g] = A->ref[g];
        return 0;
    }
    for (g = 0; g < A->G; g++) {
        size_t count = 0;
        ref[g] = avgpipe_run_reference(run, g, &count);
        if (!ref[g] || count != A->model.count[g])
            return fail("the runtime's reference of stage %d has %zu floats, expected %zu", g, count,
                        A->model.count[g]);
    }
    return 0;
}

/* The reference model's test accuracy on the process that prints (-1 on failure; 0 elsewhere). */
static double evaluate_reference(app *A, avgpipe_run *run, avgpipe_context *ctx) {
    const float *ref[MLP_MAX_LAYERS];
    if (get_reference(A, run, ctx, ref) != 0) return -1;
    return A->me <= 0 ? mlp_evaluate(&A->model, ref, &A->test, NULL) : 0;
}

/* A progress bar redrawn in place on a terminal; to a file or a pipe, one line per epoch. */
static void progress(const app *A, int epoch, double frac, const epoch_stats *s, int done) {
    char bar[21];
    int i, filled = (int)(frac * 20 + 0.5), tty = isatty(fileno(stderr));
    if (A->me > 0 || (!tty && !done)) return;
    for (i = 0; i < 20; i++) bar[i] = i < filled ? '#' : '.';
    bar[20] = '\0';
    fprintf(stderr, "%sepoch %d/%d [%s] %3.0f%%  loss %.4f  train acc %.4f  %.0f samples/s  bubble %4.1f%%  K %d%s", tty ? "\r" : "",
            epoch + 1, A->opt.epochs, bar, 100 * frac, s->micro_batches ? s->loss / (double)s->micro_batches : 0.0,
            s->samples ? (double)s->correct / (double)s->samples : 0.0, s->seconds > 0 ? s->samples / s->seconds : 0.0,
            s->seconds > 0 ? 100 * s->bubble_time / s->seconds : 0.0, s->advance, done ? "" : "   ");
    fflush(stderr);
}

/* One iteration's loss, micro-batches, hits and bubble, summed over the processes (mpi: collective). */
static int iteration_stats(app *A, avgpipe_run *run, avgpipe_context *ctx, const avgpipe_run_stats *rs, epoch_stats *s) {
    double v[4];
    int d;
    v[0] = rs->loss * (double)rs->micro_batches, v[1] = (double)rs->micro_batches, v[2] = 0, v[3] = rs->bubble * rs->seconds;
    for (d = 0; d < A->opt.replicas; d++) v[2] += (double)A->correct[d], A->correct[d] = 0;
    if (A->me >= 0 && avgpipe_run_allreduce(run, v, 4) != AVGPIPE_OK) return fail("reducing the statistics: %s", avgpipe_last_error(ctx));
    s->seconds += rs->seconds;
    s->loss += v[0];
    s->micro_batches += (long long)v[1];
    s->correct += (long long)v[2];
    s->bubble_time += A->me >= 0 ? v[3] / A->nproc : v[3];
    s->samples += (long long)A->opt.rounds * A->opt.replicas * A->opt.pipes * A->opt.batch;
    s->advance = rs->advance;
    return 0;
}

/* --checkpoint DIR: save (collective), creating DIR on first use. */
static int checkpoint(app *A, avgpipe_run *run, avgpipe_context *ctx) {
    if (!A->opt.checkpoint) return 0;
    if (mkdir(A->opt.checkpoint, 0777) != 0 && errno != EEXIST) return fail("--checkpoint %s: %s", A->opt.checkpoint, strerror(errno));
    if (avgpipe_run_save(run, A->opt.checkpoint) != AVGPIPE_OK) return fail("--checkpoint %s: %s", A->opt.checkpoint, avgpipe_last_error(ctx));
    return 0;
}

/* The iterations of epoch `epoch` from `first` on (a resumed run starts inside an epoch). */
static int run_epoch(app *A, avgpipe_run *run, avgpipe_context *ctx, int epoch, int64_t first, epoch_stats *s) {
    int64_t iters = A->order.rounds_per_epoch / A->opt.rounds, it;
    memset(s, 0, sizeof *s);
    memset(A->correct, 0, sizeof A->correct);
    for (it = first; it < iters; it++) {
        avgpipe_run_stats rs;
        avgpipe_result r = avgpipe_run_iteration(run, &rs);
        if (r != AVGPIPE_OK) {
            if (A->me >= 0) fprintf(stderr, "\n" PROG " (rank %d): iteration %lld of epoch %d: %s: %s\n", A->me, (long long)it, epoch + 1,
                                    avgpipe_result_string(r), avgpipe_last_error(ctx));
            else fprintf(stderr, "\n" PROG ": iteration %lld of epoch %d: %s: %s\n", (long long)it, epoch + 1, avgpipe_result_string(r),
                         avgpipe_last_error(ctx));
            return -1;
        }
        if (iteration_stats(A, run, ctx, &rs, s) != 0) return -1;
        progress(A, epoch, (double)(it + 1) / (double)iters, s, it + 1 == iters);
        if (setup_stashes(A, run) != 0) return -1;
        if (A->opt.checkpoint_every && avgpipe_run_iterations(run) % A->opt.checkpoint_every == 0 && checkpoint(A, run, ctx) != 0) return -1;
    }
    return 0;
}

static int write_outputs(app *A, avgpipe_run *run, avgpipe_context *ctx) {
    const float *ref[MLP_MAX_LAYERS];
    char err[512], b1[4096], b2[4096];
    const char *trace = rank_path(A, A->opt.trace, b1, sizeof b1), *prof = rank_path(A, A->opt.profile, b2, sizeof b2);
    int rc = 0;
    if (A->opt.save && get_reference(A, run, ctx, ref) != 0) rc = -1;
    else if (A->opt.save && A->me <= 0 && mlp_params_save(A->opt.save, &A->model, ref, err, sizeof err) != 0)
        rc = fail("--save: %s", err);
    if (trace && avgpipe_run_write_trace(run, trace) != AVGPIPE_OK) rc = fail("--trace %s: %s", trace, avgpipe_last_error(ctx));
    if (prof && avgpipe_run_write_profile(run, prof) != AVGPIPE_OK) rc = fail("--profile %s: %s", prof, avgpipe_last_error(ctx));
    return rc;
}

/* Train epochs (from where a resumed run left off) up to --stop-after or --epochs. */
static int train(app *A, avgpipe_run *run, avgpipe_context *ctx) {
    double total_s = 0, acc = -1;
    long long samples = 0;
    int64_t iters = A->order.rounds_per_epoch / A->opt.rounds, done = avgpipe_run_iterations(run);
    int e, first = (int)(done / iters), last = A->opt.stop_after ? A->opt.stop_after : A->opt.epochs;
    if (done && A->me <= 0)
        fprintf(stderr, PROG ": resumed from %s at iteration %lld (epoch %d, iteration %lld of %lld)\n", A->opt.resume, (long long)done,
                first + 1, (long long)(done % iters), (long long)iters);
    for (e = first; e < last; e++) {
        epoch_stats s;
        if (run_epoch(A, run, ctx, e, e == first ? done % iters : 0, &s) != 0) return -1;
        total_s += s.seconds;
        samples += s.samples;
        acc = evaluate_reference(A, run, ctx);
        if (acc < 0) return -1;
        if (A->me <= 0) fprintf(stderr, "  test acc %.4f\n", acc);
    }
    if (A->me <= 0)
        printf("trained %d epochs in %.1f s (%.0f samples/s); reference model test accuracy %.4f\n", last - first, total_s,
               total_s > 0 ? (double)samples / total_s : 0.0, acc);
    if (checkpoint(A, run, ctx) != 0) return -1;
    return write_outputs(A, run, ctx);
}

static void print_header(const app *A) {
    const options *o = &A->opt;
    char desc[256];
    mlp_model_describe(&A->model, desc, sizeof desc);
    printf("BLAS: OpenBLAS, kernel %s, 1 thread per stage\n", openblas_get_corename());
    printf("model %s\n", desc);
    printf("%s, %d ranks x %d chunk%s, %d pipelines, batch %d = %d x %d, %d rounds/iteration (%s), alpha %g, "
           "Adam lr %g%s, %d training samples (%lld rounds/epoch)\n",
           avgpipe_sched_kind_name(o->schedule), o->stages / o->chunks, o->chunks, o->chunks > 1 ? "s" : "",
           o->pipes, o->batch, o->micro, A->mb, o->rounds, o->continuous ? "continuous" : "synchronous", o->alpha,
           o->lr, o->cosine ? " (cosine decay)" : "", A->train.n, (long long)A->order.rounds_per_epoch);
    if (o->replicas > 1)
        printf("%d replica groups, their reference models averaged every round; %s\n", o->replicas,
               A->me >= 0 ? "one rank per MPI process" : "every rank a thread of this process");
    else if (A->me >= 0)
        printf("one rank per MPI process\n");
    fflush(stdout);
}

/* ---- Tuning (--micro auto, --pipes auto) ------------------------------------------------------ */

#define TUNE_WARMUP 1   /* iterations run before the profiled ones (first touches, thread start) */
#define TUNE_PROFILED 3 /* profiled iterations per micro-batch size, each a section of the profile */
#define TUNE_SHOW 5     /* alternatives printed */
/* Search limits and choice (measured on 2 cores, default model, 10 epochs):
   - N <= 4. The example's epoch shows each sample to one pipeline, so each of the N models takes 1/N of
     the optimizer steps: test accuracy 0.900 at N = 1, 0.894 at N = 2, 0.891 at N = 3, 0.889 at N = 4;
     more pipelines cost accuracy that the averaging does not win back in 10 epochs.
   - Micro-batches of at least 16 samples (M <= 8 of the default batch of 128). M does not change the
     arithmetic (gradients are summed over the batch either way), only speed: smaller micro-batches add
     per-op overhead (the fit's constant terms) for bubbles that N > 1 fills anyway, and the search grows
     as N·M (advance tries every K up to (N·M-1)(S-1), each simulated): at >= 1 sample it simulates 8512
     settings in over 10 s, at >= 16 samples 512 in ~0.06 s. The profile covers exactly this range (its two sizes are its ends), so every
     prediction interpolates the fitted line.
   - The choice: the fastest predicted; settings within TUNE_TIE of it are ties (here stage 0 holds 2/3 of
     the work, so the best settings are all stage-0 bound and predicted alike), broken toward fewer
     pipelines (accuracy per epoch), then less memory. The tie is kept narrow on purpose: the simulator
     gives every rank its own core, so with more ranks than cores it over-predicts settings with little
     work in flight (M = 1, N = 2: predicted 2% below the fastest, measured 25-35% below it here). */
#define TUNE_MAX_PIPES 4
#define TUNE_MIN_MICRO_SAMPLES 16
#define TUNE_TIE 0.005

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static double median3(const double *v) {
    double a = v[0], b = v[1], c = v[2];
    return a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
}

/* The micro-batch counts to profile: the ends of the range the search covers, M = 1 (the whole batch) and
   the largest M whose micro-batches keep min_micro samples; only the fixed M when --micro is given (the
   search then predicts that size alone, which one size fits exactly). */
static int profile_sizes(const options *o, int min_micro, int *m) {
    int M, hi = 1;
    if (o->micro != AUTO) return m[0] = o->micro, 1;
    for (M = 1; M <= o->batch; M++)
        if (o->batch % M == 0 && o->batch / M >= min_micro) hi = M;
    m[0] = 1;
    m[1] = hi;
    return hi > 1 ? 2 : 1;
}

/* One profile run: 1 pipeline of `micro` micro-batches, advance forward with K = S-1 (1F1B when S = 1), on
   nets initialised from the seed and freed afterwards. TUNE_PROFILED iterations after TUNE_WARMUP go to
   `path` (the first written when !append, then appended). The samples are the training order's first ones;
   the weights these iterations train are thrown away, so they do not count as training. */
static int profile_run(app *A, avgpipe_context *ctx, int micro, const char *path, int append, double *seconds) {
    options saved = A->opt;
    avgpipe_run *run = NULL;
    avgpipe_run_desc d;
    avgpipe_result r;
    int i, rc = -1, me = A->me;
    A->me = -1; /* rank 0 of an MPI job profiles on its own threads */
    A->opt.replicas = 1;
    A->opt.pipes = 1;
    A->opt.micro = micro;
    A->opt.schedule = AVGPIPE_SCHED_ADVANCE;
    A->opt.chunks = 1;
    A->opt.advance = A->opt.stages - 1;
    if (setup_order(A, 1) != 0 || setup_model(A) != 0) goto out;
    d = make_run_desc(A);
    d.profile = 1;
    d.micro_samples = A->mb;
    r = avgpipe_run_create(ctx, &d, &run);
    if (r != AVGPIPE_OK) {
        fail("tuner: profile run (M = %d): %s: %s", micro, avgpipe_result_string(r), avgpipe_last_error(ctx));
        goto out;
    }
    if (setup_stashes(A, run) != 0) goto out;
    for (i = 0; i < TUNE_WARMUP + TUNE_PROFILED; i++) {
        avgpipe_run_stats st;
        r = avgpipe_run_iteration(run, &st);
        if (r != AVGPIPE_OK) {
            fail("tuner: profile run (M = %d), iteration %d: %s: %s", micro, i + 1, avgpipe_result_string(r),
                 avgpipe_last_error(ctx));
            goto out;
        }
        if (i < TUNE_WARMUP) continue;
        seconds[i - TUNE_WARMUP] = st.seconds;
        r = append || i > TUNE_WARMUP ? avgpipe_run_append_profile(run, path) : avgpipe_run_write_profile(run, path);
        if (r != AVGPIPE_OK) {
            fail("tuner: cannot write the profile: %s: %s", avgpipe_result_string(r), avgpipe_last_error(ctx));
            goto out;
        }
    }
    rc = 0;
out:
    avgpipe_run_destroy(run);
    free_model(A); /* with A->opt still the profile's: it frees that many nets */
    A->opt = saved;
    A->me = me;
    return rc;
}

static void print_cost_model(const avgpipe_cost_model *m) {
    int g, K = AVGPIPE_OP_KIND_COUNT;
    fprintf(stderr, PROG ": tuner: cost model, us = a + b x samples per micro-batch (fitted at %g..%g samples):\n",
            m->samples_lo, m->samples_hi);
    for (g = 0; g < m->nstages; g++) {
        const double *a = &m->a[g * K], *b = &m->b[g * K];
        fprintf(stderr, "  stage %d  F %6.1f + %5.2f s   B %6.1f + %5.2f s   STEP %6.1f\n", g, 1e6 * a[AVGPIPE_OP_F],
                1e6 * b[AVGPIPE_OP_F], 1e6 * a[AVGPIPE_OP_B], 1e6 * b[AVGPIPE_OP_B], 1e6 * a[AVGPIPE_OP_STEP]);
    }
    fprintf(stderr, "  transfer latency %.1f us\n", 1e6 * m->latency);
}

/* The model against the iterations it was fitted to (median of the profiled ones). */
static void print_check(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_profile *p, int section,
                        const double *measured) {
    const avgpipe_profile_section *sec = &p->sections[section];
    double pred = 0, meas = median3(measured);
    if (avgpipe_tune_predict(ctx, m, &sec->shape, sec->samples, &pred) == AVGPIPE_OK && meas > 0)
        fprintf(stderr, "  check M = %d: measured %.1f ms/iteration, predicted %.1f ms (%+.0f%%)\n", sec->shape.micro, 1e3 * meas,
                1e3 * pred, 100 * (pred / meas - 1));
}

static const char *round_mode(int continuous) { return continuous ? "continuous" : "sync"; }

static void print_candidate(const avgpipe_tune_candidate *c, int batch, int chosen) {
    char k[16] = "-";
    if (c->sched.kind == AVGPIPE_SCHED_ADVANCE) snprintf(k, sizeof k, "%d", c->sched.advance);
    fprintf(stderr, "  %2s %-8s %3d %3d %4s %-10s %4d %10.0f %9.2f%s\n", chosen ? "->" : "",
            avgpipe_sched_kind_name(c->sched.kind), c->sched.micro, c->sched.pipes, k, round_mode(c->sched.continuous),
            batch / c->sched.micro, 1.0 / c->time_per_sample, c->peak_bytes / (1024.0 * 1024.0),
            c->fits ? "" : "  over --mem-limit");
}

/* Profile, fit, search; then set A->opt's schedule, micro, pipes, advance and round mode to the choice. The
   order, model and nets are set up afresh afterwards (main), from the seed: training starts from the same
   weights and sample order as a run given the chosen settings on the command line. */
static int tune(app *A, avgpipe_context *ctx) {
    options *o = &A->opt;
    char tmp[512];
    const char *path = o->profile_tune, *dir = getenv("TMPDIR");
    int sizes[2], nsizes, i, ncand = 0, nok = 0, shown = 0, chosen = -1, best = -1, min_micro, rc = -1, have_tmp = 0;
    double t0 = now_s(), t1, meas[2][TUNE_PROFILED];
    avgpipe_profile prof;
    avgpipe_cost_model cm;
    avgpipe_tune_desc td;
    avgpipe_tune_candidate *cand = NULL;
    avgpipe_result r;
    memset(&prof, 0, sizeof prof);
    memset(&cm, 0, sizeof cm);
    if (A->train.n < o->batch)
        return fail("tuner: %d training samples cannot fill one batch of %d samples", A->train.n, o->batch);
    min_micro = TUNE_MIN_MICRO_SAMPLES < o->batch ? TUNE_MIN_MICRO_SAMPLES : o->batch;
    if (o->micro != AUTO && o->batch / o->micro < min_micro) min_micro = o->batch / o->micro;
    if (!path) {
        int fd;
        snprintf(tmp, sizeof tmp, "%s/" PROG "_tune_XXXXXX", dir && *dir ? dir : "/tmp");
        fd = mkstemp(tmp);
        if (fd < 0)
            return fail("tuner: cannot create a temporary profile %s: %s (set TMPDIR, or give --profile-tune FILE)", tmp,
                        strerror(errno));
        close(fd);
        path = tmp;
        have_tmp = 1;
    }

    /* Profile and fit. */
    nsizes = profile_sizes(o, min_micro, sizes);
    for (i = 0; i < nsizes; i++)
        if (profile_run(A, ctx, sizes[i], path, i > 0, meas[i]) != 0) goto done;
    t1 = now_s();
    r = avgpipe_profile_load(ctx, path, &prof);
    if (r == AVGPIPE_OK && prof.nsections != nsizes * TUNE_PROFILED) {
        fail("tuner: the profile %s holds %d sections, %d were written", path, prof.nsections, nsizes * TUNE_PROFILED);
        goto done;
    }
    if (r == AVGPIPE_OK) r = avgpipe_tune_fit(ctx, &prof, &cm);
    if (r != AVGPIPE_OK) {
        fail("tuner: cannot fit a cost model to the profile %s: %s: %s", path, avgpipe_result_string(r),
             avgpipe_last_error(ctx));
        goto done;
    }
    { /* the stage threads share this machine's cores */
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        cm.cores = cores > 0 ? (double)cores : 0;
    }
    fprintf(stderr, PROG ": tuner: profiled 1 pipeline (advance, K = %d, %d rounds/iteration) at M = %d", o->stages - 1,
            prof.sections[0].shape.rounds, sizes[0]);
    if (nsizes > 1) fprintf(stderr, " and M = %d", sizes[1]);
    fprintf(stderr, ", %d iterations each after %d warm-up, in %.2f s (throwaway weights)%s%s\n", TUNE_PROFILED,
            TUNE_WARMUP, t1 - t0, o->profile_tune ? "; profile: " : "", o->profile_tune ? o->profile_tune : "");
    print_cost_model(&cm);
    for (i = 0; i < nsizes; i++) print_check(ctx, &cm, &prof, i * TUNE_PROFILED, meas[i]);

    /* Search: the flags the user fixed (schedule, --sync) narrow it; M and N fixed narrow the list below. */
    memset(&td, 0, sizeof td);
    td.batch = o->batch;
    td.max_pipes = o->pipes != AUTO ? o->pipes
                   : A->train.n / (o->batch * o->replicas) < TUNE_MAX_PIPES ? A->train.n / (o->batch * o->replicas) : TUNE_MAX_PIPES;
    td.rounds = o->rounds;
    td.mem_limit = o->mem_limit;
    td.opt_bytes_per_param = 8; /* Adam: two moments per parameter and model */
    td.min_micro = min_micro;
    td.no_continuous = o->sync_set;
    td.kinds = o->schedule_set ? 1u << o->schedule : 0;
    t1 = now_s();
    r = avgpipe_tune_search(ctx, &cm, &td, &cand, &ncand);
    if (r != AVGPIPE_OK) {
        fail("tuner: search failed: %s: %s", avgpipe_result_string(r), avgpipe_last_error(ctx));
        goto done;
    }
    t1 = now_s() - t1;
    for (i = 0; i < ncand; i++) { /* drop what the user fixed away; the list stays fitting first, fastest first */
        const avgpipe_tune_candidate *c = &cand[i];
        if ((o->micro == AUTO || c->sched.micro == o->micro) && (o->pipes == AUTO || c->sched.pipes == o->pipes))
            cand[nok++] = *c;
    }
    best = nok > 0 && cand[0].fits ? 0 : -1;
    for (i = 0; best >= 0 && i < nok && cand[i].fits; i++) /* see TUNE_TIE */
        if (cand[i].time_per_sample <= cand[best].time_per_sample * (1 + TUNE_TIE) &&
            (chosen < 0 || cand[i].sched.pipes < cand[chosen].sched.pipes ||
             (cand[i].sched.pipes == cand[chosen].sched.pipes && cand[i].peak_bytes < cand[chosen].peak_bytes)))
            chosen = i;
    if (chosen < 0) {
        int small = 0;
        for (i = 1; i < nok; i++)
            if (cand[i].peak_bytes < cand[small].peak_bytes) small = i;
        if (nok == 0) fail("tuner: no setting to choose from (batch %d, micro-batches of >= %d samples)", o->batch, min_micro);
        else fail("tuner: no setting fits --mem-limit %.0f bytes (%.2f MiB) per rank: the smallest, %s with M = %d, N = %d, "
                  "needs %.0f bytes (%.2f MiB); raise the limit or lower --batch or --hidden", o->mem_limit,
                  o->mem_limit / (1024.0 * 1024.0), avgpipe_sched_kind_name(cand[small].sched.kind),
                  cand[small].sched.micro, cand[small].sched.pipes, cand[small].peak_bytes,
                  cand[small].peak_bytes / (1024.0 * 1024.0));
        goto done;
    }
    fprintf(stderr, PROG ": tuner: %d settings simulated in %.2f s (N %s %d, ", ncand, t1, o->pipes == AUTO ? "<=" : "=",
            td.max_pipes);
    if (o->micro == AUTO) fprintf(stderr, "micro-batches >= %d samples", min_micro);
    else fprintf(stderr, "M = %d", o->micro);
    fprintf(stderr, "%s); predicted, fastest first, the best setting of each M and N:\n"
            "     schedule   M   N    K rounds       mb  samples/s  peak MiB\n",
            o->mem_limit > 0 ? ", within --mem-limit" : "");
    for (i = 0; i < nok && (shown < TUNE_SHOW || i <= chosen); i++) {
        int j, dup = 0; /* one line per (M, N): the schedules, K and round modes of one are often tied */
        for (j = 0; j < i && !dup; j++)
            dup = cand[j].sched.micro == cand[i].sched.micro && cand[j].sched.pipes == cand[i].sched.pipes;
        if (i == chosen || (!dup && shown < TUNE_SHOW)) {
            if (i == chosen && shown >= TUNE_SHOW) fprintf(stderr, "     ...\n");
            print_candidate(&cand[i], o->batch, i == chosen);
            shown++;
        }
    }
    o->schedule = cand[chosen].sched.kind;
    o->micro = cand[chosen].sched.micro;
    o->pipes = cand[chosen].sched.pipes;
    o->continuous = cand[chosen].sched.continuous;
    o->advance = o->schedule == AVGPIPE_SCHED_ADVANCE ? cand[chosen].sched.advance : ADVANCE_AUTO;
    o->chunks = 1;
    fprintf(stderr, PROG ": tuner: chose %s, M = %d, N = %d", avgpipe_sched_kind_name(o->schedule), o->micro, o->pipes);
    if (o->schedule == AVGPIPE_SCHED_ADVANCE) fprintf(stderr, ", K = %d", o->advance);
    fprintf(stderr, ", %s rounds: predicted %.0f samples/s, %.2f MiB per rank", round_mode(o->continuous),
            1.0 / cand[chosen].time_per_sample, cand[chosen].peak_bytes / (1024.0 * 1024.0));
    if (chosen != best) fprintf(stderr, " (of the ties within %.1f%%: fewest pipelines, least memory)", 100 * TUNE_TIE);
    fprintf(stderr, "; tuning took %.2f s\n", now_s() - t0);
    rc = 0;
done:
    if (have_tmp) remove(tmp);
    avgpipe_free(ctx, cand);
    avgpipe_cost_model_free(ctx, &cm);
    avgpipe_profile_free(ctx, &prof);
    return rc;
}

#ifdef FMNIST_MPI
/* --backend mpi: join the job (one rank per process) and check that its size fits the flags. */
static int start_mpi(app *A, avgpipe_context *ctx, int *argc, char ***argv) {
    int S = A->opt.stages / A->opt.chunks;
    if (avgpipe_mpi_init(ctx, argc, argv) != AVGPIPE_OK || avgpipe_mpi_create(ctx, NULL, &A->comm) != AVGPIPE_OK)
        return fail("--backend mpi: %s", avgpipe_last_error(ctx));
    A->me = g_rank = avgpipe_mpi_rank(&A->comm);
    A->nproc = A->comm.size;
    if (A->nproc != A->opt.replicas * S)
        return fail("--backend mpi: %d processes, but %d replica group%s x %d ranks (--stages %d / --chunks %d) need %d: "
                    "mpirun -np %d", A->nproc, A->opt.replicas, A->opt.replicas > 1 ? "s" : "", S, A->opt.stages, A->opt.chunks,
                    A->opt.replicas * S, A->opt.replicas * S);
    check_outputs(A);
    return 0;
}

/* Rank 0 tuned alone: everyone trains with its choice (or stops with it). Bounded: rank 0 has 10 minutes. */
static int share_choice(app *A, int rc) {
    options *o = &A->opt;
    int v[8], done = 0;
    MPI_Request req;
    double t0 = MPI_Wtime();
    struct timespec nap = {0, 1000000L};
    v[0] = rc, v[1] = (int)o->schedule, v[2] = o->micro, v[3] = o->pipes, v[4] = o->continuous, v[5] = o->advance, v[6] = o->chunks,
    v[7] = o->rounds;
    if (MPI_Ibcast(v, 8, MPI_INT, 0, MPI_COMM_WORLD, &req) != MPI_SUCCESS) return fail("--backend mpi: MPI_Ibcast failed");
    while (MPI_Test(&req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done && MPI_Wtime() - t0 < 600) nanosleep(&nap, NULL);
    if (!done) return fail("--backend mpi: rank 0 did not finish tuning within 10 minutes");
    if (v[0] != 0) return A->me == 0 ? -1 : fail("rank 0 failed to tune (see its message)");
    o->schedule = (avgpipe_sched_kind)v[1], o->micro = v[2], o->pipes = v[3], o->continuous = v[4], o->advance = v[5], o->chunks = v[6];
    o->rounds = v[7];
    return 0;
}
#endif

int main(int argc, char **argv) {
    static app A; /* zeroed; large */
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_run_desc desc;
    avgpipe_result r;
    int rc = 1, g;
    parse_options(argc, argv, &A.opt);
    openblas_set_num_threads(1); /* the stage threads are the parallelism */
    avgpipe_context_init(&ctx, NULL);
    A.me = -1;
    A.S = A.opt.stages / A.opt.chunks; /* ranks per replica group (is_local needs it before setup_model) */
#ifdef FMNIST_MPI
    if (A.opt.mpi && start_mpi(&A, &ctx, &argc, &argv) != 0) goto done;
#endif
    if (load_data(&A) != 0) goto done;
    if (tuning(&A.opt)) {
        int trc = A.me <= 0 ? tune(&A, &ctx) : 0;
#ifdef FMNIST_MPI
        if (A.me >= 0) trc = share_choice(&A, trc);
#endif
        if (trc != 0) goto done;
    }
    if (setup_order(&A, 0) != 0 || setup_model(&A) != 0) goto done;
    for (g = 0; A.me == 0 && g < A.G; g++) /* rank 0 gathers the reference model here */
        if (!(A.ref[g] = (float *)malloc(A.model.count[g] * sizeof(float)))) {
            fail("out of memory");
            goto done;
        }
    desc = make_run_desc(&A);
    r = avgpipe_run_create(&ctx, &desc, &run);
    if (r != AVGPIPE_OK) {
        fail("%s: %s", avgpipe_result_string(r), avgpipe_last_error(&ctx));
        goto done;
    }
    if (A.opt.resume && avgpipe_run_load(run, A.opt.resume) != AVGPIPE_OK) {
        fail("--resume %s: %s", A.opt.resume, avgpipe_last_error(&ctx));
        goto done;
    }
    if (setup_stashes(&A, run) != 0) goto done;
    if (A.me <= 0) print_header(&A);
    rc = train(&A, run, &ctx) == 0 ? 0 : 1;
done:
    avgpipe_run_destroy(run);
    free_app(&A);
    for (g = 0; g < MLP_MAX_LAYERS; g++) free(A.ref[g]);
#ifdef FMNIST_MPI
    if (A.me >= 0 && rc != 0) { /* MPI_Finalize could wait for a process that is gone: leave at once */
        fflush(stdout);
        fflush(stderr);
        _exit(rc);
    }
    if (A.me >= 0) {
        avgpipe_comm_destroy(&A.comm);
        MPI_Finalize();
    }
#endif
    return rc;
}
