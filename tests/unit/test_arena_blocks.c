/* Unit tests for the arena (src/arena/arena.c), the packing of small device buffers into shared
 * extents, block by block: alignment, empty and exactly filled extents, retired extents, find,
 * misuse (double and interior frees), coalescing, parking generations, resize, trimming and
 * deletion. */
#include "arena_fixture.h"

/* ---- Basics -------------------------------------------------------------------------------- */

static void test_alignment(void **state)
{
    (void)state;
    rng_state = 1;
    vmh_arena_t *a = vmh_arena_new();
    assert_non_null(a);
    const uintptr_t base = 0x7f0000000000;
    vmh_extent_t *e = vmh_arena_add_extent(a, base, 64 * MiB, (void *)0x1);
    assert_non_null(e);
    assert_ptr_equal(vmh_extent_owner(e), (void *)0x1);
    assert_int_equal(vmh_extent_base(e), base);
    assert_int_equal(vmh_extent_size(e), 64 * MiB);

    size_t total = 0;
    for (int i = 0; i < 2000; i++) {
        size_t size = i < 300 ? (size_t)i + 1 : rnd_logsize(1, 64 * KiB);
        uintptr_t p;
        int rc = vmh_arena_alloc(a, size, &p);
        if (rc == ENOMEM)
            break;
        assert_int_equal(rc, 0);
        assert_int_equal(p % ALIGN, 0);
        assert_true(p >= base && p + size <= base + 64 * MiB);
        vmh_block_info_t info;
        assert_true(vmh_arena_find(e, p, &info));
        assert_int_equal(info.base, p);
        assert_int_equal(info.size, size);
        assert_int_equal(info.usable, align_up(size));
        total += align_up(size);
    }
    vmh_arena_stats_t s;
    vmh_arena_stats(a, &s);
    assert_int_equal(s.live, total);
    assert_int_equal(s.extents, 1);
    assert_int_equal(s.extents_bytes, 64 * MiB);
    assert_consistent(a);

    /* Bad arguments. */
    uintptr_t p;
    assert_int_equal(vmh_arena_alloc(a, 0, &p), EINVAL);
    assert_int_equal(vmh_arena_alloc(a, SIZE_MAX, &p), ENOMEM);
    assert_null(vmh_arena_add_extent(a, base + 64 * MiB + 100, 4096, NULL));
    assert_null(vmh_arena_add_extent(a, base + 64 * MiB, 4000, NULL));
    assert_null(vmh_arena_add_extent(a, base + 64 * MiB, 0, NULL));
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

static void test_empty_arena(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    uintptr_t p;
    assert_int_equal(vmh_arena_alloc(a, 1, &p), ENOMEM);
    assert_int_equal(vmh_arena_unpark_upto(a, UINT64_MAX), 0);
    assert_int_equal(vmh_arena_parked(a), 0);
    assert_null(vmh_arena_take_empty_extent(a, NULL, NULL));
    vmh_arena_stats_t s;
    vmh_arena_stats(a, &s);
    assert_int_equal(s.extents_bytes + s.extents + s.live + s.free + s.parked, 0);
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
    vmh_arena_delete(NULL, NULL, NULL);
}

/* A retired extent (carved.c: a freed exported block's) serves nothing more: not its free
 * space, not what is freed in it later, not a growth; once its blocks are gone it is handed
 * back by take_retired_extent (and only retired extents are). */
static void test_retired_extent_serves_nothing(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    int owner_r, owner_k;
    vmh_extent_t *r = vmh_arena_add_extent(a, 0x100000, 2 * MiB, &owner_r);
    uintptr_t x, y, z;
    assert_int_equal(vmh_arena_alloc(a, 1000, &x), 0);
    assert_int_equal(vmh_arena_alloc(a, 1000, &y), 0);
    assert_int_equal(vmh_arena_park(a, r, x, 1, NULL), 0);
    vmh_arena_retire_extent(a, r);
    vmh_arena_retire_extent(a, r); /* idempotent */
    assert_true(vmh_extent_retired(r));
    assert_consistent(a);
    vmh_arena_stats_t s;
    vmh_arena_stats(a, &s);
    assert_int_equal(s.free, 0);
    assert_int_equal(s.retired, 2 * MiB - 2 * 1024);
    assert_int_equal(vmh_arena_alloc(a, 1, &z), ENOMEM);
    assert_int_equal(vmh_arena_resize(a, r, y, 5000, VMH_TAIL_FREE, 0), ENOMEM);
    assert_int_equal(vmh_arena_resize(a, r, y, 10, VMH_TAIL_FREE, 0), 0); /* a shrink keeps its tail */
    assert_int_equal(vmh_arena_unpark_upto(a, 1), 1);
    assert_int_equal(vmh_arena_alloc(a, 1, &z), ENOMEM);
    assert_consistent(a);
    /* Another extent serves; only the retired one is handed back once empty. */
    vmh_extent_t *k = vmh_arena_add_extent(a, 0x400000, 2 * MiB, &owner_k);
    assert_int_equal(vmh_arena_alloc(a, 1000, &z), 0);
    assert_true(z >= 0x400000);
    assert_int_equal(vmh_arena_release(a, k, z, NULL), 0);
    assert_null(vmh_arena_take_retired_extent(a, NULL, NULL));
    assert_int_equal(vmh_arena_release(a, r, y, NULL), 0);
    assert_consistent(a);
    uintptr_t base;
    size_t size;
    assert_ptr_equal(vmh_arena_take_retired_extent(a, &base, &size), &owner_r);
    assert_int_equal(base, 0x100000);
    assert_int_equal(size, 2 * MiB);
    assert_null(vmh_arena_take_retired_extent(a, NULL, NULL));
    vmh_arena_stats(a, &s);
    assert_int_equal(s.retired, 0);
    assert_int_equal(s.extents, 1);
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

/* A request exactly the size of the extent, then one granule too many. */
static void test_exact_fill(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    vmh_extent_t *e = vmh_arena_add_extent(a, 0x100000, 2 * MiB, NULL);
    uintptr_t p, q;
    assert_int_equal(vmh_arena_alloc(a, 2 * MiB + 1, &p), ENOMEM);
    assert_int_equal(vmh_arena_alloc(a, 2 * MiB, &p), 0);
    assert_int_equal(p, 0x100000);
    assert_int_equal(vmh_arena_alloc(a, 1, &q), ENOMEM);
    assert_int_equal(vmh_arena_release(a, e, p, NULL), 0);
    /* Many one-granule blocks fill it exactly too. */
    for (size_t i = 0; i < 2 * MiB / ALIGN; i++) {
        assert_int_equal(vmh_arena_alloc(a, 1 + rnd_below(ALIGN), &p), 0);
    }
    assert_int_equal(vmh_arena_alloc(a, 1, &q), ENOMEM);
    vmh_arena_stats_t s;
    vmh_arena_stats(a, &s);
    assert_int_equal(s.free, 0);
    assert_int_equal(s.live, 2 * MiB);
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

/* ---- find() -------------------------------------------------------------------------------- */

static void test_find(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    /* 64 MiB: several summary words of the start bitmap, so long backward scans are covered. */
    const uintptr_t base = 0x200000000;
    const size_t esize = 64 * MiB;
    vmh_extent_t *e = vmh_arena_add_extent(a, base, esize, NULL);
    vmh_block_info_t info;

    assert_false(vmh_arena_find(e, base, &info)); /* nothing live yet */

    uintptr_t x, y, z, big;
    assert_int_equal(vmh_arena_alloc(a, 1000, &x), 0); /* usable 1024 */
    assert_int_equal(vmh_arena_alloc(a, 256, &y), 0);
    assert_int_equal(y, x + 1024);
    assert_int_equal(vmh_arena_alloc(a, 40 * MiB, &big), 0);
    assert_int_equal(big, y + 256);
    assert_int_equal(vmh_arena_alloc(a, 300, &z), 0);
    assert_int_equal(z, big + 40 * MiB);

    /* Base, interior, last requested byte, slack up to usable, last byte. */
    assert_true(vmh_arena_find(e, x, &info));
    assert_int_equal(info.base, x);
    assert_int_equal(info.size, 1000);
    assert_int_equal(info.usable, 1024);
    assert_true(vmh_arena_find(e, x + 17, &info) && info.base == x);
    assert_true(vmh_arena_find(e, x + 999, &info) && info.base == x);
    assert_true(vmh_arena_find(e, x + 1023, &info) && info.base == x);
    /* One past the end is the next block. */
    assert_true(vmh_arena_find(e, x + 1024, &info) && info.base == y);
    assert_true(vmh_arena_find(e, y + 255, &info) && info.base == y);
    /* Deep inside a 40 MiB block: the start is many bitmap words back. */
    assert_true(vmh_arena_find(e, big + 39 * MiB + 12345, &info));
    assert_int_equal(info.base, big);
    assert_int_equal(info.size, 40 * MiB);
    assert_true(vmh_arena_find(e, big + 40 * MiB - 1, &info) && info.base == big);
    assert_true(vmh_arena_find(e, z + 511, &info) && info.base == z);
    /* One past the last block: free space. */
    assert_false(vmh_arena_find(e, z + 512, &info));
    assert_false(vmh_arena_find(e, base + esize - 1, &info));
    /* Outside the extent. */
    assert_false(vmh_arena_find(e, base - 1, &info));
    assert_false(vmh_arena_find(e, base + esize, &info));
    assert_false(vmh_arena_find(NULL, x, &info));

    /* Freed: the range is free space now, and a lower live block must not claim it. */
    assert_int_equal(vmh_arena_release(a, e, big, &info), 0);
    assert_int_equal(info.base, big);
    assert_int_equal(info.size, 40 * MiB);
    assert_false(vmh_arena_find(e, big, &info));
    assert_false(vmh_arena_find(e, big + 20 * MiB, &info));
    assert_true(vmh_arena_find(e, z + 1, &info) && info.base == z);

    /* Parked: not live any more. */
    assert_int_equal(vmh_arena_park(a, e, y, 7, &info), 0);
    assert_int_equal(info.base, y);
    assert_int_equal(info.size, 256);
    assert_false(vmh_arena_find(e, y, &info));
    assert_false(vmh_arena_find(e, y + 255, &info));
    assert_true(vmh_arena_find(e, x + 1023, &info) && info.base == x);
    assert_int_equal(vmh_arena_unpark_upto(a, 7), 1);
    assert_false(vmh_arena_find(e, y, &info));

    /* NULL info is allowed. */
    assert_true(vmh_arena_find(e, x, NULL));
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

/* An extent whose granule count is not a multiple of 64: the bitmap's last word is partial. */
static void test_find_odd_extent(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    const uintptr_t base = 0x300000000;
    const size_t esize = 100 * ALIGN;
    vmh_extent_t *e = vmh_arena_add_extent(a, base, esize, NULL);
    uintptr_t p[100];
    for (int i = 0; i < 100; i++)
        assert_int_equal(vmh_arena_alloc(a, ALIGN, &p[i]), 0);
    for (int i = 0; i < 100; i++) {
        vmh_block_info_t info;
        assert_true(vmh_arena_find(e, p[i] + 128, &info));
        assert_int_equal(info.base, p[i]);
    }
    for (int i = 0; i < 100; i += 2)
        assert_int_equal(vmh_arena_release(a, e, p[i], NULL), 0);
    for (int i = 0; i < 100; i++) {
        vmh_block_info_t info;
        assert_int_equal(vmh_arena_find(e, p[i] + 255, &info), i % 2 == 1);
    }
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

/* ---- Misuse -------------------------------------------------------------------------------- */

static void test_double_and_interior_free(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    vmh_extent_t *e = vmh_arena_add_extent(a, 0x400000000, 4 * MiB, NULL);
    vmh_extent_t *e2 = vmh_arena_add_extent(a, 0x500000000, 4 * MiB, NULL);
    vmh_arena_t *other = vmh_arena_new();
    uintptr_t p, q;
    assert_int_equal(vmh_arena_alloc(a, 5000, &p), 0);
    assert_int_equal(vmh_arena_alloc(a, 5000, &q), 0);
    vmh_extent_t *pe = p >= 0x500000000 ? e2 : e;
    vmh_extent_t *qe = q >= 0x500000000 ? e2 : e;
    vmh_extent_t *wrong = pe == e ? e2 : e;

    /* Interior pointers, unaligned pointers, pointers outside, the wrong extent or arena. */
    assert_int_equal(vmh_arena_release(a, pe, p + ALIGN, NULL), EINVAL);
    assert_int_equal(vmh_arena_release(a, pe, p + 1, NULL), EINVAL);
    assert_int_equal(vmh_arena_park(a, pe, p + ALIGN, 1, NULL), EINVAL);
    assert_int_equal(vmh_arena_resize(a, pe, p + ALIGN, 100, VMH_TAIL_FREE, 0), EINVAL);
    assert_int_equal(vmh_arena_release(a, wrong, p, NULL), EINVAL);
    assert_int_equal(vmh_arena_release(other, pe, p, NULL), EINVAL);
    assert_int_equal(vmh_arena_release(a, NULL, p, NULL), EINVAL);
    assert_int_equal(vmh_arena_release(a, pe, 0x100, NULL), EINVAL);
    assert_int_equal(vmh_arena_resize(a, pe, p, 0, VMH_TAIL_FREE, 0), EINVAL);

    /* Double free, free of a parked block, double park. */
    assert_int_equal(vmh_arena_release(a, pe, p, NULL), 0);
    assert_int_equal(vmh_arena_release(a, pe, p, NULL), EINVAL);
    assert_int_equal(vmh_arena_park(a, pe, p, 1, NULL), EINVAL);
    assert_int_equal(vmh_arena_park(a, qe, q, 1, NULL), 0);
    assert_int_equal(vmh_arena_park(a, qe, q, 2, NULL), EINVAL);
    assert_int_equal(vmh_arena_release(a, qe, q, NULL), EINVAL);
    assert_int_equal(vmh_arena_resize(a, qe, q, 100, VMH_TAIL_FREE, 0), EINVAL);
    assert_int_equal(vmh_arena_parked(a), 1);
    assert_int_equal(vmh_arena_unpark_upto(a, 1), 1);
    assert_int_equal(vmh_arena_release(a, qe, q, NULL), EINVAL);
    assert_consistent(a);
    vmh_arena_delete(other, NULL, NULL);
    vmh_arena_delete(a, NULL, NULL);
}

/* ---- Coalescing ---------------------------------------------------------------------------- */

static void test_coalesce_all(void **state)
{
    (void)state;
    rng_state = 2;
    vmh_arena_t *a = vmh_arena_new();
    enum { NEXT = 3, NB = 3000 };
    vmh_extent_t *ext[NEXT];
    for (int i = 0; i < NEXT; i++) {
        ext[i] = vmh_arena_add_extent(a, 0x1000000000 + (uintptr_t)i * 0x100000000, 8 * MiB, NULL);
        assert_non_null(ext[i]);
    }
    static uintptr_t p[NB];
    static vmh_extent_t *pe[NB];
    int n = 0;
    for (; n < NB; n++) {
        if (vmh_arena_alloc(a, rnd_logsize(1, 32 * KiB), &p[n]) != 0)
            break;
        pe[n] = ext[(p[n] - 0x1000000000) / 0x100000000];
    }
    assert_true(n > 500);
    /* Free in random order, half released at once, half parked in generations. */
    for (int i = n - 1; i > 0; i--) {
        int j = (int)rnd_below((size_t)i + 1);
        uintptr_t tp = p[i];
        vmh_extent_t *te = pe[i];
        p[i] = p[j], pe[i] = pe[j];
        p[j] = tp, pe[j] = te;
    }
    uint64_t gen = 0;
    size_t parked = 0;
    for (int i = 0; i < n; i++) {
        if (rnd() & 1) {
            assert_int_equal(vmh_arena_release(a, pe[i], p[i], NULL), 0);
        } else {
            assert_int_equal(vmh_arena_park(a, pe[i], p[i], gen, NULL), 0);
            parked++;
        }
        if (i % 100 == 99)
            gen++;
        if (i % 500 == 0)
            assert_consistent(a);
    }
    assert_int_equal(vmh_arena_parked(a), parked);
    assert_int_equal(vmh_arena_unpark_upto(a, gen), parked);
    assert_consistent(a);
    /* Everything merged back: one free block per extent, each spanning it. */
    assert_int_equal(vmh_arena_free_blocks(a), NEXT);
    vmh_arena_stats_t s;
    vmh_arena_stats(a, &s);
    assert_int_equal(s.free, NEXT * 8 * MiB);
    assert_int_equal(s.live + s.parked, 0);
    uintptr_t q;
    for (int i = 0; i < NEXT; i++)
        assert_int_equal(vmh_arena_alloc(a, 8 * MiB, &q), 0);
    assert_int_equal(vmh_arena_alloc(a, 1, &q), ENOMEM);
    vmh_arena_delete(a, NULL, NULL);
}

/* Parked neighbours are not merged, and merge once unparked. */
static void test_coalesce_around_parked(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    vmh_extent_t *e = vmh_arena_add_extent(a, 0x100000, 4 * ALIGN, NULL);
    uintptr_t b[4];
    for (int i = 0; i < 4; i++)
        assert_int_equal(vmh_arena_alloc(a, ALIGN, &b[i]), 0);
    assert_int_equal(vmh_arena_park(a, e, b[1], 1, NULL), 0);
    assert_int_equal(vmh_arena_release(a, e, b[0], NULL), 0);
    assert_int_equal(vmh_arena_release(a, e, b[2], NULL), 0);
    assert_int_equal(vmh_arena_free_blocks(a), 2);
    uintptr_t q;
    assert_int_equal(vmh_arena_alloc(a, 2 * ALIGN, &q), ENOMEM); /* b[1] separates them */
    assert_int_equal(vmh_arena_unpark_upto(a, 0), 0);
    assert_int_equal(vmh_arena_unpark_upto(a, 1), 1);
    assert_int_equal(vmh_arena_free_blocks(a), 1);
    assert_int_equal(vmh_arena_alloc(a, 3 * ALIGN, &q), 0);
    assert_int_equal(q, b[0]);
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

/* ---- Parking ------------------------------------------------------------------------------- */

static void test_park_generations(void **state)
{
    (void)state;
    rng_state = 3;
    vmh_arena_t *a = vmh_arena_new();
    vmh_extent_t *e = vmh_arena_add_extent(a, 0x600000000, 1 * MiB, NULL);
    enum { N = 64 };
    uintptr_t p[N];
    for (int i = 0; i < N; i++)
        assert_int_equal(vmh_arena_alloc(a, 16 * KiB, &p[i]), 0);
    uintptr_t q;
    assert_int_equal(vmh_arena_alloc(a, 1, &q), ENOMEM);
    /* Park all, generation i / 8. */
    for (int i = 0; i < N; i++)
        assert_int_equal(vmh_arena_park(a, e, p[i], (uint64_t)i / 8, NULL), 0);
    assert_int_equal(vmh_arena_parked(a), N);
    vmh_arena_stats_t s;
    vmh_arena_stats(a, &s);
    assert_int_equal(s.parked, 1 * MiB);
    assert_int_equal(s.free, 0);
    /* Nothing parked is handed out. */
    assert_int_equal(vmh_arena_alloc(a, 1, &q), ENOMEM);
    for (uint64_t g = 0; g < N / 8; g++) {
        assert_int_equal(vmh_arena_unpark_upto(a, g), 8);
        assert_int_equal(vmh_arena_unpark_upto(a, g), 0);
        /* The first 8 * (g + 1) are free, the 8 * g reused ones parked again (gen 1000). */
        assert_int_equal(vmh_arena_parked(a), N - 8);
        /* Exactly the unparked 128 KiB can be reused, and only from those blocks. */
        uintptr_t r[8];
        for (int i = 0; i < 8; i++) {
            assert_int_equal(vmh_arena_alloc(a, 16 * KiB, &r[i]), 0);
            assert_true(r[i] >= p[g * 8] && r[i] < p[g * 8] + 128 * KiB);
        }
        assert_int_equal(vmh_arena_alloc(a, 1, &q), ENOMEM);
        for (int i = 0; i < 8; i++)
            assert_int_equal(vmh_arena_park(a, e, r[i], 1000, NULL), 0);
        assert_consistent(a);
    }
    assert_int_equal(vmh_arena_unpark_upto(a, 999), 0);
    assert_int_equal(vmh_arena_unpark_upto(a, UINT64_MAX), N);
    assert_int_equal(vmh_arena_parked(a), 0);
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

/* Generations parked out of order: unpark_upto(g) frees exactly those <= g. */
static void test_park_out_of_order(void **state)
{
    (void)state;
    rng_state = 4;
    vmh_arena_t *a = vmh_arena_new();
    vmh_extent_t *e = vmh_arena_add_extent(a, 0x700000000, 4 * MiB, NULL);
    enum { N = 500 };
    uintptr_t p[N];
    uint64_t gen[N];
    bool parked[N];
    for (int i = 0; i < N; i++) {
        assert_int_equal(vmh_arena_alloc(a, 1 + rnd_below(4 * KiB), &p[i]), 0);
        gen[i] = rnd_below(50);
        assert_int_equal(vmh_arena_park(a, e, p[i], gen[i], NULL), 0);
        parked[i] = true;
    }
    for (uint64_t g = 0; g < 60; g += 1 + rnd_below(5)) {
        size_t expect = 0, left = 0;
        for (int i = 0; i < N; i++) {
            if (parked[i] && gen[i] <= g) {
                expect++;
                parked[i] = false;
            }
            left += parked[i];
        }
        assert_int_equal(vmh_arena_unpark_upto(a, g), expect);
        assert_int_equal(vmh_arena_parked(a), left);
        assert_consistent(a);
        for (int i = 0; i < N; i++)
            assert_false(vmh_arena_find(e, p[i], NULL));
        /* Newly parked blocks, again out of order, join the same queue. */
        for (int i = 0; i < N; i++) {
            if (!parked[i] && rnd_below(4) == 0 &&
                vmh_arena_alloc(a, 1 + rnd_below(4 * KiB), &p[i]) == 0) {
                gen[i] = g + rnd_below(20);
                assert_int_equal(vmh_arena_park(a, e, p[i], gen[i], NULL), 0);
                parked[i] = true;
            }
        }
    }
    vmh_arena_unpark_upto(a, UINT64_MAX);
    assert_int_equal(vmh_arena_parked(a), 0);
    assert_int_equal(vmh_arena_free_blocks(a), 1);
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

/* ---- Resize -------------------------------------------------------------------------------- */

static void test_resize(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    const uintptr_t base = 0x800000000;
    vmh_extent_t *e = vmh_arena_add_extent(a, base, 64 * KiB, NULL);
    vmh_block_info_t info;
    uintptr_t x, y, z;
    assert_int_equal(vmh_arena_alloc(a, 1000, &x), 0);
    /* Grow into the free tail of the extent. */
    assert_int_equal(vmh_arena_resize(a, e, x, 10000, VMH_TAIL_FREE, 0), 0);
    assert_true(vmh_arena_find(e, x + 9999, &info));
    assert_int_equal(info.size, 10000);
    assert_int_equal(info.usable, align_up(10000));
    assert_int_equal(vmh_arena_alloc(a, 1000, &y), 0);
    assert_int_equal(y, x + align_up(10000));
    /* A live neighbour: no room. */
    assert_int_equal(vmh_arena_resize(a, e, x, 10241, VMH_TAIL_FREE, 0), ENOMEM);
    assert_true(vmh_arena_find(e, x, &info) && info.size == 10000);
    /* Same usable size: only the recorded size changes. */
    assert_int_equal(vmh_arena_resize(a, e, x, 10200, VMH_TAIL_FREE, 0), 0);
    assert_true(vmh_arena_find(e, x, &info) && info.size == 10200 &&
                info.usable == align_up(10000));
    /* Shrink: the tail becomes free, and then can be grown into again. */
    assert_int_equal(vmh_arena_resize(a, e, x, 300, VMH_TAIL_FREE, 0), 0);
    assert_true(vmh_arena_find(e, x, &info) && info.size == 300 && info.usable == 512);
    assert_false(vmh_arena_find(e, x + 512, &info));
    assert_int_equal(vmh_arena_free_blocks(a), 2);
    assert_consistent(a);
    assert_int_equal(vmh_arena_resize(a, e, x, 10240, VMH_TAIL_FREE, 0), 0);
    assert_int_equal(vmh_arena_resize(a, e, x, 10241, VMH_TAIL_FREE, 0), ENOMEM);
    assert_int_equal(vmh_arena_free_blocks(a), 1); /* the neighbour was used up exactly */
    assert_consistent(a);

    /* Shrink next to a free block: the free block grows down, no extra block. */
    assert_int_equal(vmh_arena_resize(a, e, y, 1000, VMH_TAIL_FREE, 0), 0);
    assert_int_equal(vmh_arena_resize(a, e, y, 256, VMH_TAIL_FREE, 0), 0);
    assert_int_equal(vmh_arena_free_blocks(a), 1);
    vmh_arena_stats_t s;
    vmh_arena_stats(a, &s);
    assert_int_equal(s.live, 10240 + 256);
    assert_consistent(a);

    /* A parked neighbour is not free space. */
    assert_int_equal(vmh_arena_alloc(a, 1000, &z), 0);
    assert_int_equal(z, y + 256);
    assert_int_equal(vmh_arena_park(a, e, z, 5, NULL), 0);
    assert_int_equal(vmh_arena_resize(a, e, y, 257, VMH_TAIL_FREE, 0), ENOMEM);
    assert_int_equal(vmh_arena_unpark_upto(a, 5), 1);
    assert_int_equal(vmh_arena_resize(a, e, y, 257, VMH_TAIL_FREE, 0), 0);

    /* Up to the end of the extent, and not one granule further. */
    size_t rest = base + 64 * KiB - y;
    assert_int_equal(vmh_arena_resize(a, e, y, rest + 1, VMH_TAIL_FREE, 0), ENOMEM);
    assert_int_equal(vmh_arena_resize(a, e, y, rest, VMH_TAIL_FREE, 0), 0);
    vmh_arena_stats(a, &s);
    assert_int_equal(s.free, 0);
    assert_int_equal(vmh_arena_resize(a, e, y, SIZE_MAX, VMH_TAIL_FREE, 0), ENOMEM);
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

/* ---- Trimming and deletion ----------------------------------------------------------------- */

static void count_owner(void *owner, void *arg)
{
    *(uintptr_t *)arg += (uintptr_t)owner;
}

static void test_take_empty_extent(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    vmh_extent_t *e1 = vmh_arena_add_extent(a, 0x900000000, 2 * MiB, (void *)1);
    vmh_extent_t *e2 = vmh_arena_add_extent(a, 0xa00000000, 2 * MiB, (void *)2);
    vmh_extent_t *e3 = vmh_arena_add_extent(a, 0xb00000000, 2 * MiB, (void *)4);
    (void)e3;
    uintptr_t p1, p2, q;
    /* Fill two extents exactly; the third stays empty. */
    assert_int_equal(vmh_arena_alloc(a, 2 * MiB, &p1), 0);
    assert_int_equal(vmh_arena_alloc(a, 2 * MiB, &p2), 0);
    vmh_extent_t *pe1 = p1 == 0x900000000 ? e1 : p1 == 0xa00000000 ? e2 : e3;
    vmh_extent_t *pe2 = p2 == 0x900000000 ? e1 : p2 == 0xa00000000 ? e2 : e3;
    uintptr_t base;
    size_t size;
    void *owner = vmh_arena_take_empty_extent(a, &base, &size);
    assert_non_null(owner);
    assert_int_equal(size, 2 * MiB);
    assert_true(vmh_extent_base(pe1) != base && vmh_extent_base(pe2) != base);
    assert_null(vmh_arena_take_empty_extent(a, &base, &size));
    assert_int_equal(vmh_arena_alloc(a, 1, &q), ENOMEM);

    /* A parked block keeps its extent; unparking frees it. */
    void *owner1 = vmh_extent_owner(pe1);
    assert_int_equal(vmh_arena_park(a, pe1, p1, 9, NULL), 0);
    assert_null(vmh_arena_take_empty_extent(a, &base, &size));
    assert_int_equal(vmh_arena_unpark_upto(a, 9), 1);
    assert_ptr_equal(vmh_arena_take_empty_extent(a, &base, &size), owner1);
    assert_int_equal(base, p1);
    vmh_arena_stats_t s;
    vmh_arena_stats(a, &s);
    assert_int_equal(s.extents, 1);
    assert_int_equal(s.extents_bytes, 2 * MiB);
    assert_int_equal(s.free, 0);
    assert_int_equal(vmh_arena_alloc(a, 1, &q), ENOMEM);

    /* Partly used extents are never taken, whatever the order of frees. */
    assert_int_equal(vmh_arena_resize(a, pe2, p2, 4096, VMH_TAIL_FREE, 0), 0);
    assert_null(vmh_arena_take_empty_extent(a, &base, &size));
    assert_int_equal(vmh_arena_release(a, pe2, p2, NULL), 0);
    assert_non_null(vmh_arena_take_empty_extent(a, NULL, NULL));
    vmh_arena_stats(a, &s);
    assert_int_equal(s.extents + s.extents_bytes + s.free + s.live + s.parked, 0);
    assert_consistent(a);

    /* delete() hands back every remaining owner, busy or idle. */
    vmh_arena_add_extent(a, 0x900000000, 2 * MiB, (void *)8);
    vmh_arena_add_extent(a, 0xa00000000, 2 * MiB, (void *)16);
    assert_int_equal(vmh_arena_alloc(a, 100, &q), 0);
    uintptr_t sum = 0;
    vmh_arena_delete(a, count_owner, &sum);
    assert_int_equal(sum, 24);
}

/* ---- Free runs (issue 27's holes) ---------------------------------------------------------- */

typedef struct runs_seen {
    uintptr_t base[8];
    size_t size[8];
    int n;
} runs_seen_t;

static void on_run(uintptr_t base, size_t size, void *arg)
{
    runs_seen_t *r = arg;
    assert_true(r->n < 8);
    r->base[r->n] = base;
    r->size[r->n++] = size;
}

/* Only free blocks count (a parked block may still be used by the GPU), each cut to its aligned
 * interior from the extent's base, the extent's end counting as aligned. */
static void test_free_runs(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    const uintptr_t base = 0x7f0000000000;
    const size_t chunk = 8 * MiB;
    /* 30 MiB: three chunks of 8 MiB and a last one of 6 MiB. */
    vmh_extent_t *e = vmh_arena_add_extent(a, base, 30 * MiB, NULL);
    assert_non_null(e);
    runs_seen_t r = {0};
    assert_int_equal(vmh_arena_free_runs(e, chunk, false, on_run, &r), 30 * MiB);
    assert_int_equal(r.n, 1);

    /* [0, 1M) live, [1M, 12M) to be parked, [12M, 13M) live, the rest free. */
    uintptr_t p0, p1, p2;
    assert_int_equal(vmh_arena_alloc(a, 1 * MiB, &p0), 0);
    assert_int_equal(vmh_arena_alloc(a, 11 * MiB, &p1), 0);
    assert_int_equal(vmh_arena_alloc(a, 1 * MiB, &p2), 0);
    assert_int_equal(p0, base);
    assert_int_equal(p1, base + 1 * MiB);
    assert_int_equal(p2, base + 12 * MiB);
    assert_int_equal(vmh_arena_park(a, e, p1, 5, NULL), 0);
    r = (runs_seen_t){0};
    /* Free [13M, 30M): chunks [16M, 24M) and the short last one [24M, 30M). */
    assert_int_equal(vmh_arena_free_runs(e, chunk, false, on_run, &r), 14 * MiB);
    assert_int_equal(r.n, 1);
    assert_int_equal(r.base[0], base + 16 * MiB);
    assert_int_equal(r.size[0], 14 * MiB);

    /* Unparked, [1M, 12M) is free: its chunk [8M, 16M) is not (the block at 12M is live). */
    assert_int_equal(vmh_arena_unpark_upto(a, 5), 1);
    r = (runs_seen_t){0};
    assert_int_equal(vmh_arena_free_runs(e, chunk, false, on_run, &r), 14 * MiB);
    assert_int_equal(vmh_arena_free_runs(e, 1 * MiB, false, NULL, NULL), 11 * MiB + 17 * MiB);
    assert_int_equal(vmh_arena_release(a, e, p2, NULL), 0);
    r = (runs_seen_t){0};
    assert_int_equal(vmh_arena_free_runs(e, chunk, false, on_run, &r), 22 * MiB);
    assert_int_equal(r.n, 1);
    assert_int_equal(r.base[0], base + 8 * MiB);

    /* A retired extent's free space may be another process's: none is offered. */
    vmh_arena_retire_extent(a, e);
    assert_int_equal(vmh_arena_free_runs(e, chunk, false, NULL, NULL), 0);
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

/* A hole is out of service: never served, found or merged; unholed it is free space again,
 * merged with its free neighbours; an extent whose other blocks are free is empty and its
 * take gives every byte back. */
static void test_holes(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    const uintptr_t base = 0x7f0000000000;
    vmh_extent_t *e = vmh_arena_add_extent(a, base, 32 * MiB, NULL);
    uintptr_t p0, p1;
    assert_int_equal(vmh_arena_alloc(a, 1 * MiB, &p0), 0);
    /* [8M, 16M) and [16M, 24M) out of service: two holes side by side, free space around. */
    assert_int_equal(vmh_arena_hole(a, e, base + 8 * MiB, 8 * MiB), 0);
    assert_int_equal(vmh_arena_hole(a, e, base + 16 * MiB, 8 * MiB), 0);
    assert_int_equal(vmh_arena_hole(a, e, base + 12 * MiB, 1 * MiB), EINVAL); /* not free */
    assert_int_equal(vmh_arena_hole(a, e, base, 1 * MiB), EINVAL);            /* live */
    assert_consistent(a);
    vmh_arena_stats_t st;
    vmh_arena_stats(a, &st);
    assert_int_equal(st.holes, 16 * MiB);
    assert_int_equal(st.free, 15 * MiB);
    assert_int_equal(vmh_extent_holes(e), 16 * MiB);
    assert_int_equal(vmh_arena_holes(e, NULL, NULL), 2);
    /* Free runs skip the holes: [1M, 8M) and [24M, 32M). */
    assert_int_equal(vmh_arena_free_runs(e, 1 * MiB, false, NULL, NULL), 15 * MiB);
    /* 10 MiB fits only across the holes: not served. */
    assert_int_equal(vmh_arena_alloc(a, 10 * MiB, &p1), ENOMEM);
    assert_false(vmh_arena_find(e, base + 9 * MiB, &(vmh_block_info_t){0}));
    /* The extent with no live block is empty (its holes hold nothing): counted without them. */
    assert_int_equal(vmh_arena_release(a, e, p0, NULL), 0);
    assert_int_equal(vmh_arena_unused_extent_bytes(a, NULL), 16 * MiB);
    assert_int_equal(vmh_arena_unhole(a, e, base + 12 * MiB), EINVAL); /* not a hole's start */
    assert_int_equal(vmh_arena_unhole(a, e, base + 8 * MiB), 0);
    assert_consistent(a);
    /* [0, 16M) is one free block now: 10 MiB is served from it. */
    assert_int_equal(vmh_arena_alloc(a, 10 * MiB, &p1), 0);
    assert_true(p1 + 10 * MiB <= base + 16 * MiB);
    assert_int_equal(vmh_arena_release(a, e, p1, NULL), 0);
    uintptr_t tb;
    size_t ts;
    assert_null(vmh_arena_take_empty_extent(a, &tb, &ts));
    assert_int_equal(ts, 32 * MiB);
    vmh_arena_stats(a, &st);
    assert_int_equal(st.holes + st.free + st.extents_bytes, 0);
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

/* Two neighbouring extents joined (issue 27): the free edges become one block that serves what
 * neither held alone; live, parked and hole blocks keep their places and are found, freed and
 * unparked through the new extent; its owner is the lower one's; misuse changes nothing. */
static void test_join(void **state)
{
    (void)state;
    vmh_arena_t *a = vmh_arena_new();
    const uintptr_t base = 0x7f0000000000;
    int lo_owner, hi_owner, far_owner;
    vmh_extent_t *lo = vmh_arena_add_extent(a, base, 16 * MiB, &lo_owner);
    vmh_extent_t *hi = vmh_arena_add_extent(a, base + 16 * MiB, 16 * MiB, &hi_owner);
    uintptr_t p0, p1, h0, h1, keep, big;
    /* Best fit, lowest address first: lo [0, 4M) [4M, 16M), hi [16M, 24M) [24M, 28M) [28M, 32M). */
    assert_int_equal(vmh_arena_alloc(a, 4 * MiB, &p0), 0);
    assert_int_equal(vmh_arena_alloc(a, 12 * MiB, &p1), 0);
    assert_int_equal(vmh_arena_alloc(a, 8 * MiB, &h0), 0);
    assert_int_equal(vmh_arena_alloc(a, 4 * MiB, &h1), 0);
    assert_int_equal(vmh_arena_alloc(a, 4 * MiB, &keep), 0);
    assert_int_equal(p0, base);
    assert_int_equal(p1, base + 4 * MiB);
    assert_int_equal(h0, base + 16 * MiB);
    assert_int_equal(h1, base + 24 * MiB);
    assert_int_equal(keep, base + 28 * MiB);
    /* lo: live, then 12M free; hi: 8M free, a hole, a parked block. */
    assert_int_equal(vmh_arena_release(a, lo, p1, NULL), 0);
    assert_int_equal(vmh_arena_release(a, hi, h0, NULL), 0);
    assert_int_equal(vmh_arena_release(a, hi, h1, NULL), 0);
    assert_int_equal(vmh_arena_hole(a, hi, h1, 4 * MiB), 0);
    assert_int_equal(vmh_arena_park(a, hi, keep, 7, NULL), 0);
    vmh_extent_t *far = vmh_arena_add_extent(a, base + 64 * MiB, 8 * MiB, &far_owner);
    size_t head, tail;
    vmh_extent_edges(lo, &head, &tail);
    assert_int_equal(head, 0);
    assert_int_equal(tail, 12 * MiB);
    vmh_extent_edges(hi, &head, &tail);
    assert_int_equal(head, 8 * MiB);
    assert_int_equal(tail, 0);
    vmh_extent_edges(far, &head, &tail);
    assert_int_equal(head, 8 * MiB);
    assert_int_equal(tail, 8 * MiB);
    /* 20 MiB fits no extent alone. */
    assert_int_equal(vmh_arena_alloc(a, 20 * MiB, &big), ENOMEM);
    assert_null(vmh_arena_join_new(hi, lo)); /* hi does not end where lo starts */
    assert_null(vmh_arena_join_new(lo, far)); /* far does not start where lo ends */
    assert_null(vmh_arena_join_new(lo, lo));
    vmh_arena_join_drop(vmh_arena_join_new(lo, hi)); /* made, not used: nothing changes */
    assert_consistent(a);
    vmh_arena_stats_t before, after;
    vmh_arena_stats(a, &before);

    vmh_extent_t *fresh = vmh_arena_join_new(lo, hi);
    assert_non_null(fresh);
    vmh_extent_t *j = vmh_arena_join(a, lo, hi, fresh);
    assert_ptr_equal(j, fresh);
    assert_consistent(a);
    vmh_arena_stats(a, &after);
    assert_int_equal(after.extents, before.extents - 1);
    assert_int_equal(after.extents_bytes, before.extents_bytes);
    assert_int_equal(after.free, before.free);
    assert_int_equal(after.holes, before.holes);
    assert_int_equal(after.parked, before.parked);
    assert_ptr_equal(vmh_extent_owner(j), &lo_owner);
    assert_int_equal(vmh_extent_base(j), base);
    assert_int_equal(vmh_extent_size(j), 32 * MiB);
    assert_int_equal(vmh_extent_holes(j), 4 * MiB);
    vmh_block_info_t info;
    assert_true(vmh_arena_find(j, p0 + 100, &info));
    assert_int_equal(info.base, p0);
    /* [4M, 24M) is one free block now: 20 MiB is served from it. */
    assert_int_equal(vmh_arena_alloc(a, 20 * MiB, &big), 0);
    assert_int_equal(big, base + 4 * MiB);
    assert_true(vmh_arena_find(j, big + 17 * MiB, &info));
    assert_int_equal(vmh_arena_unpark_upto(a, 7), 1);
    assert_int_equal(vmh_arena_unhole(a, j, base + 24 * MiB), 0);
    assert_int_equal(vmh_arena_release(a, j, big, NULL), 0);
    assert_int_equal(vmh_arena_release(a, j, p0, NULL), 0);
    assert_consistent(a);
    /* Empty again: one free block, taken whole. */
    uintptr_t tb;
    size_t ts;
    void *owner;
    int taken = 0;
    while ((owner = vmh_arena_take_empty_extent(a, &tb, &ts))) {
        if (owner == &lo_owner) {
            assert_int_equal(tb, base);
            assert_int_equal(ts, 32 * MiB);
        } else {
            assert_ptr_equal(owner, &far_owner);
        }
        taken++;
    }
    assert_int_equal(taken, 2);
    assert_consistent(a);
    vmh_arena_delete(a, NULL, NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alignment),
        cmocka_unit_test(test_empty_arena),
        cmocka_unit_test(test_exact_fill),
        cmocka_unit_test(test_retired_extent_serves_nothing),
        cmocka_unit_test(test_find),
        cmocka_unit_test(test_find_odd_extent),
        cmocka_unit_test(test_double_and_interior_free),
        cmocka_unit_test(test_coalesce_all),
        cmocka_unit_test(test_coalesce_around_parked),
        cmocka_unit_test(test_park_generations),
        cmocka_unit_test(test_park_out_of_order),
        cmocka_unit_test(test_resize),
        cmocka_unit_test(test_take_empty_extent),
        cmocka_unit_test(test_free_runs),
        cmocka_unit_test(test_holes),
        cmocka_unit_test(test_join),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
