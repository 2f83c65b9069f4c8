/* Layer "driver table".
 *
 * Every CUDA driver entry point the library itself calls, resolved once from the real
 * libcuda.so.1 (through the real dlsym and the real cuGetProcAddress), so that none of the
 * library's own calls can reach its own interposed symbols. Tests install a simulated driver
 * in the same table with vmh_driver_install(); nothing else changes.
 *
 * Error convention (whole library): internal functions return a CUresult (CUDA_SUCCESS or the
 * driver's code) and write results through pointers; interposed entry points keep the
 * driver's semantics and codes exactly; the public API returns the vmm_status codes of
 * include/vmmhook.h.
 */
#ifndef VMH_DRIVER_H
#define VMH_DRIVER_H

#include <cuda.h>
#include <stdbool.h>

/* X(field, params): field is the cuda.h name; cuda.h's versioning macros turn cuMemAlloc into
 * cuMemAlloc_v2 and so on wherever the field is named, while #field stays the plain name that
 * cuGetProcAddress expects. Every entry is fetched for CUDA_VERSION with flags 0 (legacy
 * default stream), i.e. the ABI these headers declare. */
/* The most devices the library keeps state for (ordinals 0 to VMH_MAX_DEVICES - 1): every
 * per-device table of every layer has this many rows; a device past it is passed through. */
#define VMH_MAX_DEVICES 64

#define VMH_DRIVER_FUNCS(X)                                                                        \
    X(cuInit, (unsigned int flags))                                                                \
    X(cuDriverGetVersion, (int *version))                                                          \
    X(cuDeviceGetCount, (int *count))                                                              \
    X(cuDeviceGet, (CUdevice * dev, int ordinal))                                                  \
    X(cuDeviceGetAttribute, (int *pi, CUdevice_attribute attrib, CUdevice dev))                    \
    X(cuDeviceTotalMem, (size_t * bytes, CUdevice dev))                                            \
    X(cuDeviceCanAccessPeer, (int *can, CUdevice dev, CUdevice peer))                              \
    X(cuCtxGetCurrent, (CUcontext * pctx))                                                         \
    X(cuCtxPushCurrent, (CUcontext ctx))                                                           \
    X(cuCtxPopCurrent, (CUcontext * pctx))                                                         \
    X(cuCtxGetDevice, (CUdevice * device))                                                         \
    X(cuCtxSynchronize, (void))                                                                    \
    X(cuDevicePrimaryCtxRetain, (CUcontext * pctx, CUdevice dev))                                  \
    X(cuMemGetInfo, (size_t * free, size_t * total))                                               \
    X(cuMemGetAllocationGranularity, (size_t * granularity, const CUmemAllocationProp *prop,       \
                                      CUmemAllocationGranularity_flags option))                    \
    X(cuMemCreate, (CUmemGenericAllocationHandle * handle, size_t size,                            \
                    const CUmemAllocationProp *prop, unsigned long long flags))                    \
    X(cuMemRelease, (CUmemGenericAllocationHandle handle))                                         \
    X(cuMemAddressReserve, (CUdeviceptr * ptr, size_t size, size_t alignment, CUdeviceptr addr,    \
                            unsigned long long flags))                                             \
    X(cuMemAddressFree, (CUdeviceptr ptr, size_t size))                                            \
    X(cuMemMap, (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, \
                 unsigned long long flags))                                                        \
    X(cuMemUnmap, (CUdeviceptr ptr, size_t size))                                                  \
    X(cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count))   \
    X(cuMemExportToShareableHandle, (void *shareable, CUmemGenericAllocationHandle handle,         \
                                     CUmemAllocationHandleType type, unsigned long long flags))    \
    X(cuMemImportFromShareableHandle,                                                              \
      (CUmemGenericAllocationHandle * handle, void *os_handle, CUmemAllocationHandleType type))    \
    X(cuMemcpyDtoD, (CUdeviceptr dst, CUdeviceptr src, size_t bytes))                              \
    X(cuMemcpyDtoDAsync, (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream))        \
    X(cuStreamSynchronize, (CUstream stream))                                                      \
    /* Contexts, streams, capture, host memory and copies (for reclaim and pause). The             \
     * library's own calls are never the interposed ones, so nothing here is reported to           \
     * contexts.c: a layer that makes or changes a context through them reports it itself. */      \
    X(cuCtxSetCurrent, (CUcontext ctx))                                                            \
    X(cuCtxCreate,                                                                                 \
      (CUcontext * pctx, CUctxCreateParams * params, unsigned int flags, CUdevice dev))            \
    X(cuCtxDestroy, (CUcontext ctx))                                                               \
    X(cuDevicePrimaryCtxRelease, (CUdevice dev))                                                   \
    X(cuDevicePrimaryCtxReset, (CUdevice dev))                                                     \
    X(cuStreamCreate, (CUstream * stream, unsigned int flags))                                     \
    X(cuStreamDestroy, (CUstream stream))                                                          \
    X(cuStreamBeginCapture, (CUstream stream, CUstreamCaptureMode mode))                           \
    X(cuStreamEndCapture, (CUstream stream, CUgraph * graph))                                      \
    X(cuStreamIsCapturing, (CUstream stream, CUstreamCaptureStatus * status))                      \
    X(cuThreadExchangeStreamCaptureMode, (CUstreamCaptureMode * mode))                             \
    X(cuGraphDestroy, (CUgraph graph))                                                             \
    X(cuMemAllocFromPoolAsync,                                                                     \
      (CUdeviceptr * dptr, size_t bytesize, CUmemoryPool pool, CUstream stream))                   \
    X(cuMemAllocManaged, (CUdeviceptr * dptr, size_t bytesize, unsigned int flags))                \
    X(cuMemHostAlloc, (void **pp, size_t bytesize, unsigned int flags))                            \
    X(cuMemFreeHost, (void *p))                                                                    \
    X(cuMemHostRegister, (void *p, size_t bytesize, unsigned int flags))                           \
    X(cuMemHostUnregister, (void *p))                                                              \
    X(cuMemcpyHtoD, (CUdeviceptr dst, const void *src, size_t bytes))                              \
    X(cuMemcpyDtoH, (void *dst, CUdeviceptr src, size_t bytes))                                    \
    X(cuMemcpyHtoDAsync, (CUdeviceptr dst, const void *src, size_t bytes, CUstream stream))        \
    X(cuMemcpyDtoHAsync, (void *dst, CUdeviceptr src, size_t bytes, CUstream stream))              \
    /* Real versions of the interposed entry points, for pass-through and for our own use. */      \
    X(cuMemAlloc, (CUdeviceptr * dptr, size_t bytesize))                                           \
    X(cuMemAllocPitch,                                                                             \
      (CUdeviceptr * dptr, size_t * pitch, size_t width, size_t height, unsigned int elementSize)) \
    X(cuMemFree, (CUdeviceptr dptr))                                                               \
    X(cuMemFreeAsync, (CUdeviceptr dptr, CUstream stream))                                         \
    X(cuMemGetAddressRange, (CUdeviceptr * base, size_t * size, CUdeviceptr dptr))                 \
    X(cuPointerGetAttribute, (void *data, CUpointer_attribute attribute, CUdeviceptr ptr))         \
    X(cuPointerGetAttributes,                                                                      \
      (unsigned int n, CUpointer_attribute *attributes, void **data, CUdeviceptr ptr))             \
    X(cuIpcGetMemHandle, (CUipcMemHandle * handle, CUdeviceptr dptr))                              \
    X(cuIpcOpenMemHandle, (CUdeviceptr * pdptr, CUipcMemHandle handle, unsigned int flags))        \
    X(cuIpcCloseMemHandle, (CUdeviceptr dptr))                                                     \
    X(cuCtxEnablePeerAccess, (CUcontext peer, unsigned int flags))                                 \
    X(cuCtxDisablePeerAccess, (CUcontext peer))

