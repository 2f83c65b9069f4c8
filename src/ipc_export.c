/* CUDA IPC, the exporting side (see ipc_export.h).
 *
 * Owns: the export table (token -> the buffer's chunks, with references), the listener thread,
 * its abstract socket and its connections.
 *
 * Locks: ipc_lock guards the export table and the listener's state. It is held across the
 * export and release calls of the table and of the listener (never across socket I/O, never
 * while waiting), so that the exit handler, which takes it, knows no driver call of ours is in
 * flight when it marks the module shut down: after that nothing here calls the driver. The
 * listener's connections belong to the listener thread alone (no lock). No heap lock is held
 * while ipc_lock is taken; the heap's own locks are taken inside it (export, release, find).
 */
#include "ipc.h"
#include "ipc_export.h"
#include "ipc_wire.h"

#include "driver.h"
#include "heap.h"
#include "log.h"
#include "options.h"
#include "stats.h"
#include "testable.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

/* Counted like every driver call of the library (stats; the fault-injection tests compare). */
#define CALL(expr) (vmh_count(VMH_STAT_driver_calls, 1), (expr))

VMH_TESTABLE _Atomic int vmh_ipc_request_timeout_ms = 2000;

/* How long an importer that stopped reading may keep its connection. */
#define IPC_SEND_TIMEOUT_MS 10000
/* The listener lets go of the exports of freed buffers this often when idle. */
#define IPC_PRUNE_EVERY_MS 1000
/* At the descriptor limit, the listener waits this long (doubling) before it accepts again. */
#define IPC_BACKOFF_FIRST_MS 50
#define IPC_BACKOFF_MAX_MS 1000
/* Enough socket buffer for a few batches only: descriptors in flight count against the
 * sender's descriptor limit (ETOOMANYREFS), so the stream waits for the importer instead. */
#define IPC_PEER_SNDBUF 4096

typedef struct export_entry {
    vmh_ipc_token_t token;
    vmh_export_t ex;
    CUcontext ctx; /* current at cuIpcGetMemHandle: tried when an export needs a context */
} export_entry_t;

typedef struct listener {
    int listen_fd;
    int event_fd;
} listener_t;

static pthread_mutex_t ipc_lock = PTHREAD_MUTEX_INITIALIZER;
static export_entry_t *exports;
static size_t nexports, exports_cap;
static bool listening;     /* a listener runs for own_pid */
static uint32_t own_pid;   /* the process the listener was started in */
static uint64_t own_token; /* names its socket */
static pthread_t listener_thread;
static listener_t *listener;
static atomic_bool listener_stop;
static bool ipc_shut; /* exit: no more driver calls from here */
static bool exit_registered;
static atomic_flag warned_handle_type = ATOMIC_FLAG_INIT;
static atomic_flag warned_refusal = ATOMIC_FLAG_INIT;
static atomic_flag warned_fd_limit = ATOMIC_FLAG_INIT;

/* ---- the table ---------------------------------------------------------------------------- */

/* Told by the heap's lookup today: the buffer is live when the heap still serves a buffer that
 * starts where the exported one started (a grow in place keeps it, a free or a move ends it).
 * The heap's per-buffer generation (common.md: the heap helper's part) will make this exact:
 * a new buffer that lands at the same address is not the exported one. Until the heap recycles
 * exported memory that difference cannot expose another buffer's data: the table's references
 * keep the freed buffer's own chunks. */
bool vmh_ipc_buffer_live(const vmh_export_t *ex)
{
    vmh_buffer_info_t bi;
    return vmh_heap_find(ex->base, &bi) && bi.base == ex->base;
}

/* Drops the entries whose buffers are no longer live; their references go, and with the last
 * one the memory. ipc_lock held. */
static size_t prune_locked(void)
{
    if (ipc_shut)
        return 0;
    size_t w = 0, dropped = 0;
    for (size_t i = 0; i < nexports; i++) {
        if (vmh_ipc_buffer_live(&exports[i].ex)) {
            exports[w++] = exports[i];
            continue;
        }
        vmh_debug("IPC export of %zu bytes at 0x%llx released: the buffer was freed",
                  exports[i].ex.size, (unsigned long long)exports[i].ex.base);
        vmh_heap_export_release(&exports[i].ex);
        dropped++;
    }
    nexports = w;
    return dropped;
}

