/* simdrv: the strict simulated CUDA driver. See simdrv.h for what is simulated, simint.h for
 * how the sources divide it. This file: the state, helpers, ledger, control API, devices, VMM,
 * the native allocator, pointer queries, IPC, errors, the table, cuGetProcAddress and fork. */
#include "simint.h"

#include <dirent.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>

#define VA_BASE 0x100000000000ULL /* 16 TiB: reservations */
#define VA_MAX_SIZE (64ULL * TiB)
#define NAT_BASE 0x500000000000ULL /* 80 TiB: native blocks */
#define NAT_SPAN (4ULL * TiB)
#define NAT_ALIGN 512ULL
#define MAX_FAULTS (sizeof S.faults / sizeof S.faults[0])
#define TRACE_MAX (1u << 20)
#define DRIVER_VERSION 13000

static const char *const fn_names[SIM_E_COUNT] = {
#define SIM_NAME(name, params) #name,
    SIM_FUNCS(SIM_NAME)
#undef SIM_NAME
};

sim_state_t S = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .next_id = 1,
    .next_handle = 0x51d000000000ULL,
};

__thread sim_thread_t T;
static __thread char last_reason[256];

/* ---------------------------------------------------------------------------------------- */
/* Helpers                                                                                   */

void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("simdrv: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

CUresult reject(CUresult code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_reason, sizeof last_reason, fmt, ap);
    va_end(ap);
    if (S.verbose)
        fprintf(stderr, "simdrv: rejected (%d): %s\n", (int)code, last_reason);
    return code;
}

int sim_lock(void)
{
    pthread_mutex_lock(&S.mu);
    return 1;
}

void sim_unlock_cleanup(int *held)
{
    (void)held;
    pthread_mutex_unlock(&S.mu);
}

void *xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (!p)
        die("out of host memory");
    return p;
}

void *xrealloc(void *p, size_t sz)
{
    p = realloc(p, sz ? sz : 1);
    if (!p)
        die("out of host memory");
    return p;
}

static bool is_pow2(size_t x) { return x && !(x & (x - 1)); }
static CUdeviceptr align_up(CUdeviceptr x, size_t a) { return (x + a - 1) & ~(CUdeviceptr)(a - 1); }
size_t gran(void) { return S.cfg.granularity; }
int ndev(void) { return S.cfg.devices; }
bool overlaps(CUdeviceptr a, size_t an, CUdeviceptr b, size_t bn)
{
    return a < b + bn && b < a + an;
}

/* Entry points a forked child may still call: they touch no driver state. */
static bool works_after_fork(enum sim_fn fn)
{
    return fn == SIM_E_cuDriverGetVersion || fn == SIM_E_cuGetProcAddress ||
           fn == SIM_E_cuGetErrorString || fn == SIM_E_cuGetErrorName;
}

/* Schedule perturbation for the stress runs (tools/run-tests --stress): with SIM_PERTURB set to
 * a number (the seed), every simulated driver call first does, at random, nothing (half the
 * calls), sched_yield(), or sleeps 1-50 us (1 call in 8) or 50-500 us (1 in 32). Each thread
 * draws from its own generator, seeded from the seed and the order in which threads made their
 * first call, so a seed replays the same choices per thread (not the same interleaving: the
 * kernel schedules). Unset, empty or 0: off, one relaxed load per call. */
static _Atomic uint64_t perturb_seed = UINT64_MAX; /* UINT64_MAX: not read yet; 0: off */
static atomic_uint perturb_threads;
static _Thread_local uint64_t perturb_state;

