/* Layer "carved", idle memory given back: empty extents unlinked and destroyed (the trims, and
 * a shard's release of retired extents in carved.c), the tidy's holes punched in extents that
 * still hold blocks, and the counts of what could go (hole bytes, the free hint, idle bytes:
 * the heap's idle and reclaimable bytes and its tidy read them). Filling a hole again is
 * placement's (carved_place.c): this file only takes memory out of service. It calls down into
 * carved_place.c (span_give) and carved_visit.c (an extent's pieces), never up. */
#include "carved.h"
#include "carved_internal.h"

#include "grow.h"
#include "list.h"
#include "registry.h"
#include "witness.h"

#include <sched.h>
#include <stdlib.h>

#ifdef VMH_TESTING
void (*vmh_carved_test_unmapping)(vmh_shard_t *s);
#endif

/* ---- trims: empty extents given back ---- */

static bool ext_holds_memory(const void *owner);
static bool ext_paused(const void *owner)
{
    return !ext_holds_memory(owner) && ext_settled(owner);
}

/* Whether an empty extent may be unmapped now: every block freed at once in it was freed
 * before a wait that has completed (a free may land between a trim's wait and its unmapping). */
static bool ext_passed(const void *owner)
{
    const vmh_ext_t *e = owner;
    return vmh_reclaim_passed(e->shard->carved->reclaim, e->freed_mark);
}

/* An empty extent may go when settled (no fill or punch of its shard is mid-call) and passed. */
static bool ext_settled_passed(const void *owner)
{
    return ext_settled(owner) && ext_passed(owner);
}

static bool ext_retired_passed(const void *owner)
{
    return vmh_extent_retired(((const vmh_ext_t *)owner)->extent) && ext_settled_passed(owner);
}

/* Takes shard s's empty extents of a kind out of its arena, list and the registry, until they
 * hold at least *budget bytes (then lowered by theirs; NULL: all); returns them linked by next.
 * s is locked. */
static vmh_ext_t *unlink_empty_upto_locked(vmh_shard_t *s, empty_kind_t kind, size_t *budget)
{
    vmh_ext_t *empty = NULL, *e;
    uintptr_t base;
    size_t size;
    while ((!budget || *budget > 0) &&
           (e = vmh_arena_take_empty_extent_where(s->arena,
                                                  kind == EMPTY_RETIRED  ? ext_retired_passed
                                                  : kind == EMPTY_PAUSED ? ext_paused
                                                                         : ext_settled_passed,
                                                  &base, &size))) {
        /* Dead, not unknown, until extents_destroy has unmapped it: a query meanwhile must not
         * reach the driver, which would answer for the still-mapped chunks (device.h). */
        vmh_registry_set(base, size, &vmh_owner_dead);
        if (budget)
            *budget -= size < *budget ? size : *budget;
        VMH_HLIST_REMOVE(s->exts, e);
        e->next = empty;
        empty = e;
    }
    return empty;
}

vmh_ext_t *unlink_empty_locked(vmh_shard_t *s, empty_kind_t kind)
{
    return unlink_empty_upto_locked(s, kind, NULL);
}

/* Gives back the memory of extents unlinked from s (s not locked: driver calls) and keeps
 * their records as spares; returns the bytes. */
