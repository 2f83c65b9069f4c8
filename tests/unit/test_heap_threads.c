/* The heap under threads on the simulated driver: churn with data checks, large requests packed
 * without a spurious out of memory, blocks handed between threads across carved shards, and
 * shards reusing each other's space. Each test ends with everything freed, the cache trimmed
 * and the driver's ledger empty. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_heap_thread_shard, declared in heap.h */
#endif
#include "testutil.h"

#include "carved.h"

#include <cudaTypedefs.h>

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "vmmhook.h"

static unsigned seed_of(int k)
{
    return (unsigned)k * 7919u + 13u;
}

#define THREADS 8
#define ROUNDS (400 / TU_SLOWDOWN)

static void *churn(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    sim_set_current_device(0);
    CUdeviceptr live[16] = {0};
    size_t size[16] = {0};
    for (int i = 0; i < ROUNDS; i++) {
        int k = (int)(rand_r(&seed) % 16);
        if (live[k]) {
            if (!tu_check(live[k], size[k], seed_of(k)))
                return (void *)1;
            if (vmh_heap_free(live[k], NULL, false) != CUDA_SUCCESS)
                return (void *)1;
            live[k] = 0;
        } else {
            unsigned r = rand_r(&seed);
            size[k] = r % 4 == 0 ? (size_t)(r % (6 * MiB)) + 1 : (size_t)(r % 70000) + 1;
            if (vmh_heap_alloc(size[k], &live[k]) != CUDA_SUCCESS)
                return (void *)1;
            if (!tu_fill_try(live[k], size[k], seed_of(k)))
                return (void *)1;
        }
    }
    for (int k = 0; k < 16; k++)
        if (live[k] && vmh_heap_free(live[k], NULL, false) != CUDA_SUCCESS)
            return (void *)1;
    return NULL;
}

/* Every thread packs large requests: a thread whose new extent was taken by another thread
 * before it could use it must make another, not report out of memory. */
static void *packed_churn(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    sim_set_current_device(0);
    CUdeviceptr live[8] = {0};
    for (int i = 0; i < 300 / TU_SLOWDOWN; i++) {
        int k = (int)(rand_r(&seed) % 8);
        if (live[k]) {
            if (vmh_heap_free(live[k], NULL, false) != CUDA_SUCCESS)
                return (void *)1;
            live[k] = 0;
        } else {
            size_t size = (size_t)(rand_r(&seed) % (48 * MiB)) + 1;
            if (vmh_heap_alloc(size, &live[k]) != CUDA_SUCCESS)
                return (void *)2;
        }
    }
    for (int k = 0; k < 8; k++)
        if (live[k] && vmh_heap_free(live[k], NULL, false) != CUDA_SUCCESS)
            return (void *)1;
    return NULL;
}

static void threads_pack_large_requests_without_spurious_oom(void **state)
{
    (void)state;
    tu_opt.pack_below = 512 * MiB;
    tu_configure();
    pthread_t t[16];
    for (uintptr_t i = 0; i < 16; i++)
        assert_int_equal(pthread_create(&t[i], NULL, packed_churn, (void *)(i + 1)), 0);
    for (int i = 0; i < 16; i++) {
        void *bad;
        pthread_join(t[i], &bad);
        assert_null(bad);
    }
}

static void threads_churn_with_data_checks(void **state)
{
    (void)state;
    pthread_t t[THREADS];
    for (uintptr_t i = 0; i < THREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, churn, (void *)(i + 1)), 0);
    for (int i = 0; i < THREADS; i++) {
        void *bad;
        pthread_join(t[i], &bad);
        assert_null(bad);
    }
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_requested), 0);
}


/* ---- carved shards ---- */

/* Blocks handed between threads: allocated on one, checked and freed on another. */
typedef struct handed {
    CUdeviceptr p;
    size_t size;
    unsigned seed;
} handed_t;

