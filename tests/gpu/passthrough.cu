/* passthrough: memory the hook must leave alone still works under it, and is not counted.
 *
 * The program's own VMM memory (cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess,
 * fetched through cuGetProcAddress as NCCL and PyTorch's expandable segments do), stream-ordered
 * pools (cudaMallocAsync, cudaMallocFromPoolAsync), managed memory, pinned host memory
 * (cudaMallocHost, cudaHostAlloc mapped, cudaHostRegister): kernels write and read each, copies
 * between them and a cudaMalloc buffer (served) work, range queries answer what native answers
 * (compared), and vmm_owns() is 0 for all of them and 1 for the cudaMalloc buffers.
 *
 * Prints "I expect_served_allocs=N": the number of allocations the hook should have served
 * (the cudaMalloc calls); tools/gpu-suite.sh checks the hook's served_allocs against it. */
#include "gpu_common.h"

static unsigned g_served_expected;
static uintptr_t g_freed[64];
static size_t g_nfreed;

static gt_range_fn range_fn;
static gt_attr_fn attr_fn;

/* Range answers for an interior pointer q of memory that starts at base: compared, not
 * asserted (the native answer is whatever the driver gives for that kind of memory). */
static void range_report(const char *label, const void *base, const void *q)
{
    CUdeviceptr b = 0;
    size_t sz = 0;
    CUresult r = range_fn ? range_fn(&b, &sz, (CUdeviceptr)q) : CUDA_ERROR_UNKNOWN;
    long long off = r == CUDA_SUCCESS ? (long long)(b - (CUdeviceptr)base) : 0;
    R("range %s code=%d base_off=%lld size=%zu", label, (int)r, off, r == CUDA_SUCCESS ? sz : 0);
    if (attr_fn) {
        CUdeviceptr st = 0;
        size_t rs = 0;
        CUresult r1 = attr_fn(&st, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, (CUdeviceptr)q);
        CUresult r2 = attr_fn(&rs, CU_POINTER_ATTRIBUTE_RANGE_SIZE, (CUdeviceptr)q);
        R("attr %s start_code=%d start_off=%lld size_code=%d size=%zu", label, (int)r1,
          r1 == CUDA_SUCCESS ? (long long)(st - (CUdeviceptr)base) : 0LL, (int)r2,
          r2 == CUDA_SUCCESS ? rs : 0);
    }
    cudaPointerAttributes pa;
    memset(&pa, 0, sizeof pa);
    cudaError_t e = cudaPointerGetAttributes(&pa, q);
    R("cudaPointerGetAttributes %s code=%d type=%d", label, (int)e, (int)pa.type);
    cudaGetLastError();
}

static void *served_malloc(size_t n)
{
    void *p = NULL;
    if (CK(cudaMalloc(&p, n)))
        return NULL;
    g_served_expected++;
    CHECK_OWNS(p, 1, "cudaMalloc buffer");
    return p;
}

static void served_free(void *p)
{
    if (!p)
        return;
    CK(cudaFree(p));
    g_freed[g_nfreed++] = (uintptr_t)p;
}

/* The program's own VMM mappings: two granularity-sized chunks and one of 64 MiB, adjacent
 * in one reservation, one cuMemSetAccess over all. */
