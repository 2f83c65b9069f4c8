/* The first pause's backup copy (copypool.c, staging.c, and pause.c's use of them), on the
 * simulated driver: the copy pool copies every byte; the staging ring copies device memory of
 * sizes that are not multiples of its slot (1 byte over, many slots, less than one slot) with
 * every byte right, which it can only do by waiting for each asynchronous copy before reading
 * its slot (the simulated driver lands an async copy into pinned memory only when its stream is
 * synchronized: a slot read too early holds stale bytes, and the fill below differs from piece
 * to piece); a tag's pause through the ring keeps the contents and leaves nothing pinned; a
 * refused pinning falls back to direct copies; and a fault sweep over a staged pause. The pool
 * of kept pinned backups (staging.c, the one owner of backup host memory): the ring's backups
 * are pinned during the pause within the budget (VMMHOOK_PIN_LIMIT, a quarter of the host's
 * memory, never below an eighth available: the host is read through an injected reader), kept
 * between pauses, given back under pressure; refused registrations leave backups pageable; and
 * a fault sweep over a pause that pins. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_tags_reset, vmh_pause_reset, vmh_pause_set_staging */
#endif
#include "testutil.h"
#include "testtags.h"

#include "copypool.h"
#include "lifetime.h"
#include "pause.h"
#include "staging.h"
#include "tags.h"
#include "vmmhook.h"

#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define KiB ((size_t)1 << 10)
#define INJECTED CUDA_ERROR_UNKNOWN

/* ---- bytes that never repeat with a period of a slot ---------------------------------------- */

/* Byte i of the pattern for seed: a hash, so that no two pieces of a buffer hold the same
 * bytes (tu_fill's pattern repeats every 256 bytes, which would let a stale slot pass). */
static unsigned char pattern(size_t i, unsigned seed)
{
    uint64_t x = (uint64_t)i * 0x9E3779B97F4A7C15ull + seed;
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    return (unsigned char)(x >> 56);
}

/* The first n bytes of seed's pattern, made once per seed and kept (the largest n asked so
 * far): the sweeps fill and check the same 28 MiB at every injection point, and a loop per
 * byte there was most of this test's time under TSan (353 s). The hash runs once per byte
 * per seed; each use is one copy or one memcmp. */
static const unsigned char *pattern_bytes(size_t n, unsigned seed)
{
    /* One slot per seed modulo its size: a seed whose slot another one took is made again. */
    static struct {
        unsigned seed;
        size_t n;
        unsigned char *bytes;
    } made[64];
    size_t k = seed % (sizeof made / sizeof made[0]);
    if (made[k].bytes && made[k].seed == seed && made[k].n >= n)
        return made[k].bytes;
    unsigned char *b = realloc(made[k].bytes, n ? n : 1);
    assert_non_null(b);
    for (size_t i = 0; i < n; i++)
        b[i] = pattern(i, seed);
    made[k].seed = seed;
    made[k].n = n;
    made[k].bytes = b;
    return b;
}

static void pattern_fill(CUdeviceptr p, size_t n, unsigned seed)
{
    assert_int_equal(sim_write(p, pattern_bytes(n, seed), n), CUDA_SUCCESS);
}

static bool pattern_in_host(const unsigned char *h, size_t n, unsigned seed)
{
    return memcmp(h, pattern_bytes(n, seed), n) == 0;
}

static bool pattern_on_device(CUdeviceptr p, size_t n, unsigned seed)
{
    unsigned char *buf = malloc(n);
    assert_non_null(buf);
    bool ok = sim_read(buf, p, n) == CUDA_SUCCESS && pattern_in_host(buf, n, seed);
    free(buf);
    return ok;
}

/* ---- the copy pool --------------------------------------------------------------------------- */

static void copy_pool_copies_every_byte(void **state)
{
    (void)state;
    size_t max = 10 * MiB + 3;
    unsigned char *src = malloc(max), *dst = malloc(max);
    assert_non_null(src);
    assert_non_null(dst);
    for (size_t i = 0; i < max; i++)
        src[i] = pattern(i, 5);
    /* Page-rounded parts per worker up to 2 MiB; above, 2 MiB parts, more than workers. */
    static const size_t sizes[] = {
        0, 1, 4095, 4096, 3 * 4096 + 5, MiB + 7, 3 * MiB + 4097, 10 * MiB + 3};
    for (int want = 0; want <= 3; want += 3) { /* none: the caller copies; three workers */
        vmh_copy_pool_t pool;
        vmh_copy_pool_start(&pool, want);
        assert_true(pool.nthreads <= want);
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            memset(dst, 0xee, max);
            vmh_copy_pool_run(&pool, dst, src, sizes[k]);
            assert_true(pattern_in_host(dst, sizes[k], 5));
            if (sizes[k] < max) /* not one byte past the end */
                assert_int_equal(dst[sizes[k]], 0xee);
        }
        vmh_copy_pool_stop(&pool);
        assert_int_equal(pool.nthreads, 0);
    }
    free(src);
    free(dst);
}

/* Whether [p, p + n) is mapped (msync answers ENOMEM for unmapped pages). */
static bool host_mapped(const void *p, size_t n)
{
    return msync((void *)p, n, MS_ASYNC) == 0;
}

/* The pause's region: backups handed out in order from one mapping, a backup it has no room
 * for mapped on its own, the unused tail unmapped at close, each backup unmapped at its put. */
static void region_hands_out_in_order(void **state)
{
    (void)state;
    vmh_staging_region_open(7 * MiB);
    bool pinned = true;
    char *a = vmh_staging_backup_get(2 * MiB, VMH_BACKUP_ANY, &pinned);
    assert_false(pinned);
    char *b = vmh_staging_backup_get(4 * MiB, VMH_BACKUP_ANY, &pinned);
    char *c = vmh_staging_backup_get(2 * MiB, VMH_BACKUP_ANY, &pinned); /* 1 MiB left: its own */
    assert_true(((uintptr_t)a & (2 * MiB - 1)) == 0); /* huge-page aligned */
    assert_ptr_equal(b, a + 2 * MiB);
    assert_true(c != b + 4 * MiB);
    assert_true(host_mapped(b + 4 * MiB, MiB));
    vmh_staging_region_close();
    assert_false(host_mapped(b + 4 * MiB, MiB));
    memset(a, 1, 2 * MiB);
    memset(b, 2, 4 * MiB);
    memset(c, 3, 2 * MiB);
    vmh_staging_backup_put(b, 4 * MiB);
    assert_false(host_mapped(b, 4 * MiB));
    assert_true(host_mapped(a, 2 * MiB));
    vmh_staging_backup_put(a, 2 * MiB);
    vmh_staging_backup_put(c, 2 * MiB);
    assert_false(host_mapped(a, 2 * MiB) || host_mapped(c, 2 * MiB));
}

