/* Layer "API" on the simulated driver: vmm_realloc and friends, every status code of
 * include/vmmhook.h, and the PyTorch pluggable-allocator entry points. */
#define VMH_TESTING 1 /* vmh_lifetime_exit, declared in lifetime.h */
#include "testutil.h"

#include "vmmhook.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <unistd.h>

static int setup(void **state)
{
    (void)state;
    tu_reset(NULL);
    assert_true(vmh_lifetime_ready()); /* reads the options once; the test's values come after */
    vmh_options_defaults(&tu_opt);
    tu_configure();
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    vmm_trim();
    tu_assert_ledger_empty();
    tu_assert_stats_consistent();
    return 0;
}

static void realloc_lifecycle(void **state)
{
    (void)state;
    void *p = NULL;
    assert_int_equal(vmm_realloc(&p, 3 * MiB), VMM_OK);
    assert_non_null(p);
    assert_true(vmm_owns(p));
    assert_true(vmm_owns((char *)p + 3 * MiB - 1));
    assert_false(vmm_owns((char *)p + 3 * MiB));
    assert_int_equal(vmm_usable_size(p), 4 * MiB);
    assert_int_equal(vmm_usable_size((char *)p + 1), 0);
    tu_fill((CUdeviceptr)(uintptr_t)p, 3 * MiB, 1);
    assert_int_equal(vmm_realloc(&p, 100 * MiB), VMM_OK);
    assert_true(tu_check((CUdeviceptr)(uintptr_t)p, 3 * MiB, 1));
    assert_int_equal(vmm_realloc(&p, 0), VMM_OK);
    assert_null(p);
    assert_int_equal(vmm_realloc(&p, 0), VMM_OK); /* NULL and 0: nothing */
    assert_null(p);
}

static void status_codes(void **state)
{
    (void)state;
    void *p = NULL;
    assert_int_equal(vmm_realloc(NULL, 10), VMM_ERR_INVALID);
    assert_int_equal(vmm_realloc(&p, SIZE_MAX), VMM_ERR_SIZE);
    assert_null(p);
    void *foreign = (void *)0x7000;
    assert_int_equal(vmm_realloc(&foreign, 10), VMM_ERR_FOREIGN);
    assert_ptr_equal(foreign, (void *)0x7000);
    assert_int_equal(vmm_realloc(&p, 4 * MiB), VMM_OK);
    void *inner = (char *)p + 512;
    assert_int_equal(vmm_realloc(&inner, 8 * MiB), VMM_ERR_INTERIOR);
    assert_int_equal(vmm_realloc(&p, 200 * GiB), VMM_ERR_NO_MEMORY); /* 80 GiB device */
    tu_opt.va_limit = 8 * MiB;
    tu_opt.headroom = 0;
    tu_configure();
    sim_refuse_hints(true);
    assert_int_equal(vmm_realloc(&p, 16 * MiB), VMM_ERR_NO_ADDRESS);
    sim_refuse_hints(false);
    sim_fail_function("cuMemCreate", 1, CUDA_ERROR_ECC_UNCORRECTABLE);
    assert_int_equal(vmm_realloc(&p, 6 * MiB), VMM_ERR_DRIVER);
    assert_int_equal(vmm_last_driver_error(), CUDA_ERROR_ECC_UNCORRECTABLE);
    sim_clear_faults();
    assert_int_equal(vmm_realloc(&p, 0), VMM_OK);
    sim_set_current_device(-1);
    assert_int_equal(vmm_realloc(&p, 10), VMM_ERR_NO_DRIVER);
    sim_set_current_device(0);
    for (int s = 0; s <= VMM_STATUS_COUNT; s++)
        assert_non_null(vmm_status_string((vmm_status)s));
    assert_int_equal(vmm_version(), VMM_VERSION);
}

/* A freed pointer is nobody's buffer: FOREIGN, as for a pointer never served (a928081 said
 * INTERIOR), whether the buffer had chunks of its own or was packed, parked or cached. */
static void realloc_of_a_freed_pointer_is_foreign(void **state)
{
    (void)state;
    void *big = NULL, *small = NULL;
    assert_int_equal(vmm_realloc(&big, 4 * MiB), VMM_OK);
    assert_int_equal(vmm_realloc(&small, 3000), VMM_OK);
    void *keep = NULL; /* keeps the shared extent alive */
    assert_int_equal(vmm_realloc(&keep, 100), VMM_OK);
    void *freed_big = big, *freed_small = small;
    assert_int_equal(vmm_realloc(&big, 0), VMM_OK);
    assert_int_equal(vmm_realloc(&small, 0), VMM_OK);
    assert_int_equal(vmm_realloc(&freed_big, 8 * MiB), VMM_ERR_FOREIGN); /* parked */
    assert_int_equal(vmm_realloc(&freed_small, 8000), VMM_ERR_FOREIGN);
    vmm_trim(); /* the wait releases them: cached, or free in the extent */
    assert_int_equal(vmm_realloc(&freed_big, 8 * MiB), VMM_ERR_FOREIGN);
    assert_int_equal(vmm_realloc(&freed_small, 8000), VMM_ERR_FOREIGN);
    assert_int_equal(vmm_realloc(&keep, 0), VMM_OK);
}

static void torch_entry_points(void **state)
{
    (void)state;
    void *p = vmm_torch_alloc(5 * MiB, 0, NULL);
    assert_non_null(p);
    assert_true(vmm_owns(p));
    assert_null(vmm_torch_alloc(0, 0, NULL));
    vmm_torch_free(p, 5 * MiB, 0, NULL);
    assert_false(vmm_owns(p));
    vmm_torch_free(NULL, 0, 0, NULL);
}

