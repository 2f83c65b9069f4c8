/* Layer "arena, registry": packing small device buffers into shared, already-mapped extents (see
 * arena.h).
 *
 * Everything here is host memory: device memory cannot be read from the host, so there are no
 * boundary tags in the extents. Each block (live, parked or free) has a record taken from a
 * slab of host pages; records of one extent are chained in address order, which is all that
 * coalescing needs. Free blocks sit in a two-level segregated fit index (TLSF, Masmano et al.):
 * first level a power of two, second level 16 linear sub-classes, two bitmaps to find a
 * non-empty list with a couple of bit scans, so alloc and free cost O(1).
 *
 * Finding the block behind an address (free and realloc give exact starts, range queries give
 * interior pointers) uses two per-extent structures that hold live blocks only:
 *   - a bitmap with one bit per 256-byte granule, set where a live block starts, and a summary
 *     bitmap with one bit per non-zero word of it: an interior pointer is resolved by scanning
 *     backwards for the nearest set bit, which skips 16 KiB per word and 1 MiB per summary word;
 *   - an open-addressing hash table from a live block's start to its record (8 bytes per slot,
 *     at most half full), for O(1) exact lookups and to turn the bit found above into a record.
 * Free and parked blocks are in neither, so splitting and coalescing never touch them.
 *
 * Parked blocks (freed, but maybe still used by queued work) keep their records and stay in
 * the address chain, never coalesced, in a FIFO by generation until unpark_upto() frees them.
 *
 * Host cost per block: a 56-byte record, plus 8-16 bytes of hash table per live block, plus
 * 1/2048 of the extent size in bitmaps: under 1% of device memory for blocks of 16 KiB and up
 * (the arena's unit tests check it), about 28% for 256-byte blocks (the record and its hash
 * slot against the block). Slabs are kept until the arena is deleted; hash tables shrink after
 * a peak.
 *
 * Failure: allocating calls reserve the host memory they need (a record, a hash slot) before
 * changing anything, so running out of host memory leaves no trace. Freeing calls need no
 * memory (a hash table may try to shrink, and simply stays larger if that fails).
 *
 * The structures, size classes and the live-block index are in arena_internal.h (shared with
 * arena_query.c, the queries that change nothing, and arena_check.c, the tests' invariant
 * check); this file holds the records' slabs, the free lists and the entry points that change
 * the arena.
 */
#include "arena.h"
#include "arena_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* ---- Records ------------------------------------------------------------------------------ */

/* Makes sure a spare record exists, so that the caller can go on without a failure path. */
static bool rec_reserve(vmh_arena_t *a)
{
    if (a->spare)
        return true;
    slab_t *s = malloc(SLAB_BYTES);
    if (!s)
        return false;
    s->next = a->slabs;
    a->slabs = s;
    a->nslabs++;
    size_t n = (SLAB_BYTES - sizeof(slab_t)) / sizeof(blk_t);
    for (size_t i = n; i-- > 0;) {
        s->recs[i].next = a->spare;
        a->spare = &s->recs[i];
    }
    return true;
}

/* Only after rec_reserve(). */
static blk_t *rec_take(vmh_arena_t *a)
{
    blk_t *b = a->spare;
    a->spare = b->next;
    return b;
}

static void rec_put(vmh_arena_t *a, blk_t *b)
{
    b->next = a->spare;
    a->spare = b;
}

/* ---- Segregated free lists ------------------------------------------------------------------ */

static void free_insert(vmh_arena_t *a, blk_t *b)
{
    unsigned fl, sl;
    mapping(blk_size(b), &fl, &sl);
    blk_t *h = a->heads[fl][sl];
    b->next = h;
    b->u.prev = NULL;
    if (h)
        h->u.prev = b;
    a->heads[fl][sl] = b;
    a->sl_map[fl] |= 1u << sl;
    a->fl_map |= (uint64_t)1 << fl;
}

