/* hello: the README's "main job" demo. An ordinary CUDA program that knows nothing of the hook:
 * it allocates a few buffers of different sizes with cudaMalloc, runs a kernel, checks the
 * result, frees, and says what it did. Run it plainly, then under the hook:
 *
 *   ./hello
 *   LD_PRELOAD=/path/to/libvmmhook.so VMMHOOK_STATS=1 ./hello
 *
 * The output is the same both ways, except the line saying whether the hook is loaded; under
 * the hook with VMMHOOK_STATS=1 the hook prints its statistics table when the program exits.
 * Exit: 0 ok, 1 no GPU ("no CUDA GPU found: ...") or a wrong result or a CUDA error.
 */
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "vmmhook.h"

#define CK(x)                                                                                     \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "hello: %s failed: %s\n", #x, cudaGetErrorString(e_));                \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

/* y = a * x + y; and a count of elements differing from the expected value. */
__global__ void saxpy(size_t n, float a, const float *x, float *y)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = a * x[i] + y[i];
}

__global__ void count_wrong(size_t n, const float *y, unsigned int *wrong)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        if (y[i] != 2.0f * (float)(i % 1000) + 1.0f)
            atomicAdd(wrong, 1u);
}

int main()
{
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("no CUDA GPU found: %s\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 1;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("hello: GPU 0 is %s, %.1f GiB\n", prop.name, (double)prop.totalGlobalMem / (1 << 30));
    if (vmm_hook_available()) {
        int (*ver)(void) = (int (*)(void))vmm_fn("vmm_version");
        int v = ver ? ver() : 0;
        printf("hello: libvmmhook %d.%d.%d is loaded: it serves the allocations below\n",
               v / 10000, v / 100 % 100, v % 100);
    } else {
        printf("hello: libvmmhook is not loaded (try LD_PRELOAD=/path/to/libvmmhook.so "
               "VMMHOOK_STATS=1)\n");
    }

    const size_t n = size_t(8) << 20; /* 8 Mi floats: 32 MiB per vector */
    unsigned int *wrong = nullptr;    /* 4 bytes */
    char *scratch = nullptr;          /* an odd size: 1 MiB + 3 bytes */
    float *x = nullptr, *y = nullptr;
    const size_t scratch_bytes = (size_t(1) << 20) + 3;
    CK(cudaMalloc(&wrong, sizeof *wrong));
    CK(cudaMalloc(&scratch, scratch_bytes));
    CK(cudaMalloc(&x, n * sizeof *x));
    CK(cudaMalloc(&y, n * sizeof *y));
    printf("hello: cudaMalloc %zu B -> %p, %zu B -> %p, %zu MiB -> %p, %zu MiB -> %p\n",
           sizeof *wrong, (void *)wrong, scratch_bytes, (void *)scratch,
           n * sizeof *x >> 20, (void *)x, n * sizeof *y >> 20, (void *)y);

    std::vector<float> hx(n), hy(n);
    for (size_t i = 0; i < n; ++i) {
        hx[i] = (float)(i % 1000);
        hy[i] = 1.0f;
    }
    CK(cudaMemcpy(x, hx.data(), n * sizeof *x, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(y, hy.data(), n * sizeof *y, cudaMemcpyHostToDevice));
    CK(cudaMemset(scratch, 0xab, scratch_bytes));
    CK(cudaMemset(wrong, 0, sizeof *wrong));

    const int blocks = prop.multiProcessorCount * 4;
    saxpy<<<blocks, 256>>>(n, 2.0f, x, y);
    CK(cudaGetLastError());
    count_wrong<<<blocks, 256>>>(n, y, wrong);
    CK(cudaGetLastError());
    unsigned int dev_wrong = 0;
    CK(cudaMemcpy(&dev_wrong, wrong, sizeof dev_wrong, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hy.data(), y, n * sizeof *y, cudaMemcpyDeviceToHost));
    size_t host_wrong = 0;
    for (size_t i = 0; i < n; ++i)
        host_wrong += hy[i] != 2.0f * hx[i] + 1.0f;
    std::vector<unsigned char> hs(scratch_bytes);
    CK(cudaMemcpy(hs.data(), scratch, scratch_bytes, cudaMemcpyDeviceToHost));
    size_t scratch_wrong = 0;
    for (unsigned char b : hs)
        scratch_wrong += b != 0xab;
    printf("hello: kernel y = 2*x + y over %zu floats: %u wrong (device check), %zu wrong (host "
           "check); memset of %zu B: %zu wrong bytes\n",
           n, dev_wrong, host_wrong, scratch_bytes, scratch_wrong);

    CK(cudaFree(y));
    CK(cudaFree(x));
    CK(cudaFree(scratch));
    CK(cudaFree(wrong));
    printf("hello: freed 4 buffers\n");
    const bool ok = dev_wrong == 0 && host_wrong == 0 && scratch_wrong == 0;
    printf("hello: %s\n", ok ? "OK" : "FAILED");
    return ok ? 0 : 1;
}
