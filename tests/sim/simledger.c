/* simdrv: the ledger as the tests see it: sim_reset (everything the driver holds let go, the
 * configuration applied), the configuration and switches, and the queries of what is live
 * (sim_ledger_empty, sim_ledger_dump and the counts every test ends on). */
#include "simint.h"

/* sim_reset's first half: everything the driver holds let go. Mappings before handles, so that
 * each allocation goes with its last reference (a leftover one is a ledger bug); then the
 * reservations, native blocks, and the other sources' work, contexts and host memory. */
static void wipe(void)
{
    S.nexports = 0; /* a reset forgets exported descriptors: they keep nothing alive any more */
    allocs_sweep_held();
    while (S.maps.n)
        map_destroy((sim_map_t *)S.maps.v[S.maps.n - 1]);
    while (S.handles.n) {
        sim_handle_t *h = (sim_handle_t *)S.handles.v[S.handles.n - 1];
        vec_remove(&S.handles, h);
        h->a->nhandles--;
        alloc_maybe_free(h->a);
        free(h);
    }
    if (S.allocs)
        die("wipe: allocation left with no handle and no mapping");
    while (S.resvs.n) {
        sim_iv_t *r = S.resvs.v[S.resvs.n - 1];
        vec_remove(&S.resvs, r);
        free(r);
    }
    while (S.natives.n)
        native_destroy((sim_native_t *)S.natives.v[S.natives.n - 1]);
    work_wipe();
    contexts_wipe();
    hosts_wipe();
    S.nexports = 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Configuration and control                                                                 */

size_t env_size(const char *name, size_t dflt)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return dflt;
    char *end;
    unsigned long long v = strtoull(s, &end, 0);
    switch (*end) {
    case 'k': case 'K': v *= KiB; break;
    case 'm': case 'M': v *= MiB; break;
    case 'g': case 'G': v *= GiB; break;
    case 't': case 'T': v *= TiB; break;
    default: break;
    }
    return (size_t)v;
}

void reset_locked(const sim_config_t *cfg)
{
    wipe();
    sim_config_t c = cfg ? *cfg : (sim_config_t){0};
    if (c.devices <= 0)
        c.devices = 1;
    if (c.devices > SIM_MAX_DEVICES)
        die("at most %d devices", SIM_MAX_DEVICES);
    if (!c.memory)
        c.memory = 80 * GiB;
    if (!c.host_memory)
        c.host_memory = 256 * GiB;
    if (!c.granularity)
        c.granularity = 2 * MiB;
    if (!is_pow2(c.granularity))
        die("granularity %zu is not a power of two", c.granularity);
    if (!c.recommended)
        c.recommended = c.granularity;
    if (!c.va_size)
        c.va_size = VA_MAX_SIZE;
    if (c.va_size > VA_MAX_SIZE)
        die("va_size above %llu", VA_MAX_SIZE);
    c.va_size &= ~(c.granularity - 1);
    if (!c.va_gap)
        c.va_gap = 1 * GiB;
    if (c.va_gap == SIM_VA_GAP_NONE)
        c.va_gap = 0;
    S.cfg = c;
    memset(S.ctx, 0, sizeof S.ctx);
    for (int d = 0; d < c.devices; d++) {
        S.ctx[d].iv.ptr = (CUdeviceptr)(uintptr_t)&S.ctx[d];
        S.ctx[d].iv.span = 1;
        S.ctx[d].magic = CTX_MAGIC;
        S.ctx[d].device = d;
        S.ctx[d].primary = true;
    }
    memset(S.primary_refs, 0, sizeof S.primary_refs);
    memset(S.peer, 0, sizeof S.peer);
    memset(S.used, 0, sizeof S.used);
    S.host_used = 0;
    S.res_rover = VA_BASE;
    S.nat_rover = NAT_BASE;
    S.refuse_hints = false;
    S.hazards = 0;
    S.total = 0;
    memset(S.calls, 0, sizeof S.calls);
    S.nfaults = 0;
    S.fired = 0;
    S.tracing = false;
    S.ntrace = 0;
    S.trace_calls = 0;
    S.gen++;
    S.initialized = true;
    S.forked_child = false; /* a test may start afresh in a child */
    T.gen = S.gen;
    T.depth = 0;
    T.capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
    if (!c.no_current_context)
        T.stack[T.depth++] = &S.ctx[0];
}

void sim_reset(const sim_config_t *cfg)
{
    LOCKED;
    reset_locked(cfg);
}

sim_config_t sim_get_config(void)
{
    LOCKED;
    return S.cfg;
}

void sim_refuse_hints(bool refuse)
{
    LOCKED;
    S.refuse_hints = refuse;
}

void sim_set_verbose(bool verbose)
{
    LOCKED;
    S.verbose = verbose;
}

size_t sim_live_allocations(void)
{
    LOCKED;
    allocs_sweep_held();
    return S.nallocs;
}

size_t sim_live_handles(void)
{
    LOCKED;
    return S.handles.n;
}

size_t sim_live_reservations(void)
{
    LOCKED;
    return S.resvs.n;
}

