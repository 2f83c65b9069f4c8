/* contexts.c on the simulated driver: the known contexts per device and the wait on all of them,
 * the per-thread current-context cache (no driver call in steady state), the capture rule of
 * the driver (which thread may make a potentially unsafe call), forgetting a context while the
 * library waits on it, and the driver-call statistic counting every call once. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_contexts_reset, declared in contexts.h */
#endif
#include "testutil.h"

#include <pthread.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "contexts.h"
#include "log.h"

static int ctx_setup(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    vmh_contexts_reset();
    return 0;
}

static int ctx_teardown(void **state)
{
    vmh_contexts_reset();
    return tu_teardown(state);
}

static CUcontext primary(int device)
{
    CUcontext c = NULL;
    assert_int_equal(sim_table()->cuDevicePrimaryCtxRetain(&c, device), CUDA_SUCCESS);
    assert_non_null(c);
    return c;
}

static CUcontext driver_current(void)
{
    CUcontext c = (CUcontext)1;
    assert_int_equal(sim_table()->cuCtxGetCurrent(&c), CUDA_SUCCESS);
    return c;
}

/* Runs fn(arg) on a new thread and returns its result. */
typedef struct thread_call {
    bool (*fn)(void *);
    void *arg;
    bool result;
} thread_call_t;

static void *thread_main(void *p)
{
    thread_call_t *t = p;
    t->result = t->fn(t->arg);
    return NULL;
}

static bool on_thread(bool (*fn)(void *), void *arg)
{
    thread_call_t t = {fn, arg, false};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, thread_main, &t), 0);
    pthread_join(th, NULL);
    return t.result;
}

/* --------------------------------------------------------------------------------------------- */
/* The current context                                                                           */

static void current_cached_without_driver_calls(void **state)
{
    (void)state;
    CUcontext c0 = driver_current();
    sim_reset_counters();
    CUcontext c = NULL;
    int dev = -1;
    assert_int_equal(vmh_ctx_current(&c, &dev), CUDA_SUCCESS);
    assert_ptr_equal(c, c0);
    assert_int_equal(dev, 0);
    unsigned long first = sim_call_count();
    assert_true(first > 0); /* asked the driver once */
    for (int i = 0; i < 1000; i++) {
        assert_int_equal(vmh_ctx_current(&c, &dev), CUDA_SUCCESS);
        assert_ptr_equal(c, c0);
    }
    assert_int_equal(sim_call_count(), first); /* steady state: no driver call */

    /* A context change reported by the interposer: asked again, and the new one is known. */
    sim_set_current_device(1);
    vmh_ctx_current_changed();
    assert_int_equal(vmh_ctx_current(&c, &dev), CUDA_SUCCESS);
    assert_ptr_equal(c, driver_current());
    assert_int_equal(dev, 1);
    assert_true(sim_call_count() > first);
}

static void current_none_is_invalid_context(void **state)
{
    (void)state;
    sim_set_current_device(-1);
    vmh_ctx_current_changed();
    CUcontext c;
    int dev;
    assert_int_equal(vmh_ctx_current(&c, &dev), CUDA_ERROR_INVALID_CONTEXT);
    /* Not cached: the context made current afterwards is found without a report. */
    sim_set_current_device(0);
    assert_int_equal(vmh_ctx_current(&c, &dev), CUDA_SUCCESS);
    assert_ptr_equal(c, driver_current());
}

static bool other_thread_sees_device1(void *arg)
{
    CUcontext *ctx1 = arg;
    sim_set_current_device(1);
    CUcontext c;
    int dev;
    return vmh_ctx_current(&c, &dev) == CUDA_SUCCESS && c == *ctx1 && dev == 1;
}

typedef struct cache_probe {
    atomic_int step;
    unsigned long calls_before, calls_after;
    CUcontext got;
} cache_probe_t;

static void wait_step(atomic_int *step, int want)
{
    while (atomic_load(step) < want)
        usleep(100);
}

/* A thread caches its context; another thread's forget (a destroy) makes it ask again. */
static void *probe_thread(void *p)
{
    cache_probe_t *pr = p;
    CUcontext c;
    int dev;
    sim_set_current_device(0);
    vmh_ctx_current(&c, &dev);
    atomic_store(&pr->step, 1);
    wait_step(&pr->step, 2);
    pr->calls_before = sim_calls("cuCtxGetCurrent");
    vmh_ctx_current(&pr->got, &dev);
    pr->calls_after = sim_calls("cuCtxGetCurrent");
    atomic_store(&pr->step, 3);
    return NULL;
}

