/* avgpipe — the command-line front end of avgpipe.h: generate, validate, simulate, compare and render
   pipeline schedules.

       avgpipe sim       generate one schedule, validate it, simulate it, print its timeline and a summary
       avgpipe validate  check a schedule file (PyTorch CSV or avgpipe text) and point at the offending op
       avgpipe compare   one row per (schedule, K) for the same shape and costs, as a table or TSV
       avgpipe tune      fit a cost model to a runtime profile, rank every setting under a memory limit

   Exit status: 0 ok; 1 a schedule fails validation (tune: no setting fits the memory limit); 2 bad
   arguments, an unreadable or unparseable file, or an error from the library (its message is printed,
   on one line, on stderr).

   Build: gcc -std=c11 -O2 -Wall -Wextra -pedantic -Werror -I. tools/avgpipe.c -o build/avgpipe -lm */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CLI_MAX_KINDS 16   /* entries in a --schedule list */
#define CLI_MAX_K_RANGE 1000 /* values in an --advance range: each one is a full simulation */
/* Sizes the library accepts but this tool refuses: the validator and the simulator keep S x S
   channel tables and a few hundred bytes per (stage, micro-batch), so the library's own limits
   (32767 stages, 1.3e8 ops) would exhaust memory before they fail cleanly. */
#define CLI_MAX_STAGES 4096
#define CLI_MAX_ITEMS 10000000LL
#define CLI_MAX_INPUT ((size_t)1 << 30) /* bytes of a schedule on standard input: the library's cap for files */
#define CLI_EXIT_INVALID 1
#define CLI_EXIT_USAGE 2
/* tune: every candidate is a simulation of up to stages x pipes x batch x rounds ops. */
#define CLI_MAX_BATCH 65536
#define CLI_MAX_PIPES 64
#define CLI_MAX_TUNE_WORK 3e8 /* ops simulated by one search, summed over the candidates: about a minute */

enum { CMD_SIM = 1, CMD_VALIDATE = 2, CMD_COMPARE = 4, CMD_TUNE = 8, CMD_ALL = 15 };

/* Everything the command line says, with the defaults filled in before parsing. */
#define CLI_MAX_TIES 16

typedef struct cli_opts {
    unsigned cmd;
    avgpipe_sched_kind kinds[CLI_MAX_KINDS];
    int nkinds;
    int stages, micro, pipes, chunks, rounds, continuous;
    int adv_lo, adv_hi; /* --advance K is the range K..K */
    double cost_f, cost_b, cost_w;
    double latency, bytes, bandwidth;
    int blocking, width, tsv, quiet, lower, help;
    avgpipe_tie ties[CLI_MAX_TIES]; /* --tie A:B,...: tied stage pairs (avgpipe_sched_add_sync) */
    int nties, agree;
    double tie_bytes;
    const char *trace, *svg, *csv, *file;
    /* tune */
    const char *profile;
    int batch, top, max_pipes, no_continuous, max_advance, min_micro;
    double mem_limit, opt_bytes, cores;
    double noise_scale; /* --noise-scale: > 0 ranks by predicted time to target */
} cli_opts;

/* One evaluated schedule: a row of the compare table or of the TSV summary. */
typedef struct cli_row {
    avgpipe_sched_desc d; /* resolved by the library: what was actually generated */
    int valid;
    double makespan, bubble;
    int peak_max, peak0;
    char why[512]; /* the validator's message when valid == 0 */
} cli_row;

/* ---- errors ---------------------------------------------------------------------------------- */

/* Print "avgpipe: <message>" as one line on stderr. Library text may quote a file's bytes: control
   and non-ASCII bytes are written as \xNN so the message stays one readable line. */
static int cli_error(const char *fmt, ...) {
    char msg[1536];
    va_list ap;
    const unsigned char *p;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fputs("avgpipe: ", stderr);
    for (p = (const unsigned char *)msg; *p; p++) {
        if (*p >= 0x20 && *p < 0x7f) fputc(*p, stderr);
        else fprintf(stderr, "\\x%02x", *p);
    }
    fputc('\n', stderr);
    return CLI_EXIT_USAGE;
}

/* The library's detail for the last failed call on ctx (or the result's name when it left none). */
static int lib_error(const avgpipe_context *ctx) {
    const char *msg = avgpipe_last_error(ctx);
    if (!msg[0]) msg = avgpipe_result_string(avgpipe_last_result(ctx));
    return cli_error("%s", msg);
}

/* ---- numbers --------------------------------------------------------------------------------- */

/* A whole-string decimal integer that fits a long. No leading blanks, no trailing characters. */
static int parse_long(const char *s, long *out) {
    char *end;
    if (!s || !(*s == '-' || *s == '+' || (*s >= '0' && *s <= '9'))) return 0;
    errno = 0;
    *out = strtol(s, &end, 10);
    return errno == 0 && end != s && *end == '\0';
}

/* A whole-string finite floating-point number. */
static int parse_double(const char *s, double *out) {
    char *end;
    if (!s || !(*s == '-' || *s == '+' || *s == '.' || (*s >= '0' && *s <= '9'))) return 0;
    errno = 0;
    *out = strtod(s, &end);
    return errno == 0 && end != s && *end == '\0' && isfinite(*out);
}

/* ---- option table ---------------------------------------------------------------------------- */

typedef struct cli_flag cli_flag;
typedef int (*cli_parse_fn)(cli_opts *o, const cli_flag *f, const char *val);
struct cli_flag {
    const char *name;
    cli_parse_fn parse;
    size_t off;     /* field of cli_opts the generic parsers write */
    double lo, hi;  /* accepted range of numeric values */
    unsigned cmds;  /* CMD_* that accept the flag */
    const char *arg; /* NULL: a switch without a value */
    const char *help;
};

#define CLI_FIELD(o, f, type) ((type *)(void *)((char *)(o) + (f)->off))

static int set_switch(cli_opts *o, const cli_flag *f, const char *val) {
    (void)val;
    *CLI_FIELD(o, f, int) = 1;
    return 0;
}

static int set_int(cli_opts *o, const cli_flag *f, const char *val) {
    long v;
    if (!parse_long(val, &v) || v < f->lo || v > f->hi) {
        if (f->hi >= INT_MAX) return cli_error("%s: expected an integer >= %.0f, got '%s'", f->name, f->lo, val);
        return cli_error("%s: expected an integer from %.0f to %.0f, got '%s'", f->name, f->lo, f->hi, val);
    }
    *CLI_FIELD(o, f, int) = (int)v;
    return 0;
}

/* A number in [lo, hi] (lo is 0 for every number flag). */
static int set_num(cli_opts *o, const cli_flag *f, const char *val) {
    double v;
    if (!parse_double(val, &v) || !(v >= f->lo && v <= f->hi)) return cli_error("%s: expected a number >= 0, got '%s'", f->name, val);
    *CLI_FIELD(o, f, double) = v;
    return 0;
}

static int set_str(cli_opts *o, const cli_flag *f, const char *val) {
    if (!val[0]) return cli_error("%s: expected a file name, got ''", f->name);
    *CLI_FIELD(o, f, const char *) = val;
    return 0;
}

/* --tie A:B[,C:D...]: stage pairs, each a tie of their gradients (the stages are checked by the library). */
static int set_ties(cli_opts *o, const cli_flag *f, const char *val) {
    const char *p = val;
    (void)f;
    o->nties = 0;
    while (*p) {
        long a, b;
        char *end;
        if (o->nties == CLI_MAX_TIES) return cli_error("--tie: at most %d pairs", CLI_MAX_TIES);
        a = strtol(p, &end, 10);
        if (end == p || *end != ':' || a < 0 || a > INT_MAX) return cli_error("--tie: expected STAGE:STAGE[,STAGE:STAGE...], got '%s'", val);
        p = end + 1;
        b = strtol(p, &end, 10);
        if (end == p || (*end && *end != ',') || b < 0 || b > INT_MAX) return cli_error("--tie: expected STAGE:STAGE[,STAGE:STAGE...], got '%s'", val);
        memset(&o->ties[o->nties], 0, sizeof o->ties[0]);
        o->ties[o->nties].stage_a = (int)a;
        o->ties[o->nties].stage_b = (int)b;
        o->ties[o->nties].count = 1;
        o->nties++;
        p = *end ? end + 1 : end;
    }
    return o->nties ? 0 : cli_error("--tie: expected STAGE:STAGE[,STAGE:STAGE...], got ''");
}

