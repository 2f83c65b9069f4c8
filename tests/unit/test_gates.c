/* The safety gates no other suite guards (issue 38; tools/mutation-check.py deletes each gate of
 * tools/mutation-gates.txt in turn and fails when the tests named for it still pass), on the
 * simulated driver, in the mode the library ships in: every size carved, freed memory reused at
 * once while the program's work runs in one queue (VMMHOOK_STREAM_ORDERED on), the default park
 * limit. test_holes.c runs the holes with frees parked (stream ordered off, park limit 0) and
 * queues no work, so that deleting what keeps the tidy from unmapping memory that queued work
 * still touches left it passing.
 *
 * The race these gates close: an application thread frees a buffer (released at once: free
 * space again) with work still queued on it, while the reclaim thread's tidy or a trim is inside
 * its wait for the GPU. The wait began before the free, so it proves nothing about that work,
 * and the memory must stay mapped until a later wait has passed it. Each test makes that window
 * happen deterministically: the driver table's cuCtxSynchronize runs a step once the real
 * synchronize has returned (the wait's end, before the caller goes on), on a thread of its own
 * as another application thread would (sync_hook). The step queues a "kernel" writing the
 * buffer (sim_launch_write, in the program's one queue: the primary context; a second context
 * ends reuse at once, and frees park: the test of what a wait releases makes one) and frees it.
 * Unmapping that memory before the write has run is a hazard of the simulated driver (sim_hazards),
 * which every test checks. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_heap_tidy_now, vmh_pause_reset, vmh_tags_reset */
#endif
#include "testutil.h"
/* after testutil.h */
#include "testtags.h"

#include "heap_internal.h" /* extent records: addresses, chunks */
#include "registry.h"

#include <cudaTypedefs.h>
#include <pthread.h>
#include <stdatomic.h>

/* ---- the window: a step run at the end of the library's next synchronize --------------------- */

static vmh_driver_t hooked;
static void (*_Atomic after_sync)(void);
static _Atomic(CUcontext) hook_ctx; /* the step waits for this context's synchronize (NULL: any) */
static atomic_int hook_ran;

static void *hook_thread(void *arg)
{
    void (*step)(void) = *(void (**)(void))arg;
    sim_set_current_device(0); /* an application thread of the program: the primary context */
    step();
    return NULL;
}

static CUresult sync_hook(void)
{
    CUresult rc = sim_table()->cuCtxSynchronize();
    CUcontext want = atomic_load(&hook_ctx), cur = NULL;
    if (want && (sim_table()->cuCtxGetCurrent(&cur) != CUDA_SUCCESS || cur != want))
        return rc; /* another context's: the step waits for the one named */
    void (*step)(void) = atomic_exchange(&after_sync, NULL);
    if (step && rc == CUDA_SUCCESS) {
        pthread_t t;
        if (pthread_create(&t, NULL, hook_thread, &step) == 0 && pthread_join(t, NULL) == 0)
            atomic_fetch_add(&hook_ran, 1);
    }
    return rc;
}

/* step runs once, after the next synchronize of ctx (NULL: of any context) */
static void arm_in(CUcontext ctx, void (*step)(void))
{
    atomic_store(&hook_ran, 0);
    atomic_store(&hook_ctx, ctx);
    atomic_store(&after_sync, step);
}

static void arm(void (*step)(void))
{
    arm_in(NULL, step);
}

/* The step of most tests: a kernel queued on late_p (late_n bytes) in the program's queue, then
 * its free (at once: free space again). late_rc: the first failure (checked after the step). */
static CUdeviceptr late_p;
static size_t late_n;
static CUcontext late_ctx; /* where the kernel is queued (NULL: the thread's, the primary) */
static _Atomic CUresult late_rc;