/* The production reader of the host's memory answers something sane here. */
static void host_memory_reader(void **state)
{
    (void)state;
    vmh_host_mem_t m;
    assert_true(vmh_host_mem_read(&m));
    printf("  host memory as the budget reads it: %zu MiB, %zu MiB available\n", m.total / MiB,
           m.available / MiB);
    assert_true(m.total >= 64 * MiB);
    assert_true(m.available <= m.total);
}

/* ---- the staging ring ------------------------------------------------------------------------ */

/* The simulated driver's rule the ring relies on (and the reason the tests below can fail): an
 * async copy into pinned memory on a non-blocking stream lands at that stream's synchronization,
 * not before and not at another stream's. */
static void sim_async_copy_lands_at_sync(void **state)
{
    (void)state;
    const vmh_driver_t *d = sim_table();
    CUdeviceptr dev = 0;
    assert_int_equal(d->cuMemAlloc(&dev, 4096), CUDA_SUCCESS);
    assert_int_equal(sim_memset(dev, 0x5a, 4096), CUDA_SUCCESS);
    unsigned char *slot = NULL;
    assert_int_equal(d->cuMemHostAlloc((void **)&slot, 4096, CU_MEMHOSTALLOC_PORTABLE),
                     CUDA_SUCCESS);
    assert_false(sim_ledger_empty()); /* pinned host memory is in the ledger */
    CUstream s, other;
    assert_int_equal(d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    assert_int_equal(d->cuStreamCreate(&other, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    assert_int_equal(d->cuMemcpyDtoHAsync(slot, dev, 4096, s), CUDA_SUCCESS);
    assert_int_equal(slot[100], 0); /* stale */
    assert_int_equal(d->cuStreamSynchronize(other), CUDA_SUCCESS);
    assert_int_equal(slot[100], 0);
    assert_int_equal(d->cuStreamSynchronize(s), CUDA_SUCCESS);
    assert_int_equal(slot[100], 0x5a);
    assert_int_equal(d->cuStreamDestroy(s), CUDA_SUCCESS);
    assert_int_equal(d->cuStreamDestroy(other), CUDA_SUCCESS);
    assert_int_equal(d->cuMemFreeHost(slot), CUDA_SUCCESS);
    assert_int_equal(d->cuMemFree(dev), CUDA_SUCCESS);
    assert_int_equal(sim_hazards(), 0);
}

/* A ring on the heap: a failed assertion skips its close, and its workers then keep waiting on
 * it; on the stack, the next test's ring would take the same memory under them. */
static vmh_staging_t *ring_new(void)
{
    vmh_staging_t *ring = calloc(1, sizeof *ring);
    assert_non_null(ring);
    return ring;
}

/* A device buffer of n bytes (native: any size) filled with the pattern for seed. */
static CUdeviceptr device_buffer(size_t n, unsigned seed)
{
    CUdeviceptr p = 0;
    assert_int_equal(sim_table()->cuMemAlloc(&p, n), CUDA_SUCCESS);
    pattern_fill(p, n, seed);
    return p;
}

/* Copies n bytes through a ring of slot-byte slots into fresh memory; checks every byte, the
 * byte after the end untouched, and one async copy and one wait per slot's worth. */
static void staged_copy_of(vmh_staging_t *ring, size_t n, unsigned seed)
{
    CUdeviceptr src = device_buffer(n, seed);
    unsigned char *dst = malloc(n + 1);
    assert_non_null(dst);
    memset(dst, 0xee, n + 1);
    sim_reset_counters();
    assert_int_equal(vmh_staging_copy(ring, dst, src, n), CUDA_SUCCESS);
    size_t pieces = (n + ring->slot_size - 1) / ring->slot_size;
    assert_int_equal(sim_calls("cuMemcpyDtoHAsync"), pieces);
    assert_int_equal(sim_calls("cuStreamSynchronize"), pieces);
    assert_int_equal(sim_calls("cuMemcpyDtoH"), 0);
    assert_true(pattern_in_host(dst, n, seed));
    assert_int_equal(dst[n], 0xee);
    assert_int_equal(sim_pending_ops(), 0);
    free(dst);
    assert_int_equal(sim_table()->cuMemFree(src), CUDA_SUCCESS);
}

static void staging_copies_sizes_not_multiple_of_slot(void **state)
{
    (void)state;
    /* A small slot reaches many slots cheaply; the library's own 16 MiB slot once as well. */
    static const size_t slots[] = {64 * KiB + 512, 16 * MiB};
    CUcontext ctx = sim_primary_context(0);
    for (size_t k = 0; k < 2; k++) {
        size_t slot = slots[k];
        vmh_staging_t *ring = ring_new();
        assert_int_equal(vmh_staging_open(ring, ctx, slot, 4), CUDA_SUCCESS);
        assert_int_equal(sim_live_host(), 2);
        assert_int_equal(sim_host_pinned_bytes(), 2 * slot);
        staged_copy_of(ring, slot + 1, 1); /* one byte over: two pieces */
        staged_copy_of(ring, slot / 3, 2); /* less than one slot */
        staged_copy_of(ring, 1, 3);        /* one byte */
        staged_copy_of(ring, 2 * slot, 4); /* exactly two */
        if (k == 0)
            staged_copy_of(ring, 7 * slot + 999, 6); /* many, both slots reused */
        vmh_staging_leave_context(ring);
        assert_int_equal(sim_live_streams(), 0);
        vmh_staging_close(ring);
        free(ring);
        assert_int_equal(sim_live_host(), 0);
        assert_int_equal(sim_host_pinned_bytes(), 0);
    }
    assert_int_equal(sim_hazards(), 0);
}

/* Failures: pinning the second slot gives back the first; a failed queue or wait fails the copy
 * and leaves nothing queued once the context is left (a slot freed under a queued copy would be
 * a hazard). */
static void staging_failures_leave_nothing(void **state)
{
    (void)state;
    CUcontext ctx = sim_primary_context(0);
    vmh_staging_t *ring = ring_new();
    sim_fail_function("cuMemHostAlloc", 2, CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_staging_open(ring, ctx, 64 * KiB, 2), CUDA_ERROR_OUT_OF_MEMORY);
    sim_clear_faults();
    assert_int_equal(sim_live_host(), 0);

    static const char *const calls[] = {"cuStreamCreate", "cuMemcpyDtoHAsync",
                                        "cuStreamSynchronize"};
    size_t n = 5 * 64 * KiB + 3;
    CUdeviceptr src = device_buffer(n, 9);
    unsigned char *dst = malloc(n);
    assert_non_null(dst);
    for (size_t c = 0; c < 3; c++)
        for (unsigned long nth = 1; nth <= 3; nth++) {
            assert_int_equal(vmh_staging_open(ring, ctx, 64 * KiB, 2), CUDA_SUCCESS);
            unsigned long fired_before = sim_faults_fired();
            sim_fail_function(calls[c], nth, INJECTED);
            CUresult rc = vmh_staging_copy(ring, dst, src, n);
            bool fired = sim_faults_fired() > fired_before;
            sim_clear_faults();
            assert_int_equal(rc, fired ? INJECTED : CUDA_SUCCESS);
            if (!fired) /* cuStreamCreate is called once */
                assert_true(pattern_in_host(dst, n, 9));
            vmh_staging_leave_context(ring);
            vmh_staging_close(ring);
            assert_int_equal(sim_pending_ops(), 0);
            assert_int_equal(sim_live_streams(), 0);
            assert_int_equal(sim_live_host(), 0);
        }
    assert_int_equal(sim_hazards(), 0);
    free(ring);
    free(dst);
    assert_int_equal(sim_table()->cuMemFree(src), CUDA_SUCCESS);
}

/* A failed wait leaves the copy queued in the copying context; the slots are freed in the
 * context they were pinned in, whose freeing waits only for its own work: leaving the copying
 * context must wait for that copy first (else a hazard: pinned memory freed under a copy). */
static void staging_failure_in_another_context(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    vmh_staging_t *ring = ring_new();
    assert_int_equal(vmh_staging_open(ring, sim_primary_context(0), 64 * KiB, 2), CUDA_SUCCESS);
    sim_set_current_device(1);
    size_t n = 3 * 64 * KiB;
    CUdeviceptr src = device_buffer(n, 11);
    unsigned char *dst = malloc(n);
    assert_non_null(dst);
    sim_fail_function("cuStreamSynchronize", 2, INJECTED);
    assert_int_equal(vmh_staging_copy(ring, dst, src, n), INJECTED);
    sim_clear_faults();
    assert_int_equal(sim_pending_ops(), 1);
    vmh_staging_leave_context(ring);
    assert_int_equal(sim_pending_ops(), 0);
    vmh_staging_close(ring);
    assert_int_equal(sim_current_device(), 1);
    assert_int_equal(sim_live_host(), 0);
    assert_int_equal(sim_hazards(), 0);
    assert_int_equal(sim_table()->cuMemFree(src), CUDA_SUCCESS);
    sim_set_current_device(0);
    free(dst);
    free(ring);
}

/* ---- a tag's pause through the ring ---------------------------------------------------------- */

/* The host as the budget sees it (staging.h), set by each test. */
static vmh_host_mem_t fake_host;

/* Pinned memory is not available: what the simulated driver holds pinned comes off. */
static bool fake_host_read(vmh_host_mem_t *out)
{
    size_t pinned = sim_host_pinned_bytes();
    *out = fake_host;
    out->available = fake_host.available > pinned ? fake_host.available - pinned : 0;
    return true;
}

/* A host with plenty: 64 GiB, 48 available (budget: a quarter, 16 GiB; mark: 8 GiB). */
static void host_plenty(void)
{
    fake_host = (vmh_host_mem_t){64 * GiB, 48 * GiB};
    vmh_staging_set_host_mem(fake_host_read);
}

static void set_pin_limit(size_t limit)
{
    tu_opt.pin_limit = limit;
    vmh_pause_configure(tu_opt.pin_limit);
}

static void backup_reset(const sim_config_t *cfg)
{
    tu_reset(cfg);
    assert_true(vmh_lifetime_ready());
    tu_opt.pack_below = MiB;
    tu_opt.pin_limit = 0;
    tu_opt.headroom = 0;
    tu_configure();
    vmh_pause_configure(tu_opt.pin_limit);
    vmh_tags_reset();
    vmh_pause_reset();
    host_plenty();
    /* A slot of 3 MiB, so that the 2 MiB-granular records are not multiples of it, and the ring
     * used from 1 MiB of pageable backups on. */
    vmh_pause_set_staging(3 * MiB, MiB);
}

static int setup(void **state)
{
    (void)state;
    backup_reset(NULL);
    return 0;
}



/* The tag "w": records smaller than a slot (2 MiB), one slot and a part (4 MiB), many slots and
 * a part (20 MiB), and a packed small buffer (its 2 MiB extent). */
typedef struct wfix {
    CUdeviceptr p[4];
    size_t n[4];
} wfix_t;

static void wfix_make(wfix_t *f)
{
    static const size_t sizes[4] = {2 * MiB, 4 * MiB, 20 * MiB, 3000};
    for (int i = 0; i < 4; i++) {
        f->n[i] = sizes[i];
        f->p[i] = tt_alloc_in("w", sizes[i]);
        pattern_fill(f->p[i], sizes[i], 70u + (unsigned)i);
    }
    vmh_heap_trim();
}

static bool wfix_intact(const wfix_t *f)
{
    for (int i = 0; i < 4; i++)
        if (!pattern_on_device(f->p[i], f->n[i], 70u + (unsigned)i))
            return false;
    return true;
}

static void wfix_free(const wfix_t *f)
{
    for (int i = 0; i < 4; i++)
        assert_int_equal(vmh_heap_free(f->p[i], NULL, false), CUDA_SUCCESS);
}

/* Backed-up bytes of tag "w", from the statistics. */
static size_t w_backed_up(void)
{
    char buf[8192];
    assert_true(vmm_stats_json(buf, sizeof buf) < (int)sizeof buf);
    const char *at = strstr(buf, "\"w\": {");
    assert_non_null(at);
    at = strstr(at, "\"backed_up\": ");
    assert_non_null(at);
    return (size_t)strtoull(at + strlen("\"backed_up\": "), NULL, 10);
}

/* The statistics' pinned_host_bytes.current. */
static size_t stats_pinned(void)
{
    char buf[8192];
    assert_true(vmm_stats_json(buf, sizeof buf) < (int)sizeof buf);
    const char *at = strstr(buf, "\"pinned_host_bytes\": {\"current\": ");
    assert_non_null(at);
    return (size_t)strtoull(at + strlen("\"pinned_host_bytes\": {\"current\": "), NULL, 10);
}

#define W_BYTES (2 * MiB + 4 * MiB + 20 * MiB + 2 * MiB)

/* With room in the budget the first pause copies through the ring and the pinner registers each
 * backup during the pause: the pause returns with the backups pinned (the slots gone), the
 * first resume copies back from pinned memory without pinning anything, and the next pause
 * copies into the same buffers directly. */
static void first_pause_stages_and_pins(void **state)
{
    (void)state;
    wfix_t f;
    wfix_make(&f);
    set_pin_limit(256 * MiB);
    sim_reset_counters();
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    size_t paused = w_backed_up();
    assert_int_equal(paused, W_BYTES);
    assert_int_equal(vmh_pause_staged_bytes(), paused);
    /* Pieces: 1 + 2 + 7 + 1; the slots pinned once and given back; no direct copy; each
     * backup registered once, by the pinner. */
    assert_int_equal(sim_calls("cuMemcpyDtoHAsync"), 11);
    assert_int_equal(sim_calls("cuMemcpyDtoH"), 0);
    assert_int_equal(sim_calls("cuMemHostAlloc"), 2);
    assert_int_equal(sim_calls("cuMemFreeHost"), 2);
    assert_int_equal(sim_calls("cuMemHostRegister"), 4);
    /* Pinned: the four backups, nothing of the ring; no stream, nothing queued. */
    assert_int_equal(sim_live_host(), 4);
    assert_int_equal(sim_host_pinned_bytes(), W_BYTES);
    assert_int_equal(stats_pinned(), W_BYTES);
    assert_int_equal(vmh_staging_kept_count(), 4);
    assert_int_equal(sim_live_streams(), 0);
    assert_int_equal(sim_pending_ops(), 0);
    assert_int_equal(sim_device_used(0), 0);

    sim_reset_counters();
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(wfix_intact(&f));
    assert_int_equal(sim_calls("cuMemHostRegister"), 0); /* pinned already */
    assert_int_equal(sim_calls("cuMemcpyHtoD"), 4);
    assert_int_equal(vmh_staging_pinned_free(), W_BYTES);
    sim_reset_counters();
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmh_pause_staged_bytes(), paused); /* no more through the ring */
    assert_int_equal(sim_calls("cuMemcpyDtoH"), 4);
    assert_int_equal(sim_calls("cuMemcpyDtoHAsync"), 0);
    assert_int_equal(sim_calls("cuMemHostAlloc") + sim_calls("cuMemHostRegister"), 0);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(wfix_intact(&f));
    wfix_free(&f);
    assert_int_equal(sim_hazards(), 0);
}

/* VMMHOOK_PIN_LIMIT 0 keeps nothing: the pause leaves nothing pinned, the resume copies back
 * from pageable memory. */
static void pin_limit_zero_keeps_none(void **state)
{
    (void)state;
    wfix_t f;
    wfix_make(&f);
    sim_reset_counters();
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmh_pause_staged_bytes(), W_BYTES);
    assert_int_equal(sim_calls("cuMemHostAlloc"), 2);
    assert_int_equal(sim_calls("cuMemFreeHost"), 2);
    assert_int_equal(sim_live_host(), 0);
    assert_int_equal(sim_host_pinned_bytes(), 0);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(wfix_intact(&f));
    assert_int_equal(sim_calls("cuMemHostRegister"), 0);
    assert_int_equal(sim_live_host(), 0);
    assert_int_equal(stats_pinned(), 0);
    wfix_free(&f);
}

/* One pause and resume with pinning; the most ever pinned must stay within want. */
static void cycle_within(const wfix_t *f, size_t want)
{
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_true(sim_host_pinned_bytes() <= want);
    assert_int_equal(sim_host_pinned_bytes(), vmh_staging_kept_bytes());
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(wfix_intact(f));
    assert_true(sim_host_pinned_bytes() <= want);
    assert_int_equal(sim_host_pinned_bytes(), stats_pinned());
}

/* The budget: min(VMMHOOK_PIN_LIMIT, a quarter of the host's memory), and never pinning below an
 * eighth available. Each bound in turn is the smallest; the pause and the resume both keep to it
 * (the resume pins what the pause could not, within what is left), and something is pinned
 * whenever a backup fits. */
static void budget_is_obeyed(void **state)
{
    (void)state;
    wfix_t f;
    wfix_make(&f);
    static const struct {
        size_t total, available, limit, want;
    } cases[] = {
        {48 * MiB, 40 * MiB, 256 * MiB, 12 * MiB},      /* a quarter of a 48 MiB host */
        {64 * GiB, 48 * GiB, 5 * MiB, 5 * MiB},         /* the cap */
        {GiB, 128 * MiB + 9 * MiB, 256 * MiB, 9 * MiB}, /* 9 MiB above the mark of 128 */
        {GiB, 100 * MiB, 256 * MiB, 0},                 /* below the mark: nothing */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        vmh_pause_reset();
        fake_host = (vmh_host_mem_t){cases[c].total, cases[c].available};
        vmh_staging_set_host_mem(fake_host_read);
        set_pin_limit(cases[c].limit);
        for (int cycle = 0; cycle < 3; cycle++)
            cycle_within(&f, cases[c].want);
        if (cases[c].want >= 2 * MiB)
            assert_true(sim_host_pinned_bytes() >= 2 * MiB);
        else
            assert_int_equal(sim_host_pinned_bytes(), 0);
    }
    wfix_free(&f);
    assert_int_equal(sim_hazards(), 0);
}

/* Kept between pauses: later cycles pin nothing more and copy directly. Under pressure (the
 * host's available memory below an eighth) the next call gives back the free kept buffers, but
 * never those holding a paused tag's backups; when the pressure is gone the next pause pins
 * again. */
static void kept_between_pauses_given_back_under_pressure(void **state)
{
    (void)state;
    wfix_t f;
    wfix_make(&f);
    set_pin_limit(256 * MiB);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_int_equal(vmh_staging_kept_count(), 4);
    sim_reset_counters();
    for (int i = 0; i < 3; i++) {
        assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
        assert_int_equal(vmm_resume("w"), VMM_OK);
        assert_true(wfix_intact(&f));
    }
    assert_int_equal(sim_calls("cuMemHostRegister") + sim_calls("cuMemHostUnregister") +
                         sim_calls("cuMemHostAlloc") + sim_calls("cuMemcpyDtoHAsync"),
                     0);
    assert_int_equal(sim_host_pinned_bytes(), W_BYTES);

    /* Pressure while paused: the backups in use stay. */
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    fake_host.available = 7 * GiB; /* mark: 8 GiB */
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_int_equal(sim_calls("cuMemHostUnregister"), 0);
    assert_true(wfix_intact(&f));
    /* Free now: the next call gives them back, and pins nothing new. */
    size_t staged = vmh_pause_staged_bytes();
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(sim_calls("cuMemHostUnregister"), 4);
    assert_int_equal(sim_host_pinned_bytes(), 0);
    assert_int_equal(stats_pinned(), 0);
    assert_int_equal(vmh_pause_staged_bytes(), staged + W_BYTES); /* pageable again */
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(wfix_intact(&f));
    assert_int_equal(sim_calls("cuMemHostRegister"), 0);
    assert_int_equal(sim_live_host(), 0);
    /* Pressure gone: the next pause pins again. */
    fake_host.available = 48 * GiB;
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(sim_calls("cuMemHostRegister"), 4);
    assert_int_equal(sim_host_pinned_bytes(), W_BYTES);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(wfix_intact(&f));
    wfix_free(&f);
    assert_int_equal(sim_hazards(), 0);
}

/* vmm_backup_trim: the kept pinned buffers free after a resume are given back (unregistered,
 * unmapped) and counted; those holding a paused tag's backup stay. */
static void backup_trim_gives_back_free_kept(void **state)
{
    (void)state;
    wfix_t f;
    wfix_make(&f);
    set_pin_limit(256 * MiB);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmm_backup_trim(), 0); /* every kept buffer holds a backup */
    assert_int_equal(sim_host_pinned_bytes(), W_BYTES);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_int_equal(vmh_staging_kept_count(), 4);
    sim_reset_counters();
    assert_int_equal(vmm_backup_trim(), W_BYTES);
    assert_int_equal(sim_calls("cuMemHostUnregister"), 4);
    assert_int_equal(vmh_staging_kept_count(), 0);
    assert_int_equal(sim_host_pinned_bytes(), 0);
    assert_int_equal(stats_pinned(), 0);
    assert_int_equal(vmm_backup_trim(), 0);
    /* The next pause starts over: staged and pinned again. */
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(sim_host_pinned_bytes(), W_BYTES);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(wfix_intact(&f));
    wfix_free(&f);
    assert_int_equal(sim_hazards(), 0);
}

