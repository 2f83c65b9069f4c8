/* vmmhook-config: the options table of libvmmhook (src/util/options_table.c), presented for people
 * and for the launcher. Built from the library's own options_table.c, options.c and log.c, so that
 * there is one table and one parser:
 *
 *   vmmhook-config --check       parse the VMMHOOK_* variables of the environment as the library
 *                                will, check that the output files can be written and that
 *                                every VMMHOOK_* name is known, print the resolved
 *                                configuration; exit 2 on a bad value (as the launcher's
 *                                usage errors), 1 on any other problem
 *   vmmhook-config --help-text   the options section of `vmmhook --help`
 *   vmmhook-config --markdown    the options table of docs/OPTIONS.md
 *   vmmhook-config --stats-fields  the counters and gauges of the stats JSON, for OPTIONS.md
 *   vmmhook-config --list        one line per option for the launcher: NAME KIND FLAG
 *   vmmhook-config --closest FLAG [FLAG...]
 *                                the flag of the table (or one of the FLAGs after it: the
 *                                launcher's own) that FLAG is a misspelling of, as the library
 *                                names the closest VMMHOOK_* variable; nothing when none is near
 *   vmmhook-config --version
 *
 * Before the mode, --as=NAME: messages start with "NAME: " instead of this program's path (the
 * launcher passes its own name, so that all it prints starts the same).
 *
 * docs/OPTIONS.md holds the --markdown output between two marker lines; the tools test suite
 * fails when they differ (`meson compile -C build update-docs` rewrites it). */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "options.h"
#include "optparse.h"
#include "outfile.h" /* VMH_PATH_MAX only: outfile.c is not linked */
#include "stats.h"   /* the counter and gauge tables only: stats.c is not linked */
#include "trace.h"   /* VMH_TRACE_GAUGES_SUFFIX only: trace.c is not linked */
#include "vmmhook.h"

extern char **environ;

/* This program as it was run (argv[0]): messages name it by the path it has, since it is on
 * PATH only after `meson install` (issue 30: they named `vmmhook-config`, which a build tree or
 * a pip install does not put there). */
static const char *self = "vmmhook-config";

/* "--cache-limit" for VMMHOOK_CACHE_LIMIT. */
static void flag_of(const char *name, char *buf, size_t len)
{
    const char *p = name + strlen("VMMHOOK_");
    size_t n = 0;
    if (len < 3)
        return;
    buf[n++] = '-';
    buf[n++] = '-';
    for (; *p && n + 1 < len; p++)
        buf[n++] = *p == '_' ? '-' : (char)(*p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p);
    buf[n] = '\0';
}

/* The table's words of a row joined by sep ("off|host"), after what buf holds. */
static void join_words(const vmh_option_info_t *r, const char *sep, char *buf, size_t len)
{
    size_t n = strlen(buf);
    for (unsigned w = 0; w < r->nwords && n < len; w++)
        n += (size_t)snprintf(buf + n, len - n, "%s%s", w ? sep : "", r->words[w]);
}

/* What a flag takes, as --help shows it, into buf; false for a boolean (the flag alone turns it
 * on). Word lists come from the options table, the parser's own (issue 30: a hard-coded row
 * showed the handle types for --overflow); test-launcher.sh checks them against the parser. */
static bool metavar(const vmh_option_info_t *r, char *buf, size_t len)
{
    buf[0] = '\0';
    switch (r->kind) {
    case VMH_OPTION_SIZE:
        snprintf(buf, len, "SIZE");
        return true;
    case VMH_OPTION_WORD:
        join_words(r, "|", buf, len);
        return true;
    case VMH_OPTION_GRANULARITY:
        join_words(r, "|", buf, len);
        snprintf(buf + strlen(buf), len - strlen(buf), "|SIZE");
        return true;
    case VMH_OPTION_DEVICES:
        snprintf(buf, len, "all|none|LIST");
        return true;
    case VMH_OPTION_PATH:
        snprintf(buf, len, "FILE");
        return true;
    default:
        return false;
    }
}

