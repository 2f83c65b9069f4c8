/* Holes inside extents (issue 27), on the simulated driver: whole chunks of free space inside an
 * extent that holds live blocks are unmapped by the tidy once the program's recent peak no
 * longer needs them (their neighbours' contents intact), mapped again when an allocation needs
 * them, and a tag whose extents have holes pauses and resumes only what is mapped. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_tags_reset, vmh_pause_reset, vmh_heap_tidy_now */
#endif
#include "testutil.h"
/* after testutil.h */
#include "testtags.h"

#include "heap_internal.h" /* the shards' hints: extents and bytes in holes */

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#define N 10240 /* 2 MiB buffers: 20 GiB, in extents of up to 1 GiB (3 chunks each) */
#define KEEP_EVERY 512
/* Every keep_every-th buffer survives (KEEP_EVERY, or what a case sets before its fill). */
static int keep_every = KEEP_EVERY;

static CUdeviceptr bufs[N];

/* A block's first and last 4 KiB get a pattern (writing whole blocks of the simulated driver's
 * memory would cost seconds). */
#define MARK 4096
static void mark(CUdeviceptr p, size_t size, unsigned seed)
{
    tu_fill(p, MARK, seed);
    tu_fill(p + size - MARK, MARK, seed + 1);
}

static bool marked(CUdeviceptr p, size_t size, unsigned seed)
{
    return tu_check(p, MARK, seed) && tu_check(p + size - MARK, MARK, seed + 1);
}

/* Extents and bytes in holes of device 0's carved shards (their hints). */
static void shards_count(size_t *extents, size_t *holes)
{
    *extents = *holes = 0;
    hdev_t *h = hdev_at(0);
    assert_non_null(h);
    FOR_EACH_PART(h, part)
    for (int k = 0; k < VMH_SHARDS; k++) {
        *extents += atomic_load(&part->carved.shards[k].extents);
        *holes += atomic_load(&part->carved.shards[k].holes);
    }
}

static int setup(void **state)
{
    return tt_setup_carved(state);
}

static int teardown(void **state)
{
    for (int i = 0; i < N; i++)
        if (bufs[i])
            assert_int_equal(vmh_heap_free(bufs[i], NULL, false), CUDA_SUCCESS);
    memset(bufs, 0, sizeof bufs);
    return tt_teardown(state);
}

/* N x 2 MiB in tag "holes", every keep_every-th kept (written) and the rest freed. */
static void survivors_among_freed(void)
{
    assert_int_equal(vmm_tag_push("holes"), VMM_OK);
    for (int i = 0; i < N; i++)
        assert_int_equal(vmh_heap_alloc(2 * MiB, &bufs[i]), CUDA_SUCCESS);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    for (int i = 0; i < N; i++) {
        if (i % keep_every == 0) {
            mark(bufs[i], 2 * MiB, (unsigned)i);
            continue;
        }
        assert_int_equal(vmh_heap_free(bufs[i], NULL, false), CUDA_SUCCESS);
        bufs[i] = 0;
    }
}

/* survivors_among_freed, then two windows of the tidy: the peak is the small live set now, and
 * the free chunks go. Returns the device bytes before the tidy. */
static size_t punch_around_survivors(void)
{
    survivors_among_freed();
    size_t before = sim_device_used(0);
    vmh_heap_tidy_now(0, true);
    vmh_heap_tidy_now(0, true);
    return before;
}

static void survivors_intact(void)
{
    for (int i = 0; i < N; i += keep_every)
        if (bufs[i])
            assert_true(marked(bufs[i], 2 * MiB, (unsigned)i));
}

/* Free chunks beside live blocks go back: the device holds far less than before, the extents
 * with survivors stay (their addresses, their blocks' contents), and every byte still mapped
 * is a chunk that holds a survivor or one the trim could not take whole. */
