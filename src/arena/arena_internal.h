/* Internal to the arena (arena.c, arena_check.c): the records, the extent and arena structures,
 * the size classes and the live-block index (start bitmap and hash table). See arena.c for the
 * design; nothing else includes this. */
#ifndef VMH_ARENA_INTERNAL_H
#define VMH_ARENA_INTERNAL_H

#include "arena.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALIGN_SHIFT 8u
_Static_assert((1u << ALIGN_SHIFT) == VMH_ARENA_ALIGN, "ALIGN_SHIFT must match VMH_ARENA_ALIGN");

/* TLSF geometry. Sizes below 4 KiB (16 granules) are first level 0, one granule per sub-class;
 * above, first level l covers [2^(l+11), 2^(l+12)) in 16 equal sub-classes. With 256-byte
 * granules the classes up to 8 KiB are exact (width 256). 53 first levels cover size_t. */
#define SL_SHIFT 4u
#define SL_COUNT (1u << SL_SHIFT)
#define FL_SHIFT (SL_SHIFT + ALIGN_SHIFT)
#define FL_COUNT (64u - FL_SHIFT + 1u)

/* Larger requests cannot be mapped anyway; refusing them keeps size arithmetic overflow-free. */
#define MAX_BLOCK ((size_t)1 << 62)

/* How many entries of a free list alloc looks at: the first SCAN_HOT for the best fit (tight
 * sizes, low addresses), and up to SCAN_LAST in the request's own class before answering ENOMEM
 * (the caller would then map a new extent, which costs far more than walking a list). */
#define SCAN_HOT 8u
#define SCAN_LAST 1024u

/* Records come from slabs of SLAB_BYTES; a hash table has at least 1 << TAB_MIN_SHIFT slots. */
#define SLAB_BYTES 16384u
#define TAB_MIN_SHIFT 4u

/* B_HOLE: space the owner took out of service (vmh_arena_hole: unmapped, carved.h). */
enum { B_FREE = 0, B_LIVE = 1, B_PARKED = 2, B_HOLE = 3 };

typedef struct blk blk_t;
struct blk {
    blk_t *phys_prev, *phys_next; /* address-order neighbours within the extent */
    blk_t *next;                  /* free list, parked FIFO, or the slab's list of spares */
    union {
        blk_t *prev;  /* free: previous in its free list */
        size_t req;   /* live: the size asked for */
        uint64_t gen; /* parked: the generation that must complete before reuse */
    } u;
    vmh_extent_t *ext;
    uintptr_t base;
    size_t size_state; /* usable size (a multiple of 256) | state in the low byte */
};

_Static_assert(sizeof(void *) != 8 || sizeof(blk_t) == 56, "a block record should stay 56 bytes");

struct vmh_extent {
    vmh_arena_t *arena;
    vmh_extent_t *prev, *next; /* in the arena's busy or idle list */
    uintptr_t base;
    size_t size;
    void *owner;
    blk_t *first;          /* the block at base: its record lives as long as the extent */
    size_t nlive, nparked; /* the extent is idle (trimmable) when both are 0 */
    bool retired;          /* serves no new block: its free blocks are in no free list */
    size_t holes;          /* bytes in B_HOLE blocks */
    blk_t **tab;           /* live blocks by start, open addressing, linear probing */
    size_t tab_n;
    unsigned tab_shift; /* capacity is 1 << tab_shift (0: no table yet) */
    size_t nwords;      /* words in the start bitmap */
    uint64_t *summary;  /* bit w set: starts word w is non-zero */
    uint64_t starts[];  /* one bit per granule, then the summary words */
};

typedef struct slab {
    struct slab *next;
    blk_t recs[];
} slab_t;

struct vmh_arena {
    uint64_t fl_map;           /* bit f: some sl list of first level f is non-empty */
    uint32_t sl_map[FL_COUNT]; /* bit s: list [f][s] is non-empty */
    blk_t *heads[FL_COUNT][SL_COUNT];
    blk_t *park_head, *park_tail;
    size_t nparked;
    bool park_sorted; /* generations non-decreasing along the FIFO: unpark pops from the head */
    vmh_extent_t *busy, *idle;
    blk_t *spare; /* recycled records */
    slab_t *slabs;
    size_t nslabs;
    size_t live, parked, free, extents_bytes, extents;
    size_t retired; /* free bytes of retired extents (never served) */
    size_t holes;   /* bytes in B_HOLE blocks */
};

/* ---- Records ------------------------------------------------------------------------------ */

static inline size_t blk_size(const blk_t *b)
{
    return b->size_state & ~(size_t)(VMH_ARENA_ALIGN - 1);
}

static inline unsigned blk_state(const blk_t *b)
{
    return (unsigned)(b->size_state & (VMH_ARENA_ALIGN - 1));
}

static inline void blk_set(blk_t *b, size_t size, unsigned state)
{
    b->size_state = size | state;
}

static inline unsigned fls64(uint64_t x)
{
    return 63u - (unsigned)__builtin_clzll(x);
}

/* ---- Size classes ------------------------------------------------------------------------- */

static inline void mapping(size_t size, unsigned *fl, unsigned *sl)
{
    if (size < ((size_t)1 << FL_SHIFT)) {
        *fl = 0;
        *sl = (unsigned)(size >> ALIGN_SHIFT);
    } else {
        unsigned l = fls64(size);
        *fl = l - FL_SHIFT + 1;
        *sl = (unsigned)(size >> (l - SL_SHIFT)) & (SL_COUNT - 1);
    }
}

