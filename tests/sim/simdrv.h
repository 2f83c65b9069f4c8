/* simdrv: a strict simulated CUDA driver for the unit and interposition tests.
 *
 * Two forms, one source:
 *   - static library (sim_dep): sim_table() gives a vmh_driver_t for vmh_driver_install();
 *   - fake libcuda.so.1 (fake_libcuda, in fake_libcuda_dir): exports the real driver's symbol
 *     names (cuInit, cuGetProcAddress, cuGetProcAddress_v2, cuMemAlloc_v2, the _ptds/_ptsz
 *     variants, cuCtxGetDevice_v2, cuCtxSynchronize_v2 ...) and every sim_* function below
 *     (dlsym them). It initialises itself on the first cuInit, tuned by SIM_DEVICES,
 *     SIM_MEMORY, SIM_HOST_MEMORY, SIM_GRANULARITY, SIM_VA_SIZE (sizes take K/M/G/T
 *     suffixes); SIM_VERBOSE=1
 *     logs every rejection to stderr. SIM_PERTURB=<seed> (both forms of the driver, read at
 *     the first call) perturbs the schedule: each call first yields or sleeps a random few
 *     microseconds (simcall.c, sim_perturb; tools/run-tests --stress sets it). There cuInit makes no
 *     context current (cudart does that itself: cuDevicePrimaryCtxRetain + cuCtxSetCurrent).
 *     It is linked -Bsymbolic: cuGetProcAddress answers and sim_table() stay the fake's own
 *     functions even when a preloaded library defines the same names. fakecuda_smoke.c shows
 *     the cudart-style loading (dlopen, dlsym cuGetProcAddress_v2, the rest through it).
 *
 * WHAT IS SIMULATED (codes as the H200 / CUDA 13 driver answers, see driver-facts.md):
 *   - init: every entry point but cuInit, cuDriverGetVersion and cuGetProcAddress* answers
 *     CUDA_ERROR_NOT_INITIALIZED before sim_reset() / cuInit (the real driver's answer before
 *     cuInit). sim_reset() initialises and makes device 0's primary context current on the
 *     calling thread only (config.no_current_context skips that); other threads start with no
 *     context. Calls that need a context (cuMemAlloc*, cuMemFree*, cuMemGetInfo,
 *     cuMemGetAddressRange, cuMemcpy*, cuCtxSynchronize, cuStreamSynchronize, cuCtxGetDevice,
 *     the _v2 of these two given NULL, cuIpc*, cuCtxEnable/DisablePeerAccess, sim_read/write/
 *     memset) answer CUDA_ERROR_INVALID_CONTEXT without one. The VMM calls do not need a
 *     context (as real).
 *   - contexts: one primary context per device and any number made by cuCtxCreate (_v4 with
 *     CUctxCreateParams, which cuda.h maps the plain name to; _v2 and _v3 exported too and answered
 *     by cuGetProcAddress("cuCtxCreate") below 11040 / 12050; execution affinity and CIG ->
 *     NOT_SUPPORTED), which pushes the new context on the calling thread. A per-thread context
 *     stack (Push/Pop/GetCurrent/SetCurrent), peer access recorded per device pair. cuCtxDestroy:
 *     NULL -> INVALID_VALUE, a primary or unknown or destroyed context -> INVALID_CONTEXT; it
 *     lands the context's work, frees its native blocks and streams, pops it from the calling
 *     thread; a thread that still has it current gets CUDA_ERROR_CONTEXT_IS_DESTROYED from every
 *     call needing a context. cuDevicePrimaryCtxRelease of the last reference and
 *     cuDevicePrimaryCtxReset reset the primary context the same way (its handle stays valid).
 *   - work in flight per context (simwork.c): async copies and sim_launch_write "kernels" land
 *     at their context's next synchronization only (see below, "asynchrony").
 *   - stream capture (simctx.c): cuStreamBeginCapture_v2 on a created stream (NULL / legacy ->
 *     STREAM_CAPTURE_UNSUPPORTED; the per-thread default stream -> NOT_SUPPORTED, not simulated;
 *     twice -> ILLEGAL_STATE), modes GLOBAL / THREAD_LOCAL / RELAXED and the per-thread
 *     interaction mode (cuThreadExchangeStreamCaptureMode, default GLOBAL). A potentially
 *     unsafe call made by a thread the documented rule prohibits (its own capture not begun
 *     RELAXED; or, in GLOBAL interaction mode, another thread's GLOBAL capture; never in RELAXED
 *     interaction mode) answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, does nothing, and
 *     invalidates those captures: cuStreamEndCapture then answers
 *     CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (graph NULL). The unsafe calls here:
 *     cuCtxSynchronize[_v2], cuStreamSynchronize of a default stream, cuMemAlloc,
 *     cuMemAllocPitch, cuMemAllocManaged, cuMemFree (also of 0), cuMemFreeHost, the synchronous
 *     cuMemcpyDtoD/HtoD/DtoH. What necessarily conflicts with a capture is refused in every
 *     mode, RELAXED included, and invalidates the captures met (the programming guide's
 *     prohibited operations): cuStreamSynchronize / cuStreamQuery of a capturing stream and
 *     cuCtxSynchronize[_v2] of a context with a capturing stream (STREAM_CAPTURE_UNSUPPORTED;
 *     on the H200 the hook's cuCtxSynchronize under PyTorch's relaxed-mode cudaMalloc
 *     invalidated its capture, issue 14); any use of the legacy stream (NULL or
 *     CU_STREAM_LEGACY: the synchronous copies and cuMemsetD8, its synchronization or query,
 *     async copies, stream-ordered allocations and frees, sim_launch_write on it) while a
 *     blocking stream of that context captures (STREAM_CAPTURE_IMPLICIT; cuStreamIsCapturing
 *     of it answers that code too). VMM calls, host registration, work on other streams are
 *     never refused. Work issued to a capturing
 *     stream (async copies, cuMemFreeAsync, sim_launch_write) is recorded, not run; graphs are
 *     only made (cuStreamEndCapture) and destroyed (cuGraphDestroy, unknown -> INVALID_VALUE).
 *     cuStreamEndCapture from another thread than the one that began a non-RELAXED capture ->
 *     STREAM_CAPTURE_WRONG_THREAD; of a stream not capturing -> ILLEGAL_STATE. Assumed where
 *     the documentation is silent (re-measure on a GPU): the error codes of the legacy-stream
 *     begin, of cuCtxDestroy(primary) and of the two conflicts above; that synchronizing
 *     another, non-capturing named stream is allowed; that cuMemFree and cuMemFreeHost follow
 *     the interaction-mode rule only (no context-wide conflict).
 *   - per-thread default stream: the fake libcuda exports the _ptsz/_ptds variants as functions
 *     of their own (counted under the plain name) and cuGetProcAddress answers them for
 *     CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: a NULL stream there is the thread's
 *     per-thread stream (CU_STREAM_PER_THREAD), and the synchronous _ptds copies do not use the
 *     legacy stream. CU_STREAM_PER_THREAD is otherwise the context's default stream (its
 *     synchronization lands the whole context's work; it cannot be captured here). The static
 *     form's table (sim_table) is the legacy-stream ABI.
 *   - fork: pthread_atfork gives the child a fresh lock (never a hang). In strict mode
 *     (sim_set_fork_strict(true), or SIM_FORK_STRICT=1 read at the first cuInit), in a child of
 *     a process that had initialized, every entry point except cuDriverGetVersion,
 *     cuGetProcAddress* and cuGetError* answers CUDA_ERROR_NOT_INITIALIZED at once (cuInit too):
 *     CUDA is not usable after fork and the real driver answers an error instead of blocking
 *     (driver-facts.md section 5; the exact code is assumed). Not strict (the default, for the
 *     IPC tests that use children as other processes): the child goes on with a copy of the
 *     parent's state. sim_reset in the child starts afresh.
 *   - the CUDA 13 context-taking ABIs: cuda.h declares cuCtxGetDevice(CUdevice *) and
 *     cuCtxSynchronize(void) with no versioning macro, and beside them cuCtxGetDevice_v2(CUdevice
 *     *, CUcontext) and cuCtxSynchronize_v2(CUcontext) (PFN_..._v13000). As on the H200 (driver
 *     580), cuGetProcAddress("cuCtxGetDevice" / "cuCtxSynchronize") answers the _v2 function for
 *     cudaVersion >= 13000 and the plain one below (2000 .. 12090), for every flag set; the _v2
 *     names are not cuGetProcAddress symbols (NOT_FOUND, it takes base names) but are exported
 *     for dlsym. The _v2 take ctx NULL as the current context (INVALID_CONTEXT when none) and
 *     otherwise only an exact context (any thread's, current or not); any other value, such as
 *     the stray register a caller of the plain ABI passes, is CUDA_ERROR_INVALID_CONTEXT and
 *     does nothing, so a wrong-ABI caller fails loudly. Counted and fault-injectable under
 *     their own names ("cuCtxGetDevice_v2", "cuCtxSynchronize_v2"), apart from the plain ones.
 *     No other entry point the simulation implements has this pattern in the CUDA 13.0 headers
 *     (cuStreamGetCtx / _v2 at 12050 has it, and cuGraphInstantiate's PFN is not the ABI its
 *     macro declares, but the simulation implements neither).
 *   - VMM: allocations (granularity multiple, PINNED, DEVICE / HOST / HOST_NUMA, handle types
 *     NONE|POSIX_FD; FABRIC -> 800, WIN32 -> 801), charged to the device, or for a host
 *     location to the host's own limit (config.host_memory; OUT_OF_MEMORY past it: the real
 *     driver pins such memory at creation); handles are never
 *     reused (a double release is CUDA_ERROR_INVALID_VALUE); an allocation's memory goes when
 *     no handle and no mapping is left. Reservations in a fake VA region (default 64 TiB from
 *     0x100000000000; hint granted when free and inside the region, sim_refuse_hints() turns
 *     that off; reservations without hint are placed next-fit with a 1 GiB gap after the last
 *     one, so that an adjacent hint is usually granted, then first-fit when the region is
 *     full; CUDA_ERROR_OUT_OF_MEMORY when nothing fits). Mappings: whole allocation only
 *     (partial -> 801), inside one reservation, no overlap. Unmap: whole adjacent mappings, no
 *     holes. Access: per granule and per device; a new mapping has none.
 *     Export/import: POSIX_FD gives a real memfd; importing it in this process gives a new
 *     handle (a new reference) to the same allocation, which keeps it alive (memory and
 *     contents) after the exporter released its own handle and mappings, as the real driver
 *     does. An exported fd still open in this process keeps the allocation alive too (so it
 *     can be imported after the exporter's release); once every such fd is closed the
 *     allocation goes at the next cuMemCreate or ledger query. An fd of an allocation that is
 *     gone (or a memfd this process did not export) answers CUDA_ERROR_INVALID_VALUE.
 *   - native allocator: cuMemAlloc (512-byte aligned, 2 MiB aligned from 2 MiB; charged
 *     rounded up to 512), cuMemAllocPitch (elementSize 4/8/16; pitch = width rounded up to 512:
 *     width 1000 -> 1024 as measured; range = pitch * height), cuMemAllocAsync and
 *     cuMemAllocFromPoolAsync (pool NULL -> INVALID_VALUE, any other value is taken as a pool:
 *     pools are not simulated), cuMemAllocManaged (flags GLOBAL or HOST; charged to the current
 *     device like cuMemAlloc so that a test can exhaust it; IS_MANAGED answers 1), cuMemFree (0 ->
 *     success; unknown, interior, freed or VMM pointer -> INVALID_VALUE; lands the work of the
 *     calling thread's context and of the block's context first), cuMemFreeAsync (lands its
 *     stream's work). Every block belongs to the context it was allocated in and goes with it.
 *     Native memory lives in its own fake VA region (0x500000000000) and shares the device
 *     capacity with VMM memory.
 *   - pinned host memory (simhost.c): cuMemHostAlloc (real, zeroed host memory; flags PORTABLE|
 *     DEVICEMAP|WRITECOMBINED; size 0 -> INVALID_VALUE), cuMemFreeHost (only such a pointer,
 *     else INVALID_VALUE), cuMemHostRegister_v2 (flags PORTABLE|DEVICEMAP|IOMEMORY|READ_ONLY;
 *     overlap -> HOST_MEMORY_ALREADY_REGISTERED), cuMemHostUnregister (only the start of a
 *     registered range, else HOST_MEMORY_NOT_REGISTERED). Both kinds are in the ledger.
 *   - queries: cuMemGetAddressRange answers a native block exactly (base, requested size) and
 *     for VMM the one mapping holding the pointer; an unknown pointer is CUDA_ERROR_NOT_FOUND
 *     (500, as the real driver answers; cuda.h lists it). cuPointerGetAttribute: RANGE_* answer
 *     the reservation for VMM and the block for native; MAPPING_* the mapping; unknown pointer
 *     -> CUDA_ERROR_INVALID_VALUE (documented); a reserved unmapped address answers MAPPED = 0
 *     and INVALID_VALUE for the rest. cuPointerGetAttributes never fails on a pointer: unknown
 *     ones get zeroes (documented). Boolean, MEMORY_TYPE, DEVICE_ORDINAL, ACCESS_FLAGS and
 *     ALLOWED_HANDLE_TYPES results are written as 4 bytes, ids as 8, pointers and sizes as 8.
 *     cuIpcGetMemHandle: native -> handle; VMM or unknown -> INVALID_VALUE. Opening a handle of
 *     this same process -> CUDA_ERROR_INVALID_CONTEXT (as the real driver).
 *   - contents: every allocation keeps its bytes (host memory mapped lazily on first write;
 *     never-written memory reads as zeroes). sim_read/sim_write/sim_memset and the copies go
 *     through the mappings: CUDA_ERROR_ILLEGAL_ADDRESS when a byte is unmapped or the current
 *     device lacks the access (native blocks are reachable from every device, as through UVA).
 *   - asynchrony: cuMemcpyDtoDAsync, cuMemcpyHtoDAsync_v2 (pageable source: staged at the call;
 *     pinned: read when it runs), cuMemcpyDtoHAsync_v2 (pinned destination: written when it
 *     runs; pageable: done before returning) and sim_launch_write are queued with their context
 *     and stream, and run in order when THAT context is synchronized: cuCtxSynchronize with it
 *     current, cuCtxSynchronize_v2(it), cuStreamSynchronize / cuStreamQuery of its stream (of a
 *     default stream: the whole context), the synchronous copies, cuMemsetD8 and sim_read/
 *     sim_write/sim_memset in it, cuMemFree there, its destruction or reset, sim_flush (all).
 *     Another context's synchronization never runs them. Work whose memory is unmapped or
 *     inaccessible when it runs, and unmapping, freeing or releasing memory (device or pinned
 *     host) that queued work touches, count as hazards (sim_hazards()); the real driver does not
 *     fail then, the program is just wrong. Synchronizations are counted per context
 *     (sim_sync_count).
 *   - bookkeeping for tests: call counts, fault injection, trace, ledger, hazards.
 * NOT SIMULATED: real kernels (sim_launch_write stands for one), events, graph launch, memory
 *   pools (the stream-ordered allocators give plain native blocks), managed memory migration,
 *   capture of the per-thread default stream, the v1 (32-bit) entry points (cuGetProcAddress
 *   for a version below a symbol's _v2 answers NOT_FOUND with VERSION_NOT_SUFFICIENT; dlsym of
 *   the plain legacy names such as "cuMemAlloc" finds nothing; cuCtxGetDevice and
 *   cuCtxSynchronize are no such case: their plain ABI is the current one below 13000), sticky
 *   errors after ILLEGAL_ADDRESS, IPC across processes, multicast and fabric handles.
 *
 * Thread-safe throughout (one mutex). Every function of SIM_FUNCS (simint.h: the library's
 * table and the extra exports) counts as an entry point, and so does cuGetProcAddress*; a call
 * that fails by injection changes nothing and writes no output. The sim_* functions below are
 * the test API (not entry points: not counted, never failed by injection).
 */
