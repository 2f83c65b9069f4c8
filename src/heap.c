/* Layer "heap front": routes each call to the layer that owns it (see heap.h).
 *
 * What owns what (docs/DESIGN.md has the diagram):
 *   heap.c (this file)  the devices table and the entry points: picks a device, picks packing or
 *                       a buffer of its own by size, finds a pointer's owner and hands it on
 *   bigbuf.c            buffers with their own chunks: make, grow, shrink, move, park
 *   packing.c           small buffers in shared chunks (shards over arena.c)
 *   cache.c             idle ranges kept for reuse
 *   reclaim.c           parked frees: released once the GPU has passed them
 *   device.c            each device's shape, usable bytes, owner records and their locks
 * Owners (big buffers, extents) are recycled per device and never freed while the process runs,
 * which is what lets registry readers go without a lock (registry.h).
 *
 * Lock order: witness.h's ranks (checked in debug and sanitizer builds). Nothing waits for the
 * GPU with a lock of the heap held; no driver call is made under the owners', cache's or
 * reclaim's queue locks.
 */
#include "heap.h"

#include "bigbuf.h"
#include "cache.h"
#include "clock.h"
#include "contexts.h"
#include "driver.h"
#include "log.h"
#include "overflow.h"
#include "packing.h"
#include "reclaim.h"
#include "registry.h"
#include "stats.h"
#include "tags.h"
#include "witness.h"

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PITCH_ALIGN 512 /* the alignment of the pitches native cudaMallocPitch gives */

/* One tag's memory on a device: a big-buffer set and packing shards of its own, so that memory
 * of one tag never shares a chunk with another tag's (pause.c gives a tag's memory back
 * alone). Made at the tag's first allocation on the device; freed only by the tests' reset. */
typedef struct tagpart {
    unsigned tag;
    vmh_packing_t pack;
    vmh_bigbufs_t big;
} tagpart_t;

/* One device's heap: its shape at the bottom, then each layer's state. */
typedef struct hdev {
    vmh_dev_t dev;
    vmh_reclaim_t reclaim;
    vmh_cache_t cache; /* idle ranges are nobody's: any tag may reuse them */
    _Atomic(tagpart_t *) part[VMM_TAGS_MAX];
    /* The tidy's state (reclaim thread only, tidy_lock): the peak of live bytes of the window
     * before the current one, when the current one began, when the last tidy ran. */
    pthread_mutex_t tidy_lock;
    size_t peak_before;
    uint64_t window_ns, tidy_ns;
} hdev_t;

/* Guards making tag parts and freezing them (vmh_heap_tag_freeze). */
static pthread_mutex_t parts_lock = PTHREAD_MUTEX_INITIALIZER;

#define FOR_EACH_PART(h, p)                                                                        \
    for (unsigned part_i_ = 0; part_i_ < VMM_TAGS_MAX; part_i_++)                                  \
        for (tagpart_t *p = atomic_load_explicit(&(h)->part[part_i_], memory_order_acquire); p;   \
             p = NULL)

enum { HEAP_RUNNING, HEAP_EXITED, HEAP_CHILD };

/* Written by the front's configure before any allocation; read without a lock after. */
static vmh_heap_settings_t settings;
static pthread_mutex_t devs_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(hdev_t *) devs[VMH_MAX_DEVICES];
static atomic_int mode = HEAP_RUNNING;
static _Atomic(vmh_pressure_fn) pressure_hook; /* run before trimming on out of memory */

static hdev_t *hdev_of(vmh_dev_t *d)
{
    return (hdev_t *)((char *)d - offsetof(hdev_t, dev));
}

void vmh_heap_configure(const vmh_heap_settings_t *s)
{
    settings = *s;
}



/* ---- devices ---------------------------------------------------------------------------- */

/* Gives back idle memory of the device after the driver ran out of memory (device.h): waits
 * for parked frees (not while the calling thread may not synchronize: a capture; the caller
 * then answers out of memory, as the driver would), and trims. */
static bool dev_relieve(vmh_dev_t *d)
{
    hdev_t *h = hdev_of(d);
    vmh_pressure_fn hook = atomic_load(&pressure_hook);
    /* lets other layers drop what pins freed memory (ipc.c: stale exports) */
    bool dropped = hook && hook();
    vmh_reclaim_drain(&h->reclaim);
    size_t bytes = vmh_cache_trim(&h->cache);
    FOR_EACH_PART(h, p)
        bytes += vmh_packing_trim(&p->pack);
    if (bytes)
        vmh_count(VMH_STAT_trims, 1);
    return bytes != 0 || dropped || vmh_reclaim_pending(&h->reclaim);
}

