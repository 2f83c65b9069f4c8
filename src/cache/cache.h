/* Layer "cache": idle ranges of a device kept for reuse.
 *
 * A buffer of its own, once freed and released (reclaim.h), comes here as a range: still
 * mapped, in the registry as idle (device.h's vmh_owner_idle), ready to serve a later buffer of
 * about its size without a driver call. The cache never holds more than VMMHOOK_CACHE_LIMIT
 * bytes; the least recently freed ranges go first. Guarded by its own mutex; no driver call
 * under it (ranges are destroyed after they are taken off).
 */
#ifndef VMH_CACHE_H
#define VMH_CACHE_H

#include "device.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

typedef struct vmh_idle vmh_idle_t;

typedef struct vmh_cache {
    vmh_dev_t *dev;
    pthread_mutex_t lock;
    vmh_idle_t *head, *tail; /* most recently put first */
    size_t count, bytes;
} vmh_cache_t;

/* What this layer takes from the options; the front makes it once, at start (lifetime.c). */
typedef struct vmh_cache_settings {
    size_t limit; /* VMMHOOK_CACHE_LIMIT: idle bytes kept per device */
} vmh_cache_settings_t;

/* Takes a copy of *s, before any device is used. */
void vmh_cache_configure(const vmh_cache_settings_t *s);

void vmh_cache_init(vmh_cache_t *c, vmh_dev_t *dev);

/* Keeps r (no queued work can touch it any more) for reuse, then gives back the least recently
 * freed ranges past the limit. */
void vmh_cache_put(vmh_cache_t *c, vmh_range_t *r);

/* An idle range of at least `rounded` bytes and at most 1/8 more, off the cache (still in the
 * registry as idle: the caller sets its own owner). The caller has taken `rounded` usable bytes
 * (vmh_dev_usable_take); the bytes beyond are taken here, and a larger range that would pass
 * VMMHOOK_MEM_LIMIT is not used. NULL when none fits. */
vmh_range_t *vmh_cache_take(vmh_cache_t *c, size_t rounded);

/* Before a miss makes `rounded` new bytes (`parked`: the device's bytes freed and not yet
 * reusable): gives back idle ranges so that the cache does not make the footprint grow beyond
 * the larger of the device's recent peak of live bytes (since the last trim; the cache then
 * holds what the program held at that peak and holds neither live nor parked now, within
 * VMMHOOK_CACHE_LIMIT) and the live bytes plus a small allowance (1/32 of them, or up to
 * 256 MiB within VMMHOOK_CACHE_LIMIT for programs that repeat a few sizes). */
void vmh_cache_make_room(vmh_cache_t *c, size_t rounded, size_t parked);

/* Gives back every idle range and resets the device's recent peak; returns the bytes. */
size_t vmh_cache_trim(vmh_cache_t *c);
/* Gives back idle ranges, least recently freed first, until at least `bytes` (or all there
 * are); the peak is kept (the background tidy, heap_upkeep.c); returns the bytes. */
size_t vmh_cache_trim_upto(vmh_cache_t *c, size_t bytes);

/* Idle bytes held (every one of them can serve an allocation: whole ranges). */
size_t vmh_cache_bytes(vmh_cache_t *c);

/* Tests: destroys everything held. */
void vmh_cache_destroy(vmh_cache_t *c);

#endif
