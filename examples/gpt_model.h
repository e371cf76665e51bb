/* gpt_model.h — a GPT-2-style byte-level decoder in plain C11, split into partitions of consecutive layers,
   for the avgpipe examples. Single header; every function is static (no implementation macro), there is no
   avgpipe dependency, and matrix products go through CBLAS (cblas_sgemm). POSIX is used for the corpus
   loader (opendir, lstat): define _POSIX_C_SOURCE 200809L before the first #include of the program, or let
   this header do it when it comes first.

   Two trainers call the SAME functions below: the pipeline-parallel one (examples/gpt.c, on avgpipe) and
   the plain loop of examples/gpt_reference.c. With the same partitions, data order and one thread per
   partition they produce bit-identical parameters (gpt_save writes the same bytes: `cmp` them).

   THE MODEL
   ---------
   Vocabulary 256 (bytes). Config (gpt_config): C channels, L blocks, H heads, Tmax context, B rows per
   micro-batch. The model is a list of L + 2 layers:
     layer 0        embedding: x[b,t] = wte[token[b,t]] + wpe[t]            wte V x C, wpe Tmax x C
     layer 1 .. L   pre-norm block: x2 = x + proj(attn(LN1(x))), out = x2 + fcproj(GELU(fc(LN2(x2))))
                    (causal multi-head self-attention, GELU with the tanh approximation, MLP width 4C)
     layer L + 1    head: logits = LNf(x) wte^T (wte TIED to the embedding's), masked cross-entropy.
   Linear weights use PyTorch's layout (out x in, row-major): y = x W^T + b.

   Tensor order of a layer (gpt_layer_tensors; also the order of a partition's float array, layer after
   layer, and of the save file):
     embedding  0 wte (V x C), 1 wpe (Tmax x C)
     block      0 ln1.w (C), 1 ln1.b (C), 2 attn.qkv.w (3C x C), 3 attn.qkv.b (3C), 4 attn.proj.w (C x C),
                5 attn.proj.b (C), 6 ln2.w (C), 7 ln2.b (C), 8 mlp.fc.w (4C x C), 9 mlp.fc.b (4C),
                10 mlp.proj.w (C x 4C), 11 mlp.proj.b (C)            (q, k, v: rows 0..C-1, C..2C-1, 2C..3C-1)
     head       0 lnf.w (C), 1 lnf.b (C), and, only in a partition without layer 0, 2 wte (V x C): its copy.

   PARTITIONS AND THE TIE
   ----------------------
   A partition (gpt_part) holds layers [lo, hi): its parameters are ONE float array of gpt_part.nparams
   floats, its gradients a second array of the same layout. wte is used by layer 0 and by the head:
     - one partition holding both (a single partition): wte is stored once; a backward adds the head's
       gradient (dlogits^T LNf(x), one sgemm with beta 1) to it first, then the embedding's (rows scattered
       in position order b*T+t);
     - a partition with the head but not layer 0 holds its OWN copy of wte (wte_copy = 1) after lnf.b;
       initialised, loaded and updated identically to the first partition's. A trainer declares the two
       float ranges [wte_off, wte_off + wte_len) of the first and the last partition as one parameter:
       their gradients are summed with one float addition a + b (gpt_tie_sum, or avgpipe's tie) before the
       optimizer step, which is elementwise, so both copies stay bit-identical.

   ONE MICRO-BATCH
   ---------------
   A micro-batch (gpt_micro) has `rows` (<= B) rows of the same length T (1 <= T <= Tmax); shorter
   sequences are padded on the right, and a per-position mask (1 = counts, 0 = padding; any weight works)
   takes padding out of the loss. Activations between partitions are rows x T x C floats, row-major.
     gpt_forward(part, params, mb, in, out, stash, &loss)   in: NULL on the first partition (it reads
         mb->tokens); out: NULL on the last one (it reads mb->targets and mb->mask and sets loss to the sum of
         mask * -log p(target) over the micro-batch); a middle partition reads only mb->rows and mb->T.
         What the backward needs goes to `stash` (gpt_part_stash_floats(part) floats: one per in-flight
         micro-batch); the forward copies the micro-batch's shape, tokens, targets and mask there, so the
         backward needs no gpt_micro.
     gpt_backward(part, params, grads, stash, dout, din, work, batch_weight)   dout: gradient of the output
         (NULL on the last partition: it starts from the loss); din: gradient of the input, written (NULL on
         the first partition); parameter gradients are ADDED to grads. batch_weight = the sum of the masks
         over the whole batch (its token count): gradients summed over a batch's micro-batches are then the
         gradient of the mean loss per non-padding token. work: gpt_part_work_floats(part) floats of
         scratch, used only during the call (one per thread).
     gpt_backward_input(part, params, stash, dout, din, work, batch_weight), later
     gpt_backward_weight(part, grads, stash)   the same backward in two halves, for zero-bubble schedules
         (ZB-H1, ZB-V): the input half writes din and keeps in the stash what the weight half needs (stashes
         of gpt_part_stash_floats_iw(part) floats); the weight half adds the parameter gradients. I then W
         adds exactly what gpt_backward adds (the same kernels on the same values, each tensor once per
         micro-batch), so weight halves run in micro-batch order give gpt_backward's bits.
   Padding changes nothing: attention is causal and padding is on the right, so no real position reads a
   padded one, and every gradient flowing into a padded position is an exact zero.

   TRAINING STEP (what both trainers do)
   -------------------------------------
     grads = 0; for each micro-batch: forwards, backwards (per partition in micro-batch order 0..M-1);
     the tie: a[k] = b[k] = a[k] + b[k] over the first's and the last's wte ranges (gpt_tie_sum; avgpipe's
       TIE op computes the same);
     the global norm as avgpipe's runtime computes it, with avgpipe.h's exact helpers: per partition p, from
       0, avgpipe_grad_sumsq over its gradients in index order (the last partition's wte range left out: the
       tied range counts once) gives (sumsq, non-finite count); avgpipe_agree_combine adds the S pairs in
       partition order; a non-finite count > 0 skips the step on every partition; else
     scale = avgpipe_clip_scale(total, clip) (clip / norm when the norm exceeds clip, else 1);
     lr = gpt_lr(lr_max, step, warmup, steps);
     gpt_adamw(part p, params p, grads p, m p, v p, t, lr, (float)scale, &hp) for every p (t: 1-based count of
       the updates applied).
   This header does not include avgpipe.h: gpt_sumsq, gpt_nonfinite and gpt_clip_scale are the same step for
   a plain loop without it (gpt_sumsq is the same sum; gpt_clip_scale follows nanoGPT, clip / (norm + 1e-6)
   as a float, so it differs from avgpipe_clip_scale in the last bits: the two trainers do not use it).

   DATA
   ----
   The fortunes corpus (Debian package `fortunes`: /usr/share/games/fortunes). gpt_data_load reads every
   plain file of the directory in name order (not the .dat index files, not symlinks such as *.u8, not
   subdirectories: the offensive off/ set, where installed, is left out); entries are separated by lines
   holding only "%", and each non-blank entry is a document. A document's tokens are 0, its bytes, 0: byte 0
   marks the start (first input) and the end (last target). Document i (in load order) goes to validation
   when i % 20 == 19, else to training. A document with n targets longer than Tmax is cut into windows of
   Tmax targets (window w: tokens [w Tmax, w Tmax + Tmax], the next window's first input is this one's
   last target), the last one shorter. Batching buckets by length: the training windows are sorted by
   length, each epoch permutes the windows within every length, cuts the list into micro-batches of B
   windows (T = the longest in it; the last nwin % B windows, the longest, wait for another epoch)
   and permutes the micro-batches; batch b of the epoch is micro-batches b M .. b M + M - 1 of that order.
   All of it is a pure function of (seed, step, micro-batch index) computed on the fly (keyed Feistel
   permutations): gpt_data_micro is read-only and may be called from any thread.

   NUMERICS
   --------
   Deterministic: the same inputs give the same bits; no threads inside (set OpenBLAS to one thread, or
   the GEMMs run on its threads); sums run in a fixed order. The functions are compiled with floating-
   point contraction and fast-math off whatever the includer's flags (gcc: optimize pragmas; clang:
   float_control), so two programs built with the same BLAS agree bit for bit. Measured with
   gpt_reference (20 steps, 2 partitions, OpenBLAS 0.3.21 Haswell kernel): gcc 12 -O2, -O3 -march=native
   -ffp-contract=fast, -Ofast and clang 14 -O2 gave cmp-identical parameters. (-Ofast also links
   flush-to-zero, which no pragma undoes; it changed nothing there, but it could with subnormals.)
   Build with -fno-math-errno where you can (meson does for gpt and gpt_reference): gcc keeps sqrtf a libm
   call that may set errno otherwise, and no optimize pragma lifts that, so AdamW's loop stays scalar (5.5
   against 1.8 ns per parameter on AVX-512); sqrt is correctly rounded either way, so the bits are the same.

   FUNCTIONS
   ---------
     shapes      gpt_config_check, gpt_config_params, gpt_layer_tensors, gpt_part_layout, gpt_part_init,
                 gpt_part_tensors, gpt_partition, gpt_split_parse, gpt_parts_describe
     buffers     gpt_part_stash_floats(_iw), gpt_part_work_floats, gpt_act_floats, gpt_micro_alloc/_free
     compute     gpt_init, gpt_forward, gpt_backward, gpt_forward_timed, gpt_backward_timed (each layer's time,
                 for a tuner's per-layer costs), gpt_backward_input and gpt_backward_weight (the backward split
                 for zero-bubble schedules; their stash: gpt_part_stash_floats_iw)
     step        gpt_tie_sum, gpt_sumsq, gpt_nonfinite, gpt_clip_scale, gpt_lr, gpt_adamw_defaults, gpt_adamw
     data        gpt_data_load/_free, gpt_data_batches_per_epoch, gpt_data_micro, gpt_data_batch_tokens,
                 gpt_data_padding, gpt_data_val_micros, gpt_data_val_micro
     whole model gpt_eval, gpt_sample, gpt_save, gpt_load

   Errors: functions that can fail return 0 (or a count) on success and -1 on failure, with a one-line
   message in (err, errcap) where they take one. Nothing here prints, exits or aborts.
   Thread-safety: functions touch only their arguments; gpt_data and gpt_part are read-only after their
   init; a stash, a work buffer and a gradient array must not be used by two threads at once. */
#ifndef GPT_MODEL_H
#define GPT_MODEL_H

#if !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE)
#define _POSIX_C_SOURCE 200809L /* effective only when this header is the first include */
#endif

#include <cblas.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#if defined(__GNUC__) || defined(__clang__)
#define GPT_FN static __attribute__((unused)) /* a program need not call every function */
#else
#define GPT_FN static
#endif

#define GPT_VOCAB 256       /* byte-level tokens */
#define GPT_MAX_BLOCKS 256  /* most L */
#define GPT_MAX_PARTS 258   /* most partitions: one layer each */
#define GPT_MAX_TENSORS 12  /* most tensors of one layer (a block) */
#define GPT_VAL_EVERY 20    /* document i goes to validation when i % GPT_VAL_EVERY == GPT_VAL_EVERY - 1 */
#define GPT_FILE_MAGIC "GPTBYTE1"
#define GPT_FILE_VERSION 1u

/* ---- Shapes --------------------------------------------------------------------------------------------- */

/* The model's shape. */
typedef struct gpt_config {
    int C;    /* channels: the width of every activation; a multiple of H */
    int L;    /* transformer blocks (layers 1 .. L of the L + 2) */
    int H;    /* attention heads (head size C / H) */
    int Tmax; /* context: the longest micro-batch's T, and the rows of wpe */
    int B;    /* most rows of a micro-batch: what stashes and work buffers are sized for */
} gpt_config;

/* How a tensor is initialised (gpt_init). */
enum { GPT_INIT_ZERO, GPT_INIT_ONE, GPT_INIT_NORMAL };

/* One parameter tensor of a layer. (layer, index) names it whatever the partitioning; the head's copy of
   wte is (0, 0) too, which is why both copies are initialised and saved as one tensor. */
