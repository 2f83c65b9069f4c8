/* The one list of the driver symbols the library interposes (layer "entry points"). Everything that
 * names them is expanded from it: the wrappers' declarations, the names dlsym matches, the
 * cuGetProcAddress answers replaced, the fall-back resolution of the real functions, the exported
 * aliases (src/vmmhook.map exports cu* by pattern: with hidden visibility only these aliases are
 * candidates), the test that exactly these are exported (tests/interpose/ip_exports.c) and
 * README's list (checked by the docs test). Adding a row takes the wrapper vmh_ip_<sym> in
 * interpose_mem.c or interpose_ctx.c (the group the row is in) and README's list regenerated;
 * nothing else names the symbols.
 *
 * X(sym, pfn, base, since, until, stream)
 *   sym     the exported name (an identifier; cuda.h's versioning macros of these names are
 *           undefined below, so that none rewrites it); the wrapper is vmh_ip_<sym>, the variant
 *           IP_<sym>
 *   pfn     the function type of that exact ABI (cudaTypedefs.h's PFN of the version that
 *           introduced it; for a v1 ABI cudaTypedefs.h keeps to the driver's own build, the PFN
 *           of the same signature, or one declared below)
 *   base    the name cuGetProcAddress takes
 *   since   the first cudaVersion the driver answers `base` with this ABI
 *   until   the first cudaVersion it answers with a newer ABI (INT_MAX: none known)
 *   stream  IP_STREAM_NONE (no per-thread-stream variant), IP_STREAM_LEGACY or IP_STREAM_PTSZ
 *           (the two variants of one base, chosen by cuGetProcAddress's flags)
 *
 * An entry point with both stream forms is one IP_STREAM_FORMS row, which makes the X rows of
 * both: `sym` (IP_STREAM_LEGACY) and `sym`_ptsz with the PFN `pfn`_ptsz (IP_STREAM_PTSZ). Their
 * wrappers are written once too (interpose.h, IP_STREAM_FORM_WRAPPERS).
 *
 * The ABIs older than cudaTypedefs.h's public PFNs (a v1 that the driver still exports for
 * old binaries) are interposed too: a program built against an old toolkit calls them.
 */
#ifndef VMH_HOOKED_H
#define VMH_HOOKED_H

#include <cuda.h>
#include <cudaTypedefs.h>
#include <limits.h>

/* A driver name here means that exact symbol, never the newer ABI cuda.h's macros put in its
 * place: the wrappers of the older ABIs (cuCtxCreate, cuCtxPushCurrent, ...) are named after
 * them, and a macro that passes a name on to another (IP_STREAM_FORMS, IP_PASS) would otherwise
 * silently reach the newer one. */
#undef cuGetProcAddress
#undef cuCtxCreate
#undef cuCtxDestroy
#undef cuCtxPushCurrent
#undef cuCtxPopCurrent
#undef cuDevicePrimaryCtxRelease
#undef cuDevicePrimaryCtxReset
#undef cuStreamBeginCapture
#undef cuStreamBeginCaptureToGraph
#undef cuStreamEndCapture
#undef cuMemAllocAsync
#undef cuMemAllocFromPoolAsync
#undef cuMemFreeAsync

enum ip_stream_kind { IP_STREAM_NONE, IP_STREAM_LEGACY, IP_STREAM_PTSZ };

/* The v1 ABIs cudaTypedefs.h declares only inside the driver's own build (the same function
 * type in both stream forms). */
typedef CUresult(CUDAAPI *IP_PFN_cuStreamBeginCapture_v10000)(CUstream hStream);
typedef IP_PFN_cuStreamBeginCapture_v10000 IP_PFN_cuStreamBeginCapture_v10000_ptsz;

