/* Layer "API": the public API of include/vmmhook.h. Translates the heap's CUresult codes into
 * vmm_status codes. (The library's lifetime, and the destructor that reports: lifetime.c.) */
#include "vmmhook.h"

#include "driver.h"
#include "handle.h"
#include "heap.h"
#include "lifetime.h"
#include "log.h"
#include "pause.h"
#include "staging.h"
#include "stats.h"
#include "tags.h"
#include "thread_state.h"

#include <stdint.h>
#include <sys/stat.h>

#define VMM_API __attribute__((visibility("default")))

/* no_address: an out-of-memory result came from the address space budget. */
static vmm_status to_status(CUresult rc, bool no_address)
{
    switch (rc) {
    case CUDA_SUCCESS:
        return VMM_OK;
    case CUDA_ERROR_NOT_FOUND:
        return VMM_ERR_FOREIGN;
    case CUDA_ERROR_INVALID_VALUE:
        return VMM_ERR_INTERIOR;
    case CUDA_ERROR_OUT_OF_MEMORY:
        return no_address ? VMM_ERR_NO_ADDRESS : VMM_ERR_NO_MEMORY;
    case CUDA_ERROR_NOT_PERMITTED: /* the heap's answer for a paused buffer (pause.c) */
        return VMM_ERR_PAUSED;
    case CUDA_ERROR_INVALID_CONTEXT:
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
        return VMM_ERR_NO_DRIVER;
    default:
        vmh_thread.last_driver_error = (int)rc;
        return VMM_ERR_DRIVER;
    }
}

static vmm_status do_realloc(void **ptr, size_t size, void *stream, bool async)
{
    if (!ptr)
        return VMM_ERR_INVALID;
    if (!vmh_lifetime_ready())
        return VMM_ERR_NO_DRIVER;
    /* The largest size the driver could ever map once rounded to a chunk. */
    if (size > SIZE_MAX / 2)
        return VMM_ERR_SIZE;
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)*ptr;
    bool no_address = false;
    CUresult rc = vmh_heap_realloc_ex(&p, size, (CUstream)stream, async, &no_address);
    if (rc == CUDA_SUCCESS)
        *ptr = (void *)(uintptr_t)p;
    return to_status(rc, no_address);
}

VMM_API vmm_status vmm_realloc(void **ptr, size_t size)
{
    return do_realloc(ptr, size, NULL, false);
}

VMM_API vmm_status vmm_realloc_async(void **ptr, size_t size, void *stream)
{
    return do_realloc(ptr, size, stream, true);
}

VMM_API size_t vmm_usable_size(const void *ptr)
{
    vmh_buffer_info_t info;
    if (!ptr || !vmh_heap_find((CUdeviceptr)(uintptr_t)ptr, &info) ||
        info.base != (CUdeviceptr)(uintptr_t)ptr)
        return 0;
    return info.usable;
}

VMM_API int vmm_owns(const void *ptr)
{
    vmh_buffer_info_t info;
    return ptr && vmh_heap_find((CUdeviceptr)(uintptr_t)ptr, &info);
}

VMM_API size_t vmm_trim(void)
{
    return vmh_driver_loaded() ? vmh_heap_trim() : 0;
}

VMM_API int vmm_version(void)
{
    return VMM_VERSION;
}

VMM_API const char *vmm_status_string(vmm_status status)
{
    static const char *const text[VMM_STATUS_COUNT] = {
        [VMM_OK] = "success",
        [VMM_ERR_INVALID] = "invalid argument",
        [VMM_ERR_FOREIGN] = "pointer not allocated by libvmmhook (or already freed)",
        [VMM_ERR_INTERIOR] = "pointer inside a buffer, not its start",
        [VMM_ERR_NO_MEMORY] = "out of device memory",
        [VMM_ERR_NO_ADDRESS] = "out of virtual address space",
        [VMM_ERR_SIZE] = "size too large",
        [VMM_ERR_NO_DRIVER] = "no CUDA driver or context, or libvmmhook disabled",
        [VMM_ERR_DRIVER] = "CUDA driver error (see vmm_last_driver_error)",
        [VMM_ERR_PAUSED] = "the tag is paused",
        [VMM_ERR_NOT_PAUSED] = "the tag is not paused",
        [VMM_ERR_LIMIT] = "too many tags, or tags nested too deep",
        [VMM_ERR_UNKNOWN_TAG] = "no tag of that name",
        [VMM_ERR_CAPTURING] = "a CUDA stream capture is in progress",
        [VMM_ERR_SHARED] = "the buffer is shared (CUDA IPC): its memory cannot be swapped",
    };
    return (unsigned)status < VMM_STATUS_COUNT ? text[status] : "unknown status";
}

/* vmm_pause / vmm_resume: pause.c does the work; the driver's code of a VMM_ERR_DRIVER is kept
 * here with the others'. */
static vmm_status tags_status(vmm_status st, CUresult driver_rc)
{
    if (st == VMM_ERR_DRIVER)
        vmh_thread.last_driver_error = (int)driver_rc;
    return st;
}

