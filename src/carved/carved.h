/* Layer "carved": buffers carved from shared extents (the glue between a device and the
 * host-side sub-allocator of arena.h).
 *
 * Carved buffers live in VMH_SHARDS shards per device (VMH_CLASS_SHARDS per size class, below),
 * each with its own mutex, arena, extents (each backed by a range, or by pieces between holes),
 * registry entries of those extents and set of exported carved buffers.
 *
 * Geometry. A shard's extents are carved from its spans (span.h): large
 * reservations (the first 16 GiB of address space, each next one as large as the shard holds,
 * up to 64 GiB, at most a quarter of what is left of VMMHOOK_VA_LIMIT), first fit, so that a
 * shard's extents are neighbours in address space, in the order they were made, and an extent given
 * back leaves its addresses to the next one. A span's reservation is referenced by the span and by
 * every mapping in it (handle.h): it is freed once its last extent is given back and the span
 * dropped. The size of a shard's next shared extent doubles with every new extent, whatever its
 * size, up to 1 GiB; a shared extent is also at most 1/16 of the device's live bytes (at least 32
 * MiB), and a request over 1/8 of it gets an extent of its own size. 20480 x 2 MiB in one tag: 101
 * extents in 3 spans (tests/unit/test_geometry.c prints each phase's driver calls).
 * Joins and growth (docs/DESIGN.md): before new memory is made, neighbouring extents
 * of a span whose free space holds a request only together become one extent (no driver call;
 * the higher one's addresses pass to the lower one's record, which vmh_owner_lock follows), and
 * a new extent is carved right after an extent with a free end and joined to it (for a request
 * of its own size, only what that end lacks), so a shard's free space stays in few pieces as an
 * expandable segment's does.
 * Holes: an extent is backed by chunks of max(128 MiB, extent / 3) (one chunk up to
 * 128 MiB: carved_place.c's extent_chunk; larger chunks than holes would want, smaller ones break
 * the pause bound of 256 calls for 20480 x 2 MiB: 593 calls to allocate, 246 to pause), at most
 * VMMHOOK_CHUNK_MAX (docs/DESIGN.md, "Chunk size"). Once a window the tidy (heap_upkeep.c)
 * unmaps the chunks that lie wholly in free space inside extents that hold live blocks, beyond
 * what the recent peak keeps (vmh_carved_punch_upto); the space stays the arena's hole
 * (arena.h), never served, its addresses kept. An extent's backing is then a
 * list of pieces (vmh_ext_piece_t), the ranges between its holes, each a record of the heap's
 * visit (pause, resume and backups per piece; an export hands over its block's piece). An
 * allocation that no mapped free space fits maps a hole again before a new extent is made
 * (one chunk of the hole's size, or chunks of VMMHOOK_CHUNK_MAX, on the allocating thread with
 * the shard's lock let go; out of memory there goes the new-extent way). Bench (d)'s churn keeps
 * its free space mapped (its live bytes stay near their peak, and chunks are large): 1.24x on the
 * simulated driver, as before (BENCHMARKS.md, "Holes inside extents, built"). A thread allocates in
 * the shard it picked at its first allocation, in the request's size class, and looks at other
 * shards' free space (of that class) only when its own has none (and, for a request of its own
 * size, at every shard's free ends in the class to grow); a free goes to the shard that owns the
 * extent. An extent given back is registered dead (device.h) from its unlinking until its chunks
 * are unmapped, then unknown. An exported block is listed with its export serial until it is freed;
 * then its export is dead and its memory is never served again: another process may map the chunk
 * (natively, memory freed by its exporter stays the importer's), so its extent is retired (arena.h:
 * it serves no new block) and given back once its other blocks are freed and the GPU is past them;
 * the driver keeps the chunk for as long as an importer holds it. A freed block is parked in its
 * arena with the reclaim generation; each shard parks one item in reclaim.h whose release unparks
 * the shard's blocks up to the generation passed and gives back the retired extents that this
 * empties.
 *
 * Lock order (witness.h, OWNER): the reclaim wait lock, then one shard lock, then the reclaim
 * queue lock; never two shard locks at once; no driver call under a shard lock but pause.c's
 * visit (OWNER_VISIT: rare and explicit, and nothing meets a record half-paused). A hole's
 * fill maps, and a punch unmaps, with the lock let go: the extent (a fill) or the shard (a
 * punch) is marked meanwhile, and nothing maps, unmaps or gives back addresses of a marked one
 * (carved_internal.h's ext_settled), so frees and allocations in mapped space never wait
 * behind those driver calls.
 */
