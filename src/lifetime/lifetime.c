/* The library's lifetime: start, exit, fork (see lifetime.h). The only owner of "what happens
 * after": it alone moves the process's phase (phase.h: RUNNING, EXITING, EXITED, CHILD, and
 * the FORKED bit), which every layer reads; no layer keeps a flag of its own about exit or fork.
 *
 * Process events have one owner, this file: it alone registers fork handlers (pthread_atfork)
 * and an exit handler (atexit), once each, and walks the layers' step sets (phase.h's
 * vmh_steps_t; the table `layers` below, bottom up: contexts, reclaim, IPC) in one order:
 *
 *   prefork (the fork's prepare)  top down: IPC takes its import table's lock, the listener's,
 *       the export table's (ipc.c). A thread of a higher layer may hold its lock while it calls
 *       a lower one (an export under the table lock calls the driver and the heap), never the
 *       reverse, so taking the higher lock first never waits for a thread that waits for a lock
 *       already taken here. No lower layer's lock is taken: contexts.c makes its locks anew in
 *       the child and the heap and the reclaim thread are never used in a child (pass-through,
 *       or no thread); taking them here would wait for a context synchronize of the reclaim
 *       thread.
 *   parent                        bottom up: the prefork locks released (IPC, in reverse order).
 *   child                         the phase first (FORKED, and CHILD when the parent started the
 *       library: the heap passes through, IPC's last closes forget their mappings, the reclaim
 *       thread is not here and none starts), then each layer bottom up: contexts (locks anew;
 *       the parent's other threads' waits and captures dropped), IPC (its prefork locks
 *       released). Lower layers first, as at start: a higher layer's step may then rely on the
 *       layers below being usable in the child. Each runs once, atomics and lock
 *       initialization only.
 *   exit                          the phase first (EXITING: no background thread starts, the
 *       IPC listener stops at its next wake, the export table refuses), then top down: IPC
 *       (the export table's driver call in flight, if any, ends), then the reclaim thread
 *       (stopped and joined). Users stop before what they use: the listener's last prunes may
 *       park frees.
 *
 * The library's other threads need no event: the copy pool's workers and the pinner live
 * inside one pause call, which starts and joins them (staging.c); every thread is started by
 * thread_state.c.
 *
 * When: the fork handlers at the first of: the first use of contexts.c's locks (a context or
 * capture report, or the first served allocation asking for its context), the reclaim thread's
 * start, IPC's first export. Before that no layer has state a child must drop (no context, no
 * thread, no served pointer: serving asks contexts.c first), and every one of those comes after
 * the driver's first successful call, so after the driver registered its own fork handlers,
 * wherever it does that (the simulated one: at load). This matters for prefork: handlers run
 * in reverse order of registration, so ours runs before the driver's. A thread may hold the
 * export table's lock while it calls the driver, which takes the driver's lock; were the
 * driver's prepare to run first (it takes that lock: the simulated driver does, TSan reported
 * the inversion when ours was registered at load), ours would wait for that thread, which
 * waits for the forking thread: a deadlock. The exit handler at the first of: the reclaim
 * thread's start, IPC's first export; both come after the CUDA runtime and the driver were
 * initialized, so it is registered after their own exit handlers and runs before them (atexit
 * handlers run in reverse order of registration): no driver call of ours after their
 * teardown. The destructor (vmh_lifetime_exit) moves the phase to EXITED and reports
 * afterwards; it is not an exit handler of the C library.
 */
#include "lifetime.h"
#include "contexts.h"

#include "cache.h"
#include "device.h"
#include "driver.h"
#include "first_use.h"
#include "heap.h"
#include "ipc.h"
#include "log.h"
#include "overflow.h"
#include "pause.h"
#include "phase.h"
#include "reclaim.h"
#include "stats.h"
#include "tags.h"
#include "testable.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pthread_once_t started = PTHREAD_ONCE_INIT;
static atomic_bool start_done; /* the once above completed (the fork handler reads it) */
/* The options the layers were configured from: the snapshot (a test's own options in the
 * tests). Read for VMMHOOK_DISABLE, VMMHOOK_LEAKS, and to name a refused value. */
static const vmh_options_t *opts;

static void ipc_began(void);

/* ---- settings: each layer's, made from the options ------------------------------------------
 * The layers below never see the options: each takes the small struct of its own header
 * (vmh_device_settings_t, ...), made here, once, at start. */

/* Which variables have had their one refusal warning (bit = row of the table). */
static _Atomic uint64_t refused_mask;

