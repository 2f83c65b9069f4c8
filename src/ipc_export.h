/* CUDA IPC, the exporting side: the export table and the listener thread (see ipc.h for the
 * whole picture, ipc_wire.h for what crosses).
 *
 * cuIpcGetMemHandle (vmh_ipc_get_handle, declared in ipc.h) records the buffer's chunks under
 * a fresh 128-bit random token and starts, once per process, a listener thread on an abstract
 * socket. The listener never blocks on a peer: it checks each connection's credentials as it
 * accepts it, waits for requests of up to VMH_IPC_MAX_PEERS connections at once within a short
 * deadline, streams the answer without blocking, and backs off at the descriptor limit.
 */
#ifndef VMH_IPC_EXPORT_H
#define VMH_IPC_EXPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "heap.h"

/* Connections the listener serves at once; more wait in the socket's backlog. */
#define VMH_IPC_MAX_PEERS 16

/* Whether (pid, socket_token) names this process's own listener: an open of our own handle
 * gets the driver's answer for a same-process open. */
bool vmh_ipc_export_is_own(uint32_t pid, uint64_t socket_token);

/* Whether the buffer that ex describes is still the live buffer it was exported from: false
 * once the program freed it (or a realloc moved it away), and an export whose buffer is not
 * live is never served again. This is the exporter's side of the heap's promise (common
 * interface: a freed buffer's export is not importable); see ipc_export.c for how it is told
 * today. */
bool vmh_ipc_buffer_live(const vmh_export_t *ex);

#ifdef VMH_TESTING
/* Internal to ipc_export.c (testable.h). */

/* Stops the listener (its connections dropped) and drops every export; the next export starts
 * afresh (new socket, new token). */
void vmh_ipc_export_reset(void);
size_t vmh_ipc_export_count(void);
bool vmh_ipc_listening(void);

/* How long a connected importer has to send its request (milliseconds, default 2000). */
extern _Atomic int vmh_ipc_request_timeout_ms; /* atomic: the listener reads it */
#endif

#endif
