/* Layer "utilities" (the bottom, below options and stats): diagnostics, one line per message,
 * prefixed "vmmhook: ", formatted into a stack buffer and written with write(2) to stderr. No
 * allocation, no stdio: safe inside the driver, inside dlsym and during exit. */
#ifndef VMH_LOG_H
#define VMH_LOG_H

#include <stdbool.h>
#include <stddef.h>

void vmh_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The same, only when verbose logging is on (vmh_log_set_verbose; off until then). */
void vmh_debug(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Verbose logging on or off. The log sits below the options: the front sets it from
 * VMMHOOK_VERBOSE at start (lifetime.c); the log never reads the options. */
void vmh_log_set_verbose(bool on);
bool vmh_log_verbose(void);

/* Formats n bytes as "12.5 MiB" into buf (one decimal, rounded; "512 B" below 1 KiB; "64 MiB"
 * when exact). Returns buf. */
const char *vmh_fmt_bytes(char *buf, size_t len, unsigned long long n);

/* s as a quoted, printable string for a log line: bytes outside printable ASCII, '"' and '\\'
 * as \xNN; at most max bytes of s, then "..." when cut. A value from the environment or a path
 * could hold a newline that would forge a log line. Returns buf. */
const char *vmh_fmt_quoted(char *buf, size_t len, const char *s, size_t max);

/* How VMMHOOK_STRICT stops the program (a bad value when the options are read, a value the
 * machine refuses later): the C library's buffers are flushed, so that what the program printed
 * so far is not lost, then abort(). Not exit(): the stop can come from inside the library (its
 * first use runs inside a pthread_once, a refusal inside a device lock), and exit handlers,
 * cudart's among them, call CUDA and would re-enter it and wait forever. Not _exit(): that
 * loses the program's buffered output. Returns only when a test replaced vmh_log_exit. */
void vmh_log_stop(void);

/* A value the parser accepted but that the machine refuses later (VMMHOOK_HANDLE_TYPE=fabric
 * when cuMemCreate answers CUDA_ERROR_NOT_PERMITTED, a trace file that cannot be made): name is
 * the variable ("VMMHOOK_X"), why the machine's answer, instead what the caller then uses. The
 * front's policy (lifetime.c: one warning per variable naming the value and its accepted
 * forms, or VMMHOOK_STRICT's stop), handed down in the settings of the layers that meet such
 * a value; the caller applies `instead` itself when it returns. */
typedef void (*vmh_refuse_fn)(const char *name, const char *why, const char *instead);

/* The longest line vmh_log writes, prefix and newline included; longer ones end in "...". */
#define VMH_LOG_LINE_MAX 1024

#ifdef VMH_TESTING
/* Where finished lines ("vmmhook: ...\n") go: write(2) to fd 2 in the library; tests capture. */
extern void (*vmh_log_sink)(const char *line, size_t len);
void vmh_log_write_stderr(const char *line, size_t len);
/* What vmh_log_stop calls: flush and abort in the library; tests replace it (it may return). */
extern void (*vmh_log_exit)(int status);
#endif

#endif
