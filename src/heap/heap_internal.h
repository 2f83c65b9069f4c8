/* Internal to the heap front (heap.c, heap_devices.c, heap_upkeep.c): the per-GPU record and
 * its tag parts and the records' table (the front's mode is the process's phase: phase.h), shared
 * by the three files of the layer. Nothing else includes this but tools/probe/churn_sim.c and
 * tests/unit/test_holes.c (test builds: they read the shards). */
#ifndef VMH_HEAP_INTERNAL_H
#define VMH_HEAP_INTERNAL_H

#include "heap.h"

#include "cache.h"
#include "carved.h"
#include "device.h"
#include "ownchunk.h"
#include "phase.h"
#include "reclaim.h"
#include "vmmhook.h"

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* One tag's memory on a device: an own-chunk set and carved shards of its own, so that memory
 * of one tag never shares a chunk with another tag's (pause.c gives a tag's memory back
 * alone). Made at the tag's first allocation on the device; freed only by the tests' reset. */
typedef struct tagpart {
    unsigned tag;
    vmh_carved_t carved;
    vmh_ownchunks_t own;
} tagpart_t;

/* One GPU's record: every layer's state for the device in one place (as PyTorch's
 * DeviceCachingAllocator), each layer handed a pointer to its own part, which that layer's header
 * defines: the heap front is the lowest layer that knows them all, so the record is its own.
 * Made at the device's first mention, without a lock or a driver call (a peer grant or the
 * program's primary context may come before any allocation); the heap's parts, from `dev` on,
 * are set up at the first allocation (then `ready`). Never freed while the process runs (only
 * the tests' reset frees it), so a reader that loaded one may use it without a lock. */
typedef struct hdev {
    /* From the record's making on: */
    vmh_grants_t grants;        /* handle layer's: the peers granted its chunks */
    _Atomic(CUcontext) primary; /* the program's primary context, as the interposer saw it */
    atomic_bool ready;          /* the parts below are set up (vmh_hdev_get) */
    /* From the first allocation on: the device's shape, then each layer's state. */
    vmh_dev_t dev;
    vmh_reclaim_t reclaim;
    vmh_cache_t cache; /* idle ranges are nobody's: any tag may reuse them */
    vmh_overflow_dev_t overflow;
    _Atomic(tagpart_t *) part[VMM_TAGS_MAX];
    /* The tidy's state (reclaim thread only, tidy_lock): the peak of live bytes of the window
     * before the current one, when the current one began, when the last tidy ran. */
    pthread_mutex_t tidy_lock;
    size_t peak_before;
    uint64_t window_ns, tidy_ns;
    /* Allocations of the device served from host memory, and of them small ones (overflow.h):
     * the statistics' per-device counts (vmh_heap_stats_devices). */
    _Atomic uint64_t spills, spills_small;
} hdev_t;

#define FOR_EACH_PART(h, p)                                                                        \
    for (unsigned part_i_ = 0; part_i_ < VMM_TAGS_MAX; part_i_++)                                  \
        for (tagpart_t *p = atomic_load_explicit(&(h)->part[part_i_], memory_order_acquire); p;    \
             p = NULL)

/* What the heap does with an owner of served memory, by its kind (heap_owners.c, the one place
 * that tells the kinds apart): a block of a shared extent (carved) or a buffer with chunks of
 * its own. Calls marked "locked" take the owner as vmh_owner_lock gave it (the caller unlocks);
 * each entry only calls down to its layer (carved.h, ownchunk.h), which knows nothing of this. */
