/* Layer "backup staging": a pool of CPU threads that copy host memory in parallel parts.
 *
 * What it is for: a pause's backup goes into fresh pageable memory, and the first write to each
 * page makes the kernel fault it in and zero it. One thread doing that (the driver's own staged
 * pageable copy) is what held the first pause back; several threads, each copying
 * and faulting its own part, run the faults on several cores (docs/SLEEP.md's design notes).
 *
 * One owner thread starts the pool, runs copies through it and stops it; only the owner calls
 * vmh_copy_pool_run. The workers block every signal: they are the library's threads inside the
 * program's process, and a signal meant for the program must not land in one of them. */
#ifndef VMH_COPYPOOL_H
#define VMH_COPYPOOL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

#define VMH_COPY_POOL_MAX 16

typedef struct vmh_copy_pool {
    pthread_mutex_t lock;
    pthread_cond_t wake; /* a new job or stop, for the workers */
    pthread_cond_t done; /* every part of the job copied, for the owner */
    pthread_t threads[VMH_COPY_POOL_MAX];
    int nthreads;
    /* The job, under lock: parts [next, nparts) are not taken yet; `generation` counts jobs so
     * that a worker knows a job it has not seen from one it has finished. */
    unsigned long generation;
    bool stop;
    char *dst;
    const char *src;
    size_t n, part, nparts, next, parts_done;
} vmh_copy_pool_t;

/* Starts min(want, online CPUs, VMH_COPY_POOL_MAX) workers, fewer when the system refuses a
 * thread; with none, vmh_copy_pool_run copies on the calling thread. */
void vmh_copy_pool_start(vmh_copy_pool_t *pool, int want);

/* Copies n bytes from src to dst (not overlapping) in parts that the workers take in turn (2 MiB
 * each, one huge page, when n is larger; else one page-rounded part per worker); returns when
 * every byte is copied. */
void vmh_copy_pool_run(vmh_copy_pool_t *pool, void *dst, const void *src, size_t n);

/* Stops and joins the workers. */
void vmh_copy_pool_stop(vmh_copy_pool_t *pool);

#endif
