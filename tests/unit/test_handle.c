/* Layer "handles": the three refcounted VMM handles (handle.h), on the simulated driver: argument
 * refusals that reach no driver call, reference counting, a mapping's references on its
 * allocation and reservation (unmap always before release and free), access descriptors that
 * travel with the chunk, and failures that unwind to nothing held. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "driver.h"
#include "handle.h"
#include "simdrv.h"

#define GRAN ((size_t)2 << 20)

static int setup(void **state)
{
    (void)state;
    sim_config_t c = {.devices = 2, .memory = 64 * GRAN};
    sim_reset(&c);
    vmh_driver_install(sim_table());
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    if (!sim_ledger_empty())
        sim_ledger_dump();
    assert_true(sim_ledger_empty());
    return 0;
}

static CUmemAllocationProp prop(int device)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    return p;
}

static CUmemAccessDesc acc_desc(int device, CUmemAccess_flags flags)
{
    CUmemAccessDesc d;
    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = device;
    d.flags = flags;
    return d;
}

static vmh_alloc_t *chunk(size_t size, const CUmemAccessDesc *acc, int nacc)
{
    CUmemAllocationProp p = prop(0);
    vmh_alloc_t *a = NULL;
    assert_int_equal(vmh_alloc_create(NULL, size, &p, acc, nacc, &a), CUDA_SUCCESS);
    assert_non_null(a);
    return a;
}

static vmh_resv_t *resv(size_t size)
{
    vmh_resv_t *r = NULL;
    assert_int_equal(vmh_resv_create(size, 0, 0, &r), CUDA_SUCCESS);
    assert_non_null(r);
    return r;
}

static void alloc_refusals_make_no_call(void **state)
{
    (void)state;
    CUmemAllocationProp p = prop(0);
    CUmemAccessDesc d[VMH_MAX_ACCESS + 1];
    for (int i = 0; i <= VMH_MAX_ACCESS; i++)
        d[i] = acc_desc(0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    vmh_alloc_t *a = NULL;
    unsigned long calls = sim_call_count();
    assert_int_equal(vmh_alloc_create(NULL, GRAN, &p, d, 1, NULL), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_alloc_create(NULL, GRAN, NULL, d, 1, &a), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_alloc_create(NULL, GRAN, &p, d, -1, &a), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_alloc_create(NULL, GRAN, &p, d, VMH_MAX_ACCESS + 1, &a),
                     CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_alloc_create(NULL, GRAN, &p, NULL, 1, &a), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_resv_create(GRAN, 0, 0, NULL), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_map_create(0, NULL, NULL, NULL), CUDA_ERROR_INVALID_VALUE);
    assert_null(a);
    assert_int_equal(sim_call_count(), calls);
    /* The driver's own refusal comes back as is, with nothing held. */
    assert_int_equal(vmh_alloc_create(NULL, GRAN + 4096, &p, d, 1, &a), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_alloc_create(NULL, 128 * GRAN, &p, d, 1, &a), CUDA_ERROR_OUT_OF_MEMORY);
    assert_null(a);
    /* The unrefs take NULL. */
    vmh_alloc_unref(NULL);
    vmh_resv_unref(NULL);
    vmh_map_unref(NULL);
}

