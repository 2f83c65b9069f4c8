/* simdrv internals shared by the sim's own sources (not for tests).
 *
 * Files, by concern:
 *   simdrv.c     the state (S, T), helpers, sorted vectors, initialisation and devices, error
 *                strings, the library's table, cuGetProcAddress and the fake's extra exports;
 *   simcall.c    what every entry point does first (SIM_ENTER): perturbation, counts, trace,
 *                injected faults, a forked child's refusal; their control API; fork handlers;
 *   simledger.c  sim_reset, the configuration and switches, the ledger's queries and dump;
 *   simmem.c     device memory's contents; the lifetimes of allocations, handles, mappings
 *                and native blocks;
 *   simvmm.c     the VMM calls (create, reserve, map, access);
 *   simnative.c  the native allocator and the pointer queries;
 *   simipc.c     shareable handles and legacy IPC;
 *   simctx.c     contexts; simstream.c streams, stream capture and graphs;
 *   simwork.c    work in flight per context: queued copies and "kernels", the synchronizing
 *                calls that land them, copies;
 *   simhost.c    pinned host memory, managed memory, pool allocations.
 * One mutex (S.mu) guards everything; every entry point takes it for its whole run. */
#ifndef SIMINT_H
#define SIMINT_H

#include "simdrv.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

/* Every entry point the simulation implements: X(plain cuda.h name, params); cuda.h's
 * versioning macros turn the name into the versioned one (cuMemAlloc -> cuMemAlloc_v2) wherever
 * it is not stringified. This is the simulation's own list, a superset of the library's
 * driver table (src/driver/driver.h VMH_DRIVER_FUNCS): sim_table() fills the table by name from it,
 * so a row added to VMH_DRIVER_FUNCS compiles as soon as it is listed here (and fails to compile,
 * naming the missing sim_ function, when it is not). */