size_t extents_destroy(vmh_shard_t *s, vmh_ext_t *list)
{
    size_t bytes = 0, n = 0, k = 0;
    vmh_ext_t *last = NULL;
    for (vmh_ext_t *e = list; e; e = e->next)
        n += e->npieces;
    /* The ranges go together: adjacent extents of one reservation are unmapped with one call
     * (range.h's vmh_ranges_destroy); without memory for the list, one by one. */
    vmh_range_t **ranges = calloc(n ? n : 1, sizeof *ranges);
    for (vmh_ext_t *e = list; e; e = e->next) {
        for (size_t i = 0; i < e->npieces; i++) {
            vmh_range_t *r = e->pieces[i].range;
            if (r) {
                bytes += r->size;
                idle_gauge(-(int64_t)r->size);
            }
            if (ranges)
                ranges[k++] = r;
            else
                vmh_range_destroy(r);
        }
    }
    /* Unmapped before their address space goes back to the spans: another thread may take
     * it and map there at once. */
    vmh_ranges_destroy(ranges, k);
    free(ranges);
    for (vmh_ext_t *e = list; e; e = e->next) {
        for (size_t i = 0; i < e->npieces; i++)
            vmh_paused_destroy(e->pieces[i].paused); /* emptied while paused: its addresses go */
        vmh_registry_set(e->va, e->va_size, NULL);   /* unmapped now: unknown, as natively */
        span_give(s, e->va, e->va_size);
        ext_pieces_set(e, NULL);
        kept_drop_all(e);
        e->extent = NULL;
        e->freed_mark = 0; /* the record serves a new extent next */
        last = e;
    }
    /* A registry reader may still hold one of these records: keep them (type-stable). */
    vmh_lock(&s->lock, VMH_RANK_OWNER);
    last->next = s->spare;
    s->spare = list;
    vmh_unlock(&s->lock);
    return bytes;
}

/* Gives back the shards' empty extents of a kind, until at least *budget bytes (NULL: all);
 * returns the bytes that were mapped. */
static size_t trim_kind(vmh_carved_t *pk, empty_kind_t kind, size_t *budget)
{
    size_t bytes = 0;
    for (int i = 0; i < VMH_SHARDS && (!budget || *budget > 0); i++) {
        vmh_shard_t *s = &pk->shards[i];
        vmh_lock(&s->lock, VMH_RANK_OWNER);
        vmh_ext_t *empty = unlink_empty_upto_locked(s, kind, budget);
        shard_note(s);
        vmh_unlock(&s->lock);
        if (empty)
            bytes += extents_destroy(s, empty);
    }
    return bytes;
}

size_t vmh_carved_trim(vmh_carved_t *pk)
{
    return trim_kind(pk, EMPTY_ALL, NULL);
}

size_t vmh_carved_trim_upto(vmh_carved_t *pk, size_t bytes)
{
    return trim_kind(pk, EMPTY_ALL, &bytes);
}

void vmh_carved_trim_paused(vmh_carved_t *pk)
{
    trim_kind(pk, EMPTY_PAUSED, NULL);
}

/* ---- holes: idle chunks inside extents unmapped (the tidy's) ---- */

/* The free runs of an extent, granule-aligned (vmh_arena_free_runs), in address order. */
typedef struct free_runs {
    struct free_run {
        uintptr_t base;
        size_t size;
    } * run;
    size_t n, cap;
    bool failed; /* out of host memory: the extent is left alone */
} free_runs_t;

static void free_run_seen(uintptr_t base, size_t size, void *arg)
{
    free_runs_t *f = arg;
    struct free_run *grown = f->failed ? NULL : vmh_grow(f->run, &f->cap, f->n, sizeof *grown, 16);
    if (!grown) {
        f->failed = true;
        return;
    }
    f->run = grown;
    f->run[f->n++] = (struct free_run){base, size};
}

/* Whether e's free chunks may become holes, once the GPU has passed what was freed in it at
 * once (s locked; see ext_punchable). */
static bool ext_may_hole(const vmh_shard_t *s, const vmh_ext_t *e)
{
    if (!e->extent || !e->npieces || !vmh_extent_busy(e->extent) || vmh_extent_retired(e->extent) ||
        vmh_carved_paused_locked(e) || !ext_settled(e))
        return false;
    for (size_t x = 0; x < s->nexported; x++)
        if (s->exported[x].base - vmh_extent_base(e->extent) < vmh_extent_size(e->extent))
            return false;
    return true;
}

