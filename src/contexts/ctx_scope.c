/* The library's own scopes in a context (contexts.h): the only pushes and pops of a context the
 * library makes. A scope makes a context current for the library's own driver calls (a
 * synchronize, a copy, a host registration, asking a context's device) and restores the
 * thread's context when left; a device's context is the thread's current one when it is that
 * device's, else the device's primary context, retained for the scope.
 *
 * While a thread has scopes open, its scope.known (thread_state.h) is its current context as they
 * left it (NULL: unknown, after a failed pop, until the last scope is left); with none open,
 * contexts.c's cache says it. An enter pushes unless ctx is known to be current already, so the
 * library's uses inside a program's context (a pause, a staging copy, a backup given back) make no
 * driver call for it. */
#include "contexts_internal.h"

#include "driver.h"
#include "first_use.h"
#include "log.h"
#include "thread_state.h"
#include "witness.h"

#include <stdatomic.h>
#include <stdbool.h>

/* The thread's scopes are its state's `scope` (thread_state.h). */
static atomic_flag leave_failure_logged = ATOMIC_FLAG_INIT;

static CUcontext current_known(void)
{
    if (vmh_thread.scope.depth > 0)
        return vmh_thread.scope.unsure ? NULL : vmh_thread.scope.known;
    return vmh_ctx_cached();
}

CUresult vmh_ctx_scope_enter(CUcontext ctx, CUcontext current, vmh_ctx_scope_t *scope)
{
    *scope = (vmh_ctx_scope_t){.primary = -1};
    if (ctx != current) {
        CUresult rc = vmh_drv.cuCtxPushCurrent(ctx);
        if (rc != CUDA_SUCCESS)
            return rc;
        scope->pushed = true;
    }
    scope->ctx = ctx;
    scope->outer = current_known();
    scope->depth = ++vmh_thread.scope.depth;
    vmh_thread.scope.known = ctx;
    return CUDA_SUCCESS;
}

CUresult vmh_ctx_enter(CUcontext ctx, vmh_ctx_scope_t *scope)
{
    return vmh_ctx_scope_enter(ctx, current_known(), scope);
}

CUresult vmh_ctx_leave(vmh_ctx_scope_t *scope)
{
    if (scope->ctx == NULL)
        return CUDA_SUCCESS;
    vmh_assert_internal(scope->depth == vmh_thread.scope.depth &&
                        "scopes are left in reverse order");
    CUresult rc = CUDA_SUCCESS;
    if (scope->pushed) {
        CUcontext popped = NULL;
        rc = vmh_drv.cuCtxPopCurrent(&popped);
        vmh_assert_internal(rc != CUDA_SUCCESS || popped == scope->ctx);
    }
    if (rc == CUDA_SUCCESS && scope->primary >= 0)
        rc = vmh_drv.cuDevicePrimaryCtxRelease(scope->primary);
    if (rc != CUDA_SUCCESS) {
        vmh_thread.scope.unsure = true;
        vmh_ctx_current_changed(); /* asked of the driver again */
        if (!atomic_flag_test_and_set(&leave_failure_logged))
            vmh_log("restoring a thread's context after the library's use of context %p failed "
                    "(CUDA error %d): that thread's current context may have changed (logged "
                    "once)",
                    (void *)scope->ctx, (int)rc);
    }
    vmh_thread.scope.known = scope->outer;
    if (--vmh_thread.scope.depth == 0)
        vmh_thread.scope.unsure = false;
    *scope = (vmh_ctx_scope_t){.primary = -1};
    return rc;
}

/* vmh_ctx_of_device; *primary: the device whose primary context was retained for the caller
 * (-1: the current context was of `device`, nothing retained); *current: the thread's current
 * context as the driver answered (NULL: none, or not known). */
static CUresult device_context(int device, CUcontext *ctx, CUdevice *primary, CUcontext *current)
{
    CUcontext cur = NULL;
    CUdevice cur_dev = -1, dev;
    *primary = -1;
    if (vmh_drv.cuCtxGetCurrent(&cur) != CUDA_SUCCESS)
        cur = NULL;
    *current = cur;
    if (cur != NULL && vmh_drv.cuCtxGetDevice(&cur_dev) == CUDA_SUCCESS && cur_dev == device) {
        *ctx = cur;
        return CUDA_SUCCESS;
    }
    CUresult rc = vmh_drv.cuDeviceGet(&dev, device);
    if (rc == CUDA_SUCCESS)
        rc = vmh_drv.cuDevicePrimaryCtxRetain(ctx, dev);
    if (rc == CUDA_SUCCESS)
        *primary = dev;
    return rc;
}

CUresult vmh_ctx_of_device(int device, CUcontext *ctx)
{
    CUdevice primary;
    CUcontext current;
    return device_context(device, ctx, &primary, &current);
}

CUresult vmh_ctx_enter_device(int device, vmh_ctx_scope_t *scope)
{
    CUcontext ctx = NULL, current;
    CUdevice primary;
    CUresult rc = device_context(device, &ctx, &primary, &current);
    if (rc == CUDA_SUCCESS)
        rc = vmh_ctx_scope_enter(ctx, current,
                                 scope); /* the driver's answer, fresher than the cache */
    if (rc != CUDA_SUCCESS) {
        if (primary >= 0)
            (void)vmh_drv.cuDevicePrimaryCtxRelease(primary); /* undo: what the enter made */
        *scope = (vmh_ctx_scope_t){.primary = -1};
        return rc;
    }
    scope->primary = primary;
    return CUDA_SUCCESS;
}

CUresult vmh_ctx_device_of(CUcontext ctx, int *device)
{
    vmh_ctx_scope_t scope;
    CUresult rc = vmh_ctx_enter(ctx, &scope);
    if (rc != CUDA_SUCCESS)
        return rc;
    CUdevice dev;
    rc = vmh_drv.cuCtxGetDevice(&dev);
    CUresult left = vmh_ctx_leave(&scope);
    if (rc == CUDA_SUCCESS && (rc = left) == CUDA_SUCCESS)
        *device = (int)dev;
    return rc;
}

#ifdef VMH_TESTING
void vmh_ctx_scope_reset(void)
{
    atomic_flag_clear(&leave_failure_logged);
}
#endif
