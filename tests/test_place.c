/* Tests of stage placement (issue 10): the loop, V and custom placements in the schedule IR, their
   text form (inferred by import, recorded by the header), the V-placed generators ZB-V and DualPipeV
   against an independent implementation of the published algorithms (scripts/torch_v_schedules.py,
   whose output tests/data holds in PyTorch's CSV layout), their validity over a grid of shapes, and
   their closed forms in the simulator.

   Build and run from the repository root:
     gcc -std=c11 -O2 -Wall -Wextra -pedantic -Werror -I. tests/test_place.c -o /tmp/test_place \
         -lcriterion -lm && /tmp/test_place */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include "tests/sched_helpers.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers --------------------------------------------------------------------------------- */

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;
    cr_assert_not_null(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = (char *)malloc((size_t)n + 1);
    cr_assert_not_null(buf);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    buf[n] = 0;
    *len = (size_t)n;
    return buf;
}

static void import_text(const char *text, avgpipe_schedule *s) {
    avgpipe_result r = avgpipe_sched_import(NULL, text, strlen(text), s);
    cr_assert_eq(r, AVGPIPE_OK, "import: %s (%s)\n%s", avgpipe_result_string(r), avgpipe_last_error(NULL), text);
}

static void validate_ok(const avgpipe_schedule *s, const char *what) {
    avgpipe_validate_report rep;
    avgpipe_result r = avgpipe_sched_validate(NULL, s, NULL, &rep);
    cr_assert_eq(r, AVGPIPE_OK, "%s: %s", what, rep.message);
}

/* export(s) imports back to the same ops, placement and shape, and exports to the same text. */
static void roundtrip(const avgpipe_schedule *s, const char *what) {
    avgpipe_buf a = {NULL, 0, 0}, b = {NULL, 0, 0};
    avgpipe_schedule back;
    int r, g;
    cr_assert_eq(avgpipe_sched_export(NULL, s, 0, &a), AVGPIPE_OK, "%s: export: %s", what, avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_sched_import(NULL, a.data, a.len, &back), AVGPIPE_OK, "%s: import: %s\n%s", what, avgpipe_last_error(NULL), a.data);
    cr_assert_eq(back.nranks, s->nranks, "%s", what);
    cr_assert_eq(back.nstages, s->nstages, "%s", what);
    cr_assert_eq(back.shape.placement, s->shape.placement, "%s: placement %s, was %s", what, avgpipe_placement_name(back.shape.placement),
                 avgpipe_placement_name(s->shape.placement));
    for (g = 0; g < s->nstages; g++) cr_assert_eq(avgpipe_stage_rank(&back, g), avgpipe_stage_rank(s, g), "%s: stage %d", what, g);
    for (r = 0; r < s->nranks; r++) {
        cr_assert_eq(back.len[r], s->len[r], "%s: rank %d", what, r);
        cr_assert(memcmp(back.ops[r], s->ops[r], (size_t)s->len[r] * sizeof(avgpipe_op)) == 0, "%s: rank %d ops differ", what, r);
    }
    cr_assert_eq(avgpipe_sched_export(NULL, &back, 0, &b), AVGPIPE_OK);
    cr_assert_str_eq(b.data, a.data, "%s: export -> import -> export changed the text", what);
    avgpipe_buf_free(NULL, &a);
    avgpipe_buf_free(NULL, &b);
    avgpipe_sched_free(NULL, &back);
}

static void data_path(char *out, size_t cap, const char *name) { snprintf(out, cap, "tests/data/%s", name); }

/* ---- the placements --------------------------------------------------------------------------- */

Test(placement, named_formulas) {
    static const int v4[12] = {0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3}; /* rank r holds r, 2S-1-r, 2S+r */
    int g;
    for (g = 0; g < 12; g++) {
        cr_assert_eq(avgpipe_place_rank(AVGPIPE_PLACE_LOOP, 4, g), g % 4);
        cr_assert_eq(avgpipe_place_rank(AVGPIPE_PLACE_V, 4, g), v4[g], "V stage %d", g);
        cr_assert_eq(avgpipe_place_rank(AVGPIPE_PLACE_V, 1, g), 0);
    }
    cr_assert_eq(avgpipe_place_rank(AVGPIPE_PLACE_CUSTOM, 4, 0), -1);
    cr_assert_eq(avgpipe_place_rank(AVGPIPE_PLACE_AUTO, 4, 0), -1);
    cr_assert_eq(avgpipe_place_rank(AVGPIPE_PLACE_LOOP, 0, 0), -1);
    cr_assert_eq(avgpipe_place_rank(AVGPIPE_PLACE_LOOP, 4, -1), -1);
    cr_assert_str_eq(avgpipe_placement_name(AVGPIPE_PLACE_V), "v");
    cr_assert_str_eq(avgpipe_placement_name((avgpipe_placement)77), "?");
}