#define SIM_FUNCS(X)                                                                               \
    /* initialisation and devices */                                                              \
    X(cuInit, (unsigned int flags))                                                                \
    X(cuDriverGetVersion, (int *version))                                                          \
    X(cuDeviceGetCount, (int *count))                                                              \
    X(cuDeviceGet, (CUdevice * dev, int ordinal))                                                  \
    X(cuDeviceGetAttribute, (int *pi, CUdevice_attribute attrib, CUdevice dev))                    \
    X(cuDeviceTotalMem, (size_t * bytes, CUdevice dev))                                            \
    X(cuDeviceCanAccessPeer, (int *can, CUdevice dev, CUdevice peer))                              \
    X(cuDeviceGetName, (char *name, int len, CUdevice dev))                                        \
    /* contexts */                                                                                 \
    X(cuCtxGetCurrent, (CUcontext * pctx))                                                         \
    X(cuCtxSetCurrent, (CUcontext ctx))                                                            \
    X(cuCtxPushCurrent, (CUcontext ctx))                                                           \
    X(cuCtxPopCurrent, (CUcontext * pctx))                                                         \
    X(cuCtxGetDevice, (CUdevice * device))                                                         \
    X(cuCtxSynchronize, (void))                                                                    \
    X(cuCtxCreate, (CUcontext * pctx, CUctxCreateParams * params, unsigned int flags,              \
                    CUdevice dev))                                                                 \
    X(cuCtxDestroy, (CUcontext ctx))                                                               \
    X(cuDevicePrimaryCtxRetain, (CUcontext * pctx, CUdevice dev))                                  \
    X(cuDevicePrimaryCtxRelease, (CUdevice dev))                                                   \
    X(cuDevicePrimaryCtxReset, (CUdevice dev))                                                     \
    X(cuCtxEnablePeerAccess, (CUcontext peer, unsigned int flags))                                 \
    X(cuCtxDisablePeerAccess, (CUcontext peer))                                                    \
    /* VMM */                                                                                      \
    X(cuMemGetInfo, (size_t * free, size_t *total))                                                \
    X(cuMemGetAllocationGranularity, (size_t * granularity, const CUmemAllocationProp *prop,       \
                                      CUmemAllocationGranularity_flags option))                    \
    X(cuMemCreate, (CUmemGenericAllocationHandle * handle, size_t size,                            \
                    const CUmemAllocationProp *prop, unsigned long long flags))                    \
    X(cuMemRelease, (CUmemGenericAllocationHandle handle))                                         \
    X(cuMemAddressReserve, (CUdeviceptr * ptr, size_t size, size_t alignment, CUdeviceptr addr,   \
                            unsigned long long flags))                                             \
    X(cuMemAddressFree, (CUdeviceptr ptr, size_t size))                                            \
    X(cuMemMap, (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, \
                 unsigned long long flags))                                                        \
    X(cuMemUnmap, (CUdeviceptr ptr, size_t size))                                                  \
    X(cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count))   \
    X(cuMemExportToShareableHandle, (void *shareable, CUmemGenericAllocationHandle handle,         \
                                     CUmemAllocationHandleType type, unsigned long long flags))    \
    X(cuMemImportFromShareableHandle, (CUmemGenericAllocationHandle * handle, void *os_handle,     \
                                       CUmemAllocationHandleType type))                            \
    X(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle * handle, void *addr))           \
    X(cuMemGetAllocationPropertiesFromHandle, (CUmemAllocationProp * prop,                         \
                                               CUmemGenericAllocationHandle handle))               \
    /* copies */                                                                                   \
    X(cuMemcpyDtoD, (CUdeviceptr dst, CUdeviceptr src, size_t bytes))                              \
    X(cuMemcpyDtoDAsync, (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream))       \
    X(cuMemcpyHtoD, (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount))               \
    X(cuMemcpyDtoH, (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount))                     \
    X(cuMemcpyHtoDAsync, (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,           \
                          CUstream hStream))                                                       \
    X(cuMemcpyDtoHAsync, (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,                 \
                          CUstream hStream))                                                       \
    X(cuMemsetD8, (CUdeviceptr dstDevice, unsigned char uc, size_t N))                             \
    /* streams, capture, graphs */                                                                 \
    X(cuStreamCreate, (CUstream * phStream, unsigned int Flags))                                   \
    X(cuStreamCreateWithPriority, (CUstream * phStream, unsigned int flags, int priority))        \
    X(cuStreamDestroy, (CUstream hStream))                                                         \
    X(cuStreamSynchronize, (CUstream stream))                                                      \
    X(cuStreamQuery, (CUstream hStream))                                                           \
    X(cuStreamBeginCapture, (CUstream hStream, CUstreamCaptureMode mode))                          \
    X(cuStreamEndCapture, (CUstream hStream, CUgraph * phGraph))                                   \
    X(cuStreamIsCapturing, (CUstream hStream, CUstreamCaptureStatus * captureStatus))              \
    X(cuThreadExchangeStreamCaptureMode, (CUstreamCaptureMode * mode))                             \
    X(cuGraphDestroy, (CUgraph hGraph))                                                            \
    /* native allocators */                                                                        \
    X(cuMemAlloc, (CUdeviceptr * dptr, size_t bytesize))                                           \
    X(cuMemAllocPitch, (CUdeviceptr * dptr, size_t *pitch, size_t width, size_t height,           \
                        unsigned int elementSize))                                                 \
    X(cuMemFree, (CUdeviceptr dptr))                                                               \
    X(cuMemAllocAsync, (CUdeviceptr * dptr, size_t bytesize, CUstream hStream))                    \
    X(cuMemFreeAsync, (CUdeviceptr dptr, CUstream stream))                                         \
    X(cuMemAllocFromPoolAsync, (CUdeviceptr * dptr, size_t bytesize, CUmemoryPool pool,            \
                                CUstream hStream))                                                 \
    X(cuMemAllocManaged, (CUdeviceptr * dptr, size_t bytesize, unsigned int flags))                \
    X(cuMemHostAlloc, (void **pp, size_t bytesize, unsigned int Flags))                            \
    X(cuMemFreeHost, (void *p))                                                                    \
    X(cuMemHostRegister, (void *p, size_t bytesize, unsigned int Flags))                           \
    X(cuMemHostUnregister, (void *p))                                                              \
    /* queries */                                                                                  \
    X(cuMemGetAddressRange, (CUdeviceptr * base, size_t *size, CUdeviceptr dptr))                 \
    X(cuPointerGetAttribute, (void *data, CUpointer_attribute attribute, CUdeviceptr ptr))         \
    X(cuPointerGetAttributes, (unsigned int n, CUpointer_attribute *attributes, void **data,       \
                               CUdeviceptr ptr))                                                   \
    X(cuIpcGetMemHandle, (CUipcMemHandle * handle, CUdeviceptr dptr))                              \
    X(cuIpcOpenMemHandle, (CUdeviceptr * pdptr, CUipcMemHandle handle, unsigned int flags))        \
    X(cuIpcCloseMemHandle, (CUdeviceptr dptr))                                                     \
    X(cuGetProcAddress, (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,       \
                         CUdriverProcAddressQueryResult *symbolStatus))                            \
    X(cuGetErrorString, (CUresult error, const char **pStr))                                       \
    X(cuGetErrorName, (CUresult error, const char **pStr))                                         \
    /* Older or newer ABIs that cuGetProcAddress answers for a plain name by cudaVersion (see      \
     * sim_abi_versions in simdrv.c); counted under these names. cuda.h has no macro for them. */  \
    X(cuCtxGetDevice_v2, (CUdevice * device, CUcontext ctx))                                       \
    X(cuCtxSynchronize_v2, (CUcontext ctx))                                                        \
    X(cuCtxCreate_v2, (CUcontext * pctx, unsigned int flags, CUdevice dev))                        \
    X(cuCtxCreate_v3, (CUcontext * pctx, CUexecAffinityParam * paramsArray, int numParams,         \
                       unsigned int flags, CUdevice dev))

