/* Layer "arena, registry": address -> owner (see registry.h). A two-level radix table over 2 MiB
 * granules of the 48-bit user address space: 2^27 granules split 2^14 x 2^13. Leaves (64 KiB each)
 * are allocated on first use and kept for the life of the process, so readers never see one go. */
#include "registry.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#define ADDR_BITS 48
#define LEAF_BITS 13
#define TOP_BITS (ADDR_BITS - VMH_REGISTRY_SHIFT - LEAF_BITS)

typedef struct leaf {
    _Atomic(void *) slot[1u << LEAF_BITS];
} leaf_t;

static _Atomic(leaf_t *) top[1u << TOP_BITS];

static leaf_t *leaf_for(uint64_t g, bool create)
{
    _Atomic(leaf_t *) *t = &top[g >> LEAF_BITS];
    leaf_t *l = atomic_load_explicit(t, memory_order_acquire);
    if (l || !create)
        return l;
    leaf_t *fresh = calloc(1, sizeof *fresh);
    if (!fresh)
        return NULL;
    /* Writers of different devices may race for the same leaf. */
    if (!atomic_compare_exchange_strong_explicit(t, &l, fresh, memory_order_acq_rel,
                                                 memory_order_acquire)) {
        free(fresh);
        return l;
    }
    return fresh;
}

bool vmh_registry_set(CUdeviceptr base, size_t size, void *owner)
{
    uint64_t first = (uint64_t)base >> VMH_REGISTRY_SHIFT;
    uint64_t count = (uint64_t)size >> VMH_REGISTRY_SHIFT;
    if (size == 0 || (((uint64_t)base | size) & ((1u << VMH_REGISTRY_SHIFT) - 1)) ||
        first + count > (1ull << (ADDR_BITS - VMH_REGISTRY_SHIFT)) || first + count < first)
        return false;
    /* Make every leaf exist first, so a failure changes nothing. */
    for (uint64_t g = first; g < first + count; g = (g | ((1u << LEAF_BITS) - 1)) + 1)
        if (owner && !leaf_for(g, true))
            return false;
    for (uint64_t g = first; g < first + count; g++) {
        leaf_t *l = leaf_for(g, false);
        if (l)
            atomic_store_explicit(&l->slot[g & ((1u << LEAF_BITS) - 1)], owner,
                                  memory_order_release);
    }
    return true;
}

void *vmh_registry_get(CUdeviceptr p)
{
    uint64_t g = (uint64_t)p >> VMH_REGISTRY_SHIFT;
    if (g >= (1ull << (ADDR_BITS - VMH_REGISTRY_SHIFT)))
        return NULL;
    leaf_t *l = leaf_for(g, false);
    return l ? atomic_load_explicit(&l->slot[g & ((1u << LEAF_BITS) - 1)], memory_order_acquire)
             : NULL;
}