/* VMM_PAUSE_PAGEABLE: contents kept through the ring, nothing registered at the pause or the
 * resume, no kept pinned buffer taken (one is free from an earlier pause), nothing host-side
 * left after the resume beyond that free buffer. */
static void pageable_backups_never_pinned(void **state)
{
    (void)state;
    wfix_t f;
    wfix_make(&f);
    set_pin_limit(256 * MiB);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK); /* kept buffers exist now */
    assert_int_equal(vmm_resume("w"), VMM_OK);
    sim_reset_counters();
    size_t staged = vmh_pause_staged_bytes();
    for (int i = 0; i < 2; i++) {
        assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP | VMM_PAUSE_PAGEABLE), VMM_OK);
        assert_int_equal(vmm_resume("w"), VMM_OK);
        assert_true(wfix_intact(&f));
    }
    assert_int_equal(sim_calls("cuMemHostRegister"), 0);
    assert_int_equal(vmh_pause_staged_bytes(), staged + 2 * W_BYTES); /* never a kept one */
    assert_int_equal(vmh_staging_kept_count(), 4);
    /* PAGEABLE or DISK alone, both at once, unknown bits: refused, nothing done. */
    assert_int_equal(vmm_pause("w", VMM_PAUSE_PAGEABLE), VMM_ERR_INVALID);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_DISK), VMM_ERR_INVALID);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP | VMM_PAUSE_PAGEABLE | VMM_PAUSE_DISK),
                     VMM_ERR_INVALID);
    assert_int_equal(vmm_pause("w", 8u | VMM_PAUSE_BACKUP), VMM_ERR_INVALID);
    assert_true(wfix_intact(&f));
    wfix_free(&f);
    assert_int_equal(sim_hazards(), 0);
}

