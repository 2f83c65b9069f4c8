/* Interpose test: the entry points the library interposes only to watch or to help, reached the
 * way cudart reaches them (dlopen + cuGetProcAddress_v2), over the simulated driver.
 *
 *  - other allocators' out-of-memory: memory the library holds idle (a served buffer freed and
 *    cached) is given back when cuMemAllocAsync, cuMemAllocFromPoolAsync, managed memory or the
 *    program's own cuMemCreate run out, and the call is retried once: it succeeds as natively;
 *  - contexts: a context made with cuCtxCreate and destroyed with cuCtxDestroy; the library
 *    follows the calling thread's current context through both (cuMemGetInfo adds the idle
 *    memory of the current context's device, and only that device's);
 *  - capture: an allocation or a free during a global-mode capture gets the driver's refusal and
 *    the capture is invalidated, exactly as natively (the library does not serve it); in relaxed
 *    mode, or on a thread whose interaction mode is relaxed, it is served and the capture stays
 *    valid; another thread's thread-local capture does not stop this thread.
 *
 * Run twice by meson: "served" and "native" (VMMHOOK_DISABLE=1), with the same expectations for
 * every code, so that the codes the library gives are shown to be the driver's.
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <pthread.h>
#include <stdint.h>

#include "ip_common.h"
#include "simdrv.h"

#define GiB ((size_t)1 << 30)

static bool served;
static ip_driver_t driver; /* libcuda.so.1 opened, its controls, the library's lookups */

/* The entry points used, fetched through the library's cuGetProcAddress (ip_common.h). */
#define ENTRY_POINTS(X)                                                                            \
    X(cuDevicePrimaryCtxRetain, v7000) X(cuCtxSetCurrent, v4000) X(cuMemAlloc, v3020)              \
    X(cuMemFree, v3020) X(cuMemAllocAsync, v11020) X(cuMemFreeAsync, v11020)                       \
    X(cuMemCreate, v10020) X(cuMemRelease, v10020) X(cuMemAllocFromPoolAsync, v11020)              \
    X(cuMemAllocManaged, v6000) X(cuMemGetInfo, v3020) X(cuCtxDestroy, v4000)                      \
    X(cuDevicePrimaryCtxRelease, v11000) X(cuDevicePrimaryCtxReset, v11000)                        \
    X(cuCtxGetCurrent, v4000) X(cuStreamCreate, v2000) X(cuStreamDestroy, v4000)                   \
    X(cuStreamBeginCapture, v10010) X(cuStreamEndCapture, v10000) X(cuGraphDestroy, v10000)        \
    X(cuThreadExchangeStreamCaptureMode, v10010)
ENTRY_POINTS(IP_ENTRY_DECLARE)
static PFN_cuMemAllocAsync_v11020_ptsz p_cuMemAllocAsync_ptsz;
static PFN_cuCtxCreate_v12050 p_cuCtxCreate;
static PFN_cuStreamBeginCapture_v10010_ptsz p_cuStreamBeginCapture_ptsz;

/* A served buffer of `size` allocated and freed: the library keeps it idle for reuse (served
 * run), the driver takes it back (native run). */
static void hold_idle(size_t size)
{
    CUdeviceptr p = 0;
    CHECK_RC(p_cuMemAlloc(&p, size), CUDA_SUCCESS, "cuMemAlloc(%zu GiB)", size / GiB);
    CHECK(driver.vmm_owns((const void *)(uintptr_t)p) == (served ? 1 : 0), "%s",
          served ? "served" : "native");
    CHECK_RC(p_cuMemFree(p), CUDA_SUCCESS, "cuMemFree(%zu GiB)", size / GiB);
    size_t used = driver.sim.sim_device_used(0);
    CHECK(served ? used >= size : used < GiB, "after the free the device has %zu MiB in use (%s)",
          used >> 20, served ? "the library's cache holds it" : "native: given back");
}

