/* CUDA IPC of served buffers and peer access (ipc.c, ipc_wire.c, ipc_export.c, ipc_listener.c,
 * ipc_import.c) on the simulated driver.
 *
 * The simulated driver imports only fds exported by its own process, so these tests export and
 * import in one process: vmh_ipc_open_remote is the import path without the same-process check,
 * and it talks to this process's own listener thread through the real abstract socket and
 * SCM_RIGHTS. Imported mappings therefore alias the exporter's memory here, which lets the
 * tests check contents too. Another user is played two ways: simulated credentials (the
 * getter both ends use is replaced, per side), and where the suite runs as root, forked
 * children that become uid 65534. Every test ends with the module reset, the heap reset, the
 * driver's ledger empty and no file descriptor left open. tests/interpose/ip_ipc.c covers two
 * processes; docs/SECURITY.md says which test checks which promise. */
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
#include "reclaim.h"

/* ---- helpers ------------------------------------------------------------------------------ */

static pthread_mutex_t cap_lock = PTHREAD_MUTEX_INITIALIZER;
static char cap_text[1 << 16];
static size_t cap_len;

static void capture_sink(const char *line, size_t len)
{
    pthread_mutex_lock(&cap_lock);
    if (cap_len + len < sizeof cap_text) {
        memcpy(cap_text + cap_len, line, len);
        cap_len += len;
        cap_text[cap_len] = '\0';
    }
    pthread_mutex_unlock(&cap_lock);
}

static size_t captured(const char *needle)
{
    pthread_mutex_lock(&cap_lock);
    size_t k = 0;
    for (const char *p = cap_text; (p = strstr(p, needle)) != NULL; p += strlen(needle))
        k++;
    pthread_mutex_unlock(&cap_lock);
    return k;
}

static void capture_clear(void)
{
    pthread_mutex_lock(&cap_lock);
    cap_len = 0;
    cap_text[0] = '\0';
    pthread_mutex_unlock(&cap_lock);
}

static int count_fds(void)
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
static int settled_fds(int want)
{
    int n = count_fds();
    for (int i = 0; i < 200 && n != want; i++) {
        usleep(5000);
        n = count_fds();
    }
    return n;
}

static int group_setup(void **state)
{
    (void)state;
    tu_reset(NULL);
    assert_true(vmh_lifetime_ready()); /* reads the options once; the tests' values come after */
    vmh_log_sink = capture_sink;
    return 0;
}

static void reset_with(int devices, vmh_handle_kind_t kind)
{
    sim_config_t cfg = {.devices = devices};
    tu_reset(&cfg);
    tu_opt.handle = kind;
    tu_opt.pack_below = 1 * MiB; /* pinned: the tests name buffers big (own chunks) or packed */
    tu_configure();
    capture_clear();
    fds_at_start = count_fds();
}

static int setup(void **state)
{
    (void)state;
    reset_with(2, VMH_HANDLE_POSIX_FD);
    return 0;
}

static int teardown(void **state)
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

static vmh_ipc_handle_t decode(const CUipcMemHandle *h)
{
    vmh_ipc_handle_t w;
    memcpy(&w, h->reserved, sizeof w);
    return w;
}

static CUipcMemHandle get_handle(CUdeviceptr p)
{
    CUipcMemHandle h;
    assert_int_equal(vmh_ipc_get_handle(p, &h), CUDA_SUCCESS);
    assert_true(vmh_ipc_handle_is_ours(&h));
    return h;
}

/* ---- refusals ----------------------------------------------------------------------------- */

