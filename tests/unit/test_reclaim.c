/* Unit tests of the reclaim layer (reclaim.c) through the heap, on the simulated driver's
 * contexts, work in flight and captures: freed memory is reused only after the work of every
 * context of the device has landed, the reclaim thread waits so that application threads do
 * not, nothing synchronizes while a capture forbids it, the park limit and out of memory make
 * an application thread wait, the thread stops at exit, and failures of the new paths leave
 * nothing behind (issue 14). */
#ifndef VMH_TESTING
#define VMH_TESTING 1
#endif
#include "testutil.h"

#include "contexts.h"
#include "reclaim.h"

#include <cudaTypedefs.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LATE 0xAB /* what a late "kernel" writes */

static struct {
    PFN_cuCtxCreate_v12050 ctx_create;
    PFN_cuCtxDestroy_v4000 ctx_destroy;
    PFN_cuCtxSetCurrent_v4000 ctx_set_current;
    PFN_cuStreamCreate_v2000 stream_create;
    PFN_cuStreamDestroy_v4000 stream_destroy;
    PFN_cuStreamBeginCapture_v10010 begin_capture;
    PFN_cuStreamEndCapture_v10000 end_capture;
    PFN_cuGraphDestroy_v10000 graph_destroy;
} F;

static void *proc(const char *name)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    assert_int_equal(sim_get_proc_address(name, &fn, 13000, 0, &st), CUDA_SUCCESS);
    assert_non_null(fn);
    return fn;
}

/* A fresh driver (cfg may be NULL), the reclaim thread on or off, a park limit. */
static void reset(const sim_config_t *cfg, bool background, size_t park_limit)
{
    tu_reset(cfg);
    vmh_reclaim_background(background);
    tu_opt.park_limit = park_limit;
    tu_configure();
#define GET(field, name) F.field = (__typeof__(F.field))proc(name)
    GET(ctx_create, "cuCtxCreate");
    GET(ctx_destroy, "cuCtxDestroy");
    GET(ctx_set_current, "cuCtxSetCurrent");
    GET(stream_create, "cuStreamCreate");
    GET(stream_destroy, "cuStreamDestroy");
    GET(begin_capture, "cuStreamBeginCapture");
    GET(end_capture, "cuStreamEndCapture");
    GET(graph_destroy, "cuGraphDestroy");
#undef GET
}

static int teardown(void **state)
{
    (void)state;
    vmh_reclaim_stop();
    vmh_reclaim_background(false);
    vmh_contexts_reset();
    vmh_heap_trim();
    tu_assert_ledger_empty();
    tu_assert_stats_consistent();
    assert_int_equal(sim_hazards(), 0);
    return 0;
}

/* A second context on device 0, reported as the interposer would; the primary context stays
 * current on the calling thread. */
static CUcontext second_context(void)
{
    CUcontext c = NULL;
    assert_int_equal(F.ctx_create(&c, NULL, 0, 0), CUDA_SUCCESS);
    vmh_ctx_seen(c, 0);
    assert_int_equal(F.ctx_set_current(sim_primary_context(0)), CUDA_SUCCESS);
    vmh_ctx_current_changed();
    return c;
}

/* Bytes of [p, p + n) that hold LATE. */
static size_t late_bytes(CUdeviceptr p, size_t n)
{
    unsigned char *h = malloc(n);
    assert_non_null(h);
    assert_int_equal(sim_read(h, p, n), CUDA_SUCCESS);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += h[i] == LATE;
    free(h);
    return k;
}

static void sleep_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* ---- every context ------------------------------------------------------------------------ */

/* Issue 14's program: a kernel of a second context still writes a buffer when the program frees
 * it from the first; the same size is allocated four times and zeroed; after the kernel has
 * run, none of them may hold its bytes. Waiting on the first context only lets it land in one
 * of them (the bug on a928081). Run with the allocating thread waiting (park limit 0) and with
 * the reclaim thread releasing. */
