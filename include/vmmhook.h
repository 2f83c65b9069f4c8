/* libvmmhook public API, for code that knows the hook may be loaded.
 *
 * Compiles in C and C++ without CUDA headers. Device pointers are passed as void * (the value
 * of a CUdeviceptr or of a cudaMalloc pointer); streams as void * (a CUstream or a
 * cudaStream_t, which are the same pointer; NULL is the legacy default stream).
 *
 * The library may be absent: vmm_hook_available() (header-only, through dlsym) says whether
 * it is loaded in this process, and the vmm_fn() helper fetches an entry point or NULL, so aware
 * code can fall back to cudaMalloc + cudaMemcpy + cudaFree itself.
 */
#ifndef VMMHOOK_H
#define VMMHOOK_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define VMM_VERSION_MAJOR 0
#define VMM_VERSION_MINOR 1
#define VMM_VERSION_PATCH 0
#define VMM_VERSION ((VMM_VERSION_MAJOR * 10000) + (VMM_VERSION_MINOR * 100) + VMM_VERSION_PATCH)

/* Status codes of the public API. */
typedef enum vmm_status {
    VMM_OK = 0,
    VMM_ERR_INVALID = 1,       /* a NULL out-pointer, or a bad argument */
    VMM_ERR_FOREIGN = 2,       /* the pointer was not allocated by this library (or was freed) */
    VMM_ERR_INTERIOR = 3,      /* the pointer lies inside a buffer but is not its start */
    VMM_ERR_NO_MEMORY = 4,     /* the device (or VMMHOOK_MEM_LIMIT) has no memory for it */
    VMM_ERR_NO_ADDRESS = 5,    /* no virtual address space could be reserved */
    VMM_ERR_SIZE = 6,          /* size overflows once rounded to the granularity */
    VMM_ERR_NO_DRIVER = 7,     /* no CUDA driver, no current context, or the library is disabled */
    VMM_ERR_DRIVER = 8,        /* the driver failed otherwise; vmm_last_driver_error() tells */
    VMM_STATUS_COUNT
} vmm_status;

/* Resizes the device buffer *ptr to size bytes, like realloc:
 *  - *ptr NULL allocates on the current context's device; size 0 frees *ptr and sets it NULL;
 *  - growth keeps the contents; it keeps the pointer when the reserved headroom or the
 *    adjacent address space allows, otherwise it maps the same physical memory at a new address
 *    (no copy); buffers smaller than one chunk (packed) that outgrow their slot move with one
 *    device-to-device copy;
 *  - shrinking keeps the pointer and returns whole chunks past the new size to the system;
 *  - on any failure *ptr and its buffer are untouched and valid, and the status says why.
 * After a move the old pointer is invalid, as with realloc. Before the old address is unmapped
 * (and before anything freed by a shrink is reused), the call waits for all work queued on the
 * device so far (one context synchronize), as cudaFree would; the new pointer is usable at once. */
vmm_status vmm_realloc(void **ptr, size_t size);

/* Stream-ordered variant: the copy of a packed buffer that moves is enqueued on stream, and the
 * old address stays mapped until work queued before this call has completed. */
vmm_status vmm_realloc_async(void **ptr, size_t size, void *stream);

/* Bytes usable at ptr without moving (>= the size asked for); 0 for a pointer not served. */
size_t vmm_usable_size(const void *ptr);

/* 1 when ptr lies inside a live buffer served by the library, else 0. */
int vmm_owns(const void *ptr);

/* Returns idle cached memory to the driver; returns the number of bytes released. */
size_t vmm_trim(void);

/* VMM_VERSION of the loaded library. */
int vmm_version(void);

/* Short text for a status code (never NULL). */
const char *vmm_status_string(vmm_status status);

/* The last driver code (CUresult value) behind VMM_ERR_DRIVER on this thread. */
int vmm_last_driver_error(void);

/* PyTorch CUDAPluggableAllocator entry points (the ABI torch.cuda.memory loads):
 *   torch.cuda.memory.CUDAPluggableAllocator("libvmmhook.so", "vmm_torch_alloc", "vmm_torch_free")
 * They allocate on `device`, and the free is ordered after work queued before it. */
void *vmm_torch_alloc(size_t size, int device, void *stream);
void vmm_torch_free(void *ptr, size_t size, int device, void *stream);

/* Run-time detection without linking against the library. */
#if defined(__unix__) && !defined(VMM_NO_DLSYM_HELPERS)
#include <dlfcn.h>
/* An exported function of the library, or NULL when the library is not loaded. The handle is
 * glibc's RTLD_DEFAULT ((void *)0), spelled out so that no _GNU_SOURCE is needed. */
static inline void *vmm_fn(const char *name)
{
    return dlsym((void *)0, name);
}
static inline int vmm_hook_available(void)
{
    return vmm_fn("vmm_realloc") != NULL;
}
#endif

#ifdef __cplusplus
}
#endif

#endif
