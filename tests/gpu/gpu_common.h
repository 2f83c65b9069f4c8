/* Shared helpers of the GPU suite (CUDA C++, built with nvcc; no cmocka).
 *
 * Conventions every program follows, so tools/gpu-suite.sh can run it with and without the
 * hook and compare:
 *   - exit 0 pass, 1 fail, 77 skip (the reason printed on a "SKIP: ..." line);
 *   - lines starting "R " are the compared part: codes, sizes, offsets, counts; never a raw
 *     pointer or anything else that legitimately differs between a native and a hooked run;
 *   - lines starting "I " are information (pointers, timings, hook answers), not compared;
 *   - "FAIL ..." lines say what went wrong; the last line is "PASS: <prog> ..." or
 *     "FAIL: <prog> ...".
 * GPUTEST_EXPECT_HOOK=1 (set by the runner for hooked runs) turns "the hook is not loaded" into
 * a failure, so a library that silently failed to preload cannot pass as native. */
#ifndef GPU_COMMON_H
#define GPU_COMMON_H

#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <vector>

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

/* ---------------------------------------------------------------- checks and output */

static int g_checks, g_failed;
static const char *g_prog = "gpu-test";

#define R(...) (printf("R " __VA_ARGS__), printf("\n"))
#define INFO(...) (printf("I " __VA_ARGS__), printf("\n"))

/* CHECK(cond, fmt, ...): counts; prints a FAIL line with the location when cond is false. */
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        __atomic_add_fetch(&g_checks, 1, __ATOMIC_RELAXED);                                        \
        if (!(cond)) {                                                                             \
            __atomic_add_fetch(&g_failed, 1, __ATOMIC_RELAXED);                                    \
            gt_fail_line(__FILE__, __LINE__, __VA_ARGS__);                                         \
        }                                                                                          \
    } while (0)

/* CK(call): a CUDA runtime call that must succeed. Evaluates to the code. */
#define CK(call) gt_ck((int)(call), #call, __FILE__, __LINE__)
/* CKD(call): a driver API call that must succeed. */
#define CKD(call) gt_ckd((int)(call), #call, __FILE__, __LINE__)

static inline void gt_fail_line(const char *file, int line, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    const char *base = strrchr(file, '/');
    printf("FAIL %s:%d: %s\n", base ? base + 1 : file, line, buf);
    fflush(stdout);
}

static inline int gt_ck(int code, const char *what, const char *file, int line)
{
    __atomic_add_fetch(&g_checks, 1, __ATOMIC_RELAXED);
    if (code != 0) {
        __atomic_add_fetch(&g_failed, 1, __ATOMIC_RELAXED);
        gt_fail_line(file, line, "%s -> %d (%s)", what, code,
                     cudaGetErrorString((cudaError_t)code));
    }
    return code;
}

static inline int gt_ckd(int code, const char *what, const char *file, int line)
{
    __atomic_add_fetch(&g_checks, 1, __ATOMIC_RELAXED);
    if (code != 0) {
        __atomic_add_fetch(&g_failed, 1, __ATOMIC_RELAXED);
        gt_fail_line(file, line, "%s -> CUresult %d", what, code);
    }
    return code;
}

/* The final line and the exit status. A sticky device error (a fault) fails the program. */
static inline int gt_finish(void)
{
    cudaError_t e = cudaDeviceSynchronize();
    CHECK(e == cudaSuccess, "final cudaDeviceSynchronize -> %d (%s)", (int)e,
          cudaGetErrorString(e));
    e = cudaGetLastError();
    (void)e; /* a non-sticky leftover from a deliberate bad call is fine */
    if (g_failed) {
        printf("FAIL: %s (%d of %d checks failed)\n", g_prog, g_failed, g_checks);
        fflush(stdout);
        return 1;
    }
    printf("PASS: %s (%d checks)\n", g_prog, g_checks);
    fflush(stdout);
    return 0;
}

static inline void gt_skip(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    printf("SKIP: %s\n", buf);
    printf("SKIP: %s (exit 77)\n", g_prog);
    fflush(stdout);
    exit(77);
}

/* ---------------------------------------------------------------- device and hook */

typedef int (*gt_owns_fn)(const void *);
typedef size_t (*gt_trim_fn)(void);
typedef size_t (*gt_usable_fn)(const void *);

static gt_owns_fn g_vmm_owns;
static gt_trim_fn g_vmm_trim;
static gt_usable_fn g_vmm_usable;
static int g_expect_hook;

