/* gpt.c — avgpipe's main job: a GPT-2-style byte-level decoder (examples/gpt_model.h: token and position
   embeddings, L pre-norm blocks, final LayerNorm, the LM head tied to the token embedding; sgemm through
   OpenBLAS) trained on the Debian `fortunes` corpus by N parallel pipelines of G stage partitions, with
   elastic averaging of the N models after every round.

   What runs where. Each rank is a stage thread of this process (OpenBLAS single-threaded inside it), or,
   with --backend mpi, one MPI process (avgpipe_mpi.h; mpirun -np <replicas x ranks>). The model's L + 2
   layers (embedding, blocks, head) are cut into G contiguous partitions; by default the tuner picks the
   cut (--split auto), the schedule, M, N, K and (without --batch) a batch of 1x, 2x or 4x from a short
   profiled run, as examples/fashion_mnist.c does, ranked by the predicted time to a target loss: windows/s
   x the efficiency 1 + N x batch / B_noise of the gradient noise scale (TUNE_NOISE_RATIO: measured for this
   model, not in the run).
   The two copies of the token embedding (partition 0's input table and the last partition's LM head) are
   one parameter for the runtime: desc.ties sums their gradients each round (a + b in both), so they stay
   bit-identical. Global-norm clipping (1.0) is the runtime's step agreement: desc.agree.clip_norm, with
   the scale handed to cb.step_agreed, and a non-finite gradient anywhere skips the pipeline's step on
   every partition (agree.skip_nonfinite). AdamW with linear warm-up and cosine decay (gpt_lr, gpt_adamw).

   Data. Each fortune is a document: byte 0, its bytes, byte 0 (examples/gpt_model.h, DATA). Document i goes
   to validation when i % 20 == 19: a fixed split. Sequences are NOT packed: each row of a micro-batch is
   one window of one document (at most --seq targets; longer documents are cut into windows), padded on
   the right to the micro-batch's longest row, and the padding is masked out of the loss (a padded
   position contributes an exact zero to every gradient). Windows are bucketed by length before they are
   cut into micro-batches, so little is padded: the header line prints the measured waste (0.00-0.02% of
   the positions on the default model, by micro-batch size). Tokens counted in tokens/s are non-padding positions.
   Micro-batches are of variable shape (rows x T, T the longest row): desc.variable_bytes, each forward sets
   op->output_bytes (each backward op->grad_input_bytes) to rows x T x C floats and the next partition checks
   op->input_bytes against its own cut of the micro-batch; act_bytes is the maximum, B x --seq x C.
   Batch `step` of the run (0-based) is gpt_data_micro's pure function of (seed, step, micro-batch):
   pipeline p of replica group d takes batch (round D + d) N + p at each round, so one pipeline trains on
   batches 0, 1, 2, ... as examples/gpt_reference.c does.

   --steps K counts batches (of --batch windows) over the whole run: each of the N x D models takes K /
   (N D) optimizer steps (rounded up to whole iterations of --rounds rounds), so the data seen, and the
   time, do not grow with N. Its learning rate follows its own steps.

   The same bits as the plain loop. `gpt --deterministic --pipes 1 --micro M --split LIST --save A` and
   `gpt_reference --micro M --split LIST --save B` (same model, batch, steps, seed) write cmp-identical
   files, for every schedule kind and both backends (tests/gpt_cmp_test.sh): both sum each partition's
   gradients in micro-batch order, tie them with one float addition, and take the norm with avgpipe.h's
   exact helpers (avgpipe_grad_sumsq, avgpipe_agree_combine, avgpipe_clip_scale). With one pipeline the
   averaging pull defaults to 0 (there is no other model to average with; --alpha sets it).

   Figures (2 vCPUs, Xeon with AVX-512, OpenBLAS SkylakeX kernel; sh bench/bench_gpt.sh): the default run
   tunes in 7 s (ZB-H1, M = 4 of 4 windows, N = 1, split 3,3), trains 2,000 steps (1.72M tokens) in 162 s at
   10.7k tokens/s (bubble 21%) and ends at 2.72 bits per byte on the validation windows, about 3.5 minutes in
   all with the build (the target was 2.5: 3,600 steps gave 2.55). Tokens/s, medians of 3 alternating runs of
   300 steps (2026-12-03): this program tuned 11.0k, gpt_reference on one thread 7.3k (1.51x), with --threads 2
   12.0k (0.91x).

   Build: meson (build/gpt; -DGPT_MPI with MPI), or
          gcc -std=c11 -O2 -fno-math-errno -I. examples/gpt.c -o gpt -lopenblas -lm -pthread
   Run:   build/gpt                                   (2 stages; split, schedule, M, N, K from the tuner)
          build/gpt --micro 4 --pipes 1 --split 3,3   (no tuner: advance forward with the runtime's adaptive K)
          mpirun -np 2 build/gpt --backend mpi        (one rank per process)         (--help lists all)

   Callback mapping (avgpipe_op_ctx -> gpt_model.h):
     forward   gpt_data_micro(step of (replica, pipe, round), micro) into the stage's gpt_micro (stage 0
               reads the tokens, the head the targets and mask, the others only rows and T), then
               gpt_forward(partition, params, mb, input, output, stash[stage][slot]); the head sets op->loss.
     backward  gpt_backward(..., grad_output, grad_input, grads[model][stage], work, tokens of the batch)
     I / W     gpt_backward_input / gpt_backward_weight (ZB-H1, ZB-V: B is exactly I then W)
     step      cb.step_agreed: AdamW with st->scale (the clip), nothing but zeroing with st->skip. */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#ifdef GPT_MPI
#include "avgpipe_mpi.h"
#endif
#include "examples/gpt_model.h"
#define BLAS_KERNEL_IMPLEMENTATION
#include "examples/blas_kernel.h"
#include "examples/tune_rank.h" /* the candidates of every batch searched, and the choice among them */

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

void openblas_set_num_threads(int num_threads); /* also in OpenBLAS's cblas.h; not in netlib's */

#define PROG "gpt"
#define AUTO 0              /* --micro auto, --pipes auto */
#define ADVANCE_AUTO (-1)   /* --advance auto */
#define MAX_REPLICAS 8
#define EVAL_ROWS 8         /* rows of a validation micro-batch, whatever M: the same bits per byte for every setting */
#define EVAL_SUBSET 60      /* validation micro-batches of the evaluations during training */
#define TUNE_WARMUP 1       /* profile iterations before the timed ones */
#define TUNE_PROFILED 3     /* timed iterations per micro-batch size */
#define TUNE_MAX_PIPES 4
#define TUNE_MIN_ROWS 2     /* the smallest micro-batch the tuner considers, in windows */
#define TUNE_TIE 0.005      /* settings predicted within 0.5% of the best are ties: fewer pipelines win */
/* The default gradient noise scale, in windows, for ranking by time to target (--noise-scale): the value
   that explains what bench_gpt_converge measured for the default model at --lr 3e-3 (2026-12-03: tokens to
   3.80 bits per byte with batch 16 windows 0.14M, with batch 32 0.20M, with batch 64 0.32M: ratios 1.43 and
   2.29, which avgpipe_tune_noise_from_ratio turns into 21.2 and 21.2 windows; N = 2 and N = 4 pipelines of
   16 give 28 and 9), so the tuner's efficiency 1 + N x batch / B_noise reproduces it. Not measured in the
   run: on this model a probe's estimates moved by 10x between neighbouring points of one run (gradient
   norms at 64 and 200 steps: raw 21 to 954 windows, preconditioned by AdamW's moments 16 or not
   measurable; loss decrease of 32 batches of 16 against 16 of 32 from one state: 73 to 513 windows at the
   end of the warm-up over 3 seeds, 15 to 16,000 later, where 32 steps of progress are within the loss's
   own noise), while fashion_mnist's gradient-norm probe is steady enough to use. */
#define TUNE_NOISE_BATCH 16    /* the measurement: batch 2 x TUNE_NOISE_BATCH windows took TUNE_NOISE_RATIO */
#define TUNE_NOISE_RATIO 1.43  /* times the tokens of TUNE_NOISE_BATCH to the same loss */
#define TUNE_BATCHES 4 /* with --batch not given, the tuner also tries batches of 2x and 4x (tune_choose) */
#define TUNE_SHOW 5
#define LSAMP_CAP 4096      /* per-layer times kept per (size, layer, kind) */

/* ---- Options ------------------------------------------------------------------------------------------ */

typedef struct options {
    gpt_config cfg;                  /* C, L, H, Tmax (B follows from batch / micro) */
    int stages, chunks, micro, pipes, batch, rounds, replicas, advance, continuous;
    int schedule_set, sync_set, alpha_set, split_given, split_planned, deterministic, procs;
    int batch_set, objective, objective_set; /* --batch given; --objective (avgpipe_tune_objective), given */
    avgpipe_sched_kind schedule;
    int split[GPT_MAX_PARTS], nsplit; /* --split LIST: layers per partition; nsplit 0: auto */
    long steps, warmup, stop_after, log_every, eval_every;
    int checkpoint_every, sample_len;
    double lr, wd, clip, alpha, temperature, mem_limit;
    double noise_scale;              /* --noise-scale: B_noise in windows (-1: the default, TUNE_NOISE_RATIO's) */
    unsigned long long seed;
    const char *data, *save, *trace, *profile, *profile_tune, *checkpoint, *resume;
} options;

static const char usage[] =
    "usage: " PROG " [options]\n"
    "Model (examples/gpt_model.h):\n"
    "  --layers L          transformer blocks (default 4)\n"
    "  --channels C        embedding width (default 128)\n"
    "  --heads H           attention heads, a divisor of C (default 4)\n"
    "  --seq T             context: the longest window, the rows of wpe (default 64)\n"
    "Training:\n"
    "  --steps K           batches over the run (default 2000); each of the N x D models takes K / (N D)\n"
    "                      steps, rounded up to whole iterations\n"
    "  --batch B           windows per batch per pipeline, a multiple of --micro (default 16)\n"
    "  --lr LR             peak learning rate (default 3e-3)\n"
    "  --warmup W          linear warm-up steps (default 100), then cosine decay to lr / 10\n"
    "  --wd WD             AdamW weight decay of the 2-D tensors (default 0.1)\n"
    "  --clip C            global gradient-norm clip, the runtime's step agreement (default 1.0; 0: none)\n"
    "  --seed S            weights and batch order (default 1)\n"
    "  --data DIR          fortunes corpus (default /usr/share/games/fortunes: apt-get install fortunes)\n"
    "Pipelines:\n"
    "  --stages G          stage partitions of the model's L + 2 layers (default 2)\n"
    "  --split auto|LIST   layers per partition, e.g. 3,3 (default auto: the tuner's partitioner)\n"
    "  --schedule KIND     afab | 1f1b | advance | interleaved | zbh1 | zbv | dualpipev (default advance;\n"
    "                      with --micro or --pipes auto the tuner's pick among afab, 1f1b, advance, zbh1,\n"
    "                      or only KIND); zbv and dualpipev hold two partitions per rank (ranks = G / 2)\n"
    "  --micro M|auto      micro-batches per batch (default auto: the tuner picks M, >= 2 windows each)\n"
    "  --pipes N|auto      parallel pipelines = parallel models (default auto: the tuner picks 1..4)\n"
    "  --advance K|auto    advance forwards (advance only; default auto: adaptive K with M and N fixed,\n"
    "                      the tuner's K otherwise)\n"
    "  --chunks V          partitions per rank (interleaved only; default 2; ranks = G / V)\n"
    "  --rounds R          rounds per runtime iteration (default 8)\n"
    "  --sync              synchronous rounds (default: continuous, or the tuner's pick)\n"
    "  --alpha A           elasticity in [0, 1] (default 0.1 with N >= 2; 0 with one pipeline)\n"
    "  --replicas D        replica groups, their reference models averaged every round (default 1)\n"
    "  --backend B         threads (default) | mpi (one rank per process: mpirun -np <D x ranks> " PROG " ...)\n"
    "  --deterministic     every averaging waits for the previous round's reference (reproducible)\n"
    "  --mem-limit SIZE    tuner: bytes per rank, suffix K, M or G (default: no limit)\n"
    "  --profile-tune FILE tuner: keep its profile (default: a temporary file, removed)\n"
    "  --objective OBJ     tuner: time (to a target loss; default) | throughput (windows/s alone)\n"
    "  --noise-scale W     tuner: the gradient noise scale in windows (default 21: measured for the default\n"
    "                      model and --lr; 0: rank by windows/s)\n"
    "Output:\n"
    "  --log-every K       a progress line every K steps (default 250)\n"
    "  --eval-every K      validation loss every K steps on 60 validation micro-batches (default 1000; 0: only\n"
    "                      at the end, on all of them)\n"
    "  --sample-len N      bytes of each of the 3 samples at the end (default 200; 0: none)\n"
    "  --temperature X     of the samples (default 0.8; top-k 40)\n"
    "  --save FILE         write the reference model (gpt_save: the same bytes for any partitioning)\n"
    "  --trace FILE.json   Chrome trace of the last iteration; with --backend mpi rank R writes FILE.R\n"
    "  --profile FILE      per-op profile of the last iteration (the tuner's input); mpi: as --trace\n"
    "  --checkpoint DIR    save a checkpoint there at the end and every --checkpoint-every K iterations\n"
    "  --checkpoint-every K\n"
    "  --resume DIR        continue from the checkpoint in DIR (give the flags it was made with; with the\n"
    "                      tuner, fix --micro, --pipes, --split and --batch: it might choose otherwise)\n"
    "  --stop-after K      stop after K of the --steps batches (rounded up to a whole iteration)\n";
