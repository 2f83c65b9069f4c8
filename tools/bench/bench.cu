/* bench: the allocation benchmark of issue 5.
 *
 * One binary, run twice by run-bench.sh on the same GPU:
 *   bench                  -> "native" (cudaMalloc/cudaFree) and "async" (cudaMallocAsync /
 *                             cudaFreeAsync on the device's default pool, release threshold
 *                             UINT64_MAX so the pool keeps its memory);
 *   LD_PRELOAD=libvmmhook.so bench --expect-hook
 *                          -> "hook": the same cudaMalloc/cudaFree calls, served by the hook
 *                             (detected with vmm_hook_available()), plus vmm_realloc growth.
 *
 * Workloads (each prints a human block, then machine lines "RESULT <impl>.<metric> <value>
 * <unit>"; combine.py joins the two runs into tables):
 *   a  isolated alloc+free pairs at 256 B, 64 KiB, 2 MiB, 64 MiB, 1 GiB: ns per pair, each pair
 *      timed alone with the steady clock; p10/p50/p90 over up to 20000 pairs (0.75 s cap each).
 *      The hook run measures them twice: first before the program has made any stream
 *      ("pair_nostream.*": frees are reused without a wait), then, like every workload, after
 *      the bench's stream exists ("pair.*": a free is reused only once the GPU has passed it).
 *   b  churn, 1 thread: 1000 live blocks, sizes drawn with a fixed seed from three classes,
 *      uniform inside each: 70% in [1 B, 64 KiB), 25% in [64 KiB, 8 MiB), 5% in [8 MiB,
 *      256 MiB) (about 7.6 GiB live). One step = free a random live block + allocate a new
 *      size into its slot. Batches of 500 steps; median us per step over batches; steps/s.
 *   c  churn, 16 threads. The total live set stays bounded at 1000 blocks: thread t keeps
 *      1000/16 blocks (63 or 62), its own seed, the same size classes, so live memory matches
 *      (b). All threads start each batch together; a batch is K steps per thread, K doubled
 *      in warm-up until a batch lasts >= 20 ms. Total steps/s (wall) and the ratio to (b).
 *      Async: one non-blocking stream per thread.
 *   d  memory: the (b) churn from a trimmed state (vmm_trim / cudaMemPoolTrimTo), untimed,
 *      fill + 4000 steps; device memory used is sampled (at each new peak of requested bytes,
 *      every 10 fill allocations and every 50 steps) as NVML's used bytes
 *      (libnvidia-ml.so.1, dlopen) minus a baseline taken before the workload; result = peak
 *      used / peak requested. Without NVML: cudaMemGetInfo (total - free), which under the
 *      hook does not count its idle cache (cuMemGetInfo reports it free): marked, not judged.
 *   e  growth by 2 MiB of 1, 8 and 64 GiB buffers: native copy-based grow (cudaMalloc new +
 *      cudaMemcpy D2D + cudaFree old + cudaDeviceSynchronize) in the plain run; vmm_realloc
 *      (+ cudaDeviceSynchronize) in the hook run. Each grow starts on an idle device (the
 *      previous one ended with a synchronize; the vmm side synchronizes again, untimed, just
 *      before its clock starts) with nothing else queued. One warm-up grow, reported apart as
 *      "first" and not counted, then p50 (with p10, p90, min) of several: 11/9/5 copies,
 *      31/31/25 vmm_realloc grows at 1/8/64 GiB. The copy at 64 GiB needs 128 GiB + 2 MiB
 *      live: skipped (and said so) if cudaMemGetInfo's free memory is short.
 *   f  pass-through cost, ns per call, median of 200 batches of 1000 calls:
 *      cuPointerGetAttribute(RANGE_SIZE) and cuMemGetAddressRange on a cudaMallocAsync pointer
 *      (entry points fetched with cudaGetDriverEntryPointByVersion, i.e. through
 *      cuGetProcAddress, the way cudart reaches the driver: the hook returns its wrappers,
 *      which look the pointer up in their registry and pass through); for information also
 *      cudaPointerGetAttributes on it, cudaFree(NULL) (cudart may answer it without the
 *      driver), dlsym(libcuda handle, "cuMemAlloc_v2") and dlsym(libc handle, "strlen")
 *      (the hook interposes dlsym), and the empty-loop floor of the timing itself.
 *
 * Options: --only a,b,... (workloads), --quick (smoke test: few repetitions), --expect-hook
 * (fail with exit 2 when the hook is not loaded), --check (only the GPU check), --device N.
 * Exit: 0 done (errors inside a workload are printed and give NA results), 77 no CUDA GPU,
 * 2 usage / hook expected but absent.
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "vmmhook.h"

namespace {

constexpr size_t KiB = 1024;
constexpr size_t MiB = 1024 * KiB;
constexpr size_t GiB = 1024 * MiB;

using clk = std::chrono::steady_clock;

double ns_between(clk::time_point a, clk::time_point b)
{
    return std::chrono::duration<double, std::nano>(b - a).count();
}

double s_since(clk::time_point a)
{
    return std::chrono::duration<double>(clk::now() - a).count();
}

struct CudaError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

void check(cudaError_t e, const char *what, int line)
{
    if (e != cudaSuccess) {
        char buf[512];
        snprintf(buf, sizeof buf, "%s (line %d): %s: %s", what, line, cudaGetErrorName(e),
                 cudaGetErrorString(e));
        cudaGetLastError(); /* clear a non-sticky error so that later workloads can run */
        throw CudaError(buf);
    }
}
#define CK(x) check((x), #x, __LINE__)

