/* The library's threads (thread_state.h): the library's only thread-local, and the only place
 * that starts a thread. */
#include "thread_state.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>

__thread vmh_thread_state_t vmh_thread __attribute__((tls_model("initial-exec")));

typedef struct start {
    void *(*fn)(void *);
    void *arg;
} start_t;

static void *thread_main(void *p)
{
    start_t s = *(start_t *)p;
    free(p);
    vmh_thread.background = true;
    return s.fn(s.arg);
}

int vmh_thread_start(pthread_t *thread, void *(*fn)(void *), void *arg)
{
    start_t *s = malloc(sizeof *s);
    if (s == NULL)
        return ENOMEM;
    *s = (start_t){fn, arg};
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = pthread_create(thread, NULL, thread_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0)
        free(s);
    return err;
}
