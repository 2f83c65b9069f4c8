/* Layers 4-5: per-device serving, reuse and parked frees (see heap.h).
 *
 * What owns what:
 *   device state -> packing shards -> arena -> extents (each owns one range: one chunk, one
 *                                               reservation)
 *               -> big buffers (each owns one range of its own chunks)
 *               -> lists: live, parked (freed, work may still use them), cache (idle, reusable)
 *               -> old ranges (left behind by a move or shrink, unmapped once work is done)
 * Owners (big buffers, extents) are recycled per device and never freed while the process runs,
 * which is what lets registry readers go without a lock (registry.h).
 *
 * Locking: packed buffers live in SHARDS shards per device, each with its own mutex, arena,
 * extents, registry entries of those extents and set of exported packed buffers. A thread
 * allocates in the shard it picked at its first allocation (a counter modulo SHARDS) and only
 * looks at other shards' free space when its own has none; a free goes to the shard that owns
 * the extent (ext_t->shard). The device mutex (d->lock) guards everything else: big buffers,
 * their lists and registry entries, old ranges, the next extent size. live_usable is atomic.
 * No driver call is made under any of these locks (except the rare peer-access grant), so a
 * slow cuMemCreate or synchronize never blocks another thread's fast path.
 *
 * Lock order: a device's sync_lock, then d->lock, then one shard lock. A thread never holds
 * two shard locks at once, and never takes d->lock or sync_lock while it holds a shard lock.
 *
 * Parked frees and generations: a free tags its block with the device's current generation.
 * A synchronize first advances the generation (taking the old value g), then waits for the
 * context, then releases every block tagged <= g: all of them were freed before the wait began,
 * so no work queued before their free can still be running.
 */
#include "heap.h"

#include "arena.h"
#include "driver.h"
#include "handle.h"
#include "log.h"
#include "options.h"
#include "range.h"
#include "registry.h"
#include "stats.h"
#include "testable.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEVICES 64
#define EXTENT_MAX ((size_t)64 << 20)
#define CACHE_FLOOR ((size_t)256 << 20) /* idle bytes a miss may leave in the cache */
#define PITCH_ALIGN 512 /* cudaMallocPitch(1000 x 77) gave pitch 1024 on the H200 */

/* OWN_DEAD marks address space that is still mapped but no longer anybody's buffer (the old
 * address of a moved buffer, the tail of a shrunk one) until work queued before the change has
 * finished and it is unmapped: queries must not pass it to the driver, which would answer for
 * it as if it were allocated. */
typedef enum owner_kind { OWN_BIG = 1, OWN_EXTENT, OWN_DEAD } owner_kind_t;

typedef struct vdev vdev_t;

typedef struct owner {
    owner_kind_t kind;
    vdev_t *dev; /* never changes once set: owners are recycled within their device */
} owner_t;

typedef enum big_state { BIG_UNUSED, BIG_LIVE, BIG_RESIZING, BIG_PARKED, BIG_CACHED } big_state_t;

typedef struct big {
    owner_t o;
    vmh_range_t *range;
    size_t req;      /* the size asked for */
    big_state_t state;
    bool growable;   /* from vmm_realloc: reserve headroom when it grows */
    bool exported;   /* shared with another process: its chunks are never reused */
    void *site;      /* where it was allocated (leak report) */
    uint64_t gen;    /* generation of its free, while parked */
    struct big *prev, *next;
} big_t;

typedef struct biglist {
    big_t *head, *tail;
    size_t count, bytes;
} biglist_t;

#define SHARDS 8 /* packing shards per device */

typedef struct shard shard_t;

typedef struct ext {
    owner_t o;
    shard_t *shard; /* never changes once set: extent records are recycled within their shard */
    vmh_range_t *range;
    vmh_extent_t *extent;
    struct ext *prev, *next;
} ext_t;

typedef struct old_range {
    vmh_range_t *range;
    uint64_t gen;
    CUdeviceptr dead;  /* the part marked OWN_DEAD in the registry until it goes */
    size_t dead_len;
    struct old_range *next;
} old_range_t;

static owner_t dead_owner = {OWN_DEAD, NULL};

/* One packing shard. Guarded by lock, except the two hints, which are stored under it (by
 * shard_note) and read without it. */
struct shard {
    pthread_mutex_t lock;
    vmh_arena_t *arena;
    ext_t *exts;        /* extents in the arena */
    ext_t *spare;       /* records of trimmed extents, reused (registry readers may still look) */
    size_t extent_next; /* size of the shard's next extent (doubles up to EXTENT_MAX) */
    CUdeviceptr *exported; /* packed buffers shared with other processes */
    size_t nexported, exported_cap;
    _Atomic size_t nparked; /* parked blocks */
    _Atomic size_t free;    /* free bytes (not parked): a shard with less is not tried */
    _Atomic size_t extents; /* extents in the arena */
    char pad[64];           /* keeps shards off each other's cache lines */
};

struct vdev {
    int ordinal;
    bool unsupported; /* no VMM on this device: everything passes through */
    CUcontext ctx; /* the context synchronized for parked frees */
    CUmemAllocationProp prop;
    CUmemAccessDesc access[VMH_MAX_ACCESS];
    int naccess;
    size_t gran;        /* chunk granularity */

    pthread_mutex_t lock;
    pthread_mutex_t sync_lock; /* one synchronize at a time; guards synced_gen */
    uint64_t synced_gen;       /* the generation the last successful synchronize released */
    bool synced_any;
    biglist_t live, parked, cache, unused;
    old_range_t *old;
    /* Usable bytes of live buffers (and of allocations in flight), for VMMHOOK_MEM_LIMIT:
     * taken before a buffer is made (usable_take), so the limit is never exceeded. */
    _Atomic size_t live_usable;
    _Atomic uint64_t gen;
    shard_t shards[SHARDS];
};

static pthread_mutex_t devs_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(vdev_t *) devs[MAX_DEVICES];
static atomic_bool shut_down;
static _Atomic(vmh_pressure_fn) pressure_hook; /* run before trimming on out of memory */
static uint64_t peer_requests[MAX_DEVICES]; /* peers granted through the driver's peer calls */

/* ---- small helpers ---------------------------------------------------------------------- */

static bool round_up(size_t n, size_t to, size_t *out)
{
    if (n > SIZE_MAX - (to - 1))
        return false;
    *out = (n + to - 1) / to * to;
    return true;
}

static void list_push(biglist_t *l, big_t *b)
{
    b->prev = NULL;
    b->next = l->head;
    if (l->head)
        l->head->prev = b;
    else
        l->tail = b;
    l->head = b;
    l->count++;
    l->bytes += b->range ? b->range->size : 0;
}

static void list_remove(biglist_t *l, big_t *b)
{
    if (b->prev)
        b->prev->next = b->next;
    else
        l->head = b->next;
    if (b->next)
        b->next->prev = b->prev;
    else
        l->tail = b->prev;
    b->prev = b->next = NULL;
    l->count--;
    l->bytes -= b->range ? b->range->size : 0;
}

static void idle_gauge(int64_t delta)
{
    vmh_gauge_add(VMH_STAT_bytes_cached, delta);
}

/* The calling thread's packing shard: picked at its first packed allocation, kept for the
 * thread's life, so that threads spread over the shards and a thread keeps its cache lines. */
static _Atomic unsigned shard_next;
static _Thread_local unsigned shard_mine __attribute__((tls_model("initial-exec"))); /* + 1 */

VMH_TESTABLE unsigned vmh_heap_thread_shard(void)
{
    unsigned s = shard_mine;
    if (!s) {
        s = atomic_fetch_add_explicit(&shard_next, 1, memory_order_relaxed) % SHARDS + 1;
        shard_mine = s;
    }
    return s - 1;
}

