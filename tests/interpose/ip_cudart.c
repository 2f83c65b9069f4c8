/* Interpose test 1: a program that reaches the driver the way cudart does.
 *
 * dlopen("libcuda.so.1") (the simulated driver), dlsym(h, "cuGetProcAddress_v2"), then every
 * entry point through it, with the versions (11030, 12000, 13000) and flags (0, per-thread
 * stream) that cudart uses. Run twice by meson: "served" (the library serves allocations) and
 * "native" (VMMHOOK_DISABLE=1: everything passes through), with the same expectations for every
 * code, so that the codes the library gives are shown to be the driver's.
 *
 * What it checks, in order:
 *  - lookups: which requests get the library's wrappers (only the ABIs it implements, by
 *    version and stream flavour) and that every other answer, code and symbolStatus is exactly
 *    the driver's; nested cuGetProcAddress stays hooked; nothing is initialised and nothing is
 *    printed by lookups (VMMHOOK_VERBOSE=1 is set: option parsing would print);
 *  - allocations are served (VMM mappings in the simulated driver, vmm_owns) or native;
 *  - interior pointer queries answer the buffer (base, requested size), not a chunk;
 *  - bad inputs give the native codes; the application's own cuMemCreate/cuMemMap pass through
 *    (cuMemCreate through the library's wrapper, which only retries it when out of memory);
 *  - stream-ordered frees in both stream flavours, cuMemAllocAsync passed through (wrapped);
 *  - cuMemGetInfo counts the library's idle cache as free; IPC on served memory; peer access;
 *  - a fork child that does not use CUDA is fine; at exit, after vmm_trim, nothing is left in
 *    the simulated driver (no allocation, reservation, mapping or native block).
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <pthread.h>
#include <stdint.h>
#include <sys/wait.h>

#include "ip_common.h"
#include "simdrv.h"

#ifndef IPT_CUDAUSER_PATH
#error "IPT_CUDAUSER_PATH: the path of libipt_cudauser.so (set by meson.build)"
#endif

#define MiB ((size_t)1 << 20)
#define PTDS CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
#define LEGACY CU_GET_PROC_ADDRESS_LEGACY_STREAM

static bool served; /* what this run expects */
static ip_driver_t driver; /* libcuda.so.1 opened, its controls, the library's lookups */

/* Driver entry points, fetched through getproc as cudart does. */
static PFN_cuDevicePrimaryCtxRetain_v7000 p_cuDevicePrimaryCtxRetain;
static PFN_cuCtxSetCurrent_v4000 p_cuCtxSetCurrent;
static PFN_cuMemAlloc_v3020 p_cuMemAlloc;
static PFN_cuMemAllocPitch_v3020 p_cuMemAllocPitch;
static PFN_cuMemFree_v3020 p_cuMemFree;
static PFN_cuMemFreeAsync_v11020 p_cuMemFreeAsync;
static PFN_cuMemFreeAsync_v11020_ptsz p_cuMemFreeAsync_ptsz;
static PFN_cuMemAllocAsync_v11020 p_cuMemAllocAsync;
static PFN_cuMemAllocAsync_v11020_ptsz p_cuMemAllocAsync_ptsz;
static PFN_cuMemGetAddressRange_v3020 p_cuMemGetAddressRange;
static PFN_cuPointerGetAttribute_v4000 p_cuPointerGetAttribute;
static PFN_cuPointerGetAttributes_v7000 p_cuPointerGetAttributes;
static PFN_cuMemGetInfo_v3020 p_cuMemGetInfo;
static PFN_cuIpcGetMemHandle_v4010 p_cuIpcGetMemHandle;
static PFN_cuIpcCloseMemHandle_v4010 p_cuIpcCloseMemHandle;
static PFN_cuCtxEnablePeerAccess_v4000 p_cuCtxEnablePeerAccess;
static PFN_cuCtxDisablePeerAccess_v4000 p_cuCtxDisablePeerAccess;
static PFN_cuMemCreate_v10020 p_cuMemCreate;
static PFN_cuMemRelease_v10020 p_cuMemRelease;
static PFN_cuMemAddressReserve_v10020 p_cuMemAddressReserve;
static PFN_cuMemAddressFree_v10020 p_cuMemAddressFree;
static PFN_cuMemMap_v10020 p_cuMemMap;
static PFN_cuMemUnmap_v10020 p_cuMemUnmap;
static PFN_cuMemSetAccess_v10020 p_cuMemSetAccess;
static PFN_cuStreamCreate_v2000 p_cuStreamCreate;
static PFN_cuStreamDestroy_v4000 p_cuStreamDestroy;

/* The driver's own function for a request (what the program would get without the library). */
static void *driver_fn(const char *name)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    return driver.sim.sim_get_proc_address(name, &fn, 13000, 0, &st) == CUDA_SUCCESS ? fn : NULL;
}

static bool owned(CUdeviceptr p)
{
    return driver.vmm_owns((const void *)(uintptr_t)p) != 0;
}

/* ---- lookups ---------------------------------------------------------------------------- */

/* base name, the exported name of the ABI the library implements (NULL: not interposed), the
 * same for the per-thread flavour, and the version that ABI appeared in. */
