/* Layer "utilities": the library's lock order, checked, and its internal asserts.
 *
 * Every lock whose place in the order matters has a rank below. A thread takes a lock only when
 * its rank is above the rank of every lock it already holds (so no two locks of one rank at
 * once: never two shards, never an own-chunk set and a shard); a cycle of waits between threads
 * would need a thread to take a lower rank while holding a higher one. Some ranks also forbid
 * driver calls while held (the heap's locks: one thread's slow cuMemCreate must not block
 * another's cache hit). This table is the one statement of the order; comments elsewhere and
 * docs/DESIGN.md point here.
 *
 * Checked, as jemalloc's witness does, in builds with VMH_WITNESS (meson -Dwitness: on by
 * default in debug and sanitizer builds, CI's ASan and TSan steps included): vmh_lock records
 * each lock in a thread-local list of the locks held and the place it was taken, and a lock
 * taken out of order, a lock released that was not taken through here, or a driver call under a
 * lock that forbids one writes both places to the log and aborts. Elsewhere every wrapper is the
 * bare pthread call.
 *
 * Checks by level, after mimalloc's mi_assert levels:
 *   assert(cond)               cheap, everywhere but release builds (b_ndebug=if-release);
 *   vmh_assert_internal(cond)  invariants of the design cheap enough to check on every call of
 *                              a debug or sanitizer build, with the lock order (VMH_WITNESS).
 */
#ifndef VMH_WITNESS_H
#define VMH_WITNESS_H

#include <assert.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

/* X(name, driver, what), outermost first: `driver` is whether driver calls may be made while
 * the lock is held. */
#define VMH_RANKS(X)                                                                               \
    X(PAUSE, true, "pause.c pause_lock: one pause or resume at a time, waits included")            \
    X(IPC_IMPORT, true,                                                                            \
      "ipc_import.c imp_lock: the import table (prefork takes the IPC locks "                      \
      "in this order)")                                                                            \
    X(IPC_LISTENER, true, "ipc_listener.c listen_lock: the listener's start and stop")             \
    X(IPC_EXPORT, true, "ipc_export.c table_lock: the export table, across the exporting calls")   \
    X(DEVICES, true, "heap_devices.c devs_lock: making a device's state")                          \
    X(TIDY, true, "heap_upkeep.c tidy_lock: one device's tidy (its wait and trims)")               \
    X(RECLAIM_WAIT, true,                                                                          \
      "reclaim.c wait_lock: one wait for the GPU per device, and the "                             \
      "releases after it")                                                                         \
    X(OWNER, false, "an own-chunk set's lock (ownchunk.c) or one carved shard's (carved.c)")       \
    X(OWNER_VISIT, true,                                                                           \
      "the same lock taken for pause.c's visit of its records: held across "                       \
      "the pause's driver calls, so that no other thread sees a record "                           \
      "half-changed (docs/SLEEP.md)")                                                              \
    X(SPILL, true, "overflow.c spill_lock: the host-memory budget, across the spill's creation")   \
    X(KEPT, false,                                                                                 \
      "staging.c kept_lock: the kept pinned backups (pause.c's visit gives one "                   \
      "back under a record's lock)")                                                               \
    X(CACHE, false, "cache.c: the idle ranges of a device")                                        \
    X(RECLAIM_QUEUE, false, "reclaim.c: a device's queue of parked items")                         \
    X(RECLAIM_STOP, true, "reclaim.c stop_lock: one stop of the reclaim thread at a time")         \
    X(RECLAIM_THREAD, false, "reclaim.c: the reclaim thread's state (a park starts or wakes it)")  \
    X(PARTS, false, "heap_devices.c parts_lock: making and freezing tags' parts")                  \
    X(ACCESS, true,                                                                                \
      "handle.c access_lock: peer grants against new mappings, across the mapping "                \
      "calls")                                                                                     \
    X(MAPS, true, "handle.c maps_lock: the list of mappings (a peer grant walks it)")              \
    X(CAPTURE_GATE, false, "captures.c gate_lock: library synchronizes against capture begins")    \
    X(CONTEXTS, false, "contexts.c ctx_lock: the known contexts")                                  \
    X(CAPTURES, false, "captures.c cap_lock: the captures in progress")

typedef enum vmh_rank {
    VMH_RANK_NONE,
#define VMH_RANK_ENUM(name, driver, what) VMH_RANK_##name,
    VMH_RANKS(VMH_RANK_ENUM)
#undef VMH_RANK_ENUM
        VMH_RANK_COUNT
} vmh_rank_t;

#if defined(VMH_WITNESS) || defined(VMH_TESTING)
/* The checker (the test build has it whatever the option, for test_witness.c). file and line:
 * the caller's place, for the report. */
