/* The simulated driver's contexts, work in flight per context, stream capture, pinned host and
 * managed memory, fork safety and the range query for paused buffers (test_sim_*.c have the rest).
 * Entry points not in the library's table yet are fetched through the simulated
 * cuGetProcAddress, as a CUDA 13 program would. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cudaTypedefs.h>

#include "simdrv.h"

#define MB (1024ULL * 1024)
#define G2 (2 * MB)

#define OK(x) assert_int_equal((x), CUDA_SUCCESS)
#define RC(code, x) assert_int_equal((x), (code))

static const vmh_driver_t *D;

/* The entry points, as cuGetProcAddress answers them at cudaVersion 13000. */
static struct {
    PFN_cuCtxCreate_v12050 ctx_create;
    PFN_cuCtxDestroy_v4000 ctx_destroy;
    PFN_cuCtxSetCurrent_v4000 ctx_set_current;
    PFN_cuCtxSynchronize_v13000 ctx_sync_v2;
    PFN_cuDevicePrimaryCtxRelease_v11000 primary_release;
    PFN_cuDevicePrimaryCtxReset_v11000 primary_reset;
    PFN_cuStreamCreate_v2000 stream_create;
    PFN_cuStreamDestroy_v4000 stream_destroy;
    PFN_cuStreamQuery_v2000 stream_query;
    PFN_cuStreamBeginCapture_v10010 begin_capture;
    PFN_cuStreamEndCapture_v10000 end_capture;
    PFN_cuStreamIsCapturing_v10000 is_capturing;
    PFN_cuThreadExchangeStreamCaptureMode_v10010 exchange_mode;
    PFN_cuGraphDestroy_v10000 graph_destroy;
    PFN_cuMemAllocManaged_v6000 alloc_managed;
    PFN_cuMemAllocFromPoolAsync_v11020 alloc_from_pool;
    PFN_cuMemAllocAsync_v11020 alloc_async;
    PFN_cuMemHostAlloc_v2020 host_alloc;
    PFN_cuMemFreeHost_v2000 free_host;
    PFN_cuMemHostRegister_v6050 host_register;
    PFN_cuMemHostUnregister_v4000 host_unregister;
    PFN_cuMemcpyHtoD_v3020 htod;
    PFN_cuMemcpyDtoH_v3020 dtoh;
    PFN_cuMemcpyHtoDAsync_v3020 htod_async;
    PFN_cuMemcpyDtoHAsync_v3020 dtoh_async;
} F;

static void *proc(const char *name, int version)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    assert_int_equal(sim_get_proc_address(name, &fn, version, 0, &st), CUDA_SUCCESS);
    assert_int_equal(st, CU_GET_PROC_ADDRESS_SUCCESS);
    assert_non_null(fn);
    return fn;
}

static int setup_with(const sim_config_t *c)
{
    sim_reset(c);
    D = sim_table();
#define GET(field, name) F.field = (__typeof__(F.field))proc(name, 13000)
    GET(ctx_create, "cuCtxCreate");
    GET(ctx_destroy, "cuCtxDestroy");
    GET(ctx_set_current, "cuCtxSetCurrent");
    GET(ctx_sync_v2, "cuCtxSynchronize");
    GET(primary_release, "cuDevicePrimaryCtxRelease");
    GET(primary_reset, "cuDevicePrimaryCtxReset");
    GET(stream_create, "cuStreamCreate");
    GET(stream_destroy, "cuStreamDestroy");
    GET(stream_query, "cuStreamQuery");
    GET(begin_capture, "cuStreamBeginCapture");
    GET(end_capture, "cuStreamEndCapture");
    GET(is_capturing, "cuStreamIsCapturing");
    GET(exchange_mode, "cuThreadExchangeStreamCaptureMode");
    GET(graph_destroy, "cuGraphDestroy");
    GET(alloc_managed, "cuMemAllocManaged");
    GET(alloc_from_pool, "cuMemAllocFromPoolAsync");
    GET(alloc_async, "cuMemAllocAsync");
    GET(host_alloc, "cuMemHostAlloc");
    GET(free_host, "cuMemFreeHost");
    GET(host_register, "cuMemHostRegister");
    GET(host_unregister, "cuMemHostUnregister");
    GET(htod, "cuMemcpyHtoD");
    GET(dtoh, "cuMemcpyDtoH");
    GET(htod_async, "cuMemcpyHtoDAsync");
    GET(dtoh_async, "cuMemcpyDtoHAsync");
#undef GET
    sim_reset_counters();
    return 0;
}

static int setup(void **state)
{
    (void)state;
    return setup_with(NULL);
}

static int setup_small(void **state)
{
    (void)state;
    sim_config_t c = {.memory = 64 * MB};
    return setup_with(&c);
}

static void ledger_empty(void)
{
    if (!sim_ledger_empty())
        sim_ledger_dump();
    assert_true(sim_ledger_empty());
}

/* A 2 MiB VMM chunk mapped read-write for device 0 (the memory the hook serves from). */
typedef struct chunk {
    CUmemGenericAllocationHandle h;
    CUdeviceptr p;
} chunk_t;