size_t sim_live_mappings(void)
{
    LOCKED;
    return S.maps.n;
}

size_t sim_live_native(void)
{
    LOCKED;
    return S.natives.n;
}

bool sim_ledger_empty(void)
{
    LOCKED;
    allocs_sweep_held();
    return !S.nallocs && !S.handles.n && !S.resvs.n && !S.maps.n && !S.natives.n && !S.hosts.n;
}

void sim_ledger_fdump(FILE *out)
{
    LOCKED;
    allocs_sweep_held();
    fprintf(out, "simdrv ledger: %zu allocations, %zu handles, %zu reservations, %zu mappings, "
                 "%zu native, %zu pinned host ranges, %zu streams, %zu created contexts, "
                 "%zu graphs, %zu queued operations, %lu hazards\n",
            S.nallocs, S.handles.n, S.resvs.n, S.maps.n, S.natives.n, S.hosts.n, S.streams.n,
            S.ctxs_live, S.graphs.n, S.nops, S.hazards);
    for (size_t i = 0; i < S.hosts.n; i++) {
        sim_host_t *h = (sim_host_t *)S.hosts.v[i];
        fprintf(out, "  pinned host %p: %zu bytes (%s)\n", (void *)(uintptr_t)h->iv.ptr,
                h->iv.span, h->registered ? "cuMemHostRegister" : "cuMemHostAlloc");
    }
    for (sim_alloc_t *a = S.allocs; a; a = a->next)
        fprintf(out, "  allocation #%llu: %zu bytes on %s %d, %u handles, %u mappings\n", a->id,
                a->size, a->device >= 0 ? "device" : "host", a->device, a->nhandles, a->nmaps);
    for (size_t i = 0; i < S.handles.n; i++) {
        sim_handle_t *h = (sim_handle_t *)S.handles.v[i];
        fprintf(out, "  handle 0x%llx -> allocation #%llu\n", (unsigned long long)h->iv.ptr,
                h->a->id);
    }
    for (size_t i = 0; i < S.resvs.n; i++)
        fprintf(out, "  reservation [0x%llx, +0x%zx)\n", (unsigned long long)S.resvs.v[i]->ptr,
                S.resvs.v[i]->span);
    for (size_t i = 0; i < S.maps.n; i++) {
        sim_map_t *m = (sim_map_t *)S.maps.v[i];
        fprintf(out, "  mapping [0x%llx, +0x%zx) of allocation #%llu\n",
                (unsigned long long)m->iv.ptr, m->iv.span, m->a->id);
    }
    for (size_t i = 0; i < S.natives.n; i++) {
        sim_native_t *n = (sim_native_t *)S.natives.v[i];
        fprintf(out, "  native 0x%llx: %zu bytes on device %d\n", (unsigned long long)n->iv.ptr,
                n->size, n->device);
    }
    for (int d = 0; d < ndev(); d++)
        fprintf(out, "  device %d: %zu of %zu bytes used\n", d, S.used[d], S.cfg.memory);
    fprintf(out, "  host-located: %zu of %zu bytes used\n", S.host_used, S.cfg.host_memory);
}

void sim_ledger_dump(void) { sim_ledger_fdump(stderr); }

bool sim_is_mapped(CUdeviceptr p)
{
    LOCKED;
    return vec_find(&S.maps, p) != NULL;
}

size_t sim_range_mapped_bytes(CUdeviceptr p, size_t n)
{
    LOCKED;
    size_t total = 0;
    if (p + n < p)
        n = (size_t)(~(CUdeviceptr)0 - p);
    size_t i = vec_upper(&S.maps, p);
    if (i > 0)
        i--;
    for (; i < S.maps.n && S.maps.v[i]->ptr < p + n; i++) {
        sim_iv_t *m = S.maps.v[i];
        CUdeviceptr lo = m->ptr > p ? m->ptr : p;
        CUdeviceptr hi = m->ptr + m->span < p + n ? m->ptr + m->span : p + n;
        if (hi > lo)
            total += hi - lo;
    }
    return total;
}

bool sim_is_reserved(CUdeviceptr p)
{
    LOCKED;
    return vec_find(&S.resvs, p) != NULL;
}

unsigned sim_access_flags(CUdeviceptr p, int device)
{
    LOCKED;
    sim_map_t *m = vec_find(&S.maps, p);
    if (!m || device < 0 || device >= ndev())
        return 0;
    return m->acc[(p - m->iv.ptr) / gran() * (size_t)ndev() + (size_t)device];
}

size_t sim_device_used(int device)
{
    LOCKED;
    allocs_sweep_held();
    return device >= 0 && device < ndev() ? S.used[device] : 0;
}

size_t sim_host_used(void)
{
    LOCKED;
    allocs_sweep_held();
    return S.host_used;
}

size_t sim_device_capacity(int device)
{
    LOCKED;
    return device >= 0 && device < ndev() ? S.cfg.memory : 0;
}

size_t sim_reserved_bytes(void)
{
    LOCKED;
    size_t t = 0;
    for (size_t i = 0; i < S.resvs.n; i++)
        t += S.resvs.v[i]->span;
    return t;
}