static void write_then_free(void)
{
    CUresult rc = sim_launch_write(late_ctx, NULL, late_p, late_n, 0x5A);
    if (rc == CUDA_SUCCESS)
        rc = vmh_heap_free(late_p, NULL, false);
    atomic_store(&late_rc, rc);
}

static void assert_step_ran(void)
{
    assert_int_equal(atomic_load(&hook_ran), 1);
    assert_int_equal(atomic_load(&late_rc), CUDA_SUCCESS);
}

/* ---- fixtures -------------------------------------------------------------------------------- */

/* The shipped options (vmh_options_defaults: everything carved, reuse at once, the default park
 * limit), the tags and pauses fresh, and the hooked driver table. */
static int setup(void **state)
{
    tt_setup_carved(state);
    vmh_options_t shipped;
    vmh_options_defaults(&shipped);
    tu_opt.pack_below = shipped.pack_below;
    tu_opt.stream_ordered = shipped.stream_ordered;
    tu_opt.park_limit = shipped.park_limit;
    tu_configure();
    assert_true(tu_opt.stream_ordered && tu_opt.park_limit > 0);
    hooked = *sim_table();
    hooked.cuCtxSynchronize = sync_hook;
    vmh_driver_install(&hooked);
    atomic_store(&late_rc, CUDA_SUCCESS);
    return 0;
}

static int teardown(void **state)
{
    atomic_store(&after_sync, NULL);
    atomic_store(&hook_ctx, NULL);
    late_ctx = NULL;
    vmh_driver_install(sim_table());
    sim_flush();
    assert_int_equal(sim_hazards(), 0);
    return tt_teardown(state);
}

/* ---- helpers --------------------------------------------------------------------------------- */

static CUdeviceptr alloc(size_t size)
{
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_alloc(size, &p), CUDA_SUCCESS);
    return p;
}

