/* cuda_mlp.cu — the CUDA twin of examples/fashion_mnist.c: the same MLP (examples/mlp.h's model, weights,
   sample order and Adam) trained on Fashion-MNIST by N parallel pipelines of G stages with elastic
   averaging, on NVIDIA GPUs. Linear layers are cuBLAS SGEMMs; bias, ReLU, softmax cross-entropy, their
   gradients, the sample gather and Adam are small kernels of this file. Same flags and output as the CPU
   example (tuner included), plus --backend nccl, --device and --nccl-id.

   Two ways to run:
     one process, all stages on one GPU (default, --backend threads): every rank is a thread of this
       process, every stage on the same GPU; the N pipelines' kernels run concurrently on their own
       streams (AvgPipe's point: N small pipelines fill a GPU one pipeline leaves idle);
           build/cuda_mlp                                  (tuner picks schedule, M, N, K)
           build/cuda_mlp --micro 4 --pipes 2 --device 1
     one process per GPU over NCCL (--backend nccl): rank r of S runs stage r on the node-local GPU;
       activations and gradients go GPU to GPU through NCCL (avgpipe_nccl.h). The launcher gives the rank
       (Open MPI, MPICH/PMI, Slurm or torchrun variables); the NCCL id goes through a file (--nccl-id):
           mpirun -np 4 build/cuda_mlp --backend nccl
           mpirun -np 8 build/cuda_mlp --backend nccl --replicas 2       (2 replica groups of 4 ranks)
   Without a CUDA device it says so and exits with status 77 (a test harness's "skipped").

   THE DEVICE AND STREAM CONTRACT (avgpipe.h "Devices and streams", DESIGN.md section 6)
     - run_desc.device is the CUDA device table (avgpipe_cuda.h): the runtime's boundary buffers (op->input,
       op->output, op->grad_output, op->grad_input) are device memory, and so are the parameters we give it
       (run_desc.params), which the averaging pulls toward the reference in place, on the GPU.
     - A callback ENQUEUES its kernels on op->stream (the compute stream of its pipeline on its rank) and
       returns; it never waits for the GPU. The runtime records an event after each op and orders sends,
       receives, STEP and averaging after it with event waits. So everything a callback reads or writes on
       the device (its stash, the gradient accumulator, the loss accumulator) is touched only by work
       enqueued on that one stream, in op order.
     - The optimizer is cb.step_async: Adam is enqueued on the pipeline's stream after the round's backward
       work. The Adam step counter and learning rate live on the host (the step is enqueued in order).
     - op->loss is read when the callback returns, before the GPU has computed anything: this example never
       sets it. The last stage's loss kernel adds each micro-batch's mean loss and argmax hits to a
       per-model accumulator in device memory; after each iteration (when the runtime has waited for the
       GPU) the host copies the accumulators back and prints them as the CPU example prints op->loss.
     - A stash (the activations a backward needs) is keyed by (replica, stage, slot): the runtime hands a
       slot to a new micro-batch only after the previous holder's work on the device has finished.
     - cuBLAS: one handle per (rank, pipeline), used only by that rank's worker thread and bound to that
       pipeline's stream, so two streams never share a handle's workspace. Default math mode: FP32 SGEMM,
       no TF32.
     - The host waits for the GPU only between iterations: to read the loss accumulators, to evaluate,
       save or checkpoint the reference model, and to grow the stashes.

   Numerics: the same operations as mlp.h, in fp32, built with -fmad=false (no contraction into FMA, as
   the CPU build); cuBLAS and OpenBLAS sum the GEMMs in different orders, so results agree to rounding,
   not bit for bit. Evaluation runs on the host (mlp_evaluate on the reference copied back).

   Build (meson does it when it finds nvcc, cuBLAS, OpenBLAS and zlib; NCCL optional; for the architectures
   of -Dnvcc_arch, by default sm_80 and sm_90 machine code and compute_90 PTX):
       nvcc -std=c++14 -O2 -fmad=false -gencode arch=compute_90,code=sm_90 -I. \
            -I/usr/include/x86_64-linux-gnu/openblas-pthread \
            [-DCUDA_MLP_NCCL] examples/cuda_mlp.cu -o cuda_mlp -lcublas [-lnccl] -lopenblas -lz -lpthread -lm

   Callback mapping (avgpipe_op_ctx -> kernels, all on op->stream):
     forward   stage 0 copies the micro-batch's sample indices to the device and gathers their pixels from
               the training set in GPU memory (the last stage gathers their labels); per layer
               Y = X W^T (SGEMM), then bias (+ ReLU); the last stage runs softmax cross-entropy in place
               (probabilities kept for B) into the loss accumulator; other stages copy their output.
     backward  I then W, as mlp.h's mlp_stage_backward.
     I         dZ at the top (softmax - onehot) / batch on the last stage, else grad_output masked by ReLU;
               dX = dZ W (SGEMM) down the stage's layers.
     W         dW += dZ^T X (SGEMM), db += column sums of dZ.
     step      (step_async) Adam on (pipe, stage), cosine learning-rate decay; zeroes the gradient. */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_cuda.h"
#ifdef CUDA_MLP_NCCL
#include "avgpipe_nccl.h"
#endif
#define MLP_IMPLEMENTATION
#include "examples/mlp.h"
#define PROG "cuda_mlp"
#include "examples/mlp_app.h" /* options, parse_options, fail, bad_usage (shared with fashion_mnist.c) */

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXIT_NO_GPU 77 /* no CUDA device: "skipped" for meson and automake test harnesses */

/* What one in-flight micro-batch of one stage keeps on the device between its forward and backward
   (mlp.h's mlp_stash, in GPU memory). */
typedef struct dev_stash {
    uint32_t *idx;              /* stage 0 and last stage: the micro-batch's sample indices */
    float *x;                   /* stage 0: the gathered input, mb x width[0] */
    uint8_t *labels;            /* last stage: the gathered labels */
    float *act[MLP_MAX_LAYERS]; /* per layer of the stage: output after ReLU (probabilities at the top of the model) */
    float *dz[MLP_MAX_LAYERS];  /* per layer: gradient of its pre-activation (written by I, read by W) */
} dev_stash;

/* One parallel model's local stages on the device (mlp.h's mlp_net); the Adam step count on the host. */
typedef struct dev_net {
    float *params[MLP_MAX_LAYERS], *grad[MLP_MAX_LAYERS], *m[MLP_MAX_LAYERS], *v[MLP_MAX_LAYERS];
    long t[MLP_MAX_LAYERS];
} dev_net;

/* Per model, in device memory: what the last stage's loss kernel adds up over an iteration. */
typedef struct loss_acc {
    double loss;                  /* sum of the micro-batches' mean cross-entropies */
    unsigned long long correct;   /* argmax hits */
    unsigned long long micro;     /* micro-batches */
    unsigned long long nonfinite; /* micro-batches whose loss was NaN or infinite */
} loss_acc;

/* Everything the callbacks reach through op->user (as in fashion_mnist.c). A model is replica * N + pipe. */
typedef struct app {
    options opt;
    mlp_model model;
    mlp_data train, test;  /* host: loaded by mlp.h; the training set is also copied to the GPU */
    mlp_order order;
    int G, S, mb;
    float loss_scale;
    int64_t decay_steps;
    mlp_adam_hp adam;
    dev_net *nets;         /* [D * N]; only local stages allocated */
    float **params;        /* [model * G + stage] -> nets[model].params[stage] (device), NULL when not local */
    size_t act_bytes[MLP_MAX_LAYERS];
    int slots[MLP_MAX_LAYERS];
    dev_stash *stash[MAX_REPLICAS][MLP_MAX_LAYERS]; /* [replica][stage][slot] */
    mlp_perm perm[MAX_REPLICAS][MLP_MAX_LAYERS];    /* host sample order cache of stage 0 and the last stage */
    float *d_pixels;       /* the training set on the device (pixels when stage 0 is local, labels when the last is) */
    uint8_t *d_labels;
    loss_acc *d_acc, *h_acc; /* [D * N] */
    cublasHandle_t *blas;    /* [global rank * N + pipe], local ranks only */
    cudaStream_t *blas_stream; /* the stream each handle is bound to */
    int nblas;
    /* the GPU */
    avgpipe_device gpu;    /* avgpipe_cuda.h's table: run_desc.device */
    int gpu_ordinal, have_gpu;
    avgpipe_device_stream aux; /* this program's own copies between iterations */
    /* --backend nccl: this process's rank and the comm backend; me = -1 with threads */
    int me, nproc, have_comm;
    avgpipe_comm comm;
    float *ref[MLP_MAX_LAYERS]; /* host: the reference model, for evaluation and --save */
} app;

