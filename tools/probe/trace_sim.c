/* trace_sim: an allocation trace in RMM's logging_resource_adaptor CSV replayed through the
 * library's heap on the simulated driver, to count what it costs in driver calls and in memory.
 * CPU only: counts and bytes, never the GPU's speed.
 *
 * The trace is parsed by tools/replay/replay.cu's rules (keep in step with its load_trace):
 * blank lines and lines starting with '#' skipped; a first line whose first field is "Thread"
 * names the columns (Thread, Time, Action, Pointer, Size, any order; without it that order);
 * fields trimmed; actions "allocate", "free" or "deallocate", "allocate failure" (counted, not
 * replayed); pointers hex ("0x..", "(nil)"), sizes decimal. Each trace pointer maps to a replay
 * slot while live: a free of a pointer that is not live is counted and skipped; an allocate of
 * a pointer still live first frees the older block (counted); an allocate of 0 bytes or of a
 * null pointer is counted and skipped. The Time column is read only for --tidy-by-time
 * (replay.cu only prints the span).
 *
 * Replay, as replay.cu replays under the hook: events in file order on one thread, streams
 * ignored, each event allocating in the carved shard its trace thread would have taken (the
 * trace's threads in order of first appearance, shards in order: carved_place.c's per-thread pick;
 * PyTorch allocates from its autograd thread too); the calls are those cudaMalloc / cudaFree reach
 * under the hook: vmh_heap_alloc on the thread's current context and vmh_heap_free(p, NULL, async
 * false) (interpose_mem.c). Blocks still live at the end of the trace are freed after it.
 * --repeat-trace N replays the trace N times back to back on the same heap (a training loop repeats
 * its steps): the first replay starts cold, the later ones show the steady state. The heap is set
 * up as churn_sim's (simprobe.h: tests/unit/testutil.h's tu_reset on an H200-sized simulated
 * device, the product's options from the environment, the product's background reclaim thread
 * unless
 * --no-reclaim-thread). With --runs R the whole thing runs R times from a fresh heap and a
 * figure that differs is printed as its min-max.
 *
 * Printed per replay of the trace: events replayed, allocations made, the library's
 * VMH_STAT_driver_calls, those made on the replaying thread per allocation (the allocation
 * path's: every call but the reclaim thread's), of them the VMM entry points, synchronizations (the
 * simulated driver's count), blocking synchronizations, waits at VMMHOOK_PARK_LIMIT and cache hits
 * (the library's counters), and the peaks of the library's gauges bytes_mapped and bytes_requested
 * within the replay, read after every event (the reclaim thread only lowers bytes_mapped, so
 * that is where it peaks unless a call maps and unmaps within itself; the run's peaks from the
 * gauges themselves are printed beside them), and the gauges bytes_mapped and bytes_requested
 * after the last replay's last event once three windows of the tidy ran (vmh_heap_tidy_now, before
 * the blocks still live are freed: what the reclaim thread gives back within seconds of a
 * load's end, "settled"). Then the simulated driver's calls by entry point
 * (sim_calls), for the first replay and per later replay, of the first run.
 *
 * Timing is not the GPU's: the simulated driver's synchronizations return at once and a call
 * here costs microseconds of CPU, so the reclaim thread, which releases parked frees in the
 * background, keeps up at another rate than on a GPU, and the GPU's lag between a free and the
 * GPU passing it is not modeled. Blocking synchronizations, park waits and the parked bytes
 * inside the peaks are this machine's scheduling. With --no-reclaim-thread parked frees are
 * released only when an allocation finds more than VMMHOOK_PARK_LIMIT parked (or at a free
 * larger than it, where the code waits there): deterministic, and the most parking can hold.
 *
 * Build: meson setup build -Dunit_tests=enabled (it links the simulated driver and the unit
 * suites' set-up, hence cmocka); run:
 *   build/tools/probe/trace_sim [--repeat-trace N] [--runs R] [--no-reclaim-thread]
 *                               [--tidy-by-time] [--quiet] TRACE.csv
 * --tidy-by-time runs the reclaim thread's tidy (vmh_heap_tidy_now) at its pace in the trace's
 * own time (the Time column: every 50 ms of it, a new window every second), so that what the
 * tidy gives back during a load, and what is then mapped again, is in the figures; its calls
 * count as the replay's.
 * Exit 0; 1 when the trace cannot be read, an allocation or free failed, or the driver's
 * ledger was not empty after a run; 2 usage.
 */