/* The refusal policy the layers are handed (log.h's vmh_refuse_fn): one warning per variable,
 * however many devices ask, "VMMHOOK_X=value is refused: <why>; accepted: <forms>; using
 * <instead>", the value as the options hold it; with VMMHOOK_STRICT the program stops. */
VMH_TESTABLE void vmh_lifetime_refuse(const char *name, const char *why, const char *instead)
{
    size_t row = 0, rows = vmh_options_count();
    while (row < rows && strcmp(vmh_options_name(row), name) != 0)
        row++;
    vmh_option_info_t info;
    char v[300], q[80];
    const char *forms = "?";
    if (row < rows && vmh_options_info(row, &info)) {
        uint64_t bit = row < 64 ? (uint64_t)1 << row : 0;
        if (!opts->strict && (atomic_fetch_or(&refused_mask, bit) & bit))
            return;
        vmh_options_format(opts, row, v, sizeof v);
        vmh_fmt_quoted(q, sizeof q, v, 64);
        forms = info.forms;
    } else {
        snprintf(q, sizeof q, "(unknown)");
    }
    if (opts->strict) {
        vmh_log("%s=%s is refused: %s; accepted: %s; stopping because VMMHOOK_STRICT is set", name,
                q, why, forms);
        vmh_log_stop();
        return;
    }
    vmh_log("%s=%s is refused: %s; accepted: %s; using %s", name, q, why, forms, instead);
}

/* The statistics' settings: opens the trace when one is asked for (its clock starts then). */
VMH_TESTABLE void vmh_lifetime_configure_stats(const vmh_options_t *o)
{
    opts = o;
    vmh_stats_configure(&(vmh_stats_settings_t){.stats = o->stats,
                                                .leaks = o->leaks,
                                                .trace = o->trace,
                                                .json = o->stats_json,
                                                .refuse = vmh_lifetime_refuse});
}

/* The heap's settings and those of the layers under it, and IPC's. */
VMH_TESTABLE void vmh_lifetime_configure(const vmh_options_t *o)
{
    opts = o;
    vmh_device_configure(&(vmh_device_settings_t){.gran_mode = o->gran_mode,
                                                  .gran_bytes = o->gran_bytes,
                                                  .handle = o->handle,
                                                  .rdma = o->rdma,
                                                  .peers = o->peers,
                                                  .mem_limit = o->mem_limit,
                                                  .va_limit = o->va_limit,
                                                  .headroom = o->headroom,
                                                  .chunk_max = o->chunk_max,
                                                  .refuse = vmh_lifetime_refuse});
    vmh_cache_configure(&(vmh_cache_settings_t){.limit = o->cache_limit});
    vmh_reclaim_configure(&(vmh_reclaim_settings_t){.park_limit = o->park_limit});
    vmh_overflow_configure(o->overflow == VMH_OVERFLOW_HOST, o->overflow_limit);
    vmh_overflow_set_reserve(o->overflow_reserve);
    vmh_heap_configure(&(vmh_heap_settings_t){.pack_below = o->pack_below,
                                              .stream_ordered = o->stream_ordered,
                                              .free_sync = o->free_sync});
    vmh_ipc_configure(&(vmh_ipc_settings_t){.handle = o->handle}, ipc_began);
}

static void start(void)
{
    const vmh_options_t *o = vmh_options_load();
    vmh_log_set_verbose(o->verbose);
    vmh_lifetime_configure_stats(o); /* the trace clock starts here, the trace file exists */
    vmh_stats_set_tag_report(vmh_tags_report_table, vmh_tags_json);
    vmh_stats_set_device_report(vmh_heap_stats_devices);
    vmh_lifetime_configure(o);
    vmh_pause_configure(o->pin_limit);
    atomic_store(&start_done, true);
}

bool vmh_lifetime_ready(void)
{
    /* A child never runs the once: another thread of the parent may have been inside it. */
    if (vmh_phase_stage() == VMH_PHASE_CHILD)
        return false;
    pthread_once(&started, start);
    return !opts->disable && vmh_phase_serving() && vmh_driver_ready();
}

const vmh_options_t *vmh_lifetime_options(void)
{
    return opts;
}

/* ---- process events ------------------------------------------------------------------------ */

/* The layers with process-event steps (phase.h), bottom up as in docs/DESIGN.md's table; the
 * order of each walk is written in this file's header comment. */
static const vmh_steps_t *const layers[] = {
    &vmh_contexts_steps, /* 1b. contexts: its locks, the other threads' waits and captures */
    &vmh_reclaim_steps,  /* 4b. reclaim: the reclaim thread */
    &vmh_ipc_steps,      /* 8. sharing: its three locks, the export table's calls */
};
enum { NLAYERS = sizeof layers / sizeof layers[0] };

