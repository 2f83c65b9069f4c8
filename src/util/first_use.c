/* The first use of the library's process-wide locks (first_use.h). */
#include "first_use.h"

#include <stdatomic.h>
#include <stdbool.h>

static void (*_Atomic first_use_hook)(void);
static atomic_bool first_use_seen;

void vmh_first_use_set(void (*fn)(void))
{
    atomic_store(&first_use_hook, fn);
}

void vmh_first_use_lock(pthread_mutex_t *m, vmh_rank_t rank)
{
    if (!atomic_load_explicit(&first_use_seen, memory_order_acquire)) {
        void (*fn)(void) = atomic_load(&first_use_hook);
        if (fn) {
            fn(); /* idempotent: threads racing here may each call it */
            atomic_store_explicit(&first_use_seen, true, memory_order_release);
        }
    }
    vmh_lock(m, rank);
}
