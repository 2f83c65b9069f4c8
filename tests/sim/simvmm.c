/* simdrv: the VMM calls (cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess and the rest)
 * with the real driver's rules: granularity multiples, PINNED allocations charged to their
 * device or, located on the host, to the host's own limit; handles never reused; reservations in
 * the fake address space (VA_BASE); mappings of whole granules inside one reservation; access
 * per granule and device. The shareable handles are simipc.c's; the objects' lifetimes
 * simmem.c's. */
#include "simint.h"

/* Checks a CUmemAllocationProp; *device gets the device ordinal or -1 for host memory. */
static CUresult check_prop(const char *what, const CUmemAllocationProp *prop, int *device)
{
    if (!prop)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: prop NULL", what);
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: type %d is not PINNED", what, prop->type);
    switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        if (prop->location.id < 0 || prop->location.id >= ndev())
            return reject(CUDA_ERROR_INVALID_DEVICE, "%s: no device %d", what, prop->location.id);
        *device = prop->location.id;
        break;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        *device = -1;
        break;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
        if (prop->location.id != 0)
            return reject(CUDA_ERROR_INVALID_VALUE, "%s: no NUMA node %d", what,
                          prop->location.id);
        *device = -1;
        break;
    default:
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: location type %d", what,
                      prop->location.type);
    }
    unsigned t = (unsigned)prop->requestedHandleTypes;
    if (t & ~0xfu)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: handle types 0x%x", what, t);
    if (t & CU_MEM_HANDLE_TYPE_FABRIC)
        return reject(CUDA_ERROR_NOT_PERMITTED, "%s: FABRIC handles not permitted", what);
    if (t & (CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_WIN32_KMT))
        return reject(CUDA_ERROR_NOT_SUPPORTED, "%s: WIN32 handles on Linux", what);
    if (prop->win32HandleMetaData)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: win32HandleMetaData set", what);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemGetAllocationGranularity)(size_t *granularity,
                                                  const CUmemAllocationProp *prop,
                                                  CUmemAllocationGranularity_flags option)
{
    SIM_ENTER(cuMemGetAllocationGranularity);
    NEED_INIT();
    if (!granularity)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemGetAllocationGranularity: NULL");
    int device;
    CUresult rc = check_prop("cuMemGetAllocationGranularity", prop, &device);
    if (rc == CUDA_ERROR_NOT_PERMITTED)
        rc = CUDA_SUCCESS; /* the query itself is fine; creating is not */
    if (rc)
        return rc;
    if (option == CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        *granularity = S.cfg.granularity;
    else if (option == CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        *granularity = S.cfg.recommended;
    else
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemGetAllocationGranularity: option %d",
                      option);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemCreate)(CUmemGenericAllocationHandle *handle, size_t size,
                                const CUmemAllocationProp *prop, unsigned long long flags)
{
    SIM_ENTER(cuMemCreate);
    NEED_INIT();
    if (!handle)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemCreate: handle NULL");
    if (flags)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemCreate: flags 0x%llx", flags);
    int device;
    CUresult rc = check_prop("cuMemCreate", prop, &device);
    if (rc)
        return rc;
    if (!size || size % gran())
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemCreate: size %zu is not a multiple of the granularity %zu", size,
                      gran());
    allocs_sweep_held();
    if (device >= 0 && size > S.cfg.memory - S.used[device])
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate: %zu bytes, %zu free on device %d",
                      size, S.cfg.memory - S.used[device], device);
    /* Host-located memory is pinned by the driver at creation: its own, separate limit. */
    if (device < 0 && size > S.cfg.host_memory - S.host_used)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate: %zu bytes of host memory, %zu free",
                      size, S.cfg.host_memory - S.host_used);
    sim_alloc_t *a = xcalloc(1, sizeof *a);
    a->id = S.next_id++;
    a->size = size;
    a->prop = *prop;
    a->device = device;
    if (device >= 0)
        S.used[device] += size;
    else
        S.host_used += size;
    a->next = S.allocs;
    if (S.allocs)
        S.allocs->prev = a;
    S.allocs = a;
    S.nallocs++;
    *handle = handle_new(a);
    return CUDA_SUCCESS;
}

sim_handle_t *handle_find(CUmemGenericAllocationHandle h)
{
    return vec_exact(&S.handles, (CUdeviceptr)h);
}

