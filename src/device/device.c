/* Layer "device": a device's shape and the owner records (see device.h). */
#include "device.h"

#include "contexts.h"

#include "driver.h"
#include "log.h"
#include "registry.h"
#include "stats.h"
#include "tags.h"
#include "testable.h"
#include "witness.h"

#include <assert.h>
#include <stdio.h>
#include <string.h>

/* Written by the front's configure before any device is set up; read without a lock after. */
static vmh_device_settings_t settings;
static bool configured;

void vmh_device_configure(const vmh_device_settings_t *s)
{
    assert(s->refuse != NULL);
    settings = *s;
    configured = true;
}

vmh_owner_t vmh_owner_idle = {VMH_OWN_IDLE, NULL, NULL};
vmh_owner_t vmh_owner_dead = {VMH_OWN_DEAD, NULL, NULL};

/* The chunk granularity: the driver's recommended or minimum one, or VMMHOOK_GRANULARITY's
 * size when it is a multiple of the driver's minimum (cuMemMap needs the multiple); else the
 * value is refused (s->refuse: one warning, or VMMHOOK_STRICT's stop) and the recommended one
 * used. A size the driver cannot make at all is found later, with a chunk (probe_granularity). */
VMH_TESTABLE size_t vmh_dev_pick_granularity(const vmh_device_settings_t *s, size_t min_gran,
                                             size_t rec_gran)
{
    if (min_gran == 0)
        min_gran = 1; /* the driver never answers 0; do not divide by it if it does */
    /* The recommended granularity is a multiple of the minimum on every driver seen; fall back
     * to the minimum if one ever answers otherwise. */
    size_t rec = (rec_gran != 0 && rec_gran % min_gran == 0) ? rec_gran : min_gran;
    switch (s->gran_mode) {
    case VMH_GRAN_MIN:
        return min_gran;
    case VMH_GRAN_BYTES: {
        if (s->gran_bytes != 0 && s->gran_bytes % min_gran == 0)
            return s->gran_bytes;
        char why[160], instead[80], m[32], r[32];
        snprintf(why, sizeof why,
                 "not a multiple of the driver's minimum granularity %zu (%s) for these "
                 "allocation properties",
                 min_gran, vmh_fmt_bytes(m, sizeof m, min_gran));
        snprintf(instead, sizeof instead, "the recommended granularity %s",
                 vmh_fmt_bytes(r, sizeof r, rec));
        s->refuse("VMMHOOK_GRANULARITY", why, instead);
        return rec;
    }
    case VMH_GRAN_RECOMMENDED:
    default:
        return rec;
    }
}

/* The name of the driver's answers this file reports (the table has no cuGetErrorName). */
static const char *cu_name(CUresult rc)
{
    switch (rc) {
    case CUDA_ERROR_OUT_OF_MEMORY:
        return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_INVALID_VALUE:
        return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_NOT_PERMITTED:
        return "CUDA_ERROR_NOT_PERMITTED";
    case CUDA_ERROR_NOT_SUPPORTED:
        return "CUDA_ERROR_NOT_SUPPORTED";
    default:
        return "CUDA error";
    }
}

/* A granularity above the recommended one may be more than the device can ever make
 * (VMMHOOK_GRANULARITY=1T, or 64G on a GPU of 80 GiB: every chunk would then fail with out of
 * memory, and every served allocation with it). One chunk of it is made and released now, as
 * the handle type's is. When the driver refuses it but makes one of the recommended size, the
 * value is refused (one warning naming the variable, the value and the driver's answer, or the
 * strict stop) and the recommended granularity is used. When neither can be made the device
 * is full right now, which says nothing about the value: it is kept. */