#ifndef VMH_CARVED_H
#define VMH_CARVED_H

#include "arena.h"
#include "device.h"
#include "reclaim.h"
#include "span.h"

#include <pthread.h>
#include <stdatomic.h>

/* Shards per size class: a thread picks one (vmh_carved_thread_shard) and allocates in it, in
 * the class of each request's size. Requests of at most VMH_SMALL_MAX bytes are carved in the
 * small class's shards, the others in the large class's: small blocks then never sit between
 * large ones, where a few live bytes would keep a large chunk mapped and split large free
 * space (PyTorch's caching allocator keeps a small pool apart for the same reason). */
#define VMH_CLASS_SHARDS 8
#define VMH_SHARDS (2 * VMH_CLASS_SHARDS)
#define VMH_SMALL_MAX ((size_t)1 << 20)

typedef struct vmh_ext vmh_ext_t;
typedef struct vmh_carved vmh_carved_t;

/* A live carved buffer that was exported, and the serial of its export. */
typedef struct vmh_carved_export {
    CUdeviceptr base;
    uint64_t serial;
} vmh_carved_export_t;

typedef struct vmh_shard {
    pthread_mutex_t lock;
    vmh_carved_t *carved;
    vmh_arena_t *arena;
    vmh_ext_t *exts;    /* extents in the arena */
    vmh_ext_t *spare;   /* records of trimmed extents, reused (registry readers may still look) */
    size_t extent_next; /* size of the shard's next extent (doubles up to a limit) */
    vmh_spans_t spans;  /* the address space its extents are carved from (span.h) */
    vmh_carved_export_t *exported; /* live carved buffers shared with other processes */
    size_t nexported, exported_cap;
    vmh_parked_t parked_item; /* queued in reclaim while the arena holds parked blocks */
    /* Punches whose unmapping runs after the lock is let go (carved_idle.c): while any does, no
     * extent of the shard is trimmed, punched or filled (ext_settled). Under the lock. */
    unsigned unmapping;
    /* Hints, stored under the lock (shard_note) and read without it. */
    _Atomic size_t nparked; /* parked blocks */
    _Atomic size_t free;    /* free bytes (not parked): a shard with less is not tried */
    _Atomic size_t extents; /* extents in the arena */
    _Atomic size_t holes;   /* bytes in holes (unmapped inside extents) */
    char pad[64];           /* keeps shards off each other's cache lines */
} vmh_shard_t;

struct vmh_carved {
    vmh_dev_t *dev;
    vmh_reclaim_t *reclaim;
    atomic_bool frozen; /* set by pause.c: nothing is served from these shards meanwhile */
    /* Punches of any shard still unmapping outside the lock: a relieve waits for them
     * (vmh_carved_settle: the memory they free is what its caller's retry needs). */
    _Atomic unsigned unmaps_in_flight;
    vmh_shard_t shards[VMH_SHARDS];
};

/* A stretch of an extent's backing between holes: a range, or while paused (range NULL;
 * pause.c) its addresses and backup. */
typedef struct vmh_ext_piece {
    vmh_range_t *range;
    vmh_paused_t *paused;
} vmh_ext_piece_t;

/* A backup kept after a resume (VMM_RESUME_KEEP_BACKUP) once its piece's range went (a hole
 * made or filled rebuilds the pieces) or one of its buffers was freed: the host copy of
 * [base, base + size) and the live buffers it still answers for (their bases), each buffer's
 * own. A buffer's free takes its base out; the last one out gives the host memory back (so
 * a free never drops a neighbour's backup). A pause drops them (it makes new ones). */