static uint64_t perturb_next(void)
{
    uint64_t x = perturb_state; /* xorshift64* */
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    perturb_state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

void sim_perturb(void)
{
    uint64_t seed = atomic_load_explicit(&perturb_seed, memory_order_relaxed);
    if (seed == 0)
        return;
    if (seed == UINT64_MAX) {
        const char *v = getenv("SIM_PERTURB");
        seed = v ? strtoull(v, NULL, 0) : 0;
        if (seed == UINT64_MAX)
            seed--;
        uint64_t expected = UINT64_MAX;
        if (atomic_compare_exchange_strong(&perturb_seed, &expected, seed) && seed)
            fprintf(stderr, "simdrv: schedule perturbation on, SIM_PERTURB=%llu\n",
                    (unsigned long long)seed);
        if (seed == 0)
            return;
    }
    if (perturb_state == 0) {
        uint64_t n = atomic_fetch_add(&perturb_threads, 1) + 1;
        perturb_state = (seed ^ (n * 0x9E3779B97F4A7C15ULL)) | 1;
    }
    uint64_t r = perturb_next();
    unsigned pick = (unsigned)(r >> 59); /* 0..31 */
    if (pick < 16)
        return;
    if (pick == 31) {
        usleep(50 + (useconds_t)((r >> 8) % 451));
    } else if (pick >= 27) {
        usleep(1 + (useconds_t)((r >> 8) % 50));
    } else {
        sched_yield();
    }
}

/* Counts the call, records it in the trace and fires a matching fault. */
CUresult sim_enter(enum sim_fn fn)
{
    S.total++;
    S.calls[fn]++;
    if (S.tracing) {
        if (S.ntrace < TRACE_MAX)
            S.trace[S.ntrace++] = fn_names[fn];
        S.trace_calls++;
    }
    /* CUDA is not usable in a child of a process that initialized it: the real driver answers
     * an error at once (measured: no child hung, driver-facts.md section 5). */
    if (S.forked_child && !works_after_fork(fn))
        return reject(CUDA_ERROR_NOT_INITIALIZED, "%s: forked child of an initialized process",
                      fn_names[fn]);
    CUresult rc = CUDA_SUCCESS;
    size_t j = 0;
    for (size_t i = 0; i < S.nfaults; i++) {
        sim_fault_t f = S.faults[i];
        unsigned long count = f.fn < 0 ? S.total : S.calls[fn];
        bool mine = f.fn < 0 || f.fn == (int)fn;
        if (mine && rc == CUDA_SUCCESS && count >= f.from && count <= f.to) {
            rc = f.code;
            S.fired++;
            snprintf(last_reason, sizeof last_reason, "%s: injected fault %d", fn_names[fn],
                     (int)rc);
            if (S.verbose)
                fprintf(stderr, "simdrv: %s\n", last_reason);
        }
        if (mine && count >= f.to)
            continue; /* spent */
        S.faults[j++] = f;
    }
    S.nfaults = j;
    if (rc == CUDA_SUCCESS)
        last_reason[0] = 0;
    return rc;
}

/* fork: the child gets a fresh lock (the parent's may have been held by a thread that does not
 * exist in the child; prepare takes it so that the child's copy of the state is consistent) and,
 * in strict mode when the parent had initialized, answers NOT_INITIALIZED from then on, as the
 * real driver does. Strict mode is opt-in (sim_set_fork_strict, SIM_FORK_STRICT=1) because the
 * IPC tests use forked children as stand-ins for other processes. */
static void fork_prepare(void) { pthread_mutex_lock(&S.mu); }
static void fork_parent(void) { pthread_mutex_unlock(&S.mu); }
static void fork_child(void)
{
    pthread_mutex_init(&S.mu, NULL);
    if (S.initialized && S.fork_strict)
        S.forked_child = true;
}

void sim_set_fork_strict(bool strict)
{
    LOCKED;
    S.fork_strict = strict;
}

__attribute__((constructor)) static void sim_register_fork_handlers(void)
{
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

bool sim_in_forked_child(void)
{
    LOCKED;
    return S.forked_child;
}

/* ---------------------------------------------------------------------------------------- */
/* Sorted vectors of intervals                                                               */

/* Index of the first element with ptr > p. */
size_t vec_upper(const sim_vec_t *s, CUdeviceptr p)
{
    size_t lo = 0, hi = s->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->v[mid]->ptr <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Element whose [ptr, ptr + span) holds p. */
void *vec_find(const sim_vec_t *s, CUdeviceptr p)
{
    size_t i = vec_upper(s, p);
    if (i == 0)
        return NULL;
    sim_iv_t *e = s->v[i - 1];
    return p - e->ptr < e->span ? e : NULL;
}

void *vec_exact(const sim_vec_t *s, CUdeviceptr p)
{
    size_t i = vec_upper(s, p);
    if (i == 0 || s->v[i - 1]->ptr != p)
        return NULL;
    return s->v[i - 1];
}

void vec_insert(sim_vec_t *s, void *obj)
{
    sim_iv_t *e = obj;
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 64;
        s->v = xrealloc(s->v, s->cap * sizeof *s->v);
    }
    size_t i = vec_upper(s, e->ptr);
    memmove(s->v + i + 1, s->v + i, (s->n - i) * sizeof *s->v);
    s->v[i] = e;
    s->n++;
}

void vec_remove(sim_vec_t *s, void *obj)
{
    sim_iv_t *e = obj;
    size_t i = vec_upper(s, e->ptr);
    while (i > 0 && s->v[i - 1] != e)
        i--;
    if (i == 0)
        die("vec_remove: element not found");
    i--;
    memmove(s->v + i, s->v + i + 1, (s->n - i - 1) * sizeof *s->v);
    s->n--;
}

bool vec_range_free(const sim_vec_t *s, CUdeviceptr p, size_t size)
{
    size_t i = vec_upper(s, p);
    if (i > 0 && s->v[i - 1]->ptr + s->v[i - 1]->span > p)
        return false;
    return i == s->n || s->v[i]->ptr >= p + size;
}

/* First address >= from, aligned, where size bytes fit below hi; 0 if none. */
static CUdeviceptr vec_gap_from(const sim_vec_t *s, CUdeviceptr from, CUdeviceptr hi, size_t size,
                                size_t align)
{
    CUdeviceptr cur = align_up(from, align);
    size_t i = vec_upper(s, cur);
    if (i > 0 && s->v[i - 1]->ptr + s->v[i - 1]->span > cur)
        i--;
    for (;; i++) {
        if (cur < from || cur > hi || hi - cur < size)
            return 0;
        if (i == s->n || s->v[i]->ptr >= cur + size)
            return cur;
        CUdeviceptr end = s->v[i]->ptr + s->v[i]->span;
        if (end > cur)
            cur = align_up(end, align);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Contents                                                                                  */

static unsigned char *backing(unsigned char **slot, size_t size)
{
    if (!*slot) {
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED)
            die("mmap of %zu bytes for contents failed: %s", size, strerror(errno));
        *slot = p;
    }
    return *slot;
}

static void drop_backing(unsigned char **slot, size_t size)
{
    if (*slot)
        munmap(*slot, size);
    *slot = NULL;
}

typedef struct loc {
    unsigned char **slot;
    size_t slot_size;
    size_t off;
    size_t avail; /* bytes from off on with the same answer */
} loc_t;

/* Where device address p lives, if device dev may read (or write) it. */
static CUresult resolve(CUdeviceptr p, int dev, bool write, loc_t *out)
{
    sim_map_t *m = vec_find(&S.maps, p);
    if (m) {
        size_t g = (p - m->iv.ptr) / gran();
        unsigned flags = m->acc[g * (size_t)ndev() + (size_t)dev];
        unsigned need = write ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
        if ((flags & need) != need)
            return reject(CUDA_ERROR_ILLEGAL_ADDRESS,
                          "0x%llx: device %d has no %s access (flags %u)", (unsigned long long)p,
                          dev, write ? "write" : "read", flags);
        out->slot = &m->a->bytes;
        out->slot_size = m->a->size;
        out->off = p - m->iv.ptr;
        out->avail = (g + 1) * gran() - out->off;
        return CUDA_SUCCESS;
    }
    sim_native_t *n = vec_find(&S.natives, p);
    if (n && p - n->iv.ptr < n->size) {
        out->slot = &n->bytes;
        out->slot_size = n->size;
        out->off = p - n->iv.ptr;
        out->avail = n->size - out->off;
        return CUDA_SUCCESS;
    }
    return reject(CUDA_ERROR_ILLEGAL_ADDRESS, "0x%llx is not mapped", (unsigned long long)p);
}

CUresult check_range(CUdeviceptr p, size_t n, int dev, bool write)
{
    if (p + n < p)
        return reject(CUDA_ERROR_ILLEGAL_ADDRESS, "%s", "range wraps");
    while (n) {
        loc_t l;
        CUresult rc = resolve(p, dev, write, &l);
        if (rc)
            return rc;
        size_t k = l.avail < n ? l.avail : n;
        p += k;
        n -= k;
    }
    return CUDA_SUCCESS;
}

/* The three below assume check_range passed. src NULL writes zeroes (fill = value). */
void do_write(CUdeviceptr p, const unsigned char *src, int fill, size_t n, int dev)
{
    while (n) {
        loc_t l;
        if (resolve(p, dev, true, &l))
            die("do_write: unchecked range");
        size_t k = l.avail < n ? l.avail : n;
        if (src || fill || *l.slot) {
            unsigned char *b = backing(l.slot, l.slot_size);
            if (src)
                memcpy(b + l.off, src, k);
            else
                memset(b + l.off, fill, k);
        }
        if (src)
            src += k;
        p += k;
        n -= k;
    }
}

void do_read(unsigned char *dst, CUdeviceptr p, size_t n, int dev)
{
    while (n) {
        loc_t l;
        if (resolve(p, dev, false, &l))
            die("do_read: unchecked range");
        size_t k = l.avail < n ? l.avail : n;
        if (*l.slot)
            memcpy(dst, *l.slot + l.off, k);
        else
            memset(dst, 0, k);
        dst += k;
        p += k;
        n -= k;
    }
}

static bool unbacked(CUdeviceptr p, size_t n, int dev)
{
    while (n) {
        loc_t l;
        if (resolve(p, dev, false, &l))
            return false;
        if (*l.slot)
            return false;
        size_t k = l.avail < n ? l.avail : n;
        p += k;
        n -= k;
    }
    return true;
}

void do_copy(CUdeviceptr dst, CUdeviceptr src, size_t n, int dev)
{
    enum { CH = 1 << 20 };
    static unsigned char buf[CH]; /* under the lock */
    bool backward = dst > src && dst < src + n;
    size_t done = 0;
    while (done < n) {
        size_t k = n - done < CH ? n - done : CH;
        size_t off = backward ? n - done - k : done;
        if (unbacked(src + off, k, dev) && unbacked(dst + off, k, dev)) {
            done += k;
            continue;
        }
        do_read(buf, src + off, k, dev);
        do_write(dst + off, buf, 0, k, dev);
        done += k;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Ledger objects                                                                            */

/* Whether a descriptor exported from allocation a is still open in this process. As with the
 * real driver, an open exported descriptor keeps the allocation alive (an importer may import
 * it later); a descriptor sent to another process is that process's (a forked child has its
 * own copy of this state). */
static bool export_fd_open(const sim_alloc_t *a)
{
    bool exported = false;
    for (size_t i = 0; i < S.nexports && !exported; i++)
        exported = S.exports[i].a == a;
    if (!exported)
        return false;
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return false;
    bool open = false;
    struct dirent *de;
    while (!open && (de = readdir(d))) {
        struct stat st;
        int fd = atoi(de->d_name);
        if (de->d_name[0] == '.' || fd == dirfd(d) || fstat(fd, &st) != 0)
            continue;
        for (size_t i = 0; i < S.nexports && !open; i++)
            open = S.exports[i].a == a && S.exports[i].dev == st.st_dev &&
                   S.exports[i].ino == st.st_ino;
    }
    closedir(d);
    return open;
}

static void alloc_maybe_free(sim_alloc_t *a)
{
    if (a->nhandles || a->nmaps)
        return;
    bool held = export_fd_open(a);
    if (held != a->held_by_fd) {
        a->held_by_fd = held;
        if (held)
            S.held_by_fd++;
        else
            S.held_by_fd--;
    }
    if (held)
        return;
    if (a->device >= 0)
        S.used[a->device] -= a->size;
    else
        S.host_used -= a->size;
    drop_backing(&a->bytes, a->size);
    for (size_t i = 0; i < S.nexports;) {
        if (S.exports[i].a == a)
            S.exports[i] = S.exports[--S.nexports];
        else
            i++;
    }
    if (a->prev)
        a->prev->next = a->next;
    else
        S.allocs = a->next;
    if (a->next)
        a->next->prev = a->prev;
    S.nallocs--;
    free(a);
}

/* Frees the allocations that only an exported descriptor kept alive once it is closed: checked
 * at the next allocation and ledger query (a close is no driver call). */
static void allocs_sweep_held(void)
{
    if (!S.held_by_fd)
        return;
    for (sim_alloc_t *a = S.allocs, *next; a; a = next) {
        next = a->next;
        if (a->held_by_fd)
            alloc_maybe_free(a);
    }
}

static CUmemGenericAllocationHandle handle_new(sim_alloc_t *a)
{
    sim_handle_t *h = xcalloc(1, sizeof *h);
    S.next_handle += 0x10;
    h->iv.ptr = S.next_handle;
    h->iv.span = 1;
    h->a = a;
    a->nhandles++;
    vec_insert(&S.handles, h);
    return h->iv.ptr;
}

static void map_destroy(sim_map_t *m)
{
    vec_remove(&S.maps, m);
    m->a->nmaps--;
    alloc_maybe_free(m->a);
    free(m->acc);
    free(m);
}

void native_destroy(sim_native_t *n)
{
    vec_remove(&S.natives, n);
    S.used[n->device] -= n->charged;
    drop_backing(&n->bytes, n->size);
    free(n);
}

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

static size_t env_size(const char *name, size_t dflt)
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

static void reset_locked(const sim_config_t *cfg)
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

const char *sim_last_reason(void) { return last_reason; }

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

unsigned long sim_call_count(void)
{
    LOCKED;
    return S.total;
}

static int fn_index(const char *name)
{
    for (int i = 0; i < SIM_E_COUNT; i++)
        if (!strcmp(fn_names[i], name))
            return i;
    die("unknown entry point name \"%s\"", name);
}

unsigned long sim_calls(const char *name)
{
    LOCKED;
    return S.calls[fn_index(name)];
}

void sim_reset_counters(void)
{
    LOCKED;
    S.total = 0;
    memset(S.calls, 0, sizeof S.calls);
    S.nfaults = 0; /* their counts were relative to the old counters */
    S.fired = 0;
}

static void add_fault(int fn, unsigned long nth, unsigned long times, CUresult code)
{
    if (S.nfaults == MAX_FAULTS)
        die("more than %zu pending faults", MAX_FAULTS);
    if (!nth)
        nth = 1;
    unsigned long base = fn < 0 ? S.total : S.calls[fn];
    sim_fault_t f = {.fn = fn, .from = base + nth, .code = code};
    f.to = times ? f.from + times - 1 : ULONG_MAX;
    S.faults[S.nfaults++] = f;
}

void sim_fail_call(unsigned long nth, CUresult code)
{
    LOCKED;
    add_fault(-1, nth, 1, code);
}

void sim_fail_function(const char *name, unsigned long nth, CUresult code)
{
    LOCKED;
    add_fault(fn_index(name), nth, 1, code);
}

void sim_fail_function_repeat(const char *name, unsigned long nth, unsigned long times,
                              CUresult code)
{
    LOCKED;
    add_fault(fn_index(name), nth, times, code);
}

void sim_clear_faults(void)
{
    LOCKED;
    S.nfaults = 0;
}

unsigned long sim_faults_fired(void)
{
    LOCKED;
    return S.fired;
}

void sim_trace_begin(void)
{
    LOCKED;
    if (!S.trace)
        S.trace = xcalloc(TRACE_MAX, sizeof *S.trace);
    S.tracing = true;
    S.ntrace = 0;
    S.trace_calls = 0;
}

size_t sim_trace_get(const char **names, size_t max)
{
    LOCKED;
    size_t k = S.ntrace < max ? S.ntrace : max;
    if (names && k)
        memcpy(names, S.trace, k * sizeof *names);
    return S.trace_calls;
}

void sim_trace_end(void)
{
    LOCKED;
    S.tracing = false;
}

size_t sim_entry_count(void) { return SIM_E_COUNT; }

const char *sim_entry_name(size_t i) { return i < SIM_E_COUNT ? fn_names[i] : NULL; }

/* ---------------------------------------------------------------------------------------- */
/* Initialisation, devices, contexts                                                         */

CUresult SIM_IMPL(cuInit)(unsigned int flags)
{
    SIM_ENTER(cuInit);
    if (flags)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuInit: flags %u", flags);
    if (!S.initialized) {
        sim_config_t c = {0};
        c.devices = (int)env_size("SIM_DEVICES", 0);
        c.memory = env_size("SIM_MEMORY", 0);
        c.host_memory = env_size("SIM_HOST_MEMORY", 0);
        c.granularity = env_size("SIM_GRANULARITY", 0);
        c.va_size = env_size("SIM_VA_SIZE", 0);
        c.no_current_context = true; /* cudart makes the primary context current itself */
        unsigned long total = S.total, calls = S.calls[SIM_E_cuInit];
        reset_locked(&c);
        S.total = total; /* this call stays counted */
        S.calls[SIM_E_cuInit] = calls;
        const char *v = getenv("SIM_VERBOSE");
        if (v && *v && *v != '0')
            S.verbose = true;
        v = getenv("SIM_FORK_STRICT");
        if (v && *v && *v != '0')
            S.fork_strict = true;
    }
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDriverGetVersion)(int *version)
{
    SIM_ENTER(cuDriverGetVersion);
    if (!version)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDriverGetVersion: NULL");
    *version = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDeviceGetCount)(int *count)
{
    SIM_ENTER(cuDeviceGetCount);
    NEED_INIT();
    if (!count)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceGetCount: NULL");
    *count = ndev();
    return CUDA_SUCCESS;
}


CUresult SIM_IMPL(cuDeviceGet)(CUdevice *dev, int ordinal)
{
    SIM_ENTER(cuDeviceGet);
    NEED_INIT();
    if (!dev)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceGet: NULL");
    NEED_DEVICE(ordinal, "cuDeviceGet");
    *dev = ordinal;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDeviceGetAttribute)(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    SIM_ENTER(cuDeviceGetAttribute);
    NEED_INIT();
    if (!pi)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceGetAttribute: NULL");
    NEED_DEVICE(dev, "cuDeviceGetAttribute");
    if ((int)attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetAttribute: attribute %d", attrib);
    int v = 0;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = 132; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = 0x18 + dev; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: v = 0; break;
    default: v = 0; break;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDeviceTotalMem)(size_t *bytes, CUdevice dev)
{
    SIM_ENTER(cuDeviceTotalMem);
    NEED_INIT();
    if (!bytes)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceTotalMem: NULL");
    NEED_DEVICE(dev, "cuDeviceTotalMem");
    *bytes = S.cfg.memory;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDeviceCanAccessPeer)(int *can, CUdevice dev, CUdevice peer)
{
    SIM_ENTER(cuDeviceCanAccessPeer);
    NEED_INIT();
    if (!can)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceCanAccessPeer: NULL");
    NEED_DEVICE(dev, "cuDeviceCanAccessPeer");
    NEED_DEVICE(peer, "cuDeviceCanAccessPeer");
    *can = dev != peer && !S.cfg.no_peer_access;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDeviceGetName)(char *name, int len, CUdevice dev)
{
    SIM_ENTER(cuDeviceGetName);
    NEED_INIT();
    if (!name || len <= 0)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceGetName: bad buffer");
    NEED_DEVICE(dev, "cuDeviceGetName");
    snprintf(name, (size_t)len, "Simulated NVIDIA H200 (simdrv)");
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemGetInfo)(size_t *free_bytes, size_t *total)
{
    SIM_ENTER(cuMemGetInfo);
    NEED_CTX(dev);
    if (!free_bytes || !total)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemGetInfo: NULL");
    *free_bytes = S.cfg.memory - S.used[dev];
    *total = S.cfg.memory;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------------- */
/* VMM                                                                                       */

/* Checks a CUmemAllocationProp; *device gets the device ordinal or -1 for host memory. */
static CUresult check_prop(const char *what, const CUmemAllocationProp *prop, int *device)
{
    if (!prop)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: prop NULL", what);
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: type %d is not PINNED", what, prop->type);
    switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        if (prop->location.id < 0 || prop->location.id >= ndev())
            return reject(CUDA_ERROR_INVALID_DEVICE, "%s: no device %d", what, prop->location.id);
        *device = prop->location.id;
        break;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        *device = -1;
        break;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
        if (prop->location.id != 0)
            return reject(CUDA_ERROR_INVALID_VALUE, "%s: no NUMA node %d", what,
                          prop->location.id);
        *device = -1;
        break;
    default:
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: location type %d", what,
                      prop->location.type);
    }
    unsigned t = (unsigned)prop->requestedHandleTypes;
    if (t & ~0xfu)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: handle types 0x%x", what, t);
    if (t & CU_MEM_HANDLE_TYPE_FABRIC)
        return reject(CUDA_ERROR_NOT_PERMITTED, "%s: FABRIC handles not permitted", what);
    if (t & (CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_WIN32_KMT))
        return reject(CUDA_ERROR_NOT_SUPPORTED, "%s: WIN32 handles on Linux", what);
    if (prop->win32HandleMetaData)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: win32HandleMetaData set", what);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemGetAllocationGranularity)(size_t *granularity,
                                                  const CUmemAllocationProp *prop,
                                                  CUmemAllocationGranularity_flags option)
{
    SIM_ENTER(cuMemGetAllocationGranularity);
    NEED_INIT();
    if (!granularity)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemGetAllocationGranularity: NULL");
    int device;
    CUresult rc = check_prop("cuMemGetAllocationGranularity", prop, &device);
    if (rc == CUDA_ERROR_NOT_PERMITTED)
        rc = CUDA_SUCCESS; /* the query itself is fine; creating is not */
    if (rc)
        return rc;
    if (option == CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        *granularity = S.cfg.granularity;
    else if (option == CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        *granularity = S.cfg.recommended;
    else
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemGetAllocationGranularity: option %d",
                      option);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemCreate)(CUmemGenericAllocationHandle *handle, size_t size,
                                const CUmemAllocationProp *prop, unsigned long long flags)
{
    SIM_ENTER(cuMemCreate);
    NEED_INIT();
    if (!handle)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemCreate: handle NULL");
    if (flags)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemCreate: flags 0x%llx", flags);
    int device;
    CUresult rc = check_prop("cuMemCreate", prop, &device);
    if (rc)
        return rc;
    if (!size || size % gran())
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemCreate: size %zu is not a multiple of the granularity %zu", size,
                      gran());
    allocs_sweep_held();
    if (device >= 0 && size > S.cfg.memory - S.used[device])
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate: %zu bytes, %zu free on device %d",
                      size, S.cfg.memory - S.used[device], device);
    /* Host-located memory is pinned by the driver at creation: its own, separate limit. */
    if (device < 0 && size > S.cfg.host_memory - S.host_used)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate: %zu bytes of host memory, %zu free",
                      size, S.cfg.host_memory - S.host_used);
    sim_alloc_t *a = xcalloc(1, sizeof *a);
    a->id = S.next_id++;
    a->size = size;
    a->prop = *prop;
    a->device = device;
    if (device >= 0)
        S.used[device] += size;
    else
        S.host_used += size;
    a->next = S.allocs;
    if (S.allocs)
        S.allocs->prev = a;
    S.allocs = a;
    S.nallocs++;
    *handle = handle_new(a);
    return CUDA_SUCCESS;
}

static sim_handle_t *handle_find(CUmemGenericAllocationHandle h)
{
    return vec_exact(&S.handles, (CUdeviceptr)h);
}

CUresult SIM_IMPL(cuMemRelease)(CUmemGenericAllocationHandle handle)
{
    SIM_ENTER(cuMemRelease);
    NEED_INIT();
    sim_handle_t *h = handle_find(handle);
    if (!h)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemRelease: unknown handle 0x%llx",
                      (unsigned long long)handle);
    sim_alloc_t *a = h->a;
    vec_remove(&S.handles, h);
    free(h);
    a->nhandles--;
    alloc_maybe_free(a);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle *handle, void *addr)
{
    SIM_ENTER(cuMemRetainAllocationHandle);
    NEED_INIT();
    if (!handle)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemRetainAllocationHandle: NULL");
    sim_map_t *m = vec_find(&S.maps, (CUdeviceptr)(uintptr_t)addr);
    if (!m)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemRetainAllocationHandle: %p not mapped",
                      addr);
    *handle = handle_new(m->a);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle handle)
{
    SIM_ENTER(cuMemGetAllocationPropertiesFromHandle);
    NEED_INIT();
    if (!prop)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemGetAllocationPropertiesFromHandle");
    sim_handle_t *h = handle_find(handle);
    if (!h)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "unknown handle");
    *prop = h->a->prop;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment,
                                        CUdeviceptr addr, unsigned long long flags)
{
    SIM_ENTER(cuMemAddressReserve);
    NEED_INIT();
    if (!ptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAddressReserve: ptr NULL");
    if (flags)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemAddressReserve: flags 0x%llx", flags);
    if (!size || size % gran())
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemAddressReserve: size 0x%zx is not a multiple of the granularity",
                      size);
    if (alignment && !is_pow2(alignment))
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemAddressReserve: alignment 0x%zx is not a power of two", alignment);
    size_t align = alignment > gran() ? alignment : gran();
    if (addr % align)
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemAddressReserve: hint 0x%llx is not aligned to 0x%zx",
                      (unsigned long long)addr, align);
    CUdeviceptr lo = VA_BASE, hi = VA_BASE + S.cfg.va_size, p = 0;
    if (addr && !S.refuse_hints && addr >= lo && addr < hi && hi - addr >= size &&
        vec_range_free(&S.resvs, addr, size))
        p = addr;
    if (!p) {
        CUdeviceptr from = S.res_rover + S.cfg.va_gap;
        if (from >= S.res_rover && from < hi)
            p = vec_gap_from(&S.resvs, from, hi, size, align);
    }
    if (!p)
        p = vec_gap_from(&S.resvs, lo, hi, size, align);
    if (!p)
        return reject(CUDA_ERROR_OUT_OF_MEMORY,
                      "cuMemAddressReserve: no 0x%zx bytes of address space left", size);
    sim_resv_t *r = xcalloc(1, sizeof *r);
    r->iv.ptr = p;
    r->iv.span = size;
    r->id = S.next_id++;
    vec_insert(&S.resvs, r);
    S.res_rover = p + size;
    *ptr = p;
    return CUDA_SUCCESS;
}

