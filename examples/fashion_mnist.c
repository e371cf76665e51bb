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
          ./fashion_mnist --bind auto           (built with hwloc: print where each rank's stage thread and
                                                 averaging thread run, and bind them when every stage
                                                 gets cores of its own; report: print only; always: bind
                                                 even on shared cores; none, the default: leave them be)

   Callback mapping (avgpipe_op_ctx -> mlp.h):
     forward   stage 0 gathers the samples of (pipe, round, micro) into its stash (input is NULL there),
               the last stage gathers their labels; mlp_stage_forward(stage, params, stash[stage][slot],
               input, output); the last stage then sets op->loss = mlp_stage_loss (softmax kept for B).
     backward  mlp_stage_backward(..., input, grad_output, grad_input, grad[pipe][stage], 1 / batch)
     I / W     mlp_stage_backward_input / mlp_stage_backward_weight (B is exactly I then W)
     step      Adam on (pipe, stage) with cosine learning-rate decay; zeroes the accumulated gradient. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* glibc: syscall(SYS_gettid), for a stage thread's own priority (lower_priority) */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#ifdef FMNIST_MPI
#include "avgpipe_mpi.h"
#endif
#ifdef FMNIST_HWLOC
#include "avgpipe_hwloc.h"
#endif
#define MLP_IMPLEMENTATION
#include "examples/mlp.h"
#define BLAS_KERNEL_IMPLEMENTATION
#include "examples/blas_kernel.h"
#define PROG "fashion_mnist"
#include "examples/mlp_app.h" /* options, parse_options, fail, bad_usage (shared with cuda_mlp.cu) */

#include <errno.h>
#include <sys/stat.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/resource.h>
#include <sys/syscall.h>
#endif

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
    /* The tuner's per-layer profile (layer_samples): while lprof is set, each forward and backward puts
       its layers' times (mlp_layer_times, one per stage, written by the stage's own thread) into
       lsamp[lsize][layer][0 forward, 1 backward]; each layer belongs to one stage, so to one thread. */
    int lprof, lsize;
    int nice_base, nice_done[MAX_REPLICAS * MLP_MAX_LAYERS]; /* --priorities: the process's nice; per rank, set yet */
    int have_work;                        /* tune_split filled stage_work: seconds per sample of each stage partition */
    double stage_work[MLP_MAX_LAYERS], work_cores;
    mlp_layer_times ltimes[MLP_MAX_LAYERS];
    double *lsamp[2][MLP_MAX_LAYERS][2];
    int nlsamp[2][MLP_MAX_LAYERS][2];
} app;

#define LSAMP_CAP 2048 /* per-layer samples kept per (size, layer, kind): a profile run has a few hundred */

static blas_kernel_status g_blas; /* the OpenBLAS kernel this process runs, and why (blas_kernel.h) */

/* ---- Options ---------------------------------------------------------------------------------- */

static const char usage[] =
    "usage: " PROG " [options]\n"
    "  --stages G          stage partitions of the model (default 4)\n"
    "  --split auto|LIST   layers per stage partition, e.g. 1,1,2 (default auto: the tuner's partitioner)\n"
    "  --backend B         threads (default: every rank a thread of this process) | mpi (one rank per\n"
    "                      process: mpirun -np <replicas x ranks> " PROG " --backend mpi ...)\n"
    MLP_APP_USAGE_FLAGS("mpi")
    "  --target-acc A      stop once the reference model's test accuracy reaches A; say when (epochs, s)\n"
    "  --priorities on|off with more stage threads than cores, the lighter stages' threads run at a lower\n"
    "                      priority, so the busiest stage keeps a core (default on; threads, tuner)\n"
    "  --evals-per-epoch E with --target-acc: test evaluations per epoch (default 2)\n"
    "  --no-normalize      keep pixels in [0, 1] (default: standardise with the training set's mean/std)\n"
    "  --bind MODE         none|report|auto|always: hwloc thread placement\n"
    ;
static const char usage_tuning[] =
    "Tuning (when --micro or --pipes is auto, the default): before training, the model is profiled for\n"
    "a few iterations of 1 pipeline at two micro-batch sizes on throwaway copies of the initial weights\n"
    "(training then starts from the same weights and sample order as without tuning), a cost model is\n"
    "fitted, and every setting (schedule, M, N <= 4, K, round mode) is simulated; what the command line\n"
    "fixes (--micro, --pipes, --schedule, --sync) stays fixed. With N auto, a plain-loop probe trains\n"
    "half an epoch on throwaway weights and measures the gradient noise scale B_noise: N pipelines take\n"
    "1 + N x batch / B_noise times the epochs of a small batch (Adam's preconditioned noise). Without\n"
    "--batch it also tries 2x and 4x the batch (N x batch at most 4x the batch). The setting predicted to\n"
    "reach a target loss soonest (samples/s x that; --objective throughput: the most samples/s) within\n"
    "--mem-limit is trained (near-ties, within 0.5%: fewer pipelines, then less memory). The fit, the\n"
    "choice and the best alternatives (one per batch, M and N) go to stderr. --split auto: the profile\n"
    "times every layer and the partitioner picks the split with the setting (also with M and N fixed).\n";

/* Contiguous splits of the model's layers into its stage partitions: C(L-1, G-1). */
static double split_count(const options *o) {
    mlp_model m;
    double c = 1;
    int i, n, k;
    if (mlp_model_parse(&m, 784, o->hidden, o->stages, NULL, 0) != 0) return 1;
    n = m.layers - 1, k = o->stages - 1;
    for (i = 1; i <= k; i++) c = c * (n - k + i) / i;
    return c;
}