typedef struct vmh_ext_kept {
    CUdeviceptr base;
    size_t size;
    vmh_backup_t backup;
    CUdeviceptr *owners;
    size_t nowners, owners_cap;
    bool failed; /* out of host memory while listing the owners: the backup goes */
} vmh_ext_kept_t;

/* An extent's owner record (registry.h): the owner's lock is its shard's. */
struct vmh_ext {
    vmh_owner_t o;
    vmh_shard_t *shard; /* never changes once set: records are recycled within their shard */
    /* Its backing: pieces[0..npieces), ascending, holes between them (the arena's holes: what
     * the tidy unmapped); one piece (&one) until the tidy makes a hole. */
    vmh_ext_piece_t *pieces;
    size_t npieces, pieces_cap;
    vmh_ext_piece_t one;
    /* Kept backups detached from their pieces' ranges (vmh_ext_kept_t), a few at most. */
    vmh_ext_kept_t *kept;
    size_t nkept, kept_cap;
    vmh_extent_t *extent;
    CUdeviceptr va; /* its address space, taken from the shard's spans while the record */
    size_t va_size; /* serves an extent */
    vmh_ext_t *prev, *next;
    /* The reclaim mark of the last block freed at once in it (vmh_reclaim_mark; 0: none): a
     * trim gives the extent back only once a wait has passed it. Under the shard's lock. */
    uint64_t freed_mark;
    /* Hole fills mapping memory in it after the lock is let go (carved_place.c): while any
     * does, it is not trimmed, joined, punched or filled again (ext_settled). Under the lock. */
    unsigned filling;
};

CUresult vmh_carved_init(vmh_carved_t *pk, vmh_dev_t *dev, vmh_reclaim_t *reclaim);

/* Serves size bytes: the thread's shard, then free space in the others, and only then a new
 * extent (never waits for parked frees but on out of memory). *no_address: the address space
 * budget, not memory, ran out. */
CUresult vmh_carved_alloc(vmh_carved_t *pk, size_t size, CUdeviceptr *out, bool *no_address);

/* On an extent found and locked with vmh_owner_lock (the caller unlocks): */
/* Frees the live block starting at p; *req gets the size asked for. at_once: the program's
 * work runs in one queue (contexts.h), so the block is free space again at once (reclaim.h's
 * vmh_reclaim_freed_at_once keeps its extent mapped until the GPU has passed it); otherwise,
 * and always for an exported block, it is parked until the GPU has passed the free.
 * INVALID_VALUE for an interior pointer or a block that is not live. */
CUresult vmh_carved_park_locked(vmh_ext_t *e, CUdeviceptr p, bool at_once, size_t *req);
/* The live block containing p. */
bool vmh_carved_find_locked(vmh_ext_t *e, CUdeviceptr p, vmh_buffer_info_t *info);
/* Where device address p's bytes (n of them, inside one of e's live blocks) are in e's backup:
 * paused with one, or running with one kept (pause.c); NULL when there is none or the bytes are
 * not inside one block. */
const void *vmh_carved_backup_locked(vmh_ext_t *e, CUdeviceptr p, size_t n);
/* Resizes the live block at p in place when the following space allows (within
 * VMMHOOK_MEM_LIMIT); CUDA_ERROR_NOT_FOUND when p is not a block's start, OUT_OF_MEMORY when it
 * does not fit in place. A shrink's tail follows the free rule, at_once as for a free (park).
 * *old_size: the size asked for before. */
CUresult vmh_carved_resize_locked(vmh_ext_t *e, CUdeviceptr p, size_t size, bool at_once,
                                  size_t *old_size);
/* Fills base, size, offset, serial and the range of the live block containing p for an
 * export (the serial is kept until the block is freed; the free retires the extent). */
CUresult vmh_carved_export_locked(vmh_ext_t *e, CUdeviceptr p, vmh_export_t *out,
                                  const vmh_range_t **range);
