/* The heap's layers (device to heap front) on the simulated driver: serving, packing, reuse, parked
 * frees, out of memory, limits, realloc, several devices and threads. Each test ends with
 * everything freed, the cache trimmed and the driver's ledger empty. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_heap_thread_shard, declared in heap.h */
#endif
#include "testutil.h"

#include "packing.h"

#include <cudaTypedefs.h>

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "vmmhook.h"

static unsigned seed_of(int k)
{
    return (unsigned)k * 7919u + 13u;
}

static void serves_and_frees(void **state)
{
    (void)state;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(3 * MiB + 5, &p), CUDA_SUCCESS);
    assert_int_equal(p % GRAN, 0);
    assert_int_equal(sim_live_native(), 0); /* served from VMM, not cuMemAlloc */
    vmh_buffer_info_t info;
    assert_true(vmh_heap_find(p + 3 * MiB, &info));
    assert_int_equal(info.base, p);
    assert_int_equal(info.size, 3 * MiB + 5);
    assert_int_equal(info.usable, 4 * MiB);
    assert_false(vmh_heap_find(p + 3 * MiB + 5, &info)); /* past the size asked for */
    tu_fill(p, 3 * MiB + 5, 1);
    assert_true(tu_check(p, 3 * MiB + 5, 1));
    assert_int_equal(vmh_heap_free(p + 256, NULL, false), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_false(vmh_heap_find(p, &info));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_ERROR_INVALID_VALUE); /* double */
    assert_int_equal(vmh_heap_free(0x1234, NULL, false), CUDA_ERROR_NOT_FOUND);
}

static void packs_small_requests(void **state)
{
    (void)state;
    CUdeviceptr p[100];
    for (int i = 0; i < 100; i++) {
        assert_int_equal(vmh_heap_alloc((size_t)1 + (size_t)i * 97, &p[i]), CUDA_SUCCESS);
        assert_int_equal(p[i] % 256, 0);
        tu_fill(p[i], (size_t)1 + (size_t)i * 97, (unsigned)i);
    }
    assert_int_equal(sim_live_allocations(), 1); /* one chunk holds them all */
    for (int i = 0; i < 100; i++) {
        assert_true(tu_check(p[i], (size_t)1 + (size_t)i * 97, (unsigned)i));
        vmh_buffer_info_t info;
        assert_true(vmh_heap_find(p[i] + (size_t)i * 97, &info));
        assert_int_equal(info.base, p[i]);
        assert_int_equal(info.size, (size_t)1 + (size_t)i * 97);
        assert_true(info.packed);
    }
    assert_int_equal(vmh_heap_free(p[5] + 1, NULL, false), CUDA_ERROR_INVALID_VALUE);
    for (int i = 0; i < 100; i++)
        assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p[7], NULL, false), CUDA_ERROR_INVALID_VALUE);
}

