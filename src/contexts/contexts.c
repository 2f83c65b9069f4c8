/* The process's contexts as the interposer reports them (contexts.h), and the library's waits
 * on them.
 *
 * Above the driver table, below the heap: the heap asks which contexts of a device to wait for;
 * the interposer tells, after each context call of the program, what changed. Two kinds of
 * state here:
 *   - the known contexts, per device, under ctx_lock; each counts the library's waits in
 *     progress on it, which vmh_ctx_forget (the program destroying it) waits out, because the
 *     driver must not destroy a context another thread has pushed for a synchronize;
 *   - each thread's current context, cached in a thread-local and trusted while the global
 *     generation is unchanged (the interposer invalidates the thread's own cache on every call
 *     that changes it; a destroy anywhere bumps the generation, so every thread asks the driver
 *     again once).
 * The rest of the layer: the captures in progress and the gate between synchronizes and capture
 * begins (captures.c), the library's own scopes in a context (ctx_scope.c), the rule that lets
 * freed memory be reused at once while the program's work runs in one queue (one_queue.c). This
 * file also holds the layer's lock wrapper and its fork and reset steps, which call the others'.
 *
 * Lock order: ctx_lock, cap_lock and gate_lock are never held together, nor across a driver
 * call (the last ranks of witness.h). All are made anew in a forked child (the layer's child
 * step, ctx_wait.c's vmh_contexts_steps, walked by lifetime.c's fork handler, registered at
 * their first use).
 */
#include "contexts_internal.h"

#include "driver.h"
#include "first_use.h"
#include "log.h"
#include "thread_state.h"
#include "witness.h"

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
 * Known contexts.
 */
typedef struct ctx_rec {
    CUcontext ctx;
    int device;
    unsigned waits;  /* vmh_ctx_sync_device calls between their push and their pop */
    bool forgetting; /* vmh_ctx_forget waits for `waits` to reach 0: start no new wait */
    bool dead;       /* the driver said it no longer exists: the last wait forgets it */
} ctx_rec_t;

static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ctx_waits_done = PTHREAD_COND_INITIALIZER;
static ctx_rec_t *ctx_recs;
static size_t ctx_count, ctx_capacity;

/* Bumped when a context is forgotten: every thread's cached current context is checked again
 * (it may be the one destroyed, or a new context may now have its address). Starts at 1: a
 * thread's cache with generation 0 is empty. */
static atomic_uint ctx_generation = 1;

static ctx_rec_t *ctx_find_locked(CUcontext ctx)
{
    for (size_t i = 0; i < ctx_count; i++)
        if (ctx_recs[i].ctx == ctx)
            return &ctx_recs[i];
    return NULL;
}

/* Drops a record (no wait in progress on it) and makes every thread ask the driver for its
 * current context again (it may be the one gone, or a new context may now have its address). */
static void ctx_remove_locked(ctx_rec_t *r)
{
    assert(r->waits == 0);
    *r = ctx_recs[--ctx_count];
    atomic_fetch_add_explicit(&ctx_generation, 1, memory_order_acq_rel);
}

void vmh_ctx_seen(CUcontext ctx, int device)
{
    if (ctx == NULL || device < 0)
        return;
    vmh_first_use_lock(&ctx_lock, VMH_RANK_CONTEXTS);
    ctx_rec_t *r = ctx_find_locked(ctx);
    if (r != NULL) {
        r->device = device; /* the same address, a context made again after a destroy */
        r->dead = false;
    } else {
        if (ctx_count == ctx_capacity) {
            size_t cap = ctx_capacity ? 2 * ctx_capacity : 8;
            ctx_rec_t *grown = realloc(ctx_recs, cap * sizeof *grown);
            if (grown == NULL) {
                vmh_unlock(&ctx_lock);
                vmh_log("out of host memory: context %p of device %d is not waited for on reuse",
                        (void *)ctx, device);
                return;
            }
            ctx_recs = grown;
            ctx_capacity = cap;
        }
        ctx_recs[ctx_count++] = (ctx_rec_t){.ctx = ctx, .device = device};
    }
    bool second = false;
    for (size_t i = 0; i < ctx_count && !second; i++)
        second = ctx_recs[i].ctx != ctx && ctx_recs[i].device == device && !ctx_recs[i].dead;
    vmh_unlock(&ctx_lock);
    if (second)
        vmh_work_queue_split("a second context on a device");
}

void vmh_ctx_forget(CUcontext ctx)
{
    if (ctx == NULL)
        return;
    vmh_first_use_lock(&ctx_lock, VMH_RANK_CONTEXTS);
    ctx_rec_t *r = ctx_find_locked(ctx);
    if (r != NULL) {
        r->forgetting = true;
        while (r->waits > 0) {
            pthread_cond_wait(&ctx_waits_done, &ctx_lock);
            r = ctx_find_locked(ctx); /* the array may have moved or shrunk meanwhile */
            assert(r != NULL && r->forgetting);
        }
        ctx_remove_locked(r);
    } else {
        atomic_fetch_add_explicit(&ctx_generation, 1, memory_order_acq_rel);
    }
    vmh_unlock(&ctx_lock);
}

/* ---------------------------------------------------------------------------------------------
 * The calling thread's current context.
 */
/* Cached in the thread's state (thread_state.h: current). */

void vmh_ctx_current_changed(void)
{
    vmh_thread.current.generation = 0;
}

