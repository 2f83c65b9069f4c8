/* Linked into every unit-test program: VMH_TEST_FILTER=<name> runs only the cmocka tests whose
 * name matches (cmocka's pattern: '*' and '?'). The meson suite 'stress' runs the concurrency
 * tests one by one this way (tests/unit/meson.build, stress_cases). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

__attribute__((constructor)) static void tu_filter(void)
{
    const char *f = getenv("VMH_TEST_FILTER");
    if (f && *f)
        cmocka_set_test_filter(f);
}
