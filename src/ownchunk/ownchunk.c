/* Layer "own-chunk buffers": buffers with a range of their own (see ownchunk.h). */
#include "ownchunk.h"

#include "clock.h"
#include "driver.h"
#include "list.h"
#include "log.h"
#include "overflow.h"
#include "registry.h"
#include "stats.h"
#include "witness.h"

#include <assert.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

typedef enum own_state { OWN_UNUSED, OWN_LIVE, OWN_RESIZING, OWN_PARKED, OWN_PAUSED } own_state_t;

struct vmh_ownbuf {
    vmh_owner_t o;
    vmh_ownchunks_t *set; /* never changes once set */
    vmh_range_t *range;
    vmh_paused_t *paused; /* while PAUSED (range NULL): where it was mapped, its backup */
    size_t req;           /* the size asked for */
    own_state_t state;
    bool growable;            /* from vmm_realloc: reserve headroom when it grows */
    uint64_t export_serial;   /* shared with another process in this life (0: not exported) */
    void *site;               /* where it was allocated (leak report) */
    vmh_parked_t parked_item; /* while PARKED */
    vmh_ownbuf_t *prev, *next;
};

/* What a move or shrink leaves behind, until the GPU has passed it. */
typedef struct old_range {
    vmh_parked_t parked_item;
    vmh_ownchunks_t *set;
    vmh_range_t *range;
    CUdeviceptr dead; /* the part marked dead in the registry until it goes */
    size_t dead_len;
} old_range_t;

static void idle_gauge(int64_t delta)
{
    vmh_gauge_add(VMH_STAT_bytes_cached, delta);
}

/* A set's lists keep their count and bytes beside the links (list.h links only). */
static void list_push(vmh_ownlist_t *l, vmh_ownbuf_t *b)
{
    VMH_LIST_PUSH(l->head, l->tail, b);
    l->count++;
    l->bytes += b->range ? b->range->size : 0;
}

static void list_remove(vmh_ownlist_t *l, vmh_ownbuf_t *b)
{
    VMH_LIST_REMOVE(l->head, l->tail, b);
    assert(l->count > 0);
    l->count--;
    l->bytes -= b->range ? b->range->size : 0;
}

void vmh_ownchunk_init(vmh_ownchunks_t *set, vmh_dev_t *dev, vmh_reclaim_t *reclaim,
                       vmh_cache_t *cache, vmh_overflow_dev_t *overflow)
{
    set->dev = dev;
    set->reclaim = reclaim;
    set->cache = cache;
    set->overflow = overflow;
    pthread_mutex_init(&set->lock, NULL);
    set->live = set->parked = set->unused = set->paused = (vmh_ownlist_t){NULL, NULL, 0, 0};
    atomic_init(&set->frozen, false);
    atomic_init(&set->old_ranges, 0);
}

/* ---- parked frees ------------------------------------------------------------------------ */

/* A parked buffer's reclaim item: the GPU is past its free; its range goes to the cache (which
 * marks it idle in the registry) before the record is recycled, so that a registry reader never
 * finds the record serving another range at this address. */
static size_t own_release(vmh_parked_t *item, uint64_t passed)
{
    (void)passed;
    vmh_ownbuf_t *b = (vmh_ownbuf_t *)((char *)item - offsetof(vmh_ownbuf_t, parked_item));
    vmh_ownchunks_t *set = b->set;
    vmh_lock(&set->lock, VMH_RANK_OWNER);
    assert(b->state == OWN_PARKED);
    list_remove(&set->parked, b);
    vmh_range_t *r = b->range;
    vmh_unlock(&set->lock);
    size_t bytes = r->size;
    vmh_cache_put(set->cache, r);
    vmh_lock(&set->lock, VMH_RANK_OWNER);
    b->range = NULL;
    b->state = OWN_UNUSED;
    list_push(&set->unused, b);
    vmh_unlock(&set->lock);
    return bytes;
}

/* An old range's dead addresses are unmapped: unknown again (before its reservation may go). */
static void old_forget(CUdeviceptr base, size_t size, void *arg)
{
    (void)base;
    (void)size;
    const old_range_t *o = arg;
    vmh_registry_set(o->dead, o->dead_len, NULL);
}

/* Old ranges count no parked bytes: a move's old range shares its chunks with the new one, and
 * a shrink's tail is given back by a blocking realloc's own wait or within one reclaim. */