static void alloc_keeps_what_it_was_made_with(void **state)
{
    (void)state;
    CUmemAllocationProp p = prop(1);
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemAccessDesc d[2] = {acc_desc(1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
                            acc_desc(0, CU_MEM_ACCESS_FLAGS_PROT_READ)};
    vmh_alloc_t *a = NULL;
    assert_int_equal(vmh_alloc_create(NULL, 2 * GRAN, &p, d, 2, &a), CUDA_SUCCESS);
    assert_int_equal(a->size, 2 * GRAN);
    assert_int_equal(a->device, 1);
    assert_int_equal(a->handle_type, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    assert_int_equal(a->naccess, 2);
    assert_memory_equal(a->access, d, sizeof d);
    assert_int_equal(sim_device_used(1), 2 * GRAN);
    vmh_alloc_unref(a);
    assert_int_equal(sim_device_used(1), 0);
}

static void references_count(void **state)
{
    (void)state;
    vmh_alloc_t *a = chunk(GRAN, NULL, 0);
    vmh_resv_t *r = resv(4 * GRAN);
    assert_ptr_equal(vmh_alloc_ref(a), a);
    assert_ptr_equal(vmh_resv_ref(r), r);
    vmh_alloc_unref(a);
    vmh_resv_unref(r);
    assert_int_equal(sim_live_handles(), 1); /* one reference each is left */
    assert_int_equal(sim_live_reservations(), 1);
    assert_int_equal(sim_calls("cuMemRelease"), 0);
    vmh_alloc_unref(a);
    assert_int_equal(sim_live_handles(), 0);
    vmh_resv_unref(r);
    assert_int_equal(sim_live_reservations(), 0);
    assert_int_equal(sim_calls("cuMemRelease"), 1);
    assert_int_equal(sim_calls("cuMemAddressFree"), 1);
}

static void mapping_holds_its_parts(void **state)
{
    (void)state;
    CUmemAccessDesc d = acc_desc(0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    vmh_alloc_t *a = chunk(GRAN, &d, 1), *b = chunk(GRAN, NULL, 0);
    vmh_resv_t *r = resv(4 * GRAN);
    vmh_map_t *m = NULL, *n = NULL;
    assert_int_equal(vmh_map_create(r->ptr + GRAN, a, r, &m), CUDA_SUCCESS);
    assert_int_equal(m->ptr, r->ptr + GRAN);
    assert_int_equal(m->size, GRAN);
    assert_ptr_equal(m->alloc, a);
    assert_ptr_equal(m->resv, r);
    /* The chunk's descriptors are applied to the new mapping; none, no cuMemSetAccess. */
    assert_int_equal(sim_access_flags(m->ptr, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    unsigned long set_access = sim_calls("cuMemSetAccess");
    assert_int_equal(vmh_map_create(r->ptr + 3 * GRAN, b, r, &n), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemSetAccess"), set_access);
    assert_int_equal(sim_access_flags(n->ptr, 0), 0);
    assert_ptr_equal(vmh_map_ref(m), m);
    vmh_map_unref(m);
    /* The caller lets go of its references: the mappings keep everything alive. */
    vmh_alloc_unref(a);
    vmh_alloc_unref(b);
    vmh_resv_unref(r);
    assert_int_equal(sim_live_handles(), 2);
    assert_int_equal(sim_live_reservations(), 1);
    assert_true(sim_is_mapped(m->ptr));
    /* The last mapping's unref unmaps, then releases, then frees the reservation. */
    vmh_map_unref(m);
    assert_int_equal(sim_live_handles(), 1);
    assert_int_equal(sim_live_reservations(), 1); /* n still maps into it */
    sim_trace_begin();
    vmh_map_unref(n);
    const char *names[8] = {0};
    assert_int_equal(sim_trace_get(names, 8), 3);
    sim_trace_end();
    assert_string_equal(names[0], "cuMemUnmap");
    assert_string_equal(names[1], "cuMemRelease");
    assert_string_equal(names[2], "cuMemAddressFree");
}

static void mapping_must_lie_inside(void **state)
{
    (void)state;
    vmh_alloc_t *a = chunk(2 * GRAN, NULL, 0);
    vmh_resv_t *r = resv(3 * GRAN), *small = resv(GRAN);
    vmh_map_t *m = NULL;
    unsigned long maps = sim_calls("cuMemMap");
    assert_int_equal(vmh_map_create(r->ptr - GRAN, a, r, &m), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_map_create(r->ptr + 2 * GRAN, a, r, &m), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_map_create(small->ptr, a, small, &m), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_map_create(r->ptr, a, NULL, &m), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(sim_calls("cuMemMap"), maps);
    assert_null(m);
    assert_int_equal(vmh_map_create(r->ptr + GRAN, a, r, &m), CUDA_SUCCESS); /* the end fits */
    vmh_map_unref(m);
    vmh_alloc_unref(a);
    vmh_resv_unref(r);
    vmh_resv_unref(small);
}

static void failures_unwind(void **state)
{
    (void)state;
    CUmemAllocationProp p = prop(0);
    vmh_alloc_t *a = NULL;
    sim_fail_function("cuMemCreate", 1, CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_alloc_create(NULL, GRAN, &p, NULL, 0, &a), CUDA_ERROR_OUT_OF_MEMORY);
    assert_null(a);
    vmh_resv_t *r = NULL;
    sim_fail_function("cuMemAddressReserve", 1, CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_resv_create(GRAN, 0, 0, &r), CUDA_ERROR_OUT_OF_MEMORY);
    assert_null(r);

    /* A failed map or a failed access leaves no mapping and takes no reference. */
    CUmemAccessDesc d = acc_desc(0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    a = chunk(GRAN, &d, 1);
    r = resv(GRAN);
    vmh_map_t *m = NULL;
    sim_fail_function("cuMemMap", 1, CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_map_create(r->ptr, a, r, &m), CUDA_ERROR_OUT_OF_MEMORY);
    sim_fail_function("cuMemSetAccess", 1, CUDA_ERROR_INVALID_DEVICE);
    assert_int_equal(vmh_map_create(r->ptr, a, r, &m), CUDA_ERROR_INVALID_DEVICE);
    assert_null(m);
    assert_int_equal(sim_live_mappings(), 0);
    assert_int_equal(atomic_load(&a->refs), 1);
    assert_int_equal(atomic_load(&r->refs), 1);
    assert_int_equal(sim_faults_fired(), 4);
    vmh_alloc_unref(a);
    vmh_resv_unref(r);
}

static void failed_undo_leaves_the_object(void **state)
{
    (void)state;
    vmh_alloc_t *a = chunk(GRAN, NULL, 0);
    sim_fail_function("cuMemRelease", 1, CUDA_ERROR_UNKNOWN);
    vmh_alloc_unref(a); /* reported; the driver object stays (a visible leak, not a crash) */
    assert_int_equal(sim_live_handles(), 1);
    assert_int_equal(sim_faults_fired(), 1);
    sim_reset(NULL); /* the test's own cleanup of what was left behind on purpose */
    vmh_driver_install(sim_table());
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(alloc_refusals_make_no_call, setup, teardown),
        cmocka_unit_test_setup_teardown(alloc_keeps_what_it_was_made_with, setup, teardown),
        cmocka_unit_test_setup_teardown(references_count, setup, teardown),
        cmocka_unit_test_setup_teardown(mapping_holds_its_parts, setup, teardown),
        cmocka_unit_test_setup_teardown(mapping_must_lie_inside, setup, teardown),
        cmocka_unit_test_setup_teardown(failures_unwind, setup, teardown),
        cmocka_unit_test_setup_teardown(failed_undo_leaves_the_object, setup, teardown),
    };
    return cmocka_run_group_tests_name("handle", tests, NULL, NULL);
}