/* ---- Options (as fashion_mnist.c; --backend threads|nccl, --device, --nccl-id) ----------------- */

static const char usage[] =
    "usage: " PROG " [options]\n"
    "  --stages G          stage partitions of the model (default 4)\n"
    "  --backend B         threads (default: every rank a thread of this process, all stages on one GPU) |\n"
    "                      nccl (one rank per process, one GPU each, NCCL between them: mpirun -np\n"
    "                      <replicas x ranks> " PROG " --backend nccl ...)\n"
    "  --device D          threads: the CUDA device to run on (default 0); nccl: each process takes its\n"
    "                      node-local rank's GPU\n"
    "  --nccl-id FILE      nccl: where rank 0 leaves NCCL's id for the others (a file every rank sees;\n"
    "                      default $TMPDIR/" PROG "-nccl-<job>.id)\n"
    MLP_APP_USAGE_FLAGS("nccl")
    "  --no-normalize      keep pixels in [0, 1] (default: standardise with the training set's mean/std)\n"
    "Tuning (when --micro or --pipes is auto, the default): before training, the model is profiled on the\n"
    "GPU for a few iterations of 1 pipeline at two micro-batch sizes on throwaway copies of the initial\n"
    "weights (training then starts from the same weights and sample order as without tuning), a cost\n"
    "model is fitted, and every setting (schedule, M, N <= 4, K, round mode) is simulated; what the\n"
    "command line fixes (--micro, --pipes, --schedule, --sync) stays fixed. The fastest predicted per\n"
    "sample within --mem-limit is trained (near-ties, within 0.5%: fewer pipelines, then less memory).\n"
    "The fit, the choice and the best alternatives (one per M and N) go to stderr. With --backend nccl,\n"
    "rank 0 tunes alone (all stages on its GPU) and the others train with its choice.\n"
    "Exit status: 0 trained, 1 failed, 2 bad command line, 77 no CUDA device.\n";

static const char *const own_flags[] = {"--device", "--nccl-id", NULL};

/* This program's flags with a value (the shared ones: mlp_app.h). */
static void own_value(options *o, const char *f, const char *v) {
    if (!strcmp(f, "--device")) o->device = (int)parse_long(f, v, 0, 1023), o->device_set = 1;
    else if (!strcmp(f, "--nccl-id")) o->nccl_id = v;
}

/* This program's cross-flag checks, after the shared ones. */
static void own_check(options *o) {
    if (o->procs && o->device_set)
        bad_usage("--device applies to --backend threads; with nccl each process takes its node-local rank's GPU "
                  "(or set CUDA_VISIBLE_DEVICES per process)");
    if (!o->procs && o->nccl_id) bad_usage("--nccl-id applies only to --backend nccl");
}

static const mlp_cli_program program = {
    usage, NULL, "nccl",
#ifdef CUDA_MLP_NCCL
    NULL,
#else
    "this build has no NCCL (install NCCL and rebuild with -DCUDA_MLP_NCCL -lnccl)",
#endif
    own_flags, NULL, own_value, own_check, tuning, "the tuner (--micro auto or --pipes auto)"};

/* ---- Device helpers (host side, between iterations) -------------------------------------------- */

/* The CUDA table's last failure, for messages. */
static const char *gpu_error(const app *A, avgpipe_result r) {
    const char *s = A->gpu.error_string ? A->gpu.error_string(A->gpu.user) : NULL;
    return s && *s ? s : avgpipe_result_string(r);
}

static int dev_alloc(app *A, void **p, size_t bytes, const char *what) {
    avgpipe_result r = A->gpu.alloc(A->gpu.user, bytes ? bytes : 1, p);
    if (r != AVGPIPE_OK) {
        *p = NULL;
        return fail("cannot allocate %zu bytes of GPU memory for %s: %s", bytes, what, gpu_error(A, r));
    }
    return 0;
}

static void dev_free(app *A, void *p) {
    if (p && A->have_gpu) A->gpu.free(A->gpu.user, p);
}

/* A copy (or, src NULL, a memset to zero) on this program's own stream, waited for (bounded: the table's
   stream_synchronize gives up after its timeout). Only between iterations, when no callback's work is
   in flight. */
static int dev_copy(app *A, void *dst, const void *src, size_t bytes, avgpipe_device_copy_kind kind, const char *what) {
    avgpipe_result r;
    if (!bytes) return 0;
    r = src ? A->gpu.copy(A->gpu.user, dst, src, bytes, kind, A->aux) : A->gpu.memset(A->gpu.user, dst, 0, bytes, A->aux);
    if (r == AVGPIPE_OK) r = A->gpu.stream_synchronize(A->gpu.user, A->aux);
    return r == AVGPIPE_OK ? 0 : fail("%s: %s", what, gpu_error(A, r));
}

/* ---- Kernels ------------------------------------------------------------------------------------
   Grid-stride loops; all launched on the op's stream. The element operations are mlp.h's. */

#define BLOCK 256

static unsigned grid_for(size_t n) {
    size_t b = (n + BLOCK - 1) / BLOCK;
    return (unsigned)(b < 1 ? 1 : b > 4096 ? 4096 : b);
}

/* x[r][c] = pixels[idx[r]][c] (x may be NULL); labels_out[r] = labels[idx[r]] (labels_out may be NULL). */
__global__ void k_gather(float *x, uint8_t *labels_out, const float *pixels, const uint8_t *labels, const uint32_t *idx,
                         int n, int dim) {
    size_t i, stride = (size_t)gridDim.x * blockDim.x, start = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (x)
        for (i = start; i < (size_t)n * (size_t)dim; i += stride)
            x[i] = pixels[(size_t)idx[i / (size_t)dim] * (size_t)dim + i % (size_t)dim];
    if (labels_out)
        for (i = start; i < (size_t)n; i += stride) labels_out[i] = labels[idx[i]];
}

/* y[r][j] += b[j], then ReLU (NaN -> 0, as mlp.h) unless relu is 0. */
__global__ void k_bias_act(float *y, const float *b, int n, int out, int relu) {
    size_t i, stride = (size_t)gridDim.x * blockDim.x;
    for (i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)n * (size_t)out; i += stride) {
        float v = y[i] + b[i % (size_t)out];
        y[i] = relu && !(v > 0.0f) ? 0.0f : v;
    }
}

/* dz = g where a > 0, else 0 (dz may be g). */
__global__ void k_relu_back(float *dz, const float *g, const float *a, size_t count) {
    size_t i, stride = (size_t)gridDim.x * blockDim.x;
    for (i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) dz[i] = a[i] > 0.0f ? g[i] : 0.0f;
}

/* The last stage's top gradient: (softmax - onehot) * scale. */
__global__ void k_loss_grad(float *dz, const float *probs, const uint8_t *labels, int n, float scale) {
    size_t i, stride = (size_t)gridDim.x * blockDim.x;
    for (i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)n * MLP_CLASSES; i += stride) {
        unsigned j = (unsigned)(i % MLP_CLASSES);
        dz[i] = (probs[i] - (j == labels[i / MLP_CLASSES] ? 1.0f : 0.0f)) * scale;
    }
}

/* gb[j] += dz[0][j] + dz[1][j] + ... in row order (mlp.h's order), one thread per column. */
__global__ void k_bias_grad(float *gb, const float *dz, int n, int out) {
    int j, i;
    for (j = blockIdx.x * blockDim.x + threadIdx.x; j < out; j += gridDim.x * blockDim.x) {
        float s = gb[j];
        for (i = 0; i < n; i++) s += dz[(size_t)i * out + j];
        gb[j] = s;
    }
}

/* Softmax cross-entropy in place over n rows of MLP_CLASSES logits, as mlp_stage_loss: the rows become
   probabilities; the micro-batch's mean loss, its argmax hits and a non-finite flag are added to *acc.
   ONE block (a fixed reduction tree), so the sum does not depend on scheduling. */