static void handle_type_none_refuses_and_says_so_once(void **state)
{
    (void)state;
    reset_with(1, VMH_HANDLE_NONE);
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(3 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h;
    assert_int_equal(vmh_ipc_get_handle(p, &h), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_ipc_get_handle(p + 100, &h), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(captured("VMMHOOK_HANDLE_TYPE=posix_fd"), 1);
    assert_false(vmh_ipc_listening());
    assert_int_equal(vmh_ipc_export_count(), 0);
    /* A pointer the library did not serve is the driver's business. */
    assert_int_equal(vmh_ipc_get_handle(0x1234, &h), CUDA_ERROR_NOT_FOUND);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void handle_type_refused_by_the_device(void **state)
{
    (void)state;
    /* posix_fd asked for, but the chunks were made without it (fabric falls back to none on
     * the simulated driver, which refuses fabric like the H200). */
    reset_with(1, VMH_HANDLE_FABRIC);
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(3 * MiB, &p), CUDA_SUCCESS);
    tu_opt.handle = VMH_HANDLE_POSIX_FD;
    tu_configure();
    CUipcMemHandle h;
    assert_int_equal(vmh_ipc_get_handle(p, &h), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(captured("refused POSIX fd"), 1);
    assert_int_equal(vmh_ipc_export_count(), 0);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void foreign_and_bad_handles_are_not_ours(void **state)
{
    (void)state;
    CUipcMemHandle zero;
    memset(&zero, 0, sizeof zero);
    assert_false(vmh_ipc_handle_is_ours(&zero));
    /* A native handle of the simulated driver (its own magic). */
    CUdeviceptr n;
    CUipcMemHandle nh;
    assert_int_equal(sim_table()->cuMemAlloc(&n, 4096), CUDA_SUCCESS);
    assert_int_equal(sim_table()->cuIpcGetMemHandle(&nh, n), CUDA_SUCCESS);
    assert_false(vmh_ipc_handle_is_ours(&nh));
    assert_int_equal(sim_table()->cuMemFree(n), CUDA_SUCCESS);
    /* Ours, with any byte changed, is not ours any more. */
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    for (size_t i = 0; i < offsetof(vmh_ipc_handle_t, check) + 8; i++) {
        CUipcMemHandle bad = h;
        bad.reserved[i] ^= 0x10;
        assert_false(vmh_ipc_handle_is_ours(&bad));
    }
    assert_int_equal(vmh_ipc_close(p), CUDA_ERROR_NOT_FOUND); /* not opened here */
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void same_process_flags_and_context(void **state)
{
    (void)state;
    CUdeviceptr p, q = 0;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    /* As the driver: a handle of this same process. */
    assert_int_equal(vmh_ipc_open(&h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, &q),
                     CUDA_ERROR_INVALID_CONTEXT);
    assert_int_equal(vmh_ipc_open(&h, 0, &q), CUDA_ERROR_INVALID_VALUE);
    sim_set_current_device(-1);
    assert_int_equal(vmh_ipc_open(&h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, &q),
                     CUDA_ERROR_INVALID_CONTEXT);
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_ERROR_INVALID_CONTEXT);
    sim_set_current_device(0);
    assert_int_equal(q, 0);
    assert_int_equal(vmh_ipc_import_count(), 0);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* ---- export and import -------------------------------------------------------------------- */

static void big_buffer_round_trip(void **state)
{
    (void)state;
    const size_t n = 6 * MiB + 5;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(n, &p), CUDA_SUCCESS);
    vmh_buffer_info_t bi;
    assert_true(vmh_heap_find(p, &bi) && !bi.packed);
    tu_fill(p, n, 1);
    CUipcMemHandle h = get_handle(p);
    vmh_ipc_handle_t w = decode(&h);
    assert_int_equal(w.pid, (uint32_t)getpid());
    assert_int_equal(w.size, n);
    assert_int_equal(w.offset, 0);
    assert_int_equal(w.device, 0);
    assert_true(vmh_ipc_listening());
    /* The same buffer gives the same handle (PyTorch asks once per tensor sent). */
    CUipcMemHandle again = get_handle(p + 4096);
    assert_memory_equal(&h, &again, sizeof h);
    assert_int_equal(vmh_ipc_export_count(), 1);

    sim_reset_counters();
    CUdeviceptr q = 0, q2 = 0;
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_SUCCESS);
    assert_int_not_equal(q, 0);
    assert_int_not_equal(q, p);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), 1);
    assert_int_equal(sim_calls("cuMemImportFromShareableHandle"), 1);
    assert_int_equal(sim_access_flags(q, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(q, 1), 0);
    /* The same memory: what the exporter wrote, and writes back. */
    assert_true(tu_check(q, n, 1));
    tu_fill(q, n, 2);
    assert_true(tu_check(p, n, 2));
    /* Opened twice in one context: the same pointer, counted (cuda.h). */
    assert_int_equal(vmh_ipc_open_remote(&h, &q2), CUDA_SUCCESS);
    assert_int_equal(q2, q);
    assert_int_equal(sim_calls("cuMemImportFromShareableHandle"), 1);
    assert_int_equal(vmh_ipc_import_count(), 1);
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_true(sim_is_mapped(q));
    assert_int_equal(vmh_ipc_close(q + 256), CUDA_ERROR_NOT_FOUND); /* only what open gave */
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_false(sim_is_mapped(q));
    assert_int_equal(vmh_ipc_close(q), CUDA_ERROR_NOT_FOUND);
    assert_int_equal(vmh_ipc_import_count(), 0);
    assert_true(tu_check(p, n, 2));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* Closing the last reference waits for the device's work before the mapping goes; during a
 * capture that wait would be refused and invalidate the capture: the close is refused without
 * a driver call and the import stays open, to be closed after the capture (a blocking wait). */
static void close_during_capture_is_refused_and_kept(void **state)
{
    (void)state;
    const size_t n = 4 * MiB;
    CUdeviceptr p, q;
    assert_int_equal(vmh_heap_alloc(n, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_SUCCESS);
    const vmh_driver_t *D = sim_table();
    CUstream s;
    assert_int_equal(D->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    assert_int_equal(D->cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
    vmh_capture_began(s, CU_STREAM_CAPTURE_MODE_GLOBAL); /* what the interposer reports */
    sim_reset_counters();
    assert_int_equal(vmh_ipc_close(q), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert_int_equal(sim_call_count(), 0);
    assert_true(sim_is_mapped(q));
    assert_int_equal(vmh_ipc_import_count(), 1);
    CUgraph g = NULL;
    assert_int_equal(D->cuStreamEndCapture(s, &g), CUDA_SUCCESS); /* not invalidated */
    vmh_capture_ended(s);
    assert_int_equal(D->cuGraphDestroy(g), CUDA_SUCCESS);
    assert_int_equal(D->cuStreamDestroy(s), CUDA_SUCCESS);
    uint64_t blocking = vmh_counter_get(VMH_STAT_syncs_blocking);
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_false(sim_is_mapped(q));
    assert_int_equal(vmh_counter_get(VMH_STAT_syncs_blocking), blocking + 1);
    assert_int_equal(vmh_ipc_import_count(), 0);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void packed_buffer_maps_its_chunk_at_the_offset(void **state)
{
    (void)state;
    CUdeviceptr a, b;
    assert_int_equal(vmh_heap_alloc(5000, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(3000, &b), CUDA_SUCCESS);
    vmh_buffer_info_t bi;
    assert_true(vmh_heap_find(b, &bi) && bi.packed);
    tu_fill(a, 5000, 3);
    tu_fill(b, 3000, 4);
    CUipcMemHandle h = get_handle(b);
    vmh_ipc_handle_t w = decode(&h);
    assert_int_equal(w.size, 3000);
    assert_true(w.offset > 0);
    CUdeviceptr q;
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_SUCCESS);
    assert_int_equal(q % GRAN, w.offset % GRAN);
    assert_true(tu_check(q, 3000, 4));
    /* The neighbour shares the chunk: it is there too, before the buffer. */
    assert_true(tu_check(q - (b - a), 5000, 3));
    tu_fill(q, 3000, 5);
    assert_true(tu_check(b, 3000, 5));
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS);
}

/* The importer keeps what it opened when the exporter grows, moves and frees the buffer; it
 * sees the buffer as it was when the handle was made (its size then, not the growth). */
static void importer_keeps_its_view_through_grow_and_free(void **state)
{
    (void)state;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
    vmh_buffer_info_t bi;
    assert_true(vmh_heap_find(p, &bi) && !bi.packed);
    tu_fill(p, 4 * MiB, 6);
    CUipcMemHandle h1 = get_handle(p);
    CUdeviceptr q1;
    assert_int_equal(vmh_ipc_open_remote(&h1, &q1), CUDA_SUCCESS);
    tu_opt.headroom = 0;
    tu_configure();
    sim_refuse_hints(true); /* the grow moves the buffer */
    CUdeviceptr old = p;
    assert_int_equal(vmh_heap_realloc(&p, 20 * MiB, NULL, false), CUDA_SUCCESS);
    sim_refuse_hints(false);
    assert_int_not_equal(p, old);
    vmh_heap_trim(); /* the old address is unmapped once its queued work is done */
    assert_true(tu_check(q1, 4 * MiB, 6));
    /* A new handle for the grown buffer: two chunks now. */
    CUipcMemHandle h2 = get_handle(p);
    assert_memory_not_equal(&h1, &h2, sizeof h1);
    assert_int_equal(decode(&h2).size, 20 * MiB);
    tu_fill(p, 20 * MiB, 7);
    CUdeviceptr q2;
    assert_int_equal(vmh_ipc_open_remote(&h2, &q2), CUDA_SUCCESS);
    assert_true(tu_check(q2, 20 * MiB, 7));
    /* q1 maps the first chunk, which the grown buffer still uses. */
    assert_true(tu_check(q1, 4 * MiB, 7));
    /* The move freed the old address: h1's entry went (h1 opens nothing new any more; q1 is
     * the importer's own). */
    assert_int_equal(vmh_ipc_export_count(), 1);

    /* The exporter frees: the importer's mappings stay. */
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    assert_false(sim_is_mapped(p));
    assert_true(tu_check(q2, 20 * MiB, 7));
    /* New memory of the same size is other memory. */
    CUdeviceptr r;
    assert_int_equal(vmh_heap_alloc(20 * MiB, &r), CUDA_SUCCESS);
    tu_fill(r, 20 * MiB, 8);
    assert_true(tu_check(q2, 20 * MiB, 7));
    /* Freed: the table lets go (the imports hold the memory themselves). */
    vmh_ipc_prune(); /* the listener may have done it already: it prunes every second */
    assert_int_equal(vmh_ipc_export_count(), 0);
    assert_true(tu_check(q1, 4 * MiB, 7));
    assert_int_equal(vmh_ipc_close(q1), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_close(q2), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(r, NULL, false), CUDA_SUCCESS);
}

static void many_chunks_cross_in_batches(void **state)
{
    (void)state;
    /* Each grow adds one chunk: more chunks than one SCM_RIGHTS batch carries. */
    tu_opt.headroom = 128 * MiB;
    tu_configure();
    CUdeviceptr p = 0;
    const int steps = VMH_IPC_BATCH + 8;
    for (int i = 1; i <= steps; i++)
        assert_int_equal(vmh_heap_realloc(&p, (size_t)i * GRAN, NULL, false), CUDA_SUCCESS);
    const size_t n = (size_t)steps * GRAN;
    tu_fill(p, n, 9);
    CUipcMemHandle h = get_handle(p);
    sim_reset_counters();
    CUdeviceptr q;
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemImportFromShareableHandle"), (unsigned long)steps);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), (unsigned long)steps);
    assert_true(tu_check(q, n, 9));
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* ---- the exporter says no ----------------------------------------------------------------- */

static void freed_before_open_is_an_invalid_handle(void **state)
{
    (void)state;
    CUdeviceptr p, q = 0;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_ERROR_INVALID_HANDLE);
    assert_int_equal(captured("has no such export"), 1);
    assert_int_equal(vmh_ipc_export_count(), 0);
}

/* Exit is lifetime.c's call (issue 13: one owner of the library's lifetime): its IPC exit
 * handler stops the listener and the export table, after which nothing is exported (the driver
 * may be gone) and the export table makes no driver call; a fork meanwhile (the handlers that
 * lifetime installed at the first export) leaves the child with usable locks. */
static void lifetime_exit_stops_exports(void **state)
{
    (void)state;
    CUdeviceptr p, r;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(2 * MiB, &r), CUDA_SUCCESS);
    (void)get_handle(p); /* IPC began: lifetime's handlers are installed */
    pid_t child = fork();
    if (child == 0) /* the table's and the listener's locks are free in the child */
        _exit(vmh_ipc_export_count() == 1 && !vmh_ipc_listener_is_own(0, 0) ? 0 : 1);
    int status = 0;
    assert_int_equal(waitpid(child, &status, 0), child);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    vmh_lifetime_ipc_exit();
    sim_reset_counters();
    CUipcMemHandle h;
    assert_int_equal(vmh_ipc_get_handle(r, &h), CUDA_ERROR_DEINITIALIZED);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), 0);
    assert_int_equal(vmh_ipc_export_count(), 1);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(r, NULL, false), CUDA_SUCCESS);
    vmh_ipc_reset(); /* (tests only) the table serves again */
}

/* Issue 20: one owner of process events. lifetime.c alone registers fork handlers; a child
 * forked while the listener runs (IPC began) ran each fork step exactly once, in lifetime.c's
 * order: the prefork locks top down (import, listener, export), then in the child their
 * release, contexts, the reclaim thread, the heap, IPC (bottom up); contexts.c's own step
 * (which once ran twice: it registered a handler of its own too) is counted where it runs.
 * The parent ran the prefork and its release, once per fork, and exports again afterwards
 * (nothing was left locked).
 *
 * With the reclaim thread running (a parked free) and a thread exporting during the forks: the
 * test found a use-after-free there (an exported buffer's free read its range's size after
 * parking it, and the reclaim thread could release it first: bigbuf.c), failing most runs on
 * e516064 under ASan; VMH_TEST_FORK_RACE=0 leaves both out. */
typedef struct {
    CUdeviceptr p;
    atomic_bool stop;
    unsigned rounds;
} exporter_arg_t;

static void *export_loop(void *arg)
{
    exporter_arg_t *a = arg;
    while (!atomic_load(&a->stop)) {
        CUipcMemHandle h;
        if (vmh_ipc_get_handle(a->p, &h) != CUDA_SUCCESS)
            break;
        a->rounds++;
    }
    return NULL;
}

static void fork_runs_each_step_once(void **state)
{
    (void)state;
    const char *env = getenv("VMH_TEST_FORK_RACE");
    bool race = !env || strcmp(env, "0") != 0;
    vmh_reclaim_background(race);
    CUdeviceptr p, q;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    (void)get_handle(p); /* IPC began: the listener runs */
    assert_true(vmh_ipc_listening());
    assert_int_equal(vmh_heap_alloc(4 * MiB, &q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
    exporter_arg_t arg = {.p = p};
    pthread_t t;
    if (race) {
        assert_true(vmh_reclaim_thread_running());
        assert_int_equal(pthread_create(&t, NULL, export_loop, &arg), 0);
    }
    for (int i = 0; i < 20; i++) {
        unsigned runs = vmh_contexts_after_fork_runs();
        vmh_lifetime_steps_clear();
        pid_t child = fork();
        assert_true(child >= 0);
        if (child == 0) {
            alarm(10); /* a lock left held hangs the child: SIGALRM ends it */
            const char *steps = vmh_lifetime_steps();
            unsigned mine = vmh_contexts_after_fork_runs() - runs;
            CUipcMemHandle h;
            bool stopped = vmh_ipc_get_handle(p, &h) != CUDA_SUCCESS; /* pass-through now */
            if (strcmp(steps, "ilecCRHI") != 0 || mine != 1 || !stopped) {
                fprintf(stderr, "child: steps \"%s\" (want \"ilecCRHI\"), contexts step ran %u "
                        "times, IPC %s\n", steps, mine, stopped ? "stopped" : "still serves");
                _exit(1);
            }
            _exit(0);
        }
        int status = 0;
        assert_int_equal(waitpid(child, &status, 0), child);
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 0);
        assert_string_equal(vmh_lifetime_steps(), "ilep");
        assert_int_equal(vmh_contexts_after_fork_runs(), runs); /* the parent's own: none */
    }
    if (race) {
        atomic_store(&arg.stop, true);
        pthread_join(t, NULL);
        assert_true(arg.rounds > 0);
    }
    (void)get_handle(p); /* every lock the prefork took was released */
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void closed_exporter_socket(void **state)
{
    (void)state;
    CUdeviceptr p, q = 0;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    vmh_ipc_reset(); /* the listener and its socket go, as when the exporter exits */
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_ERROR_INVALID_HANDLE);
    assert_int_equal(captured("cannot be reached"), 1);
    /* A new export gets a new token: the old handle still names nothing. */
    CUipcMemHandle h2 = get_handle(p);
    assert_true(decode(&h2).socket_token != decode(&h).socket_token);
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_ERROR_INVALID_HANDLE);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* ---- hardening (issue 16): each of these failed before the round-10 rewrite ---------------- */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A raw connection to the exporter named by h, as any local process can make one. */
static int raw_connect(const vmh_ipc_handle_t *h)
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
static int await_reply(int s, int ms, vmh_ipc_reply_t *rep)
{
    struct pollfd p = {.fd = s, .events = POLLIN};
    if (poll(&p, 1, ms) <= 0)
        return -1;
    ssize_t n = recv(s, rep, sizeof *rep, MSG_DONTWAIT);
    return n == (ssize_t)sizeof *rep ? 1 : 0;
}

/* Simulated credentials: the peer of every connection runs as another uid when `side` asks. */
static vmh_ipc_side_t foreign_side;
static int foreign_cred(int fd, vmh_ipc_side_t side, uid_t *uid, pid_t *pid)
{
    int err = vmh_ipc_so_peercred(fd, side, uid, pid);
    if (!err && side == foreign_side)
        *uid = geteuid() + 1000;
    return err;
}

/* The exporter checks who connected as it accepts, before it waits for anything: a peer of
 * another uid that sends nothing is answered at once, nothing is exported for it, and a
 * neighbour connecting in a loop gets one log line, not one per attempt. */
static void exporter_refuses_another_user_before_waiting(void **state)
{
    (void)state;
    CUdeviceptr p, q = 0;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    vmh_ipc_handle_t w = decode(&h);
    foreign_side = VMH_IPC_EXPORTER_ASKS;
    vmh_ipc_peer_cred = foreign_cred;
    sim_reset_counters();
    for (int i = 0; i < 5; i++) {
        int s = raw_connect(&w);
        assert_true(s >= 0);
        vmh_ipc_reply_t rep;
        memset(&rep, 0, sizeof rep);
        int64_t t0 = now_ms();
        assert_int_equal(await_reply(s, 1000, &rep), 1); /* nothing was sent */
        assert_true(now_ms() - t0 < 1000);
        assert_int_equal(rep.status, VMH_IPC_REFUSED_USER);
        close(s);
    }
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_ERROR_INVALID_HANDLE);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), 0);
    assert_int_equal(captured("refused a CUDA IPC request"), 1);
    assert_int_equal(captured("runs as another user"), 1);
    vmh_ipc_peer_cred = vmh_ipc_so_peercred;
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* The importer checks who owns the socket before it sends the token: an exporter of another
 * uid never learns it (so never exports), and cannot hand over memory. */
static void importer_refuses_an_exporter_of_another_user(void **state)
{
    (void)state;
    CUdeviceptr p, q = 0;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    foreign_side = VMH_IPC_IMPORTER_ASKS;
    vmh_ipc_peer_cred = foreign_cred;
    sim_reset_counters();
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_ERROR_INVALID_HANDLE);
    assert_int_equal(q, 0);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), 0);
    assert_int_equal(sim_calls("cuMemImportFromShareableHandle"), 0);
    assert_int_equal(captured("not to this user"), 1);
    assert_int_equal(vmh_ipc_import_count(), 0);
    vmh_ipc_peer_cred = vmh_ipc_so_peercred;
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* Runs fn in a child that has become uid/gid 65534; returns its exit status (fn's result). */
static int as_nobody(int (*fn)(void *), void *arg)
{
    fflush(stdout);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (setgroups(0, NULL) != 0 || setgid(65534) != 0 || setuid(65534) != 0)
            _exit(77);
        _exit(fn(arg));
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* As uid 65534: connect to the exporter, send nothing, expect the refusal within a second. */
static int nobody_connects(void *arg)
{
    const vmh_ipc_handle_t *w = arg;
    int s = raw_connect(w);
    if (s < 0)
        return 10;
    vmh_ipc_reply_t rep;
    memset(&rep, 0, sizeof rep);
    int r = await_reply(s, 1000, &rep);
    close(s);
    if (r != 1)
        return 11; /* no answer in time: the exporter waited for a request first */
    return rep.status == VMH_IPC_REFUSED_USER ? 0 : 12;
}

typedef struct squatter {
    uint64_t token; /* the socket name's token the squatter binds */
    int ready[2];   /* the squatter writes one byte once it listens */
} squatter_t;

/* As uid 65534: a fake exporter that offers memory (a memfd) to whoever asks. Exit 0 when the
 * importer never sent its request, 20 when it did. */
static int nobody_squats(void *arg)
{
    squatter_t *sq = arg;
    int l = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    size_t n = vmh_ipc_socket_name(sa.sun_path + 1, sizeof sa.sun_path - 1, (uint32_t)getpid(),
                                   sq->token);
    if (l < 0 || bind(l, (struct sockaddr *)&sa,
                      (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n)) != 0 ||
        listen(l, 4) != 0)
        return 30;
    char one = 1;
    if (write(sq->ready[1], &one, 1) != 1)
        return 31;
    struct pollfd p = {.fd = l, .events = POLLIN};
    if (poll(&p, 1, 5000) != 1)
        return 32;
    int c = accept(l, NULL, NULL);
    p = (struct pollfd){.fd = c, .events = POLLIN};
    char req[256];
    ssize_t got = poll(&p, 1, 2000) == 1 ? recv(c, req, sizeof req, 0) : 0;
    if (got <= 0)
        return 0; /* closed without a word: the importer checked us first */
    /* It asked: answer as an exporter would, with memory of ours. */
    vmh_ipc_reply_t rep;
    memset(&rep, 0, sizeof rep);
    rep.magic = VMH_IPC_MAGIC;
    rep.nchunks = 1;
    rep.size = GRAN;
    send(c, &rep, sizeof rep, MSG_NOSIGNAL);
    vmh_ipc_batch_t b;
    memset(&b, 0, sizeof b);
    b.count = 1;
    b.sizes[0] = GRAN;
    int mfd = memfd_create("squatter", 0);
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct iovec iov = {&b, sizeof b};
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &mfd, sizeof mfd);
    sendmsg(c, &msg, MSG_NOSIGNAL);
    return 20;
}

/* Another real uid on both sides, where the tests run as root (CI containers usually do). */
static void another_real_user_is_refused_both_ways(void **state)
{
    (void)state;
    if (geteuid() != 0) {
        printf("SKIP another_real_user_is_refused_both_ways: not root, cannot become uid 65534 "
               "(the simulated-credential tests above cover the same checks)\n");
        skip();
    }
    CUdeviceptr p, q = 0;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    vmh_ipc_handle_t w = decode(&h);
    sim_reset_counters();
    /* Importer of another user: refused at once, nothing exported. */
    int r = as_nobody(nobody_connects, &w);
    if (r == 77) {
        printf("SKIP another_real_user_is_refused_both_ways: root, but cannot become uid 65534 "
               "(no CAP_SETUID?); the simulated-credential tests cover the same checks\n");
        assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
        skip();
    }
    assert_int_equal(r, 0);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), 0);
    assert_int_equal(captured("refused a CUDA IPC request"), 1);

    /* Exporter of another user: a socket squatted under a name a made-up handle points to. */
    squatter_t sq = {.token = 0x5eedull};
    assert_int_equal(pipe(sq.ready), 0);
    fflush(stdout);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        close(sq.ready[0]);
        if (setgroups(0, NULL) != 0 || setgid(65534) != 0 || setuid(65534) != 0)
            _exit(77);
        _exit(nobody_squats(&sq));
    }
    close(sq.ready[1]);
    char one;
    assert_int_equal(read(sq.ready[0], &one, 1), 1);
    close(sq.ready[0]);
    vmh_ipc_handle_t forged = w;
    forged.pid = (uint32_t)child;
    forged.socket_token = sq.token;
    CUipcMemHandle fh;
    vmh_ipc_handle_encode(&forged, &fh);
    assert_true(vmh_ipc_handle_is_ours(&fh)); /* the check recognizes; it does not authenticate */
    assert_int_equal(vmh_ipc_open_remote(&fh, &q), CUDA_ERROR_INVALID_HANDLE);
    assert_int_equal(sim_calls("cuMemImportFromShareableHandle"), 0);
    int status = 0;
    assert_int_equal(waitpid(child, &status, 0), child);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0); /* the squatter never got the token */
    assert_int_equal(captured("not to this user"), 1);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static int popcount_xor(const vmh_ipc_token_t *a, const vmh_ipc_token_t *b)
{
    int n = 0;
    for (size_t i = 0; i < sizeof a->b; i++)
        n += __builtin_popcount((unsigned)(a->b[i] ^ b->b[i]));
    return n;
}