static const char usage_tuning[] =
    "Tuning (--micro auto or --pipes auto, the default; or --split auto with a split to choose): the model is\n"
    "profiled for a few iterations of 1 pipeline at two micro-batch sizes (and of 2 pipelines at one) on\n"
    "throwaway weights, every layer timed; the tuner fits its cost model, the partitioner picks the split,\n"
    "and every setting (schedule, M, N <= 4, K, round mode; without --batch also 2x and 4x the batch, N x batch\n"
    "<= 4x, --steps then counting the larger batches: the same windows) is simulated and ranked by its time to\n"
    "target (--objective); what the command line fixes stays fixed. Its report goes to stderr.\n";

static int g_rank = -1; /* one rank per process: this process's rank, for messages */

/* Print "gpt: <message>" ("gpt (rank R): " with one rank per process) on stderr; returns -1. */
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

/* An integer flag value in [lo, hi], or a bad command line. */
static long parse_long(const char *flag, const char *s, long lo, long hi) {
    char *end;
    long v;
    errno = 0;
    v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) bad_usage("%s expects an integer in [%ld, %ld], got '%s'", flag, lo, hi, s);
    return v;
}

/* A number flag value in [lo, hi] (NaN refused), or a bad command line. */
static double parse_double(const char *flag, const char *s, double lo, double hi) {
    char *end;
    double v;
    errno = 0;
    v = strtod(s, &end);
    if (end == s || *end || errno || !(v >= lo && v <= hi)) bad_usage("%s expects a number in [%g, %g], got '%s'", flag, lo, hi, s);
    return v;
}

/* A size in bytes with an optional binary suffix K, M or G. */
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

/* --micro auto or --pipes auto: the tuner picks the setting. */
static int tuning(const options *o) { return o->micro == AUTO || o->pipes == AUTO; }
/* The kinds that hold two partitions per rank in a V (rank r: partitions r and 2S - 1 - r). */
static int v_placed(avgpipe_sched_kind k) { return avgpipe_sched_kind_query(k)->placement == AVGPIPE_PLACE_V; }

/* Contiguous splits of the L + 2 layers into G partitions: C(L + 1, G - 1). */
static double split_count(const options *o) {
    double c = 1;
    int i, n = o->cfg.L + 1, k = o->stages - 1;
    for (i = 1; i <= k; i++) c = c * (n - k + i) / i;
    return c;
}

/* --split auto with a choice to make: the partitioner picks it from the profile's layer costs (not for the
   schedules with several partitions per rank: the profile runs hold one per rank). */
static int planning(const options *o) {
    return o->nsplit == 0 && avgpipe_sched_kind_query(o->schedule)->chunks == 1 && split_count(o) > 1;
}

/* The tuner's profile runs happen (a setting or a split to choose). */
static int profiles(const options *o) { return tuning(o) || planning(o); }

/* Create (and leave empty) every output file now, so that a bad path fails before the training. */
static void check_output(const char *flag, const char *path) {
    FILE *f;
    if (!path) return;
    errno = 0;
    if (!(f = fopen(path, "wb"))) bad_usage("%s %s: cannot create: %s", flag, path, strerror(errno));
    fclose(f);
}

/* What rank `me` writes for FILE: FILE itself for rank 0 (and with threads, me < 0), FILE.me for the others. */
static const char *rank_path(int me, const char *path, char *buf, size_t cap) {
    if (!path || me <= 0) return path;
    snprintf(buf, cap, "%s.%d", path, me);
    return buf;
}

/* Every output file of the process of rank `me` (threads: me < 0, all of them). */
static void check_outputs(const options *o, int me) {
    char b1[4096], b2[4096];
    check_output("--trace", rank_path(me, o->trace, b1, sizeof b1));
    check_output("--profile", rank_path(me, o->profile, b2, sizeof b2));
    if (me <= 0) check_output("--save", o->save), check_output("--profile-tune", o->profile_tune);
}

/* The defaults: the model, batch and steps of a 2-3 minute run on 2 cores, the tuner for the rest. */
static void defaults(options *o) {
    memset(o, 0, sizeof *o);
    o->cfg.L = 4, o->cfg.C = 128, o->cfg.H = 4, o->cfg.Tmax = 64;
    o->stages = 2, o->micro = AUTO, o->pipes = AUTO, o->batch = 16, o->rounds = 8, o->replicas = 1, o->advance = ADVANCE_AUTO;
    o->continuous = 1, o->schedule = AVGPIPE_SCHED_ADVANCE, o->alpha = 0.1, o->seed = 1;
    o->steps = 2000, o->warmup = 100, o->lr = 3e-3, o->wd = 0.1, o->clip = 1.0, o->temperature = 0.8, o->sample_len = 200;
    o->log_every = 250, o->eval_every = 1000, o->noise_scale = -1;
    o->data = "/usr/share/games/fortunes";
}

static const char *const value_flags[] = {
    "--layers", "--channels", "--heads", "--seq", "--steps", "--batch", "--lr", "--warmup", "--wd", "--clip", "--seed", "--data",
    "--stages", "--split", "--schedule", "--micro", "--pipes", "--advance", "--chunks", "--rounds", "--alpha", "--replicas",
    "--backend", "--mem-limit", "--profile-tune", "--log-every", "--eval-every", "--sample-len", "--temperature", "--save",
    "--trace", "--profile", "--checkpoint", "--checkpoint-every", "--resume", "--stop-after", "--objective", "--noise-scale", NULL};

/* One flag of value_flags with its value; *advance_flag keeps --advance's text for the checks. */
static void set_value(options *o, const char *f, const char *v, const char **advance_flag) {
    char err[256];
    if (!strcmp(f, "--layers")) o->cfg.L = (int)parse_long(f, v, 0, GPT_MAX_BLOCKS);
    else if (!strcmp(f, "--channels")) o->cfg.C = (int)parse_long(f, v, 1, 16384);
    else if (!strcmp(f, "--heads")) o->cfg.H = (int)parse_long(f, v, 1, 16384);
    else if (!strcmp(f, "--seq")) o->cfg.Tmax = (int)parse_long(f, v, 1, 4096);
    else if (!strcmp(f, "--steps")) o->steps = parse_long(f, v, 1, 100000000L);
    else if (!strcmp(f, "--batch")) o->batch = (int)parse_long(f, v, 1, 65536), o->batch_set = 1;
    else if (!strcmp(f, "--lr")) o->lr = parse_double(f, v, 1e-9, 10);
    else if (!strcmp(f, "--warmup")) o->warmup = parse_long(f, v, 0, 100000000L);
    else if (!strcmp(f, "--wd")) o->wd = parse_double(f, v, 0, 10);
    else if (!strcmp(f, "--clip")) o->clip = parse_double(f, v, 0, 1e9);
    else if (!strcmp(f, "--seed")) o->seed = (unsigned long long)parse_long(f, v, 0, 2147483647L);
    else if (!strcmp(f, "--data")) o->data = v;
    else if (!strcmp(f, "--stages")) o->stages = (int)parse_long(f, v, 1, GPT_MAX_PARTS);
    else if (!strcmp(f, "--split")) {
        o->nsplit = 0, o->split_given = 0;
        if (strcmp(v, "auto") && gpt_split_parse(v, o->split, GPT_MAX_PARTS, &o->nsplit, err, sizeof err)) bad_usage("--split: %s", err);
        o->split_given = o->nsplit > 0;
    } else if (!strcmp(f, "--schedule")) {
        if (avgpipe_sched_kind_parse(v, &o->schedule) != AVGPIPE_OK || o->schedule == AVGPIPE_SCHED_CUSTOM)
            bad_usage("--schedule expects afab, 1f1b, advance, interleaved, zbh1, zbv or dualpipev, got '%s'", v);
        o->schedule_set = 1;
    } else if (!strcmp(f, "--micro")) o->micro = !strcmp(v, "auto") ? AUTO : (int)parse_long(f, v, 1, 65536);
    else if (!strcmp(f, "--pipes")) o->pipes = !strcmp(v, "auto") ? AUTO : (int)parse_long(f, v, 1, 256);
    else if (!strcmp(f, "--advance")) o->advance = !strcmp(v, "auto") ? ADVANCE_AUTO : (int)parse_long(f, v, 0, 4096), *advance_flag = v;
    else if (!strcmp(f, "--chunks")) o->chunks = (int)parse_long(f, v, 1, GPT_MAX_PARTS);
    else if (!strcmp(f, "--rounds")) o->rounds = (int)parse_long(f, v, 1, 100000);
    else if (!strcmp(f, "--alpha")) o->alpha = parse_double(f, v, 0, 1), o->alpha_set = 1;
    else if (!strcmp(f, "--replicas")) o->replicas = (int)parse_long(f, v, 1, MAX_REPLICAS);
    else if (!strcmp(f, "--backend")) {
        if (strcmp(v, "threads") && strcmp(v, "mpi")) bad_usage("--backend expects threads or mpi, got '%s'", v);
        o->procs = !strcmp(v, "mpi");
#ifndef GPT_MPI
        if (o->procs) bad_usage("--backend mpi: this build has no MPI (install libopenmpi-dev and rebuild)");
#endif
    } else if (!strcmp(f, "--mem-limit")) o->mem_limit = parse_size(f, v);
    else if (!strcmp(f, "--profile-tune")) o->profile_tune = v;
    else if (!strcmp(f, "--log-every")) o->log_every = parse_long(f, v, 1, 100000000L);
    else if (!strcmp(f, "--eval-every")) o->eval_every = parse_long(f, v, 0, 100000000L);
    else if (!strcmp(f, "--sample-len")) o->sample_len = (int)parse_long(f, v, 0, 1 << 20);
    else if (!strcmp(f, "--temperature")) o->temperature = parse_double(f, v, 0, 100);
    else if (!strcmp(f, "--save")) o->save = v;
    else if (!strcmp(f, "--trace")) o->trace = v;
    else if (!strcmp(f, "--profile")) o->profile = v;
    else if (!strcmp(f, "--checkpoint")) o->checkpoint = v;
    else if (!strcmp(f, "--checkpoint-every")) o->checkpoint_every = (int)parse_long(f, v, 1, 1 << 30);
    else if (!strcmp(f, "--resume")) o->resume = v;
    else if (!strcmp(f, "--stop-after")) o->stop_after = parse_long(f, v, 1, 100000000L);
    else if (!strcmp(f, "--objective")) {
        if (!strcmp(v, "time")) o->objective = AVGPIPE_TUNE_TIME_TO_TARGET;
        else if (!strcmp(v, "throughput")) o->objective = AVGPIPE_TUNE_THROUGHPUT;
        else bad_usage("--objective expects time or throughput, got '%s'", v);
        o->objective_set = 1;
    } else if (!strcmp(f, "--noise-scale")) o->noise_scale = parse_double(f, v, 0, 1e12);
}

