/* grow_vector: the README demo of issue 4, a device vector grown by vmm_realloc.
 *
 *   LD_PRELOAD=/path/to/libvmmhook.so ./grow_vector [--max-gib N] [--tail-steps N]
 *
 * A vector of uint32_t grows from 1 MiB, doubling to N GiB (default 8), then by 2 MiB at a
 * time: one warm-up step, then --tail-steps timed ones (default 9). After every step a kernel
 * writes the new tail (a hash of the index) and another checks the whole vector, counting
 * mismatches into a device counter: what was there before the grow must still be there.
 * A second vector with the same contents grows the classic way (cudaMalloc new, cudaMemcpy
 * device-to-device, cudaFree old) and is checked the same way.
 *
 * The phases run apart, so that neither side's work is queued or being scrubbed while the
 * other is timed:
 *   0. reference: a 64 MiB vector grown by 2 MiB (one warm-up step, then --tail-steps), freed;
 *   1. the vmm_realloc vector through every step, verified after each (untimed);
 *   2. it is freed, and vmm_trim() (when the library exports it) returns the idle memory;
 *   3. the copy-based vector through the same steps, verified after each; its table shows the
 *      per-step times of both.
 * Every grow is timed with the steady clock from an idle device (cudaDeviceSynchronize before,
 * untimed) around the host calls plus a cudaDeviceSynchronize (the copy is part of the classic
 * grow's cost). Under the hook the classic grow's cudaMalloc/cudaFree are served by the hook
 * too: that is what an unaware program gets; its cost is the copy, which grows with the vector.
 *
 * The last line states the issue's "Done when": growing the N GiB vector by 2 MiB costs a time
 * independent of its size (judged: the median N GiB + k*2 MiB grow within 1.5x of the median
 * 64 MiB + 2 MiB grow) and at least 100 times less than the copy-based grow (medians of the
 * timed tail steps; the warm-up step is shown, not counted).
 *
 * vmm_realloc (and vmm_trim) are fetched with vmm_fn() from vmmhook.h: no link against the
 * library.
 * Exit: 0 contents verified (the PASS/MISS of the speed criterion is printed, not the status),
 * 1 a mismatch or a CUDA error, 77 no GPU or the hook not loaded.
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "vmmhook.h"

namespace {

constexpr size_t MiB = size_t(1) << 20;
constexpr size_t GiB = size_t(1) << 30;

#define CK(x)                                                                                     \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "grow_vector: %s (line %d): %s\n", #x, __LINE__,                      \
                    cudaGetErrorString(e_));                                                      \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

typedef vmm_status (*vmm_realloc_t)(void **, size_t);
typedef const char *(*vmm_status_string_t)(vmm_status);
typedef size_t (*vmm_trim_t)(void);
vmm_realloc_t vmm_realloc_fn;
vmm_status_string_t vmm_status_string_fn;
vmm_trim_t vmm_trim_fn;

__host__ __device__ inline uint32_t pattern(size_t i)
{
    uint64_t x = (uint64_t)i * 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
    return (uint32_t)x | 1u; /* never 0: fresh zeroed memory cannot pass for data */
}

__global__ void write_tail(uint32_t *v, size_t from, size_t to)
{
    for (size_t i = from + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < to;
         i += (size_t)gridDim.x * blockDim.x)
        v[i] = pattern(i);
}

__global__ void verify(const uint32_t *v, size_t n, unsigned long long *bad)
{
    unsigned long long mine = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        mine += v[i] != pattern(i);
    if (mine)
        atomicAdd(bad, mine);
}

int g_blocks = 1024;

void fill(uint32_t *v, size_t from_bytes, size_t to_bytes)
{
    write_tail<<<g_blocks, 256>>>(v, from_bytes / 4, to_bytes / 4);
    CK(cudaGetLastError());
}

unsigned long long check(const uint32_t *v, size_t bytes, unsigned long long *d_bad)
{
    CK(cudaMemset(d_bad, 0, sizeof *d_bad));
    verify<<<g_blocks, 256>>>(v, bytes / 4, d_bad);
    CK(cudaGetLastError());
    unsigned long long bad = 0;
    CK(cudaMemcpy(&bad, d_bad, sizeof bad, cudaMemcpyDeviceToHost));
    return bad;
}

