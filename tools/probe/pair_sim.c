/* pair_sim: bench.cu's isolated pairs (workload a: alloc+free of 256 B, 64 KiB, 2 MiB, 64 MiB,
 * 1 GiB, each pair alone) through the library's heap on the simulated driver, to see what work
 * a size's pair does that another's does not: driver calls per pair (on the pairing thread and
 * on the reclaim thread, by entry point), wakes of the reclaim thread per pair, and CPU ns per
 * pair on this machine (not a GPU's speed: the simulated driver answers at once). The heap is
 * set up as churn_sim's (simprobe.h), the product's reclaim thread on.
 *
 * Two modes, as a program meets them: the program's work in one queue (frees reused at once,
 * contexts.h), and after a stream was created, as bench.cu creates one before its workloads
 * (frees park until the GPU has passed them, reclaim.h): the H200's pairs run in this one.
 *
 * Build: meson setup build -Dunit_tests=enabled; run: build/tools/probe/pair_sim [--pairs N]
 * [--split-only] [--only 64MiB] */
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

/* The entry points that differ between two snapshots, as "name n/1000 pairs" pairs. */
static void print_entries(const probe_snapshot_t *a, const probe_snapshot_t *b, int pairs)
{
    bool any = false;
    for (size_t i = 0; i < sim_entry_count(); i++) {
        unsigned long n = b->sim[i] - a->sim[i];
        if (n) {
            printf("%s%s %.1f", any ? ", " : "", sim_entry_name(i), 1000.0 * (double)n / pairs);
            any = true;
        }
    }
    printf("%s", any ? "" : "none");
}

static bool run_mode(bool split, int pairs, const char *only, double *ns)
{
    const size_t sizes[] = {256, 64 * 1024, 2 * MiB, 64 * MiB, 1 * GiB};
    const char *names[] = {"256B", "64KiB", "2MiB", "64MiB", "1GiB"};
    bool ok = true;
    probe_heap_reset("pair_sim", true);
    if (split)
        vmh_work_queue_split("a stream created (bench.cu's)");
    printf("\n%s\n\n| size | p10 ns | p50 ns | p90 ns | app calls / 1000 pairs | reclaim thread "
           "calls / 1000 | thread wakes / 1000 | calls by entry point / 1000 |\n| --- | --- | "
           "--- | --- | --- | --- | --- | --- |\n",
           split ? "After a stream was created (bench.cu): frees park" :
                   "The program's work in one queue: frees reused at once");
    probe_snapshot_t s0, s1;
    probe_snapshot_init(&s0);
    probe_snapshot_init(&s1);
    for (size_t k = 0; ok && k < sizeof sizes / sizeof sizes[0]; k++) {
        if (only && strcmp(only, names[k]) != 0)
            continue;
        CUdeviceptr p;
        for (int i = 0; i < 10; i++) { /* warm-up, as bench.cu's */
            ok = ok && vmh_heap_alloc(sizes[k], &p) == CUDA_SUCCESS &&
                 vmh_heap_free(p, NULL, false) == CUDA_SUCCESS;
        }
        vmh_reclaim_settle(1000);
        probe_snap(&s0);
        unsigned long wakes0 = vmh_reclaim_wakes();
        for (int r = 0; ok && r < pairs; r++) {
            double t0 = now_ns();
            ok = vmh_heap_alloc(sizes[k], &p) == CUDA_SUCCESS &&
                 vmh_heap_free(p, NULL, false) == CUDA_SUCCESS;
            ns[r] = now_ns() - t0;
        }
        unsigned long wakes = vmh_reclaim_wakes() - wakes0;
        vmh_reclaim_settle(1000); /* the reclaim thread's calls for these pairs counted too */
        probe_snap(&s1);
        uint64_t all = s1.counters[VMH_STAT_driver_calls] - s0.counters[VMH_STAT_driver_calls];
        uint64_t bg = s1.counters[VMH_STAT_driver_calls_background] -
                      s0.counters[VMH_STAT_driver_calls_background];
        qsort(ns, (size_t)pairs, sizeof *ns, cmp_double);
        printf("| %s | %.0f | %.0f | %.0f | %.1f | %.1f | %.1f | ", names[k], ns[pairs / 10],
               ns[pairs / 2], ns[pairs * 9 / 10], 1000.0 * (double)(all - bg) / pairs,
               1000.0 * (double)bg / pairs, 1000.0 * (double)wakes / pairs);
        print_entries(&s0, &s1, pairs);
        printf(" |\n");
    }
    probe_snapshot_free(&s0);
    probe_snapshot_free(&s1);
    return probe_heap_finish("pair_sim") && ok;
}

int main(int argc, char **argv)
{
    int pairs = 20000;
    bool split_only = false;
    const char *only = NULL; /* one size by its name (strace -f -c of one size's pairs) */
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--pairs") == 0 && i + 1 < argc)
            pairs = atoi(argv[++i]);
        else if (strcmp(argv[i], "--split-only") == 0)
            split_only = true;
        else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc)
            only = argv[++i];
    }
    double *ns = calloc((size_t)(pairs > 0 ? pairs : 1), sizeof *ns);
    bool ok = ns != NULL && pairs > 0;
    if (ok && !split_only)
        ok = run_mode(false, pairs, only, ns);
    ok = ok && run_mode(true, pairs, only, ns);
    free(ns);
    return ok ? 0 : 1;
}
