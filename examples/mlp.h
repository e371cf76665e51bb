/* mlp.h — a small multilayer perceptron for the avgpipe examples. Single header, C11.

   What it gives (no avgpipe dependency: the model code knows nothing of pipelines):
     - an IDX (.gz) loader for MNIST-style data sets (Debian's dataset-fashion-mnist files), through zlib;
     - an MLP whose layers are grouped into G contiguous stage partitions, each partition's weights and
       biases in ONE flat float buffer (what avgpipe averages); forward and backward of one stage on a
       micro-batch through CBLAS, with the activations a backward needs kept in a per-slot stash, and the
       backward split into I (gradient of the input) and W (gradient of the weights) for ZB-H1;
     - Adam, a deterministic He initialiser, a per-epoch shuffled sample order shared by all drivers;
     - a non-pipelined single-thread reference trainer and an evaluation function.

   Use:
       #define MLP_IMPLEMENTATION       // in exactly one .c file
       #include "mlp.h"
   Link with -lopenblas -lz -lm.

   Layout of a stage buffer: for each layer l of the stage, in order, its weights W_l (width[l+1] rows of
   width[l] floats, row-major, PyTorch's Linear layout) then its bias b_l (width[l+1] floats).
   Every hidden layer is Linear + ReLU; the last layer is Linear, followed by softmax cross-entropy.

   Numerics: B is exactly I followed by W (the same BLAS calls with the same arguments in the same order),
   and gradients of a batch are summed over its micro-batches in micro-batch order, so a pipelined run of
   one pipeline (N = 1, alpha = 0) can match the reference trainer bit for bit on the same BLAS.

   Errors: functions that can fail return 0 on success and -1 on failure, with a one-line message in the
   caller's buffer (err, errcap) where they take one. Nothing here prints, exits or aborts.
   Thread-safety: functions touch only their arguments; a stash, a net's gradient buffer and a perm cache
   must not be used by two threads at once. */
#ifndef MLP_H
#define MLP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MLP_MAX_LAYERS 16 /* layers of a model, hence also its most stages */
#define MLP_CLASSES 10    /* labels are 0 .. MLP_CLASSES-1 */

/* ---- Data ------------------------------------------------------------------------------------ */

/* A labelled image set: n samples of dim = rows * cols pixels. */
typedef struct mlp_data {
    int n, rows, cols, dim;
    float *x;   /* n * dim pixels, in [0, 1] after loading (then optionally normalised) */
    uint8_t *y; /* n labels, each < MLP_CLASSES */
} mlp_data;

/* Load an IDX image file (magic 0x00000803) and its IDX label file (magic 0x00000801), gzip-compressed or
   not. Checks the magic numbers, the dimensions, that both files hold the same number of samples, that
   every label is < MLP_CLASSES, and that neither file is truncated or has trailing bytes. On failure *d is
   zeroed and err gets "path: what is wrong". Returns 0 or -1.
   What a pipeline stage does not need it need not load: with `parts` MLP_PIXELS only the images are
   read (y stays NULL), with MLP_LABELS only the labels and the image file's header (x stays NULL; n and
   the dimensions are known). MLP_PIXELS | MLP_LABELS reads both. */
#define MLP_PIXELS 1
#define MLP_LABELS 2
int mlp_data_load(mlp_data *d, const char *images_path, const char *labels_path, char *err, size_t errcap);
int mlp_data_load_parts(mlp_data *d, const char *images_path, const char *labels_path, int parts, char *err, size_t errcap);

/* Load Fashion-MNIST from dir: {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz. Returns 0 or -1 (err set,
   both sets zeroed). _parts: the parts of the training set (MLP_PIXELS, MLP_LABELS) and of the test set
   (0: not loaded) to read. */
int mlp_data_load_fashion(const char *dir, mlp_data *train, mlp_data *test, char *err, size_t errcap);
int mlp_data_load_fashion_parts(const char *dir, mlp_data *train, int train_parts, mlp_data *test, int test_parts, char *err,
                                size_t errcap);

/* Mean and standard deviation of all pixels of d (computed in double). */
void mlp_data_stats(const mlp_data *d, float *mean, float *std);

/* x <- (x - mean) / std for every pixel (std <= 0 is taken as 1). */
void mlp_data_normalize(mlp_data *d, float mean, float std);

/* Keep only the first n samples (n outside [0, d->n) leaves d unchanged). The buffers are not shrunk. */
void mlp_data_truncate(mlp_data *d, int n);

/* Free the buffers and zero *d. Safe on a zeroed struct. */
void mlp_data_free(mlp_data *d);

/* ---- Model shape ----------------------------------------------------------------------------- */

/* An MLP of `layers` Linear layers grouped into `stages` contiguous partitions. */
typedef struct mlp_model {
    int layers;                    /* L */
    int width[MLP_MAX_LAYERS + 1]; /* width[0] inputs ... width[L] classes */
    int stages;                    /* G */
    int first[MLP_MAX_LAYERS + 1]; /* stage g holds layers first[g] .. first[g+1]-1; first[G] = L */
    size_t count[MLP_MAX_LAYERS];  /* floats of stage g's buffer (weights and biases) */
    size_t offset[MLP_MAX_LAYERS]; /* where layer l's weights start in its stage's buffer */
} mlp_model;

/* Describe a model of `layers` layers with widths width[0 .. layers] into *m, grouped into `stages`
   contiguous partitions: the largest stage's multiply-adds as small as possible, then the others as even
   as that allows (least sum of squares); with stages == layers, one layer per stage. Errors (-1, err set): layers outside [1, MLP_MAX_LAYERS], a width < 1 or
   > 1 << 20, width[layers] != MLP_CLASSES, stages < 1 or > layers. */
int mlp_model_init(mlp_model *m, int layers, const int *width, int stages, char *err, size_t errcap);

/* Regroup m's layers into `stages` contiguous partitions, partition g holding the next split[g] layers
   (split NULL: the grouping mlp_model_init picks). Offsets and counts follow. Errors (-1, err set):
   stages outside [1, layers], a partition without a layer, split[] not adding up to the layers. */
int mlp_model_regroup(mlp_model *m, int stages, const int *split, char *err, size_t errcap);

/* Parse "1,1,2" (layers per stage partition) into split[0 .. *n-1] (at most `cap` entries). Returns 0, or
   -1 with a message in err on anything but positive integers separated by commas. */
int mlp_split_parse(const char *text, int *split, int cap, int *n, char *err, size_t errcap);

/* Parse a list of hidden widths "512,256,128" (empty string: no hidden layer) into a model of
   inputs -> hidden... -> MLP_CLASSES, grouped into `stages` partitions. Errors as mlp_model_init, plus a
   malformed list. */
int mlp_model_parse(mlp_model *m, int inputs, const char *hidden, int stages, char *err, size_t errcap);

/* Width of the activation stage g sends to stage g+1 (its last layer's output width). */
int mlp_stage_out_width(const mlp_model *m, int stage);

/* Write a short description "784-512-256-128-10, stages [784-512 | 512-256-128-10]" into buf (truncated to
   cap bytes). */
void mlp_model_describe(const mlp_model *m, char *buf, size_t cap);

/* ---- Parameters, gradients, optimizer -------------------------------------------------------- */

/* Adam hyperparameters. */
typedef struct mlp_adam_hp {
    float lr, beta1, beta2, eps, weight_decay; /* weight_decay: L2 added to the gradient (Adam, not AdamW) */
} mlp_adam_hp;

/* lr 1e-3, beta1 0.9, beta2 0.999, eps 1e-8, weight_decay 0 (PyTorch's defaults). */
mlp_adam_hp mlp_adam_defaults(void);

/* Adam state of one stage partition: first and second moments, step counter. */
typedef struct mlp_adam {
    size_t count;
    float *m, *v;
    long t;
} mlp_adam;

/* One parallel model: per stage its parameters, its gradient accumulator and its Adam state. */
typedef struct mlp_net {
    const mlp_model *model;
    float *params[MLP_MAX_LAYERS];
    float *grad[MLP_MAX_LAYERS];
    mlp_adam adam[MLP_MAX_LAYERS];
} mlp_net;

/* Fill stage g's buffer with the deterministic initial weights of `seed`: He-normal weights
   (std sqrt(2 / fan_in)), zero biases. Layer l's values depend only on (seed, l, widths), not on the
   grouping, so every partitioning of the same model starts from the same weights. */
