/* Fault-injection sweep. For each operation, a clean run first counts the driver calls it
 * makes (the test discovers them; nothing lists them by hand); then, for each call in turn,
 * the operation runs again from the same starting state with that call failing. After each
 * failure: the operation reports the injected code (or, where the failed call is a probe the
 * design allows to fail, succeeds anyway), the earlier buffer keeps its base, mappings,
 * access and contents, and once everything is released the driver's ledger is empty. */
#include "testutil.h"

#define INJECTED CUDA_ERROR_UNKNOWN /* a code nothing else produces */

/* State shared by an operation's set-up, run and check. */
typedef struct fixture {
    vmh_range_t *old;   /* the earlier buffer that must stay intact */
    vmh_range_t *out;   /* what the operation produced */
    CUdeviceptr p, q;   /* heap-level pointers */
    size_t old_size;
} fixture_t;

typedef struct op {
    const char *name;
    void (*setup)(fixture_t *f);
    CUresult (*run)(fixture_t *f);
    void (*release)(fixture_t *f); /* frees what setup and a successful run made */
    bool old_is_heap;              /* the earlier buffer is f->p (heap) instead of f->old */
} op_t;

static vmh_range_t *range_of(size_t n, size_t reserve)
{
    vmh_alloc_t *a[4];
    for (size_t i = 0; i < n; i++)
        a[i] = tu_chunk(GRAN);
    vmh_range_t *r = NULL;
    assert_int_equal(vmh_range_create(a, n, reserve, 0, 0, &r, NULL), CUDA_SUCCESS);
    for (size_t i = 0; i < n; i++)
        vmh_alloc_unref(a[i]);
    return r;
}

/* ---- range-level operations (the chunk to add is created inside the run) ---- */

static void setup_range(fixture_t *f)
{
    f->old = range_of(2, 0);
    f->old_size = f->old->size;
    tu_fill(f->old->base, f->old->size, 42);
}

static void setup_range_headroom(fixture_t *f)
{
    f->old = range_of(2, 8 * GRAN);
    f->old_size = f->old->size;
    tu_fill(f->old->base, f->old->size, 42);
}

static void release_range(fixture_t *f)
{
    vmh_range_destroy(f->out);
    vmh_range_destroy(f->old);
}

static CUresult run_create(fixture_t *f)
{
    vmh_alloc_t *a[3] = {NULL, NULL, NULL};
    CUmemAllocationProp p = tu_prop(0);
    CUmemAccessDesc d = tu_rw(0);
    CUresult rc = CUDA_SUCCESS;
    for (int i = 0; i < 3 && rc == CUDA_SUCCESS; i++)
        rc = vmh_alloc_create(NULL, GRAN, &p, &d, 1, &a[i]);
    if (rc == CUDA_SUCCESS)
        rc = vmh_range_create(a, 3, 0, 0, 0, &f->out, NULL);
    for (int i = 0; i < 3; i++)
        vmh_alloc_unref(a[i]);
    return rc;
}

static CUresult run_grow(fixture_t *f)
{
    CUmemAllocationProp p = tu_prop(0);
    CUmemAccessDesc d = tu_rw(0);
    vmh_alloc_t *a;
    CUresult rc = vmh_alloc_create(NULL, GRAN, &p, &d, 1, &a);
    if (rc != CUDA_SUCCESS)
        return rc;
    vmh_grow_kind_t kind;
    rc = vmh_range_grow(f->old, &a, 1, 0, 0, true, &f->out, &kind, NULL);
    vmh_alloc_unref(a);
    return rc;
}

static CUresult run_grow_moving(fixture_t *f)
{
    sim_refuse_hints(true);
    CUresult rc = run_grow(f);
    sim_refuse_hints(false);
    return rc;
}

static CUresult run_move(fixture_t *f)
{
    return vmh_range_move(f->old, 0, 0, 0, &f->out);
}

static CUresult run_shrink(fixture_t *f)
{
    return vmh_range_shrink(f->old, GRAN, &f->out);
}

/* ---- heap-level operations ---- */

static void setup_heap(fixture_t *f)
{
    tu_opt.headroom = 0; /* so that grows go through the adjacent probe or a move */
    tu_configure();
    assert_int_equal(vmh_heap_alloc(3 * MiB, &f->p), CUDA_SUCCESS);
    f->old_size = 3 * MiB;
    tu_fill(f->p, f->old_size, 42);
}

static void setup_heap_small(fixture_t *f)
{
    assert_int_equal(vmh_heap_alloc(4096, &f->p), CUDA_SUCCESS);
    f->old_size = 4096;
    tu_fill(f->p, f->old_size, 42);
}

/* The product's serving (issue 21): every size carved from mapped extents, freed memory reused
 * at once while the program's work runs in one queue. */
static void setup_heap_carved(fixture_t *f)
{
    tu_opt.pack_below = (size_t)1 << 40;
    tu_opt.stream_ordered = true;
    tu_configure();
    setup_heap(f);
}