/* The per-thread-default-stream variants the real driver exports: X(plain name, exported name,
 * params). In the fake libcuda they are functions of their own, counted under the plain name:
 * the _ptsz ones read a NULL stream as the calling thread's per-thread default stream
 * (CU_STREAM_PER_THREAD), the _ptds synchronous ones run on that stream instead of the legacy
 * one (so they never meet the legacy stream's capture conflicts); cuGetProcAddress answers them
 * for CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM. Each is defined beside its plain entry.
 * The static form has none: tests call the table, whose NULL is the legacy stream. */
#define SIM_PT_FUNCS(X)                                                                            \
    X(cuMemcpyDtoD, cuMemcpyDtoD_v2_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t n))           \
    X(cuMemcpyHtoD, cuMemcpyHtoD_v2_ptds, (CUdeviceptr dst, const void *src, size_t n))           \
    X(cuMemcpyDtoH, cuMemcpyDtoH_v2_ptds, (void *dst, CUdeviceptr src, size_t n))                 \
    X(cuMemsetD8, cuMemsetD8_v2_ptds, (CUdeviceptr dst, unsigned char uc, size_t n))              \
    X(cuMemcpyDtoDAsync, cuMemcpyDtoDAsync_v2_ptsz,                                                \
      (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream))                               \
    X(cuMemcpyHtoDAsync, cuMemcpyHtoDAsync_v2_ptsz,                                                \
      (CUdeviceptr dst, const void *src, size_t n, CUstream stream))                               \
    X(cuMemcpyDtoHAsync, cuMemcpyDtoHAsync_v2_ptsz,                                                \
      (void *dst, CUdeviceptr src, size_t n, CUstream stream))                                     \
    X(cuStreamSynchronize, cuStreamSynchronize_ptsz, (CUstream stream))                            \
    X(cuStreamQuery, cuStreamQuery_ptsz, (CUstream stream))                                        \
    X(cuStreamBeginCapture, cuStreamBeginCapture_v2_ptsz,                                          \
      (CUstream stream, CUstreamCaptureMode mode))                                                 \
    X(cuStreamEndCapture, cuStreamEndCapture_ptsz, (CUstream stream, CUgraph * graph))             \
    X(cuStreamIsCapturing, cuStreamIsCapturing_ptsz,                                               \
      (CUstream stream, CUstreamCaptureStatus * status))                                           \
    X(cuMemFreeAsync, cuMemFreeAsync_ptsz, (CUdeviceptr dptr, CUstream stream))                    \
    X(cuMemAllocAsync, cuMemAllocAsync_ptsz, (CUdeviceptr * dptr, size_t n, CUstream stream))     \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz,                                       \
      (CUdeviceptr * dptr, size_t n, CUmemoryPool pool, CUstream stream))

#ifdef SIM_SHARED
#define SIM_PT_PROTO(plain, exported, params) CUresult exported params;
SIM_PT_FUNCS(SIM_PT_PROTO)
#undef SIM_PT_PROTO
#endif

/* What a _ptsz variant passes on for its stream argument. */
#define SIM_PT_STREAM(s) ((s) ? (s) : CU_STREAM_PER_THREAD)

