/* Unit tests of src/stats.c: counters and peaks under threads, the RMM-format trace (format,
 * permissions, whole lines under threads, refusal) and its gauges companion file, the JSON
 * report (checked by a small JSON validator written here), the stats table and the leak
 * report. */
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

static void capture(const char *line, size_t len)
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
static void fake_exit(int status)
{
    (void)status;
    exit_calls++;
}

static char tmpdir[64];
static vmh_options_t opt; /* what the tests configure stats.c with (through lifetime.c) */

static int setup(void **state)
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

static int teardown(void **state)
{
    (void)state;
    vmh_trace_close();
    opt.trace[0] = '\0';
    vmh_lifetime_configure_stats(&opt);
    return 0;
}

static void path_in_tmp(char *buf, size_t len, const char *name)
{
    snprintf(buf, len, "%s/%s", tmpdir, name);
}

/* The whole file into a static buffer. */
static char *slurp(const char *path, size_t *len)
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

static mode_t mode_of(const char *path)
{
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    return st.st_mode & 07777;
}

/* ---- counters and gauges -------------------------------------------------------------------- */

static void test_counters(void **state)
{
    (void)state;
    vmh_count(VMH_STAT_served_allocs, 1);
    vmh_count(VMH_STAT_served_allocs, 41);
    vmh_count(VMH_STAT_moves, 3);
    assert_int_equal(vmh_counter_get(VMH_STAT_served_allocs), 42);
    assert_int_equal(vmh_counter_get(VMH_STAT_moves), 3);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs), 0);
    /* Out-of-range ids are ignored, not written out of bounds. */
    vmh_count(VMH_COUNTER_COUNT, 1);
    vmh_gauge_add(VMH_GAUGE_COUNT, 1);
    assert_int_equal(vmh_counter_get(VMH_COUNTER_COUNT), 0);
    vmh_stats_reset();
    assert_int_equal(vmh_counter_get(VMH_STAT_served_allocs), 0);
}

static void test_gauge_peak(void **state)
{
    (void)state;
    vmh_gauge_add(VMH_STAT_bytes_mapped, 10);
    vmh_gauge_add(VMH_STAT_bytes_mapped, 5);
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_mapped), 15);
    assert_int_equal(vmh_gauge_peak(VMH_STAT_bytes_mapped), 15);
    vmh_gauge_add(VMH_STAT_bytes_mapped, -12);
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_mapped), 3);
    assert_int_equal(vmh_gauge_peak(VMH_STAT_bytes_mapped), 15);
    vmh_gauge_add(VMH_STAT_bytes_mapped, 1);
    assert_int_equal(vmh_gauge_peak(VMH_STAT_bytes_mapped), 15);
    vmh_gauge_add(VMH_STAT_bytes_mapped, 20);
    assert_int_equal(vmh_gauge_peak(VMH_STAT_bytes_mapped), 24);
    assert_int_equal(vmh_gauge_peak(VMH_STAT_bytes_reserved), 0);
}

#define NTHREADS 8
#define NITER 200000

static pthread_barrier_t barrier;

static void *hammer(void *arg)
{
    (void)arg;
    for (int i = 0; i < NITER; i++) {
        vmh_count(VMH_STAT_served_allocs, 1);
        vmh_gauge_add(VMH_STAT_bytes_requested, 256);
        vmh_gauge_add(VMH_STAT_bytes_requested, -256);
    }
    /* Everyone holds 1000 bytes at once, then lets go: the peak must see all of them. */
    vmh_gauge_add(VMH_STAT_bytes_cached, 1000);
    pthread_barrier_wait(&barrier);
    vmh_gauge_add(VMH_STAT_bytes_cached, -1000);
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    pthread_t t[NTHREADS];
    pthread_barrier_init(&barrier, NULL, NTHREADS);
    for (int i = 0; i < NTHREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, hammer, NULL), 0);
    for (int i = 0; i < NTHREADS; i++)
        pthread_join(t[i], NULL);
    pthread_barrier_destroy(&barrier);
    assert_int_equal(vmh_counter_get(VMH_STAT_served_allocs), (uint64_t)NTHREADS * NITER);
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_requested), 0);
    int64_t p = vmh_gauge_peak(VMH_STAT_bytes_requested);
    assert_true(p >= 256 && p <= 256 * NTHREADS && p % 256 == 0);
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_cached), 0);
    assert_int_equal(vmh_gauge_peak(VMH_STAT_bytes_cached), 1000 * NTHREADS);
}

/* ---- trace ------------------------------------------------------------------------------------
 */

/* One trace line as RMM's logging adaptor writes it:
 * Thread,HH:MM:SS.uuuuuu,Action,0xPointer,Size,Stream. */
