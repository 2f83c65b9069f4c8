/* Internal to the contexts layer: what one of its files asks of another. The layer's interface
 * to the rest of the library is contexts.h; nothing outside the layer includes this. Its calls
 * point one way (check-layers checks it): ctx_wait.c uses contexts.c, captures.c, ctx_scope.c
 * and one_queue.c; ctx_scope.c uses contexts.c; contexts.c uses one_queue.c; every file takes
 * its locks through first_use.h. */
#ifndef VMH_CONTEXTS_INTERNAL_H
#define VMH_CONTEXTS_INTERNAL_H

#include "contexts.h"

#include "witness.h"

#include <pthread.h>
#include <stddef.h>

/* The calling thread's current context as cached by vmh_ctx_current (contexts.c), without
 * asking the driver; NULL when nothing valid is cached. */
CUcontext vmh_ctx_cached(void);

/* The distinct devices of the known contexts, at most `max` of them, into devices[] (contexts.c);
 * returns how many. */
size_t vmh_ctx_devices(int *devices, size_t max);

/* A wait on each known context of `device` (contexts.c), so that none is destroyed while the
 * caller synchronizes it: `current` (the calling thread's context, when not NULL) becomes known
 * first; *list gets the contexts (`one` when there is at most one, else allocated); returns how
 * many, SIZE_MAX when out of host memory (no wait taken). vmh_ctx_waits_end ends the waits: the
 * first `gone` of list are contexts the driver no longer has (forgotten by their last wait). */
size_t vmh_ctx_waits_begin(int device, CUcontext current, CUcontext **list, CUcontext *one);
void vmh_ctx_waits_end(CUcontext *list, size_t n, size_t gone, CUcontext *one);

/* Whether the end of the one-queue rule owes its wait, claimed once (one_queue.c). */
bool vmh_work_split_wait_claim(void);

/* Enters ctx with `current` the thread's current context (NULL: unknown, so push): the scope of
 * vmh_ctx_enter with the caller's own knowledge of what is current (ctx_scope.c). */
CUresult vmh_ctx_scope_enter(CUcontext ctx, CUcontext current, vmh_ctx_scope_t *scope);

/* The gate between the library's synchronizes and the program's capture begins (captures.c): a
 * synchronize counts itself in unless a capture is in progress or beginning (false: it must not
 * synchronize), and counts itself out when done. */
bool vmh_capture_gate_sync_enter(void);
void vmh_capture_gate_sync_leave(void);

/* Each file's part of the child step of a fork, called by ctx_wait.c's vmh_contexts_steps
 * (contexts.h says what they do). */
void vmh_contexts_after_fork_child(void);
void vmh_captures_after_fork_child(void);

/* Each file's step in the tests' reset, called by ctx_wait.c's vmh_contexts_reset. */
#ifdef VMH_TESTING
void vmh_contexts_known_reset(void);
void vmh_captures_reset(void);
void vmh_ctx_scope_reset(void);
void vmh_work_reset(void);
#endif

#endif
