/* Layer "heap front", its entry points: routes each call to the layer that owns it (see heap.h).
 * Picks a device and a tag's part, a carved buffer or one of its own by size, serves, frees,
 * resizes, finds and exports by a pointer's owner (through its kind's operations, heap_owners.c),
 * and traces each event.
 *
 * What owns what (docs/DESIGN.md has the diagram):
 *   heap.c (this file)  the entry points: picks a device, picks a carved buffer or one of its own
 *                       by size, finds a pointer's owner and hands it on
 *   heap_devices.c      the per-GPU records: one per device, a part per tag, the front's mode
 *   heap_upkeep.c       idle memory given back (relieve, tidy, trim), spilled memory brought home
 *   heap_owners.c       the kinds of owner as one table (ops_of): the one place that tells a
 *                       carved buffer from one with chunks of its own
 *   ownchunk.c          buffers with their own chunks: make, grow, shrink, move, park
 *   carved.c            buffers carved from shared extents (shards over arena.c)
 *   cache.c             idle ranges kept for reuse
 *   reclaim.c           parked frees: released once the GPU has passed them
 *   device.c            each device's shape, usable bytes, owner records and their locks
 * Owners (own-chunk buffers, extents) are recycled per device and never freed while the process
 * runs, which is what lets registry readers go without a lock (registry.h).
 *
 * Lock order: witness.h's ranks (checked in debug and sanitizer builds). Nothing waits for the
 * GPU with a lock of the heap held; no driver call is made under the owners', cache's or
 * reclaim's queue locks.
 */
#include "heap_internal.h"

#include "contexts.h"
#include "driver.h"
#include "overflow.h"
#include "registry.h"
#include "stats.h"
#include "tags.h"

#include <assert.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PITCH_ALIGN 512 /* the alignment of the pitches native cudaMallocPitch gives */

/* ---- allocation ---------------------------------------------------------------------------- */

/* Small requests are packed; buffers that may grow (vmm_realloc) only when below half a chunk:
 * a buffer of its own grows in place or by remapping, a carved one by a copy. */
static size_t pack_below(const hdev_t *h, bool growable)
{
    size_t below = vmh_heap_settings.pack_below;
    if (growable && below > h->dev.gran / 2)
        below = h->dev.gran / 2;
    return below;
}

/* Serves `size` bytes from host memory (overflow.h), counted. */
static CUresult spill_on(hdev_t *h, tagpart_t *p, size_t size, void *site, CUdeviceptr *out)
{
    CUresult rc = vmh_ownchunk_alloc_spilled(&p->own, size, site, out);
    if (rc == CUDA_SUCCESS) {
        vmh_count(VMH_STAT_spills, 1);
        atomic_fetch_add_explicit(&h->spills, 1, memory_order_relaxed);
        if (vmh_overflow_is_small(&h->overflow, size)) {
            vmh_count(VMH_STAT_spills_small, 1);
            atomic_fetch_add_explicit(&h->spills_small, 1, memory_order_relaxed);
        }
    }
    return rc;
}

static CUresult alloc_on(hdev_t *h, unsigned tag, size_t size, bool growable, void *site,
                         CUdeviceptr *out, bool *no_address)
{
    assert(heap_running() && size > 0);
    if (__builtin_expect(vmh_work_split_wait_pending(), 0))
        vmh_work_split_wait(); /* a second context seen here: before anything is reused */
    tagpart_t *p = vmh_hdev_part(h, tag);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* Host memory, when allowed, not for a paused tag (it takes no memory): first for a big
     * request that would eat into the device's reserve for small ones (overflow.h), else once
     * the device refused after its wait, release and trim, and addresses remain. */
    bool spill = __builtin_expect(vmh_overflow_enabled(), 0) && vmh_tag_running(tag);
    bool big_first = spill && vmh_hdev_spill_first(h, size);
    CUresult rc = big_first ? spill_on(h, p, size, site, out) : CUDA_ERROR_OUT_OF_MEMORY;
    if (rc != CUDA_SUCCESS)
        rc = size < pack_below(h, growable)
                 ? vmh_carved_alloc(&p->carved, size, out, no_address)
                 : vmh_ownchunk_alloc(&p->own, size, growable, site, out, no_address);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && !*no_address && spill && !big_first)
        rc = spill_on(h, p, size, site, out);
    if (rc == CUDA_SUCCESS) {
        vmh_count(VMH_STAT_served_allocs, 1);
        vmh_tag_requested_add(tag, (int64_t)size);
    }
    return rc;
}