enum Impl { IMPL_NATIVE, IMPL_ASYNC, IMPL_HOOK, IMPL_COUNT };
const char *const impl_name[IMPL_COUNT] = {"native", "async", "hook"};

/* Options and process-wide state. */
struct Bench {
    int dev = 0;
    bool hook = false;
    bool quick = false;
    std::string only = "abcdef";
    cudaMemPool_t pool = nullptr;
    vmm_status (*vmm_realloc_fn)(void **, size_t) = nullptr;
    size_t (*vmm_trim_fn)(void) = nullptr;
    const char *(*vmm_status_string_fn)(vmm_status) = nullptr;
    double churn1_steps_per_s[IMPL_COUNT] = {NAN, NAN, NAN};
};

bool wants(const Bench &b, char w)
{
    return b.only.find(w) != std::string::npos;
}

void result(Impl impl, const std::string &metric, double v, const char *unit)
{
    printf("RESULT %s.%s %.6g %s\n", impl_name[impl], metric.c_str(), v, unit);
}

void result_na(Impl impl, const std::string &metric, const char *why)
{
    printf("RESULT %s.%s NA %s\n", impl_name[impl], metric.c_str(), why);
}

struct Stats {
    double min = NAN, p10 = NAN, p50 = NAN, p90 = NAN;
    size_t n = 0;
};

Stats stats_of(std::vector<double> v)
{
    Stats s;
    s.n = v.size();
    if (v.empty())
        return s;
    std::sort(v.begin(), v.end());
    auto q = [&](double f) {
        double idx = f * (double)(v.size() - 1);
        size_t i = (size_t)idx;
        size_t j = std::min(i + 1, v.size() - 1);
        return v[i] + (v[j] - v[i]) * (idx - (double)i);
    };
    s.min = v.front();
    s.p10 = q(0.10);
    s.p50 = q(0.50);
    s.p90 = q(0.90);
    return s;
}

/* One allocation interface for the three implementations. native and hook are the same calls:
 * which one runs depends on whether the process was started with the hook preloaded. */
struct Allocator {
    Impl impl;
    cudaStream_t stream;
    void *alloc(size_t n)
    {
        void *p = nullptr;
        if (impl == IMPL_ASYNC)
            CK(cudaMallocAsync(&p, n, stream));
        else
            CK(cudaMalloc(&p, n));
        return p;
    }
    void release(void *p)
    {
        if (impl == IMPL_ASYNC)
            CK(cudaFreeAsync(p, stream));
        else
            CK(cudaFree(p));
    }
    void sync()
    {
        if (impl == IMPL_ASYNC)
            CK(cudaStreamSynchronize(stream));
    }
};

/* Everything idle goes back: the async pool to 0 bytes kept, the hook's cache via vmm_trim. */
void trim_all(Bench &b)
{
    CK(cudaDeviceSynchronize());
    if (b.pool)
        CK(cudaMemPoolTrimTo(b.pool, 0));
    if (b.vmm_trim_fn)
        b.vmm_trim_fn();
    CK(cudaDeviceSynchronize());
}

/* ---- NVML: device memory used, as nvidia-smi shows it ------------------------------------ */

struct NvmlMemory {
    unsigned long long total, free, used;
};

struct MemProbe {
    void *dev = nullptr;
    int (*get_info)(void *, NvmlMemory *) = nullptr;
    bool nvml = false;
    std::string why_not;

    void open(int cuda_dev)
    {
        void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            why_not = "libnvidia-ml.so.1 not loadable";
            return;
        }
        auto init = (int (*)(void))dlsym(lib, "nvmlInit_v2");
        auto by_pci = (int (*)(const char *, void **))dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2");
        get_info = (int (*)(void *, NvmlMemory *))dlsym(lib, "nvmlDeviceGetMemoryInfo");
        if (!init || !by_pci || !get_info) {
            why_not = "NVML symbols missing";
            return;
        }
        char bus[64] = {0};
        if (cudaDeviceGetPCIBusId(bus, sizeof bus, cuda_dev) != cudaSuccess) {
            why_not = "cudaDeviceGetPCIBusId failed";
            return;
        }
        int rc = init();
        if (rc != 0) {
            why_not = "nvmlInit_v2 returned " + std::to_string(rc);
            return;
        }
        rc = by_pci(bus, &dev);
        if (rc != 0) {
            why_not = std::string("nvmlDeviceGetHandleByPciBusId_v2(") + bus + ") returned " +
                      std::to_string(rc);
            return;
        }
        NvmlMemory m;
        if (get_info(dev, &m) != 0) {
            why_not = "nvmlDeviceGetMemoryInfo failed";
            return;
        }
        nvml = true;
    }

    /* Bytes in use on the device (all processes, as nvidia-smi). */
    long long used()
    {
        if (nvml) {
            NvmlMemory m;
            if (get_info(dev, &m) == 0)
                return (long long)m.used;
        }
        size_t fr = 0, tot = 0;
        CK(cudaMemGetInfo(&fr, &tot));
        return (long long)(tot - fr);
    }

    const char *source() const { return nvml ? "nvml" : "cudaMemGetInfo"; }
};

MemProbe g_probe;

/* ---- the churn workload's random sizes ---------------------------------------------------- */