#define SIM_ENUM(name, params) SIM_E_##name,
enum sim_fn { SIM_FUNCS(SIM_ENUM) SIM_E_COUNT };
#undef SIM_ENUM

/* The implementations. Their names go through cuda.h's versioning macros first: in the static
 * form sim_cuMemAlloc_v2 and so on; in the fake libcuda (SIM_SHARED) the exported names
 * themselves (cuMemAlloc_v2), linked -Bsymbolic so the library's own references stay local. */
#ifdef SIM_SHARED
#define SIM_IMPL(name) name
#else
#define SIM_IMPL(name) SIM_IMPL_(name)
#define SIM_IMPL_(name) sim_##name
#endif

#define SIM_PROTO(name, params) CUresult SIM_IMPL(name) params;
SIM_FUNCS(SIM_PROTO)
#undef SIM_PROTO

/* Everything below is internal to the simulation: hidden, so that the fake libcuda exports
 * only driver names and the sim_* test API. */
#pragma GCC visibility push(hidden)

/* The internals' short names, spelled with the sim_ prefix in the object files: the unit tests
 * link the simulation beside the library's own layers, whose names must never collide with
 * these. (Every system header the sim uses is included above, before these macros.) */
#define S sim_state_
#define T sim_thread_
#define die sim_die_
#define reject sim_reject_
#define last_reason sim_last_reason_
#define is_pow2 sim_is_pow2_
#define xcalloc sim_xcalloc_
#define xrealloc sim_xrealloc_
#define gran sim_gran_
#define ndev sim_ndev_
#define overlaps sim_overlaps_
#define vec_upper sim_vec_upper_
#define vec_find sim_vec_find_
#define vec_exact sim_vec_exact_
#define vec_insert sim_vec_insert_
#define vec_remove sim_vec_remove_
#define vec_range_free sim_vec_range_free_
#define vec_gap_from sim_vec_gap_from_
#define env_size sim_env_size_
#define reset_locked sim_reset_locked_
#define check_range sim_check_range_
#define do_write sim_do_write_
#define do_read sim_do_read_
#define do_copy sim_do_copy_
#define alloc_maybe_free sim_alloc_maybe_free_
#define allocs_sweep_held sim_allocs_sweep_held_
#define handle_new sim_handle_new_
#define handle_find sim_handle_find_
#define map_destroy sim_map_destroy_
#define native_new sim_native_new_
#define native_destroy sim_native_destroy_
#define round512 sim_round512_
#define cur_ctx sim_cur_ctx_
#define cur_dev sim_cur_dev_
#define need_ctx sim_need_ctx_
#define ctx_valid sim_ctx_valid_
#define is_default_stream sim_is_default_stream_
#define stream_ctx sim_stream_ctx_
#define capture_allows sim_capture_allows_
#define stream_capturing sim_stream_capturing_
#define capture_conflicts_ctx sim_capture_conflicts_ctx_
#define capture_conflicts_legacy sim_capture_conflicts_legacy_
#define contexts_wipe sim_contexts_wipe_
#define ctx_release_resources sim_ctx_release_resources_
#define ctx_sync sim_ctx_sync_
#define stream_free sim_stream_free_
#define work_land_ctx sim_work_land_ctx_
#define work_land_stream sim_work_land_stream_
#define work_land_all sim_work_land_all_
#define work_forget_stream sim_work_forget_stream_
#define hazard_check sim_hazard_check_
#define hazard_check_host sim_hazard_check_host_
#define work_queue sim_work_queue_
#define work_wipe sim_work_wipe_
#define host_range_pinned sim_host_range_pinned_
#define hosts_wipe sim_hosts_wipe_

#define KiB (1024ULL)
#define MiB (1024ULL * KiB)
#define GiB (1024ULL * MiB)
#define TiB (1024ULL * GiB)

/* The fake address space: reservations from VA_BASE (config.va_size of it, at most VA_MAX_SIZE),
 * native blocks in [NAT_BASE, NAT_BASE + NAT_SPAN), so that a pointer's range tells its kind. */
#define VA_BASE 0x100000000000ULL /* 16 TiB: reservations */
#define VA_MAX_SIZE (64ULL * TiB)
#define NAT_BASE 0x500000000000ULL /* 80 TiB: native blocks */
#define NAT_SPAN (4ULL * TiB)