typedef struct gpt_tensor {
    char name[24];   /* "wte", "h2.attn.qkv.w", "lnf.b" */
    int layer;       /* 0 .. L + 1 (its identity: the wte copy says 0) */
    int index;       /* position in its layer's list (the header comment) */
    int rows, cols;  /* a vector has rows 1 */
    size_t off, len; /* floats: offset in the partition's array (gpt_part_tensors) or in the layer */
    int decay;       /* 1: AdamW's weight decay applies (every 2-D tensor: weights, wte, wpe) */
    int init;        /* GPT_INIT_* */
    double std;      /* GPT_INIT_NORMAL: N(0, std^2); 0.02, the residual projections 0.02 / sqrt(2 L) */
} gpt_tensor;

/* A partition: layers [lo, hi) of the L + 2. gpt_part_init fills it; read-only afterwards. */
typedef struct gpt_part {
    gpt_config cfg;
    int lo, hi;
    int has_embed, has_head; /* lo == 0; hi == L + 2 */
    int wte_copy;            /* has_head && !has_embed: the partition holds its own copy of wte */
    size_t nparams;          /* floats of its parameter (and gradient) array */
    size_t wte_off, wte_len; /* its wte range (the first partition: 0, V C; the copy: after lnf.b); 0, 0 if none */
    size_t layer_off[GPT_MAX_BLOCKS + 3]; /* where layer lo + i starts; layer_off[hi - lo] == nparams */
} gpt_part;

/* One micro-batch: `rows` rows of T positions, row-major (position t of row r at r T + t). */
typedef struct gpt_micro {
    int rows, T;
    double ntok;      /* sum of mask: the micro-batch's non-padding positions */
    uint8_t *tokens;  /* inputs, rows * T (the first partition reads them) */
    uint8_t *targets; /* next bytes, rows * T (the head reads them) */
    float *mask;      /* 1 = counts in the loss, 0 = padding (the head reads it) */
    size_t cap;       /* positions the three buffers hold (gpt_micro_alloc) */
} gpt_micro;

#endif /* GPT_MODEL_H: declarations */

/* ================================================================================================== */
/* The functions (every one static); guarded so that a second include is harmless                      */
/* ================================================================================================== */
#ifndef GPT_MODEL_H_FUNCTIONS
#define GPT_MODEL_H_FUNCTIONS

/* Contraction (a*b+c fused) and fast-math off for everything below: the bit-for-bit promise must not
   depend on the includer's -ffp-contract, -Ofast or -march. gcc also gets no-trapping-math, which changes
   no result (it only stops modelling floating-point exception flags) and lets it vectorize the loops with
   comparisons (the softmaxes, GELU), and vectorization at -O2 as at -O3 (gcc 12's -O2 cost model leaves
   loops of unknown length scalar: 10.4k against 12.0k tokens/s). Vectorizing elementwise loops changes no
   bit; gcc vectorizes a float sum only in order (fold-left), never reassociated, without fast-math. */
#if defined(__clang__)
#pragma float_control(precise, on, push)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off", "no-trapping-math", "tree-vectorize", "vect-cost-model=dynamic")
#endif

/* Format a one-line message into (err, cap); returns -1, so that `return gpt__err(...);` reports a failure. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 3, 4)))
#endif
static int gpt__err(char *err, size_t cap, const char *fmt, ...) {
    va_list ap;
    if (!err || !cap) return -1;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return -1;
}

/* ---- Config, layers, partitions ------------------------------------------------------------------------ */

/* Check a config: C, H >= 1 with C % H == 0, 0 <= L <= GPT_MAX_BLOCKS, 1 <= Tmax <= 4096, 1 <= B <= 65536,
   C <= 16384. Returns 0, or -1 with the field named in err. */
GPT_FN int gpt_config_check(const gpt_config *c, char *err, size_t cap) {
    if (!c) return gpt__err(err, cap, "no config");
    if (c->C < 1 || c->C > 16384) return gpt__err(err, cap, "channels %d: want 1 .. 16384", c->C);
    if (c->H < 1 || c->C % c->H) return gpt__err(err, cap, "heads %d: want a divisor of the channels (%d)", c->H, c->C);
    if (c->L < 0 || c->L > GPT_MAX_BLOCKS) return gpt__err(err, cap, "layers %d: want 0 .. %d", c->L, GPT_MAX_BLOCKS);
    if (c->Tmax < 1 || c->Tmax > 4096) return gpt__err(err, cap, "context %d: want 1 .. 4096", c->Tmax);
    if (c->B < 1 || c->B > 65536) return gpt__err(err, cap, "rows per micro-batch %d: want 1 .. 65536", c->B);
    return 0;
}

/* Total floats of the model's parameters, wte counted once. */
GPT_FN size_t gpt_config_params(const gpt_config *c) {
    size_t C = (size_t)c->C;
    return (size_t)GPT_VOCAB * C + (size_t)c->Tmax * C + (size_t)c->L * (12 * C * C + 13 * C) + 2 * C;
}

static void gpt__tensor(gpt_tensor *t, const char *name, int layer, int index, int rows, int cols, size_t *off, int init, double std) {
    snprintf(t->name, sizeof t->name, "%s", name);
    t->layer = layer, t->index = index, t->rows = rows, t->cols = cols;
    t->off = *off, t->len = (size_t)rows * (size_t)cols;
    t->decay = rows > 1, t->init = init, t->std = std;
    *off += t->len;
}

/* The tensors of layer `layer` (0 .. L + 1) into t[0 .. n-1] (at most GPT_MAX_TENSORS), offsets from the
   layer's start; with_wte_copy adds the head's own wte (index 2, identity layer 0 index 0). Returns n. */
GPT_FN int gpt_layer_tensors(const gpt_config *c, int layer, int with_wte_copy, gpt_tensor *t) {
    static const char *const bn[12] = {"ln1.w", "ln1.b", "attn.qkv.w", "attn.qkv.b", "attn.proj.w", "attn.proj.b",
                                       "ln2.w", "ln2.b", "mlp.fc.w", "mlp.fc.b", "mlp.proj.w", "mlp.proj.b"};
    const int C = c->C;
    const double s = 0.02, sres = 0.02 / sqrt(2.0 * (c->L > 0 ? c->L : 1));
    size_t off = 0;
    char name[24];
    int i;
    if (layer == 0) {
        gpt__tensor(&t[0], "wte", 0, 0, GPT_VOCAB, C, &off, GPT_INIT_NORMAL, s);
        gpt__tensor(&t[1], "wpe", 0, 1, c->Tmax, C, &off, GPT_INIT_NORMAL, s);
        return 2;
    }
    if (layer == c->L + 1) {
        gpt__tensor(&t[0], "lnf.w", layer, 0, 1, C, &off, GPT_INIT_ONE, 0);
        gpt__tensor(&t[1], "lnf.b", layer, 1, 1, C, &off, GPT_INIT_ZERO, 0);
        if (!with_wte_copy) return 2;
        gpt__tensor(&t[2], "wte", 0, 0, GPT_VOCAB, C, &off, GPT_INIT_NORMAL, s);
        return 3;
    }
    {
        const int rows[12] = {1, 1, 3 * C, 1, C, 1, 1, 1, 4 * C, 1, C, 1};
        const int cols[12] = {C, C, C, 3 * C, C, C, C, C, C, 4 * C, 4 * C, C};
        for (i = 0; i < 12; i++) {
            int init = rows[i] > 1 ? GPT_INIT_NORMAL : (i == 0 || i == 6) ? GPT_INIT_ONE : GPT_INIT_ZERO;
            snprintf(name, sizeof name, "h%d.%s", layer, bn[i]);
            gpt__tensor(&t[i], name, layer, i, rows[i], cols[i], &off, init, (i == 4 || i == 10) ? sres : s);
        }
    }
    return 12;
}

/* Floats of layer `layer`'s parameters (with the head's wte copy when with_wte_copy). */
static size_t gpt__layer_params(const gpt_config *c, int layer, int with_wte_copy) {
    gpt_tensor t[GPT_MAX_TENSORS];
    int n = gpt_layer_tensors(c, layer, with_wte_copy, t);
    return t[n - 1].off + t[n - 1].len;
}

/* The layout of partition [lo, hi) of config c: returns its floats (0 when lo, hi are out of range), and
   in *wte_off, *wte_len (may be NULL) where its wte range is (0, 0 when it has none). This is what a
   trainer declares as the tie: the first partition's range and the last one's, when they differ. */
GPT_FN size_t gpt_part_layout(const gpt_config *c, int lo, int hi, size_t *wte_off, size_t *wte_len) {
    size_t n = 0, woff = 0, wlen = 0;
    int l;
    if (lo < 0 || hi > c->L + 2 || lo >= hi) return 0;
    for (l = lo; l < hi; l++) {
        int copy = l == c->L + 1 && lo > 0;
        if (l == 0) woff = n, wlen = (size_t)GPT_VOCAB * c->C;
        if (copy) woff = n + 2 * (size_t)c->C, wlen = (size_t)GPT_VOCAB * c->C;
        n += gpt__layer_params(c, l, copy);
    }
    if (wte_off) *wte_off = woff;
    if (wte_len) *wte_len = wlen;
    return n;
}

/* Describe partition [lo, hi) of c in *p. Returns 0, or -1 (err set) on a bad config or range. */
GPT_FN int gpt_part_init(gpt_part *p, const gpt_config *c, int lo, int hi, char *err, size_t cap) {
    int l;
    size_t off = 0;
    memset(p, 0, sizeof *p);
    if (gpt_config_check(c, err, cap)) return -1;
    if (lo < 0 || hi > c->L + 2 || lo >= hi)
        return gpt__err(err, cap, "partition [%d, %d): want 0 <= lo < hi <= %d (layers + 2)", lo, hi, c->L + 2);
    p->cfg = *c, p->lo = lo, p->hi = hi;
    p->has_embed = lo == 0, p->has_head = hi == c->L + 2, p->wte_copy = p->has_head && !p->has_embed;
    for (l = lo; l < hi; l++) {
        p->layer_off[l - lo] = off;
        off += gpt__layer_params(c, l, l == c->L + 1 && p->wte_copy);
    }
    p->layer_off[hi - lo] = off;
    p->nparams = gpt_part_layout(c, lo, hi, &p->wte_off, &p->wte_len);
    return 0;
}

/* The tensors of partition p, in storage order, with offsets in its array, into t (room for
   (hi - lo) * GPT_MAX_TENSORS). Returns their number. */
GPT_FN int gpt_part_tensors(const gpt_part *p, gpt_tensor *t) {
    int l, i, n = 0;
    for (l = p->lo; l < p->hi; l++) {
        int k = gpt_layer_tensors(&p->cfg, l, l == p->cfg.L + 1 && p->wte_copy, t + n);
        for (i = 0; i < k; i++) t[n + i].off += p->layer_off[l - p->lo];
        n += k;
    }
    return n;
}

/* Parse "2,2,1,1" (layers per partition) into split[0 .. *n-1], at most cap entries. Returns 0, or -1 with a
   message on anything but positive integers separated by commas. */
GPT_FN int gpt_split_parse(const char *text, int *split, int cap, int *n, char *err, size_t errcap) {
    const char *s = text;
    *n = 0;
    while (*s) {
        char *end;
        long v;
        errno = 0;
        v = strtol(s, &end, 10);
        if (end == s || errno || v < 1 || v > GPT_MAX_PARTS || (*end && *end != ',') || *n >= cap)
            return gpt__err(err, errcap, "split '%s': want layers per partition, positive integers separated by commas", text);
        split[(*n)++] = (int)v;
        s = *end ? end + 1 : end;
        if (*end && !*s) return gpt__err(err, errcap, "split '%s' ends with a comma", text);
    }
    if (!*n) return gpt__err(err, errcap, "split '%s' is empty", text);
    return 0;
}

/* Cut the L + 2 layers of c into S partitions parts[0 .. S-1]: partition s holds split[s] layers, or with
   split NULL an even split (sizes differ by at most one; the first (L + 2) % S partitions get the extra
   layer). Returns 0, or -1 (err set): S outside [1, L + 2], a split that does not add up to L + 2. */
