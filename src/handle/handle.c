/* Layer "handles": allocation, reservation and mapping handles (see handle.h). The only code that
 * creates or destroys VMM driver objects. */
#include "handle.h"

#include "driver.h"
#include "list.h"
#include "log.h"
#include "stats.h"
#include "witness.h"

#include <assert.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* An undo call that fails leaves the driver object alive: there is nothing better to do than
 * say so once per failure (the program goes on; the leak is visible). */
void vmh_handle_report_failure(const char *call, CUresult rc)
{
    vmh_log("%s failed with CUDA error %d during release", call, (int)rc);
}

/* The reference protocol of the three handles. A new reference is taken by a holder of one,
 * so the object cannot go meanwhile: relaxed is enough. The last drop is acq_rel: every
 * holder's use happens before the undo call that follows it. */
static void ref_take(atomic_int *refs)
{
    atomic_fetch_add_explicit(refs, 1, memory_order_relaxed);
}

static bool ref_drop_last(atomic_int *refs)
{
    return atomic_fetch_sub_explicit(refs, 1, memory_order_acq_rel) == 1;
}

/* An undo call's answer: a refusal is reported, and the object stays alive (above). */
static void undo_checked(const char *call, CUresult rc)
{
    if (rc != CUDA_SUCCESS)
        vmh_handle_report_failure(call, rc);
}

static _Atomic int64_t host_bytes; /* of the process; each device's: a->host_count */

static void host_bytes_add(const vmh_alloc_t *a, int64_t delta)
{
    if (!a->host)
        return;
    atomic_fetch_add_explicit(&host_bytes, delta, memory_order_relaxed);
    if (a->host_count)
        atomic_fetch_add_explicit(a->host_count, delta, memory_order_relaxed);
}

size_t vmh_alloc_host_bytes(void)
{
    int64_t n = atomic_load_explicit(&host_bytes, memory_order_relaxed);
    return n > 0 ? (size_t)n : 0;
}

void vmh_alloc_count_in(vmh_alloc_t *a, _Atomic int64_t *count)
{
    assert(!a->host_count && "counted in one device's count");
    a->host_count = count;
    if (a->host)
        atomic_fetch_add_explicit(count, (int64_t)a->size, memory_order_relaxed);
}

