/* simdrv: the native allocator (cuMemAlloc and its async, pool, managed and pitched kin,
 * cuMemFree[Async]) in its own fake address range (NAT_BASE), blocks belonging to the context
 * they were made in; and the pointer queries (cuMemGetAddressRange, cuPointerGetAttribute[s])
 * for native blocks and VMM mappings alike. */
#include "simint.h"

#define NAT_ALIGN 512ULL

/* A new native block in ctx (freed with it), charged to ctx's device. */
CUresult native_new(const char *what, CUcontext ctx, size_t size, size_t charged,
                    sim_native_kind_t kind, CUdeviceptr *out)
{
    int dev = ctx->device;
    if (charged > S.cfg.memory - S.used[dev])
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "%s: %zu bytes, %zu free on device %d", what,
                      size, S.cfg.memory - S.used[dev], dev);
    size_t align = charged >= 2 * MiB ? 2 * MiB : NAT_ALIGN;
    CUdeviceptr hi = NAT_BASE + NAT_SPAN, p = 0;
    if (S.nat_rover < hi)
        p = vec_gap_from(&S.natives, S.nat_rover, hi, charged, align);
    if (!p)
        p = vec_gap_from(&S.natives, NAT_BASE, hi, charged, align);
    if (!p)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "%s: native address space full", what);
    sim_native_t *n = xcalloc(1, sizeof *n);
    n->iv.ptr = p;
    n->iv.span = charged;
    n->size = size;
    n->charged = charged;
    n->device = dev;
    n->ctx = ctx;
    n->kind = kind;
    n->id = S.next_id++;
    vec_insert(&S.natives, n);
    S.used[dev] += charged;
    S.nat_rover = p + charged;
    *out = p;
    return CUDA_SUCCESS;
}

size_t round512(size_t n) { return (n + NAT_ALIGN - 1) & ~(size_t)(NAT_ALIGN - 1); }

CUresult SIM_IMPL(cuMemAlloc)(CUdeviceptr *dptr, size_t bytesize)
{
    SIM_ENTER(cuMemAlloc);
    NEED_CTX(dev);
    CUresult rc = capture_allows("cuMemAlloc");
    if (rc)
        return rc;
    if (!dptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAlloc: dptr NULL");
    if (!bytesize)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAlloc: size 0");
    if (bytesize > S.cfg.memory) {
        *dptr = 0; /* the H200 wrote 0 to the pointer of a failed cuMemAlloc(1 PiB) */
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc: %zu bytes", bytesize);
    }
    rc = native_new("cuMemAlloc", cur_ctx(), bytesize, round512(bytesize), NATIVE_DEVICE, dptr);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY)
        *dptr = 0;
    (void)dev;
    return rc;
}

/* The stream-ordered allocators: a plain native block (pools are not simulated), in the
 * stream's context. */
static CUresult alloc_async(const char *what, CUdeviceptr *dptr, size_t bytesize, CUstream s)
{
    CUcontext ctx;
    CUresult rc = stream_ctx(s, what, &ctx);
    if (!rc)
        rc = capture_conflicts_legacy(s, ctx, what);
    if (rc)
        return rc;
    if (!dptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: dptr NULL", what);
    if (!bytesize)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: size 0", what);
    if (bytesize > S.cfg.memory)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "%s: %zu bytes", what, bytesize);
    return native_new(what, ctx, bytesize, round512(bytesize), NATIVE_DEVICE, dptr);
}

CUresult SIM_IMPL(cuMemAllocAsync)(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    SIM_ENTER(cuMemAllocAsync);
    NEED_CTX(dev);
    (void)dev;
    return alloc_async("cuMemAllocAsync", dptr, bytesize, hStream);
}

CUresult SIM_IMPL(cuMemAllocFromPoolAsync)(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                            CUstream hStream)
{
    SIM_ENTER(cuMemAllocFromPoolAsync);
    NEED_CTX(dev);
    (void)dev;
    if (!pool) /* any other value is taken as a pool: pools are not simulated */
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAllocFromPoolAsync: pool NULL");
    return alloc_async("cuMemAllocFromPoolAsync", dptr, bytesize, hStream);
}

