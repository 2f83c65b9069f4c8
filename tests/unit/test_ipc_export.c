/* IPC export and import (ipc_fixture.h says how, in one process): the refusals (handle type,
 * foreign handles, flags), round trips of big and packed buffers, an importer's view through
 * the exporter's grow and free, many chunks in batches, concurrent opens of one handle, and
 * peer access following the contexts. */
#include "ipc_fixture.h"

/* ---- refusals ----------------------------------------------------------------------------- */

static void handle_type_none_refuses_and_says_so_once(void **state)
{
    (void)state;
    reset_with(1, VMH_HANDLE_NONE);
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(3 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h;
    assert_int_equal(vmh_ipc_get_handle(p, &h), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_ipc_get_handle(p + 100, &h), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(captured("VMMHOOK_HANDLE_TYPE=posix_fd"), 1);
    assert_false(vmh_ipc_listening());
    assert_int_equal(vmh_ipc_export_count(), 0);
    /* A pointer the library did not serve is the driver's business. */
    assert_int_equal(vmh_ipc_get_handle(0x1234, &h), CUDA_ERROR_NOT_FOUND);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void handle_type_refused_by_the_device(void **state)
{
    (void)state;
    /* posix_fd asked for, but the chunks were made without it (fabric falls back to none on
     * the simulated driver, which refuses fabric like the H200). */
    reset_with(1, VMH_HANDLE_FABRIC);
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(3 * MiB, &p), CUDA_SUCCESS);
    tu_opt.handle = VMH_HANDLE_POSIX_FD;
    tu_configure();
    CUipcMemHandle h;
    assert_int_equal(vmh_ipc_get_handle(p, &h), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(captured("refused POSIX fd"), 1);
    assert_int_equal(vmh_ipc_export_count(), 0);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void foreign_and_bad_handles_are_not_ours(void **state)
{
    (void)state;
    CUipcMemHandle zero;
    memset(&zero, 0, sizeof zero);
    assert_false(vmh_ipc_handle_is_ours(&zero));
    /* A native handle of the simulated driver (its own magic). */
    CUdeviceptr n;
    CUipcMemHandle nh;
    assert_int_equal(sim_table()->cuMemAlloc(&n, 4096), CUDA_SUCCESS);
    assert_int_equal(sim_table()->cuIpcGetMemHandle(&nh, n), CUDA_SUCCESS);
    assert_false(vmh_ipc_handle_is_ours(&nh));
    assert_int_equal(sim_table()->cuMemFree(n), CUDA_SUCCESS);
    /* Ours, with any byte changed, is not ours any more. */
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    for (size_t i = 0; i < offsetof(vmh_ipc_handle_t, check) + 8; i++) {
        CUipcMemHandle bad = h;
        bad.reserved[i] ^= 0x10;
        assert_false(vmh_ipc_handle_is_ours(&bad));
    }
    assert_int_equal(vmh_ipc_close(p), CUDA_ERROR_NOT_FOUND); /* not opened here */
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void same_process_flags_and_context(void **state)
{
    (void)state;
    CUdeviceptr p, q = 0;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    /* As the driver: a handle of this same process. */
    assert_int_equal(vmh_ipc_open(&h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, &q),
                     CUDA_ERROR_INVALID_CONTEXT);
    assert_int_equal(vmh_ipc_open(&h, 0, &q), CUDA_ERROR_INVALID_VALUE);
    sim_set_current_device(-1);
    assert_int_equal(vmh_ipc_open(&h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, &q),
                     CUDA_ERROR_INVALID_CONTEXT);
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_ERROR_INVALID_CONTEXT);
    sim_set_current_device(0);
    assert_int_equal(q, 0);
    assert_int_equal(vmh_ipc_import_count(), 0);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* ---- export and import -------------------------------------------------------------------- */

static void big_buffer_round_trip(void **state)
{
    (void)state;
    const size_t n = 6 * MiB + 5;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(n, &p), CUDA_SUCCESS);
    vmh_buffer_info_t bi;
    assert_true(vmh_heap_find(p, &bi) && !bi.carved);
    tu_fill(p, n, 1);
    CUipcMemHandle h = get_handle(p);
    vmh_ipc_handle_t w = decode(&h);
    assert_int_equal(w.pid, (uint32_t)getpid());
    assert_int_equal(w.size, n);
    assert_int_equal(w.offset, 0);
    assert_int_equal(w.device, 0);
    assert_true(vmh_ipc_listening());
    /* The same buffer gives the same handle (PyTorch asks once per tensor sent). */
    CUipcMemHandle again = get_handle(p + 4096);
    assert_memory_equal(&h, &again, sizeof h);
    assert_int_equal(vmh_ipc_export_count(), 1);

    sim_reset_counters();
    CUdeviceptr q = 0, q2 = 0;
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_SUCCESS);
    assert_int_not_equal(q, 0);
    assert_int_not_equal(q, p);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), 1);
    assert_int_equal(sim_calls("cuMemImportFromShareableHandle"), 1);
    assert_int_equal(sim_access_flags(q, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(q, 1), 0);
    /* The same memory: what the exporter wrote, and writes back. */
    assert_true(tu_check(q, n, 1));
    tu_fill(q, n, 2);
    assert_true(tu_check(p, n, 2));
    /* Opened twice in one context: the same pointer, counted (cuda.h). */
    assert_int_equal(vmh_ipc_open_remote(&h, &q2), CUDA_SUCCESS);
    assert_int_equal(q2, q);
    assert_int_equal(sim_calls("cuMemImportFromShareableHandle"), 1);
    assert_int_equal(vmh_ipc_import_count(), 1);
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_true(sim_is_mapped(q));
    assert_int_equal(vmh_ipc_close(q + 256), CUDA_ERROR_NOT_FOUND); /* only what open gave */
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_false(sim_is_mapped(q));
    assert_int_equal(vmh_ipc_close(q), CUDA_ERROR_NOT_FOUND);
    assert_int_equal(vmh_ipc_import_count(), 0);
    assert_true(tu_check(p, n, 2));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* Closing the last reference waits for the device's work before the mapping goes; during a
 * capture that wait would be refused and invalidate the capture: the close is refused without
 * a driver call and the import stays open, to be closed after the capture (a blocking wait). */
static void close_during_capture_is_refused_and_kept(void **state)
{
    (void)state;
    const size_t n = 4 * MiB;
    CUdeviceptr p, q;
    assert_int_equal(vmh_heap_alloc(n, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_SUCCESS);
    const vmh_driver_t *D = sim_table();
    CUstream s;
    assert_int_equal(D->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    assert_int_equal(D->cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
    vmh_capture_began(s, CU_STREAM_CAPTURE_MODE_GLOBAL); /* what the interposer reports */
    sim_reset_counters();
    assert_int_equal(vmh_ipc_close(q), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert_int_equal(sim_call_count(), 0);
    assert_true(sim_is_mapped(q));
    assert_int_equal(vmh_ipc_import_count(), 1);
    CUgraph g = NULL;
    assert_int_equal(D->cuStreamEndCapture(s, &g), CUDA_SUCCESS); /* not invalidated */
    vmh_capture_ended(s);
    assert_int_equal(D->cuGraphDestroy(g), CUDA_SUCCESS);
    assert_int_equal(D->cuStreamDestroy(s), CUDA_SUCCESS);
    uint64_t blocking = vmh_counter_get(VMH_STAT_syncs_blocking);
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_false(sim_is_mapped(q));
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), blocking + 1);
    assert_int_equal(vmh_ipc_import_count(), 0);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void packed_buffer_maps_its_chunk_at_the_offset(void **state)
{
    (void)state;
    CUdeviceptr a, b;
    assert_int_equal(vmh_heap_alloc(5000, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(3000, &b), CUDA_SUCCESS);
    vmh_buffer_info_t bi;
    assert_true(vmh_heap_find(b, &bi) && bi.carved);
    tu_fill(a, 5000, 3);
    tu_fill(b, 3000, 4);
    CUipcMemHandle h = get_handle(b);
    vmh_ipc_handle_t w = decode(&h);
    assert_int_equal(w.size, 3000);
    assert_true(w.offset > 0);
    CUdeviceptr q;
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_SUCCESS);
    assert_int_equal(q % GRAN, w.offset % GRAN);
    assert_true(tu_check(q, 3000, 4));
    /* The neighbour shares the chunk: it is there too, before the buffer. */
    assert_true(tu_check(q - (b - a), 5000, 3));
    tu_fill(q, 3000, 5);
    assert_true(tu_check(b, 3000, 5));
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
}

/* The importer keeps what it opened when the exporter grows, moves and frees the buffer; it
 * sees the buffer as it was when the handle was made (its size then, not the growth). */
static void importer_keeps_its_view_through_grow_and_free(void **state)
{
    (void)state;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
    vmh_buffer_info_t bi;
    assert_true(vmh_heap_find(p, &bi) && !bi.carved);
    tu_fill(p, 4 * MiB, 6);
    CUipcMemHandle h1 = get_handle(p);
    CUdeviceptr q1;
    assert_int_equal(vmh_ipc_open_remote(&h1, &q1), CUDA_SUCCESS);
    tu_opt.headroom = 0;
    tu_configure();
    sim_refuse_hints(true); /* the grow moves the buffer */
    CUdeviceptr old = p;
    assert_int_equal(vmh_heap_realloc(&p, 20 * MiB, NULL, false), CUDA_SUCCESS);
    sim_refuse_hints(false);
    assert_int_not_equal(p, old);
    vmh_heap_trim(); /* the old address is unmapped once its queued work is done */
    assert_true(tu_check(q1, 4 * MiB, 6));
    /* A new handle for the grown buffer: two chunks now. */
    CUipcMemHandle h2 = get_handle(p);
    assert_memory_not_equal(&h1, &h2, sizeof h1);
    assert_int_equal(decode(&h2).size, 20 * MiB);
    tu_fill(p, 20 * MiB, 7);
    CUdeviceptr q2;
    assert_int_equal(vmh_ipc_open_remote(&h2, &q2), CUDA_SUCCESS);
    assert_true(tu_check(q2, 20 * MiB, 7));
    /* q1 maps the first chunk, which the grown buffer still uses. */
    assert_true(tu_check(q1, 4 * MiB, 7));
    /* The move freed the old address: h1's entry went (h1 opens nothing new any more; q1 is
     * the importer's own). */
    assert_int_equal(vmh_ipc_export_count(), 1);

    /* The exporter frees: the importer's mappings stay. */
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    assert_false(sim_is_mapped(p));
    assert_true(tu_check(q2, 20 * MiB, 7));
    /* New memory of the same size is other memory. */
    CUdeviceptr r;
    assert_int_equal(vmh_heap_alloc(20 * MiB, &r), CUDA_SUCCESS);
    tu_fill(r, 20 * MiB, 8);
    assert_true(tu_check(q2, 20 * MiB, 7));
    /* Freed: the table lets go (the imports hold the memory themselves). */
    vmh_ipc_prune(); /* the listener may have done it already: it prunes every second */
    assert_int_equal(vmh_ipc_export_count(), 0);
    assert_true(tu_check(q1, 4 * MiB, 7));
    assert_int_equal(vmh_ipc_close(q1), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_close(q2), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(r, NULL, false), CUDA_SUCCESS);
}

static void many_chunks_cross_in_batches(void **state)
{
    (void)state;
    /* Each grow adds one chunk: more chunks than one SCM_RIGHTS batch carries. */
    tu_opt.headroom = 128 * MiB;
    tu_configure();
    CUdeviceptr p = 0;
    const int steps = VMH_IPC_BATCH + 8;
    for (int i = 1; i <= steps; i++)
        assert_int_equal(vmh_heap_realloc(&p, (size_t)i * GRAN, NULL, false), CUDA_SUCCESS);
    const size_t n = (size_t)steps * GRAN;
    tu_fill(p, n, 9);
    CUipcMemHandle h = get_handle(p);
    sim_reset_counters();
    CUdeviceptr q;
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemImportFromShareableHandle"), (unsigned long)steps);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), (unsigned long)steps);
    assert_true(tu_check(q, n, 9));
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* ---- threads ------------------------------------------------------------------------------ */

#define OPENERS 8

typedef struct opener {
    CUipcMemHandle h;
    CUdeviceptr got;
    CUresult rc;
} opener_t;

static void *open_thread(void *arg)
{
    opener_t *o = arg;
    sim_set_current_device(0);
    o->rc = vmh_ipc_open_remote(&o->h, &o->got);
    return NULL;
}

static void concurrent_opens_share_one_mapping(void **state)
{
    (void)state;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
    tu_fill(p, 4 * MiB, 10);
    CUipcMemHandle h = get_handle(p);
    pthread_t t[OPENERS];
    opener_t o[OPENERS];
    for (int i = 0; i < OPENERS; i++) {
        o[i] = (opener_t){.h = h};
        assert_int_equal(pthread_create(&t[i], NULL, open_thread, &o[i]), 0);
    }
    for (int i = 0; i < OPENERS; i++)
        pthread_join(t[i], NULL);
    for (int i = 0; i < OPENERS; i++) {
        assert_int_equal(o[i].rc, CUDA_SUCCESS);
        assert_int_equal(o[i].got, o[0].got);
    }
    assert_int_equal(vmh_ipc_import_count(), 1);
    assert_true(tu_check(o[0].got, 4 * MiB, 10));
    for (int i = 0; i < OPENERS; i++) {
        assert_true(sim_is_mapped(o[0].got));
        assert_int_equal(vmh_ipc_close(o[i].got), CUDA_SUCCESS);
    }
    assert_false(sim_is_mapped(o[0].got));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* ---- peer access -------------------------------------------------------------------------- */

static void peer_access_follows_the_contexts(void **state)
{
    (void)state;
    const vmh_driver_t *drv = sim_table();
    CUcontext ctx0, ctx1;
    assert_int_equal(drv->cuDevicePrimaryCtxRetain(&ctx0, 0), CUDA_SUCCESS);
    assert_int_equal(drv->cuDevicePrimaryCtxRetain(&ctx1, 1), CUDA_SUCCESS);
    CUdeviceptr on1, small1, on0;
    sim_set_current_device(1);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &on1), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(500, &small1), CUDA_SUCCESS);
    tu_fill(on1, 4 * MiB, 11);
    sim_set_current_device(0);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &on0), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(on1, 0), 0);
    assert_false(tu_check(on1, 4 * MiB, 11)); /* device 0 cannot read device 1's memory */

    /* Device 0's context enables access to device 1's: device 0 reaches device 1's buffers. */
    assert_int_equal(drv->cuCtxEnablePeerAccess(ctx1, 0), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_peer_changed(ctx1, true), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(on1, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(small1, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(on0, 1), 0); /* not the other way round */
    assert_true(tu_check(on1, 4 * MiB, 11));
    /* Future buffers of device 1 too. */
    CUdeviceptr later;
    sim_set_current_device(1);
    assert_int_equal(vmh_heap_alloc(8 * MiB, &later), CUDA_SUCCESS);
    sim_set_current_device(0);
    assert_int_equal(sim_access_flags(later, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_current_device(), 0); /* the peer context was pushed and popped */

    assert_int_equal(drv->cuCtxDisablePeerAccess(ctx1), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_peer_changed(ctx1, false), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(on1, 0), 0);
    assert_int_equal(sim_access_flags(later, 0), 0);
    assert_int_equal(sim_access_flags(on1, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    /* The peer's own context: same device, nothing to grant. */
    assert_int_equal(vmh_ipc_peer_changed(ctx0, true), CUDA_ERROR_INVALID_DEVICE);
    /* (the driver's enable rejects a NULL peer first; here the push does) */
    assert_int_not_equal(vmh_ipc_peer_changed(NULL, true), CUDA_SUCCESS);
    assert_int_equal(sim_current_device(), 0);

    assert_int_equal(vmh_heap_free(on1, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small1, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(later, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(on0, NULL, false), CUDA_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(handle_type_none_refuses_and_says_so_once, setup, teardown),
        cmocka_unit_test_setup_teardown(handle_type_refused_by_the_device, setup, teardown),
        cmocka_unit_test_setup_teardown(foreign_and_bad_handles_are_not_ours, setup, teardown),
        cmocka_unit_test_setup_teardown(same_process_flags_and_context, setup, teardown),
        cmocka_unit_test_setup_teardown(big_buffer_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(close_during_capture_is_refused_and_kept, setup, teardown),
        cmocka_unit_test_setup_teardown(packed_buffer_maps_its_chunk_at_the_offset, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(importer_keeps_its_view_through_grow_and_free, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(many_chunks_cross_in_batches, setup, teardown),
        cmocka_unit_test_setup_teardown(concurrent_opens_share_one_mapping, setup, teardown),
        cmocka_unit_test_setup_teardown(peer_access_follows_the_contexts, setup, teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, NULL);
}