static size_t probe_granularity(vmh_dev_t *d, size_t rec_gran)
{
    vmh_alloc_t *probe;
    CUresult rc = vmh_alloc_create(d->grants, d->gran, &d->prop, NULL, 0, &probe);
    if (rc == CUDA_SUCCESS) {
        vmh_alloc_unref(probe);
        return d->gran;
    }
    CUresult rec_rc = vmh_alloc_create(d->grants, rec_gran, &d->prop, NULL, 0, &probe);
    if (rec_rc != CUDA_SUCCESS) {
        vmh_debug("device %d: no chunk of %zu bytes, nor of the recommended %zu, can be made "
                  "now (CUDA errors %d, %d); VMMHOOK_GRANULARITY kept",
                  d->ordinal, d->gran, rec_gran, (int)rc, (int)rec_rc);
        return d->gran;
    }
    vmh_alloc_unref(probe);
    char why[200], instead[80], b[32], r[32];
    snprintf(why, sizeof why,
             "the driver cannot make a chunk of that size on device %d (cuMemCreate of %s "
             "answers %s %d; one of the recommended %s is made)",
             d->ordinal, vmh_fmt_bytes(b, sizeof b, d->gran), cu_name(rc), (int)rc,
             vmh_fmt_bytes(r, sizeof r, rec_gran));
    snprintf(instead, sizeof instead, "the recommended granularity %s", r);
    settings.refuse("VMMHOOK_GRANULARITY", why, instead);
    return rec_gran;
}

/* Makes the device's allocation properties; checks the handle type once with a real chunk, so
 * that a type the driver refuses is reported clearly at the start, not at some later grow. */
CUresult vmh_dev_setup(vmh_dev_t *d, int ordinal, CUcontext ctx)
{
    assert(configured && "vmh_device_configure first");
    d->ordinal = ordinal;
    d->ctx = ctx;
    int vmm = 0;
    vmh_drv.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                 ordinal);
    if (!vmm) {
        vmh_debug("device %d has no virtual memory management: passing it through", ordinal);
        d->unsupported = true;
        return CUDA_SUCCESS;
    }
    memset(&d->prop, 0, sizeof d->prop);
    d->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    d->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d->prop.location.id = ordinal;
    static const CUmemAllocationHandleType types[VMH_HANDLE_KIND_COUNT] = {
        [VMH_HANDLE_NONE] = CU_MEM_HANDLE_TYPE_NONE,
        [VMH_HANDLE_POSIX_FD] = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        [VMH_HANDLE_FABRIC] = CU_MEM_HANDLE_TYPE_FABRIC,
    };
    d->prop.requestedHandleTypes = types[settings.handle];
    if (settings.rdma) {
        int rdma = 0;
        vmh_drv.cuDeviceGetAttribute(
            &rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, ordinal);
        if (rdma)
            d->prop.allocFlags.gpuDirectRDMACapable = 1;
        else
            vmh_log("VMMHOOK_RDMA: device %d does not support GPUDirect RDMA with VMM memory; "
                    "allocating without it",
                    ordinal);
    }

    size_t min_gran = 0, rec_gran = 0;
    CUresult rc = vmh_drv.cuMemGetAllocationGranularity(&min_gran, &d->prop,
                                                        CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (rc == CUDA_SUCCESS)
        rc = vmh_drv.cuMemGetAllocationGranularity(&rec_gran, &d->prop,
                                                   CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (rc != CUDA_SUCCESS || min_gran == 0)
        return rc != CUDA_SUCCESS ? rc : CUDA_ERROR_NOT_SUPPORTED;
    /* The registry works in 2 MiB granules: never use a smaller chunk. */
    size_t floor = (size_t)1 << VMH_REGISTRY_SHIFT;
    if (min_gran < floor && floor % min_gran == 0)
        min_gran = floor;
    if (rec_gran < min_gran || rec_gran % min_gran)
        rec_gran = min_gran;
    d->gran = vmh_dev_pick_granularity(&settings, min_gran, rec_gran);
    d->rec_gran = rec_gran;

    d->access.location = d->prop.location;
    d->access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (int peer = 0; peer < VMH_MAX_DEVICES; peer++) {
        int can = 0;
        if (peer == ordinal || !(settings.peers & (1ull << peer)))
            continue;
        if (vmh_drv.cuDeviceCanAccessPeer(&can, ordinal, peer) != CUDA_SUCCESS || !can) {
            vmh_debug("VMMHOOK_PEERS: device %d cannot reach device %d; not granted", peer,
                      ordinal);
            continue;
        }
        vmh_access_set_peer(d->grants, ordinal, peer, true); /* no mapping yet: no driver call */
        vmh_work_queue_split("VMMHOOK_PEERS"); /* a peer's kernels run in its own queue */
    }

    /* The handle type first, with a chunk of the minimum size (the one most surely made), so
     * that a refusal of the type is never taken for one of the size. */
    if (d->prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) {
        vmh_alloc_t *probe;
        rc = vmh_alloc_create(d->grants, min_gran, &d->prop, NULL, 0, &probe);
        if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_OUT_OF_MEMORY) {
            char why[96];
            snprintf(why, sizeof why, "cuMemCreate on device %d answers CUDA error %d", ordinal,
                     (int)rc);
            settings.refuse("VMMHOOK_HANDLE_TYPE", why, "none");
            d->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
        } else if (rc == CUDA_SUCCESS) {
            vmh_alloc_unref(probe);
        }
    }
    if (d->gran > rec_gran)
        d->gran = probe_granularity(d, rec_gran);

    d->chunk_max = settings.chunk_max - settings.chunk_max % d->gran;
    if (settings.chunk_max && !d->chunk_max)
        d->chunk_max = d->gran;
    vmh_debug("device %d: chunk granularity %zu (minimum %zu), handle type %d", ordinal, d->gran,
              min_gran, (int)d->prop.requestedHandleTypes);
    return CUDA_SUCCESS;
}

