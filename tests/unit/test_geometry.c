/* The heap's geometry on the simulated driver (issue 27): a program asking for many buffers of
 * one size pays driver calls per extent, not per buffer (the shared extent grows with every new
 * extent), and a tag's extents are carved from a few large reservations, so that neighbours are
 * adjacent in address space. Prints the driver calls per phase it measured. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_tags_reset, vmh_pause_reset */
#endif
#include "testutil.h"
#include "testtags.h"


#include <stdlib.h>

static int setup(void **state)
{
    return tt_setup_carved(state);
}

/* Driver calls of each phase for n buffers of `size` in one tag. */
typedef struct phase_calls {
    unsigned long alloc, pause, resume, free, reserves, maps;
} phase_calls_t;

static phase_calls_t buffers_in_one_tag(size_t n, size_t size)
{
    phase_calls_t c = {0};
    CUdeviceptr *p = calloc(n, sizeof *p);
    assert_non_null(p);
    sim_reset_counters();
    assert_int_equal(vmm_tag_push("bulk"), VMM_OK);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(vmh_heap_alloc(size, &p[i]), CUDA_SUCCESS);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    c.alloc = sim_call_count();
    c.reserves = sim_calls("cuMemAddressReserve");
    c.maps = sim_calls("cuMemMap");
    sim_reset_counters();
    assert_int_equal(vmm_pause("bulk", 0), VMM_OK);
    c.pause = sim_call_count();
    sim_reset_counters();
    assert_int_equal(vmm_resume("bulk"), VMM_OK);
    c.resume = sim_call_count();
    sim_reset_counters();
    for (size_t i = 0; i < n; i++)
        assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    c.free = sim_call_count();
    free(p);
    return c;
}

/* N x 2 MiB in one tag, N = 1280 .. 20480: allocation costs driver calls per extent (at most
 * 1024 for 20480 buffers, 40 GiB: the target), and the extents share few reservations. */
static void many_2mib_buffers_cost_calls_per_extent(void **state)
{
    (void)state;
    printf("  %6s %8s %8s %8s %8s %9s %6s\n", "N", "alloc", "pause", "resume", "free+trim",
           "reserves", "maps");
    for (size_t n = 1280; n <= 20480; n *= 2) {
        phase_calls_t c = buffers_in_one_tag(n, 2 * MiB);
        printf("  %6zu %8lu %8lu %8lu %8lu %9lu %6lu\n", n, c.alloc, c.pause, c.resume, c.free,
               c.reserves, c.maps);
        assert_true(c.alloc <= 1024);
        /* at most 3 chunks per extent (packing.c's CHUNK_SPLIT), each mapped once */
        assert_true(c.maps <= 300);
        assert_true(c.reserves <= 8);
        tt_teardown(state);
        setup(state);
    }
}

/* 1024 x 40 MiB in one tag (pause_resume's other size on the H200): once the live bytes make
 * the shared extent 8 times larger, 40 MiB buffers share extents too. */
static void many_40mib_buffers_share_extents(void **state)
{
    (void)state;
    phase_calls_t c = buffers_in_one_tag(1024, 40 * MiB);
    printf("  1024 x 40 MiB: alloc %lu, pause %lu, resume %lu, free+trim %lu, reserves %lu, "
           "maps %lu\n", c.alloc, c.pause, c.resume, c.free, c.reserves, c.maps);
    assert_true(c.maps < 512); /* one extent per buffer before */
}

/* A shard's extents are neighbours: the second extent starts where the first ends. */
static void a_shards_extents_are_adjacent(void **state)
{
    (void)state;
    CUdeviceptr p[64];
    sim_reset_counters();
    for (int i = 0; i < 64; i++)
        assert_int_equal(vmh_heap_alloc(2 * MiB, &p[i]), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemAddressReserve"), 1);
    assert_true(sim_calls("cuMemMap") > 1);
    /* Every buffer lies in the one reservation, one after the other (served in order from
     * extents carved in order). */
    for (int i = 1; i < 64; i++)
        assert_int_equal(p[i], p[i - 1] + 2 * MiB);
    for (int i = 0; i < 64; i++)
        assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
}

/* An extent given back leaves its addresses to the next one of the shard, and the last one
 * given back frees the reservation (nothing of the span is left in the driver: the
 * teardown's ledger check). */
static void a_trimmed_extents_addresses_are_reused(void **state)
{
    (void)state;
    CUdeviceptr a, b;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(100 * MiB, &b), CUDA_SUCCESS); /* an extent of its own */
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    sim_reset_counters();
    CUdeviceptr c;
    assert_int_equal(vmh_heap_alloc(100 * MiB, &c), CUDA_SUCCESS);
    assert_int_equal(c, b);
    assert_int_equal(sim_calls("cuMemAddressReserve"), 0);
    assert_int_equal(vmh_heap_free(c, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
}

/* Under a small VMMHOOK_VA_LIMIT a span takes at most a quarter of the budget: here extents get
 * reservations of their own size (big buffers keep the rest of the budget). */
static void a_small_address_budget_gets_spans_of_extent_size(void **state)
{
    (void)state;
    tu_opt.va_limit = (size_t)8 << 30; /* a first span of 4 GiB would take half */
    tu_configure();
    CUdeviceptr p[48];
    for (int i = 0; i < 48; i++) /* 96 MiB: some shared extents, none larger than 256 MiB */
        assert_int_equal(vmh_heap_alloc(2 * MiB, &p[i]), CUDA_SUCCESS);
    assert_true(sim_calls("cuMemAddressReserve") >= 2);
    assert_true((size_t)vmh_gauge_get(VMH_STAT_bytes_reserved) < (size_t)1 << 30);
    for (int i = 0; i < 48; i++)
        assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(many_2mib_buffers_cost_calls_per_extent, setup,
                                        tt_teardown),
        cmocka_unit_test_setup_teardown(many_40mib_buffers_share_extents, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(a_shards_extents_are_adjacent, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(a_trimmed_extents_addresses_are_reused, setup,
                                        tt_teardown),
        cmocka_unit_test_setup_teardown(a_small_address_budget_gets_spans_of_extent_size, setup,
                                        tt_teardown),
    };
    return cmocka_run_group_tests_name("geometry", tests, NULL, NULL);
}
