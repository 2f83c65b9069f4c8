/* Layer "heap front": serving, freeing and finding device buffers.
 *
 * The interposed entry points (interpose.c), the public API (api.c) and IPC (ipc.c) call only
 * this; it routes to the layers below (docs/DESIGN.md): carved.c for buffers carved from shared
 * extents, ownchunk.c for buffers with chunks of their own, cache.c for idle memory, reclaim.c for
 * parked frees, device.c for each device's shape. A heap exists per device; every call works on the
 * current context's device unless it takes a pointer, whose owner names its device. Freed memory is
 * not handed out again until work queued before the free has completed.
 *
 * Its lifetime is lifetime.c's: configured once before any use, shut down at exit, switched to
 * pass-through in a forked child.
 */
#ifndef VMH_HEAP_H
#define VMH_HEAP_H

#include "device.h"
#include "handle.h"
#include "range.h"
#include "report.h"

#include <cuda.h>
#include <stdbool.h>
#include <stddef.h>

/* What the front takes from the options; lifetime.c makes it once, at start, with the settings
 * of the layers below (vmh_device_configure, vmh_cache_configure, vmh_reclaim_configure). */
typedef struct vmh_heap_settings {
    size_t pack_below;   /* VMMHOOK_PACK_BELOW: smaller requests are packed */
    bool stream_ordered; /* VMMHOOK_STREAM_ORDERED: reuse at once while one queue (contexts.h) */
    bool free_sync;      /* VMMHOOK_FREE_SYNC: every free (not async) waits like cudaFree */
} vmh_heap_settings_t;

/* Takes a copy of *s, before any allocation (tests call it again between tests). */
void vmh_heap_configure(const vmh_heap_settings_t *s);

/* Serves size bytes (size > 0) on the current context's device, 256-byte aligned. site: where
 * the program asked (the interposed entry point's return address; kept for buffers of their
 * own, for the leak report; may be NULL). CUDA_ERROR_OUT_OF_MEMORY when the device (after
 * trimming the cache) or the memory limit has no room; CUDA_ERROR_INVALID_CONTEXT without a
 * current context; CUDA_ERROR_NOT_SUPPORTED after shutdown, in a forked child, or on a device
 * without virtual memory management (the caller passes the request to the driver). */
CUresult vmh_heap_alloc_at(size_t size, void *site, CUdeviceptr *out);

static inline CUresult vmh_heap_alloc(size_t size, CUdeviceptr *out)
{
    return vmh_heap_alloc_at(size, NULL, out);
}

/* The same on a given device, whatever the calling thread's context (PyTorch's allocator
 * threads may have none): the device's primary context is used when needed. */
CUresult vmh_heap_alloc_on(int device, size_t size, CUdeviceptr *out);

/* Pitched allocation with cudaMallocPitch's rules (pitch a multiple of the texture pitch
 * alignment the device reports). Returns CUDA_ERROR_INVALID_VALUE for bad element sizes. */
CUresult vmh_heap_alloc_pitch(size_t width, size_t height, unsigned int elem, void *site,
                              CUdeviceptr *out, size_t *pitch);

/* Frees a served buffer. CUDA_ERROR_NOT_FOUND: p is not in any buffer the library serves
 * (the caller passes it to the driver; also every pointer in a forked child);
 * CUDA_ERROR_INVALID_VALUE: p is inside a served buffer but not its start. stream is recorded
 * for stream-ordered frees (async true); the memory is reused only after work queued before the
 * call has completed, in every context of the device, either way. The call does not wait for
 * that (the reclaim thread does, reclaim.h) unless VMMHOOK_FREE_SYNC is set and async false. After
 * shutdown a served pointer is accepted quietly, without a driver call (late frees from other
 * destructors). */
CUresult vmh_heap_free(CUdeviceptr p, CUstream stream, bool async);

/* The live served buffer that contains p: its base, the size asked for, the usable size and
 * the device. false when p is not in a live served buffer. Lock-free on a miss. */
bool vmh_heap_find(CUdeviceptr p, vmh_buffer_info_t *info);

/* Copies n bytes of the host backup of a served buffer (paused with one, or running with one
 * kept: pause.c), from device address p on, into dst (vmm_backup_read). false when p's buffer
 * has no backup, or the n bytes are not inside it. */
bool vmh_heap_backup_read(CUdeviceptr p, size_t n, void *dst);
/* The same without a copy: where p's bytes are in the backup (vmm_backup_host), NULL as false
 * above. Valid until the backup goes (a resume that keeps none, a free, a pause without one). */
const void *vmh_heap_backup_host(CUdeviceptr p, size_t n);

