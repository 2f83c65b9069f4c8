/* Layer "heap front", its upkeep: idle memory given back and spilled memory brought home.
 *   - relieve: after the driver ran out of memory, the device's parked frees waited for and its
 *     idle memory trimmed, so that the allocation can try once more (device.h);
 *   - tidy: from the reclaim thread, idle memory beyond what the program's recent peak may need
 *     again goes back, so that no application thread waits for it (docs/DESIGN.md, "Limits that
 *     follow the program");
 *   - trim: everything idle (holes inside extents too), when the program or another allocator
 *     of the process asks, or a resume needs the memory;
 *   - prefetch: buffers spilled to host memory (VMMHOOK_OVERFLOW=host) moved back to the device.
 * The per-GPU records are heap_devices.c's; the entry points that serve and free are heap.c's.
 */
#include "heap_internal.h"

#include "clock.h"
#include "contexts.h"
#include "driver.h"
#include "overflow.h"
#include "registry.h"
#include "stats.h"
#include "witness.h"

#include <assert.h>
#include <stdatomic.h>

static _Atomic(vmh_pressure_fn) pressure_hook; /* run before trimming on out of memory */

void vmh_heap_on_pressure(vmh_pressure_fn fn)
{
    atomic_store(&pressure_hook, fn);
}

/* Every idle byte of h, after a drain (so that what was freed at once is behind a completed
 * wait): cached buffers, empty extents, and the whole free chunks inside extents that hold
 * live blocks (holes): idle memory never fails a request nor keeps a tag paused. Returns the
 * bytes. */
static size_t idle_give_back(hdev_t *h)
{
    size_t bytes = vmh_cache_trim(&h->cache);
    /* (another thread's punch still unmapping keeps its shard's empty extents from the trim,
     * and its memory from the driver, until it is done: settled before and after) */
    FOR_EACH_PART(h, p)
    vmh_carved_settle(&p->carved);
    FOR_EACH_PART(h, p)
    bytes += vmh_carved_trim(&p->carved);
    FOR_EACH_PART(h, p)
    bytes += vmh_carved_punch_upto(&p->carved, SIZE_MAX);
    FOR_EACH_PART(h, p)
    vmh_carved_settle(&p->carved);
    return bytes;
}

/* Gives back idle memory of the device after the driver ran out of memory (device.h): waits
 * for parked frees (not while the calling thread may not synchronize: a capture; the caller
 * then answers out of memory, as the driver would), trims, and unmaps every whole free chunk
 * inside extents that hold live blocks (holes): idle memory never fails a request. */
bool vmh_hdev_relieve(vmh_dev_t *d)
{
    hdev_t *h = hdev_of(d);
    vmh_pressure_fn hook = atomic_load(&pressure_hook);
    /* lets other layers drop what pins freed memory (ipc.c: stale exports) */
    bool dropped = hook && hook();
    vmh_reclaim_drain(&h->reclaim);
    size_t bytes = idle_give_back(h);
    if (bytes)
        vmh_count(VMH_STAT_trims, 1);
    return bytes != 0 || dropped || vmh_reclaim_pending(&h->reclaim);
}

/* Limits that follow the program: idle memory (free carved space in whole extents, cached
 * buffers) stays while the program's recent peak of live bytes may need it again, plus a
 * slack of 1/TIDY_SLACK of that peak; the rest goes back, from the reclaim thread, so no
 * application thread waits. "Recent": the larger of the peaks of the current window and the
 * one before (VMH_TIDY_WINDOW_NS each), so a program whose steps repeat keeps its steps' memory
 * and one that shrank for good gives it back within two windows. Once a window, free space
 * inside extents that hold live blocks counts too: whole free chunks of it beyond that budget
 * are unmapped (holes, carved.h), after whole idle extents and cached buffers. */
#define TIDY_SLACK 16

/* Free bytes inside the device's extents beside live blocks (a hint): what holes could take. */
static size_t free_inside_extents(hdev_t *h)
{
    size_t free_bytes = 0, whole = 0;
    FOR_EACH_PART(h, p)
    {
        free_bytes += vmh_carved_free_hint(&p->carved);
        whole += vmh_carved_idle_bytes(&p->carved);
    }
    return free_bytes > whole ? free_bytes - whole : 0;
}

