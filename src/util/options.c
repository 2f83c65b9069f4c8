/* Layer "utilities": the VMMHOOK_* options, read through their one table (options_table.c, one
 * row per variable: name, kind, field, default, bounds, help, detail). This file is the code over
 * the rows: it parses the environment into a snapshot, checks forms, formats and prints values,
 * names unknown variables, and answers the tools' questions row by row. The value parsers are in
 * optparse.c.
 *
 * Rules every row follows:
 *  - read once, with secure_getenv (a set-uid program ignores the environment);
 *  - unset or empty: the default;
 *  - blanks around a value are ignored except for paths, which are taken verbatim;
 *  - a bad value: one warning naming the variable, the value (escaped, shortened) and the
 *    accepted forms, and the default is kept; with VMMHOOK_STRICT the program stops instead
 *    (log.h's vmh_log_stop).
 * This file parses, checks forms, formats and prints; what a value means to a layer is that
 * layer's (lifetime.c makes each layer's settings from the snapshot), and so is a value the
 * machine refuses later (lifetime.c's refusal policy). Nothing here allocates; stdio only to
 * format. The first read can happen inside dlsym or the driver. */
#include "options_internal.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <unistd.h>

#include "log.h"
#include "optparse.h"
#include "testable.h"
#include "vmmhook.h"

/* The accepted forms, as the warnings state them. */
static const char *forms(const opt_row_t *r)
{
    switch (r->kind) {
    case K_SIZE:
        return "a byte count with an optional K, M, G or T suffix (KiB, KB... also accepted; "
               "powers of 1024), e.g. 512K or 64M";
    case K_BOOL:
        return "1, 0, true, false, yes, no, on, off";
    case K_ENUM:
        return vmh_option_word_forms(r);
    case K_GRAN:
        return "min, recommended, or a size that is a multiple of 2M, such as 2M or 64M, at "
               "most 256G (and a multiple of the driver's minimum granularity where that is "
               "larger)";
    case K_DEVMASK:
        return "all, none, or a comma-separated list of device ordinals 0 to 63, e.g. 0,1,3";
    case K_STRING:
        return "a file path of at most 255 bytes";
    default:
        return "?";
    }
}

static int parse_word(const opt_row_t *r, const char *s, size_t len, int *out)
{
    for (unsigned i = 0; i < r->nwords; i++) {
        if (vmh_word_eq(s, len, r->words[i])) {
            *out = (int)i;
            return 0;
        }
    }
    return EINVAL;
}

/* ---- rows ------------------------------------------------------------------------------- */

static void *field(vmh_options_t *o, const opt_row_t *r)
{
    return (char *)o + r->off;
}

static const void *cfield(const vmh_options_t *o, const opt_row_t *r)
{
    return (const char *)o + r->off;
}

static size_t fmt_size(char *buf, size_t len, size_t v);

/* Why a value was refused, in a few words. */
typedef struct why {
    char text[96];
} why_t;

static void say(why_t *why, const char *text)
{
    snprintf(why->text, sizeof(why->text), "%s", text);
}

/* A size against the row's step (VMMHOOK_GRANULARITY: a multiple of 2M), the same check for
 * the library and for vmmhook --check. */
static int check_step(const opt_row_t *r, size_t v, why_t *why)
{
    if (r->step == 0 || v % r->step == 0)
        return 0;
    char unit[32];
    fmt_size(unit, sizeof(unit), r->step);
    snprintf(why->text, sizeof(why->text), "not a multiple of %s", unit);
    return ERANGE;
}

/* Sets row r from value (already known non-empty or a default). On failure the field is left
 * as it was and *why says why. */
