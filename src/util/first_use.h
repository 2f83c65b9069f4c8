/* The first use of the library's process-wide locks (layer 0, a leaf).
 *
 * Reports of contexts and captures arrive from the program's first CUDA calls, before the
 * library starts, and a fork may come at any time after: the first time any of those locks is
 * taken, the function lifetime.c handed over runs (it registers the fork handlers that make the
 * locks anew in a child). The hook lives in this leaf so that every file of the contexts layer
 * takes its locks through it without calling one another.
 */
#ifndef VMH_FIRST_USE_H
#define VMH_FIRST_USE_H

#include "witness.h"

#include <pthread.h>

/* fn runs at the first vmh_first_use_lock (also by several threads at once: it must be
 * idempotent). Set once, at load, by lifetime.c. */
void vmh_first_use_set(void (*fn)(void));

/* Takes m at its rank (witness.h), running the hook first if it never ran. */
void vmh_first_use_lock(pthread_mutex_t *m, vmh_rank_t rank);

#endif
