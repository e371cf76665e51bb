/* Tests of examples/gpt_model.h's split backward, gpt_backward_input then gpt_backward_weight, which the
   zero-bubble schedules (ZB-H1, ZB-V) of examples/gpt.c run as their I and W ops:
     - for 1, 2 and 3 partitions (a single partition storing wte once, the tie's two copies, a middle one),
       two micro-batches (one with padded rows) run as the schedules order them (I of both, then W of both)
       give the input gradients and the accumulated parameter gradients of gpt_backward bit for bit;
     - the halves refuse what gpt_backward refuses (a stash of another partition, missing buffers);
     - the split stash is larger, and the input half leaves the gradients untouched.
   Build: gcc -std=c11 -O2 -Wall -Wextra -I. tests/test_gpt_split.c -o /tmp/test_gpt_split -lcriterion -lopenblas -lm */
#define _POSIX_C_SOURCE 200809L
#include "examples/gpt_model.h"

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

void openblas_set_num_threads(int num_threads);

static void one_thread(void) { openblas_set_num_threads(1); }

#define U 2 /* micro-batches */

/* Micro-batch u: rows x T of bytes from a fixed generator; with pad, the last row's second half is padding. */
static void fill_micro(gpt_micro *mb, int rows, int T, int u, int pad) {
    uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(u + 1);
    int r, t;
    mb->rows = rows, mb->T = T, mb->ntok = 0;
    for (r = 0; r < rows; r++)
        for (t = 0; t < T; t++) {
            size_t i = (size_t)r * T + t;
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            mb->tokens[i] = (uint8_t)(x >> 56), mb->targets[i] = (uint8_t)(x >> 48);
            mb->mask[i] = pad && r == rows - 1 && t >= T / 2 ? 0.0f : 1.0f;
            mb->ntok += mb->mask[i];
        }
}

/* One partitioning's buffers: params, two sets of gradients (B and I + W), stashes per micro-batch, the
   activations and their gradients between partitions. */
typedef struct setup {
    int S;
    gpt_part part[3];
    float *param[3], *gb[3], *giw[3], *stash[3][U], *work[3];
    float *act[3][U], *dact_b[3][U], *dact_iw[3][U];
    gpt_micro mb[U];
} setup;

static void make(setup *z, int S) {
    gpt_config c = {16, 2, 2, 12, 3};
    char err[256];
    int s, u;
    memset(z, 0, sizeof *z);
    z->S = S;
    cr_assert_eq(gpt_partition(&c, S, NULL, z->part, err, sizeof err), 0, "%s", err);
    for (u = 0; u < U; u++) {
        cr_assert_eq(gpt_micro_alloc(&z->mb[u], c.B, c.Tmax), 0);
        fill_micro(&z->mb[u], u ? 2 : 3, u ? 12 : 9, u, u == 0);
    }
    for (s = 0; s < S; s++) {
        const gpt_part *p = &z->part[s];
        cr_assert_gt(gpt_part_stash_floats_iw(p), gpt_part_stash_floats(p));
        z->param[s] = calloc(p->nparams, sizeof(float));
        z->gb[s] = calloc(p->nparams, sizeof(float));
        z->giw[s] = calloc(p->nparams, sizeof(float));
        z->work[s] = calloc(gpt_part_work_floats(p), sizeof(float));
        gpt_init(p, z->param[s], 7);
        for (u = 0; u < U; u++) {
            z->stash[s][u] = calloc(gpt_part_stash_floats_iw(p), sizeof(float));
            z->act[s][u] = calloc(gpt_act_floats(&c), sizeof(float));
            z->dact_b[s][u] = calloc(gpt_act_floats(&c), sizeof(float));
            z->dact_iw[s][u] = calloc(gpt_act_floats(&c), sizeof(float));
        }
    }
}

static void release(setup *z) {
    int s, u;
    for (s = 0; s < z->S; s++) {
        free(z->param[s]), free(z->gb[s]), free(z->giw[s]), free(z->work[s]);
        for (u = 0; u < U; u++) free(z->stash[s][u]), free(z->act[s][u]), free(z->dact_b[s][u]), free(z->dact_iw[s][u]);
    }
    for (u = 0; u < U; u++) gpt_micro_free(&z->mb[u]);
}

