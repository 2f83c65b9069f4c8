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
    VMM_ERR_INVALID = 1,      /* a NULL out-pointer, or a bad argument */
    VMM_ERR_FOREIGN = 2,      /* the pointer was not allocated by this library (or was freed) */
    VMM_ERR_INTERIOR = 3,     /* the pointer lies inside a buffer but is not its start */
    VMM_ERR_NO_MEMORY = 4,    /* the device (or VMMHOOK_MEM_LIMIT) has no memory for it */
    VMM_ERR_NO_ADDRESS = 5,   /* no virtual address space could be reserved */
    VMM_ERR_SIZE = 6,         /* size overflows once rounded to the granularity */
    VMM_ERR_NO_DRIVER = 7,    /* no CUDA driver, no current context, or the library is disabled */
    VMM_ERR_DRIVER = 8,       /* the driver failed otherwise; vmm_last_driver_error() tells */
    VMM_ERR_PAUSED = 9,       /* the tag (or the buffer's tag) is paused: nothing was done */
    VMM_ERR_NOT_PAUSED = 10,  /* vmm_resume of a tag that is not paused: nothing was done */
    VMM_ERR_LIMIT = 11,       /* too many tags, or tags nested too deep */
    VMM_ERR_UNKNOWN_TAG = 12, /* no tag of that name has ever been pushed */
    VMM_ERR_CAPTURING = 13,   /* a CUDA stream capture is in progress in the process: pausing or
                                 resuming (which must wait for the device) would break it */
    VMM_ERR_SHARED = 14,      /* the buffer is shared with another process (CUDA IPC) or still
                                 mapped by a move in flight: its memory cannot be swapped */
    VMM_STATUS_COUNT
} vmm_status;

/* Calls whose status says whether anything happened (a failed realloc leaves *ptr as it was, a
 * refused pause leaves the memory mapped): the compiler warns when a caller drops it. */
#if defined(__GNUC__) || defined(__clang__)
#define VMM_NODISCARD __attribute__((warn_unused_result))
#else
#define VMM_NODISCARD
#endif

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
VMM_NODISCARD vmm_status vmm_realloc(void **ptr, size_t size);

/* Stream-ordered variant: the copy of a packed buffer that moves is enqueued on stream, and the
 * old address stays mapped until work queued before this call has completed. */
VMM_NODISCARD vmm_status vmm_realloc_async(void **ptr, size_t size, void *stream);

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

/* ---- Tags, pause and resume (docs/SLEEP.md) ----
 *
 * Every buffer the library serves belongs to a tag: the tag on top of the allocating thread's
 * tag stack when it was allocated, "default" when the stack is empty. Memory of one tag never
 * shares a physical chunk with another tag's, so a tag's memory can be given back alone. */

/* Longest tag name (bytes, without the terminating NUL), most tags in a process (including
 * "default"), and the deepest nesting of vmm_tag_push per thread. */
#define VMM_TAG_NAME_MAX 31
#define VMM_TAGS_MAX 32
#define VMM_TAG_DEPTH_MAX 16

/* Makes `name` the calling thread's current tag until the matching vmm_tag_pop. A name is
 * registered the first time it is pushed. VMM_ERR_INVALID: name NULL, empty or longer than
 * VMM_TAG_NAME_MAX; VMM_ERR_LIMIT: VMM_TAGS_MAX names exist already or the thread's stack is
 * VMM_TAG_DEPTH_MAX deep. */
VMM_NODISCARD vmm_status vmm_tag_push(const char *name);

/* Returns to the tag below. VMM_ERR_INVALID when the thread's stack is empty. */
vmm_status vmm_tag_pop(void);

/* vmm_pause flag: copy each buffer's contents to host memory first (pinned when
 * VMMHOOK_PIN_LIMIT keeps some; docs/SLEEP.md); vmm_resume writes them back. Without it the
 * contents are lost (resume gives fresh, uninitialised memory). */
#define VMM_PAUSE_BACKUP 1u
/* With VMM_PAUSE_BACKUP, where the backup lives instead of the default (at most one of them):
 * PAGEABLE: pageable host memory only, never pinned (the kernel may page it out; given back to
 * the system at the resume); DISK: one file per buffer in the directory of vmm_backup_dir,
 * mapped shared, its pages out of the process's resident memory once copied (the resume reads
 * them back; the files are removed when the backups go: at the resume, or the buffer's free). */
#define VMM_PAUSE_PAGEABLE 2u
#define VMM_PAUSE_DISK 4u

/* Gives the physical memory of every buffer of `tag` (NULL: of every tag) back to the driver
 * while keeping every address reserved: pointers stay valid as numbers, but a kernel or a copy
 * that touches a paused buffer faults (an illegal address), as it would with any unmapped
 * memory. Waits first for all work queued on the tag's devices (a context synchronize), then
 * unmaps and releases; idle cached memory is released too. While paused the tag takes no new
 * memory: allocations in it are refused (out of memory); frees of its buffers work. Buffers
 * exported to another process stay mapped (docs/SLEEP.md).
 * VMM_ERR_PAUSED: the named tag is paused already (nothing done; with NULL, paused tags are
 * skipped); VMM_ERR_UNKNOWN_TAG; VMM_ERR_INVALID: unknown flags, VMM_PAUSE_PAGEABLE or
 * VMM_PAUSE_DISK without VMM_PAUSE_BACKUP, or both; VMM_ERR_NO_MEMORY: no host memory (or file)
 * for a backup; VMM_ERR_DRIVER: a copy or the wait failed (vmm_last_driver_error() tells
 * the driver's code); VMM_ERR_CAPTURING: a stream
 * capture is in progress (nothing done). After a failure the tag is
 * running again with its contents (if even that fails, it stays paused: resume it). */
