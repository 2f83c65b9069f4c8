/* The arena (src/arena/arena.c) run against a shadow model: a randomized stress test checks, after
 * every batch, that live and parked blocks never overlap, stay inside their extents and that
 * the statistics add up; vmh_arena_check() verifies the arena's internal invariants at the same
 * time. */
#include "arena_fixture.h"

struct leak_walk {
    size_t n, bytes;
};

static void on_live(const vmh_block_info_t *b, void *arg)
{
    struct leak_walk *w = arg;
    w->n++;
    w->bytes += b->usable;
}

/* ---- Randomized stress against a shadow model ---------------------------------------------- */

typedef struct shadow_blk {
    uintptr_t base;
    size_t size, usable;
    int ext;      /* index into the shadow extents */
    uint64_t gen; /* parked blocks */
} shadow_blk_t;

typedef struct shadow_ext {
    vmh_extent_t *e;
    uintptr_t base;
    size_t size;
    bool gone;
} shadow_ext_t;

enum { MAX_EXT = 12, MAX_BLK = 4096 };

static struct {
    vmh_arena_t *a;
    shadow_ext_t ext[MAX_EXT];
    int next;
    shadow_blk_t live[MAX_BLK], parked[MAX_BLK];
    int nlive, nparked;
    uint64_t gen;
} S;

/* What the stress runs exercised, summed over seeds (printed, to see the mix is sane). */
static struct {
    unsigned long alloc, alloc_nomem, release, park, unpark, unparked, grow, grow_nomem, shrink,
        find, find_hit, take;
} T;

static int shadow_ext_of(uintptr_t p)
{
    for (int i = 0; i < S.next; i++)
        if (!S.ext[i].gone && p >= S.ext[i].base && p - S.ext[i].base < S.ext[i].size)
            return i;
    return -1;
}

static int cmp_blk(const void *x, const void *y)
{
    const shadow_blk_t *a = x, *b = y;
    return a->base < b->base ? -1 : a->base > b->base;
}

/* The end of the free run after [p, p + usable): the next live or parked start, or the
 * extent's end. The arena coalesces eagerly, so that is exactly what resize can grow into. */
static uintptr_t shadow_room_end(int ext, uintptr_t end)
{
    uintptr_t lim = S.ext[ext].base + S.ext[ext].size;
    for (int i = 0; i < S.nlive; i++)
        if (S.live[i].base >= end && S.live[i].base < lim)
            lim = S.live[i].base;
    for (int i = 0; i < S.nparked; i++)
        if (S.parked[i].base >= end && S.parked[i].base < lim)
            lim = S.parked[i].base;
    return lim;
}

static void shadow_check(void)
{
    assert_consistent(S.a);
    static shadow_blk_t all[2 * MAX_BLK];
    int n = 0;
    size_t live = 0, parked = 0, ext_bytes = 0, exts = 0;
    for (int i = 0; i < S.nlive; i++) {
        all[n++] = S.live[i];
        live += S.live[i].usable;
    }
    for (int i = 0; i < S.nparked; i++) {
        all[n++] = S.parked[i];
        parked += S.parked[i].usable;
    }
    for (int i = 0; i < S.next; i++) {
        if (!S.ext[i].gone) {
            ext_bytes += S.ext[i].size;
            exts++;
        }
    }
    qsort(all, (size_t)n, sizeof(all[0]), cmp_blk);
    for (int i = 0; i < n; i++) {
        const shadow_ext_t *x = &S.ext[all[i].ext];
        assert_false(x->gone);
        assert_int_equal(all[i].base % ALIGN, 0);
        assert_true(all[i].base >= x->base && all[i].base + all[i].usable <= x->base + x->size);
        if (i > 0)
            assert_true(all[i - 1].base + all[i - 1].usable <= all[i].base); /* disjoint */
    }
    vmh_arena_stats_t s;
    vmh_arena_stats(S.a, &s);
    assert_int_equal(s.live, live);
    assert_int_equal(s.parked, parked);
    assert_int_equal(s.extents_bytes, ext_bytes);
    assert_int_equal(s.extents, exts);
    assert_int_equal(s.free, ext_bytes - live - parked);
    assert_int_equal(vmh_arena_parked(S.a), (size_t)S.nparked);
    struct leak_walk w = {0, 0};
    vmh_arena_for_each_live(S.a, on_live, &w);
    assert_int_equal(w.n, (size_t)S.nlive);
    assert_int_equal(w.bytes, live);
}