static void free_remove(vmh_arena_t *a, blk_t *b)
{
    unsigned fl, sl;
    mapping(blk_size(b), &fl, &sl);
    if (b->next)
        b->next->u.prev = b->u.prev;
    if (b->u.prev) {
        b->u.prev->next = b->next;
    } else {
        a->heads[fl][sl] = b->next;
        if (!b->next) {
            a->sl_map[fl] &= ~(1u << sl);
            if (!a->sl_map[fl])
                a->fl_map &= ~((uint64_t)1 << fl);
        }
    }
}

/* The head of the first non-empty list at or above class [fl][sl]. */
static blk_t *find_suitable(const vmh_arena_t *a, unsigned fl, unsigned sl)
{
    uint32_t m = a->sl_map[fl] & (~0u << sl);
    if (!m) {
        uint64_t f = fl + 1 < FL_COUNT ? a->fl_map & (~(uint64_t)0 << (fl + 1)) : 0;
        if (!f)
            return NULL;
        fl = (unsigned)__builtin_ctzll(f);
        m = a->sl_map[fl];
    }
    return a->heads[fl][__builtin_ctz(m)];
}

/* Among the first limit entries of list [fl][sl], the smallest block of at least size bytes,
 * and of those the lowest in address. Preferring low addresses packs live blocks towards the
 * bottom of the extents and leaves the holes above them to grow (and whole extents to trim), so
 * that a churn of mixed sizes needs less device memory than taking list heads (LIFO) would, and
 * about what an exhaustive address-ordered best fit needs. */
static blk_t *scan_class(const vmh_arena_t *a, unsigned fl, unsigned sl, size_t size,
                         unsigned limit)
{
    blk_t *best = NULL;
    size_t best_size = SIZE_MAX;
    for (blk_t *b = a->heads[fl][sl]; b && limit; b = b->next, limit--) {
        size_t bs = blk_size(b);
        if (bs >= size && (bs < best_size || (bs == best_size && b->base < best->base))) {
            best = b;
            best_size = bs;
        }
    }
    return best;
}

/* Picks the free block to carve size bytes from. Plain TLSF takes the head of the first
 * non-empty class above the request's (every block there fits, O(1)), which can split a large
 * block while one of nearly the right size sits in the request's own class. So: the request's
 * class first, then the first non-empty class above it, each with a bounded best-fit scan;
 * and before giving up (which makes the caller map memory), a longer look at the request's
 * class, where a block may fit that the short scan did not reach. */
static blk_t *pick(const vmh_arena_t *a, size_t size)
{
    unsigned fl, sl, rfl, rsl;
    mapping(size, &fl, &sl);
    blk_t *b = scan_class(a, fl, sl, size, SCAN_HOT);
    if (b)
        return b;
    mapping_search(size, &rfl, &rsl);
    b = find_suitable(a, rfl, rsl);
    if (b) {
        mapping(blk_size(b), &rfl, &rsl);
        return scan_class(a, rfl, rsl, size, SCAN_HOT);
    }
    if (a->heads[fl][sl] && (fl != rfl || sl != rsl))
        return scan_class(a, fl, sl, size, SCAN_LAST);
    return NULL;
}

/* ---- Extent bookkeeping --------------------------------------------------------------------- */

static void ext_unlink(vmh_extent_t **list, vmh_extent_t *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        *list = e->next;
    if (e->next)
        e->next->prev = e->prev;
    e->prev = e->next = NULL;
}

static void ext_push(vmh_extent_t **list, vmh_extent_t *e)
{
    e->prev = NULL;
    e->next = *list;
    if (*list)
        (*list)->prev = e;
    *list = e;
}

/* Called after nlive/nparked changed from (or to) zero: keeps the idle list exact, so that
 * take_empty_extent() is O(1). */
static void ext_became_busy(vmh_arena_t *a, vmh_extent_t *e)
{
    ext_unlink(&a->idle, e);
    ext_push(&a->busy, e);
}

static void ext_maybe_idle(vmh_arena_t *a, vmh_extent_t *e)
{
    if (e->nlive == 0 && e->nparked == 0) {
        ext_unlink(&a->busy, e);
        ext_push(&a->idle, e);
    }
}

