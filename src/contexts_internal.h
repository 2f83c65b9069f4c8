/* Internal to the contexts layer (contexts.c, captures.c, ctx_scope.c, one_queue.c): what one
 * of its files asks of another. The layer's interface to the rest of the library is contexts.h;
 * nothing outside the layer includes this. */
#ifndef VMH_CONTEXTS_INTERNAL_H
#define VMH_CONTEXTS_INTERNAL_H

#include "contexts.h"

#include "witness.h"

#include <pthread.h>
#include <stddef.h>

/* Takes one of the layer's locks (contexts.c): the first use of any of them runs the function
 * lifetime.c handed over (vmh_contexts_on_first_use), which registers its fork handler. */
void vmh_contexts_lock(pthread_mutex_t *m, vmh_rank_t rank);

/* The calling thread's current context as cached by vmh_ctx_current (contexts.c), without
 * asking the driver; NULL when nothing valid is cached. */
CUcontext vmh_ctx_cached(void);

/* The distinct devices of the known contexts, at most `max` of them, into devices[] (contexts.c);
 * returns how many. */
size_t vmh_ctx_devices(int *devices, size_t max);

/* Enters ctx with `current` the thread's current context (NULL: unknown, so push): the scope of
 * vmh_ctx_enter with the caller's own knowledge of what is current (ctx_scope.c). */
CUresult vmh_ctx_scope_enter(CUcontext ctx, CUcontext current, vmh_ctx_scope_t *scope);

/* The gate between the library's synchronizes and the program's capture begins (captures.c): a
 * synchronize counts itself in unless a capture is in progress or beginning (false: it must not
 * synchronize), and counts itself out when done. */
bool vmh_capture_gate_sync_enter(void);
void vmh_capture_gate_sync_leave(void);

/* Each file's step in a forked child (only the calling thread exists) and in the tests' reset,
 * called by contexts.c's vmh_contexts_after_fork_child and vmh_contexts_reset. */
void vmh_captures_after_fork_child(void);
#ifdef VMH_TESTING
void vmh_captures_reset(void);
void vmh_ctx_scope_reset(void);
void vmh_work_reset(void);
#endif

#endif
