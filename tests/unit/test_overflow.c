/* Overflow to host memory (VMMHOOK_OVERFLOW=host, src/overflow/overflow.c): what the device cannot
 * serve is served from host-located memory at device addresses, and moves back at the same address
 * when the program asks (vmm_prefetch) or at a resume. Against the simulated driver, whose
 * host-located allocations have their own limit (sim_config.host_memory). */
#include "testutil.h"

#include "log.h"
#include "log_capture.h"
#include "overflow.h"
#include "pause.h"
#include "registry.h"
#include "staging.h"
#include "tags.h"
#include "vmmhook.h"

#include <pthread.h>

/* ---- helpers ------------------------------------------------------------------------------ */

/* A device of 32 MiB, host-located memory 64 MiB, overflow on with no cap of its own. */
static void reset(bool on, size_t host_memory)
{
    sim_config_t cfg = {.memory = 32 * MiB, .host_memory = host_memory};
    tu_reset(&cfg);
    tu_opt.pin_limit = 0;
    vmh_pause_configure(tu_opt.pin_limit);
    vmh_tags_reset();
    vmh_pause_reset();
    vmh_overflow_reset();
    vmh_overflow_configure(on, (size_t)64 << 40);
    vmh_overflow_set_reserve(0); /* a full device means full here; the placement tests set one */
    vmh_staging_set_host_mem(NULL);
    capture_clear();
    vmh_log_sink = capture_sink;
}

static int setup(void **state)
{
    (void)state;
    reset(true, 64 * MiB);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    vmh_log_sink = NULL;
    vmh_overflow_configure(false, 0);
    return tu_teardown(state);
}

/* Fills the device: 16 buffers of one chunk each. */
static void fill_device(CUdeviceptr p[16])
{
    for (int i = 0; i < 16; i++)
        assert_int_equal(vmh_heap_alloc(GRAN, &p[i]), CUDA_SUCCESS);
}

static void free_all(CUdeviceptr *p, int n)
{
    for (int i = 0; i < n; i++)
        if (p[i])
            assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
}

/* p is served, and the host holds spilled memory. */
static bool served_while_spilled(CUdeviceptr p)
{
    return vmh_registry_get(p) && sim_host_used() > 0;
}

/* ---- the simulated driver ------------------------------------------------------------------ */

/* Host-located memory is charged to the host's own limit, not to a device. */
static void sim_host_memory_has_its_own_limit(void **state)
{
    (void)state;
    CUmemAllocationProp p = tu_prop(0);
    p.location.type = CU_MEM_LOCATION_TYPE_HOST;
    p.location.id = 0;
    CUmemGenericAllocationHandle h[2];
    assert_int_equal(sim_table()->cuMemCreate(&h[0], 64 * MiB, &p, 0), CUDA_SUCCESS);
    assert_int_equal(sim_host_used(), 64 * MiB);
    assert_int_equal(sim_device_used(0), 0);
    assert_int_equal(sim_table()->cuMemCreate(&h[1], GRAN, &p, 0), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(sim_table()->cuMemRelease(h[0]), CUDA_SUCCESS);
    assert_int_equal(sim_host_used(), 0);
}

/* ---- spilling ------------------------------------------------------------------------------ */

/* Off (the default): a full device answers out of memory, as natively; nothing is asked of the
 * host and the failing allocation makes no more driver calls than before. */
static void off_changes_nothing(void **state)
{
    (void)state;
    reset(false, 64 * MiB);
    CUdeviceptr p[16], q = 0;
    fill_device(p);
    sim_reset_counters();
    assert_int_equal(vmh_heap_alloc(GRAN, &q), CUDA_ERROR_OUT_OF_MEMORY);
    unsigned long calls_off = sim_call_count();
    assert_int_equal(sim_host_used(), 0);
    assert_int_equal(vmh_counter_get(VMH_STAT_spills), 0);
    assert_int_equal(captured("host memory"), 0);
    free_all(p, 16);

    /* On, with the host full too: the same calls plus the spill's own. */
    reset(true, GRAN); /* host memory of one chunk: too little for the 4 MiB request */
    fill_device(p);
    sim_reset_counters();
    assert_int_equal(vmh_heap_alloc(4 * MiB, &q), CUDA_ERROR_OUT_OF_MEMORY);
    assert_true(sim_call_count() > calls_off);
    free_all(p, 16);
}

/* A spilled buffer is an ordinary served pointer: written, read, found, freed; its host memory
 * is given back after the free, and the first spill says so once. */
static void spills_when_the_device_is_full(void **state)
{
    (void)state;
    CUdeviceptr p[16], a = 0, b = 0;
    fill_device(p);
    assert_int_equal(vmh_heap_alloc(3 * MiB, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(100, &b), CUDA_SUCCESS); /* small ones too */
    assert_int_equal(sim_device_used(0), 32 * MiB);
    assert_int_equal(sim_host_used(), 4 * MiB + GRAN);
    assert_true(served_while_spilled(a));
    assert_int_equal(vmh_counter_get(VMH_STAT_spills), 2);
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_spilled), (int64_t)(4 * MiB + GRAN));
    assert_int_equal(vmh_heap_spilled_bytes(0), 4 * MiB + GRAN);
    assert_int_equal(captured("served from host memory"), 1);
    tu_fill(a, 3 * MiB, 7);
    assert_true(tu_check(a, 3 * MiB, 7));
    vmh_buffer_info_t info;
    assert_true(vmh_heap_find(a + 5, &info));
    assert_int_equal(info.base, a);
    assert_int_equal(info.size, 3 * MiB);
    assert_int_equal(sim_hazards(), 0);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    assert_int_equal(sim_host_used(), 0); /* never cached: the cache serves device memory */
    assert_int_equal(vmh_heap_spilled_bytes(0), 0);
    free_all(p, 16);
}

