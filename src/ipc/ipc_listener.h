/* CUDA IPC, the listener: one thread per exporting process, on an abstract socket, answering
 * importers' requests from the export table (see ipc.h for the whole picture, ipc_wire.h for
 * what crosses).
 *
 * It never blocks on a peer: it checks each connection's credentials as it accepts it (another
 * user is answered at once and dropped), waits for the requests of up to VMH_IPC_MAX_PEERS
 * connections at once within a short deadline, streams each answer without blocking (one
 * batch of descriptors at a time), and backs off at the descriptor limit instead of spinning.
 */
#ifndef VMH_IPC_LISTENER_H
#define VMH_IPC_LISTENER_H

#include <cuda.h>
#include <stdbool.h>
#include <stdint.h>

/* Connections the listener serves at once; more wait in the socket's backlog. */
#define VMH_IPC_MAX_PEERS 16

/* Starts the listener of this process unless it runs (a forked child gets its own): the pid
 * and socket token a handle names it by. CUDA_ERROR_OPERATING_SYSTEM when it cannot start
 * (said with vmh_log). */
CUresult vmh_ipc_listener_start(uint32_t *pid, uint64_t *socket_token);

/* Whether (pid, socket_token) names this process's own listener: an open of our own handle
 * gets the driver's answer for a same-process open. */
bool vmh_ipc_listener_is_own(uint32_t pid, uint64_t socket_token);

/* fork (the IPC layer's steps, ipc.c's vmh_ipc_steps; the listener registers no handler of
 * its own): its lock is taken before a fork and released after it. Once exit began (the phase
 * past RUNNING, phase.h) the thread stops taking connections at its next wake: nothing to do
 * at exit. A child gets its own listener (the pid tells it). */
void vmh_ipc_listener_prefork(void);
void vmh_ipc_listener_postfork(void);

#ifdef VMH_TESTING
/* Stops the listener (its connections dropped); the next start makes a new socket and token. */
void vmh_ipc_listener_stop(void);
bool vmh_ipc_listening(void);

/* How long a connected importer has to send its request, and an answered one to read it all
 * (milliseconds, defaults 2000 and 10000). Atomic: the listener reads them. */
extern _Atomic int vmh_ipc_request_timeout_ms;
extern _Atomic int vmh_ipc_send_timeout_ms;
#endif

#endif
