/* libFuzzer target for the VMMHOOK_* option parser (src/util/options.c) and the log line writer.
 *
 * Input: NUL-separated values; value i is the environment value of table row i (an environment
 * value cannot hold a NUL, so NUL is the one byte that needs no escaping).
 *
 * Besides "no crash, no sanitizer report", every run checks:
 *  - each warning is exactly one line, bounded in length (a value cannot forge log lines);
 *  - the size parser agrees with an independent reference (128-bit arithmetic);
 *  - every resolved value formats to text that its row accepts again, giving the same value;
 *  - parsing is idempotent, and a bad value leaves its field at the default.
 * The granularity chosen from VMMHOOK_GRANULARITY is device.c's (test_device.c). Strict mode's
 * exit goes through a hook that counts instead of exiting. */
#ifndef VMH_TESTING
#define VMH_TESTING 1
#endif

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "options.h"
#include "optparse.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c))                                                                                  \
            __builtin_trap();                                                                      \
    } while (0)

static unsigned lines;

static void sink(const char *line, size_t len)
{
    CHECK(len >= 10 && len <= VMH_LOG_LINE_MAX);
    CHECK(memcmp(line, "vmmhook: ", 9) == 0);
    CHECK(line[len - 1] == '\n');
    CHECK(memchr(line, '\n', len - 1) == NULL);
    CHECK(memchr(line, '\0', len) == NULL);
    lines++;
}

static unsigned exits;
static void no_exit(int status)
{
    CHECK(status == 2);
    exits++;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    vmh_log_sink = sink;
    vmh_log_exit = no_exit;
    return 0;
}

#define MAXV 32
typedef struct env {
    const char *value[MAXV];
} env_t;

static const char *get(const char *name, void *arg)
{
    const env_t *e = arg;
    for (size_t i = 0; i < vmh_options_count() && i < MAXV; i++)
        if (strcmp(vmh_options_name(i), name) == 0)
            return e->value[i];
    return NULL;
}

/* The reference size parser: digits, then a suffix; overflow of the digits first. */
static int ref_size(const char *s, size_t len, size_t *out)
{
    static const char *const sfx[] = {"",    "b", "k",  "kb",  "kib", "m",  "mb",
                                      "mib", "g", "gb", "gib", "t",   "tb", "tib"};
    static const unsigned shift[] = {0, 0, 10, 10, 10, 20, 20, 20, 30, 30, 30, 40, 40, 40};
    unsigned __int128 v = 0;
    bool over = false;
    size_t i = 0;
    for (; i < len && s[i] >= '0' && s[i] <= '9'; i++) {
        v = v * 10 + (unsigned)(s[i] - '0');
        if (v > SIZE_MAX) {
            over = true;
            v = (unsigned __int128)SIZE_MAX + 1; /* keep it from overflowing 128 bits */
        }
    }
    if (i == 0)
        return EINVAL;
    if (over)
        return ERANGE;
    char low[8];
    size_t n = len - i;
    if (n >= sizeof(low))
        return EINVAL;
    for (size_t k = 0; k < n; k++)
        low[k] = (char)((s[i + k] >= 'A' && s[i + k] <= 'Z') ? s[i + k] + 32 : s[i + k]);
    low[n] = '\0';
    if (memchr(s + i, '\0', n))
        return EINVAL;
    for (size_t k = 0; k < sizeof(sfx) / sizeof(sfx[0]); k++) {
        if (strcmp(low, sfx[k]) != 0)
            continue;
        v <<= shift[k];
        if (v > SIZE_MAX)
            return ERANGE;
        *out = (size_t)v;
        return 0;
    }
    return EINVAL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char buf[8192];
    if (size >= sizeof(buf))
        return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';

    /* Split into values. */
    env_t e = {{0}};
    size_t nrows = vmh_options_count();
    const char *p = buf;
    for (size_t i = 0; i < nrows && i < MAXV && p <= buf + size; i++) {
        e.value[i] = p;
        p += strlen(p) + 1;
    }

    /* The value parsers alone, on every value, against the reference for sizes. */
    for (size_t i = 0; i < MAXV && e.value[i]; i++) {
        const char *v = e.value[i];
        size_t len = strlen(v), a = 0, b = 0;
        int ra = vmh_parse_size(v, len, &a), rb = ref_size(v, len, &b);
        CHECK(ra == rb);
        CHECK(ra != 0 || a == b);
        bool bo;
        (void)vmh_parse_bool(v, len, &bo);
        uint64_t m;
        (void)vmh_parse_devices(v, len, &m);
    }

    /* The whole table. */
    vmh_options_t o, d, again;
    vmh_options_defaults(&d);
    unsigned nbad = 0;
    lines = 0;
    exits = 0;
    int rc = vmh_options_apply(&o, get, &e);
    CHECK(rc != 0 || exits == 0);
    vmh_options_defaults(&again);
    (void)vmh_options_parse(&again, get, &e, &nbad);
    CHECK(memcmp(&again, &o, sizeof(o)) == 0); /* deterministic */
    CHECK(exits <= 1);
    CHECK(exits == 0 || (o.strict && nbad > 0));

    for (size_t i = 0; i < nrows; i++) {
        char text[512], text2[512];
        vmh_options_format(&o, i, text, sizeof(text));
        vmh_options_t r;
        vmh_options_defaults(&r);
        /* The formatted value is accepted again (an empty string is the unset default). */
        if (text[0] != '\0')
            CHECK(vmh_options_set(&r, i, text) == 0);
        vmh_options_format(&r, i, text2, sizeof(text2));
        CHECK(strcmp(text, text2) == 0);
    }

    /* A value the row refused left the default in place: parse each value alone. */
    for (size_t i = 0; i < nrows && e.value[i]; i++) {
        vmh_options_t one = d;
        if (vmh_options_set(&one, i, e.value[i]) != 0)
            CHECK(memcmp(&one, &d, sizeof(d)) == 0);
    }

    /* The bound of VMMHOOK_GRANULARITY holds for whatever was accepted. */
    CHECK(o.gran_mode != VMH_GRAN_BYTES ||
          (o.gran_bytes > 0 && o.gran_bytes <= VMH_GRANULARITY_MAX));

    /* The load line's list: terminated, whole items only, whatever the buffer size. */
    for (size_t cap = 1; cap <= 1024; cap *= 4) {
        char changed[1024];
        memset(changed, 'x', sizeof(changed));
        size_t n = vmh_options_changed(&o, changed, cap);
        CHECK(n < cap && changed[n] == '\0' && strlen(changed) == n);
        CHECK(n == 0 || strncmp(changed, "VMMHOOK_", 8) == 0);
    }
    return 0;
}