static size_t files_in(const char *dir, size_t *bytes)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    size_t n = 0;
    *bytes = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char path[512];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        assert_int_equal(stat(path, &st), 0);
        *bytes += (size_t)st.st_size;
        n++;
    }
    closedir(d);
    return n;
}

/* VMM_PAUSE_DISK: one file per paused record in the directory while paused (their sizes cover
 * the records), contents back at the resume, the files gone after it, and after a free of a
 * paused buffer (a packed one's extent: at the resume); no directory (or a bad one): refused. */
static void disk_backups_in_files(void **state)
{
    (void)state;
    wfix_t f;
    wfix_make(&f);
    assert_int_equal(vmm_backup_dir("/nonexistent/vmmhook"), VMM_ERR_INVALID);
    assert_int_equal(vmm_backup_dir(""), VMM_ERR_INVALID);
    assert_int_equal(vmm_backup_dir(NULL), VMM_OK);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP | VMM_PAUSE_DISK), VMM_ERR_NO_MEMORY);
    assert_true(wfix_intact(&f)); /* running again, contents kept */
    char dir[] = "/tmp/vmmhook-disk-XXXXXX";
    assert_non_null(mkdtemp(dir));
    assert_int_equal(vmm_backup_dir(dir), VMM_OK);
    size_t bytes;
    for (int i = 0; i < 2; i++) {
        assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP | VMM_PAUSE_DISK), VMM_OK);
        assert_int_equal(files_in(dir, &bytes), 4); /* the packed buffer's extent is one */
        assert_true(bytes >= 26 * MiB + 3000);
        unsigned char head[16];
        assert_int_equal(vmm_backup_read((void *)(uintptr_t)f.p[2], head, sizeof head), VMM_OK);
        assert_true(pattern_in_host(head, sizeof head, 72));
        assert_int_equal(vmm_resume("w"), VMM_OK);
        assert_int_equal(files_in(dir, &bytes), 0);
        assert_true(wfix_intact(&f));
    }
    assert_int_equal(sim_calls("cuMemHostRegister"), 0);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP | VMM_PAUSE_DISK), VMM_OK);
    wfix_free(&f); /* frees of paused buffers: their files go (the packed extent's at the
                    * resume, which gives back packed memory freed while paused) */
    assert_int_equal(files_in(dir, &bytes), 1);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_int_equal(files_in(dir, &bytes), 0);
    assert_int_equal(vmm_backup_dir(NULL), VMM_OK);
    assert_int_equal(rmdir(dir), 0);
    assert_int_equal(sim_hazards(), 0);
}