__global__ void k_softmax_xent(float *z, const uint8_t *labels, int n, loss_acc *acc) {
    __shared__ double s_loss[BLOCK];
    __shared__ unsigned s_hits[BLOCK];
    double loss = 0;
    unsigned hits = 0;
    int i, j, k;
    for (i = threadIdx.x; i < n; i += blockDim.x) {
        float *r = z + (size_t)i * MLP_CLASSES, mx = r[0], sum = 0.0f;
        int arg = 0;
        for (j = 1; j < MLP_CLASSES; j++)
            if (r[j] > mx) mx = r[j], arg = j;
        for (j = 0; j < MLP_CLASSES; j++) sum += (r[j] = expf(r[j] - mx));
        loss -= log((double)r[labels[i]] / sum);
        for (j = 0; j < MLP_CLASSES; j++) r[j] /= sum;
        hits += arg == labels[i];
    }
    s_loss[threadIdx.x] = loss;
    s_hits[threadIdx.x] = hits;
    __syncthreads();
    for (k = BLOCK / 2; k > 0; k /= 2) {
        if ((int)threadIdx.x < k) {
            s_loss[threadIdx.x] += s_loss[threadIdx.x + k];
            s_hits[threadIdx.x] += s_hits[threadIdx.x + k];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        double mean = s_loss[0] / n;
        acc->loss += isfinite(mean) ? mean : 0.0;
        acc->nonfinite += !isfinite(mean);
        acc->correct += s_hits[0];
        acc->micro += 1;
    }
}

/* mlp_adam_step on the device: step = lr / (1 - beta1^t), inv = 1 / sqrt(1 - beta2^t) come from the host. */
__global__ void k_adam(float *p, float *grad, float *m, float *v, size_t count, float b1, float b2, float eps, float wd,
                       float step, float inv) {
    size_t i, stride = (size_t)gridDim.x * blockDim.x;
    for (i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        float g = grad[i] + wd * p[i];
        m[i] = b1 * m[i] + (1.0f - b1) * g;
        v[i] = b2 * v[i] + (1.0f - b2) * g * g;
        p[i] -= step * m[i] / (sqrtf(v[i]) * inv + eps);
        grad[i] = 0.0f;
    }
}

/* ---- Stage callbacks ---------------------------------------------------------------------------- */

static int model_of(const app *A, const avgpipe_op_ctx *op) { return op->replica * A->opt.pipes + op->pipe; }

static int op_failed(const avgpipe_op_ctx *op, const char *what) {
    fprintf(stderr, "\n" PROG ": %s (pipeline %d, stage %d, round %d, micro-batch %d)\n", what, op->pipe, op->stage, op->round,
            op->micro);
    return 1;
}

static dev_stash *op_stash(app *A, const avgpipe_op_ctx *op) {
    if (op->stage < 0 || op->stage >= A->G || op->slot < 0 || op->slot >= A->slots[op->stage] || op->pipe < 0 ||
        op->pipe >= A->opt.pipes || op->replica < 0 || op->replica >= A->opt.replicas || !A->stash[op->replica][op->stage]) {
        fprintf(stderr, "\n" PROG ": op of replica %d, pipeline %d, stage %d, slot %d is outside the model's %d replicas, %d "
                "pipelines, %d stages, %d slots\n", op->replica, op->pipe, op->stage, op->slot, A->opt.replicas, A->opt.pipes,
                A->G, op->stage >= 0 && op->stage < A->G ? A->slots[op->stage] : 0);
        return NULL;
    }
    return &A->stash[op->replica][op->stage][op->slot];
}

/* Every op: the stream the runtime gives (an avgpipe.h that runs ops on the CPU device gives none: its
   buffers are host memory, which these kernels cannot use), this thread on our GPU, the stash. */
static dev_stash *op_begin(app *A, const avgpipe_op_ctx *op, cudaStream_t *stream) {
    if (!op->stream) {
        op_failed(op, "the runtime gave no device stream (op->stream is NULL): this avgpipe.h runs the stages on the CPU "
                      "device; " PROG " needs a runtime that honours run_desc.device");
        return NULL;
    }
    if (cudaSetDevice(A->gpu_ordinal) != cudaSuccess) {
        op_failed(op, "cudaSetDevice failed");
        return NULL;
    }
    *stream = AVGPIPE_CUDA_STREAM(op->stream);
    return op_stash(A, op);
}

/* The (rank, pipeline) cuBLAS handle, bound to this op's stream. */
static cublasHandle_t op_blas(app *A, const avgpipe_op_ctx *op, cudaStream_t stream) {
    int k = op->rank * A->opt.pipes + op->pipe;
    if (k < 0 || k >= A->nblas || !A->blas[k]) return NULL;
    if (A->blas_stream[k] != stream) {
        if (cublasSetStream(A->blas[k], stream) != CUBLAS_STATUS_SUCCESS) return NULL;
        A->blas_stream[k] = stream;
    }
    return A->blas[k];
}

/* Launch errors (bad configuration, a sticky fault from earlier work) of this thread's last launches. */
static int launched(const avgpipe_op_ctx *op, const char *what) {
    cudaError_t e = cudaGetLastError();
    char msg[512];
    if (e == cudaSuccess) return 0;
    snprintf(msg, sizeof msg, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return op_failed(op, msg);
}

static int cuda_failed(const avgpipe_op_ctx *op, const char *what, cudaError_t e) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return op_failed(op, msg);
}

static int blas_failed(const avgpipe_op_ctx *op, const char *what, cublasStatus_t s) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s: cuBLAS: %s", what, cublasGetStatusString(s));
    return op_failed(op, msg);
}

static const float ONE = 1.0f, ZERO = 0.0f;

/* Y = X W^T (row-major, n x out): column-major Y^T = W X^T, W read as its transpose (ld = in). */
static cublasStatus_t gemm_forward(cublasHandle_t h, int in, int out, int n, const float *w, const float *x, float *y) {
    return cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &ONE, w, in, x, in, &ZERO, y, out);
}

/* dX = dZ W (row-major, n x in): column-major dX^T = W^T dZ^T. */
static cublasStatus_t gemm_dx(cublasHandle_t h, int in, int out, int n, const float *w, const float *dz, float *dx) {
    return cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, &ONE, w, in, dz, out, &ZERO, dx, in);
}

/* dW += dZ^T X (row-major, out x in): column-major dW^T += X^T dZ. */
static cublasStatus_t gemm_dw(cublasHandle_t h, int in, int out, int n, const float *x, const float *dz, float *dw) {
    return cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, &ONE, x, in, dz, out, &ONE, dw, in);
}

/* Stage 0 gathers the micro-batch's pixels, the last stage its labels (both when G = 1): the indices come
   from the host's order (mlp.h), copied from pageable memory (cudaMemcpyAsync stages such a copy before
   it returns, so the host cache may change afterwards), then a gather kernel on the stream. */
static int load_samples(app *A, const avgpipe_op_ctx *op, dev_stash *st, cudaStream_t s) {
    const uint32_t *idx = mlp_order_micro(&A->order, &A->perm[op->replica][op->stage], model_of(A, op), op->round, op->micro, A->mb);
    int i, first = op->stage == 0, last = op->stage == A->G - 1;
    cudaError_t e;
    if (!idx) return op_failed(op, "cannot load the samples");
    for (i = 0; i < A->mb; i++)
        if (idx[i] >= (uint32_t)A->train.n) return op_failed(op, "sample index outside the training set");
    if ((first && !A->d_pixels) || (last && !A->d_labels)) return op_failed(op, "the training set is not on this GPU");
    if ((e = cudaMemcpyAsync(st->idx, idx, sizeof(uint32_t) * (size_t)A->mb, cudaMemcpyHostToDevice, s)) != cudaSuccess)
        return cuda_failed(op, "copying the sample indices", e);
    k_gather<<<grid_for((size_t)A->mb * (first ? (size_t)A->train.dim : 1)), BLOCK, 0, s>>>(
        first ? st->x : NULL, last ? st->labels : NULL, A->d_pixels, A->d_labels, st->idx, A->mb, A->train.dim);
    return launched(op, "gathering the samples");
}

static int cb_forward(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    const mlp_model *m = &A->model;
    cudaStream_t s = NULL;
    dev_stash *st = op_begin(A, op, &s);
    cublasHandle_t h;
    cublasStatus_t bs;
    const float *x;
    int l, k, first, top, last, n = A->mb;
    if (!st) return 1;
    if (!(h = op_blas(A, op, s))) return op_failed(op, "no cuBLAS handle for this rank and pipeline");
    last = op->stage == A->G - 1;
    if ((op->stage == 0 || last) && load_samples(A, op, st, s) != 0) return 1;
    x = op->stage == 0 ? st->x : (const float *)op->input;
    if (!x) return op_failed(op, "forward without an input");
    first = m->first[op->stage];
    top = m->first[op->stage + 1] - 1 - first;
    for (k = 0; k <= top; k++) {
        const float *w;
        l = first + k;
        w = op->params + m->offset[l];
        if ((bs = gemm_forward(h, m->width[l], m->width[l + 1], n, w, x, st->act[k])) != CUBLAS_STATUS_SUCCESS)
            return blas_failed(op, "forward", bs);
        k_bias_act<<<grid_for((size_t)n * m->width[l + 1]), BLOCK, 0, s>>>(st->act[k], w + (size_t)m->width[l + 1] * m->width[l],
                                                                        n, m->width[l + 1], l != m->layers - 1);
        x = st->act[k];
    }
    if (!last) {
        if (!op->output) return op_failed(op, "forward without an output buffer");
        cudaError_t e = cudaMemcpyAsync(op->output, st->act[top], A->act_bytes[op->stage], cudaMemcpyDeviceToDevice, s);
        if (e != cudaSuccess) return cuda_failed(op, "copying the stage's output", e);
        return launched(op, "forward");
    }
    /* The loss goes to the model's accumulator, read by the host after the iteration (op->loss stays 0). */
    k_softmax_xent<<<1, BLOCK, 0, s>>>(st->act[top], st->labels, n, &A->d_acc[model_of(A, op)]);
    return launched(op, "forward (loss)");
}