void mlp_init_stage(const mlp_model *m, int stage, float *params, uint64_t seed);

/* Allocate a net for m (params initialised from seed, gradients and Adam moments zero). Returns 0 or -1
   (out of memory; *net zeroed). m must outlive the net. */
int mlp_net_init(mlp_net *net, const mlp_model *m, uint64_t seed);

/* Free a net's buffers and zero it. Safe on a zeroed struct. */
void mlp_net_free(mlp_net *net);

/* Copy src's parameters into dst (same model); gradients and Adam state are untouched. */
void mlp_net_copy_params(mlp_net *dst, const mlp_net *src);

/* Cosine learning-rate decay: base * (1 + cos(pi * step / total)) / 2, from base at step 0 to 0 at step
   total (and after). total <= 0 means no decay: base. */
float mlp_lr_cosine(float base, int64_t step, int64_t total);

/* One Adam step on `count` parameters from the accumulated gradient, which is then zeroed (ready for the
   next batch). bias-corrected as PyTorch's Adam. */
void mlp_adam_step(mlp_adam *a, const mlp_adam_hp *hp, float *params, float *grad);

/* ---- Stage compute --------------------------------------------------------------------------- */

/* What one in-flight micro-batch of one stage keeps between its forward and its backward. */
typedef struct mlp_stash {
    int stage, cap, n;               /* n: samples of the micro-batch stashed by the last forward */
    float *x;                        /* stage 0 only: the loaded input, cap * width[0] */
    uint8_t *labels;                 /* last stage only: the labels, cap */
    float *act[MLP_MAX_LAYERS];      /* per layer of the stage: its output after ReLU (probabilities on
                                        the model's last layer, after mlp_stage_loss) */
    float *dz[MLP_MAX_LAYERS];       /* per layer: gradient of its pre-activation (written by I, read by W) */
    struct mlp_layer_times *times;   /* NULL (mlp_stash_init's): not timed; else where the stage functions
                                        write each layer's time (a profiler sets it) */
} mlp_stash;

/* Seconds each layer of a stage took in the last forward (forward[k] for the stage's k-th layer) and
   backward (backward[k]: I sets it, W adds to it, so after B it is the layer's whole backward). For
   profiling per-layer costs (the stage partitioner's input); the clock reads cost ~50 ns a layer. */
typedef struct mlp_layer_times {
    double forward[MLP_MAX_LAYERS], backward[MLP_MAX_LAYERS];
} mlp_layer_times;

/* Allocate a stash of stage g for micro-batches of up to cap samples. Returns 0 or -1 (out of memory or a
   bad argument; *st zeroed). */
int mlp_stash_init(mlp_stash *st, const mlp_model *m, int stage, int cap);

/* Free a stash and zero it. Safe on a zeroed struct. */
void mlp_stash_free(mlp_stash *st);

/* Gather the samples idx[0 .. n-1] of d into the stash: pixels when it has x (stage 0), labels when it has
   labels (last stage). Returns -1 if n is outside [1, cap] or an index is outside d. */
int mlp_stash_load(mlp_stash *st, const mlp_data *d, const uint32_t *idx, int n);

/* Forward of stage g on n samples: in is the input activation (n * width[first[g]]), or NULL on stage 0 to
   use the stash's loaded x. The stage's activations go to the stash; out (n * mlp_stage_out_width, may be
   NULL) gets a copy of the stage's output. On the last stage act of the top layer holds the logits.
   Returns -1 on a bad argument. */
int mlp_stage_forward(const mlp_model *m, int stage, const float *params, mlp_stash *st, const float *in,
                      float *out, int n);

/* Last stage, after its forward: softmax of the logits in place (kept for the backward) and the mean
   cross-entropy over the stash's n samples against its labels; *correct (may be NULL) gets the number
   of argmax hits. Returns the loss (NaN on a bad argument or a non-finite logit). */
double mlp_stage_loss(const mlp_model *m, mlp_stash *st, int *correct);

/* I: gradient of stage g's input. grad_out is the gradient of its output (n * out width), or NULL on the
   last stage, which starts from its loss: dlogits = (softmax - onehot) * loss_scale (loss_scale = 1 / the
   batch's samples gives the batch mean). grad_in (n * input width) may be NULL (stage 0: not needed). Keeps
   in the stash what W needs. Returns -1 on a bad argument. */
int mlp_stage_backward_input(const mlp_model *m, int stage, const float *params, mlp_stash *st,
                             const float *grad_out, float *grad_in, float loss_scale);

/* W: add the gradient of stage g's parameters to grad (count[g] floats), after its I. in is the stage's
   input as in the forward (NULL on stage 0). Returns -1 on a bad argument. */
int mlp_stage_backward_weight(const mlp_model *m, int stage, mlp_stash *st, const float *in, float *grad);

/* B: mlp_stage_backward_input then mlp_stage_backward_weight, bit for bit. */
int mlp_stage_backward(const mlp_model *m, int stage, const float *params, mlp_stash *st, const float *in,
                       const float *grad_out, float *grad_in, float *grad, float loss_scale);

/* ---- Sample order ---------------------------------------------------------------------------- */

/* The order in which N parallel pipelines see the training set. Epoch e is a shuffle of all n samples
   (seeded by seed and e); it is cut into batches of `batch` samples, and batch b of the epoch goes to
   pipeline b % N in round b / N, so in one epoch every sample is seen at most once, by one pipeline.
   rounds_per_epoch = floor(n / (N * batch * round_multiple)) * round_multiple; the remainder of a
   shuffle is left out that epoch (drop-last). With N = 1 the order is the plain shuffled-batch order of
   the reference trainer. */
typedef struct mlp_order {
    int n, batch, pipes;
    int64_t rounds_per_epoch;
    uint64_t seed;
} mlp_order;

/* Set up an order; -1 (err set) when n < pipes * batch * round_multiple or an argument is < 1. */
int mlp_order_init(mlp_order *o, int n, int batch, int pipes, int round_multiple, uint64_t seed, char *err,
                   size_t errcap);

/* The permutation of one epoch, cached by whoever needs sample indices (one per thread). */
typedef struct mlp_perm {
    int64_t epoch; /* -1: none yet */
    int n;
    uint32_t *idx;
} mlp_perm;

/* Allocate a cache for n samples. Returns 0 or -1. */
int mlp_perm_init(mlp_perm *p, int n);

/* Free a cache. Safe on a zeroed struct. */
void mlp_perm_free(mlp_perm *p);

/* Fill idx[0 .. n-1] with the shuffle of epoch `epoch` under `seed` (Fisher-Yates on splitmix64). */
void mlp_shuffle(uint32_t *idx, int n, uint64_t seed, uint64_t epoch);

/* The sample indices (mb of them) of micro-batch `micro` of pipeline `pipe`'s batch in global round
   `round`, when a batch is cut into micro-batches of mb samples: a pointer into the cache, valid until
   the cache is asked for another epoch. NULL on a bad argument. */
const uint32_t *mlp_order_micro(const mlp_order *o, mlp_perm *cache, int pipe, int64_t round, int micro,
                                int mb);

/* ---- Reference trainer and evaluation -------------------------------------------------------- */

/* The non-pipelined trainer: one model, one thread; each batch runs its M micro-batches one after the
   other through every stage (forward of all stages, then backward of all stages), accumulating the
   gradients, then one Adam step per stage. */
typedef struct mlp_reference {
    const mlp_model *model;
    const mlp_data *data;
    mlp_order order; /* pipes = 1 */
    int micro, mb;   /* micro-batches per batch, samples per micro-batch */
    mlp_adam_hp adam;
    int64_t decay_steps; /* > 0: cosine decay of adam.lr over this many steps (mlp_lr_cosine); 0: constant */
    int64_t steps;       /* steps taken */
    mlp_net net;
    mlp_stash stash[MLP_MAX_LAYERS];
    float *act[MLP_MAX_LAYERS];  /* boundary g|g+1 activation, mb * out width */
    float *grad[MLP_MAX_LAYERS]; /* boundary g|g+1 gradient */
    float *one[MLP_MAX_LAYERS];  /* mlp_reference_batch_noise: one micro-batch's gradient of stage g (lazily) */
    float *pw[MLP_MAX_LAYERS];   /* and its preconditioner's squared weights */
    mlp_perm perm;
} mlp_reference;