VMM_API vmm_status vmm_pause(const char *tag, unsigned flags)
{
    if (!vmh_lifetime_ready())
        return VMM_ERR_NO_DRIVER;
    CUresult driver_rc = CUDA_ERROR_UNKNOWN;
    vmm_status st = vmh_pause_tags(tag, flags, &driver_rc);
    return tags_status(st, driver_rc);
}

VMM_API vmm_status vmm_resume_flags(const char *tag, unsigned flags)
{
    if (!vmh_lifetime_ready())
        return VMM_ERR_NO_DRIVER;
    CUresult driver_rc = CUDA_ERROR_UNKNOWN;
    vmh_heap_trim_paused(); /* carved memory freed while paused does not come back */
    vmm_status st = vmh_resume_tags(tag, flags, &driver_rc);
    return tags_status(st, driver_rc);
}

VMM_API vmm_status vmm_resume(const char *tag)
{
    return vmm_resume_flags(tag, 0);
}

/* vmm_prefetch and vmm_prefetch_tag: heap_upkeep.c moves; here the codes. */
static vmm_status prefetch_status(CUresult rc)
{
    switch (rc) {
    case CUDA_ERROR_INVALID_DEVICE:
        return VMM_ERR_INVALID;
    case CUDA_ERROR_ALREADY_MAPPED:
        return VMM_ERR_SHARED;
    default:
        return to_status(rc, false);
    }
}

VMM_API vmm_status vmm_prefetch(const void *ptr)
{
    if (!ptr)
        return VMM_ERR_INVALID;
    if (!vmh_lifetime_ready())
        return VMM_ERR_NO_DRIVER;
    size_t moved = 0;
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr;
    return prefetch_status(vmh_heap_prefetch(p, &moved));
}

VMM_API vmm_status vmm_prefetch_tag(const char *tag)
{
    if (!vmh_lifetime_ready())
        return VMM_ERR_NO_DRIVER;
    unsigned t = tag ? vmh_tag_lookup(tag) : vmh_tag_current();
    if (t == VMH_TAG_NONE)
        return VMM_ERR_UNKNOWN_TAG;
    size_t moved = 0;
    return prefetch_status(vmh_heap_prefetch_tag(t, &moved));
}

/* vmm_backup_read and vmm_backup_host: ptr inside a served buffer, with the len bytes. */
static vmm_status backup_span(const void *ptr, size_t len, CUdeviceptr *p)
{
    vmh_buffer_info_t info;
    *p = (CUdeviceptr)(uintptr_t)ptr;
    if (!vmh_heap_find(*p, &info))
        return VMM_ERR_FOREIGN;
    return len > info.base + info.size - *p ? VMM_ERR_INVALID : VMM_OK;
}

VMM_API vmm_status vmm_backup_read(const void *ptr, void *dst, size_t len)
{
    if (!ptr || (!dst && len))
        return VMM_ERR_INVALID;
    CUdeviceptr p;
    vmm_status st = backup_span(ptr, len, &p);
    if (st != VMM_OK)
        return st;
    return vmh_heap_backup_read(p, len, dst) ? VMM_OK : VMM_ERR_NOT_PAUSED;
}

VMM_API vmm_status vmm_backup_host(const void *ptr, size_t len, void **host)
{
    if (!ptr || !host)
        return VMM_ERR_INVALID;
    *host = NULL;
    CUdeviceptr p;
    vmm_status st = backup_span(ptr, len, &p);
    if (st != VMM_OK)
        return st;
    *host = (void *)vmh_heap_backup_host(p, len);
    return *host ? VMM_OK : VMM_ERR_NOT_PAUSED;
}

VMM_API vmm_status vmm_backup_dir(const char *dir)
{
    struct stat st;
    if (dir && (!*dir || stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)))
        return VMM_ERR_INVALID;
    return vmh_staging_set_dir(dir) ? VMM_OK : VMM_ERR_NO_MEMORY;
}

VMM_API size_t vmm_backup_trim(void)
{
    return vmh_lifetime_ready() ? vmh_staging_trim() : 0;
}

VMM_API int vmm_last_driver_error(void)
{
    return vmh_thread.last_driver_error;
}

/* PyTorch's CUDAPluggableAllocator ABI. PyTorch makes `device` current before it calls. */
VMM_API void *vmm_torch_alloc(size_t size, int device, void *stream)
{
    (void)stream; /* an allocation needs no ordering: nothing can use it yet */
    CUdeviceptr p = 0;
    /* PyTorch calls from threads with no current context (autograd's device threads), so the
     * device comes from the argument; segments do not grow, so no headroom is reserved. */
    if (size == 0 || !vmh_lifetime_ready() || vmh_heap_alloc_on(device, size, &p) != CUDA_SUCCESS)
        return NULL;
    return (void *)(uintptr_t)p;
}

VMM_API void vmm_torch_free(void *ptr, size_t size, int device, void *stream)
{
    (void)size;
    (void)device;
    if (ptr && vmh_lifetime_ready())
        vmh_heap_free((CUdeviceptr)(uintptr_t)ptr, (CUstream)stream, true);
}
