/* The heap's layers (device to heap front) on the simulated driver, serving one thread on one
 * device: serving, packing, reuse after a sync and parked frees, out of memory and the pressure
 * hook, limits, pitch, the packed fast path, a trim racing a new extent, idle bytes. Each test
 * ends with everything freed, the cache trimmed and the driver's ledger empty. */
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
        assert_true(info.carved);
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
    assert_true(vmh_heap_find(a, &info) && info.carved);
    assert_true(vmh_heap_find(c, &info) && info.carved && info.size == 300 * MiB);
    assert_int_equal(vmh_heap_free(c, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_realloc(&g, 5 * MiB, NULL, false), CUDA_SUCCESS);
    assert_true(vmh_heap_find(g, &info) && !info.carved); /* may grow in place */
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

/* Once the device and a shared extent exist, a packed allocation on the current context and
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
    vmh_carved_test_extent_published = NULL; /* once */
    vmh_heap_trim();                          /* what a pause on another thread does */
}

/* A pause's trim ran on another thread just after an allocating thread had published a new
 * shared extent and let go of its shard's lock (CI, ASan: the allocating thread then read the
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
    vmh_carved_test_extent_published = trim_in_the_window;
    assert_int_equal(vmh_heap_alloc(4096, &p), CUDA_SUCCESS);
    assert_null(vmh_carved_test_extent_published); /* the window was met */
    assert_int_equal(sim_calls("cuMemCreate"), 1);
    assert_int_equal(sim_calls("cuMemUnmap"), 0);
    assert_true(sim_is_mapped(p));
    tu_fill(p, 4096, 9);
    assert_true(tu_check(p, 4096, 9));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* ---- idle bytes (cuMemGetInfo, issue 16) ---- */

/* Only what an allocation would get counts as idle: whole idle buffers and shared extents with
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
        cmocka_unit_test_setup_teardown(pressure_hook_runs_before_out_of_memory, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(packed_fast_path_makes_no_driver_call, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(trim_never_takes_an_extent_being_served, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(idle_bytes_count_only_whole_chunks, tu_setup, tu_teardown),
    };
    return cmocka_run_group_tests_name("heap_serve", tests, NULL, NULL);
}
