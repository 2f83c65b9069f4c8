/* Layer "backup staging": the host memory that backups live in, and how a first pause fills it.
 *
 * This layer owns every byte of host memory a backup uses (the pause layer asks it, never pins
 * or maps on its own):
 *
 * - Backups (vmh_staging_backup_get / _put): a pinned buffer kept from an earlier pause or
 *   resume when a free one fits, else fresh pageable memory (huge pages advised).
 * - The pool of kept pinned buffers and its budget. A backup becomes a kept pinned buffer by
 *   registration (cuMemHostRegister) of memory a copy has already touched (the fast way to pin:
 *   docs/SLEEP.md's design notes), either in the background while a pause's ring copies the next
 *   buffers (vmh_staging_pin_later) or by the resume before its copy back (vmh_staging_pin_now),
 *   and stays pinned for later pauses within a budget that follows the host:
 *       budget = min(VMMHOOK_PIN_LIMIT, physical memory / 4)
 *   and no new pinning that would leave less than physical memory / 8 available (MemAvailable);
 *   under pressure (available below that mark at the start of a pause or a resume) free kept
 *   buffers are given back until the mark is met again. "Physical" and "available" are the
 *   host's (/proc/meminfo), or the memory cgroup's when it is smaller.
 * - The staging ring: the driver copies one slot's worth at a time asynchronously into one of two
 *   pinned slots (the pinned copy rate) while the copy pool moves the other slot, filled just
 *   before, into the destination in parallel parts (where the page faults of fresh memory are
 *   paid, on several cores). Measured first as a probe (tools/probe/backup_rate.c,
 *   docs/SLEEP.md's design notes); this is the library's own version of it, for a pause's fresh
 *   backups. A ring also runs the pinner: one thread that registers the backups queued by
 *   vmh_staging_pin_later while the ring copies the next ones.
 *
 * One thread uses a ring at a time (the pausing thread, under the pause layer's lock). The
 * slots are pinned portable (every context may copy into them); the stream belongs to the
 * context current at the first copy after open or vmh_staging_leave_context, and the copies
 * must run with that context current until the next vmh_staging_leave_context. The pool's
 * functions take their own lock and may be called from any thread; _get, _put, _pin_later and
 * _pinned_free make no driver call. */
#ifndef VMH_STAGING_H
#define VMH_STAGING_H

#include "copypool.h"
#include "driver.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

/* ---- the pool of kept pinned backups -------------------------------------------------------- */

/* VMMHOOK_PIN_LIMIT: the cap on pinned host memory kept for backups (0: none kept). */
void vmh_staging_configure(size_t pin_cap);

/* At the start of each pause and resume (under the pause layer's lock, any context current or
 * none): reads the host's memory; under pressure gives back free kept buffers (unregistering
 * each with the context it was registered in); sets how much may be newly pinned during the
 * call (vmh_staging_pin_later, vmh_staging_pin_now). */
void vmh_staging_budget_begin(void);

/* What host memory a backup may live in (the pause's flags, include/vmmhook.h):
 *   ANY       a kept pinned buffer, or pageable memory that may be pinned later (the default);
 *   PAGEABLE  fresh pageable memory, never pinned (VMM_PAUSE_PAGEABLE: reclaimable by the
 *             kernel, given back to the system when the backup goes);
 *   FILE      a file of its own in the directory of vmh_staging_set_dir, mapped shared and never
 *             pinned (VMM_PAUSE_DISK); the file is removed when the backup goes. */
typedef enum { VMH_BACKUP_ANY, VMH_BACKUP_PAGEABLE, VMH_BACKUP_FILE } vmh_backup_kind_t;

/* Host memory for a backup of size bytes. ANY: the smallest free kept pinned buffer that fits
 * (*pinned true; direct copies into it run at the pinned rate), else fresh pageable memory,
 * starting on a huge-page boundary with huge pages advised. PAGEABLE: the latter; FILE: a
 * file's shared mapping. NULL when the system has none (for FILE also: no directory set, or
 * the file cannot be made). */
void *vmh_staging_backup_get(size_t size, vmh_backup_kind_t kind, bool *pinned);

/* After the copy into a backup: a FILE backup's pages leave the process's resident memory (they
 * stay in the file; the resume's copy reads them back). Nothing for the other kinds. */
void vmh_staging_backup_settle(void *host, size_t size);

/* The directory of FILE backups (copied; NULL: none). False when out of memory. */
bool vmh_staging_set_dir(const char *dir);

/* Gives back every kept pinned buffer that holds no paused backup (unregistered, unmapped):
 * vmm_backup_trim. Returns the bytes given back. Any thread, no context needed. */
size_t vmh_staging_trim(void);

/* The fresh pageable backups a pause expects (bytes): mapped now as one region (huge-page
 * aligned, huge pages advised), which _get then hands out in order, so that no mmap runs during
 * the pause's copies. Why: an mmap takes the process's address-space lock for writing, and a
 * registration by the pinner holds it for reading while it pins a backup's pages, so a mapping
 * per backup would wait for the previous backup's registration and undo the overlap. Pausing
 * thread only, one region at a time; _close unmaps what was not handed out. A backup from the
 * region is given back like any other (its own pages are unmapped at _put). */
