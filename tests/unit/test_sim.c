/* The simulated driver's own tests: every strictness rule (the code, and that the rejected call
 * changed nothing), reference counting, contents, fault injection, contexts. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>

#include <cudaTypedefs.h>

#include "simdrv.h"

#define MB (1024ULL * 1024)
#define GB (1024ULL * MB)
#define G2 (2 * MB)

#define OK(x) assert_int_equal((x), CUDA_SUCCESS)
#define RC(code, x) assert_int_equal((x), (code))
#define LEDGER_EMPTY()                \
    do {                              \
        if (!sim_ledger_empty())      \
            sim_ledger_dump();        \
        assert_true(sim_ledger_empty()); \
    } while (0)

static const vmh_driver_t *D;

/* Snapshot of everything a rejected call must leave alone. */
typedef struct snap {
    size_t allocs, handles, resvs, maps, native, used0;
} snap_t;

static snap_t snap(void)
{
    return (snap_t){sim_live_allocations(), sim_live_handles(), sim_live_reservations(),
                    sim_live_mappings(), sim_live_native(), sim_device_used(0)};
}

static void same(snap_t a)
{
    snap_t b = snap();
    assert_int_equal(a.allocs, b.allocs);
    assert_int_equal(a.handles, b.handles);
    assert_int_equal(a.resvs, b.resvs);
    assert_int_equal(a.maps, b.maps);
    assert_int_equal(a.native, b.native);
    assert_int_equal(a.used0, b.used0);
}

static CUmemAllocationProp prop_dev(int dev, int types)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    p.requestedHandleTypes = (CUmemAllocationHandleType)types;
    return p;
}

static CUmemGenericAllocationHandle create(size_t size, int dev)
{
    CUmemAllocationProp p = prop_dev(dev, 0);
    CUmemGenericAllocationHandle h = 0;
    OK(D->cuMemCreate(&h, size, &p, 0));
    return h;
}

static CUdeviceptr reserve(size_t size, CUdeviceptr hint)
{
    CUdeviceptr p = 0;
    OK(D->cuMemAddressReserve(&p, size, 0, hint, 0));
    return p;
}

static void set_access(CUdeviceptr p, size_t size, int dev, CUmemAccess_flags flags)
{
    CUmemAccessDesc a;
    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = dev;
    a.flags = flags;
    OK(D->cuMemSetAccess(p, size, &a, 1));
}

static int setup(void **state)
{
    (void)state;
    sim_reset(NULL);
    D = sim_table();
    return 0;
}

static int setup_small(void **state)
{
    (void)state;
    sim_config_t c = {.memory = 64 * MB, .va_size = 1 * GB};
    sim_reset(&c);
    D = sim_table();
    return 0;
}

static int setup_two(void **state)
{
    (void)state;
    sim_config_t c = {.devices = 2, .memory = 256 * MB};
    sim_reset(&c);
    D = sim_table();
    return 0;
}

/* ---------------------------------------------------------------------------------------- */

/* Runs first, before any sim_reset. */
static void test_not_initialized(void **state)
{
    (void)state;
    D = sim_table();
    CUmemGenericAllocationHandle h;
    CUmemAllocationProp p = prop_dev(0, 0);
    RC(CUDA_ERROR_NOT_INITIALIZED, D->cuMemCreate(&h, G2, &p, 0));
    CUdeviceptr d;
    RC(CUDA_ERROR_NOT_INITIALIZED, D->cuMemAlloc(&d, 16));
    int v = 0;
    OK(D->cuDriverGetVersion(&v));
    assert_int_equal(v, 13000);
    /* cuGetProcAddress needs no cuInit; the CUDA 13 context-taking forms do. */
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    OK(sim_get_proc_address("cuCtxSynchronize", &fn, 13000, 0, &st));
    RC(CUDA_ERROR_NOT_INITIALIZED, ((PFN_cuCtxSynchronize_v13000)fn)(NULL));
    OK(sim_get_proc_address("cuCtxGetDevice", &fn, 13000, 0, &st));
    CUdevice dev = -7;
    RC(CUDA_ERROR_NOT_INITIALIZED, ((PFN_cuCtxGetDevice_v13000)fn)(&dev, NULL));
    assert_int_equal(dev, -7);
    sim_reset(NULL);
    LEDGER_EMPTY();
}