/* A 3-stage model on 2 ranks with stage 1 alone on rank 0: F and B of one micro-batch. */
static void three_stage_custom(avgpipe_schedule *s) {
    static const int map[3] = {1, 0, 1};
    cr_assert_eq(avgpipe_sched_init(NULL, s, 2, NULL), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_set_place(NULL, s, map, 3), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_sched_push(NULL, s, 1, (avgpipe_op){0, 0, 0, AVGPIPE_OP_F, 0, 0}), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_push(NULL, s, 0, (avgpipe_op){1, 0, 0, AVGPIPE_OP_F, 0, 0}), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_push(NULL, s, 1, (avgpipe_op){2, 0, 0, AVGPIPE_OP_F, 0, 0}), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_push(NULL, s, 1, (avgpipe_op){2, 0, 0, AVGPIPE_OP_B, 0, 0}), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_push(NULL, s, 0, (avgpipe_op){1, 0, 0, AVGPIPE_OP_B, 0, 0}), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_push(NULL, s, 1, (avgpipe_op){0, 0, 0, AVGPIPE_OP_B, 0, 0}), AVGPIPE_OK);
}

Test(placement, set_place_names_known_maps_and_keeps_others) {
    static const int loop[4] = {0, 1, 0, 1}, v[4] = {0, 1, 1, 0}, odd[4] = {1, 1, 0, 0}, far[4] = {0, 2, 0, 1};
    avgpipe_schedule s, c;
    cr_assert_eq(avgpipe_sched_init(NULL, &s, 2, NULL), AVGPIPE_OK);
    cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_LOOP);
    cr_assert_eq(avgpipe_sched_set_place(NULL, &s, v, 4), AVGPIPE_OK);
    cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_V);
    cr_assert_null(s.place);
    cr_assert_eq(s.nstages, 4);
    cr_assert_eq(s.shape.chunks, 2);
    cr_assert_eq(avgpipe_sched_set_place(NULL, &s, loop, 4), AVGPIPE_OK);
    cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_LOOP);
    cr_assert_eq(avgpipe_sched_set_place(NULL, &s, odd, 4), AVGPIPE_OK);
    cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_CUSTOM);
    cr_assert_eq(s.nplace, 4);
    cr_assert_eq(avgpipe_stage_rank(&s, 0), 1);
    cr_assert_eq(avgpipe_stage_rank(&s, 3), 0);
    cr_assert_eq(avgpipe_stage_rank(&s, 4), -1);
    cr_assert_eq(avgpipe_sched_copy(NULL, &s, &c), AVGPIPE_OK);
    cr_assert(c.place != s.place && c.nplace == 4 && memcmp(c.place, odd, sizeof odd) == 0, "copy shares or loses the map");
    avgpipe_sched_free(NULL, &c);
    /* refused: a rank out of range, fewer stages than the schedule has, an op already elsewhere */
    cr_assert_eq(avgpipe_sched_set_place(NULL, &s, far, 4), AVGPIPE_INVALID_ARG);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "rank 2"), "%s", avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_sched_set_place(NULL, &s, loop, 2), AVGPIPE_INVALID_ARG);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "4 stages"), "%s", avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_sched_push(NULL, &s, 1, (avgpipe_op){0, 0, 0, AVGPIPE_OP_F, 0, 0}), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_set_place(NULL, &s, v, 4), AVGPIPE_INVALID_ARG);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "runs stage 0"), "%s", avgpipe_last_error(NULL));
    avgpipe_sched_free(NULL, &s);
}

/* A custom map with a non-neighbour channel layout: lowering, validation (both send kinds), the
   simulator and the text form all follow it. */
