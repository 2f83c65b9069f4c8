/* Layer "utilities": the library's output files (the trace, its gauges companion, the JSON
 * report), created owner-only. Nothing here allocates or uses stdio: the trace opens its
 * files on the event path.
 *
 * A new file is created 0600 (a trace holds addresses and sizes of the program's memory). An
 * existing path must be a regular file owned by the process's effective uid: then it is made
 * 0600 and emptied; anything else is refused without being changed (a symbolic link, a FIFO,
 * which would block the program, a device, another user's file, even for root). */
#ifndef VMH_OUTFILE_H
#define VMH_OUTFILE_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* The longest output path once "%p" is replaced, terminator included. */
#define VMH_PATH_MAX 512

/* path: the template tmpl ("%p": this process's id, "%%": one '%'; optparse.h's
 * vmh_expand_path) as it is now, so that a forked child gets its own; false with why when it
 * does not fit len bytes. */
bool vmh_outfile_path(const char *tmpl, char *path, size_t len, char *why, size_t whylen);

/* Opens path for writing (open(2) flags added: O_APPEND for the trace) as above: the
 * descriptor, or -1 with why (whylen bytes) saying what was refused or failed. */
int vmh_outfile_open(const char *path, int flags, char *why, size_t whylen);

/* Writes all n bytes (retrying short writes and EINTR); false with errno on failure. */
bool vmh_outfile_write(int fd, const char *p, size_t n);

#ifdef VMH_TESTING
/* The effective uid that must own an existing output file: geteuid; tests pretend. */
extern uid_t (*vmh_stats_euid)(void);
#endif

#endif