static bool check_line(const char *line, long *tid, char *action, unsigned long long *ptr,
                       unsigned long long *size, char *stream)
{
    char f[6][64];
    int nf = 0;
    const char *p = line;
    for (;;) {
        const char *c = strchr(p, ',');
        size_t n = c ? (size_t)(c - p) : strlen(p);
        if (nf == 6 || n >= sizeof(f[0]))
            return false;
        memcpy(f[nf], p, n);
        f[nf++][n] = '\0';
        if (!c)
            break;
        p = c + 1;
    }
    if (nf != 6)
        return false;
    char *end;
    *tid = strtol(f[0], &end, 10);
    if (*end || *tid <= 0)
        return false;
    /* HH:MM:SS.uuuuuu */
    const char *t = f[1];
    if (strlen(t) != 15)
        return false;
    for (int i = 0; i < 15; i++) {
        bool want_digit = !(i == 2 || i == 5 || i == 8);
        if (want_digit ? !isdigit((unsigned char)t[i]) : t[i] != (i == 8 ? '.' : ':'))
            return false;
    }
    if (atoi(t + 3) > 59 || atoi(t + 6) > 59)
        return false;
    strcpy(action, f[2]);
    if (strncmp(f[3], "0x", 2) != 0)
        return false;
    *ptr = strtoull(f[3] + 2, &end, 16);
    if (*end || f[3][2] == '\0')
        return false;
    *size = strtoull(f[4], &end, 10);
    if (*end || f[4][0] == '\0')
        return false;
    strcpy(stream, f[5]);
    /* What RMM's replay parser makes of the stream column (std::stoul, base 10): must be 0. */
    if (strtoul(stream, NULL, 10) != 0 || !isdigit((unsigned char)stream[0]))
        return false;
    return true;
}

static void test_trace_format(void **state)
{
    (void)state;
    char path[128];
    path_in_tmp(path, sizeof(path), "trace.csv");
    /* An existing world-readable file with content: made 0600 and truncated. */
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "old content\n", 12), 12);
    fchmod(fd, 0644);
    close(fd);

    snprintf(opt.trace, sizeof(opt.trace), "%s", path);

    vmh_lifetime_configure_stats(&opt);
    errno = 777;
    vmh_trace("allocate", (CUdeviceptr)0x7f3a40000000ULL, 1048576, NULL);
    assert_int_equal(errno, 777);
    vmh_trace("free", (CUdeviceptr)0x7f3a40000000ULL, 1048576, (CUstream)(uintptr_t)0x5581c2d0);
    vmh_trace("allocate failure", 0, (size_t)64 << 30, (CUstream)(uintptr_t)0x2);
    assert_int_equal(loglines, 0);
    assert_int_equal(mode_of(path), 0600);

    char *text = slurp(path, NULL);
    const char *header = "Thread,Time,Action,Pointer,Size,Stream\n";
    assert_memory_equal(text, header, strlen(header));
    char *lines[3];
    char *save;
    strtok_r(text, "\n", &save);
    for (int i = 0; i < 3; i++)
        assert_non_null(lines[i] = strtok_r(NULL, "\n", &save));
    assert_null(strtok_r(NULL, "\n", &save));

    long tid;
    char action[64], stream[64];
    unsigned long long ptr, size;
    assert_true(check_line(lines[0], &tid, action, &ptr, &size, stream));
    assert_int_equal(tid, (long)syscall(SYS_gettid));
    assert_string_equal(action, "allocate");
    assert_true(ptr == 0x7f3a40000000ULL);
    assert_int_equal(size, 1048576);
    assert_string_equal(stream, "0");
    assert_memory_equal(lines[0] + strlen(lines[0]) - 25, ",0x7f3a40000000,1048576,0", 25);
    assert_true(strncmp(strchr(lines[0], ',') + 1, "00:00:0", 7) == 0);

    assert_true(check_line(lines[1], &tid, action, &ptr, &size, stream));
    assert_string_equal(action, "free");
    assert_string_equal(stream, "0x5581c2d0");

    assert_true(check_line(lines[2], &tid, action, &ptr, &size, stream));
    assert_string_equal(action, "allocate failure");
    assert_true(ptr == 0);
    assert_true(size == 64ull << 30);
    assert_string_equal(stream, "0x2");
    assert_non_null(strstr(lines[2], ",allocate failure,0x0,68719476736,0x2"));
}

static void test_trace_new_file_private(void **state)
{
    (void)state;
    char path[128];
    path_in_tmp(path, sizeof(path), "fresh.csv");
    unlink(path);
    mode_t old = umask(0); /* even with a permissive umask */
    snprintf(opt.trace, sizeof(opt.trace), "%s", path);
    vmh_lifetime_configure_stats(&opt);
    vmh_trace("allocate", 0x1000, 1, NULL); /* opens on first use */
    umask(old);
    assert_int_equal(mode_of(path), 0600);
    size_t n;
    char *text = slurp(path, &n);
    assert_non_null(strstr(text, "Thread,Time,Action,Pointer,Size,Stream\n"));
    assert_non_null(strstr(text, ",allocate,0x1000,1,0\n"));
}

#define TTHREADS 8
#define TLINES 2000

static void *tracer(void *arg)
{
    uintptr_t id = (uintptr_t)arg;
    for (int i = 0; i < TLINES; i++)
        vmh_trace(i % 2 ? "free" : "allocate",
                  (CUdeviceptr)(0x7f0000000000ULL + id * 0x100000000ULL + (uint64_t)i * 512),
                  (size_t)i * 1000 + id, NULL);
    return NULL;
}

static void test_trace_threads(void **state)
{
    (void)state;
    char path[128];
    path_in_tmp(path, sizeof(path), "threads.csv");
    snprintf(opt.trace, sizeof(opt.trace), "%s", path);
    vmh_lifetime_configure_stats(&opt);
    pthread_t t[TTHREADS];
    for (uintptr_t i = 0; i < TTHREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, tracer, (void *)i), 0);
    for (int i = 0; i < TTHREADS; i++)
        pthread_join(t[i], NULL);

    char *text = slurp(path, NULL);
    char *save;
    char *line = strtok_r(text, "\n", &save);
    assert_string_equal(line, "Thread,Time,Action,Pointer,Size,Stream");
    int count = 0;
    long tids[TTHREADS] = {0};
    int per[TTHREADS] = {0};
    while ((line = strtok_r(NULL, "\n", &save)) != NULL) {
        long tid;
        char action[64], stream[64];
        unsigned long long ptr, size;
        if (!check_line(line, &tid, action, &ptr, &size, stream))
            fail_msg("malformed (interleaved?) line %d: \"%s\"", count, line);
        /* The line is internally consistent: its pointer and size name the same thread. */
        unsigned id = (unsigned)((ptr - 0x7f0000000000ULL) >> 32);
        assert_true(id < TTHREADS);
        assert_int_equal(size % 1000, id);
        if (tids[id] == 0)
            tids[id] = tid;
        assert_int_equal(tids[id], tid);
        per[id]++;
        count++;
    }
    assert_int_equal(count, TTHREADS * TLINES);
    for (int i = 0; i < TTHREADS; i++)
        assert_int_equal(per[i], TLINES);
}

