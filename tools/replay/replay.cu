/* replay: replays an allocation trace in RMM's logging_resource_adaptor CSV
 *
 *   Thread,Time,Action,Pointer,Size,Stream
 *   140573312345856,15:47:02.841961,allocate,0x10012400000,1048576,0x0
 *   140573312345856,15:47:02.841977,free,0x10012400000,1048576,0x0
 *
 * against native cudaMalloc/cudaFree and cudaMallocAsync/cudaFreeAsync (warm pool: release
 * threshold UINT64_MAX) in a plain run, or against the hook when run under
 * LD_PRELOAD=libvmmhook.so (detected with vmm_hook_available()); it prints the time and the
 * peak device memory of each.
 *
 *   replay [--parse-only] [--repeat N] [--impl native,async] [--no-memory] TRACE.csv
 *
 * Parsing (also --parse-only, which needs no GPU): the header names the columns (any order;
 * without a header the order above is assumed); actions "allocate", "free" (or "deallocate"),
 * "allocate failure" (counted, not replayed); pointers are hex ("0x..", "(nil)"). Each trace
 * pointer maps to a replay slot while live: a free of a pointer that is not live is counted
 * and skipped; an allocate of a pointer still live first frees the older block (counted).
 * Blocks still live at the end of the trace are freed after the timed region.
 *
 * Replay: events in file order, on one thread (the trace's threads are counted, not
 * re-created), streams ignored (async uses one non-blocking stream). Timed passes: the
 * steady clock around the whole loop plus a final device synchronize; median of --repeat
 * (default 3) passes. Memory pass (untimed): from a trimmed state (vmm_trim /
 * cudaMemPoolTrimTo), NVML used bytes (libnvidia-ml.so.1, dlopen) minus a baseline, sampled at
 * the event of peak requested bytes, near-peak records and every events/2000 events; without
 * NVML cudaMemGetInfo (which under the hook counts its idle cache as free: marked).
 *
 * Output: a table and lines "RESULT replay.<impl>.<metric> <value> <unit>".
 * Exit: 0 ok, 1 a failed replay (e.g. out of memory) or unreadable trace, 2 usage,
 * 77 no CUDA GPU (not for --parse-only).
 */
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "vmmhook.h"