/* The checks across flags; sets the chunks per rank. */
static void check_options(options *o, const char *advance_flag) {
    const avgpipe_sched_kind_info *k = avgpipe_sched_kind_query(o->schedule);
    int interleaved = k->chunks == 0, ranks, s, total = 0;
    char err[256];
    gpt_config c = o->cfg;
    c.B = 1;
    if (gpt_config_check(&c, err, sizeof err)) bad_usage("%s", err);
    if (o->micro != AUTO && o->batch % o->micro) bad_usage("--batch %d is not a multiple of --micro %d", o->batch, o->micro);
    if (o->stages > o->cfg.L + 2) bad_usage("--stages %d: the model has %d layers (embedding, %d blocks, head)", o->stages, o->cfg.L + 2, o->cfg.L);
    if (o->nsplit && o->nsplit != o->stages) bad_usage("--split: %d stage partitions listed, --stages is %d", o->nsplit, o->stages);
    for (s = 0; s < o->nsplit; s++) total += o->split[s];
    if (o->nsplit && total != o->cfg.L + 2)
        bad_usage("--split adds up to %d layers; the model has %d (embedding, %d blocks, head)", total, o->cfg.L + 2, o->cfg.L);
    if (tuning(o) && (interleaved || k->chunks > 1))
        bad_usage("--schedule %s needs fixed --micro and --pipes (the tuner profiles one partition per rank)", k->name);
    if (tuning(o) && advance_flag && strcmp(advance_flag, "auto"))
        bad_usage("--advance %s needs fixed --micro and --pipes (with --micro or --pipes auto the tuner picks K)", advance_flag);
    if (advance_flag && strcmp(advance_flag, "auto") && o->schedule != AVGPIPE_SCHED_ADVANCE)
        bad_usage("--advance %s applies only to --schedule advance", advance_flag);
    if (o->chunks && !interleaved) bad_usage("--chunks applies only to --schedule interleaved");
    if (!profiles(o) && (o->mem_limit > 0 || o->profile_tune))
        bad_usage("%s applies only to the tuner (--micro auto or --pipes auto, or --split auto with a split to choose)",
                  o->mem_limit > 0 ? "--mem-limit" : "--profile-tune");
    if (!tuning(o) && (o->objective_set || o->noise_scale >= 0))
        bad_usage("%s applies only to the tuner (--micro auto or --pipes auto)", o->objective_set ? "--objective" : "--noise-scale");
    if (o->checkpoint_every && !o->checkpoint) bad_usage("--checkpoint-every needs --checkpoint DIR");
    if (o->stop_after > o->steps) bad_usage("--stop-after %ld is past --steps %ld", o->stop_after, o->steps);
    o->chunks = interleaved ? (o->chunks ? o->chunks : 2) : k->chunks;
    if (o->stages % o->chunks) bad_usage("--stages %d is not a multiple of %d (%s holds %d partitions per rank)", o->stages, o->chunks, k->name, o->chunks);
    ranks = o->stages / o->chunks;
    if (k->micro_pipes_per_stage && !tuning(o) && o->pipes * o->micro < k->micro_pipes_per_stage * ranks)
        bad_usage("--schedule %s needs --pipes x --micro >= %d x ranks = %d (got %d x %d)", k->name, k->micro_pipes_per_stage,
                  k->micro_pipes_per_stage * ranks, o->pipes, o->micro);
    if (interleaved && k->micro_multiple && o->chunks > 1 && o->micro != AUTO && o->micro % ranks)
        bad_usage("--schedule interleaved needs --micro a multiple of the ranks (%d), got %d", ranks, o->micro);
}

/* argv into *o: defaults, the flags in any order, the checks, and (threads) the output files created. */
static void parse_options(int argc, char **argv, options *o) {
    const char *advance_flag = NULL;
    int i, k;
    defaults(o);
    for (i = 1; i < argc; i++) {
        const char *f = argv[i];
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) fputs(usage, stdout), fputs(usage_tuning, stdout), exit(0);
        if (!strcmp(f, "--deterministic")) { o->deterministic = 1; continue; }
        if (!strcmp(f, "--sync")) { o->continuous = 0, o->sync_set = 1; continue; }
        for (k = 0; value_flags[k] && strcmp(f, value_flags[k]); k++) {}
        if (!value_flags[k]) bad_usage(strncmp(f, "--", 2) ? "unexpected argument '%s' (try --help)" : "unknown option '%s' (try --help)", f);
        if (i + 1 >= argc) bad_usage("missing value after %s", f);
        set_value(o, f, argv[++i], &advance_flag);
    }
    check_options(o, advance_flag);
    if (!o->procs) check_outputs(o, -1);
}

/* ---- The trainer's state -------------------------------------------------------------------------------- */

/* Per (replica, partition): what the stage's thread uses during a callback (one thread per rank, so one op
   of a partition at a time). */
typedef struct stage_bufs {
    float **stash;        /* [slots]: what a forward keeps for its backward */
    int slots;
    float *work;          /* gpt_backward's scratch */
    gpt_micro mb;         /* the micro-batch being loaded */
} stage_bufs;

/* Everything the callbacks reach through op->user. A model is replica * N + pipe; per-model arrays are
   indexed [model * G + partition], NULL where this process does not run the partition. */
typedef struct app {
    options opt;
    int G, S, N, D, M, B;           /* partitions, ranks per group, pipelines, groups, micro-batches, rows */
    int me, nproc;                  /* --backend mpi: this process's rank; -1 with threads */
    gpt_config cfg;                 /* opt.cfg with B rows */
    gpt_part part[GPT_MAX_PARTS];
    gpt_data data;                  /* micro-batches of B rows */
    size_t count[GPT_MAX_PARTS], act_bytes[GPT_MAX_PARTS];
    avgpipe_tie tie;                /* partition 0's wte and the last one's copy (G > 1) */
    long rounds;                    /* rounds of the run: each model's optimizer steps */
    float **params, **grads, **m, **v;
    long *updates;                  /* AdamW updates applied, per model and partition (bias correction) */
    stage_bufs *sb;                 /* [replica * G + g] */
    /* last stage's counters per replica group, read by the main thread between iterations */
    double loss_sum[MAX_REPLICAS], tokens[MAX_REPLICAS], norm[MAX_REPLICAS];
    avgpipe_comm comm;              /* --backend mpi */
    /* the tuner's per-layer profile: each layer belongs to one partition, so one thread writes its rows */
    int lprof, lsize, nlayers;
    double *lsamp;                  /* [(size * nlayers + layer) * 2 + kind][LSAMP_CAP] */
    int *nlsamp;
} app;

static blas_kernel_status g_blas;

/* Seconds on a monotonic clock. */
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The rank within a group that holds partition g: the schedule's placement. */
static int stage_rank(const app *A, int g) {
    return avgpipe_place_rank(v_placed(A->opt.schedule) ? AVGPIPE_PLACE_V : AVGPIPE_PLACE_LOOP, A->S, g);
}

/* Does this process run partition g of replica group d? (Threads, or rank 0 tuning alone: every one.) */
static int is_local(const app *A, int d, int g) { return A->me < 0 || A->me == d * A->S + stage_rank(A, g); }

/* The batch that pipeline `pipe` of group d trains on in global round `round`. */
static long data_step(const app *A, int d, int pipe, long round) { return (round * A->D + d) * A->N + pipe; }

/* calloc that never asks for 0 bytes (a NULL from it is out of memory). */
static void *xcalloc(size_t n, size_t size) { return calloc(n ? n : 1, size); }

/* The corpus cut for micro-batches of B rows (loaded again only when B changes). */
static int load_data(app *A, int B) {
    char err[512];
    if (A->data.tok && A->data.B == B) return 0;
    gpt_data_free(&A->data);
    if (gpt_data_load(&A->data, A->opt.data, A->opt.cfg.Tmax, B, A->opt.seed, err, sizeof err)) return fail("%s", err);
    return 0;
}

/* Rounds of the run for the current N and D: --steps batches over N D models, in whole iterations (--rounds
   lowered to the rounds of a run shorter than one iteration). */
static void plan_rounds(app *A) {
    options *o = &A->opt;
    long per = (long)A->N * A->D, r = (o->steps + per - 1) / per;
    if (r < o->rounds) o->rounds = (int)r;
    A->rounds = (r + o->rounds - 1) / o->rounds * o->rounds;
}

/* The state of opt's setting: partitions, data, the tie, and every local model (all from the seed, so every
   parallel model and every reference starts identical), their gradients and AdamW state, the per-partition
   buffers, the run's rounds. */
static int setup_model(app *A) {
    options *o = &A->opt;
    char err[512];
    int i, g, d, n;
    A->G = o->stages, A->S = o->stages / o->chunks, A->N = o->pipes, A->D = o->replicas, A->M = o->micro, A->B = o->batch / o->micro;
    A->cfg = o->cfg, A->cfg.B = A->B;
    if (gpt_partition(&A->cfg, A->G, o->nsplit ? o->split : NULL, A->part, err, sizeof err)) return fail("%s", err);
    if (load_data(A, A->B)) return -1;
    if (gpt_data_batches_per_epoch(&A->data, A->M) < 1)
        return fail("the corpus has %zu micro-batches of %d windows: fewer than --micro %d", A->data.nmicro, A->B, A->M);
    for (g = 0; g < A->G; g++) {
        A->count[g] = A->part[g].nparams;
        A->act_bytes[g] = gpt_act_floats(&A->cfg) * sizeof(float);
    }
    memset(&A->tie, 0, sizeof A->tie);
    if (A->G > 1) {
        A->tie.stage_a = 0, A->tie.stage_b = A->G - 1;
        A->tie.offset_a = A->part[0].wte_off, A->tie.offset_b = A->part[A->G - 1].wte_off, A->tie.count = A->part[0].wte_len;
    }
    n = A->N * A->D;
    A->params = (float **)xcalloc((size_t)n * A->G, sizeof(float *));
    A->grads = (float **)xcalloc((size_t)n * A->G, sizeof(float *));
    A->m = (float **)xcalloc((size_t)n * A->G, sizeof(float *));
    A->v = (float **)xcalloc((size_t)n * A->G, sizeof(float *));
    A->updates = (long *)xcalloc((size_t)n * A->G, sizeof(long));
    A->sb = (stage_bufs *)xcalloc((size_t)A->D * A->G, sizeof(stage_bufs));
    if (!A->params || !A->grads || !A->m || !A->v || !A->updates || !A->sb) return fail("out of memory");
    for (i = 0; i < n; i++)
        for (g = 0; g < A->G; g++) {
            size_t k = (size_t)i * A->G + g, c = A->count[g];
            if (!is_local(A, i / A->N, g)) continue;
            A->params[k] = (float *)xcalloc(c, sizeof(float)), A->grads[k] = (float *)xcalloc(c, sizeof(float));
            A->m[k] = (float *)xcalloc(c, sizeof(float)), A->v[k] = (float *)xcalloc(c, sizeof(float));
            if (!A->params[k] || !A->grads[k] || !A->m[k] || !A->v[k]) return fail("out of memory");
            gpt_init(&A->part[g], A->params[k], o->seed);
        }
    for (d = 0; d < A->D; d++)
        for (g = 0; g < A->G; g++) {
            stage_bufs *b = &A->sb[d * A->G + g];
            if (!is_local(A, d, g)) continue;
            if (!(b->work = (float *)xcalloc(gpt_part_work_floats(&A->part[g]), sizeof(float))) || gpt_micro_alloc(&b->mb, A->B, A->cfg.Tmax))
                return fail("out of memory");
        }
    memset(A->loss_sum, 0, sizeof A->loss_sum), memset(A->tokens, 0, sizeof A->tokens), memset(A->norm, 0, sizeof A->norm);
    plan_rounds(A);
    return 0;
}