static void release(CUdeviceptr p)
{
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* The extent record a carved buffer lies in (the tests run one thread when they look). */
static vmh_ext_t *extent_of(CUdeviceptr p)
{
    vmh_owner_t *o = vmh_registry_get(p);
    assert_non_null(o);
    assert_int_equal(o->kind, VMH_OWN_EXTENT);
    return (vmh_ext_t *)o;
}

static size_t mapped(const vmh_ext_t *e)
{
    return sim_range_mapped_bytes(e->va, e->va_size);
}

/* An extent of its own for a request of `size` bytes (chunks of max(32 MiB, size / 8)), empty
 * again at once: the blocks allocated next are carved from it. */
static vmh_ext_t *empty_extent(size_t size)
{
    CUdeviceptr z = alloc(size);
    vmh_ext_t *e = extent_of(z);
    assert_int_equal(e->va_size, size);
    release(z); /* at once: free space again */
    return e;
}

/* A free released at once that no wait has passed yet: the next pass (a trim's, the tidy's)
 * waits, and the window opens. Its extent (small class) is its own. */
static void unpassed_free(void)
{
    release(alloc(4096));
}

/* The shrink's variant of the step: the kernel queued on late_p, then late_p shrunk to 2 MiB
 * (its tail free at once: the program's work runs in one queue). */
static void write_then_shrink(void)
{
    CUresult rc = sim_launch_write(late_ctx, NULL, late_p, late_n, 0x5A);
    CUdeviceptr p = late_p;
    if (rc == CUDA_SUCCESS)
        rc = vmh_heap_realloc_ex(&p, 2 * MiB, NULL, false, NULL);
    if (rc == CUDA_SUCCESS && p != late_p)
        rc = CUDA_ERROR_UNKNOWN; /* a shrink stays in place */
    atomic_store(&late_rc, rc);
}

/* ---- holes (issue 27): the tidy unmaps idle chunks inside extents ---------------------------- */

/* The frees so far passed by a wait (no trim: a trim would make the holes itself), and the
 * recent peak made the live bytes now, so that the next tidy sees the free space beside them as
 * idle. */
static void pass_and_forget_the_peak(void)
{
    hdev_t *h = hdev_at(0);
    assert_non_null(h);
    assert_int_equal(vmh_reclaim_drain(&h->reclaim), CUDA_SUCCESS);
    vmh_dev_usable_peak_reset(&h->dev);
}

/* An extent of 512 MiB in 8 chunks of 64 MiB: a 2 MiB block kept at its start (*keep), a 126 MiB
 * one after it (late_p, which covers a whole chunk) for the window, and free space after them. */
static vmh_ext_t *extent_with_a_late_block(CUdeviceptr *keep)
{
    vmh_ext_t *e = empty_extent(512 * MiB);
    *keep = alloc(2 * MiB);
    late_p = alloc(126 * MiB);
    late_n = 126 * MiB;
    assert_ptr_equal(extent_of(*keep), e);
    assert_ptr_equal(extent_of(late_p), e);
    return e;
}

/* A buffer freed at once while the tidy waits may still be written by queued work: the tidy's
 * holes (carved_idle.c's ext_punchable, ext_passed) must leave its extent mapped until a later wait
 * has passed the free. */
static void tidy_holes_wait_for_frees_at_once(void **state)
{
    (void)state;
    CUdeviceptr keep;
    vmh_ext_t *e = extent_with_a_late_block(&keep);
    pass_and_forget_the_peak();
    unpassed_free();
    arm(write_then_free);
    vmh_heap_tidy_now(0, true); /* its pass waits, the free lands in the window */
    assert_step_ran();
    assert_int_equal(sim_hazards(), 0);
    assert_int_equal(mapped(e), e->va_size); /* no hole under the queued write */
    /* The next tidy's wait passes the free: now its chunks may go. */
    vmh_heap_tidy_now(0, true);
    assert_int_equal(sim_hazards(), 0);
    assert_true(mapped(e) < e->va_size);
    release(keep);
}

/* A trim with `step` (a kernel queued on late_p, then late_p freed or shrunk at once) in the
 * window after its wait: it makes no hole under the queued write; the next trim's wait passes
 * it, and the chunks go. */
static void trim_window(void (*step)(void))
{
    CUdeviceptr keep;
    vmh_ext_t *e = extent_with_a_late_block(&keep);
    unpassed_free();
    arm(step);
    vmh_heap_trim();
    assert_step_ran();
    assert_int_equal(sim_hazards(), 0);
    assert_int_equal(mapped(e), e->va_size);
    vmh_heap_trim(); /* its wait passes the step */
    assert_int_equal(sim_hazards(), 0);
    assert_true(mapped(e) < e->va_size);
    release(keep);
}

/* The same window in a trim, which makes holes of every idle chunk after its wait
 * (vmm_trim, out of memory, a resume that runs out). */
static void trim_holes_wait_for_frees_at_once(void **state)
{
    (void)state;
    trim_window(write_then_free);
}

/* A shrink's tail freed at once while a trim waits: the extent takes the freed-at-once mark as
 * for a free (carved.c's vmh_carved_resize_locked), so the trim makes no hole under the queued
 * write. */
static void shrunk_tail_stays_mapped_until_passed(void **state)
{
    (void)state;
    trim_window(write_then_shrink);
    release(late_p);
}

/* An extent with a live export gets no hole (carved_idle.c's export check of the holes): another
 * process may map its chunks. Here the export's chunk references are gone (what cuIpcGetMemHandle
 * leaves when it fails after the heap's export: ipc.c releases them, the block stays exported), so
 * that the export list alone must keep the hole away; an extent beside it without an export
 * gets holes in the same tidy. */
static void no_holes_in_an_exported_extent(void **state)
{
    (void)state;
    CUdeviceptr z1 = alloc(512 * MiB), z2 = alloc(512 * MiB);
    vmh_ext_t *e1 = extent_of(z1), *e2 = extent_of(z2);
    assert_true(e1 != e2);
    release(z1);
    CUdeviceptr x = alloc(2 * MiB), fill = alloc(510 * MiB); /* e1 full */
    assert_ptr_equal(extent_of(x), e1);
    assert_ptr_equal(extent_of(fill), e1);
    release(z2);
    CUdeviceptr y = alloc(2 * MiB);
    assert_ptr_equal(extent_of(y), e2);
    release(fill);
    vmh_export_t ex;
    assert_int_equal(vmh_heap_export(x, &ex), CUDA_SUCCESS);
    uint64_t serial = ex.serial;
    vmh_heap_export_release(&ex);
    assert_true(vmh_heap_export_alive(x, serial));
    vmh_heap_trim(); /* a wait passes the frees, then the holes (as the tidy's below) */
    vmh_heap_tidy_now(0, true);
    assert_true(mapped(e2) < e2->va_size); /* holes where nothing is exported */
    assert_int_equal(mapped(e1), e1->va_size);
    release(x);
    release(y);
}

/* A chunk that another holder keeps (its mapping or its handle: an export being made, a range
 * that still maps it) never becomes a hole (carved_idle.c's reference check of the holes): the tidy
 * would unmap what the holder still uses, and a hole mapped again would no longer be its memory.
 * Here every chunk of the extent gets a second reference, as an export's. */
static void no_hole_in_a_chunk_held_elsewhere(void **state)
{
    (void)state;
    vmh_ext_t *e = empty_extent(512 * MiB);
    CUdeviceptr keep = alloc(2 * MiB);
    assert_ptr_equal(extent_of(keep), e);
    assert_int_equal(e->npieces, 1);
    vmh_range_t *r = e->pieces[0].range;
    size_t n = r->nmaps;
    assert_true(n > 1);
    vmh_alloc_t **held = calloc(n, sizeof *held);
    assert_non_null(held);
    for (size_t i = 0; i < n; i++)
        held[i] = vmh_alloc_ref(r->maps[i]->alloc);
    vmh_heap_trim();
    vmh_heap_tidy_now(0, true);
    assert_int_equal(mapped(e), e->va_size);
    for (size_t i = 0; i < n; i++)
        vmh_alloc_unref(held[i]);
    free(held);
    /* Held alone again: the next window's tidy makes the holes. */
    vmh_heap_tidy_now(0, true);
    assert_true(mapped(e) < e->va_size);
    release(keep);
}

/* ---- trims: whole empty extents given back --------------------------------------------------- */

/* A freed exported block retires its extent (no new block from it); the release that empties it
 * gives it back at once, but only once its blocks freed at once are passed too
 * (ext_retired_passed): here the extent's other block is freed, with a write queued, while the
 * trim's wait that releases the exported block runs. */
static void retired_extent_waits_for_frees_at_once(void **state)
{
    (void)state;
    vmh_ext_t *e = empty_extent(256 * MiB);
    CUdeviceptr x = alloc(64 * MiB);
    late_p = alloc(64 * MiB);
    late_n = 64 * MiB;
    assert_ptr_equal(extent_of(x), e);
    assert_ptr_equal(extent_of(late_p), e);
    vmh_heap_trim();
    vmh_export_t ex;
    assert_int_equal(vmh_heap_export(x, &ex), CUDA_SUCCESS);
    release(x); /* parks (an exported block's free always does) and retires the extent */
    arm(write_then_free);
    vmh_heap_trim(); /* its wait releases x; the other block is freed in the window */
    assert_step_ran();
    assert_int_equal(sim_hazards(), 0);
    assert_true(sim_is_mapped(late_p));
    vmh_heap_trim(); /* a wait passes that free: the extent goes */
    assert_int_equal(sim_hazards(), 0);
    assert_false(sim_is_mapped(late_p));
    vmh_heap_export_release(&ex);
}

/* ---- exports --------------------------------------------------------------------------------- */

/* true when [p, p + n) and [q, q + m) share a byte */
static bool overlap(CUdeviceptr p, size_t n, CUdeviceptr q, size_t m)
{
    return p < q + m && q < p + n;
}

/* Once its exporter frees it, an exported block's memory is never served again (another process
 * may still map its chunk, as natively memory freed by its exporter stays the importer's), even
 * while reuse at once is on and after the GPU has passed the free, and its export is dead. */
static void exported_block_is_never_served_again(void **state)
{
    (void)state;
    vmh_ext_t *e = empty_extent(256 * MiB);
    CUdeviceptr x = alloc(64 * MiB), y = alloc(64 * MiB);
    assert_ptr_equal(extent_of(x), e);
    assert_ptr_equal(extent_of(y), e);
    vmh_export_t ex;
    assert_int_equal(vmh_heap_export(x, &ex), CUDA_SUCCESS);
    assert_true(vmh_heap_export_alive(x, ex.serial));
    release(x);
    assert_false(vmh_heap_export_alive(x, ex.serial));
    const size_t sizes[] = {64 * MiB, 32 * MiB, 64 * MiB - 4096, 2 * MiB, 128 * MiB};
    const size_t n = sizeof sizes / sizeof sizes[0];
    CUdeviceptr got[2][sizeof sizes / sizeof sizes[0]];
    for (int round = 0; round < 2; round++) {
        if (round == 1)
            vmh_heap_trim(); /* the GPU passes the free: still never served */
        for (size_t i = 0; i < n; i++) {
            got[round][i] = alloc(sizes[i]);
            assert_false(overlap(got[round][i], sizes[i], x, 64 * MiB));
        }
    }
    assert_false(vmh_heap_export_alive(x, ex.serial));
    for (int round = 0; round < 2; round++)
        for (size_t i = 0; i < n; i++)
            release(got[round][i]);
    release(y);
    vmh_heap_export_release(&ex);
}

/* An export is alive for the buffer it was made of only (its serial), not for a later buffer at
 * the same address: here the freed exported block's extent goes, the next extent of its size
 * takes its addresses back (a span's first fit) and the next block x's. */
static void export_serial_ends_with_the_buffer(void **state)
{
    (void)state;
    CUdeviceptr z = alloc(256 * MiB), keep = alloc(256 * MiB); /* keep: the span stays */
    vmh_ext_t *e = extent_of(z);
    const CUdeviceptr base = e->va;
    release(z);
    CUdeviceptr x = alloc(64 * MiB), y = alloc(64 * MiB);
    assert_ptr_equal(extent_of(x), e);
    assert_ptr_equal(extent_of(y), e);
    vmh_export_t ex;
    assert_int_equal(vmh_heap_export(x, &ex), CUDA_SUCCESS);
    const uint64_t first = ex.serial;
    vmh_heap_export_release(&ex);
    release(x);
    release(y);
    vmh_heap_trim(); /* passes both frees: the retired extent goes */
    assert_false(sim_is_mapped(x));
    assert_int_equal(empty_extent(256 * MiB)->va, base);
    CUdeviceptr again = alloc(64 * MiB);
    assert_int_equal(again, x);
    assert_int_equal(vmh_heap_export(again, &ex), CUDA_SUCCESS);
    assert_true(ex.serial != first);
    assert_true(vmh_heap_export_alive(again, ex.serial));
    assert_false(vmh_heap_export_alive(x, first));
    vmh_heap_export_release(&ex);
    release(again);
    release(keep);
}

/* ---- waits: what a wait releases ------------------------------------------------------------- */

/* A wait releases only what was parked before it began (reclaim.c's take_upto: generation <= the
 * wait's): a buffer freed while the wait runs, with work queued in a second context (so frees
 * park: the program's work is in two queues), waits for the next wait. Here the buffer has
 * chunks of its own (a growable one, vmm_realloc's), whose release hands its range to the cache
 * that the same trim then empties: unmapped under the queued write, were it released. */
static void a_free_during_a_wait_waits_for_the_next(void **state)
{
    (void)state;
    CUdeviceptr a = alloc(8 * MiB);
    late_p = 0;
    late_n = 32 * MiB; /* within the park budget: its free does not wait itself */
    assert_int_equal(vmh_heap_realloc_ex(&late_p, late_n, NULL, false, NULL), CUDA_SUCCESS);
    assert_int_equal(((vmh_owner_t *)vmh_registry_get(late_p))->kind, VMH_OWN_CHUNKS);
    tu_ctx_fns_t f = tu_ctx_fns();
    CUcontext c2 = NULL;
    assert_int_equal(f.create(&c2, NULL, 0, 0), CUDA_SUCCESS); /* current on this thread now */
    vmh_ctx_seen(c2, 0);
    assert_false(vmh_work_in_one_queue()); /* frees park from now on */
    assert_int_equal(f.set_current(sim_primary_context(0)), CUDA_SUCCESS);
    vmh_ctx_current_changed();
    release(a); /* parked: the trim below waits */
    late_ctx = c2;
    arm_in(c2, write_then_free);
    vmh_heap_trim();
    assert_step_ran();
    assert_int_equal(sim_hazards(), 0);
    assert_true(sim_is_mapped(late_p));
    /* A new buffer of that size gets other memory; the late write lands where it was aimed. */
    CUdeviceptr q = 0;
    assert_int_equal(vmh_heap_realloc_ex(&q, late_n, NULL, false, NULL), CUDA_SUCCESS);
    assert_true(q != late_p);
    tu_fill(q, 4 * MiB, 3);
    sim_flush();
    assert_true(tu_check(q, 4 * MiB, 3));
    release(q);
    vmh_heap_trim(); /* its wait passes the free: now it goes */
    assert_false(sim_is_mapped(late_p));
    vmh_ctx_forget(c2);
    assert_int_equal(f.destroy(c2), CUDA_SUCCESS);
    assert_int_equal(f.set_current(sim_primary_context(0)), CUDA_SUCCESS);
    vmh_ctx_current_changed();
}

/* ---- pauses ---------------------------------------------------------------------------------- */

/* A pause leaves memory shared with another process mapped (pause.c's pausable): its memory
 * would not go, and the importer would lose what it shares. The exported mark alone must keep
 * it: the export's chunk references are released here, as a failed cuIpcGetMemHandle leaves
 * them (the buffer stays exported until it is freed). */
static void pause_leaves_an_exported_buffer_mapped(void **state)
{
    (void)state;
    CUdeviceptr x = tt_alloc_in("gates", 64 * MiB);
    tu_fill(x, 64 * MiB, 5);
    vmh_export_t ex;
    assert_int_equal(vmh_heap_export(x, &ex), CUDA_SUCCESS);
    vmh_heap_export_release(&ex);
    assert_int_equal(vmm_pause("gates", VMM_PAUSE_BACKUP), VMM_OK);
    assert_true(sim_is_mapped(x));
    assert_true(tu_check(x, 64 * MiB, 5));
    assert_int_equal(vmm_resume("gates"), VMM_OK);
    assert_true(tu_check(x, 64 * MiB, 5));
    release(x);
}

/* A pause leaves memory that another holder keeps mapped (pause.c's pausable: a range a move left
 * that the GPU has not passed, an export being made): pausing would give nothing back, and the
 * resumed range would no longer share memory with that holder. Here every chunk of the buffer's
 * extent gets a second reference, as an export's. */
static void pause_leaves_a_chunk_held_elsewhere_mapped(void **state)
{
    (void)state;
    CUdeviceptr x = tt_alloc_in("gates", 64 * MiB);
    tu_fill(x, 64 * MiB, 6);
    vmh_ext_t *e = extent_of(x);
    assert_int_equal(e->npieces, 1);
    vmh_range_t *r = e->pieces[0].range;
    vmh_alloc_t **held = calloc(r->nmaps, sizeof *held);
    assert_non_null(held);
    for (size_t i = 0; i < r->nmaps; i++)
        held[i] = vmh_alloc_ref(r->maps[i]->alloc);
    const size_t n = r->nmaps;
    assert_int_equal(vmm_pause("gates", VMM_PAUSE_BACKUP), VMM_OK);
    assert_true(sim_is_mapped(x));
    assert_true(tu_check(x, 64 * MiB, 6));
    assert_int_equal(vmm_resume("gates"), VMM_OK);
    for (size_t i = 0; i < n; i++)
        vmh_alloc_unref(held[i]);
    free(held);
    assert_true(tu_check(x, 64 * MiB, 6));
    release(x);
}

/* ---- joins (issue 27): neighbouring extents made one ----------------------------------------- */

/* Two neighbouring extents joined into one keep the later mark of a block freed at once (a trim
 * or the tidy waits for the frees of either): here the higher one's block is freed, with a write
 * queued, in the tidy's window, and a request that only both together hold joins them; the
 * lower one's own free was passed long before. */
static CUdeviceptr joined;
static void write_free_then_join(void)
{
    write_then_free();
    if (atomic_load(&late_rc) == CUDA_SUCCESS)
        atomic_store(&late_rc, vmh_heap_alloc(400 * MiB, &joined));
}

static void joined_extent_keeps_the_later_mark(void **state)
{
    (void)state;
    CUdeviceptr lo = alloc(256 * MiB);
    late_p = alloc(256 * MiB);
    late_n = 256 * MiB;
    vmh_ext_t *elo = extent_of(lo), *ehi = extent_of(late_p);
    assert_true(elo->va + elo->va_size == ehi->va); /* neighbours in one span */
    release(lo);
    pass_and_forget_the_peak(); /* lo's free passed */
    unpassed_free();
    arm(write_free_then_join);
    vmh_heap_tidy_now(0, true);
    assert_step_ran();
    assert_ptr_equal(extent_of(joined), elo); /* joined: the lower record holds both */
    assert_int_equal(elo->va_size, 512 * MiB);
    assert_int_equal(sim_hazards(), 0);
    assert_int_equal(mapped(elo), elo->va_size);
    vmh_heap_tidy_now(0, true); /* a wait passes the free: the free end may go now */
    assert_int_equal(sim_hazards(), 0);
    assert_true(mapped(elo) < elo->va_size);
    release(joined);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(tidy_holes_wait_for_frees_at_once, setup, teardown),
        cmocka_unit_test_setup_teardown(trim_holes_wait_for_frees_at_once, setup, teardown),
        cmocka_unit_test_setup_teardown(shrunk_tail_stays_mapped_until_passed, setup, teardown),
        cmocka_unit_test_setup_teardown(no_holes_in_an_exported_extent, setup, teardown),
        cmocka_unit_test_setup_teardown(no_hole_in_a_chunk_held_elsewhere, setup, teardown),
        cmocka_unit_test_setup_teardown(retired_extent_waits_for_frees_at_once, setup, teardown),
        cmocka_unit_test_setup_teardown(exported_block_is_never_served_again, setup, teardown),
        cmocka_unit_test_setup_teardown(export_serial_ends_with_the_buffer, setup, teardown),
        cmocka_unit_test_setup_teardown(a_free_during_a_wait_waits_for_the_next, setup, teardown),
        cmocka_unit_test_setup_teardown(pause_leaves_an_exported_buffer_mapped, setup, teardown),
        cmocka_unit_test_setup_teardown(pause_leaves_a_chunk_held_elsewhere_mapped, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(joined_extent_keeps_the_later_mark, setup, teardown),
    };
    return cmocka_run_group_tests_name("gates", tests, NULL, NULL);
}