/* ---- usable bytes (VMMHOOK_MEM_LIMIT) ---------------------------------------------------- */

/* Raises the recent peak to `now` (usually one relaxed load: the peak is rarely passed). */
static void peak_note(vmh_dev_t *d, size_t now)
{
    size_t peak = atomic_load_explicit(&d->peak_usable, memory_order_relaxed);
    while (now > peak &&
           !atomic_compare_exchange_weak_explicit(&d->peak_usable, &peak, now, memory_order_relaxed,
                                                  memory_order_relaxed))
        ;
}

bool vmh_dev_usable_take(vmh_dev_t *d, size_t n)
{
    size_t limit = settings.mem_limit;
    if (!limit) {
        peak_note(d, atomic_fetch_add_explicit(&d->live_usable, n, memory_order_relaxed) + n);
        return true;
    }
    size_t cur = atomic_load_explicit(&d->live_usable, memory_order_relaxed);
    do {
        if (cur > limit || n > limit - cur)
            return false;
    } while (!atomic_compare_exchange_weak_explicit(&d->live_usable, &cur, cur + n,
                                                    memory_order_relaxed, memory_order_relaxed));
    peak_note(d, cur + n);
    return true;
}

size_t vmh_dev_usable_peak(const vmh_dev_t *d)
{
    return atomic_load_explicit((_Atomic size_t *)&d->peak_usable, memory_order_relaxed);
}

void vmh_dev_usable_peak_reset(vmh_dev_t *d)
{
    atomic_store_explicit(&d->peak_usable,
                          atomic_load_explicit(&d->live_usable, memory_order_relaxed),
                          memory_order_relaxed);
}

void vmh_dev_usable_give(vmh_dev_t *d, size_t n)
{
    size_t before = atomic_fetch_sub_explicit(&d->live_usable, n, memory_order_relaxed);
    assert(before >= n && "more usable bytes given back than taken");
    (void)before;
}

void vmh_dev_usable_adjust(vmh_dev_t *d, int64_t delta)
{
    size_t now = atomic_fetch_add_explicit(&d->live_usable, (size_t)delta, memory_order_relaxed) +
                 (size_t)delta;
    if (delta > 0)
        peak_note(d, now);
}

/* ---- address space (VMMHOOK_VA_LIMIT, VMMHOOK_HEADROOM) ---------------------------------- */

