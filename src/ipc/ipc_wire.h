/* CUDA IPC, the bottom of the IPC files: what crosses between processes and how.
 *
 * Owns: the 64-byte handle's layout, the messages on the socket, the abstract socket's name,
 * sending and receiving with descriptors (SCM_RIGHTS), peer credentials, bounded waits and the
 * random tokens. No table, no thread, no driver call: ipc_export.c and ipc_import.c build on it.
 *
 * Trust (docs/SECURITY.md): nothing in a handle is a secret from the processes of its user,
 * and nothing in it authenticates anybody. Both ends of a connection are authenticated by the
 * kernel's peer credentials (SO_PEERCRED), checked before anything else is sent or awaited: the
 * exporter serves only processes of its own effective uid, the importer talks only to a socket
 * whose owner runs as its own effective uid. Within one uid, an export is named by 128 random
 * bits (its token): a process that was not given the handle cannot guess it.
 */
#ifndef VMH_IPC_WIRE_H
#define VMH_IPC_WIRE_H

#include <cuda.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

/* ---- the handle (the 64 bytes of a CUipcMemHandle) ------------------------------------- */

#define VMH_IPC_MAGIC 0x49484d56u /* "VMHI" in memory order */
#define VMH_IPC_VERSION 2u        /* 2: 128-bit export tokens, both ends authenticated */
#define VMH_IPC_TOKEN_BYTES 16

typedef struct vmh_ipc_token {
    uint8_t b[VMH_IPC_TOKEN_BYTES];
} vmh_ipc_token_t;

typedef struct vmh_ipc_handle {
    uint32_t magic;         /* VMH_IPC_MAGIC */
    uint16_t version;       /* VMH_IPC_VERSION */
    uint16_t flags;         /* 0 */
    uint32_t pid;           /* the exporter, as it sees itself */
    int32_t device;         /* the exporter's device ordinal (information) */
    uint64_t socket_token;  /* names the exporter's socket (random; public in /proc/net/unix) */
    vmh_ipc_token_t export; /* names the export: 128 random bits, asked for in the request */
    uint64_t size;          /* the buffer's size (information) */
    uint64_t offset;        /* where the buffer starts in its first chunk (information) */
    uint64_t check;         /* a hash of the fields above: tells ours from a driver's handle */
} vmh_ipc_handle_t;

/* Fills h->check and copies h into out. */
void vmh_ipc_handle_encode(vmh_ipc_handle_t *h, CUipcMemHandle *out);

/* Copies in into *h; true when it is one of ours (magic, version and check). The check is a
 * recognizer, not a signature: anyone can make a handle that passes it. */
bool vmh_ipc_handle_decode(const CUipcMemHandle *in, vmh_ipc_handle_t *h);

/* ---- the messages (SOCK_SEQPACKET: every message arrives whole, descriptors with it) ---- */

/* importer -> exporter: one request per connection, sent only after the importer has checked
 * the exporter's credentials. */
typedef struct vmh_ipc_request {
    uint32_t magic;
    uint32_t version;
    vmh_ipc_token_t export;
} vmh_ipc_request_t;

typedef enum vmh_ipc_status {
    VMH_IPC_OK = 0,
    VMH_IPC_UNKNOWN_EXPORT = 1, /* no live export by that token (never made, wrong, or freed) */
    VMH_IPC_REFUSED_USER = 2,   /* the importer runs as another user */
    VMH_IPC_EXPORT_FAILED = 3,  /* cuMemExportToShareableHandle failed: driver_rc says how */
    VMH_IPC_BAD_REQUEST = 4,
    VMH_IPC_SHUT_DOWN = 5, /* the exporter is exiting */
    VMH_IPC_TIMED_OUT = 6, /* no request arrived in time after the connection */
} vmh_ipc_status_t;