double now_us()
{
    return std::chrono::duration<double, std::micro>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

/* Grows by vmm_realloc; returns microseconds: the host call plus a device synchronize. The
 * device is idle when the clock starts (a synchronize before it, untimed). */
double grow_vmm(uint32_t **v, size_t bytes)
{
    CK(cudaDeviceSynchronize());
    const double t0 = now_us();
    vmm_status st = vmm_realloc_fn((void **)v, bytes);
    CK(cudaDeviceSynchronize());
    const double t1 = now_us();
    if (st != VMM_OK) {
        fprintf(stderr, "grow_vector: vmm_realloc(%zu bytes): %s\n", bytes,
                vmm_status_string_fn ? vmm_status_string_fn(st) : "error");
        exit(1);
    }
    return t1 - t0;
}

/* Grows the classic way; returns microseconds (the same clock: idle device at the start, the
 * host calls plus a device synchronize). */
double grow_copy(uint32_t **v, size_t old_bytes, size_t bytes)
{
    CK(cudaDeviceSynchronize());
    const double t0 = now_us();
    uint32_t *q = nullptr;
    CK(cudaMalloc(&q, bytes));
    CK(cudaMemcpy(q, *v, old_bytes, cudaMemcpyDeviceToDevice));
    CK(cudaFree(*v));
    CK(cudaDeviceSynchronize());
    const double t1 = now_us();
    *v = q;
    return t1 - t0;
}

/* Frees what is idle in the hook's cache (vmm_trim, when the library exports it), so that the
 * next phase starts from a device that holds only live buffers. */
void trim_idle()
{
    CK(cudaDeviceSynchronize());
    if (vmm_trim_fn)
        vmm_trim_fn();
    CK(cudaDeviceSynchronize());
}

double median(std::vector<double> x)
{
    std::sort(x.begin(), x.end());
    size_t n = x.size();
    return n == 0 ? 0 : (n % 2 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2);
}

void size_str(char *buf, size_t n, size_t bytes)
{
    if (bytes >= GiB && bytes % GiB == 0)
        snprintf(buf, n, "%zu GiB", bytes / GiB);
    else if (bytes >= GiB)
        snprintf(buf, n, "%zu GiB + %zu MiB", bytes / GiB, (bytes % GiB) / MiB);
    else
        snprintf(buf, n, "%zu MiB", bytes / MiB);
}

} // namespace