/* Giving a kept buffer back under pressure can fail (making its context current, or the
 * unregistration): that buffer stays kept, still pinned and counted, the call goes on, and the
 * next call under pressure gives it back. */
static void pressure_release_refused(void **state)
{
    (void)state;
    static const char *const calls[] = {"cuCtxPushCurrent", "cuMemHostUnregister"};
    for (int c = 0; c < 2; c++) {
        backup_reset(NULL);
        set_pin_limit(256 * MiB);
        wfix_t f;
        wfix_make(&f);
        assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
        assert_int_equal(vmm_resume("w"), VMM_OK);
        assert_int_equal(vmh_staging_kept_count(), 4);
        fake_host.available = 7 * GiB; /* below the mark of 8 */
        /* The first of these calls in a pause is the first buffer's release. Its context is
         * pushed only when the thread has not got it current already: none is, for the push. */
        if (c == 0)
            sim_set_current_device(-1);
        sim_fail_function(calls[c], 1, INJECTED);
        assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
        sim_set_current_device(0);
        assert_int_equal(sim_faults_fired(), 1);
        sim_clear_faults();
        assert_int_equal(vmh_staging_kept_count(), 1);
        assert_int_equal(sim_live_host(), 1);
        assert_int_equal(sim_host_pinned_bytes(), vmh_staging_kept_bytes());
        assert_int_equal(sim_host_pinned_bytes(), stats_pinned());
        assert_int_equal(vmm_resume("w"), VMM_OK);
        assert_true(wfix_intact(&f));
        /* Still under pressure: the next call gives the last one back. */
        assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
        assert_int_equal(vmh_staging_kept_count(), 0);
        assert_int_equal(sim_host_pinned_bytes(), 0);
        assert_int_equal(vmm_resume("w"), VMM_OK);
        assert_true(wfix_intact(&f));
        assert_int_equal(sim_hazards(), 0);
        wfix_free(&f);
        vmh_heap_trim();
        vmh_pause_reset();
        tu_assert_ledger_empty();
    }
}

