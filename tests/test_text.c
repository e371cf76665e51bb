/* Tests of the text form (PyTorch's torch.distributed.pipelining CSV grammar plus avgpipe's
   extension): the golden PyTorch file exports back byte-identical, export -> import is the identity
   for every generator and for lowered schedules, and malformed text is refused with the line number.

   Build and run from the repository root:
     gcc -std=c11 -O2 -Wall -Wextra -pedantic -Werror -I. tests/test_text.c -o /tmp/test_text \
         -lcriterion -lm && /tmp/test_text
   AVGPIPE_GOLDEN_DIR overrides the golden directory (default tests/data). */
#define _POSIX_C_SOURCE 200809L /* mkstemp */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include "tests/sched_helpers.h"
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "tests/guard.h"

/* ---- helpers --------------------------------------------------------------------------------- */

static void import_text(const char *text, avgpipe_schedule *s) {
    avgpipe_result r = avgpipe_sched_import(NULL, text, strlen(text), s);
    cr_assert_eq(r, AVGPIPE_OK, "import: %s (%s)\n%s", avgpipe_result_string(r), avgpipe_last_error(NULL), text);
}

/* Whole file as bytes (NUL-terminated); *len gets its length. */
static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    char *p;
    long n;
    cr_assert_not_null(f, "cannot open %s", path);
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    n = ftell(f);
    cr_assert_geq(n, 0);
    rewind(f);
    p = (char *)malloc((size_t)n + 1);
    cr_assert_not_null(p);
    cr_assert_eq(fread(p, 1, (size_t)n, f), (size_t)n);
    p[n] = 0;
    fclose(f);
    *len = (size_t)n;
    return p;
}

static void golden_path(char *out, size_t cap) {
    const char *dir = getenv("AVGPIPE_GOLDEN_DIR");
    snprintf(out, cap, "%s/torch_zb1p_2rank_2stagep_compute.csv", dir && *dir ? dir : "tests/data");
}

static int carries_comm(const avgpipe_schedule *s) {
    int r, i;
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++)
            if (s->ops[r][i].kind >= AVGPIPE_OP_SEND_F && s->ops[r][i].kind <= AVGPIPE_OP_RECV_B) return 1;
    return 0;
}

/* Shapes, counts and every op field equal. */
static void assert_same_schedule(const avgpipe_schedule *a, const avgpipe_schedule *b, const char *what) {
    int r, i;
    cr_assert_eq(a->nranks, b->nranks, "%s: nranks %d vs %d", what, a->nranks, b->nranks);
    cr_assert_eq(a->nstages, b->nstages, "%s: nstages %d vs %d", what, a->nstages, b->nstages);
    /* has_comm: 1 when the lists carry SEND/RECV ops (import infers it from them) */
    cr_assert_eq(carries_comm(a), carries_comm(b), "%s: SEND/RECV ops in one schedule only", what);
    cr_assert_eq(b->has_comm, carries_comm(b), "%s: has_comm %d but SEND/RECV ops: %d", what, b->has_comm, carries_comm(b));
    cr_assert_eq(a->shape.kind, b->shape.kind, "%s: kind %d vs %d", what, a->shape.kind, b->shape.kind);
    cr_assert_eq(a->shape.stages, b->shape.stages, "%s: stages %d vs %d", what, a->shape.stages, b->shape.stages);
    cr_assert_eq(a->shape.chunks, b->shape.chunks, "%s: chunks %d vs %d", what, a->shape.chunks, b->shape.chunks);
    cr_assert_eq(a->shape.micro, b->shape.micro, "%s: micro %d vs %d", what, a->shape.micro, b->shape.micro);
    cr_assert_eq(a->shape.pipes, b->shape.pipes, "%s: pipes %d vs %d", what, a->shape.pipes, b->shape.pipes);
    cr_assert_eq(a->shape.rounds, b->shape.rounds, "%s: rounds %d vs %d", what, a->shape.rounds, b->shape.rounds);
    cr_assert_eq(a->shape.advance, b->shape.advance, "%s: advance %d vs %d", what, a->shape.advance, b->shape.advance);
    cr_assert_eq(a->shape.continuous, b->shape.continuous, "%s: continuous %d vs %d", what, a->shape.continuous,
                 b->shape.continuous);
    for (r = 0; r < a->nranks; r++) {
        cr_assert_eq(a->len[r], b->len[r], "%s: rank %d has %d vs %d ops", what, r, a->len[r], b->len[r]);
        for (i = 0; i < a->len[r]; i++) {
            const avgpipe_op *x = &a->ops[r][i], *y = &b->ops[r][i];
            char tx[64], ty[64];
            avgpipe_op_format(x, 1, tx, sizeof tx);
            avgpipe_op_format(y, 1, ty, sizeof ty);
            cr_assert(x->kind == y->kind && x->stage == y->stage && x->micro == y->micro && x->pipe == y->pipe && x->flags == y->flags,
                      "%s: rank %d position %d: %s (flags %u) vs %s (flags %u)", what, r, i, tx, x->flags, ty, y->flags);
        }
    }
}

