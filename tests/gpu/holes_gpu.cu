/* holes_gpu: idle chunks inside extents go back (issue 27's holes), under the hook (natively it
 * exits 77: what it checks is the hook's tidy).
 *
 * 1  N buffers of 2 MiB (N = 10240, 20 GiB, scaled to a third of the free memory) allocated with
 *    cudaMalloc, every 512th filled with a pattern, the rest freed (at once: one queue). The
 *    program then waits 3.5 s without allocating: the library's reclaim thread tidies, and after
 *    two one-second windows the recent peak is the small live set, so whole idle extents go and
 *    the chunks inside the extents that keep a buffer are unmapped (holes). The library's
 *    bytes_mapped (vmm_stats_json: the handle layer's count of what is mapped; cudaMemGetInfo
 *    under the hook reports idle memory as free, so it cannot tell) before and after: with holes
 *    about 20% of the 20 GiB stays (the simulated driver: 4072 of 20602 MiB), without them about
 *    56% (11490 MiB): the check is < 40%.
 * 2  A 340 MiB buffer (larger than any free space left mapped, as large as a 1 GiB extent's
 *    chunk: it maps a hole again), filled and verified; every kept buffer verified.
 * R lines are the checked outcomes, I lines the measured numbers ("I holes: ..."). Usage:
 * holes_gpu [N=10240]. */
#include "gpu_common.h"
#include "vmmhook.h"

#include <chrono>
#include <thread>
#include <vector>

#define KEEP_EVERY 512

typedef int (*stats_json_fn)(char *, size_t);
static stats_json_fn p_stats_json;

/* The library's gauge "bytes_mapped": {"current": N, ...} (report.c), 0 when not found. */
static size_t used_bytes(void)
{
    std::vector<char> buf(1 << 20);
    if (!p_stats_json || p_stats_json(buf.data(), buf.size()) < 0)
        return 0;
    buf.back() = 0;
    const char *k = strstr(buf.data(), "\"bytes_mapped\"");
    const char *cur = k ? strstr(k, "\"current\":") : NULL;
    return cur ? (size_t)strtoull(cur + strlen("\"current\":"), NULL, 10) : 0;
}

int main(int argc, char **argv)
{
    gt_init("holes_gpu");
    if (!gt_hooked()) {
        if (g_expect_hook)
            return gt_finish();
        gt_skip("needs the hook (LD_PRELOAD=libvmmhook.so): the holes are the hook's tidy");
    }
    p_stats_json = (stats_json_fn)vmm_fn("vmm_stats_json");
    CHECK(p_stats_json != NULL, "the loaded hook lacks vmm_stats_json");
    size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : 10240;
    size_t free_b = gt_free_bytes();
    if (n * 2 * MiB > free_b / 3)
        n = free_b / 3 / (2 * MiB);
    if (n < 4 * KEEP_EVERY)
        gt_skip("too little free memory for %d x 2 MiB", 4 * KEEP_EVERY);
    std::vector<void *> p(n, nullptr);
    size_t base_used = used_bytes();
    INFO("holes: bytes_mapped %zu MiB at the start", base_used / MiB);
    for (size_t i = 0; i < n; i++)
        if (CK(cudaMalloc(&p[i], 2 * MiB)))
            return gt_finish();
    for (size_t i = 0; i < n; i += KEEP_EVERY)
        gt_fill(p[i], 2 * MiB, i + 1);
    CK(cudaDeviceSynchronize());
    size_t before = used_bytes() - base_used;
    for (size_t i = 0; i < n; i++) {
        if (i % KEEP_EVERY) {
            CK(cudaFree(p[i]));
            p[i] = nullptr;
        }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(3500));
    size_t after = used_bytes() - base_used;
    INFO("holes: %zu x 2 MiB, 1 in %d kept: %zu MiB used before the frees, %zu MiB 3.5 s after "
         "(%.3f)",
         n, KEEP_EVERY, before / MiB, after / MiB, before ? (double)after / (double)before : 0.0);
    CHECK(after * 10 < before * 4,
          "3.5 s after the frees %zu of %zu MiB are still used (>= 40%%): the chunks inside the "
          "extents that keep a buffer were not unmapped",
          after / MiB, before / MiB);
    R("idle chunks inside extents unmapped: %s", after * 10 < before * 4 ? "yes" : "no");

    void *big = nullptr;
    auto t0 = std::chrono::steady_clock::now();
    CK(cudaMalloc(&big, 340 * MiB));
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    size_t refilled = used_bytes() - base_used;
    INFO("holes: 340 MiB allocated in %.3f ms, %zu MiB used after", ms, refilled / MiB);
    unsigned long long bad = 0;
    if (big) {
        gt_fill(big, 340 * MiB, 77);
        bad += gt_verify(big, 340 * MiB, 77, 0, 0, "340 MiB in a hole");
    }
    for (size_t i = 0; i < n; i += KEEP_EVERY)
        bad += gt_verify(p[i], 2 * MiB, i + 1, 0, 0, "a kept 2 MiB buffer");
    CHECK(bad == 0, "%llu bytes differ in the kept buffers or the one in a hole", bad);
    R("contents intact: %s", bad == 0 ? "yes" : "no");
    CK(cudaFree(big));
    for (size_t i = 0; i < n; i += KEEP_EVERY)
        CK(cudaFree(p[i]));
    return gt_finish();
}