/* One stash per slot the runtime reserved on each local partition; the count grows with an adaptive K, so
   this runs after every iteration too (no callback runs then). */
static int grow_stashes(app *A, const avgpipe_run *run) {
    int d, g, s, split = avgpipe_sched_kind_query(A->opt.schedule)->split; /* I and W: the larger stash */
    for (d = 0; d < A->D; d++)
        for (g = 0; g < A->G; g++) {
            stage_bufs *b = &A->sb[d * A->G + g];
            int want = avgpipe_run_slots(run, g);
            float **grown;
            if (!is_local(A, d, g) || want <= b->slots) continue;
            if (!(grown = (float **)realloc(b->stash, sizeof(float *) * (size_t)want))) return fail("out of memory");
            b->stash = grown;
            for (s = b->slots; s < want; s++)
                if (!(grown[s] = (float *)malloc(sizeof(float) * (split ? gpt_part_stash_floats_iw(&A->part[g]) : gpt_part_stash_floats(&A->part[g])))))
                    return b->slots = s, fail("out of memory");
            b->slots = want;
        }
    return 0;
}

/* Undo setup_model (the data stays). */
static void free_model(app *A) {
    int i, s, n = A->N * A->D * A->G;
    for (i = 0; A->params && i < n; i++) free(A->params[i]), free(A->grads[i]), free(A->m[i]), free(A->v[i]);
    for (i = 0; A->sb && i < A->D * A->G; i++) {
        for (s = 0; s < A->sb[i].slots; s++) free(A->sb[i].stash[s]);
        free(A->sb[i].stash), free(A->sb[i].work);
        gpt_micro_free(&A->sb[i].mb);
    }
    free(A->params), free(A->grads), free(A->m), free(A->v), free(A->updates), free(A->sb);
    A->params = A->grads = A->m = A->v = NULL, A->updates = NULL, A->sb = NULL;
}

/* ---- Stage callbacks ------------------------------------------------------------------------------------ */

/* A callback's failure, on a line of its own naming the op; returns 1 (the runtime stops every rank). */
static int op_failed(const avgpipe_op_ctx *op, const char *what) {
    fprintf(stderr, "\n" PROG ": %s (replica %d, pipeline %d, partition %d, round %d, micro-batch %d)\n", what, op->replica, op->pipe, op->stage,
            op->round, op->micro);
    return 1;
}

/* The buffers of op's (replica, partition) and in *stash its slot's stash; NULL for an op outside the run. */
static stage_bufs *op_bufs(app *A, const avgpipe_op_ctx *op, float **stash) {
    stage_bufs *b;
    if (op->stage < 0 || op->stage >= A->G || op->replica < 0 || op->replica >= A->D || op->pipe < 0 || op->pipe >= A->N) return NULL;
    b = &A->sb[op->replica * A->G + op->stage];
    if (op->slot < 0 || op->slot >= b->slots) return NULL;
    *stash = b->stash[op->slot];
    return b;
}

/* The tuner's profile runs: an op's time split over its partition's layers. What the layers' own clocks do
   not cover (loading the micro-batch, copies) goes to the first layer on partition 0's forward, else to
   the last one, so that a partition's layers add up to its op. */
static void record_layers(app *A, int g, int kind, double total, const double *sec) {
    int first = A->part[g].lo, n = A->part[g].hi - first, k;
    double x[GPT_MAX_PARTS], sum = 0;
    for (k = 0; k < n; k++) sum += x[k] = sec[k];
    if (total > sum) x[g == 0 && kind == 0 ? 0 : n - 1] += total - sum;
    for (k = 0; k < n; k++) {
        size_t row = ((size_t)A->lsize * A->nlayers + (size_t)(first + k)) * 2 + (size_t)kind;
        if (A->nlsamp[row] < LSAMP_CAP) A->lsamp[row * LSAMP_CAP + (size_t)A->nlsamp[row]++] = x[k];
    }
}

/* The bytes of a boundary's activation (and gradient) for a micro-batch of rows x T positions: what moves
   between partitions (desc.variable_bytes; act_bytes is the maximum, B x Tmax). */
static size_t boundary_bytes(const app *A, double rows, double T) { return (size_t)rows * (size_t)T * (size_t)A->cfg.C * sizeof(float); }

/* The sizes a consumer was handed against its micro-batch's shape; 0 when they agree. */
static int sizes_wrong(const avgpipe_op_ctx *op, size_t want, int backward) {
    if (op->stage > 0 && op->input_bytes != want) return op_failed(op, "the activation received is not of the micro-batch's size");
    if (backward && op->grad_output && op->grad_output_bytes != want) return op_failed(op, "the gradient received is not of the micro-batch's size");
    return 0;
}

/* F: cut the op's micro-batch, run the partition's layers; the head reports the loss per token and counts. */
static int cb_forward(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    float *stash;
    stage_bufs *b = op_bufs(A, op, &stash);
    double loss = 0, sec[GPT_MAX_PARTS], t0 = A->lprof ? now_s() : 0;
    const gpt_part *p;
    if (!b) return op_failed(op, "an op outside the model's replicas, pipelines, partitions or slots");
    p = &A->part[op->stage];
    if (gpt_data_micro(&A->data, data_step(A, op->replica, op->pipe, op->round), op->micro, A->M, &b->mb))
        return op_failed(op, "cannot cut the micro-batch");
    if (sizes_wrong(op, boundary_bytes(A, b->mb.rows, b->mb.T), 0)) return 1;
    if (op->output) op->output_bytes = boundary_bytes(A, b->mb.rows, b->mb.T); /* only the micro-batch's rows x T move */
    if (gpt_forward_timed(p, op->params, &b->mb, (const float *)op->input, (float *)op->output, stash, &loss, A->lprof ? sec : NULL))
        return op_failed(op, "forward failed");
    if (p->has_head) {
        op->loss = loss / b->mb.ntok;
        A->loss_sum[op->replica] += loss, A->tokens[op->replica] += b->mb.ntok;
    }
    if (A->lprof) record_layers(A, op->stage, 0, now_s() - t0, sec);
    return 0;
}

/* The split backward (ZB-H1, ZB-V): I writes the input gradient and keeps what W needs in the stash; W adds
   the weight gradients (the same bits as cb_backward; the stashes are gpt_part_stash_floats_iw then). */
static int cb_backward_input(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    float *stash;
    stage_bufs *b = op_bufs(A, op, &stash);
    if (!b) return op_failed(op, "an op outside the model's replicas, pipelines, partitions or slots");
    if (sizes_wrong(op, boundary_bytes(A, stash[0], stash[1]), 1)) return 1; /* the forward's shape, from the stash */
    if (op->grad_input) op->grad_input_bytes = boundary_bytes(A, stash[0], stash[1]);
    if (gpt_backward_input(&A->part[op->stage], op->params, stash, (const float *)op->grad_output, (float *)op->grad_input, b->work,
                           gpt_data_batch_tokens(&A->data, data_step(A, op->replica, op->pipe, op->round), A->M)))
        return op_failed(op, "backward to the input (I) failed");
    return 0;
}

/* W: the weight half, from what I kept in the stash. */
static int cb_backward_weight(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    float *stash;
    if (!op_bufs(A, op, &stash)) return op_failed(op, "an op outside the model's replicas, pipelines, partitions or slots");
    if (gpt_backward_weight(&A->part[op->stage], A->grads[(op->replica * A->N + op->pipe) * A->G + op->stage], stash))
        return op_failed(op, "backward to the weights (W) failed");
    return 0;
}

/* B: the whole backward, gradients added to the model's (the batch's token count normalises them). */
static int cb_backward(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    float *stash;
    stage_bufs *b = op_bufs(A, op, &stash);
    double sec[GPT_MAX_PARTS], t0 = A->lprof ? now_s() : 0, weight;
    if (!b) return op_failed(op, "an op outside the model's replicas, pipelines, partitions or slots");
    if (sizes_wrong(op, boundary_bytes(A, stash[0], stash[1]), 1)) return 1;
    if (op->grad_input) op->grad_input_bytes = boundary_bytes(A, stash[0], stash[1]);
    weight = gpt_data_batch_tokens(&A->data, data_step(A, op->replica, op->pipe, op->round), A->M);
    if (gpt_backward_timed(&A->part[op->stage], op->params, A->grads[(op->replica * A->N + op->pipe) * A->G + op->stage], stash,
                           (const float *)op->grad_output, (float *)op->grad_input, b->work, weight, A->lprof ? sec : NULL))
        return op_failed(op, "backward failed");
    if (A->lprof) record_layers(A, op->stage, 1, now_s() - t0, sec);
    return 0;
}

/* AdamW on (model, partition) with the agreed clip scale; a skipped step (a non-finite gradient somewhere in
   the pipeline) only drops the gradients. The learning rate follows the model's own step (the round). */
static int cb_step(const avgpipe_step_ctx *st) {
    app *A = (app *)st->user;
    int model = st->replica * A->N + st->pipe;
    size_t k = (size_t)model * A->G + (size_t)st->stage;
    gpt_adamw_hp hp = gpt_adamw_defaults();
    if (st->pipe < 0 || st->pipe >= A->N || st->stage < 0 || st->stage >= A->G || st->replica < 0 || st->replica >= A->D || st->grads != A->grads[k])
        return fail("step of replica %d, pipeline %d, partition %d: not a model of this run", st->replica, st->pipe, st->stage), 1;
    if (!st->skip) {
        hp.weight_decay = (float)A->opt.wd;
        A->updates[k]++;
        gpt_adamw(&A->part[st->stage], st->params, st->grads, A->m[k], A->v[k], A->updates[k],
                  (float)gpt_lr(A->opt.lr, st->round, A->opt.warmup, A->rounds), (float)st->scale, &hp);
    }
    if (st->stage == 0 && st->pipe == 0) A->norm[st->replica] = sqrt(st->sumsq);
    memset(st->grads, 0, A->count[st->stage] * sizeof(float));
    return 0;
}

/* Checkpoints: what this program owns for a rank is the AdamW state (updates applied, both moments) of the
   rank's partitions of each model of its group, in ascending order. The batch order is a function of the
   seed and the round. */
static int cb_save_state(int rank, avgpipe_buf *out, void *user) {
    app *A = (app *)user;
    int i, g, d = rank / A->S;
    for (i = d * A->N; i < (d + 1) * A->N; i++)
        for (g = 0; g < A->G; g++) {
            size_t k = (size_t)i * A->G + g;
            int64_t t = A->updates[k];
            if (stage_rank(A, g) != rank % A->S) continue;
            if (avgpipe_buf_append(NULL, out, &t, sizeof t) || avgpipe_buf_append(NULL, out, A->m[k], A->count[g] * sizeof(float)) ||
                avgpipe_buf_append(NULL, out, A->v[k], A->count[g] * sizeof(float)))
                return fail("checkpoint: out of memory");
        }
    return 0;
}

/* The bytes cb_save_state wrote for `rank`, back into the AdamW state (sizes checked). */
static int cb_load_state(int rank, const void *data, size_t bytes, void *user) {
    app *A = (app *)user;
    const unsigned char *p = (const unsigned char *)data;
    int i, g, d = rank / A->S;
    for (i = d * A->N; i < (d + 1) * A->N; i++)
        for (g = 0; g < A->G; g++) {
            size_t k = (size_t)i * A->G + g, n = A->count[g] * sizeof(float);
            int64_t t;
            if (stage_rank(A, g) != rank % A->S) continue;
            if (bytes < sizeof t + 2 * n) return fail("checkpoint: rank %d's AdamW state is too short (another model shape?)", rank);
            memcpy(&t, p, sizeof t), memcpy(A->m[k], p + sizeof t, n), memcpy(A->v[k], p + sizeof t + n, n);
            A->updates[k] = (long)t;
            p += sizeof t + 2 * n, bytes -= sizeof t + 2 * n;
        }
    return bytes == 0 ? 0 : fail("checkpoint: rank %d's AdamW state is too long (other --pipes or model shape?)", rank);
}

