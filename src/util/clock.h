/* Layer "utilities": the library's one clock for durations and deadlines, CLOCK_MONOTONIC (no
 * jump when the wall clock is set, no time zone lookup, which could allocate or take locks
 * inside the driver). Timed waits on a condition variable keep CLOCK_REALTIME, the clock
 * pthread_cond_timedwait measures by default. */
#ifndef VMH_CLOCK_H
#define VMH_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Monotonic nanoseconds (an arbitrary origin: only differences mean anything). */
static inline uint64_t vmh_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#endif
