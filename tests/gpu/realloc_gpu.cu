/* realloc_gpu: vmm_realloc on a real device (runs only under the hook; 77 otherwise).
 *
 * NULL allocates; grow 2 MiB -> 3 MiB -> 64 MiB -> 1 GiB keeping the contents (kernel verify
 * after each; the pointer must stay when vmm_usable_size said the size fits); range answers
 * follow the new size; shrink keeps the pointer and the contents; size 0 frees; a foreign
 * pointer (cudaMallocAsync, host), an interior pointer, a bad size and an impossible size fail
 * with their status and leave the buffer untouched; a packed (small) buffer outgrowing its slot
 * moves with its contents and its neighbour intact; cudaMalloc and vmm_realloc buffers mix;
 * work queued on a stream that writes the buffer long after the call (a kernel that spins
 * first) is waited for by vmm_realloc and ordered by vmm_realloc_async: no fault, contents
 * right. The library is reached through vmm_fn() (dlsym), never linked. */
#include "gpu_common.h"

#include "vmmhook.h"

#include <chrono>

typedef decltype(&vmm_realloc) realloc_fn;
typedef decltype(&vmm_realloc_async) realloc_async_fn;
typedef decltype(&vmm_status_string) status_string_fn;
typedef decltype(&vmm_version) version_fn;

static realloc_fn vr;
static realloc_async_fn vra;
static status_string_fn vss;
static gt_range_fn range_fn;
static gt_attr_fn attr_fn;

static uintptr_t g_freed[256];
static size_t g_nfreed;
static int g_in_place, g_moved;

/* The library's vmm_owns / vmm_usable_size, fetched through dlsym by gt_init (never linked). */
static int owns_(const void *p)
{
    return g_vmm_owns(p);
}
static size_t usable_(const void *p)
{
    return g_vmm_usable(p);
}

static const char *st(vmm_status s)
{
    return vss ? vss(s) : "?";
}

static void note_freed(const void *p)
{
    if (p && g_nfreed < sizeof g_freed / sizeof g_freed[0])
        g_freed[g_nfreed++] = (uintptr_t)p;
}