static bool range_has_mapping(CUdeviceptr p, size_t size)
{
    size_t i = vec_upper(&S.maps, p);
    if (i > 0 && S.maps.v[i - 1]->ptr + S.maps.v[i - 1]->span > p)
        return true;
    return i < S.maps.n && S.maps.v[i]->ptr < p + size;
}

CUresult SIM_IMPL(cuMemAddressFree)(CUdeviceptr ptr, size_t size)
{
    SIM_ENTER(cuMemAddressFree);
    NEED_INIT();
    sim_resv_t *r = vec_exact(&S.resvs, ptr);
    if (!r || r->iv.span != size)
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemAddressFree: (0x%llx, 0x%zx) is not a reservation",
                      (unsigned long long)ptr, size);
    if (range_has_mapping(ptr, size))
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemAddressFree: reservation 0x%llx still has mappings",
                      (unsigned long long)ptr);
    hazard_check("cuMemAddressFree", ptr, size);
    vec_remove(&S.resvs, r);
    free(r);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemMap)(CUdeviceptr ptr, size_t size, size_t offset,
                             CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    SIM_ENTER(cuMemMap);
    NEED_INIT();
    if (flags)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemMap: flags 0x%llx", flags);
    sim_handle_t *h = handle_find(handle);
    if (!h)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemMap: unknown handle 0x%llx",
                      (unsigned long long)handle);
    sim_alloc_t *a = h->a;
    if (!size || ptr % gran() || size % gran() || offset % gran())
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemMap: ptr 0x%llx size 0x%zx offset 0x%zx not granularity multiples",
                      (unsigned long long)ptr, size, offset);
    if (offset >= a->size || a->size - offset < size)
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemMap: offset 0x%zx + size 0x%zx beyond the allocation (0x%zx)", offset,
                      size, a->size);
    if (offset || size != a->size)
        return reject(CUDA_ERROR_NOT_SUPPORTED,
                      "cuMemMap: partial map (offset 0x%zx, size 0x%zx of 0x%zx)", offset, size,
                      a->size);
    sim_resv_t *r = vec_find(&S.resvs, ptr);
    if (!r || r->iv.ptr + r->iv.span - ptr < size)
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemMap: [0x%llx, +0x%zx) is not inside one reservation",
                      (unsigned long long)ptr, size);
    if (range_has_mapping(ptr, size))
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemMap: [0x%llx, +0x%zx) already mapped",
                      (unsigned long long)ptr, size);
    sim_map_t *m = xcalloc(1, sizeof *m);
    m->iv.ptr = ptr;
    m->iv.span = size;
    m->a = a;
    m->r = r;
    m->acc = xcalloc(size / gran() * (size_t)ndev(), 1);
    a->nmaps++;
    vec_insert(&S.maps, m);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemUnmap)(CUdeviceptr ptr, size_t size)
{
    SIM_ENTER(cuMemUnmap);
    NEED_INIT();
    if (!size)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemUnmap: size 0");
    size_t i = vec_upper(&S.maps, ptr);
    if (i == 0 || S.maps.v[i - 1]->ptr != ptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemUnmap: no mapping starts at 0x%llx",
                      (unsigned long long)ptr);
    size_t first = i - 1, last = first;
    CUdeviceptr end = ptr + size, at = ptr;
    for (;;) {
        sim_iv_t *m = S.maps.v[last];
        if (m->ptr != at)
            return reject(CUDA_ERROR_INVALID_VALUE, "cuMemUnmap: hole at 0x%llx",
                          (unsigned long long)at);
        at = m->ptr + m->span;
        if (at == end)
            break;
        if (at > end)
            return reject(CUDA_ERROR_INVALID_VALUE,
                          "cuMemUnmap: [0x%llx, +0x%zx) ends inside a mapping",
                          (unsigned long long)ptr, size);
        if (++last == S.maps.n)
            return reject(CUDA_ERROR_INVALID_VALUE, "cuMemUnmap: unmapped tail at 0x%llx",
                          (unsigned long long)at);
    }
    hazard_check("cuMemUnmap", ptr, size);
    for (size_t k = last + 1; k-- > first;)
        map_destroy((sim_map_t *)S.maps.v[k]);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                   size_t count)
{
    SIM_ENTER(cuMemSetAccess);
    NEED_INIT();
    if (!count || !desc)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemSetAccess: no descriptor");
    if (!size || ptr % gran() || size % gran())
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemSetAccess: [0x%llx, +0x%zx) not granularity multiples",
                      (unsigned long long)ptr, size);
    /* The range must be mapped throughout. */
    CUdeviceptr end = ptr + size;
    for (CUdeviceptr at = ptr; at < end;) {
        sim_map_t *m = vec_find(&S.maps, at);
        if (!m)
            return reject(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: 0x%llx is not mapped",
                          (unsigned long long)at);
        at = m->iv.ptr + m->iv.span;
    }
    for (size_t k = 0; k < count; k++) {
        const CUmemAccessDesc *d = &desc[k];
        if (d->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
            return reject(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: location type %d",
                          d->location.type);
        if (d->location.id < 0 || d->location.id >= ndev())
            return reject(CUDA_ERROR_INVALID_DEVICE, "cuMemSetAccess: no device %d",
                          d->location.id);
        if (d->flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
            d->flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            d->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return reject(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: flags %d", d->flags);
        if (S.cfg.no_peer_access && d->flags != CU_MEM_ACCESS_FLAGS_PROT_NONE) {
            for (CUdeviceptr at = ptr; at < end;) {
                sim_map_t *m = vec_find(&S.maps, at);
                if (m->a->device >= 0 && m->a->device != d->location.id)
                    return reject(CUDA_ERROR_INVALID_DEVICE,
                                  "cuMemSetAccess: device %d cannot reach device %d's memory",
                                  d->location.id, m->a->device);
                at = m->iv.ptr + m->iv.span;
            }
        }
    }
    for (CUdeviceptr at = ptr; at < end;) {
        sim_map_t *m = vec_find(&S.maps, at);
        CUdeviceptr mend = m->iv.ptr + m->iv.span, stop = mend < end ? mend : end;
        for (size_t g = (at - m->iv.ptr) / gran(); g < (stop - m->iv.ptr) / gran(); g++)
            for (size_t k = 0; k < count; k++)
                m->acc[g * (size_t)ndev() + (size_t)desc[k].location.id] =
                    (unsigned char)desc[k].flags;
        at = stop;
    }
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemExportToShareableHandle)(void *shareable,
                                                 CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType type,
                                                 unsigned long long flags)
{
    SIM_ENTER(cuMemExportToShareableHandle);
    NEED_INIT();
    if (!shareable)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemExportToShareableHandle: NULL");
    if (flags)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemExportToShareableHandle: flags");
    sim_handle_t *h = handle_find(handle);
    if (!h)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemExportToShareableHandle: unknown handle");
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
        !(h->a->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemExportToShareableHandle: type %d not requested at creation (0x%x)",
                      type, (unsigned)h->a->prop.requestedHandleTypes);
    int fd = memfd_create("simdrv-export", MFD_CLOEXEC);
    if (fd < 0)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "memfd_create: %s", strerror(errno));
    struct stat st;
    if (fstat(fd, &st)) {
        close(fd);
        return reject(CUDA_ERROR_UNKNOWN, "fstat: %s", strerror(errno));
    }
    size_t i;
    for (i = 0; i < S.nexports; i++)
        if (S.exports[i].dev == st.st_dev && S.exports[i].ino == st.st_ino)
            break;
    if (i == S.nexports) {
        if (S.nexports == S.capexports) {
            S.capexports = S.capexports ? 2 * S.capexports : 16;
            S.exports = xrealloc(S.exports, S.capexports * sizeof *S.exports);
        }
        S.nexports++;
    }
    S.exports[i] = (sim_export_t){.dev = st.st_dev, .ino = st.st_ino, .a = h->a};
    *(int *)shareable = fd;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *handle,
                                                   void *os_handle, CUmemAllocationHandleType type)
{
    SIM_ENTER(cuMemImportFromShareableHandle);
    NEED_INIT();
    if (!handle)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemImportFromShareableHandle: NULL");
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return reject(type == CU_MEM_HANDLE_TYPE_WIN32 || type == CU_MEM_HANDLE_TYPE_WIN32_KMT
                          ? CUDA_ERROR_NOT_SUPPORTED
                          : CUDA_ERROR_INVALID_VALUE,
                      "cuMemImportFromShareableHandle: type %d", type);
    int fd = (int)(intptr_t)os_handle;
    struct stat st;
    if (fd < 0 || fstat(fd, &st))
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemImportFromShareableHandle: bad fd %d", fd);
    for (size_t i = 0; i < S.nexports; i++)
        if (S.exports[i].dev == st.st_dev && S.exports[i].ino == st.st_ino) {
            *handle = handle_new(S.exports[i].a);
            return CUDA_SUCCESS;
        }
    return reject(CUDA_ERROR_INVALID_VALUE,
                  "cuMemImportFromShareableHandle: fd %d is no live export of this process", fd);
}

/* ---------------------------------------------------------------------------------------- */
/* Native allocator                                                                          */

/* A new native block in ctx (freed with it), charged to ctx's device. */
CUresult native_new(const char *what, CUcontext ctx, size_t size, size_t charged,
                    sim_native_kind_t kind, CUdeviceptr *out)
{
    int dev = ctx->device;
    if (charged > S.cfg.memory - S.used[dev])
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "%s: %zu bytes, %zu free on device %d", what,
                      size, S.cfg.memory - S.used[dev], dev);
    size_t align = charged >= 2 * MiB ? 2 * MiB : NAT_ALIGN;
    CUdeviceptr hi = NAT_BASE + NAT_SPAN, p = 0;
    if (S.nat_rover < hi)
        p = vec_gap_from(&S.natives, S.nat_rover, hi, charged, align);
    if (!p)
        p = vec_gap_from(&S.natives, NAT_BASE, hi, charged, align);
    if (!p)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "%s: native address space full", what);
    sim_native_t *n = xcalloc(1, sizeof *n);
    n->iv.ptr = p;
    n->iv.span = charged;
    n->size = size;
    n->charged = charged;
    n->device = dev;
    n->ctx = ctx;
    n->kind = kind;
    n->id = S.next_id++;
    vec_insert(&S.natives, n);
    S.used[dev] += charged;
    S.nat_rover = p + charged;
    *out = p;
    return CUDA_SUCCESS;
}