/* A size in bytes: a whole number with an optional binary suffix K, M or G (KiB = 1024 bytes, MiB,
   GiB; "512M", "1.5G", "65536"); must be > 0. */
static int set_size(cli_opts *o, const cli_flag *f, const char *val) {
    char num[64];
    size_t n = strlen(val);
    double v, unit = 1;
    if (n > 0 && n < sizeof num) {
        switch (val[n - 1]) {
        case 'K': case 'k': unit = 1024.0; break;
        case 'M': case 'm': unit = 1024.0 * 1024; break;
        case 'G': case 'g': unit = 1024.0 * 1024 * 1024; break;
        default: break;
        }
    }
    if (n == 0 || n >= sizeof num) return cli_error("%s: expected a size such as 65536, 512K, 64M or 2G, got '%s'", f->name, val);
    memcpy(num, val, n + 1);
    if (unit > 1) num[n - 1] = '\0';
    if (!parse_double(num, &v) || !(v * unit >= 1) || v * unit > 1e18)
        return cli_error("%s: expected a size >= 1 byte such as 65536, 512K, 64M or 2G, got '%s'", f->name, val);
    *CLI_FIELD(o, f, double) = v * unit;
    return 0;
}

static int set_summary(cli_opts *o, const cli_flag *f, const char *val) {
    if (strcmp(val, "tsv") == 0) o->tsv = 1;
    else if (strcmp(val, "table") == 0) o->tsv = 0;
    else return cli_error("%s: expected 'table' or 'tsv', got '%s'", f->name, val);
    return 0;
}

/* A comma list of generator names: "afab,1f1b,advance". */
static int set_schedule(cli_opts *o, const cli_flag *f, const char *val) {
    const char *p = val;
    o->nkinds = 0;
    for (;;) {
        char name[32];
        size_t n = strcspn(p, ",");
        avgpipe_sched_kind k;
        if (n == 0 || n >= sizeof name)
            return cli_error("%s: expected a comma list of afab, 1f1b, advance, interleaved, zbh1, zbv, dualpipev, got '%s'", f->name, val);
        memcpy(name, p, n);
        name[n] = '\0';
        if (avgpipe_sched_kind_parse(name, &k) != AVGPIPE_OK || k == AVGPIPE_SCHED_CUSTOM)
            return cli_error("%s: unknown schedule '%s' (expected afab, 1f1b, advance, interleaved, zbh1, zbv or dualpipev)", f->name, name);
        if (o->nkinds == CLI_MAX_KINDS) return cli_error("%s: at most %d schedules", f->name, CLI_MAX_KINDS);
        o->kinds[o->nkinds++] = k;
        if (!p[n]) return 0;
        p += n + 1;
    }
}

/* K or, for compare, A..B. */
static int set_advance(cli_opts *o, const cli_flag *f, const char *val) {
    const char *dots = strstr(val, "..");
    char left[32];
    long a, b;
    if (!dots) {
        if (!parse_long(val, &a) || a < 0 || a > INT_MAX)
            return cli_error("%s: expected an integer >= 0, got '%s'", f->name, val);
        o->adv_lo = o->adv_hi = (int)a;
        return 0;
    }
    if (o->cmd != CMD_COMPARE) return cli_error("%s: a range is accepted by compare only, got '%s'", f->name, val);
    if ((size_t)(dots - val) >= sizeof left) return cli_error("%s: malformed range '%s' (expected A..B)", f->name, val);
    memcpy(left, val, (size_t)(dots - val));
    left[dots - val] = '\0';
    if (!parse_long(left, &a) || !parse_long(dots + 2, &b) || a < 0 || b > INT_MAX || a > b)
        return cli_error("%s: malformed range '%s' (expected A..B with 0 <= A <= B)", f->name, val);
    if (b - a >= CLI_MAX_K_RANGE) return cli_error("%s: range '%s' has more than %d values", f->name, val, CLI_MAX_K_RANGE);
    o->adv_lo = (int)a;
    o->adv_hi = (int)b;
    return 0;
}

#define OFF(field) offsetof(cli_opts, field)
#define SC (CMD_SIM | CMD_COMPARE)
#define T CMD_TUNE
static const cli_flag cli_flags[] = {
    {"--profile", set_str, OFF(profile), 0, 0, T, "FILE", "runtime profile (avgpipe_run_write/append_profile), two micro-batch sizes"},
    {"--batch", set_int, OFF(batch), 1, CLI_MAX_BATCH, T, "B", "samples per batch of one pipeline (required)"},
    {"--mem-limit", set_size, OFF(mem_limit), 0, 0, T, "SIZE", "bytes per rank (required); suffix K, M, G = KiB, MiB, GiB (x1024)"},
    {"--top", set_int, OFF(top), 0, INT_MAX, T, "N", "rows to print, best first; 0 = all (default 10)"},
    {"--max-pipes", set_int, OFF(max_pipes), 1, CLI_MAX_PIPES, T, "N", "parallel pipelines tried: 1..N (default 4)"},
    {"--opt-bytes-per-param", set_num, OFF(opt_bytes), 0, 1e6, T, "X", "optimizer state per parameter and pipeline (Adam: 8; default 0)"},
    {"--no-continuous", set_switch, OFF(no_continuous), 0, 0, T, NULL, "synchronous rounds only (default: both round modes)"},
    {"--max-advance", set_int, OFF(max_advance), 0, INT_MAX, T, "K", "largest K of advance tried (default 0: up to all forwards first)"},
    {"--cores", set_num, OFF(cores), 0, 1e6, T, "C", "cores the ranks' stage threads share (CPU); 0 = one per rank (default)"},
    {"--noise-scale", set_num, OFF(noise_scale), 0, 1e18, T, "B", "the model's gradient noise scale in samples: rank by predicted time to\n"
     "                           target, time per sample x (1 + N x batch / B) (default 0: by time per sample)"},
    {"--min-micro", set_int, OFF(min_micro), 1, CLI_MAX_BATCH, T, "SAMPLES", "smallest micro-batch tried, in samples (default 1)"},
    {"--schedule", set_schedule, 0, 0, 0, SC | T, "NAME", "afab|1f1b|advance|interleaved|zbh1|zbv|dualpipev; compare and tune take a comma list"},
    {"--stages", set_int, OFF(stages), 1, INT_MAX, SC | T, "S", "pipeline stages = ranks (default 4; tune: the profile's, and with\n"
     "                           'layer' lines in the profile the partitioner splits the layers into S)"},
    {"--micro", set_int, OFF(micro), 1, INT_MAX, SC, "M", "micro-batches per batch (default 8)"},
    {"--pipes", set_int, OFF(pipes), 1, 32767, SC, "N", "parallel pipelines (default 1)"},
    {"--chunks", set_int, OFF(chunks), 1, INT_MAX, SC, "V", "model chunks per rank, interleaved only (default 2; zbv and dualpipev hold 2 in a V)"},
    {"--advance", set_advance, 0, 0, 0, SC, "K", "extra warm-up forwards of advance; compare: K or a range A..B"},
    {"--rounds", set_int, OFF(rounds), 1, INT_MAX, SC | T, "R", "rounds (per iteration for tune; default 1)"},
    {"--continuous", set_switch, OFF(continuous), 0, 0, SC, NULL, "continuous rounds (default synchronous)"},
    {"--cost-f", set_num, OFF(cost_f), 0, 1e12, SC, "T", "forward time of a stage (default 1)"},
    {"--cost-b", set_num, OFF(cost_b), 0, 1e12, SC, "T", "full backward time (default 2)"},
    {"--cost-w", set_num, OFF(cost_w), 0, 1e12, SC, "T", "time of I and of W, split backward halves (default 1)"},
    {"--comm-latency", set_num, OFF(latency), 0, 1e12, SC, "T", "latency per transfer (default 0)"},
    {"--comm-bytes", set_num, OFF(bytes), 0, 1e18, SC, "B", "bytes per transfer (default 0)"},
    {"--bandwidth", set_num, OFF(bandwidth), 0, 1e18, SC, "B/T", "link bandwidth; 0 = no bandwidth term (default)"},
    {"--blocking-send", set_switch, OFF(blocking), 0, 0, SC, NULL, "blocking sends (default asynchronous)"},
    {"--tie", set_ties, 0, 0, 0, SC, "A:B,...", "tie the gradients of stages A and B (GPT-2's embedding: 0:G-1) before the STEPs"},
    {"--agree", set_switch, OFF(agree), 0, 0, SC, NULL, "step agreement (global-norm clipping) across each pipeline's stages"},
    {"--tie-bytes", set_num, OFF(tie_bytes), 0, 1e18, SC, "B", "bytes a tie between two ranks exchanges each way (default 0)"},
    {"--trace", set_str, OFF(trace), 0, 0, CMD_SIM, "FILE", "write a Chrome trace JSON (ui.perfetto.dev)"},
    {"--svg", set_str, OFF(svg), 0, 0, CMD_SIM, "FILE", "write an SVG timeline"},
    {"--csv", set_str, OFF(csv), 0, 0, CMD_SIM, "FILE", "write the generated compute schedule as text/CSV"},
    {"--width", set_int, OFF(width), 10, 100000, CMD_SIM, "N", "columns of the ASCII timeline (default 100)"},
    {"--summary", set_summary, 0, 0, 0, SC | T, "FMT", "table (default) or tsv: a header line, one row per schedule"},
    {"--quiet", set_switch, OFF(quiet), 0, 0, CMD_SIM | CMD_VALIDATE, NULL, "sim: no timeline; validate: exit status only"},
    {"--lower", set_switch, OFF(lower), 0, 0, CMD_VALIDATE, NULL, "also print the schedule with SEND/RECV ops"},
    {"--help", set_switch, OFF(help), 0, 0, CMD_ALL, NULL, "print this help"},
};
#undef T
#undef SC
#undef OFF
#define CLI_NFLAGS (sizeof cli_flags / sizeof cli_flags[0])

