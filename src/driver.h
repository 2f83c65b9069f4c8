/* Layer 1: the driver table.
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
    X(cuMemcpyDtoD, (CUdeviceptr dst, CUdeviceptr src, size_t bytes))                              \
    X(cuMemcpyDtoDAsync, (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream))       \
    X(cuStreamSynchronize, (CUstream stream))                                                      \
    /* Real versions of the interposed entry points, for pass-through and for our own use. */     \
    X(cuMemAlloc, (CUdeviceptr * dptr, size_t bytesize))                                           \
    X(cuMemAllocPitch, (CUdeviceptr * dptr, size_t *pitch, size_t width, size_t height,           \
                        unsigned int elementSize))                                                 \
    X(cuMemFree, (CUdeviceptr dptr))                                                               \
    X(cuMemFreeAsync, (CUdeviceptr dptr, CUstream stream))                                         \
    X(cuMemGetAddressRange, (CUdeviceptr * base, size_t *size, CUdeviceptr dptr))                 \
    X(cuPointerGetAttribute, (void *data, CUpointer_attribute attribute, CUdeviceptr ptr))         \
    X(cuPointerGetAttributes, (unsigned int n, CUpointer_attribute *attributes, void **data,       \
                               CUdeviceptr ptr))                                                   \
    X(cuIpcGetMemHandle, (CUipcMemHandle * handle, CUdeviceptr dptr))                              \
    X(cuIpcOpenMemHandle, (CUdeviceptr * pdptr, CUipcMemHandle handle, unsigned int flags))        \
    X(cuIpcCloseMemHandle, (CUdeviceptr dptr))                                                     \
    X(cuCtxEnablePeerAccess, (CUcontext peer, unsigned int flags))                                 \
    X(cuCtxDisablePeerAccess, (CUcontext peer))

#define VMH_DRIVER_FIELD(name, params) CUresult (*name) params;
typedef struct vmh_driver {
    VMH_DRIVER_FUNCS(VMH_DRIVER_FIELD)
} vmh_driver_t;
#undef VMH_DRIVER_FIELD

/* The table. Read it only after vmh_driver_ready() returned true. */
extern vmh_driver_t vmh_drv;

/* Loads libcuda.so.1 and fills the table, once (thread-safe). Returns false when no driver can
 * be loaded (no GPU machine); the library then passes everything through. */
bool vmh_driver_ready(void);

/* Whether the table has been filled (no loading; safe anywhere). */
bool vmh_driver_loaded(void);

/* Tests and the simulated driver: install a complete table instead of loading libcuda. */
void vmh_driver_install(const vmh_driver_t *table);

/* The real dlsym of the C library (never the interposed one), resolved once with dlvsym. */
void *vmh_real_dlsym(void *handle, const char *symbol);

/* The handle of the real libcuda.so.1 once loaded (NULL before, or under a test table). */
void *vmh_driver_handle(void);

/* The real cuGetProcAddress_v2 from libcuda (NULL when not loaded). */
typedef CUresult (*vmh_getproc_fn)(const char *symbol, void **pfn, int cudaVersion,
                                   cuuint64_t flags, CUdriverProcAddressQueryResult *status);
vmh_getproc_fn vmh_driver_real_getproc(void);

#endif
