/* churn_mt: threads allocating and freeing at random, with data checks.
 *
 * Each thread, on its own stream, does ops random steps: allocate (70% < 64 KiB, 25% < 8 MiB,
 * 5% < max; 15% of them through cudaMallocAsync from the device's default pool, which the hook
 * must pass through), write a block-specific pattern with a kernel right after allocating, and
 * verify the pattern before every free. 10% of the frees hand the block to another thread
 * through a mailbox instead (frees on other threads: the receiver verifies and frees it,
 * cudaFreeAsync on its own stream for pool blocks). The live total is capped.
 *
 * Usage: churn_mt [threads=8] [ops_per_thread=3000] [cap_MiB=4096] [max_alloc_MiB=256]
 * Compared part (R lines): the parameters and the error counts, all 0 when correct. */
#include "gpu_common.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

enum { KIND_MALLOC = 0, KIND_ASYNC = 1 };

struct Block {
    void *p;
    size_t n;
    uint64_t seed;
    int kind;
    int owner;
};

static std::mutex g_mbox_mu;
static std::vector<Block> g_mbox;
static std::atomic<long long> g_live_bytes{0}, g_peak_bytes{0};
static std::atomic<long long> g_api_errors{0}, g_data_errors{0}, g_owns_errors{0},
    g_align_errors{0};
static std::atomic<long long> g_allocs{0}, g_async_allocs{0}, g_frees{0}, g_passed{0},
    g_received{0}, g_refused{0};
static std::mutex g_addr_mu;
static std::vector<uintptr_t> g_addrs; /* freed cudaMalloc blocks, for the leftover check */

static long long g_cap;
static size_t g_max_alloc;
static int g_hook;

static inline uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static size_t pick_size(uint64_t *rng)
{
    unsigned r = rng_next(rng) % 100;
    size_t lo, hi;
    if (r < 70)
        lo = 1, hi = 64 * KiB;
    else if (r < 95)
        lo = 64 * KiB, hi = 8 * MiB;
    else
        lo = 8 * MiB, hi = 256 * MiB;
    if (hi > g_max_alloc)
        hi = g_max_alloc;
    if (lo >= hi)
        lo = hi / 2 ? hi / 2 : 1;
    return lo + rng_next(rng) % (hi - lo);
}

static void api_error(const char *what, cudaError_t e, size_t n)
{
    long long k = g_api_errors.fetch_add(1);
    if (k < 10)
        printf("FAIL api: %s(%zu) -> %d (%s)\n", what, n, (int)e, cudaGetErrorString(e));
    cudaGetLastError();
}

static void verify_and_free(const Block &b, cudaStream_t s, int slot)
{
    char what[96];
    snprintf(what, sizeof what, "block of %zu bytes (kind %d, owner %d, freed by slot %d)", b.n,
             b.kind, b.owner, slot);
    unsigned long long bad = gt_verify(b.p, b.n, b.seed, s, slot, what);
    if (bad)
        g_data_errors.fetch_add(1);
    if (g_hook) {
        int o = gt_owns(b.p);
        if (o != (b.kind == KIND_MALLOC ? 1 : 0)) {
            if (g_owns_errors.fetch_add(1) < 5)
                printf("FAIL owns: vmm_owns(%s block) = %d before free\n",
                       b.kind == KIND_MALLOC ? "cudaMalloc" : "cudaMallocAsync", o);
        }
    }
    cudaError_t e;
    if (b.kind == KIND_MALLOC) {
        e = cudaFree(b.p);
        if (e != cudaSuccess)
            api_error("cudaFree", e, b.n);
        std::lock_guard<std::mutex> lk(g_addr_mu);
        g_addrs.push_back((uintptr_t)b.p);
    } else {
        e = cudaFreeAsync(b.p, s);
        if (e != cudaSuccess)
            api_error("cudaFreeAsync", e, b.n);
    }
    g_live_bytes.fetch_sub((long long)b.n);
    g_frees.fetch_add(1);
}