/* export -> import -> compare -> export again: the same text. */
static void roundtrip(const avgpipe_schedule *s, const char *what) {
    avgpipe_buf t1 = {NULL, 0, 0}, t2 = {NULL, 0, 0};
    avgpipe_schedule back;
    cr_assert_eq(avgpipe_sched_export(NULL, s, 0, &t1), AVGPIPE_OK, "%s: export: %s", what, avgpipe_last_error(NULL));
    cr_assert_eq(strlen(t1.data), t1.len, "%s: export length", what);
    cr_assert_eq(avgpipe_sched_import(NULL, t1.data, t1.len, &back), AVGPIPE_OK, "%s: import: %s\n%s", what, avgpipe_last_error(NULL),
                 t1.data);
    assert_same_schedule(s, &back, what);
    cr_assert_eq(avgpipe_sched_export(NULL, &back, 0, &t2), AVGPIPE_OK);
    cr_assert_str_eq(t1.data, t2.data, "%s: second export differs", what);
    avgpipe_buf_free(NULL, &t1);
    avgpipe_buf_free(NULL, &t2);
    avgpipe_sched_free(NULL, &back);
}

/* ---- the golden PyTorch file -------------------------------------------------------------------- */

Test(golden, exports_back_byte_identical) {
    char path[1024], tmp[] = "/tmp/avgpipe_test_text_XXXXXX";
    size_t n, n2;
    char *bytes, *saved;
    avgpipe_schedule s, t;
    avgpipe_buf out = {NULL, 0, 0};
    int fd;
    golden_path(path, sizeof path);
    bytes = read_all(path, &n);
    cr_assert_eq(avgpipe_sched_import(NULL, bytes, n, &s), AVGPIPE_OK, "import: %s", avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_sched_export(NULL, &s, 0, &out), AVGPIPE_OK);
    cr_assert_eq(out.len, n, "export is %zu bytes, the file %zu", out.len, n);
    cr_assert(memcmp(out.data, bytes, n) == 0, "export differs from the file:\n%s\n--- file:\n%s", out.data, bytes);
    /* PyTorch's own flavour is the same text for this file */
    cr_assert_eq(avgpipe_sched_export(NULL, &s, AVGPIPE_TEXT_TORCH, &out), AVGPIPE_OK);
    cr_assert(out.len == n && memcmp(out.data, bytes, n) == 0, "torch export differs:\n%s", out.data);
    /* load/save through a file */
    cr_assert_eq(avgpipe_sched_load(NULL, path, &t), AVGPIPE_OK, "load: %s", avgpipe_last_error(NULL));
    assert_same_schedule(&s, &t, "load vs import");
    fd = mkstemp(tmp);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(avgpipe_sched_save(NULL, &t, 0, tmp), AVGPIPE_OK, "save: %s", avgpipe_last_error(NULL));
    saved = read_all(tmp, &n2);
    remove(tmp);
    cr_assert(n2 == n && memcmp(saved, bytes, n) == 0, "saved file differs:\n%s", saved);
    roundtrip(&s, "golden");
    free(saved);
    free(bytes);
    avgpipe_buf_free(NULL, &out);
    avgpipe_sched_free(NULL, &s);
    avgpipe_sched_free(NULL, &t);
}

/* ---- export -> import identity ----------------------------------------------------------------- */