size_t round512(size_t n) { return (n + NAT_ALIGN - 1) & ~(size_t)(NAT_ALIGN - 1); }

CUresult SIM_IMPL(cuMemAlloc)(CUdeviceptr *dptr, size_t bytesize)
{
    SIM_ENTER(cuMemAlloc);
    NEED_CTX(dev);
    CUresult rc = capture_allows("cuMemAlloc");
    if (rc)
        return rc;
    if (!dptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAlloc: dptr NULL");
    if (!bytesize)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAlloc: size 0");
    if (bytesize > S.cfg.memory) {
        *dptr = 0; /* the H200 wrote 0 to the pointer of a failed cuMemAlloc(1 PiB) */
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc: %zu bytes", bytesize);
    }
    rc = native_new("cuMemAlloc", cur_ctx(), bytesize, round512(bytesize), NATIVE_DEVICE, dptr);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY)
        *dptr = 0;
    (void)dev;
    return rc;
}

/* The stream-ordered allocators: a plain native block (pools are not simulated), in the
 * stream's context. */
static CUresult alloc_async(const char *what, CUdeviceptr *dptr, size_t bytesize, CUstream s)
{
    CUcontext ctx;
    CUresult rc = stream_ctx(s, what, &ctx);
    if (!rc)
        rc = capture_conflicts_legacy(s, ctx, what);
    if (rc)
        return rc;
    if (!dptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: dptr NULL", what);
    if (!bytesize)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: size 0", what);
    if (bytesize > S.cfg.memory)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "%s: %zu bytes", what, bytesize);
    return native_new(what, ctx, bytesize, round512(bytesize), NATIVE_DEVICE, dptr);
}