void vmh_staging_region_open(size_t bytes);
void vmh_staging_region_close(void);

/* Gives a backup back (a vmh_host_release_fn, range.h): a kept pinned one stays pinned for the
 * next backup, a pageable one goes back to the system. Any thread; no driver call. */
void vmh_staging_backup_put(void *host, size_t size);

/* Bytes of kept pinned buffers free for the next backups. */
size_t vmh_staging_pinned_free(void);

/* Before a resume copies a pageable backup back: registers it (touched by the pause's copy:
 * the fast registration) when the call's budget has room, and keeps it. The calling thread has
 * ctx current. False when it stays pageable (no room, or the driver refused: the copy back is
 * only slower). */
bool vmh_staging_pin_now(void *host, size_t size, CUcontext ctx);

/* ---- the staging ring ----------------------------------------------------------------------- */

typedef struct vmh_staging {
    size_t slot_size;
    void *slot[2];       /* cuMemHostAlloc'd, slot_size bytes each */
    CUcontext pinned_in; /* the context current at open (freeing the slots needs one) */
    CUstream stream;     /* NULL until the first copy in the current context */
    bool in_flight;      /* a copy into a slot is queued and not yet waited for */
    bool pinner_running; /* the pinner thread was started (at the first vmh_staging_pin_later) */
    pthread_t pinner;
    vmh_copy_pool_t pool;
} vmh_staging_t;

/* Pins the two slots in ctx (current on the calling thread) and starts `workers` copy threads.
 * On failure (the driver's code) nothing is held. */
CUresult vmh_staging_open(vmh_staging_t *s, CUcontext ctx, size_t slot_size, int workers);

/* Copies n bytes of device memory at src (readable by the current context's device) into dst;
 * every byte is in dst when it returns CUDA_SUCCESS. The copy is ordered after nothing: the
 * caller has waited for the work that writes src. On failure (the driver's code: making the
 * stream, queueing a copy, waiting for one) dst holds part of the bytes and the ring is still
 * usable, and still to be closed; a copy queued before the failure is waited for by the next
 * copy or by vmh_staging_leave_context. */
CUresult vmh_staging_copy(vmh_staging_t *s, void *dst, CUdeviceptr src, size_t n);

/* The same for a run: the device bytes from src on, as many as dst_len[0..ndst) add up to, into
 * dst[0] (dst_len[0] bytes), then dst[1], ...: one stream of pieces through the ring for the
 * whole run (a pause's adjacent records), not one per destination. */
CUresult vmh_staging_copy_run(vmh_staging_t *s, void *const *dst, const size_t *dst_len,
                              size_t ndst, CUdeviceptr src);

/* A pageable backup (from vmh_staging_backup_get, its copy done, its holder paused) that should
 * stay pinned: when the call's budget has room it is claimed and queued for the ring's pinner
 * thread (started now if it is the first), which registers it while the ring goes on; true
 * then. Until the pinner is done with it, _put only marks it free; a registration the driver
 * refuses leaves it pageable (given back to the system if it was put meanwhile). */
bool vmh_staging_pin_later(vmh_staging_t *s, void *host, size_t size);

/* The end of the copies in the current context (the one the copies ran in, still current):
 * waits for a copy left queued by a failure and destroys the stream. Nothing when no copy ran. */
void vmh_staging_leave_context(vmh_staging_t *s);

/* Waits until the pinner has registered everything queued and joins it, frees the slots (with
 * the context of open made current for the call) and joins the workers. After
 * vmh_staging_leave_context for every context that copied. Nothing of the ring outlives it. */
void vmh_staging_close(vmh_staging_t *s);

/* The host's memory as the budget sees it: total and available bytes; false when unknown. */
typedef struct vmh_host_mem {
    size_t total, available;
} vmh_host_mem_t;
typedef bool (*vmh_host_mem_fn)(vmh_host_mem_t *out);

/* The host's memory now, through the reader the budget uses (the tests' when they set one):
 * for the other owner of pinned host memory, overflow.c. */
bool vmh_staging_host_mem(vmh_host_mem_t *out);

#ifdef VMH_TESTING
/* The production reader (/proc/meminfo, the memory cgroup, sysconf as a fallback). */
bool vmh_host_mem_read(vmh_host_mem_t *out);
/* Tests: replace the reader (NULL: the production one). */
void vmh_staging_set_host_mem(vmh_host_mem_fn fn);
/* Tests: gives back every kept buffer (none may be in use), restores the reader. */
void vmh_staging_reset(void);
/* Tests: kept pinned buffers, and the bytes they hold (free and in use). */
size_t vmh_staging_kept_count(void);
size_t vmh_staging_kept_bytes(void);
#endif

#endif
