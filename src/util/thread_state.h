/* The library's threads (layer 0): each thread's state, every layer's per-thread fields in one
 * thread-local, and the start of the library's own threads.
 *
 * One struct, as jemalloc's tsd: what a thread carries is visible in one place, and it is one
 * initial-exec thread-local, so that no access goes through __tls_get_addr (which may allocate,
 * and runs inside the interposed dlsym). Each field belongs to the file named beside it; no
 * other file reads it unless its comment says so. Zero is every field's starting value in a new
 * thread.
 */
#ifndef VMH_THREAD_STATE_H
#define VMH_THREAD_STATE_H

#include "vmmhook.h" /* VMM_TAG_DEPTH_MAX */
#include "witness.h"

#include <cuda.h>
#include <pthread.h>
#include <stdbool.h>

/* The most locks one thread holds at once (witness.c); far more than the lock order allows. */
#define VMH_HELD_MAX 16

#if defined(VMH_WITNESS) || defined(VMH_TESTING)
/* A ranked lock held (witness.c): where it was taken. */
typedef struct vmh_held_lock {
    const void *lock;
    vmh_rank_t rank;
    const char *file;
    int line;
} vmh_held_lock_t;
#endif

typedef struct vmh_thread_state {
    /* interpose.c: depth inside the library (a call from inside goes straight to the driver) */
    unsigned ip_depth;
    /* contexts.c: the current context as last seen, trusted while `generation` is the global */
    struct {
        CUcontext ctx;
        int device;
        unsigned generation; /* 0: nothing cached */
    } current;
    /* captures.c: the capture interaction mode (0 is CU_STREAM_CAPTURE_MODE_GLOBAL) */
    CUstreamCaptureMode capture_mode;
    /* ctx_scope.c: the library's own scopes in a context */
    struct {
        CUcontext known;
        unsigned depth;
        bool unsure;
    } scope;
    /* stats.c: the counter shard (+ 1; 0: none given yet) */
    unsigned stats_shard;
    /* set by the library's own threads at their start (reclaim.c), read by driver.c: their
     * driver calls count as driver_calls_background too, so that what an allocating thread
     * pays shows apart */
    bool background;
    /* tags.c: the tag stack */
    unsigned char tag_stack[VMM_TAG_DEPTH_MAX];
    unsigned tag_depth;
    /* reclaim.c: a free in progress on this thread holds back the reclaim thread's wake
     * (vmh_reclaim_free_begin), and whether a park of it owes one */
    bool kick_held, kick_owed;
    /* carved_place.c: the shard this thread allocates in (+ 1; 0: none picked yet) */
    unsigned shard_mine;
    /* api.c: the driver's answer behind the last failed call of the public API */
    int last_driver_error;
#if defined(VMH_WITNESS) || defined(VMH_TESTING)
    /* witness.c: the ranked locks held, in the order taken, and how many forbid driver calls */
    vmh_held_lock_t held[VMH_HELD_MAX];
    unsigned nheld, no_driver;
#endif
} vmh_thread_state_t;

extern __attribute__((visibility("hidden"))) __thread vmh_thread_state_t vmh_thread
    __attribute__((tls_model("initial-exec")));

/* Starts one of the library's own threads: fn(arg) runs with every signal blocked (the
 * program's signals are never delivered to the library's threads; a new thread inherits its
 * creator's mask, so the mask is blocked around the creation) and with its state's `background`
 * set. The only pthread_create of the library. Answers pthread_create's error (0: started).
 *
 * The threads, and what stops them at the process's events (phase.h; lifetime.c walks the
 * steps, in the order its header comment gives):
 *   the reclaim thread (reclaim.c)  one per process, at the first park; starts only while the
 *       phase is RUNNING in a process that is not a forked child; exit: the reclaim layer's
 *       step stops and joins it; a fork: none in the child (the phase's FORKED bit).
 *   the IPC listener (ipc_listener.c)  one per process, at the first export; exit: it ends at
 *       its next wake once the phase left RUNNING; a fork: the child starts its own (by pid).
 *   the copy pool's workers (copypool.c), the pinner (staging.c)  inside one pause, started
 *       and joined by it: no process event concerns them. */
int vmh_thread_start(pthread_t *thread, void *(*fn)(void *), void *arg);

#endif
