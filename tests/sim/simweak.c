/* Fallbacks for entry points added to the driver table that simdrv.c does not implement yet:
 * they are counted, fault-injectable, and answer CUDA_ERROR_NOT_SUPPORTED. simdrv.c's real
 * implementations override them (these are weak). */
#include "simint.h"

#define SIM_WEAK(name, params) \
    __attribute__((weak)) CUresult SIM_IMPL(name) params { return sim_unimplemented(SIM_E_##name); }
SIM_ALL_FUNCS(SIM_WEAK)
#undef SIM_WEAK
