/* Unit tests of the log line writer (src/util/log.c): the prefix, errno kept, the verbose switch,
 * truncation, vmh_fmt_bytes. The set-up (the captured log): options_fixture.h. */
#include "options_fixture.h"

/* ---- log.c
 * --------------------------------------------------------------------------------------- */

static void test_log_line(void **state)
{
    (void)state;
    errno = 1234;
    vmh_log("hello %s %d %zu 0x%llx", "world", -5, (size_t)7, 0xabcULL);
    assert_int_equal(errno, 1234); /* interposed callers must not see errno change */
    assert_string_equal(logbuf, "vmmhook: hello world -5 7 0xabc\n");
    assert_int_equal(loglines, 1);

    log_reset();
    vmh_log_set_verbose(false);
    vmh_debug("hidden");
    assert_int_equal(loglines, 0);
    opt.verbose = true; /* the log does not read the options: still hidden */
    vmh_debug("hidden");
    assert_int_equal(loglines, 0);
    vmh_log_set_verbose(true);
    vmh_debug("shown %d", 1);
    assert_string_equal(logbuf, "vmmhook: shown 1\n");
    vmh_log_set_verbose(false);
}

static void test_log_truncates(void **state)
{
    (void)state;
    char big[3000];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    vmh_log("%s", big);
    assert_int_equal(loglines, 1);
    assert_int_equal(loglen, VMH_LOG_LINE_MAX);
    assert_memory_equal(logbuf + loglen - 4, "...\n", 4);
    assert_memory_equal(logbuf, "vmmhook: xxx", 12);
}

static void test_fmt_bytes(void **state)
{
    (void)state;
    static const struct {
        unsigned long long n;
        const char *s;
    } cases[] = {
        {0, "0 B"},
        {1023, "1023 B"},
        {1024, "1 KiB"},
        {1536, "1.5 KiB"},
        {64ull << 20, "64 MiB"},
        {(3ull << 30) / 2, "1.5 GiB"},
        {(1ull << 20) + 1, "1.0 MiB"},
        {(1ull << 20) - 1, "1024.0 KiB"},
        {12ull << 40, "12 TiB"},
        {1ull << 60, "1 EiB"},
        {ULLONG_MAX, "16.0 EiB"},
    };
    char buf[32];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        assert_string_equal(vmh_fmt_bytes(buf, sizeof(buf), cases[i].n), cases[i].s);
    char tiny[4];
    assert_string_equal(vmh_fmt_bytes(tiny, sizeof(tiny), 1536), "1.5");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_log_line, setup),
        cmocka_unit_test_setup(test_log_truncates, setup),
        cmocka_unit_test_setup(test_fmt_bytes, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