/* For the launcher: flag (boolean), path (made absolute), value. */
static const char *launcher_kind(const vmh_option_info_t *r)
{
    return r->kind == VMH_OPTION_BOOL ? "flag" : r->kind == VMH_OPTION_PATH ? "path" : "value";
}

/* A size as the table writes it: 1T, 256M, 1. */
static void size_text(size_t v, char *buf, size_t len)
{
    static const char sfx[] = "TGMK";
    for (unsigned i = 0; i < 4; i++) {
        unsigned shift = 10 * (4 - i);
        if (v != 0 && (v & (((size_t)1 << shift) - 1)) == 0) {
            snprintf(buf, len, "%zu%c", v >> shift, sfx[i]);
            return;
        }
    }
    snprintf(buf, len, "%zu", v);
}

/* Prints text wrapped at width, each line indented. */
static void wrap(const char *text, unsigned indent, unsigned width)
{
    unsigned col = 0;
    const char *p = text;
    while (*p) {
        while (*p == ' ')
            p++;
        size_t w = strcspn(p, " ");
        if (w == 0)
            break;
        if (col == 0) {
            printf("%*s", (int)indent, "");
            col = indent;
        } else if (col + 1 + w > width) {
            printf("\n%*s", (int)indent, "");
            col = indent;
        } else {
            putchar(' ');
            col++;
        }
        printf("%.*s", (int)w, p);
        col += (unsigned)w;
        p += w;
    }
    if (col)
        putchar('\n');
}

static void help_text(void)
{
    for (size_t i = 0; i < vmh_options_count(); i++) {
        vmh_option_info_t r;
        vmh_options_info(i, &r);
        char flag[64], text[1024];
        flag_of(r.name, flag, sizeof(flag));
        char mv[128];
        if (metavar(&r, mv, sizeof(mv)))
            printf("  %s=%s\n", flag, mv);
        else
            printf("  %s\n", flag);
        snprintf(text, sizeof(text), "%s [%s, default %s]", r.help, r.name,
                 r.def[0] ? r.def : "none");
        wrap(text, 6, 100);
    }
}

static void markdown_forms(const vmh_option_info_t *r, char *buf, size_t len)
{
    char max[32], min[32], step[32];
    size_text(r->max, max, sizeof(max));
    size_text(r->min, min, sizeof(min));
    size_text(r->step, step, sizeof(step));
    switch (r->kind) {
    case VMH_OPTION_SIZE:
        snprintf(buf, len, "size%s%s%s%s%s%s", r->step ? ", a multiple of " : "",
                 r->step ? step : "", r->min ? ", at least " : "", r->min ? min : "",
                 r->max ? ", at most " : "", r->max ? max : "");
        return;
    case VMH_OPTION_BOOL:
        snprintf(buf, len, "boolean");
        return;
    case VMH_OPTION_WORD:
        buf[0] = '`';
        buf[1] = '\0';
        join_words(r, "`, `", buf, len);
        snprintf(buf + strlen(buf), len - strlen(buf), "`");
        return;
    case VMH_OPTION_GRANULARITY:
        buf[0] = '`';
        buf[1] = '\0';
        join_words(r, "`, `", buf, len);
        snprintf(
            buf + strlen(buf), len - strlen(buf), "`, or a size%s%s%s such as `2M` or `64M`%s%s%s",
            r->step ? " that is a multiple of `" : "", r->step ? step : "", r->step ? "`," : "",
            r->max ? ", at most `" : "", r->max ? max : "", r->max ? "`" : "");
        return;
    case VMH_OPTION_DEVICES:
        snprintf(buf, len,
                 "`all`, `none`, or device ordinals `0`-`63` separated by commas, "
                 "e.g. `0,1,3`");
        return;
    case VMH_OPTION_PATH:
        snprintf(buf, len, "a file path of at most 255 bytes; `%%p` is the process id");
        return;
    default:
        snprintf(buf, len, "?");
    }
}

