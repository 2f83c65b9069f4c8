/* Layer "cache": idle ranges kept for reuse (see cache.h). */
#include "cache.h"

#include "list.h"
#include "registry.h"
#include "stats.h"
#include "witness.h"

#include <assert.h>
#include <stdint.h>
#include <stdlib.h>

#define CACHE_FLOOR ((size_t)256 << 20) /* idle bytes a miss may leave in the cache */

struct vmh_idle {
    vmh_range_t *range;
    vmh_idle_t *prev, *next;
};

/* Written by the front's configure before any device is used; read without a lock after. */
static vmh_cache_settings_t settings;

void vmh_cache_configure(const vmh_cache_settings_t *s)
{
    settings = *s;
}

void vmh_cache_init(vmh_cache_t *c, vmh_dev_t *dev)
{
    c->dev = dev;
    pthread_mutex_init(&c->lock, NULL);
    c->head = c->tail = NULL;
    c->count = c->bytes = 0;
}

static void unlink_locked(vmh_cache_t *c, vmh_idle_t *e)
{
    vmh_assert_held(&c->lock);
    VMH_LIST_REMOVE(c->head, c->tail, e);
    assert(c->count > 0 && c->bytes >= e->range->size);
    c->count--;
    c->bytes -= e->range->size;
}

/* Takes up to `need` bytes of idle ranges (least recently freed first) off the cache and out
 * of the registry; the caller destroys them without the lock (destroy_taken). */
static vmh_idle_t *evict_locked(vmh_cache_t *c, size_t need)
{
    vmh_idle_t *taken = NULL;
    size_t got = 0;
    while (c->tail && got < need) {
        vmh_idle_t *e = c->tail;
        unlink_locked(c, e);
        /* dead until destroy_taken has unmapped it: a query must not reach the driver */
        vmh_registry_set(e->range->base, e->range->size, &vmh_owner_dead);
        got += e->range->size;
        e->next = taken;
        taken = e;
    }
    return taken;
}

/* Unmapped: the addresses are unknown again (before their reservation may go). */
static void forget(CUdeviceptr base, size_t size, void *arg)
{
    (void)arg;
    vmh_registry_set(base, size, NULL);
}

static size_t destroy_taken(vmh_idle_t *taken)
{
    size_t bytes = 0;
    for (vmh_idle_t *e = taken, *next; e; e = next) {
        next = e->next;
        bytes += e->range->size;
        vmh_gauge_add(VMH_STAT_bytes_cached, -(int64_t)e->range->size);
        vmh_range_destroy_then(e->range, forget, NULL);
        free(e);
    }
    return bytes;
}

void vmh_cache_put(vmh_cache_t *c, vmh_range_t *r)
{
    vmh_idle_t *e = malloc(sizeof *e);
    if (!e) { /* no host memory to remember it: give it back now (it is safe to) */
        vmh_registry_set(r->base, r->size, &vmh_owner_dead);
        vmh_gauge_add(VMH_STAT_bytes_cached, -(int64_t)r->size);
        vmh_range_destroy_then(r, forget, NULL);
        return;
    }
    e->range = r;
    vmh_lock(&c->lock, VMH_RANK_CACHE);
    vmh_registry_set(r->base, r->size, &vmh_owner_idle);
    VMH_LIST_PUSH(c->head, c->tail, e);
    c->count++;
    c->bytes += r->size;
    vmh_idle_t *over =
        c->bytes > settings.limit ? evict_locked(c, c->bytes - settings.limit) : NULL;
    vmh_unlock(&c->lock);
    destroy_taken(over);
}

/* An idle range of at least `rounded` bytes and at most `slack` more. */
static vmh_idle_t *find_locked(vmh_cache_t *c, size_t rounded, size_t slack)
{
    vmh_idle_t *best = NULL;
    for (vmh_idle_t *e = c->head; e; e = e->next) {
        size_t s = e->range->size;
        if (s >= rounded && s - rounded <= slack && (!best || s < best->range->size)) {
            best = e;
            if (s == rounded)
                break;
        }
    }
    return best;
}

vmh_range_t *vmh_cache_take(vmh_cache_t *c, size_t rounded)
{
    vmh_lock(&c->lock, VMH_RANK_CACHE);
    vmh_idle_t *best = find_locked(c, rounded, rounded / 8);
    if (best && best->range->size > rounded &&
        !vmh_dev_usable_take(c->dev, best->range->size - rounded))
        best = find_locked(c, rounded, 0);
    if (best)
        unlink_locked(c, best);
    vmh_unlock(&c->lock);
    if (!best)
        return NULL;
    vmh_range_t *r = best->range;
    assert(vmh_registry_get(r->base) == &vmh_owner_idle && "an idle range is registered idle");
    free(best);
    vmh_gauge_add(VMH_STAT_bytes_cached, -(int64_t)r->size);
    return r;
}

void vmh_cache_make_room(vmh_cache_t *c, size_t rounded, size_t parked)
{
    vmh_lock(&c->lock, VMH_RANK_CACHE);
    size_t floor = settings.limit < CACHE_FLOOR ? settings.limit : CACHE_FLOOR;
    size_t live = atomic_load_explicit(&c->dev->live_usable, memory_order_relaxed);
    size_t allowance = live / 32 > floor ? live / 32 : floor;
    /* Idle bytes that may stay: the allowance beside the new bytes, or what the program held
     * at its recent peak and holds neither live nor parked now (live counts the new bytes
     * already: the caller took them), whichever is more. Keeping the latter makes the
     * footprint no larger than that peak was, and a program that repeats its steps (a
     * training loop: the activations of one step are freed and asked for again in the next)
     * finds them here instead of making them anew, seven driver calls each. */
    size_t keep = allowance > rounded ? allowance - rounded : 0;
    size_t peak = vmh_dev_usable_peak(c->dev);
    size_t held = live + parked < live ? SIZE_MAX : live + parked;
    size_t below_peak = peak > held ? peak - held : 0;
    if (below_peak > settings.limit)
        below_peak = settings.limit;
    if (below_peak > keep)
        keep = below_peak;
    vmh_idle_t *taken = c->bytes > keep ? evict_locked(c, c->bytes - keep) : NULL;
    vmh_unlock(&c->lock);
    destroy_taken(taken);
}

size_t vmh_cache_trim(vmh_cache_t *c)
{
    vmh_lock(&c->lock, VMH_RANK_CACHE);
    vmh_idle_t *taken = evict_locked(c, SIZE_MAX);
    /* A trim (memory pressure, vmm_trim): the peak held before no longer earns room. */
    vmh_dev_usable_peak_reset(c->dev);
    vmh_unlock(&c->lock);
    return destroy_taken(taken);
}

size_t vmh_cache_trim_upto(vmh_cache_t *c, size_t bytes)
{
    vmh_lock(&c->lock, VMH_RANK_CACHE);
    vmh_idle_t *taken = evict_locked(c, bytes);
    vmh_unlock(&c->lock);
    return destroy_taken(taken);
}

size_t vmh_cache_bytes(vmh_cache_t *c)
{
    vmh_lock(&c->lock, VMH_RANK_CACHE);
    size_t bytes = c->bytes;
    vmh_unlock(&c->lock);
    return bytes;
}

void vmh_cache_destroy(vmh_cache_t *c)
{
    vmh_cache_trim(c);
    pthread_mutex_destroy(&c->lock);
}
