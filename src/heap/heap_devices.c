/* Layer "heap front", its per-GPU records (heap_internal.h's hdev_t): one per device, made at
 * the device's first mention, its heap set up at the device's first allocation, each with a part
 * per tag made at the tag's first allocation there; the exit's leak report and the tests' reset
 * (the front's mode is the process's phase, phase.h); the tags' parts as pause.c sees them. The
 * entry points that route allocations and pointers are in heap.c, what gives idle memory back
 * in heap_upkeep.c.
 *
 * Records and parts are never freed while the process runs (only the tests' reset frees them),
 * so a reader that loaded one may use it without a lock.
 */
#include "heap_internal.h"

#include "clock.h"
#include "contexts.h"
#include "driver.h"
#include "overflow.h"
#include "report.h"
#include "tags.h"
#include "witness.h"

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

vmh_heap_settings_t vmh_heap_settings;
_Atomic(hdev_t *) vmh_heap_devs[VMH_MAX_DEVICES];

/* Guards making tag parts and freezing them (vmh_heap_tag_freeze). */
static pthread_mutex_t parts_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t devs_lock = PTHREAD_MUTEX_INITIALIZER;

void vmh_heap_configure(const vmh_heap_settings_t *s)
{
    vmh_heap_settings = *s;
}

hdev_t *vmh_hdev_record(int i)
{
    /* Made without a lock, so that any thread may ask at any time (a forked child, whose locks
     * may be held by threads that are gone, too): of two made at once, the first published
     * stays. */
    hdev_t *h = atomic_load_explicit(&vmh_heap_devs[i], memory_order_acquire);
    if (h)
        return h;
    hdev_t *made = calloc(1, sizeof *made);
    if (!made)
        return NULL;
    if (atomic_compare_exchange_strong_explicit(&vmh_heap_devs[i], &h, made, memory_order_acq_rel,
                                                memory_order_acquire))
        return made;
    free(made);
    return h;
}

/* Undoes hdev_setup, leaving the heap's parts as the record's making left them (zero). */
static void hdev_teardown(hdev_t *h)
{
    vmh_reclaim_release_all(&h->reclaim);
    FOR_EACH_PART(h, p)
    {
        vmh_ownchunk_destroy(&p->own);
        vmh_carved_destroy(&p->carved);
        free(p);
    }
    vmh_cache_destroy(&h->cache);
    vmh_reclaim_destroy(&h->reclaim);
    pthread_mutex_destroy(&h->tidy_lock);
    memset(&h->dev, 0, sizeof *h - offsetof(hdev_t, dev));
}

/* Sets up the heap's parts of a record (devs_lock held); on failure they stay as they were. */
static CUresult hdev_setup(hdev_t *h, int ordinal, CUcontext ctx)
{
    h->dev.grants = &h->grants;
    h->dev.relieve = vmh_hdev_relieve;
    h->dev.tidy = vmh_hdev_tidy;
    pthread_mutex_init(&h->tidy_lock, NULL);
    h->window_ns = h->tidy_ns = vmh_now_ns();
    CUresult rc = vmh_dev_setup(&h->dev, ordinal, ctx);
    vmh_ctx_seen(ctx, ordinal); /* waited for with the device's other contexts (contexts.h) */
    vmh_reclaim_init(&h->reclaim, &h->dev);
    vmh_cache_init(&h->cache, &h->dev);
    vmh_overflow_init(&h->overflow, &h->dev);
    if (rc != CUDA_SUCCESS)
        hdev_teardown(h);
    return rc;
}