static size_t stress_size(void)
{
    switch (rnd_below(10)) {
    case 0:
        return rnd_logsize(64 * KiB, 1 * MiB);
    case 1:
    case 2:
    case 3:
        return rnd_logsize(4 * KiB, 64 * KiB);
    default:
        return rnd_logsize(1, 4 * KiB);
    }
}

static void stress_run(uint64_t seed, int ops)
{
    memset(&S, 0, sizeof(S));
    rng_state = seed;
    S.a = vmh_arena_new();
    for (int op = 0; op < ops; op++) {
        unsigned r = (unsigned)rnd_below(100);
        if (r < 40 && S.nlive < MAX_BLK - 1) {
            size_t size = stress_size();
            uintptr_t p;
            int rc = vmh_arena_alloc(S.a, size, &p);
            if (rc == ENOMEM && S.next < MAX_EXT) {
                /* Like heap.c: map another extent and retry. Odd sizes on purpose. */
                size_t esize = align_up(size) + ALIGN * rnd_below(4 * MiB / ALIGN);
                uintptr_t base =
                    0x10000000000 + (uintptr_t)S.next * 0x40000000 + ALIGN * rnd_below(1024);
                vmh_extent_t *e = vmh_arena_add_extent(S.a, base, esize, &S.ext[S.next]);
                assert_non_null(e);
                S.ext[S.next++] = (shadow_ext_t){e, base, esize, false};
                rc = vmh_arena_alloc(S.a, size, &p);
                assert_int_equal(rc, 0);
            }
            if (rc == ENOMEM) {
                T.alloc_nomem++;
                continue;
            }
            assert_int_equal(rc, 0);
            T.alloc++;
            int x = shadow_ext_of(p);
            assert_true(x >= 0);
            assert_int_equal(p % ALIGN, 0);
            /* Never over a parked block (nor a live one; the batch check also sees that). */
            for (int i = 0; i < S.nparked; i++)
                assert_true(p + align_up(size) <= S.parked[i].base ||
                            S.parked[i].base + S.parked[i].usable <= p);
            S.live[S.nlive++] = (shadow_blk_t){p, size, align_up(size), x, 0};
        } else if (r < 55 && S.nlive) {
            int i = (int)rnd_below((size_t)S.nlive);
            shadow_blk_t b = S.live[i];
            vmh_block_info_t info;
            assert_int_equal(vmh_arena_release(S.a, S.ext[b.ext].e, b.base, &info), 0);
            assert_int_equal(info.base, b.base);
            assert_int_equal(info.size, b.size);
            assert_int_equal(info.usable, b.usable);
            S.live[i] = S.live[--S.nlive];
            assert_int_equal(vmh_arena_release(S.a, S.ext[b.ext].e, b.base, NULL), EINVAL);
            T.release++;
        } else if (r < 72 && S.nlive) {
            int i = (int)rnd_below((size_t)S.nlive);
            shadow_blk_t b = S.live[i];
            /* Mostly increasing generations, sometimes an older one. */
            uint64_t gen = rnd_below(10) ? S.gen : S.gen - rnd_below(S.gen + 1);
            vmh_block_info_t info;
            assert_int_equal(vmh_arena_park(S.a, S.ext[b.ext].e, b.base, gen, &info), 0);
            assert_int_equal(info.size, b.size);
            b.gen = gen;
            S.parked[S.nparked++] = b;
            T.park++;
            S.live[i] = S.live[--S.nlive];
            if (rnd_below(4) == 0)
                S.gen++;
        } else if (r < 77) {
            uint64_t g = rnd_below(S.gen + 2);
            size_t expect = 0;
            for (int i = 0; i < S.nparked;) {
                if (S.parked[i].gen <= g) {
                    S.parked[i] = S.parked[--S.nparked];
                    expect++;
                } else {
                    i++;
                }
            }
            assert_int_equal(vmh_arena_unpark_upto(S.a, g), expect);
            T.unpark++;
            T.unparked += expect;
        } else if (r < 90 && S.nlive) {
            int i = (int)rnd_below((size_t)S.nlive);
            shadow_blk_t *b = &S.live[i];
            size_t size = rnd_below(2) ? b->size / 2 + 1 : b->size + stress_size();
            uintptr_t room = shadow_room_end(b->ext, b->base + b->usable);
            int expect = b->base + align_up(size) <= room ? 0 : ENOMEM;
            assert_int_equal(vmh_arena_resize(S.a, S.ext[b->ext].e, b->base, size, VMH_TAIL_FREE, 0), expect);
            if (size <= b->size)
                T.shrink++;
            else if (expect == 0)
                T.grow++;
            else
                T.grow_nomem++;
            if (expect == 0) {
                b->size = size;
                b->usable = align_up(size);
            }
            vmh_block_info_t info;
            assert_true(vmh_arena_find(S.ext[b->ext].e, b->base + b->usable - 1, &info));
            assert_int_equal(info.base, b->base);
            assert_int_equal(info.size, b->size);
        } else if (r < 98 && S.next) {
            /* find() at a random address of a random extent, against the shadow. */
            int x = (int)rnd_below((size_t)S.next);
            if (S.ext[x].gone)
                continue;
            uintptr_t p = S.ext[x].base + rnd_below(S.ext[x].size);
            if (S.nlive && rnd_below(2)) {
                const shadow_blk_t *b = &S.live[rnd_below((size_t)S.nlive)];
                x = b->ext;
                p = b->base + rnd_below(b->usable);
            }
            const shadow_blk_t *hit = NULL;
            for (int i = 0; i < S.nlive; i++)
                if (p >= S.live[i].base && p - S.live[i].base < S.live[i].usable)
                    hit = &S.live[i];
            vmh_block_info_t info;
            bool found = vmh_arena_find(S.ext[x].e, p, &info);
            assert_int_equal(found, hit != NULL);
            T.find++;
            T.find_hit += found;
            if (hit) {
                assert_int_equal(info.base, hit->base);
                assert_int_equal(info.size, hit->size);
                assert_int_equal(info.usable, hit->usable);
            }
        } else {
            uintptr_t base;
            size_t size;
            bool any_empty = false;
            for (int x = 0; x < S.next; x++) {
                if (S.ext[x].gone)
                    continue;
                bool used = false;
                for (int i = 0; i < S.nlive && !used; i++)
                    used = S.live[i].ext == x;
                for (int i = 0; i < S.nparked && !used; i++)
                    used = S.parked[i].ext == x;
                any_empty |= !used;
            }
            void *owner = vmh_arena_take_empty_extent(S.a, &base, &size);
            assert_int_equal(owner != NULL, any_empty);
            if (owner) {
                int x = shadow_ext_of(base);
                assert_true(x >= 0);
                assert_ptr_equal(owner, &S.ext[x]);
                assert_int_equal(S.ext[x].base, base);
                assert_int_equal(S.ext[x].size, size);
                for (int i = 0; i < S.nlive; i++)
                    assert_true(S.live[i].ext != x);
                for (int i = 0; i < S.nparked; i++)
                    assert_true(S.parked[i].ext != x);
                S.ext[x].gone = true;
                T.take++;
            }
        }
        if (op % 97 == 0)
            shadow_check();
    }
    shadow_check();
    /* Drain: everything free, one free block per extent, all extents trimmable. */
    while (S.nlive) {
        shadow_blk_t b = S.live[--S.nlive];
        assert_int_equal(vmh_arena_release(S.a, S.ext[b.ext].e, b.base, NULL), 0);
    }
    assert_int_equal(vmh_arena_unpark_upto(S.a, UINT64_MAX), (size_t)S.nparked);
    S.nparked = 0;
    shadow_check();
    vmh_arena_stats_t s;
    vmh_arena_stats(S.a, &s);
    assert_int_equal(vmh_arena_free_blocks(S.a), s.extents);
    for (size_t i = 0; i < s.extents; i++)
        assert_non_null(vmh_arena_take_empty_extent(S.a, NULL, NULL));
    assert_null(vmh_arena_take_empty_extent(S.a, NULL, NULL));
    vmh_arena_stats(S.a, &s);
    assert_int_equal(s.extents, 0);
    vmh_arena_delete(S.a, NULL, NULL);
}

static void test_stress(void **state)
{
    (void)state;
    for (uint64_t seed = 11; seed < 19; seed++)
        stress_run(seed, 10000);
    printf("stress: %lu allocs (%lu ENOMEM at the extent limit), %lu releases, %lu parks, "
           "%lu unparks freeing %lu, resize %lu grown %lu ENOMEM %lu shrunk, %lu finds "
           "(%lu hits), %lu extents trimmed\n",
           T.alloc, T.alloc_nomem, T.release, T.park, T.unpark, T.unparked, T.grow, T.grow_nomem,
           T.shrink, T.find, T.find_hit, T.take);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stress),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