/* ---- The run's description ------------------------------------------------------------------------------ */

/* The run: opt's schedule and shape, the callbacks, the buffers, the tie (G > 1), the agreement (clip and
   non-finite skip), the averaging, and with MPI one local rank. */
static avgpipe_run_desc make_run_desc(app *A) {
    const options *o = &A->opt;
    avgpipe_run_desc d;
    memset(&d, 0, sizeof d);
    d.sched.kind = o->schedule;
    d.sched.stages = A->S;
    d.sched.chunks = o->chunks;
    d.sched.micro = A->M;
    d.sched.pipes = A->N;
    d.sched.rounds = o->rounds;
    d.sched.continuous = o->continuous;
    d.sched.advance = o->advance == ADVANCE_AUTO ? 0 : o->advance;
    d.adaptive = o->schedule == AVGPIPE_SCHED_ADVANCE && o->advance == ADVANCE_AUTO;
    d.cb.forward = cb_forward;
    d.cb.backward = cb_backward;
    d.cb.backward_input = cb_backward_input;
    d.cb.backward_weight = cb_backward_weight;
    d.cb.step_agreed = cb_step;
    d.cb.save_state = cb_save_state;
    d.cb.load_state = cb_load_state;
    d.cb.user = A;
    d.act_bytes = A->act_bytes;
    d.params = (float *const *)A->params;
    d.grads = (float *const *)A->grads;
    d.param_count = A->count;
    d.variable_bytes = 1; /* a micro-batch's activations are rows x T x C, up to act_bytes (B x Tmax x C) */
    d.ties = A->G > 1 ? &A->tie : NULL; /* one partition stores wte once */
    d.nties = A->G > 1;
    d.agree.clip_norm = o->clip;
    d.agree.skip_nonfinite = 1;
    d.averaging.alpha = o->alpha == 0.0 ? AVGPIPE_ZERO : (float)o->alpha;
    d.deterministic = o->deterministic;
    d.profile = o->trace || o->profile;
    d.replicas = A->D;
    d.micro_samples = A->B;
    if (A->me >= 0) { /* one rank per process over MPI */
        d.comm = &A->comm;
        d.local_ranks = &A->me;
        d.local_count = 1;
        d.timeout_s = 120;
    }
    return d;
}

/* ---- Evaluation, samples, outputs ----------------------------------------------------------------------- */

/* The reference model's partitions on the process that evaluates it (threads: here; mpi: rank 0, gathered,
   collective); ref[g] points into the run or into buf[g]. */
static int get_reference(app *A, avgpipe_run *run, avgpipe_context *ctx, float **buf, float **ref) {
    int g;
    if (A->me >= 0) {
        if (avgpipe_run_gather_reference(run, A->me == 0 ? buf : NULL) != AVGPIPE_OK)
            return fail("gathering the reference model: %s", avgpipe_last_error(ctx));
        for (g = 0; g < A->G; g++) ref[g] = buf[g];
        return 0;
    }
    for (g = 0; g < A->G; g++) {
        size_t count = 0;
        ref[g] = (float *)avgpipe_run_reference(run, g, &count);
        if (!ref[g] || count != A->count[g]) return fail("the runtime's reference of partition %d has %zu floats, expected %zu", g, count, A->count[g]);
    }
    return 0;
}

/* The evaluation's own view: the same partitions sized for EVAL_ROWS rows, and the validation windows cut
   into micro-batches of EVAL_ROWS (the same list for every M). */
typedef struct evaluator {
    gpt_part part[GPT_MAX_PARTS];
    gpt_data data;
    float *buf[GPT_MAX_PARTS]; /* mpi rank 0: the gathered reference */
} evaluator;

/* The evaluator of A's partitioning (the corpus on the process that evaluates; mpi rank 0's gather buffers). */
static int evaluator_init(evaluator *E, const app *A) {
    gpt_config c = A->cfg;
    char err[512];
    int g;
    c.B = EVAL_ROWS;
    if (gpt_partition(&c, A->G, A->opt.nsplit ? A->opt.split : NULL, E->part, err, sizeof err)) return fail("%s", err);
    if (A->me <= 0 && gpt_data_load(&E->data, A->opt.data, c.Tmax, EVAL_ROWS, A->opt.seed, err, sizeof err)) return fail("%s", err);
    for (g = 0; A->me == 0 && g < A->G; g++)
        if (!(E->buf[g] = (float *)malloc(A->count[g] * sizeof(float)))) return fail("out of memory");
    return 0;
}

/* Free what evaluator_init allocated; safe on a zeroed one. */
static void evaluator_free(evaluator *E) {
    int g;
    gpt_data_free(&E->data);
    for (g = 0; g < GPT_MAX_PARTS; g++) free(E->buf[g]), E->buf[g] = NULL;
}

/* Validation loss of the reference model on `micro` micro-batches (0: all); collective with mpi, rank 0
   evaluates. *bpb (rank 0 / threads) gets bits per byte. */
static int evaluate(app *A, evaluator *E, avgpipe_run *run, avgpipe_context *ctx, size_t micro, double *nats, double *bpb) {
    float *ref[GPT_MAX_PARTS];
    char err[256];
    if (get_reference(A, run, ctx, E->buf, ref)) return -1;
    if (A->me <= 0 && gpt_eval(E->part, A->G, ref, &E->data, micro, nats, bpb, err, sizeof err)) return fail("evaluation: %s", err);
    return 0;
}

/* The end of the run (rank 0 / threads): the reference model saved, and three samples from prompts. */
static int finish_outputs(app *A, evaluator *E, float **ref) {
    static const char *const prompts[3] = {"", "The ", "A man "};
    char err[512], *text;
    int k;
    if (A->opt.save) {
        if (gpt_save(A->opt.save, E->part, A->G, ref, err, sizeof err)) return fail("--save: %s", err);
        printf("saved the reference model to %s\n", A->opt.save);
    }
    if (A->opt.sample_len <= 0) return 0;
    if (!(text = (char *)malloc((size_t)A->opt.sample_len + 1))) return fail("out of memory");
    for (k = 0; k < 3; k++) {
        if (gpt_sample(E->part, A->G, ref, prompts[k], A->opt.sample_len, (float)A->opt.temperature, 40, A->opt.seed + (unsigned)k, text,
                       (size_t)A->opt.sample_len + 1, err, sizeof err) < 0) {
            free(text);
            return fail("sampling: %s", err);
        }
        printf("--- sample %d (prompt \"%s\", temperature %g, top-k 40)\n%s%s\n", k + 1, prompts[k], A->opt.temperature, prompts[k], text);
    }
    free(text);
    return 0;
}

/* --checkpoint DIR: save (collective), creating DIR on first use. */
static int checkpoint(const options *o, avgpipe_run *run, avgpipe_context *ctx) {
    if (!o->checkpoint) return 0;
    if (mkdir(o->checkpoint, 0777) != 0 && errno != EEXIST) return fail("--checkpoint %s: %s", o->checkpoint, strerror(errno));
    if (avgpipe_run_save(run, o->checkpoint) != AVGPIPE_OK) return fail("--checkpoint %s: %s", o->checkpoint, avgpipe_last_error(ctx));
    return 0;
}

/* ---- Training ------------------------------------------------------------------------------------------- */

/* What the progress lines add up between two of them. */
typedef struct window {
    double seconds, loss, tokens, bubble_time;
    long long skipped;
} window;

/* One iteration's loss and tokens (the last partition's counters), bubble and skips into *w; summed over the
   processes with mpi (collective). */
static int add_iteration(app *A, avgpipe_run *run, avgpipe_context *ctx, const avgpipe_run_stats *rs, window *w, double *norm) {
    double v[4] = {0, 0, 0, 0};
    int d;
    for (d = 0; d < A->D; d++) v[0] += A->loss_sum[d], v[1] += A->tokens[d], A->loss_sum[d] = A->tokens[d] = 0;
    v[2] = rs->bubble * rs->seconds, v[3] = A->norm[0];
    if (A->me >= 0 && avgpipe_run_allreduce(run, v, 4) != AVGPIPE_OK) return fail("reducing the statistics: %s", avgpipe_last_error(ctx));
    w->seconds += rs->seconds, w->loss += v[0], w->tokens += v[1];
    w->bubble_time += A->me >= 0 ? v[2] / A->nproc : v[2];
    w->skipped += rs->skipped;
    *norm = v[3]; /* partition 0's process saw it (mpi: the others add 0) */
    return 0;
}

/* The lines before training: the model and split, the data and its padding, the setting. */
static void print_header(const app *A) {
    const options *o = &A->opt;
    char desc[1024];
    gpt_parts_describe(A->part, A->G, desc, sizeof desc);
    if (A->me >= 0) printf("BLAS: %s, 1 thread per stage\n", g_blas.line); /* mpi: rank 0's (threads: printed first thing) */
    printf("model: %d layers, %d channels, %d heads, context %d, vocabulary %d: %zu parameters (wte tied: the last partition's copy "
           "is one parameter with partition 0's); %d partitions [%s] (%s)\n",
           o->cfg.L, o->cfg.C, o->cfg.H, o->cfg.Tmax, GPT_VOCAB, gpt_config_params(&A->cfg), A->G, desc,
           o->split_planned ? "the tuner's partitioner" : o->split_given ? "--split" : split_count(o) > 1 ? "an even split" : "the only one");
    printf("data: %s: %zu files, %zu documents (%zu for validation), %.0f training and %.0f validation targets; windows of up to %d, "
           "masked padding: %zu micro-batches of %d windows an epoch, padding %.2f%% of their positions\n",
           o->data, A->data.nfiles, A->data.ndocs, A->data.nval_docs, A->data.train_targets, A->data.val_targets, o->cfg.Tmax,
           A->data.nmicro, A->B, 100 * gpt_data_padding(&A->data));
    printf("%s, %d ranks x %d partition%s, %d pipeline%s, batch %d = %d x %d windows, %d rounds/iteration (%s), alpha %g; "
           "%ld rounds = %ld batches (%.2f epochs); AdamW lr %g (warm-up %ld, cosine to %g), wd %g, clip %g (agreed)\n",
           avgpipe_sched_kind_name(o->schedule), A->S, o->chunks, o->chunks > 1 ? "s" : "", A->N, A->N > 1 ? "s" : "", o->batch, A->M, A->B,
           o->rounds, o->continuous ? "continuous" : "synchronous", o->alpha, A->rounds, A->rounds * A->N * A->D,
           (double)(A->rounds * A->N * A->D) / (double)gpt_data_batches_per_epoch(&A->data, A->M), o->lr, o->warmup, o->lr / 10, o->wd, o->clip);
    if (A->D > 1)
        printf("%d replica groups, their reference models averaged every round; %s\n", A->D,
               A->me >= 0 ? "one rank per MPI process" : "every rank a thread of this process");
    else if (A->me >= 0)
        printf("one rank per MPI process\n");
    fflush(stdout);
}

/* --trace and --profile of the last iteration (each process its ranks' part). */
static int write_traces(const app *A, avgpipe_run *run, avgpipe_context *ctx) {
    char b1[4096], b2[4096];
    const char *trace = rank_path(A->me, A->opt.trace, b1, sizeof b1), *prof = rank_path(A->me, A->opt.profile, b2, sizeof b2);
    if (trace && avgpipe_run_write_trace(run, trace) != AVGPIPE_OK) return fail("--trace %s: %s", trace, avgpipe_last_error(ctx));
    if (prof && avgpipe_run_write_profile(run, prof) != AVGPIPE_OK) return fail("--profile %s: %s", prof, avgpipe_last_error(ctx));
    return 0;
}

/* A progress line after the iteration that ends at `step` (rank 0 / threads). */
static void print_progress(const app *A, long step, long long it, const window *w, double norm, int advance, double elapsed) {
    const options *o = &A->opt;
    printf("step %7ld/%ld | loss %.4f | lr %.2e | norm %.3f | %6.0f tokens/s | bubble %4.1f%% | K %d | %.1f s\n", step,
           A->rounds * A->N * A->D, w->tokens > 0 ? w->loss / w->tokens : 0.0, gpt_lr(o->lr, (long)(it + 1) * o->rounds - 1, o->warmup, A->rounds),
           norm, w->seconds > 0 ? w->tokens / w->seconds : 0.0, w->seconds > 0 ? 100 * w->bubble_time / w->seconds : 0.0, advance, elapsed);
    fflush(stdout);
}