/* Reserves n usable bytes on the device within VMMHOOK_MEM_LIMIT; false (nothing taken) when
 * they do not fit. */
static bool usable_take(vdev_t *d, size_t n)
{
    size_t limit = vmh_opt.mem_limit;
    if (!limit) {
        atomic_fetch_add_explicit(&d->live_usable, n, memory_order_relaxed);
        return true;
    }
    size_t cur = atomic_load_explicit(&d->live_usable, memory_order_relaxed);
    do {
        if (cur > limit || n > limit - cur)
            return false;
    } while (!atomic_compare_exchange_weak_explicit(&d->live_usable, &cur, cur + n,
                                                    memory_order_relaxed, memory_order_relaxed));
    return true;
}

static void usable_give(vdev_t *d, size_t n)
{
    atomic_fetch_sub_explicit(&d->live_usable, n, memory_order_relaxed);
}

/* Refreshes the shard's hints after a change; the shard is locked. */
static void shard_note(shard_t *s)
{
    vmh_arena_stats_t st;
    vmh_arena_stats(s->arena, &st);
    atomic_store_explicit(&s->nparked, vmh_arena_parked(s->arena), memory_order_relaxed);
    atomic_store_explicit(&s->free, st.free, memory_order_relaxed);
    atomic_store_explicit(&s->extents, st.extents, memory_order_relaxed);
}

/* Whether any shard holds parked blocks (a hint: read without the shard locks). */
static bool dev_packed_parked(vdev_t *d)
{
    for (int i = 0; i < SHARDS; i++)
        if (atomic_load_explicit(&d->shards[i].nparked, memory_order_relaxed))
            return true;
    return false;
}

/* ---- devices ---------------------------------------------------------------------------- */

/* Makes the device's allocation properties; checks the handle type once with a real chunk, so
 * that a type the driver refuses is reported clearly at the start, not at some later grow. */
