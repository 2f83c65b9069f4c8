/* Layer "overflow": host memory at device addresses (see overflow.h). */
#include "overflow.h"

#include "driver.h"
#include "log.h"
#include "staging.h"
#include "testable.h"
#include "witness.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* The share of the host's memory overflow may pin, and the mark of available memory below
 * which nothing more is pinned (the pinned pool of backups, staging.c, keeps a quarter and
 * the same mark: both together stay within three quarters). */
#define HOST_SHARE_DIV 2
#define HOST_LOW_DIV 8

_Atomic bool vmh_overflow_on;
static size_t cap;

/* The reserve (VMMHOOK_OVERFLOW_RESERVE) is at most 1/RESERVE_SHARE_DIV of a device's memory,
 * and an allocation is big, spilled first, from 1/BIG_OF_RESERVE of the reserve on. */
#define RESERVE_SHARE_DIV 16
#define BIG_OF_RESERVE 4
static _Atomic size_t reserve_setting;

/* What was learnt about a device's host-located chunks, once (vmh_overflow_dev_t's host_state):
 * whether they can be made, and with which handle types (the device's, so that a spilled buffer
 * can be exported, or none when the driver refuses those for host memory). */
typedef enum host_state { HOST_UNKNOWN, HOST_OK, HOST_NO_HANDLES, HOST_UNSUPPORTED } host_state_t;

/* Spills are serialized: the budget is checked and taken in one step. */
static pthread_mutex_t spill_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_flag said_first_spill = ATOMIC_FLAG_INIT;
static atomic_flag said_budget = ATOMIC_FLAG_INIT;

void vmh_overflow_configure(bool on, size_t limit)
{
    cap = limit;
    atomic_store(&vmh_overflow_on, on);
}

void vmh_overflow_set_reserve(size_t bytes)
{
    atomic_store(&reserve_setting, bytes);
}

void vmh_overflow_init(vmh_overflow_dev_t *o, const vmh_dev_t *dev)
{
    o->dev = dev;
    atomic_init(&o->total, 0);
    atomic_init(&o->host_state, (int)HOST_UNKNOWN);
    atomic_init(&o->host_bytes, 0);
}

/* The device's memory, learnt once (0: unknown; asked again next time). */
static size_t total_of(vmh_overflow_dev_t *o)
{
    size_t total = atomic_load_explicit(&o->total, memory_order_relaxed);
    if (!total && vmh_drv.cuDeviceTotalMem(&total, o->dev->ordinal) == CUDA_SUCCESS)
        atomic_store_explicit(&o->total, total, memory_order_relaxed);
    return total;
}

size_t vmh_overflow_reserve(vmh_overflow_dev_t *o)
{
    size_t r = atomic_load_explicit(&reserve_setting, memory_order_relaxed);
    size_t most = total_of(o) / RESERVE_SHARE_DIV;
    return r < most ? r : most;
}

bool vmh_overflow_is_small(vmh_overflow_dev_t *o, size_t size)
{
    /* Without a reserve, small is what the largest reserve would keep on the device (so that
     * the statistics count the same requests either way). */
    size_t r = vmh_overflow_reserve(o);
    return size < (r ? r : total_of(o) / RESERVE_SHARE_DIV) / BIG_OF_RESERVE;
}

size_t vmh_overflow_bytes(const vmh_overflow_dev_t *o)
{
    int64_t n = atomic_load_explicit((_Atomic int64_t *)&o->host_bytes, memory_order_relaxed);
    return n > 0 ? (size_t)n : 0;
}

/* Whether `size` more bytes fit the budget; why not into `why` when they do not. */
static bool budget_allows(size_t size, char *why, size_t whylen)
{
    size_t used = vmh_alloc_host_bytes(), limit = cap;
    vmh_host_mem_t m;
    bool known = vmh_staging_host_mem(&m) && m.total > 0;
    if (known && m.total / HOST_SHARE_DIV < limit)
        limit = m.total / HOST_SHARE_DIV;
    if (used > limit || size > limit - used) {
        snprintf(why, whylen,
                 "%zu bytes spilled already, the limit is %zu (VMMHOOK_OVERFLOW_LIMIT, "
                 "at most half of the host's memory)",
                 used, limit);
        return false;
    }
    if (known &&
        (m.available < m.total / HOST_LOW_DIV || size > m.available - m.total / HOST_LOW_DIV)) {
        snprintf(why, whylen,
                 "the host has %zu bytes available, and an eighth of its memory "
                 "stays free",
                 m.available);
        return false;
    }
    return true;
}

