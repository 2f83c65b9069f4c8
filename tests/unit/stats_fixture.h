/* Shared by the suites of src/util/stats.c (test_stats_counters.c, test_stats_trace.c,
 * test_stats_files.c, test_stats_reports.c): the log captured, options::exit replaced by a
 * counter, a temporary directory for the output files (made once per program), the options
 * the tests configure stats.c with, and small file helpers. Header-only (static) like
 * testutil.h, so that each suite stays one program of one file; include it first. */
#ifndef VMH_STATS_FIXTURE_H
#define VMH_STATS_FIXTURE_H

#ifndef VMH_TESTING
#define VMH_TESTING 1 /* the internal prototypes of the headers */
#endif

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "lifetime.h"
#include "log.h"
#include "options.h"
#include "optparse.h"
#include "stats.h"

/* ---- fixtures ----------------------------------------------------------------------------- */

static char logbuf[1 << 17];
static size_t loglen;
static int loglines;
static pthread_mutex_t loglock = PTHREAD_MUTEX_INITIALIZER;

static inline void capture(const char *line, size_t len)
{
    pthread_mutex_lock(&loglock);
    if (loglen + len < sizeof(logbuf)) {
        memcpy(logbuf + loglen, line, len);
        loglen += len;
        logbuf[loglen] = '\0';
    }
    loglines++;
    pthread_mutex_unlock(&loglock);
}

static int exit_calls;
static inline void fake_exit(int status)
{
    (void)status;
    exit_calls++;
}

static char tmpdir[64];
static vmh_options_t opt; /* what the tests configure stats.c with (through lifetime.c) */

static inline int setup(void **state)
{
    (void)state;
    vmh_log_sink = capture;
    vmh_log_exit = fake_exit;
    exit_calls = 0;
    loglen = 0;
    logbuf[0] = '\0';
    loglines = 0;
    vmh_lifetime_refuse_reset();
    vmh_trace_close();
    vmh_stats_reset();
    vmh_options_defaults(&opt);
    vmh_lifetime_configure_stats(&opt);
    return 0;
}

static inline int teardown(void **state)
{
    (void)state;
    vmh_trace_close();
    opt.trace[0] = '\0';
    vmh_lifetime_configure_stats(&opt);
    return 0;
}

static inline void path_in_tmp(char *buf, size_t len, const char *name)
{
    snprintf(buf, len, "%s/%s", tmpdir, name);
}

/* The whole file into a static buffer. */
static inline char *slurp(const char *path, size_t *len)
{
    static char buf[1 << 20];
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    size_t n = 0;
    ssize_t r;
    while ((r = read(fd, buf + n, sizeof(buf) - 1 - n)) > 0)
        n += (size_t)r;
    close(fd);
    buf[n] = '\0';
    if (len)
        *len = n;
    return buf;
}

static inline mode_t mode_of(const char *path)
{
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    return st.st_mode & 07777;
}

/* cmocka's group fixtures: the temporary directory, made once per program. */
static inline int group_setup(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/vmh_test_stats.XXXXXX");
    assert_non_null(mkdtemp(tmpdir));
    return 0;
}

static inline int group_teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

/* A test with the fixtures above. */
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

#endif