size_t vmh_dev_reserve_for(size_t size, bool growable)
{
    size_t reserve = size;
    if (growable && settings.headroom) {
        size_t extra = size < settings.headroom ? size : settings.headroom;
        if (extra <= SIZE_MAX - size)
            reserve = size + extra;
    }
    if (vmh_dev_va_exhausted(reserve))
        reserve = size;
    return reserve;
}

bool vmh_dev_va_exhausted(size_t reserve)
{
    int64_t used = vmh_gauge_get(VMH_STAT_bytes_reserved);
    return settings.va_limit && (size_t)used + reserve > settings.va_limit;
}

/* ---- memory ----------------------------------------------------------------------------- */

CUresult vmh_dev_chunk(vmh_dev_t *d, size_t size, vmh_alloc_t **out)
{
    return vmh_alloc_create(d->grants, size, &d->prop, &d->access, 1, out);
}

/* Chunks of `chunk` bytes (the last one shorter; chunk 0 or >= size: one chunk) for `size`
 * bytes, made into allocs[0..*n): all or nothing. */
static CUresult chunks_make(vmh_dev_t *d, size_t size, size_t chunk, vmh_alloc_t **allocs,
                            size_t *n)
{
    if (!chunk || chunk > size)
        chunk = size;
    CUresult rc = CUDA_SUCCESS;
    *n = 0;
    for (size_t done = 0; done < size && rc == CUDA_SUCCESS; done += chunk) {
        size_t len = size - done < chunk ? size - done : chunk;
        if ((rc = vmh_dev_chunk(d, len, &allocs[*n])) == CUDA_SUCCESS)
            ++*n;
    }
    if (rc != CUDA_SUCCESS)
        while (*n)
            vmh_alloc_unref(allocs[--*n]);
    return rc;
}

/* `size` bytes in chunks of `chunk` (0: one chunk) mapped at `at` inside resv when resv is
 * given, else in a new reservation of `reserve` bytes; the relieve-and-retry of
 * vmh_dev_range_new. */
