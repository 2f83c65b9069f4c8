/* Layer "utilities": the exit reports: the statistics table (VMMHOOK_STATS), the JSON report
 * (VMMHOOK_STATS_JSON) and the leak report (VMMHOOK_LEAKS), over the counters of stats.h; and
 * the one configuration call of the statistics, trace included. */
#ifndef VMH_REPORT_H
#define VMH_REPORT_H

#include <cuda.h>
#include <stdbool.h>
#include <stddef.h>

#include "log.h"

/* What the statistics take from the options; the front makes it once, at start (lifetime.c). */
typedef struct vmh_stats_settings {
    bool stats;           /* VMMHOOK_STATS: the table at exit */
    bool leaks;           /* VMMHOOK_LEAKS: list leaks at exit */
    const char *trace;    /* VMMHOOK_TRACE: path template, "" = no trace */
    const char *json;     /* VMMHOOK_STATS_JSON: path template, "" = no JSON */
    vmh_refuse_fn refuse; /* a trace file that cannot be made (log.h) */
} vmh_stats_settings_t;

/* Takes a copy of *s (the paths copied, cut at VMH_PATH_MAX) and hands the trace its path and
 * refusal (vmh_trace_configure: a trace is opened now). Called by the front once, before any
 * other call here (tests call it again to change the settings).
 *
 * Output files (the trace, its gauges companion, the JSON) are created as outfile.h says; "%p"
 * in a path is replaced by the process id when the file is opened (the trace at configure time,
 * the JSON at exit, so that a forked child writes its own), "%%" by one '%'; any other '%' is
 * kept. A JSON file that cannot be opened at exit gets one line. */
void vmh_stats_configure(const vmh_stats_settings_t *s);

/* The per-tag section of the report, written by a layer above this one (tags.c): a function
 * that logs its lines of the exit table, and one that writes its JSON value into buf (at most
 * len bytes, indented by indent) and returns the length it needed, like snprintf. Set by the
 * front at start (lifetime.c); without it the table has no tag lines and the JSON says
 * "tags": {}. The reports call up only through these, so no arrow of the layer diagram points
 * up. */
typedef void (*vmh_stats_table_fn)(void);
typedef size_t (*vmh_stats_json_fn)(char *buf, size_t len, int indent);
void vmh_stats_set_tag_report(vmh_stats_table_fn table, vmh_stats_json_fn json);

/* The width of the label column of the statistics table: the longest label of its lines (the
 * counters', the gauges' and "buffers leaked"), computed from the labels of stats.h, so that a
 * longer label widens the column instead of pushing its line's values out of it. Lines that the
 * tag report (vmh_stats_set_tag_report) adds in the table's format should pad their label to
 * it ("  %-*s ...") to stay aligned. */
int vmh_stats_label_width(void);

/* Called at exit: the stats table / JSON when asked. Once per process (later calls do
 * nothing); call it after the leak report so that the JSON includes the leak totals. */
void vmh_stats_report(void);

/* A text builder over a caller's buffer that keeps counting past its end, like snprintf: need
 * is what the whole text takes (the buffer holds it, terminated, while need < cap). */
typedef struct vmh_jbuf {
    char *p;
    size_t cap, need;
} vmh_jbuf_t;
void vmh_jb_printf(vmh_jbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* What the JSON reports (the exit report, vmm_stats_json) share, each followed by what the
 * caller adds: the opening brace and the members "library", "version", "pid" and "counters"
 * (its object closed, no comma after it); and the member "gauges" (each gauge's current value
 * and peak), on lines of its own, no comma after it. */
void vmh_stats_json_head(vmh_jbuf_t *b);
void vmh_stats_json_gauges(vmh_jbuf_t *b);

/* The per-device part, written by the heap front (heap_devices.c) through a function it sets at
 * start (as the tags' part, above): each device's value of the member "devices", e.g.
 * "0": {"bytes_spilled": 0, "spills": 0, "spills_small": 0}, separated by commas. The JSON
 * reports write ",\n  \"devices\": {...}" after the gauges ({} without the function). */
typedef void (*vmh_stats_devices_fn)(vmh_jbuf_t *b);
void vmh_stats_set_device_report(vmh_stats_devices_fn fn);
void vmh_stats_json_devices(vmh_jbuf_t *b);

/* Leak report at exit: the heap walks its live buffers and calls begin, one per live buffer,
 * then end. With leaks configured (VMMHOOK_LEAKS) each leak is listed (pointer, size, device, call
 * site resolved with dladdr; the first 256), then a total; without it nothing is printed, but the
 * totals still go into the JSON. Not thread-safe against itself: one walk at a time. */
void vmh_leak_report_begin(void);
void vmh_leak_report_one(CUdeviceptr p, size_t size, int device, void *call_site);
void vmh_leak_report_end(void);

/* Zeroes the counters and gauges (vmh_counters_reset) and forgets the leak totals and that the
 * report was written. */
void vmh_stats_reset(void);

#endif
