/* CUDA IPC of served buffers (cuIpcGetMemHandle / cuIpcOpenMemHandle / cuIpcCloseMemHandle),
 * and peer access for served memory (cuCtxEnablePeerAccess / cuCtxDisablePeerAccess).
 *
 * Legacy IPC handles do not exist for VMM memory (the driver answers CUDA_ERROR_INVALID_VALUE,
 * driver-facts 3). With VMMHOOK_HANDLE_TYPE=posix_fd every chunk is created exportable as a
 * POSIX file descriptor, and a served buffer is shared like this:
 *
 *   exporter (cuIpcGetMemHandle)                 importer (cuIpcOpenMemHandle)
 *   vmh_heap_export: the buffer's chunks         reads pid, token, export id from the handle
 *   export table: id -> chunks (references)      connects to the exporter's abstract socket
 *   handle = magic, pid, token, id, ...   ---->  asks for the id
 *   listener thread (one, started lazily):
 *     SO_PEERCRED uid == own uid, else refuse
 *     cuMemExportToShareableHandle per chunk
 *     sizes + fds by SCM_RIGHTS, fds closed ---> cuMemImportFromShareableHandle per fd, fds
 *                                                closed; one reservation for all chunks, mapped
 *                                                in order, access for the current device;
 *                                                returns base + offset of the buffer
 *
 * Why a socket and not pidfd_getfd: pidfd_getfd needs ptrace rights over the exporter, which
 * containers usually lack (pytorch#165685); SCM_RIGHTS needs nothing but a socket both can
 * reach. The socket is abstract (no file, gone with the process), named from the exporter's
 * pid and a random 64-bit token, so a stale handle never reaches a later process that reused
 * the pid. Abstract names are visible to every process of the network namespace
 * (/proc/net/unix): the uid check, not the name, is what keeps other users out.
 *
 * Semantics (docs/IPC.md has the user's view):
 *   - the importer's mapping holds its own driver handles: it stays valid until the importer
 *     closes it, whatever the exporter does (free, grow, move, exit). It shows the chunks of
 *     the buffer at the time of cuIpcGetMemHandle: the size then, not a later growth.
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

#include "handle.h"

/* ---- the handle (the 64 bytes of a CUipcMemHandle) ------------------------------------- */

#define VMH_IPC_MAGIC 0x49484d56u /* "VMHI" in memory order */
#define VMH_IPC_VERSION 1u

typedef struct vmh_ipc_handle {
    uint32_t magic;   /* VMH_IPC_MAGIC */
    uint16_t version; /* VMH_IPC_VERSION */
    uint16_t flags;   /* 0 */
    uint32_t pid;     /* the exporter, as it sees itself */
    int32_t device;   /* the exporter's device ordinal (information) */
    uint64_t token;   /* the exporter's random token: names its socket */
    uint64_t id;      /* the export id in the exporter's table */
    uint64_t size;    /* the buffer's size (information) */
    uint64_t offset;  /* where the buffer starts in its first chunk (information) */
    uint64_t check;   /* a hash of the fields above: a driver's handle never passes */
    uint64_t reserved;
} vmh_ipc_handle_t;

/* ---- the wire protocol (SOCK_SEQPACKET: every message arrives whole, fds with it) ------- */

/* importer -> exporter: one request per connection. */
typedef struct vmh_ipc_request {
    uint32_t magic;
    uint32_t version;
    uint64_t token;
    uint64_t id;
} vmh_ipc_request_t;

typedef enum vmh_ipc_status {
    VMH_IPC_OK = 0,
    VMH_IPC_UNKNOWN_ID = 1,    /* no such export (never made, or the buffer was freed) */
    VMH_IPC_REFUSED_USER = 2,  /* the importer runs as another user */
    VMH_IPC_EXPORT_FAILED = 3, /* cuMemExportToShareableHandle failed: driver_rc says how */
    VMH_IPC_BAD_REQUEST = 4,
    VMH_IPC_SHUT_DOWN = 5, /* the exporter is exiting */
} vmh_ipc_status_t;

/* exporter -> importer: the header, then ceil(nchunks / VMH_IPC_BATCH) batch messages. */
typedef struct vmh_ipc_reply {
    uint32_t magic;
    uint32_t status;   /* vmh_ipc_status_t */
    int32_t driver_rc; /* the CUresult behind VMH_IPC_EXPORT_FAILED */
    int32_t device;
    uint64_t nchunks;
    uint64_t size;
    uint64_t offset;
} vmh_ipc_reply_t;

/* One batch: count chunk sizes, and count descriptors in SCM_RIGHTS (the kernel takes at most
 * 253 per message). */
#define VMH_IPC_BATCH 32
typedef struct vmh_ipc_batch {
    uint32_t count;
    uint32_t pad;
    uint64_t sizes[VMH_IPC_BATCH];
} vmh_ipc_batch_t;

/* The abstract socket name (without the leading NUL) for (pid, token); returns its length. */
size_t vmh_ipc_socket_name(char *buf, size_t len, uint32_t pid, uint64_t token);

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
 * export (the exporter is gone, the buffer was freed, or it refused this user: vmh_log says
 * which); CUDA_ERROR_MAP_FAILED when the exchange with the exporter broke; else the driver's
 * code of the import, reservation or mapping that failed (nothing is left held). */
CUresult vmh_ipc_open(const CUipcMemHandle *h, unsigned int flags, CUdeviceptr *out);

/* cuIpcCloseMemHandle: drops one reference of a pointer vmh_ipc_open returned; the last one
 * waits for the context's queued work and unmaps. CUDA_ERROR_NOT_FOUND when p was not opened
 * here (the caller passes to the driver). */
CUresult vmh_ipc_close(CUdeviceptr p);

/* After a successful cuCtxEnablePeerAccess(peer) (grant) or cuCtxDisablePeerAccess(peer)
 * (revoke) on the current context: the current context's device gains or loses access to
 * every served buffer of peer's device, existing and future (vmh_heap_set_peer_access). */
CUresult vmh_ipc_peer_changed(CUcontext peer, bool grant);

/* Drops export-table entries whose chunks nothing else in the process holds any more (the
 * exporter freed the buffer and the heap unmapped it), so that their memory goes. Runs at
 * every export, at every request, and every second in the listener. The heap may call it
 * before it gives up on an allocation. Returns the number of entries dropped. */
size_t vmh_ipc_prune(void);

/* An allocation handle for a POSIX fd exported by another process: cuMemImportFromShareableHandle,
 * size as the exporter created it, the given access descriptors applied wherever it is mapped.
 * Its last reference calls cuMemRelease (vmh_alloc_unref), exactly as for a created chunk. The
 * caller keeps and closes fd. */
CUresult vmh_alloc_import(int fd, size_t size, int device, const CUmemAccessDesc *access,
                          int naccess, vmh_alloc_t **out);

#ifdef VMH_TESTING
/* Internal to ipc.c (static in the shipped library, see testable.h). */

/* The import path without the same-process check: the simulated driver imports only fds of
 * its own process, so the unit tests open their own handles through the real socket. */
CUresult vmh_ipc_open_remote(const CUipcMemHandle *h, CUdeviceptr *out);

/* Stops the listener, drops every export and unmaps every import through the driver; the next
 * export starts afresh (new token). */
void vmh_ipc_reset(void);

/* Counts: export-table entries, live imports (distinct mappings), whether the listener runs. */
size_t vmh_ipc_export_count(void);
size_t vmh_ipc_import_count(void);
bool vmh_ipc_listening(void);

/* The uid the exporter accepts; -1 (default): its own effective uid. */
extern long vmh_ipc_accept_uid;
#endif

#endif