int main(int argc, char **argv)
{
    setvbuf(stdout, nullptr, _IOLBF, 0);
    size_t max_gib = 8;
    int tail_steps = 9;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--max-gib") && i + 1 < argc)
            max_gib = strtoull(argv[++i], nullptr, 10);
        else if (!strcmp(argv[i], "--tail-steps") && i + 1 < argc)
            tail_steps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: grow_vector [--max-gib N (power of 2, default 8)] "
                            "[--tail-steps N (timed 2 MiB steps after a warm-up one, default 9)]\n");
            return 2;
        }
    }
    if (max_gib == 0 || (max_gib & (max_gib - 1)) || tail_steps < 1) {
        fprintf(stderr, "grow_vector: --max-gib must be a power of two, --tail-steps >= 1\n");
        return 2;
    }

    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("SKIP grow_vector: no CUDA GPU found (%s)\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 77;
    }
    vmm_realloc_fn = (vmm_realloc_t)vmm_fn("vmm_realloc");
    vmm_status_string_fn = (vmm_status_string_t)vmm_fn("vmm_status_string");
    vmm_trim_fn = (vmm_trim_t)vmm_fn("vmm_trim");
    if (!vmm_realloc_fn) {
        printf("SKIP grow_vector: libvmmhook is not loaded (vmm_realloc not found); run it as\n"
               "  LD_PRELOAD=/path/to/libvmmhook.so %s\n",
               argv[0]);
        return 77;
    }

    CK(cudaSetDevice(0));
    CK(cudaFree(nullptr));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    g_blocks = prop.multiProcessorCount * 8;
    size_t fr = 0, tot = 0;
    CK(cudaMemGetInfo(&fr, &tot));
    /* The steps: one warm-up 2 MiB step after the doublings, then tail_steps timed ones. */
    const int tail_total = tail_steps + 1;
    /* Live at the peak: the copy vector twice (old + new) in phase 3; without vmm_trim the
     * vmm vector of phase 1 may still sit in the hook's cache. */
    auto need = [&](size_t g) {
        const size_t top = g * GiB + (size_t)tail_total * 2 * MiB;
        return (vmm_trim_fn ? 2 : 3) * top + GiB;
    };
    while (max_gib > 1 && need(max_gib) > fr) {
        printf("grow_vector: %.1f GiB free is not enough for %zu GiB (needs %.1f GiB): using %zu "
               "GiB\n",
               (double)fr / GiB, max_gib, (double)need(max_gib) / GiB, max_gib / 2);
        max_gib /= 2;
    }
    const size_t max_bytes = max_gib * GiB;
    printf("grow_vector: %s, %.1f GiB free; growing to %zu GiB, then %d steps of 2 MiB (the "
           "first a warm-up)\n",
           prop.name, (double)fr / GiB, max_gib, tail_total);
    printf("grow_vector: phases run apart: the reference, the vmm_realloc vector, then (after "
           "freeing it%s) the copy-based vector; each timed grow starts on an idle device\n",
           vmm_trim_fn ? " and vmm_trim" : "");

    /* The steps, shared by both vectors: from 1 MiB, doubling to max, then 2 MiB at a time. */
    std::vector<size_t> sizes; /* size after step i */
    std::vector<int> tail_idx; /* -1: doubling; 0: the warm-up 2 MiB step; 1..: timed */
    for (size_t n = 1 * MiB; n < max_bytes;) {
        n *= 2;
        sizes.push_back(n);
        tail_idx.push_back(-1);
    }
    for (int k = 0; k < tail_total; ++k) {
        sizes.push_back(max_bytes + (size_t)(k + 1) * 2 * MiB);
        tail_idx.push_back(k);
    }
    const size_t nsteps = sizes.size();

    unsigned long long *d_bad = nullptr;
    CK(cudaMalloc(&d_bad, sizeof *d_bad));
    unsigned long long total_bad = 0;

    /* Phase 0, the reference: a 64 MiB vector grown by 2 MiB, for "independent of the size". */
    std::vector<double> ref_us;
    {
        uint32_t *r = nullptr;
        size_t n = 64 * MiB;
        grow_vmm(&r, n);
        fill(r, 0, n);
        for (int i = 0; i < tail_total; ++i) {
            double us = grow_vmm(&r, n + 2 * MiB);
            fill(r, n, n + 2 * MiB);
            n += 2 * MiB;
            if (i > 0) /* the first grow is a warm-up */
                ref_us.push_back(us);
        }
        unsigned long long bad = check(r, n, d_bad);
        total_bad += bad;
        if (bad)
            printf("grow_vector: reference vector: %llu mismatches\n", bad);
        vmm_realloc_fn((void **)&r, 0);
        trim_idle();
    }
    const double ref = median(ref_us);
    printf("grow_vector: 64 MiB + 2 MiB reference, vmm_realloc us per step:");
    for (double us : ref_us)
        printf(" %.1f", us);
    printf("\n");

    char sz[48];
    std::vector<double> vmm_us(nsteps), copy_us(nsteps);
    std::vector<char> moved(nsteps);
    std::vector<unsigned long long> bad_vmm(nsteps), bad_copy(nsteps);

    /* Phase 1: the vmm_realloc vector through every step, verified after each (untimed). */
    printf("\nphase 1: vmm_realloc vector\n%4s  %-16s %14s %8s  %s\n", "step", "size",
           "vmm_realloc us", "moved", "check (mismatches)");
    {
        uint32_t *v = nullptr;
        size_t n = 1 * MiB;
        grow_vmm(&v, n);
        fill(v, 0, n);
        for (size_t i = 0; i < nsteps; ++i) {
            const size_t next = sizes[i];
            uint32_t *before = v;
            vmm_us[i] = grow_vmm(&v, next);
            moved[i] = v != before;
            fill(v, n, next);
            bad_vmm[i] = check(v, next, d_bad);
            total_bad += bad_vmm[i];
            size_str(sz, sizeof sz, next);
            printf("%4zu  %-16s %14.1f %8s  %s (%llu)%s\n", i + 1, sz, vmm_us[i],
                   moved[i] ? "yes" : "no", bad_vmm[i] ? "FAIL" : "ok", bad_vmm[i],
                   tail_idx[i] == 0 ? "  [warm-up]" : "");
            n = next;
        }
        /* Phase 2: free it, and give the idle memory back before the copy-based phase. */
        vmm_realloc_fn((void **)&v, 0);
        trim_idle();
    }

    /* Phase 3: the copy-based vector through the same steps. */
    printf("\nphase 3: copy-based vector (cudaMalloc new + cudaMemcpy D2D + cudaFree old)\n"
           "%4s  %-16s %14s %8s %16s %9s  %s\n",
           "step", "size", "vmm_realloc us", "moved", "copy-based us", "copy/vmm",
           "check (mismatches vmm / copy)");
    {
        uint32_t *c = nullptr;
        size_t n = 1 * MiB;
        CK(cudaMalloc(&c, n));
        fill(c, 0, n);
        for (size_t i = 0; i < nsteps; ++i) {
            const size_t next = sizes[i];
            copy_us[i] = grow_copy(&c, n, next);
            fill(c, n, next);
            bad_copy[i] = check(c, next, d_bad);
            total_bad += bad_copy[i];
            size_str(sz, sizeof sz, next);
            printf("%4zu  %-16s %14.1f %8s %16.1f %8.0fx  %s (%llu / %llu)%s\n", i + 1, sz,
                   vmm_us[i], moved[i] ? "yes" : "no", copy_us[i], copy_us[i] / vmm_us[i],
                   bad_vmm[i] + bad_copy[i] ? "FAIL" : "ok", bad_vmm[i], bad_copy[i],
                   tail_idx[i] == 0 ? "  [warm-up]" : "");
            n = next;
        }
        CK(cudaFree(c));
    }
    CK(cudaFree(d_bad));

    std::vector<double> tail_vmm, tail_copy;
    for (size_t i = 0; i < nsteps; ++i)
        if (tail_idx[i] > 0) {
            tail_vmm.push_back(vmm_us[i]);
            tail_copy.push_back(copy_us[i]);
        }
    const double mv = median(tail_vmm), mc = median(tail_copy);
    const double minv = *std::min_element(tail_vmm.begin(), tail_vmm.end());
    const double minc = *std::min_element(tail_copy.begin(), tail_copy.end());
    const double minr = *std::min_element(ref_us.begin(), ref_us.end());
    const bool flat = mv <= 1.5 * ref, fast = mc >= 100 * mv;
    printf("\n");
    if (total_bad)
        printf("grow_vector: FAIL: %llu mismatching elements\n", total_bad);
    else
        printf("grow_vector: contents verified after every step\n");
    printf("grow_vector: %zu GiB + k*2 MiB steps (median of %zu, warm-up apart): vmm_realloc "
           "min %.1f us, copy-based min %.1f us; 64 MiB + 2 MiB min %.1f us\n",
           max_gib, tail_vmm.size(), minv, minc, minr);
    printf("RESULT grow_vector.%zuGiB_plus_2MiB.vmm_us %.1f\n", max_gib, mv);
    printf("RESULT grow_vector.%zuGiB_plus_2MiB.copy_us %.1f\n", max_gib, mc);
    printf("RESULT grow_vector.64MiB_plus_2MiB.vmm_us %.1f\n", ref);
    printf("RESULT grow_vector.%zuGiB_plus_2MiB.vmm_min_us %.1f\n", max_gib, minv);
    printf("RESULT grow_vector.%zuGiB_plus_2MiB.copy_min_us %.1f\n", max_gib, minc);
    printf("RESULT grow_vector.64MiB_plus_2MiB.vmm_min_us %.1f\n", minr);
    printf("%zu GiB + 2 MiB grow (median of %zu): vmm_realloc %.1f us, copy-based %.1f us: %.0fx "
           "faster (done when >= 100x: %s); 64 MiB + 2 MiB: %.1f us, so %.2fx (size-independent "
           "when <= 1.5x: %s)\n",
           max_gib, tail_vmm.size(), mv, mc, mc / mv, fast ? "PASS" : "MISS", ref, mv / ref,
           flat ? "PASS" : "MISS");
    return total_bad ? 1 : 0;
}