/* --split auto with a choice to make: profile the layers and let the partitioner split them (the tuner's
   profile runs do it; with --micro and --pipes fixed they run for the split alone). Not for the schedules
   with several stages per rank (interleaved, zbv, dualpipev): the profile runs hold one per rank. */
static int planning(const options *o) {
    return o->nsplit == 0 && o->schedule != AVGPIPE_SCHED_INTERLEAVED && !v_placed(o->schedule) && split_count(o) > 1;
}

static const char *const own_flags[] = {"--split", "--bind", "--target-acc", "--evals-per-epoch", "--priorities", NULL};

static void own_defaults(options *o) { o->priorities = 1; }

/* This program's flags with a value (the shared ones: mlp_app.h). */
static void own_value(options *o, const char *f, const char *v) {
    if (!strcmp(f, "--target-acc")) o->target_acc = parse_double(f, v, 1e-9, 1);
    else if (!strcmp(f, "--priorities")) {
        if (strcmp(v, "on") && strcmp(v, "off")) bad_usage("--priorities expects on or off, got '%s'", v);
        o->priorities = !strcmp(v, "on");
    } else if (!strcmp(f, "--evals-per-epoch")) o->evals_per_epoch = (int)parse_long(f, v, 1, 1000);
    else if (!strcmp(f, "--split")) {
        char err[256];
        if (!strcmp(v, "auto")) o->nsplit = 0;
        else if (mlp_split_parse(v, o->split, MLP_MAX_LAYERS, &o->nsplit, err, sizeof err) != 0) bad_usage("--split: %s", err);
        o->split_given = o->nsplit > 0;
    } else if (!strcmp(f, "--bind")) {
        if (strcmp(v, "none") && strcmp(v, "report") && strcmp(v, "auto") && strcmp(v, "always"))
            bad_usage("--bind expects none, report, auto or always, got '%s'", v);
#ifndef FMNIST_HWLOC
        if (strcmp(v, "none")) bad_usage("--bind %s: this build has no hwloc (install libhwloc-dev and rebuild)", v);
#endif
        o->bind = v;
    }
}

/* This program's cross-flag checks, after the shared ones and the model's. */
static void own_check(options *o) {
    mlp_model m;
    char err[512];
    if (o->evals_per_epoch && !(o->target_acc > 0)) bad_usage("--evals-per-epoch applies only with --target-acc");
    if (!o->evals_per_epoch) o->evals_per_epoch = 2;
    mlp_model_parse(&m, 784, o->hidden, o->stages, NULL, 0); /* checked by parse_options */
    if (o->nsplit && o->nsplit != o->stages)
        bad_usage("--split: %d stage partitions listed, --stages is %d", o->nsplit, o->stages);
    if (o->nsplit && mlp_model_regroup(&m, o->stages, o->split, err, sizeof err) != 0) bad_usage("--split: %s", err);
}

/* The tuner's profile runs happen when it tunes M or N, or when the partitioner has a split to choose. */
static int profiles(const options *o) { return tuning(o) || planning(o); }

static const mlp_cli_program program = {
    usage, usage_tuning, "mpi",
#ifdef FMNIST_MPI
    NULL,
#else
    "this build has no MPI (install libopenmpi-dev and rebuild)",
#endif
    own_flags, own_defaults, own_value, own_check, profiles,
    "the tuner (--micro auto or --pipes auto, or --split auto with a split to choose)"};

/* A generic OpenBLAS kernel on a CPU that can run a better one: restart with it (blas_kernel.h), before
   anything a restart would repeat (the data, the tuner, MPI). The check uses the model's layer shapes at
   its micro-batch size (32 rows when the tuner picks it). Returns 0 (a message on stderr when the better
   kernel failed its check and the generic one stays). */
static int ensure_blas_kernel(const options *o, char **argv) {
    blas_kernel_shape shapes[MLP_MAX_LAYERS];
    mlp_model m;
    int l, rows = o->micro != AUTO ? o->batch / o->micro : (o->batch < 32 ? o->batch : 32);
    if (mlp_model_parse(&m, 784, o->hidden, o->stages, NULL, 0) != 0) return 0; /* checked by parse_options */
    for (l = 0; l < m.layers; l++) shapes[l].m = rows, shapes[l].n = m.width[l + 1], shapes[l].k = m.width[l];
    blas_kernel_ensure(argv, shapes, m.layers, PROG, &g_blas);
    return 0;
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

/* The tuner's profile runs: the op's time split over the stage's layers (mlp_layer_times). What the
   layers' own clocks do not cover (gathering the samples on stage 0, the loss on the last stage, copies)
   goes to the stage's first layer on stage 0's forward, else to its last layer, so that the layers of a
   stage add up to its op. */
static void record_layers(app *A, int stage, int kind, double total, const mlp_stash *st) {
    int first = A->model.first[stage], n = A->model.first[stage + 1] - first, k, *cnt;
    double x[MLP_MAX_LAYERS], sum = 0;
    if (!st->times) return;
    for (k = 0; k < n; k++) sum += x[k] = kind ? st->times->backward[k] : st->times->forward[k];
    if (total > sum) x[stage == 0 && kind == 0 ? 0 : n - 1] += total - sum;
    for (k = 0; k < n; k++) {
        cnt = &A->nlsamp[A->lsize][first + k][kind];
        if (A->lsamp[A->lsize][first + k][kind] && *cnt < LSAMP_CAP) A->lsamp[A->lsize][first + k][kind][(*cnt)++] = x[k];
    }
}

/* --priorities: on its first op, a lighter stage's thread lowers its own priority (Linux: nice is per
   thread), so that when the stage threads outnumber the cores the scheduler gives the busiest stage, which
   bounds the speed, its core instead of time-slicing it evenly with the others (tune_split decides). */
static void lower_priority(app *A, const avgpipe_op_ctx *op) {
    int inc = A->opt.stage_nice[op->rank % A->S];
    A->nice_done[op->rank] = 1;
#ifdef __linux__
    if (inc && setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), A->nice_base + inc) != 0)
        fprintf(stderr, PROG ": note: stage %d's thread keeps its priority: %s\n", op->stage, strerror(errno));
