/* The process's contexts and stream captures, as the interposer reports them (contexts.h).
 *
 * Above the driver table, below the heap: the heap asks which contexts of a device to wait for
 * and whether it may wait at all; the interposer tells, after each context or capture call of
 * the program, what changed. Three kinds of state:
 *   - the known contexts, per device, under ctx_lock; each counts the library's waits in
 *     progress on it, which vmh_ctx_forget (the program destroying it) waits out, because the
 *     driver must not destroy a context another thread has pushed for a synchronize;
 *   - each thread's current context, cached in a thread-local and trusted while the global
 *     generation is unchanged (the interposer invalidates the thread's own cache on every call
 *     that changes it; a destroy anywhere bumps the generation, so every thread asks the driver
 *     again once);
 *   - the captures in progress (stream, mode, thread) under cap_lock, with a count read without
 *     the lock, so that the question "may I synchronize?" costs one atomic load when nothing
 *     captures (the steady state), and each thread's capture interaction mode;
 *   - the gate between the library's synchronizes and the program's capture begins, under
 *     gate_lock: a count of synchronizes past their capture check and one of captures
 *     beginning, so that no capture begins during a synchronize.
 *
 * Lock order: ctx_lock, cap_lock and gate_lock are never held together, nor across a driver
 * call (the last ranks of witness.h). All are made anew in a forked child
 * (vmh_contexts_after_fork_child, called by lifetime.c's fork handler, registered at their first
 * use).
 */
#include "contexts.h"

#include "driver.h"
#include "log.h"
#include "stats.h"
#include "witness.h"

#include <assert.h>
#include <execinfo.h>
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
 * come at any time: at the first use of a lock of this file, the function lifetime.c handed
 * over (vmh_contexts_on_first_use) registers its fork handler, which calls
 * vmh_contexts_after_fork_child in every child from then on (it makes these locks anew). */
static void (*_Atomic first_use_hook)(void);
static atomic_bool first_use_seen;

void vmh_contexts_on_first_use(void (*fn)(void))
{
    atomic_store(&first_use_hook, fn);
}

static void lock(pthread_mutex_t *m, vmh_rank_t rank)
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
    lock(&ctx_lock, VMH_RANK_CONTEXTS);
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
    lock(&ctx_lock, VMH_RANK_CONTEXTS);
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

/* ---------------------------------------------------------------------------------------------
 * The library's own scopes (contexts.h).
 *
 * While a thread has scopes open, tl_known is its current context as they left it (NULL:
 * unknown, after a failed pop, until the last scope is left); with none open, the cache above
 * says it. An enter pushes unless ctx is known to be current already, so the library's uses
 * inside a program's context (a pause, a staging copy, a backup given back) make no driver call
 * for it. */
static __thread CUcontext tl_known __attribute__((tls_model("initial-exec")));
static __thread unsigned tl_depth __attribute__((tls_model("initial-exec")));
static __thread bool tl_unsure __attribute__((tls_model("initial-exec")));
static atomic_flag leave_failure_logged = ATOMIC_FLAG_INIT;

static CUcontext current_known(void)
{
    if (tl_depth > 0)
        return tl_unsure ? NULL : tl_known;
    unsigned g = atomic_load_explicit(&ctx_generation, memory_order_acquire);
    return tl_current.generation == g ? tl_current.ctx : NULL;
}

/* Enters ctx with `current` the thread's current context (NULL: unknown, so push). */
static CUresult scope_enter(CUcontext ctx, CUcontext current, vmh_ctx_scope_t *scope)
{
    *scope = (vmh_ctx_scope_t){.primary = -1};
    if (ctx != current) {
        CUresult rc = vmh_drv.cuCtxPushCurrent(ctx);
        if (rc != CUDA_SUCCESS)
            return rc;
        scope->pushed = true;
    }
    scope->ctx = ctx;
    scope->outer = current_known();
    scope->depth = ++tl_depth;
    tl_known = ctx;
    return CUDA_SUCCESS;
}

CUresult vmh_ctx_enter(CUcontext ctx, vmh_ctx_scope_t *scope)
{
    return scope_enter(ctx, current_known(), scope);
}