static CUresult dev_setup(vdev_t *d, int ordinal, CUcontext ctx)
{
    d->ordinal = ordinal;
    d->ctx = ctx;
    pthread_mutex_init(&d->lock, NULL);
    pthread_mutex_init(&d->sync_lock, NULL);
    for (int i = 0; i < SHARDS; i++) {
        pthread_mutex_init(&d->shards[i].lock, NULL);
        d->shards[i].arena = vmh_arena_new();
        if (!d->shards[i].arena)
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    int vmm = 0;
    vmh_drv.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                 ordinal);
    if (!vmm) {
        vmh_debug("device %d has no virtual memory management: passing it through", ordinal);
        d->unsupported = true;
        return CUDA_SUCCESS;
    }
    memset(&d->prop, 0, sizeof d->prop);
    d->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    d->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d->prop.location.id = ordinal;
    static const CUmemAllocationHandleType types[VMH_HANDLE_KIND_COUNT] = {
        [VMH_HANDLE_NONE] = CU_MEM_HANDLE_TYPE_NONE,
        [VMH_HANDLE_POSIX_FD] = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        [VMH_HANDLE_FABRIC] = CU_MEM_HANDLE_TYPE_FABRIC,
    };
    d->prop.requestedHandleTypes = types[vmh_opt.handle];
    if (vmh_opt.rdma) {
        int rdma = 0;
        vmh_drv.cuDeviceGetAttribute(
            &rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, ordinal);
        if (rdma)
            d->prop.allocFlags.gpuDirectRDMACapable = 1;
        else
            vmh_log("VMMHOOK_RDMA: device %d does not support GPUDirect RDMA with VMM memory; "
                    "allocating without it", ordinal);
    }

    size_t min_gran = 0, rec_gran = 0;
    CUresult rc = vmh_drv.cuMemGetAllocationGranularity(&min_gran, &d->prop,
                                                         CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (rc == CUDA_SUCCESS)
        rc = vmh_drv.cuMemGetAllocationGranularity(&rec_gran, &d->prop,
                                                   CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (rc != CUDA_SUCCESS || min_gran == 0)
        return rc != CUDA_SUCCESS ? rc : CUDA_ERROR_NOT_SUPPORTED;
    /* The registry works in 2 MiB granules: never use a smaller chunk. */
    size_t floor = (size_t)1 << VMH_REGISTRY_SHIFT;
    if (min_gran < floor && floor % min_gran == 0)
        min_gran = floor;
    if (rec_gran < min_gran || rec_gran % min_gran)
        rec_gran = min_gran;
    d->gran = vmh_options_granularity(min_gran, rec_gran);
    for (int i = 0; i < SHARDS; i++)
        d->shards[i].extent_next = d->gran;

    d->access[0].location = d->prop.location;
    d->access[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    d->naccess = 1;
    for (int peer = 0; peer < MAX_DEVICES && d->naccess < VMH_MAX_ACCESS; peer++) {
        int can = 0;
        if (peer == ordinal || !((vmh_opt.peers | peer_requests[ordinal]) & (1ull << peer)))
            continue;
        if (vmh_drv.cuDeviceCanAccessPeer(&can, ordinal, peer) != CUDA_SUCCESS || !can) {
            vmh_debug("VMMHOOK_PEERS: device %d cannot reach device %d; not granted", peer,
                      ordinal);
            continue;
        }
        d->access[d->naccess].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        d->access[d->naccess].location.id = peer;
        d->access[d->naccess].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        d->naccess++;
    }

    if (d->prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) {
        vmh_alloc_t *probe;
        rc = vmh_alloc_create(d->gran, &d->prop, NULL, 0, &probe);
        if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_OUT_OF_MEMORY) {
            char why[96];
            snprintf(why, sizeof why, "cuMemCreate on device %d answers CUDA error %d",
                     ordinal, (int)rc);
            vmh_options_refuse("VMMHOOK_HANDLE_TYPE", why, "none");
            d->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
        } else if (rc == CUDA_SUCCESS) {
            vmh_alloc_unref(probe);
        }
    }

    vmh_debug("device %d: chunk granularity %zu (minimum %zu), handle type %d, %d access "
              "descriptor(s)", ordinal, d->gran, min_gran, (int)d->prop.requestedHandleTypes,
              d->naccess);
    return CUDA_SUCCESS;
}

static CUresult dev_by_ordinal(int ordinal, CUcontext ctx, vdev_t **out)
{
    if (ordinal < 0 || ordinal >= MAX_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    vdev_t *d = atomic_load_explicit(&devs[ordinal], memory_order_acquire);
    if (d) {
        *out = d;
        return CUDA_SUCCESS;
    }
    pthread_mutex_lock(&devs_lock);
    d = atomic_load_explicit(&devs[ordinal], memory_order_acquire);
    CUresult rc = CUDA_SUCCESS;
    if (!d) {
        d = calloc(1, sizeof *d);
        rc = d ? dev_setup(d, ordinal, ctx) : CUDA_ERROR_OUT_OF_MEMORY;
        if (rc == CUDA_SUCCESS) {
            atomic_store_explicit(&devs[ordinal], d, memory_order_release);
        } else {
            for (int i = 0; d && i < SHARDS; i++)
                if (d->shards[i].arena)
                    vmh_arena_delete(d->shards[i].arena, NULL, NULL);
            free(d);
            d = NULL;
        }
    }
    pthread_mutex_unlock(&devs_lock);
    *out = d;
    if (rc == CUDA_SUCCESS && d->unsupported)
        return CUDA_ERROR_NOT_SUPPORTED;
    return rc;
}

/* The current context's device. */
static CUresult dev_current(vdev_t **out)
{
    CUcontext ctx = NULL;
    CUdevice dev;
    CUresult rc = vmh_drv.cuCtxGetCurrent(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    rc = vmh_drv.cuCtxGetDevice(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    return dev_by_ordinal((int)dev, ctx, out);
}

static big_t *cache_evict_locked(vdev_t *d, size_t need);
static size_t evicted_destroy(vdev_t *d, big_t *taken);

/* ---- parked frees ----------------------------------------------------------------------- */

static void destroy_ranges(old_range_t *o)
{
    while (o) {
        old_range_t *next = o->next;
        vmh_range_destroy(o->range);
        free(o);
        o = next;
    }
}

/* Waits for all work queued on the device so far, then releases everything parked before the
 * wait began: blocks become reusable, old ranges are unmapped. */
static CUresult dev_sync_now(vdev_t *d);

/* Threads that need parked memory at the same time share one synchronize: a thread that
 * waited for another's synchronize which began after its own request returns at once (that
 * wait covered every free parked before the request). */
static CUresult dev_sync(vdev_t *d)
{
    uint64_t want = atomic_load(&d->gen);
    pthread_mutex_lock(&d->sync_lock);
    CUresult rc = CUDA_SUCCESS;
    if (!d->synced_any || d->synced_gen < want)
        rc = dev_sync_now(d);
    pthread_mutex_unlock(&d->sync_lock);
    return rc;
}

static CUresult dev_sync_now(vdev_t *d)
{
    uint64_t g = atomic_fetch_add(&d->gen, 1);
    CUcontext cur = NULL;
    CUresult rc = vmh_drv.cuCtxGetCurrent(&cur);
    if (rc == CUDA_SUCCESS) {
        if (cur == d->ctx) {
            rc = vmh_drv.cuCtxSynchronize();
        } else {
            rc = vmh_drv.cuCtxPushCurrent(d->ctx);
            if (rc == CUDA_SUCCESS) {
                rc = vmh_drv.cuCtxSynchronize();
                vmh_drv.cuCtxPopCurrent(&cur);
            }
        }
    }
    vmh_count(VMH_STAT_syncs, 1);
    if (rc != CUDA_SUCCESS)
        return rc; /* a failed wait proves nothing: everything stays parked */
    d->synced_gen = g;
    d->synced_any = true;

    for (int i = 0; i < SHARDS; i++) {
        shard_t *s = &d->shards[i];
        pthread_mutex_lock(&s->lock);
        vmh_arena_unpark_upto(s->arena, g);
        shard_note(s);
        pthread_mutex_unlock(&s->lock);
    }
    old_range_t *done = NULL;
    pthread_mutex_lock(&d->lock);
    for (big_t *b = d->parked.tail, *prev; b; b = prev) {
        prev = b->prev;
        if (b->gen > g)
            continue;
        list_remove(&d->parked, b);
        b->state = BIG_CACHED;
        list_push(&d->cache, b);
    }
    for (old_range_t **pp = &d->old; *pp;) {
        old_range_t *o = *pp;
        if (o->gen <= g) {
            *pp = o->next;
            vmh_registry_set(o->dead, o->dead_len, NULL);
            o->next = done;
            done = o;
        } else {
            pp = &o->next;
        }
    }
    big_t *over = d->cache.bytes > vmh_opt.cache_limit
                      ? cache_evict_locked(d, d->cache.bytes - vmh_opt.cache_limit)
                      : NULL;
    pthread_mutex_unlock(&d->lock);
    destroy_ranges(done);
    evicted_destroy(d, over);
    return CUDA_SUCCESS;
}

/* Whether anything waits for a synchronize; d->lock held. */
static bool dev_has_parked_locked(vdev_t *d)
{
    return d->parked.count || d->old || dev_packed_parked(d);
}

static bool dev_has_parked(vdev_t *d)
{
    pthread_mutex_lock(&d->lock);
    bool parked = dev_has_parked_locked(d);
    pthread_mutex_unlock(&d->lock);
    return parked;
}

/* ---- owners ----------------------------------------------------------------------------- */

static big_t *big_get(vdev_t *d)
{
    big_t *b = d->unused.head;
    if (b) {
        list_remove(&d->unused, b);
        return b;
    }
    b = calloc(1, sizeof *b);
    if (b) {
        b->o.kind = OWN_BIG;
        b->o.dev = d;
    }
    return b;
}

/* Takes up to `need` bytes of idle cached buffers (least recently freed first) off the cache
 * and out of the registry; the caller destroys their ranges without the lock and then
 * returns the owners with big_recycle(). */
static big_t *cache_evict_locked(vdev_t *d, size_t need)
{
    big_t *taken = NULL;
    size_t got = 0;
    while (d->cache.tail && got < need) {
        big_t *b = d->cache.tail;
        list_remove(&d->cache, b);
        vmh_registry_set(b->range->base, b->range->size, NULL);
        got += b->range->size;
        b->next = taken;
        taken = b;
    }
    return taken;
}

static size_t evicted_destroy(vdev_t *d, big_t *taken)
{
    size_t bytes = 0;
    for (big_t *b = taken, *next; b; b = next) {
        next = b->next;
        bytes += b->range->size;
        idle_gauge(-(int64_t)b->range->size);
        vmh_range_destroy(b->range);
        b->range = NULL;
        b->state = BIG_UNUSED;
        pthread_mutex_lock(&d->lock);
        list_push(&d->unused, b);
        pthread_mutex_unlock(&d->lock);
    }
    return bytes;
}

/* Gives back every idle buffer and every empty extent of the device. */
static size_t dev_trim(vdev_t *d)
{
    pthread_mutex_lock(&d->lock);
    big_t *taken = cache_evict_locked(d, SIZE_MAX);
    pthread_mutex_unlock(&d->lock);
    size_t bytes = evicted_destroy(d, taken);
    for (int i = 0; i < SHARDS; i++) {
        shard_t *s = &d->shards[i];
        ext_t *empty = NULL, *last = NULL;
        uintptr_t base;
        size_t size;
        ext_t *e;
        pthread_mutex_lock(&s->lock);
        while ((e = vmh_arena_take_empty_extent(s->arena, &base, &size))) {
            vmh_registry_set(e->range->base, e->range->size, NULL);
            if (e->prev)
                e->prev->next = e->next;
            else
                s->exts = e->next;
            if (e->next)
                e->next->prev = e->prev;
            e->prev = NULL;
            e->next = empty;
            if (!empty)
                last = e;
            empty = e;
        }
        shard_note(s);
        pthread_mutex_unlock(&s->lock);
        if (!empty)
            continue;
        for (e = empty; e; e = e->next) {
            bytes += e->range->size;
            idle_gauge(-(int64_t)e->range->size);
            vmh_range_destroy(e->range);
            e->range = NULL;
            e->extent = NULL;
        }
        /* A registry reader may still hold one of these records: keep them (type-stable). */
        pthread_mutex_lock(&s->lock);
        last->next = s->spare;
        s->spare = empty;
        pthread_mutex_unlock(&s->lock);
    }
    if (bytes)
        vmh_count(VMH_STAT_trims, 1);
    return bytes;
}

/* ---- creating memory ---------------------------------------------------------------------- */

/* Address space for a buffer of `size` bytes that may grow: headroom, within the budget. */
static size_t reserve_for(size_t size, bool growable)
{
    size_t reserve = size;
    if (growable && vmh_opt.headroom) {
        size_t extra = size < vmh_opt.headroom ? size : vmh_opt.headroom;
        if (extra <= SIZE_MAX - size)
            reserve = size + extra;
    }
    int64_t used = vmh_gauge_get(VMH_STAT_bytes_reserved);
    if (vmh_opt.va_limit && (size_t)used + reserve > vmh_opt.va_limit)
        reserve = size;
    return reserve;
}

static bool va_exhausted(size_t reserve)
{
    int64_t used = vmh_gauge_get(VMH_STAT_bytes_reserved);
    return vmh_opt.va_limit && (size_t)used + reserve > vmh_opt.va_limit;
}

/* One chunk of `size` bytes mapped in a range of its own. On out of memory the device is
 * trimmed (and parked frees released) and the creation tried once more: memory held idle by
 * the library must never make the program fail. */
static CUresult range_new(vdev_t *d, size_t size, size_t reserve, vmh_range_t **out)
{
    for (int attempt = 0;; attempt++) {
        if (va_exhausted(reserve)) {
            vmh_handle_last_failure = VMH_FAILED_RESERVE;
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        vmh_alloc_t *a;
        CUresult rc = vmh_alloc_create(size, &d->prop, d->access, d->naccess, &a);
        if (rc == CUDA_SUCCESS) {
            rc = vmh_range_create(&a, 1, reserve, 0, 0, out);
            vmh_alloc_unref(a);
        }
        if (rc != CUDA_ERROR_OUT_OF_MEMORY || attempt > 0)
            return rc;
        vmh_count(VMH_STAT_oom_retries, 1);
        vmh_pressure_fn hook = atomic_load(&pressure_hook);
        if (hook)
            hook(); /* lets other layers drop what pins freed memory (ipc.c: stale exports) */
        if (dev_has_parked(d))
            dev_sync(d);
        if (dev_trim(d) == 0 && !dev_has_parked(d) && attempt == 0) {
            /* Nothing was idle: the device really is full. */
            return rc;
        }
    }
}

/* A cached buffer of at least `rounded` bytes and at most `slack` more. */
static big_t *cache_find_locked(vdev_t *d, size_t rounded, size_t slack)
{
    big_t *best = NULL;
    for (big_t *b = d->cache.head; b; b = b->next) {
        size_t s = b->range->size;
        if (s >= rounded && s - rounded <= slack && (!best || s < best->range->size)) {
            best = b;
            if (s == rounded)
                break;
        }
    }
    return best;
}

/* A cached buffer of at least `rounded` bytes and at most 1/8 more, off the cache. The caller
 * has taken `rounded` usable bytes (usable_take); the bytes beyond are taken here, and a
 * larger buffer that would pass VMMHOOK_MEM_LIMIT is not used. */
static big_t *cache_take_locked(vdev_t *d, size_t rounded)
{
    big_t *best = cache_find_locked(d, rounded, rounded / 8);
    if (best && best->range->size > rounded && !usable_take(d, best->range->size - rounded))
        best = cache_find_locked(d, rounded, 0);
    if (best)
        list_remove(&d->cache, best);
    return best;
}

_Thread_local void *vmh_alloc_site __attribute__((tls_model("initial-exec")));

static void make_live_locked(vdev_t *d, big_t *b, size_t size, bool growable)
{
    b->site = vmh_alloc_site;
    b->state = BIG_LIVE;
    b->req = size;
    b->growable = growable;
    list_push(&d->live, b); /* its usable bytes were taken by the caller */
}

static CUresult big_alloc(vdev_t *d, size_t size, bool growable, CUdeviceptr *out)
{
    size_t rounded;
    if (!round_up(size, d->gran, &rounded) || !usable_take(d, rounded))
        return CUDA_ERROR_OUT_OF_MEMORY;
    for (int attempt = 0;; attempt++) {
        pthread_mutex_lock(&d->lock);
        big_t *b = cache_take_locked(d, rounded);
        if (b) {
            make_live_locked(d, b, size, growable);
            pthread_mutex_unlock(&d->lock);
            idle_gauge(-(int64_t)b->range->size);
            vmh_count(VMH_STAT_cache_hits, 1);
            *out = b->range->base;
            return CUDA_SUCCESS;
        }
        bool parked = dev_has_parked_locked(d);
        pthread_mutex_unlock(&d->lock);
        if (!parked || attempt > 0 || dev_sync(d) != CUDA_SUCCESS)
            break;
    }

    /* A miss: recycle idle memory before asking for more, so that the cache does not make the
     * footprint grow beyond a small allowance: 1/32 of the live bytes, or up to 256 MiB (within
     * VMMHOOK_CACHE_LIMIT) for programs that repeat a few sizes, such as PyTorch without its
     * caching allocator. Memory pressure trims the rest anyway. */
    pthread_mutex_lock(&d->lock);
    size_t floor = vmh_opt.cache_limit < CACHE_FLOOR ? vmh_opt.cache_limit : CACHE_FLOOR;
    size_t live = atomic_load_explicit(&d->live_usable, memory_order_relaxed);
    size_t allowance = live / 32 > floor ? live / 32 : floor;
    big_t *taken = d->cache.bytes + rounded > allowance
                       ? cache_evict_locked(d, d->cache.bytes + rounded - allowance)
                       : NULL;
    pthread_mutex_unlock(&d->lock);
    evicted_destroy(d, taken);

    vmh_range_t *r;
    CUresult rc = range_new(d, rounded, reserve_for(rounded, growable), &r);
    if (rc != CUDA_SUCCESS) {
        usable_give(d, rounded);
        return rc;
    }
    pthread_mutex_lock(&d->lock);
    big_t *b = big_get(d);
    if (!b || !vmh_registry_set(r->base, r->size, b)) {
        if (b)
            list_push(&d->unused, b);
        pthread_mutex_unlock(&d->lock);
        vmh_range_destroy(r);
        usable_give(d, rounded);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    b->range = r;
    make_live_locked(d, b, size, growable);
    pthread_mutex_unlock(&d->lock);
    *out = r->base;
    return CUDA_SUCCESS;
}

/* Adds a packing extent large enough for `size` to shard s. */
static CUresult extent_add(vdev_t *d, shard_t *s, size_t size)
{
    size_t want;
    if (!round_up(size, d->gran, &want))
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&s->lock);
    if (want < s->extent_next)
        want = s->extent_next;
    if (s->extent_next < EXTENT_MAX)
        s->extent_next *= 2;
    pthread_mutex_unlock(&s->lock);

    vmh_range_t *r;
    CUresult rc = range_new(d, want, want, &r);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&s->lock);
    ext_t *e = s->spare;
    if (e) {
        s->spare = e->next;
    } else if ((e = calloc(1, sizeof *e))) {
        e->o.kind = OWN_EXTENT;
        e->o.dev = d;
        e->shard = s;
    }
    if (e) {
        e->range = r;
        e->extent = vmh_arena_add_extent(s->arena, r->base, r->size, e);
    }
    if (!e || !e->extent || !vmh_registry_set(r->base, r->size, e)) {
        /* An extent the arena knows but the registry does not cannot happen: the arena
         * only learns of it above, and add_extent failing leaves nothing behind. */
        if (e) {
            e->range = NULL;
            e->extent = NULL;
            e->prev = NULL;
            e->next = s->spare;
            s->spare = e;
        }
        pthread_mutex_unlock(&s->lock);
        vmh_range_destroy(r);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    e->prev = NULL;
    e->next = s->exts;
    if (s->exts)
        s->exts->prev = e;
    s->exts = e;
    shard_note(s);
    pthread_mutex_unlock(&s->lock);
    idle_gauge((int64_t)r->size);
    return CUDA_SUCCESS;
}

/* Serves size bytes from shard s: 0, ENOMEM when it has no room, EBUSY when `try` and another
 * thread holds the shard. */
static int shard_alloc(shard_t *s, size_t size, bool try, CUdeviceptr *out, size_t *usable)
{
    if (try) {
        if (pthread_mutex_trylock(&s->lock) != 0)
            return EBUSY;
    } else {
        pthread_mutex_lock(&s->lock);
    }
    uintptr_t p;
    int rc = vmh_arena_alloc(s->arena, size, &p);
    if (rc == 0) {
        vmh_extent_t *e = ((ext_t *)vmh_registry_get(p))->extent;
        vmh_block_info_t info;
        vmh_arena_find(e, p, &info);
        *usable = info.usable;
        *out = p;
        shard_note(s);
    }
    pthread_mutex_unlock(&s->lock);
    return rc == 0 ? 0 : ENOMEM;
}

/* Free space in the other shards, before any memory is made. Shards whose free bytes (the
 * hint) are fewer than `want` are not tried. Busy ones are waited for only when wait_busy:
 * a thread whose own shard has no extent yet and meets contention elsewhere gives its shard
 * a first extent instead, which is what spreads threads over the shards (at most one chunk
 * per shard); beyond that, free space anywhere comes before growth. */
static bool others_alloc(vdev_t *d, unsigned home, size_t size, size_t want, bool wait_busy,
                         CUdeviceptr *out, size_t *usable)
{
    unsigned busy = 0;
    for (unsigned i = 1; i < SHARDS; i++) {
        unsigned k = (home + i) % SHARDS;
        if (atomic_load_explicit(&d->shards[k].free, memory_order_relaxed) < want)
            continue;
        int rc = shard_alloc(&d->shards[k], size, true, out, usable);
        if (rc == 0)
            return true;
        if (rc == EBUSY)
            busy |= 1u << k;
    }
    for (unsigned k = 0; wait_busy && busy && k < SHARDS; k++)
        if ((busy & (1u << k)) && shard_alloc(&d->shards[k], size, false, out, usable) == 0)
            return true;
    return false;
}

static CUresult packed_alloc(vdev_t *d, size_t size, CUdeviceptr *out)
{
    size_t want;
    if (!round_up(size, VMH_ARENA_ALIGN, &want) || !usable_take(d, want))
        return CUDA_ERROR_OUT_OF_MEMORY;
    unsigned home = vmh_heap_thread_shard();
    size_t usable = 0;
    bool synced = false;
    /* The thread's own shard, then free space in the others, then parked frees released by
     * a synchronize, and only then a new extent (in the thread's own shard). Other threads
     * may take the space of an extent this thread just added before it gets to use it: then
     * it adds another (each extent_add either makes memory or reports the driver's out of
     * memory after trimming), within a bound that only a pathological race could reach. */
    shard_t *mine = &d->shards[home];
    for (int grown = 0;; grown++) {
        if ((atomic_load_explicit(&mine->free, memory_order_relaxed) >= want &&
             shard_alloc(mine, size, false, out, &usable) == 0) ||
            others_alloc(d, home, size, want,
                         atomic_load_explicit(&mine->extents, memory_order_relaxed) > 0, out,
                         &usable))
            break;
        if (dev_packed_parked(d) && !synced) {
            synced = true;
            if (dev_sync(d) == CUDA_SUCCESS)
                continue;
        }
        CUresult rc = grown >= 64 ? CUDA_ERROR_OUT_OF_MEMORY : extent_add(d, mine, size);
        if (rc != CUDA_SUCCESS) {
            usable_give(d, want);
            return rc;
        }
        synced = false; /* frees parked meanwhile may be released by a later wait */
    }
    if (usable != want) /* the arena hands out exactly the rounded size; kept exact anyway */
        atomic_fetch_add_explicit(&d->live_usable, usable - want, memory_order_relaxed);
    idle_gauge(-(int64_t)usable);
    return CUDA_SUCCESS;
}

static CUresult alloc_on(vdev_t *d, size_t size, bool growable, CUdeviceptr *out)
{
    /* Buffers that may grow (vmm_realloc) are packed only when small (below half a chunk):
     * a buffer of its own grows in place or by remapping, a packed one by a copy. */
    size_t pack_below = vmh_opt.pack_below;
    if (growable && pack_below > d->gran / 2)
        pack_below = d->gran / 2;
    CUresult rc = size < pack_below ? packed_alloc(d, size, out)
                                    : big_alloc(d, size, growable, out);
    if (rc == CUDA_SUCCESS) {
        vmh_count(VMH_STAT_served_allocs, 1);
        vmh_gauge_add(VMH_STAT_bytes_requested, (int64_t)size);
    }
    return rc;
}

/* ---- the interface ------------------------------------------------------------------------ */

static void heap_load(void)
{
    /* the trace clock starts here, and the trace file exists from now */
    vmh_stats_configure(vmh_options_load());
}

bool vmh_heap_ready(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, heap_load);
    return !vmh_opt.disable && !atomic_load_explicit(&shut_down, memory_order_relaxed) &&
           vmh_driver_ready();
}

/* What both allocation entry points share: the checks before a device is chosen, and serving
 * on it (rc: how choosing the device went) with the trace line either way. */
static CUresult request_check(size_t size, const CUdeviceptr *out)
{
    if (atomic_load_explicit(&shut_down, memory_order_relaxed))
        return CUDA_ERROR_NOT_SUPPORTED;
    return !out || size == 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

static CUresult serve_traced(vdev_t *d, CUresult rc, size_t size, CUdeviceptr *out)
{
    if (rc == CUDA_SUCCESS)
        rc = alloc_on(d, size, false, out);
    vmh_trace(rc == CUDA_SUCCESS ? "allocate" : "allocate failure",
              rc == CUDA_SUCCESS ? *out : 0, size, NULL);
    return rc;
}

CUresult vmh_heap_alloc(size_t size, CUdeviceptr *out)
{
    CUresult rc = request_check(size, out);
    if (rc != CUDA_SUCCESS)
        return rc;
    vdev_t *d;
    rc = dev_current(&d);
    if (rc != CUDA_SUCCESS)
        return rc;
    return serve_traced(d, rc, size, out);
}

CUresult vmh_heap_alloc_on(int device, size_t size, CUdeviceptr *out)
{
    CUresult rc = request_check(size, out);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (device < 0 || device >= MAX_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    vdev_t *d = atomic_load_explicit(&devs[device], memory_order_acquire);
    if (!d) {
        /* The device's state needs a context to synchronize later: the current one when it
         * is this device's, else the device's primary context. */
        CUcontext ctx = NULL;
        CUdevice cur = -1, dev;
        if (vmh_drv.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx ||
            vmh_drv.cuCtxGetDevice(&cur) != CUDA_SUCCESS || cur != device) {
            rc = vmh_drv.cuDeviceGet(&dev, device);
            if (rc == CUDA_SUCCESS)
                rc = vmh_drv.cuDevicePrimaryCtxRetain(&ctx, dev);
        }
        if (rc == CUDA_SUCCESS)
            rc = dev_by_ordinal(device, ctx, &d);
    } else if (d->unsupported) {
        rc = CUDA_ERROR_NOT_SUPPORTED;
    }
    return serve_traced(d, rc, size, out);
}

CUresult vmh_heap_alloc_pitch(size_t width, size_t height, unsigned int elem, CUdeviceptr *out,
                              size_t *pitch)
{
    if (!out || !pitch || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t p;
    if (!round_up(width, PITCH_ALIGN, &p) || height > SIZE_MAX / p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = vmh_heap_alloc(p * height, out);
    if (rc == CUDA_SUCCESS)
        *pitch = p;
    return rc;
}

/* The mutex that guards an owner: its shard's for an extent, its device's for a big buffer. */
static pthread_mutex_t *owner_mutex(owner_t *o)
{
    return o->kind == OWN_EXTENT ? &((ext_t *)o)->shard->lock : &o->dev->lock;
}

/* Finds the owner of p and locks it (owner_mutex); NULL (nothing locked) when p is not ours.
 * Unlock with owner_unlock(). */
static owner_t *owner_lock(CUdeviceptr p)
{
    owner_t *o = vmh_registry_get(p);
    if (!o || o->kind == OWN_DEAD)
        return NULL;
    pthread_mutex_t *m = owner_mutex(o);
    pthread_mutex_lock(m);
    if (vmh_registry_get(p) != o) { /* released meanwhile */
        pthread_mutex_unlock(m);
        return NULL;
    }
    return o;
}

static void owner_unlock(owner_t *o)
{
    pthread_mutex_unlock(owner_mutex(o));
}

static CUresult park_range_locked(vdev_t *d, vmh_range_t *r, CUdeviceptr dead,
                                  size_t dead_len);

/* Packed buffers of a shard that were exported: a small unsorted set (exports are rare);
 * the shard is locked. */
static bool exported_packed_take_locked(shard_t *s, CUdeviceptr p)
{
    for (size_t i = 0; i < s->nexported; i++) {
        if (s->exported[i] == p) {
            s->exported[i] = s->exported[--s->nexported];
            return true;
        }
    }
    return false;
}

/* Parks a live buffer; its owner is locked (owner_lock). */
static CUresult park_locked(vdev_t *d, owner_t *o, CUdeviceptr p, size_t *req)
{
    uint64_t gen = atomic_load(&d->gen);
    if (o->kind == OWN_EXTENT) {
        vmh_block_info_t info;
        shard_t *s = ((ext_t *)o)->shard;
        if (exported_packed_take_locked(s, p))
            gen = UINT64_MAX; /* shared with another process: the slot is never reused */
        if (vmh_arena_park(s->arena, ((ext_t *)o)->extent, p, gen, &info) != 0)
            return CUDA_ERROR_INVALID_VALUE;
        shard_note(s);
        usable_give(d, info.usable);
        idle_gauge((int64_t)info.usable);
        *req = info.size;
        return CUDA_SUCCESS;
    }
    big_t *b = (big_t *)o;
    if (b->state != BIG_LIVE || p != b->range->base)
        return CUDA_ERROR_INVALID_VALUE; /* interior pointer, double free, or being resized */
    if (b->exported) {
        /* Importers may still map these chunks: they must never hold another buffer. The
         * range is unmapped once queued work is done; the physical memory lives on for as
         * long as an importer holds it. */
        if (park_range_locked(d, b->range, b->range->base, b->range->size) != CUDA_SUCCESS)
            return CUDA_ERROR_OUT_OF_MEMORY;
        list_remove(&d->live, b);
        usable_give(d, b->range->size);
        *req = b->req;
        b->range = NULL;
        b->exported = false;
        b->state = BIG_UNUSED;
        list_push(&d->unused, b);
        return CUDA_SUCCESS;
    }
    list_remove(&d->live, b);
    usable_give(d, b->range->size);
    b->state = BIG_PARKED;
    b->gen = gen;
    list_push(&d->parked, b);
    idle_gauge((int64_t)b->range->size);
    *req = b->req;
    return CUDA_SUCCESS;
}

CUresult vmh_heap_free(CUdeviceptr p, CUstream stream, bool async)
{
    owner_t *o = owner_lock(p);
    if (!o)
        return CUDA_ERROR_NOT_FOUND;
    vdev_t *d = o->dev;
    if (atomic_load_explicit(&shut_down, memory_order_relaxed)) {
        /* Late frees from other destructors: the driver may be gone; forget quietly. */
        owner_unlock(o);
        return CUDA_SUCCESS;
    }
    size_t req = 0;
    CUresult rc = park_locked(d, o, p, &req);
    owner_unlock(o);
    if (rc != CUDA_SUCCESS)
        return rc;
    vmh_count(VMH_STAT_served_frees, 1);
    vmh_gauge_add(VMH_STAT_bytes_requested, -(int64_t)req);
    vmh_trace("free", p, req, stream);
    if (vmh_opt.free_sync && !async)
        dev_sync(d);
    return CUDA_SUCCESS;
}

void vmh_heap_on_pressure(vmh_pressure_fn fn)
{
    atomic_store(&pressure_hook, fn);
}

bool vmh_heap_holds(CUdeviceptr p)
{
    return vmh_registry_get(p) != NULL;
}

bool vmh_heap_find(CUdeviceptr p, vmh_buffer_info_t *info)
{
    owner_t *o = owner_lock(p);
    if (!o)
        return false;
    vdev_t *d = o->dev;
    bool found = false;
    if (o->kind == OWN_EXTENT) {
        vmh_block_info_t bi;
        if (vmh_arena_find(((ext_t *)o)->extent, p, &bi) && p < bi.base + bi.size) {
            *info = (vmh_buffer_info_t){bi.base, bi.size, bi.usable, d->ordinal, true};
            found = true;
        }
    } else {
        big_t *b = (big_t *)o;
        if ((b->state == BIG_LIVE || b->state == BIG_RESIZING) && p < b->range->base + b->req) {
            *info = (vmh_buffer_info_t){b->range->base, b->req, b->range->size, d->ordinal,
                                        false};
            found = true;
        }
    }
    owner_unlock(o);
    return found;
}

/* ---- realloc -------------------------------------------------------------------------- */

/* Leaves a range to be destroyed once work queued so far is done; locked. */
static CUresult park_range_locked(vdev_t *d, vmh_range_t *r, CUdeviceptr dead, size_t dead_len)
{
    old_range_t *o = malloc(sizeof *o);
    if (!o)
        return CUDA_ERROR_OUT_OF_MEMORY;
    o->range = r;
    o->dead = dead;
    o->dead_len = dead_len;
    vmh_registry_set(dead, dead_len, &dead_owner);
    o->gen = atomic_load(&d->gen);
    o->next = d->old;
    d->old = o;
    return CUDA_SUCCESS;
}

/* Packed buffer that outgrows its block, or a size change across the packing threshold:
 * a new buffer and one device copy. */
static CUresult realloc_by_copy(vdev_t *d, CUdeviceptr *p, size_t old_size, size_t size,
                                CUstream stream, bool async)
{
    CUdeviceptr np;
    CUresult rc = alloc_on(d, size, true, &np);
    if (rc != CUDA_SUCCESS)
        return rc;
    size_t n = old_size < size ? old_size : size;
    if (async) {
        rc = vmh_drv.cuMemcpyDtoDAsync(np, *p, n, stream);
    } else {
        /* Work on any stream may still write the old buffer: wait for it, as cudaFree
         * would, then copy. */
        rc = dev_sync(d);
        if (rc == CUDA_SUCCESS)
            rc = vmh_drv.cuMemcpyDtoD(np, *p, n);
    }
    if (rc != CUDA_SUCCESS) {
        vmh_heap_free(np, stream, async);
        return rc;
    }
    vmh_count(VMH_STAT_copies, 1);
    vmh_heap_free(*p, stream, async);
    *p = np;
    return CUDA_SUCCESS;
}

static CUresult realloc_big(vdev_t *d, big_t *b, CUdeviceptr *p, size_t size, CUstream stream,
                            bool async)
{
    /* Locked on entry; unlocked on return. */
    size_t rounded;
    if (!round_up(size, d->gran, &rounded)) {
        pthread_mutex_unlock(&d->lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    vmh_range_t *r = b->range;
    if (rounded <= r->size) {
        vmh_range_t *nr = NULL;
        bool shrunk = false;
        CUresult rc = vmh_range_shrink(r, rounded, &nr);
        if (rc == CUDA_SUCCESS && nr->size < r->size) {
            rc = park_range_locked(d, r, r->base + nr->size, r->size - nr->size);
            if (rc == CUDA_SUCCESS) {
                shrunk = true;
                usable_give(d, r->size - nr->size);
                b->range = nr;
                nr = NULL;
            }
        }
        vmh_gauge_add(VMH_STAT_bytes_requested, (int64_t)size - (int64_t)b->req);
        if (rc == CUDA_SUCCESS)
            b->req = size;
        pthread_mutex_unlock(&d->lock);
        vmh_range_destroy(nr); /* only references: r keeps every mapping alive */
        if (shrunk && !async)
            dev_sync(d); /* the chunks past the new size go once queued work is done */
        return rc;
    }
    size_t extra = rounded - r->size; /* usable bytes taken for the growth */
    if (!usable_take(d, extra)) {
        pthread_mutex_unlock(&d->lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (d->old) {
        /* The tail of an earlier shrink may still be mapped in this buffer's headroom. */
        pthread_mutex_unlock(&d->lock);
        dev_sync(d);
        pthread_mutex_lock(&d->lock);
        if (b->state != BIG_LIVE || b->range != r) {
            pthread_mutex_unlock(&d->lock);
            usable_give(d, extra);
            return CUDA_ERROR_INVALID_VALUE; /* freed or resized by another thread meanwhile */
        }
    }
    /* The driver calls run without the lock; RESIZING keeps frees and other resizes off. */
    b->state = BIG_RESIZING;
    pthread_mutex_unlock(&d->lock);

    vmh_alloc_t *a;
    CUresult rc = vmh_alloc_create(rounded - r->size, &d->prop, d->access, d->naccess, &a);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
        dev_trim(d);
        rc = vmh_alloc_create(rounded - r->size, &d->prop, d->access, d->naccess, &a);
    }
    vmh_range_t *nr = NULL;
    vmh_grow_kind_t kind = VMH_GROW_MOVED;
    if (rc == CUDA_SUCCESS) {
        size_t reserve = reserve_for(rounded, true);
        if (va_exhausted(reserve - r->size)) {
            vmh_handle_last_failure = VMH_FAILED_RESERVE;
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            rc = vmh_range_grow(r, &a, 1, reserve, 0, true, &nr, &kind);
        }
        vmh_alloc_unref(a);
    }

    pthread_mutex_lock(&d->lock);
    if (rc == CUDA_SUCCESS) {
        bool moved = kind == VMH_GROW_MOVED;
        CUdeviceptr from = moved ? nr->base : r->base + r->size;
        size_t len = moved ? nr->size : nr->size - r->size;
        if (!vmh_registry_set(from, len, b) ||
            (moved && park_range_locked(d, r, r->base, r->size) != 0)) {
            if (moved)
                vmh_registry_set(from, len, NULL);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (rc != CUDA_SUCCESS) {
        b->state = BIG_LIVE;
        pthread_mutex_unlock(&d->lock);
        vmh_range_destroy(nr);
        usable_give(d, extra);
        return rc;
    }
    bool moved = kind == VMH_GROW_MOVED;
    if (nr->size - r->size != extra) /* the range grows by exactly the chunk added */
        atomic_fetch_add_explicit(&d->live_usable, nr->size - r->size - extra,
                                  memory_order_relaxed);
    vmh_gauge_add(VMH_STAT_bytes_requested, (int64_t)size - (int64_t)b->req);
    b->range = nr;
    b->req = size;
    b->state = BIG_LIVE;
    pthread_mutex_unlock(&d->lock);
    vmh_count(moved ? VMH_STAT_moves : VMH_STAT_grows_in_place, 1);
    if (!moved)
        vmh_range_destroy(r); /* references only: nr holds every mapping */
    *p = nr->base;
    if (moved && !async)
        dev_sync(d); /* the old address goes once work queued before the call is done */
    return CUDA_SUCCESS;
}

CUresult vmh_heap_realloc(CUdeviceptr *p, size_t size, CUstream stream, bool async)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    if (atomic_load_explicit(&shut_down, memory_order_relaxed))
        return CUDA_ERROR_NOT_SUPPORTED;
    if (*p == 0) {
        if (size == 0)
            return CUDA_SUCCESS;
        vdev_t *d;
        CUresult rc = dev_current(&d);
        if (rc == CUDA_SUCCESS)
            rc = alloc_on(d, size, true, p);
        return rc;
    }
    if (size == 0) {
        CUresult rc = vmh_heap_free(*p, stream, async);
        if (rc == CUDA_SUCCESS)
            *p = 0;
        return rc;
    }
    owner_t *o = owner_lock(*p);
    if (!o)
        return CUDA_ERROR_NOT_FOUND;
    vdev_t *d = o->dev;
    if (o->kind == OWN_BIG) {
        big_t *b = (big_t *)o;
        if (b->state != BIG_LIVE || *p != b->range->base) {
            pthread_mutex_unlock(&d->lock);
            return CUDA_ERROR_INVALID_VALUE;
        }
        return realloc_big(d, b, p, size, stream, async);
    }
    ext_t *e = (ext_t *)o;
    shard_t *s = e->shard; /* locked */
    vmh_block_info_t info;
    if (!vmh_arena_find(e->extent, *p, &info) || info.base != *p) {
        owner_unlock(o);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (size < (vmh_opt.pack_below < d->gran / 2 ? vmh_opt.pack_below : d->gran / 2)) {
        /* In place: the growth's usable bytes are taken first (VMMHOOK_MEM_LIMIT). */
        size_t want = (size + VMH_ARENA_ALIGN - 1) & ~(size_t)(VMH_ARENA_ALIGN - 1);
        size_t extra = want > info.usable ? want - info.usable : 0;
        if (extra == 0 || usable_take(d, extra)) {
            if (vmh_arena_resize(s->arena, e->extent, *p, size) == 0) {
                vmh_block_info_t now;
                vmh_arena_find(e->extent, *p, &now);
                shard_note(s);
                /* now.usable - info.usable in all, of which extra is taken already */
                atomic_fetch_add_explicit(&d->live_usable, now.usable - info.usable - extra,
                                          memory_order_relaxed);
                owner_unlock(o);
                vmh_gauge_add(VMH_STAT_bytes_requested, (int64_t)size - (int64_t)info.size);
                return CUDA_SUCCESS;
            }
            usable_give(d, extra);
        }
    }
    owner_unlock(o);
    return realloc_by_copy(d, p, info.size, size, stream, async);
}

/* ---- sharing -------------------------------------------------------------------------- */

CUresult vmh_heap_export(CUdeviceptr p, vmh_export_t *out)
{
    owner_t *o = owner_lock(p);
    if (!o)
        return CUDA_ERROR_NOT_FOUND;
    vdev_t *d = o->dev;
    memset(out, 0, sizeof *out);
    const vmh_range_t *r;
    CUresult rc = CUDA_SUCCESS;
    if (o->kind == OWN_EXTENT) {
        vmh_block_info_t bi;
        ext_t *e = (ext_t *)o;
        if (!vmh_arena_find(e->extent, p, &bi)) {
            rc = CUDA_ERROR_INVALID_VALUE;
        } else {
            r = e->range;
            out->base = bi.base;
            out->size = bi.size;
            out->offset = bi.base - r->base;
            shard_t *s = e->shard; /* locked */
            if (s->nexported == s->exported_cap) {
                size_t cap = s->exported_cap ? 2 * s->exported_cap : 16;
                CUdeviceptr *grown = realloc(s->exported, cap * sizeof *grown);
                if (!grown)
                    rc = CUDA_ERROR_OUT_OF_MEMORY;
                else {
                    s->exported = grown;
                    s->exported_cap = cap;
                }
            }
            if (rc == CUDA_SUCCESS) {
                exported_packed_take_locked(s, bi.base); /* exported twice: listed once */
                s->exported[s->nexported++] = bi.base;
            }
        }
    } else {
        big_t *b = (big_t *)o;
        if (b->state != BIG_LIVE && b->state != BIG_RESIZING) {
            rc = CUDA_ERROR_INVALID_VALUE;
        } else {
            r = b->range;
            out->base = r->base;
            out->size = b->req;
            out->offset = 0;
            b->exported = true;
        }
    }
    if (rc == CUDA_SUCCESS) {
        out->chunks = malloc(r->nmaps * sizeof *out->chunks);
        if (!out->chunks) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            for (size_t i = 0; i < r->nmaps; i++)
                out->chunks[i] = vmh_alloc_ref(r->maps[i]->alloc);
            out->nchunks = r->nmaps;
            out->device = d->ordinal;
        }
    }
    owner_unlock(o);
    return rc;
}

void vmh_heap_export_release(vmh_export_t *ex)
{
    for (size_t i = 0; i < ex->nchunks; i++)
        vmh_alloc_unref(ex->chunks[i]);
    free(ex->chunks);
    memset(ex, 0, sizeof *ex);
}

/* Adds or removes peer's descriptor in a descriptor list. */
static void edit_access(CUmemAccessDesc *acc, int *n, int peer, bool grant)
{
    for (int i = 0; i < *n; i++) {
        if (acc[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE && acc[i].location.id == peer) {
            if (!grant)
                acc[i] = acc[--*n];
            return;
        }
    }
    if (grant && *n < VMH_MAX_ACCESS) {
        acc[*n].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        acc[*n].location.id = peer;
        acc[*n].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        (*n)++;
    }
}

static CUresult range_set_peer(const vmh_range_t *r, const CUmemAccessDesc *desc, bool grant)
{
    CUresult rc = CUDA_SUCCESS;
    for (size_t i = 0; r && i < r->nmaps && rc == CUDA_SUCCESS; i++) {
        vmh_map_t *m = r->maps[i];
        rc = vmh_drv.cuMemSetAccess(m->ptr, m->size, desc, 1);
        vmh_count(VMH_STAT_driver_calls, 1);
        /* The chunk carries its descriptors wherever it is mapped next. */
        if (rc == CUDA_SUCCESS)
            edit_access(m->alloc->access, &m->alloc->naccess, desc->location.id, grant);
    }
    return rc;
}

CUresult vmh_heap_set_peer_access(int owner, int peer, bool grant)
{
    if (owner < 0 || owner >= MAX_DEVICES || peer < 0 || peer >= MAX_DEVICES || owner == peer)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&devs_lock);
    if (grant)
        peer_requests[owner] |= 1ull << peer;
    else
        peer_requests[owner] &= ~(1ull << peer);
    vdev_t *d = atomic_load_explicit(&devs[owner], memory_order_acquire);
    pthread_mutex_unlock(&devs_lock);
    if (!d || d->unsupported)
        return CUDA_SUCCESS; /* applied when the device's first buffer is made */

    CUmemAccessDesc desc;
    memset(&desc, 0, sizeof desc);
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = peer;
    desc.flags = grant ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
    /* A rare call that must reach every mapping of the device at once: the device lock is
     * held across the driver calls, so no big buffer appears or moves meanwhile, and each
     * shard's lock while its extents are walked. */
    pthread_mutex_lock(&d->lock);
    edit_access(d->access, &d->naccess, peer, grant);
    CUresult rc = CUDA_SUCCESS;
    biglist_t *lists[] = {&d->live, &d->parked, &d->cache};
    for (size_t l = 0; l < sizeof lists / sizeof lists[0]; l++)
        for (big_t *b = lists[l]->head; b && rc == CUDA_SUCCESS; b = b->next)
            rc = range_set_peer(b->range, &desc, grant);
    for (int i = 0; i < SHARDS && rc == CUDA_SUCCESS; i++) {
        shard_t *s = &d->shards[i]; /* d->lock, then one shard lock: the lock order */
        pthread_mutex_lock(&s->lock);
        for (ext_t *e = s->exts; e && rc == CUDA_SUCCESS; e = e->next)
            rc = range_set_peer(e->range, &desc, grant);
        pthread_mutex_unlock(&s->lock);
    }
    for (old_range_t *o = d->old; o && rc == CUDA_SUCCESS; o = o->next)
        rc = range_set_peer(o->range, &desc, grant);
    pthread_mutex_unlock(&d->lock);
    return rc;
}

/* ---- maintenance ------------------------------------------------------------------------ */

size_t vmh_heap_trim(void)
{
    size_t bytes = 0;
    for (int i = 0; i < MAX_DEVICES; i++) {
        vdev_t *d = atomic_load_explicit(&devs[i], memory_order_acquire);
        if (!d)
            continue;
        if (dev_has_parked(d))
            dev_sync(d);
        bytes += dev_trim(d);
    }
    return bytes;
}

size_t vmh_heap_idle_bytes(int device)
{
    if (device < 0 || device >= MAX_DEVICES)
        return 0;
    vdev_t *d = atomic_load_explicit(&devs[device], memory_order_acquire);
    if (!d)
        return 0;
    pthread_mutex_lock(&d->lock);
    size_t idle = d->cache.bytes + d->parked.bytes;
    pthread_mutex_unlock(&d->lock);
    for (int i = 0; i < SHARDS; i++) {
        vmh_arena_stats_t s;
        pthread_mutex_lock(&d->shards[i].lock);
        vmh_arena_stats(d->shards[i].arena, &s);
        pthread_mutex_unlock(&d->shards[i].lock);
        idle += s.free + s.parked;
    }
    return idle;
}

static void report_packed_leak(const vmh_block_info_t *b, void *arg)
{
    vmh_leak_report_one(b->base, b->size, *(int *)arg, NULL);
}

void vmh_heap_shutdown(void)
{
    if (atomic_exchange(&shut_down, true))
        return;
    if (!vmh_opt.leaks)
        return;
    vmh_leak_report_begin();
    for (int i = 0; i < MAX_DEVICES; i++) {
        vdev_t *d = atomic_load_explicit(&devs[i], memory_order_acquire);
        if (!d)
            continue;
        pthread_mutex_lock(&d->lock);
        for (big_t *b = d->live.head; b; b = b->next)
            vmh_leak_report_one(b->range->base, b->req, i, b->site);
        pthread_mutex_unlock(&d->lock);
        for (int k = 0; k < SHARDS; k++) {
            pthread_mutex_lock(&d->shards[k].lock);
            vmh_arena_for_each_live(d->shards[k].arena, report_packed_leak, &i);
            pthread_mutex_unlock(&d->shards[k].lock);
        }
    }
    vmh_leak_report_end();
}

static void free_bigs(biglist_t *l)
{
    for (big_t *b = l->head, *next; b; b = next) {
        next = b->next;
        if (b->range) {
            vmh_registry_set(b->range->base, b->range->size, NULL);
            vmh_range_destroy(b->range);
        }
        free(b);
    }
}

void vmh_heap_reset(void)
{
    for (int i = 0; i < MAX_DEVICES; i++) {
        vdev_t *d = atomic_exchange(&devs[i], NULL);
        if (!d)
            continue;
        free_bigs(&d->live);
        free_bigs(&d->parked);
        free_bigs(&d->cache);
        free_bigs(&d->unused);
        destroy_ranges(d->old);
        for (int k = 0; k < SHARDS; k++) {
            shard_t *s = &d->shards[k];
            for (ext_t *e = s->exts, *next; e; e = next) {
                next = e->next;
                vmh_registry_set(e->range->base, e->range->size, NULL);
                vmh_range_destroy(e->range);
                free(e);
            }
            for (ext_t *e = s->spare, *next; e; e = next) {
                next = e->next;
                free(e);
            }
            vmh_arena_delete(s->arena, NULL, NULL);
            pthread_mutex_destroy(&s->lock);
            free(s->exported);
        }
        pthread_mutex_destroy(&d->lock);
        pthread_mutex_destroy(&d->sync_lock);
        free(d);
    }
    memset(peer_requests, 0, sizeof peer_requests);
    atomic_store(&shut_down, false);
}