static void late_write_run(bool background)
{
    reset(NULL, background, background ? SIZE_MAX : 0);
    CUcontext other = second_context();
    const size_t n = 16 * MiB, small = 4096;
    CUdeviceptr p, s, q[4], t[4];
    assert_int_equal(vmh_heap_alloc(n, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(small, &s), CUDA_SUCCESS); /* packed */
    assert_int_equal(sim_launch_write(other, NULL, p, n, LATE), CUDA_SUCCESS);
    assert_int_equal(sim_launch_write(other, NULL, s, small, LATE), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(s, NULL, false), CUDA_SUCCESS);
    if (background) {
        assert_true(vmh_reclaim_settle(5000));
        assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 0);
        assert_true(vmh_counter_get(VMH_STAT_syncs_background) >= 1);
        /* The thread put itself in relaxed capture interaction mode (reclaim.c). */
        assert_int_equal(sim_calls("cuThreadExchangeStreamCaptureMode"), 1);
    }
    for (int i = 0; i < 4; i++) {
        assert_int_equal(vmh_heap_alloc(n, &q[i]), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_alloc(small, &t[i]), CUDA_SUCCESS);
        assert_int_equal(sim_memset(q[i], 0, n), CUDA_SUCCESS);
        assert_int_equal(sim_memset(t[i], 0, small), CUDA_SUCCESS);
    }
    assert_int_equal(sim_pending_ops_ctx(other), 0); /* the wait covered the other context */
    assert_true(q[0] == p || q[1] == p || q[2] == p || q[3] == p); /* reused: the case tested */
    sim_flush();
    for (int i = 0; i < 4; i++) {
        assert_int_equal(late_bytes(q[i], n), 0);
        assert_int_equal(late_bytes(t[i], small), 0);
        assert_int_equal(vmh_heap_free(q[i], NULL, false), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_free(t[i], NULL, false), CUDA_SUCCESS);
    }
    assert_int_equal(sim_hazards(), 0);
    vmh_reclaim_stop();
    vmh_ctx_forget(other);
    assert_int_equal(F.ctx_destroy(other), CUDA_SUCCESS);
}

static void late_write_from_another_context_never_lands_in_reused_memory(void **state)
{
    (void)state;
    late_write_run(false);
}

static void late_write_with_the_reclaim_thread(void **state)
{
    (void)state;
    late_write_run(true);
}

/* A context the library waited on is destroyed, through the interposer (forgotten first, as
 * interpose.c reports cuCtxDestroy) or behind its back (destroyed on the driver directly: the
 * push for the wait answers CUDA_ERROR_INVALID_CONTEXT); the next waits skip it and memory is
 * still reused. */
static void destroyed_context_is_skipped(void **state)
{
    (void)state;
    for (int forget = 0; forget < 2; forget++) {
        reset(NULL, false, 0);
        CUcontext other = second_context();
        CUdeviceptr p, q;
        assert_int_equal(vmh_heap_alloc(8 * MiB, &p), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
        unsigned long before = sim_sync_count(other);
        assert_int_equal(vmh_heap_alloc(8 * MiB, &q), CUDA_SUCCESS);
        assert_int_equal(q, p);
        assert_int_equal(sim_sync_count(other), before + 1); /* waited on */
        if (forget)
            vmh_ctx_forget(other);
        assert_int_equal(F.ctx_destroy(other), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
        uint64_t blocking = vmh_counter_get(VMH_STAT_syncs_blocking);
        assert_int_equal(vmh_heap_alloc(8 * MiB, &p), CUDA_SUCCESS);
        assert_int_equal(p, q); /* the wait succeeded without the destroyed context */
        assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), blocking + 1);
        /* Forgotten either way: the next wait asks nothing of it. */
        sim_reset_counters();
        assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_alloc(8 * MiB, &q), CUDA_SUCCESS);
        assert_int_equal(q, p);
        assert_int_equal(sim_calls("cuCtxPushCurrent"), 0);
        assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
        teardown(NULL);
    }
}

/* ---- no stalls ------------------------------------------------------------------------------ */

/* In steady state the application thread never synchronizes: the reclaim thread releases what
 * was freed, and allocations find it in the cache without a driver call. */
static void steady_state_has_no_blocking_sync(void **state)
{
    (void)state;
    reset(NULL, true, 256 * MiB);
    CUdeviceptr p[8];
    for (int round = 0; round < 20; round++) {
        for (int i = 0; i < 8; i++)
            assert_int_equal(vmh_heap_alloc(i % 2 ? 4 * MiB : 100000, &p[i]), CUDA_SUCCESS);
        for (int i = 0; i < 8; i++)
            assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
        assert_true(vmh_reclaim_settle(5000));
        if (round == 1)
            sim_reset_counters(); /* from here on everything is reused */
    }
    assert_true(vmh_reclaim_thread_running());
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 0);
    assert_true(vmh_counter_get(VMH_STAT_syncs_background) >= 20);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs), vmh_counter_get(VMH_STAT_syncs_background));
    assert_int_equal(sim_calls("cuMemCreate"), 0);
    assert_int_equal(sim_calls("cuMemMap"), 0);
}