static void markdown(void)
{
    printf("| Variable | Launcher flag | Default | Accepted forms | Meaning |\n");
    printf("|---|---|---|---|---|\n");
    for (size_t i = 0; i < vmh_options_count(); i++) {
        vmh_option_info_t r;
        vmh_options_info(i, &r);
        char flag[64], forms[256];
        flag_of(r.name, flag, sizeof(flag));
        markdown_forms(&r, forms, sizeof(forms));
        /* A '|' splits a table cell even inside a code span: escaped. */
        char mv[128] = "", text[128];
        const char *m = metavar(&r, text, sizeof(text)) ? text : NULL;
        for (size_t k = 0, n = 0; m && m[k] && n + 3 < sizeof(mv); k++) {
            if (m[k] == '|')
                mv[n++] = '\\';
            mv[n++] = m[k];
            mv[n] = '\0';
        }
        printf("| `%s` | `%s%s%s` | %s%s%s | %s | %s%s%s |\n", r.name, flag, m ? "=" : "", mv,
               r.def[0] ? "`" : "", r.def[0] ? r.def : "(none)", r.def[0] ? "`" : "", forms, r.help,
               r.detail[0] ? " " : "", r.detail);
    }
}

/* The counters and gauges of the stats JSON (both the exit report and vmm_stats_json), from
 * stats.h's tables, the ones report.c writes the JSON and the exit table from. */
