/* Shared set-up for the unit suites: the simulated driver installed in the driver table,
 * default options, and helpers to make chunks and check buffers. Header-only (static inline)
 * so each suite stays one file. */
#ifndef VMH_TESTUTIL_H
#define VMH_TESTUTIL_H

#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cudaTypedefs.h>

#include "contexts.h"
#include "driver.h"
#include "handle.h"
#include "heap.h"
#include "lifetime.h"
#include "options.h"
#include "phase.h"
#include "range.h"
#include "reclaim.h"
#include "simdrv.h"
#include "stats.h"
#include "tags.h"

/* The unit suites have no interposer to report context changes to contexts.h (whose cache of
 * the calling thread's context the heap reads): a test that makes a context current reports
 * it as the interposer would. */
static inline void tu_set_current_device(int dev)
{
    sim_set_current_device(dev);
    vmh_ctx_current_changed();
}
#define sim_set_current_device(dev) tu_set_current_device(dev)

/* A forked child that ends with exit() calls tu_forked_child() first. LeakSanitizer (the ASan
 * build) asks __lsan_is_turned_off() at exit before its leak check, which takes the sanitizer
 * allocator's lock: in a child forked while another thread was inside malloc, that lock stays
 * held for ever (GCC's runtime takes no lock around fork) and the child would hang in the
 * sanitizer, not in the library. A child's leaks are its parent's memory anyway. (Not static:
 * the runtime finds it by name; each suite is one file, so it is defined once.) */
static volatile sig_atomic_t tu_in_forked_child;
int __lsan_is_turned_off(void);
int __lsan_is_turned_off(void)
{
    return tu_in_forked_child;
}

static inline void tu_forked_child(void)
{
    tu_in_forked_child = 1;
}

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)
#define GRAN (2 * MiB)

/* The options the suites run with, as the library's front would have parsed them. The layers
 * take settings made from them (lifetime.c), not the options themselves: a test that changes
 * a field calls tu_configure() before the change is to take effect. Lifetime keeps a pointer
 * to them (a refused value is named from them, VMMHOOK_LEAKS is read at exit). */
static vmh_options_t tu_opt;

static inline void tu_configure(void)
{
    vmh_lifetime_configure(&tu_opt);
}

/* A fresh simulated driver (cfg NULL: one 80 GiB device, 2 MiB granularity) and defaults. */
static inline void tu_reset(const sim_config_t *cfg)
{
    vmh_heap_reset();
    vmh_phase_reset(); /* serves again after a test's exit */
    vmh_contexts_reset(); /* the contexts of the previous simulated driver are gone */
    sim_reset(cfg);
    vmh_ctx_current_changed(); /* the contexts the thread knew are gone */
    vmh_driver_install(sim_table());
    vmh_options_defaults(&tu_opt);
    /* The suites use sizes of a few MiB for buffers of their own: pack only below 1 MiB here
     * (the packing tests of test_heap_serve.c say what they pack). */
    tu_opt.pack_below = MiB;
    /* The suites count driver calls: no reclaim thread synchronizes behind their back, and an
     * allocation waits for anything parked first (park limit 0), so that freed memory is
     * reused deterministically. test_reclaim.c turns the thread on and sets its own limits. */
    vmh_reclaim_background(false);
    tu_opt.park_limit = 0;
    /* Nor is freed memory reused at once (contexts.h: the program's work in one queue): the
     * suites check parking; test_ordered.c checks reuse at once. */
    tu_opt.stream_ordered = false;
    tu_configure();
    /* The tags' figures with the overall ones: the bytes requested are kept by both, and a
     * reset of one alone would leave them apart (tu_assert_stats_consistent). */
    vmh_stats_reset();
    vmh_tags_reset();
}

/* Every test ends here: nothing may be left in the driver. */
static inline void tu_assert_ledger_empty(void)
{
    if (!sim_ledger_empty())
        sim_ledger_dump();
    assert_true(sim_ledger_empty());
}

/* cmocka fixtures: a fresh driver before each test; after it, the cache trimmed and the ledger
 * checked empty. */
static inline int tu_setup(void **state)
{
    (void)state;
    tu_reset(NULL);
    return 0;
}

/* Every figure of the live stats JSON is non-negative and the tags' requested bytes sum to the
 * overall gauge (issue 30: resizes moved only the overall figure, so a tag's went negative at
 * the free). Every test's teardown checks it; tests check it between steps too. */
static inline void tu_assert_stats_consistent(void)
{
    static char json[32768];
    int n = vmm_stats_json(json, sizeof json);
    assert_true(n > 0 && (size_t)n < sizeof json);
    if (strstr(json, ": -"))
        fail_msg("a negative figure in the stats JSON:\n%s", json);
    int64_t sum = 0;
    for (unsigned t = 0; t < vmh_tag_count(); t++) {
        assert_true(vmh_tag_requested_peak(t) >= vmh_tag_requested(t));
        sum += vmh_tag_requested(t);
    }
    assert_int_equal(sum, vmh_gauge_get(VMH_STAT_bytes_requested));
}

static inline int tu_teardown(void **state)
{
    (void)state;
    vmh_heap_trim();
    tu_assert_ledger_empty();
    tu_assert_stats_consistent();
    return 0;
}

static inline CUmemAllocationProp tu_prop(int device)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    return p;
}

static inline CUmemAccessDesc tu_rw(int device)
{
    CUmemAccessDesc d;
    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = device;
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return d;
}