namespace {

constexpr double MiBd = 1024.0 * 1024.0;

/* ---- the trace ---------------------------------------------------------------------------- */

struct Event {
    uint32_t slot; /* replay slot: one per live block of the trace */
    bool alloc;
    size_t size; /* bytes (allocations) */
};

struct Trace {
    std::vector<Event> ev;
    uint32_t nslots = 0;
    size_t allocs = 0, frees = 0, failures = 0, unmatched_frees = 0, reused_live = 0,
           size_mismatch = 0, zero_size = 0, malformed = 0, unknown_action = 0;
    size_t threads = 0, live_at_end = 0, live_bytes_at_end = 0;
    size_t peak_requested = 0, peak_event = 0, total_requested = 0;
    double t_first = NAN, t_last = NAN;
};

std::string trim(const std::string &s)
{
    size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
    return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

std::string lower(std::string s)
{
    for (char &c : s)
        c = (char)tolower((unsigned char)c);
    return s;
}

std::vector<std::string> split(const std::string &line)
{
    std::vector<std::string> f;
    size_t start = 0;
    for (;;) {
        size_t comma = line.find(',', start);
        f.push_back(trim(line.substr(start, comma == std::string::npos ? std::string::npos
                                                                       : comma - start)));
        if (comma == std::string::npos)
            return f;
        start = comma + 1;
    }
}

bool parse_u64(const std::string &s, int base, uint64_t *out)
{
    if (s.empty())
        return false;
    errno = 0;
    char *end = nullptr;
    unsigned long long v = strtoull(s.c_str(), &end, base);
    if (errno || *end || s[0] == '-')
        return false;
    *out = v;
    return true;
}

bool parse_ptr(const std::string &s, uint64_t *out)
{
    std::string t = lower(s);
    if (t.empty() || t == "(nil)" || t == "nil" || t == "null" || t == "0") {
        *out = 0;
        return true;
    }
    if (t.compare(0, 2, "0x") == 0)
        t = t.substr(2);
    return parse_u64(t, 16, out);
}

/* "HH:MM:SS.ffffff", "HH:MM:SS:ffffff" (older RMM) or plain seconds; NAN when neither. */
double parse_time(const std::string &s)
{
    int h, m, sec;
    char sep;
    char frac[32] = {0};
    if (sscanf(s.c_str(), "%d:%d:%d%c%31[0-9]", &h, &m, &sec, &sep, frac) >= 3) {
        double f = frac[0] ? atof(("0." + std::string(frac)).c_str()) : 0.0;
        return h * 3600.0 + m * 60.0 + sec + f;
    }
    char *end = nullptr;
    double v = strtod(s.c_str(), &end);
    return (end && *end == 0 && end != s.c_str()) ? v : NAN;
}

bool load_trace(const char *path, Trace &t)
{
    std::ifstream in(path);
    if (!in) {
        fprintf(stderr, "replay: cannot open %s: %s\n", path, strerror(errno));
        return false;
    }
    int c_thread = 0, c_time = 1, c_action = 2, c_ptr = 3, c_size = 4;
    std::unordered_map<uint64_t, uint32_t> live; /* trace pointer -> slot */
    std::vector<size_t> slot_size;
    std::unordered_set<std::string> threads;
    std::string line;
    size_t lineno = 0, requested = 0;
    double t_prev = NAN, t_wrap = 0;
    bool first = true;
    int warned = 0;
    auto warn = [&](const char *what) {
        if (warned++ < 5)
            fprintf(stderr, "replay: %s:%zu: %s: %s\n", path, lineno, what, line.c_str());
    };
    while (std::getline(in, line)) {
        ++lineno;
        std::string l = trim(line);
        if (l.empty() || l[0] == '#')
            continue;
        std::vector<std::string> f = split(l);
        if (first) {
            first = false;
            if (lower(f[0]) == "thread") {
                for (size_t i = 0; i < f.size(); ++i) {
                    std::string n = lower(f[i]);
                    if (n == "thread")
                        c_thread = (int)i;
                    else if (n == "time")
                        c_time = (int)i;
                    else if (n == "action")
                        c_action = (int)i;
                    else if (n == "pointer")
                        c_ptr = (int)i;
                    else if (n == "size")
                        c_size = (int)i;
                }
                continue;
            }
        }
        const int need = std::max({c_thread, c_time, c_action, c_ptr, c_size});
        if ((int)f.size() <= need) {
            t.malformed++;
            warn("too few columns");
            continue;
        }
        const std::string action = lower(f[c_action]);
        uint64_t ptr = 0, size = 0;
        if (!parse_ptr(f[c_ptr], &ptr) || !parse_u64(f[c_size], 10, &size)) {
            t.malformed++;
            warn("bad pointer or size");
            continue;
        }
        threads.insert(f[c_thread]);
        double tm = parse_time(f[c_time]);
        if (!std::isnan(tm)) {
            if (!std::isnan(t_prev) && tm + t_wrap < t_prev - 43200) /* past midnight */
                t_wrap += 86400;
            tm += t_wrap;
            if (std::isnan(t.t_first))
                t.t_first = tm;
            t.t_last = tm;
            t_prev = tm;
        }
        if (action == "allocate") {
            if (size == 0 || ptr == 0) {
                t.zero_size++; /* nothing to replay: cudaMalloc(0) allocates nothing */
                continue;
            }
            auto it = live.find(ptr);
            if (it != live.end()) { /* the free was not logged: free the older block first */
                t.reused_live++;
                t.ev.push_back({it->second, false, 0});
                t.frees++;
                requested -= slot_size[it->second];
                live.erase(it);
            }
            uint32_t slot = t.nslots++;
            slot_size.push_back(size);
            live[ptr] = slot;
            t.ev.push_back({slot, true, size});
            t.allocs++;
            requested += size;
            t.total_requested += size;
            if (requested > t.peak_requested) {
                t.peak_requested = requested;
                t.peak_event = t.ev.size() - 1;
            }
        } else if (action == "free" || action == "deallocate") {
            if (ptr == 0)
                continue; /* freeing NULL: nothing */
            auto it = live.find(ptr);
            if (it == live.end()) {
                t.unmatched_frees++;
                continue;
            }
            if (slot_size[it->second] != size)
                t.size_mismatch++;
            t.ev.push_back({it->second, false, 0});
            t.frees++;
            requested -= slot_size[it->second];
            live.erase(it);
        } else if (action.compare(0, 16, "allocate failure") == 0 ||
                   action == "allocate_failure") {
            t.failures++;
        } else {
            t.unknown_action++;
            warn("unknown action");
        }
    }
    t.threads = threads.size();
    t.live_at_end = live.size();
    t.live_bytes_at_end = requested;
    if (warned > 5)
        fprintf(stderr, "replay: %d more warnings not shown\n", warned - 5);
    return true;
}

void print_trace(const char *path, const Trace &t)
{
    printf("trace %s\n", path);
    printf("  events %zu (allocate %zu, free %zu); threads %zu; span %.3f s\n", t.ev.size(),
           t.allocs, t.frees, t.threads,
           std::isnan(t.t_first) ? 0.0 : t.t_last - t.t_first);
    printf("  peak requested %zu bytes (%.2f MiB) at event %zu; total requested %.2f MiB\n",
           t.peak_requested, t.peak_requested / MiBd, t.peak_event, t.total_requested / MiBd);
    printf("  live at end %zu (%zu bytes); allocate failures %zu; unmatched frees %zu; "
           "allocates of a live pointer %zu; free size mismatches %zu; empty allocates %zu; "
           "malformed lines %zu; unknown actions %zu\n",
           t.live_at_end, t.live_bytes_at_end, t.failures, t.unmatched_frees, t.reused_live,
           t.size_mismatch, t.zero_size, t.malformed, t.unknown_action);
    printf("PARSE events=%zu allocs=%zu frees=%zu peak_requested_bytes=%zu threads=%zu "
           "unmatched_frees=%zu failures=%zu live_at_end=%zu\n",
           t.ev.size(), t.allocs, t.frees, t.peak_requested, t.threads, t.unmatched_frees,
           t.failures, t.live_at_end);
}

/* ---- replaying ---------------------------------------------------------------------------- */

struct CudaError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

void check(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        cudaGetLastError();
        throw CudaError(std::string(what) + ": " + cudaGetErrorName(e) + ": " +
                        cudaGetErrorString(e));
    }
}
#define CK(x) check((x), #x)

struct NvmlMemory {
    unsigned long long total, free, used;
};

struct MemProbe {
    void *dev = nullptr;
    int (*get_info)(void *, NvmlMemory *) = nullptr;
    bool nvml = false;
    std::string why_not = "not opened";
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
        char bus[64] = {0};
        NvmlMemory m;
        if (!init || !by_pci || !get_info)
            why_not = "NVML symbols missing";
        else if (cudaDeviceGetPCIBusId(bus, sizeof bus, cuda_dev) != cudaSuccess)
            why_not = "cudaDeviceGetPCIBusId failed";
        else if (init() != 0)
            why_not = "nvmlInit_v2 failed";
        else if (by_pci(bus, &dev) != 0)
            why_not = std::string("no NVML device for ") + bus;
        else if (get_info(dev, &m) != 0)
            why_not = "nvmlDeviceGetMemoryInfo failed";
        else
            nvml = true;
    }
    long long used()
    {
        NvmlMemory m;
        if (nvml && get_info(dev, &m) == 0)
            return (long long)m.used;
        size_t fr = 0, tot = 0;
        CK(cudaMemGetInfo(&fr, &tot));
        return (long long)(tot - fr);
    }
};