static chunk_t chunk_new(void)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    chunk_t c = {0, 0};
    OK(D->cuMemCreate(&c.h, G2, &prop, 0));
    OK(D->cuMemAddressReserve(&c.p, G2, 0, 0, 0));
    OK(D->cuMemMap(c.p, G2, 0, c.h, 0));
    CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    OK(D->cuMemSetAccess(c.p, G2, &acc, 1));
    return c;
}

static void chunk_free(chunk_t c)
{
    OK(D->cuMemUnmap(c.p, G2));
    OK(D->cuMemRelease(c.h));
    OK(D->cuMemAddressFree(c.p, G2));
}

static unsigned char byte_at(CUdeviceptr p)
{
    unsigned char b = 0xee;
    OK(sim_read(&b, p, 1));
    return b;
}

/* ---- contexts ----------------------------------------------------------------------------- */

typedef struct on_thread {
    CUcontext ctx;
    CUresult alloc_rc, sync_rc;
} on_thread_t;

/* Another thread with ctx current at the time of the calls. */
static void *use_ctx(void *arg)
{
    on_thread_t *t = arg;
    CUdeviceptr p = 0;
    t->alloc_rc = F.ctx_set_current(t->ctx);
    if (t->alloc_rc == CUDA_SUCCESS)
        t->alloc_rc = D->cuMemAlloc(&p, 64);
    t->sync_rc = D->cuCtxSynchronize();
    return NULL;
}

static void test_ctx_create_destroy(void **state)
{
    (void)state;
    CUcontext primary = sim_primary_context(0), c = NULL, cur = NULL;
    RC(CUDA_ERROR_INVALID_VALUE, F.ctx_create(NULL, NULL, 0, 0));
    RC(CUDA_ERROR_INVALID_DEVICE, F.ctx_create(&c, NULL, 0, 1));
    RC(CUDA_ERROR_INVALID_VALUE, F.ctx_create(&c, NULL, 0x100, 0));
    CUctxCreateParams params;
    memset(&params, 0, sizeof params);
    CUexecAffinityParam aff;
    memset(&aff, 0, sizeof aff);
    params.execAffinityParams = &aff;
    params.numExecAffinityParams = 1;
    RC(CUDA_ERROR_NOT_SUPPORTED, F.ctx_create(&c, &params, 0, 0));
    assert_int_equal(sim_live_contexts(), 0);

    /* A new context is pushed: current, beside the primary one, with its own memory. */
    OK(F.ctx_create(&c, NULL, CU_CTX_SCHED_BLOCKING_SYNC, 0));
    assert_non_null(c);
    assert_ptr_not_equal(c, primary);
    assert_int_equal(sim_live_contexts(), 1);
    OK(D->cuCtxGetCurrent(&cur));
    assert_ptr_equal(cur, c);
    CUdeviceptr p = 0;
    OK(D->cuMemAlloc(&p, 4096));
    CUcontext owner = NULL;
    OK(D->cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, p));
    assert_ptr_equal(owner, c);
    CUstream s = NULL;
    OK(F.stream_create(&s, 0));
    assert_int_equal(sim_live_streams(), 1);

    /* Another thread keeps it current across its destruction. */
    RC(CUDA_ERROR_INVALID_VALUE, F.ctx_destroy(NULL));
    RC(CUDA_ERROR_INVALID_CONTEXT, F.ctx_destroy(primary));
    OK(F.ctx_destroy(c));
    assert_int_equal(sim_live_contexts(), 0);
    assert_int_equal(sim_live_native(), 0); /* its memory went with it */
    assert_int_equal(sim_live_streams(), 0);
    OK(D->cuCtxGetCurrent(&cur));
    assert_ptr_equal(cur, primary); /* popped from this thread */
    RC(CUDA_ERROR_INVALID_CONTEXT, F.ctx_destroy(c));
    RC(CUDA_ERROR_INVALID_CONTEXT, F.ctx_set_current(c));
    RC(CUDA_ERROR_INVALID_CONTEXT, F.ctx_sync_v2(c));
    RC(CUDA_ERROR_INVALID_CONTEXT, D->cuCtxPushCurrent(c));

    /* A thread made it current before the destruction: destroyed, not merely invalid. */
    CUcontext c2 = NULL;
    OK(F.ctx_create(&c2, NULL, 0, 0));
    OK(D->cuCtxPopCurrent(NULL));
    /* Used from another thread: the block allocated there belongs to c2 and goes with it. */
    on_thread_t t = {c2, CUDA_SUCCESS, CUDA_SUCCESS};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, use_ctx, &t), 0);
    pthread_join(th, NULL);
    OK(t.alloc_rc);
    OK(t.sync_rc);
    assert_int_equal(sim_live_native(), 1);
    OK(F.ctx_destroy(c2));
    assert_int_equal(sim_live_native(), 0);
    ledger_empty();
}

static CUcontext destroyed_ctx;
static pthread_barrier_t bar;
static CUresult late_alloc_rc, late_sync_rc;