static void test_trace_unwritable(void **state)
{
    (void)state;
    snprintf(opt.trace, sizeof(opt.trace), "%s/no/such/dir/t.csv", tmpdir);
    vmh_lifetime_configure_stats(&opt);
    vmh_trace("allocate", 0x1000, 1, NULL);
    vmh_trace("allocate", 0x2000, 1, NULL);
    assert_int_equal(loglines, 1);
    assert_non_null(strstr(logbuf, "vmmhook: VMMHOOK_TRACE=\""));
    assert_non_null(strstr(logbuf, "\" is refused: cannot create it: No such file or directory"));
    assert_non_null(strstr(logbuf, "; using no trace\n"));
    assert_int_equal(exit_calls, 0);
}

static void test_trace_unwritable_strict(void **state)
{
    (void)state;
    opt.strict = true;
    snprintf(opt.trace, sizeof(opt.trace), "%s/no/such/dir/t.csv", tmpdir);
    vmh_lifetime_configure_stats(&opt);
    assert_int_equal(exit_calls, 1);
    assert_non_null(strstr(logbuf, "stopping because VMMHOOK_STRICT is set"));
}

/* A symbolic link planted at the trace path is not followed. */
static void test_trace_symlink_refused(void **state)
{
    (void)state;
    char target[128], link[128];
    path_in_tmp(target, sizeof(target), "victim");
    path_in_tmp(link, sizeof(link), "link.csv");
    int fd = open(target, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "precious\n", 9), 9);
    close(fd);
    unlink(link);
    assert_int_equal(symlink(target, link), 0);
    snprintf(opt.trace, sizeof(opt.trace), "%s", link);
    vmh_lifetime_configure_stats(&opt);
    vmh_trace("allocate", 0x1000, 1, NULL);
    assert_int_equal(loglines, 1);
    assert_non_null(strstr(logbuf, "is refused: it is a symbolic link"));
    assert_string_equal(slurp(target, NULL), "precious\n");
    assert_int_equal(mode_of(target), 0644);
}

static void test_trace_off(void **state)
{
    (void)state;
    vmh_trace("allocate", 0x1000, 1, NULL);
    vmh_lifetime_configure_stats(&opt);
    assert_int_equal(loglines, 0);
}

/* ---- the gauges companion of the trace -----------------------------------------------------
 */

static const char gauges_header[] = "Time,Requested,Mapped,Reserved,Cached\n";

static bool is_time(const char *t, size_t len)
{
    if (len != 15)
        return false;
    for (size_t i = 0; i < 15; i++) {
        bool want_digit = !(i == 2 || i == 5 || i == 8);
        if (want_digit ? !isdigit((unsigned char)t[i]) : t[i] != (i == 8 ? '.' : ':'))
            return false;
    }
    return true;
}

/* One companion line: HH:MM:SS.uuuuuu,Requested,Mapped,Reserved,Cached (signed decimals). */
static bool check_gauges_line(const char *line, char time[16], long long v[4])
{
    const char *c = strchr(line, ',');
    if (!c || !is_time(line, (size_t)(c - line)))
        return false;
    memcpy(time, line, 15);
    time[15] = '\0';
    for (int i = 0; i < 4; i++) {
        if (*c != ',')
            return false;
        const char *f = c + 1;
        if (!(isdigit((unsigned char)f[0]) || (f[0] == '-' && isdigit((unsigned char)f[1]))))
            return false;
        char *end;
        errno = 0;
        v[i] = strtoll(f, &end, 10);
        if (errno != 0)
            return false;
        c = end;
    }
    return *c == '\0';
}

/* The Time field of a trace line, into time[16]. */
static void trace_time(const char *line, char time[16])
{
    const char *c = strchr(line, ',');
    assert_non_null(c);
    assert_true(is_time(c + 1, 15) && c[16] == ',');
    memcpy(time, c + 1, 15);
    time[15] = '\0';
}

/* Splits text (modified) into lines; returns how many, at most max. */
static int split_lines(char *text, char **lines, int max)
{
    int n = 0;
    char *save, *l = strtok_r(text, "\n", &save);
    while (l && n < max) {
        lines[n++] = l;
        l = strtok_r(NULL, "\n", &save);
    }
    assert_null(l);
    return n;
}

#define GEVENTS 6

