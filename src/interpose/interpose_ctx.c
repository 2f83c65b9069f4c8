/* Layer "entry points": the interposed context and stream-capture entry points. Each passes the
 * call to the real driver, untouched, and reports what changed to contexts.c, so that the library
 * knows every context it must wait for before reusing freed memory, each thread's current context
 * without asking the driver, and when the driver forbids it to synchronize (a capture in progress).
 *
 * Reports follow the real call's success (a failed call changed nothing), with two exceptions
 * the driver's rules impose: a context is forgotten *before* it is destroyed (the library may
 * be waiting on it from another thread, and the driver must not destroy it under that wait),
 * and a capture is over once cuStreamEndCapture returns, whatever it answers (an invalidated
 * capture ends too). A destroy that then fails loses nothing: the context, if still current
 * somewhere, is found again when that thread's cache is checked (forgetting bumps the
 * generation).
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>

#include "contexts.h"
#include "driver.h"
#include "heap.h"
#include "interpose.h"
#include "stats.h"

/* ---------------------------------------------------------------------------------------------
 * Contexts.
 */

/* After a report that may have made a second queue of work on a device (contexts.h): the wait
 * that makes the end of reuse at once safe, before the program has the new stream or context.
 * Only where the library serves: before it does, nothing was reused. */
static void ip_after_queue_report(void)
{
    if (vmh_work_split_wait_pending() && vmh_ip_served_before())
        vmh_work_split_wait();
}

/* cuCtxCreate* makes the new context current on the calling thread. */
static CUresult ip_ctx_created(CUresult r, const CUcontext *pctx, CUdevice dev)
{
    if (r == CUDA_SUCCESS) {
        vmh_ctx_seen(*pctx, (int)dev);
        vmh_ctx_current_changed();
        ip_after_queue_report();
    }
    return r;
}

CUresult vmh_ip_cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CUresult r;
    IP_CALL_REAL(r, cuCtxCreate, pctx, flags, dev);
    return ip_ctx_created(r, pctx, dev);
}

CUresult vmh_ip_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CUresult r;
    IP_CALL_REAL(r, cuCtxCreate_v2, pctx, flags, dev);
    return ip_ctx_created(r, pctx, dev);
}

CUresult vmh_ip_cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                               unsigned int flags, CUdevice dev)
{
    CUresult r;
    IP_CALL_REAL(r, cuCtxCreate_v3, pctx, paramsArray, numParams, flags, dev);
    return ip_ctx_created(r, pctx, dev);
}

CUresult vmh_ip_cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams,
                               unsigned int flags, CUdevice dev)
{
    CUresult r;
    IP_CALL_REAL(r, cuCtxCreate_v4, pctx, ctxCreateParams, flags, dev);
    return ip_ctx_created(r, pctx, dev);
}

/* The calls that may destroy a context (a destroy; a primary context's release and reset, below):
 * forget(arg) forgets the context first, then the real call; the calling thread's current
 * context may have changed either way (a destroy pops the context from the calling thread if it
 * was current there). The forms of each differ only in the real function they call. */
#define IP_CTX_GOING_WRAPPER(sym, arg_type, forget)                                                \
    CUresult vmh_ip_##sym(arg_type arg)                                                            \
    {                                                                                              \
        forget(arg);                                                                               \
        CUresult r;                                                                                \
        IP_CALL_REAL(r, sym, arg);                                                                 \
        vmh_ctx_current_changed();                                                                 \
        return r;                                                                                  \
    }
IP_CTX_GOING_WRAPPER(cuCtxDestroy, CUcontext, vmh_ctx_forget)
IP_CTX_GOING_WRAPPER(cuCtxDestroy_v2, CUcontext, vmh_ctx_forget)

/* The calls that only change which context is current on the calling thread. */
#define IP_CURRENT_CHANGING(sym, ...)                                                              \
    do {                                                                                           \
        CUresult r_;                                                                               \
        IP_CALL_REAL(r_, sym, __VA_ARGS__);                                                        \
        if (r_ == CUDA_SUCCESS)                                                                    \
            vmh_ctx_current_changed();                                                             \
        return r_;                                                                                 \
    } while (0)

CUresult vmh_ip_cuCtxSetCurrent(CUcontext ctx)
{
    IP_CURRENT_CHANGING(cuCtxSetCurrent, ctx);
}

CUresult vmh_ip_cuCtxPushCurrent(CUcontext ctx)
{
    IP_CURRENT_CHANGING(cuCtxPushCurrent, ctx);
}

CUresult vmh_ip_cuCtxPushCurrent_v2(CUcontext ctx)
{
    IP_CURRENT_CHANGING(cuCtxPushCurrent_v2, ctx);
}

CUresult vmh_ip_cuCtxPopCurrent(CUcontext *pctx)
{
    IP_CURRENT_CHANGING(cuCtxPopCurrent, pctx);
}

CUresult vmh_ip_cuCtxPopCurrent_v2(CUcontext *pctx)
{
    IP_CURRENT_CHANGING(cuCtxPopCurrent_v2, pctx);
}