/* Forward of micro-batch u through every partition into its stashes. */
static void forward(setup *z, int u) {
    double loss;
    int s;
    for (s = 0; s < z->S; s++)
        cr_assert_eq(gpt_forward(&z->part[s], z->param[s], &z->mb[u], s ? z->act[s - 1][u] : NULL, s + 1 < z->S ? z->act[s][u] : NULL,
                                 z->stash[s][u], &loss), 0);
}

static double batch_weight(const setup *z) {
    double w = 0;
    int u;
    for (u = 0; u < U; u++) w += z->mb[u].ntok;
    return w;
}

static void check_split(int S) {
    setup z;
    double w;
    int s, u;
    make(&z, S);
    w = batch_weight(&z);
    /* B: each micro-batch forward then backward, gradients accumulated in micro-batch order */
    for (u = 0; u < U; u++) {
        forward(&z, u);
        for (s = S - 1; s >= 0; s--)
            cr_assert_eq(gpt_backward(&z.part[s], z.param[s], z.gb[s], z.stash[s][u], s + 1 < S ? z.dact_b[s][u] : NULL,
                                      s ? z.dact_b[s - 1][u] : NULL, z.work[s], w), 0);
    }
    /* I and W as ZB-H1 orders them: both forwards, both input halves, then both weight halves */
    for (u = 0; u < U; u++) forward(&z, u);
    for (u = 0; u < U; u++)
        for (s = S - 1; s >= 0; s--)
            cr_assert_eq(gpt_backward_input(&z.part[s], z.param[s], z.stash[s][u], s + 1 < S ? z.dact_iw[s][u] : NULL,
                                            s ? z.dact_iw[s - 1][u] : NULL, z.work[s], w), 0);
    for (s = 0; s < S; s++)
        for (size_t i = 0; i < z.part[s].nparams; i++) cr_assert_eq(z.giw[s][i], 0.0f, "the input half touched a gradient");
    for (u = 0; u < U; u++)
        for (s = 0; s < S; s++) cr_assert_eq(gpt_backward_weight(&z.part[s], z.giw[s], z.stash[s][u]), 0);
    for (s = 0; s < S; s++) {
        cr_assert_eq(memcmp(z.gb[s], z.giw[s], z.part[s].nparams * sizeof(float)), 0, "%d partitions: partition %d's gradients differ", S, s);
        for (u = 0; u < U && s > 0; u++)
            cr_assert_eq(memcmp(z.dact_b[s - 1][u], z.dact_iw[s - 1][u], (size_t)z.mb[u].rows * z.mb[u].T * 16 * sizeof(float)), 0,
                         "%d partitions: the input gradient of partition %d, micro-batch %d differs", S, s, u);
    }
    release(&z);
}

Test(gpt_split, one_partition_equals_backward, .init = one_thread) { check_split(1); }
Test(gpt_split, two_partitions_equal_backward, .init = one_thread) { check_split(2); }
Test(gpt_split, three_partitions_equal_backward, .init = one_thread) { check_split(3); }

Test(gpt_split, halves_refuse_what_backward_refuses, .init = one_thread) {
    setup z;
    make(&z, 2);
    forward(&z, 0);
    /* partition 1's stash given to partition 0 */
    cr_assert_eq(gpt_backward_input(&z.part[0], z.param[0], z.stash[1][0], z.dact_iw[0][0], NULL, z.work[0], 10), -1);
    cr_assert_eq(gpt_backward_weight(&z.part[0], z.giw[0], z.stash[1][0]), -1);
    /* partition 1 needs a place for its input gradient; batch weight must be positive; W needs gradients */
    cr_assert_eq(gpt_backward_input(&z.part[1], z.param[1], z.stash[1][0], NULL, NULL, z.work[1], 10), -1);
    cr_assert_eq(gpt_backward_input(&z.part[1], z.param[1], z.stash[1][0], NULL, z.dact_iw[0][0], z.work[1], 0), -1);
    cr_assert_eq(gpt_backward_weight(&z.part[1], NULL, z.stash[1][0]), -1);
    release(&z);
}