/* Train from where a resumed run left off up to --stop-after or the end; then the checkpoint, the traces,
   the final evaluation (all validation windows), the saved model and the samples. */
static int train(app *A, avgpipe_run *run, avgpipe_context *ctx) {
    const options *o = &A->opt;
    long long iters = A->rounds / o->rounds, it = avgpipe_run_iterations(run), stop = iters, first = it, skipped = 0;
    long per_iter = (long)o->rounds * A->N * A->D;
    double total_s = 0, total_tok = 0, nats = 0, bpb = 0, norm = 0, t0;
    float *ref[GPT_MAX_PARTS];
    char err[256];
    int rc = -1;
    window w;
    evaluator E;
    memset(&E, 0, sizeof E);
    memset(&w, 0, sizeof w);
    if (evaluator_init(&E, A)) goto out;
    if (o->stop_after) stop = (o->stop_after + per_iter - 1) / per_iter;
    if (stop > iters) stop = iters;
    if (it && A->me <= 0) printf("resumed from %s at iteration %lld of %lld (step %lld)\n", o->resume, it, iters, it * per_iter);
    for (; it < stop; it++) {
        avgpipe_run_stats rs;
        long step = (long)(it + 1) * per_iter;
        avgpipe_result r = avgpipe_run_iteration(run, &rs);
        if (r != AVGPIPE_OK) {
            fail("iteration %lld: %s: %s", it, avgpipe_result_string(r), avgpipe_last_error(ctx));
            goto out;
        }
        if (add_iteration(A, run, ctx, &rs, &w, &norm) || grow_stashes(A, run)) goto out;
        if (step / o->log_every != (step - per_iter) / o->log_every || it + 1 == stop) {
            if (A->me <= 0) print_progress(A, step, it, &w, norm, rs.advance, total_s + w.seconds);
            total_s += w.seconds, total_tok += w.tokens, skipped += w.skipped;
            memset(&w, 0, sizeof w);
        }
        if (o->checkpoint_every && avgpipe_run_iterations(run) % o->checkpoint_every == 0 && checkpoint(o, run, ctx)) goto out;
        if (o->eval_every && step / o->eval_every != (step - per_iter) / o->eval_every && it + 1 < stop) {
            t0 = now_s();
            if (evaluate(A, &E, run, ctx, EVAL_SUBSET, &nats, &bpb)) goto out;
            if (A->me <= 0)
                printf("step %7ld | validation (%d micro-batches): %.4f nats, %.3f bits/byte (%.1f s)\n", step, EVAL_SUBSET, nats, bpb, now_s() - t0);
            fflush(stdout);
        }
    }
    if (A->me <= 0)
        printf("done: %lld steps of %ld (%lld skipped: non-finite gradients), %.0f tokens in %.1f s of training: %.0f tokens/s\n",
               (stop - first) * per_iter, A->rounds * A->N * A->D, skipped, total_tok, total_s, total_s > 0 ? total_tok / total_s : 0.0);
    if (checkpoint(o, run, ctx) || write_traces(A, run, ctx) || get_reference(A, run, ctx, E.buf, ref)) goto out;
    rc = 0;
    if (A->me <= 0) {
        t0 = now_s();
        if (gpt_eval(E.part, A->G, ref, &E.data, 0, &nats, &bpb, err, sizeof err)) rc = fail("evaluation: %s", err);
        else printf("validation: %.4f nats, %.3f bits per byte (the reference model, all %zu validation windows, %.1f s)\n", nats, bpb, E.data.nval,
                    now_s() - t0);
        fflush(stdout);
        if (!rc) rc = finish_outputs(A, &E, ref);
    }
out:
    evaluator_free(&E);
    return rc;
}

/* ---- Tuning ----------------------------------------------------------------------------------------------- */

/* One profile run: `pipes` pipelines of `micro` micro-batches, advance forward with K = S - 1, throwaway
   weights from the seed; TUNE_PROFILED iterations after TUNE_WARMUP go to `path` (written when !append,
   else appended), every layer timed (record_layers) as layer-profile size `size` (-1: not timed). */