static int set_row(vmh_options_t *o, const opt_row_t *r, const char *value, why_t *why)
{
    size_t len = strlen(value);
    const char *s = value;
    int rc;
    if (r->kind != K_STRING)
        vmh_trim(&s, &len);
    say(why, "not one of the accepted forms");

    switch (r->kind) {
    case K_SIZE: {
        size_t v;
        rc = vmh_parse_size(s, len, &v);
        if (rc == ERANGE)
            say(why, "too large");
        if (rc == 0 && v < r->min) {
            say(why, "too small");
            rc = ERANGE;
        }
        if (rc == 0 && r->max != 0 && v > r->max) {
            say(why, "too large");
            rc = ERANGE;
        }
        if (rc == 0)
            rc = check_step(r, v, why);
        if (rc == 0)
            *(size_t *)field(o, r) = v;
        return rc;
    }
    case K_BOOL: {
        bool v;
        rc = vmh_parse_bool(s, len, &v);
        if (rc == 0)
            *(bool *)field(o, r) = v;
        return rc;
    }
    case K_ENUM: {
        int v;
        rc = parse_word(r, s, len, &v);
        if (rc == 0)
            *(int *)field(o, r) = v;
        return rc;
    }
    case K_GRAN: {
        int mode;
        size_t bytes;
        if (parse_word(r, s, len, &mode) == 0) {
            o->gran_mode = (vmh_gran_mode_t)mode;
            o->gran_bytes = 0;
            return 0;
        }
        rc = vmh_parse_size(s, len, &bytes);
        if (rc == ERANGE)
            say(why, "too large");
        if (rc == 0 && bytes == 0) {
            say(why, "a granularity of 0");
            rc = ERANGE;
        }
        if (rc == 0 && r->max != 0 && bytes > r->max) {
            say(why, "larger than any GPU's memory; at most 256G");
            rc = ERANGE;
        }
        if (rc == 0)
            rc = check_step(r, bytes, why);
        if (rc == 0) {
            o->gran_mode = VMH_GRAN_BYTES;
            o->gran_bytes = bytes;
        }
        return rc;
    }
    case K_DEVMASK: {
        uint64_t v;
        rc = vmh_parse_devices(s, len, &v);
        if (rc == ERANGE)
            say(why, "a device ordinal above 63");
        if (rc == 0)
            *(uint64_t *)field(o, r) = v;
        return rc;
    }
    case K_STRING:
        if (len >= r->size) {
            say(why, "longer than 255 bytes");
            return ERANGE;
        }
        memcpy(field(o, r), s, len + 1);
        return 0;
    default:
        return EINVAL;
    }
}

/* The canonical spelling of a size: the largest suffix that divides it exactly. */
static size_t fmt_size(char *buf, size_t len, size_t v)
{
    static const char sfx[] = "TGMK";
    for (unsigned i = 0; i < 4; i++) {
        unsigned shift = 10 * (4 - i);
        if (v != 0 && (v & ((1ULL << shift) - 1)) == 0)
            return (size_t)snprintf(buf, len, "%zu%c", v >> shift, sfx[i]);
    }
    return (size_t)snprintf(buf, len, "%zu", v);
}

static size_t fmt_row(const vmh_options_t *o, const opt_row_t *r, char *buf, size_t len)
{
    if (len == 0)
        return 0;
    buf[0] = '\0';
    switch (r->kind) {
    case K_SIZE:
        return fmt_size(buf, len, *(const size_t *)cfield(o, r));
    case K_BOOL:
        return (size_t)snprintf(buf, len, "%s", *(const bool *)cfield(o, r) ? "on" : "off");
    case K_ENUM: {
        int v = *(const int *)cfield(o, r);
        return (size_t)snprintf(buf, len, "%s",
                                v >= 0 && (unsigned)v < r->nwords ? r->words[v] : "?");
    }
    case K_GRAN:
        if (o->gran_mode == VMH_GRAN_BYTES)
            return fmt_size(buf, len, o->gran_bytes);
        return (size_t)snprintf(buf, len, "%s",
                                (unsigned)o->gran_mode < r->nwords ? r->words[o->gran_mode] : "?");
    case K_DEVMASK: {
        uint64_t m = *(const uint64_t *)cfield(o, r);
        if (m == 0)
            return (size_t)snprintf(buf, len, "none");
        if (m == UINT64_MAX)
            return (size_t)snprintf(buf, len, "all");
        size_t n = 0;
        /* Each item is at most 3 bytes (",63"): stop while 4 more always fit. */
        for (unsigned d = 0; d < 64 && n + 4 < len; d++)
            if (m & (1ULL << d))
                n += (size_t)snprintf(buf + n, len - n, "%s%u", n ? "," : "", d);
        return n;
    }
    case K_STRING:
        return (size_t)snprintf(buf, len, "%s", (const char *)cfield(o, r));
    default:
        return 0;
    }
}

