/* Unit tests of what the options do with a bad or unknown value and what they print
 * (src/util/options.c): the strict stop (the hook, and the real one in a child), verbose, unknown
 * names and their suggestions, the check's form of the warnings, values the machine refuses
 * later (lifetime.c's policy), the VMMHOOK_VERBOSE load line. The values themselves:
 * test_options_parse.c; the set-up: options_fixture.h. */
#include "options_fixture.h"

/* ---- strict and verbose ------------------------------------------------------------------------
 */

static void test_strict_stops(void **state)
{
    (void)state;
    fake_env_t e = {0};
    env_set(&e, "VMMHOOK_CACHE_LIMIT", "12Q");
    env_set(&e, "VMMHOOK_STRICT", "yes");
    vmh_options_t o;
    assert_int_equal(vmh_options_apply(&o, fake_get, &e), -1);
    assert_int_equal(exit_calls, 1);
    assert_int_equal(exit_status, 2);
    assert_int_equal(loglines, 1);
    assert_non_null(strstr(logbuf, "VMMHOOK_CACHE_LIMIT=\"12Q\" is not valid"));
    assert_non_null(strstr(logbuf, "accepted: "));
    assert_non_null(strstr(logbuf, "stopping because VMMHOOK_STRICT is set"));
    assert_null(strstr(logbuf, "using the default"));
}

static void test_strict_all_good(void **state)
{
    (void)state;
    fake_env_t e = {0};
    env_set(&e, "VMMHOOK_CACHE_LIMIT", "12M");
    env_set(&e, "VMMHOOK_STRICT", "1");
    vmh_options_t o;
    assert_int_equal(vmh_options_apply(&o, fake_get, &e), 0);
    assert_int_equal(exit_calls, 0);
    assert_int_equal(loglines, 0);
    assert_int_equal(o.cache_limit, 12 << 20);
}

/* A bad VMMHOOK_STRICT itself is a warning, and strict stays off. */
static void test_strict_bad_itself(void **state)
{
    (void)state;
    fake_env_t e = {0};
    env_set(&e, "VMMHOOK_STRICT", "very");
    env_set(&e, "VMMHOOK_RDMA", "x");
    vmh_options_t o;
    assert_int_equal(vmh_options_apply(&o, fake_get, &e), -1);
    assert_int_equal(exit_calls, 0);
    assert_int_equal(loglines, 2);
    assert_false(o.strict);
}

static void test_verbose_lists_all(void **state)
{
    (void)state;
    fake_env_t e = {0};
    env_set(&e, "VMMHOOK_VERBOSE", "1");
    env_set(&e, "VMMHOOK_PACK_BELOW", "64K");
    env_set(&e, "VMMHOOK_PEERS", "0,2");
    vmh_options_t o;
    assert_int_equal(vmh_options_apply(&o, fake_get, &e), 0);
    assert_int_equal(loglines, 1 + (int)vmh_options_count());
    assert_non_null(strstr(logbuf, "vmmhook: libvmmhook "));
    for (size_t i = 0; i < vmh_options_count(); i++) {
        char want[64];
        snprintf(want, sizeof(want), "vmmhook:   %s ", vmh_options_name(i));
        char *line = strstr(logbuf, want);
        if (line == NULL)
            fail_msg("verbose output lacks %s:\n%s", vmh_options_name(i), logbuf);
        char *end = strchr(line, '\n');
        bool changed =
            strstr(want, "VERBOSE") || strstr(want, "PACK_BELOW") || strstr(want, "PEERS");
        bool marked = strstr(line, "(default)") != NULL && strstr(line, "(default)") < end;
        if (changed == marked)
            fail_msg("line %.*s: (default) marker wrong", (int)(end - line), line);
    }
    assert_non_null(strstr(logbuf, "VMMHOOK_PACK_BELOW       = 64K\n"));
    assert_non_null(strstr(logbuf, "VMMHOOK_PEERS            = 0,2\n"));
    assert_non_null(strstr(logbuf, "VMMHOOK_GRANULARITY      = recommended (default)\n"));
    assert_non_null(strstr(logbuf, "VMMHOOK_VA_LIMIT         = 64T (default)\n"));
    assert_non_null(strstr(logbuf, "VMMHOOK_TRACE            = (none) (default)\n"));
    assert_non_null(strstr(logbuf, "VMMHOOK_OVERFLOW_RESERVE = 4G (default)\n"));
    /* One column of '=', after the longest name (issue 37: three names pushed it out). */
    int width = vmh_options_name_width(), col = -1;
    assert_int_equal(width, (int)strlen("VMMHOOK_OVERFLOW_RESERVE"));
    for (size_t i = 0; i < vmh_options_count(); i++) {
        char want[64];
        snprintf(want, sizeof(want), "vmmhook:   %s ", vmh_options_name(i));
        const char *line = strstr(logbuf, want), *eq = strstr(line, " = ");
        if (col < 0)
            col = (int)(eq - line);
        if ((int)(eq - line) != col)
            fail_msg("the '=' of %s is at column %d, not %d", vmh_options_name(i), (int)(eq - line),
                     col);
    }
}