/* VMMHOOK_OVERFLOW_LIMIT bounds the host bytes; past it the allocation fails, said once. */
static void limit_bounds_the_host_bytes(void **state)
{
    (void)state;
    vmh_overflow_configure(true, 4 * MiB);
    CUdeviceptr p[16], a = 0, b = 0, c = 0;
    fill_device(p);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(GRAN, &b), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_heap_alloc(GRAN, &c), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(captured("does not spill"), 1);
    assert_int_equal(vmh_counter_get(VMH_STAT_ooms), 2);
    assert_int_equal(sim_host_used(), 4 * MiB);
    free_all(&a, 1);
    free_all(p, 16);
}

/* The host's own memory bounds it too: at most half of it, and an eighth stays available. */
static bool small_host(vmh_host_mem_t *m)
{
    m->total = 8 * MiB;
    m->available = 6 * MiB;
    return true;
}

static void host_share_bounds_the_host_bytes(void **state)
{
    (void)state;
    vmh_staging_set_host_mem(small_host);
    CUdeviceptr p[16], a = 0, b = 0;
    fill_device(p);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &a), CUDA_SUCCESS); /* half of 8 MiB */
    assert_int_equal(vmh_heap_alloc(GRAN, &b), CUDA_ERROR_OUT_OF_MEMORY);
    free_all(&a, 1);
    free_all(p, 16);
    vmh_staging_set_host_mem(NULL);
}

