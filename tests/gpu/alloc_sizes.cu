/* alloc_sizes: cudaMalloc of many sizes, every answer a program can observe.
 *
 * For each size (1 B .. 3 GiB, across 2 MiB chunk boundaries): 256-byte alignment; all buffers
 * live at once with distinct patterns (a kernel writes, another verifies: catches overlapping
 * buffers); range queries on the base, a middle pointer and the last byte through
 * cuMemGetAddressRange (fetched through cudart's cuGetProcAddress path and through dlsym on
 * libcuda.so.1), cuPointerGetAttribute(RANGE_START_ADDR/RANGE_SIZE), cuPointerGetAttributes and
 * cudaPointerGetAttributes, which must answer base = the pointer and size = the requested size
 * (the native answer, driver-facts 3a); H2D/D2H/D2D copies and memsets; cudaMallocPitch; bad
 * inputs with their native codes; and that freed addresses answer "not mapped".
 *
 * Usage: alloc_sizes [--quick]   (--quick leaves out the 513 MiB and 3 GiB buffers)
 * The "R " lines are compared between a native and a hooked run by tools/gpu-suite.sh. */
#include "gpu_common.h"

static const size_t kSizes[] = {
    1,        255,       256,    4096, 64 * KiB, MiB + 3, 2 * MiB, 2 * MiB + 1, 7 * MiB + 12345,
    64 * MiB, 513 * MiB, 3 * GiB};
static const int kNSizes = sizeof kSizes / sizeof kSizes[0];

static uintptr_t g_freed[512];
static size_t g_nfreed;

static void note_freed(const void *p, size_t n)
{
    if (g_nfreed + 2 > sizeof g_freed / sizeof g_freed[0])
        return;
    g_freed[g_nfreed++] = (uintptr_t)p;
    if (n > 1)
        g_freed[g_nfreed++] = (uintptr_t)p + n - 1;
}

static gt_range_fn range_gpa, range_dl;
static gt_attr_fn attr_gpa;
static gt_attrs_fn attrs_gpa;

static const char *ptr_state(void *p, void *sentinel)
{
    return p == sentinel ? "untouched" : p == NULL ? "null" : "set";
}