static void test_not_verbose_silent(void **state)
{
    (void)state;
    fake_env_t e = {0};
    env_set(&e, "VMMHOOK_STATS", "1");
    vmh_options_t o;
    assert_int_equal(vmh_options_apply(&o, fake_get, &e), 0);
    assert_int_equal(loglines, 0);
}

static void test_unknown_variables(void **state)
{
    (void)state;
    char *envp[] = {"PATH=/bin",
                    "VMMHOOK_GRANULARTY=64M",
                    "VMMHOOK_STATS=1",
                    "VMMHOOK_=x",
                    "VMMHOOKX=1",
                    "VMMHOOK_TRACE",
                    NULL};
    assert_int_equal(vmh_options_check_unknown(envp, false), 2);
    assert_int_equal(loglines, 2);
    assert_non_null(strstr(logbuf, "vmmhook: VMMHOOK_GRANULARTY: unknown variable, ignored; did "
                                   "you mean VMMHOOK_GRANULARITY?\n"));
    assert_non_null(strstr(logbuf, "vmmhook: VMMHOOK_: unknown variable, ignored "
                                   "(VMMHOOK_VERBOSE=1 lists the known ones)\n"));
    /* For vmmhook-config --check, which fails on them: "unknown", not "ignored". */
    log_reset();
    assert_int_equal(vmh_options_check_unknown(envp, true), 2);
    assert_non_null(strstr(logbuf, "vmmhook: VMMHOOK_GRANULARTY: unknown; did you mean "
                                   "VMMHOOK_GRANULARITY?\n"));
    assert_non_null(strstr(logbuf, "vmmhook: VMMHOOK_: unknown (the launcher's --help lists"));
}

/* The closest known name is suggested when it is near enough to be a misspelling of it. */
static void test_unknown_suggestions(void **state)
{
    (void)state;
    static const struct {
        const char *var, *suggested; /* NULL: none */
    } cases[] = {
        {"VMMHOOK_GRANULARTY=2M", "VMMHOOK_GRANULARITY"},  /* a letter left out */
        {"VMMHOOK_GRANUALRITY=2M", "VMMHOOK_GRANULARITY"}, /* two swapped */
        {"VMMHOOK_STATS_FILE=x", "VMMHOOK_STATS_JSON"},    /* issue 20's other misspelling */
        {"VMMHOOK_verbose=1", "VMMHOOK_VERBOSE"},          /* case */
        {"VMMHOOK_CACHELIMIT=1G", "VMMHOOK_CACHE_LIMIT"},
        {"VMMHOOK_PEER=all", "VMMHOOK_PEERS"},
        {"VMMHOOK_FOO=1", NULL},
        {"VMMHOOK_X=1", NULL},
        {"VMMHOOK_SOMETHING_ELSE_ENTIRELY=1", NULL},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        log_reset();
        char *envp[] = {(char *)cases[i].var, NULL};
        assert_int_equal(vmh_options_check_unknown(envp, true), 1);
        char want[96];
        if (cases[i].suggested) {
            snprintf(want, sizeof(want), "; did you mean %s?\n", cases[i].suggested);
            if (!strstr(logbuf, want))
                fail_msg("%s: no suggestion of %s in: %s", cases[i].var, cases[i].suggested,
                         logbuf);
        } else if (strstr(logbuf, "did you mean")) {
            fail_msg("%s: a suggestion: %s", cases[i].var, logbuf);
        }
    }
    /* A name that could forge a log line is quoted, escaped. */
    log_reset();
    char *envp[] = {"VMMHOOK_A\nvmmhook: forged=1", NULL};
    assert_int_equal(vmh_options_check_unknown(envp, false), 1);
    assert_int_equal(loglines, 1);
    assert_non_null(strstr(logbuf, "\"VMMHOOK_A\\x0avmmhook: forged\""));
}

static const char *flag_name(size_t i, void *arg)
{
    return ((const char *const *)arg)[i];
}

/* The same rule on the launcher's flags (vmmhook-config --closest, issue 37: a misspelt flag
 * got no suggestion where the variable did): after the two dashes. */
static void test_closest_flag(void **state)
{
    (void)state;
    static const char *const flags[] = {"--granularity", "--stats", "--stats-json", "--check"};
    static const struct {
        const char *given;
        size_t want; /* 4: none */
    } cases[] = {
        {"--granularty", 0}, {"--GRANULARITY", 0}, {"--stat", 1}, {"--stats-jsno", 2},
        {"--chek", 3},       {"--bogus", 4},       {"--", 4},     {"--x", 4},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t got = vmh_closest_name(cases[i].given, strlen(cases[i].given), 2, flag_name, 4,
                                      (void *)flags);
        if (got != cases[i].want)
            fail_msg("%s: %zu, not %zu", cases[i].given, got, cases[i].want);
    }
}

/* The check's own form of the warnings: what is wrong and the accepted forms, not what the
 * library would do (vmmhook-config --check fails instead). */