/* Whether shard s may make holes in e now (s locked): it holds a live or parked block (empty
 * extents are the trim's, and so e keeps a piece), serves blocks (not retired), is shared with
 * no process (no live export in it), runs (no piece paused), and every block freed at once in
 * it was freed before the last completed wait (else the GPU may still touch it). */
static bool ext_punchable(const vmh_shard_t *s, const vmh_ext_t *e)
{
    return ext_may_hole(s, e) && ext_passed(e);
}

/* Whether mapping m (of an extent whose free runs are `runs`, the mappings visited in address
 * order, *r the run reached) lies wholly in free space and nothing but its piece holds it or
 * its chunk (an export being made keeps it): a hole could take it. */
static bool map_idle(const free_runs_t *runs, size_t *r, const vmh_map_t *m)
{
    while (*r < runs->n && runs->run[*r].base + runs->run[*r].size <= m->ptr)
        ++*r;
    bool in_run = *r < runs->n && runs->run[*r].base <= m->ptr &&
                  m->ptr + m->size <= runs->run[*r].base + runs->run[*r].size;
    return in_run && atomic_load(&m->refs) == 1 && atomic_load(&m->alloc->refs) == 1;
}

/* Makes holes of e's mappings that lie wholly in its free runs and that it alone holds (one
 * chunk each: extents are made of chunks, extent_chunk), until at least *budget bytes (then
 * lowered); the pieces' old ranges go into *old (grown as needed) for the caller to destroy,
 * which unmaps and releases what the new pieces left out. Returns the bytes. s locked. */
static size_t ext_punch_locked(vmh_shard_t *s, vmh_ext_t *e, size_t *budget, free_runs_t *runs,
                               vmh_range_t ***old, size_t *nold, size_t *oldcap)
{
    runs->n = 0;
    if (!vmh_arena_free_runs(e->extent, s->carved->dev->gran, false, free_run_seen, runs) ||
        runs->failed)
        return 0;

    if (*nold + e->npieces > *oldcap) {
        size_t cap = (*nold + e->npieces) * 2;
        vmh_range_t **grown = realloc(*old, cap * sizeof *grown);
        if (!grown)
            return 0;
        *old = grown;
        *oldcap = cap;
    }
    vmh_range_t *all = ext_maps_with(e, NULL), *kept = all ? maps_list(all->nmaps) : NULL;
    uintptr_t *holes = all ? malloc(all->nmaps * sizeof *holes) : NULL;
    size_t punched = 0, nholes = 0;
    for (size_t i = 0, r = 0; holes && kept && i < all->nmaps; i++) {
        vmh_map_t *m = all->maps[i];
        if (map_idle(runs, &r, m) && punched < *budget &&
            vmh_arena_hole(s->arena, e->extent, m->ptr, m->size) == 0) {
            holes[nholes++] = m->ptr;
            punched += m->size;
        } else {
            kept->maps[kept->nmaps++] = m;
        }
    }
    /* The kept mappings become the pieces; without host memory for them the holes are undone
     * (free space again: nothing was unmapped). */
    if (punched && !ext_pieces_from(e, kept, *old, nold)) {
        while (nholes)
            vmh_arena_unhole(s->arena, e->extent, holes[--nholes]);
        punched = 0;
    }
    free(all);
    free(kept);
    free(holes);
    *budget -= punched < *budget ? punched : *budget;
    return punched;
}