CUresult SIM_IMPL(cuMemAllocManaged)(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    SIM_ENTER(cuMemAllocManaged);
    NEED_CTX(dev);
    (void)dev;
    CUresult rc = capture_allows("cuMemAllocManaged");
    if (rc)
        return rc;
    if (!dptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAllocManaged: dptr NULL");
    if (!bytesize)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAllocManaged: size 0");
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemAllocManaged: flags %u", flags);
    /* Charged to the current device like cuMemAlloc, so that a test can exhaust it (the real
     * driver can oversubscribe managed memory; the simulation does not). */
    if (bytesize > S.cfg.memory)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAllocManaged: %zu bytes", bytesize);
    return native_new("cuMemAllocManaged", cur_ctx(), bytesize, round512(bytesize),
                      NATIVE_MANAGED, dptr);
}

CUresult SIM_IMPL(cuMemAllocPitch)(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                    unsigned int elementSize)
{
    SIM_ENTER(cuMemAllocPitch);
    NEED_CTX(dev);
    (void)dev;
    CUresult rc = capture_allows("cuMemAllocPitch");
    if (rc)
        return rc;
    if (!dptr || !pitch)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAllocPitch: NULL");
    if (elementSize != 4 && elementSize != 8 && elementSize != 16)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemAllocPitch: elementSize %u", elementSize);
    if (!width || !height)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAllocPitch: empty");
    if (width > S.cfg.memory || height > S.cfg.memory)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "%s", "cuMemAllocPitch: too large");
    size_t p = round512(width);
    if (height > S.cfg.memory / p)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "%s", "cuMemAllocPitch: too large");
    rc = native_new("cuMemAllocPitch", cur_ctx(), p * height, p * height, NATIVE_DEVICE, dptr);
    if (rc == CUDA_SUCCESS)
        *pitch = p;
    return rc;
}

static CUresult native_find(const char *what, CUdeviceptr dptr, sim_native_t **out)
{
    sim_native_t *n = vec_exact(&S.natives, dptr);
    if (!n) {
        if (vec_find(&S.maps, dptr) || vec_find(&S.resvs, dptr))
            return reject(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is VMM memory", what,
                          (unsigned long long)dptr);
        if (vec_find(&S.natives, dptr))
            return reject(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is an interior pointer", what,
                          (unsigned long long)dptr);
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx was not allocated (or was freed)",
                      what, (unsigned long long)dptr);
    }
    *out = n;
    return CUDA_SUCCESS;
}

static void native_free(const char *what, sim_native_t *n)
{
    hazard_check(what, n->iv.ptr, n->size);
    native_destroy(n);
}

CUresult SIM_IMPL(cuMemFree)(CUdeviceptr dptr)
{
    SIM_ENTER(cuMemFree);
    NEED_CTX(dev);
    (void)dev;
    CUresult rc = capture_allows("cuMemFree"); /* cudaFree(0) too is refused during capture */
    if (rc)
        return rc;
    if (!dptr)
        return CUDA_SUCCESS;
    sim_native_t *n = NULL;
    rc = native_find("cuMemFree", dptr, &n);
    if (rc)
        return rc;
    /* cuMemFree synchronizes: the work of the calling thread's context and of the block's own
     * context lands first (other contexts' work does not). */
    work_land_ctx(cur_ctx());
    if (n->ctx != cur_ctx())
        work_land_ctx(n->ctx);
    native_free("cuMemFree", n);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemFreeAsync)(CUdeviceptr dptr, CUstream stream)
{
    SIM_ENTER(cuMemFreeAsync);
    NEED_INIT();
    CUcontext ctx;
    CUresult rc = stream_ctx(stream, "cuMemFreeAsync", &ctx);
    if (!rc)
        rc = capture_conflicts_legacy(stream, ctx, "cuMemFreeAsync");
    if (rc)
        return rc;
    if (!dptr)
        return CUDA_SUCCESS;
    sim_native_t *n = NULL;
    rc = native_find("cuMemFreeAsync", dptr, &n);
    if (rc)
        return rc;
    if (stream_capturing(stream)) {
        stream->captured_ops++; /* a free node of the graph: nothing is freed now */
        return CUDA_SUCCESS;
    }
    /* stream-ordered: the stream's work before it is done when the memory goes */
    if (is_default_stream(stream))
        work_land_ctx(ctx);
    else
        work_land_stream(stream);
    native_free("cuMemFreeAsync", n);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemGetAddressRange)(CUdeviceptr *base, size_t *size, CUdeviceptr dptr)
{
    SIM_ENTER(cuMemGetAddressRange);
    NEED_CTX(dev);
    (void)dev;
    sim_native_t *n = vec_find(&S.natives, dptr);
    if (n && dptr - n->iv.ptr < n->size) {
        if (base)
            *base = n->iv.ptr;
        if (size)
            *size = n->size;
        return CUDA_SUCCESS;
    }
    sim_map_t *m = vec_find(&S.maps, dptr);
    if (m) {
        if (base)
            *base = m->iv.ptr;
        if (size)
            *size = m->iv.span;
        return CUDA_SUCCESS;
    }
    return reject(CUDA_ERROR_NOT_FOUND, "cuMemGetAddressRange: 0x%llx unknown",
                  (unsigned long long)dptr);
}