GPT_FN int gpt_partition(const gpt_config *c, int S, const int *split, gpt_part *parts, char *err, size_t cap) {
    int s, lo = 0, total = 0, nl;
    if (gpt_config_check(c, err, cap)) return -1;
    nl = c->L + 2;
    if (S < 1 || S > nl) return gpt__err(err, cap, "stages %d: want 1 .. %d (layers + 2)", S, nl);
    if (split) {
        for (s = 0; s < S; s++) {
            if (split[s] < 1) return gpt__err(err, cap, "split: partition %d has %d layers", s, split[s]);
            total += split[s];
        }
        if (total != nl)
            return gpt__err(err, cap, "split adds up to %d layers; the model has %d (embedding, %d blocks, head)", total, nl, c->L);
    }
    for (s = 0; s < S; s++) {
        int k = split ? split[s] : nl / S + (s < nl % S);
        if (gpt_part_init(&parts[s], c, lo, lo + k, err, cap)) return -1;
        lo += k;
    }
    return 0;
}

/* Check that parts[0 .. n-1] are consecutive partitions of one config covering all L + 2 layers. */
static int gpt__parts_check(const gpt_part *parts, int n, char *err, size_t cap) {
    int s;
    if (n < 1 || !parts) return gpt__err(err, cap, "no partitions");
    for (s = 0; s < n; s++) {
        const gpt_config *a = &parts[0].cfg, *b = &parts[s].cfg;
        if (memcmp(a, b, sizeof *a)) return gpt__err(err, cap, "partition %d has another config than partition 0", s);
        if (parts[s].lo != (s ? parts[s - 1].hi : 0))
            return gpt__err(err, cap, "partition %d starts at layer %d, not where the previous one ends", s, parts[s].lo);
    }
    if (parts[n - 1].hi != parts[0].cfg.L + 2) return gpt__err(err, cap, "the partitions end before the head");
    return 0;
}

/* "emb h1 | h2 h3 | h4 head" into buf (truncated to cap). */
GPT_FN void gpt_parts_describe(const gpt_part *parts, int n, char *buf, size_t cap) {
    size_t used = 0;
    int s, l;
    if (!cap) return;
    buf[0] = '\0';
    for (s = 0; s < n; s++)
        for (l = parts[s].lo; l < parts[s].hi; l++) {
            int w;
            const char *sep = l > parts[s].lo ? " " : s ? " | " : "";
            if (l == 0) w = snprintf(buf + used, cap - used, "%semb", sep);
            else if (l == parts[s].cfg.L + 1) w = snprintf(buf + used, cap - used, "%shead", sep);
            else w = snprintf(buf + used, cap - used, "%sh%d", sep, l);
            if (w < 0 || (size_t)w >= cap - used) return;
            used += (size_t)w;
        }
}

/* ---- Initialisation ------------------------------------------------------------------------------------ */

/* splitmix64's finaliser: a bijective mix of 64 bits. */
static uint64_t gpt__mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* A small generator (splitmix64 stream): 53-bit uniforms in (0, 1]. */
typedef struct gpt_rng {
    uint64_t s;
} gpt_rng;

static double gpt__uniform(gpt_rng *r) {
    r->s += 0x9e3779b97f4a7c15ull;
    return (double)((gpt__mix(r->s) >> 11) + 1) / 9007199254740992.0;
}

/* N(0, 1) by Box-Muller (one value per two uniforms, in double). */
static double gpt__normal(gpt_rng *r) {
    double u = gpt__uniform(r), v = gpt__uniform(r);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* Fill t's floats (at x) with its initial values; its stream depends only on (seed, layer, index). */
static void gpt__init_tensor(const gpt_tensor *t, float *x, uint64_t seed) {
    gpt_rng r;
    size_t i;
    r.s = gpt__mix(gpt__mix(gpt__mix(seed) ^ (uint64_t)t->layer) ^ ((uint64_t)t->index << 32));
    for (i = 0; i < t->len; i++)
        x[i] = t->init == GPT_INIT_NORMAL ? (float)(t->std * gpt__normal(&r)) : t->init == GPT_INIT_ONE ? 1.0f : 0.0f;
}

/* Initialise partition p's parameters from seed (GPT-2: weights and embeddings N(0, 0.02), the attention
   and MLP output projections N(0, 0.02 / sqrt(2 L)), biases 0, LayerNorm gains 1). A tensor's values depend
   only on (seed, its layer, its index), so every partitioning starts from the same model and the two wte
   copies are equal. */
GPT_FN void gpt_init(const gpt_part *p, float *params, uint64_t seed) {
    gpt_tensor t[GPT_MAX_TENSORS];
    int l, i, n;
    for (l = p->lo; l < p->hi; l++) {
        n = gpt_layer_tensors(&p->cfg, l, l == p->cfg.L + 1 && p->wte_copy, t);
        for (i = 0; i < n; i++) gpt__init_tensor(&t[i], params + p->layer_off[l - p->lo] + t[i].off, seed);
    }
}

/* ---- Sizes of a stash and of a work buffer --------------------------------------------------------------- */

/* Where things are in a stash for a micro-batch of `rows` x T: a 4-float header (rows, T, lo, hi), the
   tokens (first partition), the targets and the mask (head), then one region per layer. A block's region:
   x, ln1, qkv (3), attout, x2, ln2, h (4), g (4) (rows T C floats per unit), mean1, rstd1, mean2, rstd2
   (rows T each), att (rows H T T). The head's: x, ln, probs (rows T V), mean, rstd. */
typedef struct gpt__smap {
    size_t tok, tgt, mask, layer[GPT_MAX_BLOCKS + 3], total;
    size_t wsave[GPT_MAX_BLOCKS + 3], total_iw; /* after total: what gpt_backward_input keeps for the weights */
} gpt__smap;

/* The W region of a layer (gpt_backward_input's output, gpt_backward_weight's input), in units of N C floats:
   the embedding keeps its output gradient (1); a block its output gradient, the MLP's hidden gradient (4), the
   gradients of LN2's output (1), of the attention projection's output (1), of qkv (3) and of LN1's output (1);
   the head the gradient of LNf's output (1; dlogits overwrite the probabilities in its stash region). */
static size_t gpt__wsave_units(const gpt_config *c, int layer) {
    return layer == 0 || layer == c->L + 1 ? 1 : 11;
}

static size_t gpt__block_stash(const gpt_config *c, size_t rows, size_t T) {
    size_t N = rows * T;
    return 16 * N * (size_t)c->C + 4 * N + rows * (size_t)c->H * T * T;
}

static size_t gpt__head_stash(const gpt_config *c, size_t rows, size_t T) {
    size_t N = rows * T;
    return 2 * N * (size_t)c->C + N * GPT_VOCAB + 2 * N;
}

static void gpt__stash_map(const gpt_part *p, int rows, int T, gpt__smap *m) {
    size_t N = (size_t)rows * (size_t)T, at = 4;
    int l;
    m->tok = m->tgt = m->mask = 0;
    if (p->has_embed) m->tok = at, at += N;
    if (p->has_head) m->tgt = at, m->mask = at + N, at += 2 * N;
    for (l = p->lo; l < p->hi; l++) {
        m->layer[l - p->lo] = at;
        if (l == 0) continue;
        at += l == p->cfg.L + 1 ? gpt__head_stash(&p->cfg, (size_t)rows, (size_t)T) : gpt__block_stash(&p->cfg, (size_t)rows, (size_t)T);
    }
    m->total = at;
    for (l = p->lo; l < p->hi; l++) m->wsave[l - p->lo] = at, at += gpt__wsave_units(&p->cfg, l) * N * (size_t)p->cfg.C;
    m->total_iw = at;
}

/* Floats of one stash of partition p (a micro-batch of B rows x Tmax; smaller ones use a prefix). */
GPT_FN size_t gpt_part_stash_floats(const gpt_part *p) {
    gpt__smap m;
    gpt__stash_map(p, p->cfg.B, p->cfg.Tmax, &m);
    return m.total;
}

/* Floats of one stash of partition p for the split backward (gpt_backward_input, then gpt_backward_weight):
   gpt_part_stash_floats plus what the input half keeps for the weight half (about 70% more per block). */
GPT_FN size_t gpt_part_stash_floats_iw(const gpt_part *p) {
    gpt__smap m;
    gpt__stash_map(p, p->cfg.B, p->cfg.Tmax, &m);
    return m.total_iw;
}

/* Floats of partition p's backward scratch: two activation gradients plus the largest layer's own. */
GPT_FN size_t gpt_part_work_floats(const gpt_part *p) {
    size_t N = (size_t)p->cfg.B * (size_t)p->cfg.Tmax, NC = N * (size_t)p->cfg.C, T = (size_t)p->cfg.Tmax, own = 0;
    if (p->lo <= p->cfg.L && p->hi > 1) own = 9 * NC + T * T;
    if (p->has_head && N * GPT_VOCAB + NC > own) own = N * GPT_VOCAB + NC;
    return 2 * NC + own;
}

/* Floats of one activation between partitions at full size: B x Tmax x C. */
GPT_FN size_t gpt_act_floats(const gpt_config *c) {
    return (size_t)c->B * (size_t)c->Tmax * (size_t)c->C;
}

/* ---- Layer kernels --------------------------------------------------------------------------------------- */

/* y[N x out] = x[N x in] W^T + b (W out x in): rows set to the bias, then one sgemm with beta 1. */
static void gpt__linear_fwd(const float *x, const float *W, const float *b, float *y, size_t N, int in, int out) {
    size_t i;
    for (i = 0; i < N; i++) memcpy(y + i * (size_t)out, b, sizeof(float) * (size_t)out);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)N, out, in, 1.0f, x, in, W, in, 1.0f, y, out);
}

/* A linear layer's backward to its input: dx = dy W (written). */
static void gpt__linear_bwd_x(const float *dy, const float *W, float *dx, size_t N, int in, int out) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)N, in, out, 1.0f, dy, out, W, in, 0.0f, dx, in);
}

/* ... and to its weights: dW += dy^T x, db += column sums of dy (rows in order). */
static void gpt__linear_bwd_w(const float *dy, const float *x, float *dW, float *db, size_t N, int in, int out) {
    size_t i;
    int j;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, (int)N, 1.0f, dy, out, x, in, 1.0f, dW, in);
    for (i = 0; i < N; i++) {
        const float *r = dy + i * (size_t)out;
        for (j = 0; j < out; j++) db[j] += r[j];
    }
}

/* LayerNorm of N rows of C: y = (x - mean) rstd w + b, rstd = 1 / sqrt(var + 1e-5); keeps mean and rstd. */
static void gpt__ln_fwd(const float *x, const float *w, const float *b, float *y, float *mean, float *rstd, size_t N, int C) {
    size_t i;
    int c;
    for (i = 0; i < N; i++) {
        const float *xi = x + i * (size_t)C;
        float *yi = y + i * (size_t)C, m = 0.0f, v = 0.0f, s;
        for (c = 0; c < C; c++) m += xi[c];
        m /= (float)C;
        for (c = 0; c < C; c++) v += (xi[c] - m) * (xi[c] - m);
        v /= (float)C;
        s = 1.0f / sqrtf(v + 1e-5f);
        for (c = 0; c < C; c++) yi[c] = (xi[c] - m) * s * w[c] + b[c];
        mean[i] = m, rstd[i] = s;
    }
}

/* LayerNorm backward to its input: dx += rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)). */
static void gpt__ln_bwd_x(const float *dy, const float *x, const float *mean, const float *rstd, const float *w, float *dx, size_t N, int C) {
    size_t i;
    int c;
    for (i = 0; i < N; i++) {
        const float *dyi = dy + i * (size_t)C, *xi = x + i * (size_t)C;
        float *dxi = dx + i * (size_t)C, m = mean[i], s = rstd[i], a = 0.0f, bsum = 0.0f;
        for (c = 0; c < C; c++) {
            float dh = dyi[c] * w[c];
            a += dh;
            bsum += dh * (xi[c] - m) * s;
        }
        a /= (float)C, bsum /= (float)C;
        for (c = 0; c < C; c++) {
            float xh = (xi[c] - m) * s, dh = dyi[c] * w[c];
            dxi[c] = dxi[c] + s * (dh - a - xh * bsum);
        }
    }
}