static void check_other_allocators_oom(void)
{
    size_t cap = driver.sim.sim_device_capacity(0);
    CHECK(cap == 8 * GiB, "SIM_MEMORY=8G");

    /* cudaMallocAsync: 5 GiB cached by the library, 4 GiB asked from the pool. */
    hold_idle(5 * GiB);
    CUdeviceptr a = 0;
    CHECK_RC(p_cuMemAllocAsync(&a, 4 * GiB, NULL), CUDA_SUCCESS,
             "cuMemAllocAsync(4 GiB) with 5 GiB freed before (retried after a trim when served)");
    CHECK(a != 0 && driver.sim.sim_device_used(0) < 5 * GiB,
          "the pool got its memory; the cache was given back (%zu MiB in use)",
          driver.sim.sim_device_used(0) >> 20);
    CHECK_RC(p_cuMemFreeAsync(a, NULL), CUDA_SUCCESS, "cuMemFreeAsync(pool block)");

    /* The per-thread-stream flavour. */
    hold_idle(5 * GiB);
    CHECK_RC(p_cuMemAllocAsync_ptsz(&a, 4 * GiB, NULL), CUDA_SUCCESS,
             "cuMemAllocAsync_ptsz(4 GiB) with 5 GiB freed before");
    CHECK_RC(p_cuMemFreeAsync(a, NULL), CUDA_SUCCESS, "cuMemFreeAsync(pool block)");

    /* The program's own cuMemCreate (NCCL's buffers, an application's own VMM). */
    hold_idle(5 * GiB);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h = 0;
    CHECK_RC(p_cuMemCreate(&h, 4 * GiB, &prop, 0), CUDA_SUCCESS,
             "cuMemCreate(4 GiB) with 5 GiB freed before");
    CHECK_RC(p_cuMemRelease(h), CUDA_SUCCESS, "cuMemRelease");

    /* cuMemAllocFromPoolAsync (a pool of the program's) and managed memory. */
    hold_idle(5 * GiB);
    CHECK_RC(p_cuMemAllocFromPoolAsync(&a, 4 * GiB, (CUmemoryPool)0x1, NULL), CUDA_SUCCESS,
             "cuMemAllocFromPoolAsync(4 GiB) with 5 GiB freed before");
    CHECK_RC(p_cuMemFreeAsync(a, NULL), CUDA_SUCCESS, "cuMemFreeAsync(pool block)");
    hold_idle(5 * GiB);
    CHECK_RC(p_cuMemAllocManaged(&a, 4 * GiB, CU_MEM_ATTACH_GLOBAL), CUDA_SUCCESS,
             "cuMemAllocManaged(4 GiB) with 5 GiB freed before");
    CHECK_RC(p_cuMemFree(a), CUDA_SUCCESS, "cuMemFree(managed)");

    /* What cannot fit even after the trim is the driver's answer, retried once. */
    unsigned long creates = driver.sim.sim_calls("cuMemCreate");
    CHECK_RC(p_cuMemCreate(&h, 16 * GiB, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY,
             "cuMemCreate(16 GiB) on an 8 GiB device");
    CHECK(driver.sim.sim_calls("cuMemCreate") == creates + (served ? 2 : 1), "tried %s (%lu calls)",
          served ? "twice: once more after the trim" : "once",
          driver.sim.sim_calls("cuMemCreate") - creates);
}

/* cuMemGetInfo's free memory, and what the driver alone says of the device (the library adds
 * the memory it holds idle on the current context's device, only when it serves). */
static size_t info_free(void)
{
    size_t free = 0, total = 0;
    CHECK_RC(p_cuMemGetInfo(&free, &total), CUDA_SUCCESS, "cuMemGetInfo");
    return free;
}

static CUcontext current(void)
{
    CUcontext c = NULL;
    CHECK_RC(p_cuCtxGetCurrent(&c), CUDA_SUCCESS, "cuCtxGetCurrent");
    return c;
}

static void check_contexts(CUcontext ctx0, CUcontext ctx1)
{
    /* 1 GiB idle on device 1 (served), 2 GiB of a native block on device 0. */
    CHECK_RC(p_cuCtxSetCurrent(ctx1), CUDA_SUCCESS, "cuCtxSetCurrent(device 1)");
    CUdeviceptr p = 0;
    CHECK_RC(p_cuMemAlloc(&p, GiB), CUDA_SUCCESS, "cuMemAlloc(1 GiB) on device 1");
    CHECK_RC(p_cuMemFree(p), CUDA_SUCCESS, "cuMemFree");
    CHECK_RC(p_cuCtxSetCurrent(ctx0), CUDA_SUCCESS, "cuCtxSetCurrent(device 0)");
    CUdeviceptr native = 0;
    CHECK_RC(p_cuMemAllocAsync(&native, 2 * GiB, NULL), CUDA_SUCCESS,
             "cuMemAllocAsync(2 GiB) on device 0");
    CHECK_RC(p_cuCtxSetCurrent(ctx1), CUDA_SUCCESS, "cuCtxSetCurrent(device 1)");
    CHECK(info_free() == 8 * GiB, "device 1: all free (%s)",
          served ? "1 GiB used by the cache, counted as free" : "nothing used");

    /* A context of its own on device 0: current on this thread once made. */
    size_t live = driver.sim.sim_live_contexts();
    CUcontext mine = NULL;
    CHECK_RC(p_cuCtxCreate(&mine, NULL, 0, 0), CUDA_SUCCESS, "cuCtxCreate(device 0)");
    CHECK(mine != NULL && current() == mine && driver.sim.sim_live_contexts() == live + 1,
          "the new context is current");
    CHECK(info_free() == 6 * GiB,
          "cuMemGetInfo in it answers for device 0 (2 GiB used; nothing of device 1's cache)");
    CHECK_RC(p_cuMemAlloc(&p, 4096), CUDA_SUCCESS, "cuMemAlloc(4 KiB) in the new context");
    CHECK(driver.vmm_owns((const void *)(uintptr_t)p) == (served ? 1 : 0), "%s",
          served ? "served" : "native");
    CHECK_RC(p_cuMemFree(p), CUDA_SUCCESS, "cuMemFree");

    /* Destroyed: the previous context (device 1) is current again. */
    CHECK_RC(p_cuCtxDestroy(mine), CUDA_SUCCESS, "cuCtxDestroy");
    CHECK(current() == ctx1 && driver.sim.sim_live_contexts() == live,
          "device 1's context is current");
    CHECK(info_free() == 8 * GiB, "cuMemGetInfo answers for device 1 again");
    CHECK_RC(p_cuCtxDestroy(mine), CUDA_ERROR_INVALID_CONTEXT, "cuCtxDestroy again");

    CHECK_RC(p_cuCtxSetCurrent(ctx0), CUDA_SUCCESS, "cuCtxSetCurrent(device 0)");
    CHECK_RC(p_cuMemFreeAsync(native, NULL), CUDA_SUCCESS, "cuMemFreeAsync(native block)");

    /* Every ABI of cuCtxCreate the driver answers by version is the library's wrapper of that
     * ABI, and each makes a context current on device 1, which cuMemGetInfo then answers for
     * (device 1 has its 1 GiB idle in the cache: free throughout when served). */
    static const struct {
        int version;
        const char *exported;
    } abis[] = {{11030, "cuCtxCreate_v2"}, {12000, "cuCtxCreate_v3"}, {13000, "cuCtxCreate_v4"}};
    for (size_t i = 0; i < sizeof abis / sizeof abis[0]; i++) {
        void *fn = ip_fetch(driver.getproc, "cuCtxCreate", abis[i].version, 0);
        CHECK(ip_in_hook(fn) && fn == ip_need_dlsym(driver.libcuda, abis[i].exported),
              "cuGetProcAddress(cuCtxCreate, %d) -> the library's %s", abis[i].version,
              abis[i].exported);
        CUcontext c = NULL;
        CUresult r;
        if (i == 0)
            r = ((PFN_cuCtxCreate_v3020)fn)(&c, 0, 1);
        else if (i == 1)
            r = ((PFN_cuCtxCreate_v11040)fn)(&c, NULL, 0, 0, 1);
        else
            r = ((PFN_cuCtxCreate_v12050)fn)(&c, NULL, 0, 1);
        CHECK_RC(r, CUDA_SUCCESS, "%s(device 1)", abis[i].exported);
        CHECK(c != NULL && current() == c, "%s: the new context is current", abis[i].exported);
        CHECK(info_free() == 8 * GiB, "cuMemGetInfo answers for device 1");
        CHECK_RC(p_cuCtxDestroy(c), CUDA_SUCCESS, "cuCtxDestroy");
        CHECK(current() == ctx0, "device 0's context is current again");
        CHECK(info_free() == 8 * GiB, "cuMemGetInfo answers for device 0");
    }

    /* Device 1's primary context retained once more and released, then reset (cudaDeviceReset):
     * the driver's codes; afterwards device 1 serves again once its context is current. */
    CUcontext again = NULL;
    CHECK_RC(p_cuDevicePrimaryCtxRetain(&again, 1), CUDA_SUCCESS, "cuDevicePrimaryCtxRetain(1)");
    CHECK(again == ctx1, "the same primary context");
    CHECK_RC(p_cuDevicePrimaryCtxRelease(1), CUDA_SUCCESS, "cuDevicePrimaryCtxRelease_v2(1)");
    CHECK_RC(p_cuDevicePrimaryCtxReset(1), CUDA_SUCCESS, "cuDevicePrimaryCtxReset_v2(1)");
    CHECK_RC(p_cuDevicePrimaryCtxRetain(&again, 1), CUDA_SUCCESS, "cuDevicePrimaryCtxRetain(1)");
    CHECK_RC(p_cuCtxSetCurrent(again), CUDA_SUCCESS, "cuCtxSetCurrent(device 1)");
    CHECK_RC(p_cuMemAlloc(&p, 3 << 20), CUDA_SUCCESS, "cuMemAlloc(3 MiB) on device 1");
    CHECK(driver.vmm_owns((const void *)(uintptr_t)p) == (served ? 1 : 0), "%s",
          served ? "served" : "native");
    CHECK_RC(p_cuMemFree(p), CUDA_SUCCESS, "cuMemFree");
    CHECK_RC(p_cuCtxSetCurrent(ctx0), CUDA_SUCCESS, "cuCtxSetCurrent(device 0)");
}

/* Another thread's capture of `stream` in `mode`, held until told to end. */
typedef struct other_capture {
    CUstream stream;
    CUstreamCaptureMode mode;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int step; /* 1: begun, 2: end it, 3: ended */
    CUresult begin_rc, end_rc;
} other_capture_t;

static void step_to(other_capture_t *o, int step)
{
    pthread_mutex_lock(&o->lock);
    o->step = step;
    pthread_cond_broadcast(&o->cond);
    pthread_mutex_unlock(&o->lock);
}

static void wait_for(other_capture_t *o, int step)
{
    pthread_mutex_lock(&o->lock);
    while (o->step < step)
        pthread_cond_wait(&o->cond, &o->lock);
    pthread_mutex_unlock(&o->lock);
}

static void *other_capture_main(void *p)
{
    other_capture_t *o = p;
    o->begin_rc = p_cuStreamBeginCapture(o->stream, o->mode);
    step_to(o, 1);
    wait_for(o, 2);
    CUgraph g = NULL;
    o->end_rc = p_cuStreamEndCapture(o->stream, &g);
    if (g != NULL)
        p_cuGraphDestroy(g);
    step_to(o, 3);
    return NULL;
}

static void other_begin(other_capture_t *o, pthread_t *th, CUstream s, CUstreamCaptureMode mode)
{
    *o = (other_capture_t){.stream = s, .mode = mode, .step = 0};
    pthread_mutex_init(&o->lock, NULL);
    pthread_cond_init(&o->cond, NULL);
    if (pthread_create(th, NULL, other_capture_main, o) != 0) {
        printf("FAIL pthread_create\n");
        exit(1);
    }
    wait_for(o, 1);
}

static CUresult other_end(other_capture_t *o, pthread_t th)
{
    step_to(o, 2);
    pthread_join(th, NULL);
    return o->end_rc;
}

/* An allocation of 1 MiB during a capture: its code; a success is freed at once and must be
 * served when the library serves. */
static CUresult alloc_during_capture(const char *what)
{
    CUdeviceptr p = 0;
    CUresult r = p_cuMemAlloc(&p, 1 << 20);
    if (r == CUDA_SUCCESS) {
        CHECK(driver.vmm_owns((const void *)(uintptr_t)p) == (served ? 1 : 0), "%s: %s", what,
              served ? "served" : "native");
        p_cuMemFree(p);
    }
    return r;
}

static void check_capture(void)
{
    CUstream s = NULL, s2 = NULL;
    CHECK_RC(p_cuStreamCreate(&s, 0), CUDA_SUCCESS, "cuStreamCreate");
    CHECK_RC(p_cuStreamCreate(&s2, 0), CUDA_SUCCESS, "cuStreamCreate");
    CUgraph g = NULL;
    unsigned long refusals = driver.sim.sim_capture_refusals();

    /* A buffer freed during a global-mode capture: refused as natively, the capture
     * invalidated, the buffer still allocated (freed after the capture). */
    CUdeviceptr kept = 0;
    CHECK_RC(p_cuMemAlloc(&kept, 1 << 20), CUDA_SUCCESS, "cuMemAlloc(1 MiB) before a capture");
    CHECK_RC(p_cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS,
             "cuStreamBeginCapture(global)");
    CHECK_RC(p_cuMemFree(kept), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
             "cuMemFree during a global-mode capture (the driver's refusal)");
    CHECK(driver.sim.sim_capture_refusals() == refusals + 1, "the driver saw and refused it");
    CHECK_RC(p_cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
             "cuStreamEndCapture: invalidated, as natively");
    CHECK(driver.vmm_owns((const void *)(uintptr_t)kept) == (served ? 1 : 0),
          "the buffer is still allocated");
    CHECK_RC(p_cuMemFree(kept), CUDA_SUCCESS, "cuMemFree after the capture");
    refusals = driver.sim.sim_capture_refusals();

    /* Global mode, own capture: the driver refuses cuMemAlloc and invalidates the capture. */
    CHECK_RC(p_cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS,
             "cuStreamBeginCapture(global)");
    CHECK_RC(alloc_during_capture("global"), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
             "cuMemAlloc during a global-mode capture (the driver's refusal)");
    CHECK(driver.sim.sim_capture_refusals() == refusals + 1, "the driver saw and refused it");
    CHECK_RC(p_cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
             "cuStreamEndCapture: invalidated, as natively");
    CHECK_RC(alloc_during_capture("after the capture"), CUDA_SUCCESS, "cuMemAlloc after it");

    /* Relaxed capture: allowed, served, the capture stays valid. */
    CHECK_RC(p_cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS,
             "cuStreamBeginCapture(relaxed)");
    CHECK_RC(alloc_during_capture("relaxed"), CUDA_SUCCESS, "cuMemAlloc during a relaxed capture");
    g = NULL;
    CHECK_RC(p_cuStreamEndCapture(s, &g), CUDA_SUCCESS, "cuStreamEndCapture: a valid graph");
    CHECK(g != NULL, "a graph");
    if (g != NULL)
        p_cuGraphDestroy(g);

    /* The per-thread-stream flavour of the begin, thread-local mode. */
    CHECK_RC(p_cuStreamBeginCapture_ptsz(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), CUDA_SUCCESS,
             "cuStreamBeginCapture_v2_ptsz(thread-local)");
    CHECK_RC(alloc_during_capture("thread-local"), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
             "cuMemAlloc during its own thread-local capture");
    g = NULL;
    CHECK_RC(p_cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
             "cuStreamEndCapture: invalidated");

    /* Another thread's global capture: refused here in global mode, served in relaxed mode. */
    other_capture_t o;
    pthread_t th;
    other_begin(&o, &th, s2, CU_STREAM_CAPTURE_MODE_GLOBAL);
    CHECK_RC(o.begin_rc, CUDA_SUCCESS, "another thread: cuStreamBeginCapture(global)");
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    CHECK_RC(p_cuThreadExchangeStreamCaptureMode(&mode), CUDA_SUCCESS,
             "cuThreadExchangeStreamCaptureMode(relaxed)");
    CHECK(mode == CU_STREAM_CAPTURE_MODE_GLOBAL, "the previous mode was global");
    CHECK_RC(alloc_during_capture("relaxed thread"), CUDA_SUCCESS,
             "cuMemAlloc on a relaxed thread during another's global capture");
    CHECK_RC(p_cuThreadExchangeStreamCaptureMode(&mode), CUDA_SUCCESS,
             "cuThreadExchangeStreamCaptureMode(back to global)");
    CHECK_RC(alloc_during_capture("global thread"), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
             "cuMemAlloc on a global thread during another's global capture");
    CHECK_RC(other_end(&o, th), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
             "the other thread's capture was invalidated, as natively");

    /* Another thread's thread-local capture does not concern this thread. */
    other_begin(&o, &th, s2, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    CHECK_RC(alloc_during_capture("beside a thread-local capture"), CUDA_SUCCESS,
             "cuMemAlloc beside another thread's thread-local capture");
    CHECK_RC(other_end(&o, th), CUDA_SUCCESS, "its capture stays valid");

    /* A capturing stream destroyed without cuStreamEndCapture: its capture is over (the
     * driver drops it with the stream), so allocations are served again. */
    CUstream doomed = NULL;
    CHECK_RC(p_cuStreamCreate(&doomed, 0), CUDA_SUCCESS, "cuStreamCreate");
    CHECK_RC(p_cuStreamBeginCapture(doomed, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS,
             "cuStreamBeginCapture(global)");
    CHECK_RC(p_cuStreamDestroy(doomed), CUDA_SUCCESS, "cuStreamDestroy of a capturing stream");
    CHECK_RC(alloc_during_capture("after a capturing stream was destroyed"), CUDA_SUCCESS,
             "cuMemAlloc once the capturing stream is gone");

    CHECK_RC(alloc_during_capture("after everything"), CUDA_SUCCESS, "cuMemAlloc at the end");
    CHECK_RC(p_cuStreamDestroy(s), CUDA_SUCCESS, "cuStreamDestroy");
    CHECK_RC(p_cuStreamDestroy(s2), CUDA_SUCCESS, "cuStreamDestroy");
}

int main(int argc, char **argv)
{
    served = ip_served_arg(argc, argv, "ip_contexts");

    driver = ip_open_driver();

    PFN_cuGetProcAddress_v12000 getproc = driver.getproc;
    ENTRY_POINTS(IP_ENTRY_FETCH)
    p_cuMemAllocAsync_ptsz =
        ip_fetch(getproc, "cuMemAllocAsync", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
    p_cuCtxCreate = ip_fetch(getproc, "cuCtxCreate", 13000, 0);
    p_cuStreamBeginCapture_ptsz = ip_fetch(getproc, "cuStreamBeginCapture", 12000,
                                           CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
    CHECK(ip_in_hook((void *)p_cuMemAllocAsync) && ip_in_hook((void *)p_cuMemAllocAsync_ptsz) &&
              ip_in_hook((void *)p_cuMemCreate) && p_cuMemAllocAsync != p_cuMemAllocAsync_ptsz,
          "cuMemAllocAsync (both flavours) and cuMemCreate are the library's wrappers");
    CHECK(ip_in_hook((void *)p_cuCtxCreate) && ip_in_hook((void *)p_cuCtxDestroy) &&
              ip_in_hook((void *)p_cuStreamBeginCapture) &&
              ip_in_hook((void *)p_cuStreamBeginCapture_ptsz) &&
              p_cuStreamBeginCapture != p_cuStreamBeginCapture_ptsz &&
              ip_in_hook((void *)p_cuStreamEndCapture) &&
              ip_in_hook((void *)p_cuThreadExchangeStreamCaptureMode) &&
              ip_in_hook((void *)p_cuStreamDestroy) &&
              ip_in_hook((void *)p_cuMemAllocFromPoolAsync) &&
              ip_in_hook((void *)p_cuMemAllocManaged) && ip_in_hook((void *)p_cuStreamCreate) &&
              !ip_in_hook((void *)p_cuGraphDestroy),
          "the context, stream, capture and allocator entry points are the library's wrappers; "
          "cuGraphDestroy is the driver's");

    CUcontext ctx[2];
    ip_two_primary_contexts(driver.getproc, ctx);

    check_other_allocators_oom();
    check_contexts(ctx[0], ctx[1]);
    check_capture();

    driver.vmm_trim();
    CHECK(driver.sim.sim_ledger_empty(), "at the end the driver holds nothing");
    return ip_finish(served ? "ip_contexts served" : "ip_contexts native");
}
