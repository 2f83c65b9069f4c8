/* The library's lifetime, in one place: start, exit, fork, and what a call gets after each.
 *
 *   start   the first interposed or public call: options are read once into a snapshot, the
 *           statistics start, each layer gets its settings (a small struct of its own header)
 *           made from the snapshot here: the layers below never see the options. A value the
 *           machine refuses later is reported by this layer's policy, handed down with the
 *           settings (log.h's vmh_refuse_fn: one warning per variable, or VMMHOOK_STRICT's
 *           stop).
 *   exit    the library's destructor: the leak report and statistics, then the heap serves
 *           nothing more; late frees of served pointers (other libraries' destructors) are
 *           accepted quietly without a driver call, everything else passes through.
 *   fork    (handlers registered once, when first needed: lifetime.c says when and in which
 *           order the steps run; the process's phase, phase.h, says what a child may do)
 *           a child of a process that used the driver gets pass-through for everything: the
 *           driver answers as it does natively (CUDA is not usable in such a child). The child
 *           takes no lock another thread of the parent may have held, writes no report and
 *           reports no leak.
 *   IPC     start hands IPC its settings and a function it calls before each export
 *           (vmh_ipc_configure); from the first, the exit handler stops the IPC listener and
 *           export table before libcuda's teardown, and the fork handlers keep their locks
 *           from being inherited held (ipc.h's vmh_ipc_steps). IPC reads exit and a forked
 *           child from the phase: it includes nothing of this layer.
 *   events  lifetime.c is the only file that registers fork handlers (pthread_atfork) or an
 *           exit handler (atexit), once each, and the only one that changes the process's phase
 *           (phase.h); it walks each layer's step set (phase.h's vmh_steps_t: prefork / parent
 *           / child / exit) in one order, written in lifetime.c's header comment. The test
 *           `process-events` (tools/meson.build) fails when another file of src/ registers a
 *           handler or changes the phase.
 */
#ifndef VMH_LIFETIME_H
#define VMH_LIFETIME_H

#include "options.h"

#include <stdbool.h>

/* Starts the library once (see above); true while calls may be served: not disabled, not
 * exited, not a forked child, and a driver loaded. Call before anything else; false means
 * pass everything through. */
bool vmh_lifetime_ready(void);

/* The options the layers were configured from: the snapshot (valid after vmh_lifetime_ready;
 * NULL before). */
const vmh_options_t *vmh_lifetime_options(void);

#ifdef VMH_TESTING
/* What start does with the snapshot, for the tests' own options (o must outlive their use: a
 * refusal names its value from it): the settings of the heap, the layers under it and IPC;
 * those of the statistics (which opens the trace). Both may be called again to change them. */
void vmh_lifetime_configure(const vmh_options_t *o);
void vmh_lifetime_configure_stats(const vmh_options_t *o);
/* The refusal policy handed to the layers, and its reset (every variable may warn again). */
void vmh_lifetime_refuse(const char *name, const char *why, const char *instead);
void vmh_lifetime_refuse_reset(void);
/* Tests: what the destructor does at exit, what the fork handler does in a child (only there:
 * it releases the locks the prefork step took), and what the exit handler does (the phase
 * becomes EXITING: vmh_phase_reset, phase.h, serves again). */
void vmh_lifetime_exit(void);
void vmh_lifetime_fork_child(void);
void vmh_lifetime_at_exit(void);
/* The events and steps of the fork and exit handlers run in this process so far, one letter
 * each (see lifetime.c): prefork "fI" (the event's letter, then each step's layer: I for IPC),
 * parent "pI", child "cCI" (C for contexts), exit "xIR" (R for reclaim). A child starts with
 * its parent's letters up to the fork. */
const char *vmh_lifetime_steps(void);
void vmh_lifetime_steps_clear(void);
#endif

#endif