/* The tag of the part an owner (locked or not: parts never change) belongs to. */
static unsigned owner_tag(const vmh_owner_t *o)
{
    return ops_of(o)->part(o)->tag;
}

/* What both allocation entry points share: the checks before a device is chosen, and serving
 * on it (rc: how choosing the device went) with the trace line either way. */
static CUresult request_check(size_t size, const CUdeviceptr *out)
{
    if (!heap_running())
        return CUDA_ERROR_NOT_SUPPORTED;
    return !out || size == 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

static CUresult serve_traced(hdev_t *h, CUresult rc, size_t size, void *site, CUdeviceptr *out)
{
    bool no_address = false; /* a refusal before any reservation (a paused tag) leaves it */
    if (rc == CUDA_SUCCESS &&
        (rc = alloc_on(h, vmh_tag_current(), size, false, site, out, &no_address)) != CUDA_SUCCESS)
        vmh_dev_alloc_failed(&h->dev, size, rc, no_address); /* VMMHOOK_VERBOSE: why */
    vmh_trace(rc == CUDA_SUCCESS ? "allocate" : "allocate failure", rc == CUDA_SUCCESS ? *out : 0,
              size, NULL);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) /* after the retry that relieves: the program's OOM */
        vmh_count(VMH_STAT_ooms, 1);
    return rc;
}

CUresult vmh_heap_alloc_at(size_t size, void *site, CUdeviceptr *out)
{
    CUresult rc = request_check(size, out);
    if (rc != CUDA_SUCCESS)
        return rc;
    hdev_t *h;
    rc = vmh_hdev_current(&h);
    if (rc != CUDA_SUCCESS)
        return rc;
    return serve_traced(h, rc, size, site, out);
}