static bool row_equal(const vmh_options_t *a, const vmh_options_t *b, const opt_row_t *r)
{
    if (r->kind == K_GRAN)
        return a->gran_mode == b->gran_mode &&
               (a->gran_mode != VMH_GRAN_BYTES || a->gran_bytes == b->gran_bytes);
    if (r->kind == K_STRING)
        return strcmp(cfield(a, r), cfield(b, r)) == 0;
    return memcmp(cfield(a, r), cfield(b, r), r->size) == 0;
}

static const opt_row_t *find_row(const char *name)
{
    for (size_t i = 0; i < vmh_option_nrows; i++)
        if (strcmp(vmh_option_rows[i].name, name) == 0)
            return &vmh_option_rows[i];
    return NULL;
}

/* ---- the table, as a whole ---------------------------------------------------------------- */

void vmh_options_defaults(vmh_options_t *o)
{
    memset(o, 0, sizeof(*o));
    for (size_t i = 0; i < vmh_option_nrows; i++) {
        why_t why;
        /* Cannot fail: test_options checks that every default parses. */
        (void)set_row(o, &vmh_option_rows[i], vmh_option_rows[i].def, &why);
    }
}

/* How parse_rows reports a bad value: not at all (the load line), as the library acts on it
 * (the default, or the strict stop), or for vmmhook-config --check, which fails instead. */
typedef enum { WARN_NONE, WARN_RUN, WARN_CHECK } warn_mode_t;

static void warn_bad(const opt_row_t *r, const char *value, const char *reason, bool strict,
                     warn_mode_t how)
{
    char q[80], def[64];
    vmh_fmt_quoted(q, sizeof(q), value, 64);
    if (how == WARN_CHECK) {
        vmh_log("%s=%s is not valid (%s); accepted: %s", r->name, q, reason, forms(r));
    } else if (strict) {
        vmh_log("%s=%s is not valid (%s); accepted: %s; stopping because VMMHOOK_STRICT is set",
                r->name, q, reason, forms(r));
    } else {
        vmh_options_t d;
        vmh_options_defaults(&d);
        fmt_row(&d, r, def, sizeof(def));
        vmh_log("%s=%s is not valid (%s); accepted: %s; using the default %s", r->name, q, reason,
                forms(r), def[0] ? def : "(none)");
    }
}

/* Every row from get() into *o; a bad value leaves its field and gets a warning as `how` says. */
static unsigned parse_rows(vmh_options_t *o, vmh_getenv_fn get, void *arg, warn_mode_t how)
{
    unsigned bad = 0;
    /* VMMHOOK_STRICT first: the warnings of the other rows say whether the program stops. */
    const opt_row_t *strict_row = find_row("VMMHOOK_STRICT");
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < vmh_option_nrows; i++) {
            const opt_row_t *r = &vmh_option_rows[i];
            if ((pass == 0) != (r == strict_row))
                continue;
            const char *v = get(r->name, arg);
            if (v == NULL || v[0] == '\0')
                continue; /* empty is unset: `VMMHOOK_X= prog` restores the default */
            why_t why;
            if (set_row(o, r, v, &why) != 0) {
                if (how != WARN_NONE)
                    warn_bad(r, v, why.text, o->strict && r != strict_row, how);
                bad++;
            }
        }
    }
    return bad;
}

int vmh_options_parse(vmh_options_t *o, vmh_getenv_fn get, void *arg, unsigned *nbad)
{
    unsigned bad = parse_rows(o, get, arg, WARN_RUN);
    if (nbad)
        *nbad = bad;
    return (int)bad;
}

unsigned vmh_options_parse_for_check(vmh_options_t *o, vmh_getenv_fn get, void *arg)
{
    return parse_rows(o, get, arg, WARN_CHECK);
}

