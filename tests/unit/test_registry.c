/* Layer "arena, registry": the address registry (registry.h): exact and interior look-ups, granule
 * and leaf boundaries, the refusals that change nothing, and concurrent writers racing for a fresh
 * leaf while readers look (run under TSan by CI). The registry is process-global: every test uses
 * its own addresses and clears them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>

#include "registry.h"

#define GRAN ((CUdeviceptr)1 << VMH_REGISTRY_SHIFT)
#define LEAF_SPAN ((CUdeviceptr)1 << (VMH_REGISTRY_SHIFT + 13)) /* 16 GiB: one leaf */
#define TOP ((CUdeviceptr)1 << 48)

static int owner_a, owner_b, owner_c;

static void empty_answers_null(void **state)
{
    (void)state;
    assert_null(vmh_registry_get(0));
    assert_null(vmh_registry_get(0x100000000000ULL));
    assert_null(vmh_registry_get(TOP - 1));
    assert_null(vmh_registry_get(TOP)); /* outside the covered space: never an owner */
    assert_null(vmh_registry_get(~(CUdeviceptr)0));
}

static void exact_and_interior(void **state)
{
    (void)state;
    CUdeviceptr base = 0x200000000000ULL;
    assert_true(vmh_registry_set(base, 3 * GRAN, &owner_a));
    assert_ptr_equal(vmh_registry_get(base), &owner_a);
    assert_ptr_equal(vmh_registry_get(base + 1), &owner_a);
    assert_ptr_equal(vmh_registry_get(base + GRAN + 12345), &owner_a);
    assert_ptr_equal(vmh_registry_get(base + 3 * GRAN - 1), &owner_a);
    assert_null(vmh_registry_get(base + 3 * GRAN)); /* the granule after */
    assert_null(vmh_registry_get(base - 1));        /* the granule before */
    /* A neighbour of its own, then re-owning the middle granule. */
    assert_true(vmh_registry_set(base + 3 * GRAN, GRAN, &owner_b));
    assert_ptr_equal(vmh_registry_get(base + 3 * GRAN), &owner_b);
    assert_true(vmh_registry_set(base + GRAN, GRAN, &owner_c));
    assert_ptr_equal(vmh_registry_get(base), &owner_a);
    assert_ptr_equal(vmh_registry_get(base + GRAN), &owner_c);
    assert_ptr_equal(vmh_registry_get(base + 2 * GRAN), &owner_a);
    /* NULL clears. */
    assert_true(vmh_registry_set(base, 4 * GRAN, NULL));
    for (CUdeviceptr p = base; p < base + 4 * GRAN; p += GRAN / 2)
        assert_null(vmh_registry_get(p));
}

static void refusals_change_nothing(void **state)
{
    (void)state;
    CUdeviceptr base = 0x210000000000ULL;
    assert_true(vmh_registry_set(base, GRAN, &owner_a));
    assert_false(vmh_registry_set(base, 0, &owner_b));            /* empty */
    assert_false(vmh_registry_set(base + 4096, GRAN, &owner_b));  /* base not granule-aligned */
    assert_false(vmh_registry_set(base, GRAN + 4096, &owner_b));  /* size not a multiple */
    assert_false(vmh_registry_set(TOP - GRAN, 2 * GRAN, &owner_b)); /* runs past 48 bits */
    assert_false(vmh_registry_set(TOP, GRAN, &owner_b));
    assert_false(vmh_registry_set(~(CUdeviceptr)0 - GRAN + 1, GRAN, &owner_b)); /* top of 64 bits */
    assert_false(vmh_registry_set(base, (size_t)0 - GRAN, &owner_b)); /* wraps */
    assert_ptr_equal(vmh_registry_get(base), &owner_a);
    assert_null(vmh_registry_get(TOP - GRAN));
    /* The last granule of the space is usable. */
    assert_true(vmh_registry_set(TOP - GRAN, GRAN, &owner_b));
    assert_ptr_equal(vmh_registry_get(TOP - 1), &owner_b);
    assert_true(vmh_registry_set(TOP - GRAN, GRAN, NULL));
    assert_true(vmh_registry_set(base, GRAN, NULL));
    assert_null(vmh_registry_get(base));
    /* Clearing where nothing was ever set is fine. */
    assert_true(vmh_registry_set(0x7f0000000000ULL, 64 * GRAN, NULL));
    assert_null(vmh_registry_get(0x7f0000000000ULL));
}