/* Primary contexts. Release and reset take a device, not the context: the primary context of
 * each device is remembered from its retains (a device's primary context keeps its handle), in
 * the device's record (heap.h). Devices past the table's end are not forgotten on release;
 * their waits then skip a context the driver says is destroyed. */

CUresult vmh_ip_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CUresult r;
    IP_CALL_REAL(r, cuDevicePrimaryCtxRetain, pctx, dev);
    if (r == CUDA_SUCCESS) {
        vmh_heap_primary_retained((int)dev, *pctx);
        vmh_ctx_seen(*pctx, (int)dev);
        ip_after_queue_report();
    }
    return r;
}

/* A release may destroy the primary context (its last reference) and a reset does: forgotten
 * first, as a destroy. Released while other references remain, it is seen again as soon as a
 * thread that has it current asks for its context. */
static void ip_primary_going(CUdevice dev)
{
    vmh_ctx_forget(vmh_heap_primary((int)dev));
}

IP_CTX_GOING_WRAPPER(cuDevicePrimaryCtxRelease, CUdevice, ip_primary_going)
IP_CTX_GOING_WRAPPER(cuDevicePrimaryCtxRelease_v2, CUdevice, ip_primary_going)
IP_CTX_GOING_WRAPPER(cuDevicePrimaryCtxReset, CUdevice, ip_primary_going)
IP_CTX_GOING_WRAPPER(cuDevicePrimaryCtxReset_v2, CUdevice, ip_primary_going)
#undef IP_CTX_GOING_WRAPPER

/* ---------------------------------------------------------------------------------------------
 * Stream capture. Every entry point has both stream forms (IP_STREAM_FORM_WRAPPERS); a capture
 * is recorded on the stream the call names (vmh_ip_stream), which captures.c pairs with the
 * calling thread when it is CU_STREAM_PER_THREAD.
 */

/* One begin call of the program, whichever ABI and stream form: captures.c makes it through
 * ip_begin_real once no library synchronize is in progress (vmh_capture_begin), and records its
 * capture. */
typedef enum {
    IP_BEGIN_V1,
    IP_BEGIN_V2,
    IP_BEGIN_TO_GRAPH,
} ip_begin_form_t;

typedef struct ip_begin_call {
    ip_begin_form_t form;
    enum ip_variant variant; /* the form's stream variant: the real function to call */
    CUstream stream;         /* as the program passed it */
    CUstreamCaptureMode mode;
    CUgraph graph;
    const CUgraphNode *dependencies;
    const CUgraphEdgeData *dependency_data;
    size_t dependency_count;
} ip_begin_call_t;

static CUresult ip_begin_real(void *arg)
{
    const ip_begin_call_t *c = arg;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    switch (c->form) {
    case IP_BEGIN_V1:
        IP_CALL_REAL_VARIANT(r, c->variant, cuStreamBeginCapture, c->stream);
        break;
    case IP_BEGIN_V2:
        IP_CALL_REAL_VARIANT(r, c->variant, cuStreamBeginCapture_v2, c->stream, c->mode);
        break;
    case IP_BEGIN_TO_GRAPH:
        IP_CALL_REAL_VARIANT(r, c->variant, cuStreamBeginCaptureToGraph, c->stream, c->graph,
                             c->dependencies, c->dependency_data, c->dependency_count, c->mode);
        break;
    }
    return r;
}

static CUresult ip_begin(ip_begin_call_t call, bool ptsz)
{
    return vmh_capture_begin(vmh_ip_stream(ptsz, call.stream), call.mode, ip_begin_real, &call);
}

/* The first ABI (CUDA 10.0) has no mode. Recorded as global, the strictest: the library then
 * refrains from whatever any mode could forbid. */
static CUresult ip_begin_v1(enum ip_variant v, bool ptsz, CUstream hStream)
{
    return ip_begin((ip_begin_call_t){.form = IP_BEGIN_V1,
                                      .variant = v,
                                      .stream = hStream,
                                      .mode = CU_STREAM_CAPTURE_MODE_GLOBAL},
                    ptsz);
}
IP_STREAM_FORM_WRAPPERS(cuStreamBeginCapture, ip_begin_v1, (CUstream hStream), (hStream))

static CUresult ip_begin_v2(enum ip_variant v, bool ptsz, CUstream hStream,
                            CUstreamCaptureMode mode)
{
    return ip_begin(
        (ip_begin_call_t){.form = IP_BEGIN_V2, .variant = v, .stream = hStream, .mode = mode},
        ptsz);
}
IP_STREAM_FORM_WRAPPERS(cuStreamBeginCapture_v2, ip_begin_v2,
                        (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode))

static CUresult ip_begin_to_graph(enum ip_variant v, bool ptsz, CUstream hStream, CUgraph hGraph,
                                  const CUgraphNode *dependencies,
                                  const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                  CUstreamCaptureMode mode)
{
    return ip_begin((ip_begin_call_t){.form = IP_BEGIN_TO_GRAPH,
                                      .variant = v,
                                      .stream = hStream,
                                      .mode = mode,
                                      .graph = hGraph,
                                      .dependencies = dependencies,
                                      .dependency_data = dependencyData,
                                      .dependency_count = numDependencies},
                    ptsz);
}
IP_STREAM_FORM_WRAPPERS(cuStreamBeginCaptureToGraph, ip_begin_to_graph,
                        (CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies,
                         const CUgraphEdgeData *dependencyData, size_t numDependencies,
                         CUstreamCaptureMode mode),
                        (hStream, hGraph, dependencies, dependencyData, numDependencies, mode))

