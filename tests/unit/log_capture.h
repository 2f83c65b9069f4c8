/* The library's log captured for the unit suites that check what it says: vmh_log_sink =
 * capture_sink; captured("text") counts the occurrences since the last capture_clear(). Safe
 * across threads (the listener, the reclaim thread log too). Header-only, as testutil.h. */
#ifndef VMH_LOG_CAPTURE_H
#define VMH_LOG_CAPTURE_H

#include <pthread.h>
#include <stddef.h>
#include <string.h>

static pthread_mutex_t cap_lock = PTHREAD_MUTEX_INITIALIZER;
static char cap_text[1 << 16];
static size_t cap_len;

static inline void capture_sink(const char *line, size_t len)
{
    pthread_mutex_lock(&cap_lock);
    if (cap_len + len < sizeof cap_text) {
        memcpy(cap_text + cap_len, line, len);
        cap_len += len;
        cap_text[cap_len] = '\0';
    }
    pthread_mutex_unlock(&cap_lock);
}

static inline size_t captured(const char *needle)
{
    pthread_mutex_lock(&cap_lock);
    size_t k = 0;
    for (const char *p = cap_text; (p = strstr(p, needle)) != NULL; p += strlen(needle))
        k++;
    pthread_mutex_unlock(&cap_lock);
    return k;
}

static inline void capture_clear(void)
{
    pthread_mutex_lock(&cap_lock);
    cap_len = 0;
    cap_text[0] = '\0';
    pthread_mutex_unlock(&cap_lock);
}

#endif
