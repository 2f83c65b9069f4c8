/* Interpose test 4: multithreaded allocation churn through the hook, cudart style.
 *
 * THREADS threads, each with its context current, keep up to LIVE buffers of mixed sizes (70%
 * under 64 KiB, 25% under 8 MiB, 5% under 32 MiB, the mix of driver-facts 2) and replace them at
 * random, freeing with cuMemFree, cuMemFreeAsync or cuMemFreeAsync_ptsz (half of the threads
 * fetched the per-thread flavour). Every buffer carries its owner's tag in its first and last
 * 8 bytes, written after the allocation and checked before the free, so that two buffers sharing
 * memory are caught; every buffer must be served and must answer a range query with its own base
 * and size. At the end nothing is left in the simulated driver after vmm_trim.
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "ip_common.h"
#include "simdrv.h"

#define THREADS 8
#define LIVE 24
#define OPS 4000

static ip_driver_t driver; /* libcuda.so.1 opened, its controls, the library's lookups */
static CUcontext ctx;

static atomic_int errors_alloc, errors_free, errors_owned, errors_range, errors_tag, served_n;

static uint64_t next_rand(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static size_t pick_size(uint64_t *s)
{
    uint64_t r = next_rand(s) % 100;
    if (r < 70)
        return 1 + next_rand(s) % (64 << 10);
    if (r < 95)
        return 1 + next_rand(s) % (8 << 20);
    return 1 + next_rand(s) % (32 << 20);
}

struct slot {
    CUdeviceptr p;
    size_t size;
    uint64_t tag;
};

static void put_tag(struct slot *b)
{
    size_t n = b->size < 8 ? b->size : 8;
    driver.sim.sim_write(b->p, &b->tag, n);
    if (b->size >= 16)
        driver.sim.sim_write(b->p + b->size - 8, &b->tag, 8);
}

static bool tag_ok(const struct slot *b)
{
    uint64_t head = 0, tail = 0;
    size_t n = b->size < 8 ? b->size : 8;
    if (driver.sim.sim_read(&head, b->p, n) != CUDA_SUCCESS || memcmp(&head, &b->tag, n))
        return false;
    if (b->size >= 16 &&
        (driver.sim.sim_read(&tail, b->p + b->size - 8, 8) != CUDA_SUCCESS || tail != b->tag))
        return false;
    return true;
}

static void *worker(void *arg)
{
    int id = (int)(intptr_t)arg;
    bool ptsz = id % 2;
    cuuint64_t flags = ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0;
    PFN_cuCtxSetCurrent_v4000 set_current =
        ip_fetch(driver.getproc, "cuCtxSetCurrent", 12000, flags);
    PFN_cuMemAlloc_v3020 mem_alloc = ip_fetch(driver.getproc, "cuMemAlloc", 12000, flags);
    PFN_cuMemFree_v3020 mem_free = ip_fetch(driver.getproc, "cuMemFree", 12000, flags);
    PFN_cuMemFreeAsync_v11020 free_async = ip_fetch(driver.getproc, "cuMemFreeAsync", 12000, flags);
    PFN_cuMemGetAddressRange_v3020 range =
        ip_fetch(driver.getproc, "cuMemGetAddressRange", 13000, flags);
    set_current(ctx);

    struct slot live[LIVE] = {{0}};
    uint64_t rnd = 0x9e3779b97f4a7c15ULL * (uint64_t)(id + 1);
    for (int op = 0; op < OPS; op++) {
        struct slot *b = &live[next_rand(&rnd) % LIVE];
        if (b->p) {
            if (!tag_ok(b))
                atomic_fetch_add(&errors_tag, 1);
            CUresult rc;
            if (next_rand(&rnd) % 2)
                rc = mem_free(b->p);
            else
                rc = free_async(b->p, NULL); /* the _ptsz flavour on odd threads */
            if (rc != CUDA_SUCCESS)
                atomic_fetch_add(&errors_free, 1);
            b->p = 0;
        }
        b->size = pick_size(&rnd);
        b->tag = ((uint64_t)id << 48) | (uint64_t)op;
        if (mem_alloc(&b->p, b->size) != CUDA_SUCCESS) {
            atomic_fetch_add(&errors_alloc, 1);
            b->p = 0;
            continue;
        }
        if (driver.vmm_owns((const void *)(uintptr_t)b->p))
            atomic_fetch_add(&served_n, 1);
        else
            atomic_fetch_add(&errors_owned, 1);
        CUdeviceptr base = 0;
        size_t len = 0;
        if (range(&base, &len, b->p + b->size - 1) != CUDA_SUCCESS || base != b->p ||
            len != b->size)
            atomic_fetch_add(&errors_range, 1);
        put_tag(b);
    }
    for (int i = 0; i < LIVE; i++) {
        if (!live[i].p)
            continue;
        if (!tag_ok(&live[i]))
            atomic_fetch_add(&errors_tag, 1);
        if (mem_free(live[i].p) != CUDA_SUCCESS)
            atomic_fetch_add(&errors_free, 1);
    }
    return NULL;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ip_churn: %d threads x %d operations, up to %d live buffers each\n", THREADS, OPS,
           LIVE);
    ip_require_preloaded();
    driver = ip_open_driver();

    PFN_cuInit_v2000 init = ip_fetch(driver.getproc, "cuInit", 12000, 0);
    PFN_cuDevicePrimaryCtxRetain_v7000 retain =
        ip_fetch(driver.getproc, "cuDevicePrimaryCtxRetain", 12000, 0);
    CHECK_RC(init(0), CUDA_SUCCESS, "cuInit");
    CHECK_RC(retain(&ctx, 0), CUDA_SUCCESS, "cuDevicePrimaryCtxRetain");

    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);

    CHECK(atomic_load(&served_n) == THREADS * OPS && atomic_load(&errors_owned) == 0,
          "every allocation served (%d of %d)", atomic_load(&served_n), THREADS * OPS);
    CHECK(atomic_load(&errors_alloc) == 0, "no allocation failed (%d did)",
          atomic_load(&errors_alloc));
    CHECK(atomic_load(&errors_free) == 0, "no free failed (%d did)", atomic_load(&errors_free));
    CHECK(atomic_load(&errors_range) == 0, "every range query answered the buffer (%d did not)",
          atomic_load(&errors_range));
    CHECK(atomic_load(&errors_tag) == 0,
          "no buffer's tag was overwritten by another buffer (%d were)", atomic_load(&errors_tag));
    CHECK(driver.sim.sim_live_native() == 0, "no native allocation was made");
    driver.vmm_trim();
    bool empty = driver.sim.sim_ledger_empty();
    CHECK(empty, "after vmm_trim the driver holds nothing (%zu mappings, %zu reservations)",
          driver.sim.sim_live_mappings(), driver.sim.sim_live_reservations());
    if (!empty)
        driver.sim.sim_ledger_dump();
    return ip_finish("ip_churn");
}