/* ---- command line ---------------------------------------------------------------------------- */

typedef struct cli_command {
    const char *name;
    unsigned cmd;
    const char *args, *about, *notes;
} cli_command;

static const cli_command cli_commands[] = {
    {"sim", CMD_SIM, "[options]", "generate, validate and simulate a schedule; print its timeline and a summary",
     "Defaults: --schedule advance --stages 4 --micro 8 --advance 0 (K = 0 is 1F1B).\n"
     "Shapes: interleaved with V > 1 needs M a multiple of S; dualpipev needs M x N >= 2 x S; --advance applies to\n"
     "advance and zbv. Every kind: S x V <= 32767, N <= 32767, S x V x N x M x R <= 1.3e8.\n"
     "Costs are per stage; an op of an interleaved chunk costs 1/V of it. The summary gives the makespan, the\n"
     "bubble (idle share of all ranks' time) and per rank busy, idle, blocked time and peak stashed activations.\n"
     "Exit status: 0 ok, 1 the generated schedule fails validation, 2 bad arguments or a library error.\n"},
    {"validate", CMD_VALIDATE, "[options] FILE", "check a schedule file (PyTorch CSV or avgpipe text; '-' = stdin)",
     "Prints 'valid: ...', or the validator's message and the op grid around the offending op (>op<).\n"
     "A schedule is text: a file with a NUL or another control byte is refused at that byte.\n"
     "Exit status: 0 valid, 1 invalid, 2 bad arguments or a file that cannot be read or parsed.\n"},
    {"compare", CMD_COMPARE, "[options]", "simulate several schedules (and a range of K) side by side",
     "Defaults: --schedule afab,1f1b,advance,zbh1 --stages 4 --micro 8 --advance 0.\n"
     "--advance A..B gives one row per K for advance (other schedules get one row); --chunks applies to\n"
     "interleaved only. TSV columns: schedule stages micro pipes chunks advance makespan bubble peak_act_max\n"
     "peak_act_stage0 valid rounds continuous (bubble a fraction; peak_act_* the simulator's peak stash).\n"
     "Exit status: 0 ok, 1 a schedule fails validation, 2 bad arguments or a library error.\n"},
    {"tune", CMD_TUNE, "--profile FILE --batch B --mem-limit SIZE [options]",
     "fit a cost model to a runtime profile and rank every setting (schedule, M, N, K, round mode)",
     "The profile is what avgpipe_run_write_profile / avgpipe_run_append_profile write: profile one setting\n"
     "at two micro-batch sizes (two sections in one file) so that each stage's op time is fitted as\n"
     "a + b x samples per micro-batch; with one size the times are taken as proportional to the samples.\n"
     "Every candidate (default schedules afab, 1f1b, advance with each K that changes a warm-up, zbh1;\n"
     "M a divisor of B; N = 1..--max-pipes; synchronous and continuous rounds) is simulated with the\n"
     "fitted costs; its memory per rank is the runtime's boundary buffers and averaging buffers plus N x\n"
     "parameters x (4 + --opt-bytes-per-param) bytes. Candidates that fit --mem-limit come first, each\n"
     "group fastest per sample first. Sizes: plain bytes or a suffix K, M, G (binary: 1K = 1024 bytes).\n"
     "With 'layer' lines in the profile (per-layer costs: avgpipe.h section 20) the stage partitioner picks\n"
     "the split of the layers into --stages partitions jointly with the setting (every split's best setting,\n"
     "splits bounded out by their least possible time), prints it and what bounds the model: the busiest\n"
     "stage's share of the work; the ranking is that split's.\n"
     "TSV columns: rank schedule micro pipes advance continuous samples pred_time_per_sample pred_seconds\n"
     "pred_peak_bytes fits (times in seconds; pred_seconds is one iteration of R rounds), with --noise-scale\n"
     "efficiency pred_time_to_target (per sample of ideal progress), and with 'layer' lines split (layers\n"
     "per stage, e.g. 1,3). --noise-scale B (the model's, e.g. from avgpipe_tune_noise_scale on its gradient\n"
     "norms) ranks by predicted time to target instead: time per sample x (1 + N x batch / B).\n"
     "Exit status: 0 ok, 1 no setting fits the memory limit, 2 bad arguments, a profile that cannot be\n"
     "read or parsed (the message names the line), or a library error.\n"},
};
#define CLI_NCOMMANDS (sizeof cli_commands / sizeof cli_commands[0])

static void print_usage(FILE *f) {
    size_t i;
    fprintf(f, "usage: avgpipe COMMAND [options]\n       avgpipe --help | --version\n\ncommands:\n");
    for (i = 0; i < CLI_NCOMMANDS; i++) fprintf(f, "  %-10s %s\n", cli_commands[i].name, cli_commands[i].about);
    fprintf(f, "\n'avgpipe COMMAND --help' lists the options of a command.\n"
               "Exit status: 0 ok, 1 a schedule fails validation (tune: nothing fits the memory limit),\n"
               "2 bad arguments or input.\n");
}

static void print_command_help(const cli_command *c) {
    size_t i;
    printf("usage: avgpipe %s %s\n%s\n\noptions:\n", c->name, c->args, c->about);
    for (i = 0; i < CLI_NFLAGS; i++) {
        const char *arg = cli_flags[i].arg;
        char lhs[48];
        if (!(cli_flags[i].cmds & c->cmd)) continue;
        snprintf(lhs, sizeof lhs, "%s%s%s", cli_flags[i].name, arg ? " " : "", arg ? arg : "");
        printf("  %-24s %s\n", lhs, cli_flags[i].help);
    }
    printf("\n%s", c->notes);
}

static const cli_flag *find_flag(const char *name, size_t len) {
    size_t i;
    for (i = 0; i < CLI_NFLAGS; i++)
        if (strlen(cli_flags[i].name) == len && strncmp(cli_flags[i].name, name, len) == 0) return &cli_flags[i];
    return NULL;
}

/* One option at argv[*i] ("--name value" or "--name=value"); advances *i past its value. */
static int parse_flag(cli_opts *o, int argc, char **argv, int *i) {
    const char *arg = argv[*i], *eq = strchr(arg, '='), *val = NULL;
    size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
    const cli_flag *f = find_flag(arg, len);
    if (!f) return cli_error("unknown option '%.*s' (see 'avgpipe %s --help')", (int)len, arg, argv[1]);
    if (!(f->cmds & o->cmd)) return cli_error("%s: not an option of '%s'", f->name, argv[1]);
    if (!f->arg) {
        if (eq) return cli_error("%s: takes no value", f->name);
        return f->parse(o, f, NULL);
    }
    if (eq) val = eq + 1;
    else if (*i + 1 < argc) val = argv[++*i];
    else return cli_error("%s: missing value (%s)", f->name, f->arg);
    return f->parse(o, f, val);
}

