/* Pause and resume of ranges (range.h), on the simulated driver: the addresses stay reserved
 * while the memory is gone, resume maps new memory at exactly those addresses with the same
 * access and (with a backup) the same contents, and every failure leaves either the running
 * range or the paused one whole: nothing half-mapped, nothing mapped twice, nothing leaked. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_tags_reset, declared in tags.h */
#endif
#include "testutil.h"

#include "tags.h"

#define INJECTED CUDA_ERROR_UNKNOWN /* a code nothing else produces */

/* A range of n chunks of GRAN bytes in one reservation of reserve bytes (0: exact). */
static vmh_range_t *range_of(size_t n, size_t reserve)
{
    vmh_alloc_t *a[8];
    assert_true(n <= 8);
    for (size_t i = 0; i < n; i++)
        a[i] = tu_chunk(GRAN);
    vmh_range_t *r = NULL;
    assert_int_equal(vmh_range_create(a, n, reserve, 0, 0, &r, NULL), CUDA_SUCCESS);
    for (size_t i = 0; i < n; i++)
        vmh_alloc_unref(a[i]);
    return r;
}

/* Every granule of [base, base + size) mapped (or not), reserved either way. */
static void assert_mapped(CUdeviceptr base, size_t size, bool mapped)
{
    for (size_t off = 0; off < size; off += GRAN) {
        assert_true(sim_is_reserved(base + off));
        assert_int_equal(sim_is_mapped(base + off), mapped);
    }
}

