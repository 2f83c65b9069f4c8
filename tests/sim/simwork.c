/* simdrv: work in flight, per context.
 *
 * Asynchronous copies (cuMemcpyDtoDAsync, cuMemcpyHtoDAsync, cuMemcpyDtoHAsync) and the "kernels"
 * a test launches with sim_launch_write are queued with their context and stream and run, in
 * order, when that context (or that stream) is next synchronized: cuCtxSynchronize[_v2] with it,
 * cuStreamSynchronize / cuStreamQuery of its streams (the legacy stream: the whole context), the
 * synchronous copies and sim_read/sim_write/sim_memset in it, a native cuMemFree there (and in
 * the freed block's own context), its destruction, sim_flush (every context). Landing one
 * context's work never lands another's, so a test can watch a late write reach memory that was
 * reused in between. Work whose memory is gone when it lands (unmapped, no access, freed) is a
 * hazard, as is unmapping, freeing or releasing memory that queued work still touches: the real
 * driver does not fail then, the program is just wrong. Work issued to a capturing stream is
 * recorded into the capture and never runs. */
#include "simint.h"

static bool touches_device(const sim_op_t *o, CUdeviceptr p, size_t n)
{
    bool dst = o->kind != OP_DTOH && overlaps(o->dst, o->n, p, n);
    bool src = (o->kind == OP_COPY || o->kind == OP_DTOH) && overlaps(o->src, o->n, p, n);
    return dst || src;
}

static bool touches_host(const sim_op_t *o, const void *p, size_t n)
{
    if (!o->host || o->staged)
        return false;
    uintptr_t h = (uintptr_t)o->host, q = (uintptr_t)p;
    return h < q + n && q < h + o->n;
}

static const char *op_name(const sim_op_t *o)
{
    switch (o->kind) {
    case OP_COPY: return "copy";
    case OP_FILL: return "kernel write";
    case OP_HTOD: return "host-to-device copy";
    case OP_DTOH: return "device-to-host copy";
    }
    return "?";
}

/* Runs one queued operation (its context is live: destruction lands its work first). */
static void land(sim_op_t *o)
{
    int dev = o->ctx->device;
    CUresult rc = CUDA_SUCCESS;
    if (o->kind == OP_COPY || o->kind == OP_DTOH)
        rc = check_range(o->src, o->n, dev, false);
    if (!rc && o->kind != OP_DTOH)
        rc = check_range(o->dst, o->n, dev, true);
    if (rc) {
        S.hazards++;
        fprintf(stderr,
                "simdrv: HAZARD: a queued %s 0x%llx <- 0x%llx (%zu bytes) ran after its memory "
                "went: %s\n",
                op_name(o), (unsigned long long)o->dst, (unsigned long long)o->src, o->n,
                sim_last_reason());
    } else {
        switch (o->kind) {
        case OP_COPY: do_copy(o->dst, o->src, o->n, dev); break;
        case OP_FILL: do_write(o->dst, NULL, o->fill, o->n, dev); break;
        case OP_HTOD:
            do_write(o->dst, o->staged ? o->staged : (const unsigned char *)o->host, 0, o->n, dev);
            break;
        case OP_DTOH: do_read(o->host, o->src, o->n, dev); break;
        }
    }
    free(o->staged);
    o->staged = NULL;
}

/* Lands the queued operations `which` selects, in order; the rest keep their order. */
static void land_where(bool (*which)(const sim_op_t *, const void *), const void *arg)
{
    size_t j = 0;
    for (size_t i = 0; i < S.nops; i++) {
        sim_op_t o = S.ops[i];
        if (which(&o, arg))
            land(&o);
        else
            S.ops[j++] = o;
    }
    S.nops = j;
}

static bool of_ctx(const sim_op_t *o, const void *ctx) { return o->ctx == ctx; }
static bool of_stream(const sim_op_t *o, const void *s) { return o->stream == s; }
static bool any_op(const sim_op_t *o, const void *unused)
{
    (void)o;
    (void)unused;
    return true;
}

void work_land_ctx(CUcontext c) { land_where(of_ctx, c); }
void work_land_stream(CUstream s) { land_where(of_stream, s); }
void work_land_all(void) { land_where(any_op, NULL); }

void work_forget_stream(CUstream s)
{
    for (size_t i = 0; i < S.nops; i++)
        if (S.ops[i].stream == s)
            S.ops[i].stream = NULL; /* now lands with its context only */
}