static void default_opts(cli_opts *o, unsigned cmd) {
    memset(o, 0, sizeof *o);
    o->cmd = cmd;
    o->stages = 4;
    o->micro = 8;
    o->width = 100;
    o->pipes = 1;
    o->rounds = 1;
    o->cost_f = 1;
    o->cost_b = 2;
    o->cost_w = 1;
    o->top = 10;
    o->max_pipes = 4;
    if (cmd == CMD_TUNE) o->stages = 0; /* the profile's */
}

/* Parse argv[2..] into *o. Returns 0 or CLI_EXIT_USAGE (message printed). Stops at --help. */
static int parse_args(cli_opts *o, int argc, char **argv) {
    int i, rc;
    for (i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0) a = "--help";
        if (a[0] == '-' && a[1] == '-') {
            if (strcmp(a, "--help") == 0) {
                o->help = 1; /* at once: the rest of the line may be what the user needs help with */
                return 0;
            }
            if ((rc = parse_flag(o, argc, argv, &i)) != 0) return rc;
        } else if (a[0] == '-' && a[1] != '\0') {
            return cli_error("unknown option '%s' (see 'avgpipe %s --help')", a, argv[1]);
        } else if (o->cmd == CMD_VALIDATE && !o->file) {
            o->file = a;
        } else {
            return cli_error("unexpected argument '%s' (see 'avgpipe %s --help')", a, argv[1]);
        }
    }
    if (o->cmd == CMD_VALIDATE && !o->file) return cli_error("validate: missing FILE (see 'avgpipe validate --help')");
    if (o->cmd == CMD_TUNE) {
        const char *missing = !o->profile ? "--profile FILE" : !o->batch ? "--batch B" : o->mem_limit <= 0 ? "--mem-limit SIZE" : NULL;
        if (missing) return cli_error("tune: missing %s (see 'avgpipe tune --help')", missing);
    }
    return 0;
}

/* ---- evaluation ------------------------------------------------------------------------------ */

static avgpipe_sched_desc make_sched_desc(const cli_opts *o, avgpipe_sched_kind kind, int k) {
    avgpipe_sched_desc d;
    memset(&d, 0, sizeof d);
    d.kind = kind;
    d.stages = o->stages;
    d.micro = o->micro;
    d.pipes = o->pipes;
    d.chunks = o->chunks;
    d.rounds = o->rounds;
    d.advance = k;
    d.continuous = o->continuous;
    if (avgpipe_sched_kind_query(kind)->chunks != 0 && (o->cmd == CMD_COMPARE || avgpipe_sched_kind_query(kind)->chunks > 1))
        d.chunks = 0; /* --chunks is for the kinds that take any (interleaved); the others hold their own count */
    return d;
}

/* The --cost-* times are those of one stage's share of the model; a rank holding V chunks of an
   interleaved schedule runs 1/V of that share per op, so schedules compare at equal work. */
static avgpipe_sim_desc make_sim_desc(const cli_opts *o, int record, int chunks) {
    avgpipe_sim_desc d;
    memset(&d, 0, sizeof d);
    d.cost[AVGPIPE_OP_F] = o->cost_f > 0 ? o->cost_f / chunks : AVGPIPE_ZERO; /* --cost-x 0: free, not the default */
    d.cost[AVGPIPE_OP_B] = o->cost_b > 0 ? o->cost_b / chunks : AVGPIPE_ZERO;
    d.cost[AVGPIPE_OP_I] = o->cost_w > 0 ? o->cost_w / chunks : AVGPIPE_ZERO;
    d.cost[AVGPIPE_OP_W] = o->cost_w > 0 ? o->cost_w / chunks : AVGPIPE_ZERO;
    d.latency = o->latency;
    d.bytes = o->bytes;
    d.bandwidth = o->bandwidth;
    d.blocking_send = o->blocking;
    d.tie_bytes = o->tie_bytes;
    d.record_events = record;
    return d;
}

static void fill_row_stats(cli_row *row, const avgpipe_sim_result *r) {
    int i;
    row->makespan = r->makespan;
    row->bubble = r->bubble;
    row->peak0 = r->nranks > 0 ? r->rank[0].peak_stash : 0;
    row->peak_max = 0;
    for (i = 0; i < r->nranks; i++)
        if (r->rank[i].peak_stash > row->peak_max) row->peak_max = r->rank[i].peak_stash;
}

/* This tool's own size limits (see CLI_MAX_STAGES). Checked in double before the library sees the
   description too: avgpipe_sched_resolve multiplies the sizes in long long before it bounds them. */
static int check_size(const avgpipe_sched_desc *d) {
    double g = (double)d->stages * (d->chunks > 1 ? d->chunks : 1), items = g * d->pipes * d->micro * d->rounds;
    if (g > CLI_MAX_STAGES) return cli_error("stages x chunks = %.0f: this tool simulates at most %d", g, CLI_MAX_STAGES);
    if (items > (double)CLI_MAX_ITEMS)
        return cli_error("stages x chunks x pipes x micro x rounds = %.0f: this tool simulates at most %lld", items,
                         CLI_MAX_ITEMS);
    return 0;
}

/* Generate, validate and simulate one schedule. A schedule that fails validation is a row with
   valid = 0 (and no numbers when it cannot be simulated either), not an error. On success the caller
   owns *s and *r. Returns 0, or CLI_EXIT_USAGE after printing the library's message. */
static int evaluate(avgpipe_context *ctx, const cli_opts *o, avgpipe_sched_kind kind, int k, int record,
                    avgpipe_schedule *s, avgpipe_sim_result *r, cli_row *row) {
    avgpipe_sched_desc d = make_sched_desc(o, kind, k);
    avgpipe_sim_desc sd;
    avgpipe_validate_report rep;
    memset(row, 0, sizeof *row);
    memset(r, 0, sizeof *r);
    if (check_size(&d) != 0) return CLI_EXIT_USAGE;
    if (avgpipe_sched_resolve(ctx, &d, &row->d) != AVGPIPE_OK) return lib_error(ctx);
    if (check_size(&row->d) != 0) return CLI_EXIT_USAGE;
    sd = make_sim_desc(o, record, row->d.chunks);
    if (avgpipe_sched_generate(ctx, &d, s) != AVGPIPE_OK) return lib_error(ctx);
    if (o->nties || o->agree) { /* ties and agreement, placed with the same op costs */
        avgpipe_sync_desc sy;
        avgpipe_schedule synced;
        memset(&sy, 0, sizeof sy);
        sy.ties = o->ties;
        sy.nties = o->nties;
        sy.agree = o->agree;
        sy.cost_f = sd.cost[AVGPIPE_OP_F];
        sy.cost_b = sd.cost[AVGPIPE_OP_B];
        sy.cost_i = sd.cost[AVGPIPE_OP_I];
        sy.cost_w = sd.cost[AVGPIPE_OP_W];
        if (avgpipe_sched_add_sync(ctx, s, &sy, &synced) != AVGPIPE_OK) {
            avgpipe_sched_free(ctx, s);
            return lib_error(ctx);
        }
        avgpipe_sched_free(ctx, s);
        *s = synced;
    }
    avgpipe_sched_validate(ctx, s, NULL, &rep);
    row->valid = rep.result == AVGPIPE_OK;
    row->makespan = row->bubble = NAN;
    if (!row->valid && rep.result != AVGPIPE_INVALID_SCHEDULE && rep.result != AVGPIPE_DEADLOCK) {
        avgpipe_sched_free(ctx, s);
        return lib_error(ctx);
    }
    if (!row->valid) snprintf(row->why, sizeof row->why, "%s", rep.message);
    if (avgpipe_sim_run(ctx, s, &sd, r) == AVGPIPE_OK) {
        fill_row_stats(row, r);
        return 0;
    }
    if (!row->valid) return 0; /* already explained by the validator */
    avgpipe_sched_free(ctx, s);
    return lib_error(ctx);
}

