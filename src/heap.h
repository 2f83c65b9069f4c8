/* Layers 4 and 5 seen from above: serving, freeing and finding device buffers.
 *
 * The interposed entry points (interpose.c) and the public API (api.c) call only this. A heap
 * exists per device; every call works on the current context's device unless it takes a
 * pointer, whose owner names its device. Buffers of at least VMMHOOK_PACK_BELOW bytes own a
 * range of whole chunks (see range.h); smaller ones are packed into shared chunks (arena.h).
 * Freed memory is not handed out again until work queued before the free has completed: frees
 * are parked, and one context synchronize releases every parked free of a device at once.
 */
#ifndef VMH_HEAP_H
#define VMH_HEAP_H

#include <cuda.h>
#include <stdbool.h>
#include <stddef.h>

/* Loads the options (once) and the driver; false when the library is disabled, shut down, or
 * no driver can be loaded: every entry point then passes through. Call before anything else. */
bool vmh_heap_ready(void);

/* Where the allocation being served was asked for (the return address of the interposed entry
 * point), for the leak report; set by the interposer, kept for buffers of their own (packed
 * buffers have no room for it). */
extern _Thread_local void *vmh_alloc_site __attribute__((tls_model("initial-exec")));

/* Serves size bytes (size > 0) on the current context's device, 256-byte aligned.
 * CUDA_ERROR_OUT_OF_MEMORY when the device (after trimming the cache) or the memory limit has
 * no room; CUDA_ERROR_INVALID_CONTEXT without a current context; CUDA_ERROR_NOT_SUPPORTED after shutdown
 * or on a device without virtual memory management (the caller passes the request to the
 * driver). */
CUresult vmh_heap_alloc(size_t size, CUdeviceptr *out);

/* The same on a given device, whatever the calling thread's context (PyTorch's allocator
 * threads may have none): the device's primary context is used when needed. */
CUresult vmh_heap_alloc_on(int device, size_t size, CUdeviceptr *out);

/* Pitched allocation with cudaMallocPitch's rules (pitch a multiple of the texture pitch
 * alignment the device reports). Returns CUDA_ERROR_INVALID_VALUE for bad element sizes. */
CUresult vmh_heap_alloc_pitch(size_t width, size_t height, unsigned int elem, CUdeviceptr *out,
                              size_t *pitch);

/* Frees a served buffer. CUDA_ERROR_NOT_FOUND: p is not in any buffer the library serves
 * (the caller passes it to the driver); CUDA_ERROR_INVALID_VALUE: p is inside a served buffer
 * but not its start. stream is recorded for stream-ordered frees (async true); the memory is
 * reused only after work queued before the call has completed either way. */
CUresult vmh_heap_free(CUdeviceptr p, CUstream stream, bool async);

/* The live served buffer that contains p: its base, the size asked for, the usable size and
 * the device. false when p is not in a live served buffer. Lock-free on a miss. */
typedef struct vmh_buffer_info {
    CUdeviceptr base;
    size_t size;    /* the size the program asked for (what native range queries answer) */
    size_t usable;  /* bytes usable without moving */
    int device;
    bool packed;    /* lives in a shared chunk */
} vmh_buffer_info_t;
bool vmh_heap_find(CUdeviceptr p, vmh_buffer_info_t *info);

/* True when p lies in address space the library holds, live or idle (a freed buffer kept for
 * reuse is still mapped: the driver would answer for it, a native allocator would not). */
bool vmh_heap_holds(CUdeviceptr p);

/* Realloc semantics of include/vmmhook.h on a served buffer (or NULL). stream NULL: the legacy
 * default stream. */
CUresult vmh_heap_realloc(CUdeviceptr *p, size_t size, CUstream stream, bool async);

/* Sharing with other processes (ipc.c): the chunks behind the live served buffer that contains
 * p, each with a reference the caller drops with vmh_heap_export_release(). The buffer is
 * marked exported: once freed, its chunks (or its packed slot) are never handed out again, so
 * an importer keeps seeing the memory it mapped. offset is where the buffer starts in the
 * first chunk (non-zero for a packed buffer). CUDA_ERROR_NOT_FOUND when p is not served. */
#include "handle.h"
typedef struct vmh_export {
    CUdeviceptr base;
    size_t size;
    size_t offset;
    int device;
    size_t nchunks;
    vmh_alloc_t **chunks;
} vmh_export_t;
CUresult vmh_heap_export(CUdeviceptr p, vmh_export_t *out);
void vmh_heap_export_release(vmh_export_t *ex);

/* Several devices: from now on device `peer` may (grant) or may not read and write every
 * buffer of device `owner`, existing and future, as cuCtxEnablePeerAccess makes native memory
 * reachable. */
CUresult vmh_heap_set_peer_access(int owner, int peer, bool grant);

/* A function run when an allocation fails for want of memory, before the cache is trimmed and
 * the allocation retried (ipc.c drops the references of exports whose buffers were freed). */
typedef void (*vmh_pressure_fn)(void);
void vmh_heap_on_pressure(vmh_pressure_fn fn);

/* Releases idle cached memory of every device; returns the bytes given back. */
size_t vmh_heap_trim(void);

/* Idle bytes held for reuse on a device (reported as free by cuMemGetInfo). */
size_t vmh_heap_idle_bytes(int device);

/* Exit: reports leaks when asked, then forgets everything without calling the driver (the
 * driver may already be gone). Entry points stay safe afterwards and pass through. */
void vmh_heap_shutdown(void);

/* Tests: destroys every buffer and cache of every device through the driver (so that the
 * simulated driver's ledger can be checked empty). */
void vmh_heap_reset(void);

#ifdef VMH_TESTING
/* Tests: the packing shard the calling thread allocates in (picked on the first call). */
unsigned vmh_heap_thread_shard(void);
#endif

#endif
