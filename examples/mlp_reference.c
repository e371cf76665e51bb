/* mlp_reference.c — the non-pipelined baseline: trains examples/mlp.h's MLP on Fashion-MNIST in one
   thread (plain loop over micro-batches, Adam step per batch) and reports samples/s and test accuracy.
   It is the baseline the pipelined example (fashion_mnist.c) is measured against, with the same model,
   initial weights and sample order (that of one pipeline).

   Build: gcc -std=c11 -O2 -Wall -Wextra -pedantic -Werror -I. examples/mlp_reference.c -o /tmp/mlp_ref \
              -lopenblas -lz -lm -pthread
   Run:   /tmp/mlp_ref [--epochs 10] [--batch 128] [--micro 4] [--lr 1e-3] ...   (--help lists all) */
#define _POSIX_C_SOURCE 200809L
#define MLP_IMPLEMENTATION
#include "examples/mlp.h"
#define BLAS_KERNEL_IMPLEMENTATION
#include "examples/blas_kernel.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void openblas_set_num_threads(int num_threads); /* also in OpenBLAS's cblas.h; not in netlib's */

typedef struct options {
    int stages, micro, batch, epochs, threads, limit_train, normalize, eval_every, cosine;
    double lr, wd;
    unsigned long long seed;
    const char *data, *hidden, *save;
} options;

static const char *usage =
    "usage: mlp_reference [options]\n"
    "  --hidden LIST      hidden widths (default 512,256,128: 784-512-256-128-10)\n"
    "  --stages G         stage partitions (default 4; same numbers, other buffers)\n"
    "  --batch B          samples per batch (default 128)\n"
    "  --micro M          micro-batches per batch (default 4)\n"
    "  --epochs E         (default 10)\n"
    "  --lr LR            Adam learning rate (default 1e-3)\n"
    "  --constant-lr      no cosine decay of the learning rate (default: cosine to 0 over the run)\n"
    "  --wd WD            L2 weight decay (default 0)\n"
    "  --seed S           weights and sample order (default 1)\n"
    "  --data DIR         (default /usr/share/datasets/fashion-mnist)\n"
    "  --save FILE        write the trained parameters (mlp_params_save)\n"
    "  --limit-train N    use only the first N training samples\n"
    "  --threads T        OpenBLAS threads (default 1: the single-thread baseline)\n"
    "  --eval-every K     test accuracy every K epochs (default 1; 0: only at the end)\n"
    "  --no-normalize     keep pixels in [0, 1] (default: standardise with the training set's mean/std)\n";

static void die_usage(const char *msg, const char *arg) {
    fprintf(stderr, "mlp_reference: %s '%s' (try --help)\n", msg, arg);
    exit(2);
}

static long parse_long(const char *flag, const char *s, long lo, long hi) {
    char *end;
    long v;
    errno = 0;
    v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) {
        fprintf(stderr, "mlp_reference: %s expects an integer in [%ld, %ld], got '%s'\n", flag, lo, hi, s);
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
        fprintf(stderr, "mlp_reference: %s expects a number in [%g, %g], got '%s'\n", flag, lo, hi, s);
        exit(2);
    }
    return v;
}

static int is_value_flag(const char *f) {
    static const char *const names[] = {"--stages", "--micro", "--batch", "--epochs", "--threads", "--limit-train",
                                        "--eval-every", "--lr", "--wd", "--seed", "--data", "--hidden", "--save"};
    size_t i;
    for (i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(f, names[i])) return 1;
    return 0;
}