void hazard_check(const char *what, CUdeviceptr p, size_t n)
{
    for (size_t i = 0; i < S.nops; i++) {
        sim_op_t *o = &S.ops[i];
        if (touches_device(o, p, n)) {
            S.hazards++;
            fprintf(stderr,
                    "simdrv: HAZARD: %s of [0x%llx, +%zu) while a queued %s 0x%llx <- 0x%llx "
                    "(%zu bytes) may still touch it\n",
                    what, (unsigned long long)p, n, op_name(o), (unsigned long long)o->dst,
                    (unsigned long long)o->src, o->n);
        }
    }
}

void hazard_check_host(const char *what, const void *p, size_t n, bool drop)
{
    size_t j = 0;
    for (size_t i = 0; i < S.nops; i++) {
        sim_op_t o = S.ops[i];
        if (touches_host(&o, p, n)) {
            S.hazards++;
            fprintf(stderr,
                    "simdrv: HAZARD: %s of host [%p, +%zu) while a queued %s may still touch "
                    "it\n",
                    what, p, n, op_name(&o));
            if (drop) /* the host memory is about to go: the copy can never run */
                continue;
        }
        S.ops[j++] = o;
    }
    S.nops = j;
}

CUresult work_queue(const sim_op_t *op)
{
    if (stream_capturing(op->stream)) {
        op->stream->captured_ops++; /* a node of the graph being captured */
        free(op->staged);
        return CUDA_SUCCESS;
    }
    if (S.nops == S.capops) {
        S.capops = S.capops ? 2 * S.capops : 64;
        S.ops = xrealloc(S.ops, S.capops * sizeof *S.ops);
    }
    S.ops[S.nops++] = *op;
    return CUDA_SUCCESS;
}