#ifndef SIMDRV_H
#define SIMDRV_H

#include <cuda.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "driver.h"

#define SIM_MAX_DEVICES 16
#define SIM_VA_GAP_NONE ((size_t)-1)

/* Zero fields mean the default. */
typedef struct sim_config {
    int devices;          /* default 1 (at most SIM_MAX_DEVICES) */
    size_t memory;        /* bytes per device, default 80 GiB */
    size_t host_memory;   /* bytes of host-located VMM allocations (cuMemCreate with a HOST
                             location), default 256 GiB; SIM_HOST_MEMORY */
    size_t granularity;   /* minimum granularity (power of two), default 2 MiB */
    size_t recommended;   /* recommended granularity, default = granularity */
    size_t va_size;       /* bytes of address space for reservations, default 64 TiB */
    size_t va_gap;        /* gap left after an unhinted reservation, default 1 GiB;
                             SIM_VA_GAP_NONE for none */
    bool no_peer_access;  /* cuDeviceCanAccessPeer answers 0; access across devices refused */
    bool no_current_context; /* sim_reset leaves the calling thread without a context */
} sim_config_t;

/* The driver table (every entry counted and fault-injectable). */
const vmh_driver_t *sim_table(void);

/* Wipes everything (ledger, faults, counters, trace, hazards, contexts) and initialises with
 * cfg (NULL: defaults). Memory mapped for contents is returned to the system. */