static void forget_bumps_every_thread_cache(void **state)
{
    (void)state;
    CUcontext ctx1 = primary(1);
    assert_true(on_thread(other_thread_sees_device1, &ctx1));

    cache_probe_t pr = {.step = 0};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, probe_thread, &pr), 0);
    wait_step(&pr.step, 1);
    vmh_ctx_forget(ctx1); /* another context destroyed somewhere */
    atomic_store(&pr.step, 2);
    pthread_join(th, NULL);
    assert_int_equal(pr.calls_after, pr.calls_before + 1);
    assert_ptr_equal(pr.got, driver_current()); /* same device 0 primary context */
}

/* --------------------------------------------------------------------------------------------- */
/* Waiting for a device                                                                          */

static void sync_device_waits_every_context_of_the_device_only(void **state)
{
    (void)state;
    CUcontext ctx0 = primary(0), ctx1 = primary(1);
    vmh_ctx_seen(ctx0, 0);
    vmh_ctx_seen(ctx1, 1);
    vmh_ctx_seen(ctx1, 1); /* idempotent */
    sim_set_current_device(0);

    sim_reset_counters();
    assert_int_equal(vmh_ctx_sync_device(1), CUDA_SUCCESS);
    /* Device 1's context synchronized from this thread, pushed and popped; device 0's not. */
    assert_int_equal(sim_calls("cuCtxSynchronize"), 1);
    assert_int_equal(sim_calls("cuCtxPushCurrent"), 1);
    assert_int_equal(sim_calls("cuCtxPopCurrent"), 1);
    assert_ptr_equal(driver_current(), ctx0); /* the thread's context is restored */

    sim_reset_counters();
    assert_int_equal(vmh_ctx_sync_device(0), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuCtxSynchronize"), 1);
    assert_int_equal(sim_calls("cuCtxPushCurrent"), 0); /* already current: no push */
    assert_ptr_equal(driver_current(), ctx0);
}

/* Work in flight in a context made with cuCtxCreate lands only at that context's
 * synchronization: the wait on the device reaches it once the context is known, from a thread
 * where another context is current. */
static void sync_device_lands_work_of_a_created_context(void **state)
{
    (void)state;
    const vmh_driver_t *D = sim_table();
    CUcontext ctx0 = primary(0), mine = NULL;
    assert_int_equal(D->cuCtxCreate(&mine, NULL, 0, 0), CUDA_SUCCESS); /* current now */
    CUdeviceptr p = 0;
    assert_int_equal(D->cuMemAlloc(&p, 4096), CUDA_SUCCESS);
    assert_int_equal(sim_launch_write(mine, NULL, p, 4096, 0xab), CUDA_SUCCESS);
    CUcontext popped = NULL;
    assert_int_equal(D->cuCtxPopCurrent(&popped), CUDA_SUCCESS);
    assert_ptr_equal(popped, mine);
    sim_set_current_device(0);
    assert_ptr_equal(driver_current(), ctx0);

    /* Not known: the wait covers only this thread's context, the work stays in flight. */
    assert_int_equal(vmh_ctx_sync_device(0), CUDA_SUCCESS);
    assert_int_equal(sim_pending_ops_ctx(mine), 1);

    vmh_ctx_seen(mine, 0); /* what the interposer reports after cuCtxCreate */
    unsigned long syncs = sim_sync_count(mine);
    assert_int_equal(vmh_ctx_sync_device(0), CUDA_SUCCESS);
    assert_int_equal(sim_pending_ops_ctx(mine), 0);
    assert_int_equal(sim_sync_count(mine), syncs + 1);
    assert_ptr_equal(driver_current(), ctx0);
    unsigned char b = 0;
    assert_int_equal(sim_read(&b, p, 1), CUDA_SUCCESS);
    assert_int_equal(b, 0xab);

    /* Destroyed: forgotten first, then no longer waited for. */
    vmh_ctx_forget(mine);
    assert_int_equal(D->cuMemFree(p), CUDA_SUCCESS);
    assert_int_equal(D->cuCtxDestroy(mine), CUDA_SUCCESS);
    sim_reset_counters();
    assert_int_equal(vmh_ctx_sync_device(0), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuCtxSynchronize"), 1); /* the primary context only */
    assert_int_equal(sim_calls("cuCtxPushCurrent"), 0);
}

/* Destroyed on the driver directly (behind the interposer, no vmh_ctx_forget): the push for
 * the wait answers CUDA_ERROR_INVALID_CONTEXT, like the real driver for a destroyed handle; the
 * wait still succeeds for the device and the context is forgotten. */
static void sync_device_forgets_a_context_destroyed_behind_its_back(void **state)
{
    (void)state;
    const vmh_driver_t *D = sim_table();
    CUcontext ctx0 = primary(0), mine = NULL;
    assert_int_equal(D->cuCtxCreate(&mine, NULL, 0, 0), CUDA_SUCCESS);
    vmh_ctx_seen(mine, 0);
    CUcontext popped = NULL;
    assert_int_equal(D->cuCtxPopCurrent(&popped), CUDA_SUCCESS);
    sim_set_current_device(0);
    assert_int_equal(D->cuCtxDestroy(mine), CUDA_SUCCESS); /* not reported */
    assert_int_equal(D->cuCtxPushCurrent(mine), CUDA_ERROR_INVALID_CONTEXT); /* the answer */
    sim_reset_counters();
    assert_int_equal(vmh_ctx_sync_device(0), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuCtxPushCurrent"), 1); /* tried once */
    assert_ptr_equal(driver_current(), ctx0);
    sim_reset_counters();
    assert_int_equal(vmh_ctx_sync_device(0), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuCtxPushCurrent"), 0); /* forgotten */
    assert_int_equal(sim_calls("cuCtxSynchronize"), 1);
}

typedef struct dead_current {
    CUcontext ctx;
    atomic_int step;
    CUresult sync_rc, again_rc;
    unsigned long pushes_again;
} dead_current_t;

/* Keeps the context current while another thread destroys it: its synchronize then answers
 * CUDA_ERROR_CONTEXT_IS_DESTROYED, which forgets it too. */
static bool sync_with_dead_current(void *arg)
{
    dead_current_t *d = arg;
    if (sim_table()->cuCtxSetCurrent(d->ctx) != CUDA_SUCCESS)
        return false;
    atomic_store(&d->step, 1);
    wait_step(&d->step, 2);
    d->sync_rc = vmh_ctx_sync_device(0);
    sim_reset_counters();
    d->again_rc = vmh_ctx_sync_device(0);
    d->pushes_again = sim_calls("cuCtxPushCurrent") + sim_calls("cuCtxSynchronize");
    return true;
}

static void sync_device_forgets_a_dead_current_context(void **state)
{
    (void)state;
    const vmh_driver_t *D = sim_table();
    CUcontext mine = NULL;
    assert_int_equal(D->cuCtxCreate(&mine, NULL, 0, 0), CUDA_SUCCESS);
    vmh_ctx_seen(mine, 0);
    CUcontext popped = NULL;
    assert_int_equal(D->cuCtxPopCurrent(&popped), CUDA_SUCCESS);
    sim_set_current_device(-1); /* this thread waits for nothing of device 0 itself */
    dead_current_t d = {.ctx = mine};
    pthread_t th;
    thread_call_t call = {sync_with_dead_current, &d, false};
    assert_int_equal(pthread_create(&th, NULL, thread_main, &call), 0);
    wait_step(&d.step, 1);
    assert_int_equal(D->cuCtxDestroy(mine), CUDA_SUCCESS); /* behind the interposer */
    atomic_store(&d.step, 2);
    pthread_join(th, NULL);
    assert_true(call.result);
    assert_int_equal(d.sync_rc, CUDA_SUCCESS);
    assert_int_equal(d.again_rc, CUDA_SUCCESS);
    assert_int_equal(d.pushes_again, 0); /* forgotten: nothing of device 0 left to wait for */
}

static void sync_device_learns_the_callers_context(void **state)
{
    (void)state;
    /* Nothing reported: the calling thread's own context is still waited for. */
    sim_set_current_device(1);
    sim_reset_counters();
    assert_int_equal(vmh_ctx_sync_device(1), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuCtxSynchronize"), 1);
    sim_set_current_device(0);
    sim_reset_counters();
    assert_int_equal(vmh_ctx_sync_device(1), CUDA_SUCCESS); /* learnt: pushed and waited */
    assert_int_equal(sim_calls("cuCtxSynchronize"), 1);
    assert_int_equal(sim_calls("cuCtxPushCurrent"), 1);
}

static void sync_device_of_a_forgotten_context_skips_it(void **state)
{
    (void)state;
    CUcontext ctx1 = primary(1);
    vmh_ctx_seen(ctx1, 1);
    vmh_ctx_forget(ctx1);
    sim_set_current_device(0);
    sim_reset_counters();
    assert_int_equal(vmh_ctx_sync_device(1), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuCtxSynchronize"), 0);
}

static void sync_device_reports_the_drivers_error(void **state)
{
    (void)state;
    vmh_ctx_seen(primary(1), 1);
    sim_set_current_device(0);
    sim_fail_function("cuCtxSynchronize", 1, CUDA_ERROR_LAUNCH_FAILED);
    assert_int_equal(vmh_ctx_sync_device(1), CUDA_ERROR_LAUNCH_FAILED);
    sim_clear_faults();
    assert_ptr_equal(driver_current(), primary(0)); /* popped even so */
}

/* A table whose cuCtxSynchronize blocks until released, to hold a wait in progress. */
static vmh_driver_t blocking_table;
static atomic_int sync_entered, sync_release;

static CUresult blocking_sync(void)
{
    atomic_store(&sync_entered, 1);
    wait_step(&sync_release, 1);
    return sim_table()->cuCtxSynchronize();
}

typedef struct forget_arg {
    CUcontext ctx;
    atomic_int done;
} forget_arg_t;

static void *sync_thread(void *p)
{
    sim_set_current_device(0);
    *(CUresult *)p = vmh_ctx_sync_device(1);
    return NULL;
}

/* Device 1's primary context, known, and a thread (*waiter, its result in *rc) inside a wait on
 * it that blocks until sync_release is set. */
static CUcontext start_blocked_wait(pthread_t *waiter, CUresult *rc)
{
    CUcontext ctx1 = primary(1);
    vmh_ctx_seen(ctx1, 1);
    blocking_table = *sim_table();
    blocking_table.cuCtxSynchronize = blocking_sync;
    vmh_driver_install(&blocking_table);
    atomic_store(&sync_entered, 0);
    atomic_store(&sync_release, 0);
    *rc = CUDA_ERROR_UNKNOWN;
    assert_int_equal(pthread_create(waiter, NULL, sync_thread, rc), 0);
    wait_step(&sync_entered, 1);
    return ctx1;
}

static void *forget_thread(void *p)
{
    forget_arg_t *f = p;
    vmh_ctx_forget(f->ctx);
    atomic_store(&f->done, 1);
    return NULL;
}

static void forget_waits_for_a_wait_in_progress(void **state)
{
    (void)state;
    CUresult sync_rc;
    pthread_t waiter, forgetter;
    CUcontext ctx1 = start_blocked_wait(&waiter, &sync_rc);
    forget_arg_t f = {.ctx = ctx1, .done = 0};
    assert_int_equal(pthread_create(&forgetter, NULL, forget_thread, &f), 0);
    usleep(50 * 1000);
    assert_int_equal(atomic_load(&f.done), 0); /* still waiting for the synchronize */
    atomic_store(&sync_release, 1);
    pthread_join(waiter, NULL);
    pthread_join(forgetter, NULL);
    assert_int_equal(atomic_load(&f.done), 1);
    assert_int_equal(sync_rc, CUDA_SUCCESS);
    vmh_driver_install(sim_table());

    /* Forgotten: device 1 has no context left to wait for. */
    sim_reset_counters();
    assert_int_equal(vmh_ctx_sync_device(1), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuCtxSynchronize"), 0);
}

/* --------------------------------------------------------------------------------------------- */
/* Captures                                                                                      */

#define S1 ((CUstream)0x1001)
#define S2 ((CUstream)0x1002)

static bool forbidden_on_thread(void *mode)
{
    vmh_capture_thread_mode(*(CUstreamCaptureMode *)mode);
    return vmh_capture_forbids_unsafe();
}

static bool other_forbidden(CUstreamCaptureMode mode)
{
    return on_thread(forbidden_on_thread, &mode);
}

static void capture_rule_global(void **state)
{
    (void)state;
    assert_false(vmh_capture_any());
    assert_false(vmh_capture_forbids_unsafe());
    vmh_capture_began(S1, CU_STREAM_CAPTURE_MODE_GLOBAL);
    assert_true(vmh_capture_any());
    assert_true(vmh_capture_forbids_unsafe()); /* own capture */
    assert_true(other_forbidden(CU_STREAM_CAPTURE_MODE_GLOBAL));
    assert_false(other_forbidden(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    assert_false(other_forbidden(CU_STREAM_CAPTURE_MODE_RELAXED));
    vmh_capture_thread_mode(CU_STREAM_CAPTURE_MODE_RELAXED);
    assert_false(vmh_capture_forbids_unsafe()); /* relaxed: never */
    vmh_capture_thread_mode(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    assert_true(vmh_capture_forbids_unsafe()); /* its own non-relaxed capture */
    vmh_capture_thread_mode(CU_STREAM_CAPTURE_MODE_GLOBAL);
    vmh_capture_ended(S1);
    assert_false(vmh_capture_any());
    assert_false(vmh_capture_forbids_unsafe());
    assert_false(other_forbidden(CU_STREAM_CAPTURE_MODE_GLOBAL));
}

static void capture_rule_thread_local_and_relaxed(void **state)
{
    (void)state;
    vmh_capture_began(S1, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    assert_true(vmh_capture_forbids_unsafe());
    assert_false(other_forbidden(CU_STREAM_CAPTURE_MODE_GLOBAL)); /* not a global capture */
    vmh_capture_ended(S1);

    vmh_capture_began(S2, CU_STREAM_CAPTURE_MODE_RELAXED);
    assert_true(vmh_capture_any());
    assert_false(vmh_capture_forbids_unsafe());
    assert_false(other_forbidden(CU_STREAM_CAPTURE_MODE_GLOBAL));
    vmh_capture_ended(S2);
    assert_false(vmh_capture_any());
}

static bool capture_per_thread_stream(void *arg)
{
    (void)arg;
    vmh_capture_began(CU_STREAM_PER_THREAD, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    bool mine = vmh_capture_forbids_unsafe();
    vmh_capture_ended(CU_STREAM_PER_THREAD);
    return mine && !vmh_capture_forbids_unsafe();
}

static void capture_per_thread_stream_is_per_thread(void **state)
{
    (void)state;
    vmh_capture_began(CU_STREAM_PER_THREAD, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    /* Another thread captures and ends its own per-thread stream: this thread's stays. */
    assert_true(on_thread(capture_per_thread_stream, NULL));
    assert_true(vmh_capture_any());
    assert_true(vmh_capture_forbids_unsafe());
    vmh_capture_ended(CU_STREAM_PER_THREAD);
    assert_false(vmh_capture_any());
}

static void sync_refused_during_capture_without_a_driver_call(void **state)
{
    (void)state;
    vmh_ctx_seen(primary(0), 0);
    vmh_capture_began(S1, CU_STREAM_CAPTURE_MODE_GLOBAL);
    sim_reset_counters();
    assert_int_equal(vmh_ctx_sync_device(0), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert_int_equal(sim_call_count(), 0);
    /* Not even from a relaxed thread, nor during a relaxed capture: a context synchronize
     * waits for the capturing stream too. */
    vmh_capture_thread_mode(CU_STREAM_CAPTURE_MODE_RELAXED);
    assert_int_equal(vmh_ctx_sync_device(0), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    vmh_capture_ended(S1);
    vmh_capture_began(S1, CU_STREAM_CAPTURE_MODE_RELAXED);
    assert_int_equal(vmh_ctx_sync_device(0), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert_int_equal(sim_call_count(), 0);
    vmh_capture_ended(S1);
    assert_int_equal(vmh_ctx_sync_device(0), CUDA_SUCCESS); /* capture over: waits again */
}

/* --------------------------------------------------------------------------------------------- */
/* fork                                                                                          */

static bool capture_global_s2(void *arg)
{
    (void)arg;
    vmh_capture_began(S2, CU_STREAM_CAPTURE_MODE_GLOBAL);
    return true;
}

static void *begin_global_s2(void *arg)
{
    (void)arg;
    vmh_capture_began(S2, CU_STREAM_CAPTURE_MODE_GLOBAL); /* held at the gate meanwhile */
    return NULL;
}

/* Forked while another thread waits on a context and a third one's capture begin waits for that
 * wait: in the child, forgetting that context and beginning captures return at once, and the
 * pending begin is gone. In the parent the begin goes through once the wait is over. */
static void child_after_fork_never_blocks(void **state)
{
    (void)state;
    CUresult sync_rc;
    pthread_t waiter, beginner;
    CUcontext ctx1 = start_blocked_wait(&waiter, &sync_rc);
    assert_int_equal(pthread_create(&beginner, NULL, begin_global_s2, NULL), 0);
    while (vmh_capture_begins_pending() == 0)
        usleep(100);

    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        alarm(10); /* a hang ends the child with SIGALRM */
        /* the contexts layer's child steps have run (lifetime.c's fork handler) */
        vmh_ctx_forget(ctx1);
        int code = 0;
        if (vmh_capture_begins_pending() != 0 || vmh_capture_any())
            code = 2; /* the other thread's begin kept */
        vmh_capture_began(S1, CU_STREAM_CAPTURE_MODE_GLOBAL);
        if (!vmh_capture_any())
            code = 3;
        vmh_capture_ended(S1);
        _exit(code);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_false(vmh_capture_any()); /* still held at the gate */
    atomic_store(&sync_release, 1);
    pthread_join(waiter, NULL);
    pthread_join(beginner, NULL);
    vmh_driver_install(sim_table());
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    assert_int_equal(sync_rc, CUDA_SUCCESS);
    assert_true(vmh_capture_any()); /* begun after the wait */
    vmh_capture_ended(S2);
}

/* Forked while this thread and another have captures in progress: in the child only this
 * thread's own capture is left. */
static void child_keeps_only_its_own_capture(void **state)
{
    (void)state;
    assert_true(on_thread(capture_global_s2, NULL)); /* another thread's, still in progress */
    vmh_capture_began(S1, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        alarm(10);
        int code = 0;
        if (!vmh_capture_any())
            code = 2; /* own capture lost */
        vmh_capture_ended(S1);
        if (vmh_capture_any())
            code = 3; /* the other thread's capture kept */
        _exit(code);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    vmh_capture_ended(S1);
    vmh_capture_ended(S2); /* reported by this thread for the other: a named stream is one */
    assert_false(vmh_capture_any());
}

/* --------------------------------------------------------------------------------------------- */
/* The driver-call statistic                                                                     */

static void driver_calls_counted_once(void **state)
{
    (void)state;
    vmh_ctx_seen(primary(1), 1);
    sim_reset_counters();
    uint64_t before = vmh_counter_get(VMH_STAT_driver_calls);
    CUdeviceptr p = 0, q = 0;
    assert_int_equal(vmh_heap_alloc(4 * MiB, &p), CUDA_SUCCESS); /* a buffer of its own */
    assert_int_equal(vmh_heap_alloc(4096, &q), CUDA_SUCCESS);    /* a packed one */
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_ctx_sync_device(1), CUDA_SUCCESS);
    vmh_heap_trim();
    unsigned long made = sim_call_count();
    assert_true(made > 0);
    /* Every call the library made into the (simulated) driver, counted exactly once. */
    assert_int_equal(vmh_counter_get(VMH_STAT_driver_calls) - before, made);
}

/* --------------------------------------------------------------------------------------------- */
/* The library's own scopes                                                                      */

/* The last line logged and how many (vmh_log_sink). */
static char last_log[256];
static unsigned logged;

static void log_last(const char *line, size_t len)
{
    snprintf(last_log, sizeof last_log, "%.*s", (int)len, line);
    logged++;
}

/* Device 0's and 1's primary contexts; device 0's current (reported). */
static void on_device0(CUcontext *ctx0, CUcontext *ctx1)
{
    *ctx0 = primary(0);
    *ctx1 = primary(1);
    sim_set_current_device(0);
}

/* Scopes nest: a context already current (the thread's, or an open scope's) is not pushed
 * again, another one is, and leaving them in reverse order gives the thread its context back. */
static void scope_pushes_only_what_is_not_current(void **state)
{
    (void)state;
    CUcontext ctx0, ctx1, c;
    int dev;
    on_device0(&ctx0, &ctx1);
    assert_int_equal(vmh_ctx_current(&c, &dev), CUDA_SUCCESS); /* the thread's, cached */
    sim_reset_counters();
    vmh_ctx_scope_t a, b, d, e;
    assert_int_equal(vmh_ctx_enter(ctx0, &a), CUDA_SUCCESS); /* current: no driver call */
    assert_int_equal(sim_call_count(), 0);
    assert_int_equal(vmh_ctx_enter(ctx1, &b), CUDA_SUCCESS);
    assert_ptr_equal(driver_current(), ctx1);
    assert_int_equal(vmh_ctx_enter(ctx1, &d), CUDA_SUCCESS); /* the open scope's */
    assert_int_equal(vmh_ctx_enter(ctx0, &e), CUDA_SUCCESS); /* no longer current */
    assert_ptr_equal(driver_current(), ctx0);
    assert_int_equal(sim_calls("cuCtxPushCurrent"), 2);
    assert_int_equal(vmh_ctx_leave(&e), CUDA_SUCCESS);
    assert_ptr_equal(driver_current(), ctx1);
    assert_int_equal(vmh_ctx_leave(&d), CUDA_SUCCESS);
    assert_int_equal(vmh_ctx_leave(&b), CUDA_SUCCESS);
    assert_int_equal(vmh_ctx_leave(&a), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuCtxPopCurrent"), 2);
    assert_ptr_equal(driver_current(), ctx0);
    assert_int_equal(vmh_ctx_leave(&a), CUDA_SUCCESS); /* empty now: nothing */
    assert_int_equal(sim_calls("cuCtxPopCurrent"), 2);

    /* Nothing known of the thread's context (no report since it changed): pushed. */
    vmh_ctx_current_changed();
    sim_reset_counters();
    assert_int_equal(vmh_ctx_enter(ctx0, &a), CUDA_SUCCESS);
    assert_int_equal(vmh_ctx_leave(&a), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuCtxPushCurrent"), 1);
    assert_int_equal(sim_calls("cuCtxPopCurrent"), 1);
    assert_ptr_equal(driver_current(), ctx0);
}

/* A refused push: the driver's code, nothing pushed, an empty scope; the next enter works. */
static void scope_enter_refused(void **state)
{
    (void)state;
    CUcontext ctx0, ctx1;
    on_device0(&ctx0, &ctx1);
    vmh_ctx_scope_t s;
    sim_fail_function("cuCtxPushCurrent", 1, CUDA_ERROR_ILLEGAL_STATE);
    assert_int_equal(vmh_ctx_enter(ctx1, &s), CUDA_ERROR_ILLEGAL_STATE);
    assert_ptr_equal(driver_current(), ctx0);
    sim_reset_counters();
    assert_int_equal(vmh_ctx_leave(&s), CUDA_SUCCESS);
    assert_int_equal(sim_call_count(), 0);
    assert_int_equal(vmh_ctx_enter(ctx1, &s), CUDA_SUCCESS);
    assert_ptr_equal(driver_current(), ctx1);
    assert_int_equal(vmh_ctx_leave(&s), CUDA_SUCCESS);
    assert_ptr_equal(driver_current(), ctx0);
}

/* A refused pop: returned every time, logged once; what is current is unknown afterwards, so
 * the thread's context is asked of the driver again and an enclosing scope pushes whatever it
 * enters until it is left. */
static void scope_leave_refused_is_logged_once(void **state)
{
    (void)state;
    CUcontext ctx0, ctx1, c;
    int dev;
    const vmh_driver_t *D = sim_table();
    logged = 0;
    vmh_log_sink = log_last;
    on_device0(&ctx0, &ctx1);
    assert_int_equal(vmh_ctx_current(&c, &dev), CUDA_SUCCESS);
    vmh_ctx_scope_t outer, s;
    assert_int_equal(vmh_ctx_enter(ctx0, &outer), CUDA_SUCCESS); /* no push: current */
    for (int round = 0; round < 2; round++) {
        assert_int_equal(vmh_ctx_enter(ctx1, &s), CUDA_SUCCESS);
        sim_fail_function("cuCtxPopCurrent", 1, CUDA_ERROR_ILLEGAL_STATE);
        assert_int_equal(vmh_ctx_leave(&s), CUDA_ERROR_ILLEGAL_STATE);
        assert_ptr_equal(driver_current(), ctx1); /* the refused pop left it */
        assert_int_equal(logged, 1);
        assert_non_null(strstr(last_log, "restoring a thread's context"));
        /* The enclosing scope no longer trusts what it knew: ctx0 is pushed. */
        sim_reset_counters();
        assert_int_equal(vmh_ctx_enter(ctx0, &s), CUDA_SUCCESS);
        assert_int_equal(sim_calls("cuCtxPushCurrent"), 1);
        assert_int_equal(vmh_ctx_leave(&s), CUDA_SUCCESS);
        CUcontext popped;
        assert_int_equal(D->cuCtxPopCurrent(&popped), CUDA_SUCCESS); /* the test's own undo */
        assert_ptr_equal(popped, ctx1);
    }
    assert_int_equal(vmh_ctx_leave(&outer), CUDA_SUCCESS);
    assert_ptr_equal(driver_current(), ctx0);
    /* Asked again, once: the cache was dropped. */
    sim_reset_counters();
    assert_int_equal(vmh_ctx_current(&c, &dev), CUDA_SUCCESS);
    assert_ptr_equal(c, ctx0);
    assert_int_equal(sim_calls("cuCtxGetCurrent"), 1);
    vmh_log_sink = vmh_log_write_stderr;
}

/* A device's context by ordinal: the thread's own when it is that device's (nothing retained,
 * nothing pushed), else the primary context, retained for the scope and released with it; a
 * refused push releases it at once. */
static void scope_of_a_device(void **state)
{
    (void)state;
    CUcontext ctx0, ctx1;
    on_device0(&ctx0, &ctx1);
    sim_reset_counters();
    vmh_ctx_scope_t s;
    assert_int_equal(vmh_ctx_enter_device(0, &s), CUDA_SUCCESS);
    assert_int_equal(vmh_ctx_leave(&s), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuCtxPushCurrent") + sim_calls("cuDevicePrimaryCtxRetain"), 0);

    assert_int_equal(vmh_ctx_enter_device(1, &s), CUDA_SUCCESS);
    assert_ptr_equal(driver_current(), ctx1);
    assert_int_equal(vmh_ctx_leave(&s), CUDA_SUCCESS);
    assert_ptr_equal(driver_current(), ctx0);
    assert_int_equal(sim_calls("cuDevicePrimaryCtxRetain"), 1);
    assert_int_equal(sim_calls("cuDevicePrimaryCtxRelease"), 1);
    assert_int_equal(sim_calls("cuCtxPopCurrent"), 1);

    sim_fail_function("cuCtxPushCurrent", 1, CUDA_ERROR_ILLEGAL_STATE);
    assert_int_equal(vmh_ctx_enter_device(1, &s), CUDA_ERROR_ILLEGAL_STATE);
    assert_int_equal(sim_calls("cuDevicePrimaryCtxRetain"), 2);
    assert_int_equal(sim_calls("cuDevicePrimaryCtxRelease"), 2);
    assert_int_equal(vmh_ctx_leave(&s), CUDA_SUCCESS);
    assert_ptr_equal(driver_current(), ctx0);
    assert_int_equal(vmh_ctx_enter_device(SIM_MAX_DEVICES, &s), CUDA_ERROR_INVALID_DEVICE);

    /* The context the heap serves a device in: the same choice, the retain kept. */
    CUcontext c = NULL;
    sim_reset_counters();
    assert_int_equal(vmh_ctx_of_device(0, &c), CUDA_SUCCESS);
    assert_ptr_equal(c, ctx0);
    assert_int_equal(vmh_ctx_of_device(1, &c), CUDA_SUCCESS);
    assert_ptr_equal(c, ctx1);
    assert_int_equal(sim_calls("cuDevicePrimaryCtxRetain"), 1);
    assert_int_equal(sim_calls("cuDevicePrimaryCtxRelease"), 0);
    assert_ptr_equal(driver_current(), ctx0);
}

/* The device of a context, asked inside a scope of it: a refused push or pop is the answer. */
static void device_of_a_context(void **state)
{
    (void)state;
    CUcontext ctx0, ctx1;
    on_device0(&ctx0, &ctx1);
    int dev = -1;
    assert_int_equal(vmh_ctx_device_of(ctx1, &dev), CUDA_SUCCESS);
    assert_int_equal(dev, 1);
    assert_ptr_equal(driver_current(), ctx0);
    dev = -1;
    sim_fail_function("cuCtxPushCurrent", 1, CUDA_ERROR_ILLEGAL_STATE);
    assert_int_equal(vmh_ctx_device_of(ctx1, &dev), CUDA_ERROR_ILLEGAL_STATE);
    assert_int_equal(dev, -1);
    vmh_log_sink = log_last;
    sim_fail_function("cuCtxPopCurrent", 1, CUDA_ERROR_ILLEGAL_STATE);
    assert_int_equal(vmh_ctx_device_of(ctx1, &dev), CUDA_ERROR_ILLEGAL_STATE);
    assert_int_equal(dev, -1);
    vmh_log_sink = vmh_log_write_stderr;
    CUcontext popped;
    assert_int_equal(sim_table()->cuCtxPopCurrent(&popped), CUDA_SUCCESS); /* the test's undo */
    assert_ptr_equal(driver_current(), ctx0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
#define T(name) cmocka_unit_test_setup_teardown(name, ctx_setup, ctx_teardown)
        T(current_cached_without_driver_calls),
        T(current_none_is_invalid_context),
        T(forget_bumps_every_thread_cache),
        T(sync_device_waits_every_context_of_the_device_only),
        T(sync_device_lands_work_of_a_created_context),
        T(sync_device_learns_the_callers_context),
        T(sync_device_forgets_a_context_destroyed_behind_its_back),
        T(sync_device_forgets_a_dead_current_context),
        T(sync_device_of_a_forgotten_context_skips_it),
        T(sync_device_reports_the_drivers_error),
        T(forget_waits_for_a_wait_in_progress),
        T(capture_rule_global),
        T(capture_rule_thread_local_and_relaxed),
        T(capture_per_thread_stream_is_per_thread),
        T(sync_refused_during_capture_without_a_driver_call),
        T(child_after_fork_never_blocks),
        T(child_keeps_only_its_own_capture),
        T(driver_calls_counted_once),
        T(scope_pushes_only_what_is_not_current),
        T(scope_enter_refused),
        T(scope_leave_refused_is_logged_once),
        T(scope_of_a_device),
        T(device_of_a_context),
#undef T
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