static int cb_backward_input(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    const mlp_model *m = &A->model;
    cudaStream_t s = NULL;
    dev_stash *st = op_begin(A, op, &s);
    cublasHandle_t h;
    cublasStatus_t bs;
    int k, first, top, last, n = A->mb;
    if (!st) return 1;
    if (!(h = op_blas(A, op, s))) return op_failed(op, "no cuBLAS handle for this rank and pipeline");
    first = m->first[op->stage];
    top = m->first[op->stage + 1] - 1 - first;
    last = op->stage == A->G - 1;
    if (last)
        k_loss_grad<<<grid_for((size_t)n * MLP_CLASSES), BLOCK, 0, s>>>(st->dz[top], st->act[top], st->labels, n, A->loss_scale);
    else if (op->grad_output)
        k_relu_back<<<grid_for((size_t)n * m->width[first + top + 1]), BLOCK, 0, s>>>(
            st->dz[top], (const float *)op->grad_output, st->act[top], (size_t)n * m->width[first + top + 1]);
    else
        return op_failed(op, "backward without the gradient of the output");
    for (k = top; k >= 0; k--) {
        const float *w = op->params + m->offset[first + k];
        float *dx = k > 0 ? st->dz[k - 1] : (float *)op->grad_input;
        if (!dx) continue; /* stage 0: no gradient of the input */
        if ((bs = gemm_dx(h, m->width[first + k], m->width[first + k + 1], n, w, st->dz[k], dx)) != CUBLAS_STATUS_SUCCESS)
            return blas_failed(op, "backward to the input (I)", bs);
        if (k > 0)
            k_relu_back<<<grid_for((size_t)n * m->width[first + k]), BLOCK, 0, s>>>(dx, dx, st->act[k - 1],
                                                                                 (size_t)n * m->width[first + k]);
    }
    return launched(op, "backward to the input (I)");
}

static int cb_backward_weight(avgpipe_op_ctx *op) {
    app *A = (app *)op->user;
    const mlp_model *m = &A->model;
    cudaStream_t s = NULL;
    dev_stash *st = op_begin(A, op, &s);
    cublasHandle_t h;
    cublasStatus_t bs;
    float *grad;
    const float *x0;
    int k, first, top, n = A->mb;
    if (!st) return 1;
    if (!(h = op_blas(A, op, s))) return op_failed(op, "no cuBLAS handle for this rank and pipeline");
    grad = A->nets[model_of(A, op)].grad[op->stage];
    x0 = op->stage == 0 ? st->x : (const float *)op->input;
    if (!grad || !x0) return op_failed(op, "backward to the weights without its gradient buffer or input");
    first = m->first[op->stage];
    top = m->first[op->stage + 1] - 1 - first;
    for (k = top; k >= 0; k--) {
        int l = first + k, in = m->width[l], out = m->width[l + 1];
        const float *x = k > 0 ? st->act[k - 1] : x0;
        float *g = grad + m->offset[l];
        if ((bs = gemm_dw(h, in, out, n, x, st->dz[k], g)) != CUBLAS_STATUS_SUCCESS)
            return blas_failed(op, "backward to the weights (W)", bs);
        k_bias_grad<<<grid_for((size_t)out), BLOCK, 0, s>>>(g + (size_t)out * in, st->dz[k], n, out);
    }
    return launched(op, "backward to the weights (W)");
}

/* B: I then W, on the same stream (mlp_stage_backward). */
static int cb_backward(avgpipe_op_ctx *op) {
    return cb_backward_input(op) != 0 ? 1 : cb_backward_weight(op);
}

static int stage_rank(const app *A, int g) {
    return avgpipe_place_rank(v_placed(A->opt.schedule) ? AVGPIPE_PLACE_V : AVGPIPE_PLACE_LOOP, A->S, g);
}

/* Adam on (pipe, stage), enqueued on the pipeline's stream after the round's backward work. The step
   count is the host's: STEP ops of one (pipe, stage) are enqueued in order, so t and the cosine decay
   follow that model's own steps, as in fashion_mnist.c. */
static int cb_step_async(int rank, int pipe, int stage, int round, float *params, avgpipe_device_stream stream, void *user) {
    app *A = (app *)user;
    int model = rank / A->S * A->opt.pipes + pipe;
    dev_net *net;
    long t;
    float lr, step, inv;
    cudaError_t e;
    (void)round;
    if (pipe < 0 || pipe >= A->opt.pipes || stage < 0 || stage >= A->G || model >= A->opt.pipes * A->opt.replicas || !stream) {
        fprintf(stderr, "\n" PROG ": step of rank %d, pipeline %d, stage %d%s\n", rank, pipe, stage,
                stream ? " is outside the model" : ": no device stream (the runtime must honour run_desc.device)");
        return 1;
    }
    if (cudaSetDevice(A->gpu_ordinal) != cudaSuccess) return 1;
    net = &A->nets[model];
    lr = mlp_lr_cosine(A->adam.lr, net->t[stage], A->decay_steps); /* the rate of this step, before counting it */
    t = ++net->t[stage];
    step = (float)(lr / (1.0 - pow(A->adam.beta1, (double)t)));
    inv = (float)(1.0 / sqrt(1.0 - pow(A->adam.beta2, (double)t)));
    k_adam<<<grid_for(A->model.count[stage]), BLOCK, 0, AVGPIPE_CUDA_STREAM(stream)>>>(
        params, net->grad[stage], net->m[stage], net->v[stage], A->model.count[stage], A->adam.beta1, A->adam.beta2, A->adam.eps,
        A->adam.weight_decay, step, inv);
    if ((e = cudaGetLastError()) != cudaSuccess) {
        fprintf(stderr, "\n" PROG ": Adam (pipeline %d, stage %d): %s\n", pipe, stage, cudaGetErrorString(e));
        return 1;
    }
    return 0;
}

/* Checkpoints: the Adam state (step count, both moments) of the rank's stages of each model of its
   replica group, copied from the GPU (between iterations: nothing is in flight). */
static int cb_save_state(int rank, avgpipe_buf *out, void *user) {
    app *A = (app *)user;
    int i, g, d = rank / A->S;
    for (i = d * A->opt.pipes; i < (d + 1) * A->opt.pipes; i++)
        for (g = 0; g < A->G; g++)
            if (stage_rank(A, g) == rank % A->S) {
                dev_net *net = &A->nets[i];
                size_t n = A->model.count[g] * sizeof(float);
                int64_t t = net->t[g];
                float *host = (float *)malloc(2 * n);
                int rc = host ? 0 : fail("checkpoint: out of memory");
                if (!rc) rc = dev_copy(A, host, net->m[g], n, AVGPIPE_DEVICE_COPY_D2H, "checkpoint: reading Adam's moments");
                if (!rc) rc = dev_copy(A, (char *)host + n, net->v[g], n, AVGPIPE_DEVICE_COPY_D2H, "checkpoint: reading Adam's moments");
                if (!rc && (avgpipe_buf_append(NULL, out, &t, sizeof t) || avgpipe_buf_append(NULL, out, host, 2 * n)))
                    rc = fail("checkpoint: out of memory");
                free(host);
                if (rc) return rc;
            }
    return 0;
}