/* The live block starting exactly at p in e, or NULL. */
static blk_t *live_at(const vmh_arena_t *a, const vmh_extent_t *e, uintptr_t p)
{
    if (!e || e->arena != a || p < e->base || p - e->base >= e->size || (p & (VMH_ARENA_ALIGN - 1)))
        return NULL;
    return tab_get(e, p);
}

/* The live block starting exactly at p in e, described in *info and taken out of the index and
 * the live counts (it is being parked or freed); NULL when there is none. */
static blk_t *take_live(vmh_arena_t *a, vmh_extent_t *e, uintptr_t p, vmh_block_info_t *info)
{
    blk_t *b = live_at(a, e, p);
    if (!b)
        return NULL;
    fill_info(b, info);
    tab_del(e, b);
    start_clear(e, granule(e, b->base));
    e->nlive--;
    a->live -= blk_size(b);
    return b;
}

/* b (not in any list) becomes free: merges with free neighbours, then joins a free list
 * (none in a retired extent: its free space is never served). The lower record survives a
 * merge, so the extent's first record never changes. */
static void make_free(vmh_arena_t *a, blk_t *b)
{
    bool listed = !b->ext->retired;
    size_t size = blk_size(b);
    blk_t *p = b->phys_prev, *n = b->phys_next;
    if (p && blk_state(p) == B_FREE) {
        if (listed)
            free_remove(a, p);
        size += blk_size(p);
        p->phys_next = n;
        if (n)
            n->phys_prev = p;
        rec_put(a, b);
        b = p;
    }
    if (n && blk_state(n) == B_FREE) {
        if (listed)
            free_remove(a, n);
        size += blk_size(n);
        b->phys_next = n->phys_next;
        if (n->phys_next)
            n->phys_next->phys_prev = b;
        rec_put(a, n);
    }
    blk_set(b, size, B_FREE);
    if (listed)
        free_insert(a, b);
}

/* The bytes of b from offset `at` on (`tail` of them) become a free block of their own, linked
 * after b and listed; b's own size is the caller's to set. Only after rec_reserve(). The block
 * above b is not free (free blocks never touch), so the tail needs no merging. */
static void split_tail(vmh_arena_t *a, blk_t *b, size_t at, size_t tail)
{
    blk_t *r = rec_take(a);
    r->ext = b->ext;
    r->base = b->base + at;
    blk_set(r, tail, B_FREE);
    r->phys_prev = b;
    r->phys_next = b->phys_next;
    if (r->phys_next)
        r->phys_next->phys_prev = r;
    b->phys_next = r;
    free_insert(a, r);
}

/* Counts n bytes of e that became free (servable, or not when e is retired). */
static void freed_bytes(vmh_arena_t *a, const vmh_extent_t *e, size_t n)
{
    if (e->retired)
        a->retired += n;
    else
        a->free += n;
}

/* ---- Public entry points -------------------------------------------------------------------- */

vmh_arena_t *vmh_arena_new(void)
{
    vmh_arena_t *a = calloc(1, sizeof(*a));
    if (a)
        a->park_sorted = true;
    return a;
}

static void ext_destroy(vmh_extent_t *e)
{
    free(e->tab);
    free(e);
}

void vmh_arena_delete(vmh_arena_t *a, void (*cb)(void *owner, void *arg), void *arg)
{
    if (!a)
        return;
    vmh_extent_t *lists[2] = {a->busy, a->idle};
    for (int i = 0; i < 2; i++) {
        for (vmh_extent_t *e = lists[i], *next; e; e = next) {
            next = e->next;
            if (cb)
                cb(e->owner, arg);
            ext_destroy(e);
        }
    }
    for (slab_t *s = a->slabs, *next; s; s = next) {
        next = s->next;
        free(s);
    }
    free(a);
}

/* A new extent record for [base, base + size): its bitmaps (zero) and, for nlive live blocks,
 * a hash table at most half full. NULL without host memory. */
