/* Internal to the heap front (heap.c, heap_devices.c, heap_upkeep.c): one device's heap and its
 * tag parts, the devices table and the front's mode, shared by the three files of the layer.
 * Nothing else includes this but tools/probe/churn_sim.c and tests/unit/test_holes.c (test
 * builds: they read the shards). */
#ifndef VMH_HEAP_INTERNAL_H
#define VMH_HEAP_INTERNAL_H

#include "heap.h"

#include "bigbuf.h"
#include "cache.h"
#include "device.h"
#include "packing.h"
#include "reclaim.h"
#include "vmmhook.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* One tag's memory on a device: a big-buffer set and packing shards of its own, so that memory
 * of one tag never shares a chunk with another tag's (pause.c gives a tag's memory back
 * alone). Made at the tag's first allocation on the device; freed only by the tests' reset. */
typedef struct tagpart {
    unsigned tag;
    vmh_packing_t pack;
    vmh_bigbufs_t big;
} tagpart_t;

/* One device's heap: its shape at the bottom, then each layer's state. */
typedef struct hdev {
    vmh_dev_t dev;
    vmh_reclaim_t reclaim;
    vmh_cache_t cache; /* idle ranges are nobody's: any tag may reuse them */
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

enum { HEAP_RUNNING, HEAP_EXITED, HEAP_CHILD };

/* The devices table (heap_devices.c). Settings are written by the front's configure before any
 * allocation and read without a lock after; a device's entry is published once, whole. */
extern vmh_heap_settings_t vmh_heap_settings;
extern _Atomic(hdev_t *) vmh_heap_devs[VMH_MAX_DEVICES];
extern atomic_int vmh_heap_mode; /* HEAP_RUNNING, then HEAP_EXITED or HEAP_CHILD */

static inline hdev_t *hdev_of(vmh_dev_t *d)
{
    return (hdev_t *)((char *)d - offsetof(hdev_t, dev));
}

/* Device `i`'s heap, NULL before its first use. */
static inline hdev_t *hdev_at(int i)
{
    return atomic_load_explicit(&vmh_heap_devs[i], memory_order_acquire);
}

static inline bool heap_running(void)
{
    return atomic_load_explicit(&vmh_heap_mode, memory_order_relaxed) == HEAP_RUNNING;
}

/* In a forked child: the parent's locks may be held by threads that are gone, so no entry point
 * takes one. */
static inline bool heap_in_child(void)
{
    return atomic_load_explicit(&vmh_heap_mode, memory_order_relaxed) == HEAP_CHILD;
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