/* A paused buffer freed while paused: its backup's kept buffer becomes free for later backups
 * (never unmapped under the pool); the resume and the next pauses use what is left. */
static void freed_while_paused_keeps_buffer(void **state)
{
    (void)state;
    wfix_t f;
    wfix_make(&f);
    set_pin_limit(256 * MiB);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmh_staging_pinned_free(), 0);
    assert_int_equal(vmh_heap_free(f.p[2], NULL, false), CUDA_SUCCESS); /* the 20 MiB one */
    assert_int_equal(vmh_staging_pinned_free(), 20 * MiB);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    for (int i = 0; i < 4; i++)
        if (i != 2)
            assert_true(pattern_on_device(f.p[i], f.n[i], 70u + (unsigned)i));
    assert_int_equal(vmh_staging_kept_count(), 4);
    sim_reset_counters();
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(sim_calls("cuMemcpyDtoH"), 3);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    for (int i = 0; i < 4; i++)
        if (i != 2)
            assert_true(pattern_on_device(f.p[i], f.n[i], 70u + (unsigned)i));
    for (int i = 0; i < 4; i++)
        if (i != 2)
            assert_int_equal(vmh_heap_free(f.p[i], NULL, false), CUDA_SUCCESS);
    assert_int_equal(sim_hazards(), 0);
}

/* Where each buffer of "w" has its backup now (vmm_backup_host); NULL when it has none. */
static void w_hosts(const wfix_t *f, void *h[4])
{
    for (int i = 0; i < 4; i++) {
        vmm_status st = vmm_backup_host((void *)(uintptr_t)f->p[i], f->n[i], &h[i]);
        assert_true(st == VMM_OK || (st == VMM_ERR_NOT_PAUSED && !h[i]));
    }
}

static bool w_backups_hold(const wfix_t *f, void *const h[4], unsigned seed)
{
    for (int i = 0; i < 4; i++)
        if (!h[i] || !pattern_in_host(h[i], f->n[i], seed + (unsigned)i))
            return false;
    return true;
}

/* VMM_RESUME_KEEP_BACKUP (torch_memory_saver's retain_cpu_backup): the backups stay attached to
 * the running buffers at the same host addresses, readable, out of the free pool; the next pause
 * of the same kind writes the fresh bytes into them (direct copies, same addresses); a resume
 * without the flag, a pause of another kind or without a backup, and a free give them back. */
static void kept_backups_stay_attached(void **state)
{
    (void)state;
    wfix_t f;
    wfix_make(&f);
    set_pin_limit(256 * MiB);
    void *first[4], *now[4];
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    w_hosts(&f, first);
    assert_true(w_backups_hold(&f, first, 70));
    assert_int_equal(vmm_resume_flags("w", 4u), VMM_ERR_INVALID); /* unknown flag: nothing done */
    assert_int_equal(vmm_resume_flags("w", VMM_RESUME_KEEP_BACKUP), VMM_OK);
    assert_true(wfix_intact(&f));
    w_hosts(&f, now);
    assert_memory_equal(now, first, sizeof now);
    assert_true(w_backups_hold(&f, now, 70));
    unsigned char head[64];
    assert_int_equal(vmm_backup_read((void *)(uintptr_t)f.p[1], head, sizeof head), VMM_OK);
    assert_true(pattern_in_host(head, sizeof head, 71));
    assert_int_equal(vmh_staging_pinned_free(), 0); /* attached: nobody else's */
    assert_int_equal(vmm_backup_trim(), 0);
    /* New contents: the next pause writes them into the same host memory, one direct copy
     * each, nothing new mapped or pinned; kept again, and then given back by a plain resume. */
    for (int i = 0; i < 4; i++)
        pattern_fill(f.p[i], f.n[i], 90u + (unsigned)i);
    sim_reset_counters();
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(sim_calls("cuMemcpyDtoH"), 4);
    assert_int_equal(sim_calls("cuMemHostRegister"), 0);
    w_hosts(&f, now);
    assert_memory_equal(now, first, sizeof now);
    assert_true(w_backups_hold(&f, now, 90));
    assert_int_equal(vmm_resume_flags("w", VMM_RESUME_KEEP_BACKUP), VMM_OK);
    assert_int_equal(vmm_resume_flags("w", VMM_RESUME_KEEP_BACKUP), VMM_ERR_NOT_PAUSED);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    w_hosts(&f, now);
    for (int i = 0; i < 4; i++)
        assert_null(now[i]);
    assert_int_equal(vmh_staging_pinned_free(), W_BYTES); /* back in the pool */
    /* Another kind, or no backup, at the next pause: the kept one goes at that pause. */
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmm_resume_flags("w", VMM_RESUME_KEEP_BACKUP), VMM_OK);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP | VMM_PAUSE_PAGEABLE), VMM_OK);
    assert_int_equal(vmh_staging_pinned_free(), W_BYTES);
    w_hosts(&f, now);
    assert_true(w_backups_hold(&f, now, 90));
    assert_int_equal(vmm_resume_flags("w", VMM_RESUME_KEEP_BACKUP), VMM_OK);
    assert_int_equal(vmm_pause("w", 0), VMM_OK);
    w_hosts(&f, now);
    for (int i = 0; i < 4; i++)
        assert_null(now[i]);
    assert_int_equal(vmm_resume_flags("w", VMM_RESUME_KEEP_BACKUP), VMM_OK); /* none to keep */
    /* Freed while running with a kept backup: it goes with the buffer (back to the pool). */
    for (int i = 0; i < 4; i++)
        pattern_fill(f.p[i], f.n[i], 70u + (unsigned)i);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmm_resume_flags("w", VMM_RESUME_KEEP_BACKUP), VMM_OK);
    assert_int_equal(vmh_staging_pinned_free(), 0);
    w_hosts(&f, first);
    assert_int_equal(vmh_heap_free(f.p[2], NULL, false), CUDA_SUCCESS); /* the 20 MiB one */
    assert_int_equal(vmh_staging_pinned_free(), 20 * MiB);
    assert_int_equal(vmh_heap_free(f.p[3], NULL, false), CUDA_SUCCESS); /* packed: its extent's */
    assert_int_equal(vmh_staging_pinned_free(), 22 * MiB);
    for (int i = 0; i < 2; i++) { /* the others keep theirs */
        assert_int_equal(vmm_backup_host((void *)(uintptr_t)f.p[i], f.n[i], &now[i]), VMM_OK);
        assert_ptr_equal(now[i], first[i]);
    }
    for (int i = 0; i < 2; i++)
        assert_int_equal(vmh_heap_free(f.p[i], NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_staging_pinned_free(), W_BYTES);
    assert_int_equal(sim_hazards(), 0);
}

