/* The heap's realloc on the simulated driver: null, zero and foreign pointers, grows in place
 * and moves, shrinks, packed moves, copies done or ordered, failures that leave the buffer as
 * it was, refused address space, and the trace of a realloc. Each test ends with everything
 * freed, the cache trimmed and the driver's ledger empty. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_heap_thread_shard, declared in heap.h */
#endif
#include "testutil.h"

#include "carved.h"

#include <cudaTypedefs.h>

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "vmmhook.h"

/* ---- realloc ---- */

static void realloc_null_zero_and_foreign(void **state)
{
    (void)state;
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_realloc(&p, 5 * MiB, NULL, false), CUDA_SUCCESS);
    assert_int_not_equal(p, 0);
    CUdeviceptr foreign = 0x1000;
    assert_int_equal(vmh_heap_realloc(&foreign, 10, NULL, false), CUDA_ERROR_NOT_FOUND);
    assert_int_equal(foreign, 0x1000);
    CUdeviceptr interior = p + 4096;
    assert_int_equal(vmh_heap_realloc(&interior, 10 * MiB, NULL, false), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(interior, p + 4096);
    assert_int_equal(vmh_heap_realloc(&p, 0, NULL, false), CUDA_SUCCESS);
    assert_int_equal(p, 0);
}

static void realloc_grows_in_place_with_headroom(void **state)
{
    (void)state;
    tu_opt.headroom = 64 * MiB;
    tu_configure();
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_realloc(&p, 4 * MiB, NULL, false), CUDA_SUCCESS);
    tu_fill(p, 4 * MiB, 3);
    CUdeviceptr before = p;
    sim_reset_counters();
    assert_int_equal(vmh_heap_realloc(&p, 4 * MiB - 100, NULL, false), CUDA_SUCCESS);
    assert_int_equal(sim_call_count(), 0); /* within the usable size: nothing to do */
    assert_int_equal(vmh_heap_realloc(&p, 7 * MiB + 1, NULL, false), CUDA_SUCCESS);
    assert_int_equal(p, before);
    assert_int_equal(vmh_counter_get(VMH_STAT_grows_in_place), 1);
    assert_true(tu_check(p, 4 * MiB - 100, 3));
    tu_fill(p, 7 * MiB + 1, 4);
    assert_true(tu_check(p, 7 * MiB + 1, 4));
    vmh_buffer_info_t info;
    assert_true(vmh_heap_find(p + 7 * MiB, &info));
    assert_int_equal(info.size, 7 * MiB + 1);
    assert_int_equal(vmh_heap_realloc(&p, 0, NULL, false), CUDA_SUCCESS);
}

