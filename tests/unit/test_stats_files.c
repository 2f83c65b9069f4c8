/* Unit tests of how src/util/stats.c opens its output files (trace and JSON report): a FIFO does
 * not hang the program, a device or another user's file is refused, and %p expands to the pid. */
#include "stats_fixture.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_fifo_refused),
        T(test_device_refused),
        T(test_other_users_file_refused),
        T(test_expand_path),
        T(test_pid_in_paths),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
