/* Layer "ranges". A range is an immutable, ascending, contiguous list of mappings: the
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

/* Gives back host memory a backup lives in (the pause layer's, as data). */
typedef void (*vmh_host_release_fn)(void *host, size_t size);

/* A backup's host memory, held as data for the pause layer: host (NULL: none), its size, the
 * pause layer's kind of memory, and how to give it back. */
typedef struct vmh_backup {
    void *host;
    size_t size;
    unsigned kind;
    vmh_host_release_fn release;
} vmh_backup_t;

/* Gives b's host memory back (nothing when none) and clears b. */
void vmh_backup_release(vmh_backup_t *b);

typedef struct vmh_range {
    CUdeviceptr base;
    size_t size; /* bytes mapped: the sum of the mappings' sizes */
    /* A backup kept attached after a resume (vmm_resume_flags' VMM_RESUME_KEEP_BACKUP, pause.c):
     * released with the range, unless the pause layer takes it back first. Never carried into a
     * range built from this one (grown, moved, shrunk: the bytes changed place). */
    vmh_backup_t kept;
    size_t nmaps;
    vmh_map_t *maps[];
} vmh_range_t;

typedef enum vmh_grow_kind {
    VMH_GROW_HEADROOM, /* mapped into the last reservation's headroom: same base */
    VMH_GROW_ADJACENT, /* mapped into a new reservation granted at the end: same base */
    VMH_GROW_MOVED,    /* remapped at a new base */
    VMH_GROW_KIND_COUNT
} vmh_grow_kind_t;

/* Reserves max(reserve, total) bytes (aligned to align; hint may be 0) and maps allocs[0..n)
 * in order from its start. *no_address (may be NULL): the reservation failed (address space,
 * not memory, ran out). */
CUresult vmh_range_create(vmh_alloc_t *const *allocs, size_t n, size_t reserve, size_t align,
                          CUdeviceptr hint, vmh_range_t **out, bool *no_address);

/* Maps allocs[0..n) in order from `at` inside resv, a reservation the caller holds (a span of
 * many ranges, span.h): the mappings take their own references on it. */
CUresult vmh_range_create_in(vmh_alloc_t *const *allocs, size_t n, vmh_resv_t *resv, CUdeviceptr at,
                             vmh_range_t **out);

/* New range = r's mappings followed by allocs[0..n). Headroom, then adjacent, then move; a
 * move reserves max(reserve, new total). allow_move false makes it fail with
 * CUDA_ERROR_OUT_OF_MEMORY instead of moving. *kind says which path was taken. *no_address
 * (may be NULL): the move's reservation failed (the adjacent probe failing is no failure). */
CUresult vmh_range_grow(const vmh_range_t *r, vmh_alloc_t *const *allocs, size_t n, size_t reserve,
                        size_t align, bool allow_move, vmh_range_t **out, vmh_grow_kind_t *kind,
                        bool *no_address);

/* New range at a fresh reservation of max(reserve, r->size) bytes (hint may be 0), mapping
 * the same allocations at the same offsets. */
CUresult vmh_range_move(const vmh_range_t *r, size_t reserve, size_t align, CUdeviceptr hint,
                        vmh_range_t **out);

/* New range keeping the leading mappings that cover keep bytes (keep > 0); the caller drops
 * the old range to release the trailing ones. No driver call. */
CUresult vmh_range_shrink(const vmh_range_t *r, size_t keep, vmh_range_t **out);

/* New range of the mappings of rs[0..n) (ascending; NULL entries allowed) that lie inside
 * [from, from + bytes), which they must cover exactly, contiguous: references taken, no driver
 * call (carved_visit.c cuts an extent's backing around holes and joins it again). INVALID_VALUE
 * when they do not cover it, OUT_OF_MEMORY without host memory. */
CUresult vmh_range_pick(const vmh_range_t *const *rs, size_t n, CUdeviceptr from, size_t bytes,
                        vmh_range_t **out);

/* Drops every mapping reference (one cuMemUnmap per stretch of adjacent mappings in one
 * reservation, handle.h). NULL is allowed. */
void vmh_range_destroy(vmh_range_t *r);
/* The same, calling unmapped(base, size, arg) once r's mappings are gone but before its address
 * space may go back to the driver (its reservations are held across the call): a caller that
 * keeps the addresses registered as dead until they are unmapped clears them there, before
 * another reservation can take them. Without host memory to hold the reservations, unmapped
 * runs first (as with clearing before vmh_range_destroy). */