static void test_gauges_companion(void **state)
{
    (void)state;
    char path[128], gpath[160];
    path_in_tmp(path, sizeof(path), "g.csv");
    snprintf(gpath, sizeof(gpath), "%s.gauges.csv", path);
    unlink(path);
    /* A stale, world-readable companion: made 0600 and truncated. */
    int fd = open(gpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "old content\n", 12), 12);
    fchmod(fd, 0644);
    close(fd);

    snprintf(opt.trace, sizeof(opt.trace), "%s", path);

    vmh_lifetime_configure_stats(&opt);
    /* Present from the start, like the trace: just the header. */
    assert_int_equal(mode_of(gpath), 0600);
    assert_string_equal(slurp(gpath, NULL), gauges_header);

    /* Each event with the gauges moved first, as the heap does; the values include 0, more
     * than 32 bits and a negative one (a bookkeeping bug upstream shows, not wraps). */
    static const int64_t delta[GEVENTS][4] = {
        {1048576, 2097152, (int64_t)1 << 30, 0},
        {256, 0, 0, 0},
        {0, 0, 0, 0}, /* a failure: nothing moves */
        {-1048576, 0, 0, 1048576},
        {(int64_t)5 << 32, (int64_t)5 << 32, (int64_t)6 << 32, -1048576},
        {-((int64_t)5 << 32) - 512, 0, 0, -7},
    };
    static const char *const action[GEVENTS] = {"allocate", "allocate", "allocate failure",
                                                "free",     "allocate", "free"};
    static const vmh_gauge_t g[4] = {VMH_STAT_bytes_requested, VMH_STAT_bytes_mapped,
                                     VMH_STAT_bytes_reserved, VMH_STAT_bytes_cached};
    long long want[GEVENTS][4];
    for (int e = 0; e < GEVENTS; e++) {
        for (int k = 0; k < 4; k++) {
            vmh_gauge_add(g[k], delta[e][k]);
            want[e][k] = vmh_gauge_get(g[k]);
        }
        errno = 4242;
        vmh_trace(action[e], e == 2 ? 0 : 0x7f0000000000ULL + (uint64_t)e * 0x100000, 4096, NULL);
        assert_int_equal(errno, 4242);
    }
    assert_int_equal(loglines, 0);
    assert_true(want[3][3] == 1048576 && want[5][3] == -7 &&
                want[4][2] == ((int64_t)6 << 32) + (1 << 30));

    /* The RMM CSV is as before: its header and one 6-field line per event. */
    static char trace_copy[1 << 16];
    snprintf(trace_copy, sizeof(trace_copy), "%s", slurp(path, NULL));
    char *tl[GEVENTS + 2];
    assert_int_equal(split_lines(trace_copy, tl, GEVENTS + 2), GEVENTS + 1);
    assert_string_equal(tl[0], "Thread,Time,Action,Pointer,Size,Stream");
    for (int e = 0; e < GEVENTS; e++) {
        long tid;
        char act[64], stream[64];
        unsigned long long ptr, size;
        assert_true(check_line(tl[e + 1], &tid, act, &ptr, &size, stream));
        assert_string_equal(act, action[e]);
    }

    assert_int_equal(mode_of(gpath), 0600);
    char *text = slurp(gpath, NULL);
    assert_memory_equal(text, gauges_header, strlen(gauges_header));
    char *gl[GEVENTS + 2];
    assert_int_equal(split_lines(text, gl, GEVENTS + 2), GEVENTS + 1);
    assert_string_equal(gl[0], "Time,Requested,Mapped,Reserved,Cached");
    for (int e = 0; e < GEVENTS; e++) {
        char t[16], tt[16];
        long long v[4];
        if (!check_gauges_line(gl[e + 1], t, v))
            fail_msg("malformed gauges line %d: \"%s\"", e, gl[e + 1]);
        trace_time(tl[e + 1], tt);
        assert_string_equal(t, tt); /* the Time of the trace line it goes with */
        for (int k = 0; k < 4; k++)
            if (v[k] != want[e][k])
                fail_msg("line %d column %d: %lld, want %lld", e, k + 1, v[k], want[e][k]);
    }
    assert_non_null(strstr(gl[6], ",-256,21476933632,26843545600,-7"));
}

static int cmp_time(const void *a, const void *b)
{
    return strcmp((const char *)a, (const char *)b);
}

/* Under threads: one whole companion line per trace line, and the same Times in both files. */
static void test_gauges_threads(void **state)
{
    (void)state;
    char path[128], gpath[160];
    path_in_tmp(path, sizeof(path), "gthreads.csv");
    snprintf(gpath, sizeof(gpath), "%s.gauges.csv", path);
    snprintf(opt.trace, sizeof(opt.trace), "%s", path);
    vmh_lifetime_configure_stats(&opt);
    vmh_gauge_add(VMH_STAT_bytes_reserved, 123456789);
    pthread_t t[TTHREADS];
    for (uintptr_t i = 0; i < TTHREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, tracer, (void *)i), 0);
    for (int i = 0; i < TTHREADS; i++)
        pthread_join(t[i], NULL);

    enum { N = TTHREADS * TLINES };
    static char times_t[N][16], times_g[N][16];
    char *save, *line;
    int n = 0;
    char *text = slurp(path, NULL);
    line = strtok_r(text, "\n", &save);
    while ((line = strtok_r(NULL, "\n", &save)) != NULL) {
        assert_true(n < N);
        trace_time(line, times_t[n++]);
    }
    assert_int_equal(n, N);

    n = 0;
    text = slurp(gpath, NULL);
    line = strtok_r(text, "\n", &save);
    assert_string_equal(line, "Time,Requested,Mapped,Reserved,Cached");
    while ((line = strtok_r(NULL, "\n", &save)) != NULL) {
        long long v[4];
        assert_true(n < N);
        if (!check_gauges_line(line, times_g[n], v))
            fail_msg("malformed (interleaved?) gauges line %d: \"%s\"", n, line);
        assert_true(v[0] == 0 && v[1] == 0 && v[2] == 123456789 && v[3] == 0);
        n++;
    }
    assert_int_equal(n, N);
    qsort(times_t, N, 16, cmp_time);
    qsort(times_g, N, 16, cmp_time);
    assert_memory_equal(times_t, times_g, sizeof(times_t));
}

