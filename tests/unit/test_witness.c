/* witness.c: the lock order of witness.h checked. A lock taken at or below the rank of one
 * already held, a release of a lock not taken through the witness and a driver call under a
 * lock that forbids one are reported (here to a hook that records them; by default to the log,
 * then abort, checked in a forked child). The checker is in every test build; the library's
 * own locks go through it only in witness builds (-Dwitness, on in debug and sanitizer builds),
 * where the last test takes a library path under a lock that must come after its locks. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_witness_on_violation, vmh_witness_held_count */
#endif
#include "testutil.h"

#include <sys/wait.h>
#include <unistd.h>

#include "log.h"
#include "witness.h"

static char reports[8][512];
static unsigned nreports;

static void record(const char *report)
{
    if (nreports < 8)
        snprintf(reports[nreports], sizeof reports[0], "%s", report);
    nreports++;
}

static int w_setup(void **state)
{
    (void)state;
    nreports = 0;
    vmh_witness_on_violation = record;
    assert_int_equal(vmh_witness_held_count(), 0);
    return 0;
}

static int w_teardown(void **state)
{
    (void)state;
    vmh_witness_on_violation = NULL;
    assert_int_equal(vmh_witness_held_count(), 0); /* every test releases what it took */
    return 0;
}

/* Stand-ins for locks: the checker knows locks by address only. */
static char lock_a, lock_b, lock_c;

#define ACQ(l, r) vmh_witness_acquire(&(l), VMH_RANK_##r, __FILE__, __LINE__)
#define REL(l) vmh_witness_release(&(l), __FILE__, __LINE__)

/* Outermost first, as the table says: nothing to report, and locks may go in any order. */
static void order_followed_is_quiet(void **state)
{
    (void)state;
    ACQ(lock_a, RECLAIM_WAIT);
    ACQ(lock_b, OWNER);
    ACQ(lock_c, RECLAIM_QUEUE);
    assert_int_equal(vmh_witness_held_count(), 3);
    REL(lock_b); /* not the last taken: allowed */
    REL(lock_c);
    ACQ(lock_b, CACHE); /* after the wait lock still */
    REL(lock_b);
    REL(lock_a);
    assert_int_equal(nreports, 0);
}

/* The reclaim queue's lock, then a shard's: the wrong way round, reported with both places. */
static void wrong_order_is_reported(void **state)
{
    (void)state;
    ACQ(lock_a, RECLAIM_QUEUE);
    ACQ(lock_b, OWNER);
    assert_int_equal(nreports, 1);
    assert_non_null(strstr(reports[0], "takes OWNER"));
    assert_non_null(strstr(reports[0], "while holding RECLAIM_QUEUE"));
    assert_non_null(strstr(reports[0], "test_witness.c"));
    REL(lock_b);
    REL(lock_a);
    assert_int_equal(nreports, 1);
}

/* One rank, two locks (two shards, or a shard and an own-chunk set): reported; so is the same
 * lock taken twice. */
static void same_rank_twice_is_reported(void **state)
{
    (void)state;
    ACQ(lock_a, OWNER);
    ACQ(lock_b, OWNER);
    assert_int_equal(nreports, 1);
    assert_non_null(strstr(reports[0], "while holding OWNER"));
    ACQ(lock_a, OWNER);
    assert_int_equal(nreports, 2);
    assert_non_null(strstr(reports[1], "the same lock again"));
    REL(lock_a);
    REL(lock_b);
    REL(lock_a);
}

/* A lock released that was never taken through the witness: a lock taken with a bare pthread
 * call somewhere, which the order would not see. */
static void release_of_a_lock_not_taken_is_reported(void **state)
{
    (void)state;
    REL(lock_c);
    assert_int_equal(nreports, 1);
    assert_non_null(strstr(reports[0], "did not take"));
}

/* Driver calls: none under the heap's locks, allowed under the wait lock (it waits). */
static void driver_call_under_a_heap_lock_is_reported(void **state)
{
    (void)state;
    ACQ(lock_a, RECLAIM_WAIT);
    vmh_witness_driver_call();
    assert_int_equal(nreports, 0);
    ACQ(lock_b, OWNER);
    vmh_witness_driver_call();
    assert_int_equal(nreports, 1);
    assert_non_null(strstr(reports[0], "a driver call while holding OWNER"));
    REL(lock_b);
    vmh_witness_driver_call();
    assert_int_equal(nreports, 1);
    REL(lock_a);
}

static void held_and_none_above(void **state)
{
    (void)state;
    ACQ(lock_a, RECLAIM_WAIT);
    vmh_witness_assert_held(&lock_a, __FILE__, __LINE__);
    vmh_witness_assert_none_above(VMH_RANK_RECLAIM_WAIT, __FILE__, __LINE__);
    assert_int_equal(nreports, 0);
    vmh_witness_assert_held(&lock_b, __FILE__, __LINE__);
    assert_int_equal(nreports, 1);
    ACQ(lock_b, CACHE);
    vmh_witness_assert_none_above(VMH_RANK_RECLAIM_WAIT, __FILE__, __LINE__);
    assert_int_equal(nreports, 2);
    assert_non_null(strstr(reports[1], "holds CACHE"));
    REL(lock_b);
    REL(lock_a);
}

/* Without a hook: one log line naming both places, then abort(). */
static void default_is_log_and_abort(void **state)
{
    (void)state;
    vmh_witness_on_violation = NULL;
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        tu_forked_child();
        dup2(fds[1], 2);
        ACQ(lock_a, CAPTURES);
        ACQ(lock_b, PAUSE);
        _exit(0); /* not reached */
    }
    close(fds[1]);
    char buf[1024];
    ssize_t n, got = 0;
    while (got < (ssize_t)sizeof buf - 1 && (n = read(fds[0], buf + got, sizeof buf - 1 - got)) > 0)
        got += n;
    buf[got] = '\0';
    close(fds[0]);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
    assert_non_null(strstr(buf, "vmmhook: lock order violated:"));
    assert_non_null(strstr(buf, "takes PAUSE"));
    assert_non_null(strstr(buf, "while holding CAPTURES"));
}

/* The library's own locks, in a witness build: an allocation under a lock ranked after all of
 * the heap's (and under which driver calls are allowed) is caught at the heap's first lock. */
static void library_locks_are_checked(void **state)
{
    (void)state;
#ifndef VMH_WITNESS
    skip(); /* the library's locks are bare pthread calls in this build */
#else
    tu_reset(NULL);
    pthread_mutex_t leaf = PTHREAD_MUTEX_INITIALIZER;
    vmh_lock(&leaf, VMH_RANK_MAPS);
    assert_int_equal(vmh_witness_held_count(), 1);
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_alloc(4096, &p), CUDA_SUCCESS);
    vmh_unlock(&leaf);
    assert_true(nreports > 0);
    assert_non_null(strstr(reports[0], "while holding MAPS"));
    assert_non_null(strstr(reports[0], "src/"));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    tu_assert_ledger_empty();
#endif
}

int main(void)
{
    const struct CMUnitTest tests[] = {
#define T(name) cmocka_unit_test_setup_teardown(name, w_setup, w_teardown)
        T(order_followed_is_quiet),
        T(wrong_order_is_reported),
        T(same_rank_twice_is_reported),
        T(release_of_a_lock_not_taken_is_reported),
        T(driver_call_under_a_heap_lock_is_reported),
        T(held_and_none_above),
        T(default_is_log_and_abort),
        T(library_locks_are_checked),
#undef T
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
