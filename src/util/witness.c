/* The lock-order checker of witness.h: each thread's locks held, in the order taken, with the
 * place each was taken; a violation is reported with both places and aborts the process (a
 * debug build's answer to a possible deadlock: the stack at the abort shows the taker).
 *
 * Nothing here allocates or takes a lock: it runs inside every ranked lock and before every
 * driver call. */
#include "witness.h"

#include "log.h"
#include "thread_state.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#if defined(VMH_WITNESS) || defined(VMH_TESTING)

static const struct {
    const char *name;
    bool driver; /* driver calls allowed while held */
} ranks[VMH_RANK_COUNT] = {[VMH_RANK_NONE] = {"NONE", true},
#define VMH_RANK_ROW(n, d, what) [VMH_RANK_##n] = {#n, d},
                           VMH_RANKS(VMH_RANK_ROW)
#undef VMH_RANK_ROW
};

/* Each thread's locks held are in its state (thread_state.h: held, nheld), with how many of
 * them forbid driver calls (no_driver: the check before a driver call is one load). */

#ifdef VMH_TESTING
void (*vmh_witness_on_violation)(const char *report);

unsigned vmh_witness_held_count(void)
{
    return vmh_thread.nheld;
}
#endif

static void violation(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void violation(const char *fmt, ...)
{
    char report[VMH_LOG_LINE_MAX - 32];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(report, sizeof report, fmt, ap);
    va_end(ap);
#ifdef VMH_TESTING
    if (vmh_witness_on_violation) {
        vmh_witness_on_violation(report);
        return;
    }
#endif
    vmh_log("lock order violated: %s", report);
    abort();
}

static const char *rank_name(vmh_rank_t rank)
{
    return rank > VMH_RANK_NONE && rank < VMH_RANK_COUNT ? ranks[rank].name : "(no rank)";
}

void vmh_witness_acquire(const void *lock, vmh_rank_t rank, const char *file, int line)
{
    if (rank <= VMH_RANK_NONE || rank >= VMH_RANK_COUNT) {
        violation("%s:%d takes %p with no rank", file, line, lock);
        return;
    }
    /* The held lock of the highest rank at or above this one: the one out of order. */
    const vmh_held_lock_t *worst = NULL;
    for (unsigned i = 0; i < vmh_thread.nheld; i++)
        if (vmh_thread.held[i].rank >= rank && (!worst || vmh_thread.held[i].rank > worst->rank))
            worst = &vmh_thread.held[i];
    if (worst)
        violation("%s:%d takes %s %p while holding %s %p (taken at %s:%d)%s", file, line,
                  rank_name(rank), lock, rank_name(worst->rank), worst->lock, worst->file,
                  worst->line, worst->lock == lock ? ": the same lock again" : "");
    if (vmh_thread.nheld == VMH_HELD_MAX) {
        violation("%s:%d takes %s %p while holding %d locks already", file, line, rank_name(rank),
                  lock, VMH_HELD_MAX);
        return;
    }
    vmh_thread.held[vmh_thread.nheld++] = (vmh_held_lock_t){lock, rank, file, line};
    vmh_thread.no_driver += !ranks[rank].driver;
}

void vmh_witness_release(const void *lock, const char *file, int line)
{
    for (unsigned i = vmh_thread.nheld; i-- > 0;) {
        if (vmh_thread.held[i].lock == lock) {
            vmh_thread.no_driver -= !ranks[vmh_thread.held[i].rank].driver;
            for (unsigned k = i + 1; k < vmh_thread.nheld; k++)
                vmh_thread.held[k - 1] = vmh_thread.held[k];
            vmh_thread.nheld--;
            return;
        }
    }
    violation("%s:%d releases %p, which this thread did not take through vmh_lock", file, line,
              lock);
}

void vmh_witness_assert_held(const void *lock, const char *file, int line)
{
    for (unsigned i = 0; i < vmh_thread.nheld; i++)
        if (vmh_thread.held[i].lock == lock)
            return;
    violation("%s:%d needs %p held, and this thread does not hold it", file, line, lock);
}

void vmh_witness_assert_none_above(vmh_rank_t rank, const char *file, int line)
{
    for (unsigned i = 0; i < vmh_thread.nheld; i++) {
        const vmh_held_lock_t *h = &vmh_thread.held[i];
        if (h->rank > rank) {
            violation("%s:%d holds %s %p (taken at %s:%d) where nothing above %s may be held", file,
                      line, rank_name(h->rank), h->lock, h->file, h->line,
                      rank > VMH_RANK_NONE ? rank_name(rank) : "no rank");
            return;
        }
    }
}

void vmh_witness_driver_call(void)
{
    if (__builtin_expect(vmh_thread.no_driver == 0, 1))
        return;
    for (unsigned i = vmh_thread.nheld; i-- > 0;) {
        const vmh_held_lock_t *h = &vmh_thread.held[i];
        if (!ranks[h->rank].driver) {
            violation("a driver call while holding %s %p (taken at %s:%d), under which none is "
                      "made",
                      rank_name(h->rank), h->lock, h->file, h->line);
            return;
        }
    }
}

#endif
