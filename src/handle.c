/* Layer 2: allocation, reservation and mapping handles (see handle.h). The only code that
 * creates or destroys VMM driver objects. */
#include "handle.h"

#include "driver.h"
#include "log.h"
#include "stats.h"

#include <stdlib.h>
#include <string.h>

/* Every driver call of this layer is counted (stats, and the fault-injection tests compare). */
#define CALL(expr) (vmh_count(VMH_STAT_driver_calls, 1), (expr))

/* An undo call that fails leaves the driver object alive: there is nothing better to do than
 * say so once per failure (the program goes on; the leak is visible). */
void vmh_handle_report_failure(const char *call, CUresult rc)
{
    vmh_log("%s failed with CUDA error %d during release", call, (int)rc);
}

_Thread_local vmh_failed_call_t vmh_handle_last_failure;

CUresult vmh_alloc_create(size_t size, const CUmemAllocationProp *prop,
                          const CUmemAccessDesc *access, int naccess, vmh_alloc_t **out)
{
    if (!out || !prop || naccess < 0 || naccess > VMH_MAX_ACCESS || (naccess && !access))
        return CUDA_ERROR_INVALID_VALUE;
    vmh_alloc_t *a = calloc(1, sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CALL(vmh_drv.cuMemCreate(&a->handle, size, prop, 0));
    if (rc != CUDA_SUCCESS) {
        vmh_handle_last_failure = VMH_FAILED_CREATE;
        free(a);
        return rc;
    }
    atomic_init(&a->refs, 1);
    a->size = size;
    a->device = prop->location.id;
    a->handle_type = (int)prop->requestedHandleTypes;
    a->naccess = naccess;
    if (naccess)
        memcpy(a->access, access, (size_t)naccess * sizeof *access);
    *out = a;
    return CUDA_SUCCESS;
}

vmh_alloc_t *vmh_alloc_ref(vmh_alloc_t *a)
{
    atomic_fetch_add_explicit(&a->refs, 1, memory_order_relaxed);
    return a;
}

void vmh_alloc_unref(vmh_alloc_t *a)
{
    if (!a || atomic_fetch_sub_explicit(&a->refs, 1, memory_order_acq_rel) != 1)
        return;
    CUresult rc = CALL(vmh_drv.cuMemRelease(a->handle));
    if (rc != CUDA_SUCCESS)
        vmh_handle_report_failure("cuMemRelease", rc);
    free(a);
}

CUresult vmh_resv_create(size_t size, size_t align, CUdeviceptr hint, vmh_resv_t **out)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    vmh_resv_t *r = calloc(1, sizeof *r);
    if (!r)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CALL(vmh_drv.cuMemAddressReserve(&r->ptr, size, align, hint, 0));
    if (rc != CUDA_SUCCESS) {
        vmh_handle_last_failure = VMH_FAILED_RESERVE;
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
    atomic_fetch_add_explicit(&r->refs, 1, memory_order_relaxed);
    return r;
}

void vmh_resv_unref(vmh_resv_t *r)
{
    if (!r || atomic_fetch_sub_explicit(&r->refs, 1, memory_order_acq_rel) != 1)
        return;
    /* The exact pair the driver returned: cuMemAddressFree accepts nothing else. */
    CUresult rc = CALL(vmh_drv.cuMemAddressFree(r->ptr, r->size));
    if (rc != CUDA_SUCCESS)
        vmh_handle_report_failure("cuMemAddressFree", rc);
    vmh_gauge_add(VMH_STAT_bytes_reserved, -(int64_t)r->size);
    free(r);
}

CUresult vmh_map_create(CUdeviceptr ptr, vmh_alloc_t *alloc, vmh_resv_t *resv, vmh_map_t **out)
{
    if (!out || !alloc || !resv)
        return CUDA_ERROR_INVALID_VALUE;
    /* A mapping must lie inside its reservation: the reservation is freed only after every
     * mapping in it is gone, which the references below guarantee only if this holds. */
    if (ptr < resv->ptr || alloc->size > resv->size || ptr - resv->ptr > resv->size - alloc->size)
        return CUDA_ERROR_INVALID_VALUE;
    vmh_map_t *m = calloc(1, sizeof *m);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CALL(vmh_drv.cuMemMap(ptr, alloc->size, 0, alloc->handle, 0));
    if (rc != CUDA_SUCCESS) {
        vmh_handle_last_failure = VMH_FAILED_MAP;
        free(m);
        return rc;
    }
    /* A new mapping starts with no access; the chunk's descriptors travel with it. */
    if (alloc->naccess) {
        rc = CALL(vmh_drv.cuMemSetAccess(ptr, alloc->size, alloc->access,
                                         (size_t)alloc->naccess));
        if (rc != CUDA_SUCCESS) {
            vmh_handle_last_failure = VMH_FAILED_MAP;
            CUresult urc = CALL(vmh_drv.cuMemUnmap(ptr, alloc->size));
            if (urc != CUDA_SUCCESS)
                vmh_handle_report_failure("cuMemUnmap", urc);
            free(m);
            return rc;
        }
    }
    atomic_init(&m->refs, 1);
    m->ptr = ptr;
    m->size = alloc->size;
    m->alloc = vmh_alloc_ref(alloc);
    m->resv = vmh_resv_ref(resv);
    vmh_gauge_add(VMH_STAT_bytes_mapped, (int64_t)m->size);
    *out = m;
    return CUDA_SUCCESS;
}

vmh_map_t *vmh_map_ref(vmh_map_t *m)
{
    atomic_fetch_add_explicit(&m->refs, 1, memory_order_relaxed);
    return m;
}

void vmh_map_unref(vmh_map_t *m)
{
    if (!m || atomic_fetch_sub_explicit(&m->refs, 1, memory_order_acq_rel) != 1)
        return;
    CUresult rc = CALL(vmh_drv.cuMemUnmap(m->ptr, m->size));
    if (rc != CUDA_SUCCESS)
        vmh_handle_report_failure("cuMemUnmap", rc);
    vmh_gauge_add(VMH_STAT_bytes_mapped, -(int64_t)m->size);
    /* Unmap first, then the references: the allocation is released and the reservation
     * freed only when nothing maps them any more. */
    vmh_alloc_unref(m->alloc);
    vmh_resv_unref(m->resv);
    free(m);
}

/* An allocation handle for a POSIX fd another process exported (CUDA IPC, ipc_import.c). Built
 * like vmh_alloc_create's, so that vmh_alloc_unref's cuMemRelease + free is exactly right for
 * it too: the driver releases an imported handle with cuMemRelease like a created one. */
CUresult vmh_alloc_import(int fd, size_t size, int device, const CUmemAccessDesc *access,
                          int naccess, vmh_alloc_t **out)
{
    if (!out || fd < 0 || size == 0 || naccess < 0 || naccess > VMH_MAX_ACCESS ||
        (naccess && !access))
        return CUDA_ERROR_INVALID_VALUE;
    vmh_alloc_t *a = calloc(1, sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CALL(vmh_drv.cuMemImportFromShareableHandle(
        &a->handle, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    if (rc != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    atomic_init(&a->refs, 1);
    a->size = size;
    a->device = device; /* the device it is mapped for here (the importer's numbering) */
    a->handle_type = (int)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    a->naccess = naccess;
    if (naccess)
        memcpy(a->access, access, (size_t)naccess * sizeof *access);
    *out = a;
    return CUDA_SUCCESS;
}