CUresult SIM_IMPL(cuMemAllocAsync)(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    SIM_ENTER(cuMemAllocAsync);
    NEED_CTX(dev);
    (void)dev;
    return alloc_async("cuMemAllocAsync", dptr, bytesize, hStream);
}

CUresult SIM_IMPL(cuMemAllocFromPoolAsync)(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                            CUstream hStream)
{
    SIM_ENTER(cuMemAllocFromPoolAsync);
    NEED_CTX(dev);
    (void)dev;
    if (!pool) /* any other value is taken as a pool: pools are not simulated */
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAllocFromPoolAsync: pool NULL");
    return alloc_async("cuMemAllocFromPoolAsync", dptr, bytesize, hStream);
}

CUresult SIM_IMPL(cuMemAllocManaged)(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    SIM_ENTER(cuMemAllocManaged);
    NEED_CTX(dev);
    (void)dev;
    CUresult rc = capture_allows("cuMemAllocManaged");
    if (rc)
        return rc;
    if (!dptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAllocManaged: dptr NULL");
    if (!bytesize)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAllocManaged: size 0");
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemAllocManaged: flags %u", flags);
    /* Charged to the current device like cuMemAlloc, so that a test can exhaust it (the real
     * driver can oversubscribe managed memory; the simulation does not). */
    if (bytesize > S.cfg.memory)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAllocManaged: %zu bytes", bytesize);
    return native_new("cuMemAllocManaged", cur_ctx(), bytesize, round512(bytesize),
                      NATIVE_MANAGED, dptr);
}

CUresult SIM_IMPL(cuMemAllocPitch)(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                    unsigned int elementSize)
{
    SIM_ENTER(cuMemAllocPitch);
    NEED_CTX(dev);
    (void)dev;
    CUresult rc = capture_allows("cuMemAllocPitch");
    if (rc)
        return rc;
    if (!dptr || !pitch)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAllocPitch: NULL");
    if (elementSize != 4 && elementSize != 8 && elementSize != 16)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemAllocPitch: elementSize %u", elementSize);
    if (!width || !height)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemAllocPitch: empty");
    if (width > S.cfg.memory || height > S.cfg.memory)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "%s", "cuMemAllocPitch: too large");
    size_t p = round512(width);
    if (height > S.cfg.memory / p)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "%s", "cuMemAllocPitch: too large");
    rc = native_new("cuMemAllocPitch", cur_ctx(), p * height, p * height, NATIVE_DEVICE, dptr);
    if (rc == CUDA_SUCCESS)
        *pitch = p;
    return rc;
}

