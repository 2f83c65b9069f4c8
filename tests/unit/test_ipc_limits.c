/* IPC under stalls and shortage (ipc_fixture.h says how, in one process; issue 16's
 * hardening): silent peers and an unanswering exporter are given up and block nobody, an
 * importer that stops reading holds nobody, the descriptor limit is backed off from, more
 * chunks than descriptors still cross, and driver failures anywhere in the exchange leave
 * nothing behind. */
#include "ipc_fixture.h"


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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(silent_peers_do_not_block_importers, setup, teardown),
        cmocka_unit_test_setup_teardown(unanswering_exporter_is_given_up, setup, teardown),
        cmocka_unit_test_setup_teardown(importer_that_stops_reading_holds_nobody, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(descriptor_limit_backs_off, setup, teardown),
        cmocka_unit_test_setup_teardown(many_more_chunks_than_descriptors, setup, teardown),
        cmocka_unit_test_setup_teardown(driver_failures_leave_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(failure_sweep_over_the_exchange, setup, teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, NULL);
}
