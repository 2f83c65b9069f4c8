/* CUDA IPC and peer access: the entry points that need both sides of IPC, and peer access
 * (see ipc.h). The export side lives in ipc_export.c, the import side in ipc_import.c, what
 * crosses between them in ipc_wire.c. */
#include "ipc.h"
#include "ipc_export.h"
#include "ipc_import.h"
#include "ipc_wire.h"

#include "driver.h"
#include "heap.h"
#include "log.h"
#include "stats.h"

#include <string.h>

/* Counted like every driver call of the library (stats; the fault-injection tests compare). */
#define CALL(expr) (vmh_count(VMH_STAT_driver_calls, 1), (expr))

bool vmh_ipc_handle_is_ours(const CUipcMemHandle *hp)
{
    vmh_ipc_handle_t h;
    return vmh_ipc_handle_decode(hp, &h);
}

CUresult vmh_ipc_open(const CUipcMemHandle *hp, unsigned int flags, CUdeviceptr *out)
{
    if (!out || flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return CUDA_ERROR_INVALID_VALUE; /* cuda.h: the flag must be given */
    vmh_ipc_handle_t h;
    vmh_ipc_handle_decode(hp, &h);
    CUcontext ctx = NULL;
    if (CALL(vmh_drv.cuCtxGetCurrent(&ctx)) != CUDA_SUCCESS || !ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    /* The driver answers CUDA_ERROR_INVALID_CONTEXT for a handle of the same process. The
     * socket token, not the pid alone: a process of another pid namespace may have our pid. */
    if (vmh_ipc_export_is_own(h.pid, h.socket_token))
        return CUDA_ERROR_INVALID_CONTEXT;
    return vmh_ipc_import(&h, ctx, out);
}

/* ---- peer access ---------------------------------------------------------------------------- */

CUresult vmh_ipc_peer_changed(CUcontext peer, bool grant)
{
    CUdevice cur, owner;
    CUresult rc = CALL(vmh_drv.cuCtxGetDevice(&cur));
    if (rc != CUDA_SUCCESS)
        return rc;
    /* The peer context's device: asked with the context made current for a moment. */
    rc = CALL(vmh_drv.cuCtxPushCurrent(peer));
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = CALL(vmh_drv.cuCtxGetDevice(&owner));
    CUcontext popped;
    CALL(vmh_drv.cuCtxPopCurrent(&popped));
    if (rc != CUDA_SUCCESS)
        return rc;
    vmh_debug("peer access %s: device %d %s every served buffer of device %d",
              grant ? "enabled" : "disabled", (int)cur, grant ? "reaches" : "no longer reaches",
              (int)owner);
    return vmh_heap_set_peer_access((int)owner, (int)cur, grant);
}

/* ---- tests ---------------------------------------------------------------------------------- */

#ifdef VMH_TESTING
CUresult vmh_ipc_open_remote(const CUipcMemHandle *hp, CUdeviceptr *out)
{
    vmh_ipc_handle_t h;
    vmh_ipc_handle_decode(hp, &h);
    CUcontext ctx = NULL;
    if (CALL(vmh_drv.cuCtxGetCurrent(&ctx)) != CUDA_SUCCESS || !ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    return vmh_ipc_import(&h, ctx, out);
}

void vmh_ipc_reset(void)
{
    vmh_ipc_export_reset();
    vmh_ipc_import_reset();
}
#endif