/* A paused tag takes no memory, host memory included. */
static void paused_tag_does_not_spill(void **state)
{
    (void)state;
    CUdeviceptr p[16], a = 0;
    fill_device(p);
    assert_int_equal(vmm_tag_push("kv"), VMM_OK);
    assert_int_equal(vmh_heap_alloc(GRAN, &a), CUDA_SUCCESS); /* a spilled one in "kv" */
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    CUresult drc;
    assert_int_equal(vmh_pause_tags("kv", 0, &drc), VMM_OK);
    assert_int_equal(sim_host_used(), 0); /* the pause gave the host memory back */
    assert_int_equal(vmm_tag_push("kv"), VMM_OK);
    CUdeviceptr b = 0;
    assert_int_equal(vmh_heap_alloc(GRAN, &b), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    assert_int_equal(sim_host_used(), 0);
    free_all(&a, 1);
    free_all(p, 16);
}

/* vmm_realloc grows a spilled buffer with device memory when there is room, else host memory;
 * the contents stay. */
static void spilled_buffer_grows(void **state)
{
    (void)state;
    CUdeviceptr p[16], a = 0;
    fill_device(p);
    assert_int_equal(vmh_heap_alloc(GRAN, &a), CUDA_SUCCESS);
    tu_fill(a, GRAN, 3);
    assert_int_equal(vmh_heap_realloc(&a, 3 * GRAN, NULL, false), CUDA_SUCCESS);
    assert_true(tu_check(a, GRAN, 3));
    assert_int_equal(sim_host_used(), 3 * GRAN);
    free_all(&a, 1);
    free_all(p, 16);
}

/* ---- which allocations spill ---------------------------------------------------------------- */

/* Issue 29's probe: a 1 GiB device filled past its size with 64 MiB buffers, then 200
 * short-lived 2 MiB temporaries (allocated, written, read back, freed). Returns how many of the
 * temporaries were served from host memory; every one must read back right. */
static unsigned probe_temporaries(size_t reserve, size_t pack_below, unsigned *big_spilled)
{
    sim_config_t cfg = {.memory = GiB, .host_memory = 2 * GiB};
    tu_reset(&cfg);
    tu_opt.pack_below = pack_below;
    tu_opt.overflow = VMH_OVERFLOW_HOST;
    tu_opt.overflow_reserve = reserve;
    tu_configure();
    vmh_overflow_reset();
    enum { BIG = 20, TEMPS = 200 };
    CUdeviceptr big[BIG];
    for (int i = 0; i < BIG; i++) {
        assert_int_equal(vmh_heap_alloc(64 * MiB, &big[i]), CUDA_SUCCESS);
        tu_fill(big[i], 4096, (unsigned char)i);
    }
    assert_true(sim_host_used() > 0); /* past the device's size */
    *big_spilled = (unsigned)vmh_counter_get(VMH_STAT_spills);
    for (int t = 0; t < TEMPS; t++) {
        CUdeviceptr tmp = 0;
        assert_int_equal(vmh_heap_alloc(2 * MiB, &tmp), CUDA_SUCCESS);
        tu_fill(tmp, 2 * MiB, (unsigned char)(t + 1));
        assert_true(tu_check(tmp, 2 * MiB, (unsigned char)(t + 1)));
        assert_int_equal(vmh_heap_free(tmp, NULL, false), CUDA_SUCCESS);
    }
    unsigned temps = (unsigned)vmh_counter_get(VMH_STAT_spills) - *big_spilled;
    assert_int_equal(vmh_counter_get(VMH_STAT_spills_small), temps);
    for (int i = 0; i < BIG; i++)
        assert_true(tu_check(big[i], 4096, (unsigned char)i));
    free_all(big, BIG);
    assert_int_equal(sim_hazards(), 0);
    vmh_heap_trim();
    tu_opt.overflow = VMH_OVERFLOW_OFF;
    tu_opt.overflow_reserve = 0;
    return temps;
}

/* With the default reserve (VMMHOOK_OVERFLOW_RESERVE: a sixteenth of this device, 64 MiB) the
 * big buffers spill first and no temporary does, packed (the library's default) or not; with
 * no reserve every temporary spills, as before the policy (docs/OVERFLOW.md's measurement). */
static void temporaries_stay_on_the_device(void **state)
{
    (void)state;
    const size_t every = (size_t)1 << 40; /* VMMHOOK_PACK_BELOW's default: everything packed */
    unsigned big_spilled = 0;
    for (int packed = 0; packed < 2; packed++) {
        size_t pack_below = packed ? every : MiB;
        assert_int_equal(probe_temporaries((size_t)4 << 30, pack_below, &big_spilled), 0);
        assert_int_equal(big_spilled, 5); /* 15 fit and 64 MiB stay free */
        unsigned without = probe_temporaries(0, pack_below, &big_spilled);
        printf("probe, %s: 0 of 200 temporaries spilled with the reserve, %u without\n",
               packed ? "packed" : "own chunks", without);
        assert_int_equal(without, 200);
        assert_int_equal(big_spilled, 4);
    }
}

/* Small requests may take the reserve; only when the device is full do they spill, counted as
 * small; with overflow off the reserve does nothing (the device fills as natively). */
static void small_ones_use_the_reserve(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = GiB, .host_memory = 2 * GiB};
    tu_reset(&cfg);
    tu_opt.overflow_reserve = (size_t)4 << 30;
    tu_configure();
    CUdeviceptr p[17] = {0};
    for (int i = 0; i < 16; i++) /* overflow off: the last 64 MiB too */
        assert_int_equal(vmh_heap_alloc(64 * MiB, &p[i]), CUDA_SUCCESS);
    assert_int_equal(sim_device_used(0), GiB);
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p[16]), CUDA_ERROR_OUT_OF_MEMORY);
    free_all(p, 16);
    vmh_heap_trim();

    tu_opt.overflow = VMH_OVERFLOW_HOST;
    tu_configure();
    for (int i = 0; i < 15; i++)
        assert_int_equal(vmh_heap_alloc(64 * MiB, &p[i]), CUDA_SUCCESS);
    CUdeviceptr small[33] = {0};
    for (int i = 0; i < 33; i++)
        assert_int_equal(vmh_heap_alloc(2 * MiB, &small[i]), CUDA_SUCCESS);
    assert_int_equal(sim_device_used(0), GiB); /* 32 of them in the reserve, */
    assert_int_equal(vmh_counter_get(VMH_STAT_spills), 1); /* the 33rd on the host */
    assert_int_equal(vmh_counter_get(VMH_STAT_spills_small), 1);
    /* Per device in the JSON too. */
    vmh_stats_set_device_report(vmh_heap_stats_devices);
    static char js[1 << 16];
    assert_true(vmm_stats_json(js, sizeof js) > 0);
    assert_non_null(strstr(js, "\"devices\": {\"0\": {\"bytes_spilled\": 2097152, "
                               "\"spills\": 1, \"spills_small\": 1}}"));
    vmh_stats_set_device_report(NULL);
    free_all(small, 33);
    free_all(p, 15);
    vmh_heap_trim();
    tu_opt.overflow = VMH_OVERFLOW_OFF;
    tu_opt.overflow_reserve = 0;
}