static vmh_extent_t *ext_alloc(uintptr_t base, size_t size, size_t nlive)
{
    size_t nwords = ((size >> ALIGN_SHIFT) + 63) / 64;
    size_t nsum = (nwords + 63) / 64;
    vmh_extent_t *e = calloc(1, sizeof(*e) + (nwords + nsum) * sizeof(uint64_t));
    if (!e)
        return NULL;
    e->base = base;
    e->size = size;
    e->nwords = nwords;
    e->summary = e->starts + nwords;
    unsigned shift = TAB_MIN_SHIFT;
    while (((size_t)1 << shift) < 2 * nlive)
        shift++;
    if (nlive && !tab_resize(e, shift)) {
        free(e);
        return NULL;
    }
    return e;
}

vmh_extent_t *vmh_arena_add_extent(vmh_arena_t *a, uintptr_t base, size_t size, void *owner)
{
    if (!a || !size || ((base | size) & (VMH_ARENA_ALIGN - 1)) || size > MAX_BLOCK ||
        base + size < base) {
        errno = EINVAL;
        return NULL;
    }
    if (!rec_reserve(a))
        return NULL;
    vmh_extent_t *e = ext_alloc(base, size, 0);
    if (!e)
        return NULL;
    e->arena = a;
    e->owner = owner;

    blk_t *b = rec_take(a);
    memset(b, 0, sizeof(*b));
    b->ext = e;
    b->base = base;
    blk_set(b, size, B_FREE);
    free_insert(a, b);
    e->first = b;

    ext_push(&a->idle, e);
    a->free += size;
    a->extents_bytes += size;
    a->extents++;
    return e;
}

int vmh_arena_alloc(vmh_arena_t *a, size_t size, uintptr_t *out)
{
    if (!a || !out || !size)
        return EINVAL;
    if (size > MAX_BLOCK)
        return ENOMEM;
    size_t need = (size + VMH_ARENA_ALIGN - 1) & ~(size_t)(VMH_ARENA_ALIGN - 1);
    blk_t *b = pick(a, need);
    if (!b)
        return ENOMEM;
    vmh_extent_t *e = b->ext;
    size_t have = blk_size(b);
    /* Host memory first, so that running out of it changes nothing. */
    if (!tab_reserve(e) || (have > need && !rec_reserve(a)))
        return ENOMEM;

    free_remove(a, b);
    if (have > need)
        split_tail(a, b, need, have - need); /* the tail stays free */
    blk_set(b, need, B_LIVE);
    b->next = NULL;
    b->u.req = size;
    tab_put(e, b);
    start_set(e, granule(e, b->base));
    if (e->nlive++ == 0 && e->nparked == 0)
        ext_became_busy(a, e);
    a->free -= need;
    a->live += need;
    *out = b->base;
    return 0;
}

/* b (in no list, its extent's live count already without it) becomes parked with generation
 * gen, at the end of the FIFO. */
static void park_push(vmh_arena_t *a, blk_t *b, uint64_t gen)
{
    size_t size = blk_size(b);
    blk_set(b, size, B_PARKED);
    b->u.gen = gen;
    b->next = NULL;
    if (a->park_tail) {
        if (gen < a->park_tail->u.gen)
            a->park_sorted = false;
        a->park_tail->next = b;
    } else {
        a->park_head = b;
    }
    a->park_tail = b;
    a->nparked++;
    b->ext->nparked++;
    a->parked += size;
}

int vmh_arena_park(vmh_arena_t *a, vmh_extent_t *e, uintptr_t p, uint64_t gen,
                   vmh_block_info_t *info)
{
    blk_t *b = take_live(a, e, p, info);
    if (!b)
        return EINVAL;
    park_push(a, b, gen);
    return 0;
}

int vmh_arena_release(vmh_arena_t *a, vmh_extent_t *e, uintptr_t p, vmh_block_info_t *info)
{
    blk_t *b = take_live(a, e, p, info);
    if (!b)
        return EINVAL;
    size_t size = blk_size(b);
    make_free(a, b);
    ext_maybe_idle(a, e);
    freed_bytes(a, e, size);
    return 0;
}