enum Impl { IMPL_NATIVE, IMPL_ASYNC, IMPL_HOOK };
const char *const impl_name[] = {"native", "async", "hook"};

struct Replayer {
    Impl impl;
    cudaStream_t stream;
    cudaMemPool_t pool;
    size_t (*vmm_trim)(void);
    std::vector<void *> slot;

    void trim_all()
    {
        CK(cudaDeviceSynchronize());
        if (pool)
            CK(cudaMemPoolTrimTo(pool, 0));
        if (vmm_trim)
            vmm_trim();
        CK(cudaDeviceSynchronize());
    }
    void do_event(const Event &e)
    {
        if (e.alloc) {
            void *p = nullptr;
            if (impl == IMPL_ASYNC)
                CK(cudaMallocAsync(&p, e.size, stream));
            else
                CK(cudaMalloc(&p, e.size));
            slot[e.slot] = p;
        } else {
            if (impl == IMPL_ASYNC)
                CK(cudaFreeAsync(slot[e.slot], stream));
            else
                CK(cudaFree(slot[e.slot]));
            slot[e.slot] = nullptr;
        }
    }
    void free_rest() noexcept
    {
        for (void *&p : slot)
            if (p) {
                if (impl == IMPL_ASYNC)
                    cudaFreeAsync(p, stream);
                else
                    cudaFree(p);
                p = nullptr;
            }
        cudaDeviceSynchronize();
    }
    /* One pass; returns seconds, or throws with the failing event's index in the message. */
    double pass(const Trace &t)
    {
        slot.assign(t.nslots, nullptr);
        size_t i = 0;
        try {
            const auto t0 = std::chrono::steady_clock::now();
            for (; i < t.ev.size(); ++i)
                do_event(t.ev[i]);
            CK(cudaDeviceSynchronize());
            const auto t1 = std::chrono::steady_clock::now();
            free_rest();
            return std::chrono::duration<double>(t1 - t0).count();
        } catch (const CudaError &e) {
            free_rest();
            throw CudaError("event " + std::to_string(i) + ": " + e.what());
        }
    }
    /* Untimed pass with memory samples; returns peak used bytes over the baseline. */
    long long memory_pass(const Trace &t, MemProbe &probe, size_t *samples)
    {
        trim_all();
        const long long base = probe.used();
        long long peak = 0;
        slot.assign(t.nslots, nullptr);
        const size_t stride = std::max<size_t>(1, t.ev.size() / 2000);
        size_t requested = 0, record = 0, record_samples = 0;
        *samples = 0;
        auto sample = [&] {
            peak = std::max(peak, probe.used() - base);
            ++*samples;
        };
        size_t i = 0;
        try {
            for (; i < t.ev.size(); ++i) {
                const Event &e = t.ev[i];
                do_event(e);
                if (e.alloc)
                    requested += e.size;
                else
                    requested -= slot_bytes(t, e.slot);
                bool near_peak_record = requested > record &&
                                        requested >= t.peak_requested / 100 * 95 &&
                                        record_samples < 2000;
                record = std::max(record, requested);
                if (i == t.peak_event || near_peak_record || i % stride == 0) {
                    record_samples += near_peak_record;
                    sample();
                }
            }
            sample();
        } catch (const CudaError &e) {
            free_rest();
            throw CudaError("event " + std::to_string(i) + ": " + e.what());
        }
        free_rest();
        trim_all();
        return peak;
    }
    /* The size of a slot's allocation, looked up once per slot from the trace. */
    std::vector<size_t> sizes;
    size_t slot_bytes(const Trace &t, uint32_t s)
    {
        if (sizes.size() != t.nslots) {
            sizes.assign(t.nslots, 0);
            for (const Event &e : t.ev)
                if (e.alloc)
                    sizes[e.slot] = e.size;
        }
        return sizes[s];
    }
};

