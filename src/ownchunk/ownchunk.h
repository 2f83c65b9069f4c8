/* Layer "own-chunk buffers": buffers with a range of their own (chunks nobody else uses): made,
 * grown, shrunk, moved, freed into the cache.
 *
 * An own-chunk buffer is LIVE while the program holds it, RESIZING while a grow runs its driver
 * calls without the lock (frees and other resizes of it are refused meanwhile), PARKED once freed
 * until the GPU has passed the free (its reclaim item then hands the range to the cache and the
 * record to the unused list). What a move or a shrink leaves behind (the old address, the tail)
 * is parked in reclaim.h as an old range: marked dead in the registry, unmapped once the GPU is
 * past it. Records are recycled per device, never freed while the process runs.
 *
 * One mutex per device guards the records, their lists and their registry entries. No driver
 * call is made under it; a function that needs a wait drops it first.
 */
#ifndef VMH_OWNCHUNK_H
#define VMH_OWNCHUNK_H

#include "cache.h"
#include "device.h"
#include "overflow.h"
#include "reclaim.h"

#include <pthread.h>

typedef struct vmh_ownbuf vmh_ownbuf_t;

typedef struct vmh_ownlist {
    vmh_ownbuf_t *head, *tail;
    size_t count, bytes;
} vmh_ownlist_t;

typedef struct vmh_ownchunks {
    vmh_dev_t *dev;
    vmh_reclaim_t *reclaim;
    vmh_cache_t *cache;
    vmh_overflow_dev_t *overflow; /* where spilled buffers come from (overflow.h) */
    pthread_mutex_t lock;
    vmh_ownlist_t live, parked, unused;
    vmh_ownlist_t paused;      /* live buffers whose memory is given back (pause.c) */
    atomic_bool frozen;        /* set by pause.c: no buffer is served from this set meanwhile */
    _Atomic size_t old_ranges; /* parked old ranges not yet unmapped */
} vmh_ownchunks_t;

void vmh_ownchunk_init(vmh_ownchunks_t *set, vmh_dev_t *dev, vmh_reclaim_t *reclaim,
                       vmh_cache_t *cache, vmh_overflow_dev_t *overflow);

/* A buffer of `size` bytes in host memory at device addresses (overflow.h), for what the
 * device could not serve; freed, its memory is given back, never cached. */
CUresult vmh_ownchunk_alloc_spilled(vmh_ownchunks_t *set, size_t size, void *site,
                                    CUdeviceptr *out);

/* Moves a spilled buffer's host memory to the device at the same address (vmm_prefetch; p any
 * address in it): b locked, unlocked on return. *moved grows by the bytes moved. NOT_PERMITTED
 * for a paused buffer, ALREADY_MAPPED for a shared one (CUDA IPC, a move's old range);
 * OUT_OF_MEMORY when the device has no room (nothing changed). The copy runs on `stream`.
 * The caller has waited for the device's work, and the calling thread's context is on the
 * buffer's device. */
CUresult vmh_ownchunk_prefetch_locked(vmh_ownbuf_t *b, CUdeviceptr p, CUstream stream,
                                      size_t *moved);
/* The same for every spilled buffer of the set in one pass: all the copies queued, one wait,
 * then the swaps; the first failure is returned, the others are still moved. The copies run on
 * `stream` (the library's, on the buffers' device, current in the calling thread). The host
 * memory they leave goes back from the reclaim thread. */
CUresult vmh_ownchunk_prefetch_all(vmh_ownchunks_t *set, CUstream stream, size_t *moved);

/* A buffer of `size` bytes (rounded to chunks): from the cache, after a wait for parked frees
 * when that may help, or new. growable: address space headroom for later grows. site: where
 * the program asked (leak report). *no_address: the address space budget ran out. */
CUresult vmh_ownchunk_alloc(vmh_ownchunks_t *set, size_t size, bool growable, void *site,
                            CUdeviceptr *out, bool *no_address);

/* On an own-chunk buffer found and locked with vmh_owner_lock (the caller unlocks): */
/* Parks the live buffer starting at p; *req gets the size asked for. INVALID_VALUE for an
 * interior pointer, a double free or a buffer being resized. A paused buffer is freed at once:
 * *gone gets what is left of it, for the caller to destroy (vmh_paused_destroy: its addresses
 * and backup go, driver calls) once it has unlocked; NULL otherwise. */
CUresult vmh_ownchunk_park_locked(vmh_ownbuf_t *b, CUdeviceptr p, size_t *req, vmh_paused_t **gone);
bool vmh_ownchunk_find_locked(vmh_ownbuf_t *b, CUdeviceptr p, vmh_buffer_info_t *info);
/* Where device address p's bytes (n of them) are in b's backup: paused with one, or running
 * with one kept (pause.c); NULL when there is none or the bytes are not inside b. */
const void *vmh_ownchunk_backup_locked(vmh_ownbuf_t *b, CUdeviceptr p, size_t n);
/* Fills base, size, offset, serial and the range for an export. A freed exported buffer is
 * not cached: its range is destroyed once queued work is done (its chunks are never served
 * again to this process), and its serial dies with it. */
CUresult vmh_ownchunk_export_locked(vmh_ownbuf_t *b, vmh_export_t *out, const vmh_range_t **range);
/* Whether b is still the live buffer exported at base with serial. */
bool vmh_ownchunk_export_alive_locked(vmh_ownbuf_t *b, CUdeviceptr base, uint64_t serial);

/* Resizes the live buffer starting at *p in place, by remapping, or by shrinking (locks by
 * itself). CUDA_ERROR_NOT_FOUND when *p is not a live own-chunk buffer (foreign, or freed),
 * INVALID_VALUE when it is not its start or it is being resized. *old_size: the size asked for
 * before. */
CUresult vmh_ownchunk_realloc(CUdeviceptr *p, size_t size, bool async, size_t *old_size,
                              bool *no_address);

/* The heap's visit (heap.h): fn on every run of adjacent live and paused buffers (range.h's
 * vmh_visit_runs; each buffer has a reservation of its own), under the set's lock
 * (held across fn's driver calls, like the peer-access grant: a rare, explicit call). Buffers
 * being resized are left alone. A paused buffer has no range: a free releases it (its
 * reservations; its memory went at the pause), a lookup answers from its paused description,
 * a resize or an export is refused with CUDA_ERROR_NOT_PERMITTED. */
CUresult vmh_ownchunk_visit(vmh_ownchunks_t *set, vmh_visit_run_fn fn, void *arg);

/* The set a buffer belongs to (the front finds the buffer's tag from it). */
vmh_ownchunks_t *vmh_ownchunk_set_of(const vmh_ownbuf_t *b);

/* Bytes of parked buffers (whole ranges: each serves an allocation once released). */
size_t vmh_ownchunk_parked_bytes(vmh_ownchunks_t *set);

/* Walks the live buffers (leak report): base, size asked for, call site. */
void vmh_ownchunk_for_each_live(vmh_ownchunks_t *set,
                                void (*cb)(CUdeviceptr base, size_t size, void *site, void *arg),
                                void *arg);

/* Tests: destroys everything (after vmh_reclaim_release_all). */
void vmh_ownchunk_destroy(vmh_ownchunks_t *set);

#endif
