/* driver_direct: the driver API called directly, linked with -lcuda (no cudart, no
 * cuGetProcAddress): the calls bind to the exported symbols cuMemAlloc_v2, cuMemFree_v2,
 * cuMemGetAddressRange_v2, cuMemAllocPitch_v2, cuPointerGetAttribute(s), cuMemGetInfo_v2,
 * cuMemFreeAsync, which the preloaded hook must answer as the driver would (driver-facts 1a:
 * a prototype answered chunk-rounded sizes here).
 *
 * Sizes 1 B .. 3 GiB, all live at once, each memset to its own byte value and checked at both
 * ends and on both sides of every 2 MiB boundary (full read-back up to 64 MiB), H2D/D2D/D2H of a
 * pattern, range answers at base/middle/last byte = (pointer, requested size); bad inputs with
 * their native codes (compared); freed addresses answer "not mapped".
 * Same output conventions as gpu_common.h (R/I lines, exit 0/1/77). Plain C.
 * Usage: driver_direct [--quick]   (--quick leaves out the 513 MiB and 3 GiB buffers)
 * It also runs on the simulated driver (tests/sim/fakecuda): meson's gpu-sim suite. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cuda.h>
#include <dlfcn.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

static int g_checks, g_failed;
static int (*g_owns)(const void *);
static size_t (*g_trim)(void);

#define R(...) (printf("R " __VA_ARGS__), printf("\n"))
#define INFO(...) (printf("I " __VA_ARGS__), printf("\n"))
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        g_checks++;                                                                                \
        if (!(cond)) {                                                                             \
            g_failed++;                                                                            \
            printf("FAIL driver_direct.c:%d: ", __LINE__);                                         \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
        }                                                                                          \
    } while (0)
#define CKD(call)                                                                                  \
    ({                                                                                             \
        CUresult r_ = (call);                                                                      \
        CHECK(r_ == CUDA_SUCCESS, "%s -> %d", #call, (int)r_);                                     \
        r_;                                                                                        \
    })
#define CHECK_OWNS(p, want, what)                                                                  \
    do {                                                                                           \
        if (g_owns) {                                                                              \
            int o_ = g_owns((const void *)(uintptr_t)(p));                                         \
            CHECK(o_ == (want), "vmm_owns(%s) = %d, want %d", (what), o_, (want));                 \
        }                                                                                          \
    } while (0)

static const size_t kSizes[] = {
    1,        255,       256,    4096, 64 * KiB, MiB + 3, 2 * MiB, 2 * MiB + 1, 7 * MiB + 12345,
    64 * MiB, 513 * MiB, 3 * GiB};
#define NSIZES ((int)(sizeof kSizes / sizeof kSizes[0]))

static uintptr_t g_freed[256];
static size_t g_nfreed;

static void note_freed(CUdeviceptr p, size_t n)
{
    if (g_nfreed + 2 > sizeof g_freed / sizeof g_freed[0])
        return;
    g_freed[g_nfreed++] = (uintptr_t)p;
    if (n > 1)
        g_freed[g_nfreed++] = (uintptr_t)p + n - 1;
}

static const char *ptr_state(CUdeviceptr p)
{
    return p == 0x1230 ? "untouched" : p == 0 ? "null" : "set";
}

static void skip(const char *why, CUresult r)
{
    const char *name = NULL;
    cuGetErrorName(r, &name);
    printf("SKIP: no CUDA device: %s -> %d (%s)\n", why, (int)r, name ? name : "?");
    printf("SKIP: driver_direct (exit 77)\n");
    exit(77);
}

static void range_checks(const char *label, CUdeviceptr p, size_t n)
{
    const size_t offs[3] = {0, n / 2, n - 1};
    const char *names[3] = {"base", "mid", "last"};
    for (int k = 0; k < 3; k++) {
        CUdeviceptr q = p + offs[k], base = 0, start = 0;
        size_t size = 0, rsize = 0;
        CUresult r = cuMemGetAddressRange_v2(&base, &size, q);
        long long off = r == CUDA_SUCCESS ? (long long)(base - p) : 0;
        R("range %s at=%s code=%d base_off=%lld size=%zu", label, names[k], (int)r, off,
          r == CUDA_SUCCESS ? size : 0);
        CHECK(r == CUDA_SUCCESS && base == p && size == n,
              "cuMemGetAddressRange_v2(%s %s) -> %d base_off %lld size %zu, want 0 0 %zu", label,
              names[k], (int)r, off, size, n);
        CUresult r1 = cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, q);
        CUresult r2 = cuPointerGetAttribute(&rsize, CU_POINTER_ATTRIBUTE_RANGE_SIZE, q);
        R("attr %s at=%s start_code=%d start_off=%lld size_code=%d size=%zu", label, names[k],
          (int)r1, r1 == CUDA_SUCCESS ? (long long)(start - p) : 0LL, (int)r2,
          r2 == CUDA_SUCCESS ? rsize : 0);
        CHECK(r1 == CUDA_SUCCESS && start == p && r2 == CUDA_SUCCESS && rsize == n,
              "cuPointerGetAttribute(RANGE_*, %s %s) -> %d/%d, off %lld size %zu", label, names[k],
              (int)r1, (int)r2, (long long)(start - p), rsize);
        CUpointer_attribute a[3] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                    CU_POINTER_ATTRIBUTE_RANGE_SIZE};
        unsigned int mtype = 0;
        start = 0;
        rsize = 0;
        void *data[3] = {&mtype, &start, &rsize};
        r = cuPointerGetAttributes(3, a, data, q);
        R("attrs %s at=%s code=%d type=%u start_off=%lld size=%zu", label, names[k], (int)r, mtype,
          r == CUDA_SUCCESS ? (long long)(start - p) : 0LL, rsize);
        CHECK(r == CUDA_SUCCESS && mtype == CU_MEMORYTYPE_DEVICE && start == p && rsize == n,
              "cuPointerGetAttributes(%s %s) -> %d type %u size %zu", label, names[k], (int)r,
              mtype, rsize);
    }
}

/* Bytes of p (n bytes, memset to v) at both ends and around every 2 MiB boundary. */
static size_t check_memset(CUdeviceptr p, size_t n, unsigned char v)
{
    size_t bad = 0;
    if (n <= 64 * MiB) {
        unsigned char *h = malloc(n);
        if (CKD(cuMemcpyDtoH_v2(h, p, n)) == CUDA_SUCCESS)
            for (size_t j = 0; j < n; j++)
                bad += h[j] != v;
        free(h);
        return bad;
    }
    unsigned char b[8];
    for (size_t o = 0; o < n; o += 2 * MiB) {
        size_t lo = o >= 4 ? o - 4 : 0, len = lo + 8 <= n ? 8 : n - lo;
        if (CKD(cuMemcpyDtoH_v2(b, p + lo, len)) != CUDA_SUCCESS)
            return bad + 1;
        for (size_t j = 0; j < len; j++)
            bad += b[j] != v;
    }
    if (CKD(cuMemcpyDtoH_v2(b, p + n - 1, 1)) == CUDA_SUCCESS)
        bad += b[0] != v;
    return bad;
}