static void *current_across_destroy(void *arg)
{
    (void)arg;
    CUdeviceptr p = 0;
    OK(F.ctx_set_current(destroyed_ctx));
    pthread_barrier_wait(&bar); /* main destroys it now */
    pthread_barrier_wait(&bar);
    late_alloc_rc = D->cuMemAlloc(&p, 64);
    late_sync_rc = D->cuCtxSynchronize();
    return NULL;
}

static void test_ctx_destroyed_while_current_elsewhere(void **state)
{
    (void)state;
    OK(F.ctx_create(&destroyed_ctx, NULL, 0, 0));
    OK(D->cuCtxPopCurrent(NULL));
    pthread_barrier_init(&bar, NULL, 2);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, current_across_destroy, NULL), 0);
    pthread_barrier_wait(&bar);
    OK(F.ctx_destroy(destroyed_ctx)); /* no error although current on the other thread */
    pthread_barrier_wait(&bar);
    pthread_join(th, NULL);
    pthread_barrier_destroy(&bar);
    RC(CUDA_ERROR_CONTEXT_IS_DESTROYED, late_alloc_rc);
    RC(CUDA_ERROR_CONTEXT_IS_DESTROYED, late_sync_rc);
    ledger_empty();
}

static void test_ctx_create_versions(void **state)
{
    (void)state;
    /* cuGetProcAddress answers the ABI of the version asked for. */
    void *v4 = proc("cuCtxCreate", 12050), *v3 = proc("cuCtxCreate", 12040),
         *v2 = proc("cuCtxCreate", 11030);
    assert_ptr_equal(v4, (void *)F.ctx_create);
    assert_ptr_not_equal(v3, v4);
    assert_ptr_not_equal(v2, v3);
    assert_ptr_equal(proc("cuCtxCreate", 11040), v3);
    void *fn = (void *)1;
    RC(CUDA_ERROR_NOT_FOUND, sim_get_proc_address("cuCtxCreate_v3", &fn, 13000, 0, NULL));
    assert_null(fn);
    RC(CUDA_ERROR_NOT_FOUND, sim_get_proc_address("cuCtxCreate", &fn, 3010, 0, NULL));
    CUcontext a = NULL, b = NULL;
    OK(((PFN_cuCtxCreate_v3020)v2)(&a, 0, 0));
    OK(((PFN_cuCtxCreate_v11040)v3)(&b, NULL, 0, 0, 0));
    CUexecAffinityParam aff;
    memset(&aff, 0, sizeof aff);
    CUcontext c = NULL;
    RC(CUDA_ERROR_NOT_SUPPORTED, ((PFN_cuCtxCreate_v11040)v3)(&c, &aff, 1, 0, 0));
    RC(CUDA_ERROR_INVALID_VALUE, ((PFN_cuCtxCreate_v11040)v3)(&c, NULL, -1, 0, 0));
    assert_int_equal(sim_calls("cuCtxCreate_v2"), 1);
    assert_int_equal(sim_calls("cuCtxCreate_v3"), 3);
    assert_int_equal(sim_calls("cuCtxCreate"), 0);
    assert_int_equal(sim_live_contexts(), 2);
    OK(F.ctx_destroy(b)); /* b is current: popped, a below it */
    CUcontext cur = NULL;
    OK(D->cuCtxGetCurrent(&cur));
    assert_ptr_equal(cur, a);
    OK(F.ctx_destroy(a));
    assert_int_equal(sim_live_contexts(), 0);
}

static void test_primary_reset(void **state)
{
    (void)state;
    CUdeviceptr p = 0;
    OK(D->cuMemAlloc(&p, 4096));
    OK(F.primary_reset(0));
    assert_int_equal(sim_live_native(), 0); /* the reset freed the primary context's memory */
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemFree(p));
    OK(D->cuMemAlloc(&p, 4096)); /* and the context goes on working */
    CUcontext pc = NULL;
    OK(D->cuDevicePrimaryCtxRetain(&pc, 0));
    OK(D->cuDevicePrimaryCtxRetain(&pc, 0));
    OK(F.primary_release(0));
    assert_int_equal(sim_live_native(), 1); /* a reference is left */
    OK(F.primary_release(0));
    assert_int_equal(sim_live_native(), 0); /* the last one resets it */
    RC(CUDA_ERROR_INVALID_CONTEXT, F.primary_release(0));
    ledger_empty();
}

/* ---- work in flight per context ------------------------------------------------------------- */