/* True when p lies in address space the library holds, live or idle (a freed buffer kept for
 * reuse is still mapped: the driver would answer for it, a native allocator would not). */
bool vmh_heap_holds(CUdeviceptr p);

/* Realloc semantics of include/vmmhook.h on a served buffer (or NULL). stream NULL: the legacy
 * default stream. CUDA_ERROR_NOT_FOUND: *p is not a live served buffer (foreign or freed);
 * INVALID_VALUE: inside one but not its start. *no_address (may be NULL) is set when an
 * out-of-memory result came from the address space budget, not from memory. */
CUresult vmh_heap_realloc_ex(CUdeviceptr *p, size_t size, CUstream stream, bool async,
                             bool *no_address);

static inline CUresult vmh_heap_realloc(CUdeviceptr *p, size_t size, CUstream stream, bool async)
{
    return vmh_heap_realloc_ex(p, size, stream, async, NULL);
}

/* Sharing with other processes (ipc.c): the chunks behind the live served buffer that contains
 * p, each with a reference the caller drops with vmh_heap_export_release(), and the export's
 * serial: the same for every export of the buffer until it is freed. Once freed, an exported
 * buffer's memory is never served again (natively, memory freed by its exporter stays an
 * importer's): an own-chunk buffer's range is destroyed once queued work is done, a carved buffer's
 * extent serves nothing more and goes when its other blocks are freed (carved.h). The
 * library then holds nothing of it; the driver keeps the chunks while an importer holds them.
 * CUDA_ERROR_NOT_FOUND when p is not served. */
CUresult vmh_heap_export(CUdeviceptr p, vmh_export_t *out);
void vmh_heap_export_release(vmh_export_t *ex);

/* Whether the export (base, serial) is still alive: the buffer exported at base has not been
 * freed since (a later buffer at the same address has another serial). The IPC layer checks it
 * before it lets a process import, and to drop exports whose buffers are gone. Takes the
 * owner's lock only: cheap, no driver call. */
bool vmh_heap_export_alive(CUdeviceptr base, uint64_t serial);

/* Several devices: from now on device `peer` may (grant) or may not read and write every
 * buffer of device `owner`, existing and future, as cuCtxEnablePeerAccess makes native memory
 * reachable (handle.c applies it). */
CUresult vmh_heap_set_peer_access(int owner, int peer, bool grant);

/* The peers granted chunks of `device` (its record's part, handle.h), for a chunk made outside
 * the heap on that device (an IPC import): NULL for a device past the table or without host
 * memory for its record. */
const vmh_grants_t *vmh_heap_grants(int device);

/* The program's primary context of `device` as the interposer saw it retained (a release or a
 * reset names the device, not the context): kept in the device's record; NULL when none was
 * seen (or the device is past the table). */
void vmh_heap_primary_retained(int device, CUcontext ctx);
CUcontext vmh_heap_primary(int device);

/* A function run when an allocation fails for want of memory, before the cache is trimmed and
 * the allocation retried (ipc.c drops the references of exports whose buffers were freed);
 * true when it let go of anything (the driver may have memory again: worth one more try). */
typedef bool (*vmh_pressure_fn)(void);
void vmh_heap_on_pressure(vmh_pressure_fn fn);

/* Releases parked frees (waiting for every context of the device, unless the calling thread
 * may not synchronize now: a stream capture, reclaim.h) and idle cached memory of every device;
 * returns the bytes given back. The interposer calls it when another allocator of the process
 * ran out of memory, then retries that call once. */
size_t vmh_heap_trim(void);

/* Moves spilled memory (VMMHOOK_OVERFLOW=host) back to the device at the same addresses: the
 * buffer holding p, or every spilled buffer of a tag on the current device (vmm_prefetch,
 * vmm_prefetch_tag). Waits for the device's work first (the program submits none touching
 * them meanwhile: its contract, as for a free), and gives idle memory back to make room.
 * *moved: the bytes moved. CUDA_ERROR_NOT_FOUND: p is not served; INVALID_DEVICE: p's device
 * is not the current one; OUT_OF_MEMORY: no room (the buffer stays where it is);
 * NOT_PERMITTED: paused; ALREADY_MAPPED: shared (CUDA IPC). Carved buffers never spill:
 * success. */
CUresult vmh_heap_prefetch(CUdeviceptr p, size_t *moved);
CUresult vmh_heap_prefetch_tag(unsigned tag, size_t *moved);

/* Gives back the address space of shared extents whose every block was freed while their tag was
 * paused (they hold no memory: no wait, no unmap), so that a resume does not map them again. */