/* Whether any of e's backing is paused (its block may not be resized or exported). */
bool vmh_carved_paused_locked(const vmh_ext_t *e);
/* Whether the block at base is still the live one exported with serial. */
bool vmh_carved_export_alive_locked(vmh_ext_t *e, CUdeviceptr base, uint64_t serial);

/* The heap's visit (heap.h): fn on every run of adjacent extents of each shard, under the
 * shard's lock (held across fn's driver calls: a rare, explicit call). A paused extent keeps its
 * blocks (frees of them work as ever: host bookkeeping only) but has no range; resizing or
 * exporting one of its blocks is refused with CUDA_ERROR_NOT_PERMITTED. */
CUresult vmh_carved_visit(vmh_carved_t *pk, vmh_visit_run_fn fn, void *arg);

/* Whether any shard holds parked blocks (a hint). */
bool vmh_carved_has_parked(vmh_carved_t *pk);

/* Gives back every empty extent; returns the bytes. */
size_t vmh_carved_trim(vmh_carved_t *pk);
/* Gives back empty extents until at least `bytes` (or all there are); returns the bytes. */
size_t vmh_carved_trim_upto(vmh_carved_t *pk, size_t bytes);
/* Gives back the reservations of the paused extents whose blocks were all freed while paused
 * (they hold no memory: no wait is needed), so that a resume does not map them again. */
void vmh_carved_trim_paused(vmh_carved_t *pk);

/* Holes: unmaps, from the tidy (outside any paused tag: none while frozen), the
 * chunks inside extents that lie in free space (not parked, freed before the last completed
 * wait, in no retired or exported extent, in an extent that holds a live or parked block:
 * empty ones are the trim's), until at least `bytes` (or all there are); the space stays
 * the arena's hole, never served until an allocation maps it again. One cuMemUnmap per stretch,
 * one cuMemRelease per chunk, after the shard's lock is let go (the shard marked unmapping
 * meanwhile; see the lock order above). Returns the bytes unmapped. */
size_t vmh_carved_punch_upto(vmh_carved_t *pk, size_t bytes);
/* Waits until no punch of pk (another thread's) is still unmapping: while one is, its shard's
 * empty extents are not trimmed and its memory is not free yet, and a relieve counts on both.
 * Call with no heap lock held. */
void vmh_carved_settle(vmh_carved_t *pk);
/* Bytes of the mapped chunks inside extents that lie wholly in free space (not parked) and
 * that a punch could unmap once the GPU has passed what was freed in them: what a relieve
 * gives back beside empty extents (cuMemGetInfo counts them free). Walks the extents under each
 * shard's lock; no driver call. */
size_t vmh_carved_hole_bytes(vmh_carved_t *pk);
/* Free bytes inside the shards' extents (a hint, no lock): what holes could take at most. */
size_t vmh_carved_free_hint(vmh_carved_t *pk);

/* Bytes of whole extents that hold no live block: what an allocation of any size could get
 * after a trim. Free space beside live blocks is not counted (see heap.h's idle bytes). */
size_t vmh_carved_idle_bytes(vmh_carved_t *pk);

/* Walks every live carved buffer (leak report). */
void vmh_carved_for_each_live(vmh_carved_t *pk, void (*cb)(const vmh_block_info_t *b, void *arg),
                              void *arg);

/* Tests: destroys everything (after vmh_reclaim_release_all). */
void vmh_carved_destroy(vmh_carved_t *pk);

/* The calling thread's carved shard (picked at its first carved allocation). */
unsigned vmh_carved_thread_shard(void);

#ifdef VMH_TESTING
/* Test hook (src/util/testable.h's convention): called on the allocating thread once a new extent
 * is published and its shard's lock let go, the window in which another thread's trim (a
 * pause's) could meet the extent. NULL: nothing. */
extern void (*vmh_carved_test_extent_published)(void);
/* Called by a punch once shard s's lock is let go and before its unmapping (the window in which
 * other threads free, allocate and trim in s while the driver unmaps). NULL: nothing. */
extern void (*vmh_carved_test_unmapping)(vmh_shard_t *s);
#endif

#endif