/* The rows of an entry point's two stream forms (above). */
#define IP_STREAM_FORMS(X, sym, pfn, base, since, until)                                           \
    X(sym, pfn, base, since, until, IP_STREAM_LEGACY)                                              \
    X(sym##_ptsz, pfn##_ptsz, base, since, until, IP_STREAM_PTSZ)

/* clang-format off */
#define VMH_HOOKED(X) VMH_HOOKED_LOOKUP(X) VMH_HOOKED_MEM(X) VMH_HOOKED_CTX(X)

/* Lookups (interpose.c). */
#define VMH_HOOKED_LOOKUP(X)                                                                       \
    X(cuGetProcAddress, PFN_cuGetProcAddress_v11030, "cuGetProcAddress", 11030, 12000,             \
      IP_STREAM_NONE)                                                                              \
    X(cuGetProcAddress_v2, PFN_cuGetProcAddress_v12000, "cuGetProcAddress", 12000, INT_MAX,        \
      IP_STREAM_NONE)

/* Memory (interpose_mem.c). */
#define VMH_HOOKED_MEM(X)                                                                          \
    /* Allocation and free served by the library. */                                               \
    X(cuMemAlloc_v2, PFN_cuMemAlloc_v3020, "cuMemAlloc", 3020, INT_MAX, IP_STREAM_NONE)            \
    X(cuMemAllocPitch_v2, PFN_cuMemAllocPitch_v3020, "cuMemAllocPitch", 3020, INT_MAX,             \
      IP_STREAM_NONE)                                                                              \
    X(cuMemFree_v2, PFN_cuMemFree_v3020, "cuMemFree", 3020, INT_MAX, IP_STREAM_NONE)               \
    IP_STREAM_FORMS(X, cuMemFreeAsync, PFN_cuMemFreeAsync_v11020, "cuMemFreeAsync", 11020,        \
                    INT_MAX)                                                                       \
    /* Queries answered for served buffers. */                                                  \
    X(cuMemGetAddressRange_v2, PFN_cuMemGetAddressRange_v3020, "cuMemGetAddressRange", 3020,       \
      INT_MAX, IP_STREAM_NONE)                                                                     \
    X(cuPointerGetAttribute, PFN_cuPointerGetAttribute_v4000, "cuPointerGetAttribute", 4000,       \
      INT_MAX, IP_STREAM_NONE)                                                                     \
    X(cuPointerGetAttributes, PFN_cuPointerGetAttributes_v7000, "cuPointerGetAttributes", 7000,    \
      INT_MAX, IP_STREAM_NONE)                                                                     \
    X(cuMemGetInfo_v2, PFN_cuMemGetInfo_v3020, "cuMemGetInfo", 3020, INT_MAX, IP_STREAM_NONE)      \
    /* IPC and peer access. */                                                                     \
    X(cuIpcGetMemHandle, PFN_cuIpcGetMemHandle_v4010, "cuIpcGetMemHandle", 4010, INT_MAX,          \
      IP_STREAM_NONE)                                                                              \
    X(cuIpcOpenMemHandle_v2, PFN_cuIpcOpenMemHandle_v11000, "cuIpcOpenMemHandle", 11000, INT_MAX,  \
      IP_STREAM_NONE)                                                                              \
    X(cuIpcCloseMemHandle, PFN_cuIpcCloseMemHandle_v4010, "cuIpcCloseMemHandle", 4010, INT_MAX,    \
      IP_STREAM_NONE)                                                                              \
    X(cuCtxEnablePeerAccess, PFN_cuCtxEnablePeerAccess_v4000, "cuCtxEnablePeerAccess", 4000,       \
      INT_MAX, IP_STREAM_NONE)                                                                     \
    X(cuCtxDisablePeerAccess, PFN_cuCtxDisablePeerAccess_v4000, "cuCtxDisablePeerAccess", 4000,    \
      INT_MAX, IP_STREAM_NONE)                                                                     \
    /* Other allocators of the process: retried once after a trim when out of memory. */       \
    IP_STREAM_FORMS(X, cuMemAllocAsync, PFN_cuMemAllocAsync_v11020, "cuMemAllocAsync", 11020,      \
                    INT_MAX)                                                                       \
    IP_STREAM_FORMS(X, cuMemAllocFromPoolAsync, PFN_cuMemAllocFromPoolAsync_v11020,                \
                    "cuMemAllocFromPoolAsync", 11020, INT_MAX)                                     \
    X(cuMemCreate, PFN_cuMemCreate_v10020, "cuMemCreate", 10020, INT_MAX, IP_STREAM_NONE)          \
    X(cuMemAllocManaged, PFN_cuMemAllocManaged_v6000, "cuMemAllocManaged", 6000, INT_MAX,          \
      IP_STREAM_NONE)

/* Contexts, streams made and stream capture, reported to the contexts layer (interpose_ctx.c). */
#define VMH_HOOKED_CTX(X)                                                                          \
    X(cuCtxCreate, PFN_cuCtxCreate_v3020, "cuCtxCreate", 2000, 3020, IP_STREAM_NONE)               \
    X(cuCtxCreate_v2, PFN_cuCtxCreate_v3020, "cuCtxCreate", 3020, 11040, IP_STREAM_NONE)           \
    X(cuCtxCreate_v3, PFN_cuCtxCreate_v11040, "cuCtxCreate", 11040, 12050, IP_STREAM_NONE)         \
    X(cuCtxCreate_v4, PFN_cuCtxCreate_v12050, "cuCtxCreate", 12050, INT_MAX, IP_STREAM_NONE)       \
    X(cuCtxDestroy, PFN_cuCtxDestroy_v4000, "cuCtxDestroy", 2000, 4000, IP_STREAM_NONE)            \
    X(cuCtxDestroy_v2, PFN_cuCtxDestroy_v4000, "cuCtxDestroy", 4000, INT_MAX, IP_STREAM_NONE)      \
    X(cuCtxSetCurrent, PFN_cuCtxSetCurrent_v4000, "cuCtxSetCurrent", 4000, INT_MAX,                \
      IP_STREAM_NONE)                                                                              \
    X(cuCtxPushCurrent, PFN_cuCtxPushCurrent_v4000, "cuCtxPushCurrent", 2000, 4000,                \
      IP_STREAM_NONE)                                                                              \
    X(cuCtxPushCurrent_v2, PFN_cuCtxPushCurrent_v4000, "cuCtxPushCurrent", 4000, INT_MAX,          \
      IP_STREAM_NONE)                                                                              \
    X(cuCtxPopCurrent, PFN_cuCtxPopCurrent_v4000, "cuCtxPopCurrent", 2000, 4000, IP_STREAM_NONE)   \
    X(cuCtxPopCurrent_v2, PFN_cuCtxPopCurrent_v4000, "cuCtxPopCurrent", 4000, INT_MAX,             \
      IP_STREAM_NONE)                                                                              \
    X(cuDevicePrimaryCtxRetain, PFN_cuDevicePrimaryCtxRetain_v7000, "cuDevicePrimaryCtxRetain",    \
      7000, INT_MAX, IP_STREAM_NONE)                                                               \
    X(cuDevicePrimaryCtxRelease, PFN_cuDevicePrimaryCtxRelease_v11000,                             \
      "cuDevicePrimaryCtxRelease", 7000, 11000, IP_STREAM_NONE)                                    \
    X(cuDevicePrimaryCtxRelease_v2, PFN_cuDevicePrimaryCtxRelease_v11000,                          \
      "cuDevicePrimaryCtxRelease", 11000, INT_MAX, IP_STREAM_NONE)                                 \
    X(cuDevicePrimaryCtxReset, PFN_cuDevicePrimaryCtxReset_v11000, "cuDevicePrimaryCtxReset",      \
      7000, 11000, IP_STREAM_NONE)                                                                 \
    X(cuDevicePrimaryCtxReset_v2, PFN_cuDevicePrimaryCtxReset_v11000, "cuDevicePrimaryCtxReset",   \
      11000, INT_MAX, IP_STREAM_NONE)                                                              \
    IP_STREAM_FORMS(X, cuStreamBeginCapture, IP_PFN_cuStreamBeginCapture_v10000,                   \
                    "cuStreamBeginCapture", 10000, 10010)                                          \
    IP_STREAM_FORMS(X, cuStreamBeginCapture_v2, PFN_cuStreamBeginCapture_v10010,                   \
                    "cuStreamBeginCapture", 10010, INT_MAX)                                        \
    IP_STREAM_FORMS(X, cuStreamBeginCaptureToGraph, PFN_cuStreamBeginCaptureToGraph_v12030,        \
                    "cuStreamBeginCaptureToGraph", 12030, INT_MAX)                                 \
    IP_STREAM_FORMS(X, cuStreamEndCapture, PFN_cuStreamEndCapture_v10000, "cuStreamEndCapture",    \
                    10000, INT_MAX)                                                                \
    X(cuThreadExchangeStreamCaptureMode, PFN_cuThreadExchangeStreamCaptureMode_v10010,             \
      "cuThreadExchangeStreamCaptureMode", 10010, INT_MAX,                                         \
      IP_STREAM_NONE)                                                                              \
    X(cuStreamCreate, PFN_cuStreamCreate_v2000, "cuStreamCreate", 2000, INT_MAX,                  \
      IP_STREAM_NONE)                                                                              \
    X(cuStreamCreateWithPriority, PFN_cuStreamCreateWithPriority_v5050,                            \
      "cuStreamCreateWithPriority", 5050, INT_MAX, IP_STREAM_NONE)                                 \
    X(cuGreenCtxStreamCreate, PFN_cuGreenCtxStreamCreate_v12050, "cuGreenCtxStreamCreate", 12050,  \
      INT_MAX, IP_STREAM_NONE)                                                                     \
    X(cuStreamDestroy, PFN_cuStreamDestroy_v4000, "cuStreamDestroy", 2000, 4000,                   \
      IP_STREAM_NONE)                                                                              \
    X(cuStreamDestroy_v2, PFN_cuStreamDestroy_v4000, "cuStreamDestroy", 4000, INT_MAX,             \
      IP_STREAM_NONE)
/* clang-format on */

#define IP_ENUM_ITEM(sym, pfn, base, since, until, stream) IP_##sym,
enum ip_variant { VMH_HOOKED(IP_ENUM_ITEM) IP_VARIANT_COUNT };
#undef IP_ENUM_ITEM

/* A row of the table as data (interpose.c holds the array). */
typedef struct ip_hooked {
    const char *name; /* the exported name */
    const char *base; /* the cuGetProcAddress name */
    int since, until;
    enum ip_stream_kind stream;
    void *wrapper; /* the implementation (never the exported alias) */
} ip_hooked_t;

#endif