CUresult vmh_hdev_get(int ordinal, CUcontext ctx, hdev_t **out)
{
    if (ordinal < 0 || ordinal >= VMH_MAX_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    hdev_t *h = hdev_at(ordinal);
    CUresult rc = CUDA_SUCCESS;
    if (!h) {
        hdev_t *rec = vmh_hdev_record(ordinal);
        if (!rec)
            return CUDA_ERROR_OUT_OF_MEMORY;
        vmh_lock(&devs_lock, VMH_RANK_DEVICES);
        if (!atomic_load_explicit(&rec->ready, memory_order_relaxed)) {
            rc = hdev_setup(rec, ordinal, ctx);
            if (rc == CUDA_SUCCESS)
                atomic_store_explicit(&rec->ready, true, memory_order_release);
        }
        vmh_unlock(&devs_lock);
        h = rc == CUDA_SUCCESS ? rec : NULL;
    }
    *out = h;
    if (rc == CUDA_SUCCESS && h->dev.unsupported)
        return CUDA_ERROR_NOT_SUPPORTED;
    return rc;
}

CUresult vmh_hdev_current(hdev_t **out)
{
    CUcontext ctx = NULL;
    int dev;
    CUresult rc = vmh_ctx_current(&ctx, &dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    return vmh_hdev_get(dev, ctx, out);
}

/* A part made while its tag is not running starts frozen: made and frozen under parts_lock, which
 * vmh_heap_tag_freeze takes too, so that a pause never misses a part. */
tagpart_t *vmh_hdev_part(hdev_t *h, unsigned tag)
{
    assert(tag < VMM_TAGS_MAX);
    tagpart_t *p = atomic_load_explicit(&h->part[tag], memory_order_acquire);
    if (p)
        return p;
    vmh_lock(&parts_lock, VMH_RANK_PARTS);
    p = atomic_load_explicit(&h->part[tag], memory_order_acquire);
    if (!p && (p = calloc(1, sizeof *p))) {
        p->tag = tag;
        vmh_ownchunk_init(&p->own, &h->dev, &h->reclaim, &h->cache, &h->overflow);
        if (vmh_carved_init(&p->carved, &h->dev, &h->reclaim) != CUDA_SUCCESS) {
            vmh_carved_destroy(&p->carved);
            vmh_ownchunk_destroy(&p->own);
            free(p);
            p = NULL;
        } else {
            bool frozen = !vmh_tag_running(tag);
            atomic_store(&p->own.frozen, frozen);
            atomic_store(&p->carved.frozen, frozen);
            atomic_store_explicit(&h->part[tag], p, memory_order_release);
        }
    }
    vmh_unlock(&parts_lock);
    return p;
}

static void report_own_leak(CUdeviceptr base, size_t size, void *site, void *arg)
{
    vmh_leak_report_one(base, size, *(int *)arg, site);
}

static void report_carved_leak(const vmh_block_info_t *b, void *arg)
{
    vmh_leak_report_one(b->base, b->size, *(int *)arg, NULL);
}

void vmh_heap_shutdown(bool report_leaks)
{
    /* No driver call after this returns: the driver may be torn down next (the phase is
     * EXITED already: no thread starts again). */
    vmh_reclaim_stop();
    if (!report_leaks)
        return;
    vmh_leak_report_begin();
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = hdev_at(i);
        if (!h || h->dev.unsupported)
            continue;
        FOR_EACH_PART(h, p)
        {
            vmh_ownchunk_for_each_live(&p->own, report_own_leak, &i);
            vmh_carved_for_each_live(&p->carved, report_carved_leak, &i);
        }
    }
    vmh_leak_report_end();
}

/* ---- idle memory, and which allocations spill ------------------------------------------- */

size_t vmh_heap_idle_bytes(int device)
{
    if (device < 0 || device >= VMH_MAX_DEVICES || heap_in_child())
        return 0;
    hdev_t *h = hdev_at(device);
    if (!h || h->dev.unsupported)
        return 0;
    size_t idle = vmh_cache_bytes(&h->cache);
    FOR_EACH_PART(h, p)
    idle += vmh_ownchunk_parked_bytes(&p->own) + vmh_carved_idle_bytes(&p->carved);
    return idle;
}

size_t vmh_heap_reclaimable_bytes(int device)
{
    size_t bytes = vmh_heap_idle_bytes(device);
    if (device < 0 || device >= VMH_MAX_DEVICES || heap_in_child())
        return bytes;
    hdev_t *h = hdev_at(device);
    if (!h || h->dev.unsupported)
        return bytes;
    FOR_EACH_PART(h, p)
    bytes += vmh_carved_hole_bytes(&p->carved);
    return bytes;
}

bool vmh_hdev_spill_first(hdev_t *h, size_t size)
{
    size_t reserve = vmh_overflow_reserve(&h->overflow);
    /* Not during a stream capture: the library asks the driver nothing it need not then
     * (captures.c); the device then spills only what it refuses. */
    if (!reserve || vmh_overflow_is_small(&h->overflow, size) || vmh_capture_any())
        return false;
    /* The driver's free memory of the device (memory of other allocators and processes is
     * gone from it too), plus what this library holds idle there, which serves it first. */
    vmh_ctx_scope_t scope;
    size_t free_bytes = 0, total = 0;
    if (vmh_ctx_enter_device(h->dev.ordinal, &scope) != CUDA_SUCCESS)
        return false;
    CUresult rc = vmh_drv.cuMemGetInfo(&free_bytes, &total);
    (void)vmh_ctx_leave(&scope);
    if (rc != CUDA_SUCCESS || free_bytes >= reserve + size)
        return false;
    return free_bytes + vmh_heap_reclaimable_bytes(h->dev.ordinal) < reserve + size;
}

/* ---- statistics ---------------------------------------------------------------------------- */

void vmh_heap_stats_devices(vmh_jbuf_t *b)
{
    bool first = true;
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = hdev_at(i);
        if (!h || h->dev.unsupported)
            continue;
        vmh_jb_printf(b,
                      "%s\"%d\": {\"bytes_spilled\": %zu, \"spills\": %llu, "
                      "\"spills_small\": %llu}",
                      first ? "" : ", ", i, vmh_overflow_bytes(&h->overflow),
                      (unsigned long long)atomic_load(&h->spills),
                      (unsigned long long)atomic_load(&h->spills_small));
        first = false;
    }
}