void vmh_witness_acquire(const void *lock, vmh_rank_t rank, const char *file, int line);
void vmh_witness_release(const void *lock, const char *file, int line);
/* The calling thread holds lock. */
void vmh_witness_assert_held(const void *lock, const char *file, int line);
/* The calling thread holds no lock ranked above `rank` (VMH_RANK_NONE: no lock at all). */
void vmh_witness_assert_none_above(vmh_rank_t rank, const char *file, int line);
/* A driver call is about to be made (driver.c, every call). */
void vmh_witness_driver_call(void);
#endif

#ifdef VMH_TESTING
/* Tests: where a violation goes instead of the log and abort() (NULL: back to those). */
extern void (*vmh_witness_on_violation)(const char *report);
/* Tests: the locks the calling thread holds (as the checker knows them). */
unsigned vmh_witness_held_count(void);
#endif

#ifdef VMH_WITNESS
#define vmh_assert_internal(cond) assert(cond)
#define vmh_assert_held(lock) vmh_witness_assert_held((lock), __FILE__, __LINE__)
#define vmh_assert_none_above(rank) vmh_witness_assert_none_above((rank), __FILE__, __LINE__)
#else
/* Compiled out entirely: a helper used only inside these is defined under #ifdef VMH_WITNESS. */
#define vmh_assert_internal(cond) ((void)0)
#define vmh_assert_held(lock) ((void)0)
#define vmh_assert_none_above(rank) ((void)0)
#endif

/* The locks of the table above are taken and released only through these. */
#define vmh_lock(m, rank) vmh_lock_at((m), (rank), __FILE__, __LINE__)
#define vmh_trylock(m, rank) vmh_trylock_at((m), (rank), __FILE__, __LINE__)
#define vmh_unlock(m) vmh_unlock_at((m), __FILE__, __LINE__)
#define vmh_rdlock(l, rank) vmh_rdlock_at((l), (rank), __FILE__, __LINE__)
#define vmh_wrlock(l, rank) vmh_wrlock_at((l), (rank), __FILE__, __LINE__)
#define vmh_rwunlock(l) vmh_rwunlock_at((l), __FILE__, __LINE__)

#ifdef VMH_WITNESS
#define VMH_WITNESS_ACQUIRE(lock, rank) vmh_witness_acquire((lock), (rank), file, line)
#define VMH_WITNESS_RELEASE(lock) vmh_witness_release((lock), file, line)
#else
#define VMH_WITNESS_ACQUIRE(lock, rank) ((void)(lock), (void)(rank), (void)file, (void)line)
#define VMH_WITNESS_RELEASE(lock) ((void)(lock), (void)file, (void)line)
#endif

/* Checked before the lock is taken: a wrong order is reported instead of deadlocking. */
static inline void vmh_lock_at(pthread_mutex_t *m, vmh_rank_t rank, const char *file, int line)
{
    VMH_WITNESS_ACQUIRE(m, rank);
    pthread_mutex_lock(m);
}

/* A trylock cannot deadlock, but what the thread takes while holding it can: checked alike. */
static inline int vmh_trylock_at(pthread_mutex_t *m, vmh_rank_t rank, const char *file, int line)
{
    int rc = pthread_mutex_trylock(m);
    if (rc == 0)
        VMH_WITNESS_ACQUIRE(m, rank);
    return rc;
}

static inline void vmh_unlock_at(pthread_mutex_t *m, const char *file, int line)
{
    VMH_WITNESS_RELEASE(m);
    pthread_mutex_unlock(m);
}

/* A count read under the lock that guards it (the tests' views of a table's size): the lock
 * orders the read after every update made under it. */
#define vmh_read_locked(m, rank, v) vmh_read_locked_at((m), (rank), (v), __FILE__, __LINE__)

static inline size_t vmh_read_locked_at(pthread_mutex_t *m, vmh_rank_t rank, const size_t *v,
                                        const char *file, int line)
{
    vmh_lock_at(m, rank, file, line);
    size_t n = *v;
    vmh_unlock_at(m, file, line);
    return n;
}

static inline void vmh_rdlock_at(pthread_rwlock_t *l, vmh_rank_t rank, const char *file, int line)
{
    VMH_WITNESS_ACQUIRE(l, rank);
    pthread_rwlock_rdlock(l);
}

static inline void vmh_wrlock_at(pthread_rwlock_t *l, vmh_rank_t rank, const char *file, int line)
{
    VMH_WITNESS_ACQUIRE(l, rank);
    pthread_rwlock_wrlock(l);
}

static inline void vmh_rwunlock_at(pthread_rwlock_t *l, const char *file, int line)
{
    VMH_WITNESS_RELEASE(l);
    pthread_rwlock_unlock(l);
}

#endif