#define HAND_SLOTS 64
static pthread_mutex_t hand_lock = PTHREAD_MUTEX_INITIALIZER;
static handed_t hand[HAND_SLOTS];
static _Atomic unsigned hand_seed;

static void *sharded_churn(void *arg)
{
    unsigned rs = (unsigned)(uintptr_t)arg;
    sim_set_current_device(0);
    handed_t own[8] = {{0}};
    for (int i = 0; i < 300 / TU_SLOWDOWN; i++) {
        unsigned r = rand_r(&rs);
        int k = (int)(r % 8);
        if (own[k].p) {
            /* Check it, then either free it here or hand it to another thread. */
            if (!tu_check(own[k].p, own[k].size, own[k].seed))
                return (void *)1;
            bool handed = false;
            if (r & 0x100) {
                pthread_mutex_lock(&hand_lock);
                int slot = (int)((r >> 9) % HAND_SLOTS);
                if (!hand[slot].p) {
                    hand[slot] = own[k];
                    handed = true;
                }
                pthread_mutex_unlock(&hand_lock);
            }
            if (!handed && vmh_heap_free(own[k].p, NULL, (r & 0x200) != 0) != CUDA_SUCCESS)
                return (void *)1;
            own[k].p = 0;
        } else {
            own[k].size = r % 5 == 0 ? (size_t)(r % (3 * MiB)) + 1 : (size_t)(r % 40000) + 1;
            own[k].seed = atomic_fetch_add(&hand_seed, 1) * 2654435761u;
            if (vmh_heap_alloc(own[k].size, &own[k].p) != CUDA_SUCCESS)
                return (void *)2;
            if (!tu_fill_try(own[k].p, own[k].size, own[k].seed))
                return (void *)3;
        }
        /* Take a block another thread allocated: check and free it here. */
        handed_t h = {0};
        pthread_mutex_lock(&hand_lock);
        int slot = (int)(rand_r(&rs) % HAND_SLOTS);
        h = hand[slot];
        hand[slot].p = 0;
        pthread_mutex_unlock(&hand_lock);
        if (h.p) {
            vmh_buffer_info_t info;
            if (!vmh_heap_find(h.p, &info) || !info.carved || info.size != h.size ||
                !tu_check(h.p, h.size, h.seed))
                return (void *)4;
            if (vmh_heap_free(h.p, NULL, false) != CUDA_SUCCESS)
                return (void *)5;
        }
    }
    for (int k = 0; k < 8; k++)
        if (own[k].p && (!tu_check(own[k].p, own[k].size, own[k].seed) ||
                         vmh_heap_free(own[k].p, NULL, false) != CUDA_SUCCESS))
            return (void *)6;
    return NULL;
}

/* 16 threads over the 8 shards, everything packed, blocks freed by other threads than the
 * ones that allocated them (so in shards that are not the freeing thread's). */
static void threads_churn_across_shards(void **state)
{
    (void)state;
    tu_opt.pack_below = 512 * MiB;
    tu_configure();
    memset(hand, 0, sizeof hand);
    pthread_t t[16];
    for (uintptr_t i = 0; i < 16; i++)
        assert_int_equal(pthread_create(&t[i], NULL, sharded_churn, (void *)(i + 101)), 0);
    for (int i = 0; i < 16; i++) {
        void *bad;
        pthread_join(t[i], &bad);
        assert_null(bad);
    }
    for (int i = 0; i < HAND_SLOTS; i++) {
        if (!hand[i].p)
            continue;
        assert_true(tu_check(hand[i].p, hand[i].size, hand[i].seed));
        assert_int_equal(vmh_heap_free(hand[i].p, NULL, false), CUDA_SUCCESS);
    }
    assert_int_equal(vmh_gauge_get(VMH_STAT_bytes_requested), 0);
}

/* Runs one step on a thread of its own (a new thread: a shard of its own, in turn). */
typedef struct step {
    enum { STEP_ALLOC, STEP_FREE, STEP_SHARD } op;
    size_t size;
    CUdeviceptr p;
    unsigned shard;
    CUresult rc;
} step_t;