static CUresult native_find(const char *what, CUdeviceptr dptr, sim_native_t **out)
{
    sim_native_t *n = vec_exact(&S.natives, dptr);
    if (!n) {
        if (vec_find(&S.maps, dptr) || vec_find(&S.resvs, dptr))
            return reject(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is VMM memory", what,
                          (unsigned long long)dptr);
        if (vec_find(&S.natives, dptr))
            return reject(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is an interior pointer", what,
                          (unsigned long long)dptr);
        return reject(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx was not allocated (or was freed)",
                      what, (unsigned long long)dptr);
    }
    *out = n;
    return CUDA_SUCCESS;
}

static void native_free(const char *what, sim_native_t *n)
{
    hazard_check(what, n->iv.ptr, n->size);
    native_destroy(n);
}

CUresult SIM_IMPL(cuMemFree)(CUdeviceptr dptr)
{
    SIM_ENTER(cuMemFree);
    NEED_CTX(dev);
    (void)dev;
    CUresult rc = capture_allows("cuMemFree"); /* cudaFree(0) too is refused during capture */
    if (rc)
        return rc;
    if (!dptr)
        return CUDA_SUCCESS;
    sim_native_t *n = NULL;
    rc = native_find("cuMemFree", dptr, &n);
    if (rc)
        return rc;
    /* cuMemFree synchronizes: the work of the calling thread's context and of the block's own
     * context lands first (other contexts' work does not). */
    work_land_ctx(cur_ctx());
    if (n->ctx != cur_ctx())
        work_land_ctx(n->ctx);
    native_free("cuMemFree", n);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemFreeAsync)(CUdeviceptr dptr, CUstream stream)
{
    SIM_ENTER(cuMemFreeAsync);
    NEED_INIT();
    CUcontext ctx;
    CUresult rc = stream_ctx(stream, "cuMemFreeAsync", &ctx);
    if (!rc)
        rc = capture_conflicts_legacy(stream, ctx, "cuMemFreeAsync");
    if (rc)
        return rc;
    if (!dptr)
        return CUDA_SUCCESS;
    sim_native_t *n = NULL;
    rc = native_find("cuMemFreeAsync", dptr, &n);
    if (rc)
        return rc;
    if (stream_capturing(stream)) {
        stream->captured_ops++; /* a free node of the graph: nothing is freed now */
        return CUDA_SUCCESS;
    }
    /* stream-ordered: the stream's work before it is done when the memory goes */
    if (is_default_stream(stream))
        work_land_ctx(ctx);
    else
        work_land_stream(stream);
    native_free("cuMemFreeAsync", n);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemGetAddressRange)(CUdeviceptr *base, size_t *size, CUdeviceptr dptr)
{
    SIM_ENTER(cuMemGetAddressRange);
    NEED_CTX(dev);
    (void)dev;
    sim_native_t *n = vec_find(&S.natives, dptr);
    if (n && dptr - n->iv.ptr < n->size) {
        if (base)
            *base = n->iv.ptr;
        if (size)
            *size = n->size;
        return CUDA_SUCCESS;
    }
    sim_map_t *m = vec_find(&S.maps, dptr);
    if (m) {
        if (base)
            *base = m->iv.ptr;
        if (size)
            *size = m->iv.span;
        return CUDA_SUCCESS;
    }
    return reject(CUDA_ERROR_NOT_FOUND, "cuMemGetAddressRange: 0x%llx unknown",
                  (unsigned long long)dptr);
}

/* One pointer attribute; unknown pointers: CUDA_ERROR_INVALID_VALUE. */
static CUresult pointer_attr(void *data, CUpointer_attribute attr, CUdeviceptr ptr)
{
    sim_native_t *n = vec_find(&S.natives, ptr);
    if (n && ptr - n->iv.ptr >= n->size)
        n = NULL;
    sim_map_t *m = n ? NULL : vec_find(&S.maps, ptr);
    if (!n && !m) {
        if (attr == CU_POINTER_ATTRIBUTE_MAPPED && vec_find(&S.resvs, ptr)) {
            *(unsigned *)data = 0;
            return CUDA_SUCCESS;
        }
        return reject(CUDA_ERROR_INVALID_VALUE, "cuPointerGetAttribute: 0x%llx unknown",
                      (unsigned long long)ptr);
    }
    int dev = n ? n->device : m->a->device;
    unsigned long long id = n ? n->id : m->a->id;
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
        *(CUcontext *)data = n ? n->ctx : NULL;
        break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned *)data = dev >= 0 ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        if (cur_dev() < 0)
            return reject(CUDA_ERROR_INVALID_CONTEXT, "%s", "DEVICE_POINTER: no context");
        *(CUdeviceptr *)data = ptr;
        break;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
        *(unsigned *)data = 0;
        break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
        *(unsigned long long *)data = id;
        break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        *(unsigned *)data = n && n->kind == NATIVE_MANAGED;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *(int *)data = dev >= 0 ? dev : -1;
        break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        *(unsigned *)data = n != NULL;
        break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *(CUdeviceptr *)data = n ? n->iv.ptr : m->r->iv.ptr;
        break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *(size_t *)data = n ? n->size : m->r->iv.span;
        break;
    case CU_POINTER_ATTRIBUTE_MAPPED:
        *(unsigned *)data = 1;
        break;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
        *(unsigned *)data = n ? 0 : (unsigned)m->a->prop.requestedHandleTypes;
        break;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
        *(unsigned *)data = n ? 1 : m->a->prop.allocFlags.gpuDirectRDMACapable != 0;
        break;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: {
        int cd = cur_dev();
        if (cd < 0)
            return reject(CUDA_ERROR_INVALID_CONTEXT, "%s", "ACCESS_FLAGS: no context");
        if (n)
            *(unsigned *)data = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE;
        else
            *(unsigned *)data = m->acc[(ptr - m->iv.ptr) / gran() * (size_t)ndev() + (size_t)cd];
        break;
    }
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
        *(CUmemoryPool *)data = NULL;
        break;
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
        *(size_t *)data = n ? n->size : m->iv.span;
        break;
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
        *(CUdeviceptr *)data = n ? n->iv.ptr : m->iv.ptr;
        break;
    case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE:
        *(unsigned *)data = 0;
        break;
    default:
        return reject(CUDA_ERROR_INVALID_VALUE, "cuPointerGetAttribute: attribute %d", attr);
    }
    return CUDA_SUCCESS;
}

