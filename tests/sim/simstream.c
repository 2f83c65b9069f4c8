/* simdrv: streams, stream capture and graphs. Streams belong to the context current when
 * they were made and go with it (simctx.c).
 *
 * Capture, as the driver documents it (cuStreamBeginCapture, cuThreadExchangeStreamCaptureMode):
 * a thread whose interaction mode is GLOBAL may not make "potentially unsafe" calls while it has
 * a capture of its own not begun RELAXED or while any other thread has a capture begun GLOBAL;
 * THREAD_LOCAL only looks at its own captures; RELAXED never refuses. A refused call answers
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture(s) that forbade it; their
 * cuStreamEndCapture then answers CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. Work issued to a
 * capturing stream is recorded, not run (graphs are never launched here). */
#include "simint.h"

void stream_free(struct CUstream_st *s)
{
    work_forget_stream(s);
    vec_remove(&S.streams, s);
    free(s);
}

/* ---------------------------------------------------------------------------------------- */
/* Streams                                                                                   */

bool is_default_stream(CUstream s)
{
    return s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD;
}

static struct CUstream_st *stream_find(CUstream s)
{
    return vec_exact(&S.streams, (CUdeviceptr)(uintptr_t)s);
}

CUresult stream_ctx(CUstream s, const char *what, CUcontext *out)
{
    if (is_default_stream(s)) {
        CUresult rc = need_ctx(out);
        if (rc)
            return reject(rc, "%s: default stream with no usable context", what);
        return CUDA_SUCCESS;
    }
    struct CUstream_st *st = stream_find(s);
    if (!st)
        return reject(CUDA_ERROR_INVALID_HANDLE, "%s: unknown stream %p", what, (void *)s);
    *out = st->ctx;
    return CUDA_SUCCESS;
}

bool stream_capturing(CUstream s)
{
    if (is_default_stream(s))
        return false;
    struct CUstream_st *st = stream_find(s);
    return st && st->capture != CAPTURE_NONE;
}

