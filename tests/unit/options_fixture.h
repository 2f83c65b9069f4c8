/* Shared by the suites of the options table (src/util/options.c) and the log line writer
 * (src/util/log.c): test_options_parse.c, test_options_strict.c, test_log.c.
 *
 * The parser is driven through a fake environment (vmh_options_parse/apply take a lookup
 * function), the log sink is replaced to capture the exact warning text, and strict mode's exit
 * goes through a hook that records the status instead of ending the test. The refusal policy
 * for values the machine refuses later is lifetime.c's (vmh_lifetime_refuse), tested with the
 * options it names values from (opt, made at each setup). Header-only (static) like testutil.h,
 * so that each suite stays one program of one file; include it first. */
#ifndef VMH_OPTIONS_FIXTURE_H
#define VMH_OPTIONS_FIXTURE_H

#ifndef VMH_TESTING
#define VMH_TESTING 1 /* the internal prototypes of options.h and log.h */
#endif

#include <errno.h>
#include <limits.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "lifetime.h"
#include "log.h"
#include "options.h"
#include "optparse.h"
#include "vmmhook.h"

/* ---- fixtures: captured log, fake environment, exit hook ---------------------------------- */

static char logbuf[1 << 16];
static size_t loglen;
static int loglines;

static inline void capture(const char *line, size_t len)
{
    if (loglen + len < sizeof(logbuf)) {
        memcpy(logbuf + loglen, line, len);
        loglen += len;
        logbuf[loglen] = '\0';
    }
    loglines++;
}

static inline void log_reset(void)
{
    loglen = 0;
    logbuf[0] = '\0';
    loglines = 0;
}

#define MAXENV 32
typedef struct fake_env {
    const char *name[MAXENV];
    const char *value[MAXENV];
    int n;
} fake_env_t;

static inline const char *fake_get(const char *name, void *arg)
{
    fake_env_t *e = arg;
    for (int i = 0; i < e->n; i++)
        if (strcmp(e->name[i], name) == 0)
            return e->value[i];
    return NULL;
}

static inline void env_set(fake_env_t *e, const char *name, const char *value)
{
    assert_true(e->n < MAXENV);
    e->name[e->n] = name;
    e->value[e->n] = value;
    e->n++;
}

static void (*real_exit)(int status); /* the library's strict stop, saved by the first setup */
static vmh_options_t opt;             /* the options the refusal policy reads (lifetime.c) */
static int exit_calls, exit_status;
static inline void fake_exit(int status)
{
    exit_calls++;
    exit_status = status;
}

static inline int setup(void **state)
{
    (void)state;
    if (!real_exit)
        real_exit = vmh_log_exit;
    vmh_log_sink = capture;
    vmh_log_exit = fake_exit;
    exit_calls = 0;
    exit_status = -1;
    log_reset();
    vmh_options_defaults(&opt);
    vmh_lifetime_configure(&opt); /* a refusal names its value from opt */
    vmh_lifetime_refuse_reset();
    return 0;
}

static inline size_t row_of(const char *name)
{
    for (size_t i = 0; i < vmh_options_count(); i++)
        if (strcmp(vmh_options_name(i), name) == 0)
            return i;
    fail_msg("no row %s", name);
    return 0;
}

#endif