static void stats_fields(void)
{
/* The help's leading blanks indent "of them" lines in the exit table: not here. */
#define VMH_FIELD_ROW(name, help)                                                                  \
    printf("| `%s` | %s | %s |\n", #name, kind, &(help)[strspn(help, " ")]);
    printf("| Field | Kind | Meaning (the exit table's line) |\n|---|---|---|\n");
    const char *kind = "counter";
    VMH_COUNTERS(VMH_FIELD_ROW)
    kind = "gauge: `current`, `peak`";
    VMH_GAUGES(VMH_FIELD_ROW)
#undef VMH_FIELD_ROW
}

static void list(void)
{
    for (size_t i = 0; i < vmh_options_count(); i++) {
        vmh_option_info_t r;
        vmh_options_info(i, &r);
        char flag[64];
        flag_of(r.name, flag, sizeof(flag));
        printf("%s %s %s\n", r.name, launcher_kind(&r), flag);
    }
}

/* The names --closest compares: the table's flags, then the launcher's own given after. */
typedef struct flags {
    char table[64][64];
    size_t ntable;
    char *const *extra;
    size_t nextra;
} flags_t;

static const char *flag_at(size_t i, void *arg)
{
    const flags_t *f = arg;
    return i < f->ntable ? f->table[i] : f->extra[i - f->ntable];
}

/* The known flag that `given` (its part before '=') is a misspelling of, on stdout; the rule
 * of the library's "did you mean" for VMMHOOK_* variables (optparse.c's vmh_closest_name),
 * after the leading dashes (so that -granularity finds --granularity). Nothing when none is
 * near. */
static int closest(const char *given, char *const *extra, size_t nextra)
{
    static flags_t f;
    f.ntable = 0;
    for (size_t i = 0; i < vmh_options_count() && f.ntable < 64; i++) {
        vmh_option_info_t r;
        vmh_options_info(i, &r);
        flag_of(r.name, f.table[f.ntable++], sizeof(f.table[0]));
    }
    f.extra = extra;
    f.nextra = nextra;
    /* "--x" compared with "--x": the name given is made to start with two dashes. */
    char name[80];
    size_t dashes = strspn(given, "-"), n = strcspn(given + dashes, "=");
    if (n + 3 > sizeof(name))
        return 0;
    snprintf(name, sizeof(name), "--%.*s", (int)n, given + dashes);
    size_t total = f.ntable + f.nextra;
    size_t i = vmh_closest_name(name, strlen(name), 2, flag_at, total, &f);
    /* Not the flag itself, as given (-granularity gets --granularity). */
    if (i < total &&
        (strlen(flag_at(i, &f)) != n + dashes || strncmp(flag_at(i, &f), given, n + dashes) != 0))
        printf("%s\n", flag_at(i, &f));
    return fflush(stdout) == 0 ? 0 : 1;
}

/* Whether the library could write its output file at path (expanded): the rules of stats.c's
 * open_private, checked without creating or changing anything. A new file needs a directory
 * that exists and that this user may write into; an existing path must be a regular file of
 * this user's that it may write (the library refuses a symbolic link as the last component, a
 * directory, a FIFO, a device, another user's file). false and why otherwise. */
static bool output_writable(const char *path, char *why, size_t len)
{
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (S_ISLNK(st.st_mode))
            snprintf(why, len, "it is a symbolic link (the library refuses to follow one)");
        else if (S_ISDIR(st.st_mode))
            snprintf(why, len, "it is a directory");
        else if (!S_ISREG(st.st_mode))
            snprintf(why, len, "it is not a regular file");
        else if (st.st_uid != geteuid())
            snprintf(why, len, "it belongs to uid %u, not to this user's uid %u",
                     (unsigned)st.st_uid, (unsigned)geteuid());
        else if (faccessat(AT_FDCWD, path, W_OK, AT_EACCESS) != 0)
            snprintf(why, len, "cannot write to it: %s", strerror(errno));
        else
            return true;
        return false;
    }
    if (errno != ENOENT) {
        snprintf(why, len, "cannot examine it: %s", strerror(errno));
        return false;
    }
    /* A new file: its directory must take it. */
    char dir[VMH_PATH_MAX];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash)
        snprintf(dir, sizeof(dir), ".");
    else if (slash == dir)
        dir[1] = '\0';
    else
        *slash = '\0';
    if (stat(dir, &st) != 0) {
        snprintf(why, len, "cannot create it: its directory %s: %s", dir, strerror(errno));
        return false;
    }
    if (!S_ISDIR(st.st_mode)) {
        snprintf(why, len, "cannot create it: %s is not a directory", dir);
        return false;
    }
    if (faccessat(AT_FDCWD, dir, W_OK | X_OK, AT_EACCESS) != 0) {
        snprintf(why, len, "cannot create it in %s: %s", dir, strerror(errno));
        return false;
    }
    return true;
}

/* The output files of the path rows (VMMHOOK_TRACE and its gauges file, VMMHOOK_STATS_JSON):
 * one line for each that the library could not write; returns how many. %p is expanded as the
 * library does, with this process's id (the program's will differ: only the directory and
 * the rest of the name can be checked). */