Test(roundtrip, every_generator_and_lowered) {
    static const int Ms[] = {1, 2, 3, 4, 6, 8};
    long count = 0;
    int kind, S, mi, N, R, cont, variant;
    for (kind = AVGPIPE_SCHED_AFAB; kind < AVGPIPE_SCHED_KIND_COUNT; kind++)
        for (S = 1; S <= 6; S++)
            for (mi = 0; mi < 6; mi++)
                for (N = 1; N <= 3; N++)
                    for (R = 1; R <= 3; R++)
                        for (cont = 0; cont < 2; cont++)
                            for (variant = 0; variant < 3; variant++) {
                                int M = Ms[mi];
                                avgpipe_sched_desc d = desc_of((avgpipe_sched_kind)kind, S, M, N, 1, R, 0, cont);
                                avgpipe_schedule s, low;
                                char what[200];
                                if (kind == AVGPIPE_SCHED_INTERLEAVED) {
                                    if (variant && M % S) continue;
                                    d.chunks = 1 + variant; /* chunks 1 is 1F1B under the interleaved name */
                                } else if (kind == AVGPIPE_SCHED_ADVANCE || kind == AVGPIPE_SCHED_ZBV) {
                                    d.advance = variant == 0 ? 0 : variant == 1 ? 1 : M + 2;
                                } else if (variant) {
                                    continue;
                                }
                                if (gen_skips(&d)) continue;
                                gen(&d, &s);
                                snprintf(what, sizeof what, "%s", shape_str(&d));
                                roundtrip(&s, what);
                                cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK, "%s: lower: %s", what, avgpipe_last_error(NULL));
                                strncat(what, " lowered", sizeof what - strlen(what) - 1);
                                roundtrip(&low, what);
                                avgpipe_sched_free(NULL, &low);
                                avgpipe_sched_free(NULL, &s);
                                count++;
                            }
    cr_assert_gt(count, 1000, "only %ld shapes", count);
}

Test(roundtrip, greedy) {
    int S, M, N, split;
    for (S = 1; S <= 5; S++)
        for (M = 1; M <= 6; M++)
            for (N = 1; N <= 2; N++)
                for (split = 0; split < 2; split++) {
                    avgpipe_greedy_desc g;
                    avgpipe_schedule s;
                    char what[100];
                    memset(&g, 0, sizeof g);
                    g.shape.stages = S, g.shape.micro = M, g.shape.pipes = N, g.shape.rounds = 2, g.split_backward = split;
                    cr_assert_eq(avgpipe_sched_greedy(NULL, &g, &s), AVGPIPE_OK);
                    snprintf(what, sizeof what, "greedy S=%d M=%d N=%d split=%d", S, M, N, split);
                    roundtrip(&s, what);
                    avgpipe_sched_free(NULL, &s);
                }
}

/* Composite actions, idle slots, pipeline prefixes, STEP/AVG, FSDP no-ops, comments. */
Test(roundtrip, grammar_features) {
    static const char *texts[] = {
        "0F0,(0F1;0B0)OVERLAP_F_B,0B1\n",
        "0F0,,0F1,(0F2;0B0;0B1)OVERLAP_F_B,,0B2\n",
        "0UNSHARD,0F0,0B0,0REDUCE_GRAD,0RESHARD\n",
        ("# avgpipe version=1 kind=custom stages=2 chunks=1 micro=1 pipes=2 rounds=1 advance=0 continuous=1\n"
         "0F0,1:0F0,0B0,0STEP0,0AVG0,1:0B0,1:0STEP0,1:0AVG0\n1F0,1B0,1:1F0,1STEP0,1AVG0,1:1B0,1:1STEP0,1:1AVG0\n"),
    };
    size_t i;
    for (i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        avgpipe_schedule s;
        avgpipe_buf out = {NULL, 0, 0};
        import_text(texts[i], &s);
        cr_assert_eq(avgpipe_sched_export(NULL, &s, 0, &out), AVGPIPE_OK);
        cr_assert_str_eq(out.data, texts[i], "text %zu does not export back unchanged", i);
        avgpipe_buf_free(NULL, &out);
        avgpipe_sched_free(NULL, &s);
    }
}

/* Blank (or blank-looking) last rank lines, kept on import because a comment or the header's stage count
   says they are ranks: the probe's "0F0,0B0\n\n#\n" imported as 2 ranks, exported as "0F0,0B0\n\n" and
   read back as 1 (with a header, the re-import failed). An empty last rank now exports with the header,
   whose stage count keeps the blank lines it needs. */
