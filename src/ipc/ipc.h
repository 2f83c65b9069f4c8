/* CUDA IPC of served buffers (cuIpcGetMemHandle / cuIpcOpenMemHandle / cuIpcCloseMemHandle),
 * and peer access for served memory (cuCtxEnablePeerAccess / cuCtxDisablePeerAccess).
 *
 * Legacy IPC handles do not exist for VMM memory (the driver answers CUDA_ERROR_INVALID_VALUE,
 * driver-facts 3). With VMMHOOK_HANDLE_TYPE=posix_fd every chunk is created exportable as a
 * POSIX file descriptor, and a served buffer is shared like this:
 *
 *   exporter (cuIpcGetMemHandle)                 importer (cuIpcOpenMemHandle)
 *   vmh_heap_export: the buffer's chunks         reads pid, socket token, export token
 *   export table: 128-bit random token ->        connects to @vmmhook-ipc.<pid>.<socket token>
 *     chunks (references)                        SO_PEERCRED: the exporter's uid == own euid,
 *   handle = magic, pid, socket token,             else refuse before sending anything
 *     export token, size, offset, check ---->    sends the export token
 *   listener thread (one, started lazily, never blocking on a peer):
 *     SO_PEERCRED uid == own euid at accept, else refuse at once
 *     the request within a short deadline, else drop
 *     token unknown, or the buffer freed: refuse
 *     per batch of 32 chunks: cuMemExportToShareableHandle,
 *     sizes + fds by SCM_RIGHTS, fds closed ---> per batch: cuMemImportFromShareableHandle
 *                                                (handle.c), fds closed; then one reservation
 *                                                for all chunks, mapped in order, access for
 *                                                the current device; returns base + offset
 *
 * Files, bottom up (no file calls one above it): ipc_wire.c (handle layout, messages, socket,
 * credentials, bounded waits, tokens); ipc_export.c (the export table: tokens, references,
 * liveness, the exports of chunks); ipc_listener.c (the exporter's socket, thread and
 * connections, over the table); ipc_import.c (the exchange from the importer's side, mapping,
 * close); ipc.c (cuIpcGetMemHandle, cuIpcOpenMemHandle's same-process check, peer access).
 *
 * Why a socket and not pidfd_getfd: pidfd_getfd needs ptrace rights over the exporter, which
 * containers usually lack (pytorch#165685); SCM_RIGHTS needs nothing but a socket both can
 * reach. The socket is abstract (no file, gone with the process), named from the exporter's
 * pid and a random 64-bit token, so a stale handle never reaches a later process that reused
 * the pid. Abstract names are visible to every process of the network namespace
 * (/proc/net/unix) and anyone may bind a free one: the credential checks on both ends, not the
 * name, keep other users out (docs/SECURITY.md).
 *
 * Semantics (docs/IPC.md has the user's view):
 *   - the importer's mapping holds its own driver handles: it stays valid until the importer
 *     closes it, whatever the exporter does (free, grow, move, exit). It shows the chunks of
 *     the buffer at the time of cuIpcGetMemHandle: the size then, not a later growth.
 *   - a handle opens only while its buffer is live: once the exporter freed it (or a realloc
 *     moved it), an open answers CUDA_ERROR_INVALID_HANDLE;
 *   - one handle per buffer: cuIpcGetMemHandle of the same unchanged buffer gives the same
 *     handle (PyTorch asks once per tensor it sends);
 *   - opening a handle twice in one context returns the same pointer and counts references,
 *     as cuIpcOpenMemHandle does (cuda.h); each open needs one close;
 *   - opening a handle of this same process answers CUDA_ERROR_INVALID_CONTEXT, as the driver.
 *
 * All driver calls go through vmh_drv. Nothing here runs before the first IPC call.
 */
#ifndef VMH_IPC_H
#define VMH_IPC_H

#include <cuda.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ipc_import.h"
#include "ipc_wire.h"
#include "options.h" /* the values of VMMHOOK_HANDLE_TYPE */
#include "phase.h"

