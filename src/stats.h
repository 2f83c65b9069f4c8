/* Layer "utilities": counters, the allocation trace, the exit reports (table, JSON, leaks).
 * Below every other module but log and options; configured by the front with
 * vmh_stats_configure (its settings, made from the options), never by reading the options.
 *
 * Counters are relaxed atomics sharded by thread (no shared line on the fast path), summed by
 * vmh_counter_get. Gauges keep a peak. */
#ifndef VMH_STATS_H
#define VMH_STATS_H

#include <cuda.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "log.h"

/* The longest output path once "%p" is replaced, terminator included. */
#define VMH_PATH_MAX 512

#define VMH_COUNTERS(X)                                                                            \
    X(served_allocs, "allocations served")                                                         \
    X(served_frees, "frees of served buffers")                                                     \
    X(passthrough_calls, "calls passed to the driver")                                             \
    X(driver_calls, "driver calls made by the library")                                            \
    X(driver_calls_background, "  of them by the reclaim thread")                                 \
    X(syncs, "context synchronizations")                                                           \
    X(syncs_blocking, "  of them blocking an app thread")                                          \
    X(syncs_background, "  of them by the reclaim thread")                                         \
    X(park_waits, "allocations waited at the park limit")                                     \
    X(park_wait_us, "  microseconds they waited")                                                  \
    X(cache_hits, "allocations served from the cache")                                             \
    X(grows_in_place, "grows that kept the pointer")                                               \
    X(moves, "grows that moved the buffer")                                                        \
    X(copies, "device copies made by realloc")                                                     \
    X(trims, "cache trims")                                                                        \
    X(tidy_bytes, "idle bytes the tidy gave back")                                                 \
    X(queue_splits, "second work queues (frees park)")                                            \
    X(library_streams, "math libraries' own streams")                                             \
    X(oom_retries, "allocations retried after a trim")                                             \
    X(spills, "allocations served from host memory")                                               \
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
/* Set on the library's own threads (the reclaim thread): their driver calls are counted as
 * driver_calls_background too, so that the calls an allocating thread pays show apart. */
extern _Thread_local bool vmh_stats_background_thread;
int64_t vmh_gauge_get(vmh_gauge_t g);
int64_t vmh_gauge_peak(vmh_gauge_t g);
void vmh_stats_reset(void);

/* Trace, in the CSV of RMM's logging adaptor: Thread,Time,Action,Pointer,Size,Stream.
 * action is "allocate", "free", "allocate failure". No-op unless VMMHOOK_TRACE is set.
 * One line per call, written with one write(2) to a file opened O_APPEND, so lines of different
 * threads never interleave. Thread is the kernel thread id, Time "HH:MM:SS.uuuuuu" since the
 * trace was opened, Pointer "0x..." hex, Size decimal, Stream "0" for NULL else "0x..." hex
 * (the forms RMM writes and its replay benchmark parses). A failed allocation is traced with
 * pointer 0 and the size asked for; a free with the size the buffer was allocated with.
 *
 * Beside a trace that is a regular file, a companion "<trace>.gauges.csv" (created alike: 0600,
 * no symbolic link, O_APPEND, one write per line) gets the header
 * "Time,Requested,Mapped,Reserved,Cached" and, for every trace line, one line with the same Time
 * text and the current values (vmh_gauge_get) of bytes_requested, bytes_mapped, bytes_reserved
 * and bytes_cached, in decimal (signed). The RMM CSV itself is unchanged. A companion that cannot
 * be created gets one warning (VMMHOOK_STRICT: the program stops) and the trace goes on
 * without it. Files are opened as vmh_stats_configure says. */
#define VMH_TRACE_GAUGES_SUFFIX ".gauges.csv"
void vmh_trace(const char *action, CUdeviceptr ptr, size_t size, CUstream stream);

/* What this module takes from the options; the front makes it once, at start (lifetime.c). */
typedef struct vmh_stats_settings {
    bool stats;           /* VMMHOOK_STATS: the table at exit */
    bool leaks;           /* VMMHOOK_LEAKS: list leaks at exit */
    const char *trace;    /* VMMHOOK_TRACE: path template, "" = no trace */
    const char *json;     /* VMMHOOK_STATS_JSON: path template, "" = no JSON */
    vmh_refuse_fn refuse; /* a trace file that cannot be made (log.h) */
} vmh_stats_settings_t;

/* Takes a copy of *s (the paths copied, cut at VMH_PATH_MAX), and opens the trace now when one is
 * asked for, so that its clock starts with the program and the file exists even if nothing is
 * allocated. Called by the front once, before any other call here (tests call it again to change
 * the settings).
 *
 * Output files (the trace, its gauges companion, the JSON): "%p" in a path is replaced by the
 * process id when the file is opened (the trace at configure time, the JSON at exit, so that a
 * forked child writes its own), "%%" by one '%'; any other '%' is kept. A new file is created
 * 0600. An existing path must be a regular file owned by the process's effective uid: then it
 * is made 0600 and emptied; anything else is refused without being changed (a symbolic link, a
 * FIFO, which would block the program, a device, another user's file, even for root). A trace
 * that cannot be opened gets one warning (with VMMHOOK_STRICT, the program stops) and tracing
 * is off; a JSON file that cannot be opened at exit gets one line. */
void vmh_stats_configure(const vmh_stats_settings_t *s);

/* The per-tag section of the report, written by a layer above this one (tags.c): a function
 * that logs its lines of the exit table, and one that writes its JSON value into buf (at most
 * len bytes, indented by indent) and returns the length it needed, like snprintf. Set by the
 * front at start (lifetime.c); without it the table has no tag lines and the JSON says
 * "tags": {}. Stats calls up only through these, so no arrow of the layer diagram points up. */
typedef void (*vmh_stats_table_fn)(void);
typedef size_t (*vmh_stats_json_fn)(char *buf, size_t len, int indent);
void vmh_stats_set_tag_report(vmh_stats_table_fn table, vmh_stats_json_fn json);

/* Called at exit: the stats table / JSON when asked. Once per process (later calls do
 * nothing); call it after the leak report so that the JSON includes the leak totals. */
void vmh_stats_report(void);

/* Leak report at exit: the heap walks its live buffers and calls begin, one per live buffer,
 * then end. With leaks configured (VMMHOOK_LEAKS) each leak is listed (pointer, size, device, call
 * site resolved with dladdr; the first 256), then a total; without it nothing is printed, but the
 * totals still go into the JSON. Not thread-safe against itself: one walk at a time. */
void vmh_leak_report_begin(void);
void vmh_leak_report_one(CUdeviceptr p, size_t size, int device, void *call_site);
void vmh_leak_report_end(void);

#ifdef VMH_TESTING
/* Closes the trace and forgets it, so that a test can open another (the library never closes
 * it: frees from other libraries' destructors still trace after ours). */
void vmh_trace_close(void);

/* The effective uid that must own an existing output file: geteuid; tests pretend. */
extern uid_t (*vmh_stats_euid)(void);
#endif

#endif
