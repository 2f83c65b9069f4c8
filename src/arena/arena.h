/* Layer "arena, registry": packing small buffers into shared chunks.
 *
 * Host-side bookkeeping only: an arena sub-allocates address ranges inside extents that the
 * caller (carved_place.c) maps and hands over; it never calls the driver and never touches device
 * memory (device memory is not readable from the host, so no block header lives in it).
 * Best fit over segregated free lists (two-level: power-of-two classes, 16 sub-classes each),
 * VMH_ARENA_ALIGN alignment (cudaMalloc's), neighbours coalesced on release. O(1) alloc/free
 * (bounded list scans for a tight fit, lowest address among equals). Blocks never span
 * extents. Host cost: about 72 bytes per block plus 1/2048 of each extent (see arena.c).
 * Not thread-safe: the owner serializes calls.
 *
 * A freed block is first parked with a generation number: it is no longer live (find() and
 * free() no longer see it) but cannot be handed out until unpark_upto() with that generation
 * or a later one says that no queued work can touch it any more.
 */
#ifndef VMH_ARENA_H
#define VMH_ARENA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define VMH_ARENA_ALIGN 256u

typedef struct vmh_arena vmh_arena_t;
typedef struct vmh_extent vmh_extent_t;

typedef struct vmh_block_info {
    uintptr_t base;
    size_t size;   /* the size asked for */
    size_t usable; /* the block's size (>= size, a multiple of VMH_ARENA_ALIGN) */
} vmh_block_info_t;

vmh_arena_t *vmh_arena_new(void);
/* Frees the bookkeeping (not the extents' memory: the owners are handed back by the callback
 * so the caller can release them). cb may be NULL. */
void vmh_arena_delete(vmh_arena_t *a, void (*cb)(void *owner, void *arg), void *arg);

/* Adds [base, base + size) (base and size multiples of VMH_ARENA_ALIGN) as free space; owner
 * is the caller's object for it (carved_place.c: the extent record). NULL when out of host memory,
 * or with errno EINVAL when size is 0 or base/size are not multiples of VMH_ARENA_ALIGN. */
vmh_extent_t *vmh_arena_add_extent(vmh_arena_t *a, uintptr_t base, size_t size, void *owner);

/* Best fit for size bytes (1 <= size; EINVAL for 0). Returns 0 and *out, or ENOMEM when no
 * extent has room (the caller adds an extent and retries) or, with nothing changed, when host
 * memory for the bookkeeping runs out. The block's usable size is size rounded up to
 * VMH_ARENA_ALIGN. */
int vmh_arena_alloc(vmh_arena_t *a, size_t size, uintptr_t *out);

/* The live block that contains p in extent e (interior pointers too): base <= p < base +
 * usable. Parked and free blocks are not found. Exact starts cost a hash lookup; interior
 * pointers add a backward scan of a start bitmap (64 granules per word, 4096 per summary
 * word), bounded by the distance to the nearest live start below p. */
bool vmh_arena_find(const vmh_extent_t *e, uintptr_t p, vmh_block_info_t *info);

/* Parks the live block starting exactly at p, tagged with gen. Returns 0, or EINVAL when p is
 * not the start of a live block of e (interior pointer, double free, parked block, e of
 * another arena). *info (may be NULL) gets the block. Parked blocks are not merged with free
 * neighbours until unparked. */
int vmh_arena_park(vmh_arena_t *a, vmh_extent_t *e, uintptr_t p, uint64_t gen,
                   vmh_block_info_t *info);

/* Frees the live block at p at once (the caller knows no work can touch it), merging it with
 * free neighbours. Errors and *info as for park. */
int vmh_arena_release(vmh_arena_t *a, vmh_extent_t *e, uintptr_t p, vmh_block_info_t *info);

/* Makes every block parked with a generation <= gen free again, whatever order they were
 * parked in. Returns how many. Costs O(blocks freed) while generations are parked in
 * non-decreasing order (carved.c's case), a walk of every parked block otherwise. */
size_t vmh_arena_unpark_upto(vmh_arena_t *a, uint64_t gen);

/* Number of parked blocks (any generation). */
size_t vmh_arena_parked(const vmh_arena_t *a);

