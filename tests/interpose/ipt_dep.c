/* See ipt.h. Also defines a function named like a driver entry point, to check that a "cu"
 * symbol of a library that is not libcuda is never replaced by the hook. */
#include "ipt.h"

int ipt_dep_value(void)
{
    return 7;
}

int cuipt_dep_value(void)
{
    return 8;
}

int cuMemAlloc_v2(void);
int cuMemAlloc_v2(void)
{
    return 42;
}
