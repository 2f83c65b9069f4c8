/* Micro-benchmark of the heap's packed fast path on the simulated driver: alloc+free pairs per
 * second at 1, 2 and 16 threads. A meson benchmark() (`meson test -C build --benchmark`), not a
 * unit test: it prints figures and asserts only that every call succeeds and that nothing is
 * left in the driver afterwards. */
#include "testutil.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

/* ---- micro-benchmark (prints only) ---- */

#define BENCH_PAIRS 200000

static _Atomic int bench_go;

static void *bench_pairs(void *arg)
{
    (void)arg;
    sim_set_current_device(0);
    CUdeviceptr keep[8];
    /* A few live blocks so that the arena is not empty. */
    for (int i = 0; i < 8; i++)
        if (vmh_heap_alloc_on(0, 4096, &keep[i]) != CUDA_SUCCESS)
            return (void *)1;
    while (!atomic_load(&bench_go))
        ;
    for (int i = 0; i < BENCH_PAIRS; i++) {
        CUdeviceptr p;
        size_t size = (size_t)256 << (i % 8); /* 256 B .. 32 KiB */
        if (vmh_heap_alloc_on(0, size, &p) != CUDA_SUCCESS)
            return (void *)1;
        if (vmh_heap_free(p, NULL, true) != CUDA_SUCCESS)
            return (void *)1;
    }
    for (int i = 0; i < 8; i++)
        if (vmh_heap_free(keep[i], NULL, true) != CUDA_SUCCESS)
            return (void *)1;
    return NULL;
}

static double bench_run(int nthreads)
{
    pthread_t t[16];
    assert_true(nthreads <= 16);
    atomic_store(&bench_go, 0);
    for (intptr_t i = 0; i < nthreads; i++)
        assert_int_equal(pthread_create(&t[i], NULL, bench_pairs, (void *)i), 0);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    atomic_store(&bench_go, 1);
    for (int i = 0; i < nthreads; i++) {
        void *bad;
        pthread_join(t[i], &bad);
        assert_null(bad);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double s = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9;
    return (double)nthreads * BENCH_PAIRS / s;
}

/* Packed alloc+free pairs per second on the simulated driver, 1, 2 and 16 threads. The steady
 * state makes no driver call on the measured threads (vmh_heap_alloc_on with an existing
 * device, async frees whose parked blocks the reclaim thread releases), so this measures the
 * heap's own locking. Printed, not asserted. */
static void bench_packed_pairs(void **state)
{
    (void)state;
    tu_opt.pack_below = 512 * MiB;
    /* The product's reclaim: the thread releases parked blocks, the default park limit. */
    tu_opt.park_limit = 256 * MiB;
    tu_configure();
    vmh_reclaim_background(true);
    CUdeviceptr warm;
    assert_int_equal(vmh_heap_alloc(4096, &warm), CUDA_SUCCESS); /* makes device 0's state */
    assert_int_equal(vmh_heap_free(warm, NULL, true), CUDA_SUCCESS);
    static const int counts[] = {1, 2, 16};
    double first = 0;
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
        uint64_t syncs = vmh_counter_get(VMH_STAT_syncs);
        uint64_t blocking = vmh_counter_get(VMH_STAT_syncs_blocking);
        double rate = bench_run(counts[i]);
        if (i == 0)
            first = rate;
        printf("bench: packed alloc+free pairs/s, %2d thread(s): %9.0f (%.2fx); %llu "
               "synchronizes (%llu blocking), %zu MiB idle after\n",
               counts[i], rate, rate / first,
               (unsigned long long)(vmh_counter_get(VMH_STAT_syncs) - syncs),
               (unsigned long long)(vmh_counter_get(VMH_STAT_syncs_blocking) - blocking),
               vmh_heap_idle_bytes(0) / MiB);
    }
    fflush(stdout);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(bench_packed_pairs, tu_setup, tu_teardown),
    };
    return cmocka_run_group_tests_name("bench_heap", tests, NULL, NULL);
}