static void test_parse_for_check(void **state)
{
    (void)state;
    fake_env_t e = {0};
    env_set(&e, "VMMHOOK_CACHE_LIMIT", "12Q");
    env_set(&e, "VMMHOOK_STATS", "1");
    vmh_options_t o;
    vmh_options_defaults(&o);
    assert_int_equal(vmh_options_parse_for_check(&o, fake_get, &e), 1);
    assert_true(o.stats);
    assert_int_equal(loglines, 1);
    assert_non_null(strstr(logbuf, "VMMHOOK_CACHE_LIMIT=\"12Q\" is not valid (not one of the "
                                   "accepted forms); accepted: a byte count"));
    assert_null(strstr(logbuf, "using the default"));
    assert_int_equal(exit_calls, 0);
}

/* ---- values the machine refuses later (the front's policy, lifetime.c) ---------------------- */

static void test_handle_type_refused(void **state)
{
    (void)state;
    opt.handle = VMH_HANDLE_FABRIC;
    vmh_lifetime_refuse("VMMHOOK_HANDLE_TYPE",
                        "the driver rejects it on this machine (cuMemCreate: error 800)", "none");
    vmh_lifetime_refuse("VMMHOOK_HANDLE_TYPE", "again", "none");
    assert_int_equal(loglines, 1);
    assert_string_equal(logbuf,
                        "vmmhook: VMMHOOK_HANDLE_TYPE=\"fabric\" is refused: the driver rejects "
                        "it on this machine (cuMemCreate: error 800); accepted: none, posix_fd, "
                        "fabric; using none\n");
}

/* ---- the real strict stop and the load line -------------------------------------------------- */

/* The real strict stop: the program's buffered output is flushed, then it aborts (it used to
 * _exit(2), losing that output). Run in a child whose stdout is a pipe. */
static void test_strict_stop_flushes_and_aborts(void **state)
{
    (void)state;
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        dup2(fds[1], STDOUT_FILENO);
        close(fds[0]);
        close(fds[1]);
        setvbuf(stdout, NULL, _IOFBF, 4096);
        vmh_log_exit = real_exit;
        opt.strict = true;
        printf("output the program buffered");
        vmh_lifetime_refuse("VMMHOOK_TRACE", "a test", "no trace");
        _exit(0); /* not reached when the stop works */
    }
    close(fds[1]);
    char buf[128];
    ssize_t n = read(fds[0], buf, sizeof(buf) - 1);
    close(fds[0]);
    buf[n > 0 ? n : 0] = '\0';
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGABRT);
    assert_string_equal(buf, "output the program buffered");
}

/* VMMHOOK_VERBOSE's load line: version, pid, the options not at their default; quiet about
 * bad values (noted only), no strict stop, nothing when VMMHOOK_VERBOSE is off. */
static void test_announce(void **state)
{
    (void)state;
    fake_env_t e = {0};
    env_set(&e, "VMMHOOK_CACHE_LIMIT", "2G");
    env_set(&e, "VMMHOOK_TRACE", "/tmp/t\n.csv");
    vmh_options_announce(fake_get, &e);
    assert_int_equal(loglines, 0);

    env_set(&e, "VMMHOOK_VERBOSE", "1");
    vmh_options_announce(fake_get, &e);
    char want[200];
    snprintf(want, sizeof(want),
             "vmmhook: libvmmhook %d.%d.%d loaded (pid %d); options not at their default: "
             "VMMHOOK_CACHE_LIMIT=2G VMMHOOK_VERBOSE=on VMMHOOK_TRACE=\"/tmp/t\\x0a.csv\"\n",
             VMM_VERSION_MAJOR, VMM_VERSION_MINOR, VMM_VERSION_PATCH, (int)getpid());
    assert_string_equal(logbuf, want);

    log_reset();
    fake_env_t b = {0};
    env_set(&b, "VMMHOOK_VERBOSE", "yes");
    env_set(&b, "VMMHOOK_STRICT", "1");
    env_set(&b, "VMMHOOK_HEADROOM", "lots");
    vmh_options_announce(fake_get, &b);
    assert_int_equal(loglines, 1);
    assert_int_equal(exit_calls, 0);
    assert_non_null(strstr(logbuf, "options not at their default: VMMHOOK_VERBOSE=on "
                                   "VMMHOOK_STRICT=on (and bad values, reported at the first CUDA "
                                   "call)\n"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_strict_stops, setup),
        cmocka_unit_test_setup(test_strict_all_good, setup),
        cmocka_unit_test_setup(test_strict_bad_itself, setup),
        cmocka_unit_test_setup(test_verbose_lists_all, setup),
        cmocka_unit_test_setup(test_not_verbose_silent, setup),
        cmocka_unit_test_setup(test_unknown_variables, setup),
        cmocka_unit_test_setup(test_unknown_suggestions, setup),
        cmocka_unit_test_setup(test_closest_flag, setup),
        cmocka_unit_test_setup(test_parse_for_check, setup),
        cmocka_unit_test_setup(test_handle_type_refused, setup),
        cmocka_unit_test_setup(test_strict_stop_flushes_and_aborts, setup),
        cmocka_unit_test_setup(test_announce, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