/* A symbolic link planted at the companion's path is not followed: one warning, and the trace
 * goes on without gauges. */
static void gauges_symlink(bool strict)
{
    char path[128], gpath[160], target[128];
    path_in_tmp(path, sizeof(path), "gl.csv");
    path_in_tmp(target, sizeof(target), "gvictim");
    snprintf(gpath, sizeof(gpath), "%s.gauges.csv", path);
    int fd = open(target, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "precious\n", 9), 9);
    fchmod(fd, 0644);
    close(fd);
    unlink(gpath);
    assert_int_equal(symlink(target, gpath), 0);
    opt.strict = strict;
    snprintf(opt.trace, sizeof(opt.trace), "%s", path);
    vmh_lifetime_configure_stats(&opt);
    vmh_trace("allocate", 0x1000, 1, NULL);
    vmh_trace("free", 0x1000, 1, NULL);
    assert_int_equal(loglines, 1);
    assert_non_null(strstr(logbuf, "vmmhook: VMMHOOK_TRACE=\""));
    assert_non_null(strstr(logbuf, "\" is refused: its gauges file, the path + \".gauges.csv\": "
                                   "it is a symbolic link"));
    assert_int_equal(exit_calls, strict ? 1 : 0);
    if (!strict)
        assert_non_null(strstr(logbuf, "; using the trace without gauges\n"));
    assert_string_equal(slurp(target, NULL), "precious\n");
    assert_int_equal(mode_of(target), 0644);
    char *text = slurp(path, NULL);
    assert_non_null(strstr(text, ",allocate,0x1000,1,0\n"));
    assert_non_null(strstr(text, ",free,0x1000,1,0\n"));
    unlink(gpath);
}

static void test_gauges_symlink_refused(void **state)
{
    (void)state;
    gauges_symlink(false);
}

static void test_gauges_symlink_strict(void **state)
{
    (void)state;
    gauges_symlink(true);
}

/* ---- output files: FIFOs, other users' files, %p ------------------------------------------- */

/* Runs what(path) in a child with an alarm, so that an open that blocks fails the test (the
 * child is killed) instead of stalling the suite. The child's verdict is its exit status. */
static void in_child_with_alarm(int (*what)(const char *), const char *path)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        alarm(5);
        _exit(what(path));
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (WIFSIGNALED(status))
        fail_msg("the child was killed by signal %d (SIGALRM %d: it hung)", WTERMSIG(status),
                 SIGALRM);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}

/* Child: a trace at a FIFO nobody reads is refused at once (without O_NONBLOCK the open waits
 * for a reader forever). */
static int trace_at(const char *path)
{
    snprintf(opt.trace, sizeof(opt.trace), "%s", path);
    vmh_lifetime_configure_stats(&opt);
    vmh_trace("allocate", 0x1000, 1, NULL);
    return loglines == 1 && strstr(logbuf, "is refused: it is not a regular file") ? 0 : 3;
}

/* Child: the JSON report at a FIFO nobody reads: refused at exit, no hang. */
static int json_at(const char *path)
{
    snprintf(opt.stats_json, sizeof(opt.stats_json), "%s", path);
    vmh_lifetime_configure_stats(&opt);
    vmh_stats_report();
    return loglines == 1 && strstr(logbuf, "it is not a regular file") &&
                   strstr(logbuf, "; no JSON report")
               ? 0
               : 3;
}

static void test_fifo_refused(void **state)
{
    (void)state;
    char path[128], gpath[160];
    path_in_tmp(path, sizeof(path), "fifo");
    snprintf(gpath, sizeof(gpath), "%s.gauges.csv", path);
    unlink(path);
    assert_int_equal(mkfifo(path, 0600), 0);
    in_child_with_alarm(trace_at, path);
    in_child_with_alarm(json_at, path);

    /* With a reader the open succeeds, and the type check refuses it: nothing is written. */
    int rd = open(path, O_RDONLY | O_NONBLOCK);
    assert_true(rd >= 0);
    assert_int_equal(trace_at(path), 0);
    assert_int_equal(access(gpath, F_OK), -1);
    char buf[64];
    assert_true(read(rd, buf, sizeof(buf)) <= 0);
    close(rd);
    unlink(path);
}

/* A device is not a regular file either. */
static void test_device_refused(void **state)
{
    (void)state;
    assert_int_equal(trace_at("/dev/null"), 0);
}

static uid_t other_uid(void)
{
    return geteuid() + 4242;
}

/* An existing file of another user is neither truncated nor made 0600, even by root (faked
 * here: the process pretends to run as another uid). A file it creates itself is fine. */
