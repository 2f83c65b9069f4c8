/* hook_demo: what the hook does, step by step, through the CUDA driver API. It loads the driver
 * the way cudart does (dlopen("libcuda.so.1"), then cuGetProcAddress_v2 for every entry point)
 * and allocates, frees, reuses and grows device memory, saying after each step what the hook
 * did; run it with libvmmhook.so preloaded and VMMHOOK_STATS=1 for the counters.
 *
 * Without a GPU, tools/quickstart runs it with LD_LIBRARY_PATH pointing at the simulated driver
 * of tests/sim (a fake libcuda.so.1 that keeps its ledger in host memory; the quickstart labels
 * the run SIMULATED): the hook serves these calls as it would on a GPU, no kernel runs, and
 * nothing it prints says anything about speed. With a GPU the quickstart runs it against the
 * real driver after tools/demo/hello. Plain C: built with the C compiler only, no nvcc.
 * Exit status 0 when every step did what it says. */
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "vmmhook.h"

typedef CUresult (*get_proc_fn)(const char *, void **, int, cuuint64_t,
                                CUdriverProcAddressQueryResult *);
typedef CUresult (*init_fn)(unsigned);
typedef CUresult (*device_get_fn)(CUdevice *, int);
typedef CUresult (*device_name_fn)(char *, int, CUdevice);
typedef CUresult (*ctx_retain_fn)(CUcontext *, CUdevice);
typedef CUresult (*ctx_set_fn)(CUcontext);
typedef CUresult (*mem_alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*mem_free_fn)(CUdeviceptr);
typedef CUresult (*mem_info_fn)(size_t *, size_t *);

#define MiB ((size_t)1 << 20)
#define SMALL 100

static get_proc_fn get_proc;
static int failures;

static void *entry(const char *name)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult found;
    if (get_proc(name, &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS)
        return NULL;
    return fn;
}

static void step(int ok, const char *what)
{
    printf("  %s %s\n", ok ? "[ok]  " : "[FAIL]", what);
    failures += !ok;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!drv) {
        fprintf(stderr, "hook_demo: no libcuda.so.1 (%s)\n", dlerror());
        return 1;
    }
    get_proc = (get_proc_fn)dlsym(drv, "cuGetProcAddress_v2");
    int (*owns)(const void *) = (int (*)(const void *))vmm_fn("vmm_owns");
    vmm_status (*grow)(void **, size_t) = (vmm_status(*)(void **, size_t))vmm_fn("vmm_realloc");
    if (!get_proc || !owns || !grow) {
        fprintf(stderr, "hook_demo: %s\n",
                get_proc ? "libvmmhook.so is not preloaded"
                         : "the driver has no cuGetProcAddress_v2");
        return 1;
    }
    init_fn cu_init = (init_fn)entry("cuInit");
    device_get_fn device_get = (device_get_fn)entry("cuDeviceGet");
    device_name_fn device_name = (device_name_fn)entry("cuDeviceGetName");
    ctx_retain_fn ctx_retain = (ctx_retain_fn)entry("cuDevicePrimaryCtxRetain");
    ctx_set_fn ctx_set = (ctx_set_fn)entry("cuCtxSetCurrent");
    mem_alloc_fn mem_alloc = (mem_alloc_fn)entry("cuMemAlloc");
    mem_free_fn mem_free = (mem_free_fn)entry("cuMemFree");
    mem_info_fn mem_info = (mem_info_fn)entry("cuMemGetInfo");
    if (!cu_init || !device_get || !ctx_retain || !ctx_set || !mem_alloc || !mem_free) {
        fprintf(stderr, "hook_demo: the driver lacks an entry point this demo uses\n");
        return 1;
    }

    CUdevice dev;
    CUcontext ctx;
    char name[128] = "?";
    if (cu_init(0) || device_get(&dev, 0) || ctx_retain(&ctx, dev) || ctx_set(ctx)) {
        fprintf(stderr, "hook_demo: cannot initialise device 0\n");
        return 1;
    }
    if (device_name)
        device_name(name, sizeof(name), dev);
    printf("hook_demo: device 0 is \"%s\"; the driver's calls go through libvmmhook\n", name);

    /* 1. Small requests: packed into shared chunks, 256-byte aligned like cudaMalloc. */
    CUdeviceptr small[SMALL];
    int served = 0;
    for (int i = 0; i < SMALL; i++) {
        small[i] = 0;
        if (mem_alloc(&small[i], 4096) == CUDA_SUCCESS)
            served += owns((const void *)(uintptr_t)small[i]) != 0;
    }
    step(served == SMALL, "cuMemAlloc 100 x 4 KiB: all served by the hook, packed into shared "
                          "chunks (no driver allocation each)");

    /* 2. A big request: chunks of its own in a virtual address range. */
    CUdeviceptr big = 0;
    CUresult rc = mem_alloc(&big, 64 * MiB);
    step(rc == CUDA_SUCCESS && owns((const void *)(uintptr_t)big),
         "cuMemAlloc 64 MiB: served from a virtual-memory range");

    /* 3. Free, allocate again: the freed memory is kept for reuse once the GPU has passed the
     * free (whether this very allocation got it depends on that timing: the table says). */
    mem_free(big);
    big = 0;
    rc = mem_alloc(&big, 64 * MiB);
    step(rc == CUDA_SUCCESS && owns((const void *)(uintptr_t)big),
         "cuMemFree then cuMemAlloc 64 MiB again: served; freed memory is kept for reuse (the "
         "table below counts \"allocations served from the cache\")");
    if (mem_info) {
        size_t free_b = 0, total_b = 0;
        mem_info(&free_b, &total_b);
        printf("  cuMemGetInfo: %zu MiB free of %zu MiB (the hook counts its idle cache as free)\n",
               free_b / MiB, total_b / MiB);
    }

    /* 4. vmm_realloc: grow a buffer. Within the address space reserved past it (headroom:
     * up to its own size) the pointer stays and nothing moves; beyond, the buffer's chunks are
     * remapped to a larger range (no copy of the contents: "device copies made by realloc"
     * in the table stays 0) unless the adjacent address space is free. */
    void *vec = NULL;
    vmm_status st = grow(&vec, 64 * MiB);
    void *before = vec;
    if (st == VMM_OK)
        st = grow(&vec, 128 * MiB);
    /* In place when the buffer has headroom or the driver grants the adjacent addresses; on
     * the H200 a 64 MiB buffer taken from the reuse cache has no headroom and the driver
     * refused the adjacent hint (GPU run of 2026-12-03 06:54): it moved, without a copy. */
    step(st == VMM_OK, vec == before
                           ? "vmm_realloc 64 MiB -> 128 MiB: grown in place, same pointer"
                           : "vmm_realloc 64 MiB -> 128 MiB: its chunks remapped to a larger "
                             "range (new pointer, contents kept without a copy)");
    before = vec;
    if (st == VMM_OK)
        st = grow(&vec, 1024 * MiB);
    step(st == VMM_OK, vec == before
                           ? "vmm_realloc 128 MiB -> 1 GiB: grown in place, same pointer"
                           : "vmm_realloc 128 MiB -> 1 GiB: its chunks remapped to a larger range "
                             "(new pointer, contents kept without a copy)");
    if (st == VMM_OK)
        grow(&vec, 0);

    for (int i = 0; i < SMALL; i++)
        if (small[i])
            mem_free(small[i]);
    if (big)
        mem_free(big);
    printf("hook_demo: %s; the hook's statistics follow (VMMHOOK_STATS=1)\n",
           failures ? "SOME STEPS FAILED" : "every step did what it says");
    return failures ? 1 : 0;
}
