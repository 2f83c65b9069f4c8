/* CUDA IPC wire format, sockets, credentials, bounded waits and tokens (see ipc_wire.h). */
#include "ipc_wire.h"

#include "clock.h"
#include "testable.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

_Static_assert(sizeof(vmh_ipc_handle_t) == sizeof(CUipcMemHandle),
               "the handle must fill a CUipcMemHandle exactly");
_Static_assert(offsetof(vmh_ipc_handle_t, check) + sizeof(uint64_t) == sizeof(vmh_ipc_handle_t),
               "the check covers every field before it and is the last one");

/* ---- the handle -------------------------------------------------------------------------- */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* Over every byte before `check`: a random 64 bytes (a driver's handle) passes with probability
 * 2^-96 (magic and check). Public: it recognizes, it does not authenticate. */
static uint64_t handle_check(const vmh_ipc_handle_t *h)
{
    uint64_t x = 0x9e3779b97f4a7c15ull;
    const unsigned char *p = (const unsigned char *)h;
    for (size_t i = 0; i < offsetof(vmh_ipc_handle_t, check); i += 8) {
        uint64_t w;
        memcpy(&w, p + i, sizeof w);
        x = mix64(x ^ w);
    }
    return x;
}

void vmh_ipc_handle_encode(vmh_ipc_handle_t *h, CUipcMemHandle *out)
{
    h->check = handle_check(h);
    memset(out, 0, sizeof *out);
    memcpy(out->reserved, h, sizeof *h);
}

bool vmh_ipc_handle_decode(const CUipcMemHandle *in, vmh_ipc_handle_t *h)
{
    memcpy(h, in->reserved, sizeof *h);
    return h->magic == VMH_IPC_MAGIC && h->version == VMH_IPC_VERSION &&
           h->check == handle_check(h);
}

/* ---- time -------------------------------------------------------------------------------- */

int64_t vmh_ipc_now_ms(void)
{
    return (int64_t)(vmh_now_ns() / 1000000);
}

/* Polls fd for events until deadline_ms: 0 when ready, ETIMEDOUT, or the errno. */
static int wait_for(int fd, short events, int64_t deadline_ms)
{
    for (;;) {
        int64_t left = deadline_ms - vmh_ipc_now_ms();
        if (left < 0)
            left = 0;
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, left > 60000 ? 60000 : (int)left);
        if (n > 0)
            return 0;
        if (n < 0 && errno != EINTR)
            return errno;
        if (n == 0 && vmh_ipc_now_ms() >= deadline_ms)
            return ETIMEDOUT;
    }
}

/* ---- sockets ------------------------------------------------------------------------------- */

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

int vmh_ipc_listen(uint32_t pid, uint64_t *token)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -errno;
    /* A name in use (vanishingly unlikely with 64 random bits, or squatted by someone who read
     * /proc/net/unix) gets another token. */
    int err = EADDRINUSE;
    for (int attempt = 0; attempt < 4 && err == EADDRINUSE; attempt++) {
        uint64_t t = 0;
        if (!vmh_ipc_random(&t, sizeof t)) {
            err = EIO;
            break;
        }
        struct sockaddr_un sa;
        socklen_t sl = socket_addr(&sa, pid, t);
        err = bind(fd, (struct sockaddr *)&sa, sl) == 0 ? 0 : errno;
        if (!err)
            *token = t;
    }
    if (!err && listen(fd, 64) != 0)
        err = errno;
    if (err) {
        close(fd);
        return -err;
    }
    return fd;
}

int vmh_ipc_connect(uint32_t pid, uint64_t token, int64_t deadline_ms)
{
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0)
        return -errno;
    struct sockaddr_un sa;
    socklen_t sl = socket_addr(&sa, pid, token);
    int err;
    do
        err = connect(s, (struct sockaddr *)&sa, sl) == 0 ? 0 : errno;
    while (err == EINTR);
    /* A Unix socket connects at once or, its backlog full, answers EAGAIN (non-blocking):
     * retried until the deadline, so that a flooded exporter cannot hold us. */
    while (err == EAGAIN && vmh_ipc_now_ms() < deadline_ms) {
        struct timespec pause = {.tv_sec = 0, .tv_nsec = 10 * 1000 * 1000};
        nanosleep(&pause, NULL);
        err = connect(s, (struct sockaddr *)&sa, sl) == 0 ? 0 : errno;
    }
    if (err) {
        close(s);
        return -(err == EAGAIN ? ETIMEDOUT : err);
    }
    return s;
}

/* Room for the descriptors of one batch, aligned as a control message header must be. */
typedef union {
    char buf[CMSG_SPACE(VMH_IPC_BATCH * sizeof(int))];
    struct cmsghdr align;
} ctl_buf_t;

