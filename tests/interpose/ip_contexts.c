/* Interpose test: the entry points the library interposes only to watch or to help, reached the
 * way cudart reaches them (dlopen + cuGetProcAddress_v2), over the simulated driver.
 *
 *  - other allocators' out-of-memory: memory the library holds idle (a served buffer freed and
 *    cached) is given back when cuMemAllocAsync or the program's own cuMemCreate run out, and
 *    the call is retried once: it succeeds as natively.
 *
 * Run twice by meson: "served" and "native" (VMMHOOK_DISABLE=1), with the same expectations for
 * every code, so that the codes the library gives are shown to be the driver's.
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <stdint.h>

#include "ip_common.h"
#include "simdrv.h"

#define GiB ((size_t)1 << 30)

static bool served;
static void *libcuda;

#define SIM_FNS(X) X(sim_device_used) X(sim_device_capacity) X(sim_calls) X(sim_ledger_empty)
#define SIM_FIELD(n) __typeof__(&n) n;
static struct {
    SIM_FNS(SIM_FIELD)
} sim;
#undef SIM_FIELD

static PFN_cuGetProcAddress_v12000 getproc;
static int (*vmm_owns_fn)(const void *);
static size_t (*vmm_trim_fn)(void);

static PFN_cuInit_v2000 p_cuInit;
static PFN_cuDevicePrimaryCtxRetain_v7000 p_cuDevicePrimaryCtxRetain;
static PFN_cuCtxSetCurrent_v4000 p_cuCtxSetCurrent;
static PFN_cuMemAlloc_v3020 p_cuMemAlloc;
static PFN_cuMemFree_v3020 p_cuMemFree;
static PFN_cuMemAllocAsync_v11020 p_cuMemAllocAsync;
static PFN_cuMemAllocAsync_v11020_ptsz p_cuMemAllocAsync_ptsz;
static PFN_cuMemFreeAsync_v11020 p_cuMemFreeAsync;
static PFN_cuMemCreate_v10020 p_cuMemCreate;
static PFN_cuMemRelease_v10020 p_cuMemRelease;

static void *need_dlsym(void *h, const char *name)
{
    void *p = dlsym(h, name);
    if (!p) {
        printf("FAIL dlsym(%s): %s\n", name, dlerror());
        exit(1);
    }
    return p;
}

static void *fetch(const char *name, int version, cuuint64_t flags)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    CUresult rc = getproc(name, &fn, version, flags, &st);
    if (rc != CUDA_SUCCESS || !fn) {
        printf("FAIL cuGetProcAddress(%s, %d, %llu) -> %d\n", name, version,
               (unsigned long long)flags, rc);
        exit(1);
    }
    return fn;
}

/* A served buffer of `size` allocated and freed: the library keeps it idle for reuse (served
 * run), the driver takes it back (native run). */
static void hold_idle(size_t size)
{
    CUdeviceptr p = 0;
    CHECK_RC(p_cuMemAlloc(&p, size), CUDA_SUCCESS, "cuMemAlloc(%zu GiB)", size / GiB);
    CHECK(vmm_owns_fn((const void *)(uintptr_t)p) == (served ? 1 : 0), "%s",
          served ? "served" : "native");
    CHECK_RC(p_cuMemFree(p), CUDA_SUCCESS, "cuMemFree(%zu GiB)", size / GiB);
    size_t used = sim.sim_device_used(0);
    CHECK(served ? used >= size : used < GiB,
          "after the free the device has %zu MiB in use (%s)", used >> 20,
          served ? "the library's cache holds it" : "native: given back");
}