/* Export names are 128 random bits: one handle says nothing about another, and a guess near a
 * real one opens nothing. */
static void export_tokens_are_unguessable(void **state)
{
    (void)state;
    enum { N = 8 };
    CUdeviceptr p[N];
    vmh_ipc_handle_t w[N];
    for (int i = 0; i < N; i++) {
        assert_int_equal(vmh_heap_alloc(2 * MiB, &p[i]), CUDA_SUCCESS);
        CUipcMemHandle h = get_handle(p[i]);
        w[i] = decode(&h);
    }
    for (int i = 0; i < N; i++)
        for (int j = i + 1; j < N; j++) /* sequential ids differ in a bit or two; random in ~64 */
            assert_true(popcount_xor(&w[i].export, &w[j].export) >= 24);
    sim_reset_counters();
    for (int bit = 0; bit < 128; bit += 9) {
        vmh_ipc_handle_t guess = w[0];
        guess.export.b[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        CUipcMemHandle gh;
        vmh_ipc_handle_encode(&guess, &gh);
        CUdeviceptr q = 0;
        assert_int_equal(vmh_ipc_open_remote(&gh, &q), CUDA_ERROR_INVALID_HANDLE);
    }
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), 0);
    assert_true(captured("has no such export") >= 1);
    for (int i = 0; i < N; i++)
        assert_int_equal(vmh_heap_free(p[i], NULL, false), CUDA_SUCCESS);
}

