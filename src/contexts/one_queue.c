/* The order of the program's work (contexts.h): while the program has made no stream and has
 * one context per device, its work on a device runs in one queue, and freed memory may serve
 * the next allocation at once. This file keeps whether that still holds, ends it when the
 * interposer or the heap reports a second queue (a stream, a second context, peer access), and
 * says whether the end owes a wait: one for every known context (ctx_wait.c), if anything was
 * reused at once before.
 * docs/DESIGN.md ("Frees") states the rule and what it cannot see.
 */
#include "contexts_internal.h"

#include "log.h"
#include "stats.h"

#include <execinfo.h>
#include <stdatomic.h>
#include <stdbool.h>

static atomic_bool work_split, work_split_unwaited, work_reused;
static const char *_Atomic work_split_why;

bool vmh_work_in_one_queue(void)
{
    return !atomic_load(&work_split);
}

const char *vmh_work_split_reason(void)
{
    return atomic_load(&work_split_why);
}

void vmh_work_queue_split(const char *why)
{
    /* A free that read "one queue" before this store (sequentially consistent) released its
     * block at once; the work it followed was submitted before that read, so before the wait
     * of vmh_work_split_wait begins: it covers that work. A free after the store parks. */
    if (atomic_exchange(&work_split, true))
        return;
    atomic_store(&work_split_why, why);
    atomic_store(&work_split_unwaited, true);
    vmh_count(VMH_STAT_queue_splits, 1);
    vmh_debug("the program's work is no longer in one queue per device (%s): frees park from "
              "now on; where the program did it:",
              why);
    if (vmh_log_verbose()) {
        /* Which code made the second queue (a library the program uses may make a stream of
         * its own): the frames, written straight to stderr without allocating. */
        void *frames[24];
        int n = backtrace(frames, 24);
        backtrace_symbols_fd(frames, n, 2);
    }
}

bool vmh_work_split_wait_pending(void)
{
    return atomic_load_explicit(&work_split_unwaited, memory_order_relaxed);
}

void vmh_work_note_reuse(void)
{
    if (!atomic_load(&work_reused))
        atomic_store(&work_reused, true);
}

bool vmh_work_split_wait_claim(void)
{
    return atomic_exchange(&work_split_unwaited, false) && atomic_load(&work_reused);
}

#ifdef VMH_TESTING
void vmh_work_reset(void)
{
    atomic_store(&work_split, false);
    atomic_store(&work_split_unwaited, false);
    atomic_store(&work_reused, false);
    atomic_store(&work_split_why, NULL);
}
#endif
