/* mlp_app.h: what the two MLP trainers share beyond examples/mlp.h: examples/fashion_mnist.c (CPU
   threads or MPI) and examples/cuda_mlp.cu (a GPU, or one GPU per process over NCCL).
     1. the command line: one options struct, the flags both take, their checks and messages (each
        program adds its own flags through an mlp_cli_program);
     2. the tuner's choice: the gradient noise scale (a plain-loop probe) and, from a fitted cost model,
        the setting to train, and its report on stderr;
     3. training progress: the per-epoch statistics and bar, checkpoints.

   Part of the examples, not of the library: every function is static, and the one file of each
   program that includes this header defines PROG (its name, for messages) first and includes
   avgpipe.h and examples/mlp.h before it. Bad command lines print one line on stderr and exit with
   status 2; --help prints the program's usage and exits with 0. */
#ifndef MLP_APP_H
#define MLP_APP_H

#ifndef PROG
#error "define PROG (the program's name) before including examples/mlp_app.h"
#endif

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "examples/tune_rank.h" /* the candidates of every batch searched, and the choice among them */

#ifdef __cplusplus
extern "C"
#endif
void openblas_set_num_threads(int num_threads); /* also in OpenBLAS's cblas.h; not in netlib's */

/* ---- 1. The command line ---------------------------------------------------------------------------- */

#define AUTO 0            /* --micro auto, --pipes auto: the tuner picks them */
#define ADVANCE_AUTO (-1) /* --advance auto */
#define MAX_REPLICAS 8    /* --replicas */

typedef struct options {
    /* flags both programs take */
    int stages, pipes, micro, batch, epochs, rounds, chunks, advance, limit_train, replicas;
    int checkpoint_every, stop_after; /* iterations between checkpoints (0: only at the end); epochs to run now */
    int deterministic, continuous, normalize, cosine;
    int procs;                        /* --backend mpi (fashion_mnist) or nccl (cuda_mlp): one rank per process */
    int schedule_set, sync_set;       /* the user fixed --schedule / --sync: the tuner keeps them */
    int objective_set;                /* --objective given (it applies only to the tuner) */
    int batch_set;                    /* --batch given: the tuner keeps it (else it may take 2x or 4x, see tune_choose) */
    avgpipe_sched_kind schedule;
    double alpha, lr;
    double mem_limit;                 /* --mem-limit: bytes per rank for the tuner; 0: none */
    int objective;                    /* --objective: what the tuner ranks by (avgpipe_tune_objective) */
    unsigned long long seed;
    const char *data, *hidden, *trace, *profile, *save, *profile_tune, *checkpoint, *resume;
    /* fashion_mnist's own */
    int split[MLP_MAX_LAYERS], nsplit; /* --split LIST: layers per stage partition; nsplit 0: auto */
    int split_planned, split_given;    /* the partitioner chose the split; --split LIST (for the header) */
    int priorities;                    /* --priorities: lower the lighter stages' threads when they outnumber the cores */
    int stage_nice[MLP_MAX_LAYERS];    /* per rank of a group: nice increment of its stage thread (0: none) */
    double target_acc;                 /* --target-acc: stop when the reference reaches it (0: train every epoch) */
    int evals_per_epoch;               /* with --target-acc: test evaluations per epoch */
    const char *bind;                  /* --bind: NULL or "none", "report", "auto", "always" */
    /* cuda_mlp's own */
    int device, device_set;            /* --device: the GPU of --backend threads */
    const char *nccl_id;               /* --nccl-id: the file rank 0 leaves NCCL's id in */
} options;

/* What a program adds to the shared flags. */
typedef struct mlp_cli_program {
    const char *usage;                 /* --help prints usage, then usage_more (may be NULL) */
    const char *usage_more;
    const char *procs_backend;         /* the --backend value that runs one rank per process ("mpi", "nccl") */
    const char *procs_missing;         /* NULL when this build has that backend, else why --backend <it> cannot run */
    const char *const *own_flags;      /* the program's own flags that take a value, NULL-terminated */
    void (*own_defaults)(options *o);  /* after the shared defaults (may be NULL) */
    void (*own_value)(options *o, const char *flag, const char *value); /* one of own_flags */
    void (*own_check)(options *o);     /* after the shared checks and the model's (may be NULL) */
    int (*profiles)(const options *o); /* the tuner's profile runs happen: --mem-limit and --profile-tune apply */
    const char *profiles_when;         /* when they do, for the message when they do not */
} mlp_cli_program;

static int g_rank = -1; /* one rank per process: this process's rank, for messages */

/* Print "PROG: <message>" (one rank per process: "PROG (rank R): ...") on stderr; returns -1. */
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
static int v_placed(avgpipe_sched_kind k) { return avgpipe_sched_kind_query(k)->placement == AVGPIPE_PLACE_V; }

