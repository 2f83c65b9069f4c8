/* The heap on several simulated devices: where allocations land, devices without a context,
 * peer access granted up front, to existing and new buffers and while a buffer is being made,
 * refused handle types, and exports (what an importer holds stays its own). Each test ends with
 * everything freed, the cache trimmed and the driver's ledger empty. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_heap_thread_shard, declared in heap.h */
#endif
#include "testutil.h"

#include "carved.h"

#include <cudaTypedefs.h>

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "vmmhook.h"

static void alloc_on_a_device_without_a_context(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    sim_set_current_device(-1); /* like PyTorch's autograd threads */
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc_on(1, 3 * MiB, &p), CUDA_SUCCESS);
    vmh_buffer_info_t info;
    assert_true(vmh_heap_find(p, &info));
    assert_int_equal(info.device, 1);
    assert_int_equal(vmh_heap_free(p, NULL, true), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc_on(1, 3 * MiB, &p), CUDA_SUCCESS); /* syncs device 1 */
    assert_int_equal(vmh_heap_free(p, NULL, true), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc_on(99, 10, &p), CUDA_ERROR_INVALID_DEVICE);
    sim_set_current_device(0);
}

/* ---- devices and threads ---- */

static void allocations_land_on_the_current_device(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    CUdeviceptr p0, p1, s1;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p0), CUDA_SUCCESS);
    sim_set_current_device(1);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p1), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(500, &s1), CUDA_SUCCESS);
    vmh_buffer_info_t info;
    assert_true(vmh_heap_find(p1, &info));
    assert_int_equal(info.device, 1);
    assert_true(vmh_heap_find(s1, &info));
    assert_int_equal(info.device, 1);
    assert_true(sim_device_used(1) >= 6 * MiB);
    assert_int_equal(sim_access_flags(p1, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    tu_fill(p1, 4 * MiB, 10);
    assert_true(tu_check(p1, 4 * MiB, 10));
    /* Freed from the other device's context. */
    sim_set_current_device(0);
    assert_int_equal(vmh_heap_free(p1, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(s1, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p0, NULL, false), CUDA_SUCCESS);
    assert_true(vmh_heap_trim() >= 8 * MiB);
}

static void peers_granted_up_front(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    tu_opt.peers = 0x3;
    tu_configure();
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(p, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void refused_handle_type_falls_back(void **state)
{
    (void)state;
    tu_opt.handle = VMH_HANDLE_FABRIC; /* the simulated driver answers 800, as the H200 did */
    tu_configure();
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
    tu_fill(p, 4 * MiB, 12);
    assert_true(tu_check(p, 4 * MiB, 12));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* What an importer does with an export: maps its chunks in an address range of its own (the
 * export's references stand for the importer's handles). Returns the buffer's address there. */
static CUdeviceptr import_view(const vmh_export_t *ex, CUdeviceptr *va, size_t *len)
{
    *len = 0;
    for (size_t i = 0; i < ex->nchunks; i++)
        *len += ex->chunks[i]->size;
    assert_int_equal(vmh_drv.cuMemAddressReserve(va, *len, 0, 0, 0), CUDA_SUCCESS);
    size_t at = 0;
    for (size_t i = 0; i < ex->nchunks; i++) {
        assert_int_equal(vmh_drv.cuMemMap(*va + at, ex->chunks[i]->size, 0,
                                          ex->chunks[i]->handle, 0),
                         CUDA_SUCCESS);
        at += ex->chunks[i]->size;
    }
    CUmemAccessDesc rw = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    assert_int_equal(vmh_drv.cuMemSetAccess(*va, *len, &rw, 1), CUDA_SUCCESS);
    return *va + ex->offset;
}

static void import_view_close(CUdeviceptr va, size_t len)
{
    assert_int_equal(vmh_drv.cuMemUnmap(va, len), CUDA_SUCCESS);
    assert_int_equal(vmh_drv.cuMemAddressFree(va, len), CUDA_SUCCESS);
}

/* Whether [p, p + n) overlaps [base, base + len). */
static bool overlaps(CUdeviceptr p, size_t n, CUdeviceptr base, size_t len)
{
    return p < base + len && base < p + n;
}

/* The export's serial: one per life of a buffer; a free kills it. */
static void export_serial_dies_with_the_free(void **state)
{
    (void)state;
    CUdeviceptr big, small;
    assert_int_equal(vmh_heap_alloc(6 * MiB, &big), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(3000, &small), CUDA_SUCCESS);
    vmh_export_t ex, ex2, exs;
    assert_int_equal(vmh_heap_export(big + 100, &ex), CUDA_SUCCESS);
    assert_int_equal(ex.base, big);
    assert_int_equal(ex.size, 6 * MiB);
    assert_int_equal(ex.offset, 0);
    assert_int_equal(ex.nchunks, 1);
    assert_int_not_equal(ex.serial, 0);
    assert_int_equal(vmh_heap_export(big, &ex2), CUDA_SUCCESS);
    assert_int_equal(ex2.serial, ex.serial); /* one life, one serial */
    vmh_heap_export_release(&ex2);
    assert_int_equal(vmh_heap_export(small, &exs), CUDA_SUCCESS);
    assert_int_equal(exs.size, 3000);
    assert_true(exs.offset < 2 * MiB);
    assert_int_not_equal(exs.serial, ex.serial);
    assert_int_equal(vmh_heap_export(0x1000, &ex2), CUDA_ERROR_NOT_FOUND);
    assert_true(vmh_heap_export_alive(big, ex.serial));
    assert_true(vmh_heap_export_alive(small, exs.serial));
    assert_false(vmh_heap_export_alive(big, exs.serial));
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
    assert_false(vmh_heap_export_alive(big, ex.serial));
    assert_false(vmh_heap_export_alive(small, exs.serial));
    vmh_heap_export_release(&ex);
    vmh_heap_export_release(&exs);
}

/* As natively (tests/gpu/ipc_gpu.cu free_first on the H200): once the exporter frees an
 * exported buffer, its next allocations never land in that memory and the importer keeps
 * seeing its data; the library gives its own hold back after the reclaim wait, and the memory
 * lives exactly as long as the importer holds it. On 882660a the freed own-chunk buffer was cached
 * and served again at once (big2 == big), and the packed slot was reused. */
static void freed_export_memory_is_never_served_again(void **state)
{
    (void)state;
    CUdeviceptr big, small, pad;
    assert_int_equal(vmh_heap_alloc(6 * MiB, &big), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(1000, &pad), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(3000, &small), CUDA_SUCCESS);
    tu_fill(big, 6 * MiB, 21);
    tu_fill(small, 3000, 22);
    vmh_export_t ex, exs;
    assert_int_equal(vmh_heap_export(big, &ex), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_export(small, &exs), CUDA_SUCCESS);
    CUdeviceptr va, vas;
    size_t len, lens;
    CUdeviceptr view = import_view(&ex, &va, &len), views = import_view(&exs, &vas, &lens);
    const CUdeviceptr small_chunk = small - exs.offset;
    const size_t small_chunk_len = lens;
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
    /* The same sizes again, and more small ones than the freed slot's chunk holds. */
    CUdeviceptr big2, small2[40];
    assert_int_equal(vmh_heap_alloc(6 * MiB, &big2), CUDA_SUCCESS);
    assert_false(overlaps(big2, 6 * MiB, big, 6 * MiB));
    tu_fill(big2, 6 * MiB, 23);
    for (int i = 0; i < 40; i++) {
        assert_int_equal(vmh_heap_alloc(3000, &small2[i]), CUDA_SUCCESS);
        assert_false(overlaps(small2[i], 3000, small_chunk, small_chunk_len));
        tu_fill(small2[i], 3000, 24);
    }
    /* The free of the pad empties the retired extent: it goes after the wait. */
    assert_int_equal(vmh_heap_free(pad, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    assert_false(sim_is_mapped(big));
    assert_false(sim_is_mapped(small_chunk));
    /* The importer's view is intact. */
    assert_true(tu_check(view, 6 * MiB, 21));
    assert_true(tu_check(views, 3000, 22));
    /* The library holds nothing of it: closing the importer's side leaves only live buffers. */
    size_t allocs = sim_live_allocations();
    import_view_close(va, len);
    import_view_close(vas, lens);
    vmh_heap_export_release(&ex);
    vmh_heap_export_release(&exs);
    assert_int_equal(sim_live_allocations(), allocs - 2);
    assert_int_equal(vmh_heap_free(big2, NULL, false), CUDA_SUCCESS);
    for (int i = 0; i < 40; i++)
        assert_int_equal(vmh_heap_free(small2[i], NULL, false), CUDA_SUCCESS);
}

/* 200 rounds of export and free of packed buffers (each beside a live neighbour) leave the
 * library holding a small bound, and nothing once the neighbours go (on a928081 every exported
 * packed slot stayed parked for good: 832 MiB held after 200 rounds on the H200; on 882660a the
 * slot was served again while an importer could still map it). */
static void export_free_rounds_hold_nothing(void **state)
{
    (void)state;
    CUdeviceptr keep[200];
    for (int i = 0; i < 200; i++) {
        CUdeviceptr p;
        vmh_export_t ex;
        assert_int_equal(vmh_heap_alloc((size_t)64 << 10, &p), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_alloc(512, &keep[i]), CUDA_SUCCESS);
        assert_int_equal(vmh_heap_export(p, &ex), CUDA_SUCCESS);
        vmh_heap_export_release(&ex);
        assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
        if (i >= 2) /* the neighbour of two rounds ago goes: at most a few extents are held */
            assert_int_equal(vmh_heap_free(keep[i - 2], NULL, false), CUDA_SUCCESS);
    }
    /* The extents of the last rounds (2 MiB each: a retire starts small ones again). */
    assert_true(sim_device_used(0) <= 8 * MiB);
    vmh_heap_trim();
    assert_true(sim_device_used(0) <= 4 * MiB);
    assert_int_equal(vmh_heap_free(keep[198], NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(keep[199], NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    assert_int_equal(sim_device_used(0), 0);
}

static void peer_access_reaches_existing_and_new_buffers(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    CUdeviceptr a, s, b;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(100, &s), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(a, 1), 0);
    assert_int_equal(vmh_heap_set_peer_access(0, 1, true), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(a, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(s, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(vmh_heap_alloc(8 * MiB, &b), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(b, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    /* A grow that moves keeps the peer's access on every chunk. */
    tu_opt.headroom = 0;
    tu_configure();
    sim_refuse_hints(true);
    assert_int_equal(vmh_heap_realloc(&b, 20 * MiB, NULL, false), CUDA_SUCCESS);
    sim_refuse_hints(false);
    assert_int_equal(sim_access_flags(b, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(b + 19 * MiB, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(vmh_heap_set_peer_access(0, 1, false), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(a, 1), 0);
    assert_int_equal(sim_access_flags(b, 1), 0);
    assert_int_equal(vmh_heap_set_peer_access(0, 0, true), CUDA_ERROR_INVALID_DEVICE);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(s, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
}

/* ---- the per-GPU record before the device's first allocation (issue 31) ---- */

/* A grant made before the owner's first allocation (most programs enable peer access first) is
 * kept in the owner's record and reaches the buffers its heap makes later, once it is set up; a
 * grant of another owner does not. */
static void peer_grant_before_the_first_allocation_reaches_it(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 3};
    tu_reset(&cfg);
    assert_int_equal(vmh_heap_set_peer_access(0, 1, true), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_set_peer_access(1, 2, true), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_set_peer_access(VMH_MAX_DEVICES, 1, true),
                     CUDA_ERROR_INVALID_DEVICE);
    CUdeviceptr a, s;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(100, &s), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(a, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(s, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(a, 2), 0);
    assert_int_equal(sim_access_flags(s, 2), 0);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(s, NULL, false), CUDA_SUCCESS);
}

/* The program's primary context, as the interposer reports it retained, is kept in the device's
 * record from before its heap is set up to after; a device never mentioned has none. */
static void primary_context_kept_across_the_heap_setup(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    CUcontext primary = NULL;
    assert_int_equal(sim_table()->cuDevicePrimaryCtxRetain(&primary, 0), CUDA_SUCCESS);
    assert_null(vmh_heap_primary(0));
    vmh_heap_primary_retained(0, primary);
    vmh_heap_primary_retained(VMH_MAX_DEVICES, primary); /* past the table: dropped */
    assert_ptr_equal(vmh_heap_primary(0), primary);
    assert_null(vmh_heap_primary(1));
    assert_null(vmh_heap_primary(VMH_MAX_DEVICES));
    CUdeviceptr a;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &a), CUDA_SUCCESS);
    assert_ptr_equal(vmh_heap_primary(0), primary);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(sim_table()->cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);
}

/* ---- peer access while a buffer is being made (issue 16) ---- */

static CUresult (*real_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                            unsigned long long);
static atomic_int grant_on_next_map;
static atomic_bool grant_done;
static CUresult grant_rc;
static pthread_t grant_thread;

static void *grant_peer(void *arg)
{
    (void)arg;
    grant_rc = vmh_heap_set_peer_access(0, 1, true);
    atomic_store(&grant_done, true);
    return NULL;
}

/* cuMemMap, then (once) a peer grant from another thread, given up to 200 ms to finish before
 * the mapping's cuMemSetAccess: the grant runs while the new buffer is half made. */
static CUresult map_then_grant(CUdeviceptr ptr, size_t size, size_t offset,
                               CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    CUresult rc = real_map(ptr, size, offset, handle, flags);
    if (atomic_exchange(&grant_on_next_map, 0)) {
        assert_int_equal(pthread_create(&grant_thread, NULL, grant_peer, NULL), 0);
        for (int i = 0; i < 200 && !atomic_load(&grant_done); i++)
            usleep(1000);
    }
    return rc;
}

static void peer_grant_during_a_new_buffer_reaches_it(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    CUdeviceptr a, b;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &a), CUDA_SUCCESS); /* the device exists */
    vmh_driver_t t = *sim_table();
    real_map = t.cuMemMap;
    t.cuMemMap = map_then_grant;
    vmh_driver_install(&t);
    atomic_store(&grant_done, false);
    atomic_store(&grant_on_next_map, 1);
    assert_int_equal(vmh_heap_alloc(8 * MiB, &b), CUDA_SUCCESS);
    pthread_join(grant_thread, NULL);
    vmh_driver_install(sim_table());
    assert_int_equal(grant_rc, CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(a, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(b, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(alloc_on_a_device_without_a_context, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(allocations_land_on_the_current_device, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(peers_granted_up_front, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(refused_handle_type_falls_back, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(export_serial_dies_with_the_free, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(freed_export_memory_is_never_served_again, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(export_free_rounds_hold_nothing, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(peer_access_reaches_existing_and_new_buffers, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(peer_grant_during_a_new_buffer_reaches_it, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(peer_grant_before_the_first_allocation_reaches_it,
                                        tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(primary_context_kept_across_the_heap_setup, tu_setup,
                                        tu_teardown),
    };
    return cmocka_run_group_tests_name("heap_devices", tests, NULL, NULL);
}
