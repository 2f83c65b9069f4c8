/* Layer "utilities": counters and gauges, the allocation trace, the exit reports (table, JSON,
 * leaks).
 *
 * Counters are relaxed atomics sharded by thread (summed on read), gauges relaxed atomics each
 * on its own cache line: they are bumped on every served call from every thread, and a shared
 * line would make them the contention point. Only totals matter, never the order between two
 * counters, hence relaxed.
 *
 * Files (trace, its gauges companion, JSON) are created owner-only (0600): a trace holds
 * addresses and sizes of the program's memory. Nothing here allocates or uses stdio; lines are
 * formatted on the stack and written with one write(2) each, and errno is preserved for the
 * interposed callers. */
#include "stats.h"

#include <assert.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "optparse.h"
#include "testable.h"
#include "vmmhook.h"

/* ---- counters and gauges ---------------------------------------------------------------- */

/* Counters are sharded by thread: every served call, and the lookups inside dlsym and
 * cuGetProcAddress, bump one, and a single shared line per counter made them the point where
 * all threads met (many threads ran slower than one). Each thread adds to the shard it
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
/* The calling thread's number (vmh_thread_shard) plus one; 0: none given yet. */
static __thread unsigned tl_shard __attribute__((tls_model("initial-exec")));
static gauge_slot_t gauges[VMH_GAUGE_COUNT];

#define VMH_NAME_ITEM(name, help) #name,
#define VMH_HELP_ITEM(name, help) help,
_Thread_local bool vmh_stats_background_thread;

static const char *const counter_names[] = {VMH_COUNTERS(VMH_NAME_ITEM)};
static const char *const counter_help[] = {VMH_COUNTERS(VMH_HELP_ITEM)};
static const char *const gauge_names[] = {VMH_GAUGES(VMH_NAME_ITEM)};
static const char *const gauge_help[] = {VMH_GAUGES(VMH_HELP_ITEM)};
#undef VMH_NAME_ITEM
#undef VMH_HELP_ITEM

unsigned vmh_thread_shard(void)
{
    unsigned s = tl_shard;
    if (__builtin_expect(s == 0, 0)) {
        /* Never 0 again: the count wraps only after 2^32 threads, skipping 0. */
        do
            s = atomic_fetch_add_explicit(&next_shard, 1, memory_order_relaxed) + 1;
        while (s == 0);
        tl_shard = s;
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

/* ---- private files ---------------------------------------------------------------------- */

/* The configuration, from vmh_stats_configure (the front's settings for this file; it never
 * reads the options). Written once before any event, read without a lock after:
 * the front configures inside its one-time start, which every traced call has passed. */
static struct {
    bool stats;               /* the table at exit */
    bool leaks;               /* list leaks at exit */
    char trace[VMH_PATH_MAX]; /* path template ("" = no trace) */
    char json[VMH_PATH_MAX];  /* path template ("" = no JSON) */
    vmh_refuse_fn refuse;     /* a trace file that cannot be made */
} cfg;

/* Who owns the process's files: geteuid in the library; a test pretends to be another user. */
VMH_TESTABLE uid_t (*vmh_stats_euid)(void) = geteuid;

/* Opens an existing path for writing and checks it before anything is changed: a regular
 * file owned by us. -1 and why otherwise (errno ENOENT: it vanished, the caller creates it). */
static int open_existing(const char *path, int flags, char *why, size_t whylen)
{
    char err[128];
    /* O_NONBLOCK: opening a FIFO for writing would wait for a reader forever; with it the open
     * fails (ENXIO) or succeeds at once, and the type check below refuses it either way. */
    int fd = open(path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | flags);
    if (fd < 0) {
        int e = errno;
        if (e == ENXIO)
            snprintf(why, whylen, "it is not a regular file (a FIFO or socket)");
        else if (e == ELOOP)
            snprintf(why, whylen, "it is a symbolic link");
        else
            snprintf(why, whylen, "cannot open it: %s", strerror_r(e, err, sizeof(err)));
        errno = e;
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(why, whylen, "cannot examine it: %s", strerror_r(errno, err, sizeof(err)));
        close(fd);
        errno = EIO;
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(why, whylen, "it is not a regular file");
        close(fd);
        errno = EINVAL;
        return -1;
    }
    /* A file of another user is never truncated or made ours, even by root: a program run as
     * root with VMMHOOK_TRACE=/home/alice/x must not destroy alice's file. */
    if (st.st_uid != vmh_stats_euid()) {
        snprintf(why, whylen, "it belongs to uid %u, not to this process's uid %u",
                 (unsigned)st.st_uid, (unsigned)vmh_stats_euid());
        close(fd);
        errno = EPERM;
        return -1;
    }
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, 0) != 0) {
        snprintf(why, whylen, "cannot make it owner-only and empty: %s",
                 strerror_r(errno, err, sizeof(err)));
        close(fd);
        errno = EIO;
        return -1;
    }
    /* A regular file: O_NONBLOCK did its job (no wait at the open) and means nothing for its
     * writes; cleared all the same, keeping O_APPEND. */
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    return fd;
}

