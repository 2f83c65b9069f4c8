/* Backup staging 2: copies device memory into pageable host memory through two pinned slots.
 *
 * The driver copies one slot's worth at a time asynchronously into one pinned slot (the pinned
 * copy rate) while the copy pool moves the other slot, filled just before, into the destination
 * in parallel parts (where the page faults of fresh memory are paid, on several cores). Measured
 * as a probe on an H200 (tools/probe/backup_rate.c, docs/SLEEP.md's design notes); this is the
 * library's own version of it, for the first pause with a backup.
 *
 * One thread uses a ring at a time (the pausing thread, under the pause layer's lock). The
 * slots are pinned portable (every context may copy into them); the stream belongs to the
 * context current at the first copy after open or vmh_staging_leave_context, and the copies
 * must run with that context current until the next vmh_staging_leave_context. */
#ifndef VMH_STAGING_H
#define VMH_STAGING_H

#include "copypool.h"
#include "driver.h"

#include <stdbool.h>
#include <stddef.h>

typedef struct vmh_staging {
    size_t slot_size;
    void *slot[2];       /* cuMemHostAlloc'd, slot_size bytes each */
    CUcontext pinned_in; /* the context current at open (freeing the slots needs one) */
    CUstream stream;     /* NULL until the first copy in the current context */
    bool in_flight;      /* a copy into a slot is queued and not yet waited for */
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

/* The end of the copies in the current context (the one the copies ran in, still current):
 * waits for a copy left queued by a failure and destroys the stream. Nothing when no copy ran. */
void vmh_staging_leave_context(vmh_staging_t *s);

/* Frees the slots (with the context of open made current for the call) and joins the workers.
 * After vmh_staging_leave_context for every context that copied. */
void vmh_staging_close(vmh_staging_t *s);

#endif