/* The lower of the device's live bytes now and `low` (see vmh_hdev_tidy). */
static size_t live_bytes(vmh_dev_t *d, size_t low)
{
    size_t live = atomic_load_explicit(&d->live_usable, memory_order_relaxed);
    return live < low ? live : low;
}

/* Idle bytes the recent peak may need again, with the slack. */
static size_t keep_bytes(size_t peak, size_t live)
{
    return (peak > live ? peak - live : 0) + peak / TIDY_SLACK;
}

void vmh_hdev_tidy(vmh_dev_t *d)
{
    hdev_t *h = hdev_of(d);
    if (!heap_running() || vmh_trylock(&h->tidy_lock, VMH_RANK_TIDY) != 0)
        return;
    uint64_t now = vmh_now_ns();
    if (now - h->tidy_ns < VMH_TIDY_EVERY_NS) {
        vmh_unlock(&h->tidy_lock);
        return;
    }
    h->tidy_ns = now;
    size_t peak = vmh_dev_usable_peak(d);
    bool new_window = now - h->window_ns >= VMH_TIDY_WINDOW_NS;
    if (new_window) {
        h->window_ns = now;
        h->peak_before = peak;
        vmh_dev_usable_peak_reset(d);
    }
    if (h->peak_before > peak)
        peak = h->peak_before;
    /* Live and idle bytes are read apart while the program allocates and frees: a free
     * released at once between the two reads would count its bytes live and idle both, an
     * allocation the other way round. The lower of the live bytes read before and after the
     * idle ones keeps either from making a steady program's memory look like excess. */
    size_t live = live_bytes(d, SIZE_MAX);
#ifdef VMH_TESTING
    if (vmh_heap_test_in_tidy_reads)
        vmh_heap_test_in_tidy_reads();
#endif
    size_t idle = vmh_heap_idle_bytes(d->ordinal);
    size_t inside = new_window ? free_inside_extents(h) : 0;
    live = live_bytes(d, live);
    if (idle + inside > keep_bytes(peak, live) + d->gran &&
        vmh_reclaim_pass(&h->reclaim, VMH_WAIT_BACKGROUND) == CUDA_SUCCESS) {
        /* Memory freed at once may still be touched by queued work: passed first (above). The
         * pass freed the blocks parked up to it: what lies inside extents is counted again. */
        if (new_window)
            inside = free_inside_extents(h);
        live = live_bytes(d, live);
        size_t keep = keep_bytes(peak, live);
        size_t excess = idle + inside > keep ? idle + inside - keep : 0;
        size_t given = vmh_cache_trim_upto(&h->cache, excess);
        FOR_EACH_PART(h, p)
        if (given < excess)
            given += vmh_carved_trim_upto(&p->carved, excess - given);
        FOR_EACH_PART(h, p)
        if (new_window && given < excess)
            given += vmh_carved_punch_upto(&p->carved, excess - given);
        if (given)
            vmh_count(VMH_STAT_tidy_bytes, given);
    }
    vmh_unlock(&h->tidy_lock);
}

#ifdef VMH_TESTING
void (*vmh_heap_test_after_drain)(void);
void (*vmh_heap_test_in_tidy_reads)(void);

void vmh_heap_tidy_now(int device, bool new_window)
{
    hdev_t *h = hdev_at(device);
    assert(h);
    vmh_lock(&h->tidy_lock, VMH_RANK_TIDY);
    h->tidy_ns -= VMH_TIDY_EVERY_NS;
    if (new_window)
        h->window_ns -= VMH_TIDY_WINDOW_NS;
    vmh_unlock(&h->tidy_lock);
    vmh_hdev_tidy(&h->dev);
}
#endif