/* Opens an output file (trace, its gauges, JSON) for writing, owner-only: a new file is
 * created 0600; an existing one must be a regular file of ours, and is made 0600 and emptied
 * only after that check. Anything else is refused with why: a symbolic link as the last
 * component (O_NOFOLLOW: a link planted in a shared /tmp cannot redirect the write), a FIFO (it
 * would block the program), a device, another user's file. */
static int open_private(const char *path, int flags, char *why, size_t whylen)
{
    char err[128];
    for (int attempt = 0; attempt < 3; attempt++) {
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW | flags, 0600);
        if (fd >= 0)
            return fd; /* ours, new, empty */
        if (errno != EEXIST) {
            snprintf(why, whylen, "cannot create it: %s", strerror_r(errno, err, sizeof(err)));
            return -1;
        }
        fd = open_existing(path, flags, why, whylen);
        if (fd >= 0 || errno != ENOENT)
            return fd;
        /* Removed between the two opens: try again. */
    }
    snprintf(why, whylen, "it keeps appearing and vanishing");
    return -1;
}

static bool write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return false;
        }
        p += w;
        n -= (size_t)w;
    }
    return true;
}

/* ---- trace -------------------------------------------------------------------------------- */

enum { TRACE_UNOPENED, TRACE_OPEN, TRACE_OFF };

static pthread_mutex_t trace_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int trace_state = TRACE_UNOPENED;
static int trace_fd = -1;        /* published by trace_state = TRACE_OPEN (release) */
static int gauges_fd = -1;       /* likewise; -1 when there is no companion file */
static struct timespec trace_t0; /* likewise */

static const char trace_header[] = "Thread,Time,Action,Pointer,Size,Stream\n";
static const char gauges_header[] = "Time,Requested,Mapped,Reserved,Cached\n";

/* Opens path like the trace (0600, no symbolic link, O_APPEND) and writes header; -1 and why
 * on failure. */
static int trace_file_open(const char *path, const char *header, size_t hlen, char *why,
                           size_t whylen)
{
    /* O_APPEND: each line's single write lands whole at the end, whatever other threads (or a
     * forked child sharing the descriptor) write meanwhile. */
    int fd = open_private(path, O_APPEND, why, whylen);
    if (fd >= 0 && !write_all(fd, header, hlen)) {
        char err[128];
        snprintf(why, whylen, "cannot write to it: %s", strerror_r(errno, err, sizeof(err)));
        close(fd);
        fd = -1;
    }
    return fd;
}

/* The companion "<trace>.gauges.csv", for a trace that is a regular file (a trace sent to a
 * device or FIFO, VMMHOOK_TRACE=/dev/stderr, has none). A companion that cannot be made costs
 * one warning (with VMMHOOK_STRICT, the program stops); the trace goes on without it. */