CUresult SIM_IMPL(cuMemRelease)(CUmemGenericAllocationHandle handle)
{
    SIM_ENTER(cuMemRelease);
    NEED_INIT();
    sim_handle_t *h = handle_find(handle);
    if (!h)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemRelease: unknown handle 0x%llx",
                      (unsigned long long)handle);
    sim_alloc_t *a = h->a;
    vec_remove(&S.handles, h);
    free(h);
    a->nhandles--;
    alloc_maybe_free(a);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle *handle, void *addr)
{
    SIM_ENTER(cuMemRetainAllocationHandle);
    NEED_INIT();
    if (!handle)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemRetainAllocationHandle: NULL");
    sim_map_t *m = vec_find(&S.maps, (CUdeviceptr)(uintptr_t)addr);
    if (!m)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemRetainAllocationHandle: %p not mapped",
                      addr);
    *handle = handle_new(m->a);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle handle)
{
    SIM_ENTER(cuMemGetAllocationPropertiesFromHandle);
    NEED_INIT();
    if (!prop)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemGetAllocationPropertiesFromHandle");
    sim_handle_t *h = handle_find(handle);
    if (!h)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "unknown handle");
    *prop = h->a->prop;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment,
                                        CUdeviceptr addr, unsigned long long flags)
{
    SIM_ENTER(cuMemAddressReserve);
    NEED_INIT();
    if (!ptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAddressReserve: ptr NULL");
    if (flags)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemAddressReserve: flags 0x%llx", flags);
    if (!size || size % gran())
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemAddressReserve: size 0x%zx is not a multiple of the granularity",
                      size);
    if (alignment && !is_pow2(alignment))
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemAddressReserve: alignment 0x%zx is not a power of two", alignment);
    size_t align = alignment > gran() ? alignment : gran();
    if (addr % align)
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemAddressReserve: hint 0x%llx is not aligned to 0x%zx",
                      (unsigned long long)addr, align);
    CUdeviceptr lo = VA_BASE, hi = VA_BASE + S.cfg.va_size, p = 0;
    if (addr && !S.refuse_hints && addr >= lo && addr < hi && hi - addr >= size &&
        vec_range_free(&S.resvs, addr, size))
        p = addr;
    if (!p) {
        CUdeviceptr from = S.res_rover + S.cfg.va_gap;
        if (from >= S.res_rover && from < hi)
            p = vec_gap_from(&S.resvs, from, hi, size, align);
    }
    if (!p)
        p = vec_gap_from(&S.resvs, lo, hi, size, align);
    if (!p)
        return reject(CUDA_ERROR_OUT_OF_MEMORY,
                      "cuMemAddressReserve: no 0x%zx bytes of address space left", size);
    sim_resv_t *r = xcalloc(1, sizeof *r);
    r->iv.ptr = p;
    r->iv.span = size;
    r->id = S.next_id++;
    vec_insert(&S.resvs, r);
    S.res_rover = p + size;
    *ptr = p;
    return CUDA_SUCCESS;
}

static bool range_has_mapping(CUdeviceptr p, size_t size)
{
    size_t i = vec_upper(&S.maps, p);
    if (i > 0 && S.maps.v[i - 1]->ptr + S.maps.v[i - 1]->span > p)
        return true;
    return i < S.maps.n && S.maps.v[i]->ptr < p + size;
}

