/* Layer 7: the VMMHOOK_* options. One table, one row per variable (name, kind, field, default,
 * help); the defaults live only here, as text that the same parser reads, so a default can never
 * disagree with what the variable accepts. docs/OPTIONS.md documents the same table (a unit test
 * checks that every row and its default appear there).
 *
 * Rules every row follows:
 *  - read once, with secure_getenv (a set-uid program ignores the environment);
 *  - unset or empty: the default;
 *  - blanks around a value are ignored except for paths, which are taken verbatim;
 *  - a bad value: one warning naming the variable, the value (escaped, shortened) and the
 *    accepted forms, and the default is kept; with VMMHOOK_STRICT the program stops instead.
 * Nothing here allocates or uses stdio: the first read can happen inside dlsym or the driver. */
#include "options.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <unistd.h>

#include "log.h"
#include "testable.h"
#include "vmmhook.h"

vmh_options_t vmh_opt;

typedef enum opt_kind {
    K_SIZE,    /* size_t: bytes with an optional suffix */
    K_BOOL,    /* bool */
    K_ENUM,    /* an int-sized enum, one word per value */
    K_GRAN,    /* vmh_gran_mode_t + gran_bytes: a word or a size */
    K_DEVMASK, /* uint64_t bit mask of device ordinals */
    K_STRING,  /* char[]: a path */
    K_COUNT
} opt_kind_t;

typedef struct opt_row {
    const char *name;
    opt_kind_t kind;
    size_t off;               /* offsetof the field in vmh_options_t */
    size_t size;              /* sizeof the field (the buffer size of strings) */
    const char *def;          /* the default, in a form the row accepts */
    size_t min;               /* K_SIZE: the smallest accepted value */
    const char *const *words; /* K_ENUM, K_GRAN: the word of each enum value, in order */
    unsigned nwords;
    const char *help;
} opt_row_t;

/* Enums are stored through an int pointer: gcc and clang give these enums int size. */
_Static_assert(sizeof(vmh_handle_kind_t) == sizeof(int), "enum size");
_Static_assert(sizeof(vmh_gran_mode_t) == sizeof(int), "enum size");

static const char *const handle_words[] = {"none", "posix_fd", "fabric"};
_Static_assert(sizeof(handle_words) / sizeof(handle_words[0]) == VMH_HANDLE_KIND_COUNT, "words");
/* The words of VMH_GRAN_RECOMMENDED and VMH_GRAN_MIN; VMH_GRAN_BYTES is spelled as a size. */
static const char *const gran_words[] = {"recommended", "min"};
_Static_assert(VMH_GRAN_RECOMMENDED == 0 && VMH_GRAN_MIN == 1 && VMH_GRAN_BYTES == 2, "order");

#define FIELD(f) offsetof(vmh_options_t, f), sizeof(((vmh_options_t *)0)->f)
#define WORDS(w) w, (unsigned)(sizeof(w) / sizeof(w[0]))

