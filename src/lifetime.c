/* The library's lifetime: start, exit, fork (see lifetime.h). The only owner of "what happens
 * after": the layers below are told (vmh_heap_shutdown, vmh_heap_forked_child) and keep no
 * flags of their own about it. */
#include "lifetime.h"
#include "contexts.h"

#include "driver.h"
#include "heap.h"
#include "ipc.h"
#include "ipc_export.h"
#include "ipc_listener.h"
#include "pause.h"
#include "stats.h"
#include "tags.h"
#include "testable.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

enum { LIFE_RUNNING, LIFE_EXITED, LIFE_CHILD };

static pthread_once_t started = PTHREAD_ONCE_INIT;
static atomic_bool start_done; /* the once above completed (the fork handler reads it) */
static atomic_int phase = LIFE_RUNNING;
static const vmh_options_t *snapshot;

/* In the child, right after fork(): only atomics, no lock, no driver call, no allocation. */
VMH_TESTABLE void vmh_lifetime_fork_child(void)
{
    if (!atomic_load(&start_done) || !vmh_driver_loaded())
        return; /* the parent never used the driver: the child may, natively or through us */
    atomic_store(&phase, LIFE_CHILD);
    vmh_ipc_stop();
    vmh_contexts_after_fork_child(); /* no context or capture report may block the child */
    vmh_heap_forked_child();
}

static void ipc_began(void);

static void start(void)
{
    snapshot = vmh_options_load();
    /* the trace clock starts here, and the trace file exists from now */
    vmh_stats_configure(snapshot);
    vmh_stats_set_tag_report(vmh_tags_report_table, vmh_tags_json);
    vmh_heap_configure(snapshot);
    vmh_pause_configure(snapshot);
    vmh_ipc_configure(snapshot, ipc_began);
    pthread_atfork(NULL, NULL, vmh_lifetime_fork_child);
    atomic_store(&start_done, true);
}

bool vmh_lifetime_ready(void)
{
    /* A child never runs the once: another thread of the parent may have been inside it. */
    if (atomic_load_explicit(&phase, memory_order_relaxed) == LIFE_CHILD)
        return false;
    pthread_once(&started, start);
    return !snapshot->disable &&
           atomic_load_explicit(&phase, memory_order_relaxed) == LIFE_RUNNING &&
           vmh_driver_ready();
}

const vmh_options_t *vmh_lifetime_options(void)
{
    return snapshot;
}

/* IPC's exit handler: the listener and the export table stop calling the driver. An atexit
 * handler, not the destructor: it must run before libcuda's own teardown, which the loader's
 * destructors (this library's included) may follow. */
VMH_TESTABLE void vmh_lifetime_ipc_exit(void)
{
    vmh_ipc_listener_shutdown();
    vmh_ipc_export_shutdown(); /* on return no driver call of the table is in flight */
}

/* The two IPC locks are never held together (ipc_listener.c), so their order here is free. */
static void ipc_prefork(void)
{
    vmh_ipc_listener_prefork();
    vmh_ipc_export_prefork();
}

static void ipc_postfork(void)
{
    vmh_ipc_export_postfork();
    vmh_ipc_listener_postfork();
}

static pthread_once_t ipc_hooks_once = PTHREAD_ONCE_INIT;

static void ipc_hooks(void)
{
    /* Registered after the driver was initialized (IPC needs a context): atexit handlers run
     * in reverse order of registration, so this one runs before any libcuda registered. */
    atexit(vmh_lifetime_ipc_exit);
    /* The IPC locks, taken around a fork so that a child inherits none held by another thread
     * (the listener prunes and exports under them). */
    pthread_atfork(ipc_prefork, ipc_postfork, ipc_postfork);
}

/* IPC calls this before each export (vmh_ipc_configure): the handlers above, once. */
static void ipc_began(void)
{
    pthread_once(&ipc_hooks_once, ipc_hooks);
}

/* Reports at exit; from here on every entry point passes through (late frees from other
 * destructors are accepted quietly). Nothing runs in a process that never used the driver,
 * nor in a forked child (its parent reports). */
VMH_TESTABLE void vmh_lifetime_exit(void)
{
    int expected = LIFE_RUNNING;
    if (!vmh_driver_loaded() || !snapshot ||
        !atomic_compare_exchange_strong(&phase, &expected, LIFE_EXITED))
        return;
    vmh_ipc_stop();
    vmh_heap_shutdown(snapshot->leaks);
    vmh_stats_report();
}

__attribute__((destructor)) static void lifetime_destructor(void)
{
    vmh_lifetime_exit();
}
