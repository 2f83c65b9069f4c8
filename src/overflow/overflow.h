/* Layer "overflow": host memory at device addresses, for what the device cannot serve
 * (VMMHOOK_OVERFLOW=host; docs/OVERFLOW.md).
 *
 * A chunk made here is a VMM allocation located in host memory (the driver pins it at
 * creation) and mapped into the library's device address space with the device's own access,
 * so the program holds an ordinary device pointer: kernels read and write it over the bus,
 * copies and range queries accept it. The heap asks for one after the device refused (after
 * its wait, release and trim), or at once for a big request that would eat into the reserve
 * kept for small ones. Chunks come back to the device through the range layer
 * (vmh_range_rehome_begin / _finish: a prefetch; vmh_range_resume_run: a resume), at the same
 * addresses.
 *
 * The budget: VMMHOOK_OVERFLOW_LIMIT, at most half of the host's memory (or of its memory
 * cgroup's limit), and no spill that would leave less than an eighth of it available: pinned
 * memory cannot be swapped, and a host that runs out of it kills processes, not allocations.
 * Spills are serialized (a creation of pinned host memory takes milliseconds anyway), so the
 * budget is never passed.
 */
#ifndef VMH_OVERFLOW_H
#define VMH_OVERFLOW_H

#include "device.h"
#include "handle.h"
#include "range.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

/* On or off, and the cap in bytes (VMMHOOK_OVERFLOW, VMMHOOK_OVERFLOW_LIMIT). Off: nothing in
 * this file is reached and no driver call is made. */
void vmh_overflow_configure(bool on, size_t cap);
/* Inline: every allocation reads it (the reserve is decided before the device is asked), so
 * with overflow off that is one load of a flag, no call. */
extern _Atomic bool vmh_overflow_on;
static inline bool vmh_overflow_enabled(void)
{
    return atomic_load_explicit(&vmh_overflow_on, memory_order_relaxed);
}

/* The placement policy of a full device (docs/OVERFLOW.md, "Which allocations spill"): the
 * last `reserve` bytes of device memory are kept for small allocations, the program's
 * temporaries, which a program touches most often; a big allocation that would leave less free
 * spills first. The setting is VMMHOOK_OVERFLOW_RESERVE (0: no reserve); the reserve of a device
 * is at most a sixteenth of its memory, and big means at least a quarter of the reserve. */
void vmh_overflow_set_reserve(size_t bytes);

/* One GPU's part of this layer, kept in the per-GPU record (heap_internal.h) and handed to every
 * call below: what was learnt about the device, each once (asked of the driver only when
 * overflow needs it, so that with overflow off no call is made). */
typedef struct vmh_overflow_dev {
    const vmh_dev_t *dev;
    _Atomic size_t total;       /* the device's memory (0: not learnt yet, asked again) */
    _Atomic int host_state;     /* whether host-located chunks can serve it, and how (overflow.c) */
    _Atomic int64_t host_bytes; /* of its host-located chunks alive (handle.c counts them) */
} vmh_overflow_dev_t;

/* Before any other call with o; learns nothing yet. */
void vmh_overflow_init(vmh_overflow_dev_t *o, const vmh_dev_t *dev);

size_t vmh_overflow_reserve(vmh_overflow_dev_t *o);
bool vmh_overflow_is_small(vmh_overflow_dev_t *o, size_t size);

/* One host-located chunk of `size` bytes (a multiple of the device's gran) that o's device
 * accesses as its own memory. CUDA_ERROR_OUT_OF_MEMORY when the budget or the driver refuses;
 * NOT_SUPPORTED when the device cannot map host memory this way (said once). The first success in
 * the process says, once, on stderr, that allocations spill and where to turn it off. */
CUresult vmh_overflow_chunk(vmh_overflow_dev_t *o, size_t size, vmh_alloc_t **out);

/* A range of its own of one such chunk, with `reserve` bytes of address space. */
CUresult vmh_overflow_range_new(vmh_overflow_dev_t *o, size_t size, size_t reserve,
                                vmh_range_t **out);

/* Host bytes serving o's device now (every chunk made here and not yet released). */
size_t vmh_overflow_bytes(const vmh_overflow_dev_t *o);

#ifdef VMH_TESTING
/* Tests: forget the once-only warnings (what was learnt about each device goes with its record,
 * made anew after the heap's reset). */
void vmh_overflow_reset(void);
#endif

#endif
