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

/* Verbose logging on or off. The log sits below the options: the code that reads
 * VMMHOOK_VERBOSE (vmh_options_load) sets it; the log never reads the options. */
void vmh_log_set_verbose(bool on);
bool vmh_log_verbose(void);

/* Formats n bytes as "12.5 MiB" into buf (one decimal, rounded; "512 B" below 1 KiB; "64 MiB"
 * when exact). Returns buf. */
const char *vmh_fmt_bytes(char *buf, size_t len, unsigned long long n);

/* s as a quoted, printable string for a log line: bytes outside printable ASCII, '"' and '\\'
 * as \xNN; at most max bytes of s, then "..." when cut. A value from the environment or a path
 * could hold a newline that would forge a log line. Returns buf. */
const char *vmh_fmt_quoted(char *buf, size_t len, const char *s, size_t max);

/* The longest line vmh_log writes, prefix and newline included; longer ones end in "...". */
#define VMH_LOG_LINE_MAX 1024

#ifdef VMH_TESTING
/* Where finished lines ("vmmhook: ...\n") go: write(2) to fd 2 in the library; tests capture. */
extern void (*vmh_log_sink)(const char *line, size_t len);
void vmh_log_write_stderr(const char *line, size_t len);
#endif

#endif
