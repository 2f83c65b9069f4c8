// Probe (GPU machine, no hook): two questions of round 15, each answered with the driver API
// alone.
//
// 1. Why a move back of spilled memory (vmm_prefetch: host-located VMM chunk -> fresh device
//    chunk, cuMemcpyDtoDAsync on a non-blocking stream of the library's own) ran at 27.6 GiB/s
//    on the H200 where a bare cuMemcpyDtoD between the same kinds of mapping ran at 51.6
//    (docs/OVERFLOW.md, driver-facts.md section 7). Each copy path below moves the same 4 GiB
//    from a host-located chunk (HOST id 0, then HOST_NUMA at the GPU's node) into a device chunk,
//    three times; the median is printed.
// 2. Why a resume right after a pause (no backup) took 68-78 ms where the first cycle, with a
//    second process in between, took 9-11 ms (pause_resume at 41ce327): whether making and
//    mapping device memory right after releasing the same amount costs more than after a pause.
//    40 GiB as 40 chunks of 1 GiB (the size of the heap's extents), released, then made, mapped
//    and given access again at once / after cuCtxSynchronize / after 1 s; each call kind timed.
//
// 3. Both again right after the program released most of the GPU, as the two GPU tests do before
//    they time (after_release); `./copy_paths 4 after` runs only this part.
//   nvcc -O2 -o copy_paths tools/probe/copy_paths.cu -lcuda && ./copy_paths [GiB [after]]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda.h>
#include <thread>
#include <vector>