static void test_other_users_file_refused(void **state)
{
    (void)state;
    char path[128], jpath[128], fresh[128];
    path_in_tmp(path, sizeof(path), "theirs.csv");
    path_in_tmp(jpath, sizeof(jpath), "theirs.json");
    path_in_tmp(fresh, sizeof(fresh), "fresh.csv");
    unlink(fresh);
    for (int i = 0; i < 2; i++) {
        const char *p = i ? jpath : path;
        int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        assert_true(fd >= 0);
        assert_int_equal(write(fd, "theirs\n", 7), 7);
        fchmod(fd, 0644);
        close(fd);
    }
    vmh_stats_euid = other_uid;
    snprintf(opt.trace, sizeof(opt.trace), "%s", path);
    snprintf(opt.stats_json, sizeof(opt.stats_json), "%s", jpath);
    vmh_lifetime_configure_stats(&opt);
    vmh_trace("allocate", 0x1000, 1, NULL);
    vmh_stats_report();
    vmh_trace_close();
    snprintf(opt.trace, sizeof(opt.trace), "%s", fresh);
    vmh_lifetime_configure_stats(&opt);
    vmh_trace("allocate", 0x1000, 1, NULL);
    vmh_stats_euid = geteuid;

    assert_string_equal(slurp(path, NULL), "theirs\n");
    assert_int_equal(mode_of(path), 0644);
    assert_string_equal(slurp(jpath, NULL), "theirs\n");
    assert_int_equal(mode_of(jpath), 0644);
    char want[96];
    snprintf(want, sizeof(want), "it belongs to uid %u, not to this process's uid %u",
             (unsigned)geteuid(), (unsigned)other_uid());
    assert_non_null(strstr(logbuf, "VMMHOOK_TRACE=\""));
    assert_non_null(strstr(strstr(logbuf, "VMMHOOK_TRACE=\""), want));
    assert_non_null(strstr(logbuf, "VMMHOOK_STATS_JSON=\""));
    assert_non_null(strstr(strstr(logbuf, "VMMHOOK_STATS_JSON=\""), want));
    assert_int_equal(loglines, 2);
    assert_non_null(strstr(slurp(fresh, NULL), ",allocate,0x1000,1,0\n"));
    unlink(path);
    unlink(jpath);
    unlink(fresh);
}

static void test_expand_path(void **state)
{
    (void)state;
    static const struct {
        const char *tmpl, *want;
    } cases[] = {
        {"/tmp/t.csv", "/tmp/t.csv"},
        {"/tmp/t.%p.csv", "/tmp/t.4711.csv"},
        {"%p-%p", "4711-4711"},
        {"100%%", "100%"},
        {"%%p", "%p"},
        {"a%xb", "a%xb"},
        {"end%", "end%"},
        {"", ""},
    };
    char out[64];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        assert_true(vmh_expand_path(cases[i].tmpl, 4711, out, sizeof(out)));
        assert_string_equal(out, cases[i].want);
    }
    assert_false(vmh_expand_path("abc%p", 4711, out, 7)); /* "abc4711" needs 8 */
    assert_true(vmh_expand_path("abc%p", 4711, out, 8));
    assert_false(vmh_expand_path("abcdefgh", 1, out, 8));
}

/* Child for the %p test: traces one event and writes its JSON, as a second process would. */
static int trace_and_report(const char *tmpl)
{
    vmh_trace_close();
    vmh_stats_reset();
    snprintf(opt.trace, sizeof(opt.trace), "%s.csv", tmpl);
    snprintf(opt.stats_json, sizeof(opt.stats_json), "%s.json", tmpl);
    vmh_lifetime_configure_stats(&opt);
    vmh_trace("allocate", (CUdeviceptr)getpid(), 1, NULL);
    vmh_stats_report();
    return loglines == 0 ? 0 : 3;
}

/* Two processes with the same VMMHOOK_TRACE and VMMHOOK_STATS_JSON containing %p write
 * distinct files, each its own events. */
static void test_pid_in_paths(void **state)
{
    (void)state;
    char tmpl[128];
    path_in_tmp(tmpl, sizeof(tmpl), "run.%p");
    in_child_with_alarm(trace_and_report, tmpl);
    assert_int_equal(trace_and_report(tmpl), 0);
    vmh_trace_close();

    DIR *dir = opendir(tmpdir);
    assert_non_null(dir);
    int csv = 0, json = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        long pid;
        char ext[8], path[320];
        if (sscanf(e->d_name, "run.%ld.%7s", &pid, ext) != 2)
            continue;
        snprintf(path, sizeof(path), "%s/%s", tmpdir, e->d_name);
        char want[64];
        if (strcmp(ext, "csv") == 0) {
            snprintf(want, sizeof(want), ",allocate,0x%lx,1,0\n", pid);
            assert_non_null(strstr(slurp(path, NULL), want));
            csv++;
        } else if (strcmp(ext, "json") == 0) {
            snprintf(want, sizeof(want), "\"pid\": %ld,", pid);
            assert_non_null(strstr(slurp(path, NULL), want));
            json++;
        }
        unlink(path);
    }
    closedir(dir);
    assert_int_equal(csv, 2);
    assert_int_equal(json, 2);
}

/* ---- JSON -------------------------------------------------------------------------------------
 */

/* A strict little JSON validator (RFC 8259 structure; enough to prove the report parses). */
typedef struct jp {
    const char *p;
} jp_t;

static void ws(jp_t *j)
{
    while (*j->p == ' ' || *j->p == '\n' || *j->p == '\t' || *j->p == '\r')
        j->p++;
}

static bool jvalue(jp_t *j, int depth);

static bool jstring(jp_t *j)
{
    if (*j->p != '"')
        return false;
    j->p++;
    while (*j->p && *j->p != '"') {
        if ((unsigned char)*j->p < 0x20)
            return false;
        if (*j->p == '\\') {
            j->p++;
            if (!strchr("\"\\/bfnrtu", *j->p) || !*j->p)
                return false;
        }
        j->p++;
    }
    if (*j->p != '"')
        return false;
    j->p++;
    return true;
}