constexpr int kLive = 1000;
constexpr uint64_t kSeed = 0x5eed20261202ull;

struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed) {}
    uint64_t next() /* splitmix64 */
    {
        uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    size_t range(size_t lo, size_t hi) { return lo + (size_t)(next() % (hi - lo)); } /* [lo, hi) */
    size_t churn_size()
    {
        uint64_t c = next() % 100;
        if (c < 70)
            return range(1, 64 * KiB);
        if (c < 95)
            return range(64 * KiB, 8 * MiB);
        return range(8 * MiB, 256 * MiB);
    }
};

struct LiveSet {
    std::vector<void *> p;
    std::vector<size_t> s;
    size_t requested = 0;
    explicit LiveSet(int n) : p(n, nullptr), s(n, 0) {}
    void fill_one(Allocator &a, Rng &r, int i)
    {
        size_t n = r.churn_size();
        p[i] = a.alloc(n);
        s[i] = n;
        requested += n;
    }
    void step(Allocator &a, Rng &r)
    {
        int i = (int)(r.next() % p.size());
        a.release(p[i]);
        p[i] = nullptr;
        requested -= s[i];
        fill_one(a, r, i);
    }
    /* Best effort, for the end of a workload and for error paths: never throws. */
    void free_all(Allocator &a) noexcept
    {
        for (size_t i = 0; i < p.size(); ++i) {
            if (p[i]) {
                try {
                    a.release(p[i]);
                } catch (const CudaError &e) {
                    fprintf(stderr, "bench: cleanup: %s\n", e.what());
                }
                p[i] = nullptr;
                requested -= s[i];
            }
        }
        try {
            a.sync();
        } catch (const CudaError &) {
        }
    }
};

/* ---- (a) isolated pairs ------------------------------------------------------------------- */

void work_pairs(Bench &b, Allocator &a, const char *prefix = "pair.")
{
    const size_t sizes[] = {256, 64 * KiB, 2 * MiB, 64 * MiB, 1 * GiB};
    const char *names[] = {"256B", "64KiB", "2MiB", "64MiB", "1GiB"};
    const int max_reps = b.quick ? 200 : 20000;
    const double cap_s = b.quick ? 0.1 : 0.75;
    printf("## (a) isolated alloc+free pair [%s], ns per pair\n", impl_name[a.impl]);
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; ++k) {
        const std::string m = std::string(prefix) + names[k];
        try {
            for (int i = 0; i < 10; ++i) /* warm-up: the pool / the cache fill here */
                a.release(a.alloc(sizes[k]));
            a.sync();
            std::vector<double> ns;
            ns.reserve(max_reps);
            const auto start = clk::now();
            for (int r = 0; r < max_reps; ++r) {
                const auto t0 = clk::now();
                void *p = a.alloc(sizes[k]);
                a.release(p);
                const auto t1 = clk::now();
                ns.push_back(ns_between(t0, t1));
                if ((r & 63) == 63) {
                    a.sync(); /* untimed: keeps the async stream's queue short */
                    if (s_since(start) > cap_s)
                        break;
                }
            }
            a.sync();
            Stats st = stats_of(ns);
            printf("  %-6s p10 %10.0f  p50 %10.0f  p90 %10.0f ns   (n=%zu)\n", names[k], st.p10,
                   st.p50, st.p90, st.n);
            result(a.impl, m + ".p50", st.p50, "ns");
            result(a.impl, m + ".p10", st.p10, "ns");
            result(a.impl, m + ".p90", st.p90, "ns");
            result(a.impl, m + ".n", (double)st.n, "pairs");
        } catch (const CudaError &e) {
            printf("  %-6s ERROR %s\n", names[k], e.what());
            result_na(a.impl, m + ".p50", "error");
        }
    }
}

/* ---- the hook's own counters (vmm_stats_json), for the steady state's cost ---------------- */

/* Counters of the loaded hook read through vmm_stats_json (all zero without it). */
struct HookCounters {
    double driver_calls = 0, background = 0, allocs = 0, blocking = 0;
};

static double json_counter(const char *json, const char *name)
{
    char key[96];
    snprintf(key, sizeof key, "\"%s\": ", name);
    const char *at = strstr(json, key);
    return at ? strtod(at + strlen(key), nullptr) : 0.0;
}

static HookCounters hook_counters()
{
    HookCounters c;
    typedef int (*json_fn)(char *, size_t);
    json_fn fn = (json_fn)dlsym(RTLD_DEFAULT, "vmm_stats_json");
    if (!fn)
        return c;
    std::vector<char> buf(1 << 16);
    int n = fn(buf.data(), buf.size());
    if (n < 0 || (size_t)n >= buf.size())
        return c;
    c.driver_calls = json_counter(buf.data(), "driver_calls");
    c.background = json_counter(buf.data(), "driver_calls_background");
    c.allocs = json_counter(buf.data(), "served_allocs");
    c.blocking = json_counter(buf.data(), "syncs_blocking");
    return c;
}

/* RESULT hook.<w>.app_calls_per_alloc and .blocking_syncs_per_1000: the driver calls the
 * program's threads paid per served allocation between a and b (the reclaim thread's apart). */