void sim_reset(const sim_config_t *cfg);
sim_config_t sim_get_config(void);

/* Contexts. dev < 0 leaves this thread with no context; an invalid dev aborts. */
void sim_set_current_device(int dev);
int sim_current_device(void); /* -1 when none (or the current context was destroyed) */
CUcontext sim_primary_context(int dev); /* aborts on an invalid dev */
/* cuCtxSynchronize[_v2] and cuStreamSynchronize calls that waited on ctx (NULL: on any context)
 * since sim_reset; refused ones do not count. */
unsigned long sim_sync_count(CUcontext ctx);
/* Calls refused because of a capture since sim_reset (STREAM_CAPTURE_UNSUPPORTED by the
 * interaction-mode rule or a conflict, STREAM_CAPTURE_IMPLICIT). */
unsigned long sim_capture_refusals(void);
/* Strict fork mode (see "fork" above); kept across sim_reset. */
void sim_set_fork_strict(bool strict);
/* Whether this process is a child that answers NOT_INITIALIZED (strict mode). */
bool sim_in_forked_child(void);

/* A "kernel" in ctx (NULL: the current context) on stream (NULL / legacy: ctx's default
 * stream; otherwise a stream of ctx, else INVALID_HANDLE) that writes n bytes of value byte at
 * p when it runs: at ctx's next synchronization (not another context's). Addresses are checked
 * only then (a hazard when unmapped or inaccessible to ctx's device). On a capturing stream it is
 * recorded into the capture and never runs; on the legacy stream while a blocking stream of ctx
 * captures it answers STREAM_CAPTURE_IMPLICIT, as a launch would. */