static const struct {
    const char *name;
    const char *ours;
    const char *ours_ptsz;
    int since;
} lookups[] = {
    {"cuMemAlloc", "cuMemAlloc_v2", "cuMemAlloc_v2", 3020},
    {"cuMemAllocPitch", "cuMemAllocPitch_v2", "cuMemAllocPitch_v2", 3020},
    {"cuMemFree", "cuMemFree_v2", "cuMemFree_v2", 3020},
    {"cuMemFreeAsync", "cuMemFreeAsync", "cuMemFreeAsync_ptsz", 11020},
    {"cuMemGetAddressRange", "cuMemGetAddressRange_v2", "cuMemGetAddressRange_v2", 3020},
    {"cuPointerGetAttribute", "cuPointerGetAttribute", "cuPointerGetAttribute", 4000},
    {"cuPointerGetAttributes", "cuPointerGetAttributes", "cuPointerGetAttributes", 7000},
    {"cuMemGetInfo", "cuMemGetInfo_v2", "cuMemGetInfo_v2", 3020},
    {"cuIpcGetMemHandle", "cuIpcGetMemHandle", "cuIpcGetMemHandle", 4010},
    {"cuIpcOpenMemHandle", "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle_v2", 11000},
    {"cuIpcCloseMemHandle", "cuIpcCloseMemHandle", "cuIpcCloseMemHandle", 4010},
    {"cuCtxEnablePeerAccess", "cuCtxEnablePeerAccess", "cuCtxEnablePeerAccess", 4000},
    {"cuCtxDisablePeerAccess", "cuCtxDisablePeerAccess", "cuCtxDisablePeerAccess", 4000},
    {"cuCtxSetCurrent", "cuCtxSetCurrent", "cuCtxSetCurrent", 4000},
    {"cuCtxPushCurrent", "cuCtxPushCurrent_v2", "cuCtxPushCurrent_v2", 4000},
    {"cuCtxPopCurrent", "cuCtxPopCurrent_v2", "cuCtxPopCurrent_v2", 4000},
    {"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", 7000},
    {"cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease_v2",
     11000},
    {"cuDevicePrimaryCtxReset", "cuDevicePrimaryCtxReset_v2", "cuDevicePrimaryCtxReset_v2",
     11000},
    {"cuCtxDestroy", "cuCtxDestroy_v2", "cuCtxDestroy_v2", 4000},
    {"cuStreamBeginCapture", "cuStreamBeginCapture_v2", "cuStreamBeginCapture_v2_ptsz", 10010},
    {"cuStreamEndCapture", "cuStreamEndCapture", "cuStreamEndCapture_ptsz", 10000},
    {"cuThreadExchangeStreamCaptureMode", "cuThreadExchangeStreamCaptureMode",
     "cuThreadExchangeStreamCaptureMode", 10010},
    {"cuMemCreate", "cuMemCreate", "cuMemCreate", 10020},
    {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", 11020},
    {"cuMemAllocManaged", "cuMemAllocManaged", "cuMemAllocManaged", 6000},
    {"cuStreamCreate", "cuStreamCreate", "cuStreamCreate", 2000},
    {"cuStreamCreateWithPriority", "cuStreamCreateWithPriority", "cuStreamCreateWithPriority",
     5050},
    {"cuStreamDestroy", "cuStreamDestroy_v2", "cuStreamDestroy_v2", 4000},
    {"cuMemAllocAsync", "cuMemAllocAsync", "cuMemAllocAsync_ptsz", 11020},
    {"cuInit", NULL, NULL, 2000},
    {"cuDeviceGet", NULL, NULL, 2000},
    {"cuMemMap", NULL, NULL, 10020},
    {"cuMemAddressReserve", NULL, NULL, 10020},
    {"cuStreamSynchronize", NULL, NULL, 2000},
    {"cuNoSuchEntryPoint", NULL, NULL, 2000},
};

static void check_lookups(void)
{
    static const int versions[] = {2000, 3010, 3020, 11010, 11030, 12000, 13000, 13010, 14000};
    static const cuuint64_t flagsets[] = {0, PTDS, LEGACY, PTDS | LEGACY};
    for (size_t i = 0; i < sizeof lookups / sizeof lookups[0]; i++) {
        int bad = 0, hooked = 0;
        char why[256] = "";
        for (size_t v = 0; v < sizeof versions / sizeof versions[0]; v++) {
            for (size_t f = 0; f < sizeof flagsets / sizeof flagsets[0]; f++) {
                int ver = versions[v];
                cuuint64_t fl = flagsets[f];
                void *got = (void *)1, *drv = (void *)1;
                CUdriverProcAddressQueryResult st = 99, dst = 99;
                CUresult rc = driver.getproc(lookups[i].name, &got, ver, fl, &st);
                CUresult drc =
                    driver.sim.sim_get_proc_address(lookups[i].name, &drv, ver, fl, &dst);
                void *want = drv;
                if (drc == CUDA_SUCCESS && lookups[i].ours && ver >= lookups[i].since) {
                    /* PER_THREAD picks the _ptsz function; LEGACY excludes it. The simulated
                     * driver has one function for both, so both bits at once get _ptsz. */
                    const char *exp = (fl & PTDS) ? lookups[i].ours_ptsz : lookups[i].ours;
                    want = ip_need_dlsym(driver.libcuda, exp);
                }
                if (rc != drc || st != dst || got != want) {
                    if (!bad)
                        snprintf(why, sizeof why,
                                 "first mismatch: version %d flags %llu: rc %d st %d %p (%s), "
                                 "want rc %d st %d %p",
                                 ver, (unsigned long long)fl, rc, st, got, ip_object_of(got), drc,
                                 dst, want);
                    bad++;
                }
                hooked += ip_in_hook(got);
            }
        }
        CHECK(bad == 0, "cuGetProcAddress_v2(%s) x 9 versions x 4 flag sets: driver's code and "
                        "status, %s (%d answers hooked) %s",
              lookups[i].name, lookups[i].ours ? "our wrapper for its ABI" : "driver's function",
              hooked, why);
    }

    /* cuGetProcAddress itself: the 4-argument ABI for 11030, the 5-argument one from 12000. */
    void *v1 = ip_need_dlsym(driver.libcuda, "cuGetProcAddress");
    void *v2 = ip_need_dlsym(driver.libcuda, "cuGetProcAddress_v2");
    CHECK(ip_in_hook(v1) && ip_in_hook(v2) && v1 != v2,
          "dlsym(libcuda, cuGetProcAddress / _v2) are the library's two ABIs");
    void *got = NULL;
    CUdriverProcAddressQueryResult st;
    CHECK(driver.getproc("cuGetProcAddress", &got, 11030, 0, &st) == CUDA_SUCCESS && got == v1,
          "cuGetProcAddress(\"cuGetProcAddress\", 11030) -> our 4-argument wrapper");
    PFN_cuGetProcAddress_v11030 gp1 = (PFN_cuGetProcAddress_v11030)got;
    for (int ver = 12000; ver <= 13000; ver += 1000) {
        CHECK(driver.getproc("cuGetProcAddress", &got, ver, PTDS, &st) == CUDA_SUCCESS && got == v2,
              "cuGetProcAddress(\"cuGetProcAddress\", %d, per-thread) -> our _v2", ver);
    }
    PFN_cuGetProcAddress_v12000 nested = (PFN_cuGetProcAddress_v12000)got;
    CHECK(nested("cuMemAlloc", &got, 12000, 0, &st) == CUDA_SUCCESS &&
              got == ip_need_dlsym(driver.libcuda, "cuMemAlloc_v2"),
          "nested lookup through the returned cuGetProcAddress stays hooked");
    CHECK(gp1("cuMemFreeAsync", &got, 12000, PTDS) == CUDA_SUCCESS &&
              got == ip_need_dlsym(driver.libcuda, "cuMemFreeAsync_ptsz"),
          "the 4-argument cuGetProcAddress hooks too (cuMemFreeAsync per-thread -> _ptsz)");
    CHECK(gp1("cuInit", &got, 12000, 0) == CUDA_SUCCESS && got == driver_fn("cuInit"),
          "the 4-argument cuGetProcAddress passes cuInit through");

    /* dlsym on the driver's handle: the exact exported ABI names. */
    CHECK(dlsym(driver.libcuda, "cuMemAlloc") == NULL,
          "dlsym(libcuda, \"cuMemAlloc\") (v1 ABI, absent from the simulation) stays NULL");
    CHECK(ip_in_hook(dlsym(driver.libcuda, "cuMemAlloc_v2")),
          "dlsym(libcuda, cuMemAlloc_v2) is ours");
    CHECK(ip_in_hook(dlsym(driver.libcuda, "cuMemFreeAsync_ptsz")) &&
              dlsym(driver.libcuda, "cuMemFreeAsync_ptsz") !=
                  dlsym(driver.libcuda, "cuMemFreeAsync"),
          "dlsym(libcuda, cuMemFreeAsync_ptsz) is ours and differs from the legacy one");
    CHECK(ip_in_libcuda(dlsym(driver.libcuda, "cuInit")) &&
              ip_in_libcuda(dlsym(driver.libcuda, "cuMemMap")),
          "dlsym(libcuda, cuInit / cuMemMap) are the driver's");
    CHECK(ip_in_hook(dlsym(driver.libcuda, "cuMemCreate")) &&
              ip_in_hook(dlsym(driver.libcuda, "cuCtxSetCurrent")),
          "dlsym(libcuda, cuMemCreate / cuCtxSetCurrent) are the library's wrappers");
    CHECK(ip_in_hook(dlsym(RTLD_DEFAULT, "cuMemAlloc_v2")),
          "dlsym(RTLD_DEFAULT, cuMemAlloc_v2) finds the exported symbol");

    /* Through the handle of a library that depends on the driver (libtorch_cuda, cuDNN). */
    void *user = dlopen(IPT_CUDAUSER_PATH, RTLD_NOW | RTLD_LOCAL);
    CHECK(user != NULL, "dlopen(libipt_cudauser.so), a library linked against the driver");
    if (user) {
        CHECK(dlsym(user, "cuMemFree_v2") == ip_need_dlsym(driver.libcuda, "cuMemFree_v2") &&
                  dlsym(user, "cuGetProcAddress_v2") == (void *)driver.getproc,
              "dlsym(its handle, cuMemFree_v2 / cuGetProcAddress_v2) -> the library's");
        CHECK(ip_in_libcuda(dlsym(user, "cuInit")), "dlsym(its handle, cuInit) -> the driver's");
    }
}

/* ---- allocations ------------------------------------------------------------------------ */

static void check_range(CUdeviceptr p, size_t size, CUdeviceptr q, const char *what)
{
    CUdeviceptr base = 0, start = 0;
    size_t len = 0, rsize = 0;
    CUresult rc = p_cuMemGetAddressRange(&base, &len, q);
    CHECK(rc == CUDA_SUCCESS && base == p && len == size,
          "%s: cuMemGetAddressRange(base+%llu) -> rc %d base+%lld size %zu (want size %zu)",
          what, (unsigned long long)(q - p), rc, (long long)(base - p), len, size);
    rc = p_cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, q);
    CUresult rc2 = p_cuPointerGetAttribute(&rsize, CU_POINTER_ATTRIBUTE_RANGE_SIZE, q);
    CHECK(rc == CUDA_SUCCESS && rc2 == CUDA_SUCCESS && start == p && rsize == size,
          "%s: cuPointerGetAttribute(RANGE_START_ADDR/SIZE) -> base+%lld size %zu", what,
          (long long)(start - p), rsize);
    CUpointer_attribute attrs[4] = {CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                    CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                    CU_POINTER_ATTRIBUTE_MAPPED};
    int ordinal = -1, mapped = 0;
    start = 0;
    rsize = 0;
    void *data[4] = {&ordinal, &start, &rsize, &mapped};
    rc = p_cuPointerGetAttributes(4, attrs, data, q);
    CHECK(rc == CUDA_SUCCESS && ordinal == 0 && start == p && rsize == size && mapped == 1,
          "%s: cuPointerGetAttributes -> ordinal %d base+%lld size %zu mapped %d", what,
          ordinal, (long long)(start - p), rsize, mapped);
    base = 0;
    len = 0;
    CHECK(p_cuMemGetAddressRange(NULL, &len, q) == CUDA_SUCCESS && len == size &&
              p_cuMemGetAddressRange(&base, NULL, q) == CUDA_SUCCESS && base == p,
          "%s: cuMemGetAddressRange with one NULL out-pointer", what);
}

