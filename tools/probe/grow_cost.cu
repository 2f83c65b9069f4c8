// Probe (GPU machine, no hook): what an in-place VMM grow by one 2 MiB chunk costs depending on
// how the buffer before it was built: one big chunk, or many chunks in the same reservation.
// Prints one line per layout with the median of several grows (create + map + access).
// GROW_COST_TOUCH=1: a kernel reads the whole buffer (and finishes) before each grow.
//   nvcc -O2 -o grow_cost tools/probe/grow_cost.cu -lcuda && ./grow_cost
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cuda.h>
#include <vector>

#define CK(x)                                                                                      \
    do {                                                                                           \
        CUresult r_ = (x);                                                                         \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            printf("error %d at %s:%d\n", (int)r_, __FILE__, __LINE__);                            \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* Reads every word of the buffer, as the demo's verification does between grows. */
__global__ void touch(const unsigned *p, size_t n, unsigned *sink)
{
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        acc += p[i];
    if (acc == 0x12345678u)
        *sink = acc;
}

static double now_us()
{
    return std::chrono::duration<double, std::micro>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

int main()
{
    if (cuInit(0) != CUDA_SUCCESS) {
        printf("SKIP: no CUDA driver\n");
        return 77;
    }
    CUdevice dev;
    CUcontext ctx;
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemAccessDesc acc = {};
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    const size_t G = 2u << 20;
    struct Layout {
        const char *name;
        size_t chunks, chunk;
    } layouts[] = {{"1 x 2 MiB", 1, G},         {"1 x 1 GiB", 1, 512 * G},
                   {"1 x 8 GiB", 1, 4096 * G},   {"16 x 2 MiB", 16, G},
                   {"64 x 2 MiB", 64, G},        {"13 doubling chunks to 8 GiB", 13, 0},
                   {"256 x 2 MiB", 256, G}};
    for (auto &L : layouts) {
        size_t total = 0;
        std::vector<size_t> sizes;
        for (size_t i = 0; i < L.chunks; i++) {
            size_t s = L.chunk ? L.chunk : (i == 0 ? G : (G << (i - 1)));
            sizes.push_back(s);
            total += s;
        }
        const int grows = 9;
        CUdeviceptr base;
        size_t reserve = total + (size_t)(grows + 1) * G;
        CK(cuMemAddressReserve(&base, reserve, 0, 0, 0));
        std::vector<CUmemGenericAllocationHandle> h;
        std::vector<size_t> hs;
        size_t off = 0;
        for (size_t s : sizes) {
            CUmemGenericAllocationHandle a;
            CK(cuMemCreate(&a, s, &prop, 0));
            CK(cuMemMap(base + off, s, 0, a, 0));
            CK(cuMemSetAccess(base + off, s, &acc, 1));
            h.push_back(a);
            hs.push_back(s);
            off += s;
        }
        std::vector<double> t, tc, tm, ta;
        bool touch_first = getenv("GROW_COST_TOUCH") != nullptr;
        for (int g = 0; g < grows; g++) {
            if (touch_first) { /* a kernel over the whole buffer, finished before the grow */
                touch<<<264, 512>>>((const unsigned *)base, off / sizeof(unsigned),
                                    (unsigned *)base);
            }
            CK(cuCtxSynchronize());
            double t0 = now_us();
            CUmemGenericAllocationHandle a;
            CK(cuMemCreate(&a, G, &prop, 0));
            double t1 = now_us();
            CK(cuMemMap(base + off, G, 0, a, 0));
            double t2 = now_us();
            CK(cuMemSetAccess(base + off, G, &acc, 1));
            double t3 = now_us();
            t.push_back(t3 - t0);
            tc.push_back(t1 - t0);
            tm.push_back(t2 - t1);
            ta.push_back(t3 - t2);
            h.push_back(a);
            hs.push_back(G);
            off += G;
        }
        auto med = [](std::vector<double> v) {
            std::sort(v.begin(), v.end());
            return v[v.size() / 2];
        };
        printf("RESULT grow_cost%s layout=\"%s\" grow_us=%.1f create=%.1f map=%.1f access=%.1f\n",
               touch_first ? ".after_kernel" : "", L.name, med(t), med(tc), med(tm), med(ta));
        off = 0;
        for (size_t i = 0; i < h.size(); i++) {
            CK(cuMemUnmap(base + off, hs[i]));
            CK(cuMemRelease(h[i]));
            off += hs[i];
        }
        CK(cuMemAddressFree(base, reserve));
    }
    return 0;
}