/* Limits that follow the program: idle memory (free carved space in whole extents, cached
 * buffers) stays while the program's recent peak of live bytes may need it again, plus a
 * slack of 1/TIDY_SLACK of that peak; the rest goes back, from the reclaim thread, so no
 * application thread waits. "Recent": the larger of the peaks of the current window and the
 * one before (TIDY_WINDOW_NS each), so a program whose steps repeat keeps its steps' memory
 * and one that shrank for good gives it back within two windows. */
#define TIDY_WINDOW_NS 1000000000ull
#define TIDY_EVERY_NS 50000000ull
#define TIDY_SLACK 16

static bool running(void)
{
    return atomic_load_explicit(&mode, memory_order_relaxed) == HEAP_RUNNING;
}

static void dev_tidy(vmh_dev_t *d)
{
    hdev_t *h = hdev_of(d);
    if (!running() || vmh_trylock(&h->tidy_lock, VMH_RANK_TIDY) != 0)
        return;
    uint64_t now = vmh_now_ns();
    if (now - h->tidy_ns < TIDY_EVERY_NS) {
        vmh_unlock(&h->tidy_lock);
        return;
    }
    h->tidy_ns = now;
    size_t peak = vmh_dev_usable_peak(d);
    if (now - h->window_ns >= TIDY_WINDOW_NS) {
        h->window_ns = now;
        h->peak_before = peak;
        vmh_dev_usable_peak_reset(d);
    }
    if (h->peak_before > peak)
        peak = h->peak_before;
    size_t live = atomic_load_explicit(&d->live_usable, memory_order_relaxed);
    size_t keep = (peak > live ? peak - live : 0) + peak / TIDY_SLACK;
    size_t idle = vmh_heap_idle_bytes(d->ordinal);
    if (idle > keep + d->gran && vmh_reclaim_pass(&h->reclaim, VMH_WAIT_BACKGROUND) ==
                                     CUDA_SUCCESS) {
        /* Memory freed at once may still be touched by queued work: passed first (above). */
        size_t excess = idle - keep, given = vmh_cache_trim_upto(&h->cache, excess);
        FOR_EACH_PART(h, p)
            if (given < excess)
                given += vmh_packing_trim_upto(&p->pack, excess - given);
        if (given)
            vmh_count(VMH_STAT_tidy_bytes, given);
    }
    vmh_unlock(&h->tidy_lock);
}

#ifdef VMH_TESTING
void (*vmh_heap_test_after_drain)(void);

unsigned vmh_heap_thread_shard(void)
{
    return vmh_packing_thread_shard();
}

void vmh_heap_tidy_now(int device, bool new_window)
{
    hdev_t *h = atomic_load_explicit(&devs[device], memory_order_acquire);
    assert(h);
    vmh_lock(&h->tidy_lock, VMH_RANK_TIDY);
    h->tidy_ns -= TIDY_EVERY_NS;
    if (new_window)
        h->window_ns -= TIDY_WINDOW_NS;
    vmh_unlock(&h->tidy_lock);
    dev_tidy(&h->dev);
}
#endif

static void hdev_destroy(hdev_t *h)
{
    vmh_reclaim_release_all(&h->reclaim);
    FOR_EACH_PART(h, p) {
        vmh_bigbuf_destroy(&p->big);
        vmh_packing_destroy(&p->pack);
        free(p);
    }
    vmh_cache_destroy(&h->cache);
    vmh_reclaim_destroy(&h->reclaim);
    free(h);
}

static CUresult hdev_new(int ordinal, CUcontext ctx, hdev_t **out)
{
    hdev_t *h = calloc(1, sizeof *h);
    if (!h)
        return CUDA_ERROR_OUT_OF_MEMORY;
    h->dev.relieve = dev_relieve;
    h->dev.tidy = dev_tidy;
    pthread_mutex_init(&h->tidy_lock, NULL);
    h->window_ns = h->tidy_ns = vmh_now_ns();
    CUresult rc = vmh_dev_setup(&h->dev, ordinal, ctx);
    vmh_ctx_seen(ctx, ordinal); /* waited for with the device's other contexts (contexts.h) */
    vmh_reclaim_init(&h->reclaim, &h->dev);
    vmh_cache_init(&h->cache, &h->dev);
    if (rc != CUDA_SUCCESS) {
        hdev_destroy(h);
        return rc;
    }
    *out = h;
    return CUDA_SUCCESS;
}