static void detection_helpers(void **state)
{
    (void)state;
    /* The test binary links the library's layers statically and exports its symbols (meson:
     * export_dynamic), so the header's helpers must find the library, and find it exactly. */
    assert_true(vmm_hook_available());
    assert_ptr_equal(vmm_fn("vmm_realloc"), (void *)vmm_realloc);
    assert_null(vmm_fn("vmm_no_such_entry_point"));
}

/* ---- fork ---- */

static atomic_bool churn_stop;

static void *churn_small(void *arg)
{
    (void)arg;
    while (!atomic_load(&churn_stop)) {
        CUdeviceptr p[4];
        for (int i = 0; i < 4; i++)
            if (vmh_heap_alloc_on(0, 4096 << i, &p[i]) != CUDA_SUCCESS)
                return (void *)1;
        for (int i = 0; i < 4; i++)
            if (vmh_heap_free(p[i], NULL, true) != CUDA_SUCCESS)
                return (void *)1;
    }
    return NULL;
}

/* What the child checks; exits with a bit per failed check. Runs the destructors (exit, not
 * _exit), which must not report the parent's buffers as the child's leaks. */
static void fork_child(CUdeviceptr big, CUdeviceptr small, int errfd)
{
    tu_forked_child(); /* no LeakSanitizer check at its exit (testutil.h); ours still runs */
    alarm(10); /* a hang (a lock held by a parent thread at the fork) ends the child */
    dup2(errfd, 2);
    int bad = 0;
    CUdeviceptr q;
    vmh_buffer_info_t info;
    if (vmh_lifetime_ready())
        bad |= 1;
    if (vmh_heap_free(big, NULL, false) != CUDA_ERROR_NOT_FOUND ||
        vmh_heap_free(small, NULL, false) != CUDA_ERROR_NOT_FOUND)
        bad |= 2;
    if (vmh_heap_alloc_on(0, 4096, &q) != CUDA_ERROR_NOT_SUPPORTED ||
        vmh_heap_alloc(4096, &q) != CUDA_ERROR_NOT_SUPPORTED)
        bad |= 4;
    if (vmh_heap_find(small, &info) || vmh_heap_holds(big) || vmm_owns((void *)(uintptr_t)big))
        bad |= 8;
    void *r = (void *)(uintptr_t)big;
    if (vmm_realloc(&r, 8 * MiB) != VMM_ERR_NO_DRIVER)
        bad |= 16;
    exit(bad);
}

/* A child of a process that used the library gets pass-through for everything (the driver then
 * answers as natively), never hangs on a lock another parent thread held at the fork, and
 * reports no leak at its exit. Other threads churn packed buffers while the parent forks. */
static void fork_child_passes_through(void **state)
{
    (void)state;
    tu_opt.leaks = true;
    CUdeviceptr big, small;
    assert_int_equal(vmh_heap_alloc(3 * MiB, &big), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(4096, &small), CUDA_SUCCESS);
    atomic_store(&churn_stop, false);
    pthread_t t[4];
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&t[i], NULL, churn_small, NULL), 0);
    for (int round = 0; round < 20; round++) {
        int fds[2];
        assert_int_equal(pipe(fds), 0);
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0)
            fork_child(big, small, fds[1]);
        close(fds[1]);
        char out[4096];
        size_t len = 0;
        ssize_t n;
        while ((n = read(fds[0], out + len, sizeof out - 1 - len)) > 0)
            len += (size_t)n;
        out[len] = '\0';
        close(fds[0]);
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || strstr(out, "leak report"))
            fprintf(stderr, "child %d: status 0x%x, stderr: %s\n", round, status, out);
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 0);
        assert_null(strstr(out, "leak report"));
    }
    atomic_store(&churn_stop, true);
    for (int i = 0; i < 4; i++) {
        void *bad;
        pthread_join(t[i], &bad);
        assert_null(bad);
    }
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
    tu_opt.leaks = false;
}

/* Exit (the destructor's work): afterwards nothing is served, and late frees of served
 * pointers (other libraries' destructors) are accepted without a driver call. Runs last: the
 * library does not start again in this process. */
static void late_frees_after_exit(void **state)
{
    (void)state;
    CUdeviceptr big, small, q;
    assert_int_equal(vmh_heap_alloc(3 * MiB, &big), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(4096, &small), CUDA_SUCCESS);
    vmh_lifetime_exit();
    assert_false(vmh_lifetime_ready());
    uint64_t calls = vmh_counter_get(VMH_STAT_driver_calls);
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, true), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(0x1234, NULL, false), CUDA_ERROR_NOT_FOUND);
    assert_int_equal(vmh_heap_alloc(4096, &q), CUDA_ERROR_NOT_SUPPORTED);
    assert_int_equal(vmh_counter_get(VMH_STAT_driver_calls), calls);
    vmh_heap_reset(); /* the tests' teardown: everything destroyed through the driver */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(realloc_lifecycle, setup, teardown),
        cmocka_unit_test_setup_teardown(status_codes, setup, teardown),
        cmocka_unit_test_setup_teardown(realloc_of_a_freed_pointer_is_foreign, setup, teardown),
        cmocka_unit_test_setup_teardown(torch_entry_points, setup, teardown),
        cmocka_unit_test_setup_teardown(detection_helpers, setup, teardown),
        cmocka_unit_test_setup_teardown(fork_child_passes_through, setup, teardown),
        cmocka_unit_test_setup_teardown(late_frees_after_exit, setup, teardown), /* last */
    };
    return cmocka_run_group_tests_name("api", tests, NULL, NULL);
}