#else
    (void)inc;
#endif
}

static int cb_forward(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    mlp_stash *st = op_stash(A, op);
    int last, correct = 0;
    double t0 = A->lprof ? now_s() : 0;
    if (!st) return 1;
    if (!A->nice_done[op->rank]) lower_priority(A, op);
    last = op->stage == A->G - 1;
    if ((op->stage == 0 || last) && load_samples(A, op, st) != 0) return 1;
    if (mlp_stage_forward(&A->model, op->stage, op->params, st, (const float *)op->input,
                          last ? NULL : (float *)op->output, A->mb) != 0)
        return op_failed(op, "forward failed");
    if (last) {
        op->loss = mlp_stage_loss(&A->model, st, &correct);
        if (!isfinite(op->loss)) return op_failed(op, "non-finite loss: lower --lr?");
        A->correct[op->replica] += correct;
    }
    if (A->lprof) record_layers(A, op->stage, 0, now_s() - t0, st);
    return 0;
}

static int cb_backward(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    mlp_stash *st = op_stash(A, op);
    double t0 = A->lprof ? now_s() : 0;
    if (!st || mlp_stage_backward(&A->model, op->stage, op->params, st, (const float *)op->input,
                                  (const float *)op->grad_output, (float *)op->grad_input,
                                  A->nets[model_of(A, op)].grad[op->stage], A->loss_scale) != 0)
        return op_failed(op, "backward failed");
    if (A->lprof) record_layers(A, op->stage, 1, now_s() - t0, st);
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
    if (mlp_model_parse(&A->model, A->train.dim, o->hidden, o->stages, err, sizeof err) != 0 ||
        (o->nsplit && mlp_model_regroup(&A->model, o->stages, o->split, err, sizeof err) != 0)) {
        return fail("%s", err);
    }
    A->G = o->stages;
    A->S = o->stages / o->chunks;
    memset(A->nice_done, 0, sizeof A->nice_done); /* a new run: new stage threads */
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

#ifdef FMNIST_HWLOC
/* --bind: where this machine's ranks run (avgpipe_hwloc.h): every rank with threads, the ranks of the
   processes on this machine with MPI (each process plans them all, the same way, and binds its own). The
   plan is printed on stderr (with MPI by the first process of each machine); the runtime's threads are
   bound through run_desc.bind_thread, the profile runs' too. */
static struct {
    avgpipe_hwloc_topo *topo;
    avgpipe_hwloc_placement *plan;
} g_place;

static int setup_placement(const app *A, avgpipe_context *ctx) {
    const char *b = A->opt.bind;
    int show = A->me <= 0;
#ifdef FMNIST_MPI
    int ranks[MAX_REPLICAS * MLP_MAX_LAYERS];
#endif
    avgpipe_hwloc_placement_desc pd;
    avgpipe_buf rep = {0};
    if (!b || !strcmp(b, "none")) return 0;
    memset(&pd, 0, sizeof pd);
    pd.bind = !strcmp(b, "report") ? AVGPIPE_HWLOC_BIND_NONE : !strcmp(b, "always") ? AVGPIPE_HWLOC_BIND_ALWAYS : AVGPIPE_HWLOC_BIND_AUTO;
    pd.count = A->opt.replicas * A->S;
#ifdef FMNIST_MPI
    if (A->me >= 0) { /* the processes on this machine, by shared memory */
        MPI_Comm node;
        int me;
        if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) != MPI_SUCCESS)
            return fail("--bind: MPI_Comm_split_type failed");
        MPI_Comm_size(node, &pd.count);
        MPI_Comm_rank(node, &me);
        if (pd.count > (int)(sizeof ranks / sizeof ranks[0]) || MPI_Allgather((void *)&A->me, 1, MPI_INT, ranks, 1, MPI_INT, node) != MPI_SUCCESS)
            return fail("--bind: cannot gather the ranks of this machine");
        MPI_Comm_free(&node);
        pd.ranks = ranks;
        show = me == 0;
    }
#endif
    if (avgpipe_hwloc_topo_load(ctx, NULL, &g_place.topo) != AVGPIPE_OK ||
        avgpipe_hwloc_placement_create(ctx, g_place.topo, &pd, &g_place.plan) != AVGPIPE_OK)
        return fail("--bind %s: %s", b, avgpipe_last_error(ctx));
    if (show && avgpipe_hwloc_placement_report(ctx, g_place.plan, &rep) == AVGPIPE_OK) fputs(rep.data, stderr);
    avgpipe_buf_free(ctx, &rep);
    return 0;
}

static void free_placement(void) {
    avgpipe_hwloc_placement_free(g_place.plan);
    avgpipe_hwloc_topo_free(g_place.topo);
}
#endif

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
    d.averaging.alpha = o->alpha == 0.0 ? AVGPIPE_ZERO : (float)o->alpha;
    d.deterministic = o->deterministic;
    d.profile = o->trace || o->profile;
    d.replicas = o->replicas;
#ifdef FMNIST_HWLOC
    if (g_place.plan) d.bind_thread = avgpipe_hwloc_bind_thread, d.bind_user = g_place.plan;
#endif
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

