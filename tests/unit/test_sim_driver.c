/* The simulated driver's own tests, the driver as a whole: calls before initialization, the
 * table, contexts (also per thread, their _v2 calls, and cuCtxCreate's ABIs by version),
 * cuGetProcAddress, fault injection, and threads hammering it with the ledger ending empty.
 * Every strictness rule is checked for its code and for the rejected call changing nothing. */
#include "sim_fixture.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_not_initialized),
        cmocka_unit_test_setup(test_table_complete, setup),
        cmocka_unit_test_setup(test_contexts, setup),
        cmocka_unit_test_setup(test_per_thread_contexts, setup_two),
        cmocka_unit_test_setup(test_fault_injection, setup),
        cmocka_unit_test_setup(test_get_proc_address, setup),
        cmocka_unit_test_setup(test_get_proc_address_ctx_v2, setup),
        cmocka_unit_test_setup(test_ctx_v2, setup_two),
        cmocka_unit_test_setup(test_ctx_create_abi_by_version, setup),
        cmocka_unit_test_setup(test_threads, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