static void report_hook_cost(const char *w, const HookCounters &a, const HookCounters &b)
{
    const double allocs = b.allocs - a.allocs;
    if (allocs <= 0)
        return;
    const double app = (b.driver_calls - b.background) - (a.driver_calls - a.background);
    printf("  hook: %.4f driver calls per allocation on the program's threads, %.2f blocking "
           "syncs per 1000 allocations\n",
           app / allocs, (b.blocking - a.blocking) * 1000.0 / allocs);
    result(IMPL_HOOK, std::string(w) + ".app_calls_per_alloc", app / allocs, "calls");
    result(IMPL_HOOK, std::string(w) + ".blocking_syncs_per_1000", (b.blocking - a.blocking) * 1000.0 / allocs,
           "syncs");
}

/* ---- (b) churn, one thread ---------------------------------------------------------------- */

void work_churn1(Bench &b, Allocator &a)
{
    const int K = 500, warm = 2, max_batches = b.quick ? 3 : 30;
    const double cap_s = b.quick ? 1.0 : 6.0;
    printf("## (b) churn, 1 thread, %d live blocks [%s]\n", kLive, impl_name[a.impl]);
    Rng r(kSeed);
    LiveSet L(kLive);
    try {
        for (int i = 0; i < kLive; ++i)
            L.fill_one(a, r, i);
        a.sync();
        std::vector<double> us;
        const auto start = clk::now();
        HookCounters c0, c1;
        for (int bt = 0; bt < warm + max_batches; ++bt) {
            if (bt == warm && a.impl == IMPL_HOOK)
                c0 = hook_counters();
            const auto t0 = clk::now();
            for (int k = 0; k < K; ++k)
                L.step(a, r);
            const auto t1 = clk::now();
            a.sync();
            if (bt >= warm)
                us.push_back(ns_between(t0, t1) / K / 1e3);
            if (us.size() >= 3 && s_since(start) > cap_s)
                break;
        }
        if (a.impl == IMPL_HOOK) {
            c1 = hook_counters();
            report_hook_cost("churn1", c0, c1);
        }
        Stats st = stats_of(us);
        const double sps = 1e6 / st.p50;
        b.churn1_steps_per_s[a.impl] = sps;
        printf("  %.2f us per step (p10 %.2f, p90 %.2f; %zu batches of %d), %.0f steps/s, "
               "%.2f GiB requested live at end\n",
               st.p50, st.p10, st.p90, st.n, K, sps, (double)L.requested / GiB);
        result(a.impl, "churn1.us_per_step.p50", st.p50, "us");
        result(a.impl, "churn1.us_per_step.p10", st.p10, "us");
        result(a.impl, "churn1.us_per_step.p90", st.p90, "us");
        result(a.impl, "churn1.steps_per_s", sps, "steps/s");
    } catch (const CudaError &e) {
        printf("  ERROR %s\n", e.what());
        result_na(a.impl, "churn1.steps_per_s", "error");
    }
    L.free_all(a);
}

/* ---- (c) churn, 16 threads ---------------------------------------------------------------- */

constexpr int kThreads = 16;

struct Gate {
    std::mutex m;
    std::condition_variable go, done;
    int gen = 0, pending = 0, ready = 0, steps = 0;
    bool stop = false;
    std::string err;
};

void churn_worker(int t, int dev, Impl impl, cudaStream_t stream, Gate *g)
{
    int nlive = kLive / kThreads + (t < kLive % kThreads ? 1 : 0);
    Allocator a{impl, stream};
    Rng r(kSeed + 1 + (uint64_t)t);
    LiveSet L(nlive);
    std::string err;
    try {
        CK(cudaSetDevice(dev));
        for (int i = 0; i < nlive; ++i)
            L.fill_one(a, r, i);
        a.sync();
    } catch (const CudaError &e) {
        err = e.what();
    }
    {
        std::lock_guard<std::mutex> lk(g->m);
        g->ready++;
        if (!err.empty() && g->err.empty())
            g->err = err;
    }
    g->done.notify_all();
    int seen = 0;
    for (;;) {
        int steps;
        {
            std::unique_lock<std::mutex> lk(g->m);
            g->go.wait(lk, [&] { return g->gen != seen || g->stop; });
            if (g->stop)
                break;
            seen = g->gen;
            steps = g->steps;
        }
        if (err.empty()) {
            try {
                for (int k = 0; k < steps; ++k)
                    L.step(a, r);
                a.sync();
            } catch (const CudaError &e) {
                err = e.what();
            }
        }
        bool last;
        {
            std::lock_guard<std::mutex> lk(g->m);
            if (!err.empty() && g->err.empty())
                g->err = err;
            last = --g->pending == 0;
        }
        if (last)
            g->done.notify_all();
    }
    L.free_all(a);
}