static void idle_chunks_inside_extents_are_unmapped(void **state)
{
    (void)state;
    sim_reset_counters();
    size_t before = punch_around_survivors();
    size_t after = sim_device_used(0);
    print_message("  %d x 2 MiB, 1 in %d kept: %zu MiB mapped before the tidy, %zu MiB after; "
                  "given back %zu MiB\n",
                  N, keep_every, before / MiB, after / MiB,
                  (size_t)vmh_counter_get(VMH_STAT_tidy_bytes) / MiB);

    /* What went back is exactly what the tidy counts (whole idle extents and holes), and most
     * of it: 20 survivors hold 20 chunks of 2 to 341 MiB (carved_place.c's CHUNK_MIN, CHUNK_SPLIT),
     * and unmapping chunks of extents that hold survivors is what took the most. */
    size_t given = (size_t)vmh_counter_get(VMH_STAT_tidy_bytes), extents, holes;
    shards_count(&extents, &holes);
    print_message("  %zu extents, %zu MiB in holes\n", extents, holes / MiB);
    assert_int_equal(after, before - given);
    assert_true(given > before / 3);
    assert_true(sim_calls("cuMemRelease") > sim_calls("cuMemUnmap")); /* a stretch per call */
    survivors_intact();
    /* A pointer in a hole is no buffer. */
    vmh_buffer_info_t info;
    assert_false(vmh_heap_find(bufs[N - keep_every] - 200 * MiB, &info));
}

/* The tidy's punch unmaps with the shard's lock let go (frees and allocations never wait
 * behind those driver calls). In that window (carved.h's test hook): the shard's lock is free;
 * a free and an allocation in the shard go on; an allocation that only a hole fits maps none of
 * the holes still being unmapped, and the trim gives back none of their addresses (the
 * simulated driver refuses a mapping over a mapping and an address freed while mapped:
 * sim_rejections stays 0). After it, the survivors are intact and nothing queued touched
 * unmapped memory. */
static unsigned window_calls, window_failures; /* the lock found held, or a call failed */
static unsigned long window_rejections;

static void in_the_unmapping_window(vmh_shard_t *s)
{
    window_calls++;
    if (pthread_mutex_trylock(&s->lock) != 0) {
        window_failures++;
        return;
    }
    pthread_mutex_unlock(&s->lock);
    if (window_calls > 1)
        return; /* the first window is enough */
    unsigned long before = sim_rejections();
    /* The survivors freed (but the first), the GPU passed: their extents are empty, and the
     * trim may not give back the addresses of those whose holes are still being unmapped. */
    for (int i = keep_every; i < N; i += keep_every) {
        if (vmh_heap_free(bufs[i], NULL, false) != CUDA_SUCCESS)
            window_failures++;
        bufs[i] = 0;
    }
    hdev_t *h = hdev_at(0);
    vmh_reclaim_wait(&h->reclaim, VMH_WAIT_APP);
    size_t trimmed = 0;
    FOR_EACH_PART(h, part)
    trimmed += vmh_carved_trim(&part->carved);
    print_message("  window: trimmed %zu MiB\n", trimmed / MiB);
    /* Allocations go on; one that only a hole fits maps none being unmapped. */
    CUdeviceptr small = 0, big[12] = {0};
    if (vmh_heap_alloc(2 * MiB, &small) != CUDA_SUCCESS)
        window_failures++;
    assert_int_equal(vmm_tag_push("holes"), VMM_OK);
    /* each larger than free mapped runs, a chunk's hole fits it; together they reach the
     * addresses of the extents trimmed above */
    for (int i = 0; i < 12; i++)
        if (vmh_heap_alloc(330 * MiB, &big[i]) != CUDA_SUCCESS)
            window_failures++;
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    window_rejections += sim_rejections() - before;
    vmh_heap_free(small, NULL, false);
    for (int i = 0; i < 12; i++)
        vmh_heap_free(big[i], NULL, false);
}

static void punch_unmaps_with_the_lock_let_go(void **state)
{
    (void)state;
    window_calls = window_failures = 0;
    window_rejections = 0;
    vmh_carved_test_unmapping = in_the_unmapping_window;
    sim_reset_counters();
    punch_around_survivors();
    vmh_carved_test_unmapping = NULL;
    print_message("  %u punches met the window; %u failures, %lu calls refused in it\n",
                  window_calls, window_failures, window_rejections);
    assert_true(window_calls > 0);
    assert_int_equal(window_failures, 0);
    assert_int_equal(window_rejections, 0);
    survivors_intact();
    assert_int_equal(sim_hazards(), 0);
}

/* An allocation that fits only in a hole maps it again (one chunk: create, map, access; no new
 * extent) and is usable; the survivors beside it keep their contents. Smaller ones are served
 * from the free space still mapped first. */