/* exporter -> importer: the reply, then ceil(nchunks / VMH_IPC_BATCH) batches. The exporter
 * exports each batch just before it sends it and closes its copies right after, and the
 * importer imports each batch as it arrives and closes its copies: neither side ever holds more
 * than one batch of descriptors, whatever the buffer's chunk count (the descriptor limit). */
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
 * 253 per message). driver_rc non-zero: the export of this batch failed (no descriptors; the
 * exchange ends here). */
#define VMH_IPC_BATCH 32
typedef struct vmh_ipc_batch {
    uint32_t count;
    int32_t driver_rc;
    uint64_t sizes[VMH_IPC_BATCH];
} vmh_ipc_batch_t;

/* ---- sockets ------------------------------------------------------------------------------- */

/* The abstract socket name (without the leading NUL) for (pid, token); returns its length. */
size_t vmh_ipc_socket_name(char *buf, size_t len, uint32_t pid, uint64_t token);

/* A non-blocking SEQPACKET socket listening on a fresh random name for pid: its descriptor,
 * and the name's token in *token; -errno on failure. */
int vmh_ipc_listen(uint32_t pid, uint64_t *token);

/* A connection to the exporter's socket (pid, token), waiting at most until deadline_ms (a
 * full backlog makes connect wait): its descriptor, or -errno. */
int vmh_ipc_connect(uint32_t pid, uint64_t token, int64_t deadline_ms);

/* Sends one message with nfds descriptors (at most VMH_IPC_BATCH) without waiting: 0, or the
 * errno (EAGAIN when the peer's queue is full). Never raises SIGPIPE. */
int vmh_ipc_send(int fd, const void *buf, size_t len, const int *fds, size_t nfds);

/* Receives one message of exactly len bytes and up to maxfds descriptors, waiting at most until
 * deadline_ms (0: not at all). Every descriptor received lands in fds (*nfds of them: the caller
 * closes them whatever the result). Returns 0, or ETIMEDOUT, EAGAIN (deadline 0 and nothing
 * there), EPIPE (the peer closed), EPROTO (a message of another size, or descriptors lost to
 * the descriptor limit), or another errno. */
int vmh_ipc_recv(int fd, void *buf, size_t len, int *fds, size_t maxfds, size_t *nfds,
                 int64_t deadline_ms);

/* clock.h's monotonic clock in milliseconds: the clock of every deadline above. */
int64_t vmh_ipc_now_ms(void);

/* ---- credentials and tokens ---------------------------------------------------------------- */

/* Which end asks for its peer's credentials. */
typedef enum vmh_ipc_side {
    VMH_IPC_EXPORTER_ASKS, /* about a connected importer */
    VMH_IPC_IMPORTER_ASKS, /* about the exporter's socket */
} vmh_ipc_side_t;

/* The peer of fd must run as this process's effective uid: 0, EACCES (another user; *peer_uid
 * and *peer_pid say who), or the errno of the query (the caller refuses then too). */
int vmh_ipc_check_peer(int fd, vmh_ipc_side_t side, uid_t *peer_uid, pid_t *peer_pid);

/* n random bytes from getrandom (or /dev/urandom): false when neither gives them (the caller
 * refuses to make a guessable token). */
bool vmh_ipc_random(void *buf, size_t n);

/* Equality of tokens in time independent of where they differ. */
bool vmh_ipc_token_equal(const vmh_ipc_token_t *a, const vmh_ipc_token_t *b);

#ifdef VMH_TESTING
/* The credentials getter both ends use (testable.h): SO_PEERCRED in the shipped library. The
 * unit tests replace it to play another user on either side; the real second uid is tried too
 * where the tests run as root. Returns 0 or an errno. */
typedef int (*vmh_ipc_cred_fn)(int fd, vmh_ipc_side_t side, uid_t *uid, pid_t *pid);
extern _Atomic(vmh_ipc_cred_fn) vmh_ipc_peer_cred; /* atomic: the listener reads it */
int vmh_ipc_so_peercred(int fd, vmh_ipc_side_t side, uid_t *uid, pid_t *pid);
#endif

#endif