#include "simprobe.h"

#include "carved.h"       /* VMH_CLASS_SHARDS */
#include "thread_state.h" /* the shard a trace thread allocates in */

#include <ctype.h>
#include <errno.h>
#include <strings.h>

#define MAX_FIELDS 64
#define MAX_REPLAYS 1000
#define MAX_RUNS 100

/* ---- a set of 64-bit keys, each with a value (trace pointer -> slot; thread names) -------- */

typedef struct u64map {
    uint64_t *key;
    uint32_t *val;
    uint8_t *state;   /* MAP_EMPTY, MAP_FULL, MAP_GONE (a removed key: probing goes past it) */
    size_t cap, used; /* used counts full and gone slots: what probing must step over */
} u64map_t;

enum { MAP_EMPTY, MAP_FULL, MAP_GONE };

static size_t map_home(const u64map_t *m, uint64_t k)
{
    k ^= k >> 33; /* pointers share their low bits: mix before taking them (murmur3's fmix64) */
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (size_t)k & (m->cap - 1);
}

/* The slot holding k, or the empty slot where it would go (cap is a power of two and never
 * full, so probing ends). */
static size_t map_find(const u64map_t *m, uint64_t k, bool *found)
{
    size_t i = map_home(m, k), gone = SIZE_MAX;
    for (;; i = (i + 1) & (m->cap - 1)) {
        if (m->state[i] == MAP_EMPTY) {
            *found = false;
            return gone != SIZE_MAX ? gone : i;
        }
        if (m->state[i] == MAP_GONE && gone == SIZE_MAX)
            gone = i;
        else if (m->state[i] == MAP_FULL && m->key[i] == k) {
            *found = true;
            return i;
        }
    }
}

static void map_init(u64map_t *m, size_t cap)
{
    *m = (u64map_t){.cap = cap};
    m->key = calloc(cap, sizeof *m->key);
    m->val = calloc(cap, sizeof *m->val);
    m->state = calloc(cap, 1);
    if (!m->key || !m->val || !m->state) {
        fprintf(stderr, "trace_sim: out of memory\n");
        exit(1);
    }
}

static void map_free(u64map_t *m)
{
    free(m->key);
    free(m->val);
    free(m->state);
}

static void map_put(u64map_t *m, uint64_t k, uint32_t v);

/* Rehashes into a table twice the live keys' need, dropping the gone slots. */
static void map_grow(u64map_t *m)
{
    u64map_t old = *m;
    size_t live = 0;
    for (size_t i = 0; i < old.cap; i++)
        live += old.state[i] == MAP_FULL;
    size_t cap = old.cap;
    while (cap < 4 * (live + 1))
        cap *= 2;
    map_init(m, cap);
    for (size_t i = 0; i < old.cap; i++)
        if (old.state[i] == MAP_FULL)
            map_put(m, old.key[i], old.val[i]);
    map_free(&old);
}

/* Sets k's value, adding k if new. */
static void map_put(u64map_t *m, uint64_t k, uint32_t v)
{
    bool found;
    size_t i = map_find(m, k, &found);
    if (!found) {
        if (m->state[i] == MAP_EMPTY && 2 * (m->used + 1) > m->cap) {
            map_grow(m);
            map_put(m, k, v);
            return;
        }
        m->used += m->state[i] == MAP_EMPTY;
        m->state[i] = MAP_FULL;
        m->key[i] = k;
    }
    m->val[i] = v;
}

static bool map_get(const u64map_t *m, uint64_t k, uint32_t *v)
{
    bool found;
    size_t i = map_find(m, k, &found);
    if (found)
        *v = m->val[i];
    return found;
}

static void map_remove(u64map_t *m, uint64_t k)
{
    bool found;
    size_t i = map_find(m, k, &found);
    if (found)
        m->state[i] = MAP_GONE;
}

static size_t map_count(const u64map_t *m)
{
    size_t n = 0;
    for (size_t i = 0; i < m->cap; i++)
        n += m->state[i] == MAP_FULL;
    return n;
}

/* ---- the trace (replay.cu's load_trace) --------------------------------------------------- */