/* 1 when the hook answers (vmm_owns found), 0 otherwise. */
static inline int gt_hooked(void)
{
    return g_vmm_owns != NULL;
}

/* vmm_owns(p), or -1 when the hook is not loaded. */
static inline int gt_owns(const void *p)
{
    return g_vmm_owns ? g_vmm_owns(p) : -1;
}

/* Calls vmm_trim() when the hook is loaded; returns the bytes it released (0 without hook). */
static inline size_t gt_trim(void)
{
    if (!g_vmm_trim)
        return 0;
    size_t n = g_vmm_trim();
    INFO("vmm_trim released %zu bytes", n);
    return n;
}

/* Skips (77) without a usable device; initialises the primary context on device 0; reports
 * whether the hook is loaded. */
static inline void gt_init(const char *prog)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_prog = prog;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
        gt_skip("no CUDA device: cudaGetDeviceCount -> %d (%s)", (int)e, cudaGetErrorString(e));
    if (n == 0)
        gt_skip("no CUDA device: cudaGetDeviceCount found 0 devices");
    e = cudaSetDevice(0);
    if (e == cudaSuccess)
        e = cudaFree(0); /* creates the primary context */
    if (e != cudaSuccess) {
        printf("FAIL: %s: device 0 unusable: %d (%s)\n", prog, (int)e, cudaGetErrorString(e));
        exit(1);
    }
    cudaDeviceProp prop;
    memset(&prop, 0, sizeof prop);
    cudaGetDeviceProperties(&prop, 0);
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    INFO("device 0: %s, cc %d.%d, %zu MiB, driver %d, runtime %d, %d device(s)", prop.name,
         prop.major, prop.minor, (size_t)(prop.totalGlobalMem / MiB), drv, rt, n);

    g_vmm_owns = (gt_owns_fn)dlsym(RTLD_DEFAULT, "vmm_owns");
    g_vmm_trim = (gt_trim_fn)dlsym(RTLD_DEFAULT, "vmm_trim");
    g_vmm_usable = (gt_usable_fn)dlsym(RTLD_DEFAULT, "vmm_usable_size");
    /* VMMHOOK_DISABLE: the library is loaded but passes everything through, so it owns
     * nothing: the program runs as native (its R lines must still match the native run). */
    const char *dis = getenv("VMMHOOK_DISABLE");
    if (dis && (dis[0] == '1' || dis[0] == 't' || dis[0] == 'T' || dis[0] == 'y' || dis[0] == 'Y' ||
                ((dis[0] == 'o' || dis[0] == 'O') && (dis[1] == 'n' || dis[1] == 'N')))) {
        INFO("hook: VMMHOOK_DISABLE=%s: treated as absent", dis);
        g_vmm_owns = NULL;
        g_vmm_usable = NULL;
    }
    const char *ex = getenv("GPUTEST_EXPECT_HOOK");
    g_expect_hook = ex && ex[0] == '1';
    INFO("hook: %s (vmm_owns %s, vmm_trim %s); expected: %s", g_vmm_owns ? "loaded" : "absent",
         g_vmm_owns ? "found" : "missing", g_vmm_trim ? "found" : "missing",
         g_expect_hook ? "yes" : "no");
    if (g_expect_hook)
        CHECK(g_vmm_owns && g_vmm_trim,
              "GPUTEST_EXPECT_HOOK=1 but vmm_owns/vmm_trim are not visible through "
              "dlsym(RTLD_DEFAULT): the hook is not loaded or does not export them");
}

/* Checks vmm_owns(p) == want when the hook is loaded (no-op without the hook). */
#define CHECK_OWNS(p, want, what)                                                                  \
    do {                                                                                           \
        if (gt_hooked()) {                                                                         \
            int o_ = gt_owns((const void *)(p));                                                   \
            CHECK(o_ == (want), "vmm_owns(%s) = %d, want %d", (what), o_, (want));                 \
        }                                                                                          \
    } while (0)

/* ---------------------------------------------------------------- driver entry points */

/* A driver function fetched through cudart (cudaGetDriverEntryPointByVersion ->
 * cuGetProcAddress: the path cudart and PyTorch's expandable segments use). */
