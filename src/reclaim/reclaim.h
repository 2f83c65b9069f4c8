/* Layer "reclaim": things to release once the GPU has passed a point, and who waits for it.
 *
 * Freed memory may be handed out again only after the work submitted before its free, in every
 * context of its device, has completed. A layer that frees something parks an item here with
 * the device's current generation (vmh_reclaim_now) and its bytes; the item carries how it is
 * released (a function and the record it is embedded in: ownership as data, so this file knows
 * nothing of buffers, caches or carved extents). A wait (vmh_reclaim_wait) first advances the
 * generation (taking the old value g), then waits for every context of the device
 * (vmh_ctx_sync_device, contexts.h), then calls the release of every item parked with a
 * generation <= g: each was parked before the wait began, so no work submitted before its free
 * can still run.
 *
 * Who waits. In steady state only the reclaim thread (one per process, started at the first
 * park or free released at once, never in a forked child, stopped at exit): it waits while
 * anything is parked (and, for its tidy of idle memory, heap_upkeep.c, while anything is idle) and
 * no stream of the process captures, so application threads do not stall. An application thread
 * waits only
 *   - before an allocation makes new memory, while the device's parked bytes exceed
 *     VMMHOOK_PARK_LIMIT and no stream captures (vmh_reclaim_throttle), and at the free of one
 *     buffer larger than the limit (the heap's front);
 *   - when the driver ran out of memory, or the program asked for it (VMMHOOK_FREE_SYNC, a
 *     blocking vmm_realloc, vmh_heap_trim): vmh_reclaim_wait(r, VMH_WAIT_APP), which never
 *     synchronizes while the driver would refuse it to the calling thread (a capture:
 *     vmh_capture_forbids_unsafe) and answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED instead.
 * Threads that need parked memory at the same time share one wait: a thread that waited for
 * another's wait which began after its own request returns at once.
 *
 * Lock order (witness.h: RECLAIM_WAIT, RECLAIM_QUEUE, RECLAIM_THREAD): the wait lock, then
 * whatever the release functions take (they run without the queue lock, under the wait lock); a
 * layer may park (taking the queue lock and, rarely, the reclaim thread's lock) while it holds
 * its own locks, but must never wait while it holds them.
 */
#ifndef VMH_RECLAIM_H
#define VMH_RECLAIM_H

#include "device.h"
#include "phase.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct vmh_parked vmh_parked_t;

/* Releases what `item` stands for; `passed` is the generation the GPU has passed (every free
 * tagged <= passed is safe). Returns the parked bytes it made reusable (what vmh_reclaim_park
 * and vmh_reclaim_add_bytes counted for them). May park the item again (with a generation
 * > passed, and 0 more bytes: the bytes left were counted already). Runs without any lock of
 * this file. */
typedef size_t (*vmh_release_fn)(vmh_parked_t *item, uint64_t passed);

/* Embedded in the record it stands for (container_of finds the record). */
struct vmh_parked {
    vmh_release_fn release;
    uint64_t gen;
    atomic_bool queued;        /* parked and not yet taken for release */
    vmh_parked_t *prev, *next; /* the queue (its lock) */
    /* The list of items taken for one release (under the wait lock): a separate link, as
     * another thread may park an item again before its release runs. */
    vmh_parked_t *taken_next;
};

/* Parked bytes are counted per thread shard, so that frees on many threads do not all write
 * one line: a thread adds to (or, releasing, takes from) its shard, and moves the shard's count
 * into the device's total once it passes VMH_PARK_QUANTUM either way. The exact figure is the
 * total plus every shard; the total alone is off by less than VMH_PARK_SHARDS quanta, which is
 * what vmh_reclaim_throttle's first look allows for. Each count sits 64 bytes from the next:
 * never two in one cache line (no _Alignas: the heap callocs this). */
#define VMH_PARK_SHARDS 16
#define VMH_PARK_QUANTUM ((int64_t)1 << 20)
typedef struct vmh_park_shard {
    _Atomic int64_t bytes;
    char pad[64 - sizeof(int64_t)];
} vmh_park_shard_t;