static double now_ms(void)
{
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

/* The buffer at p answers as one allocation of n bytes, at its base and its last byte. */
static void range_is(const void *p, size_t n, const char *what)
{
    const size_t offs[2] = {0, n - 1};
    for (int k = 0; k < 2; k++) {
        CUdeviceptr b = 0;
        size_t sz = 0;
        CUresult r = range_fn(&b, &sz, (CUdeviceptr)p + offs[k]);
        CHECK(r == CUDA_SUCCESS && b == (CUdeviceptr)p && sz == n,
              "%s: cuMemGetAddressRange(+%zu) -> %d, base_off %lld, size %zu; want 0, 0, %zu", what,
              offs[k], (int)r, (long long)(b - (CUdeviceptr)p), sz, n);
        size_t rs = 0;
        r = attr_fn(&rs, CU_POINTER_ATTRIBUTE_RANGE_SIZE, (CUdeviceptr)p + offs[k]);
        CHECK(r == CUDA_SUCCESS && rs == n, "%s: RANGE_SIZE(+%zu) -> %d, %zu; want %zu", what,
              offs[k], (int)r, rs, n);
    }
}

/* vmm_realloc(&p, n) that must succeed; checks the in-place promise and the old address. */
static int grow_to(void **p, size_t n, const char *what)
{
    void *old = *p;
    size_t usable = old ? usable_(old) : 0;
    double t0 = now_ms();
    vmm_status s = vr(p, n);
    double ms = now_ms() - t0;
    CHECK(s == VMM_OK, "%s: vmm_realloc(%zu) -> %d (%s)", what, n, (int)s, st(s));
    if (s != VMM_OK)
        return 0;
    CHECK(*p != NULL && ((uintptr_t)*p & 255) == 0, "%s: pointer %p", what, *p);
    if (old) {
        int kept = *p == old;
        kept ? g_in_place++ : g_moved++;
        INFO("%s: %zu bytes %s (usable before %zu) in %.3f ms", what, n,
             kept ? "in place" : "moved", usable, ms);
        if (n <= usable)
            CHECK(kept, "%s: %zu fits the usable %zu but the buffer moved", what, n, usable);
        if (!kept) {
            CHECK(owns_(old) == 0 || (old >= *p && (char *)old < (char *)*p + n),
                  "%s: the old address is still owned after a move", what);
            note_freed(old);
        }
    }
    CHECK(owns_(*p) == 1 && owns_((char *)*p + n - 1) == 1, "%s: vmm_owns of the new buffer", what);
    CHECK(usable_(*p) >= n, "%s: vmm_usable_size %zu < %zu", what, usable_(*p), n);
    return 1;
}

static void check_data(const void *p, size_t n, uint64_t seed, const char *what, cudaStream_t s = 0)
{
    unsigned long long bad = gt_verify(p, n, seed, s, 0, what);
    CHECK(bad == 0, "%s: %llu bad of %zu bytes", what, bad, n);
}

static void grow_chain(void)
{
    void *p = NULL;
    if (!grow_to(&p, 2 * MiB, "NULL -> 2 MiB"))
        return;
    range_is(p, 2 * MiB, "2 MiB");
    gt_fill(p, 2 * MiB, 101);
    const size_t steps[3] = {3 * MiB, 64 * MiB, GiB};
    size_t cur = 2 * MiB;
    uint64_t seed = 101;
    for (int i = 0; i < 3; i++) {
        char what[64];
        snprintf(what, sizeof what, "grow %zu -> %zu", cur, steps[i]);
        if (!grow_to(&p, steps[i], what))
            break;
        check_data(p, cur, seed, what);
        range_is(p, steps[i], what);
        cur = steps[i];
        seed++;
        gt_fill(p, cur, seed);
    }
    /* Shrink: the pointer stays, the kept part is intact, the range follows. */
    void *old = p;
    vmm_status s = vr(&p, 10 * MiB);
    CHECK(s == VMM_OK && p == old, "shrink to 10 MiB -> %d (%s), moved %d", (int)s, st(s),
          p != old);
    if (s == VMM_OK) {
        check_data(p, 10 * MiB, seed, "after shrink");
        range_is(p, 10 * MiB, "after shrink");
        INFO("after shrink: usable %zu", usable_(p));
        CHECK_OWNS((char *)p + 10 * MiB - 1, 1, "last byte after shrink");
        cur = 10 * MiB;
    }
    /* Grow again after the shrink. */
    if (grow_to(&p, 100 * MiB, "regrow 10 MiB -> 100 MiB"))
        check_data(p, cur, seed, "regrow");
    /* Size 0 frees and sets NULL. */
    old = p;
    s = vr(&p, 0);
    CHECK(s == VMM_OK && p == NULL, "vmm_realloc(p, 0) -> %d (%s), p %s", (int)s, st(s),
          p ? "not NULL" : "NULL");
    CHECK(owns_(old) == 0, "vmm_owns after size-0 free");
    note_freed(old);
}

static void failures(void)
{
    /* A cudaMallocAsync pointer: foreign, untouched. */
    void *q = NULL;
    if (CK(cudaMallocAsync(&q, MiB, 0)) == 0) {
        gt_fill(q, MiB, 201);
        void *q0 = q;
        vmm_status s = vr(&q, 4 * MiB);
        CHECK(s == VMM_ERR_FOREIGN && q == q0, "vmm_realloc(cudaMallocAsync ptr) -> %d (%s)",
              (int)s, st(s));
        check_data(q, MiB, 201, "foreign buffer after refused realloc");
        CHECK(usable_(q) == 0, "usable_(foreign) = %zu", usable_(q));
        CHECK(owns_(q) == 0, "owns_(foreign)");
        CK(cudaFreeAsync(q, 0));
        CK(cudaDeviceSynchronize());
    }
    /* A host pointer. */
    void *h = malloc(64);
    void *h0 = h;
    vmm_status s = vr(&h, 4 * MiB);
    CHECK(s == VMM_ERR_FOREIGN && h == h0, "vmm_realloc(host ptr) -> %d (%s)", (int)s, st(s));
    free(h0);
    /* A NULL out-pointer. */
    s = vr(NULL, 10);
    CHECK(s == VMM_ERR_INVALID, "vmm_realloc(NULL out) -> %d (%s)", (int)s, st(s));

    void *p = NULL;
    if (!grow_to(&p, 4 * MiB, "NULL -> 4 MiB (for failures)"))
        return;
    gt_fill(p, 4 * MiB, 202);
    /* Interior pointer. */
    void *pi = (char *)p + 4096;
    s = vr(&pi, 8 * MiB);
    CHECK(s == VMM_ERR_INTERIOR && pi == (char *)p + 4096, "vmm_realloc(interior) -> %d (%s)",
          (int)s, st(s));
    /* A size that overflows once rounded. */
    void *pj = p;
    s = vr(&pj, (size_t)-1);
    CHECK(s == VMM_ERR_SIZE && pj == p, "vmm_realloc(SIZE_MAX) -> %d (%s)", (int)s, st(s));
    /* A size no device has. */
    s = vr(&pj, (size_t)1 << 50);
    CHECK((s == VMM_ERR_NO_MEMORY || s == VMM_ERR_NO_ADDRESS) && pj == p,
          "vmm_realloc(1 PiB) -> %d (%s)", (int)s, st(s));
    INFO("vmm_realloc(1 PiB) -> %s", st(s));
    check_data(p, 4 * MiB, 202, "buffer after failed reallocs");
    range_is(p, 4 * MiB, "buffer after failed reallocs");
    s = vr(&p, 0);
    CHECK(s == VMM_OK && !p, "free after failures -> %d", (int)s);
    note_freed(pj);
}

static void packed_and_mixed(void)
{
    /* A packed buffer next to a cudaMalloc'd neighbour outgrows its slot twice. */
    void *a = NULL, *nb = NULL;
    if (!grow_to(&a, 1000, "NULL -> 1000 (packed)"))
        return;
    CK(cudaMalloc(&nb, 1000));
    gt_fill(a, 1000, 301);
    gt_fill(nb, 1000, 302);
    if (grow_to(&a, 100 * KiB, "packed 1000 -> 100 KiB")) {
        check_data(a, 1000, 301, "packed after first growth");
        gt_fill(a, 100 * KiB, 303);
    }
    if (grow_to(&a, 5 * MiB, "100 KiB -> 5 MiB")) {
        check_data(a, 100 * KiB, 303, "packed after growth past a chunk");
        range_is(a, 5 * MiB, "formerly packed buffer");
    }
    check_data(nb, 1000, 302, "the packed buffer's neighbour");
    CK(cudaFree(nb));
    note_freed(nb);
    void *olda = a;
    CHECK(vr(&a, 0) == VMM_OK, "free packed");
    note_freed(olda);

    /* cudaMalloc buffer grown by vmm_realloc, then freed by cudaFree. */
    void *c = NULL;
    if (CK(cudaMalloc(&c, 2 * MiB)) == 0) {
        gt_fill(c, 2 * MiB, 304);
        if (grow_to(&c, 8 * MiB, "cudaMalloc 2 MiB -> 8 MiB"))
            check_data(c, 2 * MiB, 304, "cudaMalloc buffer after vmm_realloc");
        CK(cudaFree(c));
        note_freed(c);
    }
    /* vmm_realloc buffer freed by cudaFree. */
    void *v = NULL;
    if (grow_to(&v, 3 * MiB, "NULL -> 3 MiB (freed by cudaFree)")) {
        cudaError_t e = cudaFree(v);
        CHECK(e == cudaSuccess, "cudaFree(vmm_realloc buffer) -> %d", (int)e);
        note_freed(v);
    }
}

/* Work queued before the call still writes the buffer: vmm_realloc must wait for it before
 * copying or unmapping, vmm_realloc_async must order after it. */
static void queued_work(void)
{
    cudaStream_t s;
    if (CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)))
        return;
    const unsigned long long spin = 300ull * 1000 * 1000; /* 300 ms */
    struct Case {
        const char *name;
        size_t from, to;
        int async;
    } cases[4] = {{"packed 64 KiB -> 16 MiB, queued kernel, sync", 64 * KiB, 16 * MiB, 0},
                  {"packed 64 KiB -> 16 MiB, queued kernel, async", 64 * KiB, 16 * MiB, 1},
                  {"64 MiB -> 4 GiB, queued kernel, sync", 64 * MiB, 4 * GiB, 0},
                  {"64 MiB -> 4 GiB, queued kernel, async", 64 * MiB, 4 * GiB, 1}};
    for (int i = 0; i < 4; i++) {
        const Case &c = cases[i];
        void *p = NULL;
        if (!grow_to(&p, c.from, c.name))
            continue;
        /* Something allocated right after it, so growing in place is less likely. */
        void *blocker = NULL;
        CK(cudaMalloc(&blocker, c.from));
        gt_slow_fill(p, c.from, 400 + i, spin, s);
        void *old = p;
        double t0 = now_ms();
        vmm_status st_ = c.async ? vra(&p, c.to, (void *)s) : vr(&p, c.to);
        double ms = now_ms() - t0;
        CHECK(st_ == VMM_OK, "%s -> %d (%s)", c.name, (int)st_, st(st_));
        if (st_ != VMM_OK) { /* the old buffer must be intact; then on to the next case */
            check_data(p, c.from, 400 + i, "buffer after a failed realloc", s);
            CK(cudaStreamSynchronize(s));
            CHECK(vr(&p, 0) == VMM_OK, "%s: free after the failed realloc", c.name);
            note_freed(old);
            CK(cudaFree(blocker));
            note_freed(blocker);
            continue;
        }
        INFO("%s: %s, call took %.1f ms (kernel spins %llu ms)", c.name,
             p == old ? "in place" : "moved", ms, spin / 1000000);
        p == old ? g_in_place++ : g_moved++;
        if (p != old)
            note_freed(old);
        check_data(p, c.from, 400 + i, c.name, s);
        cudaError_t e = cudaStreamSynchronize(s);
        CHECK(e == cudaSuccess, "%s: stream -> %d (%s): a fault?", c.name, (int)e,
              cudaGetErrorString(e));
        e = cudaDeviceSynchronize();
        CHECK(e == cudaSuccess, "%s: device -> %d (%s)", c.name, (int)e, cudaGetErrorString(e));
        gt_fill(p, c.to, 500 + i, s);
        check_data(p, c.to, 500 + i, "whole grown buffer", s);
        old = p;
        CHECK(vr(&p, 0) == VMM_OK, "free");
        note_freed(old);
        CK(cudaFree(blocker));
        note_freed(blocker);
        if (e != cudaSuccess)
            break; /* sticky: the rest cannot run */
    }
    CK(cudaStreamDestroy(s));
}

