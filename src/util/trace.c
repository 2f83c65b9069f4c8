/* Layer "utilities": the allocation trace and its gauges companion (trace.h says the format).
 * Nothing here allocates or uses stdio: lines are formatted on the stack and written with one
 * write(2) each, and errno is preserved for the interposed callers. */
#include "trace.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "clock.h"
#include "outfile.h"
#include "stats.h"

/* The path template, from vmh_trace_configure ("" = no trace). Written once before any event,
 * read without a lock after: the front configures inside its one-time start, which every
 * traced call has passed. */
static char trace_tmpl[VMH_PATH_MAX];
static vmh_refuse_fn trace_refuse; /* a trace or gauges file that cannot be made */

enum { TRACE_UNOPENED, TRACE_OPEN, TRACE_OFF };

static pthread_mutex_t trace_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int trace_state = TRACE_UNOPENED;
static int trace_fd = -1;    /* published by trace_state = TRACE_OPEN (release) */
static int gauges_fd = -1;   /* likewise; -1 when there is no companion file */
static uint64_t trace_t0_ns; /* likewise */

static const char trace_header[] = "Thread,Time,Action,Pointer,Size,Stream\n";
static const char gauges_header[] = "Time,Requested,Mapped,Reserved,Cached\n";

/* Opens path like the trace (0600, no symbolic link, O_APPEND) and writes header; -1 and why
 * on failure. */
static int trace_file_open(const char *path, const char *header, size_t hlen, char *why,
                           size_t whylen)
{
    /* O_APPEND: each line's single write lands whole at the end, whatever other threads (or a
     * forked child sharing the descriptor) write meanwhile. */
    int fd = vmh_outfile_open(path, O_APPEND, why, whylen);
    if (fd >= 0 && !vmh_outfile_write(fd, header, hlen)) {
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
        trace_refuse("VMMHOOK_TRACE", why, "the trace without gauges");
    }
    return fd;
}

static void trace_open_locked(void)
{
    char why[200], path[VMH_PATH_MAX];
    int fd = -1;
    if (vmh_outfile_path(trace_tmpl, path, sizeof(path), why, sizeof(why)))
        fd = trace_file_open(path, trace_header, sizeof(trace_header) - 1, why, sizeof(why));
    if (fd < 0) {
        atomic_store_explicit(&trace_state, TRACE_OFF, memory_order_release);
        trace_refuse("VMMHOOK_TRACE", why, "no trace");
        return;
    }
    gauges_fd = gauges_open_locked(fd, path);
    trace_t0_ns = vmh_now_ns();
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

void vmh_trace_configure(const char *path_template, vmh_refuse_fn refuse)
{
    trace_refuse = refuse;
    snprintf(trace_tmpl, sizeof(trace_tmpl), "%s", path_template);
    if (trace_tmpl[0] != '\0') {
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
    (void)vmh_outfile_write(fd, line, (size_t)(p - line));
}

void vmh_trace(const char *action, CUdeviceptr ptr, size_t size, CUstream stream)
{
    if (trace_tmpl[0] == '\0')
        return;
    int saved = errno;
    int fd = trace_get();
    if (fd < 0) {
        errno = saved;
        return;
    }
    uint64_t now = vmh_now_ns();
    unsigned long long us = now > trace_t0_ns ? (unsigned long long)(now - trace_t0_ns) / 1000 : 0;
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
        (void)vmh_outfile_write(fd, line, (size_t)n);
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
