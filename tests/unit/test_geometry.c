/* The heap's geometry on the simulated driver (issue 27): a program asking for many buffers of
 * one size pays driver calls per extent, not per buffer (the shared extent grows with every new
 * extent), and a tag's extents are carved from a few large reservations, so that neighbours are
 * adjacent in address space. Prints the driver calls per phase it measured. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_tags_reset, vmh_pause_reset */
#endif
#include "testutil.h"
#include "testtags.h"
/* after testutil.h */
#include "heap_internal.h" /* the shards' hints: extents */

#include <pthread.h>
#include <stdatomic.h>


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
        /* at most 3 chunks per extent (carved_place.c's CHUNK_SPLIT), each mapped once */
        assert_true(c.maps <= 300);
        assert_true(c.reserves <= 8);
        tt_teardown(state);
        setup(state);
    }
}

/* VMMHOOK_CHUNK_MAX=64M: the same 20480 x 2 MiB in chunks of at most 64 MiB, so at least 640
 * of them: a pause releases each, and allocation makes and maps each (the trade the option's
 * text states; printed). */
static void chunk_max_caps_every_chunk(void **state)
{
    tu_opt.chunk_max = 64 * MiB;
    tu_configure();
    const size_t n = 20480, chunks = n * 2 * MiB / (64 * MiB);
    phase_calls_t c = buffers_in_one_tag(n, 2 * MiB);
    print_message("  %zu x 2 MiB, chunks of at most 64 MiB: alloc %lu, pause %lu, resume %lu, "
                  "free+trim %lu, maps %lu\n",
                  n, c.alloc, c.pause, c.resume, c.free, c.maps);
    assert_true(c.maps >= chunks && c.maps <= chunks + chunks / 4); /* extents end in parts */
    assert_true(c.resume >= chunks); /* a resume makes no chunk larger either */
    assert_true(c.pause >= chunks); /* one cuMemRelease a chunk */
    assert_true(c.alloc >= 2 * chunks && c.alloc <= 4 * chunks);
    (void)state;
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
    /* extents made for one 40 MiB request stay one chunk (carved_place.c's extent_chunk): a pause
     * of 40 GiB in them costs what it did (297 releases and unmaps; 424 with 32 + 8 MiB) */
    assert_true(c.pause <= 320);
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
 * reservations of their own size (own-chunk buffers keep the rest of the budget). */
static void a_small_address_budget_gets_spans_of_extent_size(void **state)
{
    (void)state;
    tu_opt.va_limit = (size_t)8 << 30; /* a first span of 16 GiB would take it all */
    tu_configure();
    CUdeviceptr p[48];
    for (int i = 0; i < 48; i++) /* 96 MiB: some shared extents, none larger than 256 MiB */
        assert_int_equal(vmh_heap_alloc(2 * MiB, &p[i]), CUDA_SUCCESS);
    assert_true(sim_calls("cuMemAddressReserve") >= 2);
    assert_true((size_t)vmh_gauge_get(VMH_STAT_bytes_reserved) < (size_t)1 << 30);
    for (int i = 0; i < 48; i++)
        assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
}

/* Extents of device 0's carved shards (their hints). */
static size_t extents_count(void)
{
    size_t n = 0;
    hdev_t *h = hdev_at(0);
    assert_non_null(h);
    FOR_EACH_PART(h, part)
    for (int k = 0; k < VMH_SHARDS; k++)
        n += atomic_load(&part->carved.shards[k].extents);
    return n;
}

/* A program whose tensors grow a little each step (tests/gpu/torch_varlen.py's shape): the
 * extents its last size freed serve the next, slightly larger size together (joined, no driver
 * call), the one left short grows by what it lacks, and a block that lived through a join keeps
 * its contents and is freed by its address (its extent's record changed under it). */
static void join_freed_neighbours_at(size_t u)
{
    CUdeviceptr old[4], now[4];
    /* Four extents of their own size, neighbours (none has a free end to grow). */
    assert_int_equal(vmm_tag_push("grow"), VMM_OK);
    for (int i = 0; i < 4; i++)
        assert_int_equal(vmh_heap_alloc(300 * u, &old[i]), CUDA_SUCCESS);
    tu_fill(old[3] + 299 * u, 4096, 5);
    const size_t extents = extents_count(), used = sim_device_used(0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(vmh_heap_free(old[i], NULL, false), CUDA_SUCCESS);
    sim_reset_counters();
    /* 2 x 310 MiB fit in the 900 MiB the first three left, only across their borders. */
    for (int i = 0; i < 2; i++)
        assert_int_equal(vmh_heap_alloc(310 * u, &now[i]), CUDA_SUCCESS);
    /* (the reclaim thread may wait for the GPU meanwhile: only memory calls count) */
    assert_int_equal(sim_calls("cuMemCreate") + sim_calls("cuMemMap"), 0);
    assert_true(extents_count() < extents);
    assert_true(tu_check(old[3] + 299 * u, 4096, 5));
    tu_fill(now[1] + 309 * u, 4096, 6);
    /* The fourth's neighbour freed too: its old extent joins as well. */
    assert_int_equal(vmh_heap_free(old[3], NULL, false), CUDA_SUCCESS);
    for (int i = 2; i < 4; i++)
        assert_int_equal(vmh_heap_alloc(310 * u, &now[i]), CUDA_SUCCESS);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    print_message("  4 x %zu MiB freed, 4 x %zu MiB served: +%zu MiB, %lu cuMemCreate\n",
                  300 * u / MiB, 310 * u / MiB, (sim_device_used(0) - used) / MiB,
                  sim_calls("cuMemCreate"));
    assert_true(sim_device_used(0) - used <= 40 * u + 2 * MiB);
    assert_true(sim_calls("cuMemCreate") <= 2); /* 40 MiB: chunks of 32 MiB and 8; 10 MiB: one */
    assert_true(tu_check(now[1] + 309 * u, 4096, 6));
    /* now[0] crosses the border of the first two extents joined: its backup is one piece's,
     * one stretch of host memory (torch_memory_saver's get_cpu_backup). The others are freed
     * first: the pause's trim makes holes of their chunks, so that only the chunks under
     * now[0] are copied (1.2 GiB of backups took minutes under TSan). */
    const CUdeviceptr border = old[1];
    assert_true(now[0] < border && border < now[0] + 310 * u);
    tu_fill(border - 4096, 8192, 8);
    for (int i = 1; i < 4; i++)
        assert_int_equal(vmh_heap_free(now[i], NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmm_pause("grow", VMM_PAUSE_BACKUP), VMM_OK);
    void *host = NULL;
    assert_int_equal(vmm_backup_host((const void *)(uintptr_t)now[0], 310 * u, &host), VMM_OK);
    assert_non_null(host);
    assert_int_equal(vmm_resume("grow"), VMM_OK);
    assert_true(tu_check(border - 4096, 8192, 8));
    assert_int_equal(vmh_heap_free(now[0], NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    assert_int_equal(sim_device_used(0), 0);
}

static void growing_requests_join_freed_neighbours(void **state)
{
    (void)state;
    /* At half the sizes too, and only there under TSan: the pause copies the buffer
     * through the library's pageable backup, which TSan checks byte by byte (77 s alone for
     * 310 MiB on 2 cores). */
    join_freed_neighbours_at(MiB / 2);
    if (TU_SLOWDOWN < 8) {
        tt_teardown(state);
        assert_int_equal(setup(state), 0);
        join_freed_neighbours_at(MiB);
    }
}

/* Small requests (at most VMH_SMALL_MAX) are carved apart from large ones: a program that
 * frees its large tensors and keeps the small ones it made between them (an optimizer's step
 * counters) gives the large memory back whole once the tidy's windows have passed, instead of
 * keeping a large chunk mapped for every few live bytes. */
static void small_blocks_do_not_pin_large_chunks(void **state)
{
    (void)state;
    CUdeviceptr big[16], small[16];
    for (int i = 0; i < 16; i++) {
        assert_int_equal(vmh_heap_alloc(64 * MiB, &big[i]), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_alloc(i % 2 ? 4096 : VMH_SMALL_MAX, &small[i]), CUDA_SUCCESS);
        tu_fill(small[i], 4096, i);
    }
    const size_t used = sim_device_used(0);
    assert_true(used >= 1024 * MiB);
    CUdeviceptr lo = big[0], hi = big[0];
    for (int i = 0; i < 16; i++) {
        lo = big[i] < lo ? big[i] : lo;
        hi = big[i] > hi ? big[i] : hi;
    }
    for (int i = 0; i < 16; i++) {
        assert_true(small[i] < lo || small[i] >= hi + 64 * MiB); /* never between large ones */
        assert_int_equal(vmh_heap_free(big[i], NULL, false), CUDA_SUCCESS);
    }
    for (int w = 0; w < 3; w++)
        vmh_heap_tidy_now(0, true);
    print_message("  16 x 64 MiB freed beside 16 small blocks kept: %zu of %zu MiB still mapped\n",
                  sim_device_used(0) / MiB, used / MiB);
    assert_true(sim_device_used(0) <= 32 * MiB);
    for (int i = 0; i < 16; i++) {
        assert_true(tu_check(small[i], 4096, i));
        assert_int_equal(vmh_heap_free(small[i], NULL, false), CUDA_SUCCESS);
    }
}

/* A request that no free space fits grows the extent whose end is free by what that end
 * lacks, when the span has room after it: the new memory is less than the request. */
static void a_large_request_grows_a_free_end(void **state)
{
    (void)state;
    CUdeviceptr a, b, c;
    assert_int_equal(vmh_heap_alloc(200 * MiB, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(60 * MiB, &b), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
    const size_t used = sim_device_used(0);
    sim_reset_counters();
    assert_int_equal(vmh_heap_alloc(100 * MiB, &c), CUDA_SUCCESS);
    print_message("  100 MiB beside a free end: +%zu MiB\n", (sim_device_used(0) - used) / MiB);
    assert_true(sim_device_used(0) - used < 100 * MiB);
    assert_true(sim_device_used(0) > used);
    assert_int_equal(sim_calls("cuMemAddressReserve"), 0);
    assert_int_equal(c, b); /* it starts in the free end */
    tu_fill(c, 100 * MiB, 3);
    assert_true(tu_check(c, 100 * MiB, 3));
    assert_int_equal(vmh_heap_free(c, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
}

/* A request of its own size on another thread (another shard: PyTorch's autograd thread) grows
 * the free end of this thread's extent rather than making a whole extent in its own shard. */
typedef struct grow_job {
    size_t size;
    CUdeviceptr p;
    CUresult rc;
    unsigned shard;
} grow_job_t;

static void *alloc_on_thread(void *arg)
{
    grow_job_t *j = arg;
    sim_set_current_device(0); /* as cudart makes the primary context current */
    j->rc = vmh_heap_alloc(j->size, &j->p);
    j->shard = vmh_heap_thread_shard();
    return NULL;
}

static void another_threads_request_grows_this_ones_free_end(void **state)
{
    (void)state;
    CUdeviceptr a, b;
    assert_int_equal(vmh_heap_alloc(200 * MiB, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(100 * MiB, &b), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS); /* a free end of 100 MiB */
    const size_t used = sim_device_used(0);
    grow_job_t j = {.size = 150 * MiB};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, alloc_on_thread, &j), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(j.rc, CUDA_SUCCESS);
    assert_int_not_equal(j.shard, vmh_heap_thread_shard());
    print_message("  150 MiB on another shard beside a free end of 100: +%zu MiB\n",
                  (sim_device_used(0) - used) / MiB);
    assert_int_equal(j.p, b);
    assert_true(sim_device_used(0) - used <= 50 * MiB);
    tu_fill(j.p + 149 * MiB, 4096, 4);
    assert_true(tu_check(j.p + 149 * MiB, 4096, 4));
    assert_int_equal(vmh_heap_free(j.p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
}

/* Joins while another thread frees blocks of the extents being joined: every free finds its
 * block (vmh_owner_lock follows an address to the extent that took it over). */
#define JOIN_ROUNDS 400
static _Atomic CUdeviceptr handoff[JOIN_ROUNDS];

static void *free_what_is_handed(void *arg)
{
    (void)arg;
    for (int i = 0; i < JOIN_ROUNDS; i++) {
        CUdeviceptr p;
        while (!(p = atomic_load(&handoff[i])))
            ;
        assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    }
    return NULL;
}

static void joins_while_another_thread_frees(void **state)
{
    (void)state;
    pthread_t t;
    for (int i = 0; i < JOIN_ROUNDS; i++)
        atomic_store(&handoff[i], 0);
    assert_int_equal(pthread_create(&t, NULL, free_what_is_handed, NULL), 0);
    for (int i = 0; i < JOIN_ROUNDS; i++) {
        CUdeviceptr p;
        /* growing sizes, a small one between: frees leave free ends that the next size needs
         * joined */
        size_t size = (i % 3 == 2) ? 1 * MiB : (size_t)(20 + i % 97) * MiB;
        assert_int_equal(vmh_heap_alloc(size, &p), CUDA_SUCCESS);
        atomic_store(&handoff[i], p);
    }
    assert_int_equal(pthread_join(t, NULL), 0);
    vmh_heap_trim();
    assert_int_equal(sim_device_used(0), 0);
}

/* Threads allocating and freeing sizes from 256 B to 256 MiB (tests/gpu/churn_mt.cu's mix),
 * frees parked (one queue per thread), joins and growth across shards meanwhile: once
 * everything is freed, no address the library keeps mapped is missing from the registry (a
 * program's cuMemGetAddressRange would reach the driver and see it mapped). */
#define MIX_THREADS 8
#define MIX_STEPS 6000
#define MIX_LIVE 48
static CUdeviceptr mix_freed[MIX_THREADS][MIX_STEPS];
static bool mix_tight; /* a device of 3 GiB: allocations meet out of memory and its relief */
static atomic_size_t mix_ooms;
static size_t mix_nfreed[MIX_THREADS];

static void *mix_run(void *arg)
{
    const int t = (int)(intptr_t)arg;
    sim_set_current_device(0);
    uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)(t + 1);
    CUdeviceptr live[MIX_LIVE] = {0};
    for (int i = 0; i < MIX_STEPS; i++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        int k = (int)(rng % MIX_LIVE);
        if (live[k]) {
            assert_int_equal(vmh_heap_free(live[k], NULL, (rng >> 40) % 7 == 0), CUDA_SUCCESS);
            mix_freed[t][mix_nfreed[t]++] = live[k];
            live[k] = 0;
            continue;
        }
        unsigned r = (unsigned)(rng >> 32) % 100;
        size_t size = r < 70   ? 256 + (rng >> 20) % (64 * 1024)
                      : r < 95 ? 64 * 1024 + (rng >> 20) % (8 * MiB)
                               : 8 * MiB + (rng >> 20) % (248 * MiB);
        CUresult rc = vmh_heap_alloc(size, &live[k]);
        if (mix_tight && rc == CUDA_ERROR_OUT_OF_MEMORY) {
            live[k] = 0; /* a device this small runs out: what matters is what it leaves */
            atomic_fetch_add(&mix_ooms, 1);
        }
        else
            assert_int_equal(rc, CUDA_SUCCESS);
    }
    for (int k = 0; k < MIX_LIVE; k++)
        if (live[k]) {
            assert_int_equal(vmh_heap_free(live[k], NULL, false), CUDA_SUCCESS);
            mix_freed[t][mix_nfreed[t]++] = live[k];
        }
    return NULL;
}

/* Where a lost address is: the driver's mapping around it, and the extents of device 0 whose
 * addresses hold it (their record, pieces and holes): what a failure needs to be understood. */
static void mix_explain(CUdeviceptr p)
{
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult rc = sim_table()->cuMemGetAddressRange(&base, &size, p);
    print_message("  lost 0x%llx: driver rc %d mapping [0x%llx, +%zu MiB)\n",
                  (unsigned long long)p, (int)rc, (unsigned long long)base, size >> 20);
    hdev_t *h = hdev_at(0);
    FOR_EACH_PART(h, part)
    for (int k = 0; k < VMH_SHARDS; k++) {
        vmh_shard_t *sh = &part->carved.shards[k];
        for (vmh_ext_t *e = sh->exts; e; e = e->next)
            if (p - e->va < e->va_size)
                print_message("    in extent %p of shard %d: [0x%llx, +%zu MiB), %zu pieces, "
                              "arena [0x%llx, +%zu MiB), %zu MiB holes\n",
                              (void *)e, k, (unsigned long long)e->va, e->va_size >> 20,
                              e->npieces, (unsigned long long)vmh_extent_base(e->extent),
                              vmh_extent_size(e->extent) >> 20, vmh_extent_holes(e->extent) >> 20);
        for (vmh_ext_t *e = sh->spare; e; e = e->next)
            if (p - e->va < e->va_size)
                print_message("    in spare record %p of shard %d: [0x%llx, +%zu MiB), %zu pieces\n",
                              (void *)e, k, (unsigned long long)e->va, e->va_size >> 20,
                              e->npieces);
    }
}

static void mix_churn(void)
{
    tu_opt.stream_ordered = false; /* frees park, as with a stream per thread */
    tu_opt.park_limit = (size_t)8 << 30; /* the product's: parked frees released by the */
    tu_configure();
    vmh_reclaim_background(true); /* reclaim thread, which also runs the tidy */
    pthread_t t[MIX_THREADS];
    atomic_store(&mix_ooms, 0);
    for (int i = 0; i < MIX_THREADS; i++) {
        mix_nfreed[i] = 0;
        assert_int_equal(pthread_create(&t[i], NULL, mix_run, (void *)(intptr_t)i), 0);
    }
    for (int i = 0; i < MIX_THREADS; i++)
        assert_int_equal(pthread_join(t[i], NULL), 0);
    size_t lost = 0;
    for (int i = 0; i < MIX_THREADS; i++)
        for (size_t k = 0; k < mix_nfreed[i]; k++)
            /* (registry first: the reclaim thread's tidy may be giving extents back meanwhile,
             * and an extent leaves the registry only once it is unmapped) */
            if (!vmh_heap_holds(mix_freed[i][k]) && sim_is_mapped(mix_freed[i][k]) && lost++ < 3)
                mix_explain(mix_freed[i][k]);
    print_message("  %zu freed addresses mapped but unregistered (%zu allocations out of memory)\n",
                  lost, atomic_load(&mix_ooms));
    assert_int_equal(lost, 0);
    vmh_heap_trim();
}

static void freed_addresses_stay_registered_while_mapped(void **state)
{
    (void)state;
    mix_tight = false;
    mix_churn();
}

/* The same on a device of 3 GiB: allocations fail, relieve the device (parked frees waited
 * for, idle memory given back) and retry while other threads join and grow extents. */
static int setup_tight(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = (size_t)3 << 30};
    tu_reset(&cfg);
    tu_opt.pack_below = (size_t)1 << 40;
    tu_configure();
    return 0;
}

static void freed_addresses_stay_registered_out_of_memory(void **state)
{
    (void)state;
    mix_tight = true;
    mix_churn();
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
        cmocka_unit_test_setup_teardown(chunk_max_caps_every_chunk, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(growing_requests_join_freed_neighbours, setup,
                                        tt_teardown),
        cmocka_unit_test_setup_teardown(a_large_request_grows_a_free_end, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(small_blocks_do_not_pin_large_chunks, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(another_threads_request_grows_this_ones_free_end, setup,
                                        tt_teardown),
        cmocka_unit_test_setup_teardown(joins_while_another_thread_frees, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(freed_addresses_stay_registered_while_mapped, setup,
                                        tt_teardown),
        cmocka_unit_test_setup_teardown(freed_addresses_stay_registered_out_of_memory,
                                        setup_tight, tt_teardown),
        cmocka_unit_test_setup_teardown(a_small_address_budget_gets_spans_of_extent_size, setup,
                                        tt_teardown),
    };
    return cmocka_run_group_tests_name("geometry", tests, NULL, NULL);
}