/* Past VMMHOOK_PARK_LIMIT the allocating thread waits itself; under it, it does not. */
static void park_limit_makes_the_allocating_thread_wait(void **state)
{
    (void)state;
    reset(NULL, false, 10 * MiB);
    CUdeviceptr p[3], q;
    for (int i = 0; i < 3; i++)
        assert_int_equal(vmh_heap_alloc(4 * MiB, &p[i]), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p[0], NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p[1], NULL, false), CUDA_SUCCESS);
    /* 8 MiB parked: under the limit, a fresh chunk and no wait. */
    assert_int_equal(vmh_heap_alloc(4 * MiB, &q), CUDA_SUCCESS);
    assert_true(q != p[0] && q != p[1]);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs), 0);
    assert_int_equal(vmh_counter_get(VMH_STAT_park_waits), 0);
    assert_int_equal(vmh_heap_free(p[2], NULL, false), CUDA_SUCCESS);
    /* 12 MiB parked: the next allocation waits once and reuses. */
    CUdeviceptr r;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &r), CUDA_SUCCESS);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 1);
    assert_int_equal(vmh_counter_get(VMH_STAT_park_waits), 1); /* and the stall is counted */
    assert_true(r == p[0] || r == p[1] || r == p[2]);
    assert_int_equal(vmh_heap_free(r, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
}

/* The free of one buffer larger than the park limit waits at the free, as cudaFree does: the
 * next allocation of its size then comes from the cache without a wait of its own. A smaller
 * free does not wait; an asynchronous free never does. */
static void free_larger_than_the_park_limit_waits_at_the_free(void **state)
{
    (void)state;
    reset(NULL, false, 10 * MiB);
    CUdeviceptr small, big, again, async_big;
    assert_int_equal(vmh_heap_alloc(8 * MiB, &small), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(16 * MiB, &big), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(16 * MiB, &async_big), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 0);
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 1);
    assert_int_equal(vmh_heap_alloc(16 * MiB, &again), CUDA_SUCCESS);
    assert_true(again == big); /* from the cache */
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 1);
    assert_int_equal(vmh_counter_get(VMH_STAT_park_waits), 0);
    assert_int_equal(vmh_heap_free(async_big, NULL, true), CUDA_SUCCESS);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 1);
    assert_int_equal(vmh_heap_free(again, NULL, false), CUDA_SUCCESS);
}

/* Past the park limit only an allocation that needs new memory waits: one the cache (or free
 * packed space) can serve grows nothing and goes on at once. */
static void allocation_served_from_the_cache_does_not_wait(void **state)
{
    (void)state;
    reset(NULL, false, 10 * MiB);
    CUdeviceptr x[3], a, c, hit, second;
    for (int i = 0; i < 3; i++)
        assert_int_equal(vmh_heap_alloc(4 * MiB, &x[i]), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(16 * MiB, &c), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(c, NULL, false), CUDA_SUCCESS); /* waits: a and c cached */
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 1);
    for (int i = 0; i < 3; i++)
        assert_int_equal(vmh_heap_free(x[i], NULL, false), CUDA_SUCCESS); /* 12 MiB parked */
    assert_int_equal(vmh_heap_alloc(4 * MiB, &hit), CUDA_SUCCESS);
    assert_true(hit == a);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 1);
    assert_int_equal(vmh_counter_get(VMH_STAT_park_waits), 0);
    /* The next one misses (only c, 16 MiB, is cached): it waits, then reuses a parked one. */
    assert_int_equal(vmh_heap_alloc(4 * MiB, &second), CUDA_SUCCESS);
    assert_int_equal(vmh_counter_get(VMH_STAT_park_waits), 1);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 2);
    assert_true(second == x[0] || second == x[1] || second == x[2]);
    assert_int_equal(vmh_heap_free(hit, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(second, NULL, false), CUDA_SUCCESS);
}

/* Out of memory with frees parked: the allocating thread waits, reclaims and retries. */
static void out_of_memory_waits_and_retries(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = 64 * MiB};
    reset(&cfg, false, SIZE_MAX);
    CUcontext other = second_context();
    CUdeviceptr p, q;
    assert_int_equal(vmh_heap_alloc(48 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(sim_launch_write(other, NULL, p, MiB, LATE), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs), 0); /* the free did not wait */
    /* Another size: the parked buffer must be released and trimmed to make room. */
    assert_int_equal(vmh_heap_alloc(40 * MiB, &q), CUDA_SUCCESS);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 1);
    assert_int_equal(vmh_counter_get(VMH_STAT_oom_retries), 1);
    assert_int_equal(sim_pending_ops_ctx(other), 0);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
    vmh_ctx_forget(other);
    assert_int_equal(F.ctx_destroy(other), CUDA_SUCCESS);
}

/* Another allocator of the process runs out (here the native cuMemAlloc): the interposer
 * calls vmh_heap_trim, which waits for the parked frees, gives them back, and the retried call
 * succeeds, as natively. */
static void trim_releases_parked_frees_for_another_allocator(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = 64 * MiB};
    reset(&cfg, false, SIZE_MAX);
    CUdeviceptr p, native = 0;
    assert_int_equal(vmh_heap_alloc(44 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    const vmh_driver_t *drv = sim_table();
    assert_int_equal(drv->cuMemAlloc(&native, 30 * MiB), CUDA_ERROR_OUT_OF_MEMORY);
    assert_true(vmh_heap_trim() >= 44 * MiB);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 1);
    assert_int_equal(sim_device_used(0), 0);
    assert_int_equal(drv->cuMemAlloc(&native, 30 * MiB), CUDA_SUCCESS);
    assert_int_equal(drv->cuMemFree(native), CUDA_SUCCESS);
}

