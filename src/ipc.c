/* CUDA IPC of served buffers over POSIX fds, and peer access for served memory (see ipc.h).
 *
 * Owns: the export table (export id -> the buffer's chunks, with references), the listener
 * thread and its abstract socket, the import table (what cuIpcOpenMemHandle mapped here).
 *
 * Locks: ipc_lock guards the export table and the listener's state; imp_lock guards the import
 * table. Neither is ever taken inside the other, and no heap lock is held while either is.
 * ipc_lock is held across the export and release calls the table makes (not across socket
 * I/O), so that the exit handler, which takes it, knows no driver call of ours is in flight
 * when it marks the module shut down: after that nothing here calls the driver.
 */
#include "ipc.h"

#include "driver.h"
#include "heap.h"
#include "lifetime.h"
#include "log.h"
#include "options.h"
#include "range.h"
#include "stats.h"
#include "testable.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

_Static_assert(sizeof(vmh_ipc_handle_t) == sizeof(CUipcMemHandle),
               "the handle must fill a CUipcMemHandle exactly");

/* A driver call; vmh_drv counts it (driver.h). */
#define CALL(expr) (expr)

/* How long either side waits for the other before giving up on one exchange. */
#define IPC_TIMEOUT_S 10

/* ---- small helpers ------------------------------------------------------------------------ */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* Over every field before `check`: a random 64 bytes (a driver's handle) passes with
 * probability 2^-96 (magic and check). */
static uint64_t handle_check(const vmh_ipc_handle_t *h)
{
    uint64_t x = 0x9e3779b97f4a7c15ull;
    x = mix64(x ^ ((uint64_t)h->magic | (uint64_t)h->version << 32 | (uint64_t)h->flags << 48));
    x = mix64(x ^ ((uint64_t)h->pid | (uint64_t)(uint32_t)h->device << 32));
    x = mix64(x ^ h->token);
    x = mix64(x ^ h->id);
    x = mix64(x ^ h->size);
    x = mix64(x ^ h->offset);
    return x;
}

/* Nonzero and unpredictable enough that a pid reused by a later process never finds a socket
 * named for an earlier one (the name carries both). */
static uint64_t new_token(void)
{
    uint64_t t = 0;
    if (getrandom(&t, sizeof t, GRND_NONBLOCK) != (ssize_t)sizeof t) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        t = mix64((uint64_t)ts.tv_nsec ^ (uint64_t)ts.tv_sec << 30 ^ (uint64_t)getpid() << 17 ^
                  (uint64_t)(uintptr_t)&t);
    }
    return t ? t : 1;
}

size_t vmh_ipc_socket_name(char *buf, size_t len, uint32_t pid, uint64_t token)
{
    int n = snprintf(buf, len, "vmmhook-ipc.%u.%016llx", pid, (unsigned long long)token);
    return n < 0 ? 0 : (size_t)n;
}

