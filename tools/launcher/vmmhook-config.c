/* vmmhook-config: the options table of libvmmhook (src/options.c), presented for people and
 * for the launcher. Built from the library's own options.c and log.c, so that there is one
 * table and one parser:
 *
 *   vmmhook-config --check       parse the VMMHOOK_* variables of the environment as the library
 *                                will, print the resolved configuration; exit 1 on a bad value
 *   vmmhook-config --help-text   the options section of `vmmhook --help`
 *   vmmhook-config --markdown    the options table of docs/OPTIONS.md
 *   vmmhook-config --list        one line per option for the launcher: NAME KIND FLAG
 *   vmmhook-config --version
 *
 * docs/OPTIONS.md holds the --markdown output between two marker lines; the tools test suite
 * fails when they differ (`meson compile -C build update-docs` rewrites it). */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "options.h"
#include "vmmhook.h"

extern char **environ;

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

/* What a flag takes, as --help shows it; NULL for a boolean (the flag alone turns it on). */
static const char *metavar(const vmh_option_info_t *r)
{
    switch (r->kind) {
    case VMH_OPTION_SIZE:
        return "SIZE";
    case VMH_OPTION_WORD:
        return "none|posix_fd|fabric"; /* the only word row; test-launcher.sh checks it */
    case VMH_OPTION_GRANULARITY:
        return "min|recommended|SIZE";
    case VMH_OPTION_DEVICES:
        return "all|none|LIST";
    case VMH_OPTION_PATH:
        return "FILE";
    default:
        return NULL;
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
        const char *mv = metavar(&r);
        if (mv)
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
    char max[32], min[32];
    size_text(r->max, max, sizeof(max));
    size_text(r->min, min, sizeof(min));
    switch (r->kind) {
    case VMH_OPTION_SIZE:
        snprintf(buf, len, "size%s%s%s%s", r->min ? ", at least " : "", r->min ? min : "",
                 r->max ? ", at most " : "", r->max ? max : "");
        return;
    case VMH_OPTION_BOOL:
        snprintf(buf, len, "boolean");
        return;
    case VMH_OPTION_WORD: {
        size_t n = 0;
        buf[0] = '\0';
        for (unsigned w = 0; w < r->nwords && n < len; w++)
            n += (size_t)snprintf(buf + n, len - n, "%s`%s`", w ? ", " : "", r->words[w]);
        return;
    }
    case VMH_OPTION_GRANULARITY:
        snprintf(buf, len, "`min`, `recommended`, or a size such as `2M` or `64M`%s%s%s",
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
        char mv[64] = "";
        const char *m = metavar(&r);
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

/* Parses the environment with the library's parser: its warnings go to stderr exactly as the
 * library would print them; the resolved values to stdout. */
static int check(void)
{
    vmh_options_t o, d;
    vmh_options_defaults(&o);
    vmh_options_defaults(&d);
    unsigned bad = 0;
    vmh_options_parse(&o, vmh_options_env_get, NULL, &bad);
    int unknown = vmh_options_check_unknown(environ);
    printf("libvmmhook %d.%d.%d options:\n", VMM_VERSION_MAJOR, VMM_VERSION_MINOR,
           VMM_VERSION_PATCH);
    for (size_t i = 0; i < vmh_options_count(); i++) {
        char v[300], dv[300];
        vmh_options_format(&o, i, v, sizeof(v));
        vmh_options_format(&d, i, dv, sizeof(dv));
        printf("  %-20s = %s%s\n", vmh_options_name(i), v[0] ? v : "(none)",
               strcmp(v, dv) == 0 ? " (default)" : "");
    }
    if (bad) {
        fprintf(stderr, "vmmhook-config: %u bad value%s (the library would use the default%s)\n",
                bad, bad == 1 ? "" : "s", o.strict ? "; with VMMHOOK_STRICT it stops" : "");
        return 1;
    }
    if (unknown)
        fprintf(stderr, "vmmhook-config: %d unknown VMMHOOK_* variable%s (ignored)\n", unknown,
                unknown == 1 ? "" : "s");
    return 0;
}

static int usage(FILE *f, int status)
{
    fprintf(f, "Usage: vmmhook-config --check | --help-text | --markdown | --list | --version\n"
               "  --check      parse the VMMHOOK_* variables of the environment as libvmmhook "
               "does,\n               print the resolved options; exit 1 on a bad value\n"
               "  --help-text  the options section of vmmhook --help\n"
               "  --markdown   the options table of docs/OPTIONS.md\n"
               "  --list       NAME KIND FLAG per option (for the launcher)\n");
    return status;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "vmmhook-config: %s\n",
                argc < 2 ? "no option given" : "one option at a time");
        return usage(stderr, 2);
    }
    const char *m = argv[1];
    if (!strcmp(m, "--check"))
        return check();
    if (!strcmp(m, "--help-text"))
        help_text();
    else if (!strcmp(m, "--markdown"))
        markdown();
    else if (!strcmp(m, "--list"))
        list();
    else if (!strcmp(m, "--version"))
        printf("vmmhook-config %d.%d.%d\n", VMM_VERSION_MAJOR, VMM_VERSION_MINOR,
               VMM_VERSION_PATCH);
    else if (!strcmp(m, "-h") || !strcmp(m, "--help"))
        return usage(stdout, 0);
    else {
        fprintf(stderr, "vmmhook-config: unknown option '%s'\n", m);
        return usage(stderr, 2);
    }
    return fflush(stdout) == 0 ? 0 : 1;
}