static unsigned check_outputs(const vmh_options_t *o)
{
    unsigned bad = 0;
    for (size_t i = 0; i < vmh_options_count(); i++) {
        vmh_option_info_t r;
        vmh_options_info(i, &r);
        char tmpl[300];
        if (r.kind != VMH_OPTION_PATH || vmh_options_format(o, i, tmpl, sizeof(tmpl)) == 0)
            continue;
        char path[VMH_PATH_MAX], why[VMH_PATH_MAX + 100], q[VMH_PATH_MAX + 40];
        vmh_fmt_quoted(q, sizeof(q), tmpl, sizeof(tmpl));
        if (!vmh_expand_path(tmpl, (long)getpid(), path, sizeof(path))) {
            fprintf(stderr, "%s: %s=%s: longer than %zu bytes once %%p is replaced\n", self, r.name,
                    q, sizeof(path) - 1);
            bad++;
            continue;
        }
        if (!output_writable(path, why, sizeof(why))) {
            fprintf(stderr, "%s: %s=%s: the library could not write it: %s\n", self, r.name, q,
                    why);
            bad++;
            continue;
        }
        if (strcmp(r.name, "VMMHOOK_TRACE") == 0) {
            /* The trace's companion (docs/OPTIONS.md, "Gauges file"), beside it. */
            char gauges[VMH_PATH_MAX + sizeof(VMH_TRACE_GAUGES_SUFFIX)];
            snprintf(gauges, sizeof(gauges), "%s%s", path, VMH_TRACE_GAUGES_SUFFIX);
            struct stat st;
            /* A trace sent to a device or FIFO has no companion. */
            bool regular = stat(path, &st) != 0 || S_ISREG(st.st_mode);
            if (regular && !output_writable(gauges, why, sizeof(why))) {
                vmh_fmt_quoted(q, sizeof(q), gauges, sizeof(gauges));
                fprintf(stderr,
                        "%s: VMMHOOK_TRACE's gauges file %s: the library could not "
                        "write it: %s\n",
                        self, q, why);
                bad++;
            }
        }
    }
    return bad;
}

/* "1 bad value", "2 unknown variables" into buf after what is there. */
static void count_text(char *buf, size_t len, unsigned n, const char *one, const char *many)
{
    if (!n)
        return;
    size_t at = strlen(buf);
    snprintf(buf + at, len - at, "%s%u %s", at ? ", " : "", n, n == 1 ? one : many);
}

/* Parses the environment with the library's parser, checks the output paths and the names:
 * what is wrong goes to stderr, one line each, then one line saying the check failed; the
 * resolved values to stdout, where a bad value is shown as such (not as the default the
 * library would fall back to). Exit 2 on a bad value, 1 on any other problem, 0 otherwise. */
static int check(void)
{
    vmh_options_t o, d, scratch;
    vmh_options_defaults(&o);
    vmh_options_defaults(&d);
    vmh_options_defaults(&scratch);
    unsigned bad = vmh_options_parse_for_check(&o, vmh_options_env_get, NULL);
    unsigned unknown = (unsigned)vmh_options_check_unknown(environ, true);
    unsigned outputs = check_outputs(&o);
    printf("libvmmhook %d.%d.%d options:\n", VMM_VERSION_MAJOR, VMM_VERSION_MINOR,
           VMM_VERSION_PATCH);
    /* The '=' column after the longest name (issue 37: three names pushed it out). */
    int width = vmh_options_name_width();
    unsigned later = 0;
    for (size_t i = 0; i < vmh_options_count(); i++) {
        char v[300], dv[300];
        const char *name = vmh_options_name(i), *env = vmh_options_env_get(name, NULL);
        if (env && env[0] && vmh_options_set(&scratch, i, env) != 0) {
            printf("  %-*s = not resolved: a bad value (above)\n", width, name);
            continue;
        }
        vmh_options_format(&o, i, v, sizeof(v));
        vmh_options_format(&d, i, dv, sizeof(dv));
        /* Set but empty: the library reads it as unset (options.c), so the default applies. */
        const char *note = env && !env[0]       ? " (default: the value given is empty)"
                           : strcmp(v, dv) == 0 ? " (default)"
                                                : "";
        printf("  %-*s = %s%s\n", width, name, v[0] ? v : "(none)", note);
        later += env && env[0] && vmh_options_later(&o, i) != NULL;
    }
    /* What only the run can check, for the values given (issue 37: an explicit granularity
     * passed --check without a word that the GPU has the last say). */
    if (later) {
        wrap("Checked only when the program runs, on its GPU (--check has none to ask); a "
             "value refused then gets a warning and the library's fallback (with "
             "VMMHOOK_STRICT, the program stops):",
             0, 100);
        for (size_t i = 0; i < vmh_options_count(); i++) {
            const char *name = vmh_options_name(i), *env = vmh_options_env_get(name, NULL);
            const char *what = env && env[0] ? vmh_options_later(&o, i) : NULL;
            char v[300], text[700];
            if (!what)
                continue;
            vmh_options_format(&o, i, v, sizeof(v));
            snprintf(text, sizeof(text), "%s=%s: %s.", name, v, what);
            wrap(text, 2, 100);
        }
    }
    if (!bad && !unknown && !outputs)
        return 0;
    char what[200] = "";
    count_text(what, sizeof(what), bad, "bad value", "bad values");
    count_text(what, sizeof(what), unknown, "unknown VMMHOOK_* variable",
               "unknown VMMHOOK_* variables");
    count_text(what, sizeof(what), outputs, "output file that cannot be written",
               "output files that cannot be written");
    fflush(stdout);
    fprintf(stderr, "%s: the check fails: %s (above)\n", self, what);
    return bad ? 2 : 1;
}

