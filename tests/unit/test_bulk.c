/* Bulk operations per run of adjacent memory (issue 27), on the simulated driver: the driver
 * calls of a tag's pause, resume and trim follow its extents, not its buffers (N x 2 MiB for
 * N = 1280 ... 20480, the targets at 20480), and adjacent records go with one
 * cuMemUnmap and come back with one cuMemSetAccess, their contents restored from backups. */
#ifndef VMH_TESTING
#define VMH_TESTING 1
#endif
#include "testutil.h"
#include "phase_calls.h"
#include "testtags.h"

#include "range.h"

/* Issue 27's targets for 20480 x 2 MiB in one tag (docs/SLEEP.md, "Runs"). */
#define TARGET_N 20480
#define TARGET_ALLOC 1024
#define TARGET_PAUSE 256
#define TARGET_RESUME 256

static int teardown(void **state)
{
    return tt_teardown(state);
}

/* Calls per buffer would be at least N a phase, and 16 times as many at 20480 as at 1280.
 * Per extent, they grow with the number of extents, which grows with the log of the bytes while
 * extents grow geometrically (and linearly past their cap), times the chunks of an extent (at
 * most 3 past 128 MiB: carved_place.c's CHUNK_SPLIT, so that idle chunks inside an extent can go
 * back): every phase costs at most N / 8 calls, and less than 8 times at 20480 what it costs
 * at 1280. The unmaps of a pause and the
 * access calls of a resume go per run: at most one per reservation the tag's extents were
 * carved from. Trim gives everything back. */
static void calls_follow_extents_not_buffers(void **state)
{
    (void)state;
    static const size_t ns[] = {1280, 2560, 5120, 10240, TARGET_N};
    enum { NN = sizeof ns / sizeof ns[0] };
    pc_counts_t c[NN];
    for (int i = 0; i < NN; i++) {
        assert_true(pc_measure(ns[i], 2 * MiB, 0, &c[i]));
        /* The trim after the frees gives every extent back: nothing is left in the driver. */
        tu_assert_ledger_empty();
        print_message("%6zu x 2 MiB: allocate %lu, pause %lu, resume %lu, free %lu, trim %lu\n",
                      ns[i], c[i].calls[PC_ALLOC][PC_ALL], c[i].calls[PC_PAUSE][PC_ALL],
                      c[i].calls[PC_RESUME][PC_ALL], c[i].calls[PC_FREE][PC_ALL],
                      c[i].calls[PC_TRIM][PC_ALL]);
        /* Nothing is paused without a cuMemUnmap, nothing resumed without a cuMemSetAccess. */
        assert_true(pc_get(&c[i], PC_PAUSE, "cuMemUnmap") > 0);
        assert_true(pc_get(&c[i], PC_RESUME, "cuMemSetAccess") > 0);
        unsigned long resvs = pc_get(&c[i], PC_ALLOC, "cuMemAddressReserve");
        assert_true(pc_get(&c[i], PC_PAUSE, "cuMemUnmap") <= resvs);
        assert_true(pc_get(&c[i], PC_RESUME, "cuMemSetAccess") <= resvs);
        assert_true(pc_get(&c[i], PC_TRIM, "cuMemUnmap") <= resvs);
        for (int ph = 0; ph < PC_PHASES; ph++)
            assert_true(c[i].calls[ph][PC_ALL] <= ns[i] / 8);
    }
    const pc_counts_t *lo = &c[0], *hi = &c[NN - 1];
    for (int ph = 0; ph < PC_PHASES; ph++)
        assert_true(hi->calls[ph][PC_ALL] < 8 * lo->calls[ph][PC_ALL] ||
                    hi->calls[ph][PC_ALL] == 0);
    assert_true(hi->calls[PC_ALLOC][PC_ALL] <= TARGET_ALLOC);
    assert_true(hi->calls[PC_PAUSE][PC_ALL] <= TARGET_PAUSE);
    assert_true(hi->calls[PC_RESUME][PC_ALL] <= TARGET_RESUME);
}

/* Two ranges side by side in one reservation, two chunks each (as two extents of a shard's
 * reservation are): one cuMemSetAccess maps all four, one cuMemUnmap pauses both, one
 * cuMemSetAccess resumes both (one chunk per range), and the backups come back in place. */
static vmh_range_t *range_over(vmh_map_t **maps, size_t n)
{
    vmh_range_t *r = calloc(1, sizeof *r + n * sizeof r->maps[0]);
    assert_non_null(r);
    r->base = maps[0]->ptr;
    for (size_t i = 0; i < n; i++) {
        r->maps[r->nmaps++] = maps[i];
        r->size += maps[i]->size;
    }
    return r;
}