size_t vmh_ipc_prune(void)
{
    pthread_mutex_lock(&ipc_lock);
    size_t n = prune_locked();
    pthread_mutex_unlock(&ipc_lock);
    return n;
}

static export_entry_t *find_locked(const vmh_ipc_token_t *token)
{
    export_entry_t *found = NULL;
    for (size_t i = 0; i < nexports; i++) /* every entry compared: no early exit to time */
        if (vmh_ipc_token_equal(&exports[i].token, token))
            found = &exports[i];
    return found;
}

/* Runs before libcuda's own teardown (registered after the driver was loaded, and atexit
 * handlers run in reverse order of registration, before the loader's destructors): from here
 * the listener makes no driver call. */
static void ipc_atexit(void)
{
    pthread_mutex_lock(&ipc_lock);
    ipc_shut = true;
    pthread_mutex_unlock(&ipc_lock);
    atomic_store(&listener_stop, true);
}

/* fork: the child must not inherit ipc_lock held by the listener (it prunes every second and
 * exports under it). */
static void ipc_prefork(void)
{
    pthread_mutex_lock(&ipc_lock);
}

static void ipc_postfork(void)
{
    pthread_mutex_unlock(&ipc_lock);
}

/* cuMemExportToShareableHandle of chunks [first, first + count) of ex into fds; ipc_lock held.
 * The VMM calls need no context; should a driver want one, the context current at
 * cuIpcGetMemHandle is tried. On failure no descriptor is left open. */