/* A message of one part, iov, with the first ctl_len bytes of ctl (zeroed) as its control data
 * (0: none, and ctl is not touched). */
static void msg_init(struct msghdr *msg, struct iovec *iov, ctl_buf_t *ctl, size_t ctl_len)
{
    memset(msg, 0, sizeof *msg);
    msg->msg_iov = iov;
    msg->msg_iovlen = 1;
    if (ctl_len) {
        memset(ctl, 0, sizeof *ctl);
        msg->msg_control = ctl->buf;
        msg->msg_controllen = ctl_len;
    }
}

int vmh_ipc_send(int fd, const void *buf, size_t len, const int *fds, size_t nfds)
{
    if (nfds > VMH_IPC_BATCH)
        return EINVAL;
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    ctl_buf_t ctl;
    struct msghdr msg;
    msg_init(&msg, &iov, &ctl, nfds ? CMSG_SPACE(nfds * sizeof(int)) : 0);
    if (nfds) {
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
        memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
    }
    ssize_t n;
    /* MSG_NOSIGNAL: a peer that went away must not kill the program with SIGPIPE. */
    do
        n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0)
        return errno == EWOULDBLOCK ? EAGAIN : errno;
    return n == (ssize_t)len ? 0 : EPROTO;
}

int vmh_ipc_recv(int fd, void *buf, size_t len, int *fds, size_t maxfds, size_t *nfds,
                 int64_t deadline_ms)
{
    *nfds = 0;
    if (deadline_ms) {
        int err = wait_for(fd, POLLIN, deadline_ms);
        if (err)
            return err;
    }
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    ctl_buf_t ctl;
    struct msghdr msg;
    msg_init(&msg, &iov, &ctl, sizeof ctl.buf);
    ssize_t n;
    do
        n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0 && errno == ECONNRESET) {
        /* The peer closed with a message of ours unread (an exporter refusing at accept need not
         * read the request): the kernel reports that first, and once, before the messages the
         * peer had queued for us, among them its answer. */
        msg.msg_controllen = sizeof ctl.buf;
        n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            errno = ECONNRESET;
    }
    if (n < 0)
        return errno == EWOULDBLOCK ? EAGAIN : errno;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int d;
            memcpy(&d, CMSG_DATA(c) + i * sizeof(int), sizeof d);
            if (*nfds < maxfds)
                fds[(*nfds)++] = d;
            else
                close(d);
        }
    }
    if (n == 0)
        return EPIPE;
    if (msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC) || (size_t)n != len)
        return EPROTO; /* descriptors lost (the descriptor limit) or a message of another size */
    return 0;
}

/* ---- credentials and tokens ---------------------------------------------------------------- */

VMH_TESTABLE int vmh_ipc_so_peercred(int fd, vmh_ipc_side_t side, uid_t *uid, pid_t *pid)
{
    (void)side;
    struct ucred cred;
    socklen_t clen = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0)
        return errno;
    if (clen != sizeof cred)
        return EPROTO;
    *uid = cred.uid;
    *pid = cred.pid;
    return 0;
}

#ifdef VMH_TESTING
_Atomic(vmh_ipc_cred_fn) vmh_ipc_peer_cred = vmh_ipc_so_peercred;
#define PEER_CRED atomic_load(&vmh_ipc_peer_cred)
#else
#define PEER_CRED vmh_ipc_so_peercred
#endif

int vmh_ipc_check_peer(int fd, vmh_ipc_side_t side, uid_t *peer_uid, pid_t *peer_pid)
{
    *peer_uid = (uid_t)-1;
    *peer_pid = 0;
    int err = PEER_CRED(fd, side, peer_uid, peer_pid);
    if (err)
        return err;
    /* The kernel's record of who made the connection (the importer's connect, the exporter's
     * listen), not anything the peer says: the effective uid, which is what file and memory
     * permissions go by. */
    return *peer_uid == geteuid() ? 0 : EACCES;
}

bool vmh_ipc_random(void *buf, size_t n)
{
    unsigned char *p = buf;
    size_t got = 0;
    while (got < n) {
        ssize_t k = getrandom(p + got, n - got, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    if (got == n)
        return true;
    /* getrandom missing (seccomp, old kernel): the same pool through the file. */
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    while (got < n) {
        ssize_t k = read(fd, p + got, n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    close(fd);
    return got == n;
}

bool vmh_ipc_token_equal(const vmh_ipc_token_t *a, const vmh_ipc_token_t *b)
{
    unsigned char diff = 0;
    for (size_t i = 0; i < VMH_IPC_TOKEN_BYTES; i++)
        diff |= (unsigned char)(a->b[i] ^ b->b[i]);
    return diff == 0;
}
