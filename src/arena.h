/* Layer 4: packing small buffers into shared chunks.
 *
 * Host-side bookkeeping only: an arena sub-allocates address ranges inside extents that the
 * caller (heap.c) maps and hands over; it never calls the driver and never touches device
 * memory (device memory is not readable from the host, so no block header lives in it).
 * Best fit over segregated free lists (two-level: power-of-two classes, 16 sub-classes each),
 * VMH_ARENA_ALIGN alignment (cudaMalloc's), neighbours coalesced on release. O(1) alloc/free.
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
 * is the caller's object for it (heap.c: the range). NULL when out of host memory. */
vmh_extent_t *vmh_arena_add_extent(vmh_arena_t *a, uintptr_t base, size_t size, void *owner);

/* Best fit for size bytes (1 <= size). Returns 0 and *out, or ENOMEM when no extent has room
 * (the caller adds an extent and retries). */
int vmh_arena_alloc(vmh_arena_t *a, size_t size, uintptr_t *out);

/* The live block that contains p in extent e (interior pointers too). */
bool vmh_arena_find(const vmh_extent_t *e, uintptr_t p, vmh_block_info_t *info);

/* Parks the live block starting exactly at p, tagged with gen. Returns 0, or EINVAL when p is
 * not the start of a live block of e (interior pointer, double free). *info gets the block. */
int vmh_arena_park(vmh_arena_t *a, vmh_extent_t *e, uintptr_t p, uint64_t gen,
                   vmh_block_info_t *info);

/* Frees the live block at p at once (the caller knows no work can touch it). */
int vmh_arena_release(vmh_arena_t *a, vmh_extent_t *e, uintptr_t p, vmh_block_info_t *info);

/* Makes every block parked with a generation <= gen free again. Returns how many. */
size_t vmh_arena_unpark_upto(vmh_arena_t *a, uint64_t gen);

/* Number of parked blocks (any generation). */
size_t vmh_arena_parked(const vmh_arena_t *a);

/* Grows the live block at p (of extent e) in place to size bytes when the following space is
 * free; shrinking always succeeds. 0, or ENOMEM when the neighbour has no room. */
int vmh_arena_resize(vmh_arena_t *a, vmh_extent_t *e, uintptr_t p, size_t size);

/* Removes one extent that holds no live and no parked block, returning its owner and range
 * (NULL when there is none). Used by trimming. */
void *vmh_arena_take_empty_extent(vmh_arena_t *a, uintptr_t *base, size_t *size);

/* Bytes in live blocks (usable sizes), bytes free (not parked), bytes in extents. */
typedef struct vmh_arena_stats {
    size_t live, parked, free, extents_bytes, extents;
} vmh_arena_stats_t;
void vmh_arena_stats(const vmh_arena_t *a, vmh_arena_stats_t *s);

/* The extent's owner and range. */
void *vmh_extent_owner(const vmh_extent_t *e);
uintptr_t vmh_extent_base(const vmh_extent_t *e);
size_t vmh_extent_size(const vmh_extent_t *e);

/* Walks every live block (leak report). */
void vmh_arena_for_each_live(const vmh_arena_t *a,
                             void (*cb)(const vmh_block_info_t *b, void *arg), void *arg);

#endif