void vmh_heap_trim_paused(void);

/* Idle bytes held for reuse on a device, reported as free by cuMemGetInfo: only what an
 * allocation would actually get, whatever its size: cached and parked buffers of their own
 * (whole ranges) and shared extents with no live block (a trim gives them back). Free space
 * beside live blocks in a shared extent is not counted. */
size_t vmh_heap_idle_bytes(int device);
/* What the program may count as free on a device beside the driver's free memory, reported by
 * cuMemGetInfo: the idle bytes above, plus the whole free chunks inside shared extents that
 * hold live blocks, which the relieve before an out-of-memory answer unmaps (heap_upkeep.c).
 * Walks the extents under their locks: for cuMemGetInfo and the spill decision, not the tidy. */
size_t vmh_heap_reclaimable_bytes(int device);

/* The statistics' per-device part (report.h, vmh_stats_set_device_report): per device with a
 * heap, the host bytes serving it and its spills, small ones apart (VMMHOOK_OVERFLOW=host). */
void vmh_heap_stats_devices(vmh_jbuf_t *b);

/* Exit (lifetime.c's destructor, once, after the phase became EXITED, phase.h): stops the
 * reclaim thread (when the exit handler has not) and reports leaks when report_leaks. From
 * EXITED on the heap serves nothing more and forgets late frees without calling the driver
 * (the driver may already be gone); in a forked child (phase CHILD) every entry point passes
 * through, without taking any lock (another thread of the parent may have held one at the
 * fork) and without a driver call. Entry points stay safe in both. */
void vmh_heap_shutdown(bool report_leaks);

/* Tests: destroys every buffer and cache of every device through the driver (so that the
 * simulated driver's ledger can be checked empty; the tests' reset then sets the phase back to
 * RUNNING, vmh_phase_reset, to serve again). */
void vmh_heap_reset(void);

/* The background tidy's pace (heap_upkeep.c): at most one tidy every VMH_TIDY_EVERY_NS, and a
 * window of the recent peak every VMH_TIDY_WINDOW_NS (tools/probe/trace_sim replays the tidy at
 * this pace in a trace's own time). */
#define VMH_TIDY_WINDOW_NS 1000000000ull
#define VMH_TIDY_EVERY_NS 50000000ull

#ifdef VMH_TESTING
/* Tests: the carved shard the calling thread allocates in (picked on the first call). */
unsigned vmh_heap_thread_shard(void);
/* Tests: runs the device's background tidy now (heap_upkeep.c: what the reclaim thread runs), as if
 * its pace had allowed it and, when new_window, a window of the recent peak had ended. */
void vmh_heap_tidy_now(int device, bool new_window);
/* Tests: called in vmh_heap_trim after its wait and before it gives memory back, the window in
 * which another thread's free released at once lands after the wait. NULL: nothing. */
extern void (*vmh_heap_test_after_drain)(void);
/* Tests: called in the tidy between its first read of the live bytes and its read of the idle
 * ones, the window in which the program's frees and allocations move bytes between the two. */
extern void (*vmh_heap_test_in_tidy_reads)(void);
/* Tests: the host bytes serving the device now (overflow.h), 0 before its first use. */
size_t vmh_heap_spilled_bytes(int device);
#endif

/* Tags (pause.c): one device's parts of one tag. false when the device has none of its memory
 * (or the heap is not running). The parts live as long as the heap. */
struct vmh_reclaim;
struct vmh_overflow_dev;
typedef struct vmh_tag_parts {
    vmh_dev_t *dev;
    struct vmh_reclaim *reclaim;
    struct vmh_overflow_dev *overflow; /* where a resume finds host memory (overflow.h) */
} vmh_tag_parts_t;
bool vmh_heap_tag_parts(int device, unsigned tag, vmh_tag_parts_t *out);

/* The one way to the memory of a tag on a device (pause, resume, their statistics): fn on every
 * run of adjacent records (range.h's vmh_visit_runs), own-chunk buffers first, then each carved
 * shard's extents, under each set's lock. A run never crosses two sets: a set's lock is held
 * for its runs only, and records of two sets are in different reservations (the runs' unmaps
 * and access calls stay inside one: handle.h). Stops at the first failure and returns it;
 * CUDA_SUCCESS when the device has none of the tag's memory. */
CUresult vmh_heap_visit_tag(int device, unsigned tag, vmh_visit_run_fn fn, void *arg);

/* Freezes (no buffer served) or thaws the tag's parts on every device, and every part made
 * for the tag from now on starts as the tag's state says (tags.h). */
void vmh_heap_tag_freeze(unsigned tag, bool frozen);

#endif