Test(placement, custom_map_lowers_validates_simulates) {
    avgpipe_schedule s, low;
    avgpipe_sim_result r;
    avgpipe_sim_desc sd;
    int i, sends = 0;
    three_stage_custom(&s);
    validate_ok(&s, "custom map");
    cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    cr_assert_eq(low.shape.placement, AVGPIPE_PLACE_CUSTOM);
    for (i = 0; i < low.len[1]; i++) sends += low.ops[1][i].kind == AVGPIPE_OP_SEND_F || low.ops[1][i].kind == AVGPIPE_OP_SEND_B;
    cr_assert_eq(sends, 2, "rank 1 sends stage 0's activation and stage 2's gradient (got %d sends)", sends);
    validate_ok(&low, "custom map lowered");
    memset(&sd, 0, sizeof sd);
    sd.latency = 1;
    cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &r), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    /* F 1 + link 1 + F 1 + link 1 + F 1 + B 2 + link 1 + B 2 + link 1 + B 2 */
    cr_assert_float_eq(r.makespan, 13.0, 1e-12, "makespan %g", r.makespan);
    avgpipe_sim_result_free(NULL, &r);
    roundtrip(&s, "custom map");
    roundtrip(&low, "custom map lowered");
    avgpipe_sched_free(NULL, &low);
    avgpipe_sched_free(NULL, &s);
}

/* ---- text ----------------------------------------------------------------------------------- */

Test(text, import_infers_the_placement) {
    avgpipe_schedule s;
    import_text("0F0,1F0,1B0,0B0\n", &s); /* one rank: loop */
    cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_LOOP);
    avgpipe_sched_free(NULL, &s);
    import_text("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n", &s); /* V */
    cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_V);
    cr_assert_eq(s.nstages, 4);
    validate_ok(&s, "small V");
    roundtrip(&s, "small V");
    avgpipe_sched_free(NULL, &s);
    import_text("1F0,1B0\n0F0,2F0,2B0,0B0\n", &s); /* custom, every stage named */
    cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_CUSTOM);
    cr_assert_eq(avgpipe_stage_rank(&s, 0), 1);
    cr_assert_eq(avgpipe_stage_rank(&s, 1), 0);
    cr_assert_eq(avgpipe_stage_rank(&s, 2), 1);
    validate_ok(&s, "custom");
    {
        avgpipe_buf b = {NULL, 0, 0};
        cr_assert_eq(avgpipe_sched_export(NULL, &s, 0, &b), AVGPIPE_OK);
        cr_assert_str_eq(b.data, "1F0,1B0\n0F0,2F0,2B0,0B0\n", "an inferable custom map needs no header");
        avgpipe_buf_free(NULL, &b);
    }
    avgpipe_sched_free(NULL, &s);
}

/* The header records what the actions cannot say: a custom map with an unnamed stage, V over a partial
   schedule, the format version. */
Test(text, header_records_the_placement_and_version) {
    static const char *texts[] = {
        "# avgpipe version=1 kind=custom stages=2 chunks=2 micro=1 pipes=1 rounds=1 advance=0 continuous=0 placement=custom place=1,0,0,1\n"
        "1F0,1B0\n0F0,0B0\n",
        "# avgpipe version=1 kind=custom stages=2 chunks=2 micro=1 pipes=1 rounds=1 advance=0 continuous=0 placement=v\n"
        "0F0,0B0\n1F0,1B0\n",
        "# avgpipe version=1 kind=zbv stages=1 chunks=2 micro=1 pipes=1 rounds=1 advance=0 continuous=0 placement=v\n"
        "0F0,1F0,1I0,1W0,1STEP0,1AVG0,0I0,0W0,0STEP0,0AVG0\n",
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
    {
        avgpipe_schedule s;
        import_text(texts[0], &s);
        cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_CUSTOM);
        cr_assert_eq(avgpipe_stage_rank(&s, 2), 0, "stage 2 has no op: only the header places it");
        avgpipe_sched_free(NULL, &s);
    }
}

