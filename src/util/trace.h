/* Layer "utilities": the allocation trace, in the CSV of RMM's logging adaptor, and its gauges
 * companion.
 *
 * Trace lines: Thread,Time,Action,Pointer,Size,Stream. action is "allocate", "free",
 * "allocate failure". No-op unless VMMHOOK_TRACE is set. One line per call, written with one
 * write(2) to a file opened O_APPEND, so lines of different threads never interleave. Thread is
 * the kernel thread id, Time "HH:MM:SS.uuuuuu" since the trace was opened, Pointer "0x..." hex,
 * Size decimal, Stream "0" for NULL else "0x..." hex (the forms RMM writes and its replay
 * benchmark parses). A failed allocation is traced with pointer 0 and the size asked for; a
 * free with the size the buffer was allocated with.
 *
 * Beside a trace that is a regular file, a companion "<trace>.gauges.csv" (created alike: 0600,
 * no symbolic link, O_APPEND, one write per line) gets the header
 * "Time,Requested,Mapped,Reserved,Cached" and, for every trace line, one line with the same Time
 * text and the current values (vmh_gauge_get) of bytes_requested, bytes_mapped, bytes_reserved
 * and bytes_cached, in decimal (signed). The RMM CSV itself is unchanged. A companion that cannot
 * be created gets one warning (VMMHOOK_STRICT: the program stops) and the trace goes on
 * without it. Files are opened as outfile.h says. */
#ifndef VMH_TRACE_H
#define VMH_TRACE_H

#include <cuda.h>
#include <stddef.h>

#include "log.h"

#define VMH_TRACE_GAUGES_SUFFIX ".gauges.csv"

void vmh_trace(const char *action, CUdeviceptr ptr, size_t size, CUstream stream);

/* The trace's path template (VMMHOOK_TRACE, "" for none, copied, cut at VMH_PATH_MAX; "%p" is
 * replaced by the process id when the file is opened, "%%" by one '%'), from
 * vmh_stats_configure. A trace is opened now, so that its clock starts with the program and the
 * file exists even if nothing is allocated; a trace or gauges file that cannot be made is
 * handed to refuse (one warning; with VMMHOOK_STRICT, the program stops), and without the trace
 * tracing is off. */
void vmh_trace_configure(const char *path_template, vmh_refuse_fn refuse);

#ifdef VMH_TESTING
/* Closes the trace and forgets it, so that a test can open another (the library never closes
 * it: frees from other libraries' destructors still trace after ours). */
void vmh_trace_close(void);
#endif

#endif