template <class F> static F gt_entry(const char *name, unsigned ver = 12000)
{
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, ver, cudaEnableDefault, &q);
    CHECK(e == cudaSuccess && q == cudaDriverEntryPointSuccess && fn,
          "cudaGetDriverEntryPointByVersion(%s) -> %d, query %d", name, (int)e, (int)q);
    return (F)fn;
}

/* A driver function fetched with dlsym on the libcuda.so.1 handle (the path PyTorch uses for
 * its ~60 direct look-ups). */
template <class F> static F gt_dlsym_cuda(const char *name)
{
    static void *h;
    if (!h)
        h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h)
        h = dlopen("libcuda.so.1", RTLD_NOW);
    void *fn = h ? dlsym(h, name) : NULL;
    CHECK(fn != NULL, "dlsym(libcuda.so.1, %s) -> NULL (%s)", name, h ? "no symbol" : dlerror());
    return (F)fn;
}

/* ---------------------------------------------------------------- ballast */

/* The program's own physical handles (cuMemCreate, which the hook never serves): they fill the
 * device so that only memory the hook really releases leaves room, or so that it is full. */
typedef CUresult (*gt_mem_create_fn)(CUmemGenericAllocationHandle *, size_t,
                                     const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*gt_mem_release_fn)(CUmemGenericAllocationHandle);

static std::vector<CUmemGenericAllocationHandle> gt_ballast;

static inline size_t gt_free_bytes(void)
{
    size_t fr = 0, tot = 0;
    CK(cudaMemGetInfo(&fr, &tot));
    return fr;
}

/* Pinned device memory of device 0, as a program's own cuMemCreate asks for it. */
static inline CUmemAllocationProp gt_device_prop(void)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    return prop;
}

/* Fills the device in 1 GiB handles until about keep bytes (at least) are free. */
static inline void gt_ballast_fill(size_t keep)
{
    gt_mem_create_fn create = gt_entry<gt_mem_create_fn>("cuMemCreate", 12000);
    if (!create)
        return;
    CUmemAllocationProp prop = gt_device_prop();
    gt_trim();
    size_t fr = gt_free_bytes();
    while (fr > keep + 1 * GiB) {
        CUmemGenericAllocationHandle h = 0;
        if (create(&h, 1 * GiB, &prop, 0) != CUDA_SUCCESS)
            break;
        gt_ballast.push_back(h);
        fr -= 1 * GiB;
    }
    INFO("ballast: %zu GiB of own cuMemCreate handles; cudaMemGetInfo free now %zu MiB",
         gt_ballast.size(), gt_free_bytes() / MiB);
}

/* Releases ballast handles until at least `bytes` are released (all of them by default). */
static inline void gt_ballast_release(size_t bytes = SIZE_MAX)
{
    gt_mem_release_fn release = gt_entry<gt_mem_release_fn>("cuMemRelease", 12000);
    for (size_t done = 0; !gt_ballast.empty() && done < bytes; done += 1 * GiB) {
        if (release)
            CKD(release(gt_ballast.back()));
        gt_ballast.pop_back();
    }
}

/* The driver clears the memory a program releases on the GPU itself, after cuMemRelease has
 * returned (H200, driver 580: a 4 GiB copy right after 131 GiB were released ran at 25.6 GiB/s
 * instead of 51; 40 GiB made again at once on a full GPU took 78 ms of cuMemCreate, 1 s later 8 ms:
 * docs/GPU-RUNS.md, round 15, tools/probe/copy_paths.cu). A timing that should not include that
 * clearing waits for it first. */
static inline void gt_settle(void)
{
    CK(cudaDeviceSynchronize());
    usleep(1500 * 1000);
}

typedef decltype(&cuMemGetAddressRange) gt_range_fn;
typedef decltype(&cuPointerGetAttribute) gt_attr_fn;
typedef decltype(&cuPointerGetAttributes) gt_attrs_fn;

/* How many of the addresses answer "mapped" to cuMemGetAddressRange (a freed buffer must not:
 * natively the driver answers an error for a freed cudaMalloc block). */
static inline size_t gt_count_mapped(gt_range_fn range, const uintptr_t *addrs, size_t n,
                                     int *first_code)
{
    size_t mapped = 0;
    if (first_code)
        *first_code = -1;
    for (size_t i = 0; i < n; i++) {
        CUdeviceptr base = 0;
        size_t size = 0;
        CUresult r = range(&base, &size, (CUdeviceptr)addrs[i]);
        if (first_code && *first_code < 0)
            *first_code = (int)r;
        if (r == CUDA_SUCCESS) {
            if (mapped < 4)
                INFO("still mapped after free: 0x%" PRIxPTR " -> base 0x%llx size %zu", addrs[i],
                     (unsigned long long)base, size);
            mapped++;
        }
    }
    return mapped;
}