/* One range paused (a pause.c run of one), its backup copied first when backup is not NULL. */
static CUresult pause_one(vmh_range_t *r, void *backup, vmh_paused_t **out)
{
    if (r && backup && r->nmaps && vmh_range_owned_alone(r)) {
        CUresult rc = vmh_drv.cuMemcpyDtoH(backup, r->base, r->size);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    return vmh_range_pause_run(&r, 1, 0, out);
}

/* One paused range resumed, backup (NULL: none) copied in. */
static CUresult resume_one(const vmh_paused_t *p, const CUmemAllocationProp *prop,
                           const CUmemAccessDesc *access, int naccess, const void *backup,
                           vmh_range_t **out)
{
    return vmh_range_resume_run(&p, 1, prop, access, naccess, &backup, NULL, NULL, out);
}

static CUmemAllocationProp prop0(void)
{
    return tu_prop(0);
}

static void pause_keeps_addresses(void **state)
{
    (void)state;
    vmh_range_t *r = range_of(3, 8 * GRAN);
    CUdeviceptr base = r->base;
    size_t size = r->size;
    tu_fill(base, size, 7);
    assert_int_equal(sim_device_used(0), 3 * GRAN);

    vmh_paused_t *p = NULL;
    assert_int_equal(pause_one(r, NULL, &p), CUDA_SUCCESS);
    assert_non_null(p);
    assert_int_equal(p->base, base);
    assert_int_equal(p->size, size);
    /* Three chunks of one reservation, same device and access: one segment. */
    assert_int_equal(p->nsegs, 1);
    assert_int_equal(sim_device_used(0), 0);
    assert_int_equal(sim_live_allocations(), 0);
    assert_int_equal(sim_live_mappings(), 0);
    assert_int_equal(sim_live_reservations(), 1);
    assert_mapped(base, size, false);
    /* A paused buffer faults when touched. */
    unsigned char byte;
    assert_int_equal(sim_read(&byte, base, 1), CUDA_ERROR_ILLEGAL_ADDRESS);

    CUmemAllocationProp pr = prop0();
    vmh_range_t *back = NULL;
    assert_int_equal(resume_one(p, &pr, NULL, 0, NULL, &back), CUDA_SUCCESS);
    assert_int_equal(back->base, base);
    assert_int_equal(back->size, size);
    /* Fewer, larger chunks: the three come back as one. */
    assert_int_equal(back->nmaps, 1);
    assert_int_equal(sim_live_allocations(), 1);
    assert_int_equal(sim_device_used(0), 3 * GRAN);
    assert_mapped(base, size, true);
    assert_int_equal(sim_access_flags(base + GRAN, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    /* The headroom past the end is still the range's: a grow in place works after resume. */
    assert_int_equal(vmh_range_headroom(back), 5 * GRAN);
    vmh_alloc_t *extra = tu_chunk(GRAN);
    vmh_range_t *grown = NULL;
    vmh_grow_kind_t kind;
    assert_int_equal(vmh_range_grow(back, &extra, 1, 0, 0, false, &grown, &kind, NULL),
                     CUDA_SUCCESS);
    assert_int_equal(kind, VMH_GROW_HEADROOM);
    vmh_alloc_unref(extra);
    vmh_range_destroy(back);
    /* The paused description's reservation reference goes; the grown range still maps it. */
    vmh_paused_destroy(p);
    assert_true(sim_is_reserved(base));
    vmh_range_destroy(grown);
    tu_assert_ledger_empty();
}

static void backup_restores_contents(void **state)
{
    (void)state;
    vmh_range_t *r = range_of(2, 0);
    CUdeviceptr base = r->base;
    size_t size = r->size;
    tu_fill(base, size, 99);
    unsigned char *host = malloc(size);
    assert_non_null(host);
    vmh_paused_t *p = NULL;
    assert_int_equal(pause_one(r, host, &p), CUDA_SUCCESS);
    assert_int_equal(sim_live_allocations(), 0);
    assert_int_equal(host[5], (unsigned char)(5 * 131u + 99));

    CUmemAllocationProp pr = prop0();
    vmh_range_t *back = NULL;
    assert_int_equal(resume_one(p, &pr, NULL, 0, host, &back), CUDA_SUCCESS);
    assert_true(tu_check(base, size, 99));
    vmh_paused_destroy(p);
    vmh_range_destroy(back);
    free(host);
    tu_assert_ledger_empty();
}

/* A range that spans two reservations (grown into an adjacent one) and chunks with different
 * access come back as separate chunks, each with the access it had. */
static void segments_follow_reservations_and_access(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    vmh_range_t *r = range_of(2, 0);
    /* A chunk that device 1 may also read and write. */
    CUmemAllocationProp pr = prop0();
    CUmemAccessDesc both[2] = {tu_rw(0), tu_rw(1)};
    vmh_alloc_t *shared;
    assert_int_equal(vmh_alloc_create(NULL, GRAN, &pr, both, 2, &shared), CUDA_SUCCESS);
    vmh_range_t *g = NULL;
    vmh_grow_kind_t kind;
    assert_int_equal(vmh_range_grow(r, &shared, 1, 0, 0, false, &g, &kind, NULL), CUDA_SUCCESS);
    assert_int_equal(kind, VMH_GROW_ADJACENT);
    vmh_alloc_unref(shared);
    vmh_range_destroy(r);
    CUdeviceptr base = g->base;
    tu_fill(base, g->size, 3);

    vmh_paused_t *p = NULL;
    unsigned char *host = malloc(3 * GRAN);
    assert_non_null(host);
    assert_int_equal(pause_one(g, host, &p), CUDA_SUCCESS);
    assert_int_equal(p->nsegs, 2);
    assert_int_equal(p->segs[0].size, 2 * GRAN);
    assert_int_equal(p->segs[1].size, GRAN);
    assert_int_equal(p->segs[1].naccess, 2);
    assert_int_equal(sim_live_reservations(), 2);
    assert_int_equal(sim_live_allocations(), 0);

    vmh_range_t *back = NULL;
    assert_int_equal(resume_one(p, &pr, NULL, 0, host, &back), CUDA_SUCCESS);
    assert_int_equal(back->nmaps, 2);
    assert_int_equal(sim_access_flags(base, 1), 0);
    assert_int_equal(sim_access_flags(base + 2 * GRAN, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_true(tu_check(base, 3 * GRAN, 3));
    vmh_range_destroy(back);

    /* The access list of the device now (a peer granted while paused) replaces the recorded
     * one when given. */
    assert_int_equal(resume_one(p, &pr, both, 2, NULL, &back), CUDA_SUCCESS);
    assert_int_equal(sim_access_flags(base, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    vmh_range_destroy(back);
    vmh_paused_destroy(p);
    free(host);
    tu_assert_ledger_empty();
}

/* Memory with another holder is not paused: unmapping would give nothing back. */
static void shared_memory_is_not_paused(void **state)
{
    (void)state;
    vmh_range_t *r = range_of(2, 0);
    tu_fill(r->base, r->size, 1);
    vmh_alloc_t *held = vmh_alloc_ref(r->maps[1]->alloc); /* as an export holds it */
    vmh_paused_t *p = NULL;
    assert_int_equal(pause_one(r, NULL, &p), CUDA_ERROR_NOT_PERMITTED);
    assert_null(p);
    vmh_alloc_unref(held);
    vmh_range_t *copy = NULL;
    assert_int_equal(vmh_range_shrink(r, r->size, &copy), CUDA_SUCCESS); /* shares mappings */
    assert_int_equal(pause_one(r, NULL, &p), CUDA_ERROR_NOT_PERMITTED);
    vmh_range_destroy(copy);
    assert_mapped(r->base, r->size, true);
    assert_true(tu_check(r->base, r->size, 1));
    vmh_range_destroy(r);
    tu_assert_ledger_empty();
}

/* Out of memory on resume: nothing of the range mapped, the addresses still reserved, the
 * backup still good; once memory is free again the same call succeeds. */
static void resume_out_of_memory_then_retry(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = 8 * GRAN};
    tu_reset(&cfg);
    vmh_range_t *r = range_of(1, 0);
    vmh_alloc_t *a2 = tu_chunk(GRAN);
    vmh_range_t *r2 = NULL;
    /* Two reservations, so that the resume needs two chunks and the second one fails. */
    vmh_grow_kind_t kind;
    sim_refuse_hints(false);
    assert_int_equal(vmh_range_grow(r, &a2, 1, 0, 0, false, &r2, &kind, NULL), CUDA_SUCCESS);
    assert_int_equal(kind, VMH_GROW_ADJACENT);
    vmh_alloc_unref(a2);
    vmh_range_destroy(r);
    CUdeviceptr base = r2->base;
    size_t size = r2->size;
    tu_fill(base, size, 55);
    unsigned char *host = malloc(2 * GRAN);
    assert_non_null(host);
    vmh_paused_t *p = NULL;
    assert_int_equal(pause_one(r2, host, &p), CUDA_SUCCESS);
    assert_int_equal(p->nsegs, 2);

    /* Another user takes all but one chunk's worth. */
    vmh_alloc_t *filler = tu_chunk(7 * GRAN);
    CUmemAllocationProp pr = prop0();
    vmh_range_t *back = NULL;
    assert_int_equal(resume_one(p, &pr, NULL, 0, host, &back), CUDA_ERROR_OUT_OF_MEMORY);
    assert_null(back);
    assert_mapped(base, size, false);
    assert_int_equal(sim_live_mappings(), 0);
    assert_int_equal(sim_live_allocations(), 1); /* the filler only */

    vmh_alloc_unref(filler);
    assert_int_equal(resume_one(p, &pr, NULL, 0, host, &back), CUDA_SUCCESS);
    assert_int_equal(back->base, base);
    assert_true(tu_check(base, size, 55));
    vmh_paused_destroy(p);
    vmh_range_destroy(back);
    free(host);
    tu_assert_ledger_empty();
}

/* A paused description is resumed once: a second resume while the first is mapped is refused
 * by the driver (overlapping mapping) and leaves the first alone. */
static void never_mapped_twice(void **state)
{
    (void)state;
    vmh_range_t *r = range_of(2, 0);
    vmh_paused_t *p = NULL;
    assert_int_equal(pause_one(r, NULL, &p), CUDA_SUCCESS);
    CUmemAllocationProp pr = prop0();
    vmh_range_t *a = NULL, *b = NULL;
    assert_int_equal(resume_one(p, &pr, NULL, 0, NULL, &a), CUDA_SUCCESS);
    tu_fill(a->base, a->size, 8);
    assert_int_not_equal(resume_one(p, &pr, NULL, 0, NULL, &b), CUDA_SUCCESS);
    assert_null(b);
    assert_int_equal(sim_live_mappings(), 1);
    assert_int_equal(sim_live_allocations(), 1);
    assert_true(tu_check(a->base, a->size, 8));
    vmh_range_destroy(a);
    /* After the range goes, the paused description alone keeps the address. */
    assert_true(sim_is_reserved(p->base));
    assert_int_equal(sim_live_mappings(), 0);
    vmh_paused_destroy(p);
    tu_assert_ledger_empty();
}

static void bad_arguments(void **state)
{
    (void)state;
    vmh_paused_t *p = NULL;
    CUmemAllocationProp pr = prop0();
    vmh_range_t *out = NULL;
    assert_int_equal(pause_one(NULL, NULL, &p), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(resume_one(NULL, &pr, NULL, 0, NULL, &out), CUDA_ERROR_INVALID_VALUE);
    vmh_range_t *r = range_of(1, 0);
    assert_int_equal(pause_one(r, NULL, NULL), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(pause_one(r, NULL, &p), CUDA_SUCCESS);
    assert_int_equal(resume_one(p, NULL, NULL, 0, NULL, &out), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(resume_one(p, &pr, NULL, 1, NULL, &out), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(resume_one(p, &pr, NULL, VMH_MAX_ACCESS + 1, NULL, &out),
                     CUDA_ERROR_INVALID_VALUE);
    vmh_paused_destroy(p);
    vmh_paused_destroy(NULL);
    tu_assert_ledger_empty();
}

/* ---- fault-injection sweep (the discovery approach of test_sweep.c) ---- */

typedef struct pfix {
    vmh_range_t *r;  /* the running range (pause's input, resume's output) */
    vmh_paused_t *p; /* the paused description */
    CUdeviceptr base;
    size_t size;
    unsigned char *host; /* backup */
} pfix_t;

/* Two reservations and two access lists (three segments), so that a resume makes several
 * chunks and a failure after the first has something to unwind. */
static void pfix_running(pfix_t *f)
{
    vmh_range_t *r = range_of(2, 0);
    CUmemAllocationProp pr = prop0();
    CUmemAccessDesc both[2] = {tu_rw(0), tu_rw(1)};
    vmh_alloc_t *a[2];
    assert_int_equal(vmh_alloc_create(NULL, GRAN, &pr, both, 2, &a[0]), CUDA_SUCCESS);
    a[1] = tu_chunk(GRAN);
    vmh_grow_kind_t kind;
    assert_int_equal(vmh_range_grow(r, a, 2, 0, 0, false, &f->r, &kind, NULL), CUDA_SUCCESS);
    vmh_alloc_unref(a[0]);
    vmh_alloc_unref(a[1]);
    vmh_range_destroy(r);
    f->base = f->r->base;
    f->size = f->r->size;
    f->host = calloc(1, f->size);
    assert_non_null(f->host);
    tu_fill(f->base, f->size, 42);
}

static void pfix_paused(pfix_t *f)
{
    pfix_running(f);
    assert_int_equal(pause_one(f->r, f->host, &f->p), CUDA_SUCCESS);
    assert_int_equal(f->p->nsegs, 3);
    f->r = NULL;
}

static CUresult run_pause(pfix_t *f)
{
    vmh_paused_t *p = NULL;
    CUresult rc = pause_one(f->r, f->host, &p);
    if (rc == CUDA_SUCCESS) {
        f->r = NULL;
        f->p = p;
    }
    return rc;
}

static CUresult run_resume(pfix_t *f)
{
    CUmemAllocationProp pr = prop0();
    return resume_one(f->p, &pr, NULL, 0, f->host, &f->r);
}

/* After a failed operation the state is exactly the one before it. */
static void check_unchanged(const pfix_t *f, bool was_paused)
{
    if (was_paused) {
        assert_null(f->r);
        assert_mapped(f->base, f->size, false);
        assert_int_equal(sim_live_allocations(), 0);
        /* ... and the retry succeeds with the contents. */
        pfix_t g = *f;
        assert_int_equal(run_resume(&g), CUDA_SUCCESS);
        assert_true(tu_check(f->base, f->size, 42));
        vmh_range_destroy(g.r);
    } else {
        assert_null(f->p);
        assert_mapped(f->base, f->size, true);
        assert_int_equal(sim_access_flags(f->base + 2 * GRAN, 1),
                         CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
        assert_true(tu_check(f->base, f->size, 42));
    }
}

static void pfix_release(pfix_t *f)
{
    vmh_range_destroy(f->r);
    vmh_paused_destroy(f->p);
    free(f->host);
    memset(f, 0, sizeof *f);
}

static bool is_undo(const char *name)
{
    return !strcmp(name, "cuMemUnmap") || !strcmp(name, "cuMemAddressFree") ||
           !strcmp(name, "cuMemRelease");
}

static unsigned sweep_op(const char *what, void (*setup)(pfix_t *), CUresult (*run)(pfix_t *),
                         bool was_paused)
{
    sim_config_t cfg = {.devices = 2};
    pfix_t f = {0};
    tu_reset(&cfg);
    setup(&f);
    sim_reset_counters();
    sim_trace_begin();
    assert_int_equal(run(&f), CUDA_SUCCESS);
    unsigned long n = sim_call_count();
    const char *names[256];
    size_t got = sim_trace_get(names, 256);
    sim_trace_end();
    assert_true(got == n && n < 256);
    assert_true(tu_check(f.base, 1, 42) || !was_paused); /* resumed with contents */
    pfix_release(&f);
    tu_assert_ledger_empty();

    unsigned points = 0;
    for (unsigned long i = 1; i <= n; i++) {
        if (is_undo(names[i - 1]))
            continue; /* listed, not failed: see test_sweep.c */
        tu_reset(&cfg);
        setup(&f);
        sim_reset_counters();
        sim_fail_call(i, INJECTED);
        CUresult rc = run(&f);
        sim_clear_faults();
        if (rc != INJECTED)
            fprintf(stderr, "%s: call %lu (%s) failed, operation returned %d\n", what, i,
                    names[i - 1], (int)rc);
        assert_int_equal(rc, INJECTED);
        check_unchanged(&f, was_paused);
        assert_int_equal(sim_hazards(), 0);
        pfix_release(&f);
        tu_assert_ledger_empty();
        points++;
    }
    printf("  %-30s %2lu driver calls, each failed in turn:", what, n);
    for (unsigned long i = 0; i < n; i++)
        printf(" %s", names[i] + 2);
    printf("\n");
    return points;
}

static void fault_sweep(void **state)
{
    (void)state;
    unsigned points = sweep_op("pause (backup)", pfix_running, run_pause, false);
    points += sweep_op("resume (backup)", pfix_paused, run_resume, true);
    printf("pause/resume sweep: %u injection points, no leak, nothing half-mapped\n", points);
    /* pause: the copy; resume: three creates, three maps, three access calls, the copy. */
    assert_true(points >= 10);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(pause_keeps_addresses, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(backup_restores_contents, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(segments_follow_reservations_and_access, tu_setup,
                                        tu_teardown),
        cmocka_unit_test_setup_teardown(shared_memory_is_not_paused, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(resume_out_of_memory_then_retry, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(never_mapped_twice, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(bad_arguments, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(fault_sweep, tu_setup, tu_teardown),
    };
    return cmocka_run_group_tests_name("pause", tests, NULL, NULL);
}
