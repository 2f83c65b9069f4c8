/* CUDA IPC and peer access: the entry points of IPC, over the export table (ipc_export.c), the
 * listener (ipc_listener.c) and the import side (ipc_import.c), and peer access (see ipc.h). */
#include "ipc.h"
#include "ipc_export.h"
#include "ipc_import.h"
#include "ipc_listener.h"
#include "ipc_wire.h"

#include "contexts.h"
#include "driver.h"
#include "heap.h"
#include "log.h"
#include "stats.h"

#include <assert.h>
#include <stdatomic.h>
#include <string.h>

static atomic_flag warned_handle_type = ATOMIC_FLAG_INIT;

/* Handed down by lifetime.c (vmh_ipc_configure) before any other call. */
static vmh_ipc_settings_t settings;
static void (*configured_before_export)(void);

void vmh_ipc_configure(const vmh_ipc_settings_t *s, void (*before_export)(void))
{
    assert(s != NULL && before_export != NULL);
    settings = *s;
    configured_before_export = before_export;
}

static void warn_handle_type(const char *why)
{
    if (!atomic_flag_test_and_set(&warned_handle_type))
        vmh_log("cuIpcGetMemHandle/cudaIpcGetMemHandle on a buffer served from VMM memory: "
                "CUDA_ERROR_INVALID_VALUE, as the driver answers for VMM memory (%s). Set "
                "VMMHOOK_HANDLE_TYPE=posix_fd in the exporting process (and load the library "
                "in the importing one) to make CUDA IPC of served buffers work; "
                "VMMHOOK_DISABLE=1 gives native allocations instead",
                why);
}

static bool ipc_on_pressure(void)
{
    return vmh_ipc_prune() != 0;
}

CUresult vmh_ipc_get_handle(CUdeviceptr p, CUipcMemHandle *out)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    /* The handle type the chunks were asked to carry (vmh_ipc_configure). */
    assert(configured_before_export != NULL);
    vmh_handle_kind_t kind = settings.handle;
    if (kind != VMH_HANDLE_POSIX_FD) {
        vmh_buffer_info_t bi;
        if (!vmh_heap_find(p, &bi))
            return CUDA_ERROR_NOT_FOUND;
        warn_handle_type(kind == VMH_HANDLE_FABRIC
                             ? "VMMHOOK_HANDLE_TYPE is fabric: only POSIX fds are shared"
                             : "its chunks have no shareable handle type");
        return CUDA_ERROR_INVALID_VALUE;
    }
    vmh_export_t ex;
    configured_before_export(); /* lifetime's exit and fork handlers, from now on */
    vmh_heap_on_pressure(ipc_on_pressure);
    CUresult rc = vmh_heap_export(p, &ex);
    if (rc != CUDA_SUCCESS)
        return rc; /* NOT_FOUND: freed meanwhile; the driver answers */
    for (size_t i = 0; i < ex.nchunks; i++) {
        if (!(ex.chunks[i]->handle_type & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
            vmh_heap_export_release(&ex);
            warn_handle_type("the device refused POSIX fd handles when the chunks were made");
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    CUcontext ctx = NULL;
    if (vmh_drv.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS)
        ctx = NULL;

    vmh_ipc_handle_t h;
    memset(&h, 0, sizeof h);
    h.magic = VMH_IPC_MAGIC;
    h.version = VMH_IPC_VERSION;
    h.device = ex.device;
    h.size = ex.size;
    h.offset = ex.offset;
    rc = vmh_ipc_listener_start(&h.pid, &h.socket_token);
    if (rc == CUDA_SUCCESS)
        rc = vmh_ipc_export_record(&ex, ctx, &h.export);
    if (rc != CUDA_SUCCESS) {
        vmh_heap_export_release(&ex);
        return rc;
    }
    vmh_ipc_handle_encode(&h, out);
    return CUDA_SUCCESS;
}

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
    if (vmh_drv.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    /* The driver answers CUDA_ERROR_INVALID_CONTEXT for a handle of the same process. The
     * socket token, not the pid alone: a process of another pid namespace may have our pid. */
    if (vmh_ipc_listener_is_own(h.pid, h.socket_token))
        return CUDA_ERROR_INVALID_CONTEXT;
    return vmh_ipc_import(&h, ctx, out);
}

/* ---- process events (phase.h; the order: ipc.h) ------------------------------------------- */

static void ipc_prefork(void)
{
    vmh_ipc_import_prefork();
    vmh_ipc_listener_prefork();
    vmh_ipc_export_prefork();
}

static void ipc_postfork(void)
{
    vmh_ipc_export_postfork();
    vmh_ipc_listener_postfork();
    vmh_ipc_import_postfork();
}

const vmh_steps_t vmh_ipc_steps = {.letter = 'I',
                                   .prefork = ipc_prefork,
                                   .parent = ipc_postfork,
                                   .child = ipc_postfork,
                                   .exit = vmh_ipc_export_exit};

/* ---- peer access ---------------------------------------------------------------------------- */

CUresult vmh_ipc_peer_changed(CUcontext peer, bool grant)
{
    CUdevice cur;
    int owner;
    CUresult rc = vmh_drv.cuCtxGetDevice(&cur);
    if (rc == CUDA_SUCCESS)
        rc = vmh_ctx_device_of(peer, &owner);
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
    if (vmh_drv.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    return vmh_ipc_import(&h, ctx, out);
}

void vmh_ipc_reset(void)
{
    vmh_ipc_listener_stop(); /* first: its connections give their chunks back to the table */
    vmh_ipc_export_reset();
    vmh_ipc_import_reset();
    atomic_flag_clear(&warned_handle_type);
}
#endif