static CUresult stream_create(CUstream *phStream, unsigned int Flags)
{
    NEED_CTX(dev);
    (void)dev;
    if (!phStream)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuStreamCreate: NULL");
    if (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuStreamCreate: flags %u", Flags);
    struct CUstream_st *s = xcalloc(1, sizeof *s);
    s->iv.ptr = (CUdeviceptr)(uintptr_t)s;
    s->iv.span = 1;
    s->ctx = cur_ctx();
    s->flags = Flags;
    vec_insert(&S.streams, s);
    *phStream = s;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuStreamCreate)(CUstream *phStream, unsigned int Flags)
{
    SIM_ENTER(cuStreamCreate);
    return stream_create(phStream, Flags);
}

/* The priority only orders the GPU's choice between streams: the simulation runs each stream's
 * work in order when it is synchronized, whatever its priority. */
CUresult SIM_IMPL(cuStreamCreateWithPriority)(CUstream *phStream, unsigned int flags, int priority)
{
    SIM_ENTER(cuStreamCreateWithPriority);
    (void)priority;
    return stream_create(phStream, flags);
}

CUresult SIM_IMPL(cuStreamDestroy)(CUstream hStream)
{
    SIM_ENTER(cuStreamDestroy);
    NEED_INIT();
    struct CUstream_st *s = is_default_stream(hStream) ? NULL : stream_find(hStream);
    if (!s)
        return reject(CUDA_ERROR_INVALID_HANDLE, "%s", "cuStreamDestroy: unknown stream");
    stream_free(s); /* its work in flight stays with its context */
    return CUDA_SUCCESS;
}

/* Synchronizing or querying a capturing stream conflicts with the capture in every mode. */
static CUresult refuse_on_capturing(struct CUstream_st *s, const char *what)
{
    s->capture = CAPTURE_INVALIDATED;
    S.capture_refusals++;
    return reject(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "%s: the stream is capturing", what);
}

CUresult SIM_IMPL(cuStreamSynchronize)(CUstream stream)
{
    SIM_ENTER(cuStreamSynchronize);
    NEED_INIT();
    CUcontext ctx;
    CUresult rc = stream_ctx(stream, "cuStreamSynchronize", &ctx);
    if (rc)
        return rc;
    if (is_default_stream(stream)) {
        /* the legacy stream waits for the context's other (blocking) streams: unsafe */
        rc = capture_allows("cuStreamSynchronize");
        if (!rc)
            rc = capture_conflicts_legacy(stream, ctx, "cuStreamSynchronize");
        if (rc)
            return rc;
        ctx_sync(ctx);
        return CUDA_SUCCESS;
    }
    struct CUstream_st *s = stream_find(stream);
    if (s->capture != CAPTURE_NONE)
        return refuse_on_capturing(s, "cuStreamSynchronize");
    work_land_stream(stream);
    ctx->syncs++;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuStreamQuery)(CUstream stream)
{
    SIM_ENTER(cuStreamQuery);
    NEED_INIT();
    CUcontext ctx;
    CUresult rc = stream_ctx(stream, "cuStreamQuery", &ctx);
    if (rc)
        return rc;
    if (is_default_stream(stream)) {
        rc = capture_conflicts_legacy(stream, ctx, "cuStreamQuery");
        if (rc)
            return rc;
        work_land_ctx(ctx); /* the work is done by the time anyone asks */
        return CUDA_SUCCESS;
    }
    struct CUstream_st *s = stream_find(stream);
    if (s->capture != CAPTURE_NONE)
        return refuse_on_capturing(s, "cuStreamQuery");
    work_land_stream(stream);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------------- */
/* Capture                                                                                   */

CUresult capture_allows(const char *what)
{
    cur_ctx(); /* revalidates this thread's state */
    if (T.capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_SUCCESS;
    pthread_t self = pthread_self();
    size_t offenders = 0;
    for (size_t i = 0; i < S.streams.n; i++) {
        struct CUstream_st *s = (struct CUstream_st *)S.streams.v[i];
        if (s->capture == CAPTURE_NONE)
            continue;
        bool mine = pthread_equal(s->capture_thread, self);
        bool forbids = mine ? s->capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED
                            : T.capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL &&
                                  s->capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
        if (forbids) {
            s->capture = CAPTURE_INVALIDATED;
            offenders++;
        }
    }
    if (!offenders)
        return CUDA_SUCCESS;
    S.capture_refusals++;
    return reject(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                  "%s: not permitted during stream capture (%zu capture(s) invalidated)", what,
                  offenders);
}

/* Invalidates the captures of ctx's streams that `which` selects; how many. */
static size_t invalidate_where(CUcontext ctx, bool blocking_only)
{
    size_t n = 0;
    for (size_t i = 0; i < S.streams.n; i++) {
        struct CUstream_st *s = (struct CUstream_st *)S.streams.v[i];
        if (s->ctx != ctx || s->capture == CAPTURE_NONE)
            continue;
        if (blocking_only && (s->flags & CU_STREAM_NON_BLOCKING))
            continue;
        s->capture = CAPTURE_INVALIDATED;
        n++;
    }
    return n;
}

CUresult capture_conflicts_ctx(CUcontext ctx, const char *what)
{
    size_t n = invalidate_where(ctx, false);
    if (!n)
        return CUDA_SUCCESS;
    S.capture_refusals++;
    return reject(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                  "%s: the context has %zu capturing stream(s) (invalidated)", what, n);
}

CUresult capture_conflicts_legacy(CUstream s, CUcontext ctx, const char *what)
{
    if (s != NULL && s != CU_STREAM_LEGACY)
        return CUDA_SUCCESS;
    size_t n = invalidate_where(ctx, true);
    if (!n)
        return CUDA_SUCCESS;
    S.capture_refusals++;
    return reject(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                  "%s: the legacy stream would depend on %zu capturing blocking stream(s) "
                  "(invalidated)",
                  what, n);
}

CUresult SIM_IMPL(cuStreamBeginCapture)(CUstream hStream, CUstreamCaptureMode mode)
{
    SIM_ENTER(cuStreamBeginCapture);
    NEED_INIT();
    if (hStream == NULL || hStream == CU_STREAM_LEGACY)
        return reject(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "%s",
                      "cuStreamBeginCapture: the legacy stream cannot be captured");
    if (hStream == CU_STREAM_PER_THREAD)
        return reject(CUDA_ERROR_NOT_SUPPORTED, "%s",
                      "cuStreamBeginCapture: per-thread default stream capture is not simulated");
    struct CUstream_st *s = stream_find(hStream);
    if (!s)
        return reject(CUDA_ERROR_INVALID_HANDLE, "%s", "cuStreamBeginCapture: unknown stream");
    if ((unsigned)mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuStreamBeginCapture: mode %d", (int)mode);
    if (s->capture != CAPTURE_NONE)
        return reject(CUDA_ERROR_ILLEGAL_STATE, "%s", "cuStreamBeginCapture: already capturing");
    s->capture = CAPTURE_ACTIVE;
    s->capture_mode = mode;
    s->capture_thread = pthread_self();
    s->captured_ops = 0;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuStreamEndCapture)(CUstream hStream, CUgraph *phGraph)
{
    SIM_ENTER(cuStreamEndCapture);
    NEED_INIT();
    if (!phGraph)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuStreamEndCapture: NULL");
    struct CUstream_st *s = is_default_stream(hStream) ? NULL : stream_find(hStream);
    if (!s && !is_default_stream(hStream))
        return reject(CUDA_ERROR_INVALID_HANDLE, "%s", "cuStreamEndCapture: unknown stream");
    if (!s || s->capture == CAPTURE_NONE)
        return reject(CUDA_ERROR_ILLEGAL_STATE, "%s", "cuStreamEndCapture: not capturing");
    if (s->capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED &&
        !pthread_equal(s->capture_thread, pthread_self()))
        return reject(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "%s",
                      "cuStreamEndCapture: the capture was begun by another thread");
    bool invalidated = s->capture == CAPTURE_INVALIDATED;
    s->capture = CAPTURE_NONE;
    if (invalidated) {
        *phGraph = NULL;
        return reject(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "%s",
                      "cuStreamEndCapture: the capture was invalidated");
    }
    struct CUgraph_st *g = xcalloc(1, sizeof *g);
    g->iv.ptr = (CUdeviceptr)(uintptr_t)g;
    g->iv.span = 1;
    g->nodes = s->captured_ops;
    vec_insert(&S.graphs, g);
    *phGraph = g;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuStreamIsCapturing)(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    SIM_ENTER(cuStreamIsCapturing);
    NEED_INIT();
    if (!captureStatus)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuStreamIsCapturing: NULL");
    CUcontext ctx;
    CUresult rc = stream_ctx(hStream, "cuStreamIsCapturing", &ctx);
    if (rc)
        return rc;
    if (is_default_stream(hStream)) {
        /* The legacy stream would wait for every blocking stream of its context: asking it while
         * one of them captures is CUDA_ERROR_STREAM_CAPTURE_IMPLICIT. */
        if (hStream != CU_STREAM_PER_THREAD)
            for (size_t i = 0; i < S.streams.n; i++) {
                struct CUstream_st *s = (struct CUstream_st *)S.streams.v[i];
                if (s->ctx == ctx && s->capture != CAPTURE_NONE &&
                    !(s->flags & CU_STREAM_NON_BLOCKING))
                    return reject(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "%s",
                                  "cuStreamIsCapturing: legacy stream, a blocking stream "
                                  "captures");
            }
        *captureStatus = CU_STREAM_CAPTURE_STATUS_NONE;
        return CUDA_SUCCESS;
    }
    struct CUstream_st *s = stream_find(hStream);
    *captureStatus = s->capture == CAPTURE_ACTIVE        ? CU_STREAM_CAPTURE_STATUS_ACTIVE
                     : s->capture == CAPTURE_INVALIDATED ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                                         : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuThreadExchangeStreamCaptureMode)(CUstreamCaptureMode *mode)
{
    SIM_ENTER(cuThreadExchangeStreamCaptureMode);
    NEED_INIT();
    if (!mode || (unsigned)*mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuThreadExchangeStreamCaptureMode: mode");
    cur_ctx();
    CUstreamCaptureMode old = T.capture_mode;
    T.capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuGraphDestroy)(CUgraph hGraph)
{
    SIM_ENTER(cuGraphDestroy);
    NEED_INIT();
    struct CUgraph_st *g = hGraph ? vec_exact(&S.graphs, (CUdeviceptr)(uintptr_t)hGraph) : NULL;
    if (!g)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuGraphDestroy: unknown graph");
    vec_remove(&S.graphs, g);
    free(g);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------------- */
/* The test API                                                                              */

size_t sim_live_streams(void)
{
    LOCKED;
    return S.streams.n;
}

size_t sim_live_graphs(void)
{
    LOCKED;
    return S.graphs.n;
}

unsigned long sim_capture_refusals(void)
{
    LOCKED;
    return S.capture_refusals;
}

#ifdef SIM_SHARED
/* The per-thread-default-stream exports of this file's entry points (see SIM_PT_FUNCS). */
CUresult cuStreamSynchronize_ptsz(CUstream stream)
{
    return SIM_IMPL(cuStreamSynchronize)(SIM_PT_STREAM(stream));
}

CUresult cuStreamQuery_ptsz(CUstream stream)
{
    return SIM_IMPL(cuStreamQuery)(SIM_PT_STREAM(stream));
}

CUresult cuStreamBeginCapture_v2_ptsz(CUstream stream, CUstreamCaptureMode mode)
{
    return SIM_IMPL(cuStreamBeginCapture)(SIM_PT_STREAM(stream), mode);
}

CUresult cuStreamEndCapture_ptsz(CUstream stream, CUgraph *graph)
{
    return SIM_IMPL(cuStreamEndCapture)(SIM_PT_STREAM(stream), graph);
}

CUresult cuStreamIsCapturing_ptsz(CUstream stream, CUstreamCaptureStatus *status)
{
    return SIM_IMPL(cuStreamIsCapturing)(SIM_PT_STREAM(stream), status);
}
#endif