/* ... with a large buffer freed at once (a queued write still on it) beside the earlier one. */
static void setup_heap_carved_freed(fixture_t *f)
{
    setup_heap_carved(f);
    CUdeviceptr big;
    assert_int_equal(vmh_heap_alloc(300 * MiB, &big), CUDA_SUCCESS);
    assert_int_equal(sim_launch_write(NULL, NULL, big, MiB, 0x5a), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
}

static CUresult run_heap_alloc_carved_big(fixture_t *f)
{
    return vmh_heap_alloc(300 * MiB, &f->q);
}

static CUresult run_heap_alloc_carved_reuse(fixture_t *f)
{
    return vmh_heap_alloc(200 * MiB + 4096, &f->q);
}

static void release_heap(fixture_t *f)
{
    if (f->q)
        assert_int_equal(vmh_heap_free(f->q, NULL, false), CUDA_SUCCESS);
    if (f->p)
        assert_int_equal(vmh_heap_free(f->p, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
}

static CUresult run_heap_alloc_big(fixture_t *f)
{
    return vmh_heap_alloc(5 * MiB, &f->q);
}

static CUresult run_heap_alloc_small(fixture_t *f)
{
    /* The first small buffer of a device makes a shared extent. */
    return vmh_heap_alloc(1000, &f->q);
}

static CUresult run_heap_realloc_grow(fixture_t *f)
{
    CUdeviceptr p = f->p;
    CUresult rc = vmh_heap_realloc(&p, 9 * MiB, NULL, false);
    if (rc == CUDA_SUCCESS)
        f->p = p;
    return rc;
}

static CUresult run_heap_realloc_moving(fixture_t *f)
{
    sim_refuse_hints(true);
    CUresult rc = run_heap_realloc_grow(f);
    sim_refuse_hints(false);
    return rc;
}

static CUresult run_heap_realloc_packed(fixture_t *f)
{
    CUdeviceptr p = f->p;
    CUresult rc = vmh_heap_realloc(&p, 3 * MiB, NULL, false);
    if (rc == CUDA_SUCCESS)
        f->p = p;
    return rc;
}

/* Peer access (handle.c): a second device, granted access to device 0's buffers. */
static void setup_two_devices(void)
{
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg); /* nothing is allocated yet: the sweep's reset comes just before */
}

static void setup_heap_peer_granted(fixture_t *f)
{
    setup_two_devices();
    setup_heap(f);
    assert_int_equal(vmh_heap_set_peer_access(0, 1, true), CUDA_SUCCESS);
}

static CUdeviceptr peer_small; /* a packed buffer beside f->p: its extent is granted too */

static void setup_heap_two_devices(fixture_t *f)
{
    setup_two_devices();
    setup_heap(f);
    assert_int_equal(vmh_heap_alloc(1000, &peer_small), CUDA_SUCCESS);
}

static CUresult run_heap_peer_grant(fixture_t *f)
{
    (void)f;
    return vmh_heap_set_peer_access(0, 1, true);
}

static void release_heap_peer(fixture_t *f)
{
    assert_int_equal(vmh_heap_free(peer_small, NULL, false), CUDA_SUCCESS);
    peer_small = 0;
    release_heap(f);
    /* The grant stays recorded (as the driver's peer call that asked for it succeeded); the
     * next set-up resets it. */
}

static const op_t ops[] = {
    {"range create (3 chunks)", setup_range, run_create, release_range, false},
    {"range grow (headroom)", setup_range_headroom, run_grow, release_range, false},
    {"range grow (adjacent)", setup_range, run_grow, release_range, false},
    {"range grow (move)", setup_range, run_grow_moving, release_range, false},
    {"range move", setup_range, run_move, release_range, false},
    {"range shrink", setup_range, run_shrink, release_range, false},
    {"heap alloc (own range)", setup_heap, run_heap_alloc_big, release_heap, true},
    {"heap alloc (packed, new extent)", setup_heap, run_heap_alloc_small, release_heap, true},
    {"heap alloc (carved, new extent)", setup_heap_carved, run_heap_alloc_carved_big,
     release_heap, true},
    {"heap alloc (carved, freed at once)", setup_heap_carved_freed, run_heap_alloc_carved_reuse,
     release_heap, true},
    {"heap realloc grow (adjacent)", setup_heap, run_heap_realloc_grow, release_heap, true},
    {"heap realloc grow (move)", setup_heap, run_heap_realloc_moving, release_heap, true},
    {"heap realloc packed -> own range (copy)", setup_heap_small, run_heap_realloc_packed,
     release_heap, true},
    {"heap alloc (own range, a peer granted)", setup_heap_peer_granted, run_heap_alloc_big,
     release_heap, true},
    {"peer grant over existing buffers", setup_heap_two_devices, run_heap_peer_grant,
     release_heap_peer, true},
};

/* The earlier buffer as the operation found it. */
typedef struct snapshot {
    CUdeviceptr base;
    size_t nmaps;
    CUdeviceptr map[8];
    unsigned access[8];
} snapshot_t;

static void take(const fixture_t *f, bool heap, snapshot_t *s)
{
    memset(s, 0, sizeof *s);
    if (heap) {
        s->base = f->p;
        for (size_t off = 0; off < f->old_size && s->nmaps < 8; off += GRAN) {
            s->map[s->nmaps] = f->p + off;
            s->access[s->nmaps++] = sim_access_flags(f->p + off, 0);
        }
        return;
    }
    s->base = f->old->base;
    for (size_t i = 0; i < f->old->nmaps && i < 8; i++) {
        s->map[s->nmaps] = f->old->maps[i]->ptr;
        s->access[s->nmaps++] = sim_access_flags(f->old->maps[i]->ptr, 0);
    }
}

static void assert_intact(const fixture_t *f, bool heap, const snapshot_t *before)
{
    snapshot_t now;
    take(f, heap, &now);
    assert_int_equal(now.base, before->base);
    assert_int_equal(now.nmaps, before->nmaps);
    for (size_t i = 0; i < now.nmaps; i++) {
        assert_int_equal(now.map[i], before->map[i]);
        assert_true(sim_is_mapped(now.map[i]));
        assert_int_equal(now.access[i], before->access[i]);
    }
    assert_true(tu_check(before->base, f->old_size, 42));
}

/* Index of the first reservation call: in a grow, the probe for the adjacent range. */
static unsigned long first_reserve(const char *const *names, unsigned long n)
{
    for (unsigned long i = 0; i < n; i++)
        if (!strcmp(names[i], "cuMemAddressReserve"))
            return i;
    return n;
}

static bool is_undo(const char *name)
{
    return !strcmp(name, "cuMemUnmap") || !strcmp(name, "cuMemAddressFree") ||
           !strcmp(name, "cuMemRelease");
}

static void sweep_one(const op_t *op, unsigned *points, unsigned *undo)
{
    /* The clean run: how many calls, and which. */
    fixture_t f;
    memset(&f, 0, sizeof f);
    tu_reset(NULL);
    op->setup(&f);
    sim_reset_counters();
    sim_trace_begin();
    assert_int_equal(op->run(&f), CUDA_SUCCESS);
    unsigned long n = sim_call_count();
    const char *names[256];
    size_t got = sim_trace_get(names, 256);
    sim_trace_end();
    assert_true(got == n && n < 256);
    op->release(&f);
    tu_assert_ledger_empty();

    for (unsigned long i = 1; i <= n; i++) {
        /* Undo calls (unmap, address free, release) are not failed: the real driver does not
         * refuse them for the exact objects it created, and when it does there is nothing
         * left to do but report (handle.c). They are listed, not injected. */
        if (is_undo(names[i - 1])) {
            (*undo)++;
            continue;
        }
        memset(&f, 0, sizeof f);
        tu_reset(NULL);
        op->setup(&f);
        snapshot_t before;
        take(&f, op->old_is_heap, &before);
        CUdeviceptr p_before = f.p;
        sim_reset_counters();
        sim_fail_call(i, INJECTED);
        CUresult rc = op->run(&f);
        sim_clear_faults();
        /* The only call allowed to fail without failing the operation: the probe for an
         * adjacent reservation (the real driver refuses hints at will), and, for the heap,
         * the context synchronize of a cache look-up (it proves nothing, so nothing is reused
         * and the allocation goes on with fresh memory). */
        bool probe = (strcmp(names[i - 1], "cuMemAddressReserve") == 0 &&
                      strstr(op->name, "grow") && first_reserve(names, n) == i - 1) ||
                     strcmp(names[i - 1], "cuCtxSynchronize") == 0 ||
                     strcmp(names[i - 1], "cuCtxGetCurrent") == 0;
        if (rc != CUDA_SUCCESS || !probe) {
            if (rc != INJECTED)
                fprintf(stderr, "%s: call %lu (%s) failed, operation returned %d\n", op->name,
                        i, names[i - 1], (int)rc);
            assert_int_equal(rc, INJECTED);
            assert_null(f.out);
            assert_int_equal(f.p, p_before);
            assert_int_equal(f.q, 0);
        }
        if (rc == CUDA_SUCCESS && op->old_is_heap)
            assert_true(tu_check(f.p, f.old_size, 42)); /* recovered, possibly moved */
        else
            assert_intact(&f, op->old_is_heap, &before);
        assert_int_equal(sim_hazards(), 0);
        op->release(&f);
        tu_assert_ledger_empty();
        (*points)++;
    }
    printf("  %-42s %2lu driver calls, each failed in turn:", op->name, n);
    for (unsigned long i = 0; i < n; i++)
        printf(" %s", names[i] + 2); /* without the "cu" */
    printf("\n");
}

static void sweep(void **state)
{
    (void)state;
    unsigned points = 0, undo = 0;
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
        sweep_one(&ops[i], &points, &undo);
    printf("fault-injection sweep: %u injection points over %zu operations, no leak "
           "(%u undo calls listed, not failed)\n",
           points, sizeof ops / sizeof ops[0], undo);
    assert_true(points > 30);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(sweep)};
    return cmocka_run_group_tests_name("sweep", tests, NULL, NULL);
}
