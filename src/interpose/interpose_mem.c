/* Layer "entry points": the interposed memory entry points. Each decides, call by call, whether the
 * library serves the request (heap.h, ipc.h) or the real driver answers it, untouched; and the
 * other allocators of the process (the stream-ordered pools, cuMemCreate, managed memory) get the
 * memory the library holds idle when they run out.
 *
 * Codes: every entry point answers what the native call answers in the same situation; inputs
 * the native call rejects (NULL out-pointers, size 0, bad element sizes, free of 0) are passed to
 * the real driver so that the code is its own, not a guess.
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#include "contexts.h"
#include "heap.h"
#include "interpose.h"
#include "ipc.h"
#include "log.h"
#include "stats.h"
#include "thread_state.h"

/* The served buffer holding p, or false. Only after vmh_ip_serving(): before it nothing is
 * served. */
static bool ip_find(CUdeviceptr p, vmh_buffer_info_t *info)
{
    vmh_thread.ip_depth++;
    bool found = vmh_heap_find(p, info);
    vmh_thread.ip_depth--;
    return found;
}

/* ---------------------------------------------------------------------------------------------
 * Allocation and free.
 */

/* Whether an allocation may be served now. While the driver forbids the calling thread
 * potentially unsafe calls (a capture in progress: its own, not relaxed, or another thread's in
 * global mode, by its interaction mode), cuMemAlloc is refused natively and the refusal
 * invalidates the capture; the request then goes to the driver, which answers exactly that. In
 * relaxed mode the driver allows it, and so is it served (PyTorch grows its graph pool so). */
static bool ip_may_serve_alloc(void)
{
    return vmh_ip_serving() && !vmh_capture_forbids_unsafe();
}

CUresult vmh_ip_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    /* NULL dptr and size 0 are the driver's to reject (CUDA_ERROR_INVALID_VALUE). */
    if (dptr != NULL && bytesize != 0 && ip_may_serve_alloc()) {
        CUdeviceptr p = 0;
        vmh_thread.ip_depth++;
        CUresult r = vmh_heap_alloc_at(bytesize, __builtin_return_address(0), &p);
        vmh_thread.ip_depth--;
        /* A failed allocation leaves 0 in *dptr, as the driver's own does. */
        if (r != CUDA_ERROR_NOT_SUPPORTED)
            *dptr = r == CUDA_SUCCESS ? p : 0;
        /* CUDA_ERROR_NOT_SUPPORTED: the heap does not serve (shut down at exit, or a device
         * without VMM support); the driver's own allocator does. Anything else (out of memory
         * after a trim, no context) is the code the native call gives. The heap traces. */
        if (r != CUDA_ERROR_NOT_SUPPORTED)
            return r;
    }
    IP_PASS(cuMemAlloc_v2, dptr, bytesize);
}