static CUresult range_new(vmh_dev_t *d, size_t size, size_t chunk, size_t reserve, vmh_resv_t *resv,
                          CUdeviceptr at, bool relieve, vmh_range_t **out, bool *no_address)
{
    *no_address = false;
    size_t most = chunk && chunk < size ? (size + chunk - 1) / chunk : 1;
    vmh_alloc_t *one, **allocs = most == 1 ? &one : calloc(most, sizeof *allocs);
    if (!allocs)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc;
    for (int attempt = 0;; attempt++) {
        if (!resv && vmh_dev_va_exhausted(reserve)) {
            *no_address = true;
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        size_t n;
        bool resv_failed = false;
        rc = chunks_make(d, size, chunk, allocs, &n);
        if (rc == CUDA_SUCCESS) {
            rc = resv ? vmh_range_create_in(allocs, n, resv, at, out)
                      : vmh_range_create(allocs, n, reserve, 0, 0, out, &resv_failed);
            while (n)
                vmh_alloc_unref(allocs[--n]); /* the mappings hold them now (or nothing does) */
        }
        if (rc != CUDA_ERROR_OUT_OF_MEMORY || attempt > 0 || !relieve) {
            *no_address = rc == CUDA_ERROR_OUT_OF_MEMORY && resv_failed;
            break;
        }
        vmh_count(VMH_STAT_oom_retries, 1);
        assert(d->relieve && "the front sets relieve before publishing the device");
        if (!d->relieve(d))
            break; /* nothing was idle: the device really is full */
    }
    if (allocs != &one)
        free(allocs);
    return rc;
}

CUresult vmh_dev_range_new(vmh_dev_t *d, size_t size, size_t reserve, vmh_range_t **out,
                           bool *no_address)
{
    return range_new(d, size, 0, reserve, NULL, 0, true, out, no_address);
}

CUresult vmh_dev_range_in(vmh_dev_t *d, size_t size, size_t chunk, vmh_resv_t *resv, CUdeviceptr at,
                          vmh_range_t **out)
{
    bool no_address;
    return range_new(d, size, chunk, 0, resv, at, true, out, &no_address);
}

CUresult vmh_dev_range_at(vmh_dev_t *d, size_t size, size_t chunk, vmh_resv_t *resv, CUdeviceptr at,
                          vmh_range_t **out)
{
    bool no_address;
    return range_new(d, size, chunk, 0, resv, at, false, out, &no_address);
}

void vmh_dev_alloc_failed(const vmh_dev_t *d, size_t size, CUresult rc, bool no_address)
{
    if (!vmh_log_verbose())
        return;
    char why[300], a[32], b[32], c[32], e[32];
    size_t rounded = size;
    (void)vmh_round_up(size, d->gran, &rounded);
    size_t live = atomic_load_explicit((_Atomic size_t *)&d->live_usable, memory_order_relaxed);
    unsigned tag = vmh_tag_current();
    /* The reasons of the library's own first, most certain first; the driver's last. */
    if (no_address) {
        snprintf(why, sizeof why,
                 "the address space budget VMMHOOK_VA_LIMIT=%s is used up (%s reserved)",
                 vmh_fmt_bytes(a, sizeof a, settings.va_limit),
                 vmh_fmt_bytes(b, sizeof b, (size_t)vmh_gauge_get(VMH_STAT_bytes_reserved)));
    } else if (settings.mem_limit &&
               (live > settings.mem_limit || size > settings.mem_limit - live)) {
        snprintf(why, sizeof why, "over VMMHOOK_MEM_LIMIT=%s (%s already served on the device)",
                 vmh_fmt_bytes(a, sizeof a, settings.mem_limit), vmh_fmt_bytes(b, sizeof b, live));
    } else if (!vmh_tag_running(tag)) {
        snprintf(why, sizeof why,
                 "its tag \"%s\" is paused (vmm_pause): it takes no memory "
                 "until vmm_resume",
                 vmh_tag_name(tag));
    } else if (d->gran > d->rec_gran && rc == CUDA_ERROR_OUT_OF_MEMORY) {
        size_t at_rec = size;
        (void)vmh_round_up(size, d->rec_gran, &at_rec);
        snprintf(why, sizeof why,
                 "the driver has no memory for it in chunks of VMMHOOK_GRANULARITY=%s (%s for "
                 "this request; %s at the recommended granularity %s)",
                 vmh_fmt_bytes(a, sizeof a, d->gran), vmh_fmt_bytes(b, sizeof b, rounded),
                 vmh_fmt_bytes(c, sizeof c, at_rec), vmh_fmt_bytes(e, sizeof e, d->rec_gran));
    } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
        snprintf(why, sizeof why,
                 "the device is out of memory (the driver refused new memory "
                 "after the library gave back what it held idle)");
    } else {
        snprintf(why, sizeof why, "the driver answered %s %d", cu_name(rc), (int)rc);
    }
    vmh_debug("an allocation of %zu bytes on device %d failed (%s %d): %s", size, d->ordinal,
              cu_name(rc), (int)rc, why);
}

uint64_t vmh_export_serial_new(void)
{
    static _Atomic uint64_t next = 1;
    return atomic_fetch_add_explicit(&next, 1, memory_order_relaxed);
}

/* ---- owners ----------------------------------------------------------------------------- */

vmh_owner_t *vmh_owner_lock(CUdeviceptr p)
{
    for (vmh_owner_t *o = vmh_registry_get(p);;) {
        if (!o || !o->lock)
            return NULL;
        vmh_lock(o->lock, VMH_RANK_OWNER);
        vmh_owner_t *now = vmh_registry_get(p);
        if (now == o)
            return o;
        /* Released meanwhile (now NULL), or its addresses passed to another owner: carved_place.c
         * joins neighbouring extents (the lower one takes the higher one's addresses). */
        vmh_unlock(o->lock);
        o = now;
    }
}

void vmh_owner_unlock(vmh_owner_t *o)
{
    vmh_unlock(o->lock);
}