static size_t attr_size(CUpointer_attribute attr)
{
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
        return 8;
    case CU_POINTER_ATTRIBUTE_P2P_TOKENS:
        return sizeof(CUDA_POINTER_ATTRIBUTE_P2P_TOKENS);
    default:
        return 4;
    }
}

CUresult SIM_IMPL(cuPointerGetAttribute)(void *data, CUpointer_attribute attribute,
                                          CUdeviceptr ptr)
{
    SIM_ENTER(cuPointerGetAttribute);
    NEED_INIT();
    if (!data)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuPointerGetAttribute: data NULL");
    /* Write through a scratch copy so that a failure leaves *data alone. */
    unsigned char tmp[sizeof(CUDA_POINTER_ATTRIBUTE_P2P_TOKENS) + 16];
    memset(tmp, 0, sizeof tmp);
    CUresult rc = pointer_attr(tmp, attribute, ptr);
    if (rc == CUDA_SUCCESS)
        memcpy(data, tmp, attr_size(attribute));
    return rc;
}

CUresult SIM_IMPL(cuPointerGetAttributes)(unsigned int n, CUpointer_attribute *attributes,
                                           void **data, CUdeviceptr ptr)
{
    SIM_ENTER(cuPointerGetAttributes);
    NEED_INIT();
    if (!n || !attributes || !data)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuPointerGetAttributes: bad arrays");
    for (unsigned i = 0; i < n; i++)
        if (!data[i])
            return reject(CUDA_ERROR_INVALID_VALUE, "cuPointerGetAttributes: data[%u] NULL", i);
    bool known = vec_find(&S.maps, ptr) != NULL;
    sim_native_t *nat = vec_find(&S.natives, ptr);
    known = known || (nat && ptr - nat->iv.ptr < nat->size);
    for (unsigned i = 0; i < n; i++) {
        unsigned char tmp[sizeof(CUDA_POINTER_ATTRIBUTE_P2P_TOKENS) + 16];
        memset(tmp, 0, sizeof tmp);
        if (known) {
            CUresult rc = pointer_attr(tmp, attributes[i], ptr);
            if (rc == CUDA_ERROR_INVALID_CONTEXT)
                return rc;
            if (rc != CUDA_SUCCESS)
                memset(tmp, 0, sizeof tmp); /* unsupported attribute: default value */
        }
        memcpy(data[i], tmp, attr_size(attributes[i]));
    }
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------------- */
/* Legacy IPC                                                                                */

#define IPC_MAGIC 0x51d1bc00u

typedef struct ipc_payload {
    unsigned magic;
    int pid;
    unsigned long long id;
    CUdeviceptr ptr;
    size_t size;
} ipc_payload_t;

CUresult SIM_IMPL(cuIpcGetMemHandle)(CUipcMemHandle *handle, CUdeviceptr dptr)
{
    SIM_ENTER(cuIpcGetMemHandle);
    NEED_CTX(dev);
    (void)dev;
    if (!handle)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuIpcGetMemHandle: NULL");
    sim_native_t *n = vec_find(&S.natives, dptr);
    if (!n || dptr - n->iv.ptr >= n->size)
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuIpcGetMemHandle: 0x%llx is not a cuMemAlloc block",
                      (unsigned long long)dptr);
    ipc_payload_t pl = {IPC_MAGIC, (int)getpid(), n->id, n->iv.ptr, n->size};
    memset(handle, 0, sizeof *handle);
    memcpy(handle->reserved, &pl, sizeof pl);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuIpcOpenMemHandle)(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                       unsigned int flags)
{
    SIM_ENTER(cuIpcOpenMemHandle);
    NEED_CTX(dev);
    (void)dev;
    if (!pdptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuIpcOpenMemHandle: NULL");
    if (flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuIpcOpenMemHandle: flags %u", flags);
    ipc_payload_t pl;
    memcpy(&pl, handle.reserved, sizeof pl);
    if (pl.magic != IPC_MAGIC)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuIpcOpenMemHandle: not a handle");
    if (pl.pid == (int)getpid())
        return reject(CUDA_ERROR_INVALID_CONTEXT,
                      "%s", "cuIpcOpenMemHandle: handle of this same process");
    return reject(CUDA_ERROR_MAP_FAILED, "%s",
                  "cuIpcOpenMemHandle: other processes' memory is not simulated");
}

CUresult SIM_IMPL(cuIpcCloseMemHandle)(CUdeviceptr dptr)
{
    SIM_ENTER(cuIpcCloseMemHandle);
    NEED_CTX(dev);
    (void)dev;
    return reject(CUDA_ERROR_INVALID_VALUE, "cuIpcCloseMemHandle: 0x%llx was not opened",
                  (unsigned long long)dptr);
}

/* ---------------------------------------------------------------------------------------- */
/* Errors                                                                                    */

static const struct {
    CUresult code;
    const char *name, *text;
} errors[] = {
#define E(c, t) {c, #c, t}
    E(CUDA_SUCCESS, "no error"),
    E(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
    E(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
    E(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
    E(CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
    E(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
    E(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
    E(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
    E(CUDA_ERROR_MAP_FAILED, "mapping of buffer object failed"),
    E(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "peer access is not supported between these two devices"),
    E(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
    E(CUDA_ERROR_NOT_FOUND, "named symbol not found"),
    E(CUDA_ERROR_NOT_READY, "device not ready"),
    E(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
    E(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled"),
    E(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled"),
    E(CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
    E(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
    E(CUDA_ERROR_UNKNOWN, "unknown error"),
#undef E
};

CUresult SIM_IMPL(cuGetErrorString)(CUresult error, const char **pStr)
{
    SIM_ENTER(cuGetErrorString);
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *pStr = errors[i].text;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult SIM_IMPL(cuGetErrorName)(CUresult error, const char **pStr)
{
    SIM_ENTER(cuGetErrorName);
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *pStr = errors[i].name;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* ---------------------------------------------------------------------------------------- */
/* The table and cuGetProcAddress                                                            */

/* Filled by name: every row of the library's table must be one of SIM_FUNCS (see simint.h). */
static const vmh_driver_t table = {
#define SIM_FILL(name, params) .name = SIM_IMPL(name),
    VMH_DRIVER_FUNCS(SIM_FILL)
#undef SIM_FILL
};

const vmh_driver_t *sim_table(void) { return &table; }

static const struct {
    const char *name;
    void *fn;
} procs[] = {
#define SIM_PROC(name, params) {#name, (void *)SIM_IMPL(name)},
    SIM_FUNCS(SIM_PROC)
#undef SIM_PROC
};

/* The CUDA version in which the entry point that cuda.h's name maps to appeared (older
 * versions got the v1 ABI, which the simulation does not have). */
static int min_version(const char *name)
{
    static const struct {
        const char *name;
        int version;
    } v[] = {
        {"cuMemAlloc", 3020}, {"cuMemAllocPitch", 3020}, {"cuMemFree", 3020},
        {"cuMemGetAddressRange", 3020}, {"cuMemGetInfo", 3020}, {"cuDeviceTotalMem", 3020},
        {"cuMemcpyDtoD", 3020}, {"cuMemcpyDtoDAsync", 3020}, {"cuMemcpyHtoD", 3020},
        {"cuMemcpyDtoH", 3020}, {"cuMemcpyHtoDAsync", 3020}, {"cuMemcpyDtoHAsync", 3020},
        {"cuMemsetD8", 3020}, {"cuCtxCreate", 3020}, {"cuCtxDestroy", 4000},
        {"cuCtxPushCurrent", 4000}, {"cuCtxPopCurrent", 4000}, {"cuStreamDestroy", 4000},
        {"cuCtxGetCurrent", 4000}, {"cuCtxSetCurrent", 4000}, {"cuCtxEnablePeerAccess", 4000},
        {"cuCtxDisablePeerAccess", 4000}, {"cuDeviceCanAccessPeer", 4000},
        {"cuIpcGetMemHandle", 4010}, {"cuIpcCloseMemHandle", 4010},
        {"cuIpcOpenMemHandle", 11000}, {"cuDevicePrimaryCtxRetain", 7000},
        {"cuDevicePrimaryCtxRelease", 11000}, {"cuDevicePrimaryCtxReset", 11000},
        {"cuPointerGetAttributes", 7000}, {"cuMemHostAlloc", 2020},
        {"cuMemHostRegister", 6050}, {"cuMemHostUnregister", 4000},
        {"cuMemAllocManaged", 6000}, {"cuStreamBeginCapture", 10010},
        {"cuStreamEndCapture", 10000}, {"cuStreamIsCapturing", 10000},
        {"cuThreadExchangeStreamCaptureMode", 10010}, {"cuGraphDestroy", 10000},
        {"cuMemCreate", 10020}, {"cuMemRelease", 10020}, {"cuMemAddressReserve", 10020},
        {"cuMemAddressFree", 10020}, {"cuMemMap", 10020}, {"cuMemUnmap", 10020},
        {"cuMemSetAccess", 10020}, {"cuMemGetAllocationGranularity", 10020},
        {"cuMemExportToShareableHandle", 10020}, {"cuMemImportFromShareableHandle", 10020},
        {"cuMemRetainAllocationHandle", 11000},
        {"cuMemGetAllocationPropertiesFromHandle", 10020}, {"cuMemFreeAsync", 11020},
        {"cuMemAllocAsync", 11020}, {"cuMemAllocFromPoolAsync", 11020},
        {"cuGetProcAddress", 12000},
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        if (!strcmp(v[i].name, name))
            return v[i].version;
    return 2000;
}

/* Entry points whose ABI depends on the cudaVersion asked for, as the real driver answers
 * (cudaTypedefs.h's PFN_<name>_v<version>): from `since` on, cuGetProcAddress(name) answers fn.
 * The newest row of a name that cuda.h maps (cuCtxCreate -> cuCtxCreate_v4) is procs' own entry;
 * the others are exported under their own names for dlsym, which cuGetProcAddress does not take
 * (it takes base names): those names answer NOT_FOUND there.
 *   - cuCtxGetDevice / cuCtxSynchronize: cuda.h declares the plain ABI with no versioning macro
 *     and the _v2 beside it (PFN_..._v13000); as on the H200 (driver 580) the _v2 is answered from
 *     13000 on, for every flag set.
 *   - cuCtxCreate: _v2 (flags, dev) at 3020, _v3 (exec affinity) at 11040, _v4 (params) at 12050. */
static const struct {
    const char *name;
    int since;
    void *fn;
    const char *own_name; /* the procs name of fn when it is not the plain name's own entry */
} sim_abi_versions[] = {
    {"cuCtxGetDevice", 13000, (void *)SIM_IMPL(cuCtxGetDevice_v2), "cuCtxGetDevice_v2"},
    {"cuCtxSynchronize", 13000, (void *)SIM_IMPL(cuCtxSynchronize_v2), "cuCtxSynchronize_v2"},
    {"cuCtxCreate", 3020, (void *)SIM_IMPL(cuCtxCreate_v2), "cuCtxCreate_v2"},
    {"cuCtxCreate", 11040, (void *)SIM_IMPL(cuCtxCreate_v3), "cuCtxCreate_v3"},
    {"cuCtxCreate", 12050, (void *)SIM_IMPL(cuCtxCreate), NULL},
};
#define N_ABI_VERSIONS (sizeof sim_abi_versions / sizeof sim_abi_versions[0])

/* Whether procs' name is only an export for dlsym, not a cuGetProcAddress symbol. */
static bool not_a_proc_symbol(const char *name)
{
    for (size_t i = 0; i < N_ABI_VERSIONS; i++)
        if (sim_abi_versions[i].own_name && !strcmp(sim_abi_versions[i].own_name, name))
            return true;
    return false;
}

/* The function answered for symbol at cudaVersion (procs' one when no versioned row applies). */
static void *versioned_fn(const char *symbol, int cudaVersion, void *fn)
{
    int best = -1;
    for (size_t i = 0; i < N_ABI_VERSIONS; i++)
        if (!strcmp(sim_abi_versions[i].name, symbol) && cudaVersion >= sim_abi_versions[i].since &&
            (best < 0 || sim_abi_versions[i].since > sim_abi_versions[best].since))
            best = (int)i;
    return best < 0 ? fn : sim_abi_versions[best].fn;
}

/* The per-thread-default-stream variant of symbol, when it has one (the fake libcuda only:
 * the static form's table keeps the legacy stream). */
static void *per_thread_fn(const char *symbol, void *fn)
{
#ifdef SIM_SHARED
    static const struct {
        const char *name;
        void *fn;
    } pt[] = {
#define SIM_PT_ENTRY(plain, exported, params) {#plain, (void *)exported},
        SIM_PT_FUNCS(SIM_PT_ENTRY)
#undef SIM_PT_ENTRY
    };
    for (size_t i = 0; i < sizeof pt / sizeof pt[0]; i++)
        if (!strcmp(pt[i].name, symbol))
            return pt[i].fn;
#else
    (void)symbol;
#endif
    return fn;
}

#ifdef SIM_SHARED
static CUresult getproc_v1(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
#endif

CUresult SIM_IMPL(cuGetProcAddress)(const char *symbol, void **pfn, int cudaVersion,
                                     cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
    SIM_ENTER(cuGetProcAddress);
    if (!symbol || !pfn)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuGetProcAddress: NULL");
    if (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM |
                              CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)) {
        *pfn = NULL;
        return reject(CUDA_ERROR_INVALID_VALUE, "cuGetProcAddress: flags 0x%llx",
                      (unsigned long long)flags);
    }
    for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
        if (strcmp(procs[i].name, symbol) || not_a_proc_symbol(procs[i].name))
            continue;
        if (cudaVersion < min_version(symbol)) {
#ifdef SIM_SHARED
            if (!strcmp(symbol, "cuGetProcAddress") && cudaVersion >= 11030) {
                *pfn = (void *)getproc_v1;
                if (symbolStatus)
                    *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
                return CUDA_SUCCESS;
            }
#endif
            *pfn = NULL;
            if (symbolStatus)
                *symbolStatus = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
            return reject(CUDA_ERROR_NOT_FOUND, "cuGetProcAddress(%s, %d): version too low",
                          symbol, cudaVersion);
        }
        *pfn = versioned_fn(symbol, cudaVersion, procs[i].fn);
        if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
            *pfn = per_thread_fn(symbol, *pfn);
        if (symbolStatus)
            *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    *pfn = NULL;
    if (symbolStatus)
        *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return reject(CUDA_ERROR_NOT_FOUND, "cuGetProcAddress: %s not simulated", symbol);
}

CUresult sim_get_proc_address(const char *symbol, void **pfn, int cudaVersion,
                              cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    return SIM_IMPL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags, status);
}

/* ---------------------------------------------------------------------------------------- */
/* The fake libcuda.so.1's extra exported names                                              */

#ifdef SIM_SHARED
static CUresult getproc_v1(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return SIM_IMPL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags, NULL);
}

/* The CUDA 11.3 four-argument cuGetProcAddress, under its exported name. */
#undef cuGetProcAddress
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return getproc_v1(symbol, pfn, cudaVersion, flags);
}

/* The per-thread-default-stream exports of this file's entry points (see SIM_PT_FUNCS). */
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    return SIM_IMPL(cuMemFreeAsync)(dptr, SIM_PT_STREAM(stream));
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t n, CUstream stream)
{
    return SIM_IMPL(cuMemAllocAsync)(dptr, n, SIM_PT_STREAM(stream));
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t n, CUmemoryPool pool,
                                      CUstream stream)
{
    return SIM_IMPL(cuMemAllocFromPoolAsync)(dptr, n, pool, SIM_PT_STREAM(stream));
}
#endif
