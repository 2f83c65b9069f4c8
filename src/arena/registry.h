/* Layer "arena, registry": the address registry. Maps every 2 MiB granule of address space the
 * library serves from to its owner (a buffer with its own range, or a shared extent), for exact
 * pointers (free, realloc) and interior pointers (address-range queries).
 *
 * Reads are lock-free (two atomic loads), so a pointer the library does not own costs next
 * to nothing on the pass-through path. Writers of a range of addresses are serialized by the
 * lock of whoever holds that range (an owner's lock, the cache's lock, or the reclaim item that
 * alone holds an old range). Owners are type-stable (device.h: their layers recycle them and
 * never free them while the process runs), so a reader may look at an owner it found even if it
 * was released meanwhile, take the owner's lock, and check again (vmh_owner_lock). */
#ifndef VMH_REGISTRY_H
#define VMH_REGISTRY_H

#include <cuda.h>
#include <stdbool.h>
#include <stddef.h>

#define VMH_REGISTRY_SHIFT 21 /* 2 MiB: the minimum granularity of current NVIDIA GPUs */

/* Sets [base, base + size) (granule-aligned) to owner (NULL clears). false when the range
 * lies outside the 48-bit address space the registry covers or host memory ran out; then
 * nothing was changed. */
bool vmh_registry_set(CUdeviceptr base, size_t size, void *owner);

/* The owner of the granule holding p, or NULL. */
void *vmh_registry_get(CUdeviceptr p);

#endif
