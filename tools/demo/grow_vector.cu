/* grow_vector: the README demo of issue 4, a device vector grown by vmm_realloc.
 *
 *   LD_PRELOAD=/path/to/libvmmhook.so ./grow_vector [--max-gib N] [--tail-steps N]
 *
 * A vector of uint32_t grows from 1 MiB, doubling to N GiB (default 8), then by 2 MiB at a
 * time (default 5 steps). After every step a kernel writes the new tail (a hash of the index)
 * and another checks the whole vector, counting mismatches into a device counter: what was
 * there before the grow must still be there. Beside it, a second vector with the same contents
 * grows the classic way (cudaMalloc new, cudaMemcpy device-to-device, cudaFree old) and is
 * checked the same way. Both grows are timed with the steady clock around the host calls plus
 * a cudaDeviceSynchronize (the copy is part of the classic grow's cost). Under the hook the
 * classic grow's cudaMalloc/cudaFree are served by the hook too: that is what an unaware
 * program gets; its cost is the copy, which grows with the vector.
 *
 * The last line states the issue's "Done when": growing the N GiB vector by 2 MiB costs a time
 * independent of its size (judged: the median N GiB + 2 MiB grow within 1.5x of the median
 * 64 MiB + 2 MiB grow, measured first on a separate vector) and at least 100 times less than
 * the copy-based grow.
 *
 * vmm_realloc is fetched with vmm_fn() from vmmhook.h: no link against the library.
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
vmm_realloc_t vmm_realloc_fn;
vmm_status_string_t vmm_status_string_fn;

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

/* Grows by vmm_realloc; returns microseconds (host call + device synchronize). */
double grow_vmm(uint32_t **v, size_t bytes)
{
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

/* Grows the classic way; returns microseconds. */
double grow_copy(uint32_t **v, size_t old_bytes, size_t bytes)
{
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
    int tail_steps = 5;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--max-gib") && i + 1 < argc)
            max_gib = strtoull(argv[++i], nullptr, 10);
        else if (!strcmp(argv[i], "--tail-steps") && i + 1 < argc)
            tail_steps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: grow_vector [--max-gib N (power of 2, default 8)] "
                            "[--tail-steps N (default 5)]\n");
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
    /* Live at the peak: the vmm vector (max + tail) and the copy vector twice (old + new). */
    auto need = [&](size_t g) { return 3 * (g * GiB + (size_t)tail_steps * 2 * MiB) + GiB; };
    while (max_gib > 1 && need(max_gib) > fr) {
        printf("grow_vector: %.1f GiB free is not enough for %zu GiB (needs %.1f GiB): using %zu "
               "GiB\n",
               (double)fr / GiB, max_gib, (double)need(max_gib) / GiB, max_gib / 2);
        max_gib /= 2;
    }
    printf("grow_vector: %s, %.1f GiB free; growing to %zu GiB, then %d steps of 2 MiB\n",
           prop.name, (double)fr / GiB, max_gib, tail_steps);

    unsigned long long *d_bad = nullptr;
    CK(cudaMalloc(&d_bad, sizeof *d_bad));
    unsigned long long total_bad = 0;

    /* Reference: a 64 MiB vector grown by 2 MiB, for "independent of the size". */
    std::vector<double> ref_us;
    {
        uint32_t *r = nullptr;
        size_t n = 64 * MiB;
        grow_vmm(&r, n);
        fill(r, 0, n);
        for (int i = 0; i < tail_steps + 1; ++i) {
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
    }
    const double ref = median(ref_us);

    printf("\n%4s  %-16s %14s %8s %16s %9s  %s\n", "step", "size", "vmm_realloc us", "moved",
           "copy-based us", "copy/vmm", "check (mismatches vmm / copy)");
    uint32_t *v = nullptr, *c = nullptr;
    size_t n = 1 * MiB;
    grow_vmm(&v, n);
    CK(cudaMalloc(&c, n));
    fill(v, 0, n);
    fill(c, 0, n);
    std::vector<double> tail_vmm, tail_copy;
    const size_t max_bytes = max_gib * GiB;
    int step = 0;
    while (true) {
        const bool tail = n >= max_bytes; /* doubling done: 2 MiB steps from here */
        if (tail && (int)tail_vmm.size() >= tail_steps)
            break;
        const size_t next = tail ? n + 2 * MiB : n * 2;
        uint32_t *before = v;
        const double tv = grow_vmm(&v, next);
        const double tc = grow_copy(&c, n, next);
        fill(v, n, next);
        fill(c, n, next);
        unsigned long long bv = check(v, next, d_bad);
        unsigned long long bc = check(c, next, d_bad);
        total_bad += bv + bc;
        char sz[48];
        size_str(sz, sizeof sz, next);
        printf("%4d  %-16s %14.1f %8s %16.1f %8.0fx  %s (%llu / %llu)\n", ++step, sz, tv,
               v == before ? "no" : "yes", tc, tc / tv, bv + bc ? "FAIL" : "ok", bv, bc);
        if (tail) {
            tail_vmm.push_back(tv);
            tail_copy.push_back(tc);
        }
        n = next;
    }
    CK(cudaFree(c));
    vmm_realloc_fn((void **)&v, 0);
    CK(cudaFree(d_bad));

    const double mv = median(tail_vmm), mc = median(tail_copy);
    const bool flat = mv <= 1.5 * ref, fast = mc >= 100 * mv;
    printf("\n");
    if (total_bad)
        printf("grow_vector: FAIL: %llu mismatching elements\n", total_bad);
    else
        printf("grow_vector: contents verified after every step\n");
    printf("RESULT grow_vector.%zuGiB_plus_2MiB.vmm_us %.1f\n", max_gib, mv);
    printf("RESULT grow_vector.%zuGiB_plus_2MiB.copy_us %.1f\n", max_gib, mc);
    printf("RESULT grow_vector.64MiB_plus_2MiB.vmm_us %.1f\n", ref);
    printf("%zu GiB + 2 MiB grow (median of %zu): vmm_realloc %.1f us, copy-based %.1f us: %.0fx "
           "faster (done when >= 100x: %s); 64 MiB + 2 MiB: %.1f us, so %.2fx (size-independent "
           "when <= 1.5x: %s)\n",
           max_gib, tail_vmm.size(), mv, mc, mc / mv, fast ? "PASS" : "MISS", ref, mv / ref,
           flat ? "PASS" : "MISS");
    return total_bad ? 1 : 0;
}