void work_churn16(Bench &b, Impl impl)
{
    printf("## (c) churn, %d threads, %d live blocks in all [%s]\n", kThreads, kLive,
           impl_name[impl]);
    std::vector<cudaStream_t> streams(kThreads, nullptr);
    Gate g;
    std::vector<std::thread> th;
    try {
        if (impl == IMPL_ASYNC)
            for (auto &s : streams)
                CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    } catch (const CudaError &e) {
        printf("  ERROR %s\n", e.what());
        result_na(impl, "churn16.steps_per_s", "error");
        return;
    }
    for (int t = 0; t < kThreads; ++t)
        th.emplace_back(churn_worker, t, b.dev, impl, streams[t], &g);
    {
        std::unique_lock<std::mutex> lk(g.m);
        g.done.wait(lk, [&] { return g.ready == kThreads; });
    }
    /* One batch: all threads released together, timed until the last one is done. */
    auto batch = [&](int k) -> double {
        std::unique_lock<std::mutex> lk(g.m);
        g.pending = kThreads;
        g.steps = k;
        g.gen++;
        const auto t0 = clk::now();
        g.go.notify_all();
        g.done.wait(lk, [&] { return g.pending == 0; });
        return std::chrono::duration<double>(clk::now() - t0).count();
    };
    std::vector<double> sps;
    int K = 64;
    const int max_batches = b.quick ? 3 : 10;
    const double cap_s = b.quick ? 1.5 : 8.0;
    const auto start = clk::now();
    if (g.err.empty()) {
        for (int i = 0; i < 12 && g.err.empty(); ++i) { /* warm-up and calibration */
            double dt = batch(K);
            if (dt >= 0.02 || K >= 16384 || s_since(start) > cap_s / 2)
                break;
            K *= 2;
        }
        for (int i = 0; i < max_batches && g.err.empty(); ++i) {
            double dt = batch(K);
            sps.push_back((double)K * kThreads / dt);
            if (sps.size() >= 3 && s_since(start) > cap_s)
                break;
        }
    }
    {
        std::lock_guard<std::mutex> lk(g.m);
        g.stop = true;
    }
    g.go.notify_all();
    for (auto &t : th)
        t.join();
    for (auto &s : streams)
        if (s)
            cudaStreamDestroy(s);
    if (!g.err.empty()) {
        printf("  ERROR %s\n", g.err.c_str());
        result_na(impl, "churn16.steps_per_s", "error");
        return;
    }
    Stats st = stats_of(sps);
    const double one = b.churn1_steps_per_s[impl];
    printf("  %.0f steps/s in all (p10 %.0f, p90 %.0f; %zu batches of %d steps x %d threads); "
           "1 thread: %.0f steps/s; scaling %.2fx\n",
           st.p50, st.p10, st.p90, st.n, K, kThreads, one, st.p50 / one);
    result(impl, "churn16.steps_per_s", st.p50, "steps/s");
    result(impl, "churn16.steps_per_s.p10", st.p10, "steps/s");
    result(impl, "churn16.steps_per_s.p90", st.p90, "steps/s");
    if (std::isfinite(one))
        result(impl, "churn16.scaling", st.p50 / one, "x");
    else
        result_na(impl, "churn16.scaling", "no-single-thread-result");
}

/* ---- (d) memory used over memory requested ------------------------------------------------ */

void work_memory(Bench &b, Allocator &a)
{
    const int steps = b.quick ? 500 : 4000;
    printf("## (d) peak device memory used / peak requested, churn of (b) [%s], source %s%s\n",
           impl_name[a.impl], g_probe.source(),
           (!g_probe.nvml && a.impl == IMPL_HOOK) ? " (hook's idle cache counted as free: "
                                                    "not judged)"
                                                  : "");
    if (!g_probe.nvml)
        printf("  NVML unavailable: %s\n", g_probe.why_not.c_str());
    Rng r(kSeed);
    LiveSet L(kLive);
    try {
        trim_all(b);
        const long long base = g_probe.used();
        long long peak_used = 0;
        size_t peak_req = 0;
        int samples = 0;
        auto sample = [&] {
            peak_used = std::max(peak_used, g_probe.used() - base);
            samples++;
        };
        for (int i = 0; i < kLive; ++i) {
            L.fill_one(a, r, i);
            bool new_peak = L.requested > peak_req;
            peak_req = std::max(peak_req, L.requested);
            if (i % 10 == 9 || (new_peak && i >= kLive - 10))
                sample();
        }
        const auto start = clk::now();
        int done = 0;
        for (int k = 0; k < steps; ++k, ++done) {
            if ((k & 255) == 255 && s_since(start) > (b.quick ? 2.0 : 10.0))
                break; /* a time cap, for a pathologically slow allocator */
            L.step(a, r);
            if (L.requested > peak_req) {
                peak_req = L.requested;
                sample();
            } else if (k % 50 == 49) {
                sample();
            }
        }
        sample();
        const double ratio = (double)peak_used / (double)peak_req;
        printf("  peak used %.1f MiB over peak requested %.1f MiB = %.3f (%d steps, %d samples, "
               "baseline %.1f MiB)\n",
               (double)peak_used / MiB, (double)peak_req / MiB, ratio, done, samples,
               (double)base / MiB);
        result(a.impl, "mem.ratio", ratio, g_probe.source());
        result(a.impl, "mem.peak_used_MiB", (double)peak_used / MiB, "MiB");
        result(a.impl, "mem.peak_requested_MiB", (double)peak_req / MiB, "MiB");
    } catch (const CudaError &e) {
        printf("  ERROR %s\n", e.what());
        result_na(a.impl, "mem.ratio", "error");
    }
    L.free_all(a);
    try {
        trim_all(b);
    } catch (const CudaError &) {
    }
}

/* ---- (e) growth by 2 MiB ------------------------------------------------------------------ */

struct GrowCase {
    size_t size;
    const char *name;
    int copy_reps, vmm_reps;
};
const GrowCase grow_cases[] = {
    {1 * GiB, "1GiB", 11, 31},
    {8 * GiB, "8GiB", 9, 31},
    {64 * GiB, "64GiB", 5, 25},
};