static void parse_options(int argc, char **argv, options *o) {
    int i;
    o->stages = 4, o->micro = 4, o->batch = 128, o->epochs = 10, o->threads = 1, o->limit_train = 0;
    o->normalize = 1, o->cosine = 1, o->eval_every = 1, o->lr = 1e-3, o->wd = 0, o->seed = 1;
    o->data = "/usr/share/datasets/fashion-mnist", o->hidden = "512,256,128", o->save = NULL;
    for (i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) fputs(usage, stdout), exit(0);
        if (!strcmp(f, "--no-normalize")) { o->normalize = 0; continue; }
        if (!strcmp(f, "--constant-lr")) { o->cosine = 0; continue; }
        if (strncmp(f, "--", 2) != 0) die_usage("unexpected argument", f);
        if (!is_value_flag(f)) die_usage("unknown option", f);
        if (!v) die_usage("missing value after", f);
        i++;
        if (!strcmp(f, "--stages")) o->stages = (int)parse_long(f, v, 1, MLP_MAX_LAYERS);
        else if (!strcmp(f, "--micro")) o->micro = (int)parse_long(f, v, 1, 1 << 16);
        else if (!strcmp(f, "--batch")) o->batch = (int)parse_long(f, v, 1, 1 << 20);
        else if (!strcmp(f, "--epochs")) o->epochs = (int)parse_long(f, v, 1, 100000);
        else if (!strcmp(f, "--threads")) o->threads = (int)parse_long(f, v, 1, 1024);
        else if (!strcmp(f, "--limit-train")) o->limit_train = (int)parse_long(f, v, 1, 1 << 24);
        else if (!strcmp(f, "--eval-every")) o->eval_every = (int)parse_long(f, v, 0, 100000);
        else if (!strcmp(f, "--lr")) o->lr = parse_double(f, v, 1e-9, 10);
        else if (!strcmp(f, "--wd")) o->wd = parse_double(f, v, 0, 1);
        else if (!strcmp(f, "--seed")) o->seed = (unsigned long long)parse_long(f, v, 0, 2147483647L);
        else if (!strcmp(f, "--data")) o->data = v;
        else if (!strcmp(f, "--hidden")) o->hidden = v;
        else if (!strcmp(f, "--save")) o->save = v;
        else die_usage("unknown option", f);
    }
    if (o->batch % o->micro != 0) {
        fprintf(stderr, "mlp_reference: --batch %d is not a multiple of --micro %d\n", o->batch, o->micro);
        exit(2);
    }
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Load, optionally standardise (with the training set's statistics, before truncation). */
static int load_data(const options *o, mlp_data *train, mlp_data *test) {
    char err[512];
    if (mlp_data_load_fashion(o->data, train, test, err, sizeof err) != 0) {
        fprintf(stderr, "mlp_reference: %s\n", err);
        return -1;
    }
    if (o->normalize) {
        float mean, std;
        mlp_data_stats(train, &mean, &std);
        mlp_data_normalize(train, mean, std);
        mlp_data_normalize(test, mean, std);
    }
    if (o->limit_train) mlp_data_truncate(train, o->limit_train);
    return 0;
}

/* One epoch; returns 0, or -1 on a non-finite loss. Adds the training time to *train_s. */
static int run_epoch(mlp_reference *r, int epoch, double *train_s, double *loss, double *acc) {
    int64_t rpe = r->order.rounds_per_epoch, t;
    double t0 = now(), sum = 0;
    long hits = 0;
    for (t = 0; t < rpe; t++) {
        double l;
        int c;
        if (mlp_reference_batch(r, (int64_t)epoch * rpe + t, &l, &c) != 0) {
            fprintf(stderr, "\nmlp_reference: non-finite loss in epoch %d, batch %lld (lower --lr?)\n", epoch + 1,
                    (long long)t);
            return -1;
        }
        mlp_reference_step(r);
        sum += l;
        hits += c;
    }
    *train_s += now() - t0;
    *loss = sum / (double)rpe;
    *acc = (double)hits / ((double)rpe * r->order.batch);
    return 0;
}

static int train(const options *o, const mlp_model *m, const mlp_data *trainset, const mlp_data *test) {
    mlp_reference r;
    mlp_adam_hp hp = mlp_adam_defaults();
    char err[512];
    double train_s = 0, test_acc = -1, loss, acc;
    int e;
    hp.lr = (float)o->lr;
    hp.weight_decay = (float)o->wd;
    if (mlp_reference_init(&r, m, trainset, o->batch, o->micro, &hp, o->seed, o->seed, err, sizeof err) != 0) {
        fprintf(stderr, "mlp_reference: %s\n", err);
        return -1;
    }
    if (o->cosine) r.decay_steps = r.order.rounds_per_epoch * o->epochs;
    for (e = 0; e < o->epochs; e++) {
        if (run_epoch(&r, e, &train_s, &loss, &acc) != 0) break;
        printf("epoch %3d  loss %.4f  train acc %.4f  %.1f s  %.0f samples/s", e + 1, loss, acc, train_s,
               (double)r.order.rounds_per_epoch * o->batch * (e + 1) / train_s);
        if ((o->eval_every && (e + 1) % o->eval_every == 0) || e + 1 == o->epochs) {
            test_acc = mlp_evaluate(m, (const float *const *)r.net.params, test, NULL);
            printf("  test acc %.4f", test_acc);
        }
        printf("\n");
        fflush(stdout);
    }
    if (e == o->epochs)
        printf("done: %d epochs, %.1f s training, %.0f samples/s, test accuracy %.4f\n", e, train_s,
               (double)r.order.rounds_per_epoch * o->batch * e / train_s, test_acc);
    if (e == o->epochs && o->save &&
        mlp_params_save(o->save, m, (const float *const *)r.net.params, err, sizeof err) != 0) {
        fprintf(stderr, "mlp_reference: %s\n", err);
        e = -1;
    }
    mlp_reference_free(&r);
    return e == o->epochs ? 0 : -1;
}

int main(int argc, char **argv) {
    options o;
    mlp_model m;
    mlp_data trainset, test;
    char err[512], desc[256];
    int rc;
    parse_options(argc, argv, &o);
    if (mlp_model_parse(&m, 784, o.hidden, o.stages, err, sizeof err) != 0) {
        fprintf(stderr, "mlp_reference: %s\n", err);
        return 2;
    }
    { /* a generic OpenBLAS kernel on a CPU that can do better: restart with the right one (blas_kernel.h) */
        blas_kernel_shape shapes[MLP_MAX_LAYERS];
        blas_kernel_status bk;
        int l;
        for (l = 0; l < m.layers; l++) shapes[l].m = o.batch / o.micro, shapes[l].n = m.width[l + 1], shapes[l].k = m.width[l];
        blas_kernel_ensure(argv, shapes, m.layers, "mlp_reference", &bk);
        printf("BLAS: %s, %d thread%s\n", bk.line, o.threads, o.threads > 1 ? "s" : "");
    }
    openblas_set_num_threads(o.threads);
    if (load_data(&o, &trainset, &test) != 0) return 1;
    if (trainset.dim != m.width[0]) { /* the model was parsed for 28x28 inputs */
        rc = mlp_model_parse(&m, trainset.dim, o.hidden, o.stages, err, sizeof err);
        if (rc != 0) return fprintf(stderr, "mlp_reference: %s\n", err), 1;
    }
    mlp_model_describe(&m, desc, sizeof desc);
    printf("model %s; batch %d = %d x %d, Adam lr %g%s, %d training samples, %d test\n", desc, o.batch, o.micro,
           o.batch / o.micro, o.lr, o.cosine ? " (cosine decay)" : "", trainset.n, test.n);
    rc = train(&o, &m, &trainset, &test);
    mlp_data_free(&trainset);
    mlp_data_free(&test);
    return rc == 0 ? 0 : 1;
}
