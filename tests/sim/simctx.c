/* simdrv: contexts (streams, capture and graphs are in simstream.c).
 *
 * Contexts: one primary context per device (S.ctx) and any number made by cuCtxCreate (S.ctxs).
 * A destroyed context stays allocated, marked CTX_DEAD, until sim_reset: a thread that still has
 * it current gets CUDA_ERROR_CONTEXT_IS_DESTROYED, and a handle passed back in is recognised
 * (CUDA_ERROR_INVALID_CONTEXT) without touching freed memory. Native blocks and streams belong to
 * the context they were made in and go with it.
 */
#include "simint.h"

/* ---------------------------------------------------------------------------------------- */
/* The calling thread's context                                                              */

/* Thread's current context (a reset invalidates every thread's stack and capture mode). */
CUcontext cur_ctx(void)
{
    if (T.gen != S.gen) {
        T.gen = S.gen;
        T.depth = 0;
        T.capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
    }
    return T.depth ? T.stack[T.depth - 1] : NULL;
}

int cur_dev(void)
{
    CUcontext c = cur_ctx();
    return c && c->magic == CTX_MAGIC ? c->device : -1;
}

CUresult need_ctx(CUcontext *out)
{
    CUcontext c = cur_ctx();
    if (!c)
        return reject(CUDA_ERROR_INVALID_CONTEXT, "%s", "no current context");
    if (c->magic != CTX_MAGIC)
        return reject(CUDA_ERROR_CONTEXT_IS_DESTROYED, "%s",
                      "the current context was destroyed");
    *out = c;
    return CUDA_SUCCESS;
}

/* A context handle of this simulation, live or destroyed (never dereferences an unknown one). */
static bool ctx_known(CUcontext c)
{
    for (int d = 0; d < ndev(); d++)
        if (c == &S.ctx[d])
            return true;
    return c && vec_exact(&S.ctxs, (CUdeviceptr)(uintptr_t)c) != NULL;
}

bool ctx_valid(CUcontext c) { return ctx_known(c) && c->magic == CTX_MAGIC; }

static void set_top(CUcontext ctx)
{
    if (T.depth)
        T.stack[T.depth - 1] = ctx;
    else
        T.stack[T.depth++] = ctx;
}

CUresult SIM_IMPL(cuCtxGetCurrent)(CUcontext *pctx)
{
    SIM_ENTER(cuCtxGetCurrent);
    NEED_INIT();
    if (!pctx)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuCtxGetCurrent: NULL");
    *pctx = cur_ctx();
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuCtxSetCurrent)(CUcontext ctx)
{
    SIM_ENTER(cuCtxSetCurrent);
    NEED_INIT();
    cur_ctx();
    if (!ctx) {
        if (T.depth)
            T.depth--;
        return CUDA_SUCCESS;
    }
    if (!ctx_valid(ctx))
        return reject(CUDA_ERROR_INVALID_CONTEXT, "%s", "cuCtxSetCurrent: invalid context");
    set_top(ctx);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuCtxPushCurrent)(CUcontext ctx)
{
    SIM_ENTER(cuCtxPushCurrent);
    NEED_INIT();
    cur_ctx();
    if (!ctx)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuCtxPushCurrent: NULL");
    if (!ctx_valid(ctx))
        return reject(CUDA_ERROR_INVALID_CONTEXT, "%s", "cuCtxPushCurrent: invalid context");
    if (T.depth == CTX_DEPTH)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuCtxPushCurrent: stack full");
    T.stack[T.depth++] = ctx;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuCtxPopCurrent)(CUcontext *pctx)
{
    SIM_ENTER(cuCtxPopCurrent);
    NEED_INIT();
    CUcontext c = cur_ctx();
    if (!c)
        return reject(CUDA_ERROR_INVALID_CONTEXT, "%s", "cuCtxPopCurrent: no current context");
    T.depth--;
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuCtxGetDevice)(CUdevice *device)
{
    SIM_ENTER(cuCtxGetDevice);
    NEED_CTX(dev);
    if (!device)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuCtxGetDevice: NULL");
    *device = dev;
    return CUDA_SUCCESS;
}