/* What a shrink does with the tail it gives up: it follows the free rule (carved.c), as a free
 * of a block of the tail's size would (DESIGN.md, "Frees"). */
typedef enum vmh_arena_tail {
    VMH_TAIL_FREE, /* free space at once (no work can touch it), merged with a free neighbour */
    VMH_TAIL_PARK, /* a parked block of generation gen, free once the GPU has passed it */
    VMH_TAIL_KEEP, /* kept by the block (an exported one: an importer may map the tail) */
    VMH_TAIL_COUNT
} vmh_arena_tail_t;

/* Grows the live block at p (of extent e) in place to size bytes when the following space is
 * free (not parked, same extent); shrinking always succeeds, its tail going as `tail` says
 * (gen: VMH_TAIL_PARK's generation); if host memory for the split runs out, or e is retired,
 * the block keeps its usable size. 0, ENOMEM when the neighbour has no room, EINVAL when p is
 * not the start of a live block of e or size is 0. */
int vmh_arena_resize(vmh_arena_t *a, vmh_extent_t *e, uintptr_t p, size_t size,
                     vmh_arena_tail_t tail, uint64_t gen);

/* Removes one extent that holds no live and no parked block, returning its owner and range
 * (NULL when there is none). Used by trimming. O(1): the arena keeps a list of such extents
 * (retired ones included). */
void *vmh_arena_take_empty_extent(vmh_arena_t *a, uintptr_t *base, size_t *size);

/* Like vmh_arena_take_empty_extent, among the empty extents whose owner `which` accepts (NULL
 * when there is none). O(idle extents). */
void *vmh_arena_take_empty_extent_where(vmh_arena_t *a, bool (*which)(const void *owner),
                                        uintptr_t *base, size_t *size);

/* Retires extent e: from now on no block is served from it (its free space, and whatever is
 * freed in it later, stays unused), no block of it grows, and once it holds no live and no
 * parked block vmh_arena_take_retired_extent() hands it back. carved.c retires the extent of
 * a freed exported block: another process may still map that memory. Idempotent. */
void vmh_arena_retire_extent(vmh_arena_t *a, vmh_extent_t *e);
bool vmh_extent_retired(const vmh_extent_t *e);
/* Whether e holds a live or a parked block. */
bool vmh_extent_busy(const vmh_extent_t *e);
/* Whether e holds a live block (an extent without one is idle: a trim's, once passed). */
bool vmh_extent_has_live(const vmh_extent_t *e);

/* Removes one retired extent that holds no live and no parked block, like
 * vmh_arena_take_empty_extent (NULL when there is none). O(idle extents). */
void *vmh_arena_take_retired_extent(vmh_arena_t *a, uintptr_t *base, size_t *size);

/* Bytes in live blocks (usable sizes), bytes parked, bytes free (not parked, servable), free
 * bytes of retired extents, bytes in holes, bytes in extents and their number.
 * live + parked + free + retired + holes == extents_bytes. */
typedef struct vmh_arena_stats {
    size_t live, parked, free, retired, holes, extents_bytes, extents;
} vmh_arena_stats_t;
void vmh_arena_stats(const vmh_arena_t *a, vmh_arena_stats_t *s);

/* Bytes of the extents that hold no live block (free, or parked blocks a wait frees; holes
 * left out: nothing is behind them): what a trim can give back whole. Free space inside an extent
 * that still holds a live block is not counted: no allocation of another kind can use it. The arena
 * does not know whether an extent's addresses have memory behind them (a paused one has none:
 * nothing to give back), so it asks the owner's layer: holds_memory(owner) false leaves the extent
 * out (NULL: every extent counts). O(extents). */
size_t vmh_arena_unused_extent_bytes(const vmh_arena_t *a, bool (*holds_memory)(const void *owner));

/* The extent's owner and range. */
void *vmh_extent_owner(const vmh_extent_t *e);
uintptr_t vmh_extent_base(const vmh_extent_t *e);
size_t vmh_extent_size(const vmh_extent_t *e);

