/* Layer "reclaim": parked frees, the wait that releases them, and the reclaim thread (see
 * reclaim.h). */
#include "reclaim.h"

#include "clock.h"
#include "contexts.h"
#include "driver.h"
#include "list.h"
#include "log.h"
#include "phase.h"
#include "stats.h"
#include "thread_state.h"
#include "witness.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Written by the front's configure before any device is used; read without a lock after. */
static vmh_reclaim_settings_t settings = {.park_limit = SIZE_MAX};

void vmh_reclaim_configure(const vmh_reclaim_settings_t *s)
{
    settings = *s;
}

/* ---- the reclaim thread's state -----------------------------------------------------------
 * One thread for the process: it serves every device's queue in turn. The queues live in the
 * per-GPU records (heap_internal.h); the thread knows them by the list their init links them
 * into (vmh_reclaim_t's served_next), not by a table of its own. Its lock guards that list and
 * running/stopping; the flags read without it are atomics. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;       /* a park while it sleeps, a stop */
    pthread_mutex_t stop_lock; /* one stop at a time (one join) */
    pthread_t thread;
    bool running, stopping;
    bool busy;             /* inside a wait (tests' settle) */
    vmh_reclaim_t *queues; /* every queue, in init order: served round robin */
    unsigned nqueues;
    atomic_bool started;  /* a start was tried since the last stop: parks only wake it */
    atomic_bool sleeping; /* it waits for a park with every queue empty */
    atomic_bool enabled;  /* tests may turn it off */
} bg = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .stop_lock = PTHREAD_MUTEX_INITIALIZER,
    .enabled = true,
};

/* Pause between two background waits: bounds the thread to 10,000 synchronizations a second
 * when the program frees faster than that while the GPU is idle (each wait then returns at
 * once), while freed memory still comes back within a fraction of a millisecond. */
#ifndef VMH_BG_PACE_NS /* a build may try another pace (tools/probe/park-limit-sweep.sh) */
#define VMH_BG_PACE_NS 100000L
#endif
/* While a stream captures, how often the thread looks again (it must not synchronize then). */
#define BG_CAPTURE_POLL_NS 1000000L
/* After a failed wait (the driver refused it), before the next try. */
#define BG_RETRY_NS 10000000L
/* While nothing is parked but memory is held idle: how often the thread looks at it. */
#define BG_TIDY_NS 100000000L

void vmh_reclaim_init(vmh_reclaim_t *r, vmh_dev_t *dev)
{
    r->dev = dev;
    pthread_mutex_init(&r->lock, NULL);
    pthread_mutex_init(&r->wait_lock, NULL);
    atomic_init(&r->gen, 0);
    atomic_init(&r->pending, 0);
    atomic_init(&r->parked_bytes, 0);
    atomic_init(&r->freed_at_once, 0);
    atomic_init(&r->passed, 0);
    for (int i = 0; i < VMH_PARK_SHARDS; i++)
        atomic_init(&r->parked_shard[i].bytes, 0);
    r->synced_gen = 0;
    r->synced_any = false;
    r->head = r->tail = NULL;
    r->served_next = NULL;
    vmh_lock(&bg.lock, VMH_RANK_RECLAIM_THREAD);
    vmh_reclaim_t **end = &bg.queues;
    while (*end)
        end = &(*end)->served_next;
    *end = r;
    bg.nqueues++;
    vmh_unlock(&bg.lock);
}

uint64_t vmh_reclaim_now(const vmh_reclaim_t *r)
{
    return atomic_load((_Atomic uint64_t *)&r->gen);
}

bool vmh_reclaim_pending(const vmh_reclaim_t *r)
{
    return atomic_load_explicit((_Atomic size_t *)&r->pending, memory_order_relaxed) != 0;
}

/* The moved total alone (vmh_reclaim_t): off by less than VMH_PARK_SHARDS quanta. */
static int64_t parked_rough(const vmh_reclaim_t *r)
{
    return atomic_load_explicit((_Atomic int64_t *)&r->parked_bytes, memory_order_relaxed);
}

size_t vmh_reclaim_parked_bytes(const vmh_reclaim_t *r)
{
    int64_t sum = parked_rough(r);
    for (int i = 0; i < VMH_PARK_SHARDS; i++)
        sum += atomic_load_explicit((_Atomic int64_t *)&r->parked_shard[i].bytes,
                                    memory_order_relaxed);
    /* Read while shards move: a release's take may be seen before the park it undoes. */
    return sum > 0 ? (size_t)sum : 0;
}