size_t vmh_heap_trim(void)
{
    if (heap_in_child())
        return 0;
    size_t bytes = 0;
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = hdev_at(i);
        if (!h || h->dev.unsupported)
            continue;
        /* Not beside the reclaim thread's tidy of the device: a tidy in progress (its wait
         * begun before the last frees, extents it took and is unmapping) finishes first, so
         * that what a trim returns is all the device held idle. */
        vmh_lock(&h->tidy_lock, VMH_RANK_TIDY);
        vmh_reclaim_drain(&h->reclaim); /* not during a capture (reclaim.h) */
#ifdef VMH_TESTING
        if (vmh_heap_test_after_drain)
            vmh_heap_test_after_drain();
#endif
        size_t b = idle_give_back(h);
        vmh_unlock(&h->tidy_lock);
        if (b)
            vmh_count(VMH_STAT_trims, 1);
        bytes += b;
    }
    /* Now that idle memory is unmapped, other layers may let go of chunks only they still
     * hold (ipc.c: exports of freed buffers). */
    vmh_pressure_fn hook = atomic_load(&pressure_hook);
    if (hook)
        hook();
    return bytes;
}

void vmh_heap_trim_paused(void)
{
    if (heap_in_child())
        return;
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = hdev_at(i);
        if (!h || h->dev.unsupported)
            continue;
        FOR_EACH_PART(h, p)
        vmh_carved_trim_paused(&p->carved);
    }
}

/* ---- spilled memory back to the device ---------------------------------------------------- */

/* What a prefetch does first: no work of the program may touch what moves (its contract), and
 * none submitted before may still be running; then idle memory makes room, and the library's
 * stream for the copies is made (in the current context: the device's). */
static CUresult prefetch_prepare(hdev_t *h, CUstream *stream)
{
    CUresult rc = vmh_ctx_sync_device(h->dev.ordinal);
    if (rc != CUDA_SUCCESS)
        return rc;
    (void)vmh_hdev_relieve(&h->dev);
    return vmh_drv.cuStreamCreate(stream, CU_STREAM_NON_BLOCKING);
}

CUresult vmh_heap_prefetch(CUdeviceptr p, size_t *moved)
{
    *moved = 0;
    if (heap_in_child() || !heap_running())
        return CUDA_ERROR_NOT_FOUND;
    vmh_buffer_info_t info;
    const vmh_owner_t *seen = vmh_registry_get(p);
    if (!seen || !seen->lock || !vmh_heap_find(p, &info))
        return CUDA_ERROR_NOT_FOUND; /* not a live served buffer */
    if (!ops_of(seen)->prefetch)
        return CUDA_SUCCESS; /* carved memory never spills */
    hdev_t *h;
    CUresult rc = vmh_hdev_current(&h);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (&h->dev != seen->dev)
        return CUDA_ERROR_INVALID_DEVICE; /* the copy runs in the current context */
    CUstream stream;
    if ((rc = prefetch_prepare(h, &stream)) != CUDA_SUCCESS)
        return rc;
    vmh_owner_t *o = vmh_owner_lock(p);
    if (!o)
        rc = CUDA_ERROR_NOT_FOUND; /* freed meanwhile */
    else if (!ops_of(o)->prefetch)
        vmh_owner_unlock(o); /* freed and carved meanwhile */
    else
        rc = ops_of(o)->prefetch(o, p, stream, moved); /* unlocks */
    (void)vmh_drv.cuStreamDestroy(stream);
    return rc;
}

CUresult vmh_heap_prefetch_tag(unsigned tag, size_t *moved)
{
    *moved = 0;
    if (heap_in_child() || !heap_running())
        return CUDA_SUCCESS;
    hdev_t *h;
    CUresult rc = vmh_hdev_current(&h);
    if (rc != CUDA_SUCCESS)
        return rc;
    tagpart_t *p =
        tag < VMM_TAGS_MAX ? atomic_load_explicit(&h->part[tag], memory_order_acquire) : NULL;
    if (!p || !vmh_overflow_bytes(&h->overflow))
        return CUDA_SUCCESS;
    CUstream stream;
    if ((rc = prefetch_prepare(h, &stream)) != CUDA_SUCCESS)
        return rc;
    rc = vmh_ownchunk_prefetch_all(&p->own, stream, moved);
    (void)vmh_drv.cuStreamDestroy(stream);
    return rc;
}