CUresult vmh_ip_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                   size_t Height, unsigned int ElementSizeBytes)
{
    /* Everything the driver rejects stays its answer: NULL outputs, an empty rectangle, an
     * element size other than 4, 8 or 16. */
    if (dptr != NULL && pPitch != NULL && WidthInBytes != 0 && Height != 0 &&
        (ElementSizeBytes == 4 || ElementSizeBytes == 8 || ElementSizeBytes == 16) &&
        ip_may_serve_alloc()) {
        CUdeviceptr p = 0;
        size_t pitch = 0;
        vmh_thread.ip_depth++;
        CUresult r = vmh_heap_alloc_pitch(WidthInBytes, Height, ElementSizeBytes,
                                          __builtin_return_address(0), &p, &pitch);
        vmh_thread.ip_depth--;
        if (r == CUDA_SUCCESS)
            *pPitch = pitch;
        if (r != CUDA_ERROR_NOT_SUPPORTED)
            *dptr = r == CUDA_SUCCESS ? p : 0; /* as cuMemAlloc: 0 on failure */
        if (r != CUDA_ERROR_NOT_SUPPORTED)
            return r;
    }
    IP_PASS(cuMemAllocPitch_v2, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
}

/* A served buffer's free: its code, or CUDA_ERROR_NOT_FOUND for a pointer we did not serve
 * (someone else's, allocated before we loaded, already freed: the driver answers those). */
static CUresult ip_free(CUdeviceptr p, CUstream stream, bool async)
{
    vmh_thread.ip_depth++;
    CUresult r = vmh_heap_free(p, stream, async);
    vmh_thread.ip_depth--;
    return r;
}

/* cuMemFree is a potentially unsafe call: while a capture forbids this thread such calls, the
 * driver refuses it natively (the buffer stays allocated) and the refusal invalidates the
 * capture. For a served buffer the driver is asked with the free of 0, which it refuses alike
 * under that rule and otherwise accepts: its refusal is the answer, and only if it accepts is
 * the free served. */
static CUresult ip_free_allowed_during_capture(CUdeviceptr p)
{
    if (IP_LIKELY(!vmh_capture_forbids_unsafe()) || !vmh_heap_holds(p))
        return CUDA_SUCCESS;
    CUresult r;
    IP_CALL_REAL(r, cuMemFree_v2, 0);
    return r;
}

CUresult vmh_ip_cuMemFree_v2(CUdeviceptr dptr)
{
    /* free(0) is the driver's (success once initialised). */
    if (dptr != 0 && vmh_ip_serving()) {
        CUresult r = ip_free_allowed_during_capture(dptr);
        if (r != CUDA_SUCCESS)
            return r;
        r = ip_free(dptr, NULL, false);
        if (r != CUDA_ERROR_NOT_FOUND)
            return r; /* served, or CUDA_ERROR_INVALID_VALUE for an interior pointer */
    }
    IP_PASS(cuMemFree_v2, dptr);
}

/* Both stream forms: the heap orders the free after the stream the call names (vmh_ip_stream). */
static CUresult ip_free_async(enum ip_variant v, bool ptsz, CUdeviceptr dptr, CUstream hStream)
{
    if (dptr != 0 && vmh_ip_serving()) {
        CUresult r = ip_free(dptr, vmh_ip_stream(ptsz, hStream), true);
        if (r != CUDA_ERROR_NOT_FOUND)
            return r;
    }
    IP_PASS_VARIANT(v, cuMemFreeAsync, dptr, hStream);
}
IP_STREAM_FORM_WRAPPERS(cuMemFreeAsync, ip_free_async, (CUdeviceptr dptr, CUstream hStream),
                        (dptr, hStream))

/* ---------------------------------------------------------------------------------------------
 * Queries. A served buffer answers as a native allocation of the size asked for would
 * (driver-facts 3a: base = the pointer returned, size = the size requested), not the chunk or
 * the reservation the driver would name (driver-facts 3).
 */
CUresult vmh_ip_cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    /* One lock-free registry read decides for every pointer the library does not hold. */
    if (vmh_ip_serving() && vmh_heap_holds(dptr)) {
        vmh_buffer_info_t bi;
        if (!ip_find(dptr, &bi))
            return CUDA_ERROR_NOT_FOUND; /* freed, kept mapped for reuse: natively unknown */
        if (pbase != NULL)
            *pbase = bi.base;
        if (psize != NULL)
            *psize = bi.size;
        return CUDA_SUCCESS;
    }
    IP_PASS(cuMemGetAddressRange_v2, pbase, psize, dptr);
}

static bool ip_is_range_attribute(CUpointer_attribute a)
{
    return a == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR || a == CU_POINTER_ATTRIBUTE_RANGE_SIZE;
}

static void ip_write_range_attribute(CUpointer_attribute a, void *data, const vmh_buffer_info_t *bi)
{
    if (a == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) {
        CUdeviceptr base = bi->base;
        memcpy(data, &base, sizeof base);
    } else {
        size_t size = bi->size;
        memcpy(data, &size, sizeof size);
    }
}

CUresult vmh_ip_cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    if (vmh_ip_serving() && vmh_heap_holds(ptr)) {
        vmh_buffer_info_t bi;
        if (!ip_find(ptr, &bi))
            return CUDA_ERROR_INVALID_VALUE; /* freed: unknown to a native allocator */
        /* Only the range attributes differ from what the driver says about our memory. */
        if (data != NULL && ip_is_range_attribute(attribute)) {
            ip_write_range_attribute(attribute, data, &bi);
            return CUDA_SUCCESS;
        }
    }
    IP_PASS(cuPointerGetAttribute, data, attribute, ptr);
}

