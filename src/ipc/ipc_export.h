/* CUDA IPC, the export table: which buffers this process exported, under which tokens (see
 * ipc.h for the whole picture).
 *
 * An entry holds references on the buffer's chunks, so that they stay exportable while the
 * buffer lives; it is dropped once the buffer is not live any more (freed, or moved away by a
 * realloc), and a request for it is refused from then on. The listener (ipc_listener.c) takes
 * an entry's chunks for the time of one exchange and exports them batch by batch here.
 */
#ifndef VMH_IPC_EXPORT_H
#define VMH_IPC_EXPORT_H

#include <cuda.h>
#include <stdbool.h>
#include <stddef.h>

#include "heap.h"
#include "ipc_wire.h"

/* Whether the buffer that ex describes is still the live buffer it was exported from: false
 * once the program freed it (or a realloc moved it away), even when a later buffer took its
 * address (vmh_heap_export_alive with the export's serial). */
bool vmh_ipc_buffer_live(const vmh_export_t *ex);

/* cuIpcGetMemHandle's record: ex (its references pass to the table) under a fresh random
 * token, or the token of the entry of the same unchanged buffer (ex is released then).
 * CUDA_ERROR_OPERATING_SYSTEM when no random bytes could be had, CUDA_ERROR_DEINITIALIZED after
 * exit began, CUDA_ERROR_OUT_OF_MEMORY; on failure ex is left to the caller. */
CUresult vmh_ipc_export_record(vmh_export_t *ex, CUcontext ctx, vmh_ipc_token_t *token);

/* A request for token: VMH_IPC_OK with *ex, a copy of the entry holding references of its own
 * for the exchange (vmh_ipc_export_untake drops them), and the context current when it was
 * recorded; VMH_IPC_UNKNOWN_EXPORT when no entry has that token or its buffer is no longer
 * live (the entry goes then); VMH_IPC_SHUT_DOWN after exit began; VMH_IPC_EXPORT_FAILED (with
 * *driver_rc) when memory ran out. */
vmh_ipc_status_t vmh_ipc_export_take(const vmh_ipc_token_t *token, vmh_export_t *ex, CUcontext *ctx,
                                     int32_t *driver_rc);

/* cuMemExportToShareableHandle of chunks [first, first + count) of a taken ex into fds; none
 * is left open on failure. CUDA_ERROR_DEINITIALIZED once exit began (the driver may be gone). */
CUresult vmh_ipc_export_fds(const vmh_export_t *ex, CUcontext ctx, size_t first, size_t count,
                            int *fds);

/* Drops the references of a taken copy (after exit began only its array: the driver may be
 * gone, and the process ends with the references). The copy keeps its description (base, size,
 * offset, device, nchunks) with chunks NULL; a second call does nothing. */
void vmh_ipc_export_untake(vmh_export_t *ex);

/* The table's part of the IPC layer's steps (ipc.c's vmh_ipc_steps; the table registers no
 * handler of its own): at exit, after the phase left RUNNING (phase.h), the lock taken and
 * released once, so that no driver call of the table is in flight on return and none follows
 * (each reads the phase under it); the lock taken before a fork and released after it in
 * parent and child. */
void vmh_ipc_export_exit(void);
void vmh_ipc_export_prefork(void);
void vmh_ipc_export_postfork(void);

/* Drops export-table entries whose buffers the program freed (vmh_ipc_buffer_live), so that
 * their memory goes. Runs at every export, at a request for a freed buffer, and every second
 * in the listener. The heap may call it before it gives up on an allocation. Returns the
 * number of entries dropped. */
size_t vmh_ipc_prune(void);

#ifdef VMH_TESTING
/* Drops every entry; the next record starts afresh (also after a shutdown). */
void vmh_ipc_export_reset(void);
size_t vmh_ipc_export_count(void);
#endif

#endif
