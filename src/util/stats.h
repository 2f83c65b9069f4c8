/* Layer "utilities": counters and gauges (stats.c). Below every other module but log and
 * options. The allocation trace (trace.h), the exit reports (report.h), which read them,
 * and the output files both write (outfile.h) are files of their own; this header includes
 * theirs, so that the code that counts, traces and reports needs one include. Configured by the
 * front with vmh_stats_configure (report.h: its settings, made from the options), never by
 * reading the options.
 *
 * Counters are relaxed atomics sharded by thread (no shared line on the fast path), summed by
 * vmh_counter_get. Gauges keep a peak. */
#ifndef VMH_STATS_H
#define VMH_STATS_H

#include <stdbool.h>
#include <stdint.h>

#define VMH_COUNTERS(X)                                                                            \
    X(served_allocs, "allocations served")                                                         \
    X(served_frees, "frees of served buffers")                                                     \
    X(passthrough_calls, "calls passed to the driver")                                             \
    X(driver_calls, "driver calls made by the library")                                            \
    X(driver_calls_background, "  of them by the reclaim thread")                                  \
    X(syncs, "context synchronizations")                                                           \
    X(syncs_blocking, "  of them blocking an app thread")                                          \
    X(syncs_background, "  of them by the reclaim thread")                                         \
    X(park_waits, "allocations waited at the park limit")                                          \
    X(park_wait_us, "  microseconds they waited")                                                  \
    X(cache_hits, "allocations served from the cache")                                             \
    X(grows_in_place, "grows that kept the pointer")                                               \
    X(moves, "grows that moved the buffer")                                                        \
    X(copies, "device copies made by realloc")                                                     \
    X(trims, "cache trims")                                                                        \
    X(tidy_bytes, "idle bytes the tidy gave back")                                                 \
    X(queue_splits, "second work queues (frees park)")                                             \
    X(library_streams, "math libraries' own streams")                                              \
    X(oom_retries, "allocations retried after a trim")                                             \
    X(spills, "allocations served from host memory")                                               \
    X(spills_small, "  of them small (below the reserve's big)")                                   \
    X(ooms, "allocations refused: out of memory")

#define VMH_GAUGES(X)                                                                              \
    X(bytes_requested, "bytes requested by live buffers")                                          \
    X(bytes_mapped, "bytes of device memory mapped")                                               \
    X(bytes_reserved, "bytes of address space reserved")                                           \
    X(bytes_cached, "bytes held idle for reuse")                                                   \
    X(bytes_spilled, "bytes of host memory mapped (overflow)")

#define VMH_ENUM_ITEM(name, help) VMH_STAT_##name,
typedef enum vmh_counter { VMH_COUNTERS(VMH_ENUM_ITEM) VMH_COUNTER_COUNT } vmh_counter_t;
typedef enum vmh_gauge { VMH_GAUGES(VMH_ENUM_ITEM) VMH_GAUGE_COUNT } vmh_gauge_t;
#undef VMH_ENUM_ITEM

void vmh_count(vmh_counter_t c, uint64_t n);
void vmh_gauge_add(vmh_gauge_t g, int64_t delta); /* updates the peak */
uint64_t vmh_counter_get(vmh_counter_t c);

/* The calling thread's number, given round robin at its first call and fixed after: modulo a
 * shard count it spreads threads over shards (counters here, parked bytes in reclaim.c) so
 * that threads rarely share one. An initial-exec thread-local: no allocation, no lock, no
 * __tls_get_addr (safe inside dlsym). */
unsigned vmh_thread_shard(void);
int64_t vmh_gauge_get(vmh_gauge_t g);
int64_t vmh_gauge_peak(vmh_gauge_t g);
/* Zeroes every counter and gauge (vmh_stats_reset, report.h, also forgets the reports' state). */
void vmh_counters_reset(void);

#include "outfile.h"
#include "report.h"
#include "trace.h"

#endif
