/* Diagnostics: every message is one line "vmmhook: ...\n", formatted into a stack buffer and
 * handed to the sink (write(2) to fd 2) in one call.
 *
 * Why no stdio and no malloc: these functions run inside the driver's calls, inside dlsym while
 * the loader holds its lock, in fork children and in destructors after libc's own exit handlers.
 * glibc's vsnprintf does not allocate for the integer, pointer and %s conversions used here,
 * and one write(2) per line keeps lines of different threads from interleaving. errno is
 * preserved, since the interposed entry points must not change what the program sees. The one
 * use of stdio: VMMHOOK_STRICT's stop (vmh_log_stop) flushes the program's buffers before it
 * aborts. */
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testable.h"

#define PREFIX "vmmhook: "
#define PREFIX_LEN (sizeof(PREFIX) - 1)

VMH_TESTABLE void vmh_log_write_stderr(const char *line, size_t len)
{
    while (len > 0) {
        ssize_t n = write(STDERR_FILENO, line, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return; /* stderr closed or full: nothing better to do with a diagnostic */
        }
        line += n;
        len -= (size_t)n;
    }
}

VMH_TESTABLE void (*vmh_log_sink)(const char *line, size_t len) = vmh_log_write_stderr;

static void vlog(const char *fmt, va_list ap)
{
    int saved = errno;
    char buf[VMH_LOG_LINE_MAX];
    const size_t room = sizeof(buf) - PREFIX_LEN - 1; /* 1 for the newline */

    memcpy(buf, PREFIX, PREFIX_LEN);
    int n = vsnprintf(buf + PREFIX_LEN, room + 1, fmt, ap);
    size_t len;
    if (n < 0) {
        static const char bad[] = "(message could not be formatted)";
        memcpy(buf + PREFIX_LEN, bad, sizeof(bad) - 1);
        len = PREFIX_LEN + sizeof(bad) - 1;
    } else if ((size_t)n > room) {
        /* Truncated: say so rather than cut a value silently. */
        len = PREFIX_LEN + room;
        memcpy(buf + len - 3, "...", 3);
    } else {
        len = PREFIX_LEN + (size_t)n;
    }
    buf[len++] = '\n';
    vmh_log_sink(buf, len);
    errno = saved;
}

void vmh_log(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(fmt, ap);
    va_end(ap);
}

/* Set by the front from VMMHOOK_VERBOSE (lifetime.c, at start): this file sits below the
 * options and must not read them. Relaxed: a debug line more or less while the
 * setting changes does not matter. */
static atomic_bool verbose;

void vmh_log_set_verbose(bool on)
{
    atomic_store_explicit(&verbose, on, memory_order_relaxed);
}

bool vmh_log_verbose(void)
{
    return atomic_load_explicit(&verbose, memory_order_relaxed);
}

void vmh_debug(const char *fmt, ...)
{
    if (!vmh_log_verbose())
        return;
    va_list ap;
    va_start(ap, fmt);
    vlog(fmt, ap);
    va_end(ap);
}

static void stop_program(int status)
{
    (void)status; /* abort's status is SIGABRT's */
    fflush(NULL);
    abort();
}

VMH_TESTABLE void (*vmh_log_exit)(int status) = stop_program;

void vmh_log_stop(void)
{
    vmh_log_exit(2);
}

const char *vmh_fmt_bytes(char *buf, size_t len, unsigned long long n)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    if (len == 0)
        return buf;
    unsigned u = 0;
    while (u + 1 < sizeof(units) / sizeof(units[0]) && n >> (10 * (u + 1)) != 0)
        u++;
    if (u == 0) {
        snprintf(buf, len, "%llu B", n);
        return buf;
    }
    /* Integer arithmetic (no floating point in a library that runs inside the driver): tenths
     * of the unit, rounded to nearest. (n % unit) * 10 < 10 * 2^60 fits in 64 bits. */
    unsigned long long unit = 1ULL << (10 * u);
    unsigned long long whole = n / unit;
    unsigned long long tenths = ((n % unit) * 10 + unit / 2) / unit;
    if (tenths == 10) {
        whole++;
        tenths = 0;
    }
    if (n % unit == 0)
        snprintf(buf, len, "%llu %s", whole, units[u]);
    else
        snprintf(buf, len, "%llu.%llu %s", whole, tenths, units[u]);
    return buf;
}

const char *vmh_fmt_quoted(char *buf, size_t len, const char *s, size_t max)
{
    static const char hex[] = "0123456789abcdef";
    size_t n = 0, i = 0;
    if (len < 8) {
        if (len)
            buf[0] = '\0';
        return buf;
    }
    buf[n++] = '"';
    /* n + 6 < len: room for one escape (4), the closing quote and the NUL. */
    for (; s[i] != '\0' && i < max && n + 6 < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
            buf[n++] = (char)c;
        } else {
            buf[n++] = '\\';
            buf[n++] = 'x';
            buf[n++] = hex[c >> 4];
            buf[n++] = hex[c & 15];
        }
    }
    buf[n++] = '"';
    if (s[i] != '\0' && n + 4 <= len) {
        memcpy(buf + n, "...", 3);
        n += 3;
    }
    buf[n] = '\0';
    return buf;
}