CUresult SIM_IMPL(cuMemAddressFree)(CUdeviceptr ptr, size_t size)
{
    SIM_ENTER(cuMemAddressFree);
    NEED_INIT();
    sim_resv_t *r = vec_exact(&S.resvs, ptr);
    if (!r || r->iv.span != size)
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemAddressFree: (0x%llx, 0x%zx) is not a reservation",
                      (unsigned long long)ptr, size);
    if (range_has_mapping(ptr, size))
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemAddressFree: reservation 0x%llx still has mappings",
                      (unsigned long long)ptr);
    hazard_check("cuMemAddressFree", ptr, size);
    vec_remove(&S.resvs, r);
    free(r);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemMap)(CUdeviceptr ptr, size_t size, size_t offset,
                             CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    SIM_ENTER(cuMemMap);
    NEED_INIT();
    if (flags)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemMap: flags 0x%llx", flags);
    sim_handle_t *h = handle_find(handle);
    if (!h)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemMap: unknown handle 0x%llx",
                      (unsigned long long)handle);
    sim_alloc_t *a = h->a;
    if (!size || ptr % gran() || size % gran() || offset % gran())
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemMap: ptr 0x%llx size 0x%zx offset 0x%zx not granularity multiples",
                      (unsigned long long)ptr, size, offset);
    if (offset >= a->size || a->size - offset < size)
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemMap: offset 0x%zx + size 0x%zx beyond the allocation (0x%zx)", offset,
                      size, a->size);
    if (offset || size != a->size)
        return reject(CUDA_ERROR_NOT_SUPPORTED,
                      "cuMemMap: partial map (offset 0x%zx, size 0x%zx of 0x%zx)", offset, size,
                      a->size);
    sim_resv_t *r = vec_find(&S.resvs, ptr);
    if (!r || r->iv.ptr + r->iv.span - ptr < size)
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemMap: [0x%llx, +0x%zx) is not inside one reservation",
                      (unsigned long long)ptr, size);
    if (range_has_mapping(ptr, size))
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemMap: [0x%llx, +0x%zx) already mapped",
                      (unsigned long long)ptr, size);
    sim_map_t *m = xcalloc(1, sizeof *m);
    m->iv.ptr = ptr;
    m->iv.span = size;
    m->a = a;
    m->r = r;
    m->acc = xcalloc(size / gran() * (size_t)ndev(), 1);
    a->nmaps++;
    vec_insert(&S.maps, m);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemUnmap)(CUdeviceptr ptr, size_t size)
{
    SIM_ENTER(cuMemUnmap);
    NEED_INIT();
    if (!size)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemUnmap: size 0");
    size_t i = vec_upper(&S.maps, ptr);
    if (i == 0 || S.maps.v[i - 1]->ptr != ptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemUnmap: no mapping starts at 0x%llx",
                      (unsigned long long)ptr);
    size_t first = i - 1, last = first;
    CUdeviceptr end = ptr + size, at = ptr;
    for (;;) {
        sim_iv_t *m = S.maps.v[last];
        if (m->ptr != at)
            return reject(CUDA_ERROR_INVALID_VALUE, "cuMemUnmap: hole at 0x%llx",
                          (unsigned long long)at);
        at = m->ptr + m->span;
        if (at == end)
            break;
        if (at > end)
            return reject(CUDA_ERROR_INVALID_VALUE,
                          "cuMemUnmap: [0x%llx, +0x%zx) ends inside a mapping",
                          (unsigned long long)ptr, size);
        if (++last == S.maps.n)
            return reject(CUDA_ERROR_INVALID_VALUE, "cuMemUnmap: unmapped tail at 0x%llx",
                          (unsigned long long)at);
    }
    hazard_check("cuMemUnmap", ptr, size);
    for (size_t k = last + 1; k-- > first;)
        map_destroy((sim_map_t *)S.maps.v[k]);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                   size_t count)
{
    SIM_ENTER(cuMemSetAccess);
    NEED_INIT();
    if (!count || !desc)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemSetAccess: no descriptor");
    if (!size || ptr % gran() || size % gran())
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemSetAccess: [0x%llx, +0x%zx) not granularity multiples",
                      (unsigned long long)ptr, size);
    /* The range must be mapped throughout. */
    CUdeviceptr end = ptr + size;
    for (CUdeviceptr at = ptr; at < end;) {
        sim_map_t *m = vec_find(&S.maps, at);
        if (!m)
            return reject(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: 0x%llx is not mapped",
                          (unsigned long long)at);
        at = m->iv.ptr + m->iv.span;
    }
    for (size_t k = 0; k < count; k++) {
        const CUmemAccessDesc *d = &desc[k];
        if (d->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
            return reject(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: location type %d",
                          d->location.type);
        if (d->location.id < 0 || d->location.id >= ndev())
            return reject(CUDA_ERROR_INVALID_DEVICE, "cuMemSetAccess: no device %d",
                          d->location.id);
        if (d->flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
            d->flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            d->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return reject(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: flags %d", d->flags);
        if (S.cfg.no_peer_access && d->flags != CU_MEM_ACCESS_FLAGS_PROT_NONE) {
            for (CUdeviceptr at = ptr; at < end;) {
                sim_map_t *m = vec_find(&S.maps, at);
                if (m->a->device >= 0 && m->a->device != d->location.id)
                    return reject(CUDA_ERROR_INVALID_DEVICE,
                                  "cuMemSetAccess: device %d cannot reach device %d's memory",
                                  d->location.id, m->a->device);
                at = m->iv.ptr + m->iv.span;
            }
        }
    }
    for (CUdeviceptr at = ptr; at < end;) {
        sim_map_t *m = vec_find(&S.maps, at);
        CUdeviceptr mend = m->iv.ptr + m->iv.span, stop = mend < end ? mend : end;
        for (size_t g = (at - m->iv.ptr) / gran(); g < (stop - m->iv.ptr) / gran(); g++)
            for (size_t k = 0; k < count; k++)
                m->acc[g * (size_t)ndev() + (size_t)desc[k].location.id] =
                    (unsigned char)desc[k].flags;
        at = stop;
    }
    return CUDA_SUCCESS;
}