static void worker(int t, int ops)
{
    if (cudaSetDevice(0) != cudaSuccess) {
        api_error("cudaSetDevice", cudaGetLastError(), 0);
        return;
    }
    cudaStream_t s;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        api_error("cudaStreamCreate", cudaGetLastError(), 0);
        return;
    }
    const int slot = t + 1; /* slot 0 is the main thread's */
    uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)(t + 1);
    std::vector<Block> live;
    const size_t max_live = 48;
    uint64_t serial = 0;

    for (int op = 0; op < ops; op++) {
        /* Take a block another thread handed over, now and then. */
        if (rng_next(&rng) % 8 == 0) {
            Block b;
            bool got = false;
            {
                std::lock_guard<std::mutex> lk(g_mbox_mu);
                for (size_t i = 0; i < g_mbox.size(); i++)
                    if (g_mbox[i].owner != t) {
                        b = g_mbox[i];
                        g_mbox[i] = g_mbox.back();
                        g_mbox.pop_back();
                        got = true;
                        break;
                    }
            }
            if (got) {
                verify_and_free(b, s, slot);
                g_received.fetch_add(1);
            }
        }
        bool alloc = live.empty() || (live.size() < max_live && rng_next(&rng) % 100 < 55);
        if (alloc) {
            size_t n = pick_size(&rng);
            if (g_live_bytes.load() + (long long)n > g_cap) {
                g_refused.fetch_add(1);
                alloc = false;
            } else {
                Block b;
                b.n = n;
                b.kind = rng_next(&rng) % 100 < 15 ? KIND_ASYNC : KIND_MALLOC;
                b.owner = t;
                b.seed = ((uint64_t)t << 48) ^ (serial++ * 0x100000001B3ull) ^ 0x5EEDull;
                b.p = NULL;
                cudaError_t e =
                    b.kind == KIND_MALLOC ? cudaMalloc(&b.p, n) : cudaMallocAsync(&b.p, n, s);
                if (e != cudaSuccess || !b.p) {
                    api_error(b.kind == KIND_MALLOC ? "cudaMalloc" : "cudaMallocAsync", e, n);
                    continue;
                }
                /* cudaMalloc promises 256 bytes; the pattern kernels need 4 for any kind. */
                uintptr_t amask = b.kind == KIND_MALLOC ? 255 : 3;
                if (((uintptr_t)b.p & amask) != 0) {
                    if (g_align_errors.fetch_add(1) < 5)
                        printf("FAIL align: %zu-byte block (kind %d) at %p\n", n, b.kind, b.p);
                    if (b.kind == KIND_MALLOC)
                        cudaFree(b.p);
                    else
                        cudaFreeAsync(b.p, s);
                    continue;
                }
                if (g_hook) {
                    int o = gt_owns(b.p);
                    if (o != (b.kind == KIND_MALLOC ? 1 : 0) && g_owns_errors.fetch_add(1) < 5)
                        printf("FAIL owns: vmm_owns(new %s block of %zu) = %d\n",
                               b.kind == KIND_MALLOC ? "cudaMalloc" : "cudaMallocAsync", n, o);
                }
                gt_fill(b.p, n, b.seed, s);
                long long now = g_live_bytes.fetch_add((long long)n) + (long long)n;
                long long peak = g_peak_bytes.load();
                while (now > peak && !g_peak_bytes.compare_exchange_weak(peak, now)) {
                }
                live.push_back(b);
                g_allocs.fetch_add(1);
                if (b.kind == KIND_ASYNC)
                    g_async_allocs.fetch_add(1);
            }
        }
        if (!alloc && !live.empty()) {
            size_t i = rng_next(&rng) % live.size();
            Block b = live[i];
            live[i] = live.back();
            live.pop_back();
            if (rng_next(&rng) % 100 < 10) {
                /* Hand it over: its pattern must be written before another stream reads it. */
                cudaError_t e = cudaStreamSynchronize(s);
                if (e != cudaSuccess)
                    api_error("cudaStreamSynchronize", e, b.n);
                std::lock_guard<std::mutex> lk(g_mbox_mu);
                g_mbox.push_back(b);
                g_passed.fetch_add(1);
            } else {
                verify_and_free(b, s, slot);
            }
        }
    }
    for (const Block &b : live)
        verify_and_free(b, s, slot);
    cudaError_t e = cudaStreamSynchronize(s);
    if (e != cudaSuccess)
        api_error("cudaStreamSynchronize(end)", e, 0);
    cudaStreamDestroy(s);
}