static int profile_run(app *A, avgpipe_context *ctx, int micro, int pipes, int size, const char *path, int append, double *seconds) {
    options saved = A->opt;
    avgpipe_run *run = NULL;
    avgpipe_run_desc d;
    avgpipe_result r;
    int i, rc = -1, me = A->me;
    A->me = -1; /* rank 0 of an MPI job profiles on its own threads */
    A->opt.replicas = 1, A->opt.pipes = pipes, A->opt.micro = micro, A->opt.schedule = AVGPIPE_SCHED_ADVANCE, A->opt.chunks = 1;
    A->opt.advance = A->opt.stages - 1, A->opt.alpha = pipes > 1 ? A->opt.alpha : 0;
    A->opt.steps = (long)(TUNE_WARMUP + TUNE_PROFILED) * A->opt.rounds * pipes;
    A->opt.trace = A->opt.profile = NULL;
    if (setup_model(A)) goto out;
    d = make_run_desc(A);
    d.profile = 1;
    if ((r = avgpipe_run_create(ctx, &d, &run)) != AVGPIPE_OK) {
        fail("tuner: profile run (M = %d): %s: %s", micro, avgpipe_result_string(r), avgpipe_last_error(ctx));
        goto out;
    }
    if (grow_stashes(A, run)) goto out;
    A->lsize = size;
    for (i = 0; i < TUNE_WARMUP + TUNE_PROFILED; i++) {
        avgpipe_run_stats st;
        A->lprof = i >= TUNE_WARMUP && size >= 0; /* between iterations: the callbacks see it */
        if ((r = avgpipe_run_iteration(run, &st)) != AVGPIPE_OK) {
            fail("tuner: profile run (M = %d), iteration %d: %s: %s", micro, i + 1, avgpipe_result_string(r), avgpipe_last_error(ctx));
            goto out;
        }
        if (grow_stashes(A, run)) goto out;
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
    free_model(A);
    A->opt = saved;
    A->me = me;
    return rc;
}

/* qsort's order of doubles. */
static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

/* Layer l's forward (k = 0) or backward (k = 1) as a + b x rows: through the medians at the profiled sizes;
   proportional (least squares through 0) with one size, or when the line would go negative. */
static void layer_line(app *A, int l, int k, const int *rows, int nsizes, double *a, double *b) {
    double x[2], y[2], sxy = 0, sxx = 0;
    int i, n = 0;
    for (i = 0; i < nsizes; i++) {
        size_t row = ((size_t)i * A->nlayers + (size_t)l) * 2 + (size_t)k;
        double *s = A->lsamp + row * LSAMP_CAP;
        int c = A->nlsamp[row];
        if (c < 1) continue;
        qsort(s, (size_t)c, sizeof(double), cmp_double);
        x[n] = rows[i];
        y[n++] = c % 2 ? s[c / 2] : (s[c / 2 - 1] + s[c / 2]) / 2;
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

/* The partitioner's input (avgpipe.h section 20), appended to the profile: a 'layer' line per layer (its
   parameters: the head's with its wte copy, as every split with more than one partition holds it) and an
   'averaging' line per partition of the profiled split. */
static int append_layer_costs(app *A, avgpipe_context *ctx, const char *path, const int *rows, int nsizes) {
    const gpt_config *c = &A->opt.cfg;
    FILE *f = fopen(path, "a");
    gpt_part parts[GPT_MAX_PARTS];
    gpt_config pc = *c;
    int l, g = 0, bad = 0;
    char err[256];
    if (!f) return fail("tuner: cannot append to the profile %s: %s", path, strerror(errno));
    pc.B = 1;
    if (gpt_partition(&pc, A->opt.stages, A->opt.nsplit ? A->opt.split : NULL, parts, err, sizeof err)) return fclose(f), fail("%s", err);
    for (l = 0; l < c->L + 2; l++) {
        double fa, fb, ba, bb;
        size_t floats = gpt_part_layout(c, l, l + 1, NULL, NULL);
        while (l >= parts[g].hi) g++;
        if (l == c->L + 1 && l > 0 && floats < 2 * (size_t)c->C + (size_t)GPT_VOCAB * c->C) floats = 2 * (size_t)c->C + (size_t)GPT_VOCAB * c->C;
        layer_line(A, l, 0, rows, nsizes, &fa, &fb);
        layer_line(A, l, 1, rows, nsizes, &ba, &bb);
        fprintf(f, "layer %d stage=%d f_a=%.9g f_b=%.9g b_a=%.9g b_b=%.9g param_floats=%zu act_bytes=%zu\n", l, g, fa, fb, ba, bb, floats,
                (size_t)c->Tmax * (size_t)c->C * sizeof(float));
    }
    for (g = 0; g < A->opt.stages && !bad; g++) {
        double t;
        if (avgpipe_tune_measure_averaging(ctx, parts[g].nparams, &t) != AVGPIPE_OK) bad = 1;
        else fprintf(f, "averaging floats=%zu seconds=%.9g\n", parts[g].nparams, t);
    }
    if (ferror(f)) bad = 1;
    if (fclose(f) != 0) bad = 1;
    return bad ? fail("tuner: cannot append the layer costs to %s: %s", path, avgpipe_last_error(ctx)) : 0;
}

/* The tuner's fitted costs, on stderr. */
static void print_cost_model(const avgpipe_cost_model *m) {
    int g, K = AVGPIPE_OP_KIND_COUNT;
    fprintf(stderr, PROG ": tuner: cost model, us = a + b x windows per micro-batch (fitted at %g..%g windows):\n", m->samples_lo, m->samples_hi);
    for (g = 0; g < m->nstages; g++) {
        const double *a = &m->a[g * K], *b = &m->b[g * K];
        fprintf(stderr, "  partition %d  F %7.1f + %7.1f x   B %7.1f + %7.1f x   STEP %7.1f\n", g, 1e6 * a[AVGPIPE_OP_F], 1e6 * b[AVGPIPE_OP_F],
                1e6 * a[AVGPIPE_OP_B], 1e6 * b[AVGPIPE_OP_B], 1e6 * a[AVGPIPE_OP_STEP]);
    }
    fprintf(stderr, "  transfer latency %.1f us, runtime overhead %.1f us per op and %.1f us per iteration, averaging %.2f ns per "
            "parameter, STEP %.1f us + %.2f ns per parameter\n", 1e6 * m->latency, 1e6 * m->op_overhead, 1e6 * m->iter_overhead,
            1e9 * m->avg_per_float, 1e6 * m->step_a, 1e9 * m->step_b);
    if (m->cores > 0 && m->busy_cores > 0)
        fprintf(stderr, "  %g cores; the profile's stage threads got through %.2f cores' worth of work at most (busy_cores)%s\n", m->cores,
                m->busy_cores, m->busy_cores < m->cores ? ": the bound once ranks outnumber cores" : "");
}

/* The partitioner's filter: the M and N the command line fixed. */
static int keep_fixed(const avgpipe_tune_candidate *c, void *user) {
    const options *o = (const options *)user;
    return (o->micro == AUTO || c->sched.micro == o->micro) && (o->pipes == AUTO || c->sched.pipes == o->pipes);
}

/* The split to train with and its cost model *sm: the partitioner's choice (jointly with the setting, M and N
   as fixed) when there is one to make, else the given or the only one. Prints it with what bounds it. */
static int tune_split(app *A, avgpipe_context *ctx, const avgpipe_cost_model *cm, const avgpipe_tune_desc *td, avgpipe_cost_model *sm) {
    options *o = &A->opt;
    avgpipe_tune_split_choice plan;
    avgpipe_tune_split_desc pd;
    gpt_part parts[GPT_MAX_PARTS];
    gpt_config pc = o->cfg;
    int split[GPT_MAX_PARTS], g, busiest = 0, planned = planning(o);
    double t0 = now_s(), share, x, worst = -1;
    char desc[1024], err[256];
    avgpipe_result r;
    memset(&plan, 0, sizeof plan);
    memset(&pd, 0, sizeof pd);
    pd.stages = o->stages, pd.keep = keep_fixed, pd.keep_user = o;
    if (planned && (r = avgpipe_tune_choose_split(ctx, cm, td, &pd, &plan)) != AVGPIPE_OK)
        return fail("tuner: the stage partitioner failed: %s: %s", avgpipe_result_string(r), avgpipe_last_error(ctx));
    pc.B = 1;
    if (!planned && gpt_partition(&pc, o->stages, o->nsplit ? o->split : NULL, parts, err, sizeof err)) return fail("%s", err);
    for (g = 0; g < o->stages; g++) split[g] = planned ? plan.split[g] : parts[g].hi - parts[g].lo;
    for (g = 0; g < o->stages; g++) o->split[g] = split[g];
    o->nsplit = o->stages, o->split_planned = planned;
    if ((r = avgpipe_tune_split_model(ctx, cm, split, o->stages, sm)) != AVGPIPE_OK) {
        avgpipe_tune_split_choice_free(ctx, &plan);
        return fail("tuner: %s", avgpipe_last_error(ctx));
    }
    x = planned ? plan.best.samples : (double)o->batch / (o->micro != AUTO ? o->micro : 1);
    share = avgpipe_tune_slowest_share(sm, o->stages, x, o->batch);
    for (g = 0; g < o->stages; g++) {
        const double *ca = &sm->a[g * AVGPIPE_OP_KIND_COUNT], *cb = &sm->b[g * AVGPIPE_OP_KIND_COUNT];
        double w = (ca[AVGPIPE_OP_F] + ca[AVGPIPE_OP_B]) / x + cb[AVGPIPE_OP_F] + cb[AVGPIPE_OP_B] + ca[AVGPIPE_OP_STEP] / o->batch;
        if (w > worst) worst = w, busiest = g;
    }
    gpt_partition(&pc, o->stages, split, parts, err, sizeof err);
    gpt_parts_describe(parts, o->stages, desc, sizeof desc);
    fprintf(stderr, PROG ": tuner: split ");
    for (g = 0; g < o->stages; g++) fprintf(stderr, "%s%d", g ? "," : "", split[g]);
    fprintf(stderr, " [%s]", desc);
    if (planned) fprintf(stderr, " chosen by the partitioner among %lld splits (%lld searched, %.2f s)", plan.splits, plan.searched, now_s() - t0);
    else fprintf(stderr, o->split_given ? " (--split)" : " (the only one)");
    fprintf(stderr, "; partition %d, the busiest, does %.1f%% of the work per window (micro-batches of %g): no schedule gains more than "
            "%.2fx over one thread here\n", busiest, 100 * share, x, share > 0 ? fmin(1 / share, cm->cores > 0 ? cm->cores : 1e9) : 0.0);
    avgpipe_tune_split_choice_free(ctx, &plan);
    return 0;
}

/* One line of the tuner's table, on stderr. */
static void print_candidate(const avgpipe_tune_candidate *c, int batch, int chosen) {
    char k[16] = "-";
    if (c->sched.kind == AVGPIPE_SCHED_ADVANCE) snprintf(k, sizeof k, "%d", c->sched.advance);
    fprintf(stderr, "  %2s %-8s %5d %3d %3d %4s %-10s %4d %10.0f %6.2f %9.1f %9.2f%s\n", chosen ? "->" : "", avgpipe_sched_kind_name(c->sched.kind),
            batch, c->sched.micro, c->sched.pipes, k, c->sched.continuous ? "continuous" : "sync", batch / c->sched.micro, 1.0 / c->time_per_sample,
            c->efficiency, c->time_to_target, c->peak_bytes / (1024.0 * 1024.0), c->fits ? "" : "  over --mem-limit");
}

/* Batches of `batch` windows instead of o->batch (a multiple of it, k times): the run's counts of batches
   (--steps, --warmup, --log-every, --eval-every, --stop-after) divided by k, rounded up (warm-up down), so
   that it trains on as many windows with the same learning-rate curve over them. */
static void adopt_batch(options *o, int batch) {
    long k = o->batch > 0 ? batch / o->batch : 1;
    if (k <= 1) return;
    o->steps = (o->steps + k - 1) / k, o->warmup /= k, o->log_every = (o->log_every + k - 1) / k;
    o->eval_every = (o->eval_every + k - 1) / k, o->stop_after = (o->stop_after + k - 1) / k;
    o->batch = batch;
}

/* Search `m` as td says and set o's schedule, M, N, K, round mode, chunks and batch to the choice: with what
   the user fixed and within --mem-limit, the least predicted time to target (the time per window x the
   efficiency 1 + N x batch / B_noise, x the run's windows), or with --objective throughput the least time
   per window; within TUNE_TIE of it, fewer pipelines, then less memory. Without --batch (and ranking by
   time to target) also at 2x and 4x the batch, N x batch <= 4x (adopt_batch keeps the run's windows). */
static int tune_choose(avgpipe_context *ctx, options *o, const avgpipe_cost_model *m, const avgpipe_tune_desc *td, double t0) {
    tune_cand *cand = NULL;
    int i, j, nok = 0, nsim = 0, shown = 0, chosen, best, batches = TUNE_BATCHES, thr = o->objective == AVGPIPE_TUNE_THROUGHPUT;
    double t1 = now_s();
    char err[AVGPIPE_ERROR_MAX + 64];
    if (o->batch_set || thr || !(td->noise_scale > 0)) batches = 1;
    if (tune_rank_search(ctx, m, td, batches, 0, keep_fixed, o, thr, &cand, &nok, &nsim, err, sizeof err)) return fail("tuner: %s", err);
    t1 = now_s() - t1;
    chosen = tune_rank_pick(cand, nok, TUNE_TIE, &best);
    if (chosen < 0) {
        int small = tune_rank_smallest(cand, nok);
        if (nok == 0) fail("tuner: no setting to choose from (batch %d, micro-batches of >= %d windows)", o->batch, td->min_micro);
        else fail("tuner: no setting fits --mem-limit %.0f bytes per rank: the smallest, %s with M = %d, N = %d, needs %.0f bytes (%.2f MiB)",
                  o->mem_limit, avgpipe_sched_kind_name(cand[small].c.sched.kind), cand[small].c.sched.micro, cand[small].c.sched.pipes,
                  cand[small].c.peak_bytes, cand[small].c.peak_bytes / (1024.0 * 1024.0));
        free(cand);
        return -1;
    }
    fprintf(stderr, PROG ": tuner: %d settings simulated in %.2f s (N %s %d, ", nsim, t1, o->pipes == AUTO ? "<=" : "=", td->max_pipes);
    if (o->micro == AUTO) fprintf(stderr, "micro-batches >= %d windows", td->min_micro);
    else fprintf(stderr, "M = %d", o->micro);
    if (batches > 1) fprintf(stderr, ", batches of %d to %d windows", td->batch, td->batch * batches);
    fprintf(stderr, "%s); predicted, %s first, the best setting of each batch, M and N", o->mem_limit > 0 ? ", within --mem-limit" : "",
            thr ? "fastest" : "soonest to target");
    if (td->noise_scale > 0)
        fprintf(stderr, " (eff: windows to a target relative to a batch far below the noise scale, %.1f windows;\n"
                        "     to target: seconds for the run's %.0f windows of such progress)", td->noise_scale, td->target_samples);
    fprintf(stderr, ":\n     schedule batch   M   N    K rounds     rows  windows/s    eff to target  peak MiB\n");
    for (i = 0; i < nok && (shown < TUNE_SHOW || i <= chosen); i++) {
        int dup = 0; /* one line per (batch, M, N): the schedules, K and round modes of one are often tied */
        for (j = 0; j < i && !dup; j++)
            dup = cand[j].batch == cand[i].batch && cand[j].c.sched.micro == cand[i].c.sched.micro && cand[j].c.sched.pipes == cand[i].c.sched.pipes;
        if (i == chosen || (!dup && shown < TUNE_SHOW)) {
            if (i == chosen && shown >= TUNE_SHOW) fprintf(stderr, "     ...\n");
            print_candidate(&cand[i].c, cand[i].batch, i == chosen);
            shown++;
        }
    }
    o->schedule = cand[chosen].c.sched.kind, o->micro = cand[chosen].c.sched.micro, o->pipes = cand[chosen].c.sched.pipes;
    o->continuous = cand[chosen].c.sched.continuous, o->chunks = 1;
    o->advance = o->schedule == AVGPIPE_SCHED_ADVANCE ? cand[chosen].c.sched.advance : ADVANCE_AUTO;
    fprintf(stderr, PROG ": tuner: chose %s, batch %d, M = %d, N = %d", avgpipe_sched_kind_name(o->schedule), cand[chosen].batch, o->micro, o->pipes);
    if (o->schedule == AVGPIPE_SCHED_ADVANCE) fprintf(stderr, ", K = %d", o->advance);
    fprintf(stderr, ", %s rounds: predicted %.0f windows/s", o->continuous ? "continuous" : "sync", 1.0 / cand[chosen].c.time_per_sample);
    if (td->noise_scale > 0) fprintf(stderr, ", efficiency %.2f: %.1f s to target", cand[chosen].c.efficiency, cand[chosen].c.time_to_target);
    fprintf(stderr, ", %.2f MiB per rank", cand[chosen].c.peak_bytes / (1024.0 * 1024.0));
    if (chosen != best) fprintf(stderr, " (of the ties within %.1f%%: fewest pipelines, least memory)", 100 * TUNE_TIE);
    if (cand[chosen].batch != o->batch) {
        adopt_batch(o, cand[chosen].batch);
        fprintf(stderr, "; --steps %ld of these batches (the same windows), warm-up %ld", o->steps, o->warmup);
    }
    fprintf(stderr, "; tuning took %.2f s\n", now_s() - t0);
    free(cand);
    return 0;
}

/* Where the profile goes: --profile-tune, or a temporary file named into tmp (the caller removes it). */
static int tune_profile_path(const options *o, char *tmp, size_t cap, const char **path) {
    const char *dir = getenv("TMPDIR");
    int fd;
    *path = o->profile_tune;
    if (*path) return 0;
    snprintf(tmp, cap, "%s/" PROG "_tune_XXXXXX", dir && *dir ? dir : "/tmp");
    if ((fd = mkstemp(tmp)) < 0) return fail("tuner: cannot create a temporary profile %s: %s (set TMPDIR, or give --profile-tune FILE)", tmp, strerror(errno));
    close(fd);
    *path = tmp;
    return 0;
}

/* The micro-batch counts to profile (the ends of the range searched: one micro-batch, and the most with
   *min_rows windows each; only the fixed M with --micro), and the smallest micro-batch searched. Returns how
   many. */
static int profile_sizes(const options *o, int *sizes, int *min_rows) {
    int i;
    *min_rows = TUNE_MIN_ROWS < o->batch ? TUNE_MIN_ROWS : o->batch;
    if (o->micro != AUTO) {
        if (o->batch / o->micro < *min_rows) *min_rows = o->batch / o->micro;
        return sizes[0] = o->micro, 1;
    }
    sizes[0] = 1, sizes[1] = 1;
    for (i = 1; i <= o->batch; i++)
        if (o->batch % i == 0 && o->batch / i >= *min_rows) sizes[1] = i;
    return sizes[1] > 1 ? 2 : 1;
}

/* The fit against the iterations it was fitted to (the median of each size's profiled ones), on stderr. */
static void print_checks(avgpipe_context *ctx, const avgpipe_cost_model *cm, const avgpipe_profile *prof, const avgpipe_tune_desc *td, int nsizes,
                         double meas[][TUNE_PROFILED]) {
    int i;
    for (i = 0; i < nsizes; i++) {
        const avgpipe_profile_section *sec = &prof->sections[i * TUNE_PROFILED];
        double pred = 0, a = meas[i][0], b = meas[i][1], c = meas[i][2], med = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        if (avgpipe_tune_predict_sync(ctx, cm, &sec->shape, sec->samples, td, &pred) == AVGPIPE_OK && med > 0)
            fprintf(stderr, "  check M = %d, N = %d: measured %.1f ms/iteration, predicted %.1f ms (%+.0f%%)\n", sec->shape.micro, sec->shape.pipes,
                    1e3 * med, 1e3 * pred, 100 * (pred / med - 1));
    }
}

/* The search the command line asks for: what it fixed (schedule, --sync, N) narrows it. */
static void tune_desc_init(avgpipe_tune_desc *td, const options *o, int min_rows) {
    double noise = o->noise_scale >= 0 ? o->noise_scale : avgpipe_tune_noise_from_ratio(TUNE_NOISE_BATCH, 2, TUNE_NOISE_RATIO);
    memset(td, 0, sizeof *td);
    td->objective = o->objective;
    /* with N and the batch fixed every candidate has the same efficiency; by windows/s alone none is used */
    td->noise_scale = o->objective != AVGPIPE_TUNE_THROUGHPUT && (o->pipes == AUTO || !o->batch_set) ? noise / o->replicas : 0;
    td->target_samples = (double)o->steps * o->batch; /* the run's windows */
    td->batch = o->batch;
    td->max_pipes = o->pipes != AUTO ? o->pipes : TUNE_MAX_PIPES;
    td->rounds = o->rounds;
    td->mem_limit = o->mem_limit;
    td->opt_bytes_per_param = 12; /* AdamW's two moments and the gradient, per parameter and model */
    td->min_micro = min_rows;
    td->no_continuous = o->sync_set;
    td->kinds = o->schedule_set ? 1u << o->schedule : 0;
    td->threads = tune_threads();
}

/* Profile, fit, split, search; then A->opt holds the chosen split, schedule, M, N, K and round mode. Training
   starts afterwards from the seed: the same weights and batch order as a run given that choice. */
static int tune(app *A, avgpipe_context *ctx) {
    options *o = &A->opt;
    char tmp[512];
    const char *path = NULL;
    int sizes[2], rows[2], min_rows, nsizes = profile_sizes(o, sizes, &min_rows), i, rc = -1, two = o->pipes != 1;
    double t0 = now_s(), t1, meas[3][TUNE_PROFILED];
    avgpipe_profile prof;
    avgpipe_cost_model cm, sm, *use = &cm;
    avgpipe_tune_desc td;
    avgpipe_result r;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    memset(&prof, 0, sizeof prof), memset(&cm, 0, sizeof cm), memset(&sm, 0, sizeof sm);
    A->nlayers = o->cfg.L + 2;
    A->lsamp = (double *)malloc(sizeof(double) * LSAMP_CAP * 4 * (size_t)A->nlayers);
    A->nlsamp = (int *)calloc(4 * (size_t)A->nlayers, sizeof(int));
    if (!A->lsamp || !A->nlsamp) {
        fail("out of memory");
        goto done;
    }
    if (tune_profile_path(o, tmp, sizeof tmp, &path)) goto done;
    for (i = 0; i < nsizes; i++) {
        rows[i] = o->batch / sizes[i];
        if (profile_run(A, ctx, sizes[i], 1, i, path, i > 0, meas[i])) goto done;
    }
    /* and 2 pipelines at the first size: how much of the cores the stage threads get when there is little
       bubble (the cost model's busy_cores, the bound once ranks outnumber cores; nothing to learn from it
       when N is fixed at 1) */
    if (two && profile_run(A, ctx, sizes[0], 2, -1, path, 1, meas[nsizes])) goto done;
    if (append_layer_costs(A, ctx, path, rows, nsizes)) goto done;
    t1 = now_s();
    r = avgpipe_profile_load(ctx, path, &prof);
    if (r == AVGPIPE_OK) r = avgpipe_tune_fit(ctx, &prof, &cm);
    if (r != AVGPIPE_OK) {
        fail("tuner: cannot fit a cost model to the profile %s: %s: %s", path, avgpipe_result_string(r), avgpipe_last_error(ctx));
        goto done;
    }
    cm.cores = cores > 0 ? (double)cores : 0; /* the stage threads share this machine's cores */
    cm.overlap = 0; /* the ops of a CPU rank run on its one thread: they never overlap (what the fit saw is noise) */
    fprintf(stderr, PROG ": tuner: profiled 1 pipeline (advance, K = %d, %d rounds/iteration) at M = %d", o->stages - 1, o->rounds, sizes[0]);
    if (nsizes > 1) fprintf(stderr, " and M = %d", sizes[1]);
    fprintf(stderr, " (%d and %d windows)", rows[0], rows[nsizes - 1]);
    if (two) fprintf(stderr, ", and 2 pipelines at M = %d", sizes[0]);
    fprintf(stderr, ", %d iterations each after %d warm-up, in %.2f s (throwaway weights)%s%s\n", TUNE_PROFILED, TUNE_WARMUP, t1 - t0,
            o->profile_tune ? "; profile: " : "", o->profile_tune ? o->profile_tune : "");
    print_cost_model(&cm);
    tune_desc_init(&td, o, min_rows);
    if (A->G > 1) td.ties = &A->tie, td.nties = 1; /* every setting is simulated with the run's TIE and AGREE ops */
    td.agree = 1;                                   /* (the clip and the non-finite skip agree every round) */
    print_checks(ctx, &cm, &prof, &td, nsizes + two, meas);
    if (cm.nlayers) {
        if (tune_split(A, ctx, &cm, &td, &sm)) goto done;
        use = &sm;
    }
    if (tuning(o) && tune_choose(ctx, o, use, &td, t0)) goto done;
    rc = 0;
done:
    if (path == tmp) remove(tmp);
    avgpipe_tune_cost_model_free(ctx, &cm);
    avgpipe_tune_cost_model_free(ctx, &sm);
    avgpipe_profile_free(ctx, &prof);
    free(A->lsamp), free(A->nlsamp);
    A->lsamp = NULL, A->nlsamp = NULL;
    return rc;
}

/* ---- Processes (--backend mpi) ----------------------------------------------------------------------------- */

#ifdef GPT_MPI
/* Join the job (one rank per process) and check that its size fits the flags. */
static int start_mpi(app *A, avgpipe_context *ctx, int *argc, char ***argv) {
    int S = A->opt.stages / A->opt.chunks;
    if (avgpipe_mpi_init(ctx, argc, argv) != AVGPIPE_OK || avgpipe_mpi_create(ctx, NULL, &A->comm) != AVGPIPE_OK)
        return fail("--backend mpi: %s", avgpipe_last_error(ctx));
    A->me = g_rank = avgpipe_mpi_rank(&A->comm);
    A->nproc = A->comm.size;
    if (A->nproc != A->opt.replicas * S)
        return fail("--backend mpi: %d processes, but %d replica group%s x %d ranks (--stages %d / %d partitions per rank) need %d: mpirun -np %d",
                    A->nproc, A->opt.replicas, A->opt.replicas > 1 ? "s" : "", S, A->opt.stages, A->opt.chunks, A->opt.replicas * S,
                    A->opt.replicas * S);
    check_outputs(&A->opt, A->me);
    return 0;
}

/* Rank 0 tuned alone: everyone trains with its choice, batch included (or stops with it); rank 0 has 10
   minutes. */
static int share_choice(app *A, int rc) {
    options *o = &A->opt;
    int v[10 + GPT_MAX_PARTS], done = 0, g;
    MPI_Request req;
    double t0 = MPI_Wtime();
    struct timespec nap = {0, 1000000L};
    v[0] = rc, v[1] = (int)o->schedule, v[2] = o->micro, v[3] = o->pipes, v[4] = o->continuous, v[5] = o->advance, v[6] = o->chunks;
    v[7] = o->rounds, v[8] = o->nsplit;
    for (g = 0; g < GPT_MAX_PARTS; g++) v[9 + g] = o->split[g];
    v[9 + GPT_MAX_PARTS] = o->batch;
    if (MPI_Ibcast(v, 10 + GPT_MAX_PARTS, MPI_INT, 0, MPI_COMM_WORLD, &req) != MPI_SUCCESS) return fail("--backend mpi: MPI_Ibcast failed");
    while (MPI_Test(&req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done && MPI_Wtime() - t0 < 600) nanosleep(&nap, NULL);
    if (!done) return fail("--backend mpi: rank 0 did not finish tuning within 10 minutes");
    if (v[0] != 0) return A->me == 0 ? -1 : fail("rank 0 failed to tune (see its message)");
    o->schedule = (avgpipe_sched_kind)v[1], o->micro = v[2], o->pipes = v[3], o->continuous = v[4], o->advance = v[5], o->chunks = v[6];
    o->rounds = v[7], o->nsplit = v[8];
    for (g = 0; g < GPT_MAX_PARTS; g++) o->split[g] = v[9 + g];
    adopt_batch(o, v[9 + GPT_MAX_PARTS]); /* rank 0 has adopted it already */
    return 0;
}
#endif

/* A generic OpenBLAS kernel on a CPU that can run a better one: restart with it (blas_kernel.h), before
   anything a restart would repeat; the check uses the model's GEMM shapes at its micro-batch size. */
static void ensure_blas_kernel(const options *o, char **argv) {
    blas_kernel_shape shapes[4];
    int rows = (o->micro != AUTO ? o->batch / o->micro : o->batch) * o->cfg.Tmax, C = o->cfg.C;
    shapes[0].m = rows, shapes[0].n = 3 * C, shapes[0].k = C;
    shapes[1].m = rows, shapes[1].n = 4 * C, shapes[1].k = C;
    shapes[2].m = rows, shapes[2].n = C, shapes[2].k = 4 * C;
    shapes[3].m = rows, shapes[3].n = GPT_VOCAB, shapes[3].k = C;
    blas_kernel_ensure(argv, shapes, 4, PROG, &g_blas);
}

/* Options, the BLAS kernel, MPI, the corpus, the tuner, the run, the training, the outputs. */
int main(int argc, char **argv) {
    static app A; /* zeroed; large */
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_run_desc desc;
    avgpipe_result r;
    int rc = 1;
    parse_options(argc, argv, &A.opt);
    ensure_blas_kernel(&A.opt, argv);
    if (!A.opt.procs) {
        printf("BLAS: %s, 1 thread per stage\n", g_blas.line);
        fflush(stdout); /* first, also when stdout and stderr go to one file */
    }
    openblas_set_num_threads(1); /* the stage threads are the parallelism */
    avgpipe_context_init(&ctx, NULL);
    A.me = -1;
    A.S = A.opt.stages / A.opt.chunks;
#ifdef GPT_MPI
    if (A.opt.procs && start_mpi(&A, &ctx, &argc, &argv) != 0) goto done;
#endif
    if (load_data(&A, A.opt.batch / (A.opt.micro != AUTO ? A.opt.micro : 1))) goto done;
    if (profiles(&A.opt)) {
        int trc = A.me <= 0 ? tune(&A, &ctx) : 0;
#ifdef GPT_MPI
        if (A.me >= 0) trc = share_choice(&A, trc);
#endif
        if (trc) goto done;
    }
    if (!A.opt.alpha_set && A.opt.pipes == 1) A.opt.alpha = 0; /* one model: nothing to average with */
    if (setup_model(&A)) goto done;
    desc = make_run_desc(&A);
    if ((r = avgpipe_run_create(&ctx, &desc, &run)) != AVGPIPE_OK) {
        fail("%s: %s", avgpipe_result_string(r), avgpipe_last_error(&ctx));
        goto done;
    }
    if (A.opt.resume && avgpipe_run_load(run, A.opt.resume) != AVGPIPE_OK) {
        fail("--resume %s: %s", A.opt.resume, avgpipe_last_error(&ctx));
        goto done;
    }
    if (grow_stashes(&A, run)) goto done;
    if (A.me <= 0) print_header(&A);
    rc = train(&A, run, &ctx) == 0 ? 0 : 1;
done:
    avgpipe_run_destroy(run);
    free_model(&A);
    gpt_data_free(&A.data);
#ifdef GPT_MPI
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
