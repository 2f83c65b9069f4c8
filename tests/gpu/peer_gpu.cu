/* peer_gpu: peer access to cudaMalloc buffers between two GPUs, with and without the hook.
 *
 * Needs two devices that can reach each other (exits 77 saying so otherwise). Device 0 holds a
 * 64 MiB and a 4 KiB buffer (packed under the hook) with patterns; device 1 enables peer access
 * to device 0 (cudaDeviceEnablePeerAccess, which reaches cuCtxEnablePeerAccess through
 * cuGetProcAddress: the hook then grants device 1 access to device 0's served memory), runs a
 * kernel that reads device 0's buffers, one that writes them, copies between the devices
 * (cudaMemcpyPeer and plain cudaMemcpy over unified addressing), reads a buffer device 0
 * allocated after the enable, then disables and enables again.
 *
 * R lines (compared native vs hooked): codes and mismatch counts. */
#include "gpu_common.h"

static void *on_device(int dev, size_t n)
{
    void *p = NULL;
    CK(cudaSetDevice(dev));
    CK(cudaMalloc(&p, n));
    return p;
}

/* Verify on device `dev` (a kernel there) the pattern of seed in p (which may live elsewhere). */
static unsigned long long verify_on(int dev, const void *p, size_t n, uint64_t seed,
                                    const char *what)
{
    CK(cudaSetDevice(dev));
    return gt_verify(p, n, seed, 0, 0, what);
}

int main(void)
{
    gt_init("peer_gpu");
    int n = 0;
    CK(cudaGetDeviceCount(&n));
    if (n < 2)
        gt_skip("peer access needs 2 GPUs; this machine has %d", n);
    int can10 = 0, can01 = 0;
    CK(cudaDeviceCanAccessPeer(&can10, 1, 0));
    CK(cudaDeviceCanAccessPeer(&can01, 0, 1));
    if (!can10)
        gt_skip("device 1 cannot access device 0 (cudaDeviceCanAccessPeer = 0)");
    INFO("peer: 1 -> 0 %d, 0 -> 1 %d", can10, can01);

    const size_t big = 64 * MiB, small = 4 * KiB;
    void *b0 = on_device(0, big);
    void *s0 = on_device(0, small);
    CHECK_OWNS(b0, 1, "device 0's big buffer");
    CHECK_OWNS(s0, 1, "device 0's small buffer");
    CK(cudaSetDevice(0));
    gt_fill(b0, big, 1);
    gt_fill(s0, small, 2);
    CK(cudaDeviceSynchronize());

    /* Device 1 reaches device 0's memory. */
    CK(cudaSetDevice(1));
    cudaError_t e = cudaDeviceEnablePeerAccess(0, 0);
    R("enable 1->0: %d", (int)e);
    R("device 1 reads device 0's big buffer: %llu mismatches",
      verify_on(1, b0, big, 1, "big read from device 1"));
    R("device 1 reads device 0's small buffer: %llu mismatches",
      verify_on(1, s0, small, 2, "small read from device 1"));
    CK(cudaSetDevice(1));
    gt_fill(b0, big, 3); /* device 1 writes device 0's memory */
    CK(cudaDeviceSynchronize());
    R("device 0 sees what device 1 wrote: %llu mismatches",
      verify_on(0, b0, big, 3, "device 1's write, read on device 0"));

    /* Copies between the devices. */
    void *b1 = on_device(1, big);
    CK(cudaMemcpyPeer(b1, 1, b0, 0, big));
    CK(cudaDeviceSynchronize());
    R("cudaMemcpyPeer 0->1: %llu mismatches", verify_on(1, b1, big, 3, "peer copy"));
    CK(cudaSetDevice(1));
    gt_fill(b1, big, 4);
    CK(cudaMemcpy(b0, b1, big, cudaMemcpyDefault));
    R("cudaMemcpy 1->0 (unified addressing): %llu mismatches",
      verify_on(0, b0, big, 4, "default copy"));

    /* A buffer device 0 allocates after the enable: reachable too. */
    void *later = on_device(0, 8 * MiB);
    CK(cudaSetDevice(0));
    gt_fill(later, 8 * MiB, 5);
    CK(cudaDeviceSynchronize());
    R("device 1 reads a later buffer of device 0: %llu mismatches",
      verify_on(1, later, 8 * MiB, 5, "later buffer from device 1"));

    /* Off and on again. (Touching device 0's memory from device 1 while off would fault: not
     * done; the codes are compared.) */
    CK(cudaSetDevice(1));
    e = cudaDeviceDisablePeerAccess(0);
    R("disable 1->0: %d", (int)e);
    e = cudaDeviceDisablePeerAccess(0);
    cudaGetLastError();
    R("disable again: %d", (int)e);
    e = cudaDeviceEnablePeerAccess(0, 0);
    R("enable again: %d", (int)e);
    e = cudaDeviceEnablePeerAccess(0, 0);
    cudaGetLastError();
    R("enable twice: %d", (int)e);
    R("after re-enabling, device 1 reads the small buffer: %llu mismatches",
      verify_on(1, s0, small, 2, "small after re-enable"));
    CK(cudaSetDevice(1));
    CK(cudaDeviceDisablePeerAccess(0));

    CK(cudaSetDevice(1));
    CK(cudaFree(b1));
    CK(cudaSetDevice(0));
    CK(cudaFree(b0));
    CK(cudaFree(s0));
    CK(cudaFree(later));
    gt_trim();
    return gt_finish();
}
