/* Layer "utilities": counters and gauges.
 *
 * Counters are relaxed atomics sharded by thread (summed on read), gauges relaxed atomics each
 * on its own cache line: they are bumped on every served call from every thread, and a shared
 * line would make them the contention point. Only totals matter, never the order between two
 * counters, hence relaxed. */
#include "stats.h"
#include "thread_state.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

/* Counters are sharded by thread: every served call, and the lookups inside dlsym and
 * cuGetProcAddress, bump one, and a single shared line per counter would be the point where
 * all threads meet (many threads slower than one). Each thread adds to the shard it
 * was given at its first count (round robin, so threads share a shard only past
 * VMH_STAT_SHARDS of them, and then still count right: the adds stay atomic); a read sums the
 * shards. The shard index is an initial-exec thread-local: no allocation, no lock and no
 * __tls_get_addr, which the counts made inside dlsym must not need. */
#define VMH_STAT_SHARDS 64

typedef struct counter_shard {
    _Alignas(64) _Atomic uint64_t v[VMH_COUNTER_COUNT];
} counter_shard_t;

typedef struct gauge_slot {
    _Alignas(64) _Atomic int64_t cur;
    _Atomic int64_t peak;
} gauge_slot_t;

static counter_shard_t counter_shards[VMH_STAT_SHARDS];
static atomic_uint next_shard;
static gauge_slot_t gauges[VMH_GAUGE_COUNT];

unsigned vmh_thread_shard(void)
{
    unsigned s = vmh_thread.stats_shard;
    if (__builtin_expect(s == 0, 0)) {
        /* Never 0 again: the count wraps only after 2^32 threads, skipping 0. */
        do
            s = atomic_fetch_add_explicit(&next_shard, 1, memory_order_relaxed) + 1;
        while (s == 0);
        vmh_thread.stats_shard = s;
    }
    return s - 1;
}

static counter_shard_t *my_shard(void)
{
    return &counter_shards[vmh_thread_shard() % VMH_STAT_SHARDS];
}

void vmh_count(vmh_counter_t c, uint64_t n)
{
    if ((unsigned)c < VMH_COUNTER_COUNT)
        atomic_fetch_add_explicit(&my_shard()->v[c], n, memory_order_relaxed);
}

void vmh_gauge_add(vmh_gauge_t g, int64_t delta)
{
    if ((unsigned)g >= VMH_GAUGE_COUNT)
        return;
    gauge_slot_t *s = &gauges[g];
    /* The value right after this add, in the modification order of cur: the largest of these
     * over all adds is exactly the peak, however the adds of different threads interleave. */
    int64_t now = atomic_fetch_add_explicit(&s->cur, delta, memory_order_relaxed) + delta;
    if (delta <= 0)
        return;
    int64_t peak = atomic_load_explicit(&s->peak, memory_order_relaxed);
    while (now > peak && !atomic_compare_exchange_weak_explicit(
                             &s->peak, &peak, now, memory_order_relaxed, memory_order_relaxed))
        ;
}

uint64_t vmh_counter_get(vmh_counter_t c)
{
    if ((unsigned)c >= VMH_COUNTER_COUNT)
        return 0;
    uint64_t sum = 0;
    for (unsigned i = 0; i < VMH_STAT_SHARDS; i++)
        sum += atomic_load_explicit(&counter_shards[i].v[c], memory_order_relaxed);
    return sum;
}

int64_t vmh_gauge_get(vmh_gauge_t g)
{
    return (unsigned)g < VMH_GAUGE_COUNT
               ? atomic_load_explicit(&gauges[g].cur, memory_order_relaxed)
               : 0;
}

int64_t vmh_gauge_peak(vmh_gauge_t g)
{
    return (unsigned)g < VMH_GAUGE_COUNT
               ? atomic_load_explicit(&gauges[g].peak, memory_order_relaxed)
               : 0;
}
void vmh_counters_reset(void)
{
    for (unsigned k = 0; k < VMH_STAT_SHARDS; k++)
        for (unsigned i = 0; i < VMH_COUNTER_COUNT; i++)
            atomic_store_explicit(&counter_shards[k].v[i], 0, memory_order_relaxed);
    for (unsigned i = 0; i < VMH_GAUGE_COUNT; i++) {
        atomic_store_explicit(&gauges[i].cur, 0, memory_order_relaxed);
        atomic_store_explicit(&gauges[i].peak, 0, memory_order_relaxed);
    }
}