static void test_work_lands_per_context(void **state)
{
    (void)state;
    CUcontext a = sim_primary_context(0), b = NULL;
    OK(F.ctx_create(&b, NULL, 0, 0));
    OK(F.ctx_set_current(a)); /* b stays alive, a is current */
    chunk_t m = chunk_new();
    OK(sim_memset(m.p, 0, 4096));

    /* A kernel in b writes m later; syncing a does not run it. */
    OK(sim_launch_write(b, NULL, m.p, 4096, 0xab));
    assert_int_equal(sim_pending_ops_ctx(b), 1);
    OK(D->cuCtxSynchronize());
    OK(F.ctx_sync_v2(a));
    OK(D->cuStreamSynchronize(NULL));
    assert_int_equal(sim_pending_ops_ctx(b), 1);
    assert_int_equal(byte_at(m.p), 0);
    assert_int_equal(sim_sync_count(a), 3);
    assert_int_equal(sim_sync_count(b), 0);
    OK(F.ctx_sync_v2(b));
    assert_int_equal(sim_pending_ops(), 0);
    assert_int_equal(byte_at(m.p + 4095), 0xab);
    assert_int_equal(sim_sync_count(b), 1);
    assert_int_equal(sim_sync_count(NULL), 4);

    /* The late write: "freed" (kept mapped, as the hook does), handed out again, zeroed by its
     * new user in a; b's kernel lands afterwards and overwrites it. */
    OK(sim_launch_write(b, NULL, m.p, 64, 0x5a));
    OK(sim_memset(m.p, 0, 64));
    assert_int_equal(byte_at(m.p), 0);
    sim_flush();
    assert_int_equal(byte_at(m.p), 0x5a);
    assert_int_equal(sim_hazards(), 0);

    /* Streams: syncing one stream of b lands only its work. */
    OK(F.ctx_set_current(b));
    CUstream s1 = NULL, s2 = NULL;
    OK(F.stream_create(&s1, 0));
    OK(F.stream_create(&s2, CU_STREAM_NON_BLOCKING));
    OK(F.ctx_set_current(a));
    OK(sim_launch_write(b, s1, m.p, 1, 1));
    OK(sim_launch_write(b, s2, m.p + 1, 1, 2));
    RC(CUDA_ERROR_INVALID_HANDLE, sim_launch_write(a, s1, m.p, 1, 3)); /* s1 is b's */
    RC(CUDA_ERROR_INVALID_CONTEXT, sim_launch_write((CUcontext)&m, NULL, m.p, 1, 3));
    OK(D->cuStreamSynchronize(s2));
    assert_int_equal(sim_pending_ops_ctx(b), 1);
    assert_int_equal(byte_at(m.p + 1), 2);
    assert_int_equal(byte_at(m.p), 0x5a);
    OK(F.stream_destroy(s1)); /* its work stays with b */
    assert_int_equal(sim_pending_ops_ctx(b), 1);
    OK(F.ctx_destroy(b));     /* destruction waits for it */
    assert_int_equal(sim_pending_ops(), 0);
    assert_int_equal(byte_at(m.p), 1);

    /* A kernel whose memory was unmapped before it ran: hazards (at the unmap and the landing). */
    OK(sim_launch_write(NULL, NULL, m.p, 16, 9));
    OK(D->cuMemUnmap(m.p, G2));
    assert_int_equal(sim_hazards(), 1);
    OK(D->cuCtxSynchronize());
    assert_int_equal(sim_hazards(), 2);
    assert_int_equal(sim_pending_ops(), 0);
    OK(D->cuMemRelease(m.h));
    OK(D->cuMemAddressFree(m.p, G2));
    ledger_empty();
}

static void test_native_free_lands_its_context(void **state)
{
    (void)state;
    CUcontext a = sim_primary_context(0), b = NULL;
    OK(F.ctx_create(&b, NULL, 0, 0));
    CUdeviceptr pb = 0;
    OK(D->cuMemAlloc(&pb, 4096)); /* in b */
    chunk_t m = chunk_new();
    OK(sim_launch_write(b, NULL, m.p, 16, 7));
    OK(F.ctx_set_current(a));
    CUdeviceptr pa = 0;
    OK(D->cuMemAlloc(&pa, 4096));
    OK(D->cuMemFree(pa)); /* a's block, from a: b's kernel still pending */
    assert_int_equal(sim_pending_ops_ctx(b), 1);
    OK(D->cuMemFree(pb)); /* b's block, from a: waits for b */
    assert_int_equal(sim_pending_ops_ctx(b), 0);
    OK(F.ctx_set_current(b));
    assert_int_equal(byte_at(m.p), 7);
    OK(F.ctx_destroy(b));
    chunk_free(m);
    assert_int_equal(sim_hazards(), 0);
    ledger_empty();
}

/* ---- capture ------------------------------------------------------------------------------ */

static CUstreamCaptureStatus status_of(CUstream s)
{
    CUstreamCaptureStatus st = (CUstreamCaptureStatus)-1;
    OK(F.is_capturing(s, &st));
    return st;
}