void vmh_options_print(const vmh_options_t *o)
{
    vmh_options_t d;
    vmh_options_defaults(&d);
    vmh_log("libvmmhook %d.%d.%d, options:", VMM_VERSION_MAJOR, VMM_VERSION_MINOR,
            VMM_VERSION_PATCH);
    for (size_t i = 0; i < vmh_option_nrows; i++) {
        char v[300], q[1100];
        fmt_row(o, &vmh_option_rows[i], v, sizeof(v));
        /* Paths are quoted and escaped: one could hold a newline and forge a log line. */
        if (vmh_option_rows[i].kind == K_STRING && v[0] != '\0')
            vmh_fmt_quoted(q, sizeof(q), v, sizeof(v));
        else
            snprintf(q, sizeof(q), "%s", v[0] ? v : "(none)");
        vmh_log("  %-*s = %s%s", vmh_options_name_width(), vmh_option_rows[i].name, q,
                row_equal(o, &d, &vmh_option_rows[i]) ? " (default)" : "");
    }
}

static const char *row_name_at(size_t i, void *arg)
{
    (void)arg;
    return vmh_option_rows[i].name;
}

/* The row whose name is closest to name[0..n) (after the common "VMMHOOK_"), when it is close
 * enough to be a misspelling of it (optparse.c's rule). NULL otherwise. */
static const opt_row_t *closest_row(const char *name, size_t n)
{
    size_t i =
        vmh_closest_name(name, n, sizeof("VMMHOOK_") - 1, row_name_at, vmh_option_nrows, NULL);
    return i < vmh_option_nrows ? &vmh_option_rows[i] : NULL;
}

/* A name as it may be printed bare: capitals, digits and '_' only (an environment name could
 * hold anything, a newline that would forge a log line included: those are quoted). */
static bool plain_name(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '_'))
            return false;
    return true;
}

int vmh_options_check_unknown(char *const *envp, bool check)
{
    static const char prefix[] = "VMMHOOK_";
    int unknown = 0;
    for (; envp && *envp; envp++) {
        const char *e = *envp;
        if (strncmp(e, prefix, sizeof(prefix) - 1) != 0)
            continue;
        const char *eq = strchr(e, '=');
        size_t n = eq ? (size_t)(eq - e) : strlen(e);
        bool known = false;
        for (size_t i = 0; i < vmh_option_nrows && !known; i++)
            known =
                strlen(vmh_option_rows[i].name) == n && memcmp(vmh_option_rows[i].name, e, n) == 0;
        if (known)
            continue;
        /* A typo would otherwise be silently ignored. Not fatal under VMMHOOK_STRICT: a newer
         * launcher may set a variable this library does not know yet. */
        char q[80];
        char name[72];
        size_t m = n < sizeof(name) - 1 ? n : sizeof(name) - 1;
        memcpy(name, e, m);
        name[m] = '\0';
        if (plain_name(name, m))
            snprintf(q, sizeof(q), "%s", name);
        else
            vmh_fmt_quoted(q, sizeof(q), name, 64);
        const opt_row_t *near = closest_row(e, n);
        const char *what = check ? "unknown" : "unknown variable, ignored";
        if (near)
            vmh_log("%s: %s; did you mean %s?", q, what, near->name);
        else
            vmh_log("%s: %s (%s lists the known ones)", q, what,
                    check ? "the launcher's --help" : "VMMHOOK_VERBOSE=1");
        unknown++;
    }
    return unknown;
}

VMH_TESTABLE int vmh_options_apply(vmh_options_t *o, vmh_getenv_fn get, void *arg)
{
    unsigned bad;
    vmh_options_defaults(o);
    vmh_options_parse(o, get, arg, &bad);
    if (bad > 0 && o->strict) {
        vmh_log_stop();
        return -1; /* only when a test's exit hook returns */
    }
    if (o->verbose)
        vmh_options_print(o);
    return bad ? -1 : 0;
}

const char *vmh_options_env_get(const char *name, void *arg)
{
    (void)arg;
    return secure_getenv(name);
}

size_t vmh_options_changed(const vmh_options_t *o, char *buf, size_t len)
{
    vmh_options_t d;
    vmh_options_defaults(&d);
    size_t n = 0;
    if (len == 0)
        return 0;
    buf[0] = '\0';
    for (size_t i = 0; i < vmh_option_nrows; i++) {
        if (row_equal(o, &d, &vmh_option_rows[i]))
            continue;
        char v[300], q[80];
        fmt_row(o, &vmh_option_rows[i], v, sizeof(v));
        /* Quoted: a path could hold a newline that would forge a log line. */
        vmh_fmt_quoted(q, sizeof(q), v, 64);
        int w = snprintf(buf + n, len - n, "%s%s=%s", n ? " " : "", vmh_option_rows[i].name,
                         vmh_option_rows[i].kind == K_STRING ? q : v);
        if (w < 0 || (size_t)w >= len - n) {
            buf[n] = '\0';
            return n; /* what fits, whole items only */
        }
        n += (size_t)w;
    }
    return n;
}