typedef struct timed_open {
    CUipcMemHandle h;
    CUdeviceptr q;
    CUresult rc;
    int64_t took_ms;
} timed_open_t;

static void *timed_open_thread(void *arg)
{
    timed_open_t *o = arg;
    sim_set_current_device(0);
    int64_t t0 = now_ms();
    o->rc = vmh_ipc_open_remote(&o->h, &o->q);
    o->took_ms = now_ms() - t0;
    return NULL;
}

/* A peer that connects and says nothing neither holds the listener nor other importers, and is
 * dropped after a short time; more silent peers than the listener's slots only delay others
 * by that short time. */
static void silent_peers_do_not_block_importers(void **state)
{
    (void)state;
    /* Long enough that an import behind the silent peer (1 s) tells from one beside it on a
     * loaded machine. */
    vmh_ipc_request_timeout_ms = 1000;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    tu_fill(p, 2 * MiB, 12);
    CUipcMemHandle h = get_handle(p);
    vmh_ipc_handle_t w = decode(&h);

    int silent = raw_connect(&w);
    assert_true(silent >= 0);
    usleep(50 * 1000); /* accepted and waiting for its request */
    timed_open_t o = {.h = h};
    timed_open_thread(&o);
    assert_int_equal(o.rc, CUDA_SUCCESS);
    assert_true(o.took_ms < 900); /* served while the silent one waits, not 1 s behind it */
    assert_true(tu_check(o.q, 2 * MiB, 12));
    assert_int_equal(vmh_ipc_close(o.q), CUDA_SUCCESS);
    /* The silent one is told and dropped shortly. */
    vmh_ipc_reply_t rep;
    memset(&rep, 0, sizeof rep);
    int64_t t0 = now_ms();
    int r = await_reply(silent, 3000, &rep);
    assert_true(r >= 0);
    assert_true(now_ms() - t0 < 2500);
    if (r == 1)
        assert_int_equal(rep.status, VMH_IPC_TIMED_OUT);
    close(silent);

    /* More silent peers than slots: the importer behind them waits about one timeout. */
    enum { CROWD = VMH_IPC_MAX_PEERS + 4 };
    int crowd[CROWD];
    for (int i = 0; i < CROWD; i++) {
        crowd[i] = raw_connect(&w);
        assert_true(crowd[i] >= 0);
    }
    usleep(50 * 1000);
    pthread_t t;
    o = (timed_open_t){.h = h};
    assert_int_equal(pthread_create(&t, NULL, timed_open_thread, &o), 0);
    pthread_join(t, NULL);
    assert_int_equal(o.rc, CUDA_SUCCESS);
    assert_true(o.took_ms < 3000);
    assert_int_equal(vmh_ipc_close(o.q), CUDA_SUCCESS);
    for (int i = 0; i < CROWD; i++)
        close(crowd[i]);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* An exporter that accepts nothing and says nothing (stopped, or a process of ours that only
 * bound the name) holds an importer for the exchange's bound only. */
static void unanswering_exporter_is_given_up(void **state)
{
    (void)state;
    vmh_ipc_exchange_timeout_ms = 300;
    int l = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    assert_true(l >= 0);
    vmh_ipc_handle_t w;
    memset(&w, 0, sizeof w);
    w.magic = VMH_IPC_MAGIC;
    w.version = VMH_IPC_VERSION;
    w.pid = (uint32_t)getpid();
    w.socket_token = 0x5157u;
    w.size = GRAN;
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    size_t n = vmh_ipc_socket_name(sa.sun_path + 1, sizeof sa.sun_path - 1, w.pid,
                                   w.socket_token);
    assert_int_equal(bind(l, (struct sockaddr *)&sa,
                          (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n)),
                     0);
    assert_int_equal(listen(l, 4), 0);
    CUipcMemHandle h;
    vmh_ipc_handle_encode(&w, &h);
    CUdeviceptr q = 0;
    int64_t t0 = now_ms();
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_ERROR_MAP_FAILED);
    int64_t took = now_ms() - t0;
    assert_true(took >= 250 && took < 5000); /* not 10 s per receive */
    assert_int_equal(captured("did not answer in time"), 1);
    close(l);
}