/* ... and to its gain and bias: dw += dy xhat, db += dy (rows in order). */
static void gpt__ln_bwd_w(const float *dy, const float *x, const float *mean, const float *rstd, float *dw, float *db, size_t N, int C) {
    size_t i;
    int c;
    for (i = 0; i < N; i++) {
        const float *dyi = dy + i * (size_t)C, *xi = x + i * (size_t)C;
        float m = mean[i], s = rstd[i];
        for (c = 0; c < C; c++) {
            float xh = (xi[c] - m) * s;
            dw[c] += dyi[c] * xh;
            db[c] += dyi[c];
        }
    }
}

#define GPT__GELU_K 0.7978845608028654f /* sqrt(2 / pi) */

/* exp(y) for the softmaxes and GELU, in plain arithmetic so that loops calling it vectorize (libm's expf
   and tanhf are calls: glibc's tanhf took 40% of a training step). y is clamped to [-87.3, 88.0]; then
   y = n ln2 + r with |r| <= ln2 / 2 (n rounded, ln2 split in two so n ln2 is exact to ~1e-11), exp(r) by its
   Taylor polynomial of degree 7 (truncation 5e-9 relative) and 2^n from the exponent bits. Relative error
   about 2e-7 (a few ulp); the same bits on every machine with IEEE binary32 and no contraction. */
static inline float gpt__exp(float y) {
    float x = y < -87.3f ? -87.3f : y > 88.0f ? 88.0f : y, kf, r, p, two;
    int n = (int)(x * 1.44269504f + 126.5f) - 126; /* round to nearest: the sum is positive, so truncation floors */
    uint32_t bits = (uint32_t)(n + 127) << 23;
    kf = (float)n;
    r = (x - kf * 0.693359375f) - kf * -2.12194440e-4f;
    p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720 + r * (1.0f / 5040)))))));
    memcpy(&two, &bits, sizeof two);
    return p * two;
}

/* tanh(u) = 1 - 2 / (exp(2|u|) + 1), sign restored; absolute error ~1e-7 (what GELU needs), exactly +-1
   from |u| ~ 9 on. */
static inline float gpt__tanh(float u) {
    float a = u < 0 ? -u : u, t = 1.0f - 2.0f / (gpt__exp(2.0f * a) + 1.0f);
    return u < 0 ? -t : t;
}

/* GELU, tanh approximation: g = x (1 + tanh(k (x + 0.044715 x^3))) / 2. */
static void gpt__gelu_fwd(const float *h, float *g, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        float x = h[i], t = gpt__tanh(GPT__GELU_K * (x + 0.044715f * x * x * x));
        g[i] = 0.5f * x * (1.0f + t);
    }
}

/* d <- d g'(h), in place. */
static void gpt__gelu_bwd(const float *h, float *d, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        float x = h[i], t = gpt__tanh(GPT__GELU_K * (x + 0.044715f * x * x * x));
        float dg = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GPT__GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
        d[i] *= dg;
    }
}

/* Row t of P (T x T) keeps positions 0..t: softmax over them, zeros after. */
static void gpt__softmax_causal(float *P, int T) {
    int t, j;
    for (t = 0; t < T; t++) {
        float *r = P + (size_t)t * T, mx = r[0], sum = 0.0f, inv;
        for (j = 1; j <= t; j++) mx = r[j] > mx ? r[j] : mx;
        for (j = 0; j <= t; j++) r[j] = gpt__exp(r[j] - mx);
        for (j = 0; j <= t; j++) sum += r[j];
        inv = 1.0f / sum;
        for (j = 0; j <= t; j++) r[j] *= inv;
        for (j = t + 1; j < T; j++) r[j] = 0.0f;
    }
}

/* Causal attention of every (row, head): P = softmax(Q K^T / sqrt(hs)) (kept in att), y = P V. q, k, v of
   head h are columns h hs, C + h hs, 2C + h hs of qkv (rows of 3C), so the products read them in place. */
static void gpt__attn_fwd(const float *qkv, float *att, float *y, int rows, int T, int C, int H) {
    const int hs = C / H, ld = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    int b, h;
    for (b = 0; b < rows; b++)
        for (h = 0; h < H; h++) {
            const float *q = qkv + (size_t)b * T * ld + (size_t)h * hs, *k = q + C, *v = q + 2 * C;
            float *P = att + ((size_t)b * H + h) * T * T;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, scale, q, ld, k, ld, 0.0f, P, T);
            gpt__softmax_causal(P, T);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, 1.0f, P, T, v, ld, 0.0f, y + (size_t)b * T * C + (size_t)h * hs, C);
        }
}

/* Attention backward: from dy (rows x T x C) to dqkv (written). dP (T x T) is scratch. */
static void gpt__attn_bwd(const float *dy, const float *qkv, const float *att, float *dqkv, float *dP, int rows, int T, int C, int H) {
    const int hs = C / H, ld = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    int b, h, t, j;
    for (b = 0; b < rows; b++)
        for (h = 0; h < H; h++) {
            size_t o = (size_t)b * T * ld + (size_t)h * hs;
            const float *q = qkv + o, *k = q + C, *v = q + 2 * C, *P = att + ((size_t)b * H + h) * T * T;
            const float *g = dy + (size_t)b * T * C + (size_t)h * hs;
            float *dq = dqkv + o, *dk = dq + C, *dv = dq + 2 * C;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, 1.0f, g, C, v, ld, 0.0f, dP, T);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, 1.0f, P, T, g, C, 0.0f, dv, ld);
            for (t = 0; t < T; t++) { /* softmax backward: dS = P (dP - sum_j P dP), zero above the diagonal */
                const float *pr = P + (size_t)t * T;
                float *dr = dP + (size_t)t * T, dot = 0.0f;
                for (j = 0; j <= t; j++) dot += pr[j] * dr[j];
                for (j = 0; j <= t; j++) dr[j] = pr[j] * (dr[j] - dot);
                for (j = t + 1; j < T; j++) dr[j] = 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, scale, dP, T, k, ld, 0.0f, dq, ld);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, scale, dP, T, q, ld, 0.0f, dk, ld);
        }
}

/* ---- Layers ---------------------------------------------------------------------------------------------- */

/* Pointers to a block's 12 tensors (parameters or their gradients). */
typedef struct gpt__bw {
    float *ln1w, *ln1b, *qkvw, *qkvb, *projw, *projb, *ln2w, *ln2b, *fcw, *fcb, *fcpw, *fcpb;
} gpt__bw;

static gpt__bw gpt__block_w(float *x, int C) {
    gpt__bw p;
    size_t c = (size_t)C;
    p.ln1w = x, p.ln1b = x + c, p.qkvw = x + 2 * c, p.qkvb = p.qkvw + 3 * c * c, p.projw = p.qkvb + 3 * c;
    p.projb = p.projw + c * c, p.ln2w = p.projb + c, p.ln2b = p.ln2w + c, p.fcw = p.ln2b + c, p.fcb = p.fcw + 4 * c * c;
    p.fcpw = p.fcb + 4 * c, p.fcpb = p.fcpw + 4 * c * c;
    return p;
}

/* Pointers into a block's stash region (gpt__smap's comment). */
typedef struct gpt__bs {
    float *x, *ln1, *qkv, *attout, *x2, *ln2, *h, *g, *mean1, *rstd1, *mean2, *rstd2, *att;
} gpt__bs;

static gpt__bs gpt__block_s(float *s, size_t N, int C) {
    gpt__bs p;
    size_t NC = N * (size_t)C;
    p.x = s, p.ln1 = s + NC, p.qkv = s + 2 * NC, p.attout = s + 5 * NC, p.x2 = s + 6 * NC, p.ln2 = s + 7 * NC;
    p.h = s + 8 * NC, p.g = s + 12 * NC, p.mean1 = s + 16 * NC, p.rstd1 = p.mean1 + N, p.mean2 = p.rstd1 + N;
    p.rstd2 = p.mean2 + N, p.att = p.rstd2 + N;
    return p;
}

/* Block forward: reads x from its stash region s, writes out (rows x T x C). */
static void gpt__block_fwd(const gpt_config *cf, const float *wp, float *s, int rows, int T, float *out) {
    const int C = cf->C;
    size_t N = (size_t)rows * T, i;
    gpt__bw w = gpt__block_w((float *)wp, C); /* read only: one pointer struct serves params and gradients */
    gpt__bs a = gpt__block_s(s, N, C);
    gpt__ln_fwd(a.x, w.ln1w, w.ln1b, a.ln1, a.mean1, a.rstd1, N, C);
    gpt__linear_fwd(a.ln1, w.qkvw, w.qkvb, a.qkv, N, C, 3 * C);
    gpt__attn_fwd(a.qkv, a.att, a.attout, rows, T, C, cf->H);
    gpt__linear_fwd(a.attout, w.projw, w.projb, a.x2, N, C, C);
    for (i = 0; i < N * (size_t)C; i++) a.x2[i] += a.x[i];
    gpt__ln_fwd(a.x2, w.ln2w, w.ln2b, a.ln2, a.mean2, a.rstd2, N, C);
    gpt__linear_fwd(a.ln2, w.fcw, w.fcb, a.h, N, C, 4 * C);
    gpt__gelu_fwd(a.h, a.g, N * 4 * (size_t)C);
    gpt__linear_fwd(a.g, w.fcpw, w.fcpb, out, N, 4 * C, C);
    for (i = 0; i < N * (size_t)C; i++) out[i] += a.x2[i];
}

/* What a backward computes: everything (B), the input half (I: keeps in the stash's W region what the weight
   half needs), or the weight half (W: from that region). I then W adds the same bits as B: the same kernels
   on the same values, each gradient tensor accumulated once per micro-batch. */
enum { GPT__BWD_B, GPT__BWD_I, GPT__BWD_W };

/* Block backward: dout -> din (written), gradients added to gp. scratch: 9 N C + T T floats. sv: the block's W
   region (I and W; 11 N C floats: dout, dH, dln2, dx2, dqkv, dln1). */
static void gpt__block_bwd(const gpt_config *cf, const float *wp, float *gp, float *s, int rows, int T, const float *dout, float *din,
                           float *scratch, float *sv, int mode) {
    const int C = cf->C;
    size_t N = (size_t)rows * T, NC = N * (size_t)C;
    gpt__bw w = gpt__block_w((float *)wp, C), g = gpt__block_w(gp, C); /* w is only read */
    gpt__bs a = gpt__block_s(s, N, C);
    float *dx2 = scratch, *dA = scratch + NC, *dqkv = scratch + 2 * NC, *dH = scratch + 5 * NC, *dP = scratch + 9 * NC, *dln2 = dA, *dln1 = dA;
    if (mode != GPT__BWD_B) dH = sv + NC, dln2 = sv + 5 * NC, dx2 = sv + 6 * NC, dqkv = sv + 7 * NC, dln1 = sv + 10 * NC;
    if (mode == GPT__BWD_W) {
        const float *dy = sv;
        gpt__linear_bwd_w(dy, a.g, g.fcpw, g.fcpb, N, 4 * C, C);
        gpt__linear_bwd_w(dH, a.ln2, g.fcw, g.fcb, N, C, 4 * C);
        gpt__ln_bwd_w(dln2, a.x2, a.mean2, a.rstd2, g.ln2w, g.ln2b, N, C);
        gpt__linear_bwd_w(dx2, a.attout, g.projw, g.projb, N, C, C);
        gpt__linear_bwd_w(dqkv, a.ln1, g.qkvw, g.qkvb, N, C, 3 * C);
        gpt__ln_bwd_w(dln1, a.x, a.mean1, a.rstd1, g.ln1w, g.ln1b, N, C);
        return;
    }
    if (mode == GPT__BWD_I) memcpy(sv, dout, sizeof(float) * NC);
    /* out = x2 + fcproj(gelu(fc(ln2(x2)))) */
    gpt__linear_bwd_x(dout, w.fcpw, dH, N, 4 * C, C);
    if (mode == GPT__BWD_B) gpt__linear_bwd_w(dout, a.g, g.fcpw, g.fcpb, N, 4 * C, C);
    gpt__gelu_bwd(a.h, dH, N * 4 * (size_t)C);
    gpt__linear_bwd_x(dH, w.fcw, dln2, N, C, 4 * C);
    if (mode == GPT__BWD_B) gpt__linear_bwd_w(dH, a.ln2, g.fcw, g.fcb, N, C, 4 * C);
    memcpy(dx2, dout, sizeof(float) * NC);
    gpt__ln_bwd_x(dln2, a.x2, a.mean2, a.rstd2, w.ln2w, dx2, N, C);
    if (mode == GPT__BWD_B) gpt__ln_bwd_w(dln2, a.x2, a.mean2, a.rstd2, g.ln2w, g.ln2b, N, C);
    /* x2 = x + proj(attn(ln1(x))) */
    gpt__linear_bwd_x(dx2, w.projw, dA, N, C, C);
    if (mode == GPT__BWD_B) gpt__linear_bwd_w(dx2, a.attout, g.projw, g.projb, N, C, C);
    gpt__attn_bwd(dA, a.qkv, a.att, dqkv, dP, rows, T, C, cf->H);
    gpt__linear_bwd_x(dqkv, w.qkvw, dln1, N, C, 3 * C);
    if (mode == GPT__BWD_B) gpt__linear_bwd_w(dqkv, a.ln1, g.qkvw, g.qkvb, N, C, 3 * C);
    memcpy(din, dx2, sizeof(float) * NC);
    gpt__ln_bwd_x(dln1, a.x, a.mean1, a.rstd1, w.ln1w, din, N, C);
    if (mode == GPT__BWD_B) gpt__ln_bwd_w(dln1, a.x, a.mean1, a.rstd1, g.ln1w, g.ln1b, N, C);
}