/* Counts delta parked bytes on the calling thread's shard, moving the shard's count into the
 * total once it passes a quantum. The move is an exchange: whatever another thread of the same
 * shard added meanwhile is moved with it or stays, never lost. */
static void parked_add(vmh_reclaim_t *r, int64_t delta)
{
    vmh_park_shard_t *s = &r->parked_shard[vmh_thread_shard() % VMH_PARK_SHARDS];
    int64_t now = atomic_fetch_add_explicit(&s->bytes, delta, memory_order_relaxed) + delta;
    if (__builtin_expect(now < VMH_PARK_QUANTUM && now > -VMH_PARK_QUANTUM, 1))
        return;
    int64_t moved = atomic_exchange_explicit(&s->bytes, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&r->parked_bytes, moved, memory_order_relaxed);
}

void vmh_reclaim_add_bytes(vmh_reclaim_t *r, size_t bytes)
{
    parked_add(r, (int64_t)bytes);
}

static void bg_start(void);

/* After something was queued (pending already counts it, sequentially consistent): starts the
 * thread the first time, else wakes it when it sleeps. The thread announces its sleep before
 * it looks at the queues a last time, and the park counts before it looks at the
 * announcement, so one of the two always sees the other. */
/* Starts the thread if no start was tried since the last stop; true when one was tried
 * before (the thread may be running). */
static bool bg_started(void)
{
    if (!vmh_phase_threads_may_start())
        return false; /* exiting, or a forked child: no thread here, and its lock may have been
                       * held by a thread of the parent */
    if (!atomic_load_explicit(&bg.started, memory_order_acquire)) {
        bg_start();
        return false;
    }
    return true;
}

#ifdef VMH_TESTING
static atomic_ulong bg_wakes;
unsigned long vmh_reclaim_wakes(void)
{
    return atomic_load(&bg_wakes);
}
#endif

static void bg_kick(void)
{
    if (!bg_started())
        return;
    if (atomic_load(&bg.sleeping)) {
#ifdef VMH_TESTING
        atomic_fetch_add(&bg_wakes, 1);
#endif
        vmh_lock(&bg.lock, VMH_RANK_RECLAIM_THREAD);
        pthread_cond_signal(&bg.wake);
        vmh_unlock(&bg.lock);
    }
}

void vmh_reclaim_park(vmh_reclaim_t *r, vmh_parked_t *item, uint64_t gen, size_t bytes)
{
    assert(item->release && "a parked item says how it is released");
    bool queued_now = false;
    vmh_lock(&r->lock, VMH_RANK_RECLAIM_QUEUE);
    parked_add(r, (int64_t)bytes);
    if (atomic_load(&item->queued)) {
        if (gen < item->gen)
            item->gen = gen;
    } else {
        item->gen = gen;
        VMH_LIST_APPEND(r->head, r->tail, item);
        atomic_store(&item->queued, true);
        atomic_fetch_add(&r->pending, 1);
        queued_now = true;
    }
    vmh_unlock(&r->lock);
    if (queued_now && vmh_thread.kick_held)
        vmh_thread.kick_owed = true; /* vmh_reclaim_free_end decides */
    else if (queued_now)
        bg_kick();
}

/* Takes every item parked with a generation <= g off the queue, in parking order. */
static vmh_parked_t *take_upto(vmh_reclaim_t *r, uint64_t g)
{
    vmh_parked_t *taken = NULL, **tail = &taken;
    vmh_lock(&r->lock, VMH_RANK_RECLAIM_QUEUE);
    for (vmh_parked_t *it = r->head, *next; it; it = next) {
        next = it->next;
        if (it->gen > g)
            continue;
        VMH_LIST_REMOVE(r->head, r->tail, it);
        it->taken_next = NULL;
        atomic_store(&it->queued, false);
        atomic_fetch_sub_explicit(&r->pending, 1, memory_order_relaxed);
        *tail = it;
        tail = &it->taken_next;
    }
    vmh_unlock(&r->lock);
    return taken;
}