typedef struct vmh_reclaim {
    vmh_dev_t *dev;
    pthread_mutex_t lock;      /* the queue */
    pthread_mutex_t wait_lock; /* one wait at a time; guards synced_gen, synced_any */
    _Atomic uint64_t gen;
    uint64_t synced_gen; /* the generation the last successful wait released */
    bool synced_any;
    vmh_parked_t *head, *tail;
    _Atomic size_t pending; /* items queued */
    /* Bytes freed and not yet reusable (VMMHOOK_PARK_LIMIT): the moved part, then the shards. */
    _Atomic int64_t parked_bytes;
    vmh_park_shard_t parked_shard[VMH_PARK_SHARDS];
    /* 1 + the generation of the last free released at once (vmh_reclaim_freed_at_once), 0 for
     * none: memory it made reusable may still be touched by queued work, so it is not unmapped
     * before a wait has passed it (vmh_reclaim_drain waits for it). */
    _Atomic uint64_t freed_at_once;
    /* 1 + the generation the last successful wait released (0: none yet): read without the
     * wait lock by a trim deciding what it may unmap (vmh_reclaim_passed). */
    _Atomic uint64_t passed;
    /* The next queue the reclaim thread serves (its lock): the thread keeps no table of
     * devices, each device's queue links itself in at init. */
    struct vmh_reclaim *served_next;
} vmh_reclaim_t;

/* Who is waiting: an application thread (counted as a blocking synchronization) or the reclaim
 * thread. */
typedef enum vmh_waiter { VMH_WAIT_APP, VMH_WAIT_BACKGROUND } vmh_waiter_t;

/* What this layer takes from the options; the front makes it once, at start (lifetime.c). */
typedef struct vmh_reclaim_settings {
    size_t park_limit; /* VMMHOOK_PARK_LIMIT: the park budget's cap (vmh_reclaim_park_budget) */
} vmh_reclaim_settings_t;

/* Takes a copy of *s, before any device is used (until then the budget has no cap). */
void vmh_reclaim_configure(const vmh_reclaim_settings_t *s);

/* Also makes r known to the reclaim thread (links it into the queues it serves). */
void vmh_reclaim_init(vmh_reclaim_t *r, vmh_dev_t *dev);

/* The generation to tag a free with now. */
uint64_t vmh_reclaim_now(const vmh_reclaim_t *r);

/* Parks item (its release function set), `bytes` more bytes not reusable until then, to be
 * released once the GPU has passed gen. An item already queued keeps the earlier of its
 * generation and gen. Starts the reclaim thread the first time (or wakes it). */
void vmh_reclaim_park(vmh_reclaim_t *r, vmh_parked_t *item, uint64_t gen, size_t bytes);

/* A free that made its memory reusable at once, without parking (the program's work runs in one
 * queue: contexts.h): nothing waits for it, but its memory must not be unmapped before the GPU
 * has passed it; vmh_reclaim_drain waits for that. One relaxed load and, the first time in a
 * generation, one store: the free path's cost. */
void vmh_reclaim_freed_at_once(vmh_reclaim_t *r);

/* The mark a free released at once leaves on what it freed (1 + the generation now), and
 * whether a successful wait has passed such a mark (0: nothing to pass). A trim unmaps memory
 * freed at once only once passed: a free may land between the trim's wait and its unmapping. */
uint64_t vmh_reclaim_mark(const vmh_reclaim_t *r);
bool vmh_reclaim_passed(const vmh_reclaim_t *r, uint64_t mark);

/* Counts bytes parked under an item that is queued already (its release returns them), without
 * the queue lock (carved.c's hot path). */
void vmh_reclaim_add_bytes(vmh_reclaim_t *r, size_t bytes);

/* Whether anything is parked (a hint: read without the lock); the bytes parked. */
bool vmh_reclaim_pending(const vmh_reclaim_t *r);
size_t vmh_reclaim_parked_bytes(const vmh_reclaim_t *r);

/* Waits for every context of the device to pass the current generation and releases what
 * that frees. A failed wait proves nothing: everything stays parked and the driver's code is
 * returned. VMH_WAIT_APP returns CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED at once, without any
 * lock or driver call, when the calling thread may not synchronize (a capture). Never call
 * with a lock of the heap held. */
CUresult vmh_reclaim_wait(vmh_reclaim_t *r, vmh_waiter_t who);

/* Waits (as VMH_WAIT_APP) until everything parked before the call has been released and the
 * GPU has passed every free released at once before it: a wait when anything is queued or
 * such a free is not yet passed, else until a wait in progress (the reclaim thread's) has finished
 * its releases: it takes its items off the queue before it releases them, so an empty queue
 * alone does not mean that their memory is back (a trim racing the reclaim thread
 * left a chunk mapped). Returns what the wait returned (CUDA_SUCCESS when none was needed). */
CUresult vmh_reclaim_drain(vmh_reclaim_t *r);
/* The same as `who` (the reclaim thread's tidy passes VMH_WAIT_BACKGROUND). */
CUresult vmh_reclaim_pass(vmh_reclaim_t *r, vmh_waiter_t who);