/* VMMHOOK_FREE_SYNC=1: the free itself waits for every context, as native cudaFree. */
static void free_sync_blocks_like_native(void **state)
{
    (void)state;
    reset(NULL, false, SIZE_MAX);
    tu_opt.free_sync = true;
    tu_configure();
    CUcontext other = second_context();
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(sim_launch_write(other, NULL, p, MiB, LATE), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(sim_pending_ops_ctx(other), 0);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 1);
    vmh_ctx_forget(other);
    assert_int_equal(F.ctx_destroy(other), CUDA_SUCCESS);
}

/* ---- captures ----------------------------------------------------------------------------- */

/* The simulated driver's begin, made through the gate as the interposer makes it. */
typedef struct {
    CUstream stream;
    CUstreamCaptureMode mode;
} begin_call_t;

static CUresult sim_begin(void *arg)
{
    const begin_call_t *c = arg;
    return F.begin_capture(c->stream, c->mode);
}

static void begin_capture_on(CUstream s, CUstreamCaptureMode mode)
{
    begin_call_t call = {s, mode};
    assert_int_equal(vmh_capture_begin(s, mode, sim_begin, &call), CUDA_SUCCESS);
}

static CUstream begin_capture(CUstreamCaptureMode mode)
{
    CUstream s;
    assert_int_equal(F.stream_create(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    begin_capture_on(s, mode);
    return s;
}

static void end_capture_ok(CUstream s)
{
    CUgraph g = NULL;
    CUresult rc = F.end_capture(s, &g);
    vmh_capture_ended(s);
    assert_int_equal(rc, CUDA_SUCCESS); /* not invalidated */
    assert_non_null(g);
    assert_int_equal(F.graph_destroy(g), CUDA_SUCCESS);
    assert_int_equal(F.stream_destroy(s), CUDA_SUCCESS);
}

/* A free during a global-mode capture stays parked (the reclaim thread does not synchronize
 * while it lasts), an allocation on the capturing thread is served without a wait even past
 * the park limit, the capture is not invalidated, and the frees go once it ends. */
static void global_capture_keeps_frees_parked(void **state)
{
    (void)state;
    reset(NULL, true, 0);
    CUdeviceptr before, during, fresh;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &before), CUDA_SUCCESS);
    CUstream s = begin_capture(CU_STREAM_CAPTURE_MODE_GLOBAL);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &during), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(before, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(during, NULL, false), CUDA_SUCCESS);
    sleep_ms(30); /* the reclaim thread had time to (wrongly) synchronize */
    assert_int_equal(vmh_heap_alloc(4 * MiB, &fresh), CUDA_SUCCESS);
    assert_true(fresh != before && fresh != during); /* not reused: still parked */
    assert_int_equal(sim_sync_count(NULL), 0);
    assert_int_equal(sim_capture_refusals(), 0);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs), 0);
    vmh_heap_trim(); /* may not wait now: trims without a synchronize */
    assert_int_equal(sim_sync_count(NULL), 0);
    assert_int_equal(sim_capture_refusals(), 0);
    end_capture_ok(s);
    assert_true(vmh_reclaim_settle(5000));
    assert_true(vmh_counter_get(VMH_STAT_syncs_background) >= 1);
    /* The frees went: their memory serves again, or, where the run was slow enough for the
     * recent peak to age out (two tidy windows, a loaded CI machine), the background tidy gave
     * it back, which it does only to memory no longer parked. */
    CUdeviceptr again;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &again), CUDA_SUCCESS);
    assert_true(again == before || again == during ||
                vmh_counter_get(VMH_STAT_tidy_bytes) >= 8 * MiB);
    assert_int_equal(vmh_heap_free(again, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(fresh, NULL, false), CUDA_SUCCESS);
}

/* Captures begin and end again and again while the reclaim thread has work: none is refused a
 * call or invalidated. (A stress test; the window between the thread's look at the captures and
 * its synchronize is hit on purpose by capture_begun_during_a_background_sync_waits.) */
static void captures_race_the_reclaim_thread(void **state)
{
    (void)state;
    reset(NULL, true, SIZE_MAX);
    CUdeviceptr p[8];
    for (int round = 0; round < 200; round++) {
        for (int i = 0; i < 8; i++)
            assert_int_equal(vmh_heap_alloc(i % 2 ? 2 * MiB : 3000, &p[i]), CUDA_SUCCESS);
        for (int i = 0; i < 4; i++)
            assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
        CUstream s = begin_capture(CU_STREAM_CAPTURE_MODE_GLOBAL);
        for (int i = 4; i < 8; i++)
            assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
        end_capture_ok(s);
    }
    assert_int_equal(sim_capture_refusals(), 0);
    assert_true(vmh_reclaim_settle(5000));
    assert_true(vmh_counter_get(VMH_STAT_syncs_background) >= 1);
}