/* Parked block b, already out of the FIFO, becomes free. */
static void unpark_one(vmh_arena_t *a, blk_t *b)
{
    vmh_extent_t *e = b->ext;
    size_t size = blk_size(b);
    make_free(a, b);
    e->nparked--;
    ext_maybe_idle(a, e);
    a->nparked--;
    a->parked -= size;
    freed_bytes(a, e, size);
}

size_t vmh_arena_unpark_upto(vmh_arena_t *a, uint64_t gen)
{
    if (!a)
        return 0;
    size_t n = 0;
    blk_t *b;
    if (a->park_sorted) {
        /* The usual case: generations only grow, so the ones to free are a prefix. */
        while ((b = a->park_head) && b->u.gen <= gen) {
            a->park_head = b->next;
            unpark_one(a, b);
            n++;
        }
        if (!a->park_head)
            a->park_tail = NULL;
        return n;
    }
    /* Out-of-order generations were parked: walk the whole FIFO, and find out on the way
     * whether what stays is in order again. */
    blk_t **pp = &a->park_head, *last = NULL;
    bool sorted = true;
    while ((b = *pp)) {
        if (b->u.gen <= gen) {
            *pp = b->next; /* read before make_free() may recycle a record */
            unpark_one(a, b);
            n++;
        } else {
            if (last && b->u.gen < last->u.gen)
                sorted = false;
            last = b;
            pp = &b->next;
        }
    }
    a->park_tail = last;
    a->park_sorted = sorted;
    return n;
}

int vmh_arena_resize(vmh_arena_t *a, vmh_extent_t *e, uintptr_t p, size_t size,
                     vmh_arena_tail_t tail, uint64_t gen)
{
    blk_t *b = live_at(a, e, p);
    if (!b || !size)
        return EINVAL;
    if (size > MAX_BLOCK)
        return ENOMEM;
    size_t need = (size + VMH_ARENA_ALIGN - 1) & ~(size_t)(VMH_ARENA_ALIGN - 1);
    size_t have = blk_size(b);
    blk_t *n = b->phys_next;
    if (e->retired || (need < have && tail == VMH_TAIL_KEEP)) {
        /* Its free space is never served again: no growth, and a shrink keeps its tail. */
        if (need > have)
            return ENOMEM;
        b->u.req = size;
        return 0;
    }
    if (need > have) {
        size_t extra = need - have;
        if (!n || blk_state(n) != B_FREE || blk_size(n) < extra)
            return ENOMEM;
        free_remove(a, n);
        if (blk_size(n) == extra) {
            b->phys_next = n->phys_next;
            if (n->phys_next)
                n->phys_next->phys_prev = b;
            rec_put(a, n);
        } else {
            n->base += extra;
            blk_set(n, blk_size(n) - extra, B_FREE);
            free_insert(a, n);
        }
        blk_set(b, need, B_LIVE);
        a->free -= extra;
        a->live += extra;
    } else if (need < have && tail == VMH_TAIL_PARK) {
        /* The tail may still be written by work queued before the shrink: a parked block of
         * its own, free once the GPU has passed gen, as a freed block of its size would be. */
        if (!rec_reserve(a)) {
            b->u.req = size; /* no host memory for a record: the block keeps its tail */
            return 0;
        }
        size_t cut = have - need;
        blk_t *t = rec_take(a);
        t->ext = e;
        t->base = b->base + need;
        blk_set(t, cut, B_PARKED);
        t->phys_prev = b;
        t->phys_next = n;
        if (n)
            n->phys_prev = t;
        b->phys_next = t;
        park_push(a, t, gen);
        blk_set(b, need, B_LIVE);
        a->live -= cut;
    } else if (need < have) {
        size_t cut = have - need;
        if (n && blk_state(n) == B_FREE) {
            /* The free neighbour just starts earlier. */
            free_remove(a, n);
            n->base -= cut;
            blk_set(n, blk_size(n) + cut, B_FREE);
            free_insert(a, n);
        } else if (rec_reserve(a)) {
            split_tail(a, b, need, cut);
        } else {
            /* No host memory for a record: the block keeps its tail (still a valid shrink). */
            cut = 0;
        }
        blk_set(b, have - cut, B_LIVE);
        a->free += cut;
        a->live -= cut;
    }
    b->u.req = size;
    return 0;
}