typedef struct event {
    uint32_t slot; /* replay slot: one per live block of the trace */
    bool alloc;
    size_t size;     /* bytes (allocations) */
    uint64_t t_ns;   /* the Time column ("[HH:]MM:SS.frac" or seconds; 0 when unreadable) */
    unsigned thread; /* the trace's thread, numbered in order of first appearance */
} event_t;

typedef struct trace {
    event_t *ev;
    size_t nev, ev_cap;
    uint32_t nslots;
    size_t allocs, frees, failures, unmatched_frees, reused_live, size_mismatch, zero_size,
        malformed, unknown_action;
    size_t threads, live_at_end, live_bytes_at_end;
    size_t peak_requested, peak_event, total_requested;
} trace_t;

static void trace_push(trace_t *t, event_t e)
{
    if (t->nev == t->ev_cap) {
        t->ev_cap = t->ev_cap ? 2 * t->ev_cap : 4096;
        t->ev = realloc(t->ev, t->ev_cap * sizeof *t->ev);
        if (!t->ev) {
            fprintf(stderr, "trace_sim: out of memory\n");
            exit(1);
        }
    }
    t->ev[t->nev++] = e;
}

/* s with the blanks of both ends cut off, in place. */
static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t' || *s == '\r' || *s == '\n')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r' || s[n - 1] == '\n'))
        s[--n] = 0;
    return s;
}

/* Splits line at its commas, in place, into at most MAX_FIELDS trimmed fields. */
static int split(char *line, char **f)
{
    int n = 0;
    for (;;) {
        char *comma = strchr(line, ',');
        if (comma)
            *comma = 0;
        if (n < MAX_FIELDS)
            f[n++] = trim(line);
        if (!comma)
            return n;
        line = comma + 1;
    }
}

static bool parse_u64(const char *s, int base, uint64_t *out)
{
    if (!*s)
        return false;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, base);
    if (errno || *end || s[0] == '-')
        return false;
    *out = v;
    return true;
}

static bool parse_ptr(const char *s, uint64_t *out)
{
    if (!*s || strcasecmp(s, "(nil)") == 0 || strcasecmp(s, "nil") == 0 ||
        strcasecmp(s, "null") == 0 || strcmp(s, "0") == 0) {
        *out = 0;
        return true;
    }
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X'))
        s += 2;
    return parse_u64(s, 16, out);
}

