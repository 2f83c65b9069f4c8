/* Shared by the arena's suites (test_arena_blocks.c, test_arena_stress.c, test_arena_fit.c):
 * sizes, deterministic randomness (so that a failure can be replayed from its seed), and the
 * arena's own invariant check with the statistics adding up. The arena (src/arena/arena.c) is pure
 * host bookkeeping: the extents are made-up address ranges, nothing is mapped. Header-only
 * (static) like testutil.h, so that each suite stays one program of one file; include it
 * first. */
#ifndef VMH_ARENA_FIXTURE_H
#define VMH_ARENA_FIXTURE_H

#ifndef VMH_TESTING
#define VMH_TESTING 1 /* the test hooks declared in arena.h */
#endif
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <setjmp.h>

#include <cmocka.h>

#include "arena.h"


#define KiB ((size_t)1024)
#define MiB (1024 * KiB)
#define ALIGN VMH_ARENA_ALIGN

/* Deterministic randomness (splitmix64), so a failure can be replayed from the seed. */
static uint64_t rng_state;

static inline uint64_t rnd(void)
{
    uint64_t z = (rng_state += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

static inline size_t rnd_below(size_t n)
{
    return n ? (size_t)(rnd() % n) : 0;
}

/* A size spread evenly over orders of magnitude between lo and hi (both > 0). */
static inline size_t rnd_logsize(size_t lo, size_t hi)
{
    unsigned llo = 63 - (unsigned)__builtin_clzll(lo), lhi = 63 - (unsigned)__builtin_clzll(hi);
    unsigned l = llo + (unsigned)rnd_below(lhi - llo + 1);
    size_t s = ((size_t)1 << l) + rnd_below((size_t)1 << l);
    return s < lo ? lo : s > hi ? hi : s;
}

static inline size_t align_up(size_t n)
{
    return (n + ALIGN - 1) & ~(size_t)(ALIGN - 1);
}

static inline void assert_consistent(const vmh_arena_t *a)
{
    assert_int_equal(vmh_arena_check(a), 0);
    vmh_arena_stats_t s;
    vmh_arena_stats(a, &s);
    assert_int_equal(s.live + s.parked + s.free + s.retired + s.holes, s.extents_bytes);
}

#endif