/* One pointer attribute; unknown pointers: CUDA_ERROR_INVALID_VALUE. */
static CUresult pointer_attr(void *data, CUpointer_attribute attr, CUdeviceptr ptr)
{
    sim_native_t *n = vec_find(&S.natives, ptr);
    if (n && ptr - n->iv.ptr >= n->size)
        n = NULL;
    sim_map_t *m = n ? NULL : vec_find(&S.maps, ptr);
    if (!n && !m) {
        if (attr == CU_POINTER_ATTRIBUTE_MAPPED && vec_find(&S.resvs, ptr)) {
            *(unsigned *)data = 0;
            return CUDA_SUCCESS;
        }
        return reject(CUDA_ERROR_INVALID_VALUE, "cuPointerGetAttribute: 0x%llx unknown",
                      (unsigned long long)ptr);
    }
    int dev = n ? n->device : m->a->device;
    unsigned long long id = n ? n->id : m->a->id;
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
        *(CUcontext *)data = n ? n->ctx : NULL;
        break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned *)data = dev >= 0 ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        if (cur_dev() < 0)
            return reject(CUDA_ERROR_INVALID_CONTEXT, "%s", "DEVICE_POINTER: no context");
        *(CUdeviceptr *)data = ptr;
        break;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
        *(unsigned *)data = 0;
        break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
        *(unsigned long long *)data = id;
        break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        *(unsigned *)data = n && n->kind == NATIVE_MANAGED;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *(int *)data = dev >= 0 ? dev : -1;
        break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        *(unsigned *)data = n != NULL;
        break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *(CUdeviceptr *)data = n ? n->iv.ptr : m->r->iv.ptr;
        break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *(size_t *)data = n ? n->size : m->r->iv.span;
        break;
    case CU_POINTER_ATTRIBUTE_MAPPED:
        *(unsigned *)data = 1;
        break;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
        *(unsigned *)data = n ? 0 : (unsigned)m->a->prop.requestedHandleTypes;
        break;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
        *(unsigned *)data = n ? 1 : m->a->prop.allocFlags.gpuDirectRDMACapable != 0;
        break;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: {
        int cd = cur_dev();
        if (cd < 0)
            return reject(CUDA_ERROR_INVALID_CONTEXT, "%s", "ACCESS_FLAGS: no context");
        if (n)
            *(unsigned *)data = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE;
        else
            *(unsigned *)data = m->acc[(ptr - m->iv.ptr) / gran() * (size_t)ndev() + (size_t)cd];
        break;
    }
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
        *(CUmemoryPool *)data = NULL;
        break;
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
        *(size_t *)data = n ? n->size : m->iv.span;
        break;
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
        *(CUdeviceptr *)data = n ? n->iv.ptr : m->iv.ptr;
        break;
    case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE:
        *(unsigned *)data = 0;
        break;
    default:
        return reject(CUDA_ERROR_INVALID_VALUE, "cuPointerGetAttribute: attribute %d", attr);
    }
    return CUDA_SUCCESS;
}

static size_t attr_size(CUpointer_attribute attr)
{
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
        return 8;
    case CU_POINTER_ATTRIBUTE_P2P_TOKENS:
        return sizeof(CUDA_POINTER_ATTRIBUTE_P2P_TOKENS);
    default:
        return 4;
    }
}

CUresult SIM_IMPL(cuPointerGetAttribute)(void *data, CUpointer_attribute attribute,
                                          CUdeviceptr ptr)
{
    SIM_ENTER(cuPointerGetAttribute);
    NEED_INIT();
    if (!data)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuPointerGetAttribute: data NULL");
    /* Write through a scratch copy so that a failure leaves *data alone. */
    unsigned char tmp[sizeof(CUDA_POINTER_ATTRIBUTE_P2P_TOKENS) + 16];
    memset(tmp, 0, sizeof tmp);
    CUresult rc = pointer_attr(tmp, attribute, ptr);
    if (rc == CUDA_SUCCESS)
        memcpy(data, tmp, attr_size(attribute));
    return rc;
}

CUresult SIM_IMPL(cuPointerGetAttributes)(unsigned int n, CUpointer_attribute *attributes,
                                           void **data, CUdeviceptr ptr)
{
    SIM_ENTER(cuPointerGetAttributes);
    NEED_INIT();
    if (!n || !attributes || !data)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuPointerGetAttributes: bad arrays");
    for (unsigned i = 0; i < n; i++)
        if (!data[i])
            return reject(CUDA_ERROR_INVALID_VALUE, "cuPointerGetAttributes: data[%u] NULL", i);
    bool known = vec_find(&S.maps, ptr) != NULL;
    sim_native_t *nat = vec_find(&S.natives, ptr);
    known = known || (nat && ptr - nat->iv.ptr < nat->size);
    for (unsigned i = 0; i < n; i++) {
        unsigned char tmp[sizeof(CUDA_POINTER_ATTRIBUTE_P2P_TOKENS) + 16];
        memset(tmp, 0, sizeof tmp);
        if (known) {
            CUresult rc = pointer_attr(tmp, attributes[i], ptr);
            if (rc == CUDA_ERROR_INVALID_CONTEXT)
                return rc;
            if (rc != CUDA_SUCCESS)
                memset(tmp, 0, sizeof tmp); /* unsupported attribute: default value */
        }
        memcpy(data[i], tmp, attr_size(attributes[i]));
    }
    return CUDA_SUCCESS;
}