/* Head forward: LNf, logits = ln wte^T, softmax kept in probs; returns sum of mask * -log p(target). */
static double gpt__head_fwd(const gpt_config *cf, const float *wp, const float *wte, float *s, int rows, int T, const float *tgt,
                            const float *mask) {
    const int C = cf->C, V = GPT_VOCAB;
    size_t N = (size_t)rows * T, NC = N * (size_t)C, i;
    float *x = s, *ln = s + NC, *probs = s + 2 * NC, *mean = probs + N * V, *rstd = mean + N;
    double loss = 0.0;
    int v;
    gpt__ln_fwd(x, wp, wp + C, ln, mean, rstd, N, C);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)N, V, C, 1.0f, ln, C, wte, C, 0.0f, probs, V);
    for (i = 0; i < N; i++) {
        float *r = probs + i * V, mx = r[0], sum = 0.0f, inv, zt = r[(int)tgt[i]];
        for (v = 1; v < V; v++) mx = r[v] > mx ? r[v] : mx;
        for (v = 0; v < V; v++) r[v] = gpt__exp(r[v] - mx);
        for (v = 0; v < V; v++) sum += r[v];
        inv = 1.0f / sum;
        for (v = 0; v < V; v++) r[v] *= inv;
        if (mask[i] != 0.0f) loss += (double)mask[i] * (double)(mx + logf(sum) - zt);
    }
    return loss;
}

/* Head backward: dlogits = (p - onehot) mask / batch_weight; dln = dlogits wte; dwte += dlogits^T ln;
   dx (written) from LNf's backward. scratch: N V + N C floats. I writes dlogits over the probabilities in s
   (the backward is their last reader) and dln to sv (N C floats); W reads both. */
static void gpt__head_bwd(const gpt_config *cf, const float *wp, const float *wte, float *gp, float *gwte, float *s, int rows, int T,
                          const float *tgt, const float *mask, float scale, float *dx, float *scratch, float *sv, int mode) {
    const int C = cf->C, V = GPT_VOCAB;
    size_t N = (size_t)rows * T, NC = N * (size_t)C, i;
    float *x = s, *ln = s + NC, *probs = s + 2 * NC, *mean = probs + N * V, *rstd = mean + N;
    float *dl = mode == GPT__BWD_B ? scratch : probs, *dln = mode == GPT__BWD_B ? scratch + N * V : sv;
    int v;
    if (mode != GPT__BWD_W) {
        for (i = 0; i < N; i++) {
            const float *p = probs + i * V;
            float *d = dl + i * V, wgt = mask[i] * scale, py;
            int y = (int)tgt[i];
            py = p[y];
            for (v = 0; v < V; v++) d[v] = p[v] * wgt;
            d[y] = (py - 1.0f) * wgt;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)N, C, V, 1.0f, dl, V, wte, C, 0.0f, dln, C);
    }
    if (mode != GPT__BWD_I) cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, C, (int)N, 1.0f, dl, V, ln, C, 1.0f, gwte, C);
    if (mode != GPT__BWD_W) {
        memset(dx, 0, sizeof(float) * NC);
        gpt__ln_bwd_x(dln, x, mean, rstd, wp, dx, N, C);
    }
    if (mode != GPT__BWD_I) gpt__ln_bwd_w(dln, x, mean, rstd, gp, gp + C, N, C);
}

/* ---- Partition forward and backward ---------------------------------------------------------------------- */

/* Seconds on a monotonic clock (the per-layer times of gpt_forward_timed and gpt_backward_timed). */
static double gpt__now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* gpt_forward, and with sec non-NULL each layer's wall time: sec[l - p->lo] = seconds layer l took (the
   copies into the stash before the first layer are in no layer's time). The same bits as gpt_forward. */
GPT_FN int gpt_forward_timed(const gpt_part *p, const float *params, const gpt_micro *mb, const float *in, float *out, float *stash, double *loss,
                             double *sec) {
    const gpt_config *cf = &p->cfg;
    gpt__smap m;
    size_t N, NC, i;
    int l;
    if (!p || !params || !mb || !stash || mb->rows < 1 || mb->rows > cf->B || mb->T < 1 || mb->T > cf->Tmax) return -1;
    if ((p->has_embed && !mb->tokens) || (!p->has_embed && !in) || (p->has_head && (!mb->targets || !mb->mask)) || (!p->has_head && !out))
        return -1;
    N = (size_t)mb->rows * mb->T, NC = N * (size_t)cf->C;
    gpt__stash_map(p, mb->rows, mb->T, &m);
    stash[0] = (float)mb->rows, stash[1] = (float)mb->T, stash[2] = (float)p->lo, stash[3] = (float)p->hi;
    for (i = 0; i < N; i++) {
        if (p->has_embed) stash[m.tok + i] = (float)mb->tokens[i];
        if (p->has_head) stash[m.tgt + i] = (float)mb->targets[i], stash[m.mask + i] = mb->mask[i];
    }
    if (loss) *loss = 0.0;
    if (!p->has_embed) memcpy(stash + m.layer[0], in, sizeof(float) * NC);
    for (l = p->lo; l < p->hi; l++) {
        float *dst = l + 1 < p->hi ? stash + m.layer[l + 1 - p->lo] : out, *s = stash + m.layer[l - p->lo];
        const float *w = params + p->layer_off[l - p->lo];
        double t0 = sec ? gpt__now() : 0;
        if (l == 0) {
            const float *wte = w, *wpe = w + (size_t)GPT_VOCAB * cf->C;
            int c;
            for (i = 0; i < N; i++) {
                const float *e = wte + (size_t)stash[m.tok + i] * cf->C, *q = wpe + (i % (size_t)mb->T) * cf->C;
                for (c = 0; c < cf->C; c++) dst[i * cf->C + c] = e[c] + q[c];
            }
        } else if (l == cf->L + 1) {
            double ls = gpt__head_fwd(cf, w, params + p->wte_off, s, mb->rows, mb->T, stash + m.tgt, stash + m.mask);
            if (loss) *loss = ls;
        } else {
            gpt__block_fwd(cf, w, s, mb->rows, mb->T, dst);
        }
        if (sec) sec[l - p->lo] = gpt__now() - t0;
    }
    return 0;
}

/* Forward of partition p on micro-batch mb (see the header comment). in: rows x T x C (NULL on the first
   partition); out: rows x T x C (NULL on the last); stash: gpt_part_stash_floats(p) floats; *loss (head
   only; may be NULL) gets the micro-batch's sum of mask * -log p(target), in double. Returns 0, or -1 when
   mb's rows or T is out of range or a needed pointer is NULL. */
GPT_FN int gpt_forward(const gpt_part *p, const float *params, const gpt_micro *mb, const float *in, float *out, float *stash, double *loss) {
    return gpt_forward_timed(p, params, mb, in, out, stash, loss, NULL);
}

/* The backward of partition p in `mode` (GPT__BWD_B, _I, _W; see gpt_backward and gpt_backward_input). */
static int gpt__backward(const gpt_part *p, const float *params, float *grads, float *stash, const float *dout, float *din, float *work,
                         double batch_weight, double *sec, int mode) {
    const gpt_config *cf = &p->cfg;
    gpt__smap m;
    int rows, T, l;
    size_t N, NC;
    const float *cur = dout;
    float *g0 = work, *g1, *scratch, scale = 0;
    if (!p || !stash || (mode != GPT__BWD_W && (!params || !work || !(batch_weight > 0))) || (mode != GPT__BWD_I && !grads)) return -1;
    if (mode != GPT__BWD_W) scale = (float)(1.0 / batch_weight);
    rows = (int)stash[0], T = (int)stash[1];
    if (stash[2] != (float)p->lo || stash[3] != (float)p->hi || rows < 1 || rows > cf->B || T < 1 || T > cf->Tmax) return -1;
    if (mode != GPT__BWD_W && ((!p->has_head && !dout) || (!p->has_embed && !din))) return -1;
    N = (size_t)rows * T, NC = N * (size_t)cf->C;
    g1 = work ? work + NC : NULL, scratch = work ? work + 2 * NC : NULL;
    gpt__stash_map(p, rows, T, &m);
    for (l = p->hi - 1; l >= p->lo; l--) {
        const float *w = params ? params + p->layer_off[l - p->lo] : NULL;
        float *gw = grads ? grads + p->layer_off[l - p->lo] : NULL, *s = stash + m.layer[l - p->lo], *sv = stash + m.wsave[l - p->lo];
        float *dst = l == p->lo ? din : (cur == g0 ? g1 : g0);
        double t0 = sec ? gpt__now() : 0;
        if (l == 0) {
            if (mode == GPT__BWD_I) memcpy(sv, cur, sizeof(float) * NC);
            else {
                const float *d0 = mode == GPT__BWD_W ? sv : cur;
                float *gwte = gw, *gwpe = gw + (size_t)GPT_VOCAB * cf->C;
                size_t i;
                int c;
                for (i = 0; i < N; i++) {
                    const float *d = d0 + i * cf->C;
                    float *e = gwte + (size_t)stash[m.tok + i] * cf->C, *q = gwpe + (i % (size_t)T) * cf->C;
                    for (c = 0; c < cf->C; c++) e[c] += d[c], q[c] += d[c];
                }
            }
        } else if (l == cf->L + 1) {
            gpt__head_bwd(cf, w, params ? params + p->wte_off : NULL, gw, grads ? grads + p->wte_off : NULL, s, rows, T, stash + m.tgt,
                          stash + m.mask, scale, dst, scratch, sv, mode);
        } else {
            gpt__block_bwd(cf, w, gw, s, rows, T, cur, dst, scratch, sv, mode);
        }
        if (sec) sec[l - p->lo] = gpt__now() - t0;
        cur = dst;
    }
    return 0;
}

/* gpt_backward, and with sec non-NULL each layer's wall time in sec[l - p->lo]. The same bits. */
GPT_FN int gpt_backward_timed(const gpt_part *p, const float *params, float *grads, const float *stash, const float *dout, float *din,
                              float *work, double batch_weight, double *sec) {
    return gpt__backward(p, params, grads, (float *)stash, dout, din, work, batch_weight, sec, GPT__BWD_B); /* B only reads the stash */
}

/* Backward of partition p for the micro-batch its `stash` holds (see the header comment). dout: rows x T x C
   (NULL on the last partition); din: rows x T x C, written (NULL on the first); grads: ADDED to; work:
   gpt_part_work_floats(p) floats; batch_weight: the batch's sum of masks (> 0). Returns 0, or -1 when the
   stash was not written by a forward of this partition or a needed pointer is NULL. */
GPT_FN int gpt_backward(const gpt_part *p, const float *params, float *grads, const float *stash, const float *dout, float *din, float *work,
                        double batch_weight) {
    return gpt__backward(p, params, grads, (float *)stash, dout, din, work, batch_weight, NULL, GPT__BWD_B);
}

