/* Interpose test: which streams end reuse at once (docs/DESIGN.md, "Serving"). A stream that
 * cuBLASLt makes for itself (a library named libcublasLt.so here, ipt_cublaslt.c) leaves the
 * program's work in one queue: counted as library_streams, freed memory still reused at once.
 * A stream the program makes ends it: counted as queue_splits, and a buffer freed after that is
 * no longer handed out again before the GPU has passed its free. */
#include <cuda.h>

#include <stdint.h>

#include "ip_common.h"

#define MiB ((size_t)1 << 20)

CUresult ipt_cublaslt_make_stream(CUstream *s);

static int (*stats_json)(char *, size_t);

/* The counter `name` of the library's live statistics (-1 when absent). */
static long long counter(const char *name)
{
    static char buf[1 << 16];
    if (stats_json(buf, sizeof buf) < 0)
        return -1;
    char key[96];
    snprintf(key, sizeof key, "\"%s\": ", name);
    const char *at = strstr(buf, key);
    return at ? strtoll(at + strlen(key), NULL, 10) : -1;
}

/* Whether a free followed by an allocation of the same size gets the same address back at
 * once (the next allocation finds the block free: reuse at once). *synced: whether any
 * synchronization of the library happened in between (the reclaim thread's, or a wait). */
static bool reused(bool *synced)
{
    CUdeviceptr a = 0, b = 0, keep = 0;
    if (cuMemAlloc(&keep, 4096) != CUDA_SUCCESS || cuMemAlloc(&a, 3 * MiB) != CUDA_SUCCESS)
        return false;
    long long syncs = counter("syncs");
    cuMemFree(a);
    bool same = cuMemAlloc(&b, 3 * MiB) == CUDA_SUCCESS && b == a;
    *synced = counter("syncs") != syncs;
    cuMemFree(b);
    cuMemFree(keep);
    return same;
}

static bool reused_at_once(void)
{
    bool synced;
    return reused(&synced);
}

/* Freed memory is not handed out again before the GPU has passed its free: either another
 * address, or the same one after a synchronization (the reclaim thread releases parked frees
 * by itself, so a later request may well get the same address back). */
static bool parked_until_passed(void)
{
    bool synced;
    return !reused(&synced) || synced;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    ip_require_preloaded();
    stats_json = (int (*)(char *, size_t))dlsym(RTLD_DEFAULT, "vmm_stats_json");
    CHECK(stats_json != NULL, "vmm_stats_json found through dlsym(RTLD_DEFAULT)");
    if (!stats_json)
        return 1;
    ip_linked_primary_context();

    CHECK(reused_at_once(), "before any stream: a freed buffer serves the next request at once");
    CUstream lib = NULL, own = NULL;
    CHECK_RC(ipt_cublaslt_make_stream(&lib), CUDA_SUCCESS, "libcublasLt.so makes a stream");
    CHECK(counter("library_streams") == 1 && counter("queue_splits") == 0,
          "counted as a math library's own stream (library_streams %lld, queue_splits %lld)",
          counter("library_streams"), counter("queue_splits"));
    CHECK(reused_at_once(), "after it: still reused at once");

    CHECK_RC(cuStreamCreate(&own, 0), CUDA_SUCCESS, "the program makes a stream");
    CHECK(counter("queue_splits") == 1, "a second queue of the program's work (queue_splits %lld)",
          counter("queue_splits"));
    CHECK(parked_until_passed(),
          "after it: a freed buffer is not handed out before the GPU has passed its free");
    CHECK_RC(cuStreamDestroy(own), CUDA_SUCCESS, "cuStreamDestroy (own)");
    CHECK_RC(cuStreamDestroy(lib), CUDA_SUCCESS, "cuStreamDestroy (library's)");
    printf("%s: ip_streams (%d checks)\n", ip_failures ? "FAIL" : "PASS", ip_checks);
    return ip_failures ? 1 : 0;
}
