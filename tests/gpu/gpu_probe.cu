/* The suite's 'gpu' test: is there a usable CUDA device? 0 with its name, 77 (SKIP) with the
 * reason when there is none, so a machine without a GPU shows the suite as skipped, never as
 * passed. */
#include "gpu_common.h"

/* Which host memory cudaHostGetFlags accepts (torch_memory_saver's cpu_backup example asks it of
 * a backup's address, docs/PYTORCH.md): allocated pinned, registered (the library's kept pinned
 * backups are registered pageable memory), pageable, registered then unregistered. INFO only. */
static void host_flags_probe(void)
{
    const size_t n = 2 * MiB;
    unsigned flags = 0;
    void *alloc = NULL;
    if (cudaHostAlloc(&alloc, n, cudaHostAllocDefault) == cudaSuccess) {
        INFO("cudaHostGetFlags of cudaHostAlloc memory: %d", (int)cudaHostGetFlags(&flags, alloc));
        cudaFreeHost(alloc);
    }
    char *page = (char *)aligned_alloc(4096, n);
    if (!page)
        return;
    memset(page, 1, n);
    INFO("cudaHostGetFlags of pageable memory: %d", (int)cudaHostGetFlags(&flags, page + 4096));
    if (cudaHostRegister(page, n, cudaHostRegisterDefault) == cudaSuccess) {
        INFO("cudaHostGetFlags of registered memory (inside it): %d",
             (int)cudaHostGetFlags(&flags, page + 4096));
        cudaHostUnregister(page);
        INFO("cudaHostGetFlags after unregistering: %d", (int)cudaHostGetFlags(&flags, page));
    }
    (void)cudaGetLastError(); /* the refusals above are expected answers, not errors */
    free(page);
}

int main(void)
{
    gt_init("gpu_probe");
    int n = 0;
    CK(cudaGetDeviceCount(&n));
    for (int i = 0; i < n; i++) {
        cudaDeviceProp p;
        memset(&p, 0, sizeof p);
        CK(cudaGetDeviceProperties(&p, i));
        INFO("device %d: %s, cc %d.%d, %zu MiB, %d SMs", i, p.name, p.major, p.minor,
             (size_t)(p.totalGlobalMem / MiB), p.multiProcessorCount);
    }
    /* One kernel round trip, so "a device exists" also means "kernels of this build run". */
    void *d = NULL;
    if (CK(cudaMalloc(&d, 4096)) == 0) {
        gt_fill(d, 4096, 42);
        CHECK(gt_verify(d, 4096, 42) == 0, "probe kernel round trip");
        CK(cudaFree(d));
    }
    host_flags_probe();
    return gt_finish();
}