void report_grow(Impl impl, const char *what, const GrowCase &gc, double first_us,
                 const std::vector<double> &us)
{
    Stats st = stats_of(us);
    printf("  %-6s %s: p50 %10.1f us (min %.1f, p10 %.1f, p90 %.1f, n=%zu; first %.1f us)\n",
           gc.name, what, st.p50, st.min, st.p10, st.p90, st.n, first_us);
    std::string m = std::string("grow.") + gc.name + "." + what;
    result(impl, m + ".p50", st.p50, "us");
    result(impl, m + ".p90", st.p90, "us");
    result(impl, m + ".min", st.min, "us");
    result(impl, m + ".first", first_us, "us");
}

void work_grow_copy(Bench &b)
{
    printf("## (e) grow by 2 MiB: cudaMalloc(new) + cudaMemcpy D2D + cudaFree(old) [native]\n");
    for (const GrowCase &gc : grow_cases) {
        const int reps = b.quick ? 2 : gc.copy_reps;
        const std::string m = std::string("grow.") + gc.name + ".copy.p50";
        void *p = nullptr;
        try {
            trim_all(b);
            size_t fr = 0, tot = 0;
            CK(cudaMemGetInfo(&fr, &tot));
            const size_t need = 2 * gc.size + (size_t)(2 * reps + 4) * 2 * MiB + 512 * MiB;
            if (fr < need) {
                printf("  %-6s copy: SKIPPED: needs %.1f GiB free (old + new buffer), %.1f GiB "
                       "free of %.1f GiB\n",
                       gc.name, (double)need / GiB, (double)fr / GiB, (double)tot / GiB);
                result_na(IMPL_NATIVE, m, "skipped-does-not-fit");
                continue;
            }
            size_t cur = gc.size;
            CK(cudaMalloc(&p, cur));
            CK(cudaMemset(p, 0x5a, cur));
            CK(cudaDeviceSynchronize());
            double first = NAN;
            std::vector<double> us;
            for (int i = 0; i <= reps; ++i) {
                const auto t0 = clk::now();
                void *q = nullptr;
                CK(cudaMalloc(&q, cur + 2 * MiB));
                CK(cudaMemcpy(q, p, cur, cudaMemcpyDeviceToDevice));
                CK(cudaFree(p));
                p = q;
                CK(cudaDeviceSynchronize());
                const auto t1 = clk::now();
                cur += 2 * MiB;
                const double t_us = ns_between(t0, t1) / 1e3;
                if (i == 0)
                    first = t_us; /* warm-up grow, reported apart */
                else
                    us.push_back(t_us);
            }
            report_grow(IMPL_NATIVE, "copy", gc, first, us);
        } catch (const CudaError &e) {
            printf("  %-6s copy: ERROR %s\n", gc.name, e.what());
            result_na(IMPL_NATIVE, m, "error");
        }
        if (p)
            cudaFree(p);
    }
}

void work_grow_vmm(Bench &b)
{
    printf("## (e) grow by 2 MiB: vmm_realloc [hook]\n");
    auto vr = [&](void **p, size_t n) {
        vmm_status st = b.vmm_realloc_fn(p, n);
        if (st != VMM_OK) {
            char buf[256];
            snprintf(buf, sizeof buf, "vmm_realloc(%zu bytes): %s", n,
                     b.vmm_status_string_fn ? b.vmm_status_string_fn(st) : "error");
            throw CudaError(buf);
        }
    };
    for (const GrowCase &gc : grow_cases) {
        const int reps = b.quick ? 2 : gc.vmm_reps;
        const std::string m = std::string("grow.") + gc.name + ".vmm.p50";
        void *p = nullptr;
        try {
            trim_all(b);
            size_t fr = 0, tot = 0;
            CK(cudaMemGetInfo(&fr, &tot));
            const size_t need = gc.size + (size_t)(reps + 4) * 2 * MiB + 512 * MiB;
            if (fr < need) {
                printf("  %-6s vmm: SKIPPED: needs %.1f GiB free, %.1f GiB free\n", gc.name,
                       (double)need / GiB, (double)fr / GiB);
                result_na(IMPL_HOOK, m, "skipped-does-not-fit");
                continue;
            }
            size_t cur = gc.size;
            vr(&p, cur);
            CK(cudaMemset(p, 0x5a, cur));
            CK(cudaDeviceSynchronize());
            double first = NAN;
            std::vector<double> us;
            for (int i = 0; i <= reps; ++i) {
                CK(cudaDeviceSynchronize()); /* idle device, nothing queued: untimed */
                const auto t0 = clk::now();
                vr(&p, cur + 2 * MiB);
                CK(cudaDeviceSynchronize());
                const auto t1 = clk::now();
                cur += 2 * MiB;
                const double t_us = ns_between(t0, t1) / 1e3;
                if (i == 0)
                    first = t_us; /* warm-up grow, reported apart */
                else
                    us.push_back(t_us);
            }
            report_grow(IMPL_HOOK, "vmm", gc, first, us);
        } catch (const CudaError &e) {
            printf("  %-6s vmm: ERROR %s\n", gc.name, e.what());
            result_na(IMPL_HOOK, m, "error");
        }
        if (p)
            b.vmm_realloc_fn(&p, 0);
    }
    try {
        trim_all(b);
    } catch (const CudaError &) {
    }
}

/* ---- (f) pass-through --------------------------------------------------------------------- */

__attribute__((noinline)) int empty_call(void *) /* the timing floor */
{
    asm volatile("" ::: "memory");
    return 0;
}