/* Takes idle extent e out of the arena and destroys its bookkeeping; returns its owner. */
static void *take_idle(vmh_arena_t *a, vmh_extent_t *e, uintptr_t *base, size_t *size)
{
    /* Idle means no live and no parked block: free blocks (one between holes, eager
     * coalescing) and holes. */
    for (blk_t *b = e->first, *next; b; b = next) {
        next = b->phys_next;
        if (blk_state(b) == B_FREE && !e->retired)
            free_remove(a, b);
        rec_put(a, b);
    }
    ext_unlink(&a->idle, e);
    if (e->retired)
        a->retired -= e->size - e->holes;
    else
        a->free -= e->size - e->holes;
    a->holes -= e->holes;
    a->extents_bytes -= e->size;
    a->extents--;
    if (base)
        *base = e->base;
    if (size)
        *size = e->size;
    void *owner = e->owner;
    ext_destroy(e);
    return owner;
}

void *vmh_arena_take_empty_extent(vmh_arena_t *a, uintptr_t *base, size_t *size)
{
    if (!a || !a->idle)
        return NULL;
    return take_idle(a, a->idle, base, size);
}

void *vmh_arena_take_retired_extent(vmh_arena_t *a, uintptr_t *base, size_t *size)
{
    if (!a)
        return NULL;
    for (vmh_extent_t *e = a->idle; e; e = e->next)
        if (e->retired)
            return take_idle(a, e, base, size);
    return NULL;
}

void *vmh_arena_take_empty_extent_where(vmh_arena_t *a, bool (*which)(const void *owner),
                                        uintptr_t *base, size_t *size)
{
    if (!a)
        return NULL;
    for (vmh_extent_t *e = a->idle; e; e = e->next)
        if (which(e->owner))
            return take_idle(a, e, base, size);
    return NULL;
}

void vmh_arena_retire_extent(vmh_arena_t *a, vmh_extent_t *e)
{
    assert(e->arena == a);
    if (e->retired)
        return;
    for (blk_t *b = e->first; b; b = b->phys_next) {
        if (blk_state(b) == B_FREE) {
            free_remove(a, b);
            a->free -= blk_size(b);
            a->retired += blk_size(b);
        }
    }
    e->retired = true;
}

/* Moves from's blocks into the extent record to (which covers them): their extent pointers,
 * and the live ones into to's index. */
static void ext_blocks_move(vmh_extent_t *to, const vmh_extent_t *from)
{
    for (blk_t *b = from->first; b; b = b->phys_next) {
        b->ext = to;
        if (blk_state(b) == B_LIVE) {
            tab_put(to, b);
            start_set(to, granule(to, b->base));
        }
    }
}

void vmh_extent_edges(const vmh_extent_t *e, size_t *head, size_t *tail)
{
    const blk_t *b = e->first;
    *head = blk_state(b) == B_FREE && !e->retired ? blk_size(b) : 0;
    while (b->phys_next)
        b = b->phys_next;
    *tail = blk_state(b) == B_FREE && !e->retired ? blk_size(b) : 0;
}

vmh_extent_t *vmh_arena_join_new(const vmh_extent_t *lo, const vmh_extent_t *hi)
{
    if (!lo || !hi || lo->arena != hi->arena || lo == hi || lo->retired || hi->retired ||
        lo->base + lo->size != hi->base)
        return NULL;
    return ext_alloc(lo->base, lo->size + hi->size, lo->nlive + hi->nlive);
}

