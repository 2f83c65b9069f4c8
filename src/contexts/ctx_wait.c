/* The library's waits for a device (contexts.h): every known context of the device
 * synchronized, behind the capture gate, and the one wait that ends the one-queue rule.
 *
 * The top of the contexts layer: it uses the known contexts and their wait counts
 * (contexts.c), the gate (captures.c), the library's scopes (ctx_scope.c) and the rule's state
 * (one_queue.c), and none of them calls it. It also holds the layer's test reset, which resets
 * each of those files.
 */
#include "contexts_internal.h"

#include "driver.h"
#include "log.h"
#include "stats.h"
#include "witness.h"

#include <assert.h>
#include <stdint.h>

/* What the driver answers for a context it no longer has: CUDA_ERROR_INVALID_CONTEXT when the
 * destroyed handle is passed in (cuCtxPushCurrent), CUDA_ERROR_CONTEXT_IS_DESTROYED when it is
 * still current on the calling thread (cuCtxSynchronize; cuCtxDestroy leaves it current on the
 * threads other than the destroying one). */
static bool ctx_destroyed_answer(CUresult rc)
{
    return rc == CUDA_ERROR_INVALID_CONTEXT || rc == CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

/* Synchronizes one context from the calling thread, whose current context is `current`. */
static CUresult ctx_sync_one(CUcontext ctx, CUcontext current)
{
    /* The gate: no capture began since the check of vmh_ctx_sync_device (the reclaim thread's
     * synchronize during a capture broke PyTorch's graphs). */
    assert(!vmh_capture_any() && "a context synchronize while a stream captures");
    vmh_ctx_scope_t scope;
    CUresult rc = vmh_ctx_scope_enter(ctx, current, &scope);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = vmh_drv.cuCtxSynchronize();
    CUresult left = vmh_ctx_leave(&scope);
    return rc != CUDA_SUCCESS ? rc : left;
}

/* vmh_ctx_sync_device once past the gate. */
static CUresult sync_device_gated(int device)
{
    /* The calling thread's current context, from the driver (a wait is costly anyway, and a
     * stale cache here would synchronize the wrong context). */
    CUcontext current = NULL;
    CUresult rc = vmh_drv.cuCtxGetCurrent(&current);
    if (rc != CUDA_SUCCESS)
        return rc;
    /* A wait on each context of the device, so that none is destroyed under us. */
    CUcontext one, *list;
    size_t n = vmh_ctx_waits_begin(device, current, &list, &one);
    if (n == SIZE_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;

    CUresult first_error = CUDA_SUCCESS;
    size_t gone = 0; /* the first `gone` entries of list: contexts the driver no longer knows */
    for (size_t i = 0; i < n; i++) {
        rc = ctx_sync_one(list[i], current);
        if (ctx_destroyed_answer(rc)) {
            CUcontext dead = list[i];
            list[i] = list[gone];
            list[gone++] = dead;
        } else if (rc != CUDA_SUCCESS && first_error == CUDA_SUCCESS) {
            first_error = rc;
        }
    }
    vmh_ctx_waits_end(list, n, gone, &one);
    return first_error;
}

CUresult vmh_ctx_sync_device(int device)
{
    /* Stricter than the rule for potentially unsafe calls: a context synchronize waits for
     * every stream of the context, and waiting for a capturing stream conflicts with the
     * capture whatever the modes (a device synchronize on one thread invalidates another
     * thread's thread-local capture, as TensorRT users found). Which context a capture's
     * stream belongs to is not known here, so any capture in progress refuses the wait; the
     * library then serves from memory that needs none. The check and the count are one step
     * of the gate, so a capture cannot begin between them and the synchronize. */
    /* Nothing waits for the GPU under a lock ranked after the reclaim wait lock (witness.h):
     * the heap's locks would stall every other thread behind the GPU. */
    vmh_assert_none_above(VMH_RANK_RECLAIM_WAIT);
    if (!vmh_capture_gate_sync_enter())
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    CUresult rc = sync_device_gated(device);
    vmh_capture_gate_sync_leave();
    return rc;
}

void vmh_work_split_wait(void)
{
    if (!vmh_work_split_wait_claim())
        return;
    int devices[VMH_MAX_DEVICES];
    size_t n = vmh_ctx_devices(devices, VMH_MAX_DEVICES);
    const char *why = vmh_work_split_reason();
    for (size_t k = 0; k < n; k++) {
        CUresult rc = vmh_ctx_sync_device(devices[k]);
        if (rc != CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) {
            vmh_count(VMH_STAT_syncs, 1);
            vmh_count(VMH_STAT_syncs_blocking, 1);
        }
        if (rc != CUDA_SUCCESS)
            vmh_log("waiting for device %d when the program made a second queue (%s) failed "
                    "(CUDA error %d): buffers reused just before may still be in use by work of "
                    "the old queue",
                    devices[k], why, (int)rc);
    }
}

/* The child of a fork: each file's locks anew, the other threads' waits and captures dropped
 * (contexts.h). */
static void contexts_child(void)
{
    vmh_contexts_after_fork_child();
    vmh_captures_after_fork_child();
}

const vmh_steps_t vmh_contexts_steps = {.letter = 'C', .child = contexts_child};

#ifdef VMH_TESTING
void vmh_contexts_reset(void)
{
    vmh_contexts_known_reset();
    vmh_captures_reset();
    vmh_ctx_scope_reset();
    vmh_work_reset();
}
#endif