void vmh_range_destroy_then(vmh_range_t *r,
                            void (*unmapped)(CUdeviceptr base, size_t size, void *arg), void *arg);

/* Destroys rs[0..n) (any order; NULL entries allowed) together: mappings adjacent across
 * ranges in one reservation are unmapped with one call. */
void vmh_ranges_destroy(vmh_range_t *const *rs, size_t n);
/* Drops, with no driver call, each reference of rs[0..n) (NULL entries allowed) to a mapping
 * that something else also holds: each range keeps only the mappings whose last reference it
 * holds, so that vmh_ranges_destroy later unmaps exactly those, once the caller holds no lock
 * that forbids driver calls. The other holders must outlive the call. */
void vmh_ranges_drop_shared(vmh_range_t *const *rs, size_t n);

/* Bytes of address space reserved past the range's end in its last reservation. */
size_t vmh_range_headroom(const vmh_range_t *r);

/* Bytes of the range in host-located chunks (handle.h, a->host: memory that spilled). */
size_t vmh_range_host_bytes(const vmh_range_t *r);

/* Makes one chunk of `size` bytes for a range operation that needs new memory of the caller's
 * kind (the overflow layer's host chunks, or the device's): as data, so this layer never
 * calls upwards. */
typedef CUresult (*vmh_chunk_fn)(void *arg, size_t size, vmh_alloc_t **out);

/* Moves r's host-located chunks to chunks made by make(arg, size) (device memory), at the same
 * addresses, contents kept, in two steps so that a caller moves many ranges with one wait:
 *   begin: each new chunk is mapped at a scratch address and the old bytes are copied into it
 *          by a copy queued on `stream` (r's device's, current in the calling thread); r stays
 *          as it was. A failure leaves r untouched and *job NULL; copies queued before it may
 *          still run: *unfinished gets a list (not a contiguous range: only for
 *          vmh_range_destroy) of their scratch mappings, for the caller to destroy once the GPU
 *          has passed them (else NULL).
 *   finish: after the caller waited for the stream (`waited`: how that went), r's host mappings
 *          are replaced. A failed wait leaves r untouched (*unfinished as above). Else r is
 *          consumed, *out is the new range (same base and size), and old_host[] (room for
 *          vmh_range_rehome_chunks(r) entries) gets the caller's references to the host chunks,
 *          so that their release (the driver unpins the pages: slow) happens where the caller
 *          chooses. A failure of the swap itself (the driver refusing to map a new chunk where
 *          the old one was) returns the driver's code with *out the range as mapped: the old
 *          chunk back where a new one failed, NULL in maps[] only where the driver refused
 *          that as well (logged).
 * No work may touch r from begin until finish returns (the caller's contract). r must be owned
 * alone (vmh_range_owned_alone) and have a host chunk. */
typedef struct vmh_rehome vmh_rehome_t;
CUresult vmh_range_rehome_begin(vmh_range_t *r, vmh_chunk_fn make, void *arg, CUstream stream,
                                vmh_rehome_t **job, vmh_range_t **unfinished);
CUresult vmh_range_rehome_finish(vmh_rehome_t *job, CUresult waited, vmh_range_t **out,
                                 vmh_range_t **unfinished, vmh_alloc_t **old_host);
size_t vmh_range_rehome_chunks(const vmh_range_t *r);

/* ---- Pause and resume: physical memory given back, addresses kept ----
 *
 * A paused range is a description of where a range was mapped: per segment its address, size,
 * reservation (a reference: the address stays reserved, nothing else can be mapped there), the
 * device and the access descriptors its memory had. A segment is a run of adjacent mappings of
 * one reservation with the same device and access: resume backs it with one chunk, so a range
 * grown chunk by chunk comes back with fewer, larger chunks. (One chunk per segment, never one
 * chunk across segments: the driver maps chunks only whole, driver-facts.md 2a.) */
typedef struct vmh_paused_seg {
    CUdeviceptr ptr;
    size_t size;
    vmh_resv_t *resv;
    int device;
    const vmh_grants_t *grants; /* the device's peers (handle.h), for the chunk made again */
    int naccess;
    CUmemAccessDesc access[VMH_MAX_ACCESS];
} vmh_paused_seg_t;

