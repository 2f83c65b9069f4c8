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
 * call (the last ranks of witness.h). All are made anew in a forked child
 * (vmh_contexts_after_fork_child, called by lifetime.c's fork handler, registered at their first
 * use).
 */
#include "contexts_internal.h"

#include "driver.h"
#include "log.h"
#include "witness.h"

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
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

/* Reports arrive from the program's first CUDA calls, before the library starts, and a fork may
 * come at any time: at the first use of a lock of this layer, the function lifetime.c handed
 * over (vmh_contexts_on_first_use) registers its fork handler, which calls
 * vmh_contexts_after_fork_child in every child from then on (it makes the locks anew). */
static void (*_Atomic first_use_hook)(void);
static atomic_bool first_use_seen;

void vmh_contexts_on_first_use(void (*fn)(void))
{
    atomic_store(&first_use_hook, fn);
}

void vmh_contexts_lock(pthread_mutex_t *m, vmh_rank_t rank)
{
    if (!atomic_load_explicit(&first_use_seen, memory_order_acquire)) {
        void (*fn)(void) = atomic_load(&first_use_hook);
        if (fn) {
            fn(); /* idempotent: threads racing here may each call it */
            atomic_store_explicit(&first_use_seen, true, memory_order_release);
        }
    }
    vmh_lock(m, rank);
}

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
    vmh_contexts_lock(&ctx_lock, VMH_RANK_CONTEXTS);
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
    vmh_contexts_lock(&ctx_lock, VMH_RANK_CONTEXTS);
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
typedef struct current_cache {
    CUcontext ctx;
    int device;
    unsigned generation; /* 0: nothing cached */
} current_cache_t;

static __thread current_cache_t tl_current __attribute__((tls_model("initial-exec")));

void vmh_ctx_current_changed(void)
{
    tl_current.generation = 0;
}