static int gauges_open_locked(int tfd, const char *trace_path)
{
    struct stat st;
    if (fstat(tfd, &st) != 0 || !S_ISREG(st.st_mode))
        return -1;
    char path[VMH_PATH_MAX + sizeof(VMH_TRACE_GAUGES_SUFFIX)];
    snprintf(path, sizeof(path), "%s%s", trace_path, VMH_TRACE_GAUGES_SUFFIX);
    char why[256], sub[160];
    int fd = trace_file_open(path, gauges_header, sizeof(gauges_header) - 1, sub, sizeof(sub));
    if (fd < 0) {
        snprintf(why, sizeof(why), "its gauges file, the path + \"%s\": %s",
                 VMH_TRACE_GAUGES_SUFFIX, sub);
        cfg.refuse("VMMHOOK_TRACE", why, "the trace without gauges");
    }
    return fd;
}

static void trace_open_locked(void)
{
    char why[200], path[VMH_PATH_MAX];
    int fd = -1;
    if (!vmh_expand_path(cfg.trace, (long)getpid(), path, sizeof(path)))
        snprintf(why, sizeof(why), "longer than %zu bytes once %%p is replaced", sizeof(path) - 1);
    else
        fd = trace_file_open(path, trace_header, sizeof(trace_header) - 1, why, sizeof(why));
    if (fd < 0) {
        atomic_store_explicit(&trace_state, TRACE_OFF, memory_order_release);
        cfg.refuse("VMMHOOK_TRACE", why, "no trace");
        return;
    }
    gauges_fd = gauges_open_locked(fd, path);
    clock_gettime(CLOCK_MONOTONIC, &trace_t0);
    trace_fd = fd;
    atomic_store_explicit(&trace_state, TRACE_OPEN, memory_order_release);
}

/* The trace descriptor, opening the file on first use; -1 when tracing is off. */
static int trace_get(void)
{
    int st = atomic_load_explicit(&trace_state, memory_order_acquire);
    if (st == TRACE_UNOPENED) {
        pthread_mutex_lock(&trace_lock);
        if (atomic_load_explicit(&trace_state, memory_order_relaxed) == TRACE_UNOPENED)
            trace_open_locked();
        pthread_mutex_unlock(&trace_lock);
        st = atomic_load_explicit(&trace_state, memory_order_acquire);
    }
    return st == TRACE_OPEN ? trace_fd : -1;
}

static _Atomic(vmh_stats_table_fn) tag_table;
static _Atomic(vmh_stats_json_fn) tag_json;

void vmh_stats_set_tag_report(vmh_stats_table_fn table, vmh_stats_json_fn json)
{
    atomic_store(&tag_table, table);
    atomic_store(&tag_json, json);
}

void vmh_stats_configure(const vmh_stats_settings_t *s)
{
    assert(s->refuse != NULL);
    cfg.stats = s->stats;
    cfg.leaks = s->leaks;
    cfg.refuse = s->refuse;
    snprintf(cfg.trace, sizeof(cfg.trace), "%s", s->trace);
    snprintf(cfg.json, sizeof(cfg.json), "%s", s->json);
    if (cfg.trace[0] != '\0') {
        /* Open now: the trace clock starts with the program, and the file exists even if
         * nothing is allocated. */
        int saved = errno;
        (void)trace_get();
        errno = saved;
    }
}