#define CTX_MAGIC 0x51dc7a11u /* a live context */
#define CTX_DEAD 0x51dc0dedu  /* destroyed: kept (never freed before sim_reset) so that a stale
                                 handle on some thread's stack reads as destroyed */
#define CTX_DEPTH 32

/* ---- objects ---- */

typedef struct sim_iv { /* an interval of the fake address space (or a key) */
    CUdeviceptr ptr;
    size_t span;
} sim_iv_t;

typedef struct sim_vec { /* sorted by iv.ptr */
    sim_iv_t **v;
    size_t n, cap;
} sim_vec_t;

struct CUctx_st {
    sim_iv_t iv; /* ptr = the context's address (created contexts live in S.ctxs) */
    unsigned magic;
    int device;
    bool primary;
    unsigned long syncs; /* cuCtxSynchronize[_v2] / cuStreamSynchronize that waited on it */
};

typedef struct sim_alloc {
    struct sim_alloc *prev, *next;
    unsigned long long id;
    size_t size;
    CUmemAllocationProp prop;
    int device; /* -1: host */
    unsigned nhandles, nmaps;
    bool held_by_fd; /* no handle or mapping left, but an exported descriptor is still open */
    unsigned char *bytes; /* contents, mapped on first write */
} sim_alloc_t;

typedef struct sim_handle {
    sim_iv_t iv; /* ptr = handle value */
    sim_alloc_t *a;
} sim_handle_t;

typedef struct sim_resv {
    sim_iv_t iv;
    unsigned long long id;
} sim_resv_t;

typedef struct sim_map {
    sim_iv_t iv;
    sim_alloc_t *a;
    sim_resv_t *r;
    unsigned char *acc; /* [granule * ndev + dev]: CU_MEM_ACCESS_FLAGS_PROT_* */
} sim_map_t;

typedef enum sim_native_kind { NATIVE_DEVICE, NATIVE_MANAGED } sim_native_kind_t;

typedef struct sim_native {
    sim_iv_t iv; /* span: address space taken */
    size_t size; /* bytes the caller may touch (requested, or pitch * height) */
    size_t charged;
    int device;
    CUcontext ctx; /* the context it was allocated in: destroying that frees it */
    sim_native_kind_t kind;
    unsigned long long id;
    unsigned char *bytes;
} sim_native_t;

typedef enum sim_capture { CAPTURE_NONE, CAPTURE_ACTIVE, CAPTURE_INVALIDATED } sim_capture_t;

struct CUstream_st {
    sim_iv_t iv; /* ptr = the stream's address */
    CUcontext ctx;
    unsigned flags;
    sim_capture_t capture;
    CUstreamCaptureMode capture_mode;
    pthread_t capture_thread;
    unsigned long captured_ops; /* work recorded into the capture (not run) */
};

struct CUgraph_st {
    sim_iv_t iv;
    unsigned long nodes;
};

typedef struct sim_host { /* pinned host memory: cuMemHostAlloc'd or cuMemHostRegister'ed */
    sim_iv_t iv;
    bool registered;
} sim_host_t;

typedef struct sim_export {
    dev_t dev;
    ino_t ino;
    sim_alloc_t *a;
} sim_export_t;

typedef enum sim_op_kind { OP_COPY, OP_FILL, OP_HTOD, OP_DTOH } sim_op_kind_t;

typedef struct sim_op { /* work in flight: lands at its context's next synchronization */
    sim_op_kind_t kind;
    CUcontext ctx;
    CUstream stream; /* NULL: the context's legacy default stream */
    CUdeviceptr dst, src; /* device addresses (dst for COPY/FILL/HTOD, src for COPY/DTOH) */
    size_t n;
    int fill;
    void *host;             /* HTOD source (pinned) or DTOH destination */
    unsigned char *staged;  /* HTOD from pageable memory: the bytes staged at the call */
} sim_op_t;

typedef struct sim_fault {
    int fn; /* -1: any entry point */
    unsigned long from, to; /* counts (inclusive) that fail */
    CUresult code;
} sim_fault_t;