/* The leftover check (g): freed addresses answer "not mapped" before and after vmm_trim().
 * R lines are compared with the native run; with the hook loaded, any mapped address fails. */
static inline void gt_leftover_check(const char *tag, const uintptr_t *addrs, size_t n)
{
    gt_range_fn range = gt_entry<gt_range_fn>("cuMemGetAddressRange");
    if (!range)
        return;
    CK(cudaDeviceSynchronize());
    int code_before = -1, code_after = -1;
    size_t before = gt_count_mapped(range, addrs, n, &code_before);
    INFO("leftover %s: probing %zu freed addresses", tag, n);
    R("leftover %s mapped_before_trim=%zu", tag, before);
    gt_trim();
    size_t after = gt_count_mapped(range, addrs, n, &code_after);
    R("leftover %s mapped_after_trim=%zu", tag, after);
    INFO("leftover %s first codes: before trim %d, after trim %d (500 = NOT_FOUND, 1 = "
         "INVALID_VALUE)",
         tag, code_before, code_after);
    if (gt_hooked()) {
        CHECK(before == 0, "%s: %zu freed addresses still answer as mapped (before trim)", tag,
              before);
        CHECK(after == 0, "%s: %zu freed addresses still answer as mapped after vmm_trim", tag,
              after);
    }
}

/* ---------------------------------------------------------------- patterns and kernels */

__host__ __device__ static inline uint32_t gt_hash(uint64_t seed, uint64_t i)
{
    uint64_t x = seed ^ (i * 0x9E3779B97F4A7C15ull);
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 32;
    return (uint32_t)x;
}

/* The expected byte at offset j of a buffer of n bytes filled with seed: 32-bit words of
 * gt_hash(seed, word), and the bytes past the last whole word gt_hash(seed, ~j). */
__host__ __device__ static inline uint8_t gt_byte(uint64_t seed, size_t n, size_t j)
{
    size_t words = n / 4;
    if (j < words * 4)
        return (uint8_t)(gt_hash(seed, j / 4) >> (8 * (j % 4)));
    return (uint8_t)gt_hash(seed, ~(uint64_t)j);
}

#define GT_SLOTS 128
__device__ unsigned long long gt_bad[GT_SLOTS];   /* mismatch counters, one per slot */
__device__ unsigned long long gt_first[GT_SLOTS]; /* first mismatching offset (min) */

__device__ static void gt_fill_body(uint8_t *p, size_t n, uint64_t seed)
{
    size_t words = n / 4;
    size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    uint32_t *w = (uint32_t *)p;
    for (size_t i = tid; i < words; i += stride)
        w[i] = gt_hash(seed, i);
    for (size_t j = words * 4 + tid; j < n; j += stride)
        p[j] = (uint8_t)gt_hash(seed, ~(uint64_t)j);
}

__global__ static void gt_fill_k(uint8_t *p, size_t n, uint64_t seed)
{
    gt_fill_body(p, n, seed);
}

__global__ static void gt_verify_k(const uint8_t *p, size_t n, uint64_t seed, int slot)
{
    size_t words = n / 4;
    size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    const uint32_t *w = (const uint32_t *)p;
    unsigned long long bad = 0, first = ~0ull;
    for (size_t i = tid; i < words; i += stride)
        if (w[i] != gt_hash(seed, i)) {
            if (!bad)
                first = i * 4;
            bad++;
        }
    for (size_t j = words * 4 + tid; j < n; j += stride)
        if (p[j] != (uint8_t)gt_hash(seed, ~(uint64_t)j)) {
            if (!bad)
                first = j;
            bad++;
        }
    if (bad) {
        atomicAdd(&gt_bad[slot], bad);
        atomicMin(&gt_first[slot], first);
    }
}