static bool jnumber(jp_t *j)
{
    const char *s = j->p;
    if (*j->p == '-')
        j->p++;
    if (!isdigit((unsigned char)*j->p))
        return false;
    if (*j->p == '0' && isdigit((unsigned char)j->p[1]))
        return false;
    while (isdigit((unsigned char)*j->p))
        j->p++;
    if (*j->p == '.' || *j->p == 'e' || *j->p == 'E')
        return false; /* the report has integers only */
    return j->p > s;
}

static bool jvalue(jp_t *j, int depth)
{
    if (depth > 16)
        return false;
    ws(j);
    if (*j->p == '{' || *j->p == '[') {
        char close = *j->p == '{' ? '}' : ']';
        bool obj = close == '}';
        j->p++;
        ws(j);
        if (*j->p == close) {
            j->p++;
            return true;
        }
        for (;;) {
            ws(j);
            if (obj) {
                if (!jstring(j))
                    return false;
                ws(j);
                if (*j->p++ != ':')
                    return false;
            }
            if (!jvalue(j, depth + 1))
                return false;
            ws(j);
            if (*j->p == ',') {
                j->p++;
                continue;
            }
            if (*j->p == close) {
                j->p++;
                return true;
            }
            return false;
        }
    }
    if (*j->p == '"')
        return jstring(j);
    if (strncmp(j->p, "null", 4) == 0 || strncmp(j->p, "true", 4) == 0) {
        j->p += 4;
        return true;
    }
    if (strncmp(j->p, "false", 5) == 0) {
        j->p += 5;
        return true;
    }
    return jnumber(j);
}

static bool json_valid(const char *text)
{
    jp_t j = {text};
    if (!jvalue(&j, 0))
        return false;
    ws(&j);
    return *j.p == '\0';
}

static void test_json_validator(void **state)
{
    (void)state;
    assert_true(json_valid("{\"a\": [1, -2, {\"b\": null}], \"c\": \"x\\\"y\"}"));
    assert_false(json_valid("{\"a\": 1,}"));
    assert_false(json_valid("{\"a\" 1}"));
    assert_false(json_valid("{\"a\": 01}"));
    assert_false(json_valid("{\"a\": 1} x"));
    assert_false(json_valid("{\"a\": [1, 2}"));
}

static void test_json_report(void **state)
{
    (void)state;
    char path[128];
    path_in_tmp(path, sizeof(path), "stats.json");
    unlink(path);
    snprintf(opt.stats_json, sizeof(opt.stats_json), "%s", path);
    vmh_lifetime_configure_stats(&opt);
    vmh_count(VMH_STAT_served_allocs, 120);
    vmh_count(VMH_STAT_passthrough_calls, 4);
    vmh_count(VMH_STAT_grows_in_place, 7);
    vmh_gauge_add(VMH_STAT_bytes_mapped, (int64_t)3 << 30);
    vmh_gauge_add(VMH_STAT_bytes_mapped, -((int64_t)1 << 30));
    vmh_leak_report_begin();
    vmh_leak_report_one(0x7f0000000000ULL, 4096, 0, NULL);
    vmh_leak_report_end();
    vmh_stats_report();
    assert_int_equal(loglines, 0); /* VMMHOOK_STATS and VMMHOOK_LEAKS are off */
    assert_int_equal(mode_of(path), 0600);
    char *text = slurp(path, NULL);
    if (!json_valid(text))
        fail_msg("invalid JSON:\n%s", text);
    assert_non_null(strstr(text, "\"served_allocs\": 120,"));
    assert_non_null(strstr(text, "\"passthrough_calls\": 4,"));
    assert_non_null(strstr(text, "\"grows_in_place\": 7,"));
    assert_non_null(strstr(text, "\"oom_retries\": 0,"));
    assert_non_null(strstr(text, "\"ooms\": 0\n"));
    assert_non_null(
        strstr(text, "\"bytes_mapped\": {\"current\": 2147483648, \"peak\": 3221225472}"));
    assert_non_null(strstr(text, "\"leaks\": {\"count\": 1, \"bytes\": 4096}"));
    assert_non_null(strstr(text, "\"version\": \""));

    /* Once per process: a second call writes nothing. */
    unlink(path);
    vmh_stats_report();
    assert_int_equal(access(path, F_OK), -1);
}

static void test_json_no_leak_report(void **state)
{
    (void)state;
    char path[128];
    path_in_tmp(path, sizeof(path), "stats2.json");
    /* An existing, longer, world-readable file: replaced whole and made private. */
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0666);
    assert_true(fd >= 0);
    static char junk[20000];
    memset(junk, '#', sizeof(junk));
    assert_int_equal(write(fd, junk, sizeof(junk)), (ssize_t)sizeof(junk));
    fchmod(fd, 0666);
    close(fd);
    snprintf(opt.stats_json, sizeof(opt.stats_json), "%s", path);
    vmh_lifetime_configure_stats(&opt);
    vmh_stats_report();
    assert_int_equal(mode_of(path), 0600);
    char *text = slurp(path, NULL);
    if (!json_valid(text))
        fail_msg("invalid JSON:\n%s", text);
    assert_non_null(strstr(text, "\"leaks\": null"));
}

static void test_json_unwritable(void **state)
{
    (void)state;
    snprintf(opt.stats_json, sizeof(opt.stats_json), "%s/no/dir/s.json", tmpdir);
    vmh_lifetime_configure_stats(&opt);
    vmh_stats_report();
    assert_int_equal(loglines, 1);
    assert_non_null(strstr(logbuf, "cannot create it"));
}

/* ---- the table at exit ------------------------------------------------------------------------
 */