/* An importer that asks and then stops reading holds neither the listener nor other importers,
 * and is dropped after the send bound; the exporter keeps no descriptor of it. The bound is
 * 2 s here: well above what another import takes on a loaded machine, so that a listener that
 * waited for the stuck importer shows. */
static void importer_that_stops_reading_holds_nobody(void **state)
{
    (void)state;
    vmh_ipc_send_timeout_ms = 2000;
    tu_opt.headroom = 1 * GiB;
    tu_configure();
    enum { CHUNKS = 400 };
    CUdeviceptr big = 0, other;
    for (size_t i = 1; i <= CHUNKS; i++)
        assert_int_equal(vmh_heap_realloc(&big, i * GRAN, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(2 * MiB, &other), CUDA_SUCCESS);
    CUipcMemHandle hb = get_handle(big), ho = get_handle(other);
    vmh_ipc_handle_t wb = decode(&hb);
    int s = raw_connect(&wb);
    assert_true(s >= 0);
    vmh_ipc_request_t req;
    memset(&req, 0, sizeof req);
    req.magic = VMH_IPC_MAGIC;
    req.version = VMH_IPC_VERSION;
    req.export = wb.export;
    assert_int_equal(send(s, &req, sizeof req, MSG_NOSIGNAL), (ssize_t)sizeof req);
    usleep(100 * 1000); /* the listener answers until the socket is full, then waits */
    timed_open_t o = {.h = ho};
    timed_open_thread(&o);
    assert_int_equal(o.rc, CUDA_SUCCESS);
    assert_true(o.took_ms < 1500); /* a sender blocked on the stuck importer: 2 s or more */
    assert_int_equal(vmh_ipc_close(o.q), CUDA_SUCCESS);
    /* Dropped once the bound passed (the exporter closes its end: seen without reading, which
     * would let it send on; up to 10 s on a loaded machine): after what was queued, the
     * connection ends short of the whole buffer. */
    struct pollfd pf = {.fd = s, .events = POLLRDHUP};
    assert_int_equal(poll(&pf, 1, 10000), 1);
    assert_true(pf.revents & (POLLRDHUP | POLLHUP));
    size_t batches = 0;
    for (;;) {
        char buf[sizeof(vmh_ipc_batch_t)];
        union {
            char c[CMSG_SPACE(VMH_IPC_BATCH * sizeof(int))];
            struct cmsghdr align;
        } ctl;
        struct iovec iov = {buf, sizeof buf};
        struct msghdr msg = {.msg_iov = &iov,
                             .msg_iovlen = 1,
                             .msg_control = ctl.c,
                             .msg_controllen = sizeof ctl};
        ssize_t got = recvmsg(s, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (got <= 0) {
            assert_int_equal(got, 0); /* the end, not "nothing yet" */
            break;
        }
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
            for (size_t k = 0; k < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); k++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof fd);
                close(fd);
            }
        batches += got == (ssize_t)sizeof(vmh_ipc_batch_t);
    }
    assert_true(batches < (CHUNKS + VMH_IPC_BATCH - 1) / VMH_IPC_BATCH);
    close(s);
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(other, NULL, false), CUDA_SUCCESS);
}