/* ---- output ---------------------------------------------------------------------------------- */

static void print_tsv_header(void) {
    printf("schedule\tstages\tmicro\tpipes\tchunks\tadvance\tmakespan\tbubble\tpeak_act_max\tpeak_act_stage0\tvalid\t"
           "rounds\tcontinuous\n");
}

static void print_tsv_row(const cli_row *w) {
    const avgpipe_sched_desc *d = &w->d;
    printf("%s\t%d\t%d\t%d\t%d\t%d\t", avgpipe_sched_kind_name(d->kind), d->stages, d->micro, d->pipes, d->chunks, d->advance);
    if (isnan(w->makespan)) printf("-\t-\t-\t-\t");
    else printf("%.10g\t%.4f\t%d\t%d\t", w->makespan, w->bubble, w->peak_max, w->peak0);
    printf("%d\t%d\t%d\n", w->valid, d->rounds, d->continuous);
}

static void print_shape_line(const cli_opts *o) {
    printf("S=%d M=%d N=%d R=%d %s rounds, %s sends; costs F=%g B=%g I=W=%g; transfer latency %g", o->stages, o->micro,
           o->pipes, o->rounds, o->continuous ? "continuous" : "synchronous", o->blocking ? "blocking" : "async", o->cost_f,
           o->cost_b, o->cost_w, o->latency);
    if (o->bandwidth > 0) printf(" + %g bytes / %g bytes per unit", o->bytes, o->bandwidth);
    printf("\n");
}

static void print_table_header(void) {
    printf("%-12s %3s %6s %12s %8s %12s %14s %6s\n", "schedule", "V", "K", "makespan", "bubble", "peak_act_max",
           "peak_act_rank0", "valid");
}

static void print_table_row(const cli_row *w) {
    const avgpipe_sched_desc *d = &w->d;
    printf("%-12s %3d %6d ", avgpipe_sched_kind_name(d->kind), d->chunks, d->advance);
    if (isnan(w->makespan)) printf("%12s %8s %12s %14s", "-", "-", "-", "-");
    else printf("%12.10g %7.2f%% %12d %14d", w->makespan, 100 * w->bubble, w->peak_max, w->peak0);
    printf(" %6s\n", w->valid ? "yes" : "NO");
}

/* Per-rank statistics of a simulation. */
static void print_sim_summary(const cli_row *w, const avgpipe_sim_result *r) {
    int i;
    const avgpipe_sched_desc *d = &w->d;
    printf("%s: S=%d M=%d N=%d V=%d R=%d K=%d\n", avgpipe_sched_kind_name(d->kind), d->stages, d->micro, d->pipes, d->chunks,
           d->rounds, d->advance);
    printf("makespan %.10g, bubble %.2f%%, %lld ops, %lld transfers\n", r->makespan, 100 * r->bubble, r->ops, r->transfers);
    printf("%-6s %12s %12s %12s %9s\n", "rank", "busy", "idle", "blocked", "peak_act");
    for (i = 0; i < r->nranks; i++)
        printf("%-6d %12.10g %12.10g %12.10g %9d\n", i, r->rank[i].busy, r->rank[i].idle, r->rank[i].blocked,
               r->rank[i].peak_stash);
}

static int write_file(const char *path, const avgpipe_buf *b) {
    FILE *f = fopen(path, "wb");
    int ok;
    if (!f) return cli_error("cannot create '%s': %s", path, strerror(errno));
    ok = fwrite(b->data, 1, b->len, f) == b->len;
    ok &= fclose(f) == 0;
    return ok ? 0 : cli_error("cannot write '%s'", path);
}

typedef avgpipe_result (*cli_render_fn)(avgpipe_context *, const avgpipe_event *, size_t, int, const avgpipe_render_desc *,
                                        avgpipe_buf *);

/* Render the simulation's events with fn, into path, or onto stdout when path is NULL. */
static int render(avgpipe_context *ctx, cli_render_fn fn, const avgpipe_sim_result *r, const avgpipe_render_desc *rd,
                  const char *path) {
    avgpipe_buf b = {NULL, 0, 0};
    int rc = 0;
    if (fn(ctx, r->events, r->nevents, r->nranks, rd, &b) != AVGPIPE_OK) rc = lib_error(ctx);
    else if (path) rc = write_file(path, &b);
    else if (b.data) fputs(b.data, stdout);
    avgpipe_buf_free(ctx, &b);
    return rc;
}

/* ---- commands -------------------------------------------------------------------------------- */

/* The files and the timeline of `sim`, after a successful evaluation. */
static int sim_outputs(avgpipe_context *ctx, const cli_opts *o, const avgpipe_schedule *s, const avgpipe_sim_result *r,
                       const cli_row *w) {
    avgpipe_render_desc rd;
    char title[160];
    int rc = 0;
    memset(&rd, 0, sizeof rd);
    snprintf(title, sizeof title, "%s S=%d M=%d N=%d V=%d R=%d K=%d", avgpipe_sched_kind_name(w->d.kind), w->d.stages,
             w->d.micro, w->d.pipes, w->d.chunks, w->d.rounds, w->d.advance);
    rd.title = title;
    rd.width = o->width;
    if (o->csv && avgpipe_sched_save(ctx, s, 0, o->csv) != AVGPIPE_OK) return lib_error(ctx);
    if (o->trace && (rc = render(ctx, avgpipe_render_chrome, r, &rd, o->trace)) != 0) return rc;
    if (o->svg && (rc = render(ctx, avgpipe_render_svg, r, &rd, o->svg)) != 0) return rc;
    if (o->tsv) {
        print_tsv_header();
        print_tsv_row(w);
        return 0;
    }
    if (!o->quiet) {
        rd.title = NULL; /* the summary below names the schedule */
        if ((rc = render(ctx, avgpipe_render_ascii, r, &rd, NULL)) != 0) return rc;
        printf("\n");
    }
    print_sim_summary(w, r);
    return 0;
}

static int cmd_sim(avgpipe_context *ctx, const cli_opts *o) {
    avgpipe_schedule s;
    avgpipe_sim_result r;
    cli_row w;
    int rc, record;
    if (o->nkinds != 1) return cli_error("--schedule: sim takes one schedule (compare takes a list)");
    /* events: every one for the trace and the SVG; for the ASCII timeline only those it draws */
    record = o->trace || o->svg ? AVGPIPE_SIM_EVENTS_ALL : o->tsv || o->quiet ? 0 : AVGPIPE_SIM_EVENTS_TIMED;
    if ((rc = evaluate(ctx, o, o->kinds[0], o->adv_lo, record, &s, &r, &w)) != 0) return rc;
    if (!w.valid) {
        rc = CLI_EXIT_INVALID;
        fprintf(stderr, "avgpipe: the generated schedule fails validation: %s\n", w.why);
    } else {
        rc = sim_outputs(ctx, o, &s, &r, &w);
    }
    avgpipe_sim_result_free(ctx, &r);
    avgpipe_sched_free(ctx, &s);
    return rc;
}

static int cmd_compare(avgpipe_context *ctx, const cli_opts *o) {
    int i, k, rc = 0, invalid = 0;
    if (o->tsv) print_tsv_header();
    else {
        print_shape_line(o);
        print_table_header();
    }
    for (i = 0; i < o->nkinds && !rc; i++) {
        int hi = o->kinds[i] == AVGPIPE_SCHED_ADVANCE ? o->adv_hi : o->adv_lo;
        for (k = o->adv_lo; k <= hi && !rc; k++) {
            avgpipe_schedule s;
            avgpipe_sim_result r;
            cli_row w;
            if ((rc = evaluate(ctx, o, o->kinds[i], k, 0, &s, &r, &w)) != 0) break;
            if (o->tsv) print_tsv_row(&w);
            else print_table_row(&w);
            if (!w.valid) {
                invalid = 1;
                fprintf(stderr, "avgpipe: %s K=%d fails validation: %s\n", avgpipe_sched_kind_name(w.d.kind), w.d.advance,
                        w.why);
            }
            avgpipe_sim_result_free(ctx, &r);
            avgpipe_sched_free(ctx, &s);
        }
    }
    return rc ? rc : invalid ? CLI_EXIT_INVALID : 0;
}

