/* The simulated driver's own tests of the VMM calls: granularity, the rules of create, reserve,
 * map and access (the code, and that the rejected call changed nothing), out of memory and of
 * address space, reference counting, export and import, aliased contents, and the hazard of an
 * asynchronous copy. */
#include "sim_fixture.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