void vmh_arena_join_drop(vmh_extent_t *fresh)
{
    if (fresh)
        ext_destroy(fresh);
}

vmh_extent_t *vmh_arena_join(vmh_arena_t *a, vmh_extent_t *lo, vmh_extent_t *hi,
                             vmh_extent_t *fresh)
{
    vmh_extent_t *e = fresh;
    assert(e && lo->arena == a && hi->arena == a && e->base == lo->base &&
           e->size == lo->size + hi->size && lo->base + lo->size == hi->base);
    e->arena = a;
    e->owner = lo->owner;
    e->first = lo->first;
    e->nlive = lo->nlive + hi->nlive;
    e->nparked = lo->nparked + hi->nparked;
    e->holes = lo->holes + hi->holes;
    ext_blocks_move(e, lo);
    ext_blocks_move(e, hi);
    blk_t *last = lo->first;
    while (last->phys_next)
        last = last->phys_next;
    blk_t *next = hi->first;
    last->phys_next = next;
    next->phys_prev = last;
    if (blk_state(last) == B_FREE && blk_state(next) == B_FREE) {
        /* The two free edges become one block (make_free's merge, for blocks already free). */
        free_remove(a, last);
        free_remove(a, next);
        last->phys_next = next->phys_next;
        if (next->phys_next)
            next->phys_next->phys_prev = last;
        blk_set(last, blk_size(last) + blk_size(next), B_FREE);
        rec_put(a, next);
        free_insert(a, last);
    }
    vmh_extent_t *lists[2] = {lo, hi};
    for (int i = 0; i < 2; i++) {
        bool busy = lists[i]->nlive || lists[i]->nparked;
        ext_unlink(busy ? &a->busy : &a->idle, lists[i]);
        ext_destroy(lists[i]);
    }
    ext_push(e->nlive || e->nparked ? &a->busy : &a->idle, e);
    a->extents--;
    return e;
}

int vmh_arena_hole(vmh_arena_t *a, vmh_extent_t *e, uintptr_t base, size_t size)
{
    if (!a || !e || e->arena != a || e->retired || !size ||
        ((base | size) & (VMH_ARENA_ALIGN - 1)) || base < e->base || base - e->base >= e->size ||
        size > e->size - (base - e->base))
        return EINVAL;
    blk_t *b = e->first;
    while (b && b->base + blk_size(b) <= base)
        b = b->phys_next;
    if (!b || blk_state(b) != B_FREE || base + size > b->base + blk_size(b))
        return EINVAL;
    size_t head = base - b->base, tail = b->base + blk_size(b) - (base + size);
    /* Records first (a head and a tail may each need one), so that failing changes nothing. */
    blk_t *h = NULL;
    if (head) {
        if (!rec_reserve(a))
            return ENOMEM;
        h = rec_take(a);
    }
    if (tail && !rec_reserve(a)) {
        if (h)
            rec_put(a, h);
        return ENOMEM;
    }
    free_remove(a, b);
    if (head) {
        blk_set(b, head, B_FREE);
        free_insert(a, b);
        h->ext = e;
        h->base = base;
        h->phys_prev = b;
        h->phys_next = b->phys_next;
        if (h->phys_next)
            h->phys_next->phys_prev = h;
        b->phys_next = h;
    } else {
        h = b;
    }
    if (tail)
        split_tail(a, h, size, tail);
    blk_set(h, size, B_HOLE);
    h->next = NULL;
    a->free -= size;
    a->holes += size;
    e->holes += size;
    return 0;
}

int vmh_arena_unhole(vmh_arena_t *a, vmh_extent_t *e, uintptr_t base)
{
    if (!a || !e || e->arena != a)
        return EINVAL;
    blk_t *b = e->first;
    while (b && b->base < base)
        b = b->phys_next;
    if (!b || b->base != base || blk_state(b) != B_HOLE)
        return EINVAL;
    size_t size = blk_size(b);
    a->holes -= size;
    e->holes -= size;
    make_free(a, b);
    freed_bytes(a, e, size);
    return 0;
}
