/* Layer "utilities": the exit reports (the statistics table, the JSON report, the leak report)
 * and the statistics' configuration. Nothing here allocates or uses stdio streams: text is
 * formatted on the stack and written with write(2), and errno is preserved for the caller. */
#include "report.h"

#include <assert.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "outfile.h"
#include "stats.h"
#include "trace.h"
#include "vmmhook.h"

/* The configuration, from vmh_stats_configure (the front's settings for this file; it never
 * reads the options). Written once before any event, read without a lock after:
 * the front configures inside its one-time start, before any report. */
static struct {
    bool stats;              /* the table at exit */
    bool leaks;              /* list leaks at exit */
    char json[VMH_PATH_MAX]; /* path template ("" = no JSON) */
} cfg;

#define VMH_NAME_ITEM(name, help) #name,
#define VMH_HELP_ITEM(name, help) help,
static const char *const counter_names[] = {VMH_COUNTERS(VMH_NAME_ITEM)};
static const char *const counter_help[] = {VMH_COUNTERS(VMH_HELP_ITEM)};
static const char *const gauge_names[] = {VMH_GAUGES(VMH_NAME_ITEM)};
static const char *const gauge_help[] = {VMH_GAUGES(VMH_HELP_ITEM)};
#undef VMH_NAME_ITEM
#undef VMH_HELP_ITEM

static _Atomic(vmh_stats_table_fn) tag_table;
static _Atomic(vmh_stats_json_fn) tag_json;

static _Atomic(vmh_stats_devices_fn) device_json;

void vmh_stats_set_device_report(vmh_stats_devices_fn fn)
{
    atomic_store(&device_json, fn);
}

void vmh_stats_json_devices(vmh_jbuf_t *b)
{
    vmh_stats_devices_fn fn = atomic_load(&device_json);
    vmh_jb_printf(b, ",\n  \"devices\": {");
    if (fn)
        fn(b);
    vmh_jb_printf(b, "}");
}

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
    snprintf(cfg.json, sizeof(cfg.json), "%s", s->json);
    vmh_trace_configure(s->trace, s->refuse);
}

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
    vmh_counters_reset();
    atomic_store(&leak_count, 0);
    atomic_store(&leak_bytes, 0);
    atomic_store(&leak_ran, false);
    atomic_store(&reported, false);
}

#define LEAKED_LABEL "buffers leaked"

int vmh_stats_label_width(void)
{
    size_t w = strlen(LEAKED_LABEL);
    for (unsigned i = 0; i < VMH_COUNTER_COUNT; i++)
        if (strlen(counter_help[i]) > w)
            w = strlen(counter_help[i]);
    for (unsigned i = 0; i < VMH_GAUGE_COUNT; i++)
        if (strlen(gauge_help[i]) > w)
            w = strlen(gauge_help[i]);
    return (int)w;
}

static void report_table(void)
{
    char now[32], peak[32];
    int w = vmh_stats_label_width();
    vmh_log("statistics (pid %d):", (int)getpid());
    for (unsigned i = 0; i < VMH_COUNTER_COUNT; i++)
        vmh_log("  %-*s %20llu", w, counter_help[i],
                (unsigned long long)vmh_counter_get((vmh_counter_t)i));
    for (unsigned i = 0; i < VMH_GAUGE_COUNT; i++) {
        int64_t c = vmh_gauge_get((vmh_gauge_t)i), p = vmh_gauge_peak((vmh_gauge_t)i);
        /* A negative gauge is a bookkeeping bug upstream; show it rather than wrap it. */
        if (c < 0)
            snprintf(now, sizeof(now), "%lld B", (long long)c);
        else
            vmh_fmt_bytes(now, sizeof(now), (unsigned long long)c);
        vmh_fmt_bytes(peak, sizeof(peak), p > 0 ? (unsigned long long)p : 0);
        vmh_log("  %-*s now %12s  peak %12s (%lld bytes)", w, gauge_help[i], now, peak,
                (long long)p);
        /* What counts as idle (carved_internal.h's and ownchunk.c's gauge): mapped free space of
         * the shared extents (and parked carved blocks), which the tidy keeps for the recent peak,
         * and freed buffers with chunks of their own, parked or in the cache, which alone
         * VMMHOOK_CACHE_LIMIT bounds (cache.h), so the figure can exceed the limit. */
        if (i == VMH_STAT_bytes_cached)
            vmh_log(
                "    (free space in shared chunks, not capped by VMMHOOK_CACHE_LIMIT, and freed "
                "buffers with chunks of their own, capped by it per device)");
    }
    if (atomic_load(&leak_ran)) {
        char b[32];
        vmh_log("  %-*s %20llu (%s)", w, LEAKED_LABEL, (unsigned long long)atomic_load(&leak_count),
                vmh_fmt_bytes(b, sizeof(b), atomic_load(&leak_bytes)));
    }
    vmh_stats_table_fn table = atomic_load(&tag_table);
    if (table)
        table();
}