typedef struct sim_state {
    pthread_mutex_t mu;
    bool initialized;
    bool fork_strict;  /* children of an initialized process answer NOT_INITIALIZED */
    bool forked_child; /* this process is such a child */
    unsigned gen;
    sim_config_t cfg;
    struct CUctx_st ctx[SIM_MAX_DEVICES]; /* primary contexts */
    unsigned primary_refs[SIM_MAX_DEVICES];
    bool peer[SIM_MAX_DEVICES][SIM_MAX_DEVICES];
    size_t used[SIM_MAX_DEVICES];
    size_t host_used; /* bytes of host-located VMM allocations (cfg.host_memory bounds it) */
    sim_alloc_t *allocs;
    size_t nallocs;
    sim_vec_t handles, resvs, maps, natives, streams, ctxs, graphs, hosts;
    size_t ctxs_live;
    unsigned long capture_refusals; /* calls refused with STREAM_CAPTURE_UNSUPPORTED */
    size_t host_pinned; /* bytes of cuMemHostAlloc + cuMemHostRegister */
    sim_export_t *exports;
    size_t nexports, capexports;
    size_t held_by_fd; /* allocations kept alive by an open exported descriptor alone */
    sim_op_t *ops;
    size_t nops, capops;
    CUdeviceptr res_rover, nat_rover;
    bool refuse_hints;
    bool verbose;
    unsigned long long next_id;
    unsigned long long next_handle;
    unsigned long hazards;
    unsigned long total;
    unsigned long calls[SIM_E_COUNT];
    sim_fault_t faults[64];
    size_t nfaults;
    unsigned long fired;
    unsigned long rejected; /* calls reject() refused (atomic: reject may run unlocked) */
    bool tracing;
    const char **trace;
    size_t ntrace;
    unsigned long trace_calls;
} sim_state_t;

typedef struct sim_thread {
    unsigned gen;
    int depth;
    CUcontext stack[CTX_DEPTH];
    CUstreamCaptureMode capture_mode; /* cuThreadExchangeStreamCaptureMode; reset with gen */
} sim_thread_t;

extern sim_state_t S;
extern __thread sim_thread_t T;