static CUresult ip_end_capture(enum ip_variant v, bool ptsz, CUstream hStream, CUgraph *phGraph)
{
    CUresult r;
    IP_CALL_REAL_VARIANT(r, v, cuStreamEndCapture, hStream, phGraph);
    vmh_capture_ended(vmh_ip_stream(ptsz, hStream));
    return r;
}
IP_STREAM_FORM_WRAPPERS(cuStreamEndCapture, ip_end_capture, (CUstream hStream, CUgraph *phGraph),
                        (hStream, phGraph))

/* Whether the code at `caller` belongs to one of NVIDIA's dense math libraries (cuBLAS,
 * cuBLASLt, cuDNN), which make streams for their own use: cuBLASLt makes one in its first
 * heuristic query, under every PyTorch matrix product. What they run for the
 * program is ordered on the program's stream (their API's contract: work appears to happen in
 * the stream the handle is set to), so such a stream is not a second queue of the program's
 * work. NCCL and the others are not on the list: their streams run the program's own transfers
 * on its buffers. dladdr takes the loader lock: a stream is made rarely. */
static bool ip_made_by_math_library(const void *caller)
{
    static const char *const libs[] = {"libcublasLt.so", "libcublas.so", "libcudnn"};
    Dl_info di;
    if (!caller || !dladdr(caller, &di) || !di.dli_fname)
        return false;
    const char *base = strrchr(di.dli_fname, '/');
    base = base ? base + 1 : di.dli_fname;
    for (size_t i = 0; i < sizeof libs / sizeof libs[0]; i++)
        if (strncmp(base, libs[i], strlen(libs[i])) == 0)
            return true;
    return false;
}

/* A stream the program makes is a second queue of work on its device: freed memory is no
 * longer reused at once from then on (contexts.h). Reported after the driver's answer, before
 * the program has the stream: nothing can run on it before the report's wait. One made by a
 * math library for itself is counted (library_streams) and changes nothing. */
static CUresult ip_stream_created(CUresult r, const void *caller)
{
    if (r != CUDA_SUCCESS)
        return r;
    if (ip_made_by_math_library(caller)) {
        vmh_count(VMH_STAT_library_streams, 1);
        return r;
    }
    vmh_work_queue_split("a stream created");
    ip_after_queue_report();
    return r;
}

CUresult vmh_ip_cuStreamCreate(CUstream *phStream, unsigned int flags)
{
    CUresult r;
    IP_CALL_REAL(r, cuStreamCreate, phStream, flags);
    return ip_stream_created(r, __builtin_return_address(0));
}

CUresult vmh_ip_cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    CUresult r;
    IP_CALL_REAL(r, cuStreamCreateWithPriority, phStream, flags, priority);
    return ip_stream_created(r, __builtin_return_address(0));
}

CUresult vmh_ip_cuGreenCtxStreamCreate(CUstream *phStream, CUgreenCtx greenCtx, unsigned int flags,
                                       int priority)
{
    CUresult r;
    IP_CALL_REAL(r, cuGreenCtxStreamCreate, phStream, greenCtx, flags, priority);
    return ip_stream_created(r, __builtin_return_address(0));
}

/* A stream destroyed while it captures (the program never called cuStreamEndCapture, as after
 * an exception) takes its capture with it: without this report the library would believe a
 * capture still runs and refuse every wait, so that nothing freed would be reused again. After
 * the driver's answer: a failed destroy leaves the stream and its capture as they were. */
static CUresult ip_stream_destroyed(CUresult r, CUstream stream)
{
    if (r == CUDA_SUCCESS)
        vmh_capture_ended(stream);
    return r;
}

CUresult vmh_ip_cuStreamDestroy(CUstream hStream)
{
    CUresult r;
    IP_CALL_REAL(r, cuStreamDestroy, hStream);
    return ip_stream_destroyed(r, hStream);
}

CUresult vmh_ip_cuStreamDestroy_v2(CUstream hStream)
{
    CUresult r;
    IP_CALL_REAL(r, cuStreamDestroy_v2, hStream);
    return ip_stream_destroyed(r, hStream);
}

/* *mode holds the mode asked for before the call and the previous one after it. */
CUresult vmh_ip_cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    CUstreamCaptureMode wanted = mode != NULL ? *mode : CU_STREAM_CAPTURE_MODE_GLOBAL;
    CUresult r;
    IP_CALL_REAL(r, cuThreadExchangeStreamCaptureMode, mode);
    if (r == CUDA_SUCCESS)
        vmh_capture_thread_mode(wanted);
    return r;
}

/* The exported symbols (src/vmmhook.map), for programs linked with -lcuda and for RTLD_DEFAULT
 * lookups. */
VMH_HOOKED_CTX(IP_EXPORT_ALIAS)