static CUresult dev_by_ordinal(int ordinal, CUcontext ctx, hdev_t **out)
{
    if (ordinal < 0 || ordinal >= VMH_MAX_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    hdev_t *h = atomic_load_explicit(&devs[ordinal], memory_order_acquire);
    CUresult rc = CUDA_SUCCESS;
    if (!h) {
        vmh_lock(&devs_lock, VMH_RANK_DEVICES);
        h = atomic_load_explicit(&devs[ordinal], memory_order_acquire);
        if (!h) {
            rc = hdev_new(ordinal, ctx, &h);
            if (rc == CUDA_SUCCESS)
                atomic_store_explicit(&devs[ordinal], h, memory_order_release);
        }
        vmh_unlock(&devs_lock);
    }
    *out = h;
    if (rc == CUDA_SUCCESS && h->dev.unsupported)
        return CUDA_ERROR_NOT_SUPPORTED;
    return rc;
}

/* The current context's device: no driver call in steady state (contexts.h keeps the calling
 * thread's current context as the interposer sees it change). */
static CUresult dev_current(hdev_t **out)
{
    CUcontext ctx = NULL;
    int dev;
    CUresult rc = vmh_ctx_current(&ctx, &dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    return dev_by_ordinal(dev, ctx, out);
}


static bool in_child(void)
{
    return atomic_load_explicit(&mode, memory_order_relaxed) == HEAP_CHILD;
}

/* ---- allocation ---------------------------------------------------------------------------- */

/* Small requests are packed; buffers that may grow (vmm_realloc) only when below half a chunk:
 * a buffer of its own grows in place or by remapping, a packed one by a copy. */
static size_t pack_below(const hdev_t *h, bool growable)
{
    size_t below = settings.pack_below;
    if (growable && below > h->dev.gran / 2)
        below = h->dev.gran / 2;
    return below;
}

/* Tag `tag`'s part of the device, made at its first use (NULL when out of host memory). A part
 * made while its tag is not running starts frozen: made and frozen under parts_lock, which
 * vmh_heap_tag_freeze takes too, so that a pause never misses a part. */
static tagpart_t *part_get(hdev_t *h, unsigned tag)
{
    assert(tag < VMM_TAGS_MAX);
    tagpart_t *p = atomic_load_explicit(&h->part[tag], memory_order_acquire);
    if (p)
        return p;
    vmh_lock(&parts_lock, VMH_RANK_PARTS);
    p = atomic_load_explicit(&h->part[tag], memory_order_acquire);
    if (!p && (p = calloc(1, sizeof *p))) {
        p->tag = tag;
        vmh_bigbuf_init(&p->big, &h->dev, &h->reclaim, &h->cache);
        if (vmh_packing_init(&p->pack, &h->dev, &h->reclaim) != CUDA_SUCCESS) {
            vmh_packing_destroy(&p->pack);
            vmh_bigbuf_destroy(&p->big);
            free(p);
            p = NULL;
        } else {
            bool frozen = !vmh_tag_running(tag);
            atomic_store(&p->big.frozen, frozen);
            atomic_store(&p->pack.frozen, frozen);
            atomic_store_explicit(&h->part[tag], p, memory_order_release);
        }
    }
    vmh_unlock(&parts_lock);
    return p;
}

static CUresult alloc_on(hdev_t *h, unsigned tag, size_t size, bool growable, void *site,
                         CUdeviceptr *out, bool *no_address)
{
    assert(running() && size > 0);
    if (__builtin_expect(vmh_work_split_wait_pending(), 0))
        vmh_work_split_wait(); /* a second context seen here: before anything is reused */
    tagpart_t *p = part_get(h, tag);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = size < pack_below(h, growable)
                      ? vmh_packing_alloc(&p->pack, size, out, no_address)
                      : vmh_bigbuf_alloc(&p->big, size, growable, site, out, no_address);
    /* The device refused after its wait, release and trim: host memory, when allowed. Not for a
     * paused tag (it takes no memory) nor an exhausted address budget (host memory needs
     * addresses too). */
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && !*no_address && vmh_overflow_enabled() &&
        vmh_tag_running(tag) && (rc = vmh_bigbuf_alloc_spilled(&p->big, size, site, out)) ==
                                    CUDA_SUCCESS)
        vmh_count(VMH_STAT_spills, 1);
    if (rc == CUDA_SUCCESS) {
        vmh_count(VMH_STAT_served_allocs, 1);
        vmh_gauge_add(VMH_STAT_bytes_requested, (int64_t)size);
        vmh_tag_requested_add(tag, (int64_t)size);
    }
    return rc;
}

/* The tag of the part an owner (locked or not: parts never change) belongs to. */
static unsigned owner_tag(const vmh_owner_t *o)
{
    if (o->kind == VMH_OWN_EXTENT) {
        const vmh_packing_t *pk = ((const vmh_ext_t *)o)->shard->pack;
        return ((const tagpart_t *)((const char *)pk - offsetof(tagpart_t, pack)))->tag;
    }
    const vmh_bigbufs_t *bb = vmh_bigbuf_set_of((const vmh_big_t *)o);
    return ((const tagpart_t *)((const char *)bb - offsetof(tagpart_t, big)))->tag;
}

/* What both allocation entry points share: the checks before a device is chosen, and serving
 * on it (rc: how choosing the device went) with the trace line either way. */
static CUresult request_check(size_t size, const CUdeviceptr *out)
{
    if (!running())
        return CUDA_ERROR_NOT_SUPPORTED;
    return !out || size == 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

static CUresult serve_traced(hdev_t *h, CUresult rc, size_t size, void *site, CUdeviceptr *out)
{
    bool no_address = false; /* a refusal before any reservation (a paused tag) leaves it */
    if (rc == CUDA_SUCCESS &&
        (rc = alloc_on(h, vmh_tag_current(), size, false, site, out, &no_address)) != CUDA_SUCCESS)
        vmh_dev_alloc_failed(&h->dev, size, rc, no_address); /* VMMHOOK_VERBOSE: why */
    vmh_trace(rc == CUDA_SUCCESS ? "allocate" : "allocate failure",
              rc == CUDA_SUCCESS ? *out : 0, size, NULL);
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
    rc = dev_current(&h);
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
    hdev_t *h = atomic_load_explicit(&devs[device], memory_order_acquire);
    if (!h) {
        /* The device's state needs a context to wait on later: the current one when it is
         * this device's, else the device's primary context (kept retained). */
        CUcontext ctx = NULL;
        rc = vmh_ctx_of_device(device, &ctx);
        if (rc == CUDA_SUCCESS)
            rc = dev_by_ordinal(device, ctx, &h);
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

CUresult vmh_heap_free(CUdeviceptr p, CUstream stream, bool async)
{
    if (in_child())
        return CUDA_ERROR_NOT_FOUND; /* the driver answers as it does natively; no lock */
    if (running() && vmh_registry_get(p)) {
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
    if (!running()) {
        /* Late frees from other destructors: the driver may be gone; forget quietly. */
        vmh_owner_unlock(o);
        return CUDA_SUCCESS;
    }
    assert(o->kind == VMH_OWN_EXTENT || o->kind == VMH_OWN_BIG);
    assert(o->dev && hdev_of(o->dev)->dev.ordinal == o->dev->ordinal);
    size_t req = 0;
    /* Freed memory reused at once while the program's work runs in one queue (contexts.h:
     * the note, then the look, in that order, so that the rule's end covers this free). */
    bool at_once = settings.stream_ordered && (vmh_work_note_reuse(), vmh_work_in_one_queue());
    vmh_paused_t *gone = NULL;
    CUresult rc = o->kind == VMH_OWN_EXTENT
                      ? vmh_packing_park_locked((vmh_ext_t *)o, p, at_once, &req)
                      : vmh_bigbuf_park_locked((vmh_big_t *)o, p, &req, &gone);
    vmh_owner_unlock(o);
    vmh_paused_destroy(gone); /* a paused buffer's addresses: no driver call under the lock */
    if (rc != CUDA_SUCCESS)
        return rc;
    vmh_count(VMH_STAT_served_frees, 1);
    vmh_gauge_add(VMH_STAT_bytes_requested, -(int64_t)req);
    vmh_tag_requested_add(owner_tag(o), -(int64_t)req);
    vmh_trace("free", p, req, stream);
    /* Natively cudaFree waits for the device; here the reclaim thread does, unless the program
     * asked for native blocking frees (DESIGN.md, "Frees"). */
    vmh_reclaim_t *r = &hdev_of(o->dev)->reclaim;
    if (settings.free_sync && !async) {
        vmh_reclaim_wait(r, VMH_WAIT_APP);
    } else if (!async && !(at_once && o->kind == VMH_OWN_EXTENT) && !vmh_capture_any()) {
        vmh_reclaim_free_throttle(r, req); /* one buffer larger than the park budget waits */
    }
    return CUDA_SUCCESS;
}

void vmh_heap_on_pressure(vmh_pressure_fn fn)
{
    atomic_store(&pressure_hook, fn);
}

bool vmh_heap_holds(CUdeviceptr p)
{
    return !in_child() && vmh_registry_get(p) != NULL;
}

bool vmh_heap_find(CUdeviceptr p, vmh_buffer_info_t *info)
{
    if (in_child())
        return false;
    vmh_owner_t *o = vmh_owner_lock(p);
    if (!o)
        return false;
    bool found = o->kind == VMH_OWN_EXTENT ? vmh_packing_find_locked((vmh_ext_t *)o, p, info)
                                           : vmh_bigbuf_find_locked((vmh_big_t *)o, p, info);
    vmh_owner_unlock(o);
    return found;
}

bool vmh_heap_backup_read(CUdeviceptr p, size_t n, void *dst)
{
    if (in_child())
        return false;
    vmh_owner_t *o = vmh_owner_lock(p);
    if (!o)
        return false;
    bool ok = o->kind == VMH_OWN_EXTENT ? vmh_packing_backup_locked((vmh_ext_t *)o, p, n, dst)
                                        : vmh_bigbuf_backup_locked((vmh_big_t *)o, p, n, dst);
    vmh_owner_unlock(o);
    return ok;
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

/* A packed buffer that outgrows its block, or a size change across the packing threshold:
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

/* A packed buffer: in place when it stays small and the following space allows, else by copy. */
static CUresult realloc_packed(CUdeviceptr *p, size_t size, CUstream stream, bool async,
                               bool *no_address)
{
    vmh_owner_t *o = vmh_owner_lock(*p);
    if (!o || o->kind != VMH_OWN_EXTENT) {
        if (o)
            vmh_owner_unlock(o);
        return CUDA_ERROR_NOT_FOUND; /* freed meanwhile */
    }
    vmh_ext_t *e = (vmh_ext_t *)o;
    hdev_t *h = hdev_of(o->dev);
    vmh_buffer_info_t info;
    if (!vmh_packing_find_locked(e, *p, &info)) {
        vmh_owner_unlock(o);
        return CUDA_ERROR_NOT_FOUND; /* freed (or never served): not a live buffer */
    }
    if (info.base != *p) {
        vmh_owner_unlock(o);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (e->paused) {
        vmh_owner_unlock(o);
        return CUDA_ERROR_NOT_PERMITTED; /* untouched until its tag is resumed */
    }
    size_t old_size = info.size;
    if (size < pack_below(h, true) &&
        vmh_packing_resize_locked(e, *p, size, &old_size) == CUDA_SUCCESS) {
        vmh_owner_unlock(o);
        vmh_gauge_add(VMH_STAT_bytes_requested, (int64_t)size - (int64_t)old_size);
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
    if (!running())
        return CUDA_ERROR_NOT_SUPPORTED;
    if (*p == 0) {
        if (size == 0)
            return CUDA_SUCCESS;
        hdev_t *h;
        CUresult rc = dev_current(&h);
        if (rc != CUDA_SUCCESS)
            return rc;
        rc = alloc_on(h, vmh_tag_current(), size, true, NULL, p, no_address);
        vmh_trace(rc == CUDA_SUCCESS ? "allocate" : "allocate failure",
                  rc == CUDA_SUCCESS ? *p : 0, size, stream);
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
    if (o->kind == VMH_OWN_EXTENT)
        return realloc_packed(p, size, stream, async, no_address);
    CUdeviceptr old = *p;
    size_t old_size = 0;
    CUresult rc = vmh_bigbuf_realloc(p, size, async, &old_size, no_address);
    if (rc == CUDA_SUCCESS)
        trace_resize(old, old_size, *p, size, stream);
    else if (rc == CUDA_ERROR_OUT_OF_MEMORY)
        vmh_trace("allocate failure", 0, size, stream);
    return rc;
}

/* ---- sharing ------------------------------------------------------------------------------- */

CUresult vmh_heap_export(CUdeviceptr p, vmh_export_t *out)
{
    if (in_child())
        return CUDA_ERROR_NOT_FOUND;
    vmh_owner_t *o = vmh_owner_lock(p);
    if (!o)
        return CUDA_ERROR_NOT_FOUND;
    memset(out, 0, sizeof *out);
    const vmh_range_t *r = NULL;
    CUresult rc = o->kind == VMH_OWN_EXTENT
                      ? vmh_packing_export_locked((vmh_ext_t *)o, p, out, &r)
                      : vmh_bigbuf_export_locked((vmh_big_t *)o, out, &r);
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
    if (in_child())
        return false;
    vmh_owner_t *o = vmh_owner_lock(base);
    if (!o)
        return false;
    bool alive = o->kind == VMH_OWN_EXTENT
                     ? vmh_packing_export_alive_locked((vmh_ext_t *)o, base, serial)
                     : vmh_bigbuf_export_alive_locked((vmh_big_t *)o, base, serial);
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
    if (in_child())
        return CUDA_SUCCESS;
    /* A peer's kernels run in the peer's queue, not in the owner's: memory of the owner may be
     * touched from two queues now (contexts.h). The wait, if anything was reused early, comes
     * at the next allocation. */
    if (grant)
        vmh_work_queue_split("peer access enabled");
    return vmh_access_set_peer(owner, peer, grant);
}

/* ---- spilled memory back to the device ---------------------------------------------------- */

/* What a prefetch does first: no work of the program may touch what moves (its contract), and
 * none submitted before may still be running; then idle memory makes room. */
static CUresult prefetch_prepare(hdev_t *h)
{
    CUresult rc = vmh_ctx_sync_device(h->dev.ordinal);
    if (rc == CUDA_SUCCESS)
        (void)dev_relieve(&h->dev);
    return rc;
}

CUresult vmh_heap_prefetch(CUdeviceptr p, size_t *moved)
{
    *moved = 0;
    if (in_child() || !running())
        return CUDA_ERROR_NOT_FOUND;
    vmh_buffer_info_t info;
    const vmh_owner_t *seen = vmh_registry_get(p);
    if (!seen || !seen->lock || !vmh_heap_find(p, &info))
        return CUDA_ERROR_NOT_FOUND; /* not a live served buffer */
    if (seen->kind != VMH_OWN_BIG)
        return CUDA_SUCCESS; /* packed memory never spills */
    hdev_t *h;
    CUresult rc = dev_current(&h);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (&h->dev != seen->dev)
        return CUDA_ERROR_INVALID_DEVICE; /* the copy runs in the current context */
    if ((rc = prefetch_prepare(h)) != CUDA_SUCCESS)
        return rc;
    vmh_owner_t *o = vmh_owner_lock(p);
    if (!o)
        return CUDA_ERROR_NOT_FOUND; /* freed meanwhile */
    if (o->kind != VMH_OWN_BIG) {
        vmh_owner_unlock(o);
        return CUDA_SUCCESS;
    }
    return vmh_bigbuf_prefetch_locked((vmh_big_t *)o, p, moved); /* unlocks */
}

CUresult vmh_heap_prefetch_tag(unsigned tag, size_t *moved)
{
    *moved = 0;
    if (in_child() || !running())
        return CUDA_SUCCESS;
    hdev_t *h;
    CUresult rc = dev_current(&h);
    if (rc != CUDA_SUCCESS)
        return rc;
    tagpart_t *p = tag < VMM_TAGS_MAX ? atomic_load_explicit(&h->part[tag], memory_order_acquire)
                                      : NULL;
    if (!p || !vmh_overflow_bytes(h->dev.ordinal))
        return CUDA_SUCCESS;
    if ((rc = prefetch_prepare(h)) != CUDA_SUCCESS)
        return rc;
    return vmh_bigbuf_prefetch_all(&p->big, moved);
}

/* ---- maintenance ------------------------------------------------------------------------- */

size_t vmh_heap_trim(void)
{
    if (in_child())
        return 0;
    size_t bytes = 0;
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = atomic_load_explicit(&devs[i], memory_order_acquire);
        if (!h || h->dev.unsupported)
            continue;
        vmh_reclaim_drain(&h->reclaim); /* not during a capture (reclaim.h) */
#ifdef VMH_TESTING
        if (vmh_heap_test_after_drain)
            vmh_heap_test_after_drain();
#endif
        size_t b = vmh_cache_trim(&h->cache);
        FOR_EACH_PART(h, p)
            b += vmh_packing_trim(&p->pack);
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
    if (in_child())
        return;
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = atomic_load_explicit(&devs[i], memory_order_acquire);
        if (!h || h->dev.unsupported)
            continue;
        FOR_EACH_PART(h, p)
            vmh_packing_trim_paused(&p->pack);
    }
}

size_t vmh_heap_idle_bytes(int device)
{
    if (device < 0 || device >= VMH_MAX_DEVICES || in_child())
        return 0;
    hdev_t *h = atomic_load_explicit(&devs[device], memory_order_acquire);
    if (!h || h->dev.unsupported)
        return 0;
    size_t idle = vmh_cache_bytes(&h->cache);
    FOR_EACH_PART(h, p)
        idle += vmh_bigbuf_parked_bytes(&p->big) + vmh_packing_idle_bytes(&p->pack);
    return idle;
}

static void report_big_leak(CUdeviceptr base, size_t size, void *site, void *arg)
{
    vmh_leak_report_one(base, size, *(int *)arg, site);
}

static void report_packed_leak(const vmh_block_info_t *b, void *arg)
{
    vmh_leak_report_one(b->base, b->size, *(int *)arg, NULL);
}

void vmh_heap_shutdown(bool report_leaks)
{
    int expected = HEAP_RUNNING;
    if (!atomic_compare_exchange_strong(&mode, &expected, HEAP_EXITED))
        return;
    /* No driver call after this returns: the driver may be torn down next. */
    vmh_reclaim_stop(true);
    if (!report_leaks)
        return;
    vmh_leak_report_begin();
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = atomic_load_explicit(&devs[i], memory_order_acquire);
        if (!h || h->dev.unsupported)
            continue;
        FOR_EACH_PART(h, p) {
            vmh_bigbuf_for_each_live(&p->big, report_big_leak, &i);
            vmh_packing_for_each_live(&p->pack, report_packed_leak, &i);
        }
    }
    vmh_leak_report_end();
}

/* ---- tags (pause.c) ------------------------------------------------------------------------- */

bool vmh_heap_tag_parts(int device, unsigned tag, vmh_tag_parts_t *out)
{
    /* Also after exit: the exit report counts the tags' memory (vmm_pause refuses by then). */
    if (device < 0 || device >= VMH_MAX_DEVICES || tag >= VMM_TAGS_MAX || in_child())
        return false;
    hdev_t *h = atomic_load_explicit(&devs[device], memory_order_acquire);
    tagpart_t *p = h ? atomic_load_explicit(&h->part[tag], memory_order_acquire) : NULL;
    if (!p)
        return false;
    *out = (vmh_tag_parts_t){&h->dev, &h->reclaim, &p->big, &p->pack};
    return true;
}

void vmh_heap_tag_freeze(unsigned tag, bool frozen)
{
    vmh_lock(&parts_lock, VMH_RANK_PARTS);
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = atomic_load_explicit(&devs[i], memory_order_acquire);
        tagpart_t *p = h ? atomic_load_explicit(&h->part[tag], memory_order_acquire) : NULL;
        if (p) {
            atomic_store(&p->big.frozen, frozen);
            atomic_store(&p->pack.frozen, frozen);
        }
    }
    vmh_unlock(&parts_lock);
}

void vmh_heap_forked_child(void)
{
    atomic_store(&mode, HEAP_CHILD); /* the reclaim thread's step is lifetime.c's own call */
}

void vmh_heap_reset(void)
{
    vmh_reclaim_stop(false); /* its waits use the queues destroyed here */
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = atomic_exchange(&devs[i], NULL);
        if (h)
            hdev_destroy(h);
    }
    vmh_access_reset();
    atomic_store(&mode, HEAP_RUNNING);
}