static void spans_leaves(void **state)
{
    (void)state;
    /* Two granules either side of a leaf boundary, and a range covering three leaves. */
    CUdeviceptr edge = 0x220000000000ULL + 5 * LEAF_SPAN;
    assert_true(vmh_registry_set(edge - 2 * GRAN, 4 * GRAN, &owner_a));
    assert_ptr_equal(vmh_registry_get(edge - 1), &owner_a);
    assert_ptr_equal(vmh_registry_get(edge), &owner_a);
    assert_ptr_equal(vmh_registry_get(edge + 2 * GRAN - 1), &owner_a);
    assert_null(vmh_registry_get(edge + 2 * GRAN));
    assert_null(vmh_registry_get(edge - 2 * GRAN - 1));
    CUdeviceptr big = 0x230000000000ULL + LEAF_SPAN - GRAN;
    size_t size = 2 * LEAF_SPAN + 2 * GRAN;
    assert_true(vmh_registry_set(big, size, &owner_b));
    for (CUdeviceptr p = big; p < big + size; p += GRAN)
        assert_ptr_equal(vmh_registry_get(p), &owner_b);
    assert_null(vmh_registry_get(big + size));
    assert_true(vmh_registry_set(big, size, NULL));
    assert_true(vmh_registry_set(edge - 2 * GRAN, 4 * GRAN, NULL));
    assert_null(vmh_registry_get(big + LEAF_SPAN));
    assert_null(vmh_registry_get(edge));
}

/* Writers of different "devices" fill granules of one fresh leaf at once (they race to create
 * it); readers look all the while and may only ever see NULL or the right owner. */
#define WRITERS 4
#define PER_WRITER 256
static const CUdeviceptr race_base = 0x240000000000ULL + 7 * LEAF_SPAN;
static atomic_int readers_run;
static atomic_int wrong_answers;
static int owners[WRITERS];

static void *writer(void *arg)
{
    int w = (int)(intptr_t)arg;
    for (int i = 0; i < PER_WRITER; i++) {
        CUdeviceptr p = race_base + (CUdeviceptr)(i * WRITERS + w) * GRAN;
        if (!vmh_registry_set(p, GRAN, &owners[w]))
            atomic_fetch_add(&wrong_answers, 1);
    }
    return NULL;
}

static void *reader(void *arg)
{
    (void)arg;
    while (atomic_load(&readers_run)) {
        for (int g = 0; g < WRITERS * PER_WRITER; g += 7) {
            void *o = vmh_registry_get(race_base + (CUdeviceptr)g * GRAN + 77);
            if (o && o != &owners[g % WRITERS])
                atomic_fetch_add(&wrong_answers, 1);
        }
    }
    return NULL;
}

static void concurrent_writers_and_readers(void **state)
{
    (void)state;
    pthread_t w[WRITERS], r[2];
    atomic_store(&readers_run, 1);
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&r[i], NULL, reader, NULL), 0);
    for (int i = 0; i < WRITERS; i++)
        assert_int_equal(pthread_create(&w[i], NULL, writer, (void *)(intptr_t)i), 0);
    for (int i = 0; i < WRITERS; i++)
        pthread_join(w[i], NULL);
    atomic_store(&readers_run, 0);
    for (int i = 0; i < 2; i++)
        pthread_join(r[i], NULL);
    assert_int_equal(atomic_load(&wrong_answers), 0);
    for (int g = 0; g < WRITERS * PER_WRITER; g++)
        assert_ptr_equal(vmh_registry_get(race_base + (CUdeviceptr)g * GRAN), &owners[g % WRITERS]);
    assert_true(vmh_registry_set(race_base, (size_t)WRITERS * PER_WRITER * GRAN, NULL));
    assert_null(vmh_registry_get(race_base));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(empty_answers_null),
        cmocka_unit_test(exact_and_interior),
        cmocka_unit_test(refusals_change_nothing),
        cmocka_unit_test(spans_leaves),
        cmocka_unit_test(concurrent_writers_and_readers),
    };
    return cmocka_run_group_tests_name("registry", tests, NULL, NULL);
}
