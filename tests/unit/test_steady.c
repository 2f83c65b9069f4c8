/* Unit tests of the steady state (issue 21), on the simulated driver: every size carved out of
 * mapped memory, freed memory reused at once while the program's work runs in one queue
 * (contexts.h), the end of that rule when a stream or a second context appears, and the limits
 * that follow the program (the park budget, the background tidy of idle memory).
 *
 * The simulated driver runs each context's queued work in order when that context is next
 * synchronized (simwork.c), as the legacy default stream does: a late write queued before a
 * free lands before the new owner's writes, and memory unmapped while work on it is queued is
 * a hazard. */
#ifndef VMH_TESTING
#define VMH_TESTING 1
#endif
#include "testutil.h"

#include "contexts.h"
#include "reclaim.h"

#include <cudaTypedefs.h>
#include <unistd.h>

/* The product's serving: every size carved, reuse at once on. */
static int setup(void **state)
{
    (void)state;
    tu_reset(NULL);
    tu_opt.pack_below = (size_t)1 << 40;
    tu_opt.stream_ordered = true;
    tu_opt.park_limit = (size_t)8 << 30;
    tu_configure();
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    vmh_heap_trim();
    tu_assert_ledger_empty();
    tu_assert_stats_consistent();
    assert_int_equal(sim_hazards(), 0);
    return 0;
}

static unsigned long syncs(void)
{
    return sim_calls("cuCtxSynchronize") + sim_calls("cuCtxSynchronize_v2");
}

/* Freed memory serves the next request of any size at once: no driver call, no wait. */
static void freed_memory_is_reused_at_once(void **state)
{
    (void)state;
    CUdeviceptr big, small, again;
    assert_int_equal(vmh_heap_alloc(300 * MiB, &big), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(4096, &small), CUDA_SUCCESS);
    sim_reset_counters();
    for (int i = 0; i < 50; i++) {
        assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_alloc(300 * MiB, &again), CUDA_SUCCESS);
        assert_true(again == big); /* best fit: the block just freed */
        /* and a smaller size carved out of the same memory, then given back */
        assert_int_equal(vmh_heap_free(again, NULL, false), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_alloc(100 * MiB + 12345, &again), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_free(again, NULL, false), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_alloc(300 * MiB, &big), CUDA_SUCCESS);
    }
    assert_int_equal(sim_call_count(), 0);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs), 0);
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
}

/* Many requests of a size larger than a shared extent's eighth each get an extent of their own
 * size (or grow one by what its free end lacks): nothing is left beside them that no such
 * request could use (the H200: 1024 requests of 40 MiB mapped 65 GiB in 64 MiB extents
 * before). */
static void large_requests_map_what_they_ask(void **state)
{
    (void)state;
    CUdeviceptr small[64], big[64];
    for (int i = 0; i < 64; i++) /* the shared extents grow to their largest */
        assert_int_equal(vmh_heap_alloc(1 * MiB, &small[i]), CUDA_SUCCESS);
    size_t before = sim_device_used(0);
    for (int i = 0; i < 64; i++)
        assert_int_equal(vmh_heap_alloc(40 * MiB, &big[i]), CUDA_SUCCESS);
    /* The first may grow the last shared extent's free end by what it lacks (carved_place.c's
     * growth), so the new memory is at most one request short of the requests. */
    assert_true(sim_device_used(0) - before <= 64 * 40 * MiB);
    assert_true(sim_device_used(0) - before > 63 * 40 * MiB);
    for (int i = 0; i < 64; i++) {
        assert_int_equal(vmh_heap_free(big[i], NULL, false), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_free(small[i], NULL, false), CUDA_SUCCESS);
    }
}

/* A "kernel" queued before the free writes the old owner's data; the new owner's work comes
 * after it in the same queue, so the new owner sees its own data, never the late write. */