static void fill_host(unsigned char *h, size_t n, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (size_t j = 0; j < n; j++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        h[j] = (unsigned char)x;
    }
}

static void bad_inputs(void)
{
    CUresult r = cuMemFree_v2(0);
    R("bad cuMemFree(0) code=%d", (int)r);
    void *host = malloc(4096);
    r = cuMemFree_v2((CUdeviceptr)(uintptr_t)host);
    R("bad cuMemFree(host) code=%d", (int)r);
    CHECK(r != CUDA_SUCCESS, "cuMemFree(host pointer) succeeded");
    CUdeviceptr d = 0x1230;
    r = cuMemAlloc_v2(&d, (size_t)1 << 50);
    R("bad cuMemAlloc(1PiB) code=%d ptr=%s", (int)r, ptr_state(d));
    CHECK(r == CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc(1 PiB) -> %d, want 2", (int)r);
    d = 0x1230;
    r = cuMemAlloc_v2(&d, 0);
    R("cuMemAlloc(0) code=%d ptr=%s", (int)r, ptr_state(d));
    if (r == CUDA_SUCCESS && d && d != 0x1230)
        cuMemFree_v2(d);
    r = cuMemAlloc_v2(NULL, 16);
    R("bad cuMemAlloc(NULL out) code=%d", (int)r);
    CUdeviceptr b = 0;
    size_t s = 0;
    r = cuMemGetAddressRange_v2(&b, &s, (CUdeviceptr)(uintptr_t)host);
    R("bad cuMemGetAddressRange(host) code=%d", (int)r);

    const size_t ns[3] = {256, MiB, 2 * MiB + 1};
    const size_t io[3] = {128, 256, 2 * MiB};
    for (int i = 0; i < 3; i++) {
        d = 0;
        if (CKD(cuMemAlloc_v2(&d, ns[i])) != CUDA_SUCCESS)
            continue;
        CKD(cuMemsetD8_v2(d, 0x77, ns[i]));
        r = cuMemFree_v2(d + io[i]);
        size_t bad = check_memset(d, ns[i], 0x77);
        R("bad cuMemFree(interior) size=%zu off=%zu code=%d intact_bad=%zu", ns[i], io[i], (int)r,
          bad);
        CHECK(r == CUDA_ERROR_INVALID_VALUE && bad == 0,
              "cuMemFree(interior of %zu) -> %d (want 1), bad %zu", ns[i], (int)r, bad);
        r = cuMemFree_v2(d);
        CHECK(r == CUDA_SUCCESS, "cuMemFree(base) -> %d", (int)r);
        r = cuMemFree_v2(d);
        R("bad cuMemFree(double) size=%zu code=%d", ns[i], (int)r);
        CHECK(r == CUDA_ERROR_INVALID_VALUE, "double cuMemFree(%zu) -> %d, want 1", ns[i], (int)r);
        note_freed(d, ns[i]);
    }
    /* cuMemFreeAsync of a cuMemAlloc buffer (exported by the hook): compared with native. */
    d = 0;
    if (CKD(cuMemAlloc_v2(&d, 4096)) == CUDA_SUCCESS) {
        r = cuMemFreeAsync(d, NULL);
        CUresult s2 = cuCtxSynchronize();
        R("cuMemFreeAsync(cuMemAlloc buffer) code=%d sync=%d", (int)r, (int)s2);
        if (r != CUDA_SUCCESS)
            CKD(cuMemFree_v2(d));
        note_freed(d, 4096);
    }
    free(host);
}

/* What a run of adjacent mappings may span in one call (libvmmhook's pause, resume and trim,
 * handle.h): one cuMemSetAccess and one cuMemUnmap over three 2 MiB mappings inside one
 * reservation must work (CHECK: the library relies on it); whether either call also spans two
 * adjacent reservations decides whether runs may cross reservations (an I line, not an R line:
 * whether the hint is granted may differ between the native and the hooked run; the library
 * keeps runs inside one reservation until this answers 0 for both on the GPU). */
static void runs_of_mappings(CUdevice dev)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = (int)dev;
    size_t g = 0;
    if (CKD(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        return;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUdeviceptr a = 0, b = 0;
    if (CKD(cuMemAddressReserve(&a, 3 * g, 0, 0, 0)))
        return;
    /* Adjacent: the hint at a's end (driver-facts 2: granted 50 of 50 times at 64 MiB). */
    CUresult rb = cuMemAddressReserve(&b, 2 * g, 0, a + 3 * g, 0);
    int adjacent = rb == CUDA_SUCCESS && b == a + 3 * g;
    CUmemGenericAllocationHandle h[5];
    int made = 0, mapped = 0;
    for (; made < 5; made++)
        if (CKD(cuMemCreate(&h[made], g, &prop, 0)))
            break;
    for (; mapped < made && mapped < 3; mapped++)
        if (CKD(cuMemMap(a + (size_t)mapped * g, g, 0, h[mapped], 0)))
            break;
    int in_one = made == 5 && mapped == 3;
    if (in_one) {
        CHECK(cuMemSetAccess(a, 3 * g, &acc, 1) == CUDA_SUCCESS,
              "one cuMemSetAccess over 3 mappings of one reservation refused");
        CHECK(cuMemUnmap(a, 3 * g) == CUDA_SUCCESS,
              "one cuMemUnmap over 3 mappings of one reservation refused");
    }
    if (in_one && adjacent && !CKD(cuMemMap(a, g, 0, h[0], 0)) &&
        !CKD(cuMemMap(a + g, g, 0, h[1], 0)) && !CKD(cuMemMap(a + 2 * g, g, 0, h[2], 0)) &&
        !CKD(cuMemMap(b, g, 0, h[3], 0)) && !CKD(cuMemMap(b + g, g, 0, h[4], 0))) {
        CUresult ra = cuMemSetAccess(a + g, 3 * g, &acc, 1);
        CUresult ru = cuMemUnmap(a + g, 3 * g);
        INFO("runs_across_reservations adjacent=1 setaccess=%d unmap=%d (0: one call spans two "
             "adjacent reservations; else the driver's refusal)",
             (int)ra, (int)ru);
        if (ru != CUDA_SUCCESS) {
            CKD(cuMemUnmap(a + g, 2 * g));
            CKD(cuMemUnmap(b, g));
        }
        CKD(cuMemUnmap(a, g));
        CKD(cuMemUnmap(b + g, g));
    } else {
        INFO("runs_across_reservations adjacent=0: undecided (adjacent reservation granted: "
             "%d, code %d)",
             adjacent, (int)rb);
    }
    for (int i = 0; i < made; i++)
        CKD(cuMemRelease(h[i]));
    if (rb == CUDA_SUCCESS)
        CKD(cuMemAddressFree(b, 2 * g));
    CKD(cuMemAddressFree(a, 3 * g));
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* --quick leaves out the 513 MiB and 3 GiB buffers (for the simulated driver, whose memory
     * is host memory). */
    const int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    const int nsizes = quick ? NSIZES - 2 : NSIZES;
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS)
        skip("cuInit", r);
    int n = 0;
    r = cuDeviceGetCount(&n);
    if (r != CUDA_SUCCESS)
        skip("cuDeviceGetCount", r);
    if (n == 0)
        skip("cuDeviceGetCount found 0 devices", CUDA_ERROR_NO_DEVICE);
    CUdevice dev;
    CUcontext ctx;
    if (CKD(cuDeviceGet(&dev, 0)) || CKD(cuDevicePrimaryCtxRetain(&ctx, dev)) ||
        CKD(cuCtxSetCurrent(ctx))) {
        printf("FAIL: driver_direct: no context\n");
        return 1;
    }
    char name[256] = "";
    cuDeviceGetName(name, sizeof name, dev);
    int drv = 0;
    cuDriverGetVersion(&drv);
    INFO("device 0: %s, driver %d", name, drv);
    R("driver_direct sizes=%d quick=%d", nsizes, quick);
    *(void **)&g_owns = dlsym(RTLD_DEFAULT, "vmm_owns");
    *(void **)&g_trim = dlsym(RTLD_DEFAULT, "vmm_trim");
    const char *dis = getenv("VMMHOOK_DISABLE");
    if (dis && dis[0] &&
        (strchr("1tTyY", dis[0]) ||
         !strcasecmp(dis, "on"))) { /* loaded but pass-through: owns nothing */
        g_owns = NULL;
        INFO("hook: VMMHOOK_DISABLE=%s: treated as absent", dis);
    }
    const char *ex = getenv("GPUTEST_EXPECT_HOOK");
    INFO("hook: %s", g_owns ? "loaded" : "absent");
    if (ex && ex[0] == '1')
        CHECK(g_owns && g_trim, "GPUTEST_EXPECT_HOOK=1 but vmm_owns/vmm_trim are not visible");

    runs_of_mappings(dev);

    size_t free0 = 0, total = 0;
    CKD(cuMemGetInfo_v2(&free0, &total));
    INFO("cuMemGetInfo: free %zu MiB of %zu MiB", free0 / MiB, total / MiB);

    CUdeviceptr p[NSIZES];
    for (int i = 0; i < nsizes; i++) {
        p[i] = 0;
        r = cuMemAlloc_v2(&p[i], kSizes[i]);
        R("cuMemAlloc size=%zu code=%d aligned256=%d", kSizes[i], (int)r, (int)((p[i] & 255) == 0));
        CHECK(r == CUDA_SUCCESS && p[i] && (p[i] & 255) == 0, "cuMemAlloc(%zu) -> %d", kSizes[i],
              (int)r);
        if (r != CUDA_SUCCESS) {
            p[i] = 0;
            continue;
        }
        CHECK_OWNS(p[i], 1, "cuMemAlloc buffer");
        CKD(cuMemsetD8_v2(p[i], (unsigned char)(i + 1), kSizes[i]));
    }
    size_t free1 = 0;
    CKD(cuMemGetInfo_v2(&free1, &total));
    INFO("cuMemGetInfo with all live: free %zu MiB (%lld MiB less)", free1 / MiB,
         ((long long)free0 - (long long)free1) / (long long)MiB);
    for (int i = 0; i < nsizes; i++) {
        if (!p[i])
            continue;
        size_t bad = check_memset(p[i], kSizes[i], (unsigned char)(i + 1));
        R("memset all-live size=%zu bad=%zu", kSizes[i], bad);
        CHECK(bad == 0, "memset pattern of %zu bytes: %zu bad (overlap?)", kSizes[i], bad);
        char label[32];
        snprintf(label, sizeof label, "size=%zu", kSizes[i]);
        range_checks(label, p[i], kSizes[i]);
    }
    /* H2D, D2D, D2H of a byte pattern, up to 64 MiB (16 MiB windows at the end above that). */
    for (int i = 0; i < nsizes; i++) {
        if (!p[i])
            continue;
        size_t s = kSizes[i], L = s < 16 * MiB ? s : 16 * MiB;
        unsigned char *h1 = malloc(L), *h2 = calloc(1, L);
        fill_host(h1, L, (uint32_t)i);
        CUdeviceptr q = 0;
        size_t bad = 0;
        CKD(cuMemcpyHtoD_v2(p[i] + s - L, h1, L));
        if (CKD(cuMemAlloc_v2(&q, s)) == CUDA_SUCCESS) {
            CKD(cuMemcpyDtoD_v2(q, p[i], s));
            CKD(cuMemcpyDtoH_v2(h2, q + s - L, L));
            bad = (size_t)(memcmp(h1, h2, L) != 0);
            if (s > L)
                bad += check_memset(q, s - L, (unsigned char)(i + 1));
            CKD(cuMemFree_v2(q));
            note_freed(q, s);
        }
        R("copies size=%zu bad=%zu", s, bad);
        CHECK(bad == 0, "H2D/D2D/D2H of %zu bytes: %zu bad", s, bad);
        free(h1);
        free(h2);
    }
    for (int i = 0; i < nsizes; i++) {
        if (!p[i])
            continue;
        r = cuMemFree_v2(p[i]);
        R("cuMemFree size=%zu code=%d", kSizes[i], (int)r);
        CHECK(r == CUDA_SUCCESS, "cuMemFree(%zu) -> %d", kSizes[i], (int)r);
        CHECK_OWNS(p[i], 0, "freed buffer");
        note_freed(p[i], kSizes[i]);
    }

    CUdeviceptr pp = 0;
    size_t pitch = 0;
    r = cuMemAllocPitch_v2(&pp, &pitch, 1000, 77, 16);
    R("cuMemAllocPitch w=1000 h=77 code=%d pitch=%zu", (int)r, pitch);
    /* The pitch itself is compared with native (cudaMallocPitch's 1024 is a measured fact,
     * cuMemAllocPitch with element size 16 is not). */
    CHECK(r == CUDA_SUCCESS && pitch >= 1000, "cuMemAllocPitch -> %d pitch %zu", (int)r, pitch);
    if (r == CUDA_SUCCESS) {
        CHECK_OWNS(pp, 1, "cuMemAllocPitch buffer");
        range_checks("pitch", pp, pitch * 77);
        CKD(cuMemsetD8_v2(pp, 0x44, pitch * 77));
        size_t bad = check_memset(pp, pitch * 77, 0x44);
        CHECK(bad == 0, "memset of the pitched buffer: %zu bad", bad);
        CKD(cuMemFree_v2(pp));
        note_freed(pp, pitch * 77);
    }
    bad_inputs();

    /* Leftover: freed addresses answer "not mapped", before and after vmm_trim. */
    CKD(cuCtxSynchronize());
    size_t mapped[2] = {0, 0};
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && g_trim)
            INFO("vmm_trim released %zu bytes", g_trim());
        for (size_t i = 0; i < g_nfreed; i++) {
            CUdeviceptr b = 0;
            size_t s = 0;
            if (cuMemGetAddressRange_v2(&b, &s, (CUdeviceptr)g_freed[i]) == CUDA_SUCCESS)
                mapped[pass]++;
        }
    }
    R("leftover driver_direct mapped_before_trim=%zu", mapped[0]);
    R("leftover driver_direct mapped_after_trim=%zu", mapped[1]);
    if (g_owns)
        CHECK(mapped[0] == 0 && mapped[1] == 0, "freed addresses still mapped: %zu / %zu",
              mapped[0], mapped[1]);

    CUresult fin = cuCtxSynchronize();
    CHECK(fin == CUDA_SUCCESS, "final cuCtxSynchronize -> %d", (int)fin);
    cuDevicePrimaryCtxRelease(dev);
    if (g_failed) {
        printf("FAIL: driver_direct (%d of %d checks failed)\n", g_failed, g_checks);
        return 1;
    }
    printf("PASS: driver_direct (%d checks)\n", g_checks);
    return 0;
}