Test(roundtrip, blank_last_ranks_survive) {
    static const struct {
        const char *text;
        int nranks;
    } cases[] = {
        {"0F0,0B0\n\n#\n", 2},
        {"0F0,0B0\n \n# a space is no blank line\n", 2},
        {"0F0,0B0\n\n\n#\n", 3},
        {"0F0,0B0\n1F0,1B0\n\n#\n\n\n", 3},
        {"\n#\n", 1},
        {"0F0,0B0\r\n\r\n#\r\n", 2},
        {"# avgpipe version=1 kind=custom stages=2 chunks=1 micro=1 pipes=1 rounds=1 advance=0 continuous=0\n0F0,0B0\n\n#\n", 2},
        {"# avgpipe version=1 kind=1f1b stages=3 chunks=1 micro=1 pipes=1 rounds=1 advance=0 continuous=0\n0F0,0B0\n\n\n\n\n", 3},
        {"# avgpipe version=1 kind=1f1b stages=2 chunks=1 micro=1 pipes=1 rounds=1 advance=0 continuous=0\n0F0,0B0\r\n\r\n", 2},
    };
    size_t i;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        avgpipe_schedule s;
        char what[64];
        snprintf(what, sizeof what, "text %zu", i);
        import_text(cases[i].text, &s);
        cr_assert_eq(s.nranks, cases[i].nranks, "%s: %d ranks, expected %d", what, s.nranks, cases[i].nranks);
        roundtrip(&s, what);
        avgpipe_sched_free(NULL, &s);
    }
}

/* Found by fuzz_sched: a header's shape that the actions alone do not imply (micro=8 over one
   micro-batch's ops; a custom schedule's advance or continuous) was exported without the header and
   came back as the inferred shape. */
Test(roundtrip, header_shapes_the_actions_do_not_imply) {
    static const char *texts[] = {
        "# avgpipe version=1 kind=custom stages=1 chunks=1 micro=100000000 pipes=1 rounds=1 advance=0 continuous=0\n0F0,0B0\n",
        "# avgpipe version=1 kind=custom stages=2 chunks=1 micro=8 pipes=1 rounds=1 advance=0 continuous=0\n0F0,0B0\n1F0,1B0\n",
        "# avgpipe version=1 kind=custom stages=2 chunks=2 micro=1 pipes=1 rounds=1 advance=0 continuous=0\n0F0,0B0\n1F0,1B0\n",
        "# avgpipe version=1 kind=custom stages=1 chunks=1 micro=1 pipes=1 rounds=1 advance=3 continuous=1\n0F0,0B0\n",
    };
    size_t i;
    for (i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        avgpipe_schedule s;
        char what[64];
        snprintf(what, sizeof what, "text %zu", i);
        import_text(texts[i], &s);
        roundtrip(&s, what);
        avgpipe_sched_free(NULL, &s);
    }
}

Test(import, parses_fields) {
    avgpipe_schedule s;
    char txt[64];
    import_text("# a comment line\n0F0,(0F1;0B0)OVERLAP_F_B,1:0B1,0STEP0\r\n", &s);
    cr_assert_eq(s.nranks, 1);
    cr_assert_eq(s.len[0], 5);
    cr_assert_eq(s.ops[0][1].kind, AVGPIPE_OP_F);
    cr_assert_eq(s.ops[0][1].flags, AVGPIPE_OPF_OVERLAP_NEXT, "first action of the composite overlaps the next");
    cr_assert_eq(s.ops[0][2].kind, AVGPIPE_OP_B);
    cr_assert_eq(s.ops[0][2].flags, 0);
    cr_assert_eq(s.ops[0][3].pipe, 1);
    cr_assert_eq(s.ops[0][3].micro, 1);
    cr_assert_eq(s.ops[0][4].kind, AVGPIPE_OP_STEP);
    cr_assert_eq(s.shape.pipes, 2, "pipes inferred from the highest pipeline: %d", s.shape.pipes);
    cr_assert_eq(avgpipe_op_format(&s.ops[0][3], 0, txt, sizeof txt), (int)strlen("1:0B1"));
    cr_assert_str_eq(txt, "1:0B1");
    cr_assert_eq(avgpipe_op_format(&s.ops[0][1], 1, txt, sizeof txt), 5);
    cr_assert_str_eq(txt, "0:0F1");
    avgpipe_sched_free(NULL, &s);
}