/* THE options table. Keep docs/OPTIONS.md and tools/launcher/vmmhook in step with it. */
static const opt_row_t rows[] = {
    {"VMMHOOK_GRANULARITY", K_GRAN, FIELD(gran_mode), "recommended", 0, WORDS(gran_words),
     "chunk size of device memory: the driver's minimum or recommended granularity for the "
     "allocation properties in use, or a size that is a multiple of the minimum"},
    {"VMMHOOK_HANDLE_TYPE", K_ENUM, FIELD(handle), "posix_fd", 0, WORDS(handle_words),
     "shareable handle type requested for every chunk; refused with a message when the driver "
     "rejects it on this machine"},
    {"VMMHOOK_HEADROOM", K_SIZE, FIELD(headroom), "1G", 0, NULL, 0,
     "address space reserved past the end of a growing buffer so that it can grow in place "
     "(address space only, no memory)"},
    {"VMMHOOK_VA_LIMIT", K_SIZE, FIELD(va_limit), "64T", 1, NULL, 0,
     "total virtual address space the library may reserve"},
    {"VMMHOOK_CACHE_LIMIT", K_SIZE, FIELD(cache_limit), "1G", 0, NULL, 0,
     "idle device memory kept for reuse, per device; 0 keeps none"},
    {"VMMHOOK_MEM_LIMIT", K_SIZE, FIELD(mem_limit), "0", 0, NULL, 0,
     "device memory served per device; an allocation over it fails with the native "
     "out-of-memory code; 0 is no limit"},
    {"VMMHOOK_PACK_BELOW", K_SIZE, FIELD(pack_below), "8M", 0, NULL, 0,
     "requests smaller than this are packed into shared chunks; 0 packs none"},
    {"VMMHOOK_RDMA", K_BOOL, FIELD(rdma), "off", 0, NULL, 0,
     "request GPUDirect RDMA capable chunks"},
    {"VMMHOOK_PEERS", K_DEVMASK, FIELD(peers), "none", 0, NULL, 0,
     "devices granted access to every chunk up front"},
    {"VMMHOOK_DISABLE", K_BOOL, FIELD(disable), "off", 0, NULL, 0,
     "pure pass-through: every call goes to the driver untouched"},
    {"VMMHOOK_VERBOSE", K_BOOL, FIELD(verbose), "off", 0, NULL, 0,
     "print every resolved option at start, and debug messages"},
    {"VMMHOOK_STATS", K_BOOL, FIELD(stats), "off", 0, NULL, 0, "print a table of counters at exit"},
    {"VMMHOOK_STATS_JSON", K_STRING, FIELD(stats_json), "", 0, NULL, 0,
     "write the counters at exit as JSON to this file (owner-only permissions)"},
    {"VMMHOOK_TRACE", K_STRING, FIELD(trace), "", 0, NULL, 0,
     "write one CSV line per allocation event to this file, in RMM's logging format "
     "(owner-only permissions)"},
    {"VMMHOOK_LEAKS", K_BOOL, FIELD(leaks), "off", 0, NULL, 0,
     "at exit, list the buffers still allocated"},
    {"VMMHOOK_STRICT", K_BOOL, FIELD(strict), "off", 0, NULL, 0,
     "a bad value stops the program (exit status 2) instead of a warning"},
    {"VMMHOOK_FREE_SYNC", K_BOOL, FIELD(free_sync), "off", 0, NULL, 0,
     "every free synchronizes the context like cudaFree instead of being deferred"},
    {"VMMHOOK_PARK_LIMIT", K_SIZE, FIELD(park_limit), "256M", 0, NULL, 0,
     "freed bytes not yet reusable (the GPU may still use them) past which an allocating thread "
     "waits for the GPU itself instead of leaving the wait to the background reclaim"},
    {"VMMHOOK_PIN_LIMIT", K_SIZE, FIELD(pin_limit), "0", 0, NULL, 0,
     "pinned host memory kept between pauses for the backups of vmm_pause(VMM_PAUSE_BACKUP); "
     "0 keeps none (each pause pins and releases its own)"},
};
#define NROWS (sizeof(rows) / sizeof(rows[0]))
_Static_assert(NROWS <= 32, "refused_mask has 32 bits");

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
        return "none, posix_fd, fabric"; /* the only enum row */
    case K_GRAN:
        return "min, recommended, or a size such as 2M or 64M that is a multiple of the "
               "driver's minimum granularity";
    case K_DEVMASK:
        return "all, none, or a comma-separated list of device ordinals 0 to 63, e.g. 0,1,3";
    case K_STRING:
        return "a file path of at most 255 bytes";
    default:
        return "?";
    }
}

/* ---- value parsers ---------------------------------------------------------------------- */

