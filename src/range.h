/* Layer 3: ranges. A range is an immutable, ascending, contiguous list of mappings: the
 * device memory of one buffer. Every operation builds a new range completely (taking its own
 * references on the mappings it keeps) and only then returns it; the caller swaps it in and
 * destroys the old one. A failed operation returns the driver's code, holds nothing, and
 * leaves the input range untouched.
 *
 * Grow tries, in order: the headroom left in the last mapping's reservation; an adjacent
 * reservation at the range's end (kept only if the driver grants exactly that address); a
 * move, which maps the same physical chunks at a new address (no copy). The old range's
 * mappings stay alive until the caller destroys the old range: the caller decides when no
 * queued work can touch the old addresses any more.
 */
#ifndef VMH_RANGE_H
#define VMH_RANGE_H

#include "handle.h"

#include <stdbool.h>

typedef struct vmh_range {
    CUdeviceptr base;
    size_t size;   /* bytes mapped: the sum of the mappings' sizes */
    size_t nmaps;
    vmh_map_t *maps[];
} vmh_range_t;

typedef enum vmh_grow_kind {
    VMH_GROW_HEADROOM,  /* mapped into the last reservation's headroom: same base */
    VMH_GROW_ADJACENT,  /* mapped into a new reservation granted at the end: same base */
    VMH_GROW_MOVED,     /* remapped at a new base */
    VMH_GROW_KIND_COUNT
} vmh_grow_kind_t;

/* Reserves max(reserve, total) bytes (aligned to align; hint may be 0) and maps allocs[0..n)
 * in order from its start. */
CUresult vmh_range_create(vmh_alloc_t *const *allocs, size_t n, size_t reserve, size_t align,
                          CUdeviceptr hint, vmh_range_t **out);

/* New range = r's mappings followed by allocs[0..n). Headroom, then adjacent, then move; a
 * move reserves max(reserve, new total). allow_move false makes it fail with
 * CUDA_ERROR_OUT_OF_MEMORY instead of moving. *kind says which path was taken. */
CUresult vmh_range_grow(const vmh_range_t *r, vmh_alloc_t *const *allocs, size_t n,
                        size_t reserve, size_t align, bool allow_move, vmh_range_t **out,
                        vmh_grow_kind_t *kind);

/* New range at a fresh reservation of max(reserve, r->size) bytes (hint may be 0), mapping
 * the same allocations at the same offsets. */
CUresult vmh_range_move(const vmh_range_t *r, size_t reserve, size_t align, CUdeviceptr hint,
                        vmh_range_t **out);

/* New range keeping the leading mappings that cover keep bytes (keep > 0); the caller drops
 * the old range to release the trailing ones. No driver call. */
CUresult vmh_range_shrink(const vmh_range_t *r, size_t keep, vmh_range_t **out);

/* Drops every mapping reference (last to first). NULL is allowed. */
void vmh_range_destroy(vmh_range_t *r);

/* Bytes of address space reserved past the range's end in its last reservation. */
size_t vmh_range_headroom(const vmh_range_t *r);

#endif