Test(text, placement_errors_name_what_is_wrong) {
    static const struct {
        const char *text, *needle1, *needle2;
    } bad[] = {
        {"0F0,1F0\n1F0,1B0\n", "stage 1 appears on two ranks", "line 2"},
        {"# avgpipe kind=custom stages=2 chunks=2 micro=1 pipes=1 rounds=1 placement=v\n0F0,2F0\n1F0\n", "line 2", "v placement"},
        {"# avgpipe version=2 stages=1\n0F0\n", "version 2", "newer"},
        {"# avgpipe version=0 stages=1\n0F0\n", "version 0", "line 1"},
        {"# avgpipe stages=1 chunks=1 micro=1 pipes=1 rounds=1 placement=zigzag\n0F0\n", "zigzag", "line 1"},
        {"# avgpipe stages=2 chunks=2 micro=1 pipes=1 rounds=1 placement=custom place=1,,0,1\n0F0\n1F0\n", "place", "line 1"},
        {"# avgpipe stages=2 chunks=2 micro=1 pipes=1 rounds=1 placement=custom place=1,0,0,1,\n0F0\n1F0\n", "place", "line 1"},
        {"# avgpipe stages=2 chunks=2 micro=1 pipes=1 rounds=1 place=1,0,0,1\n1F0\n0F0\n", "place=", "placement=custom"},
        {"# avgpipe stages=2 chunks=2 micro=1 pipes=1 rounds=1 placement=custom place=1,0\n1F0\n0F0\n", "place=", "4"},
        {"# avgpipe stages=2 chunks=2 micro=1 pipes=1 rounds=1 placement=custom place=1,0,5,1\n1F0\n0F0\n", "stage 2", "rank 5"},
        {"1F0,1B0\n0F0,3F0\n", "stage 2", "place="}, /* neither loop nor V, and stage 2 nowhere */
    };
    size_t i;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        avgpipe_schedule s;
        avgpipe_result r = avgpipe_sched_import(NULL, bad[i].text, strlen(bad[i].text), &s);
        const char *msg = avgpipe_last_error(NULL);
        cr_assert_eq(r, AVGPIPE_PARSE_ERROR, "text %zu accepted:\n%s", i, bad[i].text);
        cr_assert(strstr(msg, bad[i].needle1) && strstr(msg, bad[i].needle2), "text %zu: message '%s' lacks '%s' or '%s'", i, msg,
                  bad[i].needle1, bad[i].needle2);
    }
}

/* ---- PyTorch's V schedules (regenerated by scripts/torch_v_schedules.py) ----------------------- */

static const struct {
    const char *file;
    avgpipe_sched_kind kind;
    int ranks, micro;
} torch_files[] = {
    {"torch_zbv_2rank_4stage_6micro.csv", AVGPIPE_SCHED_ZBV, 2, 6},
    {"torch_zbv_4rank_8stage_4micro.csv", AVGPIPE_SCHED_ZBV, 4, 4},
    {"torch_dualpipev_2rank_4stage_4micro.csv", AVGPIPE_SCHED_DUALPIPEV, 2, 4},
    {"torch_dualpipev_4rank_8stage_10micro.csv", AVGPIPE_SCHED_DUALPIPEV, 4, 10},
};

Test(torch, v_schedules_import_validate_simulate_export_identical) {
    size_t i;
    for (i = 0; i < sizeof torch_files / sizeof torch_files[0]; i++) {
        char path[256];
        size_t len;
        char *text;
        avgpipe_schedule s, low;
        avgpipe_buf out = {NULL, 0, 0};
        avgpipe_sim_result r;
        avgpipe_sim_desc sd;
        data_path(path, sizeof path, torch_files[i].file);
        text = read_all(path, &len);
        cr_assert_eq(avgpipe_sched_import(NULL, text, len, &s), AVGPIPE_OK, "%s: %s", path, avgpipe_last_error(NULL));
        cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_V, "%s: placement %s", path, avgpipe_placement_name(s.shape.placement));
        cr_assert_eq(s.nranks, torch_files[i].ranks);
        cr_assert_eq(s.nstages, 2 * torch_files[i].ranks);
        cr_assert_eq(s.shape.micro, torch_files[i].micro);
        validate_ok(&s, path);
        memset(&sd, 0, sizeof sd);
        sd.blocking_send = 1;
        cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &r), AVGPIPE_OK, "%s: %s", path, avgpipe_last_error(NULL));
        cr_assert_gt(r.makespan, 0);
        avgpipe_sim_result_free(NULL, &r);
        cr_assert_eq(avgpipe_sched_export(NULL, &s, 0, &out), AVGPIPE_OK);
        cr_assert_eq(out.len, len, "%s: exported %zu bytes, the file has %zu", path, out.len, len);
        cr_assert(memcmp(out.data, text, len) == 0, "%s: export differs from the file", path);
        cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK);
        validate_ok(&low, path);
        roundtrip(&low, path);
        avgpipe_sched_free(NULL, &low);
        avgpipe_buf_free(NULL, &out);
        avgpipe_sched_free(NULL, &s);
        free(text);
    }
}