static void late_write_lands_before_the_new_owner(void **state)
{
    (void)state;
    CUdeviceptr p, q;
    assert_int_equal(vmh_heap_alloc(8 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(sim_launch_write(NULL, NULL, p, 8 * MiB, 0x11), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(8 * MiB, &q), CUDA_SUCCESS);
    assert_true(q == p);
    assert_true(sim_pending_ops() > 0); /* nothing waited for the GPU */
    tu_fill(q, 8 * MiB, 7);             /* a synchronous copy: after the queued write */
    assert_true(tu_check(q, 8 * MiB, 7));
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
}

/* Memory freed at once may still be touched by queued work: a trim unmaps it only after a
 * wait has passed the free (a HAZARD otherwise, checked by the teardown). */
static void trim_waits_for_memory_freed_at_once(void **state)
{
    (void)state;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(100 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(sim_launch_write(NULL, NULL, p, MiB, 0x22), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    sim_reset_counters();
    assert_true(vmh_heap_trim() >= 100 * MiB);
    assert_int_equal(syncs(), 1);
    assert_int_equal(sim_pending_ops(), 0);
    assert_int_equal(sim_hazards(), 0);
    /* Nothing freed since that wait: the next trim does not wait again. */
    sim_reset_counters();
    vmh_heap_trim();
    assert_int_equal(syncs(), 0);
}

/* A free released at once may come after a trim's wait and before its unmapping (another
 * thread frees while a trim, a pause's or the tidy's, runs): the trim must leave that memory
 * mapped until a later wait has passed it, or the unmap would pull memory from under the free's
 * queued work (a HAZARD, checked by the teardown). */
static CUdeviceptr late_free;
static void free_in_the_window(void)
{
    vmh_heap_test_after_drain = NULL;
    assert_int_equal(vmh_heap_free(late_free, NULL, false), CUDA_SUCCESS);
}

static void trim_leaves_memory_freed_after_its_wait(void **state)
{
    (void)state;
    assert_int_equal(vmh_heap_alloc(200 * MiB, &late_free), CUDA_SUCCESS); /* its own extent */
    assert_int_equal(sim_launch_write(NULL, NULL, late_free, MiB, 0x66), CUDA_SUCCESS);
    vmh_heap_test_after_drain = free_in_the_window;
    vmh_heap_trim();
    assert_null(vmh_heap_test_after_drain); /* the window was met */
    assert_int_equal(sim_hazards(), 0);
    assert_true(sim_is_mapped(late_free));
    vmh_heap_trim(); /* its wait passes the free: now it goes */
    assert_false(sim_is_mapped(late_free));
}

/* The program makes a stream: from then on its work may run in two queues. The end waits once
 * for what was reused early (the late write lands before the program has the stream), and
 * frees park from then on: not reused before the GPU has passed them. */
static void a_stream_ends_reuse_at_once(void **state)
{
    (void)state;
    CUdeviceptr p, q, x;
    assert_int_equal(vmh_heap_alloc(8 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(sim_launch_write(NULL, NULL, p, 8 * MiB, 0x33), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(8 * MiB, &q), CUDA_SUCCESS); /* p's memory, at once */
    assert_true(vmh_work_in_one_queue());
    sim_reset_counters();
    vmh_work_queue_split("a stream created"); /* what the interposer reports, then waits */
    assert_false(vmh_work_in_one_queue());
    assert_true(vmh_work_split_wait_pending());
    vmh_work_split_wait();
    assert_false(vmh_work_split_wait_pending());
    assert_int_equal(syncs(), 1);
    assert_int_equal(sim_pending_ops(), 0);
    assert_string_equal(vmh_work_split_reason(), "a stream created");
    vmh_work_split_wait(); /* once */
    assert_int_equal(syncs(), 1);

    /* Now a free parks: the next request is served elsewhere, without a wait (the budget). */
    assert_int_equal(sim_launch_write(NULL, NULL, q, MiB, 0x44), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(8 * MiB, &x), CUDA_SUCCESS);
    assert_true(x != q);
    assert_true(sim_pending_ops() > 0);
    tu_fill(x, 8 * MiB, 9);
    assert_int_equal(vmh_heap_free(x, NULL, false), CUDA_SUCCESS);
}

/* Nothing was reused early (the rule was off): its end needs no wait. */
static void no_wait_when_nothing_was_reused_early(void **state)
{
    (void)state;
    tu_opt.stream_ordered = false;
    tu_configure();
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(8 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    sim_reset_counters();
    vmh_work_queue_split("a stream created");
    vmh_work_split_wait();
    assert_int_equal(syncs(), 0);
}

/* A second context on the device is a second queue too (seen by the heap on a thread that
 * allocates in it, or reported by the interposer). */
static void a_second_context_ends_reuse_at_once(void **state)
{
    (void)state;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(4096, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_true(vmh_work_in_one_queue());
    tu_ctx_fns_t f = tu_ctx_fns();
    CUcontext c = NULL;
    assert_int_equal(f.create(&c, NULL, 0, 0), CUDA_SUCCESS);
    vmh_ctx_seen(c, 0);
    assert_false(vmh_work_in_one_queue());
    assert_string_equal(vmh_work_split_reason(), "a second context on a device");
    assert_int_equal(f.set_current(sim_primary_context(0)), CUDA_SUCCESS);
    vmh_ctx_current_changed();
    /* The next allocation waits once (p was reused... freed at once), then frees park. */
    sim_reset_counters();
    assert_int_equal(vmh_heap_alloc(4096, &p), CUDA_SUCCESS);
    assert_true(syncs() >= 1);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    vmh_ctx_forget(c);
    assert_int_equal(f.destroy(c), CUDA_SUCCESS);
}

/* The late-write check of the contexts suite (test_reclaim.c) with the product's serving on: a
 * "kernel" of a second context still writes a buffer the primary context's thread frees; the
 * memory must not serve the next request before that context has passed the free. */
static void late_write_from_a_second_context_never_lands_in_reused_memory(void **state)
{
    (void)state;
    tu_ctx_fns_t f = tu_ctx_fns();
    CUdeviceptr p[16], q[16];
    for (int i = 0; i < 16; i++)
        assert_int_equal(vmh_heap_alloc(4 * MiB, &p[i]), CUDA_SUCCESS);
    CUcontext c = NULL;
    assert_int_equal(f.create(&c, NULL, 0, 0), CUDA_SUCCESS); /* current on this thread now */
    vmh_ctx_seen(c, 0);
    for (int i = 0; i < 16; i++)
        assert_int_equal(sim_launch_write(c, NULL, p[i], 4 * MiB, 0xAB), CUDA_SUCCESS);
    assert_int_equal(f.set_current(sim_primary_context(0)), CUDA_SUCCESS);
    vmh_ctx_current_changed();
    for (int i = 0; i < 16; i++)
        assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
    for (int i = 0; i < 16; i++) {
        assert_int_equal(vmh_heap_alloc(4 * MiB, &q[i]), CUDA_SUCCESS);
        tu_fill(q[i], 4 * MiB, (unsigned)i);
    }
    sim_flush(); /* the second context's late writes land now, wherever they still can */
    for (int i = 0; i < 16; i++) {
        assert_true(tu_check(q[i], 4 * MiB, (unsigned)i));
        assert_int_equal(vmh_heap_free(q[i], NULL, false), CUDA_SUCCESS);
    }
    vmh_ctx_forget(c);
    assert_int_equal(f.destroy(c), CUDA_SUCCESS);
}

/* What may stay parked follows the program's peak of live bytes: 1/8 of it, at least 64 MiB,
 * VMMHOOK_PARK_LIMIT the cap (0: nothing). */
static void park_budget_follows_the_peak(void **state)
{
    (void)state;
    tu_opt.stream_ordered = false;
    tu_configure();
    vmh_dev_t *d = NULL;
    CUdeviceptr a, b;
    assert_int_equal(vmh_heap_alloc(100 * MiB, &a), CUDA_SUCCESS);
    vmh_tag_parts_t parts;
    assert_true(vmh_heap_tag_parts(0, 0, &parts));
    d = parts.reclaim->dev;
    assert_int_equal(vmh_reclaim_park_budget(parts.reclaim), VMH_PARK_FLOOR);
    assert_int_equal(vmh_heap_alloc(2000 * MiB, &b), CUDA_SUCCESS);
    size_t peak = vmh_dev_usable_peak(d);
    assert_true(peak >= 2100 * MiB);
    assert_int_equal(vmh_reclaim_park_budget(parts.reclaim), peak / VMH_PARK_SHARE);
    tu_opt.park_limit = 128 * MiB;
    tu_configure();
    assert_int_equal(vmh_reclaim_park_budget(parts.reclaim), 128 * MiB);
    tu_opt.park_limit = 0;
    tu_configure();
    assert_int_equal(vmh_reclaim_park_budget(parts.reclaim), 0);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
}

/* Idle memory the recent peak may need again stays mapped (a step that repeats finds it); once
 * the program's peak has been lower for a whole window, the rest goes back, after a wait that
 * passes what was freed at once. */
static void tidy_keeps_the_recent_peak_and_gives_back_the_rest(void **state)
{
    (void)state;
    CUdeviceptr p[8], keep;
    assert_int_equal(vmh_heap_alloc(4096, &keep), CUDA_SUCCESS);
    for (int i = 0; i < 8; i++)
        assert_int_equal(vmh_heap_alloc(128 * MiB, &p[i]), CUDA_SUCCESS);
    for (int i = 0; i < 8; i++)
        assert_int_equal(sim_launch_write(NULL, NULL, p[i], MiB, 0x55), CUDA_SUCCESS);
    for (int i = 0; i < 8; i++)
        assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
    size_t used = sim_device_used(0);
    assert_true(used >= 1024 * MiB);
    /* Within the window of the peak: everything stays (the next step needs it). */
    vmh_heap_tidy_now(0, false);
    assert_int_equal(sim_device_used(0), used);
    /* A window ends: the peak of the window before still counts. */
    vmh_heap_tidy_now(0, true);
    assert_int_equal(sim_device_used(0), used);
    /* Another one: the peak is now the small live set; what is idle beyond it goes back. */
    sim_reset_counters();
    vmh_heap_tidy_now(0, true);
    assert_true(sim_device_used(0) <= 64 * MiB);
    assert_int_equal(syncs(), 1); /* the frees at once were passed before the unmap */
    assert_int_equal(sim_hazards(), 0);
    assert_true(vmh_counter_get(VMH_STAT_tidy_bytes) >= 1024 * MiB - 64 * MiB);
    assert_int_equal(vmh_heap_free(keep, NULL, false), CUDA_SUCCESS);
}

/* The tidy reads the live bytes and the idle ones apart: frees released at once between the
 * reads (another thread's, here the hook's) must not count their bytes twice, live and idle, and
 * send back memory the recent peak still needs. */
static CUdeviceptr freed_in_reads[8];
static void free_between_the_reads(void)
{
    for (int i = 0; i < 8; i++)
        assert_int_equal(vmh_heap_free(freed_in_reads[i], NULL, false), CUDA_SUCCESS);
    vmh_heap_test_in_tidy_reads = NULL;
}

static void tidy_counts_frees_between_its_reads_once(void **state)
{
    (void)state;
    for (int i = 0; i < 8; i++)
        assert_int_equal(vmh_heap_alloc(128 * MiB, &freed_in_reads[i]), CUDA_SUCCESS);
    size_t used = sim_device_used(0);
    assert_true(used >= 1024 * MiB);
    vmh_heap_test_in_tidy_reads = free_between_the_reads;
    vmh_heap_tidy_now(0, true);
    assert_null(vmh_heap_test_in_tidy_reads); /* the frees ran between the reads */
    assert_int_equal(vmh_counter_get(VMH_STAT_tidy_bytes), 0);
    assert_int_equal(sim_device_used(0), used); /* the peak of the window before keeps it */
    /* The memory is idle and stays so: it still goes back once the peak is older. */
    vmh_heap_tidy_now(0, true);
    vmh_heap_tidy_now(0, true);
    assert_true(sim_device_used(0) < used);
}

/* Nothing parks while frees are released at once, but the memory they leave idle must still go
 * back in the background once the program's peak no longer needs it: the first such free starts
 * the reclaim thread, whose tidy gives it back within two windows of the recent peak (1 s
 * each), with no application thread waiting. */
static void idle_memory_goes_back_in_the_background(void **state)
{
    (void)state;
    vmh_reclaim_background(true);
    CUdeviceptr p[8], keep;
    assert_int_equal(vmh_heap_alloc(4096, &keep), CUDA_SUCCESS);
    for (int i = 0; i < 8; i++)
        assert_int_equal(vmh_heap_alloc(128 * MiB, &p[i]), CUDA_SUCCESS);
    assert_false(vmh_reclaim_thread_running()); /* nothing freed yet */
    for (int i = 0; i < 8; i++)
        assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
    assert_true(vmh_reclaim_thread_running());
    unsigned long blocking = (unsigned long)vmh_counter_get(VMH_STAT_syncs_blocking);
    for (int ms = 0; ms < 20000 && vmh_counter_get(VMH_STAT_tidy_bytes) == 0; ms += 50)
        usleep(50 * 1000);
    assert_true(vmh_counter_get(VMH_STAT_tidy_bytes) >= 1024 * MiB - 64 * MiB);
    assert_true(sim_device_used(0) <= 64 * MiB);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), blocking);
    vmh_reclaim_stop();
    vmh_reclaim_background(false);
    assert_int_equal(vmh_heap_free(keep, NULL, false), CUDA_SUCCESS);
}

/* ---- warm big pairs (issue 27: bench.cu's isolated pairs of 64 MiB and 1 GiB) ---- */

/* Driver calls made on the calling thread (the reclaim thread's are counted apart). */
static uint64_t app_calls(void)
{
    return vmh_counter_get(VMH_STAT_driver_calls) -
           vmh_counter_get(VMH_STAT_driver_calls_background);
}

static unsigned long vmm_calls(void)
{
    return sim_calls("cuMemCreate") + sim_calls("cuMemRelease") + sim_calls("cuMemMap") +
           sim_calls("cuMemUnmap") + sim_calls("cuMemSetAccess") +
           sim_calls("cuMemAddressReserve") + sim_calls("cuMemAddressFree");
}

static void pair(size_t size)
{
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(size, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* While the program's work runs in one queue, a warm pair of any size is the heap's own work: no
 * driver call on the pairing thread and no wake of the reclaim thread (a futex wake, a syscall),
 * with that thread running as in the product. */
static void warm_big_pairs_make_no_driver_call(void **state)
{
    (void)state;
    vmh_reclaim_background(true);
    const size_t sizes[] = {64 * MiB, 1024 * MiB};
    for (size_t k = 0; k < 2; k++) {
        for (int i = 0; i < 10; i++)
            pair(sizes[k]);
        uint64_t calls = app_calls();
        unsigned long wakes = vmh_reclaim_wakes();
        for (int i = 0; i < 1000; i++)
            pair(sizes[k]);
        assert_int_equal(app_calls() - calls, 0);
        assert_int_equal(vmh_reclaim_wakes() - wakes, 0);
    }
    vmh_reclaim_stop();
    vmh_reclaim_background(false);
}

/* Once a stream exists (as bench.cu creates one before its pairs), frees park. A 1 GiB buffer is
 * larger than the park budget, so its free waits itself, as cudaFree does: one context
 * synchronize (and the driver's current context) per pair, no VMM call, and no wake of the
 * reclaim thread, whose wait would only contend with the pair's own. Each pair starts with the
 * thread asleep, so that a park that woke it would be counted. A 64 MiB pair parks within the
 * budget: the allocation after two waits once for both (one wait per two pairs at most). */
static void warm_big_pairs_after_a_stream_wait_once(void **state)
{
    (void)state;
    vmh_reclaim_background(true);
    vmh_work_queue_split("a stream created");
    for (int i = 0; i < 10; i++)
        pair(1024 * MiB);
    assert_true(vmh_reclaim_thread_running());
    uint64_t calls = app_calls();
    unsigned long wakes = vmh_reclaim_wakes(), vmm = vmm_calls();
    uint64_t blocking = vmh_counter_get(VMH_STAT_syncs_blocking);
    for (int i = 0; i < 100; i++) {
        usleep(1000); /* past the thread's pace (100 us): it sleeps until woken */
        pair(1024 * MiB);
    }
    assert_int_equal(vmh_reclaim_wakes() - wakes, 0);
    assert_int_equal(vmm_calls() - vmm, 0);
    assert_true(app_calls() - calls <= 2 * 100);
    assert_true(vmh_counter_get(VMH_STAT_syncs_blocking) - blocking <= 100);

    /* The 1 GiB extent is idle from here on: given back now, not by the reclaim thread's tidy
     * in the middle of the count below (two windows pass when the pairs run slowly: TSan on a
     * loaded machine; CI saw 5 calls there). */
    vmh_heap_trim();
    for (int i = 0; i < 10; i++)
        pair(64 * MiB);
    calls = app_calls();
    vmm = vmm_calls();
    for (int i = 0; i < 1000; i++)
        pair(64 * MiB);
    /* None in the plain and ASan builds. Under TSan on a loaded machine the reclaim thread may
     * not have released a parked pair before the next allocation, which then maps an extent
     * (CI run 4 saw 5 and 17 calls): a bound there, the property checked by the other builds. */
    assert_true(vmm_calls() - vmm <= (TU_SLOWDOWN > 2 ? 64u : 0u));
    assert_true(app_calls() - calls <= 2 * (1000 / 2 + 1));
    vmh_reclaim_stop();
    vmh_reclaim_background(false);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(freed_memory_is_reused_at_once, setup, teardown),
        cmocka_unit_test_setup_teardown(large_requests_map_what_they_ask, setup, teardown),
        cmocka_unit_test_setup_teardown(late_write_lands_before_the_new_owner, setup, teardown),
        cmocka_unit_test_setup_teardown(trim_waits_for_memory_freed_at_once, setup, teardown),
        cmocka_unit_test_setup_teardown(trim_leaves_memory_freed_after_its_wait, setup, teardown),
        cmocka_unit_test_setup_teardown(a_stream_ends_reuse_at_once, setup, teardown),
        cmocka_unit_test_setup_teardown(no_wait_when_nothing_was_reused_early, setup, teardown),
        cmocka_unit_test_setup_teardown(a_second_context_ends_reuse_at_once, setup, teardown),
        cmocka_unit_test_setup_teardown(
            late_write_from_a_second_context_never_lands_in_reused_memory, setup, teardown),
        cmocka_unit_test_setup_teardown(park_budget_follows_the_peak, setup, teardown),
        cmocka_unit_test_setup_teardown(tidy_keeps_the_recent_peak_and_gives_back_the_rest, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(tidy_counts_frees_between_its_reads_once, setup, teardown),
        cmocka_unit_test_setup_teardown(idle_memory_goes_back_in_the_background, setup, teardown),
        cmocka_unit_test_setup_teardown(warm_big_pairs_make_no_driver_call, setup, teardown),
        cmocka_unit_test_setup_teardown(warm_big_pairs_after_a_stream_wait_once, setup, teardown),
    };
    return cmocka_run_group_tests_name("steady", tests, NULL, NULL);
}