#define VMH_DRIVER_FIELD(name, params) CUresult(*name) params;
typedef struct vmh_driver {
    VMH_DRIVER_FUNCS(VMH_DRIVER_FIELD)
} vmh_driver_t;
#undef VMH_DRIVER_FIELD

/* The one way the library calls the driver: vmh_drv.cuMemMap(...). vmh_drv names the table
 * through vmh_driver_call(), which counts the call (the statistic "driver calls made by the
 * library" then counts every call exactly once, wherever it is made) and returns the table.
 * Read it only after vmh_driver_ready() returned true. */
#define vmh_drv (*vmh_driver_call())
const vmh_driver_t *vmh_driver_call(void);

/* Loads libcuda.so.1 and fills the table, once (thread-safe). Returns false when no driver can
 * be loaded (no GPU machine); the library then passes everything through. */
bool vmh_driver_ready(void);

/* Whether the table has been filled (no loading; safe anywhere). */
bool vmh_driver_loaded(void);

/* Tests and the simulated driver: install a complete table instead of loading libcuda. */
void vmh_driver_install(const vmh_driver_t *table);

/* --- For the interposer: the real functions behind the program's calls. -------------------
 * Nothing below loads the driver, takes a lock of the library or prints: these run inside the
 * program's dlsym and cuGetProcAddress lookups (the dynamic loader's own lock is taken, as by
 * dlsym itself; a lookup that finds nothing leaves its message in dlerror). */

/* The C library's dlsym (never the interposed one), resolved once with dlvsym. Never NULL: a
 * C library without it (not glibc) gets a function that finds nothing. */
typedef void *(*vmh_dlsym_fn)(void *handle, const char *symbol);
vmh_dlsym_fn vmh_real_dlsym_fn(void);
void *vmh_real_dlsym(void *handle, const char *symbol);

/* Whether a dlsym handle is one of the pseudo-handles (RTLD_DEFAULT, RTLD_NEXT), whose answer
 * depends on the caller, rather than an object's. */
bool vmh_dlsym_pseudo_handle(const void *handle);

/* The definition of a driver symbol that the program would have bound without the library:
 * the next one after the library in the lookup order, else libcuda.so.1's when someone loaded
 * it (RTLD_LOCAL, as cudart does). NULL when neither has it. */
void *vmh_driver_next_symbol(const char *symbol);

/* The real driver's answer to cuGetProcAddress(symbol, version, flags) (symbol the base name,
 * as cuGetProcAddress takes it), through the driver's own cuGetProcAddress_v2 or, in a driver
 * older than CUDA 12, cuGetProcAddress. NULL when the driver has no answer or no libcuda is in
 * the process. */
void *vmh_driver_proc(const char *symbol, int version, cuuint64_t flags);

#endif
