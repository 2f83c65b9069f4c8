/* Layer "lifetime" (beside lifetime.c): the one line VMMHOOK_VERBOSE=1 prints when the library is
 * loaded, so that a user can tell the hook is there even in a program that allocates nothing. Only
 * in the shipped library (not in the unit tests' core, nor in vmmhook-config). It reads the
 * environment and nothing else: no driver call, no option kept (the snapshot is still read at the
 * first CUDA call). */
#include "options.h"

__attribute__((constructor)) static void vmh_announce_load(void)
{
    vmh_options_announce(vmh_options_env_get, NULL);
}
