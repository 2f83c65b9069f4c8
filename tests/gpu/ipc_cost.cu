/* ipc_cost: what shareable chunks cost. Allocation latency (cudaMalloc + cudaFree of 2 MiB and
 * 64 MiB) natively and under the hook, where VMMHOOK_HANDLE_TYPE=posix_fd creates every chunk
 * with requestedHandleTypes POSIX_FD and none without; and the cost of cudaIpcGetMemHandle
 * (the first call for a buffer, and again for the same buffer).
 *
 * Run it with VMMHOOK_CACHE_LIMIT=0 under the hook (tools/gpu-suite.sh does): the reuse cache
 * would otherwise serve every pair after the first without creating anything, hiding the
 * creation cost being measured. Each pair also uses a fresh size (a few KiB apart), for the
 * same reason natively and under any cache.
 *
 * Output: "COST <what> <size> median_us=<m> p10_us=<a> p90_us=<b> n=<n>" lines (collected by
 * the suite), I lines, the PASS line. No R lines: timings differ by nature. */
#include "gpu_common.h"

#include <algorithm>
#include <chrono>
#include <vector>

static double now_us(void)
{
    return std::chrono::duration<double, std::micro>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

static void report(const char *what, const char *size, std::vector<double> &t)
{
    if (t.empty())
        return;
    std::sort(t.begin(), t.end());
    size_t n = t.size();
    printf("COST %s %s median_us=%.2f p10_us=%.2f p90_us=%.2f n=%zu\n", what, size, t[n / 2],
           t[n / 10], t[n * 9 / 10], n);
}

static void alloc_pairs(const char *label, size_t base, int reps)
{
    std::vector<double> t;
    for (int i = -5; i < reps; i++) { /* 5 warm-up pairs */
        size_t n = base + (size_t)((i + 5) % 64) * 4096;
        void *p = NULL;
        double t0 = now_us();
        cudaError_t e = cudaMalloc(&p, n);
        if (e == cudaSuccess)
            e = cudaFree(p);
        double t1 = now_us();
        if (CK(e))
            return;
        if (i >= 0)
            t.push_back(t1 - t0);
    }
    report("malloc_free", label, t);
}

static void ipc_get(const char *label, size_t n, int reps)
{
    std::vector<double> first, again;
    for (int i = 0; i < reps; i++) {
        void *p = NULL;
        if (CK(cudaMalloc(&p, n)))
            return;
        cudaIpcMemHandle_t h;
        double t0 = now_us();
        cudaError_t e = cudaIpcGetMemHandle(&h, p);
        double t1 = now_us();
        cudaError_t e2 = cudaIpcGetMemHandle(&h, p);
        double t2 = now_us();
        CK(cudaFree(p));
        if (e != cudaSuccess || e2 != cudaSuccess) {
            cudaGetLastError();
            INFO("cudaIpcGetMemHandle -> %d: not measured (%s)", (int)e, cudaGetErrorString(e));
            return;
        }
        first.push_back(t1 - t0);
        again.push_back(t2 - t1);
    }
    report("ipc_get_first", label, first);
    report("ipc_get_again", label, again);
}

int main(int argc, char **argv)
{
    gt_init("ipc_cost");
    int reps = argc > 1 ? atoi(argv[1]) : 200;
    if (reps < 10)
        reps = 10;
    const char *ht = getenv("VMMHOOK_HANDLE_TYPE"), *cl = getenv("VMMHOOK_CACHE_LIMIT");
    INFO("mode: %s, VMMHOOK_HANDLE_TYPE=%s, VMMHOOK_CACHE_LIMIT=%s, %d pairs per size",
         gt_hooked() ? "hooked" : "native", ht ? ht : "(unset)", cl ? cl : "(unset)", reps);
    if (gt_hooked() && !(cl && cl[0] == '0' && cl[1] == '\0'))
        INFO("note: without VMMHOOK_CACHE_LIMIT=0 the cache may hide the creation cost");
    alloc_pairs("2MiB", 2 * MiB, reps);
    alloc_pairs("64MiB", 64 * MiB, reps / 2);
    ipc_get("64MiB", 64 * MiB, reps / 10 < 10 ? 10 : reps / 10);
    gt_trim();
    return gt_finish();
}