/* FNV-1a: the trace's threads are counted by their names' hashes (a count only). */
static uint64_t hash_name(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

/* The Time column in nanoseconds: "[[HH:]MM:]SS[.frac]" (RMM's logger writes HH:MM:SS.ffffff);
 * 0 when it does not read as that. */
static uint64_t parse_time_ns(const char *f)
{
    double secs = 0;
    const char *p = f;
    for (int part = 0; part < 3; part++) {
        char *end;
        double v = strtod(p, &end);
        if (end == p)
            return 0;
        secs = secs * 60 + v;
        if (*end != ':')
            return *end ? 0 : (uint64_t)(secs * 1e9);
        p = end + 1;
    }
    return 0;
}

static bool load_trace(const char *path, trace_t *t)
{
    FILE *in = fopen(path, "r");
    if (!in) {
        fprintf(stderr, "trace_sim: cannot open %s: %s\n", path, strerror(errno));
        return false;
    }
    int c_thread = 0, c_time = 1, c_action = 2, c_ptr = 3, c_size = 4;
    u64map_t live, threads; /* trace pointer -> slot; names */
    map_init(&live, 1024);
    map_init(&threads, 64);
    size_t *slot_size = NULL, slot_cap = 0;
    char *buf = NULL, *copy = NULL;
    size_t buf_len = 0;
    size_t lineno = 0, requested = 0;
    bool first = true;
    int warned = 0;
    while (getline(&buf, &buf_len, in) >= 0) {
        ++lineno;
        free(copy);
        copy = strdup(buf); /* the line as read, for warnings (split cuts buf up) */
        char *l = trim(buf);
        if (!copy || !*l || l[0] == '#')
            continue;
        char *f[MAX_FIELDS];
        int nf = split(l, f);
#define WARN(what)                                                                                 \
    do {                                                                                           \
        if (warned++ < 5)                                                                          \
            fprintf(stderr, "trace_sim: %s:%zu: %s: %s", path, lineno, what, copy);                \
    } while (0)
        if (first) {
            first = false;
            if (strcasecmp(f[0], "thread") == 0) {
                for (int i = 0; i < nf; i++) {
                    if (strcasecmp(f[i], "thread") == 0)
                        c_thread = i;
                    else if (strcasecmp(f[i], "time") == 0)
                        c_time = i;
                    else if (strcasecmp(f[i], "action") == 0)
                        c_action = i;
                    else if (strcasecmp(f[i], "pointer") == 0)
                        c_ptr = i;
                    else if (strcasecmp(f[i], "size") == 0)
                        c_size = i;
                }
                continue;
            }
        }
        int need = c_thread > c_time ? c_thread : c_time; /* a line needs every column */
        need = need > c_action ? need : c_action;
        need = need > c_ptr ? need : c_ptr;
        need = need > c_size ? need : c_size;
        if (nf <= need) {
            t->malformed++;
            WARN("too few columns");
            continue;
        }
        uint64_t ptr = 0, size = 0;
        if (!parse_ptr(f[c_ptr], &ptr) || !parse_u64(f[c_size], 10, &size)) {
            t->malformed++;
            WARN("bad pointer or size");
            continue;
        }
        uint32_t thread;
        if (!map_get(&threads, hash_name(f[c_thread]), &thread)) {
            thread = (uint32_t)map_count(&threads);
            map_put(&threads, hash_name(f[c_thread]), thread);
        }
        const uint64_t t_ns = parse_time_ns(f[c_time]);
        const char *action = f[c_action];
        uint32_t slot;
        if (strcasecmp(action, "allocate") == 0) {
            if (size == 0 || ptr == 0) {
                t->zero_size++; /* nothing to replay: cudaMalloc(0) allocates nothing */
                continue;
            }
            if (map_get(&live, ptr, &slot)) { /* the free was not logged: free the older first */
                t->reused_live++;
                trace_push(t, (event_t){slot, false, 0, t_ns, thread});
                t->frees++;
                requested -= slot_size[slot];
                map_remove(&live, ptr);
            }
            if (t->nslots == UINT32_MAX) {
                fprintf(stderr, "trace_sim: %s: too many allocations\n", path);
                exit(1);
            }
            slot = t->nslots++;
            if (slot == slot_cap) {
                slot_cap = slot_cap ? 2 * slot_cap : 4096;
                slot_size = realloc(slot_size, slot_cap * sizeof *slot_size);
                if (!slot_size) {
                    fprintf(stderr, "trace_sim: out of memory\n");
                    exit(1);
                }
            }
            slot_size[slot] = size;
            map_put(&live, ptr, slot);
            trace_push(t, (event_t){slot, true, size, t_ns, thread});
            t->allocs++;
            requested += size;
            t->total_requested += size;
            if (requested > t->peak_requested) {
                t->peak_requested = requested;
                t->peak_event = t->nev - 1;
            }
        } else if (strcasecmp(action, "free") == 0 || strcasecmp(action, "deallocate") == 0) {
            if (ptr == 0)
                continue; /* freeing NULL: nothing */
            if (!map_get(&live, ptr, &slot)) {
                t->unmatched_frees++;
                continue;
            }
            if (slot_size[slot] != size)
                t->size_mismatch++;
            trace_push(t, (event_t){slot, false, 0, t_ns, thread});
            t->frees++;
            requested -= slot_size[slot];
            map_remove(&live, ptr);
        } else if (strncasecmp(action, "allocate failure", 16) == 0 ||
                   strcasecmp(action, "allocate_failure") == 0) {
            t->failures++;
        } else {
            t->unknown_action++;
            WARN("unknown action");
        }
#undef WARN
    }
    bool ok = !ferror(in);
    if (!ok)
        fprintf(stderr, "trace_sim: reading %s failed\n", path);
    fclose(in);
    t->threads = map_count(&threads);
    t->live_at_end = map_count(&live);
    t->live_bytes_at_end = requested;
    if (warned > 5)
        fprintf(stderr, "trace_sim: %d more warnings not shown\n", warned - 5);
    map_free(&live);
    map_free(&threads);
    free(slot_size);
    free(buf);
    free(copy);
    return ok;
}

static void print_trace(const char *path, const trace_t *t)
{
    printf("trace %s\n", path);
    printf("  events %zu (allocate %zu, free %zu); threads %zu\n", t->nev, t->allocs, t->frees,
           t->threads);
    printf("  peak requested %zu bytes (%.2f MiB) at event %zu; total requested %.2f MiB\n",
           t->peak_requested, (double)t->peak_requested / MiB, t->peak_event,
           (double)t->total_requested / MiB);
    printf("  live at end %zu (%zu bytes); allocate failures %zu; unmatched frees %zu; "
           "allocates of a live pointer %zu; free size mismatches %zu; empty allocates %zu; "
           "malformed lines %zu; unknown actions %zu\n",
           t->live_at_end, t->live_bytes_at_end, t->failures, t->unmatched_frees, t->reused_live,
           t->size_mismatch, t->zero_size, t->malformed, t->unknown_action);
}

/* ---- replaying ---------------------------------------------------------------------------- */

/* The library's counter of that name, or -1 where this build of the library has none (the
 * probe is built against older commits to compare: park_waits came in c7675df). */
static int counter_index(const char *name)
{
#define COUNTER_NAME(n, help) #n,
    static const char *const names[] = {VMH_COUNTERS(COUNTER_NAME)};
#undef COUNTER_NAME
    for (int i = 0; i < (int)VMH_COUNTER_COUNT; i++)
        if (strcmp(names[i], name) == 0)
            return i;
    return -1;
}

/* What one replay of the trace did. */
/* --tidy-by-time: the reclaim thread's tidy replayed at the trace's own pace (its Time column),
 * so that what the tidy gives back during a load, and maps again, is in the figures. */
static bool tidy_by_time;

typedef struct replay_figures {
    size_t events, allocations;
    double driver_calls, vmm_calls, syncs, syncs_blocking, park_waits, cache_hits;
    double app_driver_calls;             /* made on the replaying thread: the allocation path's */
    int64_t peak_mapped, peak_requested; /* the gauges read after every event */
    /* After the last replay's last event, its live blocks still live, three windows of the tidy
     * run (what the reclaim thread does within seconds of a load's end; vmh_heap_tidy_now; its
     * calls in no replay's figures); 0 for the other replays (the next replay would start from
     * the tidied heap): */
    int64_t settled_mapped, settled_requested;
    bool failed;
} replay_figures_t;

typedef struct replayer {
    const trace_t *t;
    CUdeviceptr *slot;
    probe_snapshot_t before, after;
    int park_waits; /* counter_index("park_waits") */
    int64_t peak_mapped, peak_requested;
    bool settle; /* the last replay: the tidy's windows run after it (replay_figures_t) */
    bool failed;
} replayer_t;

static void note_gauges(replayer_t *r)
{
    int64_t m = vmh_gauge_get(VMH_STAT_bytes_mapped), q = vmh_gauge_get(VMH_STAT_bytes_requested);
    r->peak_mapped = m > r->peak_mapped ? m : r->peak_mapped;
    r->peak_requested = q > r->peak_requested ? q : r->peak_requested;
}

static void release(replayer_t *r, uint32_t s, size_t at)
{
    if (!r->slot[s])
        return; /* its allocation failed */
    CUresult e = vmh_heap_free(r->slot[s], NULL, false);
    if (e != CUDA_SUCCESS) {
        fprintf(stderr, "trace_sim: event %zu: free: error %d\n", at, (int)e);
        r->failed = true;
    }
    r->slot[s] = 0;
}

static replay_figures_t replay_once(replayer_t *r)
{
    const trace_t *t = r->t;
    replay_figures_t f = {.events = t->nev};
    r->peak_mapped = r->peak_requested = 0;
    note_gauges(r);
    probe_snap(&r->before);
    uint64_t tidied = t->nev ? t->ev[0].t_ns : 0, window = tidied;
    for (size_t i = 0; i < t->nev; i++) {
        const event_t *e = &t->ev[i];
        /* The reclaim thread's pace in the trace's own time (heap_upkeep.c: a tidy every 50 ms
         * at most, a new window of the recent peak every second). */
        if (tidy_by_time && e->t_ns >= tidied + VMH_TIDY_EVERY_NS) {
            bool new_window = e->t_ns >= window + VMH_TIDY_WINDOW_NS;
            if (new_window)
                window = e->t_ns;
            tidied = e->t_ns;
            vmh_heap_tidy_now(0, new_window);
        }
        /* The carved shard the trace's thread would have taken (carved_place.c picks one per
         * thread, in order of their first allocations). */
        vmh_thread.shard_mine = e->thread % VMH_CLASS_SHARDS + 1;
        if (e->alloc) {
            CUresult res = vmh_heap_alloc(e->size, &r->slot[e->slot]);
            f.allocations++;
            if (res != CUDA_SUCCESS) {
                fprintf(stderr, "trace_sim: event %zu: allocate %zu bytes: error %d\n", i, e->size,
                        (int)res);
                r->slot[e->slot] = 0;
                r->failed = true;
            }
        } else {
            release(r, e->slot, i);
        }
        note_gauges(r);
    }
    /* The last replay's live blocks are freed after its figures and the tidy's windows
     * (run_one). */
    for (uint32_t s = 0; !r->settle && s < t->nslots; s++)
        release(r, s, t->nev);
    probe_snap(&r->after);
    size_t nentries = sim_entry_count();
    uint64_t vmm = 0, syncs = 0;
    for (size_t i = 0; i < nentries; i++) {
        uint64_t n = r->after.sim[i] - r->before.sim[i];
        if (probe_is_vmm_call(sim_entry_name(i)))
            vmm += n;
        if (probe_is_sync_call(sim_entry_name(i)))
            syncs += n;
    }
#define DELTA(i) ((double)(r->after.counters[i] - r->before.counters[i]))
    f.driver_calls = DELTA(VMH_STAT_driver_calls);
    f.app_driver_calls = f.driver_calls - DELTA(VMH_STAT_driver_calls_background);
    f.cache_hits = DELTA(VMH_STAT_cache_hits);
    f.syncs_blocking = DELTA(VMH_STAT_syncs_blocking);
    f.park_waits = r->park_waits >= 0 ? DELTA(r->park_waits) : (double)NAN;
#undef DELTA
    f.vmm_calls = (double)vmm;
    f.syncs = (double)syncs;
    f.peak_mapped = r->peak_mapped;
    f.peak_requested = r->peak_requested;
    f.failed = r->failed;
    return f;
}

static bool quiet;
static bool reclaim_thread = true;

/* Prints the simulated driver's calls by entry point: the first replay's and, with later
 * replays, their mean per replay. */
static void print_entry_points(const unsigned long *first, const unsigned long *later, int nlater)
{
    printf("## simulated driver calls by entry point (first run)\n");
    printf("   %-34s %12s %20s\n", "entry point", "replay 1", nlater ? "later, per replay" : "");
    for (size_t i = 0; i < sim_entry_count(); i++) {
        if (!first[i] && !later[i])
            continue;
        printf("   %-34s %12lu", sim_entry_name(i), first[i]);
        if (nlater)
            printf(" %20.1f", (double)later[i] / nlater);
        printf("\n");
    }
}

/* One run from a fresh heap: the trace replayed nrep times; figures per replay into fig. The
 * run's gauge peaks into *run_peak_mapped, *run_peak_requested. Returns false on a failure. */
static bool run_one(const trace_t *t, int nrep, bool print_calls, replay_figures_t *fig,
                    int64_t *run_peak_mapped, int64_t *run_peak_requested)
{
    probe_heap_reset("trace_sim", reclaim_thread);
    sim_set_current_device(0); /* as cudart makes the primary context current */
    replayer_t r = {.t = t, .park_waits = counter_index("park_waits")};
    r.slot = calloc(t->nslots ? t->nslots : 1, sizeof *r.slot);
    assert(r.slot);
    probe_snapshot_init(&r.before);
    probe_snapshot_init(&r.after);
    size_t nentries = sim_entry_count();
    unsigned long *first = calloc(nentries, sizeof *first);
    unsigned long *later = calloc(nentries, sizeof *later);
    assert(first && later);
    bool ok = true;
    for (int k = 0; k < nrep; k++) {
        r.settle = k == nrep - 1;
        fig[k] = replay_once(&r);
        ok &= !fig[k].failed;
        for (size_t i = 0; i < nentries; i++)
            (k == 0 ? first : later)[i] += r.after.sim[i] - r.before.sim[i];
    }
    for (int w = 0; w < 3; w++)
        vmh_heap_tidy_now(0, true);
    fig[nrep - 1].settled_mapped = vmh_gauge_get(VMH_STAT_bytes_mapped);
    fig[nrep - 1].settled_requested = vmh_gauge_get(VMH_STAT_bytes_requested);
    for (uint32_t s = 0; s < t->nslots; s++)
        release(&r, s, t->nev);
    *run_peak_mapped = vmh_gauge_peak(VMH_STAT_bytes_mapped);
    *run_peak_requested = vmh_gauge_peak(VMH_STAT_bytes_requested);
    if (print_calls && !quiet)
        print_entry_points(first, later, nrep - 1);
    free(first);
    free(later);
    probe_snapshot_free(&r.before);
    probe_snapshot_free(&r.after);
    free(r.slot);
    ok &= probe_heap_finish("trace_sim");
    return ok;
}

/* ---- the table ---------------------------------------------------------------------------- */

/* The figures of the table, in its column order (f: one replay's figures). */
#define COLUMNS(X)                                                                                 \
    X("events", "%.0f", (double)f->events)                                                         \
    X("allocations", "%.0f", (double)f->allocations)                                               \
    X("driver calls", "%.1f", f->driver_calls)                                                     \
    X("app calls / alloc", "%.3f", f->app_driver_calls / (double)f->allocations)                   \
    X("of them VMM", "%.1f", f->vmm_calls)                                                         \
    X("syncs", "%.1f", f->syncs)                                                                   \
    X("blocking syncs", "%.1f", f->syncs_blocking)                                                 \
    X("park waits", "%.1f", f->park_waits)                                                         \
    X("cache hits", "%.1f", f->cache_hits)                                                         \
    X("peak mapped MiB", "%.1f", (double)f->peak_mapped / MiB)                                     \
    X("peak requested MiB", "%.1f", (double)f->peak_requested / MiB)                               \
    X("mapped / requested", "%.3f", (double)f->peak_mapped / (double)f->peak_requested)            \
    X("settled mapped MiB", "%.1f", (double)f->settled_mapped / MiB)                               \
    X("settled requested MiB", "%.1f", (double)f->settled_requested / MiB)

/* The mean of replays [from, to) of one run, as one replay's figures (peaks: their mean). */
static replay_figures_t mean_of(const replay_figures_t *fig, int from, int to)
{
    replay_figures_t m = {0};
    double n = to - from, mapped = 0, requested = 0, events = 0, allocations = 0;
    double settled_mapped = 0, settled_requested = 0;
    for (int k = from; k < to; k++) {
        const replay_figures_t *f = &fig[k];
        events += (double)f->events;
        allocations += (double)f->allocations;
        m.driver_calls += f->driver_calls / n;
        m.app_driver_calls += f->app_driver_calls / n;
        m.vmm_calls += f->vmm_calls / n;
        m.syncs += f->syncs / n;
        m.syncs_blocking += f->syncs_blocking / n;
        m.park_waits += f->park_waits / n;
        m.cache_hits += f->cache_hits / n;
        mapped += (double)f->peak_mapped;
        requested += (double)f->peak_requested;
        settled_mapped += (double)f->settled_mapped;
        settled_requested += (double)f->settled_requested;
    }
    m.events = (size_t)(events / n + 0.5);
    m.allocations = (size_t)(allocations / n + 0.5);
    m.peak_mapped = (int64_t)(mapped / n + 0.5);
    m.peak_requested = (int64_t)(requested / n + 0.5);
    m.settled_mapped = (int64_t)(settled_mapped / n + 0.5);
    m.settled_requested = (int64_t)(settled_requested / n + 0.5);
    return m;
}

/* A markdown row: one replay's figures over the runs (fig[run * stride]). */
static void print_row(const char *label, const replay_figures_t *fig, int runs, int stride)
{
    printf("| %s |", label);
#define PRINT_COLUMN(title, fmt, expr)                                                             \
    {                                                                                              \
        const replay_figures_t *f;                                                                 \
        PROBE_PRINT_RANGE(fmt, runs, (f = &fig[k * stride], (expr)));                              \
    }
    COLUMNS(PRINT_COLUMN)
#undef PRINT_COLUMN
    printf("\n");
}

/* fig[run * nrep + replay]. */
static void print_table(const replay_figures_t *fig, int runs, int nrep)
{
#define PRINT_TITLE(title, fmt, expr) printf(" %s |", title);
#define PRINT_RULE(title, fmt, expr) printf(" --- |");
    printf("\n| replay |");
    COLUMNS(PRINT_TITLE)
    printf("\n| --- |");
    COLUMNS(PRINT_RULE)
    printf("\n");
#undef PRINT_TITLE
#undef PRINT_RULE
    char label[32];
    for (int k = 0; k < nrep; k++) {
        snprintf(label, sizeof label, "%d", k + 1);
        print_row(label, &fig[k], runs, nrep);
    }
    if (nrep > 2) {
        replay_figures_t *mean = calloc((size_t)runs, sizeof *mean);
        assert(mean);
        for (int k = 0; k < runs; k++)
            mean[k] = mean_of(&fig[k * nrep], 1, nrep);
        snprintf(label, sizeof label, "2-%d, per replay", nrep);
        print_row(label, mean, runs, 1);
        free(mean);
    }
}

/* ---- command line ------------------------------------------------------------------------- */

static void usage(void)
{
    fprintf(stderr, "usage: trace_sim [--repeat-trace 1] [--runs 1] [--no-reclaim-thread] "
                    "[--tidy-by-time] [--quiet] TRACE.csv\n");
    exit(2);
}

int main(int argc, char **argv)
{
    long nrep = 1, runs = 1;
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--repeat-trace") == 0 && v) {
            nrep = strtol(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--runs") == 0 && v) {
            runs = strtol(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--no-reclaim-thread") == 0) {
            reclaim_thread = false;
        } else if (strcmp(a, "--tidy-by-time") == 0) {
            tidy_by_time = true;
        } else if (strcmp(a, "--quiet") == 0) {
            quiet = true;
        } else if (a[0] != '-' && !path) {
            path = a;
        } else {
            usage();
        }
    }
    if (!path || nrep < 1 || nrep > MAX_REPLAYS || runs < 1 || runs > MAX_RUNS)
        usage();

    trace_t t = {0};
    if (!load_trace(path, &t))
        return 1;
    vmh_options_t env;
    vmh_options_apply(&env, vmh_options_env_get, NULL);
    printf("trace_sim: the trace replayed through the heap on the simulated driver, %ld time(s) "
           "back to back, %ld run(s) from a fresh heap; VMMHOOK_CACHE_LIMIT %zu MiB, "
           "VMMHOOK_PARK_LIMIT %zu MiB, VMMHOOK_PACK_BELOW %zu MiB; reclaim thread %s\n",
           nrep, runs, env.cache_limit / MiB, env.park_limit / MiB, env.pack_below / MiB,
           reclaim_thread ? "on (syncs are instant here)" : "off");
    print_trace(path, &t);

    replay_figures_t *fig = calloc((size_t)(runs * nrep), sizeof *fig);
    assert(fig);
    bool ok = true;
    int64_t run_mapped_lo = 0, run_mapped_hi = 0, run_requested = 0;
    for (int k = 0; k < runs; k++) {
        int64_t mapped, requested;
        ok &= run_one(&t, (int)nrep, k == 0, &fig[k * nrep], &mapped, &requested);
        run_mapped_lo = k == 0 || mapped < run_mapped_lo ? mapped : run_mapped_lo;
        run_mapped_hi = k == 0 || mapped > run_mapped_hi ? mapped : run_mapped_hi;
        run_requested = requested > run_requested ? requested : run_requested;
        /* The replays' peaks, read after each event, stay within the gauges' own. */
        for (int j = 0; j < nrep; j++)
            assert(fig[k * nrep + j].peak_mapped <= mapped &&
                   fig[k * nrep + j].peak_requested <= requested);
    }
    print_table(fig, (int)runs, (int)nrep);
    char c[64];
    probe_cell(c, sizeof c, "%.1f", (double)run_mapped_lo / MiB, (double)run_mapped_hi / MiB);
    printf("\nthe gauges' peaks over a whole run: bytes_mapped %s MiB, bytes_requested %.1f MiB "
           "(the trace's peak requested: %.1f MiB)\n",
           c, (double)run_requested / MiB, (double)t.peak_requested / MiB);
    free(fig);
    free(t.ev);
    return ok ? 0 : 1;
}