/* Set up a reference trainer for model m on data: batches of `batch` samples cut into `micro`
   micro-batches (batch % micro == 0), weights from init_seed, order from order_seed (round_multiple 1).
   m and data must outlive it. Returns 0 or -1 (err set). */
int mlp_reference_init(mlp_reference *r, const mlp_model *m, const mlp_data *data, int batch, int micro,
                       const mlp_adam_hp *adam, uint64_t init_seed, uint64_t order_seed, char *err,
                       size_t errcap);

/* Free everything; safe on a zeroed struct. */
void mlp_reference_free(mlp_reference *r);

/* Forward and backward of batch `round` (global: epoch * rounds_per_epoch + batch of the epoch): the
   gradients accumulate in r->net.grad, no step. *loss (mean over the batch) and *correct may be NULL.
   Returns 0, or -1 on a non-finite loss. */
int mlp_reference_batch(mlp_reference *r, int64_t round, double *loss, int *correct);

/* mlp_reference_batch, measuring the gradient noise as well: *micro_sq gets the mean over the batch's
   micro-batches of |P g_u|^2 (g_u: the mean gradient over micro-batch u's samples, all stages' parameters),
   *batch_sq |P g|^2 of the batch's mean gradient (what the step uses): the two averages a gradient noise
   scale is estimated from (avgpipe_tune_noise_scale with b_small = batch / micro, b_big = batch). P is
   the identity with pre NULL, else Adam's preconditioner in the state of pre (a net over the same model:
   1 / (sqrt(v / (1 - beta2^t)) + eps) per parameter, hp's beta2 and eps): the noise in the geometry Adam
   steps in, which is what decides how much a larger batch helps it (Pollux, OSDI'21, does the same).
   Needs micro >= 2 and the gradients zero (after mlp_reference_step or init). The gradients accumulate in
   r->net.grad as with mlp_reference_batch, summed in another order (equal up to rounding). Returns 0, or
   -1 on a non-finite loss, out of memory, or micro < 2. */
int mlp_reference_batch_noise(mlp_reference *r, int64_t round, const mlp_net *pre, const mlp_adam_hp *hp, double *loss,
                              int *correct, double *micro_sq, double *batch_sq);

/* One Adam step on every stage (zeroes the gradients), at the learning rate of step r->steps. */
void mlp_reference_step(mlp_reference *r);

/* Accuracy of the parameter set params[0 .. G-1] (one buffer per stage) on d, in chunks of 500 samples;
   *loss (may be NULL) gets the mean cross-entropy. Returns the accuracy in [0, 1], or -1 when out of
   memory or d is empty. */
double mlp_evaluate(const mlp_model *m, const float *const *params, const mlp_data *d, double *loss);

/* Save a parameter set (one buffer per stage) to path: "MLPP", layers, widths (int32 little-endian as the
   host writes them), then every layer's weights and bias as float32, in layer order, so the file does not
   depend on the stage grouping (two runs can be compared with cmp). Returns 0 or -1 (err set). */
int mlp_params_save(const char *path, const mlp_model *m, const float *const *params, char *err, size_t errcap);

#ifdef __cplusplus
}
#endif
#endif /* MLP_H */

/* ============================================================================================ */
/* Implementation                                                                               */
/* ============================================================================================ */
#if defined(MLP_IMPLEMENTATION) && !defined(MLP_IMPLEMENTATION_INCLUDED)
#define MLP_IMPLEMENTATION_INCLUDED

#include <cblas.h>
#include <errno.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zlib.h>

#define MLP__MAX_SAMPLES (1 << 24) /* refuse files that claim more (a corrupt header, not a data set) */
#define MLP__MAX_DIM (1 << 20)