CUresult vmh_alloc_create(const vmh_grants_t *grants, size_t size, const CUmemAllocationProp *prop,
                          const CUmemAccessDesc *access, int naccess, vmh_alloc_t **out)
{
    if (!out || !prop || naccess < 0 || naccess > VMH_MAX_ACCESS || (naccess && !access))
        return CUDA_ERROR_INVALID_VALUE;
    vmh_alloc_t *a = calloc(1, sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = vmh_drv.cuMemCreate(&a->handle, size, prop, 0);
    if (rc != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    atomic_init(&a->refs, 1);
    a->size = size;
    /* A host-located chunk serves the device its access names (overflow.h): a resume of it
     * makes device memory there. */
    a->host = prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE;
    a->device = !a->host ? prop->location.id : naccess ? access[0].location.id : -1;
    a->grants = grants;
    host_bytes_add(a, (int64_t)size);
    a->handle_type = (int)prop->requestedHandleTypes;
    a->naccess = naccess;
    if (naccess)
        memcpy(a->access, access, (size_t)naccess * sizeof *access);
    *out = a;
    return CUDA_SUCCESS;
}

vmh_alloc_t *vmh_alloc_ref(vmh_alloc_t *a)
{
    ref_take(&a->refs);
    return a;
}

void vmh_alloc_unref(vmh_alloc_t *a)
{
    if (!a || !ref_drop_last(&a->refs))
        return;
    undo_checked("cuMemRelease", vmh_drv.cuMemRelease(a->handle));
    host_bytes_add(a, -(int64_t)a->size);
    free(a);
}

CUresult vmh_resv_create(size_t size, size_t align, CUdeviceptr hint, vmh_resv_t **out)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    vmh_resv_t *r = calloc(1, sizeof *r);
    if (!r)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = vmh_drv.cuMemAddressReserve(&r->ptr, size, align, hint, 0);
    if (rc != CUDA_SUCCESS) {
        free(r);
        return rc;
    }
    atomic_init(&r->refs, 1);
    r->size = size;
    vmh_gauge_add(VMH_STAT_bytes_reserved, (int64_t)size);
    *out = r;
    return CUDA_SUCCESS;
}

vmh_resv_t *vmh_resv_ref(vmh_resv_t *r)
{
    ref_take(&r->refs);
    return r;
}

void vmh_resv_unref(vmh_resv_t *r)
{
    if (!r || !ref_drop_last(&r->refs))
        return;
    /* The exact pair the driver returned: cuMemAddressFree accepts nothing else. */
    undo_checked("cuMemAddressFree", vmh_drv.cuMemAddressFree(r->ptr, r->size));
    vmh_gauge_add(VMH_STAT_bytes_reserved, -(int64_t)r->size);
    free(r);
}

/* ---- access ------------------------------------------------------------------------------ */

_Static_assert(VMH_MAX_DEVICES <= 64, "vmh_grants_t keeps one bit per device");

/* Held shared while a mapping is made and listed, exclusively while a grant changes: so a grant
 * either reaches a new mapping through the list or the mapping is made with the grant. */
static pthread_rwlock_t access_lock = PTHREAD_RWLOCK_INITIALIZER;
static pthread_mutex_t maps_lock = PTHREAD_MUTEX_INITIALIZER; /* guards the list below */
static vmh_map_t *maps;

/* The chunk's own descriptors plus its device's grants; access_lock held (shared). */
static int access_for(const vmh_alloc_t *a, CUmemAccessDesc *out)
{
    int n = 0;
    uint64_t peers = a->grants ? a->grants->peers : 0;
    for (int i = 0; i < a->naccess; i++) {
        out[n++] = a->access[i];
        if (a->access[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
            a->access[i].location.id >= 0 && a->access[i].location.id < VMH_MAX_DEVICES)
            peers &= ~(1ull << a->access[i].location.id);
    }
    for (int p = 0; p < VMH_MAX_DEVICES; p++) {
        if (!(peers & (1ull << p)))
            continue;
        memset(&out[n], 0, sizeof out[n]);
        out[n].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        out[n].location.id = p;
        out[n].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        n++;
    }
    return n;
}

static void maps_link(vmh_map_t *m)
{
    vmh_lock(&maps_lock, VMH_RANK_MAPS);
    VMH_HLIST_PUSH(maps, m);
    vmh_unlock(&maps_lock);
}

static void maps_unlink(vmh_map_t *m)
{
    vmh_lock(&maps_lock, VMH_RANK_MAPS);
    VMH_HLIST_REMOVE(maps, m);
    vmh_unlock(&maps_lock);
}

CUresult vmh_access_set_peer(vmh_grants_t *owner, int ordinal, int peer, bool grant)
{
    if (!owner || peer < 0 || peer >= VMH_MAX_DEVICES || ordinal == peer)
        return CUDA_ERROR_INVALID_DEVICE;
    CUmemAccessDesc desc;
    memset(&desc, 0, sizeof desc);
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = peer;
    desc.flags = grant ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
    CUresult rc = CUDA_SUCCESS;
    vmh_wrlock(&access_lock, VMH_RANK_ACCESS);
    if (grant)
        owner->peers |= 1ull << peer;
    else
        owner->peers &= ~(1ull << peer);
    /* A rare call that must reach every mapping at once: the list stays locked across the
     * driver calls, so no mapping goes meanwhile (none is made: access_lock). */
    vmh_lock(&maps_lock, VMH_RANK_MAPS);
    for (vmh_map_t *m = maps; m && rc == CUDA_SUCCESS; m = m->next)
        if (m->alloc->grants == owner)
            rc = vmh_drv.cuMemSetAccess(m->ptr, m->size, &desc, 1);
    vmh_unlock(&maps_lock);
    vmh_rwunlock(&access_lock);
    return rc;
}

/* ---- mappings ---------------------------------------------------------------------------- */

/* Unmaps the n adjacent mappings from ptr (bytes in all): one call over the run, and one per
 * mapping if the driver refused the run (each refusal reported: that mapping stays). */
static void unmap_run(CUdeviceptr ptr, size_t bytes, const size_t *sizes, size_t n)
{
    CUresult rc = vmh_drv.cuMemUnmap(ptr, bytes);
    if (rc == CUDA_SUCCESS || n == 1) {
        undo_checked("cuMemUnmap", rc);
        return;
    }
    for (size_t i = 0; i < n; ptr += sizes[i++])
        undo_checked("cuMemUnmap", vmh_drv.cuMemUnmap(ptr, sizes[i]));
}

CUresult vmh_maps_create_run(CUdeviceptr ptr, vmh_alloc_t *const *allocs, size_t n,
                             vmh_resv_t *resv, vmh_map_t **out)
{
    if (!out || !allocs || !resv || n == 0 || ptr < resv->ptr)
        return CUDA_ERROR_INVALID_VALUE;
    /* Every mapping must lie inside the reservation: the reservation is freed only after every
     * mapping in it is gone, which the references below guarantee only if this holds. */
    if (ptr - resv->ptr > resv->size)
        return CUDA_ERROR_INVALID_VALUE;
    size_t room = resv->size - (size_t)(ptr - resv->ptr), total = 0;
    for (size_t i = 0; i < n; i++) {
        if (!allocs[i] || allocs[i]->size > room - total)
            return CUDA_ERROR_INVALID_VALUE;
        total += allocs[i]->size;
    }
    vmh_map_t **m = calloc(n, sizeof *m);
    size_t *sizes = calloc(n, sizeof *sizes);
    bool records = m && sizes;
    for (size_t i = 0; i < n && records; i++)
        records = (m[i] = calloc(1, sizeof *m[i])) != NULL;
    if (!records) {
        for (size_t i = 0; m && i < n; i++)
            free(m[i]);
        free(m);
        free(sizes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = CUDA_SUCCESS;
    size_t mapped = 0, mapped_bytes = 0;
    vmh_rdlock(&access_lock, VMH_RANK_ACCESS);
    for (; mapped < n; mapped++) {
        rc = vmh_drv.cuMemMap(ptr + mapped_bytes, allocs[mapped]->size, 0, allocs[mapped]->handle,
                              0);
        if (rc != CUDA_SUCCESS)
            break;
        sizes[mapped] = allocs[mapped]->size;
        mapped_bytes += sizes[mapped];
    }
    /* A new mapping starts with no access; each chunk's descriptors travel with it, and the
     * peers granted for its device join them. Chunks with the same descriptors next to each
     * other get one cuMemSetAccess over all of them (a fully mapped range, driver-facts.md 3):
     * the call costs per call more than per byte. */
    CUmemAccessDesc acc[2][VMH_MAX_ACCESS + VMH_MAX_DEVICES];
    CUdeviceptr at = ptr;
    for (size_t i = 0; i < n && rc == CUDA_SUCCESS;) {
        int nacc = access_for(allocs[i], acc[0]);
        size_t j = i + 1, bytes = allocs[i]->size;
        while (j < n && access_for(allocs[j], acc[1]) == nacc &&
               memcmp(acc[0], acc[1], (size_t)nacc * sizeof acc[0][0]) == 0)
            bytes += allocs[j++]->size;
        if (nacc)
            rc = vmh_drv.cuMemSetAccess(at, bytes, acc[0], (size_t)nacc);
        at += bytes;
        i = j;
    }
    if (rc != CUDA_SUCCESS) {
        vmh_rwunlock(&access_lock);
        if (mapped)
            unmap_run(ptr, mapped_bytes, sizes, mapped);
        for (size_t i = 0; i < n; i++)
            free(m[i]);
        free(m);
        free(sizes);
        return rc;
    }
    at = ptr;
    for (size_t i = 0; i < n; i++) {
        atomic_init(&m[i]->refs, 1);
        m[i]->ptr = at;
        m[i]->size = allocs[i]->size;
        m[i]->alloc = vmh_alloc_ref(allocs[i]);
        m[i]->resv = vmh_resv_ref(resv);
        maps_link(m[i]);
        vmh_gauge_add(allocs[i]->host ? VMH_STAT_bytes_spilled : VMH_STAT_bytes_mapped,
                      (int64_t)m[i]->size);
        at += m[i]->size;
        out[i] = m[i];
    }
    vmh_rwunlock(&access_lock);
    free(m);
    free(sizes);
    return CUDA_SUCCESS;
}

CUresult vmh_map_create(CUdeviceptr ptr, vmh_alloc_t *alloc, vmh_resv_t *resv, vmh_map_t **out)
{
    return vmh_maps_create_run(ptr, &alloc, 1, resv, out);
}

vmh_map_t *vmh_map_ref(vmh_map_t *m)
{
    ref_take(&m->refs);
    return m;
}

/* run[0..n): adjacent, in one reservation, their last references dropped: unmapped with one
 * call, then their references go (the allocation is released and the reservation freed only
 * when nothing maps them any more). */
static void maps_gone(vmh_map_t *const *run, size_t n)
{
    size_t one, *sizes = n > 1 ? calloc(n, sizeof *sizes) : &one, bytes = 0;
    for (size_t i = 0; i < n; i++) {
        maps_unlink(run[i]);
        bytes += run[i]->size;
        if (sizes)
            sizes[i] = run[i]->size;
    }
    if (sizes)
        unmap_run(run[0]->ptr, bytes, sizes, n);
    else /* no memory for the fallback list: one call each, as before runs */
        for (size_t i = 0; i < n; i++)
            undo_checked("cuMemUnmap", vmh_drv.cuMemUnmap(run[i]->ptr, run[i]->size));
    if (sizes != &one)
        free(sizes);
    for (size_t i = 0; i < n; i++) {
        vmh_map_t *m = run[i];
        vmh_gauge_add(m->alloc->host ? VMH_STAT_bytes_spilled : VMH_STAT_bytes_mapped,
                      -(int64_t)m->size);
        vmh_alloc_unref(m->alloc);
        vmh_resv_unref(m->resv);
        free(m);
    }
}

void vmh_maps_unref_run(vmh_map_t *const *run, size_t n)
{
    /* run[first, first + len): dropped last, adjacent, one reservation: the run to unmap. A
     * mapping that another holder keeps ends the run, so a run is consecutive in run[]. */
    size_t first = 0, len = 0;
    for (size_t i = 0; i <= n; i++) {
        vmh_map_t *m = i < n ? run[i] : NULL;
        bool going = m && ref_drop_last(&m->refs);
        const vmh_map_t *prev = len ? run[first + len - 1] : NULL;
        bool joins = going && prev && prev->ptr + prev->size == m->ptr && prev->resv == m->resv;
        if (len && !joins) {
            maps_gone(&run[first], len);
            len = 0;
        }
        if (going && !len++)
            first = i;
    }
}

void vmh_map_unref(vmh_map_t *m)
{
    vmh_maps_unref_run(&m, 1);
}

/* An allocation handle for a POSIX fd another process exported (CUDA IPC, ipc_import.c). Built
 * like vmh_alloc_create's, so that vmh_alloc_unref's cuMemRelease + free is exactly right for
 * it too: the driver releases an imported handle with cuMemRelease like a created one. */
CUresult vmh_alloc_import(const vmh_grants_t *grants, int fd, size_t size, int device,
                          const CUmemAccessDesc *access, int naccess, vmh_alloc_t **out)
{
    if (!out || fd < 0 || size == 0 || naccess < 0 || naccess > VMH_MAX_ACCESS ||
        (naccess && !access))
        return CUDA_ERROR_INVALID_VALUE;
    vmh_alloc_t *a = calloc(1, sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = vmh_drv.cuMemImportFromShareableHandle(&a->handle, (void *)(intptr_t)fd,
                                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (rc != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    atomic_init(&a->refs, 1);
    a->size = size;
    a->device = device; /* the device it is mapped for here (the importer's numbering) */
    a->grants = grants;
    a->handle_type = (int)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    a->naccess = naccess;
    if (naccess)
        memcpy(a->access, access, (size_t)naccess * sizeof *access);
    *out = a;
    return CUDA_SUCCESS;
}