/* The C generators and the Python rendition of the published algorithms give the same compute order
   (the file has idle slots and no STEP/AVG; the generator the other way round). */
Test(torch, generators_match_the_published_algorithms) {
    size_t i;
    for (i = 0; i < sizeof torch_files / sizeof torch_files[0]; i++) {
        char path[256];
        avgpipe_schedule f, g;
        avgpipe_sched_desc d = desc_of(torch_files[i].kind, torch_files[i].ranks, torch_files[i].micro, 1, 1, 1, 0, 0);
        int r;
        data_path(path, sizeof path, torch_files[i].file);
        cr_assert_eq(avgpipe_sched_load(NULL, path, &f), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
        gen(&d, &g);
        cr_assert_eq(g.shape.placement, AVGPIPE_PLACE_V);
        for (r = 0; r < f.nranks; r++) {
            int a = 0, b = 0, n = 0;
            for (;;) {
                while (a < f.len[r] && f.ops[r][a].kind == AVGPIPE_OP_IDLE) a++;
                while (b < g.len[r] && (g.ops[r][b].kind == AVGPIPE_OP_STEP || g.ops[r][b].kind == AVGPIPE_OP_AVG)) b++;
                if (a == f.len[r] || b == g.len[r]) break;
                cr_assert(f.ops[r][a].kind == g.ops[r][b].kind && f.ops[r][a].stage == g.ops[r][b].stage &&
                              f.ops[r][a].micro == g.ops[r][b].micro && f.ops[r][a].flags == g.ops[r][b].flags,
                          "%s rank %d, op %d: file %d%s%d, generator %d%s%d", path, r, n, f.ops[r][a].stage,
                          avgpipe_op_kind_name((avgpipe_op_kind)f.ops[r][a].kind), f.ops[r][a].micro, g.ops[r][b].stage,
                          avgpipe_op_kind_name((avgpipe_op_kind)g.ops[r][b].kind), g.ops[r][b].micro);
                a++, b++, n++;
            }
            cr_assert(a == f.len[r] && b == g.len[r], "%s rank %d: one list ends early (after %d ops)", path, r, n);
        }
        avgpipe_sched_free(NULL, &f);
        avgpipe_sched_free(NULL, &g);
    }
}

/* ---- generators -------------------------------------------------------------------------------- */

/* Every V generator over a grid of S, M, N, R, round modes (and K for ZB-V) validates: static
   invariants, the memory model, the replay under asynchronous and blocking sends; export -> import
   is the identity. */
Test(generators, v_kinds_validate_over_a_grid) {
    static const avgpipe_sched_kind kinds[] = {AVGPIPE_SCHED_ZBV, AVGPIPE_SCHED_DUALPIPEV};
    static const int Ks[] = {0, 1, 3};
    size_t k, ki;
    int S, M, N, R, cont, count = 0;
    for (k = 0; k < 2; k++)
        for (S = 1; S <= 5; S++)
            for (M = 1; M <= 9; M += (M < 4 ? 1 : 2))
                for (N = 1; N <= 3; N++)
                    for (R = 1; R <= 2; R++)
                        for (cont = 0; cont < 2; cont++)
                            for (ki = 0; ki < (kinds[k] == AVGPIPE_SCHED_ZBV ? 3u : 1u); ki++) {
                                avgpipe_sched_desc d = desc_of(kinds[k], S, M, N, 1, R, Ks[ki], cont);
                                avgpipe_schedule s;
                                char what[200];
                                if (gen_skips(&d)) {
                                    cr_assert_eq(avgpipe_sched_generate(NULL, &d, &s), AVGPIPE_INVALID_ARG, "%s", shape_str(&d));
                                    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "micro"));
                                    continue;
                                }
                                gen(&d, &s);
                                snprintf(what, sizeof what, "%s", shape_str(&d));
                                cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_V, "%s", what);
                                validate_ok(&s, what);
                                if (S <= 3) roundtrip(&s, what);
                                avgpipe_sched_free(NULL, &s);
                                count++;
                            }
    cr_assert_gt(count, 1000, "only %d shapes", count);
}

