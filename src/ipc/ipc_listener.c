/* CUDA IPC, the listener: the exporting process's socket, its thread and its connections (see
 * ipc_listener.h).
 *
 * Owns: the listener's state (its socket, eventfd, thread, pid and socket token) under
 * listen_lock, and the connections, which belong to the listener thread alone (no lock). The
 * export table (ipc_export.c) is asked for chunks and exports; no lock of this file is held
 * while it is.
 */
#include "ipc_listener.h"
#include "ipc_export.h"
#include "ipc_wire.h"

#include "log.h"
#include "phase.h"
#include "testable.h"
#include "thread_state.h"
#include "witness.h"

#include <assert.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

VMH_TESTABLE _Atomic int vmh_ipc_request_timeout_ms = 2000;
/* How long an importer that stopped reading may keep its connection. */
VMH_TESTABLE _Atomic int vmh_ipc_send_timeout_ms = 10000;
/* The listener lets go of the exports of freed buffers this often when idle. */
#define IPC_PRUNE_EVERY_MS 1000
/* At the descriptor limit, the listener waits this long (doubling) before it accepts again. */
#define IPC_BACKOFF_FIRST_MS 50
#define IPC_BACKOFF_MAX_MS 1000
/* Enough socket buffer for a few batches only: descriptors in flight count against the
 * sender's descriptor limit (ETOOMANYREFS), so the stream waits for the importer instead. */
#define IPC_PEER_SNDBUF 4096

typedef struct listener {
    int listen_fd;
    int event_fd;
} listener_t;

static pthread_mutex_t listen_lock = PTHREAD_MUTEX_INITIALIZER;
static bool listening;     /* a listener runs for own_pid */
static uint32_t own_pid;   /* the process the listener was started in */
static uint64_t own_token; /* names its socket */
static pthread_t listener_thread;
static listener_t *listener;
static atomic_bool listener_stop;
static atomic_flag warned_refusal = ATOMIC_FLAG_INIT;
static atomic_flag warned_fd_limit = ATOMIC_FLAG_INIT;

/* fork (lifetime.c's handlers): the child must not inherit listen_lock held by a thread
 * starting the listener. */
void vmh_ipc_listener_prefork(void)
{
    vmh_lock(&listen_lock, VMH_RANK_IPC_LISTENER);
}

void vmh_ipc_listener_postfork(void)
{
    vmh_unlock(&listen_lock);
}

/* The thread ends at its next wake once asked (the tests' stop) or once exit began (the phase
 * past RUNNING, lifetime.c's exit handler: the export table makes no driver call after that
 * either way). */
static bool listener_stopping(void)
{
    return atomic_load(&listener_stop) || vmh_phase_stage() != VMH_PHASE_RUNNING;
}

/* ---- one connection ------------------------------------------------------------------------ */

typedef struct peer {
    int fd;
    int64_t deadline_ms;
    bool answering;    /* the request arrived: the reply and the batches go out */
    bool reply_unsent; /* the reply waits for room in the socket */
    bool blocked;      /* the last send found no room: wait for POLLOUT */
    vmh_ipc_reply_t reply;
    vmh_export_t ex; /* answering: the chunks, with references of this exchange */
    CUcontext ctx;
    size_t next; /* the first chunk not yet exported */
    vmh_ipc_batch_t batch;
    int fds[VMH_IPC_BATCH];
    size_t nfds; /* exported descriptors of batch, not yet sent */
    bool batch_ready;
} peer_t;

static void peer_drop(peer_t *pr)
{
    for (size_t i = 0; i < pr->nfds; i++)
        close(pr->fds[i]);
    pr->nfds = 0;
    vmh_ipc_export_untake(&pr->ex);
    close(pr->fd);
    pr->fd = -1;
}

