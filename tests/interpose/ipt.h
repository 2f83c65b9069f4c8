/* Helper libraries of ip_nocuda: what the real dlsym answers depends on who calls it
 * (RTLD_NEXT: the object after the caller; RTLD_DEFAULT: the caller's scope, which for a library
 * dlopen'ed RTLD_LOCAL includes its own dependencies). These libraries make the calls, so that
 * ip_nocuda can check the preloaded dlsym keeps those answers. */
#ifndef IPT_H
#define IPT_H

/* libipt_first.so and libipt_second.so both define ipt_value (1 and 2). */
int ipt_value(void);
int ipt_first_next(void);    /* ipt_value found by dlsym(RTLD_NEXT) from libipt_first: 2 */
int ipt_first_default(void); /* ipt_value found by dlsym(RTLD_DEFAULT): 1 */
int ipt_second_marker(void); /* keeps libipt_second linked (--as-needed) */

/* libipt_local.so (dlopen'ed RTLD_LOCAL), which needs libipt_dep.so. */
void *ipt_local_default(const char *name); /* dlsym(RTLD_DEFAULT, name) from libipt_local */
void *ipt_local_next(const char *name);    /* dlsym(RTLD_NEXT, name) from libipt_local */
int ipt_dep_value(void);                   /* 7, in libipt_dep */
int cuipt_dep_value(void);                 /* 8: a "cu" name that is not a driver's */

#endif
