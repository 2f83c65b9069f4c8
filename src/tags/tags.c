/* Tags: the registry of names, the calling thread's tag stack, per-tag statistics and their
 * reports, and the live JSON API (see tags.h). */
#include "tags.h"

#include "log.h"
#include "report.h"
#include "stats.h"
#include "thread_state.h"

#include <assert.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define VMM_API __attribute__((visibility("default")))

/* ---- registry -------------------------------------------------------------------------------- */

/* A name is written once, before its id is published by the release store of tag_count, and
 * never changed: readers that saw the count read the names without a lock. */
static char tag_names[VMM_TAGS_MAX][VMM_TAG_NAME_MAX + 1] = {"default"};
static atomic_uint tag_count = 1;
static pthread_mutex_t register_lock = PTHREAD_MUTEX_INITIALIZER;

unsigned vmh_tag_count(void)
{
    return atomic_load_explicit(&tag_count, memory_order_acquire);
}

const char *vmh_tag_name(unsigned tag)
{
    return tag < vmh_tag_count() ? tag_names[tag] : "?";
}

unsigned vmh_tag_lookup(const char *name)
{
    if (!name)
        return VMH_TAG_NONE;
    unsigned n = vmh_tag_count();
    for (unsigned i = 0; i < n; i++)
        if (strcmp(tag_names[i], name) == 0)
            return i;
    return VMH_TAG_NONE;
}

/* The id of name, registering it when new; VMH_TAG_NONE when the table is full. */
static unsigned tag_register(const char *name)
{
    unsigned id = vmh_tag_lookup(name);
    if (id != VMH_TAG_NONE)
        return id;
    pthread_mutex_lock(&register_lock);
    /* Another thread may have registered it between the look-up and the lock. */
    id = vmh_tag_lookup(name);
    unsigned n = atomic_load_explicit(&tag_count, memory_order_relaxed);
    if (id == VMH_TAG_NONE && n < VMM_TAGS_MAX) {
        strcpy(tag_names[n], name); /* length checked by the caller */
        atomic_store_explicit(&tag_count, n + 1, memory_order_release);
        id = n;
    }
    pthread_mutex_unlock(&register_lock);
    return id;
}

/* ---- the calling thread's stack -------------------------------------------------------------- */

/* The stack is the thread's state's tag_stack and tag_depth (thread_state.h). */

unsigned vmh_tag_current(void)
{
    return vmh_thread.tag_depth ? vmh_thread.tag_stack[vmh_thread.tag_depth - 1] : VMH_TAG_DEFAULT;
}

VMM_API vmm_status vmm_tag_push(const char *name)
{
    if (!name || !name[0] || strlen(name) > VMM_TAG_NAME_MAX)
        return VMM_ERR_INVALID;
    if (vmh_thread.tag_depth == VMM_TAG_DEPTH_MAX)
        return VMM_ERR_LIMIT;
    unsigned id = tag_register(name);
    if (id == VMH_TAG_NONE)
        return VMM_ERR_LIMIT;
    _Static_assert(VMM_TAGS_MAX <= 256, "tag ids are stored in bytes");
    vmh_thread.tag_stack[vmh_thread.tag_depth++] = (unsigned char)id;
    return VMM_OK;
}

VMM_API vmm_status vmm_tag_pop(void)
{
    if (!vmh_thread.tag_depth)
        return VMM_ERR_INVALID;
    vmh_thread.tag_depth--;
    return VMM_OK;
}

/* ---- per-tag figures ---------------------------------------------------------------------------
 */

typedef struct tag_stats {
    _Atomic int64_t requested, requested_peak;
    atomic_uint_fast64_t pauses, resumes;
    atomic_uint_fast64_t pause_ns, resume_ns;           /* totals */
    atomic_uint_fast64_t last_pause_ns, last_resume_ns; /* the latest one */
} tag_stats_t;

static tag_stats_t stats[VMM_TAGS_MAX];
static _Atomic int tag_states[VMM_TAGS_MAX]; /* vmh_tag_state_t; 0 is RUNNING */

vmh_tag_state_t vmh_tag_state(unsigned tag)
{
    assert(tag < VMM_TAGS_MAX);
    return (vmh_tag_state_t)atomic_load(&tag_states[tag]);
}

bool vmh_tag_transition(unsigned tag, vmh_tag_state_t from, vmh_tag_state_t to)
{
    assert(tag < VMM_TAGS_MAX && to < VMH_TAG_STATE_COUNT);
    int expect = (int)from;
    /* Sequentially consistent: a pause stores PAUSING and then takes the heap's locks; an
     * allocation checks under those locks, so one of the two sees the other. */
    return atomic_compare_exchange_strong(&tag_states[tag], &expect, (int)to);
}