void vmh_jb_printf(vmh_jbuf_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    size_t room = b->need < b->cap ? b->cap - b->need : 0;
    int n = vsnprintf(room ? b->p + b->need : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0)
        b->need += (size_t)n;
}

void vmh_stats_json_head(vmh_jbuf_t *b)
{
    vmh_jb_printf(b, "{\n  \"library\": \"libvmmhook\",\n  \"version\": \"%d.%d.%d\",\n",
                  VMM_VERSION_MAJOR, VMM_VERSION_MINOR, VMM_VERSION_PATCH);
    vmh_jb_printf(b, "  \"pid\": %d,\n  \"counters\": {\n", (int)getpid());
    for (unsigned i = 0; i < VMH_COUNTER_COUNT; i++)
        vmh_jb_printf(b, "    \"%s\": %llu%s\n", counter_names[i],
                      (unsigned long long)vmh_counter_get((vmh_counter_t)i),
                      i + 1 < VMH_COUNTER_COUNT ? "," : "");
    vmh_jb_printf(b, "  }");
}

void vmh_stats_json_gauges(vmh_jbuf_t *b)
{
    vmh_jb_printf(b, "  \"gauges\": {\n");
    for (unsigned i = 0; i < VMH_GAUGE_COUNT; i++)
        vmh_jb_printf(b, "    \"%s\": {\"current\": %lld, \"peak\": %lld}%s\n", gauge_names[i],
                      (long long)vmh_gauge_get((vmh_gauge_t)i),
                      (long long)vmh_gauge_peak((vmh_gauge_t)i),
                      i + 1 < VMH_GAUGE_COUNT ? "," : "");
    vmh_jb_printf(b, "  }");
}

static void report_json(void)
{
    char text[8192];
    vmh_jbuf_t b = {text, sizeof(text), 0};
    vmh_stats_json_head(&b);
    /* The steady-state figure (DESIGN.md): what an allocation costs an application thread, per
     * thousand (the report has integers only). */
    uint64_t allocs = vmh_counter_get(VMH_STAT_served_allocs);
    uint64_t app_calls =
        vmh_counter_get(VMH_STAT_driver_calls) - vmh_counter_get(VMH_STAT_driver_calls_background);
    vmh_jb_printf(&b, ",\n  \"app_driver_calls_per_1000_allocs\": %llu,\n",
                  (unsigned long long)(allocs ? app_calls * 1000 / allocs : 0));
    vmh_stats_json_gauges(&b);
    vmh_stats_json_devices(&b);
    vmh_jb_printf(&b, ",\n  \"tags\": ");
    vmh_stats_json_fn json = atomic_load(&tag_json);
    if (json) {
        size_t room = b.need < b.cap ? b.cap - b.need : 0;
        b.need += json(room ? b.p + b.need : NULL, room, 4);
    } else {
        vmh_jb_printf(&b, "{}");
    }
    vmh_jb_printf(&b, ",\n");
    if (atomic_load(&leak_ran))
        vmh_jb_printf(&b, "  \"leaks\": {\"count\": %llu, \"bytes\": %llu}\n}\n",
                      (unsigned long long)atomic_load(&leak_count),
                      (unsigned long long)atomic_load(&leak_bytes));
    else
        vmh_jb_printf(&b, "  \"leaks\": null\n}\n");
    if (b.need >= b.cap) {
        vmh_log("VMMHOOK_STATS_JSON: the report does not fit its buffer; not written");
        return;
    }

    char why[200], path[VMH_PATH_MAX], q[1100];
    int fd = -1;
    /* %p is this process's id now: a forked child writes its own file. */
    if (vmh_outfile_path(cfg.json, path, sizeof(path), why, sizeof(why)))
        fd = vmh_outfile_open(path, 0, why, sizeof(why));
    if (fd < 0) {
        /* At exit there is nothing left to stop, even under VMMHOOK_STRICT: just say it. */
        vmh_log("VMMHOOK_STATS_JSON=%s: %s; no JSON report",
                vmh_fmt_quoted(q, sizeof(q), cfg.json, sizeof(cfg.json)), why);
        return;
    }
    if (!vmh_outfile_write(fd, text, b.need)) {
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