int main(void)
{
    gt_init("realloc_gpu");
    if (!vmm_hook_available()) {
        if (g_expect_hook) {
            CHECK(0, "vmm_hook_available() is false under GPUTEST_EXPECT_HOOK=1");
            return gt_finish();
        }
        gt_skip("vmm_hook_available() is false: vmm_realloc needs libvmmhook loaded "
                "(LD_PRELOAD=libvmmhook.so)");
    }
    vr = (realloc_fn)vmm_fn("vmm_realloc");
    vra = (realloc_async_fn)vmm_fn("vmm_realloc_async");
    vss = (status_string_fn)vmm_fn("vmm_status_string");
    version_fn vv = (version_fn)vmm_fn("vmm_version");
    CHECK(vr && vra && vss && vv && g_vmm_owns && g_vmm_usable && g_vmm_trim,
          "an entry point of vmmhook.h is missing from the library");
    if (!(vr && vra && vss && vv && g_vmm_owns && g_vmm_usable && g_vmm_trim))
        return gt_finish();
    INFO("vmm_version() = %d (header %d)", vv(), VMM_VERSION);
    CHECK(vv() / 100 == VMM_VERSION / 100, "library version %d, header %d", vv(), VMM_VERSION);
    range_fn = gt_entry<gt_range_fn>("cuMemGetAddressRange");
    attr_fn = gt_entry<gt_attr_fn>("cuPointerGetAttribute");
    if (!range_fn || !attr_fn)
        return gt_finish();

    grow_chain();
    failures();
    packed_and_mixed();
    queued_work();
    INFO("grows: %d in place, %d moved", g_in_place, g_moved);
    R("realloc done");
    gt_leftover_check("realloc", g_freed, g_nfreed);
    return gt_finish();
}