int main(int argc, char **argv)
{
    gt_init("churn_mt");
    int threads = argc > 1 ? atoi(argv[1]) : 8;
    int ops = argc > 2 ? atoi(argv[2]) : 3000;
    long long cap_mib = argc > 3 ? atoll(argv[3]) : 4096;
    long long max_mib = argc > 4 ? atoll(argv[4]) : 256;
    if (threads < 1)
        threads = 1;
    if (threads > GT_SLOTS - 1)
        threads = GT_SLOTS - 1;
    g_cap = cap_mib * (long long)MiB;
    g_max_alloc = (size_t)max_mib * MiB;
    g_hook = gt_hooked();
    R("churn threads=%d ops_per_thread=%d cap_mib=%lld max_alloc_mib=%lld", threads, ops, cap_mib,
      max_mib);

    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> th;
    for (int t = 0; t < threads; t++)
        th.emplace_back(worker, t, ops);
    for (auto &x : th)
        x.join();
    /* Blocks still in the mailbox: their receivers finished first. */
    for (const Block &b : g_mbox)
        verify_and_free(b, 0, 0);
    g_mbox.clear();
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CK(cudaDeviceSynchronize());

    long long ops_done = g_allocs.load() + g_frees.load();
    INFO("churn: %lld allocs (%lld cudaMallocAsync), %lld frees, %lld handed over, %lld received, "
         "%lld refused by the cap, peak live %lld MiB, %.2f s, %.0f alloc+free ops/s",
         g_allocs.load(), g_async_allocs.load(), g_frees.load(), g_passed.load(), g_received.load(),
         g_refused.load(), g_peak_bytes.load() / (long long)MiB, secs, ops_done / secs);
    R("churn api_errors=%lld data_errors=%lld owns_errors=%lld align_errors=%lld live_after=%lld",
      g_api_errors.load(), g_data_errors.load(), g_owns_errors.load(), g_align_errors.load(),
      g_live_bytes.load());
    R("churn allocs_equal_frees=%d", g_allocs.load() == g_frees.load());
    CHECK(g_api_errors.load() == 0, "%lld API errors", g_api_errors.load());
    CHECK(g_data_errors.load() == 0, "%lld blocks with corrupted data", g_data_errors.load());
    CHECK(g_owns_errors.load() == 0, "%lld wrong vmm_owns answers", g_owns_errors.load());
    CHECK(g_align_errors.load() == 0, "%lld blocks not 256-aligned", g_align_errors.load());
    CHECK(g_allocs.load() == g_frees.load(), "allocs %lld != frees %lld", g_allocs.load(),
          g_frees.load());
    CHECK(g_passed.load() > 0 || ops < 100, "no block was handed between threads");

    /* Pool memory back to the driver, so only what the hook keeps could still be mapped. */
    cudaMemPool_t pool;
    if (CK(cudaDeviceGetDefaultMemPool(&pool, 0)) == 0)
        CK(cudaMemPoolTrimTo(pool, 0));
    /* Unique addresses only: the same address freed twice (reuse) is probed once. */
    std::vector<uintptr_t> &a = g_addrs;
    std::sort(a.begin(), a.end());
    a.erase(std::unique(a.begin(), a.end()), a.end());
    gt_leftover_check("churn", a.data(), a.size());
    return gt_finish();
}