static char lower(char c)
{
    return (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
}

/* s[0..len) equals word (NUL-terminated), ignoring ASCII case. */
static bool word_eq(const char *s, size_t len, const char *word)
{
    size_t i = 0;
    for (; i < len; i++)
        if (word[i] == '\0' || lower(s[i]) != word[i])
            return false;
    return word[i] == '\0';
}

static bool is_blank(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static void trim(const char **s, size_t *len)
{
    while (*len > 0 && is_blank(**s)) {
        (*s)++;
        (*len)--;
    }
    while (*len > 0 && is_blank((*s)[*len - 1]))
        (*len)--;
}

/* Decimal digits, no sign: strtoull would accept "-1" (as 2^64-1), "+5", " 5" and "0x10". */
static int parse_uint(const char *s, size_t len, size_t *used, unsigned long long max,
                      unsigned long long *out)
{
    unsigned long long v = 0;
    size_t i = 0;
    for (; i < len && s[i] >= '0' && s[i] <= '9'; i++) {
        unsigned d = (unsigned)(s[i] - '0');
        if (v > (max - d) / 10)
            return ERANGE;
        v = v * 10 + d;
    }
    if (i == 0)
        return EINVAL;
    *used = i;
    *out = v;
    return 0;
}

VMH_TESTABLE int vmh_parse_size(const char *s, size_t len, size_t *out)
{
    static const struct {
        const char *word;
        unsigned shift;
    } suffixes[] = {
        {"", 0},     {"b", 0},  {"k", 10},  {"kb", 10},  {"kib", 10}, {"m", 20},  {"mb", 20},
        {"mib", 20}, {"g", 30}, {"gb", 30}, {"gib", 30}, {"t", 40},   {"tb", 40}, {"tib", 40},
    };
    unsigned long long v;
    size_t used;
    int rc = parse_uint(s, len, &used, SIZE_MAX, &v);
    if (rc != 0)
        return rc;
    for (size_t i = 0; i < sizeof(suffixes) / sizeof(suffixes[0]); i++) {
        if (!word_eq(s + used, len - used, suffixes[i].word))
            continue;
        if (suffixes[i].shift > 0 && v > (SIZE_MAX >> suffixes[i].shift))
            return ERANGE;
        *out = (size_t)(v << suffixes[i].shift);
        return 0;
    }
    return EINVAL;
}

VMH_TESTABLE int vmh_parse_bool(const char *s, size_t len, bool *out)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    for (size_t i = 0; i < 4; i++) {
        if (word_eq(s, len, yes[i])) {
            *out = true;
            return 0;
        }
        if (word_eq(s, len, no[i])) {
            *out = false;
            return 0;
        }
    }
    return EINVAL;
}

VMH_TESTABLE int vmh_parse_devices(const char *s, size_t len, uint64_t *out)
{
    if (word_eq(s, len, "all")) {
        *out = UINT64_MAX;
        return 0;
    }
    if (word_eq(s, len, "none")) {
        *out = 0;
        return 0;
    }
    uint64_t mask = 0;
    size_t pos = 0;
    for (;;) {
        size_t end = pos;
        while (end < len && s[end] != ',')
            end++;
        const char *item = s + pos;
        size_t n = end - pos;
        trim(&item, &n);
        unsigned long long dev;
        size_t used;
        int rc = parse_uint(item, n, &used, ULLONG_MAX, &dev);
        if (rc == EINVAL || (rc == 0 && used != n))
            return EINVAL; /* empty item ("0,,1", "0,") or not a number */
        if (rc == ERANGE || dev > 63)
            return ERANGE;
        mask |= 1ULL << dev;
        if (end == len)
            break;
        pos = end + 1;
    }
    *out = mask;
    return 0;
}

static int parse_word(const opt_row_t *r, const char *s, size_t len, int *out)
{
    for (unsigned i = 0; i < r->nwords; i++) {
        if (word_eq(s, len, r->words[i])) {
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

/* Sets row r from value (already known non-empty or a default). On failure the field is left
 * as it was and *reason says why in a few words. */
static int set_row(vmh_options_t *o, const opt_row_t *r, const char *value, const char **reason)
{
    size_t len = strlen(value);
    const char *s = value;
    int rc;
    if (r->kind != K_STRING)
        trim(&s, &len);
    *reason = "not one of the accepted forms";

    switch (r->kind) {
    case K_SIZE: {
        size_t v;
        rc = vmh_parse_size(s, len, &v);
        if (rc == ERANGE)
            *reason = "too large";
        if (rc == 0 && v < r->min) {
            *reason = "too small";
            rc = ERANGE;
        }
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
            *reason = "too large";
        if (rc == 0 && bytes == 0) {
            *reason = "a granularity of 0";
            rc = ERANGE;
        }
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
            *reason = "a device ordinal above 63";
        if (rc == 0)
            *(uint64_t *)field(o, r) = v;
        return rc;
    }
    case K_STRING:
        if (len >= r->size) {
            *reason = "longer than 255 bytes";
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
    for (size_t i = 0; i < NROWS; i++)
        if (strcmp(rows[i].name, name) == 0)
            return &rows[i];
    return NULL;
}

/* ---- the table, as a whole ---------------------------------------------------------------- */

VMH_TESTABLE void (*vmh_options_exit)(int status) = _exit;

void vmh_options_defaults(vmh_options_t *o)
{
    memset(o, 0, sizeof(*o));
    for (size_t i = 0; i < NROWS; i++) {
        const char *reason;
        /* Cannot fail: test_options checks that every default parses. */
        (void)set_row(o, &rows[i], rows[i].def, &reason);
    }
}

static void warn_bad(const opt_row_t *r, const char *value, const char *reason, bool strict)
{
    char q[80], def[64];
    vmh_fmt_quoted(q, sizeof(q), value, 64);
    if (strict) {
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

VMH_TESTABLE int vmh_options_parse(vmh_options_t *o, vmh_getenv_fn get, void *arg, unsigned *nbad)
{
    unsigned bad = 0;
    /* VMMHOOK_STRICT first: the warnings of the other rows say whether the program stops. */
    const opt_row_t *strict_row = find_row("VMMHOOK_STRICT");
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < NROWS; i++) {
            const opt_row_t *r = &rows[i];
            if ((pass == 0) != (r == strict_row))
                continue;
            const char *v = get(r->name, arg);
            if (v == NULL || v[0] == '\0')
                continue; /* empty is unset: `VMMHOOK_X= prog` restores the default */
            const char *reason;
            if (set_row(o, r, v, &reason) != 0) {
                warn_bad(r, v, reason, o->strict && r != strict_row);
                bad++;
            }
        }
    }
    if (nbad)
        *nbad = bad;
    return (int)bad;
}

VMH_TESTABLE void vmh_options_print(const vmh_options_t *o)
{
    vmh_options_t d;
    vmh_options_defaults(&d);
    vmh_log("libvmmhook %d.%d.%d, options:", VMM_VERSION_MAJOR, VMM_VERSION_MINOR,
            VMM_VERSION_PATCH);
    for (size_t i = 0; i < NROWS; i++) {
        char v[300], q[1100];
        fmt_row(o, &rows[i], v, sizeof(v));
        /* Paths are quoted and escaped: one could hold a newline and forge a log line. */
        if (rows[i].kind == K_STRING && v[0] != '\0')
            vmh_fmt_quoted(q, sizeof(q), v, sizeof(v));
        else
            snprintf(q, sizeof(q), "%s", v[0] ? v : "(none)");
        vmh_log("  %-20s = %s%s", rows[i].name, q, row_equal(o, &d, &rows[i]) ? " (default)" : "");
    }
}

VMH_TESTABLE int vmh_options_check_unknown(char *const *envp)
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
        for (size_t i = 0; i < NROWS && !known; i++)
            known = strlen(rows[i].name) == n && memcmp(rows[i].name, e, n) == 0;
        if (known)
            continue;
        /* A typo would otherwise be silently ignored. Not fatal under VMMHOOK_STRICT: a newer
         * launcher may set a variable this library does not know yet. */
        char q[80];
        char name[72];
        size_t m = n < sizeof(name) - 1 ? n : sizeof(name) - 1;
        memcpy(name, e, m);
        name[m] = '\0';
        vmh_fmt_quoted(q, sizeof(q), name, 64);
        vmh_log("unknown variable %s ignored (VMMHOOK_VERBOSE=1 lists the known ones)", q);
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
        vmh_options_exit(2);
        return -1; /* only when a test's exit hook returns */
    }
    if (o->verbose)
        vmh_options_print(o);
    return bad ? -1 : 0;
}

static const char *env_get(const char *name, void *arg)
{
    (void)arg;
    return secure_getenv(name);
}

static void load_once(void)
{
    vmh_options_t o;
    /* Parse into a local, publish whole: a reader never sees a half-parsed table. */
    vmh_options_apply(&o, env_get, NULL);
    if (!getauxval(AT_SECURE))
        vmh_options_check_unknown(environ);
    vmh_opt = o;
    /* The log sits below the options and never reads them: tell it. */
    vmh_log_set_verbose(o.verbose);
}

const vmh_options_t *vmh_options_load(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, load_once);
    return &vmh_opt;
}

/* ---- checks that need the driver ------------------------------------------------------------ */

const char *vmh_handle_kind_name(vmh_handle_kind_t k)
{
    return (unsigned)k < VMH_HANDLE_KIND_COUNT ? handle_words[k] : "?";
}

bool vmh_options_check_granularity(const vmh_options_t *o, size_t min_gran, size_t rec_gran,
                                   size_t *out, char *why, size_t whylen)
{
    if (min_gran == 0)
        min_gran = 1; /* the driver never answers 0; do not divide by it if it does */
    /* The recommended granularity is a multiple of the minimum on every driver seen; fall back
     * to the minimum if one ever answers otherwise, since cuMemMap needs the multiple. */
    size_t rec = (rec_gran != 0 && rec_gran % min_gran == 0) ? rec_gran : min_gran;
    if (whylen)
        why[0] = '\0';
    switch (o->gran_mode) {
    case VMH_GRAN_MIN:
        *out = min_gran;
        return true;
    case VMH_GRAN_BYTES:
        if (o->gran_bytes != 0 && o->gran_bytes % min_gran == 0) {
            *out = o->gran_bytes;
            return true;
        }
        if (whylen) {
            char m[32];
            snprintf(why, whylen,
                     "not a multiple of the driver's minimum granularity %zu (%s) for these "
                     "allocation properties",
                     min_gran, vmh_fmt_bytes(m, sizeof(m), min_gran));
        }
        *out = rec;
        return false;
    case VMH_GRAN_RECOMMENDED:
    default:
        *out = rec;
        return true;
    }
}

size_t vmh_options_granularity(size_t min_gran, size_t rec_gran)
{
    size_t g;
    char why[160];
    if (!vmh_options_check_granularity(&vmh_opt, min_gran, rec_gran, &g, why, sizeof(why))) {
        char instead[80], b[32];
        snprintf(instead, sizeof(instead), "the recommended granularity %s",
                 vmh_fmt_bytes(b, sizeof(b), g));
        vmh_options_refuse("VMMHOOK_GRANULARITY", why, instead);
    }
    return g;
}

static _Atomic uint32_t refused_mask;

void vmh_options_refuse(const char *name, const char *why, const char *instead)
{
    const opt_row_t *r = find_row(name);
    char v[300], q[80];
    if (r) {
        uint32_t bit = 1u << (unsigned)(r - rows);
        if (!vmh_opt.strict && (atomic_fetch_or(&refused_mask, bit) & bit))
            return; /* one warning per variable, however many devices ask */
        fmt_row(&vmh_opt, r, v, sizeof(v));
        vmh_fmt_quoted(q, sizeof(q), v, 64);
    } else {
        snprintf(q, sizeof(q), "(unknown)");
    }
    if (vmh_opt.strict) {
        vmh_log("%s=%s is refused: %s; accepted: %s; stopping because VMMHOOK_STRICT is set", name,
                q, why, r ? forms(r) : "?");
        vmh_options_exit(2);
        return;
    }
    vmh_log("%s=%s is refused: %s; accepted: %s; using %s", name, q, why, r ? forms(r) : "?",
            instead);
}

#ifdef VMH_TESTING
/* Row accessors for the unit tests and the fuzzer only. */

size_t vmh_options_count(void)
{
    return NROWS;
}

const char *vmh_options_name(size_t row)
{
    return row < NROWS ? rows[row].name : NULL;
}

const char *vmh_options_default_text(size_t row)
{
    return row < NROWS ? rows[row].def : NULL;
}

int vmh_options_set(vmh_options_t *o, size_t row, const char *value)
{
    const char *reason;
    if (row >= NROWS)
        return EINVAL;
    return set_row(o, &rows[row], value, &reason);
}

size_t vmh_options_format(const vmh_options_t *o, size_t row, char *buf, size_t len)
{
    if (row >= NROWS) {
        if (len)
            buf[0] = '\0';
        return 0;
    }
    return fmt_row(o, &rows[row], buf, len);
}

void vmh_options_refuse_reset(void)
{
    atomic_store(&refused_mask, 0);
}
#endif
