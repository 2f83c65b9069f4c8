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
#include <stdlib.h>
#include <string.h>
#include <strings.h>

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

/* Two of the library's counters, read with vmm_stats_json (the table's names in quotes):
 * calls, the driver calls it made on application threads ("driver calls made by the library"
 * less "of them by the reclaim thread"), and hits ("allocations served from the cache"); -1
 * when they cannot be read. */
static int (*stats_json)(char *, size_t);

typedef struct counts {
    long long calls, hits;
} counts_t;

static long long counter(const char *json, const char *name)
{
    char key[64];
    snprintf(key, sizeof(key), "\"%s\": ", name);
    const char *at = strstr(json, key);
    return at ? strtoll(at + strlen(key), NULL, 10) : -1;
}

static counts_t counts(void)
{
    static char json[32768];
    counts_t c = {-1, -1};
    if (!stats_json || stats_json(json, sizeof(json)) < 0)
        return c;
    long long all = counter(json, "driver_calls"), bg = counter(json, "driver_calls_background");
    c.calls = all < 0 || bg < 0 ? -1 : all - bg;
    c.hits = counter(json, "cache_hits");
    return c;
}

/* Whether the hook prints its statistics table at exit: VMMHOOK_STATS read as the library
 * reads a boolean (src/util/optparse.c: 1, true, yes or on, any case, blanks around). */
static int blank(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static int stats_table_at_exit(void)
{
    const char *v = getenv("VMMHOOK_STATS");
    if (!v)
        return 0;
    while (blank(*v))
        v++;
    size_t n = strlen(v);
    while (n > 0 && blank(v[n - 1]))
        n--;
    static const char *const yes[] = {"1", "true", "yes", "on"};
    for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++)
        if (n == strlen(yes[i]) && strncasecmp(v, yes[i], n) == 0)
            return 1;
    return 0;
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
    stats_json = (int (*)(char *, size_t))vmm_fn("vmm_stats_json");
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
    counts_t before_c = counts(), after_c = before_c;
    for (int i = 0; i < SMALL; i++) {
        small[i] = 0;
        if (mem_alloc(&small[i], 4096) == CUDA_SUCCESS)
            served += owns((const void *)(uintptr_t)small[i]) != 0;
        if (i == 0)
            before_c = counts(); /* the first made the device's first shared chunk */
    }
    after_c = counts();
    char what[512];
    if (before_c.calls >= 0 && after_c.calls >= 0)
        snprintf(what, sizeof(what),
                 "cuMemAlloc 100 x 4 KiB: all served by the hook, packed into shared chunks "
                 "(%lld driver calls for the 99 after the first)",
                 after_c.calls - before_c.calls);
    else
        snprintf(what, sizeof(what),
                 "cuMemAlloc 100 x 4 KiB: all served by the hook, packed into shared chunks");
    step(served == SMALL, what);

    /* 2. A big request: chunks of its own in a virtual address range. */
    CUdeviceptr big = 0;
    CUresult rc = mem_alloc(&big, 64 * MiB);
    step(rc == CUDA_SUCCESS && owns((const void *)(uintptr_t)big),
         "cuMemAlloc 64 MiB: served from a virtual-memory range");

    /* 3. Free, allocate again: the freed space stays mapped in its shared chunk and serves the
     * next request without a driver call once the GPU has passed the free (at once while the
     * program's work runs in one queue, VMMHOOK_STREAM_ORDERED; otherwise it depends on that
     * timing). Shown by what can be seen: the address, and the driver calls the allocation
     * made. The table's "allocations served from the cache" does not count this reuse: it
     * counts buffers with chunks of their own (vmm_realloc's, step 4, or requests of at least
     * VMMHOOK_PACK_BELOW, which by default carves every cuMemAlloc from shared chunks) served
     * from the cache of freed ones; said below from the counter itself. */
    CUdeviceptr freed = big;
    mem_free(big);
    big = 0;
    before_c = counts();
    rc = mem_alloc(&big, 64 * MiB);
    after_c = counts();
    long long calls =
        before_c.calls >= 0 && after_c.calls >= 0 ? after_c.calls - before_c.calls : -1;
    const char *where = big == freed ? "the same address" : "a new address";
    int hit = before_c.hits >= 0 && after_c.hits > before_c.hits;
    if (rc != CUDA_SUCCESS)
        snprintf(what, sizeof(what), "cuMemFree then cuMemAlloc 64 MiB again: refused (%d)",
                 (int)rc);
    else if (hit)
        snprintf(what, sizeof(what),
                 "cuMemFree then cuMemAlloc 64 MiB again: served from the hook's cache of freed "
                 "buffers (%s)",
                 where);
    else if (calls == 0 && big == freed)
        snprintf(what, sizeof(what),
                 "cuMemFree then cuMemAlloc 64 MiB again: the freed memory reused (the same "
                 "address, no driver call)");
    else if (calls == 0)
        snprintf(what, sizeof(what),
                 "cuMemFree then cuMemAlloc 64 MiB again: served from memory the hook held idle "
                 "(a new address, no driver call)");
    else if (calls > 0)
        snprintf(what, sizeof(what),
                 "cuMemFree then cuMemAlloc 64 MiB again: served at %s with %lld driver calls "
                 "(the freed memory was not reusable yet: it waits for the GPU to pass the free)",
                 where, calls);
    else
        snprintf(what, sizeof(what), "cuMemFree then cuMemAlloc 64 MiB again: served at %s", where);
    step(rc == CUDA_SUCCESS && owns((const void *)(uintptr_t)big), what);
    if (hit)
        printf("         (a buffer with chunks of its own, reused whole: counted in the table's "
               "\"allocations served from the cache\")\n");
    else if (calls == 0)
        printf("         (reuse inside shared chunks: the table's \"allocations served from the "
               "cache\" does not count it;\n"
               "         that counts buffers with chunks of their own reused whole, such as "
               "vmm_realloc's below)\n");
    if (mem_info) {
        size_t free_b = 0, total_b = 0;
        mem_info(&free_b, &total_b);
        printf("  cuMemGetInfo: %zu MiB free of %zu MiB (the hook counts the memory it holds idle "
               "for reuse as free)\n",
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
    /* The table comes from the library's destructor, after main returns: announced only when
     * VMMHOOK_STATS asks for it. */
    printf("hook_demo: %s; %s\n", failures ? "SOME STEPS FAILED" : "every step did what it says",
           stats_table_at_exit() ? "the hook's statistics follow (VMMHOOK_STATS)"
                                 : "run with VMMHOOK_STATS=1 for the hook's statistics at exit");
    return failures ? 1 : 0;
}