static int64_t cpu_ms(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (int64_t)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000 +
           (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1000;
}

/* At the descriptor limit the listener cannot accept: it waits instead of spinning, says so
 * once, and serves the importer once descriptors are free again. */
static void descriptor_limit_backs_off(void **state)
{
    (void)state;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(2 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    struct rlimit old;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
    /* One descriptor left: the importer's socket takes it, the listener's accept finds none. */
    int lowest = open("/dev/null", O_RDONLY | O_CLOEXEC); /* the lowest free descriptor */
    assert_true(lowest >= 0);
    close(lowest);
    struct rlimit tight = {.rlim_cur = (rlim_t)lowest + 1, .rlim_max = old.rlim_max};
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &tight), 0);
    pthread_t t;
    timed_open_t o = {.h = h};
    assert_int_equal(pthread_create(&t, NULL, timed_open_thread, &o), 0);
    usleep(200 * 1000);
    int64_t c0 = cpu_ms();
    usleep(1000 * 1000);
    int64_t spent = cpu_ms() - c0;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &old), 0);
    pthread_join(t, NULL);
    printf("  CPU time of the process during 1 s at the descriptor limit: %lld ms\n",
           (long long)spent);
    assert_true(spent < 100); /* was: a listener spinning on poll, a whole core */
    assert_int_equal(captured("cannot accept an importer"), 1);
    assert_int_equal(o.rc, CUDA_SUCCESS); /* served once descriptors were free again */
    assert_int_equal(vmh_ipc_close(o.q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* A freed buffer's export opens nothing, packed or not, before or after the heap unmapped it;
 * the table lets go of it at once. A grow in place keeps the handle (a snapshot); a move ends
 * it, as the move frees the old address. */
static void freed_buffers_exports_are_refused(void **state)
{
    (void)state;
    CUdeviceptr a, b, big, q = 0;
    assert_int_equal(vmh_heap_alloc(5000, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(3000, &b), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &big), CUDA_SUCCESS);
    CUipcMemHandle hb = get_handle(b), hbig = get_handle(big);
    assert_int_equal(vmh_heap_free(b, NULL, false), CUDA_SUCCESS); /* its chunk lives on (a) */
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS); /* parked, not trimmed */
    sim_reset_counters();
    assert_int_equal(vmh_ipc_open_remote(&hb, &q), CUDA_ERROR_INVALID_HANDLE);
    assert_int_equal(vmh_ipc_open_remote(&hbig, &q), CUDA_ERROR_INVALID_HANDLE);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), 0);
    assert_int_equal(vmh_ipc_export_count(), 0);

    /* Grown in place: the old handle still opens its snapshot. */
    tu_opt.headroom = 64 * MiB;
    tu_configure();
    CUdeviceptr g;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &g), CUDA_SUCCESS);
    CUipcMemHandle hg = get_handle(g);
    CUdeviceptr g0 = g;
    assert_int_equal(vmh_heap_realloc(&g, 8 * MiB, NULL, false), CUDA_SUCCESS);
    assert_int_equal(g, g0);
    assert_int_equal(vmh_ipc_open_remote(&hg, &q), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    /* Moved: the old address is freed, its handle opens nothing. */
    sim_refuse_hints(true);
    tu_opt.headroom = 0;
    tu_configure();
    assert_int_equal(vmh_heap_realloc(&g, 64 * MiB, NULL, false), CUDA_SUCCESS);
    sim_refuse_hints(false);
    assert_int_not_equal(g, g0);
    vmh_ipc_reset(); /* a fresh listener: the import above is not reused from the table */
    hg = get_handle(g); /* (the new buffer's handle, to restart the listener) */
    assert_int_equal(vmh_heap_free(g, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_open_remote(&hg, &q), CUDA_ERROR_INVALID_HANDLE);
    assert_int_equal(vmh_heap_free(a, NULL, false), CUDA_SUCCESS);
}

/* As natively (tests/gpu/ipc_gpu.cu free_first on the H200): the importer keeps seeing the
 * data of a buffer the exporter freed, the exporter's next allocations never land in that
 * memory, the old handle opens nothing, and the library lets go of its own hold so that the
 * memory lives exactly as long as the importer holds it. On 882660a the freed buffers were
 * served again at their old addresses and the importer saw the new data. */
static void freed_export_stays_the_importers(void **state)
{
    (void)state;
    CUdeviceptr big, small, pad, q = 0, qbig, qsmall;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &big), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(1000, &pad), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(3000, &small), CUDA_SUCCESS);
    tu_fill(big, 4 * MiB, 16);
    tu_fill(small, 3000, 17);
    CUipcMemHandle hbig = get_handle(big), hsmall = get_handle(small);
    assert_int_equal(vmh_ipc_open_remote(&hbig, &qbig), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_open_remote(&hsmall, &qsmall), CUDA_SUCCESS);
    const CUdeviceptr small_chunk = small - decode(&hsmall).offset;
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
    CUdeviceptr big2, small2;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &big2), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(3000, &small2), CUDA_SUCCESS);
    assert_false(big2 < big + 4 * MiB && big < big2 + 4 * MiB);
    assert_false(small2 >= small_chunk && small2 < small_chunk + GRAN);
    tu_fill(big2, 4 * MiB, 18);
    tu_fill(small2, 3000, 19);
    assert_true(tu_check(qbig, 4 * MiB, 16));
    assert_true(tu_check(qsmall, 3000, 17));
    /* The old handles open nothing (a fresh open would need the exporter's export). */
    assert_int_equal(vmh_ipc_close(qbig), CUDA_SUCCESS);
    sim_reset_counters();
    assert_int_equal(vmh_ipc_open_remote(&hbig, &q), CUDA_ERROR_INVALID_HANDLE);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), 0);
    /* The new life has a handle of its own, which opens the new data. */
    CUipcMemHandle hnew = get_handle(big2);
    assert_memory_not_equal(&hnew, &hbig, sizeof hnew);
    assert_int_equal(vmh_ipc_open_remote(&hnew, &q), CUDA_SUCCESS);
    assert_true(tu_check(q, 4 * MiB, 18));
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    /* The library holds nothing of the freed memory once its wait is done and its references
     * are pruned: the importer's handle alone keeps the small buffer's chunk. */
    assert_int_equal(vmh_heap_free(pad, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    vmh_ipc_prune();
    assert_false(sim_is_mapped(big));
    assert_false(sim_is_mapped(small_chunk));
    assert_true(tu_check(qsmall, 3000, 17));
    size_t allocs = sim_live_allocations();
    assert_int_equal(vmh_ipc_close(qsmall), CUDA_SUCCESS);
    assert_int_equal(sim_live_allocations(), allocs - 1);
    assert_int_equal(vmh_heap_free(big2, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small2, NULL, false), CUDA_SUCCESS);
}

/* Memory of a freed exported buffer is given back when the device runs short, without waiting
 * for the listener's next idle prune: the heap's pressure hook drops the table's references. */
static void freed_export_memory_is_given_back_under_pressure(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 1, .memory = 64 * MiB};
    tu_reset(&cfg);
    tu_opt.handle = VMH_HANDLE_POSIX_FD;
    tu_opt.pack_below = 1 * MiB;
    tu_configure();
    capture_clear();
    fds_at_start = count_fds();
    CUdeviceptr p, r;
    assert_int_equal(vmh_heap_alloc(48 * MiB, &p), CUDA_SUCCESS);
    (void)get_handle(p);
    assert_int_equal(vmh_ipc_export_count(), 1);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    /* Another size: the freed buffer cannot serve it; its chunk must go back to the driver. */
    assert_int_equal(vmh_heap_alloc(60 * MiB, &r), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_export_count(), 0);
    assert_int_equal(vmh_heap_free(r, NULL, false), CUDA_SUCCESS);
}