void work_wipe(void)
{
    for (size_t i = 0; i < S.nops; i++)
        free(S.ops[i].staged);
    S.nops = 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Copies                                                                                    */

/* The synchronous copies run on the legacy stream (on = NULL), or on the per-thread default
 * stream for the _ptds exports: potentially unsafe during capture, conflicting on the legacy
 * stream with a capturing blocking stream, and waiting for the calling thread's context first. */
static CUresult sync_copy_begin(const char *what, CUstream on)
{
    CUresult rc = capture_allows(what);
    if (!rc)
        rc = capture_conflicts_legacy(on, cur_ctx(), what);
    if (rc)
        return rc;
    work_land_ctx(cur_ctx());
    return CUDA_SUCCESS;
}

/* A device-to-device copy is not synchronous with the host, even through the "synchronous" API
 * (CUDA's API synchronization behavior: "for transfers from device memory to device memory, no
 * host-side synchronization is performed"; a realloc on the H200 read its result through
 * another stream before it had run). It is queued in the legacy stream, after the context's
 * work, like cuMemcpyDtoDAsync(NULL). */
static CUresult memcpy_dtod(CUstream on, CUdeviceptr dst, CUdeviceptr src, size_t bytes)
{
    SIM_ENTER(cuMemcpyDtoD);
    NEED_CTX(dev);
    CUresult rc = capture_allows("cuMemcpyDtoD");
    if (!rc)
        rc = capture_conflicts_legacy(on, cur_ctx(), "cuMemcpyDtoD");
    if (!rc)
        rc = check_range(src, bytes, dev, false);
    if (!rc)
        rc = check_range(dst, bytes, dev, true);
    if (rc || !bytes)
        return rc;
    return work_queue(&(sim_op_t){.kind = OP_COPY, .ctx = cur_ctx(),
                                  .stream = is_default_stream(on) ? NULL : on, .dst = dst,
                                  .src = src, .n = bytes});
}

static CUresult memcpy_htod(CUstream on, CUdeviceptr dstDevice, const void *srcHost,
                            size_t ByteCount)
{
    SIM_ENTER(cuMemcpyHtoD);
    NEED_CTX(dev);
    if (!srcHost && ByteCount)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemcpyHtoD: src NULL");
    CUresult rc = sync_copy_begin("cuMemcpyHtoD", on);
    if (!rc)
        rc = check_range(dstDevice, ByteCount, dev, true);
    if (rc)
        return rc;
    do_write(dstDevice, srcHost, 0, ByteCount, dev);
    return CUDA_SUCCESS;
}

static CUresult memcpy_dtoh(CUstream on, void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    SIM_ENTER(cuMemcpyDtoH);
    NEED_CTX(dev);
    if (!dstHost && ByteCount)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemcpyDtoH: dst NULL");
    CUresult rc = sync_copy_begin("cuMemcpyDtoH", on);
    if (!rc)
        rc = check_range(srcDevice, ByteCount, dev, false);
    if (rc)
        return rc;
    do_read(dstHost, srcDevice, ByteCount, dev);
    return CUDA_SUCCESS;
}

static CUresult memset_d8(CUstream on, CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    SIM_ENTER(cuMemsetD8);
    NEED_CTX(dev);
    CUresult rc = capture_conflicts_legacy(on, cur_ctx(), "cuMemsetD8");
    if (rc)
        return rc;
    work_land_ctx(cur_ctx());
    rc = check_range(dstDevice, N, dev, true);
    if (rc)
        return rc;
    do_write(dstDevice, NULL, uc, N, dev);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemcpyDtoD)(CUdeviceptr dst, CUdeviceptr src, size_t bytes)
{
    return memcpy_dtod(NULL, dst, src, bytes);
}

CUresult SIM_IMPL(cuMemcpyHtoD)(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    return memcpy_htod(NULL, dstDevice, srcHost, ByteCount);
}

CUresult SIM_IMPL(cuMemcpyDtoH)(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    return memcpy_dtoh(NULL, dstHost, srcDevice, ByteCount);
}

CUresult SIM_IMPL(cuMemsetD8)(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    return memset_d8(NULL, dstDevice, uc, N);
}

/* Checks common to the async copies: a context, a stream, the device range. */
static CUresult async_begin(const char *what, CUstream stream, CUdeviceptr dptr, size_t n,
                            bool write, CUcontext *ctx)
{
    CUcontext cur;
    CUresult rc = need_ctx(&cur);
    if (!rc)
        rc = stream_ctx(stream, what, ctx);
    if (!rc)
        rc = capture_conflicts_legacy(stream, *ctx, what);
    if (!rc)
        rc = check_range(dptr, n, (*ctx)->device, write);
    return rc;
}

CUresult SIM_IMPL(cuMemcpyDtoDAsync)(CUdeviceptr dst, CUdeviceptr src, size_t bytes,
                                      CUstream stream)
{
    SIM_ENTER(cuMemcpyDtoDAsync);
    NEED_INIT();
    CUcontext ctx;
    CUresult rc = async_begin("cuMemcpyDtoDAsync", stream, src, bytes, false, &ctx);
    if (!rc)
        rc = check_range(dst, bytes, ctx->device, true);
    if (rc || !bytes)
        return rc;
    return work_queue(&(sim_op_t){.kind = OP_COPY, .ctx = ctx,
                                  .stream = is_default_stream(stream) ? NULL : stream,
                                  .dst = dst, .src = src, .n = bytes});
}

CUresult SIM_IMPL(cuMemcpyHtoDAsync)(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                      CUstream hStream)
{
    SIM_ENTER(cuMemcpyHtoDAsync);
    NEED_INIT();
    if (!srcHost && ByteCount)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemcpyHtoDAsync: src NULL");
    CUcontext ctx;
    CUresult rc = async_begin("cuMemcpyHtoDAsync", hStream, dstDevice, ByteCount, true, &ctx);
    if (rc || !ByteCount)
        return rc;
    sim_op_t op = {.kind = OP_HTOD, .ctx = ctx,
                   .stream = is_default_stream(hStream) ? NULL : hStream, .dst = dstDevice,
                   .n = ByteCount, .host = (void *)(uintptr_t)srcHost};
    /* From pageable memory the driver stages the bytes before returning; from pinned memory it
     * reads them when the copy runs, so a later change of the source shows. */
    if (!host_range_pinned(srcHost, ByteCount)) {
        op.staged = xcalloc(1, ByteCount);
        memcpy(op.staged, srcHost, ByteCount);
    }
    return work_queue(&op);
}

CUresult SIM_IMPL(cuMemcpyDtoHAsync)(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                      CUstream hStream)
{
    SIM_ENTER(cuMemcpyDtoHAsync);
    NEED_INIT();
    if (!dstHost && ByteCount)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemcpyDtoHAsync: dst NULL");
    CUcontext ctx;
    CUresult rc = async_begin("cuMemcpyDtoHAsync", hStream, srcDevice, ByteCount, false, &ctx);
    if (rc || !ByteCount)
        return rc;
    CUstream s = is_default_stream(hStream) ? NULL : hStream;
    if (!host_range_pinned(dstHost, ByteCount) && !stream_capturing(hStream)) {
        /* into pageable memory the copy completes before the call returns, after the stream's
         * earlier work */
        if (s)
            work_land_stream(s);
        else
            work_land_ctx(ctx);
        do_read(dstHost, srcDevice, ByteCount, ctx->device);
        return CUDA_SUCCESS;
    }
    return work_queue(&(sim_op_t){.kind = OP_DTOH, .ctx = ctx, .stream = s, .src = srcDevice,
                                  .n = ByteCount, .host = dstHost});
}

/* ---------------------------------------------------------------------------------------- */
/* The test API                                                                              */

static CUresult access_op(CUdeviceptr p, const void *src, void *dst, int fill, size_t n,
                          bool write)
{
    NEED_CTX(dev);
    work_land_ctx(cur_ctx()); /* like a synchronous copy in the calling thread's context */
    CUresult rc = check_range(p, n, dev, write);
    if (rc)
        return rc;
    if (!write)
        do_read(dst, p, n, dev);
    else
        do_write(p, src, fill, n, dev);
    return CUDA_SUCCESS;
}

CUresult sim_write(CUdeviceptr dst, const void *src, size_t n)
{
    LOCKED;
    if (!src && n)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "sim_write: src NULL");
    return access_op(dst, src, NULL, 0, n, true);
}