CUresult vmh_ctx_leave(vmh_ctx_scope_t *scope)
{
    if (scope->ctx == NULL)
        return CUDA_SUCCESS;
    vmh_assert_internal(scope->depth == tl_depth && "scopes are left in reverse order");
    CUresult rc = CUDA_SUCCESS;
    if (scope->pushed) {
        CUcontext popped = NULL;
        rc = vmh_drv.cuCtxPopCurrent(&popped);
        vmh_assert_internal(rc != CUDA_SUCCESS || popped == scope->ctx);
    }
    if (rc == CUDA_SUCCESS && scope->primary >= 0)
        rc = vmh_drv.cuDevicePrimaryCtxRelease(scope->primary);
    if (rc != CUDA_SUCCESS) {
        tl_unsure = true;
        tl_current.generation = 0; /* asked of the driver again */
        if (!atomic_flag_test_and_set(&leave_failure_logged))
            vmh_log("restoring a thread's context after the library's use of context %p failed "
                    "(CUDA error %d): that thread's current context may have changed (logged "
                    "once)",
                    (void *)scope->ctx, (int)rc);
    }
    tl_known = scope->outer;
    if (--tl_depth == 0)
        tl_unsure = false;
    *scope = (vmh_ctx_scope_t){.primary = -1};
    return rc;
}

/* vmh_ctx_of_device; *primary: the device whose primary context was retained for the caller
 * (-1: the current context was of `device`, nothing retained); *current: the thread's current
 * context as the driver answered (NULL: none, or not known). */
static CUresult device_context(int device, CUcontext *ctx, CUdevice *primary, CUcontext *current)
{
    CUcontext cur = NULL;
    CUdevice cur_dev = -1, dev;
    *primary = -1;
    if (vmh_drv.cuCtxGetCurrent(&cur) != CUDA_SUCCESS)
        cur = NULL;
    *current = cur;
    if (cur != NULL && vmh_drv.cuCtxGetDevice(&cur_dev) == CUDA_SUCCESS && cur_dev == device) {
        *ctx = cur;
        return CUDA_SUCCESS;
    }
    CUresult rc = vmh_drv.cuDeviceGet(&dev, device);
    if (rc == CUDA_SUCCESS)
        rc = vmh_drv.cuDevicePrimaryCtxRetain(ctx, dev);
    if (rc == CUDA_SUCCESS)
        *primary = dev;
    return rc;
}

CUresult vmh_ctx_of_device(int device, CUcontext *ctx)
{
    CUdevice primary;
    CUcontext current;
    return device_context(device, ctx, &primary, &current);
}

CUresult vmh_ctx_enter_device(int device, vmh_ctx_scope_t *scope)
{
    CUcontext ctx = NULL, current;
    CUdevice primary;
    CUresult rc = device_context(device, &ctx, &primary, &current);
    if (rc == CUDA_SUCCESS)
        rc = scope_enter(ctx, current, scope); /* the driver's answer, fresher than the cache */
    if (rc != CUDA_SUCCESS) {
        if (primary >= 0)
            (void)vmh_drv.cuDevicePrimaryCtxRelease(primary); /* undo: what the enter made */
        *scope = (vmh_ctx_scope_t){.primary = -1};
        return rc;
    }
    scope->primary = primary;
    return CUDA_SUCCESS;
}