enum event { PREFORK, PARENT, CHILD, EXIT };

static void (*step_of(const vmh_steps_t *l, enum event e))(void)
{
    switch (e) {
    case PREFORK:
        return l->prefork;
    case PARENT:
        return l->parent;
    case CHILD:
        return l->child;
    case EXIT:
        return l->exit;
    }
    return NULL;
}

#ifdef VMH_TESTING
/* Each event, as it begins, appends its letter (f, p, c, x: prefork, parent, child, exit), and
 * each step as it runs its layer's (tests read it in the child and the parent). */
static char step_log[64];
static atomic_uint step_len;

static void step(char c)
{
    unsigned i = atomic_fetch_add(&step_len, 1);
    if (i + 1 < sizeof step_log)
        step_log[i] = c;
}

void vmh_lifetime_refuse_reset(void)
{
    atomic_store(&refused_mask, 0);
}

const char *vmh_lifetime_steps(void)
{
    unsigned n = atomic_load(&step_len);
    step_log[n < sizeof step_log ? n : sizeof step_log - 1] = '\0';
    return step_log;
}

void vmh_lifetime_steps_clear(void)
{
    atomic_store(&step_len, 0);
}
#else
#define step(c) ((void)0)
#endif

/* Runs the event's step of every layer that has one: bottom up, or top down. */
static void walk(enum event e, bool top_down)
{
    for (size_t k = 0; k < NLAYERS; k++) {
        const vmh_steps_t *l = layers[top_down ? NLAYERS - 1 - k : k];
        void (*fn)(void) = step_of(l, e);
        if (fn) {
            step(l->letter);
            fn();
        }
    }
}

/* The exit handler: the phase first (no background thread starts, the export table and the
 * listener stop), then each layer top down: users stop before what they use (the listener's last
 * prunes may park frees: the export table waits for its calls in flight, then the reclaim
 * thread is stopped and joined). */
VMH_TESTABLE void vmh_lifetime_at_exit(void)
{
    step('x');
    vmh_phase_exit_begins();
    walk(EXIT, true);
}

static void at_exit(void)
{
    vmh_lifetime_at_exit();
}

static pthread_once_t exit_once = PTHREAD_ONCE_INIT;

static void register_exit(void)
{
    atexit(at_exit);
}

static void prefork(void);
static void postfork_parent(void);
VMH_TESTABLE void vmh_lifetime_fork_child(void);
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void register_fork(void)
{
    pthread_atfork(prefork, postfork_parent, vmh_lifetime_fork_child);
}

/* contexts.c's locks are used for the first time: the fork handlers, once (see the header). */
static void fork_handlers_needed(void)
{
    pthread_once(&fork_once, register_fork);
}

/* The reclaim thread started, or IPC begins: the fork handlers and the exit handler, once each
 * (see the header). */
static void process_events_needed(void)
{
    fork_handlers_needed();
    pthread_once(&exit_once, register_exit);
}

static void prefork(void)
{
    step('f');
    walk(PREFORK, true);
}

static void postfork_parent(void)
{
    step('p');
    walk(PARENT, false);
}

/* In the child, right after fork(): only atomics and lock initialization, no driver call, no
 * allocation. The phase first, so that every step sees the child's. */
VMH_TESTABLE void vmh_lifetime_fork_child(void)
{
    step('c');
    /* A parent that used the driver through the library: the child passes everything through.
     * Otherwise the child may use it, natively or through us (without a reclaim thread). */
    vmh_phase_forked(atomic_load(&start_done) && vmh_driver_loaded());
    walk(CHILD, false);
}

/* At load: the layers that say when the handlers are needed are handed the functions that
 * register them (no layer includes this one). Registers nothing itself. */
__attribute__((constructor)) static void lifetime_load(void)
{
    vmh_first_use_set(fork_handlers_needed);
    vmh_reclaim_on_first_start(process_events_needed);
}

/* IPC calls this before each export (vmh_ipc_configure). */
static void ipc_began(void)
{
    process_events_needed();
}

/* Reports at exit; from here on every entry point passes through (late frees from other
 * destructors are accepted quietly). Nothing runs in a process that never used the driver,
 * nor in a forked child (its parent reports). */
VMH_TESTABLE void vmh_lifetime_exit(void)
{
    if (!vmh_driver_loaded() || !opts || !vmh_phase_exited())
        return;
    vmh_heap_shutdown(opts->leaks);
    vmh_stats_report();
}

__attribute__((destructor)) static void lifetime_destructor(void)
{
    vmh_lifetime_exit();
}
