/* The library's lifetime: start, exit, fork (see lifetime.h). The only owner of "what happens
 * after": the layers below are told (vmh_heap_shutdown, vmh_heap_forked_child, ...) and keep no
 * flags of their own about it.
 *
 * Process events have one owner, this file: it alone registers fork handlers (pthread_atfork)
 * and an exit handler (atexit), once each, and calls each layer's step in one order:
 *
 *   prefork (the fork's prepare)  top down: the IPC import table's lock, the listener's, the
 *       export table's. A thread of a higher layer may hold its lock while it calls a lower one
 *       (an export under the table lock calls the driver and the heap), never the reverse, so
 *       taking the higher lock first never waits for a thread that waits for a lock already
 *       taken here. The three IPC locks are never held together, so their own order is free.
 *       No lower layer's lock is taken: contexts.c makes its locks anew in the child and the
 *       heap and the reclaim thread are never used in a child (pass-through); taking them
 *       here would wait for a context synchronize of the reclaim thread.
 *   parent                        the prefork locks released, in reverse order.
 *   child                         the prefork locks released, then each layer bottom up:
 *       contexts (locks anew; the parent's other threads' waits and captures dropped), the
 *       reclaim thread (it does not exist here), then, if the parent used the driver through
 *       the library, the heap (pass-through) and IPC (stopped). Lower layers first, as at start:
 *       a higher layer's step may then rely on the layers below being usable in the child.
 *       Each runs once, atomics and lock initialization only.
 *   exit                          top down: IPC (the listener stops taking connections, the
 *       export table stops calling the driver), then the reclaim thread (stopped and joined).
 *       Users stop before what they use: the listener's last prunes may park frees.
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
 * teardown. The destructor (vmh_lifetime_exit) reports afterwards; it is not an exit handler
 * of the C library.
 */
#include "lifetime.h"
#include "contexts.h"

#include "cache.h"
#include "device.h"
#include "driver.h"
#include "first_use.h"
#include "heap.h"
#include "ipc.h"
#include "ipc_export.h"
#include "ipc_import.h"
#include "ipc_listener.h"
#include "log.h"
#include "overflow.h"
#include "pause.h"
#include "reclaim.h"
#include "stats.h"
#include "tags.h"
#include "testable.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { LIFE_RUNNING, LIFE_EXITED, LIFE_CHILD };

static pthread_once_t started = PTHREAD_ONCE_INIT;
static atomic_bool start_done; /* the once above completed (the fork handler reads it) */
static atomic_int phase = LIFE_RUNNING;
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
                                                  .refuse = vmh_lifetime_refuse});
    vmh_cache_configure(&(vmh_cache_settings_t){.limit = o->cache_limit});
    vmh_reclaim_configure(&(vmh_reclaim_settings_t){.park_limit = o->park_limit});
    vmh_overflow_configure(o->overflow == VMH_OVERFLOW_HOST, o->overflow_limit);
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
    vmh_lifetime_configure(o);
    vmh_pause_configure(o->pin_limit);
    atomic_store(&start_done, true);
}

bool vmh_lifetime_ready(void)
{
    /* A child never runs the once: another thread of the parent may have been inside it. */
    if (atomic_load_explicit(&phase, memory_order_relaxed) == LIFE_CHILD)
        return false;
    pthread_once(&started, start);
    return !opts->disable && atomic_load_explicit(&phase, memory_order_relaxed) == LIFE_RUNNING &&
           vmh_driver_ready();
}

const vmh_options_t *vmh_lifetime_options(void)
{
    return opts;
}

/* ---- process events ------------------------------------------------------------------------ */

static atomic_bool ipc_begun; /* IPC exported once: its part of the exit step runs */

#ifdef VMH_TESTING
/* Each step, as it runs, appends its letter (tests read it in the child and the parent). */
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

/* IPC's part of the exit step: the listener and the export table stop calling the driver. */
VMH_TESTABLE void vmh_lifetime_ipc_exit(void)
{
    step('L');
    vmh_ipc_listener_shutdown();
    step('E');
    vmh_ipc_export_shutdown(); /* on return no driver call of the table is in flight */
}

static void at_exit(void)
{
    if (atomic_load(&ipc_begun))
        vmh_lifetime_ipc_exit();
    step('R');
    vmh_reclaim_stop(true); /* frees after this stay parked or wait on the allocating thread */
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
    step('i');
    vmh_ipc_import_prefork();
    step('l');
    vmh_ipc_listener_prefork();
    step('e');
    vmh_ipc_export_prefork();
}

static void release_prefork_locks(void)
{
    vmh_ipc_export_postfork();
    vmh_ipc_listener_postfork();
    vmh_ipc_import_postfork();
}

static void postfork_parent(void)
{
    step('p');
    release_prefork_locks();
}

/* In the child, right after fork(): only atomics and lock initialization, no driver call, no
 * allocation. */
VMH_TESTABLE void vmh_lifetime_fork_child(void)
{
    step('c');
    release_prefork_locks();
    step('C');
    vmh_contexts_after_fork_child(); /* no context or capture report may block the child */
    vmh_captures_after_fork_child();
    step('R');
    vmh_reclaim_forked_child();
    if (!atomic_load(&start_done) || !vmh_driver_loaded())
        return; /* the parent never used the driver: the child may, natively or through us */
    atomic_store(&phase, LIFE_CHILD);
    step('H');
    vmh_heap_forked_child();
    step('I');
    vmh_ipc_stop();
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
    atomic_store(&ipc_begun, true);
    process_events_needed();
}

/* Reports at exit; from here on every entry point passes through (late frees from other
 * destructors are accepted quietly). Nothing runs in a process that never used the driver,
 * nor in a forked child (its parent reports). */
VMH_TESTABLE void vmh_lifetime_exit(void)
{
    int expected = LIFE_RUNNING;
    if (!vmh_driver_loaded() || !opts ||
        !atomic_compare_exchange_strong(&phase, &expected, LIFE_EXITED))
        return;
    vmh_ipc_stop();
    vmh_heap_shutdown(opts->leaks);
    vmh_stats_report();
}

__attribute__((destructor)) static void lifetime_destructor(void)
{
    vmh_lifetime_exit();
}
