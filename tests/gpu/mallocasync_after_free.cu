/* mallocasync_after_free: memory freed with cudaFree is available to the process's other
 * allocators (issue 14, "memory the library holds goes back when anyone in the process needs
 * it").
 *
 * Three times: cudaMalloc 70% of the device's memory (in 1 GiB buffers, each written),
 * cudaFree all of it (under the hook it goes to the hook's cache or parks), then ask another
 * allocator of the process for 30% in one piece and write it:
 *   1  cudaMallocAsync on the device's default pool,
 *   2  cudaMallocFromPoolAsync on a pool of its own (cuMemAllocFromPoolAsync),
 *   3  cuMemCreate of one physical handle (a program's own VMM, as NCCL's).
 * Natively each succeeds (the memory is free); under the hook each must too.
 * It needs the GPU to itself: run it alone.
 *
 * Usage: mallocasync_after_free [free_pct=70] [ask_pct=30]
 * Compared part (R lines): OK/FAIL and the code of each allocation. */
#include "gpu_common.h"

typedef CUresult (*mem_create_fn)(CUmemGenericAllocationHandle *, size_t,
                                  const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*mem_release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*mem_gran_fn)(size_t *, const CUmemAllocationProp *,
                                CUmemAllocationGranularity_flags);

/* cudaMalloc's pct of total in 1 GiB buffers (the last one smaller), each memset, then all
 * freed. Returns the bytes that were allocated. */
static size_t fill_and_free(size_t total, int pct)
{
    size_t want = total / 100 * (size_t)pct, got = 0;
    const size_t piece = 1 * GiB;
    void *bufs[1024];
    int n = 0;
    while (got < want && n < 1024) {
        size_t sz = want - got < piece ? want - got : piece;
        sz = (sz + 2 * MiB - 1) & ~(2 * MiB - 1);
        void *p = NULL;
        cudaError_t e = cudaMalloc(&p, sz);
        if (e != cudaSuccess) {
            INFO("cudaMalloc(%zu) after %zu bytes -> %d (%s)", sz, got, (int)e,
                 cudaGetErrorString(e));
            cudaGetLastError();
            break;
        }
        CK(cudaMemsetAsync(p, 0x5A, sz, 0));
        bufs[n++] = p;
        got += sz;
    }
    CK(cudaDeviceSynchronize());
    for (int i = 0; i < n; i++)
        CK(cudaFree(bufs[i]));
    return got;
}

static const char *verdict(int code)
{
    return code == 0 ? "OK" : "FAIL";
}

int main(int argc, char **argv)
{
    gt_init("mallocasync_after_free");
    int free_pct = argc > 1 ? atoi(argv[1]) : 70;
    int ask_pct = argc > 2 ? atoi(argv[2]) : 30;
    R("free %d%% with cudaFree, then ask %d%% of another allocator", free_pct, ask_pct);
    size_t fr = 0, total = 0;
    CK(cudaMemGetInfo(&fr, &total));
    INFO("cudaMemGetInfo at start: free %zu MiB of %zu MiB", fr / MiB, total / MiB);
    const size_t ask = (total / 100 * (size_t)ask_pct + 2 * MiB - 1) & ~(2 * MiB - 1);
    cudaStream_t s = NULL;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    /* 1: the default pool. */
    {
        size_t got = fill_and_free(total, free_pct);
        R("1 cudaMalloc'd and freed %s of the %d%%", got >= total / 100 * free_pct ? "all" : "part",
          free_pct);
        CK(cudaMemGetInfo(&fr, &total));
        INFO("after the frees: cudaMemGetInfo free %zu MiB; asking %zu MiB", fr / MiB, ask / MiB);
        void *p = NULL;
        int rc = (int)cudaMallocAsync(&p, ask, s);
        if (rc == 0) {
            CK(cudaMemsetAsync(p, 0x11, ask, s));
            CK(cudaFreeAsync(p, s));
        }
        cudaGetLastError();
        int rs = (int)cudaStreamSynchronize(s);
        R("1 cudaMallocAsync(%d%%) on the default pool: %s (code %d, sync %d)", ask_pct,
          verdict(rc), rc, rs);
        CHECK(rc == 0, "cudaMallocAsync(%zu MiB) after cudaFree of %d%% -> %d (%s)", ask / MiB,
              free_pct, rc, cudaGetErrorString((cudaError_t)rc));
        cudaMemPool_t dp = NULL;
        if (CK(cudaDeviceGetDefaultMemPool(&dp, 0)) == 0)
            CK(cudaMemPoolTrimTo(dp, 0));
    }
    /* 2: a pool of the program's own. */
    {
        size_t got = fill_and_free(total, free_pct);
        R("2 cudaMalloc'd and freed %s of the %d%%", got >= total / 100 * free_pct ? "all" : "part",
          free_pct);
        cudaMemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = 0;
        cudaMemPool_t pool = NULL;
        int rp = CK(cudaMemPoolCreate(&pool, &props));
        int rc = -1, rs = -1;
        if (rp == 0) {
            void *p = NULL;
            rc = (int)cudaMallocFromPoolAsync(&p, ask, pool, s);
            if (rc == 0) {
                CK(cudaMemsetAsync(p, 0x22, ask, s));
                CK(cudaFreeAsync(p, s));
            }
            cudaGetLastError();
            rs = (int)cudaStreamSynchronize(s);
            CK(cudaMemPoolTrimTo(pool, 0));
            CK(cudaMemPoolDestroy(pool));
        }
        R("2 cudaMallocFromPoolAsync(%d%%) on its own pool: %s (code %d, sync %d)", ask_pct,
          verdict(rc), rc, rs);
        CHECK(rc == 0, "cudaMallocFromPoolAsync(%zu MiB) after cudaFree of %d%% -> %d", ask / MiB,
              free_pct, rc);
    }
    /* 3: the program's own physical handle. */
    {
        size_t got = fill_and_free(total, free_pct);
        R("3 cudaMalloc'd and freed %s of the %d%%", got >= total / 100 * free_pct ? "all" : "part",
          free_pct);
        mem_create_fn create = gt_entry<mem_create_fn>("cuMemCreate", 12000);
        mem_release_fn release = gt_entry<mem_release_fn>("cuMemRelease", 12000);
        mem_gran_fn gran = gt_entry<mem_gran_fn>("cuMemGetAllocationGranularity", 12000);
        int rc = -1;
        if (create && release && gran) {
            CUmemAllocationProp prop;
            memset(&prop, 0, sizeof prop);
            prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = 0;
            size_t g = 0;
            CKD(gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
            if (g == 0)
                g = 2 * MiB;
            size_t sz = (ask + g - 1) / g * g;
            CUmemGenericAllocationHandle h = 0;
            rc = (int)create(&h, sz, &prop, 0);
            if (rc == 0)
                CKD(release(h));
        }
        R("3 cuMemCreate(%d%%): %s (code %d)", ask_pct, verdict(rc), rc);
        CHECK(rc == 0, "cuMemCreate(%zu MiB) after cudaFree of %d%% -> CUresult %d", ask / MiB,
              free_pct, rc);
    }
    CK(cudaStreamDestroy(s));
    gt_trim();
    return gt_finish();
}