/* Seconds on a monotonic clock where POSIX has one (the caller defined _POSIX_C_SOURCE), else C11's. */
static double mlp__now(void) {
    struct timespec ts;
#if defined(CLOCK_MONOTONIC)
    clock_gettime(CLOCK_MONOTONIC, &ts);
#else
    timespec_get(&ts, TIME_UTC);
#endif
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void mlp__err(char *err, size_t cap, const char *fmt, ...) {
    va_list ap;
    if (!err || cap == 0) return;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
}

/* ---- IDX loading ------------------------------------------------------------------------------ */

/* Describe a zlib read failure: the system's error, or zlib's message without the path gzerror puts first. */
static void mlp__gz_fail(gzFile f, const char *path, char *err, size_t cap) {
    int zerr = 0;
    const char *msg = gzerror(f, &zerr);
    size_t plen = strlen(path);
    if (zerr == Z_ERRNO) {
        mlp__err(err, cap, "%s: cannot read: %s", path, strerror(errno));
        return;
    }
    if (strncmp(msg, path, plen) == 0 && msg[plen] == ':') msg += plen + 1 + (msg[plen + 1] == ' ');
    mlp__err(err, cap, "%s: corrupt compressed data (zlib: %s)", path, msg);
}

/* Read exactly `len` bytes; -1 with a message on a short read (truncated) or a zlib error. */
static int mlp__gz_read(gzFile f, const char *path, void *buf, size_t len, const char *what, char *err,
                        size_t cap) {
    unsigned char *p = (unsigned char *)buf;
    size_t done = 0;
    while (done < len) {
        size_t want = len - done > (1u << 30) ? (1u << 30) : len - done;
        int got = gzread(f, p + done, (unsigned)want);
        if (got < 0) {
            mlp__gz_fail(f, path, err, cap);
            return -1;
        }
        if (got == 0) {
            mlp__err(err, cap, "%s: truncated: the %s take %zu bytes, the file ends after %zu of them", path, what, len, done);
            return -1;
        }
        done += (size_t)got;
    }
    return 0;
}

/* Fail if anything follows the data (a wrong file that happens to start like an IDX file). */
static int mlp__gz_at_end(gzFile f, const char *path, char *err, size_t cap) {
    unsigned char extra;
    int got = gzread(f, &extra, 1);
    if (got < 0) {
        mlp__gz_fail(f, path, err, cap);
        return -1;
    }
    if (got > 0) {
        mlp__err(err, cap, "%s: trailing bytes after the data the header announces", path);
        return -1;
    }
    return 0;
}

static uint32_t mlp__be32(const unsigned char *b) {
    return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | (uint32_t)b[3];
}

/* Open an IDX file and read its header: magic 0x000008<ndims>, then ndims big-endian sizes. */
static gzFile mlp__idx_open(const char *path, int ndims, uint32_t *dims, char *err, size_t cap) {
    unsigned char head[16];
    uint32_t magic, want = 0x00000800u | (uint32_t)ndims;
    gzFile f;
    int i;
    errno = 0;
    f = gzopen(path, "rb");
    if (!f) {
        mlp__err(err, cap, "%s: cannot open: %s", path, errno ? strerror(errno) : "out of memory");
        return NULL;
    }
    if (mlp__gz_read(f, path, head, 4 + 4 * (size_t)ndims, "header's fields", err, cap) != 0) {
        gzclose(f);
        return NULL;
    }
    magic = mlp__be32(head);
    if (magic != want) {
        mlp__err(err, cap, "%s: bad magic number 0x%08x (expected 0x%08x: unsigned bytes, %d dimension%s)", path,
                 (unsigned)magic, (unsigned)want, ndims, ndims > 1 ? "s" : "");
        gzclose(f);
        return NULL;
    }
    for (i = 0; i < ndims; i++) dims[i] = mlp__be32(head + 4 + 4 * i);
    return f;
}

static int mlp__load_images(mlp_data *d, const char *path, int pixels, char *err, size_t cap) {
    uint32_t dims[3];
    unsigned char *raw;
    size_t total, i;
    gzFile f = mlp__idx_open(path, 3, dims, err, cap);
    if (!f) return -1;
    if (dims[0] < 1 || dims[0] > MLP__MAX_SAMPLES || dims[1] < 1 || dims[2] < 1 ||
        (uint64_t)dims[1] * dims[2] > MLP__MAX_DIM) {
        mlp__err(err, cap, "%s: implausible dimensions %u x %u x %u", path, (unsigned)dims[0], (unsigned)dims[1],
                 (unsigned)dims[2]);
        gzclose(f);
        return -1;
    }
    d->n = (int)dims[0];
    d->rows = (int)dims[1];
    d->cols = (int)dims[2];
    d->dim = d->rows * d->cols;
    if (!pixels) { /* the header says what a stage that never reads a pixel needs to know */
        gzclose(f);
        return 0;
    }
    total = (size_t)d->n * (size_t)d->dim;
    raw = (unsigned char *)malloc(total);
    d->x = (float *)malloc(total * sizeof(float));
    if (!raw || !d->x) {
        mlp__err(err, cap, "%s: out of memory for %zu pixels", path, total);
        free(raw);
        gzclose(f);
        return -1;
    }
    if (mlp__gz_read(f, path, raw, total, "pixels", err, cap) != 0 || mlp__gz_at_end(f, path, err, cap) != 0) {
        free(raw);
        gzclose(f);
        return -1;
    }
    for (i = 0; i < total; i++) d->x[i] = (float)raw[i] * (1.0f / 255.0f);
    free(raw);
    gzclose(f);
    return 0;
}

static int mlp__load_labels(mlp_data *d, const char *path, char *err, size_t cap) {
    uint32_t n;
    int i;
    gzFile f = mlp__idx_open(path, 1, &n, err, cap);
    if (!f) return -1;
    if (n != (uint32_t)d->n) {
        mlp__err(err, cap, "%s: %u labels for %d images", path, (unsigned)n, d->n);
        gzclose(f);
        return -1;
    }
    d->y = (uint8_t *)malloc((size_t)n);
    if (!d->y) {
        mlp__err(err, cap, "%s: out of memory", path);
        gzclose(f);
        return -1;
    }
    if (mlp__gz_read(f, path, d->y, n, "labels", err, cap) != 0 || mlp__gz_at_end(f, path, err, cap) != 0) {
        gzclose(f);
        return -1;
    }
    gzclose(f);
    for (i = 0; i < d->n; i++) {
        if (d->y[i] >= MLP_CLASSES) {
            mlp__err(err, cap, "%s: label %d of sample %d is not below %d", path, d->y[i], i, MLP_CLASSES);
            return -1;
        }
    }
    return 0;
}

int mlp_data_load_parts(mlp_data *d, const char *images_path, const char *labels_path, int parts, char *err, size_t errcap) {
    if (!d || !images_path || !labels_path || !(parts & (MLP_PIXELS | MLP_LABELS))) {
        mlp__err(err, errcap, "mlp_data_load: NULL argument or no part to load");
        return -1;
    }
    memset(d, 0, sizeof *d);
    if (mlp__load_images(d, images_path, parts & MLP_PIXELS, err, errcap) != 0 ||
        ((parts & MLP_LABELS) && mlp__load_labels(d, labels_path, err, errcap) != 0)) {
        mlp_data_free(d);
        return -1;
    }
    return 0;
}

int mlp_data_load(mlp_data *d, const char *images_path, const char *labels_path, char *err, size_t errcap) {
    return mlp_data_load_parts(d, images_path, labels_path, MLP_PIXELS | MLP_LABELS, err, errcap);
}

static int mlp__load_set(const char *dir, const char *prefix, mlp_data *d, int parts, char *err, size_t cap) {
    char img[4096], lab[4096];
    int a = snprintf(img, sizeof img, "%s/%s-images-idx3-ubyte.gz", dir, prefix);
    int b = snprintf(lab, sizeof lab, "%s/%s-labels-idx1-ubyte.gz", dir, prefix);
    if (a < 0 || b < 0 || (size_t)a >= sizeof img || (size_t)b >= sizeof lab) {
        mlp__err(err, cap, "%s: directory name too long", dir);
        return -1;
    }
    return mlp_data_load_parts(d, img, lab, parts, err, cap);
}

int mlp_data_load_fashion_parts(const char *dir, mlp_data *train, int train_parts, mlp_data *test, int test_parts, char *err,
                                size_t errcap) {
    if (!dir || !train || !test) {
        mlp__err(err, errcap, "mlp_data_load_fashion: NULL argument");
        return -1;
    }
    memset(test, 0, sizeof *test);
    if (mlp__load_set(dir, "train", train, train_parts, err, errcap) != 0) return -1;
    if (!test_parts) return 0;
    if (mlp__load_set(dir, "t10k", test, test_parts, err, errcap) != 0) {
        mlp_data_free(train);
        return -1;
    }
    if (test->dim != train->dim) {
        mlp__err(err, errcap, "%s: test images are %dx%d, training images %dx%d", dir, test->rows, test->cols,
                 train->rows, train->cols);
        mlp_data_free(train);
        mlp_data_free(test);
        return -1;
    }
    return 0;
}

int mlp_data_load_fashion(const char *dir, mlp_data *train, mlp_data *test, char *err, size_t errcap) {
    return mlp_data_load_fashion_parts(dir, train, MLP_PIXELS | MLP_LABELS, test, MLP_PIXELS | MLP_LABELS, err, errcap);
}

void mlp_data_stats(const mlp_data *d, float *mean, float *std) {
    double s = 0, s2 = 0;
    size_t i, total = d->x ? (size_t)d->n * (size_t)d->dim : 0;
    for (i = 0; i < total; i++) {
        s += d->x[i];
        s2 += (double)d->x[i] * d->x[i];
    }
    if (total == 0) total = 1;
    s /= (double)total;
    *mean = (float)s;
    *std = (float)sqrt(s2 / (double)total - s * s > 0 ? s2 / (double)total - s * s : 0);
}

void mlp_data_normalize(mlp_data *d, float mean, float std) {
    size_t i, total = d->x ? (size_t)d->n * (size_t)d->dim : 0;
    float inv = std > 0 ? 1.0f / std : 1.0f;
    for (i = 0; i < total; i++) d->x[i] = (d->x[i] - mean) * inv;
}

void mlp_data_truncate(mlp_data *d, int n) {
    if (n >= 0 && n < d->n) d->n = n;
}

void mlp_data_free(mlp_data *d) {
    if (!d) return;
    free(d->x);
    free(d->y);
    memset(d, 0, sizeof *d);
}

/* ---- Model shape ------------------------------------------------------------------------------ */

static double mlp__layer_cost(const mlp_model *m, int l) {
    return (double)m->width[l] * m->width[l + 1];
}

/* The smallest possible cost of the most expensive stage, over contiguous groupings of the layers into
   m->stages groups (dynamic programme over (stages used, layers covered); L <= 16). */
static double mlp__partition_bound(const mlp_model *m) {
    double best[MLP_MAX_LAYERS + 1][MLP_MAX_LAYERS + 1];
    int L = m->layers, G = m->stages, g, l, k;
    for (g = 0; g <= G; g++)
        for (l = 0; l <= L; l++) best[g][l] = HUGE_VAL;
    best[0][0] = 0;
    for (g = 1; g <= G; g++) {
        for (l = g; l <= L; l++) {
            double group = 0;
            for (k = l - 1; k >= g - 1; k--) { /* the last group: layers k .. l-1 */
                group += mlp__layer_cost(m, k);
                if (fmax(best[g - 1][k], group) < best[g][l]) best[g][l] = fmax(best[g - 1][k], group);
            }
        }
    }
    return best[G][L];
}

static void mlp__layout(mlp_model *m);

/* Group the layers: no stage costs more than the bound, and among such groupings the sum of squared stage
   costs is least (the other stages as even as the bound allows). */
static void mlp__partition(mlp_model *m) {
    double sq[MLP_MAX_LAYERS + 1][MLP_MAX_LAYERS + 1], bound = mlp__partition_bound(m);
    int cut[MLP_MAX_LAYERS + 1][MLP_MAX_LAYERS + 1];
    int L = m->layers, G = m->stages, g, l, k;
    for (g = 0; g <= G; g++)
        for (l = 0; l <= L; l++) sq[g][l] = HUGE_VAL, cut[g][l] = 0;
    sq[0][0] = 0;
    for (g = 1; g <= G; g++) {
        for (l = g; l <= L; l++) {
            double group = 0;
            for (k = l - 1; k >= g - 1; k--) {
                group += mlp__layer_cost(m, k);
                if (group > bound) break;
                if (sq[g - 1][k] + group * group < sq[g][l]) sq[g][l] = sq[g - 1][k] + group * group, cut[g][l] = k;
            }
        }
    }
    m->first[G] = L;
    for (g = G, l = L; g > 0; g--) {
        l = cut[g][l];
        m->first[g - 1] = l;
    }
}

int mlp_model_init(mlp_model *m, int layers, const int *width, int stages, char *err, size_t errcap) {
    int l;
    if (!m || !width) {
        mlp__err(err, errcap, "mlp_model_init: NULL argument");
        return -1;
    }
    memset(m, 0, sizeof *m);
    if (layers < 1 || layers > MLP_MAX_LAYERS) {
        mlp__err(err, errcap, "%d layers: a model has 1 to %d", layers, MLP_MAX_LAYERS);
        return -1;
    }
    for (l = 0; l <= layers; l++) {
        if (width[l] < 1 || width[l] > MLP__MAX_DIM) {
            mlp__err(err, errcap, "width %d of layer boundary %d: must be 1 to %d", width[l], l, MLP__MAX_DIM);
            return -1;
        }
    }
    if (width[layers] != MLP_CLASSES) {
        mlp__err(err, errcap, "the last layer has %d outputs, the data set %d classes", width[layers], MLP_CLASSES);
        return -1;
    }
    if (stages < 1 || stages > layers) {
        mlp__err(err, errcap, "%d stages for a model of %d layers: each stage needs at least one layer", stages,
                 layers);
        return -1;
    }
    m->layers = layers;
    m->stages = stages;
    memcpy(m->width, width, sizeof(int) * (size_t)(layers + 1));
    mlp__partition(m);
    mlp__layout(m);
    return 0;
}

/* Offsets of each layer in its stage's buffer, and the buffers' sizes, from m->first. */
static void mlp__layout(mlp_model *m) {
    int g, l;
    for (g = 0; g < m->stages; g++) {
        size_t off = 0;
        for (l = m->first[g]; l < m->first[g + 1]; l++) {
            m->offset[l] = off;
            off += (size_t)m->width[l + 1] * (size_t)m->width[l] + (size_t)m->width[l + 1];
        }
        m->count[g] = off;
    }
}

int mlp_model_regroup(mlp_model *m, int stages, const int *split, char *err, size_t errcap) {
    int g, l = 0;
    if (!m || stages < 1 || stages > m->layers) {
        mlp__err(err, errcap, "%d stages for a model of %d layers: each stage needs at least one layer", stages, m ? m->layers : 0);
        return -1;
    }
    for (g = 0; split && g < stages; g++) {
        if (split[g] < 1) {
            mlp__err(err, errcap, "stage %d would hold %d layers (each stage needs at least one)", g, split[g]);
            return -1;
        }
        l += split[g];
    }
    if (split && l != m->layers) {
        mlp__err(err, errcap, "the stages hold %d layers in all, the model has %d", l, m->layers);
        return -1;
    }
    memset(m->first, 0, sizeof m->first);
    memset(m->count, 0, sizeof m->count);
    m->stages = stages;
    if (!split) {
        mlp__partition(m);
    } else {
        for (g = 0, l = 0; g < stages; l += split[g], g++) m->first[g] = l;
        m->first[stages] = m->layers;
    }
    mlp__layout(m);
    return 0;
}

int mlp_split_parse(const char *text, int *split, int cap, int *n, char *err, size_t errcap) {
    const char *p = text ? text : "";
    *n = 0;
    while (*p) {
        char *end;
        long v;
        errno = 0;
        v = strtol(p, &end, 10);
        if (end == p || errno || v < 1 || v > MLP_MAX_LAYERS || (*end != ',' && *end != '\0') || (*end == ',' && !end[1])) {
            mlp__err(err, errcap, "split \"%s\": expected layers per stage as positive integers separated by commas (\"1,1,2\")", text);
            return -1;
        }
        if (*n >= cap) {
            mlp__err(err, errcap, "split \"%s\": more than %d stages", text, cap);
            return -1;
        }
        split[(*n)++] = (int)v;
        p = *end ? end + 1 : end;
    }
    if (*n == 0) {
        mlp__err(err, errcap, "split: empty (expected layers per stage, \"1,1,2\")");
        return -1;
    }
    return 0;
}

int mlp_model_parse(mlp_model *m, int inputs, const char *hidden, int stages, char *err, size_t errcap) {
    int width[MLP_MAX_LAYERS + 1], n = 0;
    const char *p = hidden ? hidden : "";
    width[n++] = inputs;
    while (*p) {
        char *end;
        long v;
        errno = 0;
        v = strtol(p, &end, 10);
        if (end == p || errno || v < 1 || v > MLP__MAX_DIM || (*end != ',' && *end != '\0')) {
            mlp__err(err, errcap, "hidden widths \"%s\": expected positive integers separated by commas", hidden);
            return -1;
        }
        if (n >= MLP_MAX_LAYERS) {
            mlp__err(err, errcap, "hidden widths \"%s\": at most %d hidden layers", hidden, MLP_MAX_LAYERS - 1);
            return -1;
        }
        width[n++] = (int)v;
        p = *end ? end + 1 : end;
        if (*end == ',' && *p == '\0') {
            mlp__err(err, errcap, "hidden widths \"%s\": trailing comma", hidden);
            return -1;
        }
    }
    width[n] = MLP_CLASSES;
    return mlp_model_init(m, n, width, stages, err, errcap);
}

int mlp_stage_out_width(const mlp_model *m, int stage) {
    return m->width[m->first[stage + 1]];
}

void mlp_model_describe(const mlp_model *m, char *buf, size_t cap) {
    size_t len = 0;
    int l, g;
    if (!buf || cap == 0) return;
    buf[0] = '\0';
    for (l = 0; l <= m->layers && len < cap; l++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%d", l ? "-" : "", m->width[l]);
    for (g = 0; g < m->stages && len < cap; g++) {
        len += (size_t)snprintf(buf + len, cap - len, "%s%d", g ? " | " : ", stages [", m->width[m->first[g]]);
        for (l = m->first[g]; l < m->first[g + 1] && len < cap; l++)
            len += (size_t)snprintf(buf + len, cap - len, "-%d", m->width[l + 1]);
    }
    if (len < cap) snprintf(buf + len, cap - len, "]");
}

/* ---- Random numbers, initialisation ---------------------------------------------------------- */

static uint64_t mlp__splitmix(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in (0, 1]: never 0, so log() below is finite. */
static double mlp__uniform(uint64_t *state) {
    return ((double)(mlp__splitmix(state) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

void mlp_init_stage(const mlp_model *m, int stage, float *params, uint64_t seed) {
    int l;
    for (l = m->first[stage]; l < m->first[stage + 1]; l++) {
        uint64_t state = seed * 0x2545f4914f6cdd1dull + (uint64_t)l + 1;
        size_t nw = (size_t)m->width[l + 1] * (size_t)m->width[l], i;
        float *w = params + m->offset[l];
        double std = sqrt(2.0 / m->width[l]);
        (void)mlp__splitmix(&state);
        for (i = 0; i < nw; i++) { /* Box-Muller, one normal per pair of uniforms (simple, deterministic) */
            double u1 = mlp__uniform(&state), u2 = mlp__uniform(&state);
            w[i] = (float)(std * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
        }
        memset(w + nw, 0, sizeof(float) * (size_t)m->width[l + 1]);
    }
}

/* ---- Nets and Adam ---------------------------------------------------------------------------- */

int mlp_net_init(mlp_net *net, const mlp_model *m, uint64_t seed) {
    int g;
    memset(net, 0, sizeof *net);
    net->model = m;
    for (g = 0; g < m->stages; g++) {
        size_t c = m->count[g];
        net->params[g] = (float *)malloc(c * sizeof(float));
        net->grad[g] = (float *)calloc(c, sizeof(float));
        net->adam[g].count = c;
        net->adam[g].m = (float *)calloc(c, sizeof(float));
        net->adam[g].v = (float *)calloc(c, sizeof(float));
        if (!net->params[g] || !net->grad[g] || !net->adam[g].m || !net->adam[g].v) {
            mlp_net_free(net);
            return -1;
        }
        mlp_init_stage(m, g, net->params[g], seed);
    }
    return 0;
}

void mlp_net_free(mlp_net *net) {
    int g;
    if (!net) return;
    for (g = 0; g < MLP_MAX_LAYERS; g++) {
        free(net->params[g]);
        free(net->grad[g]);
        free(net->adam[g].m);
        free(net->adam[g].v);
    }
    memset(net, 0, sizeof *net);
}

void mlp_net_copy_params(mlp_net *dst, const mlp_net *src) {
    int g;
    for (g = 0; g < src->model->stages; g++)
        memcpy(dst->params[g], src->params[g], src->model->count[g] * sizeof(float));
}

mlp_adam_hp mlp_adam_defaults(void) {
    mlp_adam_hp hp;
    hp.lr = 1e-3f;
    hp.beta1 = 0.9f;
    hp.beta2 = 0.999f;
    hp.eps = 1e-8f;
    hp.weight_decay = 0.0f;
    return hp;
}

float mlp_lr_cosine(float base, int64_t step, int64_t total) {
    if (total <= 0) return base;
    if (step >= total) return 0.0f;
    return (float)(base * 0.5 * (1.0 + cos(3.141592653589793 * (double)step / (double)total)));
}

/* One Adam update of element i (the scalar form, and the tail of the SSE loop below). */
#define MLP__ADAM_ONE(i)                                                                            \
    do {                                                                                            \
        float g_ = grad[i] + wd * params[i];                                                        \
        m[i] = b1 * m[i] + (1.0f - b1) * g_;                                                        \
        v[i] = b2 * v[i] + (1.0f - b2) * g_ * g_;                                                   \
        params[i] -= step * m[i] / (sqrtf(v[i]) * inv_sqrt_bc2 + eps);                              \
        grad[i] = 0.0f;                                                                             \
    } while (0)

void mlp_adam_step(mlp_adam *a, const mlp_adam_hp *hp, float *params, float *grad) {
    size_t i = 0, n = a->count;
    float b1 = hp->beta1, b2 = hp->beta2, wd = hp->weight_decay, eps = hp->eps, step, inv_sqrt_bc2;
    float *m = a->m, *v = a->v;
    a->t++;
    step = (float)(hp->lr / (1.0 - pow(b1, (double)a->t)));
    inv_sqrt_bc2 = (float)(1.0 / sqrt(1.0 - pow(b2, (double)a->t)));
#if defined(__SSE2__)
    /* Four at a time: the compiler keeps this loop scalar (sqrtf may set errno unless -fno-math-errno),
       which made Adam a quarter of a batch's time. The same IEEE operations in the same order as the
       scalar form (no FMA), so the results are bit for bit those of MLP__ADAM_ONE. */
    {
        const __m128 vb1 = _mm_set1_ps(b1), vb2 = _mm_set1_ps(b2), c1 = _mm_set1_ps(1.0f - b1), c2 = _mm_set1_ps(1.0f - b2);
        const __m128 vwd = _mm_set1_ps(wd), vstep = _mm_set1_ps(step), vbc = _mm_set1_ps(inv_sqrt_bc2), veps = _mm_set1_ps(eps);
        for (; i + 4 <= n; i += 4) {
            __m128 p = _mm_loadu_ps(params + i), g = _mm_add_ps(_mm_loadu_ps(grad + i), _mm_mul_ps(vwd, p));
            __m128 mm = _mm_add_ps(_mm_mul_ps(vb1, _mm_loadu_ps(m + i)), _mm_mul_ps(c1, g));
            __m128 vv = _mm_add_ps(_mm_mul_ps(vb2, _mm_loadu_ps(v + i)), _mm_mul_ps(_mm_mul_ps(c2, g), g));
            __m128 den = _mm_add_ps(_mm_mul_ps(_mm_sqrt_ps(vv), vbc), veps);
            _mm_storeu_ps(m + i, mm);
            _mm_storeu_ps(v + i, vv);
            _mm_storeu_ps(params + i, _mm_sub_ps(p, _mm_div_ps(_mm_mul_ps(vstep, mm), den)));
            _mm_storeu_ps(grad + i, _mm_setzero_ps());
        }
    }
#endif
    for (; i < n; i++) MLP__ADAM_ONE(i);
}

/* ---- Stage compute ---------------------------------------------------------------------------- */

void mlp_stash_free(mlp_stash *st) {
    int k;
    if (!st) return;
    free(st->x);
    free(st->labels);
    for (k = 0; k < MLP_MAX_LAYERS; k++) {
        free(st->act[k]);
        free(st->dz[k]);
    }
    memset(st, 0, sizeof *st);
}

int mlp_stash_init(mlp_stash *st, const mlp_model *m, int stage, int cap) {
    int l, k, ok = 1;
    memset(st, 0, sizeof *st);
    if (!m || stage < 0 || stage >= m->stages || cap < 1) return -1;
    st->stage = stage;
    st->cap = cap;
    if (stage == 0) {
        st->x = (float *)malloc(sizeof(float) * (size_t)cap * (size_t)m->width[0]);
        ok = st->x != NULL;
    }
    if (stage == m->stages - 1) {
        st->labels = (uint8_t *)malloc((size_t)cap);
        ok = ok && st->labels != NULL;
    }
    for (l = m->first[stage]; l < m->first[stage + 1]; l++) {
        size_t sz = sizeof(float) * (size_t)cap * (size_t)m->width[l + 1];
        k = l - m->first[stage];
        st->act[k] = (float *)malloc(sz);
        st->dz[k] = (float *)malloc(sz);
        ok = ok && st->act[k] && st->dz[k];
    }
    if (!ok) {
        mlp_stash_free(st);
        return -1;
    }
    return 0;
}

int mlp_stash_load(mlp_stash *st, const mlp_data *d, const uint32_t *idx, int n) {
    int i;
    if (n < 1 || n > st->cap || !idx || (st->x && !d->x) || (st->labels && !d->y)) return -1; /* a part not loaded */
    for (i = 0; i < n; i++) {
        if (idx[i] >= (uint32_t)d->n) return -1;
        if (st->x) memcpy(st->x + (size_t)i * d->dim, d->x + (size_t)idx[i] * d->dim, sizeof(float) * (size_t)d->dim);
        if (st->labels) st->labels[i] = d->y[idx[i]];
    }
    return 0;
}

/* Y = X W^T + b for n rows (row-major), then ReLU unless l is the model's last layer. */
static void mlp__linear_forward(const mlp_model *m, int l, const float *params_l, const float *x, float *y, int n) {
    int in = m->width[l], out = m->width[l + 1], i, j;
    const float *w = params_l, *b = params_l + (size_t)out * in;
    for (i = 0; i < n; i++) memcpy(y + (size_t)i * out, b, sizeof(float) * (size_t)out);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w, in, 1.0f, y, out);
    if (l == m->layers - 1) return;
    for (i = 0; i < n; i++)
        for (j = 0; j < out; j++)
            if (!(y[(size_t)i * out + j] > 0.0f)) y[(size_t)i * out + j] = 0.0f;
}

static const float *mlp__stage_input(const mlp_stash *st, const float *in) {
    return in ? in : st->x;
}

int mlp_stage_forward(const mlp_model *m, int stage, const float *params, mlp_stash *st, const float *in,
                      float *out, int n) {
    int l, first, top;
    const float *x = mlp__stage_input(st, in);
    if (!m || !params || !st || stage != st->stage || n < 1 || n > st->cap || !x) return -1;
    first = m->first[stage];
    top = m->first[stage + 1] - 1 - first;
    for (l = first; l <= first + top; l++) {
        double t0 = st->times ? mlp__now() : 0;
        mlp__linear_forward(m, l, params + m->offset[l], x, st->act[l - first], n);
        x = st->act[l - first];
        if (st->times) st->times->forward[l - first] = mlp__now() - t0;
    }
    st->n = n;
    if (out) memcpy(out, st->act[top], sizeof(float) * (size_t)n * (size_t)mlp_stage_out_width(m, stage));
    return 0;
}

double mlp_stage_loss(const mlp_model *m, mlp_stash *st, int *correct) {
    int i, j, hits = 0, top;
    double loss = 0;
    float *z;
    if (!m || !st || st->stage != m->stages - 1 || !st->labels || st->n < 1) return NAN;
    top = m->first[m->stages] - 1 - m->first[st->stage];
    for (i = 0; i < st->n; i++) {
        float mx, sum = 0.0f;
        int arg = 0;
        z = st->act[top] + (size_t)i * MLP_CLASSES;
        mx = z[0];
        for (j = 1; j < MLP_CLASSES; j++)
            if (z[j] > mx) mx = z[j], arg = j;
        for (j = 0; j < MLP_CLASSES; j++) sum += (z[j] = expf(z[j] - mx));
        loss -= log((double)z[st->labels[i]] / sum);
        for (j = 0; j < MLP_CLASSES; j++) z[j] /= sum;
        hits += arg == st->labels[i];
    }
    if (correct) *correct = hits;
    return loss / st->n;
}

/* dX = dZ W for n rows: the gradient of layer l's input. */
static void mlp__linear_dx(const mlp_model *m, int l, const float *w, const float *dz, float *dx, int n) {
    int in = m->width[l], out = m->width[l + 1];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, in, out, 1.0f, dz, out, w, in, 0.0f, dx, in);
}

/* dW += dZ^T X and db += column sums of dZ, for n rows. */
static void mlp__linear_dw(const mlp_model *m, int l, const float *dz, const float *x, float *grad_l, int n) {
    int in = m->width[l], out = m->width[l + 1], i, j;
    float *gb = grad_l + (size_t)out * in;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, n, 1.0f, dz, out, x, in, 1.0f, grad_l, in);
    for (i = 0; i < n; i++)
        for (j = 0; j < out; j++) gb[j] += dz[(size_t)i * out + j];
}

/* dz = g where a > 0, else 0 (the ReLU's derivative, from its output). */
static void mlp__relu_back(float *dz, const float *g, const float *a, size_t count) {
    size_t i;
    for (i = 0; i < count; i++) dz[i] = a[i] > 0.0f ? g[i] : 0.0f;
}

/* The gradient at the last stage's top layer: (softmax - onehot) * scale. */
static void mlp__loss_grad(const mlp_stash *st, const float *probs, float *dz, float scale) {
    int i, j;
    for (i = 0; i < st->n; i++) {
        for (j = 0; j < MLP_CLASSES; j++) {
            float p = probs[(size_t)i * MLP_CLASSES + j];
            dz[(size_t)i * MLP_CLASSES + j] = (p - (j == st->labels[i] ? 1.0f : 0.0f)) * scale;
        }
    }
}

int mlp_stage_backward_input(const mlp_model *m, int stage, const float *params, mlp_stash *st,
                             const float *grad_out, float *grad_in, float loss_scale) {
    int first, top, k, last;
    if (!m || !params || !st || stage != st->stage || st->n < 1) return -1;
    first = m->first[stage];
    top = m->first[stage + 1] - 1 - first;
    last = stage == m->stages - 1;
    if (last && !grad_out) {
        if (!st->labels) return -1;
        mlp__loss_grad(st, st->act[top], st->dz[top], loss_scale);
    } else if (grad_out && !last) {
        mlp__relu_back(st->dz[top], grad_out, st->act[top], (size_t)st->n * (size_t)m->width[first + top + 1]);
    } else {
        return -1; /* the last stage starts from its loss, every other from grad_out */
    }
    for (k = top; k >= 0; k--) {
        const float *w = params + m->offset[first + k];
        float *dx = k > 0 ? st->dz[k - 1] : grad_in;
        double t0 = st->times ? mlp__now() : 0;
        if (dx) {
            mlp__linear_dx(m, first + k, w, st->dz[k], dx, st->n);
            if (k > 0) mlp__relu_back(dx, dx, st->act[k - 1], (size_t)st->n * (size_t)m->width[first + k]);
        }
        if (st->times) st->times->backward[k] = mlp__now() - t0;
    }
    return 0;
}

int mlp_stage_backward_weight(const mlp_model *m, int stage, mlp_stash *st, const float *in, float *grad) {
    int first, top, k;
    const float *x0 = mlp__stage_input(st, in);
    if (!m || !st || !grad || stage != st->stage || st->n < 1 || !x0) return -1;
    first = m->first[stage];
    top = m->first[stage + 1] - 1 - first;
    for (k = top; k >= 0; k--) {
        const float *x = k > 0 ? st->act[k - 1] : x0;
        double t0 = st->times ? mlp__now() : 0;
        mlp__linear_dw(m, first + k, st->dz[k], x, grad + m->offset[first + k], st->n);
        if (st->times) st->times->backward[k] += mlp__now() - t0;
    }
    return 0;
}

int mlp_stage_backward(const mlp_model *m, int stage, const float *params, mlp_stash *st, const float *in,
                       const float *grad_out, float *grad_in, float *grad, float loss_scale) {
    if (mlp_stage_backward_input(m, stage, params, st, grad_out, grad_in, loss_scale) != 0) return -1;
    return mlp_stage_backward_weight(m, stage, st, in, grad);
}

/* ---- Sample order ----------------------------------------------------------------------------- */

int mlp_order_init(mlp_order *o, int n, int batch, int pipes, int round_multiple, uint64_t seed, char *err,
                   size_t errcap) {
    int64_t per_round;
    if (!o || n < 1 || batch < 1 || pipes < 1 || round_multiple < 1) {
        mlp__err(err, errcap, "sample order: samples, batch, pipelines and round multiple must be >= 1");
        return -1;
    }
    per_round = (int64_t)pipes * batch * round_multiple;
    if (per_round > n) {
        mlp__err(err, errcap, "%d training samples cannot fill %d pipeline%s x %d batch%s of %d samples", n, pipes,
                 pipes > 1 ? "s" : "", round_multiple, round_multiple > 1 ? "es" : "", batch);
        return -1;
    }
    o->n = n;
    o->batch = batch;
    o->pipes = pipes;
    o->seed = seed;
    o->rounds_per_epoch = (int64_t)(n / per_round) * round_multiple;
    return 0;
}

int mlp_perm_init(mlp_perm *p, int n) {
    p->epoch = -1;
    p->n = n;
    p->idx = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(n > 0 ? n : 1));
    return p->idx ? 0 : -1;
}

void mlp_perm_free(mlp_perm *p) {
    if (!p) return;
    free(p->idx);
    memset(p, 0, sizeof *p);
}

void mlp_shuffle(uint32_t *idx, int n, uint64_t seed, uint64_t epoch) {
    uint64_t state = seed ^ (epoch + 1) * 0x9e3779b97f4a7c15ull;
    int i;
    for (i = 0; i < n; i++) idx[i] = (uint32_t)i;
    for (i = n - 1; i > 0; i--) {
        uint32_t j = (uint32_t)(((mlp__splitmix(&state) >> 32) * (uint64_t)(i + 1)) >> 32);
        uint32_t t = idx[i];
        idx[i] = idx[j];
        idx[j] = t;
    }
}

const uint32_t *mlp_order_micro(const mlp_order *o, mlp_perm *cache, int pipe, int64_t round, int micro,
                                int mb) {
    int64_t epoch, local, start;
    if (!o || !cache || !cache->idx || cache->n != o->n || pipe < 0 || pipe >= o->pipes || round < 0 ||
        micro < 0 || mb < 1 || (int64_t)(micro + 1) * mb > o->batch)
        return NULL;
    epoch = round / o->rounds_per_epoch;
    local = round % o->rounds_per_epoch;
    if (cache->epoch != epoch) {
        mlp_shuffle(cache->idx, o->n, o->seed, (uint64_t)epoch);
        cache->epoch = epoch;
    }
    start = (local * o->pipes + pipe) * o->batch + (int64_t)micro * mb;
    return cache->idx + start;
}

/* ---- Reference trainer ------------------------------------------------------------------------ */

void mlp_reference_free(mlp_reference *r) {
    int g;
    if (!r) return;
    mlp_net_free(&r->net);
    for (g = 0; g < MLP_MAX_LAYERS; g++) {
        mlp_stash_free(&r->stash[g]);
        free(r->act[g]);
        free(r->grad[g]);
        free(r->one[g]);
        free(r->pw[g]);
    }
    mlp_perm_free(&r->perm);
    memset(r, 0, sizeof *r);
}

int mlp_reference_init(mlp_reference *r, const mlp_model *m, const mlp_data *data, int batch, int micro,
                       const mlp_adam_hp *adam, uint64_t init_seed, uint64_t order_seed, char *err,
                       size_t errcap) {
    int g;
    memset(r, 0, sizeof *r);
    if (micro < 1 || batch < 1 || batch % micro != 0) {
        mlp__err(err, errcap, "batch %d is not a multiple of %d micro-batches", batch, micro);
        return -1;
    }
    if (mlp_order_init(&r->order, data->n, batch, 1, 1, order_seed, err, errcap) != 0) return -1;
    r->model = m;
    r->data = data;
    r->micro = micro;
    r->mb = batch / micro;
    r->adam = adam ? *adam : mlp_adam_defaults();
    if (mlp_net_init(&r->net, m, init_seed) != 0 || mlp_perm_init(&r->perm, data->n) != 0) goto oom;
    for (g = 0; g < m->stages; g++) {
        size_t sz = sizeof(float) * (size_t)r->mb * (size_t)mlp_stage_out_width(m, g);
        if (mlp_stash_init(&r->stash[g], m, g, r->mb) != 0) goto oom;
        if (g == m->stages - 1) break;
        if (!(r->act[g] = (float *)malloc(sz)) || !(r->grad[g] = (float *)malloc(sz))) goto oom;
    }
    return 0;
oom:
    mlp_reference_free(r);
    mlp__err(err, errcap, "reference trainer: out of memory");
    return -1;
}

/* Forward then backward of one micro-batch through every stage; adds to the gradients grad[0 .. G-1]. */
static int mlp__reference_micro(mlp_reference *r, int64_t round, int micro, float *const *grad, double *loss, int *correct) {
    const mlp_model *m = r->model;
    int G = m->stages, g;
    float scale = 1.0f / (float)(r->micro * r->mb);
    const uint32_t *idx = mlp_order_micro(&r->order, &r->perm, 0, round, micro, r->mb);
    if (!idx || mlp_stash_load(&r->stash[0], r->data, idx, r->mb) != 0) return -1;
    if (G > 1 && mlp_stash_load(&r->stash[G - 1], r->data, idx, r->mb) != 0) return -1;
    for (g = 0; g < G; g++)
        mlp_stage_forward(m, g, r->net.params[g], &r->stash[g], g ? r->act[g - 1] : NULL,
                          g < G - 1 ? r->act[g] : NULL, r->mb);
    *loss = mlp_stage_loss(m, &r->stash[G - 1], correct);
    if (!isfinite(*loss)) return -1;
    for (g = G - 1; g >= 0; g--)
        mlp_stage_backward(m, g, r->net.params[g], &r->stash[g], g ? r->act[g - 1] : NULL,
                           g < G - 1 ? r->grad[g] : NULL, g ? r->grad[g - 1] : NULL, grad[g], scale);
    return 0;
}

int mlp_reference_batch(mlp_reference *r, int64_t round, double *loss, int *correct) {
    double sum = 0, l = 0;
    int hits = 0, u, c = 0;
    for (u = 0; u < r->micro; u++) {
        if (mlp__reference_micro(r, round, u, r->net.grad, &l, &c) != 0) return -1;
        sum += l;
        hits += c;
    }
    if (loss) *loss = sum / r->micro;
    if (correct) *correct = hits;
    return 0;
}

int mlp_reference_batch_noise(mlp_reference *r, int64_t round, const mlp_net *pre, const mlp_adam_hp *hp, double *loss,
                              int *correct, double *micro_sq, double *batch_sq) {
    const mlp_model *m = r->model;
    double sum = 0, l = 0, usq = 0, bsq = 0;
    int hits = 0, u, c = 0, g;
    size_t i;
    if (r->micro < 2 || (pre && !hp)) return -1;
    for (g = 0; g < m->stages; g++) {
        const mlp_adam *a = pre ? &pre->adam[g] : NULL;
        double bc = a && a->t > 0 ? 1 - pow((double)hp->beta2, (double)a->t) : 1; /* Adam's bias correction */
        if (!r->one[g] && !(r->one[g] = (float *)malloc(sizeof(float) * m->count[g]))) return -1;
        if (!r->pw[g] && !(r->pw[g] = (float *)malloc(sizeof(float) * m->count[g]))) return -1;
        for (i = 0; i < m->count[g]; i++) { /* the squared weight of each parameter in |P x|^2 */
            double w = a ? 1 / (sqrt((double)a->v[i] / bc) + (double)hp->eps) : 1;
            r->pw[g][i] = (float)(w * w);
        }
    }
    for (u = 0; u < r->micro; u++) {
        for (g = 0; g < m->stages; g++) memset(r->one[g], 0, sizeof(float) * m->count[g]);
        if (mlp__reference_micro(r, round, u, r->one, &l, &c) != 0) return -1;
        sum += l;
        hits += c;
        for (g = 0; g < m->stages; g++)
            for (i = 0; i < m->count[g]; i++) { /* one[] holds g_u / micro: the step's share of it */
                double x = r->one[g][i];
                usq += x * x * r->pw[g][i];
                r->net.grad[g][i] += r->one[g][i];
            }
    }
    for (g = 0; g < m->stages; g++)
        for (i = 0; i < m->count[g]; i++) bsq += (double)r->net.grad[g][i] * r->net.grad[g][i] * r->pw[g][i];
    if (loss) *loss = sum / r->micro;
    if (correct) *correct = hits;
    *micro_sq = usq * r->micro; /* mean over u of |micro * one_u|^2 */
    *batch_sq = bsq;
    return 0;
}

void mlp_reference_step(mlp_reference *r) {
    mlp_adam_hp hp = r->adam;
    int g;
    hp.lr = mlp_lr_cosine(r->adam.lr, r->steps++, r->decay_steps);
    for (g = 0; g < r->model->stages; g++) mlp_adam_step(&r->net.adam[g], &hp, r->net.params[g], r->net.grad[g]);
}

/* ---- Evaluation ------------------------------------------------------------------------------- */

#define MLP__EVAL_CHUNK 500

double mlp_evaluate(const mlp_model *m, const float *const *params, const mlp_data *d, double *loss) {
    mlp_stash st[MLP_MAX_LAYERS];
    uint32_t idx[MLP__EVAL_CHUNK];
    int G = m->stages, g, start, hits = 0, ok = d && d->n > 0;
    double sum = 0;
    memset(st, 0, sizeof st);
    for (g = 0; ok && g < G; g++) ok = mlp_stash_init(&st[g], m, g, MLP__EVAL_CHUNK) == 0;
    for (start = 0; ok && start < d->n; start += MLP__EVAL_CHUNK) {
        int n = d->n - start < MLP__EVAL_CHUNK ? d->n - start : MLP__EVAL_CHUNK, i, c = 0;
        for (i = 0; i < n; i++) idx[i] = (uint32_t)(start + i);
        mlp_stash_load(&st[0], d, idx, n);
        if (G > 1) mlp_stash_load(&st[G - 1], d, idx, n);
        for (g = 0; g < G; g++) {
            const float *in = g ? st[g - 1].act[m->first[g] - 1 - m->first[g - 1]] : NULL;
            mlp_stage_forward(m, g, params[g], &st[g], in, NULL, n);
        }
        sum += mlp_stage_loss(m, &st[G - 1], &c) * n;
        hits += c;
    }
    for (g = 0; g < G; g++) mlp_stash_free(&st[g]);
    if (!ok) return -1;
    if (loss) *loss = sum / d->n;
    return (double)hits / d->n;
}

/* ---- Saving ----------------------------------------------------------------------------------- */

int mlp_params_save(const char *path, const mlp_model *m, const float *const *params, char *err, size_t errcap) {
    int32_t head[2 + MLP_MAX_LAYERS + 1];
    int l, g, ok;
    FILE *f;
    errno = 0;
    f = fopen(path, "wb");
    if (!f) {
        mlp__err(err, errcap, "%s: cannot create: %s", path, errno ? strerror(errno) : "unknown error");
        return -1;
    }
    memcpy(head, "MLPP", 4);
    head[1] = m->layers;
    for (l = 0; l <= m->layers; l++) head[2 + l] = m->width[l];
    ok = fwrite(head, sizeof(int32_t), (size_t)(3 + m->layers), f) == (size_t)(3 + m->layers);
    for (g = 0; ok && g < m->stages; g++)
        ok = fwrite(params[g], sizeof(float), m->count[g], f) == m->count[g];
    if (fclose(f) != 0) ok = 0;
    if (!ok) mlp__err(err, errcap, "%s: write failed: %s", path, strerror(errno));
    return ok ? 0 : -1;
}

#endif /* MLP_IMPLEMENTATION */