static int cb_load_state(int rank, const void *data, size_t bytes, void *user) {
    app *A = (app *)user;
    const unsigned char *p = (const unsigned char *)data;
    int i, g, d = rank / A->S;
    for (i = d * A->opt.pipes; i < (d + 1) * A->opt.pipes; i++)
        for (g = 0; g < A->G; g++)
            if (stage_rank(A, g) == rank % A->S) {
                dev_net *net = &A->nets[i];
                size_t n = A->model.count[g] * sizeof(float);
                int64_t t;
                if (bytes < sizeof t + 2 * n) return fail("checkpoint: rank %d's Adam state is too short (other --hidden?)", rank);
                memcpy(&t, p, sizeof t);
                if (dev_copy(A, net->m[g], p + sizeof t, n, AVGPIPE_DEVICE_COPY_H2D, "checkpoint: restoring Adam's moments") ||
                    dev_copy(A, net->v[g], p + sizeof t + n, n, AVGPIPE_DEVICE_COPY_H2D, "checkpoint: restoring Adam's moments"))
                    return -1;
                net->t[g] = (long)t;
                p += sizeof t + 2 * n, bytes -= sizeof t + 2 * n;
            }
    return bytes == 0 ? 0 : fail("checkpoint: rank %d's Adam state is too long (other --hidden or --pipes?)", rank);
}

/* ---- Setup -------------------------------------------------------------------------------------- */

static int is_local(const app *A, int d, int g) { return A->me < 0 || A->me == d * A->S + stage_rank(A, g); }

/* The CUDA devices this process sees; 0 (with the reason on stderr) when there is none. */
static int count_gpus(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n < 1) {
        fprintf(stderr, PROG ": no usable CUDA device (cudaGetDeviceCount: %s); nothing to run (exit status %d: skipped)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices", EXIT_NO_GPU);
        return 0;
    }
    return n;
}

/* The CUDA device table for A->gpu_ordinal, and this program's own stream on it. */
static int start_gpu(app *A, avgpipe_context *ctx) {
    avgpipe_device_cuda_desc cd;
    avgpipe_result r;
    memset(&cd, 0, sizeof cd);
    cd.device = A->gpu_ordinal;
    if ((r = avgpipe_device_cuda_create(ctx, &cd, &A->gpu)) != AVGPIPE_OK)
        return fail("cuda:%d: %s: %s", A->gpu_ordinal, avgpipe_result_string(r), avgpipe_last_error(ctx));
    A->have_gpu = 1;
    if ((r = A->gpu.stream_create(A->gpu.user, &A->aux)) != AVGPIPE_OK) return fail("cuda:%d: a stream: %s", A->gpu_ordinal, gpu_error(A, r));
    return 0;
}

/* As fashion_mnist.c, then the parts this process's stages read go to the GPU: stage 0 the pixels, the
   last stage the labels (rank 0 of an NCCL job both: it tunes alone and evaluates). */
static int load_data(app *A) {
    char err[512];
    int parts = 0, test = 0, d, G = A->opt.stages;
    for (d = 0; d < A->opt.replicas; d++) {
        if (is_local(A, d, 0)) parts |= MLP_PIXELS;
        if (is_local(A, d, G - 1)) parts |= MLP_LABELS;
    }
    if (A->me <= 0) parts = MLP_PIXELS | MLP_LABELS, test = MLP_PIXELS | MLP_LABELS;
    if (!parts) parts = MLP_LABELS;
    if (mlp_data_load_fashion_parts(A->opt.data, &A->train, parts, &A->test, test, err, sizeof err) != 0) return fail("%s", err);
    if (A->opt.normalize && A->train.x) {
        float mean, std;
        mlp_data_stats(&A->train, &mean, &std);
        mlp_data_normalize(&A->train, mean, std);
        mlp_data_normalize(&A->test, mean, std);
    }
    if (A->opt.limit_train) mlp_data_truncate(&A->train, A->opt.limit_train);
    if (A->train.x) {
        size_t bytes = (size_t)A->train.n * (size_t)A->train.dim * sizeof(float);
        if (dev_alloc(A, (void **)&A->d_pixels, bytes, "the training images") ||
            dev_copy(A, A->d_pixels, A->train.x, bytes, AVGPIPE_DEVICE_COPY_H2D, "copying the training images to the GPU"))
            return -1;
    }
    if (A->train.y) {
        if (dev_alloc(A, (void **)&A->d_labels, (size_t)A->train.n, "the training labels") ||
            dev_copy(A, A->d_labels, A->train.y, (size_t)A->train.n, AVGPIPE_DEVICE_COPY_H2D, "copying the training labels to the GPU"))
            return -1;
    }
    return 0;
}

static int setup_order(app *A, int quiet) {
    options *o = &A->opt;
    long per_round = (long)o->replicas * o->pipes * o->batch;
    char err[512];
    int d;
    if (A->train.n / per_round < 1)
        return fail("%d training samples cannot fill one round of %d x %d pipelines x %d samples", A->train.n, o->replicas,
                    o->pipes, o->batch);
    if (A->train.n / per_round < o->rounds) {
        o->rounds = (int)(A->train.n / per_round);
        if (!quiet && A->me <= 0)
            fprintf(stderr, PROG ": note: --rounds lowered to %d (one epoch holds %d rounds)\n", o->rounds, o->rounds);
    }
    if (mlp_order_init(&A->order, A->train.n, o->batch, o->replicas * o->pipes, o->rounds, o->seed, err, sizeof err) != 0)
        return fail("%s", err);
    A->decay_steps = o->cosine ? A->order.rounds_per_epoch * o->epochs : 0;
    for (d = 0; d < o->replicas; d++)
        if ((is_local(A, d, 0) && mlp_perm_init(&A->perm[d][0], A->train.n) != 0) ||
            (o->stages > 1 && is_local(A, d, o->stages - 1) && mlp_perm_init(&A->perm[d][o->stages - 1], A->train.n) != 0))
            return fail("out of memory");
    return 0;
}

/* D x N models, all from the same seed (mlp.h's initialiser on the host, copied to the GPU); gradients and
   Adam moments zeroed on the GPU; the loss accumulators; a cuBLAS handle per local (rank, pipeline). */