static void release_list(vmh_reclaim_t *r, vmh_parked_t *it, uint64_t passed)
{
    while (it) {
        vmh_parked_t *next = it->taken_next;
        it->taken_next = NULL;
        size_t bytes = it->release(it, passed);
        parked_add(r, -(int64_t)bytes);
        it = next;
    }
}

/* The one place that waits for the GPU: every context of the device the program has made has
 * finished the work submitted before the call when it returns CUDA_SUCCESS (contexts.h). Not
 * only the context the library first saw: a kernel of another context may still write a
 * buffer freed from this one. */
static CUresult wait_for_gpu(vmh_dev_t *d, vmh_waiter_t who)
{
    CUresult rc = vmh_ctx_sync_device(d->ordinal);
    if (rc == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        return rc; /* refused without a driver call: nothing was synchronized */
    vmh_count(VMH_STAT_syncs, 1);
    vmh_count(who == VMH_WAIT_APP ? VMH_STAT_syncs_blocking : VMH_STAT_syncs_background, 1);
    return rc;
}

/* Under the wait lock. */
static CUresult wait_now(vmh_reclaim_t *r, vmh_waiter_t who)
{
    vmh_assert_held(&r->wait_lock); /* the releases of one device run one at a time */
    uint64_t g = atomic_fetch_add(&r->gen, 1);
    CUresult rc = wait_for_gpu(r->dev, who);
    if (rc != CUDA_SUCCESS)
        return rc; /* a failed wait proves nothing: everything stays parked */
    assert(!r->synced_any || g > r->synced_gen); /* generations only move forward */
    r->synced_gen = g;
    r->synced_any = true;
    atomic_store(&r->passed, g + 1);
    release_list(r, take_upto(r, g), g);
    return CUDA_SUCCESS;
}

CUresult vmh_reclaim_wait(vmh_reclaim_t *r, vmh_waiter_t who)
{
    /* The driver would refuse the synchronize and invalidate the capture (a graph
     * captured by PyTorch broke); memory parked meanwhile stays parked. */
    if (who == VMH_WAIT_APP && vmh_capture_forbids_unsafe())
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    uint64_t want = atomic_load(&r->gen);
    vmh_lock(&r->wait_lock, VMH_RANK_RECLAIM_WAIT);
    CUresult rc = CUDA_SUCCESS;
    if (!r->synced_any || r->synced_gen < want)
        rc = wait_now(r, who);
    vmh_unlock(&r->wait_lock);
    return rc;
}

uint64_t vmh_reclaim_mark(const vmh_reclaim_t *r)
{
    return vmh_reclaim_now(r) + 1;
}

bool vmh_reclaim_passed(const vmh_reclaim_t *r, uint64_t mark)
{
    return mark == 0 || atomic_load((_Atomic uint64_t *)&r->passed) >= mark;
}

void vmh_reclaim_freed_at_once(vmh_reclaim_t *r)
{
    uint64_t mark = vmh_reclaim_mark(r);
    if (atomic_load_explicit(&r->freed_at_once, memory_order_relaxed) < mark) {
        atomic_store_explicit(&r->freed_at_once, mark, memory_order_relaxed);
        /* Nothing parks while frees are released at once, yet the idle memory they leave
         * needs the thread's tidy (reclaim_main): started here, never woken (it looks again
         * every BG_TIDY_NS by itself). */
        (void)bg_started();
    }
}

/* Whether a free released at once is not yet passed by a successful wait (under the wait lock
 * or as a hint). */
static bool freed_at_once_unpassed(vmh_reclaim_t *r)
{
    uint64_t mark = atomic_load_explicit(&r->freed_at_once, memory_order_relaxed);
    return mark != 0 && (!r->synced_any || r->synced_gen < mark - 1);
}

CUresult vmh_reclaim_pass(vmh_reclaim_t *r, vmh_waiter_t who)
{
    if (vmh_reclaim_pending(r))
        return vmh_reclaim_wait(r, who);
    vmh_lock(&r->wait_lock, VMH_RANK_RECLAIM_WAIT);
    bool unpassed = freed_at_once_unpassed(r);
    vmh_unlock(&r->wait_lock);
    if (unpassed)
        return vmh_reclaim_wait(r, who);
    /* Nothing queued: items taken by a wait in progress are released under its lock. */
    vmh_lock(&r->wait_lock, VMH_RANK_RECLAIM_WAIT);
    vmh_unlock(&r->wait_lock);
    return CUDA_SUCCESS;
}

CUresult vmh_reclaim_drain(vmh_reclaim_t *r)
{
    return vmh_reclaim_pass(r, VMH_WAIT_APP);
}

size_t vmh_reclaim_park_budget(const vmh_reclaim_t *r)
{
    size_t cap = settings.park_limit;
    if (cap == 0)
        return 0;
    size_t follow = vmh_dev_usable_peak(r->dev) / VMH_PARK_SHARE;
    if (follow < VMH_PARK_FLOOR)
        follow = VMH_PARK_FLOOR;
    return follow < cap ? follow : cap;
}

void vmh_reclaim_free_begin(void)
{
    vmh_thread.kick_held = true;
    vmh_thread.kick_owed = false;
}

void vmh_reclaim_free_end(vmh_reclaim_t *r, size_t bytes, vmh_free_wait_t how)
{
    bool owed = vmh_thread.kick_owed;
    vmh_thread.kick_held = vmh_thread.kick_owed = false;
    bool wait = how == VMH_FREE_WAIT;
    if (how == VMH_FREE_THROTTLE) {
        size_t budget = vmh_reclaim_park_budget(r);
        wait = budget != 0 && bytes > budget;
    }
    /* A successful wait released every item parked before it began, this free's among them;
     * what is still queued (a failed wait, or a park that came after the generation a wait
     * already past took) is the reclaim thread's, woken as the park would have. */
    if (wait && vmh_reclaim_wait(r, VMH_WAIT_APP) == CUDA_SUCCESS && !vmh_reclaim_pending(r)) {
        /* Started all the same, never woken: its tidy gives back the idle memory such frees
         * leave (it looks again every BG_TIDY_NS by itself). */
        if (owed)
            (void)bg_started();
        return;
    }
    if (owed)
        bg_kick();
}

bool vmh_reclaim_throttle(vmh_reclaim_t *r)
{
    size_t limit = vmh_reclaim_park_budget(r);
    /* First the moved total alone (one line, rarely written); the exact sum only when that is
     * within the shards' slack of the limit. */
    const int64_t slack = VMH_PARK_SHARDS * VMH_PARK_QUANTUM;
    if (__builtin_expect(limit >= (size_t)slack, 1)) {
        size_t rough_limit = limit - (size_t)slack;
        if (rough_limit > INT64_MAX)
            rough_limit = INT64_MAX;
        if (parked_rough(r) <= (int64_t)rough_limit)
            return false;
    }
    if (vmh_reclaim_parked_bytes(r) <= limit)
        return false;
    /* During a capture nothing is synchronized for the budget: the allocation is served from
     * the cache or fresh memory, and the frees wait for the capture to end. */
    if (vmh_capture_any())
        return false;
    /* The thread stalls from here: behind the wait in progress (the reclaim thread's, which
     * holds the lock until the GPU has passed it) and then, if that did not bring the parked
     * bytes under the limit, its own. Both count as the stall (park_wait_us). */
    uint64_t t0 = vmh_now_ns();
    vmh_lock(&r->wait_lock, VMH_RANK_RECLAIM_WAIT);
    /* The reclaim thread's wait, or another thread's, may have brought it under meanwhile. */
    if (vmh_reclaim_parked_bytes(r) > limit)
        wait_now(r, VMH_WAIT_APP);
    vmh_unlock(&r->wait_lock);
    vmh_count(VMH_STAT_park_waits, 1);
    vmh_count(VMH_STAT_park_wait_us, (vmh_now_ns() - t0) / 1000);
    return true;
}

void vmh_reclaim_release_all(vmh_reclaim_t *r)
{
    /* Items parked again by their release (carved shards with blocks left) come back with a
     * later generation; UINT64_MAX covers them too. */
    vmh_parked_t *it;
    while ((it = take_upto(r, UINT64_MAX)))
        release_list(r, it, UINT64_MAX);
}

void vmh_reclaim_destroy(vmh_reclaim_t *r)
{
    assert(!r->head && "released before destroyed");
    assert(vmh_reclaim_parked_bytes(r) == 0 && "every parked byte was released");
    /* The thread picks only a queue with something parked, and uses it outside its lock:
     * the heap stops it before destroying queues that held anything (vmh_heap_reset); a queue
     * that never held anything (a device whose setup failed) may go at any time. */
    vmh_lock(&bg.lock, VMH_RANK_RECLAIM_THREAD);
    for (vmh_reclaim_t **at = &bg.queues; *at; at = &(*at)->served_next) {
        if (*at == r) {
            *at = r->served_next;
            bg.nqueues--;
            break;
        }
    }
    vmh_unlock(&bg.lock);
    pthread_mutex_destroy(&r->lock);
    pthread_mutex_destroy(&r->wait_lock);
}

/* ---- the reclaim thread --------------------------------------------------------------------- */

/* The next queue with something parked, round robin from position *next of the list; bg.lock
 * held. */
static vmh_reclaim_t *pick_locked(unsigned *next)
{
    if (!bg.nqueues)
        return NULL;
    unsigned start = *next % bg.nqueues;
    vmh_reclaim_t *r = bg.queues;
    for (unsigned i = 0; i < start; i++)
        r = r->served_next;
    for (unsigned k = 0; k < bg.nqueues; k++) {
        if (atomic_load(&r->pending) != 0) {
            *next = (start + k + 1) % bg.nqueues;
            return r;
        }
        r = r->served_next ? r->served_next : bg.queues;
    }
    return NULL;
}

/* Sleeps up to ns on the wake condition (a stop ends it early); bg.lock held. */
static void nap_locked(long ns)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_nsec += ns;
    while (t.tv_nsec >= 1000000000L) {
        t.tv_nsec -= 1000000000L;
        t.tv_sec++;
    }
    pthread_cond_timedwait(&bg.wake, &bg.lock, &t);
}

