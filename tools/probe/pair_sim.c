/* pair_sim: bench.cu's isolated pairs (workload a: alloc+free of 256 B, 64 KiB, 2 MiB, 64 MiB,
 * 1 GiB, each pair alone) through the library's heap on the simulated driver, to see what work
 * a size's pair does that another's does not: driver calls per pair (by entry point) and CPU
 * ns per pair on this machine (not a GPU's speed: the simulated driver answers at once). The
 * heap is set up as churn_sim's (simprobe.h), the product's reclaim thread on.
 *
 * Build: meson setup build -Dunit_tests=enabled; run: build/tools/probe/pair_sim [--pairs N] */
#include "simprobe.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int pairs = 20000;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--pairs") == 0 && i + 1 < argc)
            pairs = atoi(argv[++i]);
    const size_t sizes[] = {256, 64 * 1024, 2 * MiB, 64 * MiB, 1 * GiB};
    const char *names[] = {"256B", "64KiB", "2MiB", "64MiB", "1GiB"};
    double *ns = calloc((size_t)pairs, sizeof *ns);
    bool ok = ns != NULL;
    probe_heap_reset("pair_sim", true);
    printf("| size | p10 ns | p50 ns | p90 ns | driver calls / 1000 pairs |\n| --- | --- | --- "
           "| --- | --- |\n");
    for (size_t k = 0; ok && k < sizeof sizes / sizeof sizes[0]; k++) {
        CUdeviceptr p;
        for (int i = 0; i < 10; i++) { /* warm-up, as bench.cu's */
            ok = ok && vmh_heap_alloc(sizes[k], &p) == CUDA_SUCCESS &&
                 vmh_heap_free(p, NULL, false) == CUDA_SUCCESS;
        }
        unsigned long calls0 = sim_call_count();
        for (int r = 0; ok && r < pairs; r++) {
            double t0 = now_ns();
            ok = vmh_heap_alloc(sizes[k], &p) == CUDA_SUCCESS &&
                 vmh_heap_free(p, NULL, false) == CUDA_SUCCESS;
            ns[r] = now_ns() - t0;
        }
        unsigned long calls = sim_call_count() - calls0;
        qsort(ns, (size_t)pairs, sizeof *ns, cmp_double);
        printf("| %s | %.0f | %.0f | %.0f | %.1f |\n", names[k], ns[pairs / 10], ns[pairs / 2],
               ns[pairs * 9 / 10], 1000.0 * (double)calls / pairs);
    }
    free(ns);
    ok = probe_heap_finish("pair_sim") && ok;
    return ok ? 0 : 1;
}
