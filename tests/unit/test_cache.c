/* Unit tests of the cache layer (cache.c) through the heap, on the simulated driver: how much
 * idle memory a miss leaves in the cache. A program that repeats its steps (PyTorch training
 * with its caching allocator off: each step's activations are freed and asked for again in the
 * next) must find them in the cache instead of making them anew, while the footprint stays
 * within the program's own recent peak (issue 14: 1450-1720 driver calls a step on the H200,
 * most of them making and destroying the same sizes again). */
#ifndef VMH_TESTING
#define VMH_TESTING 1
#endif
#include "testutil.h"

#define STEP_BUFFERS 16
#define STEP_SIZE (32 * MiB)

static void alloc_step(CUdeviceptr *p, int n)
{
    for (int i = 0; i < n; i++)
        assert_int_equal(vmh_heap_alloc(STEP_SIZE, &p[i]), CUDA_SUCCESS);
}

static void free_step(const CUdeviceptr *p, int n)
{
    for (int i = 0; i < n; i++)
        assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
}

/* A step's buffers freed, then a new size asked for: the miss gives back only what keeps the
 * footprint within the peak, and the next step is served from the cache. */
static void repeated_steps_are_served_from_the_cache(void **state)
{
    (void)state;
    CUdeviceptr p[STEP_BUFFERS], other;
    alloc_step(p, STEP_BUFFERS); /* peak: 512 MiB */
    free_step(p, STEP_BUFFERS);
    /* The parked frees are released (park limit 0: this allocation waits first), then the
     * miss makes room: 512 MiB idle, 40 MiB live, peak 512 MiB. */
    assert_int_equal(vmh_heap_alloc(40 * MiB, &other), CUDA_SUCCESS);
    size_t idle = vmh_heap_idle_bytes(0);
    assert_true(idle > 512 * MiB - 40 * MiB - STEP_SIZE); /* before: trimmed to 192 MiB */
    assert_true(idle <= 512 * MiB - 40 * MiB);            /* live + idle: never past the peak */
    sim_reset_counters();
    alloc_step(p, STEP_BUFFERS);
    /* Before this change: 9 of the 16 made anew (4 driver calls each, and 3 more to give back
     * each evicted range). */
    assert_true(sim_calls("cuMemCreate") <= 2);
    assert_true(vmh_counter_get(VMH_STAT_cache_hits) >= STEP_BUFFERS - 2);
    /* The footprint stays within the peak of live bytes plus the fixed allowance. */
    assert_true((size_t)vmh_gauge_peak(VMH_STAT_bytes_mapped) <=
                STEP_BUFFERS * STEP_SIZE + 40 * MiB + 256 * MiB);
    free_step(p, STEP_BUFFERS);
    assert_int_equal(vmh_heap_free(other, NULL, false), CUDA_SUCCESS);
}

/* A trim (memory pressure, vmm_trim) resets the peak: a later, smaller working set earns room
 * only up to its own peak. */
static void a_trim_resets_the_peak(void **state)
{
    (void)state;
    CUdeviceptr p[STEP_BUFFERS], other;
    alloc_step(p, STEP_BUFFERS); /* peak: 512 MiB */
    free_step(p, STEP_BUFFERS);
    assert_true(vmh_heap_trim() >= STEP_BUFFERS * STEP_SIZE);
    assert_int_equal(vmh_heap_idle_bytes(0), 0);
    alloc_step(p, 12); /* the new peak: 384 MiB */
    free_step(p, 12);
    assert_int_equal(vmh_heap_alloc(40 * MiB, &other), CUDA_SUCCESS);
    /* 384 MiB freed; live 40 MiB, peak 384 MiB: at most 344 MiB stay idle (with the peak of
     * before the trim all 384 MiB would). */
    size_t idle = vmh_heap_idle_bytes(0);
    assert_true(idle <= 384 * MiB - 40 * MiB);
    assert_true(idle > 384 * MiB - 40 * MiB - STEP_SIZE);
    assert_int_equal(vmh_heap_free(other, NULL, false), CUDA_SUCCESS);
}

/* Parked bytes count as held: the cache keeps only what the program holds neither live nor
 * parked, so that idle and parked memory together stay within the peak. */
static void parked_bytes_count_against_the_room(void **state)
{
    (void)state;
    CUdeviceptr p[STEP_BUFFERS], other, next;
    alloc_step(p, STEP_BUFFERS); /* peak: 512 MiB */
    free_step(p, STEP_BUFFERS);
    assert_int_equal(vmh_heap_alloc(40 * MiB, &other), CUDA_SUCCESS); /* 448 MiB stay idle */
    tu_opt.park_limit = GiB; /* from here frees stay parked: no wait, no reclaim thread */
    tu_configure();
    assert_int_equal(vmh_heap_free(other, NULL, false), CUDA_SUCCESS);
    /* A miss with 48 MiB live and 40 MiB parked: at most 512 - 88 = 424 MiB stay in the cache
     * (448 if the parked bytes did not count); the idle bytes count the parked ones too. */
    assert_int_equal(vmh_heap_alloc(48 * MiB, &next), CUDA_SUCCESS);
    size_t idle = vmh_heap_idle_bytes(0);
    assert_true(idle <= 424 * MiB + 40 * MiB);
    assert_true(idle > 424 * MiB + 40 * MiB - STEP_SIZE);
    assert_int_equal(vmh_heap_free(next, NULL, false), CUDA_SUCCESS);
}

/* VMMHOOK_CACHE_LIMIT still bounds what the peak earns. */
static void the_cache_limit_bounds_the_room(void **state)
{
    (void)state;
    tu_opt.cache_limit = 128 * MiB;
    tu_configure();
    CUdeviceptr p[STEP_BUFFERS], other;
    alloc_step(p, STEP_BUFFERS);
    free_step(p, STEP_BUFFERS);
    assert_int_equal(vmh_heap_alloc(40 * MiB, &other), CUDA_SUCCESS);
    assert_true(vmh_heap_idle_bytes(0) <= 128 * MiB);
    assert_int_equal(vmh_heap_free(other, NULL, false), CUDA_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(repeated_steps_are_served_from_the_cache, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(a_trim_resets_the_peak, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(parked_bytes_count_against_the_room, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(the_cache_limit_bounds_the_room, tu_setup, tu_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