/* The backward split in two, for zero-bubble schedules (ZB-H1, ZB-V): gpt_backward_input writes din (as
   gpt_backward) and keeps in the stash what the weights need, touching no gradient; gpt_backward_weight,
   later, adds the parameter gradients from the stash alone. The stash must hold gpt_part_stash_floats_iw(p)
   floats (the forward fills the same prefix) and stays in use until the weight half ran; the input half
   may overwrite parts of it that only the backward reads. Together they add exactly the bits gpt_backward
   adds, in each tensor once per micro-batch, so weight halves run in micro-batch order accumulate what
   gpt_backward's do. Returns 0, or -1 as gpt_backward. */
GPT_FN int gpt_backward_input(const gpt_part *p, const float *params, float *stash, const float *dout, float *din, float *work, double batch_weight) {
    return gpt__backward(p, params, NULL, stash, dout, din, work, batch_weight, NULL, GPT__BWD_I);
}

GPT_FN int gpt_backward_weight(const gpt_part *p, float *grads, float *stash) {
    return gpt__backward(p, NULL, grads, stash, NULL, NULL, NULL, 1.0, NULL, GPT__BWD_W);
}

/* ---- Gradient norm, clipping, the tie, AdamW, the schedule ----------------------------------------------- */

/* Sum of squares of partition p's gradient floats in storage order, each square computed in double, added in
   double; skip_wte leaves out its wte range (the last partition's copy: the tied range counts once, on the
   first partition). */
GPT_FN double gpt_sumsq(const gpt_part *p, const float *grads, int skip_wte) {
    double s = 0.0;
    size_t i, skip_from = skip_wte ? p->wte_off : p->nparams, skip_to = skip_wte ? p->wte_off + p->wte_len : p->nparams;
    for (i = 0; i < skip_from; i++) s += (double)grads[i] * (double)grads[i];
    for (i = skip_to; i < p->nparams; i++) s += (double)grads[i] * (double)grads[i];
    return s;
}

/* Number of non-finite floats (NaN, +-inf) in x[0 .. n-1]; read from the bits, so -ffast-math cannot hide them. */
GPT_FN size_t gpt_nonfinite(const float *x, size_t n) {
    size_t i, k = 0;
    for (i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], sizeof u);
        k += (u & 0x7f800000u) == 0x7f800000u;
    }
    return k;
}

/* The tie: a[k] = b[k] = a[k] + b[k] for k < n (one float addition, the same result in both). */
GPT_FN void gpt_tie_sum(float *a, float *b, size_t n) {
    size_t k;
    for (k = 0; k < n; k++) a[k] = b[k] = a[k] + b[k];
}

/* The clip scale: min(1, clip / (sqrt(sumsq) + 1e-6)) in double, as a float; 1 when clip <= 0. */
GPT_FN float gpt_clip_scale(double sumsq, double clip) {
    double s;
    if (!(clip > 0)) return 1.0f;
    s = clip / (sqrt(sumsq) + 1e-6);
    return s < 1.0 ? (float)s : 1.0f;
}

/* Learning rate at step (0-based) of `total`: linear warm-up lr (step + 1) / warmup over the first warmup
   steps, then cosine decay from lr to lr / 10 at step total - 1 (and after). */
GPT_FN double gpt_lr(double lr, long step, long warmup, long total) {
    double prog, lo = 0.1 * lr;
    if (warmup > 0 && step < warmup) return lr * (double)(step + 1) / (double)warmup;
    if (total - 1 <= warmup) return lr;
    prog = (double)(step - warmup) / (double)(total - 1 - warmup);
    if (prog > 1.0) prog = 1.0;
    return lo + 0.5 * (1.0 + cos(3.141592653589793 * prog)) * (lr - lo);
}

/* AdamW hyperparameters. */
typedef struct gpt_adamw_hp {
    float beta1, beta2, eps, weight_decay;
} gpt_adamw_hp;

/* beta1 0.9, beta2 0.95, eps 1e-8, weight decay 0.1 (GPT-2 / nanoGPT). */
GPT_FN gpt_adamw_hp gpt_adamw_defaults(void) {
    gpt_adamw_hp h;
    h.beta1 = 0.9f, h.beta2 = 0.95f, h.eps = 1e-8f, h.weight_decay = 0.1f;
    return h;
}

static void gpt__adamw_range(float *x, const float *g, float *m, float *v, size_t n, float lr, float gs, float wd, float bc1, float bc2,
                             const gpt_adamw_hp *h) {
    const float b1 = h->beta1, b2 = h->beta2, c1 = 1.0f - h->beta1, c2 = 1.0f - h->beta2;
    size_t i;
    for (i = 0; i < n; i++) {
        float gi = g[i] * gs, mi = b1 * m[i] + c1 * gi, vi = b2 * v[i] + c2 * (gi * gi);
        float mh = mi / bc1, vh = vi / bc2;
        m[i] = mi, v[i] = vi;
        x[i] -= lr * (mh / (sqrtf(vh) + h->eps) + wd * x[i]);
    }
}

/* One AdamW step of partition p, elementwise: g = grads * gscale (the clip scale); m, v (p->nparams floats
   each, zero at the start) updated; bias correction for update number t (1-based); decoupled weight decay
   lr * wd * x on the 2-D tensors only (weights, wte, wpe; not biases or LayerNorm). Each float's update
   depends only on its own values, so the two wte copies stay bit-identical. grads is left as it is. */
GPT_FN void gpt_adamw(const gpt_part *p, float *params, const float *grads, float *m, float *v, long t, float lr, float gscale,
                      const gpt_adamw_hp *hp) {
    gpt_tensor ts[GPT_MAX_TENSORS];
    int l, i, n;
    float bc1 = (float)(1.0 - pow((double)hp->beta1, (double)t)), bc2 = (float)(1.0 - pow((double)hp->beta2, (double)t));
    for (l = p->lo; l < p->hi; l++) {
        n = gpt_layer_tensors(&p->cfg, l, l == p->cfg.L + 1 && p->wte_copy, ts);
        for (i = 0; i < n; i++) {
            size_t o = p->layer_off[l - p->lo] + ts[i].off;
            gpt__adamw_range(params + o, grads + o, m + o, v + o, ts[i].len, lr, gscale, ts[i].decay ? hp->weight_decay : 0.0f, bc1, bc2, hp);
        }
    }
}

/* ---- Micro-batch buffers --------------------------------------------------------------------------------- */

/* Allocate mb's buffers for rows x Tmax positions. Returns 0 or -1 (out of memory; *mb zeroed). */
GPT_FN int gpt_micro_alloc(gpt_micro *mb, int rows, int Tmax) {
    size_t n = (size_t)rows * (size_t)Tmax;
    memset(mb, 0, sizeof *mb);
    mb->tokens = (uint8_t *)calloc(n ? n : 1, 1);
    mb->targets = (uint8_t *)calloc(n ? n : 1, 1);
    mb->mask = (float *)calloc(n ? n : 1, sizeof(float));
    if (!mb->tokens || !mb->targets || !mb->mask) {
        free(mb->tokens), free(mb->targets), free(mb->mask);
        memset(mb, 0, sizeof *mb);
        return -1;
    }
    mb->cap = n;
    return 0;
}

/* Free mb's buffers and zero it; safe on a zeroed struct. */
GPT_FN void gpt_micro_free(gpt_micro *mb) {
    free(mb->tokens), free(mb->targets), free(mb->mask);
    memset(mb, 0, sizeof *mb);
}

/* ---- Data: the fortunes corpus ----------------------------------------------------------------------------- */

/* A window of a document: inputs tok[start .. start + len), targets tok[start + 1 .. start + len]. */
typedef struct gpt_window {
    uint32_t start, len;
} gpt_window;

/* The loaded corpus; read-only after gpt_data_load (gpt_data_micro may run on any thread). */
typedef struct gpt_data {
    int Tmax, B;
    uint64_t seed;
    uint8_t *tok;                /* every document's 0, bytes, 0, one after the other */
    size_t ntok;
    size_t nfiles, ndocs, nval_docs;
    gpt_window *train, *val;     /* windows sorted by (len, start) */
    size_t ntrain, nval;
    size_t *gstart;              /* Tmax + 2 entries: training windows of length len are [gstart[len], gstart[len + 1]) */
    size_t nmicro;               /* training micro-batches per epoch: ntrain / B */
    double train_targets, val_targets; /* target positions (bytes + one end per document) */
} gpt_data;

typedef struct gpt__buf {
    uint8_t *p;
    size_t n, cap;
} gpt__buf;

static int gpt__buf_put(gpt__buf *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 1 << 16;
        uint8_t *q;
        while (cap < b->n + n) cap *= 2;
        q = (uint8_t *)realloc(b->p, cap);
        if (!q) return -1;
        b->p = q, b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
    return 0;
}

static int gpt__blank(const uint8_t *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\n' && s[i] != '\r') return 0;
    return 1;
}

/* Append the documents of one fortunes file (text in t[0 .. n-1]) to tok, their (start, targets) to docs. */
static int gpt__parse_fortunes(const uint8_t *t, size_t n, gpt__buf *tok, gpt__buf *docs) {
    size_t pos = 0, start = 0;
    while (pos <= n) {
        size_t eol = pos;
        int sep, last;
        while (eol < n && t[eol] != '\n') eol++;
        sep = (eol - pos == 1 && t[pos] == '%') || (eol - pos == 2 && t[pos] == '%' && t[pos + 1] == '\r');
        last = eol >= n;
        if (sep || last) {
            size_t end = sep ? pos : n;
            if (end > start && !gpt__blank(t + start, end - start)) {
                gpt_window d;
                uint8_t zero = 0;
                if (tok->n + (end - start) + 2 > 0xffffffffu) return -2;
                d.start = (uint32_t)tok->n, d.len = (uint32_t)(end - start + 1);
                if (gpt__buf_put(tok, &zero, 1) || gpt__buf_put(tok, t + start, end - start) || gpt__buf_put(tok, &zero, 1) ||
                    gpt__buf_put(docs, &d, sizeof d))
                    return -1;
            }
            start = eol + 1;
        }
        if (last) break;
        pos = eol + 1;
    }
    return 0;
}

static int gpt__cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int gpt__cmp_win(const void *a, const void *b) {
    const gpt_window *x = (const gpt_window *)a, *y = (const gpt_window *)b;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return x->start < y->start ? -1 : x->start > y->start;
}

/* The plain files of dir, sorted by name (not .dat, not symlinks, not directories, not dot files). */
static int gpt__list_corpus(const char *dir, char ***names, size_t *n, char *err, size_t cap) {
    DIR *d = opendir(dir);
    struct dirent *e;
    size_t k = 0, room = 0;
    char **v = NULL, path[4096];
    *names = NULL, *n = 0;
    int oom = 0;
    if (!d)
        return gpt__err(err, cap, "cannot open the fortunes corpus '%s': %s (it comes with the Debian package fortunes: apt-get install fortunes)",
                        dir, strerror(errno));
    while (!oom && (e = readdir(d)) != NULL) {
        struct stat st;
        size_t len = strlen(e->d_name);
        char **nv;
        if (e->d_name[0] == '.' || (len > 4 && !strcmp(e->d_name + len - 4, ".dat"))) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (lstat(path, &st) || !S_ISREG(st.st_mode)) continue;
        if (k == room) {
            room = room ? 2 * room : 64;
            if (!(nv = (char **)realloc(v, room * sizeof *v))) {
                oom = 1;
                break;
            }
            v = nv;
        }
        if (!(v[k] = (char *)malloc(len + 1))) oom = 1;
        else memcpy(v[k++], e->d_name, len + 1);
    }
    closedir(d);
    if (oom) {
        while (k) free(v[--k]);
        free(v);
        return gpt__err(err, cap, "out of memory listing '%s'", dir);
    }
    if (v) qsort(v, k, sizeof *v, gpt__cmp_str);
    *names = v, *n = k;
    return 0;
}

static int gpt__read_file(const char *path, gpt__buf *b) {
    FILE *f = fopen(path, "rb");
    uint8_t chunk[65536];
    size_t r;
    b->n = 0;
    if (!f) return -1;
    while ((r = fread(chunk, 1, sizeof chunk, f)) > 0)
        if (gpt__buf_put(b, chunk, r)) return fclose(f);
    r = (size_t)ferror(f);
    fclose(f);
    return r ? -1 : 0;
}