static void app_vmm(void *served, size_t served_n, uint64_t served_seed)
{
    auto granf =
        gt_entry<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity");
    auto createf = gt_entry<decltype(&cuMemCreate)>("cuMemCreate");
    auto reservef = gt_entry<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
    auto mapf = gt_entry<decltype(&cuMemMap)>("cuMemMap");
    auto accessf = gt_entry<decltype(&cuMemSetAccess)>("cuMemSetAccess");
    auto unmapf = gt_entry<decltype(&cuMemUnmap)>("cuMemUnmap");
    auto releasef = gt_entry<decltype(&cuMemRelease)>("cuMemRelease");
    auto vafreef = gt_entry<decltype(&cuMemAddressFree)>("cuMemAddressFree");
    if (!granf || !createf || !reservef || !mapf || !accessf || !unmapf || !releasef || !vafreef)
        return;

    CUmemAllocationProp prop = gt_device_prop();
    size_t g = 0;
    if (CKD(granf(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) || g == 0)
        return;
    R("app vmm granularity=%zu", g);
    const size_t sizes[3] = {g, g, 64 * MiB};
    const size_t total = 2 * g + 64 * MiB;
    CUmemGenericAllocationHandle h[3] = {0, 0, 0};
    CUdeviceptr va = 0;
    int ok = 1;
    for (int i = 0; i < 3 && ok; i++)
        ok = CKD(createf(&h[i], sizes[i], &prop, 0)) == 0;
    ok = ok && CKD(reservef(&va, total, 0, 0, 0)) == 0;
    size_t off = 0;
    int mapped = 0;
    for (int i = 0; i < 3 && ok; i++) {
        ok = CKD(mapf(va + off, sizes[i], 0, h[i], 0)) == 0;
        mapped += ok;
        off += sizes[i];
    }
    if (ok) {
        CUmemAccessDesc ad;
        memset(&ad, 0, sizeof ad);
        ad.location = prop.location;
        ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        ok = CKD(accessf(va, total, &ad, 1)) == 0;
    }
    if (ok) {
        void *p = (void *)va;
        CHECK_OWNS(p, 0, "app cuMemCreate mapping");
        CHECK_OWNS((char *)p + g + 5, 0, "app cuMemCreate mapping (2nd chunk)");
        CHECK_OWNS((char *)p + total - 1, 0, "app cuMemCreate mapping (last byte)");
        gt_fill(p, total, 31);
        unsigned long long bad = gt_verify(p, total, 31, 0, 0, "app VMM");
        /* Copies between the served buffer and the app's mapping, both ways. */
        CK(cudaMemcpy(p, served, served_n, cudaMemcpyDeviceToDevice));
        unsigned long long bad_in = gt_verify(p, served_n, served_seed, 0, 0, "served -> app VMM");
        gt_fill(p, served_n, 32);
        CK(cudaMemcpy(served, p, served_n, cudaMemcpyDeviceToDevice));
        unsigned long long bad_out = gt_verify(served, served_n, 32, 0, 0, "app VMM -> served");
        R("app vmm data_bad=%llu copy_in_bad=%llu copy_out_bad=%llu", bad, bad_in, bad_out);
        CHECK(bad == 0 && bad_in == 0 && bad_out == 0, "app VMM data: %llu / %llu / %llu", bad,
              bad_in, bad_out);
        range_report("app_vmm_chunk2", p, (char *)p + g + 5);
        range_report("app_vmm_chunk3", p, (char *)p + 2 * g + 3 * MiB);
        cudaError_t e = cudaFree(p);
        cudaError_t last = cudaGetLastError();
        R("cudaFree(app VMM pointer) code=%d last=%d", (int)e, (int)last);
        CHECK(e != cudaSuccess, "cudaFree of the application's own VMM pointer succeeded");
        /* Still mapped and usable after the refused free. */
        gt_fill(p, total, 33);
        bad = gt_verify(p, total, 33, 0, 0, "app VMM rewrite");
        CHECK(bad == 0, "app VMM unusable after a refused cudaFree: %llu bad", bad);
    }
    CK(cudaDeviceSynchronize());
    off = 0;
    for (int i = 0; i < mapped; i++) {
        CKD(unmapf(va + off, sizes[i]));
        off += sizes[i];
    }
    for (int i = 0; i < 3; i++)
        if (h[i])
            CKD(releasef(h[i]));
    if (va)
        CKD(vafreef(va, total));
}

static void pools(cudaStream_t s)
{
    /* The default pool, small and large. */
    const size_t ns[2] = {1000, 64 * MiB};
    for (int i = 0; i < 2; i++) {
        void *p = NULL;
        if (CK(cudaMallocAsync(&p, ns[i], s)))
            continue;
        CHECK_OWNS(p, 0, "cudaMallocAsync block");
        gt_fill(p, ns[i], 40 + i, s);
        unsigned long long bad = gt_verify(p, ns[i], 40 + i, s, 0, "cudaMallocAsync");
        CHECK(bad == 0, "cudaMallocAsync(%zu) data: %llu bad", ns[i], bad);
        char label[48];
        snprintf(label, sizeof label, "mallocasync_%zu_mid", ns[i]);
        range_report(label, p, (char *)p + ns[i] / 2);
        CK(cudaFreeAsync(p, s));
    }
    /* An explicit pool. */
    cudaMemPoolProps pp;
    memset(&pp, 0, sizeof pp);
    pp.allocType = cudaMemAllocationTypePinned;
    pp.location.type = cudaMemLocationTypeDevice;
    pp.location.id = 0;
    cudaMemPool_t pool;
    if (CK(cudaMemPoolCreate(&pool, &pp)) == 0) {
        void *p = NULL;
        if (CK(cudaMallocFromPoolAsync(&p, 4 * MiB + 17, pool, s)) == 0) {
            CHECK_OWNS(p, 0, "cudaMallocFromPoolAsync block");
            gt_fill(p, 4 * MiB + 17, 50, s);
            CHECK(gt_verify(p, 4 * MiB + 17, 50, s, 0, "pool") == 0, "explicit pool data");
            range_report("pool_mid", p, (char *)p + 2 * MiB);
            CK(cudaFreeAsync(p, s));
        }
        CK(cudaStreamSynchronize(s));
        CK(cudaMemPoolDestroy(pool));
    }
    /* cudaFree of a cudaMallocAsync block: passes through to the driver, code compared. */
    void *p = NULL;
    if (CK(cudaMallocAsync(&p, 4096, s)) == 0) {
        CK(cudaStreamSynchronize(s));
        cudaError_t e = cudaFree(p);
        R("cudaFree(cudaMallocAsync block) code=%d", (int)e);
        if (e != cudaSuccess) {
            cudaGetLastError();
            CK(cudaFreeAsync(p, s));
        }
    }
    CK(cudaStreamSynchronize(s));
}

static void managed(void)
{
    const size_t n = 16 * MiB;
    void *u = NULL;
    if (CK(cudaMallocManaged(&u, n)))
        return;
    CHECK_OWNS(u, 0, "cudaMallocManaged block");
    gt_fill(u, n, 60);
    CK(cudaDeviceSynchronize());
    uint8_t *h = (uint8_t *)malloc(n);
    gt_host_pattern(h, n, 60);
    size_t bad = 0;
    for (size_t j = 0; j < n; j++) /* the host reads managed memory directly */
        bad += ((uint8_t *)u)[j] != h[j];
    gt_host_pattern((uint8_t *)u, n, 61); /* the host writes, a kernel reads */
    unsigned long long bad2 = gt_verify(u, n, 61, 0, 0, "managed host write");
    R("managed host_read_bad=%zu device_read_bad=%llu", bad, bad2);
    CHECK(bad == 0 && bad2 == 0, "managed data: %zu / %llu", bad, bad2);
    range_report("managed_mid", u, (char *)u + n / 2);
    free(h);
    CK(cudaFree(u));
}

static void pinned(void)
{
    const size_t n = 8 * MiB;
    /* cudaMallocHost: with unified addressing, kernels use the host pointer itself. */
    void *h = NULL;
    if (CK(cudaMallocHost(&h, n)) == 0) {
        CHECK_OWNS(h, 0, "cudaMallocHost block");
        gt_fill(h, n, 70);
        CK(cudaDeviceSynchronize());
        uint8_t *want = (uint8_t *)malloc(n);
        gt_host_pattern(want, n, 70);
        int same = memcmp(h, want, n) == 0;
        R("cudaMallocHost kernel_write_ok=%d", same);
        CHECK(same, "kernel writes to cudaMallocHost memory");
        range_report("mallochost_mid", h, (char *)h + n / 2);
        free(want);
        CK(cudaFreeHost(h));
    }
    /* cudaHostAlloc(mapped), through its device pointer. */
    void *hm = NULL, *dm = NULL;
    if (CK(cudaHostAlloc(&hm, n, cudaHostAllocMapped)) == 0) {
        CK(cudaHostGetDevicePointer(&dm, hm, 0));
        CHECK_OWNS(hm, 0, "cudaHostAlloc block");
        CHECK_OWNS(dm, 0, "cudaHostAlloc device pointer");
        gt_host_pattern((uint8_t *)hm, n, 71);
        unsigned long long bad = gt_verify(dm, n, 71, 0, 0, "mapped host");
        R("cudaHostAlloc device_read_bad=%llu", bad);
        CHECK(bad == 0, "kernel reads of mapped host memory: %llu bad", bad);
        CK(cudaFreeHost(hm));
    }
    /* cudaHostRegister of ordinary memory. */
    void *reg = NULL;
    if (posix_memalign(&reg, 4096, n) == 0) {
        memset(reg, 0, n);
        if (CK(cudaHostRegister(reg, n, cudaHostRegisterMapped)) == 0) {
            void *dr = NULL;
            CK(cudaHostGetDevicePointer(&dr, reg, 0));
            CHECK_OWNS(dr, 0, "cudaHostRegister device pointer");
            gt_fill(dr, n, 72);
            CK(cudaDeviceSynchronize());
            uint8_t *want = (uint8_t *)malloc(n);
            gt_host_pattern(want, n, 72);
            int same = memcmp(reg, want, n) == 0;
            R("cudaHostRegister kernel_write_ok=%d", same);
            CHECK(same, "kernel writes to registered host memory");
            free(want);
            CK(cudaHostUnregister(reg));
        }
        free(reg);
    }
}

int main(void)
{
    gt_init("passthrough");
    range_fn = gt_entry<gt_range_fn>("cuMemGetAddressRange");
    attr_fn = gt_entry<gt_attr_fn>("cuPointerGetAttribute");
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    /* A served buffer alive throughout: the others are made while the hook holds memory. */
    const size_t sn = 8 * MiB;
    void *served = served_malloc(sn);
    if (served)
        gt_fill(served, sn, 20);

    if (served)
        app_vmm(served, sn, 20);
    pools(s);
    managed();
    pinned();

    /* The served buffer is intact after all of that (rewritten by app_vmm's copy). */
    if (served) {
        unsigned long long bad = gt_verify(served, sn, 32, 0, 0, "served buffer at the end");
        R("served buffer end_bad=%llu", bad);
        CHECK(bad == 0, "served buffer corrupted: %llu bad", bad);
        served_free(served);
    }
    void *small = served_malloc(1000);
    if (small) {
        gt_fill(small, 1000, 21);
        CHECK(gt_verify(small, 1000, 21) == 0, "small served buffer");
        served_free(small);
    }
    CK(cudaStreamDestroy(s));
    cudaMemPool_t pool;
    if (CK(cudaDeviceGetDefaultMemPool(&pool, 0)) == 0)
        CK(cudaMemPoolTrimTo(pool, 0));
    R("expected served allocations=%u", g_served_expected);
    printf("I expect_served_allocs=%u\n", g_served_expected);
    gt_leftover_check("passthrough", g_freed, g_nfreed);
    return gt_finish();
}