CUresult vmh_ip_cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes,
                                       void **data, CUdeviceptr ptr)
{
    PFN_cuPointerGetAttributes_v7000 real = IP_REAL(cuPointerGetAttributes);
    if (real == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    /* The driver answers everything first (its codes, its validation of the list); then the
     * range entries are corrected for a served buffer. */
    vmh_buffer_info_t dead;
    if (vmh_ip_serving() && vmh_heap_holds(ptr) && !ip_find(ptr, &dead))
        ptr = 0; /* freed memory kept for reuse: answer as for an address nobody allocated */
    CUresult r = real(numAttributes, attributes, data, ptr);
    if (r != CUDA_SUCCESS || attributes == NULL || data == NULL)
        return r;
    bool wants_range = false;
    for (unsigned int i = 0; i < numAttributes && !wants_range; i++)
        wants_range = ip_is_range_attribute(attributes[i]) && data[i] != NULL;
    vmh_buffer_info_t bi;
    if (wants_range && vmh_ip_serving() && ip_find(ptr, &bi)) {
        for (unsigned int i = 0; i < numAttributes; i++)
            if (ip_is_range_attribute(attributes[i]) && data[i] != NULL)
                ip_write_range_attribute(attributes[i], data[i], &bi);
    }
    return r;
}

/* Memory the library holds idle for reuse is free for the program: programs that size
 * themselves from free memory (PyTorch's, TensorFlow's BFC, cuDNN workspaces) must not see
 * our cache as used. */
CUresult vmh_ip_cuMemGetInfo_v2(size_t *free, size_t *total)
{
    PFN_cuMemGetInfo_v3020 real = IP_REAL(cuMemGetInfo_v2);
    if (real == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(free, total);
    if (r != CUDA_SUCCESS || free == NULL || total == NULL || !vmh_ip_serving())
        return r;
    CUcontext ctx;
    int dev;
    vmh_thread.ip_depth++;
    size_t idle = vmh_ctx_current(&ctx, &dev) == CUDA_SUCCESS ? vmh_heap_reclaimable_bytes(dev) : 0;
    vmh_thread.ip_depth--;
    size_t f;
    if (__builtin_add_overflow(*free, idle, &f) || f > *total)
        f = *total;
    *free = f;
    return r;
}

/* ---------------------------------------------------------------------------------------------
 * IPC and peer access (ipc.h, docs/IPC.md).
 *
 * A served buffer's IPC handle is ours (magic, pid, token, export id) when VMMHOOK_HANDLE_TYPE is
 * posix_fd; otherwise cuIpcGetMemHandle answers CUDA_ERROR_INVALID_VALUE, as the driver does for
 * VMM memory, and says once how to make it work. Open takes our handles only (anything else,
 * including native handles, goes to the driver); close takes only what our open returned.
 */
CUresult vmh_ip_cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    vmh_buffer_info_t bi;
    /* NULL pHandle is the driver's to reject. */
    if (pHandle != NULL && vmh_ip_serving() && ip_find(dptr, &bi)) {
        vmh_thread.ip_depth++;
        CUresult r = vmh_ipc_get_handle(dptr, pHandle);
        vmh_thread.ip_depth--;
        if (r != CUDA_ERROR_NOT_FOUND) /* NOT_FOUND: freed meanwhile, the driver answers */
            return r;
    }
    IP_PASS(cuIpcGetMemHandle, pHandle, dptr);
}

CUresult vmh_ip_cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    if (pdptr != NULL && vmh_ipc_handle_is_ours(&handle) && vmh_ip_serving()) {
        vmh_thread.ip_depth++;
        CUresult r = vmh_ipc_open(&handle, Flags, pdptr);
        vmh_thread.ip_depth--;
        return r;
    }
    IP_PASS(cuIpcOpenMemHandle_v2, pdptr, handle, Flags);
}

CUresult vmh_ip_cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    if (dptr != 0 && vmh_ip_serving()) {
        vmh_thread.ip_depth++;
        CUresult r = vmh_ipc_close(dptr);
        vmh_thread.ip_depth--;
        if (r != CUDA_ERROR_NOT_FOUND)
            return r;
    }
    IP_PASS(cuIpcCloseMemHandle, dptr);
}

/* Peer access does not reach VMM memory by itself (driver-facts 3): after the driver enabled
 * (disabled) it, every served buffer of the peer context's device gets (loses) an access
 * descriptor for the current context's device, and so do the device's future buffers.
 * cudaDeviceEnablePeerAccess arrives here too: cudart fetches cuCtxEnablePeerAccess through
 * cuGetProcAddress. The driver's code is the answer; should the access update fail, the
 * program is told in the log (its peer access is on natively, and a code other than success
 * would make it believe otherwise). */
