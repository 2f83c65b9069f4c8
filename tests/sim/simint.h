/* simdrv internals shared by the sim's own sources (not for tests). */
#ifndef SIMINT_H
#define SIMINT_H

#include "simdrv.h"

/* Entry points the fake libcuda exports beyond the library's driver table (same X format:
 * plain cuda.h name, which cuda.h's macros turn into the exported versioned name). */
#define SIM_EXTRA_FUNCS(X)                                                                         \
    X(cuGetProcAddress, (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,       \
                         CUdriverProcAddressQueryResult *symbolStatus))                            \
    X(cuCtxSetCurrent, (CUcontext ctx))                                                            \
    X(cuDevicePrimaryCtxRelease, (CUdevice dev))                                                   \
    X(cuDeviceGetName, (char *name, int len, CUdevice dev))                                        \
    X(cuMemcpyHtoD, (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount))               \
    X(cuMemcpyDtoH, (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount))                     \
    X(cuMemsetD8, (CUdeviceptr dstDevice, unsigned char uc, size_t N))                             \
    X(cuMemAllocAsync, (CUdeviceptr * dptr, size_t bytesize, CUstream hStream))                    \
    X(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle * handle, void *addr))           \
    X(cuMemGetAllocationPropertiesFromHandle, (CUmemAllocationProp * prop,                         \
                                               CUmemGenericAllocationHandle handle))               \
    X(cuStreamCreate, (CUstream * phStream, unsigned int Flags))                                   \
    X(cuStreamDestroy, (CUstream hStream))                                                         \
    X(cuStreamQuery, (CUstream hStream))                                                           \
    X(cuGetErrorString, (CUresult error, const char **pStr))                                       \
    X(cuGetErrorName, (CUresult error, const char **pStr))                                         \
    /* CUDA 13's context-taking ABIs, which cuGetProcAddress answers for the plain names from      \
     * 13000 on (cuda.h has no macro for them; see sim_newer_abi in simdrv.c). */                  \
    X(cuCtxGetDevice_v2, (CUdevice * device, CUcontext ctx))                                       \
    X(cuCtxSynchronize_v2, (CUcontext ctx))

/* Per-thread-default-stream variants the real driver exports: (plain name, exported name,
 * params). They are aliases of the plain entry (counted under the plain name). */
#define SIM_PT_FUNCS(X)                                                                            \
    X(cuMemcpyDtoD, cuMemcpyDtoD_v2_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t bytes))       \
    X(cuMemcpyDtoDAsync, cuMemcpyDtoDAsync_v2_ptsz,                                                \
      (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream))                           \
    X(cuStreamSynchronize, cuStreamSynchronize_ptsz, (CUstream stream))                            \
    X(cuMemFreeAsync, cuMemFreeAsync_ptsz, (CUdeviceptr dptr, CUstream stream))                    \
    X(cuMemcpyHtoD, cuMemcpyHtoD_v2_ptds, (CUdeviceptr dst, const void *src, size_t n))           \
    X(cuMemcpyDtoH, cuMemcpyDtoH_v2_ptds, (void *dst, CUdeviceptr src, size_t n))                 \
    X(cuMemsetD8, cuMemsetD8_v2_ptds, (CUdeviceptr dst, unsigned char uc, size_t n))              \
    X(cuMemAllocAsync, cuMemAllocAsync_ptsz, (CUdeviceptr * dptr, size_t n, CUstream stream))     \
    X(cuStreamQuery, cuStreamQuery_ptsz, (CUstream stream))

#define SIM_ALL_FUNCS(X) VMH_DRIVER_FUNCS(X) SIM_EXTRA_FUNCS(X)

#define SIM_ENUM(name, params) SIM_E_##name,
enum sim_fn { SIM_ALL_FUNCS(SIM_ENUM) SIM_E_COUNT };
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
SIM_ALL_FUNCS(SIM_PROTO)
#undef SIM_PROTO

/* Counts and fault-checks a call of an entry point that has no implementation (simweak.c). */
CUresult sim_unimplemented(enum sim_fn fn);

#endif