size_t vmh_carved_punch_upto(vmh_carved_t *pk, size_t bytes)
{
    size_t punched = 0;
    free_runs_t runs = {0};
    for (int i = 0; i < VMH_SHARDS && bytes > 0; i++) {
        vmh_shard_t *s = &pk->shards[i];
        if (atomic_load_explicit(&s->free, memory_order_relaxed) < pk->dev->gran)
            continue;
        vmh_range_t **old = NULL;
        size_t nold = 0, cap = 0, here = 0;
        vmh_lock(&s->lock, VMH_RANK_OWNER);
        for (vmh_ext_t *e = s->exts; e && bytes > 0 && !atomic_load(&pk->frozen); e = e->next)
            if (ext_punchable(s, e))
                here += ext_punch_locked(s, e, &bytes, &runs, &old, &nold, &cap);
        if (here) {
            shard_note(s);
            idle_gauge(-(int64_t)here);
            /* The old pieces' references to what the new pieces hold go now; what they alone
             * hold (the holes' mappings) is unmapped once the lock is let go, so that frees and
             * allocations in this shard never wait behind the driver. Until then the shard
             * is unsettled: nothing gives these addresses away or maps them again. */
            vmh_ranges_drop_shared(old, nold);
            s->unmapping++;
            atomic_fetch_add(&pk->unmaps_in_flight, 1);
        }
        vmh_unlock(&s->lock);
        if (here) {
#ifdef VMH_TESTING
            if (vmh_carved_test_unmapping)
                vmh_carved_test_unmapping(s);
#endif
            vmh_ranges_destroy(old, nold); /* one cuMemUnmap per stretch, one release per chunk */
            vmh_lock(&s->lock, VMH_RANK_OWNER);
            s->unmapping--;
            vmh_unlock(&s->lock);
            atomic_fetch_sub(&pk->unmaps_in_flight, 1);
        }
        free(old);
        punched += here;
    }
    free(runs.run);
    return punched;
}

void vmh_carved_settle(vmh_carved_t *pk)
{
    while (atomic_load(&pk->unmaps_in_flight)) /* a few driver calls away */
        sched_yield();
}

size_t vmh_carved_hole_bytes(vmh_carved_t *pk)
{
    size_t bytes = 0;
    free_runs_t runs = {0};
    for (int i = 0; i < VMH_SHARDS && !atomic_load(&pk->frozen); i++) {
        vmh_shard_t *s = &pk->shards[i];
        if (atomic_load_explicit(&s->free, memory_order_relaxed) < pk->dev->gran)
            continue;
        vmh_lock(&s->lock, VMH_RANK_OWNER);
        for (vmh_ext_t *e = s->exts; e; e = e->next) {
            runs.n = 0;
            runs.failed = false;
            if (!vmh_extent_has_live(e->extent) || !ext_may_hole(s, e) ||
                !vmh_arena_free_runs(e->extent, pk->dev->gran, true, free_run_seen, &runs) ||
                runs.failed)
                continue;
            size_t r = 0;
            for (size_t k = 0; k < e->npieces; k++)
                for (size_t m = 0; m < e->pieces[k].range->nmaps; m++)
                    if (map_idle(&runs, &r, e->pieces[k].range->maps[m]))
                        bytes += e->pieces[k].range->maps[m]->size;
        }
        vmh_unlock(&s->lock);
    }
    free(runs.run);
    return bytes;
}

size_t vmh_carved_free_hint(vmh_carved_t *pk)
{
    size_t bytes = 0;
    for (int i = 0; i < VMH_SHARDS && !atomic_load(&pk->frozen); i++)
        bytes += atomic_load_explicit(&pk->shards[i].free, memory_order_relaxed);
    return bytes;
}

/* Whether an extent (its owner record, read under its shard's lock) has memory mapped: a paused
 * one (pause.c) has given its memory back already. */
static bool ext_holds_memory(const void *owner)
{
    const vmh_ext_t *e = owner;
    for (size_t i = 0; i < e->npieces; i++)
        if (e->pieces[i].range)
            return true;
    return false;
}

size_t vmh_carved_idle_bytes(vmh_carved_t *pk)
{
    size_t idle = 0;
    for (int i = 0; i < VMH_SHARDS; i++) {
        vmh_lock(&pk->shards[i].lock, VMH_RANK_OWNER);
        idle += vmh_arena_unused_extent_bytes(pk->shards[i].arena, ext_holds_memory);
        vmh_unlock(&pk->shards[i].lock);
    }
    return idle;
}