/* n chunks of GRAN mapped as one run from GRAN into a reservation of (n + 2) GRAN: one
 * cuMemMap each, one cuMemSetAccess for all. The mappings hold the chunks and the
 * reservation. */
static void map_run(vmh_map_t **maps, size_t n)
{
    vmh_resv_t *resv;
    assert_int_equal(vmh_resv_create((n + 2) * GRAN, 0, 0, &resv), CUDA_SUCCESS);
    vmh_alloc_t *chunks[8];
    assert_true(n <= 8);
    for (size_t i = 0; i < n; i++)
        chunks[i] = tu_chunk(GRAN);
    sim_reset_counters();
    assert_int_equal(vmh_maps_create_run(resv->ptr + GRAN, chunks, n, resv, maps), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemMap"), n);
    assert_int_equal(sim_calls("cuMemSetAccess"), 1);
    for (size_t i = 0; i < n; i++)
        vmh_alloc_unref(chunks[i]);
    vmh_resv_unref(resv);
}

static void adjacent_ranges_pause_and_resume_as_one_run(void **state)
{
    (void)state;
    vmh_map_t *maps[4];
    map_run(maps, 4);
    vmh_range_t *rs[2] = {range_over(maps, 2), range_over(maps + 2, 2)};
    CUdeviceptr base[2] = {rs[0]->base, rs[1]->base};
    assert_int_equal(base[1], base[0] + 2 * GRAN);
    void *host[2];
    for (int i = 0; i < 2; i++) {
        tu_fill(base[i], 2 * GRAN, 40u + (unsigned)i);
        host[i] = malloc(2 * GRAN);
        assert_non_null(host[i]);
        assert_int_equal(vmh_drv.cuMemcpyDtoH(host[i], base[i], 2 * GRAN), CUDA_SUCCESS);
    }

    vmh_paused_t *ps[2];
    sim_reset_counters();
    assert_int_equal(vmh_range_pause_run(rs, 2, 0, ps), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemUnmap"), 1);
    assert_int_equal(sim_calls("cuMemRelease"), 4);
    assert_int_equal(sim_live_mappings(), 0);
    assert_int_equal(sim_live_reservations(), 1);

    CUmemAllocationProp prop = tu_prop(0);
    vmh_range_t *back[2];
    const void *backups[2] = {host[0], host[1]};
    sim_reset_counters();
    assert_int_equal(vmh_range_resume_run((const vmh_paused_t *const *)ps, 2, &prop, NULL, 0,
                                          backups, NULL, NULL, back),
                     CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemCreate"), 2);
    assert_int_equal(sim_calls("cuMemMap"), 2);
    assert_int_equal(sim_calls("cuMemSetAccess"), 1);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(back[i]->base, base[i]);
        assert_int_equal(back[i]->size, 2 * GRAN);
        assert_true(tu_check(base[i], 2 * GRAN, 40u + (unsigned)i));
        vmh_paused_destroy(ps[i]);
        free(host[i]);
    }
    sim_reset_counters();
    vmh_ranges_destroy(back, 2);
    assert_int_equal(sim_calls("cuMemUnmap"), 1);
    assert_int_equal(sim_calls("cuMemAddressFree"), 1);
    tu_assert_ledger_empty();
}

/* A stretch the driver refuses to unmap whole is unmapped mapping by mapping: nothing stays. */
static void refused_run_unmap_falls_back_to_one_call_each(void **state)
{
    (void)state;
    vmh_map_t *maps[3];
    map_run(maps, 3);
    sim_reset_counters();
    sim_fail_function("cuMemUnmap", 1, CUDA_ERROR_UNKNOWN);
    vmh_maps_unref_run(maps, 3);
    assert_int_equal(sim_calls("cuMemUnmap"), 4);
    tu_assert_ledger_empty();
}

/* A chunk of GRAN bytes in host memory that device 0 reaches (overflow.h's kind). */
static vmh_alloc_t *host_chunk(void)
{
    CUmemAllocationProp p = tu_prop(0);
    p.location.type = CU_MEM_LOCATION_TYPE_HOST;
    p.location.id = 0;
    CUmemAccessDesc acc = tu_rw(0);
    vmh_alloc_t *a = NULL;
    assert_int_equal(vmh_alloc_create(NULL, GRAN, &p, &acc, 1, &a), CUDA_SUCCESS);
    return a;
}

static CUresult device_chunk(void *arg, size_t size, vmh_alloc_t **out)
{
    (void)arg;
    *out = tu_chunk(size);
    return CUDA_SUCCESS;
}

/* Spilled memory moved back in two steps (range.h's rehome_begin / rehome_finish): host,
 * host, device, host chunks: three copies queued (one per host chunk, on the caller's stream),
 * one wait by the caller, then the swap at the same addresses; the contents stay, the device
 * chunk's mapping is kept, and the caller gets the three host chunks to release. */
static void rehome_keeps_contents_and_device_chunks(void **state)
{
    (void)state;
    vmh_alloc_t *chunks[4] = {host_chunk(), host_chunk(), tu_chunk(GRAN), host_chunk()};
    vmh_range_t *r = NULL;
    assert_int_equal(vmh_range_create(chunks, 4, 0, 0, 0, &r, NULL), CUDA_SUCCESS);
    for (int i = 0; i < 4; i++)
        vmh_alloc_unref(chunks[i]);
    tu_fill(r->base, r->size, 5);
    CUdeviceptr base = r->base;
    vmh_map_t *kept = r->maps[2];
    size_t nold = vmh_range_rehome_chunks(r);
    assert_int_equal(nold, 3);
    vmh_rehome_t *job = NULL;
    vmh_range_t *nr = NULL, *unfinished = NULL;
    vmh_alloc_t *old[3] = {NULL};
    sim_reset_counters();
    assert_int_equal(vmh_range_rehome_begin(r, device_chunk, NULL, NULL, &job, &unfinished),
                     CUDA_SUCCESS);
    assert_null(unfinished);
    assert_int_equal(sim_calls("cuMemcpyDtoDAsync"), 3);
    assert_int_equal(sim_calls("cuMemCreate"), 3);
    CUresult waited = vmh_drv.cuStreamSynchronize(NULL);
    assert_int_equal(vmh_range_rehome_finish(job, waited, &nr, &unfinished, old),
                     CUDA_SUCCESS);
    assert_null(unfinished);
    assert_int_equal(nr->base, base);
    assert_ptr_equal(nr->maps[2], kept);
    assert_int_equal(vmh_range_host_bytes(nr), 0);
    assert_true(tu_check(base, 4 * GRAN, 5));
    for (int i = 0; i < 3; i++) {
        assert_non_null(old[i]);
        assert_true(old[i]->host);
        vmh_alloc_unref(old[i]);
    }
    vmh_range_destroy(nr);
    tu_assert_ledger_empty();
}

/* A tag's adjacent extents paused with backups: fewer cuMemUnmap than extents (one per run of
 * a shard's reservation), every buffer's contents back after the resume. */
static void tag_pause_joins_extents_and_restores_contents(void **state)
{
    (void)state;
    pc_heap_reset();
    enum { N = 64 };
    CUdeviceptr p[N];
    assert_int_equal(vmm_tag_push(PC_TAG), VMM_OK);
    for (int i = 0; i < N; i++) {
        assert_int_equal(vmh_heap_alloc(2 * MiB, &p[i]), CUDA_SUCCESS);
        tu_fill(p[i], 2 * MiB, 7u + (unsigned)i);
    }
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    /* Backups through the staging ring, in slots of 3 MiB: per run, the pieces are the run's
     * bytes over the slot's, rounded up once per run (per record it would be once per record). */
    vmh_pause_set_staging(3 * MiB, 1);
    size_t used = sim_device_used(0);
    sim_reset_counters();
    assert_int_equal(vmm_pause(PC_TAG, VMM_PAUSE_BACKUP), VMM_OK);
    size_t paused = used - sim_device_used(0);
    unsigned long unmaps = sim_calls("cuMemUnmap"), chunks = sim_calls("cuMemRelease");
    unsigned long pieces = sim_calls("cuMemcpyDtoHAsync");
    print_message("%d x 2 MiB paused with backups: %lu cuMemUnmap for %lu chunks, %zu MiB in %lu "
                  "pieces of 3 MiB\n",
                  N, unmaps, chunks, paused / MiB, pieces);
    assert_true(chunks > 1);
    assert_true(unmaps < chunks);
    assert_true(pieces >= paused / (3 * MiB));
    assert_true(pieces <= paused / (3 * MiB) + unmaps);
    sim_reset_counters();
    assert_int_equal(vmm_resume(PC_TAG), VMM_OK);
    assert_true(sim_calls("cuMemSetAccess") < sim_calls("cuMemMap"));
    for (int i = 0; i < N; i++) {
        assert_true(tu_check(p[i], 2 * MiB, 7u + (unsigned)i));
        assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(calls_follow_extents_not_buffers, tu_setup, teardown),
        cmocka_unit_test_setup_teardown(adjacent_ranges_pause_and_resume_as_one_run, tu_setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(refused_run_unmap_falls_back_to_one_call_each, tu_setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(tag_pause_joins_extents_and_restores_contents, tu_setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(rehome_keeps_contents_and_device_chunks, tu_setup,
                                        teardown),
    };
    return cmocka_run_group_tests_name("bulk", tests, NULL, NULL);
}