/* Read all of a stream (for '-'), at most CLI_MAX_INPUT bytes of text: the running total is checked
   before the buffer grows, and each byte as it arrives (a NUL or another control character is refused
   at once, so '</dev/zero' stops in its first 64 KiB). NULL (and the reason printed) on a read error,
   input that is not text or over the cap, or out of memory. */
static char *read_stream(FILE *f, size_t *len) {
    size_t cap = (size_t)1 << 16, n = 0, k, got;
    char *buf = (char *)malloc(cap), *p;
    while (buf) {
        got = fread(buf + n, 1, cap - n, f);
        for (k = n; k < n + got; k++) { /* text only, as the library reads files: '</dev/zero' stops here */
            unsigned char c = (unsigned char)buf[k];
            if ((c < 0x20 && (c < 0x09 || c > 0x0d)) || c == 0x7f) {
                cli_error("the standard input is not a schedule (text): byte %zu is 0x%02x", k, (unsigned)c);
                free(buf);
                return NULL;
            }
        }
        n += got;
        if (n < cap) break; /* end of input or an error */
        if (cap > CLI_MAX_INPUT) { /* holds more than the cap: refuse before growing */
            cli_error("the standard input is over 1 GiB (%zu bytes), the most a schedule file may hold", CLI_MAX_INPUT);
            free(buf);
            return NULL;
        }
        /* double, but to at most one byte over the cap (enough to see that the input passes it) */
        p = (char *)realloc(buf, 2 * cap <= CLI_MAX_INPUT ? 2 * cap : CLI_MAX_INPUT + 1);
        if (p == NULL) break;
        buf = p;
        cap = 2 * cap <= CLI_MAX_INPUT ? 2 * cap : CLI_MAX_INPUT + 1;
    }
    if (!buf || n == cap || ferror(f)) {
        cli_error(buf ? "cannot read the standard input: %s" : "cannot read the standard input: out of memory", strerror(errno));
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

static int load_schedule(avgpipe_context *ctx, const char *path, avgpipe_schedule *s) {
    char *text;
    size_t len = 0;
    avgpipe_result res;
    int rc = 0;
    if (strcmp(path, "-") != 0) {
        FILE *f = fopen(path, "rb"); /* first, for the system's reason (the library names none) */
        int bad = !f || (fgetc(f) == EOF && ferror(f));
        if (bad) rc = cli_error("cannot read '%s': %s", path, strerror(errno));
        if (f) fclose(f);
        if (bad) return rc;
        return avgpipe_sched_load(ctx, path, s) == AVGPIPE_OK ? 0 : lib_error(ctx);
    }
    if ((text = read_stream(stdin, &len)) == NULL) return CLI_EXIT_USAGE;
    res = avgpipe_sched_import(ctx, text, len, s);
    free(text);
    return res == AVGPIPE_OK ? 0 : cli_error("<stdin>: %s", avgpipe_last_error(ctx));
}

static long long count_ops(const avgpipe_schedule *s) {
    long long n = 0;
    int r, i;
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++) n += s->ops[r][i].kind != AVGPIPE_OP_IDLE;
    return n;
}

/* The schedule with its SEND/RECV ops (one that already has them is printed as it is). */
static int print_lowered(avgpipe_context *ctx, const avgpipe_schedule *s) {
    avgpipe_schedule low;
    avgpipe_buf b = {NULL, 0, 0};
    int rc = 0;
    memset(&low, 0, sizeof low);
    if (!s->has_comm && avgpipe_sched_lower(ctx, s, &low) != AVGPIPE_OK) return lib_error(ctx);
    if (avgpipe_sched_export(ctx, s->has_comm ? s : &low, 0, &b) != AVGPIPE_OK) rc = lib_error(ctx);
    else if (b.data) fputs(b.data, stdout);
    avgpipe_buf_free(ctx, &b);
    avgpipe_sched_free(ctx, &low);
    return rc;
}

/* The verdict for a schedule that fails validation: the message, then the grid with the op marked. */
static int print_invalid(avgpipe_context *ctx, const avgpipe_schedule *s, const avgpipe_validate_report *rep) {
    avgpipe_buf b = {NULL, 0, 0};
    int mark = rep->pos >= 0 ? rep->rank : -1, r, longest = 0;
    printf("invalid: %s\n", rep->message);
    for (r = 0; r < s->nranks; r++)
        if (s->len[r] > longest) longest = s->len[r];
    if (mark < 0 && longest > 4 * AVGPIPE_GRID_WINDOW) { /* no op to show a window around: no megabyte lines either */
        printf("(the error names no op; the grid of %d positions is not drawn: avgpipe sim --trace draws the timeline)\n", longest);
        return CLI_EXIT_INVALID;
    }
    if (avgpipe_sched_render_grid(ctx, s, mark, rep->pos, &b) != AVGPIPE_OK) return lib_error(ctx);
    if (b.data) fputs(b.data, stdout);
    avgpipe_buf_free(ctx, &b);
    return CLI_EXIT_INVALID;
}

static int cmd_validate(avgpipe_context *ctx, const cli_opts *o) {
    avgpipe_schedule s;
    avgpipe_validate_report rep;
    const avgpipe_sched_desc *sh = &s.shape;
    int rc = 0;
    if ((rc = load_schedule(ctx, o->file, &s)) != 0) return rc;
    if (s.nranks > CLI_MAX_STAGES) { /* a few bytes of text can ask the validator for S x S tables */
        rc = cli_error("%s: %d ranks: this tool validates at most %d", o->file, s.nranks, CLI_MAX_STAGES);
        avgpipe_sched_free(ctx, &s);
        return rc;
    }
    avgpipe_sched_validate(ctx, &s, NULL, &rep);
    if (rep.result == AVGPIPE_INVALID_SCHEDULE || rep.result == AVGPIPE_DEADLOCK) {
        if (o->quiet) rc = CLI_EXIT_INVALID;
        else rc = print_invalid(ctx, &s, &rep);
    } else if (rep.result != AVGPIPE_OK) {
        rc = lib_error(ctx);
    } else {
        if (!o->quiet)
            printf("valid: %d ranks, %d stages, %lld ops (%s, N=%d M=%d R=%d, %s)\n", s.nranks,
                   s.nstages, count_ops(&s), avgpipe_sched_kind_name(sh->kind), sh->pipes, sh->micro, sh->rounds,
                   s.has_comm ? "with SEND/RECV" : "compute only");
        if (o->lower) rc = print_lowered(ctx, &s);
    }
    avgpipe_sched_free(ctx, &s);
    return rc;
}

/* ---- tune ------------------------------------------------------------------------------------ */

/* "12.3 KiB" style, for the text table's summary lines. */
static const char *human_bytes(double b, char *buf, size_t cap) {
    static const char *const unit[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (b >= 1024 && u < 4) b /= 1024, u++;
    if (u == 0) snprintf(buf, cap, "%.0f bytes", b);
    else snprintf(buf, cap, "%.3g %s", b, unit[u]);
    return buf;
}

/* The fitted model, one line per stage: what the ranking rests on. Times in microseconds. */
static void print_cost_model(const cli_opts *o, const avgpipe_profile *p, const avgpipe_cost_model *m) {
    int g, K = AVGPIPE_OP_KIND_COUNT;
    printf("cost model fitted to '%s': %d section%s, %zu ops, %d stages; micro-batches of %g", o->profile, p->nsections,
           p->nsections == 1 ? "" : "s", p->nops, m->nstages, m->samples_lo);
    if (m->samples_hi > m->samples_lo) printf(" and %g", m->samples_hi);
    printf(" samples\n");
    if (m->samples_hi <= m->samples_lo) printf("  (one micro-batch size: op times taken as proportional to the samples)\n");
    for (g = 0; g < m->nstages; g++)
        printf("  stage %d: F %.4g + %.4g x samples us, B %.4g + %.4g x samples us; %.0f params, %.4g activation bytes/sample\n", g,
               1e6 * m->a[g * K + AVGPIPE_OP_F], 1e6 * m->b[g * K + AVGPIPE_OP_F], 1e6 * m->a[g * K + AVGPIPE_OP_B],
               1e6 * m->b[g * K + AVGPIPE_OP_B], m->param_floats[g], m->act_bytes_per_sample[g]);
    printf("  transfer latency %.4g us\n", 1e6 * m->latency);
    if (m->op_overhead > 0 || m->avg_per_float > 0 || m->step_b > 0)
        printf("  runtime overhead %.4g us per op; averaging %.4g ns per parameter; STEP %.4g us + %.4g ns per parameter\n",
               1e6 * m->op_overhead, 1e9 * m->avg_per_float, 1e6 * m->step_a, 1e9 * m->step_b);
    if (m->iter_overhead > 0) printf("  iteration start and finish %.4g us\n", 1e6 * m->iter_overhead);
    if (m->overlap > 0)
        printf("  pipelines overlap on a device: %.0f%% of a compute op runs concurrently with the others' (N = 2: %.2fx the ops per second)\n",
               100 * m->overlap, 2 / (2 - m->overlap));
    if (m->cores > 0 && m->cores < m->nstages)
        printf("  the %d ranks share %g cores: an iteration lasts at least all ranks' compute / %g\n", m->nstages, m->cores, m->cores);
}

static void print_tune_row(const cli_opts *o, int rank, const avgpipe_tune_candidate *c, const char *split) {
    const avgpipe_sched_desc *d = &c->sched;
    if (o->tsv) {
        printf("%d\t%s\t%d\t%d\t%d\t%d\t%.10g\t%.9g\t%.9g\t%.0f\t%d", rank, avgpipe_sched_kind_name(d->kind), d->micro, d->pipes,
               d->advance, d->continuous, c->samples, c->time_per_sample, c->seconds, c->peak_bytes, c->fits);
        if (o->noise_scale > 0) printf("\t%.9g\t%.9g", c->efficiency, c->time_to_target);
        printf("%s%s\n", split ? "\t" : "", split ? split : "");
        return;
    }
    printf("%4d  %-8s %5d %5d %7d %10s %14.4f %12.4f %14.0f  %s", rank, avgpipe_sched_kind_name(d->kind), d->micro, d->pipes,
           d->advance, d->continuous ? "yes" : "no", 1e6 * c->time_per_sample, 1e3 * c->seconds, c->peak_bytes, c->fits ? "yes" : "NO ");
    if (o->noise_scale > 0) printf(" %10.4f %13.4f", c->efficiency, 1e6 * c->time_to_target);
    printf("\n");
}

/* The search description from the options; kinds from --schedule (interleaved is refused: the
   profile fixes one stage partition per rank). */
static int make_tune_desc(const cli_opts *o, avgpipe_tune_desc *td) {
    int i;
    memset(td, 0, sizeof *td);
    td->batch = o->batch;
    td->max_pipes = o->max_pipes;
    td->rounds = o->rounds;
    td->mem_limit = o->mem_limit;
    td->opt_bytes_per_param = o->opt_bytes;
    td->no_continuous = o->no_continuous;
    td->max_advance = o->max_advance;
    td->min_micro = o->min_micro;
    td->noise_scale = o->noise_scale; /* 0: every efficiency 1, the ranking by time per sample */
    { /* the processors online: the ranking is the same for any count of threads */
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        td->threads = n < 1 ? 1 : n > AVGPIPE_TUNE_MAX_THREADS ? AVGPIPE_TUNE_MAX_THREADS : (int)n;
    }
    for (i = 0; i < o->nkinds; i++) {
        if (avgpipe_sched_kind_query(o->kinds[i])->chunks != 1) /* several stages per rank */
            return cli_error("--schedule: tune does not search %s (the profile fixes one stage partition per rank)",
                             avgpipe_sched_kind_name(o->kinds[i]));
        td->kinds |= 1u << o->kinds[i];
    }
    return 0;
}

/* Ops the search will simulate, summed over its candidates (an upper bound: advance counts every K up
   to N x M, the library skips those that change no warm-up). */
static double tune_work(const avgpipe_tune_desc *td, int stages) {
    unsigned kinds = td->kinds;
    double work = 0;
    int M, N, plain = 0, k;
    for (k = AVGPIPE_SCHED_CUSTOM + 1; k < AVGPIPE_SCHED_KIND_COUNT && !td->kinds; k++) /* 0: the table's tuned one-stage kinds */
        if (avgpipe_sched_kind_query((avgpipe_sched_kind)k)->tuned && avgpipe_sched_kind_query((avgpipe_sched_kind)k)->chunks == 1)
            kinds |= 1u << k;
    for (k = AVGPIPE_SCHED_CUSTOM + 1; k < AVGPIPE_SCHED_KIND_COUNT; k++)
        plain += !avgpipe_sched_kind_query((avgpipe_sched_kind)k)->advance && (kinds & (1u << k));
    for (M = 1; M <= td->batch; M++) {
        if (td->batch % M || td->batch / M < (td->min_micro > 0 ? td->min_micro : 1)) continue;
        for (N = 1; N <= td->max_pipes; N++) {
            double nk = plain, tm = (double)N * M;
            if (kinds & (1u << AVGPIPE_SCHED_ADVANCE)) nk += td->max_advance > 0 && td->max_advance < tm ? td->max_advance : tm;
            work += nk * (td->no_continuous ? 1 : 2) * stages * tm * td->rounds;
        }
    }
    return work;
}

/* With layer costs: the partitioner's split of the layers into S stages (S: --stages, else the profile's),
   its cost model into *sm, "1,3" into split; prints the split and what bounds it (table form). Without:
   nothing (0), or an error when --stages asks for a split. */
static int tune_plan(avgpipe_context *ctx, const cli_opts *o, const avgpipe_profile *p, const avgpipe_cost_model *m,
                     const avgpipe_tune_desc *td, avgpipe_cost_model *sm, char *split, size_t cap) {
    avgpipe_tune_split_choice plan;
    avgpipe_tune_split_desc pd;
    size_t len = 0;
    int g;
    if (m->nlayers < 1) {
        if (o->stages && o->stages != p->sections[0].nstages)
            return cli_error("--stages %d: the profile has no 'layer' lines, so its %d stage partitions cannot be regrouped", o->stages,
                             p->sections[0].nstages);
        return 0;
    }
    memset(&pd, 0, sizeof pd);
    pd.stages = o->stages ? o->stages : p->sections[0].shape.stages;
    if (avgpipe_tune_choose_split(ctx, m, td, &pd, &plan) != AVGPIPE_OK) return lib_error(ctx);
    for (g = 0; g < plan.nparts && len < cap; g++) len += (size_t)snprintf(split + len, cap - len, "%s%d", g ? "," : "", plan.split[g]);
    if (avgpipe_tune_split_model(ctx, m, plan.split, plan.nparts, sm) != AVGPIPE_OK) {
        avgpipe_tune_split_choice_free(ctx, &plan);
        return lib_error(ctx);
    }
    if (!o->tsv)
        printf("split %s (layers per stage, of %d layers) chosen among %lld splits, %lld searched: the busiest stage does %.1f%% of "
               "the work per sample at %g samples per micro-batch, so no schedule gains more than %.3gx over one thread\n", split,
               m->nlayers, plan.splits, plan.searched, 100 * plan.slowest_share, plan.best.samples, plan.bound);
    avgpipe_tune_split_choice_free(ctx, &plan);
    return 0;
}

static int cmd_tune(avgpipe_context *ctx, const cli_opts *o) {
    avgpipe_profile p;
    avgpipe_cost_model m, sm, *use = &m;
    avgpipe_tune_desc td;
    avgpipe_tune_candidate *c = NULL;
    int n = 0, i, nfit = 0, rc, shown;
    char b1[32], b2[32], split[256] = "";
    FILE *f = fopen(o->profile, "rb"); /* first, for the system's reason (the library names none) */
    int bad = !f || (fgetc(f) == EOF && ferror(f));
    if (bad) rc = cli_error("cannot read '%s': %s", o->profile, strerror(errno));
    if (f) fclose(f);
    if (bad) return rc;
    if ((rc = make_tune_desc(o, &td)) != 0) return rc;
    if (o->min_micro > o->batch)
        return cli_error("--min-micro %d is larger than --batch %d: no micro-batch size to try", o->min_micro, o->batch);
    if (avgpipe_profile_load(ctx, o->profile, &p) != AVGPIPE_OK) return lib_error(ctx);
    for (i = 0; i < p.nsections; i++) { /* the fit keeps a table of (pipe, stage, micro-batch) per section */
        const avgpipe_sched_desc *sh = &p.sections[i].shape;
        double items = (double)p.sections[i].nstages * sh->pipes * sh->micro * sh->rounds;
        if (p.sections[i].nstages > CLI_MAX_STAGES) {
            rc = cli_error("%s: %d stages: this tool tunes at most %d", o->profile, p.sections[i].nstages, CLI_MAX_STAGES);
            break;
        }
        if (sh->micro < 1 || sh->pipes < 1 || sh->rounds < 1 || items > (double)CLI_MAX_ITEMS) {
            rc = cli_error("%s: section %d: stages x pipes x micro x rounds is out of range (this tool reads at most %lld)",
                           o->profile, i + 1, CLI_MAX_ITEMS);
            break;
        }
    }
    if (rc) {
        avgpipe_profile_free(ctx, &p);
        return rc;
    }
    if ((double)p.sections[0].nstages * o->max_pipes * o->batch * o->rounds > (double)CLI_MAX_ITEMS) {
        rc = cli_error("stages x --max-pipes x --batch x --rounds = %.0f: this tool simulates at most %lld",
                       (double)p.sections[0].nstages * o->max_pipes * o->batch * o->rounds, CLI_MAX_ITEMS);
        avgpipe_profile_free(ctx, &p);
        return rc;
    }
    if (tune_work(&td, p.sections[0].nstages) > CLI_MAX_TUNE_WORK) {
        rc = cli_error("this search would simulate about %.2g ops (this tool stops at %.0g): lower --batch, --max-pipes or "
                       "--rounds, or set --min-micro or --max-advance", tune_work(&td, p.sections[0].nstages), CLI_MAX_TUNE_WORK);
        avgpipe_profile_free(ctx, &p);
        return rc;
    }
    rc = avgpipe_tune_fit(ctx, &p, &m) != AVGPIPE_OK ? lib_error(ctx) : 0;
    if (rc) {
        avgpipe_profile_free(ctx, &p);
        return rc;
    }
    m.cores = o->cores;
    memset(&sm, 0, sizeof sm);
    if (!o->tsv) print_cost_model(o, &p, &m);
    rc = tune_plan(ctx, o, &p, &m, &td, &sm, split, sizeof split);
    if (!rc && sm.nstages) use = &sm;
    if (!rc && avgpipe_tune_search(ctx, use, &td, &c, &n) != AVGPIPE_OK) rc = lib_error(ctx);
    for (i = 0; !rc && i < n; i++) nfit += c[i].fits;
    shown = o->top > 0 && o->top < n ? o->top : n;
    if (!rc && o->tsv) {
        printf("rank\tschedule\tmicro\tpipes\tadvance\tcontinuous\tsamples\tpred_time_per_sample\tpred_seconds\tpred_peak_bytes\tfits%s%s\n",
               o->noise_scale > 0 ? "\tefficiency\tpred_time_to_target" : "", split[0] ? "\tsplit" : "");
        for (i = 0; i < shown; i++) print_tune_row(o, i + 1, &c[i], split[0] ? split : NULL);
    } else if (!rc) {
        printf("\nbatch %d per pipeline, %d round%s per iteration, memory limit %s per rank, optimizer %g bytes/param: "
               "%d settings, %d fit\n", o->batch, o->rounds, o->rounds == 1 ? "" : "s", human_bytes(o->mem_limit, b1, sizeof b1),
               o->opt_bytes, n, nfit);
        if (o->noise_scale > 0)
            printf("ranked by predicted time to target with a noise scale of %g samples: efficiency = 1 + N x %d / %g (the samples a\n"
                   "target takes relative to a batch far below it), us_to_target = us_per_sample x efficiency\n", o->noise_scale, o->batch,
                   o->noise_scale);
        printf("%4s  %-8s %5s %5s %7s %10s %14s %12s %14s  %s%s\n", "rank", "schedule", "micro", "pipes", "advance", "continuous",
               "us_per_sample", "iteration_ms", "peak_bytes", "fits", o->noise_scale > 0 ? "  efficiency  us_to_target" : "");
        for (i = 0; i < shown; i++) print_tune_row(o, i + 1, &c[i], NULL);
        if (shown < n) printf("  ... %d more (--top 0 lists all)\n", n - shown);
        if (nfit > 0)
            printf("best: %s M=%d N=%d K=%d %s rounds, %g samples per micro-batch: %.4g us/sample (%.4g samples/s), peak %s "
                   "of %s per rank\n", avgpipe_sched_kind_name(c[0].sched.kind), c[0].sched.micro, c[0].sched.pipes,
                   c[0].sched.advance, c[0].sched.continuous ? "continuous" : "synchronous", c[0].samples,
                   1e6 * c[0].time_per_sample, 1 / c[0].time_per_sample, human_bytes(c[0].peak_bytes, b1, sizeof b1),
                   human_bytes(o->mem_limit, b2, sizeof b2));
        if (nfit > 0 && o->noise_scale > 0)
            printf("      efficiency %.4g: %.4g us per sample of ideal progress\n", c[0].efficiency, 1e6 * c[0].time_to_target);
        if (n > 0 && (c[0].samples < m.samples_lo || c[0].samples > m.samples_hi))
            printf("note: %g samples per micro-batch is outside the profiled %g..%g: its op times are extrapolated\n",
                   c[0].samples, m.samples_lo, m.samples_hi);
    }
    if (!rc && nfit == 0) {
        double least = n > 0 ? c[n - 1].peak_bytes : 0;
        for (i = 0; i < n; i++)
            if (c[i].peak_bytes < least) least = c[i].peak_bytes;
        fprintf(stderr, "avgpipe: no setting fits --mem-limit %s per rank (the smallest needs %.0f bytes)\n",
                human_bytes(o->mem_limit, b1, sizeof b1), least);
        rc = CLI_EXIT_INVALID;
    }
    avgpipe_free(ctx, c);
    avgpipe_tune_cost_model_free(ctx, &m);
    avgpipe_tune_cost_model_free(ctx, &sm);
    avgpipe_profile_free(ctx, &p);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------ */

static int run_command(const cli_command *c, int argc, char **argv) {
    cli_opts o;
    avgpipe_context ctx;
    int rc;
    default_opts(&o, c->cmd);
    if ((rc = parse_args(&o, argc, argv)) != 0) return rc;
    if (o.help) {
        print_command_help(c);
        return 0;
    }
    if (o.nkinds == 0 && c->cmd != CMD_TUNE) {
        static const avgpipe_sched_kind dflt[] = {AVGPIPE_SCHED_AFAB, AVGPIPE_SCHED_1F1B, AVGPIPE_SCHED_ADVANCE,
                                                  AVGPIPE_SCHED_ZBH1};
        o.nkinds = c->cmd == CMD_SIM ? 1 : 4;
        memcpy(o.kinds, c->cmd == CMD_SIM ? &dflt[2] : dflt, sizeof dflt[0] * (size_t)o.nkinds);
    }
    if (avgpipe_context_init(&ctx, NULL) != AVGPIPE_OK) return cli_error("cannot initialise the library context");
    if (c->cmd == CMD_SIM) return cmd_sim(&ctx, &o);
    if (c->cmd == CMD_VALIDATE) return cmd_validate(&ctx, &o);
    if (c->cmd == CMD_TUNE) return cmd_tune(&ctx, &o);
    return cmd_compare(&ctx, &o);
}

int main(int argc, char **argv) {
    size_t i;
    if (argc < 2) return cli_error("missing command (expected sim, validate, compare or tune; see 'avgpipe --help')");
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
        print_usage(stdout);
        return 0;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("avgpipe %s\n", avgpipe_version()); /* the implementation compiled in */
        return 0;
    }
    for (i = 0; i < CLI_NCOMMANDS; i++)
        if (strcmp(argv[1], cli_commands[i].name) == 0) {
            int rc = run_command(&cli_commands[i], argc, argv);
            if (fflush(stdout) != 0 || ferror(stdout)) return cli_error("cannot write the standard output");
            return rc;
        }
    return cli_error("unknown command '%s' (expected sim, validate, compare or tune; see 'avgpipe --help')", argv[1]);
}