/* A synchronization of ctx (allowed by capture_allows already): its work lands. */
void ctx_sync(CUcontext ctx)
{
    work_land_ctx(ctx);
    ctx->syncs++;
}

CUresult SIM_IMPL(cuCtxSynchronize)(void)
{
    SIM_ENTER(cuCtxSynchronize);
    NEED_CTX(dev);
    (void)dev;
    CUresult rc = capture_allows("cuCtxSynchronize");
    if (!rc)
        rc = capture_conflicts_ctx(cur_ctx(), "cuCtxSynchronize");
    if (rc)
        return rc;
    ctx_sync(cur_ctx());
    return CUDA_SUCCESS;
}

/* CUDA 13's forms with a context argument (cuGetProcAddress answers them for the plain names
 * from 13000 on). ctx NULL means the current context; anything else must be a context exactly:
 * a caller that fetched these at 13000 but calls the plain ABI passes a stray register as ctx,
 * which is rejected here instead of silently working. */
static CUresult ctx_arg(CUcontext ctx, const char *what, CUcontext *out)
{
    if (!ctx) {
        CUresult rc = need_ctx(out);
        if (rc)
            return reject(rc, "%s(NULL): no current context", what);
        return CUDA_SUCCESS;
    }
    if (!ctx_valid(ctx))
        return reject(CUDA_ERROR_INVALID_CONTEXT, "%s: %p is not a context", what, (void *)ctx);
    *out = ctx;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuCtxGetDevice_v2)(CUdevice *device, CUcontext ctx)
{
    SIM_ENTER(cuCtxGetDevice_v2);
    NEED_INIT();
    CUcontext c;
    CUresult rc = ctx_arg(ctx, "cuCtxGetDevice_v2", &c);
    if (rc)
        return rc;
    if (!device)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuCtxGetDevice_v2: NULL");
    *device = c->device;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuCtxSynchronize_v2)(CUcontext ctx)
{
    SIM_ENTER(cuCtxSynchronize_v2);
    NEED_INIT();
    CUcontext c;
    CUresult rc = ctx_arg(ctx, "cuCtxSynchronize_v2", &c);
    if (rc)
        return rc;
    rc = capture_allows("cuCtxSynchronize_v2");
    if (!rc)
        rc = capture_conflicts_ctx(c, "cuCtxSynchronize_v2");
    if (rc)
        return rc;
    ctx_sync(c);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------------- */
/* Created contexts                                                                          */

/* flags cuCtxCreate takes: CU_CTX_SCHED_* (0x7), MAP_HOST, LMEM_RESIZE_TO_MAX, COREDUMP_ENABLE,
 * USER_COREDUMP_ENABLE, SYNC_MEMOPS (0x80). */
#define CTX_CREATE_FLAGS 0xffu

static CUresult ctx_create(const char *what, CUcontext *pctx, unsigned flags, CUdevice dev)
{
    if (!pctx)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: NULL", what);
    if (flags & ~CTX_CREATE_FLAGS)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: flags 0x%x", what, flags);
    if ((flags & CU_CTX_SCHED_MASK) > CU_CTX_SCHED_BLOCKING_SYNC)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: scheduling flags 0x%x", what, flags);
    NEED_DEVICE(dev, what);
    cur_ctx();
    if (T.depth == CTX_DEPTH)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: context stack full", what);
    struct CUctx_st *c = xcalloc(1, sizeof *c);
    c->iv.ptr = (CUdeviceptr)(uintptr_t)c;
    c->iv.span = 1;
    c->magic = CTX_MAGIC;
    c->device = dev;
    vec_insert(&S.ctxs, c);
    S.ctxs_live++;
    T.stack[T.depth++] = c; /* "pushes the context onto the CPU thread's stack" */
    *pctx = c;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuCtxCreate)(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                               CUdevice dev)
{
    SIM_ENTER(cuCtxCreate);
    NEED_INIT();
    /* CUctxCreateParams: "numExecAffinityParams must be 0 if execAffinityParams is NULL"
     * (cuda.h), and the two kinds of parameters exclude each other. */
    if (params &&
        ((!params->execAffinityParams && params->numExecAffinityParams) ||
         params->numExecAffinityParams < 0 || (params->execAffinityParams && params->cigParams)))
        return reject(CUDA_ERROR_INVALID_VALUE, "cuCtxCreate: %d affinity parameters at %p, CIG %p",
                      params->numExecAffinityParams, (void *)params->execAffinityParams,
                      (void *)params->cigParams);
    if (params && (params->execAffinityParams || params->numExecAffinityParams ||
                   params->cigParams))
        return reject(CUDA_ERROR_NOT_SUPPORTED, "%s",
                      "cuCtxCreate: execution affinity and CIG are not simulated");
    return ctx_create("cuCtxCreate", pctx, flags, dev);
}

CUresult SIM_IMPL(cuCtxCreate_v2)(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    SIM_ENTER(cuCtxCreate_v2);
    NEED_INIT();
    return ctx_create("cuCtxCreate_v2", pctx, flags, dev);
}

CUresult SIM_IMPL(cuCtxCreate_v3)(CUcontext *pctx, CUexecAffinityParam *paramsArray,
                                  int numParams, unsigned int flags, CUdevice dev)
{
    SIM_ENTER(cuCtxCreate_v3);
    NEED_INIT();
    if (numParams < 0 || (numParams > 0 && !paramsArray))
        return reject(CUDA_ERROR_INVALID_VALUE, "cuCtxCreate_v3: %d affinity parameters",
                      numParams);
    if (numParams > 0)
        return reject(CUDA_ERROR_NOT_SUPPORTED, "%s",
                      "cuCtxCreate_v3: execution affinity is not simulated");
    return ctx_create("cuCtxCreate_v3", pctx, flags, dev);
}

/* What a context takes with it when destroyed or reset: the work still in flight lands first
 * (destroying waits for it), then its native blocks and its streams go. */
void ctx_release_resources(CUcontext c)
{
    work_land_ctx(c);
    for (size_t i = S.natives.n; i-- > 0;) {
        sim_native_t *n = (sim_native_t *)S.natives.v[i];
        if (n->ctx == c) {
            hazard_check("context destruction", n->iv.ptr, n->size);
            native_destroy(n);
        }
    }
    for (size_t i = S.streams.n; i-- > 0;) {
        struct CUstream_st *s = (struct CUstream_st *)S.streams.v[i];
        if (s->ctx == c)
            stream_free(s);
    }
}

CUresult SIM_IMPL(cuCtxDestroy)(CUcontext ctx)
{
    SIM_ENTER(cuCtxDestroy);
    NEED_INIT();
    if (!ctx)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuCtxDestroy: NULL");
    if (!ctx_valid(ctx))
        return reject(CUDA_ERROR_INVALID_CONTEXT, "cuCtxDestroy: %p is not a live context",
                      (void *)ctx);
    if (ctx->primary)
        return reject(CUDA_ERROR_INVALID_CONTEXT, "%s",
                      "cuCtxDestroy: a primary context (use cuDevicePrimaryCtxRelease)");
    ctx_release_resources(ctx);
    ctx->magic = CTX_DEAD;
    S.ctxs_live--;
    /* Popped from the calling thread's stack; other threads keep it current, destroyed. */
    if (cur_ctx() == ctx)
        T.depth--;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------------- */
/* Primary contexts                                                                          */

CUresult SIM_IMPL(cuDevicePrimaryCtxRetain)(CUcontext *pctx, CUdevice dev)
{
    SIM_ENTER(cuDevicePrimaryCtxRetain);
    NEED_INIT();
    if (!pctx)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDevicePrimaryCtxRetain: NULL");
    NEED_DEVICE(dev, "cuDevicePrimaryCtxRetain");
    S.primary_refs[dev]++;
    *pctx = &S.ctx[dev];
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDevicePrimaryCtxRelease)(CUdevice dev)
{
    SIM_ENTER(cuDevicePrimaryCtxRelease);
    NEED_INIT();
    NEED_DEVICE(dev, "cuDevicePrimaryCtxRelease");
    if (!S.primary_refs[dev])
        return reject(CUDA_ERROR_INVALID_CONTEXT, "%s", "cuDevicePrimaryCtxRelease: not retained");
    /* "The context is automatically reset once the last reference to it is released." */
    if (--S.primary_refs[dev] == 0)
        ctx_release_resources(&S.ctx[dev]);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDevicePrimaryCtxReset)(CUdevice dev)
{
    SIM_ENTER(cuDevicePrimaryCtxReset);
    NEED_INIT();
    NEED_DEVICE(dev, "cuDevicePrimaryCtxReset");
    ctx_release_resources(&S.ctx[dev]); /* the handle stays valid; references are kept */
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuCtxEnablePeerAccess)(CUcontext peer, unsigned int flags)
{
    SIM_ENTER(cuCtxEnablePeerAccess);
    NEED_CTX(dev);
    if (flags)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuCtxEnablePeerAccess: flags");
    if (!peer || !ctx_valid(peer))
        return reject(CUDA_ERROR_INVALID_CONTEXT, "%s", "cuCtxEnablePeerAccess: invalid peer");
    if (peer->device == dev)
        return reject(CUDA_ERROR_INVALID_DEVICE, "%s", "cuCtxEnablePeerAccess: same device");
    if (S.cfg.no_peer_access)
        return reject(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "%s", "peer access unsupported");
    if (S.peer[dev][peer->device])
        return reject(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "%s", "already enabled");
    S.peer[dev][peer->device] = true;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuCtxDisablePeerAccess)(CUcontext peer)
{
    SIM_ENTER(cuCtxDisablePeerAccess);
    NEED_CTX(dev);
    if (!peer || !ctx_valid(peer))
        return reject(CUDA_ERROR_INVALID_CONTEXT, "%s", "cuCtxDisablePeerAccess: invalid peer");
    if (!S.peer[dev][peer->device])
        return reject(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "%s", "peer access not enabled");
    S.peer[dev][peer->device] = false;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------------- */
/* Reset and the test API                                                                    */

void contexts_wipe(void)
{
    while (S.streams.n)
        stream_free((struct CUstream_st *)S.streams.v[S.streams.n - 1]);
    while (S.graphs.n) {
        sim_iv_t *g = S.graphs.v[S.graphs.n - 1];
        vec_remove(&S.graphs, g);
        free(g);
    }
    while (S.ctxs.n) {
        sim_iv_t *c = S.ctxs.v[S.ctxs.n - 1];
        vec_remove(&S.ctxs, c);
        free(c);
    }
    S.ctxs_live = 0;
    S.capture_refusals = 0;
}

void sim_set_current_device(int dev)
{
    LOCKED;
    cur_ctx(); /* revalidates the stack */
    if (dev < 0) {
        T.depth = 0;
        return;
    }
    if (!S.initialized || dev >= ndev())
        die("sim_set_current_device(%d): no such device", dev);
    set_top(&S.ctx[dev]);
}

int sim_current_device(void)
{
    LOCKED;
    return cur_dev();
}

CUcontext sim_primary_context(int dev)
{
    LOCKED;
    if (!S.initialized || dev < 0 || dev >= ndev())
        die("sim_primary_context(%d): no such device", dev);
    return &S.ctx[dev];
}

size_t sim_live_contexts(void)
{
    LOCKED;
    return S.ctxs_live;
}

unsigned long sim_sync_count(CUcontext ctx)
{
    LOCKED;
    if (ctx) {
        if (!ctx_known(ctx))
            die("sim_sync_count(%p): not a context", (void *)ctx);
        return ctx->syncs;
    }
    unsigned long total = 0;
    for (int d = 0; d < ndev(); d++)
        total += S.ctx[d].syncs;
    for (size_t i = 0; i < S.ctxs.n; i++)
        total += ((struct CUctx_st *)S.ctxs.v[i])->syncs;
    return total;
}