static size_t old_release(vmh_parked_t *item, uint64_t passed)
{
    (void)passed;
    old_range_t *o = (old_range_t *)((char *)item - offsetof(old_range_t, parked_item));
    vmh_range_destroy_then(o->range, old_forget, o); /* dead until unmapped (device.h) */
    atomic_fetch_sub(&o->set->old_ranges, 1);
    free(o);
    return 0;
}

/* Leaves range r to be destroyed once work queued so far is done, [dead, +dead_len) marked
 * dead in the registry meanwhile; locked. */
static CUresult park_range_locked(vmh_ownchunks_t *set, vmh_range_t *r, CUdeviceptr dead,
                                  size_t dead_len)
{
    old_range_t *o = calloc(1, sizeof *o);
    if (!o)
        return CUDA_ERROR_OUT_OF_MEMORY;
    o->parked_item.release = old_release;
    o->set = set;
    o->range = r;
    o->dead = dead;
    o->dead_len = dead_len;
    vmh_registry_set(dead, dead_len, &vmh_owner_dead);
    atomic_fetch_add(&set->old_ranges, 1);
    vmh_reclaim_park(set->reclaim, &o->parked_item, vmh_reclaim_now(set->reclaim), 0);
    return CUDA_SUCCESS;
}

/* ---- making ------------------------------------------------------------------------------ */

static vmh_ownbuf_t *own_get_locked(vmh_ownchunks_t *set)
{
    vmh_ownbuf_t *b = set->unused.head;
    if (b) {
        list_remove(&set->unused, b);
        return b;
    }
    b = calloc(1, sizeof *b);
    if (b) {
        b->o.kind = VMH_OWN_CHUNKS;
        b->o.dev = set->dev;
        b->o.lock = &set->lock;
        b->set = set;
        b->parked_item.release = own_release;
    }
    return b;
}

static void make_live_locked(vmh_ownchunks_t *set, vmh_ownbuf_t *b, vmh_range_t *r, size_t size,
                             bool growable, void *site)
{
    b->range = r;
    b->site = site;
    b->state = OWN_LIVE;
    b->req = size;
    b->growable = growable;
    b->export_serial = 0;
    list_push(&set->live, b); /* its usable bytes were taken by the caller */
}

/* Serves r (taken off the cache or new) as a live buffer; false (r untouched) when no record
 * or registry entry could be had. */
static bool serve_range(vmh_ownchunks_t *set, vmh_range_t *r, size_t size, bool growable,
                        void *site)
{
    vmh_lock(&set->lock, VMH_RANK_OWNER);
    /* A paused tag takes no memory (checked under the lock pause.c's visit takes). */
    vmh_ownbuf_t *b = atomic_load(&set->frozen) ? NULL : own_get_locked(set);
    assert(!b || (b->state == OWN_UNUSED && !b->range));
    if (!b || !vmh_registry_set(r->base, r->size, b)) {
        if (b)
            list_push(&set->unused, b);
        vmh_unlock(&set->lock);
        return false;
    }
    make_live_locked(set, b, r, size, growable, site);
    vmh_unlock(&set->lock);
    return true;
}

/* The usable bytes of a buffer of size bytes (*rounded: size rounded to the granularity), taken
 * off the device's limit; false when they cannot be. A paused tag takes no memory: refused
 * before any memory is made (and again under the lock, in serve_range, for a pause that comes
 * meanwhile). */
static bool usable_take(vmh_ownchunks_t *set, size_t size, size_t *rounded)
{
    return !atomic_load(&set->frozen) && vmh_round_up(size, set->dev->gran, rounded) &&
           vmh_dev_usable_take(set->dev, *rounded);
}

/* The end of a miss: `made` is the answer of the call that made r for the `rounded` usable
 * bytes the caller took (usable_take). A range made is served as a live buffer, or destroyed
 * when it cannot be (nothing else knows of it); the bytes go back on any failure. */