/* Every device's tidy (device.h), from the thread with bg.lock held on entry and exit. */
static void tidy_all_locked(void)
{
    /* The devices are read under the lock and tidied outside it: the list may change while a
     * tidy runs, the devices may not (they live as long as the heap). */
    vmh_dev_t *devs[VMH_MAX_DEVICES];
    size_t n = 0;
    for (vmh_reclaim_t *r = bg.queues; r && n < VMH_MAX_DEVICES; r = r->served_next)
        if (r->dev && r->dev->tidy)
            devs[n++] = r->dev;
    bg.busy = true;
    vmh_unlock(&bg.lock);
    for (size_t i = 0; i < n; i++)
        devs[i]->tidy(devs[i]);
    vmh_lock(&bg.lock, VMH_RANK_RECLAIM_THREAD);
    bg.busy = false;
}

static void *reclaim_main(void *unused)
{
    (void)unused;
    /* Relaxed capture interaction mode: by the driver's rule, another thread's global-mode
     * capture then never makes this thread's potentially unsafe calls (the releases after a
     * wait) refused ones. It does not cover the synchronize itself: a context synchronize
     * conflicts with a capture in any mode. That one is kept apart by captures.c's gate: it refuses
     * while a capture is in progress, and a capture cannot begin while it runs. */
    CUstreamCaptureMode relaxed = CU_STREAM_CAPTURE_MODE_RELAXED;
    if (vmh_drv.cuThreadExchangeStreamCaptureMode(&relaxed) == CUDA_SUCCESS)
        vmh_capture_thread_mode(CU_STREAM_CAPTURE_MODE_RELAXED);
    unsigned next = 0;
    vmh_lock(&bg.lock, VMH_RANK_RECLAIM_THREAD);
    while (!bg.stopping) {
        vmh_reclaim_t *r = pick_locked(&next);
        if (!r) {
            atomic_store(&bg.sleeping, true);
            r = pick_locked(&next); /* a park that missed the announcement is seen here */
            if (!r) {
                /* Nothing parked. Memory held idle (free carved space, cached buffers) is
                 * looked at again every BG_TIDY_NS: what the program's recent peak no longer
                 * needs goes back without any application thread waiting (heap_upkeep.c's tidy). */
                bool idle = vmh_gauge_get(VMH_STAT_bytes_cached) > 0;
                if (idle)
                    nap_locked(BG_TIDY_NS);
                else
                    pthread_cond_wait(&bg.wake, &bg.lock);
                atomic_store(&bg.sleeping, false);
                if (idle && !bg.stopping && !vmh_capture_any())
                    tidy_all_locked();
                continue;
            }
            atomic_store(&bg.sleeping, false);
        }
        if (vmh_capture_any()) {
            /* A synchronize now would be refused and invalidate a global-mode capture; frees
             * parked before or during the capture wait for its end. */
            nap_locked(BG_CAPTURE_POLL_NS);
            continue;
        }
        bg.busy = true;
        vmh_unlock(&bg.lock);
        CUresult rc = vmh_reclaim_wait(r, VMH_WAIT_BACKGROUND);
        if (rc == CUDA_SUCCESS && r->dev->tidy)
            r->dev->tidy(r->dev);
        vmh_lock(&bg.lock, VMH_RANK_RECLAIM_THREAD);
        bg.busy = false;
        if (!bg.stopping)
            nap_locked(rc == CUDA_SUCCESS ? VMH_BG_PACE_NS : BG_RETRY_NS);
    }
    vmh_unlock(&bg.lock);
    return NULL;
}