/* The reclaim thread's synchronize hands over to the test thread, which begins a capture, and
 * goes on only once that capture has begun or is held at the gate (issue 14: on the driver a
 * context synchronize during a capture fails and invalidates it, in any mode). */
static struct {
    vmh_driver_t table;  /* the simulated driver's, with the synchronize below */
    atomic_bool armed;   /* the next synchronize hands over */
    atomic_bool go;      /* the test thread may begin its capture */
    atomic_bool begun;   /* its begin returned */
} race;

static CUresult sync_letting_a_capture_begin(void)
{
    if (atomic_exchange(&race.armed, false)) {
        atomic_store(&race.go, true);
        while (!atomic_load(&race.begun) && vmh_capture_begins_pending() == 0)
            sleep_ms(1);
    }
    return sim_table()->cuCtxSynchronize();
}

static void capture_begun_during_a_background_sync_waits(void **state)
{
    (void)state;
    reset(NULL, true, SIZE_MAX);
    race.table = *sim_table();
    race.table.cuCtxSynchronize = sync_letting_a_capture_begin;
    atomic_store(&race.go, false);
    atomic_store(&race.begun, false);
    vmh_driver_install(&race.table); /* before the reclaim thread starts: at the first park */
    CUstream s;
    assert_int_equal(F.stream_create(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
    atomic_store(&race.armed, true);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS); /* wakes the thread */
    for (int ms = 0; !atomic_load(&race.go); ms++) {
        assert_true(ms < 5000);
        sleep_ms(1);
    }
    /* The thread is inside vmh_ctx_sync_device, past its look at the captures. */
    begin_capture_on(s, CU_STREAM_CAPTURE_MODE_GLOBAL);
    atomic_store(&race.begun, true);
    assert_int_equal(sim_capture_refusals(), 0);
    assert_int_equal(sim_sync_count(NULL), 1); /* it finished first, and none began after */
    end_capture_ok(s);
    assert_true(vmh_reclaim_settle(5000));
}

/* cudaMalloc in relaxed mode during a capture (PyTorch's graph pools): served from fresh memory
 * without a synchronize, though frees are parked past the limit. */
static void relaxed_capture_allocation_without_sync(void **state)
{
    (void)state;
    reset(NULL, false, 0);
    CUdeviceptr p, q, r;
    assert_int_equal(vmh_heap_alloc(8 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    CUstream s = begin_capture(CU_STREAM_CAPTURE_MODE_RELAXED);
    assert_int_equal(vmh_heap_alloc(8 * MiB, &q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(2048, &r), CUDA_SUCCESS);
    assert_int_equal(sim_sync_count(NULL), 0);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs), 0);
    end_capture_ok(s);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(r, NULL, false), CUDA_SUCCESS);
}

/* Out of memory while the calling thread's capture forbids a synchronize: out of memory at
 * once, no refused call, the capture intact; after it the same request succeeds by waiting. */
static void out_of_memory_during_capture_does_not_wait(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = 32 * MiB};
    reset(&cfg, false, SIZE_MAX);
    CUdeviceptr p, q;
    assert_int_equal(vmh_heap_alloc(24 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    CUstream s = begin_capture(CU_STREAM_CAPTURE_MODE_GLOBAL);
    assert_int_equal(vmh_heap_alloc(20 * MiB, &q), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(sim_capture_refusals(), 0);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs), 0);
    end_capture_ok(s);
    assert_int_equal(vmh_heap_alloc(20 * MiB, &q), CUDA_SUCCESS);
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), 1);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
}

/* ---- the thread's life -------------------------------------------------------------------- */

/* Exit while the reclaim thread works: once the heap has shut down, the thread is gone and no
 * driver call is made any more; late frees are accepted without one. */
static void reclaim_thread_stops_at_exit(void **state)
{
    (void)state;
    for (int round = 0; round < 10; round++) {
        reset(NULL, true, SIZE_MAX);
        CUdeviceptr p[16], late;
        assert_int_equal(vmh_heap_alloc(4 * MiB, &late), CUDA_SUCCESS);
        for (int i = 0; i < 16; i++)
            assert_int_equal(vmh_heap_alloc(i % 2 ? 4 * MiB : 4096, &p[i]), CUDA_SUCCESS);
        for (int i = 0; i < 16; i++)
            assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
        assert_true(vmh_reclaim_thread_running());
        if (round % 2)
            sleep_ms(1); /* sometimes inside a wait, sometimes before the first */
        assert_true(vmh_phase_exited()); /* what lifetime.c's destructor does */
        vmh_heap_shutdown(false);
        assert_false(vmh_reclaim_thread_running());
        unsigned long calls = sim_call_count();
        assert_int_equal(vmh_heap_free(late, NULL, false), CUDA_SUCCESS);
        sleep_ms(5);
        assert_int_equal(sim_call_count(), calls);
        assert_false(vmh_reclaim_thread_running()); /* the late free started none */
        vmh_heap_reset();
        vmh_phase_reset(); /* serves again; the next test's driver is fresh */
    }
}