/* A chunk of size bytes on device 0 with read-write access for it. */
static inline vmh_alloc_t *tu_chunk(size_t size)
{
    CUmemAllocationProp p = tu_prop(0);
    CUmemAccessDesc d = tu_rw(0);
    vmh_alloc_t *a = NULL;
    assert_int_equal(vmh_alloc_create(NULL, size, &p, &d, 1, &a), CUDA_SUCCESS);
    return a;
}

/* The calls that undo (unmap, free an address, release a chunk): a failure sweep lists them
 * but does not fail them, since an undo that fails leaves the driver holding what it could not
 * undo, which the ledger would report as a leak of the library's (test_sweep.c says more). */
static inline bool tu_is_undo(const char *name)
{
    return !strcmp(name, "cuMemUnmap") || !strcmp(name, "cuMemAddressFree") ||
           !strcmp(name, "cuMemRelease");
}

/* The simulated driver's context calls a test makes itself (the interposer would report them
 * in a program): a second context, made current and destroyed. */
typedef struct tu_ctx_fns {
    PFN_cuCtxCreate_v12050 create;
    PFN_cuCtxDestroy_v4000 destroy;
    PFN_cuCtxSetCurrent_v4000 set_current;
} tu_ctx_fns_t;

static inline tu_ctx_fns_t tu_ctx_fns(void)
{
    tu_ctx_fns_t f = {0};
    CUdriverProcAddressQueryResult st;
    assert_int_equal(sim_get_proc_address("cuCtxCreate", (void **)&f.create, 13000, 0, &st), 0);
    assert_int_equal(sim_get_proc_address("cuCtxDestroy", (void **)&f.destroy, 13000, 0, &st), 0);
    assert_int_equal(
        sim_get_proc_address("cuCtxSetCurrent", (void **)&f.set_current, 13000, 0, &st), 0);
    return f;
}

/* How many times slower than a plain build the sanitizer of this build runs the tests
 * (ThreadSanitizer about ten, AddressSanitizer two to three): loops that only repeat the same
 * operations for coverage divide their counts by it, so that every test stays well inside its
 * time budget under TSan on a busy 2-core machine (the stress step repeats the concurrency
 * tests for the coverage). */
#if defined(__SANITIZE_THREAD__)
#define TU_SLOWDOWN 8
#elif defined(__SANITIZE_ADDRESS__)
#define TU_SLOWDOWN 2
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TU_SLOWDOWN 8
#elif __has_feature(address_sanitizer)
#define TU_SLOWDOWN 2
#endif
#endif
#ifndef TU_SLOWDOWN
#define TU_SLOWDOWN 1
#endif

/* Whether a fault sweep fails its k-th candidate call (counted from 0 among the calls it may
 * fail): every one in the plain and ASan builds; under TSan every fourth, from the first (the
 * sweeps rebuild their fixture at each point: the plain and ASan builds sweep them all, TSan a
 * sample, for the races). */
static inline bool tu_sweep_point(unsigned long k)
{
    return TU_SLOWDOWN <= 2 || k % (TU_SLOWDOWN / 2) == 0;
}

/* tu_fill's pattern: byte i of a buffer is i * 131 + seed (mod 256). It repeats every 256
 * bytes, so one chunk of it serves every chunk of a buffer (the chunks start at multiples of
 * 256): filling and checking cost one sim_write / sim_read and one memcmp per chunk, not a loop
 * per byte (instrumented per byte under TSan, where that loop was most of the sanitized suites'
 * time). */
#define TU_FILL_CHUNK ((size_t)64 << 10)

static inline void tu_pattern_chunk(unsigned char *buf, unsigned seed)
{
    for (size_t i = 0; i < 256; i++)
        buf[i] = (unsigned char)(i * 131u + seed);
    for (size_t have = 256; have < TU_FILL_CHUNK; have *= 2)
        memcpy(buf + have, buf, have);
}

/* Writes the pattern for seed over [p, p + n) through the simulated mappings; safe in threads
 * (no cmocka assertion). */
static inline bool tu_fill_try(CUdeviceptr p, size_t n, unsigned seed)
{
    unsigned char *buf = malloc(TU_FILL_CHUNK);
    bool ok = buf != NULL;
    if (ok)
        tu_pattern_chunk(buf, seed);
    for (size_t off = 0; ok && off < n; off += TU_FILL_CHUNK) {
        size_t len = n - off < TU_FILL_CHUNK ? n - off : TU_FILL_CHUNK;
        ok = sim_write(p + off, buf, len) == CUDA_SUCCESS;
    }
    free(buf);
    return ok;
}

static inline void tu_fill(CUdeviceptr p, size_t n, unsigned seed)
{
    assert_true(tu_fill_try(p, n, seed));
}

/* True when [p, p + n) holds tu_fill's pattern for seed. */
static inline bool tu_check(CUdeviceptr p, size_t n, unsigned seed)
{
    unsigned char *want = malloc(TU_FILL_CHUNK), *got = malloc(TU_FILL_CHUNK);
    bool ok = want && got;
    if (ok)
        tu_pattern_chunk(want, seed);
    for (size_t off = 0; ok && off < n; off += TU_FILL_CHUNK) {
        size_t len = n - off < TU_FILL_CHUNK ? n - off : TU_FILL_CHUNK;
        ok = sim_read(got, p + off, len) == CUDA_SUCCESS && memcmp(got, want, len) == 0;
    }
    free(want);
    free(got);
    return ok;
}

#endif