bool vmh_tag_running(unsigned tag)
{
    return vmh_tag_state(tag) == VMH_TAG_RUNNING;
}
static _Atomic int64_t pinned_now, pinned_peak;

static _Atomic(vmh_tag_memory_fn) memory_source;

static void peak_raise(_Atomic int64_t *peak, int64_t now)
{
    int64_t p = atomic_load_explicit(peak, memory_order_relaxed);
    while (now > p && !atomic_compare_exchange_weak_explicit(peak, &p, now, memory_order_relaxed,
                                                             memory_order_relaxed))
        ;
}

void vmh_tag_requested_add(unsigned tag, int64_t delta)
{
    assert(tag < VMM_TAGS_MAX);
    vmh_gauge_add(VMH_STAT_bytes_requested, delta);
    int64_t now =
        atomic_fetch_add_explicit(&stats[tag].requested, delta, memory_order_relaxed) + delta;
    peak_raise(&stats[tag].requested_peak, now);
}

int64_t vmh_tag_requested(unsigned tag)
{
    return atomic_load_explicit(&stats[tag].requested, memory_order_relaxed);
}

int64_t vmh_tag_requested_peak(unsigned tag)
{
    return atomic_load_explicit(&stats[tag].requested_peak, memory_order_relaxed);
}

void vmh_tags_set_memory_source(vmh_tag_memory_fn fn)
{
    atomic_store(&memory_source, fn);
}

static vmh_tag_memory_t tag_memory(unsigned tag)
{
    vmh_tag_memory_t m = {0, 0, 0, 0, 0};
    vmh_tag_memory_fn fn = atomic_load(&memory_source);
    if (fn)
        fn(tag, &m);
    return m;
}

void vmh_tag_note_pause(unsigned tag, uint64_t ns)
{
    atomic_fetch_add_explicit(&stats[tag].pauses, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&stats[tag].pause_ns, ns, memory_order_relaxed);
    atomic_store_explicit(&stats[tag].last_pause_ns, ns, memory_order_relaxed);
}

void vmh_tag_note_resume(unsigned tag, uint64_t ns)
{
    atomic_fetch_add_explicit(&stats[tag].resumes, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&stats[tag].resume_ns, ns, memory_order_relaxed);
    atomic_store_explicit(&stats[tag].last_resume_ns, ns, memory_order_relaxed);
}

uint64_t vmh_tag_pauses(unsigned tag)
{
    return atomic_load_explicit(&stats[tag].pauses, memory_order_relaxed);
}

uint64_t vmh_tag_resumes(unsigned tag)
{
    return atomic_load_explicit(&stats[tag].resumes, memory_order_relaxed);
}

void vmh_tags_pinned_add(int64_t delta)
{
    int64_t now = atomic_fetch_add_explicit(&pinned_now, delta, memory_order_relaxed) + delta;
    peak_raise(&pinned_peak, now);
}

/* ---- JSON -------------------------------------------------------------------------------------
 */

/* Text is built with report.h's builder, which keeps counting past its end: need is what the
 * whole text takes, so the caller can size a second attempt. */
typedef vmh_jbuf_t jbuf_t;
#define jb_printf vmh_jb_printf

static double seconds(uint64_t ns)
{
    return (double)ns / 1e9;
}

/* Tag names are pushed by the program: escape what JSON does not allow raw. */
static void jb_string(jbuf_t *b, const char *s)
{
    jb_printf(b, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            jb_printf(b, "\\%c", c);
        else if (c < 0x20)
            jb_printf(b, "\\u%04x", c);
        else
            jb_printf(b, "%c", c);
    }
    jb_printf(b, "\"");
}