/* A buffer of 1500 chunks crosses although the process may hold only 1024 descriptors: each
 * side holds one batch at a time. (Chunks of the suite's 2 MiB: the heap keeps a device's
 * granularity across resets; the simulated driver maps contents only where written.) */
static void many_more_chunks_than_descriptors(void **state)
{
    (void)state;
    tu_opt.headroom = 4 * GiB;
    tu_configure();
    enum { CHUNKS = 1500 };
    CUdeviceptr p = 0;
    for (size_t i = 1; i <= CHUNKS; i++)
        assert_int_equal(vmh_heap_realloc(&p, i * GRAN, NULL, false), CUDA_SUCCESS);
    const size_t n = CHUNKS * GRAN;
    tu_fill(p, GRAN, 13);
    tu_fill(p + n - GRAN, GRAN, 14);
    CUipcMemHandle h = get_handle(p);
    struct rlimit old;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
    assert_true(count_fds() < 900);
    struct rlimit tight = {.rlim_cur = 1024, .rlim_max = old.rlim_max};
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &tight), 0);
    sim_reset_counters();
    CUdeviceptr q = 0;
    CUresult rc = vmh_ipc_open_remote(&h, &q);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &old), 0);
    assert_int_equal(rc, CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), CHUNKS);
    assert_int_equal(sim_calls("cuMemImportFromShareableHandle"), CHUNKS);
    assert_true(tu_check(q, GRAN, 13));
    assert_true(tu_check(q + n - GRAN, GRAN, 14));
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* Every driver failure on either side leaves nothing held and no descriptor open. */
static void driver_failures_leave_nothing(void **state)
{
    (void)state;
    CUdeviceptr p, q = 0;
    assert_int_equal(vmh_heap_alloc(6 * MiB, &p), CUDA_SUCCESS);
    CUipcMemHandle h = get_handle(p);
    size_t maps = sim_live_mappings(), resv = sim_live_reservations(), handles = sim_live_handles();
    static const struct {
        const char *fn;
        CUresult code, want;
    } cases[] = {
        {"cuMemExportToShareableHandle", CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_MAP_FAILED},
        {"cuMemImportFromShareableHandle", CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY},
        {"cuMemAddressReserve", CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY},
        {"cuMemMap", CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_VALUE},
        {"cuMemSetAccess", CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_DEVICE},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        sim_fail_function(cases[i].fn, 1, cases[i].code);
        assert_int_equal(vmh_ipc_open_remote(&h, &q), cases[i].want);
        sim_clear_faults();
        assert_int_equal(sim_live_mappings(), maps);
        assert_int_equal(sim_live_reservations(), resv);
        assert_int_equal(sim_live_handles(), handles);
        assert_int_equal(vmh_ipc_import_count(), 0);
        /* The listener's socket and eventfd stay; nothing else may. */
        assert_int_equal(settled_fds(fds_at_start + 2), fds_at_start + 2);
    }
    assert_int_equal(vmh_ipc_open_remote(&h, &q), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
    assert_int_equal(sim_live_handles(), handles);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* The failure sweep over the import path of a buffer of two batches: the nth driver call of
 * the exchange fails (on either side: the exporter's exports run on the listener thread), for
 * every n until an open makes no call that can fail. Each failure leaves nothing held and no
 * descriptor open, and the next open works. */
static void failure_sweep_over_the_exchange(void **state)
{
    (void)state;
    tu_opt.headroom = 256 * MiB;
    tu_configure();
    const size_t chunks = VMH_IPC_BATCH + 8;
    CUdeviceptr p = 0;
    for (size_t i = 1; i <= chunks; i++)
        assert_int_equal(vmh_heap_realloc(&p, i * GRAN, NULL, false), CUDA_SUCCESS);
    tu_fill(p, chunks * GRAN, 15);
    CUipcMemHandle h = get_handle(p);
    size_t maps = sim_live_mappings(), resv = sim_live_reservations(), handles = sim_live_handles();
    int fds = fds_at_start + 2; /* the listener's socket and eventfd */
    unsigned long n;
    for (n = 1; n < 1000; n++) {
        sim_reset_counters();
        sim_fail_call(n, CUDA_ERROR_OUT_OF_MEMORY);
        CUdeviceptr q = 0;
        CUresult rc = vmh_ipc_open_remote(&h, &q);
        unsigned long fired = sim_faults_fired();
        sim_clear_faults();
        if (!fired) {
            assert_int_equal(rc, CUDA_SUCCESS); /* past the last call: the sweep is done */
            assert_true(tu_check(q, chunks * GRAN, 15));
            assert_int_equal(vmh_ipc_close(q), CUDA_SUCCESS);
            break;
        }
        assert_int_not_equal(rc, CUDA_SUCCESS);
        assert_int_equal(sim_live_mappings(), maps);
        assert_int_equal(sim_live_reservations(), resv);
        assert_int_equal(sim_live_handles(), handles);
        assert_int_equal(vmh_ipc_import_count(), 0);
        assert_int_equal(settled_fds(fds), fds);
    }
    printf("  the exchange of %zu chunks failed cleanly at each of its %lu driver calls\n",
           chunks, n - 1);
    assert_true(n > 2 * chunks); /* an export and an import per chunk at least */
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* ---- threads ------------------------------------------------------------------------------ */

#define OPENERS 8

typedef struct opener {
    CUipcMemHandle h;
    CUdeviceptr got;
    CUresult rc;
} opener_t;

static void *open_thread(void *arg)
{
    opener_t *o = arg;
    sim_set_current_device(0);
    o->rc = vmh_ipc_open_remote(&o->h, &o->got);
    return NULL;
}

static void concurrent_opens_share_one_mapping(void **state)
{
    (void)state;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS);
    tu_fill(p, 4 * MiB, 10);
    CUipcMemHandle h = get_handle(p);
    pthread_t t[OPENERS];
    opener_t o[OPENERS];
    for (int i = 0; i < OPENERS; i++) {
        o[i] = (opener_t){.h = h};
        assert_int_equal(pthread_create(&t[i], NULL, open_thread, &o[i]), 0);
    }
    for (int i = 0; i < OPENERS; i++)
        pthread_join(t[i], NULL);
    for (int i = 0; i < OPENERS; i++) {
        assert_int_equal(o[i].rc, CUDA_SUCCESS);
        assert_int_equal(o[i].got, o[0].got);
    }
    assert_int_equal(vmh_ipc_import_count(), 1);
    assert_true(tu_check(o[0].got, 4 * MiB, 10));
    for (int i = 0; i < OPENERS; i++) {
        assert_true(sim_is_mapped(o[0].got));
        assert_int_equal(vmh_ipc_close(o[i].got), CUDA_SUCCESS);
    }
    assert_false(sim_is_mapped(o[0].got));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

/* ---- peer access -------------------------------------------------------------------------- */

static void peer_access_follows_the_contexts(void **state)
{
    (void)state;
    const vmh_driver_t *drv = sim_table();
    CUcontext ctx0, ctx1;
    assert_int_equal(drv->cuDevicePrimaryCtxRetain(&ctx0, 0), CUDA_SUCCESS);
    assert_int_equal(drv->cuDevicePrimaryCtxRetain(&ctx1, 1), CUDA_SUCCESS);
    CUdeviceptr on1, small1, on0;
    sim_set_current_device(1);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &on1), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(500, &small1), CUDA_SUCCESS);
    tu_fill(on1, 4 * MiB, 11);
    sim_set_current_device(0);
    assert_int_equal(vmh_heap_alloc(4 * MiB, &on0), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(on1, 0), 0);
    assert_false(tu_check(on1, 4 * MiB, 11)); /* device 0 cannot read device 1's memory */

    /* Device 0's context enables access to device 1's: device 0 reaches device 1's buffers. */
    assert_int_equal(drv->cuCtxEnablePeerAccess(ctx1, 0), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_peer_changed(ctx1, true), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(on1, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(small1, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(on0, 1), 0); /* not the other way round */
    assert_true(tu_check(on1, 4 * MiB, 11));
    /* Future buffers of device 1 too. */
    CUdeviceptr later;
    sim_set_current_device(1);
    assert_int_equal(vmh_heap_alloc(8 * MiB, &later), CUDA_SUCCESS);
    sim_set_current_device(0);
    assert_int_equal(sim_access_flags(later, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_current_device(), 0); /* the peer context was pushed and popped */

    assert_int_equal(drv->cuCtxDisablePeerAccess(ctx1), CUDA_SUCCESS);
    assert_int_equal(vmh_ipc_peer_changed(ctx1, false), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(on1, 0), 0);
    assert_int_equal(sim_access_flags(later, 0), 0);
    assert_int_equal(sim_access_flags(on1, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    /* The peer's own context: same device, nothing to grant. */
    assert_int_equal(vmh_ipc_peer_changed(ctx0, true), CUDA_ERROR_INVALID_DEVICE);
    /* (the driver's enable rejects a NULL peer first; here the push does) */
    assert_int_not_equal(vmh_ipc_peer_changed(NULL, true), CUDA_SUCCESS);
    assert_int_equal(sim_current_device(), 0);

    assert_int_equal(vmh_heap_free(on1, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small1, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(later, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(on0, NULL, false), CUDA_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(handle_type_none_refuses_and_says_so_once, setup, teardown),
        cmocka_unit_test_setup_teardown(handle_type_refused_by_the_device, setup, teardown),
        cmocka_unit_test_setup_teardown(foreign_and_bad_handles_are_not_ours, setup, teardown),
        cmocka_unit_test_setup_teardown(same_process_flags_and_context, setup, teardown),
        cmocka_unit_test_setup_teardown(big_buffer_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(close_during_capture_is_refused_and_kept, setup, teardown),
        cmocka_unit_test_setup_teardown(packed_buffer_maps_its_chunk_at_the_offset, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(importer_keeps_its_view_through_grow_and_free, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(many_chunks_cross_in_batches, setup, teardown),
        cmocka_unit_test_setup_teardown(freed_before_open_is_an_invalid_handle, setup, teardown),
        cmocka_unit_test_setup_teardown(lifetime_exit_stops_exports, setup, teardown),
        cmocka_unit_test_setup_teardown(fork_runs_each_step_once, setup, teardown),
        cmocka_unit_test_setup_teardown(closed_exporter_socket, setup, teardown),
        cmocka_unit_test_setup_teardown(exporter_refuses_another_user_before_waiting, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(importer_refuses_an_exporter_of_another_user, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(another_real_user_is_refused_both_ways, setup, teardown),
        cmocka_unit_test_setup_teardown(export_tokens_are_unguessable, setup, teardown),
        cmocka_unit_test_setup_teardown(silent_peers_do_not_block_importers, setup, teardown),
        cmocka_unit_test_setup_teardown(unanswering_exporter_is_given_up, setup, teardown),
        cmocka_unit_test_setup_teardown(importer_that_stops_reading_holds_nobody, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(descriptor_limit_backs_off, setup, teardown),
        cmocka_unit_test_setup_teardown(freed_buffers_exports_are_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(freed_export_stays_the_importers, setup, teardown),
        cmocka_unit_test_setup_teardown(freed_export_memory_is_given_back_under_pressure, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(many_more_chunks_than_descriptors, setup, teardown),
        cmocka_unit_test_setup_teardown(driver_failures_leave_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(failure_sweep_over_the_exchange, setup, teardown),
        cmocka_unit_test_setup_teardown(concurrent_opens_share_one_mapping, setup, teardown),
        cmocka_unit_test_setup_teardown(peer_access_follows_the_contexts, setup, teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, NULL);
}