static void test_capture_global(void **state)
{
    (void)state;
    CUstream s = NULL;
    OK(F.stream_create(&s, 0));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, F.begin_capture(NULL, CU_STREAM_CAPTURE_MODE_GLOBAL));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
       F.begin_capture(CU_STREAM_LEGACY, CU_STREAM_CAPTURE_MODE_GLOBAL));
    RC(CUDA_ERROR_INVALID_VALUE, F.begin_capture(s, (CUstreamCaptureMode)7));
    RC(CUDA_ERROR_INVALID_HANDLE, F.begin_capture((CUstream)&s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CUgraph g = NULL;
    RC(CUDA_ERROR_ILLEGAL_STATE, F.end_capture(s, &g));
    assert_int_equal(status_of(s), CU_STREAM_CAPTURE_STATUS_NONE);
    CUdeviceptr before = 0;
    OK(D->cuMemAlloc(&before, 4096));

    OK(F.begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    RC(CUDA_ERROR_ILLEGAL_STATE, F.begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    assert_int_equal(status_of(s), CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CUstreamCaptureStatus st;
    RC(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, F.is_capturing(NULL, &st));
    /* Allowed during capture: VMM, the stream-ordered allocator, work on the stream (recorded,
     * never run). */
    chunk_t m = chunk_new();
    CUdeviceptr q = 0;
    OK(F.alloc_async(&q, 256, s));
    OK(sim_launch_write(NULL, s, m.p, 16, 0x77));
    OK(D->cuMemFreeAsync(q, s));
    assert_int_equal(sim_pending_ops(), 0);
    unsigned long syncs = sim_sync_count(NULL);
    /* Refused, each invalidating the capture. */
    CUdeviceptr p = 0;
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, D->cuCtxSynchronize());
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, F.ctx_sync_v2(NULL));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, D->cuStreamSynchronize(NULL));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, D->cuStreamSynchronize(s));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, F.stream_query(s));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, D->cuMemAlloc(&p, 64));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, D->cuMemFree(before));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, D->cuMemFree(0));
    unsigned char buf[16] = {0};
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, F.dtoh(buf, before, 16));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, F.htod(before, buf, 16));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, D->cuMemcpyDtoD(before, before, 16));
    assert_int_equal(sim_capture_refusals(), 11);
    assert_int_equal(sim_sync_count(NULL), syncs); /* none of them synchronized */
    assert_int_equal(sim_live_native(), 2);          /* before, and q (its free was recorded) */
    assert_int_equal(status_of(s), CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    g = (CUgraph)1;
    RC(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, F.end_capture(s, &g));
    assert_null(g);
    assert_int_equal(status_of(s), CU_STREAM_CAPTURE_STATUS_NONE);
    /* After the capture everything works again, and the recorded kernel never ran. */
    OK(D->cuCtxSynchronize());
    assert_int_equal(byte_at(m.p), 0);
    OK(D->cuMemFree(q));
    OK(D->cuMemFree(before));
    chunk_free(m);
    OK(F.stream_destroy(s));
    assert_int_equal(sim_live_graphs(), 0);
    ledger_empty();
}