/* Decimal text of v at p (no terminator); returns the end. No stdio: the event path. */
static char *put_i64(char *p, int64_t v)
{
    char tmp[24];
    int n = 0;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do {
        tmp[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u != 0);
    if (v < 0)
        *p++ = '-';
    while (n > 0)
        *p++ = tmp[--n];
    return p;
}

/* The gauges line that accompanies a trace line: its Time text, then the gauges as they are
 * now. One write, like the trace line. */
static void gauges_line(int fd, const char *time_text, size_t time_len)
{
    static const vmh_gauge_t cols[] = {VMH_STAT_bytes_requested, VMH_STAT_bytes_mapped,
                                       VMH_STAT_bytes_reserved, VMH_STAT_bytes_cached};
    char line[32 + 4 * 24];
    char *p = line;
    memcpy(p, time_text, time_len);
    p += time_len;
    for (size_t i = 0; i < sizeof(cols) / sizeof(cols[0]); i++) {
        *p++ = ',';
        p = put_i64(p, vmh_gauge_get(cols[i]));
    }
    *p++ = '\n';
    (void)write_all(fd, line, (size_t)(p - line));
}

void vmh_trace(const char *action, CUdeviceptr ptr, size_t size, CUstream stream)
{
    if (cfg.trace[0] == '\0')
        return;
    int saved = errno;
    int fd = trace_get();
    if (fd < 0) {
        errno = saved;
        return;
    }
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long ns =
        (long long)(now.tv_sec - trace_t0.tv_sec) * 1000000000LL + (now.tv_nsec - trace_t0.tv_nsec);
    unsigned long long us = ns > 0 ? (unsigned long long)ns / 1000 : 0;
    unsigned long long s = us / 1000000;

    /* Stream as RMM writes it (an ostream of the pointer in hex): "0" for NULL, else "0x...".
     * RMM's replay parser reads this column as decimal and so sees 0 for every stream, which
     * is the only stream it accepts. */
    char stream_text[24];
    if (stream == NULL)
        memcpy(stream_text, "0", 2);
    else
        snprintf(stream_text, sizeof(stream_text), "0x%llx", (unsigned long long)(uintptr_t)stream);

    /* Time as RMM's pattern "%H:%M:%S.%f" (microseconds), counted from the trace's start on
     * the monotonic clock: no time zone lookup (which could allocate or take locks inside the
     * driver) and no jump at midnight. Hours keep counting past 24. */
    char time_text[48];
    int tn = snprintf(time_text, sizeof(time_text), "%02llu:%02llu:%02llu.%06llu", s / 3600,
                      (s / 60) % 60, s % 60, us % 1000000);
    char line[256];
    int n = snprintf(line, sizeof(line), "%ld,%s,%s,0x%llx,%zu,%s\n", (long)syscall(SYS_gettid),
                     time_text, action, (unsigned long long)ptr, size, stream_text);
    if (n > 0 && (size_t)n < sizeof(line)) {
        (void)write_all(fd, line, (size_t)n);
        /* The same Time text as the line just written, and each gauge as it is now (read one
         * by one, relaxed: no lock on this path). Threads tracing at once may put their lines
         * in a different order in the two files; the Time of each line is its own. */
        if (gauges_fd >= 0 && tn > 0 && (size_t)tn < sizeof(time_text))
            gauges_line(gauges_fd, time_text, (size_t)tn);
    }
    errno = saved;
}

#ifdef VMH_TESTING
void vmh_trace_close(void)
{
    pthread_mutex_lock(&trace_lock);
    if (atomic_load(&trace_state) == TRACE_OPEN) {
        close(trace_fd);
        if (gauges_fd >= 0)
            close(gauges_fd);
    }
    trace_fd = -1;
    gauges_fd = -1;
    atomic_store(&trace_state, TRACE_UNOPENED);
    pthread_mutex_unlock(&trace_lock);
}
#endif

/* ---- leak report -------------------------------------------------------------------------- */

#define LEAKS_LISTED 256

static _Atomic uint64_t leak_count, leak_bytes;
static atomic_bool leak_ran;

void vmh_leak_report_begin(void)
{
    atomic_store(&leak_count, 0);
    atomic_store(&leak_bytes, 0);
    atomic_store(&leak_ran, true);
}

/* "sym+0x12 (libfoo.so)", "libfoo.so+0x1234" or the bare address. dladdr neither allocates
 * nor calls the driver, so it is safe in the destructor. */
static void describe_site(void *site, char *buf, size_t len)
{
    Dl_info info;
    if (dladdr(site, &info) == 0 || info.dli_fname == NULL) {
        snprintf(buf, len, "%p", site);
        return;
    }
    const char *file = strrchr(info.dli_fname, '/');
    file = file ? file + 1 : info.dli_fname;
    if (file[0] == '\0')
        file = "the program";
    if (info.dli_sname && info.dli_saddr)
        snprintf(buf, len, "%s+0x%lx (%s)", info.dli_sname,
                 (unsigned long)((char *)site - (char *)info.dli_saddr), file);
    else
        snprintf(buf, len, "%s+0x%lx", file,
                 (unsigned long)((char *)site - (char *)info.dli_fbase));
}

void vmh_leak_report_one(CUdeviceptr p, size_t size, int device, void *call_site)
{
    uint64_t n = atomic_fetch_add(&leak_count, 1) + 1;
    atomic_fetch_add(&leak_bytes, size);
    if (!cfg.leaks)
        return;
    if (n == 1)
        vmh_log("leak report: buffers still allocated at exit:");
    if (n > LEAKS_LISTED)
        return;
    char site[280] = "", b[32];
    if (call_site) {
        memcpy(site, "  allocated from ", 17);
        describe_site(call_site, site + 17, sizeof(site) - 17);
    }
    vmh_log("  0x%llx  %zu bytes (%s)  device %d%s", (unsigned long long)p, size,
            vmh_fmt_bytes(b, sizeof(b), size), device, site);
}

void vmh_leak_report_end(void)
{
    if (!cfg.leaks)
        return;
    uint64_t n = atomic_load(&leak_count), bytes = atomic_load(&leak_bytes);
    char b[32];
    if (n == 0) {
        vmh_log("leak report: no buffer left allocated");
        return;
    }
    vmh_log("leak report: %llu buffer%s, %s (%llu bytes) still allocated at exit%s",
            (unsigned long long)n, n == 1 ? "" : "s", vmh_fmt_bytes(b, sizeof(b), bytes),
            (unsigned long long)bytes, n > LEAKS_LISTED ? " (the first 256 listed)" : "");
}

/* ---- exit reports ------------------------------------------------------------------------- */

static atomic_bool reported;

void vmh_stats_reset(void)
{
    for (unsigned k = 0; k < VMH_STAT_SHARDS; k++)
        for (unsigned i = 0; i < VMH_COUNTER_COUNT; i++)
            atomic_store_explicit(&counter_shards[k].v[i], 0, memory_order_relaxed);
    for (unsigned i = 0; i < VMH_GAUGE_COUNT; i++) {
        atomic_store_explicit(&gauges[i].cur, 0, memory_order_relaxed);
        atomic_store_explicit(&gauges[i].peak, 0, memory_order_relaxed);
    }
    atomic_store(&leak_count, 0);
    atomic_store(&leak_bytes, 0);
    atomic_store(&leak_ran, false);
    atomic_store(&reported, false);
}

static void report_table(void)
{
    char now[32], peak[32];
    vmh_log("statistics (pid %d):", (int)getpid());
    for (unsigned i = 0; i < VMH_COUNTER_COUNT; i++)
        vmh_log("  %-36s %20llu", counter_help[i],
                (unsigned long long)vmh_counter_get((vmh_counter_t)i));
    for (unsigned i = 0; i < VMH_GAUGE_COUNT; i++) {
        int64_t c = vmh_gauge_get((vmh_gauge_t)i), p = vmh_gauge_peak((vmh_gauge_t)i);
        /* A negative gauge is a bookkeeping bug upstream; show it rather than wrap it. */
        if (c < 0)
            snprintf(now, sizeof(now), "%lld B", (long long)c);
        else
            vmh_fmt_bytes(now, sizeof(now), (unsigned long long)c);
        vmh_fmt_bytes(peak, sizeof(peak), p > 0 ? (unsigned long long)p : 0);
        vmh_log("  %-36s now %12s  peak %12s (%lld bytes)", gauge_help[i], now, peak, (long long)p);
    }
    if (atomic_load(&leak_ran)) {
        char b[32];
        vmh_log("  %-36s %20llu (%s)", "buffers leaked",
                (unsigned long long)atomic_load(&leak_count),
                vmh_fmt_bytes(b, sizeof(b), atomic_load(&leak_bytes)));
    }
    vmh_stats_table_fn table = atomic_load(&tag_table);
    if (table)
        table();
}

/* A bounded string builder on the caller's stack. */
typedef struct sbuf {
    char *p;
    size_t len, cap;
    bool overflow;
} sbuf_t;

static void sb_printf(sbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= b->cap - b->len)
        b->overflow = true;
    else
        b->len += (size_t)n;
}