/* Output files are created before training, so that a bad path fails now rather than after the run. */
static void check_output(const char *flag, const char *path) {
    FILE *f;
    if (!path) return;
    errno = 0;
    f = fopen(path, "wb");
    if (!f) bad_usage("%s %s: cannot create: %s", flag, path, strerror(errno));
    fclose(f);
}

/* One rank per process: what rank `me` writes: FILE for rank 0 (and with threads, me < 0), FILE.me
   for the others. */
static const char *rank_path(int me, const char *path, char *buf, size_t cap) {
    if (!path || me <= 0) return path;
    snprintf(buf, cap, "%s.%d", path, me);
    return buf;
}

/* Every output file of the process of rank `me` (with threads, me < 0: all of them). */
static void check_outputs(const options *o, int me) {
    char b1[4096], b2[4096];
    check_output("--trace", rank_path(me, o->trace, b1, sizeof b1));
    check_output("--profile", rank_path(me, o->profile, b2, sizeof b2));
    if (me <= 0) check_output("--save", o->save);
    if (me <= 0) check_output("--profile-tune", o->profile_tune);
}

static void mlp_cli_defaults(options *o) {
    memset(o, 0, sizeof *o);
    o->stages = 4, o->pipes = AUTO, o->micro = AUTO, o->batch = 128, o->epochs = 10, o->rounds = 8, o->chunks = 0;
    o->replicas = 1;
    o->advance = ADVANCE_AUTO, o->continuous = 1, o->normalize = 1, o->cosine = 1;
    o->schedule = AVGPIPE_SCHED_ADVANCE, o->alpha = 0.1, o->lr = 1e-3, o->seed = 1;
    o->data = "/usr/share/datasets/fashion-mnist", o->hidden = "512,256,128";
}

/* Flags without a value; returns 1 if f was one. */
static int mlp_cli_switch(const mlp_cli_program *p, options *o, const char *f) {
    if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
        fputs(p->usage, stdout);
        if (p->usage_more) fputs(p->usage_more, stdout);
        exit(0);
    }
    if (!strcmp(f, "--sync")) return o->continuous = 0, o->sync_set = 1, 1;
    if (!strcmp(f, "--deterministic")) return o->deterministic = 1, 1;
    if (!strcmp(f, "--no-normalize")) return o->normalize = 0, 1;
    if (!strcmp(f, "--constant-lr")) return o->cosine = 0, 1;
    return 0;
}

/* The shared flags that take a value. */
static const char *const mlp_cli_flags[] = {
    "--stages", "--pipes", "--micro", "--batch", "--epochs", "--rounds", "--chunks", "--limit-train", "--alpha",
    "--lr", "--seed", "--advance", "--schedule", "--data", "--hidden", "--trace", "--profile", "--save",
    "--mem-limit", "--profile-tune", "--replicas", "--backend", "--checkpoint", "--checkpoint-every", "--resume",
    "--stop-after", "--objective", NULL};

static int mlp_cli_listed(const char *const *names, const char *f) {
    for (; names && *names; names++)
        if (!strcmp(f, *names)) return 1;
    return 0;
}

/* A shared flag with its value. */
static void mlp_cli_value(const mlp_cli_program *p, options *o, const char *f, const char *v) {
    if (!strcmp(f, "--stages")) o->stages = (int)parse_long(f, v, 1, MLP_MAX_LAYERS);
    else if (!strcmp(f, "--pipes")) o->pipes = !strcmp(v, "auto") ? AUTO : (int)parse_long(f, v, 1, 256);
    else if (!strcmp(f, "--micro")) o->micro = !strcmp(v, "auto") ? AUTO : (int)parse_long(f, v, 1, 4096);
    else if (!strcmp(f, "--batch")) o->batch = (int)parse_long(f, v, 1, 1 << 20), o->batch_set = 1;
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
        if (!strcmp(v, p->procs_backend)) o->procs = 1;
        else if (!strcmp(v, "threads")) o->procs = 0;
        else bad_usage("--backend expects threads or %s, got '%s'", p->procs_backend, v);
        if (o->procs && p->procs_missing) bad_usage("--backend %s: %s", v, p->procs_missing);
    } else if (!strcmp(f, "--alpha")) o->alpha = parse_double(f, v, 0, 1);
    else if (!strcmp(f, "--lr")) o->lr = parse_double(f, v, 1e-9, 10);
    else if (!strcmp(f, "--seed")) o->seed = (unsigned long long)parse_long(f, v, 0, 2147483647L);
    else if (!strcmp(f, "--advance")) o->advance = !strcmp(v, "auto") ? ADVANCE_AUTO : (int)parse_long(f, v, 0, 4096);
    else if (!strcmp(f, "--schedule")) {
        if (avgpipe_sched_kind_parse(v, &o->schedule) != AVGPIPE_OK || o->schedule == AVGPIPE_SCHED_CUSTOM)
            bad_usage("--schedule expects afab, 1f1b, advance, interleaved, zbh1, zbv or dualpipev, got '%s'", v);
        o->schedule_set = 1;
    } else if (!strcmp(f, "--mem-limit")) o->mem_limit = parse_size(f, v);
    else if (!strcmp(f, "--objective")) {
        if (!strcmp(v, "time")) o->objective = AVGPIPE_TUNE_TIME_TO_TARGET;
        else if (!strcmp(v, "throughput")) o->objective = AVGPIPE_TUNE_THROUGHPUT;
        else bad_usage("--objective expects time or throughput, got '%s'", v);
        o->objective_set = 1;
    }
    else if (!strcmp(f, "--profile-tune")) o->profile_tune = v;
    else if (!strcmp(f, "--data")) o->data = v;
    else if (!strcmp(f, "--hidden")) o->hidden = v;
    else if (!strcmp(f, "--trace")) o->trace = v;
    else if (!strcmp(f, "--profile")) o->profile = v;
    else if (!strcmp(f, "--save")) o->save = v;
}