/* ---- what the layer above (lifetime.c) hands down ---------------------------------------- */

/* What this layer takes from the options; the front makes it once, at start (lifetime.c). */
typedef struct vmh_ipc_settings {
    vmh_handle_kind_t handle; /* VMMHOOK_HANDLE_TYPE: what the chunks were asked to carry */
} vmh_ipc_settings_t;

/* Called once at the library's start, before any other call here: a copy of *s is kept, and
 * before_export is called before every export: lifetime installs its IPC exit and fork
 * handling there, once, after the driver was initialized. IPC includes nothing above itself;
 * what it needs from its lifetime comes down as this data. */
void vmh_ipc_configure(const vmh_ipc_settings_t *s, void (*before_export)(void));

/* The layer's process-event steps (phase.h), walked by lifetime.c; no file of IPC registers a
 * handler. prefork takes the three locks top down (import table, listener, export table: a
 * thread of a higher one may hold its lock while it calls a lower one, never the reverse; the
 * three are never held together), parent and child release them in reverse order. exit (after
 * the phase left RUNNING: the listener stops at its next wake, the table refuses exports) waits
 * for the export table's driver call in flight, if any: none follows. From the phase EXITED on,
 * or CHILD, an import's last close forgets its mapping without a driver call. */
extern const vmh_steps_t vmh_ipc_steps;

/* vmh_ipc_close (interpose.c) is ipc_import.c's, declared in ipc_import.h, which this header
 * includes; vmh_ipc_prune is ipc_export.c's: ipc_export.h. */

/* ---- the entry points' work (interpose.c) ----------------------------------------------- */

/* cuIpcGetMemHandle of a served pointer p (interior pointers name their buffer).
 * CUDA_ERROR_NOT_FOUND: p is not in a live served buffer (the caller passes to the driver).
 * CUDA_ERROR_INVALID_VALUE: the buffer's chunks are not exportable (VMMHOOK_HANDLE_TYPE is not
 * posix_fd, or the device refused it): what the driver answers for VMM memory; said once with
 * vmh_log, naming the variable. */
CUresult vmh_ipc_get_handle(CUdeviceptr p, CUipcMemHandle *out);

/* Whether h is one of ours (magic, version and check): other handles go to the driver. */
bool vmh_ipc_handle_is_ours(const CUipcMemHandle *h);

/* cuIpcOpenMemHandle of one of our handles. flags must be CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
 * (else CUDA_ERROR_INVALID_VALUE); CUDA_ERROR_INVALID_CONTEXT without a current context or for
 * a handle of this same process; CUDA_ERROR_INVALID_HANDLE when the handle names no live
 * export (the exporter is gone, the buffer was freed, the token is wrong, or either end runs as
 * another user: vmh_log says which); CUDA_ERROR_MAP_FAILED when the exchange with the exporter
 * broke or timed out; else the driver's
 * code of the import, reservation or mapping that failed (nothing is left held). */
CUresult vmh_ipc_open(const CUipcMemHandle *h, unsigned int flags, CUdeviceptr *out);

/* After a successful cuCtxEnablePeerAccess(peer) (grant) or cuCtxDisablePeerAccess(peer)
 * (revoke) on the current context: the current context's device gains or loses access to
 * every served buffer of peer's device, existing and future (vmh_heap_set_peer_access). */
CUresult vmh_ipc_peer_changed(CUcontext peer, bool grant);

#ifdef VMH_TESTING
/* The import path without the same-process check: the simulated driver imports only fds of
 * its own process, so the unit tests open their own handles through the real socket. */
CUresult vmh_ipc_open_remote(const CUipcMemHandle *h, CUdeviceptr *out);

/* Stops the listener, drops every export and unmaps every import through the driver; the next
 * export starts afresh (new socket, new token). Counts: ipc_export.h, ipc_import.h. */
void vmh_ipc_reset(void);
#endif

#endif
