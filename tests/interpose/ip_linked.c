/* Interpose test 2: a program linked directly against the driver (-lcuda), calling the exported
 * versioned symbols (cuMemAlloc_v2 ...) the way cuda.h's macros make it. The preloaded library
 * comes first in the symbol search order, so its exported definitions receive the calls, and its
 * pass-through must reach the driver without any dlsym or cuGetProcAddress by the program
 * (the real function is the next definition after the library). Run "served" and "native"
 * (VMMHOOK_DISABLE=1) with the same expected codes.
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <stdint.h>

#include "ip_common.h"
#include "simdrv.h"

#define MiB ((size_t)1 << 20)

/* Exported by the driver for per-thread-default-stream code; cuda.h declares it only under
 * CUDA_API_PER_THREAD_DEFAULT_STREAM. */
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);

static bool served;
static int (*vmm_owns_fn)(const void *);

static bool owned(CUdeviceptr p)
{
    return vmm_owns_fn((const void *)(uintptr_t)p) != 0;
}

int main(int argc, char **argv)
{
    served = ip_served_arg(argc, argv, "ip_linked");
    vmm_owns_fn = (int (*)(const void *))dlsym(RTLD_DEFAULT, "vmm_owns");
    CHECK(vmm_owns_fn != NULL, "vmm_owns found through dlsym(RTLD_DEFAULT)");
    if (!vmm_owns_fn)
        return 1;
    CHECK(ip_in_hook((void *)cuMemAlloc_v2) && ip_in_hook((void *)cuMemFree_v2) &&
              ip_in_hook((void *)cuMemFreeAsync_ptsz) && ip_in_hook((void *)cuGetProcAddress_v2),
          "the program's cuMemAlloc_v2 / cuMemFree_v2 / cuMemFreeAsync_ptsz / "
          "cuGetProcAddress_v2 bind to the library");
    CHECK(ip_in_libcuda((void *)cuInit) && ip_in_libcuda((void *)cuMemMap),
          "cuInit / cuMemMap bind to the driver");
    CHECK(ip_in_hook((void *)cuMemCreate) && ip_in_hook((void *)cuCtxSetCurrent),
          "cuMemCreate / cuCtxSetCurrent bind to the library (retried on OOM / reported)");

    ip_linked_primary_context();

    /* First interposed calls: pass-throughs of a native block, before the program ever looked
     * anything up. */
    CUdeviceptr n = 0;
    CHECK_RC(cuMemAllocAsync(&n, 4096, NULL), CUDA_SUCCESS, "cuMemAllocAsync (native)");
    size_t len = 0;
    CHECK(cuMemGetAddressRange(NULL, &len, n) == CUDA_SUCCESS && len == 4096,
          "cuMemGetAddressRange(native block) passes through (size %zu)", len);
    CHECK_RC(cuMemFree(n), CUDA_SUCCESS, "cuMemFree(native block) passes through");
    CHECK(sim_live_native() == 0, "the native block is gone");

    static const size_t sizes[] = {1, 1000, 64 << 10, 2 * MiB + 1, 9 * MiB};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t s = sizes[i];
        CUdeviceptr p = 0, base = 0;
        CHECK_RC(cuMemAlloc(&p, s), CUDA_SUCCESS, "cuMemAlloc(%zu)", s);
        CHECK(served ? owned(p) && sim_is_mapped(p) && sim_live_native() == 0
                     : !owned(p) && sim_live_native() == 1,
              "%s", served ? "served from VMM" : "native");
        CHECK(cuMemGetAddressRange(&base, &len, p + s - 1) == CUDA_SUCCESS && base == p &&
                  len == s,
              "cuMemGetAddressRange(last byte) -> base+%lld size %zu", (long long)(base - p), len);
        size_t rsize = 0;
        CHECK(cuPointerGetAttribute(&rsize, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p + s / 2) ==
                      CUDA_SUCCESS &&
                  rsize == s,
              "cuPointerGetAttribute(RANGE_SIZE) -> %zu", rsize);
        if (s > 1)
            CHECK_RC(cuMemFree(p + s / 2), CUDA_ERROR_INVALID_VALUE, "cuMemFree(interior) of %zu",
                     s);
        if (i % 2)
            CHECK_RC(cuMemFreeAsync_ptsz(p, NULL), CUDA_SUCCESS, "cuMemFreeAsync_ptsz");
        else
            CHECK_RC(cuMemFree(p), CUDA_SUCCESS, "cuMemFree");
        CHECK_RC(cuMemFree(p), CUDA_ERROR_INVALID_VALUE, "double free");
    }

    CUdeviceptr p = 0;
    size_t pitch = 0;
    CHECK(cuMemAllocPitch(&p, &pitch, 1000, 77, 8) == CUDA_SUCCESS && pitch == 1024 &&
              (!served || owned(p)),
          "cuMemAllocPitch(1000 x 77) pitch %zu", pitch);
    CHECK_RC(cuMemFreeAsync(p, NULL), CUDA_SUCCESS, "cuMemFreeAsync(pitched)");
    CHECK_RC(cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE, "cuMemAlloc(0)");
    CHECK_RC(cuMemAlloc(&p, SIZE_MAX), CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc(SIZE_MAX)");
    CHECK_RC(cuMemFree(0), CUDA_SUCCESS, "cuMemFree(0)");
    CHECK_RC(cuMemFree((CUdeviceptr)0xdeadbeef000ULL), CUDA_ERROR_INVALID_VALUE,
             "cuMemFree(never allocated)");

    /* cuGetProcAddress through the exported symbol, no dlsym. */
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    CHECK(cuGetProcAddress("cuMemAlloc", &fn, 12000, 0, &st) == CUDA_SUCCESS &&
              fn == (void *)cuMemAlloc_v2,
          "cuGetProcAddress_v2(\"cuMemAlloc\") -> the library's cuMemAlloc_v2");
    CHECK(cuGetProcAddress("cuMemFreeAsync", &fn, 12000,
                           CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
                           &st) == CUDA_SUCCESS &&
              fn == (void *)cuMemFreeAsync_ptsz,
          "cuGetProcAddress_v2(\"cuMemFreeAsync\", per-thread) -> cuMemFreeAsync_ptsz");
    CHECK(cuGetProcAddress("cuMemMap", &fn, 12000, 0, &st) == CUDA_SUCCESS && ip_in_libcuda(fn),
          "cuGetProcAddress_v2(\"cuMemMap\") -> the driver's");
    CHECK(cuGetProcAddress("cuMemCreate", &fn, 12000, 0, &st) == CUDA_SUCCESS &&
              fn == (void *)cuMemCreate,
          "cuGetProcAddress_v2(\"cuMemCreate\") -> the library's cuMemCreate");

    size_t f0, t0, f1, t1;
    CHECK_RC(cuMemGetInfo(&f0, &t0), CUDA_SUCCESS, "cuMemGetInfo");
    CHECK_RC(cuMemAlloc(&p, 32 * MiB), CUDA_SUCCESS, "cuMemAlloc(32 MiB)");
    CHECK_RC(cuMemFree(p), CUDA_SUCCESS, "cuMemFree(32 MiB)");
    CHECK(cuMemGetInfo(&f1, &t1) == CUDA_SUCCESS && f1 == f0 && t1 == t0,
          "cuMemGetInfo: free back to %zu (got %zu)", f0, f1);

    size_t (*trim)(void) = (size_t(*)(void))dlsym(RTLD_DEFAULT, "vmm_trim");
    CHECK(trim != NULL, "vmm_trim found");
    if (trim)
        trim();
    bool empty = sim_ledger_empty();
    CHECK(empty, "after vmm_trim the driver holds nothing");
    if (!empty)
        sim_ledger_dump();
    return ip_finish(served ? "ip_linked served" : "ip_linked native");
}