typedef struct owner_ops {
    /* The tag's part the owner belongs to (locked or not: parts never change). */
    const tagpart_t *(*part)(const vmh_owner_t *o);
    /* Locked: frees the live buffer at p. at_once: its memory may be reused at once (see
     * reuse_at_once); *gone: what is left of a paused buffer, for vmh_paused_destroy after the
     * unlock (NULL when nothing). */
    CUresult (*park)(vmh_owner_t *o, CUdeviceptr p, bool at_once, size_t *req, vmh_paused_t **gone);
    /* Locked: the live buffer containing p, where p's bytes are in its backup, its export, and
     * whether it is still the buffer exported at base with serial. */
    bool (*find)(vmh_owner_t *o, CUdeviceptr p, vmh_buffer_info_t *info);
    const void *(*backup)(vmh_owner_t *o, CUdeviceptr p, size_t n);
    CUresult (*export)(vmh_owner_t *o, CUdeviceptr p, vmh_export_t *out, const vmh_range_t **range);
    bool (*export_alive)(vmh_owner_t *o, CUdeviceptr base, uint64_t serial);
    /* Resizing: by the layer alone (realloc: it locks, grows in place or by remapping, shrinks);
     * or, where realloc is NULL, by the heap: in place (resize, locked) when the layer can and
     * the buffer stays small, else by a copy into a new buffer; a paused one is refused. */
    CUresult (*realloc)(CUdeviceptr *p, size_t size, bool async, size_t *old_size,
                        bool *no_address);
    CUresult (*resize)(vmh_owner_t *o, CUdeviceptr p, size_t size, bool at_once, size_t *old_size);
    bool (*paused)(vmh_owner_t *o);
    /* Locked, unlocks: moves a spilled buffer back to the device. NULL: this kind never spills. */
    CUresult (*prefetch)(vmh_owner_t *o, CUdeviceptr p, CUstream stream, size_t *moved);
    /* fn on every run of adjacent records of this kind in the tag's part (heap.h's visit). */
    CUresult (*visit)(tagpart_t *part, vmh_visit_run_fn fn, void *arg);
    /* A free while the work runs in one queue makes the memory free space again at once
     * (carved.h), so the freeing thread is not throttled for the park budget (reclaim.h). */
    bool reuse_at_once;
} owner_ops_t;

/* Indexed by kind (device.h's vmh_owner_kind_t, VMH_OWN_DEAD its last); only the kinds that
 * serve buffers have operations. */
#define OWNER_KINDS (VMH_OWN_DEAD + 1)
extern const owner_ops_t vmh_heap_owner_ops[OWNER_KINDS];

/* The operations of a served buffer's owner (as vmh_owner_lock or the registry gave it). */
static inline const owner_ops_t *ops_of(const vmh_owner_t *o)
{
    assert((unsigned)o->kind < OWNER_KINDS && vmh_heap_owner_ops[o->kind].find);
    return &vmh_heap_owner_ops[o->kind];
}

/* The records (heap_devices.c), the one table by device ordinal. Settings are written by the
 * front's configure before any allocation and read without a lock after; a record is published
 * once, and its heap parts once, whole (ready). */
extern vmh_heap_settings_t vmh_heap_settings;
extern _Atomic(hdev_t *) vmh_heap_devs[VMH_MAX_DEVICES];

static inline hdev_t *hdev_of(vmh_dev_t *d)
{
    return (hdev_t *)((char *)d - offsetof(hdev_t, dev));
}

/* Device `i`'s record once its heap is set up, NULL before its first allocation. */
static inline hdev_t *hdev_at(int i)
{
    hdev_t *h = atomic_load_explicit(&vmh_heap_devs[i], memory_order_acquire);
    return h && atomic_load_explicit(&h->ready, memory_order_acquire) ? h : NULL;
}

/* Device `i`'s record (0 <= i < VMH_MAX_DEVICES), made at the first call: its heap may not be
 * set up. NULL when out of host memory. */
hdev_t *vmh_hdev_record(int i);

/* The front's mode is the process's phase (phase.h, lifetime.c's): it serves while RUNNING or
 * EXITING; after EXITED it forgets late frees without a driver call. */
static inline bool heap_running(void)
{
    return vmh_phase_serving();
}

/* In a pass-through forked child: the parent's locks may be held by threads that are gone, so
 * no entry point takes one. */
static inline bool heap_in_child(void)
{
    return vmh_phase_stage() == VMH_PHASE_CHILD;
}

/* Device `ordinal`'s heap, made at its first use with ctx as the context to wait on
 * (heap_devices.c). CUDA_ERROR_NOT_SUPPORTED, with *out set, for a device without VMM. */
CUresult vmh_hdev_get(int ordinal, CUcontext ctx, hdev_t **out);

/* The current context's device: no driver call in steady state (contexts.h keeps the calling
 * thread's current context as the interposer sees it change). */
CUresult vmh_hdev_current(hdev_t **out);

/* Tag `tag`'s part of the device, made at its first use (NULL when out of host memory). */
tagpart_t *vmh_hdev_part(hdev_t *h, unsigned tag);

/* The device's idle memory given back (heap_upkeep.c): after the driver ran out of memory (the
 * device's relieve, device.h), and by the reclaim thread (its tidy). */
bool vmh_hdev_relieve(vmh_dev_t *d);
void vmh_hdev_tidy(vmh_dev_t *d);

/* With overflow on (heap_devices.c): whether a request of `size` bytes is big and would leave
 * the device less free memory than its reserve (overflow.h), so that it spills first. */
bool vmh_hdev_spill_first(hdev_t *h, size_t size);

#endif