/* The pinner's registration refused (each of the four in turn, and all of them): the pause
 * succeeds, the refused backup stays pageable (and the room it claimed is free again), so the
 * resume registers it before its copy back. */
static void pinner_refused_stays_pageable(void **state)
{
    (void)state;
    for (unsigned long nth = 0; nth <= 4; nth++) {
        backup_reset(NULL);
        set_pin_limit(256 * MiB);
        wfix_t f;
        wfix_make(&f);
        sim_reset_counters();
        if (nth)
            sim_fail_function("cuMemHostRegister", nth, CUDA_ERROR_OUT_OF_MEMORY);
        else
            sim_fail_function_repeat("cuMemHostRegister", 1, 4, CUDA_ERROR_OUT_OF_MEMORY);
        assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
        sim_clear_faults();
        assert_int_equal(vmh_staging_kept_count(), nth ? 3 : 0);
        assert_int_equal(sim_live_host(), nth ? 3 : 0);
        assert_int_equal(sim_host_pinned_bytes(), stats_pinned());
        assert_int_equal(vmm_resume("w"), VMM_OK);
        assert_true(wfix_intact(&f));
        assert_int_equal(vmh_staging_kept_count(), 4);
        assert_int_equal(sim_host_pinned_bytes(), W_BYTES);
        assert_int_equal(sim_hazards(), 0);
        wfix_free(&f);
        vmh_heap_trim();
        vmh_pause_reset();
        tu_assert_ledger_empty();
    }
}

/* Below the threshold the ring is not set up; neither is it when the kept pinned memory covers
 * the backups. */
static void small_totals_copy_directly(void **state)
{
    (void)state;
    wfix_t f;
    wfix_make(&f);
    vmh_pause_set_staging(3 * MiB, 29 * MiB); /* 28 MiB to back up: one short */
    sim_reset_counters();
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmh_pause_staged_bytes(), 0);
    assert_int_equal(sim_calls("cuMemcpyDtoH"), 4);
    assert_int_equal(sim_calls("cuMemHostAlloc") + sim_calls("cuMemcpyDtoHAsync"), 0);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(wfix_intact(&f));
    wfix_free(&f);
}

/* CUDA_ERROR_NOT_PERMITTED from a copy is a failed copy, not memory with another holder (which
 * stays mapped: pause.c's visit_pause asks the range which it was): the pause fails, resumes
 * what it had paused, and leaves nothing pinned, no stream and nothing queued (the wait that
 * answered it left its piece queued: the ring waits for it before it lets go). A later pause
 * of the same tag then works. */
static void refused_copy_fails_the_pause(void **state)
{
    (void)state;
    wfix_t f;
    wfix_make(&f);
    sim_fail_function("cuStreamSynchronize", 1, CUDA_ERROR_NOT_PERMITTED);
    assert_int_not_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    sim_clear_faults();
    assert_int_equal(sim_live_host(), 0);
    assert_int_equal(sim_live_streams(), 0);
    assert_int_equal(sim_pending_ops(), 0);
    assert_true(wfix_intact(&f));
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_true(vmh_pause_staged_bytes() > 0);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(wfix_intact(&f));
    assert_int_equal(sim_hazards(), 0);
    wfix_free(&f);
}

/* The ring on two devices: one pair of slots, a stream in each device's context. */
static void staging_over_two_devices(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    backup_reset(&cfg);
    CUdeviceptr p0 = tt_alloc_in("w", 8 * MiB);
    pattern_fill(p0, 8 * MiB, 80);
    sim_set_current_device(1);
    CUdeviceptr p1 = tt_alloc_in("w", 10 * MiB);
    pattern_fill(p1, 10 * MiB, 81);
    sim_set_current_device(0);
    sim_reset_counters();
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmh_pause_staged_bytes(), 18 * MiB);
    assert_int_equal(sim_calls("cuMemHostAlloc"), 2);
    assert_int_equal(sim_calls("cuStreamCreate"), 2);
    assert_int_equal(sim_calls("cuStreamDestroy"), 2);
    assert_int_equal(sim_live_host(), 0);
    assert_int_equal(sim_live_streams(), 0);
    assert_int_equal(sim_current_device(), 0);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(pattern_on_device(p0, 8 * MiB, 80));
    sim_set_current_device(1);
    assert_true(pattern_on_device(p1, 10 * MiB, 81));
    assert_int_equal(vmh_heap_free(p1, NULL, false), CUDA_SUCCESS);
    sim_set_current_device(0);
    assert_int_equal(vmh_heap_free(p0, NULL, false), CUDA_SUCCESS);
    assert_int_equal(sim_hazards(), 0);
}

/* ---- fault sweep over a staged pause -------------------------------------------------------- */

/* Calls that give back what the pause made: not failed (the real driver does not refuse them
 * for the objects it made; when it does there is nothing left but to report), listed. */
static bool is_undo(const char *name)
{
    return !strcmp(name, "cuMemUnmap") || !strcmp(name, "cuMemAddressFree") ||
           !strcmp(name, "cuMemRelease") || !strcmp(name, "cuCtxPopCurrent") ||
           !strcmp(name, "cuStreamDestroy") || !strcmp(name, "cuMemFreeHost");
}