static void a_block_in_a_hole_is_mapped_again(void **state)
{
    (void)state;
    punch_around_survivors();
    size_t used = sim_device_used(0), extents, holes, extents_after, holes_after;
    shards_count(&extents, &holes);
    assert_true(holes >= 100 * MiB);
    sim_reset_counters();
    CUdeviceptr p, small;
    assert_int_equal(vmm_tag_push("holes"), VMM_OK);
    assert_int_equal(vmh_heap_alloc(100 * MiB, &small), CUDA_SUCCESS);
    assert_int_equal(sim_call_count(), 0);
    /* The largest hole is a chunk of a 1 GiB extent (344 MiB), the largest free space mapped
     * beside a survivor 338 MiB. */
    const size_t size = 340 * MiB;
    assert_int_equal(vmh_heap_alloc(size, &p), CUDA_SUCCESS);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    print_message("  340 MiB into a hole: %lu creates, %lu maps, %lu reserves, +%zu MiB\n",
                  sim_calls("cuMemCreate"), sim_calls("cuMemMap"), sim_calls("cuMemAddressReserve"),
                  (sim_device_used(0) - used) / MiB);
    assert_int_equal(sim_calls("cuMemAddressReserve"), 0);
    assert_int_equal(sim_calls("cuMemCreate"), 1);
    assert_int_equal(sim_calls("cuMemMap"), 1);
    /* no new extent: a hole's bytes are mapped again, no more */
    shards_count(&extents_after, &holes_after);
    assert_int_equal(extents_after, extents);
    assert_true(holes_after < holes);
    assert_int_equal(sim_device_used(0) - used, holes - holes_after);
    mark(p, size, 7);
    mark(small, 100 * MiB, 9);
    assert_true(marked(p, size, 7));
    assert_true(marked(small, 100 * MiB, 9));
    survivors_intact();
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
}

/* The driver out of memory for a hole goes on as a new extent does: nothing of the hole is left
 * mapped (it stays a hole), the allocation is served by the new-extent path (which relieves the
 * device and retries once before failing), and without memory at all it fails cleanly. */
static void out_of_memory_in_a_hole_goes_the_new_extent_way(void **state)
{
    (void)state;
    punch_around_survivors();
    size_t extents, holes, extents_after, holes_after;
    shards_count(&extents, &holes);
    CUdeviceptr p;
    sim_fail_function("cuMemCreate", 1, CUDA_ERROR_OUT_OF_MEMORY); /* the hole's chunk */
    assert_int_equal(vmm_tag_push("holes"), VMM_OK);
    const size_t used = sim_device_used(0);
    assert_int_equal(vmh_heap_alloc(340 * MiB, &p), CUDA_SUCCESS);
    shards_count(&extents_after, &holes_after);
    assert_int_equal(holes_after, holes);
    /* New memory: an extent of its own, or one that grows (joins) an extent's free end. */
    assert_true(extents_after == extents + 1 || extents_after == extents);
    assert_true(sim_device_used(0) > used && sim_device_used(0) - used <= 340 * MiB);
    mark(p, 340 * MiB, 3);
    assert_true(marked(p, 340 * MiB, 3));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    /* The new memory goes; free space mapped beside the survivors, neighbouring extents' joined
     * (carved_place.c's joins), holds less than 1 GiB (a survivor every 1 GiB). */
    vmh_heap_trim();
    sim_fail_function_repeat("cuMemCreate", 1, 0, CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_heap_alloc(1024 * MiB, &p), CUDA_ERROR_OUT_OF_MEMORY);
    sim_clear_faults();
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    survivors_intact();
}

/* A tag whose extents have holes pauses (releasing only its mapped chunks) and resumes (mapping
 * back only those: its holes stay holes), the survivor's contents restored from its backup.
 * One survivor is kept (the others' extents trimmed), so that the backup stays small. */