/* The PyTorch flavour drops STEP/AVG and the header, and refuses parallel pipelines. */
Test(export, torch_flavour) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_1F1B, 2, 2, 1, 1, 1, 0, 0);
    avgpipe_schedule s;
    avgpipe_buf out = {NULL, 0, 0};
    gen(&d, &s);
    cr_assert_eq(avgpipe_sched_export(NULL, &s, AVGPIPE_TEXT_TORCH, &out), AVGPIPE_OK);
    cr_assert_str_eq(out.data, "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
    cr_assert_eq(avgpipe_sched_export(NULL, &s, 0, &out), AVGPIPE_OK);
    cr_assert_str_eq(out.data, "# avgpipe version=1 kind=1f1b stages=2 chunks=1 micro=2 pipes=1 rounds=1 advance=0 continuous=0\n"
                               "0F0,0F1,0B0,0B1,0STEP0,0AVG0\n1F0,1B0,1F1,1B1,1STEP0,1AVG0\n");
    avgpipe_sched_free(NULL, &s);
    d.pipes = 2;
    gen(&d, &s);
    cr_assert_eq(avgpipe_sched_export(NULL, &s, AVGPIPE_TEXT_TORCH, &out), AVGPIPE_INVALID_ARG);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "pipes"), "%s", avgpipe_last_error(NULL));
    avgpipe_buf_free(NULL, &out);
    avgpipe_sched_free(NULL, &s);
}

Test(names, kinds_round_trip) {
    int k;
    avgpipe_sched_kind out;
    for (k = 0; k < AVGPIPE_SCHED_KIND_COUNT; k++) {
        cr_assert_eq(avgpipe_sched_kind_parse(avgpipe_sched_kind_name((avgpipe_sched_kind)k), &out), AVGPIPE_OK);
        cr_assert_eq((int)out, k);
    }
    cr_assert_eq(avgpipe_sched_kind_parse("gpipe", &out), AVGPIPE_OK);
    cr_assert_eq(out, AVGPIPE_SCHED_AFAB);
    cr_assert_eq(avgpipe_sched_kind_parse("pipedream", &out), AVGPIPE_INVALID_ARG);
    cr_assert_str_eq(avgpipe_op_kind_name(AVGPIPE_OP_SEND_B), "SEND_B");
    cr_assert_str_eq(avgpipe_op_kind_name((avgpipe_op_kind)99), "?");
}

/* ---- parse errors ---------------------------------------------------------------------------------- */

typedef struct bad_text {
    const char *text;
    const char *line; /* "line N" expected in the message */
    const char *why;  /* another piece of the message */
} bad_text;

Test(import, errors_name_the_line) {
    static const bad_text bad[] = {
        {"hello world\n", "line 1", "stage"},
        {"0F0,0B0\n1F0,1X0\n", "line 2", "unknown action kind"},
        {"0F0,0B0\n1F0,1Q0,1B0\n", "line 2", "unknown action kind"},
        {"# comment\n0F0,0F\n", "line 2", "micro-batch"},
        {"0F0\n0B0\n\n0F\n", "line 4", "micro-batch"},
        {"0F0,0F1x\n", "line 1", "unexpected characters"},
        {"0F0\n1F0\n2F0,(2F1;2B0)\n", "line 3", "OVERLAP_F_B"},
        {"0F0,(0F1)OVERLAP_F_B\n", "line 1", "two actions"},
        {"# avgpipe version=1 kind=1f1b stages=two\n0F0\n", "line 1", "stages"},
        {"# avgpipe version=1 kind=1f1b bogus=3\n0F0\n", "line 1", "bogus"},
        {"# avgpipe version=1 kind=nonsense stages=1\n0F0\n", "line 1", "nonsense"},
        {"# avgpipe stages\n0F0\n", "line 1", "stages"},
        {"# avgpipe stages=\n0F0\n", "line 1", "stages"},
        {"0F0\n# avgpipe stages=1\n", "line 2", "first line"},
        {"0F0,0B0\n1F0,1B0\n1:\n", "line 3", "stage"},
    };
    size_t i;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        avgpipe_schedule s;
        avgpipe_result r;
        avgpipe_clear_error(NULL);
        r = avgpipe_sched_import(NULL, bad[i].text, strlen(bad[i].text), &s);
        cr_assert_eq(r, AVGPIPE_PARSE_ERROR, "text %zu ('%s') gave %s", i, bad[i].text, avgpipe_result_string(r));
        cr_assert_not_null(strstr(avgpipe_last_error(NULL), bad[i].line), "text %zu: message '%s' lacks '%s'", i,
                           avgpipe_last_error(NULL), bad[i].line);
        cr_assert_not_null(strstr(avgpipe_last_error(NULL), bad[i].why), "text %zu: message '%s' lacks '%s'", i, avgpipe_last_error(NULL),
                           bad[i].why);
        cr_assert_eq(avgpipe_last_result(NULL), AVGPIPE_PARSE_ERROR);
        cr_assert_null(s.ops, "text %zu: a failed import leaves lists behind", i);
        avgpipe_sched_free(NULL, &s); /* harmless */
    }
}

