/* See ipt.h. */
#include <dlfcn.h>

#include "ipt.h"

int ipt_value(void)
{
    return 1;
}

int ipt_first_next(void)
{
    int (*f)(void) = (int (*)(void))dlsym(RTLD_NEXT, "ipt_value");
    return f ? f() : -1;
}

int ipt_first_default(void)
{
    int (*f)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "ipt_value");
    return f ? f() : -1;
}