static void *step_run(void *arg)
{
    step_t *st = arg;
    sim_set_current_device(0);
    st->shard = vmh_heap_thread_shard();
    if (st->op == STEP_ALLOC)
        st->rc = vmh_heap_alloc(st->size, &st->p);
    else if (st->op == STEP_FREE)
        st->rc = vmh_heap_free(st->p, NULL, false);
    return NULL;
}

static step_t step_on_new_thread(step_t st)
{
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, step_run, &st), 0);
    pthread_join(t, NULL);
    return st;
}

/* Frugality: free space in another thread's shard is used before any memory is made, and a
 * block freed on one thread is reused, after one synchronize, by another thread in another
 * shard when every shard is full. */
static void shards_reuse_each_others_space(void **state)
{
    (void)state;
    tu_opt.pack_below = 512 * MiB;
    tu_configure();
    /* A thread whose shard has nothing takes room from another shard. */
    step_t a = step_on_new_thread((step_t){.op = STEP_ALLOC, .size = 1000});
    assert_int_equal(a.rc, CUDA_SUCCESS);
    sim_reset_counters();
    step_t b = step_on_new_thread((step_t){.op = STEP_ALLOC, .size = 1000});
    assert_int_equal(b.rc, CUDA_SUCCESS);
    assert_int_not_equal(a.shard, b.shard);
    assert_int_equal(sim_calls("cuMemCreate"), 0);
    assert_int_equal(vmh_heap_free(a.p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(b.p, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();

    /* 64 MiB requests: each fills an extent of its own exactly. One per shard, on 8 threads
     * that take the 8 shards in turn. */
    step_t full[8];
    for (int i = 0; i < 8; i++) {
        full[i] = step_on_new_thread((step_t){.op = STEP_ALLOC, .size = 64 * MiB});
        assert_int_equal(full[i].rc, CUDA_SUCCESS);
        tu_fill(full[i].p, 4096, (unsigned)i);
    }
    /* eight extents, each of two 32 MiB chunks (carved_place.c's OWN_CHUNK_MIN: an extent made for
     * one request is chunked finer, so that its idle chunks can go back) */
    assert_int_equal(sim_live_allocations(), 16);
    /* The first one is freed (on yet another thread); a thread in another shard asks for the
     * same size while every shard is full. */
    step_t f = step_on_new_thread((step_t){.op = STEP_FREE, .p = full[0].p});
    assert_int_equal(f.rc, CUDA_SUCCESS);
    sim_reset_counters();
    step_t q;
    do { /* a thread whose shard is not the freed block's */
        q = step_on_new_thread((step_t){.op = STEP_SHARD});
    } while (q.shard == full[0].shard || q.shard == f.shard);
    q = step_on_new_thread((step_t){.op = STEP_ALLOC, .size = 64 * MiB});
    assert_int_equal(q.rc, CUDA_SUCCESS);
    assert_int_not_equal(q.shard, full[0].shard);
    assert_int_equal(q.p, full[0].p); /* reused, not grown */
    assert_int_equal(sim_calls("cuMemCreate"), 0);
    assert_int_equal(sim_calls("cuCtxSynchronize"), 1);
    for (int i = 1; i < 8; i++) {
        assert_true(tu_check(full[i].p, 4096, (unsigned)i));
        assert_int_equal(vmh_heap_free(full[i].p, NULL, false), CUDA_SUCCESS);
    }
    assert_int_equal(vmh_heap_free(q.p, NULL, false), CUDA_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(threads_churn_with_data_checks, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(threads_pack_large_requests_without_spurious_oom,
                                        tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(threads_churn_across_shards, tu_setup, tu_teardown),
        cmocka_unit_test_setup_teardown(shards_reuse_each_others_space, tu_setup, tu_teardown),
    };
    return cmocka_run_group_tests_name("heap_threads", tests, NULL, NULL);
}