static void check_contents(CUdeviceptr p, size_t size, unsigned char tag)
{
    unsigned char in[512], out[512];
    size_t n = size < sizeof in ? size : sizeof in;
    memset(in, tag, n);
    CUresult w1 = driver.sim.sim_write(p, in, n), w2 = driver.sim.sim_write(p + size - n, in, n);
    memset(out, 0, n);
    CUresult r1 = driver.sim.sim_read(out, p + size - n, n);
    CHECK(w1 == CUDA_SUCCESS && w2 == CUDA_SUCCESS && r1 == CUDA_SUCCESS && !memcmp(in, out, n),
          "contents: the first and last %zu bytes of %zu are writable and read back", n, size);
}

static void check_allocations(void)
{
    static const size_t sizes[] = {1, 255, 256, 4096, 64 << 10, MiB + 3, 2 * MiB, 2 * MiB + 1,
                                   7 * MiB + 5, 64 * MiB};
    enum { N = sizeof sizes / sizeof sizes[0] };
    CUdeviceptr ptrs[N];
    for (int i = 0; i < N; i++) {
        size_t native0 = driver.sim.sim_live_native();
        CUresult rc = p_cuMemAlloc(&ptrs[i], sizes[i]);
        CUdeviceptr p = ptrs[i];
        CHECK(rc == CUDA_SUCCESS && p % 256 == 0, "cuMemAlloc(%zu) -> rc %d, 256-byte aligned",
              sizes[i], rc);
        if (rc != CUDA_SUCCESS)
            continue;
        if (served)
            CHECK(owned(p) && driver.sim.sim_is_mapped(p) &&
                      driver.sim.sim_live_native() == native0,
                  "cuMemAlloc(%zu) served: vmm_owns, VMM-mapped, no native block", sizes[i]);
        else
            CHECK(!owned(p) && driver.sim.sim_live_native() == native0 + 1,
                  "cuMemAlloc(%zu) native: not owned, one more native block", sizes[i]);
        char what[64];
        snprintf(what, sizeof what, "size %zu", sizes[i]);
        check_range(p, sizes[i], p + sizes[i] / 2, what);
        check_range(p, sizes[i], p + sizes[i] - 1, what);
        check_contents(p, sizes[i], (unsigned char)(i + 1));
    }
    for (int i = 0; i < N; i++)
        CHECK_RC(p_cuMemFree(ptrs[i]), CUDA_SUCCESS, "cuMemFree(size %zu)", sizes[i]);

    /* Pitched. */
    CUdeviceptr p = 0;
    size_t pitch = 0;
    CUresult rc = p_cuMemAllocPitch(&p, &pitch, 1000, 77, 4);
    CHECK(rc == CUDA_SUCCESS && pitch == 1024 && (!served || owned(p)),
          "cuMemAllocPitch(1000 x 77, 4) -> rc %d pitch %zu (1024 measured)%s", rc, pitch,
          served ? ", served" : "");
    if (rc == CUDA_SUCCESS) {
        check_range(p, pitch * 77, p + pitch * 77 - 1, "pitch 1000x77");
        CHECK_RC(p_cuMemFree(p), CUDA_SUCCESS, "cuMemFree(pitched)");
    }
    CHECK_RC(p_cuMemAllocPitch(&p, &pitch, 1000, 77, 3), CUDA_ERROR_INVALID_VALUE,
             "cuMemAllocPitch(element size 3)");
    CHECK_RC(p_cuMemAllocPitch(&p, &pitch, 0, 77, 4), CUDA_ERROR_INVALID_VALUE,
             "cuMemAllocPitch(width 0)");
    CHECK_RC(p_cuMemAllocPitch(&p, NULL, 1000, 77, 4), CUDA_ERROR_INVALID_VALUE,
             "cuMemAllocPitch(pitch NULL)");
}