static void test_capture_relaxed_and_exchange(void **state)
{
    (void)state;
    CUstream s = NULL;
    OK(F.stream_create(&s, 0));
    /* A capture begun RELAXED forbids no potentially unsafe call... */
    OK(F.begin_capture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    CUdeviceptr p = 0;
    OK(D->cuMemAlloc(&p, 4096));
    OK(D->cuMemFree(p));
    CUgraph g = NULL;
    OK(F.end_capture(s, &g));
    assert_non_null(g);
    assert_int_equal(sim_live_graphs(), 1);
    OK(F.graph_destroy(g));
    RC(CUDA_ERROR_INVALID_VALUE, F.graph_destroy(g));

    /* ...but what necessarily conflicts with it is refused in every mode, and invalidates it:
     * synchronizing the context (what the hook did under PyTorch's relaxed capture, issue 14),
     * and, while a blocking stream captures, any use of the legacy stream. */
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    OK(F.exchange_mode(&mode));
    OK(F.begin_capture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    unsigned long syncs = sim_sync_count(NULL);
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, D->cuCtxSynchronize());
    assert_int_equal(sim_sync_count(NULL), syncs);
    RC(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, F.end_capture(s, &g));
    OK(F.begin_capture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, F.ctx_sync_v2(sim_primary_context(0)));
    RC(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, F.end_capture(s, &g));
    CUdeviceptr d = 0;
    OK(D->cuMemAlloc(&d, 4096));
    unsigned char buf[8] = {0};
    struct {
        const char *what;
        CUresult got;
    } legacy[8];
    int n = 0;
#define LEGACY(call)                                                  \
    do {                                                              \
        OK(F.begin_capture(s, CU_STREAM_CAPTURE_MODE_RELAXED));       \
        legacy[n].what = #call;                                       \
        legacy[n++].got = (call);                                     \
        RC(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, F.end_capture(s, &g)); \
    } while (0)
    LEGACY(F.htod(d, buf, 8));
    LEGACY(F.dtoh(buf, d, 8));
    LEGACY(D->cuMemcpyDtoD(d, d, 8));
    LEGACY(D->cuStreamSynchronize(NULL));
    LEGACY(F.stream_query(CU_STREAM_LEGACY));
    LEGACY(D->cuMemcpyDtoDAsync(d, d, 8, NULL));
    LEGACY(sim_launch_write(NULL, NULL, d, 8, 1));
#undef LEGACY
    for (int i = 0; i < n; i++) {
        if (legacy[i].got != CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
            fprintf(stderr, "%s -> %d\n", legacy[i].what, (int)legacy[i].got);
        assert_int_equal(legacy[i].got, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    }
    /* A non-blocking capturing stream leaves the legacy stream usable (not the context). */
    CUstream nb = NULL;
    OK(F.stream_create(&nb, CU_STREAM_NON_BLOCKING));
    OK(F.begin_capture(nb, CU_STREAM_CAPTURE_MODE_RELAXED));
    OK(F.htod(d, buf, 8));
    OK(D->cuStreamSynchronize(NULL));
    OK(sim_launch_write(NULL, NULL, d, 8, 1));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, D->cuCtxSynchronize());
    RC(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, F.end_capture(nb, &g));
    OK(F.stream_destroy(nb));
    OK(D->cuMemFree(d));
    OK(F.exchange_mode(&mode)); /* back to GLOBAL */

    /* PyTorch's case: its own GLOBAL capture, cudaMalloc under a RELAXED interaction mode. */
    OK(F.begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    OK(F.exchange_mode(&mode));
    assert_int_equal(mode, CU_STREAM_CAPTURE_MODE_GLOBAL); /* the default */
    OK(D->cuMemAlloc(&p, 4096));
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, D->cuStreamSynchronize(s)); /* in every mode */
    OK(F.exchange_mode(&mode));
    assert_int_equal(mode, CU_STREAM_CAPTURE_MODE_RELAXED);
    RC(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, F.end_capture(s, &g));

    OK(F.begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    OK(F.exchange_mode(&mode));
    OK(D->cuMemFree(p));
    OK(F.exchange_mode(&mode));
    OK(F.end_capture(s, &g)); /* still valid */
    OK(F.graph_destroy(g));
    mode = (CUstreamCaptureMode)9;
    RC(CUDA_ERROR_INVALID_VALUE, F.exchange_mode(&mode));
    RC(CUDA_ERROR_INVALID_VALUE, F.exchange_mode(NULL));
    OK(F.stream_destroy(s));
    ledger_empty();
}

/* What another thread's calls meet while the main thread captures on a non-blocking stream:
 * cuMemAlloc and a legacy-stream synchronization (governed by the interaction mode), and on
 * request a context synchronization (a conflict in every mode). */
typedef struct other {
    CUstreamCaptureMode interaction;
    CUresult alloc_rc, sync_rc, end_rc, ctx_sync_rc;
    CUstream end_stream;
    bool ctx_sync;
} other_t;

static void *other_thread(void *arg)
{
    other_t *o = arg;
    sim_set_current_device(0);
    CUstreamCaptureMode m = o->interaction;
    OK(F.exchange_mode(&m));
    CUdeviceptr p = 0;
    o->alloc_rc = D->cuMemAlloc(&p, 64);
    if (o->alloc_rc == CUDA_SUCCESS)
        OK(D->cuMemFree(p));
    o->sync_rc = D->cuStreamSynchronize(NULL);
    if (o->ctx_sync)
        o->ctx_sync_rc = D->cuCtxSynchronize();
    if (o->end_stream) {
        CUgraph g = NULL;
        o->end_rc = F.end_capture(o->end_stream, &g);
    }
    return NULL;
}

static other_t run_other_sync(CUstreamCaptureMode interaction, CUstream end_stream,
                              bool ctx_sync)
{
    other_t o = {interaction, CUDA_SUCCESS, CUDA_SUCCESS, CUDA_SUCCESS, CUDA_SUCCESS,
                 end_stream, ctx_sync};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, other_thread, &o), 0);
    pthread_join(th, NULL);
    return o;
}

static other_t run_other(CUstreamCaptureMode interaction, CUstream end_stream)
{
    return run_other_sync(interaction, end_stream, false);
}

static void test_capture_other_threads(void **state)
{
    (void)state;
    CUstream s = NULL;
    CUgraph g = NULL;
    OK(F.stream_create(&s, CU_STREAM_NON_BLOCKING));

    /* THREAD_LOCAL: other threads are not concerned. */
    OK(F.begin_capture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    other_t o = run_other(CU_STREAM_CAPTURE_MODE_GLOBAL, NULL);
    OK(o.alloc_rc);
    OK(o.sync_rc);
    assert_int_equal(status_of(s), CU_STREAM_CAPTURE_STATUS_ACTIVE);
    o = run_other(CU_STREAM_CAPTURE_MODE_GLOBAL, s); /* but only this thread may end it */
    RC(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, o.end_rc);
    OK(F.end_capture(s, &g));
    OK(F.graph_destroy(g));
    /* Synchronizing the context from another thread conflicts whatever the modes. */
    OK(F.begin_capture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    o = run_other_sync(CU_STREAM_CAPTURE_MODE_RELAXED, NULL, true);
    OK(o.alloc_rc);
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, o.ctx_sync_rc);
    RC(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, F.end_capture(s, &g));

    /* GLOBAL: another thread in GLOBAL interaction mode is refused, and its call invalidates. */
    OK(F.begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    o = run_other(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, NULL);
    OK(o.alloc_rc);
    OK(o.sync_rc);
    assert_int_equal(status_of(s), CU_STREAM_CAPTURE_STATUS_ACTIVE);
    o = run_other(CU_STREAM_CAPTURE_MODE_RELAXED, NULL);
    OK(o.alloc_rc);
    assert_int_equal(status_of(s), CU_STREAM_CAPTURE_STATUS_ACTIVE);
    unsigned long syncs = sim_sync_count(NULL);
    o = run_other(CU_STREAM_CAPTURE_MODE_GLOBAL, NULL);
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, o.alloc_rc);
    RC(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, o.sync_rc);
    assert_int_equal(sim_sync_count(NULL), syncs);
    assert_int_equal(status_of(s), CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    RC(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, F.end_capture(s, &g));

    /* RELAXED captures may be ended from any thread. */
    OK(F.begin_capture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    o = run_other(CU_STREAM_CAPTURE_MODE_GLOBAL, s);
    OK(o.alloc_rc);
    OK(o.end_rc);
    assert_int_equal(sim_live_graphs(), 1);
    OK(F.stream_destroy(s));
    ledger_empty();
}

/* ---- host, managed and pool memory -------------------------------------------------------- */

static void test_pinned_host_memory(void **state)
{
    (void)state;
    void *h = NULL;
    RC(CUDA_ERROR_INVALID_VALUE, F.host_alloc(&h, 0, 0));
    RC(CUDA_ERROR_INVALID_VALUE, F.host_alloc(&h, 4096, 0x10));
    OK(F.host_alloc(&h, 8192, CU_MEMHOSTALLOC_PORTABLE));
    assert_non_null(h);
    assert_int_equal(((unsigned char *)h)[8191], 0);
    assert_int_equal(sim_live_host(), 1);
    assert_int_equal(sim_host_pinned_bytes(), 8192);
    assert_false(sim_ledger_empty());
    RC(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, F.host_register(h, 4096, 0));
    unsigned char pageable[4096];
    memset(pageable, 0, sizeof pageable);
    RC(CUDA_ERROR_INVALID_VALUE, F.host_register(pageable, 0, 0));
    RC(CUDA_ERROR_INVALID_VALUE, F.host_register(pageable, sizeof pageable, 0x20));
    RC(CUDA_ERROR_INVALID_VALUE, F.free_host(pageable));
    RC(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, F.host_unregister(pageable));

    /* Async copies: pinned memory is read and written when the copy runs; pageable memory is
     * staged at the call (to the device) or copied before returning (from it). */
    CUdeviceptr d = 0;
    OK(D->cuMemAlloc(&d, 4096));
    memset(h, 1, 16);
    memset(pageable, 2, 16);
    OK(F.htod_async(d, h, 16, NULL));
    OK(F.htod_async(d + 16, pageable, 16, NULL));
    memset(h, 3, 16);
    memset(pageable, 4, 16);
    assert_int_equal(sim_pending_ops(), 2);
    OK(D->cuCtxSynchronize());
    assert_int_equal(byte_at(d), 3);
    assert_int_equal(byte_at(d + 16), 2);
    OK(sim_memset(d, 9, 32));
    OK(F.dtoh_async(pageable + 100, d, 1, NULL));
    assert_int_equal(pageable[100], 9);
    OK(F.dtoh_async((unsigned char *)h + 100, d, 1, NULL));
    assert_int_equal(((unsigned char *)h)[100], 0);
    OK(D->cuStreamSynchronize(NULL));
    assert_int_equal(((unsigned char *)h)[100], 9);

    /* Registration, and freeing pinned memory under a queued copy: a hazard. */
    OK(F.host_register(pageable, sizeof pageable, CU_MEMHOSTREGISTER_READ_ONLY));
    RC(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, F.host_register(pageable + 8, 8, 0));
    assert_int_equal(sim_host_pinned_bytes(), 8192 + sizeof pageable);
    RC(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, F.host_unregister(pageable + 8));
    OK(F.host_unregister(pageable));
    /* cuMemFreeHost waits for the calling thread's context, not for another one's copy. */
    OK(F.htod_async(d, h, 16, NULL));
    OK(F.free_host(h));
    assert_int_equal(sim_hazards(), 0);
    OK(F.host_alloc(&h, 4096, 0));
    CUcontext a = sim_primary_context(0), b = NULL;
    OK(F.ctx_create(&b, NULL, 0, 0));
    OK(F.htod_async(d, h, 16, NULL)); /* queued in b */
    OK(F.ctx_set_current(a));
    OK(F.free_host(h));
    assert_int_equal(sim_hazards(), 1);
    assert_int_equal(sim_pending_ops(), 0); /* dropped: its memory is gone */
    RC(CUDA_ERROR_INVALID_VALUE, F.free_host(h));
    OK(F.ctx_destroy(b));
    OK(D->cuMemFree(d));
    ledger_empty();
}

static void test_managed_and_pool(void **state)
{
    (void)state;
    CUdeviceptr m = 0, p = 0;
    RC(CUDA_ERROR_INVALID_VALUE, F.alloc_managed(&m, 4096, 0));
    RC(CUDA_ERROR_INVALID_VALUE, F.alloc_managed(&m, 0, CU_MEM_ATTACH_GLOBAL));
    OK(F.alloc_managed(&m, 4096, CU_MEM_ATTACH_GLOBAL));
    unsigned managed = 0;
    OK(D->cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, m));
    assert_int_equal(managed, 1);
    RC(CUDA_ERROR_OUT_OF_MEMORY, F.alloc_managed(&p, 64 * MB, CU_MEM_ATTACH_HOST));
    CUmemoryPool pool = (CUmemoryPool)&pool;
    RC(CUDA_ERROR_INVALID_VALUE, F.alloc_from_pool(&p, 4096, NULL, NULL));
    RC(CUDA_ERROR_INVALID_HANDLE, F.alloc_from_pool(&p, 4096, pool, (CUstream)&pool));
    RC(CUDA_ERROR_OUT_OF_MEMORY, F.alloc_from_pool(&p, 64 * MB, pool, NULL));
    OK(F.alloc_from_pool(&p, 4096, pool, NULL));
    OK(D->cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, p));
    assert_int_equal(managed, 0);
    assert_int_equal(sim_device_used(0), 8192);
    OK(D->cuMemFreeAsync(p, NULL));
    OK(D->cuMemFree(m));
    ledger_empty();
}

/* ---- fork --------------------------------------------------------------------------------- */

static atomic_int churning;

static void *churn(void *arg)
{
    (void)arg;
    sim_set_current_device(0);
    while (atomic_load(&churning)) {
        CUdeviceptr p = 0;
        if (D->cuMemAlloc(&p, 4096) == CUDA_SUCCESS)
            D->cuMemFree(p);
    }
    return NULL;
}

/* Forks n children while a thread churns; each child calls cuMemAlloc and cuMemFree once and
 * exits with 0 when both answered `want`. A child still blocked after 5 s is killed. Returns how
 * many children did not exit with 0. */
static int fork_children(int n, CUresult want)
{
    atomic_store(&churning, 1);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, churn, NULL), 0);
    int bad = 0;
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            alarm(5);
            CUdeviceptr p = 0;
            CUresult a = D->cuMemAlloc(&p, 64);
            CUresult f = D->cuMemFree(want == CUDA_SUCCESS ? p : 0x500000000000ULL);
            _exit(a == want && f == want ? 0 : 1);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        bad += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    atomic_store(&churning, 0);
    pthread_join(th, NULL);
    return bad;
}

