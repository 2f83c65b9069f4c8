/* Layer 7 on the simulated driver: vmm_realloc and friends, every status code of
 * include/vmmhook.h, and the PyTorch pluggable-allocator entry points. */
#include "testutil.h"

#include "vmmhook.h"

static int setup(void **state)
{
    (void)state;
    tu_reset(NULL);
    assert_true(vmh_lifetime_ready()); /* reads the options once; the test's values come after */
    vmh_options_defaults(&vmh_opt);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    vmm_trim();
    tu_assert_ledger_empty();
    return 0;
}

static void realloc_lifecycle(void **state)
{
    (void)state;
    void *p = NULL;
    assert_int_equal(vmm_realloc(&p, 3 * MiB), VMM_OK);
    assert_non_null(p);
    assert_true(vmm_owns(p));
    assert_true(vmm_owns((char *)p + 3 * MiB - 1));
    assert_false(vmm_owns((char *)p + 3 * MiB));
    assert_int_equal(vmm_usable_size(p), 4 * MiB);
    assert_int_equal(vmm_usable_size((char *)p + 1), 0);
    tu_fill((CUdeviceptr)(uintptr_t)p, 3 * MiB, 1);
    assert_int_equal(vmm_realloc(&p, 100 * MiB), VMM_OK);
    assert_true(tu_check((CUdeviceptr)(uintptr_t)p, 3 * MiB, 1));
    assert_int_equal(vmm_realloc(&p, 0), VMM_OK);
    assert_null(p);
    assert_int_equal(vmm_realloc(&p, 0), VMM_OK); /* NULL and 0: nothing */
    assert_null(p);
}

static void status_codes(void **state)
{
    (void)state;
    void *p = NULL;
    assert_int_equal(vmm_realloc(NULL, 10), VMM_ERR_INVALID);
    assert_int_equal(vmm_realloc(&p, SIZE_MAX), VMM_ERR_SIZE);
    assert_null(p);
    void *foreign = (void *)0x7000;
    assert_int_equal(vmm_realloc(&foreign, 10), VMM_ERR_FOREIGN);
    assert_ptr_equal(foreign, (void *)0x7000);
    assert_int_equal(vmm_realloc(&p, 4 * MiB), VMM_OK);
    void *inner = (char *)p + 512;
    assert_int_equal(vmm_realloc(&inner, 8 * MiB), VMM_ERR_INTERIOR);
    assert_int_equal(vmm_realloc(&p, 200 * GiB), VMM_ERR_NO_MEMORY); /* 80 GiB device */
    vmh_opt.va_limit = 8 * MiB;
    vmh_opt.headroom = 0;
    sim_refuse_hints(true);
    assert_int_equal(vmm_realloc(&p, 16 * MiB), VMM_ERR_NO_ADDRESS);
    sim_refuse_hints(false);
    sim_fail_function("cuMemCreate", 1, CUDA_ERROR_ECC_UNCORRECTABLE);
    assert_int_equal(vmm_realloc(&p, 6 * MiB), VMM_ERR_DRIVER);
    assert_int_equal(vmm_last_driver_error(), CUDA_ERROR_ECC_UNCORRECTABLE);
    sim_clear_faults();
    assert_int_equal(vmm_realloc(&p, 0), VMM_OK);
    sim_set_current_device(-1);
    assert_int_equal(vmm_realloc(&p, 10), VMM_ERR_NO_DRIVER);
    sim_set_current_device(0);
    for (int s = 0; s <= VMM_STATUS_COUNT; s++)
        assert_non_null(vmm_status_string((vmm_status)s));
    assert_int_equal(vmm_version(), VMM_VERSION);
}

static void torch_entry_points(void **state)
{
    (void)state;
    void *p = vmm_torch_alloc(5 * MiB, 0, NULL);
    assert_non_null(p);
    assert_true(vmm_owns(p));
    assert_null(vmm_torch_alloc(0, 0, NULL));
    vmm_torch_free(p, 5 * MiB, 0, NULL);
    assert_false(vmm_owns(p));
    vmm_torch_free(NULL, 0, 0, NULL);
}

static void detection_helpers(void **state)
{
    (void)state;
    /* The test binary links the library's layers statically, so the exported name is found. */
    assert_true(vmm_hook_available() == (vmm_fn("vmm_realloc") != NULL));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(realloc_lifecycle, setup, teardown),
        cmocka_unit_test_setup_teardown(status_codes, setup, teardown),
        cmocka_unit_test_setup_teardown(torch_entry_points, setup, teardown),
        cmocka_unit_test_setup_teardown(detection_helpers, setup, teardown),
    };
    return cmocka_run_group_tests_name("api", tests, NULL, NULL);
}
