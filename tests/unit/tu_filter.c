/* Linked into every unit-test program:
 *   VMH_TEST_FILTER=<name> runs only the cmocka tests whose name matches (cmocka's pattern: '*'
 *   and '?'). The meson suite 'stress' runs the concurrency tests one by one this way
 *   (tests/unit/meson.build, stress_cases).
 *   VMH_TEST_SHARD=k/n runs only the tests whose index in the program's table is k modulo n:
 *   meson registers a long program as n tests (tests/unit/meson.build, shards), so that no one
 *   test needs minutes of its timeout under TSan on a busy machine. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

__attribute__((constructor)) static void tu_filter(void)
{
    const char *f = getenv("VMH_TEST_FILTER");
    if (f && *f)
        cmocka_set_test_filter(f);
}

typedef int (*run_group_fn)(const char *, const struct CMUnitTest *const, const size_t,
                            CMFixtureFunction, CMFixtureFunction);

/* cmocka_run_group_tests() expands to a call of this; the program's own definition wins, and
 * hands cmocka's (the next one) the shard's tests. */
int _cmocka_run_group_tests(const char *group_name, const struct CMUnitTest *const tests,
                            const size_t num_tests, CMFixtureFunction group_setup,
                            CMFixtureFunction group_teardown)
{
    run_group_fn real = (run_group_fn)dlsym(RTLD_NEXT, "_cmocka_run_group_tests");
    if (!real) {
        fprintf(stderr, "tu_filter: cmocka's _cmocka_run_group_tests not found: %s\n", dlerror());
        return 1;
    }
    const char *shard = getenv("VMH_TEST_SHARD");
    unsigned k, n;
    if (!shard || !*shard)
        return real(group_name, tests, num_tests, group_setup, group_teardown);
    if (sscanf(shard, "%u/%u", &k, &n) != 2 || n == 0 || k >= n || n > num_tests) {
        fprintf(stderr, "tu_filter: VMH_TEST_SHARD=%s: want k/n, k < n <= %zu tests\n", shard,
                num_tests);
        return 1;
    }
    struct CMUnitTest *mine = calloc(num_tests, sizeof *mine);
    if (!mine)
        return 1;
    size_t m = 0;
    for (size_t i = k; i < num_tests; i += n)
        mine[m++] = tests[i];
    int rc = real(group_name, mine, m, group_setup, group_teardown);
    free(mine);
    return rc;
}