/* Free the corpus and zero *d; safe on a zeroed struct. */
GPT_FN void gpt_data_free(gpt_data *d) {
    free(d->tok), free(d->train), free(d->val), free(d->gstart);
    memset(d, 0, sizeof *d);
}

/* Cut the documents into windows of at most Tmax targets, training or validation by document index. */
static int gpt__make_windows(gpt_data *d, const gpt_window *docs, size_t ndocs) {
    size_t i, nt = 0, nv = 0, T = (size_t)d->Tmax, l;
    for (i = 0; i < ndocs; i++) {
        size_t w = (docs[i].len + T - 1) / T;
        if (i % GPT_VAL_EVERY == GPT_VAL_EVERY - 1) nv += w, d->nval_docs++;
        else nt += w;
    }
    d->train = (gpt_window *)malloc((nt ? nt : 1) * sizeof(gpt_window));
    d->val = (gpt_window *)malloc((nv ? nv : 1) * sizeof(gpt_window));
    d->gstart = (size_t *)calloc(T + 2, sizeof(size_t));
    if (!d->train || !d->val || !d->gstart) return -1;
    for (i = 0; i < ndocs; i++) {
        int isval = i % GPT_VAL_EVERY == GPT_VAL_EVERY - 1;
        for (l = 0; l < docs[i].len; l += T) {
            gpt_window w;
            w.start = docs[i].start + (uint32_t)l, w.len = (uint32_t)(docs[i].len - l < T ? docs[i].len - l : T);
            if (isval) d->val[d->nval++] = w, d->val_targets += w.len;
            else d->train[d->ntrain++] = w, d->train_targets += w.len;
        }
    }
    qsort(d->train, d->ntrain, sizeof(gpt_window), gpt__cmp_win);
    qsort(d->val, d->nval, sizeof(gpt_window), gpt__cmp_win);
    for (l = 0, i = 0; l <= T + 1; l++) {
        while (i < d->ntrain && d->train[i].len < l) i++;
        d->gstart[l] = i;
    }
    d->nmicro = d->ntrain / (size_t)d->B;
    return 0;
}

/* Load the fortunes corpus of dir (/usr/share/games/fortunes; the header comment says what is read and
   how it is split) for micro-batches of B rows and context Tmax; seed fixes the batch order. Returns 0, or
   -1 with err set (the directory cannot be read: the message names the Debian package fortunes; no
   document; a file that cannot be read; out of memory). On failure *d is zeroed. */
GPT_FN int gpt_data_load(gpt_data *d, const char *dir, int Tmax, int B, uint64_t seed, char *err, size_t cap) {
    gpt__buf tok = {0}, docs = {0}, file = {0};
    char **names = NULL, path[4096];
    size_t n = 0, i;
    int rc = 0;
    memset(d, 0, sizeof *d);
    if (Tmax < 1 || B < 1) return gpt__err(err, cap, "context %d and rows %d: want both >= 1", Tmax, B);
    d->Tmax = Tmax, d->B = B, d->seed = seed;
    if (gpt__list_corpus(dir, &names, &n, err, cap)) return -1;
    for (i = 0; i < n && !rc; i++) {
        int pr;
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        if (gpt__read_file(path, &file)) rc = gpt__err(err, cap, "cannot read '%s': %s", path, strerror(errno));
        else if ((pr = gpt__parse_fortunes(file.p, file.n, &tok, &docs)) != 0)
            rc = gpt__err(err, cap, pr == -2 ? "the corpus in '%s' is larger than 4 GB" : "out of memory reading '%s'", dir);
        d->nfiles++;
    }
    for (i = 0; i < n; i++) free(names[i]);
    free(names), free(file.p);
    d->tok = tok.p, d->ntok = tok.n, d->ndocs = docs.n / sizeof(gpt_window);
    if (!rc && !d->ndocs)
        rc = gpt__err(err, cap, "no fortunes in '%s' (want text files of entries separated by %% lines: the Debian package fortunes, "
                                "apt-get install fortunes)", dir);
    if (!rc && gpt__make_windows(d, (const gpt_window *)docs.p, d->ndocs)) rc = gpt__err(err, cap, "out of memory cutting windows");
    free(docs.p);
    if (rc) gpt_data_free(d);
    return rc ? -1 : 0;
}

/* A keyed permutation of [0, n): a 4-round balanced Feistel network on the smallest even number of bits
   covering n, cycle-walked back into range. Pure: element i of the permutation without building it. */
static uint64_t gpt__permute(uint64_t i, uint64_t n, uint64_t key) {
    unsigned half = 1;
    uint64_t mask;
    if (n <= 1) return 0;
    while (half < 32 && (1ull << (2 * half)) < n) half++;
    mask = (1ull << half) - 1;
    do {
        uint64_t l = i >> half, r = i & mask, f;
        int round;
        for (round = 0; round < 4; round++) {
            f = gpt__mix(r ^ gpt__mix(key + (uint64_t)round)) & mask;
            f ^= l, l = r, r = f;
        }
        i = (l << half) | r;
    } while (i >= n);
    return i;
}

/* Training batches per epoch for M micro-batches per batch: floor(nmicro / M). */
GPT_FN long gpt_data_batches_per_epoch(const gpt_data *d, int M) {
    return M >= 1 ? (long)(d->nmicro / (size_t)M) : 0;
}

/* The training window in row r of micro-batch u of batch `step` (0-based over the whole run). */
static const gpt_window *gpt__train_row(const gpt_data *d, long step, int u, int M, int r) {
    uint64_t nb = d->nmicro / (uint64_t)M, e = (uint64_t)step / nb, b = (uint64_t)step % nb;
    uint64_t k = gpt__permute(b * (uint64_t)M + (uint64_t)u, d->nmicro, gpt__mix(d->seed ^ gpt__mix(2 * e)));
    uint64_t j = k * (uint64_t)d->B + (uint64_t)r, len = d->train[j].len, g = d->gstart[len], gn = d->gstart[len + 1] - g;
    return &d->train[g + gpt__permute(j - g, gn, gpt__mix(d->seed ^ gpt__mix(2 * e + 1) ^ (len << 40)))];
}

/* Which rows a micro-batch is made of: training (step, u, M) or validation micro-batch v. */
typedef struct gpt__src {
    int val, u, M;
    long step;
    size_t v;
} gpt__src;

/* Row r's window, or NULL for an empty row (past the end of the validation list). */
static const gpt_window *gpt__row(const gpt_data *d, const gpt__src *src, int r) {
    size_t j = src->v * (size_t)d->B + (size_t)r;
    if (!src->val) return gpt__train_row(d, src->step, src->u, src->M, r);
    return j < d->nval ? &d->val[j] : NULL;
}

/* Fill mb with the B rows of src: T = the longest window (at least 1), shorter rows padded (mask 0). */
static void gpt__fill(const gpt_data *d, const gpt__src *src, gpt_micro *mb) {
    int r, t, T = 1;
    for (r = 0; r < d->B; r++) {
        const gpt_window *w = gpt__row(d, src, r);
        if (w && (int)w->len > T) T = (int)w->len;
    }
    mb->rows = d->B, mb->T = T, mb->ntok = 0;
    for (r = 0; r < d->B; r++) {
        const gpt_window *w = gpt__row(d, src, r);
        int n = w ? (int)w->len : 0;
        for (t = 0; t < T; t++) {
            size_t i = (size_t)r * T + t;
            mb->tokens[i] = t < n ? d->tok[w->start + t] : 0;
            mb->targets[i] = t < n ? d->tok[w->start + t + 1] : 0;
            mb->mask[i] = t < n ? 1.0f : 0.0f;
        }
        mb->ntok += n;
    }
}

/* Micro-batch u (0 .. M-1) of training batch `step` (0-based over the run; epoch step / batches-per-epoch)
   into mb (from gpt_micro_alloc(mb, B, Tmax)): B rows, T = the longest window, shorter rows padded with mask
   0. A pure function of (seed, step, u, M): any thread, any order. Returns 0, or -1 when u is outside
   [0, M), step < 0, an epoch has no batch of M micro-batches, or mb is too small. */
GPT_FN int gpt_data_micro(const gpt_data *d, long step, int u, int M, gpt_micro *mb) {
    gpt__src src;
    if (M < 1 || u < 0 || u >= M || step < 0 || gpt_data_batches_per_epoch(d, M) < 1 || mb->cap < (size_t)d->B * d->Tmax) return -1;
    src.val = 0, src.u = u, src.M = M, src.step = step, src.v = 0;
    gpt__fill(d, &src, mb);
    return 0;
}

/* Sum of the masks (non-padding positions) of training batch `step`: what gpt_backward's batch_weight is. */
GPT_FN double gpt_data_batch_tokens(const gpt_data *d, long step, int M) {
    double s = 0;
    int u, r;
    if (gpt_data_batches_per_epoch(d, M) < 1 || step < 0) return 0;
    for (u = 0; u < M; u++)
        for (r = 0; r < d->B; r++) s += gpt__train_row(d, step, u, M, r)->len;
    return s;
}

/* Fraction of padded positions over the micro-batches an epoch is cut into (the same every epoch: the
   permutations move windows only among equal lengths). */
GPT_FN double gpt_data_padding(const gpt_data *d) {
    double pad = 0, all = 0;
    size_t k, r, B = (size_t)d->B;
    for (k = 0; k < d->nmicro; k++) {
        double T = d->train[k * B + B - 1].len;
        all += T * (double)B;
        for (r = 0; r < B; r++) pad += T - d->train[k * B + r].len;
    }
    return all > 0 ? pad / all : 0;
}

/* Validation micro-batches: ceil(nval / B). */
GPT_FN size_t gpt_data_val_micros(const gpt_data *d) {
    return (d->nval + (size_t)d->B - 1) / (size_t)d->B;
}

/* Validation micro-batch v: windows v B .. v B + B - 1 of the fixed validation list (sorted by length); rows
   past its end are empty (mask 0). Returns 0, or -1 when v is out of range or mb too small. */
GPT_FN int gpt_data_val_micro(const gpt_data *d, size_t v, gpt_micro *mb) {
    gpt__src src;
    if (v >= gpt_data_val_micros(d) || mb->cap < (size_t)d->B * d->Tmax) return -1;
    src.val = 1, src.u = 0, src.M = 1, src.step = 0, src.v = v;
    gpt__fill(d, &src, mb);
    return 0;
}

/* ---- Whole-model helpers: evaluation, sampling ------------------------------------------------------------- */

/* Buffers for running every partition's forward in one thread. */
typedef struct gpt__runner {
    float **stash, *a0, *a1;
    int n;
} gpt__runner;

static void gpt__runner_free(gpt__runner *r) {
    int s;
    if (r->stash)
        for (s = 0; s < r->n; s++) free(r->stash[s]);
    free(r->stash), free(r->a0), free(r->a1);
    memset(r, 0, sizeof *r);
}

static int gpt__runner_init(gpt__runner *r, const gpt_part *parts, int n) {
    int s;
    memset(r, 0, sizeof *r);
    r->n = n;
    r->stash = (float **)calloc((size_t)n, sizeof(float *));
    r->a0 = (float *)malloc(sizeof(float) * gpt_act_floats(&parts[0].cfg));
    r->a1 = (float *)malloc(sizeof(float) * gpt_act_floats(&parts[0].cfg));
    if (!r->stash || !r->a0 || !r->a1) return gpt__runner_free(r), -1;
    for (s = 0; s < n; s++)
        if (!(r->stash[s] = (float *)malloc(sizeof(float) * gpt_part_stash_floats(&parts[s])))) return gpt__runner_free(r), -1;
    return 0;
}

/* Forward of every partition in turn; returns the head's loss sum. */
static double gpt__run_forward(gpt__runner *r, const gpt_part *parts, int n, float *const *params, const gpt_micro *mb) {
    double loss = 0;
    const float *in = NULL;
    int s;
    for (s = 0; s < n; s++) {
        float *out = s + 1 < n ? (s % 2 ? r->a1 : r->a0) : NULL;
        gpt_forward(&parts[s], params[s], mb, in, out, r->stash[s], &loss);
        in = out;
    }
    return loss;
}