CUresult vmh_heap_alloc_on(int device, size_t size, CUdeviceptr *out)
{
    CUresult rc = request_check(size, out);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (device < 0 || device >= VMH_MAX_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    hdev_t *h = hdev_at(device);
    if (!h) {
        /* The device's state needs a context to wait on later: the current one when it is
         * this device's, else the device's primary context (kept retained). */
        CUcontext ctx = NULL;
        rc = vmh_ctx_of_device(device, &ctx);
        if (rc == CUDA_SUCCESS)
            rc = vmh_hdev_get(device, ctx, &h);
    } else if (h->dev.unsupported) {
        rc = CUDA_ERROR_NOT_SUPPORTED;
    }
    return serve_traced(h, rc, size, NULL, out);
}

CUresult vmh_heap_alloc_pitch(size_t width, size_t height, unsigned int elem, void *site,
                              CUdeviceptr *out, size_t *pitch)
{
    if (!out || !pitch || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t p;
    if (!vmh_round_up(width, PITCH_ALIGN, &p) || height > SIZE_MAX / p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = vmh_heap_alloc_at(p * height, site, out);
    if (rc == CUDA_SUCCESS)
        *pitch = p;
    return rc;
}

/* ---- pointers ------------------------------------------------------------------------------ */

/* The owner of p, locked; NULL when p is not served, or in a forked child (the parent's threads
 * that may have held the owners' locks are gone there). */
static vmh_owner_t *owner_lock(CUdeviceptr p)
{
    return heap_in_child() ? NULL : vmh_owner_lock(p);
}

/* Whether memory a buffer gives up now (a free, a shrink's tail) may be reused at once: the
 * program's work runs in one queue (contexts.h: the note, then the look, in that order, so
 * that the rule's end covers this free); otherwise it waits until the GPU has passed it. */
static bool freed_reusable_at_once(void)
{
    return vmh_heap_settings.stream_ordered && (vmh_work_note_reuse(), vmh_work_in_one_queue());
}

CUresult vmh_heap_free(CUdeviceptr p, CUstream stream, bool async)
{
    if (heap_in_child())
        return CUDA_ERROR_NOT_FOUND; /* the driver answers as it does natively; no lock */
    if (heap_running() && vmh_registry_get(p)) {
        /* The freeing thread's context may have used the buffer: known from now on (no driver
         * call in steady state, and none under the owner's lock), so that the wait before
         * reuse covers it even when no interposed call reported it. */
        CUcontext cur;
        int cur_dev;
        (void)vmh_ctx_current(&cur, &cur_dev);
    }
    vmh_owner_t *o = vmh_owner_lock(p);
    if (!o)
        return CUDA_ERROR_NOT_FOUND;
    if (!heap_running()) {
        /* Late frees from other destructors: the driver may be gone; forget quietly. */
        vmh_owner_unlock(o);
        return CUDA_SUCCESS;
    }
    const owner_ops_t *ops = ops_of(o); /* a served buffer's owner (asserted there) */
    assert(o->dev && hdev_of(o->dev)->dev.ordinal == o->dev->ordinal);
    size_t req = 0;
    bool at_once = freed_reusable_at_once();
    vmh_paused_t *gone = NULL;
    vmh_reclaim_free_begin(); /* the reclaim thread woken, if at all, at the end */
    CUresult rc = ops->park(o, p, at_once, &req, &gone);
    vmh_owner_unlock(o);
    vmh_paused_destroy(gone); /* a paused buffer's addresses: no driver call under the lock */
    vmh_reclaim_t *r = &hdev_of(o->dev)->reclaim;
    if (rc != CUDA_SUCCESS) {
        vmh_reclaim_free_end(r, 0, VMH_FREE_NO_WAIT);
        return rc;
    }
    vmh_count(VMH_STAT_served_frees, 1);
    vmh_tag_requested_add(owner_tag(o), -(int64_t)req);
    vmh_trace("free", p, req, stream);
    /* Natively cudaFree waits for the device; here the reclaim thread does, unless the program
     * asked for native blocking frees (DESIGN.md, "Frees"), or one buffer larger than the park
     * budget was freed (it waits, as cudaFree). */
    vmh_free_wait_t how = VMH_FREE_NO_WAIT;
    if (vmh_heap_settings.free_sync && !async)
        how = VMH_FREE_WAIT;
    else if (!async && !(at_once && ops->reuse_at_once) && !vmh_capture_any())
        how = VMH_FREE_THROTTLE;
    vmh_reclaim_free_end(r, req, how);
    return CUDA_SUCCESS;
}

bool vmh_heap_holds(CUdeviceptr p)
{
    return !heap_in_child() && vmh_registry_get(p) != NULL;
}

bool vmh_heap_find(CUdeviceptr p, vmh_buffer_info_t *info)
{
    vmh_owner_t *o = owner_lock(p);
    if (!o)
        return false;
    bool found = ops_of(o)->find(o, p, info);
    vmh_owner_unlock(o);
    return found;
}

/* dst NULL: no copy, the address only. */
static const void *backup_at(CUdeviceptr p, size_t n, void *dst)
{
    vmh_owner_t *o = owner_lock(p);
    if (!o)
        return NULL;
    const void *host = ops_of(o)->backup(o, p, n);
    if (host && dst)
        memcpy(dst, host, n); /* under the lock: a free or a resume cannot take it meanwhile */
    vmh_owner_unlock(o);
    return host;
}

bool vmh_heap_backup_read(CUdeviceptr p, size_t n, void *dst)
{
    return backup_at(p, n, dst) != NULL;
}

const void *vmh_heap_backup_host(CUdeviceptr p, size_t n)
{
    return backup_at(p, n, NULL);
}

/* ---- realloc ------------------------------------------------------------------------------- */

/* The trace sees a resize as RMM's log would show it: the old buffer freed, the new one
 * allocated (same address when in place), so that a replay of the log stays consistent. */
static void trace_resize(CUdeviceptr old, size_t old_size, CUdeviceptr now, size_t size,
                         CUstream stream)
{
    vmh_trace("free", old, old_size, stream);
    vmh_trace("allocate", now, size, stream);
}

/* A carved buffer that outgrows its block, or a size change across the packing threshold:
 * a new buffer and one device copy. */
static CUresult realloc_by_copy(hdev_t *h, unsigned tag, CUdeviceptr *p, size_t old_size,
                                size_t size, CUstream stream, bool async, bool *no_address)
{
    CUdeviceptr np;
    CUresult rc = alloc_on(h, tag, size, true, NULL, &np, no_address); /* the buffer's tag */
    if (rc != CUDA_SUCCESS) {
        vmh_trace("allocate failure", 0, size, stream);
        return rc;
    }
    size_t n = old_size < size ? old_size : size;
    if (async) {
        rc = vmh_drv.cuMemcpyDtoDAsync(np, *p, n, stream);
    } else {
        /* Work on any stream may still write the old buffer: wait for it, as cudaFree
         * would, then copy. */
        rc = vmh_reclaim_wait(&h->reclaim, VMH_WAIT_APP);
        if (rc == CUDA_SUCCESS)
            rc = vmh_drv.cuMemcpyDtoD(np, *p, n);
        /* A device-to-device copy does not wait for itself, even through this "synchronous"
         * call; the program may read the new buffer through a stream that does not wait for
         * the legacy one. Natively the old buffer's cudaFree would wait: so does this. */
        if (rc == CUDA_SUCCESS)
            rc = vmh_reclaim_wait(&h->reclaim, VMH_WAIT_APP);
    }
    if (rc != CUDA_SUCCESS) {
        vmh_heap_free(np, stream, async);
        return rc;
    }
    vmh_count(VMH_STAT_copies, 1);
    vmh_trace("allocate", np, size, stream);
    vmh_heap_free(*p, stream, async); /* traced as a free */
    *p = np;
    return CUDA_SUCCESS;
}

/* A buffer of a kind the heap resizes (ops: a carved one): in place when it stays small and the
 * following space allows, else by copy. */
static CUresult realloc_in_heap(const owner_ops_t *ops, CUdeviceptr *p, size_t size,
                                CUstream stream, bool async, bool *no_address)
{
    vmh_owner_t *o = vmh_owner_lock(*p);
    if (!o || ops_of(o) != ops) {
        if (o)
            vmh_owner_unlock(o);
        return CUDA_ERROR_NOT_FOUND; /* freed meanwhile */
    }
    hdev_t *h = hdev_of(o->dev);
    vmh_buffer_info_t info;
    if (!ops->find(o, *p, &info)) {
        vmh_owner_unlock(o);
        return CUDA_ERROR_NOT_FOUND; /* freed (or never served): not a live buffer */
    }
    if (info.base != *p) {
        vmh_owner_unlock(o);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (ops->paused(o)) {
        vmh_owner_unlock(o);
        return CUDA_ERROR_NOT_PERMITTED; /* untouched until its tag is resumed */
    }
    size_t old_size = info.size;
    /* A shrink stays in place (vmmhook.h: it keeps the pointer), a growth while small. */
    if ((size <= info.size || size < pack_below(h, true)) &&
        ops->resize(o, *p, size, size < info.size && freed_reusable_at_once(), &old_size) ==
            CUDA_SUCCESS) {
        vmh_owner_unlock(o);
        vmh_tag_requested_add(owner_tag(o), (int64_t)size - (int64_t)old_size);
        trace_resize(*p, old_size, *p, size, stream);
        return CUDA_SUCCESS;
    }
    vmh_owner_unlock(o);
    return realloc_by_copy(h, owner_tag(o), p, old_size, size, stream, async, no_address);
}

CUresult vmh_heap_realloc_ex(CUdeviceptr *p, size_t size, CUstream stream, bool async,
                             bool *no_address)
{
    bool ignored;
    if (!no_address)
        no_address = &ignored;
    *no_address = false;
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    if (!heap_running())
        return CUDA_ERROR_NOT_SUPPORTED;
    if (*p == 0) {
        if (size == 0)
            return CUDA_SUCCESS;
        hdev_t *h;
        CUresult rc = vmh_hdev_current(&h);
        if (rc != CUDA_SUCCESS)
            return rc;
        rc = alloc_on(h, vmh_tag_current(), size, true, NULL, p, no_address);
        vmh_trace(rc == CUDA_SUCCESS ? "allocate" : "allocate failure", rc == CUDA_SUCCESS ? *p : 0,
                  size, stream);
        return rc;
    }
    if (size == 0) {
        CUresult rc = vmh_heap_free(*p, stream, async);
        if (rc == CUDA_SUCCESS)
            *p = 0;
        return rc;
    }
    const vmh_owner_t *o = vmh_registry_get(*p);
    if (!o || !o->lock)
        return CUDA_ERROR_NOT_FOUND;
    const owner_ops_t *ops = ops_of(o);
    if (!ops->realloc)
        return realloc_in_heap(ops, p, size, stream, async, no_address);
    CUdeviceptr old = *p;
    size_t old_size = 0;
    unsigned tag = owner_tag(o); /* the record stays the buffer's through a move */
    CUresult rc = ops->realloc(p, size, async, &old_size, no_address);
    if (rc == CUDA_SUCCESS) {
        vmh_tag_requested_add(tag, (int64_t)size - (int64_t)old_size);
        trace_resize(old, old_size, *p, size, stream);
    } else if (rc == CUDA_ERROR_OUT_OF_MEMORY)
        vmh_trace("allocate failure", 0, size, stream);
    return rc;
}

/* ---- sharing ------------------------------------------------------------------------------- */

CUresult vmh_heap_export(CUdeviceptr p, vmh_export_t *out)
{
    vmh_owner_t *o = owner_lock(p);
    if (!o)
        return CUDA_ERROR_NOT_FOUND;
    memset(out, 0, sizeof *out);
    const vmh_range_t *r = NULL;
    CUresult rc = ops_of(o)->export(o, p, out, &r);
    if (rc == CUDA_SUCCESS) {
        out->chunks = malloc(r->nmaps * sizeof *out->chunks);
        if (!out->chunks) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            for (size_t i = 0; i < r->nmaps; i++)
                out->chunks[i] = vmh_alloc_ref(r->maps[i]->alloc);
            out->nchunks = r->nmaps;
            out->device = o->dev->ordinal;
        }
    }
    vmh_owner_unlock(o);
    return rc;
}

bool vmh_heap_export_alive(CUdeviceptr base, uint64_t serial)
{
    vmh_owner_t *o = owner_lock(base);
    if (!o)
        return false;
    bool alive = ops_of(o)->export_alive(o, base, serial);
    vmh_owner_unlock(o);
    return alive;
}

void vmh_heap_export_release(vmh_export_t *ex)
{
    for (size_t i = 0; i < ex->nchunks; i++)
        vmh_alloc_unref(ex->chunks[i]);
    free(ex->chunks);
    memset(ex, 0, sizeof *ex);
}

CUresult vmh_heap_set_peer_access(int owner, int peer, bool grant)
{
    if (heap_in_child())
        return CUDA_SUCCESS;
    /* A peer's kernels run in the peer's queue, not in the owner's: memory of the owner may be
     * touched from two queues now (contexts.h). The wait, if anything was reused early, comes
     * at the next allocation. */
    if (grant)
        vmh_work_queue_split("peer access enabled");
    if (owner < 0 || owner >= VMH_MAX_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    hdev_t *h = vmh_hdev_record(owner);
    return h ? vmh_access_set_peer(&h->grants, owner, peer, grant) : CUDA_ERROR_OUT_OF_MEMORY;
}

const vmh_grants_t *vmh_heap_grants(int device)
{
    hdev_t *h = device >= 0 && device < VMH_MAX_DEVICES ? vmh_hdev_record(device) : NULL;
    return h ? &h->grants : NULL;
}

void vmh_heap_primary_retained(int device, CUcontext ctx)
{
    hdev_t *h = device >= 0 && device < VMH_MAX_DEVICES ? vmh_hdev_record(device) : NULL;
    if (h)
        atomic_store_explicit(&h->primary, ctx, memory_order_release);
}

CUcontext vmh_heap_primary(int device)
{
    /* A lookup makes no record: a device never retained has no primary context to forget. */
    hdev_t *h = device >= 0 && device < VMH_MAX_DEVICES
                    ? atomic_load_explicit(&vmh_heap_devs[device], memory_order_acquire)
                    : NULL;
    return h ? atomic_load_explicit(&h->primary, memory_order_acquire) : NULL;
}

#ifdef VMH_TESTING
unsigned vmh_heap_thread_shard(void)
{
    return vmh_carved_thread_shard();
}
#endif