/* Every range answer for p (a buffer of n bytes) at its base, middle and last byte. */
static void range_checks(const char *label, void *p, size_t n)
{
    const size_t offs[3] = {0, n / 2, n - 1};
    const char *names[3] = {"base", "mid", "last"};
    for (int k = 0; k < 3; k++) {
        CUdeviceptr q = (CUdeviceptr)p + offs[k];
        gt_range_fn fns[2] = {range_gpa, range_dl};
        const char *via[2] = {"gpa", "dlsym"};
        for (int v = 0; v < 2; v++) {
            if (!fns[v])
                continue;
            CUdeviceptr base = 0;
            size_t size = 0;
            CUresult r = fns[v](&base, &size, q);
            long long off = r == CUDA_SUCCESS ? (long long)(base - (CUdeviceptr)p) : 0;
            R("range %s at=%s via=%s code=%d base_off=%lld size=%zu", label, names[k], via[v],
              (int)r, off, r == CUDA_SUCCESS ? size : 0);
            CHECK(r == CUDA_SUCCESS && base == (CUdeviceptr)p && size == n,
                  "cuMemGetAddressRange(%s %s, via %s) -> %d, base_off %lld, size %zu; want 0, 0, "
                  "%zu",
                  label, names[k], via[v], (int)r, off, size, n);
        }
        if (attr_gpa) {
            CUdeviceptr start = 0;
            size_t rsize = 0;
            CUresult r1 = attr_gpa(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, q);
            CUresult r2 = attr_gpa(&rsize, CU_POINTER_ATTRIBUTE_RANGE_SIZE, q);
            long long off = r1 == CUDA_SUCCESS ? (long long)(start - (CUdeviceptr)p) : 0;
            R("attr %s at=%s start_code=%d start_off=%lld size_code=%d size=%zu", label, names[k],
              (int)r1, off, (int)r2, r2 == CUDA_SUCCESS ? rsize : 0);
            CHECK(r1 == CUDA_SUCCESS && start == (CUdeviceptr)p,
                  "cuPointerGetAttribute(RANGE_START_ADDR, %s %s) -> %d, off %lld", label, names[k],
                  (int)r1, off);
            CHECK(r2 == CUDA_SUCCESS && rsize == n,
                  "cuPointerGetAttribute(RANGE_SIZE, %s %s) -> %d, %zu; want %zu", label, names[k],
                  (int)r2, rsize, n);
        }
        if (attrs_gpa) {
            CUpointer_attribute a[4] = {
                CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
            unsigned int mtype = 0;
            CUdeviceptr start = 0;
            size_t rsize = 0;
            int ordinal = -1;
            void *data[4] = {&mtype, &start, &rsize, &ordinal};
            CUresult r = attrs_gpa(4, a, data, q);
            long long off = r == CUDA_SUCCESS ? (long long)(start - (CUdeviceptr)p) : 0;
            R("attrs %s at=%s code=%d type=%u start_off=%lld size=%zu ordinal=%d", label, names[k],
              (int)r, mtype, off, rsize, ordinal);
            CHECK(r == CUDA_SUCCESS && mtype == CU_MEMORYTYPE_DEVICE && start == (CUdeviceptr)p &&
                      rsize == n && ordinal == 0,
                  "cuPointerGetAttributes(%s %s) -> %d type %u off %lld size %zu ordinal %d", label,
                  names[k], (int)r, mtype, off, rsize, ordinal);
        }
        cudaPointerAttributes pa;
        memset(&pa, 0, sizeof pa);
        cudaError_t e = cudaPointerGetAttributes(&pa, (void *)q);
        R("cudaPointerGetAttributes %s at=%s code=%d type=%d device=%d", label, names[k], (int)e,
          (int)pa.type, pa.device);
        CHECK(e == cudaSuccess && pa.type == cudaMemoryTypeDevice && pa.device == 0,
              "cudaPointerGetAttributes(%s %s) -> %d type %d", label, names[k], (int)e,
              (int)pa.type);
        if (e != cudaSuccess)
            cudaGetLastError();
    }
}

/* Copies and memsets over one buffer p of n bytes that holds the pattern of seed. */
static void copy_checks(void *p, size_t n, uint64_t seed)
{
    uint8_t *d = (uint8_t *)p;
    const size_t L = n < 16 * MiB ? n : 16 * MiB;
    unsigned long long full = 0, tail = 0, prefix = 0, d2d = 0, mset = 0, mset_p = 0;
    int edges = -1;

    uint8_t *h1 = (uint8_t *)malloc(n <= 64 * MiB ? n : L);
    uint8_t *h2 = (uint8_t *)malloc(n <= 64 * MiB ? n : L);
    if (!h1 || !h2) {
        CHECK(0, "host malloc failed");
        free(h1);
        free(h2);
        return;
    }
    /* D2H of the whole buffer against the host's idea of the pattern (kernel vs copy engine). */
    if (n <= 64 * MiB) {
        CK(cudaMemcpy(h1, d, n, cudaMemcpyDeviceToHost));
        gt_host_pattern(h2, n, seed);
        for (size_t j = 0; j < n; j++)
            full += h1[j] != h2[j];
    }
    /* H2D of the last L bytes (unaligned start for odd n), read back; the prefix untouched. */
    gt_host_pattern(h1, L, seed ^ 0xABCDEFull);
    CK(cudaMemcpy(d + n - L, h1, L, cudaMemcpyHostToDevice));
    memset(h2, 0, L);
    CK(cudaMemcpy(h2, d + n - L, L, cudaMemcpyDeviceToHost));
    for (size_t j = 0; j < L; j++)
        tail += h1[j] != h2[j];
    size_t pre = (n - L) & ~(size_t)3;
    if (pre)
        prefix = gt_verify(d, pre, seed, 0, 0, "prefix after H2D");

    /* D2D into a second buffer of the same size, then memsets there. */
    gt_fill(d, n, seed);
    void *q = NULL;
    if (CK(cudaMalloc(&q, n)) == 0) {
        CHECK_OWNS(q, 1, "second cudaMalloc buffer");
        CK(cudaMemcpy(q, d, n, cudaMemcpyDeviceToDevice));
        d2d = gt_verify(q, n, seed, 0, 0, "D2D copy");
        CK(cudaMemset(q, 0x5A, n));
        mset = gt_verify_const(q, n, 0x5A, 0, 0, "memset 0x5A");
        if (n >= 3) {
            uint8_t *qb = (uint8_t *)q;
            CK(cudaMemset(qb + 1, 0x11, n - 2));
            uint8_t e[4] = {0, 0, 0, 0};
            CK(cudaMemcpy(&e[0], qb, 1, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(&e[1], qb + 1, 1, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(&e[2], qb + n - 2, 1, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(&e[3], qb + n - 1, 1, cudaMemcpyDeviceToHost));
            edges = e[0] == 0x5A && e[1] == 0x11 && e[2] == 0x11 && e[3] == 0x5A;
        }
        CK(cudaFree(q));
        note_freed(q, n);
    }
    CK(cudaMemset(d, 0xA5, n));
    mset_p = gt_verify_const(d, n, 0xA5, 0, 0, "memset 0xA5");
    R("copies size=%zu d2h_full_bad=%llu h2d_tail_bad=%llu prefix_bad=%llu d2d_bad=%llu "
      "memset_bad=%llu memset_edges_ok=%d memset_src_bad=%llu",
      n, full, tail, prefix, d2d, mset, edges, mset_p);
    CHECK(full == 0 && tail == 0 && prefix == 0 && d2d == 0 && mset == 0 && mset_p == 0 &&
              edges != 0,
          "copies on %zu bytes: d2h %llu, h2d %llu, prefix %llu, d2d %llu, memset %llu/%llu, edges "
          "%d",
          n, full, tail, prefix, d2d, mset, mset_p, edges);
    free(h1);
    free(h2);
}

static void pitch_checks(void)
{
    void *pp = (void *)0x1230;
    size_t pitch = 0;
    const size_t w = 1000, h = 77;
    cudaError_t e = cudaMallocPitch(&pp, &pitch, w, h);
    R("cudaMallocPitch w=%zu h=%zu code=%d pitch=%zu", w, h, (int)e, pitch);
    CHECK(e == cudaSuccess && pitch == 1024,
          "cudaMallocPitch(1000 x 77) -> %d pitch %zu (want 1024)", (int)e, pitch);
    if (e != cudaSuccess)
        return;
    CHECK(((uintptr_t)pp & 255) == 0, "pitch pointer not 256-aligned");
    CHECK_OWNS(pp, 1, "cudaMallocPitch buffer");
    range_checks("pitch", pp, pitch * h);
    uint8_t *h1 = (uint8_t *)malloc(w * h), *h2 = (uint8_t *)calloc(1, w * h);
    gt_host_pattern(h1, w * h, 77);
    CK(cudaMemcpy2D(pp, pitch, h1, w, w, h, cudaMemcpyHostToDevice));
    CK(cudaMemcpy2D(h2, w, pp, pitch, w, h, cudaMemcpyDeviceToHost));
    size_t bad2d = 0;
    for (size_t j = 0; j < w * h; j++)
        bad2d += h1[j] != h2[j];
    CK(cudaMemset2D(pp, pitch, 0x33, w, h));
    CK(cudaMemcpy2D(h2, w, pp, pitch, w, h, cudaMemcpyDeviceToHost));
    size_t badset = 0;
    for (size_t j = 0; j < w * h; j++)
        badset += h2[j] != 0x33;
    R("pitch copy2d_bad=%zu memset2d_bad=%zu", bad2d, badset);
    CHECK(bad2d == 0 && badset == 0, "2D copies: %zu / %zu bad bytes", bad2d, badset);
    free(h1);
    free(h2);
    e = cudaFree(pp);
    R("cudaFree pitch code=%d", (int)e);
    CHECK(e == cudaSuccess, "cudaFree(pitch buffer) -> %d", (int)e);
    note_freed(pp, pitch * h);
}

/* Bad inputs: each answers its native code and leaves the process working. */
static void bad_inputs(void)
{
    cudaError_t e, last;
    void *sentinel = (void *)0x1230;

    e = cudaFree(NULL);
    last = cudaGetLastError();
    R("bad cudaFree(NULL) code=%d last=%d", (int)e, (int)last);
    CHECK(e == cudaSuccess, "cudaFree(NULL) -> %d, want 0", (int)e);

    void *host = malloc(4096);
    e = cudaFree(host);
    last = cudaGetLastError();
    R("bad cudaFree(host) code=%d last=%d", (int)e, (int)last);
    CHECK(e == cudaErrorInvalidValue, "cudaFree(host pointer) -> %d, want 1", (int)e);

    void *p = sentinel;
    e = cudaMalloc(&p, (size_t)1 << 50);
    last = cudaGetLastError();
    R("bad cudaMalloc(1PiB) code=%d last=%d ptr=%s", (int)e, (int)last, ptr_state(p, sentinel));
    CHECK(e == cudaErrorMemoryAllocation, "cudaMalloc(1 PiB) -> %d, want 2", (int)e);
    if (e == cudaSuccess && p != sentinel && p)
        cudaFree(p);

    /* Interior and double frees on a small (packed), a chunk-sized and a multi-chunk buffer. */
    const size_t ns[3] = {256, MiB, 2 * MiB + 1};
    const size_t io[3] = {128, 256, 2 * MiB};
    for (int i = 0; i < 3; i++) {
        p = NULL;
        if (CK(cudaMalloc(&p, ns[i])))
            continue;
        gt_fill(p, ns[i], 900 + i);
        e = cudaFree((char *)p + io[i]);
        last = cudaGetLastError();
        unsigned long long bad = gt_verify(p, ns[i], 900 + i, 0, 0, "after interior free");
        R("bad cudaFree(interior) size=%zu off=%zu code=%d last=%d intact_bad=%llu", ns[i], io[i],
          (int)e, (int)last, bad);
        CHECK(e == cudaErrorInvalidValue && bad == 0,
              "cudaFree(interior of %zu at +%zu) -> %d (want 1), buffer bad %llu", ns[i], io[i],
              (int)e, bad);
        e = cudaFree(p);
        R("cudaFree after interior size=%zu code=%d", ns[i], (int)e);
        CHECK(e == cudaSuccess, "cudaFree(base) after interior attempt -> %d", (int)e);
        e = cudaFree(p);
        last = cudaGetLastError();
        R("bad cudaFree(double) size=%zu code=%d last=%d", ns[i], (int)e, (int)last);
        CHECK(e == cudaErrorInvalidValue, "double cudaFree(%zu) -> %d, want 1", ns[i], (int)e);
        note_freed(p, ns[i]);
    }

    /* Size 0: compared with native (measured, not assumed). */
    p = sentinel;
    e = cudaMalloc(&p, 0);
    last = cudaGetLastError();
    R("cudaMalloc(0) code=%d last=%d ptr=%s", (int)e, (int)last, ptr_state(p, sentinel));
    if (e == cudaSuccess && p && p != sentinel) {
        e = cudaFree(p);
        R("cudaFree(cudaMalloc(0)) code=%d", (int)e);
        cudaGetLastError();
    }
    e = cudaMalloc(NULL, 256);
    last = cudaGetLastError();
    R("bad cudaMalloc(NULL out) code=%d last=%d", (int)e, (int)last);

    /* The driver entry points, fetched as cudart fetches them. */
    typedef decltype(&cuMemAlloc) alloc_fn;
    typedef decltype(&cuMemFree) free_fn;
    alloc_fn dalloc = gt_entry<alloc_fn>("cuMemAlloc");
    free_fn dfree = gt_entry<free_fn>("cuMemFree");
    if (dalloc && dfree) {
        CUdeviceptr dp = 0x1230;
        CUresult r = dalloc(&dp, 0);
        R("bad cuMemAlloc(0) code=%d ptr=%s", (int)r, ptr_state((void *)dp, sentinel));
        if (r == CUDA_SUCCESS && dp && dp != 0x1230)
            dfree(dp);
        r = dfree(0);
        R("bad cuMemFree(0) code=%d", (int)r);
        dp = 0x1230;
        r = dalloc(&dp, (size_t)1 << 50);
        R("bad cuMemAlloc(1PiB) code=%d ptr=%s", (int)r, ptr_state((void *)dp, sentinel));
        CHECK(r == CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc(1 PiB) -> %d, want 2", (int)r);
        r = dfree((CUdeviceptr)host);
        R("bad cuMemFree(host) code=%d", (int)r);
    }
    if (range_gpa) {
        CUdeviceptr b = 0;
        size_t s = 0;
        CUresult r = range_gpa(&b, &s, (CUdeviceptr)host);
        R("bad cuMemGetAddressRange(host) code=%d", (int)r);
        r = range_gpa(&b, &s, 0);
        R("bad cuMemGetAddressRange(NULL) code=%d", (int)r);
    }

    /* cudaFreeAsync of a cudaMalloc buffer: whatever native answers. */
    p = NULL;
    if (CK(cudaMalloc(&p, 4096)) == 0) {
        e = cudaFreeAsync(p, 0);
        last = cudaGetLastError();
        cudaError_t s = cudaDeviceSynchronize();
        R("cudaFreeAsync(cudaMalloc buffer) code=%d last=%d sync=%d", (int)e, (int)last, (int)s);
        if (e != cudaSuccess) {
            e = cudaFree(p);
            R("cudaFree after refused cudaFreeAsync code=%d", (int)e);
        }
        note_freed(p, 4096);
    }
    free(host);

    /* Still alive. */
    p = NULL;
    int alive = 0;
    if (CK(cudaMalloc(&p, MiB)) == 0) {
        gt_fill(p, MiB, 7);
        alive = gt_verify(p, MiB, 7) == 0;
        alive &= CK(cudaFree(p)) == 0;
        note_freed(p, MiB);
    }
    R("alive after bad inputs=%d", alive);
    CHECK(alive, "the process does not work after the bad inputs");
}

int main(int argc, char **argv)
{
    gt_init("alloc_sizes");
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    int n = quick ? kNSizes - 2 : kNSizes;
    R("alloc_sizes sizes=%d quick=%d", n, quick);

    range_gpa = gt_entry<gt_range_fn>("cuMemGetAddressRange");
    range_dl = gt_dlsym_cuda<gt_range_fn>("cuMemGetAddressRange_v2");
    attr_gpa = gt_entry<gt_attr_fn>("cuPointerGetAttribute");
    attrs_gpa = gt_entry<gt_attrs_fn>("cuPointerGetAttributes");

    void *ptr[kNSizes];
    for (int i = 0; i < n; i++) {
        size_t s = kSizes[i];
        ptr[i] = NULL;
        cudaError_t e = cudaMalloc(&ptr[i], s);
        int aligned = ((uintptr_t)ptr[i] & 255) == 0;
        R("cudaMalloc size=%zu code=%d null=%d aligned256=%d", s, (int)e, ptr[i] == NULL, aligned);
        CHECK(e == cudaSuccess && ptr[i] && aligned, "cudaMalloc(%zu) -> %d, %p", s, (int)e,
              ptr[i]);
        INFO("cudaMalloc(%zu) = %p", s, ptr[i]);
        if (e != cudaSuccess) {
            ptr[i] = NULL;
            cudaGetLastError();
            continue;
        }
        CHECK_OWNS(ptr[i], 1, "cudaMalloc buffer");
        CHECK_OWNS((char *)ptr[i] + s - 1, 1, "cudaMalloc buffer's last byte");
        if (g_vmm_usable) {
            size_t u = g_vmm_usable(ptr[i]);
            INFO("vmm_usable_size(%zu) = %zu", s, u);
            CHECK(u >= s, "vmm_usable_size(%zu-byte buffer) = %zu", s, u);
        }
    }
    /* All live at once, distinct patterns: a buffer overlapping another shows here. */
    for (int i = 0; i < n; i++)
        if (ptr[i])
            gt_fill(ptr[i], kSizes[i], 1000 + i);
    for (int i = 0; i < n; i++) {
        if (!ptr[i])
            continue;
        unsigned long long bad = gt_verify(ptr[i], kSizes[i], 1000 + i, 0, 0, "all-live");
        R("all-live verify size=%zu bad=%llu", kSizes[i], bad);
        CHECK(bad == 0, "all-live pattern of %zu bytes: %llu bad", kSizes[i], bad);
    }
    for (int i = 0; i < n; i++) {
        if (!ptr[i])
            continue;
        char label[32];
        snprintf(label, sizeof label, "size=%zu", kSizes[i]);
        range_checks(label, ptr[i], kSizes[i]);
    }
    for (int i = 0; i < n; i++)
        if (ptr[i])
            copy_checks(ptr[i], kSizes[i], 1000 + i);
    for (int i = 0; i < n; i++) {
        if (!ptr[i])
            continue;
        cudaError_t e = cudaFree(ptr[i]);
        R("cudaFree size=%zu code=%d", kSizes[i], (int)e);
        CHECK(e == cudaSuccess, "cudaFree(%zu-byte buffer) -> %d", kSizes[i], (int)e);
        CHECK_OWNS(ptr[i], 0, "freed buffer");
        note_freed(ptr[i], kSizes[i]);
    }
    pitch_checks();
    bad_inputs();
    gt_leftover_check("alloc_sizes", g_freed, g_nfreed);
    return gt_finish();
}
