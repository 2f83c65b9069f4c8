/* Layer "arena, registry": what an arena holds, read without changing it (arena.h): the block
 * behind an address, the statistics, the extents' owners and bounds, the bytes of extents that
 * hold no live block, each live block. The arena's changes (alloc, park, release, resize,
 * extents added and taken) are arena.c's; both read the structures of arena_internal.h. */
#include "arena.h"
#include "arena_internal.h"

#include <stdint.h>
#include <string.h>

bool vmh_arena_find(const vmh_extent_t *e, uintptr_t p, vmh_block_info_t *info)
{
    if (!e || p < e->base || p - e->base >= e->size || !e->tab_n)
        return false;
    size_t g = start_at_or_below(e, granule(e, p));
    if (g == SIZE_MAX)
        return false;
    const blk_t *b = tab_get(e, e->base + ((uintptr_t)g << ALIGN_SHIFT));
    if (!b || p - b->base >= blk_size(b))
        return false;
    fill_info(b, info);
    return true;
}

size_t vmh_arena_parked(const vmh_arena_t *a)
{
    return a ? a->nparked : 0;
}

bool vmh_extent_retired(const vmh_extent_t *e)
{
    return e->retired;
}

bool vmh_extent_busy(const vmh_extent_t *e)
{
    return e->nlive || e->nparked;
}

bool vmh_extent_has_live(const vmh_extent_t *e)
{
    return e->nlive != 0;
}

void vmh_arena_stats(const vmh_arena_t *a, vmh_arena_stats_t *s)
{
    if (!s)
        return;
    memset(s, 0, sizeof(*s));
    if (!a)
        return;
    s->live = a->live;
    s->parked = a->parked;
    s->free = a->free;
    s->retired = a->retired;
    s->holes = a->holes;
    s->extents_bytes = a->extents_bytes;
    s->extents = a->extents;
}

size_t vmh_arena_unused_extent_bytes(const vmh_arena_t *a, bool (*holds_memory)(const void *owner))
{
    size_t bytes = 0;
    for (const vmh_extent_t *e = a->idle; e; e = e->next)
        if (!holds_memory || holds_memory(e->owner))
            bytes += e->size - e->holes;
    for (const vmh_extent_t *e = a->busy; e; e = e->next)
        if (e->nlive == 0 && (!holds_memory || holds_memory(e->owner)))
            bytes += e->size - e->holes;
    return bytes;
}

void *vmh_extent_owner(const vmh_extent_t *e)
{
    return e->owner;
}

uintptr_t vmh_extent_base(const vmh_extent_t *e)
{
    return e->base;
}

size_t vmh_extent_size(const vmh_extent_t *e)
{
    return e->size;
}

size_t vmh_arena_free_runs(const vmh_extent_t *e, size_t align, bool with_parked,
                           void (*cb)(uintptr_t base, size_t size, void *arg), void *arg)
{
    if (!e || !align || e->retired)
        return 0;
    size_t bytes = 0;
    const uintptr_t end = e->base + e->size;
    for (const blk_t *b = e->first; b; b = b->phys_next) {
        unsigned st = blk_state(b);
        if (st != B_FREE && !(with_parked && st == B_PARKED))
            continue;
        /* A run: this block and the free (or parked) ones right after it (free blocks merge,
         * parked ones do not). */
        size_t off = b->base - e->base, off_end = off + blk_size(b);
        while (b->phys_next && (blk_state(b->phys_next) == B_FREE ||
                                (with_parked && blk_state(b->phys_next) == B_PARKED))) {
            b = b->phys_next;
            off_end += blk_size(b);
        }
        size_t lo = off % align ? off + (align - off % align) : off;
        size_t hi = e->base + off_end == end ? off_end : off_end - off_end % align;
        if (lo >= hi)
            continue;
        bytes += hi - lo;
        if (cb)
            cb(e->base + lo, hi - lo, arg);
    }
    return bytes;
}

size_t vmh_extent_holes(const vmh_extent_t *e)
{
    return e->holes;
}

size_t vmh_arena_holes(const vmh_extent_t *e, void (*cb)(uintptr_t base, size_t size, void *arg),
                       void *arg)
{
    if (!e->holes)
        return 0;
    size_t n = 0;
    for (const blk_t *b = e->first; b; b = b->phys_next) {
        if (blk_state(b) == B_HOLE) {
            n++;
            if (cb)
                cb(b->base, blk_size(b), arg);
        }
    }
    return n;
}

void vmh_extent_for_each_live(const vmh_extent_t *e,
                              void (*cb)(const vmh_block_info_t *b, void *arg), void *arg)
{
    for (const blk_t *b = e->nlive ? e->first : NULL; b; b = b->phys_next) {
        if (blk_state(b) == B_LIVE) {
            vmh_block_info_t info;
            fill_info(b, &info);
            cb(&info, arg);
        }
    }
}

void vmh_arena_for_each_live(const vmh_arena_t *a, void (*cb)(const vmh_block_info_t *b, void *arg),
                             void *arg)
{
    if (!a || !cb)
        return;
    /* Idle extents hold no live block. */
    for (const vmh_extent_t *e = a->busy; e; e = e->next)
        vmh_extent_for_each_live(e, cb, arg);
}