static void ip_peer_changed(CUcontext peerContext, bool grant)
{
    vmh_thread.ip_depth++;
    CUresult r = vmh_ipc_peer_changed(peerContext, grant);
    vmh_thread.ip_depth--;
    if (r != CUDA_SUCCESS)
        vmh_log("cuCtx%sPeerAccess succeeded, but %s the peer's access to served buffers "
                "failed with CUDA error %d: kernels %s",
                grant ? "Enable" : "Disable", grant ? "granting" : "revoking", (int)r,
                grant ? "of this context may fault on the peer's served memory"
                      : "of this context may still reach the peer's served memory");
}

CUresult vmh_ip_cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)
{
    PFN_cuCtxEnablePeerAccess_v4000 real = IP_REAL(cuCtxEnablePeerAccess);
    if (real == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(peerContext, Flags);
    if (r == CUDA_SUCCESS && vmh_ip_serving())
        ip_peer_changed(peerContext, true);
    return r;
}

CUresult vmh_ip_cuCtxDisablePeerAccess(CUcontext peerContext)
{
    PFN_cuCtxDisablePeerAccess_v4000 real = IP_REAL(cuCtxDisablePeerAccess);
    if (real == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(peerContext);
    if (r == CUDA_SUCCESS && vmh_ip_serving())
        ip_peer_changed(peerContext, false);
    return r;
}

/* ---------------------------------------------------------------------------------------------
 * The process's other allocators. When the stream-ordered pools (cudaMallocAsync), the
 * application's or NCCL's own cuMemCreate, or managed memory run out, the memory the library
 * holds idle (its cache, what is reclaimable) is given back and the call is retried once: a
 * program must not fail under the hook where it succeeds natively. Only once the library
 * serves (before, it holds nothing), and never from inside the library.
 */
static bool ip_trim_for_retry(CUresult r)
{
    if (r != CUDA_ERROR_OUT_OF_MEMORY || !vmh_ip_served_before())
        return false;
    vmh_thread.ip_depth++;
    size_t released = vmh_heap_trim();
    vmh_thread.ip_depth--;
    vmh_count(VMH_STAT_oom_retries, 1);
    vmh_debug("another allocator of the process ran out of memory: %zu bytes given back, "
              "retrying once",
              released);
    return true;
}

/* Calls the real function of `sym` with the arguments, and once more after a trim when it ran
 * out of memory. */
#define IP_PASS_RETRYING(sym, ...) IP_PASS_RETRYING_VARIANT(IP_##sym, sym, __VA_ARGS__)

/* IP_PASS_RETRYING to variant v, one of the stream forms of `sym`. */
#define IP_PASS_RETRYING_VARIANT(v, sym, ...)                                                      \
    do {                                                                                           \
        CUresult r_;                                                                               \
        IP_CALL_REAL_VARIANT(r_, v, sym, __VA_ARGS__);                                             \
        if (ip_trim_for_retry(r_))                                                                 \
            IP_CALL_REAL_VARIANT(r_, v, sym, __VA_ARGS__);                                         \
        return r_;                                                                                 \
    } while (0)

/* Both stream forms pass the stream on untouched: the driver reads it. */
static CUresult ip_alloc_async(enum ip_variant v, bool ptsz, CUdeviceptr *dptr, size_t bytesize,
                               CUstream hStream)
{
    (void)ptsz;
    IP_PASS_RETRYING_VARIANT(v, cuMemAllocAsync, dptr, bytesize, hStream);
}
IP_STREAM_FORM_WRAPPERS(cuMemAllocAsync, ip_alloc_async,
                        (CUdeviceptr * dptr, size_t bytesize, CUstream hStream),
                        (dptr, bytesize, hStream))

static CUresult ip_alloc_from_pool_async(enum ip_variant v, bool ptsz, CUdeviceptr *dptr,
                                         size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    (void)ptsz;
    IP_PASS_RETRYING_VARIANT(v, cuMemAllocFromPoolAsync, dptr, bytesize, pool, hStream);
}
IP_STREAM_FORM_WRAPPERS(cuMemAllocFromPoolAsync, ip_alloc_from_pool_async,
                        (CUdeviceptr * dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream),
                        (dptr, bytesize, pool, hStream))

CUresult vmh_ip_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                            const CUmemAllocationProp *prop, unsigned long long flags)
{
    IP_PASS_RETRYING(cuMemCreate, handle, size, prop, flags);
}

CUresult vmh_ip_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    IP_PASS_RETRYING(cuMemAllocManaged, dptr, bytesize, flags);
}

/* The exported symbols (src/vmmhook.map), for programs linked with -lcuda and for RTLD_DEFAULT
 * lookups. */
VMH_HOOKED_MEM(IP_EXPORT_ALIAS)