VMM_NODISCARD vmm_status vmm_pause(const char *tag, unsigned flags);

/* Maps new physical memory at exactly the addresses of the tag's paused buffers (NULL: every
 * paused tag), restores access for every device that had it (and for peers granted since),
 * and restores the contents of a VMM_PAUSE_BACKUP pause. VMM_ERR_NO_MEMORY: the device has no
 * room: nothing of the tag is left mapped, the tag stays paused with its backup, and the call
 * may be retried once memory is free. VMM_ERR_DRIVER (vmm_last_driver_error() tells) and
 * VMM_ERR_CAPTURING as for vmm_pause.
 * VMM_ERR_NOT_PAUSED: the named tag is not paused
 * (nothing done; with NULL, running tags are skipped); VMM_ERR_UNKNOWN_TAG. */
VMM_NODISCARD vmm_status vmm_resume(const char *tag);

/* vmm_resume_flags flag: each buffer's backup stays attached to it after the resume instead of
 * going back (torch_memory_saver's retain_cpu_backup): vmm_backup_read and vmm_backup_host read
 * it while the buffer runs, and the buffer's next VMM_PAUSE_BACKUP pause of the same kind writes
 * the fresh bytes into the same host memory (same address). It goes back at a later resume
 * without this flag, at a pause without a backup (or of another kind), when its buffer is freed,
 * paused or running, and may go at a pause of its tag that fails. Each buffer's kept backup is
 * its own: freeing one of the buffers packed together (docs/SLEEP.md) gives back only its own,
 * and a buffer allocated after the resume has none. vmm_realloc in place keeps it (it holds
 * the bytes as they were paused, up to the size then: bytes past it have no backup); a buffer
 * that vmm_realloc moved is a new one and has none. A VMM_PAUSE_DISK backup is never kept. */
#define VMM_RESUME_KEEP_BACKUP 1u

/* vmm_resume with flags (0 is vmm_resume). VMM_ERR_INVALID: unknown flags. */
VMM_NODISCARD vmm_status vmm_resume_flags(const char *tag, unsigned flags);

/* Copies len bytes of the host backup of a buffer, from ptr on (the start of a served buffer or
 * inside one, with the len bytes), into host memory at dst: what the device memory held when its
 * tag was last paused with VMM_PAUSE_BACKUP, while paused, or while running with the backup kept
 * (VMM_RESUME_KEEP_BACKUP) (torch_memory_saver's get_cpu_backup).
 * VMM_ERR_NOT_PAUSED: the buffer has no backup (running without a kept one, or paused without);
 * VMM_ERR_FOREIGN: ptr is not in a served buffer; VMM_ERR_INVALID: ptr NULL, dst NULL with len
 * > 0, or the bytes run past the buffer. */
VMM_NODISCARD vmm_status vmm_backup_read(const void *ptr, void *dst, size_t len);

/* The same without a copy: *host = where ptr's bytes are in the backup (torch_memory_saver's
 * get_cpu_backup(zero_copy=True)). The memory is the library's: valid until the backup goes (a
 * resume that does not keep it, a pause without one, the buffer's free), and rewritten by the
 * buffer's next backup pause. *host is NULL on failure; the codes are vmm_backup_read's
 * (VMM_ERR_INVALID also for host NULL). */
VMM_NODISCARD vmm_status vmm_backup_host(const void *ptr, size_t len, void **host);

/* The directory of VMM_PAUSE_DISK backups (NULL: none; a disk pause then fails with
 * VMM_ERR_NO_MEMORY, as when a file cannot be made). Files are named vmmhook-backup-XXXXXX.
 * VMM_ERR_INVALID: dir is empty or not a directory. */
vmm_status vmm_backup_dir(const char *dir);

/* Gives back the pinned host memory kept for later backups (docs/SLEEP.md: a resume keeps a
 * pinned backup for the next pause within VMMHOOK_PIN_LIMIT) that holds no paused tag's backup:
 * unregistered and unmapped. Returns the bytes given back. For a caller that wants the host
 * memory back after each resume (torch_memory_saver's meaning) at the price of a slower next
 * pause. */
size_t vmm_backup_trim(void);

/* With VMMHOOK_OVERFLOW=host (docs/OVERFLOW.md): moves the host memory of the spilled buffer
 * holding ptr (any address in it) back to device memory at the same address, contents kept.
 * It first waits for the device's work, like cudaFree, and the program must submit no work
 * touching the buffer until it returns. VMM_OK also when nothing had spilled; VMM_ERR_NO_MEMORY:
 * the device has no room (the buffer stays in host memory, still usable); VMM_ERR_FOREIGN: ptr
 * is not served; VMM_ERR_INVALID: ptr's device is not the current one; VMM_ERR_PAUSED;
 * VMM_ERR_SHARED. */
VMM_NODISCARD vmm_status vmm_prefetch(const void *ptr);

/* The same for every spilled buffer of `tag` (NULL: the calling thread's current tag) on the
 * current device; stops at nothing: each buffer that can move does, and the first failure is
 * returned. */
VMM_NODISCARD vmm_status vmm_prefetch_tag(const char *tag);

/* The library's statistics as one JSON object, the per-tag figures under "tags" (requested,
 * mapped, paused and backed-up bytes; pause and resume counts and total nanoseconds). Writes at
 * most len bytes including the NUL (buf may be NULL when len is 0) and returns the length the
 * whole text needs without the NUL, as snprintf does; -1 when the library is not working. */
int vmm_stats_json(char *buf, size_t len);

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