/* ---- back to the device -------------------------------------------------------------------- */

/* vmm_prefetch moves a spilled buffer back at the same address once there is room; without room
 * it answers out of memory and the buffer stays usable where it is. */
static void prefetch_moves_back_at_the_same_address(void **state)
{
    (void)state;
    CUdeviceptr p[16], a = 0;
    fill_device(p);
    assert_int_equal(vmh_heap_alloc(2 * GRAN, &a), CUDA_SUCCESS);
    tu_fill(a, 2 * GRAN, 9);
    size_t moved = 0;
    assert_int_equal(vmh_heap_prefetch(a, &moved), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(moved, 0);
    assert_true(tu_check(a, 2 * GRAN, 9));
    assert_int_equal(sim_host_used(), 2 * GRAN);

    assert_int_equal(vmh_heap_free(p[0], NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p[1], NULL, false), CUDA_SUCCESS);
    p[0] = p[1] = 0;
    sim_reset_counters();
    assert_int_equal(vmh_heap_prefetch(a + 100, &moved), CUDA_SUCCESS);
    assert_true(sim_sync_count(NULL) >= 1); /* waited for the device's work first */
    assert_int_equal(moved, 2 * GRAN);
    /* The host chunk goes from the reclaim thread (its release unpins: slow), not in the call;
     * bytes_spilled counts mapped host memory: 0 at once. */
    assert_int_equal(sim_host_used(), 2 * GRAN);
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_spilled), 0);
    vmh_heap_trim();
    assert_int_equal(sim_host_used(), 0);
    assert_int_equal(sim_device_used(0), 32 * MiB);
    assert_true(tu_check(a, 2 * GRAN, 9));
    assert_int_equal(sim_hazards(), 0);
    vmh_buffer_info_t info;
    assert_true(vmh_heap_find(a, &info));
    assert_int_equal(info.base, a);
    /* On the device now: a second prefetch moves nothing; the free caches it as any other. */
    assert_int_equal(vmh_heap_prefetch(a, &moved), CUDA_SUCCESS);
    assert_int_equal(moved, 0);
    free_all(&a, 1);
    free_all(p, 16);
}

/* The public entry points: codes for the cases a program meets. */
static void prefetch_api_codes(void **state)
{
    (void)state;
    assert_int_equal(vmm_prefetch(NULL), VMM_ERR_INVALID);
    assert_int_equal(vmm_prefetch_tag("no such tag"), VMM_ERR_UNKNOWN_TAG);
}

/* vmm_prefetch_tag moves every spilled buffer of the tag that fits, and only that tag's. */
static void prefetch_tag_moves_the_tags_buffers(void **state)
{
    (void)state;
    CUdeviceptr p[16], kv[2] = {0, 0}, other = 0;
    fill_device(p);
    assert_int_equal(vmm_tag_push("kv"), VMM_OK);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(vmh_heap_alloc(GRAN, &kv[i]), CUDA_SUCCESS);
        tu_fill(kv[i], GRAN, 20 + i);
    }
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    assert_int_equal(vmh_heap_alloc(GRAN, &other), CUDA_SUCCESS);
    assert_int_equal(sim_host_used(), 3 * GRAN);
    free_all(p, 4);
    for (int i = 0; i < 4; i++)
        p[i] = 0;
    assert_int_equal(vmm_tag_push("kv"), VMM_OK);
    size_t moved = 0;
    sim_reset_counters();
    assert_int_equal(vmh_heap_prefetch_tag(vmh_tag_current(), &moved), CUDA_SUCCESS);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    assert_int_equal(moved, 2 * GRAN);
    assert_int_equal(sim_calls("cuStreamSynchronize"), 1); /* one wait for both */
    vmh_heap_trim(); /* the host chunks go from the reclaim thread */
    assert_int_equal(sim_host_used(), GRAN); /* the other tag's stays */
    for (int i = 0; i < 2; i++)
        assert_true(tu_check(kv[i], GRAN, 20 + i));
    free_all(kv, 2);
    free_all(&other, 1);
    free_all(p, 16);
}