/* Exports the next batch of pr's chunks into pr->batch and pr->fds. */
static void prepare_batch(peer_t *pr)
{
    assert(pr->answering && !pr->batch_ready && pr->nfds == 0 && pr->next < pr->ex.nchunks);
    size_t left = pr->ex.nchunks - pr->next;
    size_t count = left < VMH_IPC_BATCH ? left : VMH_IPC_BATCH;
    memset(&pr->batch, 0, sizeof pr->batch);
    CUresult rc = vmh_ipc_export_fds(&pr->ex, pr->ctx, pr->next, count, pr->fds);
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
        /* Every chunk has its descriptor now, and the descriptors keep the memory for the
         * importer: the exchange's references go before the importer can hold the last batch,
         * so that a free and vmm_trim after its import leave the library holding nothing (let
         * go after the send, a chunk could still be held by this thread when they run). */
        if (pr->next == pr->ex.nchunks)
            vmh_ipc_export_untake(&pr->ex);
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
        assert(pr->nfds <= VMH_IPC_BATCH);
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

/* The request arrived: take the export's chunks for the time of the exchange, export the first
 * batch, then start sending. */
static bool peer_answer(peer_t *pr, const vmh_ipc_request_t *req)
{
    vmh_ipc_reply_t *rep = &pr->reply;
    memset(rep, 0, sizeof *rep);
    rep->magic = VMH_IPC_MAGIC;
    rep->device = -1;
    pr->answering = true;
    pr->reply_unsent = true;
    pr->deadline_ms = vmh_ipc_now_ms() + vmh_ipc_send_timeout_ms;
    if (req->magic != VMH_IPC_MAGIC || req->version != VMH_IPC_VERSION) {
        rep->status = VMH_IPC_BAD_REQUEST;
        return peer_pump(pr);
    }
    rep->status = (uint32_t)vmh_ipc_export_take(&req->export, &pr->ex, &pr->ctx, &rep->driver_rc);
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
        /* Said before the refusal is sent: whoever sees the refusal can count on the line
         * being there (a test, or a user reading the log after the peer failed). Said once: a
         * neighbour that connects in a loop must not flood the program's stderr. */
        if (!atomic_flag_test_and_set(&warned_refusal))
            vmh_log("refused a CUDA IPC request from pid %d, uid %d: this process runs as uid %u "
                    "(%s; further refusals are said with VMMHOOK_VERBOSE=1 only)",
                    (int)pid, (int)uid, (unsigned)geteuid(),
                    err == EACCES ? "another user" : "its credentials could not be read");
        else
            vmh_debug("refused a CUDA IPC request from pid %d, uid %d", (int)pid, (int)uid);
        (void)vmh_ipc_send(c, &rep, sizeof rep, NULL, 0); /* never waits */
        discard_input(c);
        close(c);
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
    while (!listener_stopping()) {
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
        if (listener_stopping())
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

/* Starts the listener for this process; listen_lock held. A child forked from an exporter
 * inherits the state but not the thread: it gets its own socket and token. */
static CUresult start_locked(void)
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
        err = vmh_thread_start(&listener_thread, listener_main, l);
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
    char name[64];
    vmh_ipc_socket_name(name, sizeof name, pid, token);
    vmh_debug("CUDA IPC: listening on abstract socket @%s", name);
    return CUDA_SUCCESS;
}

CUresult vmh_ipc_listener_start(uint32_t *pid, uint64_t *socket_token)
{
    vmh_lock(&listen_lock, VMH_RANK_IPC_LISTENER);
    CUresult rc = start_locked();
    *pid = own_pid;
    *socket_token = own_token;
    vmh_unlock(&listen_lock);
    return rc;
}

bool vmh_ipc_listener_is_own(uint32_t pid, uint64_t socket_token)
{
    vmh_lock(&listen_lock, VMH_RANK_IPC_LISTENER);
    bool own =
        listening && pid == (uint32_t)getpid() && own_pid == pid && socket_token == own_token;
    vmh_unlock(&listen_lock);
    return own;
}

/* ---- tests ---------------------------------------------------------------------------------- */

#ifdef VMH_TESTING
void vmh_ipc_listener_stop(void)
{
    vmh_lock(&listen_lock, VMH_RANK_IPC_LISTENER);
    listener_t *l = listening && own_pid == (uint32_t)getpid() ? listener : NULL;
    listener = NULL;
    listening = false;
    own_pid = 0;
    own_token = 0;
    vmh_unlock(&listen_lock);
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
    atomic_flag_clear(&warned_refusal);
    atomic_flag_clear(&warned_fd_limit);
}

bool vmh_ipc_listening(void)
{
    vmh_lock(&listen_lock, VMH_RANK_IPC_LISTENER);
    bool l = listening && own_pid == (uint32_t)getpid();
    vmh_unlock(&listen_lock);
    return l;
}
#endif
