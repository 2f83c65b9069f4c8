/* See ipt.h. Needs libipt_dep.so, which is therefore in this library's local scope only. */
#include <dlfcn.h>

#include "ipt.h"

void *ipt_local_default(const char *name)
{
    return dlsym(RTLD_DEFAULT, name);
}

void *ipt_local_next(const char *name)
{
    return dlsym(RTLD_NEXT, name);
}

/* Referenced so that --as-needed keeps libipt_dep.so as a dependency. */
int ipt_local_uses_dep(void);
int ipt_local_uses_dep(void)
{
    return ipt_dep_value();
}