Test(import, errors_without_a_line) {
    static const char *bad[] = {
        "",                                                     /* no rank lines */
        "# only a comment\n",                                   /* no rank lines */
        "# avgpipe version=1 kind=1f1b stages=3 chunks=1 micro=1\n0F0\n", /* header says 3 ranks, 1 line */
        "0F0,1F0\n",                                            /* fine: 2 chunks inferred */
        "# avgpipe version=1 kind=custom stages=1 chunks=1 micro=1\n0F0,1F0\n", /* stage 1 on 1 rank of 1 chunk */
    };
    static const avgpipe_result want[] = {AVGPIPE_PARSE_ERROR, AVGPIPE_PARSE_ERROR, AVGPIPE_PARSE_ERROR, AVGPIPE_OK,
                                          AVGPIPE_PARSE_ERROR};
    size_t i;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        avgpipe_schedule s;
        avgpipe_result r = avgpipe_sched_import(NULL, bad[i], strlen(bad[i]), &s);
        cr_assert_eq(r, want[i], "text %zu ('%s') gave %s: %s", i, bad[i], avgpipe_result_string(r), avgpipe_last_error(NULL));
        if (r != AVGPIPE_OK) cr_assert_neq(avgpipe_last_error(NULL)[0], 0, "text %zu: empty message", i);
        avgpipe_sched_free(NULL, &s);
    }
}

/* The generators' limits apply to imported text too (AVGPIPE__MAX_STAGES stage partitions, 32767
   pipelines, micro x rounds <= 1e9, S x V x N x M x R x 3 ops <= 4e8): a 13-byte rank line naming stage
   13333333 of pipeline 5 was accepted, and the simulator then allocated 2.5 GB for it. */
Test(import, generator_limits_apply) {
    static const bad_text bad[] = {
        {"5:13333333F0\n", "line 1", "stage"},
        {"5999:32766F0\n", "imply", "pipes x micro"}, /* 6000 x 32767 (pipeline, stage) cells from 13 bytes */
        {"0F0\n32767F0\n", "line 2", "stage"},
        {"# avgpipe version=1 kind=custom stages=1 chunks=32768 micro=1 pipes=1 rounds=1 advance=0 continuous=0\n0F0\n", "line 1", "chunks"},
        {"# avgpipe version=1 kind=custom stages=1 chunks=1 micro=1 pipes=32768 rounds=1 advance=0 continuous=0\n0F0\n", "line 1", "pipes"},
        {"# avgpipe version=1 kind=custom stages=1 chunks=1 micro=1000000000 pipes=1 rounds=2 advance=0 continuous=0\n0F0\n", "line 1", "micro"},
        {"# avgpipe version=1 kind=custom stages=1 chunks=1000 micro=1000 pipes=1000 rounds=1 advance=0 continuous=0\n0F0\n", "line 1", "micro"},
    };
    size_t i;
    char *many;
    avgpipe_schedule s;
    avgpipe_result r;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        avgpipe_clear_error(NULL);
        r = avgpipe_sched_import(NULL, bad[i].text, strlen(bad[i].text), &s);
        cr_expect_eq(r, AVGPIPE_PARSE_ERROR, "text %zu ('%s') gave %s", i, bad[i].text, avgpipe_result_string(r));
        cr_expect(strstr(avgpipe_last_error(NULL), bad[i].line) && strstr(avgpipe_last_error(NULL), bad[i].why),
                  "text %zu: message '%s' lacks '%s' or '%s'", i, avgpipe_last_error(NULL), bad[i].line, bad[i].why);
        if (r == AVGPIPE_OK) avgpipe_sched_free(NULL, &s);
    }
    /* 20000 rank lines and stage 20000: 2 chunks per rank inferred, 40000 stage partitions */
    many = (char *)malloc(20000 * 2 + 16);
    cr_assert_not_null(many);
    strcpy(many, "0F0,20000F0\n");
    for (i = 1; i < 20000; i++) memcpy(many + 12 + 2 * (i - 1), " \n", 3); /* blank-looking ranks */
    r = avgpipe_sched_import(NULL, many, strlen(many), &s);
    cr_expect_eq(r, AVGPIPE_PARSE_ERROR, "40000 stage partitions gave %s", avgpipe_result_string(r));
    cr_expect(strstr(avgpipe_last_error(NULL), "32767") != NULL, "%s", avgpipe_last_error(NULL));
    if (r == AVGPIPE_OK) avgpipe_sched_free(NULL, &s);
    free(many);
    /* the limits themselves are fine */
    import_text("0:32766F0\n", &s);
    cr_expect_eq(s.nstages, 32767);
    avgpipe_sched_free(NULL, &s);
}