CUresult sim_launch_write(CUcontext ctx, CUstream stream, CUdeviceptr p, size_t n, int byte);

/* Switches. */
void sim_refuse_hints(bool refuse);
void sim_set_verbose(bool verbose);      /* log every rejection to stderr */
const char *sim_last_reason(void);       /* this thread's last rejection, "" if none */

/* Contents through the mappings, with the current device's access; like a synchronous copy,
 * they land the calling thread's context's work first (only that context's). */
CUresult sim_write(CUdeviceptr dst, const void *src, size_t n);
CUresult sim_read(void *dst, CUdeviceptr src, size_t n);
CUresult sim_memset(CUdeviceptr dst, int value, size_t n);
void sim_flush(void);                    /* lands every context's queued work */
size_t sim_pending_ops(void);
size_t sim_pending_ops_ctx(CUcontext ctx); /* queued operations of one context */
unsigned long sim_hazards(void);         /* queued work whose memory went (see asynchrony) */

/* Ledger. */
size_t sim_live_allocations(void);       /* cuMemCreate chunks not yet gone */
size_t sim_live_handles(void);           /* handles not yet released */
size_t sim_live_reservations(void);
size_t sim_live_mappings(void);
size_t sim_live_native(void);            /* cuMemAlloc* blocks not yet freed */
size_t sim_live_streams(void);           /* cuStreamCreate streams (not in the ledger check) */
size_t sim_live_contexts(void);          /* cuCtxCreate contexts not destroyed (not in it) */
size_t sim_live_graphs(void);            /* graphs not destroyed (not in it) */
size_t sim_live_host(void);              /* pinned host ranges (in the ledger check) */
size_t sim_host_pinned_bytes(void);      /* bytes of them */
bool sim_ledger_empty(void);             /* no allocation, reservation, mapping, native,
                                            pinned host range */