CUresult vmh_ctx_current(CUcontext *ctx, int *device)
{
    unsigned g = atomic_load_explicit(&ctx_generation, memory_order_acquire);
    if (__builtin_expect(vmh_thread.current.generation == g, 1)) {
        *ctx = vmh_thread.current.ctx;
        *device = vmh_thread.current.device;
        return CUDA_SUCCESS;
    }
    CUcontext c = NULL;
    CUresult rc = vmh_drv.cuCtxGetCurrent(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    /* No context is not cached: a thread without one is rare on the paths that ask, and a
     * context made current behind the interposer's back (a test, a driver callback) is then
     * still found. */
    if (c == NULL)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUdevice dev;
    rc = vmh_drv.cuCtxGetDevice(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    vmh_ctx_seen(c, (int)dev);
    /* g was read before the driver was asked: a destroy meanwhile makes the next call ask
     * again. */
    vmh_thread.current.ctx = c;
    vmh_thread.current.device = (int)dev;
    vmh_thread.current.generation = g;
    *ctx = c;
    *device = (int)dev;
    return CUDA_SUCCESS;
}

CUcontext vmh_ctx_cached(void)
{
    unsigned g = atomic_load_explicit(&ctx_generation, memory_order_acquire);
    return vmh_thread.current.generation == g ? vmh_thread.current.ctx : NULL;
}

size_t vmh_ctx_devices(int *devices, size_t max)
{
    size_t n = 0;
    vmh_first_use_lock(&ctx_lock, VMH_RANK_CONTEXTS);
    for (size_t i = 0; i < ctx_count && n < max; i++) {
        bool known = false;
        for (size_t k = 0; k < n && !known; k++)
            known = devices[k] == ctx_recs[i].device;
        if (!known)
            devices[n++] = ctx_recs[i].device;
    }
    vmh_unlock(&ctx_lock);
    return n;
}

/* ---------------------------------------------------------------------------------------------
 * Waits in progress (the waits themselves: ctx_wait.c).
 */
size_t vmh_ctx_waits_begin(int device, CUcontext current, CUcontext **list, CUcontext *one)
{
    /* Known from here on, so that a program that never went through an interposed context
     * call (the unit tests) still has the calling thread's context waited for. */
    if (current != NULL) {
        vmh_first_use_lock(&ctx_lock, VMH_RANK_CONTEXTS);
        bool known = ctx_find_locked(current) != NULL;
        vmh_unlock(&ctx_lock);
        CUdevice dev;
        if (!known && vmh_drv.cuCtxGetDevice(&dev) == CUDA_SUCCESS)
            vmh_ctx_seen(current, (int)dev);
    }
    vmh_first_use_lock(&ctx_lock, VMH_RANK_CONTEXTS);
    size_t n = 0;
    for (size_t i = 0; i < ctx_count; i++)
        n += ctx_recs[i].device == device && !ctx_recs[i].forgetting;
    *list = n <= 1 ? one : malloc(n * sizeof **list);
    if (*list == NULL) {
        vmh_unlock(&ctx_lock);
        return SIZE_MAX;
    }
    size_t k = 0;
    for (size_t i = 0; i < ctx_count; i++) {
        if (ctx_recs[i].device == device && !ctx_recs[i].forgetting) {
            ctx_recs[i].waits++;
            (*list)[k++] = ctx_recs[i].ctx;
        }
    }
    assert(k == n);
    vmh_unlock(&ctx_lock);
    return n;
}

void vmh_ctx_waits_end(CUcontext *list, size_t n, size_t gone, CUcontext *one)
{
    vmh_first_use_lock(&ctx_lock, VMH_RANK_CONTEXTS);
    for (size_t i = 0; i < n; i++) {
        ctx_rec_t *r = ctx_find_locked(list[i]);
        assert(r != NULL && r->waits > 0); /* forget waits for us */
        r->waits--;
        /* Destroyed behind the interposer's back (a thread that bypassed it, a library that
         * resolved the driver itself): no work of it is left to wait for, and keeping it would
         * fail every later wait of the device, so nothing freed there would be reused again.
         * The last wait on it forgets it, unless vmh_ctx_forget does (it waits for us). */
        if (i < gone)
            r->dead = true;
        if (r->dead && r->waits == 0 && !r->forgetting)
            ctx_remove_locked(r);
    }
    pthread_cond_broadcast(&ctx_waits_done);
    vmh_unlock(&ctx_lock);
    if (list != one)
        free(list);
}

/* ---------------------------------------------------------------------------------------------
 * Lifetime.
 */
#ifdef VMH_TESTING
static atomic_uint after_fork_runs; /* inherited: a child's count is the parent's plus its own */

unsigned vmh_contexts_after_fork_runs(void)
{
    return atomic_load(&after_fork_runs);
}
#endif

void vmh_contexts_after_fork_child(void)
{
#ifdef VMH_TESTING
    atomic_fetch_add(&after_fork_runs, 1);
#endif
    /* Only this thread exists now: nothing else can hold or wait on anything. */
    pthread_mutex_init(&ctx_lock, NULL);
    pthread_cond_init(&ctx_waits_done, NULL);
    for (size_t i = 0; i < ctx_count; i++) {
        ctx_recs[i].waits = 0;
        ctx_recs[i].forgetting = false;
    }
    atomic_fetch_add_explicit(&ctx_generation, 1, memory_order_acq_rel);
}

#ifdef VMH_TESTING
void vmh_contexts_known_reset(void)
{
    vmh_first_use_lock(&ctx_lock, VMH_RANK_CONTEXTS);
    assert(ctx_count == 0 || ctx_recs != NULL);
    for (size_t i = 0; i < ctx_count; i++)
        assert(ctx_recs[i].waits == 0);
    ctx_count = 0;
    atomic_fetch_add_explicit(&ctx_generation, 1, memory_order_acq_rel);
    vmh_unlock(&ctx_lock);
    vmh_thread.current.generation = 0;
}
#endif