CUresult sim_read(void *dst, CUdeviceptr src, size_t n)
{
    LOCKED;
    if (!dst && n)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "sim_read: dst NULL");
    return access_op(src, NULL, dst, 0, n, false);
}

CUresult sim_memset(CUdeviceptr dst, int value, size_t n)
{
    LOCKED;
    return access_op(dst, NULL, NULL, value & 0xff, n, true);
}

CUresult sim_launch_write(CUcontext ctx, CUstream stream, CUdeviceptr p, size_t n, int byte)
{
    LOCKED;
    NEED_INIT();
    CUcontext c = ctx;
    if (!c) {
        CUresult rc = need_ctx(&c);
        if (rc)
            return rc;
    } else if (!ctx_valid(c)) {
        return reject(CUDA_ERROR_INVALID_CONTEXT, "sim_launch_write: %p is not a live context",
                      (void *)ctx);
    }
    if (!is_default_stream(stream)) {
        CUcontext sc;
        CUresult rc = stream_ctx(stream, "sim_launch_write", &sc);
        if (rc)
            return rc;
        if (sc != c)
            return reject(CUDA_ERROR_INVALID_HANDLE, "%s",
                          "sim_launch_write: the stream belongs to another context");
    }
    CUresult rc = capture_conflicts_legacy(stream, c, "sim_launch_write");
    if (rc)
        return rc;
    if (!n)
        return CUDA_SUCCESS;
    /* Addresses are not checked now: a kernel faults when it runs. */
    return work_queue(&(sim_op_t){.kind = OP_FILL, .ctx = c,
                                  .stream = is_default_stream(stream) ? NULL : stream, .dst = p,
                                  .n = n, .fill = byte & 0xff});
}

void sim_flush(void)
{
    LOCKED;
    work_land_all();
}

size_t sim_pending_ops(void)
{
    LOCKED;
    return S.nops;
}

size_t sim_pending_ops_ctx(CUcontext ctx)
{
    LOCKED;
    size_t k = 0;
    for (size_t i = 0; i < S.nops; i++)
        k += S.ops[i].ctx == ctx;
    return k;
}

unsigned long sim_hazards(void)
{
    LOCKED;
    return S.hazards;
}

#ifdef SIM_SHARED
/* The per-thread-default-stream exports of this file's entry points (see SIM_PT_FUNCS). */
CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    return memcpy_dtod(CU_STREAM_PER_THREAD, dst, src, n);
}

CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n)
{
    return memcpy_htod(CU_STREAM_PER_THREAD, dst, src, n);
}

CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n)
{
    return memcpy_dtoh(CU_STREAM_PER_THREAD, dst, src, n);
}

CUresult cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char uc, size_t n)
{
    return memset_d8(CU_STREAM_PER_THREAD, dst, uc, n);
}

CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream)
{
    return SIM_IMPL(cuMemcpyDtoDAsync)(dst, src, n, SIM_PT_STREAM(stream));
}

CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream stream)
{
    return SIM_IMPL(cuMemcpyHtoDAsync)(dst, src, n, SIM_PT_STREAM(stream));
}

CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream stream)
{
    return SIM_IMPL(cuMemcpyDtoHAsync)(dst, src, n, SIM_PT_STREAM(stream));
}
#endif
