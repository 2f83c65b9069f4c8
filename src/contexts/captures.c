/* The program's stream captures, as the interposer reports them (contexts.h), and the gate
 * between them and the library's synchronizes.
 *
 * While a stream captures, the driver refuses potentially unsafe calls (cuCtxSynchronize, ...)
 * to the threads its rule covers, and a refused call invalidates the capture; a context
 * synchronize of a context with a capturing stream fails in every mode. So:
 *   - the captures in progress (stream, mode, thread) are kept under cap_lock, with a count read
 *     without the lock, so that the question "may I synchronize?" costs one atomic load when
 *     nothing captures (the steady state), and each thread's capture interaction mode;
 *   - the gate, under gate_lock: a count of synchronizes past their capture check and one of
 *     captures beginning, so that no capture begins during a synchronize.
 * Neither lock is held with another of the layer's, nor across a driver call.
 */
#include "contexts_internal.h"

#include "first_use.h"
#include "log.h"
#include "thread_state.h"
#include "witness.h"

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

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

/* The calling thread's capture interaction mode (cuThreadExchangeStreamCaptureMode) is its
 * state's capture_mode (thread_state.h); zero is CU_STREAM_CAPTURE_MODE_GLOBAL, the driver's
 * default. */
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
    vmh_first_use_lock(&cap_lock, VMH_RANK_CAPTURES);
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
static unsigned gate_syncs; /* vmh_ctx_sync_device calls past their capture check */
static size_t gate_begins;  /* vmh_capture_begin / vmh_capture_began calls not yet left */

CUresult vmh_capture_begin(CUstream stream, CUstreamCaptureMode mode, vmh_capture_begin_fn begin,
                           void *call)
{
    vmh_first_use_lock(&gate_lock, VMH_RANK_CAPTURE_GATE);
    gate_begins++;
    while (gate_syncs != 0)
        pthread_cond_wait(&gate_syncs_done, &gate_lock);
    vmh_unlock(&gate_lock);

    CUresult r = begin != NULL ? begin(call) : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        capture_record(stream, mode);

    vmh_first_use_lock(&gate_lock, VMH_RANK_CAPTURE_GATE);
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
bool vmh_capture_gate_sync_enter(void)
{
    vmh_first_use_lock(&gate_lock, VMH_RANK_CAPTURE_GATE);
    bool may = gate_begins == 0 && !vmh_capture_any();
    gate_syncs += may;
    vmh_unlock(&gate_lock);
    return may;
}

void vmh_capture_gate_sync_leave(void)
{
    vmh_first_use_lock(&gate_lock, VMH_RANK_CAPTURE_GATE);
    assert(gate_syncs > 0);
    if (--gate_syncs == 0)
        pthread_cond_broadcast(&gate_syncs_done);
    vmh_unlock(&gate_lock);
}

void vmh_capture_ended(CUstream stream)
{
    pthread_t self = pthread_self();
    vmh_first_use_lock(&cap_lock, VMH_RANK_CAPTURES);
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
    vmh_thread.capture_mode = mode;
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
    CUstreamCaptureMode mine = vmh_thread.capture_mode;
    if (mine == CU_STREAM_CAPTURE_MODE_RELAXED)
        return false;
    if (mine == CU_STREAM_CAPTURE_MODE_GLOBAL &&
        atomic_load_explicit(&cap_unrecorded, memory_order_acquire) != 0)
        return true;
    pthread_t self = pthread_self();
    bool forbidden = false;
    vmh_first_use_lock(&cap_lock, VMH_RANK_CAPTURES);
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

void vmh_captures_after_fork_child(void)
{
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
void vmh_captures_reset(void)
{
    vmh_first_use_lock(&gate_lock, VMH_RANK_CAPTURE_GATE);
    assert(gate_syncs == 0 && gate_begins == 0); /* no test leaves one behind */
    vmh_unlock(&gate_lock);
    vmh_first_use_lock(&cap_lock, VMH_RANK_CAPTURES);
    atomic_store_explicit(&cap_count, 0, memory_order_release);
    atomic_store_explicit(&cap_unrecorded, 0, memory_order_release);
    vmh_unlock(&cap_lock);
    vmh_thread.capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
}

size_t vmh_capture_begins_pending(void)
{
    return vmh_read_locked(&gate_lock, VMH_RANK_CAPTURE_GATE, &gate_begins);
}
#endif