static void report_json(void)
{
    char text[8192];
    sbuf_t b = {text, 0, sizeof(text), false};
    sb_printf(&b, "{\n  \"library\": \"libvmmhook\",\n  \"version\": \"%d.%d.%d\",\n",
              VMM_VERSION_MAJOR, VMM_VERSION_MINOR, VMM_VERSION_PATCH);
    sb_printf(&b, "  \"pid\": %d,\n  \"counters\": {\n", (int)getpid());
    for (unsigned i = 0; i < VMH_COUNTER_COUNT; i++)
        sb_printf(&b, "    \"%s\": %llu%s\n", counter_names[i],
                  (unsigned long long)vmh_counter_get((vmh_counter_t)i),
                  i + 1 < VMH_COUNTER_COUNT ? "," : "");
    /* The steady-state figure (DESIGN.md): what an allocation costs an application thread, per
     * thousand (the report has integers only). */
    uint64_t allocs = vmh_counter_get(VMH_STAT_served_allocs);
    uint64_t app_calls = vmh_counter_get(VMH_STAT_driver_calls) -
                         vmh_counter_get(VMH_STAT_driver_calls_background);
    sb_printf(&b, "  },\n  \"app_driver_calls_per_1000_allocs\": %llu,\n",
              (unsigned long long)(allocs ? app_calls * 1000 / allocs : 0));
    sb_printf(&b, "  \"gauges\": {\n");
    for (unsigned i = 0; i < VMH_GAUGE_COUNT; i++)
        sb_printf(&b, "    \"%s\": {\"current\": %lld, \"peak\": %lld}%s\n", gauge_names[i],
                  (long long)vmh_gauge_get((vmh_gauge_t)i),
                  (long long)vmh_gauge_peak((vmh_gauge_t)i), i + 1 < VMH_GAUGE_COUNT ? "," : "");
    sb_printf(&b, "  },\n  \"tags\": ");
    if (!b.overflow) {
        vmh_stats_json_fn json = atomic_load(&tag_json);
        size_t need = json ? json(b.p + b.len, b.cap - b.len, 4)
                           : (size_t)snprintf(b.p + b.len, b.cap - b.len, "{}");
        b.overflow = need >= b.cap - b.len;
        b.len += b.overflow ? 0 : need;
    }
    sb_printf(&b, ",\n");
    if (atomic_load(&leak_ran))
        sb_printf(&b, "  \"leaks\": {\"count\": %llu, \"bytes\": %llu}\n}\n",
                  (unsigned long long)atomic_load(&leak_count),
                  (unsigned long long)atomic_load(&leak_bytes));
    else
        sb_printf(&b, "  \"leaks\": null\n}\n");
    if (b.overflow) {
        vmh_log("VMMHOOK_STATS_JSON: the report does not fit its buffer; not written");
        return;
    }

    char why[200], path[VMH_PATH_MAX], q[1100];
    int fd = -1;
    /* %p is this process's id now: a forked child writes its own file. */
    if (!vmh_expand_path(cfg.json, (long)getpid(), path, sizeof(path)))
        snprintf(why, sizeof(why), "longer than %zu bytes once %%p is replaced", sizeof(path) - 1);
    else
        fd = open_private(path, 0, why, sizeof(why));
    if (fd < 0) {
        /* At exit there is nothing left to stop, even under VMMHOOK_STRICT: just say it. */
        vmh_log("VMMHOOK_STATS_JSON=%s: %s; no JSON report",
                vmh_fmt_quoted(q, sizeof(q), cfg.json, sizeof(cfg.json)), why);
        return;
    }
    if (!write_all(fd, text, b.len)) {
        char err[128];
        vmh_log("VMMHOOK_STATS_JSON=%s: write failed: %s",
                vmh_fmt_quoted(q, sizeof(q), path, sizeof(path)),
                strerror_r(errno, err, sizeof(err)));
    }
    close(fd);
}

void vmh_stats_report(void)
{
    if (atomic_exchange(&reported, true))
        return;
    int saved = errno;
    if (cfg.stats)
        report_table();
    if (cfg.json[0] != '\0')
        report_json();
    errno = saved;
}