/* ---- helpers (simdrv.c) ---- */
void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
CUresult reject(CUresult code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
extern __thread char last_reason[256]; /* reject's, or the fault's sim_enter fired (simcall.c) */
int sim_lock(void);
void sim_unlock_cleanup(int *held);
/* Holds S.mu until the end of the enclosing block. */
#define LOCKED __attribute__((cleanup(sim_unlock_cleanup), unused)) int sim_locked_ = sim_lock()
CUresult sim_enter(enum sim_fn fn);
void *xcalloc(size_t n, size_t sz);
void *xrealloc(void *p, size_t sz);
size_t gran(void);
int ndev(void);
bool is_pow2(size_t x);
bool overlaps(CUdeviceptr a, size_t an, CUdeviceptr b, size_t bn);

/* Schedule perturbation (SIM_PERTURB=seed, see simdrv.h; simcall.c): before the driver's lock, so that
 * threads reach the driver, and the library's own locks around it, in other orders. */
void sim_perturb(void);

#define SIM_ENTER(id)                                          \
    sim_perturb();                                             \
    LOCKED;                                                    \
    do {                                                       \
        CUresult sim_frc_ = sim_enter(SIM_E_##id);             \
        if (sim_frc_ != CUDA_SUCCESS)                          \
            return sim_frc_;                                   \
    } while (0)

#define NEED_INIT()                                                             \
    do {                                                                        \
        if (!S.initialized)                                                     \
            return reject(CUDA_ERROR_NOT_INITIALIZED, "%s", "not initialized"); \
    } while (0)

#define NEED_DEVICE(d, what)                                                               \
    do {                                                                                   \
        if ((d) < 0 || (d) >= ndev())                                                      \
            return reject(CUDA_ERROR_INVALID_DEVICE, "%s: no device %d", what, (int)(d)); \
    } while (0)

size_t vec_upper(const sim_vec_t *s, CUdeviceptr p);
void *vec_find(const sim_vec_t *s, CUdeviceptr p);
void *vec_exact(const sim_vec_t *s, CUdeviceptr p);
void vec_insert(sim_vec_t *s, void *obj);
void vec_remove(sim_vec_t *s, void *obj);
bool vec_range_free(const sim_vec_t *s, CUdeviceptr p, size_t size);
/* First address >= from, aligned, where size bytes fit below hi; 0 if none. */
CUdeviceptr vec_gap_from(const sim_vec_t *s, CUdeviceptr from, CUdeviceptr hi, size_t size,
                         size_t align);

/* the ledger (simledger.c) */
size_t env_size(const char *name, size_t dflt); /* SIM_* sizes, K/M/G/T suffixes; 0: unset */
void reset_locked(const sim_config_t *cfg);     /* sim_reset, S.mu held (cuInit's first call) */

/* contents (simmem.c) */
CUresult check_range(CUdeviceptr p, size_t n, int dev, bool write);
void do_write(CUdeviceptr p, const unsigned char *src, int fill, size_t n, int dev);
void do_read(unsigned char *dst, CUdeviceptr p, size_t n, int dev);
void do_copy(CUdeviceptr dst, CUdeviceptr src, size_t n, int dev);

/* lifetimes (simmem.c) */
void alloc_maybe_free(sim_alloc_t *a); /* frees it once no handle, mapping or open fd is left */
void allocs_sweep_held(void);          /* frees those whose exported descriptor was closed */
CUmemGenericAllocationHandle handle_new(sim_alloc_t *a);
void map_destroy(sim_map_t *m);

/* VMM (simvmm.c) */
sim_handle_t *handle_find(CUmemGenericAllocationHandle h); /* NULL: not a live handle */

/* native blocks (simnative.c; native_destroy: simmem.c) */
CUresult native_new(const char *what, CUcontext ctx, size_t size, size_t charged,
                    sim_native_kind_t kind, CUdeviceptr *out);
void native_destroy(sim_native_t *n);
size_t round512(size_t n);

/* contexts (simctx.c), streams and capture (simstream.c) */
CUcontext cur_ctx(void);          /* top of this thread's stack, live or destroyed; NULL: none */
int cur_dev(void);                /* the current live context's device, -1 when none */
CUresult need_ctx(CUcontext *out); /* INVALID_CONTEXT / CONTEXT_IS_DESTROYED */
bool ctx_valid(CUcontext c);      /* a live context (primary or created) */
#define NEED_CTX(devvar)                         \
    NEED_INIT();                                 \
    int devvar;                                  \
    do {                                         \
        CUcontext sim_c_;                        \
        CUresult sim_crc_ = need_ctx(&sim_c_);   \
        if (sim_crc_ != CUDA_SUCCESS)            \
            return sim_crc_;                     \
        devvar = sim_c_->device;                 \
    } while (0)
bool is_default_stream(CUstream s);
/* The context a stream's work belongs to; INVALID_HANDLE for an unknown stream,
 * INVALID_CONTEXT when a default stream is named with no current context. */
CUresult stream_ctx(CUstream s, const char *what, CUcontext *out);
/* Whether the calling thread may make a "potentially unsafe" call now; if not, invalidates the
 * capture(s) that forbid it and answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED. */
CUresult capture_allows(const char *what);
bool stream_capturing(CUstream s); /* a named stream with a capture under way (or invalidated) */
/* Calls that necessarily conflict with a capture, in every interaction mode (the programming
 * guide's "prohibited operations"): synchronizing a context that has a capturing stream
 * (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), and using the legacy stream (s NULL or
 * CU_STREAM_LEGACY: synchronous copies, its synchronization, work enqueued on it) while a
 * blocking stream of ctx captures (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT). Both invalidate the
 * captures they meet. */
CUresult capture_conflicts_ctx(CUcontext ctx, const char *what);
CUresult capture_conflicts_legacy(CUstream s, CUcontext ctx, const char *what);
void contexts_wipe(void);          /* frees created contexts, graphs, streams (sim_reset) */
void ctx_sync(CUcontext ctx);      /* a synchronization the capture rule allowed: lands, counts */
void stream_free(struct CUstream_st *s); /* its work in flight stays with its context */
void ctx_release_resources(CUcontext c); /* lands its work, frees its natives and streams */

/* work in flight (simwork.c) */
void work_land_ctx(CUcontext c);      /* every op of that context, in order */
void work_land_stream(CUstream s);    /* every op of that stream */
void work_land_all(void);
void work_forget_stream(CUstream s);  /* ops of a destroyed stream stay with its context */
void hazard_check(const char *what, CUdeviceptr p, size_t n);
void hazard_check_host(const char *what, const void *p, size_t n, bool drop);
CUresult work_queue(const sim_op_t *op);
void work_wipe(void);

/* host memory (simhost.c) */
bool host_range_pinned(const void *p, size_t n); /* inside one pinned host range */
void hosts_wipe(void);

#pragma GCC visibility pop

#endif