static void realloc_moves_without_copy_and_frees_the_old_address(void **state)
{
    (void)state;
    tu_opt.headroom = 0;
    tu_configure();
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_realloc(&p, 6 * MiB, NULL, false), CUDA_SUCCESS);
    tu_fill(p, 6 * MiB, 5);
    sim_refuse_hints(true);
    CUdeviceptr old = p;
    sim_reset_counters();
    assert_int_equal(vmh_heap_realloc(&p, 10 * MiB, NULL, false), CUDA_SUCCESS);
    sim_refuse_hints(false);
    assert_int_not_equal(p, old);
    assert_int_equal(sim_calls("cuMemcpyDtoD"), 0);
    assert_int_equal(sim_calls("cuMemCreate"), 1); /* only the added chunk */
    assert_int_equal(vmh_counter_get(VMH_STAT_moves), 1);
    assert_true(tu_check(p, 6 * MiB, 5));
    /* The old address: unmapped after the synchronize, and no longer ours. */
    assert_false(sim_is_mapped(old));
    assert_false(sim_is_reserved(old));
    vmh_buffer_info_t info;
    assert_false(vmh_heap_find(old, &info));
    CUdeviceptr stale = old;
    assert_int_equal(vmh_heap_realloc(&stale, 20 * MiB, NULL, false), CUDA_ERROR_NOT_FOUND);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void async_move_keeps_old_address_dead_until_sync(void **state)
{
    (void)state;
    tu_opt.headroom = 0;
    tu_configure();
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_realloc(&p, 4 * MiB, NULL, true), CUDA_SUCCESS);
    tu_fill(p, 4 * MiB, 13);
    sim_refuse_hints(true);
    CUdeviceptr old = p;
    assert_int_equal(vmh_heap_realloc(&p, 8 * MiB, NULL, true), CUDA_SUCCESS);
    sim_refuse_hints(false);
    assert_int_not_equal(p, old);
    /* Still mapped (queued work may use it), but nobody's buffer: held, not found. */
    assert_true(sim_is_mapped(old));
    vmh_buffer_info_t info;
    assert_false(vmh_heap_find(old, &info));
    assert_true(vmh_heap_holds(old));
    assert_int_equal(vmh_heap_free(old, NULL, false), CUDA_ERROR_NOT_FOUND);
    /* An async shrink then a grow: the grow must not map over the still-mapped tail. */
    assert_int_equal(vmh_heap_realloc(&p, 2 * MiB, NULL, true), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_realloc(&p, 8 * MiB, NULL, true), CUDA_SUCCESS);
    assert_true(tu_check(p, 2 * MiB, 13));
    assert_false(sim_is_mapped(old)); /* the grow synchronized first */
    assert_false(vmh_heap_holds(old));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void realloc_shrinks_whole_chunks(void **state)
{
    (void)state;
    tu_opt.headroom = 0;
    tu_configure();
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_realloc(&p, 4 * MiB, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_realloc(&p, 8 * MiB, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_realloc(&p, 12 * MiB, NULL, false), CUDA_SUCCESS);
    tu_fill(p, 12 * MiB, 6);
    assert_int_equal(sim_live_allocations(), 3);
    CUdeviceptr before = p;
    assert_int_equal(vmh_heap_realloc(&p, 3 * MiB, NULL, false), CUDA_SUCCESS);
    assert_int_equal(p, before);
    assert_int_equal(sim_live_allocations(), 1); /* the chunks past 4 MiB went back */
    assert_int_equal(vmm_usable_size((void *)(uintptr_t)p), 4 * MiB);
    assert_true(tu_check(p, 3 * MiB, 6));
    /* Grow again after the shrink. */
    assert_int_equal(vmh_heap_realloc(&p, 9 * MiB, NULL, false), CUDA_SUCCESS);
    assert_true(tu_check(p, 3 * MiB, 6));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void realloc_packed_moves_with_one_copy(void **state)
{
    (void)state;
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_realloc(&p, 3000, NULL, false), CUDA_SUCCESS);
    vmh_buffer_info_t info;
    assert_true(vmh_heap_find(p, &info));
    assert_true(info.carved);
    tu_fill(p, 3000, 8);
    sim_reset_counters();
    assert_int_equal(vmh_heap_realloc(&p, 5 * MiB, NULL, false), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemcpyDtoD"), 1);
    assert_true(tu_check(p, 3000, 8));
    assert_true(vmh_heap_find(p, &info));
    assert_false(info.carved);
    assert_int_equal(vmh_heap_realloc(&p, 0, NULL, false), CUDA_SUCCESS);
}

/* A blocking realloc by copy returns with the copy done, as natively cudaMemcpy + cudaFree
 * would (cudaFree waits): a device-to-device copy is not synchronous with the host, and the
 * program may read the new buffer through a stream that does not wait for the legacy one (the
 * H200 caught it: realloc_gpu's "packed 64 KiB -> 16 MiB, queued kernel, sync" read the new
 * buffer on a non-blocking stream before the copy had run). */
static void blocking_realloc_copy_is_done_when_it_returns(void **state)
{
    (void)state;
    CUstream s = NULL;
    PFN_cuStreamCreate_v2000 create = NULL;
    PFN_cuStreamSynchronize_v2000 synchronize = NULL;
    PFN_cuMemcpyDtoHAsync_v3020 dtoh = NULL;
    PFN_cuStreamDestroy_v4000 destroy = NULL;
    CUdriverProcAddressQueryResult st;
    assert_int_equal(sim_get_proc_address("cuStreamCreate", (void **)&create, 13000, 0, &st), 0);
    assert_int_equal(sim_get_proc_address("cuStreamSynchronize", (void **)&synchronize, 13000, 0,
                                          &st), 0);
    assert_int_equal(sim_get_proc_address("cuMemcpyDtoHAsync", (void **)&dtoh, 13000, 0, &st), 0);
    assert_int_equal(sim_get_proc_address("cuStreamDestroy", (void **)&destroy, 13000, 0, &st), 0);
    assert_int_equal(create(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_realloc(&p, 64 * 1024, NULL, false), CUDA_SUCCESS);
    tu_fill(p, 64 * 1024, 12);
    assert_int_equal(vmh_heap_realloc(&p, 5 * MiB, NULL, false), CUDA_SUCCESS);
    unsigned char *h = malloc(64 * 1024);
    assert_non_null(h);
    assert_int_equal(dtoh(h, p, 64 * 1024, s), CUDA_SUCCESS);
    assert_int_equal(synchronize(s), CUDA_SUCCESS); /* lands s's work only */
    size_t bad = 0;
    for (size_t i = 0; i < 64 * 1024; i++)
        bad += h[i] != (unsigned char)(i * 131u + 12);
    free(h);
    assert_int_equal(bad, 0);
    assert_int_equal(destroy(s), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_realloc(&p, 0, NULL, false), CUDA_SUCCESS);
}

static void realloc_failure_leaves_buffer_untouched(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = 32 * MiB};
    tu_reset(&cfg);
    tu_opt.headroom = 0;
    tu_configure();
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_realloc(&p, 8 * MiB, NULL, false), CUDA_SUCCESS);
    tu_fill(p, 8 * MiB, 9);
    CUdeviceptr before = p;
    assert_int_equal(vmh_heap_realloc(&p, 64 * MiB, NULL, false), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(p, before);
    assert_true(tu_check(p, 8 * MiB, 9));
    /* Address space exhausted: the move path cannot reserve. */
    tu_opt.va_limit = 10 * MiB;
    tu_configure();
    sim_refuse_hints(true);
    bool no_address = false;
    assert_int_equal(vmh_heap_realloc_ex(&p, 12 * MiB, NULL, false, &no_address),
                     CUDA_ERROR_OUT_OF_MEMORY);
    assert_true(no_address);
    sim_refuse_hints(false);
    assert_true(tu_check(p, 8 * MiB, 9));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* The driver refusing address space is told from the driver running out of memory (the answer
 * the range layer returns with the failure, not a thread-local read after it). */
static void refused_reservation_is_no_address(void **state)
{
    (void)state;
    tu_opt.headroom = 0;
    tu_configure();
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_realloc(&p, 4 * MiB, NULL, false), CUDA_SUCCESS);
    tu_fill(p, 4 * MiB, 10);
    bool no_address = false;
    sim_refuse_hints(true); /* the grow must move: its reservation is refused */
    sim_fail_function_repeat("cuMemAddressReserve", 1, 8, CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_heap_realloc_ex(&p, 8 * MiB, NULL, false, &no_address),
                     CUDA_ERROR_OUT_OF_MEMORY);
    assert_true(no_address);
    sim_clear_faults();
    /* Memory, not address space: the chunk cannot be made. */
    sim_fail_function_repeat("cuMemCreate", 1, 8, CUDA_ERROR_OUT_OF_MEMORY);
    no_address = true;
    assert_int_equal(vmh_heap_realloc_ex(&p, 8 * MiB, NULL, false, &no_address),
                     CUDA_ERROR_OUT_OF_MEMORY);
    assert_false(no_address);
    sim_clear_faults();
    /* The mapping fails after a good reservation: not address space either. */
    sim_fail_function_repeat("cuMemMap", 1, 8, CUDA_ERROR_OUT_OF_MEMORY);
    no_address = true;
    assert_int_equal(vmh_heap_realloc_ex(&p, 8 * MiB, NULL, false, &no_address),
                     CUDA_ERROR_OUT_OF_MEMORY);
    assert_false(no_address);
    sim_clear_faults();
    sim_refuse_hints(false);
    assert_true(tu_check(p, 4 * MiB, 10));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* ---- trace of vmm_realloc (issue 16) ---- */

/* The number of lines of the trace at path whose action and pointer are as given, and their
 * size when size_out is not NULL. */
static int trace_count(const char *path, const char *action, CUdeviceptr p, size_t *size_out)
{
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[256], want[64];
    snprintf(want, sizeof want, ",%s,0x%llx,", action, (unsigned long long)p);
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        char *at = strstr(line, want);
        if (!at)
            continue;
        n++;
        if (size_out)
            *size_out = strtoull(at + strlen(want), NULL, 10);
    }
    fclose(f);
    return n;
}

/* Every buffer vmm_realloc makes, moves or resizes is in the trace, as a free of the old
 * buffer and an allocation of the new one (a928081 traced none of them). */
static void realloc_is_traced(void **state)
{
    (void)state;
    char path[64];
    snprintf(path, sizeof path, "/tmp/vmh_trace_realloc_%d.csv", (int)getpid());
    unlink(path);
    static vmh_options_t topt;
    vmh_options_defaults(&topt);
    snprintf(topt.trace, sizeof topt.trace, "%s", path);
    vmh_lifetime_configure_stats(&topt);
    tu_opt.headroom = 0;
    tu_configure();
    CUdeviceptr p = 0, s = 0;
    assert_int_equal(vmh_heap_realloc(&p, 3 * MiB, NULL, false), CUDA_SUCCESS);
    CUdeviceptr first = p;
    sim_refuse_hints(true); /* the grow moves */
    assert_int_equal(vmh_heap_realloc(&p, 9 * MiB, NULL, false), CUDA_SUCCESS);
    sim_refuse_hints(false);
    assert_int_not_equal(p, first);
    assert_int_equal(vmh_heap_realloc(&s, 1000, NULL, false), CUDA_SUCCESS); /* packed */
    CUdeviceptr small = s;
    assert_int_equal(vmh_heap_realloc(&s, 2000, NULL, false), CUDA_SUCCESS);  /* in place */
    assert_int_equal(s, small);
    assert_int_equal(vmh_heap_realloc(&s, 3 * MiB, NULL, false), CUDA_SUCCESS); /* copied */
    size_t size = 0;
    assert_int_equal(trace_count(path, "allocate", first, &size), 1);
    assert_int_equal(size, 3 * MiB);
    assert_int_equal(trace_count(path, "free", first, &size), 1);
    assert_int_equal(size, 3 * MiB);
    assert_int_equal(trace_count(path, "allocate", p, &size), 1);
    assert_int_equal(size, 9 * MiB);
    assert_int_equal(trace_count(path, "allocate", small, NULL), 2); /* 1000, then 2000 */
    assert_int_equal(trace_count(path, "free", small, &size), 2);    /* 1000, then 2000 */
    assert_int_equal(size, 2000);
    assert_int_equal(trace_count(path, "allocate", s, &size), 1);
    assert_int_equal(size, 3 * MiB);
    assert_int_equal(vmh_heap_realloc(&p, 0, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_realloc(&s, 0, NULL, false), CUDA_SUCCESS);
    vmh_trace_close();
    topt.trace[0] = '\0';
    vmh_lifetime_configure_stats(&topt);
    unlink(path);
}

/* ---- the bytes requested: overall and per tag (testutil.h's tu_assert_stats_consistent) ---- */

static void resizes_keep_every_tag_figure_consistent(void **state)
{
    (void)state;
    vmh_tags_reset();
    tu_opt.headroom = 64 * MiB;
    tu_configure();
    CUdeviceptr packed = 0, big = 0, moved = 0;
    assert_int_equal(vmm_tag_push("resized"), VMM_OK);
    assert_int_equal(vmh_heap_realloc(&packed, 1000, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_realloc(&big, 4 * MiB, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    assert_int_equal(vmh_heap_realloc(&moved, 3 * MiB, NULL, false), CUDA_SUCCESS); /* default */
    tu_assert_stats_consistent();
    CUdeviceptr at = packed;
    assert_int_equal(vmh_heap_realloc(&packed, 3000, NULL, false), CUDA_SUCCESS); /* in place */
    assert_int_equal(packed, at);
    tu_assert_stats_consistent();
    assert_int_equal(vmh_heap_realloc(&packed, 500, NULL, false), CUDA_SUCCESS); /* shrinks */
    tu_assert_stats_consistent();
    assert_int_equal(vmh_heap_realloc(&packed, 2 * MiB, NULL, false), CUDA_SUCCESS); /* copied */
    tu_assert_stats_consistent();
    at = big;
    assert_int_equal(vmh_heap_realloc(&big, 7 * MiB + 7, NULL, false), CUDA_SUCCESS);
    assert_int_equal(big, at); /* grown in place into the headroom */
    tu_assert_stats_consistent();
    assert_int_equal(vmh_heap_realloc(&big, 5 * MiB, NULL, false), CUDA_SUCCESS); /* shrunk */
    tu_assert_stats_consistent();
    assert_int_equal(vmh_heap_realloc(&big, 5 * MiB - 99, NULL, false), CUDA_SUCCESS);
    tu_assert_stats_consistent(); /* within the usable size */
    tu_opt.headroom = 0;
    tu_configure();
    sim_refuse_hints(true); /* the grow moves */
    at = moved;
    assert_int_equal(vmh_heap_realloc(&moved, 11 * MiB, NULL, false), CUDA_SUCCESS);
    sim_refuse_hints(false);
    assert_int_not_equal(moved, at);
    tu_assert_stats_consistent();
    unsigned tag = vmh_tag_lookup("resized");
    assert_int_equal(vmh_tag_requested(tag), 2 * MiB + 5 * MiB - 99);
    assert_int_equal(vmh_tag_requested(VMH_TAG_DEFAULT), 11 * MiB);
    assert_int_equal(vmh_heap_free(packed, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_realloc(&moved, 0, NULL, false), CUDA_SUCCESS);
    tu_assert_stats_consistent();
    assert_int_equal(vmh_tag_requested(tag), 0);
    assert_int_equal(vmh_tag_requested(VMH_TAG_DEFAULT), 0);
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_requested), 0);
    vmh_tags_reset();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(realloc_null_zero_and_foreign, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_grows_in_place_with_headroom, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_moves_without_copy_and_frees_the_old_address,
                                        tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_shrinks_whole_chunks, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(async_move_keeps_old_address_dead_until_sync, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_packed_moves_with_one_copy, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(blocking_realloc_copy_is_done_when_it_returns, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_failure_leaves_buffer_untouched, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(refused_reservation_is_no_address, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_is_traced, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(resizes_keep_every_tag_figure_consistent, tu_setup,
                                        tu_teardown),
    };
    return cmocka_run_group_tests_name("heap_realloc", tests, NULL, NULL);
}
