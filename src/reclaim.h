/* Heap layer 4b: things to release once the GPU has passed a point.
 *
 * Freed memory may be handed out again only after the work queued before its free has
 * completed. A layer that frees something parks an item here with the device's current
 * generation (vmh_reclaim_now); the item carries how it is released (a function and the record
 * it is embedded in: ownership as data, so this file knows nothing of buffers, caches or
 * packing). A wait (vmh_reclaim_wait) first advances the generation (taking the old value g),
 * then waits for the GPU, then calls the release of every item parked with a generation <= g:
 * each was parked before the wait began, so no work queued before its free can still run.
 *
 * Threads that need parked memory at the same time share one wait: a thread that waited for
 * another's wait which began after its own request returns at once.
 *
 * Lock order: the wait lock, then whatever the release functions take (they run without the
 * queue lock, under the wait lock); a layer may park (taking the queue lock) while it holds its
 * own locks, but must never wait while it holds them.
 */
#ifndef VMH_RECLAIM_H
#define VMH_RECLAIM_H

#include "device.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct vmh_parked vmh_parked_t;

/* Releases what `item` stands for; `passed` is the generation the GPU has passed (every free
 * tagged <= passed is safe). May park the item again (with a generation > passed). Runs
 * without any lock of this file. */
typedef void (*vmh_release_fn)(vmh_parked_t *item, uint64_t passed);

/* Embedded in the record it stands for (container_of finds the record). */
struct vmh_parked {
    vmh_release_fn release;
    uint64_t gen;
    atomic_bool queued; /* parked and not yet taken for release */
    vmh_parked_t *prev, *next; /* the queue (its lock) */
    /* The list of items taken for one release (under the wait lock): a separate link, as
     * another thread may park an item again before its release runs. */
    vmh_parked_t *taken_next;
};

typedef struct vmh_reclaim {
    vmh_dev_t *dev;
    pthread_mutex_t lock;      /* the queue */
    pthread_mutex_t wait_lock; /* one wait at a time; guards synced_gen, synced_any */
    _Atomic uint64_t gen;
    uint64_t synced_gen; /* the generation the last successful wait released */
    bool synced_any;
    vmh_parked_t *head, *tail;
    _Atomic size_t pending; /* items queued */
} vmh_reclaim_t;

void vmh_reclaim_init(vmh_reclaim_t *r, vmh_dev_t *dev);

/* The generation to tag a free with now. */
uint64_t vmh_reclaim_now(const vmh_reclaim_t *r);

/* Parks item (its release function set) to be released once the GPU has passed gen. An item
 * already queued keeps the earlier of its generation and gen. */
void vmh_reclaim_park(vmh_reclaim_t *r, vmh_parked_t *item, uint64_t gen);

/* Whether anything is parked (a hint: read without the lock). */
bool vmh_reclaim_pending(const vmh_reclaim_t *r);

/* Waits for the GPU to pass the current generation and releases what that frees. A failed wait
 * proves nothing: everything stays parked and the driver's code is returned. Never call with a
 * lock of the heap held. */
CUresult vmh_reclaim_wait(vmh_reclaim_t *r);

/* Tests' reset: releases every item without waiting (the driver's ledger is checked after). */
void vmh_reclaim_release_all(vmh_reclaim_t *r);
void vmh_reclaim_destroy(vmh_reclaim_t *r);

#endif