static void test_fork_strict(void **state)
{
    (void)state;
    sim_set_fork_strict(true);
    assert_int_equal(fork_children(20, CUDA_ERROR_NOT_INITIALIZED), 0);
    assert_false(sim_in_forked_child());
    sim_set_fork_strict(false);
    ledger_empty();
}

static void test_fork_usable(void **state)
{
    (void)state;
    assert_int_equal(fork_children(20, CUDA_SUCCESS), 0);
    ledger_empty();
}

/* ---- ranges ------------------------------------------------------------------------------- */

static void test_range_mapped_bytes(void **state)
{
    (void)state;
    chunk_t a = chunk_new(), b = chunk_new();
    assert_int_equal(sim_range_mapped_bytes(a.p, G2), G2);
    assert_int_equal(sim_range_mapped_bytes(a.p + 4096, 8192), 8192);
    assert_int_equal(sim_range_mapped_bytes(a.p - G2, 2 * G2), G2);
    OK(D->cuMemUnmap(a.p, G2));
    assert_int_equal(sim_range_mapped_bytes(a.p, G2), 0);
    assert_int_equal(sim_range_mapped_bytes(b.p, G2), G2);
    OK(D->cuMemRelease(a.h));
    OK(D->cuMemAddressFree(a.p, G2));
    chunk_free(b);
    assert_int_equal(sim_range_mapped_bytes(b.p, G2), 0);
    ledger_empty();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_ctx_create_destroy, setup),
        cmocka_unit_test_setup(test_ctx_destroyed_while_current_elsewhere, setup),
        cmocka_unit_test_setup(test_ctx_create_versions, setup),
        cmocka_unit_test_setup(test_primary_reset, setup),
        cmocka_unit_test_setup(test_work_lands_per_context, setup),
        cmocka_unit_test_setup(test_native_free_lands_its_context, setup),
        cmocka_unit_test_setup(test_capture_global, setup),
        cmocka_unit_test_setup(test_capture_relaxed_and_exchange, setup),
        cmocka_unit_test_setup(test_capture_other_threads, setup),
        cmocka_unit_test_setup(test_pinned_host_memory, setup),
        cmocka_unit_test_setup(test_managed_and_pool, setup_small),
        cmocka_unit_test_setup(test_fork_strict, setup),
        cmocka_unit_test_setup(test_fork_usable, setup),
        cmocka_unit_test_setup(test_range_mapped_bytes, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