__global__ static void gt_verify_const_k(const uint8_t *p, size_t n, uint8_t v, int slot)
{
    size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    unsigned long long bad = 0, first = ~0ull;
    size_t words = n / 4;
    uint32_t vw = v * 0x01010101u;
    const uint32_t *w = (const uint32_t *)p;
    for (size_t i = tid; i < words; i += stride)
        if (w[i] != vw) {
            if (!bad)
                first = i * 4;
            bad++;
        }
    for (size_t j = words * 4 + tid; j < n; j += stride)
        if (p[j] != v) {
            if (!bad)
                first = j;
            bad++;
        }
    if (bad) {
        atomicAdd(&gt_bad[slot], bad);
        atomicMin(&gt_first[slot], first);
    }
}

/* Spins for ns nanoseconds of %globaltimer, then fills the buffer: queued work that still
 * writes a buffer long after the host moved on. */
__global__ static void gt_slow_fill_k(uint8_t *p, size_t n, uint64_t seed, unsigned long long ns)
{
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
    gt_fill_body(p, n, seed);
}

static inline unsigned gt_blocks(size_t n)
{
    size_t b = (n / 4 + 255) / 256;
    if (b < 1)
        b = 1;
    if (b > 2048)
        b = 2048;
    return (unsigned)b;
}

/* Fills p[0..n) with the pattern of seed on stream. p must be 4-byte aligned. */
static inline int gt_fill(void *p, size_t n, uint64_t seed, cudaStream_t s = 0)
{
    if (n == 0)
        return 0;
    gt_fill_k<<<gt_blocks(n), 256, 0, s>>>((uint8_t *)p, n, seed);
    return CK(cudaGetLastError());
}

static inline int gt_slow_fill(void *p, size_t n, uint64_t seed, unsigned long long ns,
                               cudaStream_t s)
{
    gt_slow_fill_k<<<gt_blocks(n), 256, 0, s>>>((uint8_t *)p, n, seed, ns);
    return CK(cudaGetLastError());
}

static inline unsigned long long gt_collect(int slot, cudaStream_t s, const char *what, size_t n)
{
    unsigned long long bad = ~0ull, first = ~0ull;
    CK(cudaMemcpyFromSymbolAsync(&bad, gt_bad, sizeof bad, slot * sizeof bad,
                                 cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyFromSymbolAsync(&first, gt_first, sizeof first, slot * sizeof first,
                                 cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    if (bad)
        printf("FAIL data: %s: %llu mismatching words/bytes of %zu bytes, first at offset %llu\n",
               what, bad, n, first);
    return bad;
}

static inline void gt_reset(int slot, cudaStream_t s)
{
    static const unsigned long long zero = 0, ones = ~0ull;
    CK(cudaMemcpyToSymbolAsync(gt_bad, &zero, sizeof zero, slot * sizeof zero,
                               cudaMemcpyHostToDevice, s));
    CK(cudaMemcpyToSymbolAsync(gt_first, &ones, sizeof ones, slot * sizeof ones,
                               cudaMemcpyHostToDevice, s));
}

/* Mismatches of p[0..n) against the pattern of seed (0 = intact). slot: a counter slot that no
 * other thread uses at the same time (0 for single-threaded programs). */
static inline unsigned long long gt_verify(const void *p, size_t n, uint64_t seed,
                                           cudaStream_t s = 0, int slot = 0,
                                           const char *what = "verify")
{
    if (n == 0)
        return 0;
    gt_reset(slot, s);
    gt_verify_k<<<gt_blocks(n), 256, 0, s>>>((const uint8_t *)p, n, seed, slot);
    if (CK(cudaGetLastError()))
        return ~0ull;
    return gt_collect(slot, s, what, n);
}

static inline unsigned long long gt_verify_const(const void *p, size_t n, uint8_t v,
                                                 cudaStream_t s = 0, int slot = 0,
                                                 const char *what = "verify_const")
{
    if (n == 0)
        return 0;
    gt_reset(slot, s);
    gt_verify_const_k<<<gt_blocks(n), 256, 0, s>>>((const uint8_t *)p, n, v, slot);
    if (CK(cudaGetLastError()))
        return ~0ull;
    return gt_collect(slot, s, what, n);
}

/* Host copy of the pattern, for H2D/D2H comparisons. */
static inline void gt_host_pattern(uint8_t *h, size_t n, uint64_t seed)
{
    size_t words = n / 4;
    for (size_t i = 0; i < words; i++) {
        uint32_t v = gt_hash(seed, i);
        memcpy(h + 4 * i, &v, 4); /* little-endian, as the device stores it */
    }
    for (size_t j = words * 4; j < n; j++)
        h[j] = (uint8_t)gt_hash(seed, ~(uint64_t)j);
}

#endif