static CUresult serve_made(vmh_ownchunks_t *set, CUresult made, vmh_range_t *r, size_t rounded,
                           size_t size, bool growable, void *site, CUdeviceptr *out)
{
    if (made != CUDA_SUCCESS) {
        vmh_dev_usable_give(set->dev, rounded);
        return made;
    }
    CUdeviceptr base = r->base; /* once served, a pause may swap r out at once */
    if (!serve_range(set, r, size, growable, site)) {
        vmh_range_destroy(r);
        vmh_dev_usable_give(set->dev, rounded);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = base;
    return CUDA_SUCCESS;
}

CUresult vmh_ownchunk_alloc(vmh_ownchunks_t *set, size_t size, bool growable, void *site,
                            CUdeviceptr *out, bool *no_address)
{
    vmh_dev_t *d = set->dev;
    size_t rounded;
    *no_address = false;
    if (!usable_take(set, size, &rounded))
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* Parked buffers are not waited for here (reclaim.h: the reclaim thread releases them to
     * the cache, the device waits on out of memory) unless a miss is about to make new memory
     * while more than VMMHOOK_PARK_LIMIT is parked: then what the wait released may hit. */
    vmh_range_t *hit = vmh_cache_take(set->cache, rounded);
    if (!hit && vmh_reclaim_throttle(set->reclaim))
        hit = vmh_cache_take(set->cache, rounded);
    if (hit) {
        /* Once served, the range is the buffer's: a pause may swap it out at once. */
        CUdeviceptr base = hit->base;
        size_t hit_size = hit->size; /* once back in the cache, a trim may destroy it */
        if (!serve_range(set, hit, size, growable, site)) {
            /* The registry already covered it: only a record can be missing. */
            vmh_dev_usable_give(d, hit_size);
            vmh_cache_put(set->cache, hit);
            idle_gauge((int64_t)hit_size);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        vmh_count(VMH_STAT_cache_hits, 1);
        *out = base;
        return CUDA_SUCCESS;
    }

    /* A miss: recycle idle memory before asking for more (cache.h). */
    vmh_cache_make_room(set->cache, rounded, vmh_reclaim_parked_bytes(set->reclaim));
    vmh_range_t *r = NULL;
    CUresult rc =
        vmh_dev_range_new(d, rounded, vmh_dev_reserve_for(rounded, growable), &r, no_address);
    return serve_made(set, rc, r, rounded, size, growable, site, out);
}

CUresult vmh_ownchunk_alloc_spilled(vmh_ownchunks_t *set, size_t size, void *site, CUdeviceptr *out)
{
    size_t rounded;
    if (!usable_take(set, size, &rounded))
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t reserve = vmh_dev_reserve_for(rounded, false);
    vmh_range_t *r = NULL;
    CUresult rc = vmh_dev_va_exhausted(reserve)
                      ? CUDA_ERROR_OUT_OF_MEMORY
                      : vmh_overflow_range_new(set->overflow, rounded, reserve, &r);
    return serve_made(set, rc, r, rounded, size, false, site, out);
}

/* ---- on a locked buffer ------------------------------------------------------------------ */

CUresult vmh_ownchunk_park_locked(vmh_ownbuf_t *b, CUdeviceptr p, size_t *req, vmh_paused_t **gone)
{
    vmh_ownchunks_t *set = b->set;
    vmh_assert_held(&set->lock);
    *gone = NULL;
    if (b->state == OWN_PAUSED && p == b->paused->base) {
        /* Its memory went at the pause: only the addresses are left to free (once), by the
         * caller, unlocked. */
        list_remove(&set->paused, b);
        vmh_registry_set(b->paused->base, b->paused->size, NULL);
        vmh_dev_usable_give(set->dev, b->paused->size);
        *gone = b->paused;
        b->paused = NULL;
        b->state = OWN_UNUSED;
        list_push(&set->unused, b);
        *req = b->req;
        return CUDA_SUCCESS;
    }
    if (b->state != OWN_LIVE || p != b->range->base)
        return CUDA_ERROR_INVALID_VALUE; /* interior pointer, double free, or being resized */
    vmh_backup_release(&b->range->kept); /* a kept backup goes with its buffer (no driver call) */
    if (b->export_serial || vmh_range_host_bytes(b->range)) {
        /* Its export dies here (vmh_ownchunk_export_alive_locked), and its chunks are never
         * served again: as natively, memory freed by its exporter stays an importer's. The
         * range is not cached but destroyed once queued work is done; the driver keeps the
         * chunks for as long as an importer holds them. A range with host memory (overflow.h)
         * goes the same way: the cache serves device memory only. */
        /* Nothing of the range is read once it is parked: the reclaim thread may release it
         * at once. Its size is read before. */
        vmh_range_t *r = b->range;
        const size_t size = r->size;
        list_remove(&set->live, b);
        if (park_range_locked(set, r, r->base, size) != CUDA_SUCCESS) {
            list_push(&set->live, b);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        vmh_dev_usable_give(set->dev, size);
        *req = b->req;
        b->range = NULL;
        b->export_serial = 0;
        b->state = OWN_UNUSED;
        list_push(&set->unused, b);
        return CUDA_SUCCESS;
    }
    list_remove(&set->live, b);
    vmh_dev_usable_give(set->dev, b->range->size);
    b->state = OWN_PARKED;
    list_push(&set->parked, b);
    idle_gauge((int64_t)b->range->size);
    *req = b->req;
    vmh_reclaim_park(set->reclaim, &b->parked_item, vmh_reclaim_now(set->reclaim), b->range->size);
    return CUDA_SUCCESS;
}

bool vmh_ownchunk_find_locked(vmh_ownbuf_t *b, CUdeviceptr p, vmh_buffer_info_t *info)
{
    if (b->state == OWN_PAUSED && p >= b->paused->base && p < b->paused->base + b->req) {
        *info =
            (vmh_buffer_info_t){b->paused->base, b->req, b->paused->size, b->o.dev->ordinal, false};
        return true;
    }
    if ((b->state != OWN_LIVE && b->state != OWN_RESIZING) || p < b->range->base ||
        p >= b->range->base + b->req)
        return false;
    *info = (vmh_buffer_info_t){b->range->base, b->req, b->range->size, b->o.dev->ordinal, false};
    return true;
}

const void *vmh_ownchunk_backup_locked(vmh_ownbuf_t *b, CUdeviceptr p, size_t n)
{
    CUdeviceptr base = b->state == OWN_PAUSED ? b->paused->base
                       : b->state == OWN_LIVE ? b->range->base
                                              : 0;
    const char *host = b->state == OWN_PAUSED ? b->paused->host
                       : b->state == OWN_LIVE ? b->range->kept.host
                                              : NULL;
    /* A kept backup answers for the bytes it holds: a buffer grown since holds more. */
    size_t len =
        b->state == OWN_LIVE && b->range->kept.size < b->req ? b->range->kept.size : b->req;
    if (!host || p < base || p >= base + len || n > base + len - p)
        return NULL;
    return host + (p - base);
}

CUresult vmh_ownchunk_export_locked(vmh_ownbuf_t *b, vmh_export_t *out, const vmh_range_t **range)
{
    if (b->state == OWN_PAUSED)
        return CUDA_ERROR_NOT_PERMITTED;
    if (b->state != OWN_LIVE && b->state != OWN_RESIZING)
        return CUDA_ERROR_INVALID_VALUE;
    out->base = b->range->base;
    out->size = b->req;
    out->offset = 0;
    if (!b->export_serial)
        b->export_serial = vmh_export_serial_new();
    out->serial = b->export_serial;
    *range = b->range;
    return CUDA_SUCCESS;
}

bool vmh_ownchunk_export_alive_locked(vmh_ownbuf_t *b, CUdeviceptr base, uint64_t serial)
{
    return (b->state == OWN_LIVE || b->state == OWN_RESIZING) && b->range->base == base &&
           b->export_serial == serial;
}

/* ---- resizing ---------------------------------------------------------------------------- */

/* Shrinks b (locked, LIVE) to `rounded` bytes; the chunks past it are parked as an old range. */
static CUresult shrink_locked(vmh_ownchunks_t *set, vmh_ownbuf_t *b, size_t size, size_t rounded,
                              bool *shrunk, vmh_range_t **drop)
{
    vmh_range_t *r = b->range, *nr = NULL;
    CUresult rc = vmh_range_shrink(r, rounded, &nr);
    if (rc == CUDA_SUCCESS && nr->size < r->size) {
        rc = park_range_locked(set, r, r->base + nr->size, r->size - nr->size);
        if (rc == CUDA_SUCCESS) {
            *shrunk = true;
            vmh_dev_usable_give(set->dev, r->size - nr->size);
            set->live.bytes -= r->size - nr->size;
            nr->kept = r->kept; /* a kept backup is the buffer's: a resize keeps it */
            r->kept = (vmh_backup_t){0};
            b->range = nr;
            nr = NULL;
        }
    }
    if (rc == CUDA_SUCCESS)
        b->req = size;
    *drop = nr; /* only references: r keeps every mapping alive */
    return rc;
}

/* Maps `extra` more bytes after b's range (b RESIZING, unlocked): in place or by a move. */
static CUresult grow_unlocked(vmh_ownchunks_t *set, const vmh_range_t *r, size_t rounded,
                              vmh_range_t **nr, vmh_grow_kind_t *kind, bool *no_address)
{
    vmh_dev_t *d = set->dev;
    vmh_alloc_t *a;
    CUresult rc = vmh_dev_chunk(d, rounded - r->size, &a);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && d->relieve(d))
        rc = vmh_dev_chunk(d, rounded - r->size, &a);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && vmh_overflow_enabled())
        rc = vmh_overflow_chunk(set->overflow, rounded - r->size, &a);
    if (rc != CUDA_SUCCESS)
        return rc;
    size_t reserve = vmh_dev_reserve_for(rounded, true);
    if (vmh_dev_va_exhausted(reserve - r->size)) {
        *no_address = true;
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        bool resv_failed;
        rc = vmh_range_grow(r, &a, 1, reserve, 0, true, nr, kind, &resv_failed);
        *no_address = rc == CUDA_ERROR_OUT_OF_MEMORY && resv_failed;
    }
    vmh_alloc_unref(a);
    return rc;
}

CUresult vmh_ownchunk_realloc(CUdeviceptr *p, size_t size, bool async, size_t *old_size,
                              bool *no_address)
{
    *no_address = false;
    vmh_owner_t *o = vmh_owner_lock(*p);
    if (!o)
        return CUDA_ERROR_NOT_FOUND;
    if (o->kind != VMH_OWN_CHUNKS) { /* freed and reused by carved_place.c meanwhile */
        vmh_owner_unlock(o);
        return CUDA_ERROR_NOT_FOUND;
    }
    vmh_ownbuf_t *b = (vmh_ownbuf_t *)o;
    vmh_ownchunks_t *set = b->set;
    vmh_dev_t *d = set->dev;
    size_t rounded;
    if (b->state == OWN_PARKED || b->state == OWN_UNUSED) {
        vmh_unlock(&set->lock);
        return CUDA_ERROR_NOT_FOUND; /* freed: nobody's buffer, as for a foreign pointer */
    }
    if (b->state == OWN_PAUSED) {
        vmh_unlock(&set->lock);
        return CUDA_ERROR_NOT_PERMITTED; /* untouched until its tag is resumed */
    }
    if (b->state != OWN_LIVE || *p != b->range->base) {
        vmh_unlock(&set->lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    *old_size = b->req;
    if (!vmh_round_up(size, d->gran, &rounded)) {
        vmh_unlock(&set->lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    vmh_range_t *r = b->range;
    if (rounded <= r->size) {
        bool shrunk = false;
        vmh_range_t *drop = NULL;
        CUresult rc = shrink_locked(set, b, size, rounded, &shrunk, &drop);
        vmh_unlock(&set->lock);
        vmh_range_destroy(drop);
        if (shrunk && !async)
            vmh_reclaim_wait(set->reclaim, VMH_WAIT_APP); /* the chunks past the size go now */
        return rc;
    }
    size_t extra = rounded - r->size; /* usable bytes taken for the growth */
    if (!vmh_dev_usable_take(d, extra)) {
        vmh_unlock(&set->lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (atomic_load(&set->old_ranges)) {
        /* The tail of an earlier shrink may still be mapped in this buffer's headroom. */
        vmh_unlock(&set->lock);
        vmh_reclaim_wait(set->reclaim, VMH_WAIT_APP);
        vmh_lock(&set->lock, VMH_RANK_OWNER);
        if (b->state != OWN_LIVE || b->range != r) {
            vmh_unlock(&set->lock);
            vmh_dev_usable_give(d, extra);
            return CUDA_ERROR_INVALID_VALUE; /* freed or resized by another thread meanwhile */
        }
    }
    /* The driver calls run without the lock; RESIZING keeps frees and other resizes off. */
    b->state = OWN_RESIZING;
    vmh_unlock(&set->lock);

    vmh_range_t *nr = NULL;
    vmh_grow_kind_t kind = VMH_GROW_MOVED;
    CUresult rc = grow_unlocked(set, r, rounded, &nr, &kind, no_address);

    vmh_lock(&set->lock, VMH_RANK_OWNER);
    assert(b->state == OWN_RESIZING && b->range == r);
    bool move = kind == VMH_GROW_MOVED;
    if (rc == CUDA_SUCCESS) {
        CUdeviceptr from = move ? nr->base : r->base + r->size;
        size_t len = move ? nr->size : nr->size - r->size;
        if (!vmh_registry_set(from, len, b) ||
            (move && park_range_locked(set, r, r->base, r->size) != CUDA_SUCCESS)) {
            if (move)
                vmh_registry_set(from, len, NULL);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (rc != CUDA_SUCCESS) {
        b->state = OWN_LIVE;
        vmh_unlock(&set->lock);
        vmh_range_destroy(nr);
        vmh_dev_usable_give(d, extra);
        return rc;
    }
    if (nr->size - r->size != extra) /* the range grows by exactly the chunk added */
        vmh_dev_usable_adjust(d, (int64_t)(nr->size - r->size) - (int64_t)extra);
    set->live.bytes += nr->size - r->size;
    if (!move) { /* kept backups are the buffer's: one grown in place keeps its own (a moved
                  * buffer is a new one, as after a free and an allocation) */
        nr->kept = r->kept;
        r->kept = (vmh_backup_t){0};
    }
    b->range = nr;
    b->req = size;
    b->state = OWN_LIVE;
    CUdeviceptr base = nr->base; /* nr is the buffer's once unlocked (a pause may take it) */
    vmh_unlock(&set->lock);
    vmh_count(move ? VMH_STAT_moves : VMH_STAT_grows_in_place, 1);
    if (!move)
        vmh_range_destroy(r); /* references only: nr holds every mapping */
    *p = base;
    if (move && !async)
        vmh_reclaim_wait(set->reclaim, VMH_WAIT_APP); /* the old address goes once work is done */
    return CUDA_SUCCESS;
}

/* ---- moving spilled memory back ---------------------------------------------------------- */

/* Device memory for a rehome. No relief of idle memory here: its locks may be taken under the
 * set's lock elsewhere; the front trims first (heap_upkeep.c). */
static CUresult device_chunk(void *arg, size_t size, vmh_alloc_t **out)
{
    return vmh_dev_chunk(arg, size, out);
}

/* Host chunks a move back replaced, released by the reclaim thread: the driver unpins the pages
 * of a host chunk as it releases it, which takes longer than the copy (docs/OVERFLOW.md), and the
 * program waiting in vmm_prefetch need not wait for that too. */
typedef struct old_chunks {
    vmh_parked_t parked_item;
    size_t n;
    vmh_alloc_t *chunk[];
} old_chunks_t;

static size_t old_chunks_release(vmh_parked_t *item, uint64_t passed)
{
    (void)passed;
    old_chunks_t *o = (old_chunks_t *)((char *)item - offsetof(old_chunks_t, parked_item));
    for (size_t i = 0; i < o->n; i++)
        vmh_alloc_unref(o->chunk[i]);
    free(o);
    return 0;
}

/* One buffer of a move back: its copies queued (job), what it moves, its new range, and the
 * scratch mappings to destroy once the GPU is past them when its copies went wrong. */
typedef struct homing {
    vmh_ownbuf_t *b;
    vmh_rehome_t *job;
    size_t host;
    vmh_range_t *nr, *unfinished;
} homing_t;

/* Moves the host memory of the n buffers in h[] to the device (the set locked, each LIVE, with
 * host memory, owned alone; unlocked on return, each RESIZING meanwhile so that frees and
 * resizes keep off): every copy queued on `stream` first, one wait, then the swaps. The first
 * failure is returned; a buffer that failed stays where it was, usable. */
static CUresult home_unlock(vmh_ownchunks_t *set, homing_t *h, size_t n, CUstream stream,
                            size_t *moved)
{
    size_t nold = 0;
    for (size_t i = 0; i < n; i++) {
        h[i].b->state = OWN_RESIZING;
        nold += vmh_range_rehome_chunks(h[i].b->range);
    }
    vmh_unlock(&set->lock);
    uint64_t t0 = vmh_now_ns();
    old_chunks_t *old = calloc(1, sizeof *old + nold * sizeof old->chunk[0]);
    CUresult first = old ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY, rc;
    bool queued = false;
    for (size_t i = 0; i < n && old; i++) {
        rc = vmh_range_rehome_begin(h[i].b->range, device_chunk, set->dev, stream, &h[i].job,
                                    &h[i].unfinished);
        queued |= rc == CUDA_SUCCESS;
        if (rc != CUDA_SUCCESS && first == CUDA_SUCCESS)
            first = rc;
    }
    uint64_t t1 = vmh_now_ns();
    CUresult waited = queued ? vmh_drv.cuStreamSynchronize(stream) : CUDA_SUCCESS;
    uint64_t t2 = vmh_now_ns();
    for (size_t i = 0; i < n; i++) {
        if (!h[i].job)
            continue;
        rc = vmh_range_rehome_finish(h[i].job, waited, &h[i].nr, &h[i].unfinished,
                                     old->chunk + old->n);
        while (old->n < nold && old->chunk[old->n])
            old->n++;
        if (rc == CUDA_SUCCESS)
            *moved += h[i].host;
        else if (first == CUDA_SUCCESS)
            first = rc;
    }
    /* Where a move's time goes (VMMHOOK_VERBOSE): what a GPU run needs to tell copy from remap. */
    vmh_debug("moved %zu bytes of %zu buffers back to the device: chunks made and copies queued "
              "%.1f ms, copies waited for %.1f ms, mappings swapped %.1f ms",
              *moved, n, (double)(t1 - t0) / 1e6, (double)(t2 - t1) / 1e6,
              (double)(vmh_now_ns() - t2) / 1e6);
    vmh_lock(&set->lock, VMH_RANK_OWNER);
    for (size_t i = 0; i < n; i++) {
        assert(h[i].b->state == OWN_RESIZING);
        if (h[i].nr) /* the old range is consumed: the new one is the buffer's whatever rc says */
            h[i].b->range = h[i].nr;
        h[i].b->state = OWN_LIVE;
        if (h[i].unfinished && park_range_locked(set, h[i].unfinished, 0, 0) != CUDA_SUCCESS)
            vmh_log("moving memory back to the device: %zu bytes of scratch memory stay mapped "
                    "(no memory to track them until the GPU is done)",
                    h[i].unfinished->size);
    }
    vmh_unlock(&set->lock);
    if (old && old->n) {
        old->parked_item.release = old_chunks_release;
        vmh_reclaim_park(set->reclaim, &old->parked_item, vmh_reclaim_now(set->reclaim), 0);
    } else {
        free(old);
    }
    return first;
}

CUresult vmh_ownchunk_prefetch_locked(vmh_ownbuf_t *b, CUdeviceptr p, CUstream stream,
                                      size_t *moved)
{
    vmh_ownchunks_t *set = b->set;
    CUresult rc = CUDA_SUCCESS;
    if (b->state != OWN_LIVE || p < b->range->base || p >= b->range->base + b->req)
        rc = b->state == OWN_PAUSED ? CUDA_ERROR_NOT_PERMITTED : CUDA_ERROR_INVALID_VALUE;
    else if (vmh_range_host_bytes(b->range) && !vmh_range_owned_alone(b->range))
        rc = CUDA_ERROR_ALREADY_MAPPED; /* exported, or a move's old range still maps it */
    if (rc != CUDA_SUCCESS || !vmh_range_host_bytes(b->range)) {
        vmh_unlock(&set->lock);
        return rc; /* on the device already: success */
    }
    homing_t h = {b, NULL, vmh_range_host_bytes(b->range), NULL, NULL};
    return home_unlock(set, &h, 1, stream, moved);
}

CUresult vmh_ownchunk_prefetch_all(vmh_ownchunks_t *set, CUstream stream, size_t *moved)
{
    /* Every spilled buffer in one pass (one wait for all the copies); a buffer that cannot move
     * (shared) is left where it is and said by the result. */
    CUresult first = CUDA_SUCCESS;
    vmh_lock(&set->lock, VMH_RANK_OWNER);
    size_t n = 0;
    for (vmh_ownbuf_t *b = set->live.head; b; b = b->next)
        n += vmh_range_host_bytes(b->range) != 0;
    homing_t *h = n ? calloc(n, sizeof *h) : NULL;
    if (!h) {
        vmh_unlock(&set->lock);
        return n ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
    }
    size_t k = 0;
    for (vmh_ownbuf_t *b = set->live.head; b && k < n; b = b->next) {
        size_t host = vmh_range_host_bytes(b->range);
        if (host && vmh_range_owned_alone(b->range))
            h[k++] = (homing_t){b, NULL, host, NULL, NULL};
        else if (host)
            first = CUDA_ERROR_ALREADY_MAPPED;
    }
    CUresult rc = home_unlock(set, h, k, stream, moved);
    free(h);
    return first != CUDA_SUCCESS ? first : rc;
}

/* ---- walking and tearing down ------------------------------------------------------------ */

void vmh_ownchunk_for_each_live(vmh_ownchunks_t *set,
                                void (*cb)(CUdeviceptr base, size_t size, void *site, void *arg),
                                void *arg)
{
    vmh_lock(&set->lock, VMH_RANK_OWNER);
    for (vmh_ownbuf_t *b = set->live.head; b; b = b->next)
        cb(b->range->base, b->req, b->site, arg);
    for (vmh_ownbuf_t *b = set->paused.head; b; b = b->next)
        cb(b->paused->base, b->req, b->site, arg);
    vmh_unlock(&set->lock);
}

vmh_ownchunks_t *vmh_ownchunk_set_of(const vmh_ownbuf_t *b)
{
    return b->set;
}

CUresult vmh_ownchunk_visit(vmh_ownchunks_t *set, vmh_visit_run_fn fn, void *arg)
{
    vmh_lock(&set->lock, VMH_RANK_OWNER_VISIT);
    /* Every live and paused buffer off its list, then each back on the list its state says
     * after fn (a list's byte count follows the range a buffer had when it joined). */
    vmh_ownlist_t todo = {NULL, NULL, 0, 0};
    vmh_ownlist_t *from[] = {&set->live, &set->paused};
    size_t n = 0;
    for (int l = 0; l < 2; l++) {
        for (vmh_ownbuf_t *b = from[l]->head, *next; b; b = next) {
            next = b->next;
            if (b->state == OWN_RESIZING)
                continue; /* its range is in a grow's hands */
            list_remove(from[l], b);
            list_push(&todo, b);
            n++;
        }
    }
    vmh_visit_rec_t *recs = n ? malloc(n * sizeof *recs) : NULL;
    CUresult rc = n && !recs ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
    size_t k = 0;
    for (vmh_ownbuf_t *b = todo.head; b && recs; b = b->next)
        recs[k++] = (vmh_visit_rec_t){&b->range, &b->paused, b->export_serial != 0};
    if (recs)
        rc = vmh_visit_runs(recs, n, fn, arg);
    free(recs);
    while (todo.head) {
        vmh_ownbuf_t *b = todo.head;
        list_remove(&todo, b);
        assert(!b->range != !b->paused);
        b->state = b->range ? OWN_LIVE : OWN_PAUSED;
        list_push(b->range ? &set->live : &set->paused, b);
    }
    vmh_unlock(&set->lock);
    return rc;
}

size_t vmh_ownchunk_parked_bytes(vmh_ownchunks_t *set)
{
    vmh_lock(&set->lock, VMH_RANK_OWNER);
    size_t bytes = set->parked.bytes;
    vmh_unlock(&set->lock);
    return bytes;
}

static void free_list(vmh_ownlist_t *l)
{
    for (vmh_ownbuf_t *b = l->head, *next; b; b = next) {
        next = b->next;
        if (b->range) {
            vmh_registry_set(b->range->base, b->range->size, NULL);
            vmh_range_destroy(b->range);
        }
        if (b->paused) {
            vmh_registry_set(b->paused->base, b->paused->size, NULL);
            vmh_paused_destroy(b->paused);
        }
        free(b);
    }
    *l = (vmh_ownlist_t){NULL, NULL, 0, 0};
}

void vmh_ownchunk_destroy(vmh_ownchunks_t *set)
{
    free_list(&set->live);
    free_list(&set->paused);
    free_list(&set->parked);
    free_list(&set->unused);
    pthread_mutex_destroy(&set->lock);
}