/* A tag's buffers move in one pass: when the device has room for only some, those move, the
 * first failure is answered, and the rest stay usable where they are. */
static void prefetch_tag_moves_what_fits(void **state)
{
    (void)state;
    CUdeviceptr p[16], kv[2] = {0, 0};
    fill_device(p);
    assert_int_equal(vmm_tag_push("kv"), VMM_OK);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(vmh_heap_alloc(GRAN, &kv[i]), CUDA_SUCCESS);
        tu_fill(kv[i], GRAN, 30 + i);
    }
    free_all(p, 1); /* room for one */
    p[0] = 0;
    size_t moved = 0;
    assert_int_equal(vmh_heap_prefetch_tag(vmh_tag_current(), &moved), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    assert_int_equal(moved, GRAN);
    vmh_heap_trim();
    assert_int_equal(sim_host_used(), GRAN);
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_spilled), (int64_t)GRAN);
    for (int i = 0; i < 2; i++)
        assert_true(tu_check(kv[i], GRAN, 30 + i));
    assert_int_equal(sim_hazards(), 0);
    free_all(kv, 2);
    free_all(p, 16);
}

/* A shared (exported) spilled buffer cannot move: its chunks have another holder. */
static void prefetch_refuses_a_shared_buffer(void **state)
{
    (void)state;
    CUdeviceptr p[16], a = 0;
    fill_device(p);
    assert_int_equal(vmh_heap_alloc(GRAN, &a), CUDA_SUCCESS);
    vmh_export_t ex;
    assert_int_equal(vmh_heap_export(a, &ex), CUDA_SUCCESS);
    free_all(p, 2);
    p[0] = p[1] = 0;
    size_t moved = 0;
    assert_int_equal(vmh_heap_prefetch(a, &moved), CUDA_ERROR_ALREADY_MAPPED);
    assert_int_equal(sim_host_used(), GRAN);
    vmh_heap_export_release(&ex);
    assert_int_equal(vmh_heap_prefetch(a, &moved), CUDA_SUCCESS);
    assert_int_equal(moved, GRAN);
    free_all(&a, 1);
    free_all(p, 16);
}

/* A resume that finds no room on the device maps the rest in host memory, contents restored;
 * with overflow off it fails and the tag stays paused, as before. */
static void resume_spills_what_does_not_fit(void **state)
{
    (void)state;
    CUdeviceptr w[4], p[14] = {0};
    assert_int_equal(vmm_tag_push("w"), VMM_OK);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(vmh_heap_alloc(2 * GRAN, &w[i]), CUDA_SUCCESS);
        tu_fill(w[i], 2 * GRAN, 40 + i);
    }
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    CUresult drc;
    assert_int_equal(vmh_pause_tags("w", VMM_PAUSE_BACKUP, &drc), VMM_OK);
    for (int i = 0; i < 14; i++) /* 28 of 32 MiB: room for one of the four on the device */
        assert_int_equal(vmh_heap_alloc(GRAN, &p[i]), CUDA_SUCCESS);
    assert_int_equal(vmh_resume_tags("w", 0, &drc), VMM_OK);
    assert_int_equal(sim_host_used(), 3 * 2 * GRAN);
    for (int i = 0; i < 4; i++)
        assert_true(tu_check(w[i], 2 * GRAN, 40 + i));
    assert_int_equal(sim_hazards(), 0);

    /* Off: the same resume is refused and the tag stays paused. */
    assert_int_equal(vmh_pause_tags("w", VMM_PAUSE_BACKUP, &drc), VMM_OK);
    vmh_overflow_configure(false, 0);
    assert_int_equal(vmh_resume_tags("w", 0, &drc), VMM_ERR_NO_MEMORY);
    vmh_overflow_configure(true, (size_t)64 << 40);
    assert_int_equal(vmh_resume_tags("w", 0, &drc), VMM_OK);
    for (int i = 0; i < 4; i++)
        assert_true(tu_check(w[i], 2 * GRAN, 40 + i));
    free_all(w, 4);
    free_all(p, 14);
}

