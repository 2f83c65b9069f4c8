/* Backup staging 2: the staging ring (see staging.h). */
#include "staging.h"

#include "log.h"

#include <assert.h>
#include <string.h>

CUresult vmh_staging_open(vmh_staging_t *s, CUcontext ctx, size_t slot_size, int workers)
{
    assert(ctx && slot_size > 0);
    memset(s, 0, sizeof *s);
    for (int i = 0; i < 2; i++) {
        /* PORTABLE: a tag's memory may be on several devices; one pair of slots serves all. */
        CUresult rc = vmh_drv.cuMemHostAlloc(&s->slot[i], slot_size, CU_MEMHOSTALLOC_PORTABLE);
        if (rc != CUDA_SUCCESS) {
            if (i == 1)
                vmh_drv.cuMemFreeHost(s->slot[0]);
            memset(s, 0, sizeof *s);
            return rc;
        }
    }
    s->slot_size = slot_size;
    s->pinned_in = ctx;
    vmh_copy_pool_start(&s->pool, workers);
    return CUDA_SUCCESS;
}

/* Queues the copy of piece k of [src, src + n) into slot k % 2. */
static CUresult queue_piece(vmh_staging_t *s, size_t k, CUdeviceptr src, size_t n)
{
    size_t off = k * s->slot_size;
    size_t len = n - off < s->slot_size ? n - off : s->slot_size;
    CUresult rc = vmh_drv.cuMemcpyDtoHAsync(s->slot[k % 2], src + off, len, s->stream);
    s->in_flight = rc == CUDA_SUCCESS;
    return rc;
}

CUresult vmh_staging_copy(vmh_staging_t *s, void *dst, CUdeviceptr src, size_t n)
{
    assert(s->slot[0]);
    /* A copy left queued by a failed wait (the caller may go on: a failure it takes for "skip
     * this one") must land before its slot is written again. */
    if (s->in_flight) {
        CUresult rc = vmh_drv.cuStreamSynchronize(s->stream);
        if (rc != CUDA_SUCCESS)
            return rc;
        s->in_flight = false;
    }
    if (n == 0)
        return CUDA_SUCCESS;
    if (!s->stream) {
        /* Non-blocking: the ring's copies neither wait for the program's legacy-stream work
         * (the pause waited for the device before its copies) nor make it wait. */
        CUresult rc = vmh_drv.cuStreamCreate(&s->stream, CU_STREAM_NON_BLOCKING);
        if (rc != CUDA_SUCCESS) {
            s->stream = NULL;
            return rc;
        }
    }
    size_t pieces = (n - 1) / s->slot_size + 1;
    CUresult rc = queue_piece(s, 0, src, n);
    for (size_t k = 0; k < pieces && rc == CUDA_SUCCESS; k++) {
        /* Only piece k is queued: the next one is queued after this wait, so waiting for the
         * stream is waiting for exactly this piece (no event per slot needed). */
        rc = vmh_drv.cuStreamSynchronize(s->stream);
        if (rc != CUDA_SUCCESS)
            break;
        s->in_flight = false;
        /* The driver fills the other slot while the pool empties this one. */
        if (k + 1 < pieces && (rc = queue_piece(s, k + 1, src, n)) != CUDA_SUCCESS)
            break;
        size_t off = k * s->slot_size;
        size_t len = n - off < s->slot_size ? n - off : s->slot_size;
        vmh_copy_pool_run(&s->pool, (char *)dst + off, s->slot[k % 2], len);
    }
    return rc;
}

void vmh_staging_leave_context(vmh_staging_t *s)
{
    if (!s->stream)
        return;
    /* A copy left queued by a failed wait would write into a slot after it is freed. */
    if (s->in_flight && vmh_drv.cuStreamSynchronize(s->stream) != CUDA_SUCCESS)
        vmh_log("backup staging: waiting for a queued copy failed; freeing its slot anyway");
    s->in_flight = false;
    if (vmh_drv.cuStreamDestroy(s->stream) != CUDA_SUCCESS)
        vmh_log("backup staging: cuStreamDestroy failed (the stream is left to its context)");
    s->stream = NULL;
}

void vmh_staging_close(vmh_staging_t *s)
{
    assert(!s->stream && !s->in_flight);
    vmh_copy_pool_stop(&s->pool);
    CUcontext popped;
    if (vmh_drv.cuCtxPushCurrent(s->pinned_in) != CUDA_SUCCESS) {
        vmh_log("backup staging: cannot make the slots' context current: 2 x %zu bytes of "
                "pinned host memory are not given back",
                s->slot_size);
    } else {
        for (int i = 0; i < 2; i++)
            if (vmh_drv.cuMemFreeHost(s->slot[i]) != CUDA_SUCCESS)
                vmh_log("backup staging: cuMemFreeHost of a slot failed");
        vmh_drv.cuCtxPopCurrent(&popped);
    }
    memset(s, 0, sizeof *s);
}