static void default_threshold_packs_every_size_but_not_growable(void **state)
{
    (void)state;
    vmh_options_defaults(&tu_opt); /* VMMHOOK_PACK_BELOW's default: every size */
    tu_opt.park_limit = 0;         /* freed space reused at once (testutil.h) */
    tu_opt.stream_ordered = false; /* parked, then reused after the wait */
    tu_configure();
    assert_int_equal(tu_opt.pack_below, (size_t)1 << 40);
    CUdeviceptr a, b, c, g = 0;
    vmh_buffer_info_t info;
    assert_int_equal(vmh_heap_alloc(5 * MiB, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(3 * MiB, &b), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(300 * MiB, &c), CUDA_SUCCESS);
    assert_true(vmh_heap_find(a, &info) && info.packed);
    assert_true(vmh_heap_find(c, &info) && info.packed && info.size == 300 * MiB);
    assert_int_equal(vmh_heap_free(c, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_realloc(&g, 5 * MiB, NULL, false), CUDA_SUCCESS);
    assert_true(vmh_heap_find(g, &info) && !info.packed); /* may grow in place */
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
    /* Freed space serves another size without a driver call. */
    sim_reset_counters();
    assert_int_equal(vmh_heap_alloc(4 * MiB + 12345, &a), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemCreate"), 0);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(g, NULL, false), CUDA_SUCCESS);
}

static void reuses_after_one_sync(void **state)
{
    (void)state;
    CUdeviceptr p, q;
    assert_int_equal(vmh_heap_alloc(64 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    sim_reset_counters();
    assert_int_equal(vmh_heap_alloc(64 * MiB, &q), CUDA_SUCCESS);
    assert_int_equal(q, p);
    assert_int_equal(sim_calls("cuMemCreate"), 0);
    assert_int_equal(sim_calls("cuCtxSynchronize"), 1); /* the parked free is released once */
    /* Many frees, one synchronize. */
    CUdeviceptr s[20];
    for (int i = 0; i < 20; i++)
        assert_int_equal(vmh_heap_alloc(10000, &s[i]), CUDA_SUCCESS);
    for (int i = 0; i < 20; i++)
        assert_int_equal(vmh_heap_free(s[i], NULL, false), CUDA_SUCCESS);
    sim_reset_counters();
    for (int i = 0; i < 20; i++)
        assert_int_equal(vmh_heap_alloc(10000, &s[i]), CUDA_SUCCESS);
    assert_true(sim_calls("cuCtxSynchronize") <= 1);
    assert_int_equal(sim_calls("cuMemCreate"), 0);
    for (int i = 0; i < 20; i++)
        assert_int_equal(vmh_heap_free(s[i], NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
    assert_true(vmh_heap_idle_bytes(0) >= 64 * MiB);
    assert_true(vmh_heap_trim() >= 64 * MiB);
    assert_int_equal(vmh_heap_idle_bytes(0), 0);
}

static void never_reused_before_the_sync(void **state)
{
    (void)state;
    CUdeviceptr p, q;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    /* The synchronize fails: nothing is proven, so the parked block must not come back. */
    sim_fail_function("cuCtxSynchronize", 1, CUDA_ERROR_LAUNCH_FAILED);
    assert_int_equal(vmh_heap_alloc(2 * MiB, &q), CUDA_SUCCESS);
    sim_clear_faults();
    assert_int_not_equal(q, p);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
}

static void out_of_memory_trims_then_fails_natively(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = 64 * MiB};
    tu_reset(&cfg);
    CUdeviceptr p, q;
    assert_int_equal(vmh_heap_alloc(40 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    /* 40 MiB idle in the cache; 50 MiB only fits once it is given back. */
    assert_int_equal(vmh_heap_alloc(50 * MiB, &q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(50 * MiB, &p), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_heap_alloc(SIZE_MAX, &p), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_heap_alloc(SIZE_MAX / 2, &p), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_heap_alloc(0, &p), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
}

static void memory_limit(void **state)
{
    (void)state;
    tu_opt.mem_limit = 8 * MiB;
    tu_configure();
    CUdeviceptr p, q;
    assert_int_equal(vmh_heap_alloc(6 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &q), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_heap_alloc(1 * MiB, &q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(8 * MiB, &q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
}

static void no_context(void **state)
{
    (void)state;
    CUdeviceptr p;
    sim_set_current_device(-1);
    assert_int_equal(vmh_heap_alloc(1000, &p), CUDA_ERROR_INVALID_CONTEXT);
    sim_set_current_device(0);
}

static void pitch_follows_native_rules(void **state)
{
    (void)state;
    CUdeviceptr p;
    size_t pitch;
    assert_int_equal(vmh_heap_alloc_pitch(1000, 77, 4, NULL, &p, &pitch), CUDA_SUCCESS);
    assert_int_equal(pitch, 1024);
    vmh_buffer_info_t info;
    assert_true(vmh_heap_find(p + 5000, &info));
    assert_int_equal(info.size, 1024 * 77);
    assert_int_equal(vmh_heap_alloc_pitch(1000, 77, 3, NULL, &p, &pitch), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_heap_free(info.base, NULL, false), CUDA_SUCCESS);
}

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

static void alloc_on_a_device_without_a_context(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    sim_set_current_device(-1); /* like PyTorch's autograd threads */
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc_on(1, 3 * MiB, &p), CUDA_SUCCESS);
    vmh_buffer_info_t info;
    assert_true(vmh_heap_find(p, &info));
    assert_int_equal(info.device, 1);
    assert_int_equal(vmh_heap_free(p, NULL, true), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc_on(1, 3 * MiB, &p), CUDA_SUCCESS); /* syncs device 1 */
    assert_int_equal(vmh_heap_free(p, NULL, true), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc_on(99, 10, &p), CUDA_ERROR_INVALID_DEVICE);
    sim_set_current_device(0);
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
    assert_true(info.packed);
    tu_fill(p, 3000, 8);
    sim_reset_counters();
    assert_int_equal(vmh_heap_realloc(&p, 5 * MiB, NULL, false), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemcpyDtoD"), 1);
    assert_true(tu_check(p, 3000, 8));
    assert_true(vmh_heap_find(p, &info));
    assert_false(info.packed);
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

/* ---- devices and threads ---- */

static void allocations_land_on_the_current_device(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    CUdeviceptr p0, p1, s1;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p0), CUDA_SUCCESS);
    sim_set_current_device(1);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p1), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(500, &s1), CUDA_SUCCESS);
    vmh_buffer_info_t info;
    assert_true(vmh_heap_find(p1, &info));
    assert_int_equal(info.device, 1);
    assert_true(vmh_heap_find(s1, &info));
    assert_int_equal(info.device, 1);
    assert_true(sim_device_used(1) >= 6 * MiB);
    assert_int_equal(sim_access_flags(p1, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    tu_fill(p1, 4 * MiB, 10);
    assert_true(tu_check(p1, 4 * MiB, 10));
    /* Freed from the other device's context. */
    sim_set_current_device(0);
    assert_int_equal(vmh_heap_free(p1, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(s1, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p0, NULL, false), CUDA_SUCCESS);
    assert_true(vmh_heap_trim() >= 8 * MiB);
}

static void peers_granted_up_front(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    tu_opt.peers = 0x3;
    tu_configure();
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(p, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void refused_handle_type_falls_back(void **state)
{
    (void)state;
    tu_opt.handle = VMH_HANDLE_FABRIC; /* the simulated driver answers 800, as the H200 did */
    tu_configure();
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
    tu_fill(p, 4 * MiB, 12);
    assert_true(tu_check(p, 4 * MiB, 12));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* What an importer does with an export: maps its chunks in an address range of its own (the
 * export's references stand for the importer's handles). Returns the buffer's address there. */
static CUdeviceptr import_view(const vmh_export_t *ex, CUdeviceptr *va, size_t *len)
{
    *len = 0;
    for (size_t i = 0; i < ex->nchunks; i++)
        *len += ex->chunks[i]->size;
    assert_int_equal(vmh_drv.cuMemAddressReserve(va, *len, 0, 0, 0), CUDA_SUCCESS);
    size_t at = 0;
    for (size_t i = 0; i < ex->nchunks; i++) {
        assert_int_equal(vmh_drv.cuMemMap(*va + at, ex->chunks[i]->size, 0,
                                          ex->chunks[i]->handle, 0),
                         CUDA_SUCCESS);
        at += ex->chunks[i]->size;
    }
    CUmemAccessDesc rw = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    assert_int_equal(vmh_drv.cuMemSetAccess(*va, *len, &rw, 1), CUDA_SUCCESS);
    return *va + ex->offset;
}

static void import_view_close(CUdeviceptr va, size_t len)
{
    assert_int_equal(vmh_drv.cuMemUnmap(va, len), CUDA_SUCCESS);
    assert_int_equal(vmh_drv.cuMemAddressFree(va, len), CUDA_SUCCESS);
}

/* Whether [p, p + n) overlaps [base, base + len). */
static bool overlaps(CUdeviceptr p, size_t n, CUdeviceptr base, size_t len)
{
    return p < base + len && base < p + n;
}

/* The export's serial: one per life of a buffer; a free kills it. */
static void export_serial_dies_with_the_free(void **state)
{
    (void)state;
    CUdeviceptr big, small;
    assert_int_equal(vmh_heap_alloc(6 * MiB, &big), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(3000, &small), CUDA_SUCCESS);
    vmh_export_t ex, ex2, exs;
    assert_int_equal(vmh_heap_export(big + 100, &ex), CUDA_SUCCESS);
    assert_int_equal(ex.base, big);
    assert_int_equal(ex.size, 6 * MiB);
    assert_int_equal(ex.offset, 0);
    assert_int_equal(ex.nchunks, 1);
    assert_int_not_equal(ex.serial, 0);
    assert_int_equal(vmh_heap_export(big, &ex2), CUDA_SUCCESS);
    assert_int_equal(ex2.serial, ex.serial); /* one life, one serial */
    vmh_heap_export_release(&ex2);
    assert_int_equal(vmh_heap_export(small, &exs), CUDA_SUCCESS);
    assert_int_equal(exs.size, 3000);
    assert_true(exs.offset < 2 * MiB);
    assert_int_not_equal(exs.serial, ex.serial);
    assert_int_equal(vmh_heap_export(0x1000, &ex2), CUDA_ERROR_NOT_FOUND);
    assert_true(vmh_heap_export_alive(big, ex.serial));
    assert_true(vmh_heap_export_alive(small, exs.serial));
    assert_false(vmh_heap_export_alive(big, exs.serial));
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
    assert_false(vmh_heap_export_alive(big, ex.serial));
    assert_false(vmh_heap_export_alive(small, exs.serial));
    vmh_heap_export_release(&ex);
    vmh_heap_export_release(&exs);
}

/* As natively (tests/gpu/ipc_gpu.cu free_first on the H200): once the exporter frees an
 * exported buffer, its next allocations never land in that memory and the importer keeps
 * seeing its data; the library gives its own hold back after the reclaim wait, and the memory
 * lives exactly as long as the importer holds it. On 882660a the freed big buffer was cached
 * and served again at once (big2 == big), and the packed slot was reused. */
static void freed_export_memory_is_never_served_again(void **state)
{
    (void)state;
    CUdeviceptr big, small, pad;
    assert_int_equal(vmh_heap_alloc(6 * MiB, &big), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(1000, &pad), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(3000, &small), CUDA_SUCCESS);
    tu_fill(big, 6 * MiB, 21);
    tu_fill(small, 3000, 22);
    vmh_export_t ex, exs;
    assert_int_equal(vmh_heap_export(big, &ex), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_export(small, &exs), CUDA_SUCCESS);
    CUdeviceptr va, vas;
    size_t len, lens;
    CUdeviceptr view = import_view(&ex, &va, &len), views = import_view(&exs, &vas, &lens);
    const CUdeviceptr small_chunk = small - exs.offset;
    const size_t small_chunk_len = lens;
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
    /* The same sizes again, and more small ones than the freed slot's chunk holds. */
    CUdeviceptr big2, small2[40];
    assert_int_equal(vmh_heap_alloc(6 * MiB, &big2), CUDA_SUCCESS);
    assert_false(overlaps(big2, 6 * MiB, big, 6 * MiB));
    tu_fill(big2, 6 * MiB, 23);
    for (int i = 0; i < 40; i++) {
        assert_int_equal(vmh_heap_alloc(3000, &small2[i]), CUDA_SUCCESS);
        assert_false(overlaps(small2[i], 3000, small_chunk, small_chunk_len));
        tu_fill(small2[i], 3000, 24);
    }
    /* The free of the pad empties the retired extent: it goes after the wait. */
    assert_int_equal(vmh_heap_free(pad, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    assert_false(sim_is_mapped(big));
    assert_false(sim_is_mapped(small_chunk));
    /* The importer's view is intact. */
    assert_true(tu_check(view, 6 * MiB, 21));
    assert_true(tu_check(views, 3000, 22));
    /* The library holds nothing of it: closing the importer's side leaves only live buffers. */
    size_t allocs = sim_live_allocations();
    import_view_close(va, len);
    import_view_close(vas, lens);
    vmh_heap_export_release(&ex);
    vmh_heap_export_release(&exs);
    assert_int_equal(sim_live_allocations(), allocs - 2);
    assert_int_equal(vmh_heap_free(big2, NULL, false), CUDA_SUCCESS);
    for (int i = 0; i < 40; i++)
        assert_int_equal(vmh_heap_free(small2[i], NULL, false), CUDA_SUCCESS);
}

/* 200 rounds of export and free of packed buffers (each beside a live neighbour) leave the
 * library holding a small bound, and nothing once the neighbours go (on a928081 every exported
 * packed slot stayed parked for good: 832 MiB held after 200 rounds on the H200; on 882660a the
 * slot was served again while an importer could still map it). */
static void export_free_rounds_hold_nothing(void **state)
{
    (void)state;
    CUdeviceptr keep[200];
    for (int i = 0; i < 200; i++) {
        CUdeviceptr p;
        vmh_export_t ex;
        assert_int_equal(vmh_heap_alloc((size_t)64 << 10, &p), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_alloc(512, &keep[i]), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_export(p, &ex), CUDA_SUCCESS);
        vmh_heap_export_release(&ex);
        assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
        if (i >= 2) /* the neighbour of two rounds ago goes: at most a few extents are held */
            assert_int_equal(vmh_heap_free(keep[i - 2], NULL, false), CUDA_SUCCESS);
    }
    /* The extents of the last rounds (2 MiB each: a retire starts small ones again). */
    assert_true(sim_device_used(0) <= 8 * MiB);
    vmh_heap_trim();
    assert_true(sim_device_used(0) <= 4 * MiB);
    assert_int_equal(vmh_heap_free(keep[198], NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(keep[199], NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    assert_int_equal(sim_device_used(0), 0);
}

static void peer_access_reaches_existing_and_new_buffers(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    CUdeviceptr a, s, b;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(100, &s), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(a, 1), 0);
    assert_int_equal(vmh_heap_set_peer_access(0, 1, true), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(a, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(s, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(vmh_heap_alloc(8 * MiB, &b), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(b, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    /* A grow that moves keeps the peer's access on every chunk. */
    tu_opt.headroom = 0;
    tu_configure();
    sim_refuse_hints(true);
    assert_int_equal(vmh_heap_realloc(&b, 20 * MiB, NULL, false), CUDA_SUCCESS);
    sim_refuse_hints(false);
    assert_int_equal(sim_access_flags(b, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(b + 19 * MiB, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(vmh_heap_set_peer_access(0, 1, false), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(a, 1), 0);
    assert_int_equal(sim_access_flags(b, 1), 0);
    assert_int_equal(vmh_heap_set_peer_access(0, 0, true), CUDA_ERROR_INVALID_DEVICE);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(s, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
}

#define THREADS 8
#define ROUNDS 400

static void *churn(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    sim_set_current_device(0);
    CUdeviceptr live[16] = {0};
    size_t size[16] = {0};
    for (int i = 0; i < ROUNDS; i++) {
        int k = (int)(rand_r(&seed) % 16);
        if (live[k]) {
            if (!tu_check(live[k], size[k], seed_of(k)))
                return (void *)1;
            if (vmh_heap_free(live[k], NULL, false) != CUDA_SUCCESS)
                return (void *)1;
            live[k] = 0;
        } else {
            unsigned r = rand_r(&seed);
            size[k] = r % 4 == 0 ? (size_t)(r % (6 * MiB)) + 1 : (size_t)(r % 70000) + 1;
            if (vmh_heap_alloc(size[k], &live[k]) != CUDA_SUCCESS)
                return (void *)1;
            if (!tu_fill_try(live[k], size[k], seed_of(k)))
                return (void *)1;
        }
    }
    for (int k = 0; k < 16; k++)
        if (live[k] && vmh_heap_free(live[k], NULL, false) != CUDA_SUCCESS)
            return (void *)1;
    return NULL;
}

/* Every thread packs large requests: a thread whose new extent was taken by another thread
 * before it could use it must make another, not report out of memory. */
static void *packed_churn(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    sim_set_current_device(0);
    CUdeviceptr live[8] = {0};
    for (int i = 0; i < 300; i++) {
        int k = (int)(rand_r(&seed) % 8);
        if (live[k]) {
            if (vmh_heap_free(live[k], NULL, false) != CUDA_SUCCESS)
                return (void *)1;
            live[k] = 0;
        } else {
            size_t size = (size_t)(rand_r(&seed) % (48 * MiB)) + 1;
            if (vmh_heap_alloc(size, &live[k]) != CUDA_SUCCESS)
                return (void *)2;
        }
    }
    for (int k = 0; k < 8; k++)
        if (live[k] && vmh_heap_free(live[k], NULL, false) != CUDA_SUCCESS)
            return (void *)1;
    return NULL;
}

static void threads_pack_large_requests_without_spurious_oom(void **state)
{
    (void)state;
    tu_opt.pack_below = 512 * MiB;
    tu_configure();
    pthread_t t[16];
    for (uintptr_t i = 0; i < 16; i++)
        assert_int_equal(pthread_create(&t[i], NULL, packed_churn, (void *)(i + 1)), 0);
    for (int i = 0; i < 16; i++) {
        void *bad;
        pthread_join(t[i], &bad);
        assert_null(bad);
    }
}

static void threads_churn_with_data_checks(void **state)
{
    (void)state;
    pthread_t t[THREADS];
    for (uintptr_t i = 0; i < THREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, churn, (void *)(i + 1)), 0);
    for (int i = 0; i < THREADS; i++) {
        void *bad;
        pthread_join(t[i], &bad);
        assert_null(bad);
    }
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_requested), 0);
}


/* ---- packing shards ---- */

/* Blocks handed between threads: allocated on one, checked and freed on another. */
typedef struct handed {
    CUdeviceptr p;
    size_t size;
    unsigned seed;
} handed_t;

#define HAND_SLOTS 64
static pthread_mutex_t hand_lock = PTHREAD_MUTEX_INITIALIZER;
static handed_t hand[HAND_SLOTS];
static _Atomic unsigned hand_seed;

static void *sharded_churn(void *arg)
{
    unsigned rs = (unsigned)(uintptr_t)arg;
    sim_set_current_device(0);
    handed_t own[8] = {{0}};
    for (int i = 0; i < 300; i++) {
        unsigned r = rand_r(&rs);
        int k = (int)(r % 8);
        if (own[k].p) {
            /* Check it, then either free it here or hand it to another thread. */
            if (!tu_check(own[k].p, own[k].size, own[k].seed))
                return (void *)1;
            bool handed = false;
            if (r & 0x100) {
                pthread_mutex_lock(&hand_lock);
                int slot = (int)((r >> 9) % HAND_SLOTS);
                if (!hand[slot].p) {
                    hand[slot] = own[k];
                    handed = true;
                }
                pthread_mutex_unlock(&hand_lock);
            }
            if (!handed && vmh_heap_free(own[k].p, NULL, (r & 0x200) != 0) != CUDA_SUCCESS)
                return (void *)1;
            own[k].p = 0;
        } else {
            own[k].size = r % 5 == 0 ? (size_t)(r % (3 * MiB)) + 1 : (size_t)(r % 40000) + 1;
            own[k].seed = atomic_fetch_add(&hand_seed, 1) * 2654435761u;
            if (vmh_heap_alloc(own[k].size, &own[k].p) != CUDA_SUCCESS)
                return (void *)2;
            if (!tu_fill_try(own[k].p, own[k].size, own[k].seed))
                return (void *)3;
        }
        /* Take a block another thread allocated: check and free it here. */
        handed_t h = {0};
        pthread_mutex_lock(&hand_lock);
        int slot = (int)(rand_r(&rs) % HAND_SLOTS);
        h = hand[slot];
        hand[slot].p = 0;
        pthread_mutex_unlock(&hand_lock);
        if (h.p) {
            vmh_buffer_info_t info;
            if (!vmh_heap_find(h.p, &info) || !info.packed || info.size != h.size ||
                !tu_check(h.p, h.size, h.seed))
                return (void *)4;
            if (vmh_heap_free(h.p, NULL, false) != CUDA_SUCCESS)
                return (void *)5;
        }
    }
    for (int k = 0; k < 8; k++)
        if (own[k].p && (!tu_check(own[k].p, own[k].size, own[k].seed) ||
                         vmh_heap_free(own[k].p, NULL, false) != CUDA_SUCCESS))
            return (void *)6;
    return NULL;
}

/* 16 threads over the 8 shards, everything packed, blocks freed by other threads than the
 * ones that allocated them (so in shards that are not the freeing thread's). */
static void threads_churn_across_shards(void **state)
{
    (void)state;
    tu_opt.pack_below = 512 * MiB;
    tu_configure();
    memset(hand, 0, sizeof hand);
    pthread_t t[16];
    for (uintptr_t i = 0; i < 16; i++)
        assert_int_equal(pthread_create(&t[i], NULL, sharded_churn, (void *)(i + 101)), 0);
    for (int i = 0; i < 16; i++) {
        void *bad;
        pthread_join(t[i], &bad);
        assert_null(bad);
    }
    for (int i = 0; i < HAND_SLOTS; i++) {
        if (!hand[i].p)
            continue;
        assert_true(tu_check(hand[i].p, hand[i].size, hand[i].seed));
        assert_int_equal(vmh_heap_free(hand[i].p, NULL, false), CUDA_SUCCESS);
    }
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_requested), 0);
}

/* Runs one step on a thread of its own (a new thread: a shard of its own, in turn). */
typedef struct step {
    enum { STEP_ALLOC, STEP_FREE, STEP_SHARD } op;
    size_t size;
    CUdeviceptr p;
    unsigned shard;
    CUresult rc;
} step_t;

static void *step_run(void *arg)
{
    step_t *st = arg;
    sim_set_current_device(0);
    st->shard = vmh_heap_thread_shard();
    if (st->op == STEP_ALLOC)
        st->rc = vmh_heap_alloc(st->size, &st->p);
    else if (st->op == STEP_FREE)
        st->rc = vmh_heap_free(st->p, NULL, false);
    return NULL;
}

static step_t step_on_new_thread(step_t st)
{
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, step_run, &st), 0);
    pthread_join(t, NULL);
    return st;
}

/* Frugality: free space in another thread's shard is used before any memory is made, and a
 * block freed on one thread is reused, after one synchronize, by another thread in another
 * shard when every shard is full. */
static void shards_reuse_each_others_space(void **state)
{
    (void)state;
    tu_opt.pack_below = 512 * MiB;
    tu_configure();
    /* A thread whose shard has nothing takes room from another shard. */
    step_t a = step_on_new_thread((step_t){.op = STEP_ALLOC, .size = 1000});
    assert_int_equal(a.rc, CUDA_SUCCESS);
    sim_reset_counters();
    step_t b = step_on_new_thread((step_t){.op = STEP_ALLOC, .size = 1000});
    assert_int_equal(b.rc, CUDA_SUCCESS);
    assert_int_not_equal(a.shard, b.shard);
    assert_int_equal(sim_calls("cuMemCreate"), 0);
    assert_int_equal(vmh_heap_free(a.p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b.p, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();

    /* 64 MiB requests: each fills an extent of its own exactly. One per shard, on 8 threads
     * that take the 8 shards in turn. */
    step_t full[8];
    for (int i = 0; i < 8; i++) {
        full[i] = step_on_new_thread((step_t){.op = STEP_ALLOC, .size = 64 * MiB});
        assert_int_equal(full[i].rc, CUDA_SUCCESS);
        tu_fill(full[i].p, 4096, (unsigned)i);
    }
    assert_int_equal(sim_live_allocations(), 8);
    /* The first one is freed (on yet another thread); a thread in another shard asks for the
     * same size while every shard is full. */
    step_t f = step_on_new_thread((step_t){.op = STEP_FREE, .p = full[0].p});
    assert_int_equal(f.rc, CUDA_SUCCESS);
    sim_reset_counters();
    step_t q;
    do { /* a thread whose shard is not the freed block's */
        q = step_on_new_thread((step_t){.op = STEP_SHARD});
    } while (q.shard == full[0].shard || q.shard == f.shard);
    q = step_on_new_thread((step_t){.op = STEP_ALLOC, .size = 64 * MiB});
    assert_int_equal(q.rc, CUDA_SUCCESS);
    assert_int_not_equal(q.shard, full[0].shard);
    assert_int_equal(q.p, full[0].p); /* reused, not grown */
    assert_int_equal(sim_calls("cuMemCreate"), 0);
    assert_int_equal(sim_calls("cuCtxSynchronize"), 1);
    for (int i = 1; i < 8; i++) {
        assert_true(tu_check(full[i].p, 4096, (unsigned)i));
        assert_int_equal(vmh_heap_free(full[i].p, NULL, false), CUDA_SUCCESS);
    }
    assert_int_equal(vmh_heap_free(q.p, NULL, false), CUDA_SUCCESS);
}

/* ---- memory pressure ---- */

static vmh_export_t pressure_export;
static int pressure_calls;

/* What ipc.c does under pressure: let go of the exports of freed buffers. */
static bool drop_stale_export(void)
{
    pressure_calls++;
    if (pressure_export.nchunks &&
        !vmh_heap_export_alive(pressure_export.base, pressure_export.serial)) {
        vmh_heap_export_release(&pressure_export);
        return true;
    }
    return false;
}

/* An allocation that finds the device full first lets other layers drop what pins freed
 * memory (the pressure hook: exports of freed buffers), then waits for parked frees and trims,
 * and only then fails. */
static void pressure_hook_runs_before_out_of_memory(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = 32 * MiB};
    tu_reset(&cfg);
    CUdeviceptr a, b;
    assert_int_equal(vmh_heap_alloc(16 * MiB, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_export(a, &pressure_export), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    pressure_calls = 0;
    vmh_heap_on_pressure(drop_stale_export);
    /* 16 MiB held by the export's references (the library's own range goes after the wait):
     * 24 MiB fit only once the references go. */
    assert_int_equal(vmh_heap_alloc(24 * MiB, &b), CUDA_SUCCESS);
    assert_int_equal(pressure_calls, 1);
    assert_int_equal(pressure_export.nchunks, 0);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
    vmh_heap_on_pressure(NULL);
}

/* ---- the packed fast path (issue 13) ---- */

/* Once the device and a packing extent exist, a packed allocation on the current context and
 * its stream-ordered free make no driver call at all (a928081 made two per allocation to find
 * the current device). */
static void packed_fast_path_makes_no_driver_call(void **state)
{
    (void)state;
    tu_opt.park_limit = 256 * MiB; /* the default: no allocating thread waits (reclaim.h) */
    tu_configure();
    CUdeviceptr keep, p;
    assert_int_equal(vmh_heap_alloc(4096, &keep), CUDA_SUCCESS);
    sim_reset_counters();
    for (int i = 0; i < 100; i++) {
        assert_int_equal(vmh_heap_alloc((size_t)256 << (i % 6), &p), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_free(p, NULL, true), CUDA_SUCCESS);
    }
    assert_int_equal(sim_call_count(), 0);
    assert_int_equal(vmh_heap_free(keep, NULL, false), CUDA_SUCCESS);
}

/* ---- issue 20: a trim between a new extent's publication and its use ---- */

static void trim_in_the_window(void)
{
    vmh_packing_test_extent_published = NULL; /* once */
    vmh_heap_trim();                          /* what a pause on another thread does */
}

/* A pause's trim ran on another thread just after an allocating thread had published a new
 * packing extent and let go of its shard's lock (CI, ASan: the allocating thread then read the
 * extent's range, which the trim had destroyed). The hook runs the trim in that window, every
 * time: the new extent must already hold the block it was made for, so the trim leaves it
 * alone, the allocation is served from it with one chunk made, and nothing is read of memory
 * the trim gave back (ASan would say so). */
static void trim_never_takes_an_extent_being_served(void **state)
{
    (void)state;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(VMH_ARENA_ALIGN, &p), CUDA_SUCCESS); /* the device set up */
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    sim_reset_counters();
    vmh_packing_test_extent_published = trim_in_the_window;
    assert_int_equal(vmh_heap_alloc(4096, &p), CUDA_SUCCESS);
    assert_null(vmh_packing_test_extent_published); /* the window was met */
    assert_int_equal(sim_calls("cuMemCreate"), 1);
    assert_int_equal(sim_calls("cuMemUnmap"), 0);
    assert_true(sim_is_mapped(p));
    tu_fill(p, 4096, 9);
    assert_true(tu_check(p, 4096, 9));
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

/* ---- idle bytes (cuMemGetInfo, issue 16) ---- */

/* Only what an allocation would get counts as idle: whole idle buffers and packing extents with
 * no live block, not the free space beside a live block (an allocation of another size cannot
 * use it: on a928081, 416 MiB were reported where 256 MiB could be allocated). */
static void idle_bytes_count_only_whole_chunks(void **state)
{
    (void)state;
    CUdeviceptr small, big, q;
    assert_int_equal(vmh_heap_alloc(4096, &small), CUDA_SUCCESS); /* a 2 MiB extent */
    assert_int_equal(vmh_heap_idle_bytes(0), 0);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &big), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_idle_bytes(0), 4 * MiB); /* the parked buffer, whole */
    /* An allocation of that many bytes gets them without new memory. */
    size_t used = sim_device_used(0);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &q), CUDA_SUCCESS);
    assert_int_equal(sim_device_used(0), used);
    assert_int_equal(vmh_heap_idle_bytes(0), 0);
    /* The extent is idle once its last block is freed (parked blocks go at the next wait). */
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_idle_bytes(0), GRAN);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_idle_bytes(0), GRAN + 4 * MiB);
    assert_int_equal(vmh_heap_trim(), GRAN + 4 * MiB);
    assert_int_equal(vmh_heap_idle_bytes(0), 0);
}

/* ---- peer access while a buffer is being made (issue 16) ---- */

static CUresult (*real_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                            unsigned long long);
static atomic_int grant_on_next_map;
static atomic_bool grant_done;
static CUresult grant_rc;
static pthread_t grant_thread;

static void *grant_peer(void *arg)
{
    (void)arg;
    grant_rc = vmh_heap_set_peer_access(0, 1, true);
    atomic_store(&grant_done, true);
    return NULL;
}

/* cuMemMap, then (once) a peer grant from another thread, given up to 200 ms to finish before
 * the mapping's cuMemSetAccess: the grant runs while the new buffer is half made. */
static CUresult map_then_grant(CUdeviceptr ptr, size_t size, size_t offset,
                               CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    CUresult rc = real_map(ptr, size, offset, handle, flags);
    if (atomic_exchange(&grant_on_next_map, 0)) {
        assert_int_equal(pthread_create(&grant_thread, NULL, grant_peer, NULL), 0);
        for (int i = 0; i < 200 && !atomic_load(&grant_done); i++)
            usleep(1000);
    }
    return rc;
}

static void peer_grant_during_a_new_buffer_reaches_it(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    CUdeviceptr a, b;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &a), CUDA_SUCCESS); /* the device exists */
    vmh_driver_t t = *sim_table();
    real_map = t.cuMemMap;
    t.cuMemMap = map_then_grant;
    vmh_driver_install(&t);
    atomic_store(&grant_done, false);
    atomic_store(&grant_on_next_map, 1);
    assert_int_equal(vmh_heap_alloc(8 * MiB, &b), CUDA_SUCCESS);
    pthread_join(grant_thread, NULL);
    vmh_driver_install(sim_table());
    assert_int_equal(grant_rc, CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(a, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(b, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(serves_and_frees, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(packs_small_requests, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(default_threshold_packs_every_size_but_not_growable, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(reuses_after_one_sync, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(never_reused_before_the_sync, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(out_of_memory_trims_then_fails_natively, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(memory_limit, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(no_context, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(pitch_follows_native_rules, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_null_zero_and_foreign, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_grows_in_place_with_headroom, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_moves_without_copy_and_frees_the_old_address,
                                        tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_shrinks_whole_chunks, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(async_move_keeps_old_address_dead_until_sync, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(alloc_on_a_device_without_a_context, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_packed_moves_with_one_copy, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(blocking_realloc_copy_is_done_when_it_returns, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_failure_leaves_buffer_untouched, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(refused_reservation_is_no_address, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(allocations_land_on_the_current_device, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(peers_granted_up_front, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(refused_handle_type_falls_back, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(export_serial_dies_with_the_free, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(freed_export_memory_is_never_served_again, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(export_free_rounds_hold_nothing, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(peer_access_reaches_existing_and_new_buffers, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(pressure_hook_runs_before_out_of_memory, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(packed_fast_path_makes_no_driver_call, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(trim_never_takes_an_extent_being_served, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(realloc_is_traced, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(idle_bytes_count_only_whole_chunks, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(peer_grant_during_a_new_buffer_reaches_it, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(threads_churn_with_data_checks, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(threads_pack_large_requests_without_spurious_oom,
                                        tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(threads_churn_across_shards, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(shards_reuse_each_others_space, tu_setup, tu_teardown),
    };
    return cmocka_run_group_tests_name("heap", tests, NULL, NULL);
}