CUresult vmh_ctx_device_of(CUcontext ctx, int *device)
{
    vmh_ctx_scope_t scope;
    CUresult rc = vmh_ctx_enter(ctx, &scope);
    if (rc != CUDA_SUCCESS)
        return rc;
    CUdevice dev;
    rc = vmh_drv.cuCtxGetDevice(&dev);
    CUresult left = vmh_ctx_leave(&scope);
    if (rc == CUDA_SUCCESS && (rc = left) == CUDA_SUCCESS)
        *device = (int)dev;
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * Captures.
 */
typedef struct capture_rec {
    CUstream stream;
    CUstreamCaptureMode mode;
    pthread_t thread; /* the thread that began it */
} capture_rec_t;

static pthread_mutex_t cap_lock = PTHREAD_MUTEX_INITIALIZER;
static capture_rec_t *cap_recs;
static size_t cap_capacity;
/* Written under cap_lock, read without it: the number of captures in progress. A capture that
 * could not be recorded (no host memory) counts in cap_unrecorded as a global capture of an
 * unknown thread, so that the library errs on the side of not synchronizing. */
static atomic_size_t cap_count;
static atomic_size_t cap_unrecorded;

/* The calling thread's capture interaction mode (cuThreadExchangeStreamCaptureMode); zero is
 * CU_STREAM_CAPTURE_MODE_GLOBAL, the driver's default. */
static __thread CUstreamCaptureMode tl_mode __attribute__((tls_model("initial-exec")));

_Static_assert(CU_STREAM_CAPTURE_MODE_GLOBAL == 0, "a thread's mode starts as global");

/* The per-thread default stream is one handle for every thread: it names the calling thread's
 * own stream. */
static bool cap_same_stream(const capture_rec_t *c, CUstream stream, pthread_t self)
{
    return c->stream == stream &&
           (stream != CU_STREAM_PER_THREAD || pthread_equal(c->thread, self));
}

static void capture_record(CUstream stream, CUstreamCaptureMode mode)
{
    pthread_t self = pthread_self();
    lock(&cap_lock, VMH_RANK_CAPTURES);
    size_t n = atomic_load_explicit(&cap_count, memory_order_relaxed);
    for (size_t i = 0; i < n; i++) {
        if (cap_same_stream(&cap_recs[i], stream, self)) {
            /* The driver refuses a second capture on a stream; a record left by a capture
             * whose end we did not see (its stream destroyed) is replaced. */
            cap_recs[i].mode = mode;
            cap_recs[i].thread = self;
            vmh_unlock(&cap_lock);
            return;
        }
    }
    if (n == cap_capacity) {
        size_t cap = cap_capacity ? 2 * cap_capacity : 8;
        capture_rec_t *grown = realloc(cap_recs, cap * sizeof *grown);
        if (grown == NULL) {
            atomic_fetch_add_explicit(&cap_unrecorded, 1, memory_order_release);
            vmh_unlock(&cap_lock);
            vmh_log("out of host memory: a stream capture is not tracked; the library will not "
                    "synchronize until the process ends");
            return;
        }
        cap_recs = grown;
        cap_capacity = cap;
    }
    cap_recs[n] = (capture_rec_t){.stream = stream, .mode = mode, .thread = self};
    atomic_store_explicit(&cap_count, n + 1, memory_order_release);
    vmh_unlock(&cap_lock);
}

/* The gate. A synchronize checks for captures and counts itself in gate_syncs in one hold of
 * gate_lock; a capture begin counts itself in gate_begins, then waits for gate_syncs to drain,
 * makes the real call and records its capture before it leaves. So a synchronize that passed the
 * check runs to its end with no capture begun meanwhile, and one that comes while a begin is
 * pending refuses at once (as it would a moment later, the capture recorded): a synchronize never
 * blocks here, and a stream of synchronizes cannot starve a begin. Nothing is held across the
 * driver calls on either side; a begin waits only for synchronizes, which wait only for the GPU. */
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_syncs_done = PTHREAD_COND_INITIALIZER;
static unsigned gate_syncs;  /* vmh_ctx_sync_device calls past their capture check */
static unsigned gate_begins; /* vmh_capture_begin / vmh_capture_began calls not yet left */

CUresult vmh_capture_begin(CUstream stream, CUstreamCaptureMode mode, vmh_capture_begin_fn begin,
                           void *call)
{
    lock(&gate_lock, VMH_RANK_CAPTURE_GATE);
    gate_begins++;
    while (gate_syncs != 0)
        pthread_cond_wait(&gate_syncs_done, &gate_lock);
    vmh_unlock(&gate_lock);

    CUresult r = begin != NULL ? begin(call) : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        capture_record(stream, mode);

    lock(&gate_lock, VMH_RANK_CAPTURE_GATE);
    assert(gate_begins > 0);
    gate_begins--;
    vmh_unlock(&gate_lock);
    return r;
}

void vmh_capture_began(CUstream stream, CUstreamCaptureMode mode)
{
    (void)vmh_capture_begin(stream, mode, NULL, NULL);
}

/* Counts a synchronize in, unless a capture is in progress or beginning. */
static bool gate_sync_enter(void)
{
    lock(&gate_lock, VMH_RANK_CAPTURE_GATE);
    bool may = gate_begins == 0 && !vmh_capture_any();
    gate_syncs += may;
    vmh_unlock(&gate_lock);
    return may;
}

static void gate_sync_leave(void)
{
    lock(&gate_lock, VMH_RANK_CAPTURE_GATE);
    assert(gate_syncs > 0);
    if (--gate_syncs == 0)
        pthread_cond_broadcast(&gate_syncs_done);
    vmh_unlock(&gate_lock);
}

void vmh_capture_ended(CUstream stream)
{
    pthread_t self = pthread_self();
    lock(&cap_lock, VMH_RANK_CAPTURES);
    size_t n = atomic_load_explicit(&cap_count, memory_order_relaxed);
    for (size_t i = 0; i < n; i++) {
        if (cap_same_stream(&cap_recs[i], stream, self)) {
            cap_recs[i] = cap_recs[n - 1];
            atomic_store_explicit(&cap_count, n - 1, memory_order_release);
            break;
        }
    }
    vmh_unlock(&cap_lock);
}

void vmh_capture_thread_mode(CUstreamCaptureMode mode)
{
    tl_mode = mode;
}

bool vmh_capture_any(void)
{
    return atomic_load_explicit(&cap_count, memory_order_acquire) != 0 ||
           atomic_load_explicit(&cap_unrecorded, memory_order_acquire) != 0;
}

/* The driver's rule (cuThreadExchangeStreamCaptureMode): in global mode a thread may not make a
 * potentially unsafe call while it has a capture of its own not begun in relaxed mode, or while
 * another thread has a capture begun in global mode; in thread-local mode only its own
 * non-relaxed capture counts; in relaxed mode nothing does. */
bool vmh_capture_forbids_unsafe(void)
{
    if (!vmh_capture_any())
        return false;
    CUstreamCaptureMode mine = tl_mode;
    if (mine == CU_STREAM_CAPTURE_MODE_RELAXED)
        return false;
    if (mine == CU_STREAM_CAPTURE_MODE_GLOBAL &&
        atomic_load_explicit(&cap_unrecorded, memory_order_acquire) != 0)
        return true;
    pthread_t self = pthread_self();
    bool forbidden = false;
    lock(&cap_lock, VMH_RANK_CAPTURES);
    size_t n = atomic_load_explicit(&cap_count, memory_order_relaxed);
    for (size_t i = 0; i < n && !forbidden; i++) {
        const capture_rec_t *c = &cap_recs[i];
        if (pthread_equal(c->thread, self))
            forbidden = c->mode != CU_STREAM_CAPTURE_MODE_RELAXED;
        else
            forbidden =
                mine == CU_STREAM_CAPTURE_MODE_GLOBAL && c->mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
    }
    vmh_unlock(&cap_lock);
    return forbidden;
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
    CUresult rc = scope_enter(ctx, current, &scope);
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
        lock(&ctx_lock, VMH_RANK_CONTEXTS);
        bool known = ctx_find_locked(current) != NULL;
        vmh_unlock(&ctx_lock);
        CUdevice dev;
        if (!known && vmh_drv.cuCtxGetDevice(&dev) == CUDA_SUCCESS)
            vmh_ctx_seen(current, (int)dev);
    }

    /* Take a wait on each context of the device, so that none is destroyed under us. */
    lock(&ctx_lock, VMH_RANK_CONTEXTS);
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

    lock(&ctx_lock, VMH_RANK_CONTEXTS);
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
    if (!gate_sync_enter())
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    CUresult rc = sync_device_gated(device);
    gate_sync_leave();
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * The order of the program's work (contexts.h).
 */
static atomic_bool work_split, work_split_unwaited, work_reused;
static const char *_Atomic work_split_why;

bool vmh_work_in_one_queue(void)
{
    return !atomic_load(&work_split);
}

const char *vmh_work_split_reason(void)
{
    return atomic_load(&work_split_why);
}

void vmh_work_queue_split(const char *why)
{
    /* A free that read "one queue" before this store (sequentially consistent) released its
     * block at once; the work it followed was submitted before that read, so before the wait
     * of vmh_work_split_wait begins: it covers that work. A free after the store parks. */
    if (atomic_exchange(&work_split, true))
        return;
    atomic_store(&work_split_why, why);
    atomic_store(&work_split_unwaited, true);
    vmh_count(VMH_STAT_queue_splits, 1);
    vmh_debug("the program's work is no longer in one queue per device (%s): frees park from "
              "now on; where the program did it:", why);
    if (vmh_log_verbose()) {
        /* Which code made the second queue (a library the program uses may make a stream of
         * its own): the frames, written straight to stderr without allocating. */
        void *frames[24];
        int n = backtrace(frames, 24);
        backtrace_symbols_fd(frames, n, 2);
    }
}

bool vmh_work_split_wait_pending(void)
{
    return atomic_load_explicit(&work_split_unwaited, memory_order_relaxed);
}

void vmh_work_note_reuse(void)
{
    if (!atomic_load(&work_reused))
        atomic_store(&work_reused, true);
}

void vmh_work_split_wait(void)
{
    if (!atomic_exchange(&work_split_unwaited, false) || !atomic_load(&work_reused))
        return;
    int devices[64];
    size_t n = 0;
    lock(&ctx_lock, VMH_RANK_CONTEXTS);
    for (size_t i = 0; i < ctx_count && n < sizeof devices / sizeof devices[0]; i++) {
        bool known = false;
        for (size_t k = 0; k < n && !known; k++)
            known = devices[k] == ctx_recs[i].device;
        if (!known)
            devices[n++] = ctx_recs[i].device;
    }
    vmh_unlock(&ctx_lock);
    const char *why = vmh_work_split_reason();
    for (size_t k = 0; k < n; k++) {
        CUresult rc = vmh_ctx_sync_device(devices[k]);
        if (rc != CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) {
            vmh_count(VMH_STAT_syncs, 1);
            vmh_count(VMH_STAT_syncs_blocking, 1);
        }
        if (rc != CUDA_SUCCESS)
            vmh_log("waiting for device %d when the program made a second queue (%s) failed "
                    "(CUDA error %d): buffers reused just before may still be in use by work of "
                    "the old queue", devices[k], why, (int)rc);
    }
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
    pthread_mutex_init(&cap_lock, NULL);
    pthread_t self = pthread_self();
    size_t n = atomic_load_explicit(&cap_count, memory_order_relaxed), kept = 0;
    for (size_t i = 0; i < n; i++)
        if (pthread_equal(cap_recs[i].thread, self))
            cap_recs[kept++] = cap_recs[i];
    atomic_store_explicit(&cap_count, kept, memory_order_release);
    atomic_store_explicit(&cap_unrecorded, 0, memory_order_release);
    pthread_mutex_init(&gate_lock, NULL);
    pthread_cond_init(&gate_syncs_done, NULL);
    gate_syncs = 0;
    gate_begins = 0;
}

#ifdef VMH_TESTING
void vmh_contexts_reset(void)
{
    lock(&ctx_lock, VMH_RANK_CONTEXTS);
    assert(ctx_count == 0 || ctx_recs != NULL);
    for (size_t i = 0; i < ctx_count; i++)
        assert(ctx_recs[i].waits == 0);
    ctx_count = 0;
    atomic_fetch_add_explicit(&ctx_generation, 1, memory_order_acq_rel);
    vmh_unlock(&ctx_lock);
    lock(&gate_lock, VMH_RANK_CAPTURE_GATE);
    assert(gate_syncs == 0 && gate_begins == 0); /* no test leaves one behind */
    vmh_unlock(&gate_lock);
    lock(&cap_lock, VMH_RANK_CAPTURES);
    atomic_store_explicit(&cap_count, 0, memory_order_release);
    atomic_store_explicit(&cap_unrecorded, 0, memory_order_release);
    vmh_unlock(&cap_lock);
    tl_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
    tl_current.generation = 0;
    atomic_flag_clear(&leave_failure_logged);
    atomic_store(&work_split, false);
    atomic_store(&work_split_unwaited, false);
    atomic_store(&work_reused, false);
    atomic_store(&work_split_why, NULL);
}

unsigned vmh_capture_begins_pending(void)
{
    lock(&gate_lock, VMH_RANK_CAPTURE_GATE);
    unsigned n = gate_begins;
    vmh_unlock(&gate_lock);
    return n;
}
#endif