/* A forked child has no reclaim thread and starts none; its exit (which runs the library's exit
 * handler) does not wait for the parent's thread. With the phase the lifetime's fork handler
 * sets here (the suite never ran the library's start: FORKED, the heap serves) and with that of
 * a child of a started library (CHILD: pass-through). */
static void forked_child_has_no_reclaim_thread(void **state)
{
    (void)state;
    for (int told = 0; told < 2; told++) {
        reset(NULL, true, SIZE_MAX);
        CUdeviceptr p;
        assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
        assert_true(vmh_reclaim_thread_running());
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            tu_forked_child();
            alarm(10); /* a join of the parent's thread would hang: the alarm ends it */
            if (!vmh_phase_forked_child())
                exit(2);
            if (told)
                vmh_phase_forked(true); /* lifetime.c's fork handler after a start */
            exit(vmh_reclaim_thread_running() ? 1 : 0); /* runs the exit handlers */
        }
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 0);
        teardown(NULL);
    }
}

/* Threads churn while the reclaim thread waits and the park limit makes them wait too (TSan
 * runs this): every buffer keeps its contents while live, and nothing is lost. */
static void *churn(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    const unsigned tag = seed; /* the contents' pattern (seed moves on) */
    sim_set_current_device(0); /* a new thread has no context */
    CUdeviceptr p[6] = {0};
    size_t n[6] = {0};
    for (int step = 0; step < 300; step++) {
        int i = step % 6;
        if (p[i]) {
            if (!tu_check(p[i], n[i] < 4096 ? n[i] : 4096, tag + (unsigned)i))
                return (void *)2;
            if (vmh_heap_free(p[i], NULL, false) != CUDA_SUCCESS)
                return (void *)3;
        }
        n[i] = rand_r(&seed) % 3 == 0 ? 3 * MiB : 512 + (size_t)rand_r(&seed) % 60000;
        CUresult rc = vmh_heap_alloc(n[i], &p[i]);
        if (rc != CUDA_SUCCESS) {
            fprintf(stderr, "alloc %zu: %d\n", n[i], rc);
            return (void *)4;
        }
        if (!tu_fill_try(p[i], n[i] < 4096 ? n[i] : 4096, tag + (unsigned)i))
            return (void *)1;
    }
    for (int i = 0; i < 6; i++)
        if (vmh_heap_free(p[i], NULL, false) != CUDA_SUCCESS)
            return (void *)1;
    return NULL;
}

static void threads_churn_with_the_reclaim_thread(void **state)
{
    (void)state;
    reset(NULL, true, 8 * MiB);
    pthread_t t[4];
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&t[i], NULL, churn, (void *)(uintptr_t)(i * 100 + 1)), 0);
    for (int i = 0; i < 4; i++) {
        void *bad = (void *)1;
        assert_int_equal(pthread_join(t[i], &bad), 0);
        assert_int_equal((uintptr_t)bad, 0);
    }
    assert_true(vmh_reclaim_settle(5000));
    assert_true(vmh_counter_get(VMH_STAT_syncs_background) >= 1);
    assert_int_equal(sim_hazards(), 0);
}

/* Parked bytes are counted on per-thread shards and moved into the device's total a quantum at
 * a time: many threads adding and one releasing, the exact figure is right at every quiet
 * point (park_limit_makes_the_allocating_thread_wait checks the limit itself, below a quantum). */
typedef struct parked_adder {
    vmh_reclaim_t *r;
    size_t bytes, times;
} parked_adder_t;

static void *add_parked(void *arg)
{
    parked_adder_t *a = arg;
    for (size_t i = 0; i < a->times; i++)
        vmh_reclaim_add_bytes(a->r, a->bytes);
    return NULL;
}

static size_t released_bytes;

static size_t release_counted(vmh_parked_t *item, uint64_t passed)
{
    (void)item;
    (void)passed;
    return released_bytes;
}