/* Validation loss of the model held as partitions parts[0 .. n-1] with parameters params[s]: nats per
   non-padding token (*nats) and bits per byte (*bpb = nats / ln 2; a token is a byte or a document's end),
   over max_micro validation micro-batches spread evenly over the list (0: all of them; the list is sorted
   by length, so a subset is every (nval / max_micro)-th). Single thread. Returns 0, or -1 (err set). */
GPT_FN int gpt_eval(const gpt_part *parts, int n, float *const *params, const gpt_data *d, size_t max_micro, double *nats, double *bpb, char *err,
                    size_t cap) {
    gpt__runner r;
    gpt_micro mb;
    size_t v, nv = gpt_data_val_micros(d);
    double loss = 0, tok = 0;
    if (gpt__parts_check(parts, n, err, cap)) return -1;
    if (d->B > parts[0].cfg.B || d->Tmax > parts[0].cfg.Tmax)
        return gpt__err(err, cap, "the data's micro-batches (%d x %d) exceed the model's (%d x %d)", d->B, d->Tmax, parts[0].cfg.B, parts[0].cfg.Tmax);
    if (!nv) return gpt__err(err, cap, "no validation documents");
    if (gpt__runner_init(&r, parts, n) || gpt_micro_alloc(&mb, d->B, d->Tmax)) return gpt__runner_free(&r), gpt__err(err, cap, "out of memory");
    if (!max_micro || max_micro > nv) max_micro = nv;
    for (v = 0; v < max_micro; v++) {
        gpt_data_val_micro(d, v * nv / max_micro, &mb);
        loss += gpt__run_forward(&r, parts, n, params, &mb);
        tok += mb.ntok;
    }
    gpt__runner_free(&r), gpt_micro_free(&mb);
    *nats = loss / tok;
    if (bpb) *bpb = *nats / log(2.0);
    return 0;
}

/* Draw the next byte from probabilities p[0 .. V-1] with temperature and top-k (0: all): the k most likely
   bytes (ties: the lower byte) weighted p^(1 / temperature); temperature <= 0 takes the most likely byte. */
static int gpt__draw(const float *p, float temperature, int topk, gpt_rng *rng) {
    int idx[GPT_VOCAB], i, j, k = topk > 0 && topk < GPT_VOCAB ? topk : GPT_VOCAB;
    double w[GPT_VOCAB], sum = 0, u;
    for (i = 0; i < GPT_VOCAB; i++) idx[i] = i;
    for (i = 0; i < k; i++) { /* selection of the k largest, in order */
        int best = i;
        for (j = i + 1; j < GPT_VOCAB; j++)
            if (p[idx[j]] > p[idx[best]] || (p[idx[j]] == p[idx[best]] && idx[j] < idx[best])) best = j;
        j = idx[i], idx[i] = idx[best], idx[best] = j;
    }
    if (!(temperature > 0)) return idx[0];
    for (i = 0; i < k; i++) sum += (w[i] = p[idx[i]] > 0 ? exp(log((double)p[idx[i]]) / temperature) : 0);
    u = gpt__uniform(rng) * sum;
    for (i = 0; i < k - 1; i++) {
        if (u <= w[i]) break;
        u -= w[i];
    }
    return idx[i];
}

/* Generate up to maxnew bytes after `prompt` (a document start: the model sees 0, prompt...; the last Tmax
   tokens when longer), stopping at the end-of-document byte 0. Deterministic from seed. out gets the
   generated bytes, NUL-terminated (outcap >= maxnew + 1). Single thread. Returns the number of bytes
   generated, or -1 (err set). */
GPT_FN int gpt_sample(const gpt_part *parts, int n, float *const *params, const char *prompt, int maxnew, float temperature, int topk,
                      uint64_t seed, char *out, size_t outcap, char *err, size_t cap) {
    const gpt_config *cf = &parts[0].cfg;
    gpt__runner r;
    gpt_micro mb;
    gpt__smap m;
    gpt_rng rng;
    size_t plen = strlen(prompt), len, total;
    uint8_t *seq;
    int k = 0, t;
    if (gpt__parts_check(parts, n, err, cap)) return -1;
    if (maxnew < 0 || outcap < (size_t)maxnew + 1) return gpt__err(err, cap, "sample: output buffer too small");
    total = plen + 1 + (size_t)maxnew;
    seq = (uint8_t *)malloc(total);
    if (!seq || gpt__runner_init(&r, parts, n) || gpt_micro_alloc(&mb, 1, cf->Tmax)) {
        free(seq);
        return gpt__err(err, cap, "out of memory");
    }
    rng.s = gpt__mix(seed ^ 0x5eed);
    seq[0] = 0, memcpy(seq + 1, prompt, plen), len = plen + 1;
    for (k = 0; k < maxnew; k++) {
        size_t from = len > (size_t)cf->Tmax ? len - (size_t)cf->Tmax : 0;
        int c;
        mb.rows = 1, mb.T = (int)(len - from);
        for (t = 0; t < mb.T; t++) mb.tokens[t] = seq[from + t], mb.targets[t] = 0, mb.mask[t] = 0;
        gpt__run_forward(&r, parts, n, params, &mb);
        gpt__stash_map(&parts[n - 1], 1, mb.T, &m);
        {
            size_t NC = (size_t)mb.T * cf->C, head = m.layer[parts[n - 1].hi - 1 - parts[n - 1].lo];
            c = gpt__draw(r.stash[n - 1] + head + 2 * NC + (size_t)(mb.T - 1) * GPT_VOCAB, temperature, topk, &rng);
        }
        if (c == 0) break;
        out[k] = (char)c, seq[len++] = (uint8_t)c;
    }
    out[k] = '\0';
    free(seq), gpt__runner_free(&r), gpt_micro_free(&mb);
    return k;
}

/* ---- Save and load ------------------------------------------------------------------------------------------- */

/* File: magic "GPTBYTE1" (8 bytes), then little-endian uint32 version (1), vocab (256), C, L, H, Tmax,
   uint64 count (floats that follow), then every parameter tensor once in canonical order: layer 0 (wte,
   wpe), blocks 1 .. L, head (lnf.w, lnf.b); wte only with layer 0. Floats as little-endian IEEE binary32.
   The bytes depend only on the model, not on how it is partitioned. */

static void gpt__le32(uint8_t *b, uint32_t v) {
    b[0] = (uint8_t)v, b[1] = (uint8_t)(v >> 8), b[2] = (uint8_t)(v >> 16), b[3] = (uint8_t)(v >> 24);
}

static uint32_t gpt__rd32(const uint8_t *b) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

/* The partition holding layer l. */
static int gpt__owner(const gpt_part *parts, int n, int l) {
    int s;
    for (s = 0; s < n; s++)
        if (l >= parts[s].lo && l < parts[s].hi) return s;
    return -1;
}

static void gpt__header(const gpt_config *c, uint8_t h[40]) {
    uint64_t cnt = gpt_config_params(c);
    memcpy(h, GPT_FILE_MAGIC, 8);
    gpt__le32(h + 8, GPT_FILE_VERSION), gpt__le32(h + 12, GPT_VOCAB), gpt__le32(h + 16, (uint32_t)c->C);
    gpt__le32(h + 20, (uint32_t)c->L), gpt__le32(h + 24, (uint32_t)c->H), gpt__le32(h + 28, (uint32_t)c->Tmax);
    gpt__le32(h + 32, (uint32_t)cnt), gpt__le32(h + 36, (uint32_t)(cnt >> 32));
}

/* Save the model held as parts[0 .. n-1] / params[s] to path (the format above), through path.tmp renamed
   at the end, so a crash leaves either the old file or the new one. Returns 0 or -1 (err set). */
GPT_FN int gpt_save(const char *path, const gpt_part *parts, int n, float *const *params, char *err, size_t cap) {
    const gpt_config *c = &parts[0].cfg;
    uint8_t h[40], buf[4096];
    char tmp[4096];
    FILE *f;
    int l, ok;
    if (gpt__parts_check(parts, n, err, cap)) return -1;
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) return gpt__err(err, cap, "path too long: '%s'", path);
    if (!(f = fopen(tmp, "wb"))) return gpt__err(err, cap, "cannot create '%s': %s", tmp, strerror(errno));
    gpt__header(c, h);
    ok = fwrite(h, 1, sizeof h, f) == sizeof h;
    for (l = 0; l < c->L + 2 && ok; l++) {
        int s = gpt__owner(parts, n, l), i, k;
        gpt_tensor t[GPT_MAX_TENSORS];
        k = gpt_layer_tensors(c, l, 0, t); /* never the wte copy: wte goes once, with layer 0 */
        for (i = 0; i < k && ok; i++) {
            const float *x = params[s] + parts[s].layer_off[l - parts[s].lo] + t[i].off;
            size_t j, b = 0;
            for (j = 0; j < t[i].len && ok; j++) {
                uint32_t u;
                memcpy(&u, &x[j], 4);
                gpt__le32(buf + b, u), b += 4;
                if (b == sizeof buf || j + 1 == t[i].len) ok = fwrite(buf, 1, b, f) == b, b = 0;
            }
        }
    }
    if (fclose(f) != 0) ok = 0;
    if (!ok) {
        gpt__err(err, cap, "cannot write '%s': %s", tmp, strerror(errno));
        remove(tmp);
        return -1;
    }
    if (rename(tmp, path)) {
        gpt__err(err, cap, "cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
        remove(tmp);
        return -1;
    }
    return 0;
}

/* Load path into parts[0 .. n-1] / params[s] (any partitioning of the same config; wte goes to both copies).
   Returns 0, or -1 (err set): not a model file, another version or config (named), truncated, trailing bytes. */
GPT_FN int gpt_load(const char *path, const gpt_part *parts, int n, float *const *params, char *err, size_t cap) {
    const gpt_config *c = &parts[0].cfg;
    static const char *const field[] = {"version", "vocabulary", "channels", "layers", "heads", "context"};
    uint8_t h[40], want[40], b[4];
    FILE *f;
    int l, i, bad = 0;
    if (gpt__parts_check(parts, n, err, cap)) return -1;
    if (!(f = fopen(path, "rb"))) return gpt__err(err, cap, "cannot open '%s': %s", path, strerror(errno));
    gpt__header(c, want);
    if (fread(h, 1, sizeof h, f) != sizeof h || memcmp(h, GPT_FILE_MAGIC, 8))
        return fclose(f), gpt__err(err, cap, "'%s' is not a gpt_model file (no %s header)", path, GPT_FILE_MAGIC);
    for (i = 0; i < 6; i++)
        if (gpt__rd32(h + 8 + 4 * i) != gpt__rd32(want + 8 + 4 * i))
            return fclose(f), gpt__err(err, cap, "'%s': %s %u, the model has %u", path, field[i], gpt__rd32(h + 8 + 4 * i), gpt__rd32(want + 8 + 4 * i));
    if (memcmp(h + 32, want + 32, 8)) return fclose(f), gpt__err(err, cap, "'%s': wrong parameter count", path);
    for (l = 0; l < c->L + 2 && !bad; l++) {
        int s = gpt__owner(parts, n, l), k, last = n - 1;
        gpt_tensor t[GPT_MAX_TENSORS];
        k = gpt_layer_tensors(c, l, 0, t);
        for (i = 0; i < k && !bad; i++) {
            float *x = params[s] + parts[s].layer_off[l - parts[s].lo] + t[i].off;
            float *copy = l == 0 && i == 0 && parts[last].wte_copy ? params[last] + parts[last].wte_off : NULL;
            size_t j;
            for (j = 0; j < t[i].len && !bad; j++) {
                uint32_t u;
                if (fread(b, 1, 4, f) != 4) bad = 1;
                u = gpt__rd32(b);
                memcpy(&x[j], &u, 4);
                if (copy) memcpy(&copy[j], &u, 4);
            }
        }
    }
    if (!bad && fread(b, 1, 1, f) == 1) bad = 2;
    fclose(f);
    if (bad) return gpt__err(err, cap, bad == 1 ? "'%s' is truncated" : "'%s' has bytes after the parameters", path);
    return 0;
}

#if defined(__clang__)
#pragma float_control(pop)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif /* GPT_MODEL_H_FUNCTIONS */