static void test_table_complete(void **state)
{
    (void)state;
    const void *const *f = (const void *const *)(const void *)D;
    for (size_t i = 0; i < sizeof(vmh_driver_t) / sizeof(void *); i++)
        assert_non_null(f[i]);
    OK(D->cuInit(0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuInit(1));
    int n = 0;
    OK(D->cuDeviceGetCount(&n));
    assert_int_equal(n, 1);
    size_t total = 0;
    OK(D->cuDeviceTotalMem(&total, 0));
    assert_int_equal(total, 80 * GB);
    RC(CUDA_ERROR_INVALID_DEVICE, D->cuDeviceTotalMem(&total, 1));
    int vmm = 0;
    OK(D->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
    assert_int_equal(vmm, 1);
    LEDGER_EMPTY();
}

static void test_contexts(void **state)
{
    (void)state;
    CUcontext c = NULL, primary = NULL;
    OK(D->cuCtxGetCurrent(&c));
    assert_non_null(c); /* sim_reset made device 0 current here */
    OK(D->cuDevicePrimaryCtxRetain(&primary, 0));
    assert_ptr_equal(c, primary);
    CUdevice dev = -1;
    OK(D->cuCtxGetDevice(&dev));
    assert_int_equal(dev, 0);
    OK(D->cuCtxPopCurrent(&c));
    assert_ptr_equal(c, primary);
    OK(D->cuCtxGetCurrent(&c));
    assert_null(c);
    RC(CUDA_ERROR_INVALID_CONTEXT, D->cuCtxPopCurrent(&c));
    RC(CUDA_ERROR_INVALID_CONTEXT, D->cuCtxGetDevice(&dev));
    RC(CUDA_ERROR_INVALID_CONTEXT, D->cuCtxSynchronize());
    size_t fr, tot;
    RC(CUDA_ERROR_INVALID_CONTEXT, D->cuMemGetInfo(&fr, &tot));
    CUdeviceptr d;
    RC(CUDA_ERROR_INVALID_CONTEXT, D->cuMemAlloc(&d, 256));
    /* VMM calls need no context. */
    CUmemGenericAllocationHandle h = create(G2, 0);
    OK(D->cuMemRelease(h));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuCtxPushCurrent(NULL));
    RC(CUDA_ERROR_INVALID_CONTEXT, D->cuCtxPushCurrent((CUcontext)&fr));
    OK(D->cuCtxPushCurrent(primary));
    OK(D->cuCtxGetDevice(&dev));
    assert_int_equal(dev, 0);
    sim_set_current_device(-1);
    assert_int_equal(sim_current_device(), -1);
    sim_set_current_device(0);
    assert_int_equal(sim_current_device(), 0);
    LEDGER_EMPTY();
}

static void *thread_ctx(void *arg)
{
    (void)arg;
    CUcontext c = (CUcontext)1;
    if (D->cuCtxGetCurrent(&c) != CUDA_SUCCESS || c != NULL)
        return (void *)1;
    CUdeviceptr d;
    if (D->cuMemAlloc(&d, 256) != CUDA_ERROR_INVALID_CONTEXT)
        return (void *)2;
    sim_set_current_device(1);
    CUdevice dev;
    if (D->cuCtxGetDevice(&dev) != CUDA_SUCCESS || dev != 1)
        return (void *)3;
    if (D->cuMemAlloc(&d, 256) != CUDA_SUCCESS)
        return (void *)4;
    if (sim_device_used(1) != 512)
        return (void *)5;
    if (D->cuMemFree(d) != CUDA_SUCCESS)
        return (void *)6;
    return NULL;
}

static void test_per_thread_contexts(void **state)
{
    (void)state;
    pthread_t t;
    void *ret = (void *)99;
    assert_int_equal(pthread_create(&t, NULL, thread_ctx, NULL), 0);
    pthread_join(t, &ret);
    assert_null(ret);
    CUdevice dev = -1;
    OK(D->cuCtxGetDevice(&dev));
    assert_int_equal(dev, 0); /* the other thread's choice did not leak here */
    /* Device memory is per device. */
    size_t fr0, tot;
    CUmemGenericAllocationHandle h = create(4 * G2, 1);
    OK(D->cuMemGetInfo(&fr0, &tot));
    assert_int_equal(fr0, tot);
    sim_set_current_device(1);
    size_t fr1;
    OK(D->cuMemGetInfo(&fr1, &tot));
    assert_int_equal(fr1, tot - 4 * G2);
    OK(D->cuMemRelease(h));
    LEDGER_EMPTY();
}

/* ---------------------------------------------------------------------------------------- */

static void test_granularity(void **state)
{
    (void)state;
    CUmemAllocationProp p = prop_dev(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    size_t g = 0;
    OK(D->cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    assert_int_equal(g, G2);
    OK(D->cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    assert_int_equal(g, G2);
    RC(CUDA_ERROR_INVALID_VALUE,
       D->cuMemGetAllocationGranularity(&g, &p, (CUmemAllocationGranularity_flags)7));
    p.location.id = 3;
    RC(CUDA_ERROR_INVALID_DEVICE,
       D->cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    sim_config_t c = {.granularity = 64 * 1024, .recommended = G2};
    sim_reset(&c);
    p.location.id = 0;
    OK(D->cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    assert_int_equal(g, 64 * 1024);
    OK(D->cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    assert_int_equal(g, G2);
    LEDGER_EMPTY();
}

static void test_create_rules(void **state)
{
    (void)state;
    snap_t s = snap();
    CUmemGenericAllocationHandle h = 0;
    CUmemAllocationProp p = prop_dev(0, 0);
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemCreate(&h, G2 + 4096, &p, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemCreate(&h, 0, &p, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemCreate(&h, G2, &p, 1));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemCreate(NULL, G2, &p, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemCreate(&h, G2, NULL, 0));
    p.type = CU_MEM_ALLOCATION_TYPE_MANAGED;
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemCreate(&h, G2, &p, 0));
    p = prop_dev(1, 0);
    RC(CUDA_ERROR_INVALID_DEVICE, D->cuMemCreate(&h, G2, &p, 0));
    p = prop_dev(0, CU_MEM_HANDLE_TYPE_FABRIC);
    RC(CUDA_ERROR_NOT_PERMITTED, D->cuMemCreate(&h, G2, &p, 0));
    p = prop_dev(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC);
    RC(CUDA_ERROR_NOT_PERMITTED, D->cuMemCreate(&h, G2, &p, 0));
    p = prop_dev(0, 0);
    p.location.type = CU_MEM_LOCATION_TYPE_INVALID;
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemCreate(&h, G2, &p, 0));
    assert_int_equal(h, 0);
    same(s);
    /* POSIX_FD, HOST and HOST_NUMA are fine; host memory is not charged to the device. */
    p = prop_dev(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    OK(D->cuMemCreate(&h, G2, &p, 0));
    assert_int_equal(sim_device_used(0), G2);
    OK(D->cuMemRelease(h));
    p = prop_dev(0, 0);
    p.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    OK(D->cuMemCreate(&h, G2, &p, 0));
    assert_int_equal(sim_device_used(0), 0);
    OK(D->cuMemRelease(h));
    p.location.type = CU_MEM_LOCATION_TYPE_HOST;
    OK(D->cuMemCreate(&h, G2, &p, 0));
    OK(D->cuMemRelease(h));
    LEDGER_EMPTY();
}

static void test_out_of_memory(void **state)
{
    (void)state;
    CUmemGenericAllocationHandle h[32];
    size_t n = 0;
    CUmemAllocationProp p = prop_dev(0, 0);
    while (n < 32 && D->cuMemCreate(&h[n], G2, &p, 0) == CUDA_SUCCESS)
        n++;
    assert_int_equal(n, 32); /* 64 MiB = 32 chunks */
    snap_t s = snap();
    CUmemGenericAllocationHandle x = 0;
    RC(CUDA_ERROR_OUT_OF_MEMORY, D->cuMemCreate(&x, G2, &p, 0));
    CUdeviceptr d = 0;
    RC(CUDA_ERROR_OUT_OF_MEMORY, D->cuMemAlloc(&d, 1));
    size_t fr, tot;
    OK(D->cuMemGetInfo(&fr, &tot));
    assert_int_equal(fr, 0);
    assert_int_equal(tot, 64 * MB);
    same(s);
    for (size_t i = 0; i < n; i++)
        OK(D->cuMemRelease(h[i]));
    /* Native and VMM share the capacity. */
    OK(D->cuMemAlloc(&d, 63 * MB));
    RC(CUDA_ERROR_OUT_OF_MEMORY, D->cuMemCreate(&x, G2, &p, 0));
    OK(D->cuMemFree(d));
    OK(D->cuMemCreate(&x, G2, &p, 0));
    OK(D->cuMemRelease(x));
    LEDGER_EMPTY();
}

static void test_reserve_rules(void **state)
{
    (void)state;
    snap_t s = snap();
    CUdeviceptr p = 0;
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressReserve(&p, G2 + 1, 0, 0, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressReserve(&p, 0, 0, 0, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressReserve(&p, G2, 3 * G2, 0, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressReserve(&p, G2, 0, 0, 1));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressReserve(NULL, G2, 0, 0, 0));
    CUdeviceptr a = reserve(8 * G2, 0);
    assert_int_equal(a % G2, 0);
    /* Hint not a multiple of max(alignment, granularity). */
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressReserve(&p, G2, 0, a + 8 * G2 + 4096, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressReserve(&p, G2, 4 * G2, a + 9 * G2, 0));
    assert_int_equal(sim_live_reservations(), 1);
    /* Adjacent hint granted; an occupied hint moved elsewhere without overlap. */
    CUdeviceptr b = reserve(4 * G2, a + 8 * G2);
    assert_int_equal(b, a + 8 * G2);
    CUdeviceptr c = reserve(4 * G2, a + 2 * G2);
    assert_true(c != a + 2 * G2);
    assert_true(c >= b + 4 * G2 || c + 4 * G2 <= a);
    /* Alignment respected. */
    CUdeviceptr e = 0;
    OK(D->cuMemAddressReserve(&e, G2, 1ULL << 30, 0, 0));
    assert_int_equal(e % (1ULL << 30), 0);
    /* Refused hints. */
    sim_refuse_hints(true);
    CUdeviceptr f = reserve(G2, b + 4 * G2);
    assert_true(f != b + 4 * G2);
    sim_refuse_hints(false);
    assert_true(sim_is_reserved(a) && sim_is_reserved(b + 4 * G2 - 1) && !sim_is_reserved(0));
    /* Free: exact pair only. */
    snap_t s2 = snap();
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressFree(a, 4 * G2));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressFree(a + G2, 7 * G2));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressFree(a, 12 * G2)); /* a and b together */
    same(s2);
    OK(D->cuMemAddressFree(a, 8 * G2));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressFree(a, 8 * G2));
    OK(D->cuMemAddressFree(b, 4 * G2));
    OK(D->cuMemAddressFree(c, 4 * G2));
    OK(D->cuMemAddressFree(e, G2));
    OK(D->cuMemAddressFree(f, G2));
    same(s);
    LEDGER_EMPTY();
}

static void test_va_exhaustion(void **state)
{
    (void)state; /* setup_small: 1 GiB of address space */
    CUdeviceptr p[600];
    size_t n = 0;
    while (n < 600 && D->cuMemAddressReserve(&p[n], G2, 0, 0, 0) == CUDA_SUCCESS)
        n++;
    assert_int_equal(n, 512);
    CUdeviceptr x = 0;
    RC(CUDA_ERROR_OUT_OF_MEMORY, D->cuMemAddressReserve(&x, G2, 0, 0, 0));
    RC(CUDA_ERROR_OUT_OF_MEMORY, D->cuMemAddressReserve(&x, 2 * GB, 0, 0, 0));
    for (size_t i = 0; i < n; i++)
        OK(D->cuMemAddressFree(p[i], G2));
    OK(D->cuMemAddressReserve(&x, GB, 0, 0, 0));
    OK(D->cuMemAddressFree(x, GB));
    LEDGER_EMPTY();
}

static void test_map_rules(void **state)
{
    (void)state;
    CUmemGenericAllocationHandle h = create(4 * G2, 0), h2 = create(G2, 0);
    CUdeviceptr r = reserve(8 * G2, 0), r2 = reserve(4 * G2, 0);
    snap_t s = snap();
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemMap(r + 4096, 4 * G2, 0, h, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemMap(r, 4 * G2, 4096, h, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemMap(r, 4 * G2, 0, h, 1));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemMap(r, 4 * G2, 0, h + 1, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemMap(r, 8 * G2, 0, h, 0)); /* larger than the chunk */
    RC(CUDA_ERROR_NOT_SUPPORTED, D->cuMemMap(r, 2 * G2, 2 * G2, h, 0)); /* partial: 801 */
    RC(CUDA_ERROR_NOT_SUPPORTED, D->cuMemMap(r, 2 * G2, 0, h, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemMap(r + 6 * G2, 4 * G2, 0, h, 0)); /* crosses the end */
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemMap(0x1000000, 4 * G2, 0, h, 0)); /* not reserved */
    same(s);
    OK(D->cuMemMap(r, 4 * G2, 0, h, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemMap(r + 3 * G2, G2, 0, h2, 0)); /* overlaps */
    assert_int_equal(sim_live_mappings(), 1);
    OK(D->cuMemMap(r + 4 * G2, G2, 0, h2, 0));
    OK(D->cuMemMap(r2, 4 * G2, 0, h, 0)); /* the same chunk twice */
    assert_true(sim_is_mapped(r) && sim_is_mapped(r + 5 * G2 - 1) && !sim_is_mapped(r + 5 * G2));
    /* Reservation with mappings cannot go. */
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAddressFree(r, 8 * G2));
    /* Unmap: whole mappings only, adjacent ones together, no holes. */
    snap_t s2 = snap();
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemUnmap(r, 2 * G2));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemUnmap(r + G2, 4 * G2));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemUnmap(r, 6 * G2)); /* runs past the second mapping */
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemUnmap(r + 6 * G2, G2));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemUnmap(r, 0));
    same(s2);
    OK(D->cuMemUnmap(r, 5 * G2)); /* both adjacent mappings at once */
    assert_int_equal(sim_live_mappings(), 1);
    OK(D->cuMemMap(r, 4 * G2, 0, h, 0));
    OK(D->cuMemMap(r + 5 * G2, G2, 0, h2, 0)); /* a hole at r + 4 G2 */
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemUnmap(r, 6 * G2));
    OK(D->cuMemUnmap(r + 5 * G2, G2));
    OK(D->cuMemUnmap(r, 4 * G2));
    OK(D->cuMemUnmap(r2, 4 * G2));
    OK(D->cuMemRelease(h));
    OK(D->cuMemRelease(h2));
    OK(D->cuMemAddressFree(r, 8 * G2));
    OK(D->cuMemAddressFree(r2, 4 * G2));
    LEDGER_EMPTY();
}