void sim_ledger_dump(void);              /* prints what is left to stderr */
void sim_ledger_fdump(FILE *out);
bool sim_is_mapped(CUdeviceptr p);
bool sim_is_reserved(CUdeviceptr p);
/* Bytes of [p, p + n) covered by mappings (0: the range holds no mapping at all; for checking
 * that a paused range was unmapped, and a resumed one mapped throughout). */
size_t sim_range_mapped_bytes(CUdeviceptr p, size_t n);
unsigned sim_access_flags(CUdeviceptr p, int device); /* CU_MEM_ACCESS_FLAGS_PROT_* */
size_t sim_device_used(int device);      /* bytes charged on the device */
size_t sim_host_used(void);              /* bytes of host-located VMM allocations */
size_t sim_device_capacity(int device);
size_t sim_reserved_bytes(void);         /* address space held by reservations */

/* Counting (since sim_reset or sim_reset_counters). */
unsigned long sim_call_count(void);
unsigned long sim_calls(const char *name); /* plain cuda.h name, e.g. "cuMemMap" (but
                                              "cuCtxGetDevice_v2" / "cuCtxSynchronize_v2" for
                                              those); aborts on an unknown name */
void sim_reset_counters(void);

/* Fault injection. nth counts from 1 (0 is taken as 1): the nth call from now fails with code
 * and does nothing. sim_fail_call counts every entry point; sim_fail_function only calls of
 * name (aborts on an unknown name); the _repeat form fails `times` consecutive calls of name
 * from the nth on (times 0: every one from then on). */
void sim_fail_call(unsigned long nth, CUresult code);
void sim_fail_function(const char *name, unsigned long nth, CUresult code);
void sim_fail_function_repeat(const char *name, unsigned long nth, unsigned long times,
                              CUresult code);
void sim_clear_faults(void);
unsigned long sim_faults_fired(void);
/* Calls the simulated driver refused on its own (not injected faults) since the last
 * sim_reset_counters: a mapping over a mapped address, an unmap of part of a mapping, ... */
unsigned long sim_rejections(void);

/* Trace: names of the entry points called since sim_trace_begin (up to 1M are kept).
 * sim_trace_get copies up to max name pointers (static strings) into names and returns how many
 * calls were made since the mark (may be more than max). */
void sim_trace_begin(void);
size_t sim_trace_get(const char **names, size_t max);
void sim_trace_end(void);

/* Name of an entry point's enum index, and the number of them (for sweeps). */
size_t sim_entry_count(void);
const char *sim_entry_name(size_t i);

/* The simulated cuGetProcAddress_v2 (also exported as such by the fake libcuda). */
CUresult sim_get_proc_address(const char *symbol, void **pfn, int cudaVersion,
                              cuuint64_t flags, CUdriverProcAddressQueryResult *status);

#endif