/* An allocator that remembers the largest block asked for. */
static size_t LARGEST;
static void *largest_alloc(size_t n, void *user) {
    (void)user;
    if (n > LARGEST) LARGEST = n;
    return malloc(n);
}
static void largest_free(void *p, void *user) {
    (void)user;
    free(p);
}

/* A file that is not text is refused at its first NUL or control byte: /dev/zero was read to the
   1 GiB cap first (1 GB of memory, 2 s), and before that until the doubling buffer reached 2 GiB. */
Test(load, not_text_is_refused_at_the_first_byte) {
    avgpipe_context ctx;
    avgpipe_context_desc cd;
    avgpipe_schedule s;
    avgpipe_result r;
    FILE *f = fopen("/dev/zero", "rb");
    if (!f) cr_skip_test("no /dev/zero");
    fclose(f);
    memset(&cd, 0, sizeof cd);
    cd.allocator.alloc = largest_alloc;
    cd.allocator.free = largest_free;
    cr_assert_eq(avgpipe_context_init(&ctx, &cd), AVGPIPE_OK);
    LARGEST = 0;
    r = avgpipe_sched_load(&ctx, "/dev/zero", &s);
    cr_expect_eq(r, AVGPIPE_PARSE_ERROR, "%s: %s", avgpipe_result_string(r), avgpipe_last_error(&ctx));
    cr_expect(strstr(avgpipe_last_error(&ctx), "not a schedule (text): byte 0 is 0x00") != NULL, "%s", avgpipe_last_error(&ctx));
    cr_expect(LARGEST <= 65536, "a block of %zu bytes: read on after the first chunk", LARGEST);
    if (r == AVGPIPE_OK) avgpipe_sched_free(&ctx, &s);
}

/* A writer of `bytes` spaces into a FIFO (text the import would read on and on). */
typedef struct fifo_writer {
    const char *path;
    size_t bytes;
} fifo_writer;
static void *write_spaces(void *arg) {
    const fifo_writer *w = (const fifo_writer *)arg;
    static char buf[1 << 16];
    size_t done = 0;
    FILE *f = fopen(w->path, "wb");
    memset(buf, ' ', sizeof buf);
    while (f && done < w->bytes) {
        size_t n = w->bytes - done < sizeof buf ? w->bytes - done : sizeof buf;
        if (fwrite(buf, 1, n, f) != n) break; /* the reader stopped (EPIPE) */
        done += n;
    }
    if (f) fclose(f);
    return NULL;
}