/* ---- failures ------------------------------------------------------------------------------ */

/* Every driver call of a spill and of a move back fails in turn: the operation reports it,
 * nothing leaks, nothing is half-mapped, and a buffer that was not moved keeps its bytes. */
static CUresult run_spill(CUdeviceptr *a)
{
    return vmh_heap_alloc(2 * GRAN, a);
}

/* One fixture: the device full; for the move back (op 1) a spilled buffer with a pattern and
 * room made for it. */
static void sweep_fixture(int op, CUdeviceptr p[16], CUdeviceptr *a)
{
    reset(true, 64 * MiB);
    *a = 0;
    fill_device(p);
    if (op == 1) {
        assert_int_equal(run_spill(a), CUDA_SUCCESS);
        tu_fill(*a, 2 * GRAN, 77);
        free_all(p, 2);
        p[0] = p[1] = 0;
        vmh_heap_trim(); /* the room is made before: the sweep fails the move's own calls */
    }
    sim_reset_counters();
}

static void sweep_release(int op, CUdeviceptr p[16], CUdeviceptr a)
{
    if (op == 1)
        assert_true(tu_check(a, 2 * GRAN, 77));
    assert_int_equal(sim_hazards(), 0);
    if (a)
        free_all(&a, 1);
    free_all(p, 16);
    vmh_heap_trim();
    tu_assert_ledger_empty();
}

static void failure_sweep(void **state)
{
    (void)state;
    unsigned points = 0;
    for (int op = 0; op < 2; op++) {
        CUdeviceptr p[16], a;
        size_t moved = 0;
        const char *names[64];
        sweep_fixture(op, p, &a);
        sim_trace_begin();
        assert_int_equal(op == 0 ? run_spill(&a) : vmh_heap_prefetch(a, &moved), CUDA_SUCCESS);
        unsigned long n = sim_call_count();
        assert_true(sim_trace_get(names, 64) == n && n < 64);
        sim_trace_end();
        sweep_release(op, p, a);
        for (unsigned long i = 1; i <= n; i++) {
            if (tu_is_undo(names[i - 1]) || !strcmp(names[i - 1], "cuStreamDestroy"))
                continue; /* undoing: a failure there leaks at most, the move is done */
            sweep_fixture(op, p, &a);
            sim_fail_call(i, CUDA_ERROR_UNKNOWN);
            CUresult rc = op == 0 ? run_spill(&a) : vmh_heap_prefetch(a, &moved);
            sim_clear_faults();
            if (rc == CUDA_SUCCESS)
                fprintf(stderr, "op %d: %s failed and the operation succeeded\n", op,
                        names[i - 1]);
            assert_int_not_equal(rc, CUDA_SUCCESS);
            if (op == 0)
                assert_int_equal(a, 0);
            sweep_release(op, p, a);
            points++;
        }
    }
    printf("overflow sweep: %u injection points, no leak, contents kept\n", points);
    assert_true(points >= 12);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(sim_host_memory_has_its_own_limit, setup, teardown),
        cmocka_unit_test_setup_teardown(off_changes_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(spills_when_the_device_is_full, setup, teardown),
        cmocka_unit_test_setup_teardown(limit_bounds_the_host_bytes, setup, teardown),
        cmocka_unit_test_setup_teardown(host_share_bounds_the_host_bytes, setup, teardown),
        cmocka_unit_test_setup_teardown(paused_tag_does_not_spill, setup, teardown),
        cmocka_unit_test_setup_teardown(spilled_buffer_grows, setup, teardown),
        cmocka_unit_test_setup_teardown(temporaries_stay_on_the_device, setup, teardown),
        cmocka_unit_test_setup_teardown(small_ones_use_the_reserve, setup, teardown),
        cmocka_unit_test_setup_teardown(prefetch_moves_back_at_the_same_address, setup, teardown),
        cmocka_unit_test_setup_teardown(prefetch_api_codes, setup, teardown),
        cmocka_unit_test_setup_teardown(prefetch_tag_moves_the_tags_buffers, setup, teardown),
        cmocka_unit_test_setup_teardown(prefetch_tag_moves_what_fits, setup, teardown),
        cmocka_unit_test_setup_teardown(prefetch_refuses_a_shared_buffer, setup, teardown),
        cmocka_unit_test_setup_teardown(resume_spills_what_does_not_fit, setup, teardown),
        cmocka_unit_test_setup_teardown(failure_sweep, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