/* The iterations of epoch `epoch` from `first` on (a resumed run starts inside an epoch). */
/* --target-acc: after iteration `it` of the epoch, when it ends one of the epoch's evaluation points, the
   reference's test accuracy (collective with mpi: every process gets rank 0's); 1 once it reaches the
   target (*acc gets it), 0 when not (yet), -1 on a failure. */
static int target_check(app *A, avgpipe_run *run, avgpipe_context *ctx, int epoch, int64_t it, int64_t iters, double *acc) {
    int E = A->opt.evals_per_epoch, j, point = 0;
    double v[1];
    for (j = 1; j <= E && !point; j++) point = it + 1 == (iters * j + E - 1) / E;
    if (!(A->opt.target_acc > 0) || !point) return 0;
    v[0] = evaluate_reference(A, run, ctx);
    if (v[0] < 0) return -1;
    if (A->me >= 0 && avgpipe_run_allreduce(run, v, 1) != AVGPIPE_OK) return fail("sharing the test accuracy: %s", avgpipe_last_error(ctx));
    *acc = v[0];
    if (A->me <= 0 && it + 1 < iters) /* (the epoch's own line ends with its last evaluation) */
        fprintf(stderr, "%s  test acc %.4f at epoch %.2f\n", isatty(fileno(stderr)) ? "\n" : "", *acc, epoch + (double)(it + 1) / (double)iters);
    return *acc >= A->opt.target_acc;
}

static int run_epoch(app *A, avgpipe_run *run, avgpipe_context *ctx, int epoch, int64_t first, epoch_stats *s, double *reached) {
    int64_t iters = A->order.rounds_per_epoch / A->opt.rounds, it;
    memset(s, 0, sizeof *s);
    s->acc = -1;
    memset(A->correct, 0, sizeof A->correct);
    for (it = first; it < iters; it++) {
        avgpipe_run_stats rs;
        avgpipe_result r = avgpipe_run_iteration(run, &rs);
        if (r != AVGPIPE_OK) return iteration_failed(A->me, it, epoch, r, ctx);
        if (iteration_stats(A, run, ctx, &rs, s) != 0) return -1;
        progress(&A->opt, A->me, epoch, (double)(it + 1) / (double)iters, s, it + 1 == iters);
        if (setup_stashes(A, run) != 0) return -1;
        if (A->opt.checkpoint_every && avgpipe_run_iterations(run) % A->opt.checkpoint_every == 0 && checkpoint(&A->opt, run, ctx) != 0) return -1;
        switch (target_check(A, run, ctx, epoch, it, iters, &s->acc)) {
        case 1:
            *reached = epoch + (double)(it + 1) / (double)iters;
            return 0;
        case -1: return -1;
        default: break;
        }
    }
    return 0;
}

static int write_outputs(app *A, avgpipe_run *run, avgpipe_context *ctx) {
    const float *ref[MLP_MAX_LAYERS];
    char err[512], b1[4096], b2[4096];
    const char *trace = rank_path(A->me, A->opt.trace, b1, sizeof b1), *prof = rank_path(A->me, A->opt.profile, b2, sizeof b2);
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
    double total_s = 0, acc = -1, reached = -1, wall0 = now_s();
    long long samples = 0;
    int64_t iters = A->order.rounds_per_epoch / A->opt.rounds, done = avgpipe_run_iterations(run);
    int e, first = (int)(done / iters), last = A->opt.stop_after ? A->opt.stop_after : A->opt.epochs;
    if (done && A->me <= 0)
        fprintf(stderr, PROG ": resumed from %s at iteration %lld (epoch %d, iteration %lld of %lld)\n", A->opt.resume, (long long)done,
                first + 1, (long long)(done % iters), (long long)iters);
    for (e = first; e < last && reached < 0; e++) {
        epoch_stats s;
        s.acc = -1;
        if (run_epoch(A, run, ctx, e, e == first ? done % iters : 0, &s, &reached) != 0) return -1;
        total_s += s.seconds;
        samples += s.samples;
        acc = s.acc >= 0 ? s.acc : evaluate_reference(A, run, ctx); /* the target's check evaluated it already */
        if (acc < 0) return -1;
        if (A->me <= 0 && (reached < 0 || reached >= e + 1)) fprintf(stderr, "  test acc %.4f\n", acc); /* (else said mid-epoch) */
    }
    if (A->me <= 0 && A->opt.target_acc > 0) {
        if (reached >= 0)
            printf("reached test accuracy %.4f >= %g after %.2f epochs: %.1f s training, %.1f s wall (with the evaluations)\n", acc,
                   A->opt.target_acc, reached - first, total_s, now_s() - wall0);
        else
            printf("did not reach test accuracy %g in %d epochs (%.1f s training, %.1f s wall): %.4f\n", A->opt.target_acc, last - first,
                   total_s, now_s() - wall0, acc);
    }
    if (A->me <= 0)
        printf("trained %d epochs in %.1f s (%.0f samples/s); reference model test accuracy %.4f\n", e - first, total_s,
               total_s > 0 ? (double)samples / total_s : 0.0, acc);
    if (checkpoint(&A->opt, run, ctx) != 0) return -1;
    return write_outputs(A, run, ctx);
}

