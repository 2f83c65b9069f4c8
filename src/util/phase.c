/* The process's phase (phase.h). */
#include "phase.h"

atomic_int vmh_phase_now = VMH_PHASE_RUNNING;

/* Moves the stage from one of those in `from` (a bit per stage) to `to`, keeping FORKED. */
static bool move_stage(unsigned from, int to)
{
    int old = atomic_load(&vmh_phase_now);
    do {
        if (!(from & 1u << (old & VMH_PHASE_STAGE)))
            return false;
    } while (!atomic_compare_exchange_weak(&vmh_phase_now, &old, (old & ~VMH_PHASE_STAGE) | to));
    return true;
}

void vmh_phase_exit_begins(void)
{
    move_stage(1u << VMH_PHASE_RUNNING, VMH_PHASE_EXITING);
}

bool vmh_phase_exited(void)
{
    return move_stage(1u << VMH_PHASE_RUNNING | 1u << VMH_PHASE_EXITING, VMH_PHASE_EXITED);
}

void vmh_phase_forked(bool pass_through)
{
    int old = atomic_load(&vmh_phase_now);
    int now = old | VMH_PHASE_FORKED;
    if (pass_through)
        now = (now & ~VMH_PHASE_STAGE) | VMH_PHASE_CHILD;
    atomic_store(&vmh_phase_now, now); /* only this thread exists in the child */
}

#ifdef VMH_TESTING
void vmh_phase_reset(void)
{
    atomic_fetch_and(&vmh_phase_now, VMH_PHASE_FORKED);
}
#endif