/* Text is read up to 1 GiB, and the buffer never grows past that (a pipe of 1 GiB + 64 KiB of spaces). */
Test(load, cap_is_checked_before_growing) {
    avgpipe_context ctx;
    avgpipe_context_desc cd;
    avgpipe_schedule s;
    avgpipe_result r;
    char path[64];
    fifo_writer w;
    pthread_t t;
    snprintf(path, sizeof path, "/tmp/avgpipe_test_fifo.%ld", (long)getpid());
    unlink(path);
    if (mkfifo(path, 0600) != 0) cr_skip_test("mkfifo: cannot make a FIFO in /tmp");
    signal(SIGPIPE, SIG_IGN); /* the writer sees EPIPE when the reader stops (Criterion runs each test in its own process) */
    w.path = path, w.bytes = ((size_t)1 << 30) + 65536;
    cr_assert_eq(pthread_create(&t, NULL, write_spaces, &w), 0);
    memset(&cd, 0, sizeof cd);
    cd.allocator.alloc = largest_alloc;
    cd.allocator.free = largest_free;
    cr_assert_eq(avgpipe_context_init(&ctx, &cd), AVGPIPE_OK);
    LARGEST = 0;
    r = avgpipe_sched_load(&ctx, path, &s);
    pthread_join(t, NULL);
    unlink(path);
    cr_expect_eq(r, AVGPIPE_IO_ERROR, "%s: %s", avgpipe_result_string(r), avgpipe_last_error(&ctx));
    cr_expect(strstr(avgpipe_last_error(&ctx), "is over 1073741824 bytes, the most a schedule file may hold") != NULL, "%s",
              avgpipe_last_error(&ctx));
    cr_expect(LARGEST <= ((size_t)1 << 30) + 1, "a block of %zu bytes", LARGEST);
    if (r == AVGPIPE_OK) avgpipe_sched_free(&ctx, &s);
}

/* Text need not be NUL-terminated: only len bytes are read. */
Test(import, respects_length) {
    const char text[] = "0F0,0B0\ngarbage";
    avgpipe_schedule s;
    cr_assert_eq(avgpipe_sched_import(NULL, text, 8, &s), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    cr_assert_eq(s.nranks, 1);
    cr_assert_eq(s.len[0], 2);
    avgpipe_sched_free(NULL, &s);
}

/* Every prefix of a text with a header, a composite, comments and CRLF, each ending at an unreadable
   page: import reads only within the length it was given (a read past it crashes the test). */
Test(import, keeps_to_its_length) {
    static const char text[] = "# avgpipe version=1 kind=custom stages=2 chunks=1 micro=2 pipes=2 rounds=1 advance=0 continuous=0\r\n"
                               "# a comment\r\n0F0,(0F1;0B0)OVERLAP_F_B,0B1,1:0F0,1:0B0,0STEP0\r\n1F0,1B0,,1F1,1B1,1:1F0,1:1B0\r\n\r\n";
    size_t n;
    for (n = 0; n < sizeof text; n++) {
        guarded g = guarded_copy(text, n);
        avgpipe_schedule s;
        avgpipe_result r = avgpipe_sched_import(NULL, g.text, n, &s);
        cr_expect(r == AVGPIPE_OK || r == AVGPIPE_PARSE_ERROR, "prefix of %zu bytes: %s", n, avgpipe_result_string(r));
        if (r == AVGPIPE_OK) avgpipe_sched_free(NULL, &s);
        guarded_free(&g);
    }
}

/* "has_comm is 1 when the lists carry SEND/RECV ops" (avgpipe_schedule), also after lowering; a
   schedule whose stages all live on one rank needs no transfer. */
Test(lower, has_comm_matches_the_ops) {
    int S, kind;
    for (kind = AVGPIPE_SCHED_AFAB; kind < AVGPIPE_SCHED_KIND_COUNT; kind++)
        for (S = 1; S <= 3; S++) {
            avgpipe_sched_desc d = desc_of((avgpipe_sched_kind)kind, S, 3, 1, 1, 1, 1, 0);
            avgpipe_schedule s, low;
            if (gen_skips(&d)) continue;
            gen(&d, &s);
            cr_assert_eq(s.has_comm, 0);
            cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK);
            cr_assert_eq(carries_comm(&low), S > 1); /* V placement: S = 1 keeps both stages on rank 0 */
            cr_assert_eq(low.has_comm, carries_comm(&low), "%s lowered: has_comm %d, SEND/RECV ops %d", shape_str(&d), low.has_comm,
                         carries_comm(&low));
            avgpipe_sched_free(NULL, &low);
            avgpipe_sched_free(NULL, &s);
        }
}