static void fault_sweep_staged_pause(void **state)
{
    (void)state;
    /* The ring's slots are freed with the context they were pinned in pushed again, after the
     * last stream is destroyed: that push is part of giving back too (see is_undo). */
    size_t last_destroy = 0;
    wfix_t f;
    wfix_make(&f);
    sim_reset_counters();
    sim_trace_begin();
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    unsigned long n = sim_call_count();
    const char *names[512];
    assert_true(sim_trace_get(names, 512) == n && n < 512);
    sim_trace_end();
    for (size_t k = 0; k < n; k++)
        if (!strcmp(names[k], "cuStreamDestroy"))
            last_destroy = k;
    assert_true(last_destroy > 0);
    assert_true(vmh_pause_staged_bytes() > 0);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(wfix_intact(&f));
    wfix_free(&f);
    vmh_heap_trim();
    tu_assert_ledger_empty();

    unsigned points = 0, fallbacks = 0, staged_calls = 0;
    unsigned long candidate = 0;
    for (unsigned long i = 1; i <= n; i++) {
        if (is_undo(names[i - 1]) ||
            (i - 1 > last_destroy && !strcmp(names[i - 1], "cuCtxPushCurrent")))
            continue;
        /* Under TSan a sample of the points, and always the slots' pinning (its fallback). */
        if (!tu_sweep_point(candidate++) && strcmp(names[i - 1], "cuMemHostAlloc") != 0)
            continue;
        backup_reset(NULL);
        wfix_make(&f);
        sim_reset_counters();
        sim_fail_call(i, INJECTED);
        vmm_status st = vmm_pause("w", VMM_PAUSE_BACKUP);
        sim_clear_faults();
        bool host_alloc = !strcmp(names[i - 1], "cuMemHostAlloc");
        if (host_alloc) {
            /* No staging slots: the same pause with direct copies. */
            assert_int_equal(st, VMM_OK);
            assert_int_equal(vmh_pause_staged_bytes(), 0);
            assert_int_equal(sim_calls("cuMemcpyDtoH"), 4);
            assert_int_equal(vmm_resume("w"), VMM_OK);
            fallbacks++;
        } else {
            if (st != VMM_ERR_DRIVER)
                fprintf(stderr, "staged pause: call %lu (%s) failed, pause returned %d\n", i,
                        names[i - 1], (int)st);
            assert_int_equal(st, VMM_ERR_DRIVER);
            assert_int_equal(vmm_last_driver_error(), INJECTED);
            assert_int_equal(vmh_tag_state(vmh_tag_lookup("w")), VMH_TAG_RUNNING);
        }
        staged_calls += !strcmp(names[i - 1], "cuMemcpyDtoHAsync") ||
                        !strcmp(names[i - 1], "cuStreamSynchronize") ||
                        !strcmp(names[i - 1], "cuStreamCreate");
        /* Nothing lost, everything given back: the slots, the stream, nothing queued. */
        assert_true(wfix_intact(&f));
        assert_int_equal(sim_live_host(), 0);
        assert_int_equal(sim_live_streams(), 0);
        assert_int_equal(sim_pending_ops(), 0);
        assert_int_equal(sim_hazards(), 0);
        wfix_free(&f);
        vmh_heap_trim();
        vmh_pause_reset();
        tu_assert_ledger_empty();
        points++;
    }
    printf("  staged pause: %lu driver calls, each failed in turn:", n);
    for (unsigned long k = 0; k < n; k++)
        printf(" %s", names[k] + 2);
    printf("\nstaged pause sweep: %u injection points (%u on the ring's copies and waits, %u "
           "pinning refusals copied directly), no leak, nothing pinned left\n",
           points, staged_calls, fallbacks);
    assert_int_equal(fallbacks, 2); /* either slot's pinning */
    assert_true(staged_calls >= (TU_SLOWDOWN <= 2 ? 2 * 11 + 1 : 2));
}

/* ---- fault sweep over a pause that pins --------------------------------------------------- */

/* Every driver call of a first pause with pinning (the ring's and the pinner's, which run on two
 * threads, so calls are named by function and occurrence, not by position), failed in turn:
 * the pause either succeeds (a refused registration or anything on the pinner's thread: the
 * backup stays pageable) or fails and gives everything back; either way the contents survive,
 * nothing of the ring is left, what is pinned is what the pool keeps, within the budget, and a
 * reset leaves the ledger empty. */
static void fault_sweep_pinning_pause(void **state)
{
    (void)state;
    set_pin_limit(256 * MiB);
    wfix_t f;
    wfix_make(&f);
    sim_reset_counters();
    sim_trace_begin();
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    unsigned long n = sim_call_count();
    const char *names[512];
    assert_true(sim_trace_get(names, 512) == n && n < 512);
    sim_trace_end();
    assert_int_equal(sim_calls("cuMemHostRegister"), 4);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    wfix_free(&f);
    vmh_heap_trim();
    vmh_pause_reset();
    tu_assert_ledger_empty();

    /* As in the sweep above: the push that frees the slots, after the last stream is
     * destroyed, is part of giving back. */
    size_t last_destroy = 0;
    for (size_t k = 0; k < n; k++)
        if (!strcmp(names[k], "cuStreamDestroy"))
            last_destroy = k;
    unsigned points = 0, ok = 0, failed = 0;
    unsigned long candidate = 0;
    for (unsigned long i = 0; i < n; i++) {
        if (is_undo(names[i]) || (i > last_destroy && !strcmp(names[i], "cuCtxPushCurrent")))
            continue;
        /* Under TSan a sample of the points, and always the registrations. */
        if (!tu_sweep_point(candidate++) && strcmp(names[i], "cuMemHostRegister") != 0)
            continue;
        unsigned long nth = 0;
        for (unsigned long k = 0; k <= i; k++)
            nth += !strcmp(names[k], names[i]);
        backup_reset(NULL);
        set_pin_limit(256 * MiB);
        wfix_make(&f);
        sim_reset_counters();
        sim_fail_function(names[i], nth, INJECTED);
        vmm_status st = vmm_pause("w", VMM_PAUSE_BACKUP);
        sim_clear_faults();
        if (st == VMM_OK) {
            assert_int_equal(vmm_resume("w"), VMM_OK);
            ok++;
        } else {
            if (st != VMM_ERR_DRIVER)
                fprintf(stderr, "pinning pause: %s #%lu failed, pause returned %d\n", names[i],
                        nth, (int)st);
            assert_int_equal(st, VMM_ERR_DRIVER);
            assert_int_equal(vmh_tag_state(vmh_tag_lookup("w")), VMH_TAG_RUNNING);
            failed++;
        }
        assert_true(wfix_intact(&f));
        assert_int_equal(sim_live_streams(), 0);
        assert_int_equal(sim_pending_ops(), 0);
        assert_int_equal(sim_hazards(), 0);
        assert_int_equal(sim_host_pinned_bytes(), vmh_staging_kept_bytes());
        assert_int_equal(sim_host_pinned_bytes(), stats_pinned());
        assert_true(sim_host_pinned_bytes() <= W_BYTES);
        wfix_free(&f);
        vmh_heap_trim();
        vmh_pause_reset();
        tu_assert_ledger_empty();
        points++;
    }
    printf("pinning pause sweep: %lu driver calls, %u injection points (%u paused anyway, %u "
           "failed and gave back), no leak, pinned = kept\n",
           n, points, ok, failed);
    assert_true(ok >= 4); /* at least each registration */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(copy_pool_copies_every_byte),
        cmocka_unit_test_setup_teardown(sim_async_copy_lands_at_sync, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(staging_copies_sizes_not_multiple_of_slot, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(staging_failures_leave_nothing, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(staging_failure_in_another_context, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(first_pause_stages_and_pins, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(pin_limit_zero_keeps_none, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(budget_is_obeyed, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(kept_between_pauses_given_back_under_pressure, setup,
                                        tt_teardown),
        cmocka_unit_test_setup_teardown(pressure_release_refused, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(backup_trim_gives_back_free_kept, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(pageable_backups_never_pinned, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(disk_backups_in_files, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(freed_while_paused_keeps_buffer, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(kept_backups_stay_attached, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(pinner_refused_stays_pageable, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(small_totals_copy_directly, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(refused_copy_fails_the_pause, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(staging_over_two_devices, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(fault_sweep_staged_pause, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(fault_sweep_pinning_pause, setup, tt_teardown),
        cmocka_unit_test(host_memory_reader),
        cmocka_unit_test(region_hands_out_in_order),
    };
    return cmocka_run_group_tests_name("backup", tests, NULL, NULL);
}
