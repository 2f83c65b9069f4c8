/* Unit tests of src/util/stats.c's counters and gauges: counts, peaks, and both under threads. */
#include "stats_fixture.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_counters),
        T(test_gauge_peak),
        T(test_threads),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