/* What may stay parked on the device before an allocating thread that needs new memory waits
 * itself (vmh_reclaim_throttle), or a free waits (vmh_reclaim_free_end): a share
 * of the program's recent peak of live bytes (1/VMH_PARK_SHARE, at least VMH_PARK_FLOOR), so
 * that a 642 MiB program does not hold 512 MiB parked nor a 60 GiB one stall at 512 MiB;
 * VMMHOOK_PARK_LIMIT caps it (0: nothing may stay parked). */
#define VMH_PARK_SHARE 8
#define VMH_PARK_FLOOR ((size_t)64 << 20)
size_t vmh_reclaim_park_budget(const vmh_reclaim_t *r);

/* Before an allocation on an application thread makes new memory (it found none in the cache
 * or in free carved space: an allocation served from memory the program already has
 * grows nothing and never waits): waits (as VMH_WAIT_APP) while more than VMMHOOK_PARK_LIMIT bytes
 * are parked, unless a stream of the process is capturing (then the allocation is served from
 * fresh memory, which needs no wait). Returns whether it waited (the caller then looks for
 * released memory again before making new). */
bool vmh_reclaim_throttle(vmh_reclaim_t *r);

/* A free on an application thread is bracketed by these two. Between them a park does not wake
 * the reclaim thread; vmh_reclaim_free_end decides: when the freeing thread waits itself, that
 * wait releases what the free parked, and a wake would only make the thread contend for the
 * wait lock and the owners' locks with it (a futex wake per pair of a 1 GiB free-then-allocate
 * loop); otherwise the wake a park owed is made there.
 *
 * vmh_reclaim_free_end: `how` says what the free asked for (VMH_FREE_NO_WAIT: an asynchronous
 * free, one released at once, a capture; VMH_FREE_THROTTLE: waits (as VMH_WAIT_APP) when the
 * buffer of `bytes` alone is larger than the park budget, as native cudaFree does: the next
 * allocation that needs new memory would wait for it anyway (vmh_reclaim_throttle), and waiting
 * here makes it reusable before that allocation comes, without a handoff to the reclaim
 * thread; a budget of 0 (VMMHOOK_PARK_LIMIT=0) never waits here; VMH_FREE_WAIT: waits,
 * VMMHOOK_FREE_SYNC). Call it after a failed park too (it then only ends the bracket). */
typedef enum vmh_free_wait { VMH_FREE_NO_WAIT, VMH_FREE_THROTTLE, VMH_FREE_WAIT } vmh_free_wait_t;
void vmh_reclaim_free_begin(void);
void vmh_reclaim_free_end(vmh_reclaim_t *r, size_t bytes, vmh_free_wait_t how);

/* Tests' reset: releases every item without waiting (the driver's ledger is checked after). */
void vmh_reclaim_release_all(vmh_reclaim_t *r);
/* Makes r unknown to the reclaim thread; stop the thread first (vmh_reclaim_stop). */
void vmh_reclaim_destroy(vmh_reclaim_t *r);

/* --- the reclaim thread --- */

/* Stops the reclaim thread and waits until it has ended (it makes no driver call once this
 * returns). The next park starts one again while the phase allows it (phase.h: RUNNING, not a
 * forked child): after exit began none is; in the tests' reset one is. In a forked child it
 * does nothing (the thread is the parent's, and its lock may have been held there). */
void vmh_reclaim_stop(void);

/* The reclaim layer's process-event steps (phase.h, walked by lifetime.c): exit stops the
 * thread (vmh_reclaim_stop). A fork needs none: in a child the phase says no thread runs. */
extern const vmh_steps_t vmh_reclaim_steps;

/* fn is called each time the thread starts (once in practice), after it started: lifetime.c
 * registers its exit handler there, which stops the thread (vmh_reclaim_steps) before the
 * CUDA runtime's and the driver's own exit handlers run (the thread starts at the first park or
 * free released at once, after the driver is initialized; an exit handler registered after theirs
 * runs before theirs). This file registers no handler of its own. */
void vmh_reclaim_on_first_start(void (*fn)(void));

/* Whether the reclaim thread runs now (tests and reports). */
bool vmh_reclaim_thread_running(void);

#ifdef VMH_TESTING
/* Tests: whether parks start the reclaim thread (default true; kept across vmh_reclaim_stop).
 * Suites that count synchronizations turn it off and wait themselves. */
void vmh_reclaim_background(bool on);
/* Tests: waits until the reclaim thread has nothing left it could release now (the queues are
 * empty, or a capture holds them), at most timeout_ms; false on timeout. */
bool vmh_reclaim_settle(unsigned timeout_ms);
/* Tests: how many times a park signalled the reclaim thread while it slept (a lock and a futex
 * wake, syscalls on the freeing thread) since the process began. */
unsigned long vmh_reclaim_wakes(void);
#endif

#endif
