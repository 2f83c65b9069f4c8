/* IPC against another user (ipc_fixture.h says how, in one process; issue 16's hardening):
 * simulated credentials refused by the exporter before it waits and by the importer, a real
 * other user (uid 65534, where the suite runs as root) refused both ways, and export tokens
 * that cannot be guessed. */
#include "ipc_fixture.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(exporter_refuses_another_user_before_waiting, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(importer_refuses_an_exporter_of_another_user, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(another_real_user_is_refused_both_ways, setup, teardown),
        cmocka_unit_test_setup_teardown(export_tokens_are_unguessable, setup, teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, NULL);
}
