/* Heap layer 4b: parked frees and the wait that releases them (see reclaim.h). */
#include "reclaim.h"

#include "driver.h"
#include "stats.h"

#include <assert.h>

void vmh_reclaim_init(vmh_reclaim_t *r, vmh_dev_t *dev)
{
    r->dev = dev;
    pthread_mutex_init(&r->lock, NULL);
    pthread_mutex_init(&r->wait_lock, NULL);
    atomic_init(&r->gen, 0);
    atomic_init(&r->pending, 0);
    r->synced_gen = 0;
    r->synced_any = false;
    r->head = r->tail = NULL;
}

uint64_t vmh_reclaim_now(const vmh_reclaim_t *r)
{
    return atomic_load((_Atomic uint64_t *)&r->gen);
}

bool vmh_reclaim_pending(const vmh_reclaim_t *r)
{
    return atomic_load_explicit((_Atomic size_t *)&r->pending, memory_order_relaxed) != 0;
}

void vmh_reclaim_park(vmh_reclaim_t *r, vmh_parked_t *item, uint64_t gen)
{
    assert(item->release && "a parked item says how it is released");
    pthread_mutex_lock(&r->lock);
    if (atomic_load(&item->queued)) {
        if (gen < item->gen)
            item->gen = gen;
    } else {
        item->gen = gen;
        item->next = NULL;
        item->prev = r->tail;
        if (r->tail)
            r->tail->next = item;
        else
            r->head = item;
        r->tail = item;
        atomic_store(&item->queued, true);
        atomic_fetch_add_explicit(&r->pending, 1, memory_order_relaxed);
    }
    pthread_mutex_unlock(&r->lock);
}

/* Takes every item parked with a generation <= g off the queue, in parking order. */
static vmh_parked_t *take_upto(vmh_reclaim_t *r, uint64_t g)
{
    vmh_parked_t *taken = NULL, **tail = &taken;
    pthread_mutex_lock(&r->lock);
    for (vmh_parked_t *it = r->head, *next; it; it = next) {
        next = it->next;
        if (it->gen > g)
            continue;
        if (it->prev)
            it->prev->next = it->next;
        else
            r->head = it->next;
        if (it->next)
            it->next->prev = it->prev;
        else
            r->tail = it->prev;
        it->prev = NULL;
        it->next = NULL;
        it->taken_next = NULL;
        atomic_store(&it->queued, false);
        atomic_fetch_sub_explicit(&r->pending, 1, memory_order_relaxed);
        *tail = it;
        tail = &it->taken_next;
    }
    pthread_mutex_unlock(&r->lock);
    return taken;
}

static void release_list(vmh_parked_t *it, uint64_t passed)
{
    while (it) {
        vmh_parked_t *next = it->taken_next;
        it->taken_next = NULL;
        it->release(it, passed);
        it = next;
    }
}

/* The one place that waits for the GPU: every piece of work queued on the device's context
 * before the call has completed when it returns CUDA_SUCCESS. */
static CUresult wait_for_gpu(vmh_dev_t *d)
{
    CUcontext cur = NULL;
    CUresult rc = vmh_drv.cuCtxGetCurrent(&cur);
    if (rc == CUDA_SUCCESS) {
        if (cur == d->ctx) {
            rc = vmh_drv.cuCtxSynchronize();
        } else {
            rc = vmh_drv.cuCtxPushCurrent(d->ctx);
            if (rc == CUDA_SUCCESS) {
                rc = vmh_drv.cuCtxSynchronize();
                vmh_drv.cuCtxPopCurrent(&cur);
            }
        }
    }
    vmh_count(VMH_STAT_syncs, 1);
    return rc;
}

static CUresult wait_now(vmh_reclaim_t *r)
{
    uint64_t g = atomic_fetch_add(&r->gen, 1);
    CUresult rc = wait_for_gpu(r->dev);
    if (rc != CUDA_SUCCESS)
        return rc; /* a failed wait proves nothing: everything stays parked */
    assert(!r->synced_any || g > r->synced_gen); /* generations only move forward */
    r->synced_gen = g;
    r->synced_any = true;
    release_list(take_upto(r, g), g);
    return CUDA_SUCCESS;
}

CUresult vmh_reclaim_wait(vmh_reclaim_t *r)
{
    uint64_t want = atomic_load(&r->gen);
    pthread_mutex_lock(&r->wait_lock);
    CUresult rc = CUDA_SUCCESS;
    if (!r->synced_any || r->synced_gen < want)
        rc = wait_now(r);
    pthread_mutex_unlock(&r->wait_lock);
    return rc;
}

void vmh_reclaim_release_all(vmh_reclaim_t *r)
{
    /* Items parked again by their release (packing shards with blocks left) come back with a
     * later generation; UINT64_MAX covers them too. */
    vmh_parked_t *it;
    while ((it = take_upto(r, UINT64_MAX)))
        release_list(it, UINT64_MAX);
}

void vmh_reclaim_destroy(vmh_reclaim_t *r)
{
    assert(!r->head && "released before destroyed");
    pthread_mutex_destroy(&r->lock);
    pthread_mutex_destroy(&r->wait_lock);
}