/* Cross-flag checks of the shared flags that need no data; sets the chunks per rank. */
static void mlp_cli_check(const mlp_cli_program *p, options *o, const char *advance_flag) {
    int interleaved = avgpipe_sched_kind_query(o->schedule)->chunks == 0 /* takes any count */, vplaced = v_placed(o->schedule);
    if (o->micro != AUTO && o->batch % o->micro != 0)
        bad_usage("--batch %d is not a multiple of --micro %d", o->batch, o->micro);
    if (tuning(o) && (interleaved || vplaced))
        bad_usage("--schedule %s needs fixed --micro and --pipes (the tuner profiles one chunk per rank)",
                  avgpipe_sched_kind_name(o->schedule));
    if (tuning(o) && advance_flag && strcmp(advance_flag, "auto") != 0)
        bad_usage("--advance %s needs fixed --micro and --pipes (with --micro or --pipes auto the tuner picks K)",
                  advance_flag);
    if (!p->profiles(o) && (o->mem_limit > 0 || o->profile_tune))
        bad_usage("%s applies only to %s", o->mem_limit > 0 ? "--mem-limit" : "--profile-tune", p->profiles_when);
    if (!tuning(o) && o->objective_set) bad_usage("--objective applies only to the tuner (--micro auto or --pipes auto)");
    if (advance_flag && o->schedule != AVGPIPE_SCHED_ADVANCE && strcmp(advance_flag, "auto") != 0)
        bad_usage("--advance %s applies only to --schedule advance", advance_flag);
    if (o->chunks && !interleaved) bad_usage("--chunks applies only to --schedule interleaved");
    if (o->checkpoint_every && !o->checkpoint) bad_usage("--checkpoint-every needs --checkpoint DIR");
    if (o->stop_after > o->epochs) bad_usage("--stop-after %d is past --epochs %d", o->stop_after, o->epochs);
    if (interleaved && !o->chunks) o->chunks = 2;
    if (!interleaved) o->chunks = avgpipe_sched_kind_query(o->schedule)->chunks; /* the kind's own count */
    if (o->stages % o->chunks != 0)
        bad_usage("--stages %d is not a multiple of %d (%s holds %d stages per rank)", o->stages, o->chunks,
                  avgpipe_sched_kind_name(o->schedule), o->chunks);
    {
        int per = avgpipe_sched_kind_query(o->schedule)->micro_pipes_per_stage, ranks = o->stages / o->chunks;
        if (per && !tuning(o) && o->pipes * o->micro < per * ranks)
            bad_usage("--schedule %s needs --pipes x --micro >= %d x ranks = %d (got %d x %d)", avgpipe_sched_kind_name(o->schedule), per,
                      per * ranks, o->pipes, o->micro);
    }
}

/* Parse argv into *o: defaults, the flags in any order, then the checks (shared, the model for
   Fashion-MNIST's 784 inputs, the program's own) and, with threads, that every output file can be
   created (one rank per process: check_outputs() once the rank is known). */
static void parse_options(const mlp_cli_program *p, int argc, char **argv, options *o) {
    const char *advance_flag = NULL;
    char err[512];
    mlp_model m;
    int i;
    mlp_cli_defaults(o);
    if (p->own_defaults) p->own_defaults(o);
    for (i = 1; i < argc; i++) {
        const char *f = argv[i];
        int own;
        if (mlp_cli_switch(p, o, f)) continue;
        if (strncmp(f, "--", 2) != 0) bad_usage("unexpected argument '%s' (try --help)", f);
        own = mlp_cli_listed(p->own_flags, f);
        if (!own && !mlp_cli_listed(mlp_cli_flags, f)) bad_usage("unknown option '%s' (try --help)", f);
        if (i + 1 >= argc) bad_usage("missing value after %s", f);
        if (!strcmp(f, "--advance")) advance_flag = argv[i + 1];
        if (own) p->own_value(o, f, argv[++i]);
        else mlp_cli_value(p, o, f, argv[++i]);
    }
    mlp_cli_check(p, o, advance_flag);
    if (mlp_model_parse(&m, 784, o->hidden, o->stages, err, sizeof err) != 0) bad_usage("%s", err);
    if (p->own_check) p->own_check(o);
    if (!o->procs) check_outputs(o, -1);
}