static const char usage_text[] =
    "Usage: vmmhook-config [--as=NAME] --check | --help-text | --markdown | --list | "
    "--closest FLAG... | --version\n"
    "  --check      parse the VMMHOOK_* variables of the environment as libvmmhook does,\n"
    "               check the output files and the names, print the resolved options;\n"
    "               exit 2 on a bad value, 1 on an unknown VMMHOOK_* variable or an output\n"
    "               file the library could not write, 0 when all is well\n"
    "  --help-text  the options section of vmmhook --help\n"
    "  --markdown   the options table of docs/OPTIONS.md\n"
    "  --stats-fields  the counters and gauges of the stats JSON (docs/OPTIONS.md)\n"
    "  --list       NAME KIND FLAG per option (for the launcher)\n"
    "  --closest FLAG [FLAG...]  the flag of the table, or of the FLAGs after it, that FLAG\n"
    "               is a misspelling of (nothing when none is near)\n"
    "  --as=NAME    before the mode: messages start with NAME: (the launcher's name)\n"
    "Exit status: 0 done; 1 --check found a problem other than a bad value, or output failed;\n"
    "2 a usage error or a bad value.\n";

/* A usage error: what is wrong first, then where the usage is; status 2. */
static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "%s: ", self);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\nTry '%s --help'.\n", self);
    return 2;
}

int main(int argc, char **argv)
{
    if (argc > 0 && argv[0] && argv[0][0])
        self = argv[0];
    /* --as=NAME: the launcher's name for every message of its own (issue 37). vmh_log's lines
     * start with "vmmhook: " already. */
    if (argc > 1 && !strncmp(argv[1], "--as=", 5) && argv[1][5]) {
        self = argv[1] + 5;
        argv++;
        argc--;
    }
    if (argc < 2)
        return usage_error("%s", "a mode is needed (--check, --help-text, --markdown, --list, "
                                 "--version)");
    const char *m = argv[1];
    if (!strcmp(m, "--closest")) {
        if (argc < 3)
            return usage_error("%s", "--closest needs the flag to look up");
        return closest(argv[2], argv + 3, (size_t)(argc - 3));
    }
    if (argc > 2)
        return usage_error("one mode at a time; '%s' is one too many", argv[2]);
    if (!strcmp(m, "--check"))
        return check();
    if (!strcmp(m, "--help-text"))
        help_text();
    else if (!strcmp(m, "--markdown"))
        markdown();
    else if (!strcmp(m, "--list"))
        list();
    else if (!strcmp(m, "--stats-fields"))
        stats_fields();
    else if (!strcmp(m, "--version"))
        printf("vmmhook-config %d.%d.%d\n", VMM_VERSION_MAJOR, VMM_VERSION_MINOR,
               VMM_VERSION_PATCH);
    else if (!strcmp(m, "-h") || !strcmp(m, "--help"))
        return fputs(usage_text, stdout) < 0 || fflush(stdout) != 0;
    else
        return usage_error("unknown option '%s'", m);
    return fflush(stdout) == 0 ? 0 : 1;
}
