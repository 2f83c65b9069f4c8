/* Layer "backup staging": the copy pool (see copypool.h). */
#include "copypool.h"
#include "thread_state.h"

#include <assert.h>
#include <string.h>
#include <unistd.h>

#define HUGE_PAGE ((size_t)2 << 20) /* x86-64's and arm64's (4 KiB base pages) PMD size */

/* Takes parts of the current job until none is left; called and returns with the lock held. */
static void copy_parts_locked(vmh_copy_pool_t *pool)
{
    while (pool->next < pool->nparts) {
        size_t k = pool->next++;
        size_t off = k * pool->part;
        size_t len = pool->n - off < pool->part ? pool->n - off : pool->part;
        char *dst = pool->dst + off;
        const char *src = pool->src + off;
        pthread_mutex_unlock(&pool->lock);
        memcpy(dst, src, len);
        pthread_mutex_lock(&pool->lock);
        if (++pool->parts_done == pool->nparts)
            pthread_cond_signal(&pool->done);
    }
}

static void *worker(void *arg)
{
    vmh_copy_pool_t *pool = arg;
    pthread_mutex_lock(&pool->lock);
    unsigned long seen = 0; /* jobs are numbered from 1 */
    for (;;) {
        while (!pool->stop && pool->generation == seen)
            pthread_cond_wait(&pool->wake, &pool->lock);
        if (pool->stop)
            break;
        /* A worker woken late may find the next job already: it takes parts of that one. */
        seen = pool->generation;
        copy_parts_locked(pool);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

void vmh_copy_pool_start(vmh_copy_pool_t *pool, int want)
{
    memset(pool, 0, sizeof *pool);
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (online > 0 && want > online)
        want = (int)online;
    if (want > VMH_COPY_POOL_MAX)
        want = VMH_COPY_POOL_MAX;
    while (pool->nthreads < want &&
           vmh_thread_start(&pool->threads[pool->nthreads], worker, pool) == 0)
        pool->nthreads++;
}

void vmh_copy_pool_run(vmh_copy_pool_t *pool, void *dst, const void *src, size_t n)
{
    if (n == 0)
        return;
    if (pool->nthreads == 0) {
        memcpy(dst, src, n);
        return;
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t workers = (size_t)pool->nthreads;
    /* Parts of one huge page when there is more than one, taken in turn by whichever worker is
     * free: with transparent huge pages the first touch of a huge page faults and zeroes all of
     * it, so two threads in one huge page would wait for each other (and a huge-page aligned
     * destination, as the pause's backups are, gets one fault per part). Below that, one
     * page-rounded part per worker. */
    size_t part =
        n > HUGE_PAGE ? HUGE_PAGE : ((n + workers - 1) / workers + page - 1) / page * page;
    pthread_mutex_lock(&pool->lock);
    assert(pool->next == pool->nparts && pool->parts_done == pool->nparts); /* no job running */
    pool->dst = dst;
    pool->src = src;
    pool->n = n;
    pool->part = part;
    pool->nparts = (n + part - 1) / part;
    pool->next = 0;
    pool->parts_done = 0;
    pool->generation++;
    pthread_cond_broadcast(&pool->wake);
    while (pool->parts_done < pool->nparts)
        pthread_cond_wait(&pool->done, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
}

void vmh_copy_pool_stop(vmh_copy_pool_t *pool)
{
    pthread_mutex_lock(&pool->lock);
    pool->stop = true;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < pool->nthreads; i++)
        pthread_join(pool->threads[i], NULL);
    pool->nthreads = 0;
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
}