static void *no_context_thread(void *arg)
{
    CUdeviceptr p = 0;
    *(CUresult *)arg = p_cuMemAlloc(&p, 4096);
    return NULL;
}

static void check_bad_inputs(void)
{
    CUdeviceptr p = 0;
    size_t cap = driver.sim.sim_device_capacity(0);
    size_t native0 = driver.sim.sim_live_native();
    CHECK_RC(p_cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE, "cuMemAlloc(size 0)");
    CHECK_RC(p_cuMemAlloc(NULL, 4096), CUDA_ERROR_INVALID_VALUE, "cuMemAlloc(dptr NULL)");
    CHECK_RC(p_cuMemAlloc(&p, SIZE_MAX), CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc(SIZE_MAX)");
    CHECK_RC(p_cuMemAlloc(&p, SIZE_MAX / 2 + 1), CUDA_ERROR_OUT_OF_MEMORY,
             "cuMemAlloc(SIZE_MAX/2+1)");
    CHECK_RC(p_cuMemAlloc(&p, cap + 1), CUDA_ERROR_OUT_OF_MEMORY,
             "cuMemAlloc(device capacity + 1 = %zu)", cap + 1);
    CHECK_RC(p_cuMemAlloc(&p, 2 * cap), CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc(2 x capacity)");
    CHECK(driver.sim.sim_live_native() == native0, "no native block left behind by the failures");

    CHECK_RC(p_cuMemFree(0), CUDA_SUCCESS, "cuMemFree(0)");
    CHECK_RC(p_cuMemFree((CUdeviceptr)0x7f0000001000ULL), CUDA_ERROR_INVALID_VALUE,
             "cuMemFree(never allocated)");
    CHECK_RC(p_cuMemFreeAsync((CUdeviceptr)0x7f0000001000ULL, NULL), CUDA_ERROR_INVALID_VALUE,
             "cuMemFreeAsync(never allocated)");

    static const size_t sizes[] = {1000, 3 * MiB + 1};
    for (int i = 0; i < 2; i++) {
        size_t s = sizes[i];
        CHECK_RC(p_cuMemAlloc(&p, s), CUDA_SUCCESS, "cuMemAlloc(%zu)", s);
        CHECK_RC(p_cuMemFree(p + 256), CUDA_ERROR_INVALID_VALUE, "cuMemFree(interior +256 of %zu)",
                 s);
        CHECK(!served || owned(p), "the buffer survives the interior free");
        CHECK_RC(p_cuMemFree(p), CUDA_SUCCESS, "cuMemFree(%zu)", s);
        CHECK(!owned(p), "freed: not owned any more");
        CHECK_RC(p_cuMemFree(p), CUDA_ERROR_INVALID_VALUE, "cuMemFree(%zu) again (double free)",
                 s);
        CHECK_RC(p_cuMemFreeAsync(p, NULL), CUDA_ERROR_INVALID_VALUE,
                 "cuMemFreeAsync(%zu) after free", s);
        size_t len = 0;
        CUresult want = ((PFN_cuMemGetAddressRange_v3020)driver_fn("cuMemGetAddressRange"))(
            NULL, &len, (CUdeviceptr)0x7f0000001000ULL);
        CHECK_RC(p_cuMemGetAddressRange(NULL, &len, p + 10), want,
                 "cuMemGetAddressRange(freed %zu) gives the driver's code for an unknown "
                 "pointer", s);
    }

    CUresult rc = CUDA_SUCCESS;
    pthread_t t;
    pthread_create(&t, NULL, no_context_thread, &rc);
    pthread_join(t, NULL);
    CHECK_RC(rc, CUDA_ERROR_INVALID_CONTEXT, "cuMemAlloc on a thread without a context");
}

/* The application's own VMM memory (NCCL's, PyTorch's expandable segments) is not ours. */
static void check_app_vmm(void)
{
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    size_t sz = 2 * MiB;
    unsigned long creates = driver.sim.sim_calls("cuMemCreate");
    CHECK_RC(p_cuMemCreate(&h, sz, &prop, 0), CUDA_SUCCESS, "app cuMemCreate(2 MiB)");
    CHECK(driver.sim.sim_calls("cuMemCreate") == creates + 1,
          "the app's cuMemCreate reached the driver exactly once");
    CHECK_RC(p_cuMemAddressReserve(&va, sz, 0, 0, 0), CUDA_SUCCESS, "app cuMemAddressReserve");
    CHECK_RC(p_cuMemMap(va, sz, 0, h, 0), CUDA_SUCCESS, "app cuMemMap");
    CHECK_RC(p_cuMemSetAccess(va, sz, &acc, 1), CUDA_SUCCESS, "app cuMemSetAccess");
    check_contents(va, sz, 0x5a);
    CHECK(!owned(va) && !owned(va + 4096), "the app's VMM range is not the library's");
    CHECK_RC(p_cuMemFree(va), CUDA_ERROR_INVALID_VALUE,
             "cuMemFree(app VMM pointer) gives the driver's answer");
    CHECK(driver.sim.sim_is_mapped(va), "the app's mapping is still there");
    CUdeviceptr base = 0;
    size_t len = 0;
    CHECK(p_cuMemGetAddressRange(&base, &len, va + 100) == CUDA_SUCCESS && base == va &&
              len == sz,
          "cuMemGetAddressRange(app VMM) is the driver's (the mapping)");
    CHECK_RC(p_cuMemUnmap(va, sz), CUDA_SUCCESS, "app cuMemUnmap");
    CHECK_RC(p_cuMemAddressFree(va, sz), CUDA_SUCCESS, "app cuMemAddressFree");
    CHECK_RC(p_cuMemRelease(h), CUDA_SUCCESS, "app cuMemRelease");
}

static void check_async(void)
{
    CUstream s = NULL;
    CHECK_RC(p_cuStreamCreate(&s, 0), CUDA_SUCCESS, "cuStreamCreate");
    CUdeviceptr a = 0, b = 0, c = 0, n = 0;
    CHECK_RC(p_cuMemAlloc(&a, 3 * MiB), CUDA_SUCCESS, "cuMemAlloc(3 MiB)");
    CHECK_RC(p_cuMemAlloc(&b, 1000), CUDA_SUCCESS, "cuMemAlloc(1000)");
    CHECK_RC(p_cuMemAlloc(&c, 5 * MiB), CUDA_SUCCESS, "cuMemAlloc(5 MiB)");
    CHECK(!served || (owned(a) && owned(b) && owned(c)), "all three served");
    CHECK_RC(p_cuMemFreeAsync(a, NULL), CUDA_SUCCESS, "cuMemFreeAsync(legacy, stream 0)");
    CHECK_RC(p_cuMemFreeAsync_ptsz(b, s), CUDA_SUCCESS, "cuMemFreeAsync_ptsz(created stream)");
    CHECK_RC(p_cuMemFreeAsync_ptsz(c, NULL), CUDA_SUCCESS,
             "cuMemFreeAsync_ptsz(per-thread stream 0)");
    CHECK(!owned(a) && !owned(b) && !owned(c), "freed in stream order: none owned any more");
    CHECK_RC(p_cuMemFreeAsync_ptsz(c, NULL), CUDA_ERROR_INVALID_VALUE,
             "cuMemFreeAsync_ptsz again (double free)");

    size_t native0 = driver.sim.sim_live_native();
    CHECK_RC(p_cuMemAllocAsync_ptsz(&n, 4096, s), CUDA_SUCCESS,
             "cuMemAllocAsync_ptsz (passed through)");
    CHECK(!owned(n) && driver.sim.sim_live_native() == native0 + 1,
          "cuMemAllocAsync gives a native block in both modes");
    CUipcMemHandle ih;
    CHECK_RC(p_cuIpcGetMemHandle(&ih, n), CUDA_SUCCESS, "cuIpcGetMemHandle(native block)");
    CHECK_RC(p_cuMemFreeAsync_ptsz(n, s), CUDA_SUCCESS,
             "cuMemFreeAsync_ptsz(native block) passes through");
    CHECK(driver.sim.sim_live_native() == native0, "the native block is gone");
    CHECK_RC(p_cuMemAllocAsync(&n, 8192, NULL), CUDA_SUCCESS, "cuMemAllocAsync (legacy)");
    CHECK_RC(p_cuMemFreeAsync(n, NULL), CUDA_SUCCESS, "cuMemFreeAsync(native block), legacy");
    CHECK(driver.sim.sim_live_native() == native0, "that native block is gone too");
    CHECK_RC(p_cuStreamDestroy(s), CUDA_SUCCESS, "cuStreamDestroy");
}

static void check_mem_info(void)
{
    size_t f0 = 0, t0 = 0, f1 = 0, t1 = 0, df = 0, dt = 0;
    PFN_cuMemGetInfo_v3020 drv = (PFN_cuMemGetInfo_v3020)driver_fn("cuMemGetInfo");
    CHECK_RC(p_cuMemGetInfo(&f0, &t0), CUDA_SUCCESS, "cuMemGetInfo");
    CUdeviceptr a = 0, b = 0;
    CHECK_RC(p_cuMemAlloc(&a, 64 * MiB), CUDA_SUCCESS, "cuMemAlloc(64 MiB)");
    CHECK_RC(p_cuMemAlloc(&b, 1000), CUDA_SUCCESS, "cuMemAlloc(1000)");
    CHECK_RC(p_cuMemGetInfo(&f1, &t1), CUDA_SUCCESS, "cuMemGetInfo with 64 MiB + 1000 B live");
    CHECK(f1 <= f0 - 64 * MiB && t1 == t0, "free fell by at least 64 MiB (%zu -> %zu)", f0, f1);
    p_cuMemFree(a);
    p_cuMemFree(b);
    CHECK_RC(p_cuMemGetInfo(&f1, &t1), CUDA_SUCCESS, "cuMemGetInfo after the frees");
    drv(&df, &dt);
    CHECK(f1 == f0 && t1 == t0,
          "free is back to %zu after the frees (got %zu; the driver itself says %zu, the "
          "library holds %zu bytes)",
          f0, f1, df, driver.sim.sim_device_used(0));
    if (served)
        CHECK(df < f1, "non-vacuous: the library keeps memory cached (driver free %zu < %zu)", df,
              f1);
    CHECK_RC(p_cuMemGetInfo(NULL, &t1), drv(NULL, &dt), "cuMemGetInfo(NULL, &total)");
}

static void check_ipc_and_peers(ip_capture_t *cap, CUcontext ctx0, CUcontext ctx1)
{
    static char text[1 << 16];
    CUdeviceptr a = 0;
    CUipcMemHandle h;
    CHECK_RC(p_cuMemAlloc(&a, 3 * MiB), CUDA_SUCCESS, "cuMemAlloc(3 MiB)");
    CUresult want = served ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    CHECK_RC(p_cuIpcGetMemHandle(&h, a), want, "cuIpcGetMemHandle(%s buffer)",
             served ? "served" : "native");
    CHECK_RC(p_cuIpcGetMemHandle(&h, a), want, "cuIpcGetMemHandle again");
    ip_capture_read(cap, text, sizeof text);
    size_t lines = ip_count_substr(text, "VMMHOOK_HANDLE_TYPE=posix_fd");
    CHECK(lines == (served ? 1u : 0u), "the IPC explanation was printed %zu time(s) (want %d)",
          lines, served ? 1 : 0);
    PFN_cuIpcCloseMemHandle_v4010 close_drv =
        (PFN_cuIpcCloseMemHandle_v4010)driver_fn("cuIpcCloseMemHandle");
    CHECK_RC(p_cuIpcCloseMemHandle(a), close_drv(a), "cuIpcCloseMemHandle passes through");
    CHECK_RC(p_cuMemFree(a), CUDA_SUCCESS, "cuMemFree");

    PFN_cuCtxEnablePeerAccess_v4000 en_drv =
        (PFN_cuCtxEnablePeerAccess_v4000)driver_fn("cuCtxEnablePeerAccess");
    CHECK_RC(p_cuCtxEnablePeerAccess(ctx0, 0), en_drv(ctx0, 0),
             "cuCtxEnablePeerAccess(own context) gives the driver's code");
    CHECK_RC(p_cuCtxEnablePeerAccess(ctx1, 0), CUDA_SUCCESS, "cuCtxEnablePeerAccess(device 1)");
    CHECK_RC(p_cuCtxDisablePeerAccess(ctx1), CUDA_SUCCESS, "cuCtxDisablePeerAccess(device 1)");
    CHECK_RC(p_cuCtxDisablePeerAccess(ctx1), CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
             "cuCtxDisablePeerAccess again");

    /* Device 1: the allocation lands on the current context's device. */
    CHECK_RC(p_cuCtxSetCurrent(ctx1), CUDA_SUCCESS, "cuCtxSetCurrent(device 1)");
    CHECK_RC(p_cuMemAlloc(&a, 5 * MiB), CUDA_SUCCESS, "cuMemAlloc(5 MiB) on device 1");
    int ordinal = -1;
    CHECK(p_cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, a) ==
                  CUDA_SUCCESS &&
              ordinal == 1 && (!served || owned(a)),
          "it lives on device 1 (ordinal %d)", ordinal);
    CHECK_RC(p_cuMemFree(a), CUDA_SUCCESS, "cuMemFree on device 1");
    CHECK_RC(p_cuCtxSetCurrent(ctx0), CUDA_SUCCESS, "cuCtxSetCurrent(device 0)");
}

static void check_fork(void)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        /* No CUDA here: a look-up and a libc call, as a shell-out would do. */
        void *f = dlsym(RTLD_DEFAULT, "getpid");
        _exit(f != NULL && getpid() > 0 ? 0 : 3);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "a fork child that does not use CUDA exits normally (status 0x%x)", status);
}

