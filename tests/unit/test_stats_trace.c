/* Unit tests of src/util/stats.c's RMM-format trace (format, permissions, whole lines under
 * threads, refusal of an unwritable path or a symbolic link, off) and of its gauges file. */
#include "stats_fixture.h"

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
    int copied = snprintf(trace_copy, sizeof(trace_copy), "%s", slurp(path, NULL));
    assert_true(copied < (int)sizeof(trace_copy)); /* the whole file, every line checked */
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

int main(void)
{
    const struct CMUnitTest tests[] = {
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
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