CUresult vmh_ctx_current(CUcontext *ctx, int *device)
{
    unsigned g = atomic_load_explicit(&ctx_generation, memory_order_acquire);
    if (__builtin_expect(tl_current.generation == g, 1)) {
        *ctx = tl_current.ctx;
        *device = tl_current.device;
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
    tl_current = (current_cache_t){.ctx = c, .device = (int)dev, .generation = g};
    *ctx = c;
    *device = (int)dev;
    return CUDA_SUCCESS;
}

CUcontext vmh_ctx_cached(void)
{
    unsigned g = atomic_load_explicit(&ctx_generation, memory_order_acquire);
    return tl_current.generation == g ? tl_current.ctx : NULL;
}

size_t vmh_ctx_devices(int *devices, size_t max)
{
    size_t n = 0;
    vmh_contexts_lock(&ctx_lock, VMH_RANK_CONTEXTS);
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
 * Waiting for a device.
 */

/* What the driver answers for a context it no longer has: CUDA_ERROR_INVALID_CONTEXT when the
 * destroyed handle is passed in (cuCtxPushCurrent), CUDA_ERROR_CONTEXT_IS_DESTROYED when it is
 * still current on the calling thread (cuCtxSynchronize; cuCtxDestroy leaves it current on the
 * threads other than the destroying one). */
static bool ctx_destroyed_answer(CUresult rc)
{
    return rc == CUDA_ERROR_INVALID_CONTEXT || rc == CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

/* Synchronizes one context from the calling thread, whose current context is `current`. */
static CUresult ctx_sync_one(CUcontext ctx, CUcontext current)
{
    /* The gate: no capture began since the check of vmh_ctx_sync_device (the reclaim thread's
     * synchronize during a capture broke PyTorch's graphs). */
    assert(!vmh_capture_any() && "a context synchronize while a stream captures");
    vmh_ctx_scope_t scope;
    CUresult rc = vmh_ctx_scope_enter(ctx, current, &scope);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = vmh_drv.cuCtxSynchronize();
    CUresult left = vmh_ctx_leave(&scope);
    return rc != CUDA_SUCCESS ? rc : left;
}

/* vmh_ctx_sync_device once past the gate. */
static CUresult sync_device_gated(int device)
{
    /* The calling thread's current context, from the driver (a wait is costly anyway, and a
     * stale cache here would synchronize the wrong context); known from here on, so that a
     * program that never went through an interposed context call (the unit tests) still has
     * it waited for. */
    CUcontext current = NULL;
    CUresult rc = vmh_drv.cuCtxGetCurrent(&current);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (current != NULL) {
        vmh_contexts_lock(&ctx_lock, VMH_RANK_CONTEXTS);
        bool known = ctx_find_locked(current) != NULL;
        vmh_unlock(&ctx_lock);
        CUdevice dev;
        if (!known && vmh_drv.cuCtxGetDevice(&dev) == CUDA_SUCCESS)
            vmh_ctx_seen(current, (int)dev);
    }

    /* Take a wait on each context of the device, so that none is destroyed under us. */
    vmh_contexts_lock(&ctx_lock, VMH_RANK_CONTEXTS);
    size_t n = 0;
    for (size_t i = 0; i < ctx_count; i++)
        n += ctx_recs[i].device == device && !ctx_recs[i].forgetting;
    CUcontext one;
    CUcontext *list = n <= 1 ? &one : malloc(n * sizeof *list);
    if (list == NULL) {
        vmh_unlock(&ctx_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t k = 0;
    for (size_t i = 0; i < ctx_count; i++) {
        if (ctx_recs[i].device == device && !ctx_recs[i].forgetting) {
            ctx_recs[i].waits++;
            list[k++] = ctx_recs[i].ctx;
        }
    }
    assert(k == n);
    vmh_unlock(&ctx_lock);

    CUresult first_error = CUDA_SUCCESS;
    size_t gone = 0; /* the first `gone` entries of list: contexts the driver no longer knows */
    for (size_t i = 0; i < n; i++) {
        rc = ctx_sync_one(list[i], current);
        if (ctx_destroyed_answer(rc)) {
            CUcontext dead = list[i];
            list[i] = list[gone];
            list[gone++] = dead;
        } else if (rc != CUDA_SUCCESS && first_error == CUDA_SUCCESS) {
            first_error = rc;
        }
    }

    vmh_contexts_lock(&ctx_lock, VMH_RANK_CONTEXTS);
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
    if (list != &one)
        free(list);
    return first_error;
}

CUresult vmh_ctx_sync_device(int device)
{
    /* Stricter than the rule for potentially unsafe calls: a context synchronize waits for
     * every stream of the context, and waiting for a capturing stream conflicts with the
     * capture whatever the modes (a device synchronize on one thread invalidates another
     * thread's thread-local capture, as TensorRT users found). Which context a capture's
     * stream belongs to is not known here, so any capture in progress refuses the wait; the
     * library then serves from memory that needs none. The check and the count are one step
     * of the gate, so a capture cannot begin between them and the synchronize. */
    /* Nothing waits for the GPU under a lock ranked after the reclaim wait lock (witness.h):
     * the heap's locks would stall every other thread behind the GPU. */
    vmh_assert_none_above(VMH_RANK_RECLAIM_WAIT);
    if (!vmh_capture_gate_sync_enter())
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    CUresult rc = sync_device_gated(device);
    vmh_capture_gate_sync_leave();
    return rc;
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
    vmh_captures_after_fork_child();
}

#ifdef VMH_TESTING
void vmh_contexts_reset(void)
{
    vmh_contexts_lock(&ctx_lock, VMH_RANK_CONTEXTS);
    assert(ctx_count == 0 || ctx_recs != NULL);
    for (size_t i = 0; i < ctx_count; i++)
        assert(ctx_recs[i].waits == 0);
    ctx_count = 0;
    atomic_fetch_add_explicit(&ctx_generation, 1, memory_order_acq_rel);
    vmh_unlock(&ctx_lock);
    vmh_captures_reset();
    tl_current.generation = 0;
    vmh_ctx_scope_reset();
    vmh_work_reset();
}
#endif