int main(int argc, char **argv)
{
    served = ip_served_arg(argc, argv, "ip_cudart");
    CHECK(!ip_maps_has("libcuda.so"), "the library did not load libcuda.so.1 by itself");

    ip_capture_t cap;
    ip_capture_begin(&cap);

    driver = ip_open_driver();
    CHECK(ip_in_libcuda((void *)driver.sim.sim_live_native),
          "the simulated driver's controls resolve");

    check_lookups();

    /* Fetch what the program uses, with cudart's mix of versions and flags. */
    p_cuDevicePrimaryCtxRetain = ip_fetch(driver.getproc, "cuDevicePrimaryCtxRetain", 12000, 0);
    p_cuCtxSetCurrent = ip_fetch(driver.getproc, "cuCtxSetCurrent", 12000, 0);
    p_cuMemAlloc = ip_fetch(driver.getproc, "cuMemAlloc", 12000, 0);
    p_cuMemAllocPitch = ip_fetch(driver.getproc, "cuMemAllocPitch", 11030, 0);
    p_cuMemFree = ip_fetch(driver.getproc, "cuMemFree", 13000, PTDS);
    p_cuMemFreeAsync = ip_fetch(driver.getproc, "cuMemFreeAsync", 12000, 0);
    p_cuMemFreeAsync_ptsz = ip_fetch(driver.getproc, "cuMemFreeAsync", 12000, PTDS);
    p_cuMemAllocAsync = ip_fetch(driver.getproc, "cuMemAllocAsync", 12000, 0);
    p_cuMemAllocAsync_ptsz = ip_fetch(driver.getproc, "cuMemAllocAsync", 12000, PTDS);
    p_cuMemGetAddressRange = ip_fetch(driver.getproc, "cuMemGetAddressRange", 13000, 0);
    p_cuPointerGetAttribute = ip_fetch(driver.getproc, "cuPointerGetAttribute", 11030, 0);
    p_cuPointerGetAttributes = ip_fetch(driver.getproc, "cuPointerGetAttributes", 13000, PTDS);
    p_cuMemGetInfo = ip_fetch(driver.getproc, "cuMemGetInfo", 12000, 0);
    p_cuIpcGetMemHandle = ip_fetch(driver.getproc, "cuIpcGetMemHandle", 12000, 0);
    p_cuIpcCloseMemHandle = ip_fetch(driver.getproc, "cuIpcCloseMemHandle", 12000, 0);
    p_cuCtxEnablePeerAccess = ip_fetch(driver.getproc, "cuCtxEnablePeerAccess", 12000, 0);
    p_cuCtxDisablePeerAccess = ip_fetch(driver.getproc, "cuCtxDisablePeerAccess", 12000, 0);
    p_cuMemCreate = ip_fetch(driver.getproc, "cuMemCreate", 12000, 0);
    p_cuMemRelease = ip_fetch(driver.getproc, "cuMemRelease", 12000, 0);
    p_cuMemAddressReserve = ip_fetch(driver.getproc, "cuMemAddressReserve", 12000, 0);
    p_cuMemAddressFree = ip_fetch(driver.getproc, "cuMemAddressFree", 12000, 0);
    p_cuMemMap = ip_fetch(driver.getproc, "cuMemMap", 12000, 0);
    p_cuMemUnmap = ip_fetch(driver.getproc, "cuMemUnmap", 12000, 0);
    p_cuMemSetAccess = ip_fetch(driver.getproc, "cuMemSetAccess", 12000, 0);
    p_cuStreamCreate = ip_fetch(driver.getproc, "cuStreamCreate", 12000, 0);
    p_cuStreamDestroy = ip_fetch(driver.getproc, "cuStreamDestroy", 12000, 0);

    /* Nothing so far may have initialised the library: no cuInit from its driver table, no
     * option parsing (VMMHOOK_VERBOSE=1 would print the options), no output at all. */
    static char text[1 << 16];
    ip_capture_read(&cap, text, sizeof text);
    CHECK(driver.sim.sim_calls("cuInit") == 0, "no cuInit during dlsym and %s lookups",
          "cuGetProcAddress");
    CHECK(text[0] == '\0', "nothing printed during lookups (%zu bytes)", strlen(text));

    CUcontext ctx[2];
    ip_two_primary_contexts(driver.getproc, ctx);

    CUdeviceptr first = 0;
    CHECK_RC(p_cuMemAlloc(&first, 100), CUDA_SUCCESS, "first cuMemAlloc");
    ip_capture_read(&cap, text, sizeof text);
    CHECK(strstr(text, "vmmhook:") != NULL,
          "the first interposed call loaded the options (VMMHOOK_VERBOSE output appeared)");
    CHECK_RC(p_cuMemFree(first), CUDA_SUCCESS, "cuMemFree(first)");

    check_allocations();
    check_bad_inputs();
    check_app_vmm();
    check_async();
    check_mem_info();
    check_ipc_and_peers(&cap, ctx[0], ctx[1]);
    ip_capture_end(&cap);
    check_fork();

    size_t trimmed = driver.vmm_trim();
    printf("vmm_trim released %zu bytes\n", trimmed);
    bool empty = driver.sim.sim_ledger_empty();
    CHECK(empty,
          "after freeing everything and vmm_trim, the driver holds nothing (%zu "
          "mappings, %zu reservations, %zu native)",
          driver.sim.sim_live_mappings(), driver.sim.sim_live_reservations(),
          driver.sim.sim_live_native());
    if (!empty)
        driver.sim.sim_ledger_dump();
    return ip_finish(served ? "ip_cudart served" : "ip_cudart native");
}