#ifdef VMH_TESTING
size_t vmh_heap_spilled_bytes(int device)
{
    hdev_t *h = device >= 0 && device < VMH_MAX_DEVICES ? hdev_at(device) : NULL;
    return h ? vmh_overflow_bytes(&h->overflow) : 0;
}
#endif

/* ---- tags (pause.c) ------------------------------------------------------------------------- */

/* The part of tag on device (and its device in *h), or NULL when the device has none of its
 * memory. Also after exit: the exit report counts the tags' memory (vmm_pause refuses by then). */
static tagpart_t *tag_part(int device, unsigned tag, hdev_t **h)
{
    if (device < 0 || device >= VMH_MAX_DEVICES || tag >= VMM_TAGS_MAX || heap_in_child())
        return NULL;
    *h = hdev_at(device);
    return *h ? atomic_load_explicit(&(*h)->part[tag], memory_order_acquire) : NULL;
}

bool vmh_heap_tag_parts(int device, unsigned tag, vmh_tag_parts_t *out)
{
    hdev_t *h;
    if (!tag_part(device, tag, &h))
        return false;
    *out = (vmh_tag_parts_t){&h->dev, &h->reclaim, &h->overflow};
    return true;
}

CUresult vmh_heap_visit_tag(int device, unsigned tag, vmh_visit_run_fn fn, void *arg)
{
    hdev_t *h;
    tagpart_t *p = tag_part(device, tag, &h);
    if (!p)
        return CUDA_SUCCESS;
    CUresult rc = CUDA_SUCCESS;
    /* The kinds in the table's order: own-chunk buffers, then the carved shards (heap.h). */
    for (const owner_ops_t *ops = vmh_heap_owner_ops;
         rc == CUDA_SUCCESS && ops < vmh_heap_owner_ops + OWNER_KINDS; ops++)
        if (ops->visit)
            rc = ops->visit(p, fn, arg);
    return rc;
}

void vmh_heap_tag_freeze(unsigned tag, bool frozen)
{
    vmh_lock(&parts_lock, VMH_RANK_PARTS);
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = hdev_at(i);
        tagpart_t *p = h ? atomic_load_explicit(&h->part[tag], memory_order_acquire) : NULL;
        if (p) {
            atomic_store(&p->own.frozen, frozen);
            atomic_store(&p->carved.frozen, frozen);
        }
    }
    vmh_unlock(&parts_lock);
}

void vmh_heap_reset(void)
{
    vmh_reclaim_stop(); /* its waits use the queues destroyed here */
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = atomic_exchange(&vmh_heap_devs[i], NULL);
        if (h && atomic_load(&h->ready))
            hdev_teardown(h);
        free(h); /* its grants and primary context with it */
    }
}