template <class F> Stats time_calls(F f, bool quick)
{
    const int per = 1000, batches = quick ? 20 : 200;
    for (int i = 0; i < per; ++i)
        f();
    std::vector<double> ns;
    const auto start = clk::now();
    for (int bt = 0; bt < batches; ++bt) {
        const auto t0 = clk::now();
        for (int i = 0; i < per; ++i)
            f();
        const auto t1 = clk::now();
        ns.push_back(ns_between(t0, t1) / per);
        if (bt >= 10 && s_since(start) > 2.0) /* a time cap, for a slow call */
            break;
    }
    return stats_of(ns);
}

void work_passthrough(Bench &b, Impl impl)
{
    printf("## (f) pass-through calls [%s], ns per call\n", impl_name[impl]);
    typedef CUresult (*ptr_attr_t)(void *, CUpointer_attribute, CUdeviceptr);
    typedef CUresult (*addr_range_t)(CUdeviceptr *, size_t *, CUdeviceptr);
    void *ap = nullptr;
    cudaStream_t s = nullptr;
    try {
        ptr_attr_t ptr_attr = nullptr;
        addr_range_t addr_range = nullptr;
        cudaDriverEntryPointQueryResult q1, q2;
        CK(cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", (void **)&ptr_attr, 12000,
                                            cudaEnableDefault, &q1));
        CK(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", (void **)&addr_range, 12000,
                                            cudaEnableDefault, &q2));
        if (q1 != cudaDriverEntryPointSuccess || q2 != cudaDriverEntryPointSuccess || !ptr_attr ||
            !addr_range)
            throw CudaError("driver entry points not found");
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        CK(cudaMallocAsync(&ap, 1 * MiB, s));
        CK(cudaStreamSynchronize(s));
        const CUdeviceptr dp = (CUdeviceptr)(uintptr_t)ap + 4096; /* an interior pointer */
        size_t range = 0;
        CUdeviceptr base = 0;
        if (ptr_attr(&range, CU_POINTER_ATTRIBUTE_RANGE_SIZE, dp) != CUDA_SUCCESS ||
            range != 1 * MiB)
            throw CudaError("cuPointerGetAttribute(RANGE_SIZE) on a cudaMallocAsync block did "
                            "not answer its size");
        if (addr_range(&base, &range, dp) != CUDA_SUCCESS || base != (CUdeviceptr)(uintptr_t)ap ||
            range != 1 * MiB)
            throw CudaError("cuMemGetAddressRange on a cudaMallocAsync block did not answer it");

        void *libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
        int bad = 0;
        auto row = [&](const char *name, const char *metric, Stats st) {
            printf("  %-44s p50 %8.1f ns (p10 %.1f, p90 %.1f)\n", name, st.p50, st.p10, st.p90);
            result(impl, std::string("pass.") + metric, st.p50, "ns");
        };
        int (*volatile empty)(void *) = empty_call; /* an opaque pointer, like the others */
        row("(floor: empty call through a pointer)", "floor",
            time_calls([&] { bad |= empty(ap); }, b.quick));
        row("cuPointerGetAttribute(RANGE_SIZE, async ptr)", "cuPointerGetAttribute",
            time_calls([&] { bad |= ptr_attr(&range, CU_POINTER_ATTRIBUTE_RANGE_SIZE, dp); },
                       b.quick));
        row("cuMemGetAddressRange(async ptr)", "cuMemGetAddressRange",
            time_calls([&] { bad |= addr_range(&base, &range, dp); }, b.quick));
        cudaPointerAttributes pa;
        row("cudaPointerGetAttributes(async ptr)", "cudaPointerGetAttributes",
            time_calls([&] { bad |= cudaPointerGetAttributes(&pa, (void *)dp); }, b.quick));
        row("cudaFree(NULL)", "cudaFree_NULL", time_calls([&] { bad |= cudaFree(nullptr); }, b.quick));
        if (libcuda)
            row("dlsym(libcuda, \"cuMemAlloc_v2\")", "dlsym_libcuda",
                time_calls([&] { bad |= dlsym(libcuda, "cuMemAlloc_v2") == nullptr; }, b.quick));
        else
            result_na(impl, "pass.dlsym_libcuda", "libcuda.so.1-not-loaded");
        if (libc)
            row("dlsym(libc, \"strlen\")", "dlsym_libc",
                time_calls([&] { bad |= dlsym(libc, "strlen") == nullptr; }, b.quick));
        else
            result_na(impl, "pass.dlsym_libc", "libc.so.6-not-found");
        if (bad)
            printf("  WARNING: some timed call returned an error (results still printed)\n");
    } catch (const CudaError &e) {
        printf("  ERROR %s\n", e.what());
        result_na(impl, "pass.cuPointerGetAttribute", "error");
    }
    if (ap)
        cudaFreeAsync(ap, s);
    if (s) {
        cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
    }
}

int usage()
{
    fprintf(stderr, "usage: bench [--only abcdef] [--quick] [--expect-hook] [--check] [--device N]\n");
    return 2;
}

} // namespace

