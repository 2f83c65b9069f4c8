/* CUDA IPC, the importing side: fetching an export's chunks from the exporter and mapping them
 * (see ipc.h for the whole picture, ipc_wire.h for what crosses).
 *
 * The import checks the exporter's credentials before it sends anything or waits for anything
 * (a socket of another user never learns the export's token and never hands us memory), waits
 * at most 10 s for the whole exchange, and imports each batch of
 * descriptors as it arrives, so that a buffer of any chunk count crosses within the descriptor
 * limit. Allocation handles come from handle.c (vmh_alloc_import), mappings from range.c.
 */
#ifndef VMH_IPC_IMPORT_H
#define VMH_IPC_IMPORT_H

#include <cuda.h>
#include <stddef.h>

#include "ipc_wire.h"

/* Imports, maps and records h for the context ctx (current), or finds it mapped there already
 * (one more reference). Codes: see vmh_ipc_open in ipc.h. */
CUresult vmh_ipc_import(const vmh_ipc_handle_t *h, CUcontext ctx, CUdeviceptr *out);

/* fork (the IPC layer's steps, ipc.c's vmh_ipc_steps; no file of IPC registers a handler):
 * the import table's lock is taken before a fork and released after it, in parent and child.
 * It is never held with another lock, nor across a driver call or socket call. */
void vmh_ipc_import_prefork(void);
void vmh_ipc_import_postfork(void);

/* cuIpcCloseMemHandle: drops one reference of a pointer vmh_ipc_open returned; the last one
 * waits for the context's queued work and unmaps. CUDA_ERROR_NOT_FOUND when p was not opened
 * here (the caller passes to the driver). From the phase EXITED on (or CHILD, phase.h) the mapping
 * is forgotten without a driver call: the driver may be gone, and the process ends with it. */
CUresult vmh_ipc_close(CUdeviceptr p);

#ifdef VMH_TESTING
/* Unmaps every import through the driver. */
void vmh_ipc_import_reset(void);
/* Live imports (distinct mappings). */
size_t vmh_ipc_import_count(void);
/* How long an import waits for the exporter, from connect to the last batch (milliseconds,
 * default 10000). */
extern _Atomic int vmh_ipc_exchange_timeout_ms;
#endif

#endif