void vmh_options_announce(vmh_getenv_fn get, void *arg)
{
    vmh_options_t o;
    vmh_options_defaults(&o);
    /* Quietly: warnings and the strict stop belong to the first use by a CUDA program (a
     * process that never uses CUDA is not stopped for a value it never uses). */
    unsigned bad = parse_rows(&o, get, arg, WARN_NONE);
    if (!o.verbose)
        return;
    char changed[700];
    size_t n = vmh_options_changed(&o, changed, sizeof(changed));
    vmh_log("libvmmhook %d.%d.%d loaded (pid %d); options not at their default: %s%s",
            VMM_VERSION_MAJOR, VMM_VERSION_MINOR, VMM_VERSION_PATCH, (int)getpid(),
            n ? changed : "none", bad ? " (and bad values, reported at the first CUDA call)" : "");
}

/* The options as the environment set them, read once by vmh_options_load. */
static vmh_options_t snapshot;

static void load_once(void)
{
    vmh_options_t o;
    /* Parse into a local, publish whole: a reader never sees a half-parsed table. */
    vmh_options_apply(&o, vmh_options_env_get, NULL);
    if (!getauxval(AT_SECURE))
        vmh_options_check_unknown(environ, false);
    snapshot = o;
}

const vmh_options_t *vmh_options_load(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, load_once);
    return &snapshot;
}

/* ---- the table, row by row (vmmhook-config, the tests, the fuzzer) ----------------------------
 */

size_t vmh_options_count(void)
{
    return vmh_option_nrows;
}

const char *vmh_options_name(size_t row)
{
    return row < vmh_option_nrows ? vmh_option_rows[row].name : NULL;
}

const char *vmh_options_default_text(size_t row)
{
    return row < vmh_option_nrows ? vmh_option_rows[row].def : NULL;
}

bool vmh_options_info(size_t row, vmh_option_info_t *out)
{
    if (row >= vmh_option_nrows)
        return false;
    const opt_row_t *r = &vmh_option_rows[row];
    *out = (vmh_option_info_t){r->name,   r->kind,   r->def,  r->help,
                               r->detail, forms(r),  r->min,  r->max,
                               r->words,  r->nwords, r->step, r->later ? r->later : ""};
    return true;
}

int vmh_options_set(vmh_options_t *o, size_t row, const char *value)
{
    why_t why;
    if (row >= vmh_option_nrows)
        return EINVAL;
    return set_row(o, &vmh_option_rows[row], value, &why);
}

int vmh_options_name_width(void)
{
    size_t w = 0;
    for (size_t i = 0; i < vmh_option_nrows; i++)
        if (strlen(vmh_option_rows[i].name) > w)
            w = strlen(vmh_option_rows[i].name);
    return (int)w;
}

const char *vmh_options_later(const vmh_options_t *o, size_t row)
{
    if (row >= vmh_option_nrows || vmh_option_rows[row].later == NULL)
        return NULL;
    const opt_row_t *r = &vmh_option_rows[row];
    switch (r->kind) {
    case K_GRAN: /* min and recommended are the driver's own answers */
        return o->gran_mode == VMH_GRAN_BYTES ? r->later : NULL;
    case K_BOOL: /* off asks nothing of the GPU */
        return *(const bool *)cfield(o, r) ? r->later : NULL;
    case K_ENUM: /* the first word is "none" or "off": nothing asked of the GPU */
        return *(const int *)cfield(o, r) != 0 ? r->later : NULL;
    default:
        return r->later;
    }
}

size_t vmh_options_format(const vmh_options_t *o, size_t row, char *buf, size_t len)
{
    if (row >= vmh_option_nrows) {
        if (len)
            buf[0] = '\0';
        return 0;
    }
    return fmt_row(o, &vmh_option_rows[row], buf, len);
}