static void test_access_rules(void **state)
{
    (void)state;
    CUmemGenericAllocationHandle h = create(2 * G2, 0);
    CUdeviceptr r = reserve(4 * G2, 0);
    OK(D->cuMemMap(r, 2 * G2, 0, h, 0));
    CUmemAccessDesc a;
    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = 0;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemSetAccess(r, 2 * G2, &a, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemSetAccess(r, 3 * G2, &a, 1)); /* not all mapped */
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemSetAccess(r + 2 * G2, G2, &a, 1));
    a.location.id = 5;
    RC(CUDA_ERROR_INVALID_DEVICE, D->cuMemSetAccess(r, 2 * G2, &a, 1));
    a.location.id = 0;
    a.flags = (CUmemAccess_flags)2;
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemSetAccess(r, 2 * G2, &a, 1));
    assert_int_equal(sim_access_flags(r, 0), 0); /* nothing changed */
    char buf[16] = "abc";
    RC(CUDA_ERROR_ILLEGAL_ADDRESS, sim_write(r, buf, 4));
    set_access(r, 2 * G2, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(r + G2, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    OK(sim_write(r + 100, buf, 4));
    RC(CUDA_ERROR_ILLEGAL_ADDRESS, sim_write(r + 2 * G2 - 2, buf, 4)); /* runs off the end */
    /* Read-only on part of it. */
    set_access(r + G2, G2, 0, CU_MEM_ACCESS_FLAGS_PROT_READ);
    RC(CUDA_ERROR_ILLEGAL_ADDRESS, sim_write(r + G2, buf, 1));
    OK(sim_read(buf, r + G2, 1));
    /* After unmap, a new mapping starts with no access. */
    OK(D->cuMemUnmap(r, 2 * G2));
    OK(D->cuMemMap(r, 2 * G2, 0, h, 0));
    assert_int_equal(sim_access_flags(r, 0), 0);
    RC(CUDA_ERROR_ILLEGAL_ADDRESS, sim_read(buf, r + 100, 4));
    set_access(r, 2 * G2, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    memset(buf, 0, sizeof buf);
    OK(sim_read(buf, r + 100, 4)); /* contents belong to the chunk: kept */
    assert_string_equal(buf, "abc");
    OK(D->cuMemUnmap(r, 2 * G2));
    OK(D->cuMemRelease(h));
    OK(D->cuMemAddressFree(r, 4 * G2));
    LEDGER_EMPTY();
}

static void test_release_refcount(void **state)
{
    (void)state;
    CUmemGenericAllocationHandle h = create(4 * G2, 0);
    assert_int_equal(sim_device_used(0), 4 * G2);
    CUdeviceptr r = reserve(4 * G2, 0);
    OK(D->cuMemMap(r, 4 * G2, 0, h, 0));
    set_access(r, 4 * G2, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    OK(sim_memset(r, 0x5a, 64));
    OK(D->cuMemRelease(h)); /* legal while mapped */
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemRelease(h)); /* double release */
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemMap(r, 4 * G2, 0, h, 0)); /* handle gone */
    assert_int_equal(sim_live_allocations(), 1);
    assert_int_equal(sim_live_handles(), 0);
    assert_int_equal(sim_device_used(0), 4 * G2);
    unsigned char b = 0;
    OK(sim_read(&b, r + 63, 1));
    assert_int_equal(b, 0x5a);
    /* cuMemRetainAllocationHandle gives a handle back (a reference). */
    CUmemGenericAllocationHandle h2 = 0;
    {
        CUresult (*retain)(CUmemGenericAllocationHandle *, void *) = NULL;
        OK(sim_get_proc_address("cuMemRetainAllocationHandle", (void **)&retain, 13000, 0, NULL));
        OK(retain(&h2, (void *)(uintptr_t)(r + G2)));
    }
    OK(D->cuMemUnmap(r, 4 * G2));
    assert_int_equal(sim_live_allocations(), 1); /* h2 holds it */
    OK(D->cuMemRelease(h2));
    assert_int_equal(sim_live_allocations(), 0);
    assert_int_equal(sim_device_used(0), 0);
    OK(D->cuMemAddressFree(r, 4 * G2));
    LEDGER_EMPTY();
}

static void test_export_import(void **state)
{
    (void)state;
    CUmemAllocationProp p = prop_dev(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h = 0, plain = create(G2, 0), imp = 0;
    OK(D->cuMemCreate(&h, G2, &p, 0));
    int fd = -1;
    RC(CUDA_ERROR_INVALID_VALUE,
       D->cuMemExportToShareableHandle(&fd, plain, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    RC(CUDA_ERROR_INVALID_VALUE,
       D->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_FABRIC, 0));
    assert_int_equal(fd, -1);
    OK(D->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    assert_true(fd >= 0);
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemImportFromShareableHandle(
                                     &imp, (void *)(intptr_t)0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    OK(D->cuMemImportFromShareableHandle(&imp, (void *)(intptr_t)fd,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    assert_true(imp != h);
    assert_int_equal(sim_live_allocations(), 2);
    assert_int_equal(sim_live_handles(), 3);
    /* Both handles are the same memory. */
    CUdeviceptr r = reserve(2 * G2, 0);
    OK(D->cuMemMap(r, G2, 0, h, 0));
    OK(D->cuMemMap(r + G2, G2, 0, imp, 0));
    set_access(r, 2 * G2, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    OK(sim_write(r + 8, "xyz", 4));
    char buf[4] = {0};
    OK(sim_read(buf, r + G2 + 8, 4));
    assert_string_equal(buf, "xyz");
    OK(D->cuMemUnmap(r, 2 * G2));
    /* The importer's handle, taken before the exporter's release, keeps the memory and its
     * contents (as the real driver does). */
    OK(D->cuMemRelease(h));
    assert_int_equal(sim_live_allocations(), 2);
    OK(D->cuMemMap(r, G2, 0, imp, 0));
    set_access(r, G2, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    memset(buf, 0, sizeof buf);
    OK(sim_read(buf, r + 8, 4));
    assert_string_equal(buf, "xyz");
    OK(D->cuMemUnmap(r, G2));
    /* The open descriptor alone keeps it too: it can still be imported. */
    OK(D->cuMemRelease(imp));
    assert_int_equal(sim_live_allocations(), 2);
    assert_int_equal(sim_device_used(0), 2 * G2);
    OK(D->cuMemImportFromShareableHandle(&imp, (void *)(intptr_t)fd,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    OK(D->cuMemRelease(imp));
    /* Closed and released: the allocation goes (seen at the next query), and the number of
     * that descriptor names nothing. */
    int dup_fd = dup(fd);
    close(fd);
    assert_int_equal(sim_live_allocations(), 2); /* the duplicate is the same open file */
    close(dup_fd);
    assert_int_equal(sim_live_allocations(), 1);
    assert_int_equal(sim_device_used(0), G2);
    int other = memfd_create("not-an-export", MFD_CLOEXEC);
    assert_true(other >= 0);
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemImportFromShareableHandle(
                                     &imp, (void *)(intptr_t)other, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(other);
    OK(D->cuMemRelease(plain));
    OK(D->cuMemAddressFree(r, 2 * G2));
    LEDGER_EMPTY();
}

static void test_aliased_contents(void **state)
{
    (void)state;
    CUmemGenericAllocationHandle h = create(2 * G2, 0);
    CUdeviceptr a = reserve(2 * G2, 0), b = reserve(2 * G2, 0);
    OK(D->cuMemMap(a, 2 * G2, 0, h, 0));
    OK(D->cuMemMap(b, 2 * G2, 0, h, 0));
    set_access(a, 2 * G2, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    set_access(b, 2 * G2, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    size_t n = 3 * MB;
    unsigned char *src = malloc(n), *dst = malloc(n);
    for (size_t i = 0; i < n; i++)
        src[i] = (unsigned char)(i * 7 + 3);
    OK(sim_write(a + 1000, src, n));
    OK(sim_read(dst, b + 1000, n));
    assert_memory_equal(src, dst, n);
    /* Never-written memory reads as zeroes. */
    unsigned char z = 1;
    OK(sim_read(&z, b + 10, 1));
    assert_int_equal(z, 0);
    /* Copies go through the mappings; overlapping copies are memmove. */
    OK(D->cuMemcpyDtoD(a + 1001, a + 1000, n - 1));
    OK(sim_read(dst, b + 1001, n - 1));
    assert_memory_equal(src, dst, n - 1);
    RC(CUDA_ERROR_ILLEGAL_ADDRESS, D->cuMemcpyDtoD(a, a + 4 * G2, 16));
    free(src);
    free(dst);
    OK(D->cuMemUnmap(a, 2 * G2));
    RC(CUDA_ERROR_ILLEGAL_ADDRESS, sim_read(&z, a, 1));
    OK(D->cuMemUnmap(b, 2 * G2));
    OK(D->cuMemRelease(h));
    OK(D->cuMemAddressFree(a, 2 * G2));
    OK(D->cuMemAddressFree(b, 2 * G2));
    LEDGER_EMPTY();
}

static void test_async_copy_hazard(void **state)
{
    (void)state;
    CUdeviceptr x = 0, y = 0;
    OK(D->cuMemAlloc(&x, 4096));
    OK(D->cuMemAlloc(&y, 4096));
    OK(sim_memset(x, 7, 4096));
    OK(D->cuMemcpyDtoDAsync(y, x, 4096, NULL));
    assert_int_equal(sim_pending_ops(), 1);
    RC(CUDA_ERROR_INVALID_HANDLE, D->cuMemcpyDtoDAsync(y, x, 16, (CUstream)0x1234));
    OK(D->cuStreamSynchronize(NULL));
    assert_int_equal(sim_pending_ops(), 0);
    unsigned char b = 0;
    OK(sim_read(&b, y + 4095, 1));
    assert_int_equal(b, 7);
    assert_int_equal(sim_hazards(), 0);
    /* A VMM range unmapped under a queued copy is a hazard. */
    CUmemGenericAllocationHandle h = create(G2, 0);
    CUdeviceptr r = reserve(G2, 0);
    OK(D->cuMemMap(r, G2, 0, h, 0));
    set_access(r, G2, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    OK(D->cuMemcpyDtoDAsync(r, x, 4096, CU_STREAM_LEGACY));
    OK(D->cuMemUnmap(r, G2));
    assert_true(sim_hazards() >= 1);
    OK(D->cuCtxSynchronize());
    OK(D->cuMemRelease(h));
    OK(D->cuMemAddressFree(r, G2));
    OK(D->cuMemFree(x));
    OK(D->cuMemFree(y));
    LEDGER_EMPTY();
}

/* ---------------------------------------------------------------------------------------- */

static void test_native_rules(void **state)
{
    (void)state;
    snap_t s = snap();
    CUdeviceptr d = 0;
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAlloc(&d, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAlloc(NULL, 16));
    RC(CUDA_ERROR_OUT_OF_MEMORY, D->cuMemAlloc(&d, 1ULL << 50)); /* 1 PiB */
    same(s);
    OK(D->cuMemFree(0));
    OK(D->cuMemAlloc(&d, 1000));
    assert_int_equal(d % 256, 0);
    CUdeviceptr base = 0;
    size_t size = 0;
    OK(D->cuMemGetAddressRange(&base, &size, d + 999));
    assert_int_equal(base, d);
    assert_int_equal(size, 1000);
    RC(CUDA_ERROR_NOT_FOUND, D->cuMemGetAddressRange(&base, &size, d + 1000));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemFree(d + 8)); /* interior */
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemFree(0x1234)); /* host/unknown */
    CUipcMemHandle ipc;
    OK(D->cuIpcGetMemHandle(&ipc, d));
    CUdeviceptr o = 0;
    RC(CUDA_ERROR_INVALID_CONTEXT, D->cuIpcOpenMemHandle(&o, ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    OK(D->cuMemFree(d));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemFree(d)); /* double free */
    RC(CUDA_ERROR_INVALID_VALUE, D->cuIpcGetMemHandle(&ipc, d));
    /* Pitch: width 1000 -> 1024, range pitch * height. */
    size_t pitch = 0;
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemAllocPitch(&d, &pitch, 1000, 77, 2));
    OK(D->cuMemAllocPitch(&d, &pitch, 1000, 77, 4));
    assert_int_equal(pitch, 1024);
    OK(D->cuMemGetAddressRange(&base, &size, d + 5000));
    assert_int_equal(base, d);
    assert_int_equal(size, 78848);
    OK(D->cuMemFreeAsync(d, NULL));
    /* VMM memory is not cuMemFree's. */
    CUmemGenericAllocationHandle h = create(G2, 0);
    CUdeviceptr r = reserve(G2, 0);
    OK(D->cuMemMap(r, G2, 0, h, 0));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemFree(r));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuIpcGetMemHandle(&ipc, r));
    assert_int_equal(sim_live_mappings(), 1);
    OK(D->cuMemUnmap(r, G2));
    OK(D->cuMemRelease(h));
    OK(D->cuMemAddressFree(r, G2));
    LEDGER_EMPTY();
}

static void test_pointer_queries(void **state)
{
    (void)state;
    CUmemGenericAllocationHandle h1 = create(G2, 0), h2 = create(G2, 0);
    CUdeviceptr r = reserve(8 * G2, 0);
    OK(D->cuMemMap(r, G2, 0, h1, 0));
    OK(D->cuMemMap(r + G2, G2, 0, h2, 0));
    CUdeviceptr base = 0;
    size_t size = 0;
    OK(D->cuMemGetAddressRange(&base, &size, r + G2 + 5));
    assert_int_equal(base, r + G2); /* the one mapping */
    assert_int_equal(size, G2);
    RC(CUDA_ERROR_NOT_FOUND, D->cuMemGetAddressRange(&base, &size, r + 3 * G2));
    CUdeviceptr start = 0;
    size_t rsize = 0;
    OK(D->cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, r + G2 + 5));
    OK(D->cuPointerGetAttribute(&rsize, CU_POINTER_ATTRIBUTE_RANGE_SIZE, r + G2 + 5));
    assert_int_equal(start, r); /* the reservation */
    assert_int_equal(rsize, 8 * G2);
    unsigned type = 0, mapped = 7;
    int ord = -1;
    OK(D->cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, r));
    assert_int_equal(type, CU_MEMORYTYPE_DEVICE);
    OK(D->cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, r));
    assert_int_equal(ord, 0);
    OK(D->cuPointerGetAttribute(&mapped, CU_POINTER_ATTRIBUTE_MAPPED, r + 3 * G2));
    assert_int_equal(mapped, 0);
    CUdeviceptr keep = 0x77;
    RC(CUDA_ERROR_INVALID_VALUE,
       D->cuPointerGetAttribute(&keep, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, 0x1000));
    assert_int_equal(keep, 0x77);
    /* Native: RANGE_* = the block. */
    CUdeviceptr d = 0;
    OK(D->cuMemAlloc(&d, 3 * MB + 3));
    OK(D->cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, d + MB));
    OK(D->cuPointerGetAttribute(&rsize, CU_POINTER_ATTRIBUTE_RANGE_SIZE, d + MB));
    assert_int_equal(start, d);
    assert_int_equal(rsize, 3 * MB + 3);
    CUcontext ctx = NULL, cur = NULL;
    OK(D->cuPointerGetAttribute(&ctx, CU_POINTER_ATTRIBUTE_CONTEXT, d));
    OK(D->cuCtxGetCurrent(&cur));
    assert_ptr_equal(ctx, cur);
    /* Batch form: unknown pointers get zeroes and success. */
    CUpointer_attribute at[3] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                 CU_POINTER_ATTRIBUTE_IS_MANAGED};
    unsigned t2 = 9, managed = 9;
    size_t rs = 9;
    void *data[3] = {&t2, &rs, &managed};
    OK(D->cuPointerGetAttributes(3, at, data, d + 1));
    assert_int_equal(t2, CU_MEMORYTYPE_DEVICE);
    assert_int_equal(rs, 3 * MB + 3);
    assert_int_equal(managed, 0);
    OK(D->cuPointerGetAttributes(3, at, data, 0x1000));
    assert_int_equal(t2, 0);
    assert_int_equal(rs, 0);
    OK(D->cuMemFree(d));
    OK(D->cuMemUnmap(r, 2 * G2));
    OK(D->cuMemRelease(h1));
    OK(D->cuMemRelease(h2));
    OK(D->cuMemAddressFree(r, 8 * G2));
    LEDGER_EMPTY();
}

static void test_two_devices(void **state)
{
    (void)state; /* setup_two */
    CUmemGenericAllocationHandle h = create(G2, 1);
    assert_int_equal(sim_device_used(1), G2);
    assert_int_equal(sim_device_used(0), 0);
    CUdeviceptr r = reserve(G2, 0);
    OK(D->cuMemMap(r, G2, 0, h, 0));
    set_access(r, G2, 1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    /* Current device 0 has no access. */
    RC(CUDA_ERROR_ILLEGAL_ADDRESS, sim_write(r, "a", 1));
    sim_set_current_device(1);
    OK(sim_write(r, "a", 1));
    sim_set_current_device(0);
    set_access(r, G2, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE); /* explicit peer access */
    assert_int_equal(sim_access_flags(r, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    char c = 0;
    OK(sim_read(&c, r, 1));
    assert_int_equal(c, 'a');
    int can = 0;
    OK(D->cuDeviceCanAccessPeer(&can, 0, 1));
    assert_int_equal(can, 1);
    CUcontext p1 = NULL;
    OK(D->cuDevicePrimaryCtxRetain(&p1, 1));
    OK(D->cuCtxEnablePeerAccess(p1, 0));
    RC(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, D->cuCtxEnablePeerAccess(p1, 0));
    OK(D->cuCtxDisablePeerAccess(p1));
    RC(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, D->cuCtxDisablePeerAccess(p1));
    OK(D->cuMemUnmap(r, G2));
    OK(D->cuMemRelease(h));
    OK(D->cuMemAddressFree(r, G2));
    LEDGER_EMPTY();
}

/* ---------------------------------------------------------------------------------------- */

static void test_fault_injection(void **state)
{
    (void)state;
    sim_reset_counters();
    assert_int_equal(sim_call_count(), 0);
    CUmemGenericAllocationHandle h = create(G2, 0);
    CUdeviceptr r = reserve(G2, 0);
    assert_int_equal(sim_call_count(), 2);
    assert_int_equal(sim_calls("cuMemCreate"), 1);
    assert_int_equal(sim_calls("cuMemAlloc"), 0);
    /* The 2nd call from now fails, whatever it is, and does nothing. */
    sim_fail_call(2, CUDA_ERROR_OUT_OF_MEMORY);
    OK(D->cuMemMap(r, G2, 0, h, 0));
    snap_t s = snap();
    CUmemAccessDesc a;
    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    RC(CUDA_ERROR_OUT_OF_MEMORY, D->cuMemSetAccess(r, G2, &a, 1));
    assert_int_equal(sim_access_flags(r, 0), 0);
    OK(D->cuMemSetAccess(r, G2, &a, 1)); /* one-shot */
    assert_int_equal(sim_faults_fired(), 1);
    /* By function: the next cuMemUnmap. */
    sim_fail_function("cuMemUnmap", 1, CUDA_ERROR_UNKNOWN);
    RC(CUDA_ERROR_UNKNOWN, D->cuMemUnmap(r, G2));
    same(s);
    assert_true(sim_is_mapped(r));
    /* A failing create writes no handle and charges nothing. */
    sim_fail_function("cuMemCreate", 1, CUDA_ERROR_OUT_OF_MEMORY);
    CUmemGenericAllocationHandle x = 0;
    CUmemAllocationProp p = prop_dev(0, 0);
    RC(CUDA_ERROR_OUT_OF_MEMORY, D->cuMemCreate(&x, G2, &p, 0));
    assert_int_equal(x, 0);
    same(s);
    /* Repeat: every cuMemRelease from the 1st, twice. */
    sim_fail_function_repeat("cuMemRelease", 1, 2, CUDA_ERROR_INVALID_VALUE);
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemRelease(h));
    RC(CUDA_ERROR_INVALID_VALUE, D->cuMemRelease(h));
    same(s);
    /* Clear. */
    sim_fail_call(1, CUDA_ERROR_UNKNOWN);
    sim_clear_faults();
    /* Trace. */
    sim_trace_begin();
    OK(D->cuMemUnmap(r, G2));
    OK(D->cuMemRelease(h));
    OK(D->cuMemAddressFree(r, G2));
    const char *names[8] = {0};
    assert_int_equal(sim_trace_get(names, 8), 3);
    assert_string_equal(names[0], "cuMemUnmap");
    assert_string_equal(names[1], "cuMemRelease");
    assert_string_equal(names[2], "cuMemAddressFree");
    sim_trace_end();
    assert_int_equal(sim_calls("cuMemUnmap"), 2);
    assert_true(sim_entry_count() > 30);
    assert_string_equal(sim_entry_name(0), "cuInit");
    LEDGER_EMPTY();
}

static void test_get_proc_address(void **state)
{
    (void)state;
    void *fn = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    OK(sim_get_proc_address("cuMemAlloc", &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
    assert_ptr_equal(fn, (void *)D->cuMemAlloc);
    assert_int_equal(st, CU_GET_PROC_ADDRESS_SUCCESS);
    OK(sim_get_proc_address("cuMemFreeAsync", &fn, 12000,
                            CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
    assert_non_null(fn);
    RC(CUDA_ERROR_NOT_FOUND, sim_get_proc_address("cuNoSuchThing", &fn, 13000, 0, &st));
    assert_null(fn);
    assert_int_equal(st, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    RC(CUDA_ERROR_NOT_FOUND, sim_get_proc_address("cuMemAlloc", &fn, 3000, 0, &st));
    assert_int_equal(st, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    RC(CUDA_ERROR_INVALID_VALUE, sim_get_proc_address("cuMemAlloc", &fn, 13000, 8, &st));
    LEDGER_EMPTY();
}

/* cuCtxGetDevice and cuCtxSynchronize: cuda.h declares the plain ABI with no versioning macro,
 * and CUDA 13 added _v2 forms taking a context (PFN_..._v13000). cuGetProcAddress answers the
 * _v2 from 13000 on and the plain function below, as the real 580 driver does. */
static void test_get_proc_address_ctx_v2(void **state)
{
    (void)state;
    static const char *const names[] = {"cuCtxGetDevice", "cuCtxSynchronize"};
    const void *plain[] = {(const void *)D->cuCtxGetDevice, (const void *)D->cuCtxSynchronize};
    static const cuuint64_t flagsets[] = {0, CU_GET_PROC_ADDRESS_LEGACY_STREAM,
                                          CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM};
    for (size_t i = 0; i < 2; i++) {
        for (size_t f = 0; f < 3; f++) {
            void *fn = NULL, *v13 = NULL, *fn2 = NULL;
            CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
            OK(sim_get_proc_address(names[i], &fn, 2000, flagsets[f], &st));
            assert_int_equal(st, CU_GET_PROC_ADDRESS_SUCCESS);
            assert_ptr_equal(fn, plain[i]);
            OK(sim_get_proc_address(names[i], &fn, 12000, flagsets[f], &st));
            assert_ptr_equal(fn, plain[i]);
            OK(sim_get_proc_address(names[i], &fn, 12090, flagsets[f], &st));
            assert_ptr_equal(fn, plain[i]);
            OK(sim_get_proc_address(names[i], &v13, 13000, flagsets[f], &st));
            assert_int_equal(st, CU_GET_PROC_ADDRESS_SUCCESS);
            assert_non_null(v13);
            assert_ptr_not_equal(v13, plain[i]);
            OK(sim_get_proc_address(names[i], &fn2, 13010, flagsets[f], &st));
            assert_ptr_equal(fn2, v13);
            OK(sim_get_proc_address(names[i], &fn2, 14000, flagsets[f], &st));
            assert_ptr_equal(fn2, v13);
            /* Below the plain ABI's 2000: nothing (the sim's floor). */
            st = CU_GET_PROC_ADDRESS_SUCCESS;
            RC(CUDA_ERROR_NOT_FOUND, sim_get_proc_address(names[i], &fn, 1000, flagsets[f], &st));
            assert_null(fn);
            assert_int_equal(st, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
        }
    }
    /* The two resolve to two different functions; the _v2 names are not symbols of
     * cuGetProcAddress (it takes base names). */
    void *gd = NULL, *sy = NULL, *fn = (void *)1;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SUCCESS;
    OK(sim_get_proc_address("cuCtxGetDevice", &gd, 13000, 0, &st));
    OK(sim_get_proc_address("cuCtxSynchronize", &sy, 13000, 0, &st));
    assert_ptr_not_equal(gd, sy);
    RC(CUDA_ERROR_NOT_FOUND, sim_get_proc_address("cuCtxGetDevice_v2", &fn, 13000, 0, &st));
    assert_null(fn);
    assert_int_equal(st, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    fn = (void *)1;
    RC(CUDA_ERROR_NOT_FOUND, sim_get_proc_address("cuCtxSynchronize_v2", &fn, 13000, 0, &st));
    assert_null(fn);
    /* An entry without a newer ABI is unchanged at 13000. */
    OK(sim_get_proc_address("cuCtxGetCurrent", &fn, 13000, 0, &st));
    assert_ptr_equal(fn, (void *)D->cuCtxGetCurrent);
    LEDGER_EMPTY();
}

/* tests/gpu/two_ctx on the H200: cuGetProcAddress("cuCtxCreate", 12000) answers _v3 (the
 * execution-affinity form), and a caller of the 3-argument ABI passes (NULL, 0) and whatever its
 * registers hold as flags and device: the 580 driver answered CUDA_ERROR_INVALID_VALUE. The sim
 * answers by version too, rejects leftover flags and devices, and makes a regular context only
 * through the forms that take no affinity (_v2, and _v4 with zeroed or no parameters). */
static void test_ctx_create_abi_by_version(void **state)
{
    (void)state; /* setup: device 0 */
    void *v3 = NULL, *v4 = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    OK(sim_get_proc_address("cuCtxCreate", &v3, 12000, 0, &st));
    OK(sim_get_proc_address("cuCtxCreate", &v4, 13000, 0, &st));
    assert_int_equal(st, CU_GET_PROC_ADDRESS_SUCCESS);
    assert_ptr_not_equal(v3, v4);
    assert_ptr_equal(v4, (void *)D->cuCtxCreate);
    size_t live = sim_live_contexts();
    CUcontext c = NULL;
    /* The 3-argument call on _v3: a pointer's low bits as flags, a large device. */
    RC(CUDA_ERROR_INVALID_VALUE, ((PFN_cuCtxCreate_v11040)v3)(&c, NULL, 0, 0x12345678u, 0));
    RC(CUDA_ERROR_INVALID_DEVICE, ((PFN_cuCtxCreate_v11040)v3)(&c, NULL, 0, 0, 0x7ffd1234));
    assert_null(c);
    assert_int_equal(sim_live_contexts(), live);

    /* _v4 (cuda.h's cuCtxCreate since CUDA 13): parameters that contradict the documented
     * rules are invalid; zeroed parameters or none make a regular context, made current. */
    CUctxCreateParams params;
    memset(&params, 0, sizeof params);
    params.numExecAffinityParams = 1; /* with no array */
    RC(CUDA_ERROR_INVALID_VALUE, ((PFN_cuCtxCreate_v12050)v4)(&c, &params, 0, 0));
    params.numExecAffinityParams = -1;
    RC(CUDA_ERROR_INVALID_VALUE, ((PFN_cuCtxCreate_v12050)v4)(&c, &params, 0, 0));
    assert_null(c);
    assert_int_equal(sim_live_contexts(), live);
    memset(&params, 0, sizeof params);
    OK(((PFN_cuCtxCreate_v12050)v4)(&c, &params, 0, 0));
    assert_non_null(c);
    assert_int_equal(sim_live_contexts(), live + 1);
    CUcontext cur = NULL;
    OK(D->cuCtxGetCurrent(&cur));
    assert_ptr_equal(cur, c);
    OK(D->cuCtxDestroy(c));
    assert_int_equal(sim_live_contexts(), live);
    LEDGER_EMPTY();
}

static void test_ctx_v2(void **state)
{
    (void)state; /* setup_two: device 0 current */
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    OK(sim_get_proc_address("cuCtxGetDevice", &fn, 13000, 0, &st));
    PFN_cuCtxGetDevice_v13000 get_device = (PFN_cuCtxGetDevice_v13000)fn;
    OK(sim_get_proc_address("cuCtxSynchronize", &fn, 13000, 0, &st));
    PFN_cuCtxSynchronize_v13000 synchronize = (PFN_cuCtxSynchronize_v13000)fn;
    CUcontext c0 = NULL, c1 = NULL;
    OK(D->cuDevicePrimaryCtxRetain(&c0, 0));
    OK(D->cuDevicePrimaryCtxRetain(&c1, 1));
    sim_reset_counters();

    /* NULL: the current context; a context: that one, whatever is current. */
    CUdevice dev = -1;
    OK(get_device(&dev, NULL));
    assert_int_equal(dev, 0);
    OK(get_device(&dev, c1));
    assert_int_equal(dev, 1);
    OK(get_device(&dev, c0));
    assert_int_equal(dev, 0);
    assert_int_equal(sim_current_device(), 0);
    RC(CUDA_ERROR_INVALID_VALUE, get_device(NULL, NULL));
    /* Not NULL and not a context (what a caller of the one-argument ABI leaves in the register):
     * rejected, nothing written. */
    int junk[4] = {0};
    static const uintptr_t garbage[] = {1, 0x1234, 0x7ffd12345678ULL, (uintptr_t)-1};
    for (size_t i = 0; i < 4; i++) {
        dev = -5;
        RC(CUDA_ERROR_INVALID_CONTEXT, get_device(&dev, (CUcontext)garbage[i]));
        assert_int_equal(dev, -5);
        RC(CUDA_ERROR_INVALID_CONTEXT, synchronize((CUcontext)garbage[i]));
    }
    RC(CUDA_ERROR_INVALID_CONTEXT, get_device(&dev, (CUcontext)(void *)junk));
    RC(CUDA_ERROR_INVALID_CONTEXT, synchronize((CUcontext)(void *)&dev)); /* a stack address */
    RC(CUDA_ERROR_INVALID_CONTEXT, synchronize((CUcontext)((char *)c0 + 1))); /* inside one */

    /* cuCtxSynchronize_v2 runs queued copies; a rejected call does not. */
    CUdeviceptr x = 0, y = 0;
    OK(D->cuMemAlloc(&x, 4096));
    OK(D->cuMemAlloc(&y, 4096));
    OK(sim_memset(x, 9, 4096));
    OK(D->cuMemcpyDtoDAsync(y, x, 4096, NULL));
    assert_int_equal(sim_pending_ops(), 1);
    RC(CUDA_ERROR_INVALID_CONTEXT, synchronize((CUcontext)0x1234));
    assert_int_equal(sim_pending_ops(), 1);
    OK(synchronize(NULL));
    assert_int_equal(sim_pending_ops(), 0);
    unsigned char b = 0;
    OK(sim_read(&b, y + 4095, 1));
    assert_int_equal(b, 9);

    /* Without a current context: NULL is rejected, an explicit context works. */
    sim_set_current_device(-1);
    RC(CUDA_ERROR_INVALID_CONTEXT, get_device(&dev, NULL));
    RC(CUDA_ERROR_INVALID_CONTEXT, synchronize(NULL));
    RC(CUDA_ERROR_INVALID_CONTEXT, D->cuCtxSynchronize());
    dev = -1;
    OK(get_device(&dev, c1));
    assert_int_equal(dev, 1);
    OK(synchronize(c1));
    sim_set_current_device(0);

    /* Counted under their own names, apart from the plain ones; fault-injectable; traced. */
    assert_int_equal(sim_calls("cuCtxGetDevice"), 0);
    assert_int_equal(sim_calls("cuCtxGetDevice_v2"), 11);
    assert_int_equal(sim_calls("cuCtxSynchronize"), 1);
    assert_int_equal(sim_calls("cuCtxSynchronize_v2"), 10);
    sim_fail_function("cuCtxSynchronize_v2", 1, CUDA_ERROR_LAUNCH_FAILED);
    OK(D->cuCtxSynchronize()); /* the plain one is another entry point */
    RC(CUDA_ERROR_LAUNCH_FAILED, synchronize(NULL));
    OK(synchronize(NULL));
    sim_fail_function("cuCtxGetDevice_v2", 1, CUDA_ERROR_UNKNOWN);
    dev = -3;
    RC(CUDA_ERROR_UNKNOWN, get_device(&dev, NULL));
    assert_int_equal(dev, -3); /* an injected failure writes nothing */
    assert_int_equal(sim_faults_fired(), 2);
    sim_trace_begin();
    OK(get_device(&dev, NULL));
    OK(synchronize(c0));
    const char *tn[4] = {0};
    assert_int_equal(sim_trace_get(tn, 4), 2);
    assert_string_equal(tn[0], "cuCtxGetDevice_v2");
    assert_string_equal(tn[1], "cuCtxSynchronize_v2");
    sim_trace_end();
    OK(D->cuMemFree(x));
    OK(D->cuMemFree(y));
    LEDGER_EMPTY();
}

/* Threads hammering the driver; the ledger ends empty. */
static void *churn(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    sim_set_current_device(0);
    for (int i = 0; i < 300; i++) {
        size_t n = 1 + rand_r(&seed) % 4;
        CUmemGenericAllocationHandle h;
        CUmemAllocationProp p = prop_dev(0, 0);
        if (D->cuMemCreate(&h, n * G2, &p, 0))
            return (void *)1;
        CUdeviceptr r;
        if (D->cuMemAddressReserve(&r, 2 * n * G2, 0, 0, 0))
            return (void *)2;
        if (D->cuMemMap(r, n * G2, 0, h, 0) || D->cuMemRelease(h))
            return (void *)3;
        CUmemAccessDesc a = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        if (D->cuMemSetAccess(r, n * G2, &a, 1))
            return (void *)4;
        unsigned v = seed, w = 0;
        if (sim_write(r + 8, &v, sizeof v) || sim_read(&w, r + 8, sizeof w) || v != w)
            return (void *)5;
        CUdeviceptr d;
        if (D->cuMemAlloc(&d, 1 + rand_r(&seed) % 100000) || D->cuMemFree(d))
            return (void *)6;
        if (D->cuMemUnmap(r, n * G2) || D->cuMemAddressFree(r, 2 * n * G2))
            return (void *)7;
    }
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    pthread_t t[8];
    for (int i = 0; i < 8; i++)
        assert_int_equal(pthread_create(&t[i], NULL, churn, (void *)(uintptr_t)(i + 1)), 0);
    for (int i = 0; i < 8; i++) {
        void *ret = (void *)99;
        pthread_join(t[i], &ret);
        assert_null(ret);
    }
    assert_int_equal(sim_device_used(0), 0);
    LEDGER_EMPTY();
}

/* Measured on the H200: a failed cuMemAlloc writes 0 to the pointer. */
static void test_failed_native_alloc_writes_zero(void **state)
{
    (void)state;
    sim_reset(NULL);
    CUdeviceptr p = 0x1234;
    assert_int_equal(sim_table()->cuMemAlloc(&p, (size_t)1 << 50), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(p, 0);
    assert_true(sim_ledger_empty());
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_not_initialized),
        cmocka_unit_test_setup(test_table_complete, setup),
        cmocka_unit_test_setup(test_contexts, setup),
        cmocka_unit_test_setup(test_per_thread_contexts, setup_two),
        cmocka_unit_test_setup(test_granularity, setup),
        cmocka_unit_test_setup(test_create_rules, setup),
        cmocka_unit_test_setup(test_out_of_memory, setup_small),
        cmocka_unit_test_setup(test_reserve_rules, setup),
        cmocka_unit_test_setup(test_va_exhaustion, setup_small),
        cmocka_unit_test_setup(test_map_rules, setup),
        cmocka_unit_test_setup(test_access_rules, setup),
        cmocka_unit_test_setup(test_release_refcount, setup),
        cmocka_unit_test_setup(test_export_import, setup),
        cmocka_unit_test_setup(test_aliased_contents, setup),
        cmocka_unit_test_setup(test_async_copy_hazard, setup),
        cmocka_unit_test_setup(test_native_rules, setup),
        cmocka_unit_test_setup(test_pointer_queries, setup),
        cmocka_unit_test_setup(test_two_devices, setup_two),
        cmocka_unit_test_setup(test_fault_injection, setup),
        cmocka_unit_test_setup(test_get_proc_address, setup),
        cmocka_unit_test_setup(test_get_proc_address_ctx_v2, setup),
        cmocka_unit_test_setup(test_ctx_v2, setup_two),
        cmocka_unit_test_setup(test_ctx_create_abi_by_version, setup),
        cmocka_unit_test_setup(test_threads, setup),
        cmocka_unit_test(test_failed_native_alloc_writes_zero),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