/* The class from which every block is at least size bytes: size rounded up to the next
 * sub-class boundary (TLSF's mapping_search). Equal to mapping() when size starts its class. */
static inline void mapping_search(size_t size, unsigned *fl, unsigned *sl)
{
    unsigned l = fls64(size);
    if (l > FL_SHIFT)
        size += ((size_t)1 << (l - SL_SHIFT)) - 1;
    mapping(size, fl, sl);
}

/* ---- Live-block index: start bitmap and hash table ------------------------------------------ */

static inline size_t granule(const vmh_extent_t *e, uintptr_t p)
{
    return (size_t)((p - e->base) >> ALIGN_SHIFT);
}

static inline void start_set(vmh_extent_t *e, size_t g)
{
    size_t w = g >> 6;
    if (!e->starts[w])
        e->summary[w >> 6] |= (uint64_t)1 << (w & 63);
    e->starts[w] |= (uint64_t)1 << (g & 63);
}

static inline void start_clear(vmh_extent_t *e, size_t g)
{
    size_t w = g >> 6;
    e->starts[w] &= ~((uint64_t)1 << (g & 63));
    if (!e->starts[w])
        e->summary[w >> 6] &= ~((uint64_t)1 << (w & 63));
}

/* The highest live start at or below granule g, or SIZE_MAX. */
static inline size_t start_at_or_below(const vmh_extent_t *e, size_t g)
{
    size_t w = g >> 6;
    /* 2 << 63 is 0 in unsigned arithmetic, so the mask is all ones for bit 63. */
    uint64_t m = e->starts[w] & (((uint64_t)2 << (g & 63)) - 1);
    if (m)
        return (w << 6) + fls64(m);
    size_t sw = w >> 6;
    uint64_t sm = e->summary[sw] & (((uint64_t)1 << (w & 63)) - 1);
    while (!sm) {
        if (sw == 0)
            return SIZE_MAX;
        sm = e->summary[--sw];
    }
    w = (sw << 6) + fls64(sm);
    return (w << 6) + fls64(e->starts[w]);
}

/* Fibonacci hashing of the granule index: consecutive starts land far apart. */
static inline size_t tab_home(const vmh_extent_t *e, uintptr_t base)
{
    return (size_t)(((uint64_t)granule(e, base) * UINT64_C(0x9E3779B97F4A7C15)) >>
                    (64 - e->tab_shift));
}

static inline blk_t *tab_get(const vmh_extent_t *e, uintptr_t base)
{
    if (!e->tab_n)
        return NULL;
    size_t mask = ((size_t)1 << e->tab_shift) - 1;
    for (size_t i = tab_home(e, base);; i = (i + 1) & mask) {
        blk_t *b = e->tab[i];
        if (!b || b->base == base)
            return b;
    }
}

/* Only with room (tab_reserve()). */
static inline void tab_put(vmh_extent_t *e, blk_t *b)
{
    size_t mask = ((size_t)1 << e->tab_shift) - 1;
    size_t i = tab_home(e, b->base);
    while (e->tab[i])
        i = (i + 1) & mask;
    e->tab[i] = b;
    e->tab_n++;
}

static inline bool tab_resize(vmh_extent_t *e, unsigned shift)
{
    blk_t **old = e->tab;
    size_t oldcap = e->tab_shift ? (size_t)1 << e->tab_shift : 0;
    blk_t **t = calloc((size_t)1 << shift, sizeof(*t));
    if (!t)
        return false;
    e->tab = t;
    e->tab_shift = shift;
    e->tab_n = 0;
    for (size_t i = 0; i < oldcap; i++)
        if (old[i])
            tab_put(e, old[i]);
    free(old);
    return true;
}

/* Room for one more entry, keeping the table at most half full (short probe sequences). */
static inline bool tab_reserve(vmh_extent_t *e)
{
    if (!e->tab_shift)
        return tab_resize(e, TAB_MIN_SHIFT);
    if ((e->tab_n + 1) * 2 <= (size_t)1 << e->tab_shift)
        return true;
    return tab_resize(e, e->tab_shift + 1);
}

/* Removes b (present) with backward-shift deletion, so lookups never need tombstones. */
static inline void tab_del(vmh_extent_t *e, const blk_t *b)
{
    size_t mask = ((size_t)1 << e->tab_shift) - 1;
    size_t i = tab_home(e, b->base);
    while (e->tab[i] != b)
        i = (i + 1) & mask;
    for (size_t j = (i + 1) & mask; e->tab[j]; j = (j + 1) & mask) {
        size_t h = tab_home(e, e->tab[j]->base);
        /* The entry at j may move back to the hole at i when i lies on its probe path. */
        if (((j - h) & mask) >= ((j - i) & mask)) {
            e->tab[i] = e->tab[j];
            i = j;
        }
    }
    e->tab[i] = NULL;
    e->tab_n--;
    /* Give memory back after a peak; the 1/8 threshold keeps grow/shrink from thrashing. A
     * failed shrink just keeps the larger table. */
    if (e->tab_shift > TAB_MIN_SHIFT && e->tab_n * 8 < (size_t)1 << e->tab_shift)
        (void)tab_resize(e, e->tab_shift - 1);
}

/* The block's description as the arena's callers see it (info may be NULL: not wanted). */
static inline void fill_info(const blk_t *b, vmh_block_info_t *info)
{
    if (info) {
        info->base = b->base;
        info->size = b->u.req;
        info->usable = blk_size(b);
    }
}

#endif