static void tags_json(jbuf_t *b, int indent)
{
    unsigned n = vmh_tag_count();
    jb_printf(b, "{\n");
    for (unsigned t = 0; t < n; t++) {
        jb_printf(b, "%*s", indent, "");
        jb_string(b, tag_names[t]);
        static const char *const state_names[VMH_TAG_STATE_COUNT] = {"running", "pausing", "paused",
                                                                     "resuming"};
        jb_printf(b, ": {\"state\": \"%s\", ", state_names[vmh_tag_state(t)]);
        vmh_tag_memory_t m = tag_memory(t);
        jb_printf(b,
                  "\"requested\": %lld, \"requested_peak\": %lld, \"mapped\": %zu, "
                  "\"paused\": %zu, \"backed_up\": %zu, \"kept_mapped\": %zu, "
                  "\"spilled\": %zu, ",
                  (long long)vmh_tag_requested(t), (long long)vmh_tag_requested_peak(t), m.mapped,
                  m.paused, m.backed_up, m.kept, m.spilled);
        const tag_stats_t *s = &stats[t];
        /* Integers only, as the rest of the report: durations in nanoseconds. */
        jb_printf(b,
                  "\"pauses\": %llu, \"resumes\": %llu, \"pause_ns\": %llu, "
                  "\"resume_ns\": %llu, \"last_pause_ns\": %llu, \"last_resume_ns\": %llu}%s\n",
                  (unsigned long long)atomic_load(&s->pauses),
                  (unsigned long long)atomic_load(&s->resumes),
                  (unsigned long long)atomic_load(&s->pause_ns),
                  (unsigned long long)atomic_load(&s->resume_ns),
                  (unsigned long long)atomic_load(&s->last_pause_ns),
                  (unsigned long long)atomic_load(&s->last_resume_ns), t + 1 < n ? "," : "");
    }
    jb_printf(b, "%*s}", indent > 2 ? indent - 2 : 0, "");
}

size_t vmh_tags_json(char *buf, size_t len, int indent)
{
    jbuf_t b = {buf, buf ? len : 0, 0};
    tags_json(&b, indent);
    return b.need;
}

VMM_API int vmm_stats_json(char *buf, size_t len)
{
    if (len && !buf)
        return -1;
    jbuf_t b = {buf, len, 0};
    vmh_stats_json_head(&b);
    jb_printf(&b, ",\n");
    vmh_stats_json_gauges(&b);
    vmh_stats_json_devices(&b);
    jb_printf(&b, ",\n  \"pinned_host_bytes\": {\"current\": %lld, \"peak\": %lld},\n",
              (long long)atomic_load(&pinned_now), (long long)atomic_load(&pinned_peak));
    jb_printf(&b, "  \"tags\": ");
    tags_json(&b, 4);
    jb_printf(&b, "\n}\n");
    if (b.need > (size_t)INT_MAX)
        return -1;
    return (int)b.need;
}

/* ---- exit table ------------------------------------------------------------------------------ */

void vmh_tags_report_table(void)
{
    unsigned n = vmh_tag_count();
    if (n == 1 && !vmh_tag_pauses(0))
        return;
    for (unsigned t = 0; t < n; t++) {
        char req[32], mapped[32], paused[32], backed[32];
        int64_t r = vmh_tag_requested(t);
        vmh_tag_memory_t m = tag_memory(t);
        vmh_log("  tag %-31s requested %s, mapped %s, paused %s (%s backed up)", tag_names[t],
                vmh_fmt_bytes(req, sizeof req, r > 0 ? (unsigned long long)r : 0),
                vmh_fmt_bytes(mapped, sizeof mapped, m.mapped),
                vmh_fmt_bytes(paused, sizeof paused, m.paused),
                vmh_fmt_bytes(backed, sizeof backed, m.backed_up));
        const tag_stats_t *s = &stats[t];
        if (atomic_load(&s->pauses) || atomic_load(&s->resumes))
            vmh_log("  tag %-31s %llu pauses in %.3f s, %llu resumes in %.3f s", tag_names[t],
                    (unsigned long long)atomic_load(&s->pauses), seconds(atomic_load(&s->pause_ns)),
                    (unsigned long long)atomic_load(&s->resumes),
                    seconds(atomic_load(&s->resume_ns)));
    }
    char now[32], peak[32];
    int64_t c = atomic_load(&pinned_now), p = atomic_load(&pinned_peak);
    if (p > 0)
        vmh_log("  %-*s now %12s  peak %12s", vmh_stats_label_width(),
                "pinned host memory kept for backups",
                vmh_fmt_bytes(now, sizeof now, c > 0 ? (unsigned long long)c : 0),
                vmh_fmt_bytes(peak, sizeof peak, (unsigned long long)p));
}

#ifdef VMH_TESTING
void vmh_tags_reset(void)
{
    pthread_mutex_lock(&register_lock);
    atomic_store(&tag_count, 1);
    for (unsigned t = 1; t < VMM_TAGS_MAX; t++)
        tag_names[t][0] = '\0';
    memset(stats, 0, sizeof stats);
    for (unsigned t = 0; t < VMM_TAGS_MAX; t++)
        atomic_store(&tag_states[t], VMH_TAG_RUNNING);
    atomic_store(&pinned_now, 0);
    atomic_store(&pinned_peak, 0);
    pthread_mutex_unlock(&register_lock);
    vmh_thread.tag_depth = 0;
}
#endif