#define CK(x)                                                                                      \
    do {                                                                                           \
        CUresult r_ = (x);                                                                         \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            printf("error %d at %s:%d: %s\n", (int)r_, __FILE__, __LINE__, #x);                   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

using clk = std::chrono::steady_clock;
static double ms_since(clk::time_point t) { return std::chrono::duration<double, std::milli>(clk::now() - t).count(); }

static const size_t MiB = (size_t)1 << 20, GiB = (size_t)1 << 30;
static CUdevice dev;

static CUmemAllocationProp prop_of(CUmemLocationType type, int id)
{
    CUmemAllocationProp p = {};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = type;
    p.location.id = id;
    return p;
}

struct Mapping {
    CUdeviceptr va = 0;
    size_t size = 0;
    CUmemGenericAllocationHandle h = 0;
};

static Mapping make(CUmemLocationType type, int id, size_t size, double *create_ms = nullptr,
                    double *map_ms = nullptr, double *access_ms = nullptr)
{
    Mapping m;
    m.size = size;
    CUmemAllocationProp p = prop_of(type, id);
    auto t = clk::now();
    CK(cuMemCreate(&m.h, size, &p, 0));
    if (create_ms)
        *create_ms += ms_since(t);
    CK(cuMemAddressReserve(&m.va, size, 2 * MiB, 0, 0));
    t = clk::now();
    CK(cuMemMap(m.va, size, 0, m.h, 0));
    if (map_ms)
        *map_ms += ms_since(t);
    CUmemAccessDesc a = {};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = (int)dev;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    t = clk::now();
    CK(cuMemSetAccess(m.va, size, &a, 1));
    if (access_ms)
        *access_ms += ms_since(t);
    return m;
}

static void drop(Mapping &m, double *unmap_ms = nullptr, double *release_ms = nullptr)
{
    auto t = clk::now();
    CK(cuMemUnmap(m.va, m.size));
    if (unmap_ms)
        *unmap_ms += ms_since(t);
    t = clk::now();
    CK(cuMemRelease(m.h));
    if (release_ms)
        *release_ms += ms_since(t);
    CK(cuMemAddressFree(m.va, m.size));
    m = Mapping();
}

static double median(std::vector<double> v)
{
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

template <class F> static void timed(const char *name, size_t bytes, F f)
{
    std::vector<double> t;
    for (int i = 0; i < 3; i++) {
        CK(cuCtxSynchronize());
        auto t0 = clk::now();
        f();
        t.push_back(ms_since(t0));
    }
    double m = median(t);
    printf("COPY %-58s %8.1f ms  %6.1f GiB/s  (runs %.1f %.1f %.1f)\n", name, m,
           (double)bytes / GiB / (m / 1e3), t[0], t[1], t[2]);
    fflush(stdout);
}

static void copy_paths(CUmemLocationType htype, int hid, const char *hname, size_t S)
{
    printf("== copies of %zu MiB from a host chunk (%s) into device memory\n", S / MiB, hname);
    Mapping h = make(htype, hid, S);
    Mapping d = make(CU_MEM_LOCATION_TYPE_DEVICE, (int)dev, S);
    CK(cuMemsetD8(h.va, 0x5a, S));
    CK(cuCtxSynchronize());
    CUstream nb, bl;
    CK(cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));
    CK(cuStreamCreate(&bl, CU_STREAM_DEFAULT));
    timed("cuMemcpyDtoD (sync)", S, [&] { CK(cuMemcpyDtoD(d.va, h.va, S)); });
    timed("cuMemcpyDtoDAsync, non-blocking stream", S, [&] {
        CK(cuMemcpyDtoDAsync(d.va, h.va, S, nb));
        CK(cuStreamSynchronize(nb));
    });
    timed("cuMemcpyDtoDAsync, blocking stream", S, [&] {
        CK(cuMemcpyDtoDAsync(d.va, h.va, S, bl));
        CK(cuStreamSynchronize(bl));
    });
    timed("cuMemcpyDtoDAsync, legacy stream 0", S, [&] {
        CK(cuMemcpyDtoDAsync(d.va, h.va, S, 0));
        CK(cuStreamSynchronize(0));
    });
    timed("cuMemcpyAsync, non-blocking stream", S, [&] {
        CK(cuMemcpyAsync(d.va, h.va, S, nb));
        CK(cuStreamSynchronize(nb));
    });
    timed("cuMemcpyDtoDAsync x 64 MiB pieces, non-blocking stream", S, [&] {
        for (size_t o = 0; o < S; o += 64 * MiB)
            CK(cuMemcpyDtoDAsync(d.va + o, h.va + o, 64 * MiB, nb));
        CK(cuStreamSynchronize(nb));
    });
    timed("two non-blocking streams, halves", S, [&] {
        CK(cuMemcpyDtoDAsync(d.va, h.va, S / 2, nb));
        CK(cuMemcpyDtoDAsync(d.va + S / 2, h.va + S / 2, S / 2, bl));
        CK(cuStreamSynchronize(nb));
        CK(cuStreamSynchronize(bl));
    });
    timed("device -> host chunk, cuMemcpyDtoDAsync non-blocking", S, [&] {
        CK(cuMemcpyDtoDAsync(h.va, d.va, S, nb));
        CK(cuStreamSynchronize(nb));
    });
    /* As the library does it: a fresh device chunk made and mapped right before its copy. */
    timed("fresh device chunk made+mapped, then DtoDAsync non-blocking", S, [&] {
        Mapping f = make(CU_MEM_LOCATION_TYPE_DEVICE, (int)dev, S);
        CK(cuMemcpyDtoDAsync(f.va, h.va, S, nb));
        CK(cuStreamSynchronize(nb));
        drop(f);
    });
    {
        Mapping f = make(CU_MEM_LOCATION_TYPE_DEVICE, (int)dev, S);
        CK(cuCtxSynchronize());
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        timed("fresh device chunk 200 ms old, DtoDAsync non-blocking", S, [&] {
            CK(cuMemcpyDtoDAsync(f.va, h.va, S, nb));
            CK(cuStreamSynchronize(nb));
        });
        drop(f);
    }
    CK(cuStreamDestroy(nb));
    CK(cuStreamDestroy(bl));
    drop(d);
    double rel = 0;
    auto t = clk::now();
    drop(h, nullptr, &rel);
    printf("I host chunk of %zu MiB unmapped and released in %.1f ms (release %.1f)\n", S / MiB,
           ms_since(t), rel);
}

static void remake(size_t total, size_t chunk, const char *when)
{
    size_t n = total / chunk;
    std::vector<Mapping> v;
    for (size_t i = 0; i < n; i++)
        v.push_back(make(CU_MEM_LOCATION_TYPE_DEVICE, (int)dev, chunk));
    for (auto &m : v)
        CK(cuMemsetD8(m.va, 1, m.size));
    CK(cuCtxSynchronize());
    double un = 0, rel = 0;
    auto t = clk::now();
    for (auto &m : v)
        drop(m, &un, &rel);
    double pause_ms = ms_since(t);
    v.clear();
    if (strstr(when, "Synchronize"))
        CK(cuCtxSynchronize());
    else if (strstr(when, "1 s"))
        std::this_thread::sleep_for(std::chrono::seconds(1));
    double cr = 0, mp = 0, ac = 0;
    t = clk::now();
    for (size_t i = 0; i < n; i++)
        v.push_back(make(CU_MEM_LOCATION_TYPE_DEVICE, (int)dev, chunk, &cr, &mp, &ac));
    double resume_ms = ms_since(t);
    printf("REMAKE %zu x %zu MiB, remade %-22s: released in %.1f ms (unmap %.1f, release %.1f); "
           "made again in %.1f ms (create %.1f, map %.1f, access %.1f)\n",
           n, chunk / MiB, when, pause_ms, un, rel, resume_ms, cr, mp, ac);
    fflush(stdout);
    for (auto &m : v)
        drop(m);
}

/* Device memory of the probe's own filling the GPU until about `keep` bytes are free. */
static std::vector<Mapping> ballast(size_t keep)
{
    std::vector<Mapping> v;
    size_t fr = 0, tot = 0;
    CK(cuMemGetInfo(&fr, &tot));
    while (fr > keep + GiB) {
        CUmemGenericAllocationHandle h;
        CUmemAllocationProp p = prop_of(CU_MEM_LOCATION_TYPE_DEVICE, (int)dev);
        if (cuMemCreate(&h, GiB, &p, 0) != CUDA_SUCCESS)
            break;
        Mapping m;
        m.h = h;
        m.size = GiB;
        v.push_back(m);
        fr -= GiB;
    }
    return v;
}

static void ballast_drop(std::vector<Mapping> &v)
{
    for (auto &m : v)
        CK(cuMemRelease(m.h));
    v.clear();
}

/* 3. The same copy and the same remake right after the program released most of the GPU (what
 * overflow_gpu and pause_resume do before they time a move back or a second-cycle resume). */
static void after_release(size_t S)
{
    Mapping h = make(CU_MEM_LOCATION_TYPE_HOST, 0, S);
    CK(cuMemsetD8(h.va, 0x5a, S));
    CUstream nb;
    CK(cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));
    for (int settle : {0, 1000}) {
        auto b = ballast(8 * GiB);
        size_t n = b.size();
        CK(cuCtxSynchronize());
        auto t = clk::now();
        ballast_drop(b);
        double rel = ms_since(t);
        std::this_thread::sleep_for(std::chrono::milliseconds(settle));
        t = clk::now();
        Mapping f = make(CU_MEM_LOCATION_TYPE_DEVICE, (int)dev, S);
        CK(cuMemcpyDtoDAsync(f.va, h.va, S, nb));
        CK(cuStreamSynchronize(nb));
        double m = ms_since(t);
        printf("AFTER released %zu GiB of the program's own in %.1f ms, %d ms later: fresh chunk "
               "+ copy of %zu MiB from host %.1f ms (%.1f GiB/s)\n",
               n, rel, settle, S / MiB, m, (double)S / GiB / (m / 1e3));
        fflush(stdout);
        drop(f);
    }
    CK(cuStreamDestroy(nb));
    drop(h);
    /* pause_resume's second cycle: the GPU full (2 GiB free) but for 40 GiB in 1 GiB chunks,
     * written, released, made again at once / 1 s later. */
    for (int settle : {0, 1000, 0}) {
        auto b = ballast(42 * GiB);
        std::vector<Mapping> v;
        for (int i = 0; i < 40; i++)
            v.push_back(make(CU_MEM_LOCATION_TYPE_DEVICE, (int)dev, GiB));
        for (auto &m : v)
            CK(cuMemsetD8(m.va, 1, m.size));
        CK(cuCtxSynchronize());
        for (auto &m : v)
            drop(m);
        v.clear();
        std::this_thread::sleep_for(std::chrono::milliseconds(settle));
        double cr = 0, mp = 0, ac = 0;
        auto t = clk::now();
        for (int i = 0; i < 40; i++)
            v.push_back(make(CU_MEM_LOCATION_TYPE_DEVICE, (int)dev, GiB, &cr, &mp, &ac));
        printf("FULL GPU (%zu GiB ballast), 40 x 1 GiB released and made again %d ms later: %.1f ms "
               "(create %.1f, map %.1f, access %.1f)\n",
               b.size(), settle, ms_since(t), cr, mp, ac);
        fflush(stdout);
        for (auto &m : v)
            drop(m);
        ballast_drop(b);
    }
}

int main(int argc, char **argv)
{
    size_t S = (argc > 1 ? (size_t)atoi(argv[1]) : 4) * GiB;
    bool only_after = argc > 2 && strcmp(argv[2], "after") == 0;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    int numa = -1;
    if (cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev) != CUDA_SUCCESS)
        numa = -1;
    printf("I device 0, host NUMA id %d\n", numa);
    if (only_after) {
        after_release(S);
        return 0;
    }
    copy_paths(CU_MEM_LOCATION_TYPE_HOST, 0, "HOST id 0, as the library makes them", S);
    if (numa >= 0) {
        char name[64];
        snprintf(name, sizeof name, "HOST_NUMA id %d, the GPU's node", numa);
        copy_paths(CU_MEM_LOCATION_TYPE_HOST_NUMA, numa, name, S);
    }
    for (const char *when : {"at once", "after cuCtxSynchronize", "1 s later", "at once"})
        remake(40 * GiB, GiB, when);
    remake(40 * GiB, 2 * MiB * 64, "at once (128 MiB)");
    after_release(S);
    return 0;
}
