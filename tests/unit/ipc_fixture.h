/* Shared by the IPC suites (test_ipc_export.c, test_ipc_lifetime.c, test_ipc_security.c,
 * test_ipc_limits.c): CUDA IPC of served buffers and peer access (ipc.c, ipc_wire.c,
 * ipc_export.c, ipc_listener.c, ipc_import.c) on the simulated driver.
 *
 * The simulated driver imports only fds exported by its own process, so these tests export and
 * import in one process: vmh_ipc_open_remote is the import path without the same-process check,
 * and it talks to this process's own listener thread through the real abstract socket and
 * SCM_RIGHTS. Imported mappings therefore alias the exporter's memory here, which lets the
 * tests check contents too. Another user is played two ways: simulated credentials (the
 * getter both ends use is replaced, per side), and where the suite runs as root, forked
 * children that become uid 65534. Every test ends with the module reset, the heap reset, the
 * driver's ledger empty and no file descriptor left open. tests/interpose/ip_ipc.c covers two
 * processes; docs/SECURITY.md says which test checks which promise.
 *
 * Here: the log captured, the descriptor count, the fixtures, the handle's wire form, and a
 * raw connection to an exporter as any local process can make one. Header-only (static) like
 * testutil.h, so that each suite stays one program of one file; include it first. */
#ifndef VMH_IPC_FIXTURE_H
#define VMH_IPC_FIXTURE_H

#ifndef VMH_TESTING
#define VMH_TESTING 1 /* the internal prototypes of ipc.h and log.h */
#endif
#include "testutil.h"

#include "contexts.h"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ipc.h"
#include "ipc_export.h"
#include "ipc_import.h"
#include "ipc_listener.h"
#include "ipc_wire.h"
#include "lifetime.h"
#include "log.h"
#include "log_capture.h"
#include "reclaim.h"

/* ---- helpers ------------------------------------------------------------------------------ */

static inline int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (!d)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

static int fds_at_start;

/* The descriptor count once the listener thread (in this same process) has closed its side of
 * the last exchange: it closes its socket and its copies of the exported fds after the
 * importer has already read everything, so the count settles shortly after. */
static inline int settled_fds(int want)
{
    int n = count_fds();
    for (int i = 0; i < 200 && n != want; i++) {
        usleep(5000);
        n = count_fds();
    }
    return n;
}

static inline int group_setup(void **state)
{
    (void)state;
    tu_reset(NULL);
    assert_true(vmh_lifetime_ready()); /* reads the options once; the tests' values come after */
    vmh_log_sink = capture_sink;
    return 0;
}

static inline void reset_with(int devices, vmh_handle_kind_t kind)
{
    sim_config_t cfg = {.devices = devices};
    tu_reset(&cfg);
    tu_opt.handle = kind;
    tu_opt.pack_below = 1 * MiB; /* pinned: the tests name buffers big (own chunks) or packed */
    tu_configure();
    capture_clear();
    fds_at_start = count_fds();
}

static inline int setup(void **state)
{
    (void)state;
    reset_with(2, VMH_HANDLE_POSIX_FD);
    return 0;
}

static inline int teardown(void **state)
{
    (void)state;
    vmh_ipc_peer_cred = vmh_ipc_so_peercred;
    vmh_ipc_request_timeout_ms = 2000;
    vmh_ipc_send_timeout_ms = 10000;
    vmh_ipc_exchange_timeout_ms = 10000;
    vmh_ipc_reset();
    assert_false(vmh_ipc_listening());
    assert_int_equal(vmh_ipc_export_count(), 0);
    assert_int_equal(vmh_ipc_import_count(), 0);
    vmh_heap_trim();
    vmh_heap_reset();
    tu_assert_ledger_empty();
    assert_int_equal(count_fds(), fds_at_start);
    return 0;
}

static inline vmh_ipc_handle_t decode(const CUipcMemHandle *h)
{
    vmh_ipc_handle_t w;
    memcpy(&w, h->reserved, sizeof w);
    return w;
}

static inline CUipcMemHandle get_handle(CUdeviceptr p)
{
    CUipcMemHandle h;
    assert_int_equal(vmh_ipc_get_handle(p, &h), CUDA_SUCCESS);
    assert_true(vmh_ipc_handle_is_ours(&h));
    return h;
}

/* The monotonic clock in ms, for the checks of how long an exchange took. */
static inline int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A raw connection to the exporter named by h, as any local process can make one. */
static inline int raw_connect(const vmh_ipc_handle_t *h)
{
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    assert_true(s >= 0);
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    size_t n = vmh_ipc_socket_name(sa.sun_path + 1, sizeof sa.sun_path - 1, h->pid,
                                   h->socket_token);
    if (connect(s, (struct sockaddr *)&sa,
                (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n)) != 0) {
        close(s);
        return -1;
    }
    return s;
}

/* Waits up to ms for what the exporter says on s: 1 a reply (in *rep), 0 the connection
 * closed without one, -1 nothing in time. */
static inline int await_reply(int s, int ms, vmh_ipc_reply_t *rep)
{
    struct pollfd p = {.fd = s, .events = POLLIN};
    if (poll(&p, 1, ms) <= 0)
        return -1;
    ssize_t n = recv(s, rep, sizeof *rep, MSG_DONTWAIT);
    return n == (ssize_t)sizeof *rep ? 1 : 0;
}

#endif