int main(int argc, char **argv)
{
    setvbuf(stdout, nullptr, _IOLBF, 0);
    Bench b;
    bool expect_hook = false, check_only = false;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--only" && i + 1 < argc)
            b.only = argv[++i];
        else if (a == "--quick")
            b.quick = true;
        else if (a == "--expect-hook")
            expect_hook = true;
        else if (a == "--check")
            check_only = true;
        else if (a == "--device" && i + 1 < argc)
            b.dev = atoi(argv[++i]);
        else
            return usage();
    }

    b.hook = vmm_hook_available() != 0;
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("SKIP bench: no CUDA GPU found (cudaGetDeviceCount: %s)\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 77;
    }
    if (b.dev < 0 || b.dev >= ndev) {
        fprintf(stderr, "bench: --device %d: only %d device(s)\n", b.dev, ndev);
        return 2;
    }
    if (expect_hook && !b.hook) {
        fprintf(stderr, "bench: --expect-hook: libvmmhook is not loaded in this process "
                        "(vmm_realloc not found): check the LD_PRELOAD path\n");
        return 2;
    }
    if (check_only) {
        printf("bench: %d CUDA device(s); hook %s\n", ndev, b.hook ? "loaded" : "not loaded");
        return 0;
    }

    const auto t_start = clk::now();
    try {
        CK(cudaSetDevice(b.dev));
        CK(cudaFree(nullptr)); /* create the context outside every timed region */
        cudaDeviceProp prop;
        CK(cudaGetDeviceProperties(&prop, b.dev));
        int drv = 0, rt = 0, pools = 0;
        cudaDriverGetVersion(&drv);
        cudaRuntimeGetVersion(&rt);
        cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, b.dev);
        size_t fr = 0, tot = 0;
        CK(cudaMemGetInfo(&fr, &tot));
        printf("INFO run %s\n", b.hook ? "hook" : "native+async");
        printf("INFO gpu %s\n", prop.name);
        printf("INFO memory_total_GiB %.1f\n", (double)tot / GiB);
        printf("INFO cuda_driver %d\n", drv);
        printf("INFO cuda_runtime %d\n", rt);
        if (b.hook) {
            auto ver = (int (*)(void))vmm_fn("vmm_version");
            printf("INFO vmmhook_version %d\n", ver ? ver() : -1);
            b.vmm_realloc_fn = (vmm_status(*)(void **, size_t))vmm_fn("vmm_realloc");
            b.vmm_trim_fn = (size_t(*)(void))vmm_fn("vmm_trim");
            b.vmm_status_string_fn = (const char *(*)(vmm_status))vmm_fn("vmm_status_string");
            static const char *const vars[] = {"VMMHOOK_GRANULARITY", "VMMHOOK_CACHE_LIMIT",
                                               "VMMHOOK_PACK_BELOW", "VMMHOOK_HEADROOM",
                                               "VMMHOOK_FREE_SYNC", "VMMHOOK_DISABLE"};
            for (const char *v : vars)
                if (getenv(v))
                    printf("INFO env %s=%s\n", v, getenv(v));
        }
        if (!pools) {
            printf("SKIP bench: device %d does not support cudaMallocAsync pools\n", b.dev);
            return 77;
        }
        CK(cudaDeviceGetDefaultMemPool(&b.pool, b.dev));
        uint64_t keep = UINT64_MAX; /* the warm pool keeps everything it ever held */
        CK(cudaMemPoolSetAttribute(b.pool, cudaMemPoolAttrReleaseThreshold, &keep));
        g_probe.open(b.dev);
        printf("INFO memory_source %s%s%s\n", g_probe.source(), g_probe.nvml ? "" : " ",
               g_probe.nvml ? "" : g_probe.why_not.c_str());
    } catch (const CudaError &ex) {
        printf("bench: setup failed: %s\n", ex.what());
        return 1;
    }

    /* The hook's pairs once more before the program has made a stream of its own (results
     * "pair_nostream.*"): until then every queued work runs in one order, and a free is reused
     * without a wait (reclaim.h's one-queue rule); the stream below ends that for the rest. */
    if (b.hook && wants(b, 'a')) {
        Allocator h{IMPL_HOOK, nullptr};
        printf("(pairs before the program has made a stream)\n");
        work_pairs(b, h, "pair_nostream.");
    }
    cudaStream_t stream = nullptr;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
        printf("bench: cudaStreamCreate failed\n");
        return 1;
    }
    std::vector<Allocator> impls;
    if (b.hook)
        impls.push_back({IMPL_HOOK, nullptr});
    else {
        impls.push_back({IMPL_NATIVE, nullptr});
        impls.push_back({IMPL_ASYNC, stream});
    }
    auto trim = [&] {
        try {
            trim_all(b);
        } catch (const CudaError &ex) {
            printf("bench: trim: %s\n", ex.what());
        }
    };

    if (wants(b, 'a'))
        for (auto &a : impls) {
            work_pairs(b, a);
            trim();
        }
    if (wants(b, 'b') || wants(b, 'c'))
        for (auto &a : impls) {
            work_churn1(b, a);
            trim();
        }
    if (wants(b, 'c'))
        for (auto &a : impls) {
            work_churn16(b, a.impl);
            trim();
        }
    if (wants(b, 'd'))
        for (auto &a : impls)
            work_memory(b, a);
    if (wants(b, 'e')) {
        if (b.hook)
            work_grow_vmm(b);
        else
            work_grow_copy(b);
    }
    if (wants(b, 'f'))
        work_passthrough(b, b.hook ? IMPL_HOOK : IMPL_NATIVE);

    cudaStreamDestroy(stream);
    printf("INFO elapsed_s %.1f\n", s_since(t_start));
    return 0;
}