Test(generators, placement_in_the_description) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ZBV, 4, 8, 1, 1, 1, 0, 0), out;
    avgpipe_schedule s;
    d.placement = AVGPIPE_PLACE_V; /* explicit = the kind's own */
    gen(&d, &s);
    cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_V);
    avgpipe_sched_free(NULL, &s);
    d.placement = AVGPIPE_PLACE_LOOP;
    cr_assert_eq(avgpipe_sched_generate(NULL, &d, &s), AVGPIPE_INVALID_ARG);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "placement"), "%s", avgpipe_last_error(NULL));
    d.placement = AVGPIPE_PLACE_CUSTOM;
    cr_assert_eq(avgpipe_sched_generate(NULL, &d, &s), AVGPIPE_INVALID_ARG);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "avgpipe_sched_set_place"), "%s", avgpipe_last_error(NULL));
    d.placement = (avgpipe_placement)9;
    cr_assert_eq(avgpipe_sched_generate(NULL, &d, &s), AVGPIPE_INVALID_ARG);
    d = desc_of(AVGPIPE_SCHED_INTERLEAVED, 4, 8, 1, 2, 1, 0, 0);
    d.placement = AVGPIPE_PLACE_V;
    cr_assert_eq(avgpipe_sched_generate(NULL, &d, &s), AVGPIPE_INVALID_ARG);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "placement"), "%s", avgpipe_last_error(NULL));
    d = desc_of(AVGPIPE_SCHED_1F1B, 4, 8, 1, 1, 1, 0, 0); /* one stage per rank: V and loop agree */
    d.placement = AVGPIPE_PLACE_V;
    cr_assert_eq(avgpipe_sched_resolve(NULL, &d, &out), AVGPIPE_OK);
    cr_assert_eq(out.placement, AVGPIPE_PLACE_LOOP);
    d = desc_of(AVGPIPE_SCHED_ZBV, 4, 8, 1, 1, 1, 0, 0);
    cr_assert_eq(avgpipe_sched_resolve(NULL, &d, &out), AVGPIPE_OK);
    cr_assert_eq(out.placement, AVGPIPE_PLACE_V);
    cr_assert_eq(out.chunks, 2);
}

/* Lowering under V placement: the hand-over from stage S-1 to stage S stays on rank S-1 (no message);
   every other boundary carries one activation and one gradient per micro-batch. */
Test(generators, v_lowering_keeps_the_turn_local) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ZBV, 4, 8, 2, 1, 1, 0, 0);
    avgpipe_schedule s, low;
    int r, i, sends = 0;
    gen(&d, &s);
    cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK);
    for (r = 0; r < low.nranks; r++)
        for (i = 0; i < low.len[r]; i++) {
            const avgpipe_op *o = &low.ops[r][i];
            if (o->kind == AVGPIPE_OP_SEND_F || o->kind == AVGPIPE_OP_SEND_B) sends++;
            cr_assert(!(o->kind == AVGPIPE_OP_SEND_F && o->stage == 3) && !(o->kind == AVGPIPE_OP_SEND_B && o->stage == 4),
                      "rank %d sends across the turn of the V", r);
        }
    cr_assert_eq(sends, 2 * 6 * 8 * 2, "%d sends: 6 remote boundaries x 2 directions x 16 micro-batches expected", sends);
    validate_ok(&low, "zbv lowered");
    avgpipe_sched_free(NULL, &low);
    avgpipe_sched_free(NULL, &s);
}

/* ---- closed forms ------------------------------------------------------------------------------- */

static avgpipe_sim_desc unit_costs(double c) {
    avgpipe_sim_desc sd;
    memset(&sd, 0, sizeof sd);
    sd.cost[AVGPIPE_OP_F] = c;
    sd.cost[AVGPIPE_OP_I] = c;
    sd.cost[AVGPIPE_OP_W] = c;
    sd.cost[AVGPIPE_OP_B] = 2 * c;
    return sd;
}

/* ZB-V (Qi et al. 2024, section 6): with T_F = T_B = T_W and M >= 2S the schedule has zero bubble:
   no rank is ever idle once the pipeline has filled. Rank r's work is 2M(F + I + W) and the only idle
   time of every rank is the fill, (S-1) chunk forwards (the last rank cannot start before), so the
   makespan is 6Mc + (S-1)c and every rank idles exactly (S-1)c. For comparison the published ZB-H1
   bubble is (S-1)(T_F + T_B - T_W) per stage and 1F1B's (S-1)(T_F + T_B + T_W). Below 2S micro-batches
   ZB-V has more idle time than the fill. */