static void test_stats_table(void **state)
{
    (void)state;
    opt.stats = true;
    vmh_lifetime_configure_stats(&opt);
    vmh_count(VMH_STAT_served_allocs, 12345);
    vmh_count(VMH_STAT_syncs, 3);
    vmh_gauge_add(VMH_STAT_bytes_reserved, (int64_t)3 << 29);
    vmh_stats_report();
    /* A header, one line per counter and per gauge. */
    assert_int_equal(loglines, 1 + VMH_COUNTER_COUNT + VMH_GAUGE_COUNT);
    assert_non_null(strstr(logbuf, "vmmhook: statistics (pid "));
    static const char *const labels[] = {
        "allocations served",
        "calls passed to the driver",
        "driver calls made by the library",
        "context synchronizations",
        "grows that kept the pointer",
        "grows that moved the buffer",
        "bytes requested by live buffers",
        "bytes of device memory mapped",
        "bytes of address space reserved",
        "bytes held idle for reuse",
    };
    for (size_t i = 0; i < sizeof(labels) / sizeof(labels[0]); i++)
        if (!strstr(logbuf, labels[i]))
            fail_msg("table lacks \"%s\":\n%s", labels[i], logbuf);
    const char *l = strstr(logbuf, "allocations served");
    assert_non_null(l);
    assert_true(strstr(l, "12345\n") < strchr(l, '\n') + 1);
    l = strstr(logbuf, "bytes of address space reserved");
    assert_non_null(strstr(l, "now      1.5 GiB  peak      1.5 GiB (1610612736 bytes)"));
}

/* ---- leak report ------------------------------------------------------------------------------
 */

static void leaky_call_site(void) {}

static void test_leak_report(void **state)
{
    (void)state;
    opt.leaks = true;
    vmh_lifetime_configure_stats(&opt);
    vmh_leak_report_begin();
    vmh_leak_report_one(0x7f0000001000ULL, 4096, 1, (void *)((uintptr_t)&leaky_call_site + 4));
    vmh_leak_report_one(0x7f0000200000ULL, (size_t)3 << 20, 0, (void *)(uintptr_t)&_assert_true);
    vmh_leak_report_one(0x7f0000400000ULL, 256, 0, NULL);
    vmh_leak_report_end();
    assert_int_equal(loglines, 5);
    assert_non_null(strstr(logbuf, "vmmhook: leak report: buffers still allocated at exit:\n"));
    assert_non_null(strstr(logbuf, "vmmhook:   0x7f0000001000  4096 bytes (4 KiB)  device 1  "
                                   "allocated from "));
    /* A shared library's symbol: "name+0x0 (libfoo.so.N)"; cmocka's, which no sanitizer
     * intercepts. */
    const char *l = strstr(logbuf, "0x7f0000200000  3145728 bytes (3 MiB)  device 0  allocated "
                                   "from ");
    assert_non_null(l);
    const char *eol = strchr(l, '\n');
    const char *sym = strstr(l, "_assert_true+0x0 (libcmocka.so");
    assert_true(sym != NULL && sym < eol && eol[-1] == ')');
    /* No call site recorded: nothing said about it. */
    assert_non_null(strstr(logbuf, "0x7f0000400000  256 bytes (256 B)  device 0\n"));
    assert_non_null(strstr(logbuf, "vmmhook: leak report: 3 buffers, 3.0 MiB (3150080 bytes) "
                                   "still allocated at exit\n"));
}

static void test_leak_report_none(void **state)
{
    (void)state;
    opt.leaks = true;
    vmh_lifetime_configure_stats(&opt);
    vmh_leak_report_begin();
    vmh_leak_report_end();
    assert_int_equal(loglines, 1);
    assert_string_equal(logbuf, "vmmhook: leak report: no buffer left allocated\n");
}

static void test_leak_report_off(void **state)
{
    (void)state;
    vmh_leak_report_begin();
    vmh_leak_report_one(0x1000, 1, 0, NULL);
    vmh_leak_report_end();
    assert_int_equal(loglines, 0);
}

static void test_leak_report_capped(void **state)
{
    (void)state;
    opt.leaks = true;
    vmh_lifetime_configure_stats(&opt);
    vmh_leak_report_begin();
    for (int i = 0; i < 1000; i++)
        vmh_leak_report_one(0x100000ULL * (uint64_t)(i + 1), 512, 0, NULL);
    vmh_leak_report_end();
    assert_int_equal(loglines, 1 + 256 + 1);
    assert_non_null(strstr(logbuf, "leak report: 1000 buffers, 500 KiB (512000 bytes) still "
                                   "allocated at exit (the first 256 listed)\n"));
}

static int group_setup(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/vmh_test_stats.XXXXXX");
    assert_non_null(mkdtemp(tmpdir));
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_counters),
        T(test_gauge_peak),
        T(test_threads),
        T(test_trace_format),
        T(test_trace_new_file_private),
        T(test_trace_threads),
        T(test_trace_unwritable),
        T(test_trace_unwritable_strict),
        T(test_trace_symlink_refused),
        T(test_trace_off),
        T(test_gauges_companion),
        T(test_gauges_threads),
        T(test_gauges_symlink_refused),
        T(test_gauges_symlink_strict),
        T(test_fifo_refused),
        T(test_device_refused),
        T(test_other_users_file_refused),
        T(test_expand_path),
        T(test_pid_in_paths),
        T(test_json_validator),
        T(test_json_report),
        T(test_json_no_leak_report),
        T(test_json_unwritable),
        T(test_stats_table),
        T(test_leak_report),
        T(test_leak_report_none),
        T(test_leak_report_off),
        T(test_leak_report_capped),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