static CUmemAllocationProp host_prop(const vmh_dev_t *d, bool handles)
{
    CUmemAllocationProp p = d->prop;
    p.location.type = CU_MEM_LOCATION_TYPE_HOST;
    p.location.id = 0;
    if (!handles)
        p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    return p;
}

/* Learns, once per device, whether host-located chunks can serve it at its granularity. */
static host_state_t learn(vmh_overflow_dev_t *o)
{
    const vmh_dev_t *d = o->dev;
    host_state_t s = (host_state_t)atomic_load(&o->host_state);
    if (s != HOST_UNKNOWN)
        return s;
    CUmemAllocationProp p = host_prop(d, true);
    size_t g = 0;
    CUresult rc = vmh_drv.cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (rc != CUDA_SUCCESS || g == 0 || d->gran % g != 0) {
        vmh_log("VMMHOOK_OVERFLOW=host: device %d cannot map host memory at its chunk size (%s); "
                "its allocations do not spill",
                d->ordinal,
                rc != CUDA_SUCCESS ? "the driver refuses host-located memory"
                                   : "the host granularity does not divide it");
        s = HOST_UNSUPPORTED;
    } else {
        s = HOST_OK;
    }
    atomic_store(&o->host_state, (int)s);
    return s;
}

static CUresult create(vmh_overflow_dev_t *o, size_t size, host_state_t s, vmh_alloc_t **out)
{
    const vmh_dev_t *d = o->dev;
    CUmemAllocationProp p = host_prop(d, s == HOST_OK);
    CUresult rc = vmh_alloc_create(d->grants, size, &p, &d->access, 1, out);
    if (s == HOST_OK && (rc == CUDA_ERROR_INVALID_VALUE || rc == CUDA_ERROR_NOT_SUPPORTED ||
                         rc == CUDA_ERROR_NOT_PERMITTED)) {
        /* The driver may refuse shareable handles on host memory: spill without them (such a
         * buffer cannot be shared by CUDA IPC, docs/OVERFLOW.md). */
        p = host_prop(d, false);
        rc = vmh_alloc_create(d->grants, size, &p, &d->access, 1, out);
        if (rc == CUDA_SUCCESS) {
            atomic_store(&o->host_state, (int)HOST_NO_HANDLES);
            vmh_debug("VMMHOOK_OVERFLOW=host: device %d's spilled memory has no shareable "
                      "handle (the driver refused one): CUDA IPC cannot share it",
                      d->ordinal);
        }
    }
    if (rc == CUDA_SUCCESS)
        vmh_alloc_count_in(*out, &o->host_bytes);
    return rc;
}

CUresult vmh_overflow_chunk(vmh_overflow_dev_t *o, size_t size, vmh_alloc_t **out)
{
    const vmh_dev_t *d = o->dev;
    if (!vmh_overflow_enabled())
        return CUDA_ERROR_OUT_OF_MEMORY;
    host_state_t s = learn(o);
    if (s == HOST_UNSUPPORTED)
        return CUDA_ERROR_NOT_SUPPORTED;
    char why[200];
    vmh_lock(&spill_lock, VMH_RANK_SPILL);
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (budget_allows(size, why, sizeof why))
        rc = create(o, size, s, out);
    else if (!atomic_flag_test_and_set(&said_budget))
        vmh_log("VMMHOOK_OVERFLOW=host: an allocation of %zu bytes on device %d does not spill: "
                "%s; it fails with out of memory (said once)",
                size, d->ordinal, why);
    vmh_unlock(&spill_lock);
    if (rc == CUDA_SUCCESS && !atomic_flag_test_and_set(&said_first_spill))
        vmh_log("device %d is full: an allocation of %zu bytes is served from host memory "
                "(VMMHOOK_OVERFLOW=host; slower to reach from kernels, moved back by "
                "vmm_prefetch or a resume; said once, the statistics count spilled bytes)",
                d->ordinal, size);
    return rc;
}

CUresult vmh_overflow_range_new(vmh_overflow_dev_t *o, size_t size, size_t reserve,
                                vmh_range_t **out)
{
    vmh_alloc_t *a;
    CUresult rc = vmh_overflow_chunk(o, size, &a);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = vmh_range_create(&a, 1, reserve, 0, 0, out, NULL);
    vmh_alloc_unref(a); /* the mapping holds it now, or nothing does */
    return rc;
}

#ifdef VMH_TESTING
void vmh_overflow_reset(void)
{
    atomic_flag_clear(&said_first_spill);
    atomic_flag_clear(&said_budget);
}
#endif