/* Who is told when the thread starts (vmh_reclaim_on_first_start): lifetime.c, which then
 * registers its exit handler once (the thread stops there). */
static void (*_Atomic bg_first_start_hook)(void);

void vmh_reclaim_on_first_start(void (*fn)(void))
{
    atomic_store(&bg_first_start_hook, fn);
}

static void bg_start(void)
{
    vmh_lock(&bg.lock, VMH_RANK_RECLAIM_THREAD);
    if (!atomic_load(&bg.started) && !bg.running && atomic_load(&bg.enabled) &&
        vmh_phase_threads_may_start()) {
        int err = vmh_thread_start(&bg.thread, reclaim_main, NULL);
        if (err == 0) {
            bg.running = true;
            void (*hook)(void) = atomic_load(&bg_first_start_hook);
            if (hook)
                hook(); /* lifetime's: idempotent, so every start may call it */
        } else
            vmh_log("cannot start the reclaim thread (error %d): freed memory is reclaimed by "
                    "allocating threads (VMMHOOK_PARK_LIMIT) and on out of memory",
                    err);
    }
    /* Tried once: a failed start is not tried again at every park. */
    atomic_store_explicit(&bg.started, true, memory_order_release);
    vmh_unlock(&bg.lock);
}

void vmh_reclaim_stop(void)
{
    if (vmh_phase_forked_child())
        return; /* the thread is the parent's */
    vmh_lock(&bg.stop_lock, VMH_RANK_RECLAIM_STOP);
    vmh_lock(&bg.lock, VMH_RANK_RECLAIM_THREAD);
    bool running = bg.running;
    pthread_t t = bg.thread;
    if (running) {
        bg.stopping = true;
        pthread_cond_broadcast(&bg.wake);
    }
    vmh_unlock(&bg.lock);
    if (running)
        pthread_join(t, NULL); /* a wait in progress ends first: no driver call after this */
    vmh_lock(&bg.lock, VMH_RANK_RECLAIM_THREAD);
    bg.running = false;
    bg.stopping = false;
    atomic_store(&bg.sleeping, false);
    atomic_store(&bg.started, false);
    vmh_unlock(&bg.lock);
    vmh_unlock(&bg.stop_lock);
}

const vmh_steps_t vmh_reclaim_steps = {.letter = 'R', .exit = vmh_reclaim_stop};

bool vmh_reclaim_thread_running(void)
{
    if (vmh_phase_forked_child())
        return false;
    vmh_lock(&bg.lock, VMH_RANK_RECLAIM_THREAD);
    bool running = bg.running;
    vmh_unlock(&bg.lock);
    return running;
}

#ifdef VMH_TESTING
void vmh_reclaim_background(bool on)
{
    atomic_store(&bg.enabled, on);
}

bool vmh_reclaim_settle(unsigned timeout_ms)
{
    for (unsigned waited = 0;; waited++) {
        vmh_lock(&bg.lock, VMH_RANK_RECLAIM_THREAD);
        bool busy = bg.busy;
        for (vmh_reclaim_t *r = bg.queues; r; r = r->served_next)
            busy |= atomic_load(&r->pending) != 0;
        vmh_unlock(&bg.lock);
        if (!busy || vmh_capture_any())
            return true;
        if (waited >= timeout_ms)
            return false;
        struct timespec ms = {0, 1000000L};
        nanosleep(&ms, NULL);
    }
}
#endif
