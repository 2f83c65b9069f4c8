/* The process's phase (layer 0, a leaf): what the library may still do in this process, one
 * atomic that every layer reads with one load; and the shape of a layer's process-event steps.
 *
 * The stages, in the order a process goes through them; each later one allows less, so a layer
 * asks `stage >= X` (the exit handler and the destructor of a forked child move its own stage
 * on, from RUNNING, like a parent's):
 *
 *   RUNNING   everything: the layers serve, the background threads may start.
 *   EXITING   the exit handler ran (lifetime.c's atexit handler, before libcuda's teardown): the
 *             reclaim thread is stopped and joined, IPC exports nothing and its listener stops;
 *             allocations and frees are still served (other exit handlers may still call).
 *   EXITED    the library's destructor ran (its reports): the heap serves nothing, late frees
 *             of served pointers are accepted without a driver call (the driver may be gone),
 *             an IPC import's last close forgets its mapping.
 *   CHILD     a forked child of a process that started the library: everything passes through
 *             (CUDA is not usable in such a child); no lock a parent thread may have held is
 *             taken, no report is written.
 *
 * FORKED, a bit beside the stage: this process is a forked child (set in every child, whether
 * or not its stage is CHILD). The parent's background threads do not exist here and their
 * records may be mid-change, so none is stopped, joined or started here (the reclaim thread;
 * IPC's listener checks the pid instead, a child gets its own). A child of a process that had
 * not started the library keeps RUNNING and serves once it starts, without a reclaim thread.
 *
 * Only lifetime.c changes the phase (its process events; the meson test `process-events`
 * fails when another file of src/ calls vmh_phase_exit_begins, vmh_phase_exited or
 * vmh_phase_forked); every transition is an atomic store, callable in a child right after
 * fork() and in exit handlers.
 */
#ifndef VMH_PHASE_H
#define VMH_PHASE_H

#include <stdatomic.h>
#include <stdbool.h>

enum {
    VMH_PHASE_RUNNING = 0,
    VMH_PHASE_EXITING = 1,
    VMH_PHASE_EXITED = 2,
    VMH_PHASE_CHILD = 3,
    VMH_PHASE_STAGE = 3,  /* the mask of the stage */
    VMH_PHASE_FORKED = 4, /* the bit: a forked child */
};

extern __attribute__((visibility("hidden"))) atomic_int vmh_phase_now;

/* The phase: the stage and the FORKED bit, in one load. Relaxed (the heap reads it on every
 * call): it orders nothing else. A layer that must know that none of its calls is in flight
 * after a change, or that every later call sees it, reads it under its own lock, which its
 * step takes after lifetime.c moved the phase (ipc_export.c; the reclaim thread's start). */
static inline int vmh_phase(void)
{
    return atomic_load_explicit(&vmh_phase_now, memory_order_relaxed);
}

/* The stage alone (VMH_PHASE_RUNNING ... VMH_PHASE_CHILD). */
static inline int vmh_phase_stage(void)
{
    return vmh_phase() & VMH_PHASE_STAGE;
}

/* Whether the layers serve calls: RUNNING or EXITING. */
static inline bool vmh_phase_serving(void)
{
    return vmh_phase_stage() <= VMH_PHASE_EXITING;
}

/* Whether a background thread of the process (the reclaim thread) may start: RUNNING, in a
 * process that is not a forked child. */
static inline bool vmh_phase_threads_may_start(void)
{
    return vmh_phase() == VMH_PHASE_RUNNING;
}

/* Whether this is a forked child: the parent's background threads are not here. */
static inline bool vmh_phase_forked_child(void)
{
    return (vmh_phase() & VMH_PHASE_FORKED) != 0;
}

/* ---- transitions: lifetime.c only ---- */

/* The exit handler runs: RUNNING becomes EXITING (any other stage stays). */
void vmh_phase_exit_begins(void);

/* The destructor runs: RUNNING or EXITING becomes EXITED. True when this call made the change
 * (once per process: the destructor's work runs once, and never in a CHILD). */
bool vmh_phase_exited(void);

/* In a forked child, before any layer's step: sets FORKED, and the stage CHILD when
 * pass_through (the parent had started the library). */
void vmh_phase_forked(bool pass_through);

#ifdef VMH_TESTING
/* Tests: the stage back to RUNNING (the FORKED bit stays), as a suite's reset serves again. */
void vmh_phase_reset(void);
#endif

/* ---- the process-event steps of a layer ---------------------------------------------------
 * Each layer with something to do at a fork or at exit exposes one of these (declared in its
 * header, `vmh_<layer>_steps`); lifetime.c walks them in the order written in its header
 * comment. Any step may be NULL. prefork/parent/child run in the fork handlers (child: only
 * atomics and lock initialization, no driver call, no allocation); exit runs in the exit
 * handler, after the stage became EXITING. */
typedef struct vmh_steps {
    char letter; /* the tests' log of the steps run (lifetime.h's vmh_lifetime_steps) */
    void (*prefork)(void);
    void (*parent)(void);
    void (*child)(void);
    void (*exit)(void);
} vmh_steps_t;

#endif