/* The --help lines of the shared flags from --replicas to --stop-after; B names the backend that runs one
   rank per process ("mpi", "nccl"). */
#define MLP_APP_USAGE_FLAGS(B) \
    "  --replicas D        replica groups of the pipelines, each on its own share of the data, their\n" \
    "                      reference models averaged every round (default 1)\n" \
    "  --pipes N|auto      parallel pipelines = parallel models (default auto: the tuner picks 1..4)\n" \
    "  --micro M|auto      micro-batches per batch (default auto: the tuner picks M, micro-batches of\n" \
    "                      at least 16 samples)\n" \
    "  --batch B           samples per batch per pipeline, a multiple of M (default 128, or the tuner's 2x/4x)\n" \
    "  --schedule KIND     afab | 1f1b | advance | interleaved | zbh1 | zbv | dualpipev (default advance;\n" \
    "                      with --micro or --pipes auto the tuner's pick among afab, 1f1b, advance, zbh1,\n" \
    "                      or only KIND); zbv and dualpipev hold two stages per rank in a V (ranks = G / 2)\n" \
    "  --advance K|auto    advance forwards (advance only; default auto: the runtime's adaptive K when M and\n" \
    "                      N are fixed, the tuner's K otherwise; a fixed K needs fixed --micro and --pipes)\n" \
    "  --chunks V          model chunks per rank (interleaved only; default 2; ranks = G / V)\n" \
    "  --rounds R          rounds per runtime iteration (default 8)\n" \
    "  --sync              synchronous rounds (default: continuous rounds, or the tuner's pick)\n" \
    "  --mem-limit SIZE    tuner: bytes per rank (buffers, parameters, Adam state), suffix K, M or G\n" \
    "                      (binary); default no limit\n" \
    "  --profile-tune FILE tuner: keep its profile (default: a temporary file, removed)\n" \
    "  --objective OBJ     tuner: time (to a target loss; default) | throughput (samples/s alone)\n" \
    "  --alpha A           elasticity in [0, 1] (default 0.1)\n" \
    "  --epochs E          (default 10)\n" \
    "  --lr LR             Adam learning rate, cosine-decayed to 0 over the run (default 1e-3)\n" \
    "  --constant-lr       no learning-rate decay\n" \
    "  --seed S            weights and sample order (default 1)\n" \
    "  --hidden LIST       hidden widths (default 512,256,128: 784-512-256-128-10)\n" \
    "  --data DIR          (default /usr/share/datasets/fashion-mnist)\n" \
    "  --limit-train N     use only the first N training samples\n" \
    "  --deterministic     every averaging waits for the previous round's reference (reproducible)\n" \
    "  --trace FILE.json   Chrome trace of the last iteration (open in ui.perfetto.dev); with --backend\n" \
    "                      " B " each process writes its ranks' part, rank R's to FILE.R (rank 0's to FILE)\n" \
    "  --profile FILE      per-op profile of the last iteration (the tuner's input); " B ": as --trace\n" \
    "  --save FILE         write the reference model's parameters (mlp_params_save)\n" \
    "  --checkpoint DIR    save a checkpoint there (avgpipe_run_save: every rank's models, references,\n" \
    "                      averaging state and Adam state) at the end, and every --checkpoint-every K\n" \
    "                      iterations; the directory is created if missing\n" \
    "  --resume DIR        continue from the checkpoint in DIR: give the flags it was made with (with\n" \
    "                      --micro/--pipes auto the tuner must choose the same: fix them and --batch)\n" \
    "  --stop-after E      stop after epoch E of --epochs (to resume later; default: run them all)\n"

/* ---- 2. The tuner's choice (--micro auto, --pipes auto) --------------------------------------------- */

#define TUNE_WARMUP 1   /* iterations run before the profiled ones (first touches, thread start) */
#define TUNE_PROFILED 3 /* profiled iterations per micro-batch size, each a section of the profile */
#define TUNE_SHOW 5     /* alternatives printed */
#define TUNE_MAX_PIPES 4
#define TUNE_MIN_MICRO_SAMPLES 16
#define TUNE_TIE 0.005  /* settings predicted within 0.5% of the best are ties (see tune_choose) */
#define TUNE_NOISE_EPOCHS 0.5 /* the noise probe trains this share of an epoch, then measures (tune_noise_probe) */
#define TUNE_NOISE_BATCHES 32 /* batches the noise scale is measured on */
#define TUNE_BATCHES 4        /* with --batch not given, the tuner also tries batches of 2x and 4x (tune_choose) */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static double median3(const double *v) {
    double a = v[0], b = v[1], c = v[2];
    return a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
}

