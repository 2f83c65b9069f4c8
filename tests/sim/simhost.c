/* simdrv: pinned host memory (cuMemHostAlloc / cuMemFreeHost, cuMemHostRegister /
 * cuMemHostUnregister).
 *
 * cuMemHostAlloc gives real, zeroed host memory the program can touch (mmap'ed here); both kinds
 * are ledger entries (sim_ledger_empty is false while any is left) and count in
 * sim_host_pinned_bytes. A pinned range matters to the async copies (simwork.c): they read or
 * write it when they land, so freeing or unregistering it while one is queued is a hazard. */
#include "simint.h"

/* CU_MEMHOSTALLOC_PORTABLE | DEVICEMAP | WRITECOMBINED */
#define HOSTALLOC_FLAGS 0x7u
/* CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY */
#define HOSTREGISTER_FLAGS 0xfu

static CUdeviceptr addr(const void *p) { return (CUdeviceptr)(uintptr_t)p; }

bool host_range_pinned(const void *p, size_t n)
{
    sim_host_t *h = vec_find(&S.hosts, addr(p));
    return h && addr(p) - h->iv.ptr <= h->iv.span && n <= h->iv.span - (addr(p) - h->iv.ptr);
}

static sim_host_t *host_add(const void *p, size_t n, bool registered)
{
    sim_host_t *h = xcalloc(1, sizeof *h);
    h->iv.ptr = addr(p);
    h->iv.span = n;
    h->registered = registered;
    vec_insert(&S.hosts, h);
    S.host_pinned += n;
    return h;
}

static void host_remove(sim_host_t *h)
{
    vec_remove(&S.hosts, h);
    S.host_pinned -= h->iv.span;
    if (!h->registered)
        munmap((void *)(uintptr_t)h->iv.ptr, h->iv.span);
    free(h);
}

CUresult SIM_IMPL(cuMemHostAlloc)(void **pp, size_t bytesize, unsigned int Flags)
{
    SIM_ENTER(cuMemHostAlloc);
    NEED_CTX(dev);
    (void)dev;
    if (!pp)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemHostAlloc: NULL");
    if (Flags & ~HOSTALLOC_FLAGS)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc: flags 0x%x", Flags);
    if (!bytesize)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemHostAlloc: size 0");
    void *p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "cuMemHostAlloc: %zu bytes: %s", bytesize,
                      strerror(errno));
    host_add(p, bytesize, false);
    *pp = p;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemFreeHost)(void *p)
{
    SIM_ENTER(cuMemFreeHost);
    NEED_CTX(dev);
    (void)dev;
    /* cudaFreeHost synchronizes like cudaFree: potentially unsafe during capture */
    CUresult rc = capture_allows("cuMemFreeHost");
    if (rc)
        return rc;
    sim_host_t *h = p ? vec_exact(&S.hosts, addr(p)) : NULL;
    if (!h || h->registered)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemFreeHost: %p is not from cuMemHostAlloc", p);
    work_land_ctx(cur_ctx());
    hazard_check_host("cuMemFreeHost", p, h->iv.span, true);
    host_remove(h);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemHostRegister)(void *p, size_t bytesize, unsigned int Flags)
{
    SIM_ENTER(cuMemHostRegister);
    NEED_CTX(dev);
    (void)dev;
    if (!p || !bytesize)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemHostRegister: empty range");
    if (Flags & ~HOSTREGISTER_FLAGS)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemHostRegister: flags 0x%x", Flags);
    if (addr(p) + bytesize < addr(p))
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemHostRegister: range wraps");
    if (!vec_range_free(&S.hosts, addr(p), bytesize))
        return reject(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                      "cuMemHostRegister: [%p, +%zu) overlaps pinned memory", p, bytesize);
    host_add(p, bytesize, true);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemHostUnregister)(void *p)
{
    SIM_ENTER(cuMemHostUnregister);
    NEED_CTX(dev);
    (void)dev;
    sim_host_t *h = p ? vec_exact(&S.hosts, addr(p)) : NULL;
    if (!h || !h->registered)
        return reject(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
                      "cuMemHostUnregister: %p does not start a registered range", p);
    /* the memory stays the program's: a queued copy still runs, but it was wrong to unpin */
    hazard_check_host("cuMemHostUnregister", p, h->iv.span, false);
    host_remove(h);
    return CUDA_SUCCESS;
}

void hosts_wipe(void)
{
    while (S.hosts.n)
        host_remove((sim_host_t *)S.hosts.v[S.hosts.n - 1]);
    S.host_pinned = 0;
}

size_t sim_live_host(void)
{
    LOCKED;
    return S.hosts.n;
}

size_t sim_host_pinned_bytes(void)
{
    LOCKED;
    return S.host_pinned;
}
