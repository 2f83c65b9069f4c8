/* IPC and the exporter's lifetime (ipc_fixture.h says how, in one process): a handle opens only
 * while its buffer lives; the exporter stops at exit, and a fork runs each step once; a closed
 * exporter socket; a freed export stays the importer's memory, is never served again, and is
 * given back under pressure. */
#include "ipc_fixture.h"

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
    vmh_lifetime_at_exit();
    assert_int_equal(vmh_phase_stage(), VMH_PHASE_EXITING);
    sim_reset_counters();
    CUipcMemHandle h;
    assert_int_equal(vmh_ipc_get_handle(r, &h), CUDA_ERROR_DEINITIALIZED);
    assert_int_equal(sim_calls("cuMemExportToShareableHandle"), 0);
    assert_int_equal(vmh_ipc_export_count(), 1);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(r, NULL, false), CUDA_SUCCESS);
    vmh_ipc_reset();
    vmh_phase_reset(); /* (tests only) the table serves again */
}

/* Issues 20 and 31: one owner of process events. lifetime.c alone registers fork handlers; a
 * child forked while the listener runs (IPC began) ran each fork step exactly once, in
 * lifetime.c's order: the prefork top down (IPC's locks), then in the child the phase (a
 * pass-through child: the parent started) and the child steps bottom up (contexts, then IPC
 * releasing its locks); contexts.c's own step (which once ran twice: it registered a handler
 * of its own too) is counted where it runs. The parent ran the prefork and its release, once
 * per fork, and exports again afterwards (nothing was left locked).
 *
 * With the reclaim thread running (a parked free) and a thread exporting during the forks: the
 * test found a use-after-free there (an exported buffer's free read its range's size after
 * parking it, and the reclaim thread could release it first: ownchunk.c), failing most runs on
 * e516064 under ASan; VMH_TEST_FORK_RACE=0 leaves both out. */
typedef struct {
    CUdeviceptr p;
    atomic_bool stop, failed;
    atomic_uint rounds;
} exporter_arg_t;

static void *export_loop(void *arg)
{
    exporter_arg_t *a = arg;
    while (!atomic_load(&a->stop)) {
        CUipcMemHandle h;
        if (vmh_ipc_get_handle(a->p, &h) != CUDA_SUCCESS) {
            atomic_store(&a->failed, true);
            break;
        }
        atomic_fetch_add(&a->rounds, 1);
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
        /* Exporting before the first fork, whatever the machine's load. */
        while (atomic_load(&arg.rounds) == 0 && !atomic_load(&arg.failed))
            sched_yield();
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
            int phase = vmh_phase();
            if (strcmp(steps, "fIcCI") != 0 || mine != 1 || !stopped ||
                phase != (VMH_PHASE_CHILD | VMH_PHASE_FORKED)) {
                fprintf(stderr, "child: steps \"%s\" (want \"fIcCI\"), contexts step ran %u "
                        "times, IPC %s, phase %d\n", steps, mine,
                        stopped ? "stopped" : "still serves", phase);
                _exit(1);
            }
            _exit(0);
        }
        int status = 0;
        assert_int_equal(waitpid(child, &status, 0), child);
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 0);
        assert_string_equal(vmh_lifetime_steps(), "fIpI");
        assert_int_equal(vmh_phase(), VMH_PHASE_RUNNING);
        assert_int_equal(vmh_contexts_after_fork_runs(), runs); /* the parent's own: none */
    }
    if (race) {
        atomic_store(&arg.stop, true);
        pthread_join(t, NULL);
        assert_false(atomic_load(&arg.failed)); /* every export in the parent succeeded */
        assert_true(atomic_load(&arg.rounds) > 0);
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(freed_before_open_is_an_invalid_handle, setup, teardown),
        cmocka_unit_test_setup_teardown(lifetime_exit_stops_exports, setup, teardown),
        cmocka_unit_test_setup_teardown(fork_runs_each_step_once, setup, teardown),
        cmocka_unit_test_setup_teardown(closed_exporter_socket, setup, teardown),
        cmocka_unit_test_setup_teardown(freed_buffers_exports_are_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(freed_export_stays_the_importers, setup, teardown),
        cmocka_unit_test_setup_teardown(freed_export_memory_is_given_back_under_pressure, setup,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, NULL);
}