static void parked_bytes_sharded_by_thread(void **state)
{
    (void)state;
    reset(NULL, false, SIZE_MAX);
    vmh_reclaim_t r;
    vmh_reclaim_init(&r, NULL); /* never waited on: no device needed */
    enum { THREADS = 8 };
    pthread_t t[THREADS];
    parked_adder_t a[THREADS];
    size_t want = 0;
    for (int i = 0; i < THREADS; i++) {
        /* Odd sizes: shards pass the quantum at different points. */
        a[i] = (parked_adder_t){&r, 4096 + (size_t)i * 513, 5000 + (size_t)i * 37};
        want += a[i].bytes * a[i].times;
        assert_int_equal(pthread_create(&t[i], NULL, add_parked, &a[i]), 0);
    }
    for (int i = 0; i < THREADS; i++)
        assert_int_equal(pthread_join(t[i], NULL), 0);
    assert_int_equal(vmh_reclaim_parked_bytes(&r), want);
    assert_true(want > (size_t)VMH_PARK_SHARDS * VMH_PARK_QUANTUM); /* quanta were moved */
    vmh_parked_t item = {.release = release_counted};
    released_bytes = want;
    vmh_reclaim_park(&r, &item, vmh_reclaim_now(&r), 0);
    vmh_reclaim_release_all(&r);
    assert_int_equal(vmh_reclaim_parked_bytes(&r), 0);
    vmh_reclaim_destroy(&r);
}

/* ---- failures on the new paths ------------------------------------------------------------ */

/* The reclaim thread's wait fails (each synchronize, push and pop in turn): nothing is released
 * on a failed wait, the thread tries again later, and the memory comes back. */
static void background_wait_failures_are_retried(void **state)
{
    (void)state;
    static const char *const calls[] = {"cuCtxSynchronize", "cuCtxPushCurrent", "cuCtxPopCurrent"};
    for (size_t c = 0; c < sizeof calls / sizeof *calls; c++) {
        reset(NULL, true, SIZE_MAX);
        CUcontext other = second_context();
        CUdeviceptr p, q;
        assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
        assert_int_equal(sim_launch_write(other, NULL, p, MiB, LATE), CUDA_SUCCESS);
        sim_fail_function(calls[c], 1, CUDA_ERROR_LAUNCH_FAILED);
        assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
        assert_true(vmh_reclaim_settle(5000));
        assert_int_equal(sim_faults_fired(), 1);
        assert_int_equal(sim_pending_ops_ctx(other), 0);
        assert_int_equal(vmh_heap_alloc(4 * MiB, &q), CUDA_SUCCESS);
        assert_int_equal(q, p);
        assert_int_equal(sim_memset(q, 0, 4 * MiB), CUDA_SUCCESS);
        sim_flush();
        assert_int_equal(late_bytes(q, 4 * MiB), 0);
        assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
        vmh_reclaim_stop();
        vmh_ctx_forget(other);
        assert_int_equal(F.ctx_destroy(other), CUDA_SUCCESS);
        teardown(NULL);
    }
}

/* The allocation that must wait (out of memory with a second context's kernel pending on the
 * parked buffer) with each driver call it makes failed in turn: it succeeds or fails with a
 * code, a late write never reaches a buffer it returns, and nothing is left behind. */
static void oom_wait_failure_sweep(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = 64 * MiB};
    const size_t n = 40 * MiB;
    size_t total = 0;
    const char *names[256];
    for (size_t nth = 0;; nth++) {
        /* Undo calls are not failed (DESIGN.md: the driver does not refuse them for its own
         * objects; test_sweep.c does the same). */
        if (nth > 0 &&
            (!strcmp(names[nth - 1], "cuMemUnmap") || !strcmp(names[nth - 1], "cuMemAddressFree") ||
             !strcmp(names[nth - 1], "cuMemRelease"))) {
            if (nth == total)
                break;
            continue;
        }
        reset(&cfg, false, SIZE_MAX);
        CUcontext other = second_context();
        CUdeviceptr p, q = 0;
        assert_int_equal(vmh_heap_alloc(48 * MiB, &p), CUDA_SUCCESS);
        assert_int_equal(sim_launch_write(other, NULL, p + 44 * MiB, MiB, LATE), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
        if (nth == 0)
            sim_trace_begin();
        else
            sim_fail_call(nth, CUDA_ERROR_UNKNOWN);
        CUresult rc = vmh_heap_alloc(n, &q);
        if (nth == 0) {
            total = sim_trace_get(names, 256);
            sim_trace_end();
            assert_int_equal(rc, CUDA_SUCCESS);
            assert_true(total > 3 && total <= 256);
        } else {
            assert_int_equal(sim_faults_fired(), 1);
            assert_true(rc == CUDA_SUCCESS || rc == CUDA_ERROR_UNKNOWN ||
                        rc == CUDA_ERROR_OUT_OF_MEMORY);
        }
        sim_clear_faults();
        if (rc == CUDA_SUCCESS) {
            assert_int_equal(sim_memset(q, 0, n), CUDA_SUCCESS);
            sim_flush();
            assert_int_equal(late_bytes(q, n), 0);
            assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
        }
        vmh_ctx_forget(other);
        assert_int_equal(F.ctx_destroy(other), CUDA_SUCCESS);
        teardown(NULL);
        if (nth == total)
            break;
    }
}