static void a_tag_with_holes_pauses_and_resumes(void **state)
{
    (void)state;
    punch_around_survivors();
    const int kept = 8 * keep_every; /* in one of the 1 GiB extents */
    for (int i = 0; i < N; i += keep_every) {
        if (i != kept) {
            assert_int_equal(vmh_heap_free(bufs[i], NULL, false), CUDA_SUCCESS);
            bufs[i] = 0;
        }
    }
    vmh_heap_trim(); /* what a pause gives back first: the used bytes are those paused */
    size_t used = sim_device_used(0), extents, holes, extents_after, holes_after;
    shards_count(&extents, &holes);
    print_message("  paused: %zu extent(s), %zu MiB mapped, %zu MiB in holes\n", extents,
                  used / MiB, holes / MiB);
    assert_int_equal(extents, 1);
    assert_true(holes > 0 && used < 512 * MiB);
    assert_int_equal(vmm_pause("holes", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(sim_device_used(0), 0);
    assert_int_equal(vmm_resume("holes"), VMM_OK);
    assert_int_equal(sim_device_used(0), used);
    shards_count(&extents_after, &holes_after);
    assert_int_equal(extents_after, extents);
    assert_int_equal(holes_after, holes);
    survivors_intact();
    /* Without a backup too, and a free while paused is bookkeeping only: the resume maps back
     * no more than was mapped. */
    assert_int_equal(vmm_pause("holes", 0), VMM_OK);
    assert_int_equal(vmh_heap_free(bufs[kept], NULL, false), CUDA_SUCCESS);
    bufs[kept] = 0;
    assert_int_equal(vmm_resume("holes"), VMM_OK);
    assert_true(sim_device_used(0) <= used);
}

/* Holes made and mapped again while other threads allocate and free in the same tag: each
 * thread's blocks keep their marks (a hole is never unmapped under a live block, a block is never
 * served in a hole still unmapped), and the ledger is clean at the end. */
#define CHURN_THREADS 3
#define CHURN_LIVE 16
#define CHURN_STEPS 300
static atomic_int churn_running;
static atomic_int churn_bad;

static void *churn(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    CUdeviceptr live[CHURN_LIVE] = {0};
    size_t sz[CHURN_LIVE] = {0};
    sim_set_current_device(0);
    if (vmm_tag_push("holes") != VMM_OK)
        atomic_fetch_add(&churn_bad, 1);
    for (unsigned step = 0; step < CHURN_STEPS; step++) {
        unsigned k = (seed * 2654435761u + step * 40503u) % CHURN_LIVE;
        if (live[k]) {
            if (!tu_check(live[k], MARK, seed + k) ||
                vmh_heap_free(live[k], NULL, false) != CUDA_SUCCESS)
                atomic_fetch_add(&churn_bad, 1);
            live[k] = 0;
        }
        sz[k] = (size_t)(1 + (seed * 7 + step * 13) % 320) * MiB; /* some fit only holes */
        if (vmh_heap_alloc(sz[k], &live[k]) != CUDA_SUCCESS ||
            !tu_fill_try(live[k], MARK, seed + k))
            atomic_fetch_add(&churn_bad, 1);
    }
    for (int k = 0; k < CHURN_LIVE; k++)
        if (live[k] && (!tu_check(live[k], MARK, seed + (unsigned)k) ||
                        vmh_heap_free(live[k], NULL, false) != CUDA_SUCCESS))
            atomic_fetch_add(&churn_bad, 1);
    vmm_tag_pop();
    atomic_fetch_sub(&churn_running, 1);
    return NULL;
}

static void holes_while_others_allocate(void **state)
{
    (void)state;
    punch_around_survivors();
    atomic_store(&churn_running, CHURN_THREADS);
    atomic_store(&churn_bad, 0);
    pthread_t t[CHURN_THREADS];
    for (uintptr_t i = 0; i < CHURN_THREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, churn, (void *)(i + 11)), 0);
    size_t extents, holes, most = 0;
    sim_reset_counters();
    do { /* once at least: the threads may be done before the first round */
        vmh_heap_tidy_now(0, true); /* a new window each time: holes where the budget allows */
        shards_count(&extents, &holes);
        most = holes > most ? holes : most;
    } while (atomic_load(&churn_running));
    for (int i = 0; i < CHURN_THREADS; i++)
        assert_int_equal(pthread_join(t[i], NULL), 0);
    assert_int_equal(atomic_load(&churn_bad), 0);
    print_message("  most in holes %zu MiB, %lu chunks made and %lu released meanwhile\n",
                  most / MiB, sim_calls("cuMemCreate"), sim_calls("cuMemRelease"));
    assert_true(most > 0);
    survivors_intact();
}

/* tt_setup_carved's, on a 24 GiB device, with VMMHOOK_CHUNK_MAX=chunk_max (0: none). */
static void on_a_24_gib_device(size_t chunk_max)
{
    sim_config_t cfg = {.memory = 24 * GiB};
    tu_reset(&cfg);
    assert_true(vmh_lifetime_ready());
    tu_opt.pack_below = (size_t)1 << 40;
    tu_opt.pin_limit = 0;
    tu_opt.chunk_max = chunk_max;
    tu_configure();
    vmh_tags_reset();
    vmh_pause_reset();
}

/* A request of `want` bytes is served and usable, the survivors keep their contents, and no
 * queued work touched memory that went. */
static void served_and_survivors_intact(size_t want)
{
    CUdeviceptr big = 0;
    assert_int_equal(vmh_heap_alloc(want, &big), CUDA_SUCCESS);
    tu_fill(big + want - MARK, MARK, 7);
    assert_true(tu_check(big + want - MARK, MARK, 7));
    survivors_intact();
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(sim_hazards(), 0);
}

/* Out of memory while idle memory is mapped (issue 38's scenario 3, at the chunk size this heap
 * has): 10240 x 2 MiB on a 24 GiB device, freed but 1 in KEEP_EVERY, before any tidy. The
 * extents' whole free chunks count as free in cuMemGetInfo, and a request larger than the
 * driver's free memory and the empty extents together gets them back from the relieve before
 * out of memory is answered (natively it succeeds); the survivors keep their contents. (1 in
 * 128 or 64 needs chunks of at most 128 or 64 MiB, VMMHOOK_CHUNK_MAX: the default chunks are up
 * to 341 MiB, so one live block pins one; see the next case.) */
static void out_of_memory_gives_back_free_chunks_inside_extents(void **state)
{
    (void)state;
    on_a_24_gib_device(0);
    survivors_among_freed();
    size_t mapped = sim_device_used(0);
    size_t reclaimable = vmh_heap_reclaimable_bytes(0), idle = vmh_heap_idle_bytes(0);
    print_message("  %zu MiB mapped for %d MiB live; %zu MiB counted free by cuMemGetInfo, %zu "
                  "of them in empty extents\n",
                  mapped / MiB, 2 * (N / keep_every), reclaimable / MiB, idle / MiB);
    /* More than the driver's free memory and the empty extents together. */
    size_t want = 24 * GiB - mapped + idle + 2 * GiB;
    assert_true(reclaimable >= idle + 2 * GiB);
    served_and_survivors_intact(want);
}

/* Scenario 3 at 1 in 64 (one live 2 MiB buffer in every 128 MiB): no chunk of the default
 * size is wholly free, so this needs VMMHOOK_CHUNK_MAX=64M (or less): then every other chunk
 * is, and an 8 GiB request beyond the driver's free memory is served from them (natively it
 * succeeds). */
static void one_buffer_in_64_pins_nothing_with_64m_chunks(void **state)
{
    (void)state;
    on_a_24_gib_device(64 * MiB);
    keep_every = 64;
    survivors_among_freed();
    size_t mapped = sim_device_used(0);
    size_t reclaimable = vmh_heap_reclaimable_bytes(0);
    print_message("  1 in 64 kept, chunks of at most 64 MiB: %zu MiB mapped for %d MiB live; %zu "
                  "MiB counted free by cuMemGetInfo\n",
                  mapped / MiB, 2 * (N / keep_every), reclaimable / MiB);
    assert_true(reclaimable >= 9 * GiB);
    size_t want = 24 * GiB - mapped + 8 * GiB;
    served_and_survivors_intact(want);
    keep_every = KEEP_EVERY;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(idle_chunks_inside_extents_are_unmapped, setup, teardown),
        cmocka_unit_test_setup_teardown(punch_unmaps_with_the_lock_let_go, setup, teardown),
        cmocka_unit_test_setup_teardown(a_block_in_a_hole_is_mapped_again, setup, teardown),
        cmocka_unit_test_setup_teardown(out_of_memory_in_a_hole_goes_the_new_extent_way, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(a_tag_with_holes_pauses_and_resumes, setup, teardown),
        cmocka_unit_test_setup_teardown(holes_while_others_allocate, setup, teardown),
        cmocka_unit_test_setup_teardown(out_of_memory_gives_back_free_chunks_inside_extents,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(one_buffer_in_64_pins_nothing_with_64m_chunks, setup,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