typedef struct vmh_paused vmh_paused_t;

struct vmh_paused {
    CUdeviceptr base;
    size_t size;
    /* Kept with the description for its owner (the pause layer), and released with it by
     * vmh_paused_destroy: the backup (NULL when none) and how to give it back, and a range
     * resumed but not yet swapped in (a resume prepares every range of a tag before it
     * commits any, so that running out of memory leaves the whole tag paused). */
    void *host;
    vmh_host_release_fn host_release;
    unsigned host_kind; /* the pause layer's kind of the backup's memory */
    vmh_range_t *resumed;
    size_t nsegs;
    vmh_paused_seg_t segs[];
};

/* Whether r alone holds its mappings and chunks (what a pause needs: unmapping memory that has
 * another holder, e.g. an exported chunk, would not give it back). */
bool vmh_range_owned_alone(const vmh_range_t *r);

/* Pauses rs[0..n) (ascending addresses) as one run, their memory given back and their addresses
 * kept: out[i] describes rs[i], and each range is consumed (destroyed). The mappings go together,
 * one cuMemUnmap per stretch of adjacent mappings in one reservation (across ranges), then one
 * cuMemRelease per chunk. Backups are the caller's (pause.c copies first). A segment joins
 * adjacent mappings up to seg_max bytes (0: no limit; VMMHOOK_CHUNK_MAX, so that the resumed
 * chunks are no larger than that either). On failure (INVALID_VALUE; NOT_PERMITTED when a
 * range is not owned alone; OUT_OF_MEMORY) nothing changed and every range is still mapped. */
CUresult vmh_range_pause_run(vmh_range_t *const *rs, size_t n, size_t seg_max, vmh_paused_t **out);

/* Resumes ps[0..n) (ascending addresses) as one run: maps new memory at exactly each ps[i]'s
 * addresses into out[i], one chunk of prop (its location.id set to each segment's device) per
 * segment (cuMemCreate, cuMemMap each), with the segment's access descriptors or with
 * access[0..naccess) when naccess > 0 (the device's list now, which includes peers granted since
 * the pause): one cuMemSetAccess per stretch of adjacent segments in one reservation with the
 * same descriptors, across records. A segment whose chunk the driver has no memory for gets one
 * made by spill(spill_arg, size) instead (host memory at the same addresses, VMMHOOK_OVERFLOW;
 * NULL: none). Then backups[i] (backups NULL, or an entry NULL: none) is copied into out[i]. All
 * or nothing: on failure nothing is left mapped or created and the ps are untouched (the call can
 * be retried). The ps stay the caller's either way (vmh_paused_destroy them once the resumed
 * ranges are in place). */
CUresult vmh_range_resume_run(const vmh_paused_t *const *ps, size_t n,
                              const CUmemAllocationProp *prop, const CUmemAccessDesc *access,
                              int naccess, const void *const *backups, vmh_chunk_fn spill,
                              void *spill_arg, vmh_range_t **out);

/* How the pause layer sees a heap record (an own-chunk buffer, a shared extent) during a visit,
 * under the record's lock: the record's range slot (NULL while paused), its paused-description
 * slot (NULL while running), and whether it is shared with another process. A visit function
 * may swap one for the other. */
typedef struct vmh_visit_rec {
    vmh_range_t **range;
    vmh_paused_t **paused;
    bool exported;
} vmh_visit_rec_t;

/* A visit hands runs: recs[0..n) adjacent in address space (each record's end the next one's
 * base), ascending. Its failure stops the visit and is returned. */
typedef CUresult (*vmh_visit_run_fn)(vmh_visit_rec_t *recs, size_t n, void *arg);

/* Sorts recs[0..n) by address (each has a range or a paused description) and calls fn on each
 * maximal run of adjacent records, in order, until one fails. The records' owners hold their
 * locks across the call (the heap's visit, heap.h). */
CUresult vmh_visit_runs(vmh_visit_rec_t *recs, size_t n, vmh_visit_run_fn fn, void *arg);

/* Destroys p->resumed (unmapping it), releases p->host, then drops the reservations'
 * references (freeing an address when no resumed range maps it). NULL is allowed. */
void vmh_paused_destroy(vmh_paused_t *p);

#endif