static CUresult export_fds_locked(const vmh_export_t *ex, CUcontext ctx, size_t first,
                                  size_t count, int *fds)
{
    if (ipc_shut)
        return CUDA_ERROR_DEINITIALIZED;
    CUresult rc = CUDA_SUCCESS;
    size_t done = 0;
    while (done < count) {
        CUmemGenericAllocationHandle h = ex->chunks[first + done]->handle;
        rc = CALL(vmh_drv.cuMemExportToShareableHandle(
            &fds[done], h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        if (rc == CUDA_ERROR_INVALID_CONTEXT && ctx &&
            CALL(vmh_drv.cuCtxPushCurrent(ctx)) == CUDA_SUCCESS) {
            rc = CALL(vmh_drv.cuMemExportToShareableHandle(
                &fds[done], h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
            CUcontext popped;
            CALL(vmh_drv.cuCtxPopCurrent(&popped));
        }
        if (rc != CUDA_SUCCESS)
            break;
        done++;
    }
    if (rc != CUDA_SUCCESS)
        for (size_t i = 0; i < done; i++)
            close(fds[i]);
    return rc;
}

/* ---- one connection ------------------------------------------------------------------------ */

typedef struct peer {
    int fd;
    int64_t deadline_ms;
    bool answering;     /* the request arrived: the reply and the batches go out */
    bool reply_unsent;  /* the reply waits for room in the socket */
    bool blocked;       /* the last send found no room: wait for POLLOUT */
    vmh_ipc_reply_t reply;
    vmh_export_t ex;    /* answering: the chunks, with references of this exchange */
    CUcontext ctx;
    size_t next;        /* the first chunk not yet exported */
    vmh_ipc_batch_t batch;
    int fds[VMH_IPC_BATCH];
    size_t nfds;        /* exported descriptors of batch, not yet sent */
    bool batch_ready;
} peer_t;

static void peer_drop(peer_t *pr)
{
    for (size_t i = 0; i < pr->nfds; i++)
        close(pr->fds[i]);
    pr->nfds = 0;
    if (pr->ex.chunks) {
        pthread_mutex_lock(&ipc_lock);
        /* After exit began the driver may be gone: leave the references (the process ends). */
        if (!ipc_shut)
            vmh_heap_export_release(&pr->ex);
        else
            free(pr->ex.chunks);
        pthread_mutex_unlock(&ipc_lock);
        pr->ex.chunks = NULL;
    }
    close(pr->fd);
    pr->fd = -1;
}

/* Exports the next batch of pr's chunks into pr->batch and pr->fds. */
static void prepare_batch(peer_t *pr)
{
    size_t left = pr->ex.nchunks - pr->next;
    size_t count = left < VMH_IPC_BATCH ? left : VMH_IPC_BATCH;
    memset(&pr->batch, 0, sizeof pr->batch);
    pthread_mutex_lock(&ipc_lock);
    CUresult rc = export_fds_locked(&pr->ex, pr->ctx, pr->next, count, pr->fds);
    pthread_mutex_unlock(&ipc_lock);
    if (rc != CUDA_SUCCESS) {
        vmh_log("CUDA IPC: cuMemExportToShareableHandle failed with CUDA error %d; the importer "
                "gets CUDA_ERROR_MAP_FAILED",
                (int)rc);
        pr->batch.driver_rc = (int32_t)rc;
        pr->nfds = 0;
    } else {
        pr->batch.count = (uint32_t)count;
        for (size_t i = 0; i < count; i++)
            pr->batch.sizes[i] = pr->ex.chunks[pr->next + i]->size;
        pr->nfds = count;
        pr->next += count;
    }
    pr->batch_ready = true;
}

/* Sends what pr has to send until the socket is full (pr->blocked) or the exchange is over.
 * Returns false when the connection is done with (finished or broken). */
static bool peer_pump(peer_t *pr)
{
    pr->blocked = false;
    if (pr->reply_unsent) {
        int err = vmh_ipc_send(pr->fd, &pr->reply, sizeof pr->reply, NULL, 0);
        if (err == EAGAIN) {
            pr->blocked = true;
            return true;
        }
        if (err || pr->reply.status != VMH_IPC_OK)
            return false;
        pr->reply_unsent = false;
    }
    for (;;) {
        if (!pr->batch_ready) {
            if (pr->next == pr->ex.nchunks)
                return false; /* all sent: the importer has its own descriptors now */
            prepare_batch(pr);
        }
        int err = vmh_ipc_send(pr->fd, &pr->batch, sizeof pr->batch, pr->fds, pr->nfds);
        if (err == EAGAIN) {
            pr->blocked = true;
            return true;
        }
        /* Sent or failed, our copies of the descriptors go either way. */
        for (size_t i = 0; i < pr->nfds; i++)
            close(pr->fds[i]);
        pr->nfds = 0;
        pr->batch_ready = false;
        if (err || pr->batch.driver_rc)
            return false;
    }
}

/* The request arrived: find the export, take references on its chunks for the time of the
 * exchange (a prune or reset meanwhile then cannot release them), export the first batch, all
 * under the lock; then start sending. */
static bool peer_answer(peer_t *pr, const vmh_ipc_request_t *req)
{
    vmh_ipc_reply_t *rep = &pr->reply;
    memset(rep, 0, sizeof *rep);
    rep->magic = VMH_IPC_MAGIC;
    rep->device = -1;
    pr->answering = true;
    pr->reply_unsent = true;
    pr->deadline_ms = vmh_ipc_now_ms() + IPC_SEND_TIMEOUT_MS;
    if (req->magic != VMH_IPC_MAGIC || req->version != VMH_IPC_VERSION) {
        rep->status = VMH_IPC_BAD_REQUEST;
        return peer_pump(pr);
    }
    pthread_mutex_lock(&ipc_lock);
    export_entry_t *e = ipc_shut ? NULL : find_locked(&req->export);
    if (e && !vmh_ipc_buffer_live(&e->ex)) {
        prune_locked(); /* freed: the entry goes now, not at the next idle second */
        e = NULL;
    }
    if (ipc_shut) {
        rep->status = VMH_IPC_SHUT_DOWN;
    } else if (!e) {
        rep->status = VMH_IPC_UNKNOWN_EXPORT;
    } else {
        pr->ex = e->ex;
        pr->ctx = e->ctx;
        pr->ex.chunks = malloc(e->ex.nchunks * sizeof *pr->ex.chunks);
        if (!pr->ex.chunks) {
            rep->status = VMH_IPC_EXPORT_FAILED;
            rep->driver_rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            for (size_t i = 0; i < e->ex.nchunks; i++)
                pr->ex.chunks[i] = vmh_alloc_ref(e->ex.chunks[i]);
        }
    }
    pthread_mutex_unlock(&ipc_lock);
    if (rep->status == VMH_IPC_OK) {
        /* The first batch before the reply: a refusal of the driver is the reply's status. */
        prepare_batch(pr);
        if (pr->batch.driver_rc) {
            rep->status = VMH_IPC_EXPORT_FAILED;
            rep->driver_rc = pr->batch.driver_rc;
        } else {
            rep->device = pr->ex.device;
            rep->nchunks = pr->ex.nchunks;
            rep->size = pr->ex.size;
            rep->offset = pr->ex.offset;
        }
    }
    return peer_pump(pr);
}

/* Input on a connection waiting for its request. Returns false when it is done with. */
static bool peer_readable(peer_t *pr)
{
    vmh_ipc_request_t req;
    size_t nfd = 0;
    int junk[VMH_IPC_BATCH];
    int err = vmh_ipc_recv(pr->fd, &req, sizeof req, junk, VMH_IPC_BATCH, &nfd, 0);
    for (size_t i = 0; i < nfd; i++)
        close(junk[i]); /* an importer sends none */
    if (err == EAGAIN)
        return true;
    if (err == EPROTO) {
        memset(&req, 0, sizeof req); /* answered as a bad request */
        return peer_answer(pr, &req);
    }
    if (err)
        return false; /* gone */
    return peer_answer(pr, &req);
}

/* Reads and drops what a refused peer already sent, without waiting: a connection closed with
 * unread input reaches the peer as a reset before our answer (the importer reads past it, a
 * hand-written client may not). */
static void discard_input(int c)
{
    for (int i = 0; i < 4; i++) {
        vmh_ipc_request_t req;
        int fds[VMH_IPC_BATCH];
        size_t nfd = 0;
        int err = vmh_ipc_recv(c, &req, sizeof req, fds, VMH_IPC_BATCH, &nfd, 0);
        for (size_t k = 0; k < nfd; k++)
            close(fds[k]);
        if (err && err != EPROTO)
            return;
    }
}

/* A connection just accepted: its credentials first, before anything is awaited from it. */
static bool peer_admit(peer_t *pr, int c)
{
    uid_t uid;
    pid_t pid;
    int err = vmh_ipc_check_peer(c, VMH_IPC_EXPORTER_ASKS, &uid, &pid);
    if (err) {
        vmh_ipc_reply_t rep;
        memset(&rep, 0, sizeof rep);
        rep.magic = VMH_IPC_MAGIC;
        rep.device = -1;
        rep.status = err == EACCES ? VMH_IPC_REFUSED_USER : VMH_IPC_BAD_REQUEST;
        (void)vmh_ipc_send(c, &rep, sizeof rep, NULL, 0); /* never waits */
        discard_input(c);
        close(c);
        /* Said once: a neighbour that connects in a loop must not flood the program's stderr. */
        if (!atomic_flag_test_and_set(&warned_refusal))
            vmh_log("refused a CUDA IPC request from pid %d, uid %d: this process runs as uid %u "
                    "(%s; further refusals are said with VMMHOOK_VERBOSE=1 only)",
                    (int)pid, (int)uid, (unsigned)geteuid(),
                    err == EACCES ? "another user" : "its credentials could not be read");
        else
            vmh_debug("refused a CUDA IPC request from pid %d, uid %d", (int)pid, (int)uid);
        return false;
    }
    /* Small: the stream waits for the importer rather than piling descriptors in flight. */
    int sndbuf = IPC_PEER_SNDBUF;
    setsockopt(c, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    memset(pr, 0, sizeof *pr);
    pr->fd = c;
    pr->deadline_ms = vmh_ipc_now_ms() + vmh_ipc_request_timeout_ms;
    return true;
}

/* A connection whose deadline passed: a request that never came is told so. */
static void peer_expire(peer_t *pr)
{
    if (!pr->answering) {
        vmh_ipc_reply_t rep;
        memset(&rep, 0, sizeof rep);
        rep.magic = VMH_IPC_MAGIC;
        rep.device = -1;
        rep.status = VMH_IPC_TIMED_OUT;
        (void)vmh_ipc_send(pr->fd, &rep, sizeof rep, NULL, 0);
        vmh_debug("CUDA IPC: dropped a connection that sent no request within %d ms",
                  vmh_ipc_request_timeout_ms);
    } else {
        vmh_debug("CUDA IPC: dropped an importer that stopped reading");
    }
    peer_drop(pr);
}

/* ---- the listener --------------------------------------------------------------------------- */

typedef struct listen_state {
    peer_t peers[VMH_IPC_MAX_PEERS];
    size_t npeers;
    int64_t accept_after_ms; /* backing off at the descriptor limit until then */
    int backoff_ms;
} listen_state_t;

/* Accepts what waits, up to the connection slots. */
static void accept_pending(listener_t *l, listen_state_t *st)
{
    while (st->npeers < VMH_IPC_MAX_PEERS) {
        int c = accept4(l->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) {
            int err = errno;
            if (err == EINTR || err == ECONNABORTED)
                continue;
            if (err == EAGAIN || err == EWOULDBLOCK)
                return;
            /* EMFILE and friends: the connection stays queued and poll would report it again
             * at once. Wait instead, longer each time, and say it once. */
            st->backoff_ms = st->backoff_ms ? 2 * st->backoff_ms : IPC_BACKOFF_FIRST_MS;
            if (st->backoff_ms > IPC_BACKOFF_MAX_MS)
                st->backoff_ms = IPC_BACKOFF_MAX_MS;
            st->accept_after_ms = vmh_ipc_now_ms() + st->backoff_ms;
            if (!atomic_flag_test_and_set(&warned_fd_limit))
                vmh_log("CUDA IPC listener: cannot accept an importer (%s): importers wait "
                        "until descriptors are free again (said once)",
                        strerror(err));
            return;
        }
        st->backoff_ms = 0;
        if (peer_admit(&st->peers[st->npeers], c))
            st->npeers++;
    }
}

static void *listener_main(void *arg)
{
    listener_t *l = arg;
    listen_state_t *st = calloc(1, sizeof *st);
    if (!st) {
        vmh_log("CUDA IPC listener: out of memory; no more imports from this process");
        return NULL;
    }
    int64_t next_prune = vmh_ipc_now_ms() + IPC_PRUNE_EVERY_MS;
    while (!atomic_load(&listener_stop)) {
        struct pollfd p[2 + VMH_IPC_MAX_PEERS];
        int64_t now = vmh_ipc_now_ms();
        bool slots = st->npeers < VMH_IPC_MAX_PEERS;
        bool can_accept = slots && now >= st->accept_after_ms;
        int64_t wake = next_prune;
        if (slots && !can_accept && st->accept_after_ms < wake)
            wake = st->accept_after_ms;
        p[0] = (struct pollfd){.fd = can_accept ? l->listen_fd : -1, .events = POLLIN};
        p[1] = (struct pollfd){.fd = l->event_fd, .events = POLLIN};
        for (size_t i = 0; i < st->npeers; i++) {
            peer_t *pr = &st->peers[i];
            p[2 + i] = (struct pollfd){.fd = pr->fd, .events = pr->blocked ? POLLOUT : POLLIN};
            if (pr->deadline_ms < wake)
                wake = pr->deadline_ms;
        }
        int n = poll(p, 2 + st->npeers, wake > now ? (int)(wake - now) : 0);
        if (atomic_load(&listener_stop))
            break;
        if (n < 0 && errno != EINTR) {
            vmh_log("CUDA IPC listener: poll failed (%s); no more imports from this process",
                    strerror(errno));
            break;
        }
        now = vmh_ipc_now_ms();
        /* The connections, from the last one: a finished one takes the last one's place. */
        for (size_t i = st->npeers; i-- > 0;) {
            peer_t *pr = &st->peers[i];
            short rev = n > 0 ? p[2 + i].revents : 0;
            bool keep;
            if (rev & POLLNVAL) {
                keep = false;
            } else if (rev && pr->answering) {
                keep = peer_pump(pr);
            } else if (rev) {
                keep = peer_readable(pr);
            } else if (now >= pr->deadline_ms) {
                peer_expire(pr);
                keep = false;
                pr->fd = -1;
            } else {
                keep = true;
            }
            if (!keep) {
                if (pr->fd >= 0)
                    peer_drop(pr);
                st->peers[i] = st->peers[--st->npeers];
            }
        }
        if (n > 0 && can_accept && (p[0].revents & (POLLERR | POLLNVAL))) {
            vmh_log("CUDA IPC listener: the socket failed; no more imports from this process");
            break;
        }
        if (n > 0 && can_accept && (p[0].revents & POLLIN))
            accept_pending(l, st);
        if (now >= next_prune) {
            /* Idle or not: give back the memory of exported buffers the program freed since. */
            vmh_ipc_prune();
            next_prune = now + IPC_PRUNE_EVERY_MS;
        }
    }
    for (size_t i = 0; i < st->npeers; i++)
        peer_drop(&st->peers[i]);
    free(st);
    return NULL;
}

/* Starts the listener for this process; ipc_lock held. A child forked from an exporter
 * inherits the state but not the thread: it gets its own socket and token. */
static CUresult listener_start_locked(void)
{
    uint32_t pid = (uint32_t)getpid();
    if (listening && own_pid == pid)
        return CUDA_SUCCESS;
    if (listening) {
        /* The parent's socket and eventfd, inherited: ours to close, the parent keeps its own. */
        close(listener->listen_fd);
        close(listener->event_fd);
        free(listener);
        listener = NULL;
        listening = false;
    }
    listener_t *l = malloc(sizeof *l);
    if (!l)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t token = 0;
    l->listen_fd = vmh_ipc_listen(pid, &token);
    l->event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    int err = l->listen_fd < 0 ? -l->listen_fd : l->event_fd < 0 ? errno : 0;
    if (!err) {
        atomic_store(&listener_stop, false);
        /* The thread takes no signal: they stay the program's. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        err = pthread_create(&listener_thread, NULL, listener_main, l);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    if (err) {
        vmh_log("CUDA IPC: cannot start the listener for served buffers (%s): "
                "cuIpcGetMemHandle answers CUDA_ERROR_OPERATING_SYSTEM",
                strerror(err));
        if (l->listen_fd >= 0)
            close(l->listen_fd);
        if (l->event_fd >= 0)
            close(l->event_fd);
        free(l);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    listener = l;
    listening = true;
    own_pid = pid;
    own_token = token;
    if (!exit_registered) {
        exit_registered = atexit(ipc_atexit) == 0;
        pthread_atfork(ipc_prefork, ipc_postfork, ipc_postfork);
    }
    char name[64];
    vmh_ipc_socket_name(name, sizeof name, pid, token);
    vmh_debug("CUDA IPC: listening on abstract socket @%s", name);
    return CUDA_SUCCESS;
}

bool vmh_ipc_export_is_own(uint32_t pid, uint64_t socket_token)
{
    pthread_mutex_lock(&ipc_lock);
    bool own = listening && pid == (uint32_t)getpid() && own_pid == pid &&
               socket_token == own_token;
    pthread_mutex_unlock(&ipc_lock);
    return own;
}

/* ---- cuIpcGetMemHandle ---------------------------------------------------------------------- */

static bool same_export(const vmh_export_t *a, const vmh_export_t *b)
{
    if (a->base != b->base || a->size != b->size || a->offset != b->offset ||
        a->device != b->device || a->nchunks != b->nchunks)
        return false;
    /* Pointer identity is safe: the table's references keep every chunk it names alive. */
    for (size_t i = 0; i < a->nchunks; i++)
        if (a->chunks[i] != b->chunks[i])
            return false;
    return true;
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

static void ipc_on_pressure(void)
{
    vmh_ipc_prune();
}

/* Records ex (its references pass to the table) under a fresh token, or finds the entry of the
 * same unchanged buffer (ex is released then); ipc_lock held. */
static CUresult record_locked(vmh_export_t *ex, CUcontext ctx, vmh_ipc_token_t *token)
{
    prune_locked(); /* an entry of a freed buffer is never matched again */
    for (size_t i = 0; i < nexports; i++) {
        if (same_export(&exports[i].ex, ex)) {
            *token = exports[i].token;
            vmh_heap_export_release(ex); /* the same buffer as before: the same handle */
            return CUDA_SUCCESS;
        }
    }
    if (!vmh_ipc_random(token, sizeof *token)) {
        vmh_log("CUDA IPC: no random bytes for an export token (getrandom and /dev/urandom "
                "failed): cuIpcGetMemHandle answers CUDA_ERROR_OPERATING_SYSTEM");
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    if (nexports == exports_cap) {
        size_t cap = exports_cap ? 2 * exports_cap : 16;
        export_entry_t *grown = realloc(exports, cap * sizeof *grown);
        if (!grown)
            return CUDA_ERROR_OUT_OF_MEMORY;
        exports = grown;
        exports_cap = cap;
    }
    exports[nexports++] = (export_entry_t){.token = *token, .ex = *ex, .ctx = ctx};
    return CUDA_SUCCESS;
}

CUresult vmh_ipc_get_handle(CUdeviceptr p, CUipcMemHandle *out)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (vmh_opt.handle != VMH_HANDLE_POSIX_FD) {
        vmh_buffer_info_t bi;
        if (!vmh_heap_find(p, &bi))
            return CUDA_ERROR_NOT_FOUND;
        warn_handle_type(vmh_opt.handle == VMH_HANDLE_FABRIC
                             ? "VMMHOOK_HANDLE_TYPE is fabric: only POSIX fds are shared"
                             : "its chunks have no shareable handle type");
        return CUDA_ERROR_INVALID_VALUE;
    }
    vmh_export_t ex;
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
    if (CALL(vmh_drv.cuCtxGetCurrent(&ctx)) != CUDA_SUCCESS)
        ctx = NULL;

    vmh_ipc_handle_t h;
    memset(&h, 0, sizeof h);
    h.device = ex.device;
    h.size = ex.size;
    h.offset = ex.offset;
    pthread_mutex_lock(&ipc_lock);
    if (ipc_shut) {
        pthread_mutex_unlock(&ipc_lock);
        vmh_heap_export_release(&ex); /* never reached: the heap answers NOT_FOUND first */
        return CUDA_ERROR_DEINITIALIZED;
    }
    rc = listener_start_locked();
    if (rc == CUDA_SUCCESS)
        rc = record_locked(&ex, ctx, &h.export);
    if (rc != CUDA_SUCCESS)
        vmh_heap_export_release(&ex);
    h.pid = own_pid;
    h.socket_token = own_token;
    pthread_mutex_unlock(&ipc_lock);
    if (rc != CUDA_SUCCESS)
        return rc;
    h.magic = VMH_IPC_MAGIC;
    h.version = VMH_IPC_VERSION;
    vmh_ipc_handle_encode(&h, out);
    return CUDA_SUCCESS;
}

/* ---- tests ---------------------------------------------------------------------------------- */

#ifdef VMH_TESTING
void vmh_ipc_export_reset(void)
{
    pthread_mutex_lock(&ipc_lock);
    listener_t *l = listening && own_pid == (uint32_t)getpid() ? listener : NULL;
    pthread_mutex_unlock(&ipc_lock);
    if (l) {
        atomic_store(&listener_stop, true);
        uint64_t one = 1;
        if (write(l->event_fd, &one, sizeof one) < 0) {
            /* the poll timeout wakes it within a second anyway */
        }
        pthread_join(listener_thread, NULL);
        close(l->listen_fd);
        close(l->event_fd);
        free(l);
    }
    pthread_mutex_lock(&ipc_lock);
    listener = NULL;
    listening = false;
    own_pid = 0;
    own_token = 0;
    for (size_t i = 0; i < nexports; i++)
        vmh_heap_export_release(&exports[i].ex);
    nexports = 0;
    ipc_shut = false;
    atomic_flag_clear(&warned_handle_type);
    atomic_flag_clear(&warned_refusal);
    atomic_flag_clear(&warned_fd_limit);
    pthread_mutex_unlock(&ipc_lock);
}

size_t vmh_ipc_export_count(void)
{
    pthread_mutex_lock(&ipc_lock);
    size_t n = nexports;
    pthread_mutex_unlock(&ipc_lock);
    return n;
}

bool vmh_ipc_listening(void)
{
    pthread_mutex_lock(&ipc_lock);
    bool l = listening && own_pid == (uint32_t)getpid();
    pthread_mutex_unlock(&ipc_lock);
    return l;
}
#endif