/* A trim (or an out-of-memory retry) that finds the queue empty while the reclaim thread is
 * still releasing what it took off the queue must wait for those releases: otherwise the trim
 * runs before the memory is back and misses it (issue 13: CI's ip_ipc found a chunk still
 * held after vmm_trim, the H200's realloc_gpu 64 MiB still mapped at exit). */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool in_release, may_finish, released, drained;
} slow = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, false, false, false};

static size_t slow_release(vmh_parked_t *item, uint64_t passed)
{
    (void)item;
    (void)passed;
    pthread_mutex_lock(&slow.lock);
    slow.in_release = true;
    pthread_cond_broadcast(&slow.cond);
    while (!slow.may_finish)
        pthread_cond_wait(&slow.cond, &slow.lock);
    slow.released = true;
    pthread_mutex_unlock(&slow.lock);
    return 4096;
}

static void *background_wait(void *r)
{
    assert_int_equal(vmh_reclaim_wait(r, VMH_WAIT_BACKGROUND), CUDA_SUCCESS);
    return NULL;
}

static void *drain(void *r)
{
    assert_int_equal(vmh_reclaim_drain(r), CUDA_SUCCESS);
    pthread_mutex_lock(&slow.lock);
    slow.drained = true;
    pthread_mutex_unlock(&slow.lock);
    return NULL;
}

static void drain_waits_for_releases_in_progress(void **state)
{
    (void)state;
    reset(NULL, false, SIZE_MAX);
    vmh_dev_t dev = {.ordinal = 0};
    vmh_reclaim_t r;
    vmh_reclaim_init(&r, &dev);
    vmh_parked_t item = {.release = slow_release};
    vmh_reclaim_park(&r, &item, vmh_reclaim_now(&r), 4096);

    pthread_t waiter, drainer;
    assert_int_equal(pthread_create(&waiter, NULL, background_wait, &r), 0);
    pthread_mutex_lock(&slow.lock);
    while (!slow.in_release)
        pthread_cond_wait(&slow.cond, &slow.lock);
    pthread_mutex_unlock(&slow.lock);
    assert_false(vmh_reclaim_pending(&r)); /* taken off the queue, not yet released */

    assert_int_equal(pthread_create(&drainer, NULL, drain, &r), 0);
    sleep_ms(50);
    pthread_mutex_lock(&slow.lock);
    assert_false(slow.drained); /* the release is still running: the drain waits for it */
    slow.may_finish = true;
    pthread_cond_broadcast(&slow.cond);
    pthread_mutex_unlock(&slow.lock);
    assert_int_equal(pthread_join(drainer, NULL), 0);
    assert_int_equal(pthread_join(waiter, NULL), 0);
    assert_true(slow.released && slow.drained);
    assert_int_equal(vmh_reclaim_parked_bytes(&r), 0);
    vmh_reclaim_destroy(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(late_write_from_another_context_never_lands_in_reused_memory,
                                  teardown),
        cmocka_unit_test_teardown(late_write_with_the_reclaim_thread, teardown),
        cmocka_unit_test_teardown(destroyed_context_is_skipped, teardown),
        cmocka_unit_test_teardown(steady_state_has_no_blocking_sync, teardown),
        cmocka_unit_test_teardown(park_limit_makes_the_allocating_thread_wait, teardown),
        cmocka_unit_test_teardown(free_larger_than_the_park_limit_waits_at_the_free, teardown),
        cmocka_unit_test_teardown(allocation_served_from_the_cache_does_not_wait, teardown),
        cmocka_unit_test_teardown(out_of_memory_waits_and_retries, teardown),
        cmocka_unit_test_teardown(trim_releases_parked_frees_for_another_allocator, teardown),
        cmocka_unit_test_teardown(free_sync_blocks_like_native, teardown),
        cmocka_unit_test_teardown(global_capture_keeps_frees_parked, teardown),
        cmocka_unit_test_teardown(relaxed_capture_allocation_without_sync, teardown),
        cmocka_unit_test_teardown(captures_race_the_reclaim_thread, teardown),
        cmocka_unit_test_teardown(capture_begun_during_a_background_sync_waits, teardown),
        cmocka_unit_test_teardown(out_of_memory_during_capture_does_not_wait, teardown),
        cmocka_unit_test_teardown(threads_churn_with_the_reclaim_thread, teardown),
        cmocka_unit_test_teardown(parked_bytes_sharded_by_thread, teardown),
        cmocka_unit_test_teardown(reclaim_thread_stops_at_exit, teardown),
        cmocka_unit_test_teardown(forked_child_has_no_reclaim_thread, teardown),
        cmocka_unit_test_teardown(background_wait_failures_are_retried, teardown),
        cmocka_unit_test_teardown(oom_wait_failure_sweep, teardown),
        cmocka_unit_test_teardown(drain_waits_for_releases_in_progress, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