static void check_other_allocators_oom(void)
{
    size_t cap = sim.sim_device_capacity(0);
    CHECK(cap == 8 * GiB, "SIM_MEMORY=8G");

    /* cudaMallocAsync: 5 GiB cached by the library, 4 GiB asked from the pool. */
    hold_idle(5 * GiB);
    CUdeviceptr a = 0;
    CHECK_RC(p_cuMemAllocAsync(&a, 4 * GiB, NULL), CUDA_SUCCESS,
             "cuMemAllocAsync(4 GiB) with 5 GiB freed before (retried after a trim when served)");
    CHECK(a != 0 && sim.sim_device_used(0) < 5 * GiB,
          "the pool got its memory; the cache was given back (%zu MiB in use)",
          sim.sim_device_used(0) >> 20);
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

    /* What cannot fit even after the trim is the driver's answer, retried once. */
    unsigned long creates = sim.sim_calls("cuMemCreate");
    CHECK_RC(p_cuMemCreate(&h, 16 * GiB, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY,
             "cuMemCreate(16 GiB) on an 8 GiB device");
    CHECK(sim.sim_calls("cuMemCreate") == creates + (served ? 2 : 1),
          "tried %s (%lu calls)", served ? "twice: once more after the trim" : "once",
          sim.sim_calls("cuMemCreate") - creates);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    ip_require_preloaded();
    if (argc < 2 || (strcmp(argv[1], "served") != 0 && strcmp(argv[1], "native") != 0)) {
        printf("FAIL usage: ip_contexts served|native\n");
        return 1;
    }
    served = strcmp(argv[1], "served") == 0;

    libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!libcuda) {
        printf("FAIL dlopen(libcuda.so.1): %s\n", dlerror());
        return 1;
    }
#define SIM_GET(n) sim.n = (__typeof__(sim.n))need_dlsym(libcuda, #n);
    SIM_FNS(SIM_GET)
#undef SIM_GET
    getproc = (PFN_cuGetProcAddress_v12000)need_dlsym(libcuda, "cuGetProcAddress_v2");
    vmm_owns_fn = (int (*)(const void *))need_dlsym(RTLD_DEFAULT, "vmm_owns");
    vmm_trim_fn = (size_t(*)(void))need_dlsym(RTLD_DEFAULT, "vmm_trim");

    p_cuInit = fetch("cuInit", 12000, 0);
    p_cuDevicePrimaryCtxRetain = fetch("cuDevicePrimaryCtxRetain", 12000, 0);
    p_cuCtxSetCurrent = fetch("cuCtxSetCurrent", 12000, 0);
    p_cuMemAlloc = fetch("cuMemAlloc", 12000, 0);
    p_cuMemFree = fetch("cuMemFree", 12000, 0);
    p_cuMemAllocAsync = fetch("cuMemAllocAsync", 12000, 0);
    p_cuMemAllocAsync_ptsz =
        fetch("cuMemAllocAsync", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
    p_cuMemFreeAsync = fetch("cuMemFreeAsync", 12000, 0);
    p_cuMemCreate = fetch("cuMemCreate", 12000, 0);
    p_cuMemRelease = fetch("cuMemRelease", 12000, 0);
    CHECK(ip_in_hook((void *)p_cuMemAllocAsync) && ip_in_hook((void *)p_cuMemAllocAsync_ptsz) &&
              ip_in_hook((void *)p_cuMemCreate) && p_cuMemAllocAsync != p_cuMemAllocAsync_ptsz,
          "cuMemAllocAsync (both flavours) and cuMemCreate are the library's wrappers");

    CUcontext ctx0;
    CHECK_RC(p_cuInit(0), CUDA_SUCCESS, "cuInit");
    CHECK_RC(p_cuDevicePrimaryCtxRetain(&ctx0, 0), CUDA_SUCCESS, "cuDevicePrimaryCtxRetain(0)");
    CHECK_RC(p_cuCtxSetCurrent(ctx0), CUDA_SUCCESS, "cuCtxSetCurrent(device 0)");

    check_other_allocators_oom();

    vmm_trim_fn();
    CHECK(sim.sim_ledger_empty(), "at the end the driver holds nothing");
    return ip_finish(served ? "ip_contexts served" : "ip_contexts native");
}
