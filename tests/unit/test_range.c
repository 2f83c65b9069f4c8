/* Layer "ranges" on the simulated driver: every range operation, the access and contents it must
 * keep, and an empty ledger after each test. */
#include "testutil.h"

/* A range of n chunks of size each, reserving `reserve` bytes. */
static vmh_range_t *make_range(size_t n, size_t size, size_t reserve)
{
    vmh_alloc_t *a[16];
    assert_true(n <= 16);
    for (size_t i = 0; i < n; i++)
        a[i] = tu_chunk(size);
    vmh_range_t *r = NULL;
    assert_int_equal(vmh_range_create(a, n, reserve, 0, 0, &r, NULL), CUDA_SUCCESS);
    for (size_t i = 0; i < n; i++)
        vmh_alloc_unref(a[i]); /* the mappings keep them */
    return r;
}

static void create_and_destroy(void **state)
{
    (void)state;
    vmh_range_t *r = make_range(3, GRAN, 0);
    assert_int_equal(r->nmaps, 3);
    assert_int_equal(r->size, 3 * GRAN);
    assert_int_equal(sim_live_mappings(), 3);
    assert_int_equal(sim_live_reservations(), 1);
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(r->maps[i]->ptr, r->base + i * GRAN);
        assert_int_equal(sim_access_flags(r->maps[i]->ptr, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    }
    tu_fill(r->base, r->size, 7);
    assert_true(tu_check(r->base, r->size, 7));
    vmh_range_destroy(r);
    assert_int_equal(sim_live_allocations(), 0);
}

/* destroy_then calls back once the mappings are gone and while the address space is still
 * reserved (a caller clears its registry there, before another reservation can take it). */
typedef struct seen_then {
    CUdeviceptr base;
    size_t size;
    int calls;
    bool was_mapped;
    size_t reservations;
} seen_then_t;

static void on_unmapped(CUdeviceptr base, size_t size, void *arg)
{
    seen_then_t *s = arg;
    s->base = base;
    s->size = size;
    s->calls++;
    s->was_mapped = sim_is_mapped(base);
    s->reservations = sim_live_reservations();
}

static void destroy_then_calls_back_between_unmap_and_free(void **state)
{
    (void)state;
    vmh_range_t *r = make_range(3, GRAN, 0);
    const CUdeviceptr base = r->base;
    seen_then_t s = {0};
    vmh_range_destroy_then(r, on_unmapped, &s);
    assert_int_equal(s.calls, 1);
    assert_int_equal(s.base, base);
    assert_int_equal(s.size, 3 * GRAN);
    assert_false(s.was_mapped);
    assert_int_equal(s.reservations, 1);
    assert_int_equal(sim_live_reservations(), 0);
    assert_int_equal(sim_live_allocations(), 0);
}

static void create_rejects_bad_input(void **state)
{
    (void)state;
    vmh_range_t *r = NULL;
    vmh_alloc_t *none[1] = {NULL};
    assert_int_equal(vmh_range_create(none, 1, 0, 0, 0, &r, NULL), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_range_create(none, 0, 0, 0, 0, &r, NULL), CUDA_ERROR_INVALID_VALUE);
    assert_null(r);
    vmh_range_destroy(NULL);
}

static void grow_into_headroom_keeps_base(void **state)
{
    (void)state;
    vmh_range_t *r = make_range(1, GRAN, 8 * GRAN);
    assert_int_equal(vmh_range_headroom(r), 7 * GRAN);
    tu_fill(r->base, r->size, 1);
    vmh_alloc_t *a = tu_chunk(GRAN);
    vmh_range_t *g = NULL;
    vmh_grow_kind_t kind;
    unsigned long reserves = sim_calls("cuMemAddressReserve");
    assert_int_equal(vmh_range_grow(r, &a, 1, 0, 0, true, &g, &kind, NULL), CUDA_SUCCESS);
    vmh_alloc_unref(a);
    assert_int_equal(kind, VMH_GROW_HEADROOM);
    assert_int_equal(sim_calls("cuMemAddressReserve"), reserves); /* no new reservation */
    assert_int_equal(g->base, r->base);
    assert_int_equal(g->size, 2 * GRAN);
    assert_int_equal(vmh_range_headroom(g), 6 * GRAN);
    vmh_range_destroy(r); /* the old list only held references */
    assert_int_equal(sim_live_mappings(), 2);
    assert_true(tu_check(g->base, GRAN, 1));
    tu_fill(g->base + GRAN, GRAN, 2);
    assert_true(tu_check(g->base + GRAN, GRAN, 2));
    vmh_range_destroy(g);
}

static void grow_through_adjacent_reservation(void **state)
{
    (void)state;
    vmh_range_t *r = make_range(1, GRAN, 0);
    tu_fill(r->base, r->size, 3);
    vmh_alloc_t *a = tu_chunk(2 * GRAN);
    vmh_range_t *g = NULL;
    vmh_grow_kind_t kind;
    assert_int_equal(vmh_range_grow(r, &a, 1, 0, 0, true, &g, &kind, NULL), CUDA_SUCCESS);
    vmh_alloc_unref(a);
    assert_int_equal(kind, VMH_GROW_ADJACENT);
    assert_int_equal(g->base, r->base);
    assert_int_equal(sim_live_reservations(), 2); /* each freed separately, exactly */
    vmh_range_destroy(r);
    assert_true(tu_check(g->base, GRAN, 3));
    tu_fill(g->base, g->size, 4);
    assert_true(tu_check(g->base, g->size, 4));
    /* A second grow of a grown range. */
    a = tu_chunk(GRAN);
    vmh_range_t *g2 = NULL;
    assert_int_equal(vmh_range_grow(g, &a, 1, 0, 0, true, &g2, &kind, NULL), CUDA_SUCCESS);
    vmh_alloc_unref(a);
    assert_int_equal(g2->base, g->base);
    assert_int_equal(g2->size, 4 * GRAN);
    vmh_range_destroy(g);
    assert_true(tu_check(g2->base, 3 * GRAN, 4));
    vmh_range_destroy(g2);
}

static void grow_moves_when_hint_refused(void **state)
{
    (void)state;
    vmh_range_t *r = make_range(2, GRAN, 0);
    tu_fill(r->base, r->size, 5);
    sim_refuse_hints(true);
    vmh_alloc_t *a = tu_chunk(GRAN);
    vmh_range_t *g = NULL;
    vmh_grow_kind_t kind;
    unsigned long creates = sim_calls("cuMemCreate");
    assert_int_equal(vmh_range_grow(r, &a, 1, 0, 0, true, &g, &kind, NULL), CUDA_SUCCESS);
    vmh_alloc_unref(a);
    assert_int_equal(kind, VMH_GROW_MOVED);
    assert_int_not_equal(g->base, r->base);
    assert_int_equal(sim_calls("cuMemCreate"), creates); /* same chunks: no copy, no create */
    /* The same physical memory at both addresses until the old range goes. */
    assert_true(tu_check(g->base, 2 * GRAN, 5));
    assert_true(tu_check(r->base, 2 * GRAN, 5));
    for (size_t i = 0; i < g->nmaps; i++)
        assert_int_equal(sim_access_flags(g->maps[i]->ptr, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CUdeviceptr old = r->base;
    vmh_range_destroy(r);
    assert_false(sim_is_mapped(old));
    assert_false(sim_is_reserved(old));
    assert_true(tu_check(g->base, 2 * GRAN, 5));
    vmh_range_destroy(g);
}

static void grow_without_move_fails_cleanly(void **state)
{
    (void)state;
    vmh_range_t *r = make_range(1, GRAN, 0);
    sim_refuse_hints(true);
    vmh_alloc_t *a = tu_chunk(GRAN);
    vmh_range_t *g = NULL;
    vmh_grow_kind_t kind;
    assert_int_equal(vmh_range_grow(r, &a, 1, 0, 0, false, &g, &kind, NULL), CUDA_ERROR_OUT_OF_MEMORY);
    assert_null(g);
    vmh_alloc_unref(a);
    assert_int_equal(sim_live_mappings(), 1);
    vmh_range_destroy(r);
}

static void move_keeps_every_chunks_access(void **state)
{
    (void)state;
    /* Two chunks with different access: device 0 read-write, then read-only. */
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    CUmemAllocationProp p = tu_prop(0);
    CUmemAccessDesc rw[2] = {tu_rw(0), tu_rw(1)};
    CUmemAccessDesc ro = tu_rw(0);
    ro.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
    vmh_alloc_t *a[2];
    assert_int_equal(vmh_alloc_create(NULL, GRAN, &p, rw, 2, &a[0]), CUDA_SUCCESS);
    assert_int_equal(vmh_alloc_create(NULL, GRAN, &p, &ro, 1, &a[1]), CUDA_SUCCESS);
    vmh_range_t *r = NULL, *m = NULL;
    assert_int_equal(vmh_range_create(a, 2, 0, 0, 0, &r, NULL), CUDA_SUCCESS);
    vmh_alloc_unref(a[0]);
    vmh_alloc_unref(a[1]);
    assert_int_equal(vmh_range_move(r, 4 * GRAN, 0, 0, &m), CUDA_SUCCESS);
    vmh_range_destroy(r);
    assert_int_equal(sim_access_flags(m->base, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(m->base, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(sim_access_flags(m->base + GRAN, 0), CU_MEM_ACCESS_FLAGS_PROT_READ);
    assert_int_equal(sim_access_flags(m->base + GRAN, 1), 0);
    assert_int_equal(vmh_range_headroom(m), 2 * GRAN);
    vmh_range_destroy(m);
}

static void unaligned_sizes_and_shrink(void **state)
{
    (void)state;
    vmh_range_t *r = make_range(4, GRAN, 0);
    tu_fill(r->base, r->size, 9);
    vmh_range_t *s = NULL;
    assert_int_equal(vmh_range_shrink(r, GRAN + 1, &s), CUDA_SUCCESS);
    assert_int_equal(s->nmaps, 2);
    assert_int_equal(s->size, 2 * GRAN);
    vmh_range_t *bad = NULL;
    assert_int_equal(vmh_range_shrink(r, 0, &bad), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(vmh_range_shrink(r, r->size + 1, &bad), CUDA_ERROR_INVALID_VALUE);
    assert_null(bad);
    vmh_range_destroy(r); /* trailing chunks go, leading ones stay mapped */
    assert_int_equal(sim_live_mappings(), 2);
    assert_int_equal(sim_live_allocations(), 2);
    assert_true(tu_check(s->base, s->size, 9));
    vmh_range_destroy(s);
}

static void alias_of_one_chunk_at_two_addresses(void **state)
{
    (void)state;
    vmh_range_t *r = make_range(1, GRAN, 0);
    vmh_range_t *m = NULL;
    assert_int_equal(vmh_range_move(r, 0, 0, 0, &m), CUDA_SUCCESS);
    tu_fill(r->base, GRAN, 11);
    assert_true(tu_check(m->base, GRAN, 11));
    vmh_range_destroy(m);
    assert_int_equal(sim_live_allocations(), 1); /* r still maps it */
    vmh_range_destroy(r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(create_and_destroy, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(create_rejects_bad_input, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(grow_into_headroom_keeps_base, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(grow_through_adjacent_reservation, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(grow_moves_when_hint_refused, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(grow_without_move_fails_cleanly, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(move_keeps_every_chunks_access, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(unaligned_sizes_and_shrink, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(alias_of_one_chunk_at_two_addresses, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(destroy_then_calls_back_between_unmap_and_free, tu_setup,
                                        tu_teardown),
    };
    return cmocka_run_group_tests_name("range", tests, NULL, NULL);
}