static socklen_t socket_addr(struct sockaddr_un *sa, uint32_t pid, uint64_t token)
{
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    /* Abstract: sun_path[0] is NUL, the name follows without a terminator. */
    size_t n = vmh_ipc_socket_name(sa->sun_path + 1, sizeof sa->sun_path - 1, pid, token);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static void set_timeouts(int fd)
{
    struct timeval tv = {.tv_sec = IPC_TIMEOUT_S, .tv_usec = 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

/* MSG_NOSIGNAL: a peer that went away must not kill the program with SIGPIPE. */
static bool send_all(int fd, const void *buf, size_t len, const int *fds, size_t nfds)
{
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    union {
        char buf[CMSG_SPACE(VMH_IPC_BATCH * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (nfds) {
        memset(&ctl, 0, sizeof ctl);
        msg.msg_control = ctl.buf;
        msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
        memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
    }
    ssize_t n;
    do
        n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n == (ssize_t)len;
}

/* ---- allocation handles for imported fds ---------------------------------------------------- */

/* Built like vmh_alloc_create (same fields, same allocator), so that vmh_alloc_unref's
 * cuMemRelease + free is exactly right for it too: an imported handle is released with
 * cuMemRelease like a created one. */
CUresult vmh_alloc_import(int fd, size_t size, int device, const CUmemAccessDesc *access,
                          int naccess, vmh_alloc_t **out)
{
    if (!out || fd < 0 || size == 0 || naccess < 0 || naccess > VMH_MAX_ACCESS ||
        (naccess && !access))
        return CUDA_ERROR_INVALID_VALUE;
    vmh_alloc_t *a = calloc(1, sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CALL(vmh_drv.cuMemImportFromShareableHandle(
        &a->handle, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    if (rc != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    atomic_init(&a->refs, 1);
    a->size = size;
    a->device = device; /* the device it is mapped for here (the importer's numbering) */
    a->handle_type = (int)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    a->naccess = naccess;
    if (naccess)
        memcpy(a->access, access, (size_t)naccess * sizeof *access);
    *out = a;
    return CUDA_SUCCESS;
}

/* ---- the export table and the listener --------------------------------------------------- */

typedef struct export_entry {
    uint64_t id;
    vmh_export_t ex;
    CUcontext ctx; /* current at cuIpcGetMemHandle: tried when an export needs a context */
} export_entry_t;

typedef struct listener_args {
    int listen_fd;
    int event_fd;
} listener_args_t;

static pthread_mutex_t ipc_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t imp_lock = PTHREAD_MUTEX_INITIALIZER; /* the import table (below) */
static export_entry_t *exports;
static size_t nexports, exports_cap;
static uint64_t next_id = 1;
static bool listening;     /* a listener runs for own_pid */
static uint32_t own_pid;   /* the process the listener was started in */
static uint64_t own_token; /* names its socket */
static pthread_t listener_thread;
static listener_args_t *listener_args;
static atomic_bool listener_stop;
static bool ipc_shut; /* exit: no more driver calls from here */
static bool exit_registered;
static atomic_flag warned_handle_type = ATOMIC_FLAG_INIT;

VMH_TESTABLE long vmh_ipc_accept_uid = -1;

static int cmp_ptr(const void *a, const void *b)
{
    const vmh_alloc_t *const *pa = a, *const *pb = b;
    uintptr_t x = (uintptr_t)*pa, y = (uintptr_t)*pb;
    return x < y ? -1 : x > y;
}

/* How many times the sorted array all[0..n) holds p. */
static size_t count_in(vmh_alloc_t *const *all, size_t n, const vmh_alloc_t *p)
{
    size_t lo = 0, hi = n;
    while (lo < hi) { /* first index with all[i] >= p */
        size_t mid = lo + (hi - lo) / 2;
        if ((uintptr_t)all[mid] < (uintptr_t)p)
            lo = mid + 1;
        else
            hi = mid;
    }
    size_t k = 0;
    while (lo + k < n && all[lo + k] == p)
        k++;
    return k;
}

/* An entry is dead when every one of its chunks is referenced by the table alone: the heap no
 * longer maps it (the exporter freed the buffer), no request is exporting it. Nobody else can
 * take a reference then (one needs a reference to hold the pointer), so the verdict is stable.
 * Natively a freed allocation's handle cannot be opened either. */
static size_t prune_locked(void)
{
    if (ipc_shut || nexports == 0)
        return 0;
    size_t total = 0;
    for (size_t i = 0; i < nexports; i++)
        total += exports[i].ex.nchunks;
    vmh_alloc_t **all = malloc((total ? total : 1) * sizeof *all);
    bool *dead = calloc(nexports, sizeof *dead);
    if (!all || !dead) {
        free(all);
        free(dead);
        return 0;
    }
    size_t k = 0;
    for (size_t i = 0; i < nexports; i++)
        for (size_t j = 0; j < exports[i].ex.nchunks; j++)
            all[k++] = exports[i].ex.chunks[j];
    qsort(all, total, sizeof *all, cmp_ptr);
    size_t ndead = 0;
    for (size_t i = 0; i < nexports; i++) {
        dead[i] = true;
        for (size_t j = 0; j < exports[i].ex.nchunks && dead[i]; j++) {
            vmh_alloc_t *c = exports[i].ex.chunks[j];
            size_t held = count_in(all, total, c);
            dead[i] = (size_t)atomic_load_explicit(&c->refs, memory_order_acquire) == held;
        }
        ndead += dead[i];
    }
    free(all);
    /* Verdicts first, releases after: two dead entries may share a chunk. */
    size_t w = 0;
    for (size_t i = 0; i < nexports; i++) {
        if (dead[i]) {
            vmh_debug("IPC export %llu (%zu bytes) released: the buffer was freed",
                      (unsigned long long)exports[i].id, exports[i].ex.size);
            vmh_heap_export_release(&exports[i].ex);
        } else {
            exports[w++] = exports[i];
        }
    }
    nexports = w;
    free(dead);
    return ndead;
}

size_t vmh_ipc_prune(void)
{
    pthread_mutex_lock(&ipc_lock);
    size_t n = prune_locked();
    pthread_mutex_unlock(&ipc_lock);
    return n;
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

/* fork: the child must not inherit a lock the listener held (it prunes every second), nor a
 * driver call of the listener in flight (those run under ipc_lock). imp_lock is never taken
 * while ipc_lock is held elsewhere, so taking both here in this order cannot deadlock. */
static void ipc_prefork(void)
{
    pthread_mutex_lock(&ipc_lock);
    pthread_mutex_lock(&imp_lock);
}

static void ipc_postfork(void)
{
    pthread_mutex_unlock(&imp_lock);
    pthread_mutex_unlock(&ipc_lock);
}

/* cuMemExportToShareableHandle of every chunk of e; ipc_lock held. The VMM calls need no
 * context; should a driver want one, the context current at cuIpcGetMemHandle is tried. */
static CUresult export_fds_locked(const export_entry_t *e, int *fds)
{
    CUresult rc = CUDA_SUCCESS;
    size_t done = 0;
    while (done < e->ex.nchunks) {
        CUmemGenericAllocationHandle h = e->ex.chunks[done]->handle;
        rc = CALL(vmh_drv.cuMemExportToShareableHandle(
            &fds[done], h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        if (rc == CUDA_ERROR_INVALID_CONTEXT && e->ctx &&
            CALL(vmh_drv.cuCtxPushCurrent(e->ctx)) == CUDA_SUCCESS) {
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

/* One connection: one request, one answer. */
static void serve(int c)
{
    set_timeouts(c);
    vmh_ipc_reply_t rep;
    memset(&rep, 0, sizeof rep);
    rep.magic = VMH_IPC_MAGIC;
    rep.device = -1;

    /* The request first, then the verdict: an importer whose request is still unread when
     * the connection closes could lose the answer. */
    vmh_ipc_request_t req;
    ssize_t got;
    do
        got = recv(c, &req, sizeof req, 0);
    while (got < 0 && errno == EINTR);
    struct ucred cred;
    socklen_t clen = sizeof cred;
    long want_uid = vmh_ipc_accept_uid >= 0 ? vmh_ipc_accept_uid : (long)geteuid();
    if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0 || clen != sizeof cred) {
        rep.status = VMH_IPC_BAD_REQUEST;
        send_all(c, &rep, sizeof rep, NULL, 0);
        return;
    }
    if ((long)cred.uid != want_uid) {
        /* Same host, another user: refused before the request is even looked at. */
        vmh_log("refused a CUDA IPC request from pid %d, uid %u: this process runs as uid %ld",
                (int)cred.pid, (unsigned)cred.uid, want_uid);
        rep.status = VMH_IPC_REFUSED_USER;
        send_all(c, &rep, sizeof rep, NULL, 0);
        return;
    }
    if (got != (ssize_t)sizeof req || req.magic != VMH_IPC_MAGIC ||
        req.version != VMH_IPC_VERSION) {
        rep.status = VMH_IPC_BAD_REQUEST;
        send_all(c, &rep, sizeof rep, NULL, 0);
        return;
    }

    /* Find the entry, take references on its chunks for the time of the exchange (a prune or
     * reset meanwhile then cannot release them), export them, all under the lock. */
    vmh_export_t ex;
    memset(&ex, 0, sizeof ex);
    int *fds = NULL;
    pthread_mutex_lock(&ipc_lock);
    prune_locked();
    const export_entry_t *e = NULL;
    if (ipc_shut) {
        rep.status = VMH_IPC_SHUT_DOWN;
    } else if (req.token == own_token) {
        for (size_t i = 0; i < nexports && !e; i++)
            if (exports[i].id == req.id)
                e = &exports[i];
        rep.status = e ? VMH_IPC_OK : VMH_IPC_UNKNOWN_ID;
    } else {
        rep.status = VMH_IPC_UNKNOWN_ID;
    }
    if (e) {
        ex = e->ex;
        ex.chunks = malloc(ex.nchunks * sizeof *ex.chunks);
        fds = malloc(ex.nchunks * sizeof *fds);
        if (!ex.chunks || !fds) {
            rep.status = VMH_IPC_EXPORT_FAILED;
            rep.driver_rc = CUDA_ERROR_OUT_OF_MEMORY;
            free(ex.chunks);
            ex.chunks = NULL;
            ex.nchunks = 0;
        } else {
            for (size_t i = 0; i < ex.nchunks; i++)
                ex.chunks[i] = vmh_alloc_ref(e->ex.chunks[i]);
            CUresult rc = export_fds_locked(e, fds);
            if (rc != CUDA_SUCCESS) {
                rep.status = VMH_IPC_EXPORT_FAILED;
                rep.driver_rc = (int32_t)rc;
                vmh_log("CUDA IPC: cuMemExportToShareableHandle failed with CUDA error %d; the "
                        "importer gets CUDA_ERROR_MAP_FAILED",
                        (int)rc);
            }
        }
    }
    pthread_mutex_unlock(&ipc_lock);

    if (rep.status == VMH_IPC_OK) {
        rep.device = ex.device;
        rep.nchunks = ex.nchunks;
        rep.size = ex.size;
        rep.offset = ex.offset;
    }
    bool ok = send_all(c, &rep, sizeof rep, NULL, 0);
    if (rep.status == VMH_IPC_OK) {
        for (size_t i = 0; i < ex.nchunks; i += VMH_IPC_BATCH) {
            vmh_ipc_batch_t b;
            memset(&b, 0, sizeof b);
            b.count = (uint32_t)(ex.nchunks - i < VMH_IPC_BATCH ? ex.nchunks - i : VMH_IPC_BATCH);
            for (uint32_t j = 0; j < b.count; j++)
                b.sizes[j] = ex.chunks[i + j]->size;
            if (ok)
                ok = send_all(c, &b, sizeof b, fds + i, b.count);
        }
        /* The importer has its own descriptors now (or gave up): ours go either way. */
        for (size_t i = 0; i < ex.nchunks; i++)
            close(fds[i]);
    }
    free(fds);
    if (ex.chunks) {
        pthread_mutex_lock(&ipc_lock);
        /* After exit began the driver may be gone: leave the references (the process ends). */
        if (!ipc_shut)
            vmh_heap_export_release(&ex);
        else
            free(ex.chunks);
        pthread_mutex_unlock(&ipc_lock);
    }
}

static void *listener_main(void *arg)
{
    listener_args_t *la = arg;
    while (!atomic_load(&listener_stop)) {
        struct pollfd p[2] = {{.fd = la->listen_fd, .events = POLLIN},
                              {.fd = la->event_fd, .events = POLLIN}};
        int n = poll(p, 2, 1000);
        if (atomic_load(&listener_stop))
            break;
        if (n == 0) {
            /* Idle: give back the memory of exported buffers the program freed since. */
            vmh_ipc_prune();
            continue;
        }
        if (n < 0) {
            if (errno == EINTR)
                continue;
            vmh_log("CUDA IPC listener: poll failed (%s); no more imports from this process",
                    strerror(errno));
            break;
        }
        if (p[0].revents & (POLLERR | POLLHUP | POLLNVAL)) {
            vmh_log("CUDA IPC listener: the socket failed; no more imports from this process");
            break;
        }
        if (p[0].revents & POLLIN) {
            int c = accept4(la->listen_fd, NULL, NULL, SOCK_CLOEXEC);
            if (c >= 0) {
                serve(c);
                close(c);
            }
        }
    }
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
        close(listener_args->listen_fd);
        close(listener_args->event_fd);
        free(listener_args);
        listener_args = NULL;
        listening = false;
    }
    listener_args_t *la = malloc(sizeof *la);
    if (!la)
        return CUDA_ERROR_OUT_OF_MEMORY;
    la->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    la->event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    uint64_t token = 0;
    int err = 0;
    if (la->listen_fd < 0 || la->event_fd < 0) {
        err = errno;
    } else {
        /* A name in use (vanishingly unlikely with 64 random bits) gets another token. */
        for (int attempt = 0; attempt < 4; attempt++) {
            token = new_token();
            struct sockaddr_un sa;
            socklen_t sl = socket_addr(&sa, pid, token);
            if (bind(la->listen_fd, (struct sockaddr *)&sa, sl) == 0) {
                err = 0;
                break;
            }
            err = errno;
            if (err != EADDRINUSE)
                break;
        }
        if (!err && listen(la->listen_fd, 64) != 0)
            err = errno;
    }
    if (!err) {
        atomic_store(&listener_stop, false);
        /* The thread takes no signal: they stay the program's. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        err = pthread_create(&listener_thread, NULL, listener_main, la);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    if (err) {
        vmh_log("CUDA IPC: cannot start the listener for served buffers (%s): "
                "cuIpcGetMemHandle answers CUDA_ERROR_OPERATING_SYSTEM",
                strerror(err));
        if (la->listen_fd >= 0)
            close(la->listen_fd);
        if (la->event_fd >= 0)
            close(la->event_fd);
        free(la);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    listener_args = la;
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

    pthread_mutex_lock(&ipc_lock);
    if (ipc_shut) {
        pthread_mutex_unlock(&ipc_lock);
        vmh_heap_export_release(&ex); /* never reached: the heap answers NOT_FOUND first */
        return CUDA_ERROR_DEINITIALIZED;
    }
    rc = listener_start_locked();
    uint64_t id = 0;
    vmh_export_t kept = ex;
    if (rc == CUDA_SUCCESS) {
        for (size_t i = 0; i < nexports && !id; i++)
            if (same_export(&exports[i].ex, &ex))
                id = exports[i].id;
        if (id) {
            vmh_heap_export_release(&ex); /* the same buffer as before: the same handle */
        } else if (nexports == exports_cap) {
            size_t cap = exports_cap ? 2 * exports_cap : 16;
            export_entry_t *grown = realloc(exports, cap * sizeof *grown);
            if (!grown) {
                rc = CUDA_ERROR_OUT_OF_MEMORY;
            } else {
                exports = grown;
                exports_cap = cap;
            }
        }
        if (rc == CUDA_SUCCESS && !id) {
            id = next_id++;
            exports[nexports++] = (export_entry_t){.id = id, .ex = ex, .ctx = ctx};
        }
        prune_locked(); /* the new entry is mapped by its live buffer: it stays */
    }
    if (rc != CUDA_SUCCESS)
        vmh_heap_export_release(&ex);
    uint32_t pid = own_pid;
    uint64_t token = own_token;
    pthread_mutex_unlock(&ipc_lock);
    if (rc != CUDA_SUCCESS)
        return rc;

    vmh_ipc_handle_t h;
    memset(&h, 0, sizeof h);
    h.magic = VMH_IPC_MAGIC;
    h.version = VMH_IPC_VERSION;
    h.pid = pid;
    h.device = kept.device;
    h.token = token;
    h.id = id;
    h.size = kept.size;
    h.offset = kept.offset;
    h.check = handle_check(&h);
    memset(out, 0, sizeof *out);
    memcpy(out->reserved, &h, sizeof h);
    return CUDA_SUCCESS;
}

bool vmh_ipc_handle_is_ours(const CUipcMemHandle *hp)
{
    vmh_ipc_handle_t h;
    memcpy(&h, hp->reserved, sizeof h);
    return h.magic == VMH_IPC_MAGIC && h.version == VMH_IPC_VERSION && h.check == handle_check(&h);
}

/* ---- the import side ------------------------------------------------------------------------ */

typedef struct import_entry {
    uint32_t pid;
    uint64_t token, id;
    CUcontext ctx;
    vmh_range_t *range;
    CUdeviceptr ptr; /* range->base + offset: what the program got */
    size_t size;
    unsigned refs;
} import_entry_t;

static import_entry_t *imports;
static size_t nimports, imports_cap;
static atomic_size_t nimports_atomic; /* lock-free "none" for every cuIpcCloseMemHandle */

/* The same handle opened again in the same context: one more reference, the same pointer (as
 * cuIpcOpenMemHandle, cuda.h). imp_lock held. */
static bool import_reuse_locked(const vmh_ipc_handle_t *h, CUcontext ctx, CUdeviceptr *out)
{
    for (size_t i = 0; i < nimports; i++) {
        import_entry_t *e = &imports[i];
        if (e->pid == h->pid && e->token == h->token && e->id == h->id && e->ctx == ctx) {
            e->refs++;
            *out = e->ptr;
            return true;
        }
    }
    return false;
}

/* Receives one message and up to maxfds descriptors; every descriptor received lands in fds
 * (so that the caller closes them whatever happens). Returns the bytes, or -1. */
static ssize_t recv_msg(int s, void *buf, size_t len, int *fds, size_t maxfds, size_t *nfds)
{
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    union {
        char buf[CMSG_SPACE(VMH_IPC_BATCH * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    memset(&ctl, 0, sizeof ctl);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof ctl.buf;
    ssize_t n;
    do
        n = recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    *nfds = 0;
    if (n < 0)
        return -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            if (*nfds < maxfds)
                fds[(*nfds)++] = fd;
            else
                close(fd);
        }
    }
    if (msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC))
        return -1; /* descriptors lost (fd limit?) or a message of another size */
    return n;
}

/* Asks the exporter for h's chunks: *nchunks fds and sizes (the caller closes and frees).
 * CUDA_ERROR_INVALID_HANDLE: no live export by that name; CUDA_ERROR_MAP_FAILED: the exchange
 * broke. */
static CUresult fetch_chunks(const vmh_ipc_handle_t *h, vmh_ipc_reply_t *rep, int **pfds,
                             uint64_t **psizes)
{
    *pfds = NULL;
    *psizes = NULL;
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0) {
        vmh_log("CUDA IPC: socket: %s", strerror(errno));
        return CUDA_ERROR_MAP_FAILED;
    }
    set_timeouts(s);
    struct sockaddr_un sa;
    socklen_t sl = socket_addr(&sa, h->pid, h->token);
    int rcon;
    do
        rcon = connect(s, (struct sockaddr *)&sa, sl);
    while (rcon != 0 && errno == EINTR);
    if (rcon != 0) {
        int err = errno;
        close(s);
        vmh_log("cuIpcOpenMemHandle: the exporting process (pid %u) cannot be reached (%s): it "
                "has exited, or runs in another network namespace (the abstract socket "
                "@vmmhook-ipc.%u.* must be visible to both); CUDA_ERROR_INVALID_HANDLE",
                h->pid, strerror(err), h->pid);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    vmh_ipc_request_t req = {
        .magic = VMH_IPC_MAGIC, .version = VMH_IPC_VERSION, .token = h->token, .id = h->id};
    CUresult rc = CUDA_SUCCESS;
    size_t nfd = 0;
    int junk[VMH_IPC_BATCH];
    /* A failed send still reads: the exporter may have answered (refused) already. */
    (void)send_all(s, &req, sizeof req, NULL, 0);
    if (recv_msg(s, rep, sizeof *rep, junk, VMH_IPC_BATCH, &nfd) != (ssize_t)sizeof *rep ||
        rep->magic != VMH_IPC_MAGIC) {
        for (size_t i = 0; i < nfd; i++)
            close(junk[i]);
        close(s);
        vmh_log("cuIpcOpenMemHandle: no valid answer from the exporting process (pid %u): "
                "CUDA_ERROR_MAP_FAILED",
                h->pid);
        return CUDA_ERROR_MAP_FAILED;
    }
    for (size_t i = 0; i < nfd; i++)
        close(junk[i]);
    switch (rep->status) {
    case VMH_IPC_OK:
        break;
    case VMH_IPC_REFUSED_USER:
        vmh_log("cuIpcOpenMemHandle: the exporting process (pid %u) refused: it runs as "
                "another user; CUDA_ERROR_INVALID_HANDLE",
                h->pid);
        rc = CUDA_ERROR_INVALID_HANDLE;
        break;
    case VMH_IPC_UNKNOWN_ID:
    case VMH_IPC_SHUT_DOWN:
        vmh_log("cuIpcOpenMemHandle: the exporting process (pid %u) %s; "
                "CUDA_ERROR_INVALID_HANDLE",
                h->pid,
                rep->status == VMH_IPC_SHUT_DOWN ? "is exiting"
                                                 : "no longer has that buffer (freed?)");
        rc = CUDA_ERROR_INVALID_HANDLE;
        break;
    default:
        vmh_log("cuIpcOpenMemHandle: the exporting process (pid %u) could not export the "
                "buffer (status %u, CUDA error %d): CUDA_ERROR_MAP_FAILED",
                h->pid, rep->status, (int)rep->driver_rc);
        rc = CUDA_ERROR_MAP_FAILED;
        break;
    }
    if (rc == CUDA_SUCCESS && (rep->nchunks == 0 || rep->nchunks > ((size_t)1 << 20))) {
        vmh_log("cuIpcOpenMemHandle: the exporting process announced %llu chunks: "
                "CUDA_ERROR_MAP_FAILED",
                (unsigned long long)rep->nchunks);
        rc = CUDA_ERROR_MAP_FAILED;
    }
    int *fds = NULL;
    uint64_t *sizes = NULL;
    size_t have = 0;
    if (rc == CUDA_SUCCESS) {
        fds = malloc(rep->nchunks * sizeof *fds);
        sizes = malloc(rep->nchunks * sizeof *sizes);
        if (!fds || !sizes)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    while (rc == CUDA_SUCCESS && have < rep->nchunks) {
        vmh_ipc_batch_t b;
        size_t got = 0;
        size_t want = rep->nchunks - have < VMH_IPC_BATCH ? rep->nchunks - have : VMH_IPC_BATCH;
        ssize_t n = recv_msg(s, &b, sizeof b, fds + have, want, &got);
        have += got;
        if (n != (ssize_t)sizeof b || b.count != want || got != want) {
            vmh_log("cuIpcOpenMemHandle: %zu of %llu file descriptors arrived from the "
                    "exporting process (pid %u; the descriptor limit?): CUDA_ERROR_MAP_FAILED",
                    have, (unsigned long long)rep->nchunks, h->pid);
            rc = CUDA_ERROR_MAP_FAILED;
            break;
        }
        memcpy(sizes + have - got, b.sizes, got * sizeof *sizes);
    }
    close(s);
    if (rc != CUDA_SUCCESS) {
        for (size_t i = 0; i < have; i++)
            close(fds[i]);
        free(fds);
        free(sizes);
        return rc;
    }
    *pfds = fds;
    *psizes = sizes;
    return CUDA_SUCCESS;
}

/* Imports, maps and records h for the context ctx (current). */
static CUresult open_remote(const vmh_ipc_handle_t *h, CUcontext ctx, CUdeviceptr *out)
{
    pthread_mutex_lock(&imp_lock);
    bool reused = import_reuse_locked(h, ctx, out);
    pthread_mutex_unlock(&imp_lock);
    if (reused)
        return CUDA_SUCCESS;

    CUdevice dev;
    CUresult rc = CALL(vmh_drv.cuCtxGetDevice(&dev));
    if (rc != CUDA_SUCCESS)
        return rc;
    vmh_ipc_reply_t rep;
    int *fds;
    uint64_t *sizes;
    rc = fetch_chunks(h, &rep, &fds, &sizes);
    if (rc != CUDA_SUCCESS)
        return rc;
    size_t n = rep.nchunks, total = 0;
    vmh_alloc_t **allocs = calloc(n, sizeof *allocs);
    if (!allocs)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    for (size_t i = 0; i < n && rc == CUDA_SUCCESS; i++)
        if (sizes[i] == 0 || __builtin_add_overflow(total, sizes[i], &total))
            rc = CUDA_ERROR_MAP_FAILED;
    if (rc == CUDA_SUCCESS && (rep.offset > total || rep.size > total - rep.offset))
        rc = CUDA_ERROR_MAP_FAILED;
    /* Access for the importing context's device only, as native IPC maps for the current
     * context; the exporter's device numbering means nothing here. */
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = (int)dev;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (size_t i = 0; i < n && rc == CUDA_SUCCESS; i++)
        rc = vmh_alloc_import(fds[i], sizes[i], (int)dev, &acc, 1, &allocs[i]);
    /* The driver handles hold the memory now; the descriptors are not needed. */
    for (size_t i = 0; i < n; i++)
        close(fds[i]);
    free(fds);
    free(sizes);
    vmh_range_t *range = NULL;
    if (rc == CUDA_SUCCESS)
        rc = vmh_range_create(allocs, n, 0, 0, 0, &range);
    /* The mappings hold their allocations: drop the import references (on failure this
     * releases every imported handle). */
    for (size_t i = 0; allocs && i < n; i++)
        vmh_alloc_unref(allocs[i]);
    free(allocs);
    if (rc != CUDA_SUCCESS) {
        if (rc != CUDA_ERROR_MAP_FAILED)
            vmh_log("cuIpcOpenMemHandle: importing %zu chunk(s) from pid %u failed with CUDA "
                    "error %d",
                    n, h->pid, (int)rc);
        return rc;
    }

    CUdeviceptr ptr = range->base + rep.offset;
    pthread_mutex_lock(&imp_lock);
    if (import_reuse_locked(h, ctx, out)) {
        /* Another thread opened the same handle meanwhile: keep its mapping. */
        pthread_mutex_unlock(&imp_lock);
        vmh_range_destroy(range);
        return CUDA_SUCCESS;
    }
    if (nimports == imports_cap) {
        size_t cap = imports_cap ? 2 * imports_cap : 16;
        import_entry_t *grown = realloc(imports, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&imp_lock);
            vmh_range_destroy(range);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        imports = grown;
        imports_cap = cap;
    }
    imports[nimports++] = (import_entry_t){.pid = h->pid,
                                           .token = h->token,
                                           .id = h->id,
                                           .ctx = ctx,
                                           .range = range,
                                           .ptr = ptr,
                                           .size = rep.size,
                                           .refs = 1};
    atomic_store(&nimports_atomic, nimports);
    pthread_mutex_unlock(&imp_lock);
    vmh_debug("CUDA IPC: opened export %llu of pid %u: %llu bytes in %zu chunk(s) at 0x%llx",
              (unsigned long long)h->id, h->pid, (unsigned long long)rep.size, n,
              (unsigned long long)ptr);
    *out = ptr;
    return CUDA_SUCCESS;
}

#ifdef VMH_TESTING
CUresult vmh_ipc_open_remote(const CUipcMemHandle *hp, CUdeviceptr *out)
{
    vmh_ipc_handle_t h;
    memcpy(&h, hp->reserved, sizeof h);
    CUcontext ctx = NULL;
    if (CALL(vmh_drv.cuCtxGetCurrent(&ctx)) != CUDA_SUCCESS || !ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    return open_remote(&h, ctx, out);
}
#endif

CUresult vmh_ipc_open(const CUipcMemHandle *hp, unsigned int flags, CUdeviceptr *out)
{
    if (!out || flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return CUDA_ERROR_INVALID_VALUE; /* cuda.h: the flag must be given */
    vmh_ipc_handle_t h;
    memcpy(&h, hp->reserved, sizeof h);
    CUcontext ctx = NULL;
    if (CALL(vmh_drv.cuCtxGetCurrent(&ctx)) != CUDA_SUCCESS || !ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    /* The driver answers CUDA_ERROR_INVALID_CONTEXT for a handle of the same process. The
     * token, not the pid alone: a process of another pid namespace may have our pid. */
    pthread_mutex_lock(&ipc_lock);
    bool own = listening && h.pid == (uint32_t)getpid() && own_pid == h.pid && h.token == own_token;
    pthread_mutex_unlock(&ipc_lock);
    if (own)
        return CUDA_ERROR_INVALID_CONTEXT;
    return open_remote(&h, ctx, out);
}

/* Waits for the work queued in ctx before its mapping goes: the program may have launched
 * kernels on the memory just before closing it (cuMemUnmap does not wait, driver-facts 2a). */
static void sync_context(CUcontext ctx)
{
    CUcontext cur = NULL;
    if (CALL(vmh_drv.cuCtxGetCurrent(&cur)) != CUDA_SUCCESS)
        cur = NULL;
    bool pushed = false;
    if (cur != ctx) {
        if (CALL(vmh_drv.cuCtxPushCurrent(ctx)) != CUDA_SUCCESS)
            return; /* the context is gone, and its work with it */
        pushed = true;
    }
    CALL(vmh_drv.cuCtxSynchronize());
    vmh_count(VMH_STAT_syncs, 1);
    if (pushed) {
        CUcontext popped;
        CALL(vmh_drv.cuCtxPopCurrent(&popped));
    }
}

CUresult vmh_ipc_close(CUdeviceptr p)
{
    if (atomic_load_explicit(&nimports_atomic, memory_order_relaxed) == 0)
        return CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&imp_lock);
    size_t i = 0;
    while (i < nimports && imports[i].ptr != p)
        i++;
    if (i == nimports) {
        pthread_mutex_unlock(&imp_lock);
        return CUDA_ERROR_NOT_FOUND;
    }
    import_entry_t e = imports[i];
    if (--imports[i].refs > 0) {
        pthread_mutex_unlock(&imp_lock);
        return CUDA_SUCCESS;
    }
    imports[i] = imports[--nimports];
    atomic_store(&nimports_atomic, nimports);
    pthread_mutex_unlock(&imp_lock);
    /* At exit the driver may be gone: forget the mapping (the process ends with it). */
    if (!vmh_lifetime_ready())
        return CUDA_SUCCESS;
    sync_context(e.ctx);
    vmh_range_destroy(e.range);
    return CUDA_SUCCESS;
}

/* ---- peer access ---------------------------------------------------------------------------- */

CUresult vmh_ipc_peer_changed(CUcontext peer, bool grant)
{
    CUdevice cur, owner;
    CUresult rc = CALL(vmh_drv.cuCtxGetDevice(&cur));
    if (rc != CUDA_SUCCESS)
        return rc;
    /* The peer context's device: asked with the context made current for a moment. */
    rc = CALL(vmh_drv.cuCtxPushCurrent(peer));
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = CALL(vmh_drv.cuCtxGetDevice(&owner));
    CUcontext popped;
    CALL(vmh_drv.cuCtxPopCurrent(&popped));
    if (rc != CUDA_SUCCESS)
        return rc;
    vmh_debug("peer access %s: device %d %s every served buffer of device %d",
              grant ? "enabled" : "disabled", (int)cur, grant ? "reaches" : "no longer reaches",
              (int)owner);
    return vmh_heap_set_peer_access((int)owner, (int)cur, grant);
}

/* ---- tests ---------------------------------------------------------------------------------- */

#ifdef VMH_TESTING
void vmh_ipc_reset(void)
{
    pthread_mutex_lock(&ipc_lock);
    listener_args_t *la = listening && own_pid == (uint32_t)getpid() ? listener_args : NULL;
    pthread_mutex_unlock(&ipc_lock);
    if (la) {
        atomic_store(&listener_stop, true);
        uint64_t one = 1;
        if (write(la->event_fd, &one, sizeof one) < 0) {
            /* the poll timeout wakes it within a second anyway */
        }
        pthread_join(listener_thread, NULL);
        close(la->listen_fd);
        close(la->event_fd);
        free(la);
    }
    pthread_mutex_lock(&ipc_lock);
    listener_args = NULL;
    listening = false;
    own_pid = 0;
    own_token = 0;
    for (size_t i = 0; i < nexports; i++)
        vmh_heap_export_release(&exports[i].ex);
    nexports = 0;
    ipc_shut = false;
    atomic_flag_clear(&warned_handle_type);
    pthread_mutex_unlock(&ipc_lock);

    pthread_mutex_lock(&imp_lock);
    for (size_t i = 0; i < nimports; i++)
        vmh_range_destroy(imports[i].range);
    nimports = 0;
    atomic_store(&nimports_atomic, 0);
    pthread_mutex_unlock(&imp_lock);
}

size_t vmh_ipc_export_count(void)
{
    pthread_mutex_lock(&ipc_lock);
    size_t n = nexports;
    pthread_mutex_unlock(&ipc_lock);
    return n;
}

size_t vmh_ipc_import_count(void)
{
    pthread_mutex_lock(&imp_lock);
    size_t n = nimports;
    pthread_mutex_unlock(&imp_lock);
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