Test(closed_forms, zbv_zero_bubble_when_f_equals_b_equals_w) {
    static const double cs[] = {1.0, 0.25};
    int S, M, r;
    size_t ci;
    for (ci = 0; ci < 2; ci++)
        for (S = 1; S <= 8; S++)
            for (M = 2 * S; M <= 2 * S + 9; M += 3) {
                double c = cs[ci];
                avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ZBV, S, M, 1, 1, 1, 0, 0);
                avgpipe_sim_desc sd = unit_costs(c);
                avgpipe_schedule s;
                avgpipe_sim_result res;
                gen(&d, &s);
                cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &res), AVGPIPE_OK);
                cr_assert_float_eq(res.makespan, 6.0 * M * c + (S - 1) * c, 1e-9, "zbv S=%d M=%d c=%g: makespan %g, want %g", S, M, c,
                                   res.makespan, 6.0 * M * c + (S - 1) * c);
                for (r = 0; r < S; r++) {
                    cr_assert_float_eq(res.rank[r].busy, 6.0 * M * c, 1e-9);
                    cr_assert_float_eq(res.rank[r].idle, (S - 1) * c, 1e-9, "zbv S=%d M=%d rank %d idles %g", S, M, r, res.rank[r].idle);
                    cr_assert_eq(res.rank[r].peak_stash, 2 * S, "zbv S=%d M=%d rank %d: peak %d, 1F1B's S whole micro-batches = %d chunks", S,
                                 M, r, res.rank[r].peak_stash, 2 * S);
                }
                avgpipe_sim_result_free(NULL, &res);
                avgpipe_sched_free(NULL, &s);
            }
    { /* too few micro-batches: a bubble beyond the fill */
        avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ZBV, 4, 3, 1, 1, 1, 0, 0);
        avgpipe_sim_desc sd = unit_costs(1);
        avgpipe_schedule s;
        avgpipe_sim_result res;
        gen(&d, &s);
        cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &res), AVGPIPE_OK);
        cr_assert_gt(res.makespan, 6.0 * 3 + 3 + 0.5);
        avgpipe_sim_result_free(NULL, &res);
        avgpipe_sched_free(NULL, &s);
    }
}

/* DualPipeV: the step structure fixes the overlapped pairs per rank, (M-2S+r+1) of each direction in
   the main step less the last rank's first, plus S-r-1 in step 5; memory 2S+1 chunk activations on
   every rank (the memory model), one more than ZB-V's; every rank does 2M forwards and 2M backwards. */
Test(closed_forms, dualpipev_pairs_and_memory) {
    int S, M, r, i;
    for (S = 1; S <= 6; S++)
        for (M = 2 * S; M <= 2 * S + 5; M++) {
            avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_DUALPIPEV, S, M, 1, 1, 1, 0, 0);
            avgpipe_sim_desc sd = unit_costs(1);
            avgpipe_schedule s;
            avgpipe_sim_result res;
            gen(&d, &s);
            cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &res), AVGPIPE_OK);
            for (r = 0; r < S; r++) {
                int pairs = 0, nf = 0, nb = 0, want = 2 * (M - 2 * S + r + 1) - (r == S - 1) + (S - r - 1);
                for (i = 0; i < s.len[r]; i++) {
                    const avgpipe_op *o = &s.ops[r][i];
                    if (o->flags & AVGPIPE_OPF_OVERLAP_NEXT) {
                        pairs++;
                        cr_assert(o->kind == AVGPIPE_OP_F && i + 1 < s.len[r] && s.ops[r][i + 1].kind == AVGPIPE_OP_B,
                                  "S=%d M=%d rank %d: a pair is not (F;B)", S, M, r);
                    }
                    nf += o->kind == AVGPIPE_OP_F;
                    nb += o->kind == AVGPIPE_OP_B || o->kind == AVGPIPE_OP_I;
                }
                cr_assert_eq(pairs, want, "dualpipev S=%d M=%d rank %d: %d pairs, want %d", S, M, r, pairs, want);
                cr_assert_eq(nf, 2 * M);
                cr_assert_eq(nb, 2 * M);
                cr_assert_eq(res.rank[r].peak_stash, 2 * S + 1, "S=%d M=%d rank %d: peak %d", S, M, r, res.rank[r].peak_stash);
                cr_assert_eq(avgpipe_sched_peak_stash(&d, r), 2 * S + 1);
            }
            avgpipe_sim_result_free(NULL, &res);
            avgpipe_sched_free(NULL, &s);
        }
}
