/* The suite's 'gpu' test: is there a usable CUDA device? 0 with its name, 77 (SKIP) with the
 * reason when there is none, so a machine without a GPU shows the suite as skipped, never as
 * passed. */
#include "gpu_common.h"

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
    return gt_finish();
}
