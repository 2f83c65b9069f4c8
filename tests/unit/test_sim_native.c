/* The simulated driver's own tests of native allocations (cuMemAlloc and its kin): their rules,
 * pointer queries, two devices, and a failed cuMemAlloc writing 0 as the H200's driver does. */
#include "sim_fixture.h"

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
        cmocka_unit_test_setup(test_native_rules, setup),
        cmocka_unit_test_setup(test_pointer_queries, setup),
        cmocka_unit_test_setup(test_two_devices, setup_two),
        cmocka_unit_test(test_failed_native_alloc_writes_zero),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
