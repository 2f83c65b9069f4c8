/* Unit tests of src/util/stats.c's reports at exit: the JSON report (checked by a small JSON
 * validator written here), the stats table and the leak report. */
#include "stats_fixture.h"

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
    /* A header, one line per counter and per gauge, and the idle bytes' note. */
    assert_int_equal(loglines, 1 + VMH_COUNTER_COUNT + VMH_GAUGE_COUNT + 1);
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
    /* The idle bytes are more than the cache VMMHOOK_CACHE_LIMIT caps: the line after says so. */
    l = strstr(logbuf, "bytes held idle for reuse");
    assert_non_null(l);
    static const char note[] = "vmmhook:     (free space in shared chunks, not capped by "
                               "VMMHOOK_CACHE_LIMIT, and freed buffers with chunks of their own, "
                               "capped by it per device)\n";
    l = strchr(l, '\n') + 1;
    if (strncmp(l, note, strlen(note)) != 0)
        fail_msg("no note under the idle bytes:\n%s", logbuf);
}

/* The label column is as wide as the longest label, whichever that is (stats.h has labels longer
 * than the 36 columns the table once had): every counter's value ends in one column, every
 * gauge's "now" starts in one column, and that column is the longest label plus one space. */
static void test_stats_table_aligned(void **state)
{
    (void)state;
    opt.stats = true;
    vmh_lifetime_configure_stats(&opt);
    vmh_count(VMH_STAT_served_allocs, 7);
    vmh_count(VMH_STAT_spills_small, 123456);
    vmh_gauge_add(VMH_STAT_bytes_spilled, (int64_t)1 << 30);
    vmh_leak_report_begin(); /* the "buffers leaked" line (leaks not listed: opt.leaks is off) */
    vmh_leak_report_one(0x7f0000001000ULL, 4096, 0, NULL);
    vmh_leak_report_end();
    vmh_stats_report();
    assert_int_equal(loglines, 1 + VMH_COUNTER_COUNT + VMH_GAUGE_COUNT + 1 + 1);

    static const char prefix[] = "vmmhook:   ";
    size_t longest = 0;
    int counters = 0, gauges = 0;
    /* First pass: the longest label (a label ends where a run of two spaces, or a space and
     * "now ", begins; labels have single spaces inside). */
    for (const char *l = logbuf; *l; l = strchr(l, '\n') + 1) {
        const char *end = strchr(l, '\n');
        assert_non_null(end);
        if (strncmp(l, prefix, strlen(prefix)) != 0)
            continue; /* the header */
        const char *label = l + strlen(prefix);
        while (*label == ' ') /* "  of them ..." is indented under its counter */
            label++;
        if (*label == '(')
            continue; /* a note under a line (the idle bytes'), no columns */
        const char *e = label;
        while (e < end && !(e[0] == ' ' && (e[1] == ' ' || strncmp(e + 1, "now ", 4) == 0)))
            e++;
        assert_true(e < end);
        if ((size_t)(e - (l + strlen(prefix))) > longest)
            longest = (size_t)(e - (l + strlen(prefix)));
    }
    for (const char *l = logbuf; *l; l = strchr(l, '\n') + 1) {
        const char *end = strchr(l, '\n');
        if (strncmp(l, prefix, strlen(prefix)) != 0)
            continue;
        /* the note under the idle bytes */
        if (strncmp(l, "vmmhook:     (", 14) == 0)
            continue;
        const char *col = l + strlen(prefix) + longest; /* where the values begin */
        char line[256];
        snprintf(line, sizeof line, "%.*s", (int)(end - l), l);
        const char *now = strstr(l, " now ");
        if (now && now < end) {
            gauges++;
            if (now != col)
                fail_msg("a gauge's \"now\" is not at column %zu:\n%s\n%s", longest + 1, line,
                         logbuf);
            continue;
        }
        counters++;
        /* A counter: spaces from the label's end to the value, right-aligned in 20 columns. */
        const char *v = col + 1;
        if (*col != ' ' || (size_t)(end - v) < 20)
            fail_msg("a counter's value is not in its column:\n%s\n%s", line, logbuf);
        const char *digits_end = v + 20;
        if (!(digits_end[-1] >= '0' && digits_end[-1] <= '9') ||
            !(*digits_end == '\n' || *digits_end == ' '))
            fail_msg("a counter's value does not end at column %zu:\n%s\n%s", longest + 21, line,
                     logbuf);
    }
    assert_int_equal(counters, VMH_COUNTER_COUNT + 1); /* and "buffers leaked" */
    assert_int_equal(gauges, VMH_GAUGE_COUNT);
    /* The width comes from the labels of stats.h, whatever they are: a label added or made
     * longer there widens the column (a constant in report.c would not follow). */
#define LABEL_ITEM(name, help) help,
    static const char *const all[] = {
        VMH_COUNTERS(LABEL_ITEM) VMH_GAUGES(LABEL_ITEM) "buffers leaked",
    };
#undef LABEL_ITEM
    size_t widest = 0;
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        if (strlen(all[i]) > widest)
            widest = strlen(all[i]);
    assert_int_equal(longest, widest);
    assert_int_equal(longest, (size_t)vmh_stats_label_width());
    assert_non_null(strstr(logbuf, "123456\n"));
    assert_non_null(strstr(logbuf, "1 (4 KiB)\n"));
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_json_validator),
        T(test_json_report),
        T(test_json_no_leak_report),
        T(test_json_unwritable),
        T(test_stats_table),
        T(test_stats_table_aligned),
        T(test_leak_report),
        T(test_leak_report_none),
        T(test_leak_report_off),
        T(test_leak_report_capped),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