static void print_header(const app *A) {
    const options *o = &A->opt;
    char desc[256];
    int g;
    mlp_model_describe(&A->model, desc, sizeof desc);
    if (A->me >= 0) printf("BLAS: %s, 1 thread per stage\n", g_blas.line); /* mpi: rank 0's; threads: printed first thing */
    printf("model %s; split ", desc);
    for (g = 0; g < A->G; g++) printf("%s%d", g ? "," : "", A->model.first[g + 1] - A->model.first[g]);
    printf(" (%s)\n", o->split_planned ? "the tuner's partitioner" : o->split_given ? "--split" : split_count(o) > 1 ? "by multiply-adds" : "the only one");
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

/* The tuner's search limits and choice (TUNE_* and tune_choose in mlp_app.h; measured on 2 cores,
   default model, 10 epochs):
   - N <= 4. The example's epoch shows each sample to one pipeline, so each of the N models takes 1/N of
     the optimizer steps: test accuracy 0.900 at N = 1, 0.894 at N = 2, 0.891 at N = 3, 0.889 at N = 4;
     more pipelines cost accuracy that the averaging does not win back in 10 epochs.
   - Micro-batches of at least 16 samples (M <= 8 of the default batch of 128). M does not change the
     arithmetic (gradients are summed over the batch either way), only speed: smaller micro-batches add
     per-op overhead (the fit's constant terms) for bubbles that N > 1 fills anyway, and the search grows
     as N·M (advance tries every K up to (N·M-1)(S-1), each simulated): at >= 1 sample it simulates 8512
     settings in over 10 s, at >= 16 samples 512 in ~0.06 s. The profile covers exactly this range (its two sizes are its ends), so every
     prediction interpolates the fitted line.
   - The choice: the least predicted time to target, samples/s x the progress per sample that the
     gradient noise scale gives each N (tune_noise_probe: N pipelines of batch B take 1 + N B / B_noise
     times the epochs of a small batch; --objective throughput: the fastest predicted). Settings within
     TUNE_TIE of it are ties (here stage 0 holds 2/3 of the work, so the best settings of one N are all
     stage-0 bound and predicted alike), broken toward fewer pipelines, then less memory. The tie is kept
     narrow on purpose: with more ranks than cores one figure (the fitted busy_cores) bounds every setting,
     while the machine gives some schedules more of its cores than others (bench_tune_regret --stages 4:
     within 7% for the profiled advance, 18-24% optimistic for 1F1B and AFAB at N = 2). */

/* One profile run: `pipes` pipelines of `micro` micro-batches, advance forward with K = S-1 (1F1B when
   S = 1), on nets initialised from the seed and freed afterwards. TUNE_PROFILED iterations after
   TUNE_WARMUP go to `path` (the first written when !append, then appended). The samples are the training
   order's first ones; the weights these iterations train are thrown away, so they do not count as
   training. size >= 0: every layer's times go to the layer samples of that size (A->lsamp[size]). */
static int profile_run(app *A, avgpipe_context *ctx, int micro, int pipes, int size, const char *path, int append, double *seconds) {
    options saved = A->opt;
    avgpipe_run *run = NULL;
    avgpipe_run_desc d;
    avgpipe_result r;
    int i, rc = -1, me = A->me;
    A->me = -1; /* rank 0 of an MPI job profiles on its own threads */
    A->opt.replicas = 1;
    A->opt.pipes = pipes;
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
    for (i = 0; i < A->G && size >= 0; i++) { /* time every layer of every op (record_layers) */
        int q;
        for (q = 0; q < A->slots[i]; q++) A->stash[0][i][q].times = &A->ltimes[i];
    }
    A->lsize = size;
    for (i = 0; i < TUNE_WARMUP + TUNE_PROFILED; i++) {
        avgpipe_run_stats st;
        A->lprof = size >= 0 && i >= TUNE_WARMUP; /* between iterations: the callbacks see it (avgpipe_run_iteration) */
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
    A->lprof = 0;
    avgpipe_run_destroy(run);
    free_model(A); /* with A->opt still the profile's: it frees that many nets */
    A->opt = saved;
    A->me = me;
    return rc;
}

static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

/* Layer l's forward (k = 0) or backward (k = 1) time as a + b x samples: through the medians at the
   profiled micro-batch sizes; proportional (least squares through 0) with one size, or when the line
   would go negative (noise on a tiny layer). */
static void layer_line(app *A, int l, int k, const int *sizes, int nsizes, double *a, double *b) {
    double x[2], y[2], sxy = 0, sxx = 0;
    int i, n = 0;
    for (i = 0; i < nsizes; i++) {
        int c = A->nlsamp[i][l][k];
        if (c < 1) continue;
        qsort(A->lsamp[i][l][k], (size_t)c, sizeof(double), cmp_double);
        x[n] = (double)A->opt.batch / sizes[i];
        y[n++] = c % 2 ? A->lsamp[i][l][k][c / 2] : (A->lsamp[i][l][k][c / 2 - 1] + A->lsamp[i][l][k][c / 2]) / 2;
    }
    *a = *b = 0;
    if (n == 2 && x[0] != x[1]) {
        *b = (y[1] - y[0]) / (x[1] - x[0]);
        *a = y[0] - *b * x[0];
        if (*a >= 0 && *b >= 0) return;
    }
    for (i = 0; i < n; i++) sxy += x[i] * y[i], sxx += x[i] * x[i];
    *a = 0;
    *b = sxx > 0 ? sxy / sxx : 0;
}

/* What the stage partitioner reads (avgpipe.h, section 20), appended to the tuner's profile: a 'layer' line
   per layer (its forward and backward as a + b x samples from the profile runs' per-layer times, its
   parameters, its output bytes per sample, the stage that held it) and an 'averaging' line per stage
   (one contribution of its parameters, timed). */
static int append_layer_costs(app *A, avgpipe_context *ctx, const char *path, const int *sizes, int nsizes) {
    FILE *f = fopen(path, "a");
    int l, g = 0, bad = 0;
    if (!f) return fail("tuner: cannot append to the profile %s: %s", path, strerror(errno));
    for (l = 0; l < A->model.layers; l++) {
        double fa, fb, ba, bb;
        while (l >= A->model.first[g + 1]) g++;
        layer_line(A, l, 0, sizes, nsizes, &fa, &fb);
        layer_line(A, l, 1, sizes, nsizes, &ba, &bb);
        fprintf(f, "layer %d stage=%d f_a=%.9g f_b=%.9g b_a=%.9g b_b=%.9g param_floats=%zu act_bytes=%zu\n", l, g, fa, fb, ba, bb,
                (size_t)A->model.width[l] * (size_t)A->model.width[l + 1] + (size_t)A->model.width[l + 1],
                (size_t)A->model.width[l + 1] * sizeof(float));
    }
    for (g = 0; g < A->model.stages && !bad; g++) {
        double t;
        if (avgpipe_tune_measure_averaging(ctx, A->model.count[g], &t) != AVGPIPE_OK) bad = 1;
        else fprintf(f, "averaging floats=%zu seconds=%.9g\n", A->model.count[g], t);
    }
    if (ferror(f)) bad = 1;
    if (fclose(f) != 0) bad = 1;
    return bad ? fail("tuner: cannot append the layer costs to %s: %s", path, avgpipe_last_error(ctx)) : 0;
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
    fprintf(stderr, "  transfer latency %.1f us, runtime overhead %.1f us per op and %.1f us per iteration, averaging %.2f ns per "
            "parameter, STEP %.1f us + %.2f ns per parameter\n", 1e6 * m->latency, 1e6 * m->op_overhead, 1e6 * m->iter_overhead,
            1e9 * m->avg_per_float, 1e6 * m->step_a, 1e9 * m->step_b);
    if (m->cores > 0 && m->busy_cores > 0)
        fprintf(stderr, "  %g cores; the profile's stage threads got through %.2f cores' worth of work at most (busy_cores)%s\n", m->cores,
                m->busy_cores, m->busy_cores < m->cores && m->nstages > m->cores ? ": the bound with more ranks than cores" : "");
}

/* The M and N the user fixed, for the partitioner (avgpipe_tune_split_desc.keep). */
static int keep_fixed(const avgpipe_tune_candidate *c, void *user) {
    const options *o = (const options *)user;
    return (o->micro == AUTO || c->sched.micro == o->micro) && (o->pipes == AUTO || c->sched.pipes == o->pipes);
}

/* "784-512 | 512-256-128-10" for a split of the model's layers. */
static void describe_split(const mlp_model *m, const int *split, int n, char *buf, size_t cap) {
    size_t len = 0;
    int g, l = 0, k;
    buf[0] = '\0';
    for (g = 0; g < n && len < cap; g++) {
        len += (size_t)snprintf(buf + len, cap - len, "%s%d", g ? " | " : "", m->width[l]);
        for (k = 0; k < split[g] && len < cap; k++, l++) len += (size_t)snprintf(buf + len, cap - len, "-%d", m->width[l + 1]);
    }
}

/* --priorities: with more stage threads than cores (threads backend, one group), the cores - 1 busiest ranks (the
   work per sample of their stage partitions, A->stage_work from tune_split) keep their priority and the others
   get nice +5: the busiest stage bounds the speed, and an even time-slicing of the cores would slow it down
   (measured: the main job's 4 stage threads on 2 cores ran at 0.6 of the bound). Called once the setting is
   chosen (the chunks set the ranks); without the tuner's stage costs nothing changes. */
static void plan_priorities(app *A) {
    options *o = &A->opt;
    double w[MLP_MAX_LAYERS], cores = A->work_cores;
    int g, k, above, lowered = 0, S = o->stages / o->chunks;
    memset(o->stage_nice, 0, sizeof o->stage_nice);
    if (!o->priorities || !A->have_work || o->procs || o->replicas > 1 || !(cores > 0) || S <= cores) return; /* (one group of threads) */
    for (g = 0; g < S; g++) w[g] = 0;
    for (g = 0; g < o->stages; g++) /* the schedule's placement: loop, or V for zbv and dualpipev */
        w[avgpipe_place_rank(v_placed(o->schedule) ? AVGPIPE_PLACE_V : AVGPIPE_PLACE_LOOP, S, g)] += A->stage_work[g];
    for (g = 0; g < S; g++) {
        for (k = 0, above = 0; k < S; k++) above += w[k] > w[g] || (w[k] == w[g] && k < g);
        if (above >= (int)cores - 1) o->stage_nice[g] = 5, lowered++;
    }
    if (!lowered) return;
    fprintf(stderr, PROG ": tuner: %d stage threads on %g cores: rank%s", S, cores, lowered > 1 ? "s" : "");
    for (g = 0, k = 0; g < S; g++)
        if (o->stage_nice[g]) fprintf(stderr, "%s %d", k++ ? "," : "", g);
    fprintf(stderr, " (the lighter) run at nice +5, so that the busiest keep%s a core (--priorities off: all alike)\n",
            (int)cores - 1 > 1 ? "" : "s");
}

/* The split to train with, and its cost model *sm (from the layer costs): the partitioner's choice
   with --split auto when there is one to make (jointly with the setting, M and N as fixed), else the
   split given or the only one. Prints it, with what bounds the model: the slowest stage's share of the
   work, and so the most a schedule can gain over one thread. */
static int tune_split(app *A, avgpipe_context *ctx, const avgpipe_cost_model *cm, const avgpipe_tune_desc *td, avgpipe_cost_model *sm) {
    options *o = &A->opt;
    avgpipe_tune_split_choice plan;
    avgpipe_tune_split_desc pd;
    int split[MLP_MAX_LAYERS], g, l, planned = planning(o);
    double t0 = now_s(), share, x, worst;
    char desc[256];
    avgpipe_result r;
    memset(&plan, 0, sizeof plan);
    memset(&pd, 0, sizeof pd);
    pd.stages = o->stages;
    pd.keep = keep_fixed;
    pd.keep_user = o;
    if (planned && (r = avgpipe_tune_choose_split(ctx, cm, td, &pd, &plan)) != AVGPIPE_OK)
        return fail("tuner: the stage partitioner failed: %s: %s", avgpipe_result_string(r), avgpipe_last_error(ctx));
    for (g = 0; g < o->stages; g++) split[g] = planned ? plan.split[g] : A->model.first[g + 1] - A->model.first[g];
    for (g = 0; g < o->stages; g++) o->split[g] = split[g];
    o->nsplit = o->stages, o->split_planned = planned;
    if ((r = avgpipe_tune_split_model(ctx, cm, split, o->stages, sm)) != AVGPIPE_OK) {
        avgpipe_tune_split_choice_free(ctx, &plan);
        return fail("tuner: %s", avgpipe_last_error(ctx));
    }
    x = planned ? plan.best.samples : (double)o->batch / (o->micro != AUTO ? o->micro : 1);
    share = avgpipe_tune_slowest_share(sm, o->stages, x, o->batch);
    for (g = 0, l = 0, worst = -1; g < o->stages; g++) { /* the busiest stage, for the message */
        const double *ca = &sm->a[g * AVGPIPE_OP_KIND_COUNT], *cb = &sm->b[g * AVGPIPE_OP_KIND_COUNT];
        double w = (ca[AVGPIPE_OP_F] + ca[AVGPIPE_OP_B]) / x + cb[AVGPIPE_OP_F] + cb[AVGPIPE_OP_B] + ca[AVGPIPE_OP_STEP] / o->batch;
        A->stage_work[g] = w;
        if (w > worst) worst = w, l = g;
    }
    A->have_work = 1, A->work_cores = cm->cores;
    describe_split(&A->model, split, o->stages, desc, sizeof desc);
    fprintf(stderr, PROG ": tuner: split ");
    for (g = 0; g < o->stages; g++) fprintf(stderr, "%s%d", g ? "," : "", split[g]);
    fprintf(stderr, " [%s]", desc);
    if (planned) fprintf(stderr, " chosen by the partitioner among %lld splits (%lld searched, %.2f s)", plan.splits, plan.searched, now_s() - t0);
    else fprintf(stderr, o->split_given ? " (--split)" : " (the only one)");
    fprintf(stderr, "; stage %d, the busiest, does %.1f%% of the work per sample (micro-batches of %g): no schedule gains "
            "more than %.2fx over one thread here\n", l, 100 * share, x, share > 0 ? fmin(1 / share, cm->cores > 0 ? cm->cores : 1e9) : 0.0);
    avgpipe_tune_split_choice_free(ctx, &plan);
    return 0;
}

/* Profile, fit, search; then set A->opt's schedule, micro, pipes, advance and round mode to the choice. The
   order, model and nets are set up afresh afterwards (main), from the seed: training starts from the same
   weights and sample order as a run given the chosen settings on the command line. */
static int tune(app *A, avgpipe_context *ctx) {
    options *o = &A->opt;
    char tmp[512];
    const char *path;
    int sizes[2], nsizes, i, min_micro = tune_min_micro(o), rc = -1, two = 0;
    double t0 = now_s(), t1, meas[3][TUNE_PROFILED];
    avgpipe_profile prof;
    avgpipe_cost_model cm, sm, *use = &cm;
    avgpipe_tune_desc td;
    avgpipe_noise_scale noise;
    avgpipe_result r;
    memset(&prof, 0, sizeof prof);
    memset(&cm, 0, sizeof cm);
    memset(&sm, 0, sizeof sm);
    if (A->train.n < o->batch)
        return fail("tuner: %d training samples cannot fill one batch of %d samples", A->train.n, o->batch);
    if (tune_profile_path(o, tmp, sizeof tmp, &path) != 0) return -1;

    /* Profile (with every layer's times) and fit. */
    nsizes = profile_sizes(o, min_micro, sizes);
    memset(A->nlsamp, 0, sizeof A->nlsamp);
    for (i = 0; i < 2 * MLP_MAX_LAYERS * 2; i++)
        if (!(A->lsamp[i / (2 * MLP_MAX_LAYERS)][i / 2 % MLP_MAX_LAYERS][i % 2] = (double *)malloc(LSAMP_CAP * sizeof(double)))) {
            fail("out of memory");
            goto done;
        }
    for (i = 0; i < nsizes; i++)
        if (profile_run(A, ctx, sizes[i], 1, i, path, i > 0, meas[i]) != 0) goto done;
    /* and 2 pipelines at the first size: how much of the cores the stage threads get when there is
       little bubble (the cost model's busy_cores; nothing to learn from it when N is fixed at 1 or the
       data cannot feed 2 pipelines) */
    two = o->pipes != 1 && A->train.n >= 2 * o->batch;
    if (two && profile_run(A, ctx, sizes[0], 2, -1, path, 1, meas[nsizes]) != 0) goto done;
    if (append_layer_costs(A, ctx, path, sizes, nsizes) != 0) goto done;
    t1 = now_s();
    r = avgpipe_profile_load(ctx, path, &prof);
    if (r == AVGPIPE_OK && prof.nsections != (nsizes + two) * TUNE_PROFILED) {
        fail("tuner: the profile %s holds %d sections, %d were written", path, prof.nsections, (nsizes + two) * TUNE_PROFILED);
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
    cm.overlap = 0; /* the ops of a CPU rank run on its one thread: they never overlap (what the fit saw is noise) */
    fprintf(stderr, PROG ": tuner: profiled 1 pipeline (advance, K = %d, %d rounds/iteration) at M = %d", o->stages - 1,
            prof.sections[0].shape.rounds, sizes[0]);
    if (nsizes > 1) fprintf(stderr, " and M = %d", sizes[1]);
    if (two) fprintf(stderr, ", and 2 pipelines at M = %d", sizes[0]);
    fprintf(stderr, ", %d iterations each after %d warm-up, in %.2f s (throwaway weights)%s%s\n", TUNE_PROFILED,
            TUNE_WARMUP, t1 - t0, o->profile_tune ? "; profile: " : "", o->profile_tune ? o->profile_tune : "");
    print_cost_model(&cm);
    for (i = 0; i < nsizes + two; i++) print_check(ctx, &cm, &prof, i * TUNE_PROFILED, meas[i]);

    /* Search: the flags the user fixed (schedule, --sync) narrow it; M and N fixed narrow the choice. */
    if (tune_noise(ctx, o, &A->model, &A->train, (int)cm.cores, &noise) != 0) goto done;
    tune_desc_init(&td, o, A->train.n, min_micro, &noise);
    if (cm.nlayers) { /* the split (the partitioner's, with --split auto), searched on its layers' costs */
        if (tune_split(A, ctx, &cm, &td, &sm) != 0) goto done;
        use = &sm;
    }
    if (!tuning(o)) { /* --micro and --pipes fixed: the split was all there was to choose */
        rc = 0;
        goto done;
    }
    if (tune_choose(ctx, o, use, &td, A->train.n, o->batch_set ? 1 : TUNE_BATCHES, t0) != 0) goto done; /* (N fixed: no noise scale, 1 batch) */
    rc = 0;
done:
    if (path == tmp) remove(tmp);
    avgpipe_tune_cost_model_free(ctx, &cm);
    avgpipe_tune_cost_model_free(ctx, &sm);
    avgpipe_profile_free(ctx, &prof);
    for (i = 0; i < 2 * MLP_MAX_LAYERS * 2; i++) {
        free(A->lsamp[i / (2 * MLP_MAX_LAYERS)][i / 2 % MLP_MAX_LAYERS][i % 2]);
        A->lsamp[i / (2 * MLP_MAX_LAYERS)][i / 2 % MLP_MAX_LAYERS][i % 2] = NULL;
    }
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
    check_outputs(&A->opt, A->me);
    return 0;
}

/* Rank 0 tuned alone: everyone trains with its choice (or stops with it). Bounded: rank 0 has 10 minutes. */
static int share_choice(app *A, int rc) {
    options *o = &A->opt;
    int v[10 + MLP_MAX_LAYERS], done = 0, g;
    MPI_Request req;
    double t0 = MPI_Wtime();
    struct timespec nap = {0, 1000000L};
    v[0] = rc, v[1] = (int)o->schedule, v[2] = o->micro, v[3] = o->pipes, v[4] = o->continuous, v[5] = o->advance, v[6] = o->chunks,
    v[7] = o->rounds, v[8] = o->nsplit, v[9] = o->batch;
    for (g = 0; g < MLP_MAX_LAYERS; g++) v[10 + g] = o->split[g];
    if (MPI_Ibcast(v, 10 + MLP_MAX_LAYERS, MPI_INT, 0, MPI_COMM_WORLD, &req) != MPI_SUCCESS) return fail("--backend mpi: MPI_Ibcast failed");
    while (MPI_Test(&req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done && MPI_Wtime() - t0 < 600) nanosleep(&nap, NULL);
    if (!done) return fail("--backend mpi: rank 0 did not finish tuning within 10 minutes");
    if (v[0] != 0) return A->me == 0 ? -1 : fail("rank 0 failed to tune (see its message)");
    o->schedule = (avgpipe_sched_kind)v[1], o->micro = v[2], o->pipes = v[3], o->continuous = v[4], o->advance = v[5], o->chunks = v[6];
    o->rounds = v[7], o->nsplit = v[8], o->batch = v[9];
    for (g = 0; g < MLP_MAX_LAYERS; g++) o->split[g] = v[10 + g];
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
    parse_options(&program, argc, argv, &A.opt);
    if (ensure_blas_kernel(&A.opt, argv) == 0 && !A.opt.procs) {
        printf("BLAS: %s, 1 thread per stage\n", g_blas.line);
        fflush(stdout); /* first, also when stdout and stderr go to one file */
    }
    openblas_set_num_threads(1); /* the stage threads are the parallelism */
#ifdef __linux__
    errno = 0;
    A.nice_base = getpriority(PRIO_PROCESS, 0);
    if (errno) A.nice_base = 0;
#endif
    avgpipe_context_init(&ctx, NULL);
    A.me = -1;
    A.S = A.opt.stages / A.opt.chunks; /* ranks per replica group (is_local needs it before setup_model) */
#ifdef FMNIST_MPI
    if (A.opt.procs && start_mpi(&A, &ctx, &argc, &argv) != 0) goto done;
#endif
#ifdef FMNIST_HWLOC
    if (setup_placement(&A, &ctx) != 0) goto done;
#endif
    if (load_data(&A) != 0) goto done;
    if (tuning(&A.opt) || planning(&A.opt)) {
        int trc = A.me <= 0 ? tune(&A, &ctx) : 0;
#ifdef FMNIST_MPI
        if (A.me >= 0) trc = share_choice(&A, trc);
#endif
        if (trc != 0) goto done;
    }
    if (A.me <= 0) plan_priorities(&A); /* (threads only: it does nothing under MPI) */
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
#ifdef FMNIST_HWLOC
    free_placement(); /* after the run that binds with it */
#endif
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