/* The free runs of extent e (free blocks: neither live nor parked, so nothing the GPU may still
 * use; with_parked: parked ones too, what is free once the GPU has passed them), each cut to
 * its `align`-aligned interior, offsets counted from the extent's base and the extent's end
 * counting as aligned (a chunk at the end may be shorter): what could be unmapped inside the
 * extent if it were backed by chunks of `align` bytes (holes). cb(base, size, arg) for each
 * non-empty interior, in address order; returns their bytes. A retired extent's free space is
 * left out (another process may map its chunk). O(blocks of e). cb must not change the arena. */
size_t vmh_arena_free_runs(const vmh_extent_t *e, size_t align, bool with_parked,
                           void (*cb)(uintptr_t base, size_t size, void *arg), void *arg);
/* Holes: space inside an extent that its owner took out of service (carved_idle.c
 * unmaps it). vmh_arena_hole makes [base, base + size) of e, which must lie inside one free
 * block of e (not retired), a hole: neither free, live nor parked, never served, found or
 * merged; an extent whose other blocks are free is still empty (trimmable, its holes go with
 * it). vmh_arena_unhole makes the hole starting at base free again (merged with free
 * neighbours). 0, EINVAL (not a free block's interior, not a hole's start), ENOMEM (host
 * memory for the records: nothing changed). O(blocks of e) to find the block. */
int vmh_arena_hole(vmh_arena_t *a, vmh_extent_t *e, uintptr_t base, size_t size);
int vmh_arena_unhole(vmh_arena_t *a, vmh_extent_t *e, uintptr_t base);
/* Bytes in e's holes; its holes in address order, cb(base, size, arg) each (cb may be NULL),
 * returning how many (O(blocks of e), nothing walked when it has none). */
size_t vmh_extent_holes(const vmh_extent_t *e);
size_t vmh_arena_holes(const vmh_extent_t *e, void (*cb)(uintptr_t base, size_t size, void *arg),
                       void *arg);
/* Joining extents (free space that neighbouring extents would hold only together,
 * as an expandable segment holds it). vmh_extent_edges gives the free bytes at e's start and
 * at its end (0 when the block there is live, parked or a hole; both e's size when e is one free
 * block), O(blocks of e). vmh_arena_join_new makes the record that will replace lo and hi (hi
 * starting where lo ends, neither retired, one arena): NULL on misuse or without host memory;
 * vmh_arena_join_drop frees one not used. vmh_arena_join then makes lo and hi that one extent,
 * which cannot fail (so that the caller can prepare its own side in between): lo's owner, every
 * block kept (a free block at lo's end and one at hi's start become one); it returns `fresh`,
 * and lo's and hi's records are gone. O(blocks of lo and hi). */
void vmh_extent_edges(const vmh_extent_t *e, size_t *head, size_t *tail);
vmh_extent_t *vmh_arena_join_new(const vmh_extent_t *lo, const vmh_extent_t *hi);
void vmh_arena_join_drop(vmh_extent_t *fresh);
vmh_extent_t *vmh_arena_join(vmh_arena_t *a, vmh_extent_t *lo, vmh_extent_t *hi,
                             vmh_extent_t *fresh);
/* Walks e's live blocks in address order. cb must not change the arena. */
void vmh_extent_for_each_live(const vmh_extent_t *e,
                              void (*cb)(const vmh_block_info_t *b, void *arg), void *arg);
/* Walks every live block (leak report). cb must not change the arena. */
void vmh_arena_for_each_live(const vmh_arena_t *a, void (*cb)(const vmh_block_info_t *b, void *arg),
                             void *arg);

#ifdef VMH_TESTING
/* Test hooks (src/util/testable.h's convention), compiled only into the test build. */
/* 0 when every internal invariant holds (address chains, free lists and bitmaps, live index,
 * parked FIFO, counters); otherwise prints the failed condition and returns its line. */
int vmh_arena_check(const vmh_arena_t *a);
/* Free blocks in the arena (one per extent once everything is freed: coalescing). */
size_t vmh_arena_free_blocks(const vmh_arena_t *a);
/* Host bytes held for bookkeeping: records' slabs, extents and their bitmaps, hash tables. */
size_t vmh_arena_host_bytes(const vmh_arena_t *a);
#endif

#endif