static int setup_model(app *A) {
    options *o = &A->opt;
    char err[512];
    int i, g, r, n = o->replicas * o->pipes, ranks = o->replicas * (o->stages / o->chunks);
    float *host = NULL;
    if (mlp_model_parse(&A->model, A->train.dim, o->hidden, o->stages, err, sizeof err) != 0) return fail("%s", err);
    A->G = o->stages;
    A->S = o->stages / o->chunks;
    A->mb = o->batch / o->micro;
    A->loss_scale = 1.0f / (float)o->batch;
    A->adam = mlp_adam_defaults();
    A->adam.lr = (float)o->lr;
    A->nets = (dev_net *)calloc((size_t)n, sizeof *A->nets);
    A->params = (float **)calloc((size_t)n * (size_t)A->G, sizeof *A->params);
    A->h_acc = (loss_acc *)calloc((size_t)n, sizeof *A->h_acc);
    A->nblas = ranks * o->pipes;
    A->blas = (cublasHandle_t *)calloc((size_t)A->nblas, sizeof *A->blas);
    A->blas_stream = (cudaStream_t *)calloc((size_t)A->nblas, sizeof *A->blas_stream);
    if (!A->nets || !A->params || !A->h_acc || !A->blas || !A->blas_stream) return fail("out of memory");
    for (g = 0; g < A->G; g++) {
        size_t count = A->model.count[g], bytes = count * sizeof(float);
        int d;
        for (d = 0; d < o->replicas; d++) {
            if (!is_local(A, d, g)) continue;
            if (!host && !(host = (float *)malloc(bytes))) return fail("out of memory");
            mlp_init_stage(&A->model, g, host, o->seed); /* every model of every group: the same weights */
            for (i = d * o->pipes; i < (d + 1) * o->pipes; i++) {
                dev_net *net = &A->nets[i];
                if (dev_alloc(A, (void **)&net->params[g], bytes, "parameters") || dev_alloc(A, (void **)&net->grad[g], bytes, "gradients") ||
                    dev_alloc(A, (void **)&net->m[g], bytes, "Adam's first moments") ||
                    dev_alloc(A, (void **)&net->v[g], bytes, "Adam's second moments") ||
                    dev_copy(A, net->params[g], host, bytes, AVGPIPE_DEVICE_COPY_H2D, "copying the initial weights to the GPU") ||
                    dev_copy(A, net->grad[g], NULL, bytes, AVGPIPE_DEVICE_COPY_D2D, "zeroing the gradients") ||
                    dev_copy(A, net->m[g], NULL, bytes, AVGPIPE_DEVICE_COPY_D2D, "zeroing Adam's moments") ||
                    dev_copy(A, net->v[g], NULL, bytes, AVGPIPE_DEVICE_COPY_D2D, "zeroing Adam's moments")) {
                    free(host);
                    return -1;
                }
                A->params[i * A->G + g] = net->params[g];
            }
        }
        free(host);
        host = NULL;
    }
    if (dev_alloc(A, (void **)&A->d_acc, (size_t)n * sizeof(loss_acc), "the loss accumulators") ||
        dev_copy(A, A->d_acc, NULL, (size_t)n * sizeof(loss_acc), AVGPIPE_DEVICE_COPY_D2D, "zeroing the loss accumulators"))
        return -1;
    for (r = 0; r < ranks; r++) {
        if (A->me >= 0 && r != A->me) continue;
        for (i = 0; i < o->pipes; i++) {
            cublasStatus_t s = cublasCreate(&A->blas[r * o->pipes + i]);
            if (s != CUBLAS_STATUS_SUCCESS) {
                A->blas[r * o->pipes + i] = NULL;
                return fail("cuBLAS: cublasCreate: %s", cublasGetStatusString(s));
            }
        }
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
    d.cb.step_async = cb_step_async; /* enqueued on the pipeline's stream: no host wait per STEP */
    d.cb.save_state = cb_save_state;
    d.cb.load_state = cb_load_state;
    d.cb.user = A;
    d.act_bytes = A->act_bytes;
    d.params = (float *const *)A->params; /* device memory */
    d.param_count = A->model.count;
    d.averaging.alpha = o->alpha == 0.0 ? AVGPIPE_ZERO : (float)o->alpha;
    d.deterministic = o->deterministic;
    d.profile = o->trace || o->profile;
    d.replicas = o->replicas;
    d.device = &A->gpu; /* boundary buffers, streams, events and the averaging kernels on the GPU */
    if (A->me >= 0) {   /* one rank per process over NCCL */
        d.comm = &A->comm;
        d.local_ranks = &A->me;
        d.local_count = 1;
        d.timeout_s = 120;
    }
    return d;
}

/* One device stash per slot the runtime reserved on stage g, for each local replica group; grows between
   iterations (the adaptive controller may raise K). */
static int grow_stashes(app *A, const avgpipe_run *run, int g) {
    const mlp_model *m = &A->model;
    int want = avgpipe_run_slots(run, g), s, d, k;
    if (want < 1) return fail("the runtime reports %d slots on stage %d", want, g);
    if (want <= A->slots[g]) return 0;
    for (d = 0; d < A->opt.replicas; d++) {
        dev_stash *grown;
        if (!is_local(A, d, g)) continue;
        grown = (dev_stash *)realloc(A->stash[d][g], sizeof(dev_stash) * (size_t)want);
        if (!grown) return fail("out of memory");
        A->stash[d][g] = grown;
        memset(grown + A->slots[g], 0, sizeof(dev_stash) * (size_t)(want - A->slots[g]));
        for (s = A->slots[g]; s < want; s++) {
            dev_stash *st = &grown[s];
            if (dev_alloc(A, (void **)&st->idx, sizeof(uint32_t) * (size_t)A->mb, "sample indices")) return -1;
            if (g == 0 && dev_alloc(A, (void **)&st->x, sizeof(float) * (size_t)A->mb * (size_t)m->width[0], "stage 0's input"))
                return -1;
            if (g == A->G - 1 && dev_alloc(A, (void **)&st->labels, (size_t)A->mb, "labels")) return -1;
            for (k = 0; k < m->first[g + 1] - m->first[g]; k++) {
                size_t bytes = sizeof(float) * (size_t)A->mb * (size_t)m->width[m->first[g] + k + 1];
                if (dev_alloc(A, (void **)&st->act[k], bytes, "activations") || dev_alloc(A, (void **)&st->dz[k], bytes, "gradients"))
                    return -1;
            }
        }
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

static void free_stash(app *A, dev_stash *st) {
    int k;
    dev_free(A, st->idx);
    dev_free(A, st->x);
    dev_free(A, st->labels);
    for (k = 0; k < MLP_MAX_LAYERS; k++) {
        dev_free(A, st->act[k]);
        dev_free(A, st->dz[k]);
    }
    memset(st, 0, sizeof *st);
}

/* Undo setup_order, setup_model and setup_stashes (the data stays). */
static void free_model(app *A) {
    int i, g, d;
    for (d = 0; d < MAX_REPLICAS; d++)
        for (g = 0; g < MLP_MAX_LAYERS; g++) {
            for (i = 0; A->stash[d][g] && i < A->slots[g]; i++) free_stash(A, &A->stash[d][g][i]);
            free(A->stash[d][g]);
            A->stash[d][g] = NULL;
            mlp_perm_free(&A->perm[d][g]);
        }
    for (g = 0; g < MLP_MAX_LAYERS; g++) A->slots[g] = 0;
    for (i = 0; A->nets && i < A->opt.pipes * A->opt.replicas; i++)
        for (g = 0; g < MLP_MAX_LAYERS; g++) {
            dev_free(A, A->nets[i].params[g]);
            dev_free(A, A->nets[i].grad[g]);
            dev_free(A, A->nets[i].m[g]);
            dev_free(A, A->nets[i].v[g]);
        }
    for (i = 0; A->blas && i < A->nblas; i++)
        if (A->blas[i]) cublasDestroy(A->blas[i]);
    dev_free(A, A->d_acc);
    free(A->nets);
    free(A->params);
    free(A->h_acc);
    free(A->blas);
    free(A->blas_stream);
    A->nets = NULL, A->params = NULL, A->h_acc = NULL, A->d_acc = NULL, A->blas = NULL, A->blas_stream = NULL, A->nblas = 0;
}

static void free_app(app *A) {
    free_model(A);
    dev_free(A, A->d_pixels);
    dev_free(A, A->d_labels);
    A->d_pixels = NULL, A->d_labels = NULL;
    mlp_data_free(&A->train);
    mlp_data_free(&A->test);
}

/* ---- Training ----------------------------------------------------------------------------------- */

/* The reference model on the host, one buffer per stage, on the process that evaluates it (threads: copied
   from the GPU; nccl: gathered to rank 0, collective). */
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
        const float *dev = avgpipe_run_reference(run, g, &count);
        if (!dev || count != A->model.count[g])
            return fail("the runtime's reference of stage %d has %zu floats, expected %zu", g, count, A->model.count[g]);
        if (dev_copy(A, A->ref[g], dev, count * sizeof(float), AVGPIPE_DEVICE_COPY_D2H, "copying the reference model from the GPU"))
            return -1;
        ref[g] = A->ref[g];
    }
    return 0;
}

static double evaluate_reference(app *A, avgpipe_run *run, avgpipe_context *ctx) {
    const float *ref[MLP_MAX_LAYERS];
    if (get_reference(A, run, ctx, ref) != 0) return -1;
    return A->me <= 0 ? mlp_evaluate(&A->model, ref, &A->test, NULL) : 0;
}

/* One iteration's loss, micro-batches and hits, read from the GPU's accumulators (then zeroed for the
   next iteration), and the bubble, summed over the processes (nccl: collective). */
static int iteration_stats(app *A, avgpipe_run *run, avgpipe_context *ctx, const avgpipe_run_stats *rs, epoch_stats *s) {
    double v[5];
    int i, n = A->opt.replicas * A->opt.pipes;
    size_t bytes = (size_t)n * sizeof(loss_acc);
    if (dev_copy(A, A->h_acc, A->d_acc, bytes, AVGPIPE_DEVICE_COPY_D2H, "reading the losses from the GPU") ||
        dev_copy(A, A->d_acc, NULL, bytes, AVGPIPE_DEVICE_COPY_D2D, "zeroing the loss accumulators"))
        return -1;
    v[0] = 0, v[1] = 0, v[2] = 0, v[3] = rs->bubble * rs->seconds, v[4] = 0;
    for (i = 0; i < n; i++) {
        v[0] += A->h_acc[i].loss;
        v[1] += (double)A->h_acc[i].micro;
        v[2] += (double)A->h_acc[i].correct;
        v[4] += (double)A->h_acc[i].nonfinite;
    }
    if (A->me >= 0 && avgpipe_run_allreduce(run, v, 5) != AVGPIPE_OK) return fail("reducing the statistics: %s", avgpipe_last_error(ctx));
    if (v[4] > 0) return fail("non-finite loss in %.0f micro-batch%s of the last iteration: lower --lr?", v[4], v[4] > 1 ? "es" : "");
    s->seconds += rs->seconds;
    s->loss += v[0];
    s->micro_batches += (long long)v[1];
    s->correct += (long long)v[2];
    s->bubble_time += A->me >= 0 ? v[3] / A->nproc : v[3];
    s->samples += (long long)A->opt.rounds * A->opt.replicas * A->opt.pipes * A->opt.batch;
    s->advance = rs->advance;
    return 0;
}

static int run_epoch(app *A, avgpipe_run *run, avgpipe_context *ctx, int epoch, int64_t first, epoch_stats *s) {
    int64_t iters = A->order.rounds_per_epoch / A->opt.rounds, it;
    memset(s, 0, sizeof *s);
    for (it = first; it < iters; it++) {
        avgpipe_run_stats rs;
        avgpipe_result r = avgpipe_run_iteration(run, &rs);
        if (r != AVGPIPE_OK) return iteration_failed(A->me, it, epoch, r, ctx);
        if (iteration_stats(A, run, ctx, &rs, s) != 0) return -1;
        progress(&A->opt, A->me, epoch, (double)(it + 1) / (double)iters, s, it + 1 == iters);
        if (setup_stashes(A, run) != 0) return -1;
        if (A->opt.checkpoint_every && avgpipe_run_iterations(run) % A->opt.checkpoint_every == 0 && checkpoint(&A->opt, run, ctx) != 0) return -1;
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
    if (checkpoint(&A->opt, run, ctx) != 0) return -1;
    return write_outputs(A, run, ctx);
}

static void print_header(const app *A) {
    const options *o = &A->opt;
    char desc[256];
    cudaDeviceProp prop;
    int major = 0, minor = 0, patch = 0;
    avgpipe_device_cuda_info info;
    mlp_model_describe(&A->model, desc, sizeof desc);
    memset(&prop, 0, sizeof prop);
    memset(&info, 0, sizeof info);
    cudaGetDeviceProperties(&prop, A->gpu_ordinal);
    cublasGetProperty(MAJOR_VERSION, &major);
    cublasGetProperty(MINOR_VERSION, &minor);
    cublasGetProperty(PATCH_LEVEL, &patch);
    avgpipe_device_cuda_query(NULL, &A->gpu, &info);
    printf("GPU: %s (cuda:%d, compute capability %d.%d, %d SMs), cuBLAS %d.%d.%d, averaging kernels %s\n", prop.name,
           A->gpu_ordinal, prop.major, prop.minor, prop.multiProcessorCount, major, minor, patch, info.kernels);
    printf("model %s\n", desc);
    printf("%s, %d ranks x %d chunk%s, %d pipelines, batch %d = %d x %d, %d rounds/iteration (%s), alpha %g, "
           "Adam lr %g%s, %d training samples (%lld rounds/epoch)\n",
           avgpipe_sched_kind_name(o->schedule), o->stages / o->chunks, o->chunks, o->chunks > 1 ? "s" : "",
           o->pipes, o->batch, o->micro, A->mb, o->rounds, o->continuous ? "continuous" : "synchronous", o->alpha,
           o->lr, o->cosine ? " (cosine decay)" : "", A->train.n, (long long)A->order.rounds_per_epoch);
    if (o->replicas > 1)
        printf("%d replica groups, their reference models averaged every round; %s\n", o->replicas,
               A->me >= 0 ? "one rank per process (one GPU each) over NCCL" : "every rank a thread of this process, all on this GPU");
    else if (A->me >= 0)
        printf("one rank per process (one GPU each) over NCCL\n");
    else
        printf("every rank a thread of this process, all on this GPU, one compute stream per pipeline\n");
    fflush(stdout);
}

/* ---- Tuning (--micro auto, --pipes auto): as fashion_mnist.c, profiled on the GPU ----------------- */

/* One profile run on this process's GPU, every stage a thread (also rank 0 of an NCCL job): 1 pipeline of
   `micro` micro-batches, advance forward with K = S-1, throwaway weights. */
static int profile_run(app *A, avgpipe_context *ctx, int micro, int pipes, const char *path, int append, double *seconds) {
    options saved = A->opt;
    avgpipe_run *run = NULL;
    avgpipe_run_desc d;
    avgpipe_result r;
    int i, rc = -1, me = A->me;
    A->me = -1;
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
    for (i = 0; i < TUNE_WARMUP + TUNE_PROFILED; i++) {
        avgpipe_run_stats st;
        r = avgpipe_run_iteration(run, &st);
        if (r != AVGPIPE_OK) {
            fail("tuner: profile run (M = %d), iteration %d: %s: %s", micro, i + 1, avgpipe_result_string(r), avgpipe_last_error(ctx));
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
    free_model(A);
    A->opt = saved;
    A->me = me;
    return rc;
}

static void print_cost_model(const avgpipe_cost_model *m) {
    int g, K = AVGPIPE_OP_KIND_COUNT;
    fprintf(stderr, PROG ": tuner: cost model, us = a + b x samples per micro-batch (fitted at %g..%g samples):\n", m->samples_lo,
            m->samples_hi);
    for (g = 0; g < m->nstages; g++) {
        const double *a = &m->a[g * K], *b = &m->b[g * K];
        fprintf(stderr, "  stage %d  F %6.1f + %5.2f s   B %6.1f + %5.2f s   STEP %6.1f\n", g, 1e6 * a[AVGPIPE_OP_F],
                1e6 * b[AVGPIPE_OP_F], 1e6 * a[AVGPIPE_OP_B], 1e6 * b[AVGPIPE_OP_B], 1e6 * a[AVGPIPE_OP_STEP]);
    }
    fprintf(stderr, "  transfer latency %.1f us, runtime overhead %.1f us per iteration\n", 1e6 * m->latency, 1e6 * m->iter_overhead);
    fprintf(stderr, "  pipelines overlap on the GPU: %.0f%% of a compute op (2 pipelines: %.2fx the ops per second of 1)\n", 100 * m->overlap,
            2 / (2 - m->overlap));
}

/* Profile, fit, search; then set A->opt's schedule, micro, pipes, advance and round mode to the choice.
   The device: with every stage on one GPU the ranks share it, so the simulator is told they share one
   "core" (an iteration takes at least all ranks' GPU time); with NCCL each rank has its own GPU (0: a
   device per rank), though the profile ran every stage on rank 0's GPU. */
static int tune(app *A, avgpipe_context *ctx) {
    options *o = &A->opt;
    char tmp[512];
    const char *path;
    int sizes[2], nsizes, i, min_micro = tune_min_micro(o), rc = -1;
    double t0 = now_s(), t1, meas[3][TUNE_PROFILED];
    avgpipe_profile prof;
    avgpipe_cost_model cm;
    avgpipe_tune_desc td;
    avgpipe_noise_scale noise;
    avgpipe_result r;
    memset(&prof, 0, sizeof prof);
    memset(&cm, 0, sizeof cm);
    if (A->train.n < o->batch) return fail("tuner: %d training samples cannot fill one batch of %d samples", A->train.n, o->batch);
    if (tune_profile_path(o, tmp, sizeof tmp, &path) != 0) return -1;
    nsizes = profile_sizes(o, min_micro, sizes);
    for (i = 0; i < nsizes; i++)
        if (profile_run(A, ctx, sizes[i], 1, path, i > 0, meas[i]) != 0) goto done;
    /* and 2 pipelines at the first size: how much their kernels overlap on the GPU (the cost model's
       overlap, fitted against the 1-pipeline op times) */
    if (profile_run(A, ctx, sizes[0], 2, path, 1, meas[2]) != 0) goto done;
    t1 = now_s();
    r = avgpipe_profile_load(ctx, path, &prof);
    if (r == AVGPIPE_OK && prof.nsections != (nsizes + 1) * TUNE_PROFILED) {
        fail("tuner: the profile %s holds %d sections, %d were written", path, prof.nsections, (nsizes + 1) * TUNE_PROFILED);
        goto done;
    }
    if (r == AVGPIPE_OK) r = avgpipe_tune_fit(ctx, &prof, &cm);
    if (r != AVGPIPE_OK) {
        fail("tuner: cannot fit a cost model to the profile %s: %s: %s", path, avgpipe_result_string(r), avgpipe_last_error(ctx));
        goto done;
    }
    cm.cores = o->procs ? 0 : 1; /* see above */
    fprintf(stderr, PROG ": tuner: profiled 1 pipeline on cuda:%d (advance, K = %d, %d rounds/iteration) at M = %d", A->gpu_ordinal,
            o->stages - 1, prof.sections[0].shape.rounds, sizes[0]);
    if (nsizes > 1) fprintf(stderr, " and M = %d", sizes[1]);
    fprintf(stderr, ", and 2 pipelines at M = %d", sizes[0]);
    fprintf(stderr, ", %d iterations each after %d warm-up, in %.2f s (throwaway weights)%s%s\n", TUNE_PROFILED, TUNE_WARMUP, t1 - t0,
            o->profile_tune ? "; profile: " : "", o->profile_tune ? o->profile_tune : "");
    print_cost_model(&cm);
    for (i = 0; i < nsizes; i++) print_check(ctx, &cm, &prof, i * TUNE_PROFILED, meas[i]);
    print_check(ctx, &cm, &prof, nsizes * TUNE_PROFILED, meas[2]);

    if (tune_noise(ctx, o, &A->model, &A->train, 1, &noise) != 0) goto done;
    tune_desc_init(&td, o, A->train.n, min_micro, &noise);
    if (tune_choose(ctx, o, &cm, &td, A->train.n, 1, t0) != 0) goto done;
    rc = 0;
done:
    if (path == tmp) remove(tmp);
    avgpipe_tune_cost_model_free(ctx, &cm);
    avgpipe_profile_free(ctx, &prof);
    return rc;
}

/* ---- One process per GPU over NCCL (--backend nccl) --------------------------------------------- */
#ifdef CUDA_MLP_NCCL

/* The first of the launcher's variables that is set, as an integer; -1 if none. */
static int env_int(const char *const *names) {
    for (; *names; names++) {
        const char *s = getenv(*names);
        char *end;
        long v;
        if (!s || !*s) continue;
        errno = 0;
        v = strtol(s, &end, 10);
        if (!*end && !errno && v >= 0 && v < 1 << 20) return (int)v;
    }
    return -1;
}

/* A name for this job, the same in all its processes, so that an id file of another job is ignored: the
   launcher's job id (PMIx namespace, Slurm, torchrun), hashed when long; "" without a launcher's id. */
static void job_token(char *buf, size_t cap) {
    static const char *const names[] = {"PMIX_NAMESPACE", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid", NULL};
    const char *const *n;
    buf[0] = '\0';
    for (n = names; *n; n++) {
        const char *s = getenv(*n);
        if (s && *s) {
            if (strlen(s) < cap && strlen(s) <= AVGPIPE_NCCL_TOKEN_MAX) {
                snprintf(buf, cap, "%s", s);
            } else {
                uint64_t h = 1469598103934665603ull;
                for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
                snprintf(buf, cap, "%016llx", (unsigned long long)h);
            }
            return;
        }
    }
}

/* Join the job: rank and size from the launcher, NCCL's id through a file rank 0 writes, the GPU of the
   node-local rank. Collective (within the backend's timeout). */
static int start_nccl(app *A, avgpipe_context *ctx) {
    static const char *const rank_vars[] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK", NULL};
    static const char *const size_vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE", NULL};
    int rank = env_int(rank_vars), size = env_int(size_vars), S = A->opt.stages / A->opt.chunks;
    char token[AVGPIPE_NCCL_TOKEN_MAX + 1], path[4096];
    const char *dir = getenv("TMPDIR");
    avgpipe_nccl_desc nd;
    avgpipe_result r;
    if (rank < 0 || size < 1 || rank >= size)
        return fail("--backend nccl: cannot tell this process's rank: start it with mpirun -np %d, srun, or set RANK and WORLD_SIZE",
                    A->opt.replicas * S);
    g_rank = rank;
    if (size != A->opt.replicas * S)
        return fail("--backend nccl: %d processes, but %d replica group%s x %d ranks (--stages %d / --chunks %d) need %d: mpirun -np %d",
                    size, A->opt.replicas, A->opt.replicas > 1 ? "s" : "", S, A->opt.stages, A->opt.chunks, A->opt.replicas * S,
                    A->opt.replicas * S);
    job_token(token, sizeof token);
    if (A->opt.nccl_id) snprintf(path, sizeof path, "%s", A->opt.nccl_id);
    else snprintf(path, sizeof path, "%s/" PROG "-nccl-%s.id", dir && *dir ? dir : "/tmp", *token ? token : "job");
    memset(&nd, 0, sizeof nd);
    nd.id_file = path;
    nd.file_token = token;
    nd.rank = rank;
    nd.size = size;
    nd.device = AVGPIPE_NCCL_DEVICE_LOCAL;
    nd.timeout_s = 120;
    if ((r = avgpipe_nccl_create(ctx, &nd, &A->comm)) != AVGPIPE_OK)
        return fail("--backend nccl: %s: %s", avgpipe_result_string(r), avgpipe_last_error(ctx));
    A->have_comm = 1;
    A->me = rank;
    A->nproc = size;
    A->gpu_ordinal = avgpipe_nccl_device(&A->comm);
    check_outputs(&A->opt, A->me);
    return 0;
}

/* Rank 0 tuned alone: it sends its choice (or its failure) to every rank over the comm table (host memory,
   staged by the backend). Bounded: the others wait 10 minutes for it. */
static int share_choice(app *A, int rc) {
    options *o = &A->opt;
    const avgpipe_comm *c = &A->comm;
    int v[8], p;
    avgpipe_comm_request req;
    avgpipe_result r = AVGPIPE_OK;
    const uint32_t tag = 0x7ffff000u;
    v[0] = rc, v[1] = (int)o->schedule, v[2] = o->micro, v[3] = o->pipes, v[4] = o->continuous, v[5] = o->advance, v[6] = o->chunks,
    v[7] = o->rounds;
    if (A->me == 0) {
        for (p = 1; p < A->nproc && r == AVGPIPE_OK; p++) {
            r = c->isend(c->user, 0, p, v, sizeof v, tag, &req);
            if (r == AVGPIPE_OK) r = c->wait(c->user, 0, req, 600, NULL);
        }
        if (r != AVGPIPE_OK) return fail("--backend nccl: sending the tuner's choice to rank %d: %s", p - 1, avgpipe_result_string(r));
        return rc;
    }
    r = c->irecv(c->user, A->me, 0, v, sizeof v, tag, &req);
    if (r == AVGPIPE_OK) r = c->wait(c->user, A->me, req, 600, NULL);
    if (r != AVGPIPE_OK) return fail("--backend nccl: no tuner's choice from rank 0 within 10 minutes: %s", avgpipe_result_string(r));
    if (v[0] != 0) return fail("rank 0 failed to tune (see its message)");
    o->schedule = (avgpipe_sched_kind)v[1], o->micro = v[2], o->pipes = v[3], o->continuous = v[4], o->advance = v[5], o->chunks = v[6];
    o->rounds = v[7];
    return 0;
}
#endif

/* ---- Main --------------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    static app A;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_run_desc desc;
    avgpipe_result r;
    int rc = 1, g, ngpu;
    /* Before any CUDA call (CUDA reads it when it creates the GPU's context): the S x (N + 1) streams of the
       stages on one GPU (4 stages x 4 pipelines: 20) need more hardware queues than CUDA's default 8, or the
       pipelines are falsely serialised (avgpipe_cuda.h, HARDWARE QUEUES); 32 is the most. A value given in
       the environment stays. */
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    parse_options(&program, argc, argv, &A.opt);
    if (!(ngpu = count_gpus())) return EXIT_NO_GPU;
    avgpipe_context_init(&ctx, NULL);
    A.me = -1;
    A.S = A.opt.stages / A.opt.chunks;
    A.gpu_ordinal = A.opt.device;
#ifdef CUDA_MLP_NCCL
    if (A.opt.procs && start_nccl(&A, &ctx) != 0) goto done;
#endif
    if (!A.opt.procs && A.gpu_ordinal >= ngpu) {
        fail("--device %d: this process sees %d CUDA device%s (0..%d)", A.gpu_ordinal, ngpu, ngpu > 1 ? "s" : "", ngpu - 1);
        goto done;
    }
    if (start_gpu(&A, &ctx) != 0 || load_data(&A) != 0) goto done;
    if (tuning(&A.opt)) {
        int trc = A.me <= 0 ? tune(&A, &ctx) : 0;
#ifdef CUDA_MLP_NCCL
        if (A.me >= 0) trc = share_choice(&A, trc);
#endif
        if (trc != 0) goto done;
    }
    if (setup_order(&A, 0) != 0 || setup_model(&A) != 0) goto done;
    for (g = 0; (A.me <= 0) && g < A.G; g++) /* the host copy of the reference model (evaluation, --save) */
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
    if (A.have_comm) {
        if (rc != 0) { /* a peer may be gone: leave without waiting for it (the backend's destroy could) */
            fflush(stdout);
            fflush(stderr);
            _exit(rc);
        }
        avgpipe_comm_destroy(&A.comm);
    }
    if (A.have_gpu) {
        if (A.aux) A.gpu.stream_destroy(A.gpu.user, A.aux);
        avgpipe_device_destroy(&A.gpu);
    }
    return rc;
}