int usage()
{
    fprintf(stderr, "usage: replay [--parse-only] [--repeat N] [--impl native,async] "
                    "[--no-memory] TRACE.csv\n");
    return 2;
}

} // namespace

int main(int argc, char **argv)
{
    setvbuf(stdout, nullptr, _IOLBF, 0);
    bool parse_only = false, memory = true;
    int repeat = 3;
    std::string impls_arg;
    const char *path = nullptr;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--parse-only")
            parse_only = true;
        else if (a == "--no-memory")
            memory = false;
        else if (a == "--repeat" && i + 1 < argc)
            repeat = std::max(1, atoi(argv[++i]));
        else if (a == "--impl" && i + 1 < argc)
            impls_arg = argv[++i];
        else if (a.size() > 1 && a[0] == '-')
            return usage();
        else if (!path)
            path = argv[i];
        else
            return usage();
    }
    if (!path)
        return usage();

    Trace t;
    if (!load_trace(path, t))
        return 1;
    print_trace(path, t);
    if (parse_only)
        return t.ev.empty() ? 1 : 0;
    if (t.ev.empty()) {
        fprintf(stderr, "replay: no events to replay\n");
        return 1;
    }

    const bool hook = vmm_hook_available() != 0;
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("SKIP replay: no CUDA GPU found (%s)\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 77;
    }

    std::vector<Impl> impls;
    if (hook)
        impls.push_back(IMPL_HOOK); /* every cudaMalloc here is the hook's */
    else {
        if (impls_arg.empty() || impls_arg.find("native") != std::string::npos)
            impls.push_back(IMPL_NATIVE);
        if (impls_arg.empty() || impls_arg.find("async") != std::string::npos)
            impls.push_back(IMPL_ASYNC);
    }

    Replayer base{IMPL_NATIVE, nullptr, nullptr, nullptr, {}, {}};
    MemProbe probe;
    try {
        CK(cudaSetDevice(0));
        CK(cudaFree(nullptr));
        CK(cudaStreamCreateWithFlags(&base.stream, cudaStreamNonBlocking));
        CK(cudaDeviceGetDefaultMemPool(&base.pool, 0));
        uint64_t keep = UINT64_MAX;
        CK(cudaMemPoolSetAttribute(base.pool, cudaMemPoolAttrReleaseThreshold, &keep));
        if (hook)
            base.vmm_trim = (size_t(*)(void))vmm_fn("vmm_trim");
        probe.open(0);
    } catch (const CudaError &ex) {
        fprintf(stderr, "replay: setup: %s\n", ex.what());
        return 1;
    }
    const char *src = probe.nvml ? "nvml" : "cudaMemGetInfo";
    if (probe.nvml)
        printf("memory source: nvml\n");
    else
        printf("memory source: cudaMemGetInfo (%s)\n", probe.why_not.c_str());
    if (!probe.nvml && hook)
        printf("  (under the hook cudaMemGetInfo counts its idle cache as free: used is low)\n");
    printf("replaying %zu events in file order on one thread, %d timed pass(es)%s\n\n",
           t.ev.size(), repeat, memory ? " + 1 memory pass" : "");
    printf("| impl | time ms (median) | us per event | peak used MiB | peak requested MiB | "
           "used / requested |\n| --- | --- | --- | --- | --- | --- |\n");

    int status = 0;
    for (Impl impl : impls) {
        Replayer r = base;
        r.impl = impl;
        if (impl == IMPL_NATIVE)
            r.vmm_trim = nullptr;
        const char *name = impl_name[impl];
        try {
            r.trim_all();
            std::vector<double> secs;
            for (int k = 0; k < repeat; ++k)
                secs.push_back(r.pass(t));
            std::sort(secs.begin(), secs.end());
            const double ms = secs[secs.size() / 2] * 1e3;
            long long peak = -1;
            size_t samples = 0;
            if (memory)
                peak = r.memory_pass(t, probe, &samples);
            char used[64] = "n/a", ratio[64] = "n/a";
            if (peak >= 0) {
                snprintf(used, sizeof used, "%.1f", peak / MiBd);
                snprintf(ratio, sizeof ratio, "%.3f", (double)peak / (double)t.peak_requested);
            }
            printf("| %s | %.3f | %.3f | %s | %.1f | %s |\n", name, ms,
                   ms * 1e3 / (double)t.ev.size(), used, t.peak_requested / MiBd, ratio);
            printf("RESULT replay.%s.time_ms %.6g ms\n", name, ms);
            printf("RESULT replay.%s.us_per_event %.6g us\n", name, ms * 1e3 / (double)t.ev.size());
            if (peak >= 0) {
                printf("RESULT replay.%s.peak_used_MiB %.6g MiB\n", name, peak / MiBd);
                printf("RESULT replay.%s.mem_ratio %.6g %s\n", name,
                       (double)peak / (double)t.peak_requested, src);
            }
        } catch (const CudaError &ex) {
            printf("| %s | failed: %s | | | | |\n", name, ex.what());
            printf("RESULT replay.%s.time_ms NA error\n", name);
            status = 1;
        }
    }
    printf("RESULT replay.peak_requested_MiB %.6g MiB\n", t.peak_requested / MiBd);
    cudaStreamDestroy(base.stream);
    return status;
}