/* The fewest samples per micro-batch the search considers: TUNE_MIN_MICRO_SAMPLES, or fewer when the
   batch or a fixed --micro leaves fewer. */
static int tune_min_micro(const options *o) {
    int min_micro = TUNE_MIN_MICRO_SAMPLES < o->batch ? TUNE_MIN_MICRO_SAMPLES : o->batch;
    if (o->micro != AUTO && o->batch / o->micro < min_micro) min_micro = o->batch / o->micro;
    return min_micro;
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

/* Where the profile goes: --profile-tune, else a fresh temporary file in $TMPDIR (or /tmp) named into
   tmp[cap], which the caller removes. 0, or -1 with a message. */
static int tune_profile_path(const options *o, char *tmp, size_t cap, const char **path) {
    const char *dir = getenv("TMPDIR");
    int fd;
    *path = o->profile_tune;
    if (*path) return 0;
    snprintf(tmp, cap, "%s/" PROG "_tune_XXXXXX", dir && *dir ? dir : "/tmp");
    fd = mkstemp(tmp);
    if (fd < 0) return fail("tuner: cannot create a temporary profile %s: %s (set TMPDIR, or give --profile-tune FILE)", tmp, strerror(errno));
    close(fd);
    *path = tmp;
    return 0;
}

/* The gradient noise scale B_noise of model m at batch o->batch, for ranking by time to target (avgpipe.h
   section 20, avgpipe_tune_noise_scale): a plain-loop probe (mlp_reference on the caller's thread, weights
   and order from o->seed, thrown away) trains TUNE_NOISE_EPOCHS of an epoch at the run's learning rate,
   then, at the weights it reached, takes TUNE_NOISE_BATCHES more batches and sums the squares of each
   micro-batch's gradient (micro-batches of batch / M samples, M the largest of 2..8 dividing the batch)
   and of the batch's, both preconditioned as the probe's Adam would step them (mlp_reference_batch_noise
   with its second moments). Why Adam's geometry: the raw noise scale of the default model is ~80 samples
   at the first steps, ~200 by half an epoch, ~450 in the third epoch, which would make every pipeline
   beyond the first look wasted, while bench_converge measures 4.0-5.0 epochs to its target for every
   round size up to 4x the batch; the preconditioned one (1e5-1e6, +-60-90%) agrees with that (Adam's
   critical batch is far above SGD's). Why train first: the noise scale grows as the loss falls
   (McCandlish et al. 2018), and the first steps are not the run. Half an epoch keeps the probe at ~1 s
   here. ns->scale 0 (not measured) when the batch cannot be cut (a batch of 1) or the noise hid the
   gradient. *seconds: the probe's time. 0, or -1 with a message. */
static int tune_noise_probe(avgpipe_context *ctx, const options *o, const mlp_model *m, const mlp_data *train,
                            avgpipe_noise_scale *ns, double *seconds) {
    mlp_reference r, q;
    mlp_adam_hp hp = mlp_adam_defaults();
    double t0 = now_s(), small[TUNE_NOISE_BATCHES], big[TUNE_NOISE_BATCHES], l;
    char err[256];
    int64_t t, steps;
    int M, i, g, c, rc = -1;
    memset(ns, 0, sizeof *ns);
    *seconds = 0;
    for (M = 8; M > 1 && o->batch % M; M--) continue;
    if (M < 2 && o->batch > 1) M = o->batch; /* a prime batch: micro-batches of one sample */
    if (M < 2) return 0;
    hp.lr = (float)o->lr;
    memset(&q, 0, sizeof q);
    if (mlp_reference_init(&r, m, train, o->batch, 1, &hp, o->seed, o->seed, err, sizeof err) != 0 ||
        mlp_reference_init(&q, m, train, o->batch, M, &hp, o->seed, o->seed, err, sizeof err) != 0) {
        fail("tuner: noise probe: %s", err);
        goto out;
    }
    steps = (int64_t)(TUNE_NOISE_EPOCHS * (double)r.order.rounds_per_epoch);
    if (o->cosine) r.decay_steps = r.order.rounds_per_epoch * o->epochs;
    for (t = 0; t < steps; t++) {
        if (mlp_reference_batch(&r, t, &l, &c) != 0) {
            fail("tuner: noise probe: non-finite loss at step %lld (lower --lr?)", (long long)t + 1);
            goto out;
        }
        mlp_reference_step(&r);
    }
    for (g = 0; g < m->stages; g++) memcpy(q.net.params[g], r.net.params[g], sizeof(float) * m->count[g]);
    for (i = 0; i < TUNE_NOISE_BATCHES; i++) { /* at fixed weights: the gradients of the next batches */
        if (mlp_reference_batch_noise(&q, steps + i, &r.net, &r.adam, &l, &c, &small[i], &big[i]) != 0) {
            fail("tuner: noise probe: non-finite loss or out of memory");
            goto out;
        }
        for (g = 0; g < m->stages; g++) memset(q.net.grad[g], 0, sizeof(float) * m->count[g]);
    }
    if (avgpipe_tune_noise_scale(ctx, small, big, TUNE_NOISE_BATCHES, (double)(o->batch / M), (double)o->batch, ns) != AVGPIPE_OK) {
        fail("tuner: noise probe: %s", avgpipe_last_error(ctx));
        goto out;
    }
    rc = 0;
out:
    mlp_reference_free(&r);
    mlp_reference_free(&q);
    *seconds = now_s() - t0;
    return rc;
}

/* The tuner's noise scale (tune_noise_probe), reported on stderr; none (scale 0) when it ranks by samples/s
   alone or N is fixed (every candidate then has the same efficiency). blas_threads: OpenBLAS threads for
   the probe (the stage threads are not running yet), set back to 1 after it. 0, or -1 with a message. */
static int tune_noise(avgpipe_context *ctx, const options *o, const mlp_model *m, const mlp_data *train, int blas_threads,
                      avgpipe_noise_scale *ns) {
    double s;
    int rc;
    memset(ns, 0, sizeof *ns);
    if (o->objective == AVGPIPE_TUNE_THROUGHPUT || o->pipes != AUTO) return 0;
    openblas_set_num_threads(blas_threads);
    rc = tune_noise_probe(ctx, o, m, train, ns, &s);
    openblas_set_num_threads(1);
    if (rc != 0) return rc;
    if (ns->scale > 0)
        fprintf(stderr, PROG ": tuner: gradient noise scale %.0f samples (+-%.0f%%, %d batches after %.2g epochs of a plain-loop "
                        "probe, %.2f s): a round of N x %d samples takes 1 + N x %d / %.0f times the epochs\n",
                ns->scale, 100 * ns->rel_err, ns->n, TUNE_NOISE_EPOCHS, s, o->batch, o->batch, ns->scale);
    else fprintf(stderr, PROG ": tuner: gradient noise scale not measured (%s; %.2f s): ranking by samples/s\n",
                 o->batch < 2 ? "a batch of 1 sample has no micro-batches" : "the noise hid the gradient", s);
    return 0;
}

/* The model against the iterations it was fitted to (median of the profiled ones). */
static void print_check(avgpipe_context *ctx, const avgpipe_cost_model *m, const avgpipe_profile *p, int section,
                        const double *measured) {
    const avgpipe_profile_section *sec = &p->sections[section];
    double pred = 0, meas = median3(measured);
    if (avgpipe_tune_predict(ctx, m, &sec->shape, sec->samples, &pred) == AVGPIPE_OK && meas > 0)
        fprintf(stderr, "  check M = %d, N = %d: measured %.1f ms/iteration, predicted %.1f ms (%+.0f%%)\n", sec->shape.micro,
                sec->shape.pipes, 1e3 * meas, 1e3 * pred, 100 * (pred / meas - 1));
}

static const char *round_mode(int continuous) { return continuous ? "continuous" : "sync"; }

static void print_candidate(const avgpipe_tune_candidate *c, int batch, int chosen) {
    char k[16] = "-";
    if (c->sched.kind == AVGPIPE_SCHED_ADVANCE) snprintf(k, sizeof k, "%d", c->sched.advance);
    fprintf(stderr, "  %2s %-8s %5d %3d %3d %4s %-10s %4d %10.0f %6.2f %9.2f %9.2f%s\n", chosen ? "->" : "",
            avgpipe_sched_kind_name(c->sched.kind), batch, c->sched.micro, c->sched.pipes, k, round_mode(c->sched.continuous),
            batch / c->sched.micro, 1.0 / c->time_per_sample, c->efficiency, c->time_to_target, c->peak_bytes / (1024.0 * 1024.0),
            c->fits ? "" : "  over --mem-limit");
}

/* The search the command line asks for: the flags the user fixed (schedule, --sync, N) narrow it; N up to
   TUNE_MAX_PIPES and what `ntrain` samples can feed (every model needs a batch of its own per round).
   noise: the model's gradient noise scale (tune_noise_probe; NULL or scale 0: not measured); the time to
   target is counted in seconds per epoch of ideal progress (target_samples = ntrain: the progress one
   epoch makes at a batch far below the noise scale). */
static void tune_desc_init(avgpipe_tune_desc *td, const options *o, int ntrain, int min_micro, const avgpipe_noise_scale *noise) {
    int feed = ntrain / (o->batch * o->replicas);
    memset(td, 0, sizeof *td);
    td->objective = o->objective;
    td->noise_scale = noise ? noise->scale / o->replicas : 0; /* D replica groups train one reference */
    td->target_samples = ntrain;
    td->batch = o->batch;
    td->max_pipes = o->pipes != AUTO ? o->pipes : feed < TUNE_MAX_PIPES ? feed : TUNE_MAX_PIPES;
    td->rounds = o->rounds;
    td->mem_limit = o->mem_limit;
    td->opt_bytes_per_param = 8; /* Adam: two moments per parameter and model */
    td->min_micro = min_micro;
    td->no_continuous = o->sync_set;
    td->kinds = o->schedule_set ? 1u << o->schedule : 0;
    td->threads = tune_threads();
}

/* tune_rank_search's filter: the M and N the user fixed. */
static int tune_keep_fixed(const avgpipe_tune_candidate *c, void *user) {
    const options *o = (const options *)user;
    return (o->micro == AUTO || c->sched.micro == o->micro) && (o->pipes == AUTO || c->sched.pipes == o->pipes);
}

/* Search model `m` as td says, choose, report on stderr, and set o's schedule, micro, pipes, advance,
   round mode, chunks and batch to the choice. The choice: the best predicted (least time to target, or
   with --objective throughput least time per sample) within --mem-limit among the settings with the M
   and N the user fixed; those within TUNE_TIE of it are ties, broken toward fewer pipelines (progress
   per sample), then less memory. batches > 1: also at 2x, 4x, ... up to `batches` x td->batch samples
   per batch (one pipeline with a larger batch against more pipelines: the same efficiency from the noise
   scale, often more samples/s), micro-batches no smaller than td's times as much, and N x batch at most
   `batches` x td->batch: the learning rate was set for td->batch, and the noise scale measured half an
   epoch in is no forecast of how far beyond that a round can grow (for the default model the raw
   estimate is ~200 samples, Adam's preconditioned one 1e5-1e6 +-70%; the grid of bench_converge puts
   the real one between, in the thousands). Only when ranking by time to target with a measured noise
   scale (by samples/s alone the largest batch would always win).
   t0: when tuning began, for the report. 0, or -1 with a message (nothing fits: what the smallest
   setting needs). */
static int tune_choose(avgpipe_context *ctx, options *o, const avgpipe_cost_model *m, const avgpipe_tune_desc *td, int ntrain,
                       int batches, double t0) {
    tune_cand *cand = NULL;
    int i, nok = 0, nsim = 0, shown = 0, chosen, best, thr = o->objective == AVGPIPE_TUNE_THROUGHPUT;
    double t1 = now_s();
    char err[AVGPIPE_ERROR_MAX + 64];
    if (thr || !(td->noise_scale > 0)) batches = 1;
    if (tune_rank_search(ctx, m, td, batches, ntrain / o->replicas, tune_keep_fixed, o, thr, &cand, &nok, &nsim, err, sizeof err) != 0)
        return fail("tuner: %s", err);
    t1 = now_s() - t1;
    chosen = tune_rank_pick(cand, nok, TUNE_TIE, &best);
    if (chosen < 0) {
        int small = tune_rank_smallest(cand, nok);
        if (nok == 0) fail("tuner: no setting to choose from (batch %d, micro-batches of >= %d samples)", o->batch, td->min_micro);
        else fail("tuner: no setting fits --mem-limit %.0f bytes (%.2f MiB) per rank: the smallest, %s with M = %d, N = %d, "
                  "needs %.0f bytes (%.2f MiB); raise the limit or lower --batch or --hidden", o->mem_limit,
                  o->mem_limit / (1024.0 * 1024.0), avgpipe_sched_kind_name(cand[small].c.sched.kind), cand[small].c.sched.micro,
                  cand[small].c.sched.pipes, cand[small].c.peak_bytes, cand[small].c.peak_bytes / (1024.0 * 1024.0));
        free(cand);
        return -1;
    }
    fprintf(stderr, PROG ": tuner: %d settings simulated in %.2f s (N %s %d, ", nsim, t1, o->pipes == AUTO ? "<=" : "=", td->max_pipes);
    if (o->micro == AUTO) fprintf(stderr, "micro-batches >= %d samples", td->min_micro);
    else fprintf(stderr, "M = %d", o->micro);
    if (batches > 1) fprintf(stderr, ", batches of %d to %d samples", td->batch, td->batch * batches);
    fprintf(stderr, "%s); predicted, %s first, the best setting of each batch, M and N", o->mem_limit > 0 ? ", within --mem-limit" : "",
            o->objective == AVGPIPE_TUNE_THROUGHPUT ? "fastest" : "soonest to target");
    if (td->noise_scale > 0)
        fprintf(stderr, " (eff: epochs to a target relative to a batch far below the noise scale, %.0f samples;\n"
                        "     to target: seconds per such epoch)", td->noise_scale);
    fprintf(stderr, ":\n     schedule batch   M   N    K rounds       mb  samples/s    eff to target  peak MiB\n");
    for (i = 0; i < nok && (shown < TUNE_SHOW || i <= chosen); i++) {
        int j, dup = 0; /* one line per (batch, M, N): the schedules, K and round modes of one are often tied */
        for (j = 0; j < i && !dup; j++)
            dup = cand[j].batch == cand[i].batch && cand[j].c.sched.micro == cand[i].c.sched.micro && cand[j].c.sched.pipes == cand[i].c.sched.pipes;
        if (i == chosen || (!dup && shown < TUNE_SHOW)) {
            if (i == chosen && shown >= TUNE_SHOW) fprintf(stderr, "     ...\n");
            print_candidate(&cand[i].c, cand[i].batch, i == chosen);
            shown++;
        }
    }
    o->schedule = cand[chosen].c.sched.kind;
    o->micro = cand[chosen].c.sched.micro;
    o->pipes = cand[chosen].c.sched.pipes;
    o->continuous = cand[chosen].c.sched.continuous;
    o->advance = o->schedule == AVGPIPE_SCHED_ADVANCE ? cand[chosen].c.sched.advance : ADVANCE_AUTO;
    o->chunks = 1;
    o->batch = cand[chosen].batch;
    fprintf(stderr, PROG ": tuner: chose %s, batch %d, M = %d, N = %d", avgpipe_sched_kind_name(o->schedule), o->batch, o->micro, o->pipes);
    if (o->schedule == AVGPIPE_SCHED_ADVANCE) fprintf(stderr, ", K = %d", o->advance);
    fprintf(stderr, ", %s rounds: predicted %.0f samples/s", round_mode(o->continuous), 1.0 / cand[chosen].c.time_per_sample);
    if (td->noise_scale > 0)
        fprintf(stderr, ", efficiency %.2f: %.2f s per epoch of ideal progress", cand[chosen].c.efficiency, cand[chosen].c.time_to_target);
    fprintf(stderr, ", %.2f MiB per rank", cand[chosen].c.peak_bytes / (1024.0 * 1024.0));
    if (chosen != best) fprintf(stderr, " (of the ties within %.1f%%: fewest pipelines, least memory)", 100 * TUNE_TIE);
    fprintf(stderr, "; tuning took %.2f s\n", now_s() - t0);
    free(cand);
    return 0;
}

/* ---- 3. Training progress --------------------------------------------------------------------------- */

typedef struct epoch_stats {
    double seconds, loss, bubble_time; /* bubble_time: sum of bubble * seconds */
    double acc;                        /* fashion_mnist --target-acc: the last test accuracy measured in the epoch (-1: none) */
    long long micro_batches, samples, correct;
    int advance;
} epoch_stats;

/* A progress bar redrawn in place on a terminal; to a file or a pipe, one line per epoch. Only the process
   that prints (me <= 0: rank 0, or threads). */
static void progress(const options *o, int me, int epoch, double frac, const epoch_stats *s, int done) {
    char bar[21];
    int i, filled = (int)(frac * 20 + 0.5), tty = isatty(fileno(stderr));
    if (me > 0 || (!tty && !done)) return;
    for (i = 0; i < 20; i++) bar[i] = i < filled ? '#' : '.';
    bar[20] = '\0';
    fprintf(stderr, "%sepoch %d/%d [%s] %3.0f%%  loss %.4f  train acc %.4f  %.0f samples/s  bubble %4.1f%%  K %d%s", tty ? "\r" : "",
            epoch + 1, o->epochs, bar, 100 * frac, s->micro_batches ? s->loss / (double)s->micro_batches : 0.0,
            s->samples ? (double)s->correct / (double)s->samples : 0.0, s->seconds > 0 ? s->samples / s->seconds : 0.0,
            s->seconds > 0 ? 100 * s->bubble_time / s->seconds : 0.0, s->advance, done ? "" : "   ");
    fflush(stderr);
}

/* A failed iteration, on a line of its own (after the progress bar). */
static int iteration_failed(int me, int64_t it, int epoch, avgpipe_result r, avgpipe_context *ctx) {
    if (me >= 0) fprintf(stderr, "\n" PROG " (rank %d): iteration %lld of epoch %d: %s: %s\n", me, (long long)it, epoch + 1,
                         avgpipe_result_string(r), avgpipe_last_error(ctx));
    else fprintf(stderr, "\n" PROG ": iteration %lld of epoch %d: %s: %s\n", (long long)it, epoch + 1, avgpipe_result_string(r),
                 avgpipe_last_error(ctx));
    return -1;
}

/* --checkpoint DIR: save (collective), creating DIR on first use. */
static int checkpoint(const options *o, avgpipe_run *run, avgpipe_context *ctx) {
    if (!o->checkpoint) return 0;
    if (mkdir(o->checkpoint, 0777) != 0 && errno != EEXIST) return fail("--checkpoint %s: %s", o->checkpoint, strerror(errno));
    if (avgpipe_run_save(run, o->checkpoint) != AVGPIPE_OK) return fail("--checkpoint %s: %s", o->checkpoint, avgpipe_last_error(ctx));
    return 0;
}

#endif /* MLP_APP_H */
